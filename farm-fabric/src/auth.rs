//! Peer authentication (docs/ARCHITECTURE.md, Security): the machines of a cluster share a
//! secret, and nobody without it reads or writes their memory or sends them a datagram they
//! act on.
//!
//! - A `tcp` connection proves both ends know the secret before any one-sided operation
//!   ([`Handshake`]): each side sends a fresh nonce, and each answers with an HMAC-SHA256 of
//!   both nonces and the hello under the secret, bound to its role, so that neither a
//!   stranger nor a replay of an earlier handshake gets through. What follows on the
//!   connection is not authenticated per message: an attacker who can take over an
//!   established TCP connection on the path is outside what this protects against (put the
//!   cluster's network out of reach, or tunnel it).
//! - Every datagram (leases, control messages) carries its sender's incarnation, a sequence
//!   number and the time it was sent, under a tag ([`DatagramSeal`]); a receiver checks the
//!   tag before it looks at anything else, refuses a datagram sent more than
//!   [`DATAGRAM_AGE_MAX`] from its own clock, and remembers per sender which sequence numbers
//!   it took ([`Replays`]), so a datagram replayed later, or from an earlier life of the
//!   sender, is refused. The hosts' clocks must agree within [`DATAGRAM_AGE_MAX`].
//!
//! Secrets are files ([`Secret::load`]), readable by their owner only, as an SSH key is.

use std::fmt;
use std::io::{self, Write};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::process::{io_err, StartError};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a secret a new cluster gets ([`Secret::generate`]).
pub const SECRET_BYTES: usize = 32;
/// The fewest bytes a secret file may hold.
pub const SECRET_BYTES_MIN: usize = 16;
/// Bytes of a datagram's tag (a truncated HMAC-SHA256).
pub const TAG_BYTES: usize = 16;
/// Bytes of a handshake nonce.
pub const NONCE_BYTES: usize = 16;
/// Bytes of a handshake proof (a whole HMAC-SHA256).
pub const PROOF_BYTES: usize = 32;
/// How far a datagram's send time may be from the receiver's clock.
pub const DATAGRAM_AGE_MAX: Duration = Duration::from_secs(60);
/// Sequence numbers below the highest taken from a sender that are still accepted once
/// (datagrams overtake each other).
pub(crate) const REPLAY_WINDOW: u64 = 64;

/// The cluster's shared secret. Its `Debug` shows no byte of it.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

impl Secret {
    /// A secret of these bytes (at least [`SECRET_BYTES_MIN`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, StartError> {
        if bytes.len() < SECRET_BYTES_MIN {
            return Err(StartError::Invalid(format!(
                "a secret of {} bytes: at least {SECRET_BYTES_MIN}",
                bytes.len()
            )));
        }
        Ok(Self(bytes.to_vec()))
    }

    /// Reads the secret file at `path`: refused if others than its owner may read it, or if
    /// it is shorter than [`SECRET_BYTES_MIN`].
    pub fn load(path: &Path) -> Result<Self, StartError> {
        let what = format!("reading the cluster's secret {}", path.display());
        let meta = std::fs::metadata(path).map_err(io_err(&what))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(StartError::Invalid(format!(
                    "the cluster's secret {} may be read by others (mode {mode:o}): make it \
                     readable by its owner only (chmod 600)",
                    path.display()
                )));
            }
        }
        let bytes = std::fs::read(path).map_err(io_err(&what))?;
        Self::from_bytes(&bytes).map_err(|e| {
            StartError::Invalid(format!("the cluster's secret {}: {e}", path.display()))
        })
    }

    /// Makes a new secret of [`SECRET_BYTES`] random bytes at `path`, readable by its owner
    /// only; fails if the file exists.
    pub fn generate(path: &Path) -> Result<Self, StartError> {
        let mut bytes = [0u8; SECRET_BYTES];
        getrandom::getrandom(&mut bytes)
            .map_err(|e| io_err("drawing a secret")(io::Error::other(e.to_string())))?;
        let what = format!("creating the cluster's secret {}", path.display());
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(path).map_err(io_err(&what))?;
        file.write_all(&bytes).map_err(io_err(&what))?;
        file.sync_all().map_err(io_err(&what))?;
        Self::from_bytes(&bytes)
    }

    fn mac(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        for p in parts {
            mac.update(&(p.len() as u32).to_le_bytes());
            mac.update(p);
        }
        mac
    }

    /// The tag of a message made of `parts` (each length-prefixed, so that no two splits of
    /// the same bytes tag alike).
    fn tag(&self, parts: &[&[u8]]) -> [u8; TAG_BYTES] {
        let full = self.mac(parts).finalize().into_bytes();
        full[..TAG_BYTES].try_into().expect("16 of 32 bytes")
    }

    /// Whether `tag` is the tag of `parts`, compared in constant time.
    fn verify_tag(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        tag.len() == TAG_BYTES && self.mac(parts).verify_truncated_left(tag).is_ok()
    }

    fn proof(&self, parts: &[&[u8]]) -> [u8; PROOF_BYTES] {
        self.mac(parts).finalize().into_bytes().into()
    }

    fn verify_proof(&self, parts: &[&[u8]], proof: &[u8]) -> bool {
        self.mac(parts).verify_slice(proof).is_ok()
    }
}

/// A fresh random nonce.
pub fn nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::getrandom(&mut n).expect("the operating system's random numbers");
    n
}

/// The challenge and response of a `tcp` connection's hello: the connecting side sends its
/// hello with its nonce, the accepting side answers with its nonce and its proof, and the
/// connecting side answers with its own proof. A proof is the HMAC of the role, the hello
/// and both nonces.
#[derive(Debug)]
pub struct Handshake<'a> {
    /// The cluster's secret.
    pub secret: &'a Secret,
    /// The hello the connecting side sent.
    pub hello: &'a [u8],
    /// The connecting side's nonce.
    pub connecting: [u8; NONCE_BYTES],
    /// The accepting side's nonce.
    pub accepting: [u8; NONCE_BYTES],
}

impl Handshake<'_> {
    fn parts<'b>(&'b self, role: &'b [u8]) -> [&'b [u8]; 4] {
        [role, self.hello, &self.connecting, &self.accepting]
    }

    /// The accepting side's proof.
    pub fn accepting_proof(&self) -> [u8; PROOF_BYTES] {
        self.secret.proof(&self.parts(b"farm accepting"))
    }

    /// The connecting side's proof.
    pub fn connecting_proof(&self) -> [u8; PROOF_BYTES] {
        self.secret.proof(&self.parts(b"farm connecting"))
    }

    /// Whether `proof` is the accepting side's.
    pub fn accepting_proved(&self, proof: &[u8]) -> bool {
        self.secret
            .verify_proof(&self.parts(b"farm accepting"), proof)
    }

    /// Whether `proof` is the connecting side's.
    pub fn connecting_proved(&self, proof: &[u8]) -> bool {
        self.secret
            .verify_proof(&self.parts(b"farm connecting"), proof)
    }
}

/// Bytes a seal adds after a datagram's header: incarnation, sequence number, send time.
pub const SEAL_BYTES: usize = 8 + 8 + 8;

/// What a datagram carries to prove where and when it comes from: the sender's incarnation
/// (microseconds since the epoch when its process started), a sequence number, and the time
/// it was sent, all under the datagram's tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DatagramSeal {
    pub(crate) incarnation: u64,
    pub(crate) seq: u64,
    pub(crate) sent_us: u64,
}

impl DatagramSeal {
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.incarnation.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.sent_us.to_le_bytes());
    }

    pub(crate) fn decode(b: &[u8]) -> Self {
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Self {
            incarnation: word(0),
            seq: word(8),
            sent_us: word(16),
        }
    }
}

/// Microseconds since the Unix epoch by this host's clock.
pub(crate) fn wall_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The tag of a datagram to machine `dst` over its bytes before the tag (header, seal,
/// payload): bound to its destination, so that one captured on its way to one machine is
/// refused by another.
pub(crate) fn datagram_tag(secret: &Secret, dst: u16, sealed: &[u8]) -> [u8; TAG_BYTES] {
    secret.tag(&[b"farm datagram", &dst.to_le_bytes(), sealed])
}

/// Whether `tag` is the tag of `sealed` to machine `dst`.
pub(crate) fn datagram_tag_holds(secret: &Secret, dst: u16, sealed: &[u8], tag: &[u8]) -> bool {
    secret.verify_tag(&[b"farm datagram", &dst.to_le_bytes(), sealed], tag)
}

/// Why a datagram was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Its tag does not hold: not made with the cluster's secret, or altered.
    Forged,
    /// Sent too long ago or in the future by the receiver's clock.
    Stale,
    /// Taken before, or from an earlier life of its sender.
    Replayed,
}

/// What a receiver took from each sender: the sender's newest incarnation, the highest
/// sequence number taken from it, and which of the [`REPLAY_WINDOW`] below were taken.
#[derive(Debug, Default)]
pub(crate) struct Replays {
    senders: Vec<Option<(u64, u64, u64)>>,
}

impl Replays {
    /// Takes `seal` from `src` at `now_us`, or says why not.
    pub(crate) fn take(
        &mut self,
        src: u16,
        seal: DatagramSeal,
        now_us: u64,
    ) -> Result<(), Refusal> {
        let age_max = DATAGRAM_AGE_MAX.as_micros() as u64;
        if seal.sent_us.abs_diff(now_us) > age_max {
            return Err(Refusal::Stale);
        }
        let i = src as usize;
        if self.senders.len() <= i {
            self.senders.resize(i + 1, None);
        }
        let entry = &mut self.senders[i];
        match entry {
            Some((incarnation, _, _)) if seal.incarnation < *incarnation => Err(Refusal::Replayed),
            Some((incarnation, highest, taken)) if seal.incarnation == *incarnation => {
                if seal.seq > *highest {
                    let shift = seal.seq - *highest;
                    *taken = if shift >= REPLAY_WINDOW {
                        0
                    } else {
                        *taken << shift
                    };
                    *taken |= 1;
                    *highest = seal.seq;
                    Ok(())
                } else {
                    let back = *highest - seal.seq;
                    if back >= REPLAY_WINDOW || *taken & (1 << back) != 0 {
                        return Err(Refusal::Replayed);
                    }
                    *taken |= 1 << back;
                    Ok(())
                }
            }
            // A sender not heard from, or a new life of it.
            _ => {
                *entry = Some((seal.incarnation, seal.seq, 1));
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seal(incarnation: u64, seq: u64) -> DatagramSeal {
        DatagramSeal {
            incarnation,
            seq,
            sent_us: 1_000_000_000,
        }
    }

    #[test]
    fn each_datagram_is_taken_once_and_earlier_lives_are_refused() {
        let now = 1_000_000_000;
        let mut r = Replays::default();
        assert_eq!(r.take(3, seal(10, 5), now), Ok(()));
        assert_eq!(r.take(3, seal(10, 5), now), Err(Refusal::Replayed));
        // Overtaken datagrams are taken once, within the window.
        assert_eq!(r.take(3, seal(10, 9), now), Ok(()));
        assert_eq!(r.take(3, seal(10, 7), now), Ok(()));
        assert_eq!(r.take(3, seal(10, 7), now), Err(Refusal::Replayed));
        assert_eq!(r.take(3, seal(10, 200), now), Ok(()));
        assert_eq!(r.take(3, seal(10, 100), now), Err(Refusal::Replayed));
        // Another sender counts on its own; a new life starts afresh, the old one is over.
        assert_eq!(r.take(4, seal(10, 5), now), Ok(()));
        assert_eq!(r.take(3, seal(11, 1), now), Ok(()));
        assert_eq!(r.take(3, seal(10, 201), now), Err(Refusal::Replayed));
        // Sent long ago, or in the future.
        let mut old = seal(11, 2);
        old.sent_us = now - DATAGRAM_AGE_MAX.as_micros() as u64 - 1;
        assert_eq!(r.take(3, old, now), Err(Refusal::Stale));
        old.sent_us = now + DATAGRAM_AGE_MAX.as_micros() as u64 + 1;
        assert_eq!(r.take(3, old, now), Err(Refusal::Stale));
    }

    #[test]
    fn tags_and_proofs_hold_only_under_the_same_secret() {
        let a = Secret::from_bytes(&[1; 32]).unwrap();
        let b = Secret::from_bytes(&[2; 32]).unwrap();
        let tag = datagram_tag(&a, 1, b"hello");
        assert!(datagram_tag_holds(&a, 1, b"hello", &tag));
        assert!(!datagram_tag_holds(&a, 1, b"hellO", &tag));
        assert!(!datagram_tag_holds(&a, 2, b"hello", &tag));
        assert!(!datagram_tag_holds(&b, 1, b"hello", &tag));
        let hs = |secret| Handshake {
            secret,
            hello: b"hello",
            connecting: [3; NONCE_BYTES],
            accepting: [4; NONCE_BYTES],
        };
        let proof = hs(&a).accepting_proof();
        assert!(hs(&a).accepting_proved(&proof));
        assert!(!hs(&b).accepting_proved(&proof));
        // A role's proof is not the other role's.
        assert!(!hs(&a).connecting_proved(&proof));
        assert!(Secret::from_bytes(&[0; 8]).is_err());
        assert_eq!(format!("{a:?}"), "Secret(32 bytes)");
    }

    #[test]
    fn a_secret_file_others_may_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        let made = Secret::generate(&path).unwrap();
        assert_eq!(Secret::load(&path).unwrap().0, made.0);
        assert!(
            Secret::generate(&path).is_err(),
            "an existing secret was replaced"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
            let err = Secret::load(&path).unwrap_err().to_string();
            assert!(err.contains("chmod 600"), "{err}");
        }
    }
}
