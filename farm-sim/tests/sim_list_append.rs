//! List-append under the deterministic driver (FaRM §4 correctness: committed transactions are
//! strictly serializable), many seeds; `FARM_SIM_SEED` replays one, `FARM_SIM_SEEDS` runs more.

use farm_sim::{run_seed, SimConfig};

fn check_seed(seed: u64) {
    let out = run_seed(SimConfig {
        seed,
        ..SimConfig::default()
    });
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
    for seed in 0..seeds {
        let out = run_seed(SimConfig {
            seed,
            ..SimConfig::default()
        });
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
}

#[test]
fn a_seed_replays_exactly() {
    let a = run_seed(SimConfig {
        seed: 42,
        ..SimConfig::default()
    });
    let b = run_seed(SimConfig {
        seed: 42,
        ..SimConfig::default()
    });
    assert_eq!(a.stats, b.stats);
    assert_eq!(format!("{:?}", a.history), format!("{:?}", b.history));
    check_seed(42);
}
