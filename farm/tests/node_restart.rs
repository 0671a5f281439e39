//! Every machine process killed at once in the middle of transfers, as a power loss does, and
//! the cluster restarted from its NVRAM directory (FaRM §2, §5: committed transactions are
//! durable through the loss of every machine), with the configuration in ZooKeeper. Its own
//! binary, so that these processes do not share the two cores with other multi-process tests.

use std::collections::BTreeMap;
use std::sync::mpsc::RecvTimeoutError;
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

/// Machine 0, the CM and the machine that decides a restart, is killed and removed (§5.2); the
/// two survivors run on in the configuration without it and are then killed at once, and all
/// three processes start with `restart`. Machine 0 decides from what every machine left (its
/// own view is stale): the restart configuration of machines 1 and 2, stored in ZooKeeper. It
/// waits until both learnt it and refuses to run, naming why; the survivors restart from NVRAM
/// with nothing acknowledged lost, the total intact and their replicas equal.
#[test]
fn a_machine_removed_before_the_stop_decides_the_restart_and_stays_out() {
    let Some(zookeeper) = common::zookeeper("node-restart-removed") else {
        return;
    };
    let (net, test) = (Net::Shm, 2);
    let dir = tempfile::tempdir().unwrap();
    let mut acked: BTreeMap<u16, u64> = BTreeMap::new();
    {
        let machines = Machines::start_on(&net, "run", test, dir.path(), Some(zookeeper.clone()));
        machines.share_accounts(dir.path());
        // Records an acknowledgement; returns the configuration installed without machine 0.
        let take = |acked: &mut BTreeMap<u16, u64>, m: u16, line: &str| -> Option<u64> {
            if let Some(n) = line.strip_prefix("acked ") {
                acked.insert(m, n.parse().unwrap());
            }
            let rest = line.strip_prefix("installed ")?;
            let (id, members) = rest.split_once(" members ").unwrap();
            (members == "1,2").then(|| id.parse().unwrap())
        };
        let until = Instant::now() + Duration::from_millis(300);
        while let Ok((m, line)) = machines
            .lines
            .recv_timeout(until.saturating_duration_since(Instant::now()))
        {
            take(&mut acked, m, &line);
        }
        machines.signal(0, libc::SIGKILL);
        // Both survivors installed (so persisted) the configuration without machine 0.
        let mut installed = BTreeMap::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while installed.len() < 2 {
            let left = deadline.saturating_duration_since(Instant::now());
            let (m, line) = machines
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("installed {installed:?} only: {e}"));
            if let Some(id) = take(&mut acked, m, &line) {
                installed.insert(m, id);
            }
        }
        // And committed transfers in it.
        let at_removal = acked.clone();
        while [1, 2].iter().any(|m| acked.get(m) <= at_removal.get(m)) {
            let left = deadline.saturating_duration_since(Instant::now());
            let (m, line) = machines
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no transfer after the removal: {acked:?}: {e}"));
            take(&mut acked, m, &line);
        }
        machines.signal(1, libc::SIGKILL);
        machines.signal(2, libc::SIGKILL);
        while let Ok((m, line)) = machines.lines.recv_timeout(Duration::from_secs(10)) {
            take(&mut acked, m, &line);
        }
    }
    let counters = restart_and_check(&net, test, dir.path(), &zookeeper, &[1, 2]);
    for m in [1, 2] {
        let (n, c) = (acked[&m], counters[&m]);
        assert!(
            (n..=n + 1).contains(&c),
            "machine {m} acknowledged {n} transfers before the kill, its counter is {c} after \
             the restart"
        );
    }
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
        // Let transfers run for half a second, and on until every machine acknowledged one (on
        // a loaded host one may start late), reading the acknowledgements meanwhile.
        let least = Instant::now() + Duration::from_millis(500);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < least || acked.len() < MACHINES as usize {
            let until = if Instant::now() < least {
                least
            } else {
                deadline
            };
            match machines
                .lines
                .recv_timeout(until.saturating_duration_since(Instant::now()))
            {
                Ok((m, line)) => {
                    if let Some(n) = line.strip_prefix("acked ") {
                        acked.insert(m, n.parse().unwrap());
                    }
                }
                Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(e) => panic!("acknowledged {acked:?} only: {e}"),
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
    let counters = restart_and_check(&net, test, dir.path(), &zookeeper, &[0, 1, 2]);
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
    let again = restart_and_check(&net, test, dir.path(), &zookeeper, &[0, 1, 2]);
    for (m, c) in &counters {
        assert_eq!(again[m], c + AFTER_RESTART, "machine {m}'s counter");
    }
}

/// Kills whatever runs on `dir`, restarts the three machines from it and checks the restart
/// (see above) of `members`, the others refusing to run; returns the counters the members read
/// right after it.
fn restart_and_check(
    net: &Net,
    test: u16,
    dir: &std::path::Path,
    zookeeper: &(String, String),
    members: &[u16],
) -> BTreeMap<u16, u64> {
    let machines = Machines::start_on(net, "restarted", test, dir, Some(zookeeper.clone()));
    let mut counters = BTreeMap::new();
    let mut first_sums = BTreeMap::new();
    let mut refused = BTreeMap::new();
    // Each member prints its sum twice: right after the restart and at its end.
    let sums = std::cell::Cell::new(0);
    let outside = MACHINES as usize - members.len();
    let refusals = std::cell::Cell::new(0);
    let ends = machines.ends(
        |_| sums.get() == 2 * members.len() && refusals.get() == outside,
        |m, line| {
            if let Some(n) = line.strip_prefix("counter ") {
                counters.insert(m, n.parse::<u64>().unwrap());
            } else if let Some(rest) = line.strip_prefix("sum ") {
                let (sum, _) = rest.split_once(" moved ").unwrap();
                first_sums.entry(m).or_insert(sum.parse::<u64>().unwrap());
                sums.set(sums.get() + 1);
            } else if let Some(why) = line.strip_prefix("refused ") {
                refused.insert(m, why.to_string());
                refusals.set(refusals.get() + 1);
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
    let listed: Vec<String> = members.iter().map(u16::to_string).collect();
    let listed = format!("members {}", listed.join(","));
    for m in members {
        assert_eq!(ends.transfers[m], AFTER_RESTART);
        let c = &ends.configs[m];
        assert!(
            c.ends_with(&listed),
            "machine {m} is in {c}, not a restart configuration of {members:?}"
        );
    }
    for m in (0..MACHINES).filter(|m| !members.contains(m)) {
        let why = &refused[&m];
        assert!(
            why.contains(&format!(
                "machine m{m} is not a member of restart configuration"
            )),
            "machine {m} refused: {why}"
        );
    }
    let placements = &ends.placements[&members[0]];
    for m in members {
        assert_eq!(
            &ends.placements[m], placements,
            "machines disagree on the map"
        );
    }
    let objects = machines.check_replicas(dir, placements);
    assert!(objects > 0, "no object compared");
    counters
}
