//! Precise membership (FaRM §5.2): once a machine has installed a configuration without some
//! machine, it ignores that machine's log records and messages: a LOCK from a removed
//! coordinator takes no lock and gets no answer, while members are served as before.

mod common;

use farm_core::config::Configuration;
use farm_core::{Addr, ConfigId, MachineId};
use farm_txn::{Tx, TxError, Worker};

fn cluster() -> Vec<Worker> {
    common::workers(2 << 20, 1)
}

fn poll_all(w: &mut [Worker], now: &mut u64) {
    *now += 1;
    for x in w.iter_mut() {
        x.poll(*now);
    }
}

fn start_write(w: &mut [Worker], coordinator: usize, addr: Addr, value: u8) {
    let mut tx = Tx::new(&mut w[coordinator]);
    tx.write(addr, &[value; 8]).unwrap();
    let state = tx.into_state();
    w[coordinator].start_commit(state);
}

/// An object allocated by machine `m` in a region it is primary of.
fn allocated(w: &mut [Worker], m: usize, now: &mut u64) -> Addr {
    let mut tx = Tx::new(&mut w[m]);
    let a = tx.alloc(8, None).unwrap();
    let state = tx.into_state();
    w[m].start_commit(state);
    while common::poll_only(&mut w[m], *now).is_none() {
        poll_all(w, now);
    }
    a
}

#[test]
fn records_from_a_removed_machine_are_ignored() {
    let mut w = cluster();
    let mut now = 0;
    // An object whose primary is machine 0 (region 0; backup machine 1).
    let mut tx = Tx::new(&mut w[0]);
    let obj = tx.alloc(8, None).unwrap();
    let state = tx.into_state();
    w[0].start_commit(state);
    while common::poll_only(&mut w[0], now).is_none() {
        poll_all(&mut w, &mut now);
    }
    for _ in 0..5 {
        poll_all(&mut w, &mut now);
    }
    // Machine 2 starts a commit whose LOCK lands in machine 0's log ...
    start_write(&mut w, 2, obj, 9);
    assert!(common::poll_only(&mut w[2], now).is_none());
    // ... but machine 0 has meanwhile installed a configuration without machine 2.
    let mut next = Configuration::initial(3);
    next.id = ConfigId(2);
    next.members = vec![MachineId(0), MachineId(1)];
    next.failure_domains.remove(&MachineId(2));
    let map = w[0].view().map.clone();
    w[0].machine()
        .install(next, map, Default::default())
        .unwrap();
    let locks_before = w[0].stats().locks_processed;
    for _ in 0..20 {
        poll_all(&mut w, &mut now);
        assert!(
            common::poll_only(&mut w[2], now).is_none(),
            "a removed coordinator gets no LOCK-REPLY"
        );
    }
    assert_eq!(
        w[0].stats().locks_processed,
        locks_before,
        "the LOCK from machine 2 was not processed"
    );
    assert!(
        w[0].held_lock_txns().is_empty(),
        "no lock taken for machine 2"
    );
    let (h, data) = w[0].read_object(obj, 8).unwrap();
    assert!(!h.locked());
    assert_eq!(
        data,
        vec![0; 8],
        "the removed machine's write never applied"
    );
    // A member is still served.
    start_write(&mut w, 1, obj, 5);
    let mut outcome = None;
    for _ in 0..100 {
        poll_all(&mut w, &mut now);
        if let Some(r) = common::poll_only(&mut w[1], now) {
            outcome = Some(r);
            break;
        }
    }
    outcome.expect("the member's commit finishes").unwrap();
}

/// A transaction's reads all come from one view: once a read picked up a newer configuration
/// (NEW-CONFIG installed meanwhile), the execution ends with `ConfigurationChanged`, which
/// `txn()` retries. Before, the read went on in the newer view; the transaction's identifier
/// then took the newer configuration, so its reads from the older one escaped the commit's
/// check that a read region's primary changed, and were validated against a promoted backup
/// that may not have applied a committed write yet (issue 16, case 2).
#[test]
fn a_transaction_reads_from_one_view() {
    let mut w = cluster();
    let mut now = 0;
    let (x, y) = (
        allocated(&mut w, 0, &mut now),
        allocated(&mut w, 1, &mut now),
    );
    let machine = w[0].machine().clone();
    let map = w[0].view().map.clone();
    let mut tx = Tx::new(&mut w[0]);
    tx.read(x, 8).unwrap();
    let mut next = Configuration::initial(3);
    next.id = ConfigId(2);
    machine.install(next, map, Default::default()).unwrap();
    assert_eq!(tx.read(y, 8).unwrap_err(), TxError::ConfigurationChanged);
}

/// The commit of a transaction whose coordinator picked up a newer configuration after the
/// last read (between execution and commit, or while an allocation at a remote primary
/// polled the worker) ends with `ConfigurationChanged`. Its identifier would take the newer
/// configuration, so the check that a read region's primary changed since would miss reads
/// from the older view, validated then against a promoted backup that may not have applied a
/// committed write yet (issue 16, case 2).
#[test]
fn a_commit_started_in_a_newer_view_than_its_reads_aborts() {
    let mut w = cluster();
    let mut now = 0;
    let (x, y) = (
        allocated(&mut w, 0, &mut now),
        allocated(&mut w, 1, &mut now),
    );
    let machine = w[2].machine().clone();
    let map = w[2].view().map.clone();
    let mut tx = Tx::new(&mut w[2]);
    tx.read(x, 8).unwrap();
    tx.write(y, &[1; 8]).unwrap();
    let state = tx.into_state();
    let mut next = Configuration::initial(3);
    next.id = ConfigId(2);
    machine.install(next, map, Default::default()).unwrap();
    w[2].refresh_view();
    w[2].start_commit(state);
    let mut outcome = None;
    for _ in 0..1000 {
        if let Some(r) = common::poll_only(&mut w[2], now) {
            outcome = Some(r);
            break;
        }
        poll_all(&mut w, &mut now);
    }
    assert_eq!(outcome, Some(Err(TxError::ConfigurationChanged)));
}
