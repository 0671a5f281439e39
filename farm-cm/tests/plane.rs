//! The control plane (`farm_cm::plane`) of every machine of a cluster, driven by a small
//! deterministic harness: datagrams delivered one tick after they are sent (or lost, where a
//! test says), probes answered by live machines, an embedded coordination store, and what the
//! plane asks a machine to install, commit or mark applied at once. Leases are not modelled:
//! the tests say who suspects whom, and when. Reference: FaRM §5.2 (reconfiguration) and §5.4
//! (REGIONS-ACTIVE).

use std::collections::{BTreeMap, BTreeSet};

use farm_cm::control::ControlMsg;
use farm_cm::plane::{ControlPlane, Effect, Event, Local, PlaneParams, TAKEOVER_LEASES};
use farm_cm::reconfig::{backup_cms, ProbeAnswer};
use farm_cm::{CasOutcome, CoordinationStore, EmbeddedStore};
use farm_core::config::{Configuration, RegionChanges, RegionMap};
use farm_core::{ConfigId, MachineId, RegionId};

const LEASE: u64 = 100;

fn params(machines: u16) -> PlaneParams {
    PlaneParams {
        replicas: 3,
        regions_max: 64,
        machines_max: machines,
        lease_ticks: LEASE,
        lease_longest_ticks: LEASE,
        ack_timeout_ticks: LEASE,
        repeat_ticks: 2,
    }
}

struct Machine {
    plane: ControlPlane,
    config: Configuration,
    map: RegionMap,
    changes: BTreeMap<RegionId, RegionChanges>,
    committed: ConfigId,
    all_active: ConfigId,
    evicted: bool,
    alive: bool,
    /// Whether the machine is ready to acknowledge its newest view (its workers started afresh
    /// with machines it adds); a test clears it for a machine whose threads are busy.
    ready: bool,
    /// Replicas still being copied: none (recovery is instant here).
    copying: BTreeSet<RegionId>,
    /// Regions prepared here for an allocation (§3), not yet in the map.
    prepared: BTreeSet<RegionId>,
    /// Whether this machine refuses PREPARE (out of NVRAM).
    refuses: bool,
    /// Answers to this machine's allocation requests.
    allocated: Vec<(u64, Result<Vec<RegionId>, String>)>,
    /// A view persisted and not yet installed.
    persisted: Option<farm_core::codec::StoredView>,
    /// Whether writing a view to NVRAM fails here (a full or broken disk).
    persist_fails: bool,
}

impl Machine {
    fn local(&self) -> Local<'_> {
        Local {
            config: &self.config,
            map: &self.map,
            changes: &self.changes,
            copying: &self.copying,
            committed: self.committed,
            all_active: self.all_active,
            // Recovery is instant here: regions are active once the configuration commits.
            regions_active: self.committed >= self.config.id,
            workers_ready: self.ready,
            evicted: self.evicted,
        }
    }
}

struct Cluster {
    machines: Vec<Machine>,
    store: EmbeddedStore,
    now: u64,
    /// (deliver at, from, to, message).
    in_flight: Vec<(u64, MachineId, MachineId, ControlMsg)>,
    /// Machines that cannot exchange datagrams or probes with the others (a partition).
    cut: BTreeSet<MachineId>,
    /// Machines whose datagrams are lost (probes still reach them).
    muted: BTreeSet<MachineId>,
    /// Every event, with its machine and tick.
    events: Vec<(u64, MachineId, Event)>,
    /// Drop one datagram in `lose_one_in`, seeded (0: none).
    lose_one_in: u64,
    /// Compare-and-sets that take effect but whose answer is lost (a timeout), still to come.
    cas_answers_lost: u32,
    /// When each ALL-REGIONS-ACTIVE was sent, with its configuration.
    all_active_sent: Vec<(u64, ConfigId)>,
    /// CMs forgiven (`Effect::ForgiveCm`): when, by whom, which.
    forgiven: Vec<(u64, MachineId, MachineId)>,
    /// Members forgiven by their CM (`Effect::ForgiveMember`): when, by whom, which.
    members_forgiven: Vec<(u64, MachineId, MachineId)>,
    rng: u64,
}

impl Cluster {
    fn new(n: u16) -> Self {
        Self::with_map(n, RegionMap::striped(n, 1, 2))
    }

    /// Four machines, machine 3 removed in configuration 2 (committed and settled at the
    /// others, stored) and back as a new incarnation outside it: a joiner.
    fn with_machine_3_back() -> Self {
        let mut c = Self::new(4);
        let mut config = Configuration::initial(4);
        config.id = ConfigId(2);
        config.members.retain(|m| m.0 != 3);
        config.failure_domains.remove(&MachineId(3));
        let (v, _) = c.store.read().unwrap().unwrap();
        c.store
            .compare_and_set(Some(v), &farm_cm::codec::encode(&config))
            .unwrap();
        let map = RegionMap::striped(3, 1, 2);
        for m in &mut c.machines {
            m.config = config.clone();
            m.map = map.clone();
            m.committed = config.id;
            m.all_active = config.id;
        }
        c
    }

    fn with_map(n: u16, map: RegionMap) -> Self {
        let config = Configuration::initial(n);
        let store = EmbeddedStore::new();
        let CasOutcome::Written(_) = store
            .compare_and_set(None, &farm_cm::codec::encode(&config))
            .unwrap()
        else {
            unreachable!()
        };
        let machines = (0..n)
            .map(|m| Machine {
                plane: ControlPlane::new(MachineId(m), params(n)),
                config: config.clone(),
                map: map.clone(),
                changes: BTreeMap::new(),
                committed: config.id,
                all_active: config.id,
                evicted: false,
                alive: true,
                ready: true,
                copying: BTreeSet::new(),
                prepared: BTreeSet::new(),
                refuses: false,
                allocated: Vec::new(),
                persisted: None,
                persist_fails: false,
            })
            .collect();
        Self {
            machines,
            store,
            now: 0,
            in_flight: Vec::new(),
            cut: BTreeSet::new(),
            muted: BTreeSet::new(),
            events: Vec::new(),
            lose_one_in: 0,
            cas_answers_lost: 0,
            all_active_sent: Vec::new(),
            forgiven: Vec::new(),
            members_forgiven: Vec::new(),
            rng: 0x9e37_79b9_7f4a_7c15,
        }
    }

    fn connected(&self, a: MachineId, b: MachineId) -> bool {
        self.machines[a.0 as usize].alive
            && self.machines[b.0 as usize].alive
            && self.cut.contains(&a) == self.cut.contains(&b)
    }

    /// Carries out machine `m`'s effects until there are none.
    fn run_effects(&mut self, m: MachineId) {
        loop {
            let i = m.0 as usize;
            let effects = self.machines[i].plane.take_effects();
            if effects.is_empty() {
                return;
            }
            for e in effects {
                let now = self.now;
                match e {
                    Effect::Send(to, msg) => {
                        if let ControlMsg::AllRegionsActive(id) = msg {
                            self.all_active_sent.push((now, id));
                        }
                        // xorshift64: every choice flows from the seed.
                        self.rng ^= self.rng << 13;
                        self.rng ^= self.rng >> 7;
                        self.rng ^= self.rng << 17;
                        let lost =
                            self.lose_one_in > 0 && self.rng.is_multiple_of(self.lose_one_in);
                        if !lost && !self.muted.contains(&m) {
                            self.in_flight.push((now + 1, m, to, msg));
                        }
                    }
                    Effect::Probe(p) => {
                        // Every replica is complete but those a test says are being copied.
                        let answer = match self.connected(m, p) {
                            true => {
                                let probed = &self.machines[p.0 as usize];
                                ProbeAnswer::Complete(
                                    (probed.map.iter().map(|(r, _)| r))
                                        .filter(|r| !probed.copying.contains(r))
                                        .collect(),
                                )
                            }
                            false => ProbeAnswer::NoAnswer,
                        };
                        self.with_plane(m, |plane, local| plane.on_probe(p, answer, now, local));
                    }
                    Effect::ReadStore => {
                        let stored =
                            self.store.read().unwrap().map(|(v, bytes)| {
                                (v, farm_cm::codec::decode(&bytes).expect("valid"))
                            });
                        self.with_plane(m, |plane, local| plane.on_store_read(stored, now, local));
                    }
                    Effect::CompareAndSet { expected, data } => {
                        let mut r = self.store.compare_and_set(Some(expected), &data);
                        if self.cas_answers_lost > 0 {
                            self.cas_answers_lost -= 1;
                            r = Err(farm_cm::StoreError::Timeout(0));
                        }
                        self.with_plane(m, |plane, local| plane.on_cas(r, now, local));
                    }
                    Effect::Persist(v) => {
                        let id = v.config.id;
                        let mach = &mut self.machines[i];
                        let ok = !mach.persist_fails;
                        if ok {
                            mach.persisted = Some(v);
                        }
                        self.with_plane(m, |plane, local| plane.on_persisted(id, ok, now, local));
                    }
                    Effect::Install(id) => {
                        let mach = &mut self.machines[i];
                        let v = mach.persisted.take().expect("persisted before installed");
                        assert_eq!(v.config.id, id, "install of a view not persisted");
                        assert!(v.config.id > mach.config.id, "install of an older view");
                        mach.prepared.retain(|r| v.map.get(*r).is_none());
                        mach.config = v.config;
                        mach.map = v.map;
                        mach.changes = v.changes;
                    }
                    Effect::Commit(id) => {
                        let mach = &mut self.machines[i];
                        assert_eq!(mach.config.id, id, "commit of a view not installed");
                        mach.committed = id;
                    }
                    Effect::AllRegionsActive(id) => self.machines[i].all_active = id,
                    Effect::Evicted(_) => self.machines[i].evicted = true,
                    Effect::ForgiveCm(cm) => self.forgiven.push((now, m, cm)),
                    Effect::ForgiveMember(x) => self.members_forgiven.push((now, m, x)),
                    Effect::PrepareRegions {
                        cm,
                        config,
                        regions,
                    } => {
                        let mach = &mut self.machines[i];
                        let ok = !mach.refuses;
                        if ok {
                            mach.prepared.extend(regions.iter().copied());
                        }
                        self.with_plane(m, |plane, local| {
                            plane.on_regions_prepared(cm, config, regions, ok, now, local)
                        });
                    }
                    Effect::AbortRegions(regions) => {
                        let mach = &mut self.machines[i];
                        assert!(regions.iter().all(|r| mach.map.get(*r).is_none()));
                        mach.prepared.retain(|r| !regions.contains(r));
                    }
                    Effect::Allocated { request, result } => {
                        self.machines[i].allocated.push((request, result))
                    }
                    Effect::Event(e) => self.events.push((now, m, e)),
                }
            }
        }
    }

    fn with_plane(&mut self, m: MachineId, f: impl FnOnce(&mut ControlPlane, &Local<'_>)) {
        let mach = &mut self.machines[m.0 as usize];
        let mut plane = std::mem::replace(&mut mach.plane, ControlPlane::new(m, params(1)));
        f(&mut plane, &mach.local());
        mach.plane = plane;
    }

    fn suspect(&mut self, observer: MachineId, suspect: MachineId) {
        let now = self.now;
        self.with_plane(observer, |p, l| p.on_suspect(suspect, now, l));
        self.run_effects(observer);
    }

    fn step(&mut self) {
        self.now += 1;
        let now = self.now;
        let due: Vec<_> = self
            .in_flight
            .iter()
            .filter(|d| d.0 <= now)
            .cloned()
            .collect();
        self.in_flight.retain(|d| d.0 > now);
        for (_, from, to, msg) in due {
            if self.connected(from, to) {
                self.with_plane(to, |p, l| p.on_message(from, msg, now, l));
                self.run_effects(to);
            }
        }
        for m in 0..self.machines.len() {
            if self.machines[m].alive {
                let id = MachineId(m as u16);
                self.with_plane(id, |p, l| p.tick(now, l));
                self.run_effects(id);
            }
        }
    }

    fn run_until(&mut self, ticks: u64, done: impl Fn(&Self) -> bool) -> bool {
        for _ in 0..ticks {
            if done(self) {
                return true;
            }
            self.step();
        }
        done(self)
    }

    /// Machine `m` asks for `count` regions as request `request`.
    fn allocate(&mut self, m: MachineId, request: u64, count: u32) {
        let now = self.now;
        self.with_plane(m, |p, l| p.allocate(request, count, None, now, l));
        self.run_effects(m);
    }

    fn kill(&mut self, m: MachineId) {
        self.machines[m.0 as usize].alive = false;
    }

    /// Whether every live machine outside `cut` and `muted` committed a configuration with exactly
    /// `members` and every region active in it.
    fn settled_without(&self, members: &[MachineId]) -> bool {
        self.machines
            .iter()
            .filter(|m| {
                let id = m.plane.me();
                m.alive && !self.cut.contains(&id) && !self.muted.contains(&id)
            })
            .all(|m| {
                m.config.members == members
                    && m.committed == m.config.id
                    && m.all_active == m.config.id
            })
    }

    /// Whether a plane stored `config` in the coordination store.
    fn stored(&self, config: ConfigId) -> bool {
        self.events
            .iter()
            .any(|(_, _, e)| *e == Event::Stored(config))
    }

    fn attempts(&self) -> Vec<(u64, MachineId)> {
        self.events
            .iter()
            .filter(|(_, _, e)| matches!(e, Event::Attempt { .. }))
            .map(|(t, m, _)| (*t, *m))
            .collect()
    }
}

fn ids(v: &[u16]) -> Vec<MachineId> {
    v.iter().map(|m| MachineId(*m)).collect()
}

/// A compare-and-set that took effect but whose answer was lost (ZooKeeper timed out): the
/// attempt fails, and the configuration it stored reached nobody. The CM, still in the older
/// one, must drive again over the stored one; it saw its suspect already gone from it and
/// stopped there (the simulator's store-timeout campaigns hung at seeds 71, 180 and 302).
#[test]
fn a_configuration_stored_by_a_lost_compare_and_set_is_driven_again() {
    let mut c = Cluster::new(4);
    c.cas_answers_lost = 1;
    c.kill(MachineId(3));
    c.suspect(MachineId(0), MachineId(3));
    let ok = c.run_until(20 * LEASE, |c| c.settled_without(&ids(&[0, 1, 2])));
    assert!(ok, "{:#?}", c.events);
    assert!(
        !c.stored(ConfigId(2)),
        "the compare-and-set of configuration 2 was answered"
    );
    assert_eq!(
        c.machines[1].config.id,
        ConfigId(3),
        "configuration 2 stored, and driven again over it"
    );
}

/// §5.2 steps 1-7: the CM suspects a member and removes it; every survivor installs, commits
/// and reports its regions active, and the CM announces ALL-REGIONS-ACTIVE (§5.4).
#[test]
fn the_cm_removes_a_member_it_suspects() {
    let mut c = Cluster::new(4);
    c.kill(MachineId(3));
    c.suspect(MachineId(0), MachineId(3));
    assert!(c.run_until(10 * LEASE, |c| c.settled_without(&ids(&[0, 1, 2]))));
    let m = &c.machines[1];
    assert_eq!(m.config.id, ConfigId(2));
    assert_eq!(m.config.cm, MachineId(0));
    assert_eq!(c.attempts(), vec![(1, MachineId(0))], "at its next tick");
}

/// §5.2 step 1: the CM and its first backup CM fail together. The second backup in the
/// consistent-hashing order takes over one takeover period after it suspected the CM (the
/// first backup, whose turn came first, is dead), becomes CM, and the new configuration
/// commits while a majority lives. Nobody else attempts.
#[test]
fn losing_the_cm_and_its_first_backup_together_still_reconfigures() {
    let mut c = Cluster::new(5);
    let config = Configuration::initial(5);
    let order = backup_cms(&config, 4);
    c.kill(MachineId(0));
    c.kill(order[0]);
    for m in &order[1..] {
        c.suspect(*m, MachineId(0));
    }
    let mut survivors: Vec<MachineId> = order[1..].to_vec();
    survivors.sort();
    assert!(c.run_until(20 * LEASE, |c| c.settled_without(&survivors)));
    let attempts = c.attempts();
    assert_eq!(attempts[0].1, order[1], "{attempts:?}");
    assert!(
        attempts[0].0 >= TAKEOVER_LEASES * LEASE,
        "the second backup tried before its turn: {attempts:?}"
    );
    assert!(attempts.iter().all(|(_, m)| *m == order[1]), "{attempts:?}");
    let m = &c.machines[order[2].0 as usize];
    assert_eq!(m.config.cm, order[1]);
    assert_eq!(m.config.id, ConfigId(2));
    let stored = farm_cm::codec::decode(&c.store.read().unwrap().unwrap().1).unwrap();
    assert_eq!(stored, m.config);
}

/// "Finally any member tries itself": with the CM and its first two backups gone, the next in
/// line (a plain member of seven) reconfigures, since four of seven still answer. (No regions:
/// three dead machines of seven could hold every replica of one, which would be an error.)
#[test]
fn with_the_backups_gone_the_next_member_in_line_reconfigures() {
    let mut c = Cluster::with_map(7, RegionMap::default());
    let config = Configuration::initial(7);
    let order = backup_cms(&config, 6);
    for m in [MachineId(0), order[0], order[1]] {
        c.kill(m);
    }
    for m in &order[2..] {
        c.suspect(*m, MachineId(0));
    }
    let mut survivors: Vec<MachineId> = order[2..].to_vec();
    survivors.sort();
    let ok = c.run_until(40 * LEASE, |c| c.settled_without(&survivors));
    assert!(ok, "{:#?}", c.events);
    // The CM, and then each dead backup, was removed by whichever attempt came first; the
    // first attempt was the third in line's, at its turn.
    let attempts = c.attempts();
    assert_eq!(attempts[0].1, order[2], "{attempts:?}");
    assert!(attempts[0].0 >= 2 * TAKEOVER_LEASES * LEASE, "{attempts:?}");
}

/// A member on the CM's side of nothing (cut off alone) suspects the CM, cannot reconfigure
/// (no majority answers its probes), and learns from the store that the majority removed it:
/// nobody sends NEW-CONFIG to a removed machine (§5.2).
#[test]
fn a_member_cut_off_learns_from_the_store_that_it_was_removed() {
    let mut c = Cluster::new(5);
    let victim = MachineId(3);
    c.cut.insert(victim);
    c.suspect(MachineId(0), victim);
    c.suspect(victim, MachineId(0));
    assert!(c.run_until(40 * LEASE, |c| c.machines[3].evicted
        && c.settled_without(&ids(&[0, 1, 2, 4]))));
    let failed = c
        .events
        .iter()
        .filter(|(_, m, e)| *m == victim && matches!(e, Event::Failed(_)))
        .count();
    assert!(
        failed <= 1,
        "the cut-off machine kept trying: {failed} failed attempts"
    );
    assert_eq!(c.machines[3].config.id, ConfigId(1), "it installed nothing");
}

/// A machine outside the configuration asks the stored configuration's CM to add it, and the
/// CM adds it once its configuration is settled (§5.2, a join).
#[test]
fn a_machine_outside_the_configuration_joins() {
    let mut c = Cluster::with_machine_3_back();
    assert!(c.run_until(20 * LEASE, |c| c.settled_without(&ids(&[0, 1, 2, 3]))));
    assert_eq!(c.machines[3].config.id, ConfigId(3));
}

/// A join whose compare-and-set took effect but whose answer was lost (ZooKeeper timed out):
/// the stored configuration holds the joiner, which therefore stops asking, while every member
/// still runs the one before. Nothing else is due at the CM (no suspect, no allocation): it
/// must drive the stored configuration itself, or the joiner waits for good and the cluster's
/// stored configuration is one nobody installed.
#[test]
fn a_join_whose_compare_and_set_answer_was_lost_is_driven_again() {
    let mut c = Cluster::with_machine_3_back();
    c.cas_answers_lost = 1;
    let ok = c.run_until(40 * LEASE, |c| c.settled_without(&ids(&[0, 1, 2, 3])));
    assert!(ok, "{:#?}", c.events);
    assert!(
        !c.stored(ConfigId(3)),
        "the compare-and-set of configuration 3 was answered"
    );
    assert_eq!(
        c.machines[3].config.id,
        ConfigId(4),
        "configuration 3 stored, and driven again over it"
    );
}

/// Datagrams get lost: every message is repeated until answered, and a reconfiguration still
/// commits everywhere; an attempt whose acknowledgements did not come in time is followed by
/// another from the configuration it installed, never left uncommitted.
#[test]
fn lost_datagrams_are_repeated_until_answered() {
    for (seed, lose_one_in) in [(1, 2), (2, 2), (3, 3), (4, 5)] {
        let mut c = Cluster::new(5);
        c.lose_one_in = lose_one_in;
        c.rng ^= seed;
        c.kill(MachineId(4));
        c.suspect(MachineId(0), MachineId(4));
        let ok = c.run_until(40 * LEASE, |c| c.settled_without(&ids(&[0, 1, 2, 3])));
        let states: Vec<_> = c
            .machines
            .iter()
            .map(|m| (m.config.id, m.committed, m.all_active))
            .collect();
        assert!(
            ok,
            "losing one datagram in {lose_one_in}: {states:?} {:?}",
            c.events
        );
    }
}

/// A member whose link to another member broke tells the CM, which removes that member; the
/// CM's own broken link to a member is a suspicion of it.
#[test]
fn an_unreachable_member_reported_to_the_cm_is_removed() {
    let mut c = Cluster::new(4);
    let now = c.now;
    c.with_plane(MachineId(1), |p, l| p.on_unreachable(MachineId(2), now, l));
    c.run_effects(MachineId(1));
    // Machine 2 stays alive and answers probes: it is removed all the same, and learns it
    // when its CM falls silent (here, at once).
    assert!(c.run_until(10 * LEASE, |c| c.machines[0].config.id == ConfigId(2)));
    assert_eq!(c.machines[0].config.members, ids(&[0, 1, 3]));
    c.suspect(MachineId(2), MachineId(0));
    assert!(c.run_until(10 * LEASE, |c| c.machines[2].evicted));
}

/// A member fails after answering its probe (§5.2 step 6 never hears from it): the attempt
/// ends unacknowledged with its configuration installed at the CM and the other members. The
/// CM drives again from it, removing the silent member, instead of leaving every survivor in
/// a configuration that nobody commits (transactions blocked for good).
#[test]
fn a_configuration_installed_but_not_acknowledged_is_driven_again() {
    let mut c = Cluster::new(5);
    c.kill(MachineId(4));
    c.suspect(MachineId(0), MachineId(4));
    assert!(c.run_until(LEASE, |c| c.stored(ConfigId(2))));
    c.kill(MachineId(3));
    assert!(c.run_until(20 * LEASE, |c| c.settled_without(&ids(&[0, 1, 2]))));
    assert_eq!(c.machines[0].config.id, ConfigId(3));
    assert!(c
        .events
        .iter()
        .any(|(_, _, e)| matches!(e, Event::Failed(f) if f.contains("not acknowledged"))));
}

/// A member whose lease expires at the CM while the attempt waits for its NEW-CONFIG-ACK has
/// failed: the CM does not wait out the ack timeout for it, but drives the stored
/// configuration again without it at once (every transaction waits for the commit).
#[test]
fn a_member_suspected_while_its_ack_is_awaited_is_not_waited_for() {
    let mut c = Cluster::new(5);
    c.kill(MachineId(4));
    c.suspect(MachineId(0), MachineId(4));
    assert!(c.run_until(LEASE, |c| c.stored(ConfigId(2))));
    c.kill(MachineId(3));
    c.suspect(MachineId(0), MachineId(3));
    // Well within the ack timeout (a lease here).
    let ok = c.run_until(LEASE / 4, |c| c.settled_without(&ids(&[0, 1, 2])));
    let states: Vec<_> = c
        .machines
        .iter()
        .map(|m| (m.config.id, m.committed, m.alive))
        .collect();
    assert!(ok, "{:?} {states:?} {:?}", c.events, c.machines[0].plane);
    assert_eq!(c.machines[0].config.id, ConfigId(3));
}

/// A live member is slow to acknowledge (its threads are late to get ready, as a process's
/// are under load): removing it too would leave no majority, so that attempt fails, and the
/// CM must not keep suspecting it for good (every transaction would wait forever for a
/// configuration nobody commits). It drives the stored configuration again, which the member
/// acknowledges once its threads caught up.
#[test]
fn a_member_slow_to_acknowledge_is_waited_for_when_removing_it_would_lose_the_majority() {
    let mut c = Cluster::new(3);
    c.kill(MachineId(2));
    c.machines[1].ready = false;
    c.suspect(MachineId(0), MachineId(2));
    // Past the ack timeout (a lease here) and the attempt that would remove machine 1 too.
    let failed = |c: &Cluster| {
        c.events
            .iter()
            .any(|(_, _, e)| matches!(e, Event::Failed(f) if f.contains("majority")))
    };
    assert!(c.run_until(10 * LEASE, failed), "{:#?}", c.events);
    c.machines[1].ready = true;
    let ok = c.run_until(20 * LEASE, |c| c.settled_without(&ids(&[0, 1])));
    assert!(ok, "{:#?}", c.events);
    assert_eq!(c.machines[1].committed, c.machines[1].config.id);
}

/// §5.2 step 1, "the machine initiating the reconfiguration will try to become the new CM":
/// the first backup CM stores configuration 2 but none of its messages get out (it answers
/// probes, though); at its turn the second backup drives over the stored configuration, whose
/// CM lives, and becomes the CM of the next one itself (members take NEW-CONFIG only from its
/// CM). The first backup, whose acknowledgements never arrive, is removed after.
#[test]
fn a_machine_driving_over_a_stored_configuration_becomes_its_cm() {
    let mut c = Cluster::new(5);
    let config = Configuration::initial(5);
    let order = backup_cms(&config, 4);
    c.kill(MachineId(0));
    c.muted.insert(order[0]);
    for m in &order {
        c.suspect(*m, MachineId(0));
    }
    assert!(c.run_until(LEASE, |c| c.stored(ConfigId(2))));
    let mut rest: Vec<MachineId> = order[1..].to_vec();
    rest.sort();
    let ok = c.run_until(40 * LEASE, |c| c.settled_without(&rest));
    assert!(ok, "{:?}", c.events);
    assert!(
        c.events
            .iter()
            .any(|(_, m, e)| *m == order[1] && *e == Event::Stored(ConfigId(3))),
        "the second backup drove over configuration 2: {:?}",
        c.events
    );
    assert_eq!(c.machines[order[1].0 as usize].config.cm, order[1]);
}

/// Region allocation (§3): a member asks its CM, the CM places the regions and every chosen
/// replica prepares them, and the map with them is committed everywhere as a configuration
/// with the same members before the member hears back, over datagrams that get lost.
#[test]
fn a_member_allocates_regions_through_its_cm() {
    for lose_one_in in [0, 3] {
        let mut c = Cluster::new(4);
        c.lose_one_in = lose_one_in;
        c.allocate(MachineId(2), 7, 2);
        let done = c.run_until(40 * LEASE, |c| !c.machines[2].allocated.is_empty());
        assert!(
            done,
            "losing one in {lose_one_in}: no answer: {:?}",
            c.events
        );
        let (request, result) = c.machines[2].allocated[0].clone();
        assert_eq!(request, 7);
        let regions = result.expect("allocated");
        assert_eq!(regions, vec![RegionId(4), RegionId(5)], "the next ids");
        assert!(c.run_until(20 * LEASE, |c| c.settled_without(&ids(&[0, 1, 2, 3]))));
        for m in &c.machines {
            assert!(
                m.config.id >= ConfigId(2),
                "no configuration committed the regions"
            );
            for r in &regions {
                let p = m.map.get(*r).expect("every member maps the new region");
                assert_eq!(p.backups.len(), 2);
            }
            assert!(
                m.prepared.is_empty(),
                "prepared regions left: {:?}",
                m.prepared
            );
        }
        // A request with no room: 64 replicas per machine at most.
        c.allocate(MachineId(1), 8, 200);
        assert!(c.run_until(40 * LEASE, |c| !c.machines[1].allocated.is_empty()));
        let (_, result) = &c.machines[1].allocated[0];
        assert!(
            result.as_ref().is_err_and(|e| e.contains("capacity")),
            "{result:?}"
        );
    }
}

/// An allocation whose compare-and-set took effect but whose answer was lost: the store holds
/// a configuration of the same members that nobody installed (the map travels in NEW-CONFIG,
/// so the stored one names no new region). The requester hears that the store failed and its
/// prepared regions are released; the CM drives the stored configuration again, so that none
/// stays stored that no member runs (a member that suspected the CM would first wait a
/// takeover period for it). Before, nothing drove it: the store stayed one ahead of everyone.
#[test]
fn an_allocation_whose_compare_and_set_answer_was_lost_leaves_no_configuration_unrun() {
    let mut c = Cluster::new(4);
    c.cas_answers_lost = 1;
    c.allocate(MachineId(2), 7, 2);
    let done = c.run_until(40 * LEASE, |c| !c.machines[2].allocated.is_empty());
    assert!(done, "no answer: {:#?}", c.events);
    let (request, result) = &c.machines[2].allocated[0];
    assert_eq!(*request, 7);
    assert!(
        result.as_ref().is_err_and(|e| e.contains("timed out")),
        "{result:?}"
    );
    let runs_the_stored = |c: &Cluster| {
        let (_, stored) = c.store.read().unwrap().unwrap();
        let stored = farm_cm::codec::decode(&stored).unwrap();
        c.settled_without(&ids(&[0, 1, 2, 3])) && c.machines.iter().all(|m| m.config == stored)
    };
    assert!(c.run_until(20 * LEASE, runs_the_stored), "{:#?}", c.events);
    for m in &c.machines {
        assert_eq!(m.map.iter().count(), 4, "a released region is mapped");
        assert!(m.prepared.is_empty(), "prepared left: {:?}", m.prepared);
    }
}

/// An allocation whose configuration was installed but not acknowledged by every member (the
/// acknowledgement of one is lost for good): the CM drives that configuration again, without
/// the silent member, and the requester gets the regions it commits, once. Before, it was
/// refused although the next configuration committed the regions, for nobody.
#[test]
fn an_allocation_installed_but_not_acknowledged_is_answered_with_its_regions() {
    let mut c = Cluster::new(4);
    c.allocate(MachineId(2), 7, 2);
    assert!(c.run_until(40 * LEASE, |c| c.stored(ConfigId(2))));
    c.muted.insert(MachineId(3));
    let done = c.run_until(40 * LEASE, |c| !c.machines[2].allocated.is_empty());
    assert!(done, "no answer: {:#?}", c.events);
    assert!(c.run_until(20 * LEASE, |c| c.settled_without(&ids(&[0, 1, 2]))));
    assert_eq!(
        c.machines[2].allocated,
        vec![(7, Ok(vec![RegionId(4), RegionId(5)]))]
    );
    assert!(
        c.events
            .iter()
            .any(|(_, _, e)| matches!(e, Event::Failed(f) if f.contains("allocating"))),
        "the allocation's own attempt committed: {:#?}",
        c.events
    );
    for m in &c.machines[..3] {
        let mapped: Vec<RegionId> = m.map.iter().map(|(r, _)| r).collect();
        assert_eq!(mapped, (0..6).map(RegionId).collect::<Vec<_>>());
    }
}

/// One replica refusing PREPARE fails the allocation: the member hears why, the others release
/// what they prepared, and no configuration maps the regions.
#[test]
fn a_refused_prepare_fails_the_allocation_and_releases_what_was_prepared() {
    let mut c = Cluster::new(3);
    c.machines[1].refuses = true;
    c.allocate(MachineId(0), 1, 1);
    assert!(c.run_until(20 * LEASE, |c| !c.machines[0].allocated.is_empty()));
    let (_, result) = &c.machines[0].allocated[0];
    assert!(
        result.as_ref().is_err_and(|e| e.contains("refused")),
        "{result:?}"
    );
    c.run_until(2 * LEASE, |_| false);
    for m in &c.machines {
        assert_eq!(m.config.id, ConfigId(1));
        assert!(
            m.prepared.is_empty(),
            "{:?} kept {:?}",
            m.plane.me(),
            m.prepared
        );
    }
}

/// The CM fails while the replicas prepare: the request goes to the next CM, which allocates.
#[test]
fn a_request_outlives_the_cm_that_was_serving_it() {
    let mut c = Cluster::new(5);
    c.allocate(MachineId(3), 1, 1);
    c.step();
    c.kill(MachineId(0));
    for m in 1..5 {
        c.suspect(MachineId(m), MachineId(0));
    }
    assert!(c.run_until(60 * LEASE, |c| !c.machines[3].allocated.is_empty()));
    let (_, result) = &c.machines[3].allocated[0];
    let regions = result.clone().expect("allocated by the next CM");
    assert!(c.run_until(20 * LEASE, |c| c.settled_without(&ids(&[1, 2, 3, 4]))));
    for m in &c.machines[1..] {
        assert!(regions.iter().all(|r| m.map.get(*r).is_some()));
        assert!(m.map.iter().all(|(_, p)| !p.holds(MachineId(0))));
    }
}

/// A settled configuration is quiet: every member committed it and reported its regions
/// active, so nothing is repeated (the CM used to repeat NEW-CONFIG-COMMIT of the first
/// configuration to every member forever, every repeat period).
#[test]
fn a_settled_configuration_sends_no_control_messages() {
    let mut c = Cluster::new(3);
    for _ in 0..10 * LEASE {
        c.step();
        assert!(c.in_flight.is_empty(), "at {}: {:?}", c.now, c.in_flight);
    }
    // After a reconfiguration too, once settled.
    c.kill(MachineId(2));
    c.suspect(MachineId(0), MachineId(2));
    assert!(c.run_until(20 * LEASE, |c| c.settled_without(&ids(&[0, 1]))));
    c.run_until(LEASE, |_| false);
    for _ in 0..10 * LEASE {
        c.step();
        assert!(c.in_flight.is_empty(), "at {}: {:?}", c.now, c.in_flight);
    }
}

/// A member that cannot write a view to NVRAM neither installs nor acknowledges it (an
/// acknowledged view is durable): the CM removes it for not acknowledging, and the others
/// commit without it.
#[test]
fn a_member_that_cannot_persist_a_view_never_acknowledges_it() {
    let mut c = Cluster::new(4);
    c.machines[3].persist_fails = true;
    c.kill(MachineId(2));
    c.suspect(MachineId(0), MachineId(2));
    let settled = |c: &Cluster| {
        c.machines[..2].iter().all(|m| {
            m.config.members == ids(&[0, 1])
                && m.committed == m.config.id
                && m.all_active == m.config.id
        })
    };
    assert!(c.run_until(60 * LEASE, settled), "{:?}", c.events);
    let three = &c.machines[3];
    assert_eq!(
        three.config.id,
        ConfigId(1),
        "installed a view it could not persist"
    );
    assert!(
        c.machines[0].config.id >= ConfigId(3),
        "removed in a second attempt"
    );
}

/// The CM's AllActive event marks when ALL-REGIONS-ACTIVE first went out (§5.4): data recovery
/// at a member starts on it, and timelines order the two. The CM used to answer the last
/// member's REGIONS-ACTIVE at once but record (and apply) its own at its next repeat.
#[test]
fn the_cm_records_all_active_when_it_first_sends_it() {
    let mut c = Cluster::new(4);
    c.kill(MachineId(3));
    c.suspect(MachineId(0), MachineId(3));
    assert!(c.run_until(20 * LEASE, |c| c.settled_without(&ids(&[0, 1, 2]))));
    let config = c.machines[0].config.id;
    let first_sent = c
        .all_active_sent
        .iter()
        .filter(|(_, id)| *id == config)
        .map(|(at, _)| *at)
        .min()
        .expect("ALL-REGIONS-ACTIVE sent");
    let recorded = c
        .events
        .iter()
        .find(|(_, m, e)| *m == MachineId(0) && *e == Event::AllActive(config))
        .map(|(at, _, _)| *at)
        .expect("AllActive recorded");
    assert!(
        recorded <= first_sent,
        "recorded at {recorded}, first sent at {first_sent}"
    );
}

/// A member that suspects its CM and cannot remove it although a majority answers (here the
/// CM holds the only complete replica of its region: the other two are being copied) forgives
/// it (`Effect::ForgiveCm`, after which its lease manager takes the CM's grants again) and
/// stops driving its removal. Before, the suspicion stood for good: a CM that came back from a
/// pause was never renewed with, and the member stopped serving (issue 24, liveness seed 35335).
#[test]
fn a_member_forgives_a_cm_whose_removal_would_lose_a_region() {
    let mut c = Cluster::new(3);
    c.cut.insert(MachineId(0));
    c.machines[1].copying.insert(RegionId(0));
    c.machines[2].copying.insert(RegionId(0));
    c.suspect(MachineId(1), MachineId(0));
    let forgiven = |c: &Cluster| {
        c.forgiven
            .iter()
            .any(|(_, m, cm)| *m == MachineId(1) && *cm == MachineId(0))
    };
    assert!(c.run_until(10 * LEASE, forgiven), "{:#?}", c.events);
    assert!(c.events.iter().any(|(_, m, e)| *m == MachineId(1)
        && matches!(e, Event::Failed(f) if f.contains("complete replica"))));
    // Forgiven, the CM is no longer driven out: no attempt after, and the configuration stays.
    let at = c.now;
    c.cut.clear();
    c.run_until(5 * LEASE, |_| false);
    assert!(
        !c.events
            .iter()
            .any(|(t, m, e)| *t > at && *m == MachineId(1) && matches!(e, Event::Attempt { .. })),
        "{:#?}",
        c.events
    );
    assert_eq!(c.machines[1].config.id, ConfigId(1));
}

/// A member whose attempt to remove its CM fails for want of a majority does not forgive it:
/// cut off from the majority, it may have been removed together with its CM, and renewing
/// with that CM would let it serve reads the majority has overwritten. It keeps suspecting (its
/// lease lapses) and tries again a takeover period later.
#[test]
fn a_member_without_a_majority_keeps_suspecting_its_cm() {
    let mut c = Cluster::new(3);
    c.kill(MachineId(2));
    c.cut.insert(MachineId(0));
    c.suspect(MachineId(1), MachineId(0));
    let attempts = |c: &Cluster| {
        c.events
            .iter()
            .filter(|(_, m, e)| *m == MachineId(1) && matches!(e, Event::Attempt { .. }))
            .count()
    };
    assert!(
        c.run_until(10 * LEASE, |c| attempts(c) >= 2),
        "{:#?}",
        c.events
    );
    assert!(c
        .events
        .iter()
        .any(|(_, m, e)| *m == MachineId(1)
            && matches!(e, Event::Failed(f) if f.contains("majority"))));
    assert!(c.forgiven.is_empty(), "forgave {:?}", c.forgiven);
}

/// In a configuration of two nobody can be removed: neither machine is a majority alone, and
/// a suspect is not probed. The CM that suspects its member (a lease request lost, or the
/// member paused) forgives it once its attempt fails (`Effect::ForgiveMember`: its lease
/// manager takes the member's requests again), and the member that suspects its CM forgives it
/// likewise (`Effect::ForgiveCm`); neither is busy afterwards, and the configuration stays.
/// Before, both suspicions stood for good: the CM refused the member's lease requests, the
/// member refused the CM's grants, and both attempted every takeover period forever
/// (simulator seed 23870 of the paused machines).
#[test]
fn in_a_configuration_of_two_a_suspicion_is_forgiven() {
    let mut c = Cluster::with_map(2, RegionMap::striped(2, 1, 1));
    let (cm, member) = (MachineId(0), MachineId(1));
    c.suspect(cm, member);
    assert!(
        c.run_until(LEASE, |c| !c.members_forgiven.is_empty()),
        "{:#?}",
        c.events
    );
    assert!(c
        .members_forgiven
        .iter()
        .all(|(_, by, m)| (*by, *m) == (cm, member)));
    assert!(c
        .events
        .iter()
        .any(|(_, m, e)| *m == cm && matches!(e, Event::Failed(f) if f.contains("majority"))));
    assert!(!c.machines[0].plane.busy(), "the CM is still busy");
    c.suspect(member, cm);
    assert!(
        c.run_until(LEASE, |c| !c.forgiven.is_empty()),
        "{:#?}",
        c.events
    );
    assert!(c
        .forgiven
        .iter()
        .all(|(_, by, x)| (*by, *x) == (member, cm)));
    assert!(!c.machines[1].plane.busy(), "the member is still busy");
    c.run_until(5 * LEASE, |_| false);
    assert!(c.machines.iter().all(|m| m.config.id == ConfigId(1)));
    assert_eq!(c.attempts().len(), 2, "{:#?}", c.events);
}

/// A member that cannot write to its CM (a broken link: `on_unreachable` every tick) and cannot
/// remove it (its region's other replicas are being copied) forgives it as above, and tries
/// again a takeover period after the failure, not at its next tick: forgiving must not turn
/// paced retries into a storm of store reads and attempts. Across processes a member whose
/// two-machine configuration lost its CM attempted every 3 ms (node_rejoin.rs, once the other
/// machine had gone).
#[test]
fn a_member_that_can_neither_reach_nor_remove_its_cm_retries_at_the_takeover_pace() {
    let mut c = Cluster::new(3);
    c.cut.insert(MachineId(0));
    c.machines[1].copying.insert(RegionId(0));
    c.machines[2].copying.insert(RegionId(0));
    let ticks = 10 * LEASE;
    for _ in 0..ticks {
        let now = c.now;
        c.with_plane(MachineId(1), |p, l| p.on_unreachable(MachineId(0), now, l));
        c.run_effects(MachineId(1));
        c.step();
    }
    let attempts = c
        .events
        .iter()
        .filter(|(_, m, e)| *m == MachineId(1) && matches!(e, Event::Attempt { .. }))
        .count() as u64;
    let paced = ticks / (TAKEOVER_LEASES * LEASE) + 1;
    assert!(
        (2..=paced).contains(&attempts),
        "{attempts} attempts in {ticks} ticks (at most {paced} at the takeover pace): {:#?}",
        c.events
    );
    assert!(!c.forgiven.is_empty(), "the CM was never forgiven");
}

/// Runs `ticks` ticks in which `from` cannot write to `to` (`on_unreachable` every tick, as the
/// runtime reports a broken link), until `done`.
fn unreachable_until(
    c: &mut Cluster,
    from: MachineId,
    to: MachineId,
    ticks: u64,
    done: impl Fn(&Cluster) -> bool,
) -> bool {
    for _ in 0..ticks {
        if done(c) {
            return true;
        }
        let now = c.now;
        c.with_plane(from, |p, l| p.on_unreachable(to, now, l));
        c.run_effects(from);
        c.step();
    }
    done(c)
}

/// Whether `m` committed a configuration of exactly `members` with CM `cm`.
fn committed_as(c: &Cluster, m: MachineId, members: &[MachineId], cm: MachineId) -> bool {
    let m = &c.machines[m.0 as usize];
    m.config.members == members && m.config.cm == cm && m.committed == m.config.id
}

/// A member that cannot write to its CM (its link broke while the CM paused, and stays broken
/// while both are members) and cannot remove it (the CM holds region 0's last complete replica)
/// asks the CM to remove it instead, and the CM does. Before, the member forgave the CM and
/// suspected it again every takeover period for good, and transaction recovery waited for what
/// it could not send (simulator seed 40455 of the paused machines).
#[test]
fn a_member_that_can_neither_reach_nor_remove_its_cm_is_removed_by_it() {
    let mut c = Cluster::new(3);
    let (cm, member) = (MachineId(0), MachineId(1));
    c.machines[1].copying.insert(RegionId(0));
    c.machines[2].copying.insert(RegionId(0));
    let out = [MachineId(0), MachineId(2)];
    assert!(
        unreachable_until(&mut c, member, cm, 10 * LEASE, |c| {
            committed_as(c, cm, &out, cm) && committed_as(c, MachineId(2), &out, cm)
        }),
        "{:#?}",
        c.events
    );
    assert!(c
        .events
        .iter()
        .any(|(_, m, e)| *m == member
            && matches!(e, Event::Failed(f) if f.contains("complete replica"))));
    assert!(c.machines[1].evicted || c.machines[1].config.id < c.machines[0].config.id);
}

/// The same between two members: machine 2 cannot write to machine 1, which holds region 1's
/// last complete replica. The CM tries to remove machine 1, fails, and removes machine 2, the
/// one that cannot reach it, instead.
#[test]
fn a_member_that_cannot_reach_a_member_that_cannot_be_removed_is_removed_instead() {
    let mut c = Cluster::new(3);
    let (cm, from, to) = (MachineId(0), MachineId(2), MachineId(1));
    c.machines[0].copying.insert(RegionId(1));
    c.machines[2].copying.insert(RegionId(1));
    let out = [MachineId(0), MachineId(1)];
    assert!(
        unreachable_until(&mut c, from, to, 10 * LEASE, |c| {
            committed_as(c, cm, &out, cm) && committed_as(c, to, &out, cm)
        }),
        "{:#?}",
        c.events
    );
    let attempts: Vec<_> = c
        .events
        .iter()
        .filter_map(|(_, m, e)| match e {
            Event::Attempt { suspects, .. } if *m == cm => Some(suspects.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(attempts.first(), Some(&vec![to]), "{:#?}", c.events);
    assert_eq!(attempts.last(), Some(&vec![from]), "{:#?}", c.events);
}
