//! Micro-benchmarks of the in-process 3-machine, 3-replica cluster: lock-free 64-byte reads
//! (local and remote), single-object read-modify-write transactions, and transactions of 4 reads
//! and 2 writes spread over the machines. Prints a summary with p50/p99/p99.9 latencies and can
//! write JSON.
//!
//! `cargo run --release -p farm-benchmarks --bin micro -- --seconds 3 --json micro.json`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use farm::{Addr, Cluster, MachineId};
use hdrhistogram::Histogram;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "farm-rs micro-benchmarks on an in-process cluster")]
struct Args {
    /// Seconds per workload.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Client threads (each takes its own host).
    #[arg(long, default_value_t = 2)]
    threads: u16,
    /// 64-byte objects per machine.
    #[arg(long, default_value_t = 10_000)]
    objects: usize,
    /// Write results as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Pin host threads to cores.
    #[arg(long)]
    pin: bool,
}

type Obj = [u64; 8];

#[derive(Serialize, Debug)]
struct Result_ {
    workload: &'static str,
    ops: u64,
    seconds: f64,
    ops_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    aborts: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.seconds > 0.0,
        "--seconds must be positive, got {}",
        args.seconds
    );
    anyhow::ensure!(args.threads >= 1, "--threads must be at least 1");
    let cluster = Arc::new(
        Cluster::builder()
            .machines(3)
            .workers(args.threads)
            .replicas(3)
            .region_bytes(256 << 20)
            .pin_threads(args.pin)
            .build()?,
    );
    // objects[m] are objects whose primary is machine m.
    let mut objects: Vec<Vec<Addr>> = vec![Vec::new(); 3];
    for m in 0..3u16 {
        for i in 0..args.objects {
            let a = cluster
                .txn(MachineId(m), |tx| tx.alloc(&[i as u64; 8], None))
                .with_context(|| format!("populating machine {m}"))?;
            objects[m as usize].push(a);
        }
    }
    cluster.quiesce();
    let objects = Arc::new(objects);
    println!(
        "in-process cluster: 3 machines x {} workers, 3-way replication; {} objects of 64 bytes per machine; {} client threads, {:.1}s per workload",
        args.threads, args.objects, args.threads, args.seconds
    );
    let mut results = Vec::new();
    for workload in [
        "lock-free-read-local",
        "lock-free-read-remote",
        "rmw-1",
        "txn-4r-2w",
    ] {
        let before = cluster.stats().aborts();
        let r = run(&cluster, &objects, workload, &args)?;
        let aborts = cluster.stats().aborts() - before;
        let res = Result_ { aborts, ..r };
        println!(
            "{:<24} {:>12.0} ops/s   p50 {:>7.2} us   p99 {:>7.2} us   p99.9 {:>7.2} us   aborts {}",
            res.workload, res.ops_per_sec, res.p50_us, res.p99_us, res.p999_us, res.aborts
        );
        results.push(res);
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn run(
    cluster: &Arc<Cluster>,
    objects: &Arc<Vec<Vec<Addr>>>,
    workload: &'static str,
    args: &Args,
) -> anyhow::Result<Result_> {
    let stop = Arc::new(AtomicBool::new(false));
    let barrier = Arc::new(Barrier::new(args.threads as usize + 1));
    let handles: Vec<_> = (0..args.threads as u64)
        .map(|t| {
            let (cluster, objects, stop, barrier) = (
                cluster.clone(),
                objects.clone(),
                stop.clone(),
                barrier.clone(),
            );
            std::thread::spawn(move || -> anyhow::Result<(u64, Histogram<u64>)> {
                let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
                let mut x = 0x2545_f491_4f6c_dd1d ^ (t + 1);
                let mut rand = move || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                let n = objects[0].len() as u64;
                let mut ops = 0u64;
                barrier.wait();
                while !stop.load(Ordering::Relaxed) {
                    for i in 0..64u32 {
                        let m = (rand() % 3) as u16;
                        // Reads take ~100 ns, comparable to reading the clock twice: time every
                        // 8th read (a uniform sample) and every transaction.
                        let timed = i % 8 == 0 || !workload.starts_with("lock-free");
                        let start = timed.then(Instant::now);
                        match workload {
                            "lock-free-read-local" => {
                                let a = objects[m as usize][(rand() % n) as usize];
                                let v: Obj = cluster.read(MachineId(m), a)?;
                                std::hint::black_box(v);
                            }
                            "lock-free-read-remote" => {
                                let a = objects[((m + 1) % 3) as usize][(rand() % n) as usize];
                                let v: Obj = cluster.read(MachineId(m), a)?;
                                std::hint::black_box(v);
                            }
                            "rmw-1" => {
                                let a = objects[(rand() % 3) as usize][(rand() % n) as usize];
                                cluster.txn(MachineId(m), |tx| {
                                    let mut v: Obj = tx.read(a)?;
                                    v[0] += 1;
                                    tx.write(a, &v)
                                })?;
                            }
                            _ => {
                                let addrs: Vec<Addr> = (0..4)
                                    .map(|i| {
                                        objects[((m as u64 + i) % 3) as usize]
                                            [(rand() % n) as usize]
                                    })
                                    .collect();
                                cluster.txn(MachineId(m), |tx| {
                                    let mut vs = Vec::with_capacity(4);
                                    for a in &addrs {
                                        vs.push(tx.read::<Obj>(*a)?);
                                    }
                                    for (a, v) in addrs.iter().zip(&mut vs).take(2) {
                                        v[1] += 1;
                                        tx.write(*a, v)?;
                                    }
                                    Ok(())
                                })?;
                            }
                        }
                        if let Some(start) = start {
                            hist.saturating_record(start.elapsed().as_nanos() as u64);
                        }
                        ops += 1;
                    }
                }
                Ok((ops, hist))
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    for h in handles {
        let (ops, h) = h.join().expect("client thread panicked")?;
        total += ops;
        hist.add(h)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    Ok(Result_ {
        workload,
        ops: total,
        seconds,
        ops_per_sec: total as f64 / seconds,
        p50_us: us(0.5),
        p99_us: us(0.99),
        p999_us: us(0.999),
        aborts: 0,
    })
}
