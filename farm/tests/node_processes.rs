//! Machines as separate processes (farm::node over the `shm` fabric): this test binary runs
//! itself three times as machines 0 (the CM), 1 and 2. Leases (FaRM §5.1): nobody is suspected
//! while all run; a member stopped with SIGSTOP is suspected by the CM; a
//! member killed with SIGKILL is suspected by the CM. Transactions (§4): transfers among
//! accounts of all three processes keep the total.

use std::time::{Duration, Instant};

mod common;
mod nodes;

use nodes::{Machines, Net, ACCOUNTS, BALANCE, LEASE, MACHINES};

/// A machine process of the tests below (see `nodes::child_main`).
#[test]
#[ignore = "a child process of the multi-process tests"]
fn node_child() {
    nodes::child_main();
}

#[test]
fn lease_failures_are_detected_across_processes() {
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start("leases", 0, dir.path(), None);
    let mut up = std::collections::BTreeSet::new();
    while up.len() < MACHINES as usize {
        match machines.lines.recv_timeout(Duration::from_secs(30)) {
            Ok((m, line)) if line == "up" => {
                up.insert(m);
            }
            Ok(_) => {}
            Err(e) => panic!("machines {up:?} of {MACHINES} started: {e}"),
        }
    }
    // Ten leases with everyone running: no suspicion (`expect` fails on any).
    assert!(!machines.expect(0, "never", LEASE * 10));

    // SIGSTOP machine 2: the CM suspects it (a one-sided probe would still
    // answer: the memory of a stopped process stays mapped, as a NIC answers for a hung CPU).
    machines.signal(2, libc::SIGSTOP);
    assert!(
        machines.expect(0, "suspect 2 by 0", Duration::from_secs(20)),
        "the CM did not suspect a stopped member"
    );

    // SIGKILL machine 1: the CM suspects it.
    machines.signal(1, libc::SIGKILL);
    assert!(
        machines.expect(0, "suspect 1 by 0", Duration::from_secs(20)),
        "the CM did not suspect a killed member"
    );
}

/// Transactions across processes (§4): every machine process opens accounts in its own
/// regions, then transfers among all of them, reading remote accounts one-sided and committing
/// through the peers' logs; the snapshot each machine reads in one transaction at its end
/// holds the total, and shows balances moved.
#[test]
fn transfers_between_processes_keep_the_total() {
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start("bank", 1, dir.path(), None);
    machines.share_accounts(dir.path());
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut sums = std::collections::BTreeMap::new();
    while sums.len() < MACHINES as usize {
        let left = deadline.saturating_duration_since(Instant::now());
        match machines.lines.recv_timeout(left) {
            Ok((m, line)) => {
                assert!(!line.starts_with("suspect"), "machine {m}: {line}");
                if let Some(rest) = line.strip_prefix("sum ") {
                    let (sum, moved) = rest.split_once(" moved ").unwrap();
                    let moved: usize = moved.split(' ').next().unwrap().parse().unwrap();
                    sums.insert(m, sum.parse::<u64>().unwrap());
                    assert!(moved > 0, "machine {m}: no account changed: {line}");
                }
            }
            Err(e) => panic!("sums of {sums:?} only: {e}"),
        }
    }
    let total = MACHINES as u64 * ACCOUNTS * BALANCE;
    assert!(
        sums.values().all(|s| *s == total),
        "sums {sums:?}, expected {total} everywhere"
    );
}

/// Region allocation across processes (§3), with the configuration in ZooKeeper: machine 2
/// asks its CM, the replicas prepare, the map with the region is committed as a configuration
/// with the same members at every machine, and the region's primary allocates in it.
#[test]
fn a_member_allocates_a_region_through_its_cm_across_processes() {
    let Some(zookeeper) = common::zookeeper("node-allocate") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start("allocate", 2, dir.path(), Some(zookeeper));
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut allocated, mut object) = (None, None);
    let mut regions = std::collections::BTreeMap::new();
    while regions.len() < MACHINES as usize || allocated.is_none() || object.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let (m, line) = machines
            .lines
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("{regions:?} {allocated:?} {object:?}: {e}"));
        assert!(!line.starts_with("suspect"), "machine {m}: {line}");
        let words: Vec<&str> = line.split(' ').collect();
        match words[..] {
            ["allocated", r] => allocated = Some(r.parse::<u32>().unwrap()),
            ["regions", n, "config", c] => {
                regions.insert(m, (n.parse::<usize>().unwrap(), c.parse::<u64>().unwrap()));
            }
            ["object", r, v] => object = Some((r.parse::<u32>().unwrap(), v.to_string())),
            _ => {}
        }
    }
    let r = allocated.unwrap();
    // Each machine started with the striped map (one region per machine) and gained one.
    for (m, (n, config)) in &regions {
        assert_eq!(*n, MACHINES as usize + 1, "machine {m}");
        assert_eq!(*config, 2, "machine {m}: not committed as configuration 2");
    }
    assert_eq!(r, MACHINES as u32, "the next id from the CM's counter");
    assert_eq!(object, Some((r, "4242".to_string())));
}

/// A machine process whose regions are full gets another from its CM (§3), with the
/// configuration in ZooKeeper, over `shm` and over `tcp`: its transactions wait for the region
/// and go on in it (they failed with "region is full").
#[test]
fn a_machine_process_whose_regions_are_full_gets_another() {
    for (net, test, znode) in [
        (Net::Shm, 6, "node-grow"),
        (Net::Loopback, 7, "node-grow-tcp"),
    ] {
        let Some(zookeeper) = common::zookeeper(znode) else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let machines = Machines::start_on(&net, "grow", test, dir.path(), Some(zookeeper));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (m, line) = (machines.lines.recv_timeout(left))
                .unwrap_or_else(|e| panic!("{net:?}: machine 2 did not grow: {e}"));
            assert!(!line.starts_with("suspect"), "machine {m}: {line}");
            if let ["grown", regions, objects] = line.split(' ').collect::<Vec<_>>()[..] {
                assert_eq!(m, 2);
                assert!(regions.parse::<usize>().unwrap() > 1, "{line}");
                // At least a block of them (1 MiB) before its region was full.
                assert!(objects.parse::<usize>().unwrap() >= 900, "{line}");
                break;
            }
        }
    }
}

/// A transaction among others in flight on a pipeline allocates at a remote primary: its
/// ALLOC goes out although the pipeline holds back what its turn posts until the turn ends
/// (the step waits for the reply inside the turn), over `shm` and over `tcp`.
#[test]
fn pipelined_transactions_allocate_at_remote_primaries() {
    for (net, test, znode) in [
        (Net::Shm, 3, "node-pipeline-alloc"),
        (Net::Loopback, 4, "node-pipeline-alloc-tcp"),
    ] {
        let Some(zookeeper) = common::zookeeper(znode) else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let machines =
            Machines::start_on(&net, "pipeline-alloc", test, dir.path(), Some(zookeeper));
        machines.share_accounts(dir.path());
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut allocated = std::collections::BTreeMap::new();
        while allocated.len() < MACHINES as usize {
            let left = deadline.saturating_duration_since(Instant::now());
            let (m, line) = machines
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("{net:?}: allocated {allocated:?}: {e}"));
            let words: Vec<&str> = line.split(' ').collect();
            if let ["allocated", n, "remote", k] = words[..] {
                allocated.insert(
                    m,
                    (n.parse::<usize>().unwrap(), k.parse::<usize>().unwrap()),
                );
            }
        }
        for (m, (n, remote)) in &allocated {
            assert_eq!(*n, nodes::PIPELINE_ALLOCS, "{net:?}: machine {m}");
            assert_eq!(
                remote, n,
                "{net:?}: machine {m} allocated only {remote} of {n} at another primary"
            );
        }
    }
}

/// Pipelines whose transactions never wait (every one locks and commits at its own machine,
/// and a COMMIT-BACKUP over `shm` is written at once) still let their host's workers take
/// the other machines' records: machines 0 and 1 run transactions on their own accounts
/// until both ran [`nodes::LOCAL_TXNS`], whose records fill each other's logs many times over. An executor whose tasks never yielded never polled its host, so the other machines
/// waited for log space there for as long as it ran (TPC-C without remote warehouses stalled
/// two of three machines for whole runs).
#[test]
fn pipelines_whose_transactions_never_wait_let_the_others_commit() {
    let Some(zookeeper) = common::zookeeper("node-pipeline-local") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start_on(&Net::Shm, "pipeline-local", 5, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut ran = std::collections::BTreeMap::new();
    while ran.len() < MACHINES as usize {
        let left = deadline.saturating_duration_since(Instant::now());
        let done: Vec<_> = (0..MACHINES)
            .filter(|m| dir.path().join(format!("local-done-{m}")).exists())
            .collect();
        let (m, line) = machines.lines.recv_timeout(left).unwrap_or_else(|e| {
            panic!("only machines {done:?} ran their transactions, ended {ran:?}: {e}")
        });
        if let Some(n) = line.strip_prefix("local ") {
            ran.insert(m, n.parse::<u64>().unwrap());
        }
    }
    for m in 0..MACHINES - 1 {
        assert!(ran[&m] >= nodes::LOCAL_TXNS, "machine {m} ran {}", ran[&m]);
    }
}
