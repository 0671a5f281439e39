//! A whole-cluster restart (FaRM §2, §5: committed transactions survive the loss of power of
//! every machine): what the machines exchange to restart from their NVRAM, as a deterministic
//! state machine ([`RestartExchange`]) that every deployment and the simulator run.
//!
//! 1. Every machine sends every other what it left in NVRAM ([`ControlMsg::Persisted`]),
//!    repeated until it knows the decision.
//! 2. One machine decides ([`decide`]): machine 0 once it heard from every machine, or, with
//!    a [`LeaveOut`], the lowest machine heard from once [`LeaveOut::after`] passed, without
//!    the machines it did not hear from (machine 0 among them, if its disk died). The plan is
//!    the newest view any machine left ([`restart_view`]), which refuses a region without a
//!    complete replica, under the next configuration id, compare-and-set in the coordination
//!    store at the version it read (a cluster that still reconfigures makes that fail) and
//!    marked as its decision in its life ([`RestartMark`]). It announces it
//!    ([`ControlMsg::Restart`]) to every machine until each acknowledges
//!    ([`ControlMsg::RestartAck`]); the others check it against the store. A machine outside
//!    the decided configuration was removed before the cluster stopped: its NVRAM is stale,
//!    and it stays out.
//!
//!    Two machines may both decide (one did not hear the other in time). The store settles
//!    it: one compare-and-set wins, and a decider that finds the store marked by a machine it
//!    heard from in the life of the mark, or by one it has not heard from, decides nothing and
//!    waits for that machine's announcement. A mark of a machine heard from in another life
//!    was left by a restart that an earlier power loss cut short before anyone installed it,
//!    and is decided over like any stored configuration. The limit: a restart whose decision
//!    was stored and whose decider then never came back does not finish (its plan's view is
//!    known only to the decider); it says so.
//! 3. Each member reopens its NVRAM with that view ([`Effect::Restore`]): its readers resume
//!    every inbound ring at its head word, keeping the complete records after it.
//! 4. A sender continues each ring where its receiver found the tail, which only the receiver
//!    knows: members exchange [`ControlMsg::RingStarts`] before any worker writes
//!    ([`Effect::ResumeOutbound`]).
//! 5. Each member commits the restart configuration ([`Effect::Commit`]); transaction recovery
//!    of what the logs hold starts at the workers' first poll (§5.3), as after any
//!    reconfiguration.
//!
//! Messages travel as control datagrams, so they may be lost, repeated or reordered: each
//! sender repeats until answered, and a machine that finished keeps its exchange to answer
//! peers that missed an answer ([`RestartExchange::on_message`] after the outcome).
//!
//! A machine whose part fails (the store moved on or is another, its NVRAM does not reopen,
//! peers run other worker counts) tells every other machine why
//! ([`ControlMsg::RestartRefused`]) and answers anything they ask later with it. A machine
//! whose restart cannot finish without it (the plan's decider or a member of it, or, before a
//! plan, machine 0 of a restart that waits for every machine) fails at once, naming it
//! ([`RestartError::Refused`]); with a [`LeaveOut`], a machine that refused before a plan
//! counts as one that did not come back. A refusal lost with every repeat leaves the caller's
//! timeout to end the wait.
//!
//! The exchange reads no clock and does no IO: `now` comes from the caller, and the store
//! reads, the compare-and-set and the reopening of NVRAM are effects the caller carries out and
//! reports back.

use std::collections::{BTreeMap, BTreeSet};

use farm_core::codec::{RestartMark, StoredView};
use farm_core::config::Configuration;
use farm_core::{ConfigId, MachineId, RegionId};

use crate::control::ControlMsg;
use crate::store::{CasOutcome, MarkedConfig, StoreVersion};

/// Message ids of the restart's messages, apart from those of the control plane, which count
/// up from zero. A repeat reuses its id: a piece of a long message lost once is made up by the
/// next repeat.
const RESTART_MESSAGE_ID: u64 = 1 << 63;
const PERSISTED_MESSAGE_ID: u64 = RESTART_MESSAGE_ID | 1;
const ACK_MESSAGE_ID: u64 = RESTART_MESSAGE_ID | 2;
const RING_STARTS_MESSAGE_ID: u64 = RESTART_MESSAGE_ID | 3;
const REFUSED_MESSAGE_ID: u64 = RESTART_MESSAGE_ID | 4;

/// How many repeats of a decision or of ring starts go by per repeat of what a machine left
/// (a view is larger than a decision's acknowledgement or a ring start).
const PERSISTED_REPEAT_FACTOR: u64 = 10;

/// Worker threads one machine may run: the most ring starts a message carries.
pub const THREADS_MAX: usize = 1024;

/// What a machine left in NVRAM that a whole-cluster restart decides from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Persisted {
    /// The newest view it installed.
    pub view: StoredView,
    /// The regions it was still copying as a new backup (with whether aggressively): its
    /// replicas of these are incomplete.
    pub copying: BTreeMap<RegionId, bool>,
}

impl Persisted {
    /// Whether this machine, `id`, holds a complete replica of `region`: its own view has it
    /// and it was not still copying it.
    pub fn complete(&self, id: MachineId, region: RegionId) -> bool {
        self.view.map.get(region).is_some_and(|p| p.holds(id))
            && !self.copying.contains_key(&region)
    }
}

/// A whole-cluster restart, decided ([`decide`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartPlan {
    /// The restart configuration, stored: the newest view's configuration under the next id.
    pub config: Configuration,
    /// The newest view the machines left, which the members reopen their NVRAM with.
    pub from: StoredView,
}

/// Why a whole-cluster restart failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RestartError {
    /// Another machine's part failed ([`ControlMsg::RestartRefused`]), and the restart cannot
    /// finish without it: machine 0, or a member of the plan.
    #[error("machine {machine} refused the restart: {reason}")]
    Refused {
        /// The machine that failed.
        machine: MachineId,
        /// Its reason.
        reason: String,
    },
    /// The coordination store failed, holds nothing to restart, or changed under the restart.
    #[error("{0}")]
    Store(String),
    /// What the machines left cannot be restarted from, or they disagree.
    #[error("{0}")]
    Invalid(String),
}

/// Decides the restart of a cluster of `machines` (ids below it) whose store holds
/// configuration `stored`, from what each machine left (`persisted`, by id): the view to
/// resume from ([`restart_view`]) under the next configuration id, without the members that
/// left nothing (did not come back) if `leave_out` allows ([`without`]). The caller stores it
/// with a compare-and-set at the version it read.
pub fn decide(
    stored: ConfigId,
    persisted: &[Option<Persisted>],
    machines: u16,
    leave_out: Option<LeaveOut>,
) -> Result<RestartPlan, String> {
    let mut from = restart_view(stored, persisted)?;
    let absent: Vec<MachineId> = (from.config.members.iter().copied())
        .filter(|m| left_nothing(persisted, *m))
        .collect();
    if !absent.is_empty() {
        let Some(leave_out) = leave_out else {
            return Err(format!(
                "members {absent:?} of configuration {} left nothing to restart from",
                from.config.id.0
            ));
        };
        from = without(from, &absent, persisted, leave_out, ConfigId(stored.0 + 1))?;
    }
    // The view travels in every Restart message and each member persists it before the
    // restart configuration: what the codec refuses would never be announced.
    let encoded = farm_core::codec::encode_view(&from.config, &from.map, &from.changes);
    assert!(
        farm_core::codec::decode_view(&encoded).is_ok_and(|v| v == from),
        "restart view of configuration {} does not survive its codec: {from:?}",
        from.config.id.0
    );
    if let Some(m) = from.config.members.iter().find(|m| m.0 >= machines) {
        return Err(format!(
            "machine {m} is a member of configuration {} but the cluster runs {machines} \
             machines",
            from.config.id.0
        ));
    }
    let config = Configuration {
        id: ConfigId(stored.0 + 1),
        ..from.config.clone()
    };
    Ok(RestartPlan { config, from })
}

/// The view a whole-cluster restart resumes from, given the configuration in the coordination
/// store (`stored`) and what each machine left (`persisted`, by machine id; see
/// the runtime's `read_persisted`): the newest view any machine installed (most regions among equals).
/// The cluster may have stopped at any point, in the middle of a reconfiguration or of
/// recovery included: members that had not installed the newest view take it from there, and
/// the replicas they did not hold, or were still copying, are copied again after the restart
/// (§5.4). A region whose primary in that view holds no complete replica gets a complete backup
/// as its primary. A region that none of its replicas ever installed is left out: a view that
/// allocated it (§3) never committed, since every member acknowledges before the commit, so
/// nothing was written there and its allocation was never answered. Refused, with the reason,
/// when no machine left a view, when the store is behind the NVRAM (another store?), or when a
/// region has no complete replica left.
pub fn restart_view(
    stored: ConfigId,
    persisted: &[Option<Persisted>],
) -> Result<StoredView, String> {
    let newest = persisted
        .iter()
        .flatten()
        .map(|p| &p.view)
        .max_by_key(|v| (v.config.id, v.map.iter().count()))
        .ok_or("no machine left a view: nothing to restart")?;
    if newest.config.id > stored {
        return Err(format!(
            "the coordination store holds configuration {} but machines installed {}: is this \
             the store the cluster ran with?",
            stored.0, newest.config.id.0
        ));
    }
    let mut view = newest.clone();
    let complete = |m: MachineId, r: RegionId| {
        persisted
            .get(m.0 as usize)
            .and_then(Option::as_ref)
            .is_some_and(|p| p.complete(m, r))
    };
    // A member of the newest configuration whose own newest view is older and maps regions
    // (not a joiner that installed nothing) acknowledged every configuration from its view to
    // the newest one's predecessor: a region its map lacks was allocated (§3) in a view that
    // never committed, since this member did not acknowledge it. Its allocation was never
    // answered and nothing is in it, whichever replicas installed it: it is left out, rather
    // than kept with the replicas that did not install it to be copied (while its one
    // complete replica is all that stands between it and a lost region).
    let behind: Vec<&StoredView> = (newest.config.members.iter())
        .filter_map(|m| persisted.get(m.0 as usize).and_then(Option::as_ref))
        .map(|p| &p.view)
        .filter(|v| v.config.id < newest.config.id && v.map.iter().next().is_some())
        .collect();
    let never_committed = |r: RegionId| behind.iter().any(|v| v.map.get(r).is_none());
    let regions: Vec<(RegionId, farm_core::config::Placement)> =
        view.map.iter().map(|(r, p)| (r, p.clone())).collect();
    let installed = |m: MachineId, r: RegionId| {
        persisted
            .get(m.0 as usize)
            .and_then(Option::as_ref)
            .is_some_and(|p| p.view.map.get(r).is_some_and(|q| q.holds(m)))
    };
    for (region, placement) in regions {
        if never_committed(region) {
            view.map.remove(region);
            view.changes.remove(&region);
            continue;
        }
        if complete(placement.primary, region) {
            continue;
        }
        // Of a replica that left nothing (it did not come back) nobody knows what it
        // installed: its region is never taken for one that no replica installed.
        let known_uninstalled = |m: MachineId| !left_nothing(persisted, m) && !installed(m, region);
        if placement.replicas().all(known_uninstalled) {
            // A region in use has a replica that installed a view holding it: its replicas
            // did when it was allocated, and every remap keeps one that held it (§5.2).
            view.map.remove(region);
            view.changes.remove(&region);
            continue;
        }
        let Some(b) = placement
            .backups
            .iter()
            .copied()
            .find(|b| complete(*b, region))
        else {
            let replicas: Vec<MachineId> = placement.replicas().collect();
            let absent: Vec<MachineId> = (replicas.iter().copied())
                .filter(|m| left_nothing(persisted, *m))
                .collect();
            if !absent.is_empty() {
                return Err(format!(
                    "region {} has no complete replica among {replicas:?} (primary {}) but \
                     perhaps on {absent:?}, which did not come back",
                    region.0, placement.primary
                ));
            }
            return Err(format!(
                "region {} has no complete replica among {replicas:?} (primary {}): its data \
                 is lost",
                region.0, placement.primary
            ));
        };
        let mut backups: Vec<MachineId> = placement
            .backups
            .iter()
            .copied()
            .filter(|m| *m != b)
            .collect();
        backups.insert(0, placement.primary);
        // Its changes stay those of the view, which records none after its own
        // configuration: the new primary's change is the restart's, as every region's is
        // (the members reopen in the restart configuration with every primary changed).
        view.map.insert(
            region,
            farm_core::config::Placement {
                primary: b,
                backups,
            },
        );
    }
    Ok(view)
}

/// Whether machine `m` left nothing to restart from (it did not come back, or never ran).
fn left_nothing(persisted: &[Option<Persisted>], m: MachineId) -> bool {
    persisted.get(m.0 as usize).is_none_or(Option::is_none)
}

/// The restart view `view` ([`restart_view`]) without the members `absent`, which did not come
/// back, for restart configuration `restart`: they leave the configuration (its CM too, for
/// the first member that stays) and their replicas the map, which is remapped as a
/// reconfiguration that removes them would ([`crate::remap::remap`]: `f + 1` replicas again
/// where capacity allows, each new one copied after the restart, §5.4). The view's changes
/// stay its own: every region's primary and replicas change at the restart anyway.
/// Refused, naming them, when fewer than a majority of its members came back, or when a region
/// has no complete replica on a machine that came back.
pub fn without(
    view: StoredView,
    absent: &[MachineId],
    persisted: &[Option<Persisted>],
    leave_out: LeaveOut,
    restart: ConfigId,
) -> Result<StoredView, String> {
    let mut config = view.config.clone();
    config.members.retain(|m| !absent.contains(m));
    config.failure_domains.retain(|m, _| !absent.contains(m));
    // A majority of the newest configuration's members, as a reconfiguration needs to go on
    // (§5.2): a minority that came back restarts nothing on its own.
    if config.members.len() * 2 <= view.config.members.len() {
        return Err(format!(
            "only {:?} of configuration {}'s members {:?} came back: a restart without \
             {absent:?} needs a majority",
            config.members, view.config.id.0, view.config.members
        ));
    }
    let first = config.members[0];
    if absent.contains(&config.cm) {
        config.cm = first;
    }
    let copying: BTreeMap<MachineId, BTreeSet<RegionId>> = (config.members.iter())
        .map(|m| {
            let p = persisted[m.0 as usize]
                .as_ref()
                .expect("a member that came back");
            let incomplete = (view.map.iter())
                .filter(|(r, q)| q.holds(*m) && !p.complete(*m, *r))
                .map(|(r, _)| r)
                .collect();
            (*m, incomplete)
        })
        .collect();
    let remapped = crate::remap::remap(
        &view.map,
        &view.changes,
        &Configuration {
            id: restart,
            ..config.clone()
        },
        &copying,
        leave_out.replicas,
        leave_out.regions_max,
    )
    .map_err(|e| format!("without machines {absent:?}, which did not come back: {e}"))?;
    Ok(StoredView {
        config,
        map: remapped.map,
        changes: view.changes,
    })
}

/// Where a machine found each peer's rings to it after reopening its NVRAM, per peer (itself
/// included): per worker thread, `[log head, log tail, queue head, queue tail]`.
pub type RingStarts = BTreeMap<MachineId, Vec<[u64; 4]>>;

/// What the exchange needs to know of its deployment.
#[derive(Clone, Copy, Debug)]
pub struct ExchangeParams {
    /// Machines of the cluster (ids below it), every one of which takes part.
    pub machines: u16,
    /// How long a machine waits for an answer before it repeats an announcement or its ring
    /// starts, in the caller's time unit. What a machine left is repeated
    /// `PERSISTED_REPEAT_FACTOR` times less often.
    pub repeat: u64,
    /// Whether the restart goes on without machines not heard from, and when (`None`: it
    /// waits for every machine).
    pub leave_out: Option<LeaveOut>,
}

/// A restart without the machines that do not come back (a disk that died with the power):
/// after `after` (in the caller's time unit) the lowest machine heard from decides from what
/// the others left, leaving the silent ones out of the restart configuration as a
/// reconfiguration removes a failed machine (§5.2): each of their regions keeps a complete
/// replica on a machine that came back, or the restart is refused naming it, and gets `f + 1`
/// replicas again where capacity allows. A machine left out that comes back later learns it
/// is out (its NVRAM is stale) and can join as a new machine.
#[derive(Clone, Copy, Debug)]
pub struct LeaveOut {
    /// How long a machine waits for every machine first.
    pub after: u64,
    /// Replicas per region (`f + 1`).
    pub replicas: usize,
    /// Most region replicas one machine may hold.
    pub regions_max: usize,
}

/// What the caller does for the exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Send a control message, as datagrams of message `id` (`ControlMsg::datagrams`).
    Send {
        /// The receiver.
        to: MachineId,
        /// The message.
        msg: ControlMsg,
        /// Its message id: the same for each repeat.
        id: u64,
    },
    /// Read the coordination store with its restart mark; report with
    /// [`RestartExchange::on_store_read`].
    ReadStore,
    /// Store the restart configuration, marked as this machine's decision, if the store still
    /// holds `expected`; report with [`RestartExchange::on_cas`].
    CompareAndSet {
        /// The version read.
        expected: StoreVersion,
        /// The restart configuration.
        config: Configuration,
        /// This machine in its life.
        mark: RestartMark,
    },
    /// Reopen this machine's NVRAM with the plan's view in the restart configuration; report
    /// where its inbound rings resume with [`RestartExchange::on_restored`].
    Restore(RestartPlan),
    /// Continue this machine's outbound rings to `receiver` where it found them: per worker
    /// thread, `[log head, log tail, queue head, queue tail]`.
    ResumeOutbound {
        /// The receiver of the rings.
        receiver: MachineId,
        /// Per worker thread.
        starts: Vec<[u64; 4]>,
    },
    /// Commit the restart configuration: transaction recovery starts (§5.3).
    Commit(ConfigId),
}

/// How a machine's restart ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// This machine restarted as a member of the plan's configuration.
    Restarted(RestartPlan),
    /// This machine is not a member of the plan's configuration: it was removed before the
    /// cluster stopped, so its NVRAM is stale.
    Removed(RestartPlan),
    /// The restart failed here.
    Failed(RestartError),
}

/// Where a machine is in its restart. `all` is what every machine left, by id, as far as this
/// one heard.
#[derive(Debug)]
enum Phase {
    /// Hearing what every machine left and telling every other what this one left, until a
    /// decision is known or this machine's turn to decide comes.
    Gathering(Vec<Option<Persisted>>),
    /// Deciding here: reading the store.
    Reading(Vec<Option<Persisted>>),
    /// Storing the plan decided here.
    Storing(RestartPlan, Vec<Option<Persisted>>),
    /// The store changed under this machine's decision: reading it again to learn whether
    /// another machine decided.
    Rereading(Vec<Option<Persisted>>),
    /// Checking a plan that its decider announced against the store.
    Checking(RestartPlan, MachineId),
    /// Decided: a member reopens its NVRAM, the decider announces the plan.
    Decided,
}

/// One machine's part of a whole-cluster restart (see the module docs).
#[derive(Debug)]
pub struct RestartExchange {
    me: MachineId,
    params: ExchangeParams,
    /// This machine's life: drawn by the caller at every start, so that a restart
    /// configuration marked with it is told from one an earlier life stored.
    life: u64,
    phase: Phase,
    /// The plan, once decided here, and the machine that decided it.
    plan: Option<(RestartPlan, MachineId)>,
    /// The life of every machine heard from in this restart (itself included).
    lives: BTreeMap<MachineId, u64>,
    /// A decision marked in the store by a machine of this restart, or by one not heard from
    /// (perhaps of an earlier life): no decision here while it stands; its decider's
    /// announcement is awaited.
    deferred: Option<RestartMark>,
    /// The decider: the machines that learnt the plan (itself included).
    learnt: BTreeSet<MachineId>,
    /// A member, once its NVRAM is open: where it found each member's rings to it.
    mine: Option<RingStarts>,
    /// The members whose ring starts arrived (itself included, once open).
    resumed: BTreeSet<MachineId>,
    outcome: Option<Outcome>,
    /// When this machine last repeated its messages.
    last_repeat: Option<u64>,
    /// Refusals of peers whose part failed ([`ControlMsg::RestartRefused`]) that stop no
    /// restart this machine knows of yet: the restart configuration each failed in.
    refusals: BTreeMap<MachineId, (ConfigId, String)>,
    /// Whether it sent announcements or ring-start requests since its last tick (on deciding
    /// or reopening), which the next tick counts as its repeat.
    sent_since_tick: bool,
    /// When this machine last told the others what it left.
    last_told: Option<u64>,
    /// When it started gathering (its first tick, or when a restart without the machines not
    /// heard from was last refused), and, as decider, the machines it heard from when it
    /// decided (those that did not come back never learn the plan from it).
    gathering_since: Option<u64>,
    heard: BTreeSet<MachineId>,
    /// Why this machine, whose turn to decide came, still waits ([`LeaveOut::after`] passed).
    not_left_out: Option<String>,
    effects: Vec<Effect>,
}

impl RestartExchange {
    /// Machine `me`'s restart, which left `persisted` in its NVRAM, in its life `life` (a
    /// number the caller draws afresh at every start of the machine).
    pub fn new(me: MachineId, params: ExchangeParams, persisted: Persisted, life: u64) -> Self {
        assert!(
            me.0 < params.machines,
            "{me} is outside a cluster of {}",
            params.machines
        );
        assert!(params.repeat > 0, "a repeat interval of zero");
        let mut all: Vec<Option<Persisted>> = vec![None; params.machines as usize];
        all[me.0 as usize] = Some(persisted);
        let mut exchange = Self {
            me,
            params,
            life,
            phase: Phase::Gathering(all),
            plan: None,
            lives: BTreeMap::from([(me, life)]),
            deferred: None,
            learnt: BTreeSet::new(),
            mine: None,
            resumed: BTreeSet::new(),
            outcome: None,
            last_repeat: None,
            refusals: BTreeMap::new(),
            gathering_since: None,
            heard: BTreeSet::new(),
            not_left_out: None,
            sent_since_tick: false,
            last_told: None,
            effects: Vec::new(),
        };
        exchange.gathered();
        exchange
    }

    /// The machine.
    pub fn machine(&self) -> MachineId {
        self.me
    }

    /// How the restart ended here, once it did.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    /// The effects decided since the last call, in order.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// The machines this one waits for, to name them when the caller gives up.
    pub fn waiting_for(&self) -> Vec<MachineId> {
        if self.outcome.is_some() {
            return Vec::new();
        }
        let all = (0..self.params.machines).map(MachineId);
        match &self.phase {
            Phase::Gathering(p) => {
                let silent: Vec<MachineId> = all.filter(|m| p[m.0 as usize].is_none()).collect();
                match self.deferred {
                    Some(mark) => vec![mark.decider],
                    // Everyone came back: the decision is machine 0's.
                    None if silent.is_empty() && self.me != MachineId(0) => vec![MachineId(0)],
                    None => silent,
                }
            }
            Phase::Reading(_) | Phase::Storing(..) | Phase::Rereading(_) => Vec::new(),
            Phase::Checking(_, decider) => vec![*decider],
            Phase::Decided => {
                let (plan, decider) = self.plan.as_ref().expect("decided");
                if plan.config.contains(self.me) {
                    plan.config
                        .members
                        .iter()
                        .copied()
                        .filter(|m| !self.resumed.contains(m))
                        .collect()
                } else if *decider == self.me {
                    all.filter(|m| !self.learnt.contains(m)).collect()
                } else {
                    Vec::new()
                }
            }
        }
    }

    /// Why this machine, whose turn to decide came ([`LeaveOut::after`] passed and no lower
    /// machine was heard from), still waits for the machines [`RestartExchange::waiting_for`]
    /// names: a restart without them would lose a region's every complete replica or lack a
    /// majority, or the store holds another machine's decision whose announcement has not
    /// come.
    pub fn not_left_out(&self) -> Option<&str> {
        match self.phase {
            Phase::Gathering(_) => self.not_left_out.as_deref(),
            _ => None,
        }
    }

    /// Advances the exchange to `now`: repeats what has not been answered, and decides when
    /// this machine's turn came.
    pub fn tick(&mut self, now: u64) {
        if self.outcome.is_some() {
            return;
        }
        let repeat = self.params.repeat;
        if let Phase::Gathering(all) = &self.phase {
            let told = self
                .last_told
                .is_some_and(|at| now.saturating_sub(at) < repeat * PERSISTED_REPEAT_FACTOR);
            let mine = (!told).then(|| all[self.me.0 as usize].clone().expect("its own"));
            let since = *self.gathering_since.get_or_insert(now);
            let waited = self
                .params
                .leave_out
                .is_some_and(|l| now.saturating_sub(since) >= l.after);
            // A restart without the machines that did not come back, decided by the lowest
            // machine that did.
            let lowest = all[..self.me.0 as usize].iter().all(Option::is_none);
            let missing = all.iter().any(Option::is_none);
            if let Some(p) = mine {
                self.last_told = Some(now);
                self.tell_others(p);
            }
            if waited && lowest && self.deferred.is_none() && missing {
                self.decide_now();
            }
            return;
        }
        if !matches!(self.phase, Phase::Decided) {
            return;
        }
        if std::mem::take(&mut self.sent_since_tick) {
            self.last_repeat = Some(now);
            return;
        }
        if self
            .last_repeat
            .is_some_and(|at| now.saturating_sub(at) < repeat)
        {
            return;
        }
        self.last_repeat = Some(now);
        self.announce_unlearnt();
        self.request_ring_starts();
    }

    /// Tells every other machine what this one left, `p`.
    fn tell_others(&mut self, p: Persisted) {
        let msg = ControlMsg::Persisted {
            view: p.view,
            copying: p.copying,
            life: self.life,
        };
        for m in (0..self.params.machines).map(MachineId) {
            if m != self.me {
                self.send(m, msg.clone(), PERSISTED_MESSAGE_ID);
            }
        }
    }

    /// Whether this machine decided the plan.
    fn deciding(&self) -> bool {
        self.plan.as_ref().is_some_and(|(_, d)| *d == self.me)
    }

    /// The decider: announces the plan to every machine that has not acknowledged it.
    fn announce_unlearnt(&mut self) {
        if !self.deciding() {
            return;
        }
        let (plan, _) = self.plan.clone().expect("decided");
        for m in (0..self.params.machines).map(MachineId) {
            if !self.learnt.contains(&m) {
                self.announce(m, &plan);
            }
        }
    }

    /// A reopened member: asks every member whose ring starts have not arrived for them.
    fn request_ring_starts(&mut self) {
        let (plan, _) = self.plan.clone().expect("decided");
        if let Some(mine) = &self.mine {
            let requests: Vec<(MachineId, Vec<[u64; 4]>)> = mine
                .iter()
                .filter(|(m, _)| !self.resumed.contains(m))
                .map(|(m, s)| (*m, s.clone()))
                .collect();
            for (m, starts) in requests {
                self.send_starts(m, plan.config.id, false, starts);
            }
        }
    }

    /// `from` is heard from in its life `life`. A deferral to a decision of `from` marked with
    /// another life ends: an earlier life of `from` stored it, and never finished it.
    fn heard_life(&mut self, from: MachineId, life: u64) {
        self.lives.insert(from, life);
        if self
            .deferred
            .is_some_and(|d| d.decider == from && d.life != life)
        {
            self.deferred = None;
            self.not_left_out = None;
        }
    }

    /// A control message of the restart from `from` (others are ignored). After the outcome,
    /// it still answers: the decider announces the plan to a machine that missed it, and a
    /// member gives a peer the ring starts it asks for again.
    pub fn on_message(&mut self, from: MachineId, msg: ControlMsg) {
        if from == self.me || from.0 >= self.params.machines {
            return;
        }
        if let Some(Outcome::Failed(e)) = &self.outcome {
            // Whatever a peer still asks of the restart, it learns why this machine is out.
            if !matches!(msg, ControlMsg::RestartRefused { .. }) {
                let refusal = self.refusal(e.to_string());
                self.send(from, refusal, REFUSED_MESSAGE_ID);
            }
            return;
        }
        match msg {
            ControlMsg::RestartRefused { restart, reason } => {
                self.on_refused(from, restart, reason)
            }
            ControlMsg::Persisted {
                view,
                copying,
                life,
            } => {
                self.heard_life(from, life);
                if let Phase::Gathering(all) = &mut self.phase {
                    if !self.refusals.contains_key(&from) {
                        all[from.0 as usize] = Some(Persisted { view, copying });
                    }
                    self.gathered();
                } else if self.deciding() {
                    // It missed the announcement (or its acknowledgement was lost).
                    let (plan, _) = self.plan.clone().expect("deciding");
                    self.announce(from, &plan);
                }
            }
            ControlMsg::Restart {
                restart,
                from: view,
                life,
            } => {
                self.heard_life(from, life);
                let plan = RestartPlan {
                    config: Configuration {
                        id: restart,
                        ..view.config.clone()
                    },
                    from: view,
                };
                if matches!(self.phase, Phase::Gathering(_)) {
                    self.phase = Phase::Checking(plan, from);
                    self.effects.push(Effect::ReadStore);
                }
                let known = match (&self.phase, &self.plan) {
                    (Phase::Checking(p, d), _) | (_, Some((p, d))) => Some((p.config.id, *d)),
                    _ => None,
                };
                if known == Some((restart, from)) {
                    self.send(from, ControlMsg::RestartAck(restart), ACK_MESSAGE_ID);
                }
            }
            ControlMsg::RestartAck(id)
                if self.deciding()
                    && self.plan.as_ref().is_some_and(|(p, _)| p.config.id == id) =>
            {
                self.learnt.insert(from);
                self.finish_if_done();
            }
            ControlMsg::RingStarts {
                config,
                reply,
                starts,
            } => self.on_ring_starts(from, config, reply, starts),
            _ => {}
        }
    }

    /// `from`'s part of the restart failed in restart configuration `restart` (0: before it
    /// knew one). This machine fails too if its restart cannot finish without `from`: `from`
    /// decided the plan this machine knows or is a member of it, or, before a plan, the
    /// restart waits for every machine (no [`LeaveOut`]) and `from` is machine 0, which
    /// decides it. With a [`LeaveOut`], a machine that refused before a plan is one that did
    /// not come back. The decider outside the plan counts the refusal of a machine that knew
    /// the plan as its acknowledgement. Other refusals are kept for a plan learnt later.
    fn on_refused(&mut self, from: MachineId, restart: ConfigId, reason: String) {
        if self.outcome.is_some() {
            return;
        }
        self.refusals.insert(from, (restart, reason));
        if let Phase::Gathering(all) = &mut self.phase {
            if self.params.leave_out.is_some() {
                all[from.0 as usize] = None;
            }
        }
        self.check_refusals();
        if self.outcome.is_some() || !self.deciding() {
            return;
        }
        if self
            .plan
            .as_ref()
            .is_some_and(|(p, _)| p.config.id == restart)
        {
            self.learnt.insert(from);
            self.finish_if_done();
        }
    }

    /// Fails on a kept refusal that stops the restart this machine knows of.
    fn check_refusals(&mut self) {
        if self.outcome.is_some() {
            return;
        }
        let plan = self.known_plan();
        let waits_for_all = self.params.leave_out.is_none();
        let blocking = self.refusals.iter().find(|(m, (restart, _))| match plan {
            Some((p, decider)) => {
                p.config.id == *restart && (p.config.contains(**m) || decider == **m)
            }
            None => waits_for_all && m.0 == 0,
        });
        if let Some((machine, (_, reason))) = blocking {
            let e = RestartError::Refused {
                machine: *machine,
                reason: reason.clone(),
            };
            self.phase = Phase::Decided;
            self.outcome = Some(Outcome::Failed(e));
        }
    }

    /// The plan this machine knows, with its decider: decided, or being checked or stored.
    fn known_plan(&self) -> Option<(&RestartPlan, MachineId)> {
        match &self.phase {
            Phase::Checking(p, d) => Some((p, *d)),
            Phase::Storing(p, _) => Some((p, self.me)),
            _ => self.plan.as_ref().map(|(p, d)| (p, *d)),
        }
    }

    /// The refusal this machine sends, with the restart configuration it knew.
    fn refusal(&self, reason: String) -> ControlMsg {
        let restart = self.known_plan().map_or(ConfigId(0), |(p, _)| p.config.id);
        ControlMsg::RestartRefused { restart, reason }
    }

    fn on_ring_starts(
        &mut self,
        from: MachineId,
        config: ConfigId,
        reply: bool,
        starts: Vec<[u64; 4]>,
    ) {
        let Some((plan, _)) = self.plan.as_ref().filter(|(p, _)| p.config.id == config) else {
            return;
        };
        // Before its NVRAM is open, a member has nothing to answer with: the peer repeats.
        let Some(answer) = self.mine.as_ref().and_then(|m| m.get(&from)).cloned() else {
            return;
        };
        let id = plan.config.id;
        if starts.len() != answer.len() {
            self.fail(RestartError::Invalid(format!(
                "machine {from} runs {} workers and this machine {}: every machine of a \
                 cluster runs as many",
                starts.len(),
                answer.len()
            )));
            return;
        }
        if !reply {
            self.send_starts(from, id, true, answer);
        }
        if self.deciding() {
            // A member asks for ring starts only once it learnt the plan.
            self.learnt.insert(from);
        }
        if self.outcome.is_none() && self.resumed.insert(from) {
            self.effects.push(Effect::ResumeOutbound {
                receiver: from,
                starts,
            });
        }
        self.finish_if_done();
    }

    /// Whether a restart configuration marked `mark` in the store is a decision this machine
    /// must not decide over: one of a machine heard from in the life it was stored in (this
    /// restart's), or of a machine not heard from, which may be deciding this restart too. A
    /// decision marked by a machine heard from in another life was stored by an earlier life
    /// and never finished: nobody installed it (a member's view would be at least as new), and
    /// a restart decides over it as over any stored configuration.
    fn stands(&self, mark: RestartMark) -> bool {
        self.lives
            .get(&mark.decider)
            .is_none_or(|life| *life == mark.life)
    }

    /// Waits for the decision `mark` names instead of deciding, back to gathering.
    fn defer(&mut self, all: Vec<Option<Persisted>>, mark: RestartMark, stored: ConfigId) {
        self.not_left_out = Some(format!(
            "machine {} decided restart configuration {} in the coordination store; waiting \
             for its announcement",
            mark.decider, stored.0
        ));
        self.deferred = Some(mark);
        self.phase = Phase::Gathering(all);
    }

    /// What the store holds (`Ok(None)`: nothing), with its restart mark, or why it could not
    /// be read.
    pub fn on_store_read(&mut self, stored: Result<Option<MarkedConfig>, String>) {
        let (version, config, mark) = match stored {
            Ok(Some(s)) => s,
            Ok(None) => {
                return self.fail(RestartError::Store(
                    "the coordination store holds no configuration: nothing to restart".into(),
                ))
            }
            Err(e) => {
                return self.fail(RestartError::Store(format!(
                    "reading the stored configuration: {e}"
                )))
            }
        };
        match std::mem::replace(&mut self.phase, Phase::Decided) {
            Phase::Reading(all) => {
                if let Some(mark) = mark.filter(|m| self.stands(*m)) {
                    return self.defer(all, mark, config.id);
                }
                match decide(config.id, &all, self.params.machines, self.params.leave_out) {
                    Ok(plan) => {
                        self.effects.push(Effect::CompareAndSet {
                            expected: version,
                            config: plan.config.clone(),
                            mark: RestartMark {
                                decider: self.me,
                                life: self.life,
                            },
                        });
                        self.phase = Phase::Storing(plan, all);
                    }
                    Err(e) if all.iter().any(Option::is_none) => {
                        // Without the machines not heard from, the restart would lose data or
                        // lack a majority: wait for them, and decide again when they come
                        // back or after another `LeaveOut::after`.
                        self.gathering_since = None;
                        self.phase = Phase::Gathering(all);
                        self.not_left_out = Some(e);
                        self.gathered();
                    }
                    Err(e) => self.fail(RestartError::Invalid(e)),
                }
            }
            Phase::Rereading(all) => match mark.filter(|m| self.stands(*m)) {
                // Another machine decided meanwhile: its announcement comes.
                Some(mark) => self.defer(all, mark, config.id),
                None => self.fail(RestartError::Store(
                    "the stored configuration changed during the restart: is the cluster \
                     running?"
                        .into(),
                )),
            },
            Phase::Checking(plan, decider) => {
                if config == plan.config && mark.is_some_and(|m| m.decider == decider) {
                    self.decided(plan, decider);
                } else {
                    self.fail(RestartError::Store(format!(
                        "the coordination store holds configuration {} (members {:?}), not \
                         restart configuration {} (members {:?}) that machine {decider} \
                         announced",
                        config.id.0, config.members, plan.config.id.0, plan.config.members
                    )));
                }
            }
            other => panic!("a store read in phase {other:?}"),
        }
    }

    /// The outcome of the compare-and-set of the plan, or why it is unknown.
    pub fn on_cas(&mut self, result: Result<CasOutcome, String>) {
        let Phase::Storing(plan, all) = std::mem::replace(&mut self.phase, Phase::Decided) else {
            panic!("a compare-and-set outside the storing phase");
        };
        match result {
            Ok(CasOutcome::Written(_)) => {
                // Announced before this machine reopens its own NVRAM.
                self.learnt.insert(self.me);
                self.plan = Some((plan.clone(), self.me));
                self.announce_unlearnt();
                self.sent_since_tick = true;
                self.decided(plan, self.me);
            }
            Ok(CasOutcome::Conflict) => {
                // Another machine's decision (both turns came), or a cluster that runs.
                self.phase = Phase::Rereading(all);
                self.effects.push(Effect::ReadStore);
            }
            Err(e) => self.fail(RestartError::Store(format!(
                "storing the restart configuration: {e}"
            ))),
        }
    }

    /// This member's NVRAM is open: where it found each member's rings to it, or why it could
    /// not be opened.
    pub fn on_restored(&mut self, starts: Result<RingStarts, String>) {
        let (plan, _) = self.plan.clone().expect("restored without a plan");
        let starts = match starts {
            Ok(s) => s,
            Err(e) => {
                return self.fail(RestartError::Invalid(format!(
                    "reopening machine {}'s NVRAM: {e}",
                    self.me
                )))
            }
        };
        assert!(
            self.mine.is_none() && starts.keys().eq(plan.config.members.iter()),
            "ring starts of {:?} for members {:?}",
            starts.keys().collect::<Vec<_>>(),
            plan.config.members
        );
        assert!(
            starts
                .values()
                .all(|s| !s.is_empty() && s.len() <= THREADS_MAX),
            "ring starts of no worker or more than {THREADS_MAX}"
        );
        self.effects.push(Effect::ResumeOutbound {
            receiver: self.me,
            starts: starts[&self.me].clone(),
        });
        self.resumed.insert(self.me);
        self.mine = Some(starts);
        self.request_ring_starts();
        self.sent_since_tick = true;
        self.finish_if_done();
    }

    /// The plan `decider` decided is decided here (stored here, or checked against the store).
    fn decided(&mut self, plan: RestartPlan, decider: MachineId) {
        self.phase = Phase::Decided;
        self.plan = Some((plan.clone(), decider));
        self.check_refusals();
        if self.outcome.is_some() {
            return;
        }
        if plan.config.contains(self.me) {
            self.effects.push(Effect::Restore(plan));
        } else {
            self.finish_if_done();
        }
    }

    /// Machine 0 with what every machine left: reads the store to decide.
    fn gathered(&mut self) {
        if let Phase::Gathering(all) = &self.phase {
            if self.me.0 == 0 && self.deferred.is_none() && all.iter().all(Option::is_some) {
                self.decide_now();
            }
        }
    }

    /// Decides from what the machines it heard from left (all of them, or, once
    /// [`LeaveOut::after`] passed, those that came back): reads the store first.
    fn decide_now(&mut self) {
        let Phase::Gathering(all) = std::mem::replace(&mut self.phase, Phase::Decided) else {
            panic!("deciding outside the gathering phase");
        };
        self.heard = (0..self.params.machines)
            .map(MachineId)
            .filter(|m| all[m.0 as usize].is_some())
            .collect();
        self.phase = Phase::Reading(all);
        self.effects.push(Effect::ReadStore);
    }

    /// Ends the exchange once this machine has done its part: a member once every member's
    /// ring starts arrived (the decider then also knows every member learnt the plan, and it
    /// answers the others as they ask); a machine outside the configuration once it learnt
    /// the plan, or, as the decider, once every machine it heard from did.
    fn finish_if_done(&mut self) {
        if self.outcome.is_some() {
            return;
        }
        let Some((plan, _)) = self.plan.clone() else {
            return;
        };
        if plan.config.contains(self.me) {
            if self.mine.is_some() && plan.config.members.iter().all(|m| self.resumed.contains(m)) {
                self.effects.push(Effect::Commit(plan.config.id));
                self.outcome = Some(Outcome::Restarted(plan));
            }
        } else if !self.deciding() || self.heard.iter().all(|m| self.learnt.contains(m)) {
            self.outcome = Some(Outcome::Removed(plan));
        }
    }

    /// This machine's part failed: it tells every other machine why (once; it answers a peer
    /// that asks later again).
    fn fail(&mut self, e: RestartError) {
        let refusal = self.refusal(e.to_string());
        for m in (0..self.params.machines).map(MachineId) {
            if m != self.me {
                self.send(m, refusal.clone(), REFUSED_MESSAGE_ID);
            }
        }
        self.phase = Phase::Decided;
        self.outcome = Some(Outcome::Failed(e));
    }

    fn announce(&mut self, to: MachineId, plan: &RestartPlan) {
        let msg = ControlMsg::Restart {
            restart: plan.config.id,
            from: plan.from.clone(),
            life: self.life,
        };
        self.send(to, msg, RESTART_MESSAGE_ID);
    }

    fn send_starts(&mut self, to: MachineId, config: ConfigId, reply: bool, starts: Vec<[u64; 4]>) {
        let msg = ControlMsg::RingStarts {
            config,
            reply,
            starts,
        };
        self.send(to, msg, RING_STARTS_MESSAGE_ID);
    }

    fn send(&mut self, to: MachineId, msg: ControlMsg, id: u64) {
        self.effects.push(Effect::Send { to, msg, id });
    }

    /// Checks the exchange's invariants; panics naming the one broken.
    pub fn invariants(&self) {
        let all = self.params.machines as usize;
        assert!(
            self.learnt.iter().all(|m| (m.0 as usize) < all),
            "learnt {:?}: machines outside the cluster",
            self.learnt
        );
        assert!(
            self.deciding() || self.learnt.is_empty(),
            "only the decider tracks who learnt the plan"
        );
        assert_eq!(
            self.lives.get(&self.me),
            Some(&self.life),
            "its own life forgotten"
        );
        if let Some((plan, _)) = &self.plan {
            assert!(
                plan.config.id > plan.from.config.id
                    && plan.config.members == plan.from.config.members,
                "the restart configuration {} is the view's {} under a newer id",
                plan.config.id.0,
                plan.from.config.id.0
            );
            assert!(
                self.resumed.iter().all(|m| plan.config.contains(*m)),
                "rings resumed to non-members {:?}",
                self.resumed
            );
        } else {
            assert!(
                self.resumed.is_empty() && self.mine.is_none() && self.learnt.is_empty(),
                "rings resumed or a plan learnt before one was decided"
            );
        }
        if let Some(Outcome::Restarted(plan)) = &self.outcome {
            assert!(
                plan.config.members.iter().all(|m| self.resumed.contains(m)),
                "restarted before every member's ring starts arrived"
            );
        }
    }
}
