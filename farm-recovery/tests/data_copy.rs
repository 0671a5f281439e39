//! Data recovery (FaRM §5.4): a new backup copies a region from the primary with paced one-sided
//! reads, installing only newer versions, retrying chunks with objects being committed.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use farm_alloc::{block_header_offset, BlockPool, Slabs, BLOCK_BYTES};
use farm_core::fabric::{Fabric, FabricError, MemKey};
use farm_core::nvram::Nvram;
use farm_core::object::{self, Header};
use farm_core::rng::Rng;
use farm_core::{MachineId, RegionId, Version};
use farm_fabric::mem::{MemFabric, MemFabricConfig};
use farm_recovery::{CopyParams, Progress, RegionCopy};

const REGION_BYTES: usize = 4 * BLOCK_BYTES;

/// A primary replica with objects of several sizes, some freed; returns (offset, slot bytes).
fn populate(mem: &Nvram, rng: &mut Rng) -> Vec<(u32, u32)> {
    let pool = BlockPool::new(REGION_BYTES);
    let mut slabs = Slabs::new(RegionId(0));
    let mut objects = Vec::new();
    for i in 0..300u64 {
        let len = [8usize, 100, 1000][(i % 3) as usize];
        let a = slabs.alloc(&pool, len).unwrap();
        if let Some((block, word)) = a.new_block {
            mem.store_u64(block_header_offset(block), word, Ordering::Release);
        }
        let version = Version(1 + rng.below(50));
        let allocated = rng.below(10) != 0;
        let payload: Vec<u8> = (0..a.slot_bytes as usize - 8)
            .map(|_| rng.next_u64() as u8)
            .collect();
        let data = if allocated { &payload[..] } else { &[][..] };
        assert!(object::install_at_backup(
            mem,
            a.offset as u64,
            data,
            Header::new(version, allocated)
        ));
        objects.push((a.offset, a.slot_bytes));
    }
    objects
}

fn setup(seed: u64) -> (MemFabric, Arc<Nvram>, Nvram, Vec<(u32, u32)>) {
    let fabric = MemFabric::new(MemFabricConfig {
        machines_max: 2,
        threads_max: 1,
        seed,
        datagrams_queued_max: 4,
    });
    let primary = Arc::new(Nvram::anonymous(REGION_BYTES).unwrap());
    let objects = populate(&primary, &mut Rng::new(seed));
    fabric.register(MachineId(0), MemKey::Region(RegionId(0)), primary.clone());
    (
        fabric,
        primary,
        Nvram::anonymous(REGION_BYTES).unwrap(),
        objects,
    )
}

fn slot(mem: &Nvram, offset: u32, bytes: u32) -> Vec<u8> {
    let mut buf = vec![0u8; bytes as usize];
    mem.read(offset as usize, &mut buf);
    let h = Header(u64::from_le_bytes(buf[..8].try_into().unwrap()));
    if !h.allocated() {
        buf.truncate(8); // A free writes only the header.
    }
    buf
}

#[test]
fn a_paced_copy_makes_the_backup_equal_and_keeps_newer_versions() {
    for seed in 0..5 {
        let (fabric, primary, backup, objects) = setup(seed);
        // A COMMIT-BACKUP already applied a newer version of one object at the new backup.
        let (newer_at, newer_slot) = objects[7];
        let old = Header(primary.load_u64(newer_at as usize, Ordering::Acquire));
        let newer = Header::new(Version(old.version().0 + 100), true);
        object::install_at_backup(
            &backup,
            newer_at as u64,
            &vec![0xab; newer_slot as usize - 8],
            newer,
        );
        let remote = fabric
            .remote(MachineId(1), MachineId(0), MemKey::Region(RegionId(0)))
            .unwrap();
        let mut copy = RegionCopy::new(
            RegionId(0),
            REGION_BYTES,
            CopyParams {
                chunk_bytes: 8192,
                interval_ticks: 10,
            },
            0,
        );
        let (mut now, mut waits, mut steps) = (0u64, 0, 0);
        loop {
            match copy.poll(now, &*remote, &backup).unwrap() {
                Progress::Done => break,
                Progress::Waiting => waits += 1,
                Progress::Copied { .. } => steps += 1,
                Progress::Retry => panic!("nothing is being committed"),
            }
            now += 1;
            assert!(now < 1_000_000, "seed {seed}: copy did not finish");
        }
        assert!(
            waits >= 9 * (steps - 1),
            "seed {seed}: paced at one step per 10 ticks ({steps} steps, {waits} waits)"
        );
        for (offset, bytes) in &objects {
            if *offset == newer_at {
                assert_eq!(
                    Header(backup.load_u64(*offset as usize, Ordering::Acquire)),
                    newer,
                    "seed {seed}: newer version kept"
                );
                continue;
            }
            assert_eq!(
                slot(&backup, *offset, *bytes),
                slot(&primary, *offset, *bytes),
                "seed {seed}: object at {offset:#x}"
            );
        }
        assert_eq!(copy.installed(), objects.len() - 1);
        for b in 1..4u32 {
            let at = block_header_offset(b);
            assert_eq!(
                backup.load_u64(at, Ordering::Acquire),
                primary.load_u64(at, Ordering::Acquire),
                "block header {b}"
            );
        }
    }
}

#[test]
fn a_chunk_with_an_object_being_committed_is_read_again() {
    let (fabric, primary, backup, objects) = setup(9);
    let remote = fabric
        .remote(MachineId(1), MachineId(0), MemKey::Region(RegionId(0)))
        .unwrap();
    let (at, _) = objects[0];
    let h = Header(primary.load_u64(at as usize, Ordering::Acquire));
    object::try_lock(&primary, at as u64, h).unwrap();
    let mut copy = RegionCopy::new(RegionId(0), REGION_BYTES, CopyParams::aggressive(), 0);
    assert_eq!(
        copy.poll(0, &*remote, &backup).unwrap(),
        Progress::Copied { installed: 0 },
        "block headers"
    );
    for now in 1..5 {
        assert_eq!(copy.poll(now, &*remote, &backup).unwrap(), Progress::Retry);
    }
    assert_eq!(
        backup.load_u64(at as usize, Ordering::Acquire),
        0,
        "nothing half-committed was installed"
    );
    object::apply_locked(&primary, at as u64, &[7; 8], h.committed_successor(true));
    assert!(
        matches!(copy.poll(5, &*remote, &backup).unwrap(), Progress::Copied { installed } if installed > 0)
    );
    let got = Header(backup.load_u64(at as usize, Ordering::Acquire));
    assert_eq!(
        got.version(),
        Version(h.version().0 + 1),
        "the committed version was copied"
    );
}

#[test]
fn a_dead_primary_is_an_error_not_a_hang() {
    let (fabric, _primary, backup, _) = setup(3);
    let remote = fabric
        .remote(MachineId(1), MachineId(0), MemKey::Region(RegionId(0)))
        .unwrap();
    fabric.kill(MachineId(0));
    let mut copy = RegionCopy::new(RegionId(0), REGION_BYTES, CopyParams::aggressive(), 0);
    assert_eq!(
        copy.poll(0, &*remote, &backup),
        Err(FabricError::Unreachable(MachineId(0)))
    );
}
