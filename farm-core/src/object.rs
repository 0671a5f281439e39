//! Objects: an 8-byte header word followed by the payload (FaRM §3, §4).
//!
//! The header holds a lock bit (bit 63), an allocated bit (bit 62) and a 62-bit version. The
//! primary locks an object with a compare-and-swap of the whole header at the version a
//! transaction read (§4, Lock), so a concurrent commit, free or allocation makes the CAS fail.
//!
//! Reads are seqlock-style (docs/ARCHITECTURE.md, Objects): copy header and payload, then read the header
//! again; the copy is consistent only when both headers are equal and unlocked. Writers
//! ([`apply_locked`]) lock first, issue a release fence, write the payload and publish the new
//! header with `Release`, which is the write half of the same protocol.

use std::sync::atomic::{fence, Ordering};

use crate::ids::Version;
use crate::nvram::Nvram;

/// Size of the object header.
pub const HEADER_BYTES: usize = 8;

const LOCK_BIT: u64 = 1 << 63;
const ALLOC_BIT: u64 = 1 << 62;
const VERSION_MASK: u64 = ALLOC_BIT - 1;

/// An object header word.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Header(pub u64);

impl Header {
    /// An unlocked header.
    pub const fn new(version: Version, allocated: bool) -> Self {
        assert!(version.0 <= VERSION_MASK, "version overflow");
        Self(version.0 | if allocated { ALLOC_BIT } else { 0 })
    }

    /// Whether a transaction holds the object's lock.
    pub const fn locked(self) -> bool {
        self.0 & LOCK_BIT != 0
    }

    /// Whether the object is allocated.
    pub const fn allocated(self) -> bool {
        self.0 & ALLOC_BIT != 0
    }

    /// The version.
    pub const fn version(self) -> Version {
        Version(self.0 & VERSION_MASK)
    }

    /// This header with the lock bit set.
    pub const fn with_lock(self) -> Self {
        Self(self.0 | LOCK_BIT)
    }

    /// This header with the lock bit cleared.
    pub const fn without_lock(self) -> Self {
        Self(self.0 & !LOCK_BIT)
    }

    /// The unlocked header a commit installs over `self`: version plus one, allocated as given.
    pub fn committed_successor(self, allocated: bool) -> Self {
        let next = self.version().0 + 1;
        assert!(next <= VERSION_MASK, "object version overflow");
        Self::new(Version(next), allocated)
    }
}

/// Where an object read copies from: local NVRAM or a one-sided read through the fabric.
pub trait ObjectSource {
    /// The error of a failed read (a dead target, for the fabric).
    type Error;
    /// Copies `buf.len()` bytes at `offset`.
    fn read_bytes(&self, offset: u64, buf: &mut [u8]) -> Result<(), Self::Error>;
}

impl ObjectSource for Nvram {
    type Error = std::convert::Infallible;
    fn read_bytes(&self, offset: u64, buf: &mut [u8]) -> Result<(), Self::Error> {
        self.read(offset as usize, buf);
        Ok(())
    }
}

/// The result of one consistent-read attempt.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ReadOutcome {
    /// The buffer holds the committed payload with this (unlocked) header.
    Consistent(Header),
    /// A transaction holds the lock: the payload may be changing.
    Locked(Header),
    /// The header changed during the copy: a commit applied concurrently.
    Torn,
}

/// Reads the object at `offset` into `buf` (header first, then payload; `buf.len()` is
/// `HEADER_BYTES + payload length`) and checks it with a second header read.
pub fn read_object<S: ObjectSource + ?Sized>(
    src: &S,
    offset: u64,
    buf: &mut [u8],
) -> Result<ReadOutcome, S::Error> {
    assert!(
        buf.len() >= HEADER_BYTES,
        "object buffer smaller than a header"
    );
    src.read_bytes(offset, buf)?;
    if header_of(buf).locked() {
        return Ok(judge_copy(buf, header_of(buf).0));
    }
    // Order the payload loads before the second header load (seqlock reader).
    fence(Ordering::Acquire);
    let mut again = [0u8; HEADER_BYTES];
    src.read_bytes(offset, &mut again)?;
    Ok(judge_copy(buf, u64::from_le_bytes(again)))
}

/// The header word at the start of an object copy.
fn header_of(copy: &[u8]) -> Header {
    Header(u64::from_le_bytes(
        copy[..HEADER_BYTES].try_into().expect("8 bytes"),
    ))
}

/// Judges a copy of an object (header, then payload) against its header word read again after
/// the copy (`again`): the seqlock reader's rule, in one place for every way of reading (two
/// local reads, or one fabric read whose NIC reads the header again after copying,
/// [`crate::fabric::RemoteMemory::read_object`]). The copy must have been made with acquire
/// loads in increasing address order, and `again` loaded after it.
pub fn judge_copy(copy: &[u8], again: u64) -> ReadOutcome {
    assert!(
        copy.len() >= HEADER_BYTES,
        "object copy smaller than a header"
    );
    let before = header_of(copy);
    if before.locked() {
        ReadOutcome::Locked(before)
    } else if again != before.0 {
        ReadOutcome::Torn
    } else {
        ReadOutcome::Consistent(before)
    }
}

/// Reads only the header at `offset`.
pub fn read_header<S: ObjectSource + ?Sized>(src: &S, offset: u64) -> Result<Header, S::Error> {
    let mut word = [0u8; HEADER_BYTES];
    src.read_bytes(offset, &mut word)?;
    Ok(Header(u64::from_le_bytes(word)))
}

/// Locks the object at `offset` if its header is still `expected` (and unlocked): the
/// compare-and-swap of §4, step 1. Returns the header found on failure.
pub fn try_lock(mem: &Nvram, offset: u64, expected: Header) -> Result<(), Header> {
    assert!(!expected.locked(), "lock expected at a locked header");
    mem.cas_u64(offset as usize, expected.0, expected.with_lock().0)
        .map(|_| ())
        .map_err(Header)
}

/// Releases a lock without changing the object (ABORT): the header goes back to `unlocked`.
pub fn unlock(mem: &Nvram, offset: u64, unlocked: Header) {
    assert!(!unlocked.locked());
    let current = Header(mem.load_u64(offset as usize, Ordering::Acquire));
    assert_eq!(
        current,
        unlocked.with_lock(),
        "unlocking an object this transaction did not lock"
    );
    mem.store_u64(offset as usize, unlocked.0, Ordering::Release);
}

/// Applies a committed write at the primary, which holds the lock: payload first, then the new
/// unlocked header (COMMIT-PRIMARY, §4 step 4).
pub fn apply_locked(mem: &Nvram, offset: u64, payload: &[u8], new: Header) {
    let current = Header(mem.load_u64(offset as usize, Ordering::Acquire));
    assert!(
        current.locked(),
        "applying a write to {offset:#x} without its lock"
    );
    assert!(
        new.version() > current.version(),
        "applying version {:?} over {current:?} at {offset:#x}: versions must grow",
        new.version()
    );
    // Seqlock writer: the lock is visible before any payload byte changes.
    fence(Ordering::Release);
    mem.write(offset as usize + HEADER_BYTES, payload);
    mem.store_u64(offset as usize, new.0, Ordering::Release);
}

/// Installs an object version at a backup (at truncation, §4 step 5) or during recovery. Only
/// newer versions are installed; returns whether this one was. Installers of one object may
/// run on several threads (records of different coordinator threads, data recovery): the lock
/// bit, taken by compare-and-swap, orders them, so an older version never overwrites a newer.
pub fn install_at_backup(mem: &Nvram, offset: u64, payload: &[u8], new: Header) -> bool {
    let off = offset as usize;
    loop {
        let current = Header(mem.load_u64(off, Ordering::Acquire));
        if current.locked() {
            std::hint::spin_loop(); // Another installer: a few stores long.
            continue;
        }
        if current.version() >= new.version() && current.0 != 0 {
            return false;
        }
        if mem.cas_u64(off, current.0, new.with_lock().0).is_err() {
            continue;
        }
        fence(Ordering::Release);
        mem.write(off + HEADER_BYTES, payload);
        mem.store_u64(off, new.0, Ordering::Release);
        return true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_bits_are_independent() {
        let h = Header::new(Version(41), true);
        assert!(h.allocated() && !h.locked());
        assert_eq!(h.version(), Version(41));
        let l = h.with_lock();
        assert!(l.locked() && l.allocated() && l.version() == Version(41));
        assert_eq!(l.without_lock(), h);
        let next = h.committed_successor(false);
        assert_eq!(next.version(), Version(42));
        assert!(!next.allocated() && !next.locked());
    }

    #[test]
    fn lock_fails_on_changed_version_or_held_lock() {
        let mem = Nvram::anonymous(64).unwrap();
        let h = Header::new(Version(3), true);
        mem.store_u64(8, h.0, Ordering::Relaxed);
        assert_eq!(try_lock(&mem, 8, Header::new(Version(2), true)), Err(h));
        assert_eq!(try_lock(&mem, 8, h), Ok(()));
        assert_eq!(try_lock(&mem, 8, h), Err(h.with_lock()));
        let mut buf = [0u8; 16];
        assert_eq!(
            read_object(&mem, 8, &mut buf).unwrap(),
            ReadOutcome::Locked(h.with_lock())
        );
        apply_locked(&mem, 8, &7u64.to_le_bytes(), h.committed_successor(true));
        match read_object(&mem, 8, &mut buf).unwrap() {
            ReadOutcome::Consistent(got) => assert_eq!(got.version(), Version(4)),
            other => panic!("{other:?}"),
        }
        assert_eq!(&buf[8..], &7u64.to_le_bytes());
    }

    #[test]
    fn backup_installs_only_newer_versions() {
        let mem = Nvram::anonymous(64).unwrap();
        assert!(install_at_backup(
            &mem,
            0,
            &[1; 8],
            Header::new(Version(2), true)
        ));
        assert!(!install_at_backup(
            &mem,
            0,
            &[9; 8],
            Header::new(Version(1), true)
        ));
        let mut buf = [0u8; 16];
        assert!(matches!(
            read_object(&mem, 0, &mut buf).unwrap(),
            ReadOutcome::Consistent(_)
        ));
        assert_eq!(&buf[8..], &[1; 8]);
    }
}
