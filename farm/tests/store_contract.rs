//! One contract suite for every coordination store (FaRM §5.2, step 3): the embedded store and
//! ZooKeeper. The ZooKeeper half needs a server at `ZK_CONNECT` (`scripts/with-zookeeper.sh`
//! starts one); under `CI=true` a missing or unreachable server fails the tests, elsewhere they
//! are skipped with a printed reason.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use farm::zk::ZkStore;
use farm::{CasOutcome, CoordinationStore, EmbeddedStore, StoreError, StoreVersion};
use farm_cm::codec;
use farm_core::config::Configuration;
use farm_core::{ConfigId, MachineId, RegionId};

/// Opens `n` clients of one fresh store.
type Factory = dyn Fn(usize) -> Vec<Arc<dyn CoordinationStore>>;

fn embedded() -> Box<Factory> {
    Box::new(|n| {
        let store: Arc<dyn CoordinationStore> = Arc::new(EmbeddedStore::new());
        (0..n).map(|_| store.clone()).collect()
    })
}

fn zookeeper(test: &str) -> Option<Box<Factory>> {
    let (connect, root) = common::zookeeper(test)?;
    Some(Box::new(move |n| {
        (0..n)
            .map(|_| {
                let s = ZkStore::connect(&connect, &root, Duration::from_secs(10))
                    .unwrap_or_else(|e| panic!("ZooKeeper at {connect}: {e}"));
                Arc::new(s) as Arc<dyn CoordinationStore>
            })
            .collect()
    }))
}

fn stores(test: &str) -> Vec<(&'static str, Box<Factory>)> {
    let mut v: Vec<(&'static str, Box<Factory>)> = vec![("embedded", embedded())];
    if let Some(z) = zookeeper(test) {
        v.push(("zookeeper", z));
    }
    v
}

fn written(o: CasOutcome) -> StoreVersion {
    match o {
        CasOutcome::Written(v) => v,
        CasOutcome::Conflict => panic!("expected a write, got a conflict"),
    }
}

#[test]
fn compare_and_set_follows_the_version_read() {
    for (name, open) in stores("cas") {
        let s = open(1).pop().unwrap();
        assert_eq!(s.read().unwrap(), None, "{name}: a new store is empty");
        assert_eq!(
            s.compare_and_set(Some(StoreVersion(0)), b"x").unwrap(),
            CasOutcome::Conflict,
            "{name}"
        );
        let v0 = written(s.compare_and_set(None, b"first").unwrap());
        assert_eq!(s.read().unwrap(), Some((v0, b"first".to_vec())), "{name}");
        assert_eq!(
            s.compare_and_set(None, b"again").unwrap(),
            CasOutcome::Conflict,
            "{name}: create only once"
        );
        let v1 = written(s.compare_and_set(Some(v0), b"second").unwrap());
        assert!(v1 > v0, "{name}: versions grow");
        assert_eq!(
            s.compare_and_set(Some(v0), b"stale").unwrap(),
            CasOutcome::Conflict,
            "{name}: stale version"
        );
        assert_eq!(
            s.read().unwrap(),
            Some((v1, b"second".to_vec())),
            "{name}: a conflict changes nothing"
        );
    }
}

/// Two machines racing to move the system to the next configuration: exactly one wins.
#[test]
fn racing_clients_exactly_one_wins() {
    for (name, open) in stores("race") {
        for round in 0..5 {
            let clients = open(4);
            let base = written(
                clients[0]
                    .compare_and_set(clients[0].read().unwrap().map(|(v, _)| v), b"base")
                    .unwrap(),
            );
            let barrier = Arc::new(Barrier::new(clients.len()));
            let handles: Vec<_> = clients
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let (c, barrier) = (c.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        let (v, _) = c.read().unwrap().expect("base written");
                        assert_eq!(v, base);
                        barrier.wait();
                        (
                            i,
                            c.compare_and_set(Some(v), format!("winner {i}").as_bytes())
                                .unwrap(),
                        )
                    })
                })
                .collect();
            let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            let winners: Vec<usize> = results
                .iter()
                .filter(|(_, o)| matches!(o, CasOutcome::Written(_)))
                .map(|(i, _)| *i)
                .collect();
            assert_eq!(winners.len(), 1, "{name} round {round}: {results:?}");
            let (_, data) = clients[1].read().unwrap().unwrap();
            assert_eq!(
                data,
                format!("winner {}", winners[0]).into_bytes(),
                "{name}: every client sees the winner"
            );
        }
    }
}

#[test]
fn configurations_round_trip_through_every_store() {
    for (name, open) in stores("config") {
        let clients = open(2);
        let mut c = Configuration::initial(4);
        c.id = ConfigId(7);
        c.cm = MachineId(2);
        written(
            clients[0]
                .compare_and_set(None, &codec::encode(&c))
                .unwrap(),
        );
        let (_, bytes) = clients[1].read().unwrap().unwrap();
        assert_eq!(codec::decode(&bytes).unwrap(), c, "{name}");
    }
}

#[test]
fn an_unreachable_zookeeper_is_a_clear_error() {
    let e = ZkStore::connect("127.0.0.1:1", "/farm/x", Duration::from_millis(500)).unwrap_err();
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
    let e = ZkStore::connect("127.0.0.1:1", "farm/x", Duration::from_millis(500)).unwrap_err();
    assert!(e.to_string().contains("absolute znode path"), "{e}");
}

/// §5.2 step 3 for real: two machines reconfiguring the same configuration (machine 3
/// suspected) race their compare-and-sets from separate clients; exactly one moves the system
/// to the next configuration and the other learns it lost.
#[test]
fn racing_reconfigurations_have_exactly_one_winner_in_every_store() {
    use farm_cm::reconfig::{Effect, ProbeAnswer, Reconfig, ReconfigError, ReconfigParams};
    use farm_core::config::RegionMap;
    use std::collections::{BTreeMap, BTreeSet};

    let params = ReconfigParams {
        replicas: 3,
        regions_max: 16,
        probe_timeout_ticks: 10,
        lease_ticks: 20,
    };
    for (name, open) in stores("reconfig-race") {
        for round in 0..3 {
            let clients = open(2);
            let old = Configuration::initial(4);
            let v = match clients[0].read().unwrap() {
                None => written(
                    clients[0]
                        .compare_and_set(None, &codec::encode(&old))
                        .unwrap(),
                ),
                Some((v, _)) => written(
                    clients[0]
                        .compare_and_set(Some(v), &codec::encode(&old))
                        .unwrap(),
                ),
            };
            let barrier = Arc::new(Barrier::new(2));
            let handles: Vec<_> = [MachineId(0), MachineId(1)]
                .into_iter()
                .zip(clients)
                .map(|(me, client)| {
                    let (old, barrier) = (old.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        let map = RegionMap::striped(4, 1, 2);
                        let suspects = BTreeSet::from([MachineId(3)]);
                        let mut r = Reconfig::start(
                            me,
                            old,
                            v,
                            map,
                            BTreeMap::new(),
                            BTreeSet::new(),
                            suspects,
                            params,
                            0,
                            0,
                        );
                        for e in r.take_effects() {
                            if let Effect::Probe(m) = e {
                                // Every replica complete (the map has four regions).
                                r.on_probe(
                                    m,
                                    ProbeAnswer::Complete((0..4).map(RegionId).collect()),
                                    0,
                                );
                            }
                        }
                        let Effect::CompareAndSet { expected, data } = r.take_effects().remove(0)
                        else {
                            panic!("expected a compare-and-set")
                        };
                        barrier.wait();
                        r.on_store(client.compare_and_set(Some(expected), &data));
                        (me, r.outcome().cloned(), r.take_effects())
                    })
                })
                .collect();
            let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            let winners: Vec<_> = results.iter().filter(|(_, o, _)| o.is_none()).collect();
            let losers: Vec<_> = results
                .iter()
                .filter(|(_, o, _)| matches!(o, Some(Err(ReconfigError::LostRace(ConfigId(2))))))
                .collect();
            assert_eq!(
                (winners.len(), losers.len()),
                (1, 1),
                "{name} round {round}: {results:?}"
            );
            let sends = winners[0]
                .2
                .iter()
                .filter(|e| matches!(e, Effect::SendNewConfig(..)))
                .count();
            assert_eq!(
                sends, 3,
                "{name}: the winner sends NEW-CONFIG to the 3 survivors"
            );
        }
    }
}
