//! The coordination store (FaRM §5.2, step 3): where the current configuration lives, changed
//! only by compare-and-set, so that exactly one machine moves the system from configuration `c`
//! to `c + 1`.
//!
//! Contract of every [`CoordinationStore`]:
//! - [`CoordinationStore::read`] returns the stored bytes with their [`StoreVersion`], or `None`
//!   when nothing was ever stored;
//! - [`CoordinationStore::compare_and_set`] replaces the bytes only if the stored version is
//!   still `expected` (`None`: only if nothing is stored yet), returning the new version, or
//!   [`CasOutcome::Conflict`] and changing nothing when someone else got there first;
//! - a successful write is durable and visible to every later `read` from any client;
//! - errors ([`StoreError`]) mean the outcome is unknown (a timeout) or the store is unusable;
//!   callers read again before retrying.
//!
//! Implementations: [`EmbeddedStore`] (in-process, the default of the in-process cluster) and the
//! ZooKeeper store of the runtime crate (`farm::zk`), which keeps the bytes in a znode and uses
//! the znode version. What they keep is a [`Configuration`] in one encoding
//! (`farm_core::codec`), read and written through [`ConfigurationStore`] by every caller.

use std::sync::Mutex;

use farm_core::codec::{self, CodecError, RestartMark};
use farm_core::config::Configuration;

/// Version of the stored value (the znode version for ZooKeeper).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct StoreVersion(pub i64);

/// What a compare-and-set did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CasOutcome {
    /// Written; the value now has this version.
    Written(StoreVersion),
    /// The stored version was not the expected one: nothing changed.
    Conflict,
}

/// Why a store operation failed.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum StoreError {
    /// The store did not answer in time; the operation may or may not have happened.
    #[error("coordination store timed out after {0} ms")]
    Timeout(u64),
    /// The store cannot be reached or refused the operation.
    #[error("coordination store unavailable: {0}")]
    Unavailable(String),
}

/// The contract in the module docs.
pub trait CoordinationStore: Send + Sync + std::fmt::Debug {
    /// The stored value and its version, if any.
    fn read(&self) -> Result<Option<(StoreVersion, Vec<u8>)>, StoreError>;

    /// Replaces the value if its version is still `expected`.
    fn compare_and_set(
        &self,
        expected: Option<StoreVersion>,
        data: &[u8],
    ) -> Result<CasOutcome, StoreError>;
}

/// An in-process store with the same contract, for clusters inside one process.
#[derive(Debug, Default)]
pub struct EmbeddedStore {
    value: Mutex<Option<(StoreVersion, Vec<u8>)>>,
}

impl EmbeddedStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl CoordinationStore for EmbeddedStore {
    fn read(&self) -> Result<Option<(StoreVersion, Vec<u8>)>, StoreError> {
        Ok(self.value.lock().expect("store poisoned").clone())
    }

    fn compare_and_set(
        &self,
        expected: Option<StoreVersion>,
        data: &[u8],
    ) -> Result<CasOutcome, StoreError> {
        let mut value = self.value.lock().expect("store poisoned");
        let current = value.as_ref().map(|(v, _)| *v);
        if current != expected {
            return Ok(CasOutcome::Conflict);
        }
        // Versions follow ZooKeeper's: 0 at creation, then +1 per write.
        let next = StoreVersion(current.map_or(0, |v| v.0 + 1));
        *value = Some((next, data.to_vec()));
        Ok(CasOutcome::Written(next))
    }
}

/// Why the stored configuration could not be read.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum ReadConfigError {
    /// The store failed ([`StoreError`]).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The stored bytes are no configuration this build reads.
    #[error("the stored configuration does not decode: {0}")]
    Undecodable(#[from] CodecError),
}

/// The configuration in a [`CoordinationStore`], typed: the one place its bytes are encoded
/// and decoded. Every store has it.
pub trait ConfigurationStore {
    /// The stored configuration and its version, if any.
    fn read_config(&self) -> Result<Option<(StoreVersion, Configuration)>, ReadConfigError>;

    /// Stores `config` if the version is still `expected` (`None`: only if nothing is stored).
    fn cas_config(
        &self,
        expected: Option<StoreVersion>,
        config: &Configuration,
    ) -> Result<CasOutcome, StoreError>;

    /// The stored configuration and its version, with the [`RestartMark`] of the
    /// whole-cluster restart that stored it, if one did.
    fn read_marked_config(&self) -> Result<Option<MarkedConfig>, ReadConfigError>;

    /// Stores `config` marked as a whole-cluster restart's decision, if the version is still
    /// `expected`.
    fn cas_marked_config(
        &self,
        expected: StoreVersion,
        config: &Configuration,
        mark: RestartMark,
    ) -> Result<CasOutcome, StoreError>;
}

/// A stored configuration with its version and restart mark
/// ([`ConfigurationStore::read_marked_config`]).
pub type MarkedConfig = (StoreVersion, Configuration, Option<RestartMark>);

impl<S: CoordinationStore + ?Sized> ConfigurationStore for S {
    fn read_config(&self) -> Result<Option<(StoreVersion, Configuration)>, ReadConfigError> {
        Ok(self.read_marked_config()?.map(|(v, config, _)| (v, config)))
    }

    fn cas_config(
        &self,
        expected: Option<StoreVersion>,
        config: &Configuration,
    ) -> Result<CasOutcome, StoreError> {
        self.compare_and_set(expected, &codec::encode(config))
    }

    fn read_marked_config(&self) -> Result<Option<MarkedConfig>, ReadConfigError> {
        match self.read()? {
            Some((v, bytes)) => {
                let (config, mark) = codec::decode_marked(&bytes)?;
                Ok(Some((v, config, mark)))
            }
            None => Ok(None),
        }
    }

    fn cas_marked_config(
        &self,
        expected: StoreVersion,
        config: &Configuration,
        mark: RestartMark,
    ) -> Result<CasOutcome, StoreError> {
        self.compare_and_set(Some(expected), &codec::encode_marked(config, mark))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_round_trips_and_other_bytes_are_refused() {
        let store = EmbeddedStore::new();
        assert_eq!(store.read_config(), Ok(None));
        let config = Configuration::initial(3);
        let Ok(CasOutcome::Written(v)) = store.cas_config(None, &config) else {
            panic!("the first write wins");
        };
        assert_eq!(store.read_config(), Ok(Some((v, config.clone()))));
        assert_eq!(store.cas_config(None, &config), Ok(CasOutcome::Conflict));
        store
            .compare_and_set(Some(v), b"not a configuration")
            .unwrap();
        assert!(matches!(
            store.read_config(),
            Err(ReadConfigError::Undecodable(_))
        ));
    }
}
