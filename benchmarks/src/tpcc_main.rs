//! TPC-C on an in-process cluster (see `farm_workloads::tpcc`): populates warehouses at the
//! specification's cardinalities with a progress bar, runs the full mix (or `--mix
//! new-order-payment`) from client threads co-partitioned with their warehouses, reports
//! committed NEW-ORDERs per second and per minute with the per-type counts, aborts and
//! latencies, then checks consistency conditions 1 to 4 (clause 3.3.2), failing on a
//! violation. `--kill` kills machines during the run as in the TATP binary.
//!
//! `cargo run --release -p farm-benchmarks --bin tpcc -- --warehouses 2 --seconds 10`

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use farm::{Client, MachineId, Pipeline, Session, TxError};
use farm_benchmarks::runner::{self, CommonArgs, RunReport, Workload};
use farm_workloads::tpcc::{Kind, Outcome, Scale, Tables};
use farm_workloads::Rand;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
enum Mix {
    /// NEW-ORDER 45%, PAYMENT 43%, ORDER-STATUS, DELIVERY and STOCK-LEVEL 4% each.
    Full,
    /// NEW-ORDER and PAYMENT, 50% each.
    NewOrderPayment,
}

#[derive(Parser, Debug)]
#[command(about = "TPC-C on an in-process farm-rs cluster")]
struct Args {
    /// Warehouses (client i serves warehouses i+1, i+1+clients, ...).
    #[arg(long, default_value_t = 2)]
    warehouses: u32,
    /// The transaction mix.
    #[arg(long, value_enum, default_value_t = Mix::Full)]
    mix: Mix,
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Serialize, Debug)]
struct Report<'a> {
    warehouses: u32,
    machines: u16,
    replicas: u16,
    workers: u16,
    clients: u16,
    mix: Mix,
    populate_seconds: f64,
    new_orders_per_second: f64,
    new_orders_per_minute: f64,
    run: &'a RunReport,
}

/// TPC-C's mix for the runner: client `i`'s home warehouses are `i + 1`, `i + 1 + clients`,
/// ..., and its transactions run where the home warehouse lives.
struct Tpcc {
    tables: Tables,
    mix: Mix,
    clients: u32,
}

impl Workload for Tpcc {
    fn kinds(&self) -> Vec<&'static str> {
        Kind::ALL.iter().map(|k| k.name()).collect()
    }

    fn mix_percent(&self, kind: usize) -> u64 {
        match (self.mix, Kind::ALL[kind]) {
            (Mix::NewOrderPayment, Kind::NewOrder | Kind::Payment) => 50,
            (Mix::NewOrderPayment, _) => 0,
            (Mix::Full, Kind::NewOrder) => 45,
            (Mix::Full, Kind::Payment) => 43,
            (Mix::Full, _) => 4,
        }
    }

    fn run_one(
        &self,
        session: &Session<'_>,
        client: usize,
        rng: &mut Rand,
        down: &[bool],
        attempts: &mut u64,
    ) -> (usize, Result<bool, TxError>) {
        let (kind, w, m) = self.pick(client, rng, down, session.machines());
        let result = self
            .tables
            .run(session, Some(m), (kind, w), rng, now_ms(), attempts);
        (kind as usize, result.map(|o| o == Outcome::Committed))
    }

    /// One: in one process, where TPC-C's work is local, more in flight only adds conflicts
    /// (3 warehouses, 2 clients: 29 K/s at 1, 25 K/s at 4, 21 K/s at 16, 2026-11-27).
    fn in_flight_default(&self) -> Option<usize> {
        Some(1)
    }

    async fn run_one_in(
        &self,
        pipeline: &Pipeline<'_>,
        client: usize,
        rng: &mut Rand,
        down: &[bool],
        attempts: &mut u64,
    ) -> (usize, Result<bool, TxError>) {
        let (kind, w, m) = self.pick(client, rng, down, pipeline.machines());
        let result = self
            .tables
            .run_in(pipeline, Some(m), (kind, w), rng, now_ms(), attempts)
            .await;
        (kind as usize, result.map(|o| o == Outcome::Committed))
    }
}

impl Tpcc {
    /// The next transaction's type, home warehouse and coordinator (where the warehouse lives,
    /// or a machine `down` does not mark).
    fn pick(
        &self,
        client: usize,
        rng: &mut Rand,
        down: &[bool],
        machines: u16,
    ) -> (Kind, u32, MachineId) {
        let kind = Kind::from_draw(rng.next_u64() % 100, self.mix == Mix::NewOrderPayment);
        let w = self.home_warehouse(client, rng);
        let home = self.tables.machine_of_among(machines, w);
        let m = if down[home.0 as usize] {
            runner::pick_alive(down, rng.next_u64())
        } else {
            home
        };
        (kind, w, m)
    }

    fn home_warehouse(&self, client: usize, rng: &mut Rand) -> u32 {
        let w = self.tables.scale.warehouses;
        if self.clients >= w {
            return (client as u32 % w) + 1;
        }
        let mine = (w - 1 - client as u32) / self.clients + 1;
        client as u32 + 1 + self.clients * (rng.next_u64() % mine as u64) as u32
    }
}

/// Milliseconds since 1970, for dates.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        (1..=255).contains(&args.warehouses),
        "--warehouses must be 1 to 255"
    );
    let common = &args.common;
    let opts = common.options()?;
    let cluster = common.cluster(None).context("building the cluster")?;
    // Room for the NEW-ORDERs of the run (tables do not grow).
    let scale = Scale::for_run(args.warehouses, common.seconds);
    let started = Instant::now();
    let tables = Tables::create(&cluster, scale, common.seed).context("creating tables")?;
    let per_warehouse = (scale.items + 3 * scale.districts as u32 * scale.customers) as u64;
    // ITEM: a copy per machine.
    let items = scale.items as u64 * cluster.machines() as u64;
    let bar = indicatif::ProgressBar::new(items + per_warehouse * args.warehouses as u64)
        .with_style(
            indicatif::ProgressStyle::with_template(
                "populating {bar:40} {pos}/{len} rows ({per_sec}, {eta} left)",
            )
            .expect("template"),
        );
    tables
        .populate_items(&cluster, 40, common.seed)
        .context("populating items")?;
    bar.inc(items);
    let warehouses: Vec<u32> = (1..=args.warehouses).collect();
    runner::load_in_parallel(&warehouses, common.clients as usize, |&w| {
        tables
            .populate_warehouse(&cluster, w, common.seed, &|n| bar.inc(n))
            .with_context(|| format!("populating warehouse {w}"))
    })?;
    bar.finish_and_clear();
    let populate_seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "populated {} warehouses in {populate_seconds:.1} s",
        args.warehouses
    );
    let workload = Arc::new(Tpcc {
        tables,
        mix: args.mix,
        clients: common.clients as u32,
    });
    let run = runner::run(&cluster, &workload, &opts)?;
    let new_orders = run.types[Kind::NewOrder as usize].successes as f64 / run.seconds;
    println!(
        "TPC-C ({:?} mix): {} warehouses, {} machines x {} workers, {}-way replication, {} clients",
        args.mix, args.warehouses, common.machines, common.workers, common.replicas, common.clients
    );
    println!(
        "committed NEW-ORDERs: {new_orders:.0} per second, {:.0} per minute",
        new_orders * 60.0
    );
    runner::print(&run);
    if let Some(path) = &common.chart {
        let title = format!(
            "TPC-C, {} warehouses, {} machines, {} ms leases: transactions per ms",
            args.warehouses, common.machines, common.lease_ms
        );
        runner::chart(path, &title, &cluster, &run)
            .with_context(|| format!("drawing {}", path.display()))?;
        println!("chart written to {}", path.display());
    }
    let t = Instant::now();
    workload
        .tables
        .check(&cluster, run.survivor(&cluster))
        .map_err(|e| anyhow::anyhow!("consistency check failed: {e}"))?;
    println!(
        "consistency conditions 1-4 hold ({:.1} s)",
        t.elapsed().as_secs_f64()
    );
    if let Some(path) = &common.json {
        let report = Report {
            warehouses: args.warehouses,
            machines: common.machines,
            replicas: common.replicas,
            workers: common.workers,
            clients: common.clients,
            mix: args.mix,
            populate_seconds,
            new_orders_per_second: new_orders,
            new_orders_per_minute: new_orders * 60.0,
            run: &run,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
