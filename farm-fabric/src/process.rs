//! What the fabrics of machine processes share (docs/ARCHITECTURE.md, Fabric): the `shm` fabric (one host)
//! and the `tcp` fabric (several hosts) both run one machine per process, which
//! - claims its NVRAM directory `<dir>/m<id>/` (`claim_machine`): the directory is stamped
//!   with the cluster's id, and the process holds an exclusive lock on `alive` for as long as it
//!   lives, so no second process runs the machine;
//! - has a doorbell (`Doorbell`), a futex word that counts writes peers made into its rings,
//!   on which its idle pollers sleep;
//! - sends and receives datagrams over UDP (`Datagrams`), each stamped with the cluster's id
//!   and its sender and sealed under the cluster's secret (`crate::auth`): a forged, stale or
//!   replayed one is refused and counted before anything reads it; lease datagrams are read
//!   by the lease thread, control datagrams ([`CONTROL_TAG`]) by the CM's control thread.
//!
//! [`ProcessFabric`] is what a machine process (`farm::node`) needs of either fabric.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use farm_core::fabric::{Fabric, CONTROL_TAG};
use farm_core::ids::{MachineId, ThreadId};
use farm_core::nvram::Nvram;

use crate::auth::{self, DatagramSeal, Refusal, Replays, Secret, SEAL_BYTES, TAG_BYTES};

/// What a machine process needs of its fabric beyond [`Fabric`].
pub trait ProcessFabric: Fabric {
    /// The machine this process runs.
    fn me(&self) -> MachineId;

    /// Whether machine `m` runs and takes this machine's writes to its logs: its process
    /// answers, its rings are registered and it admitted this machine. A machine whose commits
    /// need `m` waits for this before its first transaction.
    fn ready(&self, m: MachineId) -> bool;

    /// How many writes peers have made into the rings of this machine's `thread` (the rings
    /// its worker `thread` reads, which peers' threads of the same index write): read it, look
    /// for work, then [`ProcessFabric::wait_for_writes`] with it.
    fn writes_seen(&self, thread: ThreadId) -> u64;

    /// Sleeps until a peer writes into the rings of `thread` after `seen` (from
    /// [`ProcessFabric::writes_seen`]) or `timeout` passes: an idle poller wakes for a peer's
    /// LOCK or message at once, and costs no CPU meanwhile.
    fn wait_for_writes(&self, thread: ThreadId, seen: u64, timeout: Duration);

    /// Whether an executor holds worker `thread` and polls it without sleeping long (a
    /// pipeline): writers into its rings then wake nobody, since the waiting poller could not
    /// take the worker anyway. Turning it off wakes that poller.
    fn polled(&self, thread: ThreadId, on: bool) {
        let _ = (thread, on);
    }

    /// Datagrams of this cluster refused unread: forged (their tag does not hold under the
    /// cluster's secret), stale, or replayed (`crate::auth`).
    fn datagrams_refused(&self) -> u64;
}

/// Why a machine process's fabric could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
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
    /// The NVRAM directory was made by a build whose records (logs, queues) are of another
    /// version: this build could not read them, nor its peers on the directory this build's.
    #[error(
        "the NVRAM directory {dir} holds records of version {found}; this build reads and \
         writes version {expected}: run the build that made it, or use another directory"
    )]
    OtherVersion {
        /// The directory.
        dir: String,
        /// The record version stamped in it.
        found: u8,
        /// This build's record version (`farm_core::wire::WIRE_VERSION`).
        expected: u8,
    },
    /// Another live process runs this machine.
    #[error("machine {0} already runs in another process (its `alive` lock is held)")]
    AlreadyRunning(MachineId),
    /// A bad setting, named.
    #[error("{0}")]
    Invalid(String),
    /// The directory or a socket failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: io::Error,
    },
}

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> StartError {
    let what = what.into();
    move |source| StartError::Io { what, source }
}

/// A machine's NVRAM directory under the cluster's directory.
pub fn machine_dir(dir: &Path, machine: MachineId) -> PathBuf {
    dir.join(format!("m{}", machine.0))
}

/// A machine directory this process claimed: dropping it (or dying) releases the machine.
#[derive(Debug)]
pub(crate) struct Claim {
    _alive: File,
    /// The machine's doorbell.
    pub(crate) doorbell: Doorbell,
    /// This life of the machine (`next_incarnation`).
    pub(crate) incarnation: u64,
}

/// Claims machine `me`'s directory under `dir` for this process: checks that `dir` is
/// `cluster`'s (stamping it when new), takes `me`'s `alive` lock (failing if another live
/// process holds it) and maps its doorbell.
pub(crate) fn claim_machine(dir: &Path, cluster: u64, me: MachineId) -> Result<Claim, StartError> {
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
        Err(TryLockError::WouldBlock) => return Err(StartError::AlreadyRunning(me)),
        Err(TryLockError::Error(e)) => {
            return Err(io_err(format!("locking {}", path.display()))(e))
        }
    }
    let path = mdir.join("doorbell");
    // Nothing in it outlives the process but its size: a file of another size (an earlier
    // layout) is resized.
    if std::fs::metadata(&path).is_ok_and(|m| m.len() != DOORBELL_BYTES as u64) {
        std::fs::remove_file(&path).map_err(io_err(format!("removing {}", path.display())))?;
    }
    let doorbell = Nvram::file(&path, DOORBELL_BYTES)
        .map_err(io_err(format!("creating {}", path.display())))?;
    // An earlier life's waiters and executors died with it.
    for t in 0..DOORBELL_SLOTS {
        let at = t * SLOT_BYTES;
        doorbell.store_u64(at + SLOT_WAITERS, 0, Ordering::Release);
        doorbell.store_u64(at + SLOT_POLLED, 0, Ordering::Release);
    }
    Ok(Claim {
        _alive: alive,
        doorbell: Doorbell(Arc::new(doorbell)),
        incarnation: next_incarnation(&mdir)?,
    })
}

/// The incarnation of a new life of the machine whose directory is `mdir`: microseconds
/// since the epoch, and above every earlier life's (kept in `incarnation`), so that a clock
/// that stepped back since does not make receivers take this life's datagrams for replays of
/// an earlier one's. Called with the machine's `alive` lock held.
fn next_incarnation(mdir: &Path) -> Result<u64, StartError> {
    let path = mdir.join("incarnation");
    let before = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let incarnation = auth::wall_us().max(before + 1);
    let aside = mdir.join("incarnation.new");
    std::fs::write(&aside, format!("{incarnation}\n"))
        .map_err(io_err(format!("writing {}", aside.display())))?;
    std::fs::rename(&aside, &path).map_err(io_err(format!("renaming to {}", path.display())))?;
    Ok(incarnation)
}

/// Stamps `dir` with the cluster id and the version of the records its logs and queues hold
/// (`farm_core::wire::WIRE_VERSION`), or checks the stamp already there: a directory holds the
/// NVRAM of one cluster only, written by builds that read each other's records (a restart on
/// it, or a peer on the `shm` fabric). The stamp appears whole (written aside, then linked
/// into place), so racing first processes of one cluster all read the same one. A stamp
/// without a version line predates it: version 1.
fn stamp_cluster(dir: &Path, me: MachineId, cluster: u64) -> Result<(), StartError> {
    let stamp = dir.join("cluster");
    let records = farm_core::wire::WIRE_VERSION;
    if !stamp.exists() {
        let aside = dir.join(format!("cluster.m{}", me.0));
        std::fs::write(&aside, format!("{cluster:#x}\nrecords {records}\n"))
            .map_err(io_err(format!("writing {}", aside.display())))?;
        // Fails if another process linked its stamp first: then that one is checked below.
        let _ = std::fs::hard_link(&aside, &stamp);
        let _ = std::fs::remove_file(&aside);
    }
    let text =
        std::fs::read_to_string(&stamp).map_err(io_err(format!("reading {}", stamp.display())))?;
    let invalid = |what: String| {
        io_err(format!("reading {}", stamp.display()))(io::Error::new(
            io::ErrorKind::InvalidData,
            what,
        ))
    };
    let mut lines = text.lines();
    let id = lines.next().unwrap_or_default().trim();
    let found = u64::from_str_radix(id.trim_start_matches("0x"), 16)
        .map_err(|e| invalid(format!("not a cluster id: {e}")))?;
    if found != cluster {
        return Err(StartError::OtherCluster {
            dir: dir.display().to_string(),
            found,
            expected: cluster,
        });
    }
    let stamped = match lines.next().map(str::trim) {
        None | Some("") => 1,
        Some(line) => line
            .strip_prefix("records ")
            .and_then(|v| v.parse::<u8>().ok())
            .ok_or_else(|| invalid(format!("not a record version: {line:?}")))?,
    };
    if stamped != records {
        return Err(StartError::OtherVersion {
            dir: dir.display().to_string(),
            found: stamped,
            expected: records,
        });
    }
    Ok(())
}

/// Threads with a doorbell slot of their own; thread `t` uses slot `t % DOORBELL_SLOTS`.
const DOORBELL_SLOTS: usize = 64;
/// A slot of the doorbell file: a count of writes peers made into its thread's rings (a futex
/// word), how many pollers wait on it, and whether an executor polls the thread's worker.
const SLOT_BYTES: usize = 24;
const DOORBELL_BYTES: usize = DOORBELL_SLOTS * SLOT_BYTES;
const SLOT_COUNT: usize = 0;
const SLOT_WAITERS: usize = 8;
const SLOT_POLLED: usize = 16;

/// A machine's doorbell (`<dir>/m<id>/doorbell`), a slot per worker thread: whoever writes
/// into the rings of a thread rings its slot (a peer's process that maps the file, or the
/// machine's own NIC thread), so that a LOCK for worker 0 does not wake the poller of worker 1.
#[derive(Clone, Debug)]
pub(crate) struct Doorbell(pub(crate) Arc<Nvram>);

fn slot(thread: ThreadId) -> usize {
    thread.0 as usize % DOORBELL_SLOTS * SLOT_BYTES
}

impl Doorbell {
    /// Maps the doorbell of a peer's directory, if it has one.
    pub(crate) fn open(path: &Path) -> Option<Self> {
        Nvram::open(path).ok().map(|n| Self(Arc::new(n)))
    }

    pub(crate) fn seen(&self, thread: ThreadId) -> u64 {
        self.0
            .load_u64(slot(thread) + SLOT_COUNT, Ordering::Acquire)
    }

    pub(crate) fn wait(&self, thread: ThreadId, seen: u64, timeout: Duration) {
        let (bell, at) = (&self.0, slot(thread));
        bell.fetch_add_u64(at + SLOT_WAITERS, 1);
        if bell.load_u64(at + SLOT_COUNT, Ordering::Acquire) == seen {
            bell.futex_wait(at + SLOT_COUNT, seen as u32, timeout);
        }
        bell.fetch_sub_u64(at + SLOT_WAITERS, 1);
    }

    /// Announces a write into `thread`'s rings, waking its waiting poller unless an executor
    /// polls that worker.
    pub(crate) fn ring(&self, thread: ThreadId) {
        let (bell, at) = (&self.0, slot(thread));
        bell.fetch_add_u64(at + SLOT_COUNT, 1);
        if bell.load_u64(at + SLOT_WAITERS, Ordering::Acquire) > 0
            && bell.load_u64(at + SLOT_POLLED, Ordering::Acquire) == 0
        {
            bell.futex_wake(at + SLOT_COUNT);
        }
    }

    /// [`ProcessFabric::polled`].
    pub(crate) fn polled(&self, thread: ThreadId, on: bool) {
        let (bell, at) = (&self.0, slot(thread));
        if on {
            bell.fetch_add_u64(at + SLOT_POLLED, 1);
        } else {
            bell.fetch_sub_u64(at + SLOT_POLLED, 1);
            bell.fetch_add_u64(at + SLOT_COUNT, 1);
            bell.futex_wake(at + SLOT_COUNT);
        }
    }
}

const DATAGRAM_MAGIC: u32 = 0xfa53_d6a8;
/// Magic, cluster and sender, then the seal; the tag follows the payload.
const DATAGRAM_HEADER_BYTES: usize = 4 + 8 + 2 + SEAL_BYTES;
/// Largest datagram payload (a NEW-CONFIG carries the region map).
pub const DATAGRAM_BYTES_MAX: usize = 60 << 10;

/// Where each machine's datagram socket is.
#[derive(Clone, Debug)]
pub(crate) enum Peers {
    /// Machine `m` at `127.0.0.1:base + m` (the `shm` fabric).
    Loopback(u16),
    /// Machine `m` at the `m`th address (the `tcp` fabric).
    Listed(Vec<SocketAddr>),
}

impl Peers {
    pub(crate) fn addr(&self, m: MachineId) -> Option<SocketAddr> {
        match self {
            Peers::Loopback(base) => base
                .checked_add(m.0)
                .map(|p| SocketAddr::from(([127, 0, 0, 1], p))),
            Peers::Listed(addrs) => addrs.get(m.0 as usize).copied(),
        }
    }
}

/// A machine's datagrams over UDP. Datagrams of another cluster and malformed ones are dropped
/// unread; forged, stale and replayed ones of this cluster are refused and counted.
#[derive(Debug)]
pub(crate) struct Datagrams {
    cluster: u64,
    me: MachineId,
    secret: Secret,
    /// This process's life, in the seal of every datagram it sends: a restarted sender's
    /// datagrams start a new life at the receivers, and the old life's are refused.
    incarnation: u64,
    /// The sequence number of the next datagram to each machine: counted per destination, so
    /// that datagrams to other machines sealed meanwhile cannot push one that was delayed
    /// between its seal and its sending out of the receiver's replay window.
    next_seq: Mutex<Vec<u64>>,
    /// What was taken from each sender, against replays.
    replays: Mutex<Replays>,
    /// Datagrams refused, by kind: forged, stale, replayed.
    refused: [AtomicU64; 3],
    peers: Peers,
    socket: UdpSocket,
    /// A socket to send from (datagrams carry their sender inside).
    sender: UdpSocket,
    /// Datagrams read by the other kind's reader: (sender, payload).
    lease_in: Mutex<VecDeque<(MachineId, Vec<u8>)>>,
    control_in: Mutex<VecDeque<(MachineId, Vec<u8>)>>,
}

impl Datagrams {
    /// Binds machine `me`'s datagram socket at its address among `peers`; datagrams are sealed
    /// and checked under `secret`.
    pub(crate) fn bind(
        cluster: u64,
        me: MachineId,
        peers: Peers,
        secret: Secret,
        incarnation: u64,
    ) -> Result<Self, StartError> {
        let addr = peers.addr(me).ok_or_else(|| {
            StartError::Invalid(format!("machine {me} has no datagram address: {peers:?}"))
        })?;
        let socket = UdpSocket::bind(addr).map_err(io_err(format!("binding UDP {addr}")))?;
        socket
            .set_nonblocking(true)
            .map_err(io_err("making the datagram socket non-blocking"))?;
        let sender = socket
            .try_clone()
            .map_err(io_err("cloning the datagram socket"))?;
        Ok(Self {
            cluster,
            me,
            secret,
            incarnation,
            next_seq: Mutex::new(Vec::new()),
            replays: Mutex::new(Replays::default()),
            refused: Default::default(),
            peers,
            socket,
            sender,
            lease_in: Mutex::new(VecDeque::new()),
            control_in: Mutex::new(VecDeque::new()),
        })
    }

    /// Sends `data` from `src` to `dst`; unreliable by contract, so a full buffer, a dead peer
    /// or a datagram too large loses it.
    pub(crate) fn send(&self, src: MachineId, dst: MachineId, data: &[u8]) {
        let Some(to) = self.peers.addr(dst) else {
            return;
        };
        if data.len() > DATAGRAM_BYTES_MAX {
            return;
        }
        let mut msg = Vec::with_capacity(DATAGRAM_HEADER_BYTES + data.len() + TAG_BYTES);
        msg.extend_from_slice(&DATAGRAM_MAGIC.to_le_bytes());
        msg.extend_from_slice(&self.cluster.to_le_bytes());
        msg.extend_from_slice(&src.0.to_le_bytes());
        self.seal(dst).encode(&mut msg);
        msg.extend_from_slice(data);
        let tag = auth::datagram_tag(&self.secret, dst.0, &msg);
        msg.extend_from_slice(&tag);
        let _ = self.sender.send_to(&msg, to);
    }

    /// The seal of the next datagram to `dst`.
    fn seal(&self, dst: MachineId) -> DatagramSeal {
        let mut next = self.next_seq.lock().expect("sequence numbers poisoned");
        let i = dst.0 as usize;
        if next.len() <= i {
            next.resize(i + 1, 1);
        }
        let seq = next[i];
        next[i] += 1;
        DatagramSeal {
            incarnation: self.incarnation,
            seq,
            sent_us: auth::wall_us(),
        }
    }

    /// Datagrams refused so far (forged, stale and replayed).
    pub(crate) fn refused(&self) -> u64 {
        self.refused.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Counts a refused datagram from `src`, logging the first of each kind.
    fn refuse(&self, src: MachineId, why: Refusal) {
        let (i, what) = match why {
            Refusal::Forged => (0, "its tag does not hold under the cluster's secret"),
            Refusal::Stale => (1, "it was sent over a minute from this host's clock"),
            Refusal::Replayed => (2, "it was taken before, or is from an earlier life"),
        };
        if self.refused[i].fetch_add(1, Ordering::Relaxed) == 0 {
            tracing::warn!(
                claimed_sender = src.0,
                "refused a datagram: {what} (further ones of this kind are counted only)"
            );
        }
    }

    /// One datagram for `dst` of the kind asked, if `dst` is this process's machine `me` (a
    /// process receives only its own machine's).
    pub(crate) fn recv_for(
        &self,
        me: MachineId,
        dst: MachineId,
        control: bool,
        buf: &mut Vec<u8>,
    ) -> Option<MachineId> {
        if dst != me {
            return None;
        }
        self.recv(control, buf)
    }

    /// One datagram of the kind asked (control or lease), queued or from the socket.
    pub(crate) fn recv(&self, control: bool, buf: &mut Vec<u8>) -> Option<MachineId> {
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
        raw.resize(DATAGRAM_HEADER_BYTES + DATAGRAM_BYTES_MAX + TAG_BYTES, 0);
        loop {
            let n = match self.socket.recv_from(raw) {
                Ok((n, _)) => n,
                Err(_) => return None, // WouldBlock: nothing due.
            };
            if n < DATAGRAM_HEADER_BYTES + TAG_BYTES
                || raw[..4] != DATAGRAM_MAGIC.to_le_bytes()
                || raw[4..12] != self.cluster.to_le_bytes()
            {
                continue; // Not this cluster's, or malformed: dropped unread.
            }
            let src = MachineId(u16::from_le_bytes([raw[12], raw[13]]));
            let (sealed, tag) = raw[..n].split_at(n - TAG_BYTES);
            if !auth::datagram_tag_holds(&self.secret, self.me.0, sealed, tag) {
                self.refuse(src, Refusal::Forged);
                continue;
            }
            let seal = DatagramSeal::decode(&sealed[14..DATAGRAM_HEADER_BYTES]);
            let taken =
                self.replays
                    .lock()
                    .expect("replays poisoned")
                    .take(src.0, seal, auth::wall_us());
            if let Err(why) = taken {
                self.refuse(src, why);
                continue;
            }
            let payload = &sealed[DATAGRAM_HEADER_BYTES..];
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory holds records of one version: a build whose records differ (a restart on
    /// it after an upgrade, or a peer process of another build on `shm`) is refused, naming
    /// both versions. A new directory is stamped with this build's; a stamp from before
    /// versions were stamped holds version 1.
    #[test]
    fn a_directory_of_another_record_version_is_refused_naming_both() {
        const CLUSTER: u64 = 0x5eed;
        let records = farm_core::wire::WIRE_VERSION;
        let dir = tempfile::tempdir().unwrap();
        stamp_cluster(dir.path(), MachineId(0), CLUSTER).unwrap();
        stamp_cluster(dir.path(), MachineId(1), CLUSTER).unwrap();
        let stamp = std::fs::read_to_string(dir.path().join("cluster")).unwrap();
        assert_eq!(stamp, format!("{CLUSTER:#x}\nrecords {records}\n"));

        let newer = records + 1;
        std::fs::write(
            dir.path().join("cluster"),
            format!("{CLUSTER:#x}\nrecords {newer}\n"),
        )
        .unwrap();
        match stamp_cluster(dir.path(), MachineId(0), CLUSTER) {
            Err(e @ StartError::OtherVersion { .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(&format!("records of version {newer}"))
                        && msg.contains(&format!("writes version {records}")),
                    "{msg}"
                );
            }
            other => panic!("a directory of records {newer} was opened: {other:?}"),
        }

        std::fs::write(dir.path().join("cluster"), format!("{CLUSTER:#x}\n")).unwrap();
        let opened = stamp_cluster(dir.path(), MachineId(0), CLUSTER);
        assert_eq!(
            opened.is_ok(),
            records == 1,
            "a stamp without a version (version 1) with records {records}: {opened:?}"
        );
    }

    /// A datagram is taken when datagrams to other machines were sealed between its seal and
    /// its sending (another thread sent them while this one was descheduled): sequence
    /// numbers count per destination, so only datagrams to the same machine can push it out
    /// of the receiver's replay window.
    #[test]
    fn datagrams_to_other_machines_do_not_push_one_out_of_the_replay_window() {
        let port = {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            s.local_addr().unwrap().port()
        };
        let d = Datagrams::bind(
            0x5eed,
            MachineId(0),
            Peers::Loopback(port),
            Secret::from_bytes(b"a test cluster's secret").unwrap(),
            1,
        )
        .unwrap();
        let late = d.seal(MachineId(1));
        for _ in 0..2 * auth::REPLAY_WINDOW {
            d.seal(MachineId(2));
        }
        let next = d.seal(MachineId(1));
        let mut at1 = Replays::default();
        assert_eq!(at1.take(0, next, next.sent_us), Ok(()));
        assert_eq!(
            at1.take(0, late, next.sent_us),
            Ok(()),
            "a late datagram refused"
        );
        assert_eq!(at1.take(0, late, next.sent_us), Err(Refusal::Replayed));
    }

    /// A restarted machine's datagrams are a new life at every receiver only if its
    /// incarnation grows: it does across restarts even when the clock stepped back.
    #[test]
    fn a_machine_incarnation_grows_across_restarts_even_if_the_clock_steps_back() {
        const CLUSTER: u64 = 0x5eed;
        let dir = tempfile::tempdir().unwrap();
        let first = claim_machine(dir.path(), CLUSTER, MachineId(0)).unwrap();
        let was = first.incarnation;
        drop(first);
        let second = claim_machine(dir.path(), CLUSTER, MachineId(0)).unwrap();
        assert!(second.incarnation > was);
        drop(second);
        // A life recorded an hour ahead of this clock (the clock stepped back since).
        let ahead = auth::wall_us() + 3_600_000_000;
        std::fs::write(
            machine_dir(dir.path(), MachineId(0)).join("incarnation"),
            format!("{ahead}\n"),
        )
        .unwrap();
        let third = claim_machine(dir.path(), CLUSTER, MachineId(0)).unwrap();
        assert!(third.incarnation > ahead);
    }
}
