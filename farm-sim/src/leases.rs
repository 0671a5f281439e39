//! Leases in the simulator (FaRM §5.1): every machine's lease manager, the runtime's own
//! [`MachineLease`] (its `LeaseRole` following the configuration that machine installed), over
//! the fabric's datagrams (lost and delayed as the run asks), stepped by the scheduler once a
//! tick while the machine runs. Their expiries are the suspicions the simulated CM acts on, so
//! a crashed, paused or cut-off machine is detected the way the runtime detects it, and a lossy
//! network can make a live machine a suspect. A machine not stepped for longer than a renewal
//! (paused, or the whole cluster stalled) credits the gap to the leases it granted, as the
//! runtime's lease threads do.
//!
//! A machine left out of a newer configuration ("orphan") learns it when its own lease runs
//! out, if it reaches the coordination store (where a deployed machine reads it); the driver
//! then stops it (fail-stop on lease loss, as a deployed machine would rather than linger as a
//! coordinator whose records nobody reads). Until then it runs on its stale view, which precise
//! membership (§5.2) must make harmless, and a minority cut off from the store runs on for as
//! long as the partition lasts, serving nothing once its leases end.

use std::sync::Arc;

use farm_cm::LeaseConfig;
use farm_core::config::Configuration;
use farm_core::MachineId;
use farm_txn::lease::MachineLease;
use farm_txn::MachineState;

/// Every machine's lease manager, by machine id.
#[derive(Debug)]
pub struct SimLeases {
    managers: Vec<MachineLease>,
}

impl SimLeases {
    /// The lease managers of `machines` (indexed by id), with leases of `lease_ticks` starting
    /// at `now` in the configuration each has installed.
    pub fn new(machines: &[Arc<MachineState>], lease_ticks: u64, now: u64) -> Self {
        let timing = LeaseConfig::new(lease_ticks);
        let managers = machines
            .iter()
            .enumerate()
            .map(|(i, m)| {
                assert_eq!(m.id.0 as usize, i, "machines indexed by id");
                MachineLease::new(m.clone(), timing, 1, now)
            })
            .collect();
        Self { managers }
    }

    /// One lease round of machine `m` at `now`. Returns the machines it suspects.
    pub fn step_machine(&mut self, m: MachineId, now: u64) -> Vec<MachineId> {
        let mut suspects = Vec::new();
        self.managers[m.0 as usize].round(now, &mut suspects);
        suspects
    }

    /// Whether `machine`, a member in the configuration it installed but not in `newest`, knows
    /// from its own leases at `now` that it is out: none it holds may still be in force.
    pub fn orphan_expired(&self, machine: &MachineState, newest: &Configuration, now: u64) -> bool {
        let m = machine.id;
        !newest.contains(m)
            && machine.view().config.contains(m)
            && now > self.managers[m.0 as usize].serves_until()
    }
}
