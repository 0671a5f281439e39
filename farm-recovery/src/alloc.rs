//! Allocator recovery (FaRM §5.5): slab free lists live only at the primary, so a new primary
//! rebuilds them by scanning the region's objects, paced (100 objects every 100 µs in FaRM) to
//! spare foreground work, after ALL-REGIONS-ACTIVE. A slot whose allocated bit is clear is free
//! (never used, freed, or handed out by the old primary to a transaction that never committed).
//! Frees that commit during the scan are queued and added when it finishes.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

use farm_alloc::{block_header_offset, slot_bytes_of, BlockPool, Slabs, BLOCK_BYTES};
use farm_core::nvram::Nvram;
use farm_core::object::Header;
use farm_core::RegionId;

/// What a scan step did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ScanProgress {
    /// Paced: nothing before the next interval.
    Waiting,
    /// Scanned this many slots.
    Scanned(usize),
    /// The whole region is scanned; call [`AllocatorScan::finish`].
    Done,
}

/// The paced scan of one region at its new primary.
#[derive(Debug)]
pub struct AllocatorScan {
    region: RegionId,
    region_bytes: usize,
    objects_per_step: usize,
    interval_ticks: u64,
    next_at: u64,
    block: u32,
    slot_index: usize,
    /// One past the highest carved block seen.
    next_block: u32,
    free: BTreeSet<(u32, u32)>,
    queued: Vec<(u32, u32)>,
}

impl AllocatorScan {
    /// A scan of `region` that looks at `objects_per_step` slots every `interval_ticks`.
    pub fn new(
        region: RegionId,
        region_bytes: usize,
        objects_per_step: usize,
        interval_ticks: u64,
        now: u64,
    ) -> Self {
        assert!(objects_per_step > 0 && region_bytes.is_multiple_of(BLOCK_BYTES));
        Self {
            region,
            region_bytes,
            objects_per_step,
            interval_ticks,
            next_at: now,
            block: 1,
            slot_index: 0,
            next_block: 1,
            free: BTreeSet::new(),
            queued: Vec::new(),
        }
    }

    /// One paced step over the local (primary) replica `mem`.
    pub fn poll(&mut self, now: u64, mem: &Nvram) -> ScanProgress {
        let blocks = (self.region_bytes / BLOCK_BYTES) as u32;
        if self.block >= blocks {
            return ScanProgress::Done;
        }
        if now < self.next_at {
            return ScanProgress::Waiting;
        }
        self.next_at = now + self.interval_ticks;
        let mut scanned = 0;
        while scanned < self.objects_per_step && self.block < blocks {
            let word = mem.load_u64(block_header_offset(self.block), Ordering::Acquire);
            let Some(slot) = slot_bytes_of(word) else {
                self.block += 1;
                self.slot_index = 0;
                continue;
            };
            self.next_block = self.block + 1;
            let per_block = BLOCK_BYTES / slot as usize;
            let offset = self.block as usize * BLOCK_BYTES + self.slot_index * slot as usize;
            // A locked free slot belongs to a transaction being recovered (an allocation it may
            // still commit): not free. Should recovery abort it, the slot stays unused.
            let h = Header(mem.load_u64(offset, Ordering::Acquire));
            if !h.allocated() && !h.locked() {
                self.free.insert((offset as u32, slot));
            }
            scanned += 1;
            self.slot_index += 1;
            if self.slot_index == per_block {
                self.block += 1;
                self.slot_index = 0;
            }
        }
        ScanProgress::Scanned(scanned)
    }

    /// The region being scanned.
    pub fn region(&self) -> RegionId {
        self.region
    }

    /// A free that committed during the scan: added when the scan finishes (§5.5: frees are
    /// queued until the slab's free list is recovered).
    pub fn queue_free(&mut self, offset: u32, slot_bytes: u32) {
        self.queued.push((offset, slot_bytes));
    }

    /// The recovered block pool and free lists. A queued free whose cleared header the scan
    /// also saw is counted once.
    pub fn finish(self) -> (BlockPool, Slabs) {
        assert!(
            self.block as usize >= self.region_bytes / BLOCK_BYTES,
            "scan of {:?} not finished",
            self.region
        );
        let mut free = self.free;
        free.extend(self.queued);
        (
            BlockPool::recovered(self.region_bytes, self.next_block),
            Slabs::recovered(self.region, free),
        )
    }
}
