//! Reconfiguration on the threaded runtime (FaRM §5.2): a killed machine is suspected through
//! leases, the configuration without it is stored by compare-and-set and committed, its regions
//! are remapped (a backup promoted for every lost primary, replication restored where there is
//! room), regions whose replicas changed are blocked until recovery while the others keep
//! committing, and a killed CM is replaced by a backup CM. Times are printed, not asserted.

use std::time::{Duration, Instant};

mod common;

use farm::{Addr, Cluster, MachineId, ReconfigEvent, RegionId};
use farm_cm::reconfig::backup_cms;
use farm_core::config::Configuration;
use farm_core::ConfigId;

const LEASE: Duration = Duration::from_millis(50);

fn cluster() -> Cluster {
    cluster_of(4)
}

fn cluster_of(machines: u16) -> Cluster {
    Cluster::builder()
        .machines(machines)
        .workers(2)
        .replicas(3)
        .region_bytes(4 << 20)
        .lease(LEASE)
        .build()
        .unwrap()
}

fn wait_for_config(c: &Cluster, observer: MachineId, id: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c
        .reconfig_events()
        .iter()
        .any(|e| matches!(e, ReconfigEvent::Committed { config, .. } if config.0 == id))
        || c.view(observer).config.id != ConfigId(id)
    {
        assert!(
            Instant::now() < deadline,
            "configuration {id} not committed: {:?}",
            c.reconfig_events()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn transfers(c: &Cluster, a: Addr, b: Addr, n: u64) {
    for i in 0..n {
        c.txn(MachineId((i % 3) as u16), |tx| {
            let x: u64 = tx.read(a)?;
            let y: u64 = tx.read(b)?;
            tx.write(a, &(x - 1))?;
            tx.write(b, &(y + 1))
        })
        .unwrap();
    }
}

#[test]
fn a_killed_member_is_removed_and_its_regions_remapped_and_blocked() {
    let c = cluster();
    let before = c.view(MachineId(0));
    // Accounts in a region whose primary is the CM, machine 0; the victim is the one machine
    // that holds no replica of it, and `x` lives in a region the victim is primary for.
    let a = c.txn(MachineId(0), |tx| tx.alloc(&1_000u64, None)).unwrap();
    let b = c
        .txn(MachineId(0), |tx| tx.alloc(&1_000u64, Some(a)))
        .unwrap();
    let home = before.map.get(a.region).unwrap().clone();
    let victim = (0..4).map(MachineId).find(|m| !home.holds(*m)).unwrap();
    let x = c.txn(victim, |tx| tx.alloc(&7u64, None)).unwrap();
    let lost = before.map.get(x.region).unwrap().clone();
    assert_eq!(lost.primary, victim);
    let affected: Vec<RegionId> = before
        .map
        .iter()
        .filter(|(_, p)| p.holds(victim))
        .map(|(r, _)| r)
        .collect();
    transfers(&c, a, b, 300);
    c.kill(victim);
    wait_for_config(&c, MachineId(0), 2);
    let survivors: Vec<MachineId> = (0..4).map(MachineId).filter(|m| *m != victim).collect();
    for &m in &survivors {
        let v = c.view(m);
        assert_eq!(
            v.config.id,
            ConfigId(2),
            "{m} installed the new configuration"
        );
        assert_eq!(v.config.members, survivors);
        assert_eq!(v.config.cm, MachineId(0));
        assert!(
            v.map.iter().all(|(_, p)| !p.holds(victim)),
            "the victim holds nothing"
        );
        assert_eq!(
            v.map.get(x.region).unwrap().primary,
            lost.backups[0],
            "the first surviving backup of the victim's region is promoted"
        );
        assert!(
            v.map.iter().all(|(_, p)| p.backups.len() == 2),
            "3 replicas restored on the 3 survivors"
        );
        assert_eq!(v.blocked.iter().copied().collect::<Vec<_>>(), affected);
        assert!(!v.is_blocked(a.region));
    }
    // Unaffected regions keep committing; nothing committed before the failure is lost.
    transfers(&c, a, b, 300);
    let (va, vb): (u64, u64) = (
        c.read(MachineId(1), a).unwrap(),
        c.read(MachineId(2), b).unwrap(),
    );
    assert_eq!((va, vb), (400, 1600));
    // Regions whose replicas changed were blocked until transaction recovery made them active
    // at their new primary; `txn()` waits that out, and the promoted backup has the value.
    assert_eq!(c.txn(MachineId(0), |tx| tx.read::<u64>(x)).unwrap(), 7);
    assert_eq!(c.txn(MachineId(0), |tx| tx.read::<u64>(x)).unwrap(), 7);
    let ev = c.reconfig_events();
    let at = |f: &dyn Fn(&ReconfigEvent) -> Option<u64>| ev.iter().find_map(f).expect("event");
    let suspect = at(&|e| match e {
        ReconfigEvent::Suspect { machine, at_us } if *machine == victim => Some(*at_us),
        _ => None,
    });
    let probed = at(&|e| match e {
        ReconfigEvent::Probed { at_us } => Some(*at_us),
        _ => None,
    });
    let stored = at(&|e| match e {
        ReconfigEvent::Stored { at_us, .. } => Some(*at_us),
        _ => None,
    });
    let committed = at(&|e| match e {
        ReconfigEvent::Committed { at_us, .. } => Some(*at_us),
        _ => None,
    });
    assert!(
        suspect <= probed && probed <= stored && stored <= committed,
        "{ev:?}"
    );
    println!(
        "suspect -> probed {} us -> stored {} us -> committed {} us (lease {} us)",
        probed - suspect,
        stored - suspect,
        committed - suspect,
        LEASE.as_micros()
    );
}

#[test]
fn a_killed_cm_is_replaced_by_a_backup_cm() {
    let c = cluster();
    let expected = backup_cms(&Configuration::initial(4), 3)[0];
    c.kill(MachineId(0));
    wait_for_config(&c, expected, 2);
    let v = c.view(expected);
    assert_eq!(v.config.cm, expected, "the first backup CM became CM");
    assert!(!v.config.contains(MachineId(0)));
    assert_eq!(v.config.members.len(), 3);
    assert!(v.map.iter().all(|(_, p)| !p.holds(MachineId(0))));
}

/// The same reconfiguration with the configuration in a real ZooKeeper (`ZK_CONNECT`; under
/// `CI=true` it must be there, elsewhere the test is skipped with a reason): the znode ends up
/// holding the committed configuration.
#[test]
fn reconfiguration_stores_the_new_configuration_in_zookeeper() {
    use farm::zk::ZkStore;
    use farm::CoordinationStore;
    use std::sync::Arc;

    let Some((connect, root)) = common::zookeeper("reconfig") else {
        return;
    };
    let store = Arc::new(ZkStore::connect(&connect, &root, Duration::from_secs(10)).unwrap());
    let c = Cluster::builder()
        .machines(4)
        .replicas(3)
        .region_bytes(4 << 20)
        .lease(LEASE)
        .store(store.clone())
        .build()
        .unwrap();
    let (_, first) = store
        .read()
        .unwrap()
        .expect("the first configuration is stored at start");
    assert_eq!(
        farm_cm::codec::decode(&first).unwrap(),
        Configuration::initial(4)
    );
    c.kill(MachineId(2));
    wait_for_config(&c, MachineId(0), 2);
    let (_, stored) = store.read().unwrap().unwrap();
    assert_eq!(
        farm_cm::codec::decode(&stored).unwrap(),
        c.view(MachineId(0)).config
    );
    // A second cluster cannot take over a store that already holds a configuration.
    let e = Cluster::builder()
        .machines(3)
        .region_bytes(4 << 20)
        .store(store)
        .build()
        .unwrap_err();
    assert!(
        e.to_string().contains("already holds a configuration"),
        "{e}"
    );
}

/// A machine joins a running cluster (§5.2) and receives regions allocated through the CM (§3:
/// next id, least-loaded replicas in distinct failure domains, prepare/commit); a region
/// allocated near another gets the same replicas; transactions use the new regions.
#[test]
fn a_machine_joins_and_receives_regions() {
    let c = Cluster::builder()
        .machines(3)
        .spare_machines(1)
        .workers(2)
        .replicas(3)
        .region_bytes(4 << 20)
        .lease(LEASE)
        .build()
        .unwrap();
    let spare = MachineId(3);
    assert!(!c.view(MachineId(0)).config.contains(spare));
    let e = c.join(MachineId(1)).unwrap_err();
    assert!(e.to_string().contains("already a member"), "{e}");
    assert_eq!(c.join(spare).unwrap(), ConfigId(2));
    for m in 0..4 {
        assert_eq!(
            c.view(MachineId(m)).config.members.len(),
            4,
            "machine {m} sees the join"
        );
    }
    // The newcomer holds no region yet, so it is the least loaded: the new region's primary.
    let r = c.allocate_region(None).unwrap();
    assert_eq!(r, RegionId(3), "ids come from the CM's counter");
    let p = c.view(MachineId(0)).map.get(r).cloned().unwrap();
    assert_eq!(p.primary, spare);
    // Committed as a configuration with the same members, installed everywhere.
    for m in 0..4 {
        let v = c.view(MachineId(m));
        assert_eq!((v.config.id, v.config.members.len()), (ConfigId(3), 4));
        assert!(v.map.get(r).is_some(), "machine {m} does not map {r:?}");
    }
    assert_eq!(p.backups.len(), 2);
    // Co-located with region 0.
    let near = c.allocate_region(Some(RegionId(0))).unwrap();
    assert_eq!(
        c.view(MachineId(1)).map.get(near),
        c.view(MachineId(1)).map.get(RegionId(0))
    );
    // Objects in the new region, allocated by its primary, are read and written everywhere.
    let a = c.txn(spare, |tx| tx.alloc(&5u64, None)).unwrap();
    assert_eq!(a.region, r);
    c.txn(MachineId(0), |tx| {
        let v: u64 = tx.read(a)?;
        tx.write(a, &(v * 2))
    })
    .unwrap();
    assert_eq!(c.read::<u64>(MachineId(2), a).unwrap(), 10);
    c.quiesce();
    farm_sim::check_replicas(c.machine_states()).unwrap();
    // The newcomer holds a lease at the CM like everyone else: no suspicions.
    std::thread::sleep(LEASE * 3);
    assert_eq!(c.suspicions(), vec![]);
}

/// A partition with the CM on the minority side (FaRM §5.2): the minority cannot reconfigure
/// (its probes reach no majority), the majority replaces the CM and goes on committing, and the
/// cut-off machines stay out of the new configuration even after the partition heals.
#[test]
fn a_minority_partition_cannot_reconfigure_and_the_majority_goes_on() {
    let c = cluster_of(5);
    // A region whose replicas are all in the majority {2, 3, 4}.
    let majority = [MachineId(2), MachineId(3), MachineId(4)];
    let view = c.view(MachineId(0));
    let (region, p) = view
        .map
        .iter()
        .find(|(_, p)| {
            std::iter::once(&p.primary)
                .chain(&p.backups)
                .all(|m| majority.contains(m))
        })
        .expect("the CM's balanced placement puts one region on machines 2, 3 and 4");
    let a = c
        .txn(p.primary, |tx| {
            tx.alloc(&100u64, Some(Addr::new(region, 0)))
        })
        .unwrap();
    assert_eq!(a.region, region);
    c.fabric().partition(&[
        &[MachineId(0), MachineId(1)],
        &[MachineId(2), MachineId(3), MachineId(4)],
    ]);
    wait_for_config(&c, MachineId(2), 2);
    let v = c.view(MachineId(2));
    assert_eq!(
        v.config.members,
        vec![MachineId(2), MachineId(3), MachineId(4)]
    );
    assert!(
        v.config.members.contains(&v.config.cm),
        "a majority machine became CM"
    );
    for m in [0, 1] {
        assert_eq!(
            c.view(MachineId(m)).config.id,
            ConfigId(1),
            "the minority never installs a configuration"
        );
    }
    // (Whether the minority CM got to try before the majority moved on depends on timing; when
    // it does, its probes reach no majority: farm-cm's reconfig tests check that exactly.)
    // The majority commits on regions that kept all their replicas.
    for _ in 0..50 {
        c.txn(MachineId(3), |tx| {
            let v: u64 = tx.read(a)?;
            tx.write(a, &(v + 1))
        })
        .unwrap();
    }
    c.fabric().heal();
    assert_eq!(c.read::<u64>(MachineId(4), a).unwrap(), 150);
    assert!(!c.view(MachineId(4)).config.contains(MachineId(0)));
    // The cut-off machine cannot coordinate until it rejoins: an error, not a commit that
    // waits forever for members that ignore it.
    assert_eq!(
        c.txn(MachineId(0), |tx| {
            let v: u64 = tx.read(a)?;
            tx.write(a, &(v + 1))
        })
        .unwrap_err(),
        farm::TxError::Evicted(MachineId(0))
    );
}

/// A member cut off together with its CM keeps renewing its lease with that CM, and serves
/// reads while the lease holds (§5.1). The majority's configuration without both commits once
/// the leases it knows of ended (§5.2 step 7), so the old CM's grants must end by then too:
/// here machine 1, primary of a region whose backups carry on in the majority, served the
/// value the majority had since overwritten (a CM's grants were bounded by nothing). A grant
/// now ends no later than a lease after the CM's own leases at its members did
/// (`farm_cm::lease`), and a removed machine grants none.
#[test]
fn a_member_cut_off_with_its_cm_serves_no_value_the_majority_overwrote() {
    let c = cluster_of(5);
    let view = c.view(MachineId(0));
    let (region, _) = view
        .map
        .iter()
        .find(|(_, p)| p.primary == MachineId(1))
        .expect("machine 1 is primary of a region");
    let a = c
        .txn(MachineId(1), |tx| {
            tx.alloc(&100u64, Some(Addr::new(region, 0)))
        })
        .unwrap();
    assert_eq!(a.region, region);
    c.fabric().partition(&[
        &[MachineId(0), MachineId(1)],
        &[MachineId(2), MachineId(3), MachineId(4)],
    ]);
    wait_for_config(&c, MachineId(2), 2);
    c.txn(MachineId(3), |tx| tx.write(a, &101u64)).unwrap();
    // The majority moved on: machine 1's lease (granted by machine 0) has ended, and machine 0,
    // removed, no longer renews it; machine 1 suspects it and learns from the store that it
    // was removed too.
    let evicted = Err(farm::TxError::Evicted(MachineId(1)));
    let read = c.txn(MachineId(1), |tx| tx.read::<u64>(a));
    assert_eq!(read, evicted, "after the majority wrote 101");
    let read = c.read::<u64>(MachineId(1), a);
    assert_eq!(read, evicted, "lock-free, after the majority wrote 101");
}

/// As above, but the majority does not wait for the CM's lease to run out: the first backup CM
/// commits a write that the CM backs, the write into the CM's log stalls, the link breaks, and
/// it removes the CM at once (the link's writes stall while the partition lasts). The member cut
/// off with the CM must still not serve what the majority wrote. It did, in about one run in
/// seven: the commit waited a lease from the probes, but the CM had held its leases at the
/// members until the cut and went on renewing the member's for a lease after. The commit now
/// waits two leases after the last NEW-CONFIG-ACK (`Reconfig::hold_after_acks`).
#[test]
fn a_member_cut_off_with_a_cm_removed_over_a_broken_link_serves_nothing_stale() {
    let c = cluster_of(5);
    let view = c.view(MachineId(0));
    let first_backup = backup_cms(&view.config, 1)[0];
    let cut_off = (1..5)
        .map(MachineId)
        .find(|m| *m != first_backup)
        .expect("a member besides the first backup CM");
    let majority: Vec<MachineId> = (1..5).map(MachineId).filter(|m| *m != cut_off).collect();
    let (region, _) = view
        .map
        .iter()
        .find(|(_, p)| p.primary == cut_off)
        .expect("every machine is primary of a region");
    let (cm_region, _) = view
        .map
        .iter()
        .find(|(_, p)| majority.contains(&p.primary) && p.backups.contains(&MachineId(0)))
        .expect("the CM backs a region of the majority");
    let a = c
        .txn(cut_off, |tx| tx.alloc(&100u64, Some(Addr::new(region, 0))))
        .unwrap();
    let home = view.map.get(cm_region).unwrap().primary;
    let b = c
        .txn(home, |tx| tx.alloc(&1u64, Some(Addr::new(cm_region, 0))))
        .unwrap();
    c.fabric()
        .partition(&[&[MachineId(0), cut_off], &majority[..]]);
    // The first backup CM commits a write the CM backs: the write to its log stalls and the
    // link breaks.
    let _ = c.txn(first_backup, |tx| tx.write(b, &2u64));
    wait_for_config(&c, first_backup, 2);
    c.txn(majority[1], |tx| tx.write(a, &101u64)).unwrap();
    let read = c.txn(cut_off, |tx| tx.read::<u64>(a));
    assert_ne!(read, Ok(100), "after the majority wrote 101");
}

/// A store whose compare-and-set takes `delay` once armed (ZooKeeper slow to answer), and whose
/// next one, with `lose_answer` set, takes effect and then answers with a timeout (ZooKeeper
/// wrote it, the answer was lost).
#[derive(Debug, Default)]
struct SlowStore {
    inner: farm::EmbeddedStore,
    delay: std::sync::Mutex<Duration>,
    lose_answer: std::sync::atomic::AtomicBool,
}

impl farm::CoordinationStore for SlowStore {
    fn read(&self) -> Result<Option<(farm::StoreVersion, Vec<u8>)>, farm::StoreError> {
        self.inner.read()
    }

    fn compare_and_set(
        &self,
        expected: Option<farm::StoreVersion>,
        data: &[u8],
    ) -> Result<farm::CasOutcome, farm::StoreError> {
        let delay = *self.delay.lock().unwrap();
        std::thread::sleep(delay);
        let outcome = self.inner.compare_and_set(expected, data);
        match self
            .lose_answer
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            true => Err(farm::StoreError::Timeout(0)),
            false => outcome,
        }
    }
}

/// A member whose memory the CM cannot read while its lease requests still reach the CM (a
/// connection broken while datagrams get through) is removed for its failed probe, and the CM
/// renews its lease until it installs the configuration without it. The commit must wait that
/// lease out: here the store takes three leases to answer, so the CM installs three leases
/// after the probe failed, and a commit a lease after the probe let the member serve what the
/// majority overwrote. Long leases (half a second), so that the majority's recovery and write
/// after the commit fit in what was left of the member's lease.
#[test]
fn a_member_removed_for_a_failed_probe_serves_nothing_the_majority_overwrote() {
    let lease = Duration::from_millis(500);
    let store = std::sync::Arc::new(SlowStore::default());
    let c = Cluster::builder()
        .machines(5)
        .spare_machines(1)
        .workers(2)
        .replicas(3)
        .region_bytes(4 << 20)
        .lease(lease)
        .store(store.clone())
        .build()
        .unwrap();
    let view = c.view(MachineId(0));
    let cm = view.config.cm;
    let (region, placement) = view
        .map
        .iter()
        .find(|(_, p)| p.primary != cm)
        .expect("a region whose primary is not the CM");
    let member = placement.primary;
    let other = (0..5)
        .map(MachineId)
        .find(|m| *m != cm && *m != member)
        .unwrap();
    // Coordinated elsewhere: the member then writes nothing into the CM's rings, and the CM
    // has no ring space to hand back to it, so no write between them breaks a link (the CM
    // would remove the member for a broken link instead, and wait its lease out).
    let a = c
        .txn(other, |tx| tx.alloc(&100u64, Some(Addr::new(region, 0))))
        .unwrap();
    *store.delay.lock().unwrap() = 3 * lease;
    c.fabric().cut_memory(cm, member);
    // A machine joins: the CM probes every member, the member's probe fails, and the new
    // configuration leaves it out (a region allocation would place the region and might
    // write to the member first, breaking the link).
    let _ = c.join(MachineId(5));
    wait_for_config(&c, other, 2);
    // The join's configuration, without the member: removed for its probe, not for a link.
    let config = &c.view(other).config;
    assert!(config.contains(MachineId(5)) && !config.contains(member));
    *store.delay.lock().unwrap() = Duration::ZERO;
    c.txn(other, |tx| tx.write(a, &101u64)).unwrap();
    let read = c.txn(member, |tx| tx.read::<u64>(a));
    assert_ne!(read, Ok(100), "after the majority wrote 101");
}

/// A join whose compare-and-set took effect but whose answer was lost: the stored
/// configuration holds the joiner, so it asks no more, and nothing else is due at the CM. The
/// CM drives the stored configuration again, and the joiner becomes a member that serves
/// transactions (before, configuration 2 stayed stored and installed nowhere, and the join
/// was answered with the timeout after 30 s).
#[test]
fn a_join_whose_stored_configuration_lost_its_answer_completes() {
    let store = std::sync::Arc::new(SlowStore::default());
    let c = Cluster::builder()
        .machines(3)
        .spare_machines(1)
        .workers(2)
        .replicas(3)
        .region_bytes(4 << 20)
        .store(store.clone())
        .build()
        .unwrap();
    let a = c.txn(MachineId(0), |tx| tx.alloc(&7u64, None)).unwrap();
    store
        .lose_answer
        .store(true, std::sync::atomic::Ordering::SeqCst);
    // The join is answered once a configuration with the joiner committed: the third, which
    // drove the stored second again.
    assert_eq!(c.join(MachineId(3)).unwrap(), ConfigId(3));
    assert!(
        c.reconfig_events().iter().any(
            |e| matches!(e, ReconfigEvent::Failed { reason, .. } if reason.contains("timed out"))
        ),
        "no answer was lost: {:?}",
        c.reconfig_events()
    );
    wait_for_config(&c, MachineId(3), 3);
    assert!(c.view(MachineId(0)).config.contains(MachineId(3)));
    assert_eq!(c.txn(MachineId(3), |tx| tx.read::<u64>(a)), Ok(7));
}

/// A spare joins while a member is dead: the configuration that adds it also removes the dead
/// member (its probe fails) and gives its replicas to others, the spare among them. The spare
/// must copy those replicas from their primaries (§5.4): it took them for new, empty regions
/// (its first view with regions), so a backup it held stayed without what was written before,
/// and a later failure of the primary would have promoted it (the simulator's joins campaign
/// found it: seed 24, replicas differ after recovery).
#[test]
fn a_spare_given_replicas_by_the_configuration_that_adds_it_copies_them() {
    let c = Cluster::builder()
        .machines(4)
        .spare_machines(1)
        .workers(1)
        .replicas(3)
        .region_bytes(4 << 20)
        .reconfigure(false)
        .build()
        .unwrap();
    let view = c.view(MachineId(0));
    let objects: Vec<Addr> = view
        .map
        .iter()
        .map(|(region, p)| {
            c.txn(p.primary, |tx| {
                tx.alloc(&(1000 + region.0 as u64), Some(Addr::new(region, 0)))
            })
            .unwrap()
        })
        .collect();
    c.kill(MachineId(3));
    assert_eq!(c.join(MachineId(4)).unwrap(), ConfigId(2));
    let view = c.view(MachineId(4));
    assert!(!view.config.contains(MachineId(3)) && view.config.contains(MachineId(4)));
    let given: Vec<Addr> = (objects.iter().copied())
        .filter(|a| view.map.get(a.region).unwrap().holds(MachineId(4)))
        .collect();
    assert!(
        !given.is_empty(),
        "the spare got no replica: {:?}",
        view.map
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.background_recovery_done() {
        assert!(Instant::now() < deadline, "recovery did not finish");
        std::thread::sleep(Duration::from_millis(1));
    }
    c.quiesce();
    let bytes = |m: u16, a: Addr| {
        let mut b = [0u8; 16];
        let state = &c.machine_states()[m as usize];
        let view = state.view();
        view.region(a.region)
            .unwrap()
            .read(a.offset as usize, &mut b);
        b
    };
    for a in given {
        let primary = view.map.get(a.region).unwrap().primary;
        assert_eq!(
            bytes(4, a),
            bytes(primary.0, a),
            "{a:?}: the spare's replica differs from its primary's"
        );
    }
}

/// A machine that joined is primary of no region, so its allocations go to other machines'
/// regions: when the first of them is full, the next one with room serves (before, the first
/// region alone was asked, and the transaction failed with "region is full" while others had
/// room; the simulator's joins campaign found the same with a region whose new primary was
/// still rebuilding its free lists, seed 25, which now retries).
#[test]
fn a_machine_primary_of_no_region_allocates_in_any_region_with_room() {
    let c = Cluster::builder()
        .machines(3)
        .spare_machines(1)
        .workers(1)
        .replicas(3)
        .region_bytes(2 << 20)
        .build()
        .unwrap();
    assert_eq!(c.join(MachineId(3)).unwrap(), ConfigId(2));
    let view = c.view(MachineId(3));
    assert_eq!(view.map.primary_of(MachineId(3)).count(), 0);
    // The first region in the map, the one a machine primary of none asked first, filled up.
    let (first, p) = view.map.iter().next().unwrap();
    // Its primary allocates there until it is full, and then in a region the CM gives it.
    let big = vec![7u8; 16 << 9]; // 8 KB objects, 16 KB slots
    let mut filled = 0;
    while c
        .txn(p.primary, |tx| {
            tx.alloc_bytes(&big, Some(Addr::new(first, 0)))
        })
        .unwrap()
        .region
        == first
    {
        filled += 1;
    }
    assert!(filled > 0);
    let a = c.txn(MachineId(3), |tx| tx.alloc(&42u64, None)).unwrap();
    assert_ne!(a.region, first);
    assert_eq!(c.txn(MachineId(0), |tx| tx.read::<u64>(a)), Ok(42));
}

/// The timeline counts every committed transaction once, in the millisecond it committed, and
/// carries the reconfiguration events in order; its JSON parses.
#[test]
fn the_timeline_counts_commits_and_records_reconfiguration() {
    let c = cluster();
    let a = c.txn(MachineId(0), |tx| tx.alloc(&1_000u64, None)).unwrap();
    let b = c
        .txn(MachineId(0), |tx| tx.alloc(&1_000u64, Some(a)))
        .unwrap();
    let home = c.view(MachineId(0)).map.get(a.region).unwrap().clone();
    let victim = (0..4).map(MachineId).find(|m| !home.holds(*m)).unwrap();
    transfers(&c, a, b, 200);
    c.kill(victim);
    wait_for_config(&c, MachineId(0), 2);
    transfers(&c, a, b, 100);
    // The victim held replicas: new backups copy them once every region is active (§5.4).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c
        .timeline()
        .recovery
        .iter()
        .any(|(_, e)| matches!(e, farm::RecoveryEvent::DataRecoveryDone { .. }))
    {
        assert!(Instant::now() < deadline, "no data recovery finished");
        std::thread::sleep(Duration::from_millis(1));
    }
    let t = c.timeline();
    assert_eq!(
        t.committed_per_ms.iter().sum::<u64>(),
        2 + 300,
        "every txn() that committed, once"
    );
    let names: Vec<&str> = t
        .events
        .iter()
        .map(|e| match e {
            ReconfigEvent::Suspect { .. } => "suspect",
            ReconfigEvent::Probed { .. } => "probe",
            ReconfigEvent::Stored { .. } => "zookeeper",
            ReconfigEvent::Committed { .. } => "config-commit",
            ReconfigEvent::Failed { .. } => "failed",
            ReconfigEvent::AllActive { .. } => "all-active",
        })
        .collect();
    assert_eq!(
        names,
        vec![
            "suspect",
            "probe",
            "zookeeper",
            "config-commit",
            "all-active"
        ]
    );
    let at = |name: &str| {
        t.recovery
            .iter()
            .filter_map(|(_, e)| match (name, e) {
                ("start", farm::RecoveryEvent::DataRecoveryStarted { at, .. }) => Some(*at),
                ("done", farm::RecoveryEvent::DataRecoveryDone { at, .. }) => Some(*at),
                _ => None,
            })
            .min()
            .expect("recovery event")
    };
    let all_active = match t.events[4] {
        ReconfigEvent::AllActive { at_us, .. } => at_us,
        _ => unreachable!(),
    };
    assert!(all_active <= at("start") && at("start") <= at("done"));
    let json: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
    assert_eq!(json["events"][3]["event"], "config-commit");
    assert_eq!(json["events"][4]["event"], "all-active");
    assert!(json["recovery"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["event"] == "data-recovery-done"));
    assert_eq!(
        json["committed_per_ms"].as_array().unwrap().len(),
        t.committed_per_ms.len()
    );
}

/// An application closure that runs longer than the acknowledgement timeout does not hold
/// reconfiguration hostage (issue 16 case 6): in this process a closure holds one worker of
/// every machine, and NEW-CONFIG-ACK waited for every worker to pick the view up, so no
/// attempt to remove a killed machine could commit until the closure ended. Only a view that
/// adds a machine needs its workers first (they start afresh the rings it will write).
#[test]
fn a_long_closure_does_not_hold_up_reconfiguration() {
    let c = cluster();
    let a = c.txn(MachineId(1), |tx| tx.alloc(&1u64, None)).unwrap();
    // What the first execution saw (a retry after the reconfiguration would see it done).
    let first = std::sync::Mutex::new(None);
    c.txn(MachineId(1), |tx| {
        let _: u64 = tx.read(a)?;
        let mut first = first.lock().unwrap();
        if first.is_some() {
            return Ok(());
        }
        c.kill(MachineId(3));
        // A hundred leases (ten acknowledgement timeouts) of waiting inside the closure.
        let deadline = Instant::now() + LEASE * 100;
        let mut removed = false;
        while !removed && Instant::now() < deadline {
            let v = c.view(MachineId(0));
            removed = !v.config.contains(MachineId(3))
                && c.reconfig_events().iter().any(|e| {
                    matches!(e, ReconfigEvent::Committed { config, .. } if *config == v.config.id)
                });
            std::thread::sleep(Duration::from_millis(1));
        }
        *first = Some(removed);
        Ok(())
    })
    .unwrap();
    assert_eq!(
        *first.lock().unwrap(),
        Some(true),
        "no configuration without machine 3 committed while the closure ran: {:?}",
        c.reconfig_events()
    );
}

/// A region asked for while the CM is dead (§3, §5.2): the member asks the configuration's CM
/// until a backup CM takes over and becomes CM, which allocates it; every survivor maps it.
#[test]
fn a_region_asked_for_while_the_cm_is_dead_is_allocated_by_the_next_cm() {
    let c = cluster();
    c.kill(MachineId(0));
    // Machine 1, the first that runs, asks; its CM is machine 0 until a new one commits.
    let r = c.allocate_region(None).unwrap();
    for m in 1..4 {
        let v = c.view(MachineId(m));
        assert!(
            !v.config.contains(MachineId(0)),
            "machine {m}: {:?}",
            v.config
        );
        assert!(v.map.get(r).is_some(), "machine {m} does not map {r:?}");
        assert!(!v.map.get(r).unwrap().holds(MachineId(0)));
    }
}

/// A machine that stops while its request waits gets an answer at once, not after the minute
/// the caller would otherwise wait.
#[test]
fn a_request_of_a_machine_that_stopped_is_answered() {
    let c = Cluster::builder()
        .machines(3)
        .workers(1)
        .replicas(2)
        .region_bytes(4 << 20)
        .lease(LEASE)
        .reconfigure(false)
        .build()
        .unwrap();
    // Nobody replaces the dead CM: machine 1's request waits.
    c.kill(MachineId(0));
    let c = std::sync::Arc::new(c);
    let asking = {
        let c = c.clone();
        std::thread::spawn(move || c.allocate_region(None))
    };
    std::thread::sleep(LEASE * 4);
    assert!(!asking.is_finished(), "answered with the CM dead");
    c.kill(MachineId(1));
    let e = asking.join().unwrap().unwrap_err();
    // Not `AdminError::NoAnswer`, which the caller gets after a minute.
    assert!(e.to_string().contains("stopped"), "{e}");
}

/// The value of the sample `name{labels}` in the OpenMetrics text `text`.
fn sample(text: &str, name: &str, labels: &str) -> f64 {
    let key = if labels.is_empty() {
        format!("{name} ")
    } else {
        format!("{name}{{{labels}}} ")
    };
    let line = (text.lines().find(|l| l.starts_with(&key)))
        .unwrap_or_else(|| panic!("no {key:?} in the metrics:\n{text}"));
    line[key.len()..].parse().unwrap()
}

/// The metrics the in-process cluster exposes (`Cluster::metrics`: the Prometheus text a
/// machine process serves) follow what the cluster does: commits and their latencies on the
/// coordinators, lock-free reads where they ran, the configuration and the CM; and once a
/// member is killed, the CM's suspicion, the reconfiguration it drove and the configuration
/// without the member.
#[test]
fn metrics_follow_commits_lock_free_reads_and_a_reconfiguration() {
    let c = cluster();
    let a = c.txn(MachineId(0), |tx| tx.alloc(&1_000u64, None)).unwrap();
    let b = c.txn(MachineId(1), |tx| tx.alloc(&0u64, None)).unwrap();
    transfers(&c, a, b, 30);
    for _ in 0..5 {
        let _: u64 = c.read(MachineId(3), a).unwrap();
    }
    let text = c.metrics();
    let m = |machine: u16| format!("machine=\"{machine}\"");
    for machine in 0..3 {
        let commits = sample(&text, "farm_commits_total", &m(machine));
        assert!(commits >= 10.0, "machine {machine}: {commits} commits");
        let timed = sample(&text, "farm_commit_latency_seconds_count", &m(machine));
        assert_eq!(timed, commits, "machine {machine}: every commit timed");
        let all = format!("le=\"+Inf\",{}", m(machine));
        let fast = format!("le=\"0.00001\",{}", m(machine));
        let bucket = |labels: &str| sample(&text, "farm_commit_latency_seconds_bucket", labels);
        assert_eq!(
            bucket(&all),
            commits,
            "machine {machine}: the last bucket counts all"
        );
        assert!(bucket(&fast) <= commits, "machine {machine}");
    }
    assert_eq!(sample(&text, "farm_commits_total", &m(3)), 0.0);
    assert_eq!(sample(&text, "farm_lock_free_reads_total", &m(3)), 5.0);
    assert_eq!(sample(&text, "farm_lock_free_reads_total", &m(0)), 0.0);
    // One-sided operations per peer: machine 3's reads went to `a`'s primary, and each
    // coordinator wrote its log records to the peers holding `a` and `b`.
    let primary = c.view(MachineId(0)).map.get(a.region).unwrap().primary;
    assert_ne!(primary, MachineId(3), "machine 3 allocated nothing");
    let to = |machine: u16, peer: u16| format!("machine=\"{machine}\",peer=\"{peer}\"");
    let reads = sample(&text, "farm_one_sided_reads_total", &to(3, primary.0));
    assert!(reads >= 5.0, "{reads} reads for 5 lock-free reads:\n{text}");
    let read_bytes = sample(&text, "farm_one_sided_read_bytes_total", &to(3, primary.0));
    assert!(read_bytes >= 5.0 * 16.0, "{read_bytes} bytes read");
    // Summed over the peers it wrote to (a peer never written to may have no sample).
    let to_peers = |name: &str, machine: u16| -> f64 {
        let prefix = format!("{name}{{machine=\"{machine}\",peer=");
        (text.lines().filter(|l| l.starts_with(&prefix)))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    for machine in 0..3u16 {
        let writes = to_peers("farm_one_sided_writes_total", machine);
        let bytes = to_peers("farm_one_sided_write_bytes_total", machine);
        assert!(
            writes >= 10.0,
            "machine {machine}: {writes} writes to peers"
        );
        assert!(
            bytes > 8.0 * writes,
            "machine {machine}: {bytes} bytes written"
        );
    }
    for machine in 0..4 {
        assert_eq!(sample(&text, "farm_configuration", &m(machine)), 1.0);
        assert_eq!(sample(&text, "farm_members", &m(machine)), 4.0);
        let is_cm = if machine == 0 { 1.0 } else { 0.0 };
        assert_eq!(sample(&text, "farm_is_cm", &m(machine)), is_cm);
    }
    assert_eq!(sample(&text, "farm_reconfigurations_total", ""), 0.0);

    c.kill(MachineId(3));
    wait_for_config(&c, MachineId(0), 2);
    let text = c.metrics();
    assert_eq!(sample(&text, "farm_configuration", &m(0)), 2.0);
    assert_eq!(sample(&text, "farm_members", &m(0)), 3.0);
    assert!(
        sample(&text, "farm_suspicions_total", &m(0)) >= 1.0,
        "{text}"
    );
    assert_eq!(sample(&text, "farm_reconfigurations_total", ""), 1.0);
    let took = sample(&text, "farm_last_reconfiguration_duration_seconds", "");
    assert!(took > 0.0 && took < 30.0, "{took} s");

    // Machine 3 held replicas: the survivors copy them again (§5.4), and once recovery is done
    // and every record truncated, nothing is held in any peer's rings.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.background_recovery_done() {
        assert!(Instant::now() < deadline, "data recovery did not finish");
        std::thread::sleep(Duration::from_millis(5));
    }
    c.quiesce();
    let text = c.metrics();
    let copied: f64 = (0..3)
        .map(|machine| sample(&text, "farm_recovery_read_bytes_total", &m(machine)))
        .sum();
    assert!(copied > 0.0, "no region copied again:\n{text}");
    for machine in 0..3 {
        assert_eq!(sample(&text, "farm_regions_copying", &m(machine)), 0.0);
        for peer in (0..3).filter(|p| *p != machine) {
            let labels = format!("{},peer=\"{peer}\"", m(machine));
            assert_eq!(sample(&text, "farm_log_held_bytes", &labels), 0.0, "{text}");
            assert_eq!(
                sample(&text, "farm_queue_held_bytes", &labels),
                0.0,
                "{text}"
            );
            assert_eq!(sample(&text, "farm_backlogged_messages", &labels), 0.0);
        }
    }
}

/// A lock-free read of an object whose primary was killed waits for the reconfiguration and
/// reads the object at its new primary, as a transaction waits; it failed at once with
/// "unavailable" (TATP's lookups on machine processes failed that way when a process was
/// killed in the middle of a run).
#[test]
fn a_lock_free_read_waits_out_the_death_of_the_objects_primary() {
    // Leases long enough that failing reads retried at every turn (about 130 us apart here)
    // outnumber the conflict budget (`TXN_ATTEMPTS_MAX`) before the failure is suspected.
    let c = Cluster::builder()
        .machines(4)
        .workers(2)
        .replicas(3)
        .region_bytes(4 << 20)
        .lease(Duration::from_millis(2500))
        .build()
        .unwrap();
    let a = c.txn(MachineId(1), |tx| tx.alloc(&42u64, None)).unwrap();
    let primary = c.view(MachineId(0)).map.get(a.region).unwrap().primary;
    let reader = (0..4).map(MachineId).find(|m| *m != primary).unwrap();
    let v: u64 = c.read(reader, a).unwrap();
    assert_eq!(v, 42);
    // An object of the reader's, which another task keeps reading meanwhile.
    let b = c.txn(reader, |tx| tx.alloc(&0u64, None)).unwrap();
    c.kill(primary);
    // Among the tasks of a busy pipeline (a retry at every turn, and turns never idle), then
    // blocking once the cluster is reconfigured.
    let in_pipeline = std::sync::Mutex::new(None);
    let read_done = std::sync::atomic::AtomicBool::new(false);
    c.pipeline(2, async |p, k| {
        if k == 0 {
            *in_pipeline.lock().unwrap() = Some(p.read::<u64>(reader, a).await);
            read_done.store(true, std::sync::atomic::Ordering::SeqCst);
            return;
        }
        while !read_done.load(std::sync::atomic::Ordering::SeqCst) {
            p.read::<u64>(reader, b).await.unwrap();
            p.yield_now().await;
        }
    });
    let v = in_pipeline.into_inner().unwrap().unwrap();
    assert_eq!(
        v.unwrap_or_else(|e| panic!("a read through {reader}: {e}")),
        42
    );
    let v: u64 = c
        .read(reader, a)
        .unwrap_or_else(|e| panic!("a read through {reader}: {e}"));
    assert_eq!(v, 42);
}

/// An object that recovery holds locked (lock recovery locks what the recovering transactions
/// wrote until each is decided, §5.3) stays locked as long as recovery takes: a wait, not a
/// conflict to give up on. A transaction that reads it tries again until the lock is gone,
/// past `TXN_ATTEMPTS_MAX` attempts: over `tcp`, transactions gave up with "locked when read"
/// while recovery from a stopped machine held such locks. Here the lock bit is set at the
/// primary as lock recovery sets it, and released once the reader has made more attempts
/// than that, or after a few seconds where the machine is too busy for that many (a
/// transaction waits out a lock for `RECOVERY_WAIT_MAX`, 30 s).
#[test]
fn a_transaction_waits_out_a_lock_that_recovery_holds() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
    let c = Cluster::builder().machines(3).workers(1).build().unwrap();
    let a = c.txn(MachineId(0), |tx| tx.alloc(&42u64, None)).unwrap();
    let primary = c.view(MachineId(0)).map.get(a.region).unwrap().primary;
    let reader = (0..3).map(MachineId).find(|m| *m != primary).unwrap();
    let mem = c.view(primary).region(a.region).unwrap().clone();
    let offset = a.offset as u64;
    let header = farm_core::object::Header(mem.load_u64(offset as usize, SeqCst));
    farm_core::object::try_lock(&mem, offset, header).unwrap();
    let attempts = AtomicU32::new(0);
    let ended = AtomicBool::new(false);
    let read = std::thread::scope(|s| {
        s.spawn(|| {
            let locked = Instant::now();
            while attempts.load(SeqCst) <= farm::TXN_ATTEMPTS_MAX
                && locked.elapsed() < Duration::from_secs(5)
                && !ended.load(SeqCst)
            {
                std::thread::yield_now();
            }
            // Recovery decided the transaction that wrote it.
            farm_core::object::unlock(&mem, offset, header);
        });
        let read = c.txn(reader, |tx| {
            attempts.fetch_add(1, SeqCst);
            tx.read::<u64>(a)
        });
        ended.store(true, SeqCst);
        read
    });
    let tried = attempts.load(SeqCst);
    assert_eq!(
        read.unwrap_or_else(|e| panic!("gave up after {tried} attempts: {e}")),
        42
    );
    assert!(tried > 1, "{tried} attempts");
}

/// A region allocated through the CM (§3) takes its replicas' memory from the machines'
/// spare regions, and each machine that used its spare makes another: a spare is for the next
/// failure too. (A spare was made again only once a recovery's copies were done, so an
/// allocation left the machine without one until some later failure had been recovered.)
#[test]
fn an_allocated_region_takes_spare_memory_that_is_made_again() {
    let c = Cluster::builder()
        .machines(3)
        .replicas(3)
        .region_bytes(2 << 20)
        .spare_regions(1)
        .build()
        .unwrap();
    let r = c.allocate_region(None).unwrap();
    let a = c.txn(MachineId(0), |tx| tx.alloc(&7u64, Some(Addr::new(r, 0))));
    assert!(a.is_ok(), "{a:?}");
    let machines = c.machine_states();
    let used: u64 = machines.iter().map(|m| m.spare_regions_used()).sum();
    assert_eq!(used, 3, "each of the three replicas took a spare");
    let deadline = Instant::now() + Duration::from_secs(30);
    while machines.iter().any(|m| m.spare_regions_ready() < 1) {
        assert!(
            Instant::now() < deadline,
            "spares were not made again: {:?}",
            machines
                .iter()
                .map(|m| m.spare_regions_ready())
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Allocates `n` objects of 1 KiB at `m`, forty to a transaction, each holding its number.
fn fill(c: &Cluster, m: MachineId, n: u64) -> Result<Vec<Addr>, farm::TxError> {
    let mut addrs = Vec::new();
    for batch in (0..n).collect::<Vec<_>>().chunks(40) {
        addrs.extend(c.txn(m, |tx| {
            batch
                .iter()
                .map(|i| tx.alloc(&[*i; 128], None))
                .collect::<Result<Vec<_>, _>>()
        })?);
    }
    Ok(addrs)
}

/// A machine whose regions are full gets another from its CM (§3: "machines contact the CM to
/// allocate a new region") with the replicas of its own, and its transactions allocate on
/// there: two regions' worth of objects from machine 1, whose one region holds three blocks,
/// all committed, readable elsewhere and replicated. (They failed with "region is full".)
#[test]
fn a_machine_whose_regions_are_full_gets_more_from_its_cm() {
    let c = cluster_of(3);
    let m = MachineId(1);
    let first: Vec<RegionId> = c.view(m).map.primary_of(m).collect();
    assert_eq!(first.len(), 1);
    // Six blocks of 1 MiB objects of 1 KiB (slots of 1,032 bytes with the header).
    let addrs = fill(&c, m, 6 * 1000).unwrap();
    let view = c.view(m);
    let now: Vec<RegionId> = view.map.primary_of(m).collect();
    assert!(now.len() >= 2, "machine 1 is primary of {now:?}");
    let own = |r: RegionId| view.map.get(r).map(|p| p.replicas().collect::<Vec<_>>());
    for r in &now {
        assert_eq!(
            own(*r),
            own(first[0]),
            "{r:?} has the replicas of {:?}",
            first[0]
        );
    }
    assert!(addrs.iter().any(|a| !first.contains(&a.region)));
    let metric = sample(&c.metrics(), "farm_primary_regions", "machine=\"1\"");
    assert_eq!(metric, now.len() as f64, "the metric counts them");
    for (i, a) in addrs.iter().enumerate().step_by(97) {
        assert_eq!(
            c.read::<[u64; 128]>(MachineId(0), *a).unwrap(),
            [i as u64; 128]
        );
    }
    c.quiesce();
    farm_sim::check_replicas(c.machine_states()).unwrap();
}

/// With too few machines left for a region's three replicas, no region can be placed for a
/// machine whose regions are full (its control plane runs the CM's placement), and its
/// allocation fails with "region is full", as before machines asked: it does not wait for a
/// region that cannot come.
#[test]
fn a_machine_refused_a_region_fails_its_allocation() {
    let c = cluster_of(3);
    c.kill(MachineId(2));
    wait_for_config(&c, MachineId(0), 2);
    // Waiting for a region until `txn` gave up would end with `AwaitingRegion`.
    let e = fill(&c, MachineId(1), 6 * 1000).unwrap_err();
    assert!(
        matches!(
            e,
            farm::TxError::Alloc(farm_alloc::AllocError::RegionFull(_))
        ),
        "{e}"
    );
}
