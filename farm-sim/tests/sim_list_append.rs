//! List-append under the deterministic driver (FaRM §4 correctness: committed transactions are
//! strictly serializable), many seeds; `FARM_SIM_SEED` replays one, `FARM_SIM_SEEDS` runs more.

use farm_sim::{run_seed, SimConfig};

/// Each worker keeps one to four transactions in flight, as the seed says: their executions
/// interleave (each suspended while a read is on its way, or as the seed says) and so do their
/// commits.
fn config(seed: u64) -> SimConfig {
    SimConfig {
        seed,
        clients_per_worker: 1 + (seed % 4) as u16,
        ..SimConfig::default()
    }
}

fn check_seed(seed: u64) {
    let out = run_seed(config(seed));
    let committed = out
        .history
        .iter()
        .filter(|t| t.committed && !t.ops.is_empty())
        .count();
    assert!(
        out.anomalies.is_empty(),
        "seed {seed}: {:#?}",
        out.anomalies
    );
    let report = out
        .replicas
        .unwrap_or_else(|e| panic!("seed {seed}: replicas differ: {e}"));
    assert!(report.objects > 0, "seed {seed}: no objects compared");
    assert!(
        committed > 10,
        "seed {seed}: only {committed} transactions committed"
    );
}

#[test]
fn list_append_is_strictly_serializable_across_seeds() {
    if let Ok(seed) = std::env::var("FARM_SIM_SEED") {
        check_seed(seed.parse().expect("FARM_SIM_SEED is a number"));
        return;
    }
    let seeds: u64 = std::env::var("FARM_SIM_SEEDS")
        .map(|s| s.parse().expect("a number"))
        .unwrap_or(300);
    let (mut aborted, mut remote_allocs, mut frees, mut live) = (0, 0, 0, 0);
    let (mut in_flight_max, mut executions_max) = (0, 0);
    for seed in 0..seeds {
        let out = run_seed(config(seed));
        in_flight_max = in_flight_max.max(out.commits_in_flight_max);
        executions_max = executions_max.max(out.executions_in_flight_max);
        assert!(
            out.anomalies.is_empty(),
            "seed {seed}: {:#?}",
            out.anomalies
        );
        out.replicas
            .unwrap_or_else(|e| panic!("seed {seed}: replicas differ: {e}"));
        aborted += out.stats.aborts();
        remote_allocs += out.stats.allocs_remote;
        frees += out.stats.frees;
        live += out.live_objects;
    }
    assert!(
        remote_allocs > 0 && frees > 0 && live > 0,
        "{remote_allocs} remote allocations, {frees} frees, {live} live objects"
    );
    assert!(
        aborted > 0,
        "the schedules produced no conflicts at all: the test is too weak"
    );
    assert!(
        in_flight_max >= 3,
        "no worker ever had more than {in_flight_max} commits in flight"
    );
    assert!(
        executions_max >= 3,
        "no worker ever had more than {executions_max} executions open at once"
    );
}

#[test]
fn a_seed_replays_exactly() {
    let a = run_seed(config(42));
    let b = run_seed(config(42));
    assert_eq!(a.stats, b.stats);
    assert_eq!(format!("{:?}", a.history), format!("{:?}", b.history));
    check_seed(42);
}
