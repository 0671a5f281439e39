//! farm-fabric: the backends of farm-core's [`Fabric`](farm_core::fabric::Fabric) trait, the
//! one-sided reads and writes and the datagrams every protocol is written against.
//!
//! - [`mem`]: machines in one process, each machine's memory another's to read and write; kill,
//!   partition, held writes (landing as any prefix at a crash) and datagram loss and delay,
//!   for tests and the simulator;
//! - [`shm`]: one process per machine on one host; peers map each other's NVRAM files, so
//!   reads and writes stay one-sided, and liveness comes from a lock the kernel drops with the
//!   process;
//! - [`tcp`]: machines on hosts; a NIC thread per connection serves one-sided operations on
//!   registered memory;
//! - [`process`]: what the two process fabrics share (directory claim, doorbell, UDP
//!   datagrams) and [`ProcessFabric`](process::ProcessFabric), the interface a node runs on;
//! - [`auth`]: the cluster's shared secret, which every `tcp` connection proves in its hello
//!   and every datagram carries a tag of;
//! - `verbs` (cargo feature `verbs`): real RDMA hardware through libibverbs, so far its
//!   queue-pair layer (devices, registration, RC queue pairs posting READs and WRITEs in
//!   batches, completion polling).
//!
//! They live apart from the protocol crates, which hold no socket, thread or file of their
//! own: a protocol touches other machines only through the `Fabric` handle it is given.
//!
//! ```
//! use farm_core::fabric::{Fabric, MemKey};
//! use farm_core::nvram::Nvram;
//! use farm_core::{MachineId, RegionId};
//! use farm_fabric::mem::{MemFabric, MemFabricConfig};
//! use std::sync::Arc;
//! let config = MemFabricConfig { machines_max: 2, threads_max: 1, seed: 7, datagrams_queued_max: 64 };
//! let fabric = MemFabric::new(config);
//! let mem = Arc::new(Nvram::anonymous(64).unwrap());
//! fabric.register(MachineId(1), MemKey::Region(RegionId(0)), mem.clone());
//! let remote = fabric.remote(MachineId(0), MachineId(1), MemKey::Region(RegionId(0))).unwrap();
//! mem.store_u64(0, 7, std::sync::atomic::Ordering::Release);
//! let mut buf = [0u8; 8];
//! remote.read(0, &mut buf).unwrap();
//! assert_eq!(u64::from_le_bytes(buf), 7);
//! ```
#![deny(missing_docs)]

pub mod auth;
pub mod mem;
pub mod process;
pub mod shm;
pub mod tcp;
#[cfg(feature = "verbs")]
pub mod verbs;
