//! Machines as separate processes (farm::node over the `shm` fabric): this test binary runs
//! itself three times as machines 0 (the CM), 1 and 2, each printing the suspicions of its
//! lease thread (FaRM §5.1). Nobody is suspected while all run; a member stopped with SIGSTOP
//! for ten leases is suspected by the CM, which ignores it from then on, and, continued, finds
//! its renewals unanswered and suspects the CM; a member killed with SIGKILL is suspected by
//! the CM.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use farm::node::{Node, NodeConfig};
use farm::MachineId;

const CHILD_ENV: &str = "FARM_NODE_CHILD";
const CLUSTER: u64 = 0xc1a5_7e11;
const MACHINES: u16 = 3;
const LEASE: Duration = Duration::from_millis(20);

fn base_port() -> u16 {
    20_000 + (std::process::id() % 9_000) as u16
}

fn node_config(machine: u16, port: u16, dir: &Path) -> NodeConfig {
    NodeConfig {
        dir: dir.to_path_buf(),
        cluster: CLUSTER,
        machine: MachineId(machine),
        machines: MACHINES,
        workers: 1,
        base_port: port,
        lease: LEASE,
    }
}

/// One machine, run by `lease_failures_are_detected_across_processes` as a child process:
/// `FARM_NODE_CHILD=<machine>:<base port>:<dir>`. Prints `up`, then `suspect <m> by <o>` for
/// each suspicion, for at most 60 s.
#[test]
#[ignore = "a child process of the multi-process test"]
fn node_child() {
    let spec = std::env::var(CHILD_ENV).expect("run by the multi-process test, which sets it");
    let mut parts = spec.splitn(3, ':');
    let (machine, port, dir) = (
        parts.next().unwrap().parse::<u16>().unwrap(),
        parts.next().unwrap().parse::<u16>().unwrap(),
        Path::new(parts.next().unwrap()),
    );
    let node = Node::start(&node_config(machine, port, dir)).unwrap();
    println!("up");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = 0;
    while Instant::now() < deadline {
        let s = node.suspicions();
        for x in &s[seen..] {
            println!("suspect {} by {}", x.suspect.0, x.observer.0);
        }
        seen = s.len();
        std::thread::sleep(Duration::from_millis(1));
    }
}

struct Machines {
    children: Vec<Child>,
    lines: Receiver<(u16, String)>,
}

impl Machines {
    fn start(dir: &Path) -> Self {
        let (tx, lines) = channel();
        let children = (0..MACHINES)
            .map(|m| {
                let mut child = Command::new(std::env::current_exe().unwrap())
                    .args(["--ignored", "--exact", "node_child", "--nocapture"])
                    .env(CHILD_ENV, format!("{m}:{}:{}", base_port(), dir.display()))
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap();
                let out = BufReader::new(child.stdout.take().unwrap());
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for line in out.lines().map_while(Result::ok) {
                        let _ = tx.send((m, line));
                    }
                });
                child
            })
            .collect();
        Self { children, lines }
    }

    /// Waits up to `within` for a line `what` from machine `from`, failing on any other
    /// suspicion; returns whether it came.
    fn expect(&self, from: u16, what: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((m, line)) if m == from && line == what => return true,
                Ok((m, line)) => assert!(
                    !line.starts_with("suspect"),
                    "machine {m}: unexpected {line:?} while waiting for {what:?} from {from}"
                ),
                Err(RecvTimeoutError::Timeout) => return false,
                Err(RecvTimeoutError::Disconnected) => panic!("every machine ended"),
            }
        }
    }

    fn signal(&self, m: u16, signal: libc::c_int) {
        let pid = self.children[m as usize].id() as libc::pid_t;
        // SAFETY: kill(2) with the pid of a child this test spawned and has not reaped.
        let sent = unsafe { libc::kill(pid, signal) };
        assert_eq!(sent, 0, "kill({pid}, {signal})");
    }
}

impl Drop for Machines {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn lease_failures_are_detected_across_processes() {
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start(dir.path());
    let mut up = std::collections::BTreeSet::new();
    while up.len() < MACHINES as usize {
        match machines.lines.recv_timeout(Duration::from_secs(30)) {
            Ok((m, line)) if line == "up" => {
                up.insert(m);
            }
            Ok(_) => {}
            Err(e) => panic!("machines {up:?} of {MACHINES} started: {e}"),
        }
    }
    // Ten leases with everyone running: no suspicion (`expect` fails on any).
    assert!(!machines.expect(0, "never", LEASE * 10));

    // SIGSTOP machine 2 for ten leases: the CM suspects it and from then on ignores its
    // renewals (reconfiguration would remove it), so once continued it finds its CM silent and
    // suspects it in turn, rather than going on as a member.
    machines.signal(2, libc::SIGSTOP);
    assert!(
        machines.expect(0, "suspect 2 by 0", Duration::from_secs(20)),
        "the CM did not suspect a stopped member"
    );
    std::thread::sleep(LEASE * 10);
    machines.signal(2, libc::SIGCONT);
    assert!(
        machines.expect(2, "suspect 0 by 2", Duration::from_secs(20)),
        "a continued member whose renewals go unanswered kept its CM"
    );

    // SIGKILL machine 1: the CM suspects it.
    machines.signal(1, libc::SIGKILL);
    assert!(
        machines.expect(0, "suspect 1 by 0", Duration::from_secs(20)),
        "the CM did not suspect a killed member"
    );
}
