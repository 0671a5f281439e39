//! Region remapping at reconfiguration (FaRM §5.2, step 4), as a pure function: promote a
//! surviving complete backup for every region that lost its primary, restore `f + 1` replicas
//! where capacity and failure domains allow, and fail (naming the regions) when a region lost
//! every complete replica. A new backup's replica is complete once data recovery copied it
//! (§5.4); until then it holds only what was copied so far and the commits since, so promoting
//! it would serve uncopied objects as never written. It also maintains, per region, the configuration of its last primary change and of
//! its last replica change, which transaction recovery uses to find the transactions it must
//! recover (§5.3).

use std::collections::{BTreeMap, BTreeSet};

use farm_core::config::{Configuration, Placement, RegionMap};
use farm_core::{MachineId, RegionId};

pub use farm_core::config::RegionChanges;

/// The outcome of remapping.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Remap {
    /// The new region map.
    pub map: RegionMap,
    /// Per-region change history, updated for the regions this remap touched.
    pub changes: BTreeMap<RegionId, RegionChanges>,
    /// Regions whose primary moved.
    pub promoted: Vec<RegionId>,
    /// Regions that got new backups (their data is copied later, §5.4).
    pub new_backups: Vec<(RegionId, MachineId)>,
    /// Regions left with fewer than `f + 1` replicas for want of capacity.
    pub under_replicated: Vec<RegionId>,
}

/// Why remapping is impossible.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum RemapError {
    /// Every complete replica of these regions is gone: their data is lost.
    #[error("regions {0:?} lost every complete replica")]
    RegionsLost(Vec<RegionId>),
}

/// Remaps `map` for configuration `new` (its members are the survivors). `copying` lists, per
/// survivor, the regions whose replica there is still being copied (not complete); a survivor
/// it does not name holds complete replicas only. `replicas` is `f + 1`; `regions_max` bounds
/// how many replicas one machine may hold.
pub fn remap(
    map: &RegionMap,
    changes: &BTreeMap<RegionId, RegionChanges>,
    new: &Configuration,
    copying: &BTreeMap<MachineId, BTreeSet<RegionId>>,
    replicas: usize,
    regions_max: usize,
) -> Result<Remap, RemapError> {
    let alive = |m: &MachineId| new.contains(*m);
    let complete =
        |r: RegionId, m: &MachineId| alive(m) && copying.get(m).is_none_or(|c| !c.contains(&r));
    let lost: Vec<RegionId> = map
        .iter()
        .filter(|(r, p)| !alive(&p.primary) && !p.backups.iter().any(|b| complete(*r, b)))
        .map(|(r, _)| r)
        .collect();
    if !lost.is_empty() {
        return Err(RemapError::RegionsLost(lost));
    }
    let mut load: BTreeMap<MachineId, usize> = new.members.iter().map(|m| (*m, 0)).collect();
    for (_, p) in map.iter() {
        for m in std::iter::once(&p.primary)
            .chain(&p.backups)
            .filter(|m| alive(m))
        {
            *load.get_mut(m).expect("alive") += 1;
        }
    }
    let mut out = Remap {
        map: RegionMap::default(),
        changes: changes.clone(),
        promoted: Vec::new(),
        new_backups: Vec::new(),
        under_replicated: Vec::new(),
    };
    for (region, p) in map.iter() {
        let mut survivors: Vec<MachineId> = std::iter::once(p.primary)
            .chain(p.backups.iter().copied())
            .filter(alive)
            .collect();
        let entry = out.changes.entry(region).or_default();
        let replica_lost = survivors.len() < 1 + p.backups.len();
        if !alive(&p.primary) {
            // The first complete survivor (there is one: `lost` is empty) goes first; backups
            // still copying stay backups and copy on from it.
            let at = survivors
                .iter()
                .position(|m| complete(region, m))
                .expect("a complete survivor");
            let promoted = survivors.remove(at);
            survivors.insert(0, promoted);
            out.promoted.push(region);
            entry.last_primary_change = new.id;
        }
        // A region short of f + 1 since an earlier remap (no capacity then) gets its replicas
        // once there is room, for instance from a machine that joins.
        if replica_lost || survivors.len() < replicas {
            if replica_lost {
                entry.last_replica_change = new.id;
            }
            // Restore f + 1: least-loaded members in failure domains not yet used.
            while survivors.len() < replicas {
                let domains: BTreeSet<u32> = survivors
                    .iter()
                    .map(|m| new.failure_domains.get(m).copied().unwrap_or(m.0 as u32))
                    .collect();
                let pick = new
                    .members
                    .iter()
                    .filter(|m| !survivors.contains(m) && load[m] < regions_max)
                    .filter(|m| {
                        !domains
                            .contains(&new.failure_domains.get(m).copied().unwrap_or(m.0 as u32))
                    })
                    .min_by_key(|m| (load[m], **m));
                let Some(&m) = pick else {
                    out.under_replicated.push(region);
                    break;
                };
                *load.get_mut(&m).expect("member") += 1;
                entry.last_replica_change = new.id;
                survivors.push(m);
                out.new_backups.push((region, m));
            }
        }
        // §5.2 precise membership: every replica a member, none twice.
        assert!(
            survivors.iter().all(alive),
            "{region:?} placed outside configuration {}",
            new.id.0
        );
        assert!(
            survivors
                .iter()
                .enumerate()
                .all(|(i, m)| !survivors[..i].contains(m)),
            "{region:?} placed twice on one machine: {survivors:?}"
        );
        let primary = survivors[0];
        assert!(
            primary == p.primary || entry.last_primary_change == new.id,
            "{region:?}'s primary moved without a LastPrimaryChange"
        );
        // Issue 16 case 5: only a complete replica serves as primary.
        assert!(
            primary == p.primary || complete(region, &primary),
            "{region:?} promoted to {primary}, which is still copying it"
        );
        out.map.insert(
            region,
            Placement {
                primary,
                backups: survivors[1..].to_vec(),
            },
        );
    }
    assert_eq!(
        out.map.iter().count(),
        map.iter().count(),
        "a region lost by remapping"
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use farm_core::ConfigId;

    fn config(id: u64, members: &[u16]) -> Configuration {
        let mut c = Configuration::initial(8);
        c.id = ConfigId(id);
        c.members = members.iter().map(|m| MachineId(*m)).collect();
        c.failure_domains.retain(|m, _| members.contains(&m.0));
        c.cm = c.members[0];
        c
    }

    /// §5.2 step 4: a lost primary is replaced by a surviving backup, lost replicas are
    /// restored on other machines, and the change history says which regions changed when.
    #[test]
    fn promotes_backups_and_restores_replication() {
        let map = RegionMap::striped(4, 2, 2);
        let new = config(2, &[0, 1, 3]);
        let r = remap(&map, &BTreeMap::new(), &new, &BTreeMap::new(), 3, 8).unwrap();
        for (region, old) in map.iter() {
            let now = r.map.get(region).unwrap();
            assert!(new.contains(now.primary) && now.backups.iter().all(|b| new.contains(*b)));
            assert_eq!(now.backups.len(), 2, "{region:?} back to 3 replicas");
            let touched = old.holds(MachineId(2));
            let c = r.changes.get(&region).copied().unwrap_or_default();
            assert_eq!(c.last_replica_change == ConfigId(2), touched, "{region:?}");
            if old.primary == MachineId(2) {
                assert_eq!(
                    now.primary, old.backups[0],
                    "the first surviving backup is promoted"
                );
                assert_eq!(c.last_primary_change, ConfigId(2));
                assert!(r.promoted.contains(&region));
            } else {
                assert_eq!(now.primary, old.primary, "untouched primaries stay");
            }
        }
        assert_eq!(
            r.new_backups.len(),
            map.iter().filter(|(_, p)| p.holds(MachineId(2))).count()
        );
    }

    #[test]
    fn capacity_limits_leave_regions_under_replicated() {
        let map = RegionMap::striped(3, 1, 2);
        let r = remap(
            &map,
            &BTreeMap::new(),
            &config(2, &[0, 1]),
            &BTreeMap::new(),
            3,
            8,
        )
        .unwrap();
        assert_eq!(
            r.under_replicated.len(),
            3,
            "two machines cannot hold three replicas"
        );
        assert!(r.map.iter().all(|(_, p)| p.backups.len() == 1));
    }

    /// Regions left short of replicas get them once a machine joins; a later configuration
    /// that adds no room changes nothing (no region is blocked for nothing).
    #[test]
    fn under_replicated_regions_get_replicas_on_a_joining_machine() {
        let map = RegionMap::striped(3, 1, 2);
        let short = remap(
            &map,
            &BTreeMap::new(),
            &config(2, &[0, 1]),
            &BTreeMap::new(),
            3,
            8,
        )
        .unwrap();
        let again = remap(
            &short.map,
            &short.changes,
            &config(3, &[0, 1]),
            &BTreeMap::new(),
            3,
            8,
        )
        .unwrap();
        assert_eq!(again.map, short.map);
        assert_eq!(
            again.changes, short.changes,
            "nothing changed, nothing blocked"
        );
        let joined = remap(
            &short.map,
            &short.changes,
            &config(4, &[0, 1, 2]),
            &BTreeMap::new(),
            3,
            8,
        )
        .unwrap();
        for (region, p) in joined.map.iter() {
            assert_eq!(p.backups.len(), 2, "{region:?} back to 3 replicas");
            assert!(
                p.holds(MachineId(2)),
                "{region:?} has a replica on the joiner"
            );
            assert_eq!(
                joined.changes[&region].last_replica_change,
                ConfigId(4),
                "{region:?} changed replicas in the join"
            );
        }
        assert_eq!(joined.new_backups.len(), 3);
        assert!(joined.under_replicated.is_empty());
    }

    #[test]
    fn losing_every_replica_is_an_error_naming_the_regions() {
        let map = RegionMap::striped(4, 1, 1);
        // Region 1 lives on machines 1 and 2.
        let e = remap(
            &map,
            &BTreeMap::new(),
            &config(2, &[0, 3]),
            &BTreeMap::new(),
            2,
            8,
        )
        .unwrap_err();
        assert_eq!(e, RemapError::RegionsLost(vec![RegionId(1)]));
        assert_eq!(
            e.to_string(),
            "regions [RegionId(1)] lost every complete replica"
        );
    }

    /// Issue 16 case 5: a backup still copying its region is never promoted. A complete
    /// backup listed after it is; with none, the region is lost, named as such.
    #[test]
    fn only_a_complete_backup_is_promoted() {
        let mut map = RegionMap::default();
        map.insert(
            RegionId(0),
            Placement {
                primary: MachineId(0),
                backups: vec![MachineId(1), MachineId(2)],
            },
        );
        let copying = BTreeMap::from([(MachineId(1), BTreeSet::from([RegionId(0)]))]);
        let r = remap(
            &map,
            &BTreeMap::new(),
            &config(2, &[1, 2, 3]),
            &copying,
            3,
            8,
        )
        .unwrap();
        let p = r.map.get(RegionId(0)).unwrap();
        assert_eq!(
            p.primary,
            MachineId(2),
            "the complete backup, not the first"
        );
        assert_eq!(p.backups, vec![MachineId(1), MachineId(3)]);
        let e = remap(&map, &BTreeMap::new(), &config(2, &[1, 3]), &copying, 3, 8).unwrap_err();
        assert_eq!(e, RemapError::RegionsLost(vec![RegionId(0)]));
        // A survivor copying another region is complete for this one.
        let elsewhere = BTreeMap::from([(MachineId(1), BTreeSet::from([RegionId(7)]))]);
        let r = remap(
            &map,
            &BTreeMap::new(),
            &config(2, &[1, 3]),
            &elsewhere,
            3,
            8,
        )
        .unwrap();
        assert_eq!(r.map.get(RegionId(0)).unwrap().primary, MachineId(1));
    }
}
