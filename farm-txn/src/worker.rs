//! A worker: one thread's share of a machine, as a deterministic state machine
//! (docs/ARCHITECTURE.md, Machines, threads, event loop).
//!
//! [`Worker::poll`] processes the inbound transaction logs and message queues of this thread (one
//! of each per peer machine), answers LOCK and VALIDATE, applies COMMIT-PRIMARY, keeps
//! COMMIT-BACKUP records until truncation and applies them then (§4), reports freed log space to
//! senders, and advances the coordinator's background work (acks of COMMIT-PRIMARY, truncation).
//! It never blocks and reads no clock.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use farm_alloc::{block_header_offset, block_of, slot_bytes_of, AllocError, Slabs};
use farm_core::fabric::{Endpoint, FabricError, MemKey, RemoteMemory, WriteStatus, WriteTicket};
use farm_core::object;
use farm_core::ring::{
    frame_with, skip_marker, HeadWord, RecordPos, RingKind, RingReader, RingWriter,
};
use farm_core::wire::{AllocOutcome, LogBody, LogRecord, Message, RecoveryBody, WriteSet};
use farm_core::{ConfigId, MachineId, RegionId, ThreadId, TxnId};

use crate::coordinator::{CoordinatorState, Replies};
use crate::machine::{MachineState, View};
use crate::stats::Stats;

/// Locks held at this primary for a transaction, from its LOCK record until COMMIT-PRIMARY or
/// ABORT.
#[derive(Debug)]
pub(crate) struct HeldLocks {
    pub(crate) txn: TxnId,
    pub(crate) record: RecordPos,
    pub(crate) writes: WriteSet,
    /// Whether every lock was taken (LOCK-REPLY ok).
    pub(crate) ok: bool,
}

/// Records of one transaction of one sender kept until truncation.
#[derive(Debug)]
pub(crate) struct Retained {
    pub(crate) txn: TxnId,
    pub(crate) records: Vec<RecordPos>,
    /// The LOCK writes of a transaction whose COMMIT-PRIMARY was applied here.
    pub(crate) primary_writes: Option<WriteSet>,
    /// COMMIT-BACKUP writes to apply at truncation (backups apply then, §4 step 5).
    pub(crate) backup_writes: Option<WriteSet>,
}

impl Retained {
    fn new(txn: TxnId) -> Self {
        Self {
            txn,
            records: Vec::new(),
            primary_writes: None,
            backup_writes: None,
        }
    }
}

/// Inbound state for one peer (sender) machine on this thread.
#[derive(Debug)]
pub(crate) struct Inbound {
    pub(crate) log: RingReader,
    pub(crate) queue: RingReader,
    /// Freed log position last reported to the sender.
    log_reported: u64,
    queue_reported: u64,
    pub(crate) locks: BTreeMap<u64, HeldLocks>,
    pub(crate) retained: BTreeMap<u64, Retained>,
    /// Truncation seen from the sender: every transaction below the bound, and these above it
    /// (§5.3 step 6: primaries without records vote truncated or unknown by it).
    pub(crate) truncated_below: u64,
    pub(crate) truncated_ids: BTreeSet<u64>,
    /// After a restart, the bound of the previous life (kept in NVRAM): it answers for
    /// transactions from before the restart, whose local counters the new life's bounds pass.
    pub(crate) restart_truncated_below: u64,
    /// Where the sender's log and queue tails were when this worker started (after a restart,
    /// past the records kept; the sender resumes there, told by the restart exchange,
    /// `farm_cm::restart`).
    started_tails: [u64; 2],
}

impl Inbound {
    /// This thread's readers of `sender`'s log and queue to it: at their head words, and after
    /// a `restart` with the complete records that follow them.
    fn open(machine: &MachineState, thread: ThreadId, sender: MachineId, restart: bool) -> Self {
        let layout = machine.params.layout;
        // Every reader keeps its head in NVRAM; after a restart it resumes there, with
        // what it had not freed: log records (§5.3 recovers their transactions) and
        // messages (recovery messages among them still count,
        // `restart_read_recovery_messages`; the rest belong to threads that are gone).
        let ring = |kind| {
            let head = HeadWord {
                mem: machine.heads.clone(),
                offset: layout.feedback_offset(sender, thread, kind),
            };
            let (mem, base, bytes) = (
                machine.rings.clone(),
                layout.ring_offset(sender, thread, kind),
                layout.ring_bytes(kind),
            );
            let (reader, tail) = if restart {
                RingReader::resume(mem, base, bytes, head)
            } else {
                (RingReader::new(mem, base, bytes).with_head_word(head), 0)
            };
            // A queue slot held for a recovery message (`recovery::Kept::Queue`) is freed
            // only when its transaction is forgotten: the messages after it are released out
            // of order, and a restart must not read them again as unprocessed.
            match kind {
                RingKind::Queue => (reader.mark_released(), tail),
                RingKind::Log => (reader, tail),
            }
        };
        let (log, log_tail) = ring(RingKind::Log);
        let (queue, queue_tail) = ring(RingKind::Queue);
        Inbound {
            log_reported: log.freed(),
            queue_reported: queue.freed(),
            log,
            queue,
            locks: BTreeMap::new(),
            retained: BTreeMap::new(),
            truncated_below: 0,
            truncated_ids: BTreeSet::new(),
            restart_truncated_below: if restart {
                machine.truncation.load_u64(
                    machine.truncation_offset(sender, thread.0),
                    Ordering::Acquire,
                )
            } else {
                0
            },
            started_tails: [log_tail, queue_tail],
        }
    }
}

/// What a thread holds in one peer's rings ([`Worker::rings_held`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingsHeld {
    /// The peer.
    pub peer: MachineId,
    /// Bytes of log records in the peer's log not yet truncated, or reserved.
    pub log_bytes: u64,
    /// Bytes of messages in the peer's queue not yet processed, or reserved.
    pub queue_bytes: u64,
    /// Messages waiting here for queue room at the peer.
    pub backlogged: u64,
}

/// Outbound state for one peer (receiver) machine on this thread.
#[derive(Debug)]
pub(crate) struct Outbound {
    pub(crate) log: RingWriter,
    pub(crate) queue: RingWriter,
    /// Messages to this peer waiting in [`Worker`]'s backlog for queue space there.
    backlogged: usize,
    /// The peer let [`BACKLOG_PER_PEER_MAX`] messages pile up without freeing queue space: the
    /// link is down, as a broken connection, until the peer leaves the configuration (and
    /// joins again as a new incarnation, which starts this afresh).
    cut: bool,
}

impl Outbound {
    fn new(layout: farm_core::ring::RingLayout) -> Self {
        Self {
            log: RingWriter::new(layout.log_bytes),
            queue: RingWriter::new(layout.queue_bytes),
            backlogged: 0,
            cut: false,
        }
    }
}

/// One worker thread of one machine.
#[derive(Debug)]
pub struct Worker {
    pub(crate) machine: Arc<MachineState>,
    /// This worker's copy of the machine's view, refreshed when a new one is installed.
    pub(crate) view: Arc<View>,
    pub(crate) view_generation: u64,
    /// Per machine, the generation of its joining (`MachineState::joined_at`) this worker
    /// started afresh with last.
    started: Vec<u64>,
    pub(crate) thread: ThreadId,
    pub(crate) inbound: Vec<Inbound>,
    pub(crate) outbound: Vec<Outbound>,
    /// One-sided read handles to the primary of each region, resolved on first use (§3: threads
    /// cache region mappings with their RDMA references).
    remotes: Vec<Option<Arc<dyn RemoteMemory>>>,
    /// Slabs of the regions this machine is primary for, owned by this thread (§5.5).
    pub(crate) slabs: BTreeMap<RegionId, Slabs>,
    pub(crate) coord: CoordinatorState,
    /// Replies for this thread's coordinator.
    pub(crate) replies: Replies,
    pub(crate) stats: Stats,
    pub(crate) buf: Vec<u8>,
    pub(crate) scratch: Vec<u8>,
    pub(crate) framed: Vec<u8>,
    /// Messages waiting for queue space, in order.
    backlog: std::collections::VecDeque<(MachineId, Vec<u8>)>,
    /// ALLOC-REPLYs waiting for their block header to reach the backups.
    alloc_replies: Vec<PendingAllocReply>,
    /// The buffer outgoing messages are encoded and framed in.
    msg_framed: Vec<u8>,
    /// Transaction state recovery (§5.3) of the transactions this thread coordinates.
    pub(crate) recovery: crate::recovery::RecoveryState,
    /// Recovery messages a whole-cluster restart must still see ([`crate::recovery_log`]).
    pub(crate) recovery_log: crate::recovery_log::RecoveryLog,
    /// Regions blocked in this view that were found active at their primary.
    active: BTreeSet<RegionId>,
    /// The tick of the last poll.
    pub(crate) now: u64,
    /// Data recovery copies and allocator recovery scans (run by thread 0 of each machine).
    background: Background,
    /// Whether every poll ends with [`Worker::invariants`] (debug builds, the simulator).
    check_invariants: bool,
}

/// Data and allocator recovery in progress at this machine (§5.4-5.5).
#[derive(Debug, Default)]
struct Background {
    copies: Vec<farm_recovery::RegionCopy>,
    scans: Vec<farm_recovery::AllocatorScan>,
    /// The ALL-REGIONS-ACTIVE configuration and view generation last looked at for new work
    /// (so that a poll with nothing to recover costs two loads).
    checked: (ConfigId, u64),
}

/// Slots an allocator recovery step looks at.
const SCAN_SLOTS_PER_STEP: usize = 4096;
/// Free slots a thread takes at once from those the machine's other threads or allocator
/// recovery left (`Worker::refill_slabs`).
const SHARED_SLOTS_BATCH: usize = 1024;

/// The ticket of a write that failed when it was posted (its target unreachable): it never
/// lands ([`Worker::write_settled`] says when that no longer matters). Fabrics number their
/// tickets from 1 up and never reach it.
pub(crate) const LOST: WriteTicket = WriteTicket(u64::MAX);

/// An ALLOC-REPLY (to the machine named first) held until its block-header writes are acked.
type PendingAllocReply = (MachineId, Message, Vec<(MachineId, WriteTicket)>);

/// Most messages waiting for queue space at one peer thread, beyond what its queue holds. A
/// live peer needs few: one reply per LOCK or VALIDATE it has in flight, and the recovery
/// messages of the transactions in flight at a failure. A peer that lets more pile up does
/// not drain its queue (stopped, or a bug), and the link to it is cut
/// ([`Worker::send_message`]) rather than letting the backlog grow without bound.
const BACKLOG_PER_PEER_MAX: usize = 4096;

impl Worker {
    /// Worker `thread` of `machine`.
    pub fn new(machine: Arc<MachineState>, thread: ThreadId) -> Self {
        let layout = machine.params.layout;
        assert!(
            thread.0 < layout.threads,
            "thread {thread:?} beyond the layout"
        );
        let peers = layout.machines_max;
        let restart = machine.restart_config();
        let inbound = (0..peers)
            .map(|s| Inbound::open(&machine, thread, MachineId(s), restart.is_some()))
            .collect();
        let outbound = (0..peers).map(|_| Outbound::new(layout)).collect();
        let view_generation = machine.view_generation();
        let view = machine.view();
        let view_config = view.config.id;
        let started = (0..peers)
            .map(|m| machine.joined_at(MachineId(m)))
            .collect();
        let slabs = view
            .map
            .primary_of(machine.id)
            .filter(|r| view.pool(*r).is_some())
            .map(|r| (r, Slabs::new(r)))
            .collect();
        let mut coord = CoordinatorState::new(peers as usize);
        let (recovery_log, logged) = crate::recovery_log::RecoveryLog::open(&machine, thread.0);
        if restart.is_some() {
            // Transactions of this life must not share local counters with the records of the
            // previous one that recovery still holds (truncation bounds compare them): a life
            // that starts in configuration c counts from c << 40.
            coord.next_local = view_config.0 << 40;
        }
        let mut worker = Self {
            machine,
            view,
            view_generation,
            started,
            thread,
            inbound,
            outbound,
            remotes: Vec::new(),
            check_invariants: cfg!(debug_assertions),
            slabs,
            coord,
            replies: Replies::default(),
            stats: Stats::default(),
            buf: Vec::new(),
            scratch: Vec::new(),
            framed: Vec::new(),
            backlog: std::collections::VecDeque::new(),
            alloc_replies: Vec::new(),
            msg_framed: Vec::new(),
            // After a restart, the restart configuration is still to be drained (§5.3 step 2).
            recovery: crate::recovery::RecoveryState::new(match restart {
                Some(c) if c == view_config => ConfigId(c.0 - 1),
                _ => view_config,
            }),

            recovery_log,
            active: BTreeSet::new(),
            now: 0,
            background: Background::default(),
        };
        if restart.is_some() {
            worker.restart_read_recovery_messages(logged);
        }
        worker.machine.note_refreshed(thread, view_generation);
        worker
    }

    /// Where the sender's log and queue to this worker stood when it started: `(head, tail)` of
    /// each. The sender may be elsewhere: this travels to it in a message of the restart
    /// exchange (`farm_cm::restart`), and it calls [`Worker::resume_outbound`].
    pub fn inbound_start(&self, sender: MachineId) -> [(u64, u64); 2] {
        let i = &self.inbound[sender.0 as usize];
        [
            (i.log.freed(), i.started_tails[0]),
            (i.queue.freed(), i.started_tails[1]),
        ]
    }

    /// Continues this worker's log and queue to `receiver` from `start`, what the receiver's
    /// worker of this thread found at its restart ([`Worker::inbound_start`]).
    pub fn resume_outbound(&mut self, receiver: MachineId, start: [(u64, u64); 2]) {
        let layout = self.machine.params.layout;
        let out = &mut self.outbound[receiver.0 as usize];
        assert!(
            out.log.tail() == 0 && out.queue.tail() == 0,
            "resuming a ring already written"
        );
        out.log = RingWriter::resume(layout.log_bytes, start[0].0, start[0].1);
        out.queue = RingWriter::resume(layout.queue_bytes, start[1].0, start[1].1);
    }

    /// This worker's machine.
    pub fn machine(&self) -> &Arc<MachineState> {
        &self.machine
    }

    /// This worker's thread index.
    pub fn thread(&self) -> ThreadId {
        self.thread
    }

    /// Recovery messages kept until this thread drains their configuration.
    pub fn recovery_messages_early(&self) -> usize {
        self.recovery.early_len()
    }

    /// Counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// What this thread holds in each peer's rings: bytes of its log records not yet
    /// truncated there and of its messages not yet processed (reserved room included), and
    /// messages waiting here for queue room there. Peers with nothing held are left out.
    pub fn rings_held(&self) -> Vec<RingsHeld> {
        (self.outbound.iter().enumerate())
            .map(|(m, o)| RingsHeld {
                peer: MachineId(m as u16),
                log_bytes: o.log.in_use() as u64,
                queue_bytes: o.queue.in_use() as u64,
                backlogged: o.backlogged as u64,
            })
            .filter(|r| r.log_bytes + r.queue_bytes + r.backlogged > 0)
            .collect()
    }

    pub(crate) fn endpoint(&self) -> Endpoint {
        Endpoint {
            machine: self.machine.id,
            thread: self.thread,
        }
    }

    /// The read handle for the primary of `region` (never called for local primaries).
    pub(crate) fn remote(
        &mut self,
        region: RegionId,
    ) -> Result<Arc<dyn RemoteMemory>, FabricError> {
        let idx = region.0 as usize;
        if let Some(Some(r)) = self.remotes.get(idx) {
            return Ok(r.clone());
        }
        let primary = self
            .view
            .map
            .get(region)
            .expect("caller checked the region exists")
            .primary;
        let r = self
            .machine
            .fabric
            .remote(self.machine.id, primary, MemKey::Region(region))?;
        if self.remotes.len() <= idx {
            self.remotes.resize(idx + 1, None);
        }
        self.remotes[idx] = Some(r.clone());
        Ok(r)
    }

    /// The cached read handle of `region`'s primary; [`Worker::remote`] must have resolved it.
    pub(crate) fn cached_remote(&self, region: RegionId) -> &(dyn RemoteMemory + 'static) {
        self.remotes[region.0 as usize]
            .as_deref()
            .expect("resolved by remote()")
    }

    /// Picks up a newly installed view (NEW-CONFIG): read handles to primaries are resolved
    /// again, and slabs follow the regions this machine allocates in. Returns whether it changed.
    pub fn refresh_view(&mut self) -> bool {
        let generation = self.machine.view_generation();
        if generation == self.view_generation {
            return false;
        }
        self.view = self.machine.view();
        self.view_generation = generation;
        self.remotes.clear();
        self.active.clear();
        self.unacked_now_recovering();
        let me = self.machine.id;
        let view = self.view.clone();
        // Machines that joined since this worker last started afresh with them (by the
        // machine's count, not this worker's previous view: a worker held by a closure may
        // have missed the view that removed one and see it again, a new incarnation).
        let joined: Vec<MachineId> = view
            .config
            .members
            .iter()
            .copied()
            .filter(|m| *m != me && self.machine.joined_at(*m) > self.started[m.0 as usize])
            .collect();
        for m in joined {
            self.started[m.0 as usize] = self.machine.joined_at(m);
            self.forget_peer(m);
        }
        // Acknowledged only now (see `MachineState::workers_ready`): a joined machine writes
        // here once the configuration commits, after every member acknowledged it.
        self.machine.note_refreshed(self.thread, generation);
        self.slabs.retain(|r, _| {
            view.pool(*r).is_some() && view.map.get(*r).is_some_and(|p| p.primary == me)
        });
        for r in view.map.primary_of(me).filter(|r| view.pool(*r).is_some()) {
            // Slots the machine holds free (frees queued while no thread had slabs of the
            // region, allocator recovery's) stay shared: each thread takes a batch of a size
            // when it runs out (`Worker::refill_slabs`), not all of them at once here.
            self.slabs.entry(r).or_insert_with(|| Slabs::new(r));
        }
        true
    }

    /// Starts afresh with `peer`, which joined the configuration: a new incarnation of a
    /// machine, with empty NVRAM, whose earlier life (if it had one) was removed and recovered
    /// (§5.2-5.3). This thread's rings from it are zeroed and read from the start, its rings to
    /// it written from the start, and whatever this thread still held of the earlier life
    /// (records, locks, truncation and drain marks, messages waiting) is dropped. The peer
    /// writes here only once the configuration commits, after this thread got here.
    pub(crate) fn forget_peer(&mut self, peer: MachineId) {
        let machine = self.machine.clone();
        let layout = machine.params.layout;
        for kind in [RingKind::Log, RingKind::Queue] {
            machine.rings.zero(
                layout.ring_offset(peer, self.thread, kind),
                layout.ring_bytes(kind),
            );
            let slot = layout.feedback_offset(peer, self.thread, kind);
            machine.heads.store_u64(slot, 0, Ordering::Release);
            machine.feedback.store_u64(slot, 0, Ordering::Release);
        }
        machine.forget_marks(peer, self.thread.0);
        self.forget_rings_of(peer);
        self.inbound[peer.0 as usize] = Inbound::open(&machine, self.thread, peer, false);
        self.outbound[peer.0 as usize] = Outbound::new(layout);
        self.backlog.retain(|(m, _)| *m != peer);
        self.alloc_replies.retain(|(m, ..)| *m != peer);
        self.replies.forget(peer);
    }

    /// Data recovery (§5.4) and allocator recovery (§5.5), after ALL-REGIONS-ACTIVE: thread 0
    /// copies regions this machine is a new backup of, paced, from their primaries with
    /// one-sided reads, and rebuilds the free lists of regions it was promoted to primary of.
    fn background_recovery(&mut self) -> bool {
        let all_active = self.machine.all_active_config();
        let fresh = self.background.checked != (all_active, self.view_generation);
        if !fresh && self.background.copies.is_empty() && self.background.scans.is_empty() {
            return false;
        }
        self.background.checked = (all_active, self.view_generation);
        let view = self.view.clone();
        if self.thread.0 != 0 || all_active < view.config.id {
            return false;
        }
        let me = self.machine.id;
        // No earlier than ALL-REGIONS-ACTIVE was taken up: this poll's time may predate it
        // (a threaded runtime reads the clock once per round), and recovery's timeline
        // events follow it.
        let now = self.now.max(self.machine.all_active_at());
        let interval = self.machine.params.recovery_interval_ticks;
        let region_bytes = self.machine.params.region_bytes;
        for (region, aggressive) in self.machine.regions_to_copy() {
            let backup_here = view
                .map
                .get(region)
                .is_some_and(|p| p.backups.contains(&me));
            if !backup_here {
                self.machine.copy_done(region); // Not (or no longer) a backup of it.
                continue;
            }
            if self.background.copies.iter().all(|c| c.region() != region) {
                // A region down to one replica with its data is copied without pauses (§5.4).
                let params = if aggressive {
                    farm_recovery::CopyParams::aggressive()
                } else {
                    farm_recovery::CopyParams::paced(interval)
                };
                let copy = farm_recovery::RegionCopy::new(region, region_bytes, params, now);
                self.background.copies.push(copy);
                self.machine
                    .record(crate::machine::RecoveryEvent::DataRecoveryStarted {
                        region,
                        aggressive,
                        at: now,
                    });
            }
        }
        for region in view.map.primary_of(me) {
            let promoted = view.pool(region).is_none();
            if promoted && self.background.scans.iter().all(|s| s.region() != region) {
                let scan = farm_recovery::AllocatorScan::new(
                    region,
                    region_bytes,
                    SCAN_SLOTS_PER_STEP,
                    interval,
                    now,
                );
                self.background.scans.push(scan);
            }
        }
        let mut busy = false;
        let copies = std::mem::take(&mut self.background.copies);
        for mut copy in copies {
            let region = copy.region();
            let (Some(local), Some(p)) = (view.region(region).cloned(), view.map.get(region))
            else {
                continue; // No longer held here.
            };
            if !p.backups.contains(&me) {
                continue;
            }
            let read_before = copy.bytes_read();
            let progress = self
                .remote(region)
                .and_then(|primary| copy.poll(now, &*primary, &local));
            self.stats.recovery_bytes_read += copy.bytes_read() - read_before;
            match progress {
                Ok(farm_recovery::Progress::Done) => {
                    self.machine.copy_done(region);
                    self.machine
                        .record(crate::machine::RecoveryEvent::DataRecoveryDone {
                            region,
                            objects: copy.installed(),
                            at: now,
                        });
                    busy = true;
                }
                Ok(farm_recovery::Progress::Waiting) => self.background.copies.push(copy),
                Ok(_) => {
                    busy = true;
                    self.background.copies.push(copy);
                }
                // The primary is gone: the next configuration restarts the copy.
                Err(_) => {}
            }
        }
        let scans = std::mem::take(&mut self.background.scans);
        for mut scan in scans {
            let region = scan.region();
            let Some(mem) = view.region(region).cloned() else {
                continue;
            };
            match scan.poll(now, &mem) {
                farm_recovery::ScanProgress::Done => {
                    for (offset, slot) in self.machine.take_queued_frees(region) {
                        scan.queue_free(offset, slot);
                    }
                    let (pool, mut slabs) = scan.finish();
                    self.machine.install_pool(region, pool);
                    self.refresh_view();
                    // The free slots the scan found are every thread's to hand out
                    // (`Worker::refill_slabs`), not only this one's: otherwise each other
                    // thread carves a fresh block after every change of primary, and a region
                    // runs out of blocks with most of its slots free.
                    for (offset, slot) in slabs.take_free() {
                        self.machine
                            .queue_free(farm_core::Addr::new(region, offset), slot);
                    }
                    self.slabs.insert(region, slabs);
                    self.machine
                        .record(crate::machine::RecoveryEvent::AllocatorRecovered {
                            region,
                            at: now,
                        });
                    busy = true;
                }
                farm_recovery::ScanProgress::Waiting => self.background.scans.push(scan),
                _ => {
                    busy = true;
                    self.background.scans.push(scan);
                }
            }
        }
        busy
    }

    /// Checks this worker's state against the invariants it must keep between polls
    /// (docs/ARCHITECTURE.md, Invariants), panicking with the one broken. Cheap: it looks at
    /// bounded sets, never at memory. The simulator runs it after every poll, and debug builds
    /// of the runtime after every poll of a host.
    pub fn invariants(&self) {
        let layout = self.machine.params.layout;
        let peers = layout.machines_max as usize;
        assert_eq!(self.inbound.len(), peers, "one inbound pair per peer");
        assert_eq!(self.outbound.len(), peers, "one outbound pair per peer");
        assert!(
            self.thread.0 < layout.threads,
            "{:?} beyond the layout",
            self.thread
        );
        let mut waiting_for = vec![0usize; peers];
        for (d, _) in &self.backlog {
            waiting_for[d.0 as usize] += 1;
        }
        for (m, (out, &waiting)) in self.outbound.iter().zip(&waiting_for).enumerate() {
            assert_eq!(out.backlogged, waiting, "backlog count of m{m}");
            // Messages to this machine itself wait only until its next poll frees its queue.
            assert!(
                m == self.machine.id.0 as usize || waiting <= BACKLOG_PER_PEER_MAX,
                "backlog of {waiting} to m{m} over BACKLOG_PER_PEER_MAX"
            );
            assert!(
                !out.cut || waiting == 0,
                "messages waiting for m{m}, cut off"
            );
        }
        assert!(
            self.view_generation <= self.machine.view_generation(),
            "a worker's view newer than its machine's"
        );
        // Invariant 1 (handlers never block): waiting is state, and a worker polls only what
        // its view lets it (§5.2 precise membership): it drained no configuration it lacks.
        assert!(
            self.recovery.last_drained <= self.view.config.id,
            "drained configuration {} beyond the view's {}",
            self.recovery.last_drained.0,
            self.view.config.id.0
        );
        for r in self.slabs.keys() {
            assert!(
                self.view
                    .map
                    .get(*r)
                    .is_some_and(|p| p.primary == self.machine.id),
                "slabs of {r:?}, which this machine is not primary of"
            );
        }
        self.coordinator_invariants();
        self.recovery.invariants(self.machine.id, self.thread);
    }

    /// The configuration this worker is in.
    pub fn view(&self) -> &Arc<View> {
        &self.view
    }

    /// Runs every handler that has work: inbound logs and queues of every peer, then the
    /// coordinator's background work. Returns whether anything happened (for backoff).
    pub fn poll(&mut self, now: u64) -> bool {
        self.now = now;
        let mut busy = self.refresh_view();
        busy |= self.recovery_poll();
        if self.thread.0 == 0 {
            busy |= self.background_recovery();
        }
        busy |= self.flush_backlog();
        if !self.alloc_replies.is_empty() {
            busy |= self.flush_alloc_replies();
        }
        // After a whole-cluster restart, the logs hold the previous life's records, which only
        // the first drain may take (to recovery); until it ran, logs wait.
        let restart_drain_pending = self
            .machine
            .restart_config()
            .is_some_and(|r| self.recovery.last_drained < r);
        for peer in 0..self.inbound.len() {
            let peer = MachineId(peer as u16);
            // Precise membership (§5.2): records and messages from machines outside the
            // configuration are not even looked at.
            if !self.view.config.contains(peer) {
                continue;
            }
            if !restart_drain_pending {
                busy |= self.poll_log(peer);
            }
            busy |= self.poll_queue(peer);
        }
        busy |= self.coordinator_background(now);
        // One atomic load in the normal case; during recovery, each idle thread reports until
        // the machine is settled.
        let config = self.view.config.id;
        if self.machine.settled_config() < config
            && self.recovery.last_drained == config
            && self.recovery_idle()
            && self.view.config.contains(self.machine.id)
        {
            self.machine.thread_settled(config, self.thread.0);
        }
        if self.check_invariants {
            self.invariants();
        }
        busy
    }

    /// Whether every poll ends with [`Worker::invariants`] (on in debug builds; the simulator
    /// turns it on in every build).
    pub fn set_check_invariants(&mut self, on: bool) {
        self.check_invariants = on;
    }

    pub(crate) fn poll_log(&mut self, sender: MachineId) -> bool {
        let mut busy = false;
        let mut buf = std::mem::take(&mut self.buf);
        while let Some(pos) = self.inbound[sender.0 as usize].log.poll(&mut buf) {
            busy = true;
            match LogRecord::decode(&buf) {
                Ok(rec) => self.on_log_record(sender, pos, rec),
                Err(e) => {
                    self.malformed(sender, RingKind::Log, pos, &e);
                    self.inbound[sender.0 as usize].log.release(pos);
                }
            }
        }
        self.buf = buf;
        if busy {
            self.report_freed(sender, RingKind::Log, false);
        }
        busy
    }

    /// A record or message from `sender` whose checksum held but which does not decode, or
    /// which the protocol cannot have sent in this state (a peer of another build, or a peer's
    /// bug): logged, counted, and skipped by the caller, nothing applied. A worker panics only
    /// for what means its own memory is corrupt.
    pub(crate) fn malformed(
        &mut self,
        sender: MachineId,
        kind: RingKind,
        pos: farm_core::ring::RecordPos,
        why: &dyn std::fmt::Display,
    ) {
        self.stats.malformed += 1;
        tracing::error!(
            machine = self.machine.id.0,
            thread = self.thread.0,
            sender = sender.0,
            ?kind,
            at = pos.0,
            %why,
            "a record from another machine that cannot be applied: skipped"
        );
    }

    pub(crate) fn poll_queue(&mut self, sender: MachineId) -> bool {
        let mut busy = false;
        let mut buf = std::mem::take(&mut self.buf);
        // Of a machine outside the configuration (read only when recovery drains), only
        // recovery decisions count.
        let member = self.view.config.contains(sender);
        while let Some(pos) = self.inbound[sender.0 as usize].queue.poll(&mut buf) {
            busy = true;
            let msg = Message::decode(&buf);
            if !member && !matches!(msg, Ok(Message::Recovery { .. })) {
                self.inbound[sender.0 as usize].queue.release(pos);
                continue;
            }
            if let Ok(Message::Recovery { config, .. }) = &msg {
                if self.recovery_too_far_ahead(sender, *config) {
                    self.inbound[sender.0 as usize].queue.release(pos);
                    continue;
                }
            }
            if let Ok(Message::Recovery {
                body: RecoveryBody::SendTxState(t, ws, _) | RecoveryBody::ReplicateTxState(t, ws, _),
                ..
            }) = &msg
            {
                if let Some(why) = self.unsendable_writes(ws) {
                    self.inbound[sender.0 as usize].queue.release(pos);
                    self.malformed(sender, RingKind::Queue, pos, &format!("{why} ({t})"));
                    continue;
                }
            }
            let held = match &msg {
                Ok(m) => self.log_recovery_message(sender, pos, m, &buf),
                Err(_) => false,
            };
            if !held {
                self.inbound[sender.0 as usize].queue.release(pos);
            }
            match msg {
                Ok(Message::Validate { txn, reads }) => {
                    let ok = reads.iter().all(|(addr, seen)| {
                        self.view.region(addr.region).is_some_and(|mem| {
                            object::read_header(&**mem, addr.offset as u64).ok() == Some(*seen)
                        })
                    });
                    self.send_message(sender, &Message::ValidateReply { txn, ok });
                }
                Ok(Message::Alloc {
                    request,
                    region,
                    len,
                    count,
                }) => self.on_alloc(sender, request, region, len, count),
                Ok(Message::Release {
                    addr,
                    slot_bytes,
                    config,
                }) => {
                    let me = self.machine.id;
                    // Handed out by an earlier primary: this one's allocator recovery counted
                    // the slot free already (freeing it again would hand it out twice).
                    if crate::coordinator::primary_changed_since(&self.view, addr.region, config) {
                        continue;
                    }
                    if let Some(why) = self.unreleasable(addr, slot_bytes) {
                        self.malformed(sender, RingKind::Queue, pos, &why);
                        continue;
                    }
                    match self.slabs.get_mut(&addr.region) {
                        Some(slabs) => slabs.free(addr.offset, slot_bytes),
                        // A promoted primary's scan will find it (§5.5); elsewhere the slot
                        // belongs to a primary that left, whose successor scans.
                        None if self
                            .view
                            .map
                            .get(addr.region)
                            .is_some_and(|p| p.primary == me) =>
                        {
                            self.machine.queue_free(addr, slot_bytes)
                        }
                        None => {}
                    }
                }
                Ok(Message::Recovery {
                    config,
                    region,
                    body,
                }) => self.on_recovery_message(sender, config, region, body),
                Ok(reply) => self.replies.push(sender, reply),
                // Released above.
                Err(e) => self.malformed(sender, RingKind::Queue, pos, &e),
            }
        }
        self.buf = buf;
        if busy {
            self.report_freed(sender, RingKind::Queue, false);
        }
        busy
    }

    /// ALLOC of `count` slots at the primary (§5.5: free lists live only here), answered by
    /// one ALLOC-REPLY. A slot from a fresh block is answered only once the block header has
    /// reached every backup: the coordinator's COMMIT-BACKUP travels on another link, so link
    /// order does not cover it.
    fn on_alloc(
        &mut self,
        sender: MachineId,
        request: u64,
        region: RegionId,
        len: u32,
        count: u32,
    ) {
        if self.view.pool(region).is_none() {
            let reply = Message::AllocReply {
                request,
                outcomes: vec![AllocOutcome::NotPrimary; count as usize],
            };
            return self.send_message(sender, &reply);
        }
        let mem = self
            .view
            .region(region)
            .expect("primary holds its region")
            .clone();
        let mut outcomes = Vec::with_capacity(count as usize);
        let mut tickets = Vec::new();
        while outcomes.len() < count as usize {
            self.refill_slabs(region, len as usize);
            let pool = self
                .view
                .pool(region)
                .expect("the primary, as checked above");
            let result = self
                .slabs
                .get_mut(&region)
                .expect("primary has slabs")
                .alloc(pool, len as usize);
            let a = match result {
                Ok(a) => a,
                Err(e) => {
                    // Every slot left would fail alike.
                    let outcome = match e {
                        AllocError::TooLarge(_) => AllocOutcome::TooLarge,
                        AllocError::RegionFull(_) => AllocOutcome::RegionFull,
                    };
                    outcomes.resize(count as usize, outcome);
                    break;
                }
            };
            match self.publish_block(region, &a) {
                Ok(published) => {
                    self.stats.allocs += 1;
                    tickets.extend(published);
                    let header = object::read_header(&*mem, a.offset as u64).expect("local read");
                    outcomes.push(AllocOutcome::Slot {
                        offset: a.offset,
                        slot_bytes: a.slot_bytes,
                        header,
                    });
                }
                // A backup is unreachable: recovery's business; the slot goes back.
                Err(_) => {
                    self.slabs
                        .get_mut(&region)
                        .expect("primary")
                        .free(a.offset, a.slot_bytes);
                    outcomes.resize(count as usize, AllocOutcome::RegionFull);
                }
            }
        }
        let reply = Message::AllocReply { request, outcomes };
        if tickets.is_empty() {
            self.send_message(sender, &reply);
        } else {
            self.alloc_replies.push((sender, reply, tickets));
        }
    }

    /// Sends the ALLOC-REPLYs whose block headers have landed at every backup.
    fn flush_alloc_replies(&mut self) -> bool {
        let mut ready = Vec::new();
        let mut i = 0;
        while i < self.alloc_replies.len() {
            let done = self.alloc_replies[i]
                .2
                .iter()
                .all(|(b, t)| self.write_settled(*b, Some(*t)));
            if done {
                let (dst, reply, _) = self.alloc_replies.swap_remove(i);
                ready.push((dst, reply));
            } else {
                i += 1;
            }
        }
        let busy = !ready.is_empty();
        for (dst, reply) in ready {
            self.send_message(dst, &reply);
        }
        busy
    }

    pub(crate) fn on_log_record(&mut self, sender: MachineId, pos: RecordPos, rec: LogRecord) {
        self.truncate_from(sender, rec.truncate_below, &rec.truncated);
        // §5.3 step 2: once the logs are drained, records of recovering transactions are
        // rejected; recovery decides them.
        if !matches!(rec.body, LogBody::Truncate | LogBody::Abort) && self.reject_after_drain(&rec)
        {
            self.inbound[sender.0 as usize].log.release(pos);
            if let LogBody::Lock(ws) = &rec.body {
                // Recovery aborts the transaction and never saw this LOCK: slots it allocated
                // here go back to the free lists, as its coordinator leaves them to recovery.
                self.free_fresh_slots(ws);
            }
            return;
        }
        let local = rec.txn.local;
        let why = match &rec.body {
            LogBody::Lock(ws) | LogBody::CommitBackup(ws) => self.unsendable_writes(ws),
            _ => None,
        };
        let why = why.or_else(|| {
            let twice = matches!(rec.body, LogBody::Lock(_))
                && self.inbound[sender.0 as usize].locks.contains_key(&local);
            twice.then(|| "a second LOCK under one transaction's id".to_string())
        });
        if let Some(why) = why {
            self.inbound[sender.0 as usize].log.release(pos);
            let why = format!("{why} ({})", rec.txn);
            return self.malformed(sender, RingKind::Log, pos, &why);
        }
        match rec.body {
            LogBody::Lock(writes) => {
                let ok = self.lock_all(&writes);
                self.stats.locks_processed += 1;
                let inbound = &mut self.inbound[sender.0 as usize];
                let prev = inbound.locks.insert(
                    local,
                    HeldLocks {
                        txn: rec.txn,
                        record: pos,
                        writes,
                        ok,
                    },
                );
                debug_assert!(prev.is_none(), "checked above");
                if sender == self.machine.id {
                    // The coordinator is this very worker: no message, a direct reply.
                    (self.replies).push(sender, Message::LockReply { txn: rec.txn, ok });
                } else {
                    self.send_message(sender, &Message::LockReply { txn: rec.txn, ok });
                }
            }
            LogBody::CommitBackup(writes) => {
                let r = self.inbound[sender.0 as usize]
                    .retained
                    .entry(local)
                    .or_insert_with(|| Retained::new(rec.txn));
                r.records.push(pos);
                r.backup_writes = Some(writes);
                if self.machine.params.replication == crate::machine::Replication::Rpc {
                    let ack = Message::BackupAck { txn: rec.txn };
                    self.stats.backup_acks += 1;
                    if sender == self.machine.id {
                        self.replies.push(sender, ack);
                    } else {
                        self.send_message(sender, &ack);
                    }
                }
            }
            LogBody::CommitPrimary => {
                let inbound = &mut self.inbound[sender.0 as usize];
                let held = match inbound.locks.remove(&local) {
                    Some(held) if held.ok => held,
                    // A coordinator sends COMMIT-PRIMARY only after every LOCK succeeded.
                    other => {
                        let why = match &other {
                            Some(_) => "COMMIT-PRIMARY whose locking failed",
                            None => "COMMIT-PRIMARY without a LOCK",
                        };
                        if let Some(held) = other {
                            inbound.locks.insert(local, held); // For its ABORT.
                        }
                        inbound.log.release(pos);
                        let why = format!("{why} ({})", rec.txn);
                        self.malformed(sender, RingKind::Log, pos, &why);
                        return;
                    }
                };
                self.apply_at_primary(&held.writes);
                let r = self.inbound[sender.0 as usize]
                    .retained
                    .entry(local)
                    .or_insert_with(|| Retained::new(rec.txn));
                r.records.push(held.record);
                r.records.push(pos);
                r.primary_writes = Some(held.writes);
            }
            LogBody::Abort => {
                let inbound = &mut self.inbound[sender.0 as usize];
                if let Some(held) = inbound.locks.remove(&local) {
                    if held.ok {
                        self.unlock_all(&held.writes);
                    }
                    // Slots the transaction allocated here: the coordinator leaves them to
                    // the primary that got its LOCK, so that they are free only once unlocked.
                    self.free_fresh_slots(&held.writes);
                    self.inbound[sender.0 as usize].log.release(held.record);
                } else {
                    // The LOCK already went to recovery (an ABORT sent before the coordinator
                    // saw the new configuration): its locks go now.
                    self.recovery_abort_record(rec.txn);
                }
                self.inbound[sender.0 as usize].log.release(pos);
            }
            LogBody::Truncate => self.inbound[sender.0 as usize].log.release(pos),
        }
    }

    /// Why no coordinator sends the writes `ws` (a peer's bug, or another build's), if it
    /// does not: a write that does not fit in a region, at an offset no object starts at (an
    /// object's header is a word), or whose header was read locked (§4: execution reads only
    /// unlocked objects). Checked where they arrive, before any is locked or applied.
    pub(crate) fn unsendable_writes(&self, ws: &WriteSet) -> Option<String> {
        let region_bytes = self.machine.params.region_bytes;
        ws.writes.iter().find_map(|w| {
            let offset = w.addr.offset as usize;
            let end = offset + object::HEADER_BYTES + w.data.len();
            if !offset.is_multiple_of(8) || end > region_bytes {
                Some(format!("a write at {:?} of {} bytes", w.addr, w.data.len()))
            } else if w.read.locked() {
                Some(format!("a write at {:?} read locked", w.addr))
            } else {
                None
            }
        })
    }

    /// Why the RELEASE of the slot at `addr` of `slot_bytes` names no slot that a primary of its
    /// region handed out and that is still out, if it does not: a size no slot has, an offset
    /// no slot of that size starts at (beyond the region, in block 0 of the headers, or off the
    /// block's carving), an object allocated, or a slot already free. Checked here only where
    /// the region's memory is (its primary frees the slot).
    fn unreleasable(&self, addr: farm_core::Addr, slot_bytes: u32) -> Option<String> {
        let mem = self.view.region(addr.region)?;
        let offset = addr.offset as usize;
        let why = if !farm_alloc::SLOT_BYTES.contains(&slot_bytes) {
            "a size no slot has"
        } else if offset + slot_bytes as usize > self.machine.params.region_bytes
            || block_of(addr.offset) == 0
            || !(offset % farm_alloc::BLOCK_BYTES).is_multiple_of(slot_bytes as usize)
        {
            "an offset no slot of that size starts at"
        } else if slot_bytes_of(mem.load_u64(
            block_header_offset(block_of(addr.offset)),
            Ordering::Acquire,
        )) != Some(slot_bytes)
        {
            "a block carved for another size"
        } else if object::read_header(&**mem, addr.offset as u64).is_ok_and(|h| h.allocated()) {
            "an allocated object"
        } else if self
            .slabs
            .get(&addr.region)
            .is_some_and(|s| s.is_free(addr.offset, slot_bytes))
        {
            "a slot already free"
        } else {
            return None;
        };
        Some(format!("RELEASE of {addr:?} ({slot_bytes} bytes): {why}"))
    }

    /// §4 step 1 at the primary: CAS every written object's header at the version read. On the
    /// first failure, the locks already taken are released and the LOCK fails.
    fn lock_all(&mut self, writes: &WriteSet) -> bool {
        // A coordinator with an older view may lock where this machine is no longer primary,
        // or in a blocked region: refuse, it will retry in the new configuration.
        let me = self.machine.id;
        let regions: BTreeSet<RegionId> = writes.writes.iter().map(|w| w.addr.region).collect();
        if regions.into_iter().any(|r| self.region_blocked(r)) {
            return false;
        }
        let servable = writes.writes.iter().all(|w| {
            self.view
                .map
                .get(w.addr.region)
                .is_some_and(|p| p.primary == me)
                && self.view.region(w.addr.region).is_some()
        });
        if !servable {
            return false;
        }
        for (i, w) in writes.writes.iter().enumerate() {
            let mem = self.primary_mem(w.addr.region);
            if object::try_lock(&mem, w.addr.offset as u64, w.read).is_err() {
                for taken in &writes.writes[..i] {
                    object::unlock(
                        &self.primary_mem(taken.addr.region),
                        taken.addr.offset as u64,
                        taken.read,
                    );
                }
                return false;
            }
        }
        true
    }

    pub(crate) fn unlock_all(&mut self, writes: &WriteSet) {
        for w in &writes.writes {
            object::unlock(
                &self.primary_mem(w.addr.region),
                w.addr.offset as u64,
                w.read,
            );
        }
    }

    fn primary_mem(&self, region: RegionId) -> Arc<farm_core::nvram::Nvram> {
        let placement = self.view.map.get(region);
        assert!(
            placement.is_some_and(|p| p.primary == self.machine.id),
            "LOCK for region {region:?} at {} which is not its primary",
            self.machine.id
        );
        self.view
            .region(region)
            .expect("primary holds its region")
            .clone()
    }

    /// §4 step 4: update in place, increment versions, unlock. Frees return the slot to this
    /// thread's slab (§5.5: free lists live at the primary).
    pub(crate) fn apply_at_primary(&mut self, writes: &WriteSet) {
        for w in &writes.writes {
            let mem = self.primary_mem(w.addr.region);
            let new = w.read.committed_successor(w.allocated);
            object::apply_locked(&mem, w.addr.offset as u64, &w.data, new);
            if w.read.allocated() && !w.allocated {
                let block = block_of(w.addr.offset);
                let header = mem.load_u64(block_header_offset(block), Ordering::Acquire);
                let slot = slot_bytes_of(header).expect("a freed object lies in a carved block");
                match self.slabs.get_mut(&w.addr.region) {
                    Some(slabs) => slabs.free(w.addr.offset, slot),
                    // A promoted primary rebuilds its free lists by a scan (§5.5); frees wait
                    // for it.
                    None => self.machine.queue_free(w.addr, slot),
                }
                self.stats.frees += 1;
            }
        }
    }

    /// Returns to the free lists the slots of `writes` that its transaction allocated at this
    /// primary, when it aborts after its LOCK reached this primary (its coordinator leaves
    /// them to the primary: a free slot must not be locked).
    pub(crate) fn free_fresh_slots(&mut self, writes: &WriteSet) {
        let me = self.machine.id;
        for w in &writes.writes {
            if w.read.allocated() || !w.allocated {
                continue;
            }
            let region = w.addr.region;
            if self.view.map.get(region).is_none_or(|p| p.primary != me) {
                continue;
            }
            let Some(mem) = self.view.region(region) else {
                continue;
            };
            let header = mem.load_u64(
                block_header_offset(block_of(w.addr.offset)),
                Ordering::Acquire,
            );
            let Some(slot) = slot_bytes_of(header) else {
                continue;
            };
            match self.slabs.get_mut(&region) {
                Some(slabs) => slabs.free(w.addr.offset, slot),
                None => self.machine.queue_free(w.addr, slot),
            }
        }
    }

    /// Truncation piggybacked on a record from `sender` (§4 step 5): every retained transaction
    /// of the sender below `below` or listed in `ids` is done; backups apply their writes now.
    pub(crate) fn truncate_from(&mut self, sender: MachineId, below: u64, ids: &[u64]) {
        let inbound = &mut self.inbound[sender.0 as usize];
        if below > inbound.truncated_below {
            inbound.truncated_below = below;
            // Kept in NVRAM for a restart (monotonic across lives: a new life counts from
            // above the old one's transactions).
            let slot = self.machine.truncation_offset(sender, self.thread.0);
            let stored = self.machine.truncation.load_u64(slot, Ordering::Relaxed);
            if below > stored {
                self.machine
                    .truncation
                    .store_u64(slot, below, Ordering::Release);
            }
            inbound.truncated_ids = inbound.truncated_ids.split_off(&below);
        }
        inbound
            .truncated_ids
            .extend(ids.iter().filter(|id| **id >= below));
        let mut done: Vec<u64> = inbound.retained.range(..below).map(|(k, _)| *k).collect();
        done.extend(
            ids.iter()
                .filter(|id| **id >= below && inbound.retained.contains_key(id)),
        );
        // The backup copies are cold (nothing reads them before a failure): touch every
        // header first so their cache misses overlap instead of following one another.
        for local in &done {
            let ws = inbound
                .retained
                .get(local)
                .and_then(|r| r.backup_writes.as_ref());
            for w in ws.map_or(&[][..], |ws| &ws.writes[..]) {
                if let Some(mem) = self.view.region(w.addr.region) {
                    mem.prefetch(w.addr.offset as usize, object::HEADER_BYTES + w.data.len());
                }
            }
        }
        for local in done {
            let r = inbound.retained.remove(&local).expect("listed");
            if let Some(ws) = r.backup_writes {
                for w in &ws.writes {
                    let Some(mem) = self.view.region(w.addr.region) else {
                        // A coordinator sends COMMIT-BACKUP only to the region's backups.
                        self.stats.malformed += 1;
                        tracing::error!(
                            machine = self.machine.id.0,
                            thread = self.thread.0,
                            sender = sender.0,
                            region = w.addr.region.0,
                            "COMMIT-BACKUP for a region not held here: write skipped"
                        );
                        continue;
                    };
                    let new = w.read.committed_successor(w.allocated);
                    let data = if w.allocated { &w.data[..] } else { &[][..] };
                    object::install_at_backup(mem, w.addr.offset as u64, data, new);
                }
                self.stats.backup_applied += 1;
            }
            for pos in r.records {
                inbound.log.release(pos);
            }
        }
    }

    /// Tells `sender` how far this thread freed its ring, lazily: when an eighth of the ring was
    /// freed since the last report, or when the ring is drained (`force` or nothing held).
    pub(crate) fn report_freed(&mut self, sender: MachineId, kind: RingKind, force: bool) {
        let layout = self.machine.params.layout;
        let inbound = &mut self.inbound[sender.0 as usize];
        let (ring, reported) = match kind {
            RingKind::Log => (&inbound.log, &mut inbound.log_reported),
            RingKind::Queue => (&inbound.queue, &mut inbound.queue_reported),
        };
        let freed = ring.freed();
        if freed == *reported {
            return;
        }
        let lazy_enough = freed - *reported >= (layout.ring_bytes(kind) / 8) as u64;
        if !(force || lazy_enough || ring.held() == 0) {
            return;
        }
        *reported = freed;
        let slot = layout.feedback_offset(self.machine.id, self.thread, kind);
        if sender == self.machine.id {
            self.machine
                .feedback
                .store_u64(slot, freed, Ordering::Release);
        } else {
            // A lost report is harmless: a later one carries a larger position.
            let _ = self.machine.fabric.write(
                self.endpoint(),
                sender,
                MemKey::Feedback,
                slot as u64,
                &freed.to_le_bytes(),
            );
        }
    }

    /// Refreshes this thread's view of how far `receiver` freed its ring of `kind`.
    pub(crate) fn refresh_head(&mut self, receiver: MachineId, kind: RingKind) {
        let slot = self
            .machine
            .params
            .layout
            .feedback_offset(receiver, self.thread, kind);
        let head = self.machine.feedback.load_u64(slot, Ordering::Acquire);
        let out = &mut self.outbound[receiver.0 as usize];
        match kind {
            RingKind::Log => out.log.update_head(head),
            RingKind::Queue => out.queue.update_head(head),
        }
    }

    /// Appends the record `encode` writes (its payload) to the ring of `kind` at `dst`,
    /// consuming `reserved` bytes of reservation; the payload is encoded where it is framed,
    /// with no copy in between. Local destinations are written with local memory, not the
    /// fabric (§4). Returns the write's ticket (`None` for a local write, which is complete at
    /// once) or `Ok` with no placement when the ring is full.
    pub(crate) fn append_record(
        &mut self,
        dst: MachineId,
        kind: RingKind,
        reserved: usize,
        encode: impl FnOnce(&mut Vec<u8>),
    ) -> Result<Option<Option<WriteTicket>>, FabricError> {
        let mut framed = std::mem::take(&mut self.framed);
        frame_with(&mut framed, encode);
        let result = self.append_framed(dst, kind, &framed, reserved);
        self.framed = framed;
        result
    }

    fn append_framed(
        &mut self,
        dst: MachineId,
        kind: RingKind,
        framed: &[u8],
        reserved: usize,
    ) -> Result<Option<Option<WriteTicket>>, FabricError> {
        if self.outbound[dst.0 as usize].cut {
            return Err(FabricError::Unreachable(dst));
        }
        self.refresh_head(dst, kind);
        let out = &mut self.outbound[dst.0 as usize];
        let writer = match kind {
            RingKind::Log => &mut out.log,
            RingKind::Queue => &mut out.queue,
        };
        let Some(place) = writer.place(framed.len(), reserved) else {
            return Ok(None);
        };
        let layout = self.machine.params.layout;
        let base = layout.ring_offset(self.machine.id, self.thread, kind);
        if dst == self.machine.id {
            if let Some((at, len)) = place.skip {
                self.machine.rings.write(base + at, &skip_marker(len));
            }
            self.machine.rings.write(base + place.offset, framed);
            return Ok(Some(None));
        }
        let fabric = &self.machine.fabric;
        if let Some((at, len)) = place.skip {
            fabric.write(
                self.endpoint(),
                dst,
                MemKey::Rings,
                (base + at) as u64,
                &skip_marker(len),
            )?;
        }
        let t = fabric.write(
            self.endpoint(),
            dst,
            MemKey::Rings,
            (base + place.offset) as u64,
            framed,
        )?;
        Ok(Some(Some(t)))
    }

    /// Whether messages to `dst` wait for queue space (its worker has not freed its queue).
    pub(crate) fn queue_full(&self, dst: MachineId) -> bool {
        self.outbound[dst.0 as usize].backlogged > 0
    }

    /// Sends a message. Message queues are freed as soon as messages are processed; when the
    /// queue to `dst` is full the message waits in a bounded backlog that [`Worker::poll`]
    /// retries, so a handler never blocks on a slow peer.
    pub(crate) fn send_message(&mut self, dst: MachineId, msg: &Message) {
        // A reused buffer: a LOCK-REPLY goes out for every LOCK, so this is a hot path.
        let mut framed = std::mem::take(&mut self.msg_framed);
        frame_with(&mut framed, |o| msg.encode(o));
        if self.queue_full(dst) || !self.try_send_framed(dst, &framed) {
            if dst != self.machine.id
                && self.outbound[dst.0 as usize].backlogged >= BACKLOG_PER_PEER_MAX
            {
                self.cut(dst, msg);
            } else {
                self.stats.queue_full_waits += 1;
                self.outbound[dst.0 as usize].backlogged += 1;
                self.backlog.push_back((dst, framed.clone()));
            }
        }
        self.msg_framed = framed;
    }

    /// Cuts the link to `dst`, which let [`BACKLOG_PER_PEER_MAX`] messages pile up here: they
    /// and `last` are dropped, every later write to it fails as on a broken connection, and the
    /// machine reports it unreachable (`MachineState::unreachable_members`) so that the
    /// configuration removes it. Nothing counts a message to it delivered meanwhile
    /// ([`Worker::write_settled`]); what it held is recovered once it is removed (§5.3).
    fn cut(&mut self, dst: MachineId, last: &Message) {
        tracing::error!(
            machine = self.machine.id.0,
            thread = self.thread.0,
            peer = dst.0,
            config = self.view.config.id.0,
            ?last,
            "a peer freed no queue space for {BACKLOG_PER_PEER_MAX} messages: link cut, peer \
             reported unreachable"
        );
        self.stats.cut_links += 1;
        self.backlog.retain(|(d, _)| *d != dst);
        let out = &mut self.outbound[dst.0 as usize];
        out.backlogged = 0;
        out.cut = true;
        self.machine.cut_link(self.thread, dst);
    }

    /// Sends a message now if its queue has room, returning the write's ticket (`None` for a
    /// local write, [`LOST`] for a write that failed); `None` when it must be retried.
    pub(crate) fn send_tracked(
        &mut self,
        dst: MachineId,
        msg: &Message,
    ) -> Option<Option<WriteTicket>> {
        if self.queue_full(dst) {
            return None;
        }
        let mut framed = std::mem::take(&mut self.msg_framed);
        frame_with(&mut framed, |o| msg.encode(o));
        let placed = self.append_framed(dst, RingKind::Queue, &framed, 0);
        self.msg_framed = framed;
        match placed {
            Ok(Some(ticket)) => Some(ticket),
            Ok(None) => None,
            Err(_) => Some(Some(LOST)),
        }
    }

    /// Whether `region` is blocked (§5.3 step 1): its replicas changed, and its primary has not
    /// yet recorded becoming active in a configuration at or after that change (local memory
    /// at the primary, a one-sided read elsewhere: obtaining the region's reference waits for
    /// lock recovery).
    pub(crate) fn region_blocked(&mut self, region: RegionId) -> bool {
        if !self.view.is_blocked(region) || self.active.contains(&region) {
            return false;
        }
        let Some(placement) = self.view.map.get(region) else {
            return true;
        };
        let word = if placement.primary == self.machine.id {
            self.view
                .region(region)
                .map(|m| m.load_u64(farm_alloc::REGION_ACTIVE_OFFSET, Ordering::Acquire))
        } else {
            let mut buf = [0u8; 8];
            self.remote(region)
                .and_then(|r| r.read(farm_alloc::REGION_ACTIVE_OFFSET as u64, &mut buf))
                .ok()
                .map(|_| u64::from_le_bytes(buf))
        };
        let changed = self
            .view
            .changes
            .get(&region)
            .map_or(0, |c| c.last_replica_change.0);
        if word.is_some_and(|w| w >= changed) {
            self.active.insert(region);
            return false;
        }
        true
    }

    /// Whether the message was placed (or its peer is dead: nobody will read it).
    fn try_send_framed(&mut self, dst: MachineId, framed: &[u8]) -> bool {
        !matches!(
            self.append_framed(dst, RingKind::Queue, framed, 0),
            Ok(None)
        )
    }

    fn flush_backlog(&mut self) -> bool {
        let mut busy = false;
        let mut blocked: Vec<MachineId> = Vec::new();
        let mut rest = std::collections::VecDeque::new();
        while let Some((dst, framed)) = self.backlog.pop_front() {
            if !blocked.contains(&dst) && self.try_send_framed(dst, &framed) {
                self.outbound[dst.0 as usize].backlogged -= 1;
                busy = true;
            } else {
                blocked.push(dst);
                rest.push_back((dst, framed));
            }
        }
        self.backlog = rest;
        busy
    }

    /// Whether a posted write to `dst` has landed ([`LOST`]: failed when posted).
    pub(crate) fn write_status(&self, dst: MachineId, ticket: Option<WriteTicket>) -> WriteStatus {
        match ticket {
            None => WriteStatus::Done,
            Some(LOST) => WriteStatus::Failed,
            Some(t) => self.machine.fabric.write_status(self.endpoint(), dst, t),
        }
    }

    /// Whether a posted write to `dst` is settled: it landed, or it failed and `dst` has left
    /// this worker's configuration (recovery decides what it held). A write that failed to a
    /// member is not delivered: the member may live behind a broken link, never having seen it
    /// (§4 step 5 truncates only once every primary has COMMIT-PRIMARY), until the
    /// configuration removes it, which the broken link asks for (`Fabric::broken_members`).
    pub(crate) fn write_settled(&self, dst: MachineId, ticket: Option<WriteTicket>) -> bool {
        match self.write_status(dst, ticket) {
            WriteStatus::Done => true,
            WriteStatus::Failed => !self.view.config.contains(dst),
            WriteStatus::Pending => false,
        }
    }

    /// Number of COMMIT-BACKUP and primary records kept waiting for truncation, over all peers.
    pub fn retained_records(&self) -> usize {
        self.inbound
            .iter()
            .map(|i| i.retained.len() + i.locks.len())
            .sum()
    }

    /// Transactions whose log records this worker keeps (not truncated yet), by coordinator
    /// machine and local id.
    pub fn retained_txns(&self) -> BTreeSet<(MachineId, u64)> {
        self.inbound
            .iter()
            .enumerate()
            .flat_map(|(m, i)| i.retained.keys().map(move |l| (MachineId(m as u16), *l)))
            .collect()
    }

    /// Transaction ids whose locks this worker holds as a primary.
    pub fn held_lock_txns(&self) -> BTreeSet<(MachineId, u64)> {
        self.inbound
            .iter()
            .enumerate()
            .flat_map(|(m, i)| i.locks.keys().map(move |l| (MachineId(m as u16), *l)))
            .collect()
    }

    /// Whether this worker's machine is a member of the configuration it knows.
    pub fn is_member(&self) -> bool {
        self.view.config.contains(self.machine.id)
    }

    /// Bytes of this worker's outbound logs and queues to members of the configuration that are
    /// written but not yet freed by their receivers, or reserved. At quiescence (every receiver
    /// polled and its feedback reported) this is zero; anything else is a leaked reservation
    /// or an unfreed record. (What was sent to machines that left stays unfreed.)
    pub fn outbound_in_use(&mut self) -> usize {
        let mut total = 0;
        for peer in 0..self.outbound.len() {
            let m = MachineId(peer as u16);
            if !self.view.config.contains(m) {
                continue;
            }
            self.refresh_head(m, RingKind::Log);
            self.refresh_head(m, RingKind::Queue);
            total += self.outbound[peer].log.in_use() + self.outbound[peer].queue.in_use();
        }
        total
    }

    /// Forces truncation feedback for every ring (used at quiescence).
    pub fn report_all_freed(&mut self) {
        for peer in 0..self.inbound.len() {
            self.report_freed(MachineId(peer as u16), RingKind::Log, true);
            self.report_freed(MachineId(peer as u16), RingKind::Queue, true);
        }
    }

    /// Before this thread carves a new block of `region` for a payload of `len` bytes: takes
    /// slots of that size that the machine's other threads freed while holding no slabs of the
    /// region, or that allocator recovery found free (§5.5), so that the region's few blocks
    /// are carved only when no thread has a slot left.
    pub(crate) fn refill_slabs(&mut self, region: RegionId, len: usize) {
        let Some(slabs) = self.slabs.get_mut(&region) else {
            return;
        };
        let Ok(class) = farm_alloc::class_for(len) else {
            return;
        };
        if slabs.has_free(len) {
            return;
        }
        let slot = farm_alloc::SLOT_BYTES[class];
        for offset in self
            .machine
            .take_queued_slots(region, slot, SHARED_SLOTS_BATCH)
        {
            slabs.free(offset, slot);
        }
    }

    pub(crate) fn txn_id(&mut self) -> TxnId {
        self.coord.next_local += 1;
        TxnId {
            config: self.view.config.id,
            machine: self.machine.id,
            thread: self.thread,
            local: self.coord.next_local,
        }
    }
}
