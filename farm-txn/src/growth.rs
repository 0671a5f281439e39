//! A machine whose regions are full gets another from its CM (FaRM §3: "machines contact the
//! CM to allocate a new region"). A worker whose allocation finds every region this machine is
//! primary of full reports it here ([`RegionGrowth::on_full`]) and its transaction waits and
//! retries ([`crate::TxError::AwaitingRegion`]); the machine's control plane
//! (`control::MachineControl`, which [`RegionGrowth::enable`]s this) asks the CM for one
//! region placed with the replicas of one of its own ([`RegionGrowth::take_wanted`]), so
//! that this machine is its primary, and reports the answer ([`RegionGrowth::answered`]). One
//! request is outstanding per machine however many workers find their regions full.
//!
//! What the control plane does with the view it has: it runs the placement the CM runs
//! (`farm_cm::placement::choose_replicas`). Where no region can be placed (too few members
//! with room in distinct failure domains), or none with this machine as primary (it holds the
//! most regions a machine may, or none of its regions has all its replicas), the machine is
//! refused and its allocations fail with [`farm_alloc::AllocError::RegionFull`], as before
//! machines asked, until a newer view. Otherwise it asks the CM; after a refusal (the store
//! timed out, a replica did not answer or had no memory) it waits, longer after each one in a
//! row, and asks again only if a worker still found its regions full meanwhile; the
//! transactions wait, `txn()` up to its recovery wait.
//!
//! A machine primary of no region (one that joined), which allocates in other machines'
//! regions, asks when every region is full and takes a region wherever the CM puts it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Where a machine's request for another region stands. A `generation` is that of the
/// machine's view ([`crate::MachineState::view_generation`]) when the state was reached: a
/// worker on that view or an older one has seen nothing newer.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Nothing asked.
    Idle,
    /// A worker found every region full: the control plane asks the CM.
    Wanted,
    /// Asked; no answer yet.
    Asked,
    /// The CM refused; asked again after a while if a worker still `wants` a region.
    Refusing { wants: bool },
    /// The CM committed a region for this machine by this view: an older view lacks it.
    Grown { generation: u64 },
    /// No region can be placed for this machine in this view: allocations fail until a newer.
    Refused { generation: u64 },
}

/// The control plane's answer to a request ([`RegionGrowth::answered`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Answer {
    /// A region this machine allocates in is in the view of this generation.
    Grown(u64),
    /// The CM refused this time (it may not next time).
    Refusing,
    /// No region can be placed for this machine in the view of this generation.
    Refused(u64),
}

/// One machine's request for another region ([`crate::MachineState::growth`]).
#[derive(Debug)]
pub struct RegionGrowth {
    state: Mutex<State>,
    /// Whether a control plane serves requests (a node without a coordination store runs
    /// none: its allocations fail when full, as before).
    enabled: AtomicBool,
}

impl Default for RegionGrowth {
    fn default() -> Self {
        Self {
            state: Mutex::new(State::Idle),
            enabled: AtomicBool::new(false),
        }
    }
}

impl RegionGrowth {
    /// A control plane serves this machine's requests from now on.
    pub fn enable(&self) {
        self.enabled.store(true, Ordering::Release);
    }

    /// A worker on the view of `generation` found every region this machine is primary of
    /// full (or, primary of none, every region). Whether its transaction should wait for
    /// another region; `false` when no region can be placed in that view, or no control
    /// plane would ask.
    pub fn on_full(&self, generation: u64) -> bool {
        if !self.enabled.load(Ordering::Acquire) {
            return false;
        }
        let mut s = self.state.lock().expect("growth poisoned");
        match *s {
            State::Wanted | State::Asked => true,
            State::Refusing { .. } => {
                *s = State::Refusing { wants: true };
                true
            }
            // A newer view holds the region.
            State::Grown { generation: g } if generation < g => true,
            State::Refused { generation: g } if generation <= g => false,
            State::Idle | State::Grown { .. } | State::Refused { .. } => {
                *s = State::Wanted;
                true
            }
        }
    }

    /// Whether a region is wanted and not asked for yet; if so, it counts as asked from now.
    pub fn take_wanted(&self) -> bool {
        let mut s = self.state.lock().expect("growth poisoned");
        let wanted = *s == State::Wanted;
        if wanted {
            *s = State::Asked;
        }
        wanted
    }

    /// After a refusal's wait: whether a worker still wants a region (it counts as asked from
    /// now); if none does, nothing is asked any more.
    pub fn take_still_wanted(&self) -> bool {
        let mut s = self.state.lock().expect("growth poisoned");
        match *s {
            State::Refusing { wants: true } | State::Wanted => {
                *s = State::Asked;
                true
            }
            State::Refusing { wants: false } => {
                *s = State::Idle;
                false
            }
            _ => false,
        }
    }

    /// The control plane's answer to the request asked for.
    pub fn answered(&self, answer: Answer) {
        *self.state.lock().expect("growth poisoned") = match answer {
            Answer::Grown(generation) => State::Grown { generation },
            Answer::Refusing => State::Refusing { wants: false },
            Answer::Refused(generation) => State::Refused { generation },
        };
    }

    /// Whether a region is wanted or asked for and not answered yet (or refused, and a worker
    /// still wants one).
    pub fn pending(&self) -> bool {
        matches!(
            *self.state.lock().expect("growth poisoned"),
            State::Wanted | State::Asked | State::Refusing { wants: true }
        )
    }

    /// Whether no region can be placed for this machine in the view it last asked in (its
    /// allocations fail when full).
    pub fn refused(&self) -> bool {
        matches!(
            *self.state.lock().expect("growth poisoned"),
            State::Refused { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enabled() -> RegionGrowth {
        let g = RegionGrowth::default();
        g.enable();
        g
    }

    #[test]
    fn one_request_for_many_full_workers_and_its_answer_for_older_views() {
        let g = enabled();
        assert!(!g.take_wanted(), "nothing wanted yet");
        assert!(g.on_full(5));
        assert!(g.on_full(5), "a second worker waits for the same region");
        assert!(g.take_wanted());
        assert!(!g.take_wanted(), "asked once");
        assert!(g.on_full(5), "asked: wait");
        assert!(!g.take_wanted());
        g.answered(Answer::Grown(7));
        assert!(g.on_full(6), "a view older than the region's waits for it");
        assert!(!g.take_wanted(), "and asks for nothing");
        assert!(g.on_full(7), "full again with the new region: another");
        assert!(g.take_wanted());
    }

    #[test]
    fn a_refusal_fails_allocations_until_a_newer_view() {
        let g = enabled();
        assert!(g.on_full(5));
        assert!(g.take_wanted());
        g.answered(Answer::Refused(6));
        assert!(!g.on_full(6), "refused: fail");
        assert!(!g.on_full(5), "an older view too");
        assert!(!g.take_wanted());
        assert!(g.refused());
        assert!(g.on_full(7), "a newer view (a machine joined): ask again");
        assert!(g.take_wanted());
        assert!(!g.refused());
    }

    #[test]
    fn a_refused_request_is_asked_again_only_if_still_wanted() {
        let g = enabled();
        assert!(g.on_full(5));
        assert!(g.take_wanted());
        g.answered(Answer::Refusing);
        assert!(!g.pending(), "nobody waits yet");
        assert!(g.on_full(5), "a worker waits");
        assert!(!g.take_wanted(), "not asked at once");
        assert!(g.pending());
        assert!(g.take_still_wanted(), "asked after the wait");
        g.answered(Answer::Refusing);
        assert!(!g.take_still_wanted(), "nobody wanted it since: not asked");
        assert!(!g.pending());
        assert!(g.on_full(5), "full again later: asked again");
        assert!(g.take_wanted());
    }

    #[test]
    fn without_a_control_plane_allocations_fail_when_full() {
        let g = RegionGrowth::default();
        assert!(!g.on_full(5));
        assert!(!g.take_wanted());
    }
}
