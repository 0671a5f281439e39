//! The `farm-node` binary end to end, with ZooKeeper (`ZK_CONNECT`; under `CI=true` it must be
//! there): a local cluster of three machine processes started, inspected, one machine killed
//! and started again (it rejoins), every machine stopped at once and the cluster restarted
//! from NVRAM, TATP and TPC-C run across processes with their integrity checks, a program of
//! one's own (`examples/bank.rs`) as the machines through a kill, a rejoin and a power signal,
//! and bad settings refused with messages that name the problem.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn zookeeper() -> Option<String> {
    match std::env::var("ZK_CONNECT") {
        Ok(z) => Some(z),
        Err(_) => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but ZK_CONNECT is not set: run the tests under scripts/with-zookeeper.sh"
            );
            eprintln!("skipping: ZK_CONNECT is not set (scripts/with-zookeeper.sh sets it)");
            None
        }
    }
}

/// A cluster name no other run used (the znodes stay in ZooKeeper).
fn unique(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{test}-{}-{nanos}", std::process::id())
}

/// Ports of a test's machines (UDP, and TCP over the tcp fabric): tests run in parallel.
/// Between ZooKeeper's (21810 on) and Linux's ephemeral ports (32768 on), which outgoing
/// connections hold and a listener cannot share.
fn base_port(test: u16) -> String {
    assert!(test < 8, "a test's ports past its binary's range");
    (22_000 + (std::process::id() % 330) as u16 * 32 + test * 4).to_string()
}

struct Local<'a> {
    dir: &'a Path,
    args: Vec<String>,
}

impl<'a> Local<'a> {
    /// A cluster of its own for test number `test` in `dir`.
    fn new(dir: &'a Path, test: &str, zookeeper: String, number: u16, region_mb: u16) -> Self {
        let args = [
            "--cluster",
            &unique(test),
            "--zookeeper",
            &zookeeper,
            "--base-port",
            &base_port(number),
            "--region-mb",
            &region_mb.to_string(),
        ];
        Self {
            dir,
            args: args.iter().map(|a| a.to_string()).collect(),
        }
    }

    fn run(&self, words: &[&str]) -> Output {
        self.run_with(words, &[])
    }

    /// `farm-node local <words> <settings> -- <machine_args>` (arguments for every machine).
    fn run_with(&self, words: &[&str], machine_args: &[&str]) -> Output {
        let out = Command::new(env!("CARGO_BIN_EXE_farm-node"))
            .arg("local")
            .args(words)
            .args(&self.args)
            .args(if machine_args.is_empty() {
                &[][..]
            } else {
                &["--"][..]
            })
            .args(machine_args)
            .current_dir(self.dir)
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        eprintln!(
            "farm-node local {words:?}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn ok(&self, words: &[&str]) -> String {
        self.ok_with(words, &[])
    }

    fn ok_with(&self, words: &[&str], machine_args: &[&str]) -> String {
        let out = self.run_with(words, machine_args);
        assert!(out.status.success(), "farm-node local {words:?} failed");
        String::from_utf8(out.stdout).unwrap()
    }

    /// Waits until `ok` holds, failing with `what` and the end of every machine's log after a
    /// while.
    fn wait_until(&self, what: &str, mut ok: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ok() {
            if Instant::now() > deadline {
                for m in 0..3 {
                    let log = self.log(m);
                    let lines: Vec<&str> = log.lines().collect();
                    eprintln!(
                        "machine {m}:\n{}",
                        lines[lines.len().saturating_sub(20)..].join("\n")
                    );
                }
                panic!("never: {what}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Machine `m`'s log (every start of it since the cluster's last `start`).
    fn log(&self, m: u16) -> String {
        let data = self.dir.join("farm-data").join(&self.args[1]);
        std::fs::read_to_string(data.join(format!("m{m}.log"))).unwrap_or_default()
    }

    /// `status` until it shows `configuration <id>` with these members (reconfiguration and
    /// the status read race).
    fn wait_status(&self, expected: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let status = self.ok(&["status"]);
            if status.contains(expected) {
                return status;
            }
            assert!(Instant::now() < deadline, "never {expected:?}:\n{status}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Stops the test's machine processes however the test ends: they run until killed.
struct StopOnDrop<'a>(&'a Local<'a>);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.run(&["stop"]);
    }
}

/// Start, status, kill, rejoin, stop everything, restart from NVRAM: the launcher's commands
/// and what the cluster does under them (FaRM §5.2 removal and joining, §5 durability).
#[test]
fn a_local_cluster_is_started_failed_rejoined_stopped_and_restarted() {
    started_failed_rejoined_stopped_and_restarted(0, &[]);
}

/// The same with `--fabric tcp`: the machines listen on loopback at the base port on, each
/// serving its peers' one-sided operations from its NIC threads.
#[test]
fn a_local_tcp_cluster_is_started_failed_rejoined_stopped_and_restarted() {
    started_failed_rejoined_stopped_and_restarted(3, &["--fabric", "tcp"]);
}

fn started_failed_rejoined_stopped_and_restarted(test: u16, flags: &[&str]) {
    let Some(zk) = zookeeper() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut local = Local::new(dir.path(), "launcher", zk, test, 4);
    local
        .args
        .extend(["--stats-seconds".to_string(), "1".to_string()]);
    local.args.extend(flags.iter().map(|f| f.to_string()));
    let _stop = StopOnDrop(&local);
    let started = local.ok(&["start"]);
    assert!(
        started.contains("configuration 1: members [0, 1, 2], CM 0"),
        "{started}"
    );
    for m in 0..3 {
        assert!(
            started.contains(&format!("machine {m}: running (pid")),
            "{started}"
        );
    }
    let again = local.run(&["start"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already runs"));

    assert!(local.ok(&["kill", "2"]).contains("killed machine 2"));
    let removed = local.wait_status("configuration 2: members [0, 1], CM 0");
    assert!(
        removed.contains("machine 2: not running, not a member"),
        "{removed}"
    );
    let fabric = if flags.contains(&"tcp") {
        "tcp fabric (machines at 127.0.0.1:"
    } else {
        "shm fabric"
    };
    assert!(removed.contains(fabric), "{removed}");
    assert!(local.ok(&["restart", "2"]).contains("machine 2 rejoined"));
    let rejoined = local.wait_status("configuration 3: members [0, 1, 2], CM 0");
    assert!(rejoined.contains("machine 2: running (pid"), "{rejoined}");

    // `stop` is the power signal (SIGTERM): each machine writes its NVRAM back, says so in its
    // log, and exits by itself.
    let stopped = local.ok(&["stop"]);
    assert!(
        stopped.contains("stopped machines [0, 1, 2] at once, each writing its NVRAM back first;"),
        "{stopped}"
    );
    let data = dir.path().join("farm-data").join(&local.args[1]);
    for m in 0..3 {
        let log = std::fs::read_to_string(data.join(format!("m{m}.log"))).unwrap();
        assert!(
            log.contains(&format!("farm-node: machine {m} wrote "))
                && log.contains("NVRAM mappings (")
                && log.contains("on a power signal (15), and stops"),
            "machine {m} did not write its NVRAM back:\n{log}"
        );
    }
    let restarted = local.ok(&["start", "--restart"]);
    assert!(
        restarted.contains("configuration 4: members [0, 1, 2], CM 0"),
        "{restarted}"
    );
    // Each machine logs statistics every second; status shows the last.
    for m in 0..3 {
        local.wait_status(&format!(
            "  last stats: machine={m} config=4 members=[0, 1, 2]"
        ));
    }
}

/// TATP from three machine processes: every machine runs the mix, no transaction fails, and
/// the database's integrity holds afterwards (checked by machine 0).
#[test]
fn tatp_runs_across_machine_processes() {
    let Some(zk) = zookeeper() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = Local::new(dir.path(), "tatp", zk, 1, 16);
    let out = local.ok(&["tatp", "--subscribers", "2000", "--seconds", "1", "--check"]);
    for m in 0..3 {
        assert!(out.contains(&format!("machine {m}: ")), "{out}");
    }
    assert!(out.contains(" 0 errors"), "{out}");
    assert!(
        out.contains("integrity check passed: 2000 subscribers"),
        "{out}"
    );
    let runs = dir.path().join("farm-data");
    let left: Vec<_> = std::fs::read_dir(runs.join(local.args[1].clone()).join("runs"))
        .map(|d| d.collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "the run's directory was not removed");
}

/// TPC-C from three machine processes, one warehouse each: no transaction fails, NEW-ORDERs
/// commit on every machine, and consistency conditions 1 to 4 hold afterwards.
#[test]
fn tpcc_runs_across_machine_processes() {
    let Some(zk) = zookeeper() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = Local::new(dir.path(), "tpcc", zk, 3, 64);
    let out = local.ok(&["tpcc", "--warehouses", "3", "--seconds", "1", "--check"]);
    for m in 0..3 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("  machine {m}: ")))
            .unwrap_or_else(|| panic!("no line for machine {m}: {out}"));
        assert!(line.contains(" 0 errors"), "{line}");
        assert!(!line.contains(" 0 committed NEW-ORDERs"), "{line}");
    }
    assert!(
        out.contains("integrity check passed: consistency conditions 1-4 hold for 3 warehouses"),
        "{out}"
    );
}

/// Bad settings fail at start, naming the problem: an unknown key in the file, a missing or
/// world-readable secret, an unreachable ZooKeeper, and an NVRAM directory that belongs to
/// another cluster.
#[test]
fn bad_settings_fail_at_start_with_a_clear_message() {
    let Some(zk) = zookeeper() else { return };
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_farm-node"))
            .arg("run")
            .args(args)
            .current_dir(dir.path())
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} started");
        String::from_utf8(out.stderr).unwrap()
    };
    std::fs::write(dir.path().join("node.toml"), "machines = 1\nlease = 20\n").unwrap();
    let e = run(&["--machine", "0", "--config", "node.toml"]);
    assert!(
        e.contains("node.toml") && e.contains("unknown field `lease`"),
        "{e}"
    );
    // A machine needs the cluster's secret, in a file only its owner may read.
    let e = run(&["--machine", "0", "--machines", "1"]);
    assert!(
        e.contains("the cluster's secret") && e.contains("farm-data/farm/secret"),
        "{e}"
    );
    let secret = |path: &std::path::Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, [7u8; 32]).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
    };
    secret(&dir.path().join("farm-data/farm/secret"));
    let e = run(&["--machine", "0", "--machines", "1"]);
    assert!(e.contains("chmod 600"), "{e}");
    for path in [
        dir.path().join("farm-data/farm/secret"),
        dir.path().join("shared/secret"),
    ] {
        secret(&path);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let e = run(&["--machine", "0", "--config", "node.toml"]);
    assert!(
        e.contains("node.toml") && e.contains("unknown field `lease`"),
        "{e}"
    );
    let e = run(&[
        "--machine",
        "0",
        "--machines",
        "1",
        "--zookeeper",
        "127.0.0.1:9",
        "--start-timeout-seconds",
        "1",
    ]);
    assert!(e.contains("ZooKeeper at 127.0.0.1:9"), "{e}");
    let e = run(&["--machine", "3", "--machines", "3"]);
    assert!(
        e.contains("--machine 3: the cluster has machines 0 to 2"),
        "{e}"
    );
    // A directory stamped by one cluster refuses a machine of another.
    let shared = dir.path().join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    std::fs::write(shared.join("cluster"), "0x1234\n").unwrap();
    let e = run(&[
        "--machine",
        "0",
        "--machines",
        "1",
        "--cluster",
        &unique("other"),
        "--dir",
        shared.to_str().unwrap(),
        "--zookeeper",
        &zk,
        "--base-port",
        &base_port(2),
    ]);
    assert!(e.contains("belongs to cluster 0x1234"), "{e}");
}

/// The path of example `name`, built beside this test by `cargo test`.
fn example(name: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: `cargo test -p farm-node` builds it (or `cargo build -p farm-node \
         --example {name}` in this profile)",
        path.display()
    );
    path.display().to_string()
}

/// A program of one's own as the machines (`examples/bank.rs`, on `farm_node::run`, started
/// by the launcher with `--program`): three processes of it transfer money, one is killed in
/// the middle (the other two go on without it once the configuration removed it) and started
/// again (it rejoins, and its transfers go on), every machine is stopped with the power signal
/// (each writes its NVRAM back while its transfers are in flight), and the cluster restarted
/// from NVRAM with `-- --audit` finds the money whole and, for every machine, at least the
/// transfers it acknowledged. Meanwhile each machine serves Prometheus metrics
/// (`--metrics-addr`), scraped over HTTP: commits grow under the workload, and the kill moves
/// the configuration, the members, the suspicions and the reconfigurations; `local status`
/// shows them.
#[test]
fn a_program_of_ones_own_runs_as_the_machines_through_a_kill_and_a_power_signal() {
    bank_through_a_kill_and_a_power_signal(4, &[], Some(6));
}

/// The same over the `tcp` fabric (without metrics).
#[test]
fn a_program_of_ones_own_runs_as_the_machines_over_tcp() {
    bank_through_a_kill_and_a_power_signal(5, &["--fabric", "tcp"], None);
}

/// The value of the sample `name{labels}` (`name` alone without labels) in the OpenMetrics
/// text `text`.
fn sample(text: &str, name: &str, labels: &str) -> f64 {
    let key = if labels.is_empty() {
        format!("{name} ")
    } else {
        format!("{name}{{{labels}}} ")
    };
    let line = (text.lines().find(|l| l.starts_with(&key)))
        .unwrap_or_else(|| panic!("no {key:?} in the metrics:\n{text}"));
    line[key.len()..].parse().unwrap()
}

/// With `metrics_ports`, the machines serve metrics at the ports of that test number on.
fn bank_through_a_kill_and_a_power_signal(test: u16, flags: &[&str], metrics_ports: Option<u16>) {
    let Some(zk) = zookeeper() else { return };
    let program = example("bank");
    let dir = tempfile::tempdir().unwrap();
    let mut local = Local::new(dir.path(), "bank", zk, test, 16);
    local.args.extend(["--program".to_string(), program]);
    local.args.extend(flags.iter().map(|f| f.to_string()));
    let metrics_port: Option<u16> = metrics_ports.map(|t| base_port(t).parse().unwrap());
    if let Some(port) = metrics_port {
        local
            .args
            .extend(["--metrics-addr".into(), format!("127.0.0.1:{port}")]);
    }
    // Machine `m`'s metrics, scraped over HTTP, and the value of one of its samples.
    let scrape = |m: u16| {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], metrics_port.unwrap() + m));
        farm_node::scrape(addr).unwrap_or_else(|e| panic!("scraping machine {m}: {e}"))
    };
    let value = |m: u16, name: &str| sample(&scrape(m), name, &format!("machine=\"{m}\""));
    let _stop = StopOnDrop(&local);
    // The most transfers machine `m` said were acknowledged (`bank: acked N`).
    let acked = |m: u16| -> u64 {
        (local.log(m).lines())
            .filter_map(|l| l.strip_prefix("bank: acked ")?.parse().ok())
            .max()
            .unwrap_or(0)
    };
    local.ok(&["start"]);
    local.wait_until("every machine acknowledged transfers", || {
        (0..3).all(|m| acked(m) > 0)
    });
    if metrics_port.is_some() {
        for m in 0..3 {
            let text = scrape(m);
            let labels = format!("machine=\"{m}\"");
            assert!(sample(&text, "farm_commits_total", &labels) > 0.0, "{text}");
            assert_eq!(sample(&text, "farm_configuration", &labels), 1.0);
            assert_eq!(sample(&text, "farm_members", &labels), 3.0);
            let is_cm = if m == 0 { 1.0 } else { 0.0 };
            assert_eq!(sample(&text, "farm_is_cm", &labels), is_cm);
            assert!(sample(&text, "farm_commit_latency_seconds_count", &labels) > 0.0);
            for peer in (0..3).filter(|p| *p != m) {
                let labels = format!("{labels},peer=\"{peer}\"");
                assert!(sample(&text, "farm_log_held_bytes", &labels) >= 0.0);
            }
        }
        let commits = value(0, "farm_commits_total");
        local.wait_until("machine 0's commits grow", || {
            value(0, "farm_commits_total") > commits
        });
        assert_eq!(sample(&scrape(0), "farm_reconfigurations_total", ""), 0.0);
    }
    assert!(local.ok(&["kill", "2"]).contains("killed machine 2"));
    let at_kill = [acked(0), acked(1)];
    let removed = local.wait_status("configuration 2: members [0, 1], CM 0");
    if metrics_port.is_some() {
        local.wait_until("machine 0 installed configuration 2", || {
            value(0, "farm_configuration") == 2.0
        });
        let text = scrape(0);
        assert_eq!(sample(&text, "farm_members", "machine=\"0\""), 2.0);
        assert!(sample(&text, "farm_suspicions_total", "machine=\"0\"") >= 1.0);
        assert_eq!(sample(&text, "farm_reconfigurations_total", ""), 1.0);
        assert!(
            removed.contains("metrics (http://127.0.0.1:")
                && removed.contains("    farm_commits_total{machine=\"0\"} "),
            "{removed}"
        );
    }
    local.wait_until("machines 0 and 1 transfer without machine 2", || {
        acked(0) > at_kill[0] + 100 && acked(1) > at_kill[1] + 100
    });
    let before_rejoin = acked(2);
    assert!(local.ok(&["restart", "2"]).contains("machine 2 rejoined"));
    local.wait_until("machine 2 transfers again", || {
        acked(2) > before_rejoin + 100
    });
    if metrics_port.is_some() {
        // Machine 2's new incarnation serves at the same address, in configuration 3.
        assert_eq!(value(2, "farm_configuration"), 3.0);
        assert!(value(2, "farm_commits_total") > 0.0);
    }

    let stopped = local.ok(&["stop"]);
    assert!(
        stopped.contains("stopped machines [0, 1, 2] at once, each writing its NVRAM back first;"),
        "{stopped}"
    );
    for m in 0..3 {
        let log = local.log(m);
        assert!(
            log.contains(&format!("farm-node: machine {m} wrote "))
                && log.contains("on a power signal (15), and stops"),
            "machine {m} did not write its NVRAM back:\n{log}"
        );
    }
    let acked: Vec<u64> = (0..3).map(acked).collect();

    local.ok_with(&["start", "--restart"], &["--audit"]);
    let mut audits = Vec::new();
    local.wait_until("every machine audited the bank", || {
        audits = (0..3)
            .filter_map(|m| {
                let log = local.log(m);
                let line = log.lines().find(|l| l.starts_with("bank: audit: "))?;
                Some(line.to_string())
            })
            .collect();
        audits.len() == 3
    });
    for audit in &audits {
        assert!(
            audit.contains("1000 accounts hold 1000000 (as opened)"),
            "{audit}"
        );
        let (_, counted) = audit.split_once("transfers by machine ").unwrap();
        for (m, n) in counted.split(' ').enumerate() {
            let counted: u64 = n
                .strip_prefix(&format!("{m}="))
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{audit}"));
            assert!(
                counted >= acked[m],
                "machine {m} acknowledged {} transfers, the restarted bank counts {counted}",
                acked[m]
            );
        }
    }
}
