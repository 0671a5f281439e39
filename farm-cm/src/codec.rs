//! The encoding of a configuration `<i, S, F, CM>` as stored in the coordination store
//! (ZooKeeper znode data). Versioned; decoding bytes that came from elsewhere returns an error
//! that names the problem and never panics.

use std::collections::BTreeMap;

use farm_core::config::Configuration;
use farm_core::{ConfigId, MachineId};

/// Encoding version written first.
pub const CONFIG_CODEC_VERSION: u8 = 1;
/// Most members a configuration can have.
pub const MEMBERS_MAX: usize = 4096;

/// Why stored bytes are not a configuration.
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
    out
}

/// Decodes a configuration, checking its invariants: members sorted and distinct, the CM a
/// member, and a failure domain for every member.
pub fn decode(bytes: &[u8]) -> Result<Configuration, CodecError> {
    let mut at = 0;
    let mut take = |n: usize| -> Result<&[u8], CodecError> {
        let s = bytes.get(at..at + n).ok_or(CodecError::Truncated(at))?;
        at += n;
        Ok(s)
    };
    let version = take(1)?[0];
    if version != CONFIG_CODEC_VERSION {
        return Err(CodecError::Version(version));
    }
    let id = ConfigId(u64::from_le_bytes(take(8)?.try_into().expect("8")));
    let cm = MachineId(u16::from_le_bytes(take(2)?.try_into().expect("2")));
    let n = u32::from_le_bytes(take(4)?.try_into().expect("4")) as usize;
    if n > MEMBERS_MAX {
        return Err(CodecError::Invalid(format!(
            "{n} members (max {MEMBERS_MAX})"
        )));
    }
    let mut members = Vec::with_capacity(n);
    let mut failure_domains = BTreeMap::new();
    for _ in 0..n {
        let m = MachineId(u16::from_le_bytes(take(2)?.try_into().expect("2")));
        let fd = u32::from_le_bytes(take(4)?.try_into().expect("4"));
        if members.last().is_some_and(|last| *last >= m) {
            return Err(CodecError::Invalid(format!(
                "members not sorted and distinct at {m}"
            )));
        }
        members.push(m);
        failure_domains.insert(m, fd);
    }
    if at != bytes.len() {
        return Err(CodecError::Invalid(format!(
            "{} trailing bytes",
            bytes.len() - at
        )));
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
}
