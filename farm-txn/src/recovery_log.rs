//! A worker thread's recovery log: the recovery messages it processed that a whole-cluster
//! restart must still see, kept in NVRAM until their transaction is forgotten.
//!
//! A recovery coordinator treats a decision, and a primary treats REPLICATE-TX-STATE, as held by
//! a replica once the message landed in the replica's queue (the queue is NVRAM, like a log),
//! and lets the application learn the outcome, or truncate the transaction, from then on (§5.3
//! steps 5-7). A queue slot is freed as soon as its message is processed, though, while the
//! decision's effects (installed writes, released locks) and the replicated writes stay. So the
//! thread copies each such message here before processing it, and a restart reads them back
//! ([`RecoveryLog::open`]) together with the queues' unprocessed messages: the evidence the
//! replicas had (§5.3 step 6, "saw COMMIT-RECOVERY") survives a power loss, and recovery after
//! the restart decides as before.
//!
//! The log is a ring written and read by its own thread, framed and checksummed like the
//! inbound rings ([`farm_core::ring`]), with its head word in NVRAM. It is as large as one
//! inbound log, plenty for the transactions in flight at a failure; what decides its use is
//! input from other machines, though, so a full log is not an error: a message that does not
//! fit keeps its queue slot instead (`recovery::Kept::Queue`), held until its transaction is
//! forgotten. The queue is NVRAM too, so a restart reads it back from there; and as a held
//! slot stops the sender's queue from wrapping past it, senders slow down until the log
//! frees, or, if it never does, let their backlogs fill and cut the link
//! (`Worker::send_message`), which removes this machine from the configuration rather than
//! stopping every machine that talks to it.

use std::sync::Arc;

use farm_core::nvram::Nvram;
use farm_core::ring::{frame, skip_marker, HeadWord, RecordPos, RingReader, RingWriter};

use crate::machine::MachineState;

/// One thread's recovery log.
#[derive(Debug)]
pub(crate) struct RecoveryLog {
    mem: Arc<Nvram>,
    base: usize,
    writer: RingWriter,
    reader: RingReader,
    framed: Vec<u8>,
    polled: Vec<u8>,
    /// The last append found no room.
    full: bool,
}

impl RecoveryLog {
    /// Opens thread `thread`'s recovery log: empty, or after a restart with the entries the
    /// previous life left (returned with their positions, oldest first).
    pub(crate) fn open(machine: &MachineState, thread: u16) -> (Self, Vec<(RecordPos, Vec<u8>)>) {
        let (head_offset, base, capacity) = machine.recovery_log_ring(thread);
        let mem = machine.recovery_log.clone();
        let head = HeadWord {
            mem: mem.clone(),
            offset: head_offset,
        };
        let mut entries = Vec::new();
        let (reader, writer) = if machine.restart_config().is_some() {
            let (mut reader, tail) = RingReader::resume(mem.clone(), base, capacity, head);
            let mut buf = Vec::new();
            while let Some(pos) = reader.poll(&mut buf) {
                entries.push((pos, buf.clone()));
            }
            let writer = RingWriter::resume(capacity, reader.freed(), tail);
            (reader, writer)
        } else {
            let reader = RingReader::new(mem.clone(), base, capacity).with_head_word(head);
            (reader, RingWriter::new(capacity))
        };
        let log = Self {
            mem,
            base,
            writer,
            reader,
            framed: Vec::new(),
            polled: Vec::new(),
            full: false,
        };
        (log, entries)
    }

    /// Appends `payload` (an encoded message) and returns its position; `None` when the log
    /// is full (the caller keeps the message in its queue slot instead,
    /// `recovery::Kept::Queue`).
    pub(crate) fn append(&mut self, payload: &[u8]) -> Option<RecordPos> {
        frame(payload, &mut self.framed);
        let place = self.writer.place(self.framed.len(), 0);
        self.full = place.is_none();
        let place = place?;
        if let Some((at, len)) = place.skip {
            self.mem.write(self.base + at, &skip_marker(len));
        }
        self.mem.write(self.base + place.offset, &self.framed);
        let pos = self
            .reader
            .poll(&mut self.polled)
            .expect("the entry just appended");
        debug_assert_eq!(self.polled[..payload.len()], *payload);
        Some(pos)
    }

    /// Whether the last append found no room.
    pub(crate) fn is_full(&self) -> bool {
        self.full
    }

    /// Drops the entry at `pos`.
    pub(crate) fn release(&mut self, pos: RecordPos) {
        self.reader.release(pos);
        self.writer.update_head(self.reader.freed());
    }
}
