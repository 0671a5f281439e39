//! Data structures on farm's transactions: the indexes applications and the TATP and TPC-C
//! benchmarks build their tables from (FaRM §6: "FaRM hash tables").
//!
//! - [`HashTable`]: fixed-capacity, partitioned hash table of plain-old-data keys and values,
//!   stored inline in bucket objects, so that a lookup is usually one one-sided read and a
//!   single lookup can be a lock-free read.

#![deny(missing_docs)]

pub mod hash;

pub use hash::{HashTable, TableSpec};
