//! The replication comparison of Tailwind (ATC'18): the same YCSB workloads (100-byte values,
//! Zipfian keys with θ = 0.99, 3-way replication; see `farm_benchmarks::ycsb`) on the in-process
//! cluster with FaRM's one-sided replication, where the coordinator waits only for the writes of
//! COMMIT-BACKUP into the backups' logs, and with RPC replication, where each backup's CPU
//! processes the record and answers first. The modes alternate, `--runs` times each on a fresh
//! cluster; per mode the report gives the median over runs of the throughput and of the PUT
//! latency percentiles, and the ratios one-sided over RPC (Tailwind: 1.7x the throughput, half
//! the median and a third of the p99 PUT latency). After each run every value is checked.
//!
//! `cargo run --release -p farm-benchmarks --bin replication -- --seconds 3 --runs 3`

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use farm_benchmarks::runner::{self, CommonArgs, ReplicationArg, RunReport};
use farm_benchmarks::ycsb::{Mix, Ycsb};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "One-sided against RPC replication on YCSB, on an in-process farm-rs cluster")]
struct Args {
    /// YCSB mixes to run (repeatable): a (50% PUT), b (5% PUT), update-only.
    #[arg(long, value_enum, default_values_t = [Mix::UpdateOnly, Mix::A, Mix::B])]
    mix: Vec<Mix>,
    /// Keys, spread evenly over the machines.
    #[arg(long, default_value_t = 100_000)]
    keys: u64,
    /// Bytes per value (8 to 1024).
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Zipfian constant of the key distribution.
    #[arg(long, default_value_t = 0.99)]
    theta: f64,
    /// Runs of each mode per mix, alternating.
    #[arg(long, default_value_t = 3)]
    runs: u32,
    #[command(flatten)]
    common: CommonArgs,
}

/// One measured run.
#[derive(Serialize, Debug, Clone, Copy)]
struct Sample {
    per_second: f64,
    put_p50_us: f64,
    put_p99_us: f64,
    /// `None` when the mix has no GET.
    get_p50_us: Option<f64>,
}

/// Medians over a mode's runs.
#[derive(Serialize, Debug)]
struct ModeReport {
    replication: ReplicationArg,
    runs: Vec<Sample>,
    median: Sample,
}

#[derive(Serialize, Debug)]
struct MixReport {
    mix: Mix,
    one_sided: ModeReport,
    rpc: ModeReport,
    /// One-sided throughput over RPC throughput.
    throughput_ratio: f64,
    /// RPC PUT latency over one-sided, median and 99th percentile.
    put_p50_ratio: f64,
    put_p99_ratio: f64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let common = &args.common;
    common.options()?;
    anyhow::ensure!(
        common.kill.is_empty() && common.chart.is_none(),
        "--kill and --chart are for the workload binaries; this one compares normal-case runs"
    );
    anyhow::ensure!(
        common.replication == ReplicationArg::OneSided,
        "--replication: this binary runs both modes"
    );
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    anyhow::ensure!(
        args.theta > 0.0 && args.theta < 1.0,
        "--theta must be in (0, 1), got {}",
        args.theta
    );
    println!(
        "YCSB: {} keys of {} bytes, Zipfian {}, {} machines x {} workers, {}-way replication, \
         {} clients, {} s per run, {} runs per mode",
        args.keys,
        args.value_bytes,
        args.theta,
        common.machines,
        common.workers,
        common.replicas,
        common.clients,
        common.seconds,
        args.runs
    );
    let mut reports = Vec::new();
    for mix in &args.mix {
        let mut samples: [Vec<Sample>; 2] = [Vec::new(), Vec::new()];
        for run in 0..args.runs {
            for (i, mode) in [ReplicationArg::OneSided, ReplicationArg::Rpc]
                .into_iter()
                .enumerate()
            {
                let s = measure(&args, *mix, mode)
                    .with_context(|| format!("{mix:?}, {mode:?}, run {}", run + 1))?;
                eprintln!(
                    "{mix:?} {mode:?} run {}: {:.0}/s, PUT p50 {:.1} us p99 {:.1} us",
                    run + 1,
                    s.per_second,
                    s.put_p50_us,
                    s.put_p99_us
                );
                samples[i].push(s);
            }
        }
        let [one, rpc] = samples;
        let (one, rpc) = (
            mode_report(ReplicationArg::OneSided, one),
            mode_report(ReplicationArg::Rpc, rpc),
        );
        let report = MixReport {
            mix: *mix,
            throughput_ratio: one.median.per_second / rpc.median.per_second,
            put_p50_ratio: rpc.median.put_p50_us / one.median.put_p50_us,
            put_p99_ratio: rpc.median.put_p99_us / one.median.put_p99_us,
            one_sided: one,
            rpc,
        };
        print_mix(&report);
        reports.push(report);
    }
    if let Some(path) = &common.json {
        std::fs::write(path, serde_json::to_string_pretty(&reports)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// One run of `mix` on a fresh cluster replicating as `mode`.
fn measure(args: &Args, mix: Mix, mode: ReplicationArg) -> anyhow::Result<Sample> {
    let common = CommonArgs {
        replication: mode,
        ..args.common.clone()
    };
    let opts = common.options()?;
    let per_machine = args.keys as usize / common.machines as usize + 1;
    let region_bytes = (per_machine * (args.value_bytes + 64) * common.replicas as usize)
        .next_power_of_two()
        .max(64 << 20);
    let cluster = common.cluster(Some(region_bytes))?;
    let ycsb = Ycsb::populate(
        &cluster,
        args.keys,
        args.value_bytes,
        mix,
        args.theta,
        common.clients as usize,
        &|_| {},
    )
    .context("populating")?;
    cluster.quiesce();
    let workload = Arc::new(ycsb);
    let run = runner::run(&cluster, &workload, &opts)?;
    workload.check(&cluster).context("checking the values")?;
    let errors: u64 = run.types.iter().map(|t| t.errors).sum();
    anyhow::ensure!(errors == 0, "{errors} operations failed");
    Ok(sample(&run))
}

fn sample(run: &RunReport) -> Sample {
    let get = &run.types[0];
    let put = &run.types[1];
    Sample {
        per_second: run.per_second,
        put_p50_us: put.p50_us,
        put_p99_us: put.p99_us,
        get_p50_us: (get.count > 0).then_some(get.p50_us),
    }
}

fn mode_report(replication: ReplicationArg, runs: Vec<Sample>) -> ModeReport {
    let median = |f: fn(&Sample) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let median = Sample {
        per_second: median(|s| s.per_second),
        put_p50_us: median(|s| s.put_p50_us),
        put_p99_us: median(|s| s.put_p99_us),
        get_p50_us: runs[0]
            .get_p50_us
            .map(|_| median(|s| s.get_p50_us.unwrap_or(0.0))),
    };
    ModeReport {
        replication,
        runs,
        median,
    }
}

fn print_mix(r: &MixReport) {
    println!(
        "{:?} ({}% PUT), medians over runs:",
        r.mix,
        r.mix.put_percent()
    );
    println!(
        "  {:<10} {:>12} {:>12} {:>12} {:>12}",
        "mode", "ops/s", "PUT p50 us", "PUT p99 us", "GET p50 us"
    );
    for m in [&r.one_sided, &r.rpc] {
        println!(
            "  {:<10} {:>12.0} {:>12.1} {:>12.1} {:>12}",
            format!("{:?}", m.replication),
            m.median.per_second,
            m.median.put_p50_us,
            m.median.put_p99_us,
            m.median
                .get_p50_us
                .map_or("-".to_string(), |v| format!("{v:.1}"))
        );
    }
    println!(
        "  one-sided / RPC: {:.2}x throughput; RPC / one-sided PUT latency: {:.2}x p50, {:.2}x p99",
        r.throughput_ratio, r.put_p50_ratio, r.put_p99_ratio
    );
}
