//! Lock bits after a whole-cluster restart. An object's lock bit lives in its header, in NVRAM,
//! and survives a power loss; who held the lock (a LOCK record being committed, or lock
//! recovery on behalf of a recovering transaction, §5.3 step 4) lived in volatile state and
//! does not. The restart makes every region change primary, so lock recovery locks again
//! whatever the recovering transactions wrote; a bit left from before belongs to nobody, and
//! would keep its object locked forever (every transaction on it aborts, and a new backup's
//! copy of the region waits for it to unlock).

use std::sync::atomic::Ordering;

use farm_alloc::{block_header_offset, slot_bytes_of, BLOCK_BYTES};
use farm_core::nvram::Nvram;
use farm_core::object::Header;

/// Clears the lock bit of every object of a region replica (`region_bytes` long) that
/// nothing else touches yet; returns how many were locked.
pub fn clear_locks(mem: &Nvram, region_bytes: usize) -> usize {
    assert!(region_bytes.is_multiple_of(BLOCK_BYTES) && region_bytes <= mem.len());
    let mut cleared = 0;
    for block in 1..(region_bytes / BLOCK_BYTES) as u32 {
        let word = mem.load_u64(block_header_offset(block), Ordering::Acquire);
        let Some(slot) = slot_bytes_of(word).map(|s| s as usize) else {
            continue; // Never carved: no objects.
        };
        let start = block as usize * BLOCK_BYTES;
        for offset in (start..start + BLOCK_BYTES).step_by(slot) {
            let h = Header(mem.load_u64(offset, Ordering::Acquire));
            if h.locked() {
                mem.store_u64(offset, h.without_lock().0, Ordering::Release);
                cleared += 1;
            }
        }
    }
    cleared
}
