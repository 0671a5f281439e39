//! The `shm` fabric across real processes: this test binary runs itself again as machine 1
//! (`child_machine`), reads and writes its memory one-sided, exchanges datagrams with it, kills
//! it with SIGKILL, and restarts it on the same NVRAM directory.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use farm_core::fabric::{Endpoint, Fabric, FabricError, MemKey, WriteStatus, CONTROL_TAG};
use farm_core::nvram::Nvram;
use farm_core::{MachineId, RegionId, ThreadId};
use farm_fabric::auth::Secret;
use farm_fabric::process::{ProcessFabric, StartError};
use farm_fabric::shm::{area_file, machine_dir, ShmFabric, LIVENESS_CHECK};

const CLUSTER: u64 = 0x5eed_c1a5;
const CHILD_ENV: &str = "FARM_SHM_CHILD";
const REGION_BYTES: usize = 64 << 10;
const M0: MachineId = MachineId(0);
const M1: MachineId = MachineId(1);
const M2: MachineId = MachineId(2);

/// The cluster's secret (every machine of a test cluster holds the same).
fn secret() -> Secret {
    Secret::from_bytes(b"the shm test cluster's secret").unwrap()
}

/// Below Linux's ephemeral ports (32768 on) and above ZooKeeper's (21810 on).
fn base_port() -> u16 {
    22_000 + (std::process::id() % 3_000) as u16 * 3
}

/// Machine 1, run by `one_sided_operations_cross_processes_and_fail_once_the_target_dies` as a
/// child process: `FARM_SHM_CHILD=<mode>:<base port>:<dir>`. In mode `first` it creates its
/// region, writes 0xabcd at offset 0, admits machine 0, says `ready` and echoes datagrams
/// until killed (or for 30 s); in mode `again` it maps its region again and prints the word
/// at offset 8.
#[test]
#[ignore = "the child process of the multi-process test"]
fn child_machine() {
    let spec = std::env::var(CHILD_ENV).expect("run by the multi-process test, which sets it");
    let mut parts = spec.splitn(3, ':');
    let (mode, port, dir) = (
        parts.next().unwrap(),
        parts.next().unwrap().parse::<u16>().unwrap(),
        Path::new(parts.next().unwrap()),
    );
    let fabric = ShmFabric::start(dir, CLUSTER, M1, port, secret()).unwrap();
    let region = machine_dir(dir, M1).join("region-0");
    let mem = std::sync::Arc::new(Nvram::file(&region, REGION_BYTES).unwrap());
    fabric.register(M1, MemKey::Region(RegionId(0)), mem.clone());
    if mode == "again" {
        let mut word = [0u8; 8];
        mem.read(8, &mut word);
        println!("saw {}", u64::from_le_bytes(word));
        return;
    }
    mem.write(0, &0xabcdu64.to_le_bytes());
    fabric.admit(M1, &[M0, M1]);
    println!("ready");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut buf = Vec::new();
    while Instant::now() < deadline {
        match fabric.recv_datagram(M1, 0, &mut buf) {
            Some(from) => fabric.send_datagram(M1, from, &buf, 0),
            None => std::thread::sleep(Duration::from_micros(100)),
        }
    }
}

fn spawn_child(mode: &str, dir: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_machine", "--nocapture"])
        .env(
            CHILD_ENV,
            format!("{mode}:{}:{}", base_port(), dir.display()),
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The first line of `child`'s output that starts with `prefix` (the harness prints its own);
/// the child's later output is not read (it runs until killed).
fn line_starting(child: &mut Child, prefix: &str) -> String {
    let out = child.stdout.take().unwrap();
    let line = BufReader::new(out)
        .lines()
        .map(|l| l.unwrap())
        .find(|l| l.starts_with(prefix));
    line.unwrap_or_else(|| panic!("the child ended without printing {prefix:?}"))
}

#[test]
fn one_sided_operations_cross_processes_and_fail_once_the_target_dies() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn_child("first", dir.path());
    line_starting(&mut child, "ready");
    let f0 = ShmFabric::start(dir.path(), CLUSTER, M0, base_port(), secret()).unwrap();
    assert!(
        matches!(
            ShmFabric::start(dir.path(), CLUSTER, M0, base_port(), secret()),
            Err(StartError::AlreadyRunning(M0))
        ),
        "a second process for a running machine must be refused"
    );
    assert!(f0.is_up(M1));
    // The directory is this cluster's: another cluster's machine is refused, naming both ids.
    match ShmFabric::start(dir.path(), CLUSTER + 1, MachineId(3), base_port(), secret()) {
        Err(e @ StartError::OtherCluster { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&format!("{CLUSTER:#x}")), "{msg}");
        }
        other => panic!("another cluster's machine started: {other:?}"),
    }

    // One-sided read and write of the child's memory: its CPU is not involved.
    let region = MemKey::Region(RegionId(0));
    let remote = f0.remote(M0, M1, region).unwrap();
    let mut word = [0u8; 8];
    remote.read(0, &mut word).unwrap();
    assert_eq!(u64::from_le_bytes(word), 0xabcd);
    let ep = Endpoint {
        machine: M0,
        thread: ThreadId(0),
    };
    let t = f0
        .write(ep, M1, region, 8, &0x1234u64.to_le_bytes())
        .unwrap();
    assert_eq!(f0.write_status(ep, M1, t), WriteStatus::Done);
    remote.read(8, &mut word).unwrap();
    assert_eq!(u64::from_le_bytes(word), 0x1234);
    assert!(matches!(
        remote.read(REGION_BYTES as u64 - 4, &mut word),
        Err(FabricError::OutOfBounds { .. })
    ));
    assert!(matches!(
        f0.remote(M0, M1, MemKey::Rings),
        Err(FabricError::NotRegistered { .. })
    ));

    // A machine the child did not admit cannot write to it.
    let f2 = ShmFabric::start(dir.path(), CLUSTER, M2, base_port(), secret()).unwrap();
    let ep2 = Endpoint {
        machine: M2,
        thread: ThreadId(0),
    };
    assert_eq!(
        f2.write(ep2, M1, region, 16, &[7; 8]),
        Err(FabricError::Unreachable(M1))
    );
    remote.read(16, &mut word).unwrap();
    assert_eq!(word, [0; 8], "a write from a machine not admitted landed");
    // Counted per peer: the three reads and the write that landed (not the refused ones).
    let to_1 = f0
        .traffic(M0)
        .into_iter()
        .find(|(m, _)| *m == M1)
        .unwrap()
        .1;
    assert_eq!((to_1.reads, to_1.read_bytes), (3, 24));
    assert_eq!((to_1.writes, to_1.write_bytes), (1, 8));
    assert!(f2.traffic(M2).iter().all(|(_, t)| t.writes == 0));

    // Datagrams: garbage and another cluster's are dropped, the child's echo arrives.
    let raw = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let to_m0 = ("127.0.0.1", base_port());
    raw.send_to(b"not a datagram", to_m0).unwrap();
    let mut foreign = 0xfa53_d6a7u32.to_le_bytes().to_vec();
    foreign.extend_from_slice(&(CLUSTER + 1).to_le_bytes());
    foreign.extend_from_slice(&1u16.to_le_bytes());
    foreign.extend_from_slice(b"foreign");
    raw.send_to(&foreign, to_m0).unwrap();
    f0.send_datagram(M0, M1, b"ping", 0);
    let mut buf = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let from = loop {
        if let Some(from) = f0.recv_datagram(M0, 0, &mut buf) {
            break from;
        }
        assert!(Instant::now() < deadline, "no echo from the child");
        std::thread::sleep(Duration::from_micros(100));
    };
    assert_eq!((from, &buf[..]), (M1, &b"ping"[..]));

    // Control datagrams go to recv_control, lease ones to recv_datagram, whichever reads the
    // socket first (here the lease reader, which passes the control datagram over).
    f0.send_datagram(M0, M0, &[CONTROL_TAG, 1], 0);
    f0.send_datagram(M0, M0, b"lease", 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while f0.recv_datagram(M0, 0, &mut buf).is_none() {
        assert!(
            Instant::now() < deadline,
            "the lease datagram did not arrive"
        );
    }
    assert_eq!(&buf[..], b"lease");
    assert_eq!(f0.recv_control(M0, 0, &mut buf), Some(M0));
    assert_eq!(&buf[..], &[CONTROL_TAG, 1]);
    assert_eq!(f0.recv_control(M0, 0, &mut buf), None);

    // SIGKILL: the kernel drops its lock; operations fail once liveness is rechecked.
    child.kill().unwrap();
    child.wait().unwrap();
    std::thread::sleep(LIVENESS_CHECK * 2);
    assert_eq!(remote.read(0, &mut word), Err(FabricError::Unreachable(M1)));
    assert_eq!(
        f0.write(ep, M1, region, 8, &[1; 8]).map(|_| ()),
        Err(FabricError::Unreachable(M1))
    );
    assert!(!f0.is_up(M1));

    // Its NVRAM survives it: restarted on the same directory, it sees machine 0's write.
    let again = spawn_child("again", dir.path()).wait_with_output().unwrap();
    assert!(again.status.success());
    let out = String::from_utf8(again.stdout).unwrap();
    assert!(
        out.lines().any(|l| l == format!("saw {}", 0x1234)),
        "the restarted machine did not see the write: {out}"
    );
}

#[test]
fn a_batch_of_ring_writes_rings_the_doorbell_once_at_its_flush() {
    let dir = tempfile::tempdir().unwrap();
    // Ports of their own: the multi-process test binds `base_port()` and up.
    let port = 31_000 + (std::process::id() % 500) as u16 * 3;
    let f0 = ShmFabric::start(dir.path(), CLUSTER, M0, port, secret()).unwrap();
    let f1 = ShmFabric::start(dir.path(), CLUSTER, M1, port, secret()).unwrap();
    let rings = std::sync::Arc::new(
        Nvram::file(
            &machine_dir(dir.path(), M1).join(area_file(MemKey::Rings)),
            4096,
        )
        .unwrap(),
    );
    f1.register(M1, MemKey::Rings, rings.clone());
    f1.admit(M1, &[M0, M1]);
    let ep = Endpoint {
        machine: M0,
        thread: ThreadId(0),
    };

    // Without a batch every write rings.
    let seen = f1.writes_seen(ThreadId(0));
    for i in 0..3u64 {
        f0.write(ep, M1, MemKey::Rings, 8 * i, &[1; 8]).unwrap();
    }
    assert_eq!(f1.writes_seen(ThreadId(0)), seen + 3);

    // In a batch the writes land at once (a copy), and the doorbell rings once, at the flush.
    let batch = farm_core::fabric::Batch::open();
    for i in 0..5u64 {
        f0.write(ep, M1, MemKey::Rings, 8 * i, &(i + 10).to_le_bytes())
            .unwrap();
    }
    assert_eq!(
        f1.writes_seen(ThreadId(0)),
        seen + 3,
        "a held doorbell rang"
    );
    let mut word = [0u8; 8];
    rings.read(32, &mut word);
    assert_eq!(u64::from_le_bytes(word), 14);
    farm_core::fabric::flush();
    assert_eq!(f1.writes_seen(ThreadId(0)), seen + 4);
    farm_core::fabric::flush();
    assert_eq!(
        f1.writes_seen(ThreadId(0)),
        seen + 4,
        "a flush with nothing held rang"
    );
    f0.write(ep, M1, MemKey::Rings, 0, &[2; 8]).unwrap();
    drop(batch);
    assert_eq!(
        f1.writes_seen(ThreadId(0)),
        seen + 5,
        "the batch's end did not flush"
    );

    // Each thread's rings have a doorbell slot of their own: a write from thread 1 (into the
    // rings worker 1 reads) rings slot 1 only.
    let seen1 = f1.writes_seen(ThreadId(1));
    let ep1 = Endpoint {
        machine: M0,
        thread: ThreadId(1),
    };
    f0.write(ep1, M1, MemKey::Rings, 64, &[3; 8]).unwrap();
    assert_eq!(f1.writes_seen(ThreadId(1)), seen1 + 1);
    assert_eq!(f1.writes_seen(ThreadId(0)), seen + 5);
    // An executor that stops polling a worker wakes its poller.
    f1.polled(ThreadId(1), true);
    f1.polled(ThreadId(1), false);
    assert_eq!(f1.writes_seen(ThreadId(1)), seen1 + 2);
}
