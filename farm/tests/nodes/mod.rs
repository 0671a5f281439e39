//! Machines as separate processes for the multi-process tests (farm::node over the `shm`
//! fabric, or the `tcp` fabric with a directory per machine as on separate hosts, on loopback
//! or in network namespaces; see [`Net`]): a test binary runs itself again as each machine
//! (`child_main`, behind an ignored `node_child` test), and `Machines` starts them, reads what
//! they print and signals them.
#![allow(dead_code)] // Each test binary uses part of it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use farm::node::{Node, NodeConfig, Transport};
use farm::{Addr, MachineId, RegionId};
use farm_core::nvram::Nvram;

pub const CHILD_ENV: &str = "FARM_NODE_CHILD";
pub const CLUSTER: u64 = 0xc1a5_7e11;
/// Machines of a test's cluster, unless it starts another number ([`Machines::start_n`]).
pub const MACHINES: u16 = 3;

/// In a child's environment: how many machines the cluster has (default [`MACHINES`]).
pub const MACHINES_ENV: &str = "FARM_NODE_MACHINES";

/// How many machines the cluster of this child process has.
fn machines_of_child() -> u16 {
    std::env::var(MACHINES_ENV).map_or(MACHINES, |n| n.parse().unwrap())
}
/// Lease length of the lease test; the kill test's is [`KILL_LEASE`], and the transfer test,
/// which is not about leases, uses long ones so that a loaded machine suspects nobody.
pub const LEASE: Duration = Duration::from_millis(20);
pub const KILL_LEASE: Duration = Duration::from_millis(50);
pub const REGION_BYTES: usize = 4 << 20;
const BANK_LEASE: Duration = Duration::from_millis(500);

/// Ports of a test's machines (each test its own range: tests run in parallel), UDP and, over
/// tcp, TCP listeners: between ZooKeeper's (21810 on) and Linux's ephemeral ports (32768 on),
/// which outgoing connections hold and a listener cannot share.
pub fn base_port(test: u16) -> u16 {
    assert!(test < 8, "a test's ports past its binary's range");
    22_000 + (std::process::id() % 330) as u16 * 32 + test * 4
}

/// Set (to anything) in a child's environment: its machine runs over the `tcp` fabric.
pub const TCP_ENV: &str = "FARM_NODE_TCP";

/// In a child's environment: the machines' IP addresses, comma-separated, machine 0 first
/// (the `tcp` fabric across network namespaces); without it, all are 127.0.0.1.
pub const HOSTS_ENV: &str = "FARM_NODE_HOSTS";

/// How long a `tcp` operation waits for its answer in these tests.
pub const TCP_TIMEOUT: Duration = Duration::from_millis(200);

/// Where machine `m` keeps its NVRAM: the test's directory (`shm`), or a directory of its own
/// under it (`tcp`: nothing shared, as on separate hosts).
pub fn nvram_dir(dir: &Path, m: u16, tcp: bool) -> PathBuf {
    if tcp {
        dir.join(format!("host{m}"))
    } else {
        dir.to_path_buf()
    }
}

pub fn node_config(mode: &str, machine: u16, port: u16, dir: &Path) -> NodeConfig {
    let tcp = std::env::var_os(TCP_ENV).is_some();
    let machines = machines_of_child();
    NodeConfig {
        dir: nvram_dir(dir, machine, tcp),
        transport: if tcp {
            let ips: Vec<std::net::IpAddr> = match std::env::var(HOSTS_ENV) {
                Ok(list) => list.split(',').map(|ip| ip.parse().unwrap()).collect(),
                Err(_) => vec![[127, 0, 0, 1].into(); machines as usize],
            };
            Transport::Tcp {
                addrs: (0..machines)
                    .map(|m| std::net::SocketAddr::new(ips[m as usize], port + m))
                    .collect(),
                timeout: TCP_TIMEOUT,
            }
        } else {
            Transport::Shm
        },
        cluster: CLUSTER,
        machine: MachineId(machine),
        machines,
        workers: 2,
        base_port: port,
        lease: match mode {
            "bank" | "allocate" | "grow" => BANK_LEASE,
            "kill" | "append" | "stale" | "run" | "restarted" | "rejoin" | "failover" => KILL_LEASE,
            _ => LEASE,
        },
        start_timeout: Duration::from_secs(30),
        regions_per_machine: 1,
        // The failure tests re-replicate onto the third machine (§5.4).
        // With three replicas on three machines, a machine that rejoins gets a replica of
        // every region, copied from the primaries (§5.4).
        replicas: if matches!(mode, "kill" | "append" | "stale" | "run" | "restarted") {
            2
        } else {
            3
        },
        region_bytes: REGION_BYTES,
        zookeeper: std::env::var(ZK_ENV).ok().map(|z| {
            let (connect, root) = z.split_once('|').unwrap();
            (connect.to_string(), root.to_string())
        }),
        restart: mode == "restarted",
        restart_without_after: None,
        join: false,
        secret: secret(),
    }
}

/// The test clusters' shared secret (a deployment reads its own from a file, `Secret::load`).
pub fn secret() -> farm::node::Secret {
    farm::node::Secret::from_bytes(b"the multi-process tests' cluster secret").unwrap()
}

/// The ZooKeeper ensemble and znode of the kill test's machines: `<connect>|<root>`.
pub const ZK_ENV: &str = "FARM_NODE_ZK";

/// Accounts each machine opens in the bank test, and their opening balance.
pub const ACCOUNTS: u64 = 4;
pub const BALANCE: u64 = 100;
pub const TRANSFERS: u64 = 300;

/// One machine, run by the tests below as a child process:
/// `FARM_NODE_CHILD=<mode>:<machine>:<base port>:<dir>`. Prints `up`; in mode `bank`, opens
/// its accounts (`accounts <region>:<offset> ...`), waits for the file `<dir>/accounts` naming
/// every machine's, makes transfers among all of them and prints `sum <total>` read in one
/// transaction afterwards, with how many accounts differ from their opening balance. Then
/// prints `suspect <m> by <o>` for each suspicion, for at most
/// 60 s.
pub fn child_main() {
    let spec = std::env::var(CHILD_ENV).expect("run by the multi-process test, which sets it");
    let mut parts = spec.splitn(4, ':');
    let (mode, machine, port, dir) = (
        parts.next().unwrap().to_string(),
        parts.next().unwrap().parse::<u16>().unwrap(),
        parts.next().unwrap().parse::<u16>().unwrap(),
        Path::new(parts.next().unwrap()),
    );
    if std::env::var_os("FARM_NODE_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .try_init();
    }
    let node = match Node::start(&node_config(&mode, machine, port, dir)) {
        Ok(node) => node,
        // A restarted machine that the restart leaves out says why and stops.
        Err(e) if mode == "restarted" => return println!("refused {e}"),
        Err(e) => panic!("machine {machine}: {e}"),
    };
    println!("up");
    if mode == "rejoin" {
        return rejoin_until_stopped(node, &node_config(&mode, machine, port, dir), dir);
    }
    match mode.as_str() {
        "bank" => bank(&node, dir),
        "kill" | "failover" => bank_until_stopped(&node, dir),
        "append" => append_until_stopped(&node, dir, 2),
        "stale" => append_until_stopped(&node, dir, 3),
        "run" => run_until_killed(&node, dir),
        "restarted" => restarted(&node, dir),
        "allocate" => allocate(&node),
        "grow" => grow(&node),
        "pipeline-alloc" => allocate_in_pipeline(&node, dir),
        "pipeline-local" => local_in_pipeline(&node, dir),
        _ => {}
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
    let all = open_accounts(node, dir);
    let mut next = rng(node);
    let n = all.len() as u64;
    for _ in 0..TRANSFERS {
        let (from, to, amount) = (all[next(n) as usize], all[next(n) as usize], 1 + next(10));
        transfer(node, from, to, amount).unwrap();
    }
    print_sum(node, &all);
}

/// Transfers until the file `<dir>/stop` appears, printing errors; then quiesces and prints
/// how many committed, where every region lives (`placement <region> <primary> <backups>`),
/// the configuration and its members, and the sum. A machine that learns it was removed says
/// `evicted` and stops.
fn bank_until_stopped(node: &Node, dir: &Path) {
    let all = open_accounts(node, dir);
    let mut next = rng(node);
    let n = all.len() as u64;
    let stop = dir.join("stop");
    let mut done = 0u64;
    while !stop.exists() {
        if node.is_evicted() {
            println!("evicted after {done} transfers");
            return;
        }
        let (from, to, amount) = (all[next(n) as usize], all[next(n) as usize], 1 + next(10));
        match transfer(node, from, to, amount) {
            Ok(()) => done += 1,
            Err(e) => println!("error {e}"),
        }
    }
    wait_until_removed(node, &stop);
    quiesce_and_report(node, &all, done, dir);
}

/// Region allocation across processes (§3): machine 2 asks its CM for a region and prints
/// `allocated <region>`; every machine waits until its view maps one more region than it
/// started with and prints `regions <count> config <id>`; the new region's primary allocates an
/// object in it, reads it back and prints `object <region> <value>`.
fn allocate(node: &Node) {
    let before = node.view().map.iter().count();
    if node.id().0 == 2 {
        let r = node.allocate_region(None).unwrap();
        println!("allocated {}", r.0);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while node.view().map.iter().count() == before {
        assert!(
            Instant::now() < deadline,
            "machine {}: no new region",
            node.id()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let view = node.view();
    println!(
        "regions {} config {}",
        view.map.iter().count(),
        view.config.id.0
    );
    let (r, _) = view.map.iter().last().unwrap();
    if view.map.get(r).unwrap().primary == node.id() {
        let a = node
            .txn(|tx| tx.alloc(&4242u64, Some(Addr::new(r, 0))))
            .unwrap();
        let v: u64 = node.txn(|tx| tx.read(a)).unwrap();
        println!("object {} {v}", a.region.0);
    }
}

/// A machine whose regions are full gets another from its CM (§3), across processes: machine
/// 2 allocates 1 KiB objects, forty to a transaction, each holding its number, until it is
/// primary of more regions than it started with (a region of 4 MiB holds three blocks of 1
/// MiB, shared out among the threads), reads every hundredth back and prints `grown <regions>
/// <objects>`.
fn grow(node: &Node) {
    let me = node.id();
    if me.0 != 2 {
        return;
    }
    let regions = || node.view().map.primary_of(me).count();
    let first = regions();
    let mut addrs = Vec::new();
    while regions() == first {
        let from = addrs.len() as u64;
        addrs.extend(
            node.txn(|tx| {
                (from..from + 40)
                    .map(|i| tx.alloc(&[i; 128], None))
                    .collect::<Result<Vec<_>, _>>()
            })
            .unwrap(),
        );
    }
    for (i, a) in addrs.iter().enumerate().step_by(100) {
        let v: [u64; 128] = node.txn(|tx| tx.read(*a)).unwrap();
        assert_eq!(v, [i as u64; 128], "object {i} at {a:?}");
    }
    println!("grown {} {}", regions(), addrs.len());
}

/// Objects each machine's pipeline allocates in `pipeline-alloc` mode.
pub const PIPELINE_ALLOCS: usize = 20;

/// Runs a pipeline of two tasks whose transactions each allocate an object next to another
/// machine's account (at a remote primary: an ALLOC message and its reply, waited for inside
/// the transaction's step) and prints `allocated <count> remote <at another primary>` once all
/// committed.
fn allocate_in_pipeline(node: &Node, dir: &Path) {
    let all = open_accounts(node, dir);
    let me = node.id();
    let view = node.view();
    let remote: Vec<Addr> = (all.iter().copied())
        .filter(|a| view.map.get(a.region).is_some_and(|p| p.primary != me))
        .collect();
    assert!(!remote.is_empty(), "no account at another primary");
    let made = std::cell::RefCell::new(Vec::new());
    node.pipeline(2, async |p, k| {
        for i in (k..PIPELINE_ALLOCS).step_by(2) {
            let near = remote[i % remote.len()];
            let at = p
                .txn(me, async |tx| {
                    farm::Transaction::alloc(tx, &(i as u64), Some(near))
                })
                .await
                .unwrap_or_else(|e| panic!("machine {me}: allocation {i}: {e}"));
            made.borrow_mut().push(at);
        }
    });
    let made = made.into_inner();
    let view = node.view();
    let remote = (made.iter())
        .filter(|a| view.map.get(a.region).is_some_and(|p| p.primary != me))
        .count();
    println!("allocated {} remote {remote}", made.len());
}

/// Transactions each machine runs in `pipeline-local` before it says it is done.
pub const LOCAL_TXNS: u64 = 20_000;

/// Runs transactions that each increment an account this machine is primary of, on a
/// pipeline of two tasks (one account each, so they never conflict), until every machine ran
/// [`LOCAL_TXNS`] of them (the files `<dir>/local-done-<m>`); then prints `local <n>`. Each
/// commit locks and commits at this machine and writes COMMIT-BACKUP records into the other
/// machines' logs, where their threads must take them for the logs to have room. The last
/// machine runs none: its logs are taken by its background pollers, so that only the
/// pipelines of the first two take each other's records.
fn local_in_pipeline(node: &Node, dir: &Path) {
    let all = open_accounts(node, dir);
    let me = node.id();
    let all_done = || (0..MACHINES).all(|m| dir.join(format!("local-done-{m}")).exists());
    if me.0 == MACHINES - 1 {
        std::fs::write(dir.join(format!("local-done-{}", me.0)), "").unwrap();
        while !all_done() {
            std::thread::sleep(Duration::from_millis(1));
        }
        return println!("local 0");
    }
    let view = node.view();
    let mine: Vec<Addr> = (all.iter().copied())
        .filter(|a| view.map.get(a.region).is_some_and(|p| p.primary == me))
        .collect();
    assert!(mine.len() >= 2, "machine {me}: {mine:?} are its accounts");
    let done = std::cell::Cell::new(0u64);
    node.pipeline(2, async |p, k| {
        let account = mine[k];
        loop {
            p.txn(me, async |tx| {
                let v: u64 = farm::Transaction::read(tx, account).await?;
                farm::Transaction::write(tx, account, &(v + 1)).await
            })
            .await
            .unwrap_or_else(|e| panic!("machine {me}: {e}"));
            done.set(done.get() + 1);
            if done.get() == LOCAL_TXNS {
                std::fs::write(dir.join(format!("local-done-{}", me.0)), "").unwrap();
            }
            if done.get().is_multiple_of(256) && all_done() {
                return;
            }
        }
    });
    println!("local {}", done.get());
}

/// Tells the machines of `dir` to stop (the file `<dir>/stop`), the survivors once they are in
/// a configuration without `removed`.
pub fn stop_after_removal_of(dir: &Path, removed: u16) {
    // Written whole before it appears: a child that sees the file reads the machine.
    let tmp = dir.join("stop.tmp");
    std::fs::write(&tmp, removed.to_string()).unwrap();
    std::fs::rename(&tmp, dir.join("stop")).unwrap();
}

/// The file `stop` may name a machine that the test stopped or killed: a survivor waits until
/// it is in a configuration without it before it reports, since it may hear of the removal
/// after the removed machine does (from the coordination store) and after the test's deadline.
fn wait_until_removed(node: &Node, stop: &Path) {
    let Ok(m) = std::fs::read_to_string(stop).unwrap().trim().parse::<u16>() else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while node.configuration().contains(farm::MachineId(m)) {
        assert!(
            Instant::now() < deadline,
            "machine {} still has machine {m} in its configuration",
            node.id()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Quiesces with the other machines and prints `transfers <done>`, where every region lives
/// (`placement <region> <primary> <backups>`), the configuration and its members, and the sum.
fn quiesce_and_report(node: &Node, all: &[Addr], done: u64, dir: &Path) {
    // Every survivor quiesces (truncations flushed, data recovery done) before the checks.
    quiesce_until_quiet(node, "quiesce");
    let view = node.view();
    let members: Vec<String> = view
        .config
        .members
        .iter()
        .map(|m| m.0.to_string())
        .collect();
    println!("transfers {done}");
    for (r, p) in view.map.iter() {
        let backups: Vec<String> = p.backups.iter().map(|b| b.0.to_string()).collect();
        println!("placement {} {} {}", r.0, p.primary.0, backups.join(","));
    }
    println!("config {} members {}", view.config.id.0, members.join(","));
    print_sum(node, all);
    // Keep quiescing while the others finish theirs (they may need this machine's
    // truncations), until the test has every report (`Machines::check_replicas` says so with
    // the file `reported`); then until quiet once more, and say `quiet`: this machine's NVRAM
    // now holds every write the others' last transactions made here, and the test reads it.
    // (Reading it at the last report raced: on a loaded host the test found a region whose
    // backup had applied a transfer at truncation while the primary had not yet processed its
    // COMMIT-PRIMARY.)
    let reported = dir.join(REPORTED);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !reported.exists() && Instant::now() < deadline {
        node.quiesce_step();
        std::thread::sleep(Duration::from_millis(1));
    }
    quiesce_until_quiet(node, "quiesce again");
    println!("quiet");
}

/// Quiesces until this machine is quiet (`Node::quiesce_step`), failing after 30 s with "did
/// not `what`".
fn quiesce_until_quiet(node: &Node, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !node.quiesce_step() {
        assert!(
            Instant::now() < deadline,
            "machine {} did not {what}",
            node.id()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The file that tells machines every report is in (see `quiesce_and_report`).
const REPORTED: &str = "reported";

/// A machine of the rejoin tests prints `progress <transfers>` after every so many.
pub const PROGRESS_EVERY: u64 = 25;

/// Transfers a machine makes after it rejoined, before it stops.
pub const AFTER_REJOIN: u64 = 50;

/// Transfers like `bank_until_stopped`, but a machine that learns it was removed says
/// `evicted`, stops its node and starts a new one that joins the cluster, says
/// `rejoined <configuration>` once it is a member with every region active, and makes at least
/// [`AFTER_REJOIN`] transfers before it stops too.
fn rejoin_until_stopped(mut node: Node, config: &NodeConfig, dir: &Path) {
    let all = open_accounts(&node, dir);
    let mut next = rng(&node);
    let n = all.len() as u64;
    let stop = dir.join("stop");
    let mut done = 0u64;
    let mut total = 0u64;
    let mut rejoined = false;
    while !stop.exists() || (rejoined && done < AFTER_REJOIN) {
        if node.is_evicted() {
            let committed: Vec<String> = node
                .committed_configurations()
                .iter()
                .map(|c| c.0.to_string())
                .collect();
            println!(
                "evicted after {done} transfers, having committed configurations [{}]",
                committed.join(",")
            );
            // A removed incarnation is not a member, though its last view still holds it.
            match node.wait_joined(Duration::from_secs(30)) {
                Err(farm::node::NodeError::EvictedWhileJoining(m)) => assert_eq!(m, node.id()),
                other => panic!("an evicted node waited to be joined: {other:?}"),
            }
            drop(node);
            node = Node::join(config, Duration::from_secs(30)).unwrap();
            println!("rejoined {}", node.configuration().id.0);
            rejoined = true;
            done = 0;
        }
        let (from, to, amount) = (all[next(n) as usize], all[next(n) as usize], 1 + next(10));
        match transfer(&node, from, to, amount) {
            Ok(()) => {
                done += 1;
                total += 1;
                if total.is_multiple_of(PROGRESS_EVERY) {
                    println!("progress {total}");
                }
            }
            Err(farm::TxError::Evicted(_)) => {}
            Err(e) => println!("error {e}"),
        }
    }
    quiesce_and_report(&node, &all, done, dir);
}

/// Transfers after a restart, before the checks.
pub const AFTER_RESTART: u64 = 50;

/// The restart test's first life: allocates this machine's counter (its address in
/// `<dir>/counter-<m>`), then transfers until killed, each transfer also incrementing the
/// counter and printing `acked <count>` once committed, and `installed <id> members <list>`
/// each time it installs a configuration.
fn run_until_killed(node: &Node, dir: &Path) {
    let counter = node.txn(|tx| tx.alloc(&0u64, None)).unwrap();
    let file = dir.join(format!("counter-{}", node.id().0));
    std::fs::write(&file, format!("{}:{}", counter.region.0, counter.offset)).unwrap();
    let all = open_accounts(node, dir);
    let mut next = rng(node);
    let n = all.len() as u64;
    let mut installed = node.configuration().id;
    loop {
        let config = node.configuration();
        if config.id != installed {
            installed = config.id;
            let members: Vec<String> = config.members.iter().map(|m| m.0.to_string()).collect();
            println!("installed {} members {}", config.id.0, members.join(","));
        }
        let (from, to, amount) = (all[next(n) as usize], all[next(n) as usize], 1 + next(10));
        match counted_transfer(node, counter, from, to, amount) {
            Ok(count) => println!("acked {count}"),
            Err(e) => println!("error {e}"),
        }
    }
}

/// The restart test's second life, started with `restart`: prints `counter <count>` and the
/// sum as the restart left them, makes [`AFTER_RESTART`] more transfers, then quiesces and
/// prints what `bank_until_stopped` prints at its end.
fn restarted(node: &Node, dir: &Path) {
    let file = dir.join(format!("counter-{}", node.id().0));
    let text = std::fs::read_to_string(&file).unwrap();
    let (r, o) = text.split_once(':').unwrap();
    let counter = Addr::new(RegionId(r.parse().unwrap()), o.parse().unwrap());
    let all = open_existing(dir);
    println!(
        "counter {}",
        node.txn(|tx| tx.read::<u64>(counter)).unwrap()
    );
    print_sum(node, &all);
    let mut next = rng(node);
    let n = all.len() as u64;
    for _ in 0..AFTER_RESTART {
        let (from, to, amount) = (all[next(n) as usize], all[next(n) as usize], 1 + next(10));
        counted_transfer(node, counter, from, to, amount).unwrap();
    }
    quiesce_and_report(node, &all, AFTER_RESTART, dir);
}

/// A transfer that also increments `counter`; returns the count it committed.
fn counted_transfer(
    node: &Node,
    counter: Addr,
    from: Addr,
    to: Addr,
    amount: u64,
) -> Result<u64, farm::TxError> {
    node.txn(|tx| {
        let count: u64 = tx.read(counter)?;
        tx.write(counter, &(count + 1))?;
        if from != to {
            let a: u64 = tx.read(from)?;
            let b: u64 = tx.read(to)?;
            if a >= amount {
                tx.write(from, &(a - amount))?;
                tx.write(to, &(b + amount))?;
            }
        }
        Ok(count + 1)
    })
}

/// Longest list of the list-append test.
const LIST_CAP: usize = 128;
type List = [u64; LIST_CAP + 1];

/// A clock every process of the host shares (CLOCK_MONOTONIC), in nanoseconds: the checker
/// orders transactions of different processes in real time by it.
pub fn host_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass and reads nothing else.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// List-append (the simulator's workload, `farm_sim::check`) across processes: every machine
/// opens lists; machines 0 and 1 run 1 to 3 reads or appends per transaction until
/// `<dir>/stop`, printing each acknowledged one as `txn <invoke> <complete> <ops>` (`a:key:value`
/// or `r:key:v.v.v`); machine 2 only holds lists (it is the one killed). Then machine 0 prints
/// a final read of every list as a last transaction, and `done`.
/// List-append transactions from the first `writers` machines until `<dir>/stop` appears (or,
/// for a machine removed meanwhile, until it learns it: `evicted <host ns>`); machine 0 then
/// reads every list. With three, machine 2 only reads, as fast as it can, while the others
/// append every few milliseconds (so that the lists do not fill up while it is stopped).
fn append_until_stopped(node: &Node, dir: &Path, writers: u64) {
    let keys = open_objects(node, dir, |tx| tx.alloc(&[0u64; LIST_CAP + 1], None));
    let me = node.id().0 as u64;
    let stop = dir.join("stop");
    let mut next = rng(node);
    let mut i = 0u64;
    while me < writers && !stop.exists() {
        let reader = writers == 3 && me == 2;
        let plan: Vec<(usize, bool)> = (0..1 + next(3))
            .map(|_| (next(keys.len() as u64) as usize, !reader && next(2) == 0))
            .collect();
        if writers == 3 && !reader {
            std::thread::sleep(Duration::from_millis(3));
        }
        let base = (me << 40) | (i << 4);
        i += 1;
        let invoke = host_ns();
        match node.txn(|tx| list_append(tx, &keys, &plan, base)) {
            Ok(ops) => println!("txn {invoke} {} {}", host_ns(), encode_ops(&ops)),
            Err(farm::TxError::Evicted(_)) => {
                println!("evicted {}", host_ns());
                break;
            }
            Err(e) => println!("error {e}"),
        }
    }
    if me == 0 {
        let invoke = host_ns();
        let ops = node
            .txn(|tx| {
                keys.iter()
                    .enumerate()
                    .map(|(k, a)| {
                        let list: List = tx.read(*a)?;
                        Ok(farm_sim::Op::Read {
                            key: k as u64,
                            values: list[1..=list[0] as usize].to_vec(),
                        })
                    })
                    .collect::<Result<Vec<_>, farm::TxError>>()
            })
            .unwrap();
        println!("txn {invoke} {} {}", host_ns(), encode_ops(&ops));
    }
    println!("done");
}

fn list_append(
    tx: &mut farm::Txn<'_>,
    keys: &[Addr],
    plan: &[(usize, bool)],
    base: u64,
) -> Result<Vec<farm_sim::Op>, farm::TxError> {
    let mut ops = Vec::new();
    for (j, (key, append)) in plan.iter().enumerate() {
        let mut list: List = tx.read(keys[*key])?;
        let len = list[0] as usize;
        if *append && len < LIST_CAP {
            let value = base | j as u64;
            list[1 + len] = value;
            list[0] += 1;
            tx.write(keys[*key], &list)?;
            ops.push(farm_sim::Op::Append {
                key: *key as u64,
                value,
            });
        } else {
            ops.push(farm_sim::Op::Read {
                key: *key as u64,
                values: list[1..=len].to_vec(),
            });
        }
    }
    Ok(ops)
}

fn encode_ops(ops: &[farm_sim::Op]) -> String {
    let each: Vec<String> = ops
        .iter()
        .map(|op| match op {
            farm_sim::Op::Append { key, value } => format!("a:{key}:{value}"),
            farm_sim::Op::Read { key, values } => {
                let v: Vec<String> = values.iter().map(u64::to_string).collect();
                format!("r:{key}:{}", v.join("."))
            }
        })
        .collect();
    each.join(" ")
}

/// A `txn` line's transaction, for the checker.
pub fn decode_txn(line: &str) -> farm_sim::TxnRecord {
    let mut f = line.split(' ');
    let invoke = f.next().unwrap().parse().unwrap();
    let complete = f.next().unwrap().parse().unwrap();
    let ops = f
        .map(|op| {
            let mut p = op.splitn(3, ':');
            let (kind, key, rest) = (p.next().unwrap(), p.next().unwrap(), p.next().unwrap());
            let key = key.parse().unwrap();
            match kind {
                "a" => farm_sim::Op::Append {
                    key,
                    value: rest.parse().unwrap(),
                },
                _ => farm_sim::Op::Read {
                    key,
                    values: rest
                        .split('.')
                        .filter(|v| !v.is_empty())
                        .map(|v| v.parse().unwrap())
                        .collect(),
                },
            }
        })
        .collect();
    farm_sim::TxnRecord {
        ops,
        invoke,
        complete,
        committed: true,
    }
}

fn rng(node: &Node) -> impl FnMut(u64) -> u64 {
    let mut x = node.id().0 as u64 * 7919 + 1;
    move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    }
}

fn transfer(node: &Node, from: Addr, to: Addr, amount: u64) -> Result<(), farm::TxError> {
    if from == to {
        return Ok(());
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
}

fn print_sum(node: &Node, all: &[Addr]) {
    let balances: Vec<u64> = node
        .txn(|tx| all.iter().map(|a| tx.read::<u64>(*a)).collect())
        .unwrap();
    let list: Vec<String> = balances.iter().map(u64::to_string).collect();
    println!(
        "sum {} moved {} balances {}",
        balances.iter().sum::<u64>(),
        balances.iter().filter(|b| **b != BALANCE).count(),
        list.join(",")
    );
}

/// Opens this machine's accounts, prints them, and returns every machine's once the file
/// `<dir>/accounts` names them.
fn open_accounts(node: &Node, dir: &Path) -> Vec<Addr> {
    open_objects(node, dir, |tx| tx.alloc(&BALANCE, None))
}

/// Opens [`ACCOUNTS`] objects made by `alloc` in this machine's regions, prints them
/// (`accounts <region>:<offset> ...`), and returns every machine's once the file
/// `<dir>/accounts` names them.
fn open_objects(
    node: &Node,
    dir: &Path,
    alloc: impl Fn(&mut farm::Txn<'_>) -> Result<Addr, farm::TxError>,
) -> Vec<Addr> {
    let mine: Vec<Addr> = (0..ACCOUNTS).map(|_| node.txn(&alloc).unwrap()).collect();
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
    open_existing(dir)
}

/// Every machine's objects, as `<dir>/accounts` names them.
fn open_existing(dir: &Path) -> Vec<Addr> {
    std::fs::read_to_string(dir.join("accounts"))
        .unwrap()
        .split_whitespace()
        .map(|a| {
            let (r, o) = a.split_once(':').unwrap();
            Addr::new(RegionId(r.parse().unwrap()), o.parse().unwrap())
        })
        .collect()
}

/// What the machines of a failure test print at their end (`bank_until_stopped`).
#[derive(Debug, Default)]
pub struct Ends {
    /// The sum each machine read.
    pub sums: BTreeMap<u16, u64>,
    /// Each machine's `<id> members <list>`.
    pub configs: BTreeMap<u16, String>,
    /// Transfers each machine committed.
    pub transfers: BTreeMap<u16, u64>,
    /// Each machine's `placement` lines.
    pub placements: BTreeMap<u16, Vec<String>>,
    /// Machines that said they were evicted.
    pub evicted: BTreeSet<u16>,
    /// The configurations each evicted incarnation had committed as a CM, as it said.
    pub committed_when_evicted: BTreeMap<u16, String>,
    /// The configuration a machine rejoined in.
    pub rejoined: Option<u64>,
    /// The balances each machine read with its sum, account by account (to diagnose a total
    /// that does not hold).
    pub balances: BTreeMap<u16, String>,
}

impl Ends {
    fn take(&mut self, m: u16, line: &str) {
        if let Some(rest) = line.strip_prefix("sum ") {
            let (sum, rest) = rest.split_once(" moved ").unwrap();
            self.sums.insert(m, sum.parse().unwrap());
            if let Some((_, b)) = rest.split_once(" balances ") {
                self.balances.insert(m, b.to_string());
            }
        } else if let Some(rest) = line.strip_prefix("config ") {
            self.configs.insert(m, rest.to_string());
        } else if let Some(n) = line.strip_prefix("transfers ") {
            self.transfers.insert(m, n.parse().unwrap());
        } else if let Some(p) = line.strip_prefix("placement ") {
            self.placements.entry(m).or_default().push(p.to_string());
        } else if let Some(c) = line.strip_prefix("rejoined ") {
            self.rejoined = Some(c.parse().unwrap());
        } else if line.starts_with("evicted") {
            self.evicted.insert(m);
            if let Some((_, c)) = line.split_once("having committed configurations ") {
                self.committed_when_evicted.insert(m, c.to_string());
            }
        } else if line.starts_with("error") {
            eprintln!("machine {m}: {line}");
        }
    }

    /// The total holds on machines 0 and 1, both in the configuration without machine 2.
    pub fn assert_survivors_hold_the_total(&self) {
        let total = MACHINES as u64 * ACCOUNTS * BALANCE;
        assert_eq!(
            self.sums,
            BTreeMap::from([(0, total), (1, total)]),
            "the total did not hold: {self:?}"
        );
        for m in [0u16, 1] {
            let c = &self.configs[&m];
            assert!(
                c.ends_with("members 0,1"),
                "machine {m} is in {c}, not a configuration without machine 2"
            );
        }
    }
}

/// Where a test's machines run.
#[derive(Clone, Debug)]
pub enum Net {
    /// Processes of this host over the `shm` fabric.
    Shm,
    /// Over the `tcp` fabric on loopback.
    Loopback,
    /// Over the `tcp` fabric, machine `m` in network namespace `hosts[m].0` at `hosts[m].1`.
    Namespaces(Vec<(String, std::net::IpAddr)>),
}

pub struct Machines {
    children: Vec<Child>,
    pub lines: Receiver<(u16, String)>,
    /// Lines read ahead (by [`Machines::progress`]) for [`Machines::ends`].
    read_ahead: std::cell::RefCell<std::collections::VecDeque<(u16, String)>>,
    /// Whether they run over the `tcp` fabric.
    pub tcp: bool,
    /// How many machines.
    pub count: u16,
    /// One test's machines at a time in a test binary: two clusters' processes sharing the
    /// two cores would starve each other's leases.
    _serial: std::sync::MutexGuard<'static, ()>,
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Machines {
    /// [`Machines::start_on`] the `shm` fabric.
    pub fn start(mode: &str, test: u16, dir: &Path, zookeeper: Option<(String, String)>) -> Self {
        Self::start_on(&Net::Shm, mode, test, dir, zookeeper)
    }

    /// Starts the [`MACHINES`] machines of a test in `mode` (see [`child_main`]) on `net`.
    pub fn start_on(
        net: &Net,
        mode: &str,
        test: u16,
        dir: &Path,
        zookeeper: Option<(String, String)>,
    ) -> Self {
        Self::start_n(net, MACHINES, mode, test, dir, zookeeper)
    }

    /// Starts `count` machines of a test in `mode` (see [`child_main`]) on `net`.
    pub fn start_n(
        net: &Net,
        count: u16,
        mode: &str,
        test: u16,
        dir: &Path,
        zookeeper: Option<(String, String)>,
    ) -> Self {
        // A test that failed holding it poisoned it; the next runs all the same.
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        // The reports of an earlier run on this directory (a restarted cluster) are not
        // these machines'.
        let _ = std::fs::remove_file(dir.join(REPORTED));
        let (tx, lines) = channel();
        let tcp = !matches!(net, Net::Shm);
        let children = (0..count)
            .map(|m| {
                let exe = std::env::current_exe().unwrap();
                let mut command = match net {
                    Net::Namespaces(hosts) => {
                        let mut c = Command::new("ip");
                        c.args(["netns", "exec", &hosts[m as usize].0]).arg(exe);
                        let ips: Vec<String> = hosts.iter().map(|h| h.1.to_string()).collect();
                        c.env(HOSTS_ENV, ips.join(","));
                        c
                    }
                    _ => Command::new(exe),
                };
                command
                    .args(["--ignored", "--exact", "node_child", "--nocapture"])
                    .env(
                        CHILD_ENV,
                        format!("{mode}:{m}:{}:{}", base_port(test), dir.display()),
                    )
                    .env(MACHINES_ENV, count.to_string())
                    .stdout(Stdio::piped());
                if let Some((connect, root)) = &zookeeper {
                    command.env(ZK_ENV, format!("{connect}|{root}"));
                }
                if tcp {
                    command.env(TCP_ENV, "1");
                }
                let mut child = command.spawn().unwrap();
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
        Self {
            children,
            lines,
            read_ahead: Default::default(),
            tcp,
            count,
            _serial: serial,
        }
    }

    /// The next line a machine printed (read ahead, or within `timeout`).
    fn next_line(&self, timeout: Duration) -> Result<(u16, String), RecvTimeoutError> {
        match self.read_ahead.borrow_mut().pop_front() {
            Some(line) => Ok(line),
            None => self.lines.recv_timeout(timeout),
        }
    }

    /// Waits until each machine of `machines` printed `progress <n>` with `n` at least
    /// `at_least` (at most 60 s), keeping the other lines for later reads; returns the last
    /// count each printed.
    pub fn progress(&self, machines: &[u16], at_least: u64) -> BTreeMap<u16, u64> {
        let mut counts = BTreeMap::new();
        let mut kept = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !machines
            .iter()
            .all(|m| counts.get(m).is_some_and(|n| *n >= at_least))
        {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((m, line)) => match line.strip_prefix("progress ") {
                    Some(n) => {
                        counts.insert(m, n.parse().unwrap());
                    }
                    None => kept.push((m, line)),
                },
                Err(e) => panic!("machines {machines:?} reached {counts:?}, not {at_least}: {e}"),
            }
        }
        self.read_ahead.borrow_mut().extend(kept);
        counts
    }

    /// Waits up to `within` for a line from machine `from` that starts with `prefix`, keeping
    /// every line it reads, that one included, for later reads; returns whether it came.
    pub fn saw(&self, from: u16, prefix: &str, within: Duration) -> bool {
        let hit = |(m, line): &(u16, String)| *m == from && line.starts_with(prefix);
        if self.read_ahead.borrow().iter().any(hit) {
            return true;
        }
        let deadline = Instant::now() + within;
        let mut kept = Vec::new();
        let found = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let found = hit(&line);
                    kept.push(line);
                    if found {
                        break true;
                    }
                }
                Err(_) => break false,
            }
        };
        self.read_ahead.borrow_mut().extend(kept);
        found
    }

    /// Waits up to `within` for a line `what` from machine `from`, failing on any other
    /// suspicion; returns whether it came.
    pub fn expect(&self, from: u16, what: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_line(left) {
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

    /// Reads what the machines print at their end until `done` (at most 60 s), passing every
    /// line to `each` first.
    pub fn ends(&self, done: impl Fn(&Ends) -> bool, mut each: impl FnMut(u16, &str)) -> Ends {
        let mut ends = Ends::default();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done(&ends) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_line(left) {
                Ok((m, line)) => {
                    each(m, &line);
                    ends.take(m, &line);
                }
                Err(e) => panic!("{ends:?}: {e}"),
            }
        }
        ends
    }

    /// Collects every machine's `accounts` line and writes them all to `<dir>/accounts`.
    pub fn share_accounts(&self, dir: &Path) {
        let mut accounts = std::collections::BTreeMap::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while accounts.len() < self.count as usize {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_line(left) {
                Ok((m, line)) => {
                    if let Some(list) = line.strip_prefix("accounts ") {
                        accounts.insert(m, list.to_string());
                    }
                }
                Err(e) => panic!("accounts of {accounts:?} only: {e}"),
            }
        }
        let all: Vec<&str> = accounts.values().map(String::as_str).collect();
        let tmp = dir.join("accounts.tmp");
        std::fs::write(&tmp, all.join(" ")).unwrap();
        std::fs::rename(&tmp, dir.join("accounts")).unwrap();
    }

    /// Compares the replicas of every region of `placements` (`placement` lines) byte for byte
    /// through their NVRAM files, as `farm_sim::check_region` does in one process.
    pub fn check_replicas(&self, dir: &Path, placements: &[String]) -> usize {
        // Every report is in: each machine quiesces once more and says so, and only then is
        // its NVRAM what the check reads.
        std::fs::write(dir.join(REPORTED), b"").unwrap();
        let mut read: Vec<u16> = placements
            .iter()
            .flat_map(|line| {
                let f: Vec<&str> = line.split(' ').collect();
                std::iter::once(f[1])
                    .chain(f[2].split(','))
                    .map(|m| m.parse().unwrap())
            })
            .collect();
        read.sort_unstable();
        read.dedup();
        for m in read {
            assert!(
                self.saw(m, "quiet", Duration::from_secs(60)),
                "machine {m} did not quiesce again after every report"
            );
        }
        let open = |m: &str, r: &str| {
            let path = nvram_dir(dir, m.parse().unwrap(), self.tcp)
                .join(format!("m{m}"))
                .join(format!("region-{r}"));
            Nvram::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        };
        let mut objects = 0;
        for line in placements {
            let mut f = line.split(' ');
            let (r, p, backups) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
            let primary = open(p, r);
            let backups: Vec<(MachineId, Nvram)> = backups
                .split(',')
                .map(|b| (MachineId(b.parse().unwrap()), open(b, r)))
                .collect();
            let refs: Vec<(MachineId, &Nvram)> = backups.iter().map(|(m, n)| (*m, n)).collect();
            objects += farm_sim::check_region(
                RegionId(r.parse().unwrap()),
                (MachineId(p.parse().unwrap()), &primary),
                &refs,
                REGION_BYTES,
            )
            .unwrap_or_else(|e| panic!("replicas differ: {e}"));
        }
        objects
    }

    /// What the machines of a rejoin test print at their end: once machine 2 says it rejoined,
    /// the file `<dir>/stop` tells them all to stop.
    pub fn ends_after_rejoin(&self, dir: &Path) -> Ends {
        self.ends(
            |e| e.sums.len() == MACHINES as usize,
            |m, line| {
                if line.starts_with("rejoined ") {
                    assert_eq!(m, 2, "machine {m} rejoined");
                    std::fs::write(dir.join("stop"), b"").unwrap();
                }
            },
        )
    }

    /// The checks after machine 2 was evicted and rejoined: all three end in one
    /// configuration from its join on, the total holds everywhere, the rejoined machine
    /// transferred again and holds a replica of every region, and the replicas are equal byte
    /// for byte.
    pub fn check_rejoined(&self, dir: &Path, ends: &Ends) {
        let rejoined = ends.rejoined.expect("machine 2 did not rejoin");
        assert!(ends.evicted.contains(&2), "machine 2 was not evicted");
        let total = MACHINES as u64 * ACCOUNTS * BALANCE;
        assert_eq!(
            ends.sums,
            BTreeMap::from([(0, total), (1, total), (2, total)]),
            "the total did not hold"
        );
        for m in 0..MACHINES {
            let c = &ends.configs[&m];
            assert!(
                c.ends_with("members 0,1,2"),
                "machine {m} is in {c}, not a configuration of all three"
            );
            let id: u64 = c.split(' ').next().unwrap().parse().unwrap();
            assert!(
                id >= rejoined,
                "machine {m} ended in {id}, before the join {rejoined}"
            );
        }
        assert!(ends.transfers[&2] >= AFTER_REJOIN);
        let placements = &ends.placements;
        assert_eq!(
            placements[&0], placements[&1],
            "machines disagree on the map"
        );
        assert_eq!(
            placements[&0], placements[&2],
            "machines disagree on the map"
        );
        assert!(
            placements[&0].iter().all(|p| {
                let f: Vec<&str> = p.split(' ').collect();
                f[1] == "2" || f[2].split(',').any(|b| b == "2")
            }),
            "a region without a replica on the rejoined machine: {:?}",
            placements[&0]
        );
        let objects = self.check_replicas(dir, &placements[&0]);
        assert!(objects > 0, "no object compared");
    }

    /// Machine `m`'s process id.
    pub fn pid(&self, m: u16) -> u32 {
        self.children[m as usize].id()
    }

    pub fn signal(&self, m: u16, signal: libc::c_int) {
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
