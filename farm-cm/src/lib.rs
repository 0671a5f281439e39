//! farm-cm: the configuration manager's protocol cores (FaRM §3, §5.1, §5.2).
//!
//! - [`store`]: the coordination-store contract (read; compare-and-set by version) and the
//!   embedded store; the ZooKeeper store lives in the runtime crate, as protocol crates never
//!   talk to servers themselves.
//! - [`codec`]: how a configuration is stored (re-exported from `farm_core::codec`).
//! - [`control`]: the CM's control messages between processes (NEW-CONFIG and the rest).
//! - [`lease`]: leases over datagrams with the 3-way handshake, as deterministic state machines.
//! - [`plane`]: one machine's control plane (member and driver sides of §5.2-5.4) as a
//!   state machine that every deployment and the simulator run.
//! - [`placement`]: region allocation (§3): ids, replica choice, two-phase prepare/commit.
//! - [`reconfig`]: reconfiguration steps 2-7 as a state machine, and backup CMs.
//! - [`remap`]: region remapping at reconfiguration (promotion, re-replication, change history).
//! - [`restart`]: a whole-cluster restart from NVRAM: the decision and the exchange between
//!   machines, as a state machine.
#![deny(missing_docs)]

pub use farm_core::codec;
pub mod control;
pub mod lease;
pub mod placement;
pub mod plane;
pub mod reconfig;
pub mod remap;
pub mod restart;
pub mod store;

pub use lease::{CmLeases, LeaseConfig, LeaseEvent, LeaseMsg, LeaseRole, MemberLease};
pub use store::{
    CasOutcome, ConfigurationStore, CoordinationStore, EmbeddedStore, MarkedConfig,
    ReadConfigError, StoreError, StoreVersion,
};
