//! Wire records of the normal-case protocol (FaRM Tables 1 and 2) in a versioned encoding.
//!
//! Log records (LOCK, COMMIT-BACKUP, COMMIT-PRIMARY, ABORT, TRUNCATE) go to transaction logs and
//! carry the piggybacked truncation state of their sender: a low bound below which all of the
//! sender thread's transactions are truncated, and explicit ids above it. Messages (LOCK-REPLY,
//! VALIDATE, VALIDATE-REPLY) go to message queues.
//!
//! Every record starts with [`WIRE_VERSION`] and a kind byte; all integers are little-endian.
//! Decoding bytes that came from elsewhere returns a [`WireError`] on malformed input and never
//! panics.

use crate::ids::{Addr, ConfigId, MachineId, RegionId, ThreadId, TxnId};
use crate::object::Header;

/// Encoding version written first in every record.
pub const WIRE_VERSION: u8 = 1;
/// Largest encoded record (payload before framing).
pub const RECORD_BYTES_MAX: usize = 60 * 1024;
/// Most explicit truncation ids piggybacked on one record.
pub const TRUNCATED_IDS_MAX: usize = 64;
/// Most object bytes in one write entry.
pub const OBJECT_BYTES_MAX: usize = 16 * 1024;

/// Why bytes did not decode.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the record needs.
    #[error("record truncated: needed {needed} bytes at offset {at}, have {have}")]
    Truncated {
        /// Offset of the field.
        at: usize,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// A version this build does not speak.
    #[error("unsupported wire version {0} (this build speaks {WIRE_VERSION})")]
    Version(u8),
    /// An unknown record kind.
    #[error("unknown {what} kind {kind}")]
    Kind {
        /// Log record or message.
        what: &'static str,
        /// The kind byte.
        kind: u8,
    },
    /// A field out of its allowed range.
    #[error("invalid {field}: {value}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
}

/// One written object: where, the header the transaction read (the lock is taken at it), whether
/// the object is allocated after the commit (allocation sets the bit, free clears it, §5.5), and
/// the new payload.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct WriteEntry {
    /// The object.
    pub addr: Addr,
    /// Header read during execution.
    pub read: Header,
    /// Allocated bit after commit.
    pub allocated: bool,
    /// New payload (empty for a free).
    pub data: Vec<u8>,
}

/// Payload of LOCK and COMMIT-BACKUP (Table 1): all regions written by the transaction, and the
/// writes the destination is primary (or backup) for.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct WriteSet {
    /// Every region with objects written by the transaction (for recovery, §5.3).
    pub regions: Vec<RegionId>,
    /// Written objects at the destination.
    pub writes: Vec<WriteEntry>,
}

/// The body of a log record.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum LogBody {
    /// Lock the writes at the primary and answer with LOCK-REPLY.
    Lock(WriteSet),
    /// Keep the writes at a backup until truncation.
    CommitBackup(WriteSet),
    /// Apply the locked writes in place and unlock.
    CommitPrimary,
    /// Release the locks taken for the transaction.
    Abort,
    /// Only the piggybacked truncation state.
    Truncate,
}

/// A transaction log record.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct LogRecord {
    /// The transaction the body is about (for TRUNCATE, the sender's newest).
    pub txn: TxnId,
    /// Every transaction of the sender thread with a local counter below this is truncated.
    pub truncate_below: u64,
    /// Further truncated transactions (local counters) of the sender thread.
    pub truncated: Vec<u64>,
    /// What to do.
    pub body: LogBody,
}

/// A message-queue record.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Message {
    /// Whether all locks of a LOCK record were taken.
    LockReply {
        /// The transaction.
        txn: TxnId,
        /// All locks taken.
        ok: bool,
    },
    /// Read validation over RPC, for a primary holding more than `tr` read objects (§4).
    Validate {
        /// The transaction.
        txn: TxnId,
        /// Objects read from the destination and the headers seen.
        reads: Vec<(Addr, Header)>,
    },
    /// A backup's CPU processed a COMMIT-BACKUP record: the acknowledgement of RPC-based
    /// replication (Tailwind's baseline), which the coordinator waits for instead of the
    /// one-sided write's completion when the cluster replicates that way.
    BackupAck {
        /// The transaction.
        txn: TxnId,
    },
    /// Whether every object of a VALIDATE still has the header read.
    ValidateReply {
        /// The transaction.
        txn: TxnId,
        /// Validation succeeded.
        ok: bool,
    },
    /// Allocation at a remote primary, for a locality hint in a region the coordinator's machine
    /// is not primary for (free lists live only at the primary, §5.5): `count` slots of one
    /// size, requests `request .. request + count`, answered by one ALLOC-REPLY.
    Alloc {
        /// Id of the first slot's request; ids are unique per sender thread.
        request: u64,
        /// Region to allocate in.
        region: RegionId,
        /// Payload bytes.
        len: u32,
        /// Slots asked for (at least 1, at most [`ALLOC_BATCH_MAX`]).
        count: u32,
    },
    /// The answer to an ALLOC: what each of its slots got, in request order.
    AllocReply {
        /// The ALLOC's first request.
        request: u64,
        /// Each slot, or why there is none.
        outcomes: Vec<AllocOutcome>,
    },
    /// Gives back a slot handed out by ALLOC whose transaction did not commit.
    Release {
        /// The slot.
        addr: Addr,
        /// Its size.
        slot_bytes: u32,
        /// The configuration the slot was handed out in (a primary promoted since ignores it:
        /// its allocator recovery counted the slot free).
        config: ConfigId,
    },
    /// Recovery (Table 2; §5.3), sent in configuration `config` about `region`.
    Recovery {
        /// The configuration the message belongs to.
        config: ConfigId,
        /// The region concerned.
        region: RegionId,
        /// What it says.
        body: RecoveryBody,
    },
}

/// The recovery messages of Table 2 (§5.3).
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum RecoveryBody {
    /// Backup to primary: the recovering transactions that updated the region.
    NeedRecovery(Vec<TxnId>),
    /// Primary to backup: send the state of these transactions.
    FetchTxState(Vec<TxnId>),
    /// Backup to primary: the LOCK-record contents of a transaction asked for, and what the
    /// backup saw of it (evidence for the region's vote, §5.3 step 6).
    SendTxState(TxnId, WriteSet, Seen),
    /// Primary to backup: a transaction's LOCK-record contents the backup is missing, and what
    /// the region's replicas saw of it (so that the evidence survives the replicas that held
    /// it).
    ReplicateTxState(TxnId, WriteSet, Seen),
    /// Primary to the recovery coordinator: the region's vote, with every region the
    /// transaction modified.
    RecoveryVote(TxnId, Vec<RegionId>, WireVote),
    /// Coordinator to a primary that has not voted.
    RequestVote(TxnId),
    /// Coordinator to every replica: commit.
    CommitRecovery(TxnId),
    /// Coordinator to every replica: abort.
    AbortRecovery(TxnId),
    /// Coordinator to every replica once all acked: forget the transaction.
    TruncateRecovery(TxnId),
}

/// What replicas of a region saw of a recovering transaction besides its writes (§5.3 step 6),
/// as SEND-TX-STATE and REPLICATE-TX-STATE carry it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Seen {
    /// COMMIT-BACKUP.
    pub commit_backup: bool,
    /// COMMIT-PRIMARY or COMMIT-RECOVERY.
    pub commit: bool,
    /// ABORT-RECOVERY (or the coordinator's ABORT).
    pub abort: bool,
}

impl Seen {
    fn to_byte(self) -> u8 {
        self.commit_backup as u8 | (self.commit as u8) << 1 | (self.abort as u8) << 2
    }

    fn from_byte(b: u8) -> Result<Self, WireError> {
        if b > 7 {
            return Err(WireError::Invalid {
                field: "seen",
                value: b as u64,
            });
        }
        Ok(Self {
            commit_backup: b & 1 != 0,
            commit: b & 2 != 0,
            abort: b & 4 != 0,
        })
    }
}

/// A region's vote on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum WireVote {
    /// A replica saw COMMIT-PRIMARY or COMMIT-RECOVERY.
    CommitPrimary = 0,
    /// A replica saw COMMIT-BACKUP, none ABORT-RECOVERY.
    CommitBackup = 1,
    /// A replica saw LOCK, none ABORT-RECOVERY.
    Lock = 2,
    /// Nothing allows a commit.
    Abort = 3,
    /// No records; truncated here.
    Truncated = 4,
    /// No records; not known to be truncated.
    Unknown = 5,
}

/// What an ALLOC got.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AllocOutcome {
    /// A free slot; its header (allocated bit clear) is what the transaction locks at.
    Slot {
        /// Offset of the slot in the region.
        offset: u32,
        /// Slot size.
        slot_bytes: u32,
        /// The slot's current header.
        header: Header,
    },
    /// No free slot of the size class and no unused block.
    RegionFull,
    /// Larger than the largest size class.
    TooLarge,
    /// The destination is not the region's primary.
    NotPrimary,
}

const LOG_LOCK: u8 = 1;
const LOG_COMMIT_BACKUP: u8 = 2;
const LOG_COMMIT_PRIMARY: u8 = 3;
const LOG_ABORT: u8 = 4;
const LOG_TRUNCATE: u8 = 5;
const MSG_LOCK_REPLY: u8 = 16;
const MSG_VALIDATE: u8 = 17;
const MSG_VALIDATE_REPLY: u8 = 18;
const MSG_ALLOC: u8 = 19;
/// Most slots one ALLOC asks for (its answer stays a few kilobytes).
pub const ALLOC_BATCH_MAX: u32 = 256;
const MSG_ALLOC_REPLY: u8 = 20;
const MSG_RELEASE: u8 = 21;
const MSG_RECOVERY: u8 = 22;
const MSG_BACKUP_ACK: u8 = 23;
const REC_NEED: u8 = 1;
const REC_FETCH: u8 = 2;
const REC_SEND: u8 = 3;
const REC_REPLICATE: u8 = 4;
const REC_VOTE: u8 = 5;
const REC_REQUEST_VOTE: u8 = 6;
const REC_COMMIT: u8 = 7;
const REC_ABORT: u8 = 8;
const REC_TRUNCATE: u8 = 9;

fn put_txn(out: &mut Vec<u8>, t: TxnId) {
    out.extend_from_slice(&t.config.0.to_le_bytes());
    out.extend_from_slice(&t.machine.0.to_le_bytes());
    out.extend_from_slice(&t.thread.0.to_le_bytes());
    out.extend_from_slice(&t.local.to_le_bytes());
}

fn put_addr(out: &mut Vec<u8>, a: Addr) {
    out.extend_from_slice(&a.region.0.to_le_bytes());
    out.extend_from_slice(&a.offset.to_le_bytes());
}

fn put_write_set(out: &mut Vec<u8>, ws: &WriteSet) {
    out.extend_from_slice(&(ws.regions.len() as u32).to_le_bytes());
    for r in &ws.regions {
        out.extend_from_slice(&r.0.to_le_bytes());
    }
    out.extend_from_slice(&(ws.writes.len() as u32).to_le_bytes());
    for w in &ws.writes {
        put_addr(out, w.addr);
        out.extend_from_slice(&w.read.0.to_le_bytes());
        out.push(w.allocated as u8);
        out.extend_from_slice(&(w.data.len() as u32).to_le_bytes());
        out.extend_from_slice(&w.data);
    }
}

/// Encoded size of a write set, for reservations before encoding.
pub fn write_set_bytes(regions: usize, writes: impl Iterator<Item = usize>) -> usize {
    8 + 4 * regions + writes.map(|data| 8 + 8 + 1 + 4 + data).sum::<usize>()
}

/// Encoded size of a log record header with `truncated` explicit ids.
pub const fn log_header_bytes(truncated: usize) -> usize {
    2 + 20 + 8 + 2 + 8 * truncated
}

impl LogRecord {
    /// Appends the encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        Self::encode_parts(
            self.txn,
            self.truncate_below,
            &self.truncated,
            &self.body,
            out,
        );
    }

    /// Appends the encoding of the record these parts make to `out`, without building it (a
    /// coordinator sends the same write set to a primary or backup it keeps for itself).
    pub fn encode_parts(
        txn: TxnId,
        truncate_below: u64,
        truncated: &[u64],
        body: &LogBody,
        out: &mut Vec<u8>,
    ) {
        assert!(
            truncated.len() <= TRUNCATED_IDS_MAX,
            "too many piggybacked truncations"
        );
        out.push(WIRE_VERSION);
        out.push(match body {
            LogBody::Lock(_) => LOG_LOCK,
            LogBody::CommitBackup(_) => LOG_COMMIT_BACKUP,
            LogBody::CommitPrimary => LOG_COMMIT_PRIMARY,
            LogBody::Abort => LOG_ABORT,
            LogBody::Truncate => LOG_TRUNCATE,
        });
        put_txn(out, txn);
        out.extend_from_slice(&truncate_below.to_le_bytes());
        out.extend_from_slice(&(truncated.len() as u16).to_le_bytes());
        for t in truncated {
            out.extend_from_slice(&t.to_le_bytes());
        }
        if let LogBody::Lock(ws) | LogBody::CommitBackup(ws) = body {
            put_write_set(out, ws);
        }
    }

    /// Decodes one record; trailing zero padding is allowed, anything else left over is an error.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader { bytes, at: 0 };
        let kind = r.header()?;
        let txn = r.txn()?;
        let truncate_below = r.u64()?;
        let n = r.u16()? as usize;
        if n > TRUNCATED_IDS_MAX {
            return Err(WireError::Invalid {
                field: "truncated id count",
                value: n as u64,
            });
        }
        let mut truncated = Vec::with_capacity(n);
        for _ in 0..n {
            truncated.push(r.u64()?);
        }
        let body = match kind {
            LOG_LOCK => LogBody::Lock(r.write_set()?),
            LOG_COMMIT_BACKUP => LogBody::CommitBackup(r.write_set()?),
            LOG_COMMIT_PRIMARY => LogBody::CommitPrimary,
            LOG_ABORT => LogBody::Abort,
            LOG_TRUNCATE => LogBody::Truncate,
            kind => {
                return Err(WireError::Kind {
                    what: "log record",
                    kind,
                })
            }
        };
        r.finish()?;
        Ok(Self {
            txn,
            truncate_below,
            truncated,
            body,
        })
    }
}

impl Message {
    /// Appends the encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(WIRE_VERSION);
        match self {
            Message::LockReply { txn, ok } | Message::ValidateReply { txn, ok } => {
                out.push(if matches!(self, Message::LockReply { .. }) {
                    MSG_LOCK_REPLY
                } else {
                    MSG_VALIDATE_REPLY
                });
                put_txn(out, *txn);
                out.push(*ok as u8);
            }
            Message::BackupAck { txn } => {
                out.push(MSG_BACKUP_ACK);
                put_txn(out, *txn);
            }
            Message::Validate { txn, reads } => {
                out.push(MSG_VALIDATE);
                put_txn(out, *txn);
                out.extend_from_slice(&(reads.len() as u32).to_le_bytes());
                for (a, h) in reads {
                    put_addr(out, *a);
                    out.extend_from_slice(&h.0.to_le_bytes());
                }
            }
            Message::Alloc {
                request,
                region,
                len,
                count,
            } => {
                out.push(MSG_ALLOC);
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&region.0.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(&count.to_le_bytes());
            }
            Message::AllocReply { request, outcomes } => {
                out.push(MSG_ALLOC_REPLY);
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&(outcomes.len() as u32).to_le_bytes());
                for outcome in outcomes {
                    match outcome {
                        AllocOutcome::Slot {
                            offset,
                            slot_bytes,
                            header,
                        } => {
                            out.push(0);
                            out.extend_from_slice(&offset.to_le_bytes());
                            out.extend_from_slice(&slot_bytes.to_le_bytes());
                            out.extend_from_slice(&header.0.to_le_bytes());
                        }
                        AllocOutcome::RegionFull => out.push(1),
                        AllocOutcome::TooLarge => out.push(2),
                        AllocOutcome::NotPrimary => out.push(3),
                    }
                }
            }
            Message::Release {
                addr,
                slot_bytes,
                config,
            } => {
                out.push(MSG_RELEASE);
                put_addr(out, *addr);
                out.extend_from_slice(&slot_bytes.to_le_bytes());
                out.extend_from_slice(&config.0.to_le_bytes());
            }
            Message::Recovery {
                config,
                region,
                body,
            } => {
                out.push(MSG_RECOVERY);
                out.extend_from_slice(&config.0.to_le_bytes());
                out.extend_from_slice(&region.0.to_le_bytes());
                let put_txns = |out: &mut Vec<u8>, ts: &[TxnId]| {
                    out.extend_from_slice(&(ts.len() as u32).to_le_bytes());
                    for t in ts {
                        put_txn(out, *t);
                    }
                };
                match body {
                    RecoveryBody::NeedRecovery(ts) => {
                        out.push(REC_NEED);
                        put_txns(out, ts);
                    }
                    RecoveryBody::FetchTxState(ts) => {
                        out.push(REC_FETCH);
                        put_txns(out, ts);
                    }
                    RecoveryBody::SendTxState(t, ws, seen)
                    | RecoveryBody::ReplicateTxState(t, ws, seen) => {
                        out.push(match body {
                            RecoveryBody::SendTxState(..) => REC_SEND,
                            _ => REC_REPLICATE,
                        });
                        out.push(seen.to_byte());
                        put_txn(out, *t);
                        put_write_set(out, ws);
                    }
                    RecoveryBody::RecoveryVote(t, regions, vote) => {
                        out.push(REC_VOTE);
                        put_txn(out, *t);
                        out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
                        for r in regions {
                            out.extend_from_slice(&r.0.to_le_bytes());
                        }
                        out.push(*vote as u8);
                    }
                    RecoveryBody::RequestVote(t)
                    | RecoveryBody::CommitRecovery(t)
                    | RecoveryBody::AbortRecovery(t)
                    | RecoveryBody::TruncateRecovery(t) => {
                        out.push(match body {
                            RecoveryBody::RequestVote(_) => REC_REQUEST_VOTE,
                            RecoveryBody::CommitRecovery(_) => REC_COMMIT,
                            RecoveryBody::AbortRecovery(_) => REC_ABORT,
                            _ => REC_TRUNCATE,
                        });
                        put_txn(out, *t);
                    }
                }
            }
        }
    }

    /// Decodes one message; see [`LogRecord::decode`].
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader { bytes, at: 0 };
        let kind = r.header()?;
        let msg = match kind {
            MSG_LOCK_REPLY | MSG_VALIDATE_REPLY => {
                let txn = r.txn()?;
                let ok = r.bool("ok")?;
                if kind == MSG_LOCK_REPLY {
                    Message::LockReply { txn, ok }
                } else {
                    Message::ValidateReply { txn, ok }
                }
            }
            MSG_BACKUP_ACK => Message::BackupAck { txn: r.txn()? },
            MSG_VALIDATE => {
                let txn = r.txn()?;
                let n = r.count(16, "validate count")?;
                let mut reads = Vec::with_capacity(n);
                for _ in 0..n {
                    reads.push((r.addr()?, Header(r.u64()?)));
                }
                Message::Validate { txn, reads }
            }
            MSG_ALLOC => {
                let (request, region, len, count) =
                    (r.u64()?, RegionId(r.u32()?), r.u32()?, r.u32()?);
                if count == 0 || count > ALLOC_BATCH_MAX {
                    return Err(WireError::Invalid {
                        field: "alloc count",
                        value: count as u64,
                    });
                }
                Message::Alloc {
                    request,
                    region,
                    len,
                    count,
                }
            }
            MSG_ALLOC_REPLY => {
                let request = r.u64()?;
                let n = r.count(1, "alloc outcomes")?;
                if n > ALLOC_BATCH_MAX as usize {
                    return Err(WireError::Invalid {
                        field: "alloc outcomes",
                        value: n as u64,
                    });
                }
                let mut outcomes = Vec::with_capacity(n);
                for _ in 0..n {
                    outcomes.push(match r.u8()? {
                        0 => AllocOutcome::Slot {
                            offset: r.u32()?,
                            slot_bytes: r.u32()?,
                            header: Header(r.u64()?),
                        },
                        1 => AllocOutcome::RegionFull,
                        2 => AllocOutcome::TooLarge,
                        3 => AllocOutcome::NotPrimary,
                        v => {
                            return Err(WireError::Invalid {
                                field: "alloc outcome",
                                value: v as u64,
                            })
                        }
                    });
                }
                Message::AllocReply { request, outcomes }
            }
            MSG_RELEASE => Message::Release {
                addr: r.addr()?,
                slot_bytes: r.u32()?,
                config: ConfigId(r.u64()?),
            },
            MSG_RECOVERY => {
                let config = ConfigId(r.u64()?);
                let region = RegionId(r.u32()?);
                let kind = r.u8()?;
                let body = match kind {
                    REC_NEED | REC_FETCH => {
                        let n = r.count(20, "transaction count")?;
                        let mut ts = Vec::with_capacity(n);
                        for _ in 0..n {
                            ts.push(r.txn()?);
                        }
                        if kind == REC_NEED {
                            RecoveryBody::NeedRecovery(ts)
                        } else {
                            RecoveryBody::FetchTxState(ts)
                        }
                    }
                    REC_SEND | REC_REPLICATE => {
                        let seen = Seen::from_byte(r.u8()?)?;
                        let t = r.txn()?;
                        let ws = r.write_set()?;
                        if kind == REC_REPLICATE {
                            RecoveryBody::ReplicateTxState(t, ws, seen)
                        } else {
                            RecoveryBody::SendTxState(t, ws, seen)
                        }
                    }
                    REC_VOTE => {
                        let t = r.txn()?;
                        let n = r.count(4, "region count")?;
                        let mut regions = Vec::with_capacity(n);
                        for _ in 0..n {
                            regions.push(RegionId(r.u32()?));
                        }
                        let vote = match r.u8()? {
                            0 => WireVote::CommitPrimary,
                            1 => WireVote::CommitBackup,
                            2 => WireVote::Lock,
                            3 => WireVote::Abort,
                            4 => WireVote::Truncated,
                            5 => WireVote::Unknown,
                            v => {
                                return Err(WireError::Invalid {
                                    field: "vote",
                                    value: v as u64,
                                })
                            }
                        };
                        RecoveryBody::RecoveryVote(t, regions, vote)
                    }
                    REC_REQUEST_VOTE => RecoveryBody::RequestVote(r.txn()?),
                    REC_COMMIT => RecoveryBody::CommitRecovery(r.txn()?),
                    REC_ABORT => RecoveryBody::AbortRecovery(r.txn()?),
                    REC_TRUNCATE => RecoveryBody::TruncateRecovery(r.txn()?),
                    kind => {
                        return Err(WireError::Kind {
                            what: "recovery message",
                            kind,
                        })
                    }
                };
                Message::Recovery {
                    config,
                    region,
                    body,
                }
            }
            kind => {
                return Err(WireError::Kind {
                    what: "message",
                    kind,
                })
            }
        };
        r.finish()?;
        Ok(msg)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let have = self.bytes.len() - self.at;
        if n > have {
            return Err(WireError::Truncated {
                at: self.at,
                needed: n,
                have,
            });
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn bool(&mut self, field: &'static str) -> Result<bool, WireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(WireError::Invalid {
                field,
                value: v as u64,
            }),
        }
    }

    /// A count of items of at least `item_bytes` each, checked against what is left so that a
    /// hostile count cannot make us allocate.
    fn count(&mut self, item_bytes: usize, field: &'static str) -> Result<usize, WireError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(item_bytes) > self.bytes.len() - self.at {
            return Err(WireError::Invalid {
                field,
                value: n as u64,
            });
        }
        Ok(n)
    }

    fn header(&mut self) -> Result<u8, WireError> {
        let v = self.u8()?;
        if v != WIRE_VERSION {
            return Err(WireError::Version(v));
        }
        self.u8()
    }

    fn txn(&mut self) -> Result<TxnId, WireError> {
        Ok(TxnId {
            config: ConfigId(self.u64()?),
            machine: MachineId(self.u16()?),
            thread: ThreadId(self.u16()?),
            local: self.u64()?,
        })
    }

    fn addr(&mut self) -> Result<Addr, WireError> {
        Ok(Addr {
            region: RegionId(self.u32()?),
            offset: self.u32()?,
        })
    }

    fn write_set(&mut self) -> Result<WriteSet, WireError> {
        let n = self.count(4, "region count")?;
        let mut regions = Vec::with_capacity(n);
        for _ in 0..n {
            regions.push(RegionId(self.u32()?));
        }
        let n = self.count(21, "write count")?;
        let mut writes = Vec::with_capacity(n);
        for _ in 0..n {
            let addr = self.addr()?;
            let read = Header(self.u64()?);
            if read.locked() {
                return Err(WireError::Invalid {
                    field: "read header (locked)",
                    value: read.0,
                });
            }
            let allocated = self.bool("allocated")?;
            let len = self.u32()? as usize;
            if len > OBJECT_BYTES_MAX {
                return Err(WireError::Invalid {
                    field: "object length",
                    value: len as u64,
                });
            }
            let data = self.take(len)?.to_vec();
            writes.push(WriteEntry {
                addr,
                read,
                allocated,
                data,
            });
        }
        Ok(WriteSet { regions, writes })
    }

    fn finish(&self) -> Result<(), WireError> {
        match self.bytes[self.at..].iter().position(|b| *b != 0) {
            None => Ok(()),
            Some(i) => Err(WireError::Invalid {
                field: "trailing byte offset",
                value: (self.at + i) as u64,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Version;
    use crate::rng::Rng;

    fn txn() -> TxnId {
        TxnId {
            config: ConfigId(3),
            machine: MachineId(1),
            thread: ThreadId(2),
            local: 77,
        }
    }

    fn lock_record() -> LogRecord {
        LogRecord {
            txn: txn(),
            truncate_below: 70,
            truncated: vec![72, 75],
            body: LogBody::Lock(WriteSet {
                regions: vec![RegionId(1), RegionId(4)],
                writes: vec![
                    WriteEntry {
                        addr: Addr::new(RegionId(1), 64),
                        read: Header::new(Version(5), true),
                        allocated: true,
                        data: vec![1, 2, 3],
                    },
                    WriteEntry {
                        addr: Addr::new(RegionId(4), 128),
                        read: Header::new(Version(0), false),
                        allocated: false,
                        data: vec![],
                    },
                ],
            }),
        }
    }

    #[test]
    fn every_record_round_trips() {
        let mut records = vec![lock_record()];
        let mut cb = lock_record();
        if let LogBody::Lock(ws) = cb.body {
            cb.body = LogBody::CommitBackup(ws);
        }
        records.push(cb);
        for body in [LogBody::CommitPrimary, LogBody::Abort, LogBody::Truncate] {
            records.push(LogRecord {
                txn: txn(),
                truncate_below: 0,
                truncated: vec![],
                body,
            });
        }
        for rec in records {
            let mut buf = Vec::new();
            rec.encode(&mut buf);
            buf.extend_from_slice(&[0, 0, 0]); // ring padding
            assert_eq!(LogRecord::decode(&buf).unwrap(), rec);
        }
        let msgs = [
            Message::LockReply {
                txn: txn(),
                ok: true,
            },
            Message::ValidateReply {
                txn: txn(),
                ok: false,
            },
            Message::BackupAck { txn: txn() },
            Message::Validate {
                txn: txn(),
                reads: vec![(Addr::new(RegionId(9), 8), Header::new(Version(1), true))],
            },
            Message::Alloc {
                request: 5,
                region: RegionId(2),
                len: 100,
                count: 3,
            },
            Message::AllocReply {
                request: 5,
                outcomes: vec![
                    AllocOutcome::Slot {
                        offset: 1 << 20,
                        slot_bytes: 128,
                        header: Header::new(Version(3), false),
                    },
                    AllocOutcome::RegionFull,
                    AllocOutcome::NotPrimary,
                ],
            },
            Message::AllocReply {
                request: 6,
                outcomes: vec![AllocOutcome::TooLarge],
            },
            Message::Release {
                addr: Addr::new(RegionId(2), 1 << 20),
                slot_bytes: 128,
                config: ConfigId(3),
            },
        ];
        let ws = match lock_record().body {
            LogBody::Lock(ws) => ws,
            _ => unreachable!(),
        };
        let recovery = [
            RecoveryBody::NeedRecovery(vec![txn(), txn()]),
            RecoveryBody::FetchTxState(vec![]),
            RecoveryBody::SendTxState(txn(), ws.clone(), Seen::default()),
            RecoveryBody::SendTxState(
                txn(),
                ws.clone(),
                Seen {
                    commit_backup: true,
                    commit: false,
                    abort: true,
                },
            ),
            RecoveryBody::ReplicateTxState(
                txn(),
                ws.clone(),
                Seen {
                    commit_backup: false,
                    commit: true,
                    abort: false,
                },
            ),
            RecoveryBody::ReplicateTxState(
                txn(),
                ws,
                Seen {
                    commit_backup: true,
                    commit: true,
                    abort: true,
                },
            ),
            RecoveryBody::RecoveryVote(
                txn(),
                vec![RegionId(1), RegionId(4)],
                WireVote::CommitBackup,
            ),
            RecoveryBody::RecoveryVote(txn(), vec![], WireVote::Unknown),
            RecoveryBody::RequestVote(txn()),
            RecoveryBody::CommitRecovery(txn()),
            RecoveryBody::AbortRecovery(txn()),
            RecoveryBody::TruncateRecovery(txn()),
        ];
        let msgs = msgs
            .into_iter()
            .chain(recovery.into_iter().map(|body| Message::Recovery {
                config: ConfigId(5),
                region: RegionId(3),
                body,
            }));
        for m in msgs {
            let mut buf = Vec::new();
            m.encode(&mut buf);
            assert_eq!(Message::decode(&buf).unwrap(), m);
        }
    }

    #[test]
    fn header_size_estimate_matches_encoding() {
        let rec = LogRecord {
            txn: txn(),
            truncate_below: 1,
            truncated: vec![2, 3],
            body: LogBody::Abort,
        };
        let mut buf = Vec::new();
        rec.encode(&mut buf);
        assert_eq!(buf.len(), log_header_bytes(2));
        let rec = lock_record();
        let mut buf = Vec::new();
        rec.encode(&mut buf);
        let LogBody::Lock(ws) = &rec.body else {
            unreachable!()
        };
        assert_eq!(
            buf.len(),
            log_header_bytes(2)
                + write_set_bytes(ws.regions.len(), ws.writes.iter().map(|w| w.data.len()))
        );
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        let mut buf = Vec::new();
        lock_record().encode(&mut buf);
        // Every truncation of a valid record fails cleanly.
        for cut in 0..buf.len() {
            assert!(LogRecord::decode(&buf[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = buf.clone();
        bad[0] = 9;
        assert_eq!(LogRecord::decode(&bad), Err(WireError::Version(9)));
        let mut bad = buf.clone();
        bad[1] = 99;
        assert!(matches!(
            LogRecord::decode(&bad),
            Err(WireError::Kind { kind: 99, .. })
        ));
        let mut bad = buf.clone();
        bad.push(7);
        assert!(matches!(
            LogRecord::decode(&bad),
            Err(WireError::Invalid { .. })
        ));
        // A huge count does not allocate.
        let mut bad = Vec::new();
        Message::Validate {
            txn: txn(),
            reads: vec![],
        }
        .encode(&mut bad);
        let n = bad.len() - 4;
        bad[n..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Message::decode(&bad),
            Err(WireError::Invalid { .. })
        ));
    }

    #[test]
    fn malformed_recovery_messages_are_errors() {
        let mut buf = Vec::new();
        let vote = RecoveryBody::RecoveryVote(txn(), vec![RegionId(1)], WireVote::Lock);
        Message::Recovery {
            config: ConfigId(2),
            region: RegionId(1),
            body: vote,
        }
        .encode(&mut buf);
        for cut in 0..buf.len() {
            assert!(Message::decode(&buf[..cut]).is_err(), "cut at {cut}");
        }
        let last = buf.len() - 1;
        buf[last] = 9;
        assert_eq!(
            Message::decode(&buf),
            Err(WireError::Invalid {
                field: "vote",
                value: 9
            })
        );
        let mut bad = Vec::new();
        Message::Recovery {
            config: ConfigId(2),
            region: RegionId(1),
            body: RecoveryBody::RequestVote(txn()),
        }
        .encode(&mut bad);
        bad[2 + 8 + 4] = 77;
        assert!(matches!(
            Message::decode(&bad),
            Err(WireError::Kind {
                what: "recovery message",
                kind: 77
            })
        ));
    }

    #[test]
    fn an_alloc_asks_for_one_to_alloc_batch_max_slots() {
        let alloc = |count| {
            let mut bytes = Vec::new();
            Message::Alloc {
                request: 1,
                region: RegionId(0),
                len: 8,
                count,
            }
            .encode(&mut bytes);
            Message::decode(&bytes)
        };
        assert!(alloc(1).is_ok() && alloc(ALLOC_BATCH_MAX).is_ok());
        for count in [0, ALLOC_BATCH_MAX + 1] {
            assert_eq!(
                alloc(count),
                Err(WireError::Invalid {
                    field: "alloc count",
                    value: count as u64
                })
            );
        }
    }

    #[test]
    fn random_bytes_never_panic_the_decoders() {
        let mut rng = Rng::new(0xfa12);
        let mut valid = Vec::new();
        lock_record().encode(&mut valid);
        for i in 0..20_000 {
            let mut bytes = if i % 2 == 0 {
                valid.clone()
            } else {
                (0..rng.below(96)).map(|_| rng.next_u64() as u8).collect()
            };
            if !bytes.is_empty() {
                for _ in 0..=rng.below(4) {
                    let at = rng.below(bytes.len() as u64) as usize;
                    bytes[at] = rng.next_u64() as u8;
                }
            }
            let _ = LogRecord::decode(&bytes);
            let _ = Message::decode(&bytes);
        }
    }
}
