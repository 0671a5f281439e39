//! The hash table against a model, at its capacity limits, across handles, and under
//! concurrent transactions.

use std::collections::BTreeMap;
use std::sync::Arc;

use farm::{Client, Cluster, MachineId, TxError};
use farm_core::rng::Rng;
use farm_ds::{HashTable, TableSpec};

fn cluster() -> Cluster {
    Cluster::builder()
        .machines(3)
        .workers(2)
        .replicas(3)
        .region_bytes(8 << 20)
        .log_bytes(256 << 10)
        .build()
        .unwrap()
}

/// A row: an id and some payload derived from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Row {
    id: u64,
    data: [u32; 6],
}

fn row(id: u64, version: u32) -> Row {
    Row {
        id,
        data: [version; 6],
    }
}

const ALL: [MachineId; 3] = [MachineId(0), MachineId(1), MachineId(2)];

#[test]
fn inserts_updates_removes_and_lookups_agree() {
    let c = cluster();
    let t: HashTable<u64, Row> =
        HashTable::create(&c, &TableSpec::with_capacity(ALL.to_vec(), 3000, 4)).unwrap();
    assert!(t.capacity() >= 3000);
    for k in 0..2000u64 {
        let m = MachineId((k % 3) as u16);
        assert!(c.txn(m, |tx| t.insert(tx, &k, &row(k, 1))).unwrap());
    }
    // A second insert of a present key changes nothing.
    assert!(!c.txn(ALL[0], |tx| t.insert(tx, &7, &row(7, 9))).unwrap());
    for k in 0..2000u64 {
        let m = MachineId((k % 3) as u16);
        assert_eq!(t.get(&c, m, &k).unwrap(), Some(row(k, 1)), "lock-free {k}");
        assert_eq!(
            c.txn(m, |tx| t.get_in(tx, &k)).unwrap(),
            Some(row(k, 1)),
            "transactional {k}"
        );
    }
    assert_eq!(t.get(&c, ALL[1], &5000).unwrap(), None);
    for k in (0..2000u64).step_by(2) {
        assert!(c.txn(ALL[2], |tx| t.update(tx, &k, &row(k, 2))).unwrap());
    }
    assert!(!c.txn(ALL[2], |tx| t.update(tx, &9999, &row(0, 0))).unwrap());
    for k in (0..2000u64).step_by(3) {
        let was = c.txn(ALL[0], |tx| t.remove(tx, &k)).unwrap();
        assert_eq!(was, Some(row(k, if k % 2 == 0 { 2 } else { 1 })));
    }
    assert_eq!(c.txn(ALL[0], |tx| t.remove(tx, &0)).unwrap(), None);
    for k in 0..2000u64 {
        let expect = match (k % 3 == 0, k % 2 == 0) {
            (true, _) => None,
            (false, true) => Some(row(k, 2)),
            (false, false) => Some(row(k, 1)),
        };
        assert_eq!(t.get(&c, ALL[(k % 3) as usize], &k).unwrap(), expect, "{k}");
    }
}

/// Random operations on a table small enough that entries spill past their home bucket,
/// checked against a map after every operation, for many seeds.
#[test]
fn random_operations_match_a_model_with_spilled_entries() {
    let c = cluster();
    for seed in 0..12u64 {
        let mut rng = Rng::new(seed);
        let spec = TableSpec {
            partitions: vec![MachineId((seed % 3) as u16)],
            buckets: 6,
            slots: 3,
        };
        let t: HashTable<u32, u64> = HashTable::create(&c, &spec).unwrap();
        let mut model: BTreeMap<u32, u64> = BTreeMap::new();
        let mut full_seen = 0;
        for step in 0..300u64 {
            let k = rng.below(40) as u32;
            let v = seed << 32 | step;
            let m = MachineId(rng.below(3) as u16);
            match rng.below(4) {
                0 | 1 => match c.txn(m, |tx| t.insert(tx, &k, &v)) {
                    Ok(inserted) => {
                        assert_eq!(inserted, !model.contains_key(&k), "seed {seed} step {step}");
                        model.entry(k).or_insert(v);
                    }
                    Err(TxError::Aborted(why)) => {
                        assert!(why.contains("is full"), "{why}");
                        assert!(!model.contains_key(&k));
                        full_seen += 1;
                    }
                    Err(e) => panic!("seed {seed} step {step}: {e}"),
                },
                2 => {
                    let updated = c.txn(m, |tx| t.update(tx, &k, &v)).unwrap();
                    assert_eq!(updated, model.contains_key(&k));
                    if let Some(x) = model.get_mut(&k) {
                        *x = v;
                    }
                }
                _ => {
                    let removed = c.txn(m, |tx| t.remove(tx, &k)).unwrap();
                    assert_eq!(removed, model.remove(&k), "seed {seed} step {step}");
                }
            }
            let probe = rng.below(40) as u32;
            assert_eq!(
                t.get(&c, m, &probe).unwrap(),
                model.get(&probe).copied(),
                "seed {seed} step {step}: lookup of {probe}"
            );
        }
        for k in 0..40u32 {
            assert_eq!(t.get(&c, ALL[0], &k).unwrap(), model.get(&k).copied());
        }
        assert!(model.len() <= t.capacity() as usize);
        // 40 keys into 18 slots: the table fills up and says so.
        assert!(full_seen > 0, "seed {seed}: the table never filled");
    }
}

#[test]
fn a_full_table_says_so_and_bad_specs_are_refused() {
    let c = cluster();
    let spec = TableSpec {
        partitions: vec![ALL[0]],
        buckets: 2,
        slots: 2,
    };
    let t: HashTable<u64, u64> = HashTable::create(&c, &spec).unwrap();
    for k in 0..4u64 {
        assert!(c.txn(ALL[0], |tx| t.insert(tx, &k, &k)).unwrap());
    }
    let e = c.txn(ALL[0], |tx| t.insert(tx, &4, &4)).unwrap_err();
    assert!(
        e.to_string().contains("is full") && e.to_string().contains("more buckets"),
        "{e}"
    );
    // Room again after a remove.
    assert_eq!(c.txn(ALL[0], |tx| t.remove(tx, &2)).unwrap(), Some(2));
    assert!(c.txn(ALL[0], |tx| t.insert(tx, &4, &4)).unwrap());
    let bad = |spec: TableSpec| {
        HashTable::<u64, u64>::create(&c, &spec)
            .unwrap_err()
            .to_string()
    };
    let e = bad(TableSpec {
        slots: 0,
        ..spec.clone()
    });
    assert!(e.contains("0 slots per bucket"), "{e}");
    let e = bad(TableSpec {
        partitions: vec![MachineId(7)],
        ..spec.clone()
    });
    assert!(e.contains("machine m7, which does not exist"), "{e}");
    let e = HashTable::<[u8; 4000], u64>::create(
        &c,
        &TableSpec {
            slots: 8,
            ..spec.clone()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("use fewer slots"), "{e}");
}

#[test]
fn another_handle_opens_the_table_from_its_root() {
    let c = cluster();
    let spec = TableSpec::with_capacity(ALL.to_vec(), 5000, 8);
    let t: HashTable<u64, u64> = HashTable::create(&c, &spec).unwrap();
    for k in 0..100u64 {
        c.txn(ALL[1], |tx| t.insert(tx, &k, &(k * k))).unwrap();
    }
    let u: HashTable<u64, u64> = HashTable::open(&c, ALL[2], t.root()).unwrap();
    assert_eq!(u.capacity(), t.capacity());
    for k in 0..100u64 {
        assert_eq!(u.get(&c, ALL[2], &k).unwrap(), Some(k * k));
        assert_eq!(u.home_bucket(&k), t.home_bucket(&k));
    }
    let e = HashTable::<u32, u64>::open(&c, ALL[0], t.root()).unwrap_err();
    assert!(e.to_string().contains("8-byte keys"), "{e}");
    let e = HashTable::<u64, u64>::open(&c, ALL[0], t.home_bucket(&1)).unwrap_err();
    assert!(
        e.to_string().contains("not the root of a hash table"),
        "{e}"
    );
}

/// A table with more directory pages than a root object can list (here 2,100 partitions of one
/// bucket, each its own page; TPC-C's STOCK at seven warehouses on three machines had 2,637):
/// the root lists page lists, and another handle opens the same table.
#[test]
fn a_table_of_more_directory_pages_than_a_root_holds_opens_from_its_root() {
    let c = cluster();
    let spec = TableSpec {
        partitions: (0..2100).map(|p| ALL[p % 3]).collect(),
        buckets: 1,
        slots: 4,
    };
    let t: HashTable<u64, u64> = HashTable::create(&c, &spec).unwrap();
    assert_eq!(t.partitions(), 2100);
    for k in 0..500u64 {
        assert!(c.txn(ALL[0], |tx| t.insert(tx, &k, &(k + 1))).unwrap());
    }
    let u: HashTable<u64, u64> = HashTable::open(&c, ALL[1], t.root()).unwrap();
    assert_eq!(
        (u.partitions(), u.capacity()),
        (t.partitions(), t.capacity())
    );
    for k in 0..500u64 {
        assert_eq!(u.home_bucket(&k), t.home_bucket(&k));
        assert_eq!(u.get(&c, ALL[1], &k).unwrap(), Some(k + 1));
    }
    assert_eq!(u.get(&c, ALL[1], &500).unwrap(), None);
}

/// Keys go to the partition a partitioner names, and partitions live on their machines.
#[test]
fn partitions_place_keys_on_their_machines() {
    let c = cluster();
    let spec = TableSpec::with_capacity(ALL.to_vec(), 3000, 4);
    let t: HashTable<u64, u64> = HashTable::create(&c, &spec)
        .unwrap()
        .with_partitioner(|k: &u64| (*k / 1000) as usize);
    for k in [5u64, 1500, 2999] {
        let p = t.partition_of(&k);
        assert_eq!(p, (k / 1000) as usize);
        let region = t.home_bucket(&k).region;
        let primary = c.view(ALL[0]).map.get(region).unwrap().primary;
        assert_eq!(primary, spec.partitions[p], "key {k}");
        assert_eq!(t.partition_hint(p).region, region);
    }
}

/// Two threads increment shared counters and insert and remove keys of their own, with
/// lock-free lookups in between, one through the cluster and one through a session (which
/// keeps its host): every increment counts once, and each thread's keys are exactly those it
/// left.
#[test]
fn concurrent_transactions_on_shared_buckets_are_serializable() {
    let c = Arc::new(cluster());
    let spec = TableSpec {
        partitions: ALL.to_vec(),
        buckets: 4,
        slots: 8,
    };
    let t: HashTable<u64, u64> = HashTable::create(&c, &spec).unwrap();
    for k in 0..8u64 {
        c.txn(ALL[0], |tx| t.insert(tx, &k, &0)).unwrap();
    }
    let threads: Vec<_> = (0..2u64)
        .map(|id| {
            let (c, t) = (c.clone(), t.clone());
            std::thread::spawn(move || {
                if id == 0 {
                    churn(&*c, &t, id)
                } else {
                    churn(&c.session(), &t, id)
                }
            })
        })
        .collect();
    let kept: Vec<Vec<u64>> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    let total: u64 = (0..8u64)
        .map(|k| t.get(&c, ALL[0], &k).unwrap().unwrap())
        .sum();
    assert_eq!(total, 800, "an increment was lost or doubled");
    for (id, mine) in kept.iter().enumerate() {
        for i in 0..20u64 {
            let k = 1000 * (id as u64 + 1) + i;
            assert_eq!(
                t.get(&c, ALL[1], &k).unwrap().is_some(),
                mine.contains(&k),
                "key {k}"
            );
        }
    }
}

/// 400 increments of random counters, each followed by an insert or remove of one of 20 keys
/// of thread `id`'s own, and a lookup. Returns the keys the thread left in the table.
fn churn(c: &impl Client, t: &HashTable<u64, u64>, id: u64) -> Vec<u64> {
    let mut rng = Rng::new(id + 100);
    let mut mine = Vec::new();
    for i in 0..400u64 {
        let m = MachineId(rng.below(3) as u16);
        let counter = rng.below(8);
        c.txn(m, |tx| {
            let v = t.get_in(tx, &counter)?.expect("counter");
            t.update(tx, &counter, &(v + 1)).map(|_| ())
        })
        .unwrap();
        let own = 1000 * (id + 1) + i % 20;
        if mine.contains(&own) {
            assert_eq!(c.txn(m, |tx| t.remove(tx, &own)).unwrap(), Some(i));
            mine.retain(|k| *k != own);
        } else {
            assert!(c.txn(m, |tx| t.insert(tx, &own, &(i + 20))).unwrap());
            mine.push(own);
        }
        assert!(t.get(c, m, &counter).unwrap().is_some());
    }
    mine
}

/// Each machine creates its own partition (its buckets and their directory pages, where it is
/// primary), all at once, and a root made from their pages opens as one table: how
/// `farm-node` creates TPC-C's tables. Partitions of several directory pages, the last one
/// partly full; a root refuses pages of the wrong partitions.
#[test]
fn partitions_created_apart_make_one_table() {
    let c = cluster();
    let spec = TableSpec {
        partitions: ALL.to_vec(),
        buckets: 2 * 1024 + 100,
        slots: 1,
    };
    assert_eq!(spec.pages_per_partition(), 3);
    let pages: Vec<Vec<farm::Addr>> = std::thread::scope(|s| {
        let made: Vec<_> = (0..ALL.len())
            .rev()
            .map(|p| {
                let (c, spec) = (&c, &spec);
                s.spawn(move || HashTable::<u64, u64>::create_partition(c, spec, p).unwrap())
            })
            .collect();
        made.into_iter().rev().map(|h| h.join().unwrap()).collect()
    });
    assert!(pages.iter().all(|p| p.len() == 3), "{pages:?}");
    let e = HashTable::<u64, u64>::create_root(&c, &spec, &pages[..2]).unwrap_err();
    assert!(e.to_string().contains("directory pages each"), "{e}");
    let root = HashTable::<u64, u64>::create_root(&c, &spec, &pages).unwrap();
    let t: HashTable<u64, u64> = HashTable::open(&c, ALL[1], root).unwrap();
    assert_eq!(t.capacity(), 3 * (2 * 1024 + 100));
    for k in 0..3000u64 {
        assert!(c
            .txn(ALL[(k % 3) as usize], |tx| t.insert(tx, &k, &(k + 1)))
            .unwrap());
    }
    let u: HashTable<u64, u64> = HashTable::open(&c, ALL[2], root).unwrap();
    for k in 0..3000u64 {
        assert_eq!(u.get(&c, ALL[0], &k).unwrap(), Some(k + 1), "{k}");
    }
}
