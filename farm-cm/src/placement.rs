//! Region allocation (FaRM §3): the CM assigns the next region id from its counter, chooses
//! replicas — enough capacity, each in a different failure domain, co-located with a target
//! region when the application asks for locality, otherwise balancing regions per machine — and
//! runs a two-phase protocol with them (PREPARE at every replica, [`Preparing`], then the commit)
//! so that a mapping is valid and replicated at every replica before anyone uses it. The commit
//! is a configuration change with the same members (`crate::plane`): the map with the new
//! regions is installed at every member and committed as NEW-CONFIG is, so that whichever
//! machine is CM next knows the regions.

use std::collections::{BTreeMap, BTreeSet};

use farm_core::config::{Configuration, Placement, RegionMap};
use farm_core::{ConfigId, MachineId, RegionId};

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

/// Regions one request may allocate at most.
pub const ALLOCATION_REGIONS_MAX: u32 = 1024;

/// A member's request to allocate regions (§3), as the CM holds it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct AllocRequest {
    /// The member that asked.
    pub from: MachineId,
    /// Its id of the request.
    pub request: u64,
    /// Regions wanted (1 to [`ALLOCATION_REGIONS_MAX`]).
    pub count: u32,
    /// A region whose replicas the new ones should share.
    pub near: Option<RegionId>,
}

/// Why an allocation failed after its regions were placed.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum PrepareError {
    /// A replica refused to prepare (out of NVRAM, or the region is already in its map).
    #[error("machine {0} refused to prepare the regions")]
    Refused(MachineId),
    /// Replicas did not answer PREPARE in time.
    #[error("machines {0:?} did not answer PREPARE in time")]
    Silent(Vec<MachineId>),
}

/// The first phase of a region allocation at the CM (§3): the regions are placed against the
/// map (each against the map with the ones before it), and every chosen replica is asked to
/// PREPARE the new regions it holds, one request per replica. The allocation commits (the
/// driver installs the map with the new regions in a new configuration, §5.2 steps 3-7) only
/// once every replica prepared; a refusal or a replica silent past the deadline fails it, and
/// every replica releases what it prepared ([`Preparing::replicas`]).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Preparing {
    /// The request.
    pub request: AllocRequest,
    /// The configuration the regions were placed in.
    pub config: ConfigId,
    /// The map with the new regions.
    pub map: RegionMap,
    /// The new regions, in allocation order.
    pub regions: Vec<RegionId>,
    /// Per chosen replica, the new regions it holds.
    replicas: BTreeMap<MachineId, Vec<RegionId>>,
    /// Replicas that have not prepared yet.
    awaiting: BTreeSet<MachineId>,
    refused: Option<MachineId>,
    deadline: u64,
}

impl Preparing {
    /// Places `request.count` regions in `config` over `map`, with `replicas` per region and
    /// at most `regions_max` per machine; PREPARE is answered by `deadline`.
    pub fn start(
        request: AllocRequest,
        config: &Configuration,
        map: &RegionMap,
        replicas: usize,
        regions_max: usize,
        deadline: u64,
    ) -> Result<Self, PlacementError> {
        assert!(
            (1..=ALLOCATION_REGIONS_MAX).contains(&request.count),
            "allocating {} regions",
            request.count
        );
        let mut map = map.clone();
        let mut regions = Vec::with_capacity(request.count as usize);
        let mut held: BTreeMap<MachineId, Vec<RegionId>> = BTreeMap::new();
        for _ in 0..request.count {
            let region = next_region_id(&map);
            let chosen = choose_replicas(config, &map, replicas, regions_max, request.near)?;
            for m in &chosen {
                held.entry(*m).or_default().push(region);
            }
            map.insert(
                region,
                Placement {
                    primary: chosen[0],
                    backups: chosen[1..].to_vec(),
                },
            );
            regions.push(region);
        }
        Ok(Self {
            request,
            config: config.id,
            map,
            regions,
            awaiting: held.keys().copied().collect(),
            replicas: held,
            refused: None,
            deadline,
        })
    }

    /// PREPARE for every replica that has not answered (sent at the start and repeated).
    pub fn prepares(&self) -> impl Iterator<Item = (MachineId, &[RegionId])> + '_ {
        self.awaiting
            .iter()
            .map(|m| (*m, self.replicas[m].as_slice()))
    }

    /// Every chosen replica with its new regions (for ABORT).
    pub fn replicas(&self) -> impl Iterator<Item = (MachineId, &[RegionId])> + '_ {
        self.replicas.iter().map(|(m, r)| (*m, r.as_slice()))
    }

    /// Whether `map` maps every new region: a configuration placed with them was installed
    /// (its attempt may still fail to commit it; the CM then drives it again).
    pub fn mapped_in(&self, map: &RegionMap) -> bool {
        !self.regions.is_empty() && self.regions.iter().all(|r| map.get(*r).is_some())
    }

    /// `m`'s answer to PREPARE of `regions` (answers to another PREPARE are ignored).
    pub fn on_prepared(&mut self, m: MachineId, regions: &[RegionId], ok: bool) {
        if self
            .replicas
            .get(&m)
            .is_none_or(|r| r.as_slice() != regions)
        {
            return;
        }
        if !ok && self.refused.is_none() {
            self.refused = Some(m);
        }
        self.awaiting.remove(&m);
    }

    /// The outcome at `now`: `Some(Ok)` once every replica prepared, an error once one refused
    /// or the deadline passed with replicas silent, `None` while waiting.
    pub fn outcome(&self, now: u64) -> Option<Result<(), PrepareError>> {
        if let Some(m) = self.refused {
            return Some(Err(PrepareError::Refused(m)));
        }
        if self.awaiting.is_empty() {
            return Some(Ok(()));
        }
        (now >= self.deadline).then(|| {
            Err(PrepareError::Silent(
                self.awaiting.iter().copied().collect(),
            ))
        })
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

    fn request(count: u32, near: Option<RegionId>) -> AllocRequest {
        AllocRequest {
            from: MachineId(1),
            request: 1,
            count,
            near,
        }
    }

    /// §3: an allocation commits only after every replica prepared; one refusal, or one
    /// replica silent past the deadline, fails it.
    #[test]
    fn an_allocation_is_ready_only_when_every_replica_prepared() {
        let config = Configuration::initial(4);
        let map = RegionMap::striped(4, 1, 1);
        let mut p = Preparing::start(request(2, None), &config, &map, 3, 8, 100).unwrap();
        assert_eq!(p.regions, vec![RegionId(4), RegionId(5)]);
        assert!(p.regions.iter().all(|r| p.map.get(*r).is_some()));
        let asked: Vec<(MachineId, Vec<RegionId>)> =
            p.prepares().map(|(m, r)| (m, r.to_vec())).collect();
        let held: usize = asked.iter().map(|(_, r)| r.len()).sum();
        assert_eq!(held, 6, "two regions, three replicas each: {asked:?}");
        for (m, regions) in &asked[..asked.len() - 1] {
            p.on_prepared(*m, regions, true);
            assert_eq!(p.outcome(99), None, "ready before every replica prepared");
        }
        // An answer to another PREPARE changes nothing.
        let (last, regions) = asked.last().unwrap().clone();
        p.on_prepared(last, &[RegionId(9)], true);
        assert_eq!(p.outcome(99), None);
        p.on_prepared(last, &regions, true);
        assert_eq!(p.outcome(99), Some(Ok(())));

        let mut refused = Preparing::start(request(1, None), &config, &map, 3, 8, 100).unwrap();
        let (m, regions) = refused
            .prepares()
            .map(|(m, r)| (m, r.to_vec()))
            .next()
            .unwrap();
        refused.on_prepared(m, &regions, false);
        assert_eq!(refused.outcome(0), Some(Err(PrepareError::Refused(m))));

        let silent =
            Preparing::start(request(1, Some(RegionId(0))), &config, &map, 2, 8, 100).unwrap();
        assert_eq!(
            silent.outcome(100),
            Some(Err(PrepareError::Silent(vec![MachineId(0), MachineId(1)])))
        );
    }
}
