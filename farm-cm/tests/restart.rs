//! The whole-cluster restart exchange (`farm_cm::restart`) of every machine of a cluster,
//! driven by a small deterministic harness: datagrams delivered after a seeded delay, lost or
//! repeated where a test says, an embedded coordination store, and NVRAM that reopens at once
//! with made-up ring positions that name who found what (so a test can check that every
//! sender continues each ring where its receiver found it).

use std::collections::BTreeMap;

use farm_cm::control::{ControlMsg, Reassembly};
use farm_cm::restart::{
    Effect, ExchangeParams, LeaveOut, Outcome, Persisted, RestartError, RestartExchange,
    RestartPlan,
};
use farm_cm::{CasOutcome, ConfigurationStore, EmbeddedStore, MarkedConfig};
use farm_core::codec::{RestartMark, StoredView};
use farm_core::config::{Configuration, RegionMap};
use farm_core::{ConfigId, MachineId};

/// A view of configuration `id` with `members`, three regions per member.
fn view(id: u64, members: &[u16]) -> StoredView {
    let mut config = Configuration::initial(members.iter().max().map_or(1, |m| m + 1));
    config.id = ConfigId(id);
    config.members = members.iter().map(|m| MachineId(*m)).collect();
    config.failure_domains.retain(|m, _| members.contains(&m.0));
    config.cm = config.members[0];
    let mut map = RegionMap::default();
    let striped = RegionMap::striped(members.len() as u16, 3, 1);
    for (r, p) in striped.iter() {
        let mut p = p.clone();
        p.primary = config.members[p.primary.0 as usize];
        for b in &mut p.backups {
            *b = config.members[b.0 as usize];
        }
        map.insert(r, p);
    }
    StoredView {
        config,
        map,
        changes: BTreeMap::new(),
    }
}

fn left(view: &StoredView) -> Persisted {
    Persisted {
        view: view.clone(),
        copying: BTreeMap::new(),
    }
}

/// Machine `m`'s life in these tests.
fn life(m: usize) -> u64 {
    1_000 + m as u64
}

/// Where machine `receiver` found `sender`'s ring of worker `t`: a value that names all three.
fn found(receiver: MachineId, sender: MachineId, t: usize) -> [u64; 4] {
    let k = receiver.0 as u64 * 10_000 + sender.0 as u64 * 100 + t as u64;
    [k, k + 1, k + 2, k + 3]
}

/// A store holding `config` under id 9: one that moved on, as another cluster's would.
fn moved_on(config: &Configuration) -> EmbeddedStore {
    let other = EmbeddedStore::new();
    let moved = Configuration {
        id: ConfigId(9),
        ..config.clone()
    };
    assert!(other.cas_config(None, &moved).is_ok());
    other
}

/// The plan that restarts from `view` as configuration `id`.
fn plan_of(view: &StoredView, id: u64) -> RestartPlan {
    RestartPlan {
        config: Configuration {
            id: ConfigId(id),
            ..view.config.clone()
        },
        from: view.clone(),
    }
}

/// A datagram network: a seeded delay per datagram, a loss rate, and duplicates.
struct Net {
    rng: u64,
    /// Datagrams lost per 100.
    loss: u64,
    /// Datagrams repeated per 100.
    duplicates: u64,
    /// (due, from, to, datagram)
    queue: Vec<(u64, MachineId, MachineId, Vec<u8>)>,
}

impl Net {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn send(&mut self, now: u64, from: MachineId, to: MachineId, datagram: Vec<u8>) {
        let copies = 1 + (self.next() % 100 < self.duplicates) as u64;
        for _ in 0..copies {
            if self.next() % 100 < self.loss {
                continue;
            }
            let due = now + 1 + self.next() % 4;
            self.queue.push((due, from, to, datagram.clone()));
        }
    }
}

/// One machine and what its exchange made it do.
struct Machine {
    exchange: RestartExchange,
    pieces: Reassembly,
    /// Every message this machine sent: (when, to, what).
    sent: Vec<(u64, MachineId, ControlMsg)>,
    restored: Option<RestartPlan>,
    /// Ring starts this machine continued its outbound rings with, per receiver.
    resumed: BTreeMap<MachineId, Vec<[u64; 4]>>,
    committed: Vec<ConfigId>,
    /// Whether this machine's NVRAM fails to reopen.
    broken: bool,
}

struct Cluster {
    machines: Vec<Machine>,
    store: EmbeddedStore,
    net: Net,
    now: u64,
    /// Worker threads per machine, by machine.
    threads: Vec<usize>,
    /// A machine that reads another store than the cluster's (an operator's mistake).
    misled: Option<(MachineId, EmbeddedStore)>,
    /// Machines that do not run (did not come back): datagrams to them are lost.
    silent: Vec<MachineId>,
    /// Pairs of machines whose datagrams to each other are lost (both ways).
    apart: Vec<(MachineId, MachineId)>,
}

impl Cluster {
    /// A cluster whose machines left `persisted` (by id), with `stored` in its store.
    fn new(persisted: &[Persisted], stored: &Configuration, seed: u64) -> Self {
        Self::leaving_out(persisted, stored, seed, None)
    }

    /// The same, machine 0 restarting without silent machines as `leave_out` says.
    fn leaving_out(
        persisted: &[Persisted],
        stored: &Configuration,
        seed: u64,
        leave_out: Option<LeaveOut>,
    ) -> Self {
        let store = EmbeddedStore::new();
        assert_eq!(
            store.cas_config(None, stored),
            Ok(CasOutcome::Written(farm_cm::StoreVersion(0)))
        );
        let params = ExchangeParams {
            machines: persisted.len() as u16,
            repeat: 3,
            leave_out,
        };
        let machines = persisted
            .iter()
            .enumerate()
            .map(|(m, p)| Machine {
                exchange: RestartExchange::new(MachineId(m as u16), params, p.clone(), life(m)),
                pieces: Reassembly::new(),
                sent: Vec::new(),
                restored: None,
                resumed: BTreeMap::new(),
                committed: Vec::new(),
                broken: false,
            })
            .collect();
        Self {
            machines,
            store,
            net: Net {
                rng: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
                loss: 0,
                duplicates: 0,
                queue: Vec::new(),
            },
            now: 0,
            threads: vec![2; persisted.len()],
            misled: None,
            silent: Vec::new(),
            apart: Vec::new(),
        }
    }

    fn done(&self) -> bool {
        (self.machines.iter())
            .filter(|m| !self.silent.contains(&m.exchange.machine()))
            .all(|m| m.exchange.outcome().is_some())
    }

    /// Runs until every machine has an outcome (or `steps` pass), then `after` more steps.
    fn run(&mut self, steps: u64, after: u64) {
        let mut left = None;
        for _ in 0..steps {
            self.step();
            if self.done() {
                left = Some(after);
            }
            match &mut left {
                Some(0) => return,
                Some(n) => *n -= 1,
                None => {}
            }
        }
    }

    fn step(&mut self) {
        self.now += 1;
        let now = self.now;
        let mut due = Vec::new();
        self.net.queue.retain(|d| {
            if d.0 <= now {
                due.push(d.clone());
                false
            } else {
                true
            }
        });
        for (_, from, to, datagram) in due {
            if self.silent.contains(&to) {
                continue;
            }
            let m = &mut self.machines[to.0 as usize];
            if let Some(msg) = m.pieces.accept(from, &datagram) {
                m.exchange.on_message(from, msg);
            }
            self.execute(to);
        }
        for i in 0..self.machines.len() {
            if self.silent.contains(&MachineId(i as u16)) {
                continue;
            }
            self.machines[i].exchange.tick(now);
            self.execute(MachineId(i as u16));
        }
    }

    fn execute(&mut self, me: MachineId) {
        let i = me.0 as usize;
        loop {
            let effects = self.machines[i].exchange.take_effects();
            if effects.is_empty() {
                self.machines[i].exchange.invariants();
                return;
            }
            for e in effects {
                let m = &mut self.machines[i];
                match e {
                    Effect::Send { to, msg, id } => {
                        assert_ne!(to, me, "a restart message to itself: {msg:?}");
                        let apart = (self.apart.iter())
                            .any(|(a, b)| (*a, *b) == (me, to) || (*b, *a) == (me, to));
                        for d in msg.datagrams(id).into_iter().filter(|_| !apart) {
                            self.net.send(self.now, me, to, d);
                        }
                        m.sent.push((self.now, to, msg));
                    }
                    Effect::ReadStore => {
                        let store = match &self.misled {
                            Some((who, other)) if *who == me => other,
                            _ => &self.store,
                        };
                        let read = store.read_marked_config().map_err(|e| e.to_string());
                        m.exchange.on_store_read(read);
                    }
                    Effect::CompareAndSet {
                        expected,
                        config,
                        mark,
                    } => {
                        let r = self.store.cas_marked_config(expected, &config, mark);
                        m.exchange.on_cas(r.map_err(|e| e.to_string()));
                    }
                    Effect::Restore(plan) => {
                        assert!(m.restored.is_none(), "{me} restored twice");
                        let threads = self.threads[i];
                        let starts = plan
                            .config
                            .members
                            .iter()
                            .map(|s| (*s, (0..threads).map(|t| found(me, *s, t)).collect()))
                            .collect();
                        m.restored = Some(plan);
                        let r = if m.broken {
                            Err("disk gone".to_string())
                        } else {
                            Ok(starts)
                        };
                        m.exchange.on_restored(r);
                    }
                    Effect::ResumeOutbound { receiver, starts } => {
                        assert!(m.restored.is_some(), "{me} resumed rings before reopening");
                        assert!(
                            m.committed.is_empty(),
                            "{me} resumed rings after committing"
                        );
                        let old = m.resumed.insert(receiver, starts);
                        assert!(old.is_none(), "{me} resumed its rings to {receiver} twice");
                    }
                    Effect::Commit(id) => m.committed.push(id),
                }
            }
        }
    }

    /// Runs the other machines, and delivers machine 0 what they send without letting it tick,
    /// until it decides: returns what the store holds when it asks, which the test hands it
    /// (after changing the store, if it likes).
    fn until_machine_0_reads_the_store(&mut self) -> Result<Option<MarkedConfig>, String> {
        while self.now < 1_000 {
            self.now += 1;
            let now = self.now;
            for i in 1..self.machines.len() {
                self.machines[i].exchange.tick(now);
                self.execute(MachineId(i as u16));
            }
            let mut due = Vec::new();
            self.net.queue.retain(|d| {
                let take = d.0 <= now && d.2 == MachineId(0);
                if take {
                    due.push(d.clone());
                }
                !take
            });
            for (_, from, _, d) in due {
                if let Some(msg) = self.machines[0].pieces.accept(from, &d) {
                    self.machines[0].exchange.on_message(from, msg);
                }
                let effects = self.machines[0].exchange.take_effects();
                if effects.contains(&Effect::ReadStore) {
                    return self.store.read_marked_config().map_err(|e| e.to_string());
                }
            }
        }
        panic!("machine 0 never read the store");
    }

    fn outcome(&self, m: u16) -> &Outcome {
        self.machines[m as usize]
            .exchange
            .outcome()
            .expect("an outcome")
    }

    /// Checks what every member did: it reopened with the plan, continued its rings to every
    /// member (itself included) where the receiver found them, and committed once.
    fn check_restarted(&self, plan: &RestartPlan) {
        for me in &plan.config.members {
            let m = &self.machines[me.0 as usize];
            assert_eq!(self.outcome(me.0), &Outcome::Restarted(plan.clone()));
            assert_eq!(m.restored.as_ref(), Some(plan));
            assert_eq!(m.committed, vec![plan.config.id], "{me} commits once");
            let expected: BTreeMap<MachineId, Vec<[u64; 4]>> = plan
                .config
                .members
                .iter()
                .map(|r| (*r, (0..2).map(|t| found(*r, *me, t)).collect()))
                .collect();
            assert_eq!(m.resumed, expected, "{me}'s rings");
        }
    }
}

#[test]
fn every_member_restarts_with_the_stored_plan() {
    let v = view(4, &[0, 1, 2]);
    let mut c = Cluster::new(&[left(&v), left(&v), left(&v)], &v.config, 1);
    c.run(1_000, 0);
    assert!(
        c.done(),
        "waiting for {:?}",
        c.machines[0].exchange.waiting_for()
    );
    let plan = plan_of(&v, 5);
    c.check_restarted(&plan);
    assert_eq!(
        c.store.read_config().unwrap().map(|(_, c)| c),
        Some(plan.config.clone()),
        "machine 0 stored the restart configuration"
    );
}

/// What a machine repeats until answered (machine 0's announcement of the plan, a member's
/// request for ring starts) goes out once per peer when the machine decides or reopens, and
/// again only a repeat interval later: a plan of thousands of regions is many datagrams.
#[test]
fn announcements_and_requests_go_once_per_repeat() {
    let v = view(4, &[0, 1, 2, 3]);
    let persisted: Vec<Persisted> = (0..4).map(|_| left(&v)).collect();
    let mut c = Cluster::new(&persisted, &v.config, 3);
    c.run(1_000, 20);
    assert!(c.done());
    for m in &c.machines {
        let mut last: BTreeMap<(MachineId, bool), u64> = BTreeMap::new();
        for (at, to, msg) in &m.sent {
            let restart = match msg {
                ControlMsg::Restart { .. } => true,
                ControlMsg::RingStarts { reply: false, .. } => false,
                _ => continue,
            };
            if let Some(before) = last.insert((*to, restart), *at) {
                assert!(
                    at - before >= 3,
                    "{} sent {msg:?} to {to} at {before} and again at {at}",
                    m.exchange.machine()
                );
            }
        }
    }
}

/// Lost, repeated and reordered datagrams, over many seeds: every member still restarts with
/// the same plan, each ring continued exactly once where its receiver found it.
#[test]
fn lost_and_repeated_datagrams_delay_the_restart_but_change_nothing() {
    let v = view(7, &[0, 1, 2, 3, 4]);
    let persisted: Vec<Persisted> = (0..5).map(|_| left(&v)).collect();
    for seed in 0..200 {
        let mut c = Cluster::new(&persisted, &v.config, seed);
        c.net.loss = 30;
        c.net.duplicates = 20;
        c.run(20_000, 200);
        assert!(c.done(), "seed {seed}: waiting");
        let Outcome::Restarted(plan) = c.outcome(0).clone() else {
            panic!("seed {seed}: {:?}", c.outcome(0));
        };
        assert_eq!(plan.config.id, ConfigId(8));
        c.check_restarted(&plan);
    }
}

/// Machine 3 was removed in configuration 5, before the power went: it learns it stays out,
/// and the members restart from the newest view without it. Likewise when machine 0, which
/// decides, was the one removed: it decides, and returns once every machine learnt the plan.
#[test]
fn a_machine_removed_before_the_stop_stays_out() {
    for (removed, members) in [(3u16, [0u16, 1, 2]), (0, [1, 2, 3])] {
        let old = view(4, &[0, 1, 2, 3]);
        let new = view(5, &members);
        let persisted: Vec<Persisted> = (0..4)
            .map(|m| if m == removed { left(&old) } else { left(&new) })
            .collect();
        for seed in 0..50 {
            let mut c = Cluster::new(&persisted, &new.config, seed);
            c.net.loss = 20;
            c.run(20_000, 100);
            assert!(c.done(), "seed {seed}");
            let plan = plan_of(&new, 6);
            assert_eq!(c.outcome(removed), &Outcome::Removed(plan.clone()));
            let out = &c.machines[removed as usize];
            assert!(out.restored.is_none() && out.resumed.is_empty() && out.committed.is_empty());
            c.check_restarted(&plan);
        }
    }
}

/// A restart of a cluster that still runs (or another restart got there first): the store
/// changed between machine 0's read and its compare-and-set. Machine 0 fails with the reason,
/// nobody reopens anything, and the others fail too, naming machine 0 and its reason, instead
/// of waiting for a plan that will not come.
#[test]
fn a_store_that_changes_under_the_restart_fails_it() {
    let v = view(4, &[0, 1, 2]);
    let mut c = Cluster::new(&[left(&v), left(&v), left(&v)], &v.config, 3);
    // Machine 0 reads the store once it heard from everyone; then the store moves on.
    let read = c.until_machine_0_reads_the_store();
    let Ok(Some((version, config, _))) = read.clone() else {
        panic!("stored");
    };
    let moved = Configuration {
        id: ConfigId(5),
        ..config
    };
    c.store.cas_config(Some(version), &moved).unwrap();
    c.machines[0].exchange.on_store_read(read);
    c.execute(MachineId(0));
    let Outcome::Failed(RestartError::Store(e)) = c.outcome(0) else {
        panic!("{:?}", c.machines[0].exchange.outcome());
    };
    assert!(e.contains("changed during the restart"), "{e}");
    c.run(300, 0);
    assert!(c.machines.iter().all(|m| m.restored.is_none()));
    for m in 1..3 {
        let Outcome::Failed(RestartError::Refused { machine, reason }) = c.outcome(m) else {
            panic!("{m}: {:?}", c.machines[m as usize].exchange.outcome());
        };
        assert_eq!(*machine, MachineId(0));
        assert!(reason.contains("changed during the restart"), "{reason}");
    }
}

/// Machine 0's announcement disagrees with the store (an operator pointed a machine at another
/// store): that machine refuses it. And a member whose NVRAM does not reopen fails with why.
/// Either failure leaves the restart without a member, so machine 0 fails too, naming the
/// first it heard of; over lossy datagrams it still hears.
#[test]
fn a_machine_refuses_a_plan_the_store_does_not_hold_and_fails_without_its_nvram() {
    let v = view(4, &[0, 1, 2]);
    let mut c = Cluster::new(&[left(&v), left(&v), left(&v)], &v.config, 4);
    c.net.loss = 30;
    c.misled = Some((MachineId(2), moved_on(&v.config)));
    c.machines[1].broken = true;
    c.run(2_000, 0);
    let Outcome::Failed(RestartError::Store(e)) = c.outcome(2) else {
        panic!("{:?}", c.machines[2].exchange.outcome());
    };
    assert!(e.contains("not restart configuration 5"), "{e}");
    let Outcome::Failed(RestartError::Invalid(e)) = c.outcome(1) else {
        panic!("{:?}", c.machines[1].exchange.outcome());
    };
    assert!(e.contains("disk gone"), "{e}");
    let Outcome::Failed(RestartError::Refused { machine, reason }) = c.outcome(0) else {
        panic!("{:?}", c.machines[0].exchange.outcome());
    };
    assert!(
        (*machine == MachineId(1) && reason.contains("disk gone"))
            || (*machine == MachineId(2) && reason.contains("not restart configuration 5")),
        "{machine}: {reason}"
    );
    assert!(c.machines.iter().all(|m| m.committed.is_empty()));
}

/// A machine removed before the stop that refuses the plan (it reads another store) stops
/// nobody: the members do not wait for it, and machine 0, outside the plan here, counts its
/// refusal as learning the plan.
#[test]
fn a_machine_outside_the_plan_that_refuses_it_stops_nobody() {
    let cases: [(&[u16], &[u16], u16); 2] = [
        (&[0, 1, 2, 3], &[0, 1, 2], 3),
        (&[0, 1, 2, 3, 4], &[1, 2, 3], 4),
    ];
    for (all, members, misled) in cases {
        let old = view(4, all);
        let new = view(5, members);
        let persisted: Vec<Persisted> = all
            .iter()
            .map(|m| left(if members.contains(m) { &new } else { &old }))
            .collect();
        let mut c = Cluster::new(&persisted, &new.config, 8);
        c.net.loss = 20;
        c.misled = Some((MachineId(misled), moved_on(&new.config)));
        c.run(5_000, 0);
        assert!(c.done(), "members {members:?}: waiting");
        let plan = plan_of(&new, 6);
        c.check_restarted(&plan);
        let Outcome::Failed(RestartError::Store(e)) = c.outcome(misled) else {
            panic!("{:?}", c.machines[misled as usize].exchange.outcome());
        };
        assert!(e.contains("not restart configuration 6"), "{e}");
        if !members.contains(&0) {
            assert_eq!(c.outcome(0), &Outcome::Removed(plan.clone()));
        }
    }
}

/// Machine 3 does not come back (its disk died with the power). Machine 0 waits for it as
/// long as `LeaveOut::after` says, then restarts the others without it: its replicas are
/// remapped onto them, two per region again, every region keeps a complete replica, and the
/// restart configuration's CM is a machine that came back. When machine 3 runs again later, it
/// learns it is out. Without `LeaveOut`, machine 0 waits.
#[test]
fn machines_that_do_not_come_back_are_left_out_after_a_while() {
    let v = view(4, &[0, 1, 2, 3]);
    let mut v3 = v.clone();
    v3.config.cm = MachineId(3);
    let persisted: Vec<Persisted> = (0..4).map(|_| left(&v3)).collect();
    let mut waiting = Cluster::new(&persisted, &v3.config, 9);
    waiting.silent = vec![MachineId(3)];
    waiting.run(2_000, 0);
    assert_eq!(waiting.machines[0].exchange.outcome(), None);
    assert_eq!(
        waiting.machines[0].exchange.waiting_for(),
        vec![MachineId(3)]
    );
    let leave_out = LeaveOut {
        after: 100,
        replicas: 2,
        regions_max: 64,
    };
    for seed in 0..20 {
        let mut c = Cluster::leaving_out(&persisted, &v3.config, seed, Some(leave_out));
        c.net.loss = 10;
        c.silent = vec![MachineId(3)];
        c.run(5_000, 50);
        assert!(c.done(), "seed {seed}: waiting");
        let Outcome::Restarted(plan) = c.outcome(0).clone() else {
            panic!("seed {seed}: {:?}", c.outcome(0));
        };
        assert!(c.now > 100, "seed {seed}: decided before waiting");
        assert_eq!(plan.config.id, ConfigId(5));
        let three = [MachineId(0), MachineId(1), MachineId(2)];
        assert_eq!(plan.config.members, three);
        assert_eq!(plan.config.cm, MachineId(0));
        for (r, p) in plan.from.map.iter() {
            let replicas: Vec<MachineId> = p.replicas().collect();
            assert_eq!(
                replicas.len(),
                2,
                "seed {seed}: region {r:?} on {replicas:?}"
            );
            assert!(replicas.iter().all(|m| three.contains(m)));
            // The primary held it complete before the stop.
            assert!(v.map.get(r).unwrap().holds(p.primary), "seed {seed}: {r:?}");
        }
        assert_eq!(plan.from.map.iter().count(), v.map.iter().count());
        c.check_restarted(&plan);
        // Machine 3 comes back late: machine 0's finished exchange tells it it is out.
        c.silent.clear();
        c.run(5_000, 0);
        assert_eq!(c.outcome(3), &Outcome::Removed(plan), "seed {seed}");
    }
}

/// A restart without the machines not heard from goes on only when it loses nothing: every
/// region keeps a complete replica on a machine that came back, and those are a majority of
/// the newest configuration's members. Otherwise machine 0 keeps waiting past
/// `LeaveOut::after`, says why (`not_left_out`), and restarts with every machine once the
/// missing ones run.
#[test]
fn a_restart_without_machines_that_would_lose_data_or_a_majority_keeps_waiting() {
    let v = view(4, &[0, 1, 2, 3]);
    let leave_out = LeaveOut {
        after: 100,
        replicas: 2,
        regions_max: 64,
    };
    // A region of machine 3's whose one backup was still copying it.
    let (r3, p3) = (v.map.iter())
        .find(|(_, p)| p.primary == MachineId(3))
        .expect("machine 3 is a primary");
    let mut copying: Vec<Persisted> = (0..4).map(|_| left(&v)).collect();
    copying[p3.backups[0].0 as usize].copying.insert(r3, true);
    // Every region on machines 0 and 1 alone: machines 2 and 3 hold nothing, but are half
    // the members.
    let mut on_two = v.clone();
    for (r, p) in v.map.iter() {
        let mut p = p.clone();
        p.primary = MachineId(r.0 as u16 % 2);
        p.backups = vec![MachineId(1 - r.0 as u16 % 2)];
        on_two.map.insert(r, p);
    }
    let two: Vec<Persisted> = (0..4).map(|_| left(&on_two)).collect();
    let cases = [
        (
            copying,
            vec![MachineId(3)],
            "but perhaps on [MachineId(3)], which did not come back",
        ),
        (two, vec![MachineId(2), MachineId(3)], "needs a majority"),
    ];
    for (persisted, silent, why) in cases {
        for seed in 0..5 {
            let mut c = Cluster::leaving_out(&persisted, &v.config, seed, Some(leave_out));
            c.net.loss = 10;
            c.silent = silent.clone();
            c.run(2_000, 0);
            let m0 = &c.machines[0].exchange;
            assert_eq!(m0.outcome(), None, "seed {seed}: {silent:?} left out");
            assert_eq!(m0.waiting_for(), silent, "seed {seed}");
            let reason = m0.not_left_out().expect("says why it waits");
            assert!(reason.contains(why), "seed {seed}: {reason}");
            assert!(c.machines.iter().all(|m| m.committed.is_empty()));
            c.silent.clear();
            c.run(5_000, 50);
            assert!(c.done(), "seed {seed}: waiting once all run");
            let Outcome::Restarted(plan) = c.outcome(0).clone() else {
                panic!("seed {seed}: {:?}", c.outcome(0));
            };
            // Machine 3 holds the one complete replica of a region; machines 2 and 3 hold
            // nothing in the second case, where the machine whose datagrams keep being lost
            // after the others came back may be left out.
            let members = &plan.config.members;
            if silent.len() == 1 {
                assert_eq!(members, &v.config.members, "seed {seed}");
            } else {
                assert!(members.len() >= 3, "seed {seed}: {members:?}");
            }
            assert_eq!(plan.from.map.iter().count(), v.map.iter().count());
            assert_eq!(c.machines[0].exchange.not_left_out(), None);
            c.check_restarted(&plan);
        }
    }
}

/// Machines that run different numbers of worker threads cannot continue each other's rings.
#[test]
fn machines_with_different_worker_counts_refuse_each_other() {
    let v = view(4, &[0, 1]);
    let mut c = Cluster::new(&[left(&v), left(&v)], &v.config, 5);
    c.threads[1] = 3;
    c.run(1_000, 0);
    // Each sees it in the other's ring starts, or learns it from the other's refusal first.
    for m in 0..2 {
        let Outcome::Failed(e) = c.outcome(m) else {
            panic!("{:?}", c.machines[m as usize].exchange.outcome());
        };
        let e = e.to_string();
        assert!(e.contains("every machine of a cluster runs as many"), "{e}");
    }
    assert!(c.machines.iter().all(|m| m.committed.is_empty()));
}

/// A machine that finished still answers: machine 0 announces the plan to a machine that asks
/// late, and a member gives its ring starts again to a peer that lost the answer.
#[test]
fn a_finished_machine_answers_late_requests() {
    let v = view(4, &[0, 1, 2]);
    let mut c = Cluster::new(&[left(&v), left(&v), left(&v)], &v.config, 6);
    c.run(1_000, 20);
    assert!(c.done());
    let Outcome::Restarted(plan) = c.outcome(0).clone() else {
        panic!()
    };
    let p = left(&v);
    c.machines[0].exchange.on_message(
        MachineId(2),
        ControlMsg::Persisted {
            view: p.view,
            copying: p.copying,
            life: life(2),
        },
    );
    let effects = c.machines[0].exchange.take_effects();
    assert!(
        matches!(&effects[..], [Effect::Send { to: MachineId(2), msg: ControlMsg::Restart { restart, .. }, .. }] if *restart == plan.config.id),
        "{effects:?}"
    );
    c.machines[1].exchange.on_message(
        MachineId(2),
        ControlMsg::RingStarts {
            config: plan.config.id,
            reply: false,
            starts: vec![[0; 4]; 2],
        },
    );
    let effects = c.machines[1].exchange.take_effects();
    let answer: Vec<[u64; 4]> = (0..2)
        .map(|t| found(MachineId(1), MachineId(2), t))
        .collect();
    assert_eq!(
        effects,
        vec![Effect::Send {
            to: MachineId(2),
            msg: ControlMsg::RingStarts {
                config: plan.config.id,
                reply: true,
                starts: answer,
            },
            id: match &effects[0] {
                Effect::Send { id, .. } => *id,
                e => panic!("{e:?}"),
            },
        }]
    );
    c.check_restarted(&plan);
}

/// Machine 0 does not come back (its disk died with the power). The others wait for it as long
/// as `LeaveOut::after` says, then machine 1, the lowest machine that came back, restarts them
/// without it: the store holds its decision, marked with its life, and machine 0 learns it is
/// out when it runs again. Without `LeaveOut` everyone waits for machine 0.
#[test]
fn machine_0_that_does_not_come_back_is_left_out_by_the_lowest_machine_that_did() {
    let v = view(4, &[0, 1, 2, 3]);
    let persisted: Vec<Persisted> = (0..4).map(|_| left(&v)).collect();
    let mut waiting = Cluster::new(&persisted, &v.config, 9);
    waiting.silent = vec![MachineId(0)];
    waiting.run(2_000, 0);
    for m in 1..4 {
        let exchange = &waiting.machines[m].exchange;
        assert_eq!(exchange.outcome(), None);
        assert_eq!(exchange.waiting_for(), vec![MachineId(0)]);
    }
    let leave_out = LeaveOut {
        after: 100,
        replicas: 2,
        regions_max: 64,
    };
    for seed in 0..20 {
        let mut c = Cluster::leaving_out(&persisted, &v.config, seed, Some(leave_out));
        c.net.loss = 10;
        c.silent = vec![MachineId(0)];
        c.run(5_000, 50);
        assert!(c.done(), "seed {seed}: waiting");
        let Outcome::Restarted(plan) = c.outcome(1).clone() else {
            panic!("seed {seed}: {:?}", c.outcome(1));
        };
        assert!(c.now > 100, "seed {seed}: decided before waiting");
        let three = [MachineId(1), MachineId(2), MachineId(3)];
        assert_eq!(plan.config.members, three, "seed {seed}");
        assert!(three.contains(&plan.config.cm), "seed {seed}");
        assert!(plan.from.map.iter().all(|(_, p)| !p.holds(MachineId(0))));
        c.check_restarted(&plan);
        let stored = c.store.read_marked_config().unwrap().unwrap();
        let mark = RestartMark {
            decider: MachineId(1),
            life: life(1),
        };
        assert_eq!((stored.1, stored.2), (plan.config.clone(), Some(mark)));
        // Machine 0 runs again: the decider's finished exchange tells it it is out.
        c.silent.clear();
        c.run(5_000, 0);
        assert_eq!(c.outcome(0), &Outcome::Removed(plan), "seed {seed}");
    }
}

/// Machines 0 and 1 cannot hear each other, the others hear both: each is the lowest machine
/// it heard from, and both decide, each without the other (machine 0 starting later in half
/// the seeds). The store settles it: one compare-and-set wins, and the other, finding the
/// store marked by a machine it has not heard from, decides nothing more and waits for its
/// announcement. Machines 2 and 3 restart with the winner's plan; once the two hear each
/// other, the loser learns it is out.
#[test]
fn two_machines_that_both_decide_are_settled_by_the_store() {
    let v = view(4, &[0, 1, 2, 3]);
    let persisted: Vec<Persisted> = (0..4).map(|_| left(&v)).collect();
    let leave_out = LeaveOut {
        after: 100,
        replicas: 2,
        regions_max: 64,
    };
    let mut winners = [0; 2];
    for seed in 0..40 {
        let mut c = Cluster::leaving_out(&persisted, &v.config, seed, Some(leave_out));
        c.net.loss = 10;
        c.apart = vec![(MachineId(0), MachineId(1))];
        if seed % 2 == 1 {
            c.silent = vec![MachineId(0)];
            c.run(20, 0);
            c.silent.clear();
        }
        c.run(5_000, 50);
        let (_, stored, mark) = c.store.read_marked_config().unwrap().unwrap();
        let mark = mark.expect("a decision is marked");
        let (winner, loser) = match mark.decider {
            MachineId(0) => (0, 1),
            MachineId(1) => (1, 0),
            other => panic!("seed {seed}: decided by {other}"),
        };
        winners[winner as usize] += 1;
        assert_eq!(mark.life, life(winner as usize));
        let Outcome::Restarted(plan) = c.outcome(winner).clone() else {
            panic!("seed {seed}: {:?}", c.outcome(winner));
        };
        assert_eq!(plan.config, stored, "seed {seed}");
        assert!(!plan.config.contains(MachineId(loser)), "seed {seed}");
        c.check_restarted(&plan);
        let l = &c.machines[loser as usize];
        assert_eq!(l.exchange.outcome(), None, "seed {seed}");
        assert!(
            l.restored.is_none() && l.committed.is_empty(),
            "seed {seed}"
        );
        assert_eq!(l.exchange.waiting_for(), vec![MachineId(winner)]);
        let why = l.exchange.not_left_out().expect("says why it waits");
        assert!(
            why.contains(&format!("machine {}", MachineId(winner))),
            "{why}"
        );
        c.apart.clear();
        c.run(5_000, 0);
        assert_eq!(c.outcome(loser), &Outcome::Removed(plan), "seed {seed}");
    }
    assert!(
        winners.iter().all(|w| *w > 0),
        "one machine always won: {winners:?}"
    );
}

/// The store holds a restart decision that machine 1 stored in an earlier life (the power went
/// again before anyone installed it). Machine 1 runs again in another life, so the decision is
/// no longer anyone's: machine 0, hearing from everyone, decides over it as over any stored
/// configuration, under the next id.
#[test]
fn a_decision_an_earlier_life_stored_is_decided_over() {
    let v = view(4, &[0, 1, 2]);
    let mut c = Cluster::new(&[left(&v), left(&v), left(&v)], &v.config, 2);
    let earlier = plan_of(&v, 5);
    let old = RestartMark {
        decider: MachineId(1),
        life: 7,
    };
    let version = c.store.read_config().unwrap().unwrap().0;
    assert!(c
        .store
        .cas_marked_config(version, &earlier.config, old)
        .is_ok());
    c.run(1_000, 0);
    assert!(c.done());
    let plan = plan_of(&v, 6);
    c.check_restarted(&plan);
    let (_, stored, mark) = c.store.read_marked_config().unwrap().unwrap();
    assert_eq!(stored, plan.config);
    assert_eq!(
        mark,
        Some(RestartMark {
            decider: MachineId(0),
            life: life(0)
        })
    );
}

/// Machine 1's decision reaches the store between machine 0's read and its compare-and-set
/// (both decided; machine 1's announcement is late). Machine 0's compare-and-set fails; it
/// reads the store again, finds the decision of a machine it heard from in the life the
/// decision is marked with, and waits for its announcement instead of failing or deciding
/// over it.
#[test]
fn a_decider_that_loses_the_store_to_another_waits_for_its_announcement() {
    let v = view(4, &[0, 1, 2]);
    let mut c = Cluster::new(&[left(&v), left(&v), left(&v)], &v.config, 3);
    let theirs = plan_of(&v, 5);
    let read = c.until_machine_0_reads_the_store();
    c.machines[0].exchange.on_store_read(read);
    let mark = RestartMark {
        decider: MachineId(1),
        life: life(1),
    };
    let version = c.store.read_config().unwrap().unwrap().0;
    assert!(c
        .store
        .cas_marked_config(version, &theirs.config, mark)
        .is_ok());
    c.execute(MachineId(0));
    let m0 = &c.machines[0].exchange;
    assert_eq!(m0.outcome(), None);
    assert_eq!(m0.waiting_for(), vec![MachineId(1)]);
    let why = m0.not_left_out().expect("says why it waits");
    assert!(
        why.contains("machine m1 decided restart configuration 5"),
        "{why}"
    );
    let (_, stored, kept) = c.store.read_marked_config().unwrap().unwrap();
    assert_eq!((stored, kept), (theirs.config, Some(mark)));
}
