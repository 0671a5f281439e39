//! A node's control thread: its machine's control plane (`farm_cm::plane`, through
//! `crate::control`, which also reports the links the fabric can no longer write on) fed with
//! control datagrams and the lease thread's suspicions, with the coordination store in
//! ZooKeeper. What the plane decides (§5.2-5.4: who reconfigures, NEW-CONFIG and its ack, the
//! commit, REGIONS-ACTIVE, eviction, joins) is the same in every deployment; this thread only
//! adds the answers to a whole-cluster restart's late ring-start requests
//! (`crate::node_restart`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use farm_cm::control::ControlMsg;
use farm_cm::plane::{Event, PlaneParams, ACK_TIMEOUT_LEASES};
use farm_cm::CoordinationStore;
use farm_core::fabric::Fabric;
use farm_core::ConfigId;
use farm_fabric::process::ProcessFabric;
use farm_txn::MachineState;

use crate::lease_thread::Suspicion;
use farm_txn::control::{MachineControl, REGIONS_PER_MACHINE_MAX};

/// How often NEW-CONFIG, NEW-CONFIG-COMMIT and REGIONS-ACTIVE are repeated until answered.
const REPEAT: Duration = Duration::from_millis(2);

/// How long the control loop sleeps while it drives a reconfiguration.
const DRIVING_SLEEP: Duration = Duration::from_micros(100);

pub(crate) struct Control {
    pub(crate) machine: Arc<MachineState>,
    pub(crate) fabric: Arc<dyn ProcessFabric>,
    pub(crate) store: Arc<dyn CoordinationStore>,
    pub(crate) suspicions: Arc<Mutex<Vec<Suspicion>>>,
    pub(crate) lease: Duration,
    pub(crate) replicas: usize,
    pub(crate) epoch: Instant,
    pub(crate) stop: Arc<AtomicBool>,
    /// Configurations this node committed as CM or driver, for the caller.
    pub(crate) committed: Arc<Mutex<Vec<ConfigId>>>,
    /// After a restart, where this machine found each peer's rings, for peers that still ask
    /// (`crate::node_restart`).
    pub(crate) ring_starts: Option<(ConfigId, crate::node_restart::RingStarts)>,
}

impl Control {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    pub(crate) fn run(self) {
        let me = self.machine.id;
        let lease_us = self.lease.as_micros() as u64;
        let params = PlaneParams {
            replicas: self.replicas,
            regions_max: REGIONS_PER_MACHINE_MAX,
            machines_max: self.machine.params.layout.machines_max,
            lease_ticks: lease_us,
            lease_longest_ticks: lease_us,
            // Probes are one-sided reads (answered without the target's CPU), but a NEW-CONFIG
            // needs the member's control thread and an fsync of its view: give the acks ten
            // leases, at least 100 ms, before removing the silent.
            ack_timeout_ticks: (self.lease * ACK_TIMEOUT_LEASES as u32)
                .max(Duration::from_millis(100))
                .as_micros() as u64,
            repeat_ticks: REPEAT.as_micros() as u64,
        };
        let mut control = MachineControl::new(
            self.machine.clone(),
            params,
            self.fabric.clone() as Arc<dyn Fabric>,
            self.store.clone(),
        );
        let mut seen = 0;
        let mut restart = Vec::new();
        while !self.stop.load(Ordering::Relaxed) {
            let fresh: Vec<Suspicion> = {
                let all = self.suspicions.lock().expect("poisoned");
                let fresh = all[seen..].to_vec();
                seen = all.len();
                fresh
            };
            for s in fresh.iter().filter(|s| s.observer == me) {
                control.on_suspect(s.suspect, self.now());
            }
            control.step(self.now(), &mut restart);
            for (from, msg) in restart.drain(..) {
                if let ControlMsg::RingStarts {
                    config,
                    reply: false,
                    ..
                } = msg
                {
                    self.answer_ring_starts(from, config);
                }
            }
            for (_, e) in control.take_events() {
                if let Event::Committed(c) = e {
                    self.committed.lock().expect("poisoned").push(c.id);
                }
            }
            std::thread::sleep(if control.reconfiguring() {
                DRIVING_SLEEP
            } else {
                (self.lease / 20).max(Duration::from_micros(200))
            });
        }
    }

    /// A peer of a restart that still asks where this machine found its rings.
    fn answer_ring_starts(&self, from: farm_core::MachineId, config: ConfigId) {
        if let Some(starts) = self
            .ring_starts
            .as_ref()
            .filter(|(id, _)| *id == config)
            .and_then(|(_, s)| s.get(&from))
        {
            crate::node_restart::send_starts(&*self.fabric, from, config, true, starts);
        }
    }
}
