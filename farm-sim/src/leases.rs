//! Leases in the simulator (FaRM §5.1): the CM's [`CmLeases`] and every member's
//! [`MemberLease`] from farm-cm, over the fabric's datagrams (lost and delayed as the run asks),
//! stepped by the scheduler. Their expiries are the suspicions the simulated CM acts on, so a
//! crashed, paused or cut-off machine is detected the way the runtime detects it, and a lossy
//! network can make a live machine a suspect.
//!
//! A machine left out of a newer configuration ("orphan") learns it when its own lease runs
//! out; the driver then stops it (fail-stop on lease loss, as a deployed machine would rather
//! than linger as a coordinator whose records nobody reads). Until then it runs on its stale
//! view, which precise membership (§5.2) must make harmless.

use std::collections::BTreeMap;

use farm_cm::{CmLeases, LeaseConfig, LeaseEvent, LeaseMsg, MemberLease};
use farm_core::config::Configuration;
use farm_core::fabric::Fabric;
use farm_core::{ConfigId, MachineId};

/// Every machine's leases in the newest configuration.
#[derive(Debug)]
pub struct SimLeases {
    timing: LeaseConfig,
    config: ConfigId,
    cm: MachineId,
    cm_leases: CmLeases,
    members: BTreeMap<MachineId, MemberLease>,
    /// Machines of an earlier configuration that are not in this one, with when their own
    /// lease (or, for a former CM, its leases at the members) ends.
    orphans: BTreeMap<MachineId, u64>,
    out: Vec<(MachineId, LeaseMsg)>,
    events: Vec<LeaseEvent>,
    buf: Vec<u8>,
    /// When each machine last took a lease step: a machine that was not stepped for longer
    /// than a renewal (paused) credits the gap to the leases it granted, as the runtime's
    /// lease threads do (`CmLeases::stalled`).
    last_step: BTreeMap<MachineId, u64>,
}

impl SimLeases {
    /// Leases of `config` starting at `now`: every lease gets one period to be granted.
    pub fn new(config: &Configuration, lease_ticks: u64, now: u64) -> Self {
        let timing = LeaseConfig::new(lease_ticks);
        let mut s = Self {
            timing,
            config: ConfigId(0),
            cm: config.cm,
            cm_leases: CmLeases::new(config.id, timing, &[], now),
            members: BTreeMap::new(),
            orphans: BTreeMap::new(),
            out: Vec::new(),
            events: Vec::new(),
            buf: Vec::new(),
            last_step: BTreeMap::new(),
        };
        s.reconfigure(config, now);
        s
    }

    /// The configuration the leases belong to.
    pub fn config(&self) -> ConfigId {
        self.config
    }

    /// Moves to a new configuration: leases carry over if the CM stays, else fresh ones start;
    /// members of the old one that are not in it become orphans, out once their own lease ends.
    pub fn reconfigure(&mut self, config: &Configuration, now: u64) {
        if self.config != ConfigId(0) {
            for (m, lease) in &self.members {
                if !config.contains(*m) {
                    self.orphans
                        .insert(*m, lease.lease_expires().unwrap_or(now));
                }
            }
            if !config.contains(self.cm) {
                let until = match self.cm_leases.every_lease_until() {
                    u64::MAX => now,
                    until => until,
                };
                self.orphans.insert(self.cm, until);
            }
        }
        for m in &config.members {
            self.orphans.remove(m);
        }
        let others = config.leaseholders();
        if self.config != ConfigId(0) && config.cm == self.cm {
            // The same CM: leases carry over (§5.2 resets them only when the CM changed).
            self.cm_leases.reconfigure(config.id, &others, now);
            let mut old = std::mem::take(&mut self.members);
            self.members = others
                .iter()
                .map(|m| {
                    let lease = match old.remove(m) {
                        Some(mut l) => {
                            l.reconfigure(config.id, now);
                            l
                        }
                        None => MemberLease::new(config.id, self.timing, config.cm, now),
                    };
                    (*m, lease)
                })
                .collect();
        } else {
            self.cm_leases = CmLeases::new(config.id, self.timing, &others, now);
            self.members = others
                .iter()
                .map(|m| (*m, MemberLease::new(config.id, self.timing, config.cm, now)))
                .collect();
        }
        self.config = config.id;
        self.cm = config.cm;
    }

    /// One lease step of machine `m` at `now`: takes its due datagrams, advances its leases and
    /// sends what they say. Returns the machines it suspects.
    pub fn step_machine(&mut self, m: MachineId, fabric: &dyn Fabric, now: u64) -> Vec<MachineId> {
        let is_cm = m == self.cm;
        if !is_cm && !self.members.contains_key(&m) {
            // An orphan or a spare: no lease to keep, datagrams go unread.
            while fabric.recv_datagram(m, now, &mut self.buf).is_some() {}
            return Vec::new();
        }
        // Stepped every tick while it runs: a longer gap is a stall of this machine.
        let late = self
            .last_step
            .insert(m, now)
            .map_or(0, |t| now.saturating_sub(t + 1));
        if late > self.timing.renew_ticks {
            if is_cm {
                self.cm_leases.stalled(late);
            } else if let Some(l) = self.members.get_mut(&m) {
                l.stalled(late);
            }
        }
        while let Some(from) = fabric.recv_datagram(m, now, &mut self.buf) {
            let Some(msg) = LeaseMsg::decode(&self.buf) else {
                continue;
            };
            if is_cm {
                self.cm_leases.on_datagram(from, msg, now, &mut self.out);
            } else if let Some(l) = self.members.get_mut(&m) {
                l.on_datagram(from, msg, now, &mut self.out);
            }
        }
        if is_cm {
            self.cm_leases.tick(now, &mut self.events);
        } else if let Some(l) = self.members.get_mut(&m) {
            l.tick(now, &mut self.out, &mut self.events);
        }
        for (to, msg) in self.out.drain(..) {
            fabric.send_datagram(m, to, &msg.encode(), now);
        }
        self.events
            .drain(..)
            .map(|LeaseEvent::Suspect(x)| x)
            .collect()
    }

    /// Until when machine `m` may tell an application what it read, as the runtime's lease
    /// manager computes it (`LeaseRole::serves_until`): a member's own lease, every lease the
    /// CM holds at its members, an orphan's last one; never for a spare.
    pub fn serves_until(&self, m: MachineId) -> u64 {
        if m == self.cm {
            self.cm_leases.every_lease_until()
        } else if let Some(l) = self.members.get(&m) {
            l.lease_expires().unwrap_or(0)
        } else {
            self.orphans.get(&m).copied().unwrap_or(0)
        }
    }

    /// Whether orphan `m`'s own lease has run out at `now` (it knows it is out).
    pub fn orphan_expired(&self, m: MachineId, now: u64) -> bool {
        self.orphans.get(&m).is_some_and(|until| now > *until)
    }

    /// Forgets an orphan that stopped.
    pub fn forget_orphan(&mut self, m: MachineId) {
        self.orphans.remove(&m);
    }
}
