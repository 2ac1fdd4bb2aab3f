//! Helpers shared by the fuzz targets in `fuzz_targets/`: an allocation meter, so that a target
//! can assert that a decoder's memory stays proportional to its input, and small input
//! splitters.
//!
//! Built only by `scripts/fuzz.sh` (or `cargo fuzz`); see `docs/fuzzing.md`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting live bytes and their peak since [`peak_bytes_during`] began.
pub struct Meter;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes, Ordering::Relaxed);
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the
// counters are only bookkeeping.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Meter {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static METER: Meter = Meter;

/// Runs `f` and returns its result with the most bytes that were live at once during it, over
/// what was live when it started (the fuzz targets are single-threaded).
pub fn peak_bytes_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (out, peak)
}

/// Splits `data` into chunks at the cut points its first bytes choose: the first byte says how
/// many cuts (up to 7), each next byte where (as a fraction of the rest). Returns the cut
/// positions (sorted, within the body) and the body.
pub fn chunking(data: &[u8]) -> (Vec<usize>, &[u8]) {
    let Some((&n, rest)) = data.split_first() else {
        return (Vec::new(), data);
    };
    let n = usize::from(n % 8).min(rest.len());
    let (cuts, body) = rest.split_at(n);
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|&c| usize::from(c) * body.len() / 256)
        .collect();
    at.sort_unstable();
    (at, body)
}

/// The chunks of `body` between `cuts` (from [`chunking`]); empty chunks included.
pub fn chunks<'a>(body: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(cuts.len() + 1);
    let mut from = 0;
    for &c in cuts {
        out.push(&body[from..c]);
        from = c;
    }
    out.push(&body[from..]);
    out
}
