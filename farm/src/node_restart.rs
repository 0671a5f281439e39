//! A whole-cluster restart of machine processes from their NVRAM (FaRM §2, §5: committed
//! transactions survive the loss of power of every machine), the multi-process form of
//! `ClusterBuilder::restart`. Every machine's process starts with `restart`; each holds its
//! machine's `alive` lock, so once all run, no process of the previous life does. Then each
//! runs its part of the restart exchange (`farm_cm::restart`: machine 0, or the lowest machine
//! that came back when one is left out, decides from what every machine left and stores the
//! decision in ZooKeeper, members reopen their NVRAM and tell each
//! other where their rings resume) through `farm_txn::restart::MachineRestart`, as the
//! in-process cluster and the simulator do, here over the process fabric's datagrams and with
//! this process's clock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use farm_cm::restart::{ExchangeParams, LeaveOut, Outcome, Persisted, RestartError};
use farm_cm::CoordinationStore;
use farm_core::fabric::Fabric;
use farm_core::MachineId;
use farm_fabric::process::ProcessFabric;
use farm_txn::machine::Reopen;
use farm_txn::restart::{Finished, MachineRestart, Restarted};
use farm_txn::Params;

use crate::node::{NodeConfig, NodeError};

/// How long a machine waits for an answer before it repeats an announcement or its ring starts
/// (what it left, a view, ten times as long).
pub(crate) const REPEAT: Duration = Duration::from_millis(2);

/// How often a waiting restart looks for datagrams.
const POLL: Duration = Duration::from_micros(200);

/// Restarts this node's machine, which left `persisted` in NVRAM (the node read it at start),
/// once every machine's process runs, or, with [`NodeConfig::restart_without_after`], without
/// those that did not come back within it. Fails if this machine is not a member of the
/// restart configuration, or peers stay silent past the start timeout.
pub(crate) fn restart(
    config: &NodeConfig,
    params: Params,
    fabric: &Arc<dyn ProcessFabric>,
    store: &dyn CoordinationStore,
    persisted: Persisted,
) -> Result<Restarted, NodeError> {
    let me = config.machine;
    let leave_out = config.restart_without_after.map(|after| LeaveOut {
        after: after.as_micros() as u64,
        replicas: config.replicas as usize,
        regions_max: farm_txn::control::REGIONS_PER_MACHINE_MAX,
    });
    // Without a leave-out every machine is needed; with one, each hears whoever comes back.
    let first: Vec<MachineId> = match leave_out {
        None => (0..config.machines).map(MachineId).collect(),
        Some(_) => Vec::new(),
    };
    crate::node::wait_for_machines(&first, |m| fabric.is_up(m), config.start_timeout)?;
    let exchange = ExchangeParams {
        machines: config.machines,
        repeat: REPEAT.as_micros() as u64,
        leave_out,
    };
    let members = persisted.view.config.members.clone();
    let mut restart = MachineRestart::new(
        me,
        exchange,
        persisted,
        fresh_life(),
        params,
        fabric.clone() as Arc<dyn Fabric>,
        store,
        Reopen::Dir(&config.dir),
    );
    let started = Instant::now();
    let mut said = None;
    while restart.outcome().is_none() {
        let why = restart.not_left_out().map(str::to_string);
        if started.elapsed() > config.start_timeout {
            let missing = restart.waiting_for();
            let waited = config.start_timeout;
            return Err(match why {
                Some(why) => NodeError::Invalid(format!(
                    "machines {missing:?} did not come back within {waited:?}, and the \
                     restart cannot go on without them: {why}"
                )),
                None => NodeError::PeersMissing { missing, waited },
            });
        }
        if why.is_some() && why != said {
            tracing::warn!(
                missing = ?restart.waiting_for(),
                why = why.as_deref().unwrap_or_default(),
                "not restarting without the machines that did not come back: waiting for them"
            );
            said = why;
        }
        restart.step(started.elapsed().as_micros() as u64);
        std::thread::sleep(POLL);
    }
    match restart.finish() {
        Finished::Restarted(r) => {
            if let Some(Outcome::Restarted(plan)) = r.exchange.outcome() {
                let out: Vec<MachineId> = (members.iter().copied())
                    .filter(|m| !plan.config.contains(*m))
                    .collect();
                if !out.is_empty() {
                    tracing::warn!(
                        machine = me.0,
                        left_out = ?out,
                        config = plan.config.id.0,
                        "restarted without machines that did not come back; their regions are \
                         copied again, and they join again as new incarnations"
                    );
                }
            }
            Ok(*r)
        }
        Finished::Removed(plan) => Err(NodeError::Invalid(format!(
            "machine {me} is not a member of restart configuration {} (members {:?}): it was \
             removed before the cluster stopped, so its NVRAM is stale",
            plan.config.id.0, plan.config.members
        ))),
        Finished::Failed(RestartError::Store(e)) => Err(NodeError::Store(e)),
        Finished::Failed(RestartError::Invalid(e)) => Err(NodeError::Invalid(e)),
        Finished::Failed(RestartError::Refused { machine, reason }) => {
            Err(NodeError::PeerRefused { machine, reason })
        }
    }
}

/// A machine's life for a restart exchange (`farm_cm::restart::RestartExchange::new`): a
/// number drawn at random at every start, so that a restart decision an earlier life stored
/// is told from this one's.
pub(crate) fn fresh_life() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}
