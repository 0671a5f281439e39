//! Hosts: the workers that one OS thread polls, and what every deployment does with them
//! (docs/ARCHITECTURE.md, Machines, threads, event loop). One implementation serves the in-process
//! [`crate::Cluster`] and a [`crate::node::Node`]; they differ only in which workers a host holds:
//!
//! - in one process, host `t` is worker `t` of every machine, so one OS thread polls three
//!   machines in turn without a context switch on the commit path, and a coordinator's LOCK is
//!   processed by its peer in the same thread's next poll;
//! - in a node, host `t` is worker `t` of the node's one machine.
//!
//! A thread running a transaction (or a lock-free read) takes a host for its duration, runs
//! the closure on the coordinator's worker and, while it waits for replies and acks, keeps
//! polling every worker of the host: handlers never block, and waiting polls (a coordinator
//! waiting for its own host's participant would deadlock otherwise). A background poller per
//! host serves it while nobody holds it. Everything here is the runtime's: the protocol state
//! machines it drives (`farm_txn::Worker`) read no clock and block on nothing.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use farm_core::fabric::{Fabric, PostedRead};
use farm_core::object::Header;
use farm_core::{Addr, MachineId, ThreadId};
use farm_fabric::process::ProcessFabric;
use farm_txn::{CommitHandle, Stats, Tx, TxCore, TxError, TxState, Worker};

use crate::backoff::Backoff;
use crate::metrics::Counters;
use crate::txn::Txn;

/// Attempts of one `txn()` call at conflicts before it may give up with the last one: it
/// gives up once it made this many and [`RECOVERY_WAIT_MAX`] passed since it began. A conflict
/// may be a lock that recovery holds (§5.3: lock recovery locks what the recovering
/// transactions wrote until each is decided), which lasts as long as recovery, not a number of
/// attempts: over `tcp`, transactions gave up with "locked when read" while recovery from a
/// stopped machine held such locks.
pub const TXN_ATTEMPTS_MAX: u32 = 10_000;

/// How long a `txn()` call waits for reconfiguration and recovery (a blocked region, a
/// configuration that changed under the commit, a region without a primary) before it gives
/// up with the last error. Across processes that includes a compare-and-set in ZooKeeper.
pub(crate) const RECOVERY_WAIT_MAX: Duration = Duration::from_secs(30);

/// Most polls of its host a retry makes while the host's workers have work.
const HOST_POLLS_PER_RETRY: usize = 64;

/// Milliseconds of throughput timeline kept (one hour); later commits are not recorded.
const TIMELINE_MS_MAX: usize = 3_600_000;

/// A commit waiting this long (µs) gets its host's state logged once.
const STUCK_COMMIT_US: u64 = 10_000_000;

/// The longest an idle poller of a process fabric sleeps when no peer writes to it.
const DOORBELL_WAIT: Duration = Duration::from_micros(500);

/// The longest a poller sleeps while an executor polls its host ([`Hosts::polled`]): the
/// executor wakes it when it lets go, so this only bounds a wake-up that went missing.
const EXECUTOR_HELD_WAIT: Duration = Duration::from_millis(50);

/// Hosts per process at most (a thread's held hosts and the sessions are 64-bit sets).
pub(crate) const HOSTS_MAX: usize = 64;

/// Errors that end once a new configuration is in place and its regions recovered: a
/// transaction that meets one waits by time ([`RECOVERY_WAIT_MAX`]), not by attempts.
fn waits_for_recovery(e: &TxError) -> bool {
    matches!(
        e,
        TxError::Unavailable(_)
            | TxError::RegionBlocked(_)
            | TxError::AwaitingRegion(_)
            | TxError::ConfigurationChanged
            | TxError::LeaseLapsed(_)
    )
}

/// What a transaction does after its `attempt`-th attempt failed with `e`, `started` being
/// when its first began: the one retry rule of blocking and asynchronous transactions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Wait for reconfiguration and recovery, then try again.
    Recovery,
    /// A conflict: back off, then try again.
    Conflict,
    /// Give up with the error.
    GiveUp,
}

/// `waited_us` is how long since the first attempt began, in microseconds.
pub(crate) fn retry(e: &TxError, attempt: u32, waited_us: u64) -> Retry {
    let in_time = !waited_too_long(waited_us);
    if waits_for_recovery(e) {
        if in_time {
            Retry::Recovery
        } else {
            Retry::GiveUp
        }
    } else if e.is_retryable() && (attempt < TXN_ATTEMPTS_MAX || in_time) {
        Retry::Conflict
    } else {
        Retry::GiveUp
    }
}

/// Whether a transaction or read that began `waited_us` microseconds ago waited
/// [`RECOVERY_WAIT_MAX`] for reconfiguration and recovery.
fn waited_too_long(waited_us: u64) -> bool {
    waited_us >= RECOVERY_WAIT_MAX.as_micros() as u64
}

/// What [`Hosts::judge_read`] made of an attempt of a lock-free read.
pub(crate) enum Judged {
    /// The read's outcome.
    Done(Result<(), TxError>),
    /// Wait as this says, then try again (backing off from a conflict as a transaction
    /// does: a lock-free read of an object locked by recovery retried at every turn of a busy
    /// thread gave up long before the lock was released).
    Again(Retry),
}

/// A commit started by [`Hosts::start_commit`].
#[derive(Debug)]
pub(crate) struct Committing {
    handle: CommitHandle,
    read_only: bool,
    /// When the commit started (µs since the epoch), for the commit-latency histogram.
    started: u64,
    /// Whether its host's state was logged for waiting too long ([`Committing::overdue`]).
    reported: bool,
}

impl Committing {
    /// Whether the commit has waited longer than [`STUCK_COMMIT_US`] at `now`: true once.
    fn overdue(&mut self, now: u64) -> bool {
        if self.reported || now.saturating_sub(self.started) <= STUCK_COMMIT_US {
            return false;
        }
        self.reported = true;
        true
    }
}

/// Workers polled by one OS thread at a time.
#[derive(Debug)]
pub struct Host {
    workers: Vec<Worker>,
    /// Transactions committed on this host per millisecond since the process's epoch.
    committed_per_ms: Vec<u32>,
    /// Per worker: what the host counts for its machine beside the worker's own counters
    /// (`Counters::stats` is left default here; [`Host::counters`] fills it in).
    counters: Vec<Counters>,
    /// When the host's workers' state was last logged for a stuck commit (µs since the
    /// epoch): once per [`STUCK_COMMIT_US`], however many commits in flight are stuck.
    stuck_logged: Option<u64>,
}

impl Host {
    /// Says that `commit` is still waiting past [`STUCK_COMMIT_US`] (a commit normally ends
    /// within milliseconds, recovery included), and what this host's workers hold, at most once
    /// per `STUCK_COMMIT_US` (a pipeline may have dozens stuck together), so that it can be
    /// diagnosed.
    fn report_stuck(&mut self, i: usize, commit: &Committing, now: u64) {
        tracing::warn!(
            txn = %commit.handle,
            waited_ms = (now - commit.started) / 1000,
            at = %self.workers[i].commit_summary(commit.handle),
            "commit still waiting"
        );
        if (self.stuck_logged).is_some_and(|at| now.saturating_sub(at) <= STUCK_COMMIT_US) {
            return;
        }
        self.stuck_logged = Some(now);
        for w in &self.workers {
            tracing::warn!(
                machine = w.machine().id.0,
                thread = w.thread().0,
                recovery = %w.recovery_summary(),
                "worker state"
            );
        }
    }

    /// A host of `workers`, at most one per machine.
    pub(crate) fn new(workers: Vec<Worker>) -> Self {
        for (i, w) in workers.iter().enumerate() {
            assert!(
                workers[..i]
                    .iter()
                    .all(|o| o.machine().id != w.machine().id),
                "two workers of machine {} on one host",
                w.machine().id
            );
        }
        Self {
            counters: vec![Counters::default(); workers.len()],
            workers,
            committed_per_ms: Vec::new(),
            stuck_logged: None,
        }
    }

    /// Each worker's machine and counters: the worker's own and the host's for it.
    pub(crate) fn counters(&self) -> Vec<(MachineId, Counters)> {
        (self.workers.iter().zip(&self.counters))
            .map(|(w, c)| {
                let counters = Counters {
                    stats: w.stats().clone(),
                    rings: (w.rings_held().into_iter()).map(|r| (r.peer, r)).collect(),
                    ..c.clone()
                };
                (w.machine().id, counters)
            })
            .collect()
    }

    /// Counts a lock-free read by worker `i` that ended with `done`.
    pub(crate) fn count_lock_free_read(&mut self, i: usize, done: &Result<(), TxError>) {
        if done.is_ok() {
            self.counters[i].lock_free_reads += 1;
        }
    }

    /// The position of `machine`'s worker on this host.
    pub(crate) fn index_of(&self, machine: MachineId) -> usize {
        // In one process worker m is machine m's; a node's host has one worker.
        match self.workers.get(machine.0 as usize) {
            Some(w) if w.machine().id == machine => machine.0 as usize,
            _ => self
                .workers
                .iter()
                .position(|w| w.machine().id == machine)
                .unwrap_or_else(|| panic!("no worker of machine {machine} on this host")),
        }
    }

    fn record_commit(&mut self, now_us: u64) {
        let ms = (now_us / 1000) as usize;
        if ms >= TIMELINE_MS_MAX {
            return;
        }
        if self.committed_per_ms.len() <= ms {
            self.committed_per_ms.resize(ms + 1, 0);
        }
        self.committed_per_ms[ms] += 1;
    }

    /// Runs `f` on the transaction `core` resumed on worker `i` (which started it), the host's
    /// other workers polled while `f` waits (an allocation at a remote primary hosted by this
    /// very thread); gives back the transaction to resume later.
    pub(crate) fn resume<R>(
        &mut self,
        i: usize,
        core: TxCore,
        now: impl Fn() -> u64,
        f: impl FnOnce(&mut Tx<'_>) -> R,
    ) -> (R, TxCore) {
        let (before, rest) = self.workers.split_at_mut(i);
        let (worker, after) = rest.split_first_mut().expect("index in range");
        let mut poll_others = || {
            let now = now();
            for w in before.iter_mut().chain(after.iter_mut()) {
                w.poll(now);
            }
            now
        };
        let mut tx = Tx::resume(worker, core, Some(&mut poll_others));
        let r = f(&mut tx);
        (r, tx.suspend())
    }

    /// Worker `i`.
    pub(crate) fn worker(&mut self, i: usize) -> &mut Worker {
        &mut self.workers[i]
    }

    /// Polls every worker once, and sends what they and this thread posted (a batch open on
    /// this thread holds it back until then, `fabric::Batch`: a loop that waits on the host
    /// would otherwise hold its own answers to the peers it waits for); whether any had work.
    pub(crate) fn poll_all(&mut self, now: u64) -> bool {
        let mut busy = false;
        for w in &mut self.workers {
            busy |= w.poll(now);
        }
        farm_core::fabric::flush();
        busy
    }

    /// Polls until the host is idle, at most [`HOST_POLLS_PER_RETRY`] rounds, for a thread that
    /// holds it while waiting: what it waits for (a conflicting commit, recovery of a blocked
    /// region) may need this very host's workers, which no poller serves while it is held.
    /// Returns whether there was work.
    fn poll_until_idle(&mut self, now: impl Fn() -> u64) -> bool {
        let mut worked = false;
        for _ in 0..HOST_POLLS_PER_RETRY {
            if !self.poll_all(now()) {
                break;
            }
            worked = true;
        }
        worked
    }
}

thread_local! {
    static HOST_HINT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// Hosts this thread holds, as a bit set.
    static HOSTS_HELD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A host held by the current thread; released (and forgotten by the thread) on drop.
pub(crate) struct HostGuard<'a> {
    guard: MutexGuard<'a, Host>,
    index: usize,
}

impl HostGuard<'_> {
    /// Which host this is.
    pub(crate) fn index(&self) -> usize {
        self.index
    }
}

impl Drop for HostGuard<'_> {
    fn drop(&mut self) {
        HOSTS_HELD.with(|h| h.set(h.get() & !(1 << self.index)));
    }
}

impl std::ops::Deref for HostGuard<'_> {
    type Target = Host;
    fn deref(&self) -> &Host {
        &self.guard
    }
}

impl std::ops::DerefMut for HostGuard<'_> {
    fn deref_mut(&mut self) -> &mut Host {
        &mut self.guard
    }
}

impl std::fmt::Debug for HostGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostGuard")
            .field("index", &self.index)
            .finish()
    }
}

/// An executor's hold on its host ([`Hosts::polled`]): the doorbells of its workers, and its
/// counters published for [`Hosts::stats`].
pub(crate) struct Polled<'a> {
    hosts: &'a Hosts,
    index: usize,
    doorbells: Option<(Arc<dyn ProcessFabric>, Vec<ThreadId>)>,
}

impl Drop for Polled<'_> {
    fn drop(&mut self) {
        // The executor's bit goes first: a poller that the doorbell below wakes, and that
        // finds the host still held (its guard drops after this), must see the bit clear and
        // wait the short `DOORBELL_WAIT`, not sleep as if the executor still polled the host
        // (`Hosts::background_poll`).
        (self.hosts.executors).fetch_and(!(1u64 << self.index), Ordering::AcqRel);
        if let Some((d, threads)) = &self.doorbells {
            for t in threads {
                d.polled(*t, false);
            }
        }
    }
}

/// How often an executor publishes its host's counters ([`Hosts::publish_stats`]), in
/// microseconds.
pub(crate) const STATS_PUBLISH_US: u64 = 10_000;

/// How an idle background poller waits.
pub(crate) enum IdleWait {
    /// Sleep briefly (the `mem` fabric: every write comes from a thread of this process that
    /// polls the target's worker itself while it waits).
    Backoff,
    /// Until a peer process writes into this machine's rings, or a while for lazy work.
    Doorbell(Arc<dyn ProcessFabric>),
}

impl std::fmt::Debug for IdleWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IdleWait::Backoff => "Backoff",
            IdleWait::Doorbell(_) => "Doorbell",
        })
    }
}

/// The hosts of a process, its pollers' wait, and the rules that run transactions and reads
/// on them.
#[derive(Debug)]
pub(crate) struct Hosts {
    hosts: Vec<Mutex<Host>>,
    fabric: Arc<dyn Fabric>,
    idle: IdleWait,
    epoch: Instant,
    stop: AtomicBool,
    next_host: AtomicUsize,
    /// Hosts kept by sessions, as a bit set: other threads do not wait for them.
    sessions: AtomicU64,
    /// Hosts kept by executors ([`Hosts::polled`]), as a bit set: [`Hosts::stats`] reads their
    /// counters from `published` instead of waiting for the executor's whole batch.
    executors: AtomicU64,
    /// Each host's counters as its executor last published them.
    published: Vec<Mutex<Vec<(MachineId, Counters)>>>,
}

impl Hosts {
    /// Hosts over `fabric`, with time counted from `epoch`.
    pub(crate) fn new(
        hosts: Vec<Host>,
        fabric: Arc<dyn Fabric>,
        idle: IdleWait,
        epoch: Instant,
    ) -> Self {
        assert!(
            !hosts.is_empty() && hosts.len() <= HOSTS_MAX,
            "{} hosts: between 1 and {HOSTS_MAX}",
            hosts.len()
        );
        Self {
            published: hosts.iter().map(|_| Mutex::default()).collect(),
            hosts: hosts.into_iter().map(Mutex::new).collect(),
            fabric,
            idle,
            epoch,
            stop: AtomicBool::new(false),
            next_host: AtomicUsize::new(0),
            sessions: AtomicU64::new(0),
            executors: AtomicU64::new(0),
        }
    }

    /// Microseconds since the epoch: the `now` of every worker poll.
    pub(crate) fn now(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// How many hosts.
    pub(crate) fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Starts a background poller per host, pinned round-robin to `cores` if any.
    pub(crate) fn start_pollers(
        self: &Arc<Self>,
        cores: &[core_affinity::CoreId],
    ) -> Vec<JoinHandle<()>> {
        (0..self.hosts.len())
            .map(|t| {
                let hosts = self.clone();
                let core = cores.get(t % cores.len().max(1)).copied();
                std::thread::Builder::new()
                    .name(format!("farm-poller-{t}"))
                    .spawn(move || {
                        if let Some(c) = core {
                            core_affinity::set_for_current(c);
                        }
                        hosts.background_poll(t)
                    })
                    .expect("spawn poller")
            })
            .collect()
    }

    /// Stops the background pollers (they end within one wait: at most `EXECUTOR_HELD_WAIT`).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Serves host `t` while no transaction holds it. What is left when none runs is lazy
    /// work (truncation, feedback, late replies) and, across processes, peers' records:
    /// poll while there is work, otherwise wait without spinning, leaving the cores to
    /// transaction threads.
    fn background_poll(&self, t: usize) {
        let mut backoff = Backoff::new();
        while !self.stop.load(Ordering::Relaxed) {
            let thread = ThreadId(t as u16);
            let seen = match &self.idle {
                IdleWait::Doorbell(d) => d.writes_seen(thread),
                IdleWait::Backoff => 0,
            };
            // The guard is a temporary: the host is released before any wait.
            let busy = self.hosts[t]
                .try_lock()
                .map(|mut host| host.poll_all(self.now()));
            match (&self.idle, busy) {
                (_, Ok(true)) => backoff.reset(),
                // An executor holds the host and polls it turn by turn: nothing here until
                // it lets go, which rings this thread's doorbell (`Polled`'s drop, after it
                // cleared the executor's bit; `seen` was read before the host was tried, so a
                // release in between is not missed).
                // Waking every `DOORBELL_WAIT` to find the host taken cost each poller two
                // thousand wake-ups a second, each preempting an executor on two shared cores.
                (IdleWait::Doorbell(d), Err(_)) if self.executor_polls(t) => {
                    d.wait_for_writes(thread, seen, EXECUTOR_HELD_WAIT)
                }
                // Nothing to do, or a transaction holds the host (and polls it while it
                // waits; once it lets go, what peers wrote meanwhile is this poller's again):
                // sleep until a peer writes into this machine's rings (a LOCK, a message), or
                // for lazy work (truncation, recovery timers) a while later.
                (IdleWait::Doorbell(d), _) => d.wait_for_writes(thread, seen, DOORBELL_WAIT),
                (IdleWait::Backoff, Ok(false)) => backoff.sleep(),
                // A transaction holds the host and polls it while it waits: stay out of its way.
                (IdleWait::Backoff, Err(_)) => backoff.park(),
            }
        }
    }

    /// Whether an executor polls host `t` ([`Hosts::polled`]).
    fn executor_polls(&self, t: usize) -> bool {
        self.executors.load(Ordering::Acquire) & (1 << t) != 0
    }

    /// Says that an executor polls `host`'s workers turn by turn until the guard drops: the
    /// fabric, so that peers' writes into their rings meanwhile wake no background poller,
    /// which could not take the host anyway (`ProcessFabric::polled`); and [`Hosts::stats`],
    /// which reads the counters the executor publishes ([`Hosts::publish_stats`]) instead of
    /// waiting for the host.
    pub(crate) fn polled(&self, host: &HostGuard<'_>) -> Polled<'_> {
        self.publish_stats(host.index(), host);
        self.executors
            .fetch_or(1u64 << host.index(), Ordering::AcqRel);
        let doorbells = match &self.idle {
            IdleWait::Doorbell(d) => {
                let threads: Vec<ThreadId> = (host.workers.iter())
                    .filter(|w| w.machine().id == d.me())
                    .map(|w| w.thread())
                    .collect();
                for t in &threads {
                    d.polled(*t, true);
                }
                Some((d.clone(), threads))
            }
            IdleWait::Backoff => None,
        };
        Polled {
            hosts: self,
            index: host.index(),
            doorbells,
        }
    }

    /// Publishes the counters of host `index` (`host`, held by an executor) for
    /// [`Hosts::stats`]; an executor does so every [`STATS_PUBLISH_US`].
    pub(crate) fn publish_stats(&self, index: usize, host: &Host) {
        *self.published[index].lock().expect("stats poisoned") = host.counters();
    }

    /// Takes a host for this thread: its usual one if free, else any free one. Never one this
    /// thread already holds (a `txn()` inside a `txn()` closure takes a second host), and never
    /// waits for one a session keeps; panics if this thread holds them all, or sessions keep
    /// every host this thread does not hold, either of which would otherwise deadlock.
    pub(crate) fn take(&self) -> HostGuard<'_> {
        let n = self.hosts.len();
        let hint = HOST_HINT.with(|h| {
            h.get().unwrap_or_else(|| {
                let t = self.next_host.fetch_add(1, Ordering::Relaxed) % n;
                h.set(Some(t));
                t
            })
        }) % n;
        let held = HOSTS_HELD.with(|h| h.get());
        assert!(
            (0..n).any(|t| held & (1 << t) == 0),
            "txn() nested {n} deep on one thread: every host is held by this thread"
        );
        let take = |t: usize, guard| {
            HOSTS_HELD.with(|h| h.set(h.get() | (1 << t)));
            HostGuard { guard, index: t }
        };
        loop {
            let kept = self.sessions.load(Ordering::Acquire);
            let free: Vec<usize> = (0..n)
                .map(|i| (hint + i) % n)
                .filter(|t| (held | kept) & (1 << t) == 0)
                .collect();
            assert!(
                !free.is_empty(),
                "sessions keep every one of the {n} hosts this thread does not hold: use fewer \
                 sessions than workers per machine"
            );
            for &t in &free {
                if let Ok(guard) = self.hosts[t].try_lock() {
                    return take(t, guard);
                }
            }
            // All busy: wait for the first host neither this thread nor a session holds (the
            // mutex queues us, which is fairer than spinning against a thread that re-locks in
            // a loop), unless a session took it meanwhile.
            let guard = self.hosts[free[0]].lock().expect("host poisoned");
            if self.sessions.load(Ordering::Acquire) & (1 << free[0]) == 0 {
                return take(free[0], guard);
            }
        }
    }

    /// Marks host `index` kept by a session (or no longer, `kept == false`).
    pub(crate) fn keep(&self, index: usize, kept: bool) {
        if kept {
            self.sessions.fetch_or(1u64 << index, Ordering::AcqRel);
        } else {
            self.sessions.fetch_and(!(1u64 << index), Ordering::AcqRel);
        }
    }

    /// Runs `f` as a transaction coordinated by `machine`'s worker on `host`, retrying it:
    /// conflicts with backoff (see [`TXN_ATTEMPTS_MAX`]); errors that a new
    /// configuration and recovery end, for up to [`RECOVERY_WAIT_MAX`]. Allocations that name
    /// no locality hint go near `place` if given. Between attempts the host is polled until
    /// idle: the conflicting commit or the recovery waited for may need its workers.
    pub(crate) fn txn<R>(
        &self,
        host: &mut Host,
        machine: MachineId,
        place: Option<Addr>,
        mut f: impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        let mut backoff = Backoff::new();
        let mut attempt = 0;
        let started = self.now();
        loop {
            attempt += 1;
            match self.attempt(host, machine, place, &mut f) {
                Err(e) => match retry(&e, attempt, self.now().saturating_sub(started)) {
                    Retry::Recovery => self.wait_idle(host, &mut backoff),
                    Retry::Conflict => {
                        host.poll_until_idle(|| self.now());
                        backoff.conflict(attempt);
                    }
                    Retry::GiveUp => return Err(e),
                },
                ok => return ok,
            }
        }
    }

    /// One execution and commit of `f` coordinated by `machine`'s worker on `host` (§4), without
    /// retries: conflicts and blocked regions come back as errors.
    pub(crate) fn attempt<R>(
        &self,
        host: &mut Host,
        machine: MachineId,
        place: Option<Addr>,
        f: &mut impl FnMut(&mut Txn<'_>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        let i = self.begin(host, machine)?;
        let (value, state) = {
            // The coordinator worker executes; the host's other workers are polled while the
            // execution waits (an allocation at a remote primary hosted by this very thread).
            let (before, rest) = host.workers.split_at_mut(i);
            let (worker, after) = rest.split_first_mut().expect("index in range");
            let mut poll_others = || {
                let now = self.now();
                for w in before.iter_mut().chain(after.iter_mut()) {
                    w.poll(now);
                }
                now
            };
            let mut txn = Txn::placed(Tx::with_poller(worker, &mut poll_others), place);
            let value = f(&mut txn);
            (value, txn.into_state())
        };
        let (value, mut commit) = self.start_commit(host, i, value, state, self.now())?;
        let mut backoff = Backoff::new();
        loop {
            let now = self.now();
            if let Some(r) = self.poll_commit(host, i, &mut commit, now) {
                return r.map(|()| value);
            }
            if host.poll_all(now) {
                backoff.reset();
            } else {
                backoff.idle();
            }
        }
    }

    /// The first step of an attempt coordinated by `machine`'s worker on `host`: the position
    /// of that worker, if it may start a transaction.
    pub(crate) fn begin(&self, host: &Host, machine: MachineId) -> Result<usize, TxError> {
        let i = host.index_of(machine);
        self.may_coordinate(&host.workers[i])?;
        // A machine that joins begins once the configuration that adds it commits.
        if !host.workers[i].machine().may_begin() {
            return Err(TxError::ConfigurationChanged);
        }
        // A machine whose lease may have run out starts nothing (FaRM §5.1): `txn()` waits
        // for the renewal (or for learning it was removed) before it runs the closure.
        if !host.workers[i].machine().serves_at(self.now()) {
            return Err(TxError::LeaseLapsed(machine));
        }
        Ok(i)
    }

    /// Ends the execution of an attempt on worker `i` of `host` whose closure returned
    /// `value`: aborts it on an error, or starts its commit, at `now` on the hosts' clock.
    pub(crate) fn start_commit<R>(
        &self,
        host: &mut Host,
        i: usize,
        value: Result<R, TxError>,
        state: TxState,
        now: u64,
    ) -> Result<(R, Committing), TxError> {
        match value {
            Ok(v) => {
                let read_only = state.is_read_only();
                let handle = host.workers[i].start_commit(state);
                let started = now;
                Ok((
                    v,
                    Committing {
                        handle,
                        read_only,
                        started,
                        reported: false,
                    },
                ))
            }
            Err(e) => {
                host.workers[i].abort_execution(state, &e);
                Err(e)
            }
        }
    }

    /// Advances `commit` on worker `i` of `host`: its outcome once decided.
    pub(crate) fn poll_commit(
        &self,
        host: &mut Host,
        i: usize,
        commit: &mut Committing,
        now: u64,
    ) -> Option<Result<(), TxError>> {
        let w = &mut host.workers[i];
        if let Err(e) = self.may_coordinate(w) {
            // The coordinator's machine died under the application (in-process; in a
            // deployment the application dies with it) or was removed from the
            // configuration (§5.2): the outcome is recovery's to decide among the members,
            // which refuse this machine's writes.
            w.abandon_commit(commit.handle);
            return Some(Err(e));
        }
        let Some(r) = w.poll_commit(commit.handle, now) else {
            if commit.overdue(now) {
                host.report_stuck(i, commit, now);
            }
            return None;
        };
        if r.is_ok() {
            // A read-only transaction committed on reads alone: told only if the lease
            // held when they ended (a fresh clock, read after them). A transaction
            // that wrote committed at its primaries and backups, all members.
            if commit.read_only && !w.machine().serves_at(self.now()) {
                return Some(Err(TxError::LeaseLapsed(w.machine().id)));
            }
            host.record_commit(now);
            (host.counters[i].commit_latency).record(now.saturating_sub(commit.started));
        }
        Some(r)
    }

    /// Polls `host` until idle, and backs off only if it had nothing to do: between attempts
    /// that wait for something the workers (here or elsewhere) must finish.
    fn wait_idle(&self, host: &mut Host, backoff: &mut Backoff) {
        if host.poll_until_idle(|| self.now()) {
            backoff.reset();
        } else {
            backoff.idle();
        }
    }

    /// Whether `worker`'s machine may coordinate or serve a read: not removed from the
    /// configuration, and up (the in-process fabric kills machines whose threads go on).
    fn may_coordinate(&self, worker: &Worker) -> Result<(), TxError> {
        let machine = worker.machine().id;
        if worker.machine().is_evicted() {
            return Err(TxError::Evicted(machine));
        }

        if !self.fabric.is_up(machine) {
            return Err(TxError::CoordinatorFailed(machine));
        }
        Ok(())
    }

    /// A lock-free read (§3) by `machine`'s worker on `host` of the first `buf.len() - 8`
    /// bytes of the object at `addr` into `buf[8..]`, its header into `buf[..8]`: one consistent
    /// read at the primary, retried while the object is locked, torn or its region blocked.
    pub(crate) fn read(
        &self,
        host: &mut Host,
        machine: MachineId,
        addr: Addr,
        buf: &mut [u8],
    ) -> Result<(), TxError> {
        assert!(buf.len() >= 8, "the buffer has no room for the header");
        let i = host.index_of(machine);
        let mut backoff = Backoff::new();
        let mut attempt = 0;
        let started = self.now();
        loop {
            let read = self.read_step(&mut host.workers[i], addr, buf, None);
            match self.judge_read(&host.workers[i], addr, read, &mut attempt, started) {
                Judged::Done(done) => {
                    host.count_lock_free_read(i, &done);
                    return done;
                }
                Judged::Again(Retry::Conflict) => {
                    host.poll_until_idle(|| self.now());
                    backoff.conflict(attempt);
                }
                Judged::Again(_) => self.wait_idle(host, &mut backoff),
            }
        }
    }

    /// One attempt of a lock-free read on `worker`, taking the answer of `posted` if given.
    pub(crate) fn read_step(
        &self,
        worker: &mut Worker,
        addr: Addr,
        buf: &mut [u8],
        posted: Option<Box<dyn PostedRead>>,
    ) -> Result<Header, TxError> {
        // As for transactions: a read issued from a machine that is gone fails at once (its
        // view is stale; its reads would wait for recovery that never reaches it).
        self.may_coordinate(worker)?;
        worker.read_object_into_posted(addr, buf, posted)
    }

    /// The outcome of a lock-free read whose attempt on `worker` gave `read`, or how to wait
    /// before trying again (never [`Retry::GiveUp`]); `attempt` counts the retries, since
    /// `started` (on the hosts' clock, [`Hosts::now`]).
    pub(crate) fn judge_read(
        &self,
        worker: &Worker,
        addr: Addr,
        read: Result<Header, TxError>,
        attempt: &mut u32,
        started: u64,
    ) -> Judged {
        // A fresh clock, read after the read ended: its lease is judged by it.
        let now = self.now();
        let waited = now.saturating_sub(started);
        match read {
            // Told only if the lease held when the read ended (FaRM §5.1).
            Ok(_) if !worker.machine().serves_at(now) => {
                if waited_too_long(waited) {
                    return Judged::Done(Err(TxError::LeaseLapsed(worker.machine().id)));
                }
                Judged::Again(Retry::Recovery)
            }
            Ok(h) if h.allocated() => Judged::Done(Ok(())),
            Ok(_) => Judged::Done(Err(TxError::BadAddress {
                addr,
                why: "object is not allocated",
            })),
            // The one retry rule of transactions: a conflict is retried with backoff (see
            // `TXN_ATTEMPTS_MAX`), a machine or region that recovery will bring back is
            // waited for by time. (Counting those waits as attempts failed reads in the middle
            // of a failover, on a busy thread that retries every few microseconds.)
            Err(e) => match retry(&e, *attempt + 1, waited) {
                Retry::GiveUp => Judged::Done(Err(e)),
                how => {
                    *attempt += 1;
                    Judged::Again(how)
                }
            },
        }
    }

    /// Workers that quiescing waits for: members of their configuration whose machine is up
    /// (killed machines, and machines outside the configuration, hold what they held).
    fn counted(&self, w: &Worker) -> bool {
        w.is_member() && self.fabric.is_up(w.machine().id)
    }

    /// One round of quiescing, for checks once no transaction runs: polls every host, flushes
    /// truncations and freed-log reports, and polls again. Returns whether every counted worker
    /// is quiet: nothing it coordinates in flight, no untruncated record held (backups have
    /// installed every write, §4 step 5), recovery idle. Every machine of the cluster must be
    /// quiescing for all to get there.
    pub(crate) fn quiesce_round(&self) -> bool {
        let mut quiet = true;
        for h in &self.hosts {
            let mut host = h.lock().expect("host poisoned");
            let now = self.now();
            host.poll_all(now);
            for w in &mut host.workers {
                w.flush_truncations();
                w.report_all_freed();
            }
            host.poll_all(now);
            quiet &=
                host.workers.iter().filter(|w| self.counted(w)).all(|w| {
                    w.coordinator_quiet() && w.retained_records() == 0 && w.recovery_idle()
                });
        }
        quiet
    }

    /// At quiescence: every counted worker's outbound logs are free (no reservation or record
    /// leaked). Panics, naming the worker, if not.
    pub(crate) fn assert_logs_free(&self) {
        for h in &self.hosts {
            let mut host = h.lock().expect("host poisoned");
            for w in &mut host.workers {
                w.report_all_freed();
            }
            for w in host.workers.iter_mut().filter(|w| self.counted(w)) {
                let in_use = w.outbound_in_use();
                assert_eq!(
                    in_use,
                    0,
                    "worker {}/{} holds {in_use} log bytes at quiescence",
                    w.machine().id,
                    w.thread().0
                );
            }
        }
    }

    /// One line per worker: what it holds (for a quiescence that did not come).
    pub(crate) fn report(&self) -> String {
        let mut report = Vec::new();
        for h in &self.hosts {
            let host = h.lock().expect("host poisoned");
            for w in &host.workers {
                report.push(format!(
                    "{}/{}: quiet {} retained {} recovery: {}",
                    w.machine().id,
                    w.thread().0,
                    w.coordinator_quiet(),
                    w.retained_records(),
                    w.recovery_summary()
                ));
            }
        }
        report.join("\n")
    }

    /// Counters summed over every worker: those of a host an executor keeps as it last
    /// published them (at most [`STATS_PUBLISH_US`] old), the others' once free.
    pub(crate) fn stats(&self) -> Stats {
        let mut total = Stats::default();
        for c in self.counters().values() {
            total.add(&c.stats);
        }
        total
    }

    /// Each machine's counters, summed over the hosts (see [`Hosts::stats`]).
    pub(crate) fn counters(&self) -> std::collections::BTreeMap<MachineId, Counters> {
        let mut total = std::collections::BTreeMap::<MachineId, Counters>::new();
        for (i, h) in self.hosts.iter().enumerate() {
            // An executor may take the host while this waits for it; a blocking transaction
            // may hold it for as long as recovery takes, so the wait backs off to sleeping.
            let mut backoff = Backoff::new();
            let host = loop {
                if self.executor_polls(i) {
                    break None;
                }
                match h.try_lock() {
                    Ok(host) => break Some(host),
                    Err(std::sync::TryLockError::WouldBlock) => backoff.idle(),
                    Err(std::sync::TryLockError::Poisoned(_)) => panic!("host poisoned"),
                }
            };
            let counters = match host {
                Some(host) => host.counters(),
                None => self.published[i].lock().expect("stats poisoned").clone(),
            };
            for (m, c) in counters {
                total.entry(m).or_default().add(&c);
            }
        }
        total
    }

    /// Transactions committed per millisecond since the epoch, summed over the hosts.
    pub(crate) fn committed_per_ms(&self) -> Vec<u64> {
        let mut per_ms: Vec<u64> = Vec::new();
        for h in &self.hosts {
            let host = h.lock().expect("host poisoned");
            if per_ms.len() < host.committed_per_ms.len() {
                per_ms.resize(host.committed_per_ms.len(), 0);
            }
            for (total, n) in per_ms.iter_mut().zip(&host.committed_per_ms) {
                *total += *n as u64;
            }
        }
        per_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farm_txn::Conflict;

    /// A conflict is tried again past `TXN_ATTEMPTS_MAX` attempts until `RECOVERY_WAIT_MAX`
    /// passed (it may be a lock recovery holds), and given up on once both did.
    #[test]
    fn conflicts_are_given_up_on_after_attempts_and_time_both() {
        let e = TxError::Conflict(Conflict::ReadLocked(Addr::new(farm_core::RegionId(0), 64)));
        let long = RECOVERY_WAIT_MAX.as_micros() as u64;
        assert_eq!(retry(&e, 1, 0), Retry::Conflict);
        assert_eq!(retry(&e, TXN_ATTEMPTS_MAX, long - 1), Retry::Conflict);
        assert_eq!(retry(&e, 1, long), Retry::Conflict);
        assert_eq!(retry(&e, TXN_ATTEMPTS_MAX, long), Retry::GiveUp);
        let aborted = TxError::Aborted("by the application".into());
        assert_eq!(retry(&aborted, 1, 0), Retry::GiveUp);
        let unavailable = TxError::ConfigurationChanged;
        assert_eq!(retry(&unavailable, 1, long - 1), Retry::Recovery);
        assert_eq!(retry(&unavailable, 1, long), Retry::GiveUp);
    }
}
