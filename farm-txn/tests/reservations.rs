//! Log reservations (§4): a commit whose logs lack space waits before it starts, sending nothing,
//! and commits once the receiver catches up and frees space; nothing is lost and nothing stays
//! reserved.

mod common;

use common::{drive, start};
use farm_core::Addr;
use farm_txn::{Tx, Worker};

const OBJ: usize = 16_000;

fn cluster() -> Vec<Worker> {
    common::workers(4 << 20, 2)
}

#[test]
fn a_full_log_delays_the_commit_until_explicit_truncation_frees_it() {
    let mut w = cluster();
    let mut now = 0;
    // Three 16 KB objects whose primary is machine 1; its backups are machines 2 and 0.
    let mut objs: Vec<Addr> = Vec::new();
    for _ in 0..3 {
        start(&mut w, 1, |tx| {
            objs.push(tx.alloc(OBJ, None)?);
            Ok(())
        });
        drive(&mut w, 1, &[0, 1, 2], &mut now, 1000)
            .expect("allocation commits")
            .unwrap();
    }
    // Machine 2, a backup, stops polling: COMMIT-BACKUP records from machine 0 pile up in its
    // log, unprocessed and so never truncated. Each needs a 2 x 48 KB reservation.
    let write = |round: u8| {
        let objs = objs.clone();
        move |tx: &mut Tx<'_>| {
            for o in &objs {
                tx.write(*o, &vec![round; OBJ])?;
            }
            Ok(())
        }
    };
    let mut round = 0u8;
    loop {
        round += 1;
        assert!(round < 10, "machine 0's log to machine 2 never filled");
        // Let machine 1 apply the previous COMMIT-PRIMARY (success was reported on its ack).
        for s in [0, 1] {
            now += 1;
            w[s].poll(now);
        }
        start(&mut w, 0, write(round));
        match drive(&mut w, 0, &[0, 1], &mut now, 2000) {
            Some(r) => r.unwrap(),
            None => break,
        }
    }
    assert!(round >= 3, "at least two commits fit in a 256 KB log");
    assert!(
        w[0].stats().reserve_waits > 0,
        "the stuck commit waits for log space"
    );
    assert!(w[0].stats().locks_processed == 0 && w[1].stats().locks_processed >= round as u64 - 1);
    // Nothing of the waiting commit was sent: its objects are unlocked and hold round - 1.
    let (h, data) = w[1].read_object(objs[0], OBJ).unwrap();
    assert!(!h.locked());
    assert_eq!(data[0], round - 1);
    // Machine 2 wakes up: it processes the backlog, whose piggybacked truncations free its log,
    // and the waiting commit goes through.
    drive(&mut w, 0, &[0, 1, 2], &mut now, 10_000)
        .expect("commit after space was freed")
        .unwrap();
    now += 1;
    w[1].poll(now);
    let (_, data) = w[1].read_object(objs[2], OBJ).unwrap();
    assert!(data.iter().all(|b| *b == round));
    // Quiesce: everything truncated, every reservation returned.
    for _ in 0..10 {
        now += 1_000;
        for x in w.iter_mut() {
            x.poll(now);
            x.flush_truncations();
            x.report_all_freed();
        }
    }
    for x in w.iter_mut() {
        x.poll(now);
        x.report_all_freed();
    }
    for x in w.iter_mut() {
        assert!(x.coordinator_quiet() && x.retained_records() == 0);
        assert_eq!(
            x.outbound_in_use(),
            0,
            "machine {} leaked log space",
            x.machine().id
        );
    }
}

#[test]
fn a_commit_waiting_for_log_space_behind_an_open_commit_spends_no_truncate_reservation() {
    let mut w = cluster();
    let mut now = 0;
    // Three 16 KB objects and a counter, all with machine 1 as primary (backups 2 and 0).
    let mut objs: Vec<Addr> = Vec::new();
    for size in [OBJ, OBJ, OBJ, 8] {
        start(&mut w, 1, |tx| {
            objs.push(tx.alloc(size, None)?);
            Ok(())
        });
        drive(&mut w, 1, &[0, 1, 2], &mut now, 1000)
            .expect("allocation commits")
            .unwrap();
    }
    let counter = objs.pop().unwrap();
    let begin = |w: &mut [Worker], f: &dyn Fn(&mut Tx<'_>) -> Result<(), farm_txn::TxError>| {
        let mut tx = Tx::new(&mut w[0]);
        f(&mut tx).unwrap();
        let state = tx.into_state();
        w[0].start_commit(state)
    };
    // An older commit of machine 0 sends its LOCK and is then left open: the thread's
    // truncation bound stays at it, so nothing newer can be truncated until it ends.
    let older = begin(&mut w, &|tx| tx.write(counter, &1u64.to_le_bytes()));
    now += 1;
    assert!(w[0].poll_commit(older, now).is_none());
    // Machine 2 (a backup) stops polling; newer commits fill machine 0's log to it. Each of
    // them, once acked, is a transaction to truncate holding one TRUNCATE reservation.
    let mut round = 0u8;
    let waiting = loop {
        round += 1;
        assert!(round < 10, "machine 0's log to machine 2 never filled");
        // Let machine 1 apply the previous COMMIT-PRIMARY (success was reported on its ack).
        for s in [0, 1] {
            now += 1;
            w[s].poll(now);
        }
        let objs = objs.clone();
        let c = begin(&mut w, &move |tx| {
            for o in &objs {
                tx.write(*o, &vec![round; OBJ])?;
            }
            Ok(())
        });
        let mut outcome = None;
        for _ in 0..200 {
            now += 1;
            outcome = w[0].poll_commit(c, now);
            if outcome.is_some() {
                break;
            }
            w[0].poll(now);
            w[1].poll(now);
        }
        match outcome {
            Some(r) => r.unwrap(),
            None => break c,
        }
    };
    assert!(round >= 3, "at least two commits fit in a 256 KB log");
    // The waiting commit is polled on and on. There is nothing it may truncate (every
    // transaction to truncate is newer than the open one), so it must not spend the
    // reservations on TRUNCATE records that free nothing: once they are gone, a later
    // truncation would have no room.
    let sent = w[0].stats().truncates_sent;
    for _ in 0..50 {
        now += 1;
        assert!(w[0].poll_commit(waiting, now).is_none());
        w[0].poll(now);
        w[1].poll(now);
    }
    assert_eq!(
        w[0].stats().truncates_sent,
        sent,
        "TRUNCATE records sent with nothing to truncate"
    );
    // The older commit ends; machine 2 wakes up, and the waiting commit goes through.
    let mut outcome = None;
    for _ in 0..2000 {
        now += 1;
        outcome = outcome.or_else(|| w[0].poll_commit(older, now));
        if outcome.is_some() {
            break;
        }
        for x in w.iter_mut() {
            x.poll(now);
        }
    }
    outcome.expect("the older commit ends").unwrap();
    let mut outcome = None;
    for _ in 0..10_000 {
        now += 1;
        outcome = w[0].poll_commit(waiting, now);
        if outcome.is_some() {
            break;
        }
        for x in w.iter_mut() {
            x.poll(now);
        }
    }
    outcome.expect("commit after space was freed").unwrap();
    for _ in 0..20 {
        now += 1;
        for x in w.iter_mut() {
            x.poll(now);
        }
    }
    let (_, data) = w[1].read_object(objs[2], OBJ).unwrap();
    assert!(data.iter().all(|b| *b == round));
    let (_, data) = w[1].read_object(counter, 8).unwrap();
    assert_eq!(data, 1u64.to_le_bytes());
}
