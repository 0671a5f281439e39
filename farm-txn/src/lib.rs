//! farm-txn: the FaRM transaction protocol (§4) as deterministic state machines.
//!
//! A [`Worker`] is one thread of one machine. It is both a participant (it processes LOCK,
//! COMMIT-BACKUP, COMMIT-PRIMARY, ABORT and TRUNCATE records from its inbound logs and answers
//! messages) and a coordinator (it executes [`Tx`]s and drives their commits, up to
//! [`COMMITS_IN_FLIGHT_MAX`] at once, each polled by its id). Nothing here
//! blocks, reads a clock, spawns a thread or draws a random number: the runtime in `farm` and the
//! simulator in `farm-sim` drive the same code by calling [`Worker::poll`] and
//! [`Worker::poll_commit`] with the current tick. Transaction state recovery (§5.3) runs in the
//! same workers ([`recovery`]). A machine's control plane (`farm_cm::plane`) acts on its
//! [`MachineState`] through [`control::MachineControl`], and its lease manager through
//! [`lease::MachineLease`], in every deployment and the simulator; a whole-cluster restart
//! (`farm_cm::restart`) through [`restart::MachineRestart`].
#![deny(missing_docs)]

pub mod control;
pub mod coordinator;
pub mod error;
pub mod growth;
pub mod lease;
pub mod machine;
pub mod recovery;
mod recovery_log;
pub mod restart;
pub mod stats;
#[cfg(test)]
mod test_cluster;
pub mod worker;

pub use coordinator::{CommitHandle, Tx, TxCore, TxState, COMMITS_IN_FLIGHT_MAX};
pub use error::{Conflict, TxError};
pub use machine::{MachineState, Params, RecoveryEvent, Replication};
pub use stats::Stats;
pub use worker::{RingsHeld, Worker};
