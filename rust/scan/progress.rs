//! The progress bar a scan draws on stderr.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// What a progress bar shows: adapters done, of about `total`.
#[derive(Default)]
pub(crate) struct Progress {
    pub count: AtomicUsize,
    pub total: AtomicUsize,
}

/// Runs `work`, with a bar on stderr refreshed from its `Progress` by a side thread when `show`.
pub(crate) fn with_progress<R>(show: bool, work: impl FnOnce(&Progress) -> R) -> R {
    let done = Progress::default();
    if !show {
        return work(&done);
    }
    let draw = |start: Instant| {
        let count = done.count.load(Ordering::Relaxed);
        // Sub-folders found on the way can add adapters to the first estimate.
        draw_progress(count, done.total.load(Ordering::Relaxed).max(count), start.elapsed());
    };
    // The drawer waits on a channel, not a sleep, so the end of the work wakes it at once.
    let (finished, wait) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            let start = Instant::now();
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(Duration::from_millis(100)) {
                draw(start);
            }
            draw(start);
            eprintln!();
        });
        let out = work(&done);
        drop(finished);
        out
    })
}

#[allow(clippy::cast_precision_loss)]
fn draw_progress(done: usize, total: usize, elapsed: Duration) {
    let width = 30;
    let filled = (done * width).checked_div(total).unwrap_or(width);
    let rate = done as f64 / elapsed.as_secs_f64().max(1e-3);
    eprint!(
        "\rscanning [{}{}] {done}/{total} adapters, {rate:.0}/s",
        "#".repeat(filled),
        "-".repeat(width - filled)
    );
}
