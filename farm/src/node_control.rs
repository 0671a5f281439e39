//! The configuration manager's side of a node, and a member's answers to it (FaRM §5.2-5.4),
//! with control messages over datagrams (`farm_cm::control`) instead of the in-process
//! driver's calls. One control thread per node:
//! - as a member, it installs NEW-CONFIG and acks it, commits NEW-CONFIG-COMMIT, reports
//!   REGIONS-ACTIVE until ALL-REGIONS-ACTIVE arrives;
//! - as the CM, it removes the members it suspects, repeats NEW-CONFIG-COMMIT to members that
//!   have not reported their regions active, and announces ALL-REGIONS-ACTIVE once all have;
//! - as the first backup CM of a configuration whose CM it suspects, it removes the CM and
//!   becomes CM (§5.2);
//! - outside the configuration (a new incarnation of a removed machine), it asks the CM of the
//!   stored configuration to add it, and the CM adds it once its configuration is settled
//!   (`Reconfig::start_join`).
//!
//! Reconfiguration itself is `farm_cm::reconfig::Reconfig`, as in the in-process runtime: probes
//! are one-sided reads, the new configuration is compare-and-set in the coordination store
//! (ZooKeeper), and NEW-CONFIG is repeated until acked.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use farm_cm::control::ControlMsg;
use farm_cm::reconfig::{attempt_base, backup_cms, Effect, Reconfig, ReconfigParams};
use farm_cm::CoordinationStore;
use farm_core::config::Configuration;
use farm_core::process_fabric::ProcessFabric;
use farm_core::{ConfigId, MachineId};
use farm_txn::MachineState;

use crate::lease_thread::Suspicion;

/// How often NEW-CONFIG, NEW-CONFIG-COMMIT and REGIONS-ACTIVE are repeated until answered.
const REPEAT: Duration = Duration::from_millis(2);

/// Region replicas one machine may hold.
const REGIONS_PER_MACHINE_MAX: usize = 4096;

/// How often a machine outside the configuration asks to join.
const JOIN_REPEAT: Duration = Duration::from_millis(20);

/// The longest wait before another attempt to add a machine whose join failed.
const JOIN_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Longest wait between two looks at the store by a machine whose CM fell silent.
const CM_SILENT_CHECK_MAX: Duration = Duration::from_secs(1);

/// What a reconfiguration changes.
enum Change {
    /// Remove suspected machines.
    Remove(BTreeSet<MachineId>),
    /// Add a machine that asked to join.
    Join(MachineId),
}

pub(crate) struct Control {
    pub(crate) machine: Arc<MachineState>,
    pub(crate) fabric: Arc<dyn ProcessFabric>,
    pub(crate) store: Arc<dyn CoordinationStore>,
    pub(crate) suspicions: Arc<Mutex<Vec<Suspicion>>>,
    pub(crate) lease: Duration,
    pub(crate) replicas: usize,
    pub(crate) epoch: Instant,
    pub(crate) stop: Arc<AtomicBool>,
    /// Configurations this node committed as CM or driver, for the caller.
    pub(crate) committed: Arc<Mutex<Vec<ConfigId>>>,
    /// After a restart, where this machine found each peer's rings, for peers that still ask
    /// (`crate::node_restart`).
    pub(crate) ring_starts: Option<(ConfigId, crate::node_restart::RingStarts)>,
}

/// What the CM heard from members about its configuration.
#[derive(Default)]
struct CmState {
    config: ConfigId,
    regions_active: BTreeSet<MachineId>,
    /// Machines outside the configuration that asked to join it.
    joins: BTreeSet<MachineId>,
    /// Members another member reported it cannot write to (this machine being the CM).
    unreachable: BTreeSet<MachineId>,
}

impl Control {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    fn send(&self, to: MachineId, msg: &ControlMsg) {
        self.fabric
            .send_datagram(self.machine.id, to, &msg.encode(), 0);
    }

    pub(crate) fn run(self) {
        let me = self.machine.id;
        let mut seen = 0;
        let mut cm = CmState::default();
        let mut buf = Vec::new();
        let mut last_repeat = Instant::now();
        let mut backup_tried: Option<ConfigId> = None;
        let mut last_join: Option<Instant> = None;
        // A joiner whose join failed (it did not acknowledge NEW-CONFIG: it cannot install
        // the view, or it failed meanwhile) waits before the next attempt, each time longer.
        let mut join_backoff: BTreeMap<MachineId, (Instant, Duration)> = BTreeMap::new();
        // Suspects of a failed attempt, retried two leases later (from the stored
        // configuration, which the failed attempt may have advanced).
        let mut retry: Option<(BTreeSet<MachineId>, Instant)> = None;
        // A CM this machine suspected in configuration `.0`: whether the others removed this
        // machine meanwhile is in the store, asked again at `.1`, then after `.2`, twice as
        // long each time. A machine cut off from its CM and the majority learns so only there:
        // nobody sends NEW-CONFIG to a removed machine, and it cannot reconfigure itself.
        let mut cm_silent: Option<(ConfigId, Instant, Duration)> = None;
        // Members the fabric can no longer write to, each suspected once per configuration.
        let mut broken_seen: BTreeSet<(ConfigId, MachineId)> = BTreeSet::new();
        // When this member last told its CM of each member it cannot write to.
        let mut reported: BTreeMap<MachineId, Instant> = BTreeMap::new();
        while !self.stop.load(Ordering::Relaxed) {
            while let Some(from) = self.fabric.recv_control(&mut buf) {
                if let Some(msg) = ControlMsg::decode(&buf) {
                    self.on_message(from, msg, &mut cm, None);
                }
            }
            let view = self.machine.view();
            let config = view.config.clone();
            if cm.config != config.id {
                cm = CmState {
                    config: config.id,
                    ..CmState::default()
                };
            }
            if !config.contains(me) {
                if !self.machine.is_evicted()
                    && last_join.is_none_or(|at| at.elapsed() >= JOIN_REPEAT)
                {
                    last_join = Some(Instant::now());
                    self.ask_to_join();
                }
                std::thread::sleep((self.lease / 20).max(Duration::from_micros(200)));
                continue;
            }
            let repeat = last_repeat.elapsed() >= REPEAT;
            if repeat {
                last_repeat = Instant::now();
                self.repeat(&config, &mut cm);
            }
            let fresh: Vec<Suspicion> = {
                let all = self.suspicions.lock().expect("poisoned");
                let fresh = all[seen..].to_vec();
                seen = all.len();
                fresh
            };
            let mut suspects: BTreeSet<MachineId> = fresh
                .iter()
                .filter(|s| s.observer == me && config.contains(s.suspect))
                .map(|s| s.suspect)
                .collect();
            broken_seen.retain(|(id, _)| *id == config.id);
            for m in self.fabric.broken_members() {
                if m == me || !config.contains(m) {
                    continue;
                }
                if broken_seen.insert((config.id, m)) {
                    tracing::warn!(
                        observer = me.0,
                        suspect = m.0,
                        "the link to a member broke: suspect"
                    );
                    suspects.insert(m);
                }
                // Removals are the CM's: a member tells it, again while the link stays down
                // (datagrams get lost).
                let due = reported
                    .get(&m)
                    .is_none_or(|at| at.elapsed() >= 2 * self.lease);
                if config.cm != me && m != config.cm && due {
                    reported.insert(m, Instant::now());
                    self.send(
                        config.cm,
                        &ControlMsg::Unreachable {
                            config: config.id,
                            machine: m,
                        },
                    );
                }
            }
            if config.cm == me {
                suspects.extend(
                    std::mem::take(&mut cm.unreachable)
                        .into_iter()
                        .filter(|m| config.contains(*m)),
                );
            }
            if let Some((earlier, at)) = &retry {
                if at.elapsed() >= 2 * self.lease {
                    suspects.extend(earlier.iter().filter(|m| config.contains(**m)));
                    retry = None;
                }
            }
            if suspects.contains(&config.cm) {
                if self.removed(&config) {
                    // Out of the cluster: nothing more to drive or answer.
                    cm_silent = None;
                    continue;
                }
                let every = 2 * self.lease;
                cm_silent = Some((config.id, Instant::now() + every, every));
            }
            match cm_silent {
                Some((id, _, _)) if id != config.id => cm_silent = None,
                Some((id, at, every)) if Instant::now() >= at => {
                    if self.removed(&config) {
                        cm_silent = None;
                        continue;
                    }
                    let every = (every * 2).min(CM_SILENT_CHECK_MAX);
                    cm_silent = Some((id, Instant::now() + every, every));
                }
                _ => {}
            }
            if config.cm == me && !suspects.is_empty() {
                if !self.reconfigure(&config, Change::Remove(suspects.clone()), &mut cm) {
                    retry = Some((suspects, Instant::now()));
                }
            } else if suspects.contains(&config.cm)
                && backup_cms(&config, config.members.len()).first() == Some(&me)
                && backup_tried != Some(config.id)
            {
                backup_tried = Some(config.id);
                if !self.reconfigure(
                    &config,
                    Change::Remove(BTreeSet::from([config.cm])),
                    &mut cm,
                ) {
                    backup_tried = None;
                    retry = Some((BTreeSet::from([config.cm]), Instant::now()));
                }
            } else if config.cm == me
                && retry.is_none()
                && self.machine.all_active_config() >= config.id
            {
                // One join at a time, once the configuration is settled: every member recovered
                // what the joiner's earlier life left (§5.3) before its rings start afresh.
                let now = Instant::now();
                cm.joins
                    .retain(|j| join_backoff.get(j).is_none_or(|(until, _)| now >= *until));
                if let Some(j) = cm.joins.pop_first() {
                    if self.reconfigure(&config, Change::Join(j), &mut cm) {
                        join_backoff.remove(&j);
                    } else {
                        let wait = join_backoff
                            .get(&j)
                            .map_or(Duration::from_millis(500), |(_, w)| {
                                (*w * 2).min(JOIN_BACKOFF_MAX)
                            });
                        tracing::warn!(joiner = j.0, retry_in = ?wait, "join failed");
                        join_backoff.insert(j, (Instant::now() + wait, wait));
                    }
                }
            }
            std::thread::sleep((self.lease / 20).max(Duration::from_micros(200)));
        }
    }

    /// Asks the CM of the stored configuration to add this machine.
    fn ask_to_join(&self) {
        let stored = match self.store.read() {
            Ok(Some((_, bytes))) => farm_cm::codec::decode(&bytes).ok(),
            _ => None,
        };
        if let Some(s) = stored.filter(|s| !s.contains(self.machine.id)) {
            self.send(s.cm, &ControlMsg::Join(s.id));
        }
    }

    /// Whether the coordination store holds a newer configuration without this machine (asked
    /// when its CM falls silent: a machine paused past its lease was removed meanwhile, and
    /// nobody sends NEW-CONFIG to removed machines). Marks the machine evicted if so.
    fn removed(&self, config: &Configuration) -> bool {
        let me = self.machine.id;
        let stored = match self.store.read() {
            Ok(Some((_, bytes))) => farm_cm::codec::decode(&bytes).ok(),
            _ => None,
        };
        match stored {
            Some(s) if s.id > config.id && !s.contains(me) => {
                tracing::warn!(
                    machine = me.0,
                    config = s.id.0,
                    "removed from the configuration"
                );
                self.machine.set_evicted(true);
                true
            }
            _ => false,
        }
    }

    /// Repeats what is not answered yet: a member's REGIONS-ACTIVE, the CM's
    /// NEW-CONFIG-COMMIT to members that have not reported.
    fn repeat(&self, config: &Configuration, cm: &mut CmState) {
        let me = self.machine.id;
        let committed = self.machine.committed_config() >= config.id;
        let all_active = self.machine.all_active_config() >= config.id;
        if config.cm == me {
            if committed && self.machine.regions_active() {
                cm.regions_active.insert(me);
            }
            for m in config.members.iter().filter(|m| **m != me) {
                if !cm.regions_active.contains(m) && committed {
                    self.send(*m, &ControlMsg::NewConfigCommit(config.id));
                }
            }
            if !all_active && config.members.iter().all(|m| cm.regions_active.contains(m)) {
                self.machine.all_regions_active(config.id);
            }
        } else if committed && !all_active && self.machine.regions_active() {
            self.send(config.cm, &ControlMsg::RegionsActive(config.id));
        }
    }

    /// A control message: a member's duties, the CM's bookkeeping, and acks for `acks` while a
    /// reconfiguration runs.
    fn on_message(
        &self,
        from: MachineId,
        msg: ControlMsg,
        cm: &mut CmState,
        acks: Option<&mut Vec<(MachineId, ConfigId)>>,
    ) {
        let me = self.machine.id;
        match msg {
            ControlMsg::NewConfig(v) => {
                let id = v.config.id;
                if !v.config.contains(me) || v.config.cm != from {
                    return;
                }
                if self.machine.view().config.id < id {
                    if let Err(e) = self.machine.install(v.config, v.map, v.changes) {
                        tracing::error!(error = %e, config = id.0, "installing NEW-CONFIG");
                        return;
                    }
                }
                // Acknowledged once every worker picked the view up: a machine joining in it
                // writes here after the commit, into rings started afresh for it.
                if self.machine.view().config.id == id && self.machine.workers_refreshed() {
                    self.send(from, &ControlMsg::NewConfigAck(id));
                }
            }
            ControlMsg::NewConfigAck(id) => {
                if let Some(acks) = acks {
                    acks.push((from, id));
                }
            }
            ControlMsg::NewConfigCommit(id) => {
                if self.machine.view().config.id == id && self.machine.view().config.cm == from {
                    self.machine.commit_config(id);
                }
            }
            ControlMsg::RegionsActive(id) => {
                if cm.config == id {
                    cm.regions_active.insert(from);
                    let config = self.machine.view().config.clone();
                    if config.members.iter().all(|m| cm.regions_active.contains(m)) {
                        self.send(from, &ControlMsg::AllRegionsActive(id));
                    }
                }
            }
            ControlMsg::AllRegionsActive(id) => {
                if self.machine.view().config.cm == from {
                    self.machine.all_regions_active(id);
                }
            }
            ControlMsg::RingStarts {
                config,
                reply: false,
                ..
            } => {
                if let Some(starts) = self
                    .ring_starts
                    .as_ref()
                    .filter(|(id, _)| *id == config)
                    .and_then(|(_, s)| s.get(&from))
                {
                    crate::node_restart::send_starts(&*self.fabric, from, config, true, starts);
                }
            }
            ControlMsg::Unreachable { config, machine } => {
                let current = self.machine.view().config.clone();
                if cm.config == current.id
                    && config == current.id
                    && current.cm == me
                    && machine != me
                    && current.contains(machine)
                    && current.contains(from)
                {
                    cm.unreachable.insert(machine);
                }
            }
            ControlMsg::Join(_) => {
                let config = self.machine.view().config.clone();
                let max = self.machine.params.layout.machines_max;
                if cm.config == config.id
                    && config.cm == me
                    && !config.contains(from)
                    && from.0 < max
                {
                    cm.joins.insert(from);
                }
            }
            // Repeats of a restart this machine is past.
            ControlMsg::RingStarts { reply: true, .. }
            | ControlMsg::Restart { .. }
            | ControlMsg::Persisted { .. } => {}
        }
    }

    /// Removes suspects from `config`, or adds a joiner, with this machine as driver (§5.2
    /// steps 2-7); returns whether a configuration was committed.
    fn reconfigure(&self, config: &Configuration, change: Change, cm: &mut CmState) -> bool {
        let me = self.machine.id;
        let (version, stored) = match self.store.read() {
            Ok(Some((v, bytes))) => match farm_cm::codec::decode(&bytes) {
                Ok(c) => (v, c),
                Err(e) => {
                    tracing::error!(error = %e, "the stored configuration does not decode");
                    return false;
                }
            },
            Ok(None) => {
                tracing::error!("no configuration in the coordination store");
                return false;
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the coordination store");
                return false;
            }
        };
        if stored.id > config.id && !stored.contains(me) {
            // A newer configuration without this machine: it was removed (precise
            // membership, §5.2) and must not act as a member again.
            tracing::warn!(
                machine = me.0,
                config = stored.id.0,
                "removed from the configuration"
            );
            self.machine.set_evicted(true);
            return false;
        }
        let view = self.machine.view();
        let params = ReconfigParams {
            replicas: self.replicas,
            regions_max: REGIONS_PER_MACHINE_MAX,
            // Probes are one-sided reads (answered without the target's CPU), but a NEW-CONFIG
            // needs the member's control thread and an fsync of its view: give the acks ten
            // leases, at least 100 ms, before removing the silent.
            probe_timeout_ticks: (self.lease * 10)
                .max(Duration::from_millis(100))
                .as_micros() as u64,
            lease_ticks: self.lease.as_micros() as u64,
        };
        let now = self.now();
        let mut r = match change {
            Change::Remove(suspects) => {
                tracing::warn!(driver = me.0, suspects = ?suspects, "reconfiguring");
                Reconfig::start(
                    me,
                    attempt_base(config, &stored),
                    version,
                    view.map.clone(),
                    view.changes.clone(),
                    suspects,
                    params,
                    now,
                    now,
                )
            }
            // A join starts from the configuration the CM is in; if the store moved on, the
            // joiner asks again.
            Change::Join(_) if stored.id != config.id => return false,
            Change::Join(j) => {
                tracing::info!(driver = me.0, joiner = j.0, "adding a machine");
                Reconfig::start_join(
                    me,
                    config.clone(),
                    version,
                    view.map.clone(),
                    view.changes.clone(),
                    BTreeMap::from([(j, j.0 as u32)]),
                    params,
                    now,
                )
            }
        };
        // This machine's own acknowledgement waits for its workers too (see `on_message`).
        let mut own_ack: Option<ConfigId> = None;
        let mut pending: BTreeMap<MachineId, ControlMsg> = BTreeMap::new();
        let mut last_repeat = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut buf = Vec::new();
        loop {
            if self.stop.load(Ordering::Relaxed) || Instant::now() > deadline {
                tracing::warn!(driver = me.0, "reconfiguration abandoned");
                return false;
            }
            let mut acks = Vec::new();
            while let Some(from) = self.fabric.recv_control(&mut buf) {
                if let Some(msg) = ControlMsg::decode(&buf) {
                    self.on_message(from, msg, cm, Some(&mut acks));
                }
            }
            for (m, id) in acks {
                if pending.remove(&m).is_some() {
                    r.on_ack(m, id, self.now());
                }
            }
            let effects = r.take_effects();
            if effects.is_empty() && r.outcome().is_some() {
                break;
            }
            for e in effects {
                match e {
                    Effect::Probe(m) => {
                        r.on_probe(m, crate::cm::probe(&*self.fabric, me, m), self.now())
                    }
                    Effect::CompareAndSet { expected, data } => {
                        r.on_store(self.store.compare_and_set(Some(expected), &data));
                    }
                    Effect::SendNewConfig(m, new) if m == me => {
                        if let Err(e) = self.machine.install(
                            new.config.clone(),
                            new.map.clone(),
                            new.changes.clone(),
                        ) {
                            tracing::error!(error = %e, "installing the new configuration");
                            return false;
                        }
                        own_ack = Some(new.config.id);
                    }
                    Effect::SendNewConfig(m, new) => {
                        let msg = ControlMsg::new_config(&new.config, &new.map, &new.changes);
                        self.send(m, &msg);
                        pending.insert(m, msg);
                    }
                    // NEW-CONFIG-COMMIT: transaction recovery starts at the member (§5.3); the
                    // CM repeats it until the member reports its regions active.
                    Effect::SendCommit(m, id) if m == me => self.machine.commit_config(id),
                    Effect::SendCommit(m, id) => self.send(m, &ControlMsg::NewConfigCommit(id)),
                }
            }
            if let Some(id) = own_ack.filter(|_| self.machine.workers_refreshed()) {
                own_ack = None;
                r.on_ack(me, id, self.now());
            }
            if last_repeat.elapsed() >= REPEAT {
                last_repeat = Instant::now();
                for (m, msg) in &pending {
                    self.send(*m, msg);
                }
            }
            r.tick(self.now());
            std::thread::sleep(Duration::from_micros(100));
        }
        match r.outcome().expect("finished") {
            Ok(new) => {
                tracing::info!(config = new.config.id.0, members = ?new.config.members,
                    cm = new.config.cm.0, "configuration committed");
                self.committed.lock().expect("poisoned").push(new.config.id);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "reconfiguration failed");
                false
            }
        }
    }
}
