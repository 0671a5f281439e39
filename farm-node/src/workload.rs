//! TATP and TPC-C run by every machine process of a cluster (`farm_workloads::tatp`,
//! `farm_workloads::tpcc`): machine 0 creates the tables (each machine's partition in its own
//! regions) and publishes their roots in ZooKeeper; every machine opens them, loads its own
//! partition, waits for the others, then runs the mix from its client threads for the run's
//! length, every transaction coordinated on this machine; once all are done, machine 0 checks
//! the database (machine 1 when machine 0 was failed mid-run). Each machine publishes its
//! result (`<workload>-result-m<id>`) for the launcher.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use farm::node::Node;
use farm::zk::ZkStore;
use farm::{Addr, MachineId, TxError};
use farm_workloads::{tatp, tpcc, Rand};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// A TATP run.
#[derive(clap::Args, Debug, Clone)]
pub struct TatpArgs {
    /// Subscribers in the database.
    #[arg(long, default_value_t = 20_000)]
    pub subscribers: u32,
    #[command(flatten)]
    pub run: RunArgs,
}

/// A TPC-C run.
#[derive(clap::Args, Debug, Clone)]
pub struct TpccArgs {
    /// Warehouses (warehouse w lives on machine (w - 1) mod machines; a machine with none
    /// runs no clients).
    #[arg(long, default_value_t = 3)]
    pub warehouses: u32,
    /// The mix: `full` (45/43/4/4/4) or `new-order-payment` (50/50).
    #[arg(long, default_value = "full", value_parser = ["full", "new-order-payment"])]
    pub mix: String,
    #[command(flatten)]
    pub run: RunArgs,
}

/// What every workload run takes.
#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Seconds of measured run.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Client threads per machine.
    #[arg(long, default_value_t = 1)]
    pub clients: u16,
    /// Transactions each client thread keeps in flight (default: TATP 16 over `shm` and 64
    /// over `tcp`, TPC-C 4).
    #[arg(long)]
    pub in_flight: Option<usize>,
    /// Seed of the population and of the clients' inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Machine 0 checks the database's integrity after the run (TPC-C: conditions 1 to 4);
    /// machine 1 does when machine 0 is the one `--kill-after` fails.
    #[arg(long)]
    pub check: bool,
    /// Fail a machine this many seconds into the measured run: it kills itself (SIGKILL),
    /// and `local` reports the time from its suspicion to 80% of the throughput before
    /// (FaRM §6.4). Timed by the machine's own clock, not a launcher's that may be starved.
    #[arg(long, value_name = "SECONDS")]
    pub kill_after: Option<f64>,
    /// Stop the machine (SIGSTOP) instead: a process that hangs, then is removed.
    #[arg(long, requires = "kill_after")]
    pub stop: bool,
    /// The machine to fail [default: the last; the CM is machine 0].
    #[arg(long, requires = "kill_after")]
    pub victim: Option<u16>,
}

impl RunArgs {
    /// Whether the run can work: checked by the launcher before it starts any machine, and by
    /// each machine (which may be started by hand).
    pub fn check(&self) -> anyhow::Result<()> {
        if self.clients == 0 || !self.seconds.is_finite() || self.seconds <= 0.0 {
            bail!("a run needs at least one client and a positive, finite length");
        }
        if let Some(after) = self.kill_after {
            if !(after > 0.0 && after < self.seconds) {
                bail!(
                    "--kill-after {after}: a machine fails during the run, more than 0 and less \
                     than the run's {} s after it starts",
                    self.seconds
                );
            }
        }
        Ok(())
    }

    /// The flags that give a machine process this run.
    pub fn flags(&self) -> Vec<String> {
        let mut f = vec![
            format!("--seconds={}", self.seconds),
            format!("--clients={}", self.clients),
            format!("--seed={}", self.seed),
        ];
        if let Some(n) = self.in_flight {
            f.push(format!("--in-flight={n}"));
        }
        if self.check {
            f.push("--check".into());
        }
        if let Some(after) = self.kill_after {
            f.push(format!("--kill-after={after}"));
            if self.stop {
                f.push("--stop".into());
            }
            if let Some(v) = self.victim {
                f.push(format!("--victim={v}"));
            }
        }
        f
    }

    /// The machine that checks the database's integrity after the run (`--check`): machine
    /// 0, or machine 1 when machine 0 is the one failed in the middle of it.
    pub fn checker(&self, machines: u16) -> MachineId {
        match self.victim(machines) {
            Some(MachineId(0)) => MachineId(1),
            _ => MachineId(0),
        }
    }

    /// The machine to fail in the middle of the run, among `machines`, if one is.
    pub fn victim(&self, machines: u16) -> Option<MachineId> {
        self.kill_after
            .map(|_| MachineId(self.victim.unwrap_or(machines.saturating_sub(1))))
    }
}

/// The file in the cluster's directory `dir` where the machine failed by `--kill-after`
/// writes when it failed (µs since the Unix epoch, as text), just before it does: a file, not
/// ZooKeeper, which machine processes busy on the same cores can starve for seconds.
pub fn failed_file(dir: &std::path::Path) -> std::path::PathBuf {
    dir.join("failed-at")
}

/// What one machine measured.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct WorkloadResult {
    pub machine: u16,
    pub seconds: f64,
    /// Transactions finished (TATP: found or not, as the specification counts them; TPC-C:
    /// committed or rolled back as asked).
    pub transactions: u64,
    /// TATP: transactions that found their rows; TPC-C: committed NEW-ORDERs.
    pub counted: u64,
    /// Executions, retries included.
    pub executions: u64,
    /// Transactions that failed with an error.
    pub errors: u64,
    /// Latency percentiles of finished transactions, in microseconds.
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// What the integrity check found, with `--check`, at the machine that ran it
    /// ([`RunArgs::checker`]).
    pub check: Option<String>,
    /// When the measured run started, in microseconds since the Unix epoch: the clock the
    /// launcher lines the machines' timelines up on.
    #[serde(default)]
    pub started_unix_us: u64,
    /// Transactions finished in each millisecond of the run.
    #[serde(default)]
    pub completed_per_ms: Vec<u64>,
    /// The machines this one suspected (their lease expired here, or as the CM it set out to
    /// remove them), and when, in microseconds since the Unix epoch.
    #[serde(default)]
    pub suspected: Vec<(u16, u64)>,
}

/// How long a machine waits for the others at each step.
const STEP_WAIT: Duration = Duration::from_secs(600);

/// The machines of a run, meeting in ZooKeeper under names prefixed with the workload's.
struct Meeting<'a> {
    node: &'a Node,
    /// The cluster's directory.
    dir: &'a std::path::Path,
    store: &'a ZkStore,
    workload: &'static str,
    me: MachineId,
    machines: u16,
}

impl Meeting<'_> {
    /// Publishes `data` as `what`. A ZooKeeper that does not answer is asked again until
    /// `STEP_WAIT` (busy machine processes on a host they share with it starve it for seconds;
    /// writing the same data again is harmless).
    fn publish(&self, what: &str, data: &[u8]) -> anyhow::Result<()> {
        let name = format!("{}-{what}", self.workload);
        let started = Instant::now();
        loop {
            match self.store.put(&name, data) {
                Ok(()) => return Ok(()),
                Err(e) if started.elapsed() < STEP_WAIT => {
                    tracing::warn!(name, error = %e, "publishing in ZooKeeper: asking again");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e).with_context(|| format!("publishing {name}")),
            }
        }
    }

    fn wait(&self, what: &str) -> anyhow::Result<Vec<u8>> {
        Ok(self.wait_unless(what, || false)?.expect("waited for"))
    }

    /// What the machines published as `what`, once they did, or `None` once `gone()`.
    fn wait_unless(&self, what: &str, gone: impl Fn() -> bool) -> anyhow::Result<Option<Vec<u8>>> {
        let name = format!("{}-{what}", self.workload);
        let started = Instant::now();
        loop {
            // A ZooKeeper that does not answer is asked again (see `publish`).
            match self.store.get(&name) {
                Ok(Some(data)) => return Ok(Some(data)),
                Ok(None) => {}
                Err(e) if started.elapsed() < STEP_WAIT => {
                    tracing::warn!(name, error = %e, "reading ZooKeeper: asking again");
                }
                Err(e) => return Err(e).with_context(|| format!("waiting for {name}")),
            }
            if gone() {
                return Ok(None);
            }
            if started.elapsed() > STEP_WAIT {
                bail!("{name} did not appear in ZooKeeper within {STEP_WAIT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until every machine got to `step`, or left the configuration (one failed in the
    /// middle of the run: `local ... --kill-after`).
    fn barrier(&self, step: &str) -> anyhow::Result<()> {
        self.publish(&format!("{step}-m{}", self.me.0), b"")?;
        for m in (0..self.machines).map(MachineId) {
            let left = || !self.node.configuration().members.contains(&m);
            self.wait_unless(&format!("{step}-m{}", m.0), left)?;
        }
        Ok(())
    }

    fn publish_roots(&self, roots: &[Addr]) -> anyhow::Result<()> {
        self.publish_addrs("roots", roots)
    }

    fn roots(&self) -> anyhow::Result<Vec<Addr>> {
        self.addrs("roots")
    }

    /// Publishes `addrs` as `what`.
    fn publish_addrs(&self, what: &str, addrs: &[Addr]) -> anyhow::Result<()> {
        let bytes: Vec<u8> = addrs
            .iter()
            .flat_map(|a| a.to_u64().to_le_bytes())
            .collect();
        self.publish(what, &bytes)
    }

    /// The addresses published as `what`, once they are.
    fn addrs(&self, what: &str) -> anyhow::Result<Vec<Addr>> {
        let bytes = self.wait(what)?;
        if bytes.len() % 8 != 0 {
            bail!("the published {what} are {} bytes", bytes.len());
        }
        Ok(bytes
            .chunks(8)
            .map(|c| Addr::from_u64(u64::from_le_bytes(c.try_into().expect("8 bytes"))))
            .collect())
    }
}

/// What the client threads of one machine measured.
struct Measured {
    started_unix_us: u64,
    completed_per_ms: Vec<u64>,
    seconds: f64,
    hist: Histogram<u64>,
    transactions: u64,
    counted: u64,
    executions: u64,
    errors: u64,
}

/// One client thread's counts.
struct Tally {
    client: u16,
    /// When the run started (the millisecond of a completion counts from it).
    started: Instant,
    completed_per_ms: Vec<u64>,
    hist: Histogram<u64>,
    done: u64,
    counted: u64,
    executions: u64,
    errors: u64,
    /// This machine was removed from the configuration: the client stops.
    evicted: bool,
}

impl Tally {
    /// Counts a transaction begun at `t` that ended with `r` after `executions` executions.
    fn record(&mut self, r: Result<bool, TxError>, t: Instant, executions: u64) {
        self.executions += executions;
        match r {
            Ok(c) => {
                self.done += 1;
                self.counted += c as u64;
                let _ = self.hist.record(t.elapsed().as_nanos() as u64);
                let ms = self.started.elapsed().as_millis() as usize;
                if self.completed_per_ms.len() <= ms {
                    self.completed_per_ms.resize(ms + 1, 0);
                }
                self.completed_per_ms[ms] += 1;
            }
            Err(TxError::Evicted(_)) => self.evicted = true,
            Err(e) => {
                if self.errors == 0 {
                    tracing::warn!(client = self.client, error = %e, "a transaction failed");
                }
                self.errors += 1;
            }
        }
    }
}

/// Runs `client(client, going, tally)` on `clients` threads for `seconds`: each runs
/// transactions while `going()` and counts them in its tally.
fn measure(
    meeting: &Meeting<'_>,
    run: &RunArgs,
    client: impl Fn(u16, &dyn Fn() -> bool, &RefCell<Tally>) + Sync,
) -> anyhow::Result<Measured> {
    let stop = AtomicBool::new(false);
    let started_unix_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_micros() as u64;
    let started = Instant::now();
    let total = Mutex::new(Measured {
        started_unix_us,
        completed_per_ms: Vec::new(),
        seconds: 0.0,
        hist: Histogram::new(3)?,
        transactions: 0,
        counted: 0,
        executions: 0,
        errors: 0,
    });
    std::thread::scope(|s| {
        for c in 0..run.clients {
            let (stop, total, client) = (&stop, &total, &client);
            s.spawn(move || {
                let tally = RefCell::new(Tally {
                    client: c,
                    started,
                    completed_per_ms: Vec::new(),
                    hist: Histogram::<u64>::new(3).expect("histogram"),
                    done: 0,
                    counted: 0,
                    executions: 0,
                    errors: 0,
                    evicted: false,
                });
                let going = || !stop.load(Ordering::Relaxed) && !tally.borrow().evicted;
                client(c, &going, &tally);
                let tally = tally.into_inner();
                let mut t = total.lock().expect("poisoned");
                t.hist.add(&tally.hist).expect("same bounds");
                if t.completed_per_ms.len() < tally.completed_per_ms.len() {
                    t.completed_per_ms.resize(tally.completed_per_ms.len(), 0);
                }
                for (i, n) in tally.completed_per_ms.iter().enumerate() {
                    t.completed_per_ms[i] += n;
                }
                t.transactions += tally.done;
                t.counted += tally.counted;
                t.executions += tally.executions;
                t.errors += tally.errors;
            });
        }
        s.spawn(|| fail_on_time(meeting, run, started));
        std::thread::sleep(Duration::from_secs_f64(run.seconds));
        stop.store(true, Ordering::Relaxed);
    });
    let mut m = total.into_inner().expect("poisoned");
    m.seconds = started.elapsed().as_secs_f64();
    Ok(m)
}

/// Each client's inputs: its own stream of random numbers.
fn client_rng(run: &RunArgs, me: MachineId, client: u16, task: usize) -> Rand {
    Rand::new(run.seed ^ (me.0 as u64) << 40 ^ (client as u64) << 20 ^ (task as u64) << 8)
}

/// On the victim of `--kill-after`, a thread that fails this process that long after
/// `started` (the measured run's start), once it recorded when ([`failed_file`]).
fn fail_on_time(meeting: &Meeting<'_>, run: &RunArgs, started: Instant) {
    let (Some(after), Some(victim)) = (run.kill_after, run.victim(meeting.machines)) else {
        return;
    };
    if victim != meeting.me {
        return;
    }
    std::thread::sleep(Duration::from_secs_f64(after).saturating_sub(started.elapsed()));
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    if let Err(e) = std::fs::write(failed_file(meeting.dir), at.to_string()) {
        tracing::error!(error = %e, "could not record the failure; failing anyway");
    }
    let (signal, what) = if run.stop {
        (libc::SIGSTOP, "stopping")
    } else {
        (libc::SIGKILL, "killing")
    };
    tracing::warn!(
        machine = meeting.me.0,
        "{what} this machine process, as --kill-after asks"
    );
    // SAFETY: raise(3) with a valid signal.
    unsafe { libc::raise(signal) };
}

/// Ends a run: waits for every machine, lets the checker check ([`RunArgs::checker`]),
/// publishes the result.
fn finish(
    meeting: &Meeting<'_>,
    measured: Measured,
    check: impl FnOnce() -> Result<String, String>,
    run: &RunArgs,
) -> anyhow::Result<WorkloadResult> {
    meeting.barrier("done")?;
    let check = (run.check && meeting.me == run.checker(meeting.machines))
        .then(check)
        .transpose()
        .map_err(|e| anyhow::anyhow!("integrity check failed: {e}"))?;
    let h = &measured.hist;
    // Suspicions are timed on the node's clock: moved onto the Unix epoch's.
    let unix_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_micros() as u64;
    let offset = unix_now.saturating_sub(meeting.node.now_us());
    // Lease expiries here, and (at the CM) machines a reconfiguration set out to remove.
    let leases = (meeting.node.suspicions().into_iter()).map(|s| (s.suspect, s.at_us));
    let removals = (meeting.node.reconfig_events().into_iter()).filter_map(|e| match e {
        farm::ReconfigEvent::Suspect { machine, at_us } => Some((machine, at_us)),
        _ => None,
    });
    // A lease expiry is both (farm's `on_suspicion` records it as a removal's suspect too, at
    // the same time): `false_suspicions` counts each once.
    let suspected = (leases.chain(removals))
        .map(|(m, at)| (m.0, at + offset))
        .collect();
    let result = WorkloadResult {
        machine: meeting.me.0,
        seconds: measured.seconds,
        transactions: measured.transactions,
        counted: measured.counted,
        executions: measured.executions,
        errors: measured.errors,
        p50_us: h.value_at_quantile(0.5) as f64 / 1e3,
        p99_us: h.value_at_quantile(0.99) as f64 / 1e3,
        max_us: h.max() as f64 / 1e3,
        check,
        started_unix_us: measured.started_unix_us,
        completed_per_ms: measured.completed_per_ms,
        suspected,
    };
    meeting.publish(
        &format!("result-m{}", meeting.me.0),
        &serde_json::to_vec(&result)?,
    )?;
    Ok(result)
}

/// TATP on this machine, as the module docs say.
pub fn run_tatp(
    node: &Node,
    store: &ZkStore,
    args: &TatpArgs,
    (fabric, dir): (&str, &std::path::Path),
) -> anyhow::Result<WorkloadResult> {
    args.run.check()?;
    if args.subscribers == 0 {
        bail!("TATP needs at least one subscriber");
    }
    let me = node.id();
    let meeting = Meeting {
        node,
        dir,
        store,
        workload: "tatp",
        me,
        machines: node.configuration().members.len() as u16,
    };
    let tables = if me.0 == 0 {
        let tables = tatp::Tables::create(node, args.subscribers).context("creating the tables")?;
        meeting.publish_roots(&tables.roots())?;
        tables
    } else {
        let roots = meeting.roots()?;
        let roots: [Addr; 5] = roots
            .try_into()
            .map_err(|r: Vec<Addr>| anyhow::anyhow!("{} TATP roots, not 5", r.len()))?;
        tatp::Tables::open(node, me, args.subscribers, roots).context("opening the tables")?
    };
    let started = Instant::now();
    tables
        .populate_partition(node, me.0 as usize, 8, args.run.seed, &|_| {})
        .context("loading this machine's subscribers")?;
    tracing::info!(
        machine = me.0,
        seconds = started.elapsed().as_secs_f64(),
        "loaded"
    );
    meeting.barrier("loaded")?;
    let run = &args.run;
    let in_flight = farm_workloads::in_flight(run.in_flight, Some(tatp_in_flight_default(fabric)))?;
    let measured = measure(&meeting, run, |client, going, tally| {
        node.pipeline(in_flight, async |p, task| {
            let mut rng = client_rng(run, me, client, task);
            while going() {
                let (t, mut executions) = (Instant::now(), 0);
                let kind = tatp::Kind::from_draw(rng.next_u64() % 100);
                let r = tables
                    .run_in(p, Some(me), kind, &mut rng, &mut executions)
                    .await;
                tally.borrow_mut().record(r, t, executions);
            }
        })
    })?;
    finish(
        &meeting,
        measured,
        || {
            tables
                .check(node, me)
                .map(|cfs| format!("{} subscribers, {cfs} call forwardings", args.subscribers))
        },
        &args.run,
    )
}

/// TPC-C on this machine, as the module docs say: its clients serve the warehouses that live
/// here.
pub fn run_tpcc(
    node: &Node,
    store: &ZkStore,
    args: &TpccArgs,
    dir: &std::path::Path,
) -> anyhow::Result<WorkloadResult> {
    args.run.check()?;
    let in_flight = farm_workloads::in_flight(args.run.in_flight, Some(TPCC_IN_FLIGHT_DEFAULT))?;
    if !(1..=255).contains(&args.warehouses) {
        bail!("TPC-C needs 1 to 255 warehouses");
    }
    let me = node.id();
    let meeting = Meeting {
        node,
        dir,
        store,
        workload: "tpcc",
        me,
        machines: node.configuration().members.len() as u16,
    };
    // Room for the NEW-ORDERs of the run (`local tpcc` sized the regions for it).
    let scale = tpcc::Scale::for_run(args.warehouses, args.run.seconds);
    let seed = args.run.seed;
    let started = Instant::now();
    // Each machine creates its partition of every hash table at once, where it is primary;
    // machine 0 makes the roots from every machine's directory pages.
    let pages = tpcc::Tables::create_partition(node, scale, me)
        .context("creating this machine's partitions")?;
    meeting.publish_addrs(&format!("pages-m{}", me.0), &pages)?;
    let tables = if me.0 == 0 {
        let pages = (0..meeting.machines)
            .map(|m| meeting.addrs(&format!("pages-m{m}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let tables =
            tpcc::Tables::create_from(node, scale, seed, &pages).context("creating the tables")?;
        tracing::info!(seconds = started.elapsed().as_secs_f64(), "tables created");
        meeting.publish_roots(&tables.roots())?;
        tables
    } else {
        tpcc::Tables::open(node, me, scale, seed, &meeting.roots()?)
            .context("opening the tables")?
    };
    // Every machine loads its copy of ITEM, then its own warehouses.
    tables
        .populate_item_copy(node, 40, seed, me.0 as usize)
        .context("loading ITEM")?;
    let mine: Vec<u32> = (1..=args.warehouses)
        .filter(|w| tables.machine_of(node, *w) == me)
        .collect();
    for &w in &mine {
        tables
            .populate_warehouse(node, w, seed, &|_| {})
            .with_context(|| format!("loading warehouse {w}"))?;
    }
    tracing::info!(machine = me.0, warehouses = ?mine,
        seconds = started.elapsed().as_secs_f64(), "loaded");
    meeting.barrier("loaded")?;
    let only_new_order_payment = args.mix == "new-order-payment";
    let clients = args.run.clients as usize;
    // The next transaction of client `c`: its type and home warehouse, one of every
    // clients-th of this machine's warehouses from the c-th.
    let pick = |client: u16, rng: &mut Rand| {
        let homes: Vec<u32> = mine
            .iter()
            .copied()
            .skip(client as usize % mine.len())
            .step_by(clients)
            .collect();
        let w = homes[(rng.next_u64() % homes.len() as u64) as usize];
        let kind = tpcc::Kind::from_draw(rng.next_u64() % 100, only_new_order_payment);
        (kind, w)
    };
    // TPC-C's clients run where their home warehouse lives: a machine that holds none (more
    // machines than warehouses) coordinates nothing, and serves the others' transactions as
    // a participant and backup.
    if mine.is_empty() {
        tracing::info!(
            machine = me.0,
            "no warehouse lives on this machine: its clients run no transactions"
        );
    }
    let new_order =
        |kind, outcome| kind == tpcc::Kind::NewOrder && outcome == tpcc::Outcome::Committed;
    let measured = measure(&meeting, &args.run, |client, going, tally| {
        if mine.is_empty() {
            return;
        }
        if in_flight == 1 {
            // One blocking transaction at a time, without an executor.
            let mut rng = client_rng(&args.run, me, client, 0);
            while going() {
                let (t, mut executions) = (Instant::now(), 0);
                let (kind, w) = pick(client, &mut rng);
                let r = tables
                    .run(
                        node,
                        Some(me),
                        (kind, w),
                        &mut rng,
                        now_ms(),
                        &mut executions,
                    )
                    .map(|outcome| new_order(kind, outcome));
                tally.borrow_mut().record(r, t, executions);
            }
            return;
        }
        node.pipeline(in_flight, async |p, task| {
            let mut rng = client_rng(&args.run, me, client, task);
            while going() {
                let (t, mut executions) = (Instant::now(), 0);
                let (kind, w) = pick(client, &mut rng);
                let r = tables
                    .run_in(p, Some(me), (kind, w), &mut rng, now_ms(), &mut executions)
                    .await
                    .map(|outcome| new_order(kind, outcome));
                tally.borrow_mut().record(r, t, executions);
            }
        })
    })?;
    finish(
        &meeting,
        measured,
        || {
            tables.check(node, me).map(|()| {
                format!(
                    "consistency conditions 1-4 hold for {} warehouses",
                    args.warehouses
                )
            })
        },
        &args.run,
    )
}

/// TATP transactions a client thread of a machine process keeps in flight when not told, over
/// `fabric` (`shm` or `tcp`). Over `tcp` every round trip goes through threads and syscalls, and
/// more in flight keeps gaining: three processes ran 106-114 K/s at 16, 161-192 K/s at 64 and
/// 200-232 K/s at 128, with p99 about 5 ms at 64 and 12 ms (some seconds at most) at 128; over
/// `shm` 462-528 K/s at 16, 418-434 K/s at 64 and 290-410 K/s at 128 (`farm-node local tatp
/// --fabric F --seconds 4 --subscribers 100000 --in-flight N`, two alternating rounds,
/// 2026-11-27). Since pipelines stopped walking every commit in flight and yield between
/// transactions that never wait (2026-11-28), `shm` runs as fast at 64 as at 16 (572, 631, 668
/// K/s at 16; 629, 708, 577 K/s at 64, alternated) with a lower p99 at 16, which it keeps.
pub fn tatp_in_flight_default(fabric: &str) -> usize {
    match fabric {
        "tcp" => 64,
        _ => farm_workloads::IN_FLIGHT_DEFAULT,
    }
}

/// TPC-C transactions a client thread of a machine process keeps in flight when not told:
/// over three machine processes with 3 warehouses, `shm` ran 6.7 K/s at 1, 12.7 K/s at 4,
/// 14.6 K/s at 8 and 13.5 K/s at 16, `tcp` 3.0, 3.2, 3.1 and 2.9 K/s; more in flight on a
/// warehouse conflict more (2026-11-27).
pub const TPCC_IN_FLIGHT_DEFAULT: usize = 4;

/// Milliseconds since 1970, for TPC-C's dates.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
