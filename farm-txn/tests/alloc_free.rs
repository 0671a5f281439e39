//! Allocation and free within one transaction.

mod common;

use common::{drive, start};
use farm_core::Addr;
use farm_txn::{Conflict, Tx, TxError};

/// An object that a transaction allocates and then frees gives its slot back: nobody else ever
/// saw it. (Committed as a write of a slot that stays free, it leaked: neither the commit's
/// free, which returns slots of objects allocated before, nor the abort path, which returns
/// those of objects allocated by an uncommitted transaction, took it.)
#[test]
fn alloc_then_free_in_one_transaction_leaks_no_slot() {
    let mut w = common::workers(2 << 20, 2);
    let mut now = 0;
    // A 2 MB region holds a few hundred 4 KB objects: leaking one slot per round fills it
    // several times over.
    for round in 0..2000 {
        start(&mut w, 0, |tx| {
            let a = tx.alloc(4096, None)?;
            tx.write(a, &[7; 4096])?;
            tx.free(a)
        });
        drive(&mut w, 0, &[0, 1, 2], &mut now, 1000)
            .unwrap_or_else(|| panic!("round {round}: the commit did not end"))
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
}

/// `addr` as 8 bytes, as an application stores a reference.
fn reference(addr: Addr) -> [u8; 8] {
    ((addr.region.0 as u64) << 32 | addr.offset as u64).to_le_bytes()
}

/// A transaction reads a reference to `x` from `p`; before it reads `x`, another transaction
/// frees `x` and clears `p`. Reading `x` then is a conflict (the read of `p` is stale), which
/// `txn()` retries, not a bad address: that stays for a reference no read of this
/// transaction vouches for.
#[test]
fn reading_an_object_freed_since_its_reference_was_read_is_a_conflict() {
    let mut w = common::workers(2 << 20, 2);
    let mut now = 0;
    let (mut p, mut x) = (None, None);
    start(&mut w, 1, |tx| {
        let xa = tx.alloc(8, None)?;
        let pa = tx.alloc(8, None)?;
        tx.write(pa, &reference(xa))?;
        (p, x) = (Some(pa), Some(xa));
        Ok(())
    });
    drive(&mut w, 1, &[0, 1, 2], &mut now, 1000)
        .expect("the allocation commits")
        .unwrap();
    let (p, x) = (p.unwrap(), x.unwrap());
    let (w0, others) = w.split_at_mut(1);
    let mut tx = Tx::new(&mut w0[0]);
    assert_eq!(tx.read(p, 8).unwrap(), reference(x));
    // Machine 1 (others[0]) frees x and clears p; machine 0's CPU is not needed (one-sided
    // replication).
    start(others, 0, |tx| {
        tx.free(x)?;
        tx.write(p, &[0; 8])
    });
    drive(others, 0, &[0, 1], &mut now, 1000)
        .expect("the free commits")
        .unwrap();
    assert_eq!(
        tx.read(x, 8).unwrap_err(),
        TxError::Conflict(Conflict::Validate)
    );
    // Without a read that gave it the reference, the address is bad.
    let mut fresh = Tx::new(&mut w0[0]);
    assert!(matches!(
        fresh.read(x, 8).unwrap_err(),
        TxError::BadAddress { .. }
    ));
}

/// A remote allocation waits for its ALLOC-REPLY only while this machine's lease holds: once
/// it may have run out, the primary may have removed this machine and dropped the request
/// unread, and a machine cut off from the coordination store never learns so (seed 15 of the
/// simulator's minority reads waited ten million polls once writes that a partition broke
/// landed after it healed). Here machine 0, the primary, is never polled, and machine 2's lease
/// runs out while it waits.
#[test]
fn a_remote_allocation_waits_no_longer_than_the_lease() {
    let mut w = common::workers(2 << 20, 1);
    let machine = w[2].machine().clone();
    machine.set_serves_until(1_000);
    let mut now = 0u64;
    let mut poller = || {
        now += 1;
        now
    };
    let mut tx = Tx::with_poller(&mut w[2], &mut poller);
    let near = Addr::new(farm_core::RegionId(0), 0);
    let got = tx.alloc(8, Some(near));
    assert_eq!(got, Err(TxError::LeaseLapsed(farm_core::MachineId(2))));
    assert!(
        !machine.serves_at(now) && now <= 1_002,
        "gave up at poll {now}, its lease ending at 1000"
    );
}

/// What a fabric holds back for the thread's open batch, standing for an answer the waiting
/// thread's polls posted to the primary (over `tcp`, the reply to the primary's own ALLOC,
/// held until the turn's flush).
struct HeldAnswer(std::sync::atomic::AtomicBool);

impl farm_core::fabric::Held for HeldAnswer {
    fn flush(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A remote allocation inside a batch's turn sends what the polls of its wait posted, each
/// round, not only its ALLOC before the wait: two pipelines over `tcp` that each allocated at
/// the other's primary served each other's ALLOC inside their waits and held the replies
/// until their turns ended, so both waited ten million polls and failed (CI, the pipelined
/// allocation test over `tcp`). Here the primary (machine 0) answers only once the answer
/// machine 2's poll posted to it went out.
#[test]
fn a_remote_allocation_sends_what_its_wait_posted() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut w = common::workers(2 << 20, 1);
    let machine = w[2].machine().clone();
    machine.set_serves_until(100_000);
    let _batch = farm_core::fabric::Batch::open();
    let answer = Arc::new(HeldAnswer(AtomicBool::new(false)));
    let (primary, rest) = w.split_at_mut(1);
    let mut now = 0u64;
    let mut poller = || {
        now += 1;
        if now == 1 {
            let held: Arc<dyn farm_core::fabric::Held> = answer.clone();
            assert!(farm_core::fabric::hold(&held), "the batch is open");
        } else if answer.0.load(Ordering::SeqCst) {
            primary[0].poll(now);
        }
        now
    };
    let mut tx = Tx::with_poller(&mut rest[1], &mut poller);
    let near = Addr::new(farm_core::RegionId(0), 0);
    let got = tx.alloc(8, Some(near));
    assert!(
        matches!(got, Ok(a) if a.region == near.region),
        "{got:?} after {now} polls"
    );
}
