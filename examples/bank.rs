//! A bank as a program of your own whose processes are the machines of a farm-rs cluster
//! (`farm_node::run`): each machine runs transfers between accounts anywhere in the cluster,
//! many in flight at once, and counts the transfers it committed in a teller's counter of its
//! own; a machine started with `--audit` transfers nothing and checks instead that the money
//! adds up and what the tellers counted. The README's "Your own program as machine processes"
//! walks through it:
//!
//! ```text
//! cargo build --release -p farm-node --example bank
//! target/release/farm-node local start --cluster bank --program target/release/examples/bank
//! target/release/farm-node local kill 2 --cluster bank
//! target/release/farm-node local restart 2 --cluster bank
//! target/release/farm-node local stop --cluster bank
//! target/release/farm-node local start --restart --cluster bank -- --audit
//! ```
//!
//! The accounts are a [`HashTable`] partitioned over the machines (a balance under each
//! account number); the tellers another (transfers committed, under machine and task). Machine
//! 0 creates both when the cluster is new and publishes where they are in the cluster's
//! ZooKeeper node; the other machines, and every machine that restarts or rejoins, open them
//! from there.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Parser;
use farm::{Addr, MachineId, Transaction, TxError};
use farm_ds::{HashTable, TableSpec};
use farm_node::{MachineArgs, Running};
use farm_workloads::Rand;

#[derive(Parser, Debug)]
#[command(about = "A bank whose processes are the machines of a farm-rs cluster")]
struct Args {
    #[command(flatten)]
    machine: MachineArgs,
    /// Accounts in the bank, over all machines (when machine 0 creates it).
    #[arg(long, default_value_t = 1000)]
    accounts: u64,
    /// Transfers this machine keeps in flight (one teller each).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=TELLERS_MAX as i64))]
    in_flight: u16,
    /// Milliseconds to sleep after each round of transfers, one from every slot (0: no
    /// rounds, as fast as the cluster goes).
    #[arg(long, default_value_t = 0)]
    pause_ms: u64,
    /// Transfer nothing: check that the money adds up, print what every teller counted, and
    /// serve.
    #[arg(long)]
    audit: bool,
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, default_value = "info")]
    log: tracing::Level,
}

/// What every account holds at first.
const OPENING_BALANCE: u64 = 1_000;

/// Tellers (transfers in flight) per machine, at most.
const TELLERS_MAX: u16 = 256;

/// Where the bank's tables are, in the cluster's ZooKeeper node.
const TABLES_KEY: &str = "bank-tables";

/// How often a machine says how many of its transfers were acknowledged.
const REPORT_EVERY: Duration = Duration::from_millis(100);

/// The bank's tables.
struct Bank {
    /// Account number (0 to `count - 1`) to balance.
    accounts: HashTable<u64, u64>,
    /// Accounts opened.
    count: u64,
    /// `teller(machine, task)` to the transfers that teller committed.
    tellers: HashTable<u32, u64>,
}

/// A teller's key.
fn teller(machine: MachineId, task: u16) -> u32 {
    (machine.0 as u32) << 16 | task as u32
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    farm_node::log_to_stderr(args.log);
    farm_node::run(&args.machine, |m: &Running<'_>| {
        let bank = open(m, &args)?;
        if args.audit {
            return audit(m, &bank);
        }
        transfer(m, &bank, &args);
        Ok(())
    })
}

/// The bank's tables: created by machine 0 when the cluster is new, opened from where it
/// published them otherwise.
fn open(m: &Running<'_>, args: &Args) -> anyhow::Result<Bank> {
    let s = m.settings;
    let store = s.store()?;
    let me = m.node.id();
    let machines: Vec<MachineId> = (0..s.machines).map(MachineId).collect();
    if me.0 == 0 && store.get(TABLES_KEY)?.is_none() {
        // Small buckets: a write writes its whole bucket, so keys that share one conflict.
        let spec = TableSpec::with_capacity(machines.clone(), args.accounts, 2);
        let accounts = HashTable::create(m.node, &spec)?;
        let tellers_max = s.machines as u64 * TELLERS_MAX as u64;
        let tellers =
            HashTable::create(m.node, &TableSpec::with_capacity(machines, tellers_max, 1))?;
        let numbers: Vec<u64> = (0..args.accounts).collect();
        for chunk in numbers.chunks(100) {
            m.node.txn(|tx| {
                for n in chunk {
                    accounts.insert(tx, n, &OPENING_BALANCE)?;
                }
                Ok(())
            })?;
        }
        let words = [
            accounts.root().to_u64(),
            tellers.root().to_u64(),
            args.accounts,
        ];
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        store.put(TABLES_KEY, &bytes)?;
        println!(
            "bank: opened {} accounts of {OPENING_BALANCE} each",
            args.accounts
        );
        return Ok(Bank {
            accounts,
            count: args.accounts,
            tellers,
        });
    }
    let started = Instant::now();
    let bytes = loop {
        if let Some(b) = store.get(TABLES_KEY)? {
            break b;
        }
        if started.elapsed() > Duration::from_secs(s.start_timeout_seconds) {
            bail!("machine 0 did not publish the bank's tables ({TABLES_KEY} in ZooKeeper)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if bytes.len() != 24 {
        bail!("{TABLES_KEY} in ZooKeeper is {} bytes, not 24", bytes.len());
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    Ok(Bank {
        accounts: HashTable::open(m.node, me, Addr::from_u64(word(0)))?,
        count: word(2),
        tellers: HashTable::open(m.node, me, Addr::from_u64(word(1)))?,
    })
}

/// Transfers until the machine is evicted (or the process told to stop), `args.in_flight` at
/// a time: each moves 1 to 10 from one random account to another, if the first has it, and
/// counts itself in its teller. Every `REPORT_EVERY` it prints `bank: acked N`, the sum of
/// what its tellers counted in their last acknowledged transfers.
fn transfer(m: &Running<'_>, bank: &Bank, args: &Args) {
    let me = m.node.id();
    let accounts = bank.count;
    let acked: Vec<AtomicU64> = (0..args.in_flight).map(|_| AtomicU64::new(0)).collect();
    let report = || {
        let n: u64 = acked.iter().map(|a| a.load(Ordering::Relaxed)).sum();
        println!("bank: acked {n}");
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            while !m.stopping() {
                std::thread::sleep(REPORT_EVERY);
                report();
            }
        });
        // Rounds: with a pause, each slot makes one transfer a round and the thread sleeps
        // between rounds; without, one round that lasts until the machine stops.
        let errors = AtomicU64::new(0);
        for round in 0u64.. {
            m.node.pipeline(args.in_flight as usize, async |p, task| {
                let key = teller(me, task as u16);
                let seed = (me.0 as u64) << 32 ^ (task as u64) << 16 ^ round << 40;
                let mut rng = Rand::new(seed);
                while !m.stopping() {
                    let from = rng.next_u64() % accounts;
                    let to = (from + 1 + rng.next_u64() % (accounts - 1)) % accounts;
                    let amount = 1 + rng.next_u64() % 10;
                    let done = p
                        .txn(me, async |tx| {
                            let a = balance(bank, tx, from).await?;
                            let b = balance(bank, tx, to).await?;
                            if a >= amount {
                                bank.accounts.update_async(tx, &from, &(a - amount)).await?;
                                bank.accounts.update_async(tx, &to, &(b + amount)).await?;
                            }
                            let n = match bank.tellers.get_in_async(tx, &key).await? {
                                Some(n) => {
                                    bank.tellers.update_async(tx, &key, &(n + 1)).await?;
                                    n + 1
                                }
                                None => {
                                    bank.tellers.insert_async(tx, &key, &1).await?;
                                    1
                                }
                            };
                            Ok(n)
                        })
                        .await;
                    match done {
                        Ok(n) => acked[task].store(n, Ordering::Relaxed),
                        Err(TxError::Evicted(_)) => break,
                        Err(e) => {
                            let n = errors.fetch_add(1, Ordering::Relaxed) + 1;
                            if n.is_power_of_two() {
                                tracing::warn!(task, errors = n, error = %e, "a transfer failed");
                            }
                        }
                    }
                    if args.pause_ms > 0 {
                        break;
                    }
                }
            });
            if m.stopping() {
                break;
            }
            std::thread::sleep(Duration::from_millis(args.pause_ms));
        }
    });
    report();
}

/// The balance of account `n`, read in `tx`.
async fn balance(bank: &Bank, tx: &mut impl Transaction, n: u64) -> Result<u64, TxError> {
    let balance = bank.accounts.get_in_async(tx, &n).await?;
    balance.ok_or_else(|| TxError::Aborted(format!("account {n} is missing")))
}

/// Reads every account and every teller in one transaction, prints what it found, and fails
/// if the money does not add up.
fn audit(m: &Running<'_>, bank: &Bank) -> anyhow::Result<()> {
    let machines = m.settings.machines;
    let accounts = bank.count;
    let (total, tellers) = m.node.txn(|tx| {
        let mut total = 0;
        for n in 0..accounts {
            total += farm::ready(balance(bank, tx, n))?;
        }
        let mut tellers = vec![0u64; machines as usize];
        for (machine, t) in tellers.iter_mut().enumerate() {
            for task in 0..TELLERS_MAX {
                *t += bank
                    .tellers
                    .get_in(tx, &teller(MachineId(machine as u16), task))?
                    .unwrap_or(0);
            }
        }
        Ok((total, tellers))
    })?;
    let expected = accounts * OPENING_BALANCE;
    let counted: Vec<String> = tellers
        .iter()
        .enumerate()
        .map(|(m, n)| format!("{m}={n}"))
        .collect();
    println!(
        "bank: audit: {accounts} accounts hold {total} ({}), transfers by machine {}",
        if total == expected {
            "as opened".to_string()
        } else {
            format!("MISSING {}", expected as i128 - total as i128)
        },
        counted.join(" ")
    );
    if total != expected {
        bail!("the accounts hold {total}, not the {expected} they were opened with");
    }
    Ok(())
}
