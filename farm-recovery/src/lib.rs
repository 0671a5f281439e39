//! farm-recovery: what happens after a new configuration commits (FaRM §5.3-5.5), as
//! deterministic state machines. So far: data recovery (§5.4), the block-by-block copy of a
//! region to a new backup ([`data::RegionCopy`]), and allocator recovery (§5.5), the paced scan
//! that rebuilds a new primary's free lists ([`alloc::AllocatorScan`]). Of transaction state
//! recovery (§5.3), the decision rules ([`vote`]: recovering transactions, recovery
//! coordinators, votes, decisions); its protocol steps are next.
#![deny(missing_docs)]

pub mod alloc;
pub mod data;
pub mod vote;

pub use alloc::{AllocatorScan, ScanProgress};
pub use data::{CopyParams, Progress, RegionCopy};
