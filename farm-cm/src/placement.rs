//! Region allocation (FaRM §3): the CM assigns the next region id from its counter, chooses
//! replicas — enough capacity, each in a different failure domain, co-located with a target
//! region when the application asks for locality, otherwise balancing regions per machine — and
//! runs a two-phase protocol with them (prepare, then commit) so that a mapping is valid and
//! replicated at every replica before anyone uses it.

use std::collections::{BTreeMap, BTreeSet};

use farm_core::config::{Configuration, Placement, RegionMap};
use farm_core::{MachineId, RegionId};

/// Why no region could be allocated.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum PlacementError {
    /// Not enough machines with capacity in distinct failure domains.
    #[error("need {needed} replicas in distinct failure domains with capacity, found {found}")]
    NoCapacity {
        /// Replicas wanted.
        needed: usize,
        /// Machines that qualified.
        found: usize,
    },
    /// The locality target does not exist.
    #[error("locality target region {} does not exist", .0.0)]
    NoSuchRegion(RegionId),
    /// A replica refused to prepare (out of NVRAM, say).
    #[error("machine {0} refused to prepare the region")]
    Refused(MachineId),
}

/// The id the CM's counter assigns next: one past the largest region in the map (the map is
/// replicated at every machine, so a new CM continues the count).
pub fn next_region_id(map: &RegionMap) -> RegionId {
    RegionId(map.iter().map(|(r, _)| r.0 + 1).max().unwrap_or(0))
}

/// Chooses `replicas` machines for a new region: the target region's replicas when `near` is
/// given and they all have room (locality, §3), else the least-loaded members, one per failure
/// domain, ties broken by id. The first is the primary: of those chosen, the one that is
/// primary for the fewest regions, so that primaries (where transactions lock and allocate)
/// spread over the machines too.
pub fn choose_replicas(
    config: &Configuration,
    map: &RegionMap,
    replicas: usize,
    regions_max: usize,
    near: Option<RegionId>,
) -> Result<Vec<MachineId>, PlacementError> {
    let mut load: BTreeMap<MachineId, usize> = config.members.iter().map(|m| (*m, 0)).collect();
    for (_, p) in map.iter() {
        for m in std::iter::once(&p.primary).chain(&p.backups) {
            if let Some(l) = load.get_mut(m) {
                *l += 1;
            }
        }
    }
    if let Some(target) = near {
        let p = map
            .get(target)
            .ok_or(PlacementError::NoSuchRegion(target))?;
        let colocated: Vec<MachineId> = std::iter::once(p.primary)
            .chain(p.backups.iter().copied())
            .collect();
        if colocated.len() == replicas
            && colocated
                .iter()
                .all(|m| load.get(m).is_some_and(|l| *l < regions_max))
        {
            return Ok(colocated);
        }
    }
    let mut primaries: BTreeMap<MachineId, usize> = BTreeMap::new();
    for (_, p) in map.iter() {
        *primaries.entry(p.primary).or_default() += 1;
    }
    let domain = |m: &MachineId| config.failure_domains.get(m).copied().unwrap_or(m.0 as u32);
    let mut candidates: Vec<MachineId> = config
        .members
        .iter()
        .copied()
        .filter(|m| load[m] < regions_max)
        .collect();
    candidates.sort_by_key(|m| (load[m], *m));
    let mut chosen = Vec::new();
    let mut domains = BTreeSet::new();
    for m in candidates {
        if domains.insert(domain(&m)) {
            chosen.push(m);
            if chosen.len() == replicas {
                // Balance primaries too: the chosen machine with the fewest becomes primary.
                let first = (0..chosen.len())
                    .min_by_key(|i| {
                        (
                            primaries.get(&chosen[*i]).copied().unwrap_or(0),
                            load[&chosen[*i]],
                            chosen[*i],
                        )
                    })
                    .expect("non-empty");
                let primary = chosen.remove(first);
                chosen.insert(0, primary);
                return Ok(chosen);
            }
        }
    }
    Err(PlacementError::NoCapacity {
        needed: replicas,
        found: chosen.len(),
    })
}

/// Something the driver does for a [`RegionAlloc`].
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum AllocEffect {
    /// PREPARE: the machine reserves NVRAM for the region; answer with `on_prepared`.
    Prepare(MachineId, RegionId),
    /// COMMIT: the mapping is valid; the machine adds it to its region map.
    Commit(MachineId, RegionId, Placement),
    /// ABORT: the machine releases what it prepared.
    Abort(MachineId, RegionId),
}

/// The two-phase region allocation at the CM.
#[derive(Debug)]
pub struct RegionAlloc {
    region: RegionId,
    replicas: Vec<MachineId>,
    awaiting: BTreeSet<MachineId>,
    effects: Vec<AllocEffect>,
    outcome: Option<Result<Placement, PlacementError>>,
}

impl RegionAlloc {
    /// Starts allocating `region` on `replicas` (the first is the primary).
    pub fn start(region: RegionId, replicas: Vec<MachineId>) -> Self {
        assert!(!replicas.is_empty(), "a region needs a replica");
        let effects = replicas
            .iter()
            .map(|m| AllocEffect::Prepare(*m, region))
            .collect();
        Self {
            region,
            awaiting: replicas.iter().copied().collect(),
            replicas,
            effects,
            outcome: None,
        }
    }

    /// Effects to carry out, in order.
    pub fn take_effects(&mut self) -> Vec<AllocEffect> {
        std::mem::take(&mut self.effects)
    }

    /// A replica's answer to PREPARE.
    pub fn on_prepared(&mut self, m: MachineId, ok: bool) {
        if self.outcome.is_some() || !self.awaiting.remove(&m) {
            return;
        }
        if !ok {
            self.effects.extend(
                self.replicas
                    .iter()
                    .map(|r| AllocEffect::Abort(*r, self.region)),
            );
            self.outcome = Some(Err(PlacementError::Refused(m)));
            return;
        }
        if self.awaiting.is_empty() {
            let placement = Placement {
                primary: self.replicas[0],
                backups: self.replicas[1..].to_vec(),
            };
            self.effects.extend(
                self.replicas
                    .iter()
                    .map(|r| AllocEffect::Commit(*r, self.region, placement.clone())),
            );
            self.outcome = Some(Ok(placement));
        }
    }

    /// The outcome once decided (commit or abort effects are then pending).
    pub fn outcome(&self) -> Option<&Result<Placement, PlacementError>> {
        self.outcome.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_balance_load_and_failure_domains() {
        let mut config = Configuration::initial(5);
        // Machines 0 and 1 share a failure domain.
        config.failure_domains.insert(MachineId(1), 0);
        let map = RegionMap::striped(4, 1, 1); // machines 0..4 hold 2 replicas each, 4 none
        assert_eq!(next_region_id(&map), RegionId(4));
        let r = choose_replicas(&config, &map, 3, 8, None).unwrap();
        assert_eq!(r[0], MachineId(4), "the empty machine first");
        let domains: BTreeSet<u32> = r.iter().map(|m| config.failure_domains[m]).collect();
        assert_eq!(domains.len(), 3, "distinct failure domains: {r:?}");
        // Locality: the same machines as region 2.
        let near = choose_replicas(&config, &map, 2, 8, Some(RegionId(2))).unwrap();
        assert_eq!(near, vec![MachineId(2), MachineId(3)]);
        assert_eq!(
            choose_replicas(&config, &map, 2, 8, Some(RegionId(9))),
            Err(PlacementError::NoSuchRegion(RegionId(9)))
        );
        // Capacity: with room for 2 regions per machine only machine 4 qualifies.
        assert_eq!(
            choose_replicas(&config, &map, 2, 2, None),
            Err(PlacementError::NoCapacity {
                needed: 2,
                found: 1
            })
        );
    }

    /// §3: the mapping is committed only after every replica prepared; one refusal aborts all.
    #[test]
    fn primaries_rotate_when_regions_are_allocated_one_by_one() {
        let config = Configuration::initial(3);
        let mut map = RegionMap::default();
        for r in 0..6 {
            let chosen = choose_replicas(&config, &map, 3, 8, None).unwrap();
            map.insert(
                RegionId(r),
                Placement {
                    primary: chosen[0],
                    backups: chosen[1..].to_vec(),
                },
            );
        }
        for m in 0..3 {
            assert_eq!(
                map.primary_of(MachineId(m)).count(),
                2,
                "machine {m}: {map:?}"
            );
        }
    }

    #[test]
    fn two_phase_allocation_commits_only_when_all_prepared() {
        let replicas = vec![MachineId(2), MachineId(0), MachineId(1)];
        let mut a = RegionAlloc::start(RegionId(7), replicas.clone());
        assert_eq!(a.take_effects().len(), 3);
        a.on_prepared(MachineId(2), true);
        a.on_prepared(MachineId(0), true);
        assert!(
            a.outcome().is_none() && a.take_effects().is_empty(),
            "no commit before every prepare"
        );
        a.on_prepared(MachineId(1), true);
        let commits = a.take_effects();
        assert_eq!(commits.len(), 3);
        assert!(commits.iter().all(
            |e| matches!(e, AllocEffect::Commit(_, RegionId(7), p) if p.primary == MachineId(2))
        ));
        let mut b = RegionAlloc::start(RegionId(8), replicas);
        b.take_effects();
        b.on_prepared(MachineId(0), false);
        assert_eq!(
            b.outcome(),
            Some(&Err(PlacementError::Refused(MachineId(0))))
        );
        assert!(b
            .take_effects()
            .iter()
            .all(|e| matches!(e, AllocEffect::Abort(..))));
    }
}
