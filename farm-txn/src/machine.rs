//! A machine's shared state: its NVRAM (region replicas, inbound rings, feedback slots), its view
//! of the configuration and region map, and its handle on the fabric. Worker threads of the same
//! machine share it; other machines reach it only through the fabric.

use std::io;
use std::path::Path;
use std::sync::Arc;

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

/// One machine's shared state.
#[derive(Debug)]
pub struct MachineState {
    /// This machine.
    pub id: MachineId,
    /// Cluster parameters.
    pub params: Params,
    /// The configuration this machine is in.
    pub config: Configuration,
    /// Where every region lives.
    pub region_map: RegionMap,
    /// Region replicas held here, by region id.
    regions: Vec<Option<Arc<Nvram>>>,
    /// Unused blocks of the regions this machine is primary for.
    pools: Vec<Option<BlockPool>>,
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
        let dir = match nvram_dir {
            Some(d) => {
                let dir = d.join(format!("m{}", id.0));
                std::fs::create_dir_all(&dir)?;
                Some(dir)
            }
            None => None,
        };
        let map = |name: String, len: usize| -> io::Result<Arc<Nvram>> {
            Ok(Arc::new(match &dir {
                Some(dir) => Nvram::file(&dir.join(name), len)?,
                None => Nvram::anonymous(len)?,
            }))
        };
        let mut regions = Vec::new();
        let mut pools = Vec::new();
        for (region, placement) in region_map.iter() {
            if !placement.holds(id) {
                continue;
            }
            let idx = region.0 as usize;
            if regions.len() <= idx {
                regions.resize(idx + 1, None);
                pools.resize_with(idx + 1, || None);
            }
            let mem = map(format!("region-{}", region.0), params.region_bytes)?;
            fabric.register(id, MemKey::Region(region), mem.clone());
            regions[idx] = Some(mem);
            if placement.primary == id {
                pools[idx] = Some(BlockPool::new(params.region_bytes));
            }
        }
        let rings = map("rings".into(), params.layout.rings_area_bytes())?;
        let feedback = map("feedback".into(), params.layout.feedback_area_bytes())?;
        fabric.register(id, MemKey::Rings, rings.clone());
        fabric.register(id, MemKey::Feedback, feedback.clone());
        Ok(Arc::new(Self {
            id,
            params,
            config,
            region_map,
            regions,
            pools,
            rings,
            feedback,
            fabric,
        }))
    }

    /// The local replica of `region`, if this machine holds one.
    pub fn region(&self, region: RegionId) -> Option<&Arc<Nvram>> {
        self.regions.get(region.0 as usize).and_then(Option::as_ref)
    }

    /// The block pool of `region`, if this machine is its primary.
    pub fn pool(&self, region: RegionId) -> Option<&BlockPool> {
        self.pools.get(region.0 as usize).and_then(Option::as_ref)
    }

    /// Regions this machine is primary for.
    pub fn primary_regions(&self) -> impl Iterator<Item = RegionId> + '_ {
        self.region_map.primary_of(self.id)
    }
}
