//! Reconfiguration timing (FaRM §5.1-5.2): an in-process cluster with short leases loses a
//! machine; reports the time from suspicion to NEW-CONFIG-COMMIT (and from the kill to
//! suspicion) over many runs, with median and p99, as text and optionally JSON.
//!
//! `cargo run --release -p farm-benchmarks --bin reconfig -- --runs 20 --lease-ms 10`

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use farm::{Cluster, MachineId, ReconfigEvent};
use farm_benchmarks::quantile;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Time from a machine's death to a committed configuration without it")]
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
    /// Write the samples and summary as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Run {
    kill_to_suspect_us: u64,
    suspect_to_commit_us: u64,
}

#[derive(Serialize)]
struct Summary {
    runs: usize,
    lease_ms: u64,
    suspect_to_commit_median_us: u64,
    suspect_to_commit_p99_us: u64,
    kill_to_suspect_median_us: u64,
    kill_to_suspect_p99_us: u64,
    samples: Vec<Run>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.runs == 0 || args.machines < 3 || args.lease_ms == 0 {
        bail!("need --runs >= 1, --machines >= 3 and --lease-ms >= 1");
    }
    let victim = if args.kill_cm {
        MachineId(0)
    } else {
        MachineId(args.machines - 1)
    };
    let mut samples = Vec::new();
    for run in 0..args.runs {
        let c = Cluster::builder()
            .machines(args.machines)
            .workers(2)
            .replicas(3)
            .region_bytes(4 << 20)
            .lease(Duration::from_millis(args.lease_ms))
            .build()?;
        // Let every lease be granted and renewed a few times first.
        std::thread::sleep(Duration::from_millis(5 * args.lease_ms));
        if !c.suspicions().is_empty() {
            bail!(
                "run {run}: a false suspicion before the kill: {:?}",
                c.suspicions()
            );
        }
        let killed = c.now_us();
        c.kill(victim);
        let deadline = Instant::now() + Duration::from_secs(30);
        let (suspect, commit) = loop {
            let ev = c.reconfig_events();
            let suspect = ev.iter().find_map(|e| match e {
                ReconfigEvent::Suspect { machine, at_us } if *machine == victim => Some(*at_us),
                _ => None,
            });
            let commit = ev.iter().find_map(|e| match e {
                ReconfigEvent::Committed { at_us, .. } => Some(*at_us),
                _ => None,
            });
            if let (Some(s), Some(k)) = (suspect, commit) {
                break (s, k);
            }
            if Instant::now() > deadline {
                bail!("run {run}: no committed configuration within 30 s: {ev:?}");
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        samples.push(Run {
            kill_to_suspect_us: suspect.saturating_sub(killed),
            suspect_to_commit_us: commit - suspect,
        });
        eprint!("\rrun {}/{}", run + 1, args.runs);
    }
    eprintln!();
    let mut commit: Vec<u64> = samples.iter().map(|s| s.suspect_to_commit_us).collect();
    let mut detect: Vec<u64> = samples.iter().map(|s| s.kill_to_suspect_us).collect();
    commit.sort_unstable();
    detect.sort_unstable();
    let summary = Summary {
        runs: args.runs,
        lease_ms: args.lease_ms,
        suspect_to_commit_median_us: quantile(&commit, 0.5),
        suspect_to_commit_p99_us: quantile(&commit, 0.99),
        kill_to_suspect_median_us: quantile(&detect, 0.5),
        kill_to_suspect_p99_us: quantile(&detect, 0.99),
        samples,
    };
    println!(
        "{} runs, {} ms leases, killing {}: suspicion -> NEW-CONFIG-COMMIT median {:.2} ms, p99 {:.2} ms; kill -> suspicion median {:.2} ms, p99 {:.2} ms",
        summary.runs,
        summary.lease_ms,
        if args.kill_cm { "the CM" } else { "a member" },
        summary.suspect_to_commit_median_us as f64 / 1000.0,
        summary.suspect_to_commit_p99_us as f64 / 1000.0,
        summary.kill_to_suspect_median_us as f64 / 1000.0,
        summary.kill_to_suspect_p99_us as f64 / 1000.0,
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
