//! Whole-cluster restart from NVRAM (FaRM §2 and §5: "durability for all committed transactions
//! even if the entire cluster fails or loses power"). A bank workload runs over every machine;
//! every machine stops at once in the middle of it; a cluster built with
//! `ClusterBuilder::restart` on the same NVRAM directory and coordination store recovers: every
//! acknowledged transfer is there exactly once, a transfer whose outcome the power loss hid is
//! there entirely or not at all, no money appears or vanishes, every replica equals its primary,
//! and the cluster allocates, commits and restarts again. The power may also go while the
//! cluster recovers from a machine failure: the restart finishes that recovery.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use farm::{Addr, Cluster, ClusterBuilder, MachineId, TxError};
use farm_cm::{CoordinationStore, EmbeddedStore};
use farm_core::rng::Rng;

const INITIAL: u64 = 1_000;

fn builder(dir: &std::path::Path, store: Arc<dyn CoordinationStore>) -> ClusterBuilder {
    Cluster::builder()
        .machines(3)
        .workers(2)
        .replicas(3)
        // Each worker thread carves a 1 MB block of its own per size class it allocates (slabs
        // are per thread): two threads and two classes (accounts, cold objects) may need four
        // blocks besides block 0, more than a 4 MB region has. Which host thread a call runs
        // on depends on the load, so 4 MB failed with RegionFull under a loaded CI run.
        .region_bytes(8 << 20)
        .log_bytes(256 << 10)
        .lease(Duration::from_millis(100))
        .nvram_dir(dir)
        .store(store)
}

/// A transfer: from, to, amount.
type Transfer = (usize, usize, u64);

/// What the clients saw: acknowledged transfers, and those whose outcome the power loss hid.
struct Outcomes {
    done: Vec<Transfer>,
    unknown: Vec<Transfer>,
}

/// Runs transfers from two client threads, coordinated on machines below `coordinators`, until
/// `before_power_off` returns, then cuts the power.
fn transfers_until_power_off(
    c: &Arc<Cluster>,
    accounts: &Arc<Vec<Addr>>,
    coordinators: u16,
    before_power_off: impl FnOnce(&Cluster),
) -> Outcomes {
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..2u64)
        .map(|seed| {
            let (c, accounts, stop) = (c.clone(), accounts.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = Rng::new(seed + 11);
                let (mut done, mut unknown) = (Vec::new(), Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    let m = MachineId(rng.below(coordinators as u64) as u16);
                    let (a, b, amount) = common::random_transfer(&mut rng, accounts.len());
                    let (x, y) = (accounts[a], accounts[b]);
                    let r = common::transfer(&c, m, x, y, amount);
                    match r {
                        Ok(true) => done.push((a, b, amount)),
                        Ok(false) => {}
                        // The power went while this one was committing: either way is right.
                        Err(TxError::CoordinatorFailed(_)) => {
                            unknown.push((a, b, amount));
                            break;
                        }
                        Err(e) => panic!("transfer at {m} failed: {e}"),
                    }
                }
                (done, unknown)
            })
        })
        .collect();
    before_power_off(c);
    c.power_off();
    stop.store(true, Ordering::Relaxed);
    let mut out = Outcomes {
        done: Vec::new(),
        unknown: Vec::new(),
    };
    for h in clients {
        let (d, u) = h.join().unwrap();
        out.done.extend(d);
        out.unknown.extend(u);
    }
    out
}

/// Checks the balances against the acknowledged transfers plus some subset of the unknown ones,
/// and returns the expected balances.
fn check_bank(c: &Cluster, accounts: &[Addr], before: &[u64], o: &Outcomes) -> Vec<u64> {
    let balances: Vec<u64> = c
        .txn(a_member(c), |tx| {
            accounts.iter().map(|a| tx.read::<u64>(*a)).collect()
        })
        .unwrap();
    assert_eq!(
        balances.iter().sum::<u64>(),
        before.iter().sum::<u64>(),
        "money appeared or vanished"
    );
    let apply = |subset: usize| {
        let mut expected: BTreeMap<usize, i64> = before
            .iter()
            .enumerate()
            .map(|(i, v)| (i, *v as i64))
            .collect();
        let chosen = o
            .unknown
            .iter()
            .enumerate()
            .filter(|(i, _)| subset & (1 << i) != 0)
            .map(|(_, t)| t);
        for (a, b, amount) in o.done.iter().chain(chosen) {
            *expected.get_mut(a).unwrap() -= *amount as i64;
            *expected.get_mut(b).unwrap() += *amount as i64;
        }
        expected.values().map(|v| *v as u64).collect::<Vec<u64>>()
    };
    let matching = (0..1usize << o.unknown.len()).find(|s| apply(*s) == balances);
    assert!(
        matching.is_some(),
        "balances after restart match no outcome of {} acknowledged and {} unknown transfers: \
         {balances:?} vs {:?}",
        o.done.len(),
        o.unknown.len(),
        apply(0)
    );
    balances
}

/// The lowest machine that is a member of the configuration it installed.
fn a_member(c: &Cluster) -> MachineId {
    (c.machine_states().iter())
        .find(|m| m.view().config.contains(m.id))
        .expect("a member")
        .id
}

/// Opens `per_machine` accounts of [`INITIAL`] at every machine.
fn open_accounts(c: &Cluster, per_machine: usize) -> Arc<Vec<Addr>> {
    let accounts = (0..c.machines())
        .flat_map(|m| {
            (0..per_machine)
                .map(move |_| c.txn(MachineId(m), |tx| tx.alloc(&INITIAL, None)).unwrap())
        })
        .collect();
    Arc::new(accounts)
}

/// Waits until every member settled in the current configuration: recovery is over.
fn wait_settled(c: &Cluster) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let settled = c.machine_states().iter().all(|m| {
            let view = m.view();
            !view.config.contains(m.id) || m.settled_config() == view.config.id
        });
        if settled {
            return;
        }
        assert!(Instant::now() < deadline, "recovery did not settle");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Every backup equals its primary once recovery is done.
fn check_replicas(c: &Cluster, accounts: &[Addr]) {
    wait_settled(c);
    c.quiesce();
    let report = farm_sim::check_replicas(c.machine_states()).unwrap();
    assert!(report.objects >= accounts.len());
}

#[test]
fn power_loss_mid_workload_loses_nothing_and_the_cluster_restarts_twice() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn CoordinationStore> = Arc::new(EmbeddedStore::new());
    let c = Arc::new(builder(dir.path(), store.clone()).build().unwrap());
    let accounts = open_accounts(&c, 6);
    let mut balances = vec![INITIAL; accounts.len()];
    wait_settled(&c);
    let mut c = c;
    for life in 1..=2u64 {
        let outcomes = transfers_until_power_off(&c, &accounts, c.machines(), |_| {
            std::thread::sleep(Duration::from_millis(300))
        });
        assert!(
            outcomes.done.len() > 50,
            "life {life}: only {} transfers before the power loss",
            outcomes.done.len()
        );
        drop(Arc::into_inner(c).expect("clients are gone"));
        let restarted = builder(dir.path(), store.clone())
            .restart()
            .build()
            .unwrap();
        let view = restarted.view(MachineId(0));
        assert_eq!(
            view.config.id.0,
            1 + life,
            "life {life}: the restart configuration"
        );
        assert_eq!(view.config.members.len(), 3);
        balances = check_bank(&restarted, &accounts, &balances, &outcomes);
        let stats = restarted.stats();
        println!(
            "life {life}: {} acknowledged, {} unknown; recovery decided {} commits and {} aborts",
            outcomes.done.len(),
            outcomes.unknown.len(),
            stats.recovered_commits,
            stats.recovered_aborts
        );
        // Every account is writable, and every primary allocates again (its free lists were
        // rebuilt by the allocator scan, §5.5).
        for a in accounts.iter() {
            restarted
                .txn(MachineId(1), |tx| {
                    let v: u64 = tx.read(*a)?;
                    tx.write(*a, &v)
                })
                .unwrap();
        }
        for m in 0..restarted.machines() {
            let fresh = restarted
                .txn(MachineId(m), |tx| tx.alloc(&7u64, None))
                .unwrap();
            assert_eq!(restarted.read::<u64>(MachineId(m), fresh).unwrap(), 7);
            assert!(
                !accounts.contains(&fresh),
                "a live account's slot was allocated again"
            );
            restarted.txn(MachineId(m), |tx| tx.free(fresh)).unwrap();
        }
        check_replicas(&restarted, &accounts);
        c = Arc::new(restarted);
    }
}

/// A member dies mid-workload and the power goes while the survivors still re-replicate its
/// regions (data recovery paced to a crawl, §5.4) and rebuild free lists (§5.5): the restart
/// resumes from the configuration without it, copies the unfinished replicas again, and loses
/// nothing.
#[test]
fn power_loss_during_recovery_restarts_and_finishes_recovering() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn CoordinationStore> = Arc::new(EmbeddedStore::new());
    let slow = builder(dir.path(), store.clone())
        .machines(4)
        .recovery_interval(Duration::from_secs(1))
        .lease(Duration::from_millis(20));
    let c = Arc::new(slow.build().unwrap());
    let accounts = open_accounts(&c, 4);
    // Cold objects, never written again: only a complete copy gives a new backup their data
    // (48 KB per machine, several 8 KB copy steps, one per second here).
    let cold: Vec<(Addr, [u64; 128])> = (0..c.machines())
        .flat_map(|m| {
            let c = &c;
            (0..48u64).map(move |i| {
                let v = [u64::from(m) << 32 | i; 128];
                (c.txn(MachineId(m), |tx| tx.alloc(&v, None)).unwrap(), v)
            })
        })
        .collect();
    wait_settled(&c);
    let victim = MachineId(3);
    let outcomes = transfers_until_power_off(&c, &accounts, 3, |c| {
        std::thread::sleep(Duration::from_millis(100));
        c.kill(victim);
        let deadline = Instant::now() + Duration::from_secs(30);
        while c.view(MachineId(0)).config.id.0 < 2 {
            assert!(Instant::now() < deadline, "no reconfiguration");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(100));
        let copying: usize = (0..3)
            .map(|m| c.machine_states()[m].regions_to_copy().len())
            .sum();
        assert!(copying > 0, "re-replication finished before the power loss");
    });
    assert!(
        outcomes.done.len() > 20,
        "only {} transfers",
        outcomes.done.len()
    );
    drop(Arc::into_inner(c).expect("clients are gone"));
    let restarted = builder(dir.path(), store)
        .machines(4)
        .restart()
        .build()
        .unwrap();
    let view = restarted.view(MachineId(0));
    assert_eq!(view.config.id.0, 3, "the restart configuration follows 2");
    assert!(!view.config.contains(victim), "the dead machine stays out");
    check_bank(
        &restarted,
        &accounts,
        &vec![INITIAL; accounts.len()],
        &outcomes,
    );
    check_replicas(&restarted, &accounts);
    for (a, v) in &cold {
        assert_eq!(restarted.read::<[u64; 128]>(MachineId(0), *a).unwrap(), *v);
    }
    let copies_redone = restarted
        .machine_states()
        .iter()
        .flat_map(|m| m.recovery_events())
        .filter(|e| matches!(e, farm_txn::machine::RecoveryEvent::DataRecoveryDone { .. }))
        .count();
    assert!(copies_redone > 0, "no unfinished copy was made again");
}

/// A disk dies with the power: machine 3 of four, or machine 0 (which decides a restart when
/// every machine comes back), comes back with an empty NVRAM directory. The restart refuses
/// that by default, naming the machine; with `ClusterBuilder::restart_without_lost` it
/// restarts the other three without it (decided by the lowest of them), every region served
/// again by a complete replica and replicated three times among them once data recovery
/// copied the new replicas, and the bank loses nothing.
#[test]
fn a_restart_without_a_machine_whose_disk_was_lost_loses_nothing() {
    for lost in [MachineId(3), MachineId(0)] {
        restart_without(lost);
    }
}

fn restart_without(lost: MachineId) {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn CoordinationStore> = Arc::new(EmbeddedStore::new());
    let four = |store: &Arc<dyn CoordinationStore>| builder(dir.path(), store.clone()).machines(4);
    let c = Arc::new(four(&store).build().unwrap());
    let accounts = open_accounts(&c, 6);
    let balances = vec![INITIAL; accounts.len()];
    wait_settled(&c);
    let outcomes = transfers_until_power_off(&c, &accounts, c.machines(), |_| {
        std::thread::sleep(Duration::from_millis(200))
    });
    assert!(
        outcomes.done.len() > 20,
        "{} transfers",
        outcomes.done.len()
    );
    drop(Arc::into_inner(c).expect("clients are gone"));
    std::fs::remove_dir_all(farm_txn::machine::machine_dir(dir.path(), lost)).unwrap();
    let e = four(&store).restart().build().unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("holds no state of machine {lost}")),
        "{e}"
    );
    let restarted = four(&store)
        .restart()
        .restart_without_lost(true)
        .build()
        .unwrap();
    let stayed: Vec<MachineId> = (0..4).map(MachineId).filter(|m| *m != lost).collect();
    let view = restarted.view(stayed[0]);
    assert_eq!(view.config.members, stayed);
    assert!(view
        .map
        .iter()
        .all(|(_, p)| p.replicas().count() == 3 && p.replicas().all(|m| m != lost)));
    check_bank(&restarted, &accounts, &balances, &outcomes);
    wait_settled(&restarted);
    check_replicas(&restarted, &accounts);
    for a in accounts.iter() {
        restarted
            .txn(MachineId(2), |tx| {
                let v: u64 = tx.read(*a)?;
                tx.write(*a, &v)
            })
            .unwrap();
    }
}

#[test]
fn a_restart_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn CoordinationStore> = Arc::new(EmbeddedStore::new());
    // Nothing to restart yet.
    let e = builder(dir.path(), store.clone())
        .restart()
        .build()
        .unwrap_err();
    assert!(
        e.to_string().contains("holds no state of machine m0"),
        "{e}"
    );
    let c = builder(dir.path(), store.clone()).build().unwrap();
    // A new cluster on a used directory is refused.
    let e = builder(dir.path(), Arc::new(EmbeddedStore::new()))
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("ClusterBuilder::restart"), "{e}");
    c.power_off();
    drop(c);
    // A restart with an empty coordination store.
    let e = builder(dir.path(), Arc::new(EmbeddedStore::new()))
        .restart()
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("holds no configuration"), "{e}");
    // A restart with another coordination store, which holds an older configuration.
    let other: Arc<dyn CoordinationStore> = Arc::new(EmbeddedStore::new());
    let initial = farm_core::config::Configuration::initial(3);
    let bytes = farm_cm::codec::encode(&farm_core::config::Configuration {
        id: farm_core::ConfigId(0),
        ..initial
    });
    other.compare_and_set(None, &bytes).unwrap();
    let e = builder(dir.path(), other).restart().build().unwrap_err();
    assert!(
        e.to_string().contains("the store the cluster ran with"),
        "{e}"
    );
    // The right store restarts it.
    builder(dir.path(), store).restart().build().unwrap();
}

/// The same power loss with the configuration in a real ZooKeeper: the restart reads it back
/// through a new session and stores the restart configuration there.
#[test]
fn a_cluster_restarts_from_zookeeper_and_nvram() {
    let Some((connect, root)) = common::zookeeper("restart") else {
        return;
    };
    let zk = |root: &str| -> Arc<dyn CoordinationStore> {
        Arc::new(farm::zk::ZkStore::connect(&connect, root, Duration::from_secs(10)).unwrap())
    };
    let dir = tempfile::tempdir().unwrap();
    let c = Arc::new(builder(dir.path(), zk(&root)).build().unwrap());
    let accounts = open_accounts(&c, 4);
    wait_settled(&c);
    let outcomes = transfers_until_power_off(&c, &accounts, c.machines(), |_| {
        std::thread::sleep(Duration::from_millis(200))
    });
    drop(Arc::into_inner(c).expect("clients are gone"));
    // A new session, as a restarted process would open.
    let store = zk(&root);
    let restarted = builder(dir.path(), store.clone())
        .restart()
        .build()
        .unwrap();
    let (_, bytes) = store.read().unwrap().expect("stored");
    assert_eq!(farm_cm::codec::decode(&bytes).unwrap().id.0, 2);
    check_bank(
        &restarted,
        &accounts,
        &vec![INITIAL; accounts.len()],
        &outcomes,
    );
    check_replicas(&restarted, &accounts);
}
