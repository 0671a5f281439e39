//! Machines on hosts of their own: each process in a network namespace made here
//! (`scripts/netns-hosts.sh`: a veth pair per host into a bridge in a switch namespace, which
//! also runs this test's ZooKeeper), over the `tcp` fabric, each with a directory of its own.
//! One host is partitioned from the others with nftables drops (FaRM §5.2). Needs root and
//! `ip`/`nft` (the script installs them); under `CI=true` it must run.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

mod common;
mod nodes;

use nodes::{Machines, Net, MACHINES};

/// A machine process of the tests below (see `nodes::child_main`).
#[test]
#[ignore = "a child process of the multi-process tests"]
fn node_child() {
    nodes::child_main();
}

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name)
}

/// The namespaces of one test, and the ZooKeeper server in its switch namespace; dropping it
/// stops the server and removes the namespaces.
struct Hosts {
    prefix: String,
    net: String,
    zookeeper: Option<Child>,
}

impl Hosts {
    /// Makes the hosts, or says why it cannot (not root) and returns `None` outside CI.
    fn up() -> Option<Self> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but not root: the network namespace test must run in CI"
            );
            eprintln!("skipping the network namespace test: it needs root");
            return None;
        }
        let pid = std::process::id();
        let hosts = Hosts {
            prefix: format!("fn{}h", pid % 100_000),
            net: format!("10.77.{}", pid % 200),
            zookeeper: None,
        };
        hosts.run(&["up", &hosts.prefix, &MACHINES.to_string(), &hosts.net]);
        Some(hosts)
    }

    fn run(&self, args: &[&str]) {
        let status = Command::new(script("netns-hosts.sh"))
            .args(args)
            .status()
            .unwrap();
        assert!(status.success(), "netns-hosts.sh {args:?}: {status}");
    }

    fn net(&self) -> Net {
        Net::Namespaces(
            (0..MACHINES)
                .map(|m| {
                    (
                        format!("{}{m}", self.prefix),
                        format!("{}.{}", self.net, m + 1).parse().unwrap(),
                    )
                })
                .collect(),
        )
    }

    /// Starts ZooKeeper in the switch namespace, at `<net>.254:2181`; returns the ensemble and
    /// a znode for the test.
    fn zookeeper(&mut self) -> (String, String) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &format!("{}sw", self.prefix)])
            .arg(script("with-zookeeper.sh"))
            .args([
                "bash",
                "-c",
                "echo \"zookeeper $ZK_CONNECT\"; exec sleep 3600",
            ])
            .env("ZK_ADDRESS", format!("{}.254", self.net))
            .env("ZK_PORT", "2181")
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        self.zookeeper = Some(child);
        let line = out
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("zookeeper "))
            .expect("ZooKeeper did not start in the switch namespace");
        let connect = line["zookeeper ".len()..].to_string();
        (connect, format!("/farm-test/netns-{}", std::process::id()))
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if let Some(mut zk) = self.zookeeper.take() {
            // SAFETY: kill(2) of the process group of a child this test spawned.
            unsafe { libc::kill(-(zk.id() as libc::pid_t), libc::SIGTERM) };
            let _ = zk.wait();
        }
        let _ = Command::new(script("netns-hosts.sh"))
            .args(["down", &self.prefix, &MACHINES.to_string()])
            .status();
    }
}

/// Three hosts transfer money among each other's accounts, every region with a replica on
/// each. Host 2 is cut off from the other two (it still reaches ZooKeeper): the majority
/// suspects it, removes it and goes on committing transfers, which with a replica of every
/// region on host 2 needs a configuration without it (§5.2). The minority cannot reconfigure:
/// its probes of the other machines go unanswered, so it never has the majority a new
/// configuration needs, and it commits none. Learning from ZooKeeper that it was removed, it
/// starts a new incarnation that asks to join; once the partition heals, the CM adds it, it
/// receives a replica of every region (§5.4) and transfers again. At the end the total holds
/// everywhere and every region's three replicas are equal.
#[test]
fn a_partitioned_host_is_removed_by_the_majority_and_rejoins_once_healed() {
    let Some(mut hosts) = Hosts::up() else {
        return;
    };
    let zookeeper = hosts.zookeeper();
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start_on(&hosts.net(), "rejoin", 6, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    let before = machines.progress(&[0, 1], nodes::PROGRESS_EVERY * 2);
    let partitioned = Instant::now();
    hosts.run(&["partition", &hosts.prefix, "2", &hosts.net]);
    let most = before.values().max().unwrap();
    let during = machines.progress(&[0, 1], most + 100);
    // Lines the machines printed before the partition may arrive after it and satisfy the
    // wait above at once: heal only once the majority removed machine 2 and machine 2 learned
    // it (from ZooKeeper, which it still reaches). A partition healed before that leaves
    // nobody to rejoin.
    assert!(
        machines.saw(2, "evicted", std::time::Duration::from_secs(30)),
        "machine 2 was not removed within 30 s of the partition"
    );
    eprintln!(
        "partitioned host 2; machines 0 and 1 went from {before:?} to {during:?} transfers, \
         and machine 2 was removed, in {:?}",
        partitioned.elapsed()
    );
    hosts.run(&["heal", &hosts.prefix, "2"]);
    let ends = machines.ends_after_rejoin(dir.path());
    assert_eq!(
        ends.committed_when_evicted.get(&2).map(String::as_str),
        Some("[]"),
        "the partitioned machine committed a configuration"
    );
    machines.check_rejoined(dir.path(), &ends);
}
