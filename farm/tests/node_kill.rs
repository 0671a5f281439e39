//! Machine processes failing in the middle of a workload (FaRM §5), with the configuration in
//! ZooKeeper: one killed with SIGKILL, one stopped with SIGSTOP past its lease and continued.
//! Their own binary, so that these processes do not share the two cores with other
//! multi-process tests.

use std::time::{Duration, Instant};

mod common;
mod nodes;

use nodes::{Machines, ACCOUNTS, BALANCE, MACHINES};

/// A machine process of the tests below (see `nodes::child_main`).
#[test]
#[ignore = "a child process of the multi-process tests"]
fn node_child() {
    nodes::child_main();
}

/// SIGKILL a machine process in the middle of transfers (§5): the CM suspects it, removes it
/// through ZooKeeper and NEW-CONFIG over datagrams, transaction recovery decides what it had
/// in flight, its regions get new primaries, and the survivors' transfers go on; the total
/// holds on both survivors. Needs ZooKeeper (`ZK_CONNECT`; under `CI=true` it must be there).
#[test]
fn a_killed_machine_process_is_removed_and_transfers_go_on() {
    let Some(zookeeper) = common::zookeeper("node-kill") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start("kill", 2, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    std::thread::sleep(Duration::from_millis(300));
    machines.signal(2, libc::SIGKILL);
    std::thread::sleep(Duration::from_millis(700));
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    let mut sums = std::collections::BTreeMap::new();
    let mut configs = std::collections::BTreeMap::new();
    let mut transfers = std::collections::BTreeMap::new();
    let mut placements = std::collections::BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while sums.len() < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        match machines.lines.recv_timeout(left) {
            Ok((m, line)) => {
                if let Some(rest) = line.strip_prefix("sum ") {
                    let (sum, _) = rest.split_once(" moved ").unwrap();
                    sums.insert(m, sum.parse::<u64>().unwrap());
                } else if let Some(rest) = line.strip_prefix("config ") {
                    configs.insert(m, rest.to_string());
                } else if let Some(n) = line.strip_prefix("transfers ") {
                    transfers.insert(m, n.parse::<u64>().unwrap());
                } else if let Some(p) = line.strip_prefix("placement ") {
                    placements
                        .entry(m)
                        .or_insert_with(Vec::new)
                        .push(p.to_string());
                } else if line.starts_with("error") {
                    eprintln!("machine {m}: {line}");
                }
            }
            Err(e) => panic!("sums of {sums:?} only ({configs:?}): {e}"),
        }
    }
    let total = MACHINES as u64 * ACCOUNTS * BALANCE;
    assert_eq!(
        sums,
        std::collections::BTreeMap::from([(0, total), (1, total)]),
        "the total did not hold"
    );
    for m in [0u16, 1] {
        let c = &configs[&m];
        assert!(
            c.ends_with("members 0,1"),
            "machine {m} is in {c}, not a configuration without the killed machine"
        );
        assert!(transfers[&m] > 0, "machine {m} made no transfer");
    }
    // Re-replication (§5.4): the regions the killed machine held have a new replica on the
    // third machine, and every backup equals its primary.
    assert_eq!(
        placements[&0], placements[&1],
        "survivors disagree on the map"
    );
    let holders = |p: &String| -> Vec<String> {
        let f: Vec<&str> = p.split(' ').collect();
        std::iter::once(f[1].to_string())
            .chain(f[2].split(',').map(str::to_string))
            .collect()
    };
    assert!(
        placements[&0]
            .iter()
            .all(|p| holders(p).len() == 2 && !holders(p).contains(&"2".to_string())),
        "not two replicas on the survivors: {:?}",
        placements[&0]
    );
    let objects = Machines::check_replicas(dir.path(), &placements[&0]);
    assert!(objects > 0, "no object compared");
}

/// SIGSTOP a machine process for ten leases in the middle of transfers, then SIGCONT it
/// (§5.2, precise membership): the CM removes it meanwhile; continued, it finds its CM silent,
/// reads the newer configuration without it from ZooKeeper and stops as evicted. Its writes
/// are refused by the members, so the total holds on both survivors.
#[test]
fn a_stopped_machine_is_removed_and_corrupts_nothing_when_continued() {
    let Some(zookeeper) = common::zookeeper("node-stop") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start("kill", 3, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    std::thread::sleep(Duration::from_millis(300));
    machines.signal(2, libc::SIGSTOP);
    std::thread::sleep(nodes::KILL_LEASE * 10);
    machines.signal(2, libc::SIGCONT);
    let mut evicted = false;
    let mut sums = std::collections::BTreeMap::new();
    let mut configs = std::collections::BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !evicted || sums.len() < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        match machines.lines.recv_timeout(left) {
            Ok((m, line)) => {
                if line.starts_with("evicted") {
                    assert_eq!(m, 2, "machine {m} evicted");
                    evicted = true;
                    std::fs::write(dir.path().join("stop"), b"").unwrap();
                } else if let Some(rest) = line.strip_prefix("sum ") {
                    let (sum, _) = rest.split_once(" moved ").unwrap();
                    sums.insert(m, sum.parse::<u64>().unwrap());
                } else if let Some(rest) = line.strip_prefix("config ") {
                    configs.insert(m, rest.to_string());
                }
            }
            Err(e) => panic!("evicted {evicted}, sums {sums:?} ({configs:?}): {e}"),
        }
    }
    let total = MACHINES as u64 * ACCOUNTS * BALANCE;
    assert_eq!(
        sums,
        std::collections::BTreeMap::from([(0, total), (1, total)]),
        "the total did not hold"
    );
    for m in [0u16, 1] {
        let c = &configs[&m];
        assert!(c.ends_with("members 0,1"), "machine {m} is in {c}");
    }
}
