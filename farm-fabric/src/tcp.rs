//! The `tcp` fabric: one process per machine, on different hosts (docs/ARCHITECTURE.md, Fabric).
//!
//! Each process runs a NIC: a listener thread and, per connected peer, a serving thread that
//! performs the peer's one-sided reads and writes on this machine's registered memory, so that
//! worker threads stay uninvolved, as with an RDMA NIC. A write into the rings rings the
//! machine's doorbell, which its idle pollers sleep on.
//!
//! The requesting side keeps one connection (a queue pair) per peer. Requests are pipelined:
//! `write` sends and returns a ticket at once, and the peer's NIC answers requests in the order
//! they arrived, so a ticket is done once the answer to it or to a later request arrived; a
//! read waits for its answer only. No thread of its own takes the answers: whoever checks on a
//! request of the connection (a write's status, a posted read) takes what has arrived without
//! blocking, as a poll of a completion queue does, so an executor that polls its work gets its
//! answers with no thread woken in between. A thread that must block for an answer leads: it
//! waits on the socket and takes every answer for the others, who sleep until theirs came or
//! the lead is free ([`Replies`]). A ticker per connection takes what nobody polled for and
//! breaks the connection when an answer is overdue. Writes from
//! this process to one peer land in order, each in increasing address order. An object read
//! (`RemoteMemory::read_object`) is one request: the NIC copies the object and reads its header
//! word again after the copy, the seqlock's second load, and answers with both; posted object
//! reads (`RemoteMemory::post_object_read`) go out at once and are waited for later.
//!
//! Failures: a connection that closes, or leaves a request unanswered for the fabric's
//! timeout, breaks: its unanswered reads fail, and further reads fail with
//! [`FabricError::Unreachable`] at once. While the peer is a member of this machine's
//! configuration (admitted, [`Fabric::admit`]) the link is repaired in place: its writes wait,
//! and new ones queue behind them, while a repairer connects again and resumes the link's
//! session at the peer's NIC, which says the last write it took ([`Session`]); the link sends
//! again exactly the writes after that one, in order ([`Link::repair`]), so every write lands
//! once. A NIC that holds no session to resume (its process restarted, or it removed this
//! machine since) refuses, as does the link itself when the NIC refused a write whose answer
//! was lost (it would count as done), and the link stays broken while the peer is a member, as a queue
//! pair in the error state does: reconnecting to another incarnation could land a later write
//! to a log whose earlier one was lost. Once this machine removed the peer, the link's waiting
//! writes fail and it connects again on its next use (reads: the CM probes a joiner), and a
//! peer admitted again is a new incarnation whose rings start afresh. A peer never connected to is connected to on first use, by a
//! probe (a read of its replicas list) if it is not a member. Sends never block (what the
//! socket does not take waits in the link).
//!
//! What the NIC refuses, with a logged reason, changing nothing (each counted in
//! [`TcpFabric::rejections`]): a connection from another cluster or for another machine, one
//! that cannot prove the cluster's secret after its hello ([`crate::auth`]), bad framing (its connection is closed, as the stream cannot be trusted after it), an access
//! outside a registered area or to an unregistered one, a write from a machine this machine
//! has not admitted (precise membership, §5.2), and a resumption of a session it does not
//! hold. Reads from the cluster's machines are served
//! whether or not they are members: the CM probes, and new backups copy, before they are.
//!
//! Datagrams go over UDP to each machine's listed address ([`crate::process`]).

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::auth::{self, Handshake, Secret, NONCE_BYTES, PROOF_BYTES};
use crate::process::{claim_machine, io_err, Claim, Datagrams, Peers, ProcessFabric, StartError};
use farm_core::fabric::{
    check_bounds, Endpoint, Fabric, FabricError, MemKey, PostedRead, RemoteMemory, Traffic,
    TrafficCounters, WriteStatus, WriteTicket,
};
use farm_core::ids::{MachineId, RegionId, ThreadId};
use farm_core::nvram::Nvram;
use farm_core::object::{judge_copy, ReadOutcome, HEADER_BYTES};

/// Machines the NIC's admitted set can name.
pub const ADMIT_MACHINES_MAX: usize = 512;
/// Largest one-sided read or write, and largest answer; a request for more is bad framing.
pub const OP_BYTES_MAX: usize = 64 << 20;

const MAGIC: u32 = 0xfa53_7c90;
/// The version of this fabric's protocol (hellos, requests, replies), bumped with any change to
/// them: 2 added the `Replicas` area, 3 the object read, 4 the proof of the cluster's secret
/// after the hello, 5 the writing thread in each request (whose doorbell slot a write into the
/// rings rings), 6 the members a machine cannot write to in its `Replicas` area (which
/// reconfiguration probes read), 7 lease datagrams that say how long the CM's own leases have
/// lapsed (`farm_cm::LeaseMsg`, whose older encoding a newer machine drops), 8 the repair of a
/// broken connection in place (a hello that resumes its link's session, and the last write the
/// NIC took in it after the acknowledgement), 9 the last write the NIC refused beside it. A hello also carries the version of the records and
/// messages that travel inside ring writes (`farm_core::wire::WIRE_VERSION`); a peer that
/// differs in either is refused at its hello, and both sides say which versions met.
pub const VERSION: u16 = 9;
const RECORDS: u8 = farm_core::wire::WIRE_VERSION;
const HELLO_BYTES: usize = 24;
const ACK_BYTES: usize = 8;
const REQUEST_BYTES: usize = 32;
const REPLY_BYTES: usize = 16;

/// How long a thread that leads the taking of a connection's answers waits on its socket at a
/// time before it looks at its own answer and deadline again.
const LEAD_SLICE: Duration = Duration::from_millis(1);
/// How often a connection's ticker takes answers nobody polled for, at most.
const TICK_MAX: Duration = Duration::from_millis(10);
/// The repairer's first pause before connecting again (`LinkInner::repair_pause`).
const REPAIR_PAUSE_MIN: Duration = Duration::from_millis(1);

const OP_READ: u8 = 1;
const OP_WRITE: u8 = 2;
const OP_PROBE: u8 = 3;
/// A read of an object: the bytes, then the object's header word read again after the copy
/// (`RemoteMemory::read_object`: the torn-read check inside one operation).
const OP_READ_OBJECT: u8 = 4;

/// Whether operation `op` of `len` bytes is longer than one operation may be: its request or
/// its answer (an object read answers with the header word again) over [`OP_BYTES_MAX`].
fn op_too_long(op: u8, len: usize) -> bool {
    let answer = if op == OP_READ_OBJECT {
        len.saturating_add(HEADER_BYTES)
    } else {
        len
    };
    answer > OP_BYTES_MAX
}

const OK: u8 = 0;
const NOT_REGISTERED: u8 = 1;
const OUT_OF_BOUNDS: u8 = 2;
const NOT_ADMITTED: u8 = 3;

/// Probe reply flags: the target admits the prober; its rings are registered.
const PROBE_ADMITS: u8 = 1;
const PROBE_RINGS: u8 = 2;

/// Why a connection was refused, as its acknowledgement says.
const ACK_OK: u32 = 0;
const ACK_BAD_FRAMING: u32 = 1;
const ACK_OTHER_CLUSTER: u32 = 2;
const ACK_OTHER_MACHINE: u32 = 3;
/// The low byte of the acknowledgement; above it, the refusing side's record version (bits
/// 8-15) and fabric version (bits 16-31).
const ACK_OTHER_VERSION: u32 = 4;
/// The hello is this cluster's: prove the secret (the acceptor's nonce and proof follow).
const ACK_CHALLENGE: u32 = 5;
/// The connecting side's proof of the cluster's secret did not hold.
const ACK_NOT_PROVED: u32 = 6;
/// A hello that resumes a session this NIC does not hold (it restarted, or removed the
/// connecting machine since): nothing to repair.
const ACK_NO_SESSION: u32 = 7;

/// Why a side of a connection refuses the other's proof of the cluster's secret.
const NOT_PROVED: &str = "it does not hold the cluster's secret";

/// Hello flag: the connection resumes its link's session (see [`Session`]).
const HELLO_RESUME: u8 = 1;

/// The acknowledgement refusing a peer of other versions: it names this build's.
const fn other_version_ack() -> u32 {
    ACK_OTHER_VERSION | (RECORDS as u32) << 8 | (VERSION as u32) << 16
}

/// Why a peer's acknowledgement `verdict` refused this machine's hello.
fn refusal(verdict: u32) -> String {
    match verdict & 0xff {
        ACK_OTHER_CLUSTER => "it belongs to another cluster".into(),
        ACK_OTHER_MACHINE => "it is not that machine".into(),
        ACK_OTHER_VERSION => format!(
            "it speaks fabric protocol {} with records of version {}; this build speaks {VERSION} \
             with records of version {RECORDS}",
            verdict >> 16,
            (verdict >> 8) & 0xff
        ),
        ACK_NOT_PROVED => "it refused this machine's proof of the cluster's secret (the two \
                           hold different secrets)"
            .into(),
        ACK_NO_SESSION => "it holds no session to resume (it restarted, or removed this machine \
                           since)"
            .into(),
        _ => "it does not speak this protocol".into(),
    }
}

/// Why a connection could not be opened: the network, or the peer's refusal (its
/// acknowledgement's verdict).
#[derive(Debug)]
enum Handshaken {
    Io(io::Error),
    Refused(u32),
    /// The peer did not prove the cluster's secret.
    NotProved,
}

impl From<io::Error> for Handshaken {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// How long a new connection may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// The `tcp` fabric of one process. See the module docs.
#[derive(Debug)]
pub struct TcpFabric {
    me: MachineId,
    /// This machine's directory, held while the process lives.
    claim: Claim,
    served: Arc<Served>,
    /// One link per machine of the address list.
    links: Vec<Arc<Link>>,
    datagrams: Datagrams,
    listener: Mutex<Option<JoinHandle<()>>>,
}

impl TcpFabric {
    /// The fabric of the process that runs machine `me` of cluster `cluster`, whose machines
    /// listen at `addrs` (machine `m` at `addrs[m]`, TCP for one-sided operations and UDP for
    /// datagrams): claims `me`'s NVRAM directory under `dir` (as the `shm` fabric does),
    /// binds its address and starts its NIC. An operation unanswered for `timeout` breaks its
    /// connection. Connections and datagrams prove the cluster's `secret` (`crate::auth`).
    pub fn start(
        dir: &Path,
        cluster: u64,
        me: MachineId,
        addrs: Vec<SocketAddr>,
        timeout: Duration,
        secret: Secret,
    ) -> Result<Self, StartError> {
        let Some(&addr) = addrs.get(me.0 as usize) else {
            return Err(StartError::Invalid(format!(
                "machine {me} has no address: {} listed",
                addrs.len()
            )));
        };
        if addrs.len() > ADMIT_MACHINES_MAX {
            return Err(StartError::Invalid(format!(
                "{} machines listed, at most {ADMIT_MACHINES_MAX}",
                addrs.len()
            )));
        }
        if timeout.is_zero() {
            return Err(StartError::Invalid("the operation timeout is zero".into()));
        }
        let claim = claim_machine(dir, cluster, me)?;
        let datagrams = Datagrams::bind(
            cluster,
            me,
            Peers::Listed(addrs.clone()),
            secret.clone(),
            claim.incarnation,
        )?;
        let listener = TcpListener::bind(addr).map_err(io_err(format!("listening at {addr}")))?;
        listener
            .set_nonblocking(true)
            .map_err(io_err("making the listener non-blocking"))?;
        let admitted = Arc::new(Admitted(
            (0..ADMIT_MACHINES_MAX / 64)
                .map(|_| AtomicU64::new(0))
                .collect(),
        ));
        let served = Arc::new(Served {
            me,
            cluster,
            machines: addrs.len(),
            areas: RwLock::new(HashMap::new()),
            admitted: admitted.clone(),
            doorbell: claim.doorbell.clone(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            rejections: AtomicU64::new(0),
            secret: secret.clone(),
            sessions: Mutex::new(HashMap::new()),
        });
        let accept = {
            let served = served.clone();
            std::thread::Builder::new()
                .name(format!("farm-nic-{}", me.0))
                .spawn(move || accept(listener, served))
                .map_err(io_err("starting the NIC thread"))?
        };
        let links = addrs
            .iter()
            .enumerate()
            .map(|(m, &addr)| {
                Arc::new_cyclic(|this| Link {
                    this: this.clone(),
                    stopped: AtomicBool::new(false),
                    me,
                    dst: MachineId(m as u16),
                    addr,
                    cluster,
                    timeout,
                    secret: secret.clone(),
                    admitted: admitted.clone(),
                    inner: Mutex::new(LinkInner {
                        state: LinkState::Idle,
                        next_id: 1,
                        outbox: Vec::new(),
                        unsent: 0,
                        sending: Vec::new(),
                        sending_at: 0,
                        epoch: 0,
                        window: Window::default(),
                        repairs: 0,
                        down_since: None,
                        resent_upto: 0,
                        repair_pause: REPAIR_PAUSE_MIN,
                    }),
                    acked: AtomicU64::new(0),
                    failed_any: AtomicBool::new(false),
                    failed: Mutex::new(Vec::new()),
                    waiters: Mutex::new(HashMap::new()),
                    current: Mutex::new(None),
                    backed_up: AtomicBool::new(false),
                    traffic: TrafficCounters::default(),
                })
            })
            .collect();
        Ok(Self {
            me,
            claim,
            served,
            links,
            datagrams,
            listener: Mutex::new(Some(accept)),
        })
    }

    /// Requests and connections this machine's NIC refused (another cluster, bad framing, an
    /// access outside registered memory, a write from a machine not admitted, a resumption of
    /// a session it does not hold).
    pub fn rejections(&self) -> u64 {
        self.served.rejections.load(Ordering::Relaxed)
    }

    fn link(&self, m: MachineId) -> Result<&Arc<Link>, FabricError> {
        self.links
            .get(m.0 as usize)
            .ok_or(FabricError::Unreachable(m))
    }
}

impl Drop for TcpFabric {
    fn drop(&mut self) {
        self.served.stop.store(true, Ordering::SeqCst);
        // The listener sees `stop` within a poll and closes the socket, so that a next
        // incarnation in this process can listen at the same address.
        if let Some(h) = self.listener.lock().expect("listener poisoned").take() {
            let _ = h.join();
        }
        for conn in self.served.conns.lock().expect("conns poisoned").values() {
            conn.closed.store(true, Ordering::SeqCst);
            let _ = conn.stream.shutdown(Shutdown::Both);
        }
        for link in &self.links {
            link.close();
        }
    }
}

/// The NIC's side: what peers may read and write.
#[derive(Debug)]
struct Served {
    me: MachineId,
    cluster: u64,
    machines: usize,
    areas: RwLock<HashMap<MemKey, Arc<Nvram>>>,
    /// Machines whose writes land, the members of this machine's configuration.
    admitted: Arc<Admitted>,
    doorbell: crate::process::Doorbell,
    stop: AtomicBool,
    /// Accepted connections, to close at stop or when their machine is removed.
    conns: Mutex<HashMap<u64, Inbound>>,
    next_conn: AtomicU64,
    rejections: AtomicU64,
    /// The cluster's secret, which every connection proves before its first operation.
    secret: Secret,
    /// Per connecting machine, the session of its link (see [`Session`]).
    sessions: Mutex<HashMap<MachineId, Arc<Mutex<Session>>>>,
}

/// What the NIC keeps of one peer's link across its connections, so that a connection that
/// broke can be repaired in place: the peer sends again every write it had no answer to, and
/// the NIC says which it took already. A connection that says hello afresh starts a new
/// session (the peer's link restarted: its membership changed, or its process did); one that
/// resumes continues the session its link epoch names, if this NIC still holds it.
#[derive(Debug)]
struct Session {
    /// The link's epoch, from its fresh hello.
    epoch: u32,
    /// The connection whose writes land: a later one of the session takes over, and the
    /// earlier one's serving thread applies nothing more.
    owner: u64,
    /// Set when a later session of the machine replaced this one, or this machine removed
    /// it ([`Served::close_from`]): no connection applies anything more of it.
    retired: bool,
    /// The id of the last write taken (applied or refused) in the session.
    last: u64,
    /// The id of the last write refused in the session: a resumption tells the peer, which
    /// goes on only if it heard that refusal (answers come in order), since a write taken
    /// without the peer hearing its answer counts as done.
    refused_upto: u64,
}

/// The admitted set, one bit per machine.
#[derive(Debug)]
struct Admitted(Vec<AtomicU64>);

impl Admitted {
    fn contains(&self, m: MachineId) -> bool {
        let i = m.0 as usize;
        i < ADMIT_MACHINES_MAX && self.0[i / 64].load(Ordering::Acquire) & (1 << (i % 64)) != 0
    }
}

/// A connection a peer opened.
#[derive(Debug)]
struct Inbound {
    stream: TcpStream,
    /// The peer, once it said hello.
    src: Option<MachineId>,
    /// Set when the connection is closed on purpose: its serving thread applies nothing more.
    closed: Arc<AtomicBool>,
}

impl Served {
    fn admits(&self, m: MachineId) -> bool {
        self.admitted.contains(m)
    }

    /// Closes every connection machine `m` opened, and retires its session: a write it queued
    /// must not land in a later incarnation's rings. The retirement waits for a write being
    /// applied, and every later one finds it (also on a connection that resumed the session
    /// just before).
    fn close_from(&self, m: MachineId) {
        let session = self.sessions.lock().expect("sessions poisoned").remove(&m);
        if let Some(s) = session {
            let owner = {
                let mut s = s.lock().expect("session poisoned");
                s.retired = true;
                s.owner
            };
            // Its connection, which may not have said whose it is yet.
            self.close_conn(owner);
        }
        for conn in self.conns.lock().expect("conns poisoned").values() {
            if conn.src == Some(m) {
                conn.closed.store(true, Ordering::SeqCst);
                let _ = conn.stream.shutdown(Shutdown::Both);
            }
        }
    }

    fn area(&self, key: MemKey) -> Option<Arc<Nvram>> {
        self.areas
            .read()
            .expect("areas poisoned")
            .get(&key)
            .cloned()
    }

    /// This machine's area `key`, for its own operations.
    fn registered(&self, key: MemKey) -> Result<Arc<Nvram>, FabricError> {
        self.area(key).ok_or(FabricError::NotRegistered {
            machine: self.me,
            key,
        })
    }

    fn reject(&self) {
        self.rejections.fetch_add(1, Ordering::Relaxed);
    }

    /// Closes connection `id` (superseded in its session: its thread may wait on a socket
    /// whose peer is gone, with nothing to tell it).
    fn close_conn(&self, id: u64) {
        if let Some(conn) = self.conns.lock().expect("conns poisoned").get(&id) {
            conn.closed.store(true, Ordering::SeqCst);
            let _ = conn.stream.shutdown(Shutdown::Both);
        }
    }

    /// The session connection `conn` from `src` serves, after a hello for `epoch` that
    /// resumes the link's session (`resume`) or starts a new one; `None` if there is no such
    /// session to resume. The connection it takes over from is closed.
    fn take_session(
        &self,
        src: MachineId,
        conn: u64,
        epoch: u32,
        resume: bool,
    ) -> Option<Arc<Mutex<Session>>> {
        let (session, replaced) = {
            let mut sessions = self.sessions.lock().expect("sessions poisoned");
            match sessions.get(&src) {
                Some(s) if resume => (s.clone(), None),
                _ if resume => return None,
                _ => {
                    let s = Arc::new(Mutex::new(Session {
                        epoch,
                        owner: conn,
                        retired: false,
                        last: 0,
                        refused_upto: 0,
                    }));
                    (s.clone(), sessions.insert(src, s))
                }
            }
        };
        // Outside the map's lock: a session's is held while a write is applied.
        let superseded = match replaced {
            Some(old) => {
                let mut old = old.lock().expect("session poisoned");
                old.retired = true;
                old.owner
            }
            None => {
                let mut s = session.lock().expect("session poisoned");
                if s.retired || s.epoch != epoch {
                    return None;
                }
                std::mem::replace(&mut s.owner, conn)
            }
        };
        if superseded != conn {
            self.close_conn(superseded);
        }
        Some(session)
    }
}

/// How often the listener looks for new connections and for the fabric stopping (connections
/// are made once per peer, so a few milliseconds at accept cost nothing).
const ACCEPT_POLL: Duration = Duration::from_millis(2);

/// The listener thread: accepts connections, each served by a thread of its own, until the
/// fabric stops.
fn accept(listener: TcpListener, served: Arc<Served>) {
    while !served.stop.load(Ordering::SeqCst) {
        let conn = match listener.accept() {
            Ok((conn, _)) => conn,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(_) => continue,
        };
        if conn.set_nonblocking(false).is_err() {
            continue;
        }
        let Ok(clone) = conn.try_clone() else {
            continue;
        };
        let id = served.next_conn.fetch_add(1, Ordering::Relaxed);
        let closed = Arc::new(AtomicBool::new(false));
        served.conns.lock().expect("conns poisoned").insert(
            id,
            Inbound {
                stream: clone,
                src: None,
                closed: closed.clone(),
            },
        );
        let served2 = served.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("farm-nic-{}-serve", served.me.0))
            .spawn(move || {
                let peer = conn.peer_addr().ok();
                if let Err(reason) = serve(conn, &served2, id, &closed) {
                    tracing::debug!(machine = served2.me.0, ?peer, %reason, "connection ended");
                }
                served2.conns.lock().expect("conns poisoned").remove(&id);
            });
        if spawned.is_err() {
            served.conns.lock().expect("conns poisoned").remove(&id);
        }
    }
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum ConnEnd {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("refused: {0}")]
    Refused(String),
}

/// Serves one peer's connection: its hello, then its requests in order.
fn serve(
    stream: TcpStream,
    served: &Served,
    conn_id: u64,
    closed: &AtomicBool,
) -> Result<(), ConnEnd> {
    let peer = stream.peer_addr()?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let mut input = Frames::new(stream.try_clone()?);
    let mut out = BufWriter::with_capacity(256 << 10, stream);
    if !input.fill(HELLO_BYTES)? {
        return Err(ConnEnd::Refused("no hello in time".into()));
    }
    let hello: [u8; HELLO_BYTES] = input.take(HELLO_BYTES).try_into().expect("a hello");
    let (src, verdict) = check_hello(&hello, served);
    if verdict != ACK_OK {
        served.reject();
        let reason = match verdict & 0xff {
            ACK_OTHER_CLUSTER => "another cluster's".to_string(),
            ACK_OTHER_MACHINE => "for another machine".to_string(),
            ACK_OTHER_VERSION => format!(
                "machine {} speaks fabric protocol {} with records of version {}; this build \
                 speaks {VERSION} with records of version {RECORDS}",
                src.0,
                u16::from_le_bytes([hello[4], hello[5]]),
                hello[10]
            ),
            _ => "bad framing in its hello".to_string(),
        };
        tracing::warn!(machine = served.me.0, %peer, "refused a connection: {reason}");
        out.write_all(&MAGIC.to_le_bytes())?;
        out.write_all(&verdict.to_le_bytes())?;
        out.flush()?;
        return Err(ConnEnd::Refused(reason));
    }
    // The hello is this cluster's: both sides prove they hold its secret before anything is
    // read or written (`crate::auth`).
    if !input.fill(NONCE_BYTES)? {
        return Err(ConnEnd::Refused("no nonce in time".into()));
    }
    let handshake = Handshake {
        secret: &served.secret,
        hello: &hello,
        connecting: input.take(NONCE_BYTES).try_into().expect("a nonce"),
        accepting: auth::nonce(),
    };
    out.write_all(&MAGIC.to_le_bytes())?;
    out.write_all(&ACK_CHALLENGE.to_le_bytes())?;
    out.write_all(&handshake.accepting)?;
    out.write_all(&handshake.accepting_proof())?;
    out.flush()?;
    if !input.fill(PROOF_BYTES)? {
        return Err(ConnEnd::Refused(
            "no proof of the cluster's secret in time".into(),
        ));
    }
    if !handshake.connecting_proved(input.take(PROOF_BYTES)) {
        served.reject();
        let reason = NOT_PROVED.to_string();
        tracing::warn!(machine = served.me.0, src = src.0, %peer,
            "refused a connection: {reason}");
        out.write_all(&MAGIC.to_le_bytes())?;
        out.write_all(&ACK_NOT_PROVED.to_le_bytes())?;
        out.flush()?;
        return Err(ConnEnd::Refused(reason));
    }
    // Whose connection it is, before it serves any session: `Served::close_from` closes it.
    if let Some(c) = served
        .conns
        .lock()
        .expect("conns poisoned")
        .get_mut(&conn_id)
    {
        c.src = Some(src);
    }
    let epoch = u32::from_le_bytes(hello[12..16].try_into().expect("4 bytes"));
    let resume = hello[11] & HELLO_RESUME != 0;
    let Some(session) = served.take_session(src, conn_id, epoch, resume) else {
        served.reject();
        tracing::warn!(machine = served.me.0, src = src.0, %peer,
            "refused to resume a session it does not hold");
        out.write_all(&MAGIC.to_le_bytes())?;
        out.write_all(&ACK_NO_SESSION.to_le_bytes())?;
        out.flush()?;
        return Err(ConnEnd::Refused("no session to resume".into()));
    };
    let (last, refused_upto) = {
        let s = session.lock().expect("session poisoned");
        (s.last, s.refused_upto)
    };
    out.write_all(&MAGIC.to_le_bytes())?;
    out.write_all(&ACK_OK.to_le_bytes())?;
    out.write_all(&last.to_le_bytes())?;
    out.write_all(&refused_upto.to_le_bytes())?;
    out.flush()?;
    input.stream.set_read_timeout(None)?;
    let mut warned_admission = false;
    let mut scratch = Vec::new();
    loop {
        // Answers go out together while more requests wait: pipelined requests, batched
        // answers.
        if input.buffered() < REQUEST_BYTES {
            out.flush()?;
        }
        input.fill(REQUEST_BYTES)?;
        if closed.load(Ordering::SeqCst) {
            return Err(ConnEnd::Refused("closed: the peer was removed".into()));
        }
        let req = match Request::decode(input.take(REQUEST_BYTES)) {
            Ok(req) => req,
            Err(reason) => {
                served.reject();
                tracing::warn!(machine = served.me.0, src = src.0, %peer,
                    "closed a connection for bad framing: {reason}");
                return Err(ConnEnd::Refused(reason));
            }
        };
        let mut flags = 0;
        // What follows the reply's head: a read's data, or the size of the area an access
        // fell outside of.
        let mut size = None;
        let status = match req.op {
            OP_PROBE => {
                if served.admits(src) {
                    flags |= PROBE_ADMITS;
                }
                if served.area(MemKey::Rings).is_some() {
                    flags |= PROBE_RINGS;
                }
                OK
            }
            OP_READ | OP_READ_OBJECT => match access(served, &req) {
                Ok(mem) => {
                    scratch.resize(req.len, 0);
                    mem.read(req.offset as usize, &mut scratch);
                    if req.op == OP_READ_OBJECT {
                        // The seqlock reader's second header load, ordered after the copy's
                        // loads (`object::judge_copy` judges the two at the reader).
                        fence(Ordering::Acquire);
                        let again = mem.load_u64(req.offset as usize, Ordering::Acquire);
                        scratch.extend_from_slice(&again.to_le_bytes());
                    }
                    OK
                }
                Err((status, area)) => {
                    refused_access(served, src, &req, status, area);
                    size = Some(area);
                    status
                }
            },
            _ => {
                input.fill(req.len)?;
                let data = input.take(req.len);
                // Taken in the session's order, once: a repaired connection sends again what
                // it had no answer to, from the write after the last one taken.
                let mut held = session.lock().expect("session poisoned");
                if held.owner != conn_id || held.retired || closed.load(Ordering::SeqCst) {
                    return Err(ConnEnd::Refused(
                        "closed: a later connection of the peer took over, or it was removed"
                            .into(),
                    ));
                }
                if req.id <= held.last {
                    served.reject();
                    let reason = format!(
                        "bad framing: write {} after write {} of its session",
                        req.id, held.last
                    );
                    tracing::warn!(machine = served.me.0, src = src.0, %peer,
                        "closed a connection for {reason}");
                    return Err(ConnEnd::Refused(reason));
                }
                held.last = req.id;
                if !served.admits(src) {
                    held.refused_upto = req.id;
                    served.reject();
                    if !warned_admission {
                        tracing::warn!(
                            machine = served.me.0,
                            src = src.0,
                            "refused a write from a machine not admitted (not a member of the \
                             configuration this machine runs)"
                        );
                        warned_admission = true;
                    }
                    NOT_ADMITTED
                } else {
                    // A removal of the peer meanwhile retires the session only once this write
                    // is applied (`Served::close_from`).
                    match access(served, &req) {
                        Ok(mem) => {
                            mem.write(req.offset as usize, data);
                            if req.key == MemKey::Rings {
                                served.doorbell.ring(ThreadId(req.thread));
                            }
                            OK
                        }
                        Err((status, area)) => {
                            held.refused_upto = req.id;
                            refused_access(served, src, &req, status, area);
                            size = Some(area);
                            status
                        }
                    }
                }
            }
        };
        let size = size.map(|s| (s as u64).to_le_bytes());
        let body: &[u8] = match &size {
            Some(s) => s,
            None if matches!(req.op, OP_READ | OP_READ_OBJECT) && status == OK => &scratch,
            None => &[],
        };
        let mut head = [0u8; REPLY_BYTES];
        head[..8].copy_from_slice(&req.id.to_le_bytes());
        head[8] = status;
        head[9] = flags;
        head[12..16].copy_from_slice(&(body.len() as u32).to_le_bytes());
        out.write_all(&head)?;
        out.write_all(body)?;
    }
}

/// Reads an acknowledgement: its verdict, or bad framing if it lacks the magic.
fn read_ack(stream: &TcpStream) -> io::Result<u32> {
    let mut ack = [0u8; ACK_BYTES];
    (&mut &*stream).read_exact(&mut ack)?;
    let verdict = u32::from_le_bytes(ack[4..8].try_into().expect("4 bytes"));
    Ok(if ack[..4] == MAGIC.to_le_bytes() {
        verdict
    } else {
        ACK_BAD_FRAMING
    })
}

/// The connecting machine and the acknowledgement a hello gets.
fn check_hello(hello: &[u8], served: &Served) -> (MachineId, u32) {
    let u16_at = |i: usize| u16::from_le_bytes([hello[i], hello[i + 1]]);
    let src = MachineId(u16_at(6));
    let verdict = if hello[..4] != MAGIC.to_le_bytes() || hello[11] & !HELLO_RESUME != 0 {
        ACK_BAD_FRAMING
    } else if u16_at(4) != VERSION || hello[10] != RECORDS {
        other_version_ack()
    } else if hello[16..24] != served.cluster.to_le_bytes() {
        ACK_OTHER_CLUSTER
    } else if u16_at(8) != served.me.0 || src.0 as usize >= served.machines {
        ACK_OTHER_MACHINE
    } else {
        ACK_OK
    };
    (src, verdict)
}

/// The area a request reads or writes, if the access is inside it; else the refusal and the
/// area's size.
fn access(served: &Served, req: &Request) -> Result<Arc<Nvram>, (u8, usize)> {
    let mem = served.area(req.key).ok_or((NOT_REGISTERED, 0))?;
    check_bounds(served.me, req.key, &mem, req.offset, req.len)
        .map_err(|_| (OUT_OF_BOUNDS, mem.len()))?;
    Ok(mem)
}

fn refused_access(served: &Served, src: MachineId, req: &Request, status: u8, size: usize) {
    served.reject();
    let what = if status == NOT_REGISTERED {
        "an unregistered area"
    } else {
        "outside the registered area"
    };
    tracing::warn!(machine = served.me.0, src = src.0, key = ?req.key, offset = req.offset,
        len = req.len, size, "refused an access to {what}");
}

/// A one-sided operation on the wire.
#[derive(Debug)]
struct Request {
    op: u8,
    key: MemKey,
    /// The requesting thread (a write into the rings lands in that thread's rings).
    thread: u16,
    id: u64,
    offset: u64,
    len: usize,
}

impl Request {
    fn encode(&self, out: &mut Vec<u8>) {
        let (area, region) = match self.key {
            MemKey::Region(r) => (0u8, r.0),
            MemKey::Rings => (1, 0),
            MemKey::Feedback => (2, 0),
            MemKey::Replicas => (3, 0),
        };
        out.push(self.op);
        out.push(area);
        out.extend_from_slice(&self.thread.to_le_bytes());
        out.extend_from_slice(&region.to_le_bytes());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&(self.len as u32).to_le_bytes());
        out.extend_from_slice(&[0; 4]);
    }

    fn decode(b: &[u8]) -> Result<Self, String> {
        let op = b[0];
        if !matches!(op, OP_READ | OP_WRITE | OP_PROBE | OP_READ_OBJECT) {
            return Err(format!("unknown operation {op}"));
        }
        let region = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        let key = match b[1] {
            0 => MemKey::Region(RegionId(region)),
            1 => MemKey::Rings,
            2 => MemKey::Feedback,
            3 => MemKey::Replicas,
            a => return Err(format!("unknown area {a}")),
        };
        if b[28..32] != [0; 4] || (b[1] != 0 && region != 0) {
            return Err("nonzero padding".into());
        }
        let len = u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")) as usize;
        if op_too_long(op, len) {
            return Err(format!(
                "an operation of {len} bytes (answers at most {OP_BYTES_MAX})"
            ));
        }
        if op == OP_READ_OBJECT && len < HEADER_BYTES {
            return Err(format!(
                "an object read of {len} bytes, shorter than a header"
            ));
        }
        Ok(Self {
            op,
            key,
            thread: u16::from_le_bytes([b[2], b[3]]),
            id: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            offset: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
            len,
        })
    }
}

/// Buffered input of whole frames from a stream that may have a read timeout.
struct Frames {
    stream: TcpStream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl std::fmt::Debug for Frames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frames")
            .field("buffered", &self.buffered())
            .finish_non_exhaustive()
    }
}

impl Frames {
    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            buf: vec![0; 256 << 10],
            start: 0,
            end: 0,
        }
    }

    fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Reads until `n` bytes are buffered: `Ok(false)` if the stream's read timeout passed
    /// first (nothing is consumed), an error if it closed.
    fn fill(&mut self, n: usize) -> io::Result<bool> {
        if self.buffered() >= n {
            return Ok(true);
        }
        self.make_room(n);
        while self.buffered() < n {
            match self.stream.read(&mut self.buf[self.end..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(k) => self.end += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(false)
                }
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// [`Frames::fill`] without waiting: `Ok(false)` as soon as the stream has nothing more.
    fn fill_now(&mut self, n: usize) -> io::Result<bool> {
        if self.buffered() >= n {
            return Ok(true);
        }
        self.make_room(n);
        while self.buffered() < n {
            let free = &mut self.buf[self.end..];
            // SAFETY: `free` is valid for writes of its length.
            let got = unsafe {
                libc::recv(
                    self.stream.as_raw_fd(),
                    free.as_mut_ptr().cast(),
                    free.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            match got {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                k if k > 0 => self.end += k as usize,
                _ => match io::Error::last_os_error() {
                    e if e.kind() == io::ErrorKind::Interrupted => {}
                    e if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                    e => return Err(e),
                },
            }
        }
        Ok(true)
    }

    /// Waits up to `timeout` (at a millisecond's grain) for the stream to have bytes to read.
    fn readable(&self, timeout: Duration) -> io::Result<()> {
        let mut fd = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut fd, 1, ms) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Makes room for `n` bytes after the buffered ones' start.
    fn make_room(&mut self, n: usize) {
        if self.buf.len() - self.start < n {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.buf.len() < n {
                self.buf.resize(n, 0);
            }
        }
    }

    /// The next `n` buffered bytes (after [`Frames::fill`] said they are there).
    fn take(&mut self, n: usize) -> &[u8] {
        let at = self.start;
        self.start += n;
        &self.buf[at..at + n]
    }
}

/// This machine's queue pair to one peer.
#[derive(Debug)]
struct Link {
    /// The link itself, for the repairs it starts.
    this: std::sync::Weak<Link>,
    /// Set when the fabric stops: the link breaks for good.
    stopped: AtomicBool,
    me: MachineId,
    dst: MachineId,
    addr: SocketAddr,
    cluster: u64,
    timeout: Duration,
    secret: Secret,
    /// This machine's admitted set: whether the peer is a member.
    admitted: Arc<Admitted>,
    inner: Mutex<LinkInner>,
    /// The last request answered, on any connection (ids grow across connections), or taken
    /// by the peer's NIC as a repair's resumption says.
    acked: AtomicU64,
    /// Whether `failed` holds anything (read without its lock on every status check).
    failed_any: AtomicBool,
    /// Requests that failed: inclusive ranges of ids.
    failed: Mutex<Vec<(u64, u64)>>,
    /// Reads and probes waiting for their answers.
    waiters: Mutex<HashMap<u64, Arc<Waiter>>>,
    /// The answers of the connection that is up, if one is.
    current: Mutex<Option<Arc<Replies>>>,
    /// Whether bytes of sent requests wait for the socket (`LinkInner::sending`), read
    /// without the link's lock by polls.
    backed_up: AtomicBool,
    /// Reads and writes posted to the peer.
    traffic: TrafficCounters,
}

#[derive(Debug)]
struct LinkInner {
    state: LinkState,
    /// The id of the next request (ids never repeat on a link, across connections).
    next_id: u64,
    /// Requests encoded and not sent yet: the last `unsent` ids, held back for a thread's
    /// batch (`farm_core::fabric::Batch`) or about to go.
    outbox: Vec<u8>,
    unsent: u64,
    /// Requests sent (in flight) whose bytes from `sending_at` on the socket did not take yet:
    /// a send never blocks (a peer that stops reading would hold the link, and every thread
    /// and membership change that needs it, for the whole timeout); the rest goes out as the
    /// link is next used or polled, or at the ticker's next tick.
    sending: Vec<u8>,
    sending_at: usize,
    /// The epoch of the link's session at the peer's NIC, new at each fresh hello.
    epoch: u32,
    /// The writes posted, until answered (trimmed as the link is next used or closed), which
    /// a repaired connection sends again.
    window: Window,
    /// Counts the repairs started: a repairer works while its own is under way.
    repairs: u64,
    /// When the link went down, unless a repair made progress since: the peer's NIC answered
    /// the writes it sent again (up to `resent_upto`).
    down_since: Option<Instant>,
    resent_upto: u64,
    /// How long the repairer waits before its next attempt: doubling, up to a quarter of the
    /// timeout, over an outage (repairs whose connections break again before making progress
    /// included).
    repair_pause: Duration,
}

#[derive(Debug)]
enum LinkState {
    /// Never connected, or restarted because the peer's membership changed.
    Idle,
    Up(Conn),
    /// The connection closed or timed out while the peer is a member: reads fail, writes
    /// wait, and a repairer connects again, resuming the session, to send them
    /// ([`Link::repair`]).
    Repairing,
    /// The connection broke while the peer is not a member, the session could not be
    /// resumed (the peer restarted, or removed this machine, or refused a write whose answer
    /// was lost), or the fabric stopped: operations fail while the peer is a member.
    Broken,
}

/// The writes of a link posted and not answered yet, with their encoded requests (head and
/// payload), in id order: what a repaired connection sends again, from the first write the
/// peer's NIC did not take.
#[derive(Debug, Default)]
struct Window {
    /// The requests, from `start` on.
    bytes: Vec<u8>,
    start: usize,
    /// Each write's id and the offset in `bytes` its request ends at, oldest first.
    writes: VecDeque<(u64, usize)>,
}

impl Window {
    fn push(&mut self, id: u64, request: &[u8]) {
        self.bytes.extend_from_slice(request);
        self.writes.push_back((id, self.bytes.len()));
    }

    /// Forgets the writes up to `acked`, answered.
    fn trim(&mut self, acked: u64) {
        while let Some(&(id, end)) = self.writes.front() {
            if id > acked {
                break;
            }
            self.writes.pop_front();
            self.start = end;
        }
        if self.writes.is_empty() {
            self.bytes.clear();
            self.start = 0;
        } else if self.start > 64 << 10 && self.start * 2 > self.bytes.len() {
            self.bytes.drain(..self.start);
            for (_, end) in self.writes.iter_mut() {
                *end -= self.start;
            }
            self.start = 0;
        }
    }

    fn contains(&self, id: u64) -> bool {
        self.writes.binary_search_by_key(&id, |(w, _)| *w).is_ok()
    }

    /// Empties the window, returning the ids of its writes.
    fn take_ids(&mut self) -> Vec<u64> {
        let ids = self.writes.iter().map(|(id, _)| *id).collect();
        *self = Self::default();
        ids
    }
}

/// One connection of a link.
#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    replies: Arc<Replies>,
}

/// The answers of one connection, taken by the threads that want them (module docs).
#[derive(Debug)]
struct Replies {
    /// Requests not answered yet, with when they were sent, oldest first (the answers come in
    /// this order).
    in_flight: Mutex<VecDeque<(u64, Instant)>>,
    /// The receiving side, read by one thread at a time: the leader while one blocks.
    input: Mutex<Frames>,
    /// Set once the connection closed: its unanswered reads have failed, and its writes
    /// failed or wait for the link's repair.
    closed: AtomicBool,
    /// Threads blocked for an answer without leading, asleep on `lead`.
    followers: AtomicUsize,
    lead: (Mutex<()>, Condvar),
}

/// How [`Link::take`] takes a connection's answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Take {
    /// What has arrived, without looking at the clock: a poll.
    Now,
    /// What has arrived, first waiting this long for some if none has: a blocked thread.
    Waiting(Duration),
    /// What has arrived, and whether the oldest request is overdue: the ticker.
    Ticking,
}

/// An answer a read or probe waits for.
#[derive(Debug, Default)]
struct Waiter {
    reply: Mutex<Option<Reply>>,
}

#[derive(Debug)]
enum Reply {
    Answer {
        status: u8,
        flags: u8,
        data: Vec<u8>,
    },
    Lost,
}

impl Waiter {
    fn take(&self) -> Option<Reply> {
        self.reply.lock().expect("waiter poisoned").take()
    }

    fn is_answered(&self) -> bool {
        self.reply.lock().expect("waiter poisoned").is_some()
    }
}

impl Replies {
    fn new(stream: TcpStream) -> Self {
        Self {
            in_flight: Mutex::new(VecDeque::new()),
            input: Mutex::new(Frames::new(stream)),
            closed: AtomicBool::new(false),
            followers: AtomicUsize::new(0),
            lead: (Mutex::new(()), Condvar::new()),
        }
    }

    /// Hands `reply` to `waiter`, waking the followers if any sleeps (it may be theirs).
    fn deliver(&self, waiter: &Waiter, reply: Reply) {
        *waiter.reply.lock().expect("waiter poisoned") = Some(reply);
        // Against a follower that counts itself and then looks at its answer: one of the two
        // sees the other's write.
        fence(Ordering::SeqCst);
        self.wake_followers();
    }

    fn wake_followers(&self) {
        if self.followers.load(Ordering::SeqCst) > 0 {
            let _held = self.lead.0.lock().expect("lead poisoned");
            self.lead.1.notify_all();
        }
    }

    /// Sleeps until `waiter` is answered, the followers are woken (the lead is free, or an
    /// answer came) or `timeout` passed.
    fn follow(&self, waiter: &Waiter, timeout: Duration) {
        let held = self.lead.0.lock().expect("lead poisoned");
        self.followers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !waiter.is_answered() && !self.closed.load(Ordering::SeqCst) {
            let _ = self
                .lead
                .1
                .wait_timeout(held, timeout)
                .expect("lead poisoned");
        }
        self.followers.fetch_sub(1, Ordering::SeqCst);
    }
}

impl farm_core::fabric::Held for Link {
    fn flush(&self) {
        let mut inner = self.inner.lock().expect("link poisoned");
        // A failure breaks the connection: held reads fail, and writes wait for the link's
        // repair or fail with the link (`Link::broke`).
        let _ = self.write_out(&mut inner);
    }
}

impl Link {
    /// Posts one request (with `payload` for a write), connecting first if the link may;
    /// `waiter` gets the answer. Returns the request's id and the answers of the connection it
    /// went on (none for a write queued for the link's repair). The request goes out at once, with
    /// any held back before it, unless this thread has a batch open and `may_hold` (a request
    /// nobody waits on right away): then it goes with the batch's flush.
    #[allow(clippy::too_many_arguments)]
    fn send(
        self: &Arc<Self>,
        op: u8,
        key: MemKey,
        thread: ThreadId,
        offset: u64,
        len: usize,
        payload: &[u8],
        waiter: Option<Arc<Waiter>>,
        may_hold: bool,
    ) -> Result<(u64, Option<Arc<Replies>>), FabricError> {
        let unreachable = FabricError::Unreachable(self.dst);
        let mut inner = self.inner.lock().expect("link poisoned");
        // Only a probe (`ProcessFabric::ready`, or a read of the replicas list: the CM probing
        // a joiner) connects to a machine outside this one's configuration. Anything else to
        // it comes from a thread still on a view that named it, and fails at once: connecting
        // would block that thread for the timeout when the machine is a stopped process (the
        // kernel accepts, the hello is never answered), and halted the cluster's transactions
        // for that long.
        let probe = op == OP_PROBE || key == MemKey::Replicas;
        if self.may_connect(&inner) && !probe && !self.admitted.contains(self.dst) {
            return Err(unreachable);
        }
        if self.may_connect(&inner) {
            self.connect(&mut inner).map_err(|e| {
                tracing::debug!(machine = self.me.0, dst = self.dst.0, addr = %self.addr,
                    error = %e, "could not connect");
                unreachable
            })?;
        }
        // Requests are encoded only on a connection that is up (`write_out` relies on it), or
        // into the window of a link under repair (writes only: they wait for it).
        let replies = match &inner.state {
            LinkState::Up(conn) => Some(conn.replies.clone()),
            LinkState::Repairing if op == OP_WRITE => None,
            _ => return Err(unreachable),
        };
        let acked = self.acked.load(Ordering::Acquire);
        let l = &mut *inner;
        l.window.trim(acked);
        let id = l.next_id;
        l.next_id += 1;
        let at = l.outbox.len();
        Request {
            op,
            key,
            thread: thread.0,
            id,
            offset,
            len,
        }
        .encode(&mut l.outbox);
        l.outbox.extend_from_slice(payload);
        match op {
            OP_READ | OP_READ_OBJECT => self.traffic.read(len),
            OP_WRITE => {
                self.traffic.write(len);
                l.window.push(id, &l.outbox[at..]);
            }
            _ => {}
        }
        if replies.is_none() {
            l.outbox.truncate(at);
            return Ok((id, None));
        }
        l.unsent += 1;
        if let Some(w) = waiter {
            self.waiters.lock().expect("waiters poisoned").insert(id, w);
        }
        if may_hold && farm_core::fabric::hold(&(self.clone() as Arc<dyn farm_core::fabric::Held>))
        {
            return Ok((id, replies));
        }
        if self.write_out(&mut inner).is_err() {
            // The connection broke as the request went out: a write waits for the repair, as
            // every write in the window does.
            return match inner.state {
                LinkState::Repairing if op == OP_WRITE => Ok((id, None)),
                _ => Err(unreachable),
            };
        }
        Ok((id, replies))
    }

    /// Sends the requests the outbox holds, in one send as far as the socket takes them
    /// without blocking (see `LinkInner::sending`); a failure breaks the connection
    /// ([`Link::broke`]).
    fn write_out(&self, inner: &mut LinkInner) -> Result<(), ()> {
        if inner.unsent == 0 {
            return self.push(inner);
        }
        let LinkState::Up(conn) = &inner.state else {
            unreachable!("requests are held only on a connection that is up")
        };
        let now = Instant::now();
        conn.replies
            .in_flight
            .lock()
            .expect("in flight poisoned")
            .extend((inner.next_id - inner.unsent..inner.next_id).map(|id| (id, now)));
        inner.unsent = 0;
        if inner.sending_at == inner.sending.len() {
            inner.sending.clear();
            inner.sending_at = 0;
            std::mem::swap(&mut inner.sending, &mut inner.outbox);
        } else {
            let LinkInner {
                outbox, sending, ..
            } = inner;
            sending.append(outbox);
        }
        self.push(inner)
    }

    /// Gives the socket what it takes of the bytes waiting in `inner.sending`, without
    /// blocking; a failure breaks the connection ([`Link::broke`]).
    fn push(&self, inner: &mut LinkInner) -> Result<(), ()> {
        let LinkState::Up(conn) = &inner.state else {
            return Ok(());
        };
        let fd = conn.stream.as_raw_fd();
        while inner.sending_at < inner.sending.len() {
            let rest = &inner.sending[inner.sending_at..];
            // SAFETY: `rest` is valid for reads of its length.
            let sent = unsafe {
                libc::send(
                    fd,
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if sent >= 0 {
                inner.sending_at += sent as usize;
                continue;
            }
            match io::Error::last_os_error() {
                e if e.kind() == io::ErrorKind::Interrupted => {}
                e if e.kind() == io::ErrorKind::WouldBlock => {
                    self.backed_up.store(true, Ordering::Release);
                    return Ok(());
                }
                e => {
                    self.broke(inner, &format!("sending: {e}"));
                    return Err(());
                }
            }
        }
        inner.sending.clear();
        inner.sending_at = 0;
        self.backed_up.store(false, Ordering::Release);
        Ok(())
    }

    /// Pushes bytes waiting for the socket, if any and if the link is free.
    fn try_push(&self) {
        if self.backed_up.load(Ordering::Acquire) {
            if let Ok(mut inner) = self.inner.try_lock() {
                let _ = self.push(&mut inner);
            }
        }
    }

    /// Opens a connection with a new session: hello, acknowledgement, and a ticker.
    fn connect(self: &Arc<Self>, inner: &mut LinkInner) -> io::Result<()> {
        let epoch = u32::from_le_bytes(auth::nonce()[..4].try_into().expect("4 bytes"));
        let (stream, ..) = self.handshake(epoch, false).map_err(|e| match e {
            Handshaken::Io(e) => e,
            Handshaken::Refused(verdict) => {
                io::Error::new(io::ErrorKind::ConnectionRefused, refusal(verdict))
            }
            Handshaken::NotProved => io::Error::new(io::ErrorKind::PermissionDenied, NOT_PROVED),
        })?;
        inner.epoch = epoch;
        inner.down_since = None;
        inner.repair_pause = REPAIR_PAUSE_MIN;
        self.install(inner, stream)
    }

    /// Connects, says hello (resuming the session of `epoch` if `resume`), and proves the
    /// cluster's secret: the stream, and the ids of the last write the peer's NIC took in the
    /// session and of the last it refused.
    fn handshake(&self, epoch: u32, resume: bool) -> Result<(TcpStream, u64, u64), Handshaken> {
        let stream = TcpStream::connect_timeout(&self.addr, self.timeout)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(self.timeout))?;
        stream.set_read_timeout(Some(self.timeout))?;
        let mut hello = [0u8; HELLO_BYTES];
        hello[..4].copy_from_slice(&MAGIC.to_le_bytes());
        hello[4..6].copy_from_slice(&VERSION.to_le_bytes());
        hello[6..8].copy_from_slice(&self.me.0.to_le_bytes());
        hello[10] = RECORDS;
        hello[8..10].copy_from_slice(&self.dst.0.to_le_bytes());
        if resume {
            hello[11] = HELLO_RESUME;
        }
        hello[12..16].copy_from_slice(&epoch.to_le_bytes());
        hello[16..24].copy_from_slice(&self.cluster.to_le_bytes());
        let connecting = auth::nonce();
        (&stream).write_all(&[&hello[..], &connecting[..]].concat())?;
        let refused = |verdict: u32| {
            let reason = refusal(verdict);
            tracing::warn!(machine = self.me.0, dst = self.dst.0, addr = %self.addr,
                "the peer refused the connection: {reason}");
            Handshaken::Refused(verdict)
        };
        let verdict = read_ack(&stream)?;
        if verdict != ACK_CHALLENGE {
            return Err(refused(verdict));
        }
        let mut challenge = [0u8; NONCE_BYTES + PROOF_BYTES];
        (&stream).read_exact(&mut challenge)?;
        let handshake = Handshake {
            secret: &self.secret,
            hello: &hello,
            connecting,
            accepting: challenge[..NONCE_BYTES].try_into().expect("a nonce"),
        };
        if !handshake.accepting_proved(&challenge[NONCE_BYTES..]) {
            tracing::warn!(machine = self.me.0, dst = self.dst.0, addr = %self.addr,
                "refused the peer's connection: {NOT_PROVED}");
            return Err(Handshaken::NotProved);
        }
        (&stream).write_all(&handshake.connecting_proof())?;
        let verdict = read_ack(&stream)?;
        if verdict != ACK_OK {
            return Err(refused(verdict));
        }
        let mut ids = [0u8; 16];
        (&stream).read_exact(&mut ids)?;
        let id = |at: usize| u64::from_le_bytes(ids[at..at + 8].try_into().expect("8 bytes"));
        Ok((stream, id(0), id(8)))
    }

    /// Makes `stream` the link's connection, with a ticker.
    fn install(self: &Arc<Self>, inner: &mut LinkInner, stream: TcpStream) -> io::Result<()> {
        let replies = Arc::new(Replies::new(stream.try_clone()?));
        // The ticker: answers nobody polled for, and the oldest request's age.
        let tick = (self.timeout / 4).clamp(Duration::from_millis(1), TICK_MAX);
        let (link, ticked) = (self.clone(), replies.clone());
        std::thread::Builder::new()
            .name(format!("farm-nic-{}-to-{}", self.me.0, self.dst.0))
            .spawn(move || {
                while !ticked.closed.load(Ordering::SeqCst) {
                    std::thread::sleep(tick);
                    link.try_push();
                    if let Ok(mut input) = ticked.input.try_lock() {
                        link.take(&ticked, &mut input, Take::Ticking);
                    }
                }
            })?;
        *self.current.lock().expect("current poisoned") = Some(replies.clone());
        inner.state = LinkState::Up(Conn { stream, replies });
        Ok(())
    }

    /// Takes what has arrived for the connection of `replies`, unless another thread is
    /// taking it, or this thread's batch found it empty this turn: a poll that never waits.
    fn poll(&self, replies: &Arc<Replies>) {
        self.try_push();
        let source = Arc::as_ptr(replies) as *const ();
        if farm_core::fabric::polled_empty(source) {
            return;
        }
        if let Ok(mut input) = replies.input.try_lock() {
            if !self.take(replies, &mut input, Take::Now) {
                farm_core::fabric::note_polled_empty(source);
            }
        }
    }

    /// The answer `waiter` waits for, on the connection of `replies`, or `Lost` after
    /// `timeout`: this thread leads the taking of answers while nobody else does, and follows
    /// (sleeps) while another does.
    fn wait(&self, waiter: &Waiter, replies: &Arc<Replies>, timeout: Duration) -> Reply {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(reply) = waiter.take() {
                return reply;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Reply::Lost;
            }
            let slice = left.min(LEAD_SLICE);
            self.try_push();
            match replies.input.try_lock() {
                Ok(mut input) => {
                    self.take(replies, &mut input, Take::Waiting(slice));
                    drop(input);
                    // The lead is free: a follower still waiting may take it.
                    replies.wake_followers();
                }
                Err(_) => replies.follow(waiter, slice),
            }
        }
    }

    /// Takes the answers that arrived on the connection of `replies`, whose input the caller
    /// holds, as `how` says. Breaks the connection when it closed, its framing is bad or (when
    /// waiting or ticking) an answer is overdue. Returns whether anything was taken.
    fn take(&self, replies: &Arc<Replies>, input: &mut Frames, how: Take) -> bool {
        if replies.closed.load(Ordering::SeqCst) {
            return true;
        }
        let mut took = false;
        let Err(reason) = self.take_frames(replies, input, how, &mut took) else {
            return took;
        };
        let mut inner = self.inner.lock().expect("link poisoned");
        // Only if this connection is still the link's.
        if matches!(&inner.state, LinkState::Up(c) if Arc::ptr_eq(&c.replies, replies)) {
            self.broke(&mut inner, &reason);
        }
        true
    }

    /// A reply is a head (the request's id, its status, flags, and how many bytes follow) and
    /// the bytes: a read's data, or the size of the area an access fell outside of.
    fn take_frames(
        &self,
        replies: &Replies,
        input: &mut Frames,
        how: Take,
        took: &mut bool,
    ) -> Result<(), String> {
        let mut wait = match how {
            Take::Waiting(d) => Some(d),
            Take::Now | Take::Ticking => None,
        };
        loop {
            let mut need = REPLY_BYTES;
            let known = input.buffered() >= REPLY_BYTES;
            if known {
                let at = input.start + 12;
                let len = u32::from_le_bytes(input.buf[at..at + 4].try_into().expect("4 bytes"));
                if len as usize > OP_BYTES_MAX {
                    return Err(format!("bad framing: an answer of {len} bytes"));
                }
                need += len as usize;
            }
            match input.fill_now(need) {
                Ok(true) if known => {
                    let head: [u8; REPLY_BYTES] =
                        input.take(REPLY_BYTES).try_into().expect("a head");
                    let id = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
                    let data = input.take(need - REPLY_BYTES).to_vec();
                    self.answered(replies, id, head[8], head[9], data)?;
                    *took = true;
                    // Something came: no more waiting.
                    wait = None;
                }
                // The head is here: now its bytes.
                Ok(true) => {}
                Ok(false) => {
                    // A poll leaves the clock to the ticker and to waiting threads.
                    let overdue = || {
                        let in_flight = replies.in_flight.lock().expect("in flight poisoned");
                        in_flight
                            .front()
                            .is_some_and(|(_, sent)| sent.elapsed() > self.timeout)
                    };
                    if how != Take::Now && overdue() {
                        return Err(format!("no answer within {:?}", self.timeout));
                    }
                    match wait.take() {
                        Some(d) => input.readable(d).map_err(|e| format!("receiving: {e}"))?,
                        None => return Ok(()),
                    }
                }
                Err(e) => return Err(format!("receiving: {e}")),
            }
        }
    }

    /// Takes the answer to request `id`, the oldest of the connection's in flight.
    fn answered(
        &self,
        replies: &Replies,
        id: u64,
        status: u8,
        flags: u8,
        data: Vec<u8>,
    ) -> Result<(), String> {
        let waiter = {
            // The request leaves the connection's in flight and counts answered under one
            // lock: a close that drains what is in flight sees each request in one place
            // (`close_locked`).
            let mut in_flight = replies.in_flight.lock().expect("in flight poisoned");
            match in_flight.pop_front() {
                Some((expected, _)) if expected == id => {}
                other => return Err(format!("an answer to {id} while expecting {other:?}")),
            }
            let waiter = self.waiters.lock().expect("waiters poisoned").remove(&id);
            if waiter.is_none() && status != OK {
                self.fail(id, id);
            }
            self.acked.fetch_max(id, Ordering::AcqRel);
            waiter
        };
        if waiter.is_none() && status != OK {
            tracing::warn!(
                machine = self.me.0,
                dst = self.dst.0,
                status,
                "a write was refused by the peer"
            );
        }
        if let Some(w) = waiter {
            let reply = Reply::Answer {
                status,
                flags,
                data,
            };
            replies.deliver(&w, reply);
        }
        Ok(())
    }

    /// Records requests `from..=to` as failed. Consecutive failures (a removed machine's
    /// refused writes, one after another) extend one range.
    fn fail(&self, from: u64, to: u64) {
        let mut failed = self.failed.lock().expect("failed poisoned");
        match failed.last_mut() {
            Some((_, end)) if *end + 1 == from => *end = to,
            _ => failed.push((from, to)),
        }
        self.failed_any.store(true, Ordering::Release);
    }

    /// The link's connection failed for `reason`: while the peer is a member, the link is
    /// repaired in place (its writes wait); otherwise it breaks.
    fn broke(&self, inner: &mut LinkInner, reason: &str) {
        if self.stopped.load(Ordering::SeqCst) || !self.admitted.contains(self.dst) {
            self.close_locked(inner, LinkState::Broken, reason);
            return;
        }
        // An outage starts here unless the last repair has not made progress yet (its
        // connection broke again before answering the writes it sent again).
        let progressed = self.acked.load(Ordering::Acquire) >= inner.resent_upto;
        if inner.down_since.is_none() || progressed {
            inner.down_since = Some(Instant::now());
            inner.repair_pause = REPAIR_PAUSE_MIN;
        }
        self.close_locked(inner, LinkState::Repairing, reason);
        inner.repairs += 1;
        let (link, repair) = (self.this.upgrade().expect("a link in use"), inner.repairs);
        let spawned = std::thread::Builder::new()
            .name(format!("farm-nic-{}-repair-{}", self.me.0, self.dst.0))
            .spawn(move || link.repair(repair));
        if spawned.is_err() {
            self.close_locked(inner, LinkState::Broken, "no thread to repair it");
        }
    }

    /// Connects again until the peer's NIC resumes the link's session, then sends the writes
    /// it did not take, in order. A peer that holds no session to resume (it restarted, or
    /// removed this machine since), that refused a write this machine did not hear refused,
    /// or that does not prove the cluster's secret breaks the link. Ends once repair `repair`
    /// is no longer under way (the peer's membership changed, or the fabric stopped).
    fn repair(self: Arc<Self>, repair: u64) {
        let ours = |inner: &LinkInner| {
            matches!(inner.state, LinkState::Repairing)
                && inner.repairs == repair
                && !self.stopped.load(Ordering::SeqCst)
                && self.admitted.contains(self.dst)
        };
        loop {
            let pause = {
                let mut inner = self.inner.lock().expect("link poisoned");
                if !ours(&inner) {
                    return;
                }
                let pause = inner.repair_pause;
                inner.repair_pause = (pause * 2).min((self.timeout / 4).max(REPAIR_PAUSE_MIN));
                pause
            };
            std::thread::sleep(pause);
            let epoch = {
                let inner = self.inner.lock().expect("link poisoned");
                if !ours(&inner) {
                    return;
                }
                inner.epoch
            };
            let shaken = self.handshake(epoch, true);
            let mut inner = self.inner.lock().expect("link poisoned");
            if !ours(&inner) {
                return;
            }
            let (stream, last, refused_upto) = match shaken {
                Ok(shaken) => shaken,
                Err(Handshaken::NotProved) => {
                    self.close_locked(&mut inner, LinkState::Broken, NOT_PROVED);
                    return;
                }
                Err(Handshaken::Io(e)) => {
                    tracing::debug!(machine = self.me.0, dst = self.dst.0, error = %e,
                        "repairing: could not connect");
                    continue;
                }
                Err(Handshaken::Refused(verdict)) => {
                    self.close_locked(&mut inner, LinkState::Broken, &refusal(verdict));
                    return;
                }
            };
            // Answers come in order, and a refused write counts failed before it counts
            // answered (`answered`): up to `acked`, every refusal was heard.
            let acked = self.acked.load(Ordering::Acquire);
            let broken = if last >= inner.next_id {
                Some(format!("the peer took write {last}, never sent"))
            } else if refused_upto > acked {
                Some(format!(
                    "the peer refused write {refused_upto}, and its answer was lost"
                ))
            } else {
                None
            };
            if let Some(reason) = broken {
                let _ = stream.shutdown(Shutdown::Both);
                self.close_locked(&mut inner, LinkState::Broken, &reason);
                return;
            }
            // The peer took the writes up to `last`: they are done.
            self.acked.fetch_max(last, Ordering::AcqRel);
            let acked = self.acked.load(Ordering::Acquire);
            inner.window.trim(acked);
            inner.resent_upto = inner.window.writes.back().map_or(0, |(id, _)| *id);
            if let Err(e) = self.install(&mut inner, stream) {
                tracing::debug!(machine = self.me.0, dst = self.dst.0, error = %e,
                    "repairing: could not start the connection");
                continue;
            }
            let l = &mut *inner;
            let LinkState::Up(conn) = &l.state else {
                unreachable!("installed above")
            };
            let now = Instant::now();
            (conn.replies.in_flight.lock().expect("in flight poisoned"))
                .extend(l.window.writes.iter().map(|(id, _)| (*id, now)));
            l.sending.clear();
            l.sending
                .extend_from_slice(&l.window.bytes[l.window.start..]);
            l.sending_at = 0;
            tracing::info!(
                machine = self.me.0,
                dst = self.dst.0,
                resent = l.window.writes.len(),
                "connection repaired: the peer took every write up to {last}"
            );
            let _ = self.push(&mut inner);
            return;
        }
    }

    /// Closes the link's connection, if it has one, and puts it in `state`: the connection's
    /// unanswered requests fail, except, when the link is to be repaired, its writes.
    fn close_locked(&self, inner: &mut LinkInner, state: LinkState, reason: &str) {
        let repair = matches!(state, LinkState::Repairing);
        let old = std::mem::replace(&mut inner.state, state);
        let was_repairing = matches!(old, LinkState::Repairing);
        let mut unanswered: Vec<u64> = Vec::new();
        let conn = match old {
            LinkState::Up(conn) => Some(conn),
            _ => None,
        };
        let acked = match &conn {
            Some(conn) => {
                let _ = conn.stream.shutdown(Shutdown::Both);
                *self.current.lock().expect("current poisoned") = None;
                conn.replies.closed.store(true, Ordering::SeqCst);
                let mut in_flight = conn.replies.in_flight.lock().expect("in flight poisoned");
                unanswered.extend(in_flight.drain(..).map(|(id, _)| id));
                // Every answer taken is counted by now (`answered`).
                self.acked.load(Ordering::Acquire)
            }
            None => self.acked.load(Ordering::Acquire),
        };
        // Writes answered since the window was last trimmed are done, not waiting.
        inner.window.trim(acked);
        // Requests held back were never sent: they fail as well (writes wait for a repair).
        unanswered.extend(inner.next_id - inner.unsent..inner.next_id);
        inner.unsent = 0;
        inner.outbox.clear();
        inner.sending.clear();
        inner.sending_at = 0;
        self.backed_up.store(false, Ordering::Release);
        if repair {
            unanswered.retain(|id| !inner.window.contains(*id));
        } else {
            unanswered.extend(inner.window.take_ids());
        }
        unanswered.sort_unstable();
        unanswered.dedup();
        // In order: consecutive ids extend one range (`fail`).
        for id in &unanswered {
            self.fail(*id, *id);
        }
        {
            let mut waiters = self.waiters.lock().expect("waiters poisoned");
            for id in &unanswered {
                if let Some(w) = waiters.remove(id) {
                    match &conn {
                        Some(conn) => conn.replies.deliver(&w, Reply::Lost),
                        None => *w.reply.lock().expect("waiter poisoned") = Some(Reply::Lost),
                    }
                }
            }
        }
        let Some(conn) = conn else {
            if was_repairing && !matches!(inner.state, LinkState::Repairing) {
                tracing::warn!(machine = self.me.0, dst = self.dst.0, addr = %self.addr, reason,
                    "the connection was not repaired");
            }
            return;
        };
        // Followers see the connection closed.
        conn.replies.wake_followers();
        match inner.state {
            _ if self.stopped.load(Ordering::SeqCst) => tracing::debug!(machine = self.me.0,
                dst = self.dst.0, addr = %self.addr, reason, "connection closed"),
            LinkState::Repairing => tracing::warn!(machine = self.me.0, dst = self.dst.0,
                addr = %self.addr, reason, "connection broken; repairing it"),
            LinkState::Broken => tracing::warn!(machine = self.me.0, dst = self.dst.0,
                addr = %self.addr, reason,
                "connection broken; it stays down while the peer is a member"),
            _ => tracing::debug!(machine = self.me.0, dst = self.dst.0, addr = %self.addr,
                reason, "connection closed"),
        }
    }

    /// Whether the link is to connect before its next operation: it never connected, or it
    /// broke and the peer is no longer a member.
    fn may_connect(&self, inner: &LinkInner) -> bool {
        match inner.state {
            LinkState::Idle => true,
            LinkState::Up(_) | LinkState::Repairing => false,
            LinkState::Broken => !self.admitted.contains(self.dst),
        }
    }

    /// Starts the link afresh: the peer's membership changed, so a connection to an earlier
    /// incarnation of it must not carry another request.
    fn restart(&self) {
        let mut inner = self.inner.lock().expect("link poisoned");
        self.close_locked(&mut inner, LinkState::Idle, "the peer's membership changed");
        inner.state = LinkState::Idle;
    }

    fn status(&self, id: u64) -> WriteStatus {
        if let s @ (WriteStatus::Done | WriteStatus::Failed) = self.known_status(id) {
            return s;
        }
        // Take what has arrived, then look again.
        let current = self.current.lock().expect("current poisoned").clone();
        if let Some(replies) = current {
            self.poll(&replies);
        }
        self.known_status(id)
    }

    /// The status of request `id` by the answers taken so far.
    fn known_status(&self, id: u64) -> WriteStatus {
        if self.failed_any.load(Ordering::Acquire)
            && self
                .failed
                .lock()
                .expect("failed poisoned")
                .iter()
                .any(|&(a, b)| (a..=b).contains(&id))
        {
            return WriteStatus::Failed;
        }
        if id <= self.acked.load(Ordering::Acquire) {
            WriteStatus::Done
        } else {
            WriteStatus::Pending
        }
    }

    /// Sends a read or probe and waits for its answer, with everything this thread held back
    /// sent first.
    fn call(self: &Arc<Self>, op: u8, key: MemKey, offset: u64, len: usize) -> Reply {
        farm_core::fabric::flush();
        let waiter = Arc::new(Waiter::default());
        let Ok((_, Some(replies))) = self.send(
            op,
            key,
            ThreadId(0),
            offset,
            len,
            &[],
            Some(waiter.clone()),
            false,
        ) else {
            return Reply::Lost;
        };
        // Taking answers closes the connection after the timeout; the margin covers a tick.
        self.wait(&waiter, &replies, self.timeout * 2)
    }

    fn is_up(self: &Arc<Self>) -> bool {
        let mut inner = self.inner.lock().expect("link poisoned");
        if self.may_connect(&inner) {
            self.connect(&mut inner).is_ok()
        } else {
            matches!(inner.state, LinkState::Up(_))
        }
    }

    /// Closes the link for good (the fabric stops).
    fn close(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let mut inner = self.inner.lock().expect("link poisoned");
        self.close_locked(&mut inner, LinkState::Broken, "the fabric stopped");
    }
}

/// A one-sided read handle to a peer's area.
#[derive(Debug)]
struct TcpRemote {
    link: Arc<Link>,
    key: MemKey,
}

impl TcpRemote {
    /// The bytes of the answer to a read of `len` bytes at `offset` (with `extra` bytes the
    /// operation adds), or the error it reports.
    fn answer(
        &self,
        offset: u64,
        len: usize,
        extra: usize,
        reply: Reply,
    ) -> Result<Vec<u8>, FabricError> {
        let dst = self.link.dst;
        let out_of_bounds = |size: usize| FabricError::OutOfBounds {
            machine: dst,
            key: self.key,
            offset,
            len,
            size,
        };
        match reply {
            Reply::Answer {
                status: OK, data, ..
            } if data.len() == len + extra => Ok(data),
            Reply::Answer {
                status: NOT_REGISTERED,
                ..
            } => Err(FabricError::NotRegistered {
                machine: dst,
                key: self.key,
            }),
            Reply::Answer {
                status: OUT_OF_BOUNDS,
                data,
                ..
            } => Err(out_of_bounds(
                data.try_into()
                    .map_or(0, |s| u64::from_le_bytes(s) as usize),
            )),
            _ => Err(FabricError::Unreachable(dst)),
        }
    }

    /// Judges the answer to an object read of `buf.len()` bytes: the copy and the header
    /// word the peer's NIC read after it.
    fn object_answer(
        &self,
        offset: u64,
        buf: &mut [u8],
        reply: Reply,
    ) -> Result<ReadOutcome, FabricError> {
        let data = self.answer(offset, buf.len(), HEADER_BYTES, reply)?;
        let (copy, again) = data.split_at(buf.len());
        buf.copy_from_slice(copy);
        Ok(judge_copy(
            buf,
            u64::from_le_bytes(again.try_into().expect("a header word")),
        ))
    }

    /// An access the NIC would refuse before sending: too long for one operation.
    fn too_long(&self, op: u8, offset: u64, len: usize) -> Option<FabricError> {
        op_too_long(op, len).then_some(FabricError::OutOfBounds {
            machine: self.link.dst,
            key: self.key,
            offset,
            len,
            size: 0,
        })
    }
}

impl RemoteMemory for TcpRemote {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), FabricError> {
        if let Some(e) = self.too_long(OP_READ, offset, buf.len()) {
            return Err(e);
        }
        let reply = self.link.call(OP_READ, self.key, offset, buf.len());
        buf.copy_from_slice(&self.answer(offset, buf.len(), 0, reply)?);
        Ok(())
    }

    fn machine(&self) -> MachineId {
        self.link.dst
    }

    fn read_object(&self, offset: u64, buf: &mut [u8]) -> Result<ReadOutcome, FabricError> {
        assert!(
            buf.len() >= HEADER_BYTES,
            "object buffer smaller than a header"
        );
        if let Some(e) = self.too_long(OP_READ_OBJECT, offset, buf.len()) {
            return Err(e);
        }
        let reply = self.link.call(OP_READ_OBJECT, self.key, offset, buf.len());
        self.object_answer(offset, buf, reply)
    }

    fn post_object_read(&self, offset: u64, len: usize) -> Option<Box<dyn PostedRead>> {
        if len < HEADER_BYTES || self.too_long(OP_READ_OBJECT, offset, len).is_some() {
            return None; // The read itself reports it.
        }
        let waiter = Arc::new(Waiter::default());
        let sent = self.link.send(
            OP_READ_OBJECT,
            self.key,
            ThreadId(0),
            offset,
            len,
            &[],
            Some(waiter.clone()),
            true,
        );
        Some(Box::new(TcpPostedRead {
            remote: TcpRemote {
                link: self.link.clone(),
                key: self.key,
            },
            offset,
            len,
            waiter: sent.ok().and_then(|(_, replies)| Some((waiter, replies?))),
        }))
    }
}

/// An object read on its way: the request went out (unless the link was down), and its
/// answer comes to the waiter, from the connection's answers.
#[derive(Debug)]
struct TcpPostedRead {
    remote: TcpRemote,
    offset: u64,
    len: usize,
    waiter: Option<(Arc<Waiter>, Arc<Replies>)>,
}

impl PostedRead for TcpPostedRead {
    fn is_done(&self) -> bool {
        let Some((waiter, replies)) = &self.waiter else {
            return true;
        };
        if waiter.is_answered() {
            return true;
        }
        self.remote.link.poll(replies);
        waiter.is_answered()
    }

    fn complete(self: Box<Self>, buf: &mut [u8]) -> Result<ReadOutcome, FabricError> {
        assert_eq!(
            buf.len(),
            self.len,
            "a posted read completed at another length"
        );
        let reply = match &self.waiter {
            // Taking answers closes the connection after the timeout; the margin covers a tick
            // (as `Link::call`). The request may be held back in this thread's batch.
            Some((waiter, replies)) => {
                if !self.is_done() {
                    farm_core::fabric::flush();
                }
                let link = &self.remote.link;
                link.wait(waiter, replies, link.timeout * 2)
            }
            None => Reply::Lost,
        };
        self.remote.object_answer(self.offset, buf, reply)
    }
}

/// A read handle to this machine's own area.
#[derive(Debug)]
struct LocalRemote {
    me: MachineId,
    key: MemKey,
    mem: Arc<Nvram>,
}

impl RemoteMemory for LocalRemote {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), FabricError> {
        check_bounds(self.me, self.key, &self.mem, offset, buf.len())?;
        self.mem.read(offset as usize, buf);
        Ok(())
    }

    fn machine(&self) -> MachineId {
        self.me
    }

    fn prefetch(&self, offset: u64, len: usize) {
        self.mem.prefetch(offset as usize, len);
    }
}

impl Fabric for TcpFabric {
    fn register(&self, machine: MachineId, key: MemKey, mem: Arc<Nvram>) {
        assert_eq!(
            machine, self.me,
            "the tcp fabric registers only its own machine's memory"
        );
        self.served
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
        if dst == self.me {
            let mem = self.served.registered(key)?;
            return Ok(Arc::new(LocalRemote {
                me: self.me,
                key,
                mem,
            }));
        }
        let remote = TcpRemote {
            link: self.link(dst)?.clone(),
            key,
        };
        // An empty read: the peer answers, and has the area.
        remote.read(0, &mut [])?;
        Ok(Arc::new(remote))
    }

    fn write(
        &self,
        src: Endpoint,
        dst: MachineId,
        key: MemKey,
        offset: u64,
        data: &[u8],
    ) -> Result<WriteTicket, FabricError> {
        if dst == self.me {
            let mem = self.served.registered(key)?;
            check_bounds(dst, key, &mem, offset, data.len())?;
            mem.write(offset as usize, data);
            return Ok(WriteTicket(1));
        }
        if op_too_long(OP_WRITE, data.len()) {
            return Err(FabricError::OutOfBounds {
                machine: dst,
                key,
                offset,
                len: data.len(),
                size: 0,
            });
        }
        let (id, _) = self.link(dst)?.send(
            OP_WRITE,
            key,
            src.thread,
            offset,
            data.len(),
            data,
            None,
            true,
        )?;
        Ok(WriteTicket(id))
    }

    fn write_status(&self, src: Endpoint, dst: MachineId, ticket: WriteTicket) -> WriteStatus {
        let _ = src;
        if dst == self.me {
            return WriteStatus::Done;
        }
        match self.link(dst) {
            Ok(link) => link.status(ticket.0),
            Err(_) => WriteStatus::Failed,
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

    fn admit(&self, machine: MachineId, members: &[MachineId]) {
        assert_eq!(machine, self.me, "a machine admits writers to itself only");
        let mut words = [0u64; ADMIT_MACHINES_MAX / 64];
        for m in members {
            let i = m.0 as usize;
            assert!(i < ADMIT_MACHINES_MAX, "machine {m} past the admitted set");
            words[i / 64] |= 1 << (i % 64);
        }
        let was: Vec<bool> = (0..self.links.len())
            .map(|m| self.served.admits(MachineId(m as u16)))
            .collect();
        for (w, v) in words.iter().enumerate() {
            self.served.admitted.0[w].store(*v, Ordering::Release);
        }
        // A machine removed, or added, is another incarnation from now on: neither this
        // machine's connection to it nor its connections here may carry another request
        // (as RDMA queue pairs of removed machines are torn down). Writes from a removed
        // machine are refused already; its connections are closed, so that nothing it queued
        // lands once a later incarnation is admitted.
        for (m, link) in self.links.iter().enumerate() {
            let m = MachineId(m as u16);
            if m != self.me && was[m.0 as usize] != members.contains(&m) {
                link.restart();
                if was[m.0 as usize] {
                    self.served.close_from(m);
                }
            }
        }
    }

    fn is_up(&self, machine: MachineId) -> bool {
        machine == self.me || self.link(machine).is_ok_and(|l| l.is_up())
    }

    fn traffic(&self, machine: MachineId) -> Vec<(MachineId, Traffic)> {
        assert_eq!(
            machine, self.me,
            "the tcp fabric counts its own machine's traffic"
        );
        (self.links.iter())
            .filter(|l| l.dst != self.me)
            .map(|l| (l.dst, l.traffic.get()))
            .collect()
    }

    fn broken_members(&self, machine: MachineId) -> Vec<MachineId> {
        assert_eq!(
            machine, self.me,
            "the tcp fabric answers for its own machine only"
        );
        // A link down for longer than the timeout, under repair or repaired without progress
        // (its connections keep breaking before the writes sent again are answered): a
        // connection reset between live machines is repaired within milliseconds, and
        // removing one of them for it would cost a reconfiguration and a rejoin for nothing.
        self.links
            .iter()
            .filter(|l| {
                self.served.admits(l.dst) && {
                    let inner = l.inner.lock().expect("link poisoned");
                    let long = inner.down_since.is_some_and(|at| at.elapsed() >= l.timeout);
                    match inner.state {
                        LinkState::Broken => true,
                        LinkState::Repairing => long,
                        LinkState::Up(_) => {
                            long && l.acked.load(Ordering::Acquire) < inner.resent_upto
                        }
                        LinkState::Idle => false,
                    }
                }
            })
            .map(|l| l.dst)
            .collect()
    }
}

impl ProcessFabric for TcpFabric {
    fn me(&self) -> MachineId {
        self.me
    }

    /// Machine `m` answers a probe saying it admits this machine and has its rings registered.
    fn ready(&self, m: MachineId) -> bool {
        if m == self.me {
            return self.served.admits(m) && self.served.area(MemKey::Rings).is_some();
        }
        let Ok(link) = self.link(m) else {
            return false;
        };
        match link.call(OP_PROBE, MemKey::Rings, 0, 0) {
            Reply::Answer {
                status: OK, flags, ..
            } => flags & (PROBE_ADMITS | PROBE_RINGS) == PROBE_ADMITS | PROBE_RINGS,
            _ => false,
        }
    }

    fn writes_seen(&self, thread: ThreadId) -> u64 {
        self.claim.doorbell.seen(thread)
    }

    /// This machine's NIC thread rings the doorbell after each write into the rings.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine refused for its versions says which met: the peer's (from its
    /// acknowledgement) and its own.
    #[test]
    fn a_version_refusal_names_both_sides_versions() {
        let verdict = ACK_OTHER_VERSION | 7 << 8 | 1 << 16;
        assert_eq!(
            refusal(verdict),
            format!(
                "it speaks fabric protocol 1 with records of version 7; this build speaks \
                 {VERSION} with records of version {RECORDS}"
            )
        );
        assert_eq!(other_version_ack() & 0xff, ACK_OTHER_VERSION);
        assert_eq!(refusal(ACK_OTHER_CLUSTER), "it belongs to another cluster");
    }
}
