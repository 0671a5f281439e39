//! The ZooKeeper coordination store (FaRM §5.2, step 3): the configuration lives in the znode
//! `<root>/<cluster>/config`, and compare-and-set is `setData` at the znode version read
//! (`create` for the first configuration). This is where the runtime talks to a server; the
//! protocol crates only see [`CoordinationStore`].
//!
//! The client is async (`zookeeper-client`); a small tokio runtime with one worker thread keeps
//! its session alive, and the store's blocking methods wait on it with a timeout. A session the
//! server expired (the client went unheard for its session timeout: a paused process, a
//! server that stalled) is replaced by a new one at the next operation: a read runs again in it,
//! a write that met the expiry is answered `Unavailable` (it may have been applied), and later
//! operations use the new session. The store keeps no ephemeral znodes or watches, and
//! compare-and-set goes by znode version, so nothing is lost with the old session.

use std::future::Future;
use std::time::Duration;

use farm_cm::{CasOutcome, CoordinationStore, StoreError, StoreVersion};
use zookeeper_client as zk;

/// A [`CoordinationStore`] in a ZooKeeper ensemble.
pub struct ZkStore {
    runtime: tokio::runtime::Runtime,
    /// The client of the current session, replaced when the server expired it.
    client: std::sync::Mutex<zk::Client>,
    /// The ensemble, for a new session.
    connect: String,
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
        let client = Self::session(&runtime, connect, timeout)?;
        let store = Self {
            runtime,
            client: std::sync::Mutex::new(client),
            connect: connect.to_string(),
            root: root.to_string(),
            path: format!("{root}/config"),
            timeout,
        };
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let root = root.to_string();
        let (root, options) = (&root, &options);
        store
            .op(true, |c| async move { c.mkdir(root, options).await })?
            .map_err(|e| unavailable("creating the cluster root", e))?;
        Ok(store)
    }

    /// A new session with the ensemble at `connect`.
    fn session(
        runtime: &tokio::runtime::Runtime,
        connect: &str,
        timeout: Duration,
    ) -> Result<zk::Client, StoreError> {
        let session = timeout.max(Duration::from_secs(2));
        runtime
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
            .map_err(|e| unavailable(&format!("connecting to ZooKeeper at {connect}"), e))
    }

    /// Runs the operation `f` makes with the current session's client, waiting for it at most
    /// the store's timeout. If the server expired the session (or the client closed it), a new
    /// session replaces it; a read (`rerun`) then runs again in it, while a write is answered
    /// `Unavailable`: it may have been applied before the session ended, and only its caller,
    /// reading again, can tell.
    fn op<T, F: Future<Output = Result<T, zk::Error>>>(
        &self,
        rerun: bool,
        f: impl Fn(zk::Client) -> F,
    ) -> Result<Result<T, zk::Error>, StoreError> {
        let client = self.client.lock().expect("client poisoned").clone();
        match self.wait(f(client.clone()))? {
            Err(zk::Error::SessionExpired | zk::Error::ClientClosed) => {
                let client = self.renew(&client)?;
                if rerun {
                    self.wait(f(client))
                } else {
                    Err(StoreError::Unavailable(
                        "the ZooKeeper session expired during a write, which may or may not \
                         have been applied"
                            .into(),
                    ))
                }
            }
            outcome => Ok(outcome),
        }
    }

    /// A new session in place of `expired`'s, unless another thread made one already.
    fn renew(&self, expired: &zk::Client) -> Result<zk::Client, StoreError> {
        let mut current = self.client.lock().expect("client poisoned");
        if current.session_id() == expired.session_id() {
            tracing::warn!(
                ensemble = %self.connect,
                "the ZooKeeper session expired; starting a new one"
            );
            *current = Self::session(&self.runtime, &self.connect, self.timeout)?;
        }
        Ok(current.clone())
    }

    /// The data and stat of the znode `path`.
    fn get_data(&self, path: &str) -> Result<Result<(Vec<u8>, zk::Stat), zk::Error>, StoreError> {
        self.op(true, |c| async move { c.get_data(path).await })
    }

    /// Creates the persistent znode `path` with `data`; its stat.
    fn create(&self, path: &str, data: &[u8]) -> Result<Result<zk::Stat, zk::Error>, StoreError> {
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let options = &options;
        self.op(false, |c| async move {
            c.create(path, data, options).await.map(|(stat, _)| stat)
        })
    }

    /// Sets the data of the znode `path`, at `version` if given; its stat.
    fn set_data(
        &self,
        path: &str,
        data: &[u8],
        version: Option<i32>,
    ) -> Result<Result<zk::Stat, zk::Error>, StoreError> {
        self.op(
            false,
            |c| async move { c.set_data(path, data, version).await },
        )
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
        match self.create(&path, data)? {
            Ok(_) => Ok(()),
            Err(zk::Error::NodeExists) => self
                .set_data(&path, data, None)?
                .map(|_| ())
                .map_err(|e| unavailable(&format!("setting {path}"), e)),
            Err(e) => Err(unavailable(&format!("creating {path}"), e)),
        }
    }

    /// Creates the znode `<root>/<name>` with `data` unless it exists; returns whether it
    /// created it.
    pub fn put_new(&self, name: &str, data: &[u8]) -> Result<bool, StoreError> {
        let path = self.child(name)?;
        match self.create(&path, data)? {
            Ok(_) => Ok(true),
            Err(zk::Error::NodeExists) => Ok(false),
            Err(e) => Err(unavailable(&format!("creating {path}"), e)),
        }
    }

    /// The data of the znode `<root>/<name>`, if it exists.
    pub fn get(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.child(name)?;
        match self.get_data(&path)? {
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
        match self.get_data(&self.path)? {
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
            None => match self.create(&self.path, data)? {
                Ok(stat) => Ok(CasOutcome::Written(StoreVersion(stat.version as i64))),
                Err(zk::Error::NodeExists) => Ok(CasOutcome::Conflict),
                Err(e) => Err(unavailable("creating the configuration", e)),
            },
            Some(v) => {
                let version = i32::try_from(v.0).map_err(|_| {
                    StoreError::Unavailable(format!("version {} out of range", v.0))
                })?;
                match self.set_data(&self.path, data, Some(version))? {
                    Ok(stat) => Ok(CasOutcome::Written(StoreVersion(stat.version as i64))),
                    Err(zk::Error::BadVersion | zk::Error::NoNode) => Ok(CasOutcome::Conflict),
                    Err(e) => Err(unavailable("replacing the configuration", e)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store whose session the server ended (as it does for a client it did not hear from
    /// within the session timeout) works again in a new session: before, every operation
    /// failed with "session expired" for the rest of the process, and a CM could never store
    /// another configuration.
    #[test]
    fn a_store_whose_session_expired_works_again_in_a_new_session() {
        let Ok(ensemble) = std::env::var("ZK_CONNECT") else {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but ZK_CONNECT is not set: run the tests under scripts/with-zookeeper.sh"
            );
            eprintln!("skipping: ZK_CONNECT is not set (scripts/with-zookeeper.sh sets it)");
            return;
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let root = format!("/farm/zk-expiry-{}-{nanos}", std::process::id());
        let store = ZkStore::connect(&ensemble, &root, Duration::from_secs(1)).unwrap();
        store.put("a", b"1").unwrap();
        assert_eq!(
            store.compare_and_set(None, b"c1").unwrap(),
            CasOutcome::Written(StoreVersion(0))
        );
        // The client's runtime does not answer the server for three session timeouts (a
        // paused process): the server expires the session.
        let old = store.client.lock().unwrap().clone();
        let session = old.session_timeout();
        store
            .runtime
            .spawn(async move { std::thread::sleep(3 * session) });
        std::thread::sleep(3 * session + Duration::from_millis(500));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            match store.runtime.block_on(old.get_data(&root)) {
                Err(zk::Error::SessionExpired) => break,
                other => assert!(
                    std::time::Instant::now() < deadline,
                    "the session did not expire: {other:?}"
                ),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(store.get("a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(
            store.compare_and_set(Some(StoreVersion(0)), b"c2").unwrap(),
            CasOutcome::Written(StoreVersion(1))
        );
        assert_eq!(store.read().unwrap().unwrap().1, b"c2");
    }
}
