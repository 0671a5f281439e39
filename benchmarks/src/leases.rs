//! False-positive lease expiries (the experiment of FaRM's Figure 16): an in-process cluster
//! runs transfers on every core while leases of 5, 10 and 50 ms are renewed; no machine fails,
//! so every suspicion is a false positive. Reconfiguration is off so that a false positive is
//! counted rather than acted on. Prints a table and can write JSON.
//!
//! `cargo run --release -p farm-benchmarks --bin leases -- --seconds 20`

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use farm::{Cluster, MachineId};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "False-positive lease expiries per minute under a busy workload")]
struct Args {
    /// Seconds per lease length.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Lease lengths in milliseconds.
    #[arg(long, value_delimiter = ',', default_value = "5,10,50")]
    leases_ms: Vec<u64>,
    /// Client threads keeping the cores busy.
    #[arg(long, default_value_t = 2)]
    clients: u64,
    /// Write the table as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Row {
    lease_ms: u64,
    seconds: f64,
    transactions: u64,
    false_positives: usize,
    false_positives_per_minute: f64,
    /// Every false positive: (observer, suspect, microseconds since the cluster started).
    suspicions: Vec<(u16, u16, u64)>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.seconds == 0 || args.leases_ms.contains(&0) {
        bail!("--seconds and every lease must be positive");
    }
    let mut rows = Vec::new();
    for &lease_ms in &args.leases_ms {
        let c = Arc::new(
            Cluster::builder()
                .machines(3)
                .workers(2)
                .replicas(3)
                .region_bytes(16 << 20)
                .lease(Duration::from_millis(lease_ms))
                .reconfigure(false)
                .build()?,
        );
        let accounts: Vec<_> = (0..300u64)
            .map(|i| c.txn(MachineId((i % 3) as u16), |tx| tx.alloc(&1_000u64, None)))
            .collect::<Result<_, _>>()?;
        let accounts = Arc::new(accounts);
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..args.clients)
            .map(|t| {
                let (c, accounts, stop, done) =
                    (c.clone(), accounts.clone(), stop.clone(), done.clone());
                std::thread::spawn(move || -> anyhow::Result<()> {
                    let mut x = t + 1;
                    while !stop.load(Ordering::Relaxed) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let (a, b) = (
                            accounts[(x % 300) as usize],
                            accounts[((x >> 20) % 300) as usize],
                        );
                        if a == b {
                            continue;
                        }
                        c.txn(MachineId((x % 3) as u16), |tx| {
                            let va: u64 = tx.read(a)?;
                            let vb: u64 = tx.read(b)?;
                            if va == 0 {
                                return Ok(());
                            }
                            tx.write(a, &(va - 1))?;
                            tx.write(b, &(vb + 1))
                        })?;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                })
            })
            .collect();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(args.seconds) {
            std::thread::sleep(Duration::from_secs(1));
            eprint!(
                "\r{lease_ms} ms leases: {:>3}/{} s, {} suspicions",
                start.elapsed().as_secs(),
                args.seconds,
                c.suspicions().len()
            );
        }
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().expect("client panicked")?;
        }
        eprintln!();
        let seconds = start.elapsed().as_secs_f64();
        let suspicions: Vec<(u16, u16, u64)> = c
            .suspicions()
            .iter()
            .map(|x| (x.observer.0, x.suspect.0, x.at_us))
            .collect();
        let false_positives = suspicions.len();
        rows.push(Row {
            lease_ms,
            seconds,
            transactions: done.load(Ordering::Relaxed),
            false_positives,
            false_positives_per_minute: false_positives as f64 * 60.0 / seconds,
            suspicions,
        });
    }
    println!(
        "{:>9} {:>9} {:>14} {:>16} {:>12}",
        "lease ms", "seconds", "transactions", "false positives", "per minute"
    );
    for r in &rows {
        println!(
            "{:>9} {:>9.1} {:>14} {:>16} {:>12.2}",
            r.lease_ms, r.seconds, r.transactions, r.false_positives, r.false_positives_per_minute
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
