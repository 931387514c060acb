//! The agent's resident memory: how glibc's allocator is set up for a long-lived daemon
//! with a few threads, and handing freed pages back to the kernel after bursts.
//!
//! Why: glibc gives every thread that allocates its own arena (up to eight per core) and
//! keeps freed memory inside each one. The writer thread, the async workers and the
//! blocking threads of a start-up scan each hold on to their peaks, so an idle agent
//! kept megabytes it no longer used. With one arena and an explicit trim after start-up
//! and after busy periods, the resident set follows the live data instead. Nothing here
//! changes what the agent does, only where freed memory goes.

use std::time::{Duration, Instant};

/// Arenas at most. One: the ledger's and the store's work runs on the writer thread or,
/// when that is idle, on the async worker that took the request (see `writer`), so a
/// second arena would no longer keep the writer's churn apart, only split each peak in
/// two. Measured at 4096 devices under the benchmark's load (three passes): with two
/// arenas the peak was 32.3 and 33.7 MiB, with one 31.0 and 31.0 MiB.
const MAX_ARENAS: i32 = 1;
/// Allocations at least this large get pages of their own (mmap), handed back on free.
/// Set explicitly, it stays fixed: glibc otherwise raises it after the first such free
/// (up to 32 MiB), and the connections' large buffers then land in the heap among the
/// long-lived ledger, where the holes they leave cannot be given back. Measured at
/// 4096 devices under the benchmark's load: 3-4 MiB less resident at the peak.
const MMAP_THRESHOLD: i32 = 128 << 10;
/// Free memory at the top of the heap beyond this goes back to the kernel at once.
const TRIM_THRESHOLD: i32 = 256 << 10;

/// Sets up the allocator (arenas, mmap and trim thresholds). Call first thing in `main`,
/// before any thread exists.
pub fn configure_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets a parameter of the allocator; called before any other
    // thread exists, so no allocation races with it.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, MAX_ARENAS);
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}

/// Returns the free pages of every arena to the kernel (`malloc_trim`). Takes a
/// millisecond or so on a large heap; callers rate-limit it with [`Trimmer`].
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes the arenas' own locks and only gives back pages that
    // hold no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Rate-limits [`release_free_memory`] for one thread: at most once per interval, and
/// only after some work since the last trim.
#[derive(Debug)]
pub struct Trimmer {
    interval: Duration,
    last: Instant,
    dirty: bool,
}

impl Trimmer {
    pub fn new(interval: Duration) -> Trimmer {
        Trimmer {
            interval,
            last: Instant::now(),
            dirty: false,
        }
    }

    /// Notes that memory was allocated and freed since the last trim.
    pub fn worked(&mut self) {
        self.dirty = true;
    }

    /// Whether there was work since the last trim and the interval has passed.
    pub fn due(&self) -> bool {
        self.dirty && self.last.elapsed() >= self.interval
    }

    /// Trims if there was work since the last trim and the interval has passed. Returns
    /// whether it trimmed.
    pub fn maybe_trim(&mut self) -> bool {
        if !self.due() {
            return false;
        }
        self.trim_now();
        true
    }

    /// Trims now, whatever the interval (after a full inventory, the start-up one first).
    pub fn trim_now(&mut self) {
        release_free_memory();
        self.last = Instant::now();
        self.dirty = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_only_after_work_and_at_most_once_per_interval() {
        let mut t = Trimmer::new(Duration::from_secs(3600));
        assert!(!t.maybe_trim(), "no work yet");
        t.worked();
        assert!(!t.maybe_trim(), "within the interval");
        let mut t = Trimmer::new(Duration::ZERO);
        assert!(!t.due() && !t.maybe_trim(), "no work yet");
        t.worked();
        assert!(t.due());
        assert!(t.maybe_trim());
        assert!(!t.due(), "trimmed");
        assert!(!t.maybe_trim(), "nothing since");
    }
}
