//! Configurations and the region map (FaRM §3).
//!
//! A configuration is `<i, S, F, CM>`: its id, the member machines, their failure domains and
//! the configuration manager. The region map says, for every region, its primary and its `f`
//! backups. In this version placement is static ([`RegionMap::striped`]); the configuration
//! manager replaces it with two-phase region allocation.

use std::collections::BTreeMap;

use crate::ids::{ConfigId, MachineId, RegionId};

/// A configuration `<i, S, F, CM>`.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Configuration {
    /// Unique, monotonically increasing id.
    pub id: ConfigId,
    /// Member machines, sorted.
    pub members: Vec<MachineId>,
    /// Failure domain of every member.
    pub failure_domains: BTreeMap<MachineId, u32>,
    /// The configuration manager.
    pub cm: MachineId,
}

impl Configuration {
    /// The first configuration of `machines` machines, each its own failure domain, machine 0 CM.
    pub fn initial(machines: u16) -> Self {
        let members: Vec<_> = (0..machines).map(MachineId).collect();
        Self {
            id: ConfigId(1),
            failure_domains: members.iter().map(|m| (*m, m.0 as u32)).collect(),
            members,
            cm: MachineId(0),
        }
    }

    /// Whether `m` is a member.
    pub fn contains(&self, m: MachineId) -> bool {
        self.members.binary_search(&m).is_ok()
    }

    /// The members other than the CM: those that hold leases with it (§5.1).
    pub fn leaseholders(&self) -> Vec<MachineId> {
        self.members
            .iter()
            .copied()
            .filter(|m| *m != self.cm)
            .collect()
    }
}

/// When each region last changed primary and replicas (`LastPrimaryChange`,
/// `LastReplicaChange` of §5.2).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct RegionChanges {
    /// Configuration in which the primary last changed.
    pub last_primary_change: ConfigId,
    /// Configuration in which any replica last changed.
    pub last_replica_change: ConfigId,
}

/// Replicas of one region: a primary and `f` backups, all distinct.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Placement {
    /// Where objects are read, locked and committed.
    pub primary: MachineId,
    /// Where COMMIT-BACKUP records go.
    pub backups: Vec<MachineId>,
}

impl Placement {
    /// Whether `m` holds a replica.
    pub fn holds(&self, m: MachineId) -> bool {
        self.primary == m || self.backups.contains(&m)
    }

    /// Every replica, the primary first.
    pub fn replicas(&self) -> impl Iterator<Item = MachineId> + '_ {
        std::iter::once(self.primary).chain(self.backups.iter().copied())
    }
}

/// Region id -> placement. Region ids are dense (the CM's counter), so this is a vector.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct RegionMap {
    regions: Vec<Option<Placement>>,
}

impl RegionMap {
    /// Static striped placement: `per_machine` regions with each machine as primary, backups on
    /// the next `f` machines (so replicas are on distinct machines). Panics if `f + 1 > machines`.
    pub fn striped(machines: u16, per_machine: u32, f: u16) -> Self {
        assert!(
            machines > f,
            "replication needs {} machines, have {machines}",
            f + 1
        );
        let mut map = RegionMap::default();
        for i in 0..machines as u32 * per_machine {
            let primary = (i % machines as u32) as u16;
            let backups = (1..=f)
                .map(|k| MachineId((primary + k) % machines))
                .collect();
            map.insert(
                RegionId(i),
                Placement {
                    primary: MachineId(primary),
                    backups,
                },
            );
        }
        map
    }

    /// Adds or replaces a region's placement.
    pub fn insert(&mut self, region: RegionId, placement: Placement) {
        let idx = region.0 as usize;
        if self.regions.len() <= idx {
            self.regions.resize(idx + 1, None);
        }
        assert!(
            !placement.backups.contains(&placement.primary),
            "primary of {region:?} is also a backup"
        );
        self.regions[idx] = Some(placement);
    }

    /// Removes a region (one whose allocation never committed), returning its placement.
    pub fn remove(&mut self, region: RegionId) -> Option<Placement> {
        let removed = self.regions.get_mut(region.0 as usize)?.take();
        while self.regions.last().is_some_and(Option::is_none) {
            self.regions.pop();
        }
        removed
    }

    /// The placement of `region`, if it exists.
    pub fn get(&self, region: RegionId) -> Option<&Placement> {
        self.regions.get(region.0 as usize).and_then(Option::as_ref)
    }

    /// Every region with its placement, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (RegionId, &Placement)> {
        self.regions
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.as_ref().map(|p| (RegionId(i as u32), p)))
    }

    /// Regions whose primary is `m`.
    pub fn primary_of(&self, m: MachineId) -> impl Iterator<Item = RegionId> + '_ {
        self.iter()
            .filter(move |(_, p)| p.primary == m)
            .map(|(r, _)| r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn striped_placement_uses_distinct_machines() {
        let map = RegionMap::striped(3, 2, 2);
        assert_eq!(map.iter().count(), 6);
        for (_, p) in map.iter() {
            let mut all = p.backups.clone();
            all.push(p.primary);
            all.sort();
            all.dedup();
            assert_eq!(all.len(), 3);
        }
        assert_eq!(map.primary_of(MachineId(1)).count(), 2);
        assert!(Configuration::initial(3).contains(MachineId(2)));
    }

    #[test]
    #[should_panic(expected = "replication needs 3 machines")]
    fn too_few_machines_for_f_panics() {
        RegionMap::striped(2, 1, 2);
    }
}
