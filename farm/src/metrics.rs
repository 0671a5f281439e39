//! Prometheus metrics of machines (docs/ARCHITECTURE.md, Observability): what a scrape of a
//! machine process (`metrics_addr`) or [`crate::Cluster::metrics`] answers, in the OpenMetrics
//! text format through `prometheus-client`. Every figure is read at the scrape from the
//! machine's own state: the workers' counters (those of a host a pipeline keeps as its
//! executor last published them), the commit-latency buckets of the hosts, the view, the
//! lease manager's suspicions, the regions it copies, the datagrams it refused; and the
//! reconfigurations the process drove. Every metric of a machine has a `machine` label.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use farm_core::fabric::Traffic;
use farm_core::{ConfigId, MachineId};
use farm_txn::{MachineState, RingsHeld, Stats};

use crate::lease_thread::Suspicion;
use crate::ReconfigEvent;

/// Upper bounds of the commit-latency buckets, in microseconds (then +Inf).
pub(crate) const LATENCY_BOUNDS_US: [u64; 16] = [
    10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000,
    500_000, 1_000_000,
];

/// Commit latencies (from the start of a commit to its outcome), counted in buckets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Latency {
    /// Commits per bucket of [`LATENCY_BOUNDS_US`], the last past them all.
    counts: [u64; LATENCY_BOUNDS_US.len() + 1],
    sum_us: u64,
}

impl Latency {
    /// Counts a commit that took `us` microseconds.
    pub(crate) fn record(&mut self, us: u64) {
        let i = LATENCY_BOUNDS_US.partition_point(|&b| b < us);
        self.counts[i] += 1;
        self.sum_us += us;
    }

    pub(crate) fn add(&mut self, other: &Latency) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum_us += other.sum_us;
    }

    /// How many commits were counted.
    pub(crate) fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        // Per bucket, as `prometheus_client`'s own histograms keep them: the encoder sums
        // them into the cumulative `le` counts.
        let buckets: Vec<(f64, u64)> = (LATENCY_BOUNDS_US.iter().map(|&b| b as f64 / 1e6))
            .chain([f64::MAX])
            .zip(self.counts.iter().copied())
            .collect();
        encoder.encode_histogram::<NoLabelSet>(
            self.sum_us as f64 / 1e6,
            self.count(),
            &buckets,
            None,
        )
    }
}

/// The counters a host keeps for one of its workers' machines, beside the worker's own.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    /// The worker's counters.
    pub(crate) stats: Stats,
    /// Commits coordinated by the worker, by latency.
    pub(crate) commit_latency: Latency,
    /// Lock-free reads (§3) the host did for the machine.
    pub(crate) lock_free_reads: u64,
    /// What the machine's threads hold in each peer's rings, summed over them.
    pub(crate) rings: std::collections::BTreeMap<MachineId, RingsHeld>,
}

impl Counters {
    pub(crate) fn add(&mut self, other: &Counters) {
        self.stats.add(&other.stats);
        self.commit_latency.add(&other.commit_latency);
        self.lock_free_reads += other.lock_free_reads;
        for (peer, r) in &other.rings {
            let held = self.rings.entry(*peer).or_insert(RingsHeld {
                peer: *peer,
                ..RingsHeld::default()
            });
            held.log_bytes += r.log_bytes;
            held.queue_bytes += r.queue_bytes;
            held.backlogged += r.backlogged;
        }
    }
}

/// What one machine's metrics are read from at a scrape.
#[derive(Clone, Debug)]
pub(crate) struct Sample {
    pub(crate) machine: MachineId,
    pub(crate) counters: Counters,
    /// The configuration this machine is in, its members and its CM.
    pub(crate) config: ConfigId,
    pub(crate) members: usize,
    /// The members, for the per-peer figures.
    pub(crate) peers: Vec<MachineId>,
    pub(crate) cm: MachineId,
    /// Whether this machine was removed from the configuration while alive.
    pub(crate) evicted: bool,
    /// Lease expiries this machine's lease manager saw.
    pub(crate) suspicions: u64,
    /// Regions of which this machine is a replica being copied (§5.4).
    pub(crate) regions_copying: usize,
    /// Regions this machine is primary of.
    pub(crate) primary_regions: usize,
    /// Datagrams refused (forged, replayed, stale), where the fabric counts them.
    pub(crate) datagrams_refused: u64,
    /// One-sided operations posted to each peer, where the fabric counts them.
    pub(crate) traffic: Vec<(MachineId, Traffic)>,
}

impl Sample {
    /// The sample of `machine`, with `counters` from its hosts, the process's `suspicions`
    /// (of every machine it runs), and from its fabric `datagrams_refused` and its traffic.
    pub(crate) fn of(
        machine: &MachineState,
        counters: Counters,
        suspicions: &[Suspicion],
        (datagrams_refused, traffic): (u64, Vec<(MachineId, Traffic)>),
    ) -> Self {
        let view = machine.view();
        let config = view.config.clone();
        Self {
            machine: machine.id,
            counters,
            config: config.id,
            members: config.members.len(),
            peers: config.members.clone(),
            cm: config.cm,
            evicted: machine.is_evicted(),
            suspicions: suspicions
                .iter()
                .filter(|s| s.observer == machine.id)
                .count() as u64,
            regions_copying: machine.copying_regions().len(),
            primary_regions: view.map.primary_of(machine.id).count(),
            datagrams_refused,
            traffic,
        }
    }
}

/// What the process's control plane did: reconfigurations it drove (FaRM §5.2).
#[derive(Clone, Debug, Default)]
pub(crate) struct Reconfigurations {
    /// Configurations committed.
    committed: u64,
    /// From the suspicion that started the last one to its NEW-CONFIG-COMMIT, in µs.
    last_us: Option<u64>,
}

impl Reconfigurations {
    /// What `events` (this process's, in order) say.
    pub(crate) fn of(events: &[ReconfigEvent]) -> Self {
        let mut r = Self::default();
        let mut suspected = None;
        for e in events {
            match e {
                ReconfigEvent::Suspect { at_us, .. } => {
                    suspected.get_or_insert(*at_us);
                }
                ReconfigEvent::Committed { at_us, .. } => {
                    r.committed += 1;
                    r.last_us = suspected.take().map(|s| at_us.saturating_sub(s));
                }
                _ => {}
            }
        }
        r
    }
}

/// The OpenMetrics text of `samples` and of the process's `reconfigurations`.
pub(crate) fn render(samples: Vec<Sample>, reconfigurations: Reconfigurations) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Samples(samples, reconfigurations)));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)
        .expect("writing to a String does not fail");
    text
}

#[derive(Debug)]
struct Samples(Vec<Sample>, Reconfigurations);

impl Samples {
    /// One metric: its descriptor, then a value per machine (`value` of its sample).
    fn metric(
        &self,
        encoder: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        kind: MetricType,
        value: impl Fn(&Sample, MetricEncoder<'_>) -> Result<(), std::fmt::Error>,
    ) -> Result<(), std::fmt::Error> {
        let mut metric = encoder.encode_descriptor(name, help, unit, kind)?;
        for s in &self.0 {
            let labels = [("machine", s.machine.0 as u64)];
            value(s, metric.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn counter(
        &self,
        encoder: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        value: impl Fn(&Sample) -> u64,
    ) -> Result<(), std::fmt::Error> {
        self.metric(
            encoder,
            name,
            help,
            None,
            MetricType::Counter,
            |s, mut e| e.encode_counter::<NoLabelSet, _, u64>(&value(s), None),
        )
    }

    fn gauge<G: EncodeGaugeValue>(
        &self,
        encoder: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        value: impl Fn(&Sample) -> G,
    ) -> Result<(), std::fmt::Error> {
        self.metric(encoder, name, help, unit, MetricType::Gauge, |s, mut e| {
            e.encode_gauge(&value(s))
        })
    }
}

impl Samples {
    /// A gauge's value per machine and peer of the configuration (0 where nothing is held).
    fn per_peer(
        &self,
        metric: &mut MetricEncoder<'_>,
        value: impl Fn(&RingsHeld) -> u64,
    ) -> Result<(), std::fmt::Error> {
        for s in &self.0 {
            for peer in s.peers.iter().filter(|p| **p != s.machine) {
                let held = s.counters.rings.get(peer).map_or(0, &value);
                let labels = [("machine", s.machine.0 as u64), ("peer", peer.0 as u64)];
                metric
                    .encode_family(&labels)?
                    .encode_gauge(&(held as i64))?;
            }
        }
        Ok(())
    }
}

impl Collector for Samples {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let e = &mut e;
        self.counter(
            e,
            "farm_commits",
            "Transactions committed, read-only ones included",
            |s| s.counters.stats.commits,
        )?;
        // Aborts by cause: one metric with a `cause` label beside `machine`.
        let mut aborts = e.encode_descriptor(
            "farm_aborts",
            "Transaction attempts aborted, by cause",
            None,
            MetricType::Counter,
        )?;
        for s in &self.0 {
            let st = &s.counters.stats;
            for (cause, n) in [
                ("read_locked", st.aborts_read_locked),
                ("read_torn", st.aborts_read_torn),
                ("lock", st.aborts_lock),
                ("validate", st.aborts_validate),
                ("other", st.aborts_other),
            ] {
                let labels = [
                    ("machine", s.machine.0.to_string()),
                    ("cause", cause.into()),
                ];
                aborts
                    .encode_family(&labels)?
                    .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
            }
        }
        self.metric(
            e,
            "farm_commit_latency",
            "Time from the start of a commit to its outcome, of transactions this machine coordinated",
            Some(&Unit::Seconds),
            MetricType::Histogram,
            |s, enc| s.counters.commit_latency.encode(enc),
        )?;
        self.counter(
            e,
            "farm_lock_free_reads",
            "Lock-free reads of committed objects (FaRM §3)",
            |s| s.counters.lock_free_reads,
        )?;
        self.counter(
            e,
            "farm_object_reads",
            "Consistent object reads inside transactions",
            |s| s.counters.stats.reads,
        )?;
        self.counter(
            e,
            "farm_object_reads_remote",
            "Consistent object reads inside transactions from another machine's primary (over the fabric)",
            |s| s.counters.stats.reads_remote,
        )?;
        self.counter(
            e,
            "farm_allocations",
            "Objects allocated at this machine's primaries",
            |s| s.counters.stats.allocs,
        )?;
        self.counter(
            e,
            "farm_frees",
            "Objects freed at this machine's primaries",
            |s| s.counters.stats.frees,
        )?;
        self.counter(
            e,
            "farm_log_space_waits",
            "Commits that waited for log space before starting",
            |s| s.counters.stats.reserve_waits,
        )?;
        self.counter(
            e,
            "farm_queue_full_waits",
            "Messages that waited for queue space",
            |s| s.counters.stats.queue_full_waits,
        )?;
        self.counter(
            e,
            "farm_recovered_transactions_committed",
            "Recovering transactions this machine decided to commit (FaRM §5.3)",
            |s| s.counters.stats.recovered_commits,
        )?;
        self.counter(
            e,
            "farm_recovered_transactions_aborted",
            "Recovering transactions this machine decided to abort (FaRM §5.3)",
            |s| s.counters.stats.recovered_aborts,
        )?;
        self.gauge(
            e,
            "farm_configuration",
            "The id of the configuration this machine is in",
            None,
            |s| s.config.0 as i64,
        )?;
        self.gauge(
            e,
            "farm_members",
            "Machines of the configuration this machine is in",
            None,
            |s| s.members as i64,
        )?;
        self.gauge(
            e,
            "farm_cm",
            "The configuration manager (CM) of this machine's configuration",
            None,
            |s| s.cm.0 as i64,
        )?;
        self.gauge(
            e,
            "farm_is_cm",
            "1 if this machine is its configuration's CM, else 0",
            None,
            |s| (s.cm == s.machine) as i64,
        )?;
        self.gauge(
            e,
            "farm_evicted",
            "1 if this machine was removed from the configuration while alive, else 0",
            None,
            |s| s.evicted as i64,
        )?;
        self.counter(
            e,
            "farm_suspicions",
            "Lease expiries this machine's lease manager saw (FaRM §5.1)",
            |s| s.suspicions,
        )?;
        self.counter(
            e,
            "farm_recovery_read_bytes",
            "Bytes data recovery read from primaries to copy their regions here (FaRM §5.4)",
            |s| s.counters.stats.recovery_bytes_read,
        )?;
        for (name, help, value) in [
            (
                "farm_log_held",
                "Bytes of this machine's log records in a peer's log not yet truncated there",
                (|r: &RingsHeld| r.log_bytes) as fn(&RingsHeld) -> u64,
            ),
            (
                "farm_queue_held",
                "Bytes of this machine's messages in a peer's queue not yet processed there",
                |r: &RingsHeld| r.queue_bytes,
            ),
        ] {
            let mut m = e.encode_descriptor(name, help, Some(&Unit::Bytes), MetricType::Gauge)?;
            self.per_peer(&mut m, value)?;
        }
        let mut m = e.encode_descriptor(
            "farm_backlogged_messages",
            "Messages waiting here for room in a peer's queue",
            None,
            MetricType::Gauge,
        )?;
        self.per_peer(&mut m, |r| r.backlogged)?;
        self.gauge(
            e,
            "farm_regions_copying",
            "Regions of which this machine holds a replica still being copied (FaRM §5.4)",
            None,
            |s| s.regions_copying as i64,
        )?;
        self.gauge(
            e,
            "farm_primary_regions",
            "Regions this machine is primary of; it gets another from the CM when they are full \
             (FaRM §3)",
            None,
            |s| s.primary_regions as i64,
        )?;
        for (name, help, value) in [
            (
                "farm_one_sided_reads",
                "One-sided reads this machine posted to a peer",
                (|t: &Traffic| t.reads) as fn(&Traffic) -> u64,
            ),
            (
                "farm_one_sided_read_bytes",
                "Bytes of the one-sided reads this machine posted to a peer",
                |t: &Traffic| t.read_bytes,
            ),
            (
                "farm_one_sided_writes",
                "One-sided writes this machine posted to a peer",
                |t: &Traffic| t.writes,
            ),
            (
                "farm_one_sided_write_bytes",
                "Bytes of the one-sided writes this machine posted to a peer",
                |t: &Traffic| t.write_bytes,
            ),
        ] {
            let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
            for s in &self.0 {
                for (peer, t) in &s.traffic {
                    let labels = [("machine", s.machine.0 as u64), ("peer", peer.0 as u64)];
                    m.encode_family(&labels)?
                        .encode_counter::<NoLabelSet, _, u64>(&value(t), None)?;
                }
            }
        }
        self.counter(
            e,
            "farm_recovery_messages_refused",
            "Recovery messages refused for naming a configuration further ahead than a peer can",
            |s| s.counters.stats.recovery_refused,
        )?;
        self.counter(
            e,
            "farm_datagrams_refused",
            "Lease and control datagrams refused: forged, replayed or stale",
            |s| s.datagrams_refused,
        )?;
        // The process's control plane, not one machine's.
        let r = &self.1;
        let mut m = e.encode_descriptor(
            "farm_reconfigurations",
            "Configurations this process's control plane committed as the driver of a \
             reconfiguration (FaRM §5.2)",
            None,
            MetricType::Counter,
        )?;
        m.encode_counter::<NoLabelSet, _, u64>(&r.committed, None)?;
        let mut m = e.encode_descriptor(
            "farm_last_reconfiguration_duration",
            "From the suspicion to NEW-CONFIG-COMMIT, of the last reconfiguration this process \
             drove",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?;
        m.encode_gauge(&(r.last_us.unwrap_or(0) as f64 / 1e6))?;
        Ok(())
    }
}
