//! Many transactions in flight on one thread (docs/ARCHITECTURE.md, Transactions in flight):
//! a single-threaded executor that owns a host while it runs a batch of tasks, each an async
//! closure that runs transactions ([`Pipeline::txn`]) and lock-free reads
//! ([`Pipeline::read_bytes_into`]). A transaction that waits (for a posted one-sided read, for
//! its commit's LOCK replies, validation or acks) yields, and the executor runs the others and
//! polls the host's workers between turns, as FaSST and DrTM+H run coroutines; it sleeps only
//! when no task moved and no worker had work.
//!
//! Each transaction keeps its execution ([`farm_txn::TxCore`]) while it waits and borrows its
//! worker only inside each step, so the tasks share the host through a `RefCell` that is never
//! held across an await. Retries follow the one rule of blocking transactions
//! ([`crate::hosts::retry`]); a conflict backs off by yielding turns, never by sleeping the
//! thread the others run on.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytemuck::Pod;
use farm_core::rng::Rng;
use farm_core::{fabric, Addr, MachineId};
use farm_txn::{TxCore, TxError, COMMITS_IN_FLIGHT_MAX};

use crate::backoff::{conflict_rng, conflict_rounds, Backoff};
use crate::hosts::{retry, Host, HostGuard, Hosts, Judged, Retry, STATS_PUBLISH_US};
use crate::txn::Transaction;

/// How long a transaction waiting for reconfiguration and recovery lets the others run
/// before it tries again.
const RECOVERY_PAUSE: Duration = Duration::from_micros(100);

/// Transactions and lock-free reads that may end between two turns before the tasks that end
/// more yield. Those that never wait (a commit whose primaries are all on this machine, over
/// `shm`, is decided inside its first poll) would otherwise run a task forever inside one poll,
/// and the executor would never poll its host: the records other machines write into its
/// logs would stay there, and they would wait for log space for as long as it ran.
const ENDED_PER_TURN_MAX: u32 = 16;

/// Where a pipeline's transactions run: the worker that coordinates a transaction named after
/// `machine`, and where its allocations without a hint go.
pub(crate) type Route<'a> = &'a dyn Fn(MachineId) -> (MachineId, Option<Addr>);

/// What each task of a batch runs its transactions and reads on (see the module docs).
pub struct Pipeline<'a> {
    hosts: &'a Hosts,
    host: &'a RefCell<&'a mut Host>,
    route: Route<'a>,
    machines: u16,
    /// Whether a task finished a wait this turn (the executor does not sleep then).
    progress: Cell<bool>,
    /// Transactions and lock-free reads ended since the last turn (`ENDED_PER_TURN_MAX`).
    ended: Cell<u32>,
    /// The hosts' clock ([`Hosts::now`]) read once per turn, for what the tasks time in it
    /// (a commit's progress and latency, when a retry began): with many tasks, a clock read
    /// per task per turn cost more than any one step. A lease is never judged by it.
    now: Cell<u64>,
    /// Draws the tasks' conflict backoffs.
    rng: RefCell<Rng>,
}

impl std::fmt::Debug for Pipeline<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline").finish_non_exhaustive()
    }
}

/// Runs `tasks` tasks of `f` (each given the pipeline and its index) on `host` until every one
/// ended: the executor of one thread.
pub(crate) fn run<F>(
    hosts: &Hosts,
    host: &mut HostGuard<'_>,
    route: Route<'_>,
    machines: u16,
    tasks: usize,
    f: F,
) where
    F: AsyncFn(&Pipeline<'_>, usize),
{
    // Peers' writes into this host's rings need wake nobody while the executor polls it, and
    // its counters are published for `Hosts::stats` every `STATS_PUBLISH_US`.
    let _polled = hosts.polled(host);
    let index = host.index();
    let mut published = hosts.now();
    let cell = RefCell::new(&mut **host);
    let p = Pipeline {
        hosts,
        host: &cell,
        route,
        machines,
        progress: Cell::new(false),
        ended: Cell::new(0),
        now: Cell::new(published),
        rng: RefCell::new(conflict_rng()),
    };
    let mut cx = Context::from_waker(Waker::noop());
    let mut backoff = Backoff::new();
    // What a turn posts goes out with one send per peer at its end (`fabric::Batch`).
    let _batch = fabric::Batch::open();
    // Between turns: poll the host's workers, send what the turn posted, and back off only
    // when nothing moved.
    let mut turn = |p: &Pipeline<'_>| {
        let now = hosts.now();
        p.now.set(now);
        p.ended.set(0);
        // Polling the host sends what the turn posted, one send per peer.
        let busy = cell.borrow_mut().poll_all(now);
        if now >= published + STATS_PUBLISH_US {
            hosts.publish_stats(index, &cell.borrow());
            published = now;
        }
        if busy || p.progress.replace(false) {
            backoff.reset();
        } else {
            backoff.idle();
        }
    };
    if tasks == 1 {
        // A blocking call's one task (`Tables::run` and the like, per transaction): no boxes.
        let mut task = std::pin::pin!(f(&p, 0));
        while task.as_mut().poll(&mut cx).is_pending() {
            turn(&p);
        }
        return;
    }
    let mut running: Vec<Option<Pin<Box<dyn Future<Output = ()> + '_>>>> = (0..tasks)
        .map(|k| Some(Box::pin(f(&p, k)) as Pin<Box<dyn Future<Output = ()>>>))
        .collect();
    loop {
        let mut live = 0;
        for task in &mut running {
            if let Some(fut) = task {
                if fut.as_mut().poll(&mut cx).is_ready() {
                    *task = None;
                    p.progress.set(true);
                } else {
                    live += 1;
                }
            }
        }
        if live == 0 {
            return;
        }
        turn(&p);
    }
}

/// A future that is pending once: the task lets the others run a turn.
struct YieldNow(bool);

impl Future for YieldNow {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            Poll::Pending
        }
    }
}

impl<'a> Pipeline<'a> {
    /// The number of machines.
    pub fn machines(&self) -> u16 {
        self.machines
    }

    /// Lets the other tasks run a turn.
    pub async fn yield_now(&self) {
        YieldNow(false).await
    }

    /// Counts a transaction or lock-free read that ended, and lets the others run a turn once
    /// `ENDED_PER_TURN_MAX` ended since the last.
    async fn ended(&self) {
        self.ended.set(self.ended.get() + 1);
        if self.ended.get() > ENDED_PER_TURN_MAX {
            self.yield_now().await;
        }
    }

    /// Lets the other tasks run until `cond` holds.
    async fn until(&self, mut cond: impl FnMut() -> bool) {
        if cond() {
            return;
        }
        loop {
            self.yield_now().await;
            if cond() {
                self.progress.set(true);
                return;
            }
        }
    }

    /// Runs `f` as a strictly serializable transaction named after `machine` (as
    /// [`crate::Client::txn`] names it), retrying it as a blocking transaction is retried,
    /// while the thread's other tasks run whenever it waits. Returns the closure's value once
    /// the transaction committed, or why it could not.
    pub async fn txn<R>(
        &self,
        machine: MachineId,
        mut f: impl AsyncFnMut(&mut AsyncTxn<'_, 'a>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        let started = self.now.get();
        let mut attempt = 0;
        let outcome = loop {
            attempt += 1;
            match self.attempt(machine, &mut f).await {
                Err(e) => match retry(&e, attempt, self.hosts.now().saturating_sub(started)) {
                    Retry::GiveUp => break Err(e),
                    how => self.back_off(how, attempt).await,
                },
                ok => break ok,
            }
        };
        self.ended().await;
        outcome
    }

    /// Lets the other tasks run before a retry: a pause for recovery, a random number of
    /// turns after the `attempt`-th conflict.
    async fn back_off(&self, how: Retry, attempt: u32) {
        match how {
            Retry::Recovery => {
                let until = self.now.get() + RECOVERY_PAUSE.as_micros() as u64;
                self.until(|| self.now.get() >= until).await;
            }
            Retry::Conflict => {
                let rounds = conflict_rounds(attempt, &mut self.rng.borrow_mut());
                for _ in 0..rounds {
                    self.yield_now().await;
                }
            }
            Retry::GiveUp => {}
        }
    }

    /// One execution and commit of `f`, without retries.
    async fn attempt<R>(
        &self,
        machine: MachineId,
        f: &mut impl AsyncFnMut(&mut AsyncTxn<'_, 'a>) -> Result<R, TxError>,
    ) -> Result<R, TxError> {
        let (coordinator, place) = (self.route)(machine);
        let (worker, core) = {
            let mut host = self.host.borrow_mut();
            let i = self.hosts.begin(&host, coordinator)?;
            (i, TxCore::new(host.worker(i)))
        };
        let mut tx = AsyncTxn {
            p: self,
            worker,
            core: Some(core),
            place,
        };
        let value = f(&mut tx).await;
        let state = tx.core.take().expect("open until here").into_state();
        if value.is_ok() {
            // A worker keeps at most COMMITS_IN_FLIGHT_MAX commits in flight; with more tasks
            // than that, a commit waits for room (no await between the check and the start).
            self.until(|| {
                let mut host = self.host.borrow_mut();
                host.worker(worker).commits_in_flight() < COMMITS_IN_FLIGHT_MAX
            })
            .await;
        }
        let (value, mut commit) = {
            let mut host = self.host.borrow_mut();
            (self.hosts).start_commit(&mut host, worker, value, state, self.now.get())?
        };
        let mut outcome = None;
        self.until(|| {
            let mut host = self.host.borrow_mut();
            outcome = (self.hosts).poll_commit(&mut host, worker, &mut commit, self.now.get());
            outcome.is_some()
        })
        .await;
        outcome.expect("decided").map(|()| value)
    }

    /// A lock-free read (see [`crate::Cluster::read_bytes_into`]) by `machine`'s worker: the
    /// read is posted, and the other tasks run until its answer is here.
    pub async fn read_bytes_into(
        &self,
        machine: MachineId,
        addr: Addr,
        buf: &mut [u8],
    ) -> Result<(), TxError> {
        assert!(buf.len() >= 8, "the buffer has no room for the header");
        let (coordinator, _) = (self.route)(machine);
        let i = self.host.borrow().index_of(coordinator);
        let started = self.now.get();
        let mut attempt = 0;
        loop {
            let posted = self
                .host
                .borrow_mut()
                .worker(i)
                .post_object_read(addr, buf.len() - 8);
            if let Some(p) = &posted {
                self.until(|| p.is_done()).await;
            }
            let judged = {
                let mut host = self.host.borrow_mut();
                let w = host.worker(i);
                let read = self.hosts.read_step(w, addr, buf, posted);
                let judged = self.hosts.judge_read(w, addr, read, &mut attempt, started);
                if let Judged::Done(done) = &judged {
                    host.count_lock_free_read(i, done);
                }
                judged
            };
            match judged {
                Judged::Done(done) => {
                    self.ended().await;
                    return done;
                }
                Judged::Again(how) => self.back_off(how, attempt).await,
            }
        }
    }

    /// A lock-free read of one object as a `T` (see [`Pipeline::read_bytes_into`]).
    pub async fn read<T: Pod>(&self, machine: MachineId, addr: Addr) -> Result<T, TxError> {
        let mut buf = vec![0u8; 8 + std::mem::size_of::<T>()];
        self.read_bytes_into(machine, addr, &mut buf).await?;
        Ok(bytemuck::pod_read_unaligned(&buf[8..]))
    }
}

/// A transaction in execution among others on one thread ([`Pipeline::txn`]): reads wait by
/// yielding; everything else is as [`crate::Txn`]'s, through [`Transaction`].
pub struct AsyncTxn<'t, 'a> {
    p: &'t Pipeline<'a>,
    worker: usize,
    /// The execution; taken when the closure returns.
    core: Option<TxCore>,
    place: Option<Addr>,
}

impl std::fmt::Debug for AsyncTxn<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncTxn")
            .field("core", &self.core)
            .finish_non_exhaustive()
    }
}

impl AsyncTxn<'_, '_> {
    /// Runs `f` on the transaction with its worker borrowed.
    fn step<R>(&mut self, f: impl FnOnce(&mut farm_txn::Tx<'_>) -> R) -> R {
        let core = self.core.take().expect("a transaction step after its end");
        let hosts = self.p.hosts;
        let (r, core) = self
            .p
            .host
            .borrow_mut()
            .resume(self.worker, core, || hosts.now(), f);
        self.core = Some(core);
        r
    }

    /// Runs `f` on the transaction once a read of `len` bytes at `addr` is here, letting the
    /// other tasks run until then.
    async fn once_read<R>(
        &mut self,
        addr: Addr,
        len: usize,
        f: impl FnOnce(&mut farm_txn::Tx<'_>) -> R,
    ) -> R {
        let mut f = Some(f);
        let mut waited = false;
        loop {
            let done = self.step(|tx| {
                tx.read_ready(addr, len)
                    .then(|| (f.take().expect("run once"))(tx))
            });
            if let Some(r) = done {
                if waited {
                    self.p.progress.set(true);
                }
                return r;
            }
            waited = true;
            self.p.yield_now().await;
        }
    }
}

impl Drop for AsyncTxn<'_, '_> {
    /// A transaction dropped during its execution (its task ended first) gives back what it
    /// allocated, as an aborted one does.
    fn drop(&mut self) {
        if let Some(core) = self.core.take() {
            if let Ok(mut host) = self.p.host.try_borrow_mut() {
                let e = TxError::Aborted("dropped during its execution".into());
                host.worker(self.worker)
                    .abort_execution(core.into_state(), &e);
            }
        }
    }
}

impl Transaction for AsyncTxn<'_, '_> {
    async fn read_with<R>(
        &mut self,
        addr: Addr,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, TxError> {
        self.once_read(addr, len, |tx| tx.read(addr, len).map(f))
            .await
    }

    fn prefetch(&mut self, addr: Addr, len: usize) {
        self.step(|tx| tx.prefetch(addr, len))
    }

    async fn write_bytes(&mut self, addr: Addr, data: &[u8]) -> Result<(), TxError> {
        self.once_read(addr, 0, |tx| tx.write(addr, data)).await
    }

    fn alloc_bytes(&mut self, data: &[u8], near: Option<Addr>) -> Result<Addr, TxError> {
        let near = near.or(self.place);
        self.step(|tx| {
            let addr = tx.alloc(data.len(), near)?;
            tx.write(addr, data)?;
            Ok(addr)
        })
    }

    async fn free(&mut self, addr: Addr) -> Result<(), TxError> {
        self.once_read(addr, 0, |tx| tx.free(addr)).await
    }
}
