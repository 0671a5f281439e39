//! What the crate's unit tests build machines from: three machines of one thread over the
//! `mem` fabric (the integration tests' `tests/common` builds the same through the public API).

use std::sync::Arc;

use farm_core::fabric::Fabric;
use farm_core::ring::RingLayout;
use farm_fabric::mem::{MemFabric, MemFabricConfig};

use crate::{Params, Replication};

/// Parameters of a machine of three, one thread each, 2 MB regions, leases of `lease_ticks`.
pub(crate) fn params(lease_ticks: u64) -> Params {
    Params {
        layout: RingLayout {
            machines_max: 3,
            threads: 1,
            log_bytes: 256 << 10,
            queue_bytes: 256 << 10,
        },
        region_bytes: 2 << 20,
        validate_rpc_threshold: 4,
        recovery_interval_ticks: 2,
        replication: Replication::OneSided,
        lease_ticks,
    }
}

/// A `mem` fabric for three machines of one thread.
pub(crate) fn fabric() -> Arc<dyn Fabric> {
    Arc::new(MemFabric::new(MemFabricConfig {
        machines_max: 3,
        threads_max: 1,
        seed: 0,
        datagrams_queued_max: 8,
    }))
}
