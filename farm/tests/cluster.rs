//! Whole-cluster tests on the threaded in-process runtime (FaRM §4).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod common;

use farm::{Addr, Cluster, MachineId, TxError};
use farm_sim::{check, check_replicas, Op, TxnRecord};

fn cluster(workers: u16) -> Cluster {
    Cluster::builder()
        .machines(3)
        .workers(workers)
        .replicas(3)
        .region_bytes(4 << 20)
        .build()
        .unwrap()
}

/// A tiny xorshift for workload choices (each thread its own seed, printed by the caller).
fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Bank transfers across 3 machines with 2 workers each over 1,000 accounts: the total is
/// conserved, every acknowledged transfer is present, and backups equal primaries.
#[test]
fn bank_transfers_conserve_money_and_keep_every_acknowledged_transfer() {
    const ACCOUNTS: usize = 1000;
    let c = Arc::new(cluster(2));
    let accounts: Arc<Vec<Addr>> = Arc::new(
        (0..ACCOUNTS)
            .map(|i| {
                c.txn(MachineId((i % 3) as u16), |tx| tx.alloc(&100u64, None))
                    .unwrap()
            })
            .collect(),
    );
    let threads: Vec<_> = (0..4u64)
        .map(|seed| {
            let (c, accounts) = (c.clone(), accounts.clone());
            std::thread::spawn(move || {
                let mut x = seed + 1;
                let mut deltas = vec![0i64; ACCOUNTS];
                for _ in 0..5_000 {
                    let a = xorshift(&mut x) as usize % ACCOUNTS;
                    let b = (a + 1 + xorshift(&mut x) as usize % (ACCOUNTS - 1)) % ACCOUNTS;
                    let amount = xorshift(&mut x) % 20;
                    let m = MachineId((xorshift(&mut x) % 3) as u16);
                    let moved = c
                        .txn(m, |tx| {
                            let from: u64 = tx.read(accounts[a])?;
                            let to: u64 = tx.read(accounts[b])?;
                            if from < amount {
                                return Ok(0);
                            }
                            tx.write(accounts[a], &(from - amount))?;
                            tx.write(accounts[b], &(to + amount))?;
                            Ok(amount)
                        })
                        .unwrap();
                    deltas[a] -= moved as i64;
                    deltas[b] += moved as i64;
                }
                deltas
            })
        })
        .collect();
    let mut expected = vec![100i64; ACCOUNTS];
    for t in threads {
        for (e, d) in expected.iter_mut().zip(t.join().unwrap()) {
            *e += d;
        }
    }
    c.quiesce();
    let mut total = 0;
    for (i, a) in accounts.iter().enumerate() {
        let v: u64 = c.read(MachineId((i % 3) as u16), *a).unwrap();
        assert_eq!(v as i64, expected[i], "account {i}");
        total += v;
    }
    assert_eq!(total, 100 * ACCOUNTS as u64);
    let report = check_replicas(c.machine_states()).unwrap();
    assert_eq!(
        report.objects,
        2 * ACCOUNTS,
        "every account compared at both backups"
    );
    assert!(c.stats().commits >= 20_000);
}

/// List-append on the threaded runtime: the recorded history is strictly serializable.
#[test]
fn threaded_list_append_is_strictly_serializable() {
    const CAP: usize = 64;
    type List = [u64; CAP + 1];
    let c = Arc::new(cluster(2));
    let keys: Arc<Vec<Addr>> = Arc::new(
        (0..5)
            .map(|k| {
                c.txn(MachineId(k % 3), |tx| tx.alloc(&[0u64; CAP + 1], None))
                    .unwrap()
            })
            .collect(),
    );
    let start = Instant::now();
    let history = Arc::new(Mutex::new(Vec::<TxnRecord>::new()));
    let threads: Vec<_> = (0..3u64)
        .map(|client| {
            let (c, keys, history) = (c.clone(), keys.clone(), history.clone());
            std::thread::spawn(move || {
                let mut x = client * 7919 + 1;
                for i in 0..300u64 {
                    let plan: Vec<(usize, bool)> = (0..1 + xorshift(&mut x) % 3)
                        .map(|_| {
                            (
                                (xorshift(&mut x) % 5) as usize,
                                xorshift(&mut x).is_multiple_of(2),
                            )
                        })
                        .collect();
                    let value_base = (client << 32) | (i << 4);
                    let invoke = start.elapsed().as_nanos() as u64;
                    let m = MachineId((xorshift(&mut x) % 3) as u16);
                    let ops = c
                        .txn(m, |tx| {
                            common::list_append::<{ CAP + 1 }>(tx, &keys, &plan, value_base)
                        })
                        .unwrap();
                    let complete = start.elapsed().as_nanos() as u64;
                    history.lock().unwrap().push(TxnRecord {
                        ops,
                        invoke,
                        complete,
                        committed: true,
                    });
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let invoke = start.elapsed().as_nanos() as u64;
    let ops = c
        .txn(MachineId(0), |tx| {
            (0..5)
                .map(|k| {
                    let l: List = tx.read(keys[k])?;
                    Ok(Op::Read {
                        key: k as u64,
                        values: l[1..=l[0] as usize].to_vec(),
                    })
                })
                .collect::<Result<Vec<_>, TxError>>()
        })
        .unwrap();
    let mut h = history.lock().unwrap().clone();
    h.push(TxnRecord {
        ops,
        invoke,
        complete: start.elapsed().as_nanos() as u64,
        committed: true,
    });
    let anomalies = check(&h);
    assert!(anomalies.is_empty(), "{anomalies:#?}");
    c.quiesce();
    check_replicas(c.machine_states()).unwrap();
}

/// Lock-free readers never see a torn or uncommitted value while writers commit in a loop and
/// sometimes abort after buffering a poisoned write.
#[test]
fn lock_free_reads_are_never_torn_or_uncommitted() {
    type Obj = [u64; 16];
    let c = Arc::new(cluster(2));
    let objs: Arc<Vec<Addr>> = Arc::new(
        (0..4)
            .map(|i| {
                c.txn(MachineId(i % 3), |tx| tx.alloc(&[0u64; 16], None))
                    .unwrap()
            })
            .collect(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (c, objs, stop) = (c.clone(), objs.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let o = objs[(n % 4) as usize];
                let r = c.txn(MachineId((n % 3) as u16), |tx| {
                    let cur: Obj = tx.read(o)?;
                    if n.is_multiple_of(5) {
                        // Buffered, then aborted: must never become visible.
                        tx.write(o, &[u64::MAX; 16])?;
                        return Err(tx.abort("poison"));
                    }
                    tx.write(o, &[cur[0] + 1; 16])
                });
                assert!(n.is_multiple_of(5) || r.is_ok(), "{r:?}");
            }
            n
        })
    };
    let reader = {
        let (c, objs) = (c.clone(), objs.clone());
        std::thread::spawn(move || {
            let mut last = [0u64; 4];
            let deadline = Instant::now() + std::time::Duration::from_secs(60);
            let mut i = 0usize;
            // Read at least 20,000 times and until every object has been seen at 200 committed
            // writes or more, so that reads overlapped many commits of each object.
            while i < 20_000 || last.iter().any(|v| *v < 200) {
                assert!(Instant::now() < deadline, "writer too slow: {last:?}");
                let k = i % 4;
                let v: Obj = c.read(MachineId((i % 3) as u16), objs[k]).unwrap();
                assert!(v.iter().all(|w| *w == v[0]), "torn read {v:?}");
                assert_ne!(v[0], u64::MAX, "uncommitted value read");
                assert!(
                    v[0] >= last[k],
                    "value went back from {} to {}",
                    last[k],
                    v[0]
                );
                last[k] = v[0];
                i += 1;
            }
            (last, i)
        })
    };
    let (last, reads) = reader.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let writes = writer.join().unwrap();
    assert!(
        writes >= 800 && reads >= 20_000,
        "{writes} writes, {reads} reads"
    );
    assert!(last.iter().all(|v| *v >= 200));
}

/// A conflict aborts the transaction and `txn()` retries it: the second attempt sees the
/// conflicting commit (§4 steps 1-2).
#[test]
fn conflicts_abort_and_retry() {
    let c = cluster(2);
    let x = c.txn(MachineId(1), |tx| tx.alloc(&0u64, None)).unwrap();
    let attempts = AtomicU32::new(0);
    let seen = c
        .txn(MachineId(0), |tx| {
            let v: u64 = tx.read(x)?;
            if attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                // A conflicting commit between this read and the commit: it runs on the other
                // host (this one is held by the outer transaction).
                c.txn(MachineId(2), |inner| {
                    let v: u64 = inner.read(x)?;
                    inner.write(x, &(v + 10))
                })
                .unwrap();
            }
            tx.write(x, &(v + 1))?;
            Ok(v)
        })
        .unwrap();
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        2,
        "the first attempt aborted"
    );
    assert_eq!(seen, 10, "the retry read the conflicting write");
    assert_eq!(c.read::<u64>(MachineId(0), x).unwrap(), 11);
    assert!(c.stats().aborts() >= 1);
}

/// Read validation catches a read-only object that changed (write skew is prevented).
#[test]
fn validation_aborts_when_a_read_object_changed() {
    let c = cluster(2);
    let a = c.txn(MachineId(0), |tx| tx.alloc(&1u64, None)).unwrap();
    let b = c.txn(MachineId(1), |tx| tx.alloc(&1u64, None)).unwrap();
    let attempts = AtomicU32::new(0);
    c.txn(MachineId(2), |tx| {
        let va: u64 = tx.read(a)?;
        let vb: u64 = tx.read(b)?;
        if attempts.fetch_add(1, Ordering::SeqCst) == 0 {
            c.txn(MachineId(0), |inner| inner.write(b, &0u64)).unwrap();
        }
        if va + vb == 2 {
            tx.write(a, &0u64)?;
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    assert_eq!(
        c.read::<u64>(MachineId(0), a).unwrap(),
        1,
        "the retry saw b = 0 and wrote nothing"
    );
    assert!(c.stats().aborts_validate >= 1);
}

/// Freed objects are reused by later allocations of the same size (§5.5), and reading a freed
/// object is an error that names the problem.
#[test]
fn freed_objects_are_reused() {
    let c = Cluster::builder()
        .machines(3)
        .workers(1)
        .replicas(2)
        .region_bytes(4 << 20)
        .build()
        .unwrap();
    let m = MachineId(1);
    let first: Vec<Addr> = (0..10)
        .map(|i| c.txn(m, |tx| tx.alloc(&(i as u64), None)).unwrap())
        .collect();
    for a in &first {
        c.txn(m, |tx| tx.free(*a)).unwrap();
    }
    let err = c.txn(m, |tx| tx.read::<u64>(first[0])).unwrap_err();
    assert!(
        matches!(
            err,
            TxError::BadAddress {
                why: "object is not allocated",
                ..
            }
        ),
        "{err}"
    );
    let mut again: Vec<Addr> = (0..10)
        .map(|_| c.txn(m, |tx| tx.alloc(&7u64, None)).unwrap())
        .collect();
    let mut first_sorted = first.clone();
    first_sorted.sort();
    again.sort();
    assert_eq!(again, first_sorted, "the same slots came back");
    c.quiesce();
    check_replicas(c.machine_states()).unwrap();
}

/// Allocation honours a locality hint: in the hinted region when the coordinator's machine is
/// its primary, and through ALLOC at the remote primary otherwise (§5.5); an aborted
/// transaction gives a remotely allocated slot back, and the objects replicate.
#[test]
fn allocation_follows_locality_hints_local_and_remote() {
    let c = Cluster::builder()
        .machines(3)
        .replicas(2)
        .regions_per_machine(2)
        .region_bytes(4 << 20)
        .build()
        .unwrap();
    let a = c.txn(MachineId(2), |tx| tx.alloc(&1u64, None)).unwrap();
    for _ in 0..20 {
        let b = c.txn(MachineId(2), |tx| tx.alloc(&2u64, Some(a))).unwrap();
        assert_eq!(b.region, a.region);
    }
    // Coordinators on the other machines allocate next to `a` at its primary, machine 2; the
    // first allocation of this size carves a new block whose header must reach the backup.
    let mut near = Vec::new();
    for i in 0..30u64 {
        let m = MachineId((i % 2) as u16);
        let b = c.txn(m, |tx| tx.alloc(&[i; 40], Some(a))).unwrap();
        assert_eq!(b.region, a.region, "remote hint honoured");
        near.push(b);
    }
    for (i, b) in near.iter().enumerate() {
        assert_eq!(
            c.read::<[u64; 40]>(MachineId(0), *b).unwrap(),
            [i as u64; 40]
        );
    }
    // An aborted remote allocation returns its slot: the next one gets the same slot.
    let mut given = None;
    let e = c
        .txn(MachineId(0), |tx| {
            given = Some(tx.alloc(&[0u64; 40], Some(a))?);
            Err::<(), _>(tx.abort("changed my mind"))
        })
        .unwrap_err();
    assert!(matches!(e, TxError::Aborted(_)));
    let again = c
        .txn(MachineId(0), |tx| tx.alloc(&[9u64; 40], Some(a)))
        .unwrap();
    assert_eq!(Some(again), given, "the released slot is reused");
    let stats = c.stats();
    assert!(stats.allocs_remote >= 32, "{stats:?}");
    c.quiesce();
    check_replicas(c.machine_states()).unwrap();
}

/// Bad input gets errors that name the problem.
#[test]
fn bad_addresses_and_parameters_are_clear_errors() {
    let c = cluster(1);
    let bogus = Addr::new(farm::RegionId(99), 0);
    let e = c.txn(MachineId(0), |tx| tx.read::<u64>(bogus)).unwrap_err();
    assert_eq!(e.to_string(), "bad address r99+0x0: no such region");
    let e = Cluster::builder()
        .machines(2)
        .replicas(3)
        .build()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("3 replicas need at least that many machines"),
        "{e}"
    );
    let e = Cluster::builder()
        .region_bytes(3 << 20)
        .log_bytes(1 << 20)
        .region_bytes(1000)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("region size 1000"), "{e}");
}

/// With an NVRAM directory, regions and logs are files that hold committed data.
#[test]
fn nvram_directory_holds_regions_and_logs() {
    let dir = tempfile::tempdir().unwrap();
    let c = Cluster::builder()
        .machines(3)
        .replicas(3)
        .region_bytes(4 << 20)
        .nvram_dir(dir.path())
        .build()
        .unwrap();
    let a = c
        .txn(MachineId(0), |tx| tx.alloc(&0xfeed_u64, None))
        .unwrap();
    c.quiesce();
    for m in 0..3 {
        let path = dir.path().join(format!("m{m}/region-{}", a.region.0));
        let bytes = std::fs::read(&path).unwrap();
        let at = a.offset as usize + 8;
        assert_eq!(
            u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()),
            0xfeed,
            "{path:?}"
        );
        assert!(dir.path().join(format!("m{m}/rings")).exists());
    }
    drop(c);
}

/// More than `tr = 4` read-only objects at one primary are validated over RPC (§4 step 2), and a
/// change among them aborts the transaction.
#[test]
fn many_reads_at_one_primary_validate_over_rpc() {
    let c = cluster(2);
    // Coordinator on machine 0, six read-only objects whose primary is machine 1.
    let reads: Vec<Addr> = (0..6)
        .map(|i| {
            c.txn(MachineId(1), |tx| tx.alloc(&(i as u64), None))
                .unwrap()
        })
        .collect();
    let target = c.txn(MachineId(2), |tx| tx.alloc(&0u64, None)).unwrap();
    let attempts = AtomicU32::new(0);
    let sum = c
        .txn(MachineId(0), |tx| {
            let mut sum = 0u64;
            for a in &reads {
                sum += tx.read::<u64>(*a)?;
            }
            if attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                c.txn(MachineId(1), |inner| inner.write(reads[3], &100u64))
                    .unwrap();
            }
            tx.write(target, &sum)?;
            Ok(sum)
        })
        .unwrap();
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        2,
        "validation over RPC failed the first attempt"
    );
    assert_eq!(
        sum,
        1 + 2 + 100 + 4 + 5,
        "objects 0..6 with object 3 changed to 100"
    );
    assert_eq!(c.read::<u64>(MachineId(0), target).unwrap(), sum);
    let stats = c.stats();
    assert!(stats.validate_rpcs >= 2, "{stats:?}");
    assert!(stats.aborts_validate >= 1, "{stats:?}");
}

/// Records near the size limit in the smallest allowed logs: the rings wrap with skip markers
/// every few commits, and nothing is lost (reservations waiting for space are tested
/// deterministically in farm-txn/tests/reservations.rs).
#[test]
fn large_writes_through_small_logs_lose_nothing() {
    type Big = [u64; 1500]; // 12 KB
    let c = Cluster::builder()
        .machines(3)
        .workers(1)
        .replicas(3)
        .region_bytes(8 << 20)
        .log_bytes(256 << 10)
        .queue_bytes(256 << 10)
        .build()
        .unwrap();
    let objs: Vec<Addr> = (0..4)
        .map(|_| {
            c.txn(MachineId(1), |tx| tx.alloc(&[0u64; 1500], None))
                .unwrap()
        })
        .collect();
    for _ in 0..60 {
        c.txn(MachineId(0), |tx| {
            for o in &objs {
                let mut v: Big = tx.read(*o)?;
                v.iter_mut().for_each(|w| *w += 1);
                tx.write(*o, &v)?;
            }
            Ok(())
        })
        .unwrap();
    }
    for o in &objs {
        let v: Big = c.read(MachineId(2), *o).unwrap();
        assert!(v.iter().all(|w| *w == 60), "{:?}", &v[..4]);
    }
    c.quiesce();
    check_replicas(c.machine_states()).unwrap();
}
