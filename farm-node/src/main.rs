//! `farm-node`: one farm-rs machine per process, and a launcher for a local cluster of them.
//!
//! `farm-node run --machine M` runs machine M of the cluster its settings describe (a TOML file
//! with `--config`, flags, defaults; see `config`): its NVRAM under the cluster's directory,
//! the `shm` fabric to the other processes of this host or, with `--fabric tcp --hosts
//! ip:port,...`, the `tcp` fabric to other hosts, the configuration in ZooKeeper. It logs with
//! `tracing` (`RUST_LOG`-style levels through `--log`), prints a statistics line every
//! `stats_seconds`, and when the cluster evicts it (paused past its lease, FaRM §5.2) it
//! starts again as a new incarnation that rejoins. `--restart` restarts it with the rest of a
//! stopped cluster from NVRAM; `--join` joins a running cluster. `run ... tatp` and
//! `run ... tpcc` also run those workloads from this machine (see `workload`).
//!
//! `farm-node local start|status|kill|restart|stop|tatp` runs such processes on this host:
//! see `launcher`.
//!
//! ```text
//! farm-node local start --machines 3 --zookeeper 127.0.0.1:2181
//! farm-node local status
//! farm-node local kill 2
//! farm-node local restart 2
//! farm-node local stop
//! farm-node local start --restart
//! farm-node local tatp --subscribers 20000 --seconds 5 --check
//! farm-node local tpcc --warehouses 3 --seconds 5 --check
//! farm-node local tatp --fabric tcp --hosts 10.77.0.1:7400,10.77.0.2:7400,10.77.0.3:7400 \
//!     --netns farm-h --zookeeper 10.77.0.254:2181
//! ```

mod launcher;
mod workload;

use clap::{Parser, Subcommand};
use farm_node::{MachineArgs, Running};

use crate::workload::{TatpArgs, TpccArgs};

/// Transactions allocate and free small buffers at a high rate from several threads (read
/// copies, write sets, decoded log records), where glibc's malloc took about a sixth of
/// TPC-C's time in the benchmarks; the server allocates as they do.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    name = "farm-node",
    about = "farm-rs machine server and local cluster launcher"
)]
struct Cli {
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, global = true, default_value = "info")]
    log: tracing::Level,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run one machine of a cluster in this process.
    Run(RunArgs),
    /// Start, inspect, fail and stop a cluster of machine processes on this host.
    #[command(subcommand)]
    Local(launcher::LocalCommand),
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    machine: MachineArgs,
    #[command(subcommand)]
    workload: Option<Workload>,
}

#[derive(Subcommand, Debug)]
enum Workload {
    /// Run TATP from this machine once every machine loaded its subscribers.
    Tatp(TatpArgs),
    /// Run TPC-C from this machine once every machine loaded its warehouses.
    Tpcc(TpccArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    farm_node::log_to_stderr(cli.log);
    match cli.command {
        Command::Run(args) => run(args),
        Command::Local(cmd) => launcher::main(cmd),
    }
}

/// `farm-node run`: the machine, and the workload once from its first incarnation (a machine
/// that rejoins after an eviction only serves).
fn run(args: RunArgs) -> anyhow::Result<()> {
    farm_node::run(&args.machine, |m: &Running<'_>| {
        let Some(w) = args.workload.as_ref().filter(|_| m.incarnation == 0) else {
            return Ok(());
        };
        let store = m.settings.store()?;
        let (name, result) = match w {
            Workload::Tatp(a) => (
                "tatp",
                workload::run_tatp(m.node, &store, a, (&m.settings.fabric, &m.settings.dir))?,
            ),
            Workload::Tpcc(a) => (
                "tpcc",
                workload::run_tpcc(m.node, &store, a, &m.settings.dir)?,
            ),
        };
        println!("{name} result {}", serde_json::to_string(&result)?);
        Ok(())
    })
}
