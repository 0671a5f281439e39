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

mod config;
mod launcher;
mod workload;

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use farm::node::Node;
use farm::zk::ZkStore;

use crate::config::{ConfigArgs, Settings};
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
    /// The machine this process runs (0 to machines - 1).
    #[arg(long)]
    machine: u16,
    /// Restart from the NVRAM directory with every other machine of a stopped cluster.
    #[arg(long, conflicts_with = "join")]
    restart: bool,
    /// Join the running cluster as a new incarnation of this machine (its NVRAM is forgotten).
    #[arg(long)]
    join: bool,
    #[command(flatten)]
    config: ConfigArgs,
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
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    // The ZooKeeper client logs every session event at info.
    let filter = tracing_subscriber::filter::Targets::new()
        .with_default(cli.log)
        .with_target("zookeeper_client", cli.log.min(tracing::Level::WARN));
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(filter)
        .init();
    match cli.command {
        Command::Run(args) => run(args),
        Command::Local(cmd) => launcher::main(cmd),
    }
}

/// `farm-node run`.
fn run(args: RunArgs) -> anyhow::Result<()> {
    let settings = args.config.resolve()?;
    if args.machine >= settings.machines {
        anyhow::bail!(
            "--machine {}: the cluster has machines 0 to {}",
            args.machine,
            settings.machines - 1
        );
    }
    let config = settings.node_config(args.machine, args.restart, args.join)?;
    // A power signal (a UPS's SIGPWR, or SIGTERM from `local stop` or an init system) ends the
    // process once every NVRAM mapping is written back (`serve`); it reaches the serving loop
    // at once, so that the machines of a cluster told together all halt before any exits.
    let mut signals =
        signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, libc::SIGPWR])
            .context("handling SIGTERM and SIGPWR")?;
    let (power_tx, power) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("farm-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                let _ = power_tx.send(sig);
            }
        })?;
    let joining = Duration::from_secs(settings.start_timeout_seconds);
    let node = if args.join {
        Node::join(&config, joining)
    } else {
        Node::start(&config)
    }
    .with_context(|| {
        format!(
            "starting machine {} of cluster {} in {}",
            args.machine,
            settings.cluster,
            settings.dir.display()
        )
    })?;
    announce(&node);
    if let Some(w) = &args.workload {
        let store = workload_store(&settings)?;
        let (name, result) = match w {
            Workload::Tatp(a) => (
                "tatp",
                workload::run_tatp(&node, &store, a, &settings.fabric)?,
            ),
            Workload::Tpcc(a) => ("tpcc", workload::run_tpcc(&node, &store, a)?),
        };
        println!("{name} result {}", serde_json::to_string(&result)?);
    }
    serve(node, &settings, &config, &power)
}

fn announce(node: &Node) {
    let c = node.configuration();
    let members: Vec<u16> = c.members.iter().map(|m| m.0).collect();
    // One write, so that the line does not interleave with the log on a shared file.
    let line = format!(
        "farm-node: machine {} running in configuration {} (members {members:?}, CM {})\n",
        node.id().0,
        c.id.0,
        c.cm.0
    );
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(line.as_bytes());
}

fn workload_store(settings: &Settings) -> anyhow::Result<ZkStore> {
    ZkStore::connect(
        &settings.zookeeper,
        &settings.root(),
        Duration::from_secs(10),
    )
    .with_context(|| format!("connecting to ZooKeeper at {}", settings.zookeeper))
}

/// Serves until the process is killed or `power` is set: a statistics line every
/// `stats_seconds`, and a new incarnation that rejoins whenever the cluster evicts this one.
/// On the power signal it writes every NVRAM mapping back (`msync`), says so, and exits at
/// once; what was in flight ends as at a crash, which recovery handles.
fn serve(
    mut node: Node,
    settings: &Settings,
    config: &farm::node::NodeConfig,
    power: &Receiver<i32>,
) -> anyhow::Result<()> {
    let every = Duration::from_secs(settings.stats_seconds);
    let mut last = (Instant::now(), node.stats());
    loop {
        if let Ok(sig) = power.recv_timeout(every.min(Duration::from_millis(100))) {
            let started = Instant::now();
            node.halt();
            let (areas, bytes) = node.flush_nvram().context("writing NVRAM back")?;
            let line = format!(
                "farm-node: machine {} wrote {areas} NVRAM mappings ({bytes} bytes) back in {} ms \
                 on a power signal ({sig}), and stops\n",
                node.id().0,
                started.elapsed().as_millis()
            );
            tracing::warn!(machine = node.id().0, areas, bytes, "{}", line.trim_end());
            use std::io::Write;
            let _ = std::io::stdout().lock().write_all(line.as_bytes());
            std::process::exit(0);
        }
        if node.is_evicted() {
            tracing::warn!(
                machine = node.id().0,
                "evicted from the configuration; rejoining as a new incarnation"
            );
            drop(node);
            let joining = Duration::from_secs(settings.start_timeout_seconds);
            node = Node::join(config, joining).context("starting again to rejoin")?;
            announce(&node);
            last = (Instant::now(), node.stats());
            continue;
        }
        if last.0.elapsed() < every {
            continue;
        }
        let stats = node.stats();
        let seconds = last.0.elapsed().as_secs_f64();
        let c = node.configuration();
        let members: Vec<u16> = c.members.iter().map(|m| m.0).collect();
        let aborts = |s: &farm::Stats| {
            s.aborts_read_locked
                + s.aborts_read_torn
                + s.aborts_lock
                + s.aborts_validate
                + s.aborts_other
        };
        tracing::info!(
            machine = node.id().0,
            config = c.id.0,
            members = ?members,
            commits_per_s = ((stats.commits - last.1.commits) as f64 / seconds).round(),
            aborts_per_s = ((aborts(&stats) - aborts(&last.1)) as f64 / seconds).round(),
            commits = stats.commits,
            suspicions = node.suspicions().len(),
            "stats"
        );
        last = (Instant::now(), stats);
    }
}
