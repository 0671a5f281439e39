//! The machine runtime every deployment runs (docs/ARCHITECTURE.md, Machines, threads, event
//! loop): for each machine of this process, its lease manager thread (`crate::lease_thread`,
//! §5.1) and its control plane (`farm_txn::control::MachineControl`, the member and driver
//! sides of §5.2-5.4 and region allocation, §3), stepped by a control thread with control
//! messages as fabric datagrams, suspicions from the lease threads, probes as one-sided reads
//! and the configuration in the coordination store (embedded or ZooKeeper).
//!
//! A node ([`crate::node::Node`]) runs one machine; the in-process cluster ([`crate::Cluster`])
//! runs all of its machines here, with one control thread stepping every machine's plane in
//! turn, as one host thread polls worker `t` of every machine (`crate::hosts`). Which
//! machines a thread steps is the only difference: the rules are the machines' own. A machine
//! the fabric reports down (the in-process cluster's kill stops a machine while its threads go
//! on) acts no more, lease manager and plane alike; liveness of others comes only from leases,
//! probes and failed writes.
//!
//! The control thread also serves the process's administrative requests: a spare machine
//! asking to join ([`Request::Join`]: its plane then asks the CM, §5.2) and a member asking its
//! CM for a region ([`Request::AllocateRegion`], §3). After a whole-cluster restart, each
//! machine's plane keeps its finished restart exchange (`farm_cm::restart`) to answer peers that
//! missed an answer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use farm_cm::plane::{Event, PlaneParams, ACK_TIMEOUT_LEASES};
use farm_cm::restart::RestartExchange;
use farm_cm::CoordinationStore;
use farm_core::fabric::Fabric;
use farm_core::{ConfigId, MachineId, RegionId};
use farm_txn::control::{MachineControl, REGIONS_PER_MACHINE_MAX};
use farm_txn::MachineState;

use crate::lease_thread::{LeaseLength, LeaseThreads, Suspicion};

/// A step of a reconfiguration, with its time (µs since the runtime started), for timelines.
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

/// How long the control thread sleeps while a plane drives a reconfiguration or an
/// allocation.
const DRIVING_SLEEP: Duration = Duration::from_micros(100);

/// The shortest wait for NEW-CONFIG-ACKs and probes, whatever the lease: a member acknowledges
/// once its control thread ran and it persisted the view.
const ACK_TIMEOUT_MIN: Duration = Duration::from_millis(100);

/// How long a join request waits for the machine to be added.
const JOIN_WAIT_MAX: Duration = Duration::from_secs(30);

/// Where the answer to an administrative request goes.
pub(crate) type Reply<T> = Sender<Result<T, String>>;

/// An administrative request for the control thread.
#[derive(Debug)]
pub(crate) enum Request {
    /// Add a spare machine to the configuration: its plane asks the CM (§5.2).
    Join(MachineId, Reply<ConfigId>),
    /// Allocate a region, near another one if given: a running member asks its CM (§3).
    AllocateRegion(Option<RegionId>, Reply<RegionId>),
}

/// What a runtime shares with its owner: the record of what happened, and requests.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// Every lease expiry, in order (µs since the runtime started).
    pub(crate) suspicions: Arc<Mutex<Vec<Suspicion>>>,
    /// Reconfiguration steps, in order.
    pub(crate) events: Arc<Mutex<Vec<ReconfigEvent>>>,
    /// Administrative requests not yet taken up by the control thread.
    pub(crate) requests: Arc<Mutex<Vec<Request>>>,
}

/// Hands `request` (made with the reply's sender) to the control thread and waits a minute
/// for its answer.
pub(crate) fn ask<T>(
    shared: &Shared,
    request: impl FnOnce(Reply<T>) -> Request,
) -> Result<T, crate::AdminError> {
    let (tx, rx) = std::sync::mpsc::channel();
    shared
        .requests
        .lock()
        .expect("requests poisoned")
        .push(request(tx));
    rx.recv_timeout(Duration::from_secs(60))
        .map_err(|_| crate::AdminError::NoAnswer)?
        .map_err(crate::AdminError::Refused)
}

/// How to run a set of machines.
pub(crate) struct RuntimeConfig {
    /// The machines.
    pub(crate) machines: Vec<Arc<MachineState>>,
    /// Which of them start quiet (spares, outside the configuration until asked to join).
    pub(crate) spare: Vec<bool>,
    pub(crate) fabric: Arc<dyn Fabric>,
    /// The coordination store; without one, suspicions are only recorded (nobody
    /// reconfigures, and there is no control thread).
    pub(crate) store: Option<Arc<dyn CoordinationStore>>,
    pub(crate) lease: Arc<LeaseLength>,
    /// How much longer the first leases may take (processes start only roughly together).
    pub(crate) start_grace: Duration,
    /// The clock of the runtime, of its events and of the workers' polls.
    pub(crate) epoch: Instant,
    /// Replicas per region.
    pub(crate) replicas: usize,
    /// Whether suspicions start reconfiguration (requests are always served).
    pub(crate) reconfigure: bool,
    /// After a whole-cluster restart: the machines' finished exchanges (any order), which
    /// answer peers that missed an answer.
    pub(crate) restarts: Vec<RestartExchange>,
}

/// The lease threads and the control thread of a set of machines. See the module docs.
#[derive(Debug)]
pub(crate) struct Runtime {
    leases: LeaseThreads,
    control: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

impl Runtime {
    /// Starts the machines' lease threads and, with a store, their control thread.
    pub(crate) fn start(config: RuntimeConfig, shared: &Shared) -> Self {
        assert_eq!(config.machines.len(), config.spare.len());
        let stop = Arc::new(AtomicBool::new(false));
        let leases = LeaseThreads::start(
            &config.machines,
            config.lease.clone(),
            config.fabric.clone(),
            config.epoch,
            config.start_grace,
            stop.clone(),
            shared.suspicions.clone(),
        );
        let control = config.store.clone().map(|store| {
            let thread = ControlThread::new(config, store, shared, stop.clone());
            std::thread::Builder::new()
                .name("farm-control".into())
                .spawn(move || thread.run())
                .expect("spawn control thread")
        });
        Self {
            leases,
            control,
            stop,
        }
    }

    /// Stops the threads and waits for them.
    pub(crate) fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.leases.join();
        if let Some(c) = self.control.take() {
            let _ = c.join();
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The parameters of a machine's plane: leases as in force, the ack timeout
/// [`ACK_TIMEOUT_LEASES`] leases and at least [`ACK_TIMEOUT_MIN`].
fn plane_params(lease: &LeaseLength, replicas: usize, machines_max: u16) -> PlaneParams {
    let current = lease.current();
    PlaneParams {
        replicas,
        regions_max: REGIONS_PER_MACHINE_MAX,
        machines_max,
        lease_ticks: current.as_micros() as u64,
        lease_longest_ticks: lease.longest().as_micros() as u64,
        ack_timeout_ticks: (current * ACK_TIMEOUT_LEASES as u32)
            .max(ACK_TIMEOUT_MIN)
            .as_micros() as u64,
        repeat_ticks: REPEAT.as_micros() as u64,
    }
}

/// A spare's request to join, answered once it is a member (or after [`JOIN_WAIT_MAX`]).
struct PendingJoin {
    machine: usize,
    reply: Reply<ConfigId>,
    deadline: Instant,
}

/// A region allocation under way: the machine that asked, its request, the caller.
struct PendingAllocation {
    machine: usize,
    request: u64,
    reply: Reply<RegionId>,
}

/// One machine's plane as the control thread steps it.
struct Stepped {
    control: MachineControl,
    /// A spare stays quiet until asked to join (a plane outside the configuration asks by
    /// itself).
    active: bool,
}

struct ControlThread {
    machines: Vec<Arc<MachineState>>,
    planes: Vec<Stepped>,
    fabric: Arc<dyn Fabric>,
    suspicions: Arc<Mutex<Vec<Suspicion>>>,
    events: Arc<Mutex<Vec<ReconfigEvent>>>,
    requests: Arc<Mutex<Vec<Request>>>,
    lease: Arc<LeaseLength>,
    epoch: Instant,
    reconfigure: bool,
    stop: Arc<AtomicBool>,
    joins: Vec<PendingJoin>,
    allocations: Vec<PendingAllocation>,
}

impl ControlThread {
    fn new(
        config: RuntimeConfig,
        store: Arc<dyn CoordinationStore>,
        shared: &Shared,
        stop: Arc<AtomicBool>,
    ) -> Self {
        let mut planes = config
            .machines
            .iter()
            .zip(&config.spare)
            .map(|(m, spare)| Stepped {
                control: MachineControl::new(
                    m.clone(),
                    plane_params(&config.lease, config.replicas, m.params.layout.machines_max),
                    config.fabric.clone(),
                    store.clone(),
                ),
                active: !spare,
            })
            .collect::<Vec<_>>();
        for exchange in config.restarts {
            let i = config
                .machines
                .iter()
                .position(|m| m.id == exchange.machine())
                .expect("a restart exchange of a machine of this runtime");
            planes[i].control.set_restart(exchange);
        }
        Self {
            machines: config.machines,
            planes,
            fabric: config.fabric,
            suspicions: shared.suspicions.clone(),
            events: shared.events.clone(),
            requests: shared.requests.clone(),
            lease: config.lease,
            epoch: config.epoch,
            reconfigure: config.reconfigure,
            stop,
            joins: Vec::new(),
            allocations: Vec::new(),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Whether machine `i` still runs (a killed machine's plane died with it).
    fn runs(&self, i: usize) -> bool {
        self.planes[i].active && self.fabric.is_up(self.machines[i].id)
    }

    fn run(mut self) {
        let mut lease = (self.lease.current(), self.lease.longest());
        let mut seen = 0;
        while !self.stop.load(Ordering::Relaxed) {
            let requests: Vec<Request> =
                self.requests.lock().expect("poisoned").drain(..).collect();
            for r in requests {
                self.take_up(r);
            }
            if (self.lease.current(), self.lease.longest()) != lease {
                lease = (self.lease.current(), self.lease.longest());
                let (current, longest) = (lease.0.as_micros() as u64, lease.1.as_micros() as u64);
                for p in &mut self.planes {
                    p.control.set_lease(current, longest);
                }
            }
            let fresh: Vec<Suspicion> = {
                let all = self.suspicions.lock().expect("poisoned");
                let fresh = all[seen..].to_vec();
                seen = all.len();
                fresh
            };
            for x in fresh {
                self.on_suspicion(x);
            }
            for i in 0..self.planes.len() {
                if !self.runs(i) {
                    continue;
                }
                let now = self.now();
                self.planes[i].control.step(now);
                let events = self.planes[i].control.take_events();
                self.record(events);
                for (request, result) in self.planes[i].control.take_allocated() {
                    let k = self
                        .allocations
                        .iter()
                        .position(|a| a.machine == i && a.request == request);
                    if let Some(k) = k {
                        let a = self.allocations.swap_remove(k);
                        let _ = a.reply.send(result.map(|regions| regions[0]));
                    }
                }
            }
            self.answer_joins();
            self.drop_stopped_allocations();
            let driving = (0..self.planes.len()).any(|i| {
                let c = &self.planes[i].control;
                self.runs(i) && !c.evicted() && (c.reconfiguring() || c.allocating())
            });
            std::thread::sleep(if driving || !self.joins.is_empty() {
                DRIVING_SLEEP
            } else {
                (self.lease.current() / 20).max(Duration::from_micros(200))
            });
        }
    }

    fn take_up(&mut self, r: Request) {
        match r {
            Request::Join(m, reply) => {
                let Some(i) = self.machines.iter().position(|x| x.id == m) else {
                    let _ = reply.send(Err(format!("machine {m} does not run here")));
                    return;
                };
                let view = self.machines[i].view();
                if view.config.contains(m) {
                    let _ = reply.send(Err(format!(
                        "machine {m} is already a member of configuration {}",
                        view.config.id.0
                    )));
                } else {
                    self.planes[i].active = true;
                    self.joins.push(PendingJoin {
                        machine: i,
                        reply,
                        deadline: Instant::now() + JOIN_WAIT_MAX,
                    });
                }
            }
            Request::AllocateRegion(near, reply) => {
                // Any running member asks (the caller is no machine in particular): the first
                // that runs and is in its configuration.
                let asker = (0..self.planes.len()).find(|i| {
                    let m = &self.machines[*i];
                    self.runs(*i) && !m.is_evicted() && m.view().config.contains(m.id)
                });
                let Some(i) = asker else {
                    let _ = reply.send(Err("no member runs here to ask the CM".into()));
                    return;
                };
                let now = self.now();
                let request = self.planes[i].control.allocate(1, near, now);
                self.allocations.push(PendingAllocation {
                    machine: i,
                    request,
                    reply,
                });
            }
        }
    }

    /// Answers the allocations whose asking machine stopped or was removed: nobody will.
    fn drop_stopped_allocations(&mut self) {
        let stopped: Vec<usize> = (0..self.planes.len())
            .filter(|i| !self.runs(*i) || self.planes[*i].control.evicted())
            .collect();
        let machines = &self.machines;
        self.allocations.retain(|a| {
            if !stopped.contains(&a.machine) {
                return true;
            }
            let _ = a.reply.send(Err(format!(
                "machine {} stopped, or was removed, before its request was answered",
                machines[a.machine].id
            )));
            false
        });
    }

    /// A lease expiry: recorded, and handed to the observer's plane (which ignores one about
    /// an older configuration).
    fn on_suspicion(&mut self, x: Suspicion) {
        let Some(i) = self.machines.iter().position(|m| m.id == x.observer) else {
            return;
        };
        let view = self.machines[i].view();
        if !view.config.contains(x.suspect) || !view.config.contains(x.observer) {
            return; // About an older configuration.
        }
        self.events
            .lock()
            .expect("poisoned")
            .push(ReconfigEvent::Suspect {
                machine: x.suspect,
                at_us: x.at_us,
            });
        if self.reconfigure && self.runs(i) {
            let now = self.now();
            self.planes[i].control.on_suspect(x.suspect, now);
        }
    }

    /// Answers the spares whose join completed or timed out.
    fn answer_joins(&mut self) {
        let machines = &self.machines;
        self.joins.retain(|j| {
            let machine = &machines[j.machine];
            let view = machine.view();
            if view.config.contains(machine.id) && machine.committed_config() >= view.config.id {
                let _ = j.reply.send(Ok(view.config.id));
                false
            } else if Instant::now() >= j.deadline {
                let _ = j.reply.send(Err(format!(
                    "machine {} was not added within {JOIN_WAIT_MAX:?} (is the CM up, and the \
                     configuration settled?)",
                    machine.id
                )));
                false
            } else {
                true
            }
        });
    }

    /// Records a plane's reconfiguration steps in the timeline.
    fn record(&self, events: Vec<(u64, Event)>) {
        if events.is_empty() {
            return;
        }
        let mut all = self.events.lock().expect("poisoned");
        for (at_us, e) in events {
            all.push(match e {
                // Suspicions are recorded from the lease threads, with their own time; an
                // attempt also suspects the machines no lease expiry named since the last
                // configuration (a link that broke to them: `Fabric::broken_members`).
                Event::Attempt { suspects, .. } => {
                    for machine in suspects {
                        let known = (all.iter().rev())
                            .take_while(|e| !matches!(e, ReconfigEvent::Committed { .. }))
                            .any(|e| {
                                matches!(e, ReconfigEvent::Suspect { machine: m, .. } if *m == machine)
                            });
                        if !known {
                            all.push(ReconfigEvent::Suspect { machine, at_us });
                        }
                    }
                    continue;
                }
                Event::Suspect(_) => continue,
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
}
