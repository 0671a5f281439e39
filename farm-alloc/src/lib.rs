//! farm-alloc: object allocation inside regions (FaRM §5.5).
//!
//! A region is split into 1 MB blocks. Block 0 holds the block headers (one word per block: the
//! slot size of the slab carved from it, 0 while unused); blocks 1.. are slabs of one size class.
//! Block headers are replicated to the backups when a block is allocated ([`Allocation::new_block`]
//! tells the caller what to write and replicate); slab free lists exist only at the primary, per
//! worker thread ([`Slabs`]), so allocation takes no lock on the common path. The allocated bit of
//! an object is set and cleared by transactions, not here: the allocator only hands out slots whose
//! header has the bit clear and takes back slots whose free committed.
//!
//! ```
//! use farm_alloc::{BlockPool, Slabs, BLOCK_BYTES};
//! use farm_core::RegionId;
//! let pool = BlockPool::new(4 * BLOCK_BYTES);
//! let mut slabs = Slabs::new(RegionId(0));
//! let a = slabs.alloc(&pool, 24).unwrap();
//! assert!(a.new_block.is_some(), "the first allocation carves a block");
//! let b = slabs.alloc(&pool, 24).unwrap();
//! assert_eq!(b.offset, a.offset + 32);
//! ```
#![deny(missing_docs)]

use std::sync::atomic::{AtomicU32, Ordering};

use farm_core::object::HEADER_BYTES;
use farm_core::RegionId;

/// Block size (§5.5).
pub const BLOCK_BYTES: usize = 1 << 20;
/// Slot sizes (header included) of the size classes.
pub const SLOT_BYTES: [u32; 11] = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384];
/// Largest payload an object can have.
pub const PAYLOAD_BYTES_MAX: usize = 16384 - HEADER_BYTES;
/// Block headers carry this tag in the high half, so a zero or stray word is never a header.
const BLOCK_TAG: u64 = 0xb10c << 48;

/// Why an allocation failed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AllocError {
    /// The payload is larger than the largest size class.
    TooLarge(usize),
    /// Every block of the region is in use and no slot of the class is free.
    RegionFull(RegionId),
}

impl std::fmt::Display for AllocError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllocError::TooLarge(n) => {
                write!(
                    f,
                    "object of {n} bytes exceeds the largest size class ({PAYLOAD_BYTES_MAX})"
                )
            }
            AllocError::RegionFull(r) => write!(f, "region {} is full", r.0),
        }
    }
}

impl std::error::Error for AllocError {}

/// The size class for a payload of `payload` bytes.
pub fn class_for(payload: usize) -> Result<usize, AllocError> {
    SLOT_BYTES
        .iter()
        .position(|s| *s as usize >= payload + HEADER_BYTES)
        .ok_or(AllocError::TooLarge(payload))
}

/// Offset in block 0 of the word holding the configuration in which the region last became
/// active at its primary (§5.3 step 4): written only at the primary, read by coordinators of
/// other machines while their view still shows the region blocked.
pub const REGION_ACTIVE_OFFSET: usize = BLOCK_BYTES - 8;

/// Offset of the header word of `block`.
pub const fn block_header_offset(block: u32) -> usize {
    8 * block as usize
}

/// The block header word for slabs of `slot_bytes`.
pub const fn block_header(slot_bytes: u32) -> u64 {
    BLOCK_TAG | slot_bytes as u64
}

/// The slot size a block header word names, if it is one.
pub fn slot_bytes_of(header: u64) -> Option<u32> {
    (header & (0xffff << 48) == BLOCK_TAG)
        .then_some(header as u32)
        .filter(|s| SLOT_BYTES.contains(s))
}

/// The block holding `offset`.
pub const fn block_of(offset: u32) -> u32 {
    (offset as usize / BLOCK_BYTES) as u32
}

/// Unused blocks of one region at its primary, shared by the machine's threads.
#[derive(Debug)]
pub struct BlockPool {
    next: AtomicU32,
    blocks: u32,
}

impl BlockPool {
    /// A pool for a fresh region of `region_bytes` (block 0 is metadata).
    pub fn new(region_bytes: usize) -> Self {
        let blocks = (region_bytes / BLOCK_BYTES) as u32;
        assert!(
            blocks >= 2,
            "a region needs at least 2 blocks of {BLOCK_BYTES} bytes"
        );
        assert!(
            block_header_offset(blocks) <= REGION_ACTIVE_OFFSET,
            "block headers must fit in block 0"
        );
        Self {
            next: AtomicU32::new(1),
            blocks,
        }
    }

    /// The pool of a region whose blocks below `next_block` are carved (allocator recovery at a
    /// new primary, §5.5: the scan finds the highest carved block).
    pub fn recovered(region_bytes: usize, next_block: u32) -> Self {
        let pool = Self::new(region_bytes);
        assert!(
            next_block >= 1 && next_block <= pool.blocks,
            "next block {next_block} outside the region"
        );
        pool.next.store(next_block, Ordering::Relaxed);
        pool
    }

    /// Takes an unused block.
    fn take(&self) -> Option<u32> {
        let b = self.next.fetch_add(1, Ordering::Relaxed);
        (b < self.blocks).then_some(b).or_else(|| {
            self.next.store(self.blocks, Ordering::Relaxed);
            None
        })
    }

    /// Blocks handed out so far (block 0 excluded).
    pub fn used(&self) -> u32 {
        self.next.load(Ordering::Relaxed).min(self.blocks) - 1
    }
}

/// A slot handed out by [`Slabs::alloc`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Allocation {
    /// Offset of the object header in the region.
    pub offset: u32,
    /// Slot size.
    pub slot_bytes: u32,
    /// When the slot came from a fresh block: the block header to write at
    /// `block_header_offset(block)` locally and at every backup before the slot is committed.
    pub new_block: Option<(u32, u64)>,
}

/// One thread's slabs in one region at its primary: free slots per size class.
#[derive(Debug)]
pub struct Slabs {
    region: RegionId,
    free: [Vec<u32>; SLOT_BYTES.len()],
}

impl Slabs {
    /// Empty slabs of `region`.
    pub fn new(region: RegionId) -> Self {
        Self {
            region,
            free: Default::default(),
        }
    }

    /// Slabs rebuilt by allocator recovery (§5.5) from the free slots a scan found, as
    /// (offset, slot size).
    pub fn recovered(region: RegionId, free: impl IntoIterator<Item = (u32, u32)>) -> Self {
        let mut slabs = Self::new(region);
        for (offset, slot_bytes) in free {
            let class = SLOT_BYTES
                .iter()
                .position(|s| *s == slot_bytes)
                .unwrap_or_else(|| panic!("recovered slot of unknown size {slot_bytes}"));
            slabs.free[class].push(offset);
        }
        // Hand out low addresses first, as fresh slabs do.
        for list in &mut slabs.free {
            list.sort_unstable_by(|a, b| b.cmp(a));
        }
        slabs
    }

    /// Whether a slot for a payload of `payload` bytes is free here (no block would be carved).
    pub fn has_free(&self, payload: usize) -> bool {
        class_for(payload).is_ok_and(|class| !self.free[class].is_empty())
    }

    /// Takes every free slot out, as (offset, slot size): to share them with the other threads
    /// of the region's primary.
    pub fn take_free(&mut self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for (class, list) in self.free.iter_mut().enumerate() {
            out.extend(
                list.drain(..)
                    .rev()
                    .map(|offset| (offset, SLOT_BYTES[class])),
            );
        }
        out
    }

    /// Hands out a free slot for a payload of `payload` bytes, carving a new block if needed.
    pub fn alloc(&mut self, pool: &BlockPool, payload: usize) -> Result<Allocation, AllocError> {
        let class = class_for(payload)?;
        let slot_bytes = SLOT_BYTES[class];
        if let Some(offset) = self.free[class].pop() {
            return Ok(Allocation {
                offset,
                slot_bytes,
                new_block: None,
            });
        }
        let block = pool.take().ok_or(AllocError::RegionFull(self.region))?;
        let start = block as usize * BLOCK_BYTES;
        let slots = BLOCK_BYTES / slot_bytes as usize;
        // Hand out low addresses first: push in reverse so `pop` returns the lowest.
        self.free[class].extend(
            (1..slots)
                .rev()
                .map(|i| (start + i * slot_bytes as usize) as u32),
        );
        Ok(Allocation {
            offset: start as u32,
            slot_bytes,
            new_block: Some((block, block_header(slot_bytes))),
        })
    }

    /// Returns a slot: its free committed, or the transaction that took it aborted.
    pub fn free(&mut self, offset: u32, slot_bytes: u32) {
        let class = SLOT_BYTES
            .iter()
            .position(|s| *s == slot_bytes)
            .unwrap_or_else(|| panic!("freeing a slot of unknown size {slot_bytes}"));
        assert!(
            (offset as usize % BLOCK_BYTES).is_multiple_of(slot_bytes as usize)
                && block_of(offset) > 0,
            "offset {offset:#x} is not a slot of size {slot_bytes}"
        );
        debug_assert!(
            !self.free[class].contains(&offset),
            "slot {offset:#x} freed twice"
        );
        self.free[class].push(offset);
    }

    /// Whether the slot at `offset` of `slot_bytes` is on a free list (a linear scan of its
    /// class: for checks of input from other machines, not the allocation path).
    pub fn is_free(&self, offset: u32, slot_bytes: u32) -> bool {
        SLOT_BYTES
            .iter()
            .position(|s| *s == slot_bytes)
            .is_some_and(|class| self.free[class].contains(&offset))
    }

    /// Free slots of every class.
    pub fn free_slots(&self) -> usize {
        self.free.iter().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_fit_payload_and_header() {
        assert_eq!(class_for(8), Ok(0));
        assert_eq!(class_for(9), Ok(1));
        assert_eq!(class_for(PAYLOAD_BYTES_MAX), Ok(SLOT_BYTES.len() - 1));
        assert_eq!(
            class_for(PAYLOAD_BYTES_MAX + 1),
            Err(AllocError::TooLarge(PAYLOAD_BYTES_MAX + 1))
        );
    }

    #[test]
    fn slabs_carve_blocks_reuse_freed_slots_and_fill_up() {
        let pool = BlockPool::new(3 * BLOCK_BYTES);
        let mut s = Slabs::new(RegionId(7));
        let first = s.alloc(&pool, 8000).unwrap();
        assert_eq!(first.offset as usize, BLOCK_BYTES);
        assert_eq!(first.new_block, Some((1, block_header(8192))));
        assert_eq!(slot_bytes_of(block_header(8192)), Some(8192));
        assert_eq!(slot_bytes_of(8192), None);
        let per_block = BLOCK_BYTES / 8192;
        let mut all = vec![first.offset];
        for _ in 1..2 * per_block {
            all.push(s.alloc(&pool, 8000).unwrap().offset);
        }
        assert_eq!(pool.used(), 2);
        assert_eq!(
            s.alloc(&pool, 8000),
            Err(AllocError::RegionFull(RegionId(7)))
        );
        s.free(all[5], 8192);
        assert_eq!(
            s.alloc(&pool, 8000).unwrap().offset,
            all[5],
            "freed slots are reused"
        );
        let mut sorted = all.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), all.len(), "no slot handed out twice");
    }
}
