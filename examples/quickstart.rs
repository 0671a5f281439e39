//! Quickstart: a 3-machine in-process cluster with 3-way replication runs concurrent bank
//! transfers for a few seconds, then checks that money was conserved, that every acknowledged
//! transfer is reflected, and that every backup equals its primary. Exits non-zero on any
//! violation.
//!
//! Run: `cargo run --release --example quickstart [-- SECONDS]`

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use farm::{Addr, Cluster, MachineId};

const ACCOUNTS: usize = 1000;
const INITIAL: u64 = 1_000;

fn main() -> anyhow::Result<()> {
    let seconds: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(3);
    let cluster = Arc::new(
        Cluster::builder()
            .machines(3)
            .workers(2)
            .replicas(3)
            .region_bytes(64 << 20)
            .build()?,
    );
    println!("cluster: 3 machines, 2 workers each, 3-way replication; {ACCOUNTS} accounts");
    let accounts: Vec<Addr> = (0..ACCOUNTS)
        .map(|i| {
            let m = MachineId((i % 3) as u16);
            cluster.txn(m, |tx| tx.alloc(&INITIAL, None))
        })
        .collect::<Result<_, _>>()?;
    let accounts = Arc::new(accounts);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..2u64)
        .map(|c| {
            let (cluster, accounts, stop, done) = (
                cluster.clone(),
                accounts.clone(),
                stop.clone(),
                done.clone(),
            );
            std::thread::spawn(move || -> anyhow::Result<Vec<i64>> {
                let mut deltas = vec![0i64; ACCOUNTS];
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ c;
                let mut next = || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                while !stop.load(Ordering::Relaxed) {
                    let (a, b) = (next() as usize % ACCOUNTS, next() as usize % ACCOUNTS);
                    if a == b {
                        continue;
                    }
                    let amount = next() % 50;
                    let coordinator = MachineId((next() % 3) as u16);
                    let moved = cluster.txn(coordinator, |tx| {
                        let from: u64 = tx.read(accounts[a])?;
                        let to: u64 = tx.read(accounts[b])?;
                        if from < amount {
                            return Ok(0);
                        }
                        tx.write(accounts[a], &(from - amount))?;
                        tx.write(accounts[b], &(to + amount))?;
                        Ok(amount)
                    })?;
                    deltas[a] -= moved as i64;
                    deltas[b] += moved as i64;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok(deltas)
            })
        })
        .collect();
    let start = Instant::now();
    let mut last = 0;
    while start.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_secs(1));
        let now = done.load(Ordering::Relaxed);
        println!(
            "[{:>2}s] {:>9} transfers  {:>8} /s",
            start.elapsed().as_secs(),
            now,
            now - last
        );
        last = now;
    }
    stop.store(true, Ordering::Relaxed);
    let mut expected = vec![INITIAL as i64; ACCOUNTS];
    for c in clients {
        let deltas = c.join().expect("client panicked")?;
        for (e, d) in expected.iter_mut().zip(deltas) {
            *e += d;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let total = done.load(Ordering::Relaxed);
    println!(
        "{total} transfers in {elapsed:.1}s: {:.0} transfers/s",
        total as f64 / elapsed
    );
    cluster.quiesce();
    let mut sum = 0u64;
    for (i, a) in accounts.iter().enumerate() {
        let balance: u64 = cluster.read(MachineId(0), *a)?;
        anyhow::ensure!(
            balance as i64 == expected[i],
            "account {i}: balance {balance}, acknowledged transfers say {}",
            expected[i]
        );
        sum += balance;
    }
    anyhow::ensure!(
        sum == INITIAL * ACCOUNTS as u64,
        "money not conserved: {sum}"
    );
    let report = farm_sim::check_replicas(cluster.machine_states()).map_err(anyhow::Error::msg)?;
    let stats = cluster.stats();
    println!(
        "ok: total conserved ({sum}), every acknowledged transfer present, {} objects equal on every backup; {} commits, {} aborts",
        report.objects, stats.commits, stats.aborts()
    );
    Ok(())
}
