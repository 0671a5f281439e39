//! The ZooKeeper coordination store (FaRM §5.2, step 3): the configuration lives in the znode
//! `<root>/<cluster>/config`, and compare-and-set is `setData` at the znode version read
//! (`create` for the first configuration). This is where the runtime talks to a server; the
//! protocol crates only see [`CoordinationStore`].
//!
//! The client is async (`zookeeper-client`); a small tokio runtime with one worker thread keeps
//! its session alive, and the store's blocking methods wait on it with a timeout.

use std::future::Future;
use std::time::Duration;

use farm_cm::{CasOutcome, CoordinationStore, StoreError, StoreVersion};
use zookeeper_client as zk;

/// A [`CoordinationStore`] in a ZooKeeper ensemble.
pub struct ZkStore {
    runtime: tokio::runtime::Runtime,
    client: zk::Client,
    root: String,
    path: String,
    timeout: Duration,
}

impl std::fmt::Debug for ZkStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

fn unavailable(what: &str, e: zk::Error) -> StoreError {
    StoreError::Unavailable(format!("{what}: {e}"))
}

impl ZkStore {
    /// Connects to the ensemble at `connect` (`host:port[,host:port...]`) and uses the znode
    /// `<root>/config` (`root` like `/farm/my-cluster`, created if missing). Every operation,
    /// connecting included, gives up after `timeout`.
    pub fn connect(connect: &str, root: &str, timeout: Duration) -> Result<Self, StoreError> {
        if !root.starts_with('/') || root.ends_with('/') || root.contains("//") {
            return Err(StoreError::Unavailable(format!(
                "cluster root {root:?} must be an absolute znode path like /farm/name"
            )));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("farm-zookeeper")
            .enable_time()
            .build()
            .map_err(|e| {
                StoreError::Unavailable(format!("starting the ZooKeeper client runtime: {e}"))
            })?;
        let session = timeout.max(Duration::from_secs(2));
        let client = runtime
            .block_on(async {
                tokio::time::timeout(
                    timeout,
                    zk::Client::connector()
                        .with_session_timeout(session)
                        .connect(connect),
                )
                .await
            })
            .map_err(|_| {
                StoreError::Unavailable(format!(
                    "no ZooKeeper answered at {connect} within {} ms",
                    timeout.as_millis()
                ))
            })?
            .map_err(|e| unavailable(&format!("connecting to ZooKeeper at {connect}"), e))?;
        let store = Self {
            runtime,
            client,
            root: root.to_string(),
            path: format!("{root}/config"),
            timeout,
        };
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let client = store.client.clone();
        let root = root.to_string();
        store
            .wait(async move { client.mkdir(&root, &options).await })?
            .map_err(|e| unavailable("creating the cluster root", e))?;
        Ok(store)
    }

    fn wait<T>(&self, f: impl Future<Output = T>) -> Result<T, StoreError> {
        let timeout = self.timeout;
        self.runtime
            .block_on(async { tokio::time::timeout(timeout, f).await })
            .map_err(|_| StoreError::Timeout(timeout.as_millis() as u64))
    }

    /// The znode holding the configuration.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Sets the znode `<root>/<name>` (a name without `/`) to `data`, creating it if needed:
    /// for what the cluster's processes share besides the configuration (a workload's table
    /// roots, say).
    pub fn put(&self, name: &str, data: &[u8]) -> Result<(), StoreError> {
        let path = self.child(name)?;
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        match self.wait(self.client.create(&path, data, &options))? {
            Ok(_) => Ok(()),
            Err(zk::Error::NodeExists) => self
                .wait(self.client.set_data(&path, data, None))?
                .map(|_| ())
                .map_err(|e| unavailable(&format!("setting {path}"), e)),
            Err(e) => Err(unavailable(&format!("creating {path}"), e)),
        }
    }

    /// Creates the znode `<root>/<name>` with `data` unless it exists; returns whether it
    /// created it.
    pub fn put_new(&self, name: &str, data: &[u8]) -> Result<bool, StoreError> {
        let path = self.child(name)?;
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        match self.wait(self.client.create(&path, data, &options))? {
            Ok(_) => Ok(true),
            Err(zk::Error::NodeExists) => Ok(false),
            Err(e) => Err(unavailable(&format!("creating {path}"), e)),
        }
    }

    /// The data of the znode `<root>/<name>`, if it exists.
    pub fn get(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.child(name)?;
        match self.wait(self.client.get_data(&path))? {
            Ok((data, _)) => Ok(Some(data)),
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) => Err(unavailable(&format!("reading {path}"), e)),
        }
    }

    /// The configuration stored, decoded, if there is one.
    pub fn configuration(&self) -> Result<Option<farm_core::config::Configuration>, StoreError> {
        use farm_cm::{ConfigurationStore, ReadConfigError};
        match self.read_config() {
            Ok(stored) => Ok(stored.map(|(_, c)| c)),
            Err(ReadConfigError::Store(e)) => Err(e),
            Err(e @ ReadConfigError::Undecodable(_)) => Err(StoreError::Unavailable(e.to_string())),
        }
    }

    fn child(&self, name: &str) -> Result<String, StoreError> {
        if name.is_empty() || name.contains('/') || name == "config" {
            return Err(StoreError::Unavailable(format!(
                "{name:?} is not a znode name beside the configuration"
            )));
        }
        Ok(format!("{}/{name}", self.root))
    }
}

impl CoordinationStore for ZkStore {
    fn read(&self) -> Result<Option<(StoreVersion, Vec<u8>)>, StoreError> {
        match self.wait(self.client.get_data(&self.path))? {
            Ok((data, stat)) => Ok(Some((StoreVersion(stat.version as i64), data))),
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) => Err(unavailable("reading the configuration", e)),
        }
    }

    fn compare_and_set(
        &self,
        expected: Option<StoreVersion>,
        data: &[u8],
    ) -> Result<CasOutcome, StoreError> {
        match expected {
            None => {
                let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                match self.wait(self.client.create(&self.path, data, &options))? {
                    Ok((stat, _)) => Ok(CasOutcome::Written(StoreVersion(stat.version as i64))),
                    Err(zk::Error::NodeExists) => Ok(CasOutcome::Conflict),
                    Err(e) => Err(unavailable("creating the configuration", e)),
                }
            }
            Some(v) => {
                let version = i32::try_from(v.0).map_err(|_| {
                    StoreError::Unavailable(format!("version {} out of range", v.0))
                })?;
                match self.wait(self.client.set_data(&self.path, data, Some(version)))? {
                    Ok(stat) => Ok(CasOutcome::Written(StoreVersion(stat.version as i64))),
                    Err(zk::Error::BadVersion | zk::Error::NoNode) => Ok(CasOutcome::Conflict),
                    Err(e) => Err(unavailable("replacing the configuration", e)),
                }
            }
        }
    }
}
