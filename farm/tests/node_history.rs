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
    let mut history = Vec::new();
    let mut done = std::collections::BTreeSet::new();
    let mut per_machine = [0usize; 2];
    let deadline = Instant::now() + Duration::from_secs(60);
    while done.len() < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        match machines.lines.recv_timeout(left) {
            Ok((m, line)) => {
                if let Some(t) = line.strip_prefix("txn ") {
                    history.push(decode_txn(t));
                    per_machine[m as usize] += 1;
                } else if line == "done" {
                    done.insert(m);
                } else {
                    assert!(!line.starts_with("error"), "machine {m}: {line}");
                }
            }
            Err(e) => panic!("{} transactions, done {done:?}: {e}", history.len()),
        }
    }
    assert!(
        per_machine.iter().all(|n| *n > 10),
        "too few transactions: {per_machine:?}"
    );
    let anomalies = farm_sim::check(&history);
    assert!(anomalies.is_empty(), "{anomalies:#?}");
}
