//! farm-core: the foundation of farm-rs.
//!
//! - [`ids`]: newtype identifiers and global addresses;
//! - [`config`]: configurations and the region map;
//! - [`codec`]: how configurations and machines' views are stored;
//! - [`nvram`]: memory-mapped NVRAM, the only module with raw-memory code;
//! - [`object`]: object headers, locking and consistent reads;
//! - [`fabric`]: the contract of one-sided reads and writes and datagrams that every protocol
//!   is written against (its backends, in one process, across processes and across hosts, are
//!   the `farm-fabric` crate's);
//! - [`ring`]: ring buffers for transaction logs and message queues;
//! - [`wire`]: the records of the commit protocol;
//! - [`rng`]: the seeded generator every random choice flows from.
//!
//! ```
//! use farm_core::{nvram::Nvram, object::{self, Header, ReadOutcome}, ids::Version};
//! let mem = Nvram::anonymous(64).unwrap();
//! let h = Header::new(Version(1), true);
//! mem.store_u64(0, h.0, std::sync::atomic::Ordering::Release);
//! object::try_lock(&mem, 0, h).unwrap();
//! object::apply_locked(&mem, 0, &42u64.to_le_bytes(), h.committed_successor(true));
//! let mut buf = [0u8; 16];
//! assert!(matches!(object::read_object(&mem, 0, &mut buf).unwrap(), ReadOutcome::Consistent(_)));
//! ```
#![deny(missing_docs)]

pub mod codec;
pub mod config;
pub mod fabric;
pub mod ids;
pub mod nvram;
pub mod object;
pub mod ring;
pub mod rng;
pub mod wire;

pub use ids::{Addr, ConfigId, MachineId, RegionId, ThreadId, TxnId, Version};
