//! A whole-cluster restart (FaRM §2, §5: committed transactions survive the loss of power of
//! every machine): what the machines exchange to restart from their NVRAM, as a deterministic
//! state machine ([`RestartExchange`]) that every deployment and the simulator run.
//!
//! 1. Every machine but machine 0 sends machine 0 what it left in NVRAM
//!    ([`ControlMsg::Persisted`]), repeated until machine 0 announces its decision.
//! 2. Machine 0 decides ([`decide`]): the newest view any machine left ([`restart_view`]),
//!    which refuses a region without a complete replica, under the next configuration id,
//!    compare-and-set in the coordination store at the version it read (a cluster that still
//!    reconfigures makes that fail). It announces it ([`ControlMsg::Restart`]) to every machine
//!    until each acknowledges ([`ControlMsg::RestartAck`]); the others check it against the
//!    store. A machine outside the decided configuration was removed before the cluster
//!    stopped: its NVRAM is stale, and it stays out.
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
//! whose restart cannot finish without it (it is machine 0, or a member of the plan) fails at
//! once, naming it ([`RestartError::Refused`]); a refusal lost with every repeat leaves the
//! caller's timeout to end the wait.
//!
//! The exchange reads no clock and does no IO: `now` comes from the caller, and the store
//! reads, the compare-and-set and the reopening of NVRAM are effects the caller carries out and
//! reports back.

use std::collections::{BTreeMap, BTreeSet};

use farm_core::codec::StoredView;
use farm_core::config::Configuration;
use farm_core::{ConfigId, MachineId, RegionId};

use crate::control::ControlMsg;
use crate::store::{CasOutcome, StoreVersion};

/// The machine that decides a restart.
pub const LEADER: MachineId = MachineId(0);

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
    /// Whether machine 0 restarts without machines it has not heard from, and when (`None`:
    /// it waits for every machine).
    pub leave_out: Option<LeaveOut>,
}

/// A restart without the machines that do not come back (a disk that died with the power):
/// after `after` (in the caller's time unit) machine 0 decides from what the others left,
/// leaving the silent ones out of the restart configuration as a reconfiguration removes a
/// failed machine (§5.2): each of their regions keeps a complete replica on a machine that
/// came back, or the restart is refused naming it, and gets `f + 1` replicas again where
/// capacity allows. A machine left out that comes back later learns it is out (its NVRAM is
/// stale) and can join as a new machine.
#[derive(Clone, Copy, Debug)]
pub struct LeaveOut {
    /// How long machine 0 waits for every machine first.
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
    /// Read the coordination store; report with [`RestartExchange::on_store_read`].
    ReadStore,
    /// Store the restart configuration if the store still holds `expected`; report with
    /// [`RestartExchange::on_cas`].
    CompareAndSet {
        /// The version read.
        expected: StoreVersion,
        /// The restart configuration.
        config: Configuration,
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

/// Where a machine is in its restart.
#[derive(Debug)]
enum Phase {
    /// Machine 0: gathering what every machine left, by id.
    Gathering(Vec<Option<Persisted>>),
    /// Machine 0: reading the store, with what every machine left.
    Reading(Vec<Option<Persisted>>),
    /// Machine 0: storing the plan.
    Storing(RestartPlan),
    /// Any other machine: telling machine 0 what it left, until machine 0 announces a plan.
    Telling(Persisted),
    /// Any other machine: checking machine 0's plan against the store.
    Checking(RestartPlan),
    /// Decided: a member reopens its NVRAM, machine 0 announces the plan.
    Decided,
}

/// One machine's part of a whole-cluster restart (see the module docs).
#[derive(Debug)]
pub struct RestartExchange {
    me: MachineId,
    params: ExchangeParams,
    phase: Phase,
    /// The plan, once decided here.
    plan: Option<RestartPlan>,
    /// Machine 0: the machines that learnt the plan (itself included).
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
    /// When this machine last told machine 0 what it left.
    last_told: Option<u64>,
    /// Machine 0: when it started gathering (its first tick), and the machines it heard from
    /// when it decided (those that did not come back never learn the plan from it).
    gathering_since: Option<u64>,
    heard: BTreeSet<MachineId>,
    /// Machine 0: why the last restart without the machines not heard from was refused.
    not_left_out: Option<String>,
    effects: Vec<Effect>,
}

impl RestartExchange {
    /// Machine `me`'s restart, which left `persisted` in its NVRAM.
    pub fn new(me: MachineId, params: ExchangeParams, persisted: Persisted) -> Self {
        assert!(
            me.0 < params.machines,
            "{me} is outside a cluster of {}",
            params.machines
        );
        assert!(params.repeat > 0, "a repeat interval of zero");
        let phase = if me == LEADER {
            let mut all: Vec<Option<Persisted>> = vec![None; params.machines as usize];
            all[me.0 as usize] = Some(persisted);
            Phase::Gathering(all)
        } else {
            Phase::Telling(persisted)
        };
        let mut exchange = Self {
            me,
            params,
            phase,
            plan: None,
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
            Phase::Gathering(p) => all.filter(|m| p[m.0 as usize].is_none()).collect(),
            Phase::Telling(_) => vec![LEADER],
            Phase::Reading(_) | Phase::Storing(_) | Phase::Checking(_) => Vec::new(),
            Phase::Decided => {
                let plan = self.plan.as_ref().expect("decided");
                if plan.config.contains(self.me) {
                    plan.config
                        .members
                        .iter()
                        .copied()
                        .filter(|m| !self.resumed.contains(m))
                        .collect()
                } else {
                    all.filter(|m| !self.learnt.contains(m)).collect()
                }
            }
        }
    }

    /// Machine 0: why it still waits for the machines [`RestartExchange::waiting_for`] names
    /// although [`LeaveOut::after`] passed (a restart without them would lose a region's
    /// every complete replica, or lack a majority).
    pub fn not_left_out(&self) -> Option<&str> {
        match self.phase {
            Phase::Gathering(_) => self.not_left_out.as_deref(),
            _ => None,
        }
    }

    /// Advances the exchange to `now`: repeats what has not been answered.
    pub fn tick(&mut self, now: u64) {
        if self.outcome.is_some() {
            return;
        }
        let repeat = self.params.repeat;
        if let Phase::Telling(p) = &self.phase {
            if self
                .last_told
                .is_none_or(|at| now.saturating_sub(at) >= repeat * PERSISTED_REPEAT_FACTOR)
            {
                self.last_told = Some(now);
                let msg = ControlMsg::Persisted {
                    view: p.view.clone(),
                    copying: p.copying.clone(),
                };
                self.send(LEADER, msg, PERSISTED_MESSAGE_ID);
            }
            return;
        }
        if let Phase::Gathering(all) = &self.phase {
            let since = *self.gathering_since.get_or_insert(now);
            let waited = self
                .params
                .leave_out
                .is_some_and(|l| now.saturating_sub(since) >= l.after);
            if waited && all.iter().any(Option::is_none) {
                // Restart without the machines that did not come back.
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

    /// Machine 0: announces the plan to every machine that has not acknowledged it.
    fn announce_unlearnt(&mut self) {
        if self.me != LEADER {
            return;
        }
        let plan = self.plan.clone().expect("decided");
        for m in (0..self.params.machines).map(MachineId) {
            if !self.learnt.contains(&m) {
                self.announce(m, &plan);
            }
        }
    }

    /// A reopened member: asks every member whose ring starts have not arrived for them.
    fn request_ring_starts(&mut self) {
        let plan = self.plan.clone().expect("decided");
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

    /// A control message of the restart from `from` (others are ignored). After the outcome,
    /// it still answers: machine 0 announces the plan to a machine that missed it, and a
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
            ControlMsg::Persisted { view, copying } if self.me == LEADER => {
                if let Phase::Gathering(all) = &mut self.phase {
                    all[from.0 as usize].get_or_insert(Persisted { view, copying });
                    self.gathered();
                } else if let Some(plan) = self.plan.clone() {
                    // It missed the announcement (or its acknowledgement was lost).
                    self.announce(from, &plan);
                }
            }
            ControlMsg::Restart {
                restart,
                from: view,
            } if from == LEADER => {
                let plan = RestartPlan {
                    config: Configuration {
                        id: restart,
                        ..view.config.clone()
                    },
                    from: view,
                };
                if matches!(self.phase, Phase::Telling(_)) {
                    self.phase = Phase::Checking(plan);
                    self.effects.push(Effect::ReadStore);
                }
                let id = match (&self.phase, &self.plan) {
                    (Phase::Checking(p), _) => p.config.id,
                    (_, Some(p)) => p.config.id,
                    _ => return,
                };
                if id == restart {
                    self.send(LEADER, ControlMsg::RestartAck(restart), ACK_MESSAGE_ID);
                }
            }
            ControlMsg::RestartAck(id)
                if self.me == LEADER && self.plan.as_ref().is_some_and(|p| p.config.id == id) =>
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
    /// knew one). This machine fails too if its restart cannot finish without `from`:
    /// `from` is machine 0 (no plan will come, or none will be announced again) or a member
    /// of the plan (its rings will not resume). Machine 0 outside the plan counts the refusal
    /// of a machine that knew the plan as its acknowledgement. Other refusals are kept for a
    /// plan learnt later.
    fn on_refused(&mut self, from: MachineId, restart: ConfigId, reason: String) {
        if self.outcome.is_some() {
            return;
        }
        self.refusals.insert(from, (restart, reason));
        self.check_refusals();
        if self.outcome.is_some() || self.me != LEADER {
            return;
        }
        if self.plan.as_ref().is_some_and(|p| p.config.id == restart) {
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
        let blocking = self.refusals.iter().find(|(m, (restart, _))| {
            **m == LEADER || plan.is_some_and(|p| p.config.id == *restart && p.config.contains(**m))
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

    /// The plan this machine knows: decided, or being checked or stored.
    fn known_plan(&self) -> Option<&RestartPlan> {
        match &self.phase {
            Phase::Checking(p) | Phase::Storing(p) => Some(p),
            _ => self.plan.as_ref(),
        }
    }

    /// The refusal this machine sends, with the restart configuration it knew.
    fn refusal(&self, reason: String) -> ControlMsg {
        let restart = self.known_plan().map_or(ConfigId(0), |p| p.config.id);
        ControlMsg::RestartRefused { restart, reason }
    }

    fn on_ring_starts(
        &mut self,
        from: MachineId,
        config: ConfigId,
        reply: bool,
        starts: Vec<[u64; 4]>,
    ) {
        let Some(plan) = self.plan.as_ref().filter(|p| p.config.id == config) else {
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
        if self.me == LEADER {
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

    /// What the store holds (`Ok(None)`: nothing), or why it could not be read.
    pub fn on_store_read(&mut self, stored: Result<Option<(StoreVersion, Configuration)>, String>) {
        let stored = match stored {
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
            Phase::Reading(all) => match decide(
                stored.1.id,
                &all,
                self.params.machines,
                self.params.leave_out,
            ) {
                Ok(plan) => {
                    self.effects.push(Effect::CompareAndSet {
                        expected: stored.0,
                        config: plan.config.clone(),
                    });
                    self.phase = Phase::Storing(plan);
                }
                Err(e) if all.iter().any(Option::is_none) => {
                    // Without the machines not heard from, the restart would lose data or
                    // lack a majority: wait for them, and decide again when they come back or
                    // after another `LeaveOut::after`.
                    self.gathering_since = None;
                    self.phase = Phase::Gathering(all);
                    self.not_left_out = Some(e);
                    self.gathered();
                }
                Err(e) => self.fail(RestartError::Invalid(e)),
            },
            Phase::Checking(plan) => {
                if stored.1 == plan.config {
                    self.decided(plan);
                } else {
                    self.fail(RestartError::Store(format!(
                        "the coordination store holds configuration {} (members {:?}), not \
                         restart configuration {} (members {:?}) that machine 0 announced",
                        stored.1.id.0, stored.1.members, plan.config.id.0, plan.config.members
                    )));
                }
            }
            other => panic!("a store read in phase {other:?}"),
        }
    }

    /// The outcome of the compare-and-set of the plan, or why it is unknown.
    pub fn on_cas(&mut self, result: Result<CasOutcome, String>) {
        let Phase::Storing(plan) = std::mem::replace(&mut self.phase, Phase::Decided) else {
            panic!("a compare-and-set outside the storing phase");
        };
        match result {
            Ok(CasOutcome::Written(_)) => {
                // Announced before this machine reopens its own NVRAM.
                self.learnt.insert(self.me);
                self.plan = Some(plan.clone());
                self.announce_unlearnt();
                self.sent_since_tick = true;
                self.decided(plan);
            }
            Ok(CasOutcome::Conflict) => self.fail(RestartError::Store(
                "the stored configuration changed during the restart: is the cluster running?"
                    .into(),
            )),
            Err(e) => self.fail(RestartError::Store(format!(
                "storing the restart configuration: {e}"
            ))),
        }
    }

    /// This member's NVRAM is open: where it found each member's rings to it, or why it could
    /// not be opened.
    pub fn on_restored(&mut self, starts: Result<RingStarts, String>) {
        let plan = self.plan.clone().expect("restored without a plan");
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

    /// The plan is decided here (stored by machine 0, or checked against the store).
    fn decided(&mut self, plan: RestartPlan) {
        self.phase = Phase::Decided;
        self.plan = Some(plan.clone());
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
            if all.iter().all(Option::is_some) {
                self.decide_now();
            }
        }
    }

    /// Machine 0: decides from what the machines it heard from left (all of them, or, once
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
    /// ring starts arrived (machine 0 then also knows every member learnt the plan, and it
    /// answers the others as they ask); a machine outside the configuration once it learnt
    /// the plan, or, as machine 0, once every machine did.
    fn finish_if_done(&mut self) {
        if self.outcome.is_some() {
            return;
        }
        let Some(plan) = self.plan.clone() else {
            return;
        };
        if plan.config.contains(self.me) {
            if self.mine.is_some() && plan.config.members.iter().all(|m| self.resumed.contains(m)) {
                self.effects.push(Effect::Commit(plan.config.id));
                self.outcome = Some(Outcome::Restarted(plan));
            }
        } else if self.me != LEADER || self.heard.iter().all(|m| self.learnt.contains(m)) {
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
            self.me == LEADER || self.learnt.is_empty(),
            "only machine 0 tracks who learnt the plan"
        );
        if let Some(plan) = &self.plan {
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
