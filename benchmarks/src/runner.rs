//! What the workload binaries (TATP, TPC-C) share: client threads that each keep a session and
//! run a workload's transactions until the time is up, machines killed on a schedule while they
//! run, and the report: per transaction type the count, successes, aborts (retried
//! executions), errors and latency percentiles, per kill the recovery times, operations per
//! millisecond, and a chart.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use farm::{
    Client, Cluster, MachineId, Pipeline, ReconfigEvent, RecoveryEvent, Replication, Session,
    TxError,
};
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::timeline::{self, Marker};
use farm_workloads::Rand;

/// A workload the runner drives.
#[allow(async_fn_in_trait)] // Futures of one client thread's pipeline.
pub trait Workload: Send + Sync + 'static {
    /// The names of its transaction types, in the order of their indexes.
    fn kinds(&self) -> Vec<&'static str>;

    /// Each type's share of the mix, in percent.
    fn mix_percent(&self, kind: usize) -> u64;

    /// Runs one transaction from the mix for client `client` through `session`, avoiding the
    /// machines `down` marks. Returns the type's index and whether it succeeded in the
    /// workload's sense (or its error), adding its executions to `attempts`.
    fn run_one(
        &self,
        session: &Session<'_>,
        client: usize,
        rng: &mut Rand,
        down: &[bool],
        attempts: &mut u64,
    ) -> (usize, Result<bool, TxError>);

    /// The transactions a client thread keeps in flight when not told (through
    /// [`Workload::run_one_in`] when more than one), or `None` when the workload's
    /// transactions only block, one per client thread.
    fn in_flight_default(&self) -> Option<usize> {
        None
    }

    /// [`Workload::run_one`] as one of the transactions in flight of `pipeline`'s thread.
    /// Called only for workloads with an [`Workload::in_flight_default`]; the default runs
    /// nothing and says it cannot.
    async fn run_one_in(
        &self,
        pipeline: &Pipeline<'_>,
        client: usize,
        rng: &mut Rand,
        down: &[bool],
        attempts: &mut u64,
    ) -> (usize, Result<bool, TxError>) {
        let _ = (pipeline, client, rng, down, attempts);
        unreachable!("the runner pipelines only workloads with an `in_flight_default`")
    }
}

/// The machine that `draw` (a random number) picks among those `down` does not mark.
pub fn pick_alive(down: &[bool], draw: u64) -> MachineId {
    let alive: Vec<u16> = (0..down.len() as u16)
        .filter(|m| !down[*m as usize])
        .collect();
    MachineId(alive[(draw % alive.len() as u64) as usize])
}

/// A machine to kill, and when.
#[derive(Clone, Copy, Debug)]
pub struct Kill {
    /// `None`: the CM at that moment.
    pub machine: Option<u16>,
    /// Seconds after the measured run starts.
    pub seconds: f64,
}

/// Parses `MACHINE@SECONDS` or `cm@SECONDS` (for `--kill`).
pub fn parse_kill(s: &str) -> Result<Kill, String> {
    let (who, when) = s
        .split_once('@')
        .ok_or_else(|| format!("{s:?}: expected MACHINE@SECONDS or cm@SECONDS"))?;
    let machine = match who {
        "cm" => None,
        m => Some(
            m.parse::<u16>()
                .map_err(|_| format!("{s:?}: {m:?} is neither a machine number nor cm"))?,
        ),
    };
    let seconds: f64 = when
        .parse()
        .map_err(|_| format!("{s:?}: {when:?} is not a number of seconds"))?;
    if seconds.is_nan() || seconds < 0.0 {
        return Err(format!("{s:?}: the time must not be negative"));
    }
    Ok(Kill { machine, seconds })
}

/// The command-line options every workload binary takes (flattened into its own).
#[derive(clap::Args, Debug, Clone)]
pub struct CommonArgs {
    /// Machines.
    #[arg(long, default_value_t = 3)]
    pub machines: u16,
    /// Replicas of every region (primary included).
    #[arg(long, default_value_t = 3)]
    pub replicas: u16,
    /// Worker threads per machine.
    #[arg(long, default_value_t = 2)]
    pub workers: u16,
    /// Client threads running transactions.
    #[arg(long, default_value_t = 2)]
    pub clients: u16,
    /// Transactions each client thread keeps in flight (`Client::pipeline`; 1: one at a time,
    /// blocking). Default: the workload's (TATP [`farm_workloads::IN_FLIGHT_DEFAULT`], TPC-C 1).
    #[arg(long)]
    pub in_flight: Option<usize>,
    /// Seconds of measured run.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Seed of the population and of the clients' inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Pin the cluster's poller threads and the clients to cores (client i to core i).
    #[arg(long)]
    pub pin: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Kill a machine during the run: `MACHINE@SECONDS` after the measured run starts, or
    /// `cm@SECONDS` for the machine that is CM then. Repeatable.
    #[arg(long, value_parser = parse_kill)]
    pub kill: Vec<Kill>,
    /// Lease duration in milliseconds of the measured run (failure detection, §5.1; default
    /// 10). Populating uses at least 200 ms leases (see `POPULATION_LEASE`).
    #[arg(long, default_value_t = 10)]
    pub lease_ms: u64,
    /// Draw throughput per millisecond with the recovery events to this SVG file.
    #[arg(long)]
    pub chart: Option<std::path::PathBuf>,
    /// How backups acknowledge COMMIT-BACKUP: one-sided writes (FaRM) or RPCs answered by the
    /// backups' CPUs (Tailwind's baseline).
    #[arg(long, value_enum, default_value = "one-sided")]
    pub replication: ReplicationArg,
    /// Microseconds between the 8 KB steps of data recovery that copy a region to a new
    /// backup after a failure (§5.4's pacing; the cluster's default when not given).
    #[arg(long)]
    pub recovery_interval_us: Option<u64>,
    /// Regions' memory each machine keeps ready (allocated and zeroed) for the replicas a
    /// failure gives it (`ClusterBuilder::spare_regions`). Default: 1 where the workload sizes
    /// its regions (TATP), none with the 2 GB default regions (TPC-C).
    #[arg(long)]
    pub spare_regions: Option<usize>,
}

/// `--replication`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum, Serialize)]
pub enum ReplicationArg {
    /// FaRM: the coordinator waits for the one-sided writes of COMMIT-BACKUP to complete.
    OneSided,
    /// Each backup's CPU processes COMMIT-BACKUP and answers before the coordinator goes on.
    Rpc,
}

impl From<ReplicationArg> for Replication {
    fn from(r: ReplicationArg) -> Self {
        match r {
            ReplicationArg::OneSided => Replication::OneSided,
            ReplicationArg::Rpc => Replication::Rpc,
        }
    }
}

/// The shortest lease while a workload populates its database. Populating touches gigabytes of
/// fresh memory from both cores; on the project's virtual machine (a kernel without
/// preemption), two threads faulting in fresh pages at once stall every thread, real-time ones
/// included, for 10 to 40 ms (a C program touching 3 GB from two threads saw a 38 ms gap in a
/// SCHED_FIFO sleeper; from one thread, 4.5 ms). With 10 ms leases throughout, TPC-C failed
/// creating its tables in 4 runs of 5, and TATP populating in 6 of 10 after a TPC-C run.
pub const POPULATION_LEASE: Duration = Duration::from_millis(200);

impl CommonArgs {
    /// The run's options, checked.
    pub fn options(&self) -> anyhow::Result<RunOptions> {
        anyhow::ensure!(
            self.replicas >= 1 && self.replicas <= self.machines,
            "--replicas must be 1 to --machines ({})",
            self.machines
        );
        anyhow::ensure!(self.lease_ms >= 1, "--lease-ms must be at least 1");
        // Each client keeps a session, which holds one host (a worker thread of every machine)
        // for the run: a client beyond the workers would wait for a host forever.
        anyhow::ensure!(
            self.clients <= self.workers,
            "--clients {} needs at least as many --workers ({}): each client keeps a worker \
             thread of every machine for the run",
            self.clients,
            self.workers
        );
        let opts = RunOptions {
            clients: self.clients,
            in_flight: self.in_flight,
            seconds: self.seconds,
            seed: self.seed,
            pin: self.pin,
            kills: self.kill.clone(),
            lease: Duration::from_millis(self.lease_ms),
        };
        opts.validate(self.machines)?;
        Ok(opts)
    }

    /// Starts warnings-only logging (once per process) and builds the cluster these options
    /// describe, with regions of `region_bytes` (the builder's default when `None`). Its leases
    /// last at least [`POPULATION_LEASE`] until [`run`] starts measuring with `--lease-ms`.
    pub fn cluster(&self, region_bytes: Option<usize>) -> anyhow::Result<Arc<Cluster>> {
        // A second cluster in the same process keeps the first one's logging.
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
            .with_writer(std::io::stderr)
            .try_init();
        let mut b = Cluster::builder()
            .machines(self.machines)
            .replicas(self.replicas)
            .workers(self.workers)
            .pin_threads(self.pin)
            .replication(self.replication.into())
            .lease(Duration::from_millis(self.lease_ms).max(POPULATION_LEASE));
        if let Some(bytes) = region_bytes {
            b = b.region_bytes(bytes);
        }
        b = b.spare_regions((self.spare_regions).unwrap_or(if region_bytes.is_some() {
            1
        } else {
            0
        }));
        if let Some(us) = self.recovery_interval_us {
            b = b.recovery_interval(Duration::from_micros(us));
        }
        Ok(Arc::new(b.build()?))
    }
}

/// How to run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Client threads.
    pub clients: u16,
    /// Transactions each client thread keeps in flight (`None`: the workload's default).
    pub in_flight: Option<usize>,
    /// Seconds of measured run.
    pub seconds: f64,
    /// Seed of the clients' inputs.
    pub seed: u64,
    /// Pin client `i` to core `i`.
    pub pin: bool,
    /// Machines to kill.
    pub kills: Vec<Kill>,
    /// The lease length of the measured run (the cluster may have been populated with longer
    /// ones; [`run`] switches).
    pub lease: Duration,
}

impl RunOptions {
    /// Checks the options against a cluster of `machines`, naming the problem.
    pub fn validate(&self, machines: u16) -> anyhow::Result<()> {
        anyhow::ensure!(self.seconds > 0.0, "--seconds must be positive");
        anyhow::ensure!(self.clients >= 1, "--clients must be at least 1");
        anyhow::ensure!(self.in_flight != Some(0), "--in-flight must be at least 1");
        let mut kills = self.kills.clone();
        kills.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
        // The first CM is machine 0; a later one is not known before the run.
        let who = |k: &Kill, i: usize| k.machine.or((i == 0).then_some(0));
        for (i, k) in kills.iter().enumerate() {
            if let Some(m) = who(k, i) {
                anyhow::ensure!(
                    m < machines,
                    "--kill {m}@{}: there are only {machines} machines",
                    k.seconds
                );
                // A killed machine stays dead for the run.
                let again = (kills[..i].iter().enumerate()).any(|(j, o)| who(o, j) == Some(m));
                anyhow::ensure!(
                    !again,
                    "--kill {}@{}: machine {m} is killed once already",
                    k.machine.map_or("cm".to_string(), |m| m.to_string()),
                    k.seconds
                );
            }
            anyhow::ensure!(
                k.seconds < self.seconds,
                "--kill at {} s comes after the run ({} s)",
                k.seconds,
                self.seconds
            );
        }
        // A configuration changes only while a majority of the one before it answers the
        // probes (FaRM §5.2): each failure must leave a majority of the machines that lived
        // before it, or the cluster stops for good. Kills less than `KILLS_APART_LEASES` leases
        // apart are one failure of several machines: the configuration without the first may
        // not have committed when the next comes.
        let apart = self.lease.as_secs_f64() * KILLS_APART_LEASES;
        let mut alive = machines as usize;
        for together in kills.chunk_by(|a, b| b.seconds - a.seconds < apart) {
            let left = alive.saturating_sub(together.len());
            anyhow::ensure!(
                2 * left > alive,
                "--kill at {} s: {left} of {alive} machines would live on, no majority to \
                 reconfigure with (FaRM §5.2), and the cluster would stop (kills less than {} \
                 leases apart count as one failure)",
                together[0].seconds,
                KILLS_APART_LEASES
            );
            alive = left;
        }
        Ok(())
    }
}

/// Kills closer together than this many leases are checked as one failure of several machines
/// (a suspicion takes a lease, the reconfiguration that removes the machine a few more).
const KILLS_APART_LEASES: f64 = 10.0;

/// Results of one transaction type.
#[derive(Serialize, Debug)]
pub struct TypeReport {
    /// Its name.
    pub name: &'static str,
    /// Its share of the mix.
    pub mix_percent: u64,
    /// Transactions completed.
    pub count: u64,
    /// Of those, successes in the workload's sense.
    pub successes: u64,
    /// Executions beyond the first (retries after conflicts).
    pub aborts: u64,
    /// Transactions that failed (a machine gone, or conflicts past every retry).
    pub errors: u64,
    /// Latency percentiles in microseconds.
    pub p50_us: f64,
    /// 99th.
    pub p99_us: f64,
    /// 99.9th.
    pub p999_us: f64,
}

/// What a kill did to the run.
#[derive(Serialize, Debug)]
pub struct KillReport {
    /// The machine killed.
    pub machine: u16,
    /// When, on the cluster's clock.
    pub at_us: u64,
    /// Kill to the first suspicion of it.
    pub kill_to_suspect_ms: Option<f64>,
    /// Mean operations per millisecond over the 100 ms before the kill.
    pub throughput_before_per_ms: Option<f64>,
    /// Suspicion to the first 5 ms window at 80% of that.
    pub suspect_to_80_percent_ms: Option<f64>,
    /// Suspicion to the last data-recovery copy done after the kill.
    pub suspect_to_rereplicated_ms: Option<f64>,
}

/// The outcome of a run.
#[derive(Serialize, Debug)]
pub struct RunReport {
    /// Seconds measured.
    pub seconds: f64,
    /// Transactions completed.
    pub transactions: u64,
    /// Per second.
    pub per_second: f64,
    /// Latency over all types, microseconds.
    pub p50_us: f64,
    /// 99th.
    pub p99_us: f64,
    /// Per type.
    pub types: Vec<TypeReport>,
    /// Per kill.
    pub kills: Vec<KillReport>,
    /// Suspicions of machines that were alive (all but a killed one's after its kill):
    /// machine and when (cluster clock, microseconds).
    pub false_suspicions: Vec<(u16, u64)>,
    /// Operations completed per millisecond of the cluster's clock.
    pub completed_per_ms: Vec<u64>,
    /// The cluster's timeline (reconfiguration and recovery events).
    pub timeline: serde_json::Value,
    /// The machines killed and when (cluster clock, microseconds).
    #[serde(skip)]
    pub killed: Vec<(MachineId, u64)>,
}

impl RunReport {
    /// A machine that was not killed and is a member of the newest configuration (a falsely
    /// suspected machine is out too, §5.2), to run checks from.
    pub fn survivor(&self, cluster: &Cluster) -> MachineId {
        let alive = |m: &MachineId| !self.killed.iter().any(|(k, _)| k == m);
        let newest = (0..cluster.machines())
            .map(MachineId)
            .filter(alive)
            .map(|m| cluster.view(m).config.clone())
            .max_by_key(|c| c.id)
            .expect("kills leave a machine");
        newest
            .members
            .iter()
            .copied()
            .find(alive)
            .expect("the newest configuration has a live member")
    }
}

/// Runs `load` for every item of `parts` on up to `threads` threads (item `i` on thread
/// `i % threads`), returning the first error.
pub fn load_in_parallel<T: Sync>(
    parts: &[T],
    threads: usize,
    load: impl Fn(&T) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<()> {
    let threads = threads.clamp(1, parts.len().max(1));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|l| {
                let load = &load;
                s.spawn(move || -> anyhow::Result<()> {
                    for p in parts.iter().skip(l).step_by(threads) {
                        load(p)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().expect("loader panicked")?;
        }
        Ok(())
    })
}

/// How long clients may take to finish their last transaction once the run ends.
const CLIENTS_STOP_MAX: Duration = Duration::from_secs(30);

/// What one client counted.
struct ClientStats {
    hist: Vec<Histogram<u64>>,
    successes: Vec<u64>,
    attempts: Vec<u64>,
    errors: Vec<u64>,
    per_ms: Vec<u64>,
}

/// Runs `workload` from `opts.clients` threads for `opts.seconds`, killing machines as asked.
pub fn run<W: Workload>(
    cluster: &Arc<Cluster>,
    workload: &Arc<W>,
    opts: &RunOptions,
) -> anyhow::Result<RunReport> {
    let in_flight = farm_workloads::in_flight(opts.in_flight, workload.in_flight_default())?;
    let opts = &RunOptions {
        in_flight: Some(in_flight),
        ..opts.clone()
    };
    if cluster.lease() != opts.lease {
        // Measure with the asked lease; the longer ones granted while populating end first.
        let populating = cluster.lease();
        cluster.set_lease(opts.lease);
        std::thread::sleep(populating);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let barrier = Arc::new(Barrier::new(opts.clients as usize + 1));
    let clients: Vec<_> = (0..opts.clients)
        .map(|c| {
            let (cluster, workload, stop, barrier) = (
                cluster.clone(),
                workload.clone(),
                stop.clone(),
                barrier.clone(),
            );
            let opts = opts.clone();
            let core = opts
                .pin
                .then(|| core_affinity::get_core_ids().unwrap_or_default())
                .and_then(|cores| cores.get(c as usize % cores.len().max(1)).copied());
            std::thread::spawn(move || {
                if let Some(core) = core {
                    core_affinity::set_for_current(core);
                }
                client(&cluster, &*workload, c as usize, &opts, &stop, &barrier)
            })
        })
        .collect();
    barrier.wait();
    let t0 = Instant::now();
    let mut kills = opts.kills.clone();
    kills.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
    let mut killed: Vec<(MachineId, u64)> = Vec::new();
    for k in kills {
        let due = t0 + Duration::from_secs_f64(k.seconds);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        let victim = match k.machine {
            Some(m) => MachineId(m),
            None => {
                let alive = (0..cluster.machines())
                    .map(MachineId)
                    .find(|m| !killed.iter().any(|(k, _)| k == m))
                    .expect("a machine is alive");
                // The CM an earlier kill took down stays CM until the configuration without it
                // commits: wait for the new one (never kill a dead machine again).
                let wait_until = Instant::now() + CLIENTS_STOP_MAX;
                loop {
                    let cm = cluster.view(alive).config.cm;
                    if !killed.iter().any(|(k, _)| *k == cm) {
                        break cm;
                    }
                    anyhow::ensure!(
                        Instant::now() < wait_until,
                        "--kill cm@{}: no new CM since {cm} was killed",
                        k.seconds
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        };
        eprintln!("killing {victim} at {:.3} s", t0.elapsed().as_secs_f64());
        killed.push((victim, cluster.now_us()));
        cluster.kill(victim);
    }
    std::thread::sleep(
        (t0 + Duration::from_secs_f64(opts.seconds)).saturating_duration_since(Instant::now()),
    );
    stop.store(true, Ordering::Relaxed);
    let elapsed = t0.elapsed().as_secs_f64();
    // A client stuck in a commit means the cluster cannot commit any more (a majority of its
    // machines lost, say): report that instead of waiting forever.
    let deadline = Instant::now() + CLIENTS_STOP_MAX;
    while !clients.iter().all(|h| h.is_finished()) {
        if Instant::now() >= deadline {
            // A stuck cluster suspects the same machines every lease: their count and names.
            let suspicions = cluster.suspicions();
            let survivor = (0..cluster.machines())
                .map(MachineId)
                .find(|m| !killed.iter().any(|(k, _)| k == m))
                .expect("kills leave a machine");
            let suspects: std::collections::BTreeSet<u16> =
                suspicions.iter().map(|s| s.suspect.0).collect();
            anyhow::bail!(
                "clients still in transactions {} s after the run ended: the cluster cannot \
                 commit (configuration {:?}; {} suspicions, of machines {suspects:?})",
                CLIENTS_STOP_MAX.as_secs(),
                cluster.view(survivor).config,
                suspicions.len()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut all: Vec<ClientStats> = Vec::new();
    for h in clients {
        all.push(h.join().expect("client panicked")?);
    }
    let mut overall = Histogram::<u64>::new(3)?;
    let mut types = Vec::new();
    for (i, name) in workload.kinds().into_iter().enumerate() {
        let mut h = Histogram::<u64>::new(3)?;
        for c in &all {
            h.add(&c.hist[i])?;
        }
        overall.add(&h)?;
        let count = h.len();
        let attempts: u64 = all.iter().map(|c| c.attempts[i]).sum();
        types.push(TypeReport {
            name,
            mix_percent: workload.mix_percent(i),
            count,
            successes: all.iter().map(|c| c.successes[i]).sum(),
            aborts: attempts.saturating_sub(count),
            errors: all.iter().map(|c| c.errors[i]).sum(),
            p50_us: h.value_at_quantile(0.5) as f64 / 1000.0,
            p99_us: h.value_at_quantile(0.99) as f64 / 1000.0,
            p999_us: h.value_at_quantile(0.999) as f64 / 1000.0,
        });
    }
    let mut per_ms: Vec<u64> = Vec::new();
    for c in &all {
        if per_ms.len() < c.per_ms.len() {
            per_ms.resize(c.per_ms.len(), 0);
        }
        for (t, n) in per_ms.iter_mut().zip(&c.per_ms) {
            *t += n;
        }
    }
    let tl = cluster.timeline();
    let kill_reports = killed
        .iter()
        .map(|&(victim, at_us)| kill_report(&tl, &per_ms, victim, at_us))
        .collect();
    let suspected = tl.events.iter().filter_map(|e| match e {
        ReconfigEvent::Suspect { machine, at_us } => Some((machine.0, *at_us)),
        _ => None,
    });
    let failed: Vec<(u16, u64)> = killed.iter().map(|(m, at)| (m.0, *at)).collect();
    let false_suspicions = farm_workloads::timeline::false_suspicions(suspected, &failed);
    let transactions = overall.len();
    Ok(RunReport {
        seconds: elapsed,
        transactions,
        per_second: transactions as f64 / elapsed,
        p50_us: overall.value_at_quantile(0.5) as f64 / 1000.0,
        p99_us: overall.value_at_quantile(0.99) as f64 / 1000.0,
        types,
        kills: kill_reports,
        false_suspicions,
        completed_per_ms: per_ms,
        timeline: serde_json::from_str(&tl.to_json())?,
        killed,
    })
}

/// One client: transactions from the mix until told to stop, each timed; `opts.in_flight` of
/// them at once on the client's thread.
fn client<W: Workload>(
    cluster: &Cluster,
    workload: &W,
    id: usize,
    opts: &RunOptions,
    stop: &AtomicBool,
    barrier: &Barrier,
) -> anyhow::Result<ClientStats> {
    let n = workload.kinds().len();
    let stats = RefCell::new(ClientStats {
        hist: (0..n)
            .map(|_| Histogram::new(3))
            .collect::<Result<_, _>>()?,
        successes: vec![0; n],
        attempts: vec![0; n],
        errors: vec![0; n],
        per_ms: Vec::new(),
    });
    let seed = opts.seed.wrapping_mul(1_000_003) ^ (id as u64 + 1) << 40;
    // Machines found dead or evicted: transactions go elsewhere.
    let down = RefCell::new(vec![false; cluster.machines() as usize]);
    let failed = RefCell::new(None);
    // Back-to-back transactions: keep one host rather than hand it to a poller in between.
    let session = cluster.session();
    barrier.wait();
    let done = |i: usize, result: Result<bool, TxError>, t: Instant, attempts: u64| {
        if let Err(e) = stats.borrow_mut().record(
            i,
            result,
            t.elapsed().as_nanos() as u64,
            attempts,
            cluster.now_us(),
            &mut down.borrow_mut(),
        ) {
            failed
                .borrow_mut()
                .get_or_insert(anyhow::anyhow!("{} failed: {e}", workload.kinds()[i]));
        }
    };
    let going = || !stop.load(Ordering::Relaxed) && failed.borrow().is_none();
    let in_flight = opts.in_flight.expect("resolved by `run`");
    if in_flight == 1 {
        let mut rng = Rand::new(seed);
        while going() {
            let (t, mut attempts) = (Instant::now(), 0);
            let (i, result) =
                workload.run_one(&session, id, &mut rng, &down.borrow(), &mut attempts);
            done(i, result, t, attempts);
        }
    } else {
        session.pipeline(in_flight, async |p, k| {
            let mut rng = Rand::new(seed ^ (k as u64 + 1) << 20);
            while going() {
                let (t, mut attempts) = (Instant::now(), 0);
                // Not borrowed across the transaction's awaits: `done` marks machines down.
                let now_down = down.borrow().clone();
                let (i, result) = workload
                    .run_one_in(p, id, &mut rng, &now_down, &mut attempts)
                    .await;
                done(i, result, t, attempts);
            }
        });
    }
    if let Some(e) = failed.into_inner() {
        return Err(e);
    }
    Ok(stats.into_inner())
}

impl ClientStats {
    /// Records a transaction of type `i` that took `ns` and `attempts` executions, ended at
    /// `now_us`: an error that is not the cluster's to end comes back.
    fn record(
        &mut self,
        i: usize,
        result: Result<bool, TxError>,
        ns: u64,
        attempts: u64,
        now_us: u64,
        down: &mut [bool],
    ) -> Result<(), TxError> {
        self.attempts[i] += attempts;
        match result {
            Ok(ok) => {
                self.successes[i] += ok as u64;
                self.hist[i]
                    .record(ns.max(1))
                    .expect("latencies fit the histogram");
                let ms = (now_us / 1000) as usize;
                if self.per_ms.len() <= ms {
                    self.per_ms.resize(ms + 1, 0);
                }
                self.per_ms[ms] += 1;
            }
            // The coordinator died or was removed under the transaction: go elsewhere.
            Err(TxError::CoordinatorFailed(d) | TxError::Evicted(d)) => {
                self.errors[i] += 1;
                down[d.0 as usize] = true;
            }
            Err(e) if e.is_retryable() => self.errors[i] += 1,
            Err(e) => return Err(e),
        }
        Ok(())
    }
}

/// Times from a kill of `victim` at `at_us`: to its suspicion, from suspicion to a window at
/// 80% of the mean throughput over the 100 ms before the kill, and to the last copy of data
/// recovery after it.
fn kill_report(t: &farm::Timeline, per_ms: &[u64], victim: MachineId, at_us: u64) -> KillReport {
    let suspect = t.events.iter().find_map(|e| match e {
        ReconfigEvent::Suspect { machine, at_us: s } if *machine == victim && *s >= at_us => {
            Some(*s)
        }
        _ => None,
    });
    let back = farm_workloads::timeline::recovery(
        per_ms,
        (at_us / 1000) as usize,
        suspect.map(|s| (s / 1000) as usize),
    );
    let rereplicated = t
        .recovery
        .iter()
        .filter_map(|(_, e)| match e {
            RecoveryEvent::DataRecoveryDone { at, .. } if *at >= at_us => Some(*at),
            _ => None,
        })
        .max();
    let ms = |us: u64| us as f64 / 1000.0;
    KillReport {
        machine: victim.0,
        at_us,
        kill_to_suspect_ms: suspect.map(|s| ms(s - at_us)),
        throughput_before_per_ms: back.before_per_ms,
        suspect_to_80_percent_ms: back.suspected_to_80_percent_ms.map(|m| m as f64),
        suspect_to_rereplicated_ms: suspect
            .zip(rereplicated)
            .map(|(s, r)| ms(r.saturating_sub(s))),
    }
}

/// Prints the throughput line, the per-type table and the kills.
pub fn print(r: &RunReport) {
    println!(
        "{} transactions in {:.2} s: {:.0} per second; latency p50 {:.1} us, p99 {:.1} us",
        r.transactions, r.seconds, r.per_second, r.p50_us, r.p99_us
    );
    println!(
        "{:<24} {:>4} {:>10} {:>9} {:>8} {:>7} {:>9} {:>9} {:>9}",
        "type", "mix", "count", "success", "aborts", "errors", "p50 us", "p99 us", "p99.9 us"
    );
    for t in &r.types {
        println!(
            "{:<24} {:>3}% {:>10} {:>8.1}% {:>8} {:>7} {:>9.1} {:>9.1} {:>9.1}",
            t.name,
            t.mix_percent,
            t.count,
            100.0 * t.successes as f64 / t.count.max(1) as f64,
            t.aborts,
            t.errors,
            t.p50_us,
            t.p99_us,
            t.p999_us
        );
    }
    let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1} ms"));
    for k in &r.kills {
        println!(
            "killed m{} at {:.3} s (cluster clock): suspected after {}; back to 80% of {:.0} \
             ops/ms {} after suspicion; re-replicated {} after suspicion",
            k.machine,
            k.at_us as f64 / 1e6,
            show(k.kill_to_suspect_ms),
            k.throughput_before_per_ms.unwrap_or(0.0),
            show(k.suspect_to_80_percent_ms),
            show(k.suspect_to_rereplicated_ms)
        );
    }
    let listed: Vec<String> = (r.false_suspicions.iter())
        .map(|(m, at)| format!("machine {m} at {:.3} s", *at as f64 / 1e6))
        .collect();
    println!(
        "{}",
        farm_workloads::timeline::false_suspicions_line(&listed)
    );
}

/// Draws operations per millisecond with the cluster's events and the kills to `path` (SVG).
pub fn chart(
    path: &std::path::Path,
    title: &str,
    cluster: &Cluster,
    r: &RunReport,
) -> anyhow::Result<()> {
    let mut marks = timeline::markers(&cluster.timeline());
    for (victim, at_us) in &r.killed {
        marks.push(Marker {
            at_us: *at_us,
            label: format!("kill {victim}"),
        });
    }
    marks.sort_by_key(|m| m.at_us);
    let per_ms = &r.completed_per_ms;
    let start_ms = (per_ms.iter().position(|n| *n > 0).unwrap_or(0) + 1).min(per_ms.len());
    timeline::draw(
        path,
        title,
        &per_ms[..per_ms.len().saturating_sub(1)],
        start_ms,
        &marks,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(kills: &[&str]) -> RunOptions {
        RunOptions {
            clients: 1,
            in_flight: None,
            seconds: 4.0,
            seed: 1,
            pin: false,
            kills: kills.iter().map(|k| parse_kill(k).unwrap()).collect(),
            lease: Duration::from_millis(10),
        }
    }

    /// Kills that would leave the machines alive no majority of the configuration before them
    /// are refused up front (FaRM §5.2: no reconfiguration without a majority answering its
    /// probes): two of three machines killed one after the other waited for good and then
    /// failed with every suspicion of the stuck run in the message.
    /// Why `validate` refuses `kills` in a cluster of `machines`.
    fn refused(kills: &[&str], machines: u16) -> String {
        options(kills).validate(machines).unwrap_err().to_string()
    }

    #[test]
    fn kills_that_leave_no_majority_are_refused() {
        assert!(options(&["1@1"]).validate(3).is_ok());
        assert!(options(&["1@1", "cm@2"]).validate(4).is_ok());
        let e = refused(&["1@1", "2@2.5"], 3);
        assert!(
            e.contains("--kill at 2.5 s") && e.contains("1 of 2 machines"),
            "{e}"
        );
        // Two at once of four leave two: no majority of four.
        let e = refused(&["1@1", "2@1"], 4);
        assert!(e.contains("2 of 4 machines"), "{e}");
        let e = refused(&["0@1"], 2);
        assert!(e.contains("1 of 2 machines"), "{e}");
        // A dead machine cannot be killed again, named by its number or as the first CM.
        let e = refused(&["1@2", "1@1"], 7);
        assert!(
            e.contains("--kill 1@2: machine 1 is killed once already"),
            "{e}"
        );
        let e = refused(&["cm@1", "0@2"], 7);
        assert!(
            e.contains("--kill 0@2: machine 0 is killed once already"),
            "{e}"
        );
        assert!(options(&["cm@1", "cm@2"]).validate(7).is_ok());
        // Kills a few milliseconds apart are one failure: two of four leave no majority.
        let e = refused(&["1@1", "2@1.001"], 4);
        assert!(e.contains("2 of 4 machines"), "{e}");
        assert!(options(&["1@1", "2@2"]).validate(4).is_ok());
    }
}
