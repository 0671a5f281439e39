//! A machine's control plane at work: `farm_cm::plane::ControlPlane` (the member and driver
//! sides of FaRM §5.2-5.4) wired to the machine's state, the fabric and the coordination store.
//! The plane decides; this carries its effects out (a datagram, a probe, a store read or
//! compare-and-set, installing or committing a view) and feeds the results back, so that every
//! deployment (a node's control thread, the in-process cluster) and the simulator run the same
//! rules. It reads no clock and starts no thread: `now` comes from the caller, and the store
//! and fabric calls return when they return (a ZooKeeper round trip in a node's control
//! thread, at once in the simulator).

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::growth::Answer;
use crate::machine::{PersistedView, View};
use crate::MachineState;
use farm_cm::control::{ControlMsg, Reassembly};
use farm_cm::plane::{ControlPlane, Effect, Event, Local, PlaneParams};
use farm_cm::reconfig::ProbeAnswer;
use farm_cm::restart::{Effect as RestartEffect, RestartExchange};
use farm_cm::{ConfigurationStore, CoordinationStore, ReadConfigError};
use farm_core::fabric::{Fabric, MemKey};
use farm_core::{MachineId, RegionId};

/// Region replicas one machine may hold (the plane's `regions_max` in every deployment).
pub const REGIONS_PER_MACHINE_MAX: usize = 4096;

/// One machine's control plane and what it acts on.
pub struct MachineControl {
    machine: Arc<MachineState>,
    plane: ControlPlane,
    fabric: Arc<dyn Fabric>,
    store: Arc<dyn CoordinationStore>,
    /// Steps of reconfigurations seen here, with their time, for the caller to drain.
    events: Vec<(u64, Event)>,
    /// Joins the pieces of long messages from peers.
    pieces: Reassembly,
    /// The id of the next message sent (pieces of one message share it).
    next_message: u64,
    /// Reused for received datagrams.
    buf: Vec<u8>,
    /// See [`MachineControl::set_check_invariants`].
    check_invariants: bool,
    /// Answers to this machine's allocation requests, for the caller to drain.
    allocated: Vec<(u64, Result<Vec<RegionId>, String>)>,
    /// The id of this machine's next allocation request.
    next_request: u64,
    /// The allocation request asking for a region of this machine's own, its regions being
    /// full ([`crate::growth`]); answered here, not to the caller.
    growth: Option<u64>,
    /// When a refused request for a region is asked again, if still wanted.
    growth_again_at: Option<u64>,
    /// Refusals of requests for a region in a row.
    growth_refusals: u32,
    /// A NEW-CONFIG persisted and not yet installed (`Effect::Persist`, then `Install`).
    persisted: Option<PersistedView>,
    /// The whole-cluster restart this machine took part in, which answers peers that ask late.
    restart: Option<RestartExchange>,
}

impl std::fmt::Debug for MachineControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MachineControl")
            .field("machine", &self.machine.id)
            .field("plane", &self.plane)
            .finish_non_exhaustive()
    }
}

fn local<'a>(machine: &MachineState, view: &'a View, copying: &'a BTreeSet<RegionId>) -> Local<'a> {
    Local {
        config: &view.config,
        map: &view.map,
        changes: &view.changes,
        copying,
        committed: machine.committed_config(),
        all_active: machine.all_active_config(),
        regions_active: machine.regions_active(),
        workers_ready: machine.workers_ready(),
        evicted: machine.is_evicted(),
    }
}

/// A reconfiguration probe (§5.2 step 2): a one-sided read of `m`'s memory from `me`, which
/// succeeds while `m`'s NIC (its mapped memory, on the `shm` fabric) answers, of the regions
/// whose replica `m` holds complete, or of `m`'s word that it cannot write to `me`
/// ([`MachineState::publish_unreachable`]).
pub fn probe(fabric: &dyn Fabric, me: MachineId, m: MachineId) -> ProbeAnswer {
    let read = fabric
        .remote(me, m, MemKey::Replicas)
        .and_then(|h| crate::machine::read_complete(&*h));
    match read {
        Err(_) => ProbeAnswer::NoAnswer,
        Ok(probed) if probed.unreachable.contains(&me) => ProbeAnswer::CannotWriteToProber,
        Ok(probed) => ProbeAnswer::Complete(probed.complete),
    }
}

impl MachineControl {
    /// The plane of `machine`, acting through `fabric` and `store`.
    pub fn new(
        machine: Arc<MachineState>,
        params: PlaneParams,
        fabric: Arc<dyn Fabric>,
        store: Arc<dyn CoordinationStore>,
    ) -> Self {
        machine.growth.enable();
        Self {
            plane: ControlPlane::new(machine.id, params),
            machine,
            fabric,
            store,
            events: Vec::new(),
            pieces: Reassembly::new(),
            next_message: 0,
            buf: Vec::new(),
            check_invariants: cfg!(debug_assertions),
            allocated: Vec::new(),
            next_request: 0,
            growth: None,
            growth_again_at: None,
            growth_refusals: 0,
            persisted: None,
            restart: None,
        }
    }

    /// Keeps the finished exchange of the restart this machine came from
    /// ([`crate::restart::Restarted`]), to answer the restart's messages of peers that missed
    /// an answer: the plane does not handle them.
    pub fn set_restart(&mut self, exchange: RestartExchange) {
        assert!(
            exchange.outcome().is_some() && exchange.machine() == self.machine.id,
            "a restart exchange still under way, or another machine's"
        );
        self.restart = Some(exchange);
    }

    /// Calls `f` with the plane and what the machine has installed now, then carries out the
    /// effects.
    fn with_plane(&mut self, now: u64, f: impl FnOnce(&mut ControlPlane, &Local<'_>)) {
        self.feed(f);
        self.execute(now);
        if self.check_invariants {
            self.plane.invariants();
        }
    }

    /// Whether every call ends with `ControlPlane::invariants` (on in debug builds; the
    /// simulator turns it on in every build).
    pub fn set_check_invariants(&mut self, on: bool) {
        self.check_invariants = on;
    }

    /// Calls `f` with the plane and what the machine has installed now.
    fn feed(&mut self, f: impl FnOnce(&mut ControlPlane, &Local<'_>)) {
        let view = self.machine.view();
        let copying = self.machine.copying_regions();
        f(&mut self.plane, &local(&self.machine, &view, &copying));
    }

    /// A control datagram from `from`, decoded: the message it completes (a long message
    /// travels in pieces), for the runtime to pass to [`MachineControl::on_message`] or, for
    /// the restart exchange's, to handle itself.
    pub fn receive(&mut self, from: MachineId, datagram: &[u8]) -> Option<ControlMsg> {
        self.pieces.accept(from, datagram)
    }

    /// One step at `now`: the control datagrams that arrived, then a tick
    /// ([`MachineControl::tick`]). Messages of a whole-cluster restart's exchange go to the
    /// exchange kept for them ([`MachineControl::set_restart`]), if any.
    pub fn step(&mut self, now: u64) {
        let me = self.machine.id;
        let mut buf = std::mem::take(&mut self.buf);
        while let Some(from) = self.fabric.recv_control(me, now, &mut buf) {
            match self.receive(from, &buf) {
                Some(
                    msg @ (ControlMsg::RingStarts { .. }
                    | ControlMsg::Persisted { .. }
                    | ControlMsg::Restart { .. }
                    | ControlMsg::RestartAck(_)
                    | ControlMsg::RestartRefused { .. }),
                ) => self.answer_restart(from, msg, now),
                Some(msg) => self.on_message(from, msg, now),
                None => {}
            }
        }
        self.buf = buf;
        self.tick(now);
    }

    /// A restart message of a peer that missed an answer: the kept exchange answers it.
    fn answer_restart(&mut self, from: MachineId, msg: ControlMsg, now: u64) {
        let Some(exchange) = self.restart.as_mut() else {
            return;
        };
        exchange.on_message(from, msg);
        for e in exchange.take_effects() {
            match e {
                RestartEffect::Send { to, msg, id } => {
                    crate::restart::send(&*self.fabric, self.machine.id, to, &msg, id, now)
                }
                e => panic!("a finished restart exchange asked for {e:?}"),
            }
        }
    }

    /// A control message from `from`.
    pub fn on_message(&mut self, from: MachineId, msg: ControlMsg, now: u64) {
        self.with_plane(now, |p, l| p.on_message(from, msg, now, l));
    }

    /// This machine's lease of `suspect` expired.
    pub fn on_suspect(&mut self, suspect: MachineId, now: u64) {
        self.with_plane(now, |p, l| p.on_suspect(suspect, now, l));
    }

    /// This machine cannot write to member `m` although `m` may live.
    pub fn on_unreachable(&mut self, m: MachineId, now: u64) {
        self.with_plane(now, |p, l| p.on_unreachable(m, now, l));
    }

    /// Advances the plane, first reporting the members the fabric can no longer write to
    /// (`Fabric::broken_members`): a write that did not land at a live member left a hole in
    /// its ring, so the configuration must remove it (or the link be repaired in place).
    pub fn tick(&mut self, now: u64) {
        let unreachable = self.machine.unreachable_members();
        self.machine.publish_unreachable(&unreachable);
        for m in unreachable {
            self.on_unreachable(m, now);
        }
        self.with_plane(now, |p, l| p.tick(now, l));
        self.grow(now);
    }

    /// Asks the CM for a region when a worker found every region this machine is primary of
    /// full ([`crate::growth`]): one region, near the one of its own with the most replicas,
    /// so that it has those replicas and this machine as primary (§3 locality), if the
    /// placement the CM runs says so in this machine's view (else it is refused until a newer
    /// view); a machine primary of none (one that joined) takes one wherever it goes.
    fn grow(&mut self, now: u64) {
        if self.growth.is_some() {
            return;
        }
        match self.growth_again_at {
            Some(at) if now < at => return,
            Some(_) => {
                self.growth_again_at = None;
                if !self.machine.growth.take_still_wanted() {
                    self.growth_refusals = 0;
                    return;
                }
            }
            None if !self.machine.growth.take_wanted() => return,
            None => {}
        }
        let me = self.machine.id;
        let view = self.machine.view();
        let generation = self.machine.view_generation();
        let own: Vec<RegionId> = view.map.primary_of(me).collect();
        let near =
            (own.iter().copied()).max_by_key(|r| view.map.get(*r).map_or(0, |p| p.backups.len()));
        let placed = farm_cm::placement::choose_replicas(
            &view.config,
            &view.map,
            self.plane.params().replicas,
            self.plane.params().regions_max,
            near,
        );
        match placed {
            // A machine that has regions needs one it is primary of (it holds the most a
            // machine may, or none of its regions has all its replicas, after a failure).
            Ok(chosen) if own.is_empty() || chosen.first() == Some(&me) => {
                self.growth = Some(self.next_request);
                self.allocate(1, near, now);
            }
            placed => {
                let why = placed.map_or_else(|e| e.to_string(), |_| "another primary".into());
                tracing::warn!(machine = me.0, %why, "no region can be placed for full regions");
                self.growth_refusals = 0;
                self.machine.growth.answered(Answer::Refused(generation));
            }
        }
    }

    /// Asks the CM for `count` regions (§3), sharing region `near`'s replicas if given and
    /// possible. Returns the request's id; its answer comes from
    /// [`MachineControl::take_allocated`] once the regions are committed in a configuration
    /// that every member installed, or the CM refused.
    pub fn allocate(&mut self, count: u32, near: Option<RegionId>, now: u64) -> u64 {
        let request = self.next_request;
        self.next_request += 1;
        self.with_plane(now, |p, l| p.allocate(request, count, near, now, l));
        request
    }

    /// Answers to allocation requests that arrived since the last call.
    pub fn take_allocated(&mut self) -> Vec<(u64, Result<Vec<RegionId>, String>)> {
        std::mem::take(&mut self.allocated)
    }

    /// Whether a region allocation is under way here (requested, or served as CM).
    pub fn allocating(&self) -> bool {
        self.plane.allocating()
    }

    /// Changes the lease length the plane times with (and the longest ever in force).
    pub fn set_lease(&mut self, lease_ticks: u64, lease_longest_ticks: u64) {
        self.plane.set_lease(lease_ticks, lease_longest_ticks);
    }

    /// The machine.
    pub fn machine(&self) -> MachineId {
        self.machine.id
    }

    /// Whether a reconfiguration driven here is under way.
    pub fn reconfiguring(&self) -> bool {
        self.plane.reconfiguring()
    }

    /// Whether a reconfiguration driven here is under way or due.
    pub fn busy(&self) -> bool {
        self.plane.busy()
    }

    /// Whether the machine learnt it was removed from the configuration.
    pub fn evicted(&self) -> bool {
        self.machine.is_evicted()
    }

    /// Reconfiguration steps seen since the last call, with their times.
    pub fn take_events(&mut self) -> Vec<(u64, Event)> {
        std::mem::take(&mut self.events)
    }

    /// Carries out the plane's effects, feeding results back, until it has none.
    fn execute(&mut self, now: u64) {
        let me = self.machine.id;
        loop {
            let effects = self.plane.take_effects();
            if effects.is_empty() {
                return;
            }
            for e in effects {
                match e {
                    Effect::Send(to, msg) => {
                        // The plane handles its own messages (`ControlPlane::send`).
                        assert_ne!(to, me, "a control message to itself: {msg:?}");
                        for d in msg.datagrams(self.next_message) {
                            self.fabric.send_datagram(me, to, &d, now);
                        }
                        self.next_message += 1;
                    }
                    Effect::Probe(m) => {
                        let answer = probe(&*self.fabric, me, m);
                        self.feed(|p, l| p.on_probe(m, answer, now, l));
                    }
                    Effect::ReadStore => {
                        let stored = match self.store.read_config() {
                            Ok(Some(stored)) => Some(stored),
                            Ok(None) => {
                                tracing::error!("no configuration in the coordination store");
                                None
                            }
                            Err(e @ ReadConfigError::Undecodable(_)) => {
                                tracing::error!(error = %e, "reading the coordination store");
                                None
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "reading the coordination store");
                                None
                            }
                        };
                        self.feed(|p, l| p.on_store_read(stored, now, l));
                    }
                    Effect::CompareAndSet { expected, data } => {
                        let result = self.store.compare_and_set(Some(expected), &data);
                        self.feed(|p, l| p.on_cas(result, now, l));
                    }
                    Effect::Persist(v) => {
                        let id = v.config.id;
                        let ok = match self.machine.persist_view(v) {
                            Ok(p) => {
                                self.persisted = Some(p);
                                true
                            }
                            Err(e) => {
                                tracing::error!(error = %e, config = id.0, "persisting NEW-CONFIG");
                                false
                            }
                        };
                        self.feed(|p, l| p.on_persisted(id, ok, now, l));
                    }
                    Effect::Install(id) => {
                        let persisted = self.persisted.take();
                        let persisted = persisted.filter(|p| p.config() == id);
                        let persisted =
                            persisted.expect("Install of a configuration not persisted just now");
                        match self.machine.publish_view(persisted) {
                            Ok(()) => assert!(
                                self.machine.view().config.id >= id,
                                "NEW-CONFIG {} installed but not in force",
                                id.0
                            ),
                            Err(e) => {
                                tracing::error!(error = %e, config = id.0, "installing NEW-CONFIG")
                            }
                        }
                    }
                    Effect::Commit(id) => self.machine.commit_config(id),
                    Effect::AllRegionsActive(id) => self.machine.all_regions_active(id, now),
                    Effect::Evicted(id) => {
                        tracing::warn!(
                            machine = me.0,
                            config = id.0,
                            "removed from the configuration"
                        );
                        self.machine.set_evicted();
                    }
                    Effect::ForgiveCm(cm) => {
                        tracing::info!(
                            machine = me.0,
                            cm = cm.0,
                            "could not remove the CM: renewing with it again"
                        );
                        self.machine.forgive_cm();
                    }
                    Effect::ForgiveMember(m) => {
                        tracing::info!(
                            machine = me.0,
                            member = m.0,
                            "could not remove a member: taking its lease requests again"
                        );
                        self.machine.forgive_members();
                    }
                    Effect::PrepareRegions {
                        cm,
                        config,
                        regions,
                    } => {
                        // §3: PREPARE comes from the CM of the installed view, for regions
                        // its map does not hold yet (the plane checked both).
                        let view = self.machine.view();
                        assert!(
                            view.config.cm == cm
                                && regions.iter().all(|r| view.map.get(*r).is_none()),
                            "PREPARE of {regions:?} from {cm}: not the CM of configuration {}, \
                             or regions mapped already",
                            view.config.id.0
                        );
                        let ok = regions
                            .iter()
                            .all(|r| match self.machine.prepare_region(*r) {
                                Ok(()) => true,
                                Err(e) => {
                                    tracing::warn!(region = r.0, error = %e, "PREPARE of a region");
                                    false
                                }
                            });
                        self.feed(|p, l| p.on_regions_prepared(cm, config, regions, ok, now, l));
                    }
                    Effect::AbortRegions(regions) => {
                        for r in regions {
                            self.machine.abort_region(r);
                        }
                    }
                    Effect::Allocated { request, result } => {
                        // §3: the CM answers after the commit, which every member acknowledged
                        // once installed: the regions are in this machine's view.
                        let view = self.machine.view();
                        if let Ok(regions) = &result {
                            assert!(
                                !regions.is_empty()
                                    && regions.iter().all(|r| view.map.get(*r).is_some()),
                                "regions {regions:?} allocated but not in the view of \
                                 configuration {}",
                                view.config.id.0
                            );
                        }
                        if self.growth == Some(request) {
                            self.growth = None;
                            if let Err(why) = &result {
                                // Asked again after a wait, doubled with each refusal in a row
                                // up to 16 leases, if a worker still wants a region: the store
                                // may have timed out, a replica not answered or had no memory.
                                tracing::warn!(machine = me.0, %why, "no region for full regions yet");
                                let wait =
                                    self.plane.params().lease_ticks << self.growth_refusals.min(4);
                                self.growth_refusals += 1;
                                self.growth_again_at = Some(now + wait);
                                self.machine.growth.answered(Answer::Refusing);
                                continue;
                            }
                            // Should the region not be one this machine allocates in, the next
                            // full allocation finds it so and runs the placement again.
                            self.growth_refusals = 0;
                            let generation = self.machine.view_generation();
                            self.machine.growth.answered(Answer::Grown(generation));
                            continue;
                        }
                        self.allocated.push((request, result));
                    }
                    Effect::Event(e) => {
                        log(me, &e);
                        self.events.push((now, e));
                    }
                }
            }
        }
    }
}

fn log(me: MachineId, e: &Event) {
    match e {
        Event::Suspect(m) => tracing::warn!(observer = me.0, suspect = m.0, "suspect"),
        Event::Attempt { config, suspects } => {
            tracing::warn!(driver = me.0, config = config.0, suspects = ?suspects, "reconfiguring")
        }
        Event::Committed(c) => tracing::info!(config = c.id.0, members = ?c.members,
            cm = c.cm.0, "configuration committed"),
        Event::Failed(why) => tracing::warn!(driver = me.0, error = %why, "reconfiguration failed"),
        Event::Probed | Event::Stored(_) | Event::AllActive(_) => {}
    }
}
