//! The lease manager thread of one machine (FaRM §5.1): a dedicated OS thread, not pinned, at
//! real-time priority where the OS allows it (else a raised nice level), that runs the machine's side of the lease protocol
//! over fabric datagrams and reports suspicions. Its buffers are allocated before it starts;
//! the loop itself does not allocate (the `mem` fabric copies a datagram into its queue, as a
//! NIC would into its own memory).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use farm_cm::LeaseConfig;
use farm_core::fabric::Fabric;
use farm_core::MachineId;
use farm_txn::lease::MachineLease;
use farm_txn::MachineState;

/// A machine suspected by another one because a lease ran out.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Suspicion {
    /// Who noticed.
    pub observer: MachineId,
    /// Who is suspected.
    pub suspect: MachineId,
    /// When, in microseconds since the cluster started.
    pub at_us: u64,
}

/// The lease length in force, which [`crate::Cluster::set_lease`] may change while the
/// cluster runs, and the longest ever in force (a lease granted under it may still be held).
#[derive(Debug)]
pub(crate) struct LeaseLength {
    current_us: AtomicU64,
    longest_us: AtomicU64,
}

impl LeaseLength {
    pub(crate) fn new(lease: Duration) -> Self {
        let us = lease.as_micros() as u64;
        Self {
            current_us: AtomicU64::new(us),
            longest_us: AtomicU64::new(us),
        }
    }

    pub(crate) fn set(&self, lease: Duration) {
        let us = lease.as_micros() as u64;
        self.current_us.store(us, Ordering::Relaxed);
        self.longest_us.fetch_max(us, Ordering::Relaxed);
    }

    pub(crate) fn current(&self) -> Duration {
        Duration::from_micros(self.current_us.load(Ordering::Relaxed))
    }

    pub(crate) fn longest(&self) -> Duration {
        Duration::from_micros(self.longest_us.load(Ordering::Relaxed))
    }
}

/// How long a lease thread sleeps between rounds: often enough to renew on time and to notice
/// expiry promptly.
fn round_sleep(timing: LeaseConfig) -> Duration {
    Duration::from_micros((timing.renew_ticks / 4).max(50))
}

/// Suspicions recorded at most (the lease protocol reports each suspect once per machine).
const SUSPICIONS_MAX: usize = 1024;

#[derive(Debug)]
pub(crate) struct LeaseThreads {
    handles: Vec<JoinHandle<()>>,
}

impl LeaseThreads {
    /// Starts one lease thread per machine, with leases of `lease` (ticks are µs). Each follows
    /// its machine's configuration: a new configuration (NEW-CONFIG) carries the leases over
    /// if its CM is the same and starts fresh ones with a new CM, and a machine outside the
    /// configuration holds none. The first leases allow `start_grace` more for the first
    /// request and answer: machines that are separate processes start their lease threads
    /// only roughly together (see `farm::node`); suspecting later is always safe.
    pub(crate) fn start(
        machines: &[Arc<MachineState>],
        length: Arc<LeaseLength>,
        fabric: Arc<dyn Fabric>,
        epoch: Instant,
        start_grace: Duration,
        stop: Arc<AtomicBool>,
        suspicions: Arc<Mutex<Vec<Suspicion>>>,
    ) -> Self {
        let handles = machines
            .iter()
            .map(|machine| {
                let machine = machine.clone();
                let (fabric, stop, suspicions) = (fabric.clone(), stop.clone(), suspicions.clone());
                let length = length.clone();
                std::thread::Builder::new()
                    .name(format!("farm-lease-m{}", machine.id.0))
                    .spawn(move || {
                        run(
                            &machine,
                            &length,
                            &*fabric,
                            epoch,
                            start_grace,
                            &stop,
                            &suspicions,
                        )
                    })
                    .expect("spawn lease thread")
            })
            .collect();
        Self { handles }
    }

    pub(crate) fn join(&mut self) {
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// Real-time priority of lease threads: the lowest real-time level, above every normal thread
/// (FaRM runs its lease manager at the highest user-space priority, §5.1). The thread sleeps
/// between rounds, so it cannot starve the machine.
const LEASE_RT_PRIORITY: i32 = 1;

fn raise_priority() {
    static WARN: Once = Once::new();
    let param = libc::sched_param {
        sched_priority: LEASE_RT_PRIORITY,
    };
    // SAFETY: sched_setscheduler reads the parameter struct we pass by reference for the
    // duration of the call; pid 0 names the calling thread on Linux.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } == 0 {
        return;
    }
    // SAFETY: setpriority only reads its integer arguments; `0` names the calling thread on
    // Linux (thread ids are process ids for PRIO_PROCESS).
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -10) };
    if rc != 0 {
        WARN.call_once(|| {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "cannot raise the lease threads' priority; leases run at normal priority"
            )
        });
    }
}

fn run(
    machine: &Arc<MachineState>,
    length: &LeaseLength,
    fabric: &dyn Fabric,
    epoch: Instant,
    start_grace: Duration,
    stop: &AtomicBool,
    suspicions: &Mutex<Vec<Suspicion>>,
) {
    raise_priority();
    let mut lease = length.current();
    let mut timing = LeaseConfig::new(lease.as_micros() as u64);
    let mut sleep = round_sleep(timing);
    let me = machine.id;
    let mut suspects: Vec<MachineId> = Vec::with_capacity(256);
    let mut manager = MachineLease::new(
        machine.clone(),
        timing,
        sleep.as_micros() as u64,
        epoch.elapsed().as_micros() as u64,
    );
    manager.grace(start_grace.as_micros() as u64);
    while !stop.load(Ordering::Relaxed) {
        // A killed machine's lease manager dies with it.
        if fabric.is_up(me) {
            if length.current() != lease {
                lease = length.current();
                timing = LeaseConfig::new(lease.as_micros() as u64);
                sleep = round_sleep(timing);
                manager.set_timing(timing, sleep.as_micros() as u64);
            }
            // On this VM two threads faulting in fresh memory stall every thread, real-time
            // ones included, for 10-40 ms (docs/ARCHITECTURE.md, "Leases"): the round credits
            // such a stall to the leases this machine granted.
            let now = epoch.elapsed().as_micros() as u64;
            manager.round(now, &mut suspects);
            if !suspects.is_empty() {
                let mut s = suspicions.lock().expect("suspicions poisoned");
                for suspect in suspects.drain(..) {
                    tracing::warn!(
                        observer = me.0,
                        suspect = suspect.0,
                        at_us = now,
                        "lease expired: suspect"
                    );
                    if s.len() < SUSPICIONS_MAX {
                        s.push(Suspicion {
                            observer: me,
                            suspect,
                            at_us: now,
                        });
                    }
                }
            }
        } else {
            manager.down();
        }
        std::thread::sleep(sleep);
    }
}
