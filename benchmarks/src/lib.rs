//! What the benchmark binaries share: percentiles of sorted samples, a cheap per-client
//! generator, and the bank transfer their workloads run.

use farm::{Addr, Cluster, MachineId, TxError};

pub mod runner;
pub mod tatp;
pub mod timeline;
pub mod tpcc;
pub mod tpcc_input;

/// The `q` quantile (0 to 1) of `sorted`, nearest rank.
pub fn quantile(sorted: &[u64], q: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// A small xorshift generator per client (the workloads only need spread, not quality).
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Moves one unit from `from` to `to`, coordinated on `m`, if `from` has one.
pub fn move_one(c: &Cluster, m: MachineId, from: Addr, to: Addr) -> Result<(), TxError> {
    c.txn(m, |tx| {
        let f: u64 = tx.read(from)?;
        let t: u64 = tx.read(to)?;
        if f > 0 {
            tx.write(from, &(f - 1))?;
            tx.write(to, &(t + 1))?;
        }
        Ok(())
    })
}
