//! Whole-cluster restart timing: an in-process bank workload runs on a cluster whose NVRAM is
//! in files, every machine stops at once in the middle of it (`Cluster::power_off`), and the
//! cluster restarts on the same directory and store (`ClusterBuilder::restart`). Per run it
//! reports how long the restart's `build()` took (reopening NVRAM, scanning the logs, storing
//! the restart configuration), when a transaction reading every account first committed
//! (every region's locks recovered), and when every machine settled (transaction, data and
//! allocator recovery done), with medians and p99 over the runs; optionally as JSON.
//!
//! `cargo run --release -p farm-benchmarks --bin restart -- --runs 10`

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use farm::{Addr, Cluster, ClusterBuilder, CoordinationStore, EmbeddedStore, MachineId, TxError};
use farm_benchmarks::{move_one, quantile, xorshift};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Time for a cluster to serve again after every machine stopped at once")]
struct Args {
    /// Runs (a fresh cluster and NVRAM directory each).
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Machines per cluster.
    #[arg(long, default_value_t = 3)]
    machines: u16,
    /// Bank accounts per machine.
    #[arg(long, default_value_t = 64)]
    accounts: usize,
    /// Client threads.
    #[arg(long, default_value_t = 2)]
    clients: u64,
    /// Milliseconds of workload before the power goes.
    #[arg(long, default_value_t = 300)]
    before_ms: u64,
    /// Where the runs' NVRAM directories go (default: the system's temporary directory);
    /// each is removed after its run.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Write the samples and summary as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Run {
    transfers_before: usize,
    build_us: u64,
    serving_us: u64,
    settled_us: u64,
    decided_by_recovery: u64,
}

#[derive(Serialize)]
struct Summary {
    runs: usize,
    build_median_us: u64,
    build_p99_us: u64,
    serving_median_us: u64,
    serving_p99_us: u64,
    settled_median_us: u64,
    settled_p99_us: u64,
    samples: Vec<Run>,
}

fn builder(
    args: &Args,
    dir: &std::path::Path,
    store: Arc<dyn CoordinationStore>,
) -> ClusterBuilder {
    Cluster::builder()
        .machines(args.machines)
        .replicas(args.machines.min(3))
        .region_bytes(64 << 20)
        .nvram_dir(dir)
        .store(store)
}

/// Transfers until the power goes; returns how many were acknowledged.
fn workload(c: &Arc<Cluster>, accounts: &Arc<Vec<Addr>>, args: &Args) -> usize {
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..args.clients)
        .map(|seed| {
            let (c, accounts, stop) = (c.clone(), accounts.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut done = 0;
                let mut rng = xorshift(seed);
                while !stop.load(Ordering::Relaxed) {
                    let x = rng();
                    let n = accounts.len() as u64;
                    let (a, b) = (x % n, (x / n) % n);
                    if a == b {
                        continue;
                    }
                    let m = MachineId((x % c.machines() as u64) as u16);
                    let (from, to) = (accounts[a as usize], accounts[b as usize]);
                    let r = move_one(&c, m, from, to);
                    match r {
                        Ok(()) => done += 1,
                        Err(TxError::CoordinatorFailed(_)) => break,
                        Err(e) => panic!("transfer failed: {e}"),
                    }
                }
                done
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(args.before_ms));
    c.power_off();
    stop.store(true, Ordering::Relaxed);
    clients.into_iter().map(|h| h.join().unwrap()).sum()
}

fn one_run(args: &Args, run: usize) -> anyhow::Result<Run> {
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("farm-restart-bench-{}-{run}", std::process::id()));
    if dir.exists() {
        bail!("{} exists already", dir.display());
    }
    let store: Arc<dyn CoordinationStore> = Arc::new(EmbeddedStore::new());
    let c = Arc::new(builder(args, &dir, store.clone()).build()?);
    let mut accounts = Vec::new();
    for m in 0..args.machines {
        for _ in 0..args.accounts {
            accounts.push(c.txn(MachineId(m), |tx| tx.alloc(&1_000u64, None))?);
        }
    }
    let accounts = Arc::new(accounts);
    let total = 1_000 * accounts.len() as u64;
    let transfers_before = workload(&c, &accounts, args);
    drop(Arc::into_inner(c).context("clients are gone")?);
    let start = Instant::now();
    let c = builder(args, &dir, store).restart().build()?;
    let build_us = start.elapsed().as_micros() as u64;
    let sum: u64 = c
        .txn(MachineId(0), |tx| {
            accounts.iter().map(|a| tx.read::<u64>(*a)).sum()
        })
        .context("reading every account after the restart")?;
    let serving_us = start.elapsed().as_micros() as u64;
    if sum != total {
        bail!("run {run}: the accounts hold {sum} after the restart, not {total}");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !c.machine_states().iter().all(|m| {
        let v = m.view();
        !v.config.contains(m.id) || m.settled_config() == v.config.id
    }) {
        if Instant::now() > deadline {
            bail!("run {run}: recovery did not settle within a minute");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let settled_us = start.elapsed().as_micros() as u64;
    let stats = c.stats();
    drop(c);
    std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    Ok(Run {
        transfers_before,
        build_us,
        serving_us,
        settled_us,
        decided_by_recovery: stats.recovered_commits + stats.recovered_aborts,
    })
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .init();
    let args = Args::parse();
    if args.runs == 0 || args.machines == 0 || args.accounts == 0 {
        bail!("--runs, --machines and --accounts must be at least 1");
    }
    let mut samples = Vec::new();
    for run in 0..args.runs {
        let r = one_run(&args, run)?;
        println!(
            "run {run}: {} transfers, then restart build {:.1} ms, serving {:.1} ms, settled {:.1} ms ({} transactions decided by recovery)",
            r.transfers_before,
            r.build_us as f64 / 1000.0,
            r.serving_us as f64 / 1000.0,
            r.settled_us as f64 / 1000.0,
            r.decided_by_recovery
        );
        samples.push(r);
    }
    let sorted = |f: fn(&Run) -> u64| {
        let mut v: Vec<u64> = samples.iter().map(f).collect();
        v.sort_unstable();
        v
    };
    let (b, s, t) = (
        sorted(|r| r.build_us),
        sorted(|r| r.serving_us),
        sorted(|r| r.settled_us),
    );
    let summary = Summary {
        runs: args.runs,
        build_median_us: quantile(&b, 0.5),
        build_p99_us: quantile(&b, 0.99),
        serving_median_us: quantile(&s, 0.5),
        serving_p99_us: quantile(&s, 0.99),
        settled_median_us: quantile(&t, 0.5),
        settled_p99_us: quantile(&t, 0.99),
        samples,
    };
    println!(
        "{} runs: restart build median {:.1} ms (p99 {:.1}), serving median {:.1} ms (p99 {:.1}), settled median {:.1} ms (p99 {:.1})",
        summary.runs,
        summary.build_median_us as f64 / 1000.0,
        summary.build_p99_us as f64 / 1000.0,
        summary.serving_median_us as f64 / 1000.0,
        summary.serving_p99_us as f64 / 1000.0,
        summary.settled_median_us as f64 / 1000.0,
        summary.settled_p99_us as f64 / 1000.0
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
