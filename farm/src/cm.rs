//! The configuration manager's driver in the in-process runtime (FaRM §5.2): it watches the
//! lease threads' suspicions and runs a [`Reconfig`] as the machine that must drive it (the CM
//! when a member is suspected; the first backup CM when the CM is), carrying out its effects:
//! probes are one-sided reads through the fabric, the compare-and-set goes to the coordination
//! store (embedded or ZooKeeper), NEW-CONFIG installs the configuration at each member, and
//! NEW-CONFIG-COMMIT ends it and starts transaction recovery in the members' workers (§5.3).
//! Once every member reports its regions active (REGIONS-ACTIVE), it announces
//! ALL-REGIONS-ACTIVE, which starts data and allocator recovery (§5.4-5.5).
//!
//! In-process, NEW-CONFIG and its ack, NEW-CONFIG-COMMIT, REGIONS-ACTIVE and ALL-REGIONS-ACTIVE
//! are calls into the members' state rather than messages through their queues; the message
//! encoding arrives with one process per machine.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use farm_cm::placement::{choose_replicas, next_region_id, AllocEffect, RegionAlloc};
use farm_cm::reconfig::{backup_cms, Effect, Reconfig, ReconfigParams};
use farm_cm::remap::RegionChanges;
use farm_cm::{CasOutcome, CoordinationStore, StoreVersion};
use farm_core::mem_fabric::MemFabric;
use farm_core::{ConfigId, MachineId, RegionId};
use farm_txn::MachineState;

use crate::lease_thread::Suspicion;

/// A step of a reconfiguration, with its time (µs since the cluster started), for timelines.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum ReconfigEvent {
    /// The driver took up a suspicion.
    Suspect {
        /// Who is suspected.
        machine: MachineId,
        /// When.
        at_us: u64,
    },
    /// Every probe answered or failed.
    Probed {
        /// When.
        at_us: u64,
    },
    /// The coordination store accepted the new configuration.
    Stored {
        /// The configuration.
        config: ConfigId,
        /// When.
        at_us: u64,
    },
    /// NEW-CONFIG-COMMIT was sent for the configuration.
    Committed {
        /// The configuration.
        config: ConfigId,
        /// When.
        at_us: u64,
    },
    /// Every region was active again (REGIONS-ACTIVE from every member, §5.4) and the CM sent
    /// ALL-REGIONS-ACTIVE: data recovery and allocator recovery start.
    AllActive {
        /// The configuration.
        config: ConfigId,
        /// When.
        at_us: u64,
    },
    /// An attempt ended without a new configuration.
    Failed {
        /// Why.
        reason: String,
        /// When.
        at_us: u64,
    },
}

pub(crate) struct CmDriver {
    handle: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for CmDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmDriver").finish_non_exhaustive()
    }
}

pub(crate) struct CmShared {
    /// Whether suspicions start reconfiguration (requests are always served).
    pub(crate) reconfigure: bool,
    pub(crate) machines: Vec<Arc<MachineState>>,
    pub(crate) fabric: Arc<MemFabric>,
    pub(crate) store: Arc<dyn CoordinationStore>,
    pub(crate) store_version: StoreVersion,
    /// The configuration stored at `store_version`.
    pub(crate) stored_config: farm_core::config::Configuration,
    pub(crate) suspicions: Arc<Mutex<Vec<Suspicion>>>,
    pub(crate) events: Arc<Mutex<Vec<ReconfigEvent>>>,
    pub(crate) epoch: Instant,
    pub(crate) lease: Arc<crate::lease_thread::LeaseLength>,
    pub(crate) replicas: usize,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) requests: Arc<Mutex<Vec<Request>>>,
}

impl CmDriver {
    /// Starts the driver thread.
    pub(crate) fn start(shared: CmShared) -> Self {
        let handle = std::thread::Builder::new()
            .name("farm-cm".into())
            .spawn(move || run(shared))
            .expect("spawn CM thread");
        Self {
            handle: Some(handle),
        }
    }

    pub(crate) fn join(&mut self) {
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// A suspected CM not yet replaced: who suspected it, and how many attempts were made.
struct CmSuspicion {
    config: ConfigId,
    cm: MachineId,
    observers: BTreeSet<MachineId>,
    attempts: usize,
    next_attempt: Instant,
}

fn run(mut s: CmShared) {
    let mut seen = 0;
    let mut cm_suspicion: Option<CmSuspicion> = None;
    let mut announced = ConfigId(1);
    while !s.stop.load(Ordering::Relaxed) {
        std::thread::sleep((s.lease.current() / 10).max(Duration::from_micros(200)));
        let requests: Vec<Request> = s.requests.lock().expect("poisoned").drain(..).collect();
        for r in requests {
            serve(&mut s, r);
        }
        let fresh: Vec<Suspicion> = {
            let all = s.suspicions.lock().expect("poisoned");
            let fresh = all[seen..].to_vec();
            seen = all.len();
            fresh
        };
        if !s.reconfigure {
            continue;
        }
        let Some(view) = newest_view(&s) else {
            continue;
        };
        let config = view.config.clone();
        // Timestamped before the members hear of it, so that it precedes what it starts.
        let at_us = s.epoch.elapsed().as_micros() as u64;
        if announced < config.id && all_regions_active(&s, &config) {
            announced = config.id;
            s.events
                .lock()
                .expect("poisoned")
                .push(ReconfigEvent::AllActive {
                    config: config.id,
                    at_us,
                });
        }
        if cm_suspicion.as_ref().is_some_and(|c| c.config != config.id) {
            cm_suspicion = None; // Resolved by a new configuration.
        }
        let mut suspects = BTreeSet::new();
        for x in fresh {
            if !config.contains(x.suspect) || !config.contains(x.observer) {
                continue; // About an older configuration.
            }
            s.events
                .lock()
                .expect("poisoned")
                .push(ReconfigEvent::Suspect {
                    machine: x.suspect,
                    at_us: x.at_us,
                });
            if x.observer == config.cm {
                suspects.insert(x.suspect);
            } else if x.suspect == config.cm {
                cm_suspicion
                    .get_or_insert_with(|| CmSuspicion {
                        config: config.id,
                        cm: config.cm,
                        observers: BTreeSet::new(),
                        attempts: 0,
                        next_attempt: Instant::now() + 2 * s.lease.current(),
                    })
                    .observers
                    .insert(x.observer);
            }
        }
        // The CM removes the members it suspects (§5.2 step 1).
        if !suspects.is_empty() && s.fabric.is_alive(config.cm) {
            let _ = reconfigure(
                &mut s,
                config.cm,
                config.clone(),
                view.map.clone(),
                view.changes.clone(),
                suspects,
            );
            continue;
        }
        // A suspected CM is replaced by its backup CMs in consistent-hashing order (§5.2): the
        // next one in line takes over once it suspects the CM itself; if it does not within a
        // timeout, or its attempt produces no configuration, the one after it tries, and so on
        // through every member.
        let Some(c) = cm_suspicion.as_mut() else {
            continue;
        };
        let order = backup_cms(&config, config.members.len());
        if order.is_empty() {
            continue;
        }
        let candidate = order[c.attempts % order.len()];
        let ready = c.observers.contains(&candidate) && s.fabric.is_alive(candidate);
        if !ready {
            if Instant::now() >= c.next_attempt {
                c.attempts += 1;
                c.next_attempt = Instant::now() + 2 * s.lease.current();
            }
            continue;
        }
        let driver = candidate;
        c.attempts += 1;
        c.next_attempt = Instant::now() + 2 * s.lease.current();
        let cm = c.cm;
        let _ = reconfigure(
            &mut s,
            driver,
            config.clone(),
            view.map.clone(),
            view.changes.clone(),
            BTreeSet::from([cm]),
        );
    }
}

/// REGIONS-ACTIVE and ALL-REGIONS-ACTIVE (§5.4), in-process: once every live member of
/// `config` has committed it and reports every region it is primary of active, every member
/// is told, and data and allocator recovery start. Returns whether that happened.
fn all_regions_active(s: &CmShared, config: &farm_core::config::Configuration) -> bool {
    let cm = config.cm;
    let members: Vec<&Arc<MachineState>> = config
        .members
        .iter()
        .map(|m| &s.machines[m.0 as usize])
        .filter(|m| s.fabric.reachable(cm, m.id))
        .collect();
    MachineState::announce_all_active(&members, config.id)
}

/// The newest configuration any live member has (a partitioned minority may lag behind; spare
/// machines, outside every configuration, know nothing).
fn newest_view(s: &CmShared) -> Option<Arc<farm_txn::machine::View>> {
    s.machines
        .iter()
        .filter(|m| s.fabric.is_alive(m.id))
        .map(|m| (m.id, m.view()))
        .filter(|(id, v)| v.config.contains(*id))
        .map(|(_, v)| v)
        .max_by_key(|v| v.config.id)
}

fn params(s: &CmShared) -> ReconfigParams {
    ReconfigParams {
        replicas: s.replicas,
        regions_max: REGIONS_PER_MACHINE_MAX,
        probe_timeout_ticks: s.lease.current().as_micros() as u64,
        // A machine removed for a failed probe may hold a lease granted under any length
        // in force so far.
        lease_ticks: s.lease.longest().as_micros() as u64,
    }
}

/// Region replicas one machine may hold.
const REGIONS_PER_MACHINE_MAX: usize = 4096;

fn reconfigure(
    s: &mut CmShared,
    me: MachineId,
    config: farm_core::config::Configuration,
    map: farm_core::config::RegionMap,
    changes: BTreeMap<RegionId, RegionChanges>,
    suspects: BTreeSet<MachineId>,
) -> Result<ConfigId, String> {
    let epoch = s.epoch;
    let now = move || epoch.elapsed().as_micros() as u64;
    let params = params(s);
    let start = now();
    // Suspects' leases have expired by definition (that is how they became suspects); a machine
    // that fails a probe may still hold one, and the state machine waits that out (step 7).
    let r = Reconfig::start(
        me,
        farm_cm::reconfig::attempt_base(&config, &s.stored_config),
        s.store_version,
        map,
        changes,
        suspects,
        params,
        start,
        start,
    );
    drive(s, me, r)
}

/// Carries out a reconfiguration's effects until it ends; returns the committed configuration.
fn drive(s: &mut CmShared, me: MachineId, mut r: Reconfig) -> Result<ConfigId, String> {
    let epoch = s.epoch;
    let now = move || epoch.elapsed().as_micros() as u64;
    let mut probed = false;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(
            Instant::now() < deadline,
            "reconfiguration by {me} did not finish in 30 s"
        );
        if s.stop.load(Ordering::Relaxed) || !s.fabric.is_alive(me) {
            // The driver's machine crashed (or the cluster is going away): so does the attempt.
            tracing::warn!(
                driver = me.0,
                "reconfiguration abandoned: its driver stopped"
            );
            return Err(format!("driver {me} stopped"));
        }
        let effects = r.take_effects();
        if effects.is_empty() && r.outcome().is_some() {
            break;
        }
        for e in effects {
            match e {
                Effect::Probe(m) => {
                    r.on_probe(m, farm_txn::control::probe(&*s.fabric, me, m), now())
                }
                Effect::CompareAndSet { expected, data } => {
                    if !probed {
                        probed = true;
                        s.events
                            .lock()
                            .expect("poisoned")
                            .push(ReconfigEvent::Probed { at_us: now() });
                    }
                    let result = s.store.compare_and_set(Some(expected), &data);
                    if let Ok(CasOutcome::Written(v)) = result {
                        s.store_version = v;
                        s.stored_config = farm_cm::codec::decode(&data)
                            .expect("the CM stores valid configurations");
                    }
                    r.on_store(result);
                }
                Effect::SendNewConfig(m, new) => {
                    if probed {
                        probed = false;
                        s.events
                            .lock()
                            .expect("poisoned")
                            .push(ReconfigEvent::Stored {
                                config: new.config.id,
                                at_us: now(),
                            });
                    }
                    let target = &s.machines[m.0 as usize];
                    if s.fabric.reachable(me, m) {
                        target
                            .install(new.config.clone(), new.map.clone(), new.changes.clone())
                            .expect("NVRAM for new replicas");
                        r.on_ack(m, new.config.id, now());
                    }
                }
                // NEW-CONFIG-COMMIT: transaction recovery starts at the member (§5.3).
                Effect::SendCommit(m, config) => {
                    if s.fabric.reachable(me, m) {
                        s.machines[m.0 as usize].commit_config(config);
                    }
                }
            }
        }
        r.tick(now());
        std::thread::sleep(Duration::from_micros(100));
    }
    match r.outcome().expect("finished") {
        Ok(new) => {
            // Members removed while alive learn it (their leases are not renewed; in-process,
            // a call), and members of the new configuration are in.
            for m in &s.machines {
                m.set_evicted(!new.config.contains(m.id) && m.view().config.contains(m.id));
            }
            tracing::info!(config = new.config.id.0, members = ?new.config.members, cm = new.config.cm.0, "configuration committed");
            s.events
                .lock()
                .expect("poisoned")
                .push(ReconfigEvent::Committed {
                    config: new.config.id,
                    at_us: now(),
                });
            Ok(new.config.id)
        }
        Err(e) => {
            tracing::warn!(error = %e, "reconfiguration failed");
            s.events
                .lock()
                .expect("poisoned")
                .push(ReconfigEvent::Failed {
                    reason: e.to_string(),
                    at_us: now(),
                });
            Err(e.to_string())
        }
    }
}

/// An administrative request for the CM.
#[derive(Debug)]
pub(crate) enum Request {
    /// Add a machine to the configuration.
    Join(MachineId, std::sync::mpsc::Sender<Result<ConfigId, String>>),
    /// Allocate a region, near another one if given.
    AllocateRegion(
        Option<RegionId>,
        std::sync::mpsc::Sender<Result<RegionId, String>>,
    ),
}

fn serve(s: &mut CmShared, request: Request) {
    let Some(view) = newest_view(s) else {
        return;
    };
    let cm = view.config.cm;
    match request {
        Request::Join(m, reply) => {
            let result = if view.config.contains(m) {
                Err(format!(
                    "machine {m} is already a member of configuration {}",
                    view.config.id.0
                ))
            } else if !s.fabric.is_alive(cm) {
                Err(format!(
                    "the CM {cm} is down; try again after reconfiguration"
                ))
            } else {
                let now = s.epoch.elapsed().as_micros() as u64;
                let joiners = BTreeMap::from([(m, m.0 as u32)]);
                let r = Reconfig::start_join(
                    cm,
                    farm_cm::reconfig::attempt_base(&view.config, &s.stored_config),
                    s.store_version,
                    view.map.clone(),
                    view.changes.clone(),
                    joiners,
                    params(s),
                    now,
                );
                drive(s, cm, r).and_then(|id| {
                    if s.machines[m.0 as usize].view().config.contains(m) {
                        Ok(id)
                    } else {
                        Err(format!("machine {m} did not answer the probe"))
                    }
                })
            };
            let _ = reply.send(result);
        }
        Request::AllocateRegion(near, reply) => {
            let _ = reply.send(allocate_region(s, &view, near));
        }
    }
}

/// Region allocation (§3): the next id, replicas chosen for capacity, failure domains and
/// locality, PREPARE at every replica, then the mapping committed everywhere.
fn allocate_region(
    s: &CmShared,
    view: &farm_txn::machine::View,
    near: Option<RegionId>,
) -> Result<RegionId, String> {
    let region = next_region_id(&view.map);
    let replicas = choose_replicas(
        &view.config,
        &view.map,
        s.replicas,
        REGIONS_PER_MACHINE_MAX,
        near,
    )
    .map_err(|e| e.to_string())?;
    let mut alloc = RegionAlloc::start(region, replicas);
    let mut placement = None;
    while alloc.outcome().is_none() || placement.is_none() {
        let effects = alloc.take_effects();
        if effects.is_empty() {
            break;
        }
        for e in effects {
            match e {
                AllocEffect::Prepare(m, r) => {
                    let ok =
                        s.fabric.is_alive(m) && s.machines[m.0 as usize].prepare_region(r).is_ok();
                    alloc.on_prepared(m, ok);
                }
                AllocEffect::Commit(_, _, p) => placement = Some(p),
                AllocEffect::Abort(m, r) => s.machines[m.0 as usize].abort_region(r),
            }
        }
    }
    match alloc.outcome() {
        Some(Ok(_)) => {
            let p = placement.expect("committed");
            let mut map = view.map.clone();
            map.insert(region, p);
            // COMMIT: every member learns the mapping; replicas use their prepared NVRAM.
            for m in &view.config.members {
                if s.fabric.reachable(view.config.cm, *m) {
                    let target = &s.machines[m.0 as usize];
                    let current = target.view();
                    target
                        .install(current.config.clone(), map.clone(), current.changes.clone())
                        .map_err(|e| format!("installing region {} at {m}: {e}", region.0))?;
                }
            }
            tracing::info!(region = region.0, "region allocated");
            Ok(region)
        }
        Some(Err(e)) => Err(e.to_string()),
        None => Err("region allocation did not finish".into()),
    }
}
