//! A machine's shared state: its NVRAM (region replicas, inbound rings, feedback slots), its view
//! of the configuration and region map, and its handle on the fabric. Worker threads of the same
//! machine share it; other machines reach it only through the fabric.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use farm_alloc::BlockPool;
use farm_cm::restart::Persisted;
use farm_core::config::{Configuration, RegionChanges, RegionMap};
use farm_core::fabric::{Fabric, MemKey};
use farm_core::nvram::{files, Nvram};
use farm_core::ring::RingLayout;
use farm_core::wire::RECORD_BYTES_MAX;
use farm_core::ThreadId;
use farm_core::{ConfigId, MachineId, RegionId};

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
    /// Ticks between steps of data recovery (one 8 KB chunk) and allocator recovery (a batch of
    /// slots), so that recovery does not take the machine from the foreground (§5.4-5.5).
    pub recovery_interval_ticks: u64,
    /// How backups acknowledge COMMIT-BACKUP.
    pub replication: Replication,
    /// The lease length at start, in the ticks `now` counts (microseconds in the runtime; a
    /// lease changed later, `Cluster::set_lease`, leaves these timeouts as they are). The
    /// protocol's own timeouts are fractions of it ([`Params::request_vote_ticks`],
    /// [`Params::truncate_delay_ticks`]), so that every deployment keeps the same ratios.
    pub lease_ticks: u64,
}

/// REQUEST-VOTE timeouts per lease: a recovery coordinator asks for missing votes after a
/// 400th of a lease (§5.3 step 6 says "after a timeout"; 250 µs of the default 100 ms lease).
pub const REQUEST_VOTES_PER_LEASE: u64 = 400;

/// Explicit-truncation delays per lease: a truncatable transaction waits a 500th of a lease
/// (200 µs of 100 ms) for a record to piggyback its truncation on (§4 step 5).
pub const TRUNCATE_DELAYS_PER_LEASE: u64 = 500;

/// How backups acknowledge COMMIT-BACKUP (§4 step 3).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Replication {
    /// FaRM: the coordinator waits for the completion of the one-sided write of the record into
    /// the backup's NVRAM log; the backup's CPU takes part only later, when it processes the log
    /// and at truncation (§4).
    #[default]
    OneSided,
    /// RPC-based replication, the baseline of Tailwind (ATC'18) and of RAMCloud: the backup's
    /// CPU processes the record (decodes it and copies its writes out of the log into memory)
    /// and replies; the coordinator waits for the reply. The record is still written to the log
    /// first, so recovery is unchanged. Backups still install the writes at truncation: before
    /// the outcome is known they cannot, since recovery may yet abort a transaction whose
    /// COMMIT-BACKUP reached some backups (§5.3 step 7).
    Rpc,
}

impl Params {
    /// Ticks a recovery coordinator waits for votes before sending REQUEST-VOTE (at least one).
    pub fn request_vote_ticks(&self) -> u64 {
        (self.lease_ticks / REQUEST_VOTES_PER_LEASE).max(1)
    }

    /// Ticks a truncatable transaction waits for a piggyback before an explicit TRUNCATE is
    /// sent (at least one).
    pub fn truncate_delay_ticks(&self) -> u64 {
        (self.lease_ticks / TRUNCATE_DELAYS_PER_LEASE).max(1)
    }

    /// Checks that the parameters are usable, naming the problem when not.
    pub fn validate(&self) -> Result<(), String> {
        self.layout.validate(RECORD_BYTES_MAX + 8)?;
        if self.lease_ticks == 0 {
            return Err("the lease must be at least one tick".into());
        }
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

/// A data or allocator recovery milestone at one machine, with the worker tick it happened at
/// (microseconds since the cluster started in the runtime).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RecoveryEvent {
    /// This machine started copying a region it is a new backup of (§5.4).
    DataRecoveryStarted {
        /// The region.
        region: RegionId,
        /// Copied without pauses: the region was down to one replica holding its data.
        aggressive: bool,
        /// When.
        at: u64,
    },
    /// The copy is complete: the region has all its replicas again.
    DataRecoveryDone {
        /// The region.
        region: RegionId,
        /// Objects installed.
        objects: usize,
        /// When.
        at: u64,
    },
    /// This (new) primary rebuilt the region's free lists (§5.5).
    AllocatorRecovered {
        /// The region.
        region: RegionId,
        /// When.
        at: u64,
    },
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
    /// When each region last changed primary and replicas (NEW-CONFIG carries these, §5.3
    /// step 3: they decide which transactions are recovering).
    pub changes: BTreeMap<RegionId, RegionChanges>,
    /// Regions whose replicas ever changed: each is blocked until lock recovery at its primary
    /// made it active in a configuration at or after its last replica change (§5.3 steps 1
    /// and 4), which may be a later configuration than the change when recovery was
    /// interrupted by another failure.
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

    /// Whether `region` may be blocked in this configuration (whether it is depends on its
    /// primary: see `Worker::region_blocked`).
    pub fn is_blocked(&self, region: RegionId) -> bool {
        self.blocked.contains(&region)
    }

    /// Whether a transaction that started committing in an earlier configuration and wrote
    /// `written` is recovering in this one, as replicas see it (§5.3 step 3,
    /// [`farm_recovery::vote::is_recovering`]); the condition on read regions is the
    /// coordinator's (`Worker::check_view`).
    pub fn is_recovering(&self, txn: farm_core::TxnId, written: &[RegionId]) -> bool {
        farm_recovery::vote::is_recovering(txn, written, &[], &self.config, &self.changes)
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
    /// Held by whoever installs a view (the control plane, region allocation), through the
    /// persistence of the view; the view's own lock only while it is swapped.
    installing: Mutex<()>,
    /// The regions whose replica here is complete, where reconfiguration probes read them
    /// ([`MemKey::Replicas`]; see [`MachineState::publish_complete`]).
    complete: Arc<Nvram>,
    /// What `complete` holds: the complete replicas and the members this machine cannot write
    /// to, each changed on its own and written together ([`MachineState::publish_unreachable`]).
    published: Mutex<(Vec<RegionId>, Vec<MachineId>)>,
    /// The regions still to copy, as published with `complete` (the control plane reads them
    /// at every step; a copy of `to_copy`'s keys made only when it changes).
    copying: Mutex<Arc<BTreeSet<RegionId>>>,
    view_generation: AtomicU64,
    /// Increases each time the control plane forgives the CM it could not remove
    /// (`farm_cm::Effect::ForgiveCm`); the lease manager renews with it again.
    cm_forgiven: AtomicU64,
    /// Increases each time the control plane, as CM, forgives the members it suspected and
    /// could not remove (`farm_cm::Effect::ForgiveMember`); the lease manager takes their
    /// requests again.
    members_forgiven: AtomicU64,
    nvram_dir: Option<PathBuf>,
    /// Regions prepared for allocation (§3) and not yet committed into a view.
    prepared: Mutex<std::collections::BTreeMap<RegionId, Arc<Nvram>>>,
    /// Memory kept ready for replicas this machine newly takes
    /// ([`MachineState::keep_spare_regions`]).
    spares: Arc<Mutex<SpareRegions>>,
    /// The newest configuration whose NEW-CONFIG-COMMIT this machine received (§5.2 step 7);
    /// transaction recovery for it starts then (§5.3 step 2).
    committed: AtomicU64,
    /// The newest configuration some thread drained its logs for, and the threads that did
    /// (§5.3 step 4: lock recovery waits until every local log is drained).
    drained: Mutex<(ConfigId, BTreeSet<u16>)>,
    /// Per region being recovered here as primary: the configuration and the threads whose
    /// lock recovery is done (§5.3 step 4; the region is active when all are).
    lock_recovery: Mutex<BTreeMap<RegionId, (ConfigId, BTreeSet<u16>)>>,
    /// Objects locked by transaction recovery, with the number of recovering transactions
    /// holding each (two recovering transactions may have written the same object in turn).
    recovery_locks: Mutex<BTreeMap<(RegionId, u32), u32>>,
    /// ALL-REGIONS-ACTIVE (§5.4): the newest configuration in which every region was active.
    all_active: AtomicU64,
    /// See [`MachineState::all_active_at`].
    all_active_at: AtomicU64,
    /// Removed from the configuration while alive (a false suspicion or a partition): its
    /// coordinators can no longer commit, since members ignore its logs (§5.2).
    evicted: std::sync::atomic::AtomicBool,
    /// Until when (in the ticks of the machine's lease manager, which the runtime's polls
    /// share) this machine may tell an application what it read; see [`MachineState::serves_at`].
    serves_until: AtomicU64,
    /// Regions this machine holds as a new backup, still to be copied from their primary.
    /// With whether the region is down to one replica that holds its data (then the copy runs
    /// at the aggressive pace, §5.4). Kept in NVRAM too (a restart must not take an unfinished
    /// copy for a replica).
    to_copy: Mutex<BTreeMap<RegionId, bool>>,
    /// What the NVRAM directory says of `to_copy`, so that it is rewritten only when it changes.
    copying_persisted: Mutex<BTreeMap<RegionId, bool>>,
    /// The views this machine installed that a restart may still need: the newest, and those
    /// some thread last drained a log in (its drain mark names them). Kept in NVRAM too.
    views: Mutex<BTreeMap<ConfigId, farm_core::codec::StoredView>>,
    /// Frees committed at regions whose free lists allocator recovery has not rebuilt yet
    /// (§5.5), or whose thread had no slabs yet.
    queued_frees: Mutex<Vec<(farm_core::Addr, u32)>>,
    /// Data and allocator recovery milestones, for timelines.
    events: Mutex<Vec<RecoveryEvent>>,
    /// The configuration this machine restarted into after the whole cluster stopped, if it
    /// did: its first round of transaction recovery recovers every transaction in its logs.
    restart: Option<ConfigId>,
    /// After a restart, the view the cluster restarted from (placements as the previous life
    /// left them; a primary moved by the restart has its change at the restart).
    restored: Option<farm_core::codec::StoredView>,
    /// Per local thread, the newest configuration whose transaction recovery that thread
    /// finished (it drained the configuration and holds no recovering transaction).
    settled_threads: Mutex<BTreeMap<u16, ConfigId>>,
    /// The newest configuration this machine settled in ([`MachineState::settled_config`]).
    settled: AtomicU64,
    /// Per local thread, the view generation its worker picked up last.
    refreshed: Vec<AtomicU64>,
    /// Per machine, the view generation in which it last joined this machine's view (a new
    /// incarnation, writing into rings started afresh): each worker starts afresh with it when
    /// it picks up that view or a later one (`Worker::refresh_view`). 0: never joined since
    /// this machine started.
    joined: Vec<AtomicU64>,
    /// Per worker thread and peer, the links a worker cut (`Worker::cut`): the peer's
    /// `joined` generation then, plus one (0: not cut). A later incarnation of the peer has
    /// another generation, so the mark does not follow it.
    cut: Vec<AtomicU64>,
    /// The newest of `joined`: NEW-CONFIG is acknowledged once every worker got that far.
    joined_latest: AtomicU64,
    /// A new incarnation waiting to join ([`MachineState::joiner`]): the view that adds it is
    /// its first with data, and every replica it gets there is copied (§5.4).
    joining: std::sync::atomic::AtomicBool,
    /// The first configuration of this life with this machine a member (0: none yet): it
    /// begins no transaction before that configuration commits ([`MachineState::may_begin`]).
    member_since: AtomicU64,
    /// This machine's request for another region when its own are full (§3).
    pub growth: crate::growth::RegionGrowth,
    /// Persistent state: [`STATE_MAGIC`], which marks the directory as a farm-rs machine's.
    state: Arc<Nvram>,
    /// Inbound logs and message queues.
    pub rings: Arc<Nvram>,
    /// Per inbound ring, how far this machine freed it ([`farm_core::ring::HeadWord`]), at the
    /// offsets of feedback slots.
    pub heads: Arc<Nvram>,
    /// Per inbound log, the truncation bound its sender thread piggybacked last
    /// ([`MachineState::truncation_offset`]): after a restart, a primary promoted since still
    /// knows which transactions of the previous life finished (§5.3 step 6 votes).
    pub truncation: Arc<Nvram>,
    /// Truncation feedback written by receivers of this machine's records.
    pub feedback: Arc<Nvram>,
    /// Per worker thread, the recovery log: the recovery messages (REPLICATE-TX-STATE,
    /// COMMIT-RECOVERY, ABORT-RECOVERY) the thread processed, kept until their transaction is
    /// forgotten, so that a whole-cluster restart sees what the queue no longer holds
    /// ([`MachineState::recovery_log_ring`]).
    pub recovery_log: Arc<Nvram>,
    /// Per inbound log, the drain mark: where the log stood when this thread last drained it
    /// and the configuration it drained (§5.3 step 2). A restart knows from it which records
    /// landed after the drain, which recovery had rejected ([`MachineState::drain_mark`]).
    pub drain_marks: Arc<Nvram>,
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
        let state = Self::open(
            id,
            params,
            &config,
            fabric,
            nvram_dir.map(Reopen::Dir),
            None,
        )?;
        state.settled.store(config.id.0, Ordering::Release);
        state.install(config, region_map, BTreeMap::new())?;
        Ok(state)
    }

    /// A new incarnation of machine `id` that will join `config` (a configuration without it,
    /// §5.2): whatever an earlier life left under `nvram_dir` is forgotten first
    /// ([`forget_state`]), and every replica the joining view gives it is copied from its
    /// primary (§5.4).
    pub fn joiner(
        id: MachineId,
        params: Params,
        config: Configuration,
        fabric: Arc<dyn Fabric>,
        nvram_dir: Option<&Path>,
    ) -> io::Result<Arc<Self>> {
        assert!(!config.contains(id), "{id} joins a configuration it is in");
        if let Some(dir) = nvram_dir {
            forget_state(dir, id)?;
        }
        let state = Self::new(id, params, config, RegionMap::default(), fabric, nvram_dir)?;
        state.joining.store(true, Ordering::Release);
        Ok(state)
    }

    /// Reopens the NVRAM a machine left when the whole cluster stopped (`from`), with the view
    /// the cluster restarts from (`stored`, see [`read_persisted`] and `farm_cm::restart`), and
    /// installs `restart`: the same members and regions in a new configuration in which every
    /// region changed primary and replicas, so that transaction recovery recovers every
    /// transaction in the logs (§5.3) and allocator recovery rebuilds every free list (§5.5).
    /// Replicas of `stored` this machine did not hold in its own newest view, or was still
    /// copying, are copied again from their primaries (§5.4).
    /// The caller commits `restart` once every machine is open.
    pub fn restore(
        id: MachineId,
        params: Params,
        stored: farm_core::codec::StoredView,
        restart: ConfigId,
        fabric: Arc<dyn Fabric>,
        from: Reopen<'_>,
    ) -> io::Result<Arc<Self>> {
        let farm_core::codec::StoredView {
            config,
            map,
            changes,
        } = stored;
        assert!(restart > config.id, "a restart needs a new configuration");
        let restored = farm_core::codec::StoredView {
            config: config.clone(),
            map: map.clone(),
            changes: changes.clone(),
        };
        let state = Self::open(
            id,
            params,
            &config,
            fabric,
            Some(from),
            Some((restart, restored)),
        )?;
        let own = state
            .views
            .lock()
            .expect("poisoned")
            .last_key_value()
            .map(|(_, v)| v.clone());
        let incomplete: BTreeMap<RegionId, bool> = {
            let copying = state.to_copy.lock().expect("poisoned");
            map.iter()
                .filter(|(r, p)| {
                    let held = own
                        .as_ref()
                        .and_then(|v| v.map.get(*r))
                        .is_some_and(|q| q.holds(id));
                    p.holds(id) && (!held || copying.contains_key(r))
                })
                .map(|(r, _)| (r, true))
                .collect()
        };
        *state.to_copy.lock().expect("poisoned") = incomplete;
        let genuine = state.installed_view(config.id);
        state.install_view(config.clone(), map.clone(), changes, false)?;
        // A restart without machines that did not come back gives the newest configuration
        // without them, under its own id. Records that landed after this machine's last drain
        // are judged by the view it installed under that id (a transaction those machines
        // coordinated is no recovering one), so that view is what stays kept under it.
        if let Some(v) = genuine.filter(|v| v.config != config) {
            state.persist_stored_view(&v.config, &v.map, &v.changes)?;
        }
        // Every region changes primary at the restart: lock recovery locks again what the
        // recovering transactions wrote, and no lock bit of the previous life has a holder.
        let view = state.view();
        for (region, _) in view.map.iter() {
            if let Some(mem) = view.region(region) {
                let cleared = farm_recovery::locks::clear_locks(mem, params.region_bytes);
                if cleared > 0 {
                    tracing::debug!(
                        machine = id.0,
                        region = region.0,
                        cleared,
                        "lock bits of the previous life cleared"
                    );
                }
            }
        }
        let all_changed = map
            .iter()
            .map(|(r, _)| {
                let c = RegionChanges {
                    last_primary_change: restart,
                    last_replica_change: restart,
                };
                (r, c)
            })
            .collect();
        let new = Configuration {
            id: restart,
            ..config
        };
        state.install_view(new, map, all_changed, false)?;
        Ok(state)
    }

    /// Maps (or, from the memory of a stopped machine, takes over) this machine's NVRAM areas.
    fn open(
        id: MachineId,
        params: Params,
        config: &Configuration,
        fabric: Arc<dyn Fabric>,
        from: Option<Reopen<'_>>,
        restart: Option<(ConfigId, farm_core::codec::StoredView)>,
    ) -> io::Result<Arc<Self>> {
        let (restart, plan_view) = restart.unzip();
        params
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let nvram_dir = match from {
            Some(Reopen::Dir(d)) => {
                let dir = machine_dir(d, id);
                files::create_dir(&dir)?;
                Some(dir)
            }
            _ => None,
        };
        let mut prepared = BTreeMap::new();
        let truncation_bytes = params.layout.feedback_area_bytes() / 2;
        let (rings, feedback, heads, truncation, state) = match from {
            Some(Reopen::Memory(old)) => {
                // Its regions come back as if prepared: the views installed next use them.
                let view = old.view();
                for (region, _) in view.map.iter() {
                    if let Some(mem) = view.region(region) {
                        fabric.register(id, MemKey::Region(region), mem.clone());
                        prepared.insert(region, mem.clone());
                    }
                }
                (
                    old.rings.clone(),
                    old.feedback.clone(),
                    old.heads.clone(),
                    old.truncation.clone(),
                    old.state.clone(),
                )
            }
            _ => (
                map_area(&nvram_dir, "rings", params.layout.rings_area_bytes())?,
                map_area(&nvram_dir, "feedback", params.layout.feedback_area_bytes())?,
                map_area(&nvram_dir, "heads", params.layout.feedback_area_bytes())?,
                map_area(&nvram_dir, "truncation", truncation_bytes)?,
                map_area(&nvram_dir, "state", STATE_BYTES)?,
            ),
        };
        let (recovery_log, drain_marks, views, to_copy) = match from {
            Some(Reopen::Memory(old)) => (
                old.recovery_log.clone(),
                old.drain_marks.clone(),
                old.views.lock().expect("poisoned").clone(),
                old.regions_to_copy(),
            ),
            _ => (
                map_area(&nvram_dir, "recovery-log", recovery_log_bytes(&params))?,
                map_area(&nvram_dir, "drain-marks", truncation_bytes * 2)?,
                match &nvram_dir {
                    Some(dir) => read_views(dir, id)?,
                    None => BTreeMap::new(),
                },
                match &nvram_dir {
                    Some(dir) => read_copying(dir)?,
                    None => BTreeMap::new(),
                },
            ),
        };
        let restored = plan_view
            .zip(restart)
            .map(|(v, r)| as_restored(v, id, r, views.values().last()));
        match state.load_u64(0, Ordering::Acquire) {
            0 => state.store_u64(0, STATE_MAGIC, Ordering::Release),
            STATE_MAGIC => {}
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "NVRAM state of machine {id} has magic {other:#x}, not a farm-rs machine's"
                    ),
                ))
            }
        }
        fabric.register(id, MemKey::Rings, rings.clone());
        fabric.register(id, MemKey::Feedback, feedback.clone());
        // Rewritten from the view at every install: nothing is complete before the first. A
        // file of an earlier layout's size (before the unreachable members) is resized in
        // place: the same file that peers on `shm` may have mapped.
        let complete = match map_area(&nvram_dir, "replicas", COMPLETE_AREA_BYTES) {
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                let dir = nvram_dir.as_ref().expect("a file of the wrong size");
                files::resize(dir, "replicas", COMPLETE_AREA_BYTES as u64)?;
                map_area(&nvram_dir, "replicas", COMPLETE_AREA_BYTES)?
            }
            other => other?,
        };
        write_complete(&complete, &[], &[]);
        fabric.register(id, MemKey::Replicas, complete.clone());
        let empty = View {
            config: config.clone(),
            map: RegionMap::default(),
            changes: BTreeMap::new(),
            blocked: BTreeSet::new(),
            regions: Vec::new(),
            pools: Vec::new(),
        };
        Ok(Arc::new(Self {
            id,
            params,
            view: Mutex::new(Arc::new(empty)),
            installing: Mutex::new(()),
            complete,
            published: Mutex::new((Vec::new(), Vec::new())),
            copying: Mutex::new(Arc::default()),
            view_generation: AtomicU64::new(0),
            cm_forgiven: AtomicU64::new(0),
            members_forgiven: AtomicU64::new(0),
            nvram_dir,
            prepared: Mutex::new(prepared),
            spares: Arc::default(),
            committed: AtomicU64::new(config.id.0),
            drained: Mutex::new((config.id, BTreeSet::new())),
            all_active: AtomicU64::new(config.id.0),
            all_active_at: AtomicU64::new(0),
            evicted: std::sync::atomic::AtomicBool::new(false),
            serves_until: AtomicU64::new(0),
            copying_persisted: Mutex::new(to_copy.clone()),
            to_copy: Mutex::new(to_copy),
            views: Mutex::new(views),
            queued_frees: Mutex::new(Vec::new()),
            events: Mutex::new(Vec::new()),
            lock_recovery: Mutex::new(BTreeMap::new()),
            recovery_locks: Mutex::new(BTreeMap::new()),
            restart,
            restored,
            settled_threads: Mutex::new(BTreeMap::new()),
            settled: AtomicU64::new(0),
            refreshed: (0..params.layout.threads)
                .map(|_| AtomicU64::new(0))
                .collect(),
            joined: (0..params.layout.machines_max)
                .map(|_| AtomicU64::new(0))
                .collect(),
            cut: (0..params.layout.machines_max as usize * params.layout.threads as usize)
                .map(|_| AtomicU64::new(0))
                .collect(),
            joined_latest: AtomicU64::new(0),
            joining: std::sync::atomic::AtomicBool::new(false),
            member_since: AtomicU64::new(0),
            growth: Default::default(),
            state,
            rings,
            heads,
            truncation,
            feedback,
            recovery_log,
            drain_marks,
            fabric,
        }))
    }

    /// Where thread `thread`'s recovery log lies in [`MachineState::recovery_log`]: the offset
    /// of its head word, and the ring's base and capacity.
    pub fn recovery_log_ring(&self, thread: u16) -> (usize, usize, usize) {
        let bytes = recovery_log_ring_bytes(&self.params);
        let header = recovery_log_header_bytes(&self.params);
        (thread as usize * 8, header + thread as usize * bytes, bytes)
    }

    /// The drain mark of the log from `sender` at `thread`: the position after the records the
    /// last drain took, and the configuration drained (0 before any drain).
    pub fn drain_mark(&self, sender: MachineId, thread: u16) -> (u64, ConfigId) {
        let at = 2 * self.truncation_offset(sender, thread);
        let pos = self.drain_marks.load_u64(at, Ordering::Acquire);
        let config = self.drain_marks.load_u64(at + 8, Ordering::Acquire);
        (pos, ConfigId(config))
    }

    /// Records a drain of `config` that took the log from `sender` at `thread` up to `pos`. The
    /// position goes first: a stop between the two writes leaves the new position with the
    /// previous configuration, which rejects fewer records, never one the drain took.
    pub(crate) fn set_drain_mark(
        &self,
        sender: MachineId,
        thread: u16,
        pos: u64,
        config: ConfigId,
    ) {
        let at = 2 * self.truncation_offset(sender, thread);
        self.drain_marks.store_u64(at, pos, Ordering::Release);
        self.drain_marks
            .store_u64(at + 8, config.0, Ordering::Release);
    }

    /// The view this machine installed for `config`, if it still keeps it (see
    /// [`MachineState::drain_mark`]).
    pub fn installed_view(&self, config: ConfigId) -> Option<farm_core::codec::StoredView> {
        self.views.lock().expect("poisoned").get(&config).cloned()
    }

    /// Offset in [`MachineState::truncation`] of the bound from `sender`'s thread `thread`.
    pub fn truncation_offset(&self, sender: MachineId, thread: u16) -> usize {
        (sender.0 as usize * self.params.layout.threads as usize + thread as usize) * 8
    }

    /// Forgets the truncation bound and drain mark of `sender`'s log to `thread`: a new
    /// incarnation of the sender joined (`Worker` starts its rings afresh).
    pub(crate) fn forget_marks(&self, sender: MachineId, thread: u16) {
        let at = self.truncation_offset(sender, thread);
        self.truncation.store_u64(at, 0, Ordering::Release);
        self.drain_marks.store_u64(2 * at, 0, Ordering::Release);
        self.drain_marks.store_u64(2 * at + 8, 0, Ordering::Release);
    }

    /// Records that local `thread`'s worker picked up view `generation`.
    pub(crate) fn note_refreshed(&self, thread: farm_core::ThreadId, generation: u64) {
        assert!(
            generation <= self.view_generation(),
            "{:?} picked up a view not yet installed",
            thread
        );
        self.refreshed[thread.0 as usize].fetch_max(generation, Ordering::AcqRel);
    }

    /// Whether every local worker started afresh with every machine that joined this
    /// machine's view (it picked up the view that added the newest): a member acknowledges
    /// NEW-CONFIG only then, so that a machine joining in it finds the rings it writes to
    /// started afresh (`Worker::refresh_view`) when the configuration commits. A view that adds
    /// nobody needs no worker: the acknowledgement never waits for a thread that an
    /// application's closure holds (issue 16 case 6); such a worker picks the view up at its
    /// next poll, and a read it makes meanwhile ends its execution (`Tx::same_view`).
    pub fn workers_ready(&self) -> bool {
        let due = self.joined_latest.load(Ordering::Acquire);
        self.refreshed
            .iter()
            .all(|r| r.load(Ordering::Acquire) >= due)
    }

    /// The view generation in which `m` last joined this machine's view (0: not since start).
    pub(crate) fn joined_at(&self, m: MachineId) -> u64 {
        self.joined[m.0 as usize].load(Ordering::Acquire)
    }

    /// Records that worker `thread` cut its link to `peer` (`Worker::cut`).
    pub(crate) fn cut_link(&self, thread: ThreadId, peer: MachineId) {
        let at = thread.0 as usize * self.params.layout.machines_max as usize + peer.0 as usize;
        self.cut[at].store(self.joined_at(peer) + 1, Ordering::Release);
    }

    /// The members this machine can no longer write to although they may live, which the
    /// configuration must remove: those the fabric's links to broke (`Fabric::broken_members`:
    /// a write that did not land left a hole in a ring) and those a worker cut off for not draining their
    /// queue (`Worker::cut`). The control plane reports them at every tick.
    pub fn unreachable_members(&self) -> Vec<MachineId> {
        let peers = self.params.layout.machines_max as usize;
        let view = self.view();
        let mut out = self.fabric.broken_members(self.id);
        for (at, mark) in self.cut.iter().enumerate() {
            let peer = MachineId((at % peers) as u16);
            let mark = mark.load(Ordering::Acquire);
            if mark != 0 && mark == self.joined_at(peer) + 1 && view.config.contains(peer) {
                out.push(peer);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The configuration this machine restarted into, if the cluster restarted from NVRAM.
    pub fn restart_config(&self) -> Option<ConfigId> {
        self.restart
    }

    /// After a restart, whether this machine was the primary of `region` from the start of
    /// `txn`'s commit until the cluster stopped: then the transaction's LOCK record reached it,
    /// if any did, and it kept it until the transaction aborted or was truncated.
    pub(crate) fn primary_before_restart_since(
        &self,
        region: RegionId,
        txn: farm_core::TxnId,
    ) -> bool {
        self.restored.as_ref().is_some_and(|v| {
            v.map.get(region).is_some_and(|p| p.primary == self.id)
                && v.changes
                    .get(&region)
                    .is_none_or(|c| c.last_primary_change <= txn.config)
        })
    }

    /// Records that `thread` finished transaction recovery for `config` (nothing recovering,
    /// logs drained for it). Once every thread has, and data and allocator recovery are done,
    /// the machine is settled in `config`: recovery is over here.
    pub(crate) fn thread_settled(&self, config: ConfigId, thread: u16) {
        assert!(
            thread < self.params.layout.threads,
            "thread {thread} settled"
        );
        let mut threads = self.settled_threads.lock().expect("poisoned");
        threads.insert(thread, config);
        let all = threads.len() == self.params.layout.threads as usize
            && threads.values().all(|c| *c >= config);
        drop(threads);
        if all
            && self.view().config.id == config
            && self.committed_config() >= config
            && self.all_active_config() >= config
            && self.background_recovery_done()
        {
            self.settled.store(config.0, Ordering::Release);
        }
    }

    /// The newest configuration this machine settled in: every thread's transaction recovery
    /// idle there, and data and allocator recovery done.
    pub fn settled_config(&self) -> ConfigId {
        ConfigId(self.settled.load(Ordering::Acquire))
    }

    /// The current view.
    pub fn view(&self) -> Arc<View> {
        self.view.lock().expect("view poisoned").clone()
    }

    /// Writes every NVRAM mapping of this machine back to its file and waits (`msync`): the
    /// regions and replicas of its view and those prepared, its rings, heads, truncation
    /// bounds, feedback, recovery logs, drain marks and state. Returns how many areas and
    /// bytes. For a shutdown on a power signal: what is in the mappings then survives a power
    /// cut that follows (docs/ARCHITECTURE.md, Whole-cluster restart).
    pub fn flush_nvram(&self) -> io::Result<(usize, usize)> {
        let view = self.view();
        let prepared: Vec<Arc<Nvram>> = self
            .prepared
            .lock()
            .expect("prepared poisoned")
            .values()
            .cloned()
            .collect();
        let areas = view.regions.iter().flatten().chain(&prepared).chain([
            &self.complete,
            &self.state,
            &self.rings,
            &self.heads,
            &self.truncation,
            &self.feedback,
            &self.recovery_log,
            &self.drain_marks,
        ]);
        let (mut count, mut bytes) = (0, 0);
        for area in areas {
            area.flush()?;
            count += 1;
            bytes += area.len();
        }
        Ok((count, bytes))
    }

    /// The control plane forgave the CM it suspected and could not remove: the lease manager
    /// renews with it again ([`MachineState::cm_forgiven`]).
    pub fn forgive_cm(&self) {
        self.cm_forgiven.fetch_add(1, Ordering::AcqRel);
    }

    /// How many times the CM was forgiven ([`MachineState::forgive_cm`]).
    pub fn cm_forgiven(&self) -> u64 {
        self.cm_forgiven.load(Ordering::Acquire)
    }

    /// The control plane, as CM, forgave the members it suspected and could not remove: the
    /// lease manager takes their requests again ([`MachineState::members_forgiven`]).
    pub fn forgive_members(&self) {
        self.members_forgiven.fetch_add(1, Ordering::AcqRel);
    }

    /// How many times suspected members were forgiven ([`MachineState::forgive_members`]).
    pub fn members_forgiven(&self) -> u64 {
        self.members_forgiven.load(Ordering::Acquire)
    }

    /// Increases with every installed view; workers compare it to refresh their copy cheaply.
    pub fn view_generation(&self) -> u64 {
        self.view_generation.load(Ordering::Acquire)
    }

    /// Installs a new configuration and region map (NEW-CONFIG, §5.2 step 5): persists it
    /// ([`MachineState::persist_view`]) and puts it in force ([`MachineState::publish_view`]).
    pub fn install(
        &self,
        config: Configuration,
        map: RegionMap,
        changes: BTreeMap<RegionId, RegionChanges>,
    ) -> io::Result<()> {
        self.install_view(config, map, changes, true)
    }

    /// [`MachineState::install`]; without `new_pools`, regions new to this machine's view get
    /// no block pool (a restarted machine's regions hold objects: allocator recovery scans them).
    fn install_view(
        &self,
        config: Configuration,
        map: RegionMap,
        changes: BTreeMap<RegionId, RegionChanges>,
        new_pools: bool,
    ) -> io::Result<()> {
        let view = farm_core::codec::StoredView {
            config,
            map,
            changes,
        };
        let persisted = self.persist_pooled(view, new_pools)?;
        self.publish_view(persisted)
    }

    /// The first half of NEW-CONFIG (§5.2 step 5): lists the regions this machine newly holds
    /// without their data (a new backup's, copied by data recovery, §5.4), then writes that
    /// list and the view to NVRAM. Nothing changes in what workers, readers and probes see
    /// until [`MachineState::publish_view`] puts the view in force; the control plane
    /// acknowledges NEW-CONFIG only after both, so an acknowledged view is always durable.
    pub fn persist_view(&self, view: farm_core::codec::StoredView) -> io::Result<PersistedView> {
        self.persist_pooled(view, true)
    }

    fn persist_pooled(
        &self,
        view: farm_core::codec::StoredView,
        new_pools: bool,
    ) -> io::Result<PersistedView> {
        let _installing = self.installing.lock().expect("poisoned");
        let old = self.view();
        // Views only move forward (a region allocation commits a new configuration).
        assert!(
            view.config.id >= old.config.id,
            "view of configuration {} persisted over {}",
            view.config.id.0,
            old.config.id.0
        );
        let joining = view.config.contains(self.id) && self.joining.swap(false, Ordering::AcqRel);
        if view.config.contains(self.id) {
            let _ = (self.member_since).compare_exchange(
                0,
                view.config.id.0,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        let first = old.map.iter().next().is_none() && new_pools && !joining;
        self.note_copies(&old, &view.map, joining, first);
        // Regions still to copy first: a view naming a replica whose copy is not listed would
        // pass for complete after a restart.
        self.persist_copying()?;
        self.persist_stored_view(&view.config, &view.map, &view.changes)?;
        Ok(PersistedView {
            view,
            old_config: old.config.id,
            first,
            new_pools,
        })
    }

    /// The second half of NEW-CONFIG: puts a view [`MachineState::persist_view`] wrote in
    /// force. Maps and registers the replicas this machine newly holds (new backups start
    /// empty; data recovery fills them, §5.4), keeps the ones it still holds, and keeps block
    /// pools only for regions it was already primary for (a promoted primary's free lists are
    /// rebuilt by allocator recovery, §5.5, and it stays blocked until then). The view's own
    /// lock is held only for the swap, so workers and readers never wait for the mappings.
    pub fn publish_view(&self, persisted: PersistedView) -> io::Result<()> {
        let _installing = self.installing.lock().expect("poisoned");
        let PersistedView {
            view:
                farm_core::codec::StoredView {
                    config,
                    map,
                    changes,
                },
            old_config,
            first,
            new_pools,
        } = persisted;
        let old = self.view();
        assert_eq!(
            old.config.id, old_config,
            "another view was installed between persisting and publishing configuration {}",
            config.id.0
        );
        let joined: Vec<MachineId> = config
            .members
            .iter()
            .copied()
            .filter(|m| *m != self.id && !old.config.contains(*m))
            .collect();
        let blocked = changes
            .iter()
            .filter(|(_, c)| c.last_replica_change > ConfigId(0))
            .map(|(r, _)| *r)
            .collect();
        let mut guard = self.view.lock().expect("view poisoned");
        // Precise membership (§5.2): writes from machines outside the configuration stop
        // landing here, those still in flight included.
        self.fabric.admit(self.id, &config.members);
        // `old` but for block pools that allocator recovery installed meanwhile.
        let current = guard.clone();
        assert_eq!(
            current.config.id, old.config.id,
            "the view changed under its installer"
        );
        // Views only move forward (a machine's first view replaces the empty one it opened
        // with, under the same configuration).
        assert!(
            config.id >= current.config.id,
            "view of configuration {} installed over {}",
            config.id.0,
            current.config.id.0
        );
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
            let mem = match (current.region(region), prepared) {
                (Some(m), _) => m.clone(),
                (None, Some(m)) => m,
                // A new backup of an existing region starts empty: data recovery copies it
                // (§5.4; `note_copies` listed it).
                (None, None) => self.map_region(region)?,
            };
            regions[idx] = Some(mem);
            if placement.primary == self.id {
                pools[idx] = match current.pools.get(idx).and_then(Option::as_ref) {
                    Some(p) => Some(p.clone()),
                    // A region new to the map (first configuration, or just allocated) is empty.
                    None if new_pools && (first || current.map.get(region).is_none()) => {
                        Some(Arc::new(BlockPool::new(self.params.region_bytes)))
                    }
                    None => None,
                };
            }
        }
        // Every replica the view places here is mapped: a backup without memory would drop
        // COMMIT-BACKUP writes, a primary could not serve (§3: a mapping is valid only with
        // its replicas).
        assert!(
            map.iter()
                .filter(|(_, p)| p.holds(self.id))
                .all(|(r, _)| regions.get(r.0 as usize).is_some_and(Option::is_some)),
            "configuration {} places a replica at {} without memory",
            config.id.0,
            self.id
        );
        *guard = Arc::new(View {
            config,
            map,
            changes,
            blocked,
            regions,
            pools,
        });
        // Machines new to the view join in the generation about to be published (one installer
        // at a time: nobody else moves it), so a worker that picks it up sees them.
        let next = self.view_generation() + 1;
        for m in &joined {
            self.joined[m.0 as usize].store(next, Ordering::Release);
            self.joined_latest.store(next, Ordering::Release);
        }
        self.view_generation.fetch_add(1, Ordering::Release);
        drop(guard);
        let to_copy = self.to_copy.lock().expect("poisoned");
        self.publish_complete(&to_copy);
        Ok(())
    }

    /// Publishes, for reconfiguration probes (§5.2 step 2), the regions of the view in force
    /// whose replica here is complete: held, and not still to copy (`to_copy`, whose lock the
    /// caller holds, so that publications follow one another in the order of their changes).
    fn publish_complete(&self, to_copy: &BTreeMap<RegionId, bool>) {
        let view = self.view();
        let ids: Vec<RegionId> = view
            .map
            .iter()
            .filter(|(r, p)| {
                p.holds(self.id) && view.region(*r).is_some() && !to_copy.contains_key(r)
            })
            .map(|(r, _)| r)
            .collect();
        {
            let mut published = self.published.lock().expect("poisoned");
            published.0 = ids;
            write_complete(&self.complete, &published.0, &published.1);
        }
        *self.copying.lock().expect("poisoned") = Arc::new(to_copy.keys().copied().collect());
    }

    /// Publishes, beside the complete replicas, the members this machine cannot write to
    /// (`unreachable`, from [`MachineState::unreachable_members`]), for the reconfiguration
    /// probes of those members ([`crate::control::probe`]): the CM removes this machine, and a
    /// machine taking over stands down (`farm_cm::reconfig::Reconfig::on_probe`). A probe reads
    /// the member's memory, which shows that the prober reaches the member, not that the
    /// member reaches the prober; a machine whose peers' links into it broke (while it was
    /// paused, say) could otherwise win a majority of probes, take over as CM and remove the
    /// machine holding the other replicas of its regions, after which its peers could remove
    /// neither it nor anyone (simulator seed 110052 of the varied shapes). The list is as of
    /// this machine's last control tick: one repaired since still names the peer, and makes
    /// a takeover stand down once more than needed.
    pub fn publish_unreachable(&self, unreachable: &[MachineId]) {
        let mut published = self.published.lock().expect("poisoned");
        if published.1 != unreachable {
            published.1 = unreachable.to_vec();
            write_complete(&self.complete, &published.0, &published.1);
        }
    }

    /// The regions whose replica here is still being copied, as last published.
    pub fn copying_regions(&self) -> Arc<BTreeSet<RegionId>> {
        self.copying.lock().expect("poisoned").clone()
    }

    /// Lists the regions of `map` that this machine newly holds without their data (a new
    /// backup, §5.4) among those to copy, with whether aggressively: when the region is down
    /// to one replica holding its data.
    fn note_copies(&self, old: &View, map: &RegionMap, joining: bool, first: bool) {
        let prepared = self.prepared.lock().expect("prepared poisoned");
        let mut to_copy = self.to_copy.lock().expect("poisoned");
        for (region, placement) in map.iter() {
            if !placement.holds(self.id)
                || old.region(region).is_some()
                || prepared.contains_key(&region)
            {
                continue;
            }
            if joining {
                let others = placement.replicas().filter(|m| *m != self.id).count();
                to_copy.insert(region, others <= 1);
            } else if let (false, Some(before)) = (first, old.map.get(region)) {
                // Replicas that held the region before and still do: one means the region is
                // down to a single copy of its data. So may it be when the previous
                // configuration changed its replicas too (their copies may not be complete).
                let kept = placement.replicas().filter(|m| before.holds(*m)).count();
                let changed_before = old
                    .changes
                    .get(&region)
                    .is_some_and(|c| c.last_replica_change == old.config.id);
                to_copy.insert(region, kept <= 1 || changed_before);
            }
        }
    }

    /// Keeps the view of `config` (in a file of its own when this machine has an NVRAM
    /// directory), and forgets older views no drain mark names.
    fn persist_stored_view(
        &self,
        config: &Configuration,
        map: &RegionMap,
        changes: &BTreeMap<RegionId, RegionChanges>,
    ) -> io::Result<()> {
        if let Some(dir) = &self.nvram_dir {
            let bytes = farm_core::codec::encode_view(config, map, changes);
            files::replace(dir, &view_file(config.id), &bytes)?;
        }
        let mut views = self.views.lock().expect("poisoned");
        views.insert(
            config.id,
            farm_core::codec::StoredView {
                config: config.clone(),
                map: map.clone(),
                changes: changes.clone(),
            },
        );
        let layout = self.params.layout;
        let named: BTreeSet<ConfigId> = (0..layout.machines_max)
            .flat_map(|m| (0..layout.threads).map(move |t| (MachineId(m), t)))
            .map(|(m, t)| self.drain_mark(m, t).1)
            .collect();
        let stale: Vec<ConfigId> = views
            .keys()
            .filter(|c| **c < config.id && !named.contains(c))
            .copied()
            .collect();
        for c in stale {
            views.remove(&c);
            if let Some(dir) = &self.nvram_dir {
                files::remove(dir, &view_file(c))?;
            }
        }
        Ok(())
    }

    /// Writes the regions still to copy to NVRAM (a file, when this machine has a directory).
    fn persist_copying(&self) -> io::Result<()> {
        let Some(dir) = &self.nvram_dir else {
            return Ok(());
        };
        let to_copy = self.to_copy.lock().expect("poisoned").clone();
        let mut persisted = self.copying_persisted.lock().expect("poisoned");
        if *persisted == to_copy {
            return Ok(());
        }
        let mut bytes = Vec::with_capacity(to_copy.len() * 5);
        for (r, aggressive) in &to_copy {
            bytes.extend_from_slice(&r.0.to_le_bytes());
            bytes.push(*aggressive as u8);
        }
        files::replace(dir, COPYING_FILE, &bytes)?;
        *persisted = to_copy;
        Ok(())
    }
}

/// Region memory kept ready, its pages allocated and zeroed ahead, for replicas a machine
/// newly takes (FaRM keeps free NVRAM for the replicas a failure re-places, §5.4). A new
/// backup's first writes (data recovery's copies, COMMIT-BACKUP records applied) otherwise
/// fault in and zero a whole region in the middle of recovery: in one process, five machines
/// whose failure gave three regions a new backup came back to 80% of their throughput 83-100
/// ms after the suspicion, most of the time in the kernel zeroing pages, and 8-14 ms with
/// spares.
#[derive(Debug, Default)]
struct SpareRegions {
    /// How many to keep.
    want: usize,
    ready: Vec<Arc<Nvram>>,
    /// A thread is making more.
    filling: bool,
    /// How many new replicas took one.
    used: u64,
}

/// Makes spare regions of `len` bytes until `spares` holds as many as it wants: anonymous
/// memory with every page allocated (written once; a read would map the shared zero page, and
/// the first write would still fault and zero). Each is made without the lock held.
fn fill_spares(spares: &Mutex<SpareRegions>, len: usize) -> io::Result<()> {
    loop {
        {
            let s = spares.lock().expect("poisoned");
            if s.ready.len() >= s.want {
                return Ok(());
            }
        }
        let mem = Nvram::anonymous(len)?;
        for offset in (0..mem.len()).step_by(4096) {
            mem.store_u64(offset, 0, Ordering::Relaxed);
        }
        spares.lock().expect("poisoned").ready.push(Arc::new(mem));
    }
}

impl MachineState {
    fn map_region(&self, region: RegionId) -> io::Result<Arc<Nvram>> {
        let spare = {
            let mut spares = self.spares.lock().expect("poisoned");
            let spare = spares.ready.pop();
            spares.used += spare.is_some() as u64;
            spare
        };
        let m = match spare {
            Some(m) => m,
            None => map_area(
                &self.nvram_dir,
                &format!("region-{}", region.0),
                self.params.region_bytes,
            )?,
        };
        self.fabric
            .register(self.id, MemKey::Region(region), m.clone());
        Ok(m)
    }

    /// Keeps `n` regions' memory ready for replicas this machine newly takes (see
    /// `SpareRegions`), made now; after a recovery used some, more are made once this machine
    /// has copied every region it was given (off recovery's path), and after a region
    /// allocation at once. Only for a machine without an NVRAM directory (in memory): a machine
    /// whose NVRAM is files keeps none yet.
    pub fn keep_spare_regions(&self, n: usize) -> io::Result<()> {
        if self.nvram_dir.is_some() {
            return Ok(());
        }
        self.spares.lock().expect("poisoned").want = n;
        fill_spares(&self.spares, self.params.region_bytes)
    }

    /// How many regions' memory is ready for new replicas ([`MachineState::keep_spare_regions`]).
    pub fn spare_regions_ready(&self) -> usize {
        self.spares.lock().expect("poisoned").ready.len()
    }

    /// How many replicas this machine newly took had their memory ready.
    pub fn spare_regions_used(&self) -> u64 {
        self.spares.lock().expect("poisoned").used
    }

    /// Makes the spares a recovery used again, on a thread of their own, unless enough are
    /// ready or a thread already makes them.
    fn refill_spares(&self) {
        {
            let mut spares = self.spares.lock().expect("poisoned");
            if spares.filling || spares.ready.len() >= spares.want {
                return;
            }
            spares.filling = true;
        }
        let (spares, len, id) = (self.spares.clone(), self.params.region_bytes, self.id);
        let spawned = std::thread::Builder::new()
            .name(format!("farm-spares-m{}", id.0))
            .spawn(move || {
                let made = fill_spares(&spares, len);
                spares.lock().expect("poisoned").filling = false;
                if let Err(e) = made {
                    tracing::warn!(machine = id.0, error = %e, "making a spare region");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(machine = self.id.0, error = %e, "starting the spare regions' thread");
            self.spares.lock().expect("poisoned").filling = false;
        }
    }

    /// PREPARE of region allocation (§3): maps and registers NVRAM for `region`, to be used when
    /// a view that places a replica here is installed.
    pub fn prepare_region(&self, region: RegionId) -> io::Result<()> {
        let mem = self.map_region(region)?;
        // An allocation is no recovery: a spare it took is made again now.
        self.refill_spares();
        self.prepared
            .lock()
            .expect("prepared poisoned")
            .insert(region, mem);
        Ok(())
    }

    /// NEW-CONFIG-COMMIT (§5.2 step 7): transaction recovery for `config` may start.
    pub fn commit_config(&self, config: ConfigId) {
        // §5.2 step 7: NEW-CONFIG-COMMIT of a configuration this machine installed.
        assert!(
            config <= self.view().config.id,
            "configuration {} committed before it was installed",
            config.0
        );
        self.committed.fetch_max(config.0, Ordering::AcqRel);
    }

    /// The newest configuration committed here.
    pub fn committed_config(&self) -> ConfigId {
        ConfigId(self.committed.load(Ordering::Acquire))
    }

    /// Whether this machine may begin transactions: the first configuration of its life in
    /// which it is a member committed here. A machine that joins writes into its peers' rings
    /// only from then on: every member acknowledged that configuration, each once its
    /// workers started the rings this machine writes to afresh (`workers_ready`), so nothing
    /// it writes can land before that restart and be wiped by it. A joiner's first ALLOC,
    /// sent as soon as it installed the view that adds it, once landed in a peer's queue before
    /// that peer's worker started it afresh: the message was lost, and every later one from
    /// that thread waited behind the hole it left, recovery included (simulator seed 25 of the
    /// joins campaign).
    pub fn may_begin(&self) -> bool {
        let since = self.member_since.load(Ordering::Acquire);
        since != 0 && self.committed_config().0 >= since
    }

    /// REGIONS-ACTIVE (§5.4): whether every region this machine is primary of is active in the
    /// current view, that is, its lock recovery finished after its last replica change.
    pub fn regions_active(&self) -> bool {
        let view = self.view();
        let active = view.map.primary_of(self.id).all(|r| {
            let changed = view.changes.get(&r).map_or(0, |c| c.last_replica_change.0);
            view.region(r).is_some_and(|m| {
                m.load_u64(farm_alloc::REGION_ACTIVE_OFFSET, Ordering::Acquire) >= changed
            })
        });
        active
    }

    /// Marks this machine removed from the configuration: its control plane learnt it from the
    /// coordination store once its CM fell silent. A removed machine never comes back as a
    /// member; a new incarnation (a new `MachineState`) joins instead.
    pub fn set_evicted(&self) {
        self.evicted.store(true, Ordering::Release);
    }

    /// Whether this machine was removed from the configuration while alive.
    pub fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// The lease manager's bound on serving (`farm_cm::LeaseRole::serves_until`), after each
    /// of its rounds.
    pub fn set_serves_until(&self, until: u64) {
        self.serves_until.store(until, Ordering::Release);
    }

    /// Whether a read that finished before `now` may be told to an application (FaRM §5.1):
    /// the leases that keep this machine a member held then, so no configuration without it
    /// was in force yet (one commits only once its removed machines' leases surely ended,
    /// §5.2 step 7). `now` must be read after the read it vouches for; a machine paused past
    /// its lease, removed and continued would otherwise serve its stale replicas until it
    /// learns the new configuration.
    pub fn serves_at(&self, now: u64) -> bool {
        now <= self.serves_until.load(Ordering::Acquire)
    }

    /// ALL-REGIONS-ACTIVE from the CM (§5.4), taken up at `at`: data and allocator recovery
    /// may start.
    pub fn all_regions_active(&self, config: ConfigId, at: u64) {
        // §5.4: ALL-REGIONS-ACTIVE follows every member's REGIONS-ACTIVE, which follows its
        // NEW-CONFIG-COMMIT.
        assert!(
            config <= self.committed_config(),
            "ALL-REGIONS-ACTIVE for configuration {} before its commit",
            config.0
        );
        // Before the configuration, so that a worker that sees it sees the time too.
        self.all_active_at.fetch_max(at, Ordering::AcqRel);
        self.all_active.fetch_max(config.0, Ordering::AcqRel);
    }

    /// When the newest ALL-REGIONS-ACTIVE was taken up here: the earliest time data recovery
    /// can say it started (a poll's own time may be older than what it sees).
    pub fn all_active_at(&self) -> u64 {
        self.all_active_at.load(Ordering::Acquire)
    }

    /// The newest configuration announced with ALL-REGIONS-ACTIVE.
    pub fn all_active_config(&self) -> ConfigId {
        ConfigId(self.all_active.load(Ordering::Acquire))
    }

    /// Whether data and allocator recovery are complete here: every region this machine is a
    /// new backup of is copied, and every region it is primary of has its free lists.
    pub fn background_recovery_done(&self) -> bool {
        let view = self.view();
        let pools = view.map.primary_of(self.id).all(|r| view.pool(r).is_some());
        pools && self.to_copy.lock().expect("poisoned").is_empty()
    }

    /// Regions still to be copied here (new backups, §5.4).
    /// With whether each is down to one replica holding its data (copied aggressively).
    pub fn regions_to_copy(&self) -> BTreeMap<RegionId, bool> {
        self.to_copy.lock().expect("poisoned").clone()
    }

    pub(crate) fn copy_done(&self, region: RegionId) {
        {
            let mut to_copy = self.to_copy.lock().expect("poisoned");
            if to_copy.remove(&region).is_none() {
                return;
            }
            // From now on a reconfiguration may promote this replica.
            self.publish_complete(&to_copy);
            if to_copy.is_empty() {
                self.refill_spares();
            }
        }
        // Failing to record it only makes a restart copy the region again.
        if let Err(e) = self.persist_copying() {
            tracing::warn!(machine = self.id.0, region = region.0, error = %e, "recording a finished copy");
        }
    }

    /// Data and allocator recovery milestones so far.
    pub fn recovery_events(&self) -> Vec<RecoveryEvent> {
        self.events.lock().expect("poisoned").clone()
    }

    pub(crate) fn record(&self, event: RecoveryEvent) {
        self.events.lock().expect("poisoned").push(event);
    }

    pub(crate) fn queue_free(&self, addr: farm_core::Addr, slot: u32) {
        self.queued_frees
            .lock()
            .expect("poisoned")
            .push((addr, slot));
    }

    /// Takes the queued frees of `region`.
    pub(crate) fn take_queued_frees(&self, region: RegionId) -> Vec<(u32, u32)> {
        let mut q = self.queued_frees.lock().expect("poisoned");
        let (mine, rest): (Vec<_>, Vec<_>) = q.drain(..).partition(|(a, _)| a.region == region);
        *q = rest;
        mine.into_iter().map(|(a, s)| (a.offset, s)).collect()
    }

    /// Takes up to `max` queued free slots of `region` of `slot_bytes` each: a thread about to
    /// carve a new block takes slots the machine's other threads, or allocator recovery, left
    /// free first (each thread has slabs of its own, and a region's blocks are few).
    pub(crate) fn take_queued_slots(
        &self,
        region: RegionId,
        slot_bytes: u32,
        max: usize,
    ) -> Vec<u32> {
        let mut q = self.queued_frees.lock().expect("poisoned");
        let mut out = Vec::new();
        q.retain(|(a, s)| {
            let take = out.len() < max && a.region == region && *s == slot_bytes;
            if take {
                out.push(a.offset);
            }
            !take
        });
        out
    }

    /// Installs the block pool allocator recovery rebuilt for `region` (§5.5) in a new view.
    pub(crate) fn install_pool(&self, region: RegionId, pool: BlockPool) {
        let mut guard = self.view.lock().expect("view poisoned");
        let old = guard.clone();
        let mut pools = old.pools.clone();
        let idx = region.0 as usize;
        if pools.len() <= idx || old.region(region).is_none() {
            return;
        }
        pools[idx] = Some(Arc::new(pool));
        *guard = Arc::new(View {
            config: old.config.clone(),
            map: old.map.clone(),
            changes: old.changes.clone(),
            blocked: old.blocked.clone(),
            regions: old.regions.clone(),
            pools,
        });
        self.view_generation.fetch_add(1, Ordering::Release);
    }

    /// Records that `thread` drained its logs for `config` (LastDrained, §5.3 step 2).
    pub(crate) fn thread_drained(&self, config: ConfigId, thread: u16) {
        assert!(
            thread < self.params.layout.threads,
            "thread {thread} drained"
        );
        // §5.3 step 2 starts at NEW-CONFIG-COMMIT.
        assert!(
            config <= self.committed_config(),
            "configuration {} drained before its commit",
            config.0
        );
        let mut d = self.drained.lock().expect("poisoned");
        if d.0 < config {
            *d = (config, BTreeSet::new());
        }
        if d.0 == config {
            d.1.insert(thread);
        }
    }

    /// Whether every thread drained its logs for `config` (or a later one).
    pub(crate) fn all_drained(&self, config: ConfigId) -> bool {
        let d = self.drained.lock().expect("poisoned");
        d.0 > config || (d.0 == config && d.1.len() == self.params.layout.threads as usize)
    }

    /// Records that `thread` finished lock recovery of `region` for `config` (§5.3 step 4).
    /// When every thread has, the region becomes active: the configuration is written where
    /// coordinators look for it (local memory here, one-sided reads elsewhere).
    pub(crate) fn lock_recovered(&self, region: RegionId, config: ConfigId, thread: u16) {
        assert!(
            self.all_drained(config),
            "lock recovery of {region:?} in configuration {} before every thread drained",
            config.0
        );
        let mut all = self.lock_recovery.lock().expect("poisoned");
        let entry = all.entry(region).or_insert((config, BTreeSet::new()));
        if entry.0 > config {
            return; // A thread finishing an older round late.
        }
        if entry.0 < config {
            *entry = (config, BTreeSet::new());
        }
        entry.1.insert(thread);
        if entry.1.len() == self.params.layout.threads as usize {
            all.remove(&region);
            let view = self.view();
            let (Some(mem), Some(placement)) = (view.region(region), view.map.get(region)) else {
                return;
            };
            if placement.primary == self.id {
                self.merge_block_headers(region, mem, &placement.backups, thread);
            }
            mem.store_u64(
                farm_alloc::REGION_ACTIVE_OFFSET,
                config.0,
                Ordering::Release,
            );
        }
    }

    /// Makes the block headers of `region` agree before it becomes active (§5.4: block headers
    /// reach backups right after NEW-CONFIG-COMMIT): headers a backup has and this (possibly
    /// promoted) primary lacks are taken over, by one-sided reads, and then every header goes
    /// to every backup. A block's header is written once, by the primary that carves it, so
    /// copies never disagree; a crash can only leave some replicas without it.
    fn merge_block_headers(
        &self,
        region: RegionId,
        mem: &Nvram,
        backups: &[MachineId],
        thread: u16,
    ) {
        let blocks = self.params.region_bytes / farm_alloc::BLOCK_BYTES;
        let table = 8 * blocks;
        for b in backups {
            let mut theirs = vec![0u8; table];
            let read = self
                .fabric
                .remote(self.id, *b, MemKey::Region(region))
                .and_then(|r| r.read(0, &mut theirs));
            if read.is_err() {
                continue; // A dead backup: the next configuration handles it.
            }
            for (i, word) in theirs.chunks_exact(8).enumerate().skip(1) {
                let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
                let at = farm_alloc::block_header_offset(i as u32);
                if farm_alloc::slot_bytes_of(w).is_some()
                    && mem.load_u64(at, Ordering::Acquire) == 0
                {
                    mem.store_u64(at, w, Ordering::Release);
                }
            }
        }
        let mut ours = vec![0u8; table];
        mem.read(0, &mut ours);
        let src = farm_core::fabric::Endpoint {
            machine: self.id,
            thread: farm_core::ThreadId(thread),
        };
        for b in backups {
            // Runs of carved blocks, one write each.
            let mut i = 1;
            while i < blocks {
                if ours[8 * i..8 * i + 8] == [0; 8] {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < blocks && ours[8 * i..8 * i + 8] != [0; 8] {
                    i += 1;
                }
                let _ = self.fabric.write(
                    src,
                    *b,
                    MemKey::Region(region),
                    (8 * start) as u64,
                    &ours[8 * start..8 * i],
                );
            }
        }
    }

    /// Locks an object for a recovering transaction (§5.3 step 4), whatever its version.
    pub(crate) fn recovery_lock(&self, mem: &Nvram, region: RegionId, offset: u32) {
        let mut locks = self.recovery_locks.lock().expect("poisoned");
        let n = locks.entry((region, offset)).or_insert(0);
        if *n == 0 {
            let off = offset as usize;
            let h = farm_core::object::Header(mem.load_u64(off, Ordering::Acquire));
            mem.store_u64(off, h.with_lock().0, Ordering::Release);
        }
        *n += 1;
        // One per recovering transaction that wrote the object: bounded by the transactions
        // a thread can have in flight, never by anything that grows.
        assert!(
            *n <= RECOVERY_LOCKS_PER_OBJECT_MAX,
            "{n} recovery locks on {region:?}+{offset:#x}"
        );
    }

    /// Applies a recovered commit to an object locked by recovery if it is newer, and drops
    /// one recovery lock (unlocking when it was the last).
    pub(crate) fn recovery_unlock(
        &self,
        mem: &Nvram,
        region: RegionId,
        offset: u32,
        commit: Option<(&[u8], farm_core::object::Header)>,
    ) {
        let mut locks = self.recovery_locks.lock().expect("poisoned");
        let n = locks
            .get_mut(&(region, offset))
            .expect("recovery lock held");
        let off = offset as usize;
        let current = farm_core::object::Header(mem.load_u64(off, Ordering::Acquire));
        let mut h = current.without_lock();
        if let Some((data, new)) = commit {
            if new.version() > h.version() || h.0 == 0 {
                mem.write(off + farm_core::object::HEADER_BYTES, data);
                h = new;
            }
        }
        *n -= 1;
        if *n == 0 {
            locks.remove(&(region, offset));
            mem.store_u64(off, h.0, Ordering::Release);
        } else {
            mem.store_u64(off, h.with_lock().0, Ordering::Release);
        }
    }

    /// ABORT of region allocation: forgets a prepared region.
    pub fn abort_region(&self, region: RegionId) {
        self.prepared
            .lock()
            .expect("prepared poisoned")
            .remove(&region);
    }
}

/// A view written to NVRAM and not yet in force ([`MachineState::persist_view`], then
/// [`MachineState::publish_view`]).
#[derive(Debug)]
pub struct PersistedView {
    view: farm_core::codec::StoredView,
    /// The configuration in force when it was persisted: nothing may be installed between.
    old_config: ConfigId,
    /// The machine's first view (its regions start with empty block pools).
    first: bool,
    new_pools: bool,
}

impl PersistedView {
    /// The configuration of the view.
    pub fn config(&self) -> ConfigId {
        self.view.config.id
    }
}

/// Where a restarted machine finds its NVRAM.
#[derive(Clone, Copy, Debug)]
pub enum Reopen<'a> {
    /// Files under a cluster's NVRAM directory (the runtime).
    Dir(&'a Path),
    /// The memory of the machine state that stopped (the simulator: anonymous memory outlives
    /// the state that used it, as NVRAM outlives a power loss).
    Memory(&'a MachineState),
}

/// Recovery locks one object may hold at once: one per recovering transaction that wrote it,
/// and each coordinator thread of each machine has one commit in flight.
const RECOVERY_LOCKS_PER_OBJECT_MAX: u32 = 1 << 16;

/// First word of a machine's state file.
const STATE_MAGIC: u64 = u64::from_le_bytes(*b"farmstat");
const STATE_BYTES: usize = 64;
/// The files holding a machine's views, one per configuration (`view-7`), replaced atomically.
const VIEW_FILE_PREFIX: &str = "view-";
/// The file listing the regions a machine has still to copy as a new backup.
const COPYING_FILE: &str = "copying";

/// The directory of machine `id`'s NVRAM under a cluster's NVRAM directory.
pub fn machine_dir(nvram_dir: &Path, id: MachineId) -> PathBuf {
    nvram_dir.join(format!("m{}", id.0))
}

fn view_file(config: ConfigId) -> String {
    format!("{VIEW_FILE_PREFIX}{}", config.0)
}

/// The views machine `id` kept in `dir`, by configuration.
fn read_views(
    dir: &Path,
    id: MachineId,
) -> io::Result<BTreeMap<ConfigId, farm_core::codec::StoredView>> {
    let mut views = BTreeMap::new();
    for name in files::names(dir)? {
        let Some(config) = name
            .strip_prefix(VIEW_FILE_PREFIX)
            .and_then(|c| c.parse::<u64>().ok())
        else {
            continue;
        };
        let path = dir.join(&name);
        // Gone since it was listed: only a concurrent removal of a stale view does that.
        let Some(bytes) = files::read(dir, &name)? else {
            continue;
        };
        let view = farm_core::codec::decode_view(&bytes).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("view of machine {id} in {}: {e}", path.display()),
            )
        })?;
        if view.config.id.0 != config {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} holds the view of configuration {}",
                    path.display(),
                    view.config.id.0
                ),
            ));
        }
        views.insert(view.config.id, view);
    }
    Ok(views)
}

/// The regions still to copy that a machine left in `dir` (with whether aggressively).
fn read_copying(dir: &Path) -> io::Result<BTreeMap<RegionId, bool>> {
    let Some(bytes) = files::read(dir, COPYING_FILE)? else {
        return Ok(BTreeMap::new());
    };
    if !bytes.len().is_multiple_of(5) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is {} bytes long, not a list of regions",
                dir.join(COPYING_FILE).display(),
                bytes.len()
            ),
        ));
    }
    Ok(bytes
        .chunks(5)
        .map(|c| {
            let r = u32::from_le_bytes(c[..4].try_into().expect("4 bytes"));
            (RegionId(r), c[4] != 0)
        })
        .collect())
}

/// Bytes of one thread's recovery log: as many as one of its inbound logs. It holds the
/// recovery messages of transactions that were in flight at a failure and are not yet
/// forgotten (decisions, and the writes of transactions whose records a replica lacked), far
/// less than the logs they came from; a restart scans all of it.
fn recovery_log_ring_bytes(params: &Params) -> usize {
    params.layout.log_bytes
}

/// Bytes before the first recovery log: a head word per thread, rounded to a cache line.
fn recovery_log_header_bytes(params: &Params) -> usize {
    (params.layout.threads as usize * 8).div_ceil(64) * 64
}

fn recovery_log_bytes(params: &Params) -> usize {
    recovery_log_header_bytes(params)
        + params.layout.threads as usize * recovery_log_ring_bytes(params)
}

/// What a machine left in its NVRAM directory: its newest view and the regions it was still
/// copying. `None` when the directory holds no view (the machine never ran there).
pub fn read_persisted(nvram_dir: &Path, id: MachineId) -> io::Result<Option<Persisted>> {
    let dir = machine_dir(nvram_dir, id);
    let Some((_, view)) = read_views(&dir, id)?.pop_last() else {
        return Ok(None);
    };
    let state = Nvram::file(&dir.join("state"), STATE_BYTES)?;
    if state.load_u64(0, Ordering::Acquire) != STATE_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} holds no farm-rs machine state", dir.display()),
        ));
    }
    let copying = read_copying(&dir)?;
    Ok(Some(Persisted { view, copying }))
}

/// Forgets what machine `id` left under `nvram_dir`, for a new incarnation that joins the
/// cluster: its views and copy list are removed and every NVRAM file zeroed in place (peers
/// may have it mapped: a new file would leave them the old one). The fabric's own files
/// (liveness lock, admitted set) are the fabric's.
pub fn forget_state(nvram_dir: &Path, id: MachineId) -> io::Result<()> {
    let dir = machine_dir(nvram_dir, id);
    for name in files::names(&dir)? {
        let nvram = matches!(
            name.as_str(),
            "rings"
                | "feedback"
                | "heads"
                | "truncation"
                | "state"
                | "recovery-log"
                | "drain-marks"
        ) || name.starts_with("region-");
        if nvram {
            let mem = Nvram::open(&dir.join(&name))?;
            mem.zero(0, mem.len());
        } else if name.starts_with(VIEW_FILE_PREFIX)
            || name == COPYING_FILE
            || name.ends_with(".new")
        {
            files::remove(&dir, &name)?;
        }
    }
    Ok(())
}

/// The most members a [`MemKey::Replicas`] area lists as unreachable.
const UNREACHABLE_MAX: usize = 1024;
/// Where a [`MemKey::Replicas`] area's unreachable members begin.
const UNREACHABLE_AT: usize = 16 + 4 * crate::control::REGIONS_PER_MACHINE_MAX;

/// [`MemKey::Replicas`]: a sequence word (odd while being rewritten), a count, then that many
/// region ids of 4 bytes, for the replicas one machine may hold; at `UNREACHABLE_AT` a count
/// and that many machine ids of 2 bytes, the members it cannot write to.
const COMPLETE_AREA_BYTES: usize = UNREACHABLE_AT + 8 + 2 * UNREACHABLE_MAX;

/// Rewrites a [`MemKey::Replicas`] area: complete replicas `ids` and members `unreachable`
/// (a seqlock: readers that see the sequence word odd, or changed across their read, read
/// again).
fn write_complete(area: &Nvram, ids: &[RegionId], unreachable: &[MachineId]) {
    assert!(
        ids.len() <= crate::control::REGIONS_PER_MACHINE_MAX,
        "{} complete replicas on one machine",
        ids.len()
    );
    // More than fit: the first are listed (a probe by the others is answered as before).
    let unreachable = &unreachable[..unreachable.len().min(UNREACHABLE_MAX)];
    let mut bytes: Vec<u8> = ids.iter().flat_map(|r| r.0.to_le_bytes()).collect();
    bytes.resize(bytes.len().next_multiple_of(8), 0);
    let mut machines: Vec<u8> = unreachable.iter().flat_map(|m| m.0.to_le_bytes()).collect();
    machines.resize(machines.len().next_multiple_of(8), 0);
    // Odd while rewriting (already odd if a rewrite was cut short by a power loss).
    let odd = area.load_u64(0, Ordering::Acquire) | 1;
    area.store_u64(0, odd, Ordering::Relaxed);
    std::sync::atomic::fence(Ordering::Release);
    area.store_u64(8, ids.len() as u64, Ordering::Relaxed);
    if !bytes.is_empty() {
        area.write(16, &bytes);
    }
    area.store_u64(UNREACHABLE_AT, unreachable.len() as u64, Ordering::Relaxed);
    if !machines.is_empty() {
        area.write(UNREACHABLE_AT + 8, &machines);
    }
    area.store_u64(0, odd + 1, Ordering::Release);
}

/// What a reconfiguration probe reads of a machine ([`read_complete`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Probed {
    /// The regions whose replica it holds complete.
    pub complete: BTreeSet<RegionId>,
    /// The members it cannot write to.
    pub unreachable: BTreeSet<MachineId>,
}

/// Reads a machine's complete replicas and the members it cannot write to from its
/// [`MemKey::Replicas`] area through `remote`: what a reconfiguration probe learns (§5.2 step
/// 2). An area that stays mid-rewrite for every attempt reads as no complete replica (the safe
/// answer: nothing of it is promoted) and no unreachable member.
pub fn read_complete(
    remote: &dyn farm_core::fabric::RemoteMemory,
) -> Result<Probed, farm_core::fabric::FabricError> {
    const ATTEMPTS: usize = 64;
    for _ in 0..ATTEMPTS {
        let mut head = [0u8; 16];
        remote.read(0, &mut head)?;
        let seq = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        let count = u64::from_le_bytes(head[8..].try_into().expect("8 bytes")) as usize;
        if seq % 2 == 1 || count > crate::control::REGIONS_PER_MACHINE_MAX {
            continue;
        }
        let mut ids = vec![0u8; (4 * count).next_multiple_of(8)];
        if !ids.is_empty() {
            remote.read(16, &mut ids)?;
        }
        let mut word = [0u8; 8];
        remote.read(UNREACHABLE_AT as u64, &mut word)?;
        let unreachable = u64::from_le_bytes(word) as usize;
        if unreachable > UNREACHABLE_MAX {
            continue;
        }
        let mut machines = vec![0u8; (2 * unreachable).next_multiple_of(8)];
        if !machines.is_empty() {
            remote.read(UNREACHABLE_AT as u64 + 8, &mut machines)?;
        }
        remote.read(0, &mut word)?;
        if u64::from_le_bytes(word) != seq {
            continue;
        }
        return Ok(Probed {
            complete: ids
                .chunks_exact(4)
                .take(count)
                .map(|b| RegionId(u32::from_le_bytes(b.try_into().expect("4 bytes"))))
                .collect(),
            unreachable: machines
                .chunks_exact(2)
                .take(unreachable)
                .map(|b| MachineId(u16::from_le_bytes(b.try_into().expect("2 bytes"))))
                .collect(),
        });
    }
    Ok(Probed::default())
}

/// The restart plan's view `plan` as machine `id` keeps it after restarting into `restart`
/// (`MachineState::restored`), given its own newest view before the stop (`own`). A region
/// the plan makes it the primary of, where its own view did not (the restart promoted a
/// complete backup over an incomplete primary), or did with another last primary change (the
/// primary moved in a view it did not install), changed primary at the restart: it may never
/// have seen the LOCK of a transaction in its logs (`primary_before_restart_since`). The
/// plan's view cannot say so itself: a view records no change after its own configuration.
fn as_restored(
    mut plan: farm_core::codec::StoredView,
    id: MachineId,
    restart: ConfigId,
    own: Option<&farm_core::codec::StoredView>,
) -> farm_core::codec::StoredView {
    let last_primary_change = |changes: &BTreeMap<RegionId, RegionChanges>, r: RegionId| {
        changes.get(&r).map(|c| c.last_primary_change)
    };
    let moved: Vec<RegionId> = (plan.map.iter())
        .filter(|(r, p)| {
            p.primary == id
                && !own.is_some_and(|v| {
                    v.map.get(*r).is_some_and(|q| q.primary == id)
                        && last_primary_change(&v.changes, *r)
                            == last_primary_change(&plan.changes, *r)
                })
        })
        .map(|(r, _)| r)
        .collect();
    for r in moved {
        plan.changes.entry(r).or_default().last_primary_change = restart;
    }
    plan
}

fn map_area(dir: &Option<PathBuf>, name: &str, len: usize) -> io::Result<Arc<Nvram>> {
    Ok(Arc::new(match dir {
        Some(dir) => Nvram::file(&dir.join(name), len)?,
        None => Nvram::anonymous(len)?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use farm_core::config::Placement;

    /// A whole-cluster restart that promotes a complete backup over an incomplete primary
    /// makes a machine the primary of a region whose LOCK records went to another machine: it
    /// infers nothing from finding none (a transaction it has no records of is not taken for
    /// truncated), while a region it was the primary of all along still allows the inference.
    #[test]
    fn a_backup_the_restart_promotes_infers_nothing_from_missing_locks() {
        let params = crate::test_cluster::params(1_000);
        let fabric = crate::test_cluster::fabric();
        let config = Configuration::initial(3);
        let map = RegionMap::striped(3, 1, 1);
        let (me, promoted, kept) = (MachineId(1), RegionId(0), RegionId(1));
        assert_eq!(map.get(promoted).unwrap().backups, [me]);
        assert_eq!(map.get(kept).unwrap().primary, me);
        let old = MachineState::new(
            me,
            params,
            config.clone(),
            map.clone(),
            fabric.clone(),
            None,
        )
        .unwrap();
        let mut plan_map = map.clone();
        plan_map.insert(
            promoted,
            Placement {
                primary: me,
                backups: vec![MachineId(0)],
            },
        );
        let stored = farm_core::codec::StoredView {
            config: config.clone(),
            map: plan_map,
            changes: BTreeMap::new(),
        };
        let restart = ConfigId(config.id.0 + 1);
        let state =
            MachineState::restore(me, params, stored, restart, fabric, Reopen::Memory(&old))
                .unwrap();
        let t = farm_core::TxnId {
            config: config.id,
            machine: MachineId(2),
            thread: ThreadId(0),
            local: 1,
        };
        assert!(!state.primary_before_restart_since(promoted, t));
        assert!(state.primary_before_restart_since(kept, t));
    }
}
