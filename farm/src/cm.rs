//! The control planes of the in-process cluster's machines (FaRM §5.2-5.4): one thread steps
//! every machine's `farm_cm::plane::ControlPlane` (through `farm_txn::control::MachineControl`,
//! as a node's control thread steps its own), with control messages as the `mem` fabric's
//! datagrams, suspicions from the lease threads, probes as one-sided reads and the
//! configuration in the coordination store (embedded or ZooKeeper). A killed machine's plane
//! stops with it. The thread also serves the cluster's administrative requests: adding a spare
//! machine (whose plane then asks the CM to add it, §5.2) and allocating a region (§3).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use farm_cm::placement::{choose_replicas, next_region_id, AllocEffect, RegionAlloc};
use farm_cm::plane::{Event, PlaneParams, ACK_TIMEOUT_LEASES};
use farm_cm::CoordinationStore;
use farm_core::fabric::Fabric;
use farm_core::{ConfigId, MachineId, RegionId};
use farm_fabric::mem::MemFabric;
use farm_txn::control::{MachineControl, REGIONS_PER_MACHINE_MAX};
use farm_txn::MachineState;

use crate::lease_thread::Suspicion;

/// A step of a reconfiguration, with its time (µs since the cluster started), for timelines.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum ReconfigEvent {
    /// A machine's lease expired at another (the CM, or a member suspecting the CM).
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

/// How often unanswered control messages are repeated.
const REPEAT: Duration = Duration::from_millis(2);

/// How long the control thread sleeps while a plane drives a reconfiguration.
const DRIVING_SLEEP: Duration = Duration::from_micros(100);

/// How long a join request waits for the machine to be added.
const JOIN_WAIT_MAX: Duration = Duration::from_secs(30);

/// A spare's request to join, answered once it is a member (or after [`JOIN_WAIT_MAX`]).
struct PendingJoin {
    machine: MachineId,
    reply: std::sync::mpsc::Sender<Result<ConfigId, String>>,
    deadline: Instant,
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
    pub(crate) suspicions: Arc<Mutex<Vec<Suspicion>>>,
    pub(crate) events: Arc<Mutex<Vec<ReconfigEvent>>>,
    pub(crate) epoch: Instant,
    pub(crate) lease: Arc<crate::lease_thread::LeaseLength>,
    pub(crate) replicas: usize,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) requests: Arc<Mutex<Vec<Request>>>,
}

impl CmDriver {
    /// Starts the control thread.
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

fn plane_params(s: &CmShared) -> PlaneParams {
    let lease = s.lease.current().as_micros() as u64;
    PlaneParams {
        replicas: s.replicas,
        regions_max: REGIONS_PER_MACHINE_MAX,
        machines_max: s.machines.len() as u16,
        lease_ticks: lease,
        lease_longest_ticks: s.lease.longest().as_micros() as u64,
        ack_timeout_ticks: ACK_TIMEOUT_LEASES * lease,
        repeat_ticks: REPEAT.as_micros() as u64,
    }
}

fn run(s: CmShared) {
    let now = || s.epoch.elapsed().as_micros() as u64;
    let mut planes: Vec<MachineControl> = s
        .machines
        .iter()
        .map(|m| {
            MachineControl::new(
                m.clone(),
                plane_params(&s),
                s.fabric.clone() as Arc<dyn Fabric>,
                s.store.clone(),
            )
        })
        .collect();
    // Spares stay quiet until asked to join (a plane outside the configuration asks by itself).
    let mut active: Vec<bool> = s
        .machines
        .iter()
        .map(|m| m.view().config.contains(m.id))
        .collect();
    let mut joins: Vec<PendingJoin> = Vec::new();
    let mut lease = (s.lease.current(), s.lease.longest());
    let mut seen = 0;
    while !s.stop.load(Ordering::Relaxed) {
        let requests: Vec<Request> = s.requests.lock().expect("poisoned").drain(..).collect();
        for r in requests {
            match r {
                Request::Join(m, reply) => {
                    let view = s.machines[m.0 as usize].view();
                    if view.config.contains(m) {
                        let _ = reply.send(Err(format!(
                            "machine {m} is already a member of configuration {}",
                            view.config.id.0
                        )));
                    } else {
                        active[m.0 as usize] = true;
                        joins.push(PendingJoin {
                            machine: m,
                            reply,
                            deadline: Instant::now() + JOIN_WAIT_MAX,
                        });
                    }
                }
                Request::AllocateRegion(near, reply) => {
                    let _ = reply.send(allocate_region(&s, near));
                }
                Request::AllocateRegions(count, reply) => {
                    let _ = reply.send(allocate_regions(&s, count, None));
                }
            }
        }
        if (s.lease.current(), s.lease.longest()) != lease {
            lease = (s.lease.current(), s.lease.longest());
            let (current, longest) = (lease.0.as_micros() as u64, lease.1.as_micros() as u64);
            for p in &mut planes {
                p.set_lease(current, longest);
            }
        }
        let fresh: Vec<Suspicion> = {
            let all = s.suspicions.lock().expect("poisoned");
            let fresh = all[seen..].to_vec();
            seen = all.len();
            fresh
        };
        for x in fresh {
            let view = s.machines[x.observer.0 as usize].view();
            if !view.config.contains(x.suspect) || !view.config.contains(x.observer) {
                continue; // About an older configuration.
            }
            s.events
                .lock()
                .expect("poisoned")
                .push(ReconfigEvent::Suspect {
                    machine: x.suspect,
                    at_us: x.at_us,
                });
            if s.reconfigure && s.fabric.is_alive(x.observer) {
                planes[x.observer.0 as usize].on_suspect(x.suspect, now());
            }
        }
        for (i, p) in planes.iter_mut().enumerate() {
            let m = p.machine();
            if !active[i] || !s.fabric.is_alive(m) {
                continue; // A killed machine's plane died with it.
            }
            // No restart exchange runs over datagrams in one process (`restore_machines`).
            p.step(now(), &mut Vec::new());
            record(&s, p.take_events());
        }
        joins.retain(|j| {
            let (m, reply, deadline) = (&j.machine, &j.reply, &j.deadline);
            let machine = &s.machines[m.0 as usize];
            let view = machine.view();
            if view.config.contains(*m) && machine.committed_config() >= view.config.id {
                let _ = reply.send(Ok(view.config.id));
                false
            } else if Instant::now() >= *deadline {
                let _ = reply.send(Err(format!(
                    "machine {m} was not added within {JOIN_WAIT_MAX:?} (is the CM up, and the \
                     configuration settled?)"
                )));
                false
            } else {
                true
            }
        });
        let driving = planes.iter().any(|p| p.reconfiguring());
        std::thread::sleep(if driving || !joins.is_empty() {
            DRIVING_SLEEP
        } else {
            (s.lease.current() / 20).max(Duration::from_micros(200))
        });
    }
}

/// Records a plane's reconfiguration steps in the cluster's timeline.
fn record(s: &CmShared, events: Vec<(u64, Event)>) {
    if events.is_empty() {
        return;
    }
    let mut all = s.events.lock().expect("poisoned");
    for (at_us, e) in events {
        all.push(match e {
            // Suspicions are recorded from the lease threads, with their own time.
            Event::Suspect(_) | Event::Attempt { .. } => continue,
            Event::Probed => ReconfigEvent::Probed { at_us },
            Event::Stored(config) => ReconfigEvent::Stored { config, at_us },
            Event::Committed(c) => ReconfigEvent::Committed {
                config: c.id,
                at_us,
            },
            Event::AllActive(config) => ReconfigEvent::AllActive { config, at_us },
            Event::Failed(reason) => ReconfigEvent::Failed { reason, at_us },
        });
    }
}

/// The newest view of a live member (a partitioned minority may lag behind; spare machines,
/// outside every configuration, know nothing).
fn newest_view(s: &CmShared) -> Option<Arc<farm_txn::machine::View>> {
    s.machines
        .iter()
        .filter(|m| s.fabric.is_alive(m.id))
        .map(|m| (m.id, m.view()))
        .filter(|(id, v)| v.config.contains(*id))
        .map(|(_, v)| v)
        .max_by_key(|v| v.config.id)
}

/// An administrative request for the CM.
#[derive(Debug)]
pub(crate) enum Request {
    /// Add a machine to the configuration.
    Join(MachineId, std::sync::mpsc::Sender<Result<ConfigId, String>>),
    /// Allocate `count` regions (the cluster's initial ones) in one new view.
    AllocateRegions(
        usize,
        std::sync::mpsc::Sender<Result<Vec<RegionId>, String>>,
    ),
    /// Allocate a region, near another one if given.
    AllocateRegion(
        Option<RegionId>,
        std::sync::mpsc::Sender<Result<RegionId, String>>,
    ),
}

/// Region allocation (§3): the next id, replicas chosen for capacity, failure domains and
/// locality, PREPARE at every replica, then the mapping committed everywhere.
fn allocate_region(s: &CmShared, near: Option<RegionId>) -> Result<RegionId, String> {
    allocate_regions(s, 1, near).map(|r| r[0])
}

/// Region allocation of `count` regions at once (the cluster's initial ones): each is chosen
/// and prepared as one allocation is, against the map with the ones before it, and the
/// mapping is committed everywhere once, in one new view, instead of once per region.
fn allocate_regions(
    s: &CmShared,
    count: usize,
    near: Option<RegionId>,
) -> Result<Vec<RegionId>, String> {
    let view = newest_view(s).ok_or("no live member")?;
    let mut map = view.map.clone();
    let mut regions = Vec::with_capacity(count);
    for _ in 0..count {
        let region = next_region_id(&map);
        let replicas = choose_replicas(
            &view.config,
            &map,
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
                        let ok = s.fabric.is_alive(m)
                            && s.machines[m.0 as usize].prepare_region(r).is_ok();
                        alloc.on_prepared(m, ok);
                    }
                    AllocEffect::Commit(_, _, p) => placement = Some(p),
                    AllocEffect::Abort(m, r) => s.machines[m.0 as usize].abort_region(r),
                }
            }
        }
        match alloc.outcome() {
            Some(Ok(_)) => map.insert(region, placement.expect("committed")),
            Some(Err(e)) => return Err(e.to_string()),
            None => return Err("region allocation did not finish".into()),
        }
        regions.push(region);
    }
    // COMMIT: every member learns the mapping; replicas use their prepared NVRAM.
    for m in &view.config.members {
        if s.fabric.reachable(view.config.cm, *m) {
            let target = &s.machines[m.0 as usize];
            let current = target.view();
            target
                .install(current.config.clone(), map.clone(), current.changes.clone())
                .map_err(|e| format!("installing regions {regions:?} at {m}: {e}"))?;
        }
    }
    tracing::info!(regions = regions.len(), "regions allocated");
    Ok(regions)
}
