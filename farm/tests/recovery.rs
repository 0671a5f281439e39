//! Failure recovery on the threaded runtime (FaRM §5.3): machines are killed in the middle of a
//! bank workload whose transfers span every machine, and afterwards every acknowledged transfer
//! is reflected exactly once, no money appears or vanishes, and every account is readable and
//! writable again (its region was blocked until lock recovery at the new primary), and once data
//! recovery has copied the regions to their new backups, every backup equals its primary.
//!
//! Clients coordinate on machines that survive: a coordinator killed under its application
//! takes the application with it, and the outcome of its last transaction is unknown to anyone
//! who could check it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use farm::{Addr, Cluster, MachineId, ReconfigEvent};
use farm_core::rng::Rng;
use farm_core::ConfigId;

const INITIAL: u64 = 1_000;

fn cluster(machines: u16) -> Cluster {
    Cluster::builder()
        .machines(machines)
        .workers(2)
        .replicas(3)
        .region_bytes(4 << 20)
        .lease(Duration::from_millis(20))
        .spare_regions(1)
        .build()
        .unwrap()
}

/// Accounts spread over every machine's regions.
fn accounts(c: &Cluster, per_machine: usize) -> Vec<Addr> {
    let mut all = Vec::new();
    for m in 0..c.machines() {
        for _ in 0..per_machine {
            all.push(c.txn(MachineId(m), |tx| tx.alloc(&INITIAL, None)).unwrap());
        }
    }
    all
}

/// A transfer that committed.
type Transfer = (usize, usize, u64);

/// Runs transfers from `threads` client threads, coordinated by `coordinators`, until `stop`.
fn run_clients(
    c: &Arc<Cluster>,
    accounts: &Arc<Vec<Addr>>,
    coordinators: Vec<MachineId>,
    threads: u64,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<Vec<Transfer>>> {
    (0..threads)
        .map(|seed| {
            let (c, accounts, stop) = (c.clone(), accounts.clone(), stop.clone());
            let coordinators = coordinators.clone();
            std::thread::spawn(move || {
                let mut rng = Rng::new(seed + 7);
                let mut done = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let m = coordinators[rng.below(coordinators.len() as u64) as usize];
                    let (a, b, amount) = common::random_transfer(&mut rng, accounts.len());
                    let (x, y) = (accounts[a], accounts[b]);
                    let r = common::transfer(&c, m, x, y, amount);
                    match r {
                        Ok(true) => done.push((a, b, amount)),
                        Ok(false) => {}
                        Err(e) => panic!("transfer at {m} failed: {e}"),
                    }
                }
                done
            })
        })
        .collect()
}

fn wait_for_config(c: &Cluster, observer: MachineId, id: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.view(observer).config.id < ConfigId(id) {
        assert!(
            Instant::now() < deadline,
            "configuration {id} not reached: {:?}",
            c.reconfig_events()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Kills `victims` in the middle of the workload and checks the bank afterwards.
fn bank_through_failures(machines: u16, victims: &[MachineId]) {
    let c = Arc::new(cluster(machines));
    let accounts = Arc::new(accounts(&c, 6));
    let survivors: Vec<MachineId> = (0..machines)
        .map(MachineId)
        .filter(|m| !victims.contains(m))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let clients = run_clients(&c, &accounts, survivors.clone(), 2, &stop);
    std::thread::sleep(Duration::from_millis(300));
    let before = c.stats().commits;
    for v in victims {
        c.kill(*v);
    }
    let observer = survivors[0];
    wait_for_config(&c, observer, 2);
    // The workload goes on through recovery and after it.
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let done: Vec<Transfer> = clients
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    assert!(
        c.stats().commits > before,
        "transactions commit after the failure"
    );
    c.quiesce();
    let mut expected: BTreeMap<usize, u64> = (0..accounts.len()).map(|i| (i, INITIAL)).collect();
    for (a, b, amount) in &done {
        *expected.get_mut(a).unwrap() -= amount;
        *expected.get_mut(b).unwrap() += amount;
    }
    let balances: Vec<u64> = c
        .txn(observer, |tx| {
            accounts.iter().map(|a| tx.read::<u64>(*a)).collect()
        })
        .unwrap();
    let wrong: Vec<String> = balances
        .iter()
        .enumerate()
        .filter(|(i, got)| **got != expected[i])
        .map(|(i, got)| {
            format!(
                "account {i} at {}: {got}, expected {}",
                accounts[i], expected[&i]
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "after {} acknowledged transfers (sum {}): {wrong:?}; events {:?}",
        done.len(),
        balances.iter().sum::<u64>(),
        c.reconfig_events()
    );
    assert_eq!(
        balances.iter().sum::<u64>(),
        INITIAL * accounts.len() as u64
    );
    // Every account is writable again, the victims' former regions included.
    for a in accounts.iter() {
        c.txn(observer, |tx| {
            let v: u64 = tx.read(*a)?;
            tx.write(*a, &v)
        })
        .unwrap();
    }
    // Data recovery restores every replica (§5.4): once done, every backup equals its primary.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.background_recovery_done() {
        assert!(Instant::now() < deadline, "re-replication did not finish");
        std::thread::sleep(Duration::from_millis(1));
    }
    c.quiesce();
    let live: Vec<_> = c
        .machine_states()
        .iter()
        .filter(|m| !victims.contains(&m.id))
        .cloned()
        .collect();
    let report = farm_sim::check_replicas(&live).unwrap();
    assert!(report.objects >= accounts.len());
    // The new backups' memory was made ready before the failure (§5.4's free NVRAM), and each
    // machine that used its spare made another once it had copied its regions.
    let used: u64 = live.iter().map(|m| m.spare_regions_used()).sum();
    assert!(used >= 1, "no new replica took a spare region");
    let deadline = Instant::now() + Duration::from_secs(30);
    while live.iter().any(|m| m.spare_regions_ready() < 1) {
        assert!(
            Instant::now() < deadline,
            "spare regions were not made again"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // With two of three replicas gone, some region was down to one copy of its data and was
    // copied without pauses (§5.4); with one gone, none was.
    let aggressive = c.timeline().recovery.iter().any(|(_, e)| {
        matches!(
            e,
            farm::RecoveryEvent::DataRecoveryStarted {
                aggressive: true,
                ..
            }
        )
    });
    assert_eq!(aggressive, victims.len() == 2);
    let stats = c.stats();
    let committed = c
        .reconfig_events()
        .iter()
        .filter(|e| matches!(e, ReconfigEvent::Committed { .. }))
        .count();
    println!(
        "{} transfers; recovery decided {} commits and {} aborts; {} configurations committed",
        done.len(),
        stats.recovered_commits,
        stats.recovered_aborts,
        committed
    );
}

#[test]
fn a_member_killed_mid_workload_loses_nothing() {
    bank_through_failures(4, &[MachineId(2)]);
}

#[test]
fn the_cm_killed_mid_workload_loses_nothing() {
    bank_through_failures(4, &[MachineId(0)]);
}

#[test]
fn two_members_killed_at_once_lose_nothing_with_three_replicas() {
    bank_through_failures(5, &[MachineId(1), MachineId(3)]);
}

/// List-append through a killed member: the threaded history, with the failure in the middle,
/// is strictly serializable (farm_sim's checker), and the final read sees every committed
/// append.
#[test]
fn list_append_through_a_killed_member_is_strictly_serializable() {
    use farm_sim::{check, Op, TxnRecord};
    use std::sync::Mutex;
    const CAP: usize = 256;
    type List = [u64; CAP + 1];
    let c = Arc::new(cluster(4));
    let victim = MachineId(3);
    let keys: Arc<Vec<Addr>> = Arc::new(
        (0..8)
            .map(|k| {
                c.txn(MachineId(k % 4), |tx| tx.alloc(&[0u64; CAP + 1], None))
                    .unwrap()
            })
            .collect(),
    );
    let start = Instant::now();
    let history = Arc::new(Mutex::new(Vec::<TxnRecord>::new()));
    let clients: Vec<_> = (0..2u64)
        .map(|client| {
            let (c, keys, history) = (c.clone(), keys.clone(), history.clone());
            std::thread::spawn(move || {
                let mut rng = Rng::new(client + 11);
                for i in 0..3000u64 {
                    let plan: Vec<(usize, bool)> = (0..1 + rng.below(3))
                        .map(|_| (rng.below(keys.len() as u64) as usize, rng.below(2) == 0))
                        .collect();
                    let value_base = (client << 32) | (i << 4);
                    let m = MachineId(rng.below(3) as u16); // Survivors only.
                    let invoke = start.elapsed().as_nanos() as u64;
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
    // Kill the victim once a fifth of the workload is done.
    let deadline = Instant::now() + Duration::from_secs(60);
    while history.lock().unwrap().len() < 1200 {
        assert!(Instant::now() < deadline, "the workload does not progress");
        std::thread::sleep(Duration::from_micros(200));
    }
    c.kill(victim);
    for h in clients {
        h.join().unwrap();
    }
    assert!(
        c.view(MachineId(0)).config.id >= ConfigId(2),
        "the victim was removed"
    );
    let invoke = start.elapsed().as_nanos() as u64;
    let ops = c
        .txn(MachineId(0), |tx| {
            keys.iter()
                .enumerate()
                .map(|(k, a)| {
                    let list: List = tx.read(*a)?;
                    Ok(Op::Read {
                        key: k as u64,
                        values: list[1..=list[0] as usize].to_vec(),
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .unwrap();
    let mut history = Arc::try_unwrap(history).unwrap().into_inner().unwrap();
    history.push(TxnRecord {
        ops,
        invoke,
        complete: start.elapsed().as_nanos() as u64,
        committed: true,
    });
    let anomalies = check(&history);
    assert!(anomalies.is_empty(), "{anomalies:#?}");
}

/// Only a complete replica becomes primary: a new backup's copy is not the region's data until
/// data recovery finished it (§5.4). With two replicas, killing a region's primary and then,
/// while the new backup still copies, the backup promoted in its place leaves the region
/// without a complete replica: the CM says so, naming the region, instead of promoting the
/// copy (whose uncopied objects would read as never written, and whose allocator scan would
/// hand their slots out again).
#[test]
fn a_backup_still_copying_is_never_promoted() {
    let c = Cluster::builder()
        .machines(5)
        .workers(1)
        .replicas(2)
        .region_bytes(4 << 20)
        .lease(Duration::from_millis(50))
        // One 8 KB chunk every 20 ms: the region's 1.6 MB of objects take seconds to copy.
        .recovery_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let addrs: Vec<Addr> = (0..800u64)
        .map(|i| c.txn(MachineId(1), |tx| tx.alloc(&[i; 128], None)).unwrap())
        .collect();
    let region = addrs[0].region;
    assert!(addrs.iter().all(|a| a.region == region));
    let before = c.view(MachineId(0)).map.get(region).unwrap().clone();
    let (primary, backup) = (before.primary, before.backups[0]);
    c.kill(primary);
    let deadline = Instant::now() + Duration::from_secs(30);
    let copying = loop {
        let v = c.view(backup);
        let p = v.map.get(region).unwrap();
        if !v.config.contains(primary) && p.primary == backup {
            let new = p.backups[0];
            if c.machine_states()[new.0 as usize]
                .regions_to_copy()
                .contains_key(&region)
            {
                break new;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{backup} not promoted with a new backup copying: {:?}",
            c.reconfig_events()
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    c.kill(backup);
    let named = format!("{region:?}");
    loop {
        for m in (0..5)
            .map(MachineId)
            .filter(|m| ![primary, backup].contains(m))
        {
            let v = c.view(m);
            assert_ne!(
                v.map.get(region).map(|p| p.primary),
                Some(copying),
                "{copying} became primary of {region:?} while copying it (configuration {}, \
                 seen at {m})",
                v.config.id.0
            );
        }
        let lost = c
            .reconfig_events()
            .iter()
            .any(|e| matches!(e, ReconfigEvent::Failed { reason, .. } if reason.contains(&named)));
        if lost {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no attempt failed naming {region:?}: {:?}",
            c.reconfig_events()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Recovery is not done while a member is down: a killed machine that the configuration still
/// holds (its lease has not run out yet) leaves its replicas to be made again elsewhere, so
/// `background_recovery_done` is false until the machine is removed and its regions copied
/// again; then true. (It asked the fabric who was alive, and said done at once.)
#[test]
fn recovery_is_not_done_while_a_killed_member_is_still_in_the_configuration() {
    let c = Cluster::builder()
        .machines(4)
        .workers(1)
        .replicas(3)
        .region_bytes(4 << 20)
        .lease(Duration::from_millis(500))
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.background_recovery_done() {
        assert!(
            Instant::now() < deadline,
            "recovery of the start did not end"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let victim = MachineId(2);
    c.kill(victim);
    assert!(c.view(MachineId(0)).config.contains(victim));
    assert!(
        !c.background_recovery_done(),
        "done while a killed member is still in the configuration"
    );
    wait_for_config(&c, MachineId(0), 2);
    assert!(!c.view(MachineId(0)).config.contains(victim));
    while !c.background_recovery_done() {
        assert!(Instant::now() < deadline, "re-replication did not finish");
        std::thread::sleep(Duration::from_millis(1));
    }
}
