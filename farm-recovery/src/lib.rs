//! farm-recovery: what happens after a new configuration commits (FaRM §5.3-5.5), as
//! deterministic parts: data recovery (§5.4), the block-by-block copy of a region to a new
//! backup ([`data::RegionCopy`]); allocator recovery (§5.5), the paced scan that rebuilds a new
//! primary's free lists ([`alloc::AllocatorScan`]); the decision rules of transaction state
//! recovery (§5.3, [`vote`]: recovering transactions, recovery coordinators, votes,
//! decisions); and the lock bits a whole-cluster restart finds in NVRAM ([`locks`]). The
//! protocol steps of §5.3 run in `farm-txn`'s workers, which own the logs they work on (`farm_txn::recovery`); both the runtime and the simulator drive all of it.
#![deny(missing_docs)]

pub mod alloc;
pub mod data;
pub mod locks;
pub mod vote;

pub use alloc::{AllocatorScan, ScanProgress};
pub use data::{CopyParams, Progress, RegionCopy};
