//! A node's checks of the state it starts from. Its own binary: no test here spawns processes,
//! which would inherit (until they exec) the liveness lock a dropped node releases.

mod nodes;

/// A node refuses, naming the directory, to start a new cluster over a machine's state, and
/// to restart from a directory without it or without the ZooKeeper store a restart decides in.
#[test]
fn a_node_refuses_state_it_cannot_start_from() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = nodes::node_config("bank", 0, nodes::base_port(2), dir.path());
    config.machines = 1;
    config.replicas = 1;
    config.restart = true;
    let err = farm::node::Node::start(&config).unwrap_err().to_string();
    assert!(err.contains("needs the ZooKeeper store"), "{err}");
    config.zookeeper = Some(("127.0.0.1:1".into(), "/farm/none".into()));
    let err = farm::node::Node::start(&config).unwrap_err().to_string();
    assert!(err.contains("holds no state of machine m0"), "{err}");
    config.zookeeper = None;
    config.restart = false;
    let node = farm::node::Node::start(&config).unwrap();
    node.txn(|tx| tx.alloc(&1u64, None)).unwrap();
    drop(node);
    let err = farm::node::Node::start(&config).unwrap_err().to_string();
    assert!(
        err.contains("already holds machine m0's state")
            && err.contains(&dir.path().display().to_string()),
        "{err}"
    );
}

/// Over the `tcp` fabric a node needs an address for every machine.
#[test]
fn a_tcp_node_refuses_missing_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = nodes::node_config("bank", 0, nodes::base_port(3), dir.path());
    config.transport = farm::node::Transport::Tcp {
        addrs: vec!["127.0.0.1:1".parse().unwrap()],
        timeout: nodes::TCP_TIMEOUT,
    };
    let err = farm::node::Node::start(&config).unwrap_err().to_string();
    assert!(err.contains("3 machines but 1 addresses"), "{err}");
}
