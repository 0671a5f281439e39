//! Leases under datagram loss and delay, and failure detection, in a deterministic driver over
//! the `mem` fabric's datagrams (FaRM §5.1). Every run prints its seed.

use farm_cm::{CmLeases, LeaseConfig, LeaseEvent, LeaseMsg, MemberLease};
use farm_core::fabric::Fabric;
use farm_core::{ConfigId, MachineId};
use farm_fabric::mem::{DatagramPolicy, MemFabric, MemFabricConfig};

const CM: MachineId = MachineId(0);
const LEASE: u64 = 100;
/// Datagram delay in the failure tests: a datagram sent just before a death still lands.
const DELAY_MAX: u64 = 5;

struct Sim {
    fabric: MemFabric,
    cm: CmLeases,
    members: Vec<MemberLease>,
    now: u64,
    /// (time, observer, event)
    events: Vec<(u64, MachineId, LeaseEvent)>,
    requests: u64,
}

impl Sim {
    fn new(seed: u64, machines: u16, policy: DatagramPolicy) -> Self {
        println!("lease sim seed {seed}");
        let fabric = MemFabric::new(MemFabricConfig {
            machines_max: machines,
            threads_max: 1,
            seed,
            datagrams_queued_max: 256,
        });
        fabric.set_datagram_policy(policy);
        let t = LeaseConfig::new(LEASE);
        let others: Vec<MachineId> = (1..machines).map(MachineId).collect();
        Sim {
            fabric,
            cm: CmLeases::new(ConfigId(1), t, &others, 0),
            members: others
                .iter()
                .map(|_| MemberLease::new(ConfigId(1), t, CM, 0))
                .collect(),
            now: 0,
            events: Vec::new(),
            requests: 0,
        }
    }

    fn send(&mut self, from: MachineId, out: &mut Vec<(MachineId, LeaseMsg)>) {
        for (to, msg) in out.drain(..) {
            if matches!(msg, LeaseMsg::Request { .. }) {
                self.requests += 1;
            }
            self.fabric.send_datagram(from, to, &msg.encode(), self.now);
        }
    }

    fn step(&mut self) {
        self.now += 1;
        let now = self.now;
        let (mut out, mut ev, mut buf) = (Vec::new(), Vec::new(), Vec::new());
        if self.fabric.is_alive(CM) {
            while let Some(from) = self.fabric.recv_datagram(CM, now, &mut buf) {
                if let Some(msg) = LeaseMsg::decode(&buf) {
                    self.cm.on_datagram(from, msg, now, &mut out);
                }
            }
            self.cm.tick(now, &mut ev);
            self.send(CM, &mut out);
            self.events.extend(ev.drain(..).map(|e| (now, CM, e)));
        }
        for i in 0..self.members.len() {
            let me = MachineId(i as u16 + 1);
            if !self.fabric.is_alive(me) {
                continue;
            }
            while let Some(from) = self.fabric.recv_datagram(me, now, &mut buf) {
                if let Some(msg) = LeaseMsg::decode(&buf) {
                    self.members[i].on_datagram(from, msg, now, &mut out);
                }
            }
            self.members[i].tick(now, &mut out, &mut ev);
            self.send(me, &mut out);
            self.events.extend(ev.drain(..).map(|e| (now, me, e)));
        }
    }

    fn run(&mut self, ticks: u64) {
        for _ in 0..ticks {
            self.step();
        }
    }
}

/// With up to 2% loss and delays up to a tenth of a lease, no lease ever expires falsely over
/// 200 lease periods, renewal happens every fifth of a lease, and every lease stays valid.
#[test]
fn handshake_and_renewal_survive_datagram_loss_without_false_suspicion() {
    for seed in 0..40 {
        let policy = DatagramPolicy {
            drop_per_million: 20_000,
            delay_ticks_max: LEASE / 10,
        };
        let mut sim = Sim::new(seed, 5, policy);
        sim.run(200 * LEASE);
        assert!(
            sim.events.is_empty(),
            "seed {seed}: false suspicion {:?}",
            sim.events
        );
        let per_member = sim.requests / 4;
        assert!(
            (per_member as i64 - 1000).abs() <= 2,
            "seed {seed}: {per_member} requests in 200 leases"
        );
        for (i, m) in sim.members.iter().enumerate() {
            assert!(
                m.lease_valid(sim.now),
                "seed {seed}: member {} has no valid lease",
                i + 1
            );
            assert!(
                sim.cm.holds_lease_at(MachineId(i as u16 + 1), sim.now),
                "seed {seed}: CM lease at {}",
                i + 1
            );
        }
    }
}

/// A killed member is suspected by the CM, and by nobody else, within one lease (plus the
/// delay of a datagram it sent just before it died) of its death.
#[test]
fn a_killed_member_is_suspected_within_a_lease() {
    for seed in 0..40 {
        let mut sim = Sim::new(
            seed,
            5,
            DatagramPolicy {
                drop_per_million: 10_000,
                delay_ticks_max: DELAY_MAX,
            },
        );
        sim.run(10 * LEASE + seed);
        let killed_at = sim.now;
        sim.fabric.kill(MachineId(3));
        sim.run(3 * LEASE);
        let [(at, who, LeaseEvent::Suspect(m))] = sim.events[..] else {
            panic!("seed {seed}: {:?}", sim.events)
        };
        assert_eq!((who, m), (CM, MachineId(3)), "seed {seed}");
        assert!(
            at > killed_at && at <= killed_at + LEASE + DELAY_MAX + 1,
            "seed {seed}: suspected {} ticks after the kill",
            at - killed_at
        );
    }
}

/// A killed CM is suspected by every member within one lease (plus a datagram's delay).
#[test]
fn a_killed_cm_is_suspected_by_every_member_within_a_lease() {
    for seed in 0..40 {
        let mut sim = Sim::new(
            seed,
            4,
            DatagramPolicy {
                drop_per_million: 10_000,
                delay_ticks_max: DELAY_MAX,
            },
        );
        sim.run(10 * LEASE + seed);
        let killed_at = sim.now;
        sim.fabric.kill(CM);
        sim.run(3 * LEASE);
        let mut suspecters: Vec<MachineId> = sim
            .events
            .iter()
            .map(|(at, who, e)| {
                assert_eq!(*e, LeaseEvent::Suspect(CM), "seed {seed}");
                assert!(
                    *at <= killed_at + LEASE + DELAY_MAX + 1,
                    "seed {seed}: late by {}",
                    at - killed_at
                );
                *who
            })
            .collect();
        suspecters.sort();
        assert_eq!(
            suspecters,
            vec![MachineId(1), MachineId(2), MachineId(3)],
            "seed {seed}"
        );
    }
}

/// A member cut off from the CM (every datagram lost) is suspected, and its own lease lapses
/// no later than the CM believes it does.
#[test]
fn a_partitioned_member_is_suspected_and_its_lease_lapses_first() {
    let mut sim = Sim::new(7, 3, DatagramPolicy::default());
    sim.run(5 * LEASE);
    sim.fabric.set_datagram_policy(DatagramPolicy {
        drop_per_million: 1_000_000,
        delay_ticks_max: 0,
    });
    let cut_at = sim.now;
    let cm_view = sim.cm.member_expires(MachineId(1)).unwrap();
    sim.run(2 * LEASE);
    assert!(
        !sim.members[0].lease_valid(cm_view + 1),
        "member lease outlives the CM's view of it"
    );
    let suspected: Vec<_> = sim.events.iter().filter(|(_, who, _)| *who == CM).collect();
    assert_eq!(suspected.len(), 2, "{:?}", sim.events);
    assert!(suspected.iter().all(|(at, _, _)| *at <= cut_at + LEASE + 1));
}
