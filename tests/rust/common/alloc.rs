//! A counting global allocator: bytes live and their peak, per thread, so that a measurement
//! is not disturbed by tests running on other threads. A test binary installs it with
//! `#[global_allocator] static ALLOC: CountingAlloc = CountingAlloc;`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

pub struct CountingAlloc;

thread_local! {
    // Const-initialised cells without destructors: usable from inside the allocator, at any
    // point of a thread's life. Signed, since a thread may free what another allocated.
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn grow(n: usize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get().wrapping_add(n as isize);
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

fn shrink(n: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().wrapping_sub(n as isize)));
}

// SAFETY: every call forwards to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        shrink(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            // Counted as the new block allocated before the old one is freed (the worst case).
            grow(new_size);
            shrink(layout.size());
        }
        p
    }
}

/// Runs `f` and returns its result with the most bytes it held live at once on this thread.
pub fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (out, peak.saturating_sub(start).max(0) as usize)
}

/// The bound on memory for an input of `len` bytes: 10x its size plus 64 MB.
pub fn memory_bound(len: usize) -> usize {
    len.saturating_mul(10).saturating_add(64 << 20)
}
