//! One machine per process: a [`Node`] runs machine `m` of a cluster whose machines are separate
//! processes, on one host over the `shm` fabric or on several over the `tcp` fabric
//! ([`Transport`]; docs/ARCHITECTURE.md, Fabric): it takes the machine's liveness lock, maps its NVRAM
//! under `<dir>/m<id>/` (where, on one host, its peers map it too) and runs its lease thread
//! with the CM of its configuration (§5.1), over UDP datagrams.
//!
//! Its worker threads run transactions coordinated here ([`Node::txn`]) and serve the commit
//! protocol for every peer: reads of remote objects are one-sided reads of the peer's region
//! (its mapped file, or its NIC thread over tcp), and LOCK, COMMIT-BACKUP and COMMIT-PRIMARY
//! records are one-sided writes into the peers' logs (§4), as in the in-process cluster.
//!
//! The cluster's first configuration has the regions of [`RegionMap::striped`] (every machine
//! computes the same map). With ZooKeeper ([`NodeConfig::zookeeper`]) the configuration lives
//! there and the machine's control thread (`crate::machine`, the runtime the in-process cluster
//! runs too) reconfigures when a machine fails (§5.2-5.4) and allocates regions
//! ([`Node::allocate_region`], §3); without it, a suspicion is only recorded
//! ([`Node::suspicions`]). With [`NodeConfig::restart`], every machine of a stopped cluster
//! restarts from its NVRAM (`node_restart`), and with [`NodeConfig::join`] a new incarnation
//! of a removed machine joins the running cluster.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use farm_cm::ConfigurationStore;
use farm_core::config::{Configuration, RegionMap};
use farm_core::fabric::Fabric;
use farm_core::ring::RingLayout;
use farm_core::{MachineId, ThreadId};
pub use farm_fabric::auth::Secret;
use farm_fabric::process::{ProcessFabric, StartError};
use farm_fabric::shm::ShmFabric;
use farm_fabric::tcp::TcpFabric;
use farm_txn::{MachineState, Params, Replication, TxError, Worker};

use crate::hosts::{Host, Hosts, IdleWait};
use crate::lease_thread::{LeaseLength, Suspicion};
use crate::machine::{Request, Runtime, RuntimeConfig, Shared};
use crate::ReconfigEvent;
use crate::Txn;

/// How to run one machine of a multi-process cluster.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The NVRAM directory (each machine's files under `m<id>/`): over `shm` the cluster's,
    /// shared by every process; over `tcp` this machine's own (it may be shared too).
    pub dir: PathBuf,
    /// The cluster's id: datagrams of other clusters are dropped.
    pub cluster: u64,
    /// The machine this process runs.
    pub machine: MachineId,
    /// Machines of the first configuration (machine 0 is its CM).
    pub machines: u16,
    /// Worker threads per machine (one ring per peer thread).
    pub workers: u16,
    /// Over `shm`: the datagram port of machine 0; machine `m` listens at `base_port + m` on
    /// loopback. (Over `tcp` the addresses are [`Transport::Tcp`]'s.)
    pub base_port: u16,
    /// Lease length.
    pub lease: Duration,
    /// How long to wait at start for every machine of the first configuration to run.
    pub start_timeout: Duration,
    /// Regions each machine is primary of in the first configuration.
    pub regions_per_machine: u32,
    /// Replicas of each region (primary included).
    pub replicas: u16,
    /// The ZooKeeper ensemble (`host:port,...`) and the cluster's znode (`/farm/name`) that
    /// hold its configuration. Without it, suspicions are only recorded: nobody reconfigures.
    pub zookeeper: Option<(String, String)>,
    /// Bytes per region.
    pub region_bytes: usize,
    /// Restart this machine from its NVRAM under `dir`, as part of a whole-cluster restart:
    /// every machine of the cluster starts with it, machine 0 decides the restart
    /// configuration from the views all of them left (stored in ZooKeeper, which a restart
    /// needs), and each member recovers what its logs hold (§5.3). Without it, a node refuses
    /// a directory that holds its machine's state.
    pub restart: bool,
    /// With `restart`: how long the machines wait for every machine before the lowest that came
    /// back (machine 0 if it did) restarts without those that did not come back (a machine whose disk died with the power), which it does
    /// only if every region keeps a complete replica among the machines that came back and they
    /// are a majority of the newest configuration's members (`farm_cm::restart::LeaveOut`);
    /// otherwise it goes on waiting until `start_timeout`, and says why. Those left out are
    /// removed as a reconfiguration removes a failed machine, and their regions get new
    /// replicas, copied after the restart (§5.4); a machine left out joins again later as a
    /// new incarnation (`join`). `None`: every machine is waited for.
    pub restart_without_after: Option<Duration>,
    /// Join the running cluster in ZooKeeper (which a join needs) as a new incarnation of
    /// this machine: whatever its NVRAM holds is forgotten, it waits until the cluster removed
    /// any earlier life of it, then asks the CM to add it (§5.2) and receives replicas of
    /// regions short of them (§5.4). See [`Node::wait_joined`].
    pub join: bool,
    /// How the machines reach each other.
    pub transport: Transport,
    /// The cluster's shared secret (docs/ARCHITECTURE.md, Security): every connection proves
    /// it before its first one-sided operation and every datagram carries a tag under it, so
    /// that a process without it reads nothing, writes nothing and sends nothing a machine
    /// acts on. Read it from a file only its owner may read ([`Secret::load`]).
    pub secret: Secret,
}

/// The fabric of a node (docs/ARCHITECTURE.md, Fabric).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// One host: peers map each other's NVRAM files under the shared `dir`; datagrams over
    /// UDP on loopback at `base_port + m`.
    Shm,
    /// Several hosts: machine `m` listens at `addrs[m]` (TCP for one-sided operations, UDP
    /// for datagrams); `dir` holds this machine's NVRAM only. An operation unanswered for
    /// `timeout` fails, and a peer whose connection broke stays unreachable while it is a
    /// member (see `farm_fabric::tcp`).
    Tcp {
        /// Each machine's address.
        addrs: Vec<std::net::SocketAddr>,
        /// How long an operation may wait for its answer.
        timeout: Duration,
    },
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Bad configuration, named.
    #[error("invalid node configuration: {0}")]
    Invalid(String),
    /// The fabric could not start (another process runs this machine, or I/O).
    #[error(transparent)]
    Fabric(#[from] StartError),
    /// Machines of the first configuration that did not start in time.
    #[error("machines {missing:?} of the first configuration did not start within {waited:?}")]
    PeersMissing {
        /// The machines not running.
        missing: Vec<MachineId>,
        /// How long the node waited.
        waited: Duration,
    },
    /// The coordination store failed or holds something this node cannot start from.
    #[error("coordination store: {0}")]
    Store(String),
    /// Another machine's part of a whole-cluster restart failed, one this machine cannot
    /// restart without (the restart's decider, or a member of the restart configuration).
    #[error("machine {machine} refused the restart: {reason}")]
    PeerRefused {
        /// The machine whose part failed.
        machine: MachineId,
        /// Its reason.
        reason: String,
    },
    /// This incarnation was removed again before it was a member with every region active
    /// (it fell silent past its lease while it joined, as on a loaded host): a new one must
    /// join ([`Node::join`] starts it).
    #[error("machine {0} was removed again while it joined")]
    EvictedWhileJoining(MachineId),
    /// Mapping the machine's NVRAM failed.
    #[error("mapping the NVRAM of machine {machine} under {dir}: {source}")]
    Nvram {
        /// The machine.
        machine: MachineId,
        /// The cluster's directory.
        dir: String,
        /// The error.
        source: std::io::Error,
    },
}

/// One machine of a multi-process cluster, running in this process. See the module docs.
#[derive(Debug)]
pub struct Node {
    machine: Arc<MachineState>,
    fabric: Arc<dyn ProcessFabric>,
    /// The machine's lease thread and control thread (stopped by [`Node::halt`], which may
    /// run while other threads use the node).
    runtime: std::sync::Mutex<Runtime>,
    shared: Shared,
    /// Host `t` is this machine's worker `t`.
    hosts: Arc<Hosts>,
    pollers: std::sync::Mutex<Vec<JoinHandle<()>>>,
}

impl Node {
    /// Starts machine `config.machine`: its fabric endpoint, its NVRAM and its lease thread;
    /// with [`NodeConfig::restart`], restarts it from its NVRAM with the rest of the cluster.
    pub fn start(config: &NodeConfig) -> Result<Self, NodeError> {
        let me = config.machine;
        if me.0 >= config.machines {
            return Err(NodeError::Invalid(format!(
                "machine {} is not one of the {} machines of the first configuration",
                me, config.machines
            )));
        }
        if config.workers == 0 || config.lease < Duration::from_micros(5) {
            return Err(NodeError::Invalid(
                "a node needs at least one worker and a lease of at least 5 us".into(),
            ));
        }
        if config.replicas == 0 || config.replicas > config.machines {
            return Err(NodeError::Invalid(format!(
                "{} replicas need at least that many machines, have {}",
                config.replicas, config.machines
            )));
        }
        if let Transport::Tcp { addrs, .. } = &config.transport {
            if addrs.len() < config.machines as usize {
                return Err(NodeError::Invalid(format!(
                    "{} machines but {} addresses: the tcp fabric needs one per machine",
                    config.machines,
                    addrs.len()
                )));
            }
        }
        if config.restart && config.zookeeper.is_none() {
            return Err(NodeError::Invalid(
                "a restart needs the ZooKeeper store the cluster ran with".into(),
            ));
        }
        if config.join && (config.restart || config.zookeeper.is_none()) {
            return Err(NodeError::Invalid(
                "a join needs the ZooKeeper store of the running cluster, and is not a restart"
                    .into(),
            ));
        }
        let fabric: Arc<dyn ProcessFabric> = match &config.transport {
            Transport::Shm => Arc::new(ShmFabric::start(
                &config.dir,
                config.cluster,
                me,
                config.base_port,
                config.secret.clone(),
            )?),
            Transport::Tcp { addrs, timeout } => Arc::new(TcpFabric::start(
                &config.dir,
                config.cluster,
                me,
                addrs.clone(),
                *timeout,
                config.secret.clone(),
            )?),
        };
        let nvram_err = |source| NodeError::Nvram {
            machine: me,
            dir: config.dir.display().to_string(),
            source,
        };
        let persisted = farm_txn::machine::read_persisted(&config.dir, me).map_err(nvram_err)?;
        match (&persisted, config.restart) {
            _ if config.join => {}
            (Some(p), false) => {
                return Err(NodeError::Invalid(format!(
                    "{} already holds machine {me}'s state (configuration {}): restart the \
                     whole cluster from it, or give a new cluster an empty directory",
                    config.dir.display(),
                    p.view.config.id.0
                )))
            }
            (None, true) => {
                return Err(NodeError::Invalid(format!(
                    "{} holds no state of machine {me}: nothing to restart",
                    config.dir.display()
                )))
            }
            _ => {}
        }
        // Connecting may take tens of milliseconds: before the start barrier, so that every
        // node's lease thread starts within a poll of the others' (a member whose CM starts a
        // lease later suspects it).
        let store = match &config.zookeeper {
            Some((connect, root)) => {
                let store = crate::zk::ZkStore::connect(connect, root, Duration::from_secs(10))
                    .map_err(|e| NodeError::Store(format!("ZooKeeper at {connect}: {e}")))?;
                check_parameters(&store, config, root)?;
                let store: Arc<dyn farm_cm::CoordinationStore> = Arc::new(store);
                if !config.restart && !config.join {
                    store_initial(&*store, root, config.machines)?;
                }
                Some(store)
            }
            None => None,
        };
        let params = Params {
            layout: RingLayout {
                machines_max: config.machines,
                threads: config.workers,
                log_bytes: 1 << 20,
                queue_bytes: 256 << 10,
            },
            region_bytes: config.region_bytes,
            validate_rpc_threshold: 4,
            recovery_interval_ticks: 50,
            replication: Replication::OneSided,
            lease_ticks: config.lease.as_micros() as u64,
        };
        params.validate().map_err(NodeError::Invalid)?;
        let (machine, restarted) = match &store {
            Some(store) if config.restart => {
                let persisted = persisted.expect("checked above");
                let r = crate::node_restart::restart(config, params, &fabric, &**store, persisted)?;
                (r.machine.clone(), Some(r))
            }
            Some(store) if config.join => {
                let current = removed_from(config, &**store)?;
                let machine = MachineState::joiner(
                    me,
                    params,
                    current,
                    fabric.clone() as Arc<dyn Fabric>,
                    Some(&config.dir),
                )
                .map_err(nvram_err)?;
                (machine, None)
            }
            _ => {
                let machine = MachineState::new(
                    me,
                    params,
                    Configuration::initial(config.machines),
                    RegionMap::striped(
                        config.machines,
                        config.regions_per_machine,
                        config.replicas - 1,
                    ),
                    fabric.clone() as Arc<dyn Fabric>,
                    Some(&config.dir),
                )
                .map_err(nvram_err)?;
                (machine, None)
            }
        };
        // A restarted machine's workers continue every ring where its receiver found it, and
        // it committed the restart configuration: transaction recovery of everything the logs
        // hold starts at each worker's first poll (§5.3).
        let (workers, restarts) = match restarted {
            Some(r) => {
                tracing::info!(machine = me.0, config = machine.view().config.id.0,
                    members = ?machine.view().config.members, "restarted from NVRAM");
                (r.workers, vec![r.exchange])
            }
            None => {
                let workers = (0..config.workers)
                    .map(|t| Worker::new(machine.clone(), ThreadId(t)))
                    .collect();
                (workers, Vec::new())
            }
        };
        // Commits write into every replica's logs: the configuration starts once all of its
        // machines run it (a write to a machine not yet up would count as a failure).
        // A joiner is outside the configuration: nobody writes to it, nor it to anybody, before
        // the configuration that adds it.
        let members = if config.join {
            Vec::new()
        } else {
            machine.view().config.members.clone()
        };
        wait_for_machines(&members, |m| fabric.ready(m), config.start_timeout)?;
        // One clock for the lease thread, the control thread and the polls: the polls compare
        // their time with the lease's bound (`MachineState::serves_at`).
        let epoch = Instant::now();
        let shared = Shared::default();
        let runtime = Runtime::start(
            RuntimeConfig {
                machines: vec![machine.clone()],
                // A joiner asks to join by itself.
                spare: vec![false],
                fabric: fabric.clone() as Arc<dyn Fabric>,
                store,
                lease: Arc::new(LeaseLength::new(config.lease)),
                // Past the start barrier, processes start their lease threads within a poll of
                // each other, unless one stalls (two cores, three processes faulting in their
                // regions: tens of milliseconds, seen over tcp) or its last probe is slow.
                start_grace: START_GRACE_LEASES * config.lease,
                epoch,
                replicas: config.replicas as usize,
                reconfigure: true,
                restarts,
            },
            &shared,
        );
        let hosts = Arc::new(Hosts::new(
            workers.into_iter().map(|w| Host::new(vec![w])).collect(),
            fabric.clone() as Arc<dyn Fabric>,
            IdleWait::Doorbell(fabric.clone()),
            epoch,
        ));
        let pollers = hosts.start_pollers(&[]);
        Ok(Self {
            machine,
            fabric,
            runtime: std::sync::Mutex::new(runtime),
            shared,
            hosts,
            pollers: std::sync::Mutex::new(pollers),
        })
    }

    /// Starts this machine as a new incarnation that joins the cluster ([`NodeConfig::join`])
    /// and waits until it is a member with every region active ([`Node::wait_joined`]). An
    /// incarnation removed again before that makes way for another, until `timeout` passed.
    pub fn join(config: &NodeConfig, timeout: Duration) -> Result<Node, NodeError> {
        let started = Instant::now();
        let config = NodeConfig {
            join: true,
            restart: false,
            ..config.clone()
        };
        loop {
            let node = Node::start(&config)?;
            match node.wait_joined(timeout.saturating_sub(started.elapsed())) {
                Ok(_) => return Ok(node),
                Err(NodeError::EvictedWhileJoining(m)) if started.elapsed() < timeout => {
                    tracing::warn!(
                        machine = m.0,
                        "removed again while joining: joining as a new incarnation"
                    );
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits until this machine is a member of the configuration (see [`NodeConfig::join`])
    /// and every region of it is active (§5.4); returns the configuration. Fails at once with
    /// [`NodeError::EvictedWhileJoining`] if it is removed before that.
    pub fn wait_joined(&self, timeout: Duration) -> Result<Configuration, NodeError> {
        let started = Instant::now();
        loop {
            // First: a removed machine's view may still hold it, every region active.
            if self.is_evicted() {
                return Err(NodeError::EvictedWhileJoining(self.id()));
            }
            let config = self.configuration();
            if config.contains(self.id()) && self.machine.all_active_config() >= config.id {
                return Ok(config);
            }
            if started.elapsed() > timeout {
                return Err(NodeError::Store(format!(
                    "machine {} was not added to the configuration within {timeout:?} (the \
                     cluster is in configuration {} with members {:?})",
                    self.id(),
                    config.id.0,
                    config.members
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Whether this machine learnt it was removed from the configuration (precise membership,
    /// §5.2): its transactions fail with [`TxError::Evicted`].
    pub fn is_evicted(&self) -> bool {
        self.machine.is_evicted()
    }

    /// Configurations this node committed as the driver of a reconfiguration.
    pub fn committed_configurations(&self) -> Vec<farm_core::ConfigId> {
        self.reconfig_events()
            .into_iter()
            .filter_map(|e| match e {
                ReconfigEvent::Committed { config, .. } => Some(config),
                _ => None,
            })
            .collect()
    }

    /// This machine's reconfiguration steps so far, in order (µs since the node started):
    /// suspicions it acted on, and what it drove.
    pub fn reconfig_events(&self) -> Vec<ReconfigEvent> {
        self.shared.events.lock().expect("poisoned").clone()
    }

    /// Allocates a new region (§3): this machine asks its CM, which places it (with the
    /// replicas of `near` if given and possible), has every replica prepare it and commits
    /// the map with it as a configuration with the same members, installed here before this
    /// returns. Needs the cluster's ZooKeeper store ([`NodeConfig::zookeeper`]).
    pub fn allocate_region(
        &self,
        near: Option<farm_core::RegionId>,
    ) -> Result<farm_core::RegionId, crate::AdminError> {
        crate::machine::ask(&self.shared, |tx| Request::AllocateRegion(near, tx))
    }

    /// Runs `f` as a transaction coordinated by this machine, retrying it on conflicts, and
    /// commits it (§4); its reads and writes reach every machine of the cluster.
    pub fn txn<R>(&self, f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>) -> Result<R, TxError> {
        self.txn_placed(None, f)
    }

    /// [`Node::txn`], with allocations that name no locality hint placed in a region whose
    /// primary is `machine` (the process coordinates only its own machine's transactions: the
    /// objects go where the caller asked, the coordination stays here).
    pub fn txn_allocating_on<R>(
        &self,
        machine: MachineId,
        f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        self.txn_placed(self.place_on(machine), f)
    }

    /// Where allocations without a hint of a transaction named after `machine` go: a region
    /// whose primary is `machine`, when that is another machine.
    fn place_on(&self, machine: MachineId) -> Option<farm_core::Addr> {
        (machine != self.id())
            .then(|| {
                let view = self.machine.view();
                let region = view.map.primary_of(machine).next();
                region.map(|r| farm_core::Addr::new(r, 0))
            })
            .flatten()
    }

    /// Runs `tasks` tasks of `f` on this thread with many transactions in flight
    /// ([`crate::Client::pipeline`]): every transaction is coordinated here, its allocations
    /// placed as [`Node::txn_allocating_on`] places them.
    pub fn pipeline(&self, tasks: usize, f: impl AsyncFn(&crate::Pipeline<'_>, usize)) {
        let me = self.id();
        let route = |m: MachineId| (me, self.place_on(m));
        let machines = self.machine.params.layout.machines_max;
        crate::pipeline::run(
            &self.hosts,
            &mut self.hosts.take(),
            &route,
            machines,
            tasks,
            f,
        )
    }

    fn txn_placed<R>(
        &self,
        place: Option<farm_core::Addr>,
        f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        self.hosts.txn(&mut self.hosts.take(), self.id(), place, f)
    }

    /// Stops this machine's threads as a crash would, its memory kept: the background pollers,
    /// the lease manager and the control plane, so that it renews no lease and drives no
    /// reconfiguration any more (the peers of a cluster shutting down on a power signal do not
    /// remove each other while they stop). What was in flight is recovery's, as after a crash.
    /// Before [`Node::flush_nvram`] on a power signal; dropping the node does it too.
    /// Other threads may go on using the node (the process is about to end): a thread that
    /// runs transactions still polls its own host while it waits, but no lease is renewed and
    /// no configuration changes here any more.
    pub fn halt(&self) {
        self.hosts.stop();
        let pollers = std::mem::take(&mut *self.pollers.lock().expect("pollers poisoned"));
        for p in pollers {
            let _ = p.join();
        }
        self.runtime.lock().expect("runtime poisoned").stop();
    }

    /// Writes every NVRAM mapping of this machine back to its file and waits (`msync`), for a
    /// shutdown on a power signal; returns how many areas and bytes
    /// (`MachineState::flush_nvram`).
    pub fn flush_nvram(&self) -> std::io::Result<(usize, usize)> {
        self.machine.flush_nvram()
    }

    /// The machine this node runs.
    pub fn id(&self) -> MachineId {
        self.machine.id
    }

    /// The configuration this machine is in.
    pub fn configuration(&self) -> Configuration {
        self.machine.view().config.clone()
    }

    /// This machine's view: configuration, region map, replicas held.
    pub fn view(&self) -> Arc<farm_txn::machine::View> {
        self.machine.view()
    }

    /// One round of quiescing, for checks once no transaction runs anywhere: flushes
    /// truncations and freed-log reports and polls every worker. Returns whether this machine
    /// is quiet: nothing it coordinates in flight, no untruncated record held (backups have
    /// installed every write, §4 step 5), recovery idle, and data and allocator recovery done
    /// (§5.4-5.5). Every machine of the cluster must be quiescing for all to get there.
    pub fn quiesce_step(&self) -> bool {
        self.hosts.quiesce_round() && self.machine.background_recovery_done()
    }

    /// Reads the committed object at `addr` into `buf` (its 8-byte header first, then the
    /// value) with a one-sided read, outside any transaction (`Cluster::read_bytes_into`).
    pub fn read_bytes_into(&self, addr: farm_core::Addr, buf: &mut [u8]) -> Result<(), TxError> {
        self.hosts
            .read(&mut self.hosts.take(), self.id(), addr, buf)
    }

    /// The workers' counters, summed (commits, aborts by cause, waits, allocations).
    pub fn stats(&self) -> farm_txn::Stats {
        self.hosts.stats()
    }

    /// Whether `machine`'s process is alive, as the fabric sees it.
    pub fn is_up(&self, machine: MachineId) -> bool {
        self.fabric.is_up(machine)
    }

    /// This machine's metrics in the Prometheus (OpenMetrics) text format: commits, aborts by
    /// cause, commit latencies, lock-free reads, configuration, role, suspicions,
    /// reconfigurations, regions copying, datagrams refused, operations and bytes per peer (see docs/ARCHITECTURE.md,
    /// Observability). Counters of a thread whose pipeline keeps its host are at most 10 ms
    /// old; the others wait for the host to be free.
    pub fn metrics(&self) -> String {
        let mut counters = self.hosts.counters();
        let sample = crate::metrics::Sample::of(
            &self.machine,
            counters.remove(&self.id()).unwrap_or_default(),
            &self.suspicions(),
            (
                self.fabric.datagrams_refused(),
                self.fabric.traffic(self.id()),
            ),
        );
        let reconfigurations = crate::metrics::Reconfigurations::of(&self.reconfig_events());
        crate::metrics::render(vec![sample], reconfigurations)
    }

    /// Microseconds on the clock of [`Node::suspicions`] and [`Node::reconfig_events`]: since
    /// the node started.
    pub fn now_us(&self) -> u64 {
        self.hosts.now()
    }

    /// Machines this node's lease thread suspected, in order (time in µs since it started).
    pub fn suspicions(&self) -> Vec<Suspicion> {
        self.shared
            .suspicions
            .lock()
            .expect("suspicions poisoned")
            .clone()
    }
}

/// Waits until `ok` holds for every machine of `machines`, failing with those it does not hold
/// for after `timeout`.
/// Whether machine `machine` left its state under the NVRAM directory `dir` (a view it
/// installed), as a machine that restarts from it must have: a machine whose disk died left
/// none.
pub fn left_state(dir: &Path, machine: MachineId) -> std::io::Result<bool> {
    Ok(farm_txn::machine::read_persisted(dir, machine)?.is_some())
}

pub(crate) fn wait_for_machines(
    machines: &[MachineId],
    ok: impl Fn(MachineId) -> bool,
    timeout: Duration,
) -> Result<(), NodeError> {
    let started = Instant::now();
    loop {
        let missing: Vec<MachineId> = machines.iter().copied().filter(|m| !ok(*m)).collect();
        if missing.is_empty() {
            return Ok(());
        }
        if started.elapsed() > timeout {
            return Err(NodeError::PeersMissing {
                missing,
                waited: timeout,
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Leases a machine's first lease request and answer may take beyond the first lease.
const START_GRACE_LEASES: u32 = 10;

impl Drop for Node {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Checks that this node runs with the cluster's parameters, which the first node to start
/// stored beside the configuration: machines of different region sizes, worker counts or
/// leases cannot work together, and would otherwise fail much later (a replica's file of the
/// wrong size, rings laid out differently).
fn check_parameters(
    store: &crate::zk::ZkStore,
    config: &NodeConfig,
    root: &str,
) -> Result<(), NodeError> {
    let mine = format!(
        "machines={} workers={} region_bytes={} replicas={} regions_per_machine={} lease_us={}",
        config.machines,
        config.workers,
        config.region_bytes,
        config.replicas,
        config.regions_per_machine,
        config.lease.as_micros()
    );
    let err = |e: farm_cm::StoreError| NodeError::Store(format!("the cluster's parameters: {e}"));
    if store.put_new("parameters", mine.as_bytes()).map_err(err)? {
        return Ok(());
    }
    let stored = store.get("parameters").map_err(err)?.unwrap_or_default();
    let stored = String::from_utf8_lossy(&stored);
    if stored != mine {
        return Err(NodeError::Invalid(format!(
            "the cluster at {root} runs with {stored}; this node was started with {mine}"
        )));
    }
    Ok(())
}

/// The configuration a joining machine starts from: the stored one, once it no longer holds an
/// earlier life of the machine (the CM removes one whose lease expired, §5.2).
fn removed_from(
    config: &NodeConfig,
    store: &dyn farm_cm::CoordinationStore,
) -> Result<Configuration, NodeError> {
    let me = config.machine;
    let started = Instant::now();
    loop {
        let stored = match store
            .read_config()
            .map_err(|e| NodeError::Store(e.to_string()))?
        {
            Some((_, stored)) => stored,
            None => {
                return Err(NodeError::Store(
                    "ZooKeeper holds no configuration: there is no cluster to join".into(),
                ))
            }
        };
        if !stored.contains(me) {
            return Ok(stored);
        }
        if started.elapsed() > config.start_timeout {
            return Err(NodeError::Store(format!(
                "machine {me} is still a member of configuration {} after {:?}: is it running \
                 elsewhere?",
                stored.id.0, config.start_timeout
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Stores the first configuration of `machines` machines in the cluster's coordination store
/// (whichever node comes first), or checks that it is the one there.
fn store_initial(
    store: &dyn farm_cm::CoordinationStore,
    root: &str,
    machines: u16,
) -> Result<(), NodeError> {
    use farm_cm::CasOutcome;
    let initial = Configuration::initial(machines);
    let read = || {
        store
            .read_config()
            .map_err(|e| NodeError::Store(e.to_string()))
    };
    let config = match read()? {
        Some((_, stored)) => stored,
        None => match store.cas_config(None, &initial) {
            Ok(CasOutcome::Written(_)) => initial.clone(),
            Ok(CasOutcome::Conflict) => match read()? {
                Some((_, stored)) => stored,
                None => return Err(NodeError::Store("the configuration vanished".into())),
            },
            Err(e) => return Err(NodeError::Store(e.to_string())),
        },
    };
    if config != initial {
        return Err(NodeError::Store(format!(
            "{root} holds configuration {} with members {:?}, not the first configuration of \
             {machines} machines: join the running cluster (`join`), restart a stopped one \
             from its NVRAM (`restart`), or give a new cluster a znode of its own",
            config.id.0, config.members
        )));
    }
    Ok(())
}

/// A node as a [`crate::Client`] of the cluster: transactions are coordinated here whatever
/// machine is named (a process runs its own machine only), with the objects they allocate
/// placed on the named machine ([`Node::txn_allocating_on`]); reads are one-sided from here.
impl crate::Client for Node {
    fn txn<R>(
        &self,
        machine: MachineId,
        f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        self.txn_allocating_on(machine, f)
    }

    fn read_bytes_into(
        &self,
        _machine: MachineId,
        addr: farm_core::Addr,
        buf: &mut [u8],
    ) -> Result<(), TxError> {
        Node::read_bytes_into(self, addr, buf)
    }

    fn pipeline(&self, tasks: usize, f: impl AsyncFn(&crate::Pipeline<'_>, usize)) {
        Node::pipeline(self, tasks, f)
    }

    fn machines(&self) -> u16 {
        self.machine.params.layout.machines_max
    }
}
