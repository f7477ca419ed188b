//! The core's thread pools: sized by `LORAFAST_NUM_THREADS` or the cores, and safe in a forked child.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Set in a forked child: the pools' threads did not survive the fork (see `with_pool`).
static FORKED: AtomicBool = AtomicBool::new(false);
static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();

extern "C" fn child_after_fork() {
    FORKED.store(true, Ordering::SeqCst);
}

/// Registers the fork guard; called once when the module loads.
pub fn install_fork_guard() {
    // SAFETY: registers a plain function that only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::pthread_atfork(None, None, Some(child_after_fork));
    }
}

/// The most threads a pool has, whatever is asked: a pool of thousands takes seconds to make and
/// end, and reading headers gains nothing from that many.
pub const MAX_THREADS: usize = 256;

/// Threads to use: `LORAFAST_NUM_THREADS`, else the available cores (at most `MAX_THREADS`).
pub fn default_threads() -> usize {
    std::env::var("LORAFAST_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .min(MAX_THREADS)
}

fn build_pool(threads: usize) -> Option<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("lorafast-{i}"))
        .build()
        .ok()
}

/// Runs `f` on a pool of `threads`, at most `MAX_THREADS` (None: the shared default pool). Every
/// parallel loop of the core runs inside this, never on rayon's global pool.
///
/// In a forked child the inherited pools have no threads, and waiting on one hangs: there `f`
/// runs on a pool made for the call (inline if none can be made). Not inline on the caller's
/// thread: a parallel loop outside any pool goes to rayon's global one, which hangs the same way
/// once the parent has used it.
pub fn with_pool<R: Send>(threads: Option<usize>, f: impl FnOnce() -> R + Send) -> R {
    let threads = threads.map(|n| n.clamp(1, MAX_THREADS));
    let own = FORKED.load(Ordering::SeqCst) || threads.is_some_and(|n| n != default_threads());
    let made;
    let pool = if own {
        made = build_pool(threads.unwrap_or_else(default_threads));
        made.as_ref()
    } else {
        POOL.get_or_init(|| build_pool(default_threads())).as_ref()
    };
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_has_at_most_max_threads() {
        assert_eq!(with_pool(Some(1000), rayon::current_num_threads), MAX_THREADS);
        assert_eq!(with_pool(Some(3), rayon::current_num_threads), 3);
        assert!(default_threads() <= MAX_THREADS);
    }
}
