//! The TPC-C database: population at a reduced scale satisfies the consistency conditions 1 to 4
//! (clause 3.3.2), and the check names each one it finds broken.

use farm::{Cluster, MachineId};
use farm_workloads::tpcc::{c_key, d_key, h_key, i_key, o_key, s_key, Scale, Tables};

fn populated() -> (Cluster, Tables) {
    let c = Cluster::builder()
        .machines(3)
        .replicas(3)
        .region_bytes(64 << 20)
        .build()
        .unwrap();
    let scale = Scale {
        warehouses: 2,
        items: 200,
        districts: 3,
        customers: 30,
        new_order_from: 21,
        growth: 600,
    };
    let t = Tables::create(&c, scale, 5).unwrap();
    t.populate_items(&c, 50, 5).unwrap();
    for w in 1..=scale.warehouses {
        t.populate_warehouse(&c, w, 5, &|_| {}).unwrap();
    }
    (c, t)
}

#[test]
fn population_is_consistent_and_broken_invariants_are_named() {
    let (c, t) = populated();
    let m = MachineId(1);
    t.check(&c, m).unwrap();
    // Warehouse 1 lives on machine 0, warehouse 2 on machine 1 (co-partitioning), in every
    // table partitioned by warehouse.
    let primary = |a: farm::Addr| c.view(m).map.get(a.region).unwrap().primary;
    for w in 1..=2u32 {
        let at = MachineId(w as u16 - 1);
        assert_eq!(primary(t.district.home_bucket(&d_key(w, 1))), at);
        assert_eq!(primary(t.new_order.of(w).meta()), at);
        assert_eq!(primary(t.order_by_customer.of(w).meta()), at);
        assert_eq!(primary(t.customer_by_name.of(w).meta()), at);
        assert_eq!(primary(t.customer.home_bucket(&c_key(w, 2, 3))), at);
        assert_eq!(primary(t.order.home_bucket(&o_key(w, 3, 9))), at);
        assert_eq!(primary(t.order_line.home_bucket(&o_key(w, 3, 9))), at);
        assert_eq!(primary(t.stock.home_bucket(&s_key(w, 17))), at);
        assert_eq!(primary(t.history.home_bucket(&h_key(w, 2, 5))), at);
    }
    // ITEM has a copy on every machine, each in its machine's regions, with the same rows.
    let copies: Vec<_> = (0..3)
        .map(|copy| {
            assert_eq!(
                primary(t.item.home_bucket(&i_key(copy, 17))),
                MachineId(copy as u16)
            );
            c.txn(m, |tx| t.item.get_in(tx, &i_key(copy, 17)))
                .unwrap()
                .expect("item 17 in every copy")
        })
        .collect();
    assert!(copies.windows(2).all(|p| p[0] == p[1]), "{copies:?}");
    // Condition 4: an order line goes missing.
    let lines = c
        .txn(m, |tx| t.order_line.get_in(tx, &o_key(1, 2, 7)))
        .unwrap()
        .expect("order 7 has lines");
    let mut fewer = lines;
    fewer.count -= 1;
    c.txn(m, |tx| t.order_line.update(tx, &o_key(1, 2, 7), &fewer))
        .unwrap();
    let e = t.check(&c, m).unwrap_err();
    assert!(e.contains("district 2: condition 4"), "{e}");
    c.txn(m, |tx| t.order_line.update(tx, &o_key(1, 2, 7), &lines))
        .unwrap();
    // Condition 3: a gap in NEW-ORDER.
    c.txn(m, |tx| t.new_order.of(2).remove(tx, &o_key(2, 3, 25)))
        .unwrap();
    let e = t.check(&c, m).unwrap_err();
    assert!(e.contains("warehouse 2 district 3: condition 3"), "{e}");
    c.txn(m, |tx| t.new_order.of(2).insert(tx, &o_key(2, 3, 25), &0))
        .unwrap();
    // Condition 1: a district's YTD moves without its warehouse's.
    c.txn(m, |tx| {
        let mut d = t.district.get_in(tx, &d_key(1, 1))?.unwrap();
        d.ytd += 100;
        t.district.update(tx, &d_key(1, 1), &d)
    })
    .unwrap();
    let e = t.check(&c, m).unwrap_err();
    assert!(e.contains("warehouse 1: condition 1"), "{e}");
    c.txn(m, |tx| {
        let mut d = t.district.get_in(tx, &d_key(1, 1))?.unwrap();
        d.ytd -= 100;
        t.district.update(tx, &d_key(1, 1), &d)
    })
    .unwrap();
    // Condition 2: D_NEXT_O_ID runs ahead of the orders.
    c.txn(m, |tx| {
        let mut d = t.district.get_in(tx, &d_key(2, 2))?.unwrap();
        d.next_o_id += 1;
        t.district.update(tx, &d_key(2, 2), &d)
    })
    .unwrap();
    let e = t.check(&c, m).unwrap_err();
    assert!(e.contains("warehouse 2 district 2: condition 2"), "{e}");
}

/// Tables opened from their roots (as another process opens them) are the same tables: the
/// check passes through them, and a row written through one handle is read through the other,
/// in the partition the original put it in.
#[test]
fn tables_opened_from_their_roots_are_the_same_tables() {
    let (c, t) = populated();
    let m = MachineId(2);
    let opened = Tables::open(&c, m, t.scale, 5, &t.roots()).unwrap();
    assert_eq!(opened.roots(), t.roots());
    opened.check(&c, m).unwrap();
    let key = d_key(2, 3);
    assert_eq!(
        opened.district.home_bucket(&key),
        t.district.home_bucket(&key)
    );
    let mut row = c.txn(m, |tx| t.district.get_in(tx, &key)).unwrap().unwrap();
    row.ytd += 7;
    c.txn(m, |tx| opened.district.update(tx, &key, &row))
        .unwrap();
    let again = c.txn(m, |tx| t.district.get_in(tx, &key)).unwrap().unwrap();
    assert_eq!(again.ytd, row.ytd);
    let mut wrong = t.roots();
    wrong.pop();
    let e = Tables::open(&c, m, t.scale, 5, &wrong).unwrap_err();
    assert!(e.to_string().contains("roots for 2 warehouses"), "{e}");
}

/// Customers are findable by last name in name order (the B-tree index), and the first 1,000
/// customers' names follow their ids (clause 4.3.2.3).
#[test]
fn customers_are_indexed_by_last_name() {
    let (c, t) = populated();
    let m = MachineId(0);
    let rows = c
        .txn(m, |tx| {
            let from = farm_workloads::tpcc::name_key(1, 1, &[0; 16], &[0; 16], 0);
            let to = farm_workloads::tpcc::name_key(1, 2, &[0; 16], &[0; 16], 0);
            t.customer_by_name
                .of(1)
                .range(tx, &from, Some(&to), usize::MAX)
        })
        .unwrap();
    assert_eq!(rows.len(), 30);
    assert!(rows.windows(2).all(|w| w[0].0 < w[1].0));
    for (key, c_id) in rows {
        let cust = c
            .txn(m, |tx| {
                t.customer
                    .get_in(tx, &farm_workloads::tpcc::c_key(1, 1, c_id))
            })
            .unwrap()
            .unwrap();
        assert_eq!(&key[5..21], &cust.last);
        assert_eq!(
            cust.last,
            farm_workloads::tpcc_input::last_name(c_id as u64 - 1)
        );
    }
}

/// Warehouse 2 lives on machine 1, and so do its NEW-ORDERs' items (machine 1's copy of ITEM):
/// a NEW-ORDER reads at another machine only the STOCK rows of a remote supply warehouse (1%
/// of its lines). With ITEM spread over the machines, about two thirds of a NEW-ORDER's items
/// were remote: well over one remote read per NEW-ORDER.
#[test]
fn a_new_order_reads_its_items_where_it_runs() {
    use farm_workloads::tpcc::{Kind, Outcome};
    use farm_workloads::Rand;
    let (c, t) = populated();
    let before = c.stats();
    let mut rng = Rand::new(3);
    let mut committed = 0;
    for _ in 0..40 {
        let outcome = t
            .run(&c, None, (Kind::NewOrder, 2), &mut rng, 1, &mut 0)
            .unwrap();
        committed += (outcome == Outcome::Committed) as u32;
    }
    let after = c.stats();
    assert!(committed >= 30, "{committed} of 40 NEW-ORDERs committed");
    let remote = after.reads_remote - before.reads_remote;
    assert!(
        after.reads > before.reads + 40 * 5 && remote < 40,
        "40 NEW-ORDERs of warehouse 2 read {remote} objects at other machines (of {})",
        after.reads - before.reads
    );
}

/// The full mix from two threads (one in a session, both on random machines, home warehouses
/// at random) keeps conditions 1 to 4, and the money adds up: every warehouse's YTD grew by
/// the payments made there, and NEW-ORDER rollbacks left no order behind.
#[test]
fn the_mix_keeps_the_consistency_conditions() {
    use farm_workloads::tpcc::{Kind, Outcome};
    use farm_workloads::Rand;
    let (c, t) = populated();
    let c = std::sync::Arc::new(c);
    let t = std::sync::Arc::new(t);
    let before: Vec<i64> = (1..=2u32)
        .map(|w| {
            c.txn(MachineId(0), |tx| t.warehouse.get_in(tx, &w))
                .unwrap()
                .unwrap()
                .ytd
        })
        .collect();
    let clients: Vec<_> = (0..2u64)
        .map(|id| {
            let (c, t) = (c.clone(), t.clone());
            std::thread::spawn(move || {
                let mut rng = Rand::new(id + 7);
                let mut counts = [0u32; 5];
                let mut rolled_back = 0;
                let run = |client: &dyn Fn(Kind, u32, &mut Rand) -> Outcome,
                           rng: &mut Rand,
                           counts: &mut [u32; 5],
                           rolled_back: &mut u32| {
                    for _ in 0..400 {
                        let kind = Kind::from_draw(rng.next_u64() % 100, false);
                        let w = 1 + (rng.next_u64() % 2) as u32;
                        counts[kind as usize] += 1;
                        if client(kind, w, rng) == Outcome::RolledBack {
                            *rolled_back += 1;
                        }
                    }
                };
                if id == 0 {
                    let session = c.session();
                    run(
                        &|k, w, r| {
                            let m = Some(MachineId((r.next_u64() % 3) as u16));
                            t.run(&session, m, (k, w), r, 1, &mut 0).unwrap()
                        },
                        &mut rng,
                        &mut counts,
                        &mut rolled_back,
                    );
                } else {
                    run(
                        &|k, w, r| t.run(&*c, None, (k, w), r, 1, &mut 0).unwrap(),
                        &mut rng,
                        &mut counts,
                        &mut rolled_back,
                    );
                }
                (counts, rolled_back)
            })
        })
        .collect();
    let mut counts = [0u32; 5];
    for h in clients {
        let (cs, _) = h.join().unwrap();
        for (a, b) in counts.iter_mut().zip(cs) {
            *a += b;
        }
    }
    assert!(
        counts.iter().all(|n| *n > 0),
        "a transaction type never ran: {counts:?}"
    );
    t.check(&*c, MachineId(2)).unwrap();
    for w in 1..=2u32 {
        let ytd = c
            .txn(MachineId(0), |tx| t.warehouse.get_in(tx, &w))
            .unwrap()
            .unwrap()
            .ytd;
        assert!(ytd >= before[w as usize - 1], "warehouse {w} lost money");
    }
}

/// The full mix with many transactions in flight on each of two threads (`Tables::run_in` on a
/// pipeline of four tasks each), on the same two warehouses: conflicts among tasks of one
/// thread and of the other retry, and afterwards conditions 1 to 4 hold and every type ran.
#[test]
fn the_mix_in_flight_on_pipelines_keeps_the_consistency_conditions() {
    use farm_workloads::tpcc::{Kind, Outcome};
    use farm_workloads::Rand;
    use std::sync::atomic::{AtomicU32, Ordering};
    let (c, t) = populated();
    let counts: [AtomicU32; 5] = Default::default();
    let rolled_back = AtomicU32::new(0);
    std::thread::scope(|scope| {
        for id in 0..2u64 {
            let (c, t, counts, rolled_back) = (&c, &t, &counts, &rolled_back);
            scope.spawn(move || {
                c.pipeline(4, async |p, k| {
                    let mut rng = Rand::new(id * 10 + k as u64 + 3);
                    for _ in 0..100 {
                        let kind = Kind::from_draw(rng.next_u64() % 100, false);
                        let w = 1 + (rng.next_u64() % 2) as u32;
                        let m = Some(MachineId((rng.next_u64() % 3) as u16));
                        let outcome = t
                            .run_in(p, m, (kind, w), &mut rng, 1, &mut 0)
                            .await
                            .unwrap_or_else(|e| panic!("{kind:?} at warehouse {w}: {e}"));
                        counts[kind as usize].fetch_add(1, Ordering::Relaxed);
                        if outcome == Outcome::RolledBack {
                            rolled_back.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            });
        }
    });
    let counts: Vec<u32> = counts.iter().map(|n| n.load(Ordering::Relaxed)).collect();
    assert_eq!(counts.iter().sum::<u32>(), 800);
    assert!(
        counts.iter().all(|n| *n > 0),
        "a transaction type never ran: {counts:?}"
    );
    t.check(&c, MachineId(1)).unwrap();
}

/// A machine killed in the middle of the full mix (4 machines, a warehouse each, 3-way
/// replication, 50 ms leases): clients move off it, recovery and re-replication run, and
/// afterwards conditions 1 to 4 hold and every backup equals its primary.
#[test]
fn a_killed_machine_leaves_the_conditions_holding() {
    use farm_workloads::tpcc::Kind;
    use farm_workloads::Rand;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let c = Arc::new(
        Cluster::builder()
            .machines(4)
            .replicas(3)
            .region_bytes(64 << 20)
            .lease(Duration::from_millis(50))
            .build()
            .unwrap(),
    );
    let scale = Scale {
        warehouses: 4,
        items: 200,
        districts: 3,
        customers: 30,
        new_order_from: 21,
        growth: 3000,
    };
    let t = Arc::new(Tables::create(&*c, scale, 11).unwrap());
    t.populate_items(&*c, 50, 11).unwrap();
    for w in 1..=scale.warehouses {
        t.populate_warehouse(&*c, w, 11, &|_| {}).unwrap();
    }
    let victim = MachineId(3);
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..2u64)
        .map(|id| {
            let (c, t, stop) = (c.clone(), t.clone(), stop.clone());
            std::thread::spawn(move || {
                let session = c.session();
                let mut rng = Rand::new(id + 70);
                let (mut done, mut gave_up) = (0u64, 0u64);
                let mut down = [false; 4];
                while !stop.load(Ordering::Relaxed) {
                    let kind = Kind::from_draw(rng.next_u64() % 100, false);
                    let w = 1 + (rng.next_u64() % 4) as u32;
                    let alive: Vec<u16> = (0..4).filter(|m| !down[*m as usize]).collect();
                    let m = MachineId(alive[(rng.next_u64() % alive.len() as u64) as usize]);
                    match t.run(&session, Some(m), (kind, w), &mut rng, 1, &mut 0) {
                        Ok(_) => done += 1,
                        Err(farm::TxError::CoordinatorFailed(d) | farm::TxError::Evicted(d)) => {
                            down[d.0 as usize] = true
                        }
                        // Conflicts outlasting every retry (an object locked through recovery):
                        // rare, and nothing happened.
                        Err(e) if e.is_retryable() => gave_up += 1,
                        Err(e) => panic!("{kind:?}: {e}"),
                    }
                }
                assert!(gave_up <= 5, "{gave_up} transactions gave up on conflicts");
                done
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    c.kill(victim);
    // Run on until the survivors are in a configuration without the victim and re-replicated
    // (`background_recovery_done` is false while the victim is still a member).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.background_recovery_done() {
        assert!(Instant::now() < deadline, "recovery did not finish");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    for h in clients {
        let done = h.join().unwrap();
        assert!(done > 300, "a client barely ran: {done} transactions");
    }
    t.check(&*c, MachineId(0)).unwrap();
    c.quiesce();
    farm_sim::check_replicas(c.machine_states()).unwrap();
}

/// `Tables::bytes_per_machine` is what `farm-node local tpcc` sizes a cluster's regions by:
/// with that much room per machine (and the allocator's partly filled blocks: a block per
/// object size and thread) the tables are created and loaded in the regions the cluster
/// started with, and with a third of it the machines need more regions from the CM (§3), so
/// the estimate bounds what is used without being far above it. (Before machines asked for
/// regions, loading with a third failed with "region is full".)
#[test]
fn the_tables_fit_the_room_their_estimate_gives_and_not_a_third_of_it() {
    let scale = Scale {
        warehouses: 2,
        items: 20_000,
        districts: 10,
        customers: 300,
        new_order_from: 210,
        growth: 1000,
    };
    // Regions of 8 MiB, of which a block (1 MiB, `farm_alloc::BLOCK_BYTES`) is the region's
    // own.
    const REGION: u64 = 8 << 20;
    const USABLE: u64 = REGION - (1 << 20);
    // Regions the machines got beyond those they started with.
    let load = |room: u64| {
        let per_machine = room.div_ceil(USABLE) as u32;
        let c = Cluster::builder()
            .machines(2)
            .replicas(2)
            .workers(1)
            .region_bytes(REGION as usize)
            .regions_per_machine(per_machine)
            .build()
            .unwrap();
        let t = Tables::create(&c, scale, 5).unwrap();
        t.populate_items(&c, 50, 5).unwrap();
        for w in 1..=scale.warehouses {
            t.populate_warehouse(&c, w, 5, &|_| {}).unwrap();
        }
        t.check(&c, MachineId(0)).unwrap();
        let regions = c.view(MachineId(0)).map.iter().count() as u32;
        regions - 2 * per_machine
    };
    let estimate = Tables::bytes_per_machine(scale, 2);
    // Sixteen blocks.
    let blocks = 16 << 20;
    assert_eq!(load(estimate + blocks), 0, "the estimate's room sufficed");
    assert!(load(estimate / 3) > 0, "a third of it did not");
    assert!(
        Tables::bytes_per_machine(
            Scale {
                growth: 2000,
                ..scale
            },
            2
        ) > estimate,
        "more room for more NEW-ORDERs"
    );
}
