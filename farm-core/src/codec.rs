//! How configurations are stored: a configuration `<i, S, F, CM>` in the coordination store
//! (ZooKeeper znode data), and a machine's whole view (configuration, region map and region
//! change history) in its NVRAM directory, from which a cluster restarts after every machine
//! stopped at once. Versioned; decoding bytes that came from elsewhere returns an error that
//! names the problem and never panics.

use std::collections::BTreeMap;

use crate::config::{Configuration, Placement, RegionChanges, RegionMap};
use crate::{ConfigId, MachineId, RegionId};

/// Encoding version written first.
pub const CONFIG_CODEC_VERSION: u8 = 1;
/// Encoding version of a view, written first.
pub const VIEW_CODEC_VERSION: u8 = 1;
/// Most members a configuration can have.
pub const MEMBERS_MAX: usize = 4096;
/// Most regions a stored view can map.
pub const REGIONS_MAX: usize = 1 << 20;

/// Why stored bytes are not a configuration (or a view).
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum CodecError {
    /// Fewer bytes than the encoding needs.
    #[error("stored configuration truncated at byte {0}")]
    Truncated(usize),
    /// An encoding this build does not read.
    #[error(
        "stored configuration has encoding version {0}, this build reads {CONFIG_CODEC_VERSION}"
    )]
    Version(u8),
    /// A field out of range.
    #[error("stored configuration is invalid: {0}")]
    Invalid(String),
}

/// Encodes `config`.
pub fn encode(config: &Configuration) -> Vec<u8> {
    let mut out = vec![CONFIG_CODEC_VERSION];
    encode_config_into(config, &mut out);
    out
}

fn encode_config_into(config: &Configuration, out: &mut Vec<u8>) {
    out.extend_from_slice(&config.id.0.to_le_bytes());
    out.extend_from_slice(&config.cm.0.to_le_bytes());
    out.extend_from_slice(&(config.members.len() as u32).to_le_bytes());
    for m in &config.members {
        out.extend_from_slice(&m.0.to_le_bytes());
        out.extend_from_slice(
            &config
                .failure_domains
                .get(m)
                .copied()
                .unwrap_or(0)
                .to_le_bytes(),
        );
    }
}

/// Marks a configuration stored by a whole-cluster restart: which machine decided it, in which
/// of its lives (a number it draws at every start). A machine that finds a restart
/// configuration in the store can tell the restart under way, whose decider it hears from in
/// that life, from one that an earlier life decided and never finished.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RestartMark {
    /// The machine that decided the restart.
    pub decider: MachineId,
    /// Its life when it decided.
    pub life: u64,
}

/// Tag of a [`RestartMark`] after the configuration.
const RESTART_MARK_TAG: u8 = 1;

/// Encodes `config` with a [`RestartMark`] after it.
pub fn encode_marked(config: &Configuration, mark: RestartMark) -> Vec<u8> {
    let mut out = encode(config);
    out.push(RESTART_MARK_TAG);
    out.extend_from_slice(&mark.decider.0.to_le_bytes());
    out.extend_from_slice(&mark.life.to_le_bytes());
    out
}

/// Decodes a configuration, checking its invariants: members sorted and distinct, the CM a
/// member, and a failure domain for every member. A [`RestartMark`] after it is skipped.
pub fn decode(bytes: &[u8]) -> Result<Configuration, CodecError> {
    decode_marked(bytes).map(|(c, _)| c)
}

/// Decodes a configuration as [`decode`] does, with its [`RestartMark`] if it has one.
pub fn decode_marked(bytes: &[u8]) -> Result<(Configuration, Option<RestartMark>), CodecError> {
    let mut r = Reader { bytes, at: 0 };
    let version = r.u8()?;
    if version != CONFIG_CODEC_VERSION {
        return Err(CodecError::Version(version));
    }
    let config = r.config()?;
    let mark = if r.at < bytes.len() {
        if bytes[r.at] != RESTART_MARK_TAG {
            r.end()?; // Trailing bytes that are no mark.
        }
        r.u8()?;
        Some(RestartMark {
            decider: MachineId(r.u16()?),
            life: r.u64()?,
        })
    } else {
        None
    };
    r.end()?;
    Ok((config, mark))
}

/// A machine's view as it persists it: the configuration it installed, the region map and
/// when each region last changed primary and replicas.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct StoredView {
    /// The configuration.
    pub config: Configuration,
    /// Where every region lives.
    pub map: RegionMap,
    /// LastPrimaryChange and LastReplicaChange of every region that has them.
    pub changes: BTreeMap<RegionId, RegionChanges>,
}

/// Encodes a view.
pub fn encode_view(
    config: &Configuration,
    map: &RegionMap,
    changes: &BTreeMap<RegionId, RegionChanges>,
) -> Vec<u8> {
    let mut out = vec![VIEW_CODEC_VERSION];
    encode_config_into(config, &mut out);
    out.extend_from_slice(&(map.iter().count() as u32).to_le_bytes());
    for (region, p) in map.iter() {
        out.extend_from_slice(&region.0.to_le_bytes());
        out.extend_from_slice(&p.primary.0.to_le_bytes());
        out.extend_from_slice(&(p.backups.len() as u16).to_le_bytes());
        for b in &p.backups {
            out.extend_from_slice(&b.0.to_le_bytes());
        }
    }
    out.extend_from_slice(&(changes.len() as u32).to_le_bytes());
    for (region, c) in changes {
        out.extend_from_slice(&region.0.to_le_bytes());
        out.extend_from_slice(&c.last_primary_change.0.to_le_bytes());
        out.extend_from_slice(&c.last_replica_change.0.to_le_bytes());
    }
    out
}

/// Decodes a view, checking the configuration's invariants and that every replica is a
/// distinct machine and no change is newer than the configuration.
pub fn decode_view(bytes: &[u8]) -> Result<StoredView, CodecError> {
    let mut r = Reader { bytes, at: 0 };
    let version = r.u8()?;
    if version != VIEW_CODEC_VERSION {
        return Err(CodecError::Version(version));
    }
    let config = r.config()?;
    let n = r.u32()? as usize;
    if n > REGIONS_MAX {
        return Err(CodecError::Invalid(format!(
            "{n} regions (max {REGIONS_MAX})"
        )));
    }
    let mut map = RegionMap::default();
    for _ in 0..n {
        let region = RegionId(r.u32()?);
        let primary = MachineId(r.u16()?);
        let b = r.u16()? as usize;
        let mut backups = Vec::with_capacity(b.min(MEMBERS_MAX));
        for _ in 0..b {
            let m = MachineId(r.u16()?);
            if m == primary || backups.contains(&m) {
                return Err(CodecError::Invalid(format!(
                    "region {} has machine {m} twice among its replicas",
                    region.0
                )));
            }
            backups.push(m);
        }
        if map.get(region).is_some() {
            return Err(CodecError::Invalid(format!(
                "region {} mapped twice",
                region.0
            )));
        }
        map.insert(region, Placement { primary, backups });
    }
    let n = r.u32()? as usize;
    if n > REGIONS_MAX {
        return Err(CodecError::Invalid(format!(
            "{n} region changes (max {REGIONS_MAX})"
        )));
    }
    let mut changes = BTreeMap::new();
    for _ in 0..n {
        let region = RegionId(r.u32()?);
        let c = RegionChanges {
            last_primary_change: ConfigId(r.u64()?),
            last_replica_change: ConfigId(r.u64()?),
        };
        if c.last_primary_change > config.id || c.last_replica_change > config.id {
            return Err(CodecError::Invalid(format!(
                "region {} changed after configuration {}",
                region.0, config.id.0
            )));
        }
        changes.insert(region, c);
    }
    r.end()?;
    Ok(StoredView {
        config,
        map,
        changes,
    })
}

/// A cursor over stored bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], CodecError> {
        let s = self
            .bytes
            .get(self.at..self.at + N)
            .ok_or(CodecError::Truncated(self.at))?;
        self.at += N;
        Ok(s.try_into().expect("N bytes"))
    }
    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, CodecError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.take()?))
    }

    fn config(&mut self) -> Result<Configuration, CodecError> {
        let id = ConfigId(self.u64()?);
        let cm = MachineId(self.u16()?);
        let n = self.u32()? as usize;
        if n > MEMBERS_MAX {
            return Err(CodecError::Invalid(format!(
                "{n} members (max {MEMBERS_MAX})"
            )));
        }
        let mut members = Vec::with_capacity(n);
        let mut failure_domains = BTreeMap::new();
        for _ in 0..n {
            let m = MachineId(self.u16()?);
            let fd = self.u32()?;
            if members.last().is_some_and(|last| *last >= m) {
                return Err(CodecError::Invalid(format!(
                    "members not sorted and distinct at {m}"
                )));
            }
            members.push(m);
            failure_domains.insert(m, fd);
        }
        if !members.contains(&cm) {
            return Err(CodecError::Invalid(format!("CM {cm} is not a member")));
        }
        Ok(Configuration {
            id,
            members,
            failure_domains,
            cm,
        })
    }

    fn end(&self) -> Result<(), CodecError> {
        if self.at != self.bytes.len() {
            return Err(CodecError::Invalid(format!(
                "{} trailing bytes",
                self.bytes.len() - self.at
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_malformed_bytes() {
        let mut c = Configuration::initial(5);
        c.failure_domains.insert(MachineId(3), 1);
        let bytes = encode(&c);
        assert_eq!(decode(&bytes).unwrap(), c);
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = bytes.clone();
        bad[0] = 7;
        assert_eq!(decode(&bad), Err(CodecError::Version(7)));
        let mut bad = bytes.clone();
        bad.push(0);
        assert!(decode(&bad).unwrap_err().to_string().contains("trailing"));
        let mut no_cm = c.clone();
        no_cm.cm = MachineId(9);
        assert!(decode(&encode(&no_cm))
            .unwrap_err()
            .to_string()
            .contains("CM m9 is not a member"));
    }

    #[test]
    fn a_restart_mark_round_trips_and_plain_decoding_skips_it() {
        let c = Configuration::initial(3);
        let mark = RestartMark {
            decider: MachineId(2),
            life: 0xfeed_f00d,
        };
        let bytes = encode_marked(&c, mark);
        assert_eq!(decode_marked(&bytes).unwrap(), (c.clone(), Some(mark)));
        assert_eq!(decode(&bytes).unwrap(), c);
        assert_eq!(decode_marked(&encode(&c)).unwrap(), (c.clone(), None));
        for cut in encode(&c).len() + 1..bytes.len() {
            assert!(decode_marked(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer)
            .unwrap_err()
            .to_string()
            .contains("trailing"));
    }

    #[test]
    fn views_round_trip_and_reject_malformed_bytes() {
        let mut config = Configuration::initial(4);
        config.id = ConfigId(7);
        let map = RegionMap::striped(4, 2, 2);
        let changes = BTreeMap::from([(
            RegionId(3),
            RegionChanges {
                last_primary_change: ConfigId(5),
                last_replica_change: ConfigId(7),
            },
        )]);
        let bytes = encode_view(&config, &map, &changes);
        let view = decode_view(&bytes).unwrap();
        assert_eq!(
            view,
            StoredView {
                config: config.clone(),
                map: map.clone(),
                changes: changes.clone()
            }
        );
        for cut in 0..bytes.len() {
            assert!(decode_view(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut later = changes;
        later.get_mut(&RegionId(3)).unwrap().last_replica_change = ConfigId(8);
        let err = decode_view(&encode_view(&config, &map, &later)).unwrap_err();
        assert!(
            err.to_string().contains("changed after configuration 7"),
            "{err}"
        );
    }
}
