//! One machine per process: a [`Node`] runs machine `m` of a cluster whose machines are separate
//! processes on one host, over the `shm` fabric (DESIGN.md, Fabric): it takes the machine's
//! liveness lock, maps its NVRAM under `<dir>/m<id>/` (where its peers map it too) and runs its
//! lease thread with the CM of its configuration (§5.1), over UDP datagrams on loopback.
//!
//! This is the first step of the multi-process runtime: membership of the cluster's first
//! configuration and failure detection across processes. Workers, the CM's reconfiguration
//! over messages and joining through ZooKeeper come next; until then a suspicion is recorded
//! ([`Node::suspicions`]) and acted on by nobody.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use farm_core::config::{Configuration, RegionMap};
use farm_core::fabric::Fabric;
use farm_core::ring::RingLayout;
use farm_core::shm_fabric::{ShmError, ShmFabric};
use farm_core::MachineId;
use farm_txn::{MachineState, Params, Replication};

use crate::lease_thread::{LeaseLength, LeaseThreads, Suspicion};

/// How to run one machine of a multi-process cluster.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The cluster's NVRAM directory (each machine's files under `m<id>/`), shared by every
    /// process of the cluster.
    pub dir: PathBuf,
    /// The cluster's id: datagrams of other clusters are dropped.
    pub cluster: u64,
    /// The machine this process runs.
    pub machine: MachineId,
    /// Machines of the first configuration (machine 0 is its CM).
    pub machines: u16,
    /// Worker threads per machine (one ring per peer thread).
    pub workers: u16,
    /// Datagram port of machine 0; machine `m` listens at `base_port + m` on loopback.
    pub base_port: u16,
    /// Lease length.
    pub lease: Duration,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Bad configuration, named.
    #[error("invalid node configuration: {0}")]
    Invalid(String),
    /// The fabric could not start (another process runs this machine, or I/O).
    #[error(transparent)]
    Fabric(#[from] ShmError),
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
    fabric: Arc<ShmFabric>,
    leases: LeaseThreads,
    stop: Arc<AtomicBool>,
    suspicions: Arc<Mutex<Vec<Suspicion>>>,
}

impl Node {
    /// Starts machine `config.machine`: its fabric endpoint, its NVRAM and its lease thread.
    pub fn start(config: &NodeConfig) -> Result<Self, NodeError> {
        if config.machine.0 >= config.machines {
            return Err(NodeError::Invalid(format!(
                "machine {} is not one of the {} machines of the first configuration",
                config.machine, config.machines
            )));
        }
        if config.workers == 0 || config.lease < Duration::from_micros(5) {
            return Err(NodeError::Invalid(
                "a node needs at least one worker and a lease of at least 5 us".into(),
            ));
        }
        let fabric = Arc::new(ShmFabric::start(
            &config.dir,
            config.cluster,
            config.machine,
            config.base_port,
        )?);
        let params = Params {
            layout: RingLayout {
                machines_max: config.machines,
                threads: config.workers,
                log_bytes: 1 << 20,
                queue_bytes: 256 << 10,
            },
            region_bytes: 2 << 30,
            validate_rpc_threshold: 4,
            recovery_interval_ticks: 50,
            replication: Replication::OneSided,
        };
        params.validate().map_err(NodeError::Invalid)?;
        let machine = MachineState::new(
            config.machine,
            params,
            Configuration::initial(config.machines),
            RegionMap::default(),
            fabric.clone() as Arc<dyn Fabric>,
            Some(&config.dir),
        )
        .map_err(|source| NodeError::Nvram {
            machine: config.machine,
            dir: config.dir.display().to_string(),
            source,
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let suspicions = Arc::new(Mutex::new(Vec::new()));
        let leases = LeaseThreads::start(
            std::slice::from_ref(&machine),
            Arc::new(LeaseLength::new(config.lease)),
            fabric.clone() as Arc<dyn Fabric>,
            Instant::now(),
            stop.clone(),
            suspicions.clone(),
        );
        Ok(Self {
            machine,
            fabric,
            leases,
            stop,
            suspicions,
        })
    }

    /// The machine this node runs.
    pub fn id(&self) -> MachineId {
        self.machine.id
    }

    /// The configuration this machine is in.
    pub fn configuration(&self) -> Configuration {
        self.machine.view().config.clone()
    }

    /// Whether `machine`'s process is alive, as the fabric sees it.
    pub fn is_up(&self, machine: MachineId) -> bool {
        self.fabric.is_up(machine)
    }

    /// Machines this node's lease thread suspected, in order (time in µs since it started).
    pub fn suspicions(&self) -> Vec<Suspicion> {
        self.suspicions.lock().expect("suspicions poisoned").clone()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.leases.join();
    }
}
