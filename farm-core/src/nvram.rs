//! Non-volatile memory: the one module of the workspace that touches raw memory.
//!
//! An [`Nvram`] is a word-aligned area backed by a memory-mapped file under an NVRAM directory
//! (sparse; it survives the process, as battery-backed DRAM survives a power loss in FaRM §2) or by
//! anonymous memory when no directory is given. Other machines write into it through the fabric
//! while local workers read it, so nothing here ever hands out `&[u8]` or `&mut [u8]` to its
//! contents: every access is a copy through atomic words, and callers check versions and
//! checksums on what they copied out (docs/ARCHITECTURE.md, Memory and unsafe).
//!
//! Ordering contract, which the object layer's seqlock reads and the ring buffers' trailers rely
//! on:
//! - [`Nvram::read`] loads every word with `Acquire`;
//! - [`Nvram::write`] stores words in increasing address order, `Relaxed` except the last word,
//!   which is stored with `Release`, so a reader that sees the last word of a write also sees the
//!   rest of it.
//!
//! It is also the one module of the protocol crates that opens, maps and writes files (their
//! `clippy.toml` refuses them everywhere else).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use std::fs::OpenOptions;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapMut, MmapOptions};

/// Word size of every NVRAM access.
pub const WORD_BYTES: usize = 8;

/// A transparent huge page (x86-64).
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// A mapped NVRAM area. Cloning is by `Arc`; the mapping lives as long as its last holder.
pub struct Nvram {
    // Kept for its `Drop` (unmap); all access goes through `base`.
    _map: MmapMut,
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is only accessed through atomic operations on aligned words (see `word`),
// so concurrent access from many threads is free of data races; the pointer stays valid as long
// as `_map` lives, which is as long as `self`.
unsafe impl Send for Nvram {}
// SAFETY: as for `Send`: shared access is only ever atomic.
unsafe impl Sync for Nvram {}

impl std::fmt::Debug for Nvram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvram").field("len", &self.len).finish()
    }
}

impl Nvram {
    /// Zeroed anonymous memory of `len` bytes (rounded up to a word). Pages are allocated lazily,
    /// so a large region costs only what is touched (in 2 MB steps: mappings of at least a huge
    /// page ask for transparent huge pages, as FaRM maps its regions with 2 GB pages to spare
    /// the TLB, §3; TPC-C touches objects and backup copies at random over hundreds of
    /// megabytes, and ran 4-5% faster with them, for about a third more resident memory).
    pub fn anonymous(len: usize) -> io::Result<Self> {
        let len = round_up(len.max(WORD_BYTES), WORD_BYTES);
        let mut map = MmapOptions::new().len(len).map_anon()?;
        if len >= HUGE_PAGE_BYTES {
            // Only advice: where the kernel has no transparent huge pages, 4 KB pages serve.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        let base = map.as_mut_ptr();
        Ok(Self {
            _map: map,
            base,
            len,
        })
    }

    /// Maps `path` as `len` bytes, creating a sparse zeroed file if it does not exist. An existing
    /// file keeps its contents (this is how a restarted machine finds its NVRAM again); it must
    /// have exactly `len` bytes.
    pub fn file(path: &Path, len: usize) -> io::Result<Self> {
        let len = round_up(len.max(WORD_BYTES), WORD_BYTES);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let existing = file.metadata()?.len();
        if existing == 0 {
            file.set_len(len as u64)?;
        } else if existing != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "NVRAM file {} has {existing} bytes, expected {len}",
                    path.display()
                ),
            ));
        }
        Self::map_file(&file, len)
    }

    /// Maps `len` bytes of `file`, shared with every process that maps it.
    fn map_file(file: &std::fs::File, len: usize) -> io::Result<Self> {
        // SAFETY: NVRAM files live under a cluster's NVRAM directory; every process that maps
        // one (its machine's, or a peer on the `shm` fabric) follows the same atomic-access
        // discipline, so the usual hazard of a file changing under a mapping is the intended
        // shared-memory semantics here.
        let mut map = unsafe { MmapOptions::new().len(len).map_mut(file)? };
        // No read-ahead: regions, logs and queues are touched a word or an object at a time, and
        // the kernel's read-ahead of a sparse file zeroes a whole window of page cache at each
        // fault. With thousands of regions that window is most of the machine's memory, pages
        // are evicted and faulted again, and a 4,096-region cluster spent a minute in memset
        // during lock recovery (long enough for its leases to expire). Only advice.
        let _ = map.advise(memmap2::Advice::Random);
        let base = map.as_mut_ptr();
        Ok(Self {
            _map: map,
            base,
            len,
        })
    }

    /// Maps an existing NVRAM file at its size, never creating one: how a peer process maps
    /// another machine's registered memory on the `shm` fabric.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len() as usize;
        if len == 0 || !len.is_multiple_of(WORD_BYTES) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("NVRAM file {} has {len} bytes", path.display()),
            ));
        }
        Self::map_file(&file, len)
    }

    /// Writes the mapping back to its file and waits (`msync`): what a power cut with warning
    /// (a UPS that signals) must not lose, since memory-mapped files are otherwise written back
    /// whenever the kernel chooses. Nothing to do for anonymous memory.
    pub fn flush(&self) -> std::io::Result<()> {
        self._map.flush()
    }

    /// The mapping's first byte, for registering it with an RDMA device
    /// (`farm_fabric::verbs`), which then reads and writes it directly, as peers' one-sided
    /// operations do through the other fabrics.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the area is empty (never, by construction; for clippy's sake).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The atomic word at `offset`.
    ///
    /// Panics when `offset` is unaligned or the word is out of bounds: a caller that computes a
    /// bad offset has a bug.
    fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset.is_multiple_of(WORD_BYTES) && offset + WORD_BYTES <= self.len,
            "NVRAM access at {offset} outside 0..{} or unaligned",
            self.len
        );
        // SAFETY: `offset` is in bounds and 8-aligned (checked above; the mapping is page
        // aligned), the mapping lives as long as `&self`, and every access to this memory is
        // atomic, so creating a shared reference to an `AtomicU64` there is sound.
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }
    }

    /// Loads the word at `offset`.
    pub fn load_u64(&self, offset: usize, order: Ordering) -> u64 {
        self.word(offset).load(order)
    }

    /// Stores the word at `offset`.
    pub fn store_u64(&self, offset: usize, value: u64, order: Ordering) {
        self.word(offset).store(value, order)
    }

    /// Compare-and-swap of the word at `offset` (`AcqRel`). Returns the previous value in `Ok` on
    /// success and the current value in `Err` on failure.
    pub fn cas_u64(&self, offset: usize, current: u64, new: u64) -> Result<u64, u64> {
        self.word(offset)
            .compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }

    /// Adds `value` to the word at `offset` (`AcqRel`); returns the previous value.
    pub fn fetch_add_u64(&self, offset: usize, value: u64) -> u64 {
        self.word(offset).fetch_add(value, Ordering::AcqRel)
    }

    /// Subtracts `value` from the word at `offset` (`AcqRel`); returns the previous value.
    pub fn fetch_sub_u64(&self, offset: usize, value: u64) -> u64 {
        self.word(offset).fetch_sub(value, Ordering::AcqRel)
    }

    /// Sleeps while the low 32 bits of the word at `offset` are `expected`, at most `timeout`:
    /// a futex on the mapping, which every process mapping the same file shares, so that
    /// [`Nvram::futex_wake`] from any of them ends the wait. Returns early on any change,
    /// wake-up or signal.
    pub fn futex_wait(&self, offset: usize, expected: u32, timeout: std::time::Duration) {
        let word = self.word(offset) as *const AtomicU64 as *const u32;
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `word` is the 8-aligned in-bounds word checked by `word()` (its low half on
        // this little-endian target), valid while `&self` lives; FUTEX_WAIT only reads it. A
        // shared (not private) futex, since other processes wait on and wake the same file.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word,
                libc::FUTEX_WAIT,
                expected,
                &ts as *const libc::timespec,
            );
        }
    }

    /// Wakes every waiter of [`Nvram::futex_wait`] on the word at `offset`.
    pub fn futex_wake(&self, offset: usize) {
        let word = self.word(offset) as *const AtomicU64 as *const u32;
        // SAFETY: as in `futex_wait`; FUTEX_WAKE does not touch the memory.
        unsafe {
            libc::syscall(libc::SYS_futex, word, libc::FUTEX_WAKE, i32::MAX);
        }
    }

    /// Copies `buf.len()` bytes starting at the word-aligned `offset` into `buf`, loading whole
    /// words with `Acquire`.
    pub fn read(&self, offset: usize, buf: &mut [u8]) {
        self.check_range(offset, buf.len());
        let words = self.words(offset, buf.len().div_ceil(WORD_BYTES));
        let mut chunks = buf.chunks_exact_mut(WORD_BYTES);
        for (chunk, word) in (&mut chunks).zip(words) {
            chunk.copy_from_slice(&word.load(Ordering::Acquire).to_le_bytes());
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let word = words[words.len() - 1].load(Ordering::Acquire).to_le_bytes();
            tail.copy_from_slice(&word[..tail.len()]);
        }
    }

    /// Copies `data` to the word-aligned `offset`, in increasing address order; the last word is
    /// stored with `Release`. A partial last word is merged with a compare-and-swap so that the
    /// bytes after the write keep their value.
    pub fn write(&self, offset: usize, data: &[u8]) {
        self.check_range(offset, data.len());
        let words = self.words(offset, data.len().div_ceil(WORD_BYTES));
        let Some((last, body)) = words.split_last() else {
            return;
        };
        let mut chunks = data.chunks_exact(WORD_BYTES);
        for (chunk, word) in (&mut chunks).zip(body) {
            let v = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            word.store(v, Ordering::Relaxed);
        }
        let tail = chunks.remainder();
        if tail.is_empty() {
            // The last whole word (the iterator above stopped one short of it).
            let at = data.len() - WORD_BYTES;
            let v = u64::from_le_bytes(data[at..].try_into().expect("8 bytes"));
            last.store(v, Ordering::Release);
        } else {
            let mask = (1u64 << (8 * tail.len())) - 1;
            let mut bytes = [0u8; WORD_BYTES];
            bytes[..tail.len()].copy_from_slice(tail);
            let value = u64::from_le_bytes(bytes);
            let _ = last.fetch_update(Ordering::Release, Ordering::Relaxed, |old| {
                Some((old & !mask) | value)
            });
        }
    }

    /// Zeroes `len` bytes (a whole number of words) at the word-aligned `offset`.
    pub fn zero(&self, offset: usize, len: usize) {
        self.check_range(offset, len);
        assert!(
            len.is_multiple_of(WORD_BYTES),
            "zeroing a partial word ({len} bytes)"
        );
        for word in self.words(offset, len / WORD_BYTES) {
            word.store(0, Ordering::Relaxed);
        }
        std::sync::atomic::fence(Ordering::Release);
    }

    /// Asks the CPU to bring the cache lines of `offset..offset + len` closer, without waiting:
    /// a thread about to touch several cold objects overlaps their misses by prefetching them
    /// all first. Only a hint: out-of-range bytes are ignored and nothing is read.
    pub fn prefetch(&self, offset: usize, len: usize) {
        const LINE: usize = 64;
        let end = offset.saturating_add(len).min(self.len);
        let mut at = offset - offset % LINE;
        while at < end {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch never faults nor reads into the program; the address is inside
            // the mapping (`at < end <= len`).
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>(self.base.add(at) as *const i8);
            }
            at += LINE;
        }
    }

    /// The `n` words from the word-aligned `offset`, which the caller checked are inside.
    fn words(&self, offset: usize, n: usize) -> &[AtomicU64] {
        debug_assert!(offset.is_multiple_of(WORD_BYTES) && offset + n * WORD_BYTES <= self.len);
        // SAFETY: the range is inside the mapping (checked by the caller), word-aligned (the
        // mapping is page-aligned and the offset a multiple of 8), and every access to the
        // mapping goes through atomics.
        unsafe { std::slice::from_raw_parts(self.base.add(offset) as *const AtomicU64, n) }
    }

    fn check_range(&self, offset: usize, len: usize) {
        assert!(
            offset.is_multiple_of(WORD_BYTES)
                && offset.checked_add(len).is_some_and(|end| end <= self.len),
            "NVRAM range {offset}+{len} outside 0..{} or unaligned",
            self.len
        );
    }
}

/// Rounds `n` up to a multiple of `to` (a power of two).
pub const fn round_up(n: usize, to: usize) -> usize {
    (n + to - 1) & !(to - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_past_the_end_is_clamped_and_changes_nothing() {
        // Ranges past the end, up to overflowing the address arithmetic: ignored, no panic.
        let nv = Nvram::anonymous(4096).unwrap();
        let data: Vec<u8> = (0..64).collect();
        nv.write(4096 - 64, &data);
        nv.prefetch(4096 - 64, 1 << 20);
        nv.prefetch(usize::MAX - 8, 64);
        let mut back = [0u8; 64];
        nv.read(4096 - 64, &mut back);
        assert_eq!(&back[..], &data[..]);
    }

    /// A futex wait on one mapping of a file ends when another mapping of it (as another
    /// process has) changes the word and wakes it: the shm fabric's doorbell. The wait's
    /// timeout is an hour, so the test ends only through the wake-up (or the change, if it
    /// came first).
    #[test]
    fn a_futex_wait_on_one_mapping_is_woken_through_another() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bell");
        let waiter = Nvram::file(&path, 16).unwrap();
        let waker = Nvram::open(&path).unwrap();
        std::thread::scope(|s| {
            let w = s.spawn(|| {
                while waiter.load_u64(0, Ordering::Acquire) == 0 {
                    waiter.futex_wait(0, 0, std::time::Duration::from_secs(3600));
                }
                waiter.load_u64(0, Ordering::Acquire)
            });
            waker.fetch_add_u64(0, 1);
            waker.futex_wake(0);
            assert_eq!(w.join().unwrap(), 1);
        });
        // A wait for a value the word no longer has returns at once.
        waiter.futex_wait(0, 0, std::time::Duration::from_secs(3600));
        assert_eq!(waker.fetch_sub_u64(0, 1), 1);
    }

    #[test]
    fn anonymous_memory_starts_zeroed_and_round_trips() {
        let nv = Nvram::anonymous(100).unwrap();
        assert_eq!(nv.len(), 104);
        let mut buf = [0xffu8; 13];
        nv.read(8, &mut buf);
        assert_eq!(buf, [0u8; 13]);
        let data: Vec<u8> = (1..=13).collect();
        nv.write(8, &data);
        nv.read(8, &mut buf);
        assert_eq!(&buf[..], &data[..]);
    }

    #[test]
    fn partial_word_write_keeps_following_bytes() {
        let nv = Nvram::anonymous(64).unwrap();
        nv.store_u64(0, u64::MAX, Ordering::Relaxed);
        nv.write(0, &[1, 2, 3]);
        assert_eq!(
            nv.load_u64(0, Ordering::Relaxed),
            u64::from_le_bytes([1, 2, 3, 255, 255, 255, 255, 255])
        );
    }

    #[test]
    fn cas_reports_current_value_on_failure() {
        let nv = Nvram::anonymous(64).unwrap();
        assert_eq!(nv.cas_u64(16, 0, 5), Ok(0));
        assert_eq!(nv.cas_u64(16, 0, 6), Err(5));
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn out_of_bounds_access_panics() {
        let nv = Nvram::anonymous(64).unwrap();
        nv.write(60, &[0; 8]);
    }

    #[test]
    fn file_backed_memory_survives_remapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        {
            let nv = Nvram::file(&path, 4096).unwrap();
            nv.write(64, b"persist!");
        }
        let nv = Nvram::file(&path, 4096).unwrap();
        let mut buf = [0u8; 8];
        nv.read(64, &mut buf);
        assert_eq!(&buf, b"persist!");
        let err = Nvram::file(&path, 8192).unwrap_err();
        assert!(err.to_string().contains("expected 8192"), "{err}");
    }
}

/// The small files that sit beside a machine's mapped areas in its NVRAM directory (its views,
/// the regions it has still to copy). They go through here so that the protocol crates touch
/// no file themselves: each is written whole, synced and renamed into place, so that a stop at
/// any moment leaves the old contents or the new.
pub mod files {
    use std::io;
    use std::path::Path;

    /// Creates `dir` (and its parents) if it is missing.
    pub fn create_dir(dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }

    /// Replaces `dir/name` with `bytes`: written to `name.new`, synced, renamed.
    pub fn replace(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
        let tmp = dir.join(format!("{name}.new"));
        let mut f = std::fs::File::create(&tmp)?;
        io::Write::write_all(&mut f, bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(name))
    }

    /// The contents of `dir/name`; `None` when there is no such file.
    pub fn read(dir: &Path, name: &str) -> io::Result<Option<Vec<u8>>> {
        match std::fs::read(dir.join(name)) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Sets the length of the existing file `dir/name` to `len` bytes, in place (the same file
    /// for whoever mapped it): for an area whose contents are rewritten at every start and
    /// whose layout grew.
    pub fn resize(dir: &Path, name: &str, len: u64) -> io::Result<()> {
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(name))?
            .set_len(len)
    }

    /// Removes `dir/name`; nothing to do when there is no such file.
    pub fn remove(dir: &Path, name: &str) -> io::Result<()> {
        match std::fs::remove_file(dir.join(name)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// The names of the files in `dir`, sorted; none when `dir` does not exist.
    pub fn names(dir: &Path) -> io::Result<Vec<String>> {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut names = Vec::new();
        for entry in entries {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }
}
