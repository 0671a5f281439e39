//! A machine's shared state: its NVRAM (region replicas, inbound rings, feedback slots), its view
//! of the configuration and region map, and its handle on the fabric. Worker threads of the same
//! machine share it; other machines reach it only through the fabric.

use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use farm_alloc::BlockPool;
use farm_core::config::{Configuration, RegionMap};
use farm_core::fabric::{Fabric, MemKey};
use farm_core::nvram::Nvram;
use farm_core::ring::RingLayout;
use farm_core::wire::RECORD_BYTES_MAX;
use farm_core::{MachineId, RegionId};

/// Parameters every machine of a cluster agrees on.
#[derive(Clone, Copy, Debug)]
pub struct Params {
    /// Ring sizes and counts.
    pub layout: RingLayout,
    /// Bytes per region (2 GB in FaRM; smaller for tests).
    pub region_bytes: usize,
    /// Read-validation threshold: above this many read-only objects at one primary, validate by
    /// RPC instead of one-sided reads (§4, `tr = 4`).
    pub validate_rpc_threshold: usize,
}

impl Params {
    /// Checks that the parameters are usable, naming the problem when not.
    pub fn validate(&self) -> Result<(), String> {
        self.layout.validate(RECORD_BYTES_MAX + 8)?;
        if !self.region_bytes.is_multiple_of(farm_alloc::BLOCK_BYTES)
            || self.region_bytes < 2 * farm_alloc::BLOCK_BYTES
        {
            return Err(format!(
                "region size {} must be a multiple of {} and at least two blocks",
                self.region_bytes,
                farm_alloc::BLOCK_BYTES
            ));
        }
        if self.region_bytes > u32::MAX as usize + 1 {
            return Err(format!(
                "region size {} exceeds 4 GB offsets",
                self.region_bytes
            ));
        }
        Ok(())
    }
}

/// What a machine knows about the cluster in one configuration: the configuration, where every
/// region lives, the local replicas and block pools, and which regions are blocked (§5.3 step 1:
/// regions whose replicas changed stay blocked until their transactions are recovered).
/// Immutable; a new configuration installs a new view ([`MachineState::install`]).
#[derive(Debug)]
pub struct View {
    /// The configuration.
    pub config: Configuration,
    /// Where every region lives.
    pub map: RegionMap,
    /// Regions nobody may access until recovery unblocks them.
    pub blocked: BTreeSet<RegionId>,
    regions: Vec<Option<Arc<Nvram>>>,
    pools: Vec<Option<Arc<BlockPool>>>,
}

impl View {
    /// The local replica of `region`, if this machine holds one.
    pub fn region(&self, region: RegionId) -> Option<&Arc<Nvram>> {
        self.regions.get(region.0 as usize).and_then(Option::as_ref)
    }

    /// The block pool of `region`, if this machine is its primary and allocates in it.
    pub fn pool(&self, region: RegionId) -> Option<&BlockPool> {
        self.pools.get(region.0 as usize).and_then(Option::as_deref)
    }

    /// Whether `region` is blocked.
    pub fn is_blocked(&self, region: RegionId) -> bool {
        self.blocked.contains(&region)
    }
}

/// One machine's shared state.
#[derive(Debug)]
pub struct MachineState {
    /// This machine.
    pub id: MachineId,
    /// Cluster parameters.
    pub params: Params,
    view: Mutex<Arc<View>>,
    view_generation: AtomicU64,
    nvram_dir: Option<PathBuf>,
    /// Regions prepared for allocation (§3) and not yet committed into a view.
    prepared: Mutex<std::collections::BTreeMap<RegionId, Arc<Nvram>>>,
    /// Inbound logs and message queues.
    pub rings: Arc<Nvram>,
    /// Truncation feedback written by receivers of this machine's records.
    pub feedback: Arc<Nvram>,
    /// The network.
    pub fabric: Arc<dyn Fabric>,
}

impl MachineState {
    /// Maps this machine's NVRAM (files under `nvram_dir/m<id>/`, or anonymous memory) for every
    /// region it holds, and registers it with the fabric.
    pub fn new(
        id: MachineId,
        params: Params,
        config: Configuration,
        region_map: RegionMap,
        fabric: Arc<dyn Fabric>,
        nvram_dir: Option<&Path>,
    ) -> io::Result<Arc<Self>> {
        params
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let nvram_dir = match nvram_dir {
            Some(d) => {
                let dir = d.join(format!("m{}", id.0));
                std::fs::create_dir_all(&dir)?;
                Some(dir)
            }
            None => None,
        };
        let rings = map_area(&nvram_dir, "rings", params.layout.rings_area_bytes())?;
        let feedback = map_area(&nvram_dir, "feedback", params.layout.feedback_area_bytes())?;
        fabric.register(id, MemKey::Rings, rings.clone());
        fabric.register(id, MemKey::Feedback, feedback.clone());
        let empty = View {
            config: config.clone(),
            map: RegionMap::default(),
            blocked: BTreeSet::new(),
            regions: Vec::new(),
            pools: Vec::new(),
        };
        let state = Arc::new(Self {
            id,
            params,
            view: Mutex::new(Arc::new(empty)),
            view_generation: AtomicU64::new(0),
            nvram_dir,
            prepared: Mutex::new(std::collections::BTreeMap::new()),
            rings,
            feedback,
            fabric,
        });
        state.install(config, region_map, BTreeSet::new())?;
        Ok(state)
    }

    /// The current view.
    pub fn view(&self) -> Arc<View> {
        self.view.lock().expect("view poisoned").clone()
    }

    /// Increases with every installed view; workers compare it to refresh their copy cheaply.
    pub fn view_generation(&self) -> u64 {
        self.view_generation.load(Ordering::Acquire)
    }

    /// Installs a new configuration and region map (NEW-CONFIG, §5.2 step 5): maps and registers
    /// the replicas this machine newly holds (new backups start empty; data recovery fills them,
    /// §5.4), keeps the ones it still holds, and keeps block pools only for regions it was
    /// already primary for (a promoted primary's free lists are rebuilt by allocator recovery,
    /// §5.5, and it stays blocked until then).
    pub fn install(
        &self,
        config: Configuration,
        map: RegionMap,
        blocked: BTreeSet<RegionId>,
    ) -> io::Result<()> {
        let mut guard = self.view.lock().expect("view poisoned");
        let old = guard.clone();
        let first = old.map.iter().next().is_none();
        let mut regions = Vec::new();
        let mut pools = Vec::new();
        for (region, placement) in map.iter() {
            if !placement.holds(self.id) {
                continue;
            }
            let idx = region.0 as usize;
            if regions.len() <= idx {
                regions.resize(idx + 1, None);
                pools.resize_with(idx + 1, || None);
            }
            let prepared = self
                .prepared
                .lock()
                .expect("prepared poisoned")
                .remove(&region);
            let mem = match (old.region(region), prepared) {
                (Some(m), _) => m.clone(),
                (None, Some(m)) => m,
                (None, None) => self.map_region(region)?,
            };
            regions[idx] = Some(mem);
            if placement.primary == self.id {
                pools[idx] = match old.pools.get(idx).and_then(Option::as_ref) {
                    Some(p) => Some(p.clone()),
                    // A region new to the map (first configuration, or just allocated) is empty.
                    None if first || old.map.get(region).is_none() => {
                        Some(Arc::new(BlockPool::new(self.params.region_bytes)))
                    }
                    None => None,
                };
            }
        }
        *guard = Arc::new(View {
            config,
            map,
            blocked,
            regions,
            pools,
        });
        self.view_generation.fetch_add(1, Ordering::Release);
        Ok(())
    }
}

impl MachineState {
    fn map_region(&self, region: RegionId) -> io::Result<Arc<Nvram>> {
        let m = map_area(
            &self.nvram_dir,
            &format!("region-{}", region.0),
            self.params.region_bytes,
        )?;
        self.fabric
            .register(self.id, MemKey::Region(region), m.clone());
        Ok(m)
    }

    /// PREPARE of region allocation (§3): maps and registers NVRAM for `region`, to be used when
    /// a view that places a replica here is installed.
    pub fn prepare_region(&self, region: RegionId) -> io::Result<()> {
        let mem = self.map_region(region)?;
        self.prepared
            .lock()
            .expect("prepared poisoned")
            .insert(region, mem);
        Ok(())
    }

    /// ABORT of region allocation: forgets a prepared region.
    pub fn abort_region(&self, region: RegionId) {
        self.prepared
            .lock()
            .expect("prepared poisoned")
            .remove(&region);
    }
}

fn map_area(dir: &Option<PathBuf>, name: &str, len: usize) -> io::Result<Arc<Nvram>> {
    Ok(Arc::new(match dir {
        Some(dir) => Nvram::file(&dir.join(name), len)?,
        None => Nvram::anonymous(len)?,
    }))
}
