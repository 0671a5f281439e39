//! The YCSB core workloads as Tailwind ran them (ATC'18 §5: 100-byte values, Zipfian keys with
//! θ = 0.99, replication factor 3): A (50% PUT), B (5% PUT) and update-only (100% PUT), over a
//! key space spread evenly over the machines.
//!
//! Key `k` is an object of `value_bytes` on machine `k % machines`, allocated there (so that
//! machine is its primary); clients know every key's address, as a KV store's index would tell
//! them. A PUT is a transaction that overwrites the value, coordinated at the key's primary as
//! a RAMCloud master handles a write (the primary locks locally and replicates to the two
//! backups); a GET is a lock-free read of the object from a random machine.

use farm::{Addr, Client, Cluster, MachineId, Session, TxError};

use crate::runner::{pick_alive, Workload};
use farm_workloads::Rand;

/// A YCSB mix.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum, serde::Serialize)]
pub enum Mix {
    /// Workload A: 50% PUT, 50% GET.
    A,
    /// Workload B: 5% PUT, 95% GET.
    B,
    /// Every operation a PUT.
    UpdateOnly,
}

impl Mix {
    /// PUTs in percent.
    pub fn put_percent(self) -> u64 {
        match self {
            Mix::A => 50,
            Mix::B => 5,
            Mix::UpdateOnly => 100,
        }
    }
}

/// YCSB's scrambled Zipfian generator (Gray et al., "Quickly generating billion-record synthetic
/// databases", as YCSB implements it): rank `r` (0-based) has probability proportional to
/// `1 / (r + 1)^θ`, and ranks are hashed onto items so that the popular items spread over the
/// key space (and so over the machines).
#[derive(Clone, Debug)]
pub struct Zipf {
    items: u64,
    theta: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
    half_pow_theta: f64,
}

impl Zipf {
    /// Over `items` items with constant `theta` (0 < θ < 1). Computing ζ(n) takes O(n).
    pub fn new(items: u64, theta: f64) -> Self {
        assert!(
            items >= 2,
            "a Zipfian distribution needs at least two items"
        );
        assert!(
            theta > 0.0 && theta < 1.0,
            "the Zipfian constant must be in (0, 1), got {theta}"
        );
        let zeta = |n: u64| (1..=n).map(|i| 1.0 / (i as f64).powf(theta)).sum::<f64>();
        let zetan = zeta(items);
        let zeta2 = zeta(2);
        Self {
            items,
            theta,
            alpha: 1.0 / (1.0 - theta),
            zetan,
            eta: (1.0 - (2.0 / items as f64).powf(1.0 - theta)) / (1.0 - zeta2 / zetan),
            half_pow_theta: 0.5f64.powf(theta),
        }
    }

    /// A rank: 0 is the most popular.
    pub fn rank(&self, rng: &mut Rand) -> u64 {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let uz = u * self.zetan;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + self.half_pow_theta {
            return 1;
        }
        let r = (self.items as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        r.min(self.items - 1)
    }

    /// An item: the rank hashed (FNV-1a) onto the items.
    pub fn item(&self, rng: &mut Rand) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.rank(rng).to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h % self.items
    }

    /// The probability of rank `r`.
    pub fn probability(&self, r: u64) -> f64 {
        1.0 / ((r + 1) as f64).powf(self.theta) / self.zetan
    }
}

/// The key space and the mix.
#[derive(Debug)]
pub struct Ycsb {
    keys: Vec<Addr>,
    value_bytes: usize,
    machines: u16,
    mix: Mix,
    zipf: Zipf,
}

/// Operation types, in the runner's order.
const KINDS: [&str; 2] = ["GET", "PUT"];

impl Ycsb {
    /// Allocates `keys` objects of `value_bytes` (key `k` on machine `k % machines`), from one
    /// loader thread per machine at most `threads` at once, calling `progress` with the number
    /// loaded.
    pub fn populate(
        cluster: &Cluster,
        keys: u64,
        value_bytes: usize,
        mix: Mix,
        theta: f64,
        threads: usize,
        progress: &(dyn Fn(u64) + Sync),
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(keys >= 2, "at least two keys are needed, got {keys}");
        anyhow::ensure!(
            (8..=1024).contains(&value_bytes),
            "values of 8 to 1024 bytes, got {value_bytes}"
        );
        let machines = cluster.machines();
        let per_machine: Vec<std::sync::Mutex<Vec<Addr>>> =
            (0..machines).map(|_| Default::default()).collect();
        let parts: Vec<u16> = (0..machines).collect();
        // A record holds at most 60 KB per primary: batches stay well below it.
        let batch = (16_384 / (value_bytes + 16)).max(1) as u64;
        crate::runner::load_in_parallel(&parts, threads, |&m| {
            let session = cluster.session();
            let mine: Vec<u64> = (m as u64..keys).step_by(machines as usize).collect();
            let mut out = Vec::with_capacity(mine.len());
            for chunk in mine.chunks(batch as usize) {
                let addrs = session.txn(MachineId(m), |tx| {
                    chunk
                        .iter()
                        .map(|k| tx.alloc_bytes(&value(*k, 0, value_bytes), None))
                        .collect::<Result<Vec<_>, _>>()
                })?;
                out.extend(addrs);
                progress(chunk.len() as u64);
            }
            *per_machine[m as usize].lock().expect("poisoned") = out;
            Ok(())
        })?;
        let per_machine: Vec<Vec<Addr>> = per_machine
            .into_iter()
            .map(|v| v.into_inner().expect("poisoned"))
            .collect();
        Ok(Self {
            keys: (0..keys)
                .map(|k| {
                    per_machine[(k % machines as u64) as usize][(k / machines as u64) as usize]
                })
                .collect(),
            value_bytes,
            machines,
            mix,
            zipf: Zipf::new(keys, theta),
        })
    }

    /// Key `k`'s object.
    pub fn addr(&self, k: u64) -> Addr {
        self.keys[k as usize]
    }

    /// Checks that every value is one some PUT (or the population) wrote for its key.
    pub fn check(&self, cluster: &Cluster) -> anyhow::Result<()> {
        let mut buf = vec![0u8; 8 + self.value_bytes];
        for (k, a) in self.keys.iter().enumerate() {
            cluster.read_bytes_into(
                MachineId((k % self.machines as usize) as u16),
                *a,
                &mut buf,
            )?;
            let v = &buf[8..];
            let key = u64::from_le_bytes(v[..8].try_into().expect("8 bytes"));
            anyhow::ensure!(key == k as u64, "key {k} holds the value of key {key}");
            let version = v
                .get(8..16)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8")));
            anyhow::ensure!(
                *v == value(k as u64, version.unwrap_or(0), self.value_bytes)[..],
                "key {k}: a torn value"
            );
        }
        Ok(())
    }
}

/// The value a PUT of `key` writes: the key, a counter, then bytes derived from both (so that
/// a torn value shows).
fn value(key: u64, counter: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&key.to_le_bytes());
    v.extend_from_slice(&counter.to_le_bytes());
    v.resize(len.max(16), 0);
    let fill = (key ^ counter.rotate_left(17)) as u8;
    for b in &mut v[16..] {
        *b = fill;
    }
    v.truncate(len);
    v
}

impl Workload for Ycsb {
    fn kinds(&self) -> Vec<&'static str> {
        KINDS.to_vec()
    }

    fn mix_percent(&self, kind: usize) -> u64 {
        match kind {
            0 => 100 - self.mix.put_percent(),
            _ => self.mix.put_percent(),
        }
    }

    fn run_one(
        &self,
        session: &Session<'_>,
        _client: usize,
        rng: &mut Rand,
        down: &[bool],
        attempts: &mut u64,
    ) -> (usize, Result<bool, TxError>) {
        let put = rng.next_u64() % 100 < self.mix.put_percent();
        let k = self.zipf.item(rng);
        let a = self.keys[k as usize];
        let primary = MachineId((k % self.machines as u64) as u16);
        let alive = |m: MachineId| !down[m.0 as usize];
        if put {
            let counter = rng.next_u64();
            let v = value(k, counter, self.value_bytes);
            let m = if alive(primary) {
                primary
            } else {
                pick_alive(down, rng.next_u64())
            };
            let r = session.txn(m, |tx| {
                *attempts += 1;
                tx.write_bytes(a, &v)
            });
            (1, r.map(|()| true))
        } else {
            *attempts += 1;
            let mut buf = [0u8; 8 + 1024];
            let len = (8 + self.value_bytes).min(buf.len());
            let r = session.read_bytes_into(pick_alive(down, rng.next_u64()), a, &mut buf[..len]);
            (0, r.map(|()| true))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generator follows the distribution: ranks 0 and 1 exactly (within 4 standard
    /// deviations), the mass of the top 10, 100 and 1,000 ranks within 6% (from rank 2 on the
    /// generator approximates, Gray et al.; YCSB's does the same).
    #[test]
    fn zipf_ranks_follow_the_distribution() {
        let z = Zipf::new(10_000, 0.99);
        let mut rng = Rand::new(7);
        let n = 400_000u64;
        let mut counts = vec![0u64; 10_000];
        for _ in 0..n {
            counts[z.rank(&mut rng) as usize] += 1;
        }
        for (r, drawn) in counts.iter().enumerate().take(2) {
            let p = z.probability(r as u64);
            let expected = p * n as f64;
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            assert!(
                (*drawn as f64 - expected).abs() <= 4.0 * sd,
                "rank {r}: {drawn} draws, expected {expected:.0}"
            );
        }
        for k in [10, 100, 1_000] {
            let drawn = counts[..k].iter().sum::<u64>() as f64 / n as f64;
            let p: f64 = (0..k as u64).map(|r| z.probability(r)).sum();
            assert!(
                (drawn / p - 1.0).abs() <= 0.06,
                "top {k} ranks: {drawn:.4} of draws, expected {p:.4}"
            );
        }
    }

    #[test]
    fn values_carry_their_key_and_counter() {
        let v = value(5, 9, 100);
        assert_eq!(v.len(), 100);
        assert_eq!(u64::from_le_bytes(v[..8].try_into().unwrap()), 5);
        assert_eq!(u64::from_le_bytes(v[8..16].try_into().unwrap()), 9);
        assert_ne!(value(5, 10, 100), v);
        assert_eq!(value(3, 1, 8).len(), 8);
    }
}
