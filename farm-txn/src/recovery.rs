//! Transaction state recovery (FaRM §5.3) at one worker thread, as part of the worker's
//! deterministic state machine.
//!
//! Thread `t` of every machine recovers the transactions whose coordinator thread is `t`: their
//! records arrive in thread `t`'s logs everywhere, and recovery messages go between peer threads,
//! so the paper's sharding of lock recovery by coordinator thread falls out of the ring layout.
//!
//! At NEW-CONFIG-COMMIT a thread drains every log, the logs of machines that left included, and
//! records the configuration as LastDrained (step 2). Records of recovering transactions (step 3,
//! [`View::is_recovering`]) then move out of the normal-case maps into `RecTx`; later records
//! of them are rejected. Backups send NEED-RECOVERY per region to the primary; the primary
//! fetches write sets it lacks, locks the objects of recovering transactions in regions whose
//! primary changed, and reports its thread done (step 4; the region is active once every thread
//! is); it sends REPLICATE-TX-STATE to backups that lack records (step 5) and votes to each
//! transaction's recovery coordinator (step 6), who decides by [`decide`] (step 7), sends
//! COMMIT-RECOVERY or ABORT-RECOVERY to every replica, and TRUNCATE-RECOVERY once every one of
//! those writes is acknowledged. Primaries without records answer REQUEST-VOTE with truncated or
//! unknown from the truncation bounds each thread keeps per sender.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use farm_core::fabric::WriteTicket;
use farm_core::object;
use farm_core::ring::RecordPos;
use farm_core::wire::{LogBody, Message, RecoveryBody, Seen, WriteEntry, WriteSet};
use farm_core::{ConfigId, MachineId, RegionId, TxnId};
use farm_recovery::vote::{decide, recovery_coordinator, vote, Evidence, Vote};

pub use farm_recovery::vote::Decision;

use crate::machine::View;
use crate::worker::Worker;

/// Recovery state of one worker thread.
#[derive(Debug)]
pub(crate) struct RecoveryState {
    /// LastDrained: the newest configuration whose logs this thread drained.
    pub(crate) last_drained: ConfigId,
    /// The view of `last_drained`, which decides which transactions are recovering.
    drained_view: Option<Arc<View>>,
    /// Recovering transactions with records (or decisions) here.
    txs: BTreeMap<TxnId, RecTx>,
    /// This round's lock recovery, per region this machine is primary for.
    regions: BTreeMap<RegionId, RegionRound>,
    /// Transactions this thread coordinates the recovery of.
    coord: BTreeMap<TxnId, CoordRound>,
    /// Transactions whose recovery this thread coordinated to the end, with the decision: a
    /// later vote (an answer to REQUEST-VOTE that crossed a vote, or a next round's) gets the
    /// same decision sent again to the region's current replicas (a new backup may have
    /// received the records since), never a new one.
    finished: BTreeMap<TxnId, Decision>,
    /// Recovered transactions this thread forgot after TRUNCATE-RECOVERY: a decision repeated
    /// by a later coordinator must not bring them back. Both sets hold only transactions that
    /// were in flight at a failure.
    forgotten: BTreeMap<TxnId, Decision>,
    /// Decisions (and whether TRUNCATE-RECOVERY followed) for transactions this thread has no
    /// records of, kept in case REPLICATE-TX-STATE brings them later (even in a later round).
    /// Like `finished`, this holds only transactions that were in flight at a failure.
    early_decisions: BTreeMap<TxnId, (Decision, bool)>,
    /// Messages of a configuration this thread has not drained yet.
    early: Vec<(MachineId, ConfigId, RegionId, RecoveryBody)>,
    /// Machines outside the configuration whose logs and queues a drain already took in: a
    /// machine that left is drained once, in the first round without it; what it writes later
    /// (a paused machine resuming on its stale view, §5.2 precise membership) is never read.
    left_drained: BTreeSet<MachineId>,
    /// This thread's own commits whose outcome recovery decides, and the decisions made.
    pub(crate) waiting: BTreeSet<TxnId>,
    pub(crate) decided: BTreeMap<TxnId, Decision>,
    /// Per transaction, where the recovery messages kept for a restart lie, dropped when it
    /// is forgotten.
    pub(crate) logged: BTreeMap<TxnId, Vec<Kept>>,
}

/// Where a recovery message kept for a restart lies (see [`crate::recovery_log`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kept {
    /// In this thread's recovery log.
    Log(RecordPos),
    /// Still in the queue it arrived in, from this sender, whose slot is held: the recovery
    /// log was full. A held slot stops the sender's queue from wrapping past it, which is the
    /// back-pressure a full recovery log puts on its senders.
    Queue(MachineId, RecordPos),
}

impl RecoveryState {
    pub(crate) fn new(config: ConfigId) -> Self {
        Self {
            last_drained: config,
            drained_view: None,
            txs: BTreeMap::new(),
            regions: BTreeMap::new(),
            coord: BTreeMap::new(),
            finished: BTreeMap::new(),
            forgotten: BTreeMap::new(),
            early_decisions: BTreeMap::new(),
            early: Vec::new(),
            left_drained: BTreeSet::new(),
            waiting: BTreeSet::new(),
            decided: BTreeMap::new(),
            logged: BTreeMap::new(),
        }
    }

    /// Recovery messages kept until their configuration is drained here.
    pub(crate) fn early_len(&self) -> usize {
        self.early.len()
    }

    /// Checks what this thread's recovery holds (see `Worker::invariants`).
    pub(crate) fn invariants(&self, me: MachineId, thread: farm_core::ThreadId) {
        // Thread t of every machine recovers the transactions whose coordinator thread is t:
        // their records are in thread t's logs, their messages between peer threads t.
        for t in self.txs.keys().chain(self.coord.keys()) {
            assert_eq!(t.thread, thread, "{t} recovered by thread {}", thread.0);
        }
        for t in &self.waiting {
            assert!(
                t.machine == me && t.thread == thread,
                "{t} waited for by {me}'s thread {}",
                thread.0
            );
        }
        for (t, round) in &self.coord {
            // A decision goes out only once made (§5.3 step 7).
            assert!(
                round.decision.is_some() || (round.to_send.is_empty() && round.tickets.is_empty()),
                "{t}: a decision sent before it was made"
            );
            // Only the transaction's recovery coordinator in the drained configuration collects
            // votes to decide it (step 6); a machine that coordinated it in an earlier one
            // (consistent hashing moved it since) keeps only a decision it made.
            if let (None, Some(view)) = (round.decision, &self.drained_view) {
                let c = recovery_coordinator(*t, &view.config);
                assert!(
                    c == me,
                    "{t} undecided at {me} in configuration {}, whose recovery coordinator is {c}",
                    view.config.id.0
                );
            }
        }
        for (from, config, region, _) in &self.early {
            assert!(
                *config > self.last_drained,
                "a message of configuration {} from {from} for {region:?} kept after its drain",
                config.0
            );
        }
    }

    /// Whether nothing is left to recover at this thread.
    pub(crate) fn is_idle(&self) -> bool {
        self.txs.is_empty()
            && self.coord.is_empty()
            && self
                .regions
                .values()
                .all(|r| r.done && r.unvoted.is_empty())
            && self.waiting.is_empty()
    }
}

/// What this machine knows of one recovering transaction.
#[derive(Debug, Default)]
struct RecTx {
    /// Every region the transaction wrote.
    regions: Vec<RegionId>,
    /// Writes of the LOCK record processed here as primary.
    lock: Option<WriteSet>,
    /// Whether the LOCK record's locks are still held here.
    locks_held: bool,
    /// COMMIT-PRIMARY was applied here, or COMMIT-RECOVERY arrived.
    commit_primary: bool,
    /// Writes of the COMMIT-BACKUP record processed here.
    commit_backup: Option<WriteSet>,
    /// Writes learnt from other replicas (SEND-TX-STATE, REPLICATE-TX-STATE).
    fetched: Vec<WriteEntry>,
    /// Regions whose backups reported COMMIT-BACKUP in SEND-TX-STATE.
    fetched_commit_backup: BTreeSet<RegionId>,
    /// ABORT-RECOVERY arrived.
    abort_recovery: bool,
    /// The slots the transaction allocated here went back to the free lists (at most once,
    /// whichever abort comes first).
    slots_freed: bool,
    /// The coordinator's own ABORT arrived (it aborts before any COMMIT-BACKUP).
    aborted: bool,
    decision: Option<Decision>,
    /// The decision was carried out here.
    applied: bool,
    /// TRUNCATE-RECOVERY arrived.
    truncated: bool,
    /// Objects locked here by lock recovery.
    recovery_locked: Vec<WriteEntry>,
    /// Log records (in the coordinator's log at this thread) to free when forgotten.
    records: Vec<RecordPos>,
}

impl RecTx {
    /// Writes in `region` known here, each address once.
    fn writes_in(&self, region: RegionId) -> Vec<WriteEntry> {
        let mut seen = BTreeSet::new();
        self.lock
            .iter()
            .chain(&self.commit_backup)
            .flat_map(|ws| &ws.writes)
            .chain(&self.fetched)
            .filter(|w| w.addr.region == region && seen.insert(w.addr))
            .cloned()
            .collect()
    }

    fn has_data(&self) -> bool {
        self.lock.is_some() || self.commit_backup.is_some() || !self.fetched.is_empty()
    }

    /// What this replica saw of the transaction besides its writes in `region`, as
    /// SEND-TX-STATE and REPLICATE-TX-STATE carry it.
    fn seen(&self, region: RegionId) -> Seen {
        let e = self.evidence(region);
        Seen {
            commit_backup: e.commit_backup,
            commit: e.commit_primary,
            abort: e.abort_recovery,
        }
    }

    /// Adds what another replica of `region` saw.
    fn add_seen(&mut self, region: RegionId, seen: Seen) {
        if seen.commit_backup {
            self.fetched_commit_backup.insert(region);
        }
        self.commit_primary |= seen.commit;
        self.abort_recovery |= seen.abort;
    }

    /// The evidence of this replica of `region` (§5.3 step 6).
    fn evidence(&self, region: RegionId) -> Evidence {
        let has = |ws: &Option<WriteSet>| {
            ws.as_ref()
                .is_some_and(|ws| ws.writes.iter().any(|w| w.addr.region == region))
        };
        Evidence {
            commit_primary: self.commit_primary,
            commit_backup: has(&self.commit_backup) || self.fetched_commit_backup.contains(&region),
            lock: has(&self.lock) || self.fetched.iter().any(|w| w.addr.region == region),
            abort_recovery: self.abort_recovery || self.aborted,
        }
    }
}

/// Lock recovery of one region at its primary.
#[derive(Debug)]
struct RegionRound {
    /// Backups whose NEED-RECOVERY has not arrived.
    awaiting: BTreeSet<MachineId>,
    /// Recovering transactions that wrote the region, with the backups that have records.
    listed: BTreeMap<TxnId, BTreeSet<MachineId>>,
    /// Transactions whose write sets were asked of backups.
    fetching: BTreeSet<(TxnId, MachineId)>,
    /// Every backup reported and every missing write set arrived: lock recovery may run once
    /// every local thread has drained its logs.
    ready: bool,
    /// Locks taken (votes follow replication).
    done: bool,
    /// Transactions whose vote waits for their REPLICATE-TX-STATE writes to land (§5.3 step 6:
    /// a primary votes after replication completes), with messages not yet placed in a full
    /// queue and the tickets of those placed.
    unvoted: Vec<PendingVote>,
}

/// A vote waiting for replication.
#[derive(Debug)]
struct PendingVote {
    txn: TxnId,
    unsent: Vec<(MachineId, Message)>,
    sent: Vec<(MachineId, Option<WriteTicket>)>,
}

/// A recovering transaction at its recovery coordinator.
#[derive(Debug)]
struct CoordRound {
    regions: Vec<RegionId>,
    votes: BTreeMap<RegionId, Vote>,
    /// When votes were last asked for.
    since: u64,
    /// REQUEST-VOTE rounds sent so far: each waits twice as long as the one before, up to a
    /// lease, so that a primary slow to answer (paused, or with a full queue) is not flooded
    /// (asking every tick overflowed a backlog in the simulator, crash campaign seed 1616).
    asks: u32,
    decision: Option<Decision>,
    /// Replicas not yet sent the decision.
    to_send: Vec<MachineId>,
    /// The decision's writes, acknowledged when landed.
    tickets: Vec<(MachineId, Option<WriteTicket>)>,
}

/// The wait before the REQUEST-VOTE round after `asks` earlier ones: the first timeout, doubled
/// with each round, at most a lease.
fn request_vote_wait(first: u64, lease: u64, asks: u32) -> u64 {
    first
        .saturating_mul(1u64 << asks.min(32))
        .min(lease.max(first))
}

/// Whether a recovery round of configuration `drained` may judge `t`: only one after the
/// configuration `t` started committing in (§5.3: a transaction is recovering because of a
/// change in a later configuration; in its own, its records are processed normally).
fn recovering_in(t: TxnId, drained: ConfigId) -> bool {
    t.config < drained
}

/// Whether `region`'s primary changed after `t` started committing: the current primary then
/// learnt the transaction only as a backup (or from one), not from its own LOCK record.
fn primary_moved_since(view: &View, region: RegionId, t: TxnId) -> bool {
    view.changes
        .get(&region)
        .is_some_and(|c| c.last_primary_change > t.config)
}

impl CoordRound {
    /// Adds the replicas of `placement` not yet sent the decision.
    fn also_send_to(&mut self, placement: &farm_core::config::Placement) {
        for m in placement.replicas() {
            let known = self.to_send.contains(&m) || self.tickets.iter().any(|(x, _)| *x == m);
            if !known {
                self.to_send.push(m);
            }
        }
    }

    fn new(regions: Vec<RegionId>, now: u64) -> Self {
        Self {
            regions,
            votes: BTreeMap::new(),
            since: now,
            asks: 0,
            decision: None,
            to_send: Vec::new(),
            tickets: Vec::new(),
        }
    }
}

/// The message that carries decision `d` on `t` to a replica (step 7).
fn decision_body(d: Decision, t: TxnId) -> RecoveryBody {
    match d {
        Decision::Commit => RecoveryBody::CommitRecovery(t),
        Decision::Abort => RecoveryBody::AbortRecovery(t),
    }
}

impl Worker {
    /// Starts recovery for a newly committed configuration and advances the coordinator side.
    pub(crate) fn recovery_poll(&mut self) -> bool {
        let mut busy = false;
        let config = self.view.config.id;
        if config > self.recovery.last_drained && self.machine.committed_config() >= config {
            self.start_round(self.view.clone());
            busy = true;
        }
        if self.recovery.regions.is_empty() && self.recovery.coord.is_empty() {
            return busy;
        }
        let waiting: Vec<RegionId> = self
            .recovery
            .regions
            .iter()
            .filter(|(_, r)| r.ready && !r.done)
            .map(|(id, _)| *id)
            .collect();
        if !waiting.is_empty() && self.machine.all_drained(self.recovery.last_drained) {
            for region in waiting {
                self.lock_region(region);
            }
            busy = true;
        }
        let replicating: Vec<RegionId> = self
            .recovery
            .regions
            .iter()
            .filter(|(_, r)| !r.unvoted.is_empty())
            .map(|(id, _)| *id)
            .collect();
        for region in replicating {
            busy |= self.replicate_and_vote(region);
        }
        if !self.recovery.coord.is_empty() {
            busy |= self.coordinate();
        }
        busy
    }

    /// Whether this machine has nothing left to recover on this thread.
    pub fn recovery_idle(&self) -> bool {
        self.recovery.is_idle()
    }

    /// What recovery still holds at this thread, for diagnostics.
    pub fn recovery_summary(&self) -> String {
        let r = &self.recovery;
        let txs: Vec<String> = r
            .txs
            .iter()
            .map(|(t, tx)| {
                format!(
                    "{t}: decision {:?} applied {} truncated {} data {} locks_held {} regions {:?}",
                    tx.decision,
                    tx.applied,
                    tx.truncated,
                    tx.has_data(),
                    tx.locks_held,
                    tx.regions
                )
            })
            .collect();
        let coord: Vec<String> = r
            .coord
            .iter()
            .map(|(t, c)| {
                format!(
                    "{t}: regions {:?} votes {:?} decision {:?} to_send {:?}",
                    c.regions, c.votes, c.decision, c.to_send
                )
            })
            .collect();
        let regions: Vec<String> = r
            .regions
            .iter()
            .filter(|(_, g)| !g.done)
            .map(|(id, g)| {
                format!(
                    "{id:?}: awaiting {:?} fetching {:?}",
                    g.awaiting, g.fetching
                )
            })
            .collect();
        format!(
            "drained {:?}; txs {txs:?}; coordinating {coord:?}; regions {regions:?}; waiting {:?}; early {}",
            r.last_drained,
            r.waiting,
            r.early.len()
        )
    }

    /// LastDrained of this thread.
    pub fn last_drained(&self) -> ConfigId {
        self.recovery.last_drained
    }

    /// A record of a transaction that is recovering and whose logs were drained: rejected.
    pub(crate) fn reject_after_drain(&self, rec: &farm_core::wire::LogRecord) -> bool {
        let Some(view) = &self.recovery.drained_view else {
            return false;
        };
        if rec.txn.config >= self.recovery.last_drained {
            return false;
        }
        if self.recovery.txs.contains_key(&rec.txn) {
            return true;
        }
        match &rec.body {
            farm_core::wire::LogBody::Lock(ws) | farm_core::wire::LogBody::CommitBackup(ws) => {
                view.is_recovering(rec.txn, &ws.regions)
            }
            _ => false,
        }
    }

    /// A normal ABORT for a transaction whose LOCK recovery took over.
    pub(crate) fn recovery_abort_record(&mut self, txn: TxnId) {
        let Some(tx) = self.recovery.txs.get_mut(&txn) else {
            return;
        };
        tx.aborted = true;
        let held = std::mem::replace(&mut tx.locks_held, false);
        let ws = tx.lock.clone();
        let free = !std::mem::replace(&mut tx.slots_freed, true);
        if let Some(ws) = ws {
            if held {
                self.unlock_all(&ws);
            }
            if free {
                self.free_fresh_slots(&ws);
            }
        }
    }

    /// Steps 2-4 for configuration `view`: drain, find recovering transactions, NEED-RECOVERY,
    /// and start lock recovery of the regions this machine is primary for.
    fn start_round(&mut self, view: Arc<View>) {
        let c = view.config.id;
        let me = self.machine.id;
        // §5.3 step 2: a thread drains each configuration once, after its NEW-CONFIG-COMMIT.
        assert!(
            c > self.recovery.last_drained,
            "configuration {} drained again (last drained {})",
            c.0,
            self.recovery.last_drained.0
        );
        assert!(
            self.machine.committed_config() >= c,
            "configuration {} drained before its NEW-CONFIG-COMMIT",
            c.0
        );
        // Step 2: every log, also those of machines that left (their records may decide
        // transactions). Records are processed as in the normal case. Message queues first:
        // a decision of an earlier round that landed here must count before this round votes,
        // even one from a coordinator that has left since.
        let left = &mut self.recovery.left_drained;
        left.retain(|m| !view.config.contains(*m));
        let senders: Vec<MachineId> = (0..self.inbound.len() as u16)
            .map(MachineId)
            .filter(|m| !left.contains(m))
            .collect();
        for &sender in &senders {
            self.poll_queue(sender);
        }
        // The first drain after a whole-cluster restart (which may be of a later configuration,
        // when another failure came first) takes the previous life's records to recovery.
        let restart = self
            .machine
            .restart_config()
            .filter(|r| self.recovery.last_drained < *r);
        for &sender in &senders {
            if let Some(r) = restart {
                self.restart_drain_log(sender, r);
            } else {
                self.poll_log(sender);
            }
            // Records polled from here on landed after the drain (`reject_after_drain`); a
            // restart tells them apart by this mark.
            let pos = self.inbound[sender.0 as usize].log.polled();
            self.machine.set_drain_mark(sender, self.thread.0, pos, c);
        }
        if restart.is_some() {
            self.restart_drop_unrecoverable(&view);
            for &sender in &senders {
                self.report_freed(sender, farm_core::ring::RingKind::Log, true);
            }
        }
        self.recovery
            .left_drained
            .extend(senders.iter().filter(|m| !view.config.contains(**m)));
        self.recovery.last_drained = c;
        self.recovery.drained_view = Some(view.clone());
        self.machine.thread_drained(c, self.thread.0);
        tracing::debug!(
            machine = me.0,
            thread = self.thread.0,
            config = c.0,
            recovering = self.recovery.txs.len(),
            "logs drained"
        );
        // Step 3: recovering transactions among the records held here.
        for sender in 0..self.inbound.len() {
            let inbound = &mut self.inbound[sender];
            let locks: Vec<u64> = inbound
                .locks
                .iter()
                .filter(|(_, h)| view.is_recovering(h.txn, &h.writes.regions))
                .map(|(l, _)| *l)
                .collect();
            for l in locks {
                let held = inbound.locks.remove(&l).expect("listed");
                let tx = self.recovery.txs.entry(held.txn).or_default();
                tx.regions = held.writes.regions.clone();
                tx.locks_held = held.ok;
                tx.lock = Some(held.writes);
                tx.records.push(held.record);
            }
            let retained: Vec<u64> = inbound
                .retained
                .iter()
                .filter(|(_, r)| {
                    let ws = r.primary_writes.as_ref().or(r.backup_writes.as_ref());
                    ws.is_some_and(|ws| view.is_recovering(r.txn, &ws.regions))
                })
                .map(|(l, _)| *l)
                .collect();
            for l in retained {
                let r = inbound.retained.remove(&l).expect("listed");
                let tx = self.recovery.txs.entry(r.txn).or_default();
                if let Some(ws) = r.primary_writes.as_ref().or(r.backup_writes.as_ref()) {
                    tx.regions = ws.regions.clone();
                }
                tx.commit_primary |= r.primary_writes.is_some();
                if r.primary_writes.is_some() {
                    tx.lock = r.primary_writes;
                }
                tx.commit_backup = r.backup_writes;
                tx.records.extend(r.records);
            }
        }
        // Decisions that arrived before any record of their transaction, which the drain
        // just found.
        let early: Vec<TxnId> = (self.recovery.early_decisions.keys())
            .filter(|t| self.recovery.txs.contains_key(t))
            .copied()
            .collect();
        for t in early {
            self.adopt_early_decision(t);
        }
        // Decisions that arrived in an earlier round before the records they apply to.
        let pending: Vec<TxnId> = self
            .recovery
            .txs
            .iter()
            .filter(|(_, tx)| tx.decision.is_some() && !tx.applied)
            .map(|(t, _)| *t)
            .collect();
        for t in pending {
            self.apply_decision(t);
        }
        // A new round re-collects votes for what is still undecided, at the transaction's
        // recovery coordinator in this configuration only: one that a join moved elsewhere by
        // consistent hashing is left to its new coordinator, which would otherwise share it
        // with this machine, both asking for votes and sending decisions (simulator seed 1007
        // of the joins campaign). A decision made here still goes out from here.
        self.recovery.regions.clear();
        let now = self.now;
        self.recovery.coord.retain(|t, round| {
            round.decision.is_some() || recovery_coordinator(*t, &view.config) == me
        });
        for round in self.recovery.coord.values_mut() {
            // Votes are collected again (truncation waits for every region's, after its
            // replication, at its current primary); a decision already made also goes to the
            // regions' new replicas.
            round.votes.clear();
            round.since = now;
            if round.decision.is_some() {
                for r in round.regions.clone() {
                    if let Some(p) = view.map.get(r) {
                        round.also_send_to(p);
                    }
                }
            }
        }
        // NEED-RECOVERY from backups (step 3), for every region this machine backs up.
        for (region, placement) in view.map.iter() {
            if !placement.backups.contains(&me) {
                continue;
            }
            let txns: Vec<TxnId> = self
                .recovery
                .txs
                .iter()
                .filter(|(_, tx)| !tx.writes_in(region).is_empty())
                .map(|(t, _)| *t)
                .collect();
            self.send_recovery(
                placement.primary,
                c,
                region,
                RecoveryBody::NeedRecovery(txns),
            );
        }
        // Lock recovery at primaries (step 4) starts once every backup has reported.
        let primary_of: Vec<RegionId> = view.map.primary_of(me).collect();
        for region in primary_of {
            let placement = view.map.get(region).expect("mapped");
            let listed = self
                .recovery
                .txs
                .iter()
                .filter(|(_, tx)| !tx.writes_in(region).is_empty())
                .map(|(t, _)| (*t, BTreeSet::new()))
                .collect();
            let round = RegionRound {
                awaiting: placement.backups.iter().copied().collect(),
                listed,
                fetching: BTreeSet::new(),
                ready: false,
                done: false,
                unvoted: Vec::new(),
            };
            let ready = round.awaiting.is_empty();
            self.recovery.regions.insert(region, round);
            if ready {
                self.region_collected(region);
            }
        }
        let early = std::mem::take(&mut self.recovery.early);
        for (from, config, region, body) in early {
            self.on_recovery_message(from, config, region, body);
        }
    }

    /// Step 2 after a whole-cluster restart into configuration `restart`: every record left in
    /// the log from `sender` belongs to a transaction whose coordinator's state is gone, so each
    /// goes to recovery as it is, nothing applied or locked (`MachineState::restore` cleared
    /// the previous life's lock bits; every region's primary "changed", so lock recovery
    /// locks what the recovering transactions wrote).
    /// Records that landed after the previous life's last drain of this log, of transactions
    /// recovering in the configuration drained, had been rejected (`reject_after_drain`): they
    /// are freed again, not recovered.
    fn restart_drain_log(&mut self, sender: MachineId, restart: ConfigId) {
        let mut buf = std::mem::take(&mut self.buf);
        let (mark, drained) = self.machine.drain_mark(sender, self.thread.0);
        let drained_view = match drained {
            ConfigId(0) => None,
            c => {
                let v = self.machine.installed_view(c);
                if v.is_none() {
                    tracing::warn!(
                        machine = self.machine.id.0,
                        config = c.0,
                        "no view of the configuration last drained: records that landed after \
                         the drain are recovered"
                    );
                }
                v
            }
        };
        while let Some(pos) = self.inbound[sender.0 as usize].log.poll(&mut buf) {
            let rec = match farm_core::wire::LogRecord::decode(&buf) {
                Ok(rec) => rec,
                Err(e) => {
                    self.malformed(sender, farm_core::ring::RingKind::Log, pos, &e);
                    self.inbound[sender.0 as usize].log.release(pos);
                    continue;
                }
            };
            if rec.txn.config >= restart {
                self.on_log_record(sender, pos, rec);
                continue;
            }
            self.truncate_from(sender, rec.truncate_below, &rec.truncated);
            if matches!(rec.body, LogBody::Truncate) {
                self.inbound[sender.0 as usize].log.release(pos);
                continue;
            }
            if let (true, Some(d)) = (pos.0 >= mark && rec.txn.config < drained, &drained_view) {
                let regions = match &rec.body {
                    LogBody::Lock(ws) | LogBody::CommitBackup(ws) => ws.regions.clone(),
                    LogBody::Abort => Vec::new(), // Never rejected.
                    _ => self
                        .recovery
                        .txs
                        .get(&rec.txn)
                        .map(|tx| tx.regions.clone())
                        .unwrap_or_default(),
                };
                let rejected = !regions.is_empty()
                    && farm_recovery::vote::is_recovering(
                        rec.txn,
                        &regions,
                        &[],
                        &d.config,
                        &d.changes,
                    );
                if rejected {
                    self.stats.restart_late_rejected += 1;
                    self.inbound[sender.0 as usize].log.release(pos);
                    continue;
                }
            }
            let tx = self.recovery.txs.entry(rec.txn).or_default();
            // The allocator scan after restart finds free slots from the headers (§5.5):
            // freeing an aborted transaction's slots as well would free them twice.
            tx.slots_freed = true;
            tx.records.push(pos);
            match rec.body {
                LogBody::Lock(ws) => {
                    tx.regions = ws.regions.clone();
                    tx.lock = Some(ws);
                }
                LogBody::CommitBackup(ws) => {
                    tx.regions = ws.regions.clone();
                    tx.commit_backup = Some(ws);
                }
                LogBody::CommitPrimary => tx.commit_primary = true,
                LogBody::Abort => tx.aborted = true,
                LogBody::Truncate => unreachable!("handled above"),
            }
        }
        self.buf = buf;
        // Truncations piggybacked on the records just drained are the previous life's too.
        let inbound = &mut self.inbound[sender.0 as usize];
        inbound.restart_truncated_below =
            inbound.restart_truncated_below.max(inbound.truncated_below);
    }

    /// After the restart drain: transactions known here only by records no region can vote on
    /// (an ABORT whose LOCK was freed, a COMMIT-PRIMARY whose LOCK was truncated, a decision
    /// whose writes never came), or only by writes in regions this machine no longer holds
    /// (the view it restarted in moved them), are done with here: their records and recovery
    /// log entries are freed.
    fn restart_drop_unrecoverable(&mut self, view: &View) {
        let me = self.machine.id;
        let drop: Vec<TxnId> = self
            .recovery
            .txs
            .iter()
            .filter(|(_, tx)| {
                !tx.has_data()
                    || !view
                        .map
                        .iter()
                        .any(|(r, p)| p.holds(me) && !tx.writes_in(r).is_empty())
            })
            .map(|(t, _)| *t)
            .collect();
        for t in drop {
            let tx = self.recovery.txs.remove(&t).expect("listed");
            for pos in tx.records {
                self.inbound[t.machine.0 as usize].log.release(pos);
            }
            self.release_kept(t);
        }
    }

    fn send_recovery(
        &mut self,
        dst: MachineId,
        config: ConfigId,
        region: RegionId,
        body: RecoveryBody,
    ) {
        self.send_message(
            dst,
            &Message::Recovery {
                config,
                region,
                body,
            },
        );
    }

    /// Whether a recovery message of `config` from `sender` is to be refused (and is counted)
    /// for naming a configuration further ahead than any peer can. A peer sends a
    /// configuration's recovery messages only once it committed it, and to its members, each
    /// of which acknowledged NEW-CONFIG only after installing it (§5.2): so at most one beyond
    /// the newest view installed here (one: a whole-cluster restart's configuration, which
    /// peers may start recovering before this machine installs it). Not to a machine that
    /// left: one removed keeps running on its stale view until its lease tells it it is out,
    /// and configuration ids skip (a compare-and-set that timed out after taking effect), so
    /// it may be any number behind; a recovery coordinator's decisions and truncations for
    /// replicas of an earlier view therefore go to members of the configuration they name
    /// only (`Worker::coordinate`). Messages of a
    /// configuration not drained yet are kept until it is (`RecoveryState::early`); without
    /// this, a peer naming ever newer configurations would grow that without limit.
    pub(crate) fn recovery_too_far_ahead(&mut self, sender: MachineId, config: ConfigId) -> bool {
        if config <= self.recovery.last_drained {
            return false;
        }
        let installed = self.machine.view().config.id;
        if config.0 <= installed.0 + 1 {
            return false;
        }
        self.stats.recovery_refused += 1;
        if self.stats.recovery_refused == 1 {
            tracing::warn!(
                machine = self.machine.id.0,
                thread = self.thread.0,
                sender = sender.0,
                config = config.0,
                installed = installed.0,
                "refused a recovery message of a configuration further ahead than a peer can \
                 send (counted in recovery_refused; this warning is not repeated)"
            );
        }
        true
    }

    /// A recovery message from `from`'s peer thread.
    pub(crate) fn on_recovery_message(
        &mut self,
        from: MachineId,
        config: ConfigId,
        region: RegionId,
        body: RecoveryBody,
    ) {
        // Nothing of a configuration is looked at before this thread drained its logs for it.
        if config > self.recovery.last_drained {
            self.recovery.early.push((from, config, region, body));
            return;
        }
        // Decisions are final whatever the configuration; everything else belongs to a round.
        match body {
            RecoveryBody::CommitRecovery(t) => return self.on_decision(t, Decision::Commit),
            RecoveryBody::AbortRecovery(t) => return self.on_decision(t, Decision::Abort),
            RecoveryBody::TruncateRecovery(t) => return self.on_truncate_recovery(t),
            _ => {}
        }
        if config < self.recovery.last_drained {
            // A later round redoes this one's work.
            if let RecoveryBody::ReplicateTxState(t, ws, seen) = body {
                self.on_replicate(region, t, ws, seen);
            }
            return;
        }
        match body {
            RecoveryBody::NeedRecovery(ts) => self.on_need_recovery(from, region, ts),
            RecoveryBody::FetchTxState(ts) => {
                for t in ts {
                    let (regions, writes, seen) = match self.recovery.txs.get(&t) {
                        Some(tx) => (tx.regions.clone(), tx.writes_in(region), tx.seen(region)),
                        None => (Vec::new(), Vec::new(), Seen::default()),
                    };
                    let ws = WriteSet { regions, writes };
                    let body = RecoveryBody::SendTxState(t, ws, seen);
                    self.send_recovery(from, config, region, body);
                }
            }
            RecoveryBody::SendTxState(t, ws, seen) => {
                self.on_send_tx_state(from, region, t, ws, seen)
            }
            RecoveryBody::ReplicateTxState(t, ws, seen) => self.on_replicate(region, t, ws, seen),
            RecoveryBody::RecoveryVote(t, regions, v) => self.on_vote(region, t, regions, v),
            RecoveryBody::RequestVote(t) => self.on_request_vote(from, region, t),
            RecoveryBody::CommitRecovery(_)
            | RecoveryBody::AbortRecovery(_)
            | RecoveryBody::TruncateRecovery(_) => unreachable!("handled above"),
        }
    }

    fn on_need_recovery(&mut self, from: MachineId, region: RegionId, ts: Vec<TxnId>) {
        let Some(round) = self.recovery.regions.get_mut(&region) else {
            return; // Not primary of it in this configuration.
        };
        if !round.awaiting.remove(&from) {
            return;
        }
        for t in ts {
            round.listed.entry(t).or_default().insert(from);
        }
        if round.awaiting.is_empty() {
            self.region_collected(region);
        }
    }

    /// Every backup reported: fetch the records this primary lacks (step 4): write sets it
    /// does not have, and, unless it saw a decision itself, what every backup holding the
    /// transaction saw (the region's vote counts any replica's evidence: a backup may have
    /// seen an ABORT-RECOVERY or COMMIT-RECOVERY this primary has not).
    fn region_collected(&mut self, region: RegionId) {
        let c = self.recovery.last_drained;
        let round = self.recovery.regions.get_mut(&region).expect("round");
        assert!(
            round.awaiting.is_empty() && !round.ready && !round.done,
            "{region:?} collected before every NEED-RECOVERY, or twice"
        );
        let txs = &self.recovery.txs;
        // Transactions this primary listed itself may have been decided and forgotten since.
        round
            .listed
            .retain(|t, holders| !holders.is_empty() || txs.contains_key(t));
        let mut fetch: BTreeMap<MachineId, Vec<TxnId>> = BTreeMap::new();
        for (t, holders) in &round.listed {
            let lacking = txs.get(t).is_none_or(|tx| {
                let e = tx.evidence(region);
                tx.writes_in(region).is_empty() || !(e.commit_primary || e.abort_recovery)
            });
            if lacking {
                for from in holders {
                    fetch.entry(*from).or_default().push(*t);
                }
            }
        }
        let fetching: BTreeSet<(TxnId, MachineId)> = fetch
            .iter()
            .flat_map(|(b, ts)| ts.iter().map(move |t| (*t, *b)))
            .collect();
        let empty = fetching.is_empty();
        self.recovery
            .regions
            .get_mut(&region)
            .expect("round")
            .fetching = fetching;
        for (b, ts) in fetch {
            self.send_recovery(b, c, region, RecoveryBody::FetchTxState(ts));
        }
        if empty {
            self.region_ready(region);
        }
    }

    fn on_send_tx_state(
        &mut self,
        from: MachineId,
        region: RegionId,
        t: TxnId,
        ws: WriteSet,
        seen: Seen,
    ) {
        self.merge_state(t, ws);
        if let Some(tx) = self.recovery.txs.get_mut(&t) {
            tx.add_seen(region, seen);
        }
        let Some(round) = self.recovery.regions.get_mut(&region) else {
            return;
        };
        if round.fetching.remove(&(t, from)) && round.fetching.is_empty() && !round.done {
            self.region_ready(region);
        }
    }

    /// Adds writes learnt from another replica. Writes that arrive after the transaction's
    /// commit was carried out here (another region's REPLICATE-TX-STATE) install at once.
    fn merge_state(&mut self, t: TxnId, ws: WriteSet) {
        if ws.writes.is_empty() || self.recovery.forgotten.contains_key(&t) {
            return;
        }
        let tx = self.recovery.txs.entry(t).or_default();
        if tx.regions.is_empty() {
            tx.regions = ws.regions;
        }
        let mut late = Vec::new();
        for w in ws.writes {
            if !tx.fetched.iter().any(|f| f.addr == w.addr) {
                if tx.applied && tx.decision == Some(Decision::Commit) {
                    late.push(w.clone());
                }
                tx.fetched.push(w);
            }
        }
        if !late.is_empty() {
            self.install_recovered(t, late);
            return;
        }
        self.adopt_early_decision(t);
    }

    /// A decision (and TRUNCATE-RECOVERY) that arrived before this thread had any record of
    /// `t` applies once it has one, whichever way the records came: REPLICATE-TX-STATE, or its
    /// own logs at a later drain. Without the second, a thread that got ABORT-RECOVERY before
    /// a new configuration made it drain `t`'s records waited forever for a decision the
    /// coordinator had already sent it (simulator seed 661 of the crash campaign).
    fn adopt_early_decision(&mut self, t: TxnId) {
        let Some(tx) = self.recovery.txs.get_mut(&t) else {
            return;
        };
        if let Some((d, truncated)) = self.recovery.early_decisions.remove(&t) {
            tx.truncated |= truncated;
            self.on_decision(t, d);
        }
    }

    /// Marks a region's lock recovery ready and runs it if every local log is drained (another
    /// thread may still act as a backup of the region until it drains).
    fn region_ready(&mut self, region: RegionId) {
        let round = self.recovery.regions.get_mut(&region).expect("round");
        // §5.3 step 4 needs every backup's list and every write set fetched.
        assert!(
            round.awaiting.is_empty() && round.fetching.is_empty() && !round.done,
            "{region:?} ready with backups or write sets outstanding, or after its lock recovery"
        );
        round.ready = true;
        if self.machine.all_drained(self.recovery.last_drained) {
            self.lock_region(region);
        }
    }

    /// Step 4 (lock the objects of recovering transactions where the primary changed, then
    /// the region is active as far as this thread goes), step 5 (replicate) and step 6 (vote).
    fn lock_region(&mut self, region: RegionId) {
        let c = self.recovery.last_drained;
        let view = self.recovery.drained_view.clone().expect("drained");
        let placement = view.map.get(region).expect("mapped").clone();
        assert_eq!(
            placement.primary, self.machine.id,
            "lock recovery of {region:?} away from its primary"
        );
        let round = &self.recovery.regions[&region];
        assert!(
            round.ready && !round.done,
            "lock recovery of {region:?} before it was ready, or twice"
        );
        // §5.3 step 4 follows step 2 on every thread: no record of the old configuration is
        // still on its way into this machine's logs.
        assert!(
            self.machine.all_drained(c),
            "lock recovery of {region:?} before every thread drained"
        );
        let mem = view
            .region(region)
            .expect("primary holds its region")
            .clone();
        let listed: Vec<(TxnId, BTreeSet<MachineId>)> = self.recovery.regions[&region]
            .listed
            .iter()
            .map(|(t, b)| (*t, b.clone()))
            .collect();
        for (t, _) in &listed {
            let Some(tx) = self.recovery.txs.get_mut(t) else {
                continue;
            };
            // Where this machine was already the primary when the transaction committed, its
            // own state is authoritative: the LOCK record's locks are held (or were never
            // taken, and the transaction cannot commit), or the writes were applied. Where the
            // primary changed since, the writes come from COMMIT-BACKUP or a backup's state:
            // lock them now.
            if tx.decision.is_some() || !primary_moved_since(&view, region, *t) {
                continue;
            }
            for w in tx.writes_in(region) {
                if tx.recovery_locked.iter().any(|l| l.addr == w.addr) {
                    continue;
                }
                self.machine.recovery_lock(&mem, region, w.addr.offset);
                tx.recovery_locked.push(w);
            }
        }
        self.machine.lock_recovered(region, c, self.thread.0);
        let mut unvoted = Vec::new();
        for (t, holders) in &listed {
            if self.recovery.forgotten.contains_key(t) {
                continue;
            }
            let mut unsent = Vec::new();
            if let Some(tx) = self.recovery.txs.get(t) {
                let ws = WriteSet {
                    regions: tx.regions.clone(),
                    writes: tx.writes_in(region),
                };
                let seen = tx.seen(region);
                for b in placement.backups.iter().filter(|b| !holders.contains(b)) {
                    let msg = Message::Recovery {
                        config: c,
                        region,
                        body: RecoveryBody::ReplicateTxState(*t, ws.clone(), seen),
                    };
                    unsent.push((*b, msg));
                }
            }
            unvoted.push(PendingVote {
                txn: *t,
                unsent,
                sent: Vec::new(),
            });
        }
        self.recovery
            .regions
            .get_mut(&region)
            .expect("round")
            .unvoted = unvoted;
        for (t, holders) in &listed {
            // Recovered and forgotten here already: backups that still hold it learn the
            // outcome from this primary (its recovery coordinator may be gone).
            if let Some(d) = self.recovery.forgotten.get(t).copied() {
                for b in holders {
                    let body = decision_body(d, *t);
                    self.send_recovery(*b, c, region, body);
                    self.send_recovery(*b, c, region, RecoveryBody::TruncateRecovery(*t));
                }
            }
        }
        self.recovery.regions.get_mut(&region).expect("round").done = true;
        self.replicate_and_vote(region);
        for (t, _) in &listed {
            if self
                .recovery
                .txs
                .get(t)
                .is_some_and(|tx| tx.applied && tx.truncated)
            {
                self.forget(*t);
            }
        }
    }

    /// Step 5 then 6 for a region: places REPLICATE-TX-STATE messages as queue space allows and
    /// votes for each transaction once its replication writes have landed (or failed: a dead
    /// backup is the next configuration's business). Returns whether anything happened.
    fn replicate_and_vote(&mut self, region: RegionId) -> bool {
        let Some(round) = self.recovery.regions.get_mut(&region) else {
            return false;
        };
        let mut pending = std::mem::take(&mut round.unvoted);
        let mut busy = false;
        let mut ready = Vec::new();
        for p in &mut pending {
            let unsent = std::mem::take(&mut p.unsent);
            for (dst, msg) in unsent {
                match self.send_tracked(dst, &msg) {
                    Some(ticket) => {
                        p.sent.push((dst, ticket));
                        busy = true;
                    }
                    None => p.unsent.push((dst, msg)),
                }
            }
            if p.unsent.is_empty() && p.sent.iter().all(|(m, t)| self.write_settled(*m, *t)) {
                ready.push(p.txn);
            }
        }
        pending.retain(|p| !ready.contains(&p.txn));
        if let Some(round) = self.recovery.regions.get_mut(&region) {
            round.unvoted = pending;
        }
        for t in ready {
            self.send_vote(region, t, None);
            busy = true;
            if self
                .recovery
                .txs
                .get(&t)
                .is_some_and(|tx| tx.applied && tx.truncated)
            {
                self.forget(t);
            }
        }
        busy
    }

    /// RECOVERY-VOTE for `t` in `region` to its recovery coordinator (or to `to`, answering a
    /// REQUEST-VOTE).
    fn send_vote(&mut self, region: RegionId, t: TxnId, to: Option<MachineId>) {
        let c = self.recovery.last_drained;
        let view = self.recovery.drained_view.clone().expect("drained");
        let (regions, v) = match self.recovery.txs.get(&t) {
            Some(tx) if !tx.writes_in(region).is_empty() || tx.decision.is_some() => {
                (tx.regions.clone(), vote(tx.evidence(region)))
            }
            // No records, because this replica carried out a recovery's decision and forgot
            // the transaction: it votes what that decision left here (COMMIT-RECOVERY is a
            // commit-primary, ABORT-RECOVERY an abort). Voting "unknown" instead let another
            // recovery of the same transaction abort what the first committed: a coordinator
            // whose round outlived a membership change (consistent hashing moved the
            // transaction to a machine that joined) asked again after the new coordinator's
            // decision was applied here (simulator seed 1007 of the joins campaign).
            _ if self.recovery.forgotten.contains_key(&t) => {
                let v = match self.recovery.forgotten[&t] {
                    Decision::Commit => Vote::CommitPrimary,
                    Decision::Abort => Vote::Abort,
                };
                (Vec::new(), v)
            }
            _ => {
                // No records: truncated if this thread's truncation bound from the
                // coordinator's thread passed it. After a whole-cluster restart, also if the
                // transaction is from before it and this machine has been the region's primary
                // from the start of its commit until now (so the LOCK reached it, if it
                // reached anyone, and its logs survived): a primary frees a LOCK record only
                // once its transaction aborted, was truncated, or was decided by a recovery
                // that every replica holds the decision of (in its queue or recovery log,
                // whose evidence then decides). So a transaction that any replica holds
                // COMMIT-BACKUP of, with no decision, was truncated; one whose LOCK never
                // arrived has no COMMIT-BACKUP anywhere and aborts whatever this vote says. (A
                // primary promoted since may never have seen the LOCK: no such inference.)
                let inbound = &self.inbound[t.machine.0 as usize];
                let restarted_before = self.machine.restart_config().is_some_and(|r| t.config < r);
                let below = if restarted_before {
                    inbound.restart_truncated_below
                } else {
                    inbound.truncated_below
                };
                let primary_since_restart = self.machine.restart_config().is_some_and(|r| {
                    t.config < r
                        && view
                            .changes
                            .get(&region)
                            .is_some_and(|ch| ch.last_primary_change == r)
                        && self.machine.primary_before_restart_since(region, t)
                });
                let truncated = t.local < below
                    || (!restarted_before && inbound.truncated_ids.contains(&t.local))
                    || primary_since_restart;
                let v = if truncated {
                    Vote::Truncated
                } else {
                    Vote::Unknown
                };
                (Vec::new(), v)
            }
        };
        self.stats.recovery_votes += 1;
        let dst = to.unwrap_or_else(|| recovery_coordinator(t, &view.config));
        self.send_recovery(dst, c, region, RecoveryBody::RecoveryVote(t, regions, v));
    }

    fn on_request_vote(&mut self, from: MachineId, region: RegionId, t: TxnId) {
        // Only a round of a configuration after the one `t` started committing in may judge
        // it: in an earlier or the same one, `t` was not recovering, its records were (and
        // may still be) processed normally, and "no records here" says nothing.
        if !recovering_in(t, self.recovery.last_drained) {
            return;
        }
        // Answered once lock recovery is done and the transaction's replication landed (a
        // pending one votes by itself).
        if self
            .recovery
            .regions
            .get(&region)
            .is_some_and(|r| r.done && !r.unvoted.iter().any(|p| p.txn == t))
        {
            self.send_vote(region, t, Some(from));
        }
    }

    /// Registers this thread's own commit `t`, which wrote `regions`, as waiting for recovery.
    pub(crate) fn await_recovery(&mut self, t: TxnId, regions: Vec<RegionId>) {
        // Recovery may have finished it already, before this commit saw the new view.
        if let Some(d) = self.recovery.finished.get(&t).copied() {
            self.recovery.decided.insert(t, d);
            return;
        }
        self.recovery.waiting.insert(t);
        let now = self.now;
        self.recovery
            .coord
            .entry(t)
            .or_insert_with(|| CoordRound::new(regions, now));
    }

    fn on_vote(&mut self, region: RegionId, t: TxnId, regions: Vec<RegionId>, v: Vote) {
        if !recovering_in(t, self.recovery.last_drained) {
            return; // From a round that cannot judge `t` (see `on_request_vote`).
        }
        let view = self.recovery.drained_view.clone().expect("drained");
        let now = self.now;
        if let Some(d) = self.recovery.finished.get(&t).copied() {
            // A round repeating the decision collects votes like any other, and the decision
            // goes to the replicas of every region that votes with records (a later round's
            // new backup of a region may have received them by REPLICATE-TX-STATE).
            if let Some(round) = self.recovery.coord.get_mut(&t) {
                round.votes.insert(region, v);
                if let (false, Some(p)) = (regions.is_empty(), view.map.get(region)) {
                    round.also_send_to(p);
                }
                return;
            }
            // Only a voter with records may have replicas that still lack the decision; an
            // answer without records (truncated, unknown) is a duplicate.
            if !regions.is_empty() {
                let mut round = CoordRound::new(vec![region], now);
                round.votes.insert(region, v);
                self.recovery.coord.insert(t, round);
                self.decide_tx(t, d);
            }
            return;
        }
        if regions.is_empty() && !self.recovery.coord.contains_key(&t) {
            return; // An answer for a round that is gone.
        }
        let has_records = !regions.is_empty();
        let round = self
            .recovery
            .coord
            .entry(t)
            .or_insert_with(|| CoordRound::new(regions, now));
        if round.decision.is_some() {
            round.votes.insert(region, v);
            // Decided, and the decision still on its way: replicas the region gained since
            // (a new backup that got the records by REPLICATE-TX-STATE) need it too.
            if let (true, Some(p)) = (has_records, view.map.get(region)) {
                round.also_send_to(p);
            }
            return;
        }
        round.votes.insert(region, v);
        if let Some(d) = decide(&round.regions, &round.votes) {
            self.decide_tx(t, d);
        }
    }

    /// Step 7: the decision goes to every replica of every region the transaction wrote.
    fn decide_tx(&mut self, t: TxnId, d: Decision) {
        let view = self.recovery.drained_view.clone().expect("drained");
        let round = self.recovery.coord.get_mut(&t).expect("round");
        // §5.3 step 7: a recovering transaction is decided once; a repeated round repeats it.
        assert!(
            round.decision.is_none_or(|x| x == d),
            "{t} decided {:?}, then {d:?}",
            round.decision
        );
        assert!(
            self.recovery.finished.get(&t).is_none_or(|x| *x == d),
            "{t} finished as {:?}, now decided {d:?}",
            self.recovery.finished.get(&t)
        );
        // §5.3 step 6: a commit rests on a region's vote that a replica holds the writes
        // (COMMIT-PRIMARY, or COMMIT-BACKUP with every other region locked or truncated),
        // unless an earlier round decided it and this one repeats it.
        assert!(
            d == Decision::Abort
                || self.recovery.finished.contains_key(&t)
                || round
                    .votes
                    .values()
                    .any(|v| matches!(v, Vote::CommitPrimary | Vote::CommitBackup)),
            "{t} committed by recovery without a vote of a replica holding its writes: {:?}",
            round.votes
        );
        round.decision = Some(d);
        let mut to: BTreeSet<MachineId> = BTreeSet::new();
        for r in &round.regions {
            if let Some(p) = view.map.get(*r) {
                to.extend(p.replicas());
            }
        }
        round.to_send = to.into_iter().collect();
        if !self.recovery.finished.contains_key(&t) {
            match d {
                Decision::Commit => self.stats.recovered_commits += 1,
                Decision::Abort => self.stats.recovered_aborts += 1,
            }
        }
        tracing::debug!(txn = %t, decision = ?d, "recovery decided");
    }

    /// The coordinator side: REQUEST-VOTE after the timeout, decisions until acknowledged,
    /// then TRUNCATE-RECOVERY.
    fn coordinate(&mut self) -> bool {
        let mut busy = false;
        let now = self.now;
        let c = self.recovery.last_drained;
        let Some(view) = self.recovery.drained_view.clone() else {
            return false;
        };
        let request_vote = self.machine.params.request_vote_ticks();
        let lease = self.machine.params.lease_ticks;
        let ids: Vec<TxnId> = self.recovery.coord.keys().copied().collect();
        for t in ids {
            let round = self.recovery.coord.get_mut(&t).expect("listed");
            let region0 = round.regions.first().copied().unwrap_or(RegionId(0));
            let missing: Vec<RegionId> = round
                .regions
                .iter()
                .filter(|r| !round.votes.contains_key(r))
                .copied()
                .collect();
            // Votes still missing are asked for after the timeout, also after a decision
            // (truncation waits for every region's vote, which follows its replication), and
            // before a decision, only in a round in which the transaction is recovering (its
            // primaries drained the same configuration and judge it alike): a commit that a
            // newer configuration made recovering waits until this thread drained that one.
            // (A round that repeats a decision knows only the regions that voted in it.)
            if !missing.is_empty()
                && (round.decision.is_some() || view.is_recovering(t, &round.regions))
                && now.saturating_sub(round.since)
                    >= request_vote_wait(request_vote, lease, round.asks)
            {
                round.since = now;
                round.asks = round.asks.saturating_add(1);
                for r in &missing {
                    if let Some(p) = view.map.get(*r) {
                        let p = p.primary;
                        // A primary that has not taken the last request in gets no other.
                        if !self.queue_full(p) {
                            self.send_recovery(p, c, *r, RecoveryBody::RequestVote(t));
                            busy = true;
                        }
                    }
                }
            }
            let round = self.recovery.coord.get_mut(&t).expect("listed");
            match round.decision {
                None => {}
                Some(d) => {
                    let body = decision_body(d, t);
                    let to_send = std::mem::take(&mut round.to_send);
                    let mut left = Vec::new();
                    let mut placed = Vec::new();
                    for m in to_send {
                        // A replica of an earlier configuration's view (the decision made on
                        // a vote that this round's first poll processed, or held back by a
                        // full queue) that is not a member of `c` has left: it never installs
                        // `c`, so nothing sent under `c` is ever read there (it is refused as
                        // too far ahead, `recovery_too_far_ahead`), and no recovery of `c` or
                        // later reads its logs (a machine joins again only as a new
                        // incarnation). Its holding the decision is not waited for either.
                        if !view.config.contains(m) {
                            continue;
                        }
                        let msg = Message::Recovery {
                            config: c,
                            region: region0,
                            body: body.clone(),
                        };
                        match self.send_tracked(m, &msg) {
                            Some(ticket) => placed.push((m, ticket)),
                            None => left.push(m),
                        }
                    }
                    busy |= !placed.is_empty();
                    let round = self.recovery.coord.get_mut(&t).expect("listed");
                    round.to_send = left;
                    round.tickets.extend(placed);
                    if !round.to_send.is_empty() {
                        continue;
                    }
                    let tickets = round.tickets.clone();
                    let landed = tickets.iter().all(|(m, tk)| self.write_settled(*m, *tk));
                    if !landed {
                        continue;
                    }
                    // Every replica holds the decision, so no later recovery can decide
                    // otherwise: the application may learn it now. Replicas may forget the
                    // transaction once every region voted, that is, replicated it.
                    if self.recovery.waiting.remove(&t) {
                        self.recovery.decided.insert(t, d);
                    }
                    if !missing.is_empty() {
                        continue;
                    }
                    // Only to members of `c`, as the decision above: a replica the decision
                    // reached in an earlier configuration may have left since.
                    for (m, _) in tickets
                        .into_iter()
                        .filter(|(m, _)| view.config.contains(*m))
                    {
                        let msg = Message::Recovery {
                            config: c,
                            region: region0,
                            body: RecoveryBody::TruncateRecovery(t),
                        };
                        self.send_message(m, &msg);
                    }
                    self.recovery.coord.remove(&t);
                    self.recovery.finished.insert(t, d);
                    busy = true;
                }
            }
        }
        busy
    }

    fn on_decision(&mut self, t: TxnId, d: Decision) {
        if let Some(x) = self.recovery.forgotten.get(&t) {
            assert_eq!(*x, d, "{t} forgotten as decided {x:?}, now decided {d:?}");
            return;
        }
        let Some(tx) = self.recovery.txs.get_mut(&t) else {
            // No records here: a REPLICATE-TX-STATE of this round may still bring them.
            self.recovery.early_decisions.insert(t, (d, false));
            return;
        };
        if let Some(x) = tx.decision {
            assert_eq!(x, d, "{t} decided {x:?}, then {d:?}");
            return;
        }
        tx.decision = Some(d);
        match d {
            Decision::Commit => tx.commit_primary = true,
            Decision::Abort => tx.abort_recovery = true,
        }
        self.apply_decision(t);
    }

    fn on_replicate(&mut self, region: RegionId, t: TxnId, ws: WriteSet, seen: Seen) {
        if self.recovery.forgotten.contains_key(&t) {
            return;
        }
        self.merge_state(t, ws);
        if let Some(tx) = self.recovery.txs.get_mut(&t) {
            tx.add_seen(region, seen);
        }
        if self
            .recovery
            .txs
            .get(&t)
            .is_some_and(|tx| tx.decision.is_some())
        {
            self.apply_decision(t);
        }
    }

    /// Carries out a decision here: at a primary like COMMIT-PRIMARY or ABORT (releasing the
    /// LOCK record's locks or lock recovery's), at a backup like COMMIT-BACKUP at truncation.
    /// Writes install only over older versions, so recovered transactions on the same object
    /// may be decided in any order. A decision can arrive before this primary's lock recovery
    /// of the region: the writes then install under a momentary recovery lock.
    fn apply_decision(&mut self, t: TxnId) {
        let view = self.view.clone();
        let Some(tx) = self.recovery.txs.get_mut(&t) else {
            return;
        };
        let Some(d) = tx.decision else {
            return;
        };
        if tx.applied || (d == Decision::Commit && !tx.has_data()) {
            return; // A commit waits for REPLICATE-TX-STATE.
        }
        // §5.3 step 7: a decision is carried out once, and a commit only with its writes.
        assert!(
            d == Decision::Abort || tx.has_data(),
            "{t}: a commit applied without its writes"
        );
        tx.applied = true;
        let held = std::mem::replace(&mut tx.locks_held, false);
        assert!(
            !held || tx.lock.is_some(),
            "{t}: locks held here without a LOCK record"
        );
        let free_slots = d == Decision::Abort && !std::mem::replace(&mut tx.slots_freed, true);
        let lock_ws = tx.lock.clone();
        let recovery_locked = std::mem::take(&mut tx.recovery_locked);
        // Writes known from COMMIT-BACKUP, other replicas, or a LOCK record whose locks are
        // not held here (after a restart, before lock recovery took them over), not covered by
        // a lock here.
        let mut other: Vec<WriteEntry> = Vec::new();
        if d == Decision::Commit {
            let mut seen: BTreeSet<farm_core::Addr> =
                recovery_locked.iter().map(|w| w.addr).collect();
            let held_ws = lock_ws.iter().filter(|_| held);
            seen.extend(held_ws.flat_map(|ws| ws.writes.iter().map(|w| w.addr)));
            let unheld_ws = lock_ws.iter().filter(|_| !held);
            for w in unheld_ws
                .chain(&tx.commit_backup)
                .flat_map(|ws| &ws.writes)
                .chain(&tx.fetched)
            {
                if seen.insert(w.addr) {
                    other.push(w.clone());
                }
            }
        }
        let truncated = tx.truncated;
        if let Some(ws) = &lock_ws {
            if held {
                match d {
                    Decision::Commit => self.apply_at_primary(ws),
                    Decision::Abort => self.unlock_all(ws),
                }
            }
            // The coordinator left the transaction's fresh slots to this primary.
            if free_slots {
                self.free_fresh_slots(ws);
            }
        }
        let install = |w: &WriteEntry| {
            let new = w.read.committed_successor(w.allocated);
            let data = if w.allocated { &w.data[..] } else { &[][..] };
            (data.to_vec(), new)
        };
        for w in recovery_locked {
            let Some(mem) = view.region(w.addr.region) else {
                continue; // Moved away in a later configuration.
            };
            let (data, new) = install(&w);
            let commit = (d == Decision::Commit).then_some((&data[..], new));
            self.machine
                .recovery_unlock(mem, w.addr.region, w.addr.offset, commit);
        }
        self.install_recovered(t, other);
        if truncated {
            self.forget(t);
        }
    }

    /// Installs writes of a committed recovering transaction `t` known from COMMIT-BACKUP or
    /// other replicas: as a backup installs them, or at a primary that learnt them as a backup.
    fn install_recovered(&mut self, t: TxnId, writes: Vec<WriteEntry>) {
        let view = self.view.clone();
        let me = self.machine.id;
        for w in writes {
            let (Some(placement), Some(mem)) =
                (view.map.get(w.addr.region), view.region(w.addr.region))
            else {
                continue;
            };
            let new = w.read.committed_successor(w.allocated);
            let data = if w.allocated {
                w.data.clone()
            } else {
                Vec::new()
            };
            if placement.primary == me {
                // Where this primary had its own records, they were applied or are locked. A
                // region already active got every write it needs at lock recovery (a
                // transaction no replica listed then had been applied everywhere): its objects
                // may now be locked by new transactions and must not be touched.
                if !primary_moved_since(&view, w.addr.region, t)
                    || !self.region_blocked(w.addr.region)
                {
                    continue;
                }
                self.machine
                    .recovery_lock(mem, w.addr.region, w.addr.offset);
                self.machine
                    .recovery_unlock(mem, w.addr.region, w.addr.offset, Some((&data, new)));
            } else {
                object::install_at_backup(mem, w.addr.offset as u64, &data, new);
            }
        }
    }

    fn on_truncate_recovery(&mut self, t: TxnId) {
        let Some(tx) = self.recovery.txs.get_mut(&t) else {
            if let Some((_, truncated)) = self.recovery.early_decisions.get_mut(&t) {
                *truncated = true;
            }
            return;
        };
        tx.truncated = true;
        if tx.applied {
            self.forget(t);
        }
    }

    /// Drops a recovered transaction and frees its log records, unless lock recovery of a
    /// region here has yet to replicate it to backups that lack it and vote (steps 5-6): then
    /// that does.
    fn forget(&mut self, t: TxnId) {
        let pending = self.recovery.regions.values().any(|r| {
            r.listed.contains_key(&t) && (!r.done || r.unvoted.iter().any(|p| p.txn == t))
        });
        if pending {
            return;
        }
        let tx = self.recovery.txs.remove(&t).expect("known");
        assert!(
            tx.applied,
            "{t} forgotten before its decision was carried out"
        );
        self.recovery
            .forgotten
            .insert(t, tx.decision.expect("forgotten after a decision"));
        let log = &mut self.inbound[t.machine.0 as usize].log;
        for pos in tx.records {
            log.release(pos);
        }
        self.release_kept(t);
    }

    /// Frees what was kept of `t`'s recovery messages for a restart.
    fn release_kept(&mut self, t: TxnId) {
        for kept in self.recovery.logged.remove(&t).unwrap_or_default() {
            match kept {
                Kept::Log(pos) => self.recovery_log.release(pos),
                Kept::Queue(sender, pos) => self.inbound[sender.0 as usize].queue.release(pos),
            }
        }
    }

    /// Keeps a recovery message that a restart must still see (see [`crate::recovery_log`]),
    /// before it is processed: REPLICATE-TX-STATE, COMMIT-RECOVERY and ABORT-RECOVERY of a
    /// transaction not forgotten here. `payload` is the message as it arrived from `sender` at
    /// `pos` of its queue. Returns whether the queue slot must stay held: the recovery log was
    /// full, so the message's own slot is its record until the transaction is forgotten.
    pub(crate) fn log_recovery_message(
        &mut self,
        sender: MachineId,
        pos: RecordPos,
        msg: &Message,
        payload: &[u8],
    ) -> bool {
        let Some(t) = logged_txn(msg) else {
            return false;
        };
        if self.recovery.forgotten.contains_key(&t) {
            return false;
        }
        let kept = self.keep(sender, pos, payload);
        self.recovery.logged.entry(t).or_default().push(kept);
        matches!(kept, Kept::Queue(..))
    }

    /// Drops what recovery holds in `peer`'s rings to this thread, which start afresh (a new
    /// incarnation joined): the log records of `peer`'s earlier life's transactions still
    /// recovering here (their writes and decisions are held in memory; forgetting one then
    /// frees nothing in the new ring), and the recovery messages kept in queue slots from
    /// `peer` (kept there only because the recovery log was full). A whole-cluster restart
    /// before those transactions are forgotten no longer finds them.
    pub(crate) fn forget_rings_of(&mut self, peer: MachineId) {
        let mut records = 0;
        for (t, tx) in self.recovery.txs.iter_mut() {
            if t.machine == peer && !tx.records.is_empty() {
                records += tx.records.len();
                tx.records.clear();
            }
        }
        let mut kept = 0;
        for k in self.recovery.logged.values_mut() {
            let before = k.len();
            k.retain(|k| !matches!(k, Kept::Queue(s, _) if *s == peer));
            kept += before - k.len();
        }
        if records + kept > 0 {
            tracing::error!(
                machine = self.machine.id.0,
                thread = self.thread.0,
                peer = peer.0,
                records,
                kept,
                "a machine joined again while transactions of its earlier life were still \
                 recovering here: their records in its rings are dropped, and a whole-cluster \
                 restart before they are forgotten would not see them"
            );
        }
    }

    /// Where the recovery message at `pos` of `sender`'s queue is kept: in the recovery log if
    /// it has room, else in its queue slot.
    fn keep(&mut self, sender: MachineId, pos: RecordPos, payload: &[u8]) -> Kept {
        let was_full = self.recovery_log.is_full();
        if let Some(at) = self.recovery_log.append(payload) {
            return Kept::Log(at);
        }
        if !was_full {
            tracing::warn!(
                machine = self.machine.id.0,
                thread = self.thread.0,
                sender = sender.0,
                "the recovery log is full: recovery messages keep their queue slots until their \
                 transactions are forgotten, which holds up their senders' queues"
            );
        }
        self.stats.recovery_log_full += 1;
        Kept::Queue(sender, pos)
    }

    /// After a whole-cluster restart, before anything else: what the previous life knew from
    /// recovery messages, from the recovery log (`entries`) and from the queues' unprocessed
    /// messages (copied to the log first, then freed), as evidence only; the restart's
    /// recovery round decides (§5.3 step 6: a replica that saw COMMIT-RECOVERY votes
    /// commit-primary, one that saw ABORT-RECOVERY cannot vote commit).
    pub(crate) fn restart_read_recovery_messages(&mut self, entries: Vec<(RecordPos, Vec<u8>)>) {
        let mut buf = Vec::new();
        let mut kept: Vec<(Kept, Vec<u8>)> = entries
            .into_iter()
            .map(|(at, b)| (Kept::Log(at), b))
            .collect();
        for sender in 0..self.inbound.len() {
            let from = MachineId(sender as u16);
            while let Some(pos) = self.inbound[sender].queue.poll(&mut buf) {
                let mut held = false;
                if Message::decode(&buf).is_ok_and(|m| logged_txn(&m).is_some()) {
                    let at = self.keep(from, pos, &buf);
                    held = matches!(at, Kept::Queue(..));
                    kept.push((at, buf.clone()));
                }
                if !held {
                    self.inbound[sender].queue.release(pos);
                }
            }
        }
        for (pos, bytes) in kept {
            let msg = Message::decode(&bytes).unwrap_or_else(|e| {
                panic!("corrupt kept recovery message at {pos:?} with a valid checksum: {e}")
            });
            let t = logged_txn(&msg)
                .unwrap_or_else(|| panic!("kept recovery message at {pos:?} holds {msg:?}"));
            let Message::Recovery { region, body, .. } = msg else {
                unreachable!("logged_txn matched a recovery message");
            };
            self.recovery.logged.entry(t).or_default().push(pos);
            let tx = self.recovery.txs.entry(t).or_default();
            tx.slots_freed = true; // As for log records after a restart.
            match body {
                RecoveryBody::ReplicateTxState(_, ws, seen) => {
                    if tx.regions.is_empty() {
                        tx.regions = ws.regions.clone();
                    }
                    for w in ws.writes {
                        if !tx.fetched.iter().any(|f| f.addr == w.addr) {
                            tx.fetched.push(w);
                        }
                    }
                    tx.add_seen(region, seen);
                }
                RecoveryBody::CommitRecovery(_) => tx.commit_primary = true,
                RecoveryBody::AbortRecovery(_) => tx.abort_recovery = true,
                _ => unreachable!("matched above"),
            }
        }
    }
}

/// The transaction of a recovery message that the recovery log keeps (REPLICATE-TX-STATE,
/// COMMIT-RECOVERY, ABORT-RECOVERY; see [`crate::recovery_log`]), or `None` for any other.
fn logged_txn(msg: &Message) -> Option<TxnId> {
    match msg {
        Message::Recovery {
            body:
                RecoveryBody::ReplicateTxState(t, ..)
                | RecoveryBody::CommitRecovery(t)
                | RecoveryBody::AbortRecovery(t),
            ..
        } => Some(*t),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use farm_core::config::{Configuration, RegionMap};
    use farm_core::{MachineId, ThreadId};
    use farm_recovery::vote::Decision;

    use super::RecTx;
    use crate::{MachineState, Tx, Worker};

    fn workers() -> Vec<Worker> {
        let params = crate::test_cluster::params(100_000);
        let fabric = crate::test_cluster::fabric();
        let map = RegionMap::striped(3, 1, 1);
        (0..3)
            .map(|m| {
                let state = MachineState::new(
                    MachineId(m),
                    params,
                    Configuration::initial(3),
                    map.clone(),
                    fabric.clone(),
                    None,
                )
                .unwrap();
                Worker::new(state, ThreadId(0))
            })
            .collect()
    }

    /// Commits `f` on worker `c`, polling the others between its steps until it is decided
    /// (and no further: its records stay untruncated at the participants).
    fn commit(w: &mut [Worker], c: usize, now: &mut u64, f: impl FnOnce(&mut Tx<'_>)) {
        let mut tx = Tx::new(&mut w[c]);
        f(&mut tx);
        let state = tx.into_state();
        let handle = w[c].start_commit(state);
        loop {
            *now += 1;
            for x in w.iter_mut() {
                x.poll(*now);
            }
            if let Some(r) = w[c].poll_commit(handle, *now) {
                return r.unwrap();
            }
        }
    }

    /// A transaction of machine 2's earlier life, recovered here and applied, waits for its
    /// TRUNCATE-RECOVERY holding its records in machine 2's log to this thread; machine 2 joins
    /// again as a new incarnation first, so this thread's rings from it start afresh
    /// (`Worker::forget_peer`). The records went with the ring: forgetting the transaction
    /// then must not free them in the new ring (a machine process died of "releasing record
    /// N that is not live" in `node_rejoin.rs`).
    #[test]
    fn a_recovered_transaction_of_a_machine_that_joined_again_is_forgotten_without_its_records() {
        let mut w = workers();
        let mut now = 0;
        // Machine 2 writes an object whose primary is machine 0: machine 0 keeps the records
        // of the transaction until it is truncated.
        let mut obj = None;
        commit(&mut w, 0, &mut now, |tx| {
            let a = tx.alloc(8, None).unwrap();
            tx.write(a, &[1; 8]).unwrap();
            obj = Some(a);
        });
        let obj = obj.unwrap();
        commit(&mut w, 2, &mut now, |tx| tx.write(obj, &[2; 8]).unwrap());
        // The primary processes the COMMIT-PRIMARY, and keeps its records with the LOCK's.
        w[0].poll(now + 1);
        let (_, retained) = w[0].inbound[2]
            .retained
            .pop_first()
            .expect("machine 0 keeps machine 2's records until truncation");
        assert!(!retained.records.is_empty());
        let t = retained.txn;
        // Recovery took the transaction over, decided and applied it.
        w[0].recovery.txs.insert(
            t,
            RecTx {
                decision: Some(Decision::Commit),
                applied: true,
                records: retained.records,
                ..RecTx::default()
            },
        );
        w[0].forget_peer(MachineId(2));
        w[0].on_truncate_recovery(t);
        assert!(w[0].recovery.forgotten.contains_key(&t));
        assert!(!w[0].recovery.txs.contains_key(&t));
    }
}
