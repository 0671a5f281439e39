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
