//! Data structures on farm's transactions: the indexes applications and the TATP and TPC-C
//! benchmarks build their tables from (FaRM §6: "FaRM hash tables").
//!
//! - [`HashTable`]: fixed-capacity, partitioned hash table of plain-old-data keys and values,
//!   stored inline in bucket objects, so that a lookup is usually one one-sided read and a
//!   single lookup can be a lock-free read.
//! - [`BTree`]: a B+-tree for ordered indexes and range scans, with fence keys and a cache of
//!   internal nodes per handle, so that a lookup usually reads one node (its leaf).

#![deny(missing_docs)]

pub mod btree;
pub mod hash;

pub use btree::BTree;
pub use hash::{HashTable, TableSpec};
