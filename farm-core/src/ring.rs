//! Ring buffers: transaction logs and message queues (FaRM §3; Tailwind §3.1).
//!
//! Each (sender machine, thread t) -> (receiver machine, thread t) pair has one log and one
//! message queue, both in the receiver's NVRAM ([`RingLayout`]). The sender appends with one-sided
//! writes at its tail ([`RingWriter`] keeps the sender's view); the receiver polls at its head
//! ([`RingReader`]) and lazily tells the sender, by a one-sided write into the sender's feedback
//! slot, how far it has freed.
//!
//! Framing: a record is `[len: u32][payload][padding][crc32c: u32]`, `len` a multiple of 8 and the
//! trailer in the record's last 4 bytes. Buffers are pre-zeroed and the receiver re-zeroes what it
//! frees, so a record is complete exactly when its trailer is non-zero and matches the crc32c of
//! everything before it: a torn append (the sender died mid-write; writes land in address order)
//! is never accepted. Records never wrap: a skip marker (`len` with [`SKIP_FLAG`], trailer right
//! after it) pads to the end of the buffer.
//!
//! Restart: a receiver keeps its head (how far it freed) in a word of its own NVRAM, stored
//! before the freed bytes are zeroed, and a sender never fills the last word of a ring. A
//! restarted receiver ([`RingReader::resume`]) therefore finds its live records from the head
//! word to the first incomplete one, and everything after them up to the head word's lap is
//! garbage to zero (a torn append, or a batch whose zeroing the stop interrupted). Space is
//! freed in order, so a record released while an older one is still held stays readable until
//! that one goes; a reader that must not see such a record again after a restart marks it
//! released ([`RingReader::mark_released`]: its first word becomes `len` with
//! [`RELEASED_FLAG`] and a trailer, which a resumed reader skips).

use std::collections::VecDeque;
use std::sync::Arc;

use crate::ids::{MachineId, ThreadId};
use crate::nvram::{round_up, Nvram};

/// Set in the length word of a skip marker.
pub const SKIP_FLAG: u32 = 1 << 31;
/// Set in the length word of a record released while an older one was held
/// ([`RingReader::mark_released`]).
pub const RELEASED_FLAG: u32 = 1 << 30;
/// Framing overhead: length word and trailer.
pub const FRAME_BYTES: usize = 8;
/// A skip marker is one framing word pair.
pub const SKIP_BYTES: usize = 8;
/// Bytes of every ring a sender leaves unused.
pub const RING_SLACK_BYTES: usize = 8;

/// Which ring of a pair.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RingKind {
    /// The transaction log (LOCK, COMMIT-BACKUP, COMMIT-PRIMARY, ABORT, TRUNCATE).
    Log = 0,
    /// The message queue (LOCK-REPLY, VALIDATE, ...).
    Queue = 1,
}

/// Where rings and feedback slots live, identical on every machine of a cluster.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RingLayout {
    /// Machine ids are below this.
    pub machines_max: u16,
    /// Worker threads per machine.
    pub threads: u16,
    /// Bytes of each transaction log.
    pub log_bytes: usize,
    /// Bytes of each message queue.
    pub queue_bytes: usize,
}

impl RingLayout {
    /// Checks the sizes: multiples of 8, large enough for a few maximal records.
    pub fn validate(&self, record_bytes_max: usize) -> Result<(), String> {
        for (name, bytes) in [("log", self.log_bytes), ("queue", self.queue_bytes)] {
            if bytes % 8 != 0 {
                return Err(format!("{name} size {bytes} is not a multiple of 8"));
            }
            if bytes < 4 * record_bytes_max {
                return Err(format!(
                    "{name} size {bytes} is below 4 maximal records ({record_bytes_max} bytes each)"
                ));
            }
        }
        Ok(())
    }

    /// Size of the rings area of one machine (all inbound rings).
    pub fn rings_area_bytes(&self) -> usize {
        self.machines_max as usize * self.threads as usize * (self.log_bytes + self.queue_bytes)
    }

    /// Size of the feedback area of one machine.
    pub fn feedback_area_bytes(&self) -> usize {
        self.machines_max as usize * self.threads as usize * 2 * 8
    }

    /// Offset, inside the receiver's rings area, of the ring from `sender` on `thread`.
    pub fn ring_offset(&self, sender: MachineId, thread: ThreadId, kind: RingKind) -> usize {
        let pair = sender.0 as usize * self.threads as usize + thread.0 as usize;
        pair * (self.log_bytes + self.queue_bytes)
            + if kind == RingKind::Queue {
                self.log_bytes
            } else {
                0
            }
    }

    /// Capacity of a ring of `kind`.
    pub fn ring_bytes(&self, kind: RingKind) -> usize {
        match kind {
            RingKind::Log => self.log_bytes,
            RingKind::Queue => self.queue_bytes,
        }
    }

    /// Offset, inside the sender's feedback area, of the slot the `receiver` writes for `kind`.
    pub fn feedback_offset(&self, receiver: MachineId, thread: ThreadId, kind: RingKind) -> usize {
        ((receiver.0 as usize * self.threads as usize + thread.0 as usize) * 2 + kind as usize) * 8
    }
}

fn trailer(bytes: &[u8]) -> u32 {
    match crc32c::crc32c(bytes) {
        0 => u32::MAX,
        crc => crc,
    }
}

/// Frames `payload` into `out` (cleared first): the exact bytes to append.
pub fn frame(payload: &[u8], out: &mut Vec<u8>) {
    frame_with(out, |o| o.extend_from_slice(payload));
}

/// Frames into `out` (cleared first) the payload `encode` appends to it, encoded where it is
/// framed: [`frame`] without its copy of the payload.
pub fn frame_with(out: &mut Vec<u8>, encode: impl FnOnce(&mut Vec<u8>)) {
    out.clear();
    out.extend_from_slice(&[0; 4]);
    encode(out);
    let len = framed_len(out.len() - 4);
    out[..4].copy_from_slice(&(len as u32).to_le_bytes());
    out.resize(len - 4, 0);
    let t = trailer(out);
    out.extend_from_slice(&t.to_le_bytes());
}

/// Length on the ring of a record with `payload_len` payload bytes.
pub const fn framed_len(payload_len: usize) -> usize {
    round_up(payload_len + FRAME_BYTES, 8)
}

/// The bytes of a skip marker covering `len` bytes.
pub fn skip_marker(len: usize) -> [u8; SKIP_BYTES] {
    let word = (len as u32) | SKIP_FLAG;
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&word.to_le_bytes());
    let t = trailer(&out[..4]);
    out[4..].copy_from_slice(&t.to_le_bytes());
    out
}

/// Where a sender writes one record: an optional skip marker, then the record.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Placement {
    /// Offset (in the ring) and length of a skip marker to write first.
    pub skip: Option<(usize, usize)>,
    /// Offset (in the ring) of the record.
    pub offset: usize,
}

/// The sender's view of one remote ring: its tail, the head last reported by the receiver, and
/// reservations (FaRM §4: log space for every record of a commit is reserved before it starts).
#[derive(Clone, Debug)]
pub struct RingWriter {
    capacity: usize,
    tail: u64,
    head: u64,
    reserved: usize,
}

impl RingWriter {
    /// A writer for an empty ring of `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        assert!(
            capacity.is_multiple_of(8) && capacity >= 64,
            "ring capacity {capacity}"
        );
        Self {
            capacity,
            tail: 0,
            head: 0,
            reserved: 0,
        }
    }

    /// Records the receiver's feedback: it has freed everything before `head`.
    pub fn update_head(&mut self, head: u64) {
        assert!(
            head <= self.tail,
            "receiver freed past the tail ({head} > {})",
            self.tail
        );
        self.head = self.head.max(head);
    }

    /// Resumes writing a ring whose receiver freed everything before `head` and holds records
    /// up to `tail` (what [`RingReader::resume`] found).
    pub fn resume(capacity: usize, head: u64, tail: u64) -> Self {
        let mut w = Self::new(capacity);
        assert!(
            head <= tail && tail - head < capacity as u64,
            "resumed ring {head}..{tail} does not fit {capacity} bytes"
        );
        w.head = head;
        w.tail = tail;
        w
    }

    /// Bytes neither used nor reserved. The last word of the ring is never used (see the
    /// module docs: it keeps a restarted receiver from reading the previous lap's bytes as the
    /// next record).
    pub fn free_bytes(&self) -> usize {
        (self.capacity - RING_SLACK_BYTES)
            .saturating_sub((self.tail - self.head) as usize + self.reserved)
    }

    /// Bytes to reserve for a record of `len` framed bytes: the record and the worst skip.
    pub const fn reservation(len: usize) -> usize {
        2 * len
    }

    /// Reserves `bytes`; false (and nothing reserved) when there is not enough free space.
    pub fn reserve(&mut self, bytes: usize) -> bool {
        if bytes <= self.free_bytes() {
            self.reserved += bytes;
            true
        } else {
            false
        }
    }

    /// Returns an unused reservation.
    pub fn unreserve(&mut self, bytes: usize) {
        assert!(bytes <= self.reserved, "unreserving more than reserved");
        self.reserved -= bytes;
    }

    /// Places a record of `len` framed bytes, consuming `reserved` bytes of reservation (0 to use
    /// free space). Returns `None` when it does not fit; a placement otherwise, whose bytes the
    /// caller must write in order (skip marker first).
    pub fn place(&mut self, len: usize, reserved: usize) -> Option<Placement> {
        assert!(
            len.is_multiple_of(8) && len >= FRAME_BYTES && len <= self.capacity / 2,
            "record length {len}"
        );
        let at = (self.tail % self.capacity as u64) as usize;
        let waste = if at + len > self.capacity {
            self.capacity - at
        } else {
            0
        };
        self.unreserve(reserved);
        if waste + len > self.free_bytes() {
            self.reserved += reserved;
            return None;
        }
        let skip = (waste > 0).then_some((at, waste));
        self.tail += (waste + len) as u64;
        // Whatever the reservation did not need goes back to free space.
        Some(Placement {
            skip,
            offset: if waste > 0 { 0 } else { at },
        })
    }

    /// The tail position (monotonic byte count).
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// The head position the receiver last reported.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Bytes written but not yet reported free, plus bytes reserved: zero for an idle ring whose
    /// receiver has caught up.
    pub fn in_use(&self) -> usize {
        (self.tail - self.head) as usize + self.reserved
    }
}

/// One record polled from a ring; give it back with [`RingReader::release`] once it is done
/// (truncated, for a log; processed, for a queue).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct RecordPos(pub u64);

/// The word in the receiver's NVRAM where a reader keeps its head.
#[derive(Clone, Debug)]
pub struct HeadWord {
    /// The memory holding it.
    pub mem: Arc<Nvram>,
    /// Its offset.
    pub offset: usize,
}

/// A valid frame on a ring, with its length.
enum Framed {
    Skip(usize),
    Record(usize),
}

/// The receiver's side of one ring in its own NVRAM.
#[derive(Debug)]
pub struct RingReader {
    mem: Arc<Nvram>,
    base: usize,
    capacity: usize,
    next: u64,
    freed: u64,
    head_word: Option<HeadWord>,
    /// Polled records not yet fully freed: (start, end, released). Bounded by capacity / 8.
    live: VecDeque<(u64, u64, bool)>,
    /// See [`RingReader::mark_released`].
    mark_released: bool,
}

impl RingReader {
    /// A reader of the ring at `base..base + capacity` of `mem`, which must be zeroed, keeping
    /// no head word.
    pub fn new(mem: Arc<Nvram>, base: usize, capacity: usize) -> Self {
        assert!(
            base.is_multiple_of(8)
                && capacity.is_multiple_of(8)
                && capacity < RELEASED_FLAG as usize
                && base + capacity <= mem.len()
        );
        Self {
            mem,
            base,
            capacity,
            next: 0,
            freed: 0,
            head_word: None,
            live: VecDeque::new(),
            mark_released: false,
        }
    }

    /// From now on, a record released while an older one is still held is marked released in
    /// the ring, so that a restarted reader ([`RingReader::resume`]) skips it instead of
    /// reading it again as live. For rings whose records must not count twice across a
    /// restart once processed (message queues whose slots may be held, see
    /// `farm_txn::recovery_log`).
    pub fn mark_released(mut self) -> Self {
        self.mark_released = true;
        self
    }

    /// Keeps the head in `head` from now on (a reader of a fresh ring: the word is zero).
    pub fn with_head_word(mut self, head: HeadWord) -> Self {
        self.head_word = Some(head);
        self
    }

    /// A reader of a ring that may hold records from before a restart: it starts at the
    /// position in `head` (which it keeps up to date from now on), keeps the complete records
    /// that follow it, and zeroes every other byte of the ring (torn appends, interrupted
    /// zeroing). Returns the reader and the tail, the position after the records kept, where
    /// the sender goes on.
    pub fn resume(mem: Arc<Nvram>, base: usize, capacity: usize, head: HeadWord) -> (Self, u64) {
        let mut r = Self::new(mem, base, capacity);
        let start = head
            .mem
            .load_u64(head.offset, std::sync::atomic::Ordering::Acquire);
        r.next = start;
        r.freed = start;
        r.head_word = Some(head);
        let mut tail = start;
        let mut buf = Vec::new();
        while let Some(Framed::Skip(len) | Framed::Record(len)) = r.framed_at(tail, &mut buf) {
            if tail + len as u64 - start >= capacity as u64 {
                break; // The last word is never used: this is the previous lap.
            }
            tail += len as u64;
        }
        // Everything from the tail to the head's next lap is garbage or already zero.
        let cap = capacity as u64;
        let mut at = tail;
        while at < start + cap {
            let off = base + (at % cap) as usize;
            if r.mem.load_u64(off, std::sync::atomic::Ordering::Relaxed) != 0 {
                r.mem
                    .store_u64(off, 0, std::sync::atomic::Ordering::Relaxed);
            }
            at += 8;
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        (r, tail)
    }

    /// What lies at position `pos`: a valid skip marker, or a complete record (copied, framing
    /// included, into `buf`), or `None`.
    fn framed_at(&self, pos: u64, buf: &mut Vec<u8>) -> Option<Framed> {
        let at = (pos % self.capacity as u64) as usize;
        let first = self
            .mem
            .load_u64(self.base + at, std::sync::atomic::Ordering::Acquire);
        let len_word = first as u32;
        if len_word == 0 {
            return None;
        }
        if len_word & SKIP_FLAG != 0 {
            let len = (len_word & !SKIP_FLAG) as usize;
            let ok = (first >> 32) as u32 == trailer(&len_word.to_le_bytes())
                && len == self.capacity - at;
            return ok.then_some(Framed::Skip(len));
        }
        if len_word & RELEASED_FLAG != 0 {
            // A record released out of order: skipped like padding.
            let len = (len_word & !RELEASED_FLAG) as usize;
            let ok = (first >> 32) as u32 == trailer(&len_word.to_le_bytes())
                && len.is_multiple_of(8)
                && len >= FRAME_BYTES
                && at + len <= self.capacity;
            return ok.then_some(Framed::Skip(len));
        }
        let len = len_word as usize;
        if !len.is_multiple_of(8) || len < FRAME_BYTES || at + len > self.capacity {
            return None;
        }
        let last = self.mem.load_u64(
            self.base + at + len - 8,
            std::sync::atomic::Ordering::Acquire,
        );
        let stored = (last >> 32) as u32;
        if stored == 0 {
            return None;
        }
        buf.clear();
        buf.resize(len, 0);
        self.mem.read(self.base + at, buf);
        (trailer(&buf[..len - 4]) == stored).then_some(Framed::Record(len))
    }

    /// Polls the head: copies the next complete record's payload (with its padding) into `buf`
    /// and returns its position, or `None` when no complete record is there.
    pub fn poll(&mut self, buf: &mut Vec<u8>) -> Option<RecordPos> {
        loop {
            let start = self.next;
            match self.framed_at(start, buf)? {
                Framed::Skip(len) => {
                    self.next += len as u64;
                    self.live.push_back((start, self.next, true));
                    self.advance_freed();
                }
                Framed::Record(len) => {
                    buf.truncate(len - 4);
                    buf.drain(..4);
                    self.next += len as u64;
                    self.live.push_back((start, self.next, false));
                    return Some(RecordPos(start));
                }
            }
        }
    }

    /// Frees a polled record. Space is reclaimed (and re-zeroed) up to the oldest record that is
    /// still held, so records may be released in any order.
    pub fn release(&mut self, pos: RecordPos) {
        let idx = self
            .live
            .binary_search_by_key(&pos.0, |e| e.0)
            .unwrap_or_else(|_| panic!("releasing record {} that is not live", pos.0));
        assert!(!self.live[idx].2, "record {} released twice", pos.0);
        self.live[idx].2 = true;
        if idx > 0 && self.mark_released {
            // Not freed (zeroed) until the older records go: mark it, trailer included, so
            // that a restart skips it.
            let (start, end, _) = self.live[idx];
            let word = ((end - start) as u32) | RELEASED_FLAG;
            let marker = u64::from(word) | u64::from(trailer(&word.to_le_bytes())) << 32;
            let at = (start % self.capacity as u64) as usize;
            // One aligned word: a stop leaves the record or the marker, never half of each.
            self.mem
                .store_u64(self.base + at, marker, std::sync::atomic::Ordering::Release);
        }
        self.advance_freed();
    }

    fn advance_freed(&mut self) {
        let from = self.freed;
        while let Some(&(start, end, true)) = self.live.front() {
            debug_assert_eq!(start, self.freed);
            self.freed = end;
            self.live.pop_front();
        }
        if self.freed == from {
            return;
        }
        // The head word first: a stop in the middle of zeroing leaves garbage only behind it.
        if let Some(h) = &self.head_word {
            h.mem
                .store_u64(h.offset, self.freed, std::sync::atomic::Ordering::Release);
        }
        let cap = self.capacity as u64;
        let mut at = from;
        while at < self.freed {
            let off = (at % cap) as usize;
            let len = ((self.capacity - off) as u64).min(self.freed - at) as usize;
            self.mem.zero(self.base + off, len);
            at += len as u64;
        }
    }

    /// Everything before this position is free (what the sender is told).
    pub fn freed(&self) -> u64 {
        self.freed
    }

    /// The position after the last record polled.
    pub fn polled(&self) -> u64 {
        self.next
    }

    /// Number of polled records not yet freed.
    pub fn held(&self) -> usize {
        self.live.iter().filter(|e| !e.2).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn append(mem: &Nvram, base: usize, w: &mut RingWriter, payload: &[u8]) -> bool {
        let mut framed = Vec::new();
        frame(payload, &mut framed);
        let Some(p) = w.place(framed.len(), 0) else {
            return false;
        };
        if let Some((at, len)) = p.skip {
            mem.write(base + at, &skip_marker(len));
        }
        mem.write(base + p.offset, &framed);
        true
    }

    #[test]
    fn records_round_trip_and_wrap_with_skip_markers() {
        let mem = Arc::new(Nvram::anonymous(256).unwrap());
        let mut w = RingWriter::new(256);
        let mut r = RingReader::new(mem.clone(), 0, 256);
        let mut buf = Vec::new();
        for i in 0..50u8 {
            let payload = vec![i; 20 + (i as usize % 30)];
            assert!(append(&mem, 0, &mut w, &payload), "append {i}");
            let pos = r.poll(&mut buf).expect("record");
            assert_eq!(&buf[..payload.len()], &payload[..]);
            assert!(r.poll(&mut buf).is_none());
            r.release(pos);
            w.update_head(r.freed());
        }
        assert!(w.tail() > 256, "the ring wrapped");
    }

    #[test]
    fn full_ring_refuses_until_freed_out_of_order() {
        let mem = Arc::new(Nvram::anonymous(128).unwrap());
        let mut w = RingWriter::new(128);
        let mut r = RingReader::new(mem.clone(), 0, 128);
        let mut buf = Vec::new();
        assert!(append(&mem, 0, &mut w, &[1; 24]));
        assert!(append(&mem, 0, &mut w, &[2; 24]));
        assert!(append(&mem, 0, &mut w, &[3; 24]));
        assert!(
            !append(&mem, 0, &mut w, &[4; 24]),
            "ring is full (its last word stays unused)"
        );
        let a = r.poll(&mut buf).unwrap();
        let b = r.poll(&mut buf).unwrap();
        r.release(b);
        assert_eq!(r.freed(), 0, "b is freed only after a");
        r.release(a);
        assert_eq!(r.freed(), 64);
        w.update_head(r.freed());
        assert!(append(&mem, 0, &mut w, &[4; 24]));
    }

    #[test]
    fn reservations_hold_space() {
        let mut w = RingWriter::new(128 + RING_SLACK_BYTES);
        assert!(w.reserve(RingWriter::reservation(32)));
        assert!(w.reserve(RingWriter::reservation(32)));
        assert!(!w.reserve(8), "everything is reserved");
        assert!(w.place(32, RingWriter::reservation(32)).is_some());
        assert_eq!(w.free_bytes(), 128 - 32 - 64);
    }

    /// Tailwind §3.1: a record cut at any byte offset is never accepted (the buffer was zeroed).
    #[test]
    fn torn_record_at_every_offset_is_never_accepted() {
        let payload: Vec<u8> = (0..61u8).map(|i| i.wrapping_mul(37) | 1).collect();
        let mut framed = Vec::new();
        frame(&payload, &mut framed);
        let mut buf = Vec::new();
        for cut in 0..=framed.len() {
            let mem = Arc::new(Nvram::anonymous(256).unwrap());
            mem.write(0, &framed[..cut]);
            let mut r = RingReader::new(mem, 0, 256);
            let got = r.poll(&mut buf);
            if cut == framed.len() {
                assert!(got.is_some());
                assert_eq!(&buf[..payload.len()], &payload[..]);
            } else {
                // The only acceptable early acceptance is of bytes identical to the whole record,
                // which a trailer whose last bytes are zero allows.
                let identical = framed[cut..].iter().all(|b| *b == 0);
                assert!(got.is_none() || identical, "record cut at {cut} accepted");
            }
        }
    }

    /// A restarted receiver finds exactly the records it had not freed, across a wrap, and
    /// zeroes a torn append and an interrupted zeroing, so that a resumed sender's records
    /// after them are read correctly.
    #[test]
    fn resume_keeps_unfreed_records_and_zeroes_garbage() {
        let cap = 256;
        let mem = Arc::new(Nvram::anonymous(cap + 8).unwrap());
        let head = HeadWord {
            mem: mem.clone(),
            offset: cap,
        };
        let (mut r, tail) = RingReader::resume(mem.clone(), 0, cap, head.clone());
        assert_eq!(tail, 0, "a zeroed ring resumes empty");
        let mut w = RingWriter::new(cap);
        let mut buf = Vec::new();
        // Seven records of 40 bytes: the seventh wraps (after a skip marker); the first four
        // are freed, the sixth is released out of order (not freed: the fifth is held).
        let mut pos = Vec::new();
        for i in 0..7u8 {
            assert!(append(&mem, 0, &mut w, &[i + 1; 28]), "append {i}");
            let p = r.poll(&mut buf).expect("record");
            pos.push(p);
            if i < 4 {
                r.release(p);
                w.update_head(r.freed());
            }
        }
        r.release(pos[5]);
        let freed = r.freed();
        assert_eq!(freed, 160);
        assert!(w.tail() > cap as u64, "the ring wrapped");
        assert_eq!(
            head.mem.load_u64(cap, std::sync::atomic::Ordering::Relaxed),
            freed
        );
        // A torn append after the last record: its length word and a byte of payload.
        let mut framed = Vec::new();
        frame(&[9; 40], &mut framed);
        let torn_at = (w.tail() % cap as u64) as usize;
        mem.write(torn_at, &framed[..16]);
        let (mut r2, tail) = RingReader::resume(mem.clone(), 0, cap, head.clone());
        assert_eq!(tail, w.tail(), "records 5-7 are live");
        let mut seen = Vec::new();
        while let Some(p) = r2.poll(&mut buf) {
            seen.push(buf[0]);
            r2.release(p);
        }
        assert_eq!(seen, vec![5, 6, 7]);
        assert_eq!(
            mem.load_u64(torn_at, std::sync::atomic::Ordering::Relaxed),
            0,
            "the torn append is zeroed"
        );
        // The sender resumes: its records after the zeroed garbage are read in order.
        let mut w2 = RingWriter::resume(cap, r2.freed(), tail);
        assert!(append(&mem, 0, &mut w2, &[8; 8]));
        assert!(r2.poll(&mut buf).is_some());
        assert_eq!(buf[0], 8);
    }

    /// A reader that marks released records: one released while an older one is held is
    /// skipped after a restart, and the held one and those after it are read as before.
    #[test]
    fn a_record_released_out_of_order_and_marked_is_not_read_after_a_restart() {
        let cap = 256;
        let mem = Arc::new(Nvram::anonymous(cap + 8).unwrap());
        let head = HeadWord {
            mem: mem.clone(),
            offset: cap,
        };
        let mut r = RingReader::new(mem.clone(), 0, cap)
            .with_head_word(head.clone())
            .mark_released();
        let mut w = RingWriter::new(cap);
        let mut buf = Vec::new();
        let mut pos = Vec::new();
        for i in 1..=4u8 {
            assert!(append(&mem, 0, &mut w, &[i; 20]));
            pos.push(r.poll(&mut buf).expect("record"));
        }
        r.release(pos[0]); // In order: freed.
        r.release(pos[2]); // Behind the held second: marked.
        let (mut r2, tail) = RingReader::resume(mem.clone(), 0, cap, head);
        assert_eq!(
            tail,
            w.tail(),
            "the marked record does not end the live ones"
        );
        let mut seen = Vec::new();
        while let Some(p) = r2.poll(&mut buf) {
            seen.push(buf[0]);
            r2.release(p);
        }
        assert_eq!(seen, vec![2, 4]);
        assert_eq!(
            r2.freed(),
            w.tail(),
            "all freed, the marked record included"
        );
    }

    #[test]
    fn corrupted_record_is_not_accepted() {
        let mem = Arc::new(Nvram::anonymous(256).unwrap());
        let mut framed = Vec::new();
        frame(b"hello world", &mut framed);
        framed[6] ^= 0x40;
        mem.write(0, &framed);
        let mut r = RingReader::new(mem, 0, 256);
        assert!(r.poll(&mut Vec::new()).is_none());
    }

    #[test]
    fn layout_offsets_do_not_overlap() {
        let l = RingLayout {
            machines_max: 3,
            threads: 2,
            log_bytes: 1024,
            queue_bytes: 512,
        };
        let mut spans = Vec::new();
        for m in 0..3 {
            for t in 0..2 {
                for k in [RingKind::Log, RingKind::Queue] {
                    let off = l.ring_offset(MachineId(m), ThreadId(t), k);
                    spans.push((off, off + l.ring_bytes(k)));
                }
            }
        }
        spans.sort();
        for pair in spans.windows(2) {
            assert!(pair[0].1 <= pair[1].0);
        }
        assert_eq!(spans.last().unwrap().1, l.rings_area_bytes());
        assert!(l.validate(512).is_err());
        assert!(l.validate(64).is_ok());
    }
}
