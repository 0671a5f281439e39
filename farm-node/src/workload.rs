//! TATP run by every machine process of a cluster (`farm_benchmarks::tatp`): machine 0 creates
//! the tables (each machine's buckets in its own regions) and publishes their roots in
//! ZooKeeper; every machine opens them, loads its own subscribers, waits for the others, then
//! runs the mix from its client threads for the run's length, every transaction coordinated on
//! this machine, and publishes its result (`tatp-result-m<id>`) for the launcher.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use farm::node::Node;
use farm::zk::ZkStore;
use farm::{Addr, TxError};
use farm_benchmarks::tatp::{Kind, Tables};
use farm_benchmarks::Rand;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// A TATP run.
#[derive(clap::Args, Debug, Clone)]
pub struct TatpArgs {
    /// Subscribers in the database.
    #[arg(long, default_value_t = 20_000)]
    pub subscribers: u32,
    /// Seconds of measured run.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Client threads per machine.
    #[arg(long, default_value_t = 1)]
    pub clients: u16,
    /// Seed of the population and of the clients' inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Machine 0 checks the database's integrity after the run.
    #[arg(long)]
    pub check: bool,
}

/// What one machine measured.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct TatpResult {
    pub machine: u16,
    pub seconds: f64,
    /// Transactions finished (found or not, as the specification counts them).
    pub transactions: u64,
    /// Executions, retries included.
    pub executions: u64,
    /// Transactions that failed with an error.
    pub errors: u64,
    /// Latency percentiles of finished transactions, in microseconds.
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// Call forwardings the integrity check counted (machine 0 with `--check`).
    pub checked_call_forwardings: Option<u64>,
}

/// How long a machine waits for the others at each step.
const STEP_WAIT: Duration = Duration::from_secs(300);

fn wait_for(store: &ZkStore, name: &str) -> anyhow::Result<Vec<u8>> {
    let started = Instant::now();
    loop {
        if let Some(data) = store.get(name)? {
            return Ok(data);
        }
        if started.elapsed() > STEP_WAIT {
            bail!("{name} did not appear in ZooKeeper within {STEP_WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs TATP on this machine as described in the module docs; returns its result.
pub fn tatp(node: &Node, store: &ZkStore, args: &TatpArgs) -> anyhow::Result<TatpResult> {
    if args.subscribers == 0 || args.clients == 0 || args.seconds.is_nan() || args.seconds <= 0.0 {
        bail!("TATP needs at least one subscriber, one client and a positive run length");
    }
    let me = node.id();
    let machines = node.configuration().members.len() as u16;
    let tables = if me.0 == 0 {
        let tables = Tables::create(node, args.subscribers).context("creating the tables")?;
        let roots: Vec<u8> = tables
            .roots()
            .iter()
            .flat_map(|a| a.to_u64().to_le_bytes())
            .collect();
        store.put("tatp-roots", &roots)?;
        tables
    } else {
        let bytes = wait_for(store, "tatp-roots")?;
        if bytes.len() != 40 {
            bail!("tatp-roots holds {} bytes, not five addresses", bytes.len());
        }
        let roots: [Addr; 5] = std::array::from_fn(|i| {
            Addr::from_u64(u64::from_le_bytes(
                bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"),
            ))
        });
        Tables::open(node, me, args.subscribers, roots).context("opening the tables")?
    };
    let started = Instant::now();
    tables
        .populate_partition(node, me.0 as usize, 8, args.seed, &|_| {})
        .context("loading this machine's subscribers")?;
    tracing::info!(
        machine = me.0,
        seconds = started.elapsed().as_secs_f64(),
        "subscribers loaded"
    );
    store.put(&format!("tatp-loaded-m{}", me.0), b"")?;
    for m in 0..machines {
        wait_for(store, &format!("tatp-loaded-m{m}"))?;
    }
    let stop = AtomicBool::new(false);
    let totals = Mutex::new((Histogram::<u64>::new(3)?, 0u64, 0u64, 0u64));
    let run_started = Instant::now();
    std::thread::scope(|s| {
        for client in 0..args.clients {
            let (tables, stop, totals) = (&tables, &stop, &totals);
            s.spawn(move || {
                let mut rng = Rand::new(args.seed ^ (me.0 as u64) << 40 ^ (client as u64) << 20);
                let mut hist = Histogram::<u64>::new(3).expect("histogram");
                let (mut done, mut executions, mut errors) = (0u64, 0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let kind = Kind::from_draw(rng.next_u64() % 100);
                    let t = Instant::now();
                    match tables.run(node, Some(me), kind, &mut rng, &mut executions) {
                        Ok(_) => {
                            done += 1;
                            let _ = hist.record(t.elapsed().as_nanos() as u64);
                        }
                        Err(TxError::Evicted(_)) => break,
                        Err(_) => errors += 1,
                    }
                }
                let mut t = totals.lock().expect("poisoned");
                t.0.add(&hist).expect("same bounds");
                t.1 += done;
                t.2 += executions;
                t.3 += errors;
            });
        }
        std::thread::sleep(Duration::from_secs_f64(args.seconds));
        stop.store(true, Ordering::Relaxed);
    });
    let seconds = run_started.elapsed().as_secs_f64();
    let (hist, transactions, executions, errors) = totals.into_inner().expect("poisoned");
    let checked_call_forwardings = if args.check && me.0 == 0 {
        let cfs = tables
            .check(node, me)
            .map_err(|e| anyhow::anyhow!("integrity check failed: {e}"))?;
        Some(cfs)
    } else {
        None
    };
    let result = TatpResult {
        machine: me.0,
        seconds,
        transactions,
        executions,
        errors,
        p50_us: hist.value_at_quantile(0.5) as f64 / 1e3,
        p99_us: hist.value_at_quantile(0.99) as f64 / 1e3,
        max_us: hist.max() as f64 / 1e3,
        checked_call_forwardings,
    };
    store.put(
        &format!("tatp-result-m{}", me.0),
        &serde_json::to_vec(&result)?,
    )?;
    Ok(result)
}
