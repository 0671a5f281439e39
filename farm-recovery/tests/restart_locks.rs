//! A whole-cluster restart clears the lock bits its NVRAM kept (their holders were volatile):
//! every object of every carved block is unlocked with its version and payload unchanged, and
//! nothing outside the objects' headers is written.

use std::sync::atomic::Ordering;

use farm_alloc::{block_header_offset, BlockPool, Slabs, BLOCK_BYTES, REGION_ACTIVE_OFFSET};
use farm_core::nvram::Nvram;
use farm_core::object::{self, Header};
use farm_core::{RegionId, Version};
use farm_recovery::locks::clear_locks;

const REGION_BYTES: usize = 4 * BLOCK_BYTES;

#[test]
fn every_lock_bit_is_cleared_and_nothing_else_changes() {
    let mem = Nvram::anonymous(REGION_BYTES).unwrap();
    let (pool, mut slabs) = (BlockPool::new(REGION_BYTES), Slabs::new(RegionId(0)));
    mem.store_u64(REGION_ACTIVE_OFFSET, 7, Ordering::Release);
    let mut objects = Vec::new();
    // Two slot sizes, so that two blocks are carved; the last block stays uncarved.
    for i in 0..300u64 {
        let len = [8usize, 200][(i % 2) as usize];
        let a = slabs.alloc(&pool, len).unwrap();
        if let Some((block, word)) = a.new_block {
            mem.store_u64(block_header_offset(block), word, Ordering::Release);
        }
        let h = Header::new(Version(1 + i % 5), i % 7 != 0);
        object::install_at_backup(&mem, a.offset as u64, &[i as u8; 8], h);
        if i % 3 == 0 {
            mem.store_u64(a.offset as usize, h.with_lock().0, Ordering::Release);
        }
        objects.push((a.offset as usize, h));
    }
    assert_eq!(pool.used(), 2, "blocks 1 and 2 carved, block 3 not");
    let before = snapshot(&mem);
    assert_eq!(clear_locks(&mem, REGION_BYTES), 100);
    for (offset, h) in &objects {
        assert_eq!(Header(mem.load_u64(*offset, Ordering::Acquire)), *h);
    }
    // Only the locked headers changed.
    let after = snapshot(&mem);
    let changed: Vec<usize> = (0..before.len())
        .filter(|&w| before[w] != after[w])
        .map(|w| w * 8)
        .collect();
    let mut locked: Vec<usize> = objects
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 3 == 0)
        .map(|(_, (offset, _))| *offset)
        .collect();
    locked.sort_unstable();
    assert_eq!(changed, locked);
    assert_eq!(clear_locks(&mem, REGION_BYTES), 0, "nothing left to clear");
}

fn snapshot(mem: &Nvram) -> Vec<u64> {
    (0..REGION_BYTES / 8)
        .map(|w| mem.load_u64(w * 8, Ordering::Acquire))
        .collect()
}
