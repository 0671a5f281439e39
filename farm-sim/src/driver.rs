//! The deterministic driver: a whole cluster in one thread over the `mem` fabric with writes held
//! back, so that a seeded scheduler decides which worker polls next, which commit advances and
//! when each one-sided write lands (DESIGN.md, Determinism). It runs the same protocol code as
//! the threaded runtime (`farm_txn::Worker`), prints its seed first, and a seed replays exactly.

use std::sync::Arc;

use farm_core::config::{Configuration, RegionMap};
use farm_core::fabric::Fabric;
use farm_core::mem_fabric::{MemFabric, MemFabricConfig};
use farm_core::ring::RingLayout;
use farm_core::rng::Rng;
use farm_core::{Addr, MachineId, ThreadId};
use farm_txn::{MachineState, Params, Stats, Tx, TxError, Worker};

use crate::history::{check, Anomaly, Op, TxnRecord};
use crate::replicas::{check_replicas, ReplicaReport};

/// Polls a setup or final-check transaction may take, with every write landing at once.
const SETUP_POLLS_MAX: u64 = 100_000;

/// Values a list object can hold.
pub const LIST_CAPACITY: usize = 48;
const LIST_BYTES: usize = 8 * (LIST_CAPACITY + 1);

/// What a simulation runs.
#[derive(Clone, Copy, Debug)]
pub struct SimConfig {
    /// Every random choice flows from this.
    pub seed: u64,
    /// Machines (each a primary of one region, replicated on all others up to `replicas`).
    pub machines: u16,
    /// Workers per machine; every worker is also a client.
    pub threads: u16,
    /// Replicas per region (f + 1).
    pub replicas: u16,
    /// List keys.
    pub keys: u64,
    /// Scheduler steps before draining.
    pub steps: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            machines: 3,
            threads: 2,
            replicas: 3,
            keys: 6,
            steps: 3000,
        }
    }
}

/// What a simulation produced.
#[derive(Debug)]
pub struct SimOutcome {
    /// The recorded history.
    pub history: Vec<TxnRecord>,
    /// Strict-serializability violations found in it.
    pub anomalies: Vec<Anomaly>,
    /// Replica comparison at quiescence.
    pub replicas: Result<ReplicaReport, String>,
    /// Counters of every worker, summed.
    pub stats: Stats,
    /// Objects allocated by committed transactions and still live at the end, all checked.
    pub live_objects: usize,
}

#[derive(Debug)]
enum Client {
    Idle,
    Committing(TxnRecord, Effects),
}

/// Objects a transaction allocates or frees, applied to the client's set when it commits.
#[derive(Debug, Default)]
struct Effects {
    allocated: Option<(Addr, u64)>,
    freed: Option<Addr>,
}

/// A simulated cluster.
#[derive(Debug)]
pub struct Sim {
    rng: Rng,
    now: u64,
    fabric: Arc<MemFabric>,
    machines: Vec<Arc<MachineState>>,
    /// Workers indexed by `machine * threads + thread`.
    workers: Vec<Worker>,
    clients: Vec<Client>,
    keys: Vec<Addr>,
    /// Objects each client allocated and has not freed, with their values.
    temps: Vec<Vec<(Addr, u64)>>,
    history: Vec<TxnRecord>,
    next_value: u64,
    config: SimConfig,
}

impl Sim {
    /// Builds the cluster and allocates the lists.
    pub fn new(config: SimConfig) -> Self {
        let layout = RingLayout {
            machines_max: config.machines,
            threads: config.threads,
            log_bytes: 256 << 10,
            queue_bytes: 256 << 10,
        };
        let params = Params {
            layout,
            region_bytes: 8 << 20,
            validate_rpc_threshold: 4,
        };
        let fabric = Arc::new(MemFabric::new(MemFabricConfig {
            machines_max: config.machines,
            threads_max: config.threads,
            seed: config.seed,
            datagrams_queued_max: 64,
        }));
        let cfg = Configuration::initial(config.machines);
        let map = RegionMap::striped(config.machines, 1, config.replicas - 1);
        let machines: Vec<_> = (0..config.machines)
            .map(|m| {
                MachineState::new(
                    MachineId(m),
                    params,
                    cfg.clone(),
                    map.clone(),
                    fabric.clone() as Arc<dyn Fabric>,
                    None,
                )
                .expect("anonymous NVRAM")
            })
            .collect();
        let workers = machines
            .iter()
            .flat_map(|m| (0..config.threads).map(move |t| Worker::new(m.clone(), ThreadId(t))))
            .collect::<Vec<_>>();
        let n_clients = workers.len();
        let clients = (0..n_clients).map(|_| Client::Idle).collect();
        let mut sim = Sim {
            rng: Rng::new(config.seed),
            now: 0,
            fabric,
            machines,
            workers,
            clients,
            keys: Vec::new(),
            temps: vec![Vec::new(); n_clients],
            history: Vec::new(),
            next_value: 1,
            config,
        };
        for k in 0..config.keys {
            let w = (k as usize * config.threads as usize) % sim.workers.len();
            let addr = sim.setup_txn(w, |tx| {
                let a = tx.alloc(LIST_BYTES, None)?;
                tx.write(a, &[0u8; LIST_BYTES])?;
                Ok(a)
            });
            sim.keys.push(addr);
        }
        sim.fabric.set_hold_writes(true);
        sim
    }

    /// Runs a transaction to completion with every write landing at once (setup and final
    /// checks, outside the randomized schedule).
    fn setup_txn<R>(&mut self, w: usize, f: impl FnOnce(&mut Tx<'_>) -> Result<R, TxError>) -> R {
        let mut tx = Tx::new(&mut self.workers[w]);
        let r = f(&mut tx).expect("setup transaction");
        let state = tx.into_state();
        self.workers[w].start_commit(state);
        for _ in 0..SETUP_POLLS_MAX {
            self.now += 1;
            self.fabric.deliver_all();
            for x in &mut self.workers {
                x.poll(self.now);
            }
            if let Some(res) = self.workers[w].poll_commit(self.now) {
                res.expect("setup commit");
                return r;
            }
        }
        panic!(
            "seed {}: a setup or check transaction did not commit",
            self.config.seed
        );
    }

    /// One scheduler step: poll a worker, land a held write, or advance a client.
    fn step(&mut self, start_new: bool) {
        self.now += 1;
        match self.rng.below(3) {
            0 => {
                let w = self.rng.below(self.workers.len() as u64) as usize;
                self.workers[w].poll(self.now);
            }
            1 => {
                let held = self.fabric.held_links();
                if !held.is_empty() {
                    let (src, dst, _) = held[self.rng.below(held.len() as u64) as usize];
                    self.fabric.deliver_next(src, dst);
                }
            }
            _ => {
                let c = self.rng.below(self.clients.len() as u64) as usize;
                self.advance_client(c, start_new);
            }
        }
    }

    fn advance_client(&mut self, c: usize, start_new: bool) {
        match std::mem::replace(&mut self.clients[c], Client::Idle) {
            Client::Idle if start_new => self.start_txn(c),
            Client::Idle => {}
            Client::Committing(mut rec, effects) => match self.workers[c].poll_commit(self.now) {
                None => self.clients[c] = Client::Committing(rec, effects),
                Some(r) => {
                    rec.complete = self.now;
                    rec.committed = r.is_ok();
                    if rec.committed {
                        if let Some(a) = effects.freed {
                            self.temps[c].retain(|(t, _)| *t != a);
                        }
                        self.temps[c].extend(effects.allocated);
                    }
                    self.history.push(rec);
                }
            },
        }
    }

    /// Executes a random transaction on client `c` and starts its commit: list reads and
    /// appends, plus sometimes an allocation near a random list (often at a remote primary, over
    /// ALLOC while the execution polls the other workers and lands held writes) and a free of an
    /// object this client allocated before.
    fn start_txn(&mut self, c: usize) {
        let n_ops = 1 + self.rng.below(3);
        let mut plan = Vec::new();
        for _ in 0..n_ops {
            let key = self.rng.below(self.keys.len() as u64);
            let value = (self.rng.below(2) == 0).then(|| {
                self.next_value += 1;
                self.next_value
            });
            plan.push((key, value));
        }
        let alloc_near = (self.rng.below(4) == 0).then(|| {
            self.next_value += 1;
            (
                self.keys[self.rng.below(self.keys.len() as u64) as usize],
                self.next_value,
            )
        });
        let free = if !self.temps[c].is_empty() && self.rng.below(4) == 0 {
            Some(self.temps[c][self.rng.below(self.temps[c].len() as u64) as usize])
        } else {
            None
        };
        let keys = self.keys.clone();
        let (before, rest) = self.workers.split_at_mut(c);
        let (worker, after) = rest.split_first_mut().expect("client in range");
        let (now, rng, fabric) = (&mut self.now, &mut self.rng, &self.fabric);
        let mut poll_others = || {
            *now += 1;
            let held = fabric.held_links();
            if !held.is_empty() {
                let (src, dst, _) = held[rng.below(held.len() as u64) as usize];
                fabric.deliver_next(src, dst);
            }
            for w in before.iter_mut().chain(after.iter_mut()) {
                w.poll(*now);
            }
            *now
        };
        let mut tx = Tx::with_poller(worker, &mut poll_others);
        let mut ops = Vec::new();
        let mut effects = Effects::default();
        let result = (|| -> Result<(), TxError> {
            for (key, value) in plan {
                let addr = keys[key as usize];
                let bytes = tx.read(addr, LIST_BYTES)?;
                let mut list: Vec<u64> = bytes
                    .chunks(8)
                    .map(|w| u64::from_le_bytes(w.try_into().expect("8")))
                    .collect();
                let len = list[0] as usize;
                match value {
                    Some(v) if len < LIST_CAPACITY => {
                        list[1 + len] = v;
                        list[0] += 1;
                        let out: Vec<u8> = list.iter().flat_map(|w| w.to_le_bytes()).collect();
                        tx.write(addr, &out)?;
                        ops.push(Op::Append { key, value: v });
                    }
                    _ => ops.push(Op::Read {
                        key,
                        values: list[1..=len].to_vec(),
                    }),
                }
            }
            if let Some((near, v)) = alloc_near {
                let a = tx.alloc(16, Some(near))?;
                tx.write(a, &[v.to_le_bytes(), v.to_le_bytes()].concat())?;
                effects.allocated = Some((a, v));
            }
            if let Some((a, v)) = free {
                let got = tx.read(a, 16)?;
                assert_eq!(&got[..8], &v.to_le_bytes(), "object {a} lost its value");
                tx.free(a)?;
                effects.freed = Some(a);
            }
            Ok(())
        })();
        let state = tx.into_state();
        let rec = TxnRecord {
            ops,
            invoke: self.now,
            complete: self.now,
            committed: false,
        };
        match result {
            Ok(()) => {
                self.workers[c].start_commit(state);
                self.clients[c] = Client::Committing(rec, effects);
            }
            Err(e) => {
                assert!(
                    e.is_retryable(),
                    "seed {}: unexpected execution error {e}",
                    self.config.seed
                );
                self.workers[c].abort_execution(state, &e);
                self.history.push(rec);
            }
        }
    }

    /// Runs the configured steps, drains every client, quiesces and checks.
    pub fn run(mut self) -> SimOutcome {
        for _ in 0..self.config.steps {
            self.step(true);
        }
        let mut rounds = 0u64;
        while self
            .clients
            .iter()
            .any(|c| matches!(c, Client::Committing(..)))
        {
            self.step(false);
            rounds += 1;
            assert!(
                rounds < 1_000_000,
                "seed {}: clients did not finish",
                self.config.seed
            );
        }
        self.quiesce();
        // A final read of every list, so that every committed append is ordered.
        let keys = self.keys.clone();
        let invoke = self.now;
        let ops = self.setup_txn(0, |tx| {
            keys.iter()
                .enumerate()
                .map(|(k, a)| {
                    let b = tx.read(*a, LIST_BYTES)?;
                    let list: Vec<u64> = b
                        .chunks(8)
                        .map(|w| u64::from_le_bytes(w.try_into().expect("8")))
                        .collect();
                    Ok(Op::Read {
                        key: k as u64,
                        values: list[1..=list[0] as usize].to_vec(),
                    })
                })
                .collect::<Result<Vec<_>, TxError>>()
        });
        self.history.push(TxnRecord {
            ops,
            invoke,
            complete: self.now,
            committed: true,
        });
        // Every object allocated by a committed transaction and not freed holds its value.
        let temps: Vec<(Addr, u64)> = self.temps.iter().flatten().copied().collect();
        let seed = self.config.seed;
        self.setup_txn(0, |tx| {
            for (a, v) in &temps {
                let got = tx.read(*a, 16)?;
                assert_eq!(
                    &got[..8],
                    &v.to_le_bytes(),
                    "seed {seed}: object {a} lost its value"
                );
            }
            Ok(())
        });
        self.quiesce();
        let anomalies = check(&self.history);
        let replicas = check_replicas(&self.machines);
        let mut stats = Stats::default();
        for w in &self.workers {
            stats.add(w.stats());
        }
        SimOutcome {
            history: self.history,
            anomalies,
            replicas,
            stats,
            live_objects: temps.len(),
        }
    }

    /// Lands every write and truncates everything, until no worker has anything retained.
    fn quiesce(&mut self) {
        self.fabric.set_hold_writes(false);
        for _ in 0..1000 {
            self.fabric.deliver_all();
            self.now += 1_000;
            for w in &mut self.workers {
                w.poll(self.now);
                w.flush_truncations();
                w.report_all_freed();
            }
            for w in &mut self.workers {
                w.poll(self.now);
            }
            if self
                .workers
                .iter()
                .all(|w| w.coordinator_quiet() && w.retained_records() == 0)
            {
                self.fabric.set_hold_writes(true);
                return;
            }
        }
        panic!("seed {}: the cluster did not quiesce", self.config.seed);
    }
}

/// Runs one seed, printing it first so that a failure can be replayed.
pub fn run_seed(config: SimConfig) -> SimOutcome {
    println!(
        "farm-sim seed {} (replay: FARM_SIM_SEED={})",
        config.seed, config.seed
    );
    Sim::new(config).run()
}
