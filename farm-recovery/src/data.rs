//! Data recovery (FaRM §5.4): a new backup of a region copies it from the primary block by
//! block (8 KB by default) with one-sided reads, paced so that foreground work is not hurt (an
//! aggressive pace when the region is down to one replica), and installs an object only when
//! its version is newer than the backup's, under the object's lock (so a COMMIT-BACKUP applied
//! meanwhile is never overwritten by older data).
//!
//! A chunk is read twice (the second time only to compare headers): an object whose header was
//! locked or changed between the two reads was being committed, and its chunk is copied again.
//! Block headers come first, so that slots can be found (they are also sent right after
//! NEW-CONFIG-COMMIT, §5.5).

use std::sync::atomic::Ordering;

use farm_alloc::{block_header_offset, slot_bytes_of, BLOCK_BYTES};
use farm_core::fabric::{FabricError, RemoteMemory};
use farm_core::nvram::Nvram;
use farm_core::object::{self, Header, HEADER_BYTES};
use farm_core::RegionId;

/// Pacing and chunking of a copy.
#[derive(Clone, Copy, Debug)]
pub struct CopyParams {
    /// Bytes read per step (8 KB in FaRM), rounded to whole slots.
    pub chunk_bytes: usize,
    /// Ticks between steps (FaRM paces reads; 0 copies as fast as polled).
    pub interval_ticks: u64,
}

impl CopyParams {
    /// The paced default: 8 KB every `interval_ticks`.
    pub fn paced(interval_ticks: u64) -> Self {
        Self {
            chunk_bytes: 8 * 1024,
            interval_ticks,
        }
    }

    /// Aggressive: for a region down to one replica, copy without pauses.
    pub fn aggressive() -> Self {
        Self {
            chunk_bytes: 8 * 1024,
            interval_ticks: 0,
        }
    }
}

/// What a poll did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Progress {
    /// Paced: nothing to do before the next interval.
    Waiting,
    /// Copied a chunk; `installed` objects were newer than the backup's.
    Copied {
        /// Objects installed from this chunk.
        installed: usize,
    },
    /// A chunk held an object being committed; it will be read again.
    Retry,
    /// The whole region is copied.
    Done,
}

/// The copy of one region to this (new backup) machine.
#[derive(Debug)]
pub struct RegionCopy {
    region: RegionId,
    region_bytes: usize,
    params: CopyParams,
    headers_done: bool,
    /// Next block and offset inside it.
    block: u32,
    offset_in_block: usize,
    next_at: u64,
    installed: usize,
    /// Bytes read from the primary's replica so far.
    bytes_read: u64,
    buf: Vec<u8>,
    again: Vec<u8>,
}

impl RegionCopy {
    /// Starts copying `region` (`region_bytes` long).
    pub fn new(region: RegionId, region_bytes: usize, params: CopyParams, now: u64) -> Self {
        assert!(params.chunk_bytes >= 16 && region_bytes.is_multiple_of(BLOCK_BYTES));
        Self {
            region,
            region_bytes,
            params,
            headers_done: false,
            block: 1,
            offset_in_block: 0,
            next_at: now,
            installed: 0,
            bytes_read: 0,
            buf: Vec::new(),
            again: Vec::new(),
        }
    }

    /// The region being copied.
    pub fn region(&self) -> RegionId {
        self.region
    }

    /// Objects installed so far.
    pub fn installed(&self) -> usize {
        self.installed
    }

    /// Bytes read from the primary's replica so far (chunks read twice count twice).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// One paced step: block headers first, then one chunk of objects. `primary` reads the
    /// primary's replica; `local` is this machine's replica.
    pub fn poll(
        &mut self,
        now: u64,
        primary: &dyn RemoteMemory,
        local: &Nvram,
    ) -> Result<Progress, FabricError> {
        let blocks = (self.region_bytes / BLOCK_BYTES) as u32;
        if self.block >= blocks {
            return Ok(Progress::Done);
        }
        if now < self.next_at {
            return Ok(Progress::Waiting);
        }
        self.next_at = now + self.params.interval_ticks;
        if !self.headers_done {
            let mut headers = vec![0u8; blocks as usize * 8];
            primary.read(0, &mut headers)?;
            self.bytes_read += headers.len() as u64;
            for b in 1..blocks {
                let at = block_header_offset(b);
                let word = u64::from_le_bytes(headers[at..at + 8].try_into().expect("8"));
                if word != 0 {
                    local.store_u64(at, word, Ordering::Release);
                }
            }
            self.headers_done = true;
            return Ok(Progress::Copied { installed: 0 });
        }
        let header = local.load_u64(block_header_offset(self.block), Ordering::Acquire);
        let Some(slot) = slot_bytes_of(header).map(|s| s as usize) else {
            // An unused block: nothing to copy.
            self.next_block();
            return Ok(Progress::Copied { installed: 0 });
        };
        let slots_per_chunk = (self.params.chunk_bytes / slot).max(1);
        let start = self.block as usize * BLOCK_BYTES + self.offset_in_block;
        let len = (slots_per_chunk * slot).min(BLOCK_BYTES - self.offset_in_block);
        self.buf.resize(len, 0);
        self.again.resize(len, 0);
        primary.read(start as u64, &mut self.buf)?;
        std::sync::atomic::fence(Ordering::Acquire);
        primary.read(start as u64, &mut self.again)?;
        self.bytes_read += 2 * len as u64;
        let mut installed = 0;
        for s in (0..len).step_by(slot) {
            let h = Header(u64::from_le_bytes(
                self.buf[s..s + 8].try_into().expect("8"),
            ));
            let h2 = Header(u64::from_le_bytes(
                self.again[s..s + 8].try_into().expect("8"),
            ));
            if h.0 == 0 {
                continue; // Never used.
            }
            if h.locked() || h != h2 {
                return Ok(Progress::Retry); // Being committed: read the chunk again later.
            }
            let payload = if h.allocated() {
                &self.buf[s + HEADER_BYTES..s + slot]
            } else {
                &[][..]
            };
            if object::install_at_backup(local, (start + s) as u64, payload, h) {
                installed += 1;
            }
        }
        self.installed += installed;
        self.offset_in_block += len;
        if self.offset_in_block >= BLOCK_BYTES {
            self.next_block();
        }
        Ok(Progress::Copied { installed })
    }

    fn next_block(&mut self) {
        self.block += 1;
        self.offset_in_block = 0;
    }
}
