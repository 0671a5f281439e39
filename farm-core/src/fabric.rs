//! The fabric: what RDMA gives, on hardware that has none (docs/ARCHITECTURE.md, Fabric).
//!
//! Protocols talk to other machines only through [`Fabric`]:
//! - one-sided reads of registered memory ([`Fabric::remote`] resolves a handle once, as FaRM
//!   threads cache RDMA references, §3);
//! - one-sided writes that complete asynchronously; completion is the "hardware ack": the bytes
//!   are in the target's memory. Writes from one endpoint to one target land in order, and one
//!   write lands in increasing address order, so a crash can leave any prefix;
//! - unreliable datagrams, for leases.
//!
//! A dead or unreachable target makes operations fail, never hang.
//!
//! Posting in batches: a thread that runs many transactions at once opens a [`Batch`], and
//! while it is open a fabric may hold back what the thread posts ([`hold`]) until the thread
//! [`flush`]es at the end of its turn, so that everything the turn produced goes to each peer
//! in one send (one `write` per peer over `tcp`, one doorbell over `shm`), as RDMA posts a list
//! of work requests with one doorbell. Holding back changes no guarantee above: order per
//! target is kept, and a thread about to wait for an answer flushes first, and again each
//! round of a wait that polls its workers (what they post meanwhile may be what the peer it
//! waits for needs). A batch's turn also polls each source of completions once: a fabric that
//! found a connection's answers empty notes it ([`note_polled_empty`]) and does not look again
//! before the turn's flush ([`polled_empty`]), however many of the turn's requests are checked
//! on.

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::ids::{MachineId, RegionId, ThreadId};
use crate::nvram::Nvram;
use crate::object::{self, ReadOutcome};

/// First byte of a control datagram (the CM's NEW-CONFIG and the rest, `farm_cm::control`),
/// which no lease datagram starts with: fabrics hand control datagrams to their own reader
/// ([`Fabric::recv_control`]) and tell the two apart by it.
pub const CONTROL_TAG: u8 = 0xc7;

/// A registered memory area of a machine (an RDMA memory region).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum MemKey {
    /// A region replica stored at the machine.
    Region(RegionId),
    /// The machine's inbound transaction logs and message queues.
    Rings,
    /// Truncation feedback slots: receivers tell this machine, as a sender, how far they freed.
    Feedback,
    /// The regions whose replica the machine holds complete, which a reconfiguration's probe
    /// reads (§5.2 step 2): only a complete replica may be promoted.
    Replicas,
}

/// The sending side of a queue pair: one per (machine, thread).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Endpoint {
    /// Sending machine.
    pub machine: MachineId,
    /// Sending thread.
    pub thread: ThreadId,
}

/// Sequence number of a posted write on its (endpoint, target) link.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct WriteTicket(pub u64);

/// Where a posted write stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum WriteStatus {
    /// Not acknowledged yet.
    Pending,
    /// Acknowledged: the bytes are in the target's memory.
    Done,
    /// The target or the sender died first, and the write may have landed partly or not at
    /// all; or the target removed the sender (or the sender the target) first, and it never
    /// lands.
    Failed,
}

/// Why a fabric operation failed.
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
pub enum FabricError {
    /// The target machine does not answer (dead, or partitioned away).
    #[error("machine {0} is unreachable")]
    Unreachable(MachineId),
    /// The sending machine's own NIC is down (the machine was killed).
    #[error("machine {0} is down and cannot send")]
    SenderDown(MachineId),
    /// The target has no such registered memory.
    #[error("machine {machine} has no registered memory {key:?}")]
    NotRegistered {
        /// Target machine.
        machine: MachineId,
        /// Missing area.
        key: MemKey,
    },
    /// The access falls outside the registered area.
    #[error("access {offset}+{len} outside {key:?} ({size} bytes) at machine {machine}")]
    OutOfBounds {
        /// Target machine.
        machine: MachineId,
        /// Target area.
        key: MemKey,
        /// Start of the access.
        offset: u64,
        /// Length of the access.
        len: usize,
        /// Size of the area.
        size: usize,
    },
}

/// A resolved one-sided read handle to one registered area of one machine.
pub trait RemoteMemory: Send + Sync + fmt::Debug {
    /// One-sided read of `buf.len()` bytes at `offset` (word aligned).
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), FabricError>;
    /// The machine this handle reads from.
    fn machine(&self) -> MachineId;
    /// A hint that `len` bytes at `offset` will be read soon: a fabric may start fetching them
    /// so that several reads overlap (as an RDMA client posts reads before polling for any).
    /// Never fails and changes nothing a read returns.
    fn prefetch(&self, _offset: u64, _len: usize) {}

    /// A consistent read of the object at `offset` into `buf` (header, then payload) as ONE
    /// one-sided operation, its torn-read check included (docs/ARCHITECTURE.md, Objects): the
    /// copy is judged by [`object::judge_copy`] against the header word read again after it.
    /// Where a read is a copy out of mapped memory (`mem`, `shm`) the two reads of
    /// [`object::read_object`] cost no round trip, and that is the default; a backend whose
    /// reads cross a network (`tcp`) has its NIC read the header again after the copy and
    /// return it with the bytes, so one round trip reads an object.
    fn read_object(&self, offset: u64, buf: &mut [u8]) -> Result<ReadOutcome, FabricError> {
        object::read_object(&Bytes(self), offset, buf)
    }

    /// Posts [`RemoteMemory::read_object`] of `len` bytes (header included) at `offset` without
    /// waiting for it, as an RDMA client posts reads before polling for any: the transaction
    /// that knows several addresses ahead overlaps their round trips
    /// ([`PostedRead::complete`] waits for one). `None` where posting buys nothing (a read of
    /// mapped memory); such backends start the copy's cache misses instead
    /// ([`RemoteMemory::prefetch`]). The object may change after the read lands, as it may
    /// after any read: the posted copy is as old as its completion, and the transaction that
    /// reads through it validates it at commit as every read (§4).
    fn post_object_read(&self, offset: u64, len: usize) -> Option<Box<dyn PostedRead>> {
        self.prefetch(offset, len);
        None
    }
}

/// An object read posted with [`RemoteMemory::post_object_read`].
pub trait PostedRead: Send + fmt::Debug {
    /// Whether the read completed (its answer, or its failure, is here): a state machine that
    /// must not block polls this, and calls [`PostedRead::complete`] once it holds.
    fn is_done(&self) -> bool;

    /// Waits for the read and judges it as [`RemoteMemory::read_object`] does; `buf.len()` is
    /// the length posted. Fails as a read does (an unreachable target, an access outside the
    /// registered area), after the fabric's timeout at most.
    fn complete(self: Box<Self>, buf: &mut [u8]) -> Result<ReadOutcome, FabricError>;
}

/// The bytes of any remote memory, for [`object::read_object`].
struct Bytes<'a, R: ?Sized>(&'a R);

impl<R: RemoteMemory + ?Sized> object::ObjectSource for Bytes<'_, R> {
    type Error = FabricError;
    fn read_bytes(&self, offset: u64, buf: &mut [u8]) -> Result<(), FabricError> {
        self.0.read(offset, buf)
    }
}

impl object::ObjectSource for dyn RemoteMemory {
    type Error = FabricError;
    fn read_bytes(&self, offset: u64, buf: &mut [u8]) -> Result<(), FabricError> {
        self.read(offset, buf)
    }
}

/// What a fabric held back for a thread's open [`Batch`]: a link, or a doorbell, with posted
/// work not sent yet.
pub trait Held: Send + Sync {
    /// Sends what is held back.
    fn flush(&self);
}

thread_local! {
    /// What this thread's open batch holds back (`None`: no batch is open).
    static HELD: RefCell<Option<Vec<Arc<dyn Held>>>> = const { RefCell::new(None) };
    /// Sources of completions (by address) found empty since this thread's batch last flushed.
    static POLLED_EMPTY: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Whether this thread's open batch found `source` (a fabric's source of completions, by
/// address) empty since its last flush; never with no batch open.
pub fn polled_empty(source: *const ()) -> bool {
    POLLED_EMPTY.with(|p| p.borrow().contains(&(source as usize)))
}

/// Notes that `source` was found empty, for [`polled_empty`] until this thread's open batch
/// flushes (nothing with no batch open).
pub fn note_polled_empty(source: *const ()) {
    let open = HELD.with(|h| h.borrow().is_some());
    if open {
        POLLED_EMPTY.with(|p| p.borrow_mut().push(source as usize));
    }
}

/// A thread's batch of posted work, open until dropped (which flushes): see the module docs.
/// Opening one inside another changes nothing; the outer one stays open.
#[derive(Debug)]
pub struct Batch {
    outer: bool,
    /// A batch belongs to its thread.
    _thread: PhantomData<*const ()>,
}

impl Batch {
    /// Opens a batch on this thread.
    pub fn open() -> Self {
        let outer = HELD.with(|h| {
            let mut h = h.borrow_mut();
            let outer = h.is_none();
            if outer {
                *h = Some(Vec::new());
            }
            outer
        });
        Self {
            outer,
            _thread: PhantomData,
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if !self.outer {
            return;
        }
        if !std::thread::panicking() {
            flush();
        }
        HELD.with(|h| *h.borrow_mut() = None);
    }
}

/// Whether this thread has a batch open; if so, `held` is kept to be flushed with it, and the
/// caller holds its work back.
pub fn hold(held: &Arc<dyn Held>) -> bool {
    HELD.with(|h| match &mut *h.borrow_mut() {
        Some(list) => {
            let p = Arc::as_ptr(held) as *const ();
            if !list.iter().any(|x| Arc::as_ptr(x) as *const () == p) {
                list.push(held.clone());
            }
            true
        }
        None => false,
    })
}

/// Sends everything this thread's open batch holds back (nothing without one). The batch stays
/// open.
pub fn flush() {
    POLLED_EMPTY.with(|p| p.borrow_mut().clear());
    let held = HELD.with(|h| h.borrow_mut().as_mut().map(std::mem::take));
    let Some(mut held) = held else { return };
    for h in &held {
        h.flush();
    }
    held.clear();
    // Give the list back, with its capacity, unless flushing held back more.
    HELD.with(|h| {
        if let Some(list) = &mut *h.borrow_mut() {
            if list.is_empty() {
                *list = held;
            }
        }
    });
}

/// That `len` bytes at `offset` of `machine`'s area `key` (`mem`) are word-aligned and inside
/// it: what a NIC checks against a memory registration.
pub fn check_bounds(
    machine: MachineId,
    key: MemKey,
    mem: &Nvram,
    offset: u64,
    len: usize,
) -> Result<(), FabricError> {
    let in_bounds = offset.is_multiple_of(8)
        && offset
            .checked_add(len as u64)
            .is_some_and(|end| end <= mem.len() as u64);
    if in_bounds {
        Ok(())
    } else {
        Err(FabricError::OutOfBounds {
            machine,
            key,
            offset,
            len,
            size: mem.len(),
        })
    }
}

/// The RDMA-like network of the cluster. See the module docs for its guarantees.
pub trait Fabric: Send + Sync + fmt::Debug {
    /// Registers `mem` as `key` of `machine` so that peers can read and write it.
    fn register(&self, machine: MachineId, key: MemKey, mem: Arc<Nvram>);

    /// A handle for one-sided reads of `key` at `dst`, issued by `src`.
    fn remote(
        &self,
        src: MachineId,
        dst: MachineId,
        key: MemKey,
    ) -> Result<Arc<dyn RemoteMemory>, FabricError>;

    /// Posts a one-sided write of `data` to `offset` (word aligned) of `key` at `dst`. The returned
    /// ticket completes when the bytes are in the target's memory.
    fn write(
        &self,
        src: Endpoint,
        dst: MachineId,
        key: MemKey,
        offset: u64,
        data: &[u8],
    ) -> Result<WriteTicket, FabricError>;

    /// Where the write `ticket` from `src` to `dst` stands.
    fn write_status(&self, src: Endpoint, dst: MachineId, ticket: WriteTicket) -> WriteStatus;

    /// Sends an unreliable datagram; it may be lost or delayed, and sending never blocks.
    fn send_datagram(&self, src: MachineId, dst: MachineId, data: &[u8], now: u64);

    /// Takes one lease datagram for `dst` that is due at `now` into `buf`, returning its
    /// sender; control datagrams ([`CONTROL_TAG`]) are kept for [`Fabric::recv_control`].
    fn recv_datagram(&self, dst: MachineId, now: u64, buf: &mut Vec<u8>) -> Option<MachineId>;

    /// Takes one control datagram ([`CONTROL_TAG`]: the control plane's NEW-CONFIG and the
    /// rest) for `dst` that is due at `now` into `buf`, returning its sender; lease datagrams
    /// are kept for [`Fabric::recv_datagram`]. A fabric of one machine per process answers for
    /// its own machine only.
    fn recv_control(&self, dst: MachineId, now: u64, buf: &mut Vec<u8>) -> Option<MachineId>;

    /// Precise membership at the target (§5.2): from now on `machine` takes one-sided writes
    /// only from `members` (itself included); a write from anyone else, or one still in flight
    /// from a machine removed since, fails without landing, as a NIC does once the queue pairs
    /// of removed machines are torn down. Reads are not affected (the CM probes, new backups
    /// copy). Fabrics that cannot fence leave it to the receivers, which ignore non-members.
    fn admit(&self, machine: MachineId, members: &[MachineId]) {
        let _ = (machine, members);
    }

    /// Whether `machine` is up. A crashed process takes its threads with it, so a machine's
    /// own code always sees itself up; fabrics that stop a machine while its threads go on
    /// (the in-process `mem` fabric's kill) say so here, and waits on others end.
    fn is_up(&self, machine: MachineId) -> bool {
        let _ = machine;
        true
    }

    /// Members of `machine`'s configuration (those it admits) that it cannot write to
    /// although they may live: a write to one did not get through while both were up (a
    /// connection that broke, a partition), and no later write may land beyond the hole it
    /// left in a ring. Either the link stays broken while the peer is a member (`tcp`: later
    /// writes fail) or its writes stall until the link is repaired in place, landing in the
    /// order posted (`mem`). The machine's control plane reports them
    /// (`ControlPlane::on_unreachable`) while so, and the configuration removes one end if it
    /// can; a peer admitted again is a new incarnation whose rings start afresh. A fabric of
    /// one machine per process answers for its own machine only. None by default.
    fn broken_members(&self, machine: MachineId) -> Vec<MachineId> {
        let _ = machine;
        Vec::new()
    }

    /// The one-sided operations `machine` posted to each peer since the fabric started, and
    /// their bytes ([`Traffic`]); a fabric of one machine per process answers for its own
    /// machine only. Peers it never posted to may be left out. None by default.
    fn traffic(&self, machine: MachineId) -> Vec<(MachineId, Traffic)> {
        let _ = machine;
        Vec::new()
    }
}

/// One-sided operations one machine posted to a peer, and their bytes (what
/// [`Fabric::traffic`] reports): reads of any kind (object reads, header reads, data recovery's
/// copies) and writes (log records, messages, allocations' headers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// One-sided reads.
    pub reads: u64,
    /// Bytes those reads asked for.
    pub read_bytes: u64,
    /// One-sided writes.
    pub writes: u64,
    /// Bytes those writes carried.
    pub write_bytes: u64,
}

impl Traffic {
    /// Both counts summed.
    pub fn add(&mut self, other: &Traffic) {
        self.reads += other.reads;
        self.read_bytes += other.read_bytes;
        self.writes += other.writes;
        self.write_bytes += other.write_bytes;
    }
}

/// The counters behind [`Traffic`], kept by a fabric per peer (relaxed: they order nothing).
#[derive(Debug, Default)]
pub struct TrafficCounters {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
}

impl TrafficCounters {
    /// Counts a read of `bytes`.
    pub fn read(&self, bytes: usize) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.read_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts a write of `bytes`.
    pub fn write(&self, bytes: usize) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.write_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// What was counted so far.
    pub fn get(&self) -> Traffic {
        Traffic {
            reads: self.reads.load(Ordering::Relaxed),
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_found_empty_is_skipped_until_the_turn_flushes_and_only_in_a_batch() {
        let source = 0x40 as *const ();
        note_polled_empty(source);
        assert!(!polled_empty(source), "noted with no batch open");
        let batch = Batch::open();
        assert!(!polled_empty(source));
        note_polled_empty(source);
        assert!(polled_empty(source));
        assert!(!polled_empty(0x80 as *const ()), "another source");
        flush();
        assert!(!polled_empty(source), "a new turn polls it again");
        note_polled_empty(source);
        drop(batch);
        assert!(!polled_empty(source), "the batch closed");
    }
}
