//! What the benchmark binaries share: percentiles of sorted samples, cheap per-client
//! generators, the bank transfer the recovery benchmarks run, and the TATP and TPC-C
//! workloads, YCSB for the replication comparison, and the runner that drives them.

use bytemuck::Pod;
use farm::{Addr, Client, Cluster, MachineId, Pipeline, TxError};
use farm_ds::HashTable;

/// The benchmark binaries' allocator: transactions allocate and free small buffers at a high
/// rate from several threads (read copies, write sets, decoded log records), where glibc's
/// malloc took about a sixth of TPC-C's time. Libraries leave the choice to their users; the
/// binaries link this crate, so they all use it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub mod runner;
pub mod tatp;
pub mod timeline;
pub mod tpcc;
pub mod tpcc_input;
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

/// A small seeded generator (xorshift*), one per client, with the draws the workloads' inputs
/// need (`xorshift` above is the bare one the bank benchmarks use).
#[derive(Clone, Debug)]
pub struct Rand(u64);

impl Rand {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Random bytes of digits.
    pub fn digits<const N: usize>(&mut self) -> [u8; N] {
        std::array::from_fn(|_| b'0' + (self.next_u64() % 10) as u8)
    }

    /// Random upper-case letters.
    pub fn letters<const N: usize>(&mut self) -> [u8; N] {
        std::array::from_fn(|_| b'A' + (self.next_u64() % 26) as u8)
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

/// Lock-free reads of committed rows (§3), blocking through a client or among the
/// transactions in flight of a pipeline: what TATP's lookups and TPC-C's STOCK-LEVEL read
/// with.
#[allow(async_fn_in_trait)] // Futures of one thread's pipeline.
pub trait LockFree {
    /// [`HashTable::get`] (or [`HashTable::get_async`]) of `key` of `table`, coordinated on
    /// `m`.
    async fn get<K: Pod, V: Pod>(
        &self,
        table: &HashTable<K, V>,
        m: MachineId,
        key: &K,
    ) -> Result<Option<V>, TxError>;
}

/// [`LockFree`] reads that block, through a client.
#[derive(Debug)]
pub struct Blocking<'a, C>(pub &'a C);

impl<C: Client> LockFree for Blocking<'_, C> {
    async fn get<K: Pod, V: Pod>(
        &self,
        table: &HashTable<K, V>,
        m: MachineId,
        key: &K,
    ) -> Result<Option<V>, TxError> {
        table.get(self.0, m, key)
    }
}

impl LockFree for Pipeline<'_> {
    async fn get<K: Pod, V: Pod>(
        &self,
        table: &HashTable<K, V>,
        m: MachineId,
        key: &K,
    ) -> Result<Option<V>, TxError> {
        table.get_async(self, m, key).await
    }
}
