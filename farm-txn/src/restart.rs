//! A machine's part of a whole-cluster restart at work: `farm_cm::restart::RestartExchange`
//! wired to the fabric, the coordination store, the machine's NVRAM and its workers. The
//! exchange decides; this carries its effects out (a datagram, a store read or
//! compare-and-set, reopening NVRAM, continuing rings, committing) and feeds the results back,
//! so that a node process, the in-process cluster and the simulator restart by the same rules.
//! It reads no clock and starts no thread: the caller steps it with its own time until it has
//! an outcome, and gives up when it chooses (naming [`MachineRestart::waiting_for`]).

use std::sync::Arc;

use farm_cm::control::{ControlMsg, Reassembly};
use farm_cm::restart::{Effect, ExchangeParams, Outcome, Persisted, RestartExchange, RingStarts};
use farm_cm::restart::{RestartError, RestartPlan};
use farm_cm::{ConfigurationStore, CoordinationStore};
use farm_core::fabric::Fabric;
use farm_core::{MachineId, ThreadId};

use crate::machine::Reopen;
use crate::{MachineState, Params, Worker};

/// A machine that restarted as a member: its state, its workers (every ring continued where
/// its receiver found it, the restart configuration committed) and its exchange, which keeps
/// answering peers that ask late ([`crate::control::MachineControl::set_restart`]).
pub struct Restarted {
    /// The machine, reopened from its NVRAM.
    pub machine: Arc<MachineState>,
    /// Its workers, by thread.
    pub workers: Vec<Worker>,
    /// The finished exchange.
    pub exchange: RestartExchange,
}

impl std::fmt::Debug for Restarted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Restarted")
            .field("machine", &self.machine.id)
            .field("exchange", &self.exchange)
            .finish_non_exhaustive()
    }
}

/// How a machine's restart ended ([`MachineRestart::finish`]).
#[derive(Debug)]
pub enum Finished {
    /// It restarted as a member.
    Restarted(Box<Restarted>),
    /// It is not a member of the restart configuration (it was removed before the cluster
    /// stopped: its NVRAM is stale).
    Removed(RestartPlan),
    /// The restart failed here.
    Failed(RestartError),
}

/// One machine's restart: the exchange and what it acts on.
pub struct MachineRestart<'a> {
    exchange: RestartExchange,
    params: Params,
    fabric: Arc<dyn Fabric>,
    store: &'a dyn CoordinationStore,
    nvram: Reopen<'a>,
    /// Joins the pieces of long messages from peers.
    pieces: Reassembly,
    buf: Vec<u8>,
    /// Once reopened: the machine and its workers.
    restored: Option<(Arc<MachineState>, Vec<Worker>)>,
    /// See [`MachineRestart::set_check_invariants`].
    check_invariants: bool,
}

impl std::fmt::Debug for MachineRestart<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MachineRestart")
            .field("exchange", &self.exchange)
            .finish_non_exhaustive()
    }
}

impl<'a> MachineRestart<'a> {
    /// The restart of machine `me`, which left `persisted` in `nvram`, in a cluster of
    /// `exchange.machines` machines that each run `params.layout.threads` workers; `life` is
    /// drawn afresh at every start of the machine (the runtime draws it at random, the
    /// simulator from its seed).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        me: MachineId,
        exchange: ExchangeParams,
        persisted: Persisted,
        life: u64,
        params: Params,
        fabric: Arc<dyn Fabric>,
        store: &'a dyn CoordinationStore,
        nvram: Reopen<'a>,
    ) -> Self {
        Self {
            exchange: RestartExchange::new(me, exchange, persisted, life),
            params,
            fabric,
            store,
            nvram,
            pieces: Reassembly::new(),
            buf: Vec::new(),
            restored: None,
            check_invariants: cfg!(debug_assertions),
        }
    }

    /// Whether every step ends with `RestartExchange::invariants` (on in debug builds; the
    /// simulator turns it on in every build).
    pub fn set_check_invariants(&mut self, on: bool) {
        self.check_invariants = on;
    }

    /// One step at `now`: the restart's control datagrams that arrived, then a tick. Other
    /// control messages (a peer's plane, already running) are dropped: they are repeated.
    pub fn step(&mut self, now: u64) {
        let me = self.exchange.machine();
        let mut buf = std::mem::take(&mut self.buf);
        while let Some(from) = self.fabric.recv_control(me, now, &mut buf) {
            if let Some(msg) = self.pieces.accept(from, &buf) {
                self.exchange.on_message(from, msg);
                self.execute(now);
            }
        }
        self.buf = buf;
        self.exchange.tick(now);
        self.execute(now);
    }

    /// The machine.
    pub fn machine(&self) -> MachineId {
        self.exchange.machine()
    }

    /// How the restart ended here, once it did.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.exchange.outcome()
    }

    /// The machines this one waits for.
    pub fn waiting_for(&self) -> Vec<MachineId> {
        self.exchange.waiting_for()
    }

    /// Why this machine, whose turn to decide came, still waits for the machines that did not
    /// come back (`RestartExchange::not_left_out`).
    pub fn not_left_out(&self) -> Option<&str> {
        self.exchange.not_left_out()
    }

    /// The end of the restart, once [`MachineRestart::outcome`] has one.
    pub fn finish(self) -> Finished {
        match self.exchange.outcome().cloned() {
            Some(Outcome::Restarted(_)) => {
                let (machine, workers) = self.restored.expect("restarted members reopened");
                Finished::Restarted(Box::new(Restarted {
                    machine,
                    workers,
                    exchange: self.exchange,
                }))
            }
            Some(Outcome::Removed(plan)) => Finished::Removed(plan),
            Some(Outcome::Failed(e)) => Finished::Failed(e),
            None => panic!("finishing a restart that is still under way"),
        }
    }

    /// Stops the restart where it is, as a power loss does: the machine if it reopened its
    /// NVRAM (what a later restart reopens again), or `None`.
    pub fn abandon(self) -> Option<Arc<MachineState>> {
        self.restored.map(|(machine, _)| machine)
    }

    /// Carries out the exchange's effects, feeding results back, until it has none.
    fn execute(&mut self, now: u64) {
        let me = self.exchange.machine();
        loop {
            let effects = self.exchange.take_effects();
            if effects.is_empty() {
                if self.check_invariants {
                    self.exchange.invariants();
                }
                return;
            }
            for e in effects {
                match e {
                    Effect::Send { to, msg, id } => send(&*self.fabric, me, to, &msg, id, now),
                    Effect::ReadStore => {
                        let read = self.store.read_marked_config().map_err(|e| e.to_string());
                        self.exchange.on_store_read(read);
                    }
                    Effect::CompareAndSet {
                        expected,
                        config,
                        mark,
                    } => {
                        let r = self.store.cas_marked_config(expected, &config, mark);
                        self.exchange.on_cas(r.map_err(|e| e.to_string()));
                    }
                    Effect::Restore(plan) => {
                        let starts = self.restore(&plan);
                        self.exchange.on_restored(starts);
                    }
                    Effect::ResumeOutbound { receiver, starts } => {
                        let (_, workers) = self.restored.as_mut().expect("reopened");
                        // Every machine of a cluster runs as many workers: one start per ring.
                        assert_eq!(
                            starts.len(),
                            workers.len(),
                            "ring starts from {receiver} for {} threads, {} run here",
                            starts.len(),
                            workers.len()
                        );
                        for (w, s) in workers.iter_mut().zip(&starts) {
                            w.resume_outbound(receiver, [(s[0], s[1]), (s[2], s[3])]);
                        }
                    }
                    Effect::Commit(id) => {
                        // NEW-CONFIG-COMMIT of the restart: transaction recovery of everything
                        // the logs hold starts at each worker's first poll (§5.3).
                        let (machine, _) = self.restored.as_ref().expect("reopened");
                        // The configuration committed is the one this machine reopened in.
                        assert_eq!(
                            machine.view().config.id,
                            id,
                            "restart configuration {} committed over another view",
                            id.0
                        );
                        machine.commit_config(id);
                    }
                }
            }
        }
    }

    /// Reopens this machine's NVRAM with the plan and starts its workers: where each found
    /// every member's rings to it.
    fn restore(&mut self, plan: &RestartPlan) -> Result<RingStarts, String> {
        let me = self.exchange.machine();
        // Only members reopen: a machine outside the plan's configuration holds stale NVRAM.
        assert!(
            plan.config.contains(me) && self.restored.is_none(),
            "{me} reopened for configuration {} (members {:?}), or twice",
            plan.config.id.0,
            plan.config.members
        );
        let machine = MachineState::restore(
            me,
            self.params,
            plan.from.clone(),
            plan.config.id,
            self.fabric.clone(),
            self.nvram,
        )
        .map_err(|e| e.to_string())?;
        let workers: Vec<Worker> = (0..self.params.layout.threads)
            .map(|t| Worker::new(machine.clone(), ThreadId(t)))
            .collect();
        let starts = plan
            .config
            .members
            .iter()
            .map(|sender| {
                let s = workers
                    .iter()
                    .map(|w| {
                        let [(lh, lt), (qh, qt)] = w.inbound_start(*sender);
                        [lh, lt, qh, qt]
                    })
                    .collect();
                (*sender, s)
            })
            .collect();
        self.restored = Some((machine, workers));
        Ok(starts)
    }
}

/// Sends every datagram of message `id` to `to`.
pub(crate) fn send(
    fabric: &dyn Fabric,
    me: MachineId,
    to: MachineId,
    msg: &ControlMsg,
    id: u64,
    now: u64,
) {
    for d in msg.datagrams(id) {
        fabric.send_datagram(me, to, &d, now);
    }
}
