//! `farm-node local`: a cluster of machine processes on this host. Each machine runs as
//! `farm-node run --machine M` with the launcher's settings as flags, in its own process group
//! (a Ctrl-C at the launcher's terminal does not reach it), its output appended to
//! `<dir>/m<M>.log` and its pid in `<dir>/m<M>.pid`. The launcher returns once the machines it
//! started run; they keep running until killed.

use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Subcommand;
use farm::node::Secret;

use crate::workload::{RunArgs, TatpArgs, TpccArgs, WorkloadResult};
use farm_node::config::{ConfigArgs, Settings};

#[derive(Subcommand, Debug)]
pub enum LocalCommand {
    /// Start every machine of a new cluster, or with --restart of a stopped one from its NVRAM.
    Start {
        /// Restart a stopped cluster from its NVRAM directory.
        #[arg(long)]
        restart: bool,
        #[command(flatten)]
        config: ConfigArgs,
        /// Arguments for every machine's command line, after `--` (for a `program` of your
        /// own: its flags; for `farm-node run`: a workload).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Show each machine's process and the configuration in ZooKeeper.
    Status {
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Kill a machine's process with SIGKILL (its NVRAM survives it).
    Kill {
        /// The machine.
        machine: u16,
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Start a killed machine again: it joins the running cluster as a new incarnation.
    Restart {
        /// The machine.
        machine: u16,
        #[command(flatten)]
        config: ConfigArgs,
        /// Arguments for the machine's command line, after `--` (as `start` takes them).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Stop every machine at once with SIGTERM, as a UPS's power signal does: each writes its
    /// NVRAM back and exits (one still running after 30 s is killed); `start --restart` brings
    /// the cluster back from NVRAM.
    Stop {
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Run TATP on a new cluster of these settings (in `<dir>/runs/`, its own znode), report,
    /// and stop it.
    Tatp {
        #[command(flatten)]
        tatp: TatpArgs,
        /// Keep the run's NVRAM directory afterwards.
        #[arg(long)]
        keep: bool,
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Run TPC-C on a new cluster of these settings, as `tatp` does.
    Tpcc {
        #[command(flatten)]
        tpcc: TpccArgs,
        /// Keep the run's NVRAM directory afterwards.
        #[arg(long)]
        keep: bool,
        #[command(flatten)]
        config: ConfigArgs,
    },
}

pub fn main(cmd: LocalCommand) -> anyhow::Result<()> {
    match cmd {
        LocalCommand::Start {
            restart,
            config,
            args,
        } => {
            let s = if restart {
                saved(&config)?
            } else {
                config.resolve()?
            };
            let (flag, machines) = if restart {
                (vec!["--restart"], restarting(&s)?)
            } else {
                (vec![], (0..s.machines).collect())
            };
            // They run on after the launcher exits.
            drop(start_machines(
                &s,
                &machines,
                &flag,
                &args,
                Lifetime::Detached,
            )?);
            std::fs::write(s.dir.join(SAVED), s.to_toml())?;
            status(&s)
        }
        LocalCommand::Status { config } => status(&saved(&config)?),
        LocalCommand::Kill { machine, config } => {
            let s = saved(&config)?;
            check_machine(&s, machine)?;
            let pid =
                running(&s, machine).with_context(|| format!("machine {machine} does not run"))?;
            signal(pid, libc::SIGKILL)?;
            std::fs::remove_file(pid_file(&s, machine))?;
            println!("killed machine {machine} (pid {pid})");
            Ok(())
        }
        LocalCommand::Restart {
            machine,
            config,
            args,
        } => {
            let s = saved(&config)?;
            check_machine(&s, machine)?;
            if let Some(pid) = running(&s, machine) {
                bail!("machine {machine} runs (pid {pid}): kill it first");
            }
            let from = log_len(&s, machine);
            let mut child = spawn(&s, machine, &["--join"], &args, Lifetime::Detached)?;
            wait_running(&s, machine, &mut child, from)?;
            println!("machine {machine} rejoined");
            status(&s)
        }
        LocalCommand::Stop { config } => {
            let s = saved(&config)?;
            // SIGTERM to all at once, as a UPS's power signal reaches every host: each writes
            // its NVRAM back and exits (`farm-node run`); one that does not within the wait is
            // killed.
            let mut stopping = Vec::new();
            for m in 0..s.machines {
                if let Some(pid) = running(&s, m) {
                    signal(pid, libc::SIGTERM)?;
                    stopping.push((m, pid));
                }
            }
            // A machine has stopped once its liveness lock is free: its main thread shows as a
            // zombie as soon as it exited, while the process's other threads may still be
            // tearing down (unmapping NVRAM) with the lock held, and a `start --restart` then
            // found the machine running.
            let stopped = |m: u16, pid: i32| !alive(pid) && !process_alive_in(&s, m);
            let deadline = Instant::now() + STOP_WAIT;
            let mut killed = Vec::new();
            for &(m, pid) in &stopping {
                while !stopped(m, pid) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if !stopped(m, pid) {
                    if alive(pid) {
                        signal(pid, libc::SIGKILL)?;
                    }
                    killed.push(m);
                    let deadline = Instant::now() + STOP_WAIT;
                    while !stopped(m, pid) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            for m in 0..s.machines {
                let _ = std::fs::remove_file(pid_file(&s, m));
            }
            let stopped: Vec<u16> = stopping.iter().map(|(m, _)| *m).collect();
            println!(
                "stopped machines {stopped:?} at once, each writing its NVRAM back first{}; \
                 `farm-node local start --restart` restarts the cluster from {}",
                if killed.is_empty() {
                    String::new()
                } else {
                    format!(" (killed {killed:?}, which did not exit within {STOP_WAIT:?})")
                },
                s.dir.display()
            );
            Ok(())
        }
        LocalCommand::Tatp { tatp, keep, config } => {
            tatp.run.check()?;
            let base = config.resolve()?;
            let mut args = vec![format!("--subscribers={}", tatp.subscribers)];
            args.extend(tatp.run.flags());
            let title = format!("TATP: {} subscribers", tatp.subscribers);
            run_workload(
                &base,
                "tatp",
                &args,
                (keep, &tatp.run),
                &title,
                "transactions that found their rows",
            )
        }
        LocalCommand::Tpcc { tpcc, keep, config } => {
            tpcc.run.check()?;
            let mut base = config.resolve()?;
            // A warehouse's clients run on its machine: a failed machine that holds every
            // warehouse leaves nothing to measure after it.
            if let Some(victim) = tpcc.run.victim(base.machines) {
                let elsewhere = (1..=tpcc.warehouses).any(|w| {
                    farm_workloads::tpcc::warehouse_machine(w as u64, base.machines as usize)
                        != victim.0 as usize
                });
                if !elsewhere {
                    bail!(
                        "--kill-after: machine {victim} holds every one of the {} warehouses, \
                         so no client would run after it fails; fail another machine or add \
                         warehouses",
                        tpcc.warehouses
                    );
                }
            }
            // Regions are fixed at start (transactions do not allocate new ones yet): room for
            // the tables of the run, and a quarter more for the hash tables' overflow buckets
            // and the allocator's partly filled blocks, unless more was asked.
            let scale = farm_workloads::tpcc::Scale::for_run(tpcc.warehouses, tpcc.run.seconds);
            let bytes =
                farm_workloads::tpcc::Tables::bytes_per_machine(scale, base.machines as usize);
            let needed = (bytes + bytes / 4).div_ceil((base.region_mb as u64) << 20) as u32;
            base.regions_per_machine = base.regions_per_machine.max(needed);
            let mut args = vec![
                format!("--warehouses={}", tpcc.warehouses),
                format!("--mix={}", tpcc.mix),
            ];
            args.extend(tpcc.run.flags());
            let title = format!("TPC-C ({} mix): {} warehouses", tpcc.mix, tpcc.warehouses);
            run_workload(
                &base,
                "tpcc",
                &args,
                (keep, &tpcc.run),
                &title,
                "committed NEW-ORDERs",
            )
        }
    }
}

/// How the survivors came back from `f`: their transactions per millisecond summed on one
/// clock, the victim's first suspicion after the signal, and the time from it to 80% of the
/// throughput before (`farm_workloads::timeline::recovery`).
fn failure_report(results: &[WorkloadResult], f: &Failure) -> String {
    let how = if f.stop { "stopped" } else { "killed" };
    let (Some(at), Some(origin)) = (
        f.at_unix_us,
        results.iter().map(|r| r.started_unix_us).min(),
    ) else {
        return format!("machine {} was not {how}: the run ended first", f.victim);
    };
    let mut per_ms: Vec<u64> = Vec::new();
    for r in results {
        let from = ((r.started_unix_us - origin) / 1000) as usize;
        if per_ms.len() < from + r.completed_per_ms.len() {
            per_ms.resize(from + r.completed_per_ms.len(), 0);
        }
        for (i, n) in r.completed_per_ms.iter().enumerate() {
            per_ms[from + i] += n;
        }
    }
    let suspected = (results.iter())
        .flat_map(|r| &r.suspected)
        .filter(|(m, t)| *m == f.victim && *t >= at)
        .map(|(_, t)| *t)
        .min();
    let ms = |us: u64| (us.saturating_sub(origin) / 1000) as usize;
    let r = farm_workloads::timeline::recovery(&per_ms, ms(at), suspected.map(ms));
    let show = |v: Option<f64>| v.map_or("never".to_string(), |v| format!("{v:.1} ms"));
    format!(
        "{how} machine {} at {:.3} s: suspected after {}; back to 80% of {:.1} transactions/ms {} \
         after the suspicion",
        f.victim,
        at.saturating_sub(origin) as f64 / 1e6,
        show(suspected.map(|t| (t - at) as f64 / 1e3)),
        r.before_per_ms.unwrap_or(0.0),
        show(r.suspected_to_80_percent_ms.map(|m| m as f64)),
    )
}

/// The suspicions of machines that were alive (all but the victim's after its failure,
/// `farm_workloads::timeline::false_suspicions`), each with the machine that suspected and
/// when, in seconds from the measured run's start (negative while loading): the lease a run
/// can hold is one that gives none.
fn false_suspicions(results: &[WorkloadResult], failure: Option<&Failure>) -> String {
    let origin = results.iter().map(|r| r.started_unix_us).min().unwrap_or(0);
    let failed: Vec<(u16, u64)> = (failure.into_iter())
        .filter_map(|f| f.at_unix_us.map(|at| (f.victim, at)))
        .collect();
    let listed: Vec<String> = (results.iter())
        .flat_map(|r| {
            let live =
                farm_workloads::timeline::false_suspicions(r.suspected.iter().copied(), &failed);
            live.into_iter().map(move |(m, t)| (r.machine, m, t))
        })
        .map(|(by, m, t)| {
            let s = (t as i64 - origin as i64) as f64 / 1e6;
            format!("machine {m} by machine {by} at {s:.3} s")
        })
        .collect();
    farm_workloads::timeline::false_suspicions_line(&listed)
}

/// Where `local start` leaves its settings, in the cluster's directory.
const SAVED: &str = "launcher.toml";

/// How long `local stop` waits for the machines to write their NVRAM back and exit before it
/// kills them.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// The settings of the cluster `config` names: those `local start` saved in its directory
/// (flags still win), else `config`'s.
fn saved(config: &ConfigArgs) -> anyhow::Result<Settings> {
    let s = config.resolve()?;
    let path = s.dir.join(SAVED);
    if !path.exists() {
        return Ok(s);
    }
    ConfigArgs {
        config: Some(path),
        overrides: config.overrides.clone(),
    }
    .resolve()
}

fn check_machine(s: &Settings, machine: u16) -> anyhow::Result<()> {
    if machine >= s.machines {
        bail!(
            "machine {machine}: the cluster has machines 0 to {}",
            s.machines - 1
        );
    }
    Ok(())
}

fn pid_file(s: &Settings, m: u16) -> PathBuf {
    s.dir.join(format!("m{m}.pid"))
}

fn log_file(s: &Settings, m: u16) -> PathBuf {
    s.dir.join(format!("m{m}.log"))
}

/// The pid of machine `m`'s process, if it runs.
fn running(s: &Settings, m: u16) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(pid_file(s, m))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    (unsafe { libc::kill(pid, 0) } == 0).then_some(pid)
}

/// Whether process `pid` lives (a zombie nobody reaped yet has exited).
fn alive(pid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return false;
    }
    // `pid (comm) S ...`: the state follows the last ')'.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(state != 'Z' && state != 'X')
        })
        .unwrap_or(true)
}

fn signal(pid: i32, sig: libc::c_int) -> anyhow::Result<()> {
    // SAFETY: kill(2) on a pid this launcher recorded for a machine process.
    if unsafe { libc::kill(pid, sig) } != 0 {
        bail!("kill({pid}, {sig}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the cluster's secret when its file is absent (a new cluster on this host).
fn ensure_secret(s: &Settings) -> anyhow::Result<()> {
    if s.secret_file.exists() {
        return Ok(());
    }
    if let Some(parent) = s.secret_file.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    Secret::generate(&s.secret_file)?;
    eprintln!(
        "made the cluster's secret at {} (every host of the cluster needs a copy)",
        s.secret_file.display()
    );
    Ok(())
}

/// The flags that give a machine process exactly these settings.
fn settings_flags(s: &Settings) -> Vec<String> {
    let mut f: Vec<String> = Vec::new();
    let mut push = |k: &str, v: String| {
        f.push(format!("--{k}"));
        f.push(v);
    };
    push("cluster", s.cluster.clone());
    push("dir", s.dir.display().to_string());
    push("machines", s.machines.to_string());
    push("workers", s.workers.to_string());
    push("base-port", s.base_port.to_string());
    push("lease-ms", s.lease_ms.to_string());
    push("regions-per-machine", s.regions_per_machine.to_string());
    push("replicas", s.replicas.to_string());
    push("region-mb", s.region_mb.to_string());
    push("zookeeper", s.zookeeper.clone());
    push("stats-seconds", s.stats_seconds.to_string());
    push("start-timeout-seconds", s.start_timeout_seconds.to_string());
    push("fabric", s.fabric.clone());
    push("secret-file", s.secret_file.display().to_string());
    if s.fabric == "tcp" {
        let hosts: Vec<String> = s.hosts.iter().map(ToString::to_string).collect();
        push("hosts", hosts.join(","));
        push("tcp-timeout-ms", s.tcp_timeout_ms.to_string());
    }
    if let Some(a) = s.metrics_addr {
        push("metrics-addr", a.to_string());
    }
    if let Some(t) = s.restart_without_seconds {
        push("restart-without-seconds", t.to_string());
    }
    f
}

/// Whether machine processes outlive the launcher that starts them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Lifetime {
    /// A cluster left running (`local start`, `rejoin`, `restart`): the processes go on after
    /// the launcher exits, until `local stop` or `kill`.
    Detached,
    /// A workload run's cluster: the processes end with the launcher, however it ends (Ctrl-C,
    /// a timeout's signal), since nothing else would stop them.
    Launcher,
}

/// Starts machine `m`'s process: `farm-node run --machine m <flags> <settings> [args]`, or
/// `<program> --machine m <flags> <settings> [args]` with a `program` setting, with `netns` in
/// the namespace `<netns><m>` (`ip netns exec` runs it in place: its pid is the machine's).
fn spawn(
    s: &Settings,
    m: u16,
    flags: &[&str],
    args: &[String],
    lifetime: Lifetime,
) -> anyhow::Result<Child> {
    std::fs::create_dir_all(&s.dir).with_context(|| format!("creating {}", s.dir.display()))?;
    let log_path = log_file(s, m);
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let (exe, run) = match &s.program {
        Some(program) => (program.clone(), None),
        None => (
            std::env::current_exe().context("finding the farm-node binary")?,
            Some("run"),
        ),
    };
    let mut command = match &s.netns {
        Some(prefix) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &format!("{prefix}{m}")]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    if lifetime == Lifetime::Launcher {
        let launcher = std::process::id() as libc::pid_t;
        // SAFETY: between fork and exec the closure makes only async-signal-safe calls
        // (prctl, getppid) and allocates nothing.
        unsafe {
            command.pre_exec(move || {
                // The kernel kills the process once the launcher's thread that forked it ends
                // (this one, the launcher's main thread); the mark survives the exec.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have ended before the mark was set.
                if libc::getppid() != launcher {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    let child = command
        .args(run)
        .args(["--machine", &m.to_string()])
        .args(flags)
        .args(settings_flags(s))
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("starting a machine process")?;
    std::fs::write(pid_file(s, m), child.id().to_string())?;
    Ok(child)
}

fn log_len(s: &Settings, m: u16) -> usize {
    std::fs::metadata(log_file(s, m)).map_or(0, |md| md.len() as usize)
}

/// Waits until machine `m`'s log says, past byte `from`, that it runs; fails with the log's
/// end if the process ends first.
fn wait_running(s: &Settings, m: u16, child: &mut Child, from: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(s.start_timeout_seconds + 30);
    let marker = format!("farm-node: machine {m} running");
    loop {
        let log = std::fs::read_to_string(log_file(s, m)).unwrap_or_default();
        if log
            .get(from..)
            .unwrap_or("")
            .lines()
            .any(|l| l.starts_with(&marker))
        {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            let _ = std::fs::remove_file(pid_file(s, m));
            bail!(
                "machine {m} exited ({status}) before running; the end of {}:\n{}",
                log_file(s, m).display(),
                tail(&log, 15)
            );
        }
        if Instant::now() > deadline {
            bail!(
                "machine {m} did not report running; see {}",
                log_file(s, m).display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Starts every machine with `flags` and `args` (a workload, or the program's own), and waits
/// until all run; returns their processes.
/// The machines a whole-cluster restart starts: those that left NVRAM under the cluster's
/// directory. Without `restart_without_seconds` every machine must have; with it, the others
/// restart without those that did not, if that loses nothing.
fn restarting(s: &Settings) -> anyhow::Result<Vec<u16>> {
    let mut present = Vec::new();
    let mut missing = Vec::new();
    for m in 0..s.machines {
        let left = farm::node::left_state(&s.dir, farm::MachineId(m))
            .with_context(|| format!("reading machine {m}'s NVRAM in {}", s.dir.display()))?;
        if left {
            present.push(m);
        } else {
            missing.push(m);
        }
    }
    if present.is_empty() {
        bail!(
            "no machine left NVRAM in {}: nothing to restart",
            s.dir.display()
        );
    }
    if !missing.is_empty() {
        let Some(after) = s.restart_without_seconds else {
            bail!(
                "machines {missing:?} left no NVRAM in {} (a disk that died?): bring it back, \
                 or restart without them with --restart-without-seconds S (the others go on \
                 without them after S seconds if every region keeps a complete replica among \
                 them and they are a majority)",
                s.dir.display()
            );
        };
        println!(
            "machines {missing:?} left no NVRAM in {}: machines {present:?} restart without \
             them after {after} s if every region keeps a complete replica among them and they \
             are a majority (`farm-node local restart M` brings one back as a new machine)",
            s.dir.display()
        );
    }
    Ok(present)
}

/// Starts every machine of a workload run's cluster, ending with the launcher.
fn start_all(s: &Settings, args: &[String]) -> anyhow::Result<Vec<Child>> {
    let all: Vec<u16> = (0..s.machines).collect();
    start_machines(s, &all, &[], args, Lifetime::Launcher)
}

/// Starts `machines` of the cluster and waits until each says it runs.
fn start_machines(
    s: &Settings,
    machines: &[u16],
    flags: &[&str],
    args: &[String],
    lifetime: Lifetime,
) -> anyhow::Result<Vec<Child>> {
    ensure_secret(s)?;
    for m in 0..s.machines {
        if let Some(pid) = running(s, m) {
            bail!(
                "machine {m} of cluster {} already runs (pid {pid}); `farm-node local stop` first",
                s.cluster
            );
        }
    }
    // A log per start: what the previous life printed would look like this one's.
    for m in 0..s.machines {
        let _ = std::fs::remove_file(log_file(s, m));
    }
    let mut children = Vec::new();
    for m in machines {
        children.push(spawn(s, *m, flags, args, lifetime)?);
    }
    for (m, child) in machines.iter().zip(&mut children) {
        if let Err(e) = wait_running(s, *m, child, 0) {
            for c in &mut children {
                let _ = c.kill();
            }
            for m in 0..s.machines {
                let _ = std::fs::remove_file(pid_file(s, m));
            }
            return Err(e);
        }
    }
    Ok(children)
}

fn status(s: &Settings) -> anyhow::Result<()> {
    let fabric = if s.fabric == "tcp" {
        let hosts: Vec<String> = s.hosts.iter().map(ToString::to_string).collect();
        format!("tcp fabric (machines at {})", hosts.join(", "))
    } else {
        "shm fabric".to_string()
    };
    println!(
        "cluster {} ({} machines), {fabric}, NVRAM in {}, ZooKeeper {} at {}",
        s.cluster,
        s.machines,
        s.dir.display(),
        s.zookeeper,
        s.root()
    );
    let store = s.store()?;
    let config = store.configuration()?;
    match &config {
        Some(c) => {
            let members: Vec<u16> = c.members.iter().map(|m| m.0).collect();
            println!(
                "configuration {}: members {members:?}, CM {}",
                c.id.0, c.cm.0
            );
        }
        None => println!("no configuration stored"),
    }
    for m in 0..s.machines {
        let pid = running(s, m);
        let process = match pid {
            Some(pid) => format!("running (pid {pid})"),
            None => "not running".to_string(),
        };
        let member = config
            .as_ref()
            .is_some_and(|c| c.contains(farm::MachineId(m)));
        println!(
            "machine {m}: {process}, {}; log {}",
            if member { "member" } else { "not a member" },
            log_file(s, m).display()
        );
        if let Some(stats) = last_stats(&log_file(s, m)) {
            println!("  last stats: {stats}");
        }
        if let (Some(addr), Some(_)) = (s.metrics_addr_of(m), pid) {
            match farm_node::scrape(addr) {
                Ok(text) => {
                    println!("  metrics (http://{addr}/metrics):");
                    for line in text.lines().filter(|l| !l.starts_with('#')) {
                        if !line.contains("_bucket{") {
                            println!("    {line}");
                        }
                    }
                }
                Err(e) => println!("  metrics: http://{addr}/metrics did not answer: {e}"),
            }
        }
    }
    Ok(())
}

/// The fields of the last statistics line in a machine's log (`farm-node run` prints one
/// every `stats_seconds`).
fn last_stats(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text.lines().rev().find(|l| l.contains(" stats "))?;
    let fields = line.split_once(": stats ")?.1;
    Some(fields.trim().to_string())
}

/// `local tatp` and `local tpcc`: a new cluster of `base`'s settings under
/// `<dir>/runs/<workload>-<time>` with its own znode, the workload from every machine, the
/// results summed, the cluster stopped.
fn run_workload(
    base: &Settings,
    workload: &str,
    args: &[String],
    (keep, run): (bool, &RunArgs),
    title: &str,
    counted: &str,
) -> anyhow::Result<()> {
    let mut failure = Failure::of(run, base.machines)?;
    if let Some(program) = &base.program {
        bail!(
            "program = {}: `local {workload}` runs farm-node's own {workload} (drop the program \
             setting)",
            program.display()
        );
    }
    // In milliseconds: two runs in one second would otherwise be one cluster (one id on the
    // wire, one znode), and the second's machines could talk to the first's while they stop.
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();
    let s = Settings {
        cluster: format!("{}-{workload}-{stamp}", base.cluster),
        dir: base.dir.join("runs").join(format!("{workload}-{stamp}")),
        ..base.clone()
    };
    let workload_args: Vec<String> = std::iter::once(workload.to_string())
        .chain(args.iter().cloned())
        .collect();
    eprintln!(
        "starting {} machine processes in {}",
        s.machines,
        s.dir.display()
    );
    let mut children = start_all(&s, &workload_args)?;
    let outcome = collect(&s, workload, &mut children, &mut failure)
        .and_then(|r| report(&s, &r, (title, counted), run.check, failure.as_ref()));
    for (m, c) in children.iter_mut().enumerate() {
        let _ = c.kill();
        let _ = c.wait();
        let _ = std::fs::remove_file(pid_file(&s, m as u16));
    }
    if !keep && outcome.is_ok() {
        // The processes are gone once no liveness lock is held: then the files can go.
        let deadline = Instant::now() + Duration::from_secs(10);
        while (0..s.machines).any(|m| process_alive_in(&s, m)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::remove_dir_all(&s.dir).with_context(|| format!("removing {}", s.dir.display()))?;
    }
    outcome
}

/// Whether some process still holds machine `m`'s liveness lock.
fn process_alive_in(s: &Settings, m: u16) -> bool {
    let path: &Path = &s.dir.join(format!("m{m}")).join("alive");
    match std::fs::File::open(path) {
        Ok(f) => matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock)),
        Err(_) => false,
    }
}

/// A machine failed in the middle of a run (`RunArgs::kill_after`): it fails itself on its
/// own clock and publishes when.
#[derive(Clone, Copy, Debug)]
struct Failure {
    victim: u16,
    /// SIGSTOP rather than SIGKILL.
    stop: bool,
    /// When it failed, in microseconds since the Unix epoch, once it published it.
    at_unix_us: Option<u64>,
}

impl Failure {
    fn of(run: &RunArgs, machines: u16) -> anyhow::Result<Option<Self>> {
        let Some(victim) = run.victim(machines) else {
            return Ok(None);
        };
        if victim.0 >= machines {
            bail!("no machine {victim} to fail among {machines}");
        }
        // A new configuration needs a majority of the old one to answer its probes (FaRM
        // §5.2): of two machines, the one left is not, and the run would wait for good.
        if machines < 3 {
            bail!(
                "--kill-after: a cluster goes on after a failure only while a majority of its \
                 machines lives, so fail one of at least 3 machines, not of {machines}"
            );
        }
        Ok(Some(Self {
            victim: victim.0,
            stop: run.stop,
            at_unix_us: None,
        }))
    }
}

/// Every machine's result of `workload`, as they publish them in ZooKeeper; with a
/// `failure`, the victim is failed on time and its result not waited for.
fn collect(
    s: &Settings,
    workload: &str,
    children: &mut [Child],
    failure: &mut Option<Failure>,
) -> anyhow::Result<Vec<WorkloadResult>> {
    let store = s.store()?;
    let mut results: Vec<Option<WorkloadResult>> = vec![None; s.machines as usize];
    let started = Instant::now();
    let mut reported = 0;
    // Progress through the steps the machines publish: tables created, each machine loaded.
    let mut created = false;
    let mut loaded = vec![false; s.machines as usize];
    let awaited = |m: usize, failure: &Option<Failure>| {
        failure.is_none_or(|f| f.at_unix_us.is_none() || f.victim as usize != m)
    };
    // A ZooKeeper that does not answer (busy machine processes on a host they share with it
    // starve it for seconds) is asked again at the next round: the machines' exits and the
    // deadline below still end the wait.
    let mut unanswered = false;
    let mut get = |name: &str| match store.get(name) {
        Ok(data) => data,
        Err(e) => {
            if !std::mem::replace(&mut unanswered, true) {
                eprintln!("ZooKeeper did not answer ({e}); asking again");
            }
            None
        }
    };
    while (0..results.len()).any(|m| results[m].is_none() && awaited(m, failure)) {
        if !created && get(&format!("{workload}-roots")).is_some() {
            created = true;
            eprintln!("tables created ({:.0} s)", started.elapsed().as_secs_f64());
        }
        for m in 0..s.machines {
            if !loaded[m as usize] && get(&format!("{workload}-loaded-m{m}")).is_some() {
                loaded[m as usize] = true;
                eprintln!(
                    "machine {m} loaded its partition ({:.0} s)",
                    started.elapsed().as_secs_f64()
                );
            }
        }
        // Exits first, then the failure: the victim records its failure before it fails, so
        // a victim seen gone here has its record seen below.
        let exited: Vec<bool> = (children.iter_mut())
            .map(|c| c.try_wait().map(|s| s.is_some()))
            .collect::<Result<_, _>>()?;
        if let Some(f) = failure.as_mut().filter(|f| f.at_unix_us.is_none()) {
            let file = crate::workload::failed_file(&s.dir);
            if let Ok(at) = std::fs::read_to_string(&file) {
                let at = at
                    .trim()
                    .parse()
                    .with_context(|| format!("{}", file.display()))?;
                f.at_unix_us = Some(at);
                let how = if f.stop { "stopped" } else { "killed" };
                eprintln!("machine {} {how} itself", f.victim);
            }
        }
        for m in 0..s.machines {
            if !awaited(m as usize, failure) {
                continue;
            }
            if results[m as usize].is_none() {
                if let Some(bytes) = get(&format!("{workload}-result-m{m}")) {
                    results[m as usize] = Some(serde_json::from_slice(&bytes)?);
                }
            }
            if results[m as usize].is_none() && exited[m as usize] {
                bail!(
                    "machine {m} ended during the run; the end of {}:\n{}",
                    log_file(s, m).display(),
                    tail(
                        &std::fs::read_to_string(log_file(s, m)).unwrap_or_default(),
                        15
                    )
                );
            }
        }
        let done = results.iter().flatten().count();
        if done != reported {
            let expected = (0..results.len()).filter(|m| awaited(*m, failure)).count();
            eprintln!(
                "{done} of {expected} machines finished ({:.0} s)",
                started.elapsed().as_secs_f64()
            );
            reported = done;
        }
        if started.elapsed() > Duration::from_secs(1800) {
            bail!("no result from every machine within 30 minutes");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(results.into_iter().flatten().collect())
}

/// Prints the run's results; fails if a transaction failed, none finished, or the integrity
/// check asked for (`checked`) did not run.
fn report(
    s: &Settings,
    results: &[WorkloadResult],
    (title, counted): (&str, &str),
    checked: bool,
    failure: Option<&Failure>,
) -> anyhow::Result<()> {
    let seconds = results.iter().map(|r| r.seconds).fold(0.0, f64::max);
    println!(
        "{title}, {} machine processes x {} workers, {}-way replication, {:.1} s",
        s.machines, s.workers, s.replicas, seconds
    );
    for r in results {
        println!(
            "  machine {}: {} transactions ({:.0}/s), {} {counted} ({:.0}/s), {} executions, {} \
             errors, latency p50 {:.1} us p99 {:.1} us max {:.0} us",
            r.machine,
            r.transactions,
            r.transactions as f64 / r.seconds,
            r.counted,
            r.counted as f64 / r.seconds,
            r.executions,
            r.errors,
            r.p50_us,
            r.p99_us,
            r.max_us
        );
    }
    let per_s = |f: fn(&WorkloadResult) -> u64| {
        results.iter().map(|r| f(r) as f64 / r.seconds).sum::<f64>()
    };
    println!(
        "  total: {:.0} transactions/s, {:.0} {counted}/s",
        per_s(|r| r.transactions),
        per_s(|r| r.counted)
    );
    let check = results.iter().find_map(|r| r.check.as_ref());
    if let Some(check) = check {
        println!("integrity check passed: {check}");
    }
    if let Some(f) = failure {
        println!("{}", failure_report(results, f));
    }
    println!("{}", false_suspicions(results, failure));
    let errors: u64 = results.iter().map(|r| r.errors).sum();
    if results.iter().map(|r| r.transactions).sum::<u64>() == 0 {
        bail!("no transaction finished");
    }
    if errors > 0 {
        bail!("{errors} transactions failed");
    }
    if checked && check.is_none() {
        bail!("--check: no machine reported the integrity check");
    }
    Ok(())
}
