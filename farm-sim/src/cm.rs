//! The configuration manager in the simulator: the same [`Reconfig`] state machine the runtime's
//! CM thread drives (FaRM §5.2), stepped by the scheduler. Suspicions come from leases
//! ([`crate::leases`]); the CM, or the first live backup CM when the CM is suspected, probes,
//! stores the new configuration in an embedded coordination store, installs it at every member
//! (NEW-CONFIG), and commits it (NEW-CONFIG-COMMIT), which starts transaction recovery (§5.3)
//! in the workers. A paused machine does not drive.

use std::collections::BTreeSet;
use std::sync::Arc;

use farm_cm::reconfig::{attempt_base, backup_cms, Effect, Reconfig, ReconfigParams};
use farm_cm::{CasOutcome, CoordinationStore, EmbeddedStore, StoreVersion};
use farm_core::config::RegionMap;
use farm_core::mem_fabric::MemFabric;
use farm_core::MachineId;
use farm_txn::MachineState;

/// Lease length in ticks (the leases of [`crate::leases`]; a machine removed for a failed probe
/// is waited out this long).
pub const LEASE_TICKS: u64 = 50;

/// The simulated CM.
#[derive(Debug)]
pub struct SimCm {
    store: EmbeddedStore,
    version: StoreVersion,
    replicas: usize,
    /// Machines suspected, with the tick from which the suspicion counts and the machine whose
    /// lease expired (the observer).
    suspicions: Vec<(u64, MachineId, MachineId)>,
    /// The reconfiguration under way and the machine driving it.
    active: Option<(MachineId, Reconfig)>,
    /// NEW-CONFIG and NEW-CONFIG-COMMIT messages of the active reconfiguration not sent yet:
    /// one goes per step, so that a failure can come between any two (after the store write,
    /// between installs, between commits). Probes and the store write are carried out at once.
    pending: std::collections::VecDeque<Effect>,
    /// Configurations committed.
    pub committed: u64,
    /// The newest configuration announced with ALL-REGIONS-ACTIVE.
    announced: farm_core::ConfigId,
    /// Machines paused now (they neither drive nor answer).
    paused: BTreeSet<MachineId>,
}

impl SimCm {
    /// A CM whose store holds the machines' first configuration.
    pub fn new(machines: &[Arc<MachineState>], replicas: usize) -> Self {
        let store = EmbeddedStore::new();
        let config = machines[0].view().config.clone();
        let version = match store.compare_and_set(None, &farm_cm::codec::encode(&config)) {
            Ok(CasOutcome::Written(v)) => v,
            other => panic!("storing the first configuration: {other:?}"),
        };
        Self {
            store,
            version,
            replicas,
            suspicions: Vec::new(),
            active: None,
            pending: std::collections::VecDeque::new(),
            committed: 0,
            announced: farm_core::ConfigId(1),
            paused: BTreeSet::new(),
        }
    }

    /// The id of the configuration in the coordination store.
    pub fn stored_config(&self) -> farm_core::ConfigId {
        self.stored_configuration().id
    }

    /// The configuration in the coordination store.
    fn stored_configuration(&self) -> farm_core::config::Configuration {
        let (_, bytes) = self
            .store
            .read()
            .expect("embedded store")
            .expect("a configuration is stored from the start");
        farm_cm::codec::decode(&bytes).expect("the CM stores valid configurations")
    }

    /// Marks `machine` paused or running again.
    pub fn set_paused(&mut self, machine: MachineId, paused: bool) {
        if paused {
            self.paused.insert(machine);
        } else {
            self.paused.remove(&machine);
        }
    }

    /// `observer` suspects `machine` from tick `at` on.
    pub fn suspect(&mut self, machine: MachineId, observer: MachineId, at: u64) {
        self.suspicions.push((at, machine, observer));
    }

    /// Whether a reconfiguration is under way.
    pub fn reconfiguring(&self) -> bool {
        self.active.is_some()
    }

    /// Whether a reconfiguration is under way or due.
    pub fn busy(&self) -> bool {
        self.active.is_some() || !self.suspicions.is_empty()
    }

    /// REGIONS-ACTIVE / ALL-REGIONS-ACTIVE (§5.4): once every live member committed the newest
    /// configuration and reports its regions active, every member is told.
    fn announce_all_active(&mut self, fabric: &MemFabric, machines: &[Arc<MachineState>]) {
        let Some(view) = machines
            .iter()
            .filter(|m| fabric.is_alive(m.id))
            .map(|m| m.view())
            .max_by_key(|v| v.config.id)
        else {
            return;
        };
        let config = &view.config;
        if self.announced >= config.id {
            return;
        }
        let members: Vec<&Arc<MachineState>> = config
            .members
            .iter()
            .map(|m| &machines[m.0 as usize])
            .filter(|m| fabric.is_alive(m.id))
            .collect();
        if MachineState::announce_all_active(&members, config.id) {
            self.announced = config.id;
        }
    }

    /// One step: start a reconfiguration for due suspicions, or advance the one under way.
    pub fn step(&mut self, now: u64, fabric: &MemFabric, machines: &[Arc<MachineState>]) {
        self.announce_all_active(fabric, machines);
        if self.active.is_none() {
            self.start(now, fabric, machines);
        }
        let Some((me, r)) = self.active.as_mut() else {
            return;
        };
        let me = *me;
        if self.paused.contains(&me) {
            return; // A paused driver does nothing until it runs again.
        }
        if !fabric.is_alive(me) {
            // The driver died: its suspicions stand, a live machine takes over.
            self.active = None;
            self.pending.clear();
            return;
        }
        r.tick(now);
        self.pending.extend(r.take_effects());
        while let Some(e) = self.pending.pop_front() {
            let message = matches!(e, Effect::SendNewConfig(..) | Effect::SendCommit(..));
            match e {
                Effect::Probe(m) => r.on_probe(m, fabric.reachable(me, m), now),
                Effect::CompareAndSet { expected, data } => {
                    let result = self.store.compare_and_set(Some(expected), &data);
                    if let Ok(CasOutcome::Written(v)) = result {
                        self.version = v;
                    }
                    r.on_store(result);
                }
                Effect::SendNewConfig(m, new) => {
                    if fabric.reachable(me, m) {
                        machines[m.0 as usize]
                            .install(new.config.clone(), new.map.clone(), new.changes.clone())
                            .expect("anonymous NVRAM");
                        r.on_ack(m, new.config.id, now);
                    }
                }
                Effect::SendCommit(m, config) => {
                    if fabric.reachable(me, m) {
                        machines[m.0 as usize].commit_config(config);
                    }
                }
            }
            self.pending.extend(r.take_effects());
            if message {
                break;
            }
        }
        if !self.pending.is_empty() {
            return;
        }
        let Some(outcome) = r.outcome().cloned() else {
            return;
        };
        self.active = None;
        // On failure the suspicions stand: a later step tries again (another machine may have
        // failed a probe meanwhile).
        if let Ok(new) = outcome {
            self.committed += 1;
            // Suspicions by machines removed now are about leases that no longer exist.
            self.suspicions
                .retain(|(_, m, o)| new.config.contains(*m) && new.config.contains(*o));
        }
    }

    fn start(&mut self, now: u64, fabric: &MemFabric, machines: &[Arc<MachineState>]) {
        let due: Vec<(MachineId, MachineId)> = self
            .suspicions
            .iter()
            .filter(|(at, _, _)| *at <= now)
            .map(|(_, m, observer)| (*m, *observer))
            .collect();
        if due.is_empty() {
            return;
        }
        // The newest configuration a live member holds.
        let Some(view) = machines
            .iter()
            .filter(|m| fabric.is_alive(m.id))
            .map(|m| m.view())
            .filter(|v| v.config.members.iter().any(|m| fabric.is_alive(*m)))
            .max_by_key(|v| v.config.id)
        else {
            return;
        };
        let config = attempt_base(&view.config, &self.stored_configuration());
        // Due suspicions of machines already removed, or by them, are settled; later ones
        // stand.
        self.suspicions
            .retain(|(at, m, o)| *at > now || (config.contains(*m) && config.contains(*o)));
        let due: Vec<(MachineId, MachineId)> = due
            .into_iter()
            .filter(|(m, o)| config.contains(*m) && config.contains(*o))
            .collect();
        if due.is_empty() {
            return;
        }
        // As in the runtime (§5.2): the CM removes the members it suspects itself; once the CM
        // is suspected, it does not (a CM paused past its leases would suspect every member on
        // resuming, had it not credited its stall to their leases, while they suspect it), and
        // the first backup CM that runs removes it and those it suspects itself.
        let cm = config.cm;
        let cm_suspected = due.iter().any(|(m, _)| *m == cm);
        let mut order = vec![cm];
        order.extend(backup_cms(&config, config.members.len()));
        let chosen = order
            .into_iter()
            .filter(|d| fabric.is_alive(*d) && !self.paused.contains(d))
            .find_map(|d| {
                let suspects: BTreeSet<MachineId> = due
                    .iter()
                    .filter(|(m, observer)| *observer == d || (d != cm && *m == cm))
                    .map(|(m, _)| *m)
                    .filter(|m| config.contains(*m) && *m != d)
                    .collect();
                let acts = if d == cm {
                    !suspects.is_empty() && !cm_suspected
                } else {
                    suspects.contains(&cm)
                };
                acts.then_some((d, suspects))
            });
        let Some((driver, suspects)) = chosen else {
            return;
        };
        let params = ReconfigParams {
            replicas: self.replicas,
            regions_max: 4096,
            probe_timeout_ticks: LEASE_TICKS,
            lease_ticks: LEASE_TICKS,
        };
        let map: RegionMap = view.map.clone();
        self.active = Some((
            driver,
            Reconfig::start(
                driver,
                config,
                self.version,
                map,
                // The newest configuration's own history (a configuration installed but never
                // committed, when its driver died, counts: its successor starts from it).
                view.changes.clone(),
                suspects,
                params,
                now,
                now,
            ),
        ));
    }
}
