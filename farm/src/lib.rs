//! farm-rs: FaRM-style distributed transactions over one-sided memory access.
//!
//! Start an in-process cluster, allocate objects and run strictly serializable transactions on
//! them:
//!
//! ```
//! use farm::{Cluster, MachineId};
//! let cluster = Cluster::builder().machines(3).replicas(3).region_bytes(4 << 20).build().unwrap();
//! let m = MachineId(0);
//! let a = cluster.txn(m, |tx| tx.alloc(&100u64, None)).unwrap();
//! let b = cluster.txn(MachineId(1), |tx| tx.alloc(&0u64, None)).unwrap();
//! cluster.txn(m, |tx| {
//!     let x: u64 = tx.read(a)?;
//!     let y: u64 = tx.read(b)?;
//!     tx.write(a, &(x - 10))?;
//!     tx.write(b, &(y + 10))
//! }).unwrap();
//! assert_eq!(cluster.read::<u64>(MachineId(2), b).unwrap(), 10);
//! ```
#![deny(missing_docs)]

mod backoff;
mod cluster;
mod hosts;
mod lease_thread;
mod machine;
mod metrics;
pub mod node;
mod node_restart;
mod pipeline;
mod txn;
pub mod zk;

pub use cluster::{AdminError, BuildError, Client, Cluster, ClusterBuilder, Session, Timeline};
pub use farm_cm::{CasOutcome, CoordinationStore, EmbeddedStore, StoreError, StoreVersion};
pub use farm_core::config::Configuration;
pub use farm_core::{Addr, ConfigId, MachineId, RegionId};
pub use farm_txn::{Conflict, RecoveryEvent, Replication, Stats, TxError};
pub use hosts::TXN_ATTEMPTS_MAX;
pub use lease_thread::Suspicion;
pub use machine::ReconfigEvent;
pub use pipeline::{AsyncTxn, Pipeline};
pub use txn::{ready, Transaction, Txn};
