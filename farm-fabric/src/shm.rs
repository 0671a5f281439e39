//! The `shm` fabric: one process per machine on one host (docs/ARCHITECTURE.md, Fabric).
//!
//! Every machine's registered memory is a file of its NVRAM directory, `<dir>/m<id>/<area>`
//! (the names [`area_file`] gives, which the machine's own NVRAM uses), and peers map those
//! files: a one-sided read or write is a copy into or out of the mapping, so the target's CPU
//! is never involved, as with RDMA. Writes are synchronous copies, so a write's ticket is done
//! when `write` returns, and one endpoint's writes land in order.
//!
//! Liveness: the process running machine `m` holds an exclusive `flock` on `<dir>/m<id>/alive`
//! for as long as it lives; the kernel drops it when the process dies, however it dies.
//! Operations to a machine check the lock at most every [`LIVENESS_CHECK`]: an operation to a
//! machine whose process is gone fails with [`FabricError::Unreachable`] from at most that long
//! after its death (like an operation already in flight on a NIC when its target died). Its
//! files survive it (they are its NVRAM); a restarted process maps them again.
//!
//! Precise membership (§5.2): [`Fabric::admit`] writes the admitted machines into the target's
//! `admitted` file, which writers read before each write: a write from a machine that is not
//! admitted fails without landing. (A write that passed the check just before the target
//! changed the set may still land, as a write already on the wire does with a NIC.)
//!
//! Datagrams go over UDP on loopback, machine `m` at port `base_port + m`
//! ([`crate::process`]).

use std::collections::HashMap;
use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::auth::Secret;
pub use crate::process::machine_dir;
use crate::process::{
    claim_machine, io_err, Claim, Datagrams, Doorbell, Peers, ProcessFabric, StartError,
};
use farm_core::fabric::{
    Endpoint, Fabric, FabricError, MemKey, RemoteMemory, Traffic, TrafficCounters, WriteStatus,
    WriteTicket,
};
use farm_core::ids::{MachineId, ThreadId};
use farm_core::nvram::Nvram;

/// How stale a machine's liveness may be when an operation relies on it.
pub const LIVENESS_CHECK: Duration = Duration::from_millis(1);

/// Machines an `admitted` file can name (one bit each).
pub const ADMIT_MACHINES_MAX: usize = 512;

/// The file of `key` in a machine's NVRAM directory (`<dir>/m<id>/`).
pub fn area_file(key: MemKey) -> String {
    match key {
        MemKey::Region(r) => format!("region-{}", r.0),
        MemKey::Rings => "rings".to_string(),
        MemKey::Feedback => "feedback".to_string(),
        MemKey::Replicas => "replicas".to_string(),
    }
}

/// What one process knows of one machine.
#[derive(Debug)]
struct Machine {
    /// Its `alive` lock file.
    lock_path: PathBuf,
    /// Whether its process was alive at `checked`.
    alive: AtomicBool,
    /// When liveness was last checked, in microseconds since the fabric started (0: never).
    checked: AtomicU64,
    /// Its mapped areas.
    areas: RwLock<HashMap<MemKey, Arc<Nvram>>>,
    /// Its `admitted` bitmap, once mapped.
    admitted: Mutex<Option<Arc<Nvram>>>,
    /// Its doorbell, once mapped.
    doorbell: Mutex<Option<Doorbell>>,
    /// The slots of its doorbell (`1 << t % 64` for thread `t`) whose ring a thread's batch
    /// holds back.
    ring_held: AtomicU64,
    /// Reads and writes this process posted to it.
    traffic: TrafficCounters,
}

impl farm_core::fabric::Held for Machine {
    fn flush(&self) {
        let mut held = self.ring_held.swap(0, Ordering::AcqRel);
        if held == 0 {
            return;
        }
        let bell = self.doorbell.lock().expect("doorbell poisoned").clone();
        if let Some(bell) = bell {
            while held != 0 {
                bell.ring(ThreadId(held.trailing_zeros() as u16));
                held &= held - 1;
            }
        }
    }
}

impl Machine {
    /// Whether its process lives, as checked at most [`LIVENESS_CHECK`] before `now` (in
    /// microseconds since the fabric started).
    fn alive(&self, now: u64) -> bool {
        let checked = self.checked.load(Ordering::Acquire);
        // Another thread may have checked after this one read the clock (`checked > now`).
        if checked != 0 && now.saturating_sub(checked) < LIVENESS_CHECK.as_micros() as u64 {
            return self.alive.load(Ordering::Acquire);
        }
        let alive = probe_alive(&self.lock_path);
        self.alive.store(alive, Ordering::Release);
        self.checked.store(now, Ordering::Release);
        alive
    }
}

/// The `shm` fabric of one process. See the module docs.
#[derive(Debug)]
pub struct ShmFabric {
    dir: PathBuf,
    me: MachineId,
    epoch: Instant,
    /// This machine's directory, held while the process lives.
    claim: Claim,
    /// Read on every operation (the lease thread's included: a writer's lock held by a
    /// descheduled worker would delay it), written once per machine.
    machines: RwLock<HashMap<MachineId, Arc<Machine>>>,
    /// The last write ticket handed out. Writes are copies done before `write` returns, so
    /// every ticket up to it is done; one counter for every link keeps each link's tickets
    /// increasing without a lock on the write path.
    tickets: AtomicU64,
    datagrams: Datagrams,
}

impl ShmFabric {
    /// The fabric of the process that runs machine `me` of cluster `cluster`, whose machines
    /// keep their NVRAM under `dir`: checks that `dir` is this cluster's (stamping it when
    /// new), takes `me`'s `alive` lock (failing if another live process holds it) and binds
    /// its datagram port, `base_port + me`, on loopback. Datagrams are sealed and checked
    /// under the cluster's `secret` (the NVRAM files are guarded by the file system's
    /// permissions: only processes that may open the directory map them).
    pub fn start(
        dir: &Path,
        cluster: u64,
        me: MachineId,
        base_port: u16,
        secret: Secret,
    ) -> Result<Self, StartError> {
        let claim = claim_machine(dir, cluster, me)?;
        let datagrams = Datagrams::bind(
            cluster,
            me,
            Peers::Loopback(base_port),
            secret,
            claim.incarnation,
        )?;
        // The admitted set starts empty, also after a restart (the file is the previous
        // life's): nobody writes here until this process installs a configuration, so a peer
        // sees this machine ready only once it runs one.
        let admitted = machine_dir(dir, me).join("admitted");
        let bits = Nvram::file(&admitted, ADMIT_MACHINES_MAX / 8)
            .map_err(io_err(format!("creating {}", admitted.display())))?;
        for w in 0..ADMIT_MACHINES_MAX / 64 {
            bits.store_u64(w * 8, 0, Ordering::Release);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            me,
            epoch: Instant::now(),
            claim,
            machines: RwLock::new(HashMap::new()),
            tickets: AtomicU64::new(0),
            datagrams,
        })
    }

    /// Announces a write into the rings of `dst`'s `thread`, waking its poller if it waits: now,
    /// or once for all of a thread's batch when it flushes.
    fn ring(&self, dst: MachineId, thread: ThreadId, state: &Arc<Machine>) {
        let bell = {
            let mut bell = state.doorbell.lock().expect("doorbell poisoned");
            if bell.is_none() {
                // A peer gone: nobody waits to be woken.
                *bell = Doorbell::open(&machine_dir(&self.dir, dst).join("doorbell"));
            }
            bell.clone()
        };
        let Some(bell) = bell else { return };
        if farm_core::fabric::hold(&(state.clone() as Arc<dyn farm_core::fabric::Held>)) {
            state
                .ring_held
                .fetch_or(1 << (thread.0 % 64), Ordering::AcqRel);
        } else {
            bell.ring(thread);
        }
    }

    fn machine(&self, m: MachineId) -> Arc<Machine> {
        if let Some(state) = self.machines.read().expect("machines poisoned").get(&m) {
            return state.clone();
        }
        self.machines
            .write()
            .expect("machines poisoned")
            .entry(m)
            .or_insert_with(|| {
                Arc::new(Machine {
                    lock_path: machine_dir(&self.dir, m).join("alive"),
                    alive: AtomicBool::new(false),
                    checked: AtomicU64::new(0),
                    areas: RwLock::new(HashMap::new()),
                    admitted: Mutex::new(None),
                    doorbell: Mutex::new(None),
                    ring_held: AtomicU64::new(0),
                    traffic: TrafficCounters::default(),
                })
            })
            .clone()
    }

    /// Whether machine `m`'s process lives, checked at most [`LIVENESS_CHECK`] ago.
    fn alive(&self, m: MachineId, state: &Machine) -> bool {
        m == self.me || state.alive(micros_since(self.epoch))
    }

    /// Machine `m`'s area `key`, mapped on first use.
    fn area(&self, m: MachineId, state: &Machine, key: MemKey) -> Result<Arc<Nvram>, FabricError> {
        if let Some(a) = state.areas.read().expect("areas poisoned").get(&key) {
            return Ok(a.clone());
        }
        let mut areas = state.areas.write().expect("areas poisoned");
        let path = machine_dir(&self.dir, m).join(area_file(key));
        let mem = Nvram::open(&path)
            .map(Arc::new)
            .map_err(|_| FabricError::NotRegistered { machine: m, key })?;
        areas.insert(key, mem.clone());
        Ok(mem)
    }

    /// Whether `dst` admits one-sided writes from `src`.
    fn admits(&self, dst: MachineId, state: &Machine, src: MachineId) -> bool {
        let mut admitted = state.admitted.lock().expect("admitted poisoned");
        if admitted.is_none() {
            let path = machine_dir(&self.dir, dst).join("admitted");
            *admitted = Nvram::open(&path).ok().map(Arc::new);
        }
        let Some(bits) = admitted.as_ref() else {
            return false;
        };
        let i = src.0 as usize;
        i < ADMIT_MACHINES_MAX
            && bits.load_u64(i / 64 * 8, Ordering::Acquire) & (1 << (i % 64)) != 0
    }
}

impl ProcessFabric for ShmFabric {
    fn me(&self) -> MachineId {
        self.me
    }

    /// Machine `m`'s process lives, its rings are mapped and it admitted this machine.
    fn ready(&self, m: MachineId) -> bool {
        let state = self.machine(m);
        self.alive(m, &state)
            && self.admits(m, &state, self.me)
            && self.area(m, &state, MemKey::Rings).is_ok()
    }

    fn writes_seen(&self, thread: ThreadId) -> u64 {
        self.claim.doorbell.seen(thread)
    }

    /// The writer rings the doorbell, a futex word per thread in `<dir>/m<id>/doorbell`, after
    /// its write.
    fn wait_for_writes(&self, thread: ThreadId, seen: u64, timeout: Duration) {
        self.claim.doorbell.wait(thread, seen, timeout)
    }

    fn polled(&self, thread: ThreadId, on: bool) {
        self.claim.doorbell.polled(thread, on)
    }

    fn datagrams_refused(&self) -> u64 {
        self.datagrams.refused()
    }
}

/// Microseconds since `epoch`, never 0 (which means "never checked").
fn micros_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_micros() as u64 + 1
}

/// Whether the process holding the exclusive lock on `path` lives: a shared lock can be taken
/// only once it died (or never started).
fn probe_alive(path: &Path) -> bool {
    let Ok(f) = File::open(path) else {
        return false;
    };
    match f.try_lock_shared() {
        Ok(()) => false, // Dropping `f` releases it.
        Err(TryLockError::WouldBlock) => true,
        Err(TryLockError::Error(_)) => false,
    }
}

/// A one-sided read handle to a peer's mapped area.
#[derive(Debug)]
struct ShmRemote {
    epoch: Instant,
    /// A read of this process's own machine (counted as no peer's traffic).
    local: bool,
    dst: MachineId,
    key: MemKey,
    state: Arc<Machine>,
    mem: Arc<Nvram>,
}

impl RemoteMemory for ShmRemote {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), FabricError> {
        if !self.state.alive(micros_since(self.epoch)) {
            return Err(FabricError::Unreachable(self.dst));
        }
        farm_core::fabric::check_bounds(self.dst, self.key, &self.mem, offset, buf.len())?;
        self.mem.read(offset as usize, buf);
        if !self.local {
            self.state.traffic.read(buf.len());
        }
        Ok(())
    }

    fn machine(&self) -> MachineId {
        self.dst
    }

    fn prefetch(&self, offset: u64, len: usize) {
        self.mem.prefetch(offset as usize, len);
    }
}

impl Fabric for ShmFabric {
    fn register(&self, machine: MachineId, key: MemKey, mem: Arc<Nvram>) {
        assert_eq!(
            machine, self.me,
            "the shm fabric registers only its own machine's memory"
        );
        // Peers map the file itself; locally the caller's mapping serves.
        let state = self.machine(machine);
        state
            .areas
            .write()
            .expect("areas poisoned")
            .insert(key, mem);
    }

    fn remote(
        &self,
        src: MachineId,
        dst: MachineId,
        key: MemKey,
    ) -> Result<Arc<dyn RemoteMemory>, FabricError> {
        let _ = src;
        let state = self.machine(dst);
        if !self.alive(dst, &state) {
            return Err(FabricError::Unreachable(dst));
        }
        let mem = self.area(dst, &state, key)?;
        Ok(Arc::new(ShmRemote {
            epoch: self.epoch,
            local: dst == self.me,
            dst,
            key,
            state,
            mem,
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
        let state = self.machine(dst);
        if !self.alive(dst, &state) {
            return Err(FabricError::Unreachable(dst));
        }
        if dst != src.machine && !self.admits(dst, &state, src.machine) {
            return Err(FabricError::Unreachable(dst));
        }
        let mem = self.area(dst, &state, key)?;
        farm_core::fabric::check_bounds(dst, key, &mem, offset, data.len())?;
        mem.write(offset as usize, data);
        if dst != src.machine {
            state.traffic.write(data.len());
            if key == MemKey::Rings {
                self.ring(dst, src.thread, &state);
            }
        }
        Ok(WriteTicket(self.tickets.fetch_add(1, Ordering::AcqRel) + 1))
    }

    fn write_status(&self, src: Endpoint, dst: MachineId, ticket: WriteTicket) -> WriteStatus {
        let _ = (src, dst);
        // Writes are copies done before `write` returned: every ticket handed out is done.
        if ticket.0 != 0 && ticket.0 <= self.tickets.load(Ordering::Acquire) {
            WriteStatus::Done
        } else {
            WriteStatus::Failed
        }
    }

    fn send_datagram(&self, src: MachineId, dst: MachineId, data: &[u8], now: u64) {
        let _ = now;
        self.datagrams.send(src, dst, data);
    }

    fn recv_datagram(&self, dst: MachineId, _now: u64, buf: &mut Vec<u8>) -> Option<MachineId> {
        self.datagrams.recv_for(self.me, dst, false, buf)
    }

    fn recv_control(&self, dst: MachineId, _now: u64, buf: &mut Vec<u8>) -> Option<MachineId> {
        self.datagrams.recv_for(self.me, dst, true, buf)
    }

    fn traffic(&self, machine: MachineId) -> Vec<(MachineId, Traffic)> {
        assert_eq!(
            machine, self.me,
            "the shm fabric counts its own machine's traffic"
        );
        (self.machines.read().expect("machines poisoned").iter())
            .filter(|(m, _)| **m != self.me)
            .map(|(m, state)| (*m, state.traffic.get()))
            .collect()
    }

    fn admit(&self, machine: MachineId, members: &[MachineId]) {
        assert_eq!(machine, self.me, "a machine admits writers to itself only");
        let state = self.machine(machine);
        let bits = {
            let mut admitted = state.admitted.lock().expect("admitted poisoned");
            if admitted.is_none() {
                let path = machine_dir(&self.dir, machine).join("admitted");
                *admitted = Some(Arc::new(Nvram::open(&path).expect("created at start")));
            }
            admitted.clone().expect("mapped")
        };
        let mut words = [0u64; ADMIT_MACHINES_MAX / 64];
        for m in members {
            let i = m.0 as usize;
            assert!(
                i < ADMIT_MACHINES_MAX,
                "machine {m} past the admitted bitmap"
            );
            words[i / 64] |= 1 << (i % 64);
        }
        for (w, v) in words.iter().enumerate() {
            bits.store_u64(w * 8, *v, Ordering::Release);
        }
    }

    fn is_up(&self, machine: MachineId) -> bool {
        // A machine's own threads (its lease thread each round) see it up without a lock.
        machine == self.me || self.alive(machine, &self.machine(machine))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Threads of a process share a peer's liveness: one may read the clock, another check and
    /// store a later time, and the first then compare its earlier `now` with it. That must
    /// take the fresh answer, not panic on `now - checked` (it did: a machine process of
    /// `node_rejoin.rs` died at this line under load).
    #[test]
    fn a_liveness_check_newer_than_the_readers_clock_is_taken() {
        let dir = tempfile::tempdir().expect("temp dir");
        let m = Machine {
            lock_path: dir.path().join("alive"),
            alive: AtomicBool::new(true),
            checked: AtomicU64::new(2_000),
            areas: RwLock::new(HashMap::new()),
            admitted: Mutex::new(None),
            doorbell: Mutex::new(None),
            ring_held: AtomicU64::new(0),
            traffic: TrafficCounters::default(),
        };
        // Checked at 2,000 us by another thread; this one read the clock at 1,000 us.
        assert!(m.alive(1_000), "the fresh check said alive");
        // Long after, it probes again: no lock file, so not alive.
        assert!(!m.alive(2_000 + 2 * LIVENESS_CHECK.as_micros() as u64));
    }
}
