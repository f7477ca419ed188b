//! Parse + classify adapters many times, next to two references measured in the same run:
//!
//! - `lorafast`: `scan::load`, what one scan thread does per adapter (open and read the config,
//!   open/fstat/pread the weights' header, parse, validate, classify). Every iteration parses and
//!   classifies anew unless `--memo` is given: then the scan's memory of headers (`_core::scan::memo`) is
//!   consulted and filled as in a scan, which on one adapter measures the remembered path, and on
//!   a folder of more than 16 distinct adapters the real path of a fresh fleet (a miss each time).
//! - `crate`: the `safetensors` crate's own header parse, the Rust baseline: open, mmap,
//!   `SafeTensors::read_metadata` (serde_json + its validation), then the largest lora_A rank over
//!   its tensors (what `benches/bench_scan.py`'s Python baselines compute). It does not read the
//!   config and does not classify.
//! - `scan`: what `lorafast.scan(DIR, threads=1)` does in Rust: `scan::scan_paths` on a pool of
//!   one thread (the walk, each load, the rows in order), its rows then dropped. Each round scans
//!   the whole folder, so ITERATIONS is rounded to whole folders.
//! - `floor`: the same syscalls as `lorafast` and nothing else: the config read whole, the
//!   weights opened and checked by `fstat`, the header read by `pread` into a reused buffer
//!   (`header::read_header_from`). No parsing: no user-space code can go faster on one thread.
//!
//! Usage: `cargo bench --no-default-features --bench parse -- DIR [ITERATIONS] [--memo] [--modules]
//! [--only lorafast|scan|crate|floor] [--callgrind]`. DIR is one adapter (a PEFT folder or a
//! `.safetensors` file) or a folder of adapters, taken in turn (ITERATIONS in all, per round).
//! `--modules` also builds each module's record with owned names (`ScanOptions::keep_modules`), as
//! `lorafast.scan` from Python does; without it, only the row.
//! `make_dense(root, n, unique=True)` from `benches/bench_scan.py` writes its "unique" set.
//!
//! Timings: five rounds of ITERATIONS per method, interleaved, best round kept; lorafast's rate is
//! printed as a fraction of the floor's. On a loaded machine these move from run to run.
//!
//! Instructions: `--callgrind` reruns this binary under `valgrind --tool=callgrind` once per
//! method, collecting only inside that method's loop (`--toggle-collect`), and prints the
//! instructions per adapter (total / iterations, at most 200 iterations): load-independent, so
//! the figure to compare changes by. `scan` runs on a pool thread, outside any function of this
//! file, so it is counted whole, once for one round and once for two: the difference is one
//! round's, and divided by the folder's adapters, the figure per adapter. By hand, for one method:
//! `valgrind --tool=callgrind --toggle-collect='*parse::run_lorafast*' target/release/deps/parse-HASH DIR 200 --only lorafast`
//! then `callgrind_annotate callgrind.out.PID` for the per-function costs (Ir / 200 per adapter).
use std::fs;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use _core::header::{read_header_from, ReadMode};
use _core::open::open_nonblocking;
use _core::scan::{discover, load, locate, scan_paths, ScanOptions, Target};

const METHODS: [&str; 4] = ["lorafast", "scan", "crate", "floor"];

#[inline(never)]
fn run_lorafast(targets: &[Target], opts: ScanOptions, iterations: usize) -> u64 {
    let mut rank = 0;
    for target in targets.iter().cycle().take(iterations) {
        rank += load(target.clone(), opts).expect("loads").class.rank;
    }
    rank
}

/// Whole scans of `dir` on one thread: `rounds` of them.
#[inline(never)]
fn run_scan(dir: &Path, opts: ScanOptions, rounds: usize) -> u64 {
    let mut rank = 0;
    for _ in 0..rounds {
        let rows = scan_paths(&[dir.to_path_buf()], true, opts, Some(1), false);
        rank += rows.iter().map(|r| r.as_ref().expect("loads").class.rank).sum::<u64>();
    }
    rank
}

#[inline(never)]
fn run_crate(targets: &[Target], iterations: usize) -> u64 {
    let mut rank = 0;
    for target in targets.iter().cycle().take(iterations) {
        let file = fs::File::open(&target.weights).expect("opens");
        // SAFETY: a read-only map of a file nothing changes during the benchmark.
        let map = unsafe { memmap2::Mmap::map(&file) }.expect("maps");
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&map).expect("the crate accepts it");
        let mut max = 0;
        for (name, info) in metadata.tensors() {
            if name.contains(".lora_A.") {
                let shape = &info.shape;
                max = max.max(if shape.len() == 3 { shape[1] } else { shape[0] } as u64);
            }
        }
        rank += max;
    }
    rank
}

#[inline(never)]
fn run_floor(targets: &[Target], iterations: usize) -> u64 {
    let mut buf = Vec::new();
    let mut total = 0;
    for target in targets.iter().cycle().take(iterations) {
        if let Some(config) = &target.config {
            total += fs::read(config).expect("reads the config").len() as u64;
        }
        let (file, meta) = open_nonblocking(&target.weights).expect("opens");
        let (_, n) = read_header_from(&file, &target.weights, meta.len(), ReadMode::Pread, &mut buf).expect("reads");
        total += black_box(&buf)[8 + n / 2] as u64 + n as u64;
    }
    total
}

/// Whole folders in `iterations` adapters (at least one).
fn rounds(targets: &[Target], iterations: usize) -> usize {
    (iterations / targets.len()).max(1)
}

/// Runs `method` over `iterations` adapters of `dir` (`targets`); returns a checksum.
fn run(method: &str, dir: &Path, targets: &[Target], opts: ScanOptions, iterations: usize) -> u64 {
    match method {
        "lorafast" => run_lorafast(targets, opts, iterations),
        "scan" => run_scan(dir, opts, rounds(targets, iterations)),
        "crate" => run_crate(targets, iterations),
        "floor" => run_floor(targets, iterations),
        other => panic!("unknown method {other:?} (lorafast, scan, crate or floor)"),
    }
}

/// Instructions per adapter of `method`, from callgrind's totals for the method's loop alone
/// (`scan`: the difference between two rounds and one, per adapter of the folder).
fn callgrind(method: &str, dir: &Path, targets: usize, iterations: usize, memo: bool, modules: bool) -> Option<f64> {
    if method == "scan" {
        let one = callgrind_total(method, dir, targets, memo, modules)?;
        let two = callgrind_total(method, dir, 2 * targets, memo, modules)?;
        return Some((two - one) / targets as f64);
    }
    Some(callgrind_total(method, dir, iterations, memo, modules)? / iterations as f64)
}

/// Callgrind's instruction total for one run of `method` (only its loop, except for `scan`).
fn callgrind_total(method: &str, dir: &Path, iterations: usize, memo: bool, modules: bool) -> Option<f64> {
    let out = std::env::temp_dir().join(format!("lorafast-parse-{}-{method}.callgrind", std::process::id()));
    let exe = std::env::current_exe().ok()?;
    let mut cmd = Command::new("valgrind");
    cmd.arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()));
    if method != "scan" {
        cmd.arg(format!("--toggle-collect=*parse::run_{method}*"));
    }
    cmd.arg(exe)
        .arg(dir)
        .arg(iterations.to_string())
        .args(["--only", method]);
    if memo {
        cmd.arg("--memo");
    }
    if modules {
        cmd.arg("--modules");
    }
    let status = cmd.output().ok()?.status;
    let text = fs::read_to_string(&out).ok();
    let _ = fs::remove_file(&out);
    if !status.success() {
        return None;
    }
    text?
        .lines()
        .find_map(|l| l.strip_prefix("totals:").or_else(|| l.strip_prefix("summary:")))?
        .split_whitespace()
        .next()?
        .parse::<f64>()
        .ok()
}

/// Adapters `run` reads for `iterations`: whole folders for `scan`.
fn done(method: &str, targets: &[Target], iterations: usize) -> usize {
    if method == "scan" {
        rounds(targets, iterations) * targets.len()
    } else {
        iterations
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let mut positional = Vec::new();
    let (mut only, mut memo, mut with_callgrind, mut modules) = (None, false, false, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--memo" | "--remembered" => memo = true,
            "--callgrind" => with_callgrind = true,
            "--modules" => modules = true,
            "--only" => only = it.next().cloned(),
            _ => positional.push(a.clone()),
        }
    }
    let dir =
        PathBuf::from(positional.first().expect(
            "usage: parse DIR [ITERATIONS] [--memo] [--modules] [--only lorafast|scan|crate|floor] [--callgrind]",
        ));
    let iterations: usize = positional.get(1).and_then(|s| s.parse().ok()).unwrap_or(1000);
    // One adapter, or every adapter in a folder of them (a `bench_scan.py` set), in a cycle.
    let targets: Vec<Target> = match locate(&dir) {
        Ok(target) => vec![target],
        Err(_) => discover(std::slice::from_ref(&dir), true)
            .into_iter()
            .filter_map(Result::ok)
            .collect(),
    };
    assert!(!targets.is_empty(), "no adapter in {}", dir.display());
    let opts = ScanOptions {
        fresh: !memo,
        keep_modules: modules,
        ..ScanOptions::default()
    };
    if let Some(method) = only {
        // One method, once: the form callgrind runs.
        let start = Instant::now();
        let check = run(&method, &dir, &targets, opts, iterations);
        let per = start.elapsed().as_secs_f64() / done(&method, &targets, iterations) as f64;
        println!("{method}: {:.1} us per adapter (check {check})", per * 1e6);
        return;
    }
    let mut best = [f64::INFINITY; METHODS.len()];
    for m in METHODS {
        run(m, &dir, &targets, opts, iterations.div_ceil(10)); // warm-up: page cache, allocator
    }
    for _ in 0..5 {
        for (i, m) in METHODS.iter().enumerate() {
            let start = Instant::now();
            black_box(run(m, &dir, &targets, opts, iterations));
            best[i] = best[i].min(start.elapsed().as_secs_f64() / done(m, &targets, iterations) as f64);
        }
    }
    let floor = best[METHODS.len() - 1];
    let path = if memo {
        "memo on"
    } else {
        "memo off: every header parsed anew"
    };
    let path = if modules {
        format!("{path}, module records kept")
    } else {
        path.to_owned()
    };
    println!(
        "{} ({} adapters, {path}, 1 thread, best of 5 x {iterations})",
        dir.display(),
        targets.len()
    );
    println!(
        "{:<10} {:>12} {:>14} {:>10}",
        "method", "us/adapter", "adapters/s", "of floor"
    );
    for (i, m) in METHODS.iter().enumerate() {
        println!(
            "{m:<10} {:>12.2} {:>14.0} {:>9.0}%",
            best[i] * 1e6,
            1.0 / best[i],
            100.0 * floor / best[i]
        );
    }
    if with_callgrind {
        let n = iterations.clamp(1, 200);
        println!("callgrind, instructions per adapter ({n} iterations each):");
        for m in METHODS {
            match callgrind(m, &dir, targets.len(), n, memo, modules) {
                Some(ir) => println!("{m:<10} {ir:>12.0}"),
                None => println!("{m:<10} {:>12}", "(valgrind failed or is missing)"),
            }
        }
    }
}
