//! The deterministic driver: a whole cluster in one thread over the `mem` fabric with writes held
//! back, so that a seeded scheduler decides which worker polls next, which commit advances and
//! when each one-sided write lands (docs/ARCHITECTURE.md, Determinism). It runs the same protocol code as
//! the threaded runtime (`farm_txn::Worker`), prints its seed first, and a seed replays exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use farm_cm::restart::{ExchangeParams, LeaveOut, Outcome, Persisted};
use farm_cm::ConfigurationStore;
use farm_core::config::{Configuration, RegionMap};
use farm_core::fabric::{Endpoint, Fabric};
use farm_core::ring::RingLayout;
use farm_core::rng::Rng;
use farm_core::{Addr, MachineId, ThreadId};
use farm_fabric::mem::{DatagramPolicy, MemFabric, MemFabricConfig};
use farm_txn::machine::Reopen;
use farm_txn::restart::{Finished, MachineRestart};
use farm_txn::{
    CommitHandle, MachineState, Params, Replication, Stats, Tx, TxCore, TxError, Worker,
    COMMITS_IN_FLIGHT_MAX,
};

use crate::cm::{SimCm, LEASE_TICKS, REPEAT_TICKS};
use crate::history::{check, Anomaly, Op, TxnRecord};
use crate::leases::SimLeases;
use crate::replicas::{check_replicas, ReplicaReport};
use farm_cm::reconfig::backup_cms;

/// Polls a setup or final-check transaction may take, with every write landing at once.
const SETUP_POLLS_MAX: u64 = 100_000;

/// Attempts of a final check transaction (each on a running member) before the run fails.
const CHECK_ATTEMPTS_MAX: usize = 20;

/// Ticks a whole-cluster restart's exchange may take: with one datagram in a hundred lost, it
/// takes tens.
const RESTART_TICKS_MAX: u64 = 1_000 * LEASE_TICKS;

/// The latest tick of a restart's exchange at which the simulator cuts the power again.
const RESTART_CUT_TICKS_MAX: u64 = 12;

/// Values a list object can hold.
pub const LIST_CAPACITY: usize = 48;
const LIST_BYTES: usize = 8 * (LIST_CAPACITY + 1);

/// What a simulation runs.
#[derive(Clone, Copy, Debug)]
pub struct SimConfig {
    /// Every random choice flows from this.
    pub seed: u64,
    /// Machines (each a primary of `regions_per_machine` regions, each replicated on the next
    /// `replicas - 1` machines).
    pub machines: u16,
    /// Regions each machine is primary of at the start (the scale campaign runs a thousand and
    /// more in all; regions are then 2 MB instead of 8 MB, since a run touches few of them).
    pub regions_per_machine: u32,
    /// Workers per machine; every worker is also a client.
    pub threads: u16,
    /// Replicas per region (f + 1).
    pub replicas: u16,
    /// List keys.
    pub keys: u64,
    /// Scheduler steps before draining.
    pub steps: u64,
    /// Machines that crash during the run (at seeded steps, landing a seeded prefix of their
    /// held writes); each is suspected when its lease runs out and removed by the CM, and
    /// transaction recovery runs (§5.2-5.3). At most `replicas - 1`.
    pub crashes: u16,
    /// Machines paused during the run, at seeded steps, for two to five leases: they stop
    /// running and answering (cut off from the network, as a stopped process's NIC thread
    /// is), are suspected and removed, then run again on their stale view until their own
    /// lease tells them they are out, and stop.
    pub pauses: u16,
    /// Lose 1% of datagrams and delay each by up to a tenth of a lease (leases must ride it
    /// out; a false suspicion removes a live machine, which then stops like a paused one).
    pub lossy_datagrams: bool,
    /// Whole-cluster power losses at seeded steps, in the middle of a reconfiguration or of
    /// recovery as likely as not: every machine crashes at once, each landing a seeded prefix
    /// of its held writes, and the cluster restarts from its NVRAM (`MachineState::restore`).
    pub power_losses: u16,
    /// Stalls of the whole cluster at seeded steps, for two to five leases each: no machine
    /// runs (a single-process cluster under SIGSTOP, or a VM stalling every thread). Nothing
    /// failed, so nobody may be suspected for it: every lease manager credits its own stall
    /// to the leases it granted (`CmLeases::stalled`).
    pub stalls: u16,
    /// How backups acknowledge COMMIT-BACKUP (FaRM's one-sided writes, or RPCs as in
    /// Tailwind's baseline).
    pub replication: Replication,
    /// The first crash takes the CM of the newest configuration and its first backup CM
    /// together (two of `crashes`): the next machine in the backup-CM line must take over
    /// (§5.2 step 1).
    pub cm_failover: bool,
    /// A paused machine's memory stays reachable: its CPU stops (workers, control plane and
    /// lease manager) while its NIC goes on serving one-sided reads and landing writes, as an
    /// RDMA NIC does, and as the `shm` fabric does for a process under SIGSTOP. Off, a paused
    /// machine is cut off (its peers' operations to it fail, as over `tcp`).
    pub paused_memory_reachable: bool,
    /// The coordination store times out now and then, as ZooKeeper's operations may: a read, or
    /// a compare-and-set before or after it took effect (its caller cannot tell which).
    pub store_timeouts: bool,
    /// Region allocation requests at seeded steps, each from a running member for one or two
    /// regions, half of them near an existing region (§3): placed, prepared and committed as
    /// a configuration with the same members, amid whatever else the run does.
    pub allocations: u16,
    /// Transactions each worker keeps in flight: that many clients share it, each running one
    /// transaction at a time, their executions and commits interleaved as the seed says (the
    /// commits of one worker are in flight together, `Worker::start_commit`).
    pub clients_per_worker: u16,
    /// At each power loss, one member (machine 0 among them) loses its NVRAM with the power
    /// and never comes back, when the failures so far leave room for one more (fewer than
    /// `replicas - 1`) and the restart can go on without it: the lowest machine that came back
    /// restarts the others without it ([`farm_cm::restart::LeaveOut`]).
    pub disk_losses: bool,
    /// Partitions at seeded steps, for two to five leases each: a minority of the running
    /// members (the CM among them half the time) is cut off from the others while every
    /// machine runs on. The majority removes the minority (§5.2); the minority cannot
    /// reconfigure, must serve nothing the majority overwrote (its leases end in time), and
    /// once healed its machines learn that they are out and stop. Every machine a partition
    /// cuts off counts against `replicas - 1` like a crash; a partition with no room left
    /// does not happen. Drawn from a stream of their own, so runs without them replay as
    /// before.
    pub partitions: u16,
    /// With `partitions`: the minority cannot reach the coordination store either (ZooKeeper's
    /// quorum is on the majority's side), so nothing but its leases tells it that it was
    /// removed; partitions last four times as long (eight to twenty leases), long enough for
    /// the majority to recover the minority's regions and write them; and while the partition
    /// lasts, one step in four reads, on a random minority machine, a list that machine is
    /// primary of (a read-only transaction of one object, in the history like a client's).
    /// A minority lease that outlived the removal shows as a stale read.
    pub minority_reads: bool,
    /// Spare machines outside the first configuration (ids after `machines`), each asking to
    /// join at a seeded step (§5.2, as `Cluster::join` and a restarted machine process do):
    /// the CM probes it and adds it in a configuration of its own, amid whatever else the run
    /// does, and its clients run once it is a member. A spare that asked and did not crash
    /// must be a member when the run ends. A power loss before a spare joined (before it
    /// installed a configuration holding it) restarts it as a new spare, which asks again if
    /// it had asked; one that joined takes part in the restart as any member. Drawn from a
    /// stream of their own, so runs without them replay as before.
    pub joins: u16,
}

impl SimConfig {
    /// Machines of the run: the first configuration's members, then the spares.
    pub fn all_machines(&self) -> u16 {
        self.machines + self.joins
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            machines: 3,
            regions_per_machine: 1,
            threads: 2,
            replicas: 3,
            keys: 6,
            steps: 3000,
            crashes: 0,
            pauses: 0,
            lossy_datagrams: false,
            power_losses: 0,
            stalls: 0,
            replication: Replication::OneSided,
            cm_failover: false,
            paused_memory_reachable: false,
            store_timeouts: false,
            allocations: 0,
            clients_per_worker: 1,
            disk_losses: false,
            partitions: 0,
            minority_reads: false,
            joins: 0,
        }
    }
}

/// What a simulation produced.
#[derive(Debug)]
pub struct SimOutcome {
    /// The recorded history.
    pub history: Vec<TxnRecord>,
    /// Strict-serializability violations found in it.
    pub anomalies: Vec<Anomaly>,
    /// Replica comparison at quiescence.
    pub replicas: Result<ReplicaReport, String>,
    /// Counters of every worker, summed.
    pub stats: Stats,
    /// Objects allocated by committed transactions and still live at the end, all checked.
    pub live_objects: usize,
    /// The most commits one worker had in flight at once.
    pub commits_in_flight_max: usize,
    /// The most executions open on one worker at once (suspended while others of its worker
    /// ran).
    pub executions_in_flight_max: usize,
    /// How many times an execution was suspended (waiting for a read, or yielding).
    pub executions_suspended: u64,
    /// Machines crashed.
    pub crashed: Vec<MachineId>,
    /// Transactions whose coordinator crashed mid-commit, and how many of them turned out
    /// committed (all their appends visible at the end; partial ones are anomalies).
    pub unknown: (usize, usize),
    /// Configurations the CM committed.
    pub configurations: u64,
    /// Whole-cluster restarts after a power loss.
    pub restarts: u64,
    /// Of those, restarts after a power loss in the middle of a reconfiguration (the CM busy,
    /// or a member without the newest view), of transaction recovery (a member's thread with
    /// its logs not drained for the newest configuration or a transaction still recovering),
    /// and of data or allocator recovery only.
    pub restarts_mid: (u64, u64, u64),
    /// Restarts the power cut short, during the exchange, and of those, the ones after which
    /// some machine had reopened its NVRAM.
    pub restarts_cut: (u64, u64),
    /// Machines whose NVRAM a power loss took ([`SimConfig::disk_losses`]), and of those,
    /// machine 0 (which decides a restart when every machine comes back).
    pub disks_lost: (u64, u64),
    /// Machines paused.
    pub paused: u64,
    /// Machines that stopped because their own lease told them they had been removed.
    pub evicted: u64,
    /// Whole-cluster stalls.
    pub stalls: u64,
    /// With `cm_failover`: the CM and the first backup CM that crashed together.
    pub cm_failover: Option<(MachineId, MachineId)>,
    /// Regions allocated, and allocation requests refused (§3).
    pub allocated: (u64, u64),
    /// Regions machines whose regions were full got from the CM ([`farm_txn::growth`]): the
    /// regions of the newest view beyond the first view's and those allocated on request.
    pub regions_grown: u64,
    /// Partitions, machines they cut off, and partitions whose minority held the CM.
    pub partitions: (u64, u64, u64),
    /// With [`SimConfig::minority_reads`]: reads a minority machine ran, and of those, the
    /// ones that committed (served under a lease).
    pub minority_reads: (u64, u64),
    /// With [`SimConfig::joins`]: spares that asked to join (and did not lose their disk with
    /// the power before they joined), those that became members, and
    /// those members of the newest configuration at the end (one crashed, paused or cut off
    /// after it joined may be out).
    pub joins: (u64, u64, u64),
    /// Spares a whole-cluster restart brought back: as members (they had joined), and as
    /// spares again (they had not).
    pub spares_restarted: (u64, u64),
}

#[derive(Debug)]
enum Client {
    Idle,
    /// A transaction in execution, suspended while the others of its worker run.
    Executing(Box<Execution>),
    Committing(TxnRecord, Effects, CommitHandle),
}

/// One step of a client's transaction.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Posts a read of every list the transaction goes on to read (`Tx::prefetch`).
    Prefetch,
    /// Allocates an object holding the value near the address (often at a remote primary,
    /// over ALLOC, while the step polls the other workers and lands held work).
    Alloc(Addr, u64),
    /// Reads list `key` at the address, and appends the value if there is one and room.
    List(u64, Addr, Option<u64>),
    /// Reads an object this client allocated, checks it holds the value, and frees it.
    Free(Addr, u64),
}

impl Step {
    /// The read the step makes first, if any: an asynchronous transaction waits until it is
    /// here (`Tx::read_ready`) and lets the others of its worker run meanwhile.
    fn reads(self) -> Option<(Addr, usize)> {
        match self {
            Step::List(_, addr, _) => Some((addr, LIST_BYTES)),
            Step::Free(addr, _) => Some((addr, 16)),
            Step::Prefetch | Step::Alloc(..) => None,
        }
    }
}

/// A client's transaction between its start and its commit: its execution (`TxCore`) while
/// suspended, its steps, and what it did so far. An asynchronous one runs as a task of the
/// runtime's executor does (`Tx::resume`, `Tx::read_ready`, `Tx::suspend`): it yields when a
/// read is not here yet and, as the seed says, between steps, so that the executions of one
/// worker interleave with each other, with its commits and with every fault; a blocking one
/// runs all its steps at once, waiting inside its reads as `txn(|tx| ..)` does.
#[derive(Debug)]
struct Execution {
    /// The execution, taken while a step runs.
    core: Option<TxCore>,
    steps: Vec<Step>,
    /// The step to run next.
    next: usize,
    /// Runs every step at once, waiting inside its reads.
    blocking: bool,
    /// Bit `i % 64`: an asynchronous one yields after step `i`.
    yields: u64,
    rec: TxnRecord,
    effects: Effects,
}

/// Objects a transaction allocates or frees, applied to the client's set when it commits.
#[derive(Debug, Default)]
struct Effects {
    allocated: Option<(Addr, u64)>,
    freed: Option<Addr>,
    /// Wrote nothing: committed on its reads alone, told only while the lease holds.
    read_only: bool,
}

/// A simulated cluster.
#[derive(Debug)]
pub struct Sim {
    rng: Rng,
    now: u64,
    fabric: Arc<MemFabric>,
    machines: Vec<Arc<MachineState>>,
    /// Workers indexed by `machine * threads + thread`.
    workers: Vec<Worker>,
    clients: Vec<Client>,
    keys: Vec<Addr>,
    /// Objects each client allocated and has not freed, with their values.
    temps: Vec<Vec<(Addr, u64)>>,
    history: Vec<TxnRecord>,
    /// History entries whose coordinator crashed before the outcome was known.
    unknown: Vec<usize>,
    next_value: u64,
    config: SimConfig,
    cm: SimCm,
    /// Steps at which a machine crashes, earliest last.
    crash_at: Vec<u64>,
    crashed: Vec<MachineId>,
    /// Machines down in this life of the cluster, their clients' transactions ended (a power
    /// loss restarts the cluster, and a machine crashed before it may come back).
    down: std::collections::BTreeSet<MachineId>,
    /// The most commits one worker had in flight at once.
    commits_in_flight_max: usize,
    /// The most executions open on one worker at once.
    executions_in_flight_max: usize,
    /// How many times an execution was suspended.
    executions_suspended: u64,
    /// Steps from which the power may go, earliest last.
    power_loss_at: Vec<u64>,
    /// The first power loss waits for the CM to start a reconfiguration.
    power_loss_in_reconfiguration: bool,
    /// A link (from, to) whose writes stay held until a step: see `crash_one`.
    slow_link: Option<(MachineId, MachineId, u64)>,
    /// The CM and first backup CM crashed together (`SimConfig::cm_failover`).
    cm_failover: Option<(MachineId, MachineId)>,
    /// Counters of the workers of earlier lives (before power losses).
    past_stats: Stats,
    /// Steps at which a machine pauses, earliest last.
    pause_at: Vec<u64>,
    /// Steps at which the whole cluster stalls, earliest last.
    stall_at: Vec<u64>,
    /// Steps at which a member asks for regions, latest first, and the stream they draw from.
    alloc_at: Vec<u64>,
    alloc_rng: Rng,
    /// Steps at which a minority is cut off, latest first, and the stream they draw from.
    partition_at: Vec<u64>,
    partition_rng: Rng,
    /// The minority cut off now, with the tick the partition heals.
    minority: Option<(Vec<MachineId>, u64)>,
    /// Partitions, machines they cut off, partitions with the CM in the minority.
    partitions_done: (u64, u64, u64),
    /// The stream the minority's reader draws from ([`SimConfig::minority_reads`]), and its
    /// reads run and committed.
    reader_rng: Rng,
    minority_reads: (u64, u64),
    stalls_done: u64,
    /// Paused machines, with the tick they run again.
    paused: BTreeMap<MachineId, u64>,
    /// Resumed machines, with the tick until which they run without looking at their leases.
    grace: BTreeMap<MachineId, u64>,
    leases: SimLeases,
    pauses_done: u64,
    evicted: u64,
    restarts: u64,
    restarts_mid: (u64, u64, u64),
    restarts_cut: (u64, u64),
    disks_lost: (u64, u64),
    spares_restarted: (u64, u64),
    params: Params,
    step_no: u64,
    /// Steps at which a spare asks to join, latest first ([`SimConfig::joins`]).
    join_at: Vec<(u64, MachineId)>,
    /// Spares not yet members of the configuration they installed: their clients wait.
    unjoined: BTreeSet<MachineId>,
    /// Spares that asked to join.
    joining: Vec<MachineId>,
}

impl Sim {
    /// Builds the cluster and allocates the lists.
    pub fn new(config: SimConfig) -> Self {
        // Spares, outside the first configuration, come after its members.
        let all = config.all_machines();
        let layout = RingLayout {
            machines_max: all,
            threads: config.threads,
            log_bytes: 256 << 10,
            queue_bytes: 256 << 10,
        };
        let params = Params {
            layout,
            region_bytes: if config.regions_per_machine > 1 {
                2 << 20
            } else {
                8 << 20
            },
            validate_rpc_threshold: 4,
            recovery_interval_ticks: 2,
            replication: config.replication,
            // REQUEST-VOTE and explicit truncation at the runtime's fractions of the lease
            // (`Params::request_vote_ticks`, `Params::truncate_delay_ticks`: one tick here).
            lease_ticks: LEASE_TICKS,
        };
        let fabric = Arc::new(MemFabric::new(MemFabricConfig {
            machines_max: all,
            threads_max: config.threads,
            seed: config.seed,
            // A NIC's receive queue: enough for every machine's lease renewals at the CM.
            datagrams_queued_max: 64 * all as usize,
        }));
        let cfg = Configuration::initial(config.machines);
        let map = RegionMap::striped(
            config.machines,
            config.regions_per_machine,
            config.replicas - 1,
        );
        let machines: Vec<_> = (0..all)
            .map(|m| {
                let (id, fabric) = (MachineId(m), fabric.clone() as Arc<dyn Fabric>);
                // A spare is a new incarnation waiting to join, as `Cluster::join`'s are.
                if m >= config.machines {
                    MachineState::joiner(id, params, cfg.clone(), fabric, None)
                } else {
                    MachineState::new(id, params, cfg.clone(), map.clone(), fabric, None)
                }
                .expect("anonymous NVRAM")
            })
            .collect();
        let workers = machines
            .iter()
            .flat_map(|m| (0..config.threads).map(move |t| sim_worker(m, ThreadId(t))))
            .collect::<Vec<_>>();
        assert!(
            (1..=COMMITS_IN_FLIGHT_MAX as u16).contains(&config.clients_per_worker),
            "clients per worker: 1 to {COMMITS_IN_FLIGHT_MAX}"
        );
        let n_clients = workers.len() * config.clients_per_worker as usize;
        let clients = (0..n_clients).map(|_| Client::Idle).collect();
        assert!(
            config.crashes + config.pauses < config.replicas,
            "{} crashes and {} pauses (a paused machine is removed) would lose regions with {} \
             replicas",
            config.crashes,
            config.pauses,
            config.replicas
        );
        let mut rng = Rng::new(config.seed);
        // Crashes between a fifth and four fifths of the run; a second one may land while the
        // first is still being recovered.
        let mut crash_at: Vec<u64> = (0..config.crashes)
            .map(|_| config.steps / 5 + rng.below(config.steps * 3 / 5))
            .collect();
        crash_at.sort_unstable_by(|a, b| b.cmp(a));
        let mut power_loss_at: Vec<u64> = (0..config.power_losses)
            .map(|_| config.steps / 5 + rng.below(config.steps * 3 / 5))
            .collect();
        // In a third of the runs with a crash, the power goes soon after it, during the
        // recovery that follows; in another third, during the reconfiguration (a few steps
        // after the CM starts one, `step`).
        let mut power_loss_in_reconfiguration = false;
        if let (Some(crash), Some(first)) = (crash_at.last(), power_loss_at.first_mut()) {
            match rng.below(3) {
                0 => *first = crash + rng.below(config.steps / 5),
                1 => {
                    *first = u64::MAX;
                    power_loss_in_reconfiguration = true;
                }
                _ => {}
            }
        }
        power_loss_at.sort_unstable_by(|a, b| b.cmp(a));
        let mut pause_at: Vec<u64> = (0..config.pauses)
            .map(|_| config.steps / 5 + rng.below(config.steps * 3 / 5))
            .collect();
        pause_at.sort_unstable_by(|a, b| b.cmp(a));
        let mut stall_at: Vec<u64> = (0..config.stalls)
            .map(|_| config.steps / 5 + rng.below(config.steps * 3 / 5))
            .collect();
        stall_at.sort_unstable_by(|a, b| b.cmp(a));
        // Allocations draw from a stream of their own, so that runs without them replay as
        // before.
        let mut alloc_rng = Rng::new(config.seed ^ 0xa110_c8ed_5eed);
        let mut alloc_at: Vec<u64> = (0..config.allocations)
            .map(|_| config.steps / 10 + alloc_rng.below(config.steps * 4 / 5))
            .collect();
        alloc_at.sort_unstable_by(|a, b| b.cmp(a));
        let mut partition_rng = Rng::new(config.seed ^ 0x9a27_1710_5eed);
        let mut partition_at: Vec<u64> = (0..config.partitions)
            .map(|_| config.steps / 5 + partition_rng.below(config.steps * 3 / 5))
            .collect();
        partition_at.sort_unstable_by(|a, b| b.cmp(a));
        let mut join_rng = Rng::new(config.seed ^ 0x701e_5eed);
        let mut join_at: Vec<(u64, MachineId)> = (config.machines..all)
            .map(|m| {
                (
                    config.steps / 10 + join_rng.below(config.steps * 3 / 5),
                    MachineId(m),
                )
            })
            .collect();
        join_at.sort_unstable_by(|a, b| b.cmp(a));
        let leases = SimLeases::new(&machines, LEASE_TICKS, 0);
        let mut cm = SimCm::new(
            &machines,
            &fabric,
            config.replicas as usize,
            store_faults(&config, 0),
        );
        // A spare's plane stays quiet (it would ask to join at once) until its step.
        for m in config.machines..all {
            cm.set_paused(MachineId(m), true);
        }
        let mut sim = Sim {
            rng,
            now: 0,
            fabric,
            machines,
            workers,
            clients,
            keys: Vec::new(),
            temps: vec![Vec::new(); n_clients],
            history: Vec::new(),
            unknown: Vec::new(),
            next_value: 1,
            config,
            cm,
            crash_at,
            crashed: Vec::new(),
            down: Default::default(),
            commits_in_flight_max: 0,
            executions_in_flight_max: 0,
            executions_suspended: 0,
            power_loss_at,
            power_loss_in_reconfiguration,
            slow_link: None,
            cm_failover: None,
            past_stats: Stats::default(),
            pause_at,
            stall_at,
            alloc_at,
            alloc_rng,
            partition_at,
            partition_rng,
            minority: None,
            partitions_done: (0, 0, 0),
            reader_rng: Rng::new(config.seed ^ 0x4ead_e450_5eed),
            minority_reads: (0, 0),
            stalls_done: 0,
            paused: BTreeMap::new(),
            grace: BTreeMap::new(),
            leases,
            pauses_done: 0,
            evicted: 0,
            restarts: 0,
            restarts_mid: (0, 0, 0),
            restarts_cut: (0, 0),
            disks_lost: (0, 0),
            spares_restarted: (0, 0),
            params,
            step_no: 0,
            join_at,
            unjoined: (config.machines..all).map(MachineId).collect(),
            joining: Vec::new(),
        };
        // The lists live at the first configuration's members.
        let member_workers = config.machines as usize * config.threads as usize;
        for k in 0..config.keys {
            let w = (k as usize * config.threads as usize) % member_workers;
            let addr = sim.setup_txn(w, |tx| {
                let a = tx.alloc(LIST_BYTES, None)?;
                tx.write(a, &[0u8; LIST_BYTES])?;
                Ok(a)
            });
            sim.keys.push(addr);
        }
        sim.fabric.set_hold(true);
        sim.fabric.set_datagram_policy(sim.datagram_policy());
        sim
    }

    /// The datagram behaviour of the randomized run.
    fn datagram_policy(&self) -> DatagramPolicy {
        if self.config.lossy_datagrams {
            DatagramPolicy {
                drop_per_million: 10_000,
                delay_ticks_max: LEASE_TICKS / 10,
            }
        } else {
            DatagramPolicy {
                drop_per_million: 0,
                delay_ticks_max: 0,
            }
        }
    }

    /// Whether machine `m` runs: alive and not paused.
    fn running(&self, m: MachineId) -> bool {
        running(&self.fabric, &self.paused, m)
    }

    /// A spare that asked to join, runs, and is no member of the newest committed
    /// configuration.
    fn spare_waiting(&self) -> Option<MachineId> {
        let newest = self.newest_committed()?;
        (self.joining.iter().copied()).find(|m| self.running(*m) && !newest.contains(*m))
    }

    /// Steps until `waiting` names no machine, at most [`JOIN_WAIT_STEPS`] steps after the run.
    fn settle(&mut self, waiting: fn(&Self) -> Option<MachineId>, what: &str) {
        let mut rounds = 0u64;
        while let Some(m) = waiting(self) {
            self.step(false);
            rounds += 1;
            assert!(
                rounds < JOIN_WAIT_STEPS,
                "seed {}: {m} {what} {JOIN_WAIT_STEPS} steps after the run (newest {:?})",
                self.config.seed,
                self.newest_committed()
            );
        }
    }

    /// A running member of the newest committed configuration whose request for a region (its
    /// regions being full) is not answered.
    fn growth_waiting(&self) -> Option<MachineId> {
        let newest = self.newest_committed()?;
        (newest.members.iter().copied())
            .find(|m| self.running(*m) && self.machines[m.0 as usize].growth.pending())
    }

    /// Whether `m` is a spare not yet a member of the configuration it installed (noted at
    /// every step: a spare added stays a machine of the cluster, removed later or not).
    fn unjoined(&self, m: MachineId) -> bool {
        self.unjoined.contains(&m)
    }

    /// Notes the spares that installed a configuration with them in it.
    fn note_joined(&mut self) {
        let machines = &self.machines;
        (self.unjoined).retain(|m| !machines[m.0 as usize].view().config.contains(*m));
    }

    /// The newest configuration committed at a running machine.
    fn newest_committed(&self) -> Option<Configuration> {
        newest_view(&self.fabric, &self.paused, &self.machines, true).map(|v| v.config.clone())
    }

    /// Leases, then stops the machines that learnt from theirs that they are out.
    fn lease_step(&mut self) {
        let out = lease_round(
            &mut self.leases,
            &mut self.cm,
            &self.fabric,
            &self.machines,
            (&self.paused, &self.grace),
            self.now,
        );
        self.stop_evicted(out);
    }

    /// Stops machines whose own lease told them they were removed (fail-stop); those stopped
    /// in the middle of an execution already had their fabric side crashed.
    fn stop_evicted(&mut self, out: Vec<MachineId>) {
        for m in out {
            if self.fabric.is_alive(m) {
                self.fabric.crash(m, &mut self.rng);
            }
            if !self.down.contains(&m) {
                self.evicted += 1;
                self.crashed_now(m);
            }
        }
    }

    /// Pauses a random running machine for two to five leases: it is cut off (a partition of
    /// its own) and not scheduled.
    fn pause_one(&mut self) {
        let running: Vec<MachineId> = (0..self.machines.len() as u16)
            .map(MachineId)
            .filter(|m| self.running(*m) && !self.unjoined.contains(m))
            .collect();
        let m = running[self.rng.below(running.len() as u64) as usize];
        let until = self.now + LEASE_TICKS * (2 + self.rng.below(4));
        self.paused.insert(m, until);
        self.cm.set_paused(m, true);
        self.pauses_done += 1;
        self.cut_network();
    }

    /// Resumes paused machines whose time came: reachable again, scheduled again, and not
    /// looking at their leases for up to a lease.
    fn resume_due(&mut self) {
        let now = self.now;
        let due: Vec<MachineId> = self
            .paused
            .iter()
            .filter(|(_, until)| **until <= now)
            .map(|(m, _)| *m)
            .collect();
        for m in &due {
            self.paused.remove(m);
            self.cm.set_paused(*m, false);
            let grace = self.rng.below(LEASE_TICKS);
            self.grace.insert(*m, now + grace);
        }
        let healed = self
            .minority
            .as_ref()
            .is_some_and(|(_, until)| *until <= now);
        if healed {
            self.minority = None;
        }
        if !due.is_empty() || healed {
            self.cut_network();
        }
    }

    /// Cuts a minority of the running members off from the others (see
    /// [`SimConfig::partitions`]), if the failure budget leaves room for one.
    fn partition_one(&mut self) {
        if self.minority.is_some() {
            return;
        }
        let Some(view) = newest_view(&self.fabric, &self.paused, &self.machines, false) else {
            return;
        };
        let members = &view.config.members;
        let used = self.config.crashes + self.config.pauses + self.partitions_done.1 as u16;
        let budget = self.config.replicas.saturating_sub(1 + used) as usize;
        let k_max = budget.min((members.len() - 1) / 2);
        if k_max == 0 {
            return;
        }
        let r = &mut self.partition_rng;
        let k = 1 + r.below(k_max as u64) as usize;
        let mut candidates: Vec<MachineId> = members
            .iter()
            .copied()
            .filter(|m| running(&self.fabric, &self.paused, *m))
            .collect();
        let mut minority = Vec::with_capacity(k);
        let with_cm = r.below(2) == 0 && candidates.contains(&view.config.cm);
        if with_cm {
            minority.push(view.config.cm);
            candidates.retain(|m| *m != view.config.cm);
        }
        while minority.len() < k && !candidates.is_empty() {
            let i = r.below(candidates.len() as u64) as usize;
            minority.push(candidates.swap_remove(i));
        }
        let stretch = if self.config.minority_reads { 4 } else { 1 };
        let until = self.now + LEASE_TICKS * (2 + r.below(4)) * stretch;
        self.partitions_done.0 += 1;
        self.partitions_done.1 += minority.len() as u64;
        self.partitions_done.2 += with_cm as u64;
        self.minority = Some((minority, until));
        self.cut_network();
    }

    /// The network as the faults leave it: the minority of a partition on a side of its own,
    /// and each paused machine on one of its own unless its memory stays reachable
    /// ([`SimConfig::paused_memory_reachable`]); everyone else together.
    fn cut_network(&self) {
        let alone: Vec<[MachineId; 1]> = if self.config.paused_memory_reachable {
            Vec::new()
        } else {
            self.paused.keys().map(|m| [*m]).collect()
        };
        let mut sides: Vec<&[MachineId]> = vec![&[]];
        if let Some((minority, _)) = &self.minority {
            sides.push(minority);
        }
        sides.extend(alone.iter().map(|a| &a[..]));
        self.fabric.partition(&sides);
        let without_store = match &self.minority {
            Some((minority, _)) if self.config.minority_reads => &minority[..],
            _ => &[],
        };
        self.cm.cut_from_store(without_store);
    }

    /// A read-only transaction of one list whose primary is a random machine of the minority,
    /// on one of its workers ([`SimConfig::minority_reads`]): committed only while the
    /// machine's lease holds, as every read-only commit.
    fn minority_read(&mut self) {
        let Some((minority, _)) = &self.minority else {
            return;
        };
        let m = minority[self.reader_rng.below(minority.len() as u64) as usize];
        let threads = self.config.threads as usize;
        let w = m.0 as usize * threads + self.reader_rng.below(threads as u64) as usize;
        if !self.running(m) || self.workers[w].commits_in_flight() >= COMMITS_IN_FLIGHT_MAX {
            return;
        }
        let view = self.workers[w].machine().view();
        let own: Vec<(u64, Addr)> = (self.keys.iter().enumerate())
            .filter(|(_, a)| view.map.get(a.region).is_some_and(|p| p.primary == m))
            .map(|(k, a)| (k as u64, *a))
            .collect();
        if own.is_empty() {
            return;
        }
        let (key, addr) = own[self.reader_rng.below(own.len() as u64) as usize];
        let invoke = self.now;
        let mut tx = Tx::new(&mut self.workers[w]);
        let read = tx.read(addr, LIST_BYTES).map(|b| b.to_vec());
        let state = tx.into_state();
        let bytes = match read {
            Ok(bytes) => bytes,
            Err(e) => {
                self.workers[w].abort_execution(state, &e);
                return;
            }
        };
        let txn = self.workers[w].start_commit(state);
        let result = (self.workers[w].poll_commit(txn, self.now)).unwrap_or_else(|| {
            panic!(
                "seed {}: a read-only commit of one object was not decided at its first poll",
                self.config.seed
            )
        });
        let committed = result.is_ok() && self.workers[w].machine().serves_at(self.now);
        self.minority_reads.0 += 1;
        self.minority_reads.1 += committed as u64;
        self.history.push(TxnRecord {
            ops: vec![Op::Read {
                key,
                values: list_values(&bytes),
            }],
            invoke,
            complete: self.now,
            committed,
        });
    }

    /// Runs a transaction to completion with every write landing at once (setup, outside the
    /// randomized schedule).
    fn setup_txn<R>(&mut self, w: usize, f: impl FnOnce(&mut Tx<'_>) -> Result<R, TxError>) -> R {
        self.try_txn(w, f).expect("setup transaction")
    }

    /// A transaction of the final checks, on a running member's worker: again on another's
    /// when its machine is removed under it (with lossy datagrams a false suspicion may remove
    /// a live machine at any time, the end included: seed 35335 of the varied shapes lost
    /// its checker, the CM, in the final read).
    fn check_txn<R>(&mut self, f: impl Fn(&mut Tx<'_>) -> Result<R, TxError>) -> R {
        let mut last = None;
        for _ in 0..CHECK_ATTEMPTS_MAX {
            let checker = (0..self.workers.len())
                .find(|w| self.alive_worker(*w) && self.workers[*w].is_member())
                .expect("a live member");
            match self.try_txn(checker, &f) {
                Ok(r) => return r,
                Err(e) if e.is_retryable() => last = Some(e),
                Err(e) => panic!("seed {}: a check transaction failed: {e}", self.config.seed),
            }
        }
        panic!(
            "seed {}: a check transaction failed {CHECK_ATTEMPTS_MAX} times, last with {last:?}",
            self.config.seed
        );
    }

    /// Runs a transaction on worker `w` to completion, every write landing at once: its value,
    /// or the error that ended it.
    fn try_txn<R>(
        &mut self,
        w: usize,
        f: impl FnOnce(&mut Tx<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        let mut tx = Tx::new(&mut self.workers[w]);
        let r = f(&mut tx);
        let state = tx.into_state();
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                self.workers[w].abort_execution(state, &e);
                return Err(e);
            }
        };
        let txn = self.workers[w].start_commit(state);
        for _ in 0..SETUP_POLLS_MAX {
            self.now += 1;
            self.fabric.deliver_all();
            self.lease_step();
            let out = self.cm.step(self.now, &self.fabric);
            self.stop_evicted(out);
            for x in self.workers.iter_mut() {
                if self.fabric.is_alive(x.machine().id) {
                    x.poll(self.now);
                }
            }
            if let Some(res) = self.workers[w].poll_commit(txn, self.now) {
                return res.map(|()| r);
            }
        }
        panic!(
            "seed {}: a setup or check transaction did not commit",
            self.config.seed
        );
    }

    fn alive_worker(&self, w: usize) -> bool {
        self.running(self.workers[w].machine().id)
    }

    /// The worker that client `c` runs its transactions on.
    fn worker_of(&self, c: usize) -> usize {
        c / self.config.clients_per_worker as usize
    }

    /// A running member asks its CM for one or two regions, half the time near one of its own.
    fn allocate_one(&mut self) {
        let members: Vec<MachineId> = (self.machines.iter())
            .filter(|m| self.running(m.id) && m.view().config.contains(m.id) && !m.is_evicted())
            .map(|m| m.id)
            .collect();
        if members.is_empty() {
            return;
        }
        let m = members[self.alloc_rng.below(members.len() as u64) as usize];
        let count = 1 + self.alloc_rng.below(2) as u32;
        let near = (self.alloc_rng.below(2) == 0)
            .then(|| self.machines[m.0 as usize].view().map.primary_of(m).next())
            .flatten();
        self.cm.allocate(m, count, near, self.now);
    }

    /// Crashes a random running machine (the CM included); its lease expiry tells the CM.
    fn crash_one(&mut self) {
        let live: Vec<MachineId> = self
            .machines
            .iter()
            .map(|m| m.id)
            .filter(|m| self.running(*m) && !self.unjoined.contains(m))
            .collect();
        let victim = if self.config.cm_failover && self.crashed.is_empty() {
            // The CM and its first backup CM at once; the second crash is this one.
            let view = newest_view(&self.fabric, &self.paused, &self.machines, false)
                .expect("a running member");
            let backup = backup_cms(&view.config, view.config.members.len())[0];
            if self.running(backup) && self.running(view.config.cm) {
                self.crash(backup);
                self.crash_at.pop();
                self.cm_failover = Some((view.config.cm, backup));
            }
            view.config.cm
        } else {
            live[self.rng.below(live.len() as u64) as usize]
        };
        if !self.running(victim) {
            return; // Already down (paused machines are not crashed).
        }
        self.crash(victim);
        // With power losses to come, half the time a link between two survivors stalls for a
        // while: writes of transactions in flight land after the reconfiguration's drain,
        // where recovery rejects them, and a power loss may come before they are processed.
        if self.config.power_losses > 0 && self.rng.below(2) == 0 {
            let survivors: Vec<MachineId> = live.into_iter().filter(|m| *m != victim).collect();
            if survivors.len() >= 2 {
                let i = self.rng.below(survivors.len() as u64) as usize;
                let j =
                    (i + 1 + self.rng.below(survivors.len() as u64 - 1) as usize) % survivors.len();
                let until = self.step_no + 100 + self.rng.below(400);
                self.slow_link = Some((survivors[i], survivors[j], until));
            }
        }
    }

    /// Crashes `victim`: a prefix of its held writes lands and its clients' commits in flight
    /// get unknown outcomes.
    fn crash(&mut self, victim: MachineId) {
        self.fabric.crash(victim, &mut self.rng);
        self.crashed_now(victim);
    }

    /// What follows a crash of `victim` (whose fabric side is done): its clients' commits in
    /// flight get unknown outcomes.
    fn crashed_now(&mut self, victim: MachineId) {
        self.crashed.push(victim);
        self.down.insert(victim);
        for c in 0..self.clients.len() {
            if self.workers[self.worker_of(c)].machine().id == victim {
                self.commit_unknown(c);
            }
        }
    }

    /// Client `c`'s commit in flight, if any, has an unknown outcome (its coordinator crashed
    /// or the power went): recorded as such, and an object it freed is no longer checked (a
    /// power loss may bring the client back). An execution in progress ends uncommitted.
    fn commit_unknown(&mut self, c: usize) {
        match std::mem::replace(&mut self.clients[c], Client::Idle) {
            Client::Committing(rec, effects, _) => {
                self.unknown.push(self.history.len());
                self.history.push(rec);
                if let Some(a) = effects.freed {
                    self.temps[c].retain(|(t, _)| *t != a);
                }
            }
            // An execution never committed: it ends with its machine.
            Client::Executing(exec) => self.history.push(exec.rec),
            Client::Idle => {}
        }
    }

    /// The power goes: every live machine crashes at once, landing a prefix of its held writes,
    /// and every commit in flight gets an unknown outcome. Then the cluster restarts from its
    /// memory, which survived as NVRAM does: the members of the stored configuration reopen it
    /// in a new configuration whose recovery decides every transaction the logs hold; machines
    /// removed before stay down.
    fn power_loss(&mut self) {
        let newest = self
            .machines
            .iter()
            .map(|m| m.view())
            .max_by_key(|v| v.config.id)
            .expect("machines");
        let members = &newest.config.members;
        let views_differ = members
            .iter()
            .any(|m| self.machines[m.0 as usize].view().config.id != newest.config.id);
        let transaction_recovery = self.workers.iter().any(|w| {
            members.contains(&w.machine().id)
                && (w.last_drained() < newest.config.id || !w.recovery_idle())
        });
        if self.cm.busy(&self.fabric) || views_differ {
            self.restarts_mid.0 += 1;
        } else if transaction_recovery {
            self.restarts_mid.1 += 1;
        } else if members
            .iter()
            .any(|m| self.machines[m.0 as usize].settled_config() != newest.config.id)
        {
            self.restarts_mid.2 += 1;
        }
        for m in 0..self.machines.len() {
            let m = MachineId(m as u16);
            if self.fabric.is_alive(m) {
                self.fabric.crash(m, &mut self.rng);
            }
        }
        for c in 0..self.clients.len() {
            self.commit_unknown(c);
        }
        self.down.clear();
        let seed = self.config.seed;
        // The power may go again during the restart (a third of the restarts), a few ticks
        // into the exchange (which takes about ten without losses): some machines may have
        // reopened their NVRAM by then.
        let mut cut_after =
            (self.rng.below(3) == 0).then(|| 1 + self.rng.below(RESTART_CUT_TICKS_MAX));
        // A disk that dies with the power: a member (machine 0 too), if one more failure
        // than the run plans (crashes, and pauses, which get machines removed) and the disks
        // lost before leaves room for the failures still to come, and if the restart can go
        // on without it (`farm_cm::restart::decide`: a complete replica of every region and a
        // majority among the machines that come back; machines still copying count).
        let failures =
            (self.config.crashes + self.config.pauses) as usize + self.disks_lost.0 as usize;
        let lost = (self.config.disk_losses && failures + 1 < self.config.replicas as usize)
            .then(|| {
                let stored = (self.cm.restart_store().read_config())
                    .expect("the simulated store answers reads at a power loss")
                    .expect("a configuration is stored")
                    .1
                    .id;
                let persisted: Vec<Option<Persisted>> = self
                    .machines
                    .iter()
                    .map(|m| Some(persisted_of(m)))
                    .collect();
                let leave_out = leave_out_of(&self.config);
                let candidates: Vec<MachineId> = (members.iter().copied())
                    .filter(|m| {
                        let mut without = persisted.clone();
                        without[m.0 as usize] = None;
                        let machines = self.config.all_machines();
                        farm_cm::restart::decide(stored, &without, machines, leave_out).is_ok()
                    })
                    .collect();
                (!candidates.is_empty())
                    .then(|| candidates[self.rng.below(candidates.len() as u64) as usize])
            })
            .flatten();
        if let Some(m) = lost {
            self.disks_lost.0 += 1;
            self.disks_lost.1 += (m == MachineId(0)) as u64;
            self.crashed.push(m);
        }
        let mut stopped = std::mem::take(&mut self.machines);
        let (fabric, restarts) = loop {
            let fabric = Arc::new(MemFabric::new(MemFabricConfig {
                machines_max: self.config.all_machines(),
                threads_max: self.config.threads,
                seed: self.rng.below(u64::MAX),
                datagrams_queued_max: 64 * self.config.all_machines() as usize,
            }));
            // The restart's datagrams are as lossy as any.
            fabric.set_datagram_policy(self.datagram_policy());
            let store = self.cm.restart_store();
            // Each round of the exchange is a new life of every machine, drawn apart from the
            // run's random sequence so that the seeds of earlier builds replay the same.
            let round = (self.restarts << 32) | self.restarts_cut.0;
            let mut restarts =
                restarts_of(&stopped, &fabric, store, self.params, &self.config, round);
            if let Some(m) = lost {
                // It never runs again: nothing reaches it, and it sends nothing.
                fabric.kill(m);
            }
            let cut = cut_after.take().map(|t| self.now + t);
            // Every machine's process starts again and takes part, in an order that turns.
            let deadline = self.now + RESTART_TICKS_MAX;
            let running = |r: &MachineRestart<'_>| Some(r.machine()) != lost;
            while restarts.iter().any(|r| running(r) && r.outcome().is_none())
                && cut != Some(self.now)
            {
                if self.now > deadline {
                    let waiting: Vec<_> = restarts.iter().map(|r| r.waiting_for()).collect();
                    panic!(
                        "seed {seed}: the restart did not finish: machines wait for {waiting:?}"
                    );
                }
                self.now += 1;
                let n = restarts.len();
                for k in 0..n {
                    let r = &mut restarts[(self.now as usize + k) % n];
                    if !running(r) {
                        continue;
                    }
                    r.step(self.now);
                    if let Some(Outcome::Failed(e)) = r.outcome() {
                        panic!("seed {seed}: restart refused at {}: {e}", r.machine());
                    }
                }
            }
            if cut != Some(self.now) {
                let finished: Vec<Option<Finished>> = (restarts.into_iter())
                    .map(|r| running(&r).then(|| r.finish()))
                    .collect();
                break (fabric, finished);
            }
            // The power went: what each machine reopened is its NVRAM now.
            self.restarts_cut.0 += 1;
            let reopened: Vec<Option<Arc<MachineState>>> =
                restarts.into_iter().map(|r| r.abandon()).collect();
            if reopened.iter().any(Option::is_some) {
                self.restarts_cut.1 += 1;
            }
            stopped = reopened
                .into_iter()
                .zip(stopped)
                .map(|(r, old)| r.unwrap_or(old))
                .collect();
        };
        let threads = self.config.threads;
        let mut machines = Vec::new();
        let mut workers = Vec::new();
        let mut exchanges = Vec::new();
        let plan = restarts
            .iter()
            .flatten()
            .find_map(|r| match r {
                Finished::Restarted(r) => Some(r.machine.view().config.clone()),
                _ => None,
            })
            .expect("a member restarted");
        for r in restarts {
            match r {
                Some(Finished::Restarted(r)) => {
                    self.spares_restarted.0 += (r.machine.id.0 >= self.config.machines) as u64;
                    machines.push(r.machine);
                    workers.extend(r.workers.into_iter().map(|mut w| {
                        w.set_check_invariants(true);
                        w
                    }));
                    exchanges.push(r.exchange);
                }
                // A spare that had not joined: outside the restart, its process starts again
                // as a new spare (it asks to join again if it had asked).
                Some(Finished::Removed(_)) if self.unjoined(MachineId(machines.len() as u16)) => {
                    let id = MachineId(machines.len() as u16);
                    let f = fabric.clone() as Arc<dyn Fabric>;
                    let m = MachineState::joiner(id, self.params, plan.clone(), f, None)
                        .expect("anonymous NVRAM");
                    self.spares_restarted.1 += 1;
                    workers.extend((0..threads).map(|t| sim_worker(&m, ThreadId(t))));
                    machines.push(m);
                }
                // Removed before the power went, or its NVRAM is gone: it stays down.
                Some(Finished::Removed(_)) | None => {
                    let id = MachineId(machines.len() as u16);
                    fabric.kill(id);
                    self.down.insert(id);
                    let f = fabric.clone() as Arc<dyn Fabric>;
                    let m = MachineState::new(
                        id,
                        self.params,
                        plan.clone(),
                        RegionMap::default(),
                        f,
                        None,
                    )
                    .expect("anonymous NVRAM");
                    workers.extend((0..threads).map(|t| sim_worker(&m, ThreadId(t))));
                    machines.push(m);
                }
                Some(Finished::Failed(e)) => panic!("seed {seed}: restart refused: {e}"),
            }
        }
        drop(stopped);
        fabric.set_hold(true);
        self.paused.clear();
        self.grace.clear();
        self.minority = None;
        self.leases = SimLeases::new(&machines, LEASE_TICKS, self.now);
        let (committed, allocated) = (self.cm.committed, self.cm.allocated);
        let faults = store_faults(&self.config, self.restarts);
        self.cm = SimCm::new(&machines, &fabric, self.config.replicas as usize, faults);
        (self.cm.committed, self.cm.allocated) = (committed, allocated);
        // A spare's plane stays quiet until its step, as at the start.
        for m in self.unjoined.iter().filter(|m| !self.joining.contains(m)) {
            self.cm.set_paused(*m, true);
        }
        self.cm.keep_restarts(exchanges);
        self.fabric = fabric;
        self.machines = machines;
        for w in &self.workers {
            self.past_stats.add(w.stats());
        }
        self.workers = workers;
        self.restarts += 1;
    }

    /// One scheduler step: poll a worker, land a held write, advance a client, or step the CM.
    fn step(&mut self, start_new: bool) {
        self.now += 1;
        self.step_no += 1;
        self.note_joined();
        if self.crash_at.last() == Some(&self.step_no) {
            self.crash_at.pop();
            self.crash_one();
        }
        if self.pause_at.last() == Some(&self.step_no) {
            self.pause_at.pop();
            self.pause_one();
        }
        // Two stalls drawn at the same step are one after the other.
        while self.stall_at.last() == Some(&self.step_no) {
            self.stall_at.pop();
            // Nothing runs while the cluster stalls: time simply moves on.
            self.now += LEASE_TICKS * (2 + self.rng.below(4));
            self.stalls_done += 1;
        }
        while self.alloc_at.last() == Some(&self.step_no) {
            self.alloc_at.pop();
            self.allocate_one();
        }
        if self.partition_at.last() == Some(&self.step_no) {
            self.partition_at.pop();
            self.partition_one();
        }
        while self
            .join_at
            .last()
            .is_some_and(|(at, _)| *at == self.step_no)
        {
            let (_, m) = self.join_at.pop().expect("due");
            self.cm.set_paused(m, false);
            self.joining.push(m);
        }
        if self.config.minority_reads && self.minority.is_some() && self.reader_rng.below(4) == 0 {
            self.minority_read();
        }
        self.resume_due();
        self.lease_step();
        if self.power_loss_in_reconfiguration && self.cm.reconfiguring(&self.fabric) {
            self.power_loss_in_reconfiguration = false;
            let at = self.step_no + self.rng.below(60);
            if let Some(pending) = self.power_loss_at.iter_mut().find(|a| **a == u64::MAX) {
                *pending = at;
            }
            self.power_loss_at.sort_unstable_by(|a, b| b.cmp(a));
        }
        if self
            .power_loss_at
            .last()
            .is_some_and(|at| *at <= self.step_no)
        {
            self.power_loss_at.pop();
            self.power_loss();
        }
        match self.rng.below(4) {
            0 => {
                let w = self.rng.below(self.workers.len() as u64) as usize;
                // A spare's workers are polled before it joins too, as the runtime's
                // background pollers do.
                if self.alive_worker(w) {
                    self.workers[w].poll(self.now);
                }
            }
            3 => {
                let out = self.cm.step(self.now, &self.fabric);
                self.stop_evicted(out);
            }
            1 => {
                let mut held = self.fabric.held_links();
                if let Some((src, dst, until)) = self.slow_link {
                    if self.step_no < until {
                        held.retain(|(s, d, _)| !(s.machine == src && *d == dst));
                    }
                }
                deliver_one(&self.fabric, &mut self.rng, &held);
            }
            _ => {
                let c = self.rng.below(self.clients.len() as u64) as usize;
                if self.alive_worker(self.worker_of(c)) {
                    self.advance_client(c, start_new);
                }
            }
        }
    }

    fn advance_client(&mut self, c: usize, start_new: bool) {
        // A machine removed meanwhile stops once its own lease tells it so, however long it
        // took to notice for its other work (fail-stop, as a deployment learns it from the
        // store). Until then a read-only commit is told only while its lease holds
        // (`MachineState::serves_at`, below, as in the runtime).
        let w = self.worker_of(c);
        let machine = self.workers[w].machine().clone();
        if self.unjoined(machine.id) {
            return;
        }
        let newest = newest_view(&self.fabric, &self.paused, &self.machines, false);
        let newest = newest.as_ref().map(|v| &v.config);
        if learns_it_is_out(&self.leases, &self.cm, &machine, newest, self.now) {
            self.stop_evicted(vec![machine.id]);
            return;
        }
        match std::mem::replace(&mut self.clients[c], Client::Idle) {
            Client::Idle if start_new => self.start_txn(c),
            Client::Idle => {}
            Client::Executing(exec) => self.execute(c, exec),
            Client::Committing(mut rec, effects, txn) => {
                match self.workers[w].poll_commit(txn, self.now) {
                    None => self.clients[c] = Client::Committing(rec, effects, txn),
                    Some(r) => {
                        rec.complete = self.now;
                        let machine = self.workers[w].machine();
                        rec.committed =
                            r.is_ok() && (!effects.read_only || machine.serves_at(self.now));
                        if rec.committed {
                            if let Some(a) = effects.freed {
                                self.temps[c].retain(|(t, _)| *t != a);
                            }
                            self.temps[c].extend(effects.allocated);
                        }
                        self.history.push(rec);
                    }
                }
            }
        }
    }

    /// Starts a random transaction on client `c`: list reads and appends, plus sometimes an
    /// allocation near a random list (often at a remote primary) and a free of an object this
    /// client allocated before. Half the transactions post their reads first (`Tx::prefetch`):
    /// held, those may be performed in any order, before the transaction reads them (while an
    /// allocation polls, or while it is suspended) or when it waits for them.
    fn start_txn(&mut self, c: usize) {
        // As `Hosts::begin`: a machine that joined begins once that configuration commits.
        if !self.workers[self.worker_of(c)].machine().may_begin() {
            return;
        }
        let n_ops = 1 + self.rng.below(3);
        let prefetch = self.rng.below(2) == 0;
        let mut steps = Vec::new();
        if prefetch {
            steps.push(Step::Prefetch);
        }
        let alloc_near = (self.rng.below(4) == 0).then(|| {
            self.next_value += 1;
            let near = self.keys[self.rng.below(self.keys.len() as u64) as usize];
            Step::Alloc(near, self.next_value)
        });
        // An allocation at a remote primary polls the other workers and lands held work: the
        // posted reads may be performed, and other commits apply, before this transaction
        // reads.
        steps.extend(alloc_near.filter(|_| prefetch));
        for _ in 0..n_ops {
            let key = self.rng.below(self.keys.len() as u64);
            let value = (self.rng.below(2) == 0).then(|| {
                self.next_value += 1;
                self.next_value
            });
            steps.push(Step::List(key, self.keys[key as usize], value));
        }
        steps.extend(alloc_near.filter(|_| !prefetch));
        if !self.temps[c].is_empty() && self.rng.below(4) == 0 {
            let (a, v) = self.temps[c][self.rng.below(self.temps[c].len() as u64) as usize];
            steps.push(Step::Free(a, v));
        }
        // Alone on its worker a client runs a blocking transaction half the time; sharing it,
        // one time in four. The rest yield between steps as the seed says.
        let blocking = self.rng.below(if self.config.clients_per_worker == 1 {
            2
        } else {
            4
        }) == 0;
        let yields = self.rng.below(u64::MAX);
        let w = self.worker_of(c);
        let exec = Execution {
            core: Some(TxCore::new(&mut self.workers[w])),
            steps,
            next: 0,
            blocking,
            yields,
            rec: TxnRecord {
                ops: Vec::new(),
                invoke: self.now,
                complete: self.now,
                committed: false,
            },
            effects: Effects::default(),
        };
        self.execute(c, Box::new(exec));
    }

    /// Runs client `c`'s execution on its worker until it yields, fails or ends; an ended one
    /// starts its commit.
    fn execute(&mut self, c: usize, mut exec: Box<Execution>) {
        let w = self.worker_of(c);
        let (before, rest) = self.workers.split_at_mut(w);
        let (worker, after) = rest.split_first_mut().expect("client in range");
        let (now, rng, fabric) = (&mut self.now, &mut self.rng, &self.fabric);
        let (cm, machines, paused) = (&mut self.cm, &self.machines, &self.paused);
        let (leases, grace) = (&mut self.leases, &self.grace);
        let mut evicted = Vec::new();
        let mut poll_others = || {
            *now += 1;
            // A machine that learns it is out stops at once (an execution waiting on it, or
            // coordinated by it, then ends); the rest of its stop follows the execution.
            for m in lease_round(leases, cm, fabric, machines, (paused, grace), *now) {
                fabric.crash(m, rng);
                evicted.push(m);
            }
            for m in cm.step(*now, fabric) {
                fabric.crash(m, rng);
                evicted.push(m);
            }
            deliver_one(fabric, rng, &fabric.held_links());
            for w in before.iter_mut().chain(after.iter_mut()) {
                let m = w.machine().id;
                if fabric.is_alive(m) && !paused.contains_key(&m) {
                    w.poll(*now);
                }
            }
            *now
        };
        let core = exec.core.take().expect("suspended with its execution");
        let mut tx = Tx::resume(worker, core, Some(&mut poll_others));
        let ended = loop {
            let Some(&step) = exec.steps.get(exec.next) else {
                break Some(Ok(()));
            };
            if let Some((addr, len)) = step.reads() {
                if !exec.blocking && !tx.read_ready(addr, len) {
                    break None;
                }
            }
            if let Err(e) = run_step(&mut tx, step, &mut exec) {
                break Some(Err(e));
            }
            exec.next += 1;
            if !exec.blocking && exec.yields & (1 << (exec.next % 64)) != 0 {
                break None;
            }
        };
        let core = tx.suspend();
        let Some(result) = ended else {
            exec.core = Some(core);
            self.clients[c] = Client::Executing(exec);
            let first = w * self.config.clients_per_worker as usize;
            let open = self.clients[first..first + self.config.clients_per_worker as usize]
                .iter()
                .filter(|s| matches!(s, Client::Executing(..)))
                .count();
            self.executions_suspended += 1;
            self.executions_in_flight_max = self.executions_in_flight_max.max(open);
            self.stop_evicted(evicted);
            return;
        };
        let state = core.into_state();
        let Execution { rec, effects, .. } = *exec;
        match result {
            Ok(()) => {
                let effects = Effects {
                    read_only: state.is_read_only(),
                    ..effects
                };
                let txn = self.workers[w].start_commit(state);
                self.commits_in_flight_max = self
                    .commits_in_flight_max
                    .max(self.workers[w].commits_in_flight());
                self.clients[c] = Client::Committing(rec, effects, txn);
            }
            Err(e) => {
                let machine = self.workers[w].machine();
                let me = machine.id;
                // An allocation fails once no region can be placed for the machine: too few
                // members for a region's replicas (each machine is a failure domain of its own
                // here, and none holds near the most regions a machine may).
                let replicas = self.config.replicas as usize;
                let too_few = [machine.view(), self.workers[w].view().clone()]
                    .iter()
                    .any(|v| v.config.members.len() < replicas);
                let full = matches!(e, TxError::Alloc(farm_alloc::AllocError::RegionFull(_)));
                // A coordinator that crashed or stopped under its execution fails as it may.
                assert!(
                    e.is_retryable()
                        || !self.fabric.is_alive(me)
                        || (full && machine.growth.refused() && too_few),
                    "seed {}: unexpected execution error {e} at {me} (view {:?}, newest {:?})",
                    self.config.seed,
                    self.workers[w].view().config,
                    self.newest_committed().map(|c| c.id)
                );
                self.workers[w].abort_execution(state, &e);
                self.history.push(rec);
            }
        }
        self.stop_evicted(evicted);
    }

    /// Runs the configured steps, drains every client, quiesces and checks.
    pub fn run(mut self) -> SimOutcome {
        for _ in 0..self.config.steps {
            self.step(true);
        }
        let mut rounds = 0u64;
        // Paused clients count: they run again (or stop) within a few leases.
        while self.clients.iter().enumerate().any(|(c, s)| {
            !matches!(s, Client::Idle)
                && self
                    .fabric
                    .is_alive(self.workers[self.worker_of(c)].machine().id)
        }) {
            self.step(false);
            rounds += 1;
            if rounds >= 1_000_000 {
                let stuck: Vec<String> = (0..self.clients.len())
                    .filter(|c| self.alive_worker(self.worker_of(*c)))
                    .filter(|c| !matches!(self.clients[*c], Client::Idle))
                    .map(|c| {
                        let w = &self.workers[self.worker_of(c)];
                        format!("client {c}: {}", w.recovery_summary())
                    })
                    .collect();
                let views: Vec<String> = self
                    .machines
                    .iter()
                    .map(|m| {
                        let v = m.view();
                        format!(
                            "{}: alive {} config {:?} committed {:?} members {:?}",
                            m.id,
                            self.fabric.is_alive(m.id),
                            v.config.id,
                            m.committed_config(),
                            v.config.members
                        )
                    })
                    .collect();
                panic!(
                    "seed {}: clients did not finish (CM {:?}, crashed {:?}): {stuck:#?}\n{views:#?}",
                    self.config.seed,
                    self.cm,
                    self.crashed
                );
            }
        }
        // Every spare that asked to join and runs becomes a member: a join may fail (a probe
        // lost, the store timed out) and is tried again, but is never dropped for good.
        self.settle(Self::spare_waiting, "asked to join and is no member");
        // Every request of a running member for a region (its regions full) is answered.
        self.settle(Self::growth_waiting, "asked for a region and is unanswered");
        self.quiesce();
        self.note_joined();
        let newest = self.newest_committed();
        let members = |m: &MachineId| newest.as_ref().is_some_and(|c| c.contains(*m));
        let regions = newest_view(&self.fabric, &self.paused, &self.machines, true)
            .map_or(0, |v| v.map.iter().count() as u64);
        let first = self.config.machines as u64 * self.config.regions_per_machine as u64;
        let regions_grown = regions.saturating_sub(first + self.cm.allocated.0);
        // A spare whose disk died with the power while it joined (a member of a view some
        // machine installed, not yet its own) failed before joining, as a crash would.
        let failed_joining = |m: &&MachineId| self.crashed.contains(m) && self.unjoined.contains(m);
        let joins = (
            (self.joining.iter()).filter(|m| !failed_joining(m)).count() as u64,
            (self.joining.iter())
                .filter(|m| !self.unjoined.contains(m))
                .count() as u64,
            self.joining.iter().filter(|m| members(m)).count() as u64,
        );
        // A final read of every list, so that every committed append is ordered.
        let keys = self.keys.clone();
        let invoke = self.now;
        let ops = self.check_txn(|tx| {
            keys.iter()
                .enumerate()
                .map(|(k, a)| {
                    let b = tx.read(*a, LIST_BYTES)?;
                    Ok(Op::Read {
                        key: k as u64,
                        values: list_values(b),
                    })
                })
                .collect::<Result<Vec<_>, TxError>>()
        });
        let unknown_committed = self.resolve_unknown(&ops);
        self.history.push(TxnRecord {
            ops,
            invoke,
            complete: self.now,
            committed: true,
        });
        // Every object allocated by a committed transaction and not freed holds its value.
        // (A crashed client's objects are left out: its last transaction, which may have freed
        // one, has an unknown outcome.)
        let temps: Vec<(Addr, u64)> = (0..self.temps.len())
            .filter(|c| self.alive_worker(self.worker_of(*c)))
            .flat_map(|c| self.temps[c].iter().copied())
            .collect();
        let seed = self.config.seed;
        self.check_txn(|tx| {
            for (a, v) in &temps {
                let got = tx.read(*a, 16)?;
                assert_eq!(
                    &got[..8],
                    &v.to_le_bytes(),
                    "seed {seed}: object {a} lost its value"
                );
            }
            Ok(())
        });
        self.quiesce();
        let mut anomalies = check(&self.history);
        anomalies.extend(unknown_committed.1);
        let live: Vec<Arc<MachineState>> = self
            .machines
            .iter()
            .filter(|m| self.fabric.is_alive(m.id))
            .cloned()
            .collect();
        let replicas = check_replicas(&live);
        let mut stats = self.past_stats.clone();
        for w in &self.workers {
            stats.add(w.stats());
        }
        // Every machine here runs this build: a record that does not decode is a bug, which
        // a worker only logs and skips (it may be another build's elsewhere).
        assert_eq!(
            stats.malformed, 0,
            "seed {}: workers skipped records that did not decode",
            self.config.seed
        );
        // Peers of this build never name a configuration more than one beyond the receiver's
        // newest view: a refusal would mean the bound on kept recovery messages drops one
        // that recovery needs.
        assert_eq!(
            stats.recovery_refused, 0,
            "seed {}: recovery messages refused as too far ahead",
            self.config.seed
        );
        // The recovery log holds what a failure leaves in flight many times over here: full,
        // it would mean entries are not freed when their transactions are forgotten.
        assert_eq!(
            stats.recovery_log_full, 0,
            "seed {}: a recovery log filled up",
            self.config.seed
        );
        SimOutcome {
            history: self.history,
            anomalies,
            replicas,
            stats,
            live_objects: temps.len(),
            crashed: self.crashed,
            commits_in_flight_max: self.commits_in_flight_max,
            executions_in_flight_max: self.executions_in_flight_max,
            executions_suspended: self.executions_suspended,
            unknown: (self.unknown.len(), unknown_committed.0),
            configurations: self.cm.committed,
            restarts: self.restarts,
            restarts_mid: self.restarts_mid,
            restarts_cut: self.restarts_cut,
            disks_lost: self.disks_lost,
            paused: self.pauses_done,
            evicted: self.evicted,
            stalls: self.stalls_done,
            cm_failover: self.cm_failover,
            allocated: self.cm.allocated,
            regions_grown,
            partitions: self.partitions_done,
            minority_reads: self.minority_reads,
            joins,
            spares_restarted: self.spares_restarted,
        }
    }

    /// Decides the transactions whose coordinator crashed from the final read: committed when
    /// every append is visible (their completion then counts as unknown: no real-time order),
    /// aborted when none is; a partial one is an atomicity violation.
    fn resolve_unknown(&mut self, final_read: &[Op]) -> (usize, Vec<Anomaly>) {
        let visible: std::collections::BTreeSet<u64> = final_read
            .iter()
            .flat_map(|op| match op {
                Op::Read { values, .. } => values.clone(),
                Op::Append { .. } => Vec::new(),
            })
            .collect();
        let (mut committed, mut anomalies) = (0, Vec::new());
        for &i in &self.unknown {
            let t = &mut self.history[i];
            let appends: Vec<u64> = t
                .ops
                .iter()
                .filter_map(|op| match op {
                    Op::Append { value, .. } => Some(*value),
                    Op::Read { .. } => None,
                })
                .collect();
            let seen = appends.iter().filter(|v| visible.contains(v)).count();
            if seen > 0 && seen == appends.len() {
                t.committed = true;
                t.complete = u64::MAX;
                committed += 1;
            } else if seen > 0 {
                anomalies.push(Anomaly {
                    name: "partial-commit",
                    detail: format!(
                        "T{i}, whose coordinator crashed, has {seen} of its appends {appends:?} visible"
                    ),
                });
            }
        }
        (committed, anomalies)
    }

    /// Finishes reconfiguration and recovery, lands every write and truncates everything,
    /// until no live member has anything retained or left to recover. Paused machines run
    /// again first, and machines outside the configuration stop, as their leases would make
    /// them; datagrams are no longer lost.
    fn quiesce(&mut self) {
        for m in std::mem::take(&mut self.paused).into_keys() {
            self.cm.set_paused(m, false);
        }
        self.minority = None;
        self.fabric.heal();
        self.cm.cut_from_store(&[]);
        self.fabric.set_datagram_policy(DatagramPolicy {
            drop_per_million: 0,
            delay_ticks_max: 0,
        });
        if let Some(config) = self.newest_committed() {
            for m in 0..self.machines.len() as u16 {
                let m = MachineId(m);
                if self.fabric.is_alive(m) && !config.contains(m) {
                    self.evicted += 1;
                    self.crash(m);
                }
            }
        }
        self.fabric.set_hold(false);
        for _ in 0..2000 {
            self.fabric.deliver_all();
            self.now += 100;
            let out = self.cm.step(self.now, &self.fabric);
            self.stop_evicted(out);
            let fabric = &self.fabric;
            for w in self
                .workers
                .iter_mut()
                .filter(|w| fabric.is_alive(w.machine().id))
            {
                w.poll(self.now);
                if !w.committing() {
                    w.flush_truncations();
                }
                w.report_all_freed();
            }
            for w in self
                .workers
                .iter_mut()
                .filter(|w| fabric.is_alive(w.machine().id))
            {
                w.poll(self.now);
            }
            let quiet = !self.cm.busy(&self.fabric)
                && self
                    .workers
                    .iter()
                    .filter(|w| fabric.is_alive(w.machine().id) && w.is_member())
                    .all(|w| {
                        w.coordinator_quiet()
                            && w.retained_records() == 0
                            && w.recovery_idle()
                            && w.machine().background_recovery_done()
                    });
            if quiet {
                self.fabric.set_hold(true);
                // Time jumped without lease renewals: the leases start again.
                self.leases = SimLeases::new(&self.machines, LEASE_TICKS, self.now);
                return;
            }
        }
        let report: Vec<String> = self
            .workers
            .iter()
            .map(|w| {
                let view = w.machine().view();
                // Background recovery (§5.4-5.5): regions still to copy here, and the regions
                // this machine is primary of whose free lists are not rebuilt yet.
                let unscanned: Vec<farm_core::RegionId> = view
                    .map
                    .primary_of(w.machine().id)
                    .filter(|r| view.pool(*r).is_none())
                    .collect();
                format!(
                    "{}/{}: alive {} to copy {:?} unscanned {:?} quiet {} retained {} recovery {}",
                    w.machine().id,
                    w.thread().0,
                    self.fabric.is_alive(w.machine().id),
                    w.machine().regions_to_copy(),
                    unscanned,
                    w.coordinator_quiet(),
                    w.retained_records(),
                    w.recovery_summary()
                )
            })
            .collect();
        panic!(
            "seed {}: the cluster did not quiesce (CM busy {}):\n{}",
            self.config.seed,
            self.cm.busy(&self.fabric),
            report.join("\n")
        );
    }
}

/// Steps after the run within which every spare that asked to join must be a member (a
/// failed join waits at most `JOIN_BACKOFF_LEASES_MAX` (300) leases before it is tried again),
/// and every machine's request for a region answered.
const JOIN_WAIT_STEPS: u64 = 200_000;

/// A list object's words: its length, then its values and unused room.
fn list_words(bytes: &[u8]) -> Vec<u64> {
    (bytes.chunks(8))
        .map(|w| u64::from_le_bytes(w.try_into().expect("8")))
        .collect()
}

/// The values a list object holds.
fn list_values(bytes: &[u8]) -> Vec<u64> {
    let list = list_words(bytes);
    list[1..=list[0] as usize].to_vec()
}

/// Runs one step of `exec` on `tx`, recording what it read and appended.
fn run_step(tx: &mut Tx<'_>, step: Step, exec: &mut Execution) -> Result<(), TxError> {
    match step {
        Step::Prefetch => {
            for s in &exec.steps {
                if let Step::List(_, addr, _) = s {
                    tx.prefetch(*addr, LIST_BYTES);
                }
            }
        }
        Step::Alloc(near, v) => {
            let a = tx.alloc(16, Some(near))?;
            tx.write(a, &[v.to_le_bytes(), v.to_le_bytes()].concat())?;
            exec.effects.allocated = Some((a, v));
        }
        Step::List(key, addr, value) => {
            let bytes = tx.read(addr, LIST_BYTES)?;
            let mut list = list_words(bytes);
            let len = list[0] as usize;
            match value {
                Some(v) if len < LIST_CAPACITY => {
                    list[1 + len] = v;
                    list[0] += 1;
                    let out: Vec<u8> = list.iter().flat_map(|w| w.to_le_bytes()).collect();
                    tx.write(addr, &out)?;
                    exec.rec.ops.push(Op::Append { key, value: v });
                }
                _ => exec.rec.ops.push(Op::Read {
                    key,
                    values: list[1..=len].to_vec(),
                }),
            }
        }
        Step::Free(a, v) => {
            let got = tx.read(a, 16)?;
            assert_eq!(&got[..8], &v.to_le_bytes(), "object {a} lost its value");
            tx.free(a)?;
            exec.effects.freed = Some(a);
        }
    }
    Ok(())
}

/// Lands the next write of one of the `held` links, or performs one held read (posted by a
/// validation or a prefetch), the seed choosing which: posted work completes in any order.
fn deliver_one(fabric: &MemFabric, rng: &mut Rng, held: &[(Endpoint, MachineId, usize)]) {
    let n = held.len() + fabric.held_reads();
    if n == 0 {
        return;
    }
    let i = rng.below(n as u64) as usize;
    match held.get(i) {
        Some((src, dst, _)) => {
            fabric.deliver_next(*src, *dst);
        }
        None => fabric.complete_read(i - held.len()),
    }
}

fn running(fabric: &MemFabric, paused: &BTreeMap<MachineId, u64>, m: MachineId) -> bool {
    fabric.is_alive(m) && !paused.contains_key(&m)
}

/// The newest view of a running machine: committed there (NEW-CONFIG-COMMIT) with
/// `committed`, else installed (NEW-CONFIG) with a running member: a machine of an earlier
/// configuration that is not in it is out once its own leases ran out (the new CM's leases
/// start with NEW-CONFIG-ACK, §5.2 step 6, so no commit is needed for that).
fn newest_view(
    fabric: &MemFabric,
    paused: &BTreeMap<MachineId, u64>,
    machines: &[Arc<MachineState>],
    committed: bool,
) -> Option<Arc<farm_txn::machine::View>> {
    machines
        .iter()
        .filter(|m| running(fabric, paused, m.id))
        .map(|m| (m.view(), m.committed_config()))
        .filter(|(v, c)| {
            if committed {
                *c >= v.config.id
            } else {
                v.config.members.iter().any(|m| running(fabric, paused, *m))
            }
        })
        .map(|(v, _)| v)
        .max_by_key(|v| v.config.id)
}

/// Leases (§5.1) at `now`: every running machine takes its datagrams and renews; expiries go to
/// the CM as suspicions. Returns the machines removed from the configuration whose own lease
/// ran out (a resumed machine looks at its leases only after its grace period, acting on its
/// stale view until then): they stop. Runs wherever time passes, executions included, as the
/// runtime's lease threads do.
fn lease_round(
    leases: &mut SimLeases,
    cm: &mut SimCm,
    fabric: &MemFabric,
    machines: &[Arc<MachineState>],
    (paused, grace): (&BTreeMap<MachineId, u64>, &BTreeMap<MachineId, u64>),
    now: u64,
) -> Vec<MachineId> {
    let newest = newest_view(fabric, paused, machines, false);
    let mut out = Vec::new();
    for machine in machines {
        let m = machine.id;
        if !running(fabric, paused, m) || grace.get(&m).is_some_and(|until| now < *until) {
            continue;
        }
        if learns_it_is_out(leases, cm, machine, newest.as_ref().map(|v| &v.config), now) {
            out.push(m);
            continue;
        }
        for x in leases.step_machine(m, now) {
            cm.suspect(x, m, now);
        }
    }
    out
}

/// Whether `machine`, if left out of `newest`, learns at `now` that it is out: its own leases
/// ran out ([`SimLeases::orphan_expired`]) and it reaches the store, where a deployed machine
/// reads that it was removed. One that a partition cuts off from the store runs on, serving
/// nothing once its leases end ([`SimConfig::minority_reads`]).
fn learns_it_is_out(
    leases: &SimLeases,
    cm: &SimCm,
    machine: &MachineState,
    newest: Option<&Configuration>,
    now: u64,
) -> bool {
    cm.reaches_store(machine.id) && newest.is_some_and(|c| leases.orphan_expired(machine, c, now))
}

/// The store's timeouts of a run ([`SimConfig::store_timeouts`]) in its `life`-th life (a
/// restart starts a new store over the same stored configuration), from the seed.
fn store_faults(config: &SimConfig, life: u64) -> Option<Rng> {
    config
        .store_timeouts
        .then(|| Rng::new(config.seed ^ 0x0057_07e5 ^ life << 32))
}

/// Runs one seed, printing it first so that a failure can be replayed.
pub fn run_seed(config: SimConfig) -> SimOutcome {
    println!(
        "farm-sim seed {} (replay: FARM_SIM_SEED={})",
        config.seed, config.seed
    );
    Sim::new(config).run()
}

/// Worker `thread` of `machine`, checking its invariants after every poll.
/// The restart of each machine of `stopped` (by id), from what it left in its memory (as NVRAM
/// outlives a power loss), over `fabric`, in lives drawn from the seed and `round`.
fn restarts_of<'a>(
    stopped: &'a [Arc<MachineState>],
    fabric: &Arc<MemFabric>,
    store: &'a dyn farm_cm::CoordinationStore,
    params: Params,
    config: &SimConfig,
    round: u64,
) -> Vec<MachineRestart<'a>> {
    let mut lives = Rng::new(config.seed ^ round.rotate_left(17) ^ 0x11fe);
    let exchange = ExchangeParams {
        machines: config.all_machines(),
        repeat: REPEAT_TICKS,
        leave_out: leave_out_of(config),
    };
    stopped
        .iter()
        .map(|m| {
            let persisted = persisted_of(m);
            let mut r = MachineRestart::new(
                m.id,
                exchange,
                persisted,
                lives.next_u64(),
                params,
                fabric.clone() as Arc<dyn Fabric>,
                store,
                Reopen::Memory(m),
            );
            r.set_check_invariants(true);
            r
        })
        .collect()
}

/// When a disk may be gone, the machines wait four leases for every machine (four repeats of
/// what each left, so that lost datagrams leave out no machine that runs), then the lowest
/// machine heard from restarts without those it has not heard from.
fn leave_out_of(config: &SimConfig) -> Option<LeaveOut> {
    config.disk_losses.then_some(LeaveOut {
        after: 4 * LEASE_TICKS,
        replicas: config.replicas as usize,
        regions_max: farm_txn::control::REGIONS_PER_MACHINE_MAX,
    })
}

/// What a stopped machine left in its NVRAM: its newest view, and the regions it was copying.
fn persisted_of(m: &MachineState) -> Persisted {
    let v = m.view();
    Persisted {
        view: farm_core::codec::StoredView {
            config: v.config.clone(),
            map: v.map.clone(),
            changes: v.changes.clone(),
        },
        copying: m.regions_to_copy(),
    }
}

fn sim_worker(machine: &Arc<MachineState>, thread: ThreadId) -> Worker {
    let mut w = Worker::new(machine.clone(), thread);
    w.set_check_invariants(true);
    w
}
