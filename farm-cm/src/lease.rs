//! Leases (FaRM §5.1): every machine holds a lease at the CM and the CM holds a lease at every
//! machine; expiry of either makes the holder's peer suspect it.
//!
//! Leases are granted with a 3-way handshake over unreliable datagrams: a machine sends
//! REQUEST; the CM answers GRANT-REQUEST, which grants the machine's lease and asks for its own;
//! the machine answers GRANT. A machine renews every `lease / 5` (the paper's default, to ride
//! out lost datagrams).
//!
//! Expiry times are conservative on both sides, so that a suspect's peer never believes a lease
//! valid longer than its holder does:
//! - a member's lease runs from when it *sent* the REQUEST that got granted;
//! - the CM's lease at a member runs from when the CM *sent* the GRANT-REQUEST that the member
//!   granted;
//! - each side suspects the other when the lease it granted runs out without renewal;
//! - a CM grants no lease past the end of its own leases at its members, plus one lease: a
//!   GRANT-REQUEST says how long ago the CM stopped holding a lease at every member
//!   (`lapsed`), and the member's lease is that much shorter. The price: a member that stops
//!   granting (a crashed one) ends every member's serving one lease after its last grant,
//!   until a configuration without it is installed at the CM, and for good if it cannot be
//!   removed (it holds a region's last complete replica); at start, serving waits for every
//!   member's first grant. Any member whose grant ran out
//!   may remove the CM, and a configuration without a machine commits one lease after it
//!   found the machine unreachable (§5.2 step 7): a member cut off together with its CM, and
//!   removed with it, would otherwise be renewed by that CM for good and serve what the new
//!   configuration has since overwritten.
//!
//! A lease session lasts as long as the pair (CM, member) does: a new configuration with the same
//! CM carries the leases over (`reconfigure`), and only a new CM starts fresh ones (§5.2: the CM
//! "resets the lease protocol if the CM changed"). Machines install a configuration one after
//! another, so for a while the CM and a member disagree on its id; a datagram is accepted from
//! any configuration since the session began. Resetting leases at every configuration instead
//! made a member that installed a few milliseconds after its CM (an fsync each) drop the CM's
//! grants until its lease ran out, and suspect a live CM.
//!
//! Both sides are deterministic state machines: time comes in as `now` (ticks), datagrams come
//! in through `on_datagram`, and what to send goes out through a caller's buffer. They keep no
//! growing state, so a lease thread can run them without allocating after start.

use std::collections::BTreeMap;

use farm_core::config::Configuration;
use farm_core::{ConfigId, MachineId};

/// Lease timing, in ticks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct LeaseConfig {
    /// Lease length.
    pub lease_ticks: u64,
    /// Renewal interval (a fifth of the lease by default, §5.1).
    pub renew_ticks: u64,
}

impl LeaseConfig {
    /// A lease of `lease_ticks` renewed every fifth of it.
    pub fn new(lease_ticks: u64) -> Self {
        assert!(
            lease_ticks >= 5,
            "a lease needs at least 5 ticks to renew 5 times"
        );
        Self {
            lease_ticks,
            renew_ticks: lease_ticks / 5,
        }
    }
}

/// A lease datagram.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LeaseMsg {
    /// Member to CM: grant me a lease.
    Request {
        /// Sender's configuration.
        config: ConfigId,
        /// Handshake sequence number.
        seq: u64,
    },
    /// CM to member: granted, and grant me mine.
    GrantRequest {
        /// Sender's configuration.
        config: ConfigId,
        /// The REQUEST answered.
        seq: u64,
        /// Ticks since the CM last held a lease at every member (0 while it does, `u64::MAX`
        /// before it has held one): the lease granted is that much shorter (see the module
        /// docs).
        lapsed: u64,
    },
    /// Member to CM: granted.
    Grant {
        /// Sender's configuration.
        config: ConfigId,
        /// The GRANT-REQUEST answered.
        seq: u64,
    },
}

/// Encoded size of every lease datagram.
pub const LEASE_MSG_BYTES: usize = 26;
const LEASE_CODEC_VERSION: u8 = 2;

impl LeaseMsg {
    /// The fixed-size encoding.
    pub fn encode(&self) -> [u8; LEASE_MSG_BYTES] {
        let (kind, config, seq, lapsed) = match *self {
            LeaseMsg::Request { config, seq } => (1u8, config, seq, 0),
            LeaseMsg::GrantRequest {
                config,
                seq,
                lapsed,
            } => (2, config, seq, lapsed),
            LeaseMsg::Grant { config, seq } => (3, config, seq, 0),
        };
        let mut out = [0u8; LEASE_MSG_BYTES];
        out[0] = LEASE_CODEC_VERSION;
        out[1] = kind;
        out[2..10].copy_from_slice(&config.0.to_le_bytes());
        out[10..18].copy_from_slice(&seq.to_le_bytes());
        out[18..26].copy_from_slice(&lapsed.to_le_bytes());
        out
    }

    /// Decodes a datagram; `None` for anything that is not a lease message of this version
    /// (datagrams are unauthenticated input: they are dropped, never trusted).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != LEASE_MSG_BYTES || bytes[0] != LEASE_CODEC_VERSION {
            return None;
        }
        let config = ConfigId(u64::from_le_bytes(bytes[2..10].try_into().ok()?));
        let seq = u64::from_le_bytes(bytes[10..18].try_into().ok()?);
        let lapsed = u64::from_le_bytes(bytes[18..26].try_into().ok()?);
        match (bytes[1], lapsed) {
            (1, 0) => Some(LeaseMsg::Request { config, seq }),
            (2, lapsed) => Some(LeaseMsg::GrantRequest {
                config,
                seq,
                lapsed,
            }),
            (3, 0) => Some(LeaseMsg::Grant { config, seq }),
            _ => None,
        }
    }

    fn config(&self) -> ConfigId {
        match *self {
            LeaseMsg::Request { config, .. }
            | LeaseMsg::GrantRequest { config, .. }
            | LeaseMsg::Grant { config, .. } => config,
        }
    }
}

/// Something the lease protocol noticed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LeaseEvent {
    /// The lease granted to this machine ran out: it is suspected to have failed.
    Suspect(MachineId),
}

/// The CM's side of one member.
#[derive(Clone, Copy, Debug)]
struct MemberState {
    /// The member's lease at the CM ends here (CM's clock).
    member_expires: u64,
    /// The CM's lease at the member, as the CM conservatively sees it.
    cm_expires: Option<u64>,
    /// The last GRANT-REQUEST sent: (seq, sent at).
    pending: Option<(u64, u64)>,
    suspected: bool,
}

/// The CM's leases with every member.
#[derive(Debug)]
pub struct CmLeases {
    config: ConfigId,
    /// The configuration this CM's session began in: older datagrams are ignored.
    since: ConfigId,
    timing: LeaseConfig,
    members: BTreeMap<MachineId, MemberState>,
}

impl CmLeases {
    /// Leases with `members` (the CM itself excluded) of configuration `config`, starting at
    /// `now`: every member gets one lease period to make its first request.
    pub fn new(config: ConfigId, timing: LeaseConfig, members: &[MachineId], now: u64) -> Self {
        let state = MemberState {
            member_expires: now + timing.lease_ticks,
            cm_expires: None,
            pending: None,
            suspected: false,
        };
        Self {
            config,
            since: config,
            timing,
            members: members.iter().map(|m| (*m, state)).collect(),
        }
    }

    /// Moves to a newer configuration with the same CM: members that stay keep their leases,
    /// new members get one lease period to make their first request, removed ones are
    /// forgotten. A member this CM suspected that the configuration keeps starts afresh.
    pub fn reconfigure(&mut self, config: ConfigId, members: &[MachineId], now: u64) {
        assert!(config >= self.config, "configurations only move forward");
        let fresh = MemberState {
            member_expires: now + self.timing.lease_ticks,
            cm_expires: None,
            pending: None,
            suspected: false,
        };
        let mut old = std::mem::take(&mut self.members);
        self.members = members
            .iter()
            .map(|m| match old.remove(m) {
                Some(s) if !s.suspected => (*m, s),
                Some(s) => (
                    *m,
                    MemberState {
                        cm_expires: s.cm_expires,
                        ..fresh
                    },
                ),
                None => (*m, fresh),
            })
            .collect();
        self.config = config;
    }

    /// Handles a datagram from `from`, pushing replies into `out`.
    pub fn on_datagram(
        &mut self,
        from: MachineId,
        msg: LeaseMsg,
        now: u64,
        out: &mut Vec<(MachineId, LeaseMsg)>,
    ) {
        if msg.config() < self.since {
            return;
        }
        let Some(m) = self.members.get_mut(&from) else {
            return;
        };
        match msg {
            LeaseMsg::Request { seq, .. } => {
                if m.suspected {
                    return; // Too late: reconfiguration will remove it.
                }
                m.member_expires = m.member_expires.max(now + self.timing.lease_ticks);
                m.pending = Some((seq, now));
                let lapsed = self.lapsed(now);
                out.push((
                    from,
                    LeaseMsg::GrantRequest {
                        config: self.config,
                        seq,
                        lapsed,
                    },
                ));
            }
            LeaseMsg::Grant { seq, .. } => {
                if let Some((p, sent)) = m.pending {
                    if p == seq {
                        let until = sent + self.timing.lease_ticks;
                        m.cm_expires = Some(m.cm_expires.map_or(until, |e| e.max(until)));
                    }
                }
            }
            LeaseMsg::GrantRequest { .. } => {}
        }
    }

    /// Advances time: members whose lease ran out are suspected (once each).
    pub fn tick(&mut self, now: u64, events: &mut Vec<LeaseEvent>) {
        for (id, m) in self.members.iter_mut() {
            if !m.suspected && now > m.member_expires {
                m.suspected = true;
                events.push(LeaseEvent::Suspect(*id));
            }
        }
    }

    /// Changes the lease length from now on. Expiries already computed stay (they only ever
    /// move later), so a shorter lease takes effect once the longer ones granted before end.
    pub fn set_timing(&mut self, timing: LeaseConfig) {
        self.timing = timing;
    }

    /// Takes the requests of the members this CM suspects again (its plane could not remove
    /// them: `farm_cm::Effect::ForgiveMember`): each gets one lease period from `now` to
    /// renew, and is suspected again if it does not.
    pub fn forgive_suspects(&mut self, now: u64) {
        for m in self.members.values_mut().filter(|m| m.suspected) {
            m.suspected = false;
            m.member_expires = m.member_expires.max(now + self.timing.lease_ticks);
        }
    }

    /// This CM's lease manager did not run for `ticks` past its round (its thread was not
    /// scheduled): the leases it granted are extended by as much, as if its clock had stopped.
    /// A machine that stalls cannot tell a silent peer from its own silence, and every peer's
    /// renewals were due while it could not answer them. Suspecting later is always safe
    /// (reconfiguration waits out the leases it knows of, and they only grow); the leases
    /// this CM *holds* do not move, so it never believes itself covered longer.
    pub fn stalled(&mut self, ticks: u64) {
        for m in self.members.values_mut() {
            m.member_expires += ticks;
        }
    }

    /// When `member`'s lease at the CM ends (CM's clock).
    pub fn member_expires(&self, member: MachineId) -> Option<u64> {
        self.members.get(&member).map(|m| m.member_expires)
    }

    /// When the newest lease the CM holds at any member ends, if it holds one: past it, a CM
    /// that was removed knows it is no longer anyone's CM.
    pub fn cm_lease_expires(&self) -> Option<u64> {
        self.members.values().filter_map(|m| m.cm_expires).max()
    }

    /// Until when the CM holds a lease at every member (`u64::MAX` without members; 0 while a
    /// member has granted none yet): any member whose grant ran out may drive the
    /// configuration that removes the CM (§5.2 step 1).
    pub fn every_lease_until(&self) -> u64 {
        self.members
            .values()
            .map(|m| m.cm_expires.unwrap_or(0))
            .min()
            .unwrap_or(u64::MAX)
    }

    /// How long ago, at `now`, this CM last held a lease at every member (`u64::MAX` while a
    /// member has granted none): what a grant is shortened by (see the module docs). Not
    /// capped at this CM's lease: the member's may be longer (a lease length changing).
    fn lapsed(&self, now: u64) -> u64 {
        self.members
            .values()
            .map(|m| m.cm_expires.map_or(u64::MAX, |e| now.saturating_sub(e)))
            .max()
            .unwrap_or(0)
    }

    /// Whether the CM holds a valid lease at `member` at `now`.
    pub fn holds_lease_at(&self, member: MachineId, now: u64) -> bool {
        self.members
            .get(&member)
            .and_then(|m| m.cm_expires)
            .is_some_and(|e| now <= e)
    }
}

/// Pending REQUESTs a member remembers (the oldest is forgotten first).
const PENDING_MAX: usize = 8;

/// A member's lease at the CM and the CM's lease at it.
#[derive(Debug)]
pub struct MemberLease {
    config: ConfigId,
    /// The configuration this session with the CM began in: older datagrams are ignored.
    since: ConfigId,
    timing: LeaseConfig,
    cm: MachineId,
    next_seq: u64,
    last_request: Option<u64>,
    /// REQUESTs in flight: (seq, sent at); fixed capacity.
    pending: [(u64, u64); PENDING_MAX],
    /// This member's lease at the CM ends here (member's clock), once granted.
    lease_expires: Option<u64>,
    /// The lease this member granted the CM ends here.
    cm_expires: u64,
    cm_suspected: bool,
}

impl MemberLease {
    /// A member of configuration `config` whose CM is `cm`, starting at `now`: the CM gets one
    /// lease period to answer before it is suspected.
    pub fn new(config: ConfigId, timing: LeaseConfig, cm: MachineId, now: u64) -> Self {
        Self {
            config,
            since: config,
            timing,
            cm,
            next_seq: 0,
            last_request: None,
            pending: [(0, 0); PENDING_MAX],
            lease_expires: None,
            cm_expires: now + timing.lease_ticks,
            cm_suspected: false,
        }
    }

    /// Advances time: sends a REQUEST every renewal interval and suspects the CM when the lease
    /// granted to it ran out.
    pub fn tick(
        &mut self,
        now: u64,
        out: &mut Vec<(MachineId, LeaseMsg)>,
        events: &mut Vec<LeaseEvent>,
    ) {
        if self
            .last_request
            .is_none_or(|t| now >= t + self.timing.renew_ticks)
        {
            self.next_seq += 1;
            let seq = self.next_seq;
            self.pending[(seq as usize) % PENDING_MAX] = (seq, now);
            self.last_request = Some(now);
            out.push((
                self.cm,
                LeaseMsg::Request {
                    config: self.config,
                    seq,
                },
            ));
        }
        if !self.cm_suspected && now > self.cm_expires {
            self.cm_suspected = true;
            events.push(LeaseEvent::Suspect(self.cm));
        }
    }

    /// Handles a datagram from `from`, pushing replies into `out`.
    pub fn on_datagram(
        &mut self,
        from: MachineId,
        msg: LeaseMsg,
        now: u64,
        out: &mut Vec<(MachineId, LeaseMsg)>,
    ) {
        if from != self.cm || msg.config() < self.since || self.cm_suspected {
            return;
        }
        if let LeaseMsg::GrantRequest { seq, lapsed, .. } = msg {
            let (p, sent) = self.pending[(seq as usize) % PENDING_MAX];
            if p != seq || seq == 0 {
                return; // Forgotten or forged: no grant.
            }
            // Shorter by as long as the CM has not held every member's grant: it ends no later
            // than one lease after the CM's own leases did (the module docs).
            let granted = self.timing.lease_ticks.saturating_sub(lapsed);
            if granted > 0 {
                let until = sent + granted;
                self.lease_expires = Some(self.lease_expires.map_or(until, |e| e.max(until)));
            }
            self.cm_expires = self.cm_expires.max(now + self.timing.lease_ticks);
            out.push((
                from,
                LeaseMsg::Grant {
                    config: self.config,
                    seq,
                },
            ));
        }
    }

    /// Whether this member's lease at the CM is valid at `now`.
    pub fn lease_valid(&self, now: u64) -> bool {
        self.lease_expires.is_some_and(|e| now <= e)
    }

    /// When this member's lease at the CM ends, once granted: past it, a member that was
    /// removed from the configuration knows it is out.
    pub fn lease_expires(&self) -> Option<u64> {
        self.lease_expires
    }

    /// When the lease this member granted the CM ends.
    pub fn cm_expires(&self) -> u64 {
        self.cm_expires
    }

    /// This member's lease manager did not run for `ticks` past its round: the lease it granted
    /// the CM is extended by as much; its own lease at the CM does not move. See
    /// [`CmLeases::stalled`].
    pub fn stalled(&mut self, ticks: u64) {
        self.cm_expires += ticks;
    }

    /// Changes the lease length from now on; see [`CmLeases::set_timing`].
    pub fn set_timing(&mut self, timing: LeaseConfig) {
        self.timing = timing;
    }

    /// The CM this session is with.
    pub fn cm(&self) -> MachineId {
        self.cm
    }

    /// Moves to a newer configuration with the same CM (see [`MemberLease::cm`]): the leases
    /// carry over. If this member had suspected the CM, which the configuration keeps, the CM
    /// gets one lease period again.
    pub fn reconfigure(&mut self, config: ConfigId, now: u64) {
        assert!(config >= self.config, "configurations only move forward");
        self.config = config;
        self.forgive(now);
    }

    /// Renews with the CM again if it was suspected (its removal failed: see
    /// `farm_cm::Effect::ForgiveCm`): it gets one lease period from `now`, and its grants
    /// are taken again.
    pub fn forgive(&mut self, now: u64) {
        if self.cm_suspected {
            self.cm_suspected = false;
            self.cm_expires = self.cm_expires.max(now + self.timing.lease_ticks);
        }
    }
}

/// One machine's side of the lease protocol in the configuration it has installed: the CM's
/// leases with every member, a member's lease with its CM, or none outside the configuration.
/// It follows the machine's own configuration ([`LeaseRole::follow`]): leases carry over a new
/// configuration with the same CM and start afresh with a new CM (§5.2). Every deployment's
/// lease manager, and the simulator's, runs one per machine.
#[derive(Debug)]
pub enum LeaseRole {
    /// This machine is the CM.
    Cm(CmLeases),
    /// This machine is a member; the lease is with its CM.
    Member(MemberLease),
    /// Outside the configuration: no lease to keep.
    Out,
}

impl LeaseRole {
    /// The role of `me` in `config`, its leases starting at `now`.
    pub fn new(me: MachineId, config: &Configuration, timing: LeaseConfig, now: u64) -> Self {
        if !config.contains(me) {
            LeaseRole::Out
        } else if me == config.cm {
            LeaseRole::Cm(CmLeases::new(
                config.id,
                timing,
                &config.leaseholders(),
                now,
            ))
        } else {
            LeaseRole::Member(MemberLease::new(config.id, timing, config.cm, now))
        }
    }

    /// Moves to `config`, which `me` installed at `now`: the leases carry over if the CM is the
    /// same, else fresh ones start.
    pub fn follow(&mut self, me: MachineId, config: &Configuration, timing: LeaseConfig, now: u64) {
        match self {
            LeaseRole::Cm(c) if config.cm == me => {
                c.reconfigure(config.id, &config.leaseholders(), now)
            }
            LeaseRole::Member(l) if config.contains(me) && config.cm == l.cm() && me != l.cm() => {
                l.reconfigure(config.id, now)
            }
            _ => *self = Self::new(me, config, timing, now),
        }
    }

    /// A member renews with the CM it suspected and could not remove ([`MemberLease::forgive`]).
    pub fn forgive_cm(&mut self, now: u64) {
        if let LeaseRole::Member(m) = self {
            m.forgive(now);
        }
    }

    /// A CM takes the requests of the members it suspected and could not remove again
    /// ([`CmLeases::forgive_suspects`]).
    pub fn forgive_members(&mut self, now: u64) {
        if let LeaseRole::Cm(c) = self {
            c.forgive_suspects(now);
        }
    }

    /// Until when this machine may tell an application what it read (FaRM §5.1): while the
    /// leases it holds may not have run out at the machines that could remove it. A member,
    /// while its lease at the CM holds (it runs from the REQUEST's sending, so it ends here no
    /// later than at the CM); the CM, while every member's grant holds (a member whose grant
    /// ran out may drive the configuration that removes the CM). A configuration's removed
    /// machines are dropped only after their leases surely ended (§5.2 step 7), so a machine
    /// that reads and then finds `now` within this bound read what was current. Outside the
    /// configuration: never (0).
    pub fn serves_until(&self) -> u64 {
        match self {
            LeaseRole::Cm(c) => c.every_lease_until(),
            LeaseRole::Member(m) => m.lease_expires().unwrap_or(0),
            LeaseRole::Out => 0,
        }
    }

    /// This machine's lease manager was not scheduled for `ticks` past a round: credited to
    /// the leases it granted, never to those it holds (see [`CmLeases::stalled`]).
    pub fn stalled(&mut self, ticks: u64) {
        match self {
            LeaseRole::Cm(c) => c.stalled(ticks),
            LeaseRole::Member(m) => m.stalled(ticks),
            LeaseRole::Out => {}
        }
    }

    /// A new lease length from now on (expiries already computed stay).
    pub fn set_timing(&mut self, timing: LeaseConfig) {
        match self {
            LeaseRole::Cm(c) => c.set_timing(timing),
            LeaseRole::Member(m) => m.set_timing(timing),
            LeaseRole::Out => {}
        }
    }

    /// A lease datagram from `from`; answers go to `out`.
    pub fn on_datagram(
        &mut self,
        from: MachineId,
        msg: LeaseMsg,
        now: u64,
        out: &mut Vec<(MachineId, LeaseMsg)>,
    ) {
        match self {
            LeaseRole::Cm(c) => c.on_datagram(from, msg, now, out),
            LeaseRole::Member(m) => m.on_datagram(from, msg, now, out),
            LeaseRole::Out => {}
        }
    }

    /// Advances time: renewals go to `out`, suspicions to `events`.
    pub fn tick(
        &mut self,
        now: u64,
        out: &mut Vec<(MachineId, LeaseMsg)>,
        events: &mut Vec<LeaseEvent>,
    ) {
        match self {
            LeaseRole::Cm(c) => c.tick(now, events),
            LeaseRole::Member(m) => m.tick(now, out, events),
            LeaseRole::Out => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_dropped() {
        for m in [
            LeaseMsg::Request {
                config: ConfigId(3),
                seq: 9,
            },
            LeaseMsg::GrantRequest {
                config: ConfigId(3),
                seq: 9,
                lapsed: 17,
            },
            LeaseMsg::Grant {
                config: ConfigId(u64::MAX),
                seq: 0,
            },
        ] {
            assert_eq!(LeaseMsg::decode(&m.encode()), Some(m));
        }
        let mut bad = LeaseMsg::Grant {
            config: ConfigId(1),
            seq: 1,
        }
        .encode();
        bad[1] = 9;
        assert_eq!(LeaseMsg::decode(&bad), None);
        assert_eq!(LeaseMsg::decode(&bad[..5]), None);
        bad[0] = 2;
        assert_eq!(LeaseMsg::decode(&bad), None);
    }

    /// §5.1: the 3-way handshake grants both leases, measured conservatively from send times.
    /// The first grant of a session is empty: the CM holds no lease at its member yet.
    #[test]
    fn three_way_handshake_grants_both_leases() {
        let t = LeaseConfig::new(100);
        let (cm, m) = (MachineId(0), MachineId(1));
        let mut c = CmLeases::new(ConfigId(1), t, &[m], 0);
        let mut l = MemberLease::new(ConfigId(1), t, cm, 0);
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        l.tick(5, &mut out, &mut ev);
        let [(to, req)] = out[..] else {
            panic!("{out:?}")
        };
        assert_eq!(to, cm);
        out.clear();
        c.on_datagram(m, req, 7, &mut out);
        let [(to, grant_req)] = out[..] else {
            panic!("{out:?}")
        };
        assert_eq!(to, m);
        assert_eq!(c.member_expires(m), Some(107));
        out.clear();
        l.on_datagram(cm, grant_req, 9, &mut out);
        assert!(!l.lease_valid(9), "granted before the CM held a lease");
        assert_eq!(l.cm_expires(), 109);
        let [(_, grant)] = out[..] else {
            panic!("{out:?}")
        };
        c.on_datagram(m, grant, 11, &mut out);
        assert!(
            c.holds_lease_at(m, 107) && !c.holds_lease_at(m, 108),
            "CM lease runs from its GRANT-REQUEST"
        );
        // Renewed: now a whole lease, from the REQUEST.
        out.clear();
        l.tick(25, &mut out, &mut ev);
        let (_, req) = out.pop().unwrap();
        c.on_datagram(m, req, 27, &mut out);
        let (_, grant_req) = out.pop().unwrap();
        l.on_datagram(cm, grant_req, 29, &mut out);
        assert!(
            l.lease_valid(125) && !l.lease_valid(126),
            "member lease runs from its REQUEST"
        );
        assert!(ev.is_empty());
        // A configuration older than the session: ignored.
        out.clear();
        c.on_datagram(
            m,
            LeaseMsg::Request {
                config: ConfigId(0),
                seq: 5,
            },
            12,
            &mut out,
        );
        assert!(out.is_empty());
    }

    /// A CM grants no lease past one lease after its own leases at its members ended: cut off
    /// from member b (which may then remove it), its grants to member a shrink by as long as
    /// its lease at b has lapsed, and are empty a lease later, so that a, removed together with
    /// the CM, stops serving one lease after b could suspect the CM.
    #[test]
    fn a_cm_that_lost_a_members_grant_grants_shorter_leases() {
        let t = LeaseConfig::new(100);
        let (cm, a, b) = (MachineId(0), MachineId(1), MachineId(2));
        let mut c = CmLeases::new(ConfigId(1), t, &[a, b], 0);
        let mut la = MemberLease::new(ConfigId(1), t, cm, 0);
        let mut lb = MemberLease::new(ConfigId(1), t, cm, 0);
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        // One handshake of each member at `at`, every datagram arriving at once.
        let mut handshake = |l: &mut MemberLease, m: MachineId, c: &mut CmLeases, at: u64| {
            l.tick(at, &mut out, &mut ev);
            let (_, req) = out.pop().unwrap();
            c.on_datagram(m, req, at, &mut out);
            let (_, grant_req) = out.pop().unwrap();
            l.on_datagram(cm, grant_req, at, &mut out);
            let (_, grant) = out.pop().unwrap();
            c.on_datagram(m, grant, at, &mut out);
        };
        for at in [0, 20] {
            handshake(&mut la, a, &mut c, at);
            handshake(&mut lb, b, &mut c, at);
        }
        assert_eq!(la.lease_expires(), Some(120));
        assert_eq!(c.every_lease_until(), 120);
        // b is cut off from 20: the CM's lease at b ends at 120, where b may suspect it.
        for at in [40, 60, 80, 100, 120] {
            handshake(&mut la, a, &mut c, at);
            assert_eq!(
                la.lease_expires(),
                Some(at + 100),
                "a whole lease while covered"
            );
        }
        handshake(&mut la, a, &mut c, 150);
        assert_eq!(
            la.lease_expires(),
            Some(220),
            "kept from before, not extended: 150 + 100 - 30"
        );
        for at in [170, 200, 220, 300] {
            handshake(&mut la, a, &mut c, at);
        }
        assert_eq!(
            la.lease_expires(),
            Some(220),
            "a's lease ends one lease after the CM's at b"
        );
        assert!(!la.lease_valid(221));
        assert!(ev.is_empty(), "a and the CM still renew: {ev:?}");
    }

    /// A lease manager that was not scheduled credits its stall to the leases it granted,
    /// never to those it holds: after a stall as long as the lease, neither side suspects the
    /// other, each still knows exactly when its own lease ends, and a peer that stays silent
    /// after the stall is suspected one lease later.
    #[test]
    fn a_stall_delays_suspicion_but_never_extends_a_held_lease() {
        let t = LeaseConfig::new(100);
        let (cm, m) = (MachineId(0), MachineId(1));
        let mut c = CmLeases::new(ConfigId(1), t, &[m], 0);
        let mut l = MemberLease::new(ConfigId(1), t, cm, 0);
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        // Two handshakes (the first grants the member nothing: the CM held no lease yet).
        for at in [0, 20] {
            l.tick(at, &mut out, &mut ev);
            let req = out.pop().unwrap().1;
            c.on_datagram(m, req, at, &mut out);
            let grant_req = out.pop().unwrap().1;
            l.on_datagram(cm, grant_req, at, &mut out);
            let grant = out.pop().unwrap().1;
            c.on_datagram(m, grant, at, &mut out);
        }
        // Both stall from 20 to 170.
        c.stalled(150);
        l.stalled(150);
        c.tick(170, &mut ev);
        l.tick(170, &mut out, &mut ev);
        assert!(ev.is_empty(), "a stall alone made a suspicion: {ev:?}");
        assert_eq!(l.lease_expires(), Some(120), "a held lease moved");
        assert!(!c.holds_lease_at(m, 121), "a held lease moved");
        // The member is dead from here: suspected once the credited lease ends.
        out.clear();
        c.tick(270, &mut ev);
        assert!(ev.is_empty());
        c.tick(271, &mut ev);
        assert_eq!(ev, vec![LeaseEvent::Suspect(m)]);
        // Without the credit the CM would have suspected at 170.
        let mut uncredited = CmLeases::new(ConfigId(1), t, &[m], 20);
        let mut ev = Vec::new();
        uncredited.tick(170, &mut ev);
        assert_eq!(ev, vec![LeaseEvent::Suspect(m)]);
    }

    /// A CM whose plane could not remove a suspected member (a configuration of two) forgives
    /// it: the member's requests are granted again, and it is suspected again only if it stays
    /// silent for a lease after the forgiveness.
    #[test]
    fn a_cm_forgives_a_suspected_member_and_renews_with_it() {
        let t = LeaseConfig::new(100);
        let m = MachineId(1);
        let mut c = CmLeases::new(ConfigId(1), t, &[m], 0);
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        c.tick(101, &mut ev);
        assert_eq!(ev, vec![LeaseEvent::Suspect(m)]);
        let req = LeaseMsg::Request {
            config: ConfigId(1),
            seq: 1,
        };
        c.on_datagram(m, req, 110, &mut out);
        assert!(out.is_empty(), "a suspected member's request granted");
        c.forgive_suspects(120);
        c.on_datagram(m, req, 130, &mut out);
        assert_eq!(out.len(), 1, "the forgiven member's request not granted");
        assert_eq!(c.member_expires(m), Some(230));
        ev.clear();
        c.tick(230, &mut ev);
        assert!(ev.is_empty());
        c.tick(231, &mut ev);
        assert_eq!(ev, vec![LeaseEvent::Suspect(m)]);
    }

    /// Delivers everything in `out` between one CM and its members (no loss, no delay).
    fn deliver(
        cm: &mut CmLeases,
        members: &mut [(MachineId, MemberLease)],
        cm_id: MachineId,
        mut out: Vec<(MachineId, MachineId, LeaseMsg)>,
        now: u64,
    ) {
        while let Some((from, to, msg)) = out.pop() {
            let mut replies = Vec::new();
            if to == cm_id {
                cm.on_datagram(from, msg, now, &mut replies);
                out.extend(replies.into_iter().map(|(t, m)| (cm_id, t, m)));
            } else if let Some((id, l)) = members.iter_mut().find(|(id, _)| *id == to) {
                l.on_datagram(from, msg, now, &mut replies);
                let id = *id;
                out.extend(replies.into_iter().map(|(t, m)| (id, t, m)));
            }
        }
    }

    /// §5.2: a configuration change resets the lease protocol only if the CM changed. Machines
    /// install a configuration one after another; a member that installs it one and a half
    /// leases after its CM keeps its leases meanwhile (with fresh leases at every configuration
    /// it suspected the CM), and a new member gets a lease period.
    /// Issue 16 case 3: a machine serves what it reads only while the leases that keep it a
    /// member may not have run out where it could be removed. A member until its own lease at
    /// the CM ends (a stall does not move it); the CM until the first member's grant ends.
    #[test]
    fn a_machine_serves_only_while_the_leases_keeping_it_a_member_hold() {
        let t = LeaseConfig::new(100);
        let (cm_id, a, b) = (MachineId(0), MachineId(1), MachineId(2));
        let config = Configuration::initial(3);
        let mut cm = LeaseRole::new(cm_id, &config, t, 0);
        let mut la = LeaseRole::new(a, &config, t, 0);
        let mut lb = LeaseRole::new(b, &config, t, 0);
        assert_eq!(
            [cm.serves_until(), la.serves_until(), lb.serves_until()],
            [0; 3],
            "nothing served before the first grants"
        );
        // a and b request at 10 and 20, and again at 30 and 40; the CM grants and asks 2 ticks
        // later; they grant 2 ticks after that.
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        for (m, l, at) in [(a, &mut la, 10), (b, &mut lb, 20)] {
            l.tick(at, &mut out, &mut ev);
            let (_, req) = out.pop().unwrap();
            cm.on_datagram(m, req, at + 2, &mut out);
            let (_, grant_req) = out.pop().unwrap();
            l.on_datagram(cm_id, grant_req, at + 4, &mut out);
            if m == a {
                assert_eq!(cm.serves_until(), 0, "b has not granted the CM a lease yet");
            }
            let (_, grant) = out.pop().unwrap();
            cm.on_datagram(m, grant, at + 4, &mut out);
        }
        assert_eq!(
            (la.serves_until(), lb.serves_until()),
            (0, 0),
            "granted before the CM held a lease at every member: empty"
        );
        for (m, l, at) in [(a, &mut la, 30), (b, &mut lb, 40)] {
            l.tick(at, &mut out, &mut ev);
            let (_, req) = out.pop().unwrap();
            cm.on_datagram(m, req, at + 2, &mut out);
            let (_, grant_req) = out.pop().unwrap();
            l.on_datagram(cm_id, grant_req, at + 4, &mut out);
            let (_, grant) = out.pop().unwrap();
            cm.on_datagram(m, grant, at + 4, &mut out);
        }
        assert_eq!(la.serves_until(), 130, "a's lease runs from its request");
        assert_eq!(lb.serves_until(), 140);
        assert_eq!(
            cm.serves_until(),
            132,
            "the CM's lease at a, from its GRANT-REQUEST, ends first"
        );
        la.stalled(500);
        cm.stalled(500);
        assert_eq!(
            (la.serves_until(), cm.serves_until()),
            (130, 132),
            "a stall moved a held lease"
        );
        let alone = Configuration::initial(1);
        assert_eq!(LeaseRole::new(cm_id, &alone, t, 0).serves_until(), u64::MAX);
        let out_of = LeaseRole::new(MachineId(5), &config, t, 0);
        assert_eq!(out_of.serves_until(), 0);
    }

    #[test]
    fn a_configuration_with_the_same_cm_carries_the_leases_over() {
        let t = LeaseConfig::new(100);
        let cm_id = MachineId(0);
        let (a, b, new) = (MachineId(1), MachineId(2), MachineId(3));
        let mut cm = CmLeases::new(ConfigId(1), t, &[a, b], 0);
        let mut members: Vec<(MachineId, MemberLease)> = [a, b]
            .iter()
            .map(|m| (*m, MemberLease::new(ConfigId(1), t, cm_id, 0)))
            .collect();
        let mut ev = Vec::new();
        for now in 1..=1_000u64 {
            // The CM installs configuration 2 (b removed, a newcomer) at 300; a at 450; the
            // newcomer starts its session at 380, within the lease period it was given.
            if now == 300 {
                cm.reconfigure(ConfigId(2), &[a, new], now);
                members.retain(|(m, _)| *m != b);
            }
            if now == 450 {
                members[0].1.reconfigure(ConfigId(2), now);
            }
            if now == 380 {
                members.push((new, MemberLease::new(ConfigId(2), t, cm_id, now)));
            }
            let mut out = Vec::new();
            for (id, l) in members.iter_mut() {
                let mut o = Vec::new();
                l.tick(now, &mut o, &mut ev);
                out.extend(o.into_iter().map(|(to, m)| (*id, to, m)));
            }
            cm.tick(now, &mut ev);
            deliver(&mut cm, &mut members, cm_id, out, now);
        }
        assert!(ev.is_empty(), "suspicions {ev:?}");
        assert_eq!(
            cm.member_expires(b),
            None,
            "the removed member is forgotten"
        );
        for (id, l) in &members {
            assert!(l.lease_valid(1_000), "{id} holds no lease");
            assert!(
                cm.holds_lease_at(*id, 1_000),
                "the CM holds no lease at {id}"
            );
        }
    }

    /// A shorter lease takes effect once the longer ones granted before end: a member that
    /// dies just after the change is suspected when its long lease runs out, not earlier, and
    /// one that dies later within the short lease.
    #[test]
    fn a_shorter_lease_takes_effect_once_the_longer_ones_end() {
        let (cm_id, m) = (MachineId(0), MachineId(1));
        let run = |dies_at: u64| -> u64 {
            let long = LeaseConfig::new(100);
            let mut cm = CmLeases::new(ConfigId(1), long, &[m], 0);
            let mut members = vec![(m, MemberLease::new(ConfigId(1), long, cm_id, 0))];
            let mut ev = Vec::new();
            for now in 1..=2_000u64 {
                if now == 50 {
                    let short = LeaseConfig::new(10);
                    cm.set_timing(short);
                    members[0].1.set_timing(short);
                }
                let mut out = Vec::new();
                if now < dies_at {
                    let mut o = Vec::new();
                    members[0].1.tick(now, &mut o, &mut ev);
                    out.extend(o.into_iter().map(|(to, msg)| (m, to, msg)));
                }
                cm.tick(now, &mut ev);
                if let Some(LeaseEvent::Suspect(x)) = ev.first() {
                    assert_eq!(*x, m);
                    return now;
                }
                deliver(&mut cm, &mut members, cm_id, out, now);
            }
            panic!("the dead member was never suspected");
        };
        // Dies at 51: its last request under the long lease (sent at 40) holds it until 140.
        let early = run(51);
        assert!((140..=150).contains(&early), "suspected at {early}");
        // Dies at 500: renewed every 2 ticks under the short lease.
        let late = run(500);
        assert!((500..=511).contains(&late), "suspected at {late}");
    }

    /// A new CM starts a new session: datagrams of configurations before it are ignored.
    #[test]
    fn a_new_session_ignores_datagrams_from_before_it() {
        let t = LeaseConfig::new(100);
        let (old_cm, new_cm, m) = (MachineId(0), MachineId(1), MachineId(2));
        let mut l = MemberLease::new(ConfigId(3), t, new_cm, 0);
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        l.tick(1, &mut out, &mut ev);
        let [(_, LeaseMsg::Request { seq, .. })] = out[..] else {
            panic!("{out:?}")
        };
        out.clear();
        for (from, config) in [(new_cm, ConfigId(2)), (old_cm, ConfigId(3))] {
            let grant = LeaseMsg::GrantRequest {
                config,
                seq,
                lapsed: 0,
            };
            l.on_datagram(from, grant, 2, &mut out);
        }
        assert!(out.is_empty() && !l.lease_valid(2), "{out:?}");
        let mut c = CmLeases::new(ConfigId(3), t, &[m], 0);
        c.on_datagram(
            m,
            LeaseMsg::Request {
                config: ConfigId(2),
                seq,
            },
            2,
            &mut out,
        );
        assert!(out.is_empty());
        c.on_datagram(
            m,
            LeaseMsg::Request {
                config: ConfigId(4),
                seq,
            },
            2,
            &mut out,
        );
        assert_eq!(out.len(), 1, "a member ahead of the CM is answered");
    }

    /// A machine's role follows its configuration (§5.2): the same CM carries a member's
    /// granted lease over, a new CM starts a fresh one, and a machine left out holds none.
    #[test]
    fn a_lease_role_follows_its_configuration() {
        let timing = LeaseConfig::new(100);
        let me = MachineId(1);
        let mut config = Configuration::initial(3);
        let mut role = LeaseRole::new(me, &config, timing, 0);
        let mut out = Vec::new();
        let mut events = Vec::new();
        role.tick(0, &mut out, &mut events);
        let Some((cm, LeaseMsg::Request { seq, .. })) = out.pop() else {
            panic!("no REQUEST: {out:?}")
        };
        assert_eq!(cm, MachineId(0));
        let grant = LeaseMsg::GrantRequest {
            config: config.id,
            seq,
            lapsed: 0,
        };
        role.on_datagram(cm, grant, 1, &mut out);
        let valid = |r: &LeaseRole, now| matches!(r, LeaseRole::Member(l) if l.lease_valid(now));
        assert!(valid(&role, 50));
        config.id = ConfigId(2);
        config.members.retain(|m| m.0 != 2);
        role.follow(me, &config, timing, 10);
        assert!(valid(&role, 50), "the same CM: the lease carried over");
        config.id = ConfigId(3);
        config.cm = me;
        config.members.retain(|m| m.0 != 0);
        role.follow(me, &config, timing, 20);
        assert!(matches!(role, LeaseRole::Cm(_)), "{role:?}");
        config.id = ConfigId(4);
        config.cm = MachineId(3);
        config.members = vec![MachineId(3)];
        role.follow(me, &config, timing, 30);
        assert!(matches!(role, LeaseRole::Out));
    }

    /// A member that suspected its CM takes none of its grants, so a CM that came back (from a
    /// pause) is not renewed with, and the member's own lease at it runs out for good; when
    /// the member's plane finds it cannot remove the CM (`Effect::ForgiveCm`), it forgives it:
    /// the CM's grants are taken again, and the CM gets a lease period before it is suspected
    /// again.
    #[test]
    fn a_member_forgives_a_suspected_cm_and_renews_with_it() {
        let t = LeaseConfig::new(100);
        let (cm, m) = (MachineId(0), MachineId(1));
        let mut c = CmLeases::new(ConfigId(1), t, &[m], 0);
        let mut l = MemberLease::new(ConfigId(1), t, cm, 0);
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        // The CM is silent past the lease granted to it: suspected.
        l.tick(150, &mut out, &mut ev);
        assert_eq!(ev, vec![LeaseEvent::Suspect(cm)]);
        // It comes back: its grant is ignored while suspected.
        let renew = |l: &mut MemberLease, c: &mut CmLeases, now: u64| {
            let (mut out, mut ev) = (Vec::new(), Vec::new());
            l.tick(now, &mut out, &mut ev);
            let mut grants = Vec::new();
            for (_, req) in out {
                c.on_datagram(m, req, now, &mut grants);
            }
            let mut acks = Vec::new();
            for (_, g) in grants {
                l.on_datagram(cm, g, now, &mut acks);
            }
            for (_, a) in &acks {
                c.on_datagram(m, *a, now, &mut Vec::new());
            }
            !acks.is_empty()
        };
        assert!(!renew(&mut l, &mut c, 300));
        assert!(!l.lease_valid(300));
        // Forgiven: renewed with it again (the first grant empty: the CM held no lease).
        l.forgive(310);
        assert!(renew(&mut l, &mut c, 400));
        assert!(renew(&mut l, &mut c, 420));
        assert!(l.lease_valid(450));
        assert_eq!(l.cm_expires(), 520);
        // And suspected again once the CM is silent past that.
        ev.clear();
        l.tick(521, &mut out, &mut ev);
        assert_eq!(ev, vec![LeaseEvent::Suspect(cm)]);
    }
}
