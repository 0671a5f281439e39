//! TATP on an in-process cluster (see `farm_benchmarks::tatp`): populates the database with a
//! progress bar, runs the standard mix from client threads for a while, and reports throughput,
//! and per transaction type the count, successes, aborts (retried executions) and latency
//! percentiles; optionally checks the database afterwards and writes JSON.
//!
//! Failure injection: `--kill MACHINE@SECONDS` (repeatable; `cm@SECONDS` kills whichever
//! machine is CM then) kills machines during the run, which goes on through recovery; the run
//! then reports, per kill, the times to suspicion, to 80% of the throughput before the kill
//! and to full re-replication, can draw throughput per millisecond with the recovery events
//! marked (`--chart run.svg`, like the paper's Figures 9 to 11), and `--check` checks the
//! database afterwards.
//!
//! `cargo run --release -p farm-benchmarks --bin tatp -- --subscribers 100000 --seconds 5`
//! `cargo run --release -p farm-benchmarks --bin tatp -- --seconds 2 --kill 2@1 --chart kill.svg --check`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use farm::{Cluster, MachineId, ReconfigEvent, RecoveryEvent, TxError};
use farm_benchmarks::tatp::{Kind, Rand, Tables};
use farm_benchmarks::timeline::{self, Marker};
use hdrhistogram::Histogram;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "TATP on an in-process farm-rs cluster")]
struct Args {
    /// Subscribers in the database.
    #[arg(long, default_value_t = 100_000)]
    subscribers: u32,
    /// Machines.
    #[arg(long, default_value_t = 3)]
    machines: u16,
    /// Replicas of every region (primary included).
    #[arg(long, default_value_t = 3)]
    replicas: u16,
    /// Worker threads per machine.
    #[arg(long, default_value_t = 2)]
    workers: u16,
    /// Client threads running transactions.
    #[arg(long, default_value_t = 2)]
    clients: u16,
    /// Seconds of measured run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Seed of the population and of the clients' inputs.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Coordinate each transaction on its subscriber's machine (by default on a random
    /// machine, as FaRM ran TATP: "partitionable but we have not partitioned it").
    #[arg(long)]
    partitioned: bool,
    /// Pin the cluster's poller threads and the clients to cores (client i to core i).
    #[arg(long)]
    pin: bool,
    /// Check the database's integrity after the run.
    #[arg(long)]
    check: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Kill a machine during the run: `MACHINE@SECONDS` after the measured run starts, or
    /// `cm@SECONDS` for the machine that is CM then. Repeatable.
    #[arg(long, value_parser = parse_kill)]
    kill: Vec<Kill>,
    /// Lease duration in milliseconds (failure detection, §5.1).
    #[arg(long, default_value_t = 10)]
    lease_ms: u64,
    /// Draw throughput per millisecond with the recovery events to this SVG file.
    #[arg(long)]
    chart: Option<std::path::PathBuf>,
}

/// A machine to kill, and when.
#[derive(Clone, Copy, Debug)]
struct Kill {
    /// `None`: the CM at that moment.
    machine: Option<u16>,
    seconds: f64,
}

fn parse_kill(s: &str) -> Result<Kill, String> {
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

/// What a kill did to the run.
#[derive(Serialize, Debug)]
struct KillReport {
    machine: u16,
    at_us: u64,
    kill_to_suspect_ms: Option<f64>,
    throughput_before_per_ms: Option<f64>,
    suspect_to_80_percent_ms: Option<f64>,
    suspect_to_rereplicated_ms: Option<f64>,
}

/// Results of one transaction type.
#[derive(Serialize, Debug)]
struct TypeReport {
    name: &'static str,
    mix_percent: u64,
    count: u64,
    successes: u64,
    aborts: u64,
    errors: u64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
}

#[derive(Serialize, Debug)]
struct Report {
    subscribers: u32,
    machines: u16,
    replicas: u16,
    workers: u16,
    clients: u16,
    partitioned: bool,
    seconds: f64,
    populate_seconds: f64,
    transactions: u64,
    per_second: f64,
    p50_us: f64,
    p99_us: f64,
    types: Vec<TypeReport>,
    kills: Vec<KillReport>,
    /// Operations completed per millisecond of the cluster's clock.
    completed_per_ms: Vec<u64>,
    /// The cluster's timeline (reconfiguration and recovery events).
    timeline: serde_json::Value,
}

/// What one client counted.
struct ClientStats {
    hist: Vec<Histogram<u64>>,
    successes: Vec<u64>,
    attempts: Vec<u64>,
    errors: Vec<u64>,
    /// Operations completed per millisecond of the cluster's clock.
    per_ms: Vec<u64>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.subscribers >= 1, "--subscribers must be at least 1");
    anyhow::ensure!(args.seconds > 0.0, "--seconds must be positive");
    anyhow::ensure!(args.clients >= 1, "--clients must be at least 1");
    anyhow::ensure!(
        args.replicas >= 1 && args.replicas <= args.machines,
        "--replicas must be 1 to --machines ({})",
        args.machines
    );
    anyhow::ensure!(args.lease_ms >= 1, "--lease-ms must be at least 1");
    for k in &args.kill {
        if let Some(m) = k.machine {
            anyhow::ensure!(
                m < args.machines,
                "--kill {m}@{}: there are only {} machines",
                k.seconds,
                args.machines
            );
        }
        anyhow::ensure!(
            k.seconds < args.seconds,
            "--kill at {} s comes after the run ({} s)",
            k.seconds,
            args.seconds
        );
    }
    anyhow::ensure!(
        args.kill.len() < args.machines as usize,
        "{} kills would leave no machine",
        args.kill.len()
    );
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .with_writer(std::io::stderr)
        .init();
    // Tables take about 1.5 KB per subscriber at half fill; regions are sparse.
    let region_bytes = ((args.subscribers as usize * 1600 * 3 / args.machines as usize)
        .next_power_of_two())
    .clamp(64 << 20, 1 << 32);
    let cluster = Arc::new(
        Cluster::builder()
            .machines(args.machines)
            .replicas(args.replicas)
            .workers(args.workers)
            .region_bytes(region_bytes)
            .pin_threads(args.pin)
            .lease(Duration::from_millis(args.lease_ms))
            .build()
            .context("building the cluster")?,
    );
    let started = Instant::now();
    let tables = Arc::new(Tables::create(&cluster, args.subscribers).context("creating tables")?);
    let bar = indicatif::ProgressBar::new(args.subscribers as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "populating {bar:40} {pos}/{len} subscribers ({per_sec}, {eta} left)",
        )
        .expect("template"),
    );
    let machines = args.machines as usize;
    let loaders = args.clients.min(args.machines) as usize;
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..loaders)
            .map(|l| {
                let (cluster, tables, bar) = (&cluster, &tables, &bar);
                s.spawn(move || -> anyhow::Result<()> {
                    for p in (l..machines).step_by(loaders) {
                        tables
                            .populate_partition(cluster, p, 8, args.seed, &|n| bar.inc(n))
                            .with_context(|| format!("populating partition {p}"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().expect("loader panicked")?;
        }
        Ok(())
    })?;
    bar.finish_and_clear();
    let populate_seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "populated {} subscribers in {populate_seconds:.1} s",
        args.subscribers
    );

    let stop = Arc::new(AtomicBool::new(false));
    let barrier = Arc::new(Barrier::new(args.clients as usize + 1));
    let clients: Vec<_> = (0..args.clients)
        .map(|c| {
            let (cluster, tables, stop, barrier) = (
                cluster.clone(),
                tables.clone(),
                stop.clone(),
                barrier.clone(),
            );
            let (seed, partitioned) = (args.seed, args.partitioned);
            let core = args
                .pin
                .then(|| core_affinity::get_core_ids().unwrap_or_default())
                .and_then(|cores| cores.get(c as usize % cores.len().max(1)).copied());
            std::thread::spawn(move || {
                if let Some(core) = core {
                    core_affinity::set_for_current(core);
                }
                client(&cluster, &tables, c, seed, partitioned, &stop, &barrier)
            })
        })
        .collect();
    barrier.wait();
    let t0 = Instant::now();
    let mut kills = args.kill.clone();
    kills.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
    let mut killed: Vec<(MachineId, u64)> = Vec::new();
    for k in kills {
        let due = t0 + Duration::from_secs_f64(k.seconds);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        let victim = match k.machine {
            Some(m) => MachineId(m),
            None => {
                let alive = (0..args.machines)
                    .map(MachineId)
                    .find(|m| !killed.iter().any(|(k, _)| k == m))
                    .expect("a machine is alive");
                cluster.view(alive).config.cm
            }
        };
        eprintln!("killing {victim} at {:.3} s", t0.elapsed().as_secs_f64());
        killed.push((victim, cluster.now_us()));
        cluster.kill(victim);
    }
    std::thread::sleep(
        (t0 + Duration::from_secs_f64(args.seconds)).saturating_duration_since(Instant::now()),
    );
    stop.store(true, Ordering::Relaxed);
    let elapsed = t0.elapsed().as_secs_f64();
    let mut all: Vec<ClientStats> = Vec::new();
    for h in clients {
        all.push(h.join().expect("client panicked")?);
    }

    let mut overall = Histogram::<u64>::new(3)?;
    let mut types = Vec::new();
    for (i, kind) in Kind::ALL.into_iter().enumerate() {
        let mut h = Histogram::<u64>::new(3)?;
        for c in &all {
            h.add(&c.hist[i])?;
        }
        overall.add(&h)?;
        let count = h.len();
        let attempts: u64 = all.iter().map(|c| c.attempts[i]).sum();
        types.push(TypeReport {
            name: kind.name(),
            mix_percent: kind.percent(),
            count,
            successes: all.iter().map(|c| c.successes[i]).sum(),
            aborts: attempts.saturating_sub(count),
            errors: all.iter().map(|c| c.errors[i]).sum(),
            p50_us: h.value_at_quantile(0.5) as f64 / 1000.0,
            p99_us: h.value_at_quantile(0.99) as f64 / 1000.0,
            p999_us: h.value_at_quantile(0.999) as f64 / 1000.0,
        });
    }
    let transactions = overall.len();
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
    let kill_reports: Vec<KillReport> = killed
        .iter()
        .map(|&(victim, at_us)| kill_report(&tl, &per_ms, victim, at_us))
        .collect();
    let report = Report {
        subscribers: args.subscribers,
        machines: args.machines,
        replicas: args.replicas,
        workers: args.workers,
        clients: args.clients,
        partitioned: args.partitioned,
        seconds: elapsed,
        populate_seconds,
        transactions,
        per_second: transactions as f64 / elapsed,
        p50_us: overall.value_at_quantile(0.5) as f64 / 1000.0,
        p99_us: overall.value_at_quantile(0.99) as f64 / 1000.0,
        types,
        kills: kill_reports,
        completed_per_ms: per_ms.clone(),
        timeline: serde_json::from_str(&tl.to_json())?,
    };
    print_report(&report);
    if let Some(path) = &args.chart {
        let mut marks = timeline::markers(&tl);
        for (victim, at_us) in &killed {
            marks.push(Marker {
                at_us: *at_us,
                label: format!("kill {victim}"),
            });
        }
        marks.sort_by_key(|m| m.at_us);
        let start_ms = (per_ms.iter().position(|n| *n > 0).unwrap_or(0) + 1).min(per_ms.len());
        let title = format!(
            "TATP, {} machines, {}-way replication, {} ms leases: operations per ms",
            args.machines, args.replicas, args.lease_ms
        );
        timeline::draw(
            path,
            &title,
            &per_ms[..per_ms.len().saturating_sub(1)],
            start_ms,
            &marks,
        )
        .with_context(|| format!("drawing {}", path.display()))?;
        println!("chart written to {}", path.display());
    }
    if args.check {
        let t = Instant::now();
        let reader = (0..args.machines)
            .map(MachineId)
            .find(|m| !killed.iter().any(|(k, _)| k == m))
            .expect("a machine is alive");
        let cfs = tables
            .check(&cluster, reader)
            .map_err(|e| anyhow::anyhow!("integrity check failed: {e}"))?;
        println!(
            "integrity check passed: {} subscribers, {cfs} call forwardings ({:.1} s)",
            args.subscribers,
            t.elapsed().as_secs_f64()
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// One client: draws transactions from the mix until told to stop, timing each.
fn client(
    cluster: &Cluster,
    tables: &Tables,
    id: u16,
    seed: u64,
    partitioned: bool,
    stop: &AtomicBool,
    barrier: &Barrier,
) -> anyhow::Result<ClientStats> {
    let n = Kind::ALL.len();
    let mut stats = ClientStats {
        hist: (0..n)
            .map(|_| Histogram::new(3))
            .collect::<Result<_, _>>()?,
        successes: vec![0; n],
        attempts: vec![0; n],
        errors: vec![0; n],
        per_ms: Vec::new(),
    };
    let mut rng = Rand::new(seed.wrapping_mul(1_000_003) ^ (id as u64 + 1) << 40);
    let machines = cluster.machines() as u64;
    // Machines found dead or evicted: transactions go elsewhere.
    let mut down = vec![false; machines as usize];
    // Back-to-back transactions: keep one host rather than hand it to a poller in between.
    let session = cluster.session();
    barrier.wait();
    while !stop.load(Ordering::Relaxed) {
        let kind = Kind::from_draw(rng.next_u64() % 100);
        let i = kind as usize;
        let pick = rng.next_u64();
        let m = if partitioned && !down.iter().any(|d| *d) {
            None
        } else {
            let alive: Vec<u16> = (0..machines as u16)
                .filter(|m| !down[*m as usize])
                .collect();
            Some(MachineId(alive[(pick % alive.len() as u64) as usize]))
        };
        let t = Instant::now();
        let result = tables.run(&session, m, kind, &mut rng, &mut stats.attempts[i]);
        let ns = t.elapsed().as_nanos() as u64;
        match result {
            Ok(ok) => {
                stats.successes[i] += ok as u64;
                stats.hist[i].record(ns.max(1))?;
                let ms = (cluster.now_us() / 1000) as usize;
                if stats.per_ms.len() <= ms {
                    stats.per_ms.resize(ms + 1, 0);
                }
                stats.per_ms[ms] += 1;
            }
            // The coordinator died or was removed under the transaction: go elsewhere.
            Err(TxError::CoordinatorFailed(d) | TxError::Evicted(d)) => {
                stats.errors[i] += 1;
                down[d.0 as usize] = true;
            }
            Err(e) if e.is_retryable() => stats.errors[i] += 1,
            Err(e) => anyhow::bail!("{} failed: {e}", kind.name()),
        }
    }
    Ok(stats)
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
    let kill_ms = (at_us / 1000) as usize;
    let before = timeline::mean_before(per_ms, kill_ms, 100);
    let back = match (suspect, before) {
        (Some(s), Some(b)) => timeline::back_to(per_ms, (s / 1000) as usize, b, 0.8)
            .map(|ms| (ms as u64 * 1000).saturating_sub(s)),
        _ => None,
    };
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
        throughput_before_per_ms: before,
        suspect_to_80_percent_ms: back.map(ms),
        suspect_to_rereplicated_ms: suspect
            .zip(rereplicated)
            .map(|(s, r)| ms(r.saturating_sub(s))),
    }
}

fn print_report(r: &Report) {
    println!(
        "TATP: {} subscribers, {} machines x {} workers, {}-way replication, {} clients{}",
        r.subscribers,
        r.machines,
        r.workers,
        r.replicas,
        r.clients,
        if r.partitioned { ", partitioned" } else { "" }
    );
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
}
