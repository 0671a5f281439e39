//! Input from another machine never panics a worker (issue 16 case 7): a record or message
//! whose checksum holds but which does not decode (a peer built with another record version,
//! or a peer's bug), or which no coordinator sends in that state (COMMIT-PRIMARY without a
//! LOCK), is logged, counted and skipped, nothing applied, and the worker goes on serving
//! everyone else.

mod common;

use common::{drive, start};
use farm_core::fabric::{Endpoint, Fabric, MemKey};
use farm_core::ring::{frame, RingKind};
use farm_core::wire::{LogBody, LogRecord, Message};
use farm_core::{Addr, ConfigId, MachineId, ThreadId, TxnId};
use farm_txn::{Replication, Tx, Worker};

fn read(w: &mut [Worker], m: usize, a: Addr) -> u64 {
    let mut tx = Tx::new(&mut w[m]);
    let v = tx.read(a, 8).unwrap().to_vec();
    let state = tx.into_state();
    w[m].abort_execution(state, &farm_txn::TxError::Aborted("read only".into()));
    u64::from_le_bytes(v[..8].try_into().unwrap())
}

#[test]
fn a_record_that_does_not_decode_is_skipped_and_changes_nothing() {
    let (mut w, fabric) = common::workers_over(2 << 20, 1, Replication::OneSided);
    let mut now = 0;
    let a = common::object_at_0(&mut w, &mut now, 5);
    // Machine 2, which never wrote to machine 0, appends to both of its rings there a record
    // framed and checksummed like any other, of a record version this build does not speak;
    // then, in its log, a record that decodes but that no coordinator sends in this state:
    // COMMIT-PRIMARY for a transaction whose LOCK never came.
    let garbage = vec![0xee; 40];
    let commit = LogRecord {
        txn: TxnId {
            config: ConfigId(1),
            machine: MachineId(2),
            thread: ThreadId(0),
            local: 7,
        },
        truncate_below: 0,
        truncated: Vec::new(),
        body: LogBody::CommitPrimary,
    };
    let commit = encoded(|b| commit.encode(b));
    append(&w, &fabric, RingKind::Log, [garbage.clone(), commit]);
    append(&w, &fabric, RingKind::Queue, [garbage]);
    for _ in 0..10 {
        now += 1;
        w[0].poll(now);
    }
    assert_eq!(w[0].stats().malformed, 3, "every record counted");
    assert_eq!(read(&mut w, 1, a), 5, "nothing applied");
    // Machine 0 serves the others as before.
    start(&mut w, 1, |tx| tx.write(a, &6u64.to_le_bytes()));
    drive(&mut w, 1, &[0, 1, 2], &mut now, 1000)
        .expect("the commit ends")
        .unwrap();
    // The primary applies COMMIT-PRIMARY at its next polls.
    for _ in 0..10 {
        now += 1;
        for x in w.iter_mut() {
            x.poll(now);
        }
    }
    assert_eq!(read(&mut w, 2, a), 6);
}

/// Machine 2 appends `payloads` to its ring of `kind` at machine 0, framed one after the other.
fn append(
    w: &[Worker],
    fabric: &farm_fabric::mem::MemFabric,
    kind: RingKind,
    payloads: impl IntoIterator<Item = Vec<u8>>,
) {
    let layout = w[0].machine().params.layout;
    let src = Endpoint {
        machine: MachineId(2),
        thread: ThreadId(0),
    };
    let mut at = layout.ring_offset(MachineId(2), ThreadId(0), kind);
    for payload in payloads {
        let mut framed = Vec::new();
        frame(&payload, &mut framed);
        fabric
            .write(src, MachineId(0), MemKey::Rings, at as u64, &framed)
            .unwrap();
        at += framed.len();
    }
}

fn encoded(encode: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut payload = Vec::new();
    encode(&mut payload);
    payload
}

/// LOCK and COMMIT-BACKUP records whose writes no coordinator sends (beyond the region, at an
/// offset no object starts at, at a header read locked) and a second LOCK under one
/// transaction's id are skipped like records that do not decode: nothing is locked or applied.
#[test]
fn writes_no_coordinator_sends_are_skipped() {
    let (mut w, fabric) = common::workers_over(2 << 20, 1, Replication::OneSided);
    let mut now = 0;
    let a = common::object_at_0(&mut w, &mut now, 5);
    let (header, _) = w[0].read_object(a, 8).unwrap();
    let region_bytes = w[0].machine().params.region_bytes as u32;
    let txn = |local| TxnId {
        config: ConfigId(1),
        machine: MachineId(2),
        thread: ThreadId(0),
        local,
    };
    let write = |addr: Addr, read: farm_core::object::Header| farm_core::wire::WriteEntry {
        addr,
        read,
        allocated: true,
        data: 9u64.to_le_bytes().to_vec(),
    };
    let lock = |local, writes| LogRecord {
        txn: txn(local),
        truncate_below: 0,
        truncated: Vec::new(),
        body: LogBody::Lock(farm_core::wire::WriteSet {
            regions: vec![a.region],
            writes,
        }),
    };
    let beyond = Addr {
        offset: region_bytes - 8,
        ..a
    };
    let misaligned = Addr {
        offset: a.offset + 3,
        ..a
    };
    let records = [
        lock(1, vec![write(beyond, header)]),
        lock(2, vec![write(misaligned, header)]),
        lock(3, vec![write(a, header.with_lock())]),
        // A LOCK that takes a's lock, then another under the same id.
        lock(4, vec![write(a, header)]),
        lock(4, vec![write(a, header)]),
        LogRecord {
            txn: txn(5),
            truncate_below: 0,
            truncated: Vec::new(),
            body: LogBody::CommitBackup(farm_core::wire::WriteSet {
                regions: vec![a.region],
                writes: vec![write(beyond, header)],
            }),
        },
    ];
    let locks_before = w[0].stats().locks_processed;
    append(
        &w,
        &fabric,
        RingKind::Log,
        records.iter().map(|r| encoded(|b| r.encode(b))),
    );
    for _ in 0..10 {
        now += 1;
        w[0].poll(now);
    }
    assert_eq!(w[0].stats().malformed, 5, "every such record counted");
    assert_eq!(
        w[0].stats().locks_processed,
        locks_before + 1,
        "only the first LOCK of transaction 4 taken"
    );
}

/// RELEASE messages for no slot handed out (a size no slot has, an offset no slot starts at, a
/// slot of block 0, an allocated object, a slot already free) are skipped like records that
/// do not decode: the free lists stay as they were.
#[test]
fn releases_of_no_slot_handed_out_are_skipped() {
    let (mut w, fabric) = common::workers_over(2 << 20, 1, Replication::OneSided);
    let mut now = 0;
    let a = common::object_at_0(&mut w, &mut now, 5);
    let slot = 16;
    let release = |addr: Addr, slot_bytes| Message::Release {
        addr,
        slot_bytes,
        config: ConfigId(1),
    };
    let at = |offset| Addr { offset, ..a };
    let messages = [
        release(a, 24),
        release(at(a.offset + 8), slot),
        release(at(64), slot),
        release(a, slot),
        // A slot of a's block that is on the free list (never handed out).
        release(at(a.offset + 4 * slot), slot),
    ];
    append(
        &w,
        &fabric,
        RingKind::Queue,
        messages.iter().map(|m| encoded(|b| m.encode(b))),
    );
    for _ in 0..10 {
        now += 1;
        w[0].poll(now);
    }
    assert_eq!(w[0].stats().malformed, 5, "every release skipped");
    assert_eq!(read(&mut w, 1, a), 5, "a is still allocated");
}
