//! The in-process cluster: machines as groups of workers in one process over the `mem` fabric,
//! driven by OS threads (docs/ARCHITECTURE.md, Machines, threads, event loop).
//!
//! OS thread `t` hosts worker `t` of every machine and polls them in turn, so three machines
//! share two cores without a context switch on the commit path (`crate::hosts`: the same
//! retry loop, reads and pollers as a node's, over other workers).

use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use farm_core::config::{Configuration, RegionMap};
use farm_core::fabric::Fabric;
use farm_core::ring::RingLayout;
use farm_core::{Addr, MachineId, RegionId, ThreadId};
use farm_fabric::mem::{MemFabric, MemFabricConfig};
use farm_txn::machine::Reopen;
use farm_txn::restart::{Finished, MachineRestart};
use farm_txn::{MachineState, Params, Replication, Stats, TxError, Worker};

use crate::hosts::{Host, HostGuard, Hosts, IdleWait};
use crate::lease_thread::{LeaseLength, Suspicion};
use crate::machine::{ReconfigEvent, Request, Runtime, RuntimeConfig, Shared};
use crate::pipeline::Pipeline;
use crate::txn::Txn;
use farm_cm::restart::{ExchangeParams, LeaveOut, Outcome, RestartExchange};
use farm_cm::{CasOutcome, CoordinationStore, EmbeddedStore};

/// Errors building a cluster: bad parameters or NVRAM that cannot be mapped.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// A parameter is out of range.
    #[error("invalid cluster parameter: {0}")]
    Invalid(String),
    /// NVRAM could not be created or mapped.
    #[error("NVRAM: {0}")]
    Nvram(#[from] std::io::Error),
}

/// Committed transactions per millisecond and what the configuration manager did, from one run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline {
    /// `committed_per_ms[i]`: transactions committed during millisecond `i` of the run.
    pub committed_per_ms: Vec<u64>,
    /// Reconfiguration steps, timestamped in microseconds since the start.
    pub events: Vec<ReconfigEvent>,
    /// Lease expiries, timestamped in microseconds since the start.
    pub suspicions: Vec<Suspicion>,
    /// Data recovery and allocator recovery milestones per machine (§5.4-5.5), timestamped in
    /// microseconds since the start.
    pub recovery: Vec<(MachineId, farm_txn::RecoveryEvent)>,
}

impl Timeline {
    /// A JSON document: `{"committed_per_ms": [...], "events": [{"event": ..., "at_us": ...}],
    /// "suspicions": [...], "recovery": [{"event": "data-recovery-start", "machine": ...}]}`.
    pub fn to_json(&self) -> String {
        let events: Vec<String> = self
            .events
            .iter()
            .map(|e| {
                let (name, at, extra) = match e {
                    ReconfigEvent::Suspect { machine, at_us } => {
                        ("suspect", at_us, format!(",\"machine\":{}", machine.0))
                    }
                    ReconfigEvent::Probed { at_us } => ("probe", at_us, String::new()),
                    ReconfigEvent::Stored { config, at_us } => {
                        ("zookeeper", at_us, format!(",\"config\":{}", config.0))
                    }
                    ReconfigEvent::Committed { config, at_us } => {
                        ("config-commit", at_us, format!(",\"config\":{}", config.0))
                    }
                    ReconfigEvent::Failed { reason, at_us } => {
                        ("failed", at_us, format!(",\"reason\":{reason:?}"))
                    }
                    ReconfigEvent::AllActive { config, at_us } => {
                        ("all-active", at_us, format!(",\"config\":{}", config.0))
                    }
                };
                format!("{{\"event\":\"{name}\",\"at_us\":{at}{extra}}}")
            })
            .collect();
        let recovery: Vec<String> = self
            .recovery
            .iter()
            .map(|(m, e)| {
                let (name, at, extra) = match e {
                    farm_txn::RecoveryEvent::DataRecoveryStarted {
                        region,
                        aggressive,
                        at,
                    } => (
                        "data-recovery-start",
                        at,
                        format!(",\"region\":{},\"aggressive\":{aggressive}", region.0),
                    ),
                    farm_txn::RecoveryEvent::DataRecoveryDone {
                        region,
                        objects,
                        at,
                    } => (
                        "data-recovery-done",
                        at,
                        format!(",\"region\":{},\"objects\":{objects}", region.0),
                    ),
                    farm_txn::RecoveryEvent::AllocatorRecovered { region, at } => (
                        "allocator-recovered",
                        at,
                        format!(",\"region\":{}", region.0),
                    ),
                };
                format!(
                    "{{\"event\":\"{name}\",\"machine\":{},\"at_us\":{at}{extra}}}",
                    m.0
                )
            })
            .collect();
        let suspicions: Vec<String> = self
            .suspicions
            .iter()
            .map(|s| {
                format!(
                    "{{\"observer\":{},\"suspect\":{},\"at_us\":{}}}",
                    s.observer.0, s.suspect.0, s.at_us
                )
            })
            .collect();
        let per_ms: Vec<String> = self.committed_per_ms.iter().map(u64::to_string).collect();
        format!(
            "{{\"committed_per_ms\":[{}],\"events\":[{}],\"suspicions\":[{}],\"recovery\":[{}]}}",
            per_ms.join(","),
            events.join(","),
            suspicions.join(","),
            recovery.join(",")
        )
    }
}

/// Why an administrative request to the CM failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The CM refused or failed, saying why.
    #[error("{0}")]
    Refused(String),
    /// The CM did not answer within a minute (is reconfiguration turned off?).
    #[error("the configuration manager did not answer")]
    NoAnswer,
}

/// Builder of an in-process [`Cluster`].
#[derive(Clone, Debug)]
pub struct ClusterBuilder {
    machines: u16,
    spare_machines: u16,
    workers: u16,
    replicas: u16,
    regions_per_machine: u32,
    region_bytes: usize,
    log_bytes: usize,
    queue_bytes: usize,
    nvram_dir: Option<PathBuf>,
    pin: bool,
    background_pollers: bool,
    lease: Duration,
    recovery_interval: Duration,
    spare_regions: usize,
    store: Option<Arc<dyn CoordinationStore>>,
    reconfigure: bool,
    restart: bool,
    restart_without_lost: bool,
    replication: Replication,
}

impl Default for ClusterBuilder {
    fn default() -> Self {
        Self {
            machines: 3,
            spare_machines: 0,
            workers: 2,
            replicas: 3,
            regions_per_machine: 1,
            region_bytes: 2 << 30,
            log_bytes: 1 << 20,
            queue_bytes: 256 << 10,
            nvram_dir: None,
            pin: false,
            background_pollers: true,
            lease: Duration::from_millis(100),
            recovery_interval: Duration::from_micros(50),
            spare_regions: 0,
            store: None,
            reconfigure: true,
            restart: false,
            restart_without_lost: false,
            replication: Replication::OneSided,
        }
    }
}

impl ClusterBuilder {
    /// Number of machines (default 3).
    pub fn machines(mut self, n: u16) -> Self {
        self.machines = n;
        self
    }
    /// Machines started outside the configuration, ready to join with [`Cluster::join`]
    /// (default 0).
    pub fn spare_machines(mut self, n: u16) -> Self {
        self.spare_machines = n;
        self
    }
    /// Worker threads per machine (default 2, one per core of a small machine).
    pub fn workers(mut self, n: u16) -> Self {
        self.workers = n;
        self
    }
    /// Replicas per region, primary included: `f + 1` (default 3).
    pub fn replicas(mut self, n: u16) -> Self {
        self.replicas = n;
        self
    }
    /// Regions allocated at start, per machine (default 1); the CM places them so that each
    /// machine is primary for as many.
    pub fn regions_per_machine(mut self, n: u32) -> Self {
        self.regions_per_machine = n;
        self
    }
    /// Bytes per region (default 2 GB, sparse).
    pub fn region_bytes(mut self, n: usize) -> Self {
        self.region_bytes = n;
        self
    }
    /// Bytes per transaction log (default 1 MB).
    pub fn log_bytes(mut self, n: usize) -> Self {
        self.log_bytes = n;
        self
    }
    /// Bytes per message queue (default 256 KB).
    pub fn queue_bytes(mut self, n: usize) -> Self {
        self.queue_bytes = n;
        self
    }
    /// Keep NVRAM in files under `dir` (default: anonymous memory).
    pub fn nvram_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.nvram_dir = Some(dir.into());
        self
    }
    /// Pin host threads to cores with `core_affinity` (default off).
    pub fn pin_threads(mut self, pin: bool) -> Self {
        self.pin = pin;
        self
    }

    /// Pause between steps of data recovery (one 8 KB chunk copied to a new backup) and of
    /// allocator recovery at a new primary (default 50 µs: about 160 MB/s per copy, paced so
    /// that re-replication does not take the cores from transactions, §5.4).
    pub fn recovery_interval(mut self, interval: Duration) -> Self {
        self.recovery_interval = interval;
        self
    }

    /// Regions' memory each machine keeps ready, its pages allocated and zeroed, for the
    /// replicas a failure gives it (default 0: regions default to 2 GB). With none, a new
    /// backup's first writes fault in and zero a whole region during recovery; in one process,
    /// five machines whose failure gave three regions a new backup came back to 80% of their
    /// throughput 83-100 ms after the suspicion, and 8-14 ms with one spare each (in memory
    /// only: a cluster with an NVRAM directory keeps none yet).
    pub fn spare_regions(mut self, n: usize) -> Self {
        self.spare_regions = n;
        self
    }

    /// Lease length (§5.1; default 100 ms, renewed every fifth).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The coordination store holding the configuration (default: an embedded store; use
    /// [`crate::zk::ZkStore`] for ZooKeeper). It must not hold a configuration yet, unless the
    /// cluster [restarts](ClusterBuilder::restart).
    pub fn store(mut self, store: Arc<dyn CoordinationStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// How backups acknowledge COMMIT-BACKUP (default [`Replication::OneSided`], FaRM's;
    /// [`Replication::Rpc`] makes each backup's CPU answer, as RPC-based replication does, for
    /// comparison).
    pub fn replication(mut self, replication: Replication) -> Self {
        self.replication = replication;
        self
    }

    /// Whether lease expiries start reconfiguration (default on). Off, suspicions are only
    /// recorded, which is how false positives are counted.
    pub fn reconfigure(mut self, on: bool) -> Self {
        self.reconfigure = on;
        self
    }

    /// Restarts a cluster that stopped as a whole (a power loss, §2: NVRAM survives) instead of
    /// starting a new one: the same [`store`](ClusterBuilder::store) and
    /// [`NVRAM directory`](ClusterBuilder::nvram_dir), and the same machines, workers, ring
    /// and region sizes as before. The machines of the newest configuration come back with
    /// their regions and logs; a new configuration with the same members and regions is
    /// stored and committed, in which every region counts as having changed primary and
    /// replicas, so that transaction recovery (§5.3) decides every transaction the logs hold
    /// (committing exactly those that may have been acknowledged) and allocator recovery
    /// (§5.5) rebuilds every free list. Regions serve again once their locks are recovered.
    ///
    /// The cluster may have stopped at any moment, in the middle of a reconfiguration or of
    /// recovery included: the restart resumes from the newest view any machine installed,
    /// copies again the replicas that were not complete, and recovery after it decides as
    /// recovery before it had wherever a decision took effect (recovery messages are kept in
    /// NVRAM). Refused, with the reason, when there is nothing to restart, when the store is
    /// behind the NVRAM (another store), or when a region has no complete replica left.
    pub fn restart(mut self) -> Self {
        self.restart = true;
        self
    }

    /// With [`restart`](ClusterBuilder::restart): a machine whose NVRAM holds nothing (its
    /// disk was lost with the power) is left out of the restart configuration instead of
    /// refusing the restart, as a reconfiguration removes a failed machine (§5.2): each of its
    /// regions must keep a complete replica on another machine (else the restart is refused,
    /// naming the region), and gets `f + 1` replicas again where capacity allows, copied
    /// after the restart (§5.4). The machine starts empty, outside the configuration. Off by
    /// default: an empty directory is more often a mistake than a lost disk.
    pub fn restart_without_lost(mut self, on: bool) -> Self {
        self.restart_without_lost = on;
        self
    }

    /// Builds and starts the cluster.
    pub fn build(self) -> Result<Cluster, BuildError> {
        if self.machines == 0 || self.workers == 0 {
            return Err(BuildError::Invalid(
                "machines and workers must be at least 1".into(),
            ));
        }
        if self.replicas == 0 || self.replicas > self.machines {
            return Err(BuildError::Invalid(format!(
                "{} replicas need at least that many machines, have {}",
                self.replicas, self.machines
            )));
        }
        let layout = RingLayout {
            machines_max: self.machines + self.spare_machines,
            threads: self.workers,
            log_bytes: self.log_bytes,
            queue_bytes: self.queue_bytes,
        };
        let params = Params {
            layout,
            region_bytes: self.region_bytes,
            validate_rpc_threshold: 4,
            recovery_interval_ticks: self.recovery_interval.as_micros() as u64,
            replication: self.replication,
            lease_ticks: self.lease.as_micros() as u64,
        };
        params.validate().map_err(BuildError::Invalid)?;
        let fabric = Arc::new(MemFabric::new(MemFabricConfig {
            machines_max: self.machines + self.spare_machines,
            threads_max: self.workers,
            seed: 0,
            datagrams_queued_max: 1024,
        }));
        if self.lease < Duration::from_millis(1) {
            return Err(BuildError::Invalid(format!(
                "lease {:?} is shorter than 1 ms",
                self.lease
            )));
        }
        let store = self
            .store
            .clone()
            .unwrap_or_else(|| Arc::new(EmbeddedStore::new()));
        let all = self.machines + self.spare_machines;
        let (machines, mut restarted, restarts) = if self.restart {
            self.restore_machines(params, &fabric, &*store)?
        } else {
            if let Some(dir) = &self.nvram_dir {
                for m in 0..all {
                    let held = farm_txn::machine::read_persisted(dir, MachineId(m))
                        .map_or(true, |v| v.is_some());
                    if held {
                        return Err(BuildError::Invalid(format!(
                            "NVRAM directory {} already holds machine {}'s state: restart that \
                             cluster with ClusterBuilder::restart, or give a new one an empty directory",
                            dir.display(),
                            MachineId(m)
                        )));
                    }
                }
            }
            let config = Configuration::initial(self.machines);
            // The first configuration's regions, striped over its members as in every
            // deployment; spares, outside it, hold none. Later ones are allocated through the
            // CM (`Cluster::allocate_region`, §3).
            let map =
                RegionMap::striped(self.machines, self.regions_per_machine, self.replicas - 1);
            // A spare is a new incarnation waiting to join, as a machine process started with
            // `--join` is: the replicas the configuration that adds it gives it are copied from
            // their primaries (§5.4), not taken for new regions.
            let machines = (0..all)
                .map(|m| {
                    let (id, fabric) = (MachineId(m), fabric.clone() as Arc<dyn Fabric>);
                    let dir = self.nvram_dir.as_deref();
                    if m >= self.machines {
                        MachineState::joiner(id, params, config.clone(), fabric, dir)
                    } else {
                        MachineState::new(id, params, config.clone(), map.clone(), fabric, dir)
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            match farm_cm::ConfigurationStore::cas_config(&*store, None, &config) {
                Ok(CasOutcome::Written(_)) => {}
                Ok(CasOutcome::Conflict) => return Err(BuildError::Invalid(
                    "the coordination store already holds a configuration: restart that cluster \
                         with ClusterBuilder::restart, or give a new cluster a store of its own"
                        .into(),
                )),
                Err(e) => {
                    return Err(BuildError::Invalid(format!(
                        "storing the first configuration: {e}"
                    )))
                }
            }
            (machines, Vec::new(), Vec::new())
        };
        for m in &machines {
            m.keep_spare_regions(self.spare_regions)?;
        }
        let hosts: Vec<Host> = (0..self.workers)
            .map(|t| {
                // A restarted machine's workers continue its rings (`restore_machines`).
                let workers: Vec<Worker> = machines
                    .iter()
                    .enumerate()
                    .map(
                        |(i, m)| match restarted.get_mut(i).and_then(Option::as_mut) {
                            Some(w) => {
                                let w = w.remove(0);
                                assert_eq!(w.thread(), ThreadId(t), "workers by thread");
                                w
                            }
                            None => Worker::new(m.clone(), ThreadId(t)),
                        },
                    )
                    .collect();
                Host::new(workers)
            })
            .collect();
        let epoch = Instant::now();
        let hosts = Arc::new(Hosts::new(
            hosts,
            fabric.clone() as Arc<dyn Fabric>,
            IdleWait::Backoff,
            epoch,
        ));
        let lease_length = Arc::new(LeaseLength::new(self.lease));
        let shared = Shared::default();
        // One control thread steps every machine's plane, as host thread `t` polls worker `t`
        // of every machine; spares stay quiet until asked to join.
        let runtime = Runtime::start(
            RuntimeConfig {
                spare: machines.iter().map(|m| m.id.0 >= self.machines).collect(),
                machines: machines.clone(),
                fabric: fabric.clone() as Arc<dyn Fabric>,
                store: Some(store),
                lease: lease_length.clone(),
                // One process: every lease thread starts together.
                start_grace: Duration::ZERO,
                epoch,
                replicas: self.replicas as usize,
                reconfigure: self.reconfigure,
                restarts,
            },
            &shared,
        );
        let inner = Arc::new(Inner {
            fabric,
            machines,
            hosts: hosts.clone(),
            shared,
        });
        let cores = if self.pin {
            core_affinity::get_core_ids().unwrap_or_default()
        } else {
            Vec::new()
        };
        let pollers = if self.background_pollers {
            hosts.start_pollers(&cores)
        } else {
            Vec::new()
        };
        tracing::info!(
            machines = self.machines,
            workers = self.workers,
            replicas = self.replicas,
            "cluster started"
        );
        let cluster = Cluster {
            inner,
            pollers,
            runtime,
            lease_length,
        };
        Ok(cluster)
    }
}

impl ClusterBuilder {
    /// The machines of a restart ([`ClusterBuilder::restart`]), each restarted by the restart
    /// exchange every deployment runs (`farm_cm::restart`), here over the in-process fabric's
    /// datagrams: machine 0 (or the lowest machine with a state, leaving out those without)
    /// decides from what every machine left and stores the restart
    /// configuration, the members reopen their NVRAM, continue their rings where the receivers
    /// found them and commit it. Machines outside the configuration start empty (their NVRAM is
    /// stale: they were removed). Returns the machines, the members' workers by thread, and
    /// their finished exchanges.
    #[allow(clippy::type_complexity)]
    fn restore_machines(
        &self,
        params: Params,
        fabric: &Arc<MemFabric>,
        store: &dyn CoordinationStore,
    ) -> Result<
        (
            Vec<Arc<MachineState>>,
            Vec<Option<Vec<Worker>>>,
            Vec<RestartExchange>,
        ),
        BuildError,
    > {
        let Some(dir) = &self.nvram_dir else {
            return Err(BuildError::Invalid(
                "a restart needs the NVRAM directory the cluster ran on".into(),
            ));
        };
        let invalid = BuildError::Invalid;
        let all = self.machines + self.spare_machines;
        // Machines here all take part at once, over datagrams that are not lost: the decider has
        // heard from every machine with a state well before it leaves out those without.
        let exchange = ExchangeParams {
            machines: all,
            repeat: crate::node_restart::REPEAT.as_micros() as u64,
            leave_out: self.restart_without_lost.then_some(LeaveOut {
                after: LOST_AFTER.as_micros() as u64,
                replicas: self.replicas as usize,
                regions_max: farm_txn::control::REGIONS_PER_MACHINE_MAX,
            }),
        };
        // By machine; `None` for a machine whose NVRAM holds nothing, left out.
        let mut restarts: Vec<Option<MachineRestart<'_>>> = Vec::new();
        for m in (0..all).map(MachineId) {
            let persisted = farm_txn::machine::read_persisted(dir, m)
                .map_err(|e| invalid(format!("reading machine {m}'s NVRAM: {e}")))?;
            let persisted = match persisted {
                Some(p) => p,
                None if self.restart_without_lost => {
                    tracing::warn!(machine = m.0, "no NVRAM state: restarting without it");
                    restarts.push(None);
                    continue;
                }
                None => {
                    return Err(invalid(format!(
                        "{} holds no state of machine {m}: a restart runs the machines that ran",
                        dir.display(),
                    )))
                }
            };
            restarts.push(Some(MachineRestart::new(
                m,
                exchange,
                persisted,
                crate::node_restart::fresh_life(),
                params,
                fabric.clone() as Arc<dyn Fabric>,
                store,
                Reopen::Dir(dir),
            )));
        }
        let started = Instant::now();
        let failed = |r: &MachineRestart<'_>| matches!(r.outcome(), Some(Outcome::Failed(_)));
        while restarts.iter().flatten().any(|r| r.outcome().is_none())
            && !restarts.iter().flatten().any(failed)
        {
            if started.elapsed() > RESTART_TIMEOUT {
                let waiting: Vec<(MachineId, Vec<MachineId>)> = (0..all)
                    .map(MachineId)
                    .zip(
                        restarts
                            .iter()
                            .map(|r| r.as_ref().map_or(Vec::new(), |r| r.waiting_for())),
                    )
                    .filter(|(_, w)| !w.is_empty())
                    .collect();
                return Err(invalid(format!(
                    "the restart did not finish within {RESTART_TIMEOUT:?}: machines wait for \
                     {waiting:?}"
                )));
            }
            let now = started.elapsed().as_micros() as u64;
            for r in restarts.iter_mut().flatten() {
                r.step(now);
            }
            std::thread::sleep(RESTART_POLL);
        }
        if let Some(Outcome::Failed(e)) = restarts
            .iter()
            .flatten()
            .find(|r| failed(r))
            .and_then(|r| r.outcome())
        {
            return Err(invalid(format!("restarting from {}: {e}", dir.display())));
        }
        let plan = restarts
            .iter()
            .flatten()
            .find_map(|r| match r.outcome() {
                Some(Outcome::Restarted(p) | Outcome::Removed(p)) => Some(p.config.clone()),
                _ => None,
            })
            .expect("a machine restarted");
        let (mut machines, mut workers, mut exchanges) = (Vec::new(), Vec::new(), Vec::new());
        for (m, r) in (0..all).map(MachineId).zip(restarts) {
            match r.map(MachineRestart::finish) {
                Some(Finished::Restarted(r)) => {
                    machines.push(r.machine);
                    workers.push(Some(r.workers));
                    exchanges.push(r.exchange);
                }
                // Removed before the stop (its NVRAM is stale), or its NVRAM is gone.
                Some(Finished::Removed(_)) | None => {
                    let stale = farm_txn::machine::machine_dir(dir, m);
                    if stale.exists() {
                        std::fs::remove_dir_all(&stale)?;
                    }
                    let state = MachineState::new(
                        m,
                        params,
                        plan.clone(),
                        RegionMap::default(),
                        fabric.clone() as Arc<dyn Fabric>,
                        Some(dir),
                    )
                    .map_err(|e| invalid(format!("machine {m}'s NVRAM: {e}")))?;
                    machines.push(state);
                    workers.push(None);
                }
                Some(Finished::Failed(e)) => unreachable!("failures returned above: {e}"),
            }
        }
        let config = machines[0].view().config.clone();
        tracing::info!(
            config = config.id.0,
            members = ?config.members,
            "cluster restarted from NVRAM"
        );
        Ok((machines, workers, exchanges))
    }
}

#[derive(Debug)]
struct Inner {
    fabric: Arc<MemFabric>,
    machines: Vec<Arc<MachineState>>,
    hosts: Arc<Hosts>,
    shared: Shared,
}

/// A thread's hold on one host across transactions ([`Cluster::session`]).
#[derive(Debug)]
pub struct Session<'c> {
    cluster: &'c Cluster,
    host: std::cell::RefCell<HostGuard<'c>>,
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        let index = self.host.borrow().index();
        self.cluster.inner.hosts.keep(index, false);
    }
}

impl<'c> Session<'c> {
    /// The cluster.
    pub fn cluster(&self) -> &Cluster {
        self.cluster
    }

    fn held(&self) -> std::cell::RefMut<'_, HostGuard<'c>> {
        self.host
            .try_borrow_mut()
            .expect("a session's transaction or read started inside another: use Cluster::txn")
    }
}

/// What runs transactions and lock-free reads: a [`Cluster`], which takes a host for each, or a
/// [`Session`], which keeps one. Data structures take either.
pub trait Client {
    /// See [`Cluster::txn`].
    fn txn<R>(
        &self,
        machine: MachineId,
        f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError>;

    /// See [`Cluster::read_bytes_into`].
    fn read_bytes_into(
        &self,
        machine: MachineId,
        addr: Addr,
        buf: &mut [u8],
    ) -> Result<(), TxError>;

    /// See [`Cluster::read`].
    fn read<T: bytemuck::Pod>(&self, machine: MachineId, addr: Addr) -> Result<T, TxError> {
        let mut buf = vec![0u8; 8 + std::mem::size_of::<T>()];
        self.read_bytes_into(machine, addr, &mut buf)?;
        Ok(bytemuck::pod_read_unaligned(&buf[8..]))
    }

    /// Runs `tasks` tasks of `f` on this thread, each given the [`Pipeline`] it runs its
    /// transactions and reads on and its index, until every one ended: many transactions in
    /// flight on one thread, each yielding to the others while it waits. Takes one host for
    /// the whole batch (a [`Session`] uses its own).
    fn pipeline(&self, tasks: usize, f: impl AsyncFn(&Pipeline<'_>, usize));

    /// The number of machines.
    fn machines(&self) -> u16;
}

impl Client for Cluster {
    fn txn<R>(
        &self,
        machine: MachineId,
        f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        Cluster::txn(self, machine, f)
    }

    fn read_bytes_into(
        &self,
        machine: MachineId,
        addr: Addr,
        buf: &mut [u8],
    ) -> Result<(), TxError> {
        Cluster::read_bytes_into(self, machine, addr, buf)
    }

    fn read<T: bytemuck::Pod>(&self, machine: MachineId, addr: Addr) -> Result<T, TxError> {
        Cluster::read(self, machine, addr)
    }

    fn pipeline(&self, tasks: usize, f: impl AsyncFn(&Pipeline<'_>, usize)) {
        self.pipeline_on(&mut self.host(), tasks, f)
    }

    fn machines(&self) -> u16 {
        Cluster::machines(self)
    }
}

impl<C: Client> Client for Arc<C> {
    fn txn<R>(
        &self,
        machine: MachineId,
        f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        (**self).txn(machine, f)
    }

    fn read_bytes_into(
        &self,
        machine: MachineId,
        addr: Addr,
        buf: &mut [u8],
    ) -> Result<(), TxError> {
        (**self).read_bytes_into(machine, addr, buf)
    }

    fn pipeline(&self, tasks: usize, f: impl AsyncFn(&Pipeline<'_>, usize)) {
        (**self).pipeline(tasks, f)
    }

    fn machines(&self) -> u16 {
        (**self).machines()
    }
}

impl Client for Session<'_> {
    fn txn<R>(
        &self,
        machine: MachineId,
        f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        self.cluster.txn_on(&mut self.held(), machine, f)
    }

    fn read_bytes_into(
        &self,
        machine: MachineId,
        addr: Addr,
        buf: &mut [u8],
    ) -> Result<(), TxError> {
        self.cluster
            .inner
            .hosts
            .read(&mut self.held(), machine, addr, buf)
    }

    fn pipeline(&self, tasks: usize, f: impl AsyncFn(&Pipeline<'_>, usize)) {
        self.cluster.pipeline_on(&mut self.held(), tasks, f)
    }

    fn machines(&self) -> u16 {
        self.cluster.machines()
    }
}

/// An in-process FaRM cluster. See the module docs.
#[derive(Debug)]
pub struct Cluster {
    inner: Arc<Inner>,
    pollers: Vec<JoinHandle<()>>,
    runtime: Runtime,
    lease_length: Arc<LeaseLength>,
}

/// Lock-free reads of objects up to this size use a stack buffer.
const LOCK_FREE_STACK_BYTES: usize = 256;

/// How long a restart of the in-process cluster may take: reopening every machine's NVRAM
/// (seconds for thousands of regions) and the exchange, which takes a few rounds.
const RESTART_TIMEOUT: Duration = Duration::from_secs(120);

/// How often the restart steps its machines' exchanges.
const RESTART_POLL: Duration = Duration::from_micros(50);

/// How long the machines of an in-process restart wait for what the others left before the
/// lowest with a state restarts without the machines whose NVRAM holds nothing ([`ClusterBuilder::restart_without_lost`]).
const LOST_AFTER: Duration = Duration::from_millis(100);

impl Cluster {
    /// A builder with the defaults (3 machines, 2 workers each, 3-way replication).
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    /// Number of machines.
    pub fn machines(&self) -> u16 {
        self.inner.machines.len() as u16
    }

    /// Number of workers (hosts) per machine.
    pub fn workers(&self) -> usize {
        self.inner.hosts.len()
    }

    /// The fabric, for fault injection.
    pub fn fabric(&self) -> &Arc<MemFabric> {
        &self.inner.fabric
    }

    /// Every machine's state (for checkers).
    pub fn machine_states(&self) -> &[Arc<MachineState>] {
        &self.inner.machines
    }

    /// Takes a host for this thread (see `Hosts::take`).
    fn host(&self) -> HostGuard<'_> {
        self.inner.hosts.take()
    }

    /// Runs `f` as a strictly serializable transaction coordinated on `machine`, retrying with
    /// backoff on conflicts (until [`crate::TXN_ATTEMPTS_MAX`] attempts were made and 30 s
    /// passed) and while the cluster reconfigures and recovers (up to 30 s). Returns the closure's value once the transaction
    /// committed, or why it could not. The closure may run several times;
    /// returning an error from it aborts the transaction (use [`Txn::abort`] for a reason).
    pub fn txn<R>(
        &self,
        machine: MachineId,
        f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        self.txn_on(&mut self.host(), machine, f)
    }

    /// A session: this thread's hold on one host (a worker thread of every machine) for many
    /// transactions and reads. [`Cluster::txn`] takes a host for each transaction and gives it
    /// back, and a background poller serves it in between; a client that runs transactions
    /// back to back saves those hand-overs by keeping one. The host's lazy work (truncation,
    /// feedback) then waits for the session's next transaction: drop a session that goes idle.
    /// Sessions may keep every host (one per worker per machine); then a transaction or read
    /// outside them panics rather than wait forever.
    pub fn session(&self) -> Session<'_> {
        let host = self.host();
        self.inner.hosts.keep(host.index(), true);
        Session {
            cluster: self,
            host: std::cell::RefCell::new(host),
        }
    }

    fn txn_on<R>(
        &self,
        host: &mut HostGuard<'_>,
        machine: MachineId,
        f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        assert!(machine.0 < self.machines(), "no machine {machine}");
        self.inner.hosts.txn(host, machine, None, f)
    }

    /// See [`Client::pipeline`]: transactions named after a machine are coordinated by it.
    pub fn pipeline(&self, tasks: usize, f: impl AsyncFn(&Pipeline<'_>, usize)) {
        self.pipeline_on(&mut self.host(), tasks, f)
    }

    fn pipeline_on(
        &self,
        host: &mut HostGuard<'_>,
        tasks: usize,
        f: impl AsyncFn(&Pipeline<'_>, usize),
    ) {
        let machines = self.machines();
        let route = |m: MachineId| {
            assert!(m.0 < machines, "no machine {m}");
            (m, None)
        };
        crate::pipeline::run(&self.inner.hosts, host, &route, machines, tasks, f)
    }

    /// A lock-free read of one object (§3): a single consistent read at the primary, retried
    /// while the object is locked or torn, no transaction records.
    pub fn read<T: bytemuck::Pod>(&self, machine: MachineId, addr: Addr) -> Result<T, TxError> {
        let len = std::mem::size_of::<T>();
        let mut stack = [0u8; 8 + LOCK_FREE_STACK_BYTES];
        let mut heap = Vec::new();
        let buf: &mut [u8] = if len <= LOCK_FREE_STACK_BYTES {
            &mut stack[..8 + len]
        } else {
            heap.resize(8 + len, 0);
            &mut heap
        };
        self.read_into(machine, addr, buf)?;
        Ok(bytemuck::pod_read_unaligned(&buf[8..]))
    }

    /// A lock-free read (see [`Cluster::read`]) of the first `buf.len() - 8` bytes of the object
    /// at `addr` into `buf[8..]` (the first 8 bytes receive the object's header), for objects
    /// whose layout is not a Rust type.
    pub fn read_bytes_into(
        &self,
        machine: MachineId,
        addr: Addr,
        buf: &mut [u8],
    ) -> Result<(), TxError> {
        assert!(buf.len() >= 8, "the buffer has no room for the header");
        self.read_into(machine, addr, buf)
    }

    fn read_into(&self, machine: MachineId, addr: Addr, buf: &mut [u8]) -> Result<(), TxError> {
        self.inner.hosts.read(&mut self.host(), machine, addr, buf)
    }

    /// Waits until every commit has been acknowledged and truncated everywhere, so that backups
    /// have applied every committed write (for checks at quiescence). Callers must have stopped
    /// issuing transactions.
    pub fn quiesce(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.inner.hosts.quiesce_round() {
            if Instant::now() >= deadline {
                panic!(
                    "cluster did not quiesce within 30 s:\n{}",
                    self.inner.hosts.report()
                );
            }
            std::thread::yield_now();
        }
        self.inner.hosts.assert_logs_free();
    }

    /// Kills `machine` the way a crash does: its NIC stops (one-sided operations to and from it
    /// fail, its datagrams are lost) and its lease manager stops; its memory is kept, as NVRAM
    /// is. Other machines notice through leases (§5.1).
    pub fn kill(&self, machine: MachineId) {
        assert!(machine.0 < self.machines(), "no machine {machine}");
        tracing::warn!(machine = machine.0, "killing machine");
        self.inner.fabric.kill(machine);
    }

    /// Stops every machine at once, as a power loss does: every NIC stops (nothing more lands
    /// anywhere) and transactions end with [`TxError::CoordinatorFailed`]; NVRAM keeps what
    /// it holds. Drop the cluster, then [restart](ClusterBuilder::restart) it.
    pub fn power_off(&self) {
        tracing::warn!("power off: every machine stops");
        for m in 0..self.machines() {
            self.inner.fabric.kill(MachineId(m));
        }
    }

    /// Changes the lease length (§5.1) from now on, at every machine and the CM. Leases granted
    /// before keep their expiry, so a shorter lease takes effect once the longer ones end (at
    /// most the old length later), and a machine removed for a failed probe is waited out
    /// with the longest length ever in force. Benchmarks populate with long leases and measure
    /// with short ones: populating touches gigabytes of fresh memory, which on a virtual
    /// machine can stall every thread, real-time ones included, for tens of milliseconds.
    pub fn set_lease(&self, lease: Duration) {
        assert!(
            lease.as_micros() >= 5,
            "a lease needs at least 5 us to renew 5 times"
        );
        self.lease_length.set(lease);
    }

    /// The lease length in force.
    pub fn lease(&self) -> Duration {
        self.lease_length.current()
    }

    /// Microseconds since the cluster started (the clock of [`Suspicion::at_us`]).
    pub fn now_us(&self) -> u64 {
        self.inner.hosts.now()
    }

    /// Adds `machine` (a spare, see [`ClusterBuilder::spare_machines`]) to the configuration:
    /// the CM runs a reconfiguration that probes it and stores, installs and commits a
    /// configuration with it (§5.2). Returns the new configuration's id.
    pub fn join(&self, machine: MachineId) -> Result<farm_core::ConfigId, AdminError> {
        assert!(
            (machine.0 as usize) < self.inner.machines.len(),
            "no machine {machine}"
        );
        crate::machine::ask(&self.inner.shared, |tx| Request::Join(machine, tx))
    }

    /// Allocates a new region through the CM (§3): a running member asks its CM, which takes
    /// the next region id, chooses replicas for capacity, distinct failure domains and locality
    /// (`near`: the same replicas as that region), has every replica prepare it, and commits
    /// the map with it in a new configuration with the same members, installed everywhere
    /// before this returns. Its primary then allocates objects in it.
    pub fn allocate_region(&self, near: Option<RegionId>) -> Result<RegionId, AdminError> {
        crate::machine::ask(&self.inner.shared, |tx| Request::AllocateRegion(near, tx))
    }

    /// Reconfiguration steps so far, in order.
    pub fn reconfig_events(&self) -> Vec<ReconfigEvent> {
        self.inner
            .shared
            .events
            .lock()
            .expect("events poisoned")
            .clone()
    }

    /// The current view of `machine` (its configuration, region map and blocked regions).
    pub fn view(&self, machine: MachineId) -> Arc<farm_txn::machine::View> {
        self.inner.machines[machine.0 as usize].view()
    }

    /// One attempt of [`Cluster::txn`], without retries: conflicts and blocked regions come back
    /// as errors.
    pub fn try_txn<R>(
        &self,
        machine: MachineId,
        mut f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        assert!(machine.0 < self.machines(), "no machine {machine}");
        self.inner
            .hosts
            .attempt(&mut self.host(), machine, None, &mut f)
    }

    /// The throughput timeline (docs/ARCHITECTURE.md, Observability): transactions committed in every
    /// millisecond since the cluster started, with the reconfiguration events, ready to draw
    /// the paper's recovery timelines or to write as JSON ([`Timeline::to_json`]).
    pub fn timeline(&self) -> Timeline {
        let per_ms = self.inner.hosts.committed_per_ms();
        let recovery = self
            .inner
            .machines
            .iter()
            .flat_map(|m| m.recovery_events().into_iter().map(move |e| (m.id, e)))
            .collect();
        Timeline {
            committed_per_ms: per_ms,
            events: self.reconfig_events(),
            suspicions: self.suspicions(),
            recovery,
        }
    }

    /// Whether data recovery and allocator recovery are complete at every member of the
    /// newest configuration any machine installed (§5.4-5.5): every member has installed it,
    /// every region has all its replicas copied and every primary its free lists. A member
    /// that failed and is not yet removed leaves it incomplete (its replicas are to be made
    /// again elsewhere), as does one still on an older view (what it must copy is not known
    /// there yet); a machine removed without knowing it yet is not asked.
    pub fn background_recovery_done(&self) -> bool {
        let machines = &self.inner.machines;
        let newest = machines
            .iter()
            .map(|m| m.view())
            .max_by_key(|v| v.config.id)
            .expect("a cluster has machines");
        newest.config.members.iter().all(|id| {
            let m = &machines[id.0 as usize];
            self.inner.fabric.is_alive(*id)
                && m.view().config.id == newest.config.id
                && m.background_recovery_done()
        })
    }

    /// Every machine's metrics in the Prometheus (OpenMetrics) text format, as a machine
    /// process serves its own (`farm::node::Node::metrics`), each labelled with its machine.
    pub fn metrics(&self) -> String {
        let mut counters = self.inner.hosts.counters();
        let suspicions = self.suspicions();
        let samples = (self.inner.machines.iter())
            .map(|m| {
                let c = counters.remove(&m.id).unwrap_or_default();
                let traffic = self.inner.fabric.traffic(m.id);
                crate::metrics::Sample::of(m, c, &suspicions, (0, traffic))
            })
            .collect();
        let reconfigurations = crate::metrics::Reconfigurations::of(&self.reconfig_events());
        crate::metrics::render(samples, reconfigurations)
    }

    /// Every lease expiry noticed so far, in order.
    pub fn suspicions(&self) -> Vec<Suspicion> {
        self.inner
            .shared
            .suspicions
            .lock()
            .expect("suspicions poisoned")
            .clone()
    }

    /// Counters summed over every worker.
    pub fn stats(&self) -> Stats {
        self.inner.hosts.stats()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.runtime.stop();
        self.inner.hosts.stop();
        for p in self.pollers.drain(..) {
            let _ = p.join();
        }
    }
}
