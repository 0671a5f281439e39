//! Many commits in flight on one worker (§4 per transaction): each has its own reservations,
//! replies and outcome, the replies of one are never taken or dropped by another, and the
//! truncation low bound a worker sends never passes a commit still in flight.

mod common;

use common::{drive, start};
use farm_core::Addr;
use farm_txn::{CommitHandle, Replication, Tx, TxError, Worker};

fn cluster() -> Vec<Worker> {
    common::workers(4 << 20, 2)
}

/// Objects holding zero, allocated and committed by machine `m` (their primary).
fn objects(w: &mut [Worker], m: usize, n: usize, now: &mut u64) -> Vec<Addr> {
    let mut out = Vec::new();
    start(w, m, |tx| {
        for _ in 0..n {
            let a = tx.alloc(8, None)?;
            tx.write(a, &0u64.to_le_bytes())?;
            out.push(a);
        }
        Ok(())
    });
    drive(w, m, &[0, 1, 2], now, 1000)
        .expect("allocation commits")
        .unwrap();
    out
}

/// Executes an increment of each of `addrs` on worker `c` and starts its commit.
fn start_increment(w: &mut [Worker], c: usize, addrs: &[Addr]) -> CommitHandle {
    let mut tx = Tx::new(&mut w[c]);
    for a in addrs {
        let v = u64::from_le_bytes(tx.read(*a, 8).unwrap().try_into().unwrap());
        tx.write(*a, &(v + 1).to_le_bytes()).unwrap();
    }
    let state = tx.into_state();
    w[c].start_commit(state)
}

fn value(w: &mut [Worker], primary: usize, a: Addr) -> u64 {
    let (_, data) = w[primary].read_object(a, 8).unwrap();
    u64::from_le_bytes(data.try_into().unwrap())
}

/// Polls the commits `txns` of worker `c` in the order `order` gives (indices into `txns`,
/// repeated), polling every worker between, until each is decided: every outcome once.
fn decide_all(
    w: &mut [Worker],
    c: usize,
    txns: &[CommitHandle],
    order: impl Fn(u64) -> usize,
    now: &mut u64,
) -> Vec<Result<(), TxError>> {
    let mut outcomes: Vec<Option<Result<(), TxError>>> = vec![None; txns.len()];
    for step in 0..100_000u64 {
        if outcomes.iter().all(Option::is_some) {
            return outcomes.into_iter().map(Option::unwrap).collect();
        }
        *now += 1;
        let i = order(step) % txns.len();
        if outcomes[i].is_none() {
            outcomes[i] = w[c].poll_commit(txns[i], *now);
        }
        for x in w.iter_mut() {
            x.poll(*now);
        }
    }
    panic!("commits {txns:?} not decided: {outcomes:?}");
}

#[test]
fn commits_in_flight_together_each_commit_once() {
    let mut w = cluster();
    let mut now = 0;
    // Primaries on machines 1 and 2 (each object's backups on the other two machines).
    let at1 = objects(&mut w, 1, 4, &mut now);
    let at2 = objects(&mut w, 2, 4, &mut now);
    // Machine 0's one worker starts four commits before polling any: disjoint objects, so
    // each commits; their LOCK-REPLYs arrive interleaved.
    let txns: Vec<CommitHandle> = (0..4)
        .map(|k| start_increment(&mut w, 0, &[at1[k], at2[k]]))
        .collect();
    assert_eq!(w[0].commits_in_flight(), 4);
    // The newest is polled most: under the old one-commit rule its polls dropped the older
    // commits' replies as stale.
    let outcomes = decide_all(
        &mut w,
        0,
        &txns,
        |s| [3, 3, 3, 2, 3, 1, 0][s as usize % 7],
        &mut now,
    );
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert!(!w[0].committing());
    for _ in 0..20 {
        now += 1;
        for x in w.iter_mut() {
            x.poll(now);
        }
    }
    for k in 0..4 {
        assert_eq!(value(&mut w, 1, at1[k]), 1, "object {k} at machine 1");
        assert_eq!(value(&mut w, 2, at2[k]), 1, "object {k} at machine 2");
    }
}

#[test]
fn conflicting_commits_of_one_worker_abort_all_but_one() {
    let mut w = cluster();
    let mut now = 0;
    let a = objects(&mut w, 1, 1, &mut now)[0];
    // Three increments of one object read the same version: one LOCK wins, the others fail
    // and abort without leaving a lock behind; a fourth started after them commits on top.
    let txns: Vec<CommitHandle> = (0..3).map(|_| start_increment(&mut w, 0, &[a])).collect();
    let outcomes = decide_all(&mut w, 0, &txns, |s| (s * 7 + 2) as usize, &mut now);
    let committed = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(committed, 1, "{outcomes:?}");
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Ok(()) | Err(TxError::Conflict(_)))),
        "{outcomes:?}"
    );
    for _ in 0..20 {
        now += 1;
        for x in w.iter_mut() {
            x.poll(now);
        }
    }
    let txn = start_increment(&mut w, 0, &[a]);
    assert_eq!(decide_all(&mut w, 0, &[txn], |_| 0, &mut now), vec![Ok(())]);
    for _ in 0..20 {
        now += 1;
        for x in w.iter_mut() {
            x.poll(now);
        }
    }
    assert_eq!(value(&mut w, 1, a), 2);
}

#[test]
fn truncation_never_passes_a_commit_still_in_flight() {
    // Backups answer COMMIT-BACKUP (RPC replication), so a commit can be held between its
    // COMMIT-BACKUP and its COMMIT-PRIMARY by not polling it.
    let mut w = common::workers_replicating(4 << 20, 2, Replication::Rpc);
    let mut now = 0;
    let at1 = objects(&mut w, 1, 2, &mut now);
    // The older commit's COMMIT-BACKUP reaches machine 2 (a backup of machine 1's region),
    // then machine 0 stops polling that commit. The newer one commits through the same
    // participants, and its records carry the thread's truncation low bound: were it past the
    // older commit, machine 2 would truncate the older COMMIT-BACKUP, installing its writes
    // before the transaction committed and dropping a record recovery needs (§5.3).
    let older = start_increment(&mut w, 0, &[at1[0]]);
    let mut older_at = None;
    for _ in 0..100 {
        now += 1;
        assert!(w[0].poll_commit(older, now).is_none(), "committed early");
        for x in w.iter_mut() {
            x.poll(now);
        }
        let t = w[0].commit_txn(older).expect("in flight");
        older_at = Some((t.machine, t.local));
        if w[2].retained_txns().contains(&(t.machine, t.local)) {
            break;
        }
    }
    let older_at = older_at.expect("polled");
    assert!(
        w[2].retained_txns().contains(&older_at),
        "the older COMMIT-BACKUP reached machine 2"
    );
    let newer = start_increment(&mut w, 0, &[at1[1]]);
    assert_eq!(
        decide_all(&mut w, 0, &[newer], |_| 0, &mut now),
        vec![Ok(())]
    );
    // Every record of the newer commit processed, truncation included.
    for _ in 0..200 {
        now += 1;
        for x in w.iter_mut() {
            x.poll(now);
        }
    }
    assert!(
        w[2].retained_txns().contains(&older_at),
        "a newer commit's truncation bound truncated the older one's COMMIT-BACKUP"
    );
    assert_eq!(
        decide_all(&mut w, 0, &[older], |_| 0, &mut now),
        vec![Ok(())]
    );
    for _ in 0..20 {
        now += 1;
        for x in w.iter_mut() {
            x.poll(now);
        }
    }
    assert_eq!(value(&mut w, 1, at1[0]), 1);
    assert_eq!(value(&mut w, 1, at1[1]), 1);
    assert!(w.iter().all(|x| x.stats().malformed == 0));
}
