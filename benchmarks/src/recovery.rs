//! Recovery timing under load (FaRM §5, Figures 9-11 in miniature): an in-process bank workload
//! runs on a cluster with short leases, a machine is killed, and the run goes on through
//! reconfiguration, transaction state recovery and data recovery. Per run it reports the time
//! from suspicion to the first 5 ms window with at least 80% of the pre-failure throughput, and
//! from suspicion to full re-replication (the last region copied to a new backup), with medians
//! and p99 over the runs; optionally the samples and every run's timeline as JSON.
//!
//! `cargo run --release -p farm-benchmarks --bin recovery -- --runs 20 --lease-ms 10`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use farm::{Addr, Cluster, MachineId, ReconfigEvent};
use farm_benchmarks::{move_one, quantile, xorshift};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Time from a machine's death to recovered throughput and full re-replication")]
struct Args {
    /// Runs (a fresh cluster each).
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// Lease length in milliseconds.
    #[arg(long, default_value_t = 10)]
    lease_ms: u64,
    /// Machines per cluster (the last one is killed; machine 0 is the CM).
    #[arg(long, default_value_t = 4)]
    machines: u16,
    /// Kill the CM instead of the last machine.
    #[arg(long)]
    kill_cm: bool,
    /// Bank accounts per machine.
    #[arg(long, default_value_t = 64)]
    accounts: usize,
    /// Client threads.
    #[arg(long, default_value_t = 2)]
    clients: u64,
    /// Milliseconds of workload before the kill.
    #[arg(long, default_value_t = 400)]
    before_ms: u64,
    /// Milliseconds of workload after the kill.
    #[arg(long, default_value_t = 400)]
    after_ms: u64,
    /// Write the samples, summary and timelines as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Run {
    kill_to_suspect_us: u64,
    /// Mean committed transactions per ms over the 100 ms before the kill.
    before_per_ms: f64,
    suspect_to_80_percent_us: u64,
    suspect_to_rereplicated_us: u64,
    timeline: serde_json::Value,
}

#[derive(Serialize)]
struct Summary {
    runs: usize,
    lease_ms: u64,
    suspect_to_80_percent_median_us: u64,
    suspect_to_80_percent_p99_us: u64,
    suspect_to_rereplicated_median_us: u64,
    suspect_to_rereplicated_p99_us: u64,
    kill_to_suspect_median_us: u64,
    samples: Vec<Run>,
}

/// Window over which recovered throughput is measured.
const WINDOW_MS: usize = 5;

fn one_run(args: &Args, run: usize, victim: MachineId) -> anyhow::Result<Run> {
    let c = Arc::new(
        Cluster::builder()
            .machines(args.machines)
            .workers(2)
            .replicas(3)
            .region_bytes(8 << 20)
            .lease(Duration::from_millis(args.lease_ms))
            .build()?,
    );
    let mut accounts: Vec<Addr> = Vec::new();
    for m in 0..args.machines {
        for _ in 0..args.accounts {
            accounts.push(c.txn(MachineId(m), |tx| tx.alloc(&1_000u64, None))?);
        }
    }
    let accounts = Arc::new(accounts);
    let coordinators: Vec<MachineId> = (0..args.machines)
        .map(MachineId)
        .filter(|m| *m != victim)
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..args.clients)
        .map(|seed| {
            let (c, accounts, stop, coordinators) = (
                c.clone(),
                accounts.clone(),
                stop.clone(),
                coordinators.clone(),
            );
            std::thread::spawn(move || -> Result<(), farm::TxError> {
                let mut rng = xorshift(seed + 1 + run as u64 * 7);
                while !stop.load(Ordering::Relaxed) {
                    let m = coordinators[(rng() % coordinators.len() as u64) as usize];
                    let a = accounts[(rng() % accounts.len() as u64) as usize];
                    let b = accounts[(rng() % accounts.len() as u64) as usize];
                    if a == b {
                        continue;
                    }
                    move_one(&c, m, a, b)?;
                }
                Ok(())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(args.before_ms));
    let killed = c.now_us();
    c.kill(victim);
    std::thread::sleep(Duration::from_millis(args.after_ms));
    // Re-replication may outlast the workload: wait for it (bounded).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c
        .timeline()
        .events
        .iter()
        .any(|e| matches!(e, ReconfigEvent::AllActive { .. }))
        || !c.background_recovery_done()
    {
        if Instant::now() > deadline {
            bail!(
                "run {run}: recovery did not finish in 30 s: {:?}",
                c.reconfig_events()
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    for h in clients {
        h.join().expect("client panicked")?;
    }
    let t = c.timeline();
    let suspect = t
        .events
        .iter()
        .find_map(|e| match e {
            ReconfigEvent::Suspect { machine, at_us } if *machine == victim => Some(*at_us),
            _ => None,
        })
        .context("no suspicion of the victim")?;
    let kill_ms = (killed / 1000) as usize;
    if kill_ms < 100 {
        bail!("run {run}: the kill came before 100 ms of workload");
    }
    let before: f64 = t.committed_per_ms[kill_ms - 100..kill_ms]
        .iter()
        .sum::<u64>() as f64
        / 100.0;
    let suspect_ms = (suspect / 1000) as usize;
    let recovered_ms = (suspect_ms..t.committed_per_ms.len().saturating_sub(WINDOW_MS))
        .find(|&ms| {
            let w: u64 = t.committed_per_ms[ms..ms + WINDOW_MS].iter().sum();
            w as f64 / WINDOW_MS as f64 >= 0.8 * before
        })
        .with_context(|| format!("run {run}: throughput never came back to 80%"))?;
    let rereplicated = t
        .recovery
        .iter()
        .filter_map(|(_, e)| match e {
            farm::RecoveryEvent::DataRecoveryDone { at, .. } => Some(*at),
            _ => None,
        })
        .max()
        .unwrap_or(suspect);
    Ok(Run {
        kill_to_suspect_us: suspect.saturating_sub(killed),
        before_per_ms: before,
        suspect_to_80_percent_us: (recovered_ms as u64 * 1000).saturating_sub(suspect),
        suspect_to_rereplicated_us: rereplicated.saturating_sub(suspect),
        timeline: serde_json::from_str(&t.to_json())?,
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Warnings (a commit that waits for seconds logs its host's recovery state) go to stderr.
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .with_writer(std::io::stderr)
        .init();
    if args.runs == 0 || args.machines < 3 || args.lease_ms == 0 || args.accounts == 0 {
        bail!("need --runs >= 1, --machines >= 3, --lease-ms >= 1 and --accounts >= 1");
    }
    let victim = if args.kill_cm {
        MachineId(0)
    } else {
        MachineId(args.machines - 1)
    };
    let mut samples = Vec::new();
    for run in 0..args.runs {
        samples.push(one_run(&args, run, victim)?);
        eprint!("\rrun {}/{}", run + 1, args.runs);
    }
    eprintln!();
    let sorted = |f: fn(&Run) -> u64| {
        let mut v: Vec<u64> = samples.iter().map(f).collect();
        v.sort_unstable();
        v
    };
    let back = sorted(|r| r.suspect_to_80_percent_us);
    let copied = sorted(|r| r.suspect_to_rereplicated_us);
    let detect = sorted(|r| r.kill_to_suspect_us);
    let summary = Summary {
        runs: args.runs,
        lease_ms: args.lease_ms,
        suspect_to_80_percent_median_us: quantile(&back, 0.5),
        suspect_to_80_percent_p99_us: quantile(&back, 0.99),
        suspect_to_rereplicated_median_us: quantile(&copied, 0.5),
        suspect_to_rereplicated_p99_us: quantile(&copied, 0.99),
        kill_to_suspect_median_us: quantile(&detect, 0.5),
        samples,
    };
    let before: Vec<f64> = summary.samples.iter().map(|r| r.before_per_ms).collect();
    println!(
        "{} runs, {} ms leases, killing {} ({:.0} txn/ms before): suspicion -> 80% throughput median {:.1} ms, p99 {:.1} ms; suspicion -> re-replicated median {:.1} ms, p99 {:.1} ms; kill -> suspicion median {:.1} ms",
        summary.runs,
        summary.lease_ms,
        if args.kill_cm { "the CM" } else { "a member" },
        before.iter().sum::<f64>() / before.len() as f64,
        summary.suspect_to_80_percent_median_us as f64 / 1000.0,
        summary.suspect_to_80_percent_p99_us as f64 / 1000.0,
        summary.suspect_to_rereplicated_median_us as f64 / 1000.0,
        summary.suspect_to_rereplicated_p99_us as f64 / 1000.0,
        summary.kill_to_suspect_median_us as f64 / 1000.0,
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
