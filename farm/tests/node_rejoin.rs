//! A machine process removed from the configuration rejoins it (FaRM §5.2: precise membership
//! keeps the removed machine from acting; a new incarnation joins through the CM), with the
//! configuration in ZooKeeper. Its own binary, so that these processes do not share the two
//! cores with other multi-process tests.

use std::collections::BTreeMap;
use std::time::Duration;

mod common;
mod nodes;

use nodes::{Machines, ACCOUNTS, AFTER_REJOIN, BALANCE, MACHINES};

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
    evicted_machine_rejoins(false, 0, "node-rejoin");
}

/// The same over the `tcp` fabric: the members' links to the stopped machine broke when it
/// stopped answering, and connect again only to its new incarnation, once they admit it.
#[test]
fn an_evicted_machine_rejoins_and_receives_its_replicas_again_over_tcp() {
    evicted_machine_rejoins(true, 1, "node-rejoin-tcp");
}

fn evicted_machine_rejoins(tcp: bool, test: u16, znode: &str) {
    let Some(zookeeper) = common::zookeeper(znode) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start_on(tcp, "rejoin", test, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    std::thread::sleep(Duration::from_millis(300));
    machines.signal(2, libc::SIGSTOP);
    std::thread::sleep(nodes::KILL_LEASE * 10);
    machines.signal(2, libc::SIGCONT);
    let mut rejoined = None;
    let ends = machines.ends(
        |e| e.sums.len() == MACHINES as usize,
        |m, line| {
            if let Some(c) = line.strip_prefix("rejoined ") {
                assert_eq!(m, 2, "machine {m} rejoined");
                rejoined = Some(c.parse::<u64>().unwrap());
                std::fs::write(dir.path().join("stop"), b"").unwrap();
            }
        },
    );
    assert!(ends.evicted.contains(&2), "machine 2 was not evicted");
    let rejoined = rejoined.expect("machine 2 did not rejoin");
    let total = MACHINES as u64 * ACCOUNTS * BALANCE;
    assert_eq!(
        ends.sums,
        BTreeMap::from([(0, total), (1, total), (2, total)]),
        "the total did not hold"
    );
    for m in 0..MACHINES {
        let c = &ends.configs[&m];
        assert!(
            c.ends_with("members 0,1,2"),
            "machine {m} is in {c}, not a configuration of all three"
        );
        let id: u64 = c.split(' ').next().unwrap().parse().unwrap();
        assert!(
            id >= rejoined,
            "machine {m} ended in {id}, before the join {rejoined}"
        );
    }
    assert!(ends.transfers[&2] >= AFTER_REJOIN);
    let placements = &ends.placements;
    assert_eq!(
        placements[&0], placements[&1],
        "machines disagree on the map"
    );
    assert_eq!(
        placements[&0], placements[&2],
        "machines disagree on the map"
    );
    assert!(
        placements[&0].iter().all(|p| {
            let f: Vec<&str> = p.split(' ').collect();
            f[1] == "2" || f[2].split(',').any(|b| b == "2")
        }),
        "a region without a replica on the rejoined machine: {:?}",
        placements[&0]
    );
    let objects = machines.check_replicas(dir.path(), &placements[&0]);
    assert!(objects > 0, "no object compared");
}
