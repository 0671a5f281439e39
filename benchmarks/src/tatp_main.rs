//! TATP on an in-process cluster (see `farm_workloads::tatp`): populates the database with a
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

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use farm::{MachineId, Pipeline, Session, TxError};
use farm_benchmarks::runner::{self, CommonArgs, RunReport, Workload};
use farm_workloads::tatp::{Kind, Tables};
use farm_workloads::Rand;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "TATP on an in-process farm-rs cluster")]
struct Args {
    /// Subscribers in the database.
    #[arg(long, default_value_t = 100_000)]
    subscribers: u32,
    /// Coordinate each transaction on its subscriber's machine (by default on a random
    /// machine, as FaRM ran TATP: "partitionable but we have not partitioned it").
    #[arg(long)]
    partitioned: bool,
    /// Check the database's integrity after the run.
    #[arg(long)]
    check: bool,
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Serialize, Debug)]
struct Report<'a> {
    subscribers: u32,
    machines: u16,
    replicas: u16,
    workers: u16,
    clients: u16,
    partitioned: bool,
    populate_seconds: f64,
    run: &'a RunReport,
}

/// TATP's mix for the runner.
struct Tatp {
    tables: Tables,
    partitioned: bool,
}

impl Tatp {
    /// The next transaction's type, and where it is coordinated (`None`: on its subscriber's
    /// machine), avoiding the machines `down` marks.
    fn pick(&self, rng: &mut Rand, down: &[bool]) -> (Kind, Option<MachineId>) {
        let kind = Kind::from_draw(rng.next_u64() % 100);
        let pick = rng.next_u64();
        let m = if self.partitioned && !down.iter().any(|d| *d) {
            None
        } else {
            Some(runner::pick_alive(down, pick))
        };
        (kind, m)
    }
}

impl Workload for Tatp {
    fn kinds(&self) -> Vec<&'static str> {
        Kind::ALL.iter().map(|k| k.name()).collect()
    }

    fn mix_percent(&self, kind: usize) -> u64 {
        Kind::ALL[kind].percent()
    }

    fn run_one(
        &self,
        session: &Session<'_>,
        _client: usize,
        rng: &mut Rand,
        down: &[bool],
        attempts: &mut u64,
    ) -> (usize, Result<bool, TxError>) {
        let (kind, m) = self.pick(rng, down);
        (
            kind as usize,
            self.tables.run(session, m, kind, rng, attempts),
        )
    }

    fn in_flight_default(&self) -> Option<usize> {
        Some(farm_workloads::IN_FLIGHT_DEFAULT)
    }

    async fn run_one_in(
        &self,
        pipeline: &Pipeline<'_>,
        _client: usize,
        rng: &mut Rand,
        down: &[bool],
        attempts: &mut u64,
    ) -> (usize, Result<bool, TxError>) {
        let (kind, m) = self.pick(rng, down);
        (
            kind as usize,
            self.tables.run_in(pipeline, m, kind, rng, attempts).await,
        )
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.subscribers >= 1, "--subscribers must be at least 1");
    let common = &args.common;
    let opts = common.options()?;
    // Tables take about 1.5 KB per subscriber at half fill; regions are sparse.
    let region_bytes = ((args.subscribers as usize * 1600 * 3 / common.machines as usize)
        .next_power_of_two())
    .clamp(64 << 20, 1 << 32);
    let cluster = common
        .cluster(Some(region_bytes))
        .context("building the cluster")?;
    let started = Instant::now();
    let tables = Tables::create(&cluster, args.subscribers).context("creating tables")?;
    let bar = indicatif::ProgressBar::new(args.subscribers as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "populating {bar:40} {pos}/{len} subscribers ({per_sec}, {eta} left)",
        )
        .expect("template"),
    );
    let partitions: Vec<usize> = (0..common.machines as usize).collect();
    runner::load_in_parallel(&partitions, common.clients as usize, |&p| {
        tables
            .populate_partition(&cluster, p, 8, common.seed, &|n| bar.inc(n))
            .with_context(|| format!("populating partition {p}"))
    })?;
    bar.finish_and_clear();
    let populate_seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "populated {} subscribers in {populate_seconds:.1} s",
        args.subscribers
    );
    let workload = Arc::new(Tatp {
        tables,
        partitioned: args.partitioned,
    });
    let run = runner::run(&cluster, &workload, &opts)?;
    println!(
        "TATP: {} subscribers, {} machines x {} workers, {}-way replication, {} clients{}",
        args.subscribers,
        common.machines,
        common.workers,
        common.replicas,
        common.clients,
        if args.partitioned {
            ", partitioned"
        } else {
            ""
        }
    );
    runner::print(&run);
    if let Some(path) = &common.chart {
        let title = format!(
            "TATP, {} machines, {}-way replication, {} ms leases: operations per ms",
            common.machines, common.replicas, common.lease_ms
        );
        runner::chart(path, &title, &cluster, &run)
            .with_context(|| format!("drawing {}", path.display()))?;
        println!("chart written to {}", path.display());
    }
    if args.check {
        let t = Instant::now();
        let cfs = workload
            .tables
            .check(&cluster, run.survivor(&cluster))
            .map_err(|e| anyhow::anyhow!("integrity check failed: {e}"))?;
        println!(
            "integrity check passed: {} subscribers, {cfs} call forwardings ({:.1} s)",
            args.subscribers,
            t.elapsed().as_secs_f64()
        );
    }
    if let Some(path) = &common.json {
        let report = Report {
            subscribers: args.subscribers,
            machines: common.machines,
            replicas: common.replicas,
            workers: common.workers,
            clients: common.clients,
            partitioned: args.partitioned,
            populate_seconds,
            run: &run,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
