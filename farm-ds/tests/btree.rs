//! The B-tree against a model (with fanouts small enough to split at every few inserts), with a
//! second handle whose cache goes stale, and under concurrent transactions with range scans.

use std::collections::BTreeMap;
use std::sync::Arc;

use farm::{Client, Cluster, MachineId};
use farm_core::rng::Rng;
use farm_ds::BTree;

fn cluster() -> Cluster {
    Cluster::builder()
        .machines(3)
        .workers(2)
        .replicas(3)
        .region_bytes(16 << 20)
        .log_bytes(256 << 10)
        .build()
        .unwrap()
}

const M: [MachineId; 3] = [MachineId(0), MachineId(1), MachineId(2)];

#[test]
fn random_operations_match_a_model() {
    let c = cluster();
    for seed in 0..6u64 {
        let fanout = 3 + seed as usize % 3;
        let mut rng = Rng::new(seed);
        let t: BTree<i64, u64> = BTree::create(&c, M[0], fanout, None).unwrap();
        // A second handle: its cache goes stale as the first one splits nodes.
        let u: BTree<i64, u64> = BTree::open(&c, M[1], t.meta()).unwrap();
        let mut model: BTreeMap<i64, u64> = BTreeMap::new();
        for step in 0..600u64 {
            let k = rng.below(200) as i64 - 100; // negative keys too
            let h = if rng.below(2) == 0 { &t } else { &u };
            let m = M[rng.below(3) as usize];
            match rng.below(5) {
                0..=2 => {
                    let old = c.txn(m, |tx| h.insert(tx, &k, &step)).unwrap();
                    assert_eq!(old, model.insert(k, step), "seed {seed} step {step}");
                }
                3 => {
                    let old = c.txn(m, |tx| h.remove(tx, &k)).unwrap();
                    assert_eq!(old, model.remove(&k), "seed {seed} step {step}");
                }
                _ => {
                    let (lo, n) = (rng.below(200) as i64 - 100, 1 + rng.below(30) as usize);
                    let hi = lo + rng.below(80) as i64;
                    let got = c.txn(m, |tx| h.range(tx, &lo, Some(&hi), n)).unwrap();
                    let want: Vec<(i64, u64)> =
                        model.range(lo..hi).take(n).map(|(k, v)| (*k, *v)).collect();
                    assert_eq!(
                        got, want,
                        "seed {seed} step {step}: range {lo}..{hi} max {n}"
                    );
                }
            }
            let probe = rng.below(200) as i64 - 100;
            let got = c.txn(m, |tx| h.get(tx, &probe)).unwrap();
            assert_eq!(
                got,
                model.get(&probe).copied(),
                "seed {seed} step {step}: {probe}"
            );
        }
        let all = c
            .txn(M[2], |tx| t.range(tx, &i64::MIN, None, usize::MAX))
            .unwrap();
        let want: Vec<(i64, u64)> = model.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(all, want, "seed {seed}: full scan");
    }
}

/// With its cache warm, a handle's lookups read one object each (the leaf), whatever the
/// depth; a handle whose cache went stale finds out at the leaf and reads the path again.
#[test]
fn warm_lookups_read_one_node() {
    let c = cluster();
    let t: BTree<u64, u64> = BTree::create(&c, M[0], 4, None).unwrap();
    for k in 0..500u64 {
        c.txn(M[(k % 3) as usize], |tx| {
            t.insert(tx, &(k * 7 % 500), &k).map(|_| ())
        })
        .unwrap();
    }
    // Warm: every leaf, twice (the first pass may find cached nodes the inserts made stale,
    // and then starts the cache over).
    for _ in 0..2 {
        for k in 0..500u64 {
            c.txn(M[0], |tx| t.get(tx, &k)).unwrap();
        }
    }
    let before = t.objects_read();
    for k in 0..500u64 {
        assert!(c.txn(M[1], |tx| t.get(tx, &k)).unwrap().is_some());
    }
    assert_eq!(
        t.objects_read() - before,
        500,
        "a warm lookup read more than its leaf"
    );
    // A second handle warms up, then the first splits the tree under it.
    let u: BTree<u64, u64> = BTree::open(&c, M[2], t.meta()).unwrap();
    for k in 0..500u64 {
        c.txn(M[2], |tx| u.get(tx, &k)).unwrap();
    }
    for k in 500..1500u64 {
        c.txn(M[0], |tx| t.insert(tx, &k, &k).map(|_| ())).unwrap();
    }
    for k in 0..1500u64 {
        assert!(c.txn(M[2], |tx| u.get(tx, &k)).unwrap().is_some(), "{k}");
    }
}

#[test]
fn bad_fanouts_and_meta_addresses_are_refused() {
    let c = cluster();
    let e = BTree::<u64, u64>::create(&c, M[0], 2, None).unwrap_err();
    assert!(e.to_string().contains("fanout 2"), "{e}");
    let max = BTree::<u64, u64>::max_fanout();
    assert!(max >= 100, "{max}");
    assert!(BTree::<u64, u64>::create(&c, M[0], max + 1, None).is_err());
    let t: BTree<u64, u64> = BTree::create(&c, M[0], max, None).unwrap();
    let a = c.txn(M[0], |tx| tx.alloc(&7u64, None)).unwrap();
    let e = BTree::<u64, u64>::open(&c, M[0], a).unwrap_err();
    assert!(
        e.to_string().contains("not the meta object of a B-tree"),
        "{e}"
    );
    assert!(BTree::<u64, u64>::open(&c, M[1], t.meta()).is_ok());
}

/// Two writers insert pairs of keys (2i, 2i+1) in one transaction each, through handles of
/// their own (one in a session), while a reader scans ranges: a scan never sees half a pair
/// and always sees keys in order; at the end every pair is there.
#[test]
fn concurrent_inserts_and_scans_are_serializable() {
    let c = Arc::new(cluster());
    let t: BTree<u64, u64> = BTree::create(&*c, M[0], 4, None).unwrap();
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let c = c.clone();
            let t: BTree<u64, u64> = BTree::open(&*c, M[0], t.meta()).unwrap();
            std::thread::spawn(move || {
                if w == 0 {
                    write_pairs(&c.session(), &t, w);
                } else {
                    write_pairs(&*c, &t, w);
                }
            })
        })
        .collect();
    let reader = {
        let c = c.clone();
        let t = t.clone();
        std::thread::spawn(move || {
            let mut rng = Rng::new(99);
            let mut scans = 0;
            for _ in 0..300 {
                let from = rng.below(600);
                let got = c
                    .txn(M[rng.below(3) as usize], |tx| t.range(tx, &from, None, 40))
                    .unwrap();
                assert!(
                    got.windows(2).all(|w| w[0].0 < w[1].0),
                    "out of order: {got:?}"
                );
                for (k, v) in &got {
                    let twin = k ^ 1;
                    // The twin is in the scan unless it falls outside the window scanned.
                    let inside = twin >= from && got.last().is_some_and(|l| twin <= l.0);
                    if inside {
                        assert!(
                            got.iter().any(|(x, y)| *x == twin && y == v),
                            "half a pair: {k} without {twin} in {got:?}"
                        );
                    }
                }
                scans += 1;
            }
            scans
        })
    };
    for w in writers {
        w.join().unwrap();
    }
    assert_eq!(reader.join().unwrap(), 300);
    let all = c.txn(M[1], |tx| t.range(tx, &0, None, usize::MAX)).unwrap();
    assert_eq!(all.len(), 600);
    assert!(all.iter().enumerate().all(|(i, (k, _))| *k == i as u64));
}

/// Writer `w`'s 150 pairs: pair `i` is keys `4i + 2w` and `4i + 2w + 1`, both valued `i`.
fn write_pairs(c: &impl Client, t: &BTree<u64, u64>, w: u64) {
    let mut rng = Rng::new(w + 1);
    for i in 0..150u64 {
        let pair = (i * 2 + w) * 2;
        let m = M[rng.below(3) as usize];
        c.txn(m, |tx| {
            t.insert(tx, &pair, &i)?;
            t.insert(tx, &(pair + 1), &i)
        })
        .unwrap();
    }
}
