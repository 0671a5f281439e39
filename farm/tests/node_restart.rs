//! Every machine process killed at once in the middle of transfers, as a power loss does, and
//! the cluster restarted from its NVRAM directory (FaRM §2, §5: committed transactions are
//! durable through the loss of every machine), with the configuration in ZooKeeper. Its own
//! binary, so that these processes do not share the two cores with other multi-process tests.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

mod common;
mod nodes;

use nodes::{Machines, Net, ACCOUNTS, AFTER_RESTART, BALANCE, MACHINES};

/// A machine process of the test below (see `nodes::child_main`).
#[test]
#[ignore = "a child process of the multi-process tests"]
fn node_child() {
    nodes::child_main();
}

/// Three machine processes transfer money, each transfer also counting itself in a counter of
/// its coordinator, and print every acknowledged count. All three are killed with SIGKILL at
/// once, then started again with `restart`: machine 0 decides the restart configuration from
/// the views in NVRAM and stores it in ZooKeeper, every machine resumes its logs and recovers
/// the transactions they hold (§5.3). Nothing acknowledged is lost (each counter is at least
/// the last count its machine printed, and at most one more: the transfer in flight), the
/// total holds, transfers go on, and every backup equals its primary once quiet. Then the
/// restarted cluster is killed and restarted once more.
#[test]
fn a_cluster_killed_at_once_restarts_from_nvram_with_nothing_lost() {
    killed_at_once_restarts(Net::Shm, 0, "node-restart");
}

/// The same over the `tcp` fabric, each machine with a directory of its own: the other
/// machines send machine 0 what they left (`ControlMsg::Persisted`).
#[test]
fn a_cluster_killed_at_once_restarts_from_nvram_with_nothing_lost_over_tcp() {
    killed_at_once_restarts(Net::Loopback, 1, "node-restart-tcp");
}

fn killed_at_once_restarts(net: Net, test: u16, znode: &str) {
    let Some(zookeeper) = common::zookeeper(znode) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut acked: BTreeMap<u16, u64> = BTreeMap::new();
    {
        let machines = Machines::start_on(&net, "run", test, dir.path(), Some(zookeeper.clone()));
        machines.share_accounts(dir.path());
        // Let transfers run, reading the acknowledgements meanwhile.
        let until = Instant::now() + Duration::from_millis(500);
        while let Ok((m, line)) = machines
            .lines
            .recv_timeout(until.saturating_duration_since(Instant::now()))
        {
            if let Some(n) = line.strip_prefix("acked ") {
                acked.insert(m, n.parse().unwrap());
            }
        }
        for m in 0..MACHINES {
            machines.signal(m, libc::SIGKILL);
        }
        // Every acknowledgement printed before the kill, up to the pipes' ends.
        while let Ok((m, line)) = machines.lines.recv_timeout(Duration::from_secs(10)) {
            if let Some(n) = line.strip_prefix("acked ") {
                acked.insert(m, n.parse().unwrap());
            }
        }
    }
    assert_eq!(
        acked.len(),
        MACHINES as usize,
        "a machine acknowledged no transfer before the kill: {acked:?}"
    );
    let counters = restart_and_check(&net, test, dir.path(), &zookeeper);
    for (m, n) in &acked {
        let c = counters[m];
        assert!(
            (*n..=n + 1).contains(&c),
            "machine {m} acknowledged {n} transfers before the kill, its counter is {c} after \
             the restart"
        );
    }
    // And again, from the first restart's configuration: every counter is where the
    // transfers after the first restart left it.
    let again = restart_and_check(&net, test, dir.path(), &zookeeper);
    for (m, c) in &counters {
        assert_eq!(again[m], c + AFTER_RESTART, "machine {m}'s counter");
    }
}

/// Kills whatever runs on `dir`, restarts the three machines from it and checks the restart
/// (see above); returns the counters they read right after it.
fn restart_and_check(
    net: &Net,
    test: u16,
    dir: &std::path::Path,
    zookeeper: &(String, String),
) -> BTreeMap<u16, u64> {
    let machines = Machines::start_on(net, "restarted", test, dir, Some(zookeeper.clone()));
    let mut counters = BTreeMap::new();
    let mut first_sums = BTreeMap::new();
    // Each machine prints its sum twice: right after the restart and at its end.
    let sums = std::cell::Cell::new(0);
    let ends = machines.ends(
        |_| sums.get() == 2 * MACHINES as usize,
        |m, line| {
            if let Some(n) = line.strip_prefix("counter ") {
                counters.insert(m, n.parse::<u64>().unwrap());
            } else if let Some(rest) = line.strip_prefix("sum ") {
                let (sum, _) = rest.split_once(" moved ").unwrap();
                first_sums.entry(m).or_insert(sum.parse::<u64>().unwrap());
                sums.set(sums.get() + 1);
            } else {
                assert!(!line.starts_with("error"), "machine {m}: {line}");
            }
        },
    );
    let total = MACHINES as u64 * ACCOUNTS * BALANCE;
    assert!(
        first_sums
            .values()
            .chain(ends.sums.values())
            .all(|s| *s == total),
        "the total did not hold: after the restart {first_sums:?}, at the end {:?}",
        ends.sums
    );
    for m in 0..MACHINES {
        assert_eq!(ends.transfers[&m], AFTER_RESTART);
        let c = &ends.configs[&m];
        assert!(
            c.ends_with("members 0,1,2"),
            "machine {m} is in {c}, not a restart configuration of all three"
        );
    }
    assert_eq!(
        ends.placements[&0], ends.placements[&1],
        "machines disagree on the map"
    );
    let objects = machines.check_replicas(dir, &ends.placements[&0]);
    assert!(objects > 0, "no object compared");
    counters
}
