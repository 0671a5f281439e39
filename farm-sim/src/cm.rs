//! The configuration manager in the simulator: every machine's control plane
//! (`farm_cm::plane`, carried out by `farm_txn::control::MachineControl`), the very code a
//! node runs, stepped by the scheduler (FaRM §5.2-5.4). Control messages are the fabric's
//! datagrams, lost and delayed as the run asks; suspicions come from leases
//! ([`crate::leases`]); the coordination store is an embedded one, the stand-in for ZooKeeper,
//! which may time out as ZooKeeper's operations do ([`crate::SimConfig::store_timeouts`]).
//! A paused machine's plane does not run, and a crashed one's is gone. Members ask for regions
//! at seeded steps ([`crate::SimConfig::allocations`]), which the CM allocates as in every
//! deployment (§3).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use farm_cm::plane::{Event, PlaneParams, ACK_TIMEOUT_LEASES};
use farm_cm::{
    CasOutcome, ConfigurationStore, CoordinationStore, EmbeddedStore, StoreError, StoreVersion,
};
use farm_core::fabric::Fabric;
use farm_core::rng::Rng;
use farm_core::{MachineId, RegionId};
use farm_fabric::mem::MemFabric;
use farm_txn::control::{MachineControl, REGIONS_PER_MACHINE_MAX};
use farm_txn::MachineState;

/// Lease length in ticks (the leases of [`crate::leases`]; a machine removed for a failed probe
/// is waited out this long).
pub const LEASE_TICKS: u64 = 50;

/// How often unanswered control messages are repeated, in ticks (a tenth of a lease).
pub const REPEAT_TICKS: u64 = LEASE_TICKS / 10;

/// One store operation in this many times out, when the run asks for timeouts.
const STORE_TIMEOUT_ONE_IN: u64 = 8;

/// The simulated coordination store: an embedded one whose operations, with `faults`, now and
/// then time out; a compare-and-set as likely after it took effect as before.
#[derive(Debug)]
struct SimStore {
    inner: EmbeddedStore,
    faults: Option<Mutex<Rng>>,
}

impl SimStore {
    /// Whether the next operation times out, and if so whether after taking effect.
    fn timeout(&self) -> Option<bool> {
        let mut rng = self.faults.as_ref()?.lock().expect("store rng");
        match rng.below(2 * STORE_TIMEOUT_ONE_IN) {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
}

impl CoordinationStore for SimStore {
    fn read(&self) -> Result<Option<(StoreVersion, Vec<u8>)>, StoreError> {
        match self.timeout() {
            Some(_) => Err(StoreError::Timeout(0)),
            None => self.inner.read(),
        }
    }

    fn compare_and_set(
        &self,
        expected: Option<StoreVersion>,
        data: &[u8],
    ) -> Result<CasOutcome, StoreError> {
        match self.timeout() {
            Some(false) => Err(StoreError::Timeout(0)),
            Some(true) => {
                let _ = self.inner.compare_and_set(expected, data);
                Err(StoreError::Timeout(0))
            }
            None => self.inner.compare_and_set(expected, data),
        }
    }
}

/// The store as machine `machine` reaches it: unavailable while a partition cuts the machine
/// off from it ([`SimCm::cut_from_store`]).
#[derive(Debug)]
struct MachineStore {
    store: Arc<SimStore>,
    machine: MachineId,
    cut_off: Arc<CutOff>,
}

/// Machines a partition cuts off from the store.
#[derive(Debug, Default)]
struct CutOff(Mutex<BTreeSet<MachineId>>);

impl CutOff {
    fn reaches(&self, machine: MachineId) -> bool {
        !self.0.lock().expect("cut-off set").contains(&machine)
    }
}

impl MachineStore {
    fn reachable(&self) -> Result<(), StoreError> {
        if !self.cut_off.reaches(self.machine) {
            return Err(StoreError::Unavailable(format!(
                "machine {} is cut off from the store",
                self.machine.0
            )));
        }
        Ok(())
    }
}

impl CoordinationStore for MachineStore {
    fn read(&self) -> Result<Option<(StoreVersion, Vec<u8>)>, StoreError> {
        self.reachable()?;
        self.store.read()
    }

    fn compare_and_set(
        &self,
        expected: Option<StoreVersion>,
        data: &[u8],
    ) -> Result<CasOutcome, StoreError> {
        self.reachable()?;
        self.store.compare_and_set(expected, data)
    }
}

/// The simulated CM: each machine's control plane.
#[derive(Debug)]
pub struct SimCm {
    store: Arc<SimStore>,
    /// Machines a partition cuts off from the store.
    cut_off: Arc<CutOff>,
    planes: Vec<MachineControl>,
    /// Configurations committed.
    pub committed: u64,
    /// Regions allocated (§3) and allocation requests refused.
    pub allocated: (u64, u64),
    /// Machines paused now (their planes neither drive nor answer).
    paused: BTreeSet<MachineId>,
    /// Print every reconfiguration step (`FARM_SIM_VERBOSE` set), to follow a failing seed.
    verbose: bool,
}

impl SimCm {
    /// The planes of `machines` over `fabric`, with a store holding their first configuration
    /// (whose operations time out as `faults` draws, if given).
    pub fn new(
        machines: &[Arc<MachineState>],
        fabric: &Arc<MemFabric>,
        replicas: usize,
        faults: Option<Rng>,
    ) -> Self {
        let store = Arc::new(SimStore {
            inner: EmbeddedStore::new(),
            faults: faults.map(Mutex::new),
        });
        let config = machines
            .iter()
            .map(|m| m.view().config.clone())
            .max_by_key(|c| c.id)
            .expect("machines");
        match store.inner.cas_config(None, &config) {
            Ok(CasOutcome::Written(_)) => {}
            other => panic!("storing the first configuration: {other:?}"),
        }
        let params = PlaneParams {
            replicas,
            regions_max: REGIONS_PER_MACHINE_MAX,
            machines_max: machines.len() as u16,
            lease_ticks: LEASE_TICKS,
            lease_longest_ticks: LEASE_TICKS,
            ack_timeout_ticks: ACK_TIMEOUT_LEASES * LEASE_TICKS,
            repeat_ticks: REPEAT_TICKS,
        };
        let cut_off = Arc::new(CutOff::default());
        let planes = machines
            .iter()
            .map(|m| {
                let reached = MachineStore {
                    store: store.clone(),
                    machine: m.id,
                    cut_off: cut_off.clone(),
                };
                let mut plane = MachineControl::new(
                    m.clone(),
                    params,
                    fabric.clone() as Arc<dyn Fabric>,
                    Arc::new(reached) as Arc<dyn CoordinationStore>,
                );
                plane.set_check_invariants(true);
                plane
            })
            .collect();
        Self {
            store,
            cut_off,
            planes,
            committed: 0,
            allocated: (0, 0),
            paused: BTreeSet::new(),
            verbose: std::env::var_os("FARM_SIM_VERBOSE").is_some(),
        }
    }

    /// The store as a whole-cluster restart sees it: without the timeouts of
    /// [`crate::SimConfig::store_timeouts`] (an operator's restart is retried until the store
    /// answers).
    pub fn restart_store(&self) -> &dyn CoordinationStore {
        &self.store.inner
    }

    /// Gives each restarted machine's plane its finished restart exchange, which answers
    /// peers that missed an answer.
    pub fn keep_restarts(&mut self, exchanges: Vec<farm_cm::restart::RestartExchange>) {
        for e in exchanges {
            self.planes[e.machine().0 as usize].set_restart(e);
        }
    }

    /// Cuts `machines` off from the store (and no others): its operations fail for them as
    /// ZooKeeper's do for a client on the far side of a partition.
    pub fn cut_from_store(&self, machines: &[MachineId]) {
        *self.cut_off.0.lock().expect("cut-off set") = machines.iter().copied().collect();
    }

    /// Whether `machine` reaches the store (no partition cuts it off from it).
    pub fn reaches_store(&self, machine: MachineId) -> bool {
        self.cut_off.reaches(machine)
    }

    /// Marks `machine` paused or running again.
    pub fn set_paused(&mut self, machine: MachineId, paused: bool) {
        if paused {
            self.paused.insert(machine);
        } else {
            self.paused.remove(&machine);
        }
    }

    /// `observer`'s lease of `machine` expired at `now`.
    pub fn suspect(&mut self, machine: MachineId, observer: MachineId, now: u64) {
        self.planes[observer.0 as usize].on_suspect(machine, now);
    }

    /// `machine` asks its CM for `count` regions (§3), sharing `near`'s replicas if given.
    pub fn allocate(&mut self, machine: MachineId, count: u32, near: Option<RegionId>, now: u64) {
        let request = self.planes[machine.0 as usize].allocate(count, near, now);
        if self.verbose {
            println!(
                "t{now} m{}: allocation request {request} for {count} regions",
                machine.0
            );
        }
    }

    /// Whether a reconfiguration is under way at a running machine.
    pub fn reconfiguring(&self, fabric: &MemFabric) -> bool {
        self.running(fabric).any(|p| p.reconfiguring())
    }

    /// Whether a reconfiguration is under way or due at a running machine.
    pub fn busy(&self, fabric: &MemFabric) -> bool {
        self.running(fabric).any(|p| p.busy())
    }

    fn running<'a>(&'a self, fabric: &'a MemFabric) -> impl Iterator<Item = &'a MachineControl> {
        self.planes.iter().filter(move |p| {
            let m = p.machine();
            fabric.is_alive(m) && !self.paused.contains(&m)
        })
    }

    /// One step of every running machine's plane: its control datagrams due at `now`, then a
    /// tick. Returns the machines that learnt from the store that they were removed: they stop
    /// (fail-stop, as a node marks itself evicted).
    pub fn step(&mut self, now: u64, fabric: &MemFabric) -> Vec<MachineId> {
        let mut evicted = Vec::new();
        for p in &mut self.planes {
            let m = p.machine();
            if !fabric.is_alive(m) || self.paused.contains(&m) {
                continue;
            }
            p.step(now);
            for (at, e) in p.take_events() {
                if self.verbose {
                    println!("t{at} m{}: {e:?}", m.0);
                }
                if let Event::Committed(_) = e {
                    self.committed += 1;
                }
            }
            for (request, result) in p.take_allocated() {
                if self.verbose {
                    println!("t{now} m{}: allocation request {request}: {result:?}", m.0);
                }
                match result {
                    Ok(regions) => self.allocated.0 += regions.len() as u64,
                    Err(_) => self.allocated.1 += 1,
                }
            }
            if p.evicted() {
                evicted.push(m);
            }
        }
        evicted
    }
}
