//! The CM and its first backup CM fail together (FaRM §5.2 step 1) in a cluster of five
//! machine processes with the configuration in ZooKeeper. Members that suspect the CM wait
//! their turn in the consistent-hashing order of backup CMs; the first backup is dead, so the
//! second takes over one turn later, becomes CM, and the three survivors (a majority of five)
//! commit a configuration without both, recover, and their transfers keep the total. Its own
//! binary: five processes share the two cores with no other test's.

use std::time::Duration;

use farm::Configuration;
use farm_cm::reconfig::backup_cms;

mod common;
mod nodes;

use nodes::{Machines, Net, ACCOUNTS, BALANCE};

/// A machine process of the tests below (see `nodes::child_main`).
#[test]
#[ignore = "a child process of the multi-process tests"]
fn node_child() {
    nodes::child_main();
}

const MACHINES: u16 = 5;

#[test]
fn losing_the_cm_and_its_first_backup_together_still_reconfigures() {
    cm_and_first_backup_killed(Net::Shm, 0, "node-failover");
}

/// The same over the `tcp` fabric: the killed processes' connections close.
#[test]
fn losing_the_cm_and_its_first_backup_together_still_reconfigures_over_tcp() {
    // Five machines take five ports: test 2's range starts past test 0's.
    cm_and_first_backup_killed(Net::Loopback, 2, "node-failover-tcp");
}

fn cm_and_first_backup_killed(net: Net, test: u16, znode: &str) {
    let Some(zookeeper) = common::zookeeper(znode) else {
        return;
    };
    let first = Configuration::initial(MACHINES);
    let backup = backup_cms(&first, MACHINES as usize - 1)[0];
    assert_ne!(backup.0, 0);
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start_n(
        &net,
        MACHINES,
        "failover",
        test,
        dir.path(),
        Some(zookeeper),
    );
    machines.share_accounts(dir.path());
    std::thread::sleep(Duration::from_millis(300));
    machines.signal(0, libc::SIGKILL);
    machines.signal(backup.0, libc::SIGKILL);
    // Transfers among the survivors wait for the new configuration and recovery; then each
    // quiesces (which needs every region active and re-replicated) and reports.
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    let survivors: Vec<u16> = (0..MACHINES)
        .filter(|m| *m != 0 && *m != backup.0)
        .collect();
    let ends = machines.ends(|e| e.sums.len() == survivors.len(), |_, _| {});
    let total = MACHINES as u64 * ACCOUNTS * BALANCE;
    let members: Vec<String> = survivors.iter().map(u16::to_string).collect();
    let members = format!("members {}", members.join(","));
    for m in &survivors {
        assert_eq!(ends.sums[m], total, "the total did not hold at machine {m}");
        let c = &ends.configs[m];
        assert!(
            c.ends_with(&members),
            "machine {m} is in {c}, not a configuration of the survivors ({members})"
        );
        assert!(ends.transfers[m] > 0, "machine {m} made no transfer");
    }
    let placements = &ends.placements[&survivors[0]];
    assert!(
        survivors.iter().all(|m| &ends.placements[m] == placements),
        "survivors disagree on the map"
    );
    let objects = machines.check_replicas(dir.path(), placements);
    assert!(objects > 0, "no object compared");
}
