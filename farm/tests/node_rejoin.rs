//! A machine process removed from the configuration rejoins it (FaRM §5.2: precise membership
//! keeps the removed machine from acting; a new incarnation joins through the CM), with the
//! configuration in ZooKeeper. Its own binary, so that these processes do not share the two
//! cores with other multi-process tests.

use std::collections::BTreeMap;
use std::time::Duration;

mod common;
mod nodes;

use nodes::{Machines, Net};

/// A machine process of the test below (see `nodes::child_main`).
#[test]
#[ignore = "a child process of the multi-process tests"]
fn node_child() {
    nodes::child_main();
}

/// Three processes transfer money among each other's accounts, every region with a replica on
/// each. Machine 2 is stopped with SIGSTOP for ten leases and continued: it was removed
/// meanwhile and stops as evicted; it then starts a new node that forgets its NVRAM and asks
/// the CM to add it. The CM adds it once its configuration is settled, every member starts its
/// rings with it afresh, and data recovery copies every region to it (§5.4). It transfers
/// again; at the end all three are in one configuration, the total holds everywhere, and every
/// region's three replicas are equal, the rejoined machine's included.
#[test]
fn an_evicted_machine_rejoins_and_receives_its_replicas_again() {
    evicted_machine_rejoins(Net::Shm, 0, "node-rejoin");
}

/// The same over the `tcp` fabric: the members' links to the stopped machine broke when it
/// stopped answering, and connect again only to its new incarnation, once they admit it.
#[test]
fn an_evicted_machine_rejoins_and_receives_its_replicas_again_over_tcp() {
    evicted_machine_rejoins(Net::Loopback, 1, "node-rejoin-tcp");
}

fn evicted_machine_rejoins(net: Net, test: u16, znode: &str) {
    let Some(zookeeper) = common::zookeeper(znode) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start_on(&net, "rejoin", test, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    std::thread::sleep(Duration::from_millis(300));
    machines.signal(2, libc::SIGSTOP);
    std::thread::sleep(nodes::KILL_LEASE * 10);
    machines.signal(2, libc::SIGCONT);
    let ends = machines.ends_after_rejoin(dir.path());
    machines.check_rejoined(dir.path(), &ends);
}

/// Over the `tcp` fabric, the connections to machine 2 are reset (`ss -K`) while every process
/// runs and keeps its leases (UDP). Each link is repaired in place: the writer connects again,
/// resuming its session, and sends again the writes machine 2's NIC says it did not take (a
/// log write must not land after an earlier one was lost, nor twice). Nobody is removed,
/// transfers go on everywhere, the total holds and the replicas are equal. Before the repair,
/// the links stayed down, and the CM removed machine 2, which rejoined as a new incarnation.
#[test]
fn a_machine_whose_connections_reset_stays_a_member_over_tcp() {
    connections_reset(2, false);
}

/// The same with only machine 1's connection to machine 2 reset (before the repair, machine
/// 1, not the CM, told the CM, which removed machine 2).
#[test]
fn a_machine_that_another_member_could_not_reach_for_a_moment_stays_a_member_over_tcp() {
    connections_reset(3, true);
}

/// Resets the connections to machine 2 (from machine 1 only, with `one`) in the middle of
/// transfers, then checks that the links were repaired with nobody removed.
fn connections_reset(test: u16, one: bool) {
    let Some(zookeeper) = common::zookeeper("node-reset-tcp") else {
        return;
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but not root: resetting connections (ss -K) must run in CI"
        );
        eprintln!("skipping the connection reset test: ss -K needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start_on(&Net::Loopback, "rejoin", test, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    machines.progress(&[0, 1, 2], nodes::PROGRESS_EVERY * 2);
    let port = (nodes::base_port(test) + 2).to_string();
    let mut filter = vec!["dst", "127.0.0.1", "dport", "=", &port];
    // Machine 1's connection to machine 2: its local port, from the socket machine 1 owns.
    let sport;
    if one {
        let list = std::process::Command::new("ss")
            .args(["-tnpH", "dst", "127.0.0.1", "dport", "=", &port])
            .output()
            .expect("ss (iproute2, which .ci/run installs)");
        let pid = format!("pid={},", machines.pid(1));
        let line = String::from_utf8_lossy(&list.stdout)
            .lines()
            .find(|l| l.contains(&pid))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("machine 1 has no connection to machine 2: {list:?}"));
        // `ESTAB 0 0 127.0.0.1:<sport> 127.0.0.1:<port> users:...`
        sport = line
            .split_whitespace()
            .nth(3)
            .unwrap()
            .rsplit(':')
            .next()
            .unwrap()
            .to_string();
        filter.extend(["sport", "=", &sport]);
    }
    let before = machines.progress(&[0, 1, 2], 0);
    let reset = std::process::Command::new("ss")
        .args(["-K", "-t"])
        .args(&filter)
        .output()
        .expect("ss (iproute2, which .ci/run installs)");
    assert!(reset.status.success(), "ss -K: {reset:?}");
    // A header, then the connections it reset.
    let killed = String::from_utf8_lossy(&reset.stdout).lines().count() - 1;
    assert!(killed >= 1, "ss -K reset no connection: {reset:?}");
    // Past the time a link under repair is reported broken (the fabric's timeout, four
    // leases), every machine transfers on.
    std::thread::sleep(nodes::KILL_LEASE * 10);
    for m in 0..3 {
        machines.progress(&[m], before[&m] + nodes::PROGRESS_EVERY * 2);
    }
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    let ends = machines.ends(|e| e.sums.len() == 3, |_, _| {});
    assert!(ends.evicted.is_empty(), "evicted: {:?}", ends.evicted);
    let total = 3 * nodes::ACCOUNTS * nodes::BALANCE;
    assert_eq!(
        ends.sums,
        BTreeMap::from([(0, total), (1, total), (2, total)]),
        "the total did not hold"
    );
    for m in 0..3 {
        assert!(
            ends.configs[&m].ends_with(" members 0,1,2") && ends.configs[&m] == ends.configs[&0],
            "machine {m} ended in {}, machine 0 in {}",
            ends.configs[&m],
            ends.configs[&0]
        );
    }
    let objects = machines.check_replicas(dir.path(), &ends.placements[&0]);
    assert!(objects > 0, "no object compared");
}
