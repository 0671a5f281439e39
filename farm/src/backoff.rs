//! Backoff for pollers and conflicting transactions: spin, then yield, then sleep briefly, so
//! that spinning threads do not starve a 2-core machine running three in-process machines
//! (docs/ARCHITECTURE.md, Machines, threads, event loop).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use farm_core::rng::Rng;

const SPINS_MAX: u32 = 64;
const YIELDS_MAX: u32 = 256;
const PARK: Duration = Duration::from_micros(50);
const PARK_HELD: Duration = Duration::from_millis(1);
/// A conflict backoff doubles up to this many times.
const CONFLICT_DOUBLINGS_MAX: u32 = 6;

/// How many rounds (yields of the thread, or turns of a pipeline's other tasks) a transaction
/// backs off after its `attempt`-th conflict: drawn at random below a bound that doubles with
/// each attempt ("full jitter"). Two transactions that conflict with each other and back off
/// by the same amount retry in step and conflict again; tasks of one thread, which take turns
/// in a fixed order, did so until both gave up.
pub(crate) fn conflict_rounds(attempt: u32, rng: &mut Rng) -> u32 {
    1 + rng.below(1u64 << attempt.min(CONFLICT_DOUBLINGS_MAX)) as u32
}

/// A generator for [`conflict_rounds`], a different stream for every caller of the process.
pub(crate) fn conflict_rng() -> Rng {
    static STREAMS: AtomicU64 = AtomicU64::new(0);
    Rng::new(STREAMS.fetch_add(1, Ordering::Relaxed))
}

/// Idle and conflict backoff state of one thread.
#[derive(Debug)]
pub(crate) struct Backoff {
    idle: u32,
    rng: Rng,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Self {
            idle: 0,
            rng: conflict_rng(),
        }
    }

    /// Work was found: start over.
    pub(crate) fn reset(&mut self) {
        self.idle = 0;
    }

    /// Nothing to do this round.
    pub(crate) fn idle(&mut self) {
        self.idle = self.idle.saturating_add(1);
        if self.idle <= SPINS_MAX {
            std::hint::spin_loop();
        } else if self.idle <= SPINS_MAX + YIELDS_MAX {
            std::thread::yield_now();
        } else {
            std::thread::sleep(PARK);
        }
    }

    /// Sleeps briefly: nothing to do, and spinning or yielding would take a core from threads
    /// that have work.
    pub(crate) fn sleep(&mut self) {
        std::thread::sleep(PARK);
    }

    /// Sleeps: a transaction holds the host and polls it, so there is nothing to do until it
    /// lets go. Long enough that waking up costs the transaction's thread nothing noticeable,
    /// short enough that lazy work (truncation) left on a host nobody uses is done promptly.
    pub(crate) fn park(&mut self) {
        std::thread::sleep(PARK_HELD);
    }

    /// After the `attempt`-th conflict: yield [`conflict_rounds`] times.
    pub(crate) fn conflict(&mut self, attempt: u32) {
        for _ in 0..conflict_rounds(attempt, &mut self.rng) {
            std::thread::yield_now();
        }
    }
}
