//! Strict serializability across machine processes (FaRM §4-5): list-append transactions from
//! two machine processes while the third, which holds lists, is killed with SIGKILL; the
//! history, ordered in real time by the host's monotonic clock, is checked by the simulator's
//! checker, and the final read sees every acknowledged append. Needs ZooKeeper.

use std::time::{Duration, Instant};

mod common;
mod nodes;

use nodes::{decode_txn, Machines};

/// A machine process of the test below (see `nodes::child_main`).
#[test]
#[ignore = "a child process of the multi-process tests"]
fn node_child() {
    nodes::child_main();
}

#[test]
fn list_append_across_processes_through_a_kill_is_strictly_serializable() {
    let Some(zookeeper) = common::zookeeper("node-history") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start("append", 0, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    std::thread::sleep(Duration::from_millis(300));
    machines.signal(2, libc::SIGKILL);
    std::thread::sleep(Duration::from_millis(700));
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    let (history, per_machine) = histories(&machines, 2, |m, line| {
        assert!(!line.starts_with("error"), "machine {m}: {line}");
    });
    assert!(
        per_machine.iter().all(|n| *n > 10),
        "too few transactions: {per_machine:?}"
    );
    let anomalies = farm_sim::check(&history);
    assert!(anomalies.is_empty(), "{anomalies:#?}");
}

/// The machines' lines until the first `n` said `done`: every committed transaction, how many
/// each machine committed, and every other line handed to `other`.
fn histories(
    machines: &Machines,
    n: usize,
    mut other: impl FnMut(u16, &str),
) -> (Vec<farm_sim::TxnRecord>, Vec<usize>) {
    let mut history = Vec::new();
    let mut done = std::collections::BTreeSet::new();
    let mut per_machine = vec![0usize; n];
    let deadline = Instant::now() + Duration::from_secs(60);
    while done.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match machines.lines.recv_timeout(left) {
            Ok((m, line)) => {
                if let Some(t) = line.strip_prefix("txn ") {
                    history.push(decode_txn(t));
                    per_machine[m as usize] += 1;
                } else if line == "done" {
                    done.insert(m);
                } else {
                    other(m, &line);
                }
            }
            Err(e) => panic!("{} transactions, done {done:?}: {e}", history.len()),
        }
    }
    (history, per_machine)
}

/// A machine stopped past its lease, removed, and continued serves no stale read (issue 16
/// case 3; FaRM §5.1: a machine whose lease may have expired tells nobody what it read). Its
/// lists get new primaries and newer values while it is stopped; continued, it reads on from
/// its stale view until it learns it was removed. Every transaction it reported committed is
/// in the history the checker orders in real time.
#[test]
fn a_machine_stopped_past_its_lease_serves_no_stale_read_when_continued() {
    let Some(zookeeper) = common::zookeeper("node-stale") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start("stale", 1, dir.path(), Some(zookeeper));
    machines.share_accounts(dir.path());
    std::thread::sleep(Duration::from_millis(300));
    machines.signal(2, libc::SIGSTOP);
    // Twenty leases: suspected, removed, its regions recovered and appended to elsewhere.
    std::thread::sleep(Duration::from_millis(1000));
    let continued = nodes::host_ns();
    machines.signal(2, libc::SIGCONT);
    let mut evicted_at = None;
    let (history, per_machine) = histories(&machines, 3, |m, line| {
        if let Some(at) = line.strip_prefix("evicted ") {
            assert_eq!(m, 2, "machine {m} evicted");
            evicted_at = Some(at.parse::<u64>().unwrap());
            // The others stop once the removed machine knows it is out.
            std::fs::write(dir.path().join("stop"), b"").unwrap();
        } else {
            // The removed machine's transactions may fail as it learns it is out.
            assert!(m == 2 || !line.starts_with("error"), "machine {m}: {line}");
        }
    });
    let evicted_at = evicted_at.expect("machine 2 never learnt it was removed");
    assert!(
        evicted_at > continued,
        "machine 2 learnt it was removed before it was continued"
    );
    assert!(
        per_machine.iter().all(|n| *n > 10),
        "too few transactions: {per_machine:?}"
    );
    let anomalies = farm_sim::check(&history);
    assert!(anomalies.is_empty(), "{anomalies:#?}");
}
