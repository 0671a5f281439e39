//! Per-worker counters (docs/ARCHITECTURE.md, Observability): commits, aborts by cause, protocol work.

use crate::error::{Conflict, TxError};

/// Counters of one worker. Plain integers: a worker is owned by one thread at a time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Transactions committed (read-only included).
    pub commits: u64,
    /// Aborts: a read found a lock.
    pub aborts_read_locked: u64,
    /// Aborts: reads kept being torn.
    pub aborts_read_torn: u64,
    /// Aborts: a LOCK failed.
    pub aborts_lock: u64,
    /// Aborts: validation failed.
    pub aborts_validate: u64,
    /// Aborts for other reasons (unavailable machines, application aborts, bad input).
    pub aborts_other: u64,
    /// Consistent object reads.
    pub reads: u64,
    /// Of `reads`, those from another machine's primary (one-sided reads over the fabric).
    pub reads_remote: u64,
    /// Reads that found a lock.
    pub reads_locked: u64,
    /// Reads that were torn and retried.
    pub reads_torn: u64,
    /// Object reads a transaction posted ahead (`Tx::prefetch`) and then took the answer of.
    pub reads_posted: u64,
    /// Header reads of validation posted to remote primaries (§4 step 2, one-sided).
    pub validation_reads_posted: u64,
    /// LOCK records processed as a primary.
    pub locks_processed: u64,
    /// COMMIT-BACKUP records applied at truncation.
    pub backup_applied: u64,
    /// BACKUP-ACKs sent for COMMIT-BACKUP records (RPC replication only).
    pub backup_acks: u64,
    /// Explicit TRUNCATE records sent.
    pub truncates_sent: u64,
    /// VALIDATE messages sent.
    pub validate_rpcs: u64,
    /// Commits that waited for log space before starting.
    pub reserve_waits: u64,
    /// Messages that waited for queue space.
    pub queue_full_waits: u64,
    /// Objects allocated at this machine's primaries (local or for ALLOC requests).
    pub allocs: u64,
    /// Allocations this coordinator obtained from a remote primary.
    pub allocs_remote: u64,
    /// Objects freed at this primary.
    pub frees: u64,
    /// RECOVERY-VOTEs sent (§5.3 step 6).
    pub recovery_votes: u64,
    /// Recovering transactions this thread decided to commit (§5.3 step 7).
    pub recovered_commits: u64,
    /// Recovering transactions this thread decided to abort.
    pub recovered_aborts: u64,
    /// Records a whole-cluster restart found past a log's drain mark, of transactions the
    /// drain made recovering, and rejected again (see `MachineState::drain_mark`).
    pub restart_late_rejected: u64,
    /// Records and messages from other machines that passed their checksum but did not decode
    /// (another build's, or a peer's bug): logged and skipped, nothing applied.
    pub malformed: u64,
    /// Links this thread cut because the peer freed no queue space while a full backlog of
    /// messages waited for it (the peer is reported unreachable).
    pub cut_links: u64,
    /// Recovery messages whose queue slot was held as their restart record because the
    /// recovery log was full.
    pub recovery_log_full: u64,
    /// Recovery messages refused for naming a configuration further ahead than any peer can
    /// (more than one beyond the newest view installed here).
    pub recovery_refused: u64,
    /// Bytes data recovery read from primaries to copy their regions here (§5.4).
    pub recovery_bytes_read: u64,
}

impl Stats {
    pub(crate) fn count_abort(&mut self, e: &TxError) {
        match e {
            TxError::Conflict(Conflict::ReadLocked(_)) => self.aborts_read_locked += 1,
            TxError::Conflict(Conflict::ReadTorn(_)) => self.aborts_read_torn += 1,
            TxError::Conflict(Conflict::Lock) => self.aborts_lock += 1,
            TxError::Conflict(Conflict::Validate) => self.aborts_validate += 1,
            _ => self.aborts_other += 1,
        }
    }

    /// All aborts.
    pub fn aborts(&self) -> u64 {
        self.aborts_read_locked
            + self.aborts_read_torn
            + self.aborts_lock
            + self.aborts_validate
            + self.aborts_other
    }

    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &Stats) {
        // The pattern lists every field without `..`, so a new counter cannot be forgotten.
        macro_rules! sum_all {
            ($($f:ident),*) => {{
                let Stats { $($f),* } = other;
                $( self.$f += $f; )*
            }};
        }
        sum_all!(
            commits,
            aborts_read_locked,
            aborts_read_torn,
            aborts_lock,
            aborts_validate,
            aborts_other,
            reads,
            reads_remote,
            reads_locked,
            reads_torn,
            reads_posted,
            validation_reads_posted,
            locks_processed,
            backup_applied,
            backup_acks,
            truncates_sent,
            validate_rpcs,
            reserve_waits,
            queue_full_waits,
            allocs,
            allocs_remote,
            frees,
            recovery_votes,
            recovered_commits,
            recovered_aborts,
            restart_late_rejected,
            malformed,
            cut_links,
            recovery_log_full,
            recovery_refused,
            recovery_bytes_read
        );
    }
}
