//! The CM's control messages between machines (§3, §5.2, §5.4): NEW-CONFIG, its ack,
//! NEW-CONFIG-COMMIT, REGIONS-ACTIVE and ALL-REGIONS-ACTIVE, a machine's request to join, region
//! allocation (the request, PREPARE and its answer, ABORT, the CM's answer), and those of a
//! whole-cluster restart (what each machine left, the restart decision and its acknowledgement,
//! and where each ring resumes: [`crate::restart`]). They travel as fabric datagrams beside the leases in every deployment, so they may
//! be lost or repeated: each is idempotent (installing or committing a configuration twice does
//! nothing the second time) and the sender repeats it until the answer it waits for arrives.
//!
//! A control datagram starts with [`CONTROL_TAG`], which no lease message starts with, so one
//! socket carries both.

use std::collections::BTreeMap;

use farm_core::codec::{decode_view, encode_view, StoredView};
use farm_core::config::{Configuration, RegionChanges, RegionMap};
use farm_core::{ConfigId, MachineId, RegionId};

pub use farm_core::fabric::CONTROL_TAG;

/// A control message.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum ControlMsg {
    /// CM to member: install this configuration and region map (§5.2 step 5).
    NewConfig(StoredView),
    /// Member to CM: installed (§5.2 step 6).
    NewConfigAck(ConfigId),
    /// CM to member: committed; transaction recovery may start (§5.2 step 7, §5.3).
    NewConfigCommit(ConfigId),
    /// Member to CM: committed here, and every region it is primary of is active (§5.4).
    RegionsActive(ConfigId),
    /// CM to member: every member's regions are active; data and allocator recovery may
    /// start (§5.4-5.5).
    AllRegionsActive(ConfigId),
    /// The machine that decided a whole-cluster restart to every machine: the cluster
    /// restarts as configuration `restart` (stored in the coordination store) from the view
    /// `from`, the newest any machine left in NVRAM. Repeated until the machine sends its
    /// [`ControlMsg::RingStarts`].
    Restart {
        /// The restart configuration's id.
        restart: ConfigId,
        /// The view restarted from.
        from: StoredView,
        /// The decider's life (`codec::RestartMark::life`).
        life: u64,
    },
    /// Any machine to the decider of a whole-cluster restart: it learnt restart configuration
    /// `0` ([`ControlMsg::Restart`]), which the decider then stops repeating to it.
    RestartAck(ConfigId),
    /// A machine whose part of a whole-cluster restart failed, to every other machine (and
    /// again to one that asks it anything of the restart): why. `restart` is the restart
    /// configuration it failed in, or 0 if it knew none. Peers whose restart cannot finish
    /// without it fail at once, naming it, instead of waiting until they give up.
    RestartRefused {
        /// The restart configuration, or 0.
        restart: ConfigId,
        /// Why (at most [`REFUSAL_BYTES_MAX`] bytes; never empty).
        reason: String,
    },
    /// After a restart, where the receiver found the sender's rings to it: per worker thread,
    /// `[log head, log tail, queue head, queue tail]`, so that the sender continues each at its
    /// tail. A request (`reply == false`) asks for the peer's in return.
    RingStarts {
        /// The restart configuration.
        config: ConfigId,
        /// Whether this answers a request.
        reply: bool,
        /// Per thread of the sender.
        starts: Vec<[u64; 4]>,
    },
    /// A machine outside the configuration to its CM: add me (§5.2, a join). Carries the
    /// configuration the machine read from the coordination store. Repeated until NEW-CONFIG
    /// adds it.
    Join(ConfigId),
    /// Every machine to every other of a whole-cluster restart: what it left in NVRAM, the
    /// newest view it installed and the regions it was still copying (with whether
    /// aggressively), from which the restart is decided, and its life (a number drawn at
    /// every start: `codec::RestartMark`). Repeated until it knows the decision.
    Persisted {
        /// The newest view the machine installed.
        view: StoredView,
        /// Regions whose replica it was still copying.
        copying: BTreeMap<RegionId, bool>,
        /// The sender's life.
        life: u64,
    },
    /// A member to its CM: this member can no longer write to `machine`, a member of
    /// configuration `config` (its connection broke), and one of the two must leave it: the CM
    /// removes `machine`, or this member when `machine` cannot be removed (it is the CM, or the
    /// last complete replica of a region). Repeated while so.
    Unreachable {
        /// The configuration both are members of.
        config: ConfigId,
        /// The machine this member cannot reach.
        machine: MachineId,
    },
    /// A member to its CM: allocate `count` regions, near region `near` if given (§3).
    /// Repeated until [`ControlMsg::Allocated`] or [`ControlMsg::AllocationRefused`] answers
    /// `request`, an id unique at the sender.
    Allocate {
        /// The sender's id of the request.
        request: u64,
        /// Regions wanted.
        count: u32,
        /// A region whose replicas the new ones should share (locality).
        near: Option<RegionId>,
    },
    /// The CM to a chosen replica: PREPARE these new regions of configuration `config` (map and
    /// register their NVRAM). Repeated until [`ControlMsg::RegionsPrepared`] answers.
    PrepareRegions {
        /// The CM's configuration.
        config: ConfigId,
        /// The regions, none of them in the replica's map yet.
        regions: Vec<RegionId>,
    },
    /// A replica to its CM: PREPARE of `regions` done (`ok`) or refused.
    RegionsPrepared {
        /// The configuration of the PREPARE.
        config: ConfigId,
        /// The regions of the PREPARE.
        regions: Vec<RegionId>,
        /// Whether the replica holds them ready.
        ok: bool,
    },
    /// The CM to a replica: the allocation of `regions` failed; release what was prepared.
    AbortRegions {
        /// The configuration of the PREPARE.
        config: ConfigId,
        /// The regions.
        regions: Vec<RegionId>,
    },
    /// The CM to the member that asked: `regions` are allocated, in a configuration that every
    /// member installed and the CM committed.
    Allocated {
        /// The member's id of the request.
        request: u64,
        /// The new regions.
        regions: Vec<RegionId>,
    },
    /// The CM to the member that asked: the allocation failed, and why.
    AllocationRefused {
        /// The member's id of the request.
        request: u64,
        /// Why, for the member's caller.
        reason: String,
    },
}

/// The longest reason an [`ControlMsg::AllocationRefused`] carries, in bytes (longer ones are
/// cut).
pub const REFUSAL_BYTES_MAX: usize = 512;

fn encode_regions(out: &mut Vec<u8>, regions: &[RegionId]) {
    for r in regions {
        out.extend_from_slice(&r.0.to_le_bytes());
    }
}

/// A non-empty list of regions, each once.
fn decode_regions(bytes: &[u8]) -> Option<Vec<RegionId>> {
    if bytes.is_empty() || !bytes.len().is_multiple_of(4) {
        return None;
    }
    let regions: Vec<RegionId> = bytes
        .chunks(4)
        .map(|c| RegionId(u32::from_le_bytes(c.try_into().expect("4 bytes"))))
        .collect();
    let distinct: std::collections::BTreeSet<RegionId> = regions.iter().copied().collect();
    (distinct.len() == regions.len()).then_some(regions)
}

impl ControlMsg {
    /// NEW-CONFIG of a view.
    pub fn new_config(
        config: &Configuration,
        map: &RegionMap,
        changes: &BTreeMap<RegionId, RegionChanges>,
    ) -> Self {
        ControlMsg::NewConfig(StoredView {
            config: config.clone(),
            map: map.clone(),
            changes: changes.clone(),
        })
    }

    /// The datagram.
    pub fn encode(&self) -> Vec<u8> {
        let (kind, id) = match self {
            ControlMsg::NewConfig(v) => (1u8, v.config.id),
            ControlMsg::NewConfigAck(c) => (2, *c),
            ControlMsg::NewConfigCommit(c) => (3, *c),
            ControlMsg::RegionsActive(c) => (4, *c),
            ControlMsg::AllRegionsActive(c) => (5, *c),
            ControlMsg::Restart { restart, .. } => (6, *restart),
            ControlMsg::RestartAck(c) => (7, *c),
            ControlMsg::RestartRefused { restart, .. } => (14, *restart),
            ControlMsg::RingStarts { config, reply, .. } => (8 + *reply as u8, *config),
            ControlMsg::Join(c) => (10, *c),
            ControlMsg::Persisted { view, .. } => (11, view.config.id),
            ControlMsg::Unreachable { config, .. } => (12, *config),
            ControlMsg::Allocate { request, .. } => (20, ConfigId(*request)),
            ControlMsg::PrepareRegions { config, .. } => (21, *config),
            ControlMsg::RegionsPrepared { config, ok, .. } => (22 + !*ok as u8, *config),
            ControlMsg::AbortRegions { config, .. } => (24, *config),
            ControlMsg::Allocated { request, .. } => (25, ConfigId(*request)),
            ControlMsg::AllocationRefused { request, .. } => (26, ConfigId(*request)),
        };
        let mut out = vec![CONTROL_TAG, kind];
        out.extend_from_slice(&id.0.to_le_bytes());
        match self {
            ControlMsg::NewConfig(v) => {
                out.extend_from_slice(&encode_view(&v.config, &v.map, &v.changes))
            }
            ControlMsg::Restart { from: v, life, .. } => {
                out.extend_from_slice(&life.to_le_bytes());
                out.extend_from_slice(&encode_view(&v.config, &v.map, &v.changes))
            }
            ControlMsg::RingStarts { starts, .. } => {
                for word in starts.iter().flatten() {
                    out.extend_from_slice(&word.to_le_bytes());
                }
            }
            ControlMsg::Persisted {
                view,
                copying,
                life,
            } => {
                out.extend_from_slice(&life.to_le_bytes());
                out.extend_from_slice(&(copying.len() as u32).to_le_bytes());
                for (r, aggressive) in copying {
                    out.extend_from_slice(&r.0.to_le_bytes());
                    out.push(*aggressive as u8);
                }
                out.extend_from_slice(&encode_view(&view.config, &view.map, &view.changes));
            }
            ControlMsg::Unreachable { machine, .. } => {
                out.extend_from_slice(&machine.0.to_le_bytes())
            }
            ControlMsg::Allocate { count, near, .. } => {
                out.extend_from_slice(&count.to_le_bytes());
                out.push(near.is_some() as u8);
                out.extend_from_slice(&near.map_or(0, |r| r.0).to_le_bytes());
            }
            ControlMsg::PrepareRegions { regions, .. }
            | ControlMsg::RegionsPrepared { regions, .. }
            | ControlMsg::AbortRegions { regions, .. }
            | ControlMsg::Allocated { regions, .. } => encode_regions(&mut out, regions),
            ControlMsg::AllocationRefused { reason, .. }
            | ControlMsg::RestartRefused { reason, .. } => {
                let mut end = reason.len().min(REFUSAL_BYTES_MAX);
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                out.extend_from_slice(&reason.as_bytes()[..end]);
            }
            _ => {}
        }
        out
    }

    /// Decodes a datagram; `None` for anything that is not a well-formed control message
    /// (datagrams are unauthenticated input: dropped, never trusted).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < 10 || bytes[0] != CONTROL_TAG {
            return None;
        }
        let id = ConfigId(u64::from_le_bytes(bytes[2..10].try_into().ok()?));
        let rest = &bytes[10..];
        let msg = match (bytes[1], rest.is_empty()) {
            (1, false) => {
                let view = decode_view(rest).ok()?;
                if view.config.id != id {
                    return None;
                }
                ControlMsg::NewConfig(view)
            }
            (2, true) => ControlMsg::NewConfigAck(id),
            (3, true) => ControlMsg::NewConfigCommit(id),
            (4, true) => ControlMsg::RegionsActive(id),
            (5, true) => ControlMsg::AllRegionsActive(id),
            (6, false) => {
                let life = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
                let from = decode_view(&rest[8..]).ok()?;
                if from.config.id >= id {
                    return None;
                }
                ControlMsg::Restart {
                    restart: id,
                    from,
                    life,
                }
            }
            (7, true) => ControlMsg::RestartAck(id),
            (8 | 9, false) if rest.len().is_multiple_of(32) => ControlMsg::RingStarts {
                config: id,
                reply: bytes[1] == 9,
                starts: rest
                    .chunks(32)
                    .map(|c| {
                        std::array::from_fn(|i| {
                            u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
                        })
                    })
                    .collect(),
            },
            (10, true) => ControlMsg::Join(id),
            (11, false) => {
                let life = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
                let rest = &rest[8..];
                let n = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
                let entries = rest.get(4..4 + n.checked_mul(5)?)?;
                let mut copying = BTreeMap::new();
                for e in entries.chunks(5) {
                    let aggressive = match e[4] {
                        0 => false,
                        1 => true,
                        _ => return None,
                    };
                    let r = RegionId(u32::from_le_bytes(e[..4].try_into().ok()?));
                    copying.insert(r, aggressive);
                }
                let view = decode_view(&rest[4 + n * 5..]).ok()?;
                if view.config.id != id || copying.len() != n {
                    return None;
                }
                ControlMsg::Persisted {
                    view,
                    copying,
                    life,
                }
            }
            (12, false) if rest.len() == 2 => ControlMsg::Unreachable {
                config: id,
                machine: MachineId(u16::from_le_bytes([rest[0], rest[1]])),
            },
            (20, false) if rest.len() == 9 => ControlMsg::Allocate {
                request: id.0,
                count: u32::from_le_bytes(rest[..4].try_into().ok()?),
                near: match rest[4] {
                    0 if rest[5..] == [0; 4] => None,
                    1 => Some(RegionId(u32::from_le_bytes(rest[5..].try_into().ok()?))),
                    _ => return None,
                },
            },
            (21, false) => ControlMsg::PrepareRegions {
                config: id,
                regions: decode_regions(rest)?,
            },
            (22 | 23, false) => ControlMsg::RegionsPrepared {
                config: id,
                regions: decode_regions(rest)?,
                ok: bytes[1] == 22,
            },
            (24, false) => ControlMsg::AbortRegions {
                config: id,
                regions: decode_regions(rest)?,
            },
            (25, false) => ControlMsg::Allocated {
                request: id.0,
                regions: decode_regions(rest)?,
            },
            (26, false) if rest.len() <= REFUSAL_BYTES_MAX => ControlMsg::AllocationRefused {
                request: id.0,
                reason: String::from_utf8(rest.to_vec()).ok()?,
            },
            (14, false) if rest.len() <= REFUSAL_BYTES_MAX => ControlMsg::RestartRefused {
                restart: id,
                reason: String::from_utf8(rest.to_vec()).ok()?,
            },
            _ => return None,
        };
        Some(msg)
    }
}

/// The longest control datagram: UDP's payload limit (65,507 bytes) with room to spare. A
/// longer message (NEW-CONFIG of a view with thousands of regions) travels in pieces.
pub const DATAGRAM_BYTES_MAX: usize = 60_000;

/// The longest control message reassembled from pieces (a view of the most regions a
/// configuration may map is well below it); longer ones are dropped.
pub const MESSAGE_BYTES_MAX: usize = 16 << 20;

/// Messages in pieces a receiver assembles at once from one sender: the oldest gives way (a
/// message whose piece was lost is sent again whole, under a new id).
pub const PARTIAL_PER_SENDER_MAX: usize = 4;

/// The kind of a piece of a longer message (no message has this kind).
const PIECE: u8 = 13;

/// Tag, kind, message id, index, count, total length.
const PIECE_HEADER_BYTES: usize = 2 + 8 + 4 + 4 + 4;

impl ControlMsg {
    /// The datagrams that carry this message: one, or pieces of at most
    /// [`DATAGRAM_BYTES_MAX`] bytes under the sender's message id `id` (each message sent in
    /// pieces needs an id the sender has not used for one yet), for [`Reassembly`] to join.
    pub fn datagrams(&self, id: u64) -> Vec<Vec<u8>> {
        let whole = self.encode();
        if whole.len() <= DATAGRAM_BYTES_MAX {
            return vec![whole];
        }
        assert!(
            whole.len() <= MESSAGE_BYTES_MAX,
            "a control message of {} bytes",
            whole.len()
        );
        let chunk = DATAGRAM_BYTES_MAX - PIECE_HEADER_BYTES;
        let count = whole.len().div_ceil(chunk) as u32;
        whole
            .chunks(chunk)
            .enumerate()
            .map(|(i, part)| {
                let mut d = Vec::with_capacity(PIECE_HEADER_BYTES + part.len());
                d.extend_from_slice(&[CONTROL_TAG, PIECE]);
                d.extend_from_slice(&id.to_le_bytes());
                d.extend_from_slice(&(i as u32).to_le_bytes());
                d.extend_from_slice(&count.to_le_bytes());
                d.extend_from_slice(&(whole.len() as u32).to_le_bytes());
                d.extend_from_slice(part);
                debug_assert!(d.len() <= DATAGRAM_BYTES_MAX);
                d
            })
            .collect()
    }
}

/// A message in pieces, partly arrived.
#[derive(Debug)]
struct Partial {
    count: u32,
    total: u32,
    pieces: BTreeMap<u32, Vec<u8>>,
    bytes: usize,
    /// When it started, in arrivals at this receiver (the oldest gives way).
    started: u64,
}

/// Joins the pieces of control messages ([`ControlMsg::datagrams`]) at a receiver; whole
/// messages pass through. Bounded: [`PARTIAL_PER_SENDER_MAX`] messages in progress per sender,
/// [`MESSAGE_BYTES_MAX`] bytes each. Pieces are unauthenticated input: a malformed one is
/// dropped, and one that disagrees with the others of its message drops the message.
#[derive(Debug, Default)]
pub struct Reassembly {
    partial: BTreeMap<(MachineId, u64), Partial>,
    arrivals: u64,
}

impl Reassembly {
    /// A receiver with nothing in progress.
    pub fn new() -> Self {
        Self::default()
    }

    /// A control datagram from `from`: the message it completes, if any.
    pub fn accept(&mut self, from: MachineId, datagram: &[u8]) -> Option<ControlMsg> {
        if datagram.len() < 2 || datagram[0] != CONTROL_TAG || datagram[1] != PIECE {
            return ControlMsg::decode(datagram);
        }
        if datagram.len() <= PIECE_HEADER_BYTES {
            return None;
        }
        let word = |at: usize| u32::from_le_bytes(datagram[at..at + 4].try_into().expect("4"));
        let id = u64::from_le_bytes(datagram[2..10].try_into().expect("8 bytes"));
        let (index, count, total) = (word(10), word(14), word(18));
        if count < 2 || index >= count || total as usize > MESSAGE_BYTES_MAX {
            return None;
        }
        self.arrivals += 1;
        let key = (from, id);
        if !self.partial.contains_key(&key) {
            let mine: Vec<(u64, u64)> = (self.partial.iter())
                .filter(|((m, _), _)| *m == from)
                .map(|((_, id), p)| (p.started, *id))
                .collect();
            if mine.len() >= PARTIAL_PER_SENDER_MAX {
                let oldest = mine.iter().min().expect("some").1;
                self.partial.remove(&(from, oldest));
            }
            self.partial.insert(
                key,
                Partial {
                    count,
                    total,
                    pieces: BTreeMap::new(),
                    bytes: 0,
                    started: self.arrivals,
                },
            );
        }
        let p = self.partial.get_mut(&key).expect("inserted");
        let part = &datagram[PIECE_HEADER_BYTES..];
        if p.count != count || p.total != total || p.bytes + part.len() > total as usize {
            self.partial.remove(&key);
            return None;
        }
        if p.pieces.contains_key(&index) {
            return None; // A duplicate.
        }
        p.bytes += part.len();
        p.pieces.insert(index, part.to_vec());
        if p.pieces.len() < count as usize {
            return None;
        }
        let p = self.partial.remove(&key).expect("complete");
        if p.bytes != p.total as usize {
            return None;
        }
        let whole: Vec<u8> = p.pieces.into_values().flatten().collect();
        ControlMsg::decode(&whole)
    }

    /// Messages in progress (for bounds in tests).
    pub fn in_progress(&self) -> usize {
        self.partial.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_messages_round_trip_and_garbage_is_dropped() {
        let mut config = Configuration::initial(3);
        config.id = ConfigId(7);
        let map = RegionMap::striped(3, 2, 2);
        let changes = BTreeMap::from([(
            RegionId(1),
            RegionChanges {
                last_primary_change: ConfigId(7),
                last_replica_change: ConfigId(6),
            },
        )]);
        let all = [
            ControlMsg::new_config(&config, &map, &changes),
            ControlMsg::NewConfigAck(ConfigId(7)),
            ControlMsg::NewConfigCommit(ConfigId(7)),
            ControlMsg::RegionsActive(ConfigId(7)),
            ControlMsg::AllRegionsActive(ConfigId(u64::MAX)),
            ControlMsg::Restart {
                restart: ConfigId(9),
                from: StoredView {
                    config: config.clone(),
                    map: map.clone(),
                    changes: changes.clone(),
                },
                life: 7,
            },
            ControlMsg::RingStarts {
                config: ConfigId(9),
                reply: false,
                starts: vec![[1, 2, 3, 4], [5, 6, 7, u64::MAX]],
            },
            ControlMsg::RingStarts {
                config: ConfigId(9),
                reply: true,
                starts: vec![[0; 4]],
            },
            ControlMsg::Join(ConfigId(4)),
            ControlMsg::Persisted {
                view: StoredView {
                    config: config.clone(),
                    map: map.clone(),
                    changes: changes.clone(),
                },
                copying: BTreeMap::from([(RegionId(1), true), (RegionId(4), false)]),
                life: u64::MAX,
            },
            ControlMsg::Unreachable {
                config: ConfigId(5),
                machine: MachineId(2),
            },
            ControlMsg::Allocate {
                request: 3,
                count: 2,
                near: None,
            },
            ControlMsg::Allocate {
                request: u64::MAX,
                count: 1,
                near: Some(RegionId(7)),
            },
            ControlMsg::PrepareRegions {
                config: ConfigId(2),
                regions: vec![RegionId(4), RegionId(5)],
            },
            ControlMsg::RegionsPrepared {
                config: ConfigId(2),
                regions: vec![RegionId(4)],
                ok: true,
            },
            ControlMsg::RegionsPrepared {
                config: ConfigId(2),
                regions: vec![RegionId(u32::MAX)],
                ok: false,
            },
            ControlMsg::AbortRegions {
                config: ConfigId(2),
                regions: vec![RegionId(4)],
            },
            ControlMsg::Allocated {
                request: 3,
                regions: vec![RegionId(9), RegionId(8)],
            },
            ControlMsg::AllocationRefused {
                request: 3,
                reason: "no capacity".into(),
            },
            ControlMsg::RestartAck(ConfigId(9)),
            ControlMsg::RestartRefused {
                restart: ConfigId(0),
                reason: "reopening machine 1's NVRAM: disk gone".into(),
            },
        ];
        for m in &all {
            assert_eq!(ControlMsg::decode(&m.encode()).as_ref(), Some(m));
            // As a receiver takes it: no kind is taken for a piece of a long message.
            let mut r = Reassembly::new();
            let d = m.datagrams(1);
            assert_eq!(d.len(), 1);
            assert_eq!(r.accept(MachineId(1), &d[0]).as_ref(), Some(m));
        }
        let new_config = all[0].encode();
        // Truncated, retagged, an unknown kind, a view whose id disagrees, trailing bytes.
        assert_eq!(
            ControlMsg::decode(&new_config[..new_config.len() - 1]),
            None
        );
        let mut bad = new_config.clone();
        bad[0] = 1;
        assert_eq!(ControlMsg::decode(&bad), None);
        bad = new_config.clone();
        bad[1] = 9;
        assert_eq!(ControlMsg::decode(&bad), None);
        bad = new_config.clone();
        bad[2] = 8;
        assert_eq!(ControlMsg::decode(&bad), None);
        let mut ack = all[1].encode();
        ack.push(0);
        assert_eq!(ControlMsg::decode(&ack), None);
        // A restart to a configuration not newer than its view; ring starts cut mid-word.
        let mut restart = all[5].encode();
        restart[2..10].copy_from_slice(&7u64.to_le_bytes());
        assert_eq!(ControlMsg::decode(&restart), None);
        let starts = all[6].encode();
        assert_eq!(ControlMsg::decode(&starts[..starts.len() - 8]), None);
        // A region listed twice, a list cut mid-id, a locality flag that is neither.
        let mut twice = all[13].encode();
        twice.truncate(twice.len() - 4);
        twice.extend_from_slice(&4u32.to_le_bytes());
        assert_eq!(ControlMsg::decode(&twice), None);
        let prepared = all[14].encode();
        assert_eq!(ControlMsg::decode(&prepared[..prepared.len() - 1]), None);
        let mut near = all[12].encode();
        near[14] = 2;
        assert_eq!(ControlMsg::decode(&near), None);
        // A refusal's reason is cut at a character boundary.
        let long = ControlMsg::AllocationRefused {
            request: 1,
            reason: "é".repeat(REFUSAL_BYTES_MAX),
        };
        let ControlMsg::AllocationRefused { reason, .. } =
            ControlMsg::decode(&long.encode()).unwrap()
        else {
            panic!("not a refusal");
        };
        assert_eq!(reason, "é".repeat(REFUSAL_BYTES_MAX / 2));
        // Lease datagrams are not control messages.
        let lease = crate::LeaseMsg::Grant {
            config: ConfigId(1),
            seq: 1,
        };
        assert_eq!(ControlMsg::decode(&lease.encode()), None);
    }

    /// A view of thousands of regions is longer than one datagram: it travels in pieces,
    /// joined whatever their order, duplicates ignored; a lost piece completes nothing, and at
    /// most `PARTIAL_PER_SENDER_MAX` messages wait per sender.
    #[test]
    fn long_messages_travel_in_pieces() {
        let mut config = Configuration::initial(5);
        config.id = ConfigId(9);
        let map = RegionMap::striped(5, 820, 2);
        let changes: BTreeMap<RegionId, RegionChanges> = map
            .iter()
            .map(|(r, _)| {
                let c = RegionChanges {
                    last_primary_change: ConfigId(9),
                    last_replica_change: ConfigId(9),
                };
                (r, c)
            })
            .collect();
        let msg = ControlMsg::new_config(&config, &map, &changes);
        assert!(
            msg.encode().len() > 2 * DATAGRAM_BYTES_MAX,
            "a test of pieces"
        );
        let pieces = msg.datagrams(7);
        assert!(pieces.len() >= 3 && pieces.iter().all(|d| d.len() <= DATAGRAM_BYTES_MAX));
        let mut r = Reassembly::new();
        let from = MachineId(1);
        let mut order: Vec<usize> = (0..pieces.len()).rev().collect();
        order.insert(1, order[0]); // A duplicate.
        let last = order.pop().expect("pieces");
        for i in order {
            assert_eq!(r.accept(from, &pieces[i]), None);
        }
        assert_eq!(r.accept(from, &pieces[last]), Some(msg.clone()));
        assert_eq!(r.in_progress(), 0);
        // Short messages pass through.
        let ack = ControlMsg::NewConfigAck(ConfigId(9));
        assert_eq!(ack.datagrams(8).len(), 1);
        assert_eq!(r.accept(from, &ack.datagrams(8)[0]), Some(ack));
        // Lost pieces: nothing completes, and old partial messages give way.
        for id in 0..10 {
            assert_eq!(r.accept(from, &msg.datagrams(100 + id)[0]), None);
        }
        assert_eq!(r.in_progress(), PARTIAL_PER_SENDER_MAX);
        // A piece that disagrees with its message's others, and a malformed one.
        let mut other = msg.datagrams(200);
        assert_eq!(r.accept(from, &other[0]), None);
        other[1][14] ^= 1; // Another count.
        assert_eq!(r.accept(from, &other[1]), None);
        assert_eq!(r.accept(from, &other[2]), None, "the message was dropped");
        assert_eq!(r.accept(from, &other[1][..10]), None);
    }
}
