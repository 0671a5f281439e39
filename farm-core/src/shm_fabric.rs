//! The `shm` fabric: one process per machine on one host (DESIGN.md, Fabric).
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
//! Datagrams go over UDP on loopback, machine `m` at port `base_port + m`, each with the
//! cluster's id and its sender; datagrams of another cluster or malformed ones are dropped.
//! Lease datagrams are read with [`Fabric::recv_datagram`] (the lease thread), control
//! datagrams ([`CONTROL_TAG`]) with [`ShmFabric::recv_control`] (the CM's control thread);
//! whichever reads one of the other kind queues it for the other.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::fabric::{
    Endpoint, Fabric, FabricError, MemKey, RemoteMemory, WriteStatus, WriteTicket, CONTROL_TAG,
};
use crate::ids::MachineId;
use crate::nvram::Nvram;

/// How stale a machine's liveness may be when an operation relies on it.
pub const LIVENESS_CHECK: Duration = Duration::from_millis(1);

/// Machines an `admitted` file can name (one bit each).
pub const ADMIT_MACHINES_MAX: usize = 512;

const DATAGRAM_MAGIC: u32 = 0xfa53_d6a7;
const DATAGRAM_HEADER_BYTES: usize = 4 + 8 + 2;
/// Largest datagram payload (a NEW-CONFIG carries the region map).
pub const DATAGRAM_BYTES_MAX: usize = 60 << 10;

/// The file of `key` in a machine's NVRAM directory (`<dir>/m<id>/`).
pub fn area_file(key: MemKey) -> String {
    match key {
        MemKey::Region(r) => format!("region-{}", r.0),
        MemKey::Rings => "rings".to_string(),
        MemKey::Feedback => "feedback".to_string(),
    }
}

/// A machine's NVRAM directory under the cluster's directory.
pub fn machine_dir(dir: &Path, machine: MachineId) -> PathBuf {
    dir.join(format!("m{}", machine.0))
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
    doorbell: Mutex<Option<Arc<Nvram>>>,
}

impl Machine {
    /// Whether its process lives, as checked at most [`LIVENESS_CHECK`] before `now` (in
    /// microseconds since the fabric started).
    fn alive(&self, now: u64) -> bool {
        let checked = self.checked.load(Ordering::Acquire);
        if checked != 0 && now - checked < LIVENESS_CHECK.as_micros() as u64 {
            return self.alive.load(Ordering::Acquire);
        }
        let alive = probe_alive(&self.lock_path);
        self.alive.store(alive, Ordering::Release);
        self.checked.store(now, Ordering::Release);
        alive
    }
}

/// This process's machine: the lock that says it lives, its socket.
#[derive(Debug)]
struct Local {
    id: MachineId,
    _alive: File,
    socket: UdpSocket,
    /// This machine's doorbell (see [`ShmFabric::wait_for_writes`]).
    doorbell: Arc<Nvram>,
}

/// The `shm` fabric of one process. See the module docs.
#[derive(Debug)]
pub struct ShmFabric {
    dir: PathBuf,
    cluster: u64,
    base_port: u16,
    epoch: Instant,
    local: Local,
    /// Read on every operation (the lease thread's included: a writer's lock held by a
    /// descheduled worker would delay it), written once per machine.
    machines: RwLock<HashMap<MachineId, Arc<Machine>>>,
    /// The last write ticket handed out. Writes are copies done before `write` returns, so
    /// every ticket up to it is done; one counter for every link keeps each link's tickets
    /// increasing without a lock on the write path.
    tickets: AtomicU64,
    /// A socket to send from (any machine's datagrams carry their sender inside).
    sender: UdpSocket,
    /// Datagrams read by the other kind's reader: (sender, payload).
    lease_in: Mutex<VecDeque<(MachineId, Vec<u8>)>>,
    control_in: Mutex<VecDeque<(MachineId, Vec<u8>)>>,
}

/// Why the fabric could not start.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// The NVRAM directory holds another cluster's machines.
    #[error(
        "the NVRAM directory {dir} belongs to cluster {found:#x}, not {expected:#x}: use \
         another directory, or the cluster id it was created with"
    )]
    OtherCluster {
        /// The directory.
        dir: String,
        /// The cluster id stamped in it.
        found: u64,
        /// The cluster id asked for.
        expected: u64,
    },
    /// Another live process runs this machine.
    #[error("machine {0} already runs in another process (its `alive` lock is held)")]
    AlreadyRunning(MachineId),
    /// The directory or the socket failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ShmError {
    let what = what.into();
    move |source| ShmError::Io { what, source }
}

impl ShmFabric {
    /// The fabric of the process that runs machine `me` of cluster `cluster`, whose machines
    /// keep their NVRAM under `dir`: checks that `dir` is this cluster's (stamping it when
    /// new), takes `me`'s `alive` lock (failing if another live process holds it) and binds
    /// its datagram port, `base_port + me`, on loopback.
    pub fn start(
        dir: &Path,
        cluster: u64,
        me: MachineId,
        base_port: u16,
    ) -> Result<Self, ShmError> {
        std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        stamp_cluster(dir, me, cluster)?;
        let mdir = machine_dir(dir, me);
        std::fs::create_dir_all(&mdir).map_err(io_err(format!("creating {}", mdir.display())))?;
        let path = mdir.join("alive");
        let alive = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err(format!("opening {}", path.display())))?;
        match alive.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Err(ShmError::AlreadyRunning(me)),
            Err(TryLockError::Error(e)) => {
                return Err(io_err(format!("locking {}", path.display()))(e))
            }
        }
        let port = port_of(base_port, me);
        let socket = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
            .map_err(io_err(format!("binding UDP port {port} on loopback")))?;
        socket
            .set_nonblocking(true)
            .map_err(io_err("making the datagram socket non-blocking"))?;
        let sender = socket
            .try_clone()
            .map_err(io_err("cloning the datagram socket"))?;
        // The admitted set starts empty, also after a restart (the file is the previous
        // life's): nobody writes here until this process installs a configuration, so a peer
        // sees this machine ready only once it runs one.
        let admitted = mdir.join("admitted");
        let bits = Nvram::file(&admitted, ADMIT_MACHINES_MAX / 8)
            .map_err(io_err(format!("creating {}", admitted.display())))?;
        for w in 0..ADMIT_MACHINES_MAX / 64 {
            bits.store_u64(w * 8, 0, Ordering::Release);
        }
        let path = mdir.join("doorbell");
        let doorbell = Arc::new(
            Nvram::file(&path, DOORBELL_BYTES)
                .map_err(io_err(format!("creating {}", path.display())))?,
        );
        Ok(Self {
            dir: dir.to_path_buf(),
            cluster,
            base_port,
            epoch: Instant::now(),
            local: Local {
                id: me,
                _alive: alive,
                socket,
                doorbell,
            },
            machines: RwLock::new(HashMap::new()),
            tickets: AtomicU64::new(0),
            sender,
            lease_in: Mutex::new(VecDeque::new()),
            control_in: Mutex::new(VecDeque::new()),
        })
    }

    /// The machine this process runs.
    pub fn me(&self) -> MachineId {
        self.local.id
    }

    /// How many writes into this machine's rings peers have announced: read it, look for
    /// work, then [`ShmFabric::wait_for_writes`] with it.
    pub fn writes_seen(&self) -> u64 {
        self.local
            .doorbell
            .load_u64(DOORBELL_COUNT, Ordering::Acquire)
    }

    /// Sleeps until a peer writes into this machine's rings after `seen` (from
    /// [`ShmFabric::writes_seen`]) or `timeout` passes: an idle poller wakes for a peer's LOCK
    /// or message at once instead of at its next timer, and costs no CPU meanwhile. The
    /// writer rings the doorbell, a futex word in `<dir>/m<id>/doorbell`, after its write.
    pub fn wait_for_writes(&self, seen: u64, timeout: Duration) {
        let bell = &self.local.doorbell;
        bell.fetch_add_u64(DOORBELL_WAITERS, 1);
        if bell.load_u64(DOORBELL_COUNT, Ordering::Acquire) == seen {
            bell.futex_wait(DOORBELL_COUNT, seen as u32, timeout);
        }
        bell.fetch_sub_u64(DOORBELL_WAITERS, 1);
    }

    /// Announces a write into `dst`'s rings, waking its pollers if they wait.
    fn ring(&self, dst: MachineId, state: &Machine) {
        let bell = {
            let mut bell = state.doorbell.lock().expect("doorbell poisoned");
            if bell.is_none() {
                let path = machine_dir(&self.dir, dst).join("doorbell");
                // A peer from before doorbells, or one gone: its pollers wake by their timers.
                *bell = Nvram::open(&path).ok().map(Arc::new);
            }
            bell.clone()
        };
        if let Some(bell) = bell {
            bell.fetch_add_u64(DOORBELL_COUNT, 1);
            if bell.load_u64(DOORBELL_WAITERS, Ordering::Acquire) > 0 {
                bell.futex_wake(DOORBELL_COUNT);
            }
        }
    }

    /// Whether machine `m` is running and takes this machine's writes to its logs: its
    /// process lives, its rings are mapped and it admitted this machine. A machine whose
    /// commits need `m` waits for this before its first transaction.
    pub fn ready(&self, m: MachineId) -> bool {
        let state = self.machine(m);
        self.alive(m, &state)
            && self.admits(m, &state, self.local.id)
            && self.area(m, &state, MemKey::Rings).is_ok()
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
                })
            })
            .clone()
    }

    /// Whether machine `m`'s process lives, checked at most [`LIVENESS_CHECK`] ago.
    fn alive(&self, m: MachineId, state: &Machine) -> bool {
        m == self.local.id || state.alive(micros_since(self.epoch))
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

impl ShmFabric {
    /// Takes one control datagram ([`CONTROL_TAG`]) for this machine into `buf`, returning its
    /// sender; lease datagrams read on the way are kept for [`Fabric::recv_datagram`].
    pub fn recv_control(&self, buf: &mut Vec<u8>) -> Option<MachineId> {
        self.recv_kind(true, buf)
    }

    /// One datagram of the kind asked (control or not), queued or from the socket.
    fn recv_kind(&self, control: bool, buf: &mut Vec<u8>) -> Option<MachineId> {
        let (mine, theirs) = if control {
            (&self.control_in, &self.lease_in)
        } else {
            (&self.lease_in, &self.control_in)
        };
        if let Some((src, data)) = mine.lock().expect("datagrams poisoned").pop_front() {
            buf.clear();
            buf.extend_from_slice(&data);
            return Some(src);
        }
        RECV_BUF.with_borrow_mut(|raw| self.recv_socket(control, theirs, raw, buf))
    }

    fn recv_socket(
        &self,
        control: bool,
        theirs: &Mutex<VecDeque<(MachineId, Vec<u8>)>>,
        raw: &mut Vec<u8>,
        buf: &mut Vec<u8>,
    ) -> Option<MachineId> {
        raw.resize(DATAGRAM_HEADER_BYTES + DATAGRAM_BYTES_MAX, 0);
        loop {
            let n = match self.local.socket.recv_from(raw) {
                Ok((n, _)) => n,
                Err(_) => return None, // WouldBlock: nothing due.
            };
            if n < DATAGRAM_HEADER_BYTES
                || raw[..4] != DATAGRAM_MAGIC.to_le_bytes()
                || raw[4..12] != self.cluster.to_le_bytes()
            {
                continue; // Not this cluster's, or malformed: dropped unread.
            }
            let src = MachineId(u16::from_le_bytes([raw[12], raw[13]]));
            let payload = &raw[DATAGRAM_HEADER_BYTES..n];
            if payload.first().is_some_and(|b| *b == CONTROL_TAG) != control {
                theirs
                    .lock()
                    .expect("datagrams poisoned")
                    .push_back((src, payload.to_vec()));
                continue;
            }
            buf.clear();
            buf.extend_from_slice(payload);
            return Some(src);
        }
    }
}

thread_local! {
    /// Each reader thread's receive buffer, allocated once.
    static RECV_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Microseconds since `epoch`, never 0 (which means "never checked").
fn micros_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_micros() as u64 + 1
}

fn port_of(base: u16, m: MachineId) -> u16 {
    base.checked_add(m.0)
        .expect("datagram port past 65535: lower the base port")
}

/// The doorbell file: a count of writes peers made into the machine's rings (a futex word) and
/// how many of its pollers wait on it.
const DOORBELL_BYTES: usize = 16;
const DOORBELL_COUNT: usize = 0;
const DOORBELL_WAITERS: usize = 8;

/// Stamps `dir` with the cluster id, or checks the stamp already there: a directory holds the
/// NVRAM of one cluster only. The stamp appears whole (written aside, then linked into place),
/// so racing first processes of one cluster all read the same id.
fn stamp_cluster(dir: &Path, me: MachineId, cluster: u64) -> Result<(), ShmError> {
    let stamp = dir.join("cluster");
    if !stamp.exists() {
        let aside = dir.join(format!("cluster.m{}", me.0));
        std::fs::write(&aside, format!("{cluster:#x}\n"))
            .map_err(io_err(format!("writing {}", aside.display())))?;
        // Fails if another process linked its stamp first: then that one is checked below.
        let _ = std::fs::hard_link(&aside, &stamp);
        let _ = std::fs::remove_file(&aside);
    }
    let text =
        std::fs::read_to_string(&stamp).map_err(io_err(format!("reading {}", stamp.display())))?;
    let found = u64::from_str_radix(text.trim().trim_start_matches("0x"), 16).map_err(|e| {
        io_err(format!("reading {}", stamp.display()))(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a cluster id: {e}"),
        ))
    })?;
    if found != cluster {
        return Err(ShmError::OtherCluster {
            dir: dir.display().to_string(),
            found,
            expected: cluster,
        });
    }
    Ok(())
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
        crate::fabric::check_bounds(self.dst, self.key, &self.mem, offset, buf.len())?;
        self.mem.read(offset as usize, buf);
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
            machine, self.local.id,
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
        crate::fabric::check_bounds(dst, key, &mem, offset, data.len())?;
        mem.write(offset as usize, data);
        if key == MemKey::Rings && dst != src.machine {
            self.ring(dst, &state);
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
        if data.len() > DATAGRAM_BYTES_MAX {
            return;
        }
        let mut msg = Vec::with_capacity(DATAGRAM_HEADER_BYTES + data.len());
        msg.extend_from_slice(&DATAGRAM_MAGIC.to_le_bytes());
        msg.extend_from_slice(&self.cluster.to_le_bytes());
        msg.extend_from_slice(&src.0.to_le_bytes());
        msg.extend_from_slice(data);
        let to = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port_of(self.base_port, dst));
        // Unreliable by contract: a full buffer or a dead peer loses the datagram.
        let _ = self.sender.send_to(&msg, to);
    }

    fn recv_datagram(&self, dst: MachineId, now: u64, buf: &mut Vec<u8>) -> Option<MachineId> {
        let _ = now;
        if dst != self.local.id {
            return None;
        }
        self.recv_kind(false, buf)
    }

    fn admit(&self, machine: MachineId, members: &[MachineId]) {
        assert_eq!(
            machine, self.local.id,
            "a machine admits writers to itself only"
        );
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
        machine == self.local.id || self.alive(machine, &self.machine(machine))
    }
}
