//! A whole-cluster restart of machine processes from their NVRAM (FaRM §2, §5: committed
//! transactions survive the loss of power of every machine), the multi-process form of
//! `ClusterBuilder::restart`:
//!
//! 1. Every machine's process starts with `restart`. Each holds its machine's `alive` lock, so
//!    once all run, no process of the previous life does.
//! 2. Machine 0 decides: every other machine sends it what it left in NVRAM
//!    ([`ControlMsg::Persisted`]; on other hosts machine 0 could not read it), and decides as
//!    every deployment does ([`farm_txn::machine::plan_restart`]): the newest view any machine
//!    left, which refuses a region without a complete replica, under the next configuration
//!    id, compare-and-set in ZooKeeper at the version it read (a cluster that still
//!    reconfigures makes that fail). It announces it with [`ControlMsg::Restart`]; the others
//!    check it against the store.
//! 3. Each member reopens its NVRAM with that view (`MachineState::restore`): its readers
//!    resume every inbound ring at its head word, keeping the complete records after it.
//! 4. Senders continue each ring where its receiver found the tail, which only the receiver
//!    knows: members exchange [`ControlMsg::RingStarts`] before any worker writes.
//! 5. Each member commits the restart configuration; transaction recovery of what the logs
//!    hold starts at the workers' first poll (§5.3), as after any reconfiguration.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use farm_cm::control::{ControlMsg, Reassembly};
use farm_cm::{ConfigurationStore, CoordinationStore};
use farm_core::config::Configuration;
use farm_core::{ConfigId, MachineId};
use farm_fabric::process::ProcessFabric;
use farm_txn::machine::{Persisted, RestartError, RestartPlan};
use farm_txn::Worker;

use crate::node::{NodeConfig, NodeError};

/// How often machine 0 repeats its decision and members their ring starts, until answered.
const REPEAT: Duration = Duration::from_millis(2);

/// How often a machine repeats what it left in NVRAM, until machine 0 decides (a view is
/// larger than a decision: repeated less often).
const PERSISTED_REPEAT: Duration = Duration::from_millis(20);

/// Where this machine found each peer's rings to it, per peer: what it answers requests with.
pub(crate) type RingStarts = BTreeMap<MachineId, Vec<[u64; 4]>>;

/// Steps 1 and 2: waits for every machine's process, then decides (machine 0) or learns the
/// restart configuration, `mine` being what this machine left in NVRAM (the node read it
/// at start). Fails if this machine is not a member of it.
pub(crate) fn decide(
    config: &NodeConfig,
    fabric: &dyn ProcessFabric,
    store: &dyn CoordinationStore,
    mine: Option<Persisted>,
) -> Result<RestartPlan, NodeError> {
    let me = config.machine;
    let all: Vec<MachineId> = (0..config.machines).map(MachineId).collect();
    crate::node::wait_for_machines(&all, |m| fabric.is_up(m), config.start_timeout)?;
    let restart = if me.0 == 0 {
        lead(config, fabric, store, mine)?
    } else {
        follow(config, fabric, store, mine)?
    };
    if !restart.config.contains(me) {
        return Err(NodeError::Invalid(format!(
            "machine {me} is not a member of restart configuration {} (members {:?}): it was \
             removed before the cluster stopped, so its NVRAM is stale",
            restart.config.id.0, restart.config.members
        )));
    }
    Ok(restart)
}

/// Machine 0's part of step 2.
fn lead(
    config: &NodeConfig,
    fabric: &dyn ProcessFabric,
    store: &dyn CoordinationStore,
    mine: Option<Persisted>,
) -> Result<RestartPlan, NodeError> {
    let persisted = gather(config, fabric, mine)?;
    let plan = farm_txn::machine::plan_restart(store, &persisted, config.machines).map_err(
        |e| match e {
            RestartError::Store(e) => NodeError::Store(e),
            RestartError::Invalid(e) => NodeError::Invalid(e),
        },
    )?;
    tracing::info!(config = plan.config.id.0, from = plan.from.config.id.0,
        members = ?plan.config.members, "restart decided");
    let msg = ControlMsg::Restart {
        restart: plan.config.id,
        from: plan.from.clone(),
    }
    .datagrams(RESTART_MESSAGE_ID);
    for m in (1..config.machines).map(MachineId) {
        send_all(fabric, m, &msg);
    }
    Ok(plan)
}

/// What every machine left, by machine id: this one's (`mine`), the others' as they send it
/// ([`ControlMsg::Persisted`]).
fn gather(
    config: &NodeConfig,
    fabric: &dyn ProcessFabric,
    mine: Option<Persisted>,
) -> Result<Vec<Option<Persisted>>, NodeError> {
    let mut persisted: Vec<Option<Persisted>> = (0..config.machines).map(|_| None).collect();
    persisted[config.machine.0 as usize] = mine;
    let mut missing: BTreeSet<MachineId> = (0..config.machines)
        .map(MachineId)
        .filter(|m| *m != config.machine)
        .collect();
    let started = Instant::now();
    let mut buf = Vec::new();
    let mut pieces = Reassembly::new();
    while !missing.is_empty() {
        if started.elapsed() > config.start_timeout {
            return Err(NodeError::PeersMissing {
                missing: missing.into_iter().collect(),
                waited: config.start_timeout,
            });
        }
        while let Some(from) = fabric.recv_control(fabric.me(), 0, &mut buf) {
            if let Some(ControlMsg::Persisted { view, copying }) = pieces.accept(from, &buf) {
                if missing.remove(&from) {
                    persisted[from.0 as usize] = Some(Persisted { view, copying });
                }
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(persisted)
}

/// Every other machine's part of step 2: sends machine 0 what it left until machine 0's
/// decision arrives, and checks that against the store.
fn follow(
    config: &NodeConfig,
    fabric: &dyn ProcessFabric,
    store: &dyn CoordinationStore,
    mine: Option<Persisted>,
) -> Result<RestartPlan, NodeError> {
    let mine = mine.map(|p| {
        ControlMsg::Persisted {
            view: p.view,
            copying: p.copying,
        }
        .datagrams(PERSISTED_MESSAGE_ID)
    });
    let started = Instant::now();
    let mut last_sent: Option<Instant> = None;
    let mut buf = Vec::new();
    let mut pieces = Reassembly::new();
    let (id, from) = loop {
        if let Some(m) = mine
            .as_ref()
            .filter(|_| last_sent.is_none_or(|at| at.elapsed() >= PERSISTED_REPEAT))
        {
            last_sent = Some(Instant::now());
            send_all(fabric, MachineId(0), m);
        }
        if let Some(sender) = fabric.recv_control(fabric.me(), 0, &mut buf) {
            // Peers' ring starts may come first: dropped, they repeat them.
            if let (MachineId(0), Some(ControlMsg::Restart { restart, from })) =
                (sender, pieces.accept(sender, &buf))
            {
                break (restart, from);
            }
            continue;
        }
        if started.elapsed() > config.start_timeout {
            return Err(NodeError::Store(format!(
                "machine 0 announced no restart configuration within {:?}",
                config.start_timeout
            )));
        }
        std::thread::sleep(Duration::from_micros(200));
    };
    let restart = Configuration {
        id,
        ..from.config.clone()
    };
    let stored = store
        .read_config()
        .map_err(|e| NodeError::Store(format!("reading the stored configuration: {e}")))?
        .map(|(_, c)| c);
    if stored.as_ref() != Some(&restart) {
        return Err(NodeError::Store(format!(
            "ZooKeeper holds {:?}, not restart configuration {} (members {:?}) that machine 0 \
             announced",
            stored.map(|c| (c.id.0, c.members)),
            id.0,
            restart.members
        )));
    }
    Ok(RestartPlan {
        config: restart,
        from,
    })
}

/// Step 4: continues every outbound ring of `workers` where its receiver found it, and returns
/// where this machine found each peer's (for the peers' later requests).
pub(crate) fn resume_rings(
    fabric: &dyn ProcessFabric,
    workers: &mut [Worker],
    restart: &RestartPlan,
    timeout: Duration,
) -> Result<RingStarts, NodeError> {
    let me = fabric.me();
    let id = restart.config.id;
    let peers: Vec<MachineId> = restart
        .config
        .members
        .iter()
        .copied()
        .filter(|m| *m != me)
        .collect();
    let mine: RingStarts = peers
        .iter()
        .map(|p| {
            let starts = workers
                .iter()
                .map(|w| {
                    let [(lh, lt), (qh, qt)] = w.inbound_start(*p);
                    [lh, lt, qh, qt]
                })
                .collect();
            (*p, starts)
        })
        .collect();
    for w in workers.iter_mut() {
        let own = w.inbound_start(me);
        w.resume_outbound(me, own);
    }
    let decision = (me.0 == 0).then(|| {
        ControlMsg::Restart {
            restart: id,
            from: restart.from.clone(),
        }
        .datagrams(RESTART_MESSAGE_ID)
    });
    let started = Instant::now();
    let mut last_repeat: Option<Instant> = None;
    let mut got = BTreeSet::new();
    let mut buf = Vec::new();
    let mut pieces = Reassembly::new();
    while got.len() < peers.len() {
        if started.elapsed() > timeout {
            return Err(NodeError::PeersMissing {
                missing: peers.iter().copied().filter(|p| !got.contains(p)).collect(),
                waited: timeout,
            });
        }
        while let Some(from) = fabric.recv_control(fabric.me(), 0, &mut buf) {
            let Some(ControlMsg::RingStarts {
                config,
                reply,
                starts,
            }) = pieces.accept(from, &buf)
            else {
                continue;
            };
            let Some(answer) = mine.get(&from).filter(|_| config == id) else {
                continue;
            };
            if starts.len() != workers.len() {
                return Err(NodeError::Invalid(format!(
                    "machine {from} runs {} workers and this machine {}: every machine of a \
                     cluster runs as many",
                    starts.len(),
                    workers.len()
                )));
            }
            if !reply {
                send_starts(fabric, fabric.me(), from, id, true, answer);
            }
            if got.insert(from) {
                for (w, s) in workers.iter_mut().zip(&starts) {
                    w.resume_outbound(from, [(s[0], s[1]), (s[2], s[3])]);
                }
            }
        }
        if last_repeat.is_none_or(|at| at.elapsed() >= REPEAT) {
            last_repeat = Some(Instant::now());
            for p in peers.iter().filter(|p| !got.contains(*p)) {
                if let Some(d) = &decision {
                    send_all(fabric, *p, d);
                }
                send_starts(fabric, fabric.me(), *p, id, false, &mine[p]);
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(mine)
}

/// Message ids of the restart's messages, which may travel in pieces (they carry a view),
/// apart from those of the control plane, which count up from zero. A repeat reuses its id: a
/// piece lost once is made up by the next repeat.
const RESTART_MESSAGE_ID: u64 = 1 << 63;
const PERSISTED_MESSAGE_ID: u64 = (1 << 63) | 1;

/// Sends every datagram of a message to `to`.
fn send_all(fabric: &dyn ProcessFabric, to: MachineId, datagrams: &[Vec<u8>]) {
    for d in datagrams {
        fabric.send_datagram(fabric.me(), to, d, 0);
    }
}

/// Sends where this machine found `to`'s rings to it.
pub(crate) fn send_starts(
    fabric: &dyn farm_core::fabric::Fabric,
    me: MachineId,
    to: MachineId,
    config: ConfigId,
    reply: bool,
    starts: &[[u64; 4]],
) {
    let msg = ControlMsg::RingStarts {
        config,
        reply,
        starts: starts.to_vec(),
    };
    fabric.send_datagram(me, to, &msg.encode(), 0);
}
