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
    // Allocation requests under way: the machine that asked, its request and the caller.
    let mut allocations: Vec<(usize, u64, RegionReply)> = Vec::new();
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
                    // Any running member asks (the cluster's client is no machine in
                    // particular): the first one that runs and is in its configuration.
                    let asker = planes.iter_mut().enumerate().find(|(i, p)| {
                        let m = &s.machines[*i];
                        active[*i]
                            && s.fabric.is_alive(p.machine())
                            && m.view().config.contains(m.id)
                    });
                    match asker {
                        Some((i, p)) => allocations.push((i, p.allocate(1, near, now()), reply)),
                        None => {
                            let _ = reply.send(Err("no machine runs to ask the CM".into()));
                        }
                    }
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
            for (request, result) in p.take_allocated() {
                if let Some(k) = allocations
                    .iter()
                    .position(|(asker, r, _)| *asker == i && *r == request)
                {
                    let (_, _, reply) = allocations.swap_remove(k);
                    let _ = reply.send(result.map(|regions| regions[0]));
                }
            }
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
        let driving = planes.iter().any(|p| p.reconfiguring() || p.allocating());
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

/// Where the answer to a region allocation goes.
type RegionReply = std::sync::mpsc::Sender<Result<RegionId, String>>;

/// An administrative request for the CM.
#[derive(Debug)]
pub(crate) enum Request {
    /// Add a machine to the configuration.
    Join(MachineId, std::sync::mpsc::Sender<Result<ConfigId, String>>),
    /// Allocate a region, near another one if given: a member asks its CM (§3).
    AllocateRegion(Option<RegionId>, RegionReply),
}
