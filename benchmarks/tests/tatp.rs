//! TATP end to end on a small database: the mix from two threads, then the integrity check and
//! the books: call forwardings at the end = at the start + inserts - deletes that succeeded.

use std::sync::Arc;

use farm::{Cluster, MachineId};
use farm_benchmarks::tatp::{s_id, Kind, Rand, Tables};

#[test]
fn the_mix_keeps_the_database_consistent_and_the_books_balance() {
    let c = Arc::new(
        Cluster::builder()
            .machines(3)
            .replicas(3)
            .region_bytes(64 << 20)
            .build()
            .unwrap(),
    );
    let tables = Arc::new(Tables::create(&c, 2000).unwrap());
    for p in 0..3 {
        tables.populate_partition(&c, p, 8, 7, &|_| {}).unwrap();
    }
    let before = tables.check(&c).unwrap();
    let clients: Vec<_> = (0..2u64)
        .map(|id| {
            let (c, t) = (c.clone(), tables.clone());
            std::thread::spawn(move || {
                let mut rng = Rand::new(id + 1);
                let mut net = 0i64;
                let mut seen = [0u64; 7];
                let mut attempts = 0;
                for i in 0..20_000u64 {
                    let kind = Kind::from_draw(rng.next_u64() % 100);
                    seen[kind as usize] += 1;
                    let m = (i % 2 == 0).then(|| MachineId((rng.next_u64() % 3) as u16));
                    let ok = t.run(&c, m, kind, &mut rng, &mut attempts).unwrap();
                    match kind {
                        Kind::InsertCallForwarding if ok => net += 1,
                        Kind::DeleteCallForwarding if ok => net -= 1,
                        Kind::GetSubscriberData | Kind::UpdateLocation => assert!(ok),
                        _ => {}
                    }
                }
                assert!(attempts >= 20_000);
                (net, seen)
            })
        })
        .collect();
    let mut net = 0;
    let mut seen = [0u64; 7];
    for h in clients {
        let (n, s) = h.join().unwrap();
        net += n;
        for (a, b) in seen.iter_mut().zip(s) {
            *a += b;
        }
    }
    let after = tables.check(&c).unwrap();
    assert_eq!(
        after as i64,
        before as i64 + net,
        "call forwardings do not add up"
    );
    // The mix is the standard one (40,000 draws; 3 standard deviations of slack).
    for k in Kind::ALL {
        let expect = 40_000.0 * k.percent() as f64 / 100.0;
        let sd = (expect * (1.0 - k.percent() as f64 / 100.0)).sqrt();
        let got = seen[k as usize] as f64;
        assert!(
            (got - expect).abs() <= 3.0 * sd + 1.0,
            "{}: {got} of 40,000",
            k.name()
        );
    }
}

/// The non-uniform subscriber id stays in range and favours some subscribers (clause 4.2).
#[test]
fn subscriber_ids_are_in_range_and_skewed() {
    let mut rng = Rand::new(3);
    let n = 10_000u32;
    let mut hits = vec![0u32; n as usize + 1];
    for _ in 0..200_000 {
        let id = s_id(&mut rng, n);
        assert!((1..=n).contains(&id));
        hits[id as usize] += 1;
    }
    let max = *hits.iter().max().unwrap();
    let mean = 200_000 / n;
    assert!(max > 3 * mean, "not skewed: max {max}, mean {mean}");
}
