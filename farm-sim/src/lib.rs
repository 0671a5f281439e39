//! farm-sim: the deterministic simulator and the checkers every later test reuses.
//!
//! - [`driver`]: a single-threaded, seeded driver of whole clusters over the `mem` fabric with
//!   held writes; the same `farm_txn::Worker` code as the threaded runtime.
//! - [`cm`] and [`leases`]: the configuration manager and the leases that feed it suspicions.
//! - [`history`]: list-append histories and an Elle-style strict-serializability checker.
//! - [`replicas`]: replica equality at quiescence.
#![deny(missing_docs)]

pub mod cm;
pub mod driver;
pub mod history;
pub mod leases;
pub mod replicas;

pub use driver::{run_seed, Sim, SimConfig, SimOutcome};
pub use history::{check, Anomaly, Op, TxnRecord};
pub use replicas::{check_region, check_replicas, ReplicaReport};
