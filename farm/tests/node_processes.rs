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
use farm::{Addr, MachineId, RegionId};

const CHILD_ENV: &str = "FARM_NODE_CHILD";
const CLUSTER: u64 = 0xc1a5_7e11;
const MACHINES: u16 = 3;
const LEASE: Duration = Duration::from_millis(20);

/// Datagram ports of a test's machines (each test its own range: tests run in parallel).
fn base_port(test: u16) -> u16 {
    20_000 + (std::process::id() % 4_000) as u16 * 8 + test * 4
}

fn node_config(machine: u16, port: u16, dir: &Path) -> NodeConfig {
    NodeConfig {
        dir: dir.to_path_buf(),
        cluster: CLUSTER,
        machine: MachineId(machine),
        machines: MACHINES,
        workers: 2,
        base_port: port,
        lease: LEASE,
        start_timeout: Duration::from_secs(30),
        regions_per_machine: 1,
        replicas: 3,
        region_bytes: 4 << 20,
    }
}

/// Accounts each machine opens in the bank test, and their opening balance.
const ACCOUNTS: u64 = 4;
const BALANCE: u64 = 100;
const TRANSFERS: u64 = 300;

/// One machine, run by the tests below as a child process:
/// `FARM_NODE_CHILD=<mode>:<machine>:<base port>:<dir>`. Prints `up`; in mode `bank`, opens
/// its accounts (`accounts <region>:<offset> ...`), waits for the file `<dir>/accounts` naming
/// every machine's, makes transfers among all of them and prints `sum <total>` read in one
/// transaction afterwards, with how many accounts differ from their opening balance. Then
/// prints `suspect <m> by <o>` for each suspicion, for at most
/// 60 s.
#[test]
#[ignore = "a child process of the multi-process tests"]
fn node_child() {
    let spec = std::env::var(CHILD_ENV).expect("run by the multi-process test, which sets it");
    let mut parts = spec.splitn(4, ':');
    let (mode, machine, port, dir) = (
        parts.next().unwrap().to_string(),
        parts.next().unwrap().parse::<u16>().unwrap(),
        parts.next().unwrap().parse::<u16>().unwrap(),
        Path::new(parts.next().unwrap()),
    );
    let node = Node::start(&node_config(machine, port, dir)).unwrap();
    println!("up");
    if mode == "bank" {
        bank(&node, dir);
    }
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

fn bank(node: &Node, dir: &Path) {
    let mine: Vec<Addr> = (0..ACCOUNTS)
        .map(|_| node.txn(|tx| tx.alloc(&BALANCE, None)).unwrap())
        .collect();
    let named: Vec<String> = mine
        .iter()
        .map(|a| format!("{}:{}", a.region.0, a.offset))
        .collect();
    println!("accounts {}", named.join(" "));
    let file = dir.join("accounts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !file.exists() {
        assert!(Instant::now() < deadline, "no accounts file");
        std::thread::sleep(Duration::from_millis(1));
    }
    let all: Vec<Addr> = std::fs::read_to_string(&file)
        .unwrap()
        .split_whitespace()
        .map(|a| {
            let (r, o) = a.split_once(':').unwrap();
            Addr::new(RegionId(r.parse().unwrap()), o.parse().unwrap())
        })
        .collect();
    let mut x = node.id().0 as u64 * 7919 + 1;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let n = all.len() as u64;
    for _ in 0..TRANSFERS {
        let (from, to, amount) = (all[next(n) as usize], all[next(n) as usize], 1 + next(10));
        if from == to {
            continue;
        }
        node.txn(|tx| {
            let a: u64 = tx.read(from)?;
            let b: u64 = tx.read(to)?;
            if a >= amount {
                tx.write(from, &(a - amount))?;
                tx.write(to, &(b + amount))?;
            }
            Ok(())
        })
        .unwrap();
    }
    let balances: Vec<u64> = node
        .txn(|tx| all.iter().map(|a| tx.read::<u64>(*a)).collect())
        .unwrap();
    println!(
        "sum {} moved {}",
        balances.iter().sum::<u64>(),
        balances.iter().filter(|b| **b != BALANCE).count()
    );
}

struct Machines {
    children: Vec<Child>,
    lines: Receiver<(u16, String)>,
}

impl Machines {
    fn start(mode: &str, test: u16, dir: &Path) -> Self {
        let (tx, lines) = channel();
        let children = (0..MACHINES)
            .map(|m| {
                let mut child = Command::new(std::env::current_exe().unwrap())
                    .args(["--ignored", "--exact", "node_child", "--nocapture"])
                    .env(
                        CHILD_ENV,
                        format!("{mode}:{m}:{}:{}", base_port(test), dir.display()),
                    )
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
    let machines = Machines::start("leases", 0, dir.path());
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

/// Transactions across processes (§4): every machine process opens accounts in its own
/// regions, then transfers among all of them, reading remote accounts one-sided and committing
/// through the peers' logs; the snapshot each machine reads in one transaction at its end
/// holds the total, and shows balances moved.
#[test]
fn transfers_between_processes_keep_the_total() {
    let dir = tempfile::tempdir().unwrap();
    let machines = Machines::start("bank", 1, dir.path());
    let mut accounts = std::collections::BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while accounts.len() < MACHINES as usize {
        let left = deadline.saturating_duration_since(Instant::now());
        match machines.lines.recv_timeout(left) {
            Ok((m, line)) => {
                if let Some(list) = line.strip_prefix("accounts ") {
                    accounts.insert(m, list.to_string());
                }
            }
            Err(e) => panic!("accounts of {accounts:?} only: {e}"),
        }
    }
    let all: Vec<&str> = accounts.values().map(String::as_str).collect();
    let tmp = dir.path().join("accounts.tmp");
    std::fs::write(&tmp, all.join(" ")).unwrap();
    std::fs::rename(&tmp, dir.path().join("accounts")).unwrap();
    let mut sums = std::collections::BTreeMap::new();
    while sums.len() < MACHINES as usize {
        let left = deadline.saturating_duration_since(Instant::now());
        match machines.lines.recv_timeout(left) {
            Ok((m, line)) => {
                assert!(!line.starts_with("suspect"), "machine {m}: {line}");
                if let Some(rest) = line.strip_prefix("sum ") {
                    let (sum, moved) = rest.split_once(" moved ").unwrap();
                    let moved: usize = moved.parse().unwrap();
                    sums.insert(m, sum.parse::<u64>().unwrap());
                    assert!(moved > 0, "machine {m}: no account changed: {line}");
                }
            }
            Err(e) => panic!("sums of {sums:?} only: {e}"),
        }
    }
    let total = MACHINES as u64 * ACCOUNTS * BALANCE;
    assert!(
        sums.values().all(|s| *s == total),
        "sums {sums:?}, expected {total} everywhere"
    );
}
