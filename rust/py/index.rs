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
use crate::report::index::{self, FileStat, Plan, Sig, Slot, Stored};
use crate::scan::{self, is_url, with_pool, AdapterResult, Target};

/// A stored row as `SELECT path, entry` gives it.
type StoredRow = (Py<PyAny>, Py<PyAny>);

/// A row to write: (path, class id or None, entry).
type Upsert<'py> = (Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>, Bound<'py, PyBytes>);

/// Classifications to write: (id, blob).
type Classes<'py> = Vec<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>;

/// One rescan: `IndexScan(paths, ...)` walks; then `plan(stored, trust)`, `read(...)` and `result(bodies)`.
#[pyclass(module = "lorafast._core")]
pub(super) struct IndexScan {
    roots: Vec<PathBuf>,
    threads: Option<usize>,
    ropts: RemoteOptions,
    walked: Vec<(Result<Target, Error>, Sig)>,
    stored: Vec<StoredRow>,
    plan: Plan,
    fresh: Vec<Result<AdapterResult, Error>>,
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

/// The stored rows. A value that is not bytes (a foreign writer's) reads as empty: such a row never matches
/// a signature, so its adapter is read again.
fn views<'a>(py: Python<'a>, stored: &'a [StoredRow]) -> Vec<Stored<'a>> {
    let bytes = |o: &'a Py<PyAny>| o.cast_bound::<PyBytes>(py).map_or(&[][..], |b| b.as_bytes());
    stored
        .iter()
        .map(|(path, entry)| Stored::parse(bytes(path), bytes(entry)))
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
            stored: Vec::new(),
            plan: Plan::default(),
            fresh: Vec::new(),
        })
    }

    /// Compares the walk with the `stored` rows (`trust` false: every adapter is read). A ValueError when
    /// a row to move does not decode.
    fn plan(&mut self, py: Python<'_>, stored: Vec<StoredRow>, trust: bool) -> PyResult<()> {
        let walked = std::mem::take(&mut self.walked);
        let roots = &self.roots;
        let plan = {
            let views = views(py, &stored);
            py.detach(|| index::plan(walked, &views, roots, trust))
        };
        self.plan = plan.map_err(PyValueError::new_err)?;
        self.stored = stored;
        Ok(())
    }

    /// Adapters to read.
    #[getter]
    fn reads(&self) -> usize {
        self.plan.to_read.len()
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

    /// The ids of the classifications of the stored rows that are written over or removed, each once.
    #[getter]
    fn stale<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        self.plan.stale.iter().map(|id| PyBytes::new(py, id)).collect()
    }

    /// The ids of the stored classifications that reused rows name, each once.
    fn class_ids<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        let views = views(py, &self.stored);
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

    /// Reads the adapters the plan names and encodes them: (the rows to write, read and moved ones;
    /// the new rows' classifications as (id, blob), each once).
    fn read<'py>(
        &mut self,
        py: Python<'py>,
        mode: ReadMode,
        content_hash: bool,
        progress: bool,
    ) -> PyResult<(Vec<Upsert<'py>>, Classes<'py>)> {
        let targets: Vec<Target> = self.plan.to_read.iter().map(|(t, _)| t.clone()).collect();
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
        let mut upserts: Vec<Upsert<'py>> = Vec::with_capacity(rows.len() + self.plan.moved.len());
        for (((t, sig), row), id) in self.plan.to_read.iter().zip(&fresh.rows).zip(&fresh.class_ids) {
            if let Some(sig) = sig {
                let id = id.as_ref().map(|id| &id[..]);
                upserts.push((
                    b(t.path.as_os_str().as_bytes()),
                    id.map(b),
                    b(&index::entry(sig, id, row)),
                ));
            }
        }
        for m in &self.plan.moved {
            let id = m.class.as_deref();
            upserts.push((b(&m.path), id.map(b), b(&index::entry(&m.signature, id, &m.row))));
        }
        let classes = fresh.classes.iter().map(|(id, blob)| (b(id), b(blob))).collect();
        self.fresh = rows;
        Ok((upserts, classes))
    }

    /// The report: every row in walk order, stored ones decoded with `bodies` (the blobs of `class_ids`,
    /// by id). A ValueError when a stored row or classification does not decode.
    fn result(&mut self, py: Python<'_>, bodies: &Bound<'_, PyDict>) -> PyResult<ScanResult> {
        let plan = std::mem::take(&mut self.plan);
        let fresh = std::mem::take(&mut self.fresh);
        let stored = std::mem::take(&mut self.stored);
        let pairs = bodies
            .iter()
            .map(|(k, v)| Ok((k.cast_into::<PyBytes>()?, v.cast_into::<PyBytes>()?)))
            .collect::<PyResult<Vec<_>>>()?;
        let bodies = pairs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())).collect();
        let views = views(py, &stored);
        let threads = self.threads;
        let rows = py
            .detach(|| index::assemble(plan, &views, fresh, &bodies, threads))
            .map_err(PyValueError::new_err)?;
        Ok(ScanResult { rows })
    }
}
