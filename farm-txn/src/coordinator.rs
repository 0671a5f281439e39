//! The coordinator: transaction execution and the commit protocol of FaRM §4, as a state machine
//! that [`Worker::poll_commit`] advances.
//!
//! Execution ([`Tx`]) reads objects from their primaries (local memory or one-sided reads),
//! records the header of every object read, and buffers writes, allocations and frees. Commit:
//! 1. reserve log space at every participant for every record, truncation included;
//! 2. LOCK to every primary of a written object; wait for every LOCK-REPLY;
//! 3. validate read-only objects: one-sided header reads, or VALIDATE over RPC when a primary
//!    holds more than `tr` of them;
//! 4. COMMIT-BACKUP to every backup of every written region; wait for every hardware ack;
//! 5. COMMIT-PRIMARY to every primary; success after the first ack (or a local write);
//! 6. truncation later, piggybacked on records to the same participant or sent explicitly when
//!    the coordinator is idle.
//!
//! A failed LOCK or validation sends ABORT to the primaries and leaves no lock behind.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;

use farm_alloc::{block_header_offset, class_for, Allocation};
use farm_core::fabric::{MemKey, PostedRead, WriteStatus, WriteTicket};
use farm_core::object::{self, Header, ReadOutcome, HEADER_BYTES};
use farm_core::ring::{framed_len, RingKind, RingWriter};
use farm_core::wire::{
    log_header_bytes, write_set_bytes, AllocOutcome, LogBody, LogRecord, Message, WriteEntry,
    WriteSet, ALLOC_BATCH_MAX, RECORD_BYTES_MAX,
};
use farm_core::{Addr, ConfigId, MachineId, RegionId, TxnId};

use crate::error::{Conflict, TxError};
use crate::machine::Replication;
use crate::worker::Worker;

/// Retries of a read that keeps being torn before the transaction gives up with a conflict.
const TORN_RETRIES_MAX: usize = 64;
/// Committed transactions whose truncation is pending before explicit TRUNCATEs are forced.
const OUTSTANDING_MAX: usize = 256;
/// Commits one worker keeps in flight at once (FaSST, DrTM+H and FORD keep 8 to 20 per
/// thread); [`Worker::start_commit`] refuses more.
pub const COMMITS_IN_FLIGHT_MAX: usize = 64;

/// A commit in flight on a worker ([`Worker::start_commit`], [`Worker::poll_commit`]). Its
/// transaction id is assigned when its log space is reserved, just before its first record
/// ([`Worker::commit_txn`]), so that a commit waiting for log space holds no truncation back.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct CommitHandle(u64);

impl std::fmt::Display for CommitHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "commit #{}", self.0)
    }
}

/// Size of a record header (its truncation is a bound, with no explicit ids: see
/// `Worker::piggyback`).
const fn header_bytes() -> usize {
    log_header_bytes(0)
}

/// Coordinator state of one worker that outlives single transactions.
#[derive(Debug)]
pub(crate) struct CoordinatorState {
    /// The local counter of the last transaction id handed out (`Worker::txn_id`).
    pub(crate) next_local: u64,
    /// Last ALLOC request id.
    pub(crate) next_request: u64,
    /// Committed transactions still waiting for COMMIT-PRIMARY acks.
    unacked: BTreeMap<u64, Unacked>,
    /// Committed transactions that a new view made recovering before every COMMIT-PRIMARY
    /// was acked (`Worker::unacked_now_recovering`): recovery decides them, and they hold
    /// truncation back (in `recovering`) until it has.
    committed_recovering: BTreeSet<TxnId>,
    /// Per participant: committed transactions with records there, not yet truncated.
    outstanding: Vec<BTreeSet<u64>>,
    /// Per participant: bytes reserved for explicit TRUNCATE records.
    trunc_reserved: Vec<usize>,
    /// When a truncatable transaction first waited, for the lazy explicit flush.
    truncatable_since: Option<u64>,
    /// Own transactions whose outcome recovery decides: they hold the truncation low bound
    /// down, so that no replica votes them truncated (§5.3 step 6).
    pub(crate) recovering: BTreeSet<u64>,
    /// Commits in flight, by handle. One being advanced is taken out meanwhile (and counted
    /// by the caller of `piggyback`). Boxed: every poll of a commit takes it out and puts it
    /// back, and a B-tree shifts its neighbours' values in a node as it does; a commit is
    /// hundreds of bytes, and those moves were a tenth of a `shm` machine's TATP time.
    active: BTreeMap<CommitHandle, Box<Commit>>,
    /// The local ids of the commits in flight that hold truncation back
    /// (`Commit::holds_truncation`), the one being advanced included: the truncation bounds
    /// are taken at every record a commit sends, and going through every commit in flight
    /// for them was quadratic in the commits in flight.
    holding: BTreeSet<u64>,
    /// The next commit handle.
    next_handle: u64,
}

/// A committed transaction waiting for its COMMIT-PRIMARY acks.
#[derive(Debug)]
struct Unacked {
    txn: TxnId,
    /// The regions it wrote.
    regions: Vec<RegionId>,
    tickets: Vec<(MachineId, Option<WriteTicket>)>,
}

impl CoordinatorState {
    pub(crate) fn new(peers: usize) -> Self {
        Self {
            next_local: 0,
            next_request: 0,
            unacked: BTreeMap::new(),
            committed_recovering: BTreeSet::new(),
            outstanding: vec![BTreeSet::new(); peers],
            trunc_reserved: vec![0; peers],
            truncatable_since: None,
            recovering: BTreeSet::new(),
            active: BTreeMap::new(),
            holding: BTreeSet::new(),
            next_handle: 0,
        }
    }
}

/// An object a transaction touched.
#[derive(Clone, Debug)]
struct Entry {
    /// Header seen by the read (the lock is taken at it; validation compares with it).
    read: Header,
    /// Current value as seen by this transaction (its own writes included).
    data: Vec<u8>,
    written: bool,
    /// Allocated bit after commit.
    allocated: bool,
    /// Slot size, when this transaction allocated the object (to give it back on abort), and
    /// the configuration it was handed out in: a primary promoted since rebuilt its free lists
    /// from the headers (§5.5) and counts the slot free already.
    fresh: Option<(u32, ConfigId)>,
}

/// Why a primary gave no slot to an ALLOC.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Refused {
    /// The region has no room for the size.
    Full,
    /// The primary is rebuilding the region's free lists (§5.5), or is not its primary.
    Recovering,
}

/// The execution state of a transaction: its read set and buffered writes.
#[derive(Debug, Default)]
pub struct TxState {
    objects: BTreeMap<Addr, Entry>,
    /// The coordinator's view generation during the execution (every read came from it).
    generation: u64,
}

impl TxState {
    /// Whether the transaction wrote, allocated or freed anything.
    pub fn is_read_only(&self) -> bool {
        !self.objects.values().any(|e| e.written)
    }
}

/// Polls the workers that share the coordinator's thread while a transaction waits during its
/// execution (for an allocation at a remote primary), returning the current tick.
pub type Poller<'w> = &'w mut dyn FnMut() -> u64;

/// A transaction in its execution phase, bound to the worker that coordinates it.
pub struct Tx<'w> {
    worker: &'w mut Worker,
    state: TxState,
    poller: Option<Poller<'w>>,
    /// The worker's view generation when execution started: every read comes from that view.
    generation: u64,
    /// Object reads posted ahead by [`Tx::prefetch`], taken by the first [`Tx::read`] of each
    /// address. Dropped with the transaction: a later one, or a lock-free read, never sees a
    /// copy older than its own start.
    posted: Vec<Posted>,
}

/// A transaction's execution without the worker that coordinates it: what an asynchronous
/// transaction keeps while it waits, and lends back to a [`Tx`] ([`Tx::resume`]) for each step
/// it takes with the worker borrowed. Many of them may be open on one worker at once; each
/// checks its reads against the view it started in.
#[derive(Debug)]
pub struct TxCore {
    state: TxState,
    generation: u64,
    posted: Vec<Posted>,
}

impl TxCore {
    /// A transaction starting on `worker` (in the newest view it knows).
    pub fn new(worker: &mut Worker) -> Self {
        worker.refresh_view();
        Self {
            state: TxState::default(),
            generation: worker.view_generation,
            posted: Vec::new(),
        }
    }

    /// Ends execution: see [`Tx::into_state`].
    pub fn into_state(mut self) -> TxState {
        self.state.generation = self.generation;
        self.state
    }
}

/// Object reads one transaction may have posted ahead at once: enough for a TPC-C NEW-ORDER's
/// warehouse, district, customer and fifteen items with their stock.
const POSTED_READS_MAX: usize = 64;

/// An object read posted by [`Tx::prefetch`].
#[derive(Debug)]
struct Posted {
    addr: Addr,
    /// Payload bytes posted.
    len: usize,
    read: Box<dyn PostedRead>,
}

impl std::fmt::Debug for Tx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// Polls an allocation waits for its reply before giving up on the primary.
const ALLOC_WAIT_POLLS_MAX: u64 = 10_000_000;

impl<'w> Tx<'w> {
    /// Starts executing a transaction coordinated by `worker`. Without a poller, locality hints
    /// naming a region whose primary is another machine fall back to a local region.
    pub fn new(worker: &'w mut Worker) -> Self {
        let core = TxCore::new(worker);
        Self::resume(worker, core, None)
    }

    /// Like [`Tx::new`], with a poller that serves the other workers of this thread while the
    /// transaction waits for an allocation at a remote primary.
    pub fn with_poller(worker: &'w mut Worker, poller: Poller<'w>) -> Self {
        let core = TxCore::new(worker);
        Self::resume(worker, core, Some(poller))
    }

    /// Goes on executing the transaction `core` (from [`TxCore::new`] or [`Tx::suspend`] on
    /// this same worker) with the worker borrowed again.
    pub fn resume(worker: &'w mut Worker, core: TxCore, poller: Option<Poller<'w>>) -> Self {
        Self {
            worker,
            state: core.state,
            generation: core.generation,
            poller,
            posted: core.posted,
        }
    }

    /// Gives the worker back, keeping the transaction's execution to [`Tx::resume`] later.
    pub fn suspend(self) -> TxCore {
        TxCore {
            state: self.state,
            generation: self.generation,
            posted: self.posted,
        }
    }

    /// Whether [`Tx::read`] of `len` bytes at `addr` would now return without waiting for the
    /// network: the transaction holds the object, or the answer of a read posted for it came
    /// (or no read can be posted for it: its primary is this machine, or the fabric reads in
    /// place). Otherwise a read of it is posted, if none is yet: an asynchronous transaction
    /// waits for this to hold before it reads, doing other work meanwhile.
    pub fn read_ready(&mut self, addr: Addr, len: usize) -> bool {
        if self.state.objects.contains_key(&addr) {
            return true;
        }
        self.post(addr, len, false);
        self.posted
            .iter()
            .find(|p| p.addr == addr)
            .is_none_or(|p| p.read.is_done())
    }

    /// Ends execution, handing the state to [`Worker::start_commit`] (or dropping it: an
    /// uncommitted transaction must still give back what it allocated; see [`Worker::discard`]).
    pub fn into_state(mut self) -> TxState {
        self.state.generation = self.generation;
        self.state
    }

    /// Reads `len` bytes of the object at `addr`: the transaction's own write if there is one,
    /// else the value read before, else a consistent read at the primary.
    pub fn read(&mut self, addr: Addr, len: usize) -> Result<&[u8], TxError> {
        if !self.state.objects.contains_key(&addr) {
            let (header, data) = match self.posted.iter().position(|p| p.addr == addr) {
                Some(i) => {
                    let posted = self.posted.swap_remove(i);
                    self.worker
                        .read_object_posted(addr, posted.len, posted.read)?
                }
                None => self.worker.read_object(addr, len)?,
            };
            self.same_view()?;
            if !header.allocated() {
                // A concurrent transaction freed it after this one read its address from
                // another object: that read is stale, a conflict to retry, not a bad address.
                if self.earlier_read_changed()? {
                    return Err(TxError::Conflict(Conflict::Validate));
                }
                self.same_view()?;
                return Err(TxError::BadAddress {
                    addr,
                    why: "object is not allocated",
                });
            }
            self.state.objects.insert(
                addr,
                Entry {
                    read: header,
                    data,
                    written: false,
                    allocated: true,
                    fresh: None,
                },
            );
        }
        let e = &self.state.objects[&addr];
        if !e.allocated {
            return Err(TxError::BadAddress {
                addr,
                why: "object was freed by this transaction",
            });
        }
        if e.data.len() < len && !e.written && e.fresh.is_none() {
            // Read again, longer: the same version, or the first read is already stale.
            let (header, data) = self.worker.read_object(addr, len)?;
            self.same_view()?;
            let e = self.state.objects.get_mut(&addr).expect("present");
            if header != e.read {
                return Err(TxError::Conflict(Conflict::Validate));
            }
            e.data = data;
        }
        let e = &self.state.objects[&addr];
        if e.data.len() < len {
            return Err(TxError::BadAddress {
                addr,
                why: "read longer than the object's write",
            });
        }
        Ok(&e.data[..len])
    }

    /// A hint that `len` bytes of the object at `addr` will be read soon
    /// ([`Worker::prefetch_object`]); nothing when this transaction read it already.
    pub fn prefetch(&mut self, addr: Addr, len: usize) {
        self.post(addr, len, true);
    }

    /// Posts a read of `addr` unless the transaction holds it or posted one; `fetch_local`:
    /// also fetch an object of this machine into the cache (a hint ahead of time).
    fn post(&mut self, addr: Addr, len: usize, fetch_local: bool) {
        if self.state.objects.contains_key(&addr) || self.posted.iter().any(|p| p.addr == addr) {
            return;
        }
        if self.posted.len() == POSTED_READS_MAX {
            return; // A hint: the read goes out when the transaction reads.
        }
        let read = if fetch_local {
            self.worker.prefetch_object(addr, len)
        } else {
            self.worker.post_object_read(addr, len)
        };
        if let Some(read) = read {
            self.posted.push(Posted { addr, len, read });
        }
    }

    /// Buffers a write of `data` to the object at `addr` (read first if it was not).
    pub fn write(&mut self, addr: Addr, data: &[u8]) -> Result<(), TxError> {
        self.read(addr, 0)?;
        let e = self.state.objects.get_mut(&addr).expect("just read");
        e.written = true;
        e.data.clear();
        e.data.extend_from_slice(data);
        Ok(())
    }

    /// Allocates an object with room for `len` bytes, zeroed, in a region this machine is
    /// primary for: the region of `near` when it is one, else the first with space (§5.5).
    /// With a poller, a `near` whose primary is another machine allocates there (in another
    /// of its regions if that one is full) with ALLOC.
    pub fn alloc(&mut self, len: usize, near: Option<Addr>) -> Result<Addr, TxError> {
        let (addr, slot, header) = match self.remote_hint(near) {
            Some(region) => match self.alloc_at_primary_of(region, len, 1)?.pop() {
                Some(got) => got,
                None => self.alloc_here_or_elsewhere(len, None)?,
            },
            None => self.alloc_here_or_elsewhere(len, near)?,
        };
        Ok(self.allocated(addr, slot, header, len))
    }

    /// [`Tx::alloc`] of `n` objects at once: when they go to another machine's region, the
    /// ALLOC requests are all sent before any reply is awaited (one round trip for the lot,
    /// as FaRM's applications issue operations in parallel, §4).
    pub fn alloc_many(
        &mut self,
        len: usize,
        n: usize,
        near: Option<Addr>,
    ) -> Result<Vec<Addr>, TxError> {
        let Some(region) = self.remote_hint(near) else {
            return (0..n).map(|_| self.alloc(len, near)).collect();
        };
        let mut out = Vec::with_capacity(n);
        for (addr, slot, header) in self.alloc_at_primary_of(region, len, n)? {
            out.push(self.allocated(addr, slot, header, len));
        }
        // Every region of that primary is full: here, as `alloc` places it.
        while out.len() < n {
            let (addr, slot, header) = self.alloc_here_or_elsewhere(len, None)?;
            out.push(self.allocated(addr, slot, header, len));
        }
        Ok(out)
    }

    /// Records a slot the allocator handed out as an object this transaction allocates.
    fn allocated(&mut self, addr: Addr, slot: u32, header: Header, len: usize) -> Addr {
        assert!(
            !header.allocated() && !header.locked(),
            "allocator handed out {addr} whose header is {header:?}"
        );
        let prev = self.state.objects.insert(
            addr,
            Entry {
                read: header,
                data: vec![0; len],
                written: true,
                allocated: true,
                fresh: Some((slot, self.worker.view.config.id)),
            },
        );
        assert!(
            prev.is_none(),
            "slot {addr} allocated twice in one transaction"
        );
        addr
    }

    /// A slot in a region this machine is primary for ([`Tx::alloc`]'s `near` or the first
    /// with space), or, when it is primary of none and may wait for an ALLOC-REPLY, in
    /// another machine's ([`Tx::alloc_elsewhere`]).
    fn alloc_here_or_elsewhere(
        &mut self,
        len: usize,
        near: Option<Addr>,
    ) -> Result<(Addr, u32, Header), TxError> {
        match self.alloc_local(len, near) {
            Err(TxError::NoRegion(_)) if self.poller.is_some() => self.alloc_elsewhere(len),
            other => other,
        }
    }

    /// A slot in another machine's region, for a machine that is primary of none (one that
    /// joined holds no region of its own until it is given one): each region in turn until
    /// one has room. A region that is blocked, or whose new primary is still rebuilding its
    /// free lists (§5.5), gives none yet: when no region had room the allocation is retried
    /// once it serves again ([`TxError::RegionBlocked`]), as a transaction reading a
    /// recovering region is. Before, the first unblocked region alone was asked, and a
    /// primary still recovering, or that region full, failed the transaction for good.
    fn alloc_elsewhere(&mut self, len: usize) -> Result<(Addr, u32, Header), TxError> {
        let me = self.worker.machine.id;
        let regions: Vec<RegionId> = (self.worker.view.map.iter())
            .filter(|(_, p)| p.primary != me)
            .map(|(r, _)| r)
            .collect();
        let (mut recovering, mut full) = (None, None);
        for r in regions {
            if self.worker.region_blocked(r) {
                recovering.get_or_insert(r);
                continue;
            }
            match self
                .alloc_remote_batch(r, len, 1)?
                .pop()
                .expect("one asked")
            {
                Ok(slot) => return Ok(slot),
                Err(Refused::Recovering) => _ = recovering.get_or_insert(r),
                Err(Refused::Full) => full = Some(r),
            }
        }
        let generation = self.worker.view_generation;
        Err(match (recovering, full) {
            // Retried once that region serves again (`txn` pauses for recovery).
            (Some(r), _) => TxError::RegionBlocked(r),
            // Every region is full: this machine asks its CM for one (§3).
            (None, Some(_)) if self.worker.machine.growth.on_full(generation) => {
                TxError::AwaitingRegion(me)
            }
            (None, Some(r)) => TxError::Alloc(farm_alloc::AllocError::RegionFull(r)),
            (None, None) => TxError::NoRegion(me),
        })
    }

    /// A slot in a region this machine is primary for, and its header.
    fn alloc_local(
        &mut self,
        len: usize,
        near: Option<Addr>,
    ) -> Result<(Addr, u32, Header), TxError> {
        let (addr, slot) = self.worker.alloc_slot(len, near)?;
        let mem = self.worker.view.region(addr.region).expect("local primary");
        let header = object::read_header(&**mem, addr.offset as u64).expect("local read");
        Ok((addr, slot, header))
    }

    /// The region of a locality hint to allocate in with ALLOC: one whose primary is another
    /// machine, not blocked, when this transaction can wait for the answer (it has a poller).
    fn remote_hint(&mut self, near: Option<Addr>) -> Option<RegionId> {
        let n = near?;
        let elsewhere = self.poller.is_some()
            && self
                .worker
                .view
                .map
                .get(n.region)
                .is_some_and(|p| p.primary != self.worker.machine.id);
        (elsewhere && !self.worker.region_blocked(n.region)).then_some(n.region)
    }

    /// Up to `n` slots at the primary of `region`: in `region`, then in the primary's other
    /// unblocked regions when it is full (which keeps the locality the hint asked for), each
    /// asked for what is still missing in one batch. Fewer when every one is full.
    fn alloc_at_primary_of(
        &mut self,
        region: RegionId,
        len: usize,
        n: usize,
    ) -> Result<Vec<(Addr, u32, Header)>, TxError> {
        let primary = self.worker.view.map.get(region).expect("checked").primary;
        let others: Vec<RegionId> = self
            .worker
            .view
            .map
            .primary_of(primary)
            .filter(|r| *r != region)
            .collect();
        let mut got = Vec::with_capacity(n);
        for r in std::iter::once(region).chain(others) {
            if got.len() == n {
                break;
            }
            if r != region && self.worker.region_blocked(r) {
                continue;
            }
            got.extend((self.alloc_remote_batch(r, len, n - got.len())?.into_iter()).flatten());
        }
        Ok(got)
    }

    /// `n` slots from the primary of `region`: every ALLOC sent, then every ALLOC-REPLY
    /// awaited, polling this thread's workers meanwhile. [`Refused`] for each the primary
    /// gave none.
    #[allow(clippy::type_complexity)]
    fn alloc_remote_batch(
        &mut self,
        region: RegionId,
        len: usize,
        n: usize,
    ) -> Result<Vec<Result<(Addr, u32, Header), Refused>>, TxError> {
        class_for(len)?;
        let primary = self.worker.view.map.get(region).expect("checked").primary;
        let first = self.worker.coord.next_request + 1;
        self.worker.coord.next_request += n as u64;
        let mut ticket = None;
        // One ALLOC per batch of slots, each answered by one ALLOC-REPLY.
        let mut at = 0;
        while at < n {
            let count = (n - at).min(ALLOC_BATCH_MAX as usize);
            let msg = Message::Alloc {
                request: first + at as u64,
                region,
                len: len as u32,
                count: count as u32,
            };
            ticket = self.worker.send_tracked(primary, &msg).flatten();
            if ticket.is_none() && primary != self.worker.machine.id {
                self.worker.send_message(primary, &msg);
            }
            at += count;
        }
        let requests = first..first + n as u64;
        let mut got: Vec<Option<Result<(Addr, u32, Header), Refused>>> = vec![None; n];
        let mut waiting = n;
        let generation = self.worker.machine.view_generation();
        let poller = self
            .poller
            .as_mut()
            .expect("remote allocation needs a poller");
        for _ in 0..ALLOC_WAIT_POLLS_MAX {
            // The wait is inside this thread's turn: what a pipeline's batch holds back goes
            // out each round (`fabric::Batch`), the ALLOC itself and what the polls below
            // posted, such as the reply to a peer's ALLOC that this very wait served (two
            // pipelines allocating at each other's primaries over `tcp` each held the other's
            // reply until their waits gave up).
            farm_core::fabric::flush();
            let mut i = 0;
            while i < self.worker.replies.other.len() {
                let ours = matches!(&self.worker.replies.other[i].1,
                    Message::AllocReply { request, .. } if requests.contains(request));
                if !ours {
                    i += 1;
                    continue;
                }
                let (_, Message::AllocReply { request, outcomes }) =
                    self.worker.replies.other.remove(i)
                else {
                    unreachable!("matched above")
                };
                for (k, outcome) in outcomes.into_iter().enumerate() {
                    self.worker.stats.allocs_remote += 1;
                    let slot = match outcome {
                        AllocOutcome::Slot {
                            offset,
                            slot_bytes,
                            header,
                        } => Ok((Addr::new(region, offset), slot_bytes, header)),
                        AllocOutcome::RegionFull => Err(Refused::Full),
                        AllocOutcome::NotPrimary => Err(Refused::Recovering),
                        AllocOutcome::TooLarge => {
                            return Err(farm_alloc::AllocError::TooLarge(len).into())
                        }
                    };
                    let at = (request - first) as usize + k;
                    if at < n && got[at].is_none() {
                        waiting -= 1;
                        got[at] = Some(slot);
                    }
                }
            }
            if waiting == 0 {
                return Ok(got.into_iter().map(|g| g.expect("answered")).collect());
            }
            let now = poller();
            self.worker.poll(now);
            // Nor will anyone answer a coordinator whose own machine died under it.
            let me = self.worker.machine.id;
            if !self.worker.machine.fabric.is_up(me) {
                return Err(TxError::CoordinatorFailed(me));
            }
            // A primary that died, or left the configuration, will not answer.
            if ticket.is_some() && self.worker.write_status(primary, ticket) == WriteStatus::Failed
            {
                break;
            }
            if self.worker.machine.view_generation() != generation {
                return Err(TxError::ConfigurationChanged);
            }
            // Nor, maybe, a primary while this machine's lease may have run out: it may have
            // removed this machine and dropped the request unread, and a machine cut off from
            // the coordination store does not learn that (`Tx` begins nothing there either,
            // FaRM §5.1).
            if !self.worker.machine.serves_at(now) {
                return Err(TxError::LeaseLapsed(me));
            }
        }
        Err(TxError::Unavailable(
            farm_core::fabric::FabricError::Unreachable(primary),
        ))
    }

    /// Fails once the worker picked up a newer view during the execution (a read refreshes
    /// it): the transaction's identifier takes the configuration of the view its commit starts
    /// in, so reads from an older one would escape the check that a read region's primary
    /// changed since (`check_view`'s `read_moved`), and be validated against a promoted
    /// backup that may not have applied a committed write yet (§5.3 step 1).
    fn same_view(&self) -> Result<(), TxError> {
        if self.worker.view_generation == self.generation {
            Ok(())
        } else {
            Err(TxError::ConfigurationChanged)
        }
    }

    /// Whether an object this transaction read from before (not one it allocated) changed
    /// since, or is locked by a committing transaction.
    fn earlier_read_changed(&mut self) -> Result<bool, TxError> {
        let earlier: Vec<(Addr, Header)> = self
            .state
            .objects
            .iter()
            .filter(|(_, e)| e.fresh.is_none())
            .map(|(a, e)| (*a, e.read))
            .collect();
        for (a, read) in earlier {
            match self.worker.read_object(a, 0) {
                Ok((header, _)) if header == read => {}
                Ok(_) | Err(TxError::Conflict(_)) => return Ok(true),
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }

    /// Frees the object at `addr` when the transaction commits. An object this transaction
    /// allocated goes back at once: nobody else ever saw it, and the commit has nothing to do
    /// for it (as a write of a never-allocated slot that stays free, it would leak the slot).
    pub fn free(&mut self, addr: Addr) -> Result<(), TxError> {
        self.read(addr, 0)?;
        let e = self.state.objects.get_mut(&addr).expect("just read");
        if let Some((slot, config)) = e.fresh {
            self.state.objects.remove(&addr);
            self.worker.give_back(addr, slot, config);
            return Ok(());
        }
        e.written = true;
        e.allocated = false;
        e.data.clear();
        Ok(())
    }
}

/// Replies to a thread's coordinator. Those of a commit (LOCK, VALIDATE and COMMIT-BACKUP
/// replies) are filed by transaction, so that each poll of a commit looks at its own only: with
/// every reply in one list, each of 64 commits in flight went through all of the others' at
/// every poll. The rest (ALLOC replies) stay in arrival order.
#[derive(Debug, Default)]
pub(crate) struct Replies {
    by_txn: BTreeMap<TxnId, Vec<(MachineId, Message)>>,
    /// Replies that are not a commit's, in arrival order.
    pub(crate) other: Vec<(MachineId, Message)>,
}

impl Replies {
    /// Files `m` from `from`.
    pub(crate) fn push(&mut self, from: MachineId, m: Message) {
        match m {
            Message::LockReply { txn, .. }
            | Message::ValidateReply { txn, .. }
            | Message::BackupAck { txn } => self.by_txn.entry(txn).or_default().push((from, m)),
            m => self.other.push((from, m)),
        }
    }

    /// Drops every reply from `peer`.
    pub(crate) fn forget(&mut self, peer: MachineId) {
        self.other.retain(|(m, _)| *m != peer);
        self.by_txn.retain(|_, replies| {
            replies.retain(|(m, _)| *m != peer);
            !replies.is_empty()
        });
    }

    /// Drops the replies of `txn`, whose commit ended.
    fn ended(&mut self, txn: TxnId) {
        self.by_txn.remove(&txn);
    }

    /// Once replies are filed under more transactions than the `commits` in flight, drops
    /// those of transactions not among `in_flight` (every commit's, none taken out): late
    /// replies of transactions that ended (when a new configuration overtook them, or their
    /// outcome was known before every reply came), for which nobody will ever wait. Until
    /// then a few may stay, never looked at (each commit looks under its own transaction).
    fn drop_late(&mut self, commits: usize, in_flight: impl FnOnce() -> Vec<TxnId>) {
        if self.by_txn.len() <= commits {
            return;
        }
        let mut live = in_flight();
        live.sort_unstable();
        self.by_txn.retain(|t, _| live.binary_search(t).is_ok());
    }
}

/// Consumes the replies for `txn` that `kind` recognizes (returning their transaction and
/// outcome): each one from an awaited machine is struck off, and a negative one sets `failed`.
/// Other replies stay for whoever waits.
fn take_replies(
    replies: &mut Replies,
    txn: TxnId,
    awaiting: &mut BTreeSet<MachineId>,
    failed: &mut bool,
    kind: impl Fn(&Message) -> Option<(TxnId, bool)>,
) {
    let Some(mine) = replies.by_txn.get_mut(&txn) else {
        return;
    };
    mine.retain(|(from, m)| match kind(m) {
        Some((t, ok)) if t == txn => {
            if awaiting.remove(from) && !ok {
                *failed = true;
            }
            false
        }
        _ => true,
    });
    if mine.is_empty() {
        replies.by_txn.remove(&txn);
    }
}

#[cfg(test)]
mod replies_tests {
    use super::*;

    fn txn(local: u64) -> TxnId {
        TxnId {
            local,
            ..TxnId::default()
        }
    }

    /// A commit takes its own replies of the kind it waits for and nothing else; replies of
    /// transactions that ended go once there are more of them than commits in flight, and
    /// those of a peer that is forgotten go at once.
    #[test]
    fn replies_are_taken_by_their_own_commit_and_late_ones_dropped() {
        let (m1, m2) = (MachineId(1), MachineId(2));
        let lock = |m: &Message| match m {
            Message::LockReply { txn, ok } => Some((*txn, *ok)),
            _ => None,
        };
        let mut r = Replies::default();
        r.push(
            m1,
            Message::LockReply {
                txn: txn(1),
                ok: true,
            },
        );
        r.push(
            m2,
            Message::LockReply {
                txn: txn(1),
                ok: false,
            },
        );
        r.push(
            m1,
            Message::LockReply {
                txn: txn(2),
                ok: true,
            },
        );
        r.push(
            m1,
            Message::ValidateReply {
                txn: txn(1),
                ok: true,
            },
        );
        let mut awaiting: BTreeSet<MachineId> = [m1].into();
        let mut failed = false;
        take_replies(&mut r, txn(1), &mut awaiting, &mut failed, lock);
        // m2 was not awaited: its negative reply is consumed without failing the commit.
        assert!(awaiting.is_empty() && !failed);
        assert_eq!(r.by_txn[&txn(1)].len(), 1, "the VALIDATE reply stays");
        assert_eq!(r.by_txn[&txn(2)].len(), 1, "another commit's reply stays");

        // Transaction 1 ended; 2 and 3 are in flight, and a late reply of 1 comes.
        r.ended(txn(1));
        r.push(m2, Message::BackupAck { txn: txn(1) });
        r.drop_late(2, || vec![txn(3), txn(2)]);
        assert!(
            r.by_txn.contains_key(&txn(1)),
            "no more transactions than commits yet"
        );
        r.push(
            m1,
            Message::LockReply {
                txn: txn(3),
                ok: true,
            },
        );
        r.drop_late(2, || vec![txn(3), txn(2)]);
        assert!(!r.by_txn.contains_key(&txn(1)), "the late reply is dropped");
        assert_eq!(r.by_txn.len(), 2);

        r.forget(m1);
        assert!(r.by_txn.is_empty(), "every reply left was m1's");
    }
}

/// Whether `region`'s primary changed after configuration `config` in `view`: slots handed out
/// before belong to the new primary's allocator recovery, which found them free.
pub(crate) fn primary_changed_since(
    view: &crate::machine::View,
    region: farm_core::RegionId,
    config: ConfigId,
) -> bool {
    view.changes
        .get(&region)
        .is_some_and(|c| c.last_primary_change > config)
}

/// Forgets which slots a transaction allocated: once it is recovering, the primaries that
/// handed them out free them if recovery aborts it.
fn leave_slots_to_recovery(state: &mut TxState) {
    for e in state.objects.values_mut() {
        e.fresh = None;
    }
}

/// Takes the validation reads that completed: `failed` if one's header is not the one the
/// transaction read (changed, locked, or unreadable).
fn take_validation_reads(reads: &mut Vec<(Header, Box<dyn PostedRead>)>, failed: &mut bool) {
    let mut i = 0;
    while i < reads.len() {
        if !reads[i].1.is_done() {
            i += 1;
            continue;
        }
        let (seen, read) = reads.swap_remove(i);
        let mut word = [0u8; HEADER_BYTES];
        // The header as copied: a header read is one load, whatever the second says.
        if read.complete(&mut word).is_err() || Header(u64::from_le_bytes(word)) != seen {
            *failed = true;
        }
    }
}

/// Where a commit stands.
#[derive(Debug)]
enum Phase {
    Reserve,
    Lock {
        awaiting: BTreeSet<MachineId>,
        failed: bool,
    },
    Validate {
        awaiting: BTreeSet<MachineId>,
        failed: bool,
        /// Header reads posted to remote primaries, with the header each must still show.
        reads: Vec<(Header, Box<dyn PostedRead>)>,
    },
    Backup {
        tickets: Vec<(MachineId, Option<WriteTicket>)>,
        /// Backups whose BACKUP-ACK is awaited (RPC replication only).
        awaiting: BTreeSet<MachineId>,
        /// A COMMIT-BACKUP could not be written (its backup is dead): wait for recovery.
        failed: bool,
    },
    Primary {
        tickets: Vec<(MachineId, Option<WriteTicket>)>,
    },
    /// A new configuration made the transaction recovering after COMMIT-BACKUP went out: its
    /// acks are ignored and recovery decides (§5.3 step 3).
    Recovering,
}

/// A transaction in its commit phase.
#[derive(Debug)]
pub(crate) struct Commit {
    handle: CommitHandle,
    /// The transaction's id: a new one once log space is reserved (see [`CommitHandle`]).
    txn: TxnId,
    state: TxState,
    /// Write sets per primary (LOCK payloads).
    primaries: BTreeMap<MachineId, WriteSet>,
    /// Write sets per backup (COMMIT-BACKUP payloads).
    backups: BTreeMap<MachineId, WriteSet>,
    /// Log bytes reserved per participant and not yet used.
    reserved: BTreeMap<MachineId, usize>,
    phase: Phase,
    /// The view generation the commit last checked its participants against.
    view_generation: u64,
}

impl Commit {
    /// Whether the commit may have sent log records: past its reservation, with writes. The
    /// truncation bound its thread sends stays at or below its id.
    fn holds_truncation(&self) -> bool {
        !self.primaries.is_empty() && !matches!(self.phase, Phase::Reserve)
    }
}

impl Worker {
    /// A consistent read of `len` payload bytes at `addr` from its primary: local memory when
    /// this machine is the primary, a one-sided read otherwise (§3). A locked object is a
    /// conflict at once: waiting for it here could wait for this very thread (docs/ARCHITECTURE.md, Machines, threads, event loop).
    pub fn read_object(&mut self, addr: Addr, len: usize) -> Result<(Header, Vec<u8>), TxError> {
        self.read_object_with(addr, len, None)
    }

    /// [`Worker::read_object`] of the `len` payload bytes that `posted` (from
    /// [`Worker::prefetch_object`] of the same address and length, in this view) has on its
    /// way: the answer is taken instead of reading again.
    pub fn read_object_posted(
        &mut self,
        addr: Addr,
        len: usize,
        posted: Box<dyn PostedRead>,
    ) -> Result<(Header, Vec<u8>), TxError> {
        self.read_object_with(addr, len, Some(posted))
    }

    fn read_object_with(
        &mut self,
        addr: Addr,
        len: usize,
        posted: Option<Box<dyn PostedRead>>,
    ) -> Result<(Header, Vec<u8>), TxError> {
        // Read through the encoding buffer (free while a transaction executes): only the
        // payload is allocated, and nothing is zeroed first.
        let mut buf = std::mem::take(&mut self.scratch);
        buf.resize(HEADER_BYTES + len, 0);
        let read = self.read_into(addr, &mut buf, posted);
        let out = read.map(|h| (h, buf[HEADER_BYTES..].to_vec()));
        self.scratch = buf;
        out
    }

    /// [`Worker::read_object`] into `buf` (header then payload), without allocating: the path of
    /// lock-free reads.
    pub fn read_object_into(&mut self, addr: Addr, buf: &mut [u8]) -> Result<Header, TxError> {
        self.read_into(addr, buf, None)
    }

    /// [`Worker::read_object_into`] whose first attempt takes the answer of `posted` (from
    /// [`Worker::prefetch_object`] of the same address and `buf.len() - 8` bytes).
    pub fn read_object_into_posted(
        &mut self,
        addr: Addr,
        buf: &mut [u8],
        posted: Option<Box<dyn PostedRead>>,
    ) -> Result<Header, TxError> {
        self.read_into(addr, buf, posted)
    }

    /// A consistent read into `buf`, the first attempt's answer taken from `posted` when the
    /// object's primary is remote.
    fn read_into(
        &mut self,
        addr: Addr,
        buf: &mut [u8],
        mut posted: Option<Box<dyn PostedRead>>,
    ) -> Result<Header, TxError> {
        // Lock-free reads come here without a transaction: see the newest view first.
        self.refresh_view();
        if self.view.map.get(addr.region).is_none() {
            return Err(TxError::BadAddress {
                addr,
                why: "no such region",
            });
        }
        if self.region_blocked(addr.region) {
            return Err(TxError::RegionBlocked(addr.region));
        }
        let placement = self.view.map.get(addr.region).expect("checked");
        let end = addr.offset as usize + buf.len();
        if !addr.offset.is_multiple_of(8) || end > self.machine.params.region_bytes {
            return Err(TxError::BadAddress {
                addr,
                why: "outside its region or unaligned",
            });
        }
        let local = placement.primary == self.machine.id;
        if !local {
            self.remote(addr.region)?;
        }
        for _ in 0..TORN_RETRIES_MAX {
            let outcome = if local {
                let mem = self
                    .view
                    .region(addr.region)
                    .expect("primary holds its region");
                object::read_object(&**mem, addr.offset as u64, buf)
                    .expect("local reads cannot fail")
            } else if let Some(read) = posted.take() {
                self.stats.reads_posted += 1;
                read.complete(buf)?
            } else {
                self.cached_remote(addr.region)
                    .read_object(addr.offset as u64, buf)?
            };
            match outcome {
                ReadOutcome::Consistent(h) => {
                    self.stats.reads += 1;
                    self.stats.reads_remote += !local as u64;
                    return Ok(h);
                }
                ReadOutcome::Locked(_) => {
                    self.stats.reads_locked += 1;
                    return Err(TxError::Conflict(Conflict::ReadLocked(addr)));
                }
                ReadOutcome::Torn => self.stats.reads_torn += 1,
            }
        }
        Err(TxError::Conflict(Conflict::ReadTorn(addr)))
    }

    /// A hint that the object at `addr` (header and `len` payload bytes) will be read soon, from
    /// local memory or its primary, so that a transaction that knows several addresses ahead
    /// overlaps their fetches: local cache lines are fetched without waiting, and a remote
    /// primary's object is read by a posted one-sided read
    /// ([`farm_core::fabric::RemoteMemory::post_object_read`]) whose answer
    /// [`Worker::read_object_posted`] takes, where the fabric posts reads. Addresses that a
    /// read would reject are ignored; the read itself reports them.
    pub fn prefetch_object(&mut self, addr: Addr, len: usize) -> Option<Box<dyn PostedRead>> {
        self.post_read(addr, len, true)
    }

    /// [`Worker::prefetch_object`] for a read about to be made: nothing for an object of this
    /// machine (its read does not wait).
    pub fn post_object_read(&mut self, addr: Addr, len: usize) -> Option<Box<dyn PostedRead>> {
        self.post_read(addr, len, false)
    }

    fn post_read(
        &mut self,
        addr: Addr,
        len: usize,
        fetch_local: bool,
    ) -> Option<Box<dyn PostedRead>> {
        self.refresh_view();
        let placement = self.view.map.get(addr.region)?;
        let len = HEADER_BYTES + len;
        if placement.primary == self.machine.id {
            if fetch_local {
                if let Some(mem) = self.view.region(addr.region) {
                    mem.prefetch(addr.offset as usize, len);
                }
            }
            None
        } else if !self.region_blocked(addr.region) && addr.offset.is_multiple_of(8) {
            let remote = self.remote(addr.region).ok()?;
            remote.post_object_read(addr.offset as u64, len)
        } else {
            None
        }
    }

    /// Takes a free slot for `len` bytes, near `near` when this machine is its region's primary.
    fn alloc_slot(&mut self, len: usize, near: Option<Addr>) -> Result<(Addr, u32), TxError> {
        class_for(len)?;
        let mut candidates: Vec<RegionId> = Vec::new();
        if let Some(n) = near {
            if self.slabs.contains_key(&n.region) {
                candidates.push(n.region);
            }
        }
        candidates.extend(
            self.slabs
                .keys()
                .copied()
                .filter(|r| Some(*r) != near.map(|n| n.region)),
        );
        candidates.retain(|r| !self.region_blocked(*r));
        let mut last_err = None;
        for region in candidates {
            self.refill_slabs(region, len);
            let pool = self.view.pool(region).expect("primary has a pool");
            match self
                .slabs
                .get_mut(&region)
                .expect("listed")
                .alloc(pool, len)
            {
                Ok(a) => {
                    // Local allocation: the header writes precede this thread's COMMIT-BACKUPs
                    // on the same links, so there is no need to wait for them.
                    self.publish_block(region, &a)?;
                    self.stats.allocs += 1;
                    return Ok((Addr::new(region, a.offset), a.slot_bytes));
                }
                Err(e) => last_err = Some(e),
            }
        }
        // No region to allocate in here, or every one full: one being recovered (blocked, or
        // its free lists not rebuilt yet, §5.5) will be back.
        let me = self.machine.id;
        let view = self.view.clone();
        let recovering = (view.map.primary_of(me))
            .find(|r| !self.slabs.contains_key(r) || self.region_blocked(*r));
        if let Some(r) = recovering {
            return Err(TxError::RegionBlocked(r));
        }
        match last_err {
            // Every region is full: the machine asks its CM for another (§3), and the
            // transaction waits for it, unless no region can be placed.
            Some(farm_alloc::AllocError::RegionFull(_))
                if self.machine.growth.on_full(self.view_generation) =>
            {
                Err(TxError::AwaitingRegion(me))
            }
            Some(e) => Err(TxError::Alloc(e)),
            None => Err(TxError::NoRegion(me)),
        }
    }

    /// Writes a new block's header locally and to every backup (§5.5). The backup writes go on
    /// this thread's links, ahead of any COMMIT-BACKUP that uses the block, and writes on a link
    /// land in order, so the header reaches a backup before any object of the block does.
    pub(crate) fn publish_block(
        &mut self,
        region: RegionId,
        a: &Allocation,
    ) -> Result<Vec<(MachineId, WriteTicket)>, TxError> {
        let mut tickets = Vec::new();
        let Some((block, word)) = a.new_block else {
            return Ok(tickets);
        };
        let at = block_header_offset(block);
        self.view
            .region(region)
            .expect("primary")
            .store_u64(at, word, Ordering::Release);
        let backups = self.view.map.get(region).expect("exists").backups.clone();
        for b in backups {
            let t = self.machine.fabric.write(
                self.endpoint(),
                b,
                MemKey::Region(region),
                at as u64,
                &word.to_le_bytes(),
            )?;
            tickets.push((b, t));
        }
        Ok(tickets)
    }

    /// Gives back what a transaction that failed during execution allocated, and counts the
    /// abort (`error`, from the execution, says why).
    pub fn abort_execution(&mut self, state: TxState, error: &TxError) {
        self.stats.count_abort(error);
        self.discard(state);
    }

    /// Gives back what an uncommitted transaction allocated: to this thread's slabs, or with a
    /// RELEASE to the primary that handed the slot out.
    pub fn discard(&mut self, state: TxState) {
        for (addr, e) in state.objects {
            if let Some((slot, config)) = e.fresh {
                self.give_back(addr, slot, config);
            }
        }
    }

    /// Gives back a slot of `slot` bytes at `addr` that a primary handed out in `config` and
    /// nobody saw allocated: to this thread's slabs, or with a RELEASE to that primary (unless
    /// the primary changed since: the new one's allocator scan counted it free).
    fn give_back(&mut self, addr: Addr, slot: u32, config: ConfigId) {
        if primary_changed_since(&self.view, addr.region, config) {
            return;
        }
        match self.slabs.get_mut(&addr.region) {
            Some(slabs) => slabs.free(addr.offset, slot),
            None => {
                let primary = self
                    .view
                    .map
                    .get(addr.region)
                    .expect("allocated there")
                    .primary;
                self.send_message(
                    primary,
                    &Message::Release {
                        addr,
                        slot_bytes: slot,
                        config,
                    },
                );
            }
        }
    }

    /// Where the commit `handle` stands, for diagnostics: its transaction, its phase (with what
    /// it awaits), its participants and the log space it holds reserved at each.
    pub fn commit_summary(&self, handle: CommitHandle) -> String {
        let Some(c) = self.coord.active.get(&handle) else {
            return format!("{handle} is not in flight");
        };
        format!(
            "{}: {:?}; primaries {:?}; backups {:?}; reserved {:?}",
            c.txn,
            c.phase,
            c.primaries.keys().collect::<Vec<_>>(),
            c.backups.keys().collect::<Vec<_>>(),
            c.reserved
        )
    }

    /// Drops the commit `handle` without any protocol step: this worker's machine died (the
    /// runtime's stand-in for a process that is gone).
    pub fn abandon_commit(&mut self, handle: CommitHandle) {
        if let Some(c) = self.coord.active.remove(&handle) {
            self.coord.holding.remove(&c.txn.local);
            self.replies.ended(c.txn);
        }
    }

    /// Whether a commit is in flight on this worker.
    pub fn committing(&self) -> bool {
        !self.coord.active.is_empty()
    }

    /// How many commits are in flight on this worker.
    pub fn commits_in_flight(&self) -> usize {
        self.coord.active.len()
    }

    /// The handles of the commits in flight, oldest first.
    pub fn commits(&self) -> Vec<CommitHandle> {
        self.coord.active.keys().copied().collect()
    }

    /// The transaction id the commit `handle` runs under now (it changes once, when its log
    /// space is reserved), if it is in flight.
    pub fn commit_txn(&self, handle: CommitHandle) -> Option<TxnId> {
        self.coord.active.get(&handle).map(|c| c.txn)
    }

    /// Starts committing `state` and returns its handle, which [`Worker::poll_commit`] takes.
    /// Up to [`COMMITS_IN_FLIGHT_MAX`] commits are in flight at once, each advanced by its own
    /// polls, in any order. Read-only transactions with at most one object commit at once
    /// (their read was consistent); the result is then available from the first poll.
    pub fn start_commit(&mut self, state: TxState) -> CommitHandle {
        assert!(
            self.coord.active.len() < COMMITS_IN_FLIGHT_MAX,
            "more than {COMMITS_IN_FLIGHT_MAX} commits in flight on one worker"
        );
        let txn = self.txn_id();
        let mut regions = BTreeSet::new();
        let mut primaries: BTreeMap<MachineId, WriteSet> = BTreeMap::new();
        let mut backups: BTreeMap<MachineId, WriteSet> = BTreeMap::new();
        for (addr, e) in state.objects.iter().filter(|(_, e)| e.written) {
            regions.insert(addr.region);
            let placement = self.view.map.get(addr.region).expect("read before");
            let entry = WriteEntry {
                addr: *addr,
                read: e.read,
                allocated: e.allocated,
                data: e.data.clone(),
            };
            for b in &placement.backups {
                backups.entry(*b).or_default().writes.push(entry.clone());
            }
            primaries
                .entry(placement.primary)
                .or_default()
                .writes
                .push(entry);
        }
        let regions: Vec<RegionId> = regions.into_iter().collect();
        for ws in primaries.values_mut().chain(backups.values_mut()) {
            ws.regions = regions.clone();
        }
        let handle = CommitHandle(self.coord.next_handle);
        self.coord.next_handle += 1;
        let prev = self.coord.active.insert(
            handle,
            Box::new(Commit {
                handle,
                txn,
                state,
                primaries,
                backups,
                reserved: BTreeMap::new(),
                phase: Phase::Reserve,
                // Zero: checked against the current view at the first poll.
                view_generation: 0,
            }),
        );
        assert!(prev.is_none(), "{handle} started twice");
        handle
    }

    /// Advances the commit `handle` (from [`Worker::start_commit`]); `Some` with the outcome
    /// when it is decided, after which it is no longer in flight. Call [`Worker::poll`] (of
    /// every worker this thread hosts) between calls: replies arrive there.
    pub fn poll_commit(&mut self, handle: CommitHandle, now: u64) -> Option<Result<(), TxError>> {
        let active = &self.coord.active;
        (self.replies).drop_late(active.len(), || active.values().map(|c| c.txn).collect());
        let mut commit = self
            .coord
            .active
            .remove(&handle)
            .unwrap_or_else(|| panic!("{handle} is not in flight"));
        assert_eq!(commit.handle, handle, "a commit filed under another handle");
        let result = self.advance(&mut commit, now);
        if result.is_some() {
            self.coord.holding.remove(&commit.txn.local);
            self.replies.ended(commit.txn);
        }
        match result {
            Some(Ok(())) => {
                self.stats.commits += 1;
            }
            Some(Err(ref e)) => {
                self.stats.count_abort(e);
                let state = std::mem::take(&mut commit.state);
                self.discard(state);
            }
            None => {
                self.coord.active.insert(handle, commit);
            }
        }
        result
    }

    fn advance(&mut self, c: &mut Commit, now: u64) -> Option<Result<(), TxError>> {
        // The commit is checked against each new view once (not on every poll: this is the
        // hot path of every transaction).
        self.refresh_view();
        if c.view_generation != self.view_generation {
            c.view_generation = self.view_generation;
            if let Some(outcome) = self.check_view(c) {
                return Some(outcome);
            }
        }
        loop {
            match &mut c.phase {
                Phase::Reserve => {
                    if c.primaries.is_empty() {
                        // Read-only: no locks, no records (§4); validate when more than one
                        // object was read, as a single consistent read is atomic by itself.
                        if c.state.objects.len() <= 1 {
                            return Some(Ok(()));
                        }
                        c.phase = self.start_validation(c);
                        continue;
                    }
                    match self.reserve(c) {
                        Ok(true) => {}
                        Ok(false) => {
                            // §4: "If the log becomes full, the coordinator uses the
                            // reservations to write explicit truncate records to free up space."
                            // This commit sent nothing and holds no truncation back: its
                            // transaction id comes once it has the space.
                            self.send_truncations(None);
                            return None;
                        }
                        Err(e) => return Some(Err(e)),
                    }
                    // The transaction's id is taken now, above every truncation bound this
                    // thread has sent (each at most the next id): no participant counts it
                    // truncated before its records arrive, and while it waited for log space
                    // it held no truncation back (newer commits' records may be what fills
                    // the log). The view is the execution's (`check_view`).
                    c.txn = self.txn_id();
                    // It holds truncation back from here (`Commit::holds_truncation`): its
                    // LOCKs go out next, and the phase leaves `Reserve` with them.
                    self.coord.holding.insert(c.txn.local);
                    // Invariant 5: every participant holds a reservation before any LOCK.
                    assert!(
                        c.primaries
                            .keys()
                            .chain(c.backups.keys())
                            .all(|m| c.reserved.contains_key(m)),
                        "{}: LOCK without a reservation at every participant",
                        c.txn
                    );
                    let mut awaiting = BTreeSet::new();
                    for p in c.primaries.keys().copied().collect::<Vec<_>>() {
                        // Lent to the record and taken back: no copy of the writes.
                        let ws = std::mem::take(c.primaries.get_mut(&p).expect("listed"));
                        let body = LogBody::Lock(ws);
                        let sent = self.send_log(c, p, &body);
                        let LogBody::Lock(ws) = body else {
                            unreachable!("built above")
                        };
                        c.primaries.insert(p, ws);
                        if let Err(e) = sent {
                            self.abort(c, &awaiting);
                            return Some(Err(e));
                        }
                        awaiting.insert(p);
                    }
                    assert_eq!(awaiting.len(), c.primaries.len(), "a LOCK to every primary");
                    c.phase = Phase::Lock {
                        awaiting,
                        failed: false,
                    };
                    // A local primary's LOCK is in this worker's own log: process it now.
                    if c.primaries.contains_key(&self.machine.id) {
                        let me = self.machine.id;
                        self.poll_log(me);
                    }
                }
                Phase::Lock { awaiting, failed } => {
                    take_replies(&mut self.replies, c.txn, awaiting, failed, |m| match m {
                        Message::LockReply { txn, ok } => Some((*txn, *ok)),
                        _ => None,
                    });
                    if !awaiting.is_empty() {
                        return None;
                    }
                    if *failed {
                        self.abort_at_primaries(c);
                        return Some(Err(TxError::Conflict(Conflict::Lock)));
                    }
                    c.phase = self.start_validation(c);
                }
                Phase::Validate {
                    awaiting,
                    failed,
                    reads,
                } => {
                    take_replies(&mut self.replies, c.txn, awaiting, failed, |m| match m {
                        Message::ValidateReply { txn, ok } => Some((*txn, *ok)),
                        _ => None,
                    });
                    take_validation_reads(reads, failed);
                    if !awaiting.is_empty() || !reads.is_empty() {
                        return None;
                    }
                    if *failed {
                        self.abort_at_primaries(c);
                        return Some(Err(TxError::Conflict(Conflict::Validate)));
                    }
                    if c.primaries.is_empty() {
                        return Some(Ok(()));
                    }
                    let mut tickets = Vec::new();
                    let mut failed = false;
                    for b in c.backups.keys().copied().collect::<Vec<_>>() {
                        let ws = std::mem::take(c.backups.get_mut(&b).expect("listed"));
                        let body = LogBody::CommitBackup(ws);
                        // Once one COMMIT-BACKUP may be out, only recovery may abort.
                        match self.send_log(c, b, &body) {
                            Ok(t) => tickets.push((b, t)),
                            Err(_) => failed = true,
                        }
                        let LogBody::CommitBackup(ws) = body else {
                            unreachable!("built above")
                        };
                        c.backups.insert(b, ws);
                    }
                    let awaiting = match self.machine.params.replication {
                        Replication::OneSided => BTreeSet::new(),
                        Replication::Rpc => c.backups.keys().copied().collect(),
                    };
                    let local = awaiting.contains(&self.machine.id);
                    c.phase = Phase::Backup {
                        tickets,
                        awaiting,
                        failed,
                    };
                    // RPC replication: a local backup's record is in this worker's own log.
                    if local {
                        let me = self.machine.id;
                        self.poll_log(me);
                    }
                }
                Phase::Backup {
                    tickets,
                    awaiting,
                    failed,
                } => {
                    // §4 step 3: every backup must hold the record before any primary exposes
                    // the writes, or a failure could lose them. A backup that failed leaves
                    // the outcome to recovery once the configuration changes: some backups may
                    // hold COMMIT-BACKUP, so the coordinator may no longer abort on its own.
                    // With RPC replication, each backup's CPU must also have answered.
                    let mut nack = false;
                    take_replies(&mut self.replies, c.txn, awaiting, &mut nack, |m| match m {
                        Message::BackupAck { txn } => Some((*txn, true)),
                        _ => None,
                    });
                    if *failed
                        || !awaiting.is_empty()
                        || tickets
                            .iter()
                            .any(|(b, t)| self.write_status(*b, *t) != WriteStatus::Done)
                        || self.view_moved()
                    {
                        return None;
                    }
                    // Invariant 4: COMMIT-PRIMARY goes out only once every backup of every
                    // written region acknowledged its COMMIT-BACKUP: one ticket per backup, and
                    // all of them done (checked above).
                    assert_eq!(
                        tickets.len(),
                        c.backups.len(),
                        "{}: COMMIT-PRIMARY with a backup not sent COMMIT-BACKUP",
                        c.txn
                    );
                    let mut tickets = Vec::new();
                    for p in c.primaries.keys().copied().collect::<Vec<_>>() {
                        // A primary the write failed to keeps its ticket, as lost: nothing
                        // counts it delivered (truncation waits) until it left the
                        // configuration and recovery settles its region.
                        let t = self
                            .send_log(c, p, &LogBody::CommitPrimary)
                            .unwrap_or(Some(crate::worker::LOST));
                        tickets.push((p, t));
                    }
                    let abort_bytes = RingWriter::reservation(framed_len(header_bytes()));
                    for p in c.primaries.keys().copied().collect::<Vec<_>>() {
                        self.unreserve(c, p, abort_bytes);
                    }
                    c.phase = Phase::Primary { tickets };
                    if c.primaries.contains_key(&self.machine.id) {
                        let me = self.machine.id;
                        self.poll_log(me);
                    }
                }
                Phase::Recovering => {
                    let decision = self.recovery.decided.remove(&c.txn)?;
                    self.coord.recovering.remove(&c.txn.local);
                    return Some(match decision {
                        crate::recovery::Decision::Commit => Ok(()),
                        crate::recovery::Decision::Abort => Err(TxError::ConfigurationChanged),
                    });
                }
                Phase::Primary { tickets } => {
                    // §4 step 4: success once one COMMIT-PRIMARY is acked (or written locally).
                    if !tickets
                        .iter()
                        .any(|(p, t)| self.write_status(*p, *t) == WriteStatus::Done)
                        || self.view_moved()
                    {
                        return None;
                    }
                    // Invariant 4, second half: success after one COMMIT-PRIMARY completed.
                    assert!(!c.primaries.is_empty(), "{}: a read-only commit", c.txn);
                    let local = c.txn.local;
                    assert!(
                        !self.coord.unacked.contains_key(&local),
                        "{} committed twice",
                        c.txn
                    );
                    for p in c.primaries.keys().chain(c.backups.keys()) {
                        self.coord.outstanding[p.0 as usize].insert(local);
                    }
                    // The commit ends here: its regions move, no copy on this path.
                    let regions = (c.primaries.values_mut().next())
                        .map(|ws| std::mem::take(&mut ws.regions))
                        .unwrap_or_default();
                    let tickets = std::mem::take(tickets);
                    let unacked = Unacked {
                        txn: c.txn,
                        regions,
                        tickets,
                    };
                    self.coord.unacked.insert(local, unacked);
                    let small = RingWriter::reservation(framed_len(header_bytes()));
                    for (p, left) in std::mem::take(&mut c.reserved) {
                        assert!(
                            left == small,
                            "commit of {} left {left} bytes reserved at {p}",
                            c.txn
                        );
                        self.coord.trunc_reserved[p.0 as usize] += small;
                    }
                    self.coordinator_background(now);
                    return Some(Ok(()));
                }
            }
        }
    }

    /// Whether this machine installed a view this worker has not picked up yet. Acks are
    /// counted only when it has not, after reading them: the control thread may install a
    /// view, acknowledge it and let a primary drain it between this worker's refresh and the
    /// count, and an ack of a record that primary then rejected must not count for a
    /// transaction the new view makes recovering (§5.3 step 3). The next poll refreshes first.
    fn view_moved(&self) -> bool {
        self.machine.view_generation() != self.view_generation
    }

    /// §5.3 step 3 for transactions that committed here (the application was told) and wait
    /// for COMMIT-PRIMARY acks: one that the new view makes recovering is decided by
    /// recovery, and the acks of the old configuration are ignored. Counting them, the
    /// transaction was truncated once the last one came: but a primary that drained the new
    /// configuration before the record landed rejects it, so that primary voted its LOCK,
    /// another replica voted truncated, and recovery aborted a committed transaction (the
    /// paused machines' seed 242268). It holds truncation back until the decision.
    pub(crate) fn unacked_now_recovering(&mut self) {
        let view = self.view.clone();
        let now_recovering: Vec<u64> = (self.coord.unacked.iter())
            .filter(|(_, u)| view.is_recovering(u.txn, &u.regions))
            .map(|(l, _)| *l)
            .collect();
        for l in now_recovering {
            let u = self.coord.unacked.remove(&l).expect("listed");
            self.coord.recovering.insert(l);
            self.coord.committed_recovering.insert(u.txn);
            self.await_recovery(u.txn, u.regions);
        }
    }

    /// Checks a commit against a new view (§5.3 step 3). A transaction is recovering when it
    /// started committing in an earlier configuration and a replica of a region it wrote or its
    /// coordinator changed; replicas find the same from their records. Before COMMIT-BACKUP
    /// went out it cannot commit, so it ends at once and `txn()` retries (recovery releases its
    /// locks); after, recovery decides and the acks of the old configuration are ignored. A
    /// transaction whose read region changed primary aborts if it is still validating.
    fn check_view(&mut self, c: &mut Commit) -> Option<Result<(), TxError>> {
        let view = self.view.clone();
        let written: Vec<RegionId> = c
            .primaries
            .values()
            .next()
            .map(|ws| ws.regions.clone())
            .unwrap_or_default();
        let recovering = view.is_recovering(c.txn, &written);
        let read: Vec<RegionId> = c
            .state
            .objects
            .iter()
            .filter(|(_, e)| !e.written)
            .map(|(a, _)| a.region)
            .collect();
        // The paper's condition with the read regions: recovering for the coordinator only.
        let read_moved = !recovering
            && farm_recovery::vote::is_recovering(c.txn, &[], &read, &view.config, &view.changes);
        // A slot handed out by a primary that has been replaced since: the new primary's
        // allocator recovery counts it free, so this transaction must not commit it.
        let stale_slot = c.state.objects.iter().any(|(a, e)| {
            e.fresh
                .is_some_and(|(_, handed)| primary_changed_since(&view, a.region, handed))
        });
        let blocked = written.iter().copied().find(|r| self.region_blocked(*r));
        // The coordinator picked up a newer view since the execution (between its last read
        // and the commit, or while an allocation polled the worker): the identifier took the
        // newer configuration, so `read_moved` cannot see that the reads came from an older
        // one, whose primaries may have been replaced by backups that have not applied a
        // committed write yet (§5.3 step 1).
        let reads_older = c.state.generation != self.view_generation;
        match &c.phase {
            Phase::Reserve => {
                if !recovering && !read_moved && !stale_slot && !reads_older && blocked.is_none() {
                    return None;
                }
                self.return_reservations(c);
                Some(Err(match blocked {
                    Some(r) => TxError::RegionBlocked(r),
                    None => TxError::ConfigurationChanged,
                }))
            }
            Phase::Lock { .. } | Phase::Validate { .. } => {
                if recovering {
                    self.return_reservations(c);
                    leave_slots_to_recovery(&mut c.state);
                    Some(Err(TxError::ConfigurationChanged))
                } else if read_moved {
                    self.abort_at_primaries(c);
                    Some(Err(TxError::ConfigurationChanged))
                } else {
                    None
                }
            }
            Phase::Backup { .. } | Phase::Primary { .. } => {
                if !recovering {
                    return None;
                }
                self.return_reservations(c);
                leave_slots_to_recovery(&mut c.state);
                self.coord.recovering.insert(c.txn.local);
                self.await_recovery(c.txn, written);
                c.phase = Phase::Recovering;
                None
            }
            Phase::Recovering => None,
        }
    }

    /// Gives back every log reservation a commit still holds.
    fn return_reservations(&mut self, c: &mut Commit) {
        for (m, left) in std::mem::take(&mut c.reserved) {
            self.outbound[m.0 as usize].log.unreserve(left);
        }
    }

    /// §4 step 2: validate objects read but not written, by one-sided header reads or, above the
    /// threshold of read objects at one primary, by VALIDATE messages.
    fn start_validation(&mut self, c: &mut Commit) -> Phase {
        let mut by_primary: BTreeMap<MachineId, Vec<(Addr, Header)>> = BTreeMap::new();
        for (addr, e) in c.state.objects.iter().filter(|(_, e)| !e.written) {
            let p = self.view.map.get(addr.region).expect("read before").primary;
            by_primary.entry(p).or_default().push((*addr, e.read));
        }
        let mut awaiting = BTreeSet::new();
        let mut failed = false;
        // Remote header reads are posted, all before any is awaited, and the commit waits
        // for them as for VALIDATE replies (handlers never block), where the fabric posts
        // reads.
        let mut posted: Vec<(Header, Box<dyn PostedRead>)> = Vec::new();
        for (p, reads) in by_primary {
            if p != self.machine.id && reads.len() > self.machine.params.validate_rpc_threshold {
                self.send_message(p, &Message::Validate { txn: c.txn, reads });
                self.stats.validate_rpcs += 1;
                awaiting.insert(p);
                continue;
            }
            for (addr, seen) in reads {
                let now = if p == self.machine.id {
                    let mem = self.view.region(addr.region).expect("primary");
                    object::read_header(&**mem, addr.offset as u64).ok()
                } else {
                    let Ok(r) = self.remote(addr.region) else {
                        failed = true;
                        continue;
                    };
                    match r.post_object_read(addr.offset as u64, HEADER_BYTES) {
                        Some(read) => {
                            self.stats.validation_reads_posted += 1;
                            posted.push((seen, read));
                            continue;
                        }
                        None => object::read_header(&*r, addr.offset as u64).ok(),
                    }
                };
                if now != Some(seen) {
                    failed = true;
                }
            }
        }
        Phase::Validate {
            awaiting,
            failed,
            reads: posted,
        }
    }

    /// Reserves log space at every participant for the whole commit (§4, log reservations):
    /// LOCK, COMMIT-PRIMARY and ABORT at primaries, COMMIT-BACKUP at backups, and one explicit
    /// TRUNCATE at each. All or nothing; false when some log lacks space (retry later).
    fn reserve(&mut self, c: &mut Commit) -> Result<bool, TxError> {
        let small = RingWriter::reservation(framed_len(header_bytes()));
        let mut need: BTreeMap<MachineId, usize> = BTreeMap::new();
        for (sets, extra) in [(&c.primaries, 2 * small), (&c.backups, 0)] {
            for (m, ws) in sets {
                let bytes = header_bytes()
                    + write_set_bytes(ws.regions.len(), ws.writes.iter().map(|w| w.data.len()));
                if bytes > RECORD_BYTES_MAX {
                    return Err(TxError::TooLarge {
                        machine: *m,
                        bytes,
                        max: RECORD_BYTES_MAX,
                    });
                }
                *need.entry(*m).or_default() += RingWriter::reservation(framed_len(bytes)) + extra;
            }
        }
        let mut done: Vec<(MachineId, usize)> = Vec::new();
        for (m, bytes) in &need {
            self.refresh_head(*m, RingKind::Log);
            if self.outbound[m.0 as usize].log.reserve(bytes + small) {
                done.push((*m, *bytes));
            } else {
                for (m, b) in done {
                    self.outbound[m.0 as usize].log.unreserve(b + small);
                }
                self.stats.reserve_waits += 1;
                return Ok(false);
            }
        }
        for (m, bytes) in done {
            // The TRUNCATE unit stays with the commit until it succeeds, then moves to
            // `trunc_reserved` together with the transaction's entry in `outstanding`.
            c.reserved.insert(m, bytes + small);
        }
        Ok(true)
    }

    fn unreserve(&mut self, c: &mut Commit, m: MachineId, bytes: usize) {
        let left = c.reserved.get_mut(&m).expect("reserved at participant");
        *left -= bytes;
        self.outbound[m.0 as usize].log.unreserve(bytes);
    }

    /// The thread's truncation bound: the low bound of its non-truncated transactions, at or
    /// below every unacked one and the oldest that may have sent records and is not decided
    /// (a commit in flight, `active`, or one recovery decides).
    fn truncation_bound(&self, active: Option<u64>) -> u64 {
        let open = self
            .coord
            .holding
            .first()
            .copied()
            .into_iter()
            .chain(active)
            .chain(self.coord.recovering.first().copied())
            .min();
        self.coord
            .unacked
            .keys()
            .next()
            .copied()
            .into_iter()
            .chain(open)
            .min()
            .unwrap_or(self.coord.next_local + 1)
    }

    /// Whether a TRUNCATE to participant `p` now would truncate anything, the thread's
    /// truncation bound being `below`: an outstanding id below it. Only then is one of the
    /// participant's TRUNCATE reservations spent on it: one that freed nothing would leave
    /// transactions to truncate without room for the record that truncates them (invariant
    /// 6).
    fn truncation_frees(&self, p: usize, below: u64) -> bool {
        self.coord.outstanding[p].range(..below).next().is_some()
    }

    /// The piggybacked truncation state for a record to `dst`: the low bound of this thread's
    /// non-truncated transactions. `active` is the commit being advanced (taken out of the
    /// map), if it may have sent records.
    ///
    /// The bound stays at or below every commit in flight that may have sent records
    /// (`Commit::holds_truncation`), every committed one still waiting for COMMIT-PRIMARY
    /// acks, and every transaction recovery decides; nothing above it is truncated by explicit
    /// id. A participant keeps only the bound across a restart (in NVRAM), so a transaction
    /// truncated by id above it was voted unknown after a power loss at a replica promoted
    /// since, which had dropped its records, and aborted by a recovery that another replica's
    /// COMMIT-BACKUP started (§5.3), though it committed: replicas then differed (power-loss
    /// seed 1719 with an open commit below it; varied-shapes seed 470301 with a commit waiting
    /// for its COMMIT-PRIMARY acks below it, the last case ids were passed in).
    fn piggyback(&mut self, dst: MachineId, active: Option<u64>) -> u64 {
        let below = self.truncation_bound(active);
        let out = &mut self.coord.outstanding[dst.0 as usize];
        *out = out.split_off(&below);
        if out.is_empty() {
            let units = std::mem::take(&mut self.coord.trunc_reserved[dst.0 as usize]);
            self.outbound[dst.0 as usize].log.unreserve(units);
        }
        below
    }

    /// Encodes and appends a log record for `c` to `dst`, using its reservation.
    fn send_log(
        &mut self,
        c: &mut Commit,
        dst: MachineId,
        body: &LogBody,
    ) -> Result<Option<WriteTicket>, TxError> {
        // The active commit is `c`, held outside `coord` while it advances: count it.
        let below = self.piggyback(dst, Some(c.txn.local));
        let reservation = RingWriter::reservation(framed_len(match body {
            LogBody::Lock(ws) | LogBody::CommitBackup(ws) => {
                header_bytes()
                    + write_set_bytes(ws.regions.len(), ws.writes.iter().map(|w| w.data.len()))
            }
            _ => header_bytes(),
        }));
        *c.reserved.get_mut(&dst).expect("reserved before sending") -= reservation;
        let txn = c.txn;
        let encode = |out: &mut Vec<u8>| {
            let at = out.len();
            LogRecord::encode_parts(txn, below, &[], body, out);
            assert!(out.len() - at <= RECORD_BYTES_MAX);
        };
        match self.append_record(dst, RingKind::Log, reservation, encode)? {
            Some(ticket) => Ok(ticket),
            None => panic!("log to {dst} full despite a reservation for {}", c.txn),
        }
    }

    /// ABORT to every primary of the transaction (all got a LOCK).
    fn abort_at_primaries(&mut self, c: &mut Commit) {
        let all: BTreeSet<MachineId> = c.primaries.keys().copied().collect();
        self.abort(c, &all);
    }

    /// ABORT to `primaries` (those that got a LOCK); everything else reserved is returned.
    fn abort(&mut self, c: &mut Commit, primaries: &BTreeSet<MachineId>) {
        // §4: once a COMMIT-BACKUP may be out, only recovery may abort (§5.3).
        assert!(
            matches!(
                c.phase,
                Phase::Reserve | Phase::Lock { .. } | Phase::Validate { .. }
            ),
            "{} aborted by its coordinator after COMMIT-BACKUP could be out",
            c.txn
        );
        assert!(
            primaries.iter().all(|p| c.primaries.contains_key(p)),
            "{}: ABORT to a machine that is not its primary",
            c.txn
        );
        for p in primaries {
            let _ = self.send_log(c, *p, &LogBody::Abort);
            // The primary frees the slots this transaction allocated there once it has
            // unlocked them; a RELEASE could overtake the ABORT.
            for w in &c.primaries[p].writes {
                if let Some(e) = c.state.objects.get_mut(&w.addr) {
                    e.fresh = None;
                }
            }
        }
        if primaries.contains(&self.machine.id) {
            let me = self.machine.id;
            self.poll_log(me);
        }
        // Unused reservations, this transaction's TRUNCATE unit included, go back.
        for (m, left) in std::mem::take(&mut c.reserved) {
            self.outbound[m.0 as usize].log.unreserve(left);
        }
    }

    /// Checks the coordinator's state (see `Worker::invariants`).
    pub(crate) fn coordinator_invariants(&self) {
        let peers = self.machine.params.layout.machines_max as usize;
        let coord = &self.coord;
        assert_eq!(
            coord.outstanding.len(),
            peers,
            "outstanding per participant"
        );
        assert_eq!(
            coord.trunc_reserved.len(),
            peers,
            "TRUNCATE reservations per participant"
        );
        // A committed transaction recovery decides holds truncation back and no longer waits
        // for acks.
        for t in &coord.committed_recovering {
            assert!(
                coord.recovering.contains(&t.local) && !coord.unacked.contains_key(&t.local),
                "{t} committed and recovering, but not holding truncation back or still unacked"
            );
        }
        // Transaction ids are handed out in order: nothing acked, outstanding or recovering
        // can be newer than the last one.
        let issued = |l: &u64| *l <= coord.next_local;
        assert!(
            coord.unacked.keys().all(issued),
            "an unacked id never issued"
        );
        assert!(
            coord.recovering.iter().all(issued),
            "a recovering id never issued"
        );
        for (p, ids) in coord.outstanding.iter().enumerate() {
            assert!(
                ids.iter().all(issued),
                "an id outstanding at m{p} never issued"
            );
            // Invariant 6: a participant with transactions to truncate has room for one
            // explicit TRUNCATE.
            assert!(
                ids.is_empty() || coord.trunc_reserved[p] > 0,
                "m{p} has transactions to truncate and no TRUNCATE reserved"
            );
        }
        let holding: BTreeSet<u64> = (coord.active.values())
            .filter(|c| c.holds_truncation())
            .map(|c| c.txn.local)
            .collect();
        assert_eq!(
            holding, coord.holding,
            "the commits that hold truncation back, listed and counted"
        );
        for (handle, c) in &coord.active {
            assert_eq!(*handle, c.handle, "a commit filed under another handle");
            assert!(
                c.txn.machine == self.machine.id && c.txn.thread == self.thread,
                "{} committed by {}'s thread {}",
                c.txn,
                self.machine.id,
                self.thread.0
            );
            assert!(issued(&c.txn.local), "{} never issued", c.txn);
        }
    }

    /// Background work of the coordinator: collect COMMIT-PRIMARY acks and truncate lazily,
    /// explicitly when idle for [`crate::Params::truncate_delay_ticks`] or when too much is
    /// pending.
    pub(crate) fn coordinator_background(&mut self, now: u64) -> bool {
        let mut busy = false;
        let acked: Vec<u64> = self
            .coord
            .unacked
            .iter()
            .filter(|(_, u)| {
                // A failed write went to a primary that has left the configuration since:
                // recovery settles that region. One to a member waits (`write_settled`).
                u.tickets.iter().all(|(p, t)| self.write_settled(*p, *t))
            })
            .map(|(l, _)| *l)
            .collect();
        if !self.view_moved() {
            for l in acked {
                self.coord.unacked.remove(&l);
                busy = true;
            }
        }
        // Committed transactions recovery decided: it preserves their outcome (§5.3,
        // Correctness), and they no longer hold truncation back.
        let decided: Vec<TxnId> = (self.coord.committed_recovering.iter())
            .filter(|t| self.recovery.decided.contains_key(t))
            .copied()
            .collect();
        for t in decided {
            let d = self.recovery.decided.remove(&t).expect("listed");
            assert_eq!(
                d,
                crate::recovery::Decision::Commit,
                "{t} was reported committed and recovery aborted it"
            );
            self.coord.committed_recovering.remove(&t);
            self.coord.recovering.remove(&t.local);
            busy = true;
        }
        // Not while commits are in flight (their records carry the bound; a commit that waits
        // for log space truncates explicitly itself): truncating explicitly under load shifted
        // the simulator's schedules into liveness holes not yet fixed (allocation seed 907,
        // paused seed 6294; issue 23 notes).
        if !self.coord.active.is_empty() {
            return busy;
        }
        let bound = self.truncation_bound(None);
        let truncatable =
            (0..self.coord.outstanding.len()).any(|p| self.truncation_frees(p, bound));
        if !truncatable {
            self.coord.truncatable_since = None;
            return busy;
        }
        let since = *self.coord.truncatable_since.get_or_insert(now);
        let pending: usize = self.coord.outstanding.iter().map(BTreeSet::len).sum();
        let delay = self.machine.params.truncate_delay_ticks();
        if now.saturating_sub(since) < delay && pending < OUTSTANDING_MAX {
            return busy;
        }
        self.flush_truncations();
        self.coord.truncatable_since = None;
        true
    }

    /// Sends an explicit TRUNCATE to every participant a TRUNCATE would truncate anything at.
    /// Commits in flight hold the bound back as their records do; a commit waiting for log
    /// space does this itself.
    pub fn flush_truncations(&mut self) {
        self.send_truncations(None);
    }

    /// Explicit TRUNCATE records, using the reservations made for them; `active` is the local
    /// id of a commit that has not sent anything yet, so the low bound stays at or below it.
    fn send_truncations(&mut self, active: Option<u64>) {
        for p in 0..self.coord.outstanding.len() {
            let dst = MachineId(p as u16);
            // The bounds again for each participant: sending to this machine itself polls
            // its log.
            if !self.truncation_frees(p, self.truncation_bound(active)) {
                continue;
            }
            let small = RingWriter::reservation(framed_len(header_bytes()));
            assert!(
                self.coord.trunc_reserved[p] >= small,
                "no TRUNCATE reservation at {dst}"
            );
            self.coord.trunc_reserved[p] -= small;
            let below = self.piggyback(dst, active);
            let txn = TxnId {
                local: self.coord.next_local,
                ..self.txn_template()
            };
            let rec = LogRecord {
                txn,
                truncate_below: below,
                truncated: Vec::new(),
                body: LogBody::Truncate,
            };
            match self.append_record(dst, RingKind::Log, small, |out| rec.encode(out)) {
                Ok(Some(_)) => self.stats.truncates_sent += 1,
                Ok(None) => panic!("log to {dst} full despite a TRUNCATE reservation"),
                Err(_) => {} // Dead participant: recovery's business.
            }
            if dst == self.machine.id {
                self.poll_log(dst);
            }
        }
    }

    fn txn_template(&self) -> TxnId {
        TxnId {
            config: self.view.config.id,
            machine: self.machine.id,
            thread: self.thread,
            local: 0,
        }
    }

    /// Whether this coordinator has nothing in flight and nothing left to truncate.
    pub fn coordinator_quiet(&self) -> bool {
        self.coord.active.is_empty()
            && self.coord.unacked.is_empty()
            && self.coord.outstanding.iter().all(BTreeSet::is_empty)
    }
}
