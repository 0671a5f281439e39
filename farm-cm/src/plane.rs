//! The control plane of one machine (FaRM §5.2-5.4) as a deterministic state machine: the
//! member side (install NEW-CONFIG and acknowledge it, commit NEW-CONFIG-COMMIT, report
//! REGIONS-ACTIVE until ALL-REGIONS-ACTIVE, learn from the coordination store that it was
//! removed, ask to join) and the driver side (the CM's bookkeeping, and reconfiguration
//! attempts with [`Reconfig`]: suspicions in, effects out). Every deployment runs one per
//! machine, the simulator included; they talk with [`ControlMsg`] datagrams, which may be lost
//! or repeated, so every message is idempotent and repeated until answered.
//!
//! It reads no clock and does no I/O: time comes as `now` (ticks), what the machine has
//! installed comes as [`Local`] with every call, and what must be done leaves as [`Effect`]s
//! ([`ControlPlane::take_effects`]), whose results come back through `on_probe`,
//! `on_store_read` and `on_cas`. Messages a machine sends itself (the driver's NEW-CONFIG to
//! its own machine, the member's ack to itself as CM) never leave the plane.
//!
//! # Who reconfigures (§5.2 step 1)
//!
//! - The CM removes the members it suspects (their leases expired at the CM, or it cannot write
//!   to them, or a member reported it cannot); a failed attempt is retried two leases later.
//! - A member that suspects the CM (the CM's lease expired, or its link to the CM broke) waits
//!   its turn in the consistent-hashing order of backup CMs ([`backup_cms`]): the first backup
//!   at once, the `i`-th after `i` takeover periods ([`TAKEOVER_LEASES`] leases each), every
//!   member being in the line. It then tries itself, if the configuration is still the one
//!   whose CM it suspects. So losing the CM and its first backup together still reconfigures
//!   while a majority lives, and a machine on the CM's side of a partition (which suspects
//!   nobody) is passed by.
//! - A member whose CM fell silent reads the store, again with a growing interval, for as long
//!   as its configuration stays: a newer configuration without it means it was removed
//!   (nobody sends NEW-CONFIG to a removed machine), and [`Effect::Evicted`] says so.
//! - The CM adds one joiner at a time, once its configuration is settled (every region active:
//!   recovery of the joiner's earlier life is over), backing off from joiners whose join failed.
//!
//! # Region allocation (§3)
//!
//! A member asks its CM for regions ([`ControlPlane::allocate`], repeated until answered). The
//! CM serves one request at a time, once its configuration is settled: it places the regions
//! and sends PREPARE to their replicas ([`Preparing`]); once all prepared, it commits the map
//! with the new regions as a configuration change with the same members (stored, NEW-CONFIG,
//! every member's ack, NEW-CONFIG-COMMIT), and answers. A refusal, a silent replica or a failed
//! attempt ends the request with ABORT to the replicas and the reason to the member. A request
//! the CM dropped (it stopped being CM) is asked again of the next one.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use farm_core::codec::StoredView;
use farm_core::config::{Configuration, RegionChanges, RegionMap};
use farm_core::{ConfigId, MachineId, RegionId};

use crate::control::ControlMsg;
use crate::placement::{AllocRequest, Preparing, ALLOCATION_REGIONS_MAX};
use crate::reconfig::{
    attempt_base, backup_cms, Effect as ReconfigEffect, NewConfig, ProbeAnswer, Reconfig,
    ReconfigError, ReconfigParams,
};
use crate::remap::RemapError;
use crate::store::{CasOutcome, StoreError, StoreVersion};

/// Leases between the turns of consecutive machines in the line of backup CMs, and between a
/// failed attempt and the next one.
pub const TAKEOVER_LEASES: u64 = 2;

/// Leases that probes and NEW-CONFIG-ACKs are waited for (at least; a deployment may add a
/// floor): a member acknowledges once its control loop ran and it persisted the view (and, for
/// a view that adds machines, every worker started afresh with them). A member silent that
/// long is removed by the next attempt.
pub const ACK_TIMEOUT_LEASES: u64 = 10;

/// How many times longer a machine outside the configuration waits between requests to join
/// than unanswered messages are repeated.
const JOIN_REPEATS: u64 = 10;

/// The longest interval between two reads of the store by a member whose CM fell silent, in
/// leases (at least; see [`ControlPlane::tick`]).
const SILENT_CHECK_LEASES_MAX: u64 = 10;

/// The first wait before another attempt to add a machine whose join failed, in leases; it
/// doubles with every failure up to [`JOIN_BACKOFF_LEASES_MAX`].
const JOIN_BACKOFF_LEASES: u64 = 5;

/// The longest wait before another attempt to add a machine whose join failed, in leases.
const JOIN_BACKOFF_LEASES_MAX: u64 = 300;

/// Joiners the CM remembers at most (further requests are dropped until one joined).
pub const JOINERS_MAX: usize = 64;

/// Allocation requests the CM queues at most (further ones are dropped; members ask again),
/// and requests a member may have outstanding.
pub const ALLOCATIONS_MAX: usize = 64;

/// Answers to allocation requests the CM remembers, for members that ask again because an
/// answer was lost.
pub const ANSWERS_MAX: usize = 64;

/// Timing and sizing of a control plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlaneParams {
    /// Replicas per region (`f + 1`).
    pub replicas: usize,
    /// Most region replicas one machine may hold.
    pub regions_max: usize,
    /// Machine ids are below this (a join from another id is dropped).
    pub machines_max: u16,
    /// The lease length in force.
    pub lease_ticks: u64,
    /// The longest lease length ever in force: a machine removed for a failed probe may hold a
    /// lease granted under it, and the commit waits that out (§5.2 step 7).
    pub lease_longest_ticks: u64,
    /// How long probes and NEW-CONFIG-ACKs are waited for (a member's ack needs its control
    /// loop and the installation of the view).
    pub ack_timeout_ticks: u64,
    /// How often unanswered messages are repeated.
    pub repeat_ticks: u64,
}

impl PlaneParams {
    fn reconfig(&self) -> ReconfigParams {
        ReconfigParams {
            replicas: self.replicas,
            regions_max: self.regions_max,
            probe_timeout_ticks: self.ack_timeout_ticks,
            lease_ticks: self.lease_longest_ticks,
        }
    }

    fn takeover_ticks(&self) -> u64 {
        TAKEOVER_LEASES * self.lease_ticks
    }
}

/// What the machine has installed, given with every call (the runtime reads it from its
/// machine state; the plane keeps no copy that could go stale).
#[derive(Clone, Copy, Debug)]
pub struct Local<'a> {
    /// The configuration of the installed view.
    pub config: &'a Configuration,
    /// Its region map.
    pub map: &'a RegionMap,
    /// LastPrimaryChange and LastReplicaChange per region.
    pub changes: &'a BTreeMap<RegionId, RegionChanges>,
    /// The regions of `map` whose replica here is still being copied (§5.4): a reconfiguration
    /// driven from here promotes no replica of them on this machine.
    pub copying: &'a BTreeSet<RegionId>,
    /// The newest configuration committed here (NEW-CONFIG-COMMIT).
    pub committed: ConfigId,
    /// The newest configuration whose ALL-REGIONS-ACTIVE arrived here.
    pub all_active: ConfigId,
    /// Every region this machine is primary of is active in the committed configuration.
    pub regions_active: bool,
    /// Every worker started afresh with the machines that joined the installed view (a member
    /// acknowledges NEW-CONFIG only then: a machine joining in it writes here after the
    /// commit, into rings started afresh). Without joiners, at once: the acknowledgement never
    /// waits for a worker that an application holds.
    pub workers_ready: bool,
    /// The machine learnt it was removed (it acts no more).
    pub evicted: bool,
}

/// A step of a reconfiguration, for timelines and logs.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Event {
    /// This machine took up a suspicion.
    Suspect(MachineId),
    /// This machine starts an attempt that removes `suspects`.
    Attempt {
        /// The configuration changed.
        config: ConfigId,
        /// The machines removed.
        suspects: Vec<MachineId>,
    },
    /// Every probe answered or failed.
    Probed,
    /// The store accepted the configuration.
    Stored(ConfigId),
    /// NEW-CONFIG-COMMIT went out for the configuration, driven here.
    Committed(Configuration),
    /// Every member reported its regions active (this machine being the CM).
    AllActive(ConfigId),
    /// An attempt ended without a configuration.
    Failed(String),
}

/// Something the runtime must do for the plane.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Effect {
    /// Send a control datagram.
    Send(MachineId, ControlMsg),
    /// A one-sided read of the machine's complete replicas (§5.2 step 2); report with
    /// [`ControlPlane::on_probe`].
    Probe(MachineId),
    /// Read the coordination store; report with [`ControlPlane::on_store_read`].
    ReadStore,
    /// Compare-and-set the configuration; report with [`ControlPlane::on_cas`].
    CompareAndSet {
        /// Version of the configuration replaced.
        expected: StoreVersion,
        /// The encoded new configuration.
        data: Vec<u8>,
    },
    /// NEW-CONFIG at this machine, first half: write the view to NVRAM (with the regions it
    /// newly holds without their data); report with [`ControlPlane::on_persisted`].
    Persist(StoredView),
    /// NEW-CONFIG at this machine, second half: put the view persisted for this configuration
    /// in force (map new replicas). NEW-CONFIG-ACK follows, once its workers are ready.
    Install(ConfigId),
    /// NEW-CONFIG-COMMIT at this machine: transaction recovery starts (§5.3).
    Commit(ConfigId),
    /// ALL-REGIONS-ACTIVE at this machine: data and allocator recovery start (§5.4-5.5).
    AllRegionsActive(ConfigId),
    /// This machine was removed: the store holds this newer configuration without it.
    Evicted(ConfigId),
    /// This member could not remove its CM, which it suspected, although a majority answered:
    /// a region would be left without a complete replica. It renews leases with the CM again
    /// (`MemberLease::forgive`), and suspects it again if that lease runs out. The CM stays
    /// the CM of the configuration, which no attempt changed. (Without a majority a member
    /// keeps its suspicion: it may be cut off with a CM the majority removed; but see
    /// [`Effect::ForgiveMember`] for a configuration of two.)
    ForgiveCm(MachineId),
    /// This CM could not remove a member it suspected, the other machine of a configuration
    /// of two, for want of a majority: with two members nobody can ever be removed without
    /// both answering, so the suspicion can never be acted on. Its lease manager takes the
    /// requests of the members it suspects again (`CmLeases::forgive_suspects`), giving them
    /// one lease period; a member that has really failed is suspected again when it runs out.
    /// The member does the same with its CM ([`Effect::ForgiveCm`]). Before, a live member
    /// suspected once (a lease request lost) was refused for good, suspected the CM in turn,
    /// and neither machine ever served or stopped reconfiguring.
    ForgiveMember(MachineId),
    /// PREPARE of region allocation at this machine (§3): map and register NVRAM for
    /// `regions`; report with [`ControlPlane::on_regions_prepared`].
    PrepareRegions {
        /// The CM that asked.
        cm: MachineId,
        /// Its configuration.
        config: ConfigId,
        /// The new regions.
        regions: Vec<RegionId>,
    },
    /// ABORT of region allocation at this machine: release what PREPARE mapped for `regions`
    /// (none of them in the installed map).
    AbortRegions(Vec<RegionId>),
    /// The answer to this machine's allocation request ([`ControlPlane::allocate`]).
    Allocated {
        /// The request's id.
        request: u64,
        /// The new regions, or why there are none.
        result: Result<Vec<RegionId>, String>,
    },
    /// A reconfiguration step, to record.
    Event(Event),
}

/// What an attempt changes.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Change {
    /// Remove suspects.
    Remove(BTreeSet<MachineId>),
    /// Add a machine that asked to join.
    Join(MachineId),
    /// Commit the map with the regions every replica prepared.
    Allocate(Box<Preparing>),
}

/// A reconfiguration this machine drives.
#[derive(Debug)]
struct Attempt {
    reconfig: Reconfig,
    change: Change,
    /// The configuration the attempt changes (the installed one, or a newer one stored).
    base: ConfigId,
    /// NEW-CONFIG messages not acknowledged yet, repeated.
    pending: BTreeMap<MachineId, ControlMsg>,
    last_repeat: u64,
    stored: bool,
}

/// What the CM heard from members about its configuration.
#[derive(Debug, Default)]
struct CmState {
    config: ConfigId,
    regions_active: BTreeSet<MachineId>,
    /// Machines outside the configuration that asked to join.
    joins: BTreeSet<MachineId>,
    /// Members that cannot be written to, each with the members that cannot write to it (this
    /// machine among them when it is one). No later write may land beyond the hole a broken
    /// link left, so its writes wait while both ends are members, until the fabric repairs it
    /// (the cut heals, or the connection is made again) or one of them leaves
    /// ([`CmState::cut_off`]).
    unreachable: BTreeMap<MachineId, BTreeSet<MachineId>>,
    /// Ends of broken links whose removal failed for want of a complete replica of a region
    /// they hold.
    irremovable: BTreeSet<MachineId>,
}

impl CmState {
    /// Whether `m` is an end of a broken link: it cannot be written to, or cannot write.
    fn ends_a_broken_link(&self, m: MachineId) -> bool {
        self.unreachable.contains_key(&m) || self.unreachable.values().any(|by| by.contains(&m))
    }

    /// The members CM `me` removes for links that broke (see [`CmState::unreachable`]), in the
    /// order it removes them: one end of every broken link, and as few machines as it can, since
    /// each configuration must leave a majority of the one before. Neither this CM nor an
    /// `irremovable` member is chosen. Greedily: the machine at the end of the most links not
    /// covered yet, the one that cannot be written to on a tie (it may have failed), then the
    /// lowest id. An end of each link instead once removed machines 2 and 3 where machine 3,
    /// an end of both links, would do, and two of four members are no majority (simulator seed
    /// 54 of the partitions). Links an end of which is among `leaving` (suspects removed
    /// anyway) need no other.
    fn cut_off(&self, me: MachineId, leaving: &BTreeSet<MachineId>) -> Vec<MachineId> {
        self.cover(Some(me), leaving)
    }

    /// The ends of broken links CM `me` removes from a configuration of `members` together
    /// with `suspects`: those of [`CmState::cut_off`], in its order, as many as leave a
    /// majority of `members` (each configuration must be a majority of the one before). Two
    /// broken links with no common end among four members can be ended no other way
    /// (simulator seed 160767 of the partitions): one configuration at a time. All of them at
    /// once, as before, when the cover with the CM allowed contains the CM (links of the CM's
    /// own: one at a time, the CM would shrink the cluster around itself while the members
    /// remove it), or when not even the first leaves a majority (a configuration of two): that
    /// attempt finds no majority and is retried a takeover period later.
    fn removals(
        &self,
        me: MachineId,
        members: &[MachineId],
        suspects: &BTreeSet<MachineId>,
    ) -> BTreeSet<MachineId> {
        let member = |m: &MachineId| members.contains(m);
        let ends: Vec<MachineId> = (self.cut_off(me, suspects).into_iter())
            .filter(member)
            .collect();
        if self.cover(None, suspects).contains(&me) {
            return ends.into_iter().collect();
        }
        let mut leaving = suspects.clone();
        let mut cut = BTreeSet::new();
        for m in &ends {
            leaving.insert(*m);
            if (members.len() - leaving.len()) * 2 <= members.len() {
                break;
            }
            cut.insert(*m);
        }
        if cut.is_empty() {
            return ends.into_iter().collect();
        }
        cut
    }

    /// The greedy cover of [`CmState::cut_off`], choosing neither `cm` nor an irremovable member.
    fn cover(&self, cm: Option<MachineId>, leaving: &BTreeSet<MachineId>) -> Vec<MachineId> {
        let removable = |m: MachineId| Some(m) != cm && !self.irremovable.contains(&m);
        // (writer, target) of every broken link.
        let mut links: Vec<(MachineId, MachineId)> = self
            .unreachable
            .iter()
            .flat_map(|(target, by)| by.iter().map(move |w| (*w, *target)))
            .filter(|(w, t)| !leaving.contains(w) && !leaving.contains(t))
            .filter(|(w, t)| removable(*w) || removable(*t))
            .collect();
        let mut out = Vec::new();
        while !links.is_empty() {
            // Per candidate: links it ends, links it is the target of.
            let mut ends: BTreeMap<MachineId, (usize, usize)> = BTreeMap::new();
            for (w, t) in &links {
                if removable(*w) {
                    ends.entry(*w).or_default().0 += 1;
                }
                if removable(*t) {
                    let e = ends.entry(*t).or_default();
                    e.0 += 1;
                    e.1 += 1;
                }
            }
            let (best, _) = ends
                .iter()
                .max_by_key(|(m, e)| (**e, std::cmp::Reverse(**m)))
                .expect("every link left has a removable end");
            let best = *best;
            out.push(best);
            links.retain(|(w, t)| *w != best && *t != best);
        }
        out
    }
}

/// A CM this machine suspects.
#[derive(Clone, Copy, Debug)]
struct CmSuspicion {
    config: ConfigId,
    cm: MachineId,
    since: u64,
    /// No attempt before this tick (after a failed one).
    not_before: u64,
    /// A stored configuration newer than the view, seen once: an attempt under way elsewhere
    /// is given one takeover period to reach this machine before it is driven over.
    deferred_for: Option<ConfigId>,
    /// When to read the store again to learn whether this machine was removed, and the
    /// interval after that.
    next_check: u64,
    check_every: u64,
    /// This machine cannot write to the CM (not only a lease that ran out): a link that stays
    /// broken while both are members.
    unreachable: bool,
}

/// Why the store is being read (several reasons may share one read).
#[derive(Debug, Default, Clone, Copy)]
struct Reading {
    outstanding: bool,
    attempt: bool,
    join: bool,
}

/// The control plane of one machine. See the module docs.
#[derive(Debug)]
pub struct ControlPlane {
    me: MachineId,
    params: PlaneParams,
    effects: Vec<Effect>,
    // Member side.
    /// NEW-CONFIG to acknowledge once installed (and its joiners' rings started afresh):
    /// configuration and sender.
    ack_due: Option<(ConfigId, MachineId)>,
    last_report: u64,
    last_join: Option<u64>,
    evicted: bool,
    // Driver side.
    cm: CmState,
    /// Members this machine (as CM) suspects, with when the next attempt may start.
    suspects: BTreeSet<MachineId>,
    /// Of `suspects`, those suspected only for not acknowledging a NEW-CONFIG: alive perhaps,
    /// with threads slow to pick the view up. Forgiven when removing them too would leave no
    /// majority (a lease that expires suspects them again, for good).
    unacknowledged: BTreeSet<MachineId>,
    retry_at: u64,
    /// No machine removed by an attempt abandoned here holds a lease after this tick: the next
    /// attempt's commit waits for it too (§5.2 step 7).
    leases_end: u64,
    cm_suspicion: Option<CmSuspicion>,
    /// After this member forgave a CM it could not remove, no attempt to remove it before this
    /// tick (a takeover period after the failure, as if the suspicion had stood).
    cm_retry_at: u64,
    attempt: Option<Attempt>,
    reading: Reading,
    /// Joiners whose join failed: not before `.0`, then wait `.1` after the next failure.
    join_backoff: BTreeMap<MachineId, (u64, u64)>,
    /// A compare-and-set of this CM's failed with the store's outcome unknown (a timeout): it
    /// may have stored a configuration that reached nobody, which no joiner asks for again
    /// (the stored one holds it) and no other change makes due. The CM reads the store at its
    /// next attempt time and drives such a configuration again (`start_attempt`), until a
    /// configuration commits or the store shows nothing newer than the installed one.
    cas_unknown: bool,
    /// When this member last told its CM of each member it cannot write to.
    reported: BTreeMap<MachineId, u64>,
    // Region allocation, at the CM.
    /// Members' requests, served in order.
    allocations: VecDeque<AllocRequest>,
    /// The request being prepared, or prepared and waiting for its attempt.
    preparing: Option<Preparing>,
    /// Answers sent lately: (member, request, answer).
    answers: VecDeque<(MachineId, u64, ControlMsg)>,
    // Region allocation, at the member.
    /// This machine's requests not answered yet: count and locality.
    requested: BTreeMap<u64, (u32, Option<RegionId>)>,
    last_request: u64,
}

impl ControlPlane {
    /// The plane of machine `me`.
    pub fn new(me: MachineId, params: PlaneParams) -> Self {
        assert!(params.lease_ticks > 0 && params.repeat_ticks > 0);
        assert!(params.lease_longest_ticks >= params.lease_ticks);
        Self {
            me,
            params,
            effects: Vec::new(),
            ack_due: None,
            last_report: 0,
            last_join: None,
            evicted: false,
            cm: CmState::default(),
            suspects: BTreeSet::new(),
            unacknowledged: BTreeSet::new(),
            retry_at: 0,
            leases_end: 0,
            cm_suspicion: None,
            cm_retry_at: 0,
            attempt: None,
            reading: Reading::default(),
            join_backoff: BTreeMap::new(),
            cas_unknown: false,
            reported: BTreeMap::new(),
            allocations: VecDeque::new(),
            preparing: None,
            answers: VecDeque::new(),
            requested: BTreeMap::new(),
            last_request: 0,
        }
    }

    /// The machine this plane belongs to.
    pub fn me(&self) -> MachineId {
        self.me
    }

    /// The parameters in force (the lease as last set).
    pub fn params(&self) -> &PlaneParams {
        &self.params
    }

    /// Changes the lease length in force (expiries already computed elsewhere stay).
    pub fn set_lease(&mut self, lease_ticks: u64, lease_longest_ticks: u64) {
        assert!(lease_ticks > 0 && lease_longest_ticks >= lease_ticks);
        self.params.lease_ticks = lease_ticks;
        self.params.lease_longest_ticks = lease_longest_ticks;
    }

    /// Checks the plane's state against the invariants it keeps between calls, panicking with
    /// the one broken. Cheap: bounded sets only. The runtime's `MachineControl` runs it after
    /// every call in debug builds, and the simulator in every build.
    pub fn invariants(&self) {
        let max = self.params.machines_max;
        let ids = [
            ("suspects", &self.suspects),
            ("regions active", &self.cm.regions_active),
            ("joins", &self.cm.joins),
            (
                "unreachable",
                &self.cm.unreachable.keys().copied().collect(),
            ),
            (
                "cut off",
                &self
                    .cm
                    .cut_off(self.me, &self.suspects)
                    .into_iter()
                    .collect(),
            ),
            ("irremovable", &self.cm.irremovable),
        ];
        for (name, set) in ids {
            assert!(
                set.iter().all(|m| m.0 < max),
                "{name} {set:?} beyond machines_max {max}"
            );
        }
        assert!(
            self.reported
                .keys()
                .chain(self.join_backoff.keys())
                .all(|m| m.0 < max),
            "a machine beyond machines_max {max} reported or backing off"
        );
        // A machine never removes itself: it stops when it learns it was removed.
        assert!(
            !self.suspects.contains(&self.me),
            "{} suspects itself",
            self.me
        );
        assert!(
            self.unacknowledged.is_subset(&self.suspects),
            "unacknowledged {:?} not among suspects {:?}",
            self.unacknowledged,
            self.suspects
        );
        assert!(
            self.cm_suspicion.is_none_or(|s| s.cm != self.me),
            "{} suspects itself as CM",
            self.me
        );
        assert!(
            self.allocations.len() <= ALLOCATIONS_MAX
                && self.answers.len() <= ANSWERS_MAX
                && self.requested.len() <= ALLOCATIONS_MAX,
            "allocation state beyond its bounds: {} queued, {} answers, {} requested",
            self.allocations.len(),
            self.answers.len(),
            self.requested.len()
        );
        if let Some(a) = &self.attempt {
            // The plane hands its own messages to itself (`send`); only others' are repeated.
            assert!(
                !a.pending.contains_key(&self.me) && a.pending.keys().all(|m| m.0 < max),
                "NEW-CONFIG pending for {:?}",
                a.pending.keys().collect::<Vec<_>>()
            );
        }
    }

    /// Effects to carry out, in order.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// Whether a reconfiguration driven here is under way, or one is due (a suspicion not yet
    /// acted on).
    pub fn busy(&self) -> bool {
        self.attempt.is_some()
            || self.reading.outstanding
            || !self.suspects.is_empty()
            || self.cm_suspicion.is_some()
    }

    /// Whether a reconfiguration driven here is under way.
    pub fn reconfiguring(&self) -> bool {
        self.attempt.is_some()
    }

    /// Whether a region allocation is under way here: requested, or served as CM.
    pub fn allocating(&self) -> bool {
        !self.requested.is_empty() || !self.allocations.is_empty() || self.preparing.is_some()
    }

    fn send(&mut self, to: MachineId, msg: ControlMsg, now: u64, local: &Local<'_>) {
        if to == self.me {
            self.on_message(self.me, msg, now, local);
        } else {
            self.effects.push(Effect::Send(to, msg));
        }
    }

    fn event(&mut self, e: Event) {
        self.effects.push(Effect::Event(e));
    }

    /// Resets what the CM heard when the configuration changed.
    fn follow(&mut self, local: &Local<'_>) {
        if self.cm.config != local.config.id {
            if local.config.cm != self.me {
                // Requests go to the new CM (members ask again); what was prepared is released,
                // unless a configuration installed here maps it (the next commit keeps it).
                self.allocations.clear();
                self.answers.clear();
                if let Some(p) = self.preparing.take() {
                    if !p.mapped_in(local.map) {
                        self.abort_regions(&p);
                    }
                }
            }
            // A removed machine's answers go: a later incarnation numbers its requests anew.
            self.answers.retain(|(m, _, _)| local.config.contains(*m));
            self.cm = CmState {
                config: local.config.id,
                ..CmState::default()
            };
            self.suspects.retain(|m| local.config.contains(*m));
            self.unacknowledged.retain(|m| self.suspects.contains(m));
            self.reported.clear();
            self.cm_retry_at = 0;
        }
        if self
            .cm_suspicion
            .is_some_and(|s| s.config != local.config.id || s.cm != local.config.cm)
        {
            self.cm_suspicion = None; // A new configuration resolved it.
        }
    }

    /// A control message from `from`.
    pub fn on_message(&mut self, from: MachineId, msg: ControlMsg, now: u64, local: &Local<'_>) {
        self.follow(local);
        if self.evicted || local.evicted {
            return;
        }
        let me = self.me;
        match msg {
            ControlMsg::NewConfig(v) => {
                let id = v.config.id;
                if !v.config.contains(me) || v.config.cm != from {
                    return;
                }
                if local.config.id < id {
                    assert!(v.config.members.len() <= self.params.machines_max as usize);
                    // Persisted, confirmed (`on_persisted`), installed, then acknowledged: an
                    // acknowledged view is durable (a restart resumes from it).
                    self.effects.push(Effect::Persist(v));
                }
                if local.config.id <= id {
                    // Acknowledged once installed and its workers ready (`tick`).
                    self.ack_due = Some((id, from));
                }
            }
            ControlMsg::NewConfigAck(id) => {
                if let Some(a) = self.attempt.as_mut() {
                    // A late ack of an earlier attempt's configuration answers nothing here.
                    let answers = |msg: &ControlMsg| matches!(msg, ControlMsg::NewConfig(v) if v.config.id == id);
                    if from == me || a.pending.get(&from).is_some_and(answers) {
                        a.pending.remove(&from);
                        a.reconfig.on_ack(from, id, now);
                        self.pump(now, local);
                    }
                }
            }
            ControlMsg::NewConfigCommit(id) => {
                if local.config.id == id && local.config.cm == from && local.committed < id {
                    self.effects.push(Effect::Commit(id));
                }
            }
            ControlMsg::RegionsActive(id) => {
                if local.config.id == id && local.config.cm == me && local.config.contains(from) {
                    self.cm.regions_active.insert(from);
                    if from != me && self.all_reported(local.config) {
                        // Applied and recorded here first: the event marks when
                        // ALL-REGIONS-ACTIVE first went out.
                        self.all_active_here(local);
                        self.send(from, ControlMsg::AllRegionsActive(id), now, local);
                    }
                }
            }
            ControlMsg::AllRegionsActive(id) => {
                if local.config.id == id && local.config.cm == from && local.all_active < id {
                    self.effects.push(Effect::AllRegionsActive(id));
                }
            }
            ControlMsg::Unreachable { config, machine } => {
                let c = local.config;
                // `machine` may be this CM: a member that cannot reach it and could not remove
                // it (`CmSuspicion::unreachable`).
                if config == c.id
                    && c.cm == me
                    && machine != from
                    && c.contains(machine)
                    && c.contains(from)
                {
                    self.cm.unreachable.entry(machine).or_default().insert(from);
                }
            }
            ControlMsg::Join(_) => {
                let c = local.config;
                if c.cm == me
                    && !c.contains(from)
                    && from.0 < self.params.machines_max
                    && self.cm.joins.len() < JOINERS_MAX
                {
                    self.cm.joins.insert(from);
                }
            }
            ControlMsg::Allocate {
                request,
                count,
                near,
            } => {
                let c = local.config;
                if c.cm != me || !c.contains(from) {
                    return; // The member asks its CM again once it learns who that is.
                }
                let answered = self
                    .answers
                    .iter()
                    .find(|(m, r, _)| *m == from && *r == request)
                    .map(|(_, _, answer)| answer.clone());
                if let Some(answer) = answered {
                    self.send(from, answer, now, local);
                    return;
                }
                let same = |a: &AllocRequest| a.from == from && a.request == request;
                let committing = self
                    .attempt
                    .as_ref()
                    .is_some_and(|a| matches!(&a.change, Change::Allocate(p) if same(&p.request)));
                if committing
                    || self.preparing.as_ref().is_some_and(|p| same(&p.request))
                    || self.allocations.iter().any(same)
                {
                    return;
                }
                if !(1..=ALLOCATION_REGIONS_MAX).contains(&count) {
                    let why = format!(
                        "{count} regions: a request asks for 1 to {ALLOCATION_REGIONS_MAX}"
                    );
                    self.answer(from, request, Err(why), now, local);
                } else if self.allocations.len() < ALLOCATIONS_MAX {
                    self.allocations.push_back(AllocRequest {
                        from,
                        request,
                        count,
                        near,
                    });
                }
            }
            ControlMsg::PrepareRegions { config, regions } => {
                let c = local.config;
                if c.id != config || c.cm != from || !c.contains(me) {
                    return;
                }
                if regions.iter().any(|r| local.map.get(*r).is_some()) {
                    // Not new here: a CM whose map is behind this machine's (it would reuse ids).
                    let refused = ControlMsg::RegionsPrepared {
                        config,
                        regions,
                        ok: false,
                    };
                    self.send(from, refused, now, local);
                } else {
                    self.effects.push(Effect::PrepareRegions {
                        cm: from,
                        config,
                        regions,
                    });
                }
            }
            ControlMsg::RegionsPrepared {
                config,
                regions,
                ok,
            } => {
                if let Some(p) = self.preparing.as_mut().filter(|p| p.config == config) {
                    p.on_prepared(from, &regions, ok);
                }
            }
            ControlMsg::AbortRegions { regions, .. } => {
                if local.config.contains(from) {
                    // A region the map holds is in use: only a prepared one is released.
                    let regions: Vec<RegionId> = regions
                        .into_iter()
                        .filter(|r| local.map.get(*r).is_none())
                        .collect();
                    if !regions.is_empty() {
                        self.effects.push(Effect::AbortRegions(regions));
                    }
                }
            }
            ControlMsg::Allocated { request, regions } => {
                if self.requested.remove(&request).is_some() {
                    self.effects.push(Effect::Allocated {
                        request,
                        result: Ok(regions),
                    });
                }
            }
            ControlMsg::AllocationRefused { request, reason } => {
                if self.requested.remove(&request).is_some() {
                    self.effects.push(Effect::Allocated {
                        request,
                        result: Err(reason),
                    });
                }
            }
            // The restart exchange's (`crate::restart`), which runs before the plane.
            ControlMsg::Restart { .. }
            | ControlMsg::RestartAck(_)
            | ControlMsg::RestartRefused { .. }
            | ControlMsg::RingStarts { .. }
            | ControlMsg::Persisted { .. } => {}
        }
    }

    /// Asks the CM to allocate `count` regions (§3), near region `near` if given, as request
    /// `request` (an id unique at this machine); the answer comes as [`Effect::Allocated`]. A
    /// request beyond [`ALLOCATIONS_MAX`] outstanding is refused at once.
    pub fn allocate(
        &mut self,
        request: u64,
        count: u32,
        near: Option<RegionId>,
        now: u64,
        local: &Local<'_>,
    ) {
        self.follow(local);
        if self.requested.len() >= ALLOCATIONS_MAX || self.requested.contains_key(&request) {
            self.effects.push(Effect::Allocated {
                request,
                result: Err(format!(
                    "{} allocation requests outstanding here, or request {request} twice",
                    self.requested.len()
                )),
            });
            return;
        }
        self.requested.insert(request, (count, near));
        self.ask(request, now, local);
    }

    fn ask(&mut self, request: u64, now: u64, local: &Local<'_>) {
        let c = local.config;
        if self.evicted || local.evicted || !c.contains(self.me) {
            return;
        }
        self.last_request = now;
        let (count, near) = self.requested[&request];
        let msg = ControlMsg::Allocate {
            request,
            count,
            near,
        };
        self.send(c.cm, msg, now, local);
    }

    /// The result of [`Effect::Persist`]: whether the view of `config` is in NVRAM. A view
    /// not persisted is neither installed nor acknowledged; the CM's repeated NEW-CONFIG tries
    /// again, and a member that never manages is removed for not acknowledging.
    pub fn on_persisted(&mut self, config: ConfigId, ok: bool, _now: u64, local: &Local<'_>) {
        if ok && local.config.id < config {
            self.effects.push(Effect::Install(config));
        }
    }

    /// The result of [`Effect::PrepareRegions`]: whether this machine holds `regions` ready.
    pub fn on_regions_prepared(
        &mut self,
        cm: MachineId,
        config: ConfigId,
        regions: Vec<RegionId>,
        ok: bool,
        now: u64,
        local: &Local<'_>,
    ) {
        let msg = ControlMsg::RegionsPrepared {
            config,
            regions,
            ok,
        };
        self.send(cm, msg, now, local);
    }

    /// The CM's answer to `from`'s request, remembered for a member that asks again.
    fn answer(
        &mut self,
        from: MachineId,
        request: u64,
        result: Result<Vec<RegionId>, String>,
        now: u64,
        local: &Local<'_>,
    ) {
        let msg = match result {
            Ok(regions) => ControlMsg::Allocated { request, regions },
            Err(reason) => ControlMsg::AllocationRefused { request, reason },
        };
        if self.answers.len() == ANSWERS_MAX {
            self.answers.pop_front();
        }
        self.answers.push_back((from, request, msg.clone()));
        self.send(from, msg, now, local);
    }

    /// ABORT to every replica of a failed allocation (sent once: a lost ABORT leaves a
    /// prepared mapping that a later PREPARE or NEW-CONFIG of the same region reuses).
    fn abort_regions(&mut self, p: &Preparing) {
        let config = p.config;
        let aborts: Vec<(MachineId, Vec<RegionId>)> =
            p.replicas().map(|(m, r)| (m, r.to_vec())).collect();
        for (m, regions) in aborts {
            if m == self.me {
                self.effects.push(Effect::AbortRegions(regions));
            } else {
                let msg = ControlMsg::AbortRegions { config, regions };
                self.effects.push(Effect::Send(m, msg));
            }
        }
    }

    /// Ends a request that failed: ABORT to its replicas, the reason to the member.
    fn refuse(&mut self, p: Preparing, why: String, now: u64, local: &Local<'_>) {
        self.abort_regions(&p);
        self.event(Event::Failed(format!(
            "allocating {} regions for {}: {why}",
            p.request.count, p.request.from
        )));
        self.answer(p.request.from, p.request.request, Err(why), now, local);
    }

    /// The CM's side of allocation at a tick: a request placed in an older configuration is
    /// placed again, a failed one is answered, and the next one starts once the configuration
    /// is settled and nothing else is.
    fn allocation_tick(&mut self, settled: bool, now: u64, local: &Local<'_>) {
        let c = local.config;
        if let Some(p) = self.preparing.take() {
            if p.config != c.id && p.mapped_in(local.map) {
                // Installed with its regions by an attempt that failed to commit it: the
                // commit of the CM's next attempt answers it (`finish`).
                self.preparing = Some(p);
            } else if p.config != c.id {
                self.abort_regions(&p);
                self.allocations.push_front(p.request);
            } else if let Some(Err(e)) = p.outcome(now) {
                self.refuse(p, e.to_string(), now, local);
            } else {
                self.preparing = Some(p);
            }
        }
        if self.preparing.is_some() || !settled {
            return;
        }
        let Some(request) = self.allocations.pop_front() else {
            return;
        };
        let deadline = now + self.params.ack_timeout_ticks;
        let placed = Preparing::start(
            request.clone(),
            c,
            local.map,
            self.params.replicas,
            self.params.regions_max,
            deadline,
        );
        match placed {
            Ok(p) => {
                self.preparing = Some(p);
                self.send_prepares(now, local);
            }
            Err(e) => {
                let why = e.to_string();
                self.answer(request.from, request.request, Err(why), now, local);
            }
        }
    }

    /// PREPARE to every replica of the request being prepared that has not answered.
    fn send_prepares(&mut self, now: u64, local: &Local<'_>) {
        let Some(p) = &self.preparing else {
            return;
        };
        let config = p.config;
        let prepares: Vec<(MachineId, Vec<RegionId>)> =
            p.prepares().map(|(m, r)| (m, r.to_vec())).collect();
        for (m, regions) in prepares {
            self.send(
                m,
                ControlMsg::PrepareRegions { config, regions },
                now,
                local,
            );
        }
    }

    /// ALL-REGIONS-ACTIVE at the CM itself, once (every member reported).
    fn all_active_here(&mut self, local: &Local<'_>) {
        let id = local.config.id;
        let done = self.effects.contains(&Effect::AllRegionsActive(id));
        if local.all_active < id && !done {
            self.effects.push(Effect::AllRegionsActive(id));
            self.event(Event::AllActive(id));
        }
    }

    fn all_reported(&self, config: &Configuration) -> bool {
        config
            .members
            .iter()
            .all(|m| self.cm.regions_active.contains(m))
    }

    /// This machine's lease of `suspect` expired (at the CM: a member's; at a member: the
    /// CM's), §5.1.
    pub fn on_suspect(&mut self, suspect: MachineId, now: u64, local: &Local<'_>) {
        self.follow(local);
        let c = local.config;
        if self.evicted || local.evicted || suspect == self.me || !c.contains(self.me) {
            return;
        }
        if !c.contains(suspect) {
            return; // About an older configuration.
        }
        self.event(Event::Suspect(suspect));
        debug_assert!(c.members.windows(2).all(|w| w[0] < w[1]), "members sorted");
        if c.cm == self.me {
            self.suspects.insert(suspect);
            self.unacknowledged.remove(&suspect);
            self.abandon_awaiting(suspect, now, local);
        } else if suspect == c.cm && self.cm_suspicion.is_none() {
            self.cm_suspicion = Some(CmSuspicion {
                config: c.id,
                cm: c.cm,
                since: now,
                not_before: now.max(self.cm_retry_at),
                deferred_for: None,
                next_check: now,
                check_every: self.params.takeover_ticks(),
                unreachable: false,
            });
        }
    }

    /// Ends the attempt under way if it waits for `suspect`'s NEW-CONFIG-ACK: a member whose
    /// lease expired has failed, and waiting out the ack timeout for it (ten leases) would
    /// leave the new configuration uncommitted, and every transaction blocked, that long. The
    /// next attempt, at once, drives the stored configuration again without it.
    fn abandon_awaiting(&mut self, suspect: MachineId, now: u64, local: &Local<'_>) {
        let awaited = self
            .attempt
            .as_ref()
            .and_then(|a| a.reconfig.awaiting_acks())
            .is_some_and(|w| w.contains(&suspect));
        if !awaited {
            return;
        }
        let a = self.attempt.take().expect("awaited");
        self.leases_end = self.leases_end.max(a.reconfig.leases_end());
        match a.change {
            Change::Remove(earlier) => self.suspects.extend(earlier),
            Change::Allocate(p) => {
                let why = format!("{suspect} failed before the regions were committed");
                self.refuse(*p, why, now, local);
            }
            Change::Join(_) => {}
        }
        self.retry_at = now;
        self.event(Event::Failed(format!(
            "{suspect} was suspected before acknowledging"
        )));
    }

    /// This machine cannot write to `m`, a member, although `m`'s process may live (a broken
    /// connection, whose later writes must not land beyond the hole it left in a log). Called
    /// every tick while so: the CM removes `m`; another member suspects `m` if it is the CM
    /// and otherwise tells the CM, every [`TAKEOVER_LEASES`] leases (datagrams get lost).
    pub fn on_unreachable(&mut self, m: MachineId, now: u64, local: &Local<'_>) {
        self.follow(local);
        let c = local.config;
        if self.evicted || local.evicted || m == self.me || !c.contains(m) {
            return;
        }
        if c.cm == self.me {
            self.cm.unreachable.entry(m).or_default().insert(self.me);
        } else if m == c.cm {
            if self.cm_suspicion.is_none() {
                self.on_suspect(m, now, local);
            }
            if let Some(s) = self.cm_suspicion.as_mut() {
                s.unreachable = true;
            }
        } else {
            let every = self.params.takeover_ticks();
            let due = self
                .reported
                .get(&m)
                .is_none_or(|at| now >= at.saturating_add(every));
            if due {
                self.reported.insert(m, now);
                self.effects.push(Effect::Send(
                    c.cm,
                    ControlMsg::Unreachable {
                        config: c.id,
                        machine: m,
                    },
                ));
            }
        }
    }

    /// The result of [`Effect::Probe`] (see [`Reconfig::on_probe`]).
    pub fn on_probe(&mut self, m: MachineId, answer: ProbeAnswer, now: u64, local: &Local<'_>) {
        if let Some(a) = self.attempt.as_mut() {
            a.reconfig.on_probe(m, answer, now);
            self.pump(now, local);
        }
    }

    /// The result of [`Effect::CompareAndSet`].
    pub fn on_cas(&mut self, result: Result<CasOutcome, StoreError>, now: u64, local: &Local<'_>) {
        if let Some(a) = self.attempt.as_mut() {
            a.reconfig.on_store(result);
            self.pump(now, local);
        }
    }

    /// The result of [`Effect::ReadStore`]: the stored configuration with its version (`None`
    /// when the read failed or the store is empty; the reasons for reading stand).
    pub fn on_store_read(
        &mut self,
        stored: Option<(StoreVersion, Configuration)>,
        now: u64,
        local: &Local<'_>,
    ) {
        self.follow(local);
        let reading = std::mem::take(&mut self.reading);
        let Some((version, stored)) = stored else {
            return;
        };
        let me = self.me;
        if self.evicted || local.evicted {
            return;
        }
        if local.config.contains(me) && stored.id > local.config.id && !stored.contains(me) {
            // A newer configuration without this machine: it was removed (precise
            // membership, §5.2) and must not act as a member again.
            self.evicted = true;
            self.attempt = None;
            self.effects.push(Effect::Evicted(stored.id));
            return;
        }
        if reading.join && !local.config.contains(me) && !stored.contains(me) {
            self.effects
                .push(Effect::Send(stored.cm, ControlMsg::Join(stored.id)));
        }
        if reading.attempt && self.attempt.is_none() {
            self.start_attempt(version, stored, now, local);
        }
    }

    /// Starts the attempt that is due, from the stored configuration.
    fn start_attempt(
        &mut self,
        version: StoreVersion,
        stored: Configuration,
        now: u64,
        local: &Local<'_>,
    ) {
        assert!(
            self.attempt.is_none(),
            "{} starts a second attempt",
            self.me
        );
        assert!(!self.evicted, "{} attempts after its eviction", self.me);
        let c = local.config;
        let me = self.me;
        let base = attempt_base(c, &stored);
        let base_id = base.id;
        let lease = self.params.lease_longest_ticks;
        // A CM renews every member of the configuration it installed until it installs the
        // next: members it removes have leases a lease (and a round of its lease thread) past
        // the last NEW-CONFIG-ACK, the CM's own among them.
        let renewed_until_install = lease + lease / 4;
        let mut hold = 0;
        let change = if c.cm == me {
            // The store answered: a configuration an earlier compare-and-set stored is driven
            // below like any stored one newer than the CM's (and the flag stays until one
            // commits: the drive may fail too).
            if stored.id <= c.id {
                self.cas_unknown = false;
            }
            let mut suspects: BTreeSet<MachineId> = self
                .suspects
                .iter()
                .copied()
                .filter(|m| *m != me && base.contains(*m))
                .collect();
            // Ends of broken links, as many per configuration as leave a majority
            // (`CmState::removals`). A cluster stopping together (`farm-node local stop`)
            // breaks no link before every machine halted, if all got the power signal within
            // a lease of each other: each keeps its connections a lease after it
            // (`farm_node::machine`).
            let cut = self.cm.removals(me, &base.members, &suspects);
            suspects.extend(&cut);
            // Machines removed for broken links, or by a stored configuration this CM drives
            // again (an earlier attempt's compare-and-set took effect, its probes are not
            // repeated), are renewed here until the install.
            if !cut.is_empty() || c.members.iter().any(|m| !base.contains(*m)) {
                hold = renewed_until_install;
            }
            if !suspects.is_empty() || local.committed < c.id || stored.id > c.id {
                // Removals, or a configuration installed here (this machine its CM) that no
                // attempt is committing any more, or one stored but installed nowhere (a
                // compare-and-set whose answer was lost: it took effect, the attempt failed):
                // driven again, from the stored one.
                Change::Remove(suspects)
            } else if self.prepared(now, local) {
                if stored.id != c.id {
                    return; // Placed in the configuration the CM is in; the tick sees to it.
                }
                Change::Allocate(Box::new(self.preparing.take().expect("prepared")))
            } else if let Some(j) = self.next_joiner(now) {
                if stored.id != c.id {
                    // A join starts from the configuration the CM is in; the joiner asks again.
                    return;
                }
                Change::Join(j)
            } else {
                return;
            }
        } else {
            let Some(s) = self.cm_suspicion.as_mut() else {
                return;
            };
            if stored.id > c.id && s.deferred_for != Some(stored.id) {
                // Someone stored a newer configuration that has not reached this machine:
                // give it a takeover period, then drive over it if it is still stuck.
                s.deferred_for = Some(stored.id);
                s.not_before = now + self.params.takeover_ticks();
                return;
            }
            // A CM suspected over a broken link may hold its leases at the members until they
            // install the new configuration, and renew the leases of those cut off with it for
            // a lease after: both are waited out.
            if s.unreachable {
                hold = 2 * lease + lease / 4;
            }
            Change::Remove(BTreeSet::from([s.cm]))
        };
        if !base.contains(me) {
            return; // Handled above as an eviction when the store says so.
        }
        let (params, leases_end) = (self.params.reconfig(), self.leases_end.max(now));
        let removing = |map: &RegionMap, suspects: &BTreeSet<MachineId>| {
            Reconfig::start(
                me,
                base.clone(),
                version,
                map.clone(),
                local.changes.clone(),
                local.copying.clone(),
                suspects.clone(),
                params,
                leases_end,
                now,
            )
        };
        let mut r = match &change {
            Change::Remove(suspects) => {
                self.event(Event::Attempt {
                    config: base.id,
                    suspects: suspects.iter().copied().collect(),
                });
                removing(local.map, suspects)
            }
            // The same steps with the map that holds the prepared regions, nobody removed.
            Change::Allocate(p) => removing(&p.map, &BTreeSet::new()),
            Change::Join(j) => Reconfig::start_join(
                me,
                base,
                version,
                local.map.clone(),
                local.changes.clone(),
                local.copying.clone(),
                BTreeMap::from([(*j, j.0 as u32)]),
                self.params.reconfig(),
                now,
            ),
        };
        r.hold_after_acks(hold);
        if c.cm == me {
            // And a member whose probe fails. A backup CM's probes need no hold: the old CM's
            // grants end a lease after its lease here did (`lapsed`), before the failed probe's
            // lease is out.
            r.hold_after_acks_if_a_probe_fails(renewed_until_install);
        }
        self.attempt = Some(Attempt {
            reconfig: r,
            change,
            base: base_id,
            pending: BTreeMap::new(),
            last_repeat: now,
            stored: false,
        });
        self.pump(now, local);
    }

    /// Whether the request being prepared is ready to commit: every replica prepared, in the
    /// configuration installed here, which is settled.
    fn prepared(&self, now: u64, local: &Local<'_>) -> bool {
        local.all_active >= local.config.id
            && self
                .preparing
                .as_ref()
                .is_some_and(|p| p.config == local.config.id && p.outcome(now) == Some(Ok(())))
    }

    fn next_joiner(&mut self, now: u64) -> Option<MachineId> {
        let backoff = &self.join_backoff;
        let j = self
            .cm
            .joins
            .iter()
            .copied()
            .find(|j| backoff.get(j).is_none_or(|(until, _)| now >= *until))?;
        self.cm.joins.remove(&j);
        Some(j)
    }

    /// Carries the attempt's effects out as the plane's, until it needs an answer.
    fn pump(&mut self, now: u64, local: &Local<'_>) {
        loop {
            let Some(a) = self.attempt.as_mut() else {
                return;
            };
            let effects = a.reconfig.take_effects();
            if effects.is_empty() {
                break;
            }
            for e in effects {
                match e {
                    ReconfigEffect::Probe(m) => self.effects.push(Effect::Probe(m)),
                    ReconfigEffect::CompareAndSet { expected, data } => {
                        self.event(Event::Probed);
                        self.effects.push(Effect::CompareAndSet { expected, data });
                    }
                    ReconfigEffect::SendNewConfig(m, new) => {
                        // §5.2 step 3: the machine that drives the change becomes the CM.
                        assert_eq!(
                            new.config.cm, self.me,
                            "an attempt whose driver is not the new configuration's CM"
                        );
                        assert!(
                            new.config.members.contains(&m),
                            "NEW-CONFIG to {m}, not a member"
                        );
                        let a = self.attempt.as_mut().expect("attempt");
                        if !a.stored {
                            a.stored = true;
                            self.event(Event::Stored(new.config.id));
                        }
                        let msg = ControlMsg::new_config(&new.config, &new.map, &new.changes);
                        if m != self.me {
                            let a = self.attempt.as_mut().expect("attempt");
                            a.pending.insert(m, msg.clone());
                        }
                        self.send(m, msg, now, local);
                    }
                    // NEW-CONFIG-COMMIT: transaction recovery starts at the member (§5.3); the
                    // CM repeats it until the member reports its regions active.
                    ReconfigEffect::SendCommit(m, id) => {
                        self.send(m, ControlMsg::NewConfigCommit(id), now, local)
                    }
                }
            }
        }
        let a = self.attempt.as_ref().expect("attempt");
        let Some(outcome) = a.reconfig.outcome().cloned() else {
            return;
        };
        let (change, base) = (a.change.clone(), a.base);
        self.attempt = None;
        self.finish(change, base, outcome, now, local);
    }

    fn finish(
        &mut self,
        change: Change,
        base: ConfigId,
        outcome: Result<NewConfig, ReconfigError>,
        now: u64,
        local: &Local<'_>,
    ) {
        // A compare-and-set whose outcome is unknown (the store timed out, or failed) may have
        // stored a configuration nobody installed: the CM reads the store and drives it again,
        // a takeover period from now (a store that refuses writes at once is not hammered).
        if matches!(outcome, Err(ReconfigError::Store(_))) && local.config.cm == self.me {
            self.cas_unknown = true;
            self.retry_at = self.retry_at.max(now + self.params.takeover_ticks());
        }
        match (outcome, change) {
            (Ok(new), change) => {
                self.cas_unknown = false;
                assert!(
                    new.config.contains(self.me),
                    "the driver left its own configuration"
                );
                // §5.2 step 1: the machine that drives a change is the new configuration's CM.
                assert_eq!(
                    new.config.cm, self.me,
                    "committed a configuration it is not CM of"
                );
                assert!(
                    new.config.id >= local.config.id,
                    "committed configuration {} older than the view's {}",
                    new.config.id.0,
                    local.config.id.0
                );
                match change {
                    Change::Join(j) => {
                        self.join_backoff.remove(&j);
                    }
                    Change::Allocate(p) => {
                        assert!(
                            p.regions.iter().all(|r| new.map.get(*r).is_some()),
                            "configuration {} committed without the regions it allocates",
                            new.config.id.0
                        );
                        // A requester removed meanwhile hears nothing: it learns from the
                        // store that it was removed, and its caller from that.
                        let (from, request) = (p.request.from, p.request.request);
                        if new.config.contains(from) {
                            self.answer(from, request, Ok(p.regions.clone()), now, local);
                        }
                    }
                    Change::Remove(_) => {}
                }
                // An allocation whose configuration was installed but not committed (its
                // attempt failed after storing it): this attempt drove it again and committed
                // the regions, so the requester hears of them as if its own attempt had.
                if let Some(p) = self.preparing.take_if(|p| p.mapped_in(&new.map)) {
                    let (from, request) = (p.request.from, p.request.request);
                    if new.config.contains(from) {
                        self.answer(from, request, Ok(p.regions.clone()), now, local);
                    }
                }
                self.suspects.retain(|m| new.config.contains(*m));
                self.unacknowledged.retain(|m| self.suspects.contains(m));
                self.cm_suspicion = None;
                self.event(Event::Committed(new.config));
            }
            // Installed here with its regions, but not acknowledged by every member: the CM
            // drives that configuration again (it is not committed), and the commit that maps
            // the regions answers the requester (above). Refused, the regions would be
            // committed all the same, for nobody.
            (Err(e), Change::Allocate(p)) if p.mapped_in(local.map) => {
                self.event(Event::Failed(format!(
                    "allocating {} regions for {}: {e}",
                    p.request.count, p.request.from
                )));
                self.preparing = Some(*p);
            }
            // Nothing maps the regions anywhere (a configuration the store may hold has the
            // members alone; the map travels in NEW-CONFIG): they are released.
            (Err(e), Change::Allocate(p)) => self.refuse(*p, e.to_string(), now, local),
            (Err(e), Change::Join(j)) => {
                let lease = self.params.lease_ticks;
                let wait = self
                    .join_backoff
                    .get(&j)
                    .map_or(JOIN_BACKOFF_LEASES * lease, |(_, w)| {
                        (w * 2).min(JOIN_BACKOFF_LEASES_MAX * lease)
                    });
                self.join_backoff.insert(j, (now + wait, wait));
                self.event(Event::Failed(format!("adding {j}: {e}")));
            }
            (Err(e), Change::Remove(suspects)) => {
                // The suspicions stand: another attempt a takeover period later, from the
                // stored configuration (which this one may have advanced). Members that did
                // not acknowledge a configuration installed here are suspects of the next
                // one: the attempt's suspects are not members of it, and without them
                // nobody would commit it (§5.2 step 6 needs every member's ack).
                let at = now + self.params.takeover_ticks();
                let mut forgiven = BTreeSet::new();
                // The installed configuration has two members, this machine and the one it
                // suspects: no majority of it leaves out either, and every configuration after
                // it is driven by its CM with both answering. The suspicion can never be acted
                // on, and nobody can have removed the other machine behind this one's back
                // (the CM installs any configuration that leaves its member out as it drives
                // it). Standing, it made each machine refuse the other's leases for good.
                let no_majority =
                    matches!(e, ReconfigError::NoMajority { .. }) && base == local.config.id;
                let pair = no_majority && local.config.members.len() == 2;
                match &e {
                    ReconfigError::NotAcknowledged { config, missing }
                        if local.config.id == *config =>
                    {
                        for m in missing.iter().filter(|m| **m != self.me) {
                            if self.suspects.insert(*m) {
                                self.unacknowledged.insert(*m);
                            }
                        }
                    }
                    // Removing the members that were only slow to acknowledge would leave no
                    // majority: wait for them instead, driving the stored configuration again
                    // (NEW-CONFIG repeated). A failed one's lease expires and suspects it.
                    ReconfigError::NoMajority { .. } => {
                        forgiven = std::mem::take(&mut self.unacknowledged);
                    }
                    _ => {}
                }
                // A majority answered, but removing the CM would leave a region without a
                // complete replica. Not for want of a majority: a member cut off from it may
                // have been removed meanwhile with its CM, and renewing with that CM would let
                // it serve what the majority has overwritten; it keeps suspecting (its lease
                // lapses, and it serves nothing) and tries again. Unless the configuration has
                // two members (`pair`): then nobody can have removed either.
                let removal_impossible = pair || matches!(e, ReconfigError::Remap(_));
                match self.cm_suspicion.as_mut() {
                    // The CM cannot be removed: a CM that came back from a pause would
                    // otherwise never be renewed here, and this member would stop serving for
                    // good (its own lease at the CM lapses). Forgiven, it gets a lease period;
                    // if it is really gone, the lease runs out and suspects it again.
                    // If this member cannot write to it either, that stays so while both are
                    // members: the CM is asked to remove this member instead (repeated with
                    // every attempt that fails so).
                    Some(s) if removal_impossible => {
                        let (cm, unreachable) = (s.cm, s.unreachable);
                        self.cm_suspicion = None;
                        self.cm_retry_at = at;
                        self.effects.push(Effect::ForgiveCm(cm));
                        if unreachable && !pair {
                            let config = local.config.id;
                            let msg = ControlMsg::Unreachable {
                                config,
                                machine: cm,
                            };
                            self.effects.push(Effect::Send(cm, msg));
                        }
                    }
                    Some(s) => s.not_before = at,
                    // A CM that found no majority cannot act on its suspicions, in a
                    // configuration of two (above) or any other: the probes it lacked may have
                    // failed only for a partition since healed, and a standing suspicion makes
                    // it refuse the suspect's leases, so that a live suspect suspects it in turn
                    // and is never renewed. Each suspect is forgiven and renews with it again
                    // (`Effect::ForgiveMember`); one that failed is suspected again a lease
                    // later. Before, a CM that had suspected a live member kept removing it
                    // with the two the partition had cut off, three of six, for good
                    // (simulator seed 121 of the partitions). Forgiving lets no member serve
                    // longer: a CM grants no lease past its own leases at its members
                    // (`crate::lease`).
                    None if no_majority => {
                        forgiven.extend(suspects.iter().chain(&self.suspects).copied());
                        (self.effects).extend(forgiven.iter().map(|m| Effect::ForgiveMember(*m)));
                    }
                    None => {
                        self.suspects.extend(suspects.iter().copied());
                        // Ends of broken links that cannot go without a region's last complete
                        // replica: the other ends go instead (`cut_off`). Either end: the cover
                        // may pick a machine that cannot write (seed 726 of the partitions).
                        if let ReconfigError::Remap(RemapError::RegionsLost(lost)) = &e {
                            let holds_lost = |m: MachineId| {
                                lost.iter()
                                    .any(|r| local.map.get(*r).is_some_and(|p| p.holds(m)))
                            };
                            let stuck: Vec<MachineId> = suspects
                                .iter()
                                .copied()
                                .filter(|m| self.cm.ends_a_broken_link(*m) && holds_lost(*m))
                                .collect();
                            self.cm.irremovable.extend(stuck);
                            let irremovable = &self.cm.irremovable;
                            self.suspects.retain(|m| !irremovable.contains(m));
                        }
                    }
                }
                self.suspects.retain(|m| !forgiven.contains(m));
                self.retry_at = at;
                self.event(Event::Failed(e.to_string()));
            }
        }
    }

    /// Advances time: acknowledges what was installed, repeats what is unanswered, and starts
    /// or advances reconfiguration.
    pub fn tick(&mut self, now: u64, local: &Local<'_>) {
        self.follow(local);
        if self.evicted || local.evicted {
            return;
        }
        let me = self.me;
        let c = local.config;
        if let Some((id, cm)) = self.ack_due {
            if local.config.id > id {
                self.ack_due = None;
            } else if local.config.id == id && local.workers_ready {
                self.ack_due = None;
                self.send(cm, ControlMsg::NewConfigAck(id), now, local);
            }
        }
        if !c.contains(me) {
            // A new incarnation outside the configuration: ask the stored one's CM to add it.
            let every = JOIN_REPEATS * self.params.repeat_ticks;
            if self
                .last_join
                .is_none_or(|at| now >= at.saturating_add(every))
            {
                self.last_join = Some(now);
                self.read_store(|r| r.join = true);
            }
            return;
        }
        if now >= self.last_report.saturating_add(self.params.repeat_ticks) {
            self.last_report = now;
            self.repeat(now, local);
        }
        if let Some(a) = self.attempt.as_mut() {
            if now >= a.last_repeat.saturating_add(self.params.repeat_ticks) {
                a.last_repeat = now;
                let again: Vec<(MachineId, ControlMsg)> =
                    a.pending.iter().map(|(m, msg)| (*m, msg.clone())).collect();
                self.effects
                    .extend(again.into_iter().map(|(m, msg)| Effect::Send(m, msg)));
            }
            let a = self.attempt.as_mut().expect("attempt");
            a.reconfig.tick(now);
            self.pump(now, local);
            return;
        }
        if self.reading.outstanding {
            return;
        }
        if c.cm == me {
            let uncommitted = local.committed < c.id;
            let due = (!self.suspects.is_empty()
                || !self.cm.cut_off(me, &self.suspects).is_empty()
                || uncommitted
                || self.cas_unknown)
                && now >= self.retry_at;
            let settled = local.all_active >= c.id && self.suspects.is_empty();
            self.allocation_tick(settled && !due, now, local);
            let prepared = settled && !due && self.prepared(now, local);
            let joiner = settled
                && self.cm.joins.iter().any(|j| {
                    self.join_backoff
                        .get(j)
                        .is_none_or(|(until, _)| now >= *until)
                });
            if due || joiner || prepared {
                self.read_store(|r| r.attempt = true);
            }
            return;
        }
        let Some(s) = self.cm_suspicion else {
            return;
        };
        if now >= s.next_check {
            // Was this machine removed meanwhile? Only the store can tell.
            let every = (s.check_every * 2)
                .min(SILENT_CHECK_LEASES_MAX * self.params.lease_ticks)
                .max(s.check_every);
            let s = self.cm_suspicion.as_mut().expect("suspicion");
            s.next_check = now + s.check_every;
            s.check_every = every;
            self.read_store(|_| {});
        }
        let Some(s) = self.cm_suspicion else {
            return;
        };
        let order = backup_cms(c, c.members.len());
        let rank = order.iter().position(|m| *m == me).unwrap_or(order.len()) as u64;
        let turn = s.since + rank * self.params.takeover_ticks();
        if now >= turn && now >= s.not_before {
            self.read_store(|r| r.attempt = true);
        }
    }

    fn read_store(&mut self, why: impl FnOnce(&mut Reading)) {
        why(&mut self.reading);
        if !self.reading.outstanding {
            self.reading.outstanding = true;
            self.effects.push(Effect::ReadStore);
        }
    }

    /// A member's REGIONS-ACTIVE until ALL-REGIONS-ACTIVE; the CM's NEW-CONFIG-COMMIT to
    /// members that have not reported, and its ALL-REGIONS-ACTIVE once all have (§5.4).
    fn repeat(&mut self, now: u64, local: &Local<'_>) {
        let me = self.me;
        let c = local.config;
        if self.preparing.is_some() {
            self.send_prepares(now, local);
        }
        let every = JOIN_REPEATS * self.params.repeat_ticks;
        if now >= self.last_request.saturating_add(every) {
            let requests: Vec<u64> = self.requested.keys().copied().collect();
            for r in requests {
                self.ask(r, now, local);
            }
        }
        let committed = local.committed >= c.id;
        let all_active = local.all_active >= c.id;
        if c.cm == me {
            if committed && local.regions_active {
                self.cm.regions_active.insert(me);
            }
            // Once every member reported, every member committed: nothing to repeat (the
            // first configuration starts so, committed everywhere).
            if committed && !all_active {
                let silent: Vec<MachineId> = c
                    .members
                    .iter()
                    .copied()
                    .filter(|m| *m != me && !self.cm.regions_active.contains(m))
                    .collect();
                for m in silent {
                    self.effects
                        .push(Effect::Send(m, ControlMsg::NewConfigCommit(c.id)));
                }
            }
            if self.all_reported(c) {
                self.all_active_here(local);
            }
        } else if committed && !all_active && local.regions_active {
            self.effects
                .push(Effect::Send(c.cm, ControlMsg::RegionsActive(c.id)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plane() -> ControlPlane {
        ControlPlane::new(
            MachineId(1),
            PlaneParams {
                replicas: 2,
                regions_max: 16,
                machines_max: 4,
                lease_ticks: 10,
                lease_longest_ticks: 10,
                ack_timeout_ticks: 100,
                repeat_ticks: 1,
            },
        )
    }

    #[test]
    fn a_fresh_plane_keeps_its_invariants() {
        plane().invariants();
    }

    /// Broken links as (writer, target) pairs, with the members whose removal failed.
    fn cm_state(links: &[(u16, u16)], irremovable: &[u16]) -> CmState {
        let mut cm = CmState::default();
        for (w, t) in links {
            let by = cm.unreachable.entry(MachineId(*t)).or_default();
            by.insert(MachineId(*w));
        }
        cm.irremovable = irremovable.iter().map(|m| MachineId(*m)).collect();
        cm
    }

    fn ids(ms: &[u16]) -> Vec<MachineId> {
        ms.iter().map(|m| MachineId(*m)).collect()
    }

    /// One end of every broken link goes, as few machines as will do, never the CM itself nor
    /// a member holding a region's last complete replica.
    #[test]
    fn the_cm_removes_the_fewest_machines_that_end_every_broken_link() {
        let me = MachineId(1);
        let none = BTreeSet::new();
        // One link: the machine that cannot be written to, unless it is the CM or irremovable.
        assert_eq!(cm_state(&[(3, 2)], &[]).cut_off(me, &none), ids(&[2]));
        assert_eq!(cm_state(&[(3, 1)], &[]).cut_off(me, &none), ids(&[3]));
        assert_eq!(cm_state(&[(3, 2)], &[2]).cut_off(me, &none), ids(&[3]));
        assert_eq!(cm_state(&[(1, 2)], &[2]).cut_off(me, &none), ids(&[]));
        // Seed 54 of the partitions: 3 cannot write to 2, the CM cannot write to 3. Machine 3
        // ends both links (an end of each, 2 and 3, left no majority of four).
        assert_eq!(
            cm_state(&[(3, 2), (1, 3)], &[]).cut_off(me, &none),
            ids(&[3])
        );
        // A machine paused while everyone wrote to it: it alone.
        let star = [(0, 2), (3, 2), (4, 2), (5, 2)];
        assert_eq!(cm_state(&star, &[]).cut_off(me, &none), ids(&[2]));
        // Everyone cut off from the CM: all of them at once (no majority: the members remove
        // the CM), not one at a time around it.
        let cm_alone = [(0, 1), (2, 1), (3, 1)];
        assert_eq!(cm_state(&cm_alone, &[]).cut_off(me, &none), ids(&[0, 2, 3]));
        // Two separate links: one end of each, in that order (one at a time if together they
        // leave no majority).
        assert_eq!(
            cm_state(&[(3, 2), (5, 4)], &[]).cut_off(me, &none),
            ids(&[2, 4])
        );

        // A link a suspect ends needs no other end removed.
        let leaving = BTreeSet::from([MachineId(3)]);
        assert_eq!(
            cm_state(&[(3, 2), (5, 4)], &[]).cut_off(me, &leaving),
            ids(&[4])
        );
    }

    /// The ends go as many per configuration as leave a majority, all at once when the links
    /// are the CM's own or when not even one leaves a majority.
    #[test]
    fn the_cm_removes_ends_of_broken_links_as_many_at_a_time_as_leave_a_majority() {
        let me = MachineId(1);
        let none = BTreeSet::new();
        let set =
            |ms: &[u16]| -> BTreeSet<MachineId> { ms.iter().map(|m| MachineId(*m)).collect() };
        let five = ids(&[1, 2, 3, 4, 5]);
        let four = ids(&[1, 2, 3, 4]);
        // Two separate links among five: both ends at once leave three.
        let two = cm_state(&[(3, 2), (5, 4)], &[]);
        assert_eq!(two.removals(me, &five, &none), set(&[2, 4]));
        // ... but with a suspect beside them, only the first.
        assert_eq!(two.removals(me, &five, &set(&[5])), set(&[2]));
        // Seed 160767 of the partitions: the CM cannot write to 3, machine 2 to 4. Together
        // they leave two of four: machine 3 first, machine 4 in the configuration after.
        let disjoint = cm_state(&[(1, 3), (2, 4)], &[]);
        assert_eq!(disjoint.cut_off(me, &none), ids(&[3, 4]));
        assert_eq!(disjoint.removals(me, &four, &none), set(&[3]));
        assert_eq!(disjoint.removals(me, &ids(&[1, 2, 4]), &none), set(&[4]));
        // Everyone cut off from the CM: all at once, not one at a time around the CM.
        let cm_alone = cm_state(&[(0, 1), (2, 1), (3, 1)], &[]);
        assert_eq!(
            cm_alone.removals(me, &ids(&[0, 1, 2, 3]), &none),
            set(&[0, 2, 3])
        );
        // A pair: removing the other leaves no majority either way; tried at once, as before.
        let pair = cm_state(&[(1, 2)], &[]);
        assert_eq!(pair.removals(me, &ids(&[1, 2]), &none), set(&[2]));
    }

    #[test]
    #[should_panic(expected = "suspects itself")]
    fn a_plane_suspecting_itself_breaks_an_invariant() {
        let mut p = plane();
        p.suspects.insert(MachineId(1));
        p.invariants();
    }

    #[test]
    #[should_panic(expected = "not among suspects")]
    fn an_unacknowledged_member_that_is_no_suspect_breaks_an_invariant() {
        let mut p = plane();
        p.unacknowledged.insert(MachineId(2));
        p.invariants();
    }

    #[test]
    #[should_panic(expected = "beyond machines_max")]
    fn a_machine_beyond_the_layout_breaks_an_invariant() {
        let mut p = plane();
        p.cm.joins.insert(MachineId(9));
        p.invariants();
    }
}
