//! `lorafast.Index`'s rescan (`crate::report::index`), as one `IndexScan` per scan: the walk with each adapter's
//! signature, the plan against the stored rows, the reads, then the report. The index's SQLite file is
//! Python's (the stdlib `sqlite3`); everything per row is here, with the GIL released.

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use rayon::prelude::*;

use super::args::{load_options, remote_options, Concurrency, Timeout};
use super::detach_contained;
use super::report::ScanResult;
use crate::error::Error;
use crate::header::ReadMode;
use crate::remote::{self, RemoteOptions, Stat};
use crate::report::index::{self, FileStat, Plan, Sig, Slot};
use crate::report::index_chunks::{self, ChunkWrite, NewRow, Rows};
use crate::scan::{self, is_url, with_pool, AdapterResult, Target};

/// A stored chunk as `SELECT id, body FROM chunks ORDER BY id` gives it.
type StoredChunk = (i64, Py<PyAny>);

/// A chunk to write: (the id it replaces or None, its body or None to delete it, the classification ids its
/// rows name concatenated, the ids of its new rows' classifications).
type Write<'py> = (
    Option<i64>,
    Option<Bound<'py, PyBytes>>,
    Bound<'py, PyBytes>,
    Vec<Bound<'py, PyBytes>>,
);

/// Classifications to write: (id, blob).
type Classes<'py> = Vec<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>;

/// One rescan: `IndexScan(paths, ...)` walks; then `plan(stored, trust)`, `read(...)` and `result(bodies)`.
#[pyclass(module = "lorafast._core")]
pub(super) struct IndexScan {
    roots: Vec<PathBuf>,
    threads: Option<usize>,
    ropts: RemoteOptions,
    walked: Vec<(Result<Target, Error>, Sig)>,
    /// The stored chunks' ids, and their bodies decompressed.
    chunk_ids: Vec<i64>,
    chunks: Vec<Vec<u8>>,
    plan: Plan,
    fresh: Vec<Result<AdapterResult, Error>>,
    /// The rows `read` encoded (read and moved ones), for `writes`.
    new_rows: Vec<NewRow>,
    /// How many adapters the plan reads (`read` takes them out of it).
    reads: usize,
}

/// What a rescan compares for one discovered adapter: local files by their `stat` (`weights` and `config`:
/// what discovery got, or None to `stat` here), remote ones as the walk's listing (or HEAD) said. A file that
/// cannot be stated, or a store that said neither an ETag nor a last-modified time, gives no signature.
fn sign_local(t: &Target, weights: Option<fs::Metadata>, config: Option<fs::Metadata>, context: &[u8]) -> Sig {
    let stat = |m: Option<fs::Metadata>, path: &Path| m.map_or_else(|| FileStat::local(path), |m| Ok(FileStat::of(&m)));
    let config = t.config.as_deref().map(|c| stat(config, c)).transpose();
    match (stat(weights, &t.weights), config) {
        (Ok(w), Ok(c)) => Sig::Known(index::signature(t, &w, c.as_ref(), context)),
        _ => Sig::Unknown,
    }
}

fn sign_remote(t: &Target, weights: &Stat, config: &Stat, context: &[u8]) -> Sig {
    if *weights == Stat::Missing || *config == Stat::Missing {
        return Sig::Missing;
    }
    if !is_url(&t.weights.to_string_lossy()) {
        return sign_local(t, None, None, context);
    }
    let remote = |s: &Stat| match s {
        Stat::Found(o) => FileStat::remote(o),
        _ => None,
    };
    let stats = match (remote(weights), &t.config) {
        (Some(w), None) => Some((w, None)),
        (Some(w), Some(_)) => remote(config).map(|c| (w, Some(c))),
        (None, _) => None,
    };
    match stats {
        Some((w, c)) => Sig::Known(index::signature(t, &w, c.as_ref(), context)),
        None => Sig::Unknown,
    }
}

/// The walk, each adapter signed. Local inputs alone: discovery's own `stat`s of each PEFT folder's files are
/// its signature's; with URLs, the session's discovery (listing what it can) and local files stated after.
fn walk(
    paths: &[PathBuf],
    recursive: bool,
    threads: Option<usize>,
    ropts: &RemoteOptions,
    context: &[u8],
) -> Vec<(Result<Target, Error>, Sig)> {
    if !paths.iter().any(|p| is_url(&p.to_string_lossy())) {
        return with_pool(threads, || {
            scan::discover_stated(paths, recursive)
                .into_par_iter()
                .with_min_len(64)
                .map(|r| match r {
                    Ok((t, w, c)) => {
                        let sig = sign_local(&t, w, c, context);
                        (Ok(t), sig)
                    }
                    Err(e) => (Err(e), Sig::Unknown),
                })
                .collect()
        });
    }
    let found = remote::Session::new(threads, ropts).discover_stat(paths, recursive);
    with_pool(threads, || {
        found
            .into_par_iter()
            .with_min_len(64)
            .map(|(t, w, c)| {
                let sig = t.as_ref().map_or(Sig::Unknown, |t| sign_remote(t, &w, &c, context));
                (t, sig)
            })
            .collect()
    })
}

/// The bytes of stored values. One that is not bytes (a foreign writer's) reads as empty: as a chunk, it is
/// damaged (its adapters are read again, and it is dropped).
fn bodies<'a>(py: Python<'a>, values: impl Iterator<Item = &'a Py<PyAny>>) -> Vec<&'a [u8]> {
    values
        .map(|o| o.cast_bound::<PyBytes>(py).map_or(&[][..], |b| b.as_bytes()))
        .collect()
}

/// The rows of decompressed chunks.
fn chunk_rows(chunks: &[Vec<u8>]) -> Rows<'_> {
    index_chunks::rows(&chunks.iter().map(Vec::as_slice).collect::<Vec<_>>())
}

/// The distinct adapter paths of an index's chunk bodies, sorted (`Index.paths()`).
#[pyfunction]
pub(super) fn index_paths<'py>(py: Python<'py>, chunks: Vec<Py<PyAny>>) -> Vec<Bound<'py, PyBytes>> {
    let bodies = bodies(py, chunks.iter());
    index_chunks::paths(&bodies)
        .into_iter()
        .map(|p| PyBytes::new(py, &p))
        .collect()
}

#[pymethods]
impl IndexScan {
    /// Walks `paths` (the discovery `scan` does) and signs each adapter found; `context` is what else its
    /// row depends on (the read options and the build).
    #[new]
    #[pyo3(signature = (paths, recursive, threads, context, storage_options = None, timeout = None, concurrency = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        paths: Vec<PathBuf>,
        recursive: bool,
        threads: Option<usize>,
        context: &[u8],
        storage_options: Option<Vec<(String, String)>>,
        timeout: Option<Timeout>,
        concurrency: Option<Concurrency>,
    ) -> PyResult<Self> {
        let ropts = remote_options(storage_options, timeout, concurrency);
        let walked = detach_contained(py, Path::new(""), || {
            Ok(walk(&paths, recursive, threads, &ropts, context))
        })?;
        Ok(IndexScan {
            roots: paths,
            threads,
            ropts,
            walked,
            chunk_ids: Vec::new(),
            chunks: Vec::new(),
            plan: Plan::default(),
            fresh: Vec::new(),
            new_rows: Vec::new(),
            reads: 0,
        })
    }

    /// Compares the walk with the rows of the stored `chunks` (`trust` false: every adapter is read). A
    /// ValueError when a row to move does not decode.
    fn plan(&mut self, py: Python<'_>, chunks: Vec<StoredChunk>, trust: bool) -> PyResult<()> {
        let walked = std::mem::take(&mut self.walked);
        let (roots, threads) = (&self.roots, self.threads);
        let blobs = bodies(py, chunks.iter().map(|(_, body)| body));
        let (plan, unpacked) = py.detach(|| {
            let unpacked: Vec<Vec<u8>> =
                with_pool(threads, || blobs.par_iter().map(|b| index_chunks::unpack(b)).collect());
            (index::plan(walked, &chunk_rows(&unpacked).rows, roots, trust), unpacked)
        });
        self.plan = plan.map_err(PyValueError::new_err)?;
        self.reads = self.plan.to_read.len();
        self.chunk_ids = chunks.iter().map(|(id, _)| *id).collect();
        self.chunks = unpacked;
        Ok(())
    }

    /// Adapters to read.
    #[getter]
    fn reads(&self) -> usize {
        self.reads
    }

    /// Adapters new to the index, in walk order.
    #[getter]
    fn added(&self) -> Vec<&OsStr> {
        self.plan.added.iter().map(|p| p.as_os_str()).collect()
    }

    /// Adapters whose files changed, in walk order.
    #[getter]
    fn changed(&self) -> Vec<&OsStr> {
        self.plan.changed.iter().map(|p| p.as_os_str()).collect()
    }

    /// Stored adapters gone from under the scanned paths.
    #[getter]
    fn removed(&self) -> Vec<&OsStr> {
        self.plan.removed.iter().map(|p| p.as_os_str()).collect()
    }

    /// The ids of the stored classifications that reused rows name, each once.
    fn class_ids<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        let rows = chunk_rows(&self.chunks);
        let views = &rows.rows;
        let mut ids: Vec<&[u8]> = self
            .plan
            .slots
            .iter()
            .filter_map(|s| match s {
                Slot::Stored(i) => views[*i].class,
                Slot::Moved(i) => self.plan.moved[*i].class.as_deref(),
                _ => None,
            })
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter().map(|id| PyBytes::new(py, id)).collect()
    }

    /// Reads the adapters the plan names and encodes them, with the moved rows, for `writes`. Returns the
    /// read rows' classifications as (id, blob), each once.
    fn read<'py>(
        &mut self,
        py: Python<'py>,
        mode: ReadMode,
        content_hash: bool,
        progress: bool,
    ) -> PyResult<Classes<'py>> {
        // The targets go to the load (not copies: 20,000 small adapters' paths were 2 ms to copy and free),
        // their paths and signatures stay for the rows to write.
        let mut keys = Vec::with_capacity(self.plan.to_read.len());
        let targets: Vec<Target> = std::mem::take(&mut self.plan.to_read)
            .into_iter()
            .map(|(t, sig)| {
                keys.push((t.path.as_os_str().as_bytes().to_vec(), sig));
                t
            })
            .collect();
        let (threads, ropts) = (self.threads, &self.ropts);
        let (rows, fresh) = if targets.is_empty() {
            Default::default()
        } else {
            detach_contained(py, Path::new(""), || {
                let rows = remote::load_all(
                    targets,
                    load_options(mode, content_hash, false),
                    threads,
                    progress,
                    ropts,
                );
                let fresh = index::encode_rows(&rows, threads);
                Ok((rows, fresh))
            })?
        };
        let b = |v: &[u8]| PyBytes::new(py, v);
        let mut new_rows = Vec::with_capacity(rows.len() + self.plan.moved.len());
        for (((path, sig), row), id) in keys.into_iter().zip(&fresh.rows).zip(&fresh.class_ids) {
            if let Some(sig) = sig {
                let id = id.as_ref().map(|id| &id[..]);
                new_rows.push(NewRow {
                    path,
                    class: id.map(<[u8]>::to_vec),
                    entry: index::entry(&sig, id, row),
                });
            }
        }
        for m in &self.plan.moved {
            let id = m.class.as_deref();
            new_rows.push(NewRow {
                path: m.path.clone(),
                class: m.class.clone(),
                entry: index::entry(&m.signature, id, &m.row),
            });
        }
        let classes = fresh.classes.iter().map(|(id, blob)| (b(id), b(blob))).collect();
        self.fresh = rows;
        self.new_rows = new_rows;
        Ok(classes)
    }

    /// The chunks to write after `read`, `per_chunk` rows at most in each (see `index_chunks::writes`).
    fn writes<'py>(&self, py: Python<'py>, per_chunk: usize) -> Vec<Write<'py>> {
        let writes = py.detach(|| {
            let rows = chunk_rows(&self.chunks);
            with_pool(self.threads, || {
                index_chunks::writes(
                    &self.chunk_ids,
                    &rows,
                    &self.plan.gone,
                    &self.plan.hidden,
                    &self.new_rows,
                    per_chunk,
                )
            })
        });
        let b = |v: &[u8]| PyBytes::new(py, v);
        writes
            .into_iter()
            .map(|w: ChunkWrite<'_>| {
                let new_classes = w.new_classes.iter().map(|id| b(id)).collect();
                (w.id, w.body.as_deref().map(b), b(&w.classes), new_classes)
            })
            .collect()
    }

    /// The report: every row in walk order, stored ones decoded with `bodies` (the blobs of `class_ids`,
    /// by id). A ValueError when a stored row or classification does not decode.
    fn result(&mut self, py: Python<'_>, bodies: &Bound<'_, PyDict>) -> PyResult<ScanResult> {
        let plan = std::mem::take(&mut self.plan);
        let fresh = std::mem::take(&mut self.fresh);
        let chunks = std::mem::take(&mut self.chunks);
        let pairs = bodies
            .iter()
            .map(|(k, v)| Ok((k.cast_into::<PyBytes>()?, v.cast_into::<PyBytes>()?)))
            .collect::<PyResult<Vec<_>>>()?;
        let bodies = pairs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())).collect();
        let stored = chunk_rows(&chunks);
        let threads = self.threads;
        let rows = py
            .detach(|| index::assemble(plan, &stored.rows, fresh, &bodies, threads))
            .map_err(PyValueError::new_err)?;
        Ok(ScanResult { rows })
    }
}
