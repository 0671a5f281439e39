//! A stall of the whole process (FaRM §5.1, leases): every lease thread stops at once, as on a
//! virtual machine whose page-fault storms stall every thread, or under SIGSTOP. Nobody's
//! silence is evidence against anybody then: each lease thread credits its own stall to the
//! leases it granted, so nobody is suspected, and a machine that dies afterwards still is.
//! Its own binary: stopping the process stops every test in it.

use std::process::Command;
use std::time::{Duration, Instant};

use farm::{Cluster, MachineId};

const LEASE: Duration = Duration::from_millis(20);

#[test]
fn a_stopped_and_continued_process_suspects_nobody_and_still_detects_a_kill() {
    let c = Cluster::builder()
        .machines(3)
        .workers(1)
        .replicas(3)
        .region_bytes(4 << 20)
        .lease(LEASE)
        .build()
        .unwrap();
    let a = c.txn(MachineId(0), |tx| tx.alloc(&7u64, None)).unwrap();
    // Leases granted and renewed for a while.
    std::thread::sleep(LEASE * 10);
    assert_eq!(c.suspicions(), vec![], "suspicions before the stall");

    // Stop this whole process for ten leases; a child continues it.
    let stop = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "kill -STOP {pid}; sleep 0.2; kill -CONT {pid}",
            pid = std::process::id()
        ))
        .status()
        .expect("run sh");
    assert!(stop.success());
    // Several leases for every lease thread to run again and renew.
    std::thread::sleep(LEASE * 10);
    assert_eq!(
        c.suspicions(),
        vec![],
        "a stall of every machine at once made suspicions"
    );
    assert_eq!(
        c.txn(MachineId(1), |tx| tx.read::<u64>(a)).unwrap(),
        7,
        "the cluster commits after the stall"
    );

    // Detection still works: a machine killed now is suspected.
    c.kill(MachineId(2));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c.suspicions().iter().any(|s| s.suspect == MachineId(2)) {
        assert!(
            Instant::now() < deadline,
            "the killed machine was not suspected: {:?}",
            c.suspicions()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        c.suspicions().iter().all(|s| s.suspect == MachineId(2)),
        "only the killed machine is suspected: {:?}",
        c.suspicions()
    );
}
