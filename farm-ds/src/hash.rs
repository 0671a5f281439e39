//! A partitioned hash table on farm's transactions.
//!
//! FaRM's TATP and TPC-C tables are hash tables whose lookups are usually a single one-sided
//! read (§6). Here a table is a fixed set of *buckets*, each one farm object holding up to
//! `slots` entries inline (key and value bytes) behind an 8-byte header: the number of keys whose
//! home is this bucket but which live in a later one (`overflow`), and a bitmap of used slots. A
//! key's home bucket follows from its hash within its *partition*; a full home bucket spills the
//! entry into one of the next [`PROBE_BUCKETS`] buckets of the partition (linear probing by
//! bucket) and counts it in the home's overflow. So:
//!
//! - a lookup reads the home bucket and is done unless the home overflowed (then it reads on
//!   until it has seen as many spilled keys of that home as the home counts);
//! - [`HashTable::get`] reads the home bucket with a lock-free read (one consistent object
//!   read, §3) and falls back to a read-only transaction only when the home overflowed, since
//!   reads of several buckets are consistent only in a transaction;
//! - inserts, updates and removes run in the caller's transaction and write whole buckets, so
//!   they are strictly serializable with everything else, and conflict only on shared buckets;
//! - each partition's buckets live in regions of the machine the [`TableSpec`] names for it, so
//!   a key's partition decides where it lives (a locality hint: transactions coordinated there
//!   read it locally, and [`HashTable::partition_hint`] places other objects next to it);
//! - capacity is fixed at creation: an insert that finds its home and the next buckets full
//!   aborts with an error that says so, instead of growing.
//!
//! The table's shape and bucket addresses are stored in farm objects too (a root, the page lists
//! it names and the directory pages they name), so [`HashTable::open`] gives another handle on
//! the same table from its root address.

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use farm::{ready, Addr, Client, MachineId, Pipeline, Transaction, TxError, Txn};

/// Buckets after its home that an entry may spill into. Spilling to the next buckets clusters
/// entries: in a simulation of 200,000 slots, the first insert that found its home and the next
/// buckets full came at about 75% of capacity with 4-entry buckets and 32 buckets of probing
/// (at about 64% with 16, and 55% with 8).
pub const PROBE_BUCKETS: u32 = 32;

/// Most entries per bucket (the used-slot bitmap is 32 bits).
pub const SLOTS_MAX: u8 = 32;

/// Bytes of a bucket before its slots: overflow count, used-slot bitmap.
const BUCKET_HEADER_BYTES: usize = 8;

/// Largest bucket: an object's payload.
const BUCKET_BYTES_MAX: usize = 16 * 1024 - 8;

/// Bucket addresses per directory page.
const DIR_PAGE_ADDRS: usize = 1024;

/// Allocation of buckets at creation: bytes of buckets per transaction.
const CREATE_TXN_BYTES: usize = 32 * 1024;

/// Bytes a log record spends on each object it writes beyond the payload (its address, the
/// header read, flags and length), with room to spare: a transaction of many small buckets
/// outgrew a record when only payloads counted.
const ENTRY_OVERHEAD_BYTES: usize = 32;

/// First word of a table's root object (a root that listed the directory pages themselves
/// began with `farmhash`).
const ROOT_MAGIC: u64 = u64::from_le_bytes(*b"farmhsh2");

/// Words of the root before the addresses of its page lists.
const ROOT_HEADER_WORDS: usize = 6;

/// Directory page addresses per page list: the root lists page lists, which list the
/// directory pages (partition after partition), which list the buckets. A root that listed
/// the pages themselves held at most about 2,000, which TPC-C's STOCK outgrew at seven
/// warehouses on three machines.
const LIST_ADDRS: usize = BUCKET_BYTES_MAX / 8;

/// The shape of a new table.
#[derive(Clone, Debug)]
pub struct TableSpec {
    /// The machine whose regions hold each partition's buckets (one entry per partition).
    pub partitions: Vec<MachineId>,
    /// Buckets per partition.
    pub buckets: u32,
    /// Entries per bucket, 1 to [`SLOTS_MAX`].
    pub slots: u8,
}

impl TableSpec {
    /// Bytes of the buckets [`HashTable::create`] allocates for one partition of a table of
    /// these key and value sizes: each bucket an object with its 8-byte header, counted at the
    /// power of two at or above (no allocator slot is larger). Entries beyond a bucket's slots
    /// go to overflow buckets allocated as they come.
    pub fn bytes_per_partition<K: Pod, V: Pod>(&self) -> u64 {
        let object = (bucket_bytes::<K, V>(self.slots as usize) + 8).next_power_of_two();
        self.buckets as u64 * object as u64
    }

    /// Directory pages that list one partition's buckets: a partition's pages are its own,
    /// so that each machine can create its partitions ([`HashTable::create_partition`]).
    pub fn pages_per_partition(&self) -> usize {
        (self.buckets as usize).div_ceil(DIR_PAGE_ADDRS)
    }

    /// A table for `capacity` entries spread over `partitions`, with buckets of `slots`
    /// entries: twice as many slots as entries, so that inserts do not run out of room before
    /// `capacity` even where hashing is uneven (an insert fails when its home bucket and the
    /// next [`PROBE_BUCKETS`] are full; see there).
    pub fn with_capacity(partitions: Vec<MachineId>, capacity: u64, slots: u8) -> Self {
        let n = partitions.len().max(1) as u64;
        let per_partition = capacity.div_ceil(n);
        let buckets = (per_partition * 2).div_ceil(slots.max(1) as u64).max(1);
        Self {
            partitions,
            buckets: buckets.min(u32::MAX as u64) as u32,
            slots,
        }
    }
}

/// Refuses a spec [`HashTable::create`] cannot make for `K` and `V` on `cluster`, saying why.
fn check_spec<K: Pod, V: Pod>(cluster: &impl Client, spec: &TableSpec) -> Result<(), TxError> {
    let invalid = |why: String| Err(TxError::Aborted(format!("hash table spec: {why}")));
    if spec.partitions.is_empty() {
        return invalid("no partitions".into());
    }
    if spec.slots == 0 || spec.slots > SLOTS_MAX {
        return invalid(format!(
            "{} slots per bucket; 1 to {SLOTS_MAX} are possible",
            spec.slots
        ));
    }
    if spec.buckets == 0 {
        return invalid("no buckets".into());
    }
    let bucket_bytes = bucket_bytes::<K, V>(spec.slots as usize);
    if bucket_bytes > BUCKET_BYTES_MAX {
        return invalid(format!(
            "a bucket of {} entries of {} bytes is {bucket_bytes} bytes, more than an \
             object's {BUCKET_BYTES_MAX}; use fewer slots",
            spec.slots,
            slot_bytes::<K, V>()
        ));
    }
    if let Some(m) = spec.partitions.iter().find(|m| m.0 >= cluster.machines()) {
        return invalid(format!("partition on machine {m}, which does not exist"));
    }
    let pages = spec.partitions.len() * spec.pages_per_partition();
    if ROOT_HEADER_WORDS + pages.div_ceil(LIST_ADDRS) > BUCKET_BYTES_MAX / 8 {
        return invalid(format!(
            "{} partitions of {} buckets need {pages} directory pages, more than a root holds",
            spec.partitions.len(),
            spec.buckets
        ));
    }
    Ok(())
}

/// Which partition a key belongs to.
pub type Partitioner<K> = Arc<dyn Fn(&K) -> usize + Send + Sync>;

/// A handle on a hash table from `K` to `V` (plain-old-data types; keys compare by their bytes).
/// Cheap to clone; every clone works on the same table.
pub struct HashTable<K, V> {
    root: Addr,
    slots: usize,
    buckets: u32,
    /// Bucket addresses, partition after partition.
    dir: Arc<Vec<Addr>>,
    partitioner: Partitioner<K>,
    _types: PhantomData<fn() -> (K, V)>,
}

impl<K, V> Clone for HashTable<K, V> {
    fn clone(&self) -> Self {
        Self {
            root: self.root,
            slots: self.slots,
            buckets: self.buckets,
            dir: self.dir.clone(),
            partitioner: self.partitioner.clone(),
            _types: PhantomData,
        }
    }
}

impl<K, V> std::fmt::Debug for HashTable<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HashTable")
            .field("root", &self.root)
            .field("buckets total", &self.dir.len())
            .field("buckets", &self.buckets)
            .field("slots", &self.slots)
            .finish()
    }
}

/// Where a key is, or where it may go. The buckets' bytes stay in the transaction (reading
/// one again there is a lookup, not a copy).
struct Found {
    /// Index (in the probe sequence) and address of the bucket holding the key.
    at: Option<(u32, Addr, usize)>,
    /// The home bucket's address.
    home: Addr,
    /// The first bucket read with a free slot: index in the probe sequence and address.
    room: Option<(u32, Addr)>,
}

impl<K: Pod, V: Pod> HashTable<K, V> {
    /// Creates an empty table shaped by `spec`: every partition's buckets in regions of its
    /// machine, the root and directory on the first partition's machine. Keys go to partitions
    /// by their hash; see [`HashTable::with_partitioner`].
    pub fn create(cluster: &impl Client, spec: &TableSpec) -> Result<Self, TxError> {
        let mut dir = Vec::new();
        let mut pages = Vec::with_capacity(spec.partitions.len());
        for partition in 0..spec.partitions.len() {
            let (buckets, p) = Self::alloc_partition(cluster, spec, partition)?;
            dir.extend(buckets);
            pages.push(p);
        }
        let root = Self::create_root(cluster, spec, &pages)?;
        Ok(Self::from_parts(
            root,
            spec.slots as usize,
            spec.buckets,
            dir,
        ))
    }

    /// The first half of [`HashTable::create`], for one partition: allocates partition
    /// `partition`'s empty buckets in regions of its machine, and the directory pages that list
    /// them ([`TableSpec::pages_per_partition`]), which it returns for
    /// [`HashTable::create_root`]. The machines of a cluster can each create their own
    /// partitions at once, where they are primaries.
    pub fn create_partition(
        cluster: &impl Client,
        spec: &TableSpec,
        partition: usize,
    ) -> Result<Vec<Addr>, TxError> {
        Ok(Self::alloc_partition(cluster, spec, partition)?.1)
    }

    /// The second half of [`HashTable::create`]: the table's root, on the first partition's
    /// machine, from every partition's directory pages ([`HashTable::create_partition`], by
    /// partition). [`HashTable::open`] opens it.
    pub fn create_root(
        cluster: &impl Client,
        spec: &TableSpec,
        pages: &[Vec<Addr>],
    ) -> Result<Addr, TxError> {
        check_spec::<K, V>(cluster, spec)?;
        let per_partition = spec.pages_per_partition();
        if pages.len() != spec.partitions.len() || pages.iter().any(|p| p.len() != per_partition) {
            return Err(TxError::Aborted(format!(
                "hash table root: {} partitions of {per_partition} directory pages each, not \
                 {:?}",
                spec.partitions.len(),
                pages.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        let listed: Vec<u8> = pages
            .iter()
            .flatten()
            .flat_map(|a| a.to_u64().to_le_bytes())
            .collect();
        let lists = listed
            .chunks(LIST_ADDRS * 8)
            .map(|list| cluster.txn(spec.partitions[0], |tx| tx.alloc_bytes(list, None)))
            .collect::<Result<Vec<Addr>, _>>()?;
        let mut root = Vec::with_capacity((ROOT_HEADER_WORDS + lists.len()) * 8);
        for word in [
            ROOT_MAGIC,
            std::mem::size_of::<K>() as u64,
            std::mem::size_of::<V>() as u64,
            spec.partitions.len() as u64,
            spec.buckets as u64,
            spec.slots as u64,
        ] {
            root.extend_from_slice(&word.to_le_bytes());
        }
        for a in &lists {
            root.extend_from_slice(&a.to_u64().to_le_bytes());
        }
        cluster.txn(spec.partitions[0], |tx| tx.alloc_bytes(&root, None))
    }

    /// Partition `partition`'s buckets and directory pages.
    fn alloc_partition(
        cluster: &impl Client,
        spec: &TableSpec,
        partition: usize,
    ) -> Result<(Vec<Addr>, Vec<Addr>), TxError> {
        check_spec::<K, V>(cluster, spec)?;
        let machine = *spec.partitions.get(partition).ok_or_else(|| {
            TxError::Aborted(format!(
                "hash table spec: no partition {partition} of {}",
                spec.partitions.len()
            ))
        })?;
        let bucket_bytes = bucket_bytes::<K, V>(spec.slots as usize);
        let empty = vec![0u8; bucket_bytes];
        let per_txn = (CREATE_TXN_BYTES / (bucket_bytes + ENTRY_OVERHEAD_BYTES)).max(1);
        let mut buckets = Vec::with_capacity(spec.buckets as usize);
        let mut left = spec.buckets as usize;
        while left > 0 {
            let n = left.min(per_txn);
            buckets.extend(cluster.txn(machine, |tx| tx.alloc_bytes_many(&empty, n, None))?);
            left -= n;
        }
        let mut pages = Vec::with_capacity(spec.pages_per_partition());
        for page in buckets.chunks(DIR_PAGE_ADDRS) {
            let bytes: Vec<u8> = page.iter().flat_map(|a| a.to_u64().to_le_bytes()).collect();
            pages.push(cluster.txn(machine, |tx| tx.alloc_bytes(&bytes, None))?);
        }
        Ok((buckets, pages))
    }

    /// A handle on the table whose root is at `root` (see [`HashTable::root`]), read through
    /// `machine`. Fails if `root` is not a table of these key and value sizes.
    pub fn open(cluster: &impl Client, machine: MachineId, root: Addr) -> Result<Self, TxError> {
        cluster.txn(machine, |tx| {
            let header = tx.read_bytes(root, ROOT_HEADER_WORDS * 8)?.to_vec();
            let word = |i: usize| u64::from_le_bytes(header[i * 8..i * 8 + 8].try_into().unwrap());
            let [magic, k, v, partitions, buckets, slots] = std::array::from_fn(word);
            if magic != ROOT_MAGIC {
                return Err(tx.abort(format!("{root:?} is not the root of a hash table")));
            }
            if (k, v)
                != (
                    std::mem::size_of::<K>() as u64,
                    std::mem::size_of::<V>() as u64,
                )
            {
                return Err(tx.abort(format!(
                    "the table at {root:?} maps {k}-byte keys to {v}-byte values, not {} to {}",
                    std::mem::size_of::<K>(),
                    std::mem::size_of::<V>()
                )));
            }
            let addrs = |bytes: &[u8]| -> Vec<Addr> {
                bytes
                    .chunks(8)
                    .map(|c| Addr::from_u64(u64::from_le_bytes(c.try_into().unwrap())))
                    .collect()
            };
            let per_partition = (buckets as usize).div_ceil(DIR_PAGE_ADDRS);
            let pages = partitions as usize * per_partition;
            let lists = pages.div_ceil(LIST_ADDRS);
            let words = tx
                .read_bytes(root, (ROOT_HEADER_WORDS + lists) * 8)?
                .to_vec();
            let mut page_addrs = Vec::with_capacity(pages);
            for (j, list) in addrs(&words[ROOT_HEADER_WORDS * 8..])
                .into_iter()
                .enumerate()
            {
                let n = (pages - j * LIST_ADDRS).min(LIST_ADDRS);
                page_addrs.extend(addrs(tx.read_bytes(list, n * 8)?));
            }
            let mut dir = Vec::with_capacity((partitions * buckets) as usize);
            for (i, page) in page_addrs.into_iter().enumerate() {
                // Each partition's pages list its buckets alone, the last one the rest.
                let first = (i % per_partition) * DIR_PAGE_ADDRS;
                let n = (buckets as usize - first).min(DIR_PAGE_ADDRS);
                dir.extend(addrs(tx.read_bytes(page, n * 8)?));
            }
            Ok(Self::from_parts(root, slots as usize, buckets as u32, dir))
        })
    }

    fn from_parts(root: Addr, slots: usize, buckets: u32, dir: Vec<Addr>) -> Self {
        let partitions = dir.len() / buckets as usize;
        Self {
            root,
            slots,
            buckets,
            dir: Arc::new(dir),
            partitioner: Arc::new(move |k: &K| {
                (hash_key(bytemuck::bytes_of(k)) >> 32) as usize % partitions
            }),
            _types: PhantomData,
        }
    }

    /// The same handle with keys sent to partitions by `partitioner` (whose results are taken
    /// modulo the number of partitions): keys that transactions use together can share a
    /// partition, and so a machine (TPC-C's warehouses, say).
    pub fn with_partitioner(
        mut self,
        partitioner: impl Fn(&K) -> usize + Send + Sync + 'static,
    ) -> Self {
        self.partitioner = Arc::new(partitioner);
        self
    }

    /// The address of the table's root, from which [`HashTable::open`] opens it.
    pub fn root(&self) -> Addr {
        self.root
    }

    /// Number of partitions.
    pub fn partitions(&self) -> usize {
        self.dir.len() / self.buckets as usize
    }

    /// Entries the table has room for (an insert may fail earlier, when a home bucket and the
    /// next [`PROBE_BUCKETS`] are full).
    pub fn capacity(&self) -> u64 {
        self.dir.len() as u64 * self.slots as u64
    }

    /// The partition of `key`.
    pub fn partition_of(&self, key: &K) -> usize {
        (self.partitioner)(key) % self.partitions()
    }

    /// An address in `partition` to pass as a locality hint ([`Txn::alloc`]'s `near`), so that
    /// an object lands next to the partition's entries.
    pub fn partition_hint(&self, partition: usize) -> Addr {
        self.dir[partition * self.buckets as usize]
    }

    /// The address of `key`'s home bucket (where a lookup reads first).
    pub fn home_bucket(&self, key: &K) -> Addr {
        let (p, b) = self.home(key);
        self.bucket(p, b)
    }

    /// The home bucket of `key`: its partition and index there.
    fn home(&self, key: &K) -> (usize, u32) {
        let p = self.partition_of(key);
        let b = (hash_key(bytemuck::bytes_of(key)) % self.buckets as u64) as u32;
        (p, b)
    }

    fn bucket(&self, partition: usize, index: u32) -> Addr {
        self.dir[partition * self.buckets as usize + (index % self.buckets) as usize]
    }

    fn bucket_bytes(&self) -> usize {
        bucket_bytes::<K, V>(self.slots)
    }

    /// A hint that `key` will be looked up soon in `tx`: its home bucket starts on its way
    /// ([`Txn::prefetch`]), so that lookups of several keys known ahead overlap.
    pub fn prefetch(&self, tx: &mut impl Transaction, key: &K) {
        tx.prefetch(self.home_bucket(key), self.bucket_bytes());
    }

    /// Looks `key` up in the transaction: its value, if present. The buckets read are validated
    /// at commit like any read.
    pub fn get_in(&self, tx: &mut Txn<'_>, key: &K) -> Result<Option<V>, TxError> {
        ready(self.get_in_async(tx, key))
    }

    /// [`HashTable::get_in`] in any transaction, blocking or among others in flight
    /// ([`farm::Pipeline::txn`]).
    pub async fn get_in_async(
        &self,
        tx: &mut impl Transaction,
        key: &K,
    ) -> Result<Option<V>, TxError> {
        let found = self.find(tx, key, false).await?;
        let Some((_, addr, s)) = found.at else {
            return Ok(None);
        };
        tx.read_with(addr, self.bucket_bytes(), |bytes| {
            Some(read_value::<K, V>(bytes, s))
        })
        .await
    }

    /// Looks `key` up outside any transaction, coordinated on `machine`: one lock-free read of
    /// its home bucket (§3), consistent on its own; when the home bucket overflowed, a
    /// read-only transaction over the buckets the key may be in.
    pub fn get(
        &self,
        cluster: &impl Client,
        machine: MachineId,
        key: &K,
    ) -> Result<Option<V>, TxError> {
        // Blocking, without a pipeline: the lookup path of TPC-C's and other blocking
        // clients' reads (no allocation for buckets up to 1 KB).
        let (p, b) = self.home(key);
        let len = 8 + self.bucket_bytes();
        let mut stack = [0u8; 1024];
        let mut heap = Vec::new();
        let buf: &mut [u8] = if len <= stack.len() {
            &mut stack[..len]
        } else {
            heap.resize(len, 0);
            &mut heap
        };
        cluster.read_bytes_into(machine, self.bucket(p, b), buf)?;
        match self.in_home(&buf[8..], key) {
            Some(found) => Ok(found),
            None => cluster.txn(machine, |tx| self.get_in(tx, key)),
        }
    }

    /// [`HashTable::get`] among the transactions in flight of `pipeline`: the read of the home
    /// bucket is posted, and the others run until it is here.
    pub async fn get_async(
        &self,
        pipeline: &Pipeline<'_>,
        machine: MachineId,
        key: &K,
    ) -> Result<Option<V>, TxError> {
        let (p, b) = self.home(key);
        // As in `get`: no allocation for buckets up to 1 KB.
        let len = 8 + self.bucket_bytes();
        let mut stack = [0u8; 1024];
        let mut heap = Vec::new();
        let buf: &mut [u8] = if len <= stack.len() {
            &mut stack[..len]
        } else {
            heap.resize(len, 0);
            &mut heap
        };
        pipeline
            .read_bytes_into(machine, self.bucket(p, b), buf)
            .await?;
        match self.in_home(&buf[8..], key) {
            Some(found) => Ok(found),
            None => {
                pipeline
                    .txn(machine, async |tx| self.get_in_async(tx, key).await)
                    .await
            }
        }
    }

    /// What a lock-free read of `key`'s home `bucket` says: its value or its absence, or
    /// `None` when the home overflowed and the key may be in a later bucket.
    fn in_home(&self, bucket: &[u8], key: &K) -> Option<Option<V>> {
        if let Some(s) = self.slot_of(bucket, key) {
            return Some(Some(read_value::<K, V>(bucket, s)));
        }
        (overflow(bucket) == 0).then_some(None)
    }

    /// Inserts `key` with `value` in the transaction. Returns false, changing nothing, when
    /// the key is already there. Aborts the transaction with an error saying so when the
    /// key's home bucket and the next [`PROBE_BUCKETS`] are full.
    pub fn insert(&self, tx: &mut Txn<'_>, key: &K, value: &V) -> Result<bool, TxError> {
        ready(self.insert_async(tx, key, value))
    }

    /// [`HashTable::insert`] in any transaction.
    pub async fn insert_async(
        &self,
        tx: &mut impl Transaction,
        key: &K,
        value: &V,
    ) -> Result<bool, TxError> {
        let found = self.find(tx, key, true).await?;
        if found.at.is_some() {
            return Ok(false);
        }
        let (p, b) = self.home(key);
        let Some((i, addr)) = found.room else {
            return Err(tx.abort(format!(
                "hash table {:?} is full where {:?} goes: bucket {b} of partition {p} and the \
                 next {PROBE_BUCKETS} hold {} entries each ({} entries in all); create it with \
                 more buckets",
                self.root,
                bytemuck::bytes_of(key),
                self.slots,
                self.capacity()
            )));
        };
        let len = self.bucket_bytes();
        let mut bytes = tx.read_with(addr, len, <[u8]>::to_vec).await?;
        let s = (!used(&bytes)).trailing_zeros() as usize;
        write_slot::<K, V>(&mut bytes, s, key, value);
        let bits = used(&bytes) | 1 << s;
        set_used(&mut bytes, bits);
        tx.write_bytes(addr, &bytes).await?;
        if i > 0 {
            self.count_spilled(tx, found.home, true).await?;
        }
        Ok(true)
    }

    /// Replaces the value of `key` in the transaction. Returns false, changing nothing, when
    /// the key is not there.
    pub fn update(&self, tx: &mut Txn<'_>, key: &K, value: &V) -> Result<bool, TxError> {
        ready(self.update_async(tx, key, value))
    }

    /// [`HashTable::update`] in any transaction.
    pub async fn update_async(
        &self,
        tx: &mut impl Transaction,
        key: &K,
        value: &V,
    ) -> Result<bool, TxError> {
        let found = self.find(tx, key, false).await?;
        let Some((_, addr, s)) = found.at else {
            return Ok(false);
        };
        let mut bytes = tx
            .read_with(addr, self.bucket_bytes(), <[u8]>::to_vec)
            .await?;
        write_slot::<K, V>(&mut bytes, s, key, value);
        tx.write_bytes(addr, &bytes).await?;
        Ok(true)
    }

    /// Removes `key` in the transaction, returning its value if it was there.
    pub fn remove(&self, tx: &mut Txn<'_>, key: &K) -> Result<Option<V>, TxError> {
        ready(self.remove_async(tx, key))
    }

    /// [`HashTable::remove`] in any transaction.
    pub async fn remove_async(
        &self,
        tx: &mut impl Transaction,
        key: &K,
    ) -> Result<Option<V>, TxError> {
        let found = self.find(tx, key, false).await?;
        let Some((i, addr, s)) = found.at else {
            return Ok(None);
        };
        let len = self.bucket_bytes();
        let mut bytes = tx.read_with(addr, len, <[u8]>::to_vec).await?;
        let value = read_value::<K, V>(&bytes, s);
        let bits = used(&bytes) & !(1 << s);
        set_used(&mut bytes, bits);
        tx.write_bytes(addr, &bytes).await?;
        if i > 0 {
            self.count_spilled(tx, found.home, false).await?;
        }
        Ok(Some(value))
    }

    /// Counts one more (`more`) or one fewer key spilled from the bucket at `home` in its
    /// overflow count.
    async fn count_spilled(
        &self,
        tx: &mut impl Transaction,
        home: Addr,
        more: bool,
    ) -> Result<(), TxError> {
        let mut bytes = tx
            .read_with(home, self.bucket_bytes(), <[u8]>::to_vec)
            .await?;
        let n = if more {
            overflow(&bytes) + 1
        } else {
            overflow(&bytes) - 1
        };
        set_overflow(&mut bytes, n);
        tx.write_bytes(home, &bytes).await
    }

    /// Finds `key`: reads its home bucket, then, while the home counts spilled keys not yet
    /// seen, the next buckets. With `for_insert`, reads on until a bucket with a free slot is
    /// among those read (or the probe limit).
    async fn find(
        &self,
        tx: &mut impl Transaction,
        key: &K,
        for_insert: bool,
    ) -> Result<Found, TxError> {
        let (p, b) = self.home(key);
        let len = self.bucket_bytes();
        let home = self.bucket(p, b);
        let mut spilled_seen = 0u32;
        let mut spilled = 0u32;
        let mut room = None;
        for j in 0..=PROBE_BUCKETS.min(self.buckets - 1) {
            let addr = self.bucket(p, b + j);
            let (overflowed, homed, free, slot) = tx
                .read_with(addr, len, |bytes| {
                    (
                        (j == 0).then(|| overflow(bytes)),
                        (j > 0).then(|| self.homed_at(bytes, p, b)),
                        used(bytes).count_ones() < self.slots as u32,
                        self.slot_of(bytes, key),
                    )
                })
                .await?;
            if let Some(n) = overflowed {
                spilled = n;
            }
            spilled_seen += homed.unwrap_or(0);
            if room.is_none() && free {
                room = Some((j, addr));
            }
            if let Some(s) = slot {
                return Ok(Found {
                    at: Some((j, addr, s)),
                    home,
                    room,
                });
            }
            let all_seen = spilled_seen >= spilled;
            if all_seen && (!for_insert || room.is_some()) {
                break;
            }
        }
        Ok(Found {
            at: None,
            home,
            room,
        })
    }

    /// The slot of `bucket` holding `key`.
    fn slot_of(&self, bucket: &[u8], key: &K) -> Option<usize> {
        let used = used(bucket);
        let key = bytemuck::bytes_of(key);
        let sb = slot_bytes::<K, V>();
        (0..self.slots).find(|s| {
            used & (1 << s) != 0 && {
                let at = BUCKET_HEADER_BYTES + s * sb;
                &bucket[at..at + key.len()] == key
            }
        })
    }

    /// How many entries of `bucket` have their home at bucket `home` of `partition`.
    fn homed_at(&self, bucket: &[u8], partition: usize, home: u32) -> u32 {
        let used = used(bucket);
        let sb = slot_bytes::<K, V>();
        let klen = std::mem::size_of::<K>();
        (0..self.slots)
            .filter(|s| used & (1 << s) != 0)
            .filter(|s| {
                let at = BUCKET_HEADER_BYTES + s * sb;
                let key: K = bytemuck::pod_read_unaligned(&bucket[at..at + klen]);
                self.home(&key) == (partition, home)
            })
            .count() as u32
    }
}

fn slot_bytes<K, V>() -> usize {
    (std::mem::size_of::<K>() + std::mem::size_of::<V>()).div_ceil(8) * 8
}

fn bucket_bytes<K, V>(slots: usize) -> usize {
    BUCKET_HEADER_BYTES + slots * slot_bytes::<K, V>()
}

fn overflow(bucket: &[u8]) -> u32 {
    u32::from_le_bytes(bucket[0..4].try_into().unwrap())
}

fn set_overflow(bucket: &mut [u8], n: u32) {
    bucket[0..4].copy_from_slice(&n.to_le_bytes());
}

fn used(bucket: &[u8]) -> u32 {
    u32::from_le_bytes(bucket[4..8].try_into().unwrap())
}

fn set_used(bucket: &mut [u8], bits: u32) {
    bucket[4..8].copy_from_slice(&bits.to_le_bytes());
}

fn write_slot<K: Pod, V: Pod>(bucket: &mut [u8], slot: usize, key: &K, value: &V) {
    let at = BUCKET_HEADER_BYTES + slot * slot_bytes::<K, V>();
    let k = bytemuck::bytes_of(key);
    bucket[at..at + k.len()].copy_from_slice(k);
    let v = bytemuck::bytes_of(value);
    bucket[at + k.len()..at + k.len() + v.len()].copy_from_slice(v);
}

fn read_value<K: Pod, V: Pod>(bucket: &[u8], slot: usize) -> V {
    let at = BUCKET_HEADER_BYTES + slot * slot_bytes::<K, V>() + std::mem::size_of::<K>();
    bytemuck::pod_read_unaligned(&bucket[at..at + std::mem::size_of::<V>()])
}

/// A 64-bit hash of a key's bytes, the same in every process (buckets are found by it).
fn hash_key(bytes: &[u8]) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64 ^ bytes.len() as u64;
    for chunk in bytes.chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = (h ^ u64::from_le_bytes(word)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 31;
    }
    // splitmix64's finalizer.
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}
