//! A machine's lease manager at work (FaRM §5.1): `farm_cm::LeaseRole` wired to the machine's
//! state and the fabric's datagrams. One round takes the datagrams that arrived, credits a
//! stall of this manager to the leases it granted, follows the configuration the machine
//! installed, renews, publishes until when the machine may serve reads
//! (`MachineState::set_serves_until`), and returns the machines whose leases ran out. It reads
//! no clock and starts no thread: the runtime's lease thread calls [`MachineLease::round`]
//! from its loop with the time since the cluster's epoch, and the simulator once per tick for
//! every running machine, so both run the same rules.

use std::sync::Arc;

use farm_cm::{LeaseConfig, LeaseEvent, LeaseMsg, LeaseRole};
use farm_core::MachineId;

use crate::MachineState;

/// Datagrams and suspicions one round handles without allocating (the runtime's lease thread
/// does not allocate in its loop).
const ROUND_CAPACITY: usize = 256;

/// One machine's lease manager.
#[derive(Debug)]
pub struct MachineLease {
    machine: Arc<MachineState>,
    role: LeaseRole,
    timing: LeaseConfig,
    /// Ticks meant between two rounds: a longer gap is a stall of this manager.
    interval: u64,
    /// The view generation the role follows.
    generation: u64,
    /// The forgiveness of the CM the role last took (`MachineState::cm_forgiven`).
    forgiven: u64,
    /// The forgiveness of suspected members the role last took
    /// (`MachineState::members_forgiven`).
    members_forgiven: u64,
    /// When the last round ran (`None` after the machine was down). The manager's creation
    /// counts as one: the leases its role starts with are granted then, and a stall before the
    /// first round must be credited to them like any other (simulator seed 130489).
    last_round: Option<u64>,
    out: Vec<(MachineId, LeaseMsg)>,
    events: Vec<LeaseEvent>,
    buf: Vec<u8>,
}

impl MachineLease {
    /// The lease manager of `machine`, with leases of `timing` starting at `now` in the
    /// configuration it has installed, rounds meant every `interval` ticks.
    pub fn new(machine: Arc<MachineState>, timing: LeaseConfig, interval: u64, now: u64) -> Self {
        let generation = machine.view_generation();
        let forgiven = machine.cm_forgiven();
        let members_forgiven = machine.members_forgiven();
        let role = LeaseRole::new(machine.id, &machine.view().config, timing, now);
        Self {
            machine,
            role,
            timing,
            interval,
            generation,
            forgiven,
            members_forgiven,
            last_round: Some(now),
            out: Vec::with_capacity(ROUND_CAPACITY),
            events: Vec::with_capacity(ROUND_CAPACITY),
            buf: Vec::with_capacity(64),
        }
    }

    /// Allows `ticks` more for the first leases to be granted (machines that start only
    /// roughly together; suspecting later is always safe).
    pub fn grace(&mut self, ticks: u64) {
        self.role.stalled(ticks);
    }

    /// A new lease length from now on, with rounds every `interval` ticks (expiries already
    /// computed stay: a shorter lease takes effect once the longer ones end).
    pub fn set_timing(&mut self, timing: LeaseConfig, interval: u64) {
        self.timing = timing;
        self.interval = interval;
        self.role.set_timing(timing);
    }

    /// The machine is down (killed): its manager runs no rounds, and the gap is no stall
    /// when it runs again.
    pub fn down(&mut self) {
        self.last_round = None;
    }

    /// One round at `now`; the machines whose leases ran out go to `suspects`.
    pub fn round(&mut self, now: u64, suspects: &mut Vec<MachineId>) {
        let me = self.machine.id;
        // This manager not being scheduled is no evidence against the peers: a stall longer
        // than a renewal is credited to the leases it granted (`CmLeases::stalled`).
        let late = self
            .last_round
            .map_or(0, |t| now.saturating_sub(t + self.interval));
        if late > self.timing.renew_ticks {
            tracing::info!(machine = me.0, late, "lease manager stalled");
            self.role.stalled(late);
        }
        self.last_round = Some(now);
        let generation = self.machine.view_generation();
        if generation != self.generation {
            self.generation = generation;
            self.role
                .follow(me, &self.machine.view().config, self.timing, now);
        }
        // A removed machine holds and grants no lease (precise membership, §5.2): a CM removed
        // with members cut off on its side would otherwise go on renewing them, and they would
        // never suspect it and so never learn that they were removed too.
        if self.machine.is_evicted() && !matches!(self.role, LeaseRole::Out) {
            tracing::info!(machine = me.0, "removed: no more leases");
            self.role = LeaseRole::Out;
        }
        let forgiven = self.machine.cm_forgiven();
        if forgiven != self.forgiven {
            self.forgiven = forgiven;
            self.role.forgive_cm(now);
        }
        let forgiven = self.machine.members_forgiven();
        if forgiven != self.members_forgiven {
            self.members_forgiven = forgiven;
            self.role.forgive_members(now);
        }
        let fabric = self.machine.fabric.clone();
        while let Some(from) = fabric.recv_datagram(me, now, &mut self.buf) {
            if let Some(msg) = LeaseMsg::decode(&self.buf) {
                self.role.on_datagram(from, msg, now, &mut self.out);
            }
        }
        self.role.tick(now, &mut self.out, &mut self.events);
        // What the machine's polls may tell applications (`MachineState::serves_at`); they
        // count time from the same epoch.
        self.machine.set_serves_until(self.role.serves_until());
        for (to, msg) in self.out.drain(..) {
            fabric.send_datagram(me, to, &msg.encode(), now);
        }
        suspects.extend(self.events.drain(..).map(|LeaseEvent::Suspect(x)| x));
    }

    /// Until when the machine may tell an application what it read
    /// (`LeaseRole::serves_until`).
    pub fn serves_until(&self) -> u64 {
        self.role.serves_until()
    }
}
