//! The `mem` fabric backend: machines live in one process and "remote" memory is the other
//! machine's mapped NVRAM (docs/ARCHITECTURE.md, Fabric).
//!
//! Besides the normal path (writes land and complete at once), it gives a driver the failures a
//! real network has:
//! - [`MemFabric::kill`]: a machine's NIC stops (operations from and to it fail), its memory is
//!   kept, as NVRAM is;
//! - datagram loss and delay by a seeded policy;
//! - held writes: with [`MemFabric::set_hold_writes`], writes queue on their link until the driver
//!   delivers them one by one ([`MemFabric::deliver_next`]), and a crash of the sender can land
//!   any prefix of them ([`MemFabric::crash`]), the last one possibly cut at any byte (none of
//!   those stalled behind a break, below);
//! - held reads: with [`MemFabric::set_hold_reads`], posted object reads
//!   ([`RemoteMemory::post_object_read`]) wait until the driver performs them
//!   ([`MemFabric::complete_read`]), in any order, or until their poster waits for one (then it
//!   is performed at once). Without it, posting buys nothing in one process and reads are not
//!   posted;
//! - partitions ([`MemFabric::partition`]) and cuts between two machines' memory
//!   ([`MemFabric::cut_memory`]): reads across the cut fail, and a write across it breaks the
//!   links of its (writer, target) machine pair, every thread's, as a connection breaks: the
//!   pair's writes stall, in order per link, without landing, and the writer reports the
//!   target ([`Fabric::broken_members`]). When the cut heals, the links are repaired in place:
//!   their stalled writes land in the order they were posted, as a reconnected link that
//!   resends from the last write the target took does, so that no later log write lands
//!   beyond a hole an earlier one left. Either end removing or admitting again the other, or
//!   a kill of either, ends the incarnations the stalled writes were for: they fail without
//!   landing; and a write across a cut to a machine the writer does not admit fails at once
//!   (no link between members to keep in order: a new connection would fail).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use farm_core::fabric::{
    Endpoint, Fabric, FabricError, MemKey, PostedRead, RemoteMemory, Traffic, TrafficCounters,
    WriteStatus, WriteTicket, CONTROL_TAG,
};
use farm_core::ids::{MachineId, ThreadId};
use farm_core::nvram::Nvram;
use farm_core::object::{judge_copy, ReadOutcome, HEADER_BYTES};
use farm_core::rng::Rng;

/// Limits of a [`MemFabric`].
#[derive(Clone, Copy, Debug)]
pub struct MemFabricConfig {
    /// Machines ids are `0..machines_max`.
    pub machines_max: u16,
    /// Thread ids are `0..threads_max`.
    pub threads_max: u16,
    /// Seed of the datagram loss and delay choices.
    pub seed: u64,
    /// Datagrams queued per target before new ones are dropped.
    pub datagrams_queued_max: usize,
}

/// Datagram loss and delay.
#[derive(Clone, Copy, Debug, Default)]
pub struct DatagramPolicy {
    /// Probability of loss, per million datagrams.
    pub drop_per_million: u32,
    /// Each datagram is delayed by a uniform number of ticks in `0..=delay_ticks_max`.
    pub delay_ticks_max: u64,
}

#[derive(Debug)]
struct Machine {
    alive: Arc<AtomicBool>,
    /// Machines whose writes land here, a bit per machine (every bit set until the first
    /// `admit`): one atomic load on the write path.
    admitted: Box<[AtomicU64]>,
    areas: RwLock<BTreeMap<MemKey, Arc<Nvram>>>,
    /// Lease datagrams, and control datagrams ([`CONTROL_TAG`]) apart: each has its reader.
    datagrams: Mutex<VecDeque<Datagram>>,
    control: Mutex<VecDeque<Datagram>>,
}

#[derive(Debug)]
struct Datagram {
    src: MachineId,
    due: u64,
    data: Vec<u8>,
}

#[derive(Debug)]
struct HeldWrite {
    seq: u64,
    mem: Arc<Nvram>,
    offset: u64,
    data: Vec<u8>,
}

#[derive(Debug, Default)]
struct Link {
    issued: AtomicU64,
    /// Writes posted on the link, and their bytes.
    traffic: TrafficCounters,
    landed: AtomicU64,
    /// Whether `failed` names any write: checked before its lock.
    any_failed: AtomicBool,
    /// Ranges `(after, through]` of sequence numbers of writes that failed without landing.
    /// Later writes on the link are judged on their own: landing is counted by `landed`, a
    /// high-water mark, which a failed write must not hide under.
    failed: Mutex<Vec<(u64, u64)>>,
    held: Mutex<VecDeque<HeldWrite>>,
}

impl Link {
    /// Lands write `seq`: its bytes at `offset` of `mem`, then its completion.
    fn land(&self, seq: u64, mem: &Nvram, offset: u64, data: &[u8]) {
        mem.write(offset as usize, data);
        self.landed.store(seq, Ordering::SeqCst);
    }
}

/// The in-process fabric. See the module docs.
#[derive(Debug)]
pub struct MemFabric {
    config: MemFabricConfig,
    machines: Vec<Machine>,
    links: Vec<Link>,
    hold_writes: AtomicBool,
    reads: Arc<HeldReads>,
    /// Partition side of every machine: machines on different sides cannot reach each other.
    groups: Arc<[AtomicU32]>,
    /// Machine pairs whose one-sided operations fail while datagrams pass
    /// ([`MemFabric::cut_memory`]).
    memory_cuts: Arc<MemoryCuts>,
    /// Per (writer, target) machine pair: a write was posted across a cut while both were up,
    /// and the pair's writes stall until the cut heals ([`MemFabric::repair`]) or a membership
    /// change at either end fails them (see [`Fabric::broken_members`]). Set and cleared only
    /// under `stalls`.
    broken: Box<[AtomicBool]>,
    /// Serializes breaking, repairing and failing stalled links against writers that find their
    /// link broken, so that a write never lands ahead of a stalled one on its link.
    stalls: Mutex<()>,
    /// Per (reader, target) machine pair: the reads (writes are counted per link).
    reads_traffic: Box<[Arc<TrafficCounters>]>,
    policy: Mutex<(DatagramPolicy, Rng)>,
}

#[derive(Clone, Debug)]
struct MemRemote {
    /// Reads of `dst` by `src` (none counted when they are the same machine).
    traffic: Option<Arc<TrafficCounters>>,
    dst: MachineId,
    key: MemKey,
    mem: Arc<Nvram>,
    src_alive: Arc<AtomicBool>,
    dst_alive: Arc<AtomicBool>,
    groups: Arc<[AtomicU32]>,
    memory_cuts: Arc<MemoryCuts>,
    src: MachineId,
    reads: Arc<HeldReads>,
}

impl RemoteMemory for MemRemote {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), FabricError> {
        if !self.src_alive.load(Ordering::Relaxed) {
            return Err(FabricError::SenderDown(self.src));
        }
        if !self.dst_alive.load(Ordering::Relaxed)
            || !same_side(&self.groups, self.src, self.dst)
            || self.memory_cuts.cut(self.src, self.dst)
        {
            return Err(FabricError::Unreachable(self.dst));
        }
        farm_core::fabric::check_bounds(self.dst, self.key, &self.mem, offset, buf.len())?;
        self.mem.read(offset as usize, buf);
        if let Some(t) = &self.traffic {
            t.read(buf.len());
        }
        Ok(())
    }

    fn machine(&self) -> MachineId {
        self.dst
    }

    fn prefetch(&self, offset: u64, len: usize) {
        self.mem.prefetch(offset as usize, len);
    }

    fn post_object_read(&self, offset: u64, len: usize) -> Option<Box<dyn PostedRead>> {
        if !self.reads.hold.load(Ordering::SeqCst) {
            self.prefetch(offset, len);
            return None;
        }
        let read = Arc::new(HeldRead {
            remote: self.clone(),
            offset,
            len,
            result: Mutex::new(None),
        });
        self.reads
            .queue
            .lock()
            .expect("poisoned")
            .push_back(read.clone());
        Some(Box::new(MemPostedRead(read)))
    }
}

/// Posted object reads the driver has not performed yet.
#[derive(Debug, Default)]
struct HeldReads {
    hold: AtomicBool,
    queue: Mutex<VecDeque<Arc<HeldRead>>>,
}

/// An object read posted while reads are held: performed when the driver completes it, or
/// when its poster waits for it, whichever comes first.
#[derive(Debug)]
struct HeldRead {
    remote: MemRemote,
    offset: u64,
    len: usize,
    /// The copy and the header word read after it, or the failure.
    result: Mutex<Option<Result<Vec<u8>, FabricError>>>,
}

impl HeldRead {
    /// Performs the read now, if it was not performed yet.
    fn perform(&self) {
        let mut result = self.result.lock().expect("poisoned");
        if result.is_some() {
            return;
        }
        let mut bytes = vec![0u8; self.len + HEADER_BYTES];
        let (copy, again) = bytes.split_at_mut(self.len);
        let read = self.remote.read(self.offset, copy).and_then(|()| {
            // The seqlock's second load, after the copy.
            std::sync::atomic::fence(Ordering::Acquire);
            self.remote.read(self.offset, again)
        });
        *result = Some(read.map(|()| bytes));
    }
}

#[derive(Debug)]
struct MemPostedRead(Arc<HeldRead>);

impl PostedRead for MemPostedRead {
    fn is_done(&self) -> bool {
        self.0.result.lock().expect("poisoned").is_some()
    }

    fn complete(self: Box<Self>, buf: &mut [u8]) -> Result<ReadOutcome, FabricError> {
        assert_eq!(
            buf.len(),
            self.0.len,
            "a posted read completed at another length"
        );
        // Waiting for a held read in one thread: it is performed now.
        self.0.perform();
        let bytes = self
            .0
            .result
            .lock()
            .expect("poisoned")
            .take()
            .expect("performed")?;
        let (copy, again) = bytes.split_at(buf.len());
        buf.copy_from_slice(copy);
        Ok(judge_copy(
            buf,
            u64::from_le_bytes(again.try_into().expect("a header word")),
        ))
    }
}

/// Machine pairs whose one-sided operations fail ([`MemFabric::cut_memory`]).
#[derive(Debug)]
struct MemoryCuts {
    machines: usize,
    cut: Box<[AtomicBool]>,
}

impl MemoryCuts {
    fn pair(&self, a: MachineId, b: MachineId) -> &AtomicBool {
        &self.cut[a.0 as usize * self.machines + b.0 as usize]
    }

    fn cut(&self, a: MachineId, b: MachineId) -> bool {
        self.pair(a, b).load(Ordering::Relaxed)
    }

    fn clear(&self) {
        for c in self.cut.iter() {
            c.store(false, Ordering::SeqCst);
        }
    }
}

fn same_side(groups: &[AtomicU32], a: MachineId, b: MachineId) -> bool {
    groups[a.0 as usize].load(Ordering::Relaxed) == groups[b.0 as usize].load(Ordering::Relaxed)
}

impl MemFabric {
    /// A fabric where every machine is alive and nothing is registered yet.
    pub fn new(config: MemFabricConfig) -> Self {
        let machines = (0..config.machines_max)
            .map(|_| Machine {
                alive: Arc::new(AtomicBool::new(true)),
                admitted: (0..(config.machines_max as usize).div_ceil(64))
                    .map(|_| AtomicU64::new(u64::MAX))
                    .collect(),
                areas: RwLock::new(BTreeMap::new()),
                datagrams: Mutex::new(VecDeque::new()),
                control: Mutex::new(VecDeque::new()),
            })
            .collect();
        let n_links = config.machines_max as usize
            * config.threads_max as usize
            * config.machines_max as usize;
        Self {
            config,
            machines,
            links: (0..n_links).map(|_| Link::default()).collect(),
            hold_writes: AtomicBool::new(false),
            reads: Arc::new(HeldReads::default()),
            groups: (0..config.machines_max)
                .map(|_| AtomicU32::new(0))
                .collect(),
            memory_cuts: Arc::new(MemoryCuts {
                machines: config.machines_max as usize,
                cut: (0..config.machines_max as usize * config.machines_max as usize)
                    .map(|_| AtomicBool::new(false))
                    .collect(),
            }),
            reads_traffic: (0..config.machines_max as usize * config.machines_max as usize)
                .map(|_| Arc::default())
                .collect(),
            broken: (0..config.machines_max as usize * config.machines_max as usize)
                .map(|_| AtomicBool::new(false))
                .collect(),
            stalls: Mutex::new(()),
            policy: Mutex::new((DatagramPolicy::default(), Rng::new(config.seed))),
        }
    }

    fn machine(&self, id: MachineId) -> Result<&Machine, FabricError> {
        self.machines
            .get(id.0 as usize)
            .ok_or(FabricError::Unreachable(id))
    }

    /// Whether writes from `src` land at `dst` (see [`Fabric::admit`]).
    fn admits(&self, dst: MachineId, src: MachineId) -> bool {
        let word =
            self.machines[dst.0 as usize].admitted[src.0 as usize / 64].load(Ordering::Acquire);
        src == dst || word & (1 << (src.0 % 64)) != 0
    }

    /// Whether writes from `src` to `dst` stall behind a break (see [`MemFabric::broken`]).
    fn broken_link(&self, src: MachineId, dst: MachineId) -> &AtomicBool {
        &self.broken[src.0 as usize * self.config.machines_max as usize + dst.0 as usize]
    }

    /// Whether a cut (a partition, or a cut between the two machines' memory) lies between
    /// `a` and `b`.
    fn cut_between(&self, a: MachineId, b: MachineId) -> bool {
        !same_side(&self.groups, a, b) || self.memory_cuts.cut(a, b)
    }

    /// Every thread's endpoint on `machine`.
    fn endpoints(&self, machine: MachineId) -> impl Iterator<Item = Endpoint> {
        (0..self.config.threads_max).map(move |t| Endpoint {
            machine,
            thread: ThreadId(t),
        })
    }

    /// Fails the writes stalled from `src` to `dst` without landing them, and ends the break:
    /// a membership change at either end ended the incarnation they were for. Call under
    /// `stalls`.
    fn end_break(&self, src: MachineId, dst: MachineId) {
        let broken = self.broken_link(src, dst);
        if broken.load(Ordering::SeqCst) {
            for e in self.endpoints(src) {
                self.fail_link(e, dst);
            }
            broken.store(false, Ordering::SeqCst);
        }
    }

    /// Repairs in place every broken link whose cut healed: its stalled writes land in the
    /// order they were posted (in the simulator's mode they are held for the driver, in that
    /// order), and later writes follow them.
    fn repair(&self) {
        let _stalls = self.stalls.lock().expect("fabric lock poisoned");
        let n = self.config.machines_max;
        for (src, dst) in (0..n).flat_map(|a| (0..n).map(move |b| (MachineId(a), MachineId(b)))) {
            let broken = self.broken_link(src, dst);
            if !broken.load(Ordering::SeqCst) || self.cut_between(src, dst) {
                continue;
            }
            let incarnations_hold = self.is_alive(src)
                && self.is_alive(dst)
                && self.admits(dst, src)
                && self.admits(src, dst);
            if !incarnations_hold {
                // Kills and membership changes fail stalled writes themselves; never land one
                // in an incarnation it was not for.
                self.end_break(src, dst);
                continue;
            }
            if !self.hold_writes.load(Ordering::SeqCst) {
                for e in self.endpoints(src) {
                    let link = self.link(e, dst);
                    let mut held = link.held.lock().expect("fabric lock poisoned");
                    while let Some(w) = held.pop_front() {
                        link.land(w.seq, &w.mem, w.offset, &w.data);
                    }
                }
            }
            broken.store(false, Ordering::SeqCst);
        }
    }

    /// The read counters of `src` reading `dst`.
    fn reads_of(&self, src: MachineId, dst: MachineId) -> &Arc<TrafficCounters> {
        &self.reads_traffic[src.0 as usize * self.config.machines_max as usize + dst.0 as usize]
    }

    fn link(&self, src: Endpoint, dst: MachineId) -> &Link {
        let c = &self.config;
        assert!(
            src.machine.0 < c.machines_max
                && src.thread.0 < c.threads_max
                && dst.0 < c.machines_max,
            "link {src:?} -> {dst} outside the fabric's limits"
        );
        let idx = (src.machine.0 as usize * c.threads_max as usize + src.thread.0 as usize)
            * c.machines_max as usize
            + dst.0 as usize;
        &self.links[idx]
    }

    fn area(&self, machine: MachineId, key: MemKey) -> Result<Arc<Nvram>, FabricError> {
        let m = self.machine(machine)?;
        let areas = m.areas.read().expect("fabric lock poisoned");
        areas
            .get(&key)
            .cloned()
            .ok_or(FabricError::NotRegistered { machine, key })
    }

    /// Stops `machine`'s NIC: its operations and operations to it fail from now on. Writes held
    /// on links from or to it fail without landing; use [`MemFabric::crash`] to land a prefix first.
    pub fn kill(&self, machine: MachineId) {
        let _stalls = self.stalls.lock().expect("fabric lock poisoned");
        self.machines[machine.0 as usize]
            .alive
            .store(false, Ordering::SeqCst);
        for src in (0..self.config.machines_max).flat_map(|m| self.endpoints(MachineId(m))) {
            for dst in (0..self.config.machines_max).map(MachineId) {
                if src.machine == machine || dst == machine {
                    self.fail_link(src, dst);
                }
            }
        }
    }

    /// Partitions the network: machines in different `sides` cannot reach each other (reads
    /// fail as to a dead machine, writes break their pair's links and stall, datagrams are
    /// lost); machines not listed stay on side 0 with the first group. Writes posted before
    /// the cut are in flight and land (held ones when delivered), unless a later write on
    /// their pair crosses the cut: they stall with it. Links between machines the new sides
    /// join again are repaired.
    pub fn partition(&self, sides: &[&[MachineId]]) {
        for g in self.groups.iter() {
            g.store(0, Ordering::SeqCst);
        }
        for (i, side) in sides.iter().enumerate() {
            for m in *side {
                self.groups[m.0 as usize].store(i as u32, Ordering::SeqCst);
            }
        }
        self.repair();
    }

    /// Cuts one-sided operations between `a` and `b`, both ways (reads fail as to a dead
    /// machine, writes break their link and stall) while datagrams still pass between them,
    /// as when a TCP connection breaks and UDP gets through: leases are renewed, memory is
    /// out of reach. Healed by [`MemFabric::heal`].
    pub fn cut_memory(&self, a: MachineId, b: MachineId) {
        self.memory_cuts.pair(a, b).store(true, Ordering::SeqCst);
        self.memory_cuts.pair(b, a).store(true, Ordering::SeqCst);
    }

    /// Heals every partition and every cut between two machines' memory.
    pub fn heal(&self) {
        self.memory_cuts.clear();
        self.partition(&[]);
    }

    /// Whether `a` can reach `b`: both up, on the same side of any partition, and their
    /// memory not cut apart.
    pub fn reachable(&self, a: MachineId, b: MachineId) -> bool {
        self.is_alive(a)
            && self.is_alive(b)
            && same_side(&self.groups, a, b)
            && !self.memory_cuts.cut(a, b)
    }

    /// Whether `machine`'s NIC is up.
    pub fn is_alive(&self, machine: MachineId) -> bool {
        self.machines[machine.0 as usize]
            .alive
            .load(Ordering::SeqCst)
    }

    fn fail_link(&self, src: Endpoint, dst: MachineId) {
        let link = self.link(src, dst);
        let mut held = link.held.lock().expect("fabric lock poisoned");
        let (landed, issued) = (
            link.landed.load(Ordering::SeqCst),
            link.issued.load(Ordering::SeqCst),
        );
        let failed_through = (link.failed.lock().expect("fabric lock poisoned").last())
            .map_or(0, |(_, through)| *through);
        if held.is_empty() && (landed == issued || failed_through == issued) {
            return; // Nothing outstanding that has not failed already.
        }
        held.clear();
        link.failed
            .lock()
            .expect("fabric lock poisoned")
            .push((landed.max(failed_through), issued));
        link.any_failed.store(true, Ordering::SeqCst);
    }

    /// Crashes `machine` the way a power failure mid-transfer does: on every link from it, a
    /// prefix of the held writes lands (chosen by `rng`), the next one possibly cut at any
    /// aligned 8-byte word; then the machine is killed.
    pub fn crash(&self, machine: MachineId, rng: &mut Rng) {
        for src in self.endpoints(machine) {
            for dst in 0..self.config.machines_max {
                if !self.admits(MachineId(dst), machine)
                    || self
                        .broken_link(machine, MachineId(dst))
                        .load(Ordering::SeqCst)
                {
                    continue; // Dropped with the link when the machine is killed below.
                }
                let link = self.link(src, MachineId(dst));
                let mut held = link.held.lock().expect("fabric lock poisoned");
                let land = rng.below(held.len() as u64 + 1) as usize;
                for _ in 0..land {
                    let w = held.pop_front().expect("counted");
                    link.land(w.seq, &w.mem, w.offset, &w.data);
                }
                if let Some(w) = held.front() {
                    // Cut between aligned 8-byte words: a NIC's DMA does not tear an aligned
                    // word (a block header, an object header), but a record spanning many
                    // words can land in part.
                    let cut = rng.below(w.data.len() as u64 + 1) as usize;
                    let end = (w.offset as usize + cut) & !7;
                    let cut = end.saturating_sub(w.offset as usize);
                    if cut > 0 {
                        w.mem.write(w.offset as usize, &w.data[..cut]);
                    }
                }
            }
        }
        self.kill(machine);
    }

    /// Holds every later write on its link until [`MemFabric::deliver_next`] (the simulator's
    /// mode), or, when `false`, lets writes land at once (held ones must be delivered first;
    /// writes stalled behind a break wait for its repair either way).
    pub fn set_hold_writes(&self, hold: bool) {
        self.hold_writes.store(hold, Ordering::SeqCst);
    }

    /// Links that have held writes the driver can deliver (none stalled behind a break), as
    /// (sender, target, count), in a fixed order.
    pub fn held_links(&self) -> Vec<(Endpoint, MachineId, usize)> {
        let mut out = Vec::new();
        for m in 0..self.config.machines_max {
            for src in self.endpoints(MachineId(m)) {
                for dst in 0..self.config.machines_max {
                    if self
                        .broken_link(src.machine, MachineId(dst))
                        .load(Ordering::SeqCst)
                    {
                        continue;
                    }
                    let n = self
                        .link(src, MachineId(dst))
                        .held
                        .lock()
                        .expect("poisoned")
                        .len();
                    if n > 0 {
                        out.push((src, MachineId(dst), n));
                    }
                }
            }
        }
        out
    }

    /// Lands the oldest held write from `src` to `dst`; returns whether there was one. Writes
    /// stalled behind a break wait for its repair.
    pub fn deliver_next(&self, src: Endpoint, dst: MachineId) -> bool {
        if !self.admits(dst, src.machine) {
            // The target removed the sender since: what was in flight is dropped.
            let any = !self
                .link(src, dst)
                .held
                .lock()
                .expect("poisoned")
                .is_empty();
            self.fail_link(src, dst);
            return any;
        }
        if self.broken_link(src.machine, dst).load(Ordering::SeqCst) {
            return false;
        }
        let link = self.link(src, dst);
        let mut held = link.held.lock().expect("fabric lock poisoned");
        match held.pop_front() {
            Some(w) => {
                link.land(w.seq, &w.mem, w.offset, &w.data);
                true
            }
            None => false,
        }
    }

    /// Lands every held write not stalled behind a break, in order, and performs every held
    /// read.
    pub fn deliver_all(&self) {
        for (src, dst, _) in self.held_links() {
            while self.deliver_next(src, dst) {}
        }
        while self.held_reads() > 0 {
            self.complete_read(0);
        }
    }

    /// Holds (or, with `false`, stops holding) both writes and posted reads: the simulator's
    /// mode ([`MemFabric::set_hold_writes`], [`MemFabric::set_hold_reads`]).
    pub fn set_hold(&self, hold: bool) {
        self.set_hold_writes(hold);
        self.set_hold_reads(hold);
    }

    /// Holds every later posted object read until [`MemFabric::complete_read`] performs it or
    /// its poster waits for it (the simulator's mode); with `false`, reads are not posted (held
    /// ones must be completed first).
    pub fn set_hold_reads(&self, hold: bool) {
        self.reads.hold.store(hold, Ordering::SeqCst);
    }

    /// How many posted reads wait to be performed, in the order they were posted. Reads whose
    /// poster performed them by waiting, or gave them up, wait no longer.
    pub fn held_reads(&self) -> usize {
        let mut queue = self.reads.queue.lock().expect("poisoned");
        queue.retain(|r| Arc::strong_count(r) > 1 && r.result.lock().expect("poisoned").is_none());
        queue.len()
    }

    /// Performs the `i`th held read (of [`MemFabric::held_reads`]): it copies the target's
    /// memory now, or fails as a read now would (a dead or partitioned target, a dead sender).
    pub fn complete_read(&self, i: usize) {
        let read = self.reads.queue.lock().expect("poisoned").remove(i);
        if let Some(read) = read {
            read.perform();
        }
    }

    /// Sets datagram loss and delay.
    pub fn set_datagram_policy(&self, policy: DatagramPolicy) {
        self.policy.lock().expect("poisoned").0 = policy;
    }
}

impl Fabric for MemFabric {
    fn register(&self, machine: MachineId, key: MemKey, mem: Arc<Nvram>) {
        let m = &self.machines[machine.0 as usize];
        m.areas
            .write()
            .expect("fabric lock poisoned")
            .insert(key, mem);
    }

    fn remote(
        &self,
        src: MachineId,
        dst: MachineId,
        key: MemKey,
    ) -> Result<Arc<dyn RemoteMemory>, FabricError> {
        let mem = self.area(dst, key)?;
        Ok(Arc::new(MemRemote {
            traffic: (src != dst).then(|| self.reads_of(src, dst).clone()),
            dst,
            key,
            mem,
            src_alive: self.machine(src)?.alive.clone(),
            dst_alive: self.machine(dst)?.alive.clone(),
            groups: self.groups.clone(),
            memory_cuts: self.memory_cuts.clone(),
            src,
            reads: self.reads.clone(),
        }))
    }

    fn write(
        &self,
        src: Endpoint,
        dst: MachineId,
        key: MemKey,
        offset: u64,
        data: &[u8],
    ) -> Result<WriteTicket, FabricError> {
        if !self.machine(src.machine)?.alive.load(Ordering::SeqCst) {
            return Err(FabricError::SenderDown(src.machine));
        }
        if !self.machine(dst)?.alive.load(Ordering::SeqCst) || !self.admits(dst, src.machine) {
            return Err(FabricError::Unreachable(dst));
        }
        let mem = self.area(dst, key)?;
        farm_core::fabric::check_bounds(dst, key, &mem, offset, data.len())?;
        let broken = self.broken_link(src.machine, dst);
        // A write across a cut, or on a pair stalled behind one, is decided under `stalls`,
        // so that repairs, kills and membership changes see it whole: afresh, since one of
        // them may have come between the checks above and the lock.
        let _stalls = if self.cut_between(src.machine, dst) || broken.load(Ordering::SeqCst) {
            let stalls = self.stalls.lock().expect("fabric lock poisoned");
            if !self.is_alive(src.machine) {
                return Err(FabricError::SenderDown(src.machine));
            }
            if !self.is_alive(dst) || !self.admits(dst, src.machine) {
                return Err(FabricError::Unreachable(dst));
            }
            if self.cut_between(src.machine, dst) {
                if !self.admits(src.machine, dst) {
                    // No link between members to keep in order: to a machine the writer
                    // removed (or has not admitted yet) a write across a cut is lost, as a
                    // new connection fails.
                    return Err(FabricError::Unreachable(dst));
                }
                // Both up, but the write cannot get through: the pair's link breaks, as a
                // connection does, and its writes stall until the cut heals.
                broken.store(true, Ordering::SeqCst);
            }
            Some(stalls)
        } else {
            None
        };
        let stalled = broken.load(Ordering::SeqCst);
        let link = self.link(src, dst);
        let seq = link.issued.fetch_add(1, Ordering::SeqCst) + 1;
        if src.machine != dst {
            link.traffic.write(data.len());
        }
        if stalled || self.hold_writes.load(Ordering::SeqCst) {
            let mut held = link.held.lock().expect("fabric lock poisoned");
            held.push_back(HeldWrite {
                seq,
                mem,
                offset,
                data: data.to_vec(),
            });
        } else {
            link.land(seq, &mem, offset, data);
        }
        Ok(WriteTicket(seq))
    }

    fn traffic(&self, machine: MachineId) -> Vec<(MachineId, Traffic)> {
        let c = &self.config;
        (0..c.machines_max)
            .map(MachineId)
            .filter(|dst| *dst != machine)
            .filter_map(|dst| {
                let mut t = self.reads_of(machine, dst).get();
                for thread in 0..c.threads_max {
                    let src = Endpoint {
                        machine,
                        thread: ThreadId(thread),
                    };
                    t.add(&self.link(src, dst).traffic.get());
                }
                (t != Traffic::default()).then_some((dst, t))
            })
            .collect()
    }

    fn write_status(&self, src: Endpoint, dst: MachineId, ticket: WriteTicket) -> WriteStatus {
        let link = self.link(src, dst);
        let failed = || {
            let ranges = link.failed.lock().expect("fabric lock poisoned");
            ranges
                .iter()
                .any(|(after, through)| (after + 1..=*through).contains(&ticket.0))
        };
        if link.any_failed.load(Ordering::SeqCst) && failed() {
            WriteStatus::Failed
        } else if link.landed.load(Ordering::SeqCst) >= ticket.0 {
            WriteStatus::Done
        } else {
            WriteStatus::Pending
        }
    }

    fn send_datagram(&self, src: MachineId, dst: MachineId, data: &[u8], now: u64) {
        let (Ok(s), Ok(d)) = (self.machine(src), self.machine(dst)) else {
            return;
        };
        if !s.alive.load(Ordering::SeqCst)
            || !d.alive.load(Ordering::SeqCst)
            || !same_side(&self.groups, src, dst)
        {
            return;
        }
        let delay = {
            let mut guard = self.policy.lock().expect("poisoned");
            let (policy, rng) = &mut *guard;
            if rng.chance(policy.drop_per_million) {
                return;
            }
            if policy.delay_ticks_max > 0 {
                rng.below(policy.delay_ticks_max + 1)
            } else {
                0
            }
        };
        let queue = if data.first() == Some(&CONTROL_TAG) {
            &d.control
        } else {
            &d.datagrams
        };
        let mut q = queue.lock().expect("poisoned");
        if q.len() < self.config.datagrams_queued_max {
            q.push_back(Datagram {
                src,
                due: now + delay,
                data: data.to_vec(),
            });
        }
    }

    fn admit(&self, machine: MachineId, members: &[MachineId]) {
        let Ok(m) = self.machine(machine) else {
            return;
        };
        for (i, word) in m.admitted.iter().enumerate() {
            let bits = members
                .iter()
                .filter(|x| x.0 as usize / 64 == i)
                .fold(0u64, |b, x| b | 1 << (x.0 % 64));
            let _stalls = self.stalls.lock().expect("fabric lock poisoned");
            let was = word.swap(bits, Ordering::AcqRel);
            // A machine removed or added is another incarnation from now on: what stalled
            // between the two fails, and their links start afresh.
            let mut changed = was ^ bits;
            while changed != 0 {
                let other = MachineId((i * 64) as u16 + changed.trailing_zeros() as u16);
                changed &= changed - 1;
                if other.0 < self.config.machines_max {
                    self.end_break(machine, other);
                    self.end_break(other, machine);
                }
            }
        }
    }

    fn broken_members(&self, machine: MachineId) -> Vec<MachineId> {
        (0..self.config.machines_max)
            .map(MachineId)
            .filter(|&dst| {
                dst != machine
                    && self.broken_link(machine, dst).load(Ordering::SeqCst)
                    && self.admits(machine, dst)
            })
            .collect()
    }

    fn is_up(&self, machine: MachineId) -> bool {
        self.is_alive(machine)
    }

    fn recv_datagram(&self, dst: MachineId, now: u64, buf: &mut Vec<u8>) -> Option<MachineId> {
        let d = self.machine(dst).ok()?;
        take_due(&d.alive, &d.datagrams, now, buf)
    }

    fn recv_control(&self, dst: MachineId, now: u64, buf: &mut Vec<u8>) -> Option<MachineId> {
        let d = self.machine(dst).ok()?;
        take_due(&d.alive, &d.control, now, buf)
    }
}

/// Takes the first datagram of `queue` due at `now` into `buf` (none for a dead machine).
fn take_due(
    alive: &AtomicBool,
    queue: &Mutex<VecDeque<Datagram>>,
    now: u64,
    buf: &mut Vec<u8>,
) -> Option<MachineId> {
    if !alive.load(Ordering::SeqCst) {
        return None;
    }
    let mut q = queue.lock().expect("poisoned");
    let at = q.iter().position(|g| g.due <= now)?;
    let g = q.remove(at).expect("found");
    buf.clear();
    buf.extend_from_slice(&g.data);
    Some(g.src)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fabric() -> MemFabric {
        MemFabric::new(MemFabricConfig {
            machines_max: 3,
            threads_max: 2,
            seed: 1,
            datagrams_queued_max: 16,
        })
    }

    /// A fabric whose machine 1 has 64 bytes of rings registered, and those bytes.
    fn rings_at_1() -> (MemFabric, Arc<Nvram>) {
        let f = fabric();
        let mem = Arc::new(Nvram::anonymous(64).unwrap());
        f.register(MachineId(1), MemKey::Rings, mem.clone());
        (f, mem)
    }

    fn ep(m: u16) -> Endpoint {
        Endpoint {
            machine: MachineId(m),
            thread: ThreadId(0),
        }
    }

    #[test]
    fn one_sided_write_then_read() {
        let (f, _mem) = rings_at_1();
        let t = f
            .write(ep(0), MachineId(1), MemKey::Rings, 8, b"abcdefgh")
            .unwrap();
        assert_eq!(f.write_status(ep(0), MachineId(1), t), WriteStatus::Done);
        let r = f.remote(MachineId(2), MachineId(1), MemKey::Rings).unwrap();
        let mut buf = [0u8; 8];
        r.read(8, &mut buf).unwrap();
        assert_eq!(&buf, b"abcdefgh");
        assert!(matches!(
            r.read(64, &mut buf),
            Err(FabricError::OutOfBounds { .. })
        ));
        assert!(matches!(
            f.remote(MachineId(0), MachineId(1), MemKey::Feedback),
            Err(FabricError::NotRegistered { .. })
        ));
    }

    #[test]
    fn dead_machines_fail_operations_instead_of_hanging() {
        let (f, _mem) = rings_at_1();
        let r = f.remote(MachineId(0), MachineId(1), MemKey::Rings).unwrap();
        f.kill(MachineId(1));
        let mut buf = [0u8; 8];
        assert_eq!(
            r.read(0, &mut buf),
            Err(FabricError::Unreachable(MachineId(1)))
        );
        assert_eq!(
            f.write(ep(0), MachineId(1), MemKey::Rings, 0, &[1; 8]),
            Err(FabricError::Unreachable(MachineId(1)))
        );
        assert_eq!(
            f.write(ep(1), MachineId(0), MemKey::Rings, 0, &[1; 8]),
            Err(FabricError::SenderDown(MachineId(1)))
        );
    }

    #[test]
    fn held_writes_land_in_order_and_fail_when_target_dies() {
        let (f, mem) = rings_at_1();
        f.set_hold_writes(true);
        let a = f
            .write(ep(0), MachineId(1), MemKey::Rings, 0, &[1; 8])
            .unwrap();
        let b = f
            .write(ep(0), MachineId(1), MemKey::Rings, 8, &[2; 8])
            .unwrap();
        assert_eq!(f.write_status(ep(0), MachineId(1), a), WriteStatus::Pending);
        assert_eq!(mem.load_u64(0, Ordering::SeqCst), 0);
        assert!(f.deliver_next(ep(0), MachineId(1)));
        assert_eq!(f.write_status(ep(0), MachineId(1), a), WriteStatus::Done);
        assert_eq!(f.write_status(ep(0), MachineId(1), b), WriteStatus::Pending);
        f.kill(MachineId(1));
        assert_eq!(f.write_status(ep(0), MachineId(1), b), WriteStatus::Failed);
        assert_eq!(
            mem.load_u64(8, Ordering::SeqCst),
            0,
            "a failed write never lands"
        );
    }

    /// Precise membership at the target: once machine 1 admits only 1 and 2, a write from 0
    /// fails, and one 0 posted before (held in flight) is dropped, not landed.
    #[test]
    fn writes_from_machines_a_target_removed_do_not_land() {
        let (f, mem) = rings_at_1();
        f.set_hold_writes(true);
        let early = f
            .write(ep(0), MachineId(1), MemKey::Rings, 0, &[7; 8])
            .unwrap();
        let kept = f
            .write(ep(2), MachineId(1), MemKey::Rings, 8, &[9; 8])
            .unwrap();
        f.admit(MachineId(1), &[MachineId(2), MachineId(1)]);
        assert!(matches!(
            f.write(ep(0), MachineId(1), MemKey::Rings, 16, &[1; 8]),
            Err(FabricError::Unreachable(_))
        ));
        f.deliver_all();
        assert_eq!(
            f.write_status(ep(0), MachineId(1), early),
            WriteStatus::Failed
        );
        assert_eq!(f.write_status(ep(2), MachineId(1), kept), WriteStatus::Done);
        let mut buf = [0u8; 16];
        mem.read(0, &mut buf);
        assert_eq!(buf, [[0u8; 8], [9u8; 8]].concat()[..]);
    }

    #[test]
    fn crash_lands_a_prefix_of_held_writes() {
        for seed in 0..50 {
            let (f, mem) = rings_at_1();
            f.set_hold_writes(true);
            for i in 0..4u8 {
                f.write(
                    ep(0),
                    MachineId(1),
                    MemKey::Rings,
                    i as u64 * 8,
                    &[i + 1; 8],
                )
                .unwrap();
            }
            f.crash(MachineId(0), &mut Rng::new(seed));
            let mut bytes = [0u8; 32];
            mem.read(0, &mut bytes);
            // Landed bytes form a prefix of the concatenated writes.
            let expected: Vec<u8> = (0..4u8).flat_map(|i| [i + 1; 8]).collect();
            let landed = bytes.iter().take_while(|b| **b != 0).count();
            assert_eq!(&bytes[..landed], &expected[..landed], "seed {seed}");
            assert!(
                bytes[landed..].iter().all(|b| *b == 0),
                "seed {seed}: not a prefix"
            );
        }
    }

    /// Reads and datagrams come back with the heal; a write across the partition broke its
    /// link: it and every later write on the link stall (reported while the target is a member
    /// of the writer's configuration) and land in order when the partition heals.
    #[test]
    fn a_partition_cuts_reads_and_datagrams_and_stalls_writes_until_healed() {
        let (f, mem) = rings_at_1();
        let r = f.remote(MachineId(0), MachineId(1), MemKey::Rings).unwrap();
        f.partition(&[&[MachineId(0)], &[MachineId(1), MachineId(2)]]);
        assert!(
            !f.reachable(MachineId(0), MachineId(1)) && f.reachable(MachineId(1), MachineId(2))
        );
        let mut buf = [0u8; 8];
        assert_eq!(
            r.read(0, &mut buf),
            Err(FabricError::Unreachable(MachineId(1)))
        );
        let first = f
            .write(ep(0), MachineId(1), MemKey::Rings, 0, &[1; 8])
            .unwrap();
        let second = f
            .write(ep(0), MachineId(1), MemKey::Rings, 0, &[3; 8])
            .unwrap();
        assert_eq!(
            f.write_status(ep(0), MachineId(1), first),
            WriteStatus::Pending
        );
        assert_eq!(
            mem.load_u64(0, Ordering::SeqCst),
            0,
            "nothing crossed the cut"
        );
        f.send_datagram(MachineId(0), MachineId(1), b"x", 0);
        assert_eq!(f.recv_datagram(MachineId(1), 1, &mut Vec::new()), None);
        assert_eq!(f.broken_members(MachineId(0)), vec![MachineId(1)]);
        assert_eq!(f.broken_members(MachineId(1)), vec![]);
        // Writes on links across no cut go on.
        assert!(f
            .write(ep(2), MachineId(1), MemKey::Rings, 8, &[2; 8])
            .is_ok());
        assert_eq!(
            mem.load_u64(8, Ordering::SeqCst),
            u64::from_le_bytes([2; 8])
        );
        f.heal();
        assert!(r.read(0, &mut buf).is_ok());
        for t in [first, second] {
            assert_eq!(f.write_status(ep(0), MachineId(1), t), WriteStatus::Done);
        }
        assert_eq!(
            mem.load_u64(0, Ordering::SeqCst),
            u64::from_le_bytes([3; 8]),
            "the stalled writes landed in the order they were posted"
        );
        assert_eq!(f.broken_members(MachineId(0)), vec![]);
        let after = f
            .write(ep(0), MachineId(1), MemKey::Rings, 16, &[4; 8])
            .unwrap();
        assert_eq!(
            f.write_status(ep(0), MachineId(1), after),
            WriteStatus::Done
        );
    }

    /// Writes stalled behind a break are for the incarnations the two machines were: a
    /// membership change at either end fails them, and they never land, heal or not.
    #[test]
    fn stalled_writes_fail_when_either_end_changes_its_members() {
        for target_side in [false, true] {
            let (f, mem) = rings_at_1();
            f.cut_memory(MachineId(0), MachineId(1));
            let t = f
                .write(ep(0), MachineId(1), MemKey::Rings, 0, &[1; 8])
                .unwrap();
            assert_eq!(f.write_status(ep(0), MachineId(1), t), WriteStatus::Pending);
            if target_side {
                f.admit(MachineId(1), &[MachineId(1), MachineId(2)]);
            } else {
                f.admit(MachineId(0), &[MachineId(0), MachineId(2)]);
            }
            assert_eq!(f.write_status(ep(0), MachineId(1), t), WriteStatus::Failed);
            assert_eq!(f.broken_members(MachineId(0)), vec![]);
            // Across the cut, to a machine the writer no longer admits (or that no longer
            // admits it), a write fails at once: no link between members to keep in order.
            assert!(f
                .write(ep(0), MachineId(1), MemKey::Rings, 8, &[2; 8])
                .is_err());
            f.heal();
            assert_eq!(f.write_status(ep(0), MachineId(1), t), WriteStatus::Failed);
            assert_eq!(
                mem.load_u64(0, Ordering::SeqCst),
                0,
                "target side {target_side}"
            );
        }
    }

    /// A write that failed stays failed after later writes on its link land, and those are
    /// judged on their own; a new partition that joins the two sides repairs their links.
    #[test]
    fn failed_writes_stay_failed_and_a_new_partition_repairs_what_it_joins() {
        let (f, mem) = rings_at_1();
        f.cut_memory(MachineId(0), MachineId(1));
        let lost = f
            .write(ep(0), MachineId(1), MemKey::Rings, 0, &[1; 8])
            .unwrap();
        f.admit(MachineId(1), &[MachineId(1), MachineId(2)]);
        f.admit(MachineId(1), &[MachineId(0), MachineId(1), MachineId(2)]);
        f.heal();
        let later = f
            .write(ep(0), MachineId(1), MemKey::Rings, 8, &[2; 8])
            .unwrap();
        assert_eq!(
            f.write_status(ep(0), MachineId(1), later),
            WriteStatus::Done
        );
        assert_eq!(
            f.write_status(ep(0), MachineId(1), lost),
            WriteStatus::Failed
        );
        assert_eq!(mem.load_u64(0, Ordering::SeqCst), 0);
        f.partition(&[&[MachineId(0)], &[MachineId(1), MachineId(2)]]);
        let stalled = f
            .write(ep(0), MachineId(1), MemKey::Rings, 16, &[3; 8])
            .unwrap();
        f.partition(&[&[MachineId(0), MachineId(1)], &[MachineId(2)]]);
        assert_eq!(
            f.write_status(ep(0), MachineId(1), stalled),
            WriteStatus::Done
        );
        assert_eq!(f.broken_members(MachineId(0)), vec![]);
    }

    /// Writers on two threads race partitions and heals: each thread's writes land in the
    /// order it posted them, none is left stalled once the network heals, and none fails
    /// (nobody changed membership).
    #[test]
    fn writes_racing_partitions_and_heals_land_in_order() {
        let f = Arc::new(fabric());
        let mem = Arc::new(Nvram::anonymous(64).unwrap());
        f.register(MachineId(1), MemKey::Rings, mem.clone());
        let writers: Vec<_> = (0..2u16)
            .map(|t| {
                let (f, mem) = (f.clone(), mem.clone());
                std::thread::spawn(move || {
                    let src = Endpoint {
                        machine: MachineId(0),
                        thread: ThreadId(t),
                    };
                    let mut tickets = Vec::new();
                    for i in 1..=20_000u64 {
                        let t8 = u64::from(t) * 8;
                        let ticket = f
                            .write(src, MachineId(1), MemKey::Rings, t8, &i.to_le_bytes())
                            .expect("both up and members");
                        tickets.push(ticket);
                        // Order on the link: what is there is never older than an earlier
                        // write known to have landed.
                        if i % 64 == 0 {
                            let done = tickets.iter().rposition(|k| {
                                f.write_status(src, MachineId(1), *k) == WriteStatus::Done
                            });
                            if let Some(k) = done {
                                let there = mem.load_u64(t8 as usize, Ordering::SeqCst);
                                assert!(there > k as u64, "write {} landed over {there}", k + 1);
                            }
                        }
                    }
                    (src, tickets)
                })
            })
            .collect();
        for round in 0..200 {
            if round % 2 == 0 {
                f.partition(&[&[MachineId(0)], &[MachineId(1), MachineId(2)]]);
            } else {
                f.heal();
            }
            std::thread::yield_now();
        }
        // The last round healed: nothing may stay stalled behind a cut that is gone.
        let done: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
        assert_eq!(f.broken_members(MachineId(0)), vec![]);
        for (src, tickets) in done {
            for t in &tickets {
                assert_eq!(f.write_status(src, MachineId(1), *t), WriteStatus::Done);
            }
            assert_eq!(
                mem.load_u64(src.thread.0 as usize * 8, Ordering::SeqCst),
                20_000,
                "thread {}: the last write posted is the last to land",
                src.thread.0
            );
        }
    }

    /// In the simulator's mode a stalled link is not offered to the driver, a crash lands none
    /// of it, and once repaired its writes are delivered one by one in order.
    #[test]
    fn held_writes_stalled_behind_a_break_wait_for_the_repair() {
        let (f, mem) = rings_at_1();
        f.set_hold_writes(true);
        f.partition(&[&[MachineId(0)], &[MachineId(1)]]);
        let a = f
            .write(ep(0), MachineId(1), MemKey::Rings, 0, &[1; 8])
            .unwrap();
        let b = f
            .write(ep(0), MachineId(1), MemKey::Rings, 8, &[2; 8])
            .unwrap();
        assert!(f.held_links().is_empty());
        assert!(!f.deliver_next(ep(0), MachineId(1)));
        f.heal();
        assert_eq!(f.held_links(), vec![(ep(0), MachineId(1), 2)]);
        assert!(f.deliver_next(ep(0), MachineId(1)));
        assert_eq!(f.write_status(ep(0), MachineId(1), a), WriteStatus::Done);
        assert_eq!(f.write_status(ep(0), MachineId(1), b), WriteStatus::Pending);
        f.partition(&[&[MachineId(0)], &[MachineId(1)]]);
        // A write across the new cut breaks the link again: `b`, held ahead of it, stalls
        // with it, and the crash lands neither.
        assert!(f
            .write(ep(0), MachineId(1), MemKey::Rings, 16, &[3; 8])
            .is_ok());
        f.crash(MachineId(0), &mut Rng::new(7));
        assert_eq!(f.write_status(ep(0), MachineId(1), b), WriteStatus::Failed);
        let mut bytes = [0u8; 24];
        mem.read(0, &mut bytes);
        assert_eq!(bytes, [[1u8; 8], [0; 8], [0; 8]].concat()[..]);
    }

    #[test]
    fn a_memory_cut_fails_reads_and_writes_and_lets_datagrams_pass() {
        let (f, _mem) = rings_at_1();
        let r = f.remote(MachineId(0), MachineId(1), MemKey::Rings).unwrap();
        let r2 = f.remote(MachineId(2), MachineId(1), MemKey::Rings).unwrap();
        f.cut_memory(MachineId(0), MachineId(1));
        let mut buf = [0u8; 8];
        assert_eq!(
            r.read(0, &mut buf),
            Err(FabricError::Unreachable(MachineId(1)))
        );
        let stalled = f
            .write(ep(0), MachineId(1), MemKey::Rings, 0, &[1; 8])
            .unwrap();
        assert_eq!(f.broken_members(MachineId(0)), vec![MachineId(1)]);
        // Only that pair.
        assert!(r2.read(0, &mut buf).is_ok());
        assert!(f
            .write(ep(2), MachineId(1), MemKey::Rings, 8, &[2; 8])
            .is_ok());
        f.send_datagram(MachineId(0), MachineId(1), b"x", 0);
        assert_eq!(
            f.recv_datagram(MachineId(1), 1, &mut Vec::new()),
            Some(MachineId(0))
        );
        f.heal();
        assert!(r.read(0, &mut buf).is_ok());
        assert_eq!(
            f.write_status(ep(0), MachineId(1), stalled),
            WriteStatus::Done
        );
    }

    #[test]
    fn datagrams_can_be_dropped_and_delayed() {
        let f = fabric();
        f.send_datagram(MachineId(0), MachineId(1), b"hi", 0);
        let mut buf = Vec::new();
        assert_eq!(
            f.recv_datagram(MachineId(1), 0, &mut buf),
            Some(MachineId(0))
        );
        assert_eq!(buf, b"hi");
        f.set_datagram_policy(DatagramPolicy {
            drop_per_million: 1_000_000,
            delay_ticks_max: 0,
        });
        f.send_datagram(MachineId(0), MachineId(1), b"lost", 0);
        assert_eq!(f.recv_datagram(MachineId(1), 100, &mut buf), None);
        f.set_datagram_policy(DatagramPolicy {
            drop_per_million: 0,
            delay_ticks_max: 10,
        });
        for _ in 0..20 {
            f.send_datagram(MachineId(0), MachineId(1), b"late", 5);
        }
        let mut got = 0;
        for now in 5..=15 {
            while f.recv_datagram(MachineId(1), now, &mut buf).is_some() {
                got += 1;
            }
        }
        assert_eq!(
            got, 16,
            "the queue holds datagrams_queued_max, later ones are dropped"
        );
    }
}
