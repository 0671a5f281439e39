//! Machine processes failing in the middle of a workload (FaRM §5), with the configuration in
//! ZooKeeper: one killed with SIGKILL, one stopped with SIGSTOP past its lease and continued.
//! Their own binary, so that these processes do not share the two cores with other
//! multi-process tests.

use std::time::Duration;

mod common;
mod nodes;

use nodes::{Machines, Net};

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
    killed_machine_is_removed(Net::Shm, 2, "node-kill");
}

/// The same over the `tcp` fabric, each machine with a directory of its own: the killed
/// process's connections close, and its peers' operations to it fail at once.
#[test]
fn a_killed_machine_process_is_removed_and_transfers_go_on_over_tcp() {
    killed_machine_is_removed(Net::Loopback, 4, "node-kill-tcp");
}

fn killed_machine_is_removed(net: Net, test: u16, znode: &str) {
    let Some(zookeeper) = common::zookeeper(znode) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start_on(&net, "kill", test, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    std::thread::sleep(Duration::from_millis(300));
    machines.signal(2, libc::SIGKILL);
    std::thread::sleep(Duration::from_millis(700));
    // The survivors report once they are in a configuration without machine 2.
    nodes::stop_after_removal_of(dir.path(), 2);
    let ends = machines.ends(|e| e.sums.len() == 2, |_, _| {});
    ends.assert_survivors_hold_the_total();
    for m in [0u16, 1] {
        assert!(ends.transfers[&m] > 0, "machine {m} made no transfer");
    }
    // Re-replication (§5.4): the regions the killed machine held have a new replica on the
    // third machine, and every backup equals its primary.
    let placements = &ends.placements;
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
    let objects = machines.check_replicas(dir.path(), &placements[&0]);
    assert!(objects > 0, "no object compared");
}

/// SIGSTOP a machine process for ten leases in the middle of transfers, then SIGCONT it
/// (§5.2, precise membership): the CM removes it meanwhile; continued, it finds its CM silent,
/// reads the newer configuration without it from ZooKeeper and stops as evicted. Its writes
/// are refused by the members, so the total holds on both survivors.
#[test]
fn a_stopped_machine_is_removed_and_corrupts_nothing_when_continued() {
    stopped_machine_is_removed(Net::Shm, 3, "node-stop");
}

/// The same over the `tcp` fabric: the stopped process answers nothing, so its peers'
/// operations to it time out, and their links to it stay down.
#[test]
fn a_stopped_machine_is_removed_and_corrupts_nothing_when_continued_over_tcp() {
    stopped_machine_is_removed(Net::Loopback, 5, "node-stop-tcp");
}

fn stopped_machine_is_removed(net: Net, test: u16, znode: &str) {
    let Some(zookeeper) = common::zookeeper(znode) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start_on(&net, "kill", test, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    std::thread::sleep(Duration::from_millis(300));
    machines.signal(2, libc::SIGSTOP);
    std::thread::sleep(nodes::KILL_LEASE * 10);
    machines.signal(2, libc::SIGCONT);
    let ends = machines.ends(
        |e| !e.evicted.is_empty() && e.sums.len() == 2,
        |m, line| {
            if line.starts_with("evicted") {
                assert_eq!(m, 2, "machine {m} evicted");
                nodes::stop_after_removal_of(dir.path(), 2);
            }
        },
    );
    ends.assert_survivors_hold_the_total();
}
