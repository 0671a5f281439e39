//! A cluster of three machines with one worker each over the `mem` fabric, for protocol tests
//! that drive workers by hand.

use std::sync::Arc;

use farm_core::config::{Configuration, RegionMap};
use farm_core::fabric::Fabric;
use farm_core::mem_fabric::{MemFabric, MemFabricConfig};
use farm_core::ring::RingLayout;
use farm_core::{MachineId, ThreadId};
use farm_txn::{MachineState, Params, Worker};

/// Workers of machines 0, 1, 2 (thread 0), regions striped with `backups` backups each.
pub fn workers(region_bytes: usize, backups: u16) -> Vec<Worker> {
    let layout = RingLayout {
        machines_max: 3,
        threads: 1,
        log_bytes: 256 << 10,
        queue_bytes: 256 << 10,
    };
    let params = Params {
        layout,
        region_bytes,
        validate_rpc_threshold: 4,
        recovery_interval_ticks: 2,
    };
    let fabric = Arc::new(MemFabric::new(MemFabricConfig {
        machines_max: 3,
        threads_max: 1,
        seed: 0,
        datagrams_queued_max: 8,
    }));
    let map = RegionMap::striped(3, 1, backups);
    (0..3)
        .map(|m| {
            let state = MachineState::new(
                MachineId(m),
                params,
                Configuration::initial(3),
                map.clone(),
                fabric.clone() as Arc<dyn Fabric>,
                None,
            )
            .unwrap();
            Worker::new(state, ThreadId(0))
        })
        .collect()
}
