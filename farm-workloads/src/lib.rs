//! The TATP and TPC-C workloads ([`tatp`], [`tpcc`]), written once over
//! [`farm::Transaction`] so that they run as blocking transactions and among the transactions
//! in flight of a pipeline, on an in-process cluster (the `tatp` and `tpcc` benchmarks) and on
//! machine processes (`farm-node`); and what they share: per-client generators and lock-free
//! lookups.

use bytemuck::Pod;
use farm::{Client, MachineId, Pipeline, TxError};
use farm_ds::HashTable;

pub mod tatp;
pub mod timeline;
pub mod tpcc;
pub mod tpcc_input;

/// A small seeded generator (xorshift*), one per client, with the draws the workloads' inputs
/// need (the benchmarks' `xorshift` is the bare one their bank transfers use).
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

/// Transactions a client thread of a workload that pipelines keeps in flight by default: over
/// three `shm` machine processes TATP ran 162 K/s with 8, 182 K/s with 16 and 170 K/s with 32;
/// over `tcp`, 41, 47 and 53 K/s, with latencies growing with the count (2026-11-26). Since
/// turns post in batches (2026-11-27) `tcp` keeps gaining up to 64 (93-100 K/s at 16, 166-206
/// K/s at 64) while `shm` is flat from 8 to 32 (docs/REPORT-multiprocess.md): machine
/// processes over `tcp` keep 64 (`farm-node`'s `tatp_in_flight_default`), in one process and
/// over `shm` this.
pub const IN_FLIGHT_DEFAULT: usize = 16;

/// The transactions in flight per client thread `asked` for (`None`: the workload's
/// `default`, `None` for one that only blocks), or why not.
pub fn in_flight(asked: Option<usize>, default: Option<usize>) -> anyhow::Result<usize> {
    match (asked, default) {
        (Some(0), _) => anyhow::bail!("--in-flight must be at least 1"),
        (Some(n), None) if n > 1 => anyhow::bail!(
            "--in-flight {n}: this workload runs one blocking transaction per client thread"
        ),
        (Some(n), _) => Ok(n),
        (None, Some(n)) => Ok(n),
        (None, None) => Ok(1),
    }
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
