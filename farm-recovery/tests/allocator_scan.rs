//! Allocator recovery (FaRM §5.5): a new primary rebuilds its free lists by a paced scan, and
//! frees that commit meanwhile are queued and counted once.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

use farm_alloc::{block_header_offset, BlockPool, Slabs, BLOCK_BYTES};
use farm_core::nvram::Nvram;
use farm_core::object::{self, Header};
use farm_core::rng::Rng;
use farm_core::{RegionId, Version};
use farm_recovery::{AllocatorScan, ScanProgress};

const REGION_BYTES: usize = 4 * BLOCK_BYTES;

#[test]
fn the_scan_finds_exactly_the_free_slots_and_the_next_unused_block() {
    let mem = Nvram::anonymous(REGION_BYTES).unwrap();
    let (pool, mut slabs, mut rng) = (
        BlockPool::new(REGION_BYTES),
        Slabs::new(RegionId(0)),
        Rng::new(5),
    );
    let mut in_use = BTreeSet::new();
    for i in 0..2000u64 {
        let len = [8usize, 200][(i % 2) as usize];
        let a = slabs.alloc(&pool, len).unwrap();
        if let Some((block, word)) = a.new_block {
            mem.store_u64(block_header_offset(block), word, Ordering::Release);
        }
        // Most committed as allocated; some freed again; some handed out but never committed.
        match rng.below(10) {
            0..=6 => {
                object::install_at_backup(
                    &mem,
                    a.offset as u64,
                    &[1; 8],
                    Header::new(Version(1), true),
                );
                in_use.insert(a.offset);
            }
            7 | 8 => {
                object::install_at_backup(
                    &mem,
                    a.offset as u64,
                    &[],
                    Header::new(Version(2), false),
                );
            }
            _ => {}
        }
    }
    let carved = pool.used();
    let mut scan = AllocatorScan::new(RegionId(0), REGION_BYTES, 100, 100, 0);
    // One object committed as allocated is freed while the scan runs (its header already
    // cleared, so the scan may see it too): counted once.
    let freed_late = *in_use.iter().next().unwrap();
    object::install_at_backup(&mem, freed_late as u64, &[], Header::new(Version(3), false));
    scan.queue_free(freed_late, 16);
    in_use.remove(&freed_late);
    let (mut now, mut waits) = (0u64, 0);
    while scan.poll(now, &mem) != ScanProgress::Done {
        now += 1;
        waits += 1;
    }
    assert!(
        waits > 100 * 99,
        "paced at 100 slots every 100 ticks ({waits} polls)"
    );
    let (pool, mut slabs) = scan.finish();
    let total_slots = BLOCK_BYTES / 16 + BLOCK_BYTES / 256;
    assert_eq!(
        slabs.free_slots(),
        total_slots - in_use.len(),
        "every slot not in use is free, once"
    );
    // Everything handed out now has its allocated bit clear; then a fresh block follows.
    let mut handed = BTreeSet::new();
    for _ in 0..BLOCK_BYTES / 16
        - in_use
            .iter()
            .filter(|o| (**o as usize) < 2 * BLOCK_BYTES)
            .count()
    {
        let a = slabs.alloc(&pool, 8).unwrap();
        assert!(
            !Header(mem.load_u64(a.offset as usize, Ordering::Acquire)).allocated(),
            "slot {:#x} is in use",
            a.offset
        );
        assert!(a.new_block.is_none());
        assert!(handed.insert(a.offset), "slot handed out twice");
    }
    let fresh = slabs.alloc(&pool, 8).unwrap();
    assert_eq!(
        fresh.new_block.map(|(b, _)| b),
        Some(carved + 1),
        "the next unused block"
    );
}
