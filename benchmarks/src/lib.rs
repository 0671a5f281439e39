//! What the benchmark binaries share: percentiles of sorted samples, a cheap per-client
//! generator, the bank transfer the recovery benchmarks run, YCSB for the replication
//! comparison, and the runner that drives workloads (TATP and TPC-C are `farm_workloads`'s).

use farm::{Addr, Cluster, MachineId, TxError};

/// The benchmark binaries' allocator: transactions allocate and free small buffers at a high
/// rate from several threads (read copies, write sets, decoded log records), where glibc's
/// malloc took about a sixth of TPC-C's time. Libraries leave the choice to their users; the
/// binaries link this crate, so they all use it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub mod runner;
pub mod timeline;
pub mod ycsb;

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
