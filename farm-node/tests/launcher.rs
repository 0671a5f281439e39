//! The `farm-node` binary end to end, with ZooKeeper (`ZK_CONNECT`; under `CI=true` it must be
//! there): a local cluster of three machine processes started, inspected, one machine killed
//! and started again (it rejoins), every machine stopped at once and the cluster restarted
//! from NVRAM, TATP and TPC-C run across processes with their integrity checks, and bad
//! settings refused with messages that name the problem.

use std::process::Command;

mod common;

use common::{base_port, unique, zookeeper, Local, StopOnDrop};

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

/// A machine process killed in the middle of a TATP run (`--kill-after`, on its own clock),
/// here machine 0, the CM: the others go on without a failed transaction, the report times
/// its suspicion and the return to 80% of the throughput before (both seen, within the run)
/// and lists no suspicion of a live machine, and the integrity check asked for runs on a
/// machine that lived (machine 0 checks when it is not the one killed; with it killed, no
/// check ran and the report said nothing of it).
#[test]
fn a_machine_killed_mid_run_is_reported_with_its_recovery_time() {
    let Some(zk) = zookeeper() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = Local::new(dir.path(), "kill", zk, 5, 16);
    // The run's directory is kept, so that a failed assertion shows the machines' logs.
    let out = local.ok(&[
        "tatp",
        "--subscribers",
        "2000",
        "--seconds",
        "3",
        "--kill-after",
        "1",
        "--victim",
        "0",
        "--check",
        "--keep",
    ]);
    let logs = || run_logs(dir.path(), &local);
    for m in 1..3 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("  machine {m}: ")))
            .unwrap_or_else(|| panic!("no line for machine {m}: {out}{}", logs()));
        assert!(line.contains(" 0 errors"), "{line}{}", logs());
    }
    assert!(!out.contains("  machine 0: "), "{out}{}", logs());
    assert!(
        out.contains("integrity check passed: 2000 subscribers"),
        "{out}{}",
        logs()
    );
    let report = out
        .lines()
        .find(|l| l.starts_with("killed machine 0 at "))
        .unwrap_or_else(|| panic!("no failure report: {out}{}", logs()));
    let number_before = |what: &str| -> f64 {
        let at = report
            .find(what)
            .unwrap_or_else(|| panic!("{report}{}", logs()))
            + what.len();
        let word = report[at..].split(' ').next().unwrap();
        word.parse()
            .unwrap_or_else(|_| panic!("{what:?} is followed by {word:?}: {report}{}", logs()))
    };
    let suspected = number_before("suspected after ");
    assert!(suspected > 0.0 && suspected < 2000.0, "{report}{}", logs());
    let per_ms = number_before("back to 80% of ");
    assert!(per_ms > 0.0, "{report}{}", logs());
    assert!(
        report.contains(" ms after the suspicion"),
        "{report}{}",
        logs()
    );
    // Machines 1 and 2 lived throughout: neither was suspected, before the kill or after.
    assert!(
        out.contains("\nsuspicions of live machines: none\n"),
        "{out}{}",
        logs()
    );
}

/// The logs of every machine of the workload runs kept under `dir` (`--keep`), their last 60
/// lines each: what a failed assertion about a run shows.
fn run_logs(dir: &std::path::Path, local: &Local<'_>) -> String {
    let runs = dir.join("farm-data").join(&local.args[1]).join("runs");
    let mut shown = String::new();
    for run in std::fs::read_dir(&runs).into_iter().flatten().flatten() {
        let mut logs: Vec<_> = std::fs::read_dir(run.path())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        logs.sort();
        for log in logs {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            shown += &format!(
                "\n--- {} (last 60 lines)\n{}",
                log.display(),
                lines[lines.len().saturating_sub(60)..].join("\n")
            );
        }
    }
    shown
}

/// TPC-C from four machine processes over three warehouses: the three machines a warehouse
/// lives on commit NEW-ORDERs with no transaction failing, the fourth coordinates nothing
/// (TPC-C's clients run where their home warehouse lives) and fails nothing either, and
/// consistency conditions 1 to 4 hold afterwards. (A machine without a warehouse counted
/// every attempt of its clients as a failed transaction, spinning a core that the others
/// needed.)
#[test]
fn tpcc_runs_across_machine_processes() {
    let Some(zk) = zookeeper() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = Local::new(dir.path(), "tpcc", zk, 6, 64);
    let out = local.ok(&[
        "tpcc",
        "--machines",
        "4",
        "--warehouses",
        "3",
        "--seconds",
        "1",
        "--check",
    ]);
    for m in 0..4 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("  machine {m}: ")))
            .unwrap_or_else(|| panic!("no line for machine {m}: {out}"));
        assert!(line.contains(" 0 errors"), "{line}");
        if m < 3 {
            assert!(!line.contains(" 0 committed NEW-ORDERs"), "{line}");
        } else {
            assert!(line.contains(": 0 transactions"), "{line}");
        }
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
    let run = |args: &[&str]| refused(dir.path(), &[&["run"], args].concat());
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

/// A workload run whose settings cannot work is refused by the launcher before it starts any
/// machine process (no ZooKeeper needed: nothing gets that far), with what is wrong.
#[test]
fn a_workload_run_that_cannot_work_is_refused_before_any_machine_starts() {
    let dir = tempfile::tempdir().unwrap();
    let local = |workload: &str, args: &[&str]| {
        let fixed = [
            "local",
            workload,
            "--zookeeper",
            "127.0.0.1:9",
            "--dir",
            "nvram",
        ];
        let stderr = refused(dir.path(), &[&fixed[..], args].concat());
        assert!(
            !stderr.contains("machine processes"),
            "{args:?} started: {stderr}"
        );
        assert!(
            !dir.path().join("nvram").exists(),
            "{args:?} made its directory"
        );
        stderr
    };
    for (workload, after) in [("tatp", "0"), ("tatp", "2"), ("tpcc", "5")] {
        let e = local(workload, &["--seconds", "2", "--kill-after", after]);
        assert!(
            e.contains(&format!("--kill-after {after}"))
                && e.contains("more than 0 and less than the run's 2 s"),
            "{e}"
        );
    }
    for seconds in ["0", "inf"] {
        let e = local("tatp", &["--seconds", seconds]);
        assert!(e.contains("a positive, finite length"), "{e}");
    }
    let e = local("tpcc", &["--clients", "0"]);
    assert!(e.contains("at least one client"), "{e}");
    // Two machines cannot go on after one fails: the survivor is no majority (FaRM §5.2), and
    // the run waited for it for good.
    let e = local(
        "tatp",
        &["--machines", "2", "--seconds", "2", "--kill-after", "1"],
    );
    assert!(
        e.contains("--kill-after") && e.contains("at least 3 machines"),
        "{e}"
    );
    // TPC-C's clients run where their warehouse lives: with the one warehouse's machine
    // failed, nothing would run after it (the report said "back to 80% of 0.0").
    let e = local(
        "tpcc",
        &[
            "--warehouses",
            "1",
            "--seconds",
            "2",
            "--kill-after",
            "1",
            "--victim",
            "0",
        ],
    );
    assert!(e.contains("holds every one of the 1 warehouses"), "{e}");
}

/// A workload run's machine processes end with the launcher that started them, however it
/// ends: killed (as Ctrl-C or a timeout end it, with no clean-up of its own), it left them
/// running, spinning on the cores and holding their ports against the next run.
#[test]
fn a_workload_run_s_machines_end_with_their_launcher() {
    let Some(zk) = zookeeper() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = Local::new(dir.path(), "orphans", zk, 4, 16);
    let launcher = Command::new(env!("CARGO_BIN_EXE_farm-node"))
        .arg("local")
        .args(["tatp", "--subscribers", "2000", "--seconds", "120"])
        .args(&local.args)
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Whatever the test finds, neither the launcher nor a machine of it outlives it.
    let mut run = Run {
        launcher,
        pids: Vec::new(),
    };
    let runs = dir
        .path()
        .join("farm-data")
        .join(&local.args[1])
        .join("runs");
    // The run's machines, once each says it runs: their pids.
    let running = || -> Option<Vec<u32>> {
        let run = std::fs::read_dir(&runs).ok()?.next()?.ok()?.path();
        (0..3)
            .map(|m| {
                let log = std::fs::read_to_string(run.join(format!("m{m}.log"))).ok()?;
                log.contains(&format!("farm-node: machine {m} running"))
                    .then(|| std::fs::read_to_string(run.join(format!("m{m}.pid"))).ok())??
                    .trim()
                    .parse()
                    .ok()
            })
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    run.pids = loop {
        if let Some(pids) = running() {
            break pids;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the run's machines did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    run.launcher.kill().unwrap();
    run.launcher.wait().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while run.pids.iter().any(|p| lives(*p)) {
        assert!(
            std::time::Instant::now() < deadline,
            "machine processes {:?} of {:?} outlived their launcher by 10 s",
            run.pids.iter().filter(|p| lives(**p)).collect::<Vec<_>>(),
            run.pids
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Gone: their pids may be another process's from now on.
    run.pids.clear();
}

/// Whether process `pid` runs: it exists and is no zombie (one that ended stays a zombie until
/// whoever adopted it reaps it).
fn lives(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .rsplit(')')
            .next()
            .unwrap()
            .trim_start()
            .starts_with('Z')
    })
}

/// A workload run's launcher and its machines' pids, killed when dropped (a failed test).
struct Run {
    launcher: std::process::Child,
    pids: Vec<u32>,
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
        for &pid in &self.pids {
            if lives(pid) {
                // SAFETY: kill only sends a signal to a pid.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
    }
}

/// `farm-node args` run in `dir`, which must fail: its standard error.
fn refused(dir: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_farm-node"))
        .args(args)
        .current_dir(dir)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    assert!(!out.status.success(), "{args:?} succeeded");
    String::from_utf8(out.stderr).unwrap()
}
