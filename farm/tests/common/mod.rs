//! Helpers shared by the threaded runtime's tests.

use farm::{Addr, Cluster, MachineId, TxError, Txn};
use farm_core::rng::Rng;
use farm_sim::Op;

/// One list-append transaction body: for each `(key, append)` of `plan`, reads the list at
/// `keys[key]` (a length word, then up to `N - 1` values) and appends `value_base | j` when
/// asked and there is room, else records the read. Returns the operations for the checker.
#[allow(dead_code)] // Not every test binary that shares this module checks list-append.
pub fn list_append<const N: usize>(
    tx: &mut Txn<'_>,
    keys: &[Addr],
    plan: &[(usize, bool)],
    value_base: u64,
) -> Result<Vec<Op>, TxError>
where
    [u64; N]: bytemuck::Pod,
{
    let mut ops = Vec::new();
    for (j, (key, append)) in plan.iter().enumerate() {
        let mut list: [u64; N] = tx.read(keys[*key])?;
        let len = list[0] as usize;
        if *append && len < N - 1 {
            let value = value_base | j as u64;
            list[1 + len] = value;
            list[0] += 1;
            tx.write(keys[*key], &list)?;
            ops.push(Op::Append {
                key: *key as u64,
                value,
            });
        } else {
            ops.push(Op::Read {
                key: *key as u64,
                values: list[1..=len].to_vec(),
            });
        }
    }
    Ok(ops)
}

/// One bank transfer coordinated on `m`: moves `amount` from `x` to `y` if `x` has it.
/// Returns whether it moved money.
#[allow(dead_code)] // Not every test binary that shares this module runs a bank.
pub fn transfer(c: &Cluster, m: MachineId, x: Addr, y: Addr, amount: u64) -> Result<bool, TxError> {
    c.txn(m, |tx| {
        let from: u64 = tx.read(x)?;
        let to: u64 = tx.read(y)?;
        if from < amount {
            return Ok(false);
        }
        tx.write(x, &(from - amount))?;
        tx.write(y, &(to + amount))?;
        Ok(true)
    })
}

/// A random transfer among `accounts` accounts: two distinct ones and an amount of 1 to 10.
#[allow(dead_code)] // Not every test binary that shares this module runs a bank.
pub fn random_transfer(rng: &mut Rng, accounts: usize) -> (usize, usize, u64) {
    let a = rng.below(accounts as u64) as usize;
    let b = (a + 1 + rng.below(accounts as u64 - 1) as usize) % accounts;
    (a, b, 1 + rng.below(10))
}

/// Where the ZooKeeper tests find their server: `ZK_CONNECT` and a znode root of their own
/// (`/farm-test/<test>-<pid>-<nanos>`). `None`, after saying why, when it is not set; under
/// `CI=true` that fails instead, since ZooKeeper tests must run in CI.
#[allow(dead_code)] // Not every test binary that shares this module talks to ZooKeeper.
pub fn zookeeper(test: &str) -> Option<(String, String)> {
    let Ok(connect) = std::env::var("ZK_CONNECT") else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but ZK_CONNECT is not set: ZooKeeper tests must run in CI (run them under \
             scripts/with-zookeeper.sh)"
        );
        eprintln!("skipping {test} against ZooKeeper: ZK_CONNECT is not set (scripts/with-zookeeper.sh sets it)");
        return None;
    };
    // Tests of one binary start together and may read the same time: a count tells them
    // apart (two that shared a znode found each other's configuration).
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    Some((
        connect,
        format!("/farm-test/{test}-{}-{call}-{nanos}", std::process::id()),
    ))
}
