//! Fault campaigns under the deterministic driver (FaRM §5): machines crash at seeded steps,
//! the CM among them, landing any prefix of their writes in flight; the CM removes them and
//! transaction recovery decides every transaction in flight. Every seed is checked for strict
//! serializability of the list-append history, for atomicity of transactions whose
//! coordinator crashed (all of their appends visible or none), and for no lost acknowledged
//! commit (a committed append missing from the final read is a real-time cycle), and, once data
//! recovery re-replicated every region, for replica equality.
//! `FARM_SIM_SEED=N` replays one seed; `FARM_SIM_FAULT_SEEDS=N` runs more.

use farm_sim::{run_seed, SimConfig, SimOutcome};

fn config(seed: u64) -> SimConfig {
    SimConfig {
        seed,
        machines: 5,
        threads: 2,
        replicas: 3,
        keys: 6,
        steps: 3000,
        crashes: 1 + (seed % 2) as u16,
    }
}

fn check_seed(seed: u64) -> SimOutcome {
    let out = run_seed(config(seed));
    assert!(
        out.anomalies.is_empty(),
        "seed {seed} (crashed {:?}): {:#?}",
        out.crashed,
        out.anomalies
    );
    assert!(
        out.configurations >= 1,
        "seed {seed}: no configuration committed after crashing {:?}",
        out.crashed
    );
    // Re-replication (§5.4) is done at quiescence: every backup equals its primary.
    out.replicas
        .as_ref()
        .unwrap_or_else(|e| panic!("seed {seed}: replicas differ after recovery: {e}"));
    out
}

#[test]
fn crashes_lose_nothing_and_stay_strictly_serializable() {
    if let Ok(seed) = std::env::var("FARM_SIM_SEED") {
        check_seed(seed.parse().expect("FARM_SIM_SEED is a number"));
        return;
    }
    let seeds: u64 = std::env::var("FARM_SIM_FAULT_SEEDS")
        .map(|s| s.parse().expect("a number"))
        .unwrap_or(1000);
    let (mut unknown, mut unknown_committed, mut recovered, mut double) = (0, 0, 0, 0);
    for seed in 0..seeds {
        let out = check_seed(seed);
        unknown += out.unknown.0;
        unknown_committed += out.unknown.1;
        recovered += out.stats.recovered_commits + out.stats.recovered_aborts;
        double += (out.crashed.len() == 2) as u64;
    }
    println!(
        "{seeds} seeds: {double} with two crashes, {recovered} transactions decided by recovery, \
         {unknown} in flight at a crashed coordinator ({unknown_committed} of them committed)"
    );
    assert!(recovered > 0, "no transaction ever went through recovery");
    assert!(unknown > 0, "no coordinator ever crashed mid-commit");
}
