//! Backoff for pollers and conflicting transactions: spin, then yield, then sleep briefly, so
//! that spinning threads do not starve a 2-core machine running three in-process machines
//! (docs/ARCHITECTURE.md, Machines, threads, event loop).

use std::time::Duration;

const SPINS_MAX: u32 = 64;
const YIELDS_MAX: u32 = 256;
const PARK: Duration = Duration::from_micros(50);
const PARK_HELD: Duration = Duration::from_millis(1);

/// Idle and conflict backoff state of one thread.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    idle: u32,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Self::default()
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

    /// After the `attempt`-th conflict: yield a growing number of times, capped.
    pub(crate) fn conflict(&mut self, attempt: u32) {
        let rounds = 1u32 << attempt.min(6);
        for _ in 0..rounds {
            std::thread::yield_now();
        }
    }
}
