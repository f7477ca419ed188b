//! Parse + classify one adapter many times; run under `valgrind --tool=callgrind` for
//! load-independent instruction counts, or plainly for a rough time per adapter:
//! `cargo bench --no-default-features --bench parse -- DIR [ITERATIONS] [--remembered]`.
//! Every iteration parses and classifies anew unless `--remembered` is given, which measures the
//! path of an adapter whose header the scan has seen before (`_core::memo`).
use std::path::PathBuf;
use std::time::Instant;

use _core::scan::{load, locate, ScanOptions};

fn main() {
    let args: Vec<String> = std::env::args().filter(|a| a != "--bench").collect();
    let dir = PathBuf::from(args.get(1).expect("usage: parse DIR [ITERATIONS]"));
    let iterations: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1000);
    let target = locate(&dir).expect("an adapter");
    let opts = ScanOptions {
        fresh: !args.iter().any(|a| a == "--remembered"),
        ..ScanOptions::default()
    };
    let start = Instant::now();
    let mut rank = 0;
    for _ in 0..iterations {
        rank += load(target.clone(), opts).expect("loads").class.rank;
    }
    let per = start.elapsed().as_secs_f64() / iterations as f64;
    println!("{:.1} us per adapter (rank sum {rank})", per * 1e6);
}
