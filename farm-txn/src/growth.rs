//! A machine whose regions are full gets another from its CM (FaRM §3: "machines contact the
//! CM to allocate a new region"). A worker whose allocation finds every region this machine is
//! primary of full reports it here ([`RegionGrowth::on_full`]) and its transaction waits and
//! retries ([`crate::TxError::AwaitingRegion`]); the machine's control plane asks the CM for
//! one region placed with the replicas of one of its own ([`RegionGrowth::take_wanted`],
//! `control::MachineControl::tick`), so that this machine is its primary, and reports the
//! answer ([`RegionGrowth::answered`]). One request is outstanding per machine however many
//! workers find their regions full. A machine primary of no region (one that joined), which
//! allocates in other machines' regions, asks when every region is full and takes a region
//! wherever the CM puts it. Four refusals in a row (no capacity in enough failure domains, a
//! replica out of memory; a timeout of the coordination store is asked again), or a region
//! whose primary the CM put elsewhere, make allocations fail as before
//! ([`farm_alloc::AllocError::RegionFull`]) until the regions this machine is primary of
//! change.

use std::sync::Mutex;

/// Where a machine's request for another region stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Nothing asked.
    Idle,
    /// A worker found every region full: the control plane asks the CM.
    Wanted,
    /// Asked; no answer yet.
    Asked,
    /// The CM committed a region of this machine's, in the view of this generation (or an
    /// earlier one): a worker on an older view has not seen it yet.
    Grown { generation: u64 },
    /// The CM gave this machine no region of its own while it was primary of this many.
    Refused { primaries: usize },
}

/// One machine's request for another region ([`crate::MachineState::growth`]).
#[derive(Debug)]
pub struct RegionGrowth {
    state: Mutex<State>,
}

impl Default for RegionGrowth {
    fn default() -> Self {
        Self {
            state: Mutex::new(State::Idle),
        }
    }
}

impl RegionGrowth {
    /// A worker on the view of `generation` found every region this machine is primary of
    /// (`primaries` of them) full. Whether its transaction should wait for another region
    /// (asked for, or just committed and not in that view yet); `false` once the CM refused
    /// one and the machine is still primary of as many.
    pub fn on_full(&self, primaries: usize, generation: u64) -> bool {
        let mut s = self.state.lock().expect("growth poisoned");
        match *s {
            State::Wanted | State::Asked => true,
            State::Grown { generation: g } if generation < g => true,
            State::Refused { primaries: p } if p == primaries => false,
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

    /// Whether the CM refused this machine a region (its allocations fail while its regions
    /// stay as they were).
    pub fn refused(&self) -> bool {
        matches!(
            *self.state.lock().expect("growth poisoned"),
            State::Refused { .. }
        )
    }

    /// The CM's answer: a region of this machine's in the view of `generation` (`Some`), or
    /// none while it is primary of `primaries` regions.
    pub fn answered(&self, grown: Option<u64>, primaries: usize) {
        let mut s = self.state.lock().expect("growth poisoned");
        *s = match grown {
            Some(generation) => State::Grown { generation },
            None => State::Refused { primaries },
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_request_for_many_full_workers_and_its_answer_for_older_views() {
        let g = RegionGrowth::default();
        assert!(!g.take_wanted(), "nothing wanted yet");
        assert!(g.on_full(2, 5));
        assert!(g.on_full(2, 5), "a second worker waits for the same region");
        assert!(g.take_wanted());
        assert!(!g.take_wanted(), "asked once");
        assert!(g.on_full(2, 5), "asked: wait");
        assert!(!g.take_wanted());
        g.answered(Some(7), 3);
        assert!(
            g.on_full(2, 6),
            "a view older than the region's waits for it"
        );
        assert!(!g.take_wanted(), "and asks for nothing");
        assert!(g.on_full(3, 7), "full again with the new region: another");
        assert!(g.take_wanted());
    }

    #[test]
    fn a_refusal_fails_allocations_until_the_machine_s_regions_change() {
        let g = RegionGrowth::default();
        assert!(g.on_full(2, 5));
        assert!(g.take_wanted());
        g.answered(None, 2);
        assert!(!g.on_full(2, 6), "refused: fail");
        assert!(!g.take_wanted());
        assert!(
            g.on_full(3, 8),
            "primary of another region since: ask again"
        );
        assert!(g.take_wanted());
    }
}
