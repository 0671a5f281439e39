//! Fault campaigns under the deterministic driver (FaRM §5): machines crash at seeded steps,
//! the CM among them, landing any prefix of their writes in flight; the CM removes them and
//! transaction recovery decides every transaction in flight. Every seed is checked for strict
//! serializability of the list-append history, for atomicity of transactions whose
//! coordinator crashed (all of their appends visible or none), and for no lost acknowledged
//! commit (a committed append missing from the final read is a real-time cycle), and, once data
//! recovery re-replicated every region, for replica equality.
//! A second campaign cuts the power of the whole cluster at seeded steps (every machine crashes
//! at once, landing any prefix of its writes) and restarts it from NVRAM, with and without a
//! crash before (then the power often goes in the middle of the reconfiguration or of the
//! recovery that follow, and half the time a link between two survivors stalls for a while, so
//! that records land after the drain), checked the same way. A third of its restarts are cut
//! short by the power again, during the restart exchange, often after some machines reopened
//! their NVRAM.
//! Leases detect the failures (FaRM §5.1), over datagrams that half of the seeds lose and delay;
//! a third of the seeds pause a machine for longer than a lease: it is removed, runs again
//! on its stale view, and stops once its own lease tells it it is out.
//! A quarter of the seeds also stall the whole cluster (no machine runs for a few leases), and a
//! third campaign stalls a cluster without failures, where nobody may be suspected at all.
//! A campaign pauses a machine of clusters of three or four, half the time with its memory
//! still reachable (as a stopped process's over `shm`). Further campaigns lose the CM and its
//! first backup CM together (five to seven machines, one to three threads), and crash machines
//! of clusters of 20 to 90 machines with over a thousand regions, and have members allocate
//! regions (§3) while machines crash, pause and lose power. The last draws the shape itself
//! from the seed (machines, threads, replicas, keys, length, allocations and every fault kind).
//! Others have spare machines join (§5.2) while machines crash and pause and the store times
//! out, and amid power losses and partitions: each must end up a member (unless it failed
//! after joining).
//! A fifth of the seeds replicate with RPCs (backups' CPUs acknowledge COMMIT-BACKUP) instead of
//! one-sided writes, and a quarter of the crash campaign's have a coordination store whose
//! operations time out now and then (a compare-and-set before or after it took effect).
//! `FARM_SIM_SEED=N` replays one seed (in every campaign; name one test to run only it);
//! `FARM_SIM_FAULT_SEEDS=N` runs more of each (`FARM_SIM_SCALE_SEEDS=N` of the large clusters),
//! and `FARM_SIM_FIRST_SEED=K` starts them at seed K instead of 0.

use farm_sim::{run_seed, SimConfig, SimOutcome};
use farm_txn::Replication;

/// One or two crashes; a third of the seeds pause a machine besides a single crash (a removed
/// machine is a failure too: at most f = 2 per run); a quarter time the store out. Each worker
/// keeps one to four transactions in flight (every campaign below inherits it).
fn config(seed: u64) -> SimConfig {
    let crashes = 1 + (seed % 2) as u16;
    SimConfig {
        seed,
        machines: 5,
        regions_per_machine: 1,
        threads: 2,
        replicas: 3,
        keys: 6,
        steps: 3000,
        crashes,
        pauses: (crashes == 1 && !seed.is_multiple_of(3)) as u16,
        lossy_datagrams: seed % 4 >= 2,
        power_losses: 0,
        stalls: (seed % 4 == 1) as u16,
        replication: if seed % 5 == 4 {
            Replication::Rpc
        } else {
            Replication::OneSided
        },
        cm_failover: false,
        paused_memory_reachable: seed.is_multiple_of(4),
        store_timeouts: seed % 8 >= 6,
        allocations: 0,
        clients_per_worker: 1 + (seed / 7 % 4) as u16,
        disk_losses: false,
        partitions: 0,
        minority_reads: false,
        joins: 0,
    }
}

/// A machine paused past its lease in a small cluster (three or four machines, two replicas,
/// one or two threads), cut off or with its memory still reachable (a stopped process over
/// `shm`, or an RDMA NIC serving a stopped CPU): removed, it runs again on its stale view and
/// stops once it learns it is out; half the seeds lose and delay datagrams.
fn pause_config(seed: u64) -> SimConfig {
    SimConfig {
        machines: 3 + (seed % 2) as u16,
        threads: 1 + (seed / 2 % 2) as u16,
        replicas: 2,
        crashes: 0,
        pauses: 1,
        stalls: 0,
        lossy_datagrams: seed / 4 % 2 == 1,
        paused_memory_reachable: seed / 8 % 2 == 1,
        ..config(seed)
    }
}

/// A minority cut off while every machine runs on (§5.2): one or two of five to seven machines,
/// the CM among them half the time, for two to five leases; a third of the seeds crash a
/// machine too (the minority is then one machine). The majority removes the minority, which
/// must serve nothing the majority overwrote meanwhile, and stops once it learns it is out.
fn partition_config(seed: u64) -> SimConfig {
    SimConfig {
        machines: 5 + (seed % 3) as u16,
        threads: 1 + (seed / 3 % 3) as u16,
        crashes: (seed % 3 == 2) as u16,
        pauses: 0,
        stalls: 0,
        partitions: 1,
        ..config(seed)
    }
}

/// As [`partition_config`], with the minority cut off from the coordination store too, for eight
/// to twenty leases, and its machines' own lists read while the partition lasts
/// ([`SimConfig::minority_reads`]).
fn minority_read_config(seed: u64) -> SimConfig {
    SimConfig {
        minority_reads: true,
        ..partition_config(seed)
    }
}

/// The CM and its first backup CM crash together (§5.2 step 1), in clusters of five to seven
/// machines with one to three threads; a quarter of the seeds stall the whole cluster too, and
/// half lose and delay datagrams.
fn cm_failover_config(seed: u64) -> SimConfig {
    SimConfig {
        machines: 5 + (seed % 3) as u16,
        threads: 1 + (seed / 3 % 3) as u16,
        crashes: 2,
        pauses: 0,
        stalls: (seed % 4 == 1) as u16,
        cm_failover: true,
        ..config(seed)
    }
}

/// A large cluster: 20 to 90 machines, each primary of enough regions that the cluster has
/// at least 1,024 (a view of thousands of regions travels as several datagrams), one thread,
/// one or two crashes (the CM among the candidates) and lossy datagrams in half the seeds.
fn scale_config(seed: u64) -> SimConfig {
    let machines = 20 + (seed * 37 % 71) as u16;
    SimConfig {
        machines,
        regions_per_machine: 1024u32.div_ceil(machines as u32),
        threads: 1,
        keys: 12,
        steps: 2500,
        pauses: 0,
        stalls: 0,
        ..config(seed)
    }
}

/// Region allocation (§3) amid failures: three requests from running members, one or two
/// crashes, a pause in a third of the seeds, a power loss in a quarter, lossy datagrams and
/// store timeouts as [`config`] draws them.
fn allocation_config(seed: u64) -> SimConfig {
    let power_losses = seed.is_multiple_of(4) as u16;
    SimConfig {
        allocations: 3,
        power_losses,
        // A power loss restarts every machine: no crash besides it (as `power_config`).
        crashes: if power_losses > 0 {
            0
        } else {
            config(seed).crashes
        },
        ..config(seed)
    }
}

/// The crash campaign's shapes with one or two spare machines asking to join at seeded steps,
/// the coordination store timing out in half the seeds, and allocations in two thirds.
fn join_config(seed: u64) -> SimConfig {
    SimConfig {
        joins: 1 + (seed % 2) as u16,
        store_timeouts: seed % 4 < 2,
        allocations: (seed % 3) as u16,
        ..config(seed)
    }
}

/// The varied shapes (4 to 7 machines, 1 to 3 threads, 2 or 3 replicas, crashes, pauses, power
/// losses, stalls, lossy datagrams, RPC replication, allocations) with one or two spares
/// joining.
fn varied_join_config(seed: u64) -> SimConfig {
    SimConfig {
        joins: 1 + (seed % 2) as u16,
        store_timeouts: seed % 4 < 2,
        ..varied_config(seed)
    }
}

/// One or two spares join amid power losses (a third of the seeds) or partitions (the others,
/// half of them with the minority cut off from the store too): the power may go before a
/// spare asked, while it joins, or after, and a partition may cut off the CM a spare asks;
/// a quarter time the store out. The shapes of the power and partition campaigns, drawn from
/// the seed.
fn join_power_partition_config(seed: u64) -> SimConfig {
    let mut r = farm_core::rng::Rng::new(seed ^ 0x701e_fa17);
    let shape = r.next_u64() % 1_000_000;
    let base = match r.below(6) {
        0 | 1 => power_config(shape),
        2 | 3 => partition_config(shape),
        _ => minority_read_config(shape),
    };
    SimConfig {
        seed,
        joins: 1 + r.below(2) as u16,
        store_timeouts: r.below(4) == 0,
        ..base
    }
}

/// Regions of one block each (two per machine make them 2 MiB, of which a block is the
/// region's own), so that a machine's regions fill up and it asks the CM for more: the
/// varied shapes, with one spare joining in half the seeds.
fn full_regions_config(seed: u64) -> SimConfig {
    SimConfig {
        regions_per_machine: 2,
        joins: (seed % 2) as u16,
        ..varied_config(seed)
    }
}

/// Power losses: one or two, a third of the seeds with a machine crashed (and recovered) before,
/// and a third with a disk that dies with the power (the cluster restarts without it).
fn power_config(seed: u64) -> SimConfig {
    SimConfig {
        crashes: seed.is_multiple_of(3) as u16,
        power_losses: 1 + (seed % 2) as u16,
        disk_losses: (seed / 2).is_multiple_of(3),
        ..config(seed)
    }
}

/// A shape drawn from the seed: 4 to 7 machines, 1 to 3 threads, 2 or 3 replicas, 3 to 20
/// keys, 2,000 to 5,000 steps; crashes (never more than a minority, nor all replicas), a pause
/// in a third of the seeds that leave room for one, power losses in a quarter, a whole-cluster
/// stall in a third, lossy datagrams, memory-reachable pauses and RPC replication in half,
/// coordination-store timeouts in a third.
fn varied_config(seed: u64) -> SimConfig {
    let mut r = farm_core::rng::Rng::new(seed ^ 0x5eed_5a9e);
    let machines = 4 + r.below(4) as u16;
    let replicas = 2 + r.below(2) as u16;
    let power_losses = if r.below(4) == 0 {
        1 + r.below(2) as u16
    } else {
        0
    };
    let crashes = (r.below(replicas as u64) as u16).min((machines - 1) / 2);
    let pauses = (crashes + 1 < replicas && crashes < (machines - 1) / 2 && r.below(3) == 0) as u16;
    SimConfig {
        seed,
        machines,
        regions_per_machine: 1,
        threads: 1 + r.below(3) as u16,
        replicas,
        keys: 3 + r.below(18),
        steps: 2000 + r.below(3001),
        crashes,
        pauses,
        lossy_datagrams: r.below(2) == 0,
        power_losses,
        stalls: (r.below(3) == 0) as u16,
        replication: if r.below(2) == 0 {
            Replication::Rpc
        } else {
            Replication::OneSided
        },
        cm_failover: false,
        paused_memory_reachable: r.below(2) == 0,
        store_timeouts: r.below(3) == 0,
        allocations: r.below(3) as u16,
        clients_per_worker: 1 + r.below(4) as u16,
        disk_losses: r.below(3) == 0,
        partitions: 0,
        minority_reads: false,
        joins: 0,
    }
}

/// A seed's configuration as it was when the seed was found, before the power took disks
/// (`disk_losses` changes what a seed runs).
fn as_found(config: SimConfig) -> SimConfig {
    SimConfig {
        disk_losses: false,
        ..config
    }
}

/// The seed `FARM_SIM_SEED` names for replay, if any.
fn replay_seed() -> Option<u64> {
    std::env::var("FARM_SIM_SEED")
        .ok()
        .map(|s| s.parse().expect("FARM_SIM_SEED is a number"))
}

/// A seed count or a first seed: `var` if set, else `default`.
fn seed_var(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .map(|s| s.parse().unwrap_or_else(|_| panic!("{var} is a number")))
        .unwrap_or(default)
}

/// Runs a campaign of `config`'s shapes: the seed `FARM_SIM_SEED` names alone, if any
/// (`None`: one seed's totals say nothing), else `n` seeds from `FARM_SIM_FIRST_SEED` (0 if
/// unset, so that the suite always runs the same seeds and a search can run fresh ones), `n`
/// from `var` if set or `default`, each checked and handed to `each`; returns `n`.
fn campaign(
    var: &str,
    default: u64,
    config: impl Fn(u64) -> SimConfig,
    mut each: impl FnMut(u64, &SimOutcome),
) -> Option<u64> {
    if let Some(seed) = replay_seed() {
        check(seed, config(seed));
        return None;
    }
    let seeds = seed_var(var, default);
    let first = seed_var("FARM_SIM_FIRST_SEED", 0);
    for seed in first..first + seeds {
        let out = check(seed, config(seed));
        each(seed, &out);
    }
    Some(seeds)
}

fn check(seed: u64, config: SimConfig) -> SimOutcome {
    // A power loss may bring a crashed machine back before anyone noticed it was gone.
    let crashes = if config.power_losses == 0 {
        config.crashes
    } else {
        0
    };
    let out = run_seed(config);
    assert!(
        out.anomalies.is_empty(),
        "seed {seed} (crashed {:?}): {:#?}",
        out.crashed,
        out.anomalies
    );
    assert!(
        crashes == 0 || out.configurations >= 1,
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
    let (mut unknown, mut unknown_committed, mut recovered) = (0, 0, 0);
    let (mut paused, mut evicted, mut stalls) = (0, 0, 0);
    let (mut posted, mut validations_posted, mut in_flight) = (0, 0, 0);
    let (mut executions, mut suspended) = (0, 0);
    let Some(seeds) = campaign("FARM_SIM_FAULT_SEEDS", 1000, config, |_, out| {
        in_flight = in_flight.max(out.commits_in_flight_max);
        executions = executions.max(out.executions_in_flight_max);
        suspended += out.executions_suspended;
        posted += out.stats.reads_posted;
        validations_posted += out.stats.validation_reads_posted;
        stalls += out.stalls;
        unknown += out.unknown.0;
        unknown_committed += out.unknown.1;
        recovered += out.stats.recovered_commits + out.stats.recovered_aborts;
        paused += out.paused;
        evicted += out.evicted;
    }) else {
        return;
    };
    println!(
        "{seeds} seeds: {recovered} transactions decided by recovery, {unknown} in flight at a \
         crashed or stopped coordinator ({unknown_committed} of them committed); {paused} \
         machines paused past their lease, {evicted} stopped when their lease told them they \
         were out; {stalls} whole-cluster stalls; {posted} object reads and \
         {validations_posted} validation reads posted, performed in an order the seed chose; \
         up to {in_flight} commits in flight on one worker; executions suspended {suspended} \
         times, up to {executions} open on one worker"
    );
    assert!(
        executions >= 3,
        "no worker ever had more than {executions} executions open at once"
    );
    assert!(
        in_flight >= 3,
        "no worker ever had more than {in_flight} commits in flight"
    );
    assert!(posted > 0, "no transaction read through a posted read");
    assert!(
        validations_posted > 0,
        "no validation read was posted and awaited"
    );
    assert!(recovered > 0, "no transaction ever went through recovery");
    assert!(unknown > 0, "no coordinator ever crashed mid-commit");
    assert!(
        evicted > 0,
        "no paused machine ever resumed and learnt it was out"
    );
}

#[test]
fn paused_machines_of_small_clusters_corrupt_nothing() {
    let (mut paused, mut evicted) = (0, 0);
    let Some(seeds) = campaign("FARM_SIM_FAULT_SEEDS", 300, pause_config, |_, out| {
        paused += out.paused;
        evicted += out.evicted;
    }) else {
        return;
    };
    assert_eq!(paused, seeds, "a seed paused no machine");
    assert!(
        evicted > 0,
        "no paused machine ever resumed and learnt it was out"
    );
}

#[test]
fn partitioned_minorities_serve_nothing_stale_and_leave() {
    let (mut partitions, mut cut_off, mut with_cm, mut evicted) = (0, 0, 0, 0);
    let Some(seeds) = campaign("FARM_SIM_FAULT_SEEDS", 300, partition_config, |_, out| {
        partitions += out.partitions.0;
        cut_off += out.partitions.1;
        with_cm += out.partitions.2;
        evicted += out.evicted;
    }) else {
        return;
    };
    println!(
        "{seeds} seeds: {partitions} partitions cut {cut_off} machines off ({with_cm} with the \
         CM); {evicted} machines stopped once they learnt they were out"
    );
    assert_eq!(partitions, seeds, "a seed cut no minority off");
    assert!(cut_off > partitions, "no minority of two machines");
    assert!(with_cm > 0, "no minority held the CM");
    assert!(evicted > 0, "no machine of a minority learnt it was out");
}

/// A minority that cannot reach the store learns nothing of its removal but from its leases, and
/// its machines serve reads of the lists they are primary of as long as those hold: none of
/// those reads may miss what the majority wrote after removing it (docs/ARCHITECTURE.md,
/// "Serving only under a lease"). The partitions campaign above did not reach that window: its
/// minority read the store and stopped early.
#[test]
fn a_minority_cut_off_from_the_store_serves_nothing_the_majority_overwrote() {
    let (mut reads, mut served, mut evicted) = (0, 0, 0);
    let Some(seeds) = campaign(
        "FARM_SIM_FAULT_SEEDS",
        300,
        minority_read_config,
        |_, out| {
            reads += out.minority_reads.0;
            served += out.minority_reads.1;
            evicted += out.evicted;
        },
    ) else {
        return;
    };
    println!(
        "{seeds} seeds: {reads} reads on minority machines, {served} served; {evicted} \
         machines stopped once they learnt they were out"
    );
    assert!(served > 0, "no minority machine served a read");
    assert!(
        reads > served,
        "every minority read was served: no lease ran out"
    );
    assert!(evicted > 0, "no machine of a minority learnt it was out");
}

/// Every fault kind over shapes drawn from the seed ([`varied_config`]): the campaigns above
/// fix a shape each, and the liveness failures came from shapes they did not run.
#[test]
fn varied_shapes_lose_nothing_and_stay_strictly_serializable() {
    campaign("FARM_SIM_FAULT_SEEDS", 300, varied_config, |_, _| {});
}

/// A coordinator whose commit a new configuration made recovering asks for the votes it lacks
/// after a 400th of a lease (one tick here), possibly before it drained that configuration.
/// The primary answered from the round of the configuration it had drained, in which the
/// transaction was not recovering and whose logs it had processed normally: "unknown", and the
/// coordinator aborted a transaction whose COMMIT-PRIMARY the primary had applied (a read of a
/// value whose transaction aborted, G1a). Seed 303: the round was of the transaction's own
/// configuration; seed 327: of a later one that changed none of its regions. Votes belong to
/// a round in which the transaction is recovering.
#[test]
fn a_vote_requested_before_the_coordinator_drained_does_not_abort_a_commit() {
    for seed in [303, 327] {
        check(seed, config(seed));
    }
}

/// With lossy datagrams a false suspicion may remove a live machine at any time: in seed 35335
/// of the varied shapes the CM was removed while the final read ran on its worker, which
/// ended with a conflict, and the run failed ("setup commit: Conflict(Validate)"). The final
/// checks go again on another running member.
#[test]
fn a_final_check_whose_machine_is_removed_goes_again_elsewhere() {
    check(35335, as_found(varied_config(35335)));
}

/// Machine 3 asked for regions, was removed (paused past its lease) before the CM committed
/// them, and still got the answer: seed 3918 of the varied shapes stopped at "regions [5, 6]
/// allocated but not in the view of configuration 1". The CM answers members only; a machine
/// removed meanwhile learns from the store that it was removed.
#[test]
fn a_machine_removed_while_it_waits_for_regions_is_not_answered() {
    check(3918, as_found(varied_config(3918)));
}

/// A write that fails between two live machines (here: to a machine paused, cut off, for less
/// than its removal takes) leaves a hole in the target's ring, which it waits at forever: seed
/// 1616's clients never finished and seed 2320 never quiesced
/// (machine 1 polled machine 3's queue to 136 while machine 3 had written to 262,240). The
/// link stays broken while the target is a member, and the writer reports it: the CM removes
/// the member, whose rings start afresh if it rejoins (issue 16, cases 1 and 4).
#[test]
fn a_link_that_broke_to_a_live_member_gets_it_removed() {
    for seed in [1616, 2320] {
        let config = SimConfig {
            paused_memory_reachable: false,
            ..config(seed)
        };
        check(seed, config);
    }
}

/// Machine 0, the CM of three, paused and was removed; machine 1 became the CM of a
/// configuration of two and gave machine 2 one lease from its own install to ask for a lease.
/// Machine 2 installed 41 ticks later (NEW-CONFIG delayed, the control planes not scheduled)
/// and its first request was lost: machine 1 suspected it, and machine 2, refused from then
/// on, suspected machine 1. With two members neither can be removed (one machine is no
/// majority), and neither suspicion was ever withdrawn: each refused the other's leases and
/// attempted every takeover period for good, and seed 23870 of the paused machines never
/// quiesced ("CM busy true"). In a configuration of two a removal that fails for want of a
/// majority now forgives the suspect (`Effect::ForgiveMember`, `Effect::ForgiveCm`).
#[test]
fn a_configuration_of_two_forgives_a_suspicion_it_cannot_act_on() {
    check(23870, pause_config(23870));
}

/// Machine 1 paused with its memory out of reach: machine 2's write to it failed and the link
/// stayed broken (it stays so while machine 1 is a member). Machine 1 came back, took over from
/// machine 0 and became the CM of {1, 2, 3}, holding the one complete replica of region 0 (machine
/// 0 held the other). Machine 2 could not write to its CM, suspected it, and could not remove it
/// (removing it would lose region 0), forgave it and suspected it again, every takeover period
/// for good, while recovery waited for what machine 2 could not send machine 1: seed 40455 of
/// the paused machines never finished ("clients did not finish"). One of two members whose link
/// broke must leave, and when the unreachable one cannot (the CM, or the last complete replica of
/// a region), the one that cannot reach it goes (`ControlMsg::Unreachable`).
#[test]
fn a_member_that_cannot_reach_a_machine_that_cannot_be_removed_is_removed_instead() {
    check(40455, pause_config(40455));
}

/// A probe reads the probed member's memory, so it showed only that the prober reaches the
/// member, not that the member can write to the prober. Seed 110052 of the varied shapes (6
/// machines, 2 replicas, one pause, no crash): machine 1 paused with its memory out of reach,
/// and the links from machines 0, 3, 4 and 5 into it broke (they stay down while it is a
/// member). The CM, machine 0, suspected it, but its removals failed on simulated store
/// timeouts; machine 1 resumed, suspected the CM by lease, probed the others successfully and
/// removed machine 0, which held the other complete replica of regions 0 and 6. Then machines
/// 3, 4 and 5 could not reach their CM nor remove it (regions 0 and 6 would lose every complete
/// replica), and the CM could not remove them (three of five are no majority): "clients did
/// not finish". Each member now publishes the members it cannot write to beside its complete
/// replicas (`MachineState::publish_unreachable`), and a machine taking over stands down when a
/// probed member says it cannot write to it: machine 1 does not take over, and machine 0's
/// next removal of machine 1 succeeds.
#[test]
fn a_machine_its_peers_cannot_write_to_does_not_take_over_as_cm() {
    check(110052, varied_config(110052));
}

/// A lease manager credits the time it was not scheduled to the leases it granted
/// (`CmLeases::stalled`), measured from its previous round. Seed 130489 of the varied shapes
/// (7 machines, 3 replicas, two crashes, two power losses, one stall): the whole cluster
/// stalled for 150 ticks right after the second power loss's restart, before the new lease
/// managers had run a round, so there was no previous round to measure from and nothing was
/// credited. Every lease in the cluster ran out at once: the CM, machine 0, suspected all four
/// members (and could not remove them: one of five is no majority), they suspected it (and could
/// not remove it: it held region 0's last complete replica), and it refused their requests for
/// good: "the cluster did not quiesce (CM busy true)".
#[test]
fn a_stall_before_the_first_lease_round_suspects_nobody() {
    check(130489, varied_config(130489));
}

/// Seed 242268 of the paused machines (three machines, two replicas, one thread, two clients
/// per worker, lossy datagrams, a paused machine's memory reachable): machine 2 paused at
/// t1089; machine 1 coordinated a transaction appending to key 4 (region 1: primary 1, backup
/// 2) and key 0 (region 0: primary 0, backup 1) and was told it committed at t1136, between
/// the CM storing the configuration without machine 2 (t1134) and committing it (t1141). Its
/// append to key 4 is there at the end, its append to key 0 never appears: an acknowledged
/// write lost on a region whose replicas did not change (a real-time cycle through later
/// reads of key 0). The COMMIT-PRIMARY to machine 0 landed after machine 0 drained the new
/// configuration, which rejected it; its hardware ack let the coordinator truncate the
/// transaction, so recovery got a LOCK vote and a truncated one and aborted it. A committed
/// transaction that a new view makes recovering now ignores those acks and holds truncation
/// back until recovery decided it (`Worker::unacked_now_recovering`).
#[test]
fn an_acknowledged_write_to_an_unchanged_region_survives_a_paused_machine_s_removal() {
    check(242268, pause_config(242268));
}

/// Seed 252471 of the partitions (found 2026-11-29): machines 0 and 4 crashed, the
/// configuration of 1, 2 and 3 (CM 2) had a broken link from 1 into 3, and neither end could
/// be removed (each held a region's last complete replica: `CmState::irremovable`), so the
/// clients waiting on that link never finished. The link's writes now stall instead of
/// failing, and land in order once the partition heals (the `mem` fabric's repair in place).
#[test]
fn a_broken_link_between_two_irremovable_members() {
    check(252471, partition_config(252471));
}

/// Seed 280943 of the partitions: seven machines, three replicas, machine 1 alone cut off from
/// t1227 to t1377. The CM, machine 0, could not store a configuration removing 1 (store
/// timeouts); after the heal, machine 1 took over (t1384) and stored configuration 2 of 1, 4, 5
/// and 6, removing 0 and also 2 and 3, whose writes into it had stalled across the cut: a
/// probed member that said it could not write to the prober counted as a failed probe. The
/// campaign's one crash then fell on machine 1 (t2513), the last complete replica of regions 0
/// and 1, and every later attempt failed ("lost every complete replica"). A machine taking over
/// now stands down when a member cannot write to it (`Reconfig::on_probe`), and the CM's next
/// attempt removes machine 1.
#[test]
fn a_machine_taking_over_stands_down_when_a_member_cannot_write_to_it() {
    check(280943, partition_config(280943));
}

/// Seed 54 of the partitions: machines 0 (the CM) and 3 were cut off from 1, 2 and 4 for two
/// leases. Machine 1 took over once the partition healed and removed machine 0; but writes
/// across the cut had broken two links that stay down while both ends are members: machine
/// 3's into machine 2, and machine 1's into machine 3. For each, the CM removed the machine
/// that could not be written to, 2 and 3 together, which left 2 of 4 members: no majority,
/// every attempt failed, and the clients waiting on those links waited for good ("clients did
/// not finish"). Machine 3 alone is an end of both, and now goes alone (`CmState::cut_off`).
#[test]
fn the_fewest_machines_that_end_every_broken_link_are_removed() {
    check(54, partition_config(54));
}

/// Seed 121 of the partitions: the CM, machine 0 of six, suspected machine 3 by lease just as
/// machines 4 and 5 were cut off; its probes of 4 and 5 failed, three of six is no majority,
/// and it kept all three as suspects. The partition healed, but a suspect is not probed, so
/// every later attempt to remove 3, 4 and 5 found no majority either, while the CM refused
/// machine 3's leases and machine 3, alive, suspected it in turn: "the cluster did not
/// quiesce". Links into 4 and 5 had broken, and removing those two alone would leave four.
/// A CM that finds no majority now forgives its suspects, and the next attempt removes 4 and 5.
#[test]
fn a_cm_forgives_what_it_suspected_when_it_found_no_majority() {
    check(121, partition_config(121));
}

/// Seed 160767 of the partitions: configuration 4 had four members and two broken links with
/// no end in common (the CM, machine 2, could not write to machine 3; machine 1 could not write
/// to machine 4). A link stays broken while both its ends are members, and removing an end of
/// each at once left two of four, no majority: "clients did not finish". The CM now removes
/// them one configuration at a time, each leaving a majority of the one before.
#[test]
fn two_broken_links_with_no_common_end_in_a_configuration_of_four() {
    check(160767, partition_config(160767));
}

/// Seed 726 of the partitions: machine 2 could not write to machines 3 and 4, and the CM chose
/// machine 2, the end of both links, to remove. Its removal failed (it held the last complete
/// replica of region 2), but only a machine that could not be written to was then taken as
/// irremovable, so machine 2 stayed a suspect and every attempt failed the same way: "the
/// cluster did not quiesce". Either end of a broken link is now taken as irremovable.
#[test]
fn an_end_of_a_broken_link_that_cannot_be_removed_is_not_tried_again() {
    check(726, partition_config(726));
}

/// Lock bits are NVRAM, the locks' owners are not: after a whole-cluster restart, a lock bit
/// the previous life left (here machine 1's recovery lock on an object of region 1, taken for
/// a transaction whose recovery the power loss interrupted) belonged to nobody, and machine
/// 0's copy of region 1 retried the locked object forever: seed 699 never quiesced.
#[test]
fn a_restart_leaves_no_lock_from_the_previous_life() {
    check(699, as_found(varied_config(699)));
}

/// A restart whose newest view names a primary that was still copying its region promotes a
/// complete backup, stamping the region's primary change with the restart configuration's id:
/// a change after the view's own configuration, which the view codec refuses. Machine 0's
/// announcement of the plan never decoded at the other machines, and seed 4553 of the varied
/// shapes (a power loss soon after an allocation committed) stopped at "the restart did not
/// finish: machines wait for [[1, 2, 3, 4, 5], [0], [0], [0], [0], [0]]".
#[test]
fn a_restart_that_promotes_a_complete_backup_finishes() {
    check(4553, as_found(varied_config(4553)));
}

/// Seed 470301 of the varied shapes (found 2026-11-29): machine 1's transaction 20, which
/// wrote regions 1 and 2, committed and was truncated by explicit id at machines 2 and 3
/// while its older transaction 18 still waited for COMMIT-PRIMARY acks (the truncation bound
/// stayed at 18); machine 0, a backup of region 2, still held its COMMIT-BACKUP. Machine 1
/// crashed, the power went in the middle of the recovery, and after the restart machine 2,
/// primary of region 1 since the crash, had no record of it and voted unknown (the ids of a
/// previous life are not kept): recovery aborted a committed transaction, and machine 0's
/// replica of region 2 differed from its primary's. Nothing is truncated by id above the
/// bound any more.
#[test]
fn a_transaction_truncated_past_an_unacked_commit_survives_a_power_loss() {
    check(470301, varied_config(470301));
}

/// Two commits in flight on one worker: the newer committed, and was truncated by explicit id
/// at some replicas while the older was still open (the truncation bound stays below it). The
/// power went; after the restart a replica promoted since had no record of the newer
/// transaction and, keeping only the bound across a restart, voted unknown, while another
/// replica still held its COMMIT-BACKUP: recovery aborted a committed transaction, and
/// replicas differed ("backup m1 differs from primary m4"). Seed 1719 of the power losses and
/// 2536 of the allocations (two clients per worker). Now no transaction is truncated by id
/// while an older commit of its thread is open, and a commit takes its id only once it has
/// its log space (so one waiting for space holds nothing back).
#[test]
fn a_transaction_truncated_by_id_past_an_open_commit_survives_a_power_loss() {
    check(1719, as_found(power_config(1719)));
    check(2536, allocation_config(2536));
}

/// With several commits per worker, seeds 261 and 1134 of the varied shapes ran a region out
/// of its eight 1 MB blocks with most of its slots free: "allocation failed: region 1 is
/// full". Each thread has slabs of its own; after every change of primary or restart each
/// thread of the primary carved a block, because the free slots allocator recovery found
/// (§5.5) went to the scanning thread alone, or all to the first thread that made slabs. They
/// are now shared: a thread takes a batch of the slots the machine holds free before it carves
/// a block.
#[test]
fn a_region_keeps_its_blocks_while_slots_are_free() {
    check(261, as_found(varied_config(261)));
    check(1134, as_found(varied_config(1134)));
}

/// The power went while machine 0 committed a region allocation that only machine 0, the
/// region's primary, had installed. The restart kept the region (a replica installed it) with
/// its two backups to be copied from machine 0; machine 0 crashed before the copies were done,
/// and every reconfiguration failed with "regions [6] lost every complete replica": seed 33827
/// of the varied shapes never finished its clients. The view that allocated the region never
/// committed, so nothing was ever written in it: the restart leaves it out.
#[test]
fn a_restart_leaves_out_a_region_whose_allocation_never_committed() {
    check(33827, as_found(varied_config(33827)));
}

/// A disk died with the power and the cluster restarted without its machine. The restart
/// view (the newest configuration without that machine) was installed under the newest
/// configuration's id over the view each member had really installed, and records that
/// landed after a member's last drain are judged by the view under that id: a backup took a
/// transaction the lost machine coordinated for one of a configuration it was not in and
/// rejected its COMMIT-BACKUP, which its primary had applied ("backup m2 differs from primary
/// m1"). Seed 301314 of the power losses.
#[test]
fn a_restart_without_a_machine_judges_late_records_by_the_view_each_member_installed() {
    check(301314, power_config(301314));
}

/// After a restart (configuration 2), machine 4 was removed while still running (the seed
/// loses lease datagrams; it has no crash or pause), and two compare-and-sets that timed out
/// after taking effect used up ids 3 and 4: the next configuration was 5, without machine 4,
/// which kept running on view 2 until its lease told it it was out. Machine 1 decided a
/// transaction on a vote of configuration 2 that the first poll of its round of 5 processed,
/// so the decision was to go to the replicas of configuration 2, machine 4 among them; it
/// went out once 5 was drained, under 5's id, and machine 4 refused it as naming a
/// configuration more than one ahead of its view ("recovery messages refused as too far
/// ahead"). (TRUNCATE-RECOVERY, sent to every replica the decision reached, could go the same
/// way.) A machine outside a configuration never installs it, so nothing sent to it under
/// that id is ever read: a coordinator sends a configuration's decisions and truncations to
/// its members only. Seed 22942 of the power losses.
#[test]
fn a_recovery_decision_goes_to_no_machine_that_left_its_configuration() {
    check(22942, as_found(power_config(22942)));
}

/// Losing the CM and its first backup CM at once still reconfigures: the next in line takes
/// over at its turn, and the survivors recover and re-replicate with nothing lost.
#[test]
fn the_cm_and_its_first_backup_crashing_together_still_reconfigure() {
    campaign(
        "FARM_SIM_FAULT_SEEDS",
        300,
        cm_failover_config,
        |seed, out| {
            let (cm, backup) = out.cm_failover.unwrap_or_else(|| {
                panic!("seed {seed}: the CM and its backup did not crash together")
            });
            assert!(
                out.crashed.contains(&cm) && out.crashed.contains(&backup),
                "seed {seed}: crashed {:?}",
                out.crashed
            );
            assert!(out.configurations >= 1, "seed {seed}: nobody reconfigured");
        },
    );
}

/// Crashes in clusters of 20 to 90 machines with over a thousand regions: suspected, removed,
/// recovered and re-replicated as in small ones. A few seeds here (each builds a large
/// cluster); `FARM_SIM_SCALE_SEEDS` runs more.
#[test]
fn large_clusters_reconfigure_and_recover() {
    campaign("FARM_SIM_SCALE_SEEDS", 3, scale_config, |seed, out| {
        let config = scale_config(seed);
        let regions = config.machines as u32 * config.regions_per_machine;
        assert!(regions >= 1024, "seed {seed}: {regions} regions");
        assert!(out.configurations >= 1, "seed {seed}: nobody reconfigured");
    });
}

/// A cluster of 4,096 regions (16 machines, each primary of 256): its views travel as many
/// datagrams each, and after a machine crashes a new configuration commits, the regions it
/// held get new replicas and every backup ends equal to its primary.
#[test]
fn a_cluster_of_4096_regions_reconfigures_after_a_crash() {
    let shape = |seed| SimConfig {
        machines: 16,
        regions_per_machine: 256,
        crashes: 1,
        ..scale_config(seed)
    };
    let seed = replay_seed().unwrap_or(1);
    let config = shape(seed);
    assert_eq!(config.machines as u32 * config.regions_per_machine, 4096);
    let out = check(seed, config);
    assert_eq!(out.crashed.len(), 1, "seed {seed}: no machine crashed");
    assert!(out.configurations >= 1, "seed {seed}: nobody reconfigured");
}

/// Members ask for regions while machines crash, pause and lose power: each allocation is
/// placed, prepared at its replicas and committed as a configuration with the same members,
/// or refused and its prepared regions released; histories stay strictly serializable and
/// replicas equal, new regions included.
#[test]
fn regions_are_allocated_amid_failures() {
    let (mut allocated, mut refused) = (0, 0);
    let Some(seeds) = campaign("FARM_SIM_FAULT_SEEDS", 200, allocation_config, |_, out| {
        allocated += out.allocated.0;
        refused += out.allocated.1;
    }) else {
        return;
    };
    println!("{seeds} seeds: {allocated} regions allocated, {refused} requests refused");
    assert!(
        allocated >= seeds,
        "{allocated} regions allocated in {seeds} seeds of three requests"
    );
}

/// Machines whose regions fill up get more from the CM (§3) while machines crash, pause, lose
/// power and join: every allocation succeeds unless no region could be placed (fewer members
/// than replicas), every request for a region is answered, and the new regions' objects are
/// checked as any.
#[test]
fn machines_whose_regions_fill_up_get_more() {
    let (mut grown, mut allocated) = (0, 0);
    let Some(seeds) = campaign(
        "FARM_SIM_FAULT_SEEDS",
        100,
        full_regions_config,
        |_, out| {
            grown += out.regions_grown;
            allocated += out.stats.allocs + out.stats.allocs_remote;
        },
    ) else {
        return;
    };
    println!("{seeds} seeds: {allocated} objects allocated, {grown} regions grown");
    assert!(
        grown >= seeds,
        "{grown} regions grown in {seeds} seeds with regions of one block"
    );
}

/// A campaign whose spares join ([`SimConfig::joins`]): every spare that asked and did not
/// fail before joining joined, in each seed, and at least one spare per seed asked overall;
/// `each` sees every outcome too. Returns the seeds, the spares that asked and those that
/// joined.
fn join_campaign(
    default: u64,
    config: impl Fn(u64) -> SimConfig,
    mut each: impl FnMut(&SimOutcome),
) -> Option<(u64, u64, u64)> {
    let (mut asked, mut joined) = (0, 0);
    let seeds = campaign("FARM_SIM_FAULT_SEEDS", default, config, |seed, out| {
        assert_eq!(
            out.joins.0, out.joins.1,
            "seed {seed}: a spare never joined"
        );
        asked += out.joins.0;
        joined += out.joins.1;
        each(out);
    })?;
    assert!(
        asked >= seeds,
        "{asked} spares asked to join in {seeds} seeds"
    );
    Some((seeds, asked, joined))
}

/// Spare machines ask to join (§5.2) while machines crash and pause, datagrams get lost, the
/// coordination store times out (a compare-and-set before or after it took effect) and
/// members allocate regions: each is added, runs clients, and every one that runs is a member
/// when the run ends (a join whose compare-and-set answer was lost once left the stored
/// configuration, with the joiner, installed nowhere); histories stay strictly serializable
/// and replicas equal.
#[test]
fn spares_join_amid_failures_and_store_timeouts() {
    let mut members = 0;
    let Some((seeds, asked, joined)) = join_campaign(200, join_config, |out| {
        members += out.joins.2;
    }) else {
        return;
    };
    println!(
        "{seeds} seeds: {asked} spares asked to join, {joined} joined, {members} members at the \
         end (the others crashed or paused after)"
    );
}

/// Spares join clusters of the varied shapes: as the joins campaign above.
#[test]
fn spares_join_clusters_of_varied_shapes() {
    let Some((seeds, asked, joined)) = join_campaign(100, varied_join_config, |_| {}) else {
        return;
    };
    println!("{seeds} seeds: {asked} spares asked to join, {joined} joined");
}

/// Spares join amid power losses and partitions: as the joins campaign above. A spare that had
/// not joined when the power went starts again as a spare and asks again if it had asked.
#[test]
fn spares_join_amid_power_losses_and_partitions() {
    let (mut restarts, mut partitions) = (0, 0);
    let (mut restarted_members, mut restarted_spares) = (0, 0);
    let Some((seeds, asked, joined)) = join_campaign(100, join_power_partition_config, |out| {
        restarts += out.restarts;
        partitions += out.partitions.0;
        restarted_members += out.spares_restarted.0;
        restarted_spares += out.spares_restarted.1;
    }) else {
        return;
    };
    println!(
        "{seeds} seeds: {asked} spares asked to join, {joined} joined; {restarts} restarts \
         from NVRAM, which brought spares back {restarted_members} times as members and \
         {restarted_spares} as spares; {partitions} partitions"
    );
    assert!(
        restarted_members > 0 && restarted_spares > 0 && partitions > 0,
        "{restarted_members} and {restarted_spares} spares restarted, {partitions} partitions \
         in {seeds} seeds"
    );
}

/// Seed 1007 of the joins campaign (found 2026-11-29): machines 2 and then 0, the CM, crash
/// (configurations 3 and 4), then spares 6 and 5 join (configurations 5 and 6). Machine 1
/// coordinated the recovery of transaction <1,2,1,2> (its coordinator, machine 2, crashed)
/// from configuration 4; in configuration 6 consistent hashing gave it to machine 6, which
/// decided Commit, and machine 1, the primary of region 0, applied it and forgot the
/// transaction. Machine 1's own round then asked for votes again, and its region 0, without
/// records, voted "unknown": it decided Abort (the assertion in `Worker::on_decision`). A
/// replica that forgot a transaction now votes its decision.
#[test]
fn a_transaction_recovered_again_after_joins_is_decided_as_before() {
    check(1007, join_config(1007));
}

#[test]
fn power_losses_lose_nothing_and_the_cluster_restarts_from_nvram() {
    let (mut unknown, mut unknown_committed, mut recovered, mut restarts) = (0, 0, 0, 0);
    let (mut mid_reconfiguration, mut mid_txn_recovery, mut mid_data_recovery) = (0, 0, 0);
    let (mut late_rejected, mut cut, mut cut_after_reopening) = (0, 0, 0);
    let (mut disks_lost, mut machine_0_lost) = (0, 0);
    let Some(seeds) = campaign("FARM_SIM_FAULT_SEEDS", 500, power_config, |_, out| {
        disks_lost += out.disks_lost.0;
        machine_0_lost += out.disks_lost.1;
        cut += out.restarts_cut.0;
        cut_after_reopening += out.restarts_cut.1;
        unknown += out.unknown.0;
        unknown_committed += out.unknown.1;
        recovered += out.stats.recovered_commits + out.stats.recovered_aborts;
        restarts += out.restarts;
        mid_reconfiguration += out.restarts_mid.0;
        mid_txn_recovery += out.restarts_mid.1;
        mid_data_recovery += out.restarts_mid.2;
        late_rejected += out.stats.restart_late_rejected;
    }) else {
        return;
    };
    println!(
        "{seeds} seeds: {restarts} restarts from NVRAM ({mid_reconfiguration} in the middle of a \
         reconfiguration, {mid_txn_recovery} of transaction recovery, {mid_data_recovery} of \
         data or allocator recovery), {recovered} transactions decided by recovery, {unknown} \
         in flight at a power loss or crash ({unknown_committed} committed); {late_rejected} \
         records that landed after a drain rejected again at a restart; {cut} restarts cut short \
         by the power ({cut_after_reopening} after a machine reopened its NVRAM); {disks_lost} \
         restarts without a machine whose NVRAM the power took ({machine_0_lost} without machine \
         0)"
    );
    assert!(disks_lost > 0, "no restart went on without a machine");
    assert!(machine_0_lost > 0, "no restart went on without machine 0");
    assert!(
        cut_after_reopening > 0,
        "the power never went during a restart after a machine reopened its NVRAM"
    );
    assert!(
        mid_reconfiguration > 0 && mid_txn_recovery > 0 && mid_data_recovery > 0,
        "no power loss in the middle of a reconfiguration, of transaction recovery, or of data \
         recovery"
    );
    assert!(
        restarts >= seeds,
        "fewer restarts ({restarts}) than seeds ({seeds})"
    );
    assert!(unknown > 0, "no commit was ever in flight at a power loss");
}

/// A stall of every machine at once (FaRM §5.1 leases; a single-process cluster under SIGSTOP,
/// or a VM stalling every thread) is no failure: every lease manager credits its own stall to
/// the leases it granted, so no machine is suspected, no configuration is committed, and the
/// history stays strictly serializable. Without the credit every stall longer than a lease
/// made each machine suspect its lease peers.
#[test]
fn whole_cluster_stalls_suspect_nobody() {
    let stall_config = |seed| SimConfig {
        crashes: 0,
        pauses: 0,
        lossy_datagrams: false,
        stalls: 2,
        ..config(seed)
    };
    campaign("FARM_SIM_FAULT_SEEDS", 200, stall_config, |seed, out| {
        assert_eq!(out.stalls, 2, "seed {seed}: the stalls did not happen");
        assert_eq!(
            (out.configurations, out.evicted),
            (0, 0),
            "seed {seed}: a stall of the whole cluster changed the configuration"
        );
    });
}
