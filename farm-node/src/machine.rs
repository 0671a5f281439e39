//! One machine process: [`run`] (see the crate docs).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use anyhow::Context;
use farm::node::Node;

use crate::config::{ConfigArgs, Settings};

/// Which machine a process runs, and how it starts: the flags of `farm-node run` (flatten them
/// into a program's own with `#[command(flatten)]`).
#[derive(clap::Args, Debug, Clone)]
pub struct MachineArgs {
    /// The machine this process runs (0 to machines - 1).
    #[arg(long)]
    pub machine: u16,
    /// Restart from the NVRAM directory with every other machine of a stopped cluster.
    #[arg(long, conflicts_with = "join")]
    pub restart: bool,
    /// Join the running cluster as a new incarnation of this machine (its NVRAM is forgotten).
    #[arg(long)]
    pub join: bool,
    #[command(flatten)]
    pub config: ConfigArgs,
}

/// What a program's code gets on each incarnation of its machine (see [`run`]).
#[derive(Debug)]
pub struct Running<'a> {
    /// The machine: [`Node::txn`] and [`Node::pipeline`] run transactions coordinated here,
    /// reading and writing objects anywhere in the cluster.
    pub node: &'a Node,
    /// The settings in force.
    pub settings: &'a Settings,
    /// 0 for the process's first node, then one more for each new incarnation that rejoined
    /// after an eviction.
    pub incarnation: u32,
    stop: &'a AtomicBool,
}

impl Running<'_> {
    /// Whether the code should return: this incarnation was evicted (its transactions fail
    /// with `TxError::Evicted`), and [`run`] starts another once the code returned.
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || self.node.is_evicted()
    }
}

/// Runs machine `args.machine` of the cluster its settings describe in this process, with
/// `code` on a thread of its own beside the serving loop (a statistics line every
/// `stats_seconds`):
/// - the machine starts a new cluster with the others, restarts it from NVRAM (`--restart`),
///   or joins a running one (`--join`), and says so on standard output once it runs;
/// - when the cluster evicts it (paused past its lease, FaRM §5.2), `code` is asked to stop
///   ([`Running::stopping`]), and once it returned the machine starts again as a new
///   incarnation that rejoins, and `code` runs again on it;
/// - on SIGTERM or SIGPWR (a UPS's power signal, `farm-node local stop`, an init system) the
///   machine halts at once (no more leases, polls or reconfiguration: what was in flight,
///   `code`'s transactions included, ends as at a crash, and recovery decides it), writes every
///   NVRAM mapping back (`msync`), says so, and the process exits with status 0.
///
/// `code` returning `Ok` leaves the machine serving; an error ends `run` with it (the process
/// should exit: the machine is then a crashed one). `run` returns only with an error.
pub fn run(
    args: &MachineArgs,
    code: impl Fn(&Running<'_>) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<()> {
    let settings = args.config.resolve()?;
    if args.machine >= settings.machines {
        anyhow::bail!(
            "--machine {}: the cluster has machines 0 to {}",
            args.machine,
            settings.machines - 1
        );
    }
    let config = settings.node_config(args.machine, args.restart, args.join)?;
    let metrics = match settings.metrics_addr_of(args.machine) {
        Some(addr) => {
            let listener = std::net::TcpListener::bind(addr)
                .with_context(|| format!("serving metrics at {addr} (metrics_addr)"))?;
            listener.set_nonblocking(true)?;
            Some(listener)
        }
        None => None,
    };
    // The power signal reaches the serving loop at once, whatever `code` does, so that the
    // machines of a cluster told together all halt before any exits.
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
    let mut node = if args.join {
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
    for incarnation in 0.. {
        announce(&node);
        serve(
            &node,
            &settings,
            incarnation,
            &power,
            metrics.as_ref(),
            &code,
        )?;
        tracing::warn!(
            machine = node.id().0,
            "evicted from the configuration; rejoining as a new incarnation"
        );
        drop(node);
        node = Node::join(&config, joining).context("starting again to rejoin")?;
    }
    unreachable!("incarnations run out")
}

/// Says on standard output that the machine runs, in which configuration.
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

/// Serves `node` with `code` running beside it, and its metrics on `metrics` if given, until
/// the node is evicted and `code` returned (Ok), `code` failed (its error), or a power signal
/// ends the process.
fn serve(
    node: &Node,
    settings: &Settings,
    incarnation: u32,
    power: &Receiver<i32>,
    metrics: Option<&std::net::TcpListener>,
    code: &(impl Fn(&Running<'_>) -> anyhow::Result<()> + Sync),
) -> anyhow::Result<()> {
    let stop = AtomicBool::new(false);
    let running = Running {
        node,
        settings,
        incarnation,
        stop: &stop,
    };
    let every = Duration::from_secs(settings.stats_seconds);
    let lease = Duration::from_millis(settings.lease_ms);
    std::thread::scope(|s| {
        // The code and the metrics endpoint are told to stop when this incarnation's scope
        // ends, however it ends (the scope then waits for them).
        struct Ends<'a>(&'a AtomicBool);
        impl Drop for Ends<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _ends = Ends(&stop);
        if let Some(listener) = metrics {
            std::thread::Builder::new()
                .name("farm-metrics".into())
                .spawn_scoped(s, || crate::http::serve(listener, node, &stop))
                .context("starting the metrics endpoint")?;
        }
        let mut app = Some(
            std::thread::Builder::new()
                .name("farm-app".into())
                .spawn_scoped(s, || code(&running))
                .context("starting the machine's code")?,
        );
        // Statistics on a thread of their own: reading them waits for hosts that blocking
        // transactions hold, and the loop below must hear the power signal at once.
        std::thread::Builder::new()
            .name("farm-stats".into())
            .spawn_scoped(s, || {
                let mut last = (Instant::now(), node.stats());
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    if last.0.elapsed() >= every {
                        last = (Instant::now(), log_stats(node, &last));
                    }
                }
            })
            .context("starting the statistics thread")?;
        loop {
            if let Ok(sig) = power.recv_timeout(Duration::from_millis(100)) {
                power_off(node, sig, lease);
            }
            if app.as_ref().is_some_and(|a| a.is_finished()) {
                let done = app.take().expect("checked").join();
                match done {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            if node.is_evicted() {
                stop.store(true, Ordering::Relaxed);
                // The code's transactions fail now; wait for it to return, the power signal
                // still heard.
                if let Some(a) = app.take() {
                    while !a.is_finished() {
                        if let Ok(sig) = power.recv_timeout(Duration::from_millis(10)) {
                            power_off(node, sig, lease);
                        }
                    }
                    match a.join() {
                        Ok(r) => r?,
                        Err(panic) => std::panic::resume_unwind(panic),
                    }
                }
                return Ok(());
            }
        }
    })
}

/// Halts `node`, writes its NVRAM back and ends the process (see [`run`]) no sooner than a
/// `lease` after the signal: machines stopped together halt within a lease of each other, and
/// one whose connections closed at once was seen as a broken link by a peer whose control plane
/// still ran, which removed it, and the restart then refused it as stale
/// (farm-node/tests/bank.rs, a run in twenty-four). Halted, this machine renews nothing and
/// drives nothing; its fabric stays up until it ends.
fn power_off(node: &Node, sig: i32, lease: Duration) -> ! {
    let started = Instant::now();
    tracing::warn!(machine = node.id().0, signal = sig, "power signal: halting");
    node.halt();
    let flushed = node.flush_nvram();
    let line = match &flushed {
        Ok((areas, bytes)) => format!(
            "farm-node: machine {} wrote {areas} NVRAM mappings ({bytes} bytes) back in {} ms \
             on a power signal ({sig}), and stops\n",
            node.id().0,
            started.elapsed().as_millis()
        ),
        Err(e) => format!(
            "farm-node: machine {} could not write its NVRAM back on a power signal ({sig}): \
             {e}; it stops\n",
            node.id().0
        ),
    };
    tracing::warn!(machine = node.id().0, "{}", line.trim_end());
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(line.as_bytes());
    std::thread::sleep(lease.saturating_sub(started.elapsed()));
    std::process::exit(if flushed.is_ok() { 0 } else { 1 });
}

/// A statistics line: commits and aborts per second since `last`, configuration, suspicions;
/// returns the counters it read.
fn log_stats(node: &Node, last: &(Instant, farm::Stats)) -> farm::Stats {
    let stats = node.stats();
    let seconds = last.0.elapsed().as_secs_f64();
    let c = node.configuration();
    let members: Vec<u16> = c.members.iter().map(|m| m.0).collect();
    tracing::info!(
        machine = node.id().0,
        config = c.id.0,
        members = ?members,
        commits_per_s = ((stats.commits - last.1.commits) as f64 / seconds).round(),
        aborts_per_s = ((stats.aborts() - last.1.aborts()) as f64 / seconds).round(),
        commits = stats.commits,
        suspicions = node.suspicions().len(),
        "stats"
    );
    stats
}
