//! A write that did not land at a machine that is still a member is not delivered: its link
//! broke (a connection reset, a partition) while the machine lives on, and it never saw the
//! record. Nothing may count it delivered until it lands (the `mem` fabric's link is repaired)
//! or the configuration removed the machine (FaRM §4 step 5: truncation only after every
//! primary acknowledged COMMIT-PRIMARY).

mod common;

use common::{drive, start};
use farm_core::{Addr, MachineId, RegionId};
use farm_txn::{Replication, Worker};

/// Allocates an 8-byte object in machine `m`'s region.
fn alloc(w: &mut [Worker], m: usize, now: &mut u64) -> Addr {
    let mut obj = None;
    start(w, m, |tx| {
        obj = Some(tx.alloc(8, None)?);
        Ok(())
    });
    drive(w, m, &[0, 1, 2], now, 1000)
        .expect("allocation commits")
        .unwrap();
    obj.unwrap()
}

/// The scenario of issue 16, case 1: machine 2 commits a transaction writing `a` (region 1:
/// primary 1, backup 2) and `b` (region 0: primary 0, backup 1). Once both primaries locked,
/// machine 0 is cut off from machine 2: COMMIT-PRIMARY to machine 0 stalls behind the broken
/// link while machine 0 stays a member, holding `b` locked. The commit succeeds on machine 1's acknowledgement (every
/// backup holds the records), but truncation must wait: were it sent, machine 1 would install
/// `b` from its COMMIT-BACKUP while `b`'s primary never applied it, and a recovery that later
/// finds the transaction truncated at region 1 and only locked at region 0 would abort it.
#[test]
fn a_commit_primary_lost_to_a_live_member_holds_truncation_back() {
    let (mut w, fabric) = common::workers_over(2 << 20, 1, Replication::OneSided);
    let mut now = 0;
    let a = alloc(&mut w, 1, &mut now);
    let b = alloc(&mut w, 0, &mut now);
    assert_eq!((a.region, b.region), (RegionId(1), RegionId(0)));
    // The allocations truncated everywhere (past the truncation delay).
    for _ in 0..2000 {
        now += 1;
        for x in w.iter_mut() {
            x.poll(now);
        }
    }
    assert_eq!(
        w[1].retained_records(),
        0,
        "the allocations were not truncated"
    );
    start(&mut w, 2, |tx| {
        tx.write(a, &1u64.to_le_bytes())?;
        tx.write(b, &2u64.to_le_bytes())
    });
    // LOCK goes to both primaries, which lock and answer.
    while w[0].held_lock_txns().is_empty() {
        now += 1;
        assert!(
            common::poll_only(&mut w[2], now).is_none(),
            "committed without locks"
        );
        for x in w.iter_mut() {
            x.poll(now);
        }
        assert!(now < 10_000, "machine 0 never locked b");
    }
    // Their answers go out (machine 2 does not run meanwhile).
    for _ in 0..3 {
        now += 1;
        w[0].poll(now);
        w[1].poll(now);
    }
    fabric.partition(&[&[MachineId(0)], &[MachineId(1), MachineId(2)]]);
    drive(&mut w, 2, &[1, 2], &mut now, 2000)
        .expect("the commit ends on machine 1's acknowledgement")
        .expect("committed: every backup holds the records");
    let retained = w[1].retained_records();
    assert!(retained > 0, "machine 1 holds no record of the transaction");
    // Long past the truncation delay, with machine 0 still a member.
    for _ in 0..5000 {
        now += 1;
        w[2].poll(now);
        w[1].poll(now);
    }
    assert!(w[2].view().config.contains(MachineId(0)));
    assert_eq!(
        w[1].retained_records(),
        retained,
        "machine 1 truncated the transaction (installing b from its COMMIT-BACKUP) while b's \
         primary, machine 0, never got COMMIT-PRIMARY and is still a member"
    );
}
