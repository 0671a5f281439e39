//! A cluster of three machines with one worker each over the `mem` fabric, for protocol tests
//! that drive workers by hand.

use std::sync::Arc;

use farm_core::config::{Configuration, RegionMap};
use farm_core::fabric::Fabric;
use farm_core::ring::RingLayout;
use farm_core::{MachineId, ThreadId};
use farm_fabric::mem::{MemFabric, MemFabricConfig};
use farm_txn::{MachineState, Params, Replication, Tx, TxError, Worker};

/// Workers of machines 0, 1, 2 (thread 0), regions striped with `backups` backups each.
#[allow(dead_code)] // Not every test binary uses both.
pub fn workers(region_bytes: usize, backups: u16) -> Vec<Worker> {
    workers_replicating(region_bytes, backups, Replication::OneSided)
}

/// [`workers`] whose backups acknowledge COMMIT-BACKUP as `replication` says.
pub fn workers_replicating(
    region_bytes: usize,
    backups: u16,
    replication: Replication,
) -> Vec<Worker> {
    workers_over(region_bytes, backups, replication).0
}

/// [`workers_replicating`], with their fabric (to partition it).
pub fn workers_over(
    region_bytes: usize,
    backups: u16,
    replication: Replication,
) -> (Vec<Worker>, Arc<MemFabric>) {
    let layout = RingLayout {
        machines_max: 3,
        threads: 1,
        log_bytes: 256 << 10,
        queue_bytes: 256 << 10,
    };
    let params = Params {
        layout,
        region_bytes,
        validate_rpc_threshold: 4,
        recovery_interval_ticks: 2,
        replication,
        lease_ticks: 100_000,
    };
    let fabric = Arc::new(MemFabric::new(MemFabricConfig {
        machines_max: 3,
        threads_max: 1,
        seed: 0,
        datagrams_queued_max: 8,
    }));
    let map = RegionMap::striped(3, 1, backups);
    let workers = (0..3)
        .map(|m| {
            let state = MachineState::new(
                MachineId(m),
                params,
                Configuration::initial(3),
                map.clone(),
                fabric.clone() as Arc<dyn Fabric>,
                None,
            )
            .unwrap();
            Worker::new(state, ThreadId(0))
        })
        .collect();
    (workers, fabric)
}

#[allow(dead_code)] // Not every test binary drives commits.
/// Polls the commit on worker `c` at most `polls` times, polling the `serve` workers between.
pub fn drive(
    workers: &mut [Worker],
    c: usize,
    serve: &[usize],
    now: &mut u64,
    polls: usize,
) -> Option<Result<(), TxError>> {
    for _ in 0..polls {
        *now += 1;
        if let Some(r) = poll_only(&mut workers[c], *now) {
            return Some(r);
        }
        for &s in serve {
            workers[s].poll(*now);
        }
    }
    None
}

#[allow(dead_code)]
/// Polls the one commit in flight on `w`.
pub fn poll_only(w: &mut Worker, now: u64) -> Option<Result<(), TxError>> {
    let commits = w.commits();
    assert_eq!(commits.len(), 1, "one commit in flight");
    w.poll_commit(commits[0], now)
}

#[allow(dead_code)]
/// Executes `f` on worker `c` and starts its commit.
pub fn start(workers: &mut [Worker], c: usize, f: impl FnOnce(&mut Tx<'_>) -> Result<(), TxError>) {
    let mut tx = Tx::new(&mut workers[c]);
    f(&mut tx).unwrap();
    let state = tx.into_state();
    workers[c].start_commit(state);
}

#[allow(dead_code)]
/// An object holding `value`, allocated by machine 0 in a region it is primary of.
pub fn object_at_0(workers: &mut [Worker], now: &mut u64, value: u64) -> farm_core::Addr {
    let mut a = None;
    start(workers, 0, |tx| {
        let x = tx.alloc(8, None)?;
        tx.write(x, &value.to_le_bytes())?;
        a = Some(x);
        Ok(())
    });
    drive(workers, 0, &[0, 1, 2], now, 1000)
        .expect("the allocation ends")
        .unwrap();
    let a = a.expect("allocated");
    assert_eq!(
        workers[0].view().map.get(a.region).unwrap().primary,
        MachineId(0)
    );
    a
}
