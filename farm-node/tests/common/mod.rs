//! What the multi-process tests of `farm-node` share: ZooKeeper from the environment, names
//! and ports of their own, and `farm-node local` run against a cluster in a directory.
#![allow(dead_code)] // Not every test binary that shares this module uses all of it.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub fn zookeeper() -> Option<String> {
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
pub fn unique(test: &str) -> String {
    // Tests of one binary start together and may read the same time: a count tells them
    // apart.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{test}-{}-{call}-{nanos}", std::process::id())
}

/// Ports of a test's machines (UDP, and TCP over the tcp fabric): tests run in parallel.
/// Between ZooKeeper's (21810 on) and Linux's ephemeral ports (32768 on), which outgoing
/// connections hold and a listener cannot share.
pub fn base_port(test: u16) -> String {
    assert!(test < 8, "a test's ports past its binary's range");
    (22_000 + (std::process::id() % 330) as u16 * 32 + test * 4).to_string()
}

pub struct Local<'a> {
    pub dir: &'a Path,
    pub args: Vec<String>,
}

impl<'a> Local<'a> {
    /// A cluster of its own for test number `test` in `dir`.
    pub fn new(dir: &'a Path, test: &str, zookeeper: String, number: u16, region_mb: u16) -> Self {
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

    pub fn run(&self, words: &[&str]) -> Output {
        self.run_with(words, &[])
    }

    /// `farm-node local <words> <settings> -- <machine_args>` (arguments for every machine).
    pub fn run_with(&self, words: &[&str], machine_args: &[&str]) -> Output {
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

    pub fn ok(&self, words: &[&str]) -> String {
        self.ok_with(words, &[])
    }

    pub fn ok_with(&self, words: &[&str], machine_args: &[&str]) -> String {
        let out = self.run_with(words, machine_args);
        assert!(out.status.success(), "farm-node local {words:?} failed");
        String::from_utf8(out.stdout).unwrap()
    }

    /// Waits until `ok` holds, failing with `what` and the end of every machine's log after a
    /// while.
    pub fn wait_until(&self, what: &str, mut ok: impl FnMut() -> bool) {
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
    pub fn log(&self, m: u16) -> String {
        let data = self.dir.join("farm-data").join(&self.args[1]);
        std::fs::read_to_string(data.join(format!("m{m}.log"))).unwrap_or_default()
    }

    /// `status` until it shows `configuration <id>` with these members (reconfiguration and
    /// the status read race).
    /// A `status` that could not reach ZooKeeper is asked again: the test server has stalled
    /// for seconds on this 2-core machine while busy clusters ran, which is not what these
    /// tests check.
    pub fn wait_status(&self, expected: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = self.run(&["status"]);
            let status = String::from_utf8(out.stdout).unwrap();
            let unreachable =
                String::from_utf8_lossy(&out.stderr).contains("connecting to ZooKeeper");
            assert!(
                out.status.success() || unreachable,
                "farm-node local status failed"
            );
            if status.contains(expected) {
                return status;
            }
            assert!(Instant::now() < deadline, "never {expected:?}:\n{status}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Stops the test's machine processes however the test ends: they run until killed.
pub struct StopOnDrop<'a>(pub &'a Local<'a>);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.run(&["stop"]);
    }
}
