//! TATP on an in-process cluster (see `farm_benchmarks::tatp`): populates the database with a
//! progress bar, runs the standard mix from client threads for a while, and reports throughput,
//! and per transaction type the count, successes, aborts (retried executions) and latency
//! percentiles; optionally checks the database afterwards and writes JSON.
//!
//! `cargo run --release -p farm-benchmarks --bin tatp -- --subscribers 100000 --seconds 5`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use farm::{Cluster, MachineId};
use farm_benchmarks::tatp::{Kind, Rand, Tables};
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
}

/// What one client counted.
struct ClientStats {
    hist: Vec<Histogram<u64>>,
    successes: Vec<u64>,
    attempts: Vec<u64>,
    errors: Vec<u64>,
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
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    stop.store(true, Ordering::Relaxed);
    let mut all: Vec<ClientStats> = Vec::new();
    for h in clients {
        all.push(h.join().expect("client panicked")?);
    }
    let elapsed = t0.elapsed().as_secs_f64();

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
    };
    print_report(&report);
    if args.check {
        let t = Instant::now();
        let cfs = tables
            .check(&cluster)
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
    };
    let mut rng = Rand::new(seed.wrapping_mul(1_000_003) ^ (id as u64 + 1) << 40);
    let machines = cluster.machines() as u64;
    // Back-to-back transactions: keep one host rather than hand it to a poller in between.
    let session = cluster.session();
    barrier.wait();
    while !stop.load(Ordering::Relaxed) {
        let kind = Kind::from_draw(rng.next_u64() % 100);
        let i = kind as usize;
        let m = (!partitioned).then(|| MachineId((rng.next_u64() % machines) as u16));
        let t = Instant::now();
        let result = tables.run(&session, m, kind, &mut rng, &mut stats.attempts[i]);
        let ns = t.elapsed().as_nanos() as u64;
        match result {
            Ok(ok) => {
                stats.successes[i] += ok as u64;
                stats.hist[i].record(ns.max(1))?;
            }
            Err(e) => {
                stats.errors[i] += 1;
                if !e.is_retryable() {
                    anyhow::bail!("{} failed: {e}", kind.name());
                }
            }
        }
    }
    Ok(stats)
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
}
