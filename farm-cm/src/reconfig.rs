//! Reconfiguration (FaRM §5.2, steps 2 to 7) as a deterministic state machine at the machine
//! that drives it: the CM, or a backup CM when the CM is suspected.
//!
//! 1. *Suspect* (the caller, on lease expiry) starts a [`Reconfig`] with the suspects.
//! 2. *Probe*: one-sided reads of every other member; a failed probe adds a suspect; go on only
//!    with answers from a majority of the configuration, so a minority partition cannot
//!    reconfigure. A probe's answer is the set of regions whose replica the member holds
//!    complete (data recovery of a new backup's copy finished, §5.4): only those may be
//!    promoted in step 4. A member may answer that it cannot write to the driver
//!    ([`ProbeAnswer::CannotWriteToProber`]): the CM removes it, and a machine taking over
//!    stands down.
//! 3. *Update configuration*: compare-and-set `<c+1, S', F', CM'>` in the coordination store at
//!    the version of `c`; losing the race ends this attempt.
//! 4. *Remap regions* ([`crate::remap`]).
//! 5. *Send NEW-CONFIG* to every member of `S'`.
//! 6. *Collect NEW-CONFIG-ACK* from all of them.
//! 7. *Commit*: once every removed machine's lease has surely expired, NEW-CONFIG-COMMIT.
//!
//! The machine does no I/O: it emits [`Effect`]s and is told their results (`on_probe`,
//! `on_store`, `on_ack`) and the time (`tick`).

use std::collections::{BTreeMap, BTreeSet};

use farm_core::config::{Configuration, RegionMap};
use farm_core::{ConfigId, MachineId, RegionId};

use crate::codec;
use crate::remap::{remap, RegionChanges, RemapError};
use crate::store::{CasOutcome, StoreError, StoreVersion};

/// What NEW-CONFIG carries (§5.2 step 5).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct NewConfig {
    /// The new configuration.
    pub config: Configuration,
    /// The remapped regions.
    pub map: RegionMap,
    /// LastPrimaryChange and LastReplicaChange per region.
    pub changes: BTreeMap<RegionId, RegionChanges>,
}

/// Something the driver must do for the state machine.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Effect {
    /// A one-sided read of `MachineId`'s complete replicas; report with [`Reconfig::on_probe`].
    Probe(MachineId),
    /// Compare-and-set in the coordination store; report with [`Reconfig::on_store`].
    CompareAndSet {
        /// Version of the configuration being replaced.
        expected: StoreVersion,
        /// The encoded new configuration.
        data: Vec<u8>,
    },
    /// Send NEW-CONFIG.
    SendNewConfig(MachineId, NewConfig),
    /// Send NEW-CONFIG-COMMIT for the configuration.
    SendCommit(MachineId, ConfigId),
}

/// What a probe (step 2) learned of a member.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum ProbeAnswer {
    /// The regions whose replica the member holds complete.
    Complete(BTreeSet<RegionId>),
    /// The member says it cannot write to the driver: a link into the driver broke (its
    /// writes across a partition or a cut stalled or failed) and stays so while both are
    /// members. A probe reads the member's memory, which shows only that the driver reaches
    /// it, not that it reaches the driver.
    CannotWriteToProber,
    /// The read failed.
    NoAnswer,
}

/// Why a reconfiguration attempt ended without a new configuration.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum ReconfigError {
    /// Fewer than a majority of the configuration answered the probes.
    #[error("only {answered} of {members} machines answered the probes; a majority is needed")]
    NoMajority {
        /// Machines that answered (this one included).
        answered: usize,
        /// Members of the old configuration.
        members: usize,
    },
    /// A member cannot write to this machine, which is not the configuration's CM: it stands
    /// down rather than take over and remove the member (see [`Reconfig::on_probe`]).
    #[error("{0} cannot write to this machine, which does not take over as CM")]
    CannotBeWrittenBy(MachineId),
    /// Another machine changed the configuration first.
    #[error("lost the race for configuration {}: another machine changed it first", .0.0)]
    LostRace(ConfigId),
    /// A region lost every replica.
    #[error(transparent)]
    Remap(#[from] RemapError),
    /// The store failed; the outcome of the compare-and-set is unknown (read it again).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Members of the new configuration did not acknowledge it in time (they failed after the
    /// probes): a later attempt removes them.
    #[error("configuration {} was not acknowledged by {missing:?}", config.0)]
    NotAcknowledged {
        /// The configuration stored.
        config: ConfigId,
        /// Members that did not acknowledge it.
        missing: Vec<MachineId>,
    },
}

/// Parameters of reconfiguration.
#[derive(Clone, Copy, Debug)]
pub struct ReconfigParams {
    /// Replicas per region (`f + 1`).
    pub replicas: usize,
    /// Most region replicas one machine may hold.
    pub regions_max: usize,
    /// Ticks to wait for probe answers; unanswered probes count as failures.
    pub probe_timeout_ticks: u64,
    /// Lease length: a machine removed for failing a probe (rather than for an expired lease)
    /// may hold its lease this much longer, and the commit waits for that (step 7).
    pub lease_ticks: u64,
}

#[derive(Clone, Debug)]
enum Phase {
    Probing {
        awaiting: BTreeSet<MachineId>,
        answered: BTreeSet<MachineId>,
        deadline: u64,
    },
    Storing(NewConfig),
    Acking {
        new: NewConfig,
        awaiting: BTreeSet<MachineId>,
        /// Set at the first tick: acknowledgements missing then give up the attempt.
        deadline: Option<u64>,
    },
    Done(Result<NewConfig, ReconfigError>),
}

/// One reconfiguration attempt. See the module docs.
#[derive(Debug)]
pub struct Reconfig {
    me: MachineId,
    old: Configuration,
    old_version: StoreVersion,
    map: RegionMap,
    changes: BTreeMap<RegionId, RegionChanges>,
    suspects: BTreeSet<MachineId>,
    params: ReconfigParams,
    /// No removed machine holds a lease after this tick.
    leases_end: u64,
    /// Ticks the commit waits after the last NEW-CONFIG-ACK (see [`Reconfig::hold_after_acks`]).
    hold_after_acks: u64,
    /// How long the commit waits after the last NEW-CONFIG-ACK if a member's probe failed (see
    /// [`Reconfig::hold_after_acks_if_a_probe_fails`]), and whether one did.
    hold_if_a_probe_fails: u64,
    member_probe_failed: bool,
    /// Machines asking to join, with their failure domains.
    joiners: BTreeMap<MachineId, u32>,
    /// Per answering member, the regions it holds in `map` whose replica is not complete yet.
    copying: BTreeMap<MachineId, BTreeSet<RegionId>>,
    phase: Phase,
    effects: Vec<Effect>,
}

impl Reconfig {
    /// Starts reconfiguring `old` (stored at `old_version`) without `suspects`, driven by `me`,
    /// which is still copying its replicas of the regions `copying`. `leases_end` is when every
    /// lease the suspects could hold has expired (step 7); machines that fail probes extend it
    /// by a lease.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        me: MachineId,
        old: Configuration,
        old_version: StoreVersion,
        map: RegionMap,
        changes: BTreeMap<RegionId, RegionChanges>,
        copying: BTreeSet<RegionId>,
        suspects: BTreeSet<MachineId>,
        params: ReconfigParams,
        leases_end: u64,
        now: u64,
    ) -> Self {
        assert!(
            old.contains(me),
            "{me} drives reconfiguration of a configuration it is not in"
        );
        assert!(!suspects.contains(&me), "{me} suspects itself");
        let awaiting: BTreeSet<MachineId> = old
            .members
            .iter()
            .copied()
            .filter(|m| *m != me && !suspects.contains(m))
            .collect();
        let effects = awaiting.iter().map(|m| Effect::Probe(*m)).collect();
        let mut r = Self {
            me,
            old,
            old_version,
            map,
            changes,
            suspects,
            params,
            leases_end,
            hold_after_acks: 0,
            hold_if_a_probe_fails: 0,
            member_probe_failed: false,
            joiners: BTreeMap::new(),
            copying: BTreeMap::from([(me, copying)]),
            phase: Phase::Probing {
                awaiting,
                answered: BTreeSet::from([me]),
                deadline: now + params.probe_timeout_ticks,
            },
            effects,
        };
        r.after_probe();
        r
    }

    /// Starts a reconfiguration that adds `joiners` (with their failure domains) to `old`: a
    /// machine joins a running cluster (§5.2) through the same steps, probed like the members;
    /// a joiner that does not answer is left out, and the majority counts old members only.
    #[allow(clippy::too_many_arguments)]
    pub fn start_join(
        me: MachineId,
        old: Configuration,
        old_version: StoreVersion,
        map: RegionMap,
        changes: BTreeMap<RegionId, RegionChanges>,
        copying: BTreeSet<RegionId>,
        joiners: BTreeMap<MachineId, u32>,
        params: ReconfigParams,
        now: u64,
    ) -> Self {
        assert!(
            joiners.keys().all(|j| !old.contains(*j)),
            "a joiner is already a member"
        );
        let mut r = Self::start(
            me,
            old,
            old_version,
            map,
            changes,
            copying,
            BTreeSet::new(),
            params,
            now,
            now,
        );
        if let Phase::Probing { awaiting, .. } = &mut r.phase {
            awaiting.extend(joiners.keys().copied());
            r.effects.extend(joiners.keys().map(|j| Effect::Probe(*j)));
            r.phase = Phase::Probing {
                awaiting: awaiting.clone(),
                answered: BTreeSet::from([me]),
                deadline: now + params.probe_timeout_ticks,
            };
        }
        r.joiners = joiners;
        r
    }

    /// Makes the commit wait `ticks` after the last NEW-CONFIG-ACK: for removed machines whose
    /// leases a member of the old configuration may renew until it installs the new one (every
    /// member has installed it once all acked). A CM renews the members it removes for broken
    /// links until then (a lease, and a round of its lease thread); and a CM removed over a
    /// broken link holds its leases at the members until they install, and may renew those of
    /// the members cut off with it for a lease after (two).
    pub fn hold_after_acks(&mut self, ticks: u64) {
        self.hold_after_acks = ticks;
    }

    /// Makes the commit wait at least `ticks` after the last NEW-CONFIG-ACK once a member's
    /// probe fails or times out: a CM renews every member it has not suspected, one whose
    /// probe failed among them (its memory out of reach while its lease requests still
    /// arrive), until it installs the configuration without it, which may be long after the
    /// probe (a store slow to answer).
    pub fn hold_after_acks_if_a_probe_fails(&mut self, ticks: u64) {
        self.hold_if_a_probe_fails = ticks;
    }

    /// `m`'s probe failed or timed out: it is removed, and leases it may hold are waited out
    /// (step 7), renewed until the install if it is a member.
    fn probe_failed(&mut self, m: MachineId, now: u64) {
        self.suspects.insert(m);
        self.leases_end = self.leases_end.max(now + self.params.lease_ticks);
        self.member_probe_failed |= self.old.contains(m);
    }

    /// Effects to carry out, in order.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// The outcome, once there is one.
    pub fn outcome(&self) -> Option<&Result<NewConfig, ReconfigError>> {
        match &self.phase {
            Phase::Done(r) => Some(r),
            _ => None,
        }
    }

    /// The result of probing `m`, learned at `now`. A region of `map` that `m` holds and does
    /// not name complete is one it is still copying (or has not installed yet).
    ///
    /// A member that cannot write to the driver is removed when the driver is the
    /// configuration's CM (a CM never removes itself for its own links, `plane::CmState`), and
    /// ends the attempt otherwise: of the two ends of the link, the machine taking over is the
    /// one cut off from the others as often as not, and a CM its members cannot write to could
    /// not run recovery with them. Before, it removed them with its suspect. Machine 1 of seven,
    /// cut off alone, took over once the partition healed (the CM's removals of it had failed
    /// on store timeouts) and removed the CM and machines 2 and 3, whose writes into it had
    /// stalled across the cut: four machines gone for a partition of one, and the crash that
    /// followed took the last complete replica of two regions (simulator seed 280943 of the
    /// partitions).
    pub fn on_probe(&mut self, m: MachineId, answer: ProbeAnswer, now: u64) {
        if let Phase::Probing {
            awaiting, answered, ..
        } = &mut self.phase
        {
            if awaiting.remove(&m) {
                match answer {
                    ProbeAnswer::Complete(complete) => {
                        answered.insert(m);
                        let copying: BTreeSet<RegionId> = self
                            .map
                            .iter()
                            .filter(|(r, p)| p.holds(m) && !complete.contains(r))
                            .map(|(r, _)| r)
                            .collect();
                        self.copying.insert(m, copying);
                    }
                    // A joiner that does not answer, or cannot write here, simply does not join.
                    _ if self.joiners.remove(&m).is_some() => {}
                    ProbeAnswer::CannotWriteToProber if self.old.cm != self.me => {
                        self.phase = Phase::Done(Err(ReconfigError::CannotBeWrittenBy(m)));
                        return;
                    }
                    ProbeAnswer::CannotWriteToProber | ProbeAnswer::NoAnswer => {
                        self.probe_failed(m, now)
                    }
                }
            }
        }
        self.after_probe();
    }

    /// Advances time: unanswered probes time out; the commit waits for old leases to expire.
    pub fn tick(&mut self, now: u64) {
        let timed_out = match &mut self.phase {
            Phase::Probing {
                awaiting, deadline, ..
            } if now >= *deadline => std::mem::take(awaiting),
            _ => BTreeSet::new(),
        };
        for m in timed_out {
            // A joiner that does not answer simply does not join.
            if self.joiners.remove(&m).is_none() {
                self.probe_failed(m, now);
            }
        }
        self.after_probe();
        if let Phase::Acking {
            new,
            awaiting,
            deadline,
        } = &mut self.phase
        {
            let at = *deadline.get_or_insert(now + self.params.probe_timeout_ticks);
            if now >= at && !awaiting.is_empty() {
                self.phase = Phase::Done(Err(ReconfigError::NotAcknowledged {
                    config: new.config.id,
                    missing: awaiting.iter().copied().collect(),
                }));
                return;
            }
        }
        self.try_commit(now);
    }

    fn after_probe(&mut self) {
        let Phase::Probing {
            awaiting, answered, ..
        } = &self.phase
        else {
            return;
        };
        if !awaiting.is_empty() {
            return;
        }
        let members = self.old.members.len();
        let old_answered = answered.iter().filter(|m| self.old.contains(**m)).count();
        if old_answered * 2 <= members {
            self.phase = Phase::Done(Err(ReconfigError::NoMajority {
                answered: old_answered,
                members,
            }));
            return;
        }
        let survivors: Vec<MachineId> = answered.iter().copied().collect();
        let config = Configuration {
            id: ConfigId(self.old.id.0 + 1),
            failure_domains: self
                .old
                .failure_domains
                .iter()
                .chain(&self.joiners)
                .filter(|(m, _)| survivors.contains(m))
                .map(|(m, d)| (*m, *d))
                .collect(),
            members: survivors,
            // "In all cases, the machine initiating the reconfiguration will try to become the
            // new CM" (§5.2 step 1): its NEW-CONFIG is what members accept (from their CM). A
            // machine driving over a stored configuration whose CM lives is one of them.
            cm: self.me,
        };
        // §5.2 precise membership: a suspect or a machine that failed its probe is not in the
        // new configuration; the driver is (it answered its own probe).
        assert!(
            config.members.iter().all(|m| !self.suspects.contains(m)),
            "a suspect kept in configuration {}",
            config.id.0
        );
        assert!(
            config.contains(self.me),
            "the driver left its own configuration"
        );
        assert!(
            config.members.windows(2).all(|w| w[0] < w[1]),
            "members unsorted"
        );
        match remap(
            &self.map,
            &self.changes,
            &config,
            &self.copying,
            self.params.replicas,
            self.params.regions_max,
        ) {
            Err(e) => self.phase = Phase::Done(Err(e.into())),
            Ok(r) => {
                self.effects.push(Effect::CompareAndSet {
                    expected: self.old_version,
                    data: codec::encode(&config),
                });
                self.phase = Phase::Storing(NewConfig {
                    config,
                    map: r.map,
                    changes: r.changes,
                });
            }
        }
    }

    /// The result of the compare-and-set.
    pub fn on_store(&mut self, result: Result<CasOutcome, StoreError>) {
        let Phase::Storing(new) = &self.phase else {
            return;
        };
        let new = new.clone();
        self.phase = match result {
            Ok(CasOutcome::Written(_)) => {
                let awaiting: BTreeSet<MachineId> = new.config.members.iter().copied().collect();
                self.effects.extend(
                    awaiting
                        .iter()
                        .map(|m| Effect::SendNewConfig(*m, new.clone())),
                );
                Phase::Acking {
                    new,
                    awaiting,
                    deadline: None,
                }
            }
            Ok(CasOutcome::Conflict) => Phase::Done(Err(ReconfigError::LostRace(new.config.id))),
            Err(e) => Phase::Done(Err(e.into())),
        };
    }

    /// NEW-CONFIG-ACK from `from` for configuration `config`.
    pub fn on_ack(&mut self, from: MachineId, config: ConfigId, now: u64) {
        if let Phase::Acking { new, awaiting, .. } = &mut self.phase {
            if config == new.config.id {
                assert!(
                    new.config.contains(from),
                    "NEW-CONFIG-ACK from {from}, outside configuration {}",
                    config.0
                );
                if awaiting.remove(&from) && awaiting.is_empty() {
                    let hold = match self.member_probe_failed {
                        true => self.hold_after_acks.max(self.hold_if_a_probe_fails),
                        false => self.hold_after_acks,
                    };
                    self.leases_end = self.leases_end.max(now + hold);
                }
            }
        }
        self.try_commit(now);
    }

    fn try_commit(&mut self, now: u64) {
        let Phase::Acking { new, awaiting, .. } = &self.phase else {
            return;
        };
        // Step 7: a removed machine may still act until its lease runs out; wait for that.
        if !awaiting.is_empty() || now <= self.leases_end {
            return;
        }
        let new = new.clone();
        // §5.2 step 7 (§5.1: a removed machine stops once its lease expires): the commit
        // follows every member's ack and the end of every lease a removed machine held.
        assert!(
            awaiting.is_empty() && now > self.leases_end,
            "NEW-CONFIG-COMMIT too early"
        );
        self.effects.extend(
            new.config
                .members
                .iter()
                .map(|m| Effect::SendCommit(*m, new.config.id)),
        );
        self.phase = Phase::Done(Ok(new));
    }

    /// The tick after which no machine this attempt removes holds a lease (step 7).
    pub fn leases_end(&self) -> u64 {
        self.leases_end
    }

    /// Members whose NEW-CONFIG-ACK the attempt still waits for (none before the store write).
    pub fn awaiting_acks(&self) -> Option<&BTreeSet<MachineId>> {
        match &self.phase {
            Phase::Acking { awaiting, .. } => Some(awaiting),
            _ => None,
        }
    }

    /// The machines this attempt removes (suspects and failed probes).
    pub fn suspects(&self) -> &BTreeSet<MachineId> {
        &self.suspects
    }
}

/// The configuration a reconfiguration attempt starts from: the newest view's (`view`), or the
/// one the store holds (`stored`) when that is newer. An attempt may store a configuration and
/// fail before any live member installs it; the next one starts from the view before (its map
/// and changes: the store keeps only the configuration), but with the stored membership, which
/// machines may have acted on (one removed learns it from its lease and stops), and after the
/// stored id, never storing another configuration with the same id (machines that installed
/// the first one keep it in NVRAM).
pub fn attempt_base(view: &Configuration, stored: &Configuration) -> Configuration {
    if stored.id > view.id {
        stored.clone()
    } else {
        view.clone()
    }
}

/// The `k` backup CMs of `config`: the CM's successors on a consistent-hashing ring of the
/// members (§5.2). They take over reconfiguration when the CM is suspected.
pub fn backup_cms(config: &Configuration, k: usize) -> Vec<MachineId> {
    let ring = hash_ring(config);
    let at = ring
        .iter()
        .position(|(_, m)| *m == config.cm)
        .expect("the CM is a member");
    (1..ring.len())
        .map(|i| ring[(at + i) % ring.len()].1)
        .take(k)
        .collect()
}

/// The consistent-hashing ring of `config`'s members: (point, machine), sorted by point. Every
/// machine computes the same ring from the same configuration.
pub fn hash_ring(config: &Configuration) -> Vec<(u64, MachineId)> {
    let point = |m: MachineId| farm_core::rng::Rng::new(0xc0de ^ m.0 as u64).next_u64();
    let mut ring: Vec<(u64, MachineId)> = config.members.iter().map(|m| (point(*m), *m)).collect();
    ring.sort();
    ring
}

/// The member that owns `key` on the ring: the first clockwise from it.
pub fn ring_owner(config: &Configuration, key: u64) -> MachineId {
    let ring = hash_ring(config);
    ring.iter()
        .find(|(p, _)| *p >= key)
        .or(ring.first())
        .expect("a configuration has members")
        .1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{CoordinationStore, EmbeddedStore};

    const PARAMS: ReconfigParams = ReconfigParams {
        replicas: 3,
        regions_max: 16,
        probe_timeout_ticks: 10,
        lease_ticks: 20,
    };

    /// A probe's answer: every replica complete (the test maps have fewer than 64 regions), or
    /// a failed read.
    fn answer(ok: bool) -> ProbeAnswer {
        match ok {
            true => ProbeAnswer::Complete((0..64).map(RegionId).collect()),
            false => ProbeAnswer::NoAnswer,
        }
    }

    fn setup(n: u16) -> (Configuration, RegionMap, EmbeddedStore, StoreVersion) {
        let config = Configuration::initial(n);
        let store = EmbeddedStore::new();
        let CasOutcome::Written(v) = store
            .compare_and_set(None, &codec::encode(&config))
            .unwrap()
        else {
            unreachable!()
        };
        (config, RegionMap::striped(n, 1, 2), store, v)
    }

    /// Carries out effects against `store`; probes answer `ok` unless the target is in `dead`.
    fn drive(r: &mut Reconfig, store: &EmbeddedStore, dead: &[u16], now: u64) -> Vec<Effect> {
        let mut sent = Vec::new();
        for _ in 0..10 {
            let effects = r.take_effects();
            if effects.is_empty() {
                break;
            }
            for e in effects {
                match &e {
                    Effect::Probe(m) => r.on_probe(*m, answer(!dead.contains(&m.0)), now),
                    Effect::CompareAndSet { expected, data } => {
                        r.on_store(store.compare_and_set(Some(*expected), data))
                    }
                    Effect::SendNewConfig(m, n) => r.on_ack(*m, n.config.id, now),
                    Effect::SendCommit(..) => {}
                }
                sent.push(e);
            }
        }
        sent
    }

    /// §5.2: a suspected machine is removed, its regions remapped, the new configuration stored,
    /// acknowledged by every member, and committed only after the removed machine's lease.
    #[test]
    fn removes_a_suspect_and_commits_after_its_lease() {
        let (config, map, store, v) = setup(4);
        let mut r = Reconfig::start(
            MachineId(0),
            config,
            v,
            map,
            BTreeMap::new(),
            BTreeSet::new(),
            BTreeSet::from([MachineId(3)]),
            PARAMS,
            100,
            0,
        );
        let sent = drive(&mut r, &store, &[3], 50);
        assert!(
            r.outcome().is_none(),
            "must not commit before the removed machine's lease ends"
        );
        assert!(!sent.iter().any(|e| matches!(e, Effect::SendCommit(..))));
        let new_configs = sent
            .iter()
            .filter(|e| matches!(e, Effect::SendNewConfig(..)))
            .count();
        assert_eq!(new_configs, 3);
        r.tick(101);
        let commits: Vec<_> = r.take_effects();
        assert_eq!(commits.len(), 3);
        let new = r.outcome().unwrap().as_ref().unwrap();
        assert_eq!(new.config.id, ConfigId(2));
        assert_eq!(
            new.config.members,
            vec![MachineId(0), MachineId(1), MachineId(2)]
        );
        assert_eq!(new.config.cm, MachineId(0));
        assert!(new.map.iter().all(|(_, p)| !p.holds(MachineId(3))));
        let (_, stored) = store.read().unwrap().unwrap();
        assert_eq!(codec::decode(&stored).unwrap(), new.config);
    }

    /// A removal whose machines a member may renew until it installs the new configuration
    /// commits only `hold_after_acks` after the last acknowledgement, past every earlier lease.
    #[test]
    fn a_hold_after_the_acks_delays_the_commit() {
        let (config, map, store, v) = setup(4);
        let mut r = Reconfig::start(
            MachineId(0),
            config,
            v,
            map,
            BTreeMap::new(),
            BTreeSet::new(),
            BTreeSet::from([MachineId(3)]),
            PARAMS,
            0,
            0,
        );
        r.hold_after_acks(45);
        drive(&mut r, &store, &[3], 50);
        r.tick(95);
        assert!(r.outcome().is_none(), "committed within the hold");
        r.tick(96);
        assert!(matches!(r.outcome(), Some(Ok(_))), "{:?}", r.outcome());
    }

    /// A member whose probe fails or times out is renewed by the CM until it installs the
    /// configuration without it: the commit waits `hold_after_acks_if_a_probe_fails` after the
    /// last acknowledgement. When every member answers it does not.
    #[test]
    fn a_failed_probe_holds_the_commit_after_the_acks() {
        for case in ["answers", "fails", "times out"] {
            let (config, map, store, v) = setup(5);
            let mut r = Reconfig::start(
                MachineId(0),
                config,
                v,
                map,
                BTreeMap::new(),
                BTreeSet::new(),
                BTreeSet::from([MachineId(4)]),
                PARAMS,
                0,
                0,
            );
            r.hold_after_acks_if_a_probe_fails(45);
            for e in r.take_effects() {
                match e {
                    Effect::Probe(MachineId(3)) if case == "fails" => {
                        r.on_probe(MachineId(3), ProbeAnswer::NoAnswer, 1)
                    }
                    Effect::Probe(MachineId(3)) if case == "times out" => {}
                    Effect::Probe(m) => r.on_probe(m, answer(true), 1),
                    e => panic!("{e:?} before the probes"),
                }
            }
            // The probe deadline (10 ticks), then stored and acknowledged at 50.
            r.tick(PARAMS.probe_timeout_ticks);
            drive(&mut r, &store, &[], 50);
            r.tick(51);
            if case == "answers" {
                assert!(matches!(r.outcome(), Some(Ok(_))), "{:?}", r.outcome());
                continue;
            }
            r.tick(95);
            assert!(r.outcome().is_none(), "{case}: committed within the hold");
            r.tick(96);
            assert!(
                matches!(r.outcome(), Some(Ok(_))),
                "{case}: {:?}",
                r.outcome()
            );
        }
    }

    /// A member that says it cannot write to the driver is removed when the CM drives, and
    /// makes a machine taking over stand down, storing nothing, where before it removed the
    /// member with its suspect (simulator seed 280943 of the partitions).
    #[test]
    fn a_member_that_cannot_write_to_a_machine_taking_over_makes_it_stand_down() {
        for (driver, suspect) in [(MachineId(0), MachineId(4)), (MachineId(1), MachineId(0))] {
            let (config, map, store, v) = setup(5);
            assert_eq!(config.cm, MachineId(0));
            let mut r = Reconfig::start(
                driver,
                config,
                v,
                map,
                BTreeMap::new(),
                BTreeSet::new(),
                BTreeSet::from([suspect]),
                PARAMS,
                0,
                0,
            );
            for e in r.take_effects() {
                match e {
                    Effect::Probe(MachineId(2)) => {
                        r.on_probe(MachineId(2), ProbeAnswer::CannotWriteToProber, 1)
                    }
                    Effect::Probe(m) => r.on_probe(m, answer(true), 1),
                    e => panic!("{e:?} before the probes"),
                }
            }
            let sent = drive(&mut r, &store, &[], 2);
            r.tick(2 + PARAMS.lease_ticks);
            if driver == MachineId(0) {
                let Some(Ok(new)) = r.outcome() else {
                    panic!("the CM did not remove machine 2: {:?}", r.outcome());
                };
                let kept = [MachineId(0), MachineId(1), MachineId(3)];
                assert_eq!(new.config.members, kept);
            } else {
                assert_eq!(
                    r.outcome(),
                    Some(&Err(ReconfigError::CannotBeWrittenBy(MachineId(2))))
                );
                assert!(sent.is_empty(), "stood down after {sent:?}");
                assert_eq!(
                    store.read().unwrap().unwrap().0,
                    v,
                    "stored a configuration"
                );
            }
        }
    }

    /// A joiner whose probe fails or times out does not join, and nothing waits for it: it
    /// holds no lease.
    #[test]
    fn a_joiner_that_does_not_answer_holds_nothing() {
        for fails in [true, false] {
            let (config, map, store, v) = setup(3);
            let mut r = Reconfig::start_join(
                MachineId(0),
                config,
                v,
                map,
                BTreeMap::new(),
                BTreeSet::new(),
                BTreeMap::from([(MachineId(3), 3)]),
                PARAMS,
                0,
            );
            r.hold_after_acks_if_a_probe_fails(45);
            for e in r.take_effects() {
                match e {
                    Effect::Probe(MachineId(3)) if fails => {
                        r.on_probe(MachineId(3), ProbeAnswer::NoAnswer, 1)
                    }
                    Effect::Probe(MachineId(3)) => {}
                    Effect::Probe(m) => r.on_probe(m, answer(true), 1),
                    e => panic!("{e:?} before the probes"),
                }
            }
            r.tick(PARAMS.probe_timeout_ticks);
            drive(&mut r, &store, &[], 50);
            r.tick(51);
            let Some(Ok(new)) = r.outcome() else {
                panic!("not committed at once: {:?}", r.outcome());
            };
            assert!(!new.config.contains(MachineId(3)));
        }
    }

    /// A member that fails after the probes never acknowledges: the attempt ends with an error
    /// instead of waiting forever, and the next attempt, which starts from the view before (no
    /// live member installed the stored configuration), numbers its configuration after the
    /// stored one rather than reusing its id.
    #[test]
    fn a_member_failing_after_the_probes_ends_the_attempt_and_ids_are_not_reused() {
        let (config, map, store, v) = setup(5);
        let mut r = Reconfig::start(
            MachineId(0),
            config.clone(),
            v,
            map.clone(),
            BTreeMap::new(),
            BTreeSet::new(),
            BTreeSet::from([MachineId(4)]),
            PARAMS,
            0,
            0,
        );
        let mut stored = None;
        for _ in 0..10 {
            for e in r.take_effects() {
                match e {
                    Effect::Probe(m) => r.on_probe(m, answer(true), 1),
                    Effect::CompareAndSet { expected, data } => {
                        let out = store.compare_and_set(Some(expected), &data);
                        if let Ok(CasOutcome::Written(v)) = &out {
                            stored = Some(*v);
                        }
                        r.on_store(out);
                    }
                    // Machine 3 died after answering its probe.
                    Effect::SendNewConfig(m, n) if m != MachineId(3) => r.on_ack(m, n.config.id, 1),
                    _ => {}
                }
            }
        }
        // The first tick in the acknowledging phase starts the wait of one probe timeout.
        r.tick(5);
        r.tick(14);
        assert!(r.outcome().is_none(), "gave up before the deadline");
        r.tick(15);
        match r.outcome() {
            Some(Err(ReconfigError::NotAcknowledged { config, missing })) => {
                assert_eq!(*config, ConfigId(2));
                assert_eq!(missing, &vec![MachineId(3)]);
            }
            other => panic!("{other:?}"),
        }
        let (_, bytes) = store.read().unwrap().unwrap();
        let base = attempt_base(&config, &codec::decode(&bytes).unwrap());
        assert_eq!(base.id, ConfigId(2));
        assert!(!base.contains(MachineId(4)), "the stored membership counts");
        let mut r = Reconfig::start(
            MachineId(0),
            base,
            stored.expect("stored"),
            map,
            BTreeMap::new(),
            BTreeSet::new(),
            BTreeSet::from([MachineId(3)]),
            PARAMS,
            0,
            20,
        );
        drive(&mut r, &store, &[3, 4], 20);
        r.tick(21);
        let new = r.outcome().unwrap().as_ref().unwrap();
        assert_eq!(new.config.id, ConfigId(3));
    }

    #[test]
    fn a_failed_probe_removes_that_machine_too() {
        let (config, map, store, v) = setup(5);
        let mut r = Reconfig::start(
            MachineId(1),
            config,
            v,
            map,
            BTreeMap::new(),
            BTreeSet::new(),
            BTreeSet::from([MachineId(4)]),
            PARAMS,
            0,
            0,
        );
        drive(&mut r, &store, &[3, 4], 10);
        // Machine 3 failed a probe, so it may still hold a lease: the commit waits a lease.
        r.tick(30);
        assert!(
            r.outcome().is_none(),
            "committed while machine 3 could hold a lease"
        );
        r.tick(31);
        let new = r.outcome().unwrap().as_ref().unwrap();
        assert_eq!(
            new.config.members,
            vec![MachineId(0), MachineId(1), MachineId(2)]
        );
    }

    /// A minority partition cannot reconfigure: it never reaches the store.
    #[test]
    fn a_minority_cannot_reconfigure() {
        let (config, map, store, v) = setup(5);
        let mut r = Reconfig::start(
            MachineId(0),
            config,
            v,
            map,
            BTreeMap::new(),
            BTreeSet::new(),
            BTreeSet::from([MachineId(4)]),
            PARAMS,
            0,
            0,
        );
        // Machines 2 and 3 do not answer: a probe timeout.
        let effects = r.take_effects();
        for e in effects {
            if e == Effect::Probe(MachineId(1)) {
                r.on_probe(MachineId(1), answer(true), 0);
            }
        }
        assert!(r.outcome().is_none());
        r.tick(10);
        assert_eq!(
            r.outcome(),
            Some(&Err(ReconfigError::NoMajority {
                answered: 2,
                members: 5
            }))
        );
        assert!(r.take_effects().is_empty(), "nothing stored");
        assert_eq!(store.read().unwrap().unwrap().0, v);
    }

    /// Two machines racing to change the configuration: exactly one wins the compare-and-set.
    #[test]
    fn racing_reconfigurations_have_one_winner() {
        let (config, map, store, v) = setup(4);
        let suspects = BTreeSet::from([MachineId(3)]);
        let mut a = Reconfig::start(
            MachineId(0),
            config.clone(),
            v,
            map.clone(),
            BTreeMap::new(),
            BTreeSet::new(),
            suspects.clone(),
            PARAMS,
            0,
            0,
        );
        let mut b = Reconfig::start(
            MachineId(1),
            config,
            v,
            map,
            BTreeMap::new(),
            BTreeSet::new(),
            suspects,
            PARAMS,
            0,
            0,
        );
        for r in [&mut a, &mut b] {
            for e in r.take_effects() {
                if let Effect::Probe(m) = e {
                    r.on_probe(m, answer(m != MachineId(3)), 0);
                }
            }
        }
        let (ea, eb) = (a.take_effects(), b.take_effects());
        let store_of = |es: &[Effect]| match &es[0] {
            Effect::CompareAndSet { expected, data } => (*expected, data.clone()),
            e => panic!("{e:?}"),
        };
        let (va, da) = store_of(&ea);
        let (vb, db) = store_of(&eb);
        a.on_store(store.compare_and_set(Some(va), &da));
        b.on_store(store.compare_and_set(Some(vb), &db));
        assert!(matches!(a.take_effects()[0], Effect::SendNewConfig(..)));
        assert_eq!(
            b.outcome(),
            Some(&Err(ReconfigError::LostRace(ConfigId(2))))
        );
    }

    /// A backup CM that reconfigures after the CM died becomes the CM.
    #[test]
    fn a_backup_cm_replaces_a_dead_cm() {
        let (config, map, store, v) = setup(4);
        let backup = backup_cms(&config, 2)[0];
        let mut r = Reconfig::start(
            backup,
            config,
            v,
            map,
            BTreeMap::new(),
            BTreeSet::new(),
            BTreeSet::from([MachineId(0)]),
            PARAMS,
            0,
            0,
        );
        drive(&mut r, &store, &[0], 5);
        r.tick(6);
        let new = r.outcome().unwrap().as_ref().unwrap();
        assert_eq!(new.config.cm, backup);
        assert!(!new.config.contains(MachineId(0)));
    }

    #[test]
    fn losing_every_replica_of_a_region_ends_the_attempt_with_an_error() {
        let config = Configuration::initial(5);
        let map = RegionMap::striped(5, 1, 1); // region 1 on machines 1 and 2
        let mut r = Reconfig::start(
            MachineId(0),
            config,
            StoreVersion(0),
            map,
            BTreeMap::new(),
            BTreeSet::new(),
            BTreeSet::from([MachineId(1), MachineId(2)]),
            PARAMS,
            0,
            0,
        );
        r.on_probe(MachineId(3), answer(true), 0);
        r.on_probe(MachineId(4), answer(true), 0);
        assert_eq!(
            r.outcome(),
            Some(&Err(ReconfigError::Remap(RemapError::RegionsLost(vec![
                RegionId(1)
            ]))))
        );
    }

    /// A machine joins a running cluster through the same steps; its regions are unchanged
    /// until regions are allocated on it.
    #[test]
    fn a_machine_joins() {
        let (mut config, map, store, v) = setup(4);
        config.members.retain(|m| m.0 < 3);
        config.failure_domains.remove(&MachineId(3));
        let map3 = RegionMap::striped(3, 1, 2);
        let _ = map;
        let joiners = BTreeMap::from([(MachineId(3), 3)]);
        let mut r = Reconfig::start_join(
            MachineId(0),
            config,
            v,
            map3.clone(),
            BTreeMap::new(),
            BTreeSet::new(),
            joiners,
            PARAMS,
            0,
        );
        drive(&mut r, &store, &[], 1);
        r.tick(2);
        let new = r.outcome().unwrap().as_ref().unwrap();
        assert_eq!(
            new.config.members,
            vec![MachineId(0), MachineId(1), MachineId(2), MachineId(3)]
        );
        assert_eq!(new.config.failure_domains[&MachineId(3)], 3);
        assert_eq!(new.map, map3, "joining moves no region");
        assert!(new.changes.values().all(|c| *c == RegionChanges::default()));
    }

    #[test]
    fn backup_cms_are_distinct_successors_excluding_the_cm() {
        let mut c = Configuration::initial(8);
        for cm in 0..8 {
            c.cm = MachineId(cm);
            let b = backup_cms(&c, 3);
            assert_eq!(b.len(), 3);
            assert!(!b.contains(&c.cm));
            let distinct: BTreeSet<_> = b.iter().collect();
            assert_eq!(distinct.len(), 3);
            assert_eq!(b, backup_cms(&c, 3), "deterministic");
        }
        assert_eq!(backup_cms(&Configuration::initial(2), 5).len(), 1);
    }
}
