//! Replica equality: after quiescence and truncation, every backup holds exactly what its
//! primary holds, for every allocated object and every block header (§4, §5.5).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use farm_alloc::{block_header_offset, slot_bytes_of, BLOCK_BYTES};
use farm_core::nvram::Nvram;
use farm_core::object::Header;
use farm_core::{MachineId, RegionId};
use farm_txn::MachineState;

/// What a replica comparison covered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplicaReport {
    /// Regions compared.
    pub regions: usize,
    /// Allocated objects compared (per backup).
    pub objects: usize,
}

/// Compares every region's backups with its primary. Errors name the first difference.
pub fn check_replicas(machines: &[Arc<MachineState>]) -> Result<ReplicaReport, String> {
    let views: Vec<_> = machines.iter().map(|m| (m.id, m.view())).collect();
    let by_id = |m: MachineId| {
        &views
            .iter()
            .find(|(id, _)| *id == m)
            .unwrap_or_else(|| panic!("no machine {m}"))
            .1
    };
    let any = machines.first().ok_or("no machines")?;
    let mut report = ReplicaReport::default();
    let view = any.view();
    for (region, placement) in view.map.iter() {
        let primary = by_id(placement.primary)
            .region(region)
            .ok_or("primary lacks region")?;
        let mut backups = Vec::new();
        for b in &placement.backups {
            backups.push((
                *b,
                &**by_id(*b).region(region).ok_or("backup lacks region")?,
            ));
        }
        report.objects += check_region(
            region,
            (placement.primary, primary),
            &backups,
            any.params.region_bytes,
        )?;
        report.regions += 1;
    }
    Ok(report)
}

/// Compares one region's backups with its primary, wherever their memory is mapped (another
/// process's NVRAM files included): every block header, and every object of every allocated
/// block. Returns the objects compared (per backup); errors name the first difference.
pub fn check_region(
    region: RegionId,
    (primary_id, primary): (MachineId, &Nvram),
    backups: &[(MachineId, &Nvram)],
    region_bytes: usize,
) -> Result<usize, String> {
    let mut objects = 0;
    let blocks = region_bytes / BLOCK_BYTES;
    for b in 1..blocks as u32 {
        let word = primary.load_u64(block_header_offset(b), Ordering::Acquire);
        for (backup, mem) in backups {
            let theirs = mem.load_u64(block_header_offset(b), Ordering::Acquire);
            if theirs != word {
                return Err(format!(
                    "region {} block {b}: block header {word:#x} at primary {primary_id} but \
                     {theirs:#x} at backup {backup}",
                    region.0
                ));
            }
        }
        let Some(slot) = slot_bytes_of(word) else {
            continue;
        };
        let mut ours = vec![0u8; slot as usize];
        let mut theirs = vec![0u8; slot as usize];
        for s in 0..BLOCK_BYTES / slot as usize {
            let offset = b as usize * BLOCK_BYTES + s * slot as usize;
            let h = Header(primary.load_u64(offset, Ordering::Acquire));
            if h.0 == 0 {
                continue;
            }
            if h.locked() {
                return Err(format!(
                    "region {} offset {offset:#x} still locked at quiescence",
                    region.0
                ));
            }
            ours.resize(slot as usize, 0);
            primary.read(offset, &mut ours);
            if !h.allocated() {
                // A freed object's payload is not replicated (a free writes only the header).
                ours.truncate(8);
            }
            for (backup, mem) in backups {
                theirs.resize(ours.len(), 0);
                mem.read(offset, &mut theirs);
                if theirs != ours {
                    return Err(format!(
                        "region {} offset {offset:#x}: backup {backup} differs from primary \
                         {primary_id} (headers {:?} vs {:?})",
                        region.0,
                        h,
                        Header(u64::from_le_bytes(theirs[..8].try_into().expect("8")))
                    ));
                }
                objects += 1;
            }
        }
    }
    Ok(objects)
}
