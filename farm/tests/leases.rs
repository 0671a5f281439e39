//! Failure detection with leases on the threaded runtime (FaRM §5.1): lease threads over fabric
//! datagrams, a killed machine suspected by its lease peers, and no suspicion while everyone
//! is alive. Exact bounds in ticks are checked deterministically in farm-cm/tests/leases.rs;
//! here the delays are printed, not asserted against the clock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use farm::{Cluster, MachineId, Suspicion};

const LEASE: Duration = Duration::from_millis(50);

fn cluster() -> Arc<Cluster> {
    Arc::new(
        Cluster::builder()
            .machines(4)
            .workers(2)
            .replicas(3)
            .region_bytes(4 << 20)
            .lease(LEASE)
            .build()
            .unwrap(),
    )
}

/// Runs transfers among machines 0 and 1 for `d`, then stops.
fn workload(c: &Arc<Cluster>, d: Duration) -> u64 {
    let a = c.txn(MachineId(0), |tx| tx.alloc(&1_000u64, None)).unwrap();
    let b = c.txn(MachineId(1), |tx| tx.alloc(&1_000u64, None)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let t = {
        let (c, stop) = (c.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                c.txn(MachineId((n % 2) as u16), |tx| {
                    let x: u64 = tx.read(a)?;
                    let y: u64 = tx.read(b)?;
                    tx.write(a, &(x - 1))?;
                    tx.write(b, &(y + 1))
                })
                .unwrap();
                n += 1;
            }
            n
        })
    };
    std::thread::sleep(d);
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap()
}

fn wait_for(c: &Cluster, what: impl Fn(&[Suspicion]) -> bool) -> Vec<Suspicion> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = c.suspicions();
        if what(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "not suspected within 20 s: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_killed_member_is_suspected_by_the_cm_and_nobody_else() {
    let c = cluster();
    let done = workload(&c, Duration::from_millis(400));
    assert!(done > 0);
    assert_eq!(
        c.suspicions(),
        vec![],
        "no suspicion while every machine is alive"
    );
    let killed_at = c.now_us();
    c.kill(MachineId(3));
    let s = wait_for(&c, |s| !s.is_empty());
    let Suspicion {
        observer,
        suspect,
        at_us,
    } = s[0];
    assert_eq!((observer, suspect), (MachineId(0), MachineId(3)), "{s:?}");
    assert!(at_us > killed_at, "suspected before the kill: {s:?}");
    println!(
        "machine 3 suspected {} us after the kill (lease {} us)",
        at_us - killed_at,
        LEASE.as_micros()
    );
    std::thread::sleep(LEASE * 2);
    assert_eq!(
        c.suspicions().len(),
        1,
        "only the CM holds a lease at machine 3: {:?}",
        c.suspicions()
    );
}

/// Members suspect a killed CM. (The first suspicion starts reconfiguration through a backup
/// CM, after which the other members hold leases with the new CM instead, so not every member
/// necessarily gets to suspect the old one.)
#[test]
fn a_killed_cm_is_suspected_by_members() {
    let c = cluster();
    workload(&c, Duration::from_millis(200));
    assert_eq!(c.suspicions(), vec![]);
    let killed_at = c.now_us();
    c.kill(MachineId(0));
    let s = wait_for(&c, |s| !s.is_empty());
    for x in &s {
        assert_eq!(x.suspect, MachineId(0), "{s:?}");
        assert_ne!(x.observer, MachineId(0));
        assert!(x.at_us > killed_at);
    }
    println!(
        "CM first suspected {} us after the kill (lease {} us)",
        s[0].at_us - killed_at,
        LEASE.as_micros()
    );
}

/// The lease can be shortened while the cluster runs (benchmarks populate with long leases and
/// measure with short ones): renewals go on under the new length without a false suspicion, and
/// a killed member is still detected.
#[test]
fn a_lease_shortened_at_run_time_keeps_everyone_and_still_detects_a_kill() {
    let c = Arc::new(
        Cluster::builder()
            .machines(4)
            .workers(2)
            .replicas(3)
            .region_bytes(4 << 20)
            .lease(Duration::from_millis(200))
            .build()
            .unwrap(),
    );
    assert!(workload(&c, Duration::from_millis(100)) > 0);
    c.set_lease(LEASE);
    assert_eq!(c.lease(), LEASE);
    assert!(workload(&c, Duration::from_millis(400)) > 0);
    assert_eq!(c.suspicions(), vec![], "no suspicion across the change");
    let killed_at = c.now_us();
    c.kill(MachineId(3));
    let s = wait_for(&c, |s| !s.is_empty());
    assert_eq!(
        (s[0].observer, s[0].suspect),
        (MachineId(0), MachineId(3)),
        "{s:?}"
    );
    println!(
        "machine 3 suspected {} us after the kill (lease now {} us)",
        s[0].at_us - killed_at,
        LEASE.as_micros()
    );
}
