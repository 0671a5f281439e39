//! farm-recovery: what happens after a new configuration commits (FaRM §5.3-5.5), as
//! deterministic state machines. So far: data recovery (§5.4), the block-by-block copy of a
//! region to a new backup ([`data::RegionCopy`]). Transaction state recovery (§5.3) and
//! allocator recovery (§5.5) are next.
#![deny(missing_docs)]

pub mod data;

pub use data::{CopyParams, Progress, RegionCopy};
