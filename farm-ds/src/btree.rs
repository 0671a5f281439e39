//! A B+-tree on farm's transactions, for ordered indexes and range scans (FaRM §6: TPC-C's
//! ordered indexes).
//!
//! Every node is one farm object. Leaves hold sorted entries and the address of the next leaf;
//! internal nodes hold sorted separator keys and children. Every node also holds its *fence
//! keys*: the key range `[low, high)` it covers. Nodes never merge, so a key's range only ever
//! narrows, by splits.
//!
//! Lookups use a cache of internal nodes kept by each handle: the descent to a leaf reads no
//! internal node when the cache has the path, and then reads the leaf inside the transaction,
//! where commit validates it. A stale cache can only lead to a leaf whose fences do not cover
//! the key (a split moved it), or round in a circle (nodes cached at different times, one at
//! an address freed and taken again since); either is seen at once, the cached path is
//! dropped, and the descent is redone with reads in the transaction. So a lookup is usually
//! one remote read, and what the transaction sees is exactly what a descent inside it would
//! see.
//!
//! Inserts split full nodes on the way back up, in the same transaction; a full root becomes two
//! children of a new root, whose address the tree's meta object holds.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use bytemuck::Pod;
use farm::{ready, Addr, Client, Conflict, MachineId, Transaction, TxError, Txn};

/// Most bytes of a node.
const NODE_BYTES_MAX: usize = 4096;

/// First word of the meta object.
const META_MAGIC: u64 = u64::from_le_bytes(*b"farmbtre");

/// Node header: kind (1: leaf), entries (2 bytes), has-high and has-low flags, padding, next
/// leaf, and the tree's meta address (a cached address that went stale may now hold anything:
/// a node of this tree is recognised by it).
const NODE_HEADER_BYTES: usize = 24;

/// A node, decoded.
#[derive(Clone, Debug)]
struct Node<K, V> {
    leaf: bool,
    /// `None`: unbounded.
    low: Option<K>,
    /// `None`: unbounded.
    high: Option<K>,
    keys: Vec<K>,
    /// Leaves: one value per key.
    values: Vec<V>,
    /// Internal nodes: one more child than keys; child `i` covers keys below `keys[i]`.
    children: Vec<Addr>,
    /// Leaves: the next leaf, if any.
    next: Option<Addr>,
    /// The meta address of the tree the node belongs to.
    tree: u64,
}

/// A handle on a B+-tree from `K` to `V` (plain-old-data types; keys ordered by `Ord`). Cheap
/// to clone; clones share the cache of internal nodes.
pub struct BTree<K, V> {
    meta: Addr,
    /// Entries per node.
    fanout: usize,
    cache: Arc<Mutex<Cache<K, V>>>,
    /// Objects (nodes and the meta object) this handle and its clones read.
    reads: Arc<std::sync::atomic::AtomicU64>,
    _types: PhantomData<fn() -> (K, V)>,
}

/// Internal nodes as last read, and the root's address as last read.
struct Cache<K, V> {
    root: Option<Addr>,
    nodes: HashMap<Addr, Node<K, V>>,
}

impl<K, V> Cache<K, V> {
    fn new() -> Self {
        Self {
            root: None,
            nodes: HashMap::new(),
        }
    }
}

impl<K, V> Clone for BTree<K, V> {
    fn clone(&self) -> Self {
        Self {
            meta: self.meta,
            fanout: self.fanout,
            cache: self.cache.clone(),
            reads: self.reads.clone(),
            _types: PhantomData,
        }
    }
}

impl<K, V> std::fmt::Debug for BTree<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BTree")
            .field("meta", &self.meta)
            .field("fanout", &self.fanout)
            .finish()
    }
}

impl<K: Pod + Ord, V: Pod> BTree<K, V> {
    /// The most entries per node for these key and value sizes.
    pub fn max_fanout() -> usize {
        let k = std::mem::size_of::<K>();
        // `fanout + 1` slots of a key and the larger of a value and a child address (see
        // `node_bytes`), with one more child address.
        let per = k + std::mem::size_of::<V>().max(8);
        (NODE_BYTES_MAX - NODE_HEADER_BYTES - 2 * k - 8) / per - 1
    }

    /// Creates an empty tree whose nodes hold up to `fanout` entries (at least 3, at most
    /// [`BTree::max_fanout`]), coordinated on `machine`: its objects are allocated there or near
    /// `near`.
    pub fn create(
        cluster: &impl Client,
        machine: MachineId,
        fanout: usize,
        near: Option<Addr>,
    ) -> Result<Self, TxError> {
        let max = Self::max_fanout();
        if !(3..=max).contains(&fanout) {
            return Err(TxError::Aborted(format!(
                "B-tree fanout {fanout}: 3 to {max} entries fit a node for these key and value \
                 sizes"
            )));
        }
        let tree = Self {
            meta: Addr::new(farm::RegionId(0), 0),
            fanout,
            cache: Arc::new(Mutex::new(Cache::new())),
            reads: Arc::default(),
            _types: PhantomData,
        };
        let meta = cluster.txn(machine, |tx| {
            let mut meta = Vec::with_capacity(24);
            meta.extend_from_slice(&META_MAGIC.to_le_bytes());
            meta.extend_from_slice(&(fanout as u64).to_le_bytes());
            meta.extend_from_slice(&0u64.to_le_bytes());
            let at = tx.alloc_bytes(&meta, near)?;
            // Nodes carry the meta address: the root is encoded by a handle that knows it.
            let named = Self {
                meta: at,
                ..tree.clone()
            };
            let root = Node::<K, V> {
                leaf: true,
                low: None,
                high: None,
                keys: Vec::new(),
                values: Vec::new(),
                children: Vec::new(),
                next: None,
                tree: at.to_u64(),
            };
            let root = tx.alloc_bytes(&named.encode(&root), near)?;
            meta[16..24].copy_from_slice(&root.to_u64().to_le_bytes());
            tx.write_bytes(at, &meta)?;
            Ok(at)
        })?;
        Ok(Self { meta, ..tree })
    }

    /// A handle on the tree whose meta object is at `meta` (see [`BTree::meta`]).
    pub fn open(cluster: &impl Client, machine: MachineId, meta: Addr) -> Result<Self, TxError> {
        let fanout = cluster.txn(machine, |tx| {
            let bytes = tx.read_bytes(meta, 24)?.to_vec();
            if u64::from_le_bytes(bytes[..8].try_into().unwrap()) != META_MAGIC {
                return Err(tx.abort(format!("{meta:?} is not the meta object of a B-tree")));
            }
            Ok(u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize)
        })?;
        if fanout > Self::max_fanout() {
            return Err(TxError::Aborted(format!(
                "the B-tree at {meta:?} has nodes of {fanout} entries, more than fit these key \
                 and value sizes"
            )));
        }
        Ok(Self {
            meta,
            fanout,
            cache: Arc::new(Mutex::new(Cache::new())),
            reads: Arc::default(),
            _types: PhantomData,
        })
    }

    /// The address of the tree's meta object.
    pub fn meta(&self) -> Addr {
        self.meta
    }

    /// Objects (nodes and the meta object) read so far through this handle and its clones:
    /// with a warm cache, a lookup reads one (its leaf).
    pub fn objects_read(&self) -> u64 {
        self.reads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The value of `key`, in the transaction.
    pub fn get(&self, tx: &mut Txn<'_>, key: &K) -> Result<Option<V>, TxError> {
        ready(self.get_in_async(tx, key))
    }

    /// [`BTree::get`] in any transaction, blocking or among others in flight
    /// ([`farm::Pipeline::txn`]).
    pub async fn get_in_async(
        &self,
        tx: &mut impl Transaction,
        key: &K,
    ) -> Result<Option<V>, TxError> {
        let (_, leaf) = self.leaf_for(tx, key).await?;
        Ok(leaf.keys.binary_search(key).ok().map(|i| leaf.values[i]))
    }

    /// Entries with keys in `from..to` (or `from..` without `to`), in key order, at most
    /// `limit`, in the transaction (every leaf read is validated at commit).
    pub fn range(
        &self,
        tx: &mut Txn<'_>,
        from: &K,
        to: Option<&K>,
        limit: usize,
    ) -> Result<Vec<(K, V)>, TxError> {
        ready(self.range_async(tx, from, to, limit))
    }

    /// [`BTree::range`] in any transaction.
    pub async fn range_async(
        &self,
        tx: &mut impl Transaction,
        from: &K,
        to: Option<&K>,
        limit: usize,
    ) -> Result<Vec<(K, V)>, TxError> {
        let (_, mut leaf) = self.leaf_for(tx, from).await?;
        let mut out = Vec::new();
        loop {
            for (k, v) in leaf.keys.iter().zip(&leaf.values) {
                if k < from {
                    continue;
                }
                if to.is_some_and(|t| k >= t) || out.len() == limit {
                    return Ok(out);
                }
                out.push((*k, *v));
            }
            match leaf.next {
                Some(next) if out.len() < limit => leaf = self.read_node(tx, next).await?,
                _ => return Ok(out),
            }
        }
    }

    /// Sets `key` to `value` in the transaction. Returns the previous value.
    pub fn insert(&self, tx: &mut Txn<'_>, key: &K, value: &V) -> Result<Option<V>, TxError> {
        ready(self.insert_async(tx, key, value))
    }

    /// [`BTree::insert`] in any transaction.
    pub async fn insert_async(
        &self,
        tx: &mut impl Transaction,
        key: &K,
        value: &V,
    ) -> Result<Option<V>, TxError> {
        let (at, mut leaf) = self.leaf_for(tx, key).await?;
        let i = match leaf.keys.binary_search(key) {
            Ok(i) => {
                let old = std::mem::replace(&mut leaf.values[i], *value);
                tx.write_bytes(at, &self.encode(&leaf)).await?;
                return Ok(Some(old));
            }
            Err(i) => i,
        };
        if leaf.keys.len() < self.fanout {
            leaf.keys.insert(i, *key);
            leaf.values.insert(i, *value);
            tx.write_bytes(at, &self.encode(&leaf)).await?;
            return Ok(None);
        }
        // The leaf splits: the path up to it is needed, read in the transaction. Execution is
        // not isolated (§4: validation at commit is): the descent may find another version of
        // the leaf (a concurrent split, or the cached path was stale), so the position is
        // found again in what it read.
        let (path, mut leaf) = self.path_for(tx, key).await?;
        match leaf.keys.binary_search(key) {
            // The key appeared since the first read: the transaction cannot commit.
            Ok(_) => return Err(TxError::Conflict(Conflict::Validate)),
            Err(i) => {
                leaf.keys.insert(i, *key);
                leaf.values.insert(i, *value);
            }
        }
        self.store(tx, &path, leaf).await?;
        Ok(None)
    }

    /// Removes `key` in the transaction, returning its value. Nodes do not merge.
    pub fn remove(&self, tx: &mut Txn<'_>, key: &K) -> Result<Option<V>, TxError> {
        ready(self.remove_async(tx, key))
    }

    /// [`BTree::remove`] in any transaction.
    pub async fn remove_async(
        &self,
        tx: &mut impl Transaction,
        key: &K,
    ) -> Result<Option<V>, TxError> {
        let (at, mut leaf) = self.leaf_for(tx, key).await?;
        let Ok(i) = leaf.keys.binary_search(key) else {
            return Ok(None);
        };
        leaf.keys.remove(i);
        let old = leaf.values.remove(i);
        tx.write_bytes(at, &self.encode(&leaf)).await?;
        Ok(Some(old))
    }

    /// The leaf covering `key` and its address: by the cached path when it leads to a leaf
    /// whose fences cover the key, else by a descent read in the transaction.
    async fn leaf_for(
        &self,
        tx: &mut impl Transaction,
        key: &K,
    ) -> Result<(Addr, Node<K, V>), TxError> {
        if let Some(mut at) = self.cached_leaf(key) {
            // From where the cache ends, down to the leaf, reading in the transaction. A cached
            // path may lead anywhere, even to an address freed since (a node that a transaction
            // which then aborted allocated): only nodes of this tree whose fences cover the key
            // will do; anything else means the cache is stale.
            loop {
                match self.read_node(tx, at).await {
                    Ok(node) if node.tree == self.meta.to_u64() && node.covers(key) => {
                        if node.leaf {
                            return Ok((at, node));
                        }
                        let child = node.child_for(key);
                        self.cache.lock().expect("cache").nodes.insert(at, node);
                        at = child;
                    }
                    Ok(_) | Err(TxError::BadAddress { .. }) => break,
                    Err(e) => return Err(e),
                }
            }
            // Never held across a read: another transaction of this thread may want it.
            let mut cache = self.cache.lock().expect("cache");
            cache.nodes.clear();
            cache.root = None;
        }
        let (path, leaf) = self.path_for(tx, key).await?;
        Ok((*path.last().expect("a leaf"), leaf))
    }

    /// The node the cached internal nodes lead to from the cached root (a leaf if the cache
    /// is current), if the cache has a root that covers `key`. Nodes cached at different times
    /// may lead round in a circle (one a transaction wrote and then aborted, whose freed
    /// address a later node took, pointing back at it): a walk longer than the cache has
    /// nodes went round one, and the cache is dropped. It once spun for good on an executor's
    /// thread, and its machine polled nothing more (TPC-C's loading over `tcp`).
    fn cached_leaf(&self, key: &K) -> Option<Addr> {
        let mut cache = self.cache.lock().expect("cache");
        let mut at = cache.root?;
        for _ in 0..=cache.nodes.len() {
            match cache.nodes.get(&at) {
                Some(node) if node.covers(key) => at = node.child_for(key),
                Some(_) => return None,
                None => return Some(at),
            }
        }
        cache.nodes.clear();
        cache.root = None;
        None
    }

    async fn read_root(&self, tx: &mut impl Transaction) -> Result<Addr, TxError> {
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tx.read_with(self.meta, 24, |bytes| {
            Addr::from_u64(u64::from_le_bytes(bytes[16..24].try_into().unwrap()))
        })
        .await
    }

    /// The descent to `key`'s leaf with every node read in the transaction (refreshing the
    /// cache): the addresses from the root to the leaf, and the leaf.
    async fn path_for(
        &self,
        tx: &mut impl Transaction,
        key: &K,
    ) -> Result<(Vec<Addr>, Node<K, V>), TxError> {
        let mut at = self.read_root(tx).await?;
        self.cache.lock().expect("cache").root = Some(at);
        let mut path = vec![at];
        loop {
            let node = self.read_node(tx, at).await?;
            if node.leaf {
                return Ok((path, node));
            }
            let child = node.child_for(key);
            self.cache.lock().expect("cache").nodes.insert(at, node);
            at = child;
            path.push(at);
        }
    }

    /// Writes `node` at the end of `path` (a leaf's), splitting it, and up the path its
    /// parents, when it holds more than `fanout` entries.
    async fn store(
        &self,
        tx: &mut impl Transaction,
        path: &[Addr],
        mut node: Node<K, V>,
    ) -> Result<(), TxError> {
        for level in (0..path.len()).rev() {
            let at = path[level];
            if node.keys.len() <= self.fanout {
                return tx.write_bytes(at, &self.encode(&node)).await;
            }
            // Split: the upper half moves to a new right sibling, next to this node.
            let mid = node.keys.len() / 2;
            let (separator, right) = if node.leaf {
                let keys = node.keys.split_off(mid);
                let values = node.values.split_off(mid);
                let separator = keys[0];
                let right = Node {
                    leaf: true,
                    low: Some(separator),
                    high: node.high,
                    keys,
                    values,
                    children: Vec::new(),
                    next: node.next,
                    tree: node.tree,
                };
                (separator, right)
            } else {
                let mut keys = node.keys.split_off(mid);
                let separator = keys.remove(0);
                let children = node.children.split_off(mid + 1);
                let right = Node {
                    leaf: false,
                    low: Some(separator),
                    high: node.high,
                    keys,
                    values: Vec::new(),
                    children,
                    next: None,
                    tree: node.tree,
                };
                (separator, right)
            };
            node.high = Some(separator);
            let right_at = tx.alloc_bytes(&self.encode(&right), Some(at))?;
            if node.leaf {
                node.next = Some(right_at);
            }
            tx.write_bytes(at, &self.encode(&node)).await?;
            if level == 0 {
                // A new root above the two halves.
                let root = Node::<K, V> {
                    leaf: false,
                    low: node.low,
                    high: None,
                    keys: vec![separator],
                    values: Vec::new(),
                    children: vec![at, right_at],
                    next: None,
                    tree: node.tree,
                };
                let root_at = tx.alloc_bytes(&self.encode(&root), Some(at))?;
                let mut meta = tx.read_with(self.meta, 24, <[u8]>::to_vec).await?;
                meta[16..24].copy_from_slice(&root_at.to_u64().to_le_bytes());
                return tx.write_bytes(self.meta, &meta).await;
            }
            let parent_at = path[level - 1];
            let mut parent = self.read_node(tx, parent_at).await?;
            // Read again in the transaction, the parent may be a version that no longer holds
            // the node (a concurrent split moved it): then the descent's reads cannot validate.
            let Some(i) = parent.children.iter().position(|c| *c == at) else {
                return Err(TxError::Conflict(Conflict::Validate));
            };
            parent.keys.insert(i, separator);
            parent.children.insert(i + 1, right_at);
            node = parent;
        }
        unreachable!("the root's level returns")
    }

    /// Bytes of every node, leaf or internal: room for `fanout + 1` entries (a node holds
    /// one more only on its way to a split, never stored, but its slot is sized at allocation),
    /// so that one read of a known length gets any node.
    fn node_bytes(&self) -> usize {
        Self::node_bytes_for(self.fanout)
    }

    fn node_bytes_for(fanout: usize) -> usize {
        let k = std::mem::size_of::<K>();
        let slots = fanout + 1;
        let leaf = slots * std::mem::size_of::<V>();
        let internal = (slots + 1) * 8;
        NODE_HEADER_BYTES + 2 * k + slots * k + leaf.max(internal)
    }

    /// At most how many bytes a tree of `fanout` holding `entries` takes: a split leaves both
    /// halves at least half full, so there are at most `entries / (fanout / 2) + 1` leaves and
    /// as many internal nodes again, each an object with its 8-byte header counted at the
    /// power of two at or above (no allocator slot is larger), plus the tree's meta object.
    pub fn bytes_for(fanout: usize, entries: u64) -> u64 {
        let half = (fanout as u64 / 2).max(1);
        let nodes = 2 * (entries.div_ceil(half) + 1);
        let node = (Self::node_bytes_for(fanout) + 8).next_power_of_two() as u64;
        nodes * node + 64
    }

    async fn read_node(&self, tx: &mut impl Transaction, at: Addr) -> Result<Node<K, V>, TxError> {
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tx.read_with(at, self.node_bytes(), |bytes| self.decode(bytes))
            .await
    }

    fn encode(&self, node: &Node<K, V>) -> Vec<u8> {
        let mut out = vec![0u8; self.node_bytes()];
        out[0] = node.leaf as u8;
        out[1..3].copy_from_slice(&(node.keys.len() as u16).to_le_bytes());
        out[3] = node.high.is_some() as u8;
        out[4] = node.low.is_some() as u8;
        out[8..16].copy_from_slice(&node.next.map_or(0, Addr::to_u64).to_le_bytes());
        out[16..24].copy_from_slice(&self.meta.to_u64().to_le_bytes());
        let k = std::mem::size_of::<K>();
        let mut at = NODE_HEADER_BYTES;
        let mut put = |bytes: &[u8]| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        put(bytemuck::bytes_of(&node.low.unwrap_or_else(K::zeroed)));
        put(bytemuck::bytes_of(&node.high.unwrap_or_else(K::zeroed)));
        for key in &node.keys {
            put(bytemuck::bytes_of(key));
        }
        let slots = self.fanout + 1;
        let mut at = NODE_HEADER_BYTES + 2 * k + slots * k;
        if node.leaf {
            for v in &node.values {
                let b = bytemuck::bytes_of(v);
                out[at..at + b.len()].copy_from_slice(b);
                at += b.len();
            }
        } else {
            for c in &node.children {
                out[at..at + 8].copy_from_slice(&c.to_u64().to_le_bytes());
                at += 8;
            }
        }
        out
    }

    fn decode(&self, bytes: &[u8]) -> Node<K, V> {
        let leaf = bytes[0] == 1;
        let n = u16::from_le_bytes(bytes[1..3].try_into().unwrap()) as usize;
        let has_high = bytes[3] == 1;
        let has_low = bytes[4] == 1;
        let next = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
        let tree = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
        let k = std::mem::size_of::<K>();
        let key_at = |i: usize| -> K {
            let at = NODE_HEADER_BYTES + i * k;
            bytemuck::pod_read_unaligned(&bytes[at..at + k])
        };
        let low = has_low.then(|| key_at(0));
        let high = has_high.then(|| key_at(1));
        let keys: Vec<K> = (0..n).map(|i| key_at(2 + i)).collect();
        let slots = self.fanout + 1;
        let base = NODE_HEADER_BYTES + 2 * k + slots * k;
        let (values, children) = if leaf {
            let v = std::mem::size_of::<V>();
            let values = (0..n)
                .map(|i| bytemuck::pod_read_unaligned(&bytes[base + i * v..base + (i + 1) * v]))
                .collect();
            (values, Vec::new())
        } else {
            let children = (0..=n)
                .map(|i| {
                    Addr::from_u64(u64::from_le_bytes(
                        bytes[base + i * 8..base + i * 8 + 8].try_into().unwrap(),
                    ))
                })
                .collect();
            (Vec::new(), children)
        };
        Node {
            leaf,
            low,
            high,
            keys,
            values,
            children,
            next: (leaf && next != 0).then(|| Addr::from_u64(next)),
            tree,
        }
    }
}

impl<K: Pod + Ord, V> Node<K, V> {
    /// Whether `key` is in this node's fences.
    fn covers(&self, key: &K) -> bool {
        self.low.as_ref().is_none_or(|l| key >= l) && self.high.as_ref().is_none_or(|h| key < h)
    }

    /// The child covering `key` (internal nodes).
    fn child_for(&self, key: &K) -> Addr {
        let i = self.keys.partition_point(|k| k <= key);
        self.children[i]
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use farm::{Cluster, MachineId};

    use super::BTree;

    /// A cache whose cached internal nodes lead round in a circle: nodes cached at different
    /// times (one a transaction wrote and then aborted, whose freed address a later node took)
    /// can point at each other, each covering the key. The cached walk went round for good,
    /// on the executor's thread, so that its machine polled nothing more and the whole
    /// cluster stopped: TPC-C's loading over `tcp` (`farm-node local tpcc`, a few runs in
    /// ten). A walk longer than the cache has nodes went round: the cache is dropped and the
    /// lookup descends in its transaction.
    #[test]
    fn a_cached_path_that_leads_round_in_a_circle_is_dropped() {
        let c = Cluster::builder()
            .machines(3)
            .workers(1)
            .replicas(3)
            .region_bytes(16 << 20)
            .build()
            .unwrap();
        let m = MachineId(0);
        let t: BTree<u64, u64> = BTree::create(&c, m, 3, None).unwrap();
        for k in 0..200u64 {
            c.txn(m, |tx| t.insert(tx, &k, &(k + 1000))).unwrap();
        }
        // Key 7's path cached.
        assert_eq!(c.txn(m, |tx| t.get(tx, &7)).unwrap(), Some(1007));
        {
            let mut cache = t.cache.lock().unwrap();
            let root = cache.root.expect("a cached root");
            let child = cache.nodes[&root].child_for(&7);
            // The root's child for key 7, as cached, now leads back to the root.
            let mut stale = cache.nodes.get(&child).expect("an internal child").clone();
            stale.children.iter_mut().for_each(|at| *at = root);
            (stale.low, stale.high) = (None, None);
            cache.nodes.insert(child, stale);
        }
        let (done, ended) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(c.txn(m, |tx| t.get(tx, &7)));
        });
        let got = ended
            .recv_timeout(Duration::from_secs(30))
            .expect("the lookup went round the cached circle for good");
        assert_eq!(got.unwrap(), Some(1007));
    }
}
