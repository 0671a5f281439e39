//! The decision rules of transaction state recovery (FaRM §5.3), as pure functions so that every
//! machine computes the same answer: which transactions are recovering (step 3), which machine
//! coordinates a recovering transaction (step 6), how a region votes (step 6), and how the
//! coordinator decides (step 7).

use std::collections::BTreeMap;

use farm_cm::reconfig::ring_owner;
use farm_cm::remap::RegionChanges;
use farm_core::config::Configuration;
use farm_core::{ConfigId, MachineId, RegionId, TxnId};

/// Whether `txn`, which wrote `written` and read `read`, is recovering in configuration `now`
/// (step 3): its commit started in an earlier configuration and, since then, a replica of a
/// written region, the primary of a read region, or its coordinator changed. (The paper states
/// it for one configuration change, c - 1 to c; "since the commit started" is the same there
/// and also holds for a machine whose view skipped a configuration, or a recovery interrupted by
/// another failure.) Replicas know only the written regions and pass no read regions; the
/// coordinator checks the read condition itself.
pub fn is_recovering(
    txn: TxnId,
    written: &[RegionId],
    read: &[RegionId],
    now: &Configuration,
    changes: &BTreeMap<RegionId, RegionChanges>,
) -> bool {
    if txn.config >= now.id {
        return false;
    }
    let changed = |r: &RegionId, f: fn(&RegionChanges) -> ConfigId| {
        changes.get(r).is_some_and(|c| f(c) > txn.config)
    };
    written
        .iter()
        .any(|r| changed(r, |c| c.last_replica_change))
        || read.iter().any(|r| changed(r, |c| c.last_primary_change))
        || !now.contains(txn.machine)
}

/// The machine that coordinates recovery of `txn` (step 6): its coordinator if it is still a
/// member, else a member chosen by consistent hashing of the transaction id, so that every
/// primary picks the same one without talking.
pub fn recovery_coordinator(txn: TxnId, now: &Configuration) -> MachineId {
    if now.contains(txn.machine) {
        return txn.machine;
    }
    let key = farm_core::rng::Rng::new(
        txn.config.0 ^ (txn.machine.0 as u64) << 48 ^ (txn.thread.0 as u64) << 32 ^ txn.local,
    )
    .next_u64();
    ring_owner(now, key)
}

/// What the replicas of one region saw of a transaction.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Evidence {
    /// Some replica saw COMMIT-PRIMARY or COMMIT-RECOVERY.
    pub commit_primary: bool,
    /// Some replica saw COMMIT-BACKUP.
    pub commit_backup: bool,
    /// Some replica saw LOCK.
    pub lock: bool,
    /// Some replica saw ABORT-RECOVERY.
    pub abort_recovery: bool,
}

/// A region's vote (step 6): the wire format's own enum, so that votes cross the network as
/// they are (commit-primary, commit-backup, lock, abort; truncated and unknown for primaries
/// without records).
pub use farm_core::wire::WireVote as Vote;

/// The vote of a region whose replicas have records of the transaction.
pub fn vote(e: Evidence) -> Vote {
    if e.commit_primary {
        Vote::CommitPrimary
    } else if e.commit_backup && !e.abort_recovery {
        Vote::CommitBackup
    } else if e.lock && !e.abort_recovery {
        Vote::Lock
    } else {
        Vote::Abort
    }
}

/// The coordinator's decision (step 7).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Decision {
    /// COMMIT-RECOVERY to every replica.
    Commit,
    /// ABORT-RECOVERY to every replica.
    Abort,
}

/// Decides from the votes received so far for a transaction that modified `regions`: commit on
/// any commit-primary; otherwise wait for every region, then commit if one voted commit-backup
/// and every other lock, commit-backup or truncated; abort otherwise. `None`: keep waiting (send
/// REQUEST-VOTE to the regions that have not voted, after a timeout).
pub fn decide(regions: &[RegionId], votes: &BTreeMap<RegionId, Vote>) -> Option<Decision> {
    if votes.values().any(|v| *v == Vote::CommitPrimary) {
        return Some(Decision::Commit);
    }
    if regions.iter().any(|r| !votes.contains_key(r)) {
        return None;
    }
    let all: Vec<Vote> = regions.iter().map(|r| votes[r]).collect();
    let one_backup = all.contains(&Vote::CommitBackup);
    let rest_ok = all
        .iter()
        .all(|v| matches!(v, Vote::CommitBackup | Vote::Lock | Vote::Truncated));
    Some(if one_backup && rest_ok {
        Decision::Commit
    } else {
        Decision::Abort
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use farm_core::ThreadId;

    fn txn(config: u64, machine: u16) -> TxnId {
        TxnId {
            config: ConfigId(config),
            machine: MachineId(machine),
            thread: ThreadId(1),
            local: 9,
        }
    }

    #[test]
    fn recovering_transactions_are_the_ones_a_change_touched() {
        let mut now = Configuration::initial(4);
        now.id = ConfigId(2);
        now.members.retain(|m| m.0 != 3);
        let mut changes = BTreeMap::new();
        changes.insert(
            RegionId(1),
            RegionChanges {
                last_primary_change: ConfigId(1),
                last_replica_change: ConfigId(2),
            },
        );
        changes.insert(
            RegionId(2),
            RegionChanges {
                last_primary_change: ConfigId(2),
                last_replica_change: ConfigId(2),
            },
        );
        // Wrote a region whose replicas changed.
        assert!(is_recovering(
            txn(1, 0),
            &[RegionId(1)],
            &[],
            &now,
            &changes
        ));
        // Wrote only an untouched region, read one whose primary did not change.
        assert!(!is_recovering(
            txn(1, 0),
            &[RegionId(0)],
            &[RegionId(1)],
            &now,
            &changes
        ));
        // Read a region whose primary changed.
        assert!(is_recovering(
            txn(1, 0),
            &[RegionId(0)],
            &[RegionId(2)],
            &now,
            &changes
        ));
        // Coordinator removed.
        assert!(is_recovering(
            txn(1, 3),
            &[RegionId(0)],
            &[],
            &now,
            &changes
        ));
        // Started in the new configuration: not recovering.
        assert!(!is_recovering(
            txn(2, 3),
            &[RegionId(1)],
            &[],
            &now,
            &changes
        ));
    }

    #[test]
    fn recovery_coordinators_are_agreed_and_members() {
        let mut now = Configuration::initial(5);
        now.members.retain(|m| m.0 != 2);
        assert_eq!(
            recovery_coordinator(txn(1, 4), &now),
            MachineId(4),
            "a surviving coordinator keeps its transactions"
        );
        let mut spread = std::collections::BTreeSet::new();
        for local in 0..200 {
            let t = TxnId { local, ..txn(1, 2) };
            let c = recovery_coordinator(t, &now);
            assert!(now.contains(c));
            assert_eq!(c, recovery_coordinator(t, &now), "deterministic");
            spread.insert(c);
        }
        assert!(
            spread.len() >= 3,
            "a failed coordinator's transactions spread over machines: {spread:?}"
        );
    }

    /// §5.3 steps 6-7.
    #[test]
    fn votes_and_decisions_follow_the_paper() {
        let e = |commit_primary, commit_backup, lock, abort_recovery| Evidence {
            commit_primary,
            commit_backup,
            lock,
            abort_recovery,
        };
        assert_eq!(vote(e(true, true, true, true)), Vote::CommitPrimary);
        assert_eq!(vote(e(false, true, true, false)), Vote::CommitBackup);
        assert_eq!(vote(e(false, true, true, true)), Vote::Abort);
        assert_eq!(vote(e(false, false, true, false)), Vote::Lock);
        assert_eq!(vote(e(false, false, false, false)), Vote::Abort);
        let rs = [RegionId(1), RegionId(2), RegionId(3)];
        let votes = |v: &[(u32, Vote)]| {
            v.iter()
                .map(|(r, v)| (RegionId(*r), *v))
                .collect::<BTreeMap<_, _>>()
        };
        assert_eq!(
            decide(&rs, &votes(&[(2, Vote::CommitPrimary)])),
            Some(Decision::Commit),
            "one commit-primary suffices"
        );
        assert_eq!(
            decide(&rs, &votes(&[(1, Vote::CommitBackup), (2, Vote::Lock)])),
            None,
            "wait for region 3"
        );
        assert_eq!(
            decide(
                &rs,
                &votes(&[
                    (1, Vote::CommitBackup),
                    (2, Vote::Lock),
                    (3, Vote::Truncated)
                ])
            ),
            Some(Decision::Commit)
        );
        assert_eq!(
            decide(
                &rs,
                &votes(&[(1, Vote::Lock), (2, Vote::Lock), (3, Vote::Truncated)])
            ),
            Some(Decision::Abort),
            "no commit-backup"
        );
        assert_eq!(
            decide(
                &rs,
                &votes(&[(1, Vote::CommitBackup), (2, Vote::Unknown), (3, Vote::Lock)])
            ),
            Some(Decision::Abort)
        );
        assert_eq!(
            decide(
                &rs,
                &votes(&[(1, Vote::CommitBackup), (2, Vote::Abort), (3, Vote::Lock)])
            ),
            Some(Decision::Abort)
        );
    }
}
