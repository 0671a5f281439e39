//! Many transactions in flight on one thread (`Client::pipeline`): tasks whose transactions
//! interleave on one host commit each exactly once, conflict with each other and with blocking
//! transactions of other threads correctly, and lose nothing when a machine is killed under
//! them.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use farm::{Addr, Client, Cluster, MachineId, Transaction, TxError};
use farm_core::rng::Rng;
use farm_core::ConfigId;

const INITIAL: u64 = 1_000;

fn cluster() -> Cluster {
    Cluster::builder()
        .machines(3)
        .workers(2)
        .replicas(3)
        .region_bytes(4 << 20)
        .lease(Duration::from_millis(20))
        .build()
        .unwrap()
}

/// `per_machine` objects holding `value` on every machine.
fn objects(c: &Cluster, per_machine: usize, value: u64) -> Vec<Addr> {
    let mut all = Vec::new();
    for m in 0..c.machines() {
        for _ in 0..per_machine {
            all.push(c.txn(MachineId(m), |tx| tx.alloc(&value, None)).unwrap());
        }
    }
    all
}

/// Moves `amount` from `x` to `y` if `x` holds it; whether it did. Written once over
/// [`Transaction`]: the same code runs blocking and among the tasks of a pipeline.
async fn transfer(
    tx: &mut impl Transaction,
    x: Addr,
    y: Addr,
    amount: u64,
) -> Result<bool, TxError> {
    let from: u64 = tx.read(x).await?;
    let to: u64 = tx.read(y).await?;
    if from < amount {
        return Ok(false);
    }
    tx.write(x, &(from - amount)).await?;
    tx.write(y, &(to + amount)).await?;
    Ok(true)
}

#[test]
fn transactions_in_flight_on_one_thread_each_commit_once() {
    let c = Arc::new(cluster());
    let counters = Arc::new(objects(&c, 3, 0));
    const TASKS: usize = 16;
    const INCREMENTS: u64 = 40;
    // Another thread increments the same counters with blocking transactions meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let blocking = {
        let (c, counters, stop) = (c.clone(), counters.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = Rng::new(99);
            let mut done = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let a = counters[rng.below(counters.len() as u64) as usize];
                c.txn(MachineId(rng.below(3) as u16), |tx| {
                    let v: u64 = tx.read(a)?;
                    tx.write(a, &(v + 1))
                })
                .unwrap();
                done += 1;
            }
            done
        })
    };
    let inside = Cell::new(0usize);
    let inside_max = Cell::new(0usize);
    let committed = Cell::new(0u64);
    c.pipeline(TASKS, async |p, k| {
        let mut rng = Rng::new(k as u64);
        for _ in 0..INCREMENTS {
            let a = counters[rng.below(counters.len() as u64) as usize];
            let b = counters[rng.below(counters.len() as u64) as usize];
            let m = MachineId((k % 3) as u16);
            inside.set(inside.get() + 1);
            inside_max.set(inside_max.get().max(inside.get()));
            p.txn(m, async |tx| {
                let x: u64 = tx.read(a).await?;
                tx.write(a, &(x + 1)).await?;
                let y: u64 = tx.read(b).await?;
                tx.write(b, &(y + 1)).await
            })
            .await
            .unwrap();
            inside.set(inside.get() - 1);
            committed.set(committed.get() + 1);
        }
    });
    stop.store(true, Ordering::Relaxed);
    let others = blocking.join().unwrap();
    assert_eq!(committed.get(), TASKS as u64 * INCREMENTS);
    assert!(
        inside_max.get() >= 4,
        "at most {} transactions of the pipeline were open at once",
        inside_max.get()
    );
    c.quiesce();
    let total: u64 = counters
        .iter()
        .map(|a| c.read::<u64>(MachineId(0), *a).unwrap())
        .sum();
    assert_eq!(
        total,
        2 * committed.get() + others,
        "each transaction commits exactly once"
    );
}

#[test]
fn a_closure_that_fails_aborts_its_transaction_and_no_other() {
    let c = cluster();
    let before = c.stats();
    let outcomes = std::cell::RefCell::new(Vec::new());
    c.pipeline(8, async |p, k| {
        let r = p
            .txn(MachineId((k % 3) as u16), async |tx| {
                tx.alloc(&(k as u64), None)?;
                if k % 2 == 0 {
                    return Err(tx.abort("even"));
                }
                Ok(k)
            })
            .await;
        outcomes.borrow_mut().push(r);
    });
    let outcomes = outcomes.into_inner();
    assert_eq!(outcomes.len(), 8);
    for r in &outcomes {
        match r {
            Ok(k) => assert_eq!(k % 2, 1),
            Err(TxError::Aborted(why)) => assert_eq!(why, "even"),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(c.stats().commits - before.commits, 4);
    c.quiesce();
}

#[test]
fn a_member_killed_under_pipelines_loses_no_acknowledged_transfer() {
    let c = Arc::new(cluster());
    let accounts = Arc::new(objects(&c, 6, INITIAL));
    let stop = Arc::new(AtomicBool::new(false));
    // Two threads of eight tasks each, coordinated by the machines that survive.
    let clients: Vec<_> = (0..2u64)
        .map(|t| {
            let (c, accounts, stop) = (c.clone(), accounts.clone(), stop.clone());
            std::thread::spawn(move || {
                let done = std::cell::RefCell::new(Vec::new());
                c.pipeline(8, async |p, k| {
                    let mut rng = Rng::new(t * 100 + k as u64);
                    while !stop.load(Ordering::Relaxed) {
                        let m = MachineId(rng.below(2) as u16);
                        let (a, b, amount) = common::random_transfer(&mut rng, accounts.len());
                        let (x, y) = (accounts[a], accounts[b]);
                        match p.txn(m, async |tx| transfer(tx, x, y, amount).await).await {
                            Ok(true) => done.borrow_mut().push((a, b, amount, Instant::now())),
                            Ok(false) => {}
                            Err(e) => panic!("transfer at {m} failed: {e}"),
                        }
                    }
                });
                done.into_inner()
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // (A pipeline keeps its host until its tasks end: the cluster's counters wait for it.)
    let killed_at = Instant::now();
    c.kill(MachineId(2));
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.view(MachineId(0)).config.id < ConfigId(2) {
        assert!(Instant::now() < deadline, "no new configuration");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let done: Vec<(usize, usize, u64, Instant)> = clients
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    assert!(
        done.iter().any(|d| d.3 > killed_at),
        "transfers commit after the kill"
    );
    c.quiesce();
    // Summed in acknowledgment order, which is not the serialization order: signed.
    let mut expected: BTreeMap<usize, i64> =
        (0..accounts.len()).map(|i| (i, INITIAL as i64)).collect();
    for (a, b, amount, _) in &done {
        *expected.get_mut(a).unwrap() -= *amount as i64;
        *expected.get_mut(b).unwrap() += *amount as i64;
    }
    let balances: Vec<u64> = c
        .txn(MachineId(0), |tx| {
            accounts.iter().map(|a| tx.read::<u64>(*a)).collect()
        })
        .unwrap();
    for (i, got) in balances.iter().enumerate() {
        assert_eq!(
            *got as i64,
            expected[&i],
            "account {i} after {} acknowledged transfers",
            done.len()
        );
    }
}

#[test]
fn blocking_and_pipelined_code_share_one_implementation() {
    // The transfer above, run blocking: every call of a `Txn` is ready at once.
    let c = cluster();
    let accounts = objects(&c, 1, INITIAL);
    let moved = c
        .txn(MachineId(1), |tx| {
            farm::ready(transfer(tx, accounts[0], accounts[2], 7))
        })
        .unwrap();
    assert!(moved);
    // And a lock-free read inside a pipeline sees it.
    let seen = Cell::new(0);
    c.pipeline(1, async |p, _| {
        seen.set(p.read::<u64>(MachineId(0), accounts[2]).await.unwrap());
    });
    assert_eq!(seen.get(), INITIAL + 7);
}

/// More tasks than a worker keeps commits in flight (`farm_txn::COMMITS_IN_FLIGHT_MAX`), all
/// coordinated by machine 0 and writing objects whose primary is machine 1 (so that each
/// commit waits for machine 1's worker to take its LOCK, between turns): a task whose commit
/// would pass the limit waits for a turn instead of failing the worker, and every
/// transaction commits once.
#[test]
fn more_tasks_than_commits_in_flight_wait_their_turn() {
    let c = cluster();
    const TASKS: usize = 3 * farm_txn::COMMITS_IN_FLIGHT_MAX;
    let slots: Vec<Addr> = (0..TASKS)
        .map(|k| {
            c.txn(MachineId(1), |tx| tx.alloc(&(k as u64), None))
                .unwrap()
        })
        .collect();
    c.pipeline(TASKS, async |p, k| {
        for round in 1..=3u64 {
            p.txn(MachineId(0), async |tx| {
                let v: u64 = tx.read(slots[k]).await?;
                tx.write(slots[k], &(v + round * 1000)).await
            })
            .await
            .unwrap();
        }
    });
    for (k, a) in slots.iter().enumerate() {
        let v: u64 = c.txn(MachineId(0), |tx| tx.read(*a)).unwrap();
        assert_eq!(v, k as u64 + 6000, "slot {k}");
    }
    c.quiesce();
}

/// The counters of a machine's threads (`stats`) are read while a pipeline keeps its host for
/// a whole batch: the executor publishes them as it goes, so a reader sees the batch's commits
/// while it runs (a machine process's statistics line reads them while its application's
/// pipeline runs for as long as the process does). Before, the reader waited for the batch.
#[test]
fn counters_are_read_while_a_pipeline_runs() {
    let c = cluster();
    let slots = objects(&c, 1, 0);
    let (over, saw) = (AtomicBool::new(false), AtomicBool::new(false));
    let seen = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let before = c.stats().commits;
            loop {
                let commits = c.stats().commits;
                if over.load(Ordering::SeqCst) {
                    return None;
                }
                if commits >= before + 100 {
                    saw.store(true, Ordering::SeqCst);
                    return Some(commits - before);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let started = Instant::now();
        c.pipeline(4, async |p, k| {
            let slot = slots[k % slots.len()];
            while !saw.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(10) {
                p.txn(MachineId((k % 3) as u16), async |tx| {
                    let v: u64 = tx.read(slot).await?;
                    tx.write(slot, &(v + 1)).await
                })
                .await
                .unwrap();
            }
            over.store(true, Ordering::SeqCst);
        });
        reader.join().unwrap()
    });
    assert!(
        seen.is_some(),
        "stats() answered only once the pipeline had ended"
    );
    c.quiesce();
}

/// Two tasks of one thread that conflict symmetrically, each reading the object the other
/// writes (both coordinated by machine 0, the objects' primary being machine 1): each
/// attempt of one fails validation on the lock the other's attempt holds. Retries must draw
/// their backoff at random: backing off by the same number of turns kept the two in step,
/// failing together until both gave up (`Conflict(Validate)` after `TXN_ATTEMPTS_MAX`).
#[test]
fn tasks_that_conflict_symmetrically_do_not_fail_in_step() {
    let c = cluster();
    let pair: Vec<Addr> = (0..2)
        .map(|_| c.txn(MachineId(1), |tx| tx.alloc(&0u64, None)).unwrap())
        .collect();
    const ROUNDS: u64 = 50;
    c.pipeline(2, async |p, k| {
        for _ in 0..ROUNDS {
            p.txn(MachineId(0), async |tx| {
                let other: u64 = tx.read(pair[1 - k]).await?;
                let mine: u64 = tx.read(pair[k]).await?;
                tx.write(pair[k], &(mine + 1 + other % 2)).await
            })
            .await
            .unwrap_or_else(|e| panic!("task {k}: {e}"));
        }
    });
    for a in &pair {
        let v: u64 = c.txn(MachineId(0), |tx| tx.read(*a)).unwrap();
        assert!((ROUNDS..=2 * ROUNDS).contains(&v), "{v}");
    }
    c.quiesce();
}
