//! What can go wrong with a transaction, as outcomes a caller can act on.

use farm_core::fabric::FabricError;
use farm_core::{Addr, MachineId};

/// Why a transaction did not commit. An abort is an outcome, not a failure of the library.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum TxError {
    /// A conflicting transaction won: a read found a lock, a LOCK failed, or validation failed.
    /// `txn()` retries these automatically.
    #[error("conflict: {0}")]
    Conflict(Conflict),
    /// The region is blocked after a failure until its transactions are recovered (§5.3 step
    /// 1); `txn()` waits and retries.
    #[error("region {} is blocked by recovery", .0.0)]
    RegionBlocked(farm_core::RegionId),
    /// The configuration changed under the commit before any participant could have committed
    /// it; `txn()` retries in the new configuration.
    #[error("the configuration changed during the commit")]
    ConfigurationChanged,
    /// A machine the transaction needs does not answer; nothing of the transaction committed.
    /// `txn()` retries: a new configuration without the machine will serve it (§5.2).
    #[error("unavailable: {0}")]
    Unavailable(#[from] FabricError),
    /// The coordinator's machine was removed from the configuration while alive (suspected
    /// of failure, or cut off): it can no longer commit until it rejoins; a commit in flight is
    /// decided by recovery (§5.3), and the caller cannot know how. Never retried.
    #[error("machine {0} was removed from the configuration; it must rejoin before coordinating")]
    Evicted(MachineId),
    /// The coordinator's machine read while its lease may have run out (FaRM §5.1): a
    /// configuration without it may already serve newer values, so what it read is not told.
    /// `txn()` retries: once the lease is renewed, or the machine learns it was removed.
    #[error("machine {0} does not hold its lease: it serves nothing until renewed")]
    LeaseLapsed(MachineId),
    /// The coordinator's own machine failed during the commit: recovery decides the outcome
    /// (§5.3), and the caller cannot know it. Never retried.
    #[error("the coordinator machine {0} failed during the commit; recovery decides the outcome")]
    CoordinatorFailed(MachineId),
    /// The address names no object (no such region, outside it, or not allocated).
    #[error("bad address {addr}: {why}")]
    BadAddress {
        /// The address.
        addr: Addr,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Allocation failed.
    #[error("allocation failed: {0}")]
    Alloc(#[from] farm_alloc::AllocError),
    /// Every region this machine is primary of is full, and its CM is allocating it another
    /// (§3: machines contact the CM to allocate a new region, [`crate::growth`]); `txn()`
    /// waits and retries. Where no region can be placed (too few machines), allocations fail
    /// with [`farm_alloc::AllocError::RegionFull`] instead.
    #[error("every region machine {0} is primary of is full; it waits for another from its CM")]
    AwaitingRegion(MachineId),
    /// The machine is primary of no region to allocate in, and the transaction has no way to
    /// ask another machine (no poller).
    #[error("machine {0} is primary of no region to allocate in; allocate a region or allocate near an object elsewhere")]
    NoRegion(MachineId),
    /// The transaction writes more than one log record can carry.
    #[error("transaction too large: {bytes} bytes of records for machine {machine} (max {max})")]
    TooLarge {
        /// Destination whose record is too large.
        machine: MachineId,
        /// Encoded size.
        bytes: usize,
        /// Limit.
        max: usize,
    },
    /// The application aborted the transaction with a reason.
    #[error("aborted by the application: {0}")]
    Aborted(String),
}

/// The kind of conflict, for counters and error messages.
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
pub enum Conflict {
    /// An object read during execution was locked by a committing transaction.
    #[error("object {0} was locked when read")]
    ReadLocked(Addr),
    /// A consistent read of an object kept being torn by concurrent commits.
    #[error("object {0} kept changing during the read")]
    ReadTorn(Addr),
    /// A primary could not lock a written object at the version read (§4 step 1).
    #[error("lock failed at a primary")]
    Lock,
    /// A read-only object changed before commit (§4 step 2).
    #[error("read validation failed")]
    Validate,
}

impl TxError {
    /// Whether `txn()` should retry after this error.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            TxError::Conflict(_)
                | TxError::RegionBlocked(_)
                | TxError::AwaitingRegion(_)
                | TxError::ConfigurationChanged
                | TxError::Unavailable(_)
                | TxError::LeaseLapsed(_)
        )
    }
}
