//! A peer that floods a worker never panics it (issue 16 case 7): the worker's bounded
//! buffers for a peer (messages waiting for queue space there, recovery messages kept for a
//! restart) fill up without bringing it down, and it goes on serving everyone else.

mod common;

use common::{drive, start};
use farm_core::fabric::{Endpoint, Fabric, MemKey};
use farm_core::ring::{frame, skip_marker, RingKind, RingWriter};
use farm_core::wire::{Message, RecoveryBody};
use farm_core::{Addr, ConfigId, MachineId, ThreadId, TxnId};
use farm_fabric::mem::MemFabric;
use farm_txn::{Replication, Worker};

/// Machine 2 writing to machine 0's queue from it by hand, as a peer that never polls its
/// own rings: it learns the space machine 0 freed from the feedback machine 0 reports.
struct Flooder {
    writer: RingWriter,
    framed: Vec<u8>,
}

const SENDER: MachineId = MachineId(2);
const SRC: Endpoint = Endpoint {
    machine: SENDER,
    thread: ThreadId(0),
};

impl Flooder {
    fn new(w: &[Worker]) -> Self {
        Self {
            writer: RingWriter::new(w[0].machine().params.layout.queue_bytes),
            framed: Vec::new(),
        }
    }

    /// Appends `msg` to machine 0's queue from machine 2; false when the queue is full.
    fn send(&mut self, w: &[Worker], fabric: &MemFabric, msg: &Message) -> bool {
        let layout = w[0].machine().params.layout;
        let slot = layout.feedback_offset(MachineId(0), ThreadId(0), RingKind::Queue);
        let head = w[SENDER.0 as usize]
            .machine()
            .feedback
            .load_u64(slot, std::sync::atomic::Ordering::Acquire);
        self.writer.update_head(head);
        let mut payload = Vec::new();
        msg.encode(&mut payload);
        frame(&payload, &mut self.framed);
        let Some(place) = self.writer.place(self.framed.len(), 0) else {
            return false;
        };
        let base = layout.ring_offset(SENDER, ThreadId(0), RingKind::Queue);
        if let Some((at, len)) = place.skip {
            fabric
                .write(
                    SRC,
                    MachineId(0),
                    MemKey::Rings,
                    (base + at) as u64,
                    &skip_marker(len),
                )
                .unwrap();
        }
        fabric
            .write(
                SRC,
                MachineId(0),
                MemKey::Rings,
                (base + place.offset) as u64,
                &self.framed,
            )
            .unwrap();
        true
    }
}

fn txn(local: u64) -> TxnId {
    TxnId {
        config: ConfigId(1),
        machine: SENDER,
        thread: ThreadId(0),
        local,
    }
}

/// Machine 1 commits a write of `value` to `a` through machine 0 as a primary or backup.
fn commit(w: &mut [Worker], now: &mut u64, a: Addr, value: u64) {
    start(w, 1, |tx| tx.write(a, &value.to_le_bytes()));
    drive(w, 1, &[0, 1], now, 10_000)
        .expect("the commit ends")
        .unwrap();
}

#[test]
fn a_peer_that_never_reads_its_replies_is_cut_off_and_reported() {
    let (mut w, fabric) = common::workers_over(2 << 20, 1, Replication::OneSided);
    let mut now = 0;
    let a = common::object_at_0(&mut w, &mut now, 1);
    // Machine 2 asks machine 0 to validate, over and over, and never reads a reply: the replies
    // fill its queue from machine 0, then wait at machine 0 for space that never comes.
    let mut flood = Flooder::new(&w);
    let mut sent = 0u64;
    while sent < 100_000 && w[0].machine().unreachable_members().is_empty() {
        let msg = Message::Validate {
            txn: txn(sent),
            reads: Vec::new(),
        };
        if flood.send(&w, &fabric, &msg) {
            sent += 1;
        } else {
            now += 1;
            w[0].poll(now);
        }
    }
    assert_eq!(
        w[0].machine().unreachable_members(),
        vec![SENDER],
        "machine 0 reports machine 2 once its messages there stopped moving ({sent} sent)"
    );
    assert!(w[0].stats().cut_links >= 1);
    // Machine 0 serves machine 1 as before.
    commit(&mut w, &mut now, a, 7);
}

#[test]
fn a_full_recovery_log_keeps_recovery_messages_in_their_queue() {
    let (mut w, fabric) = common::workers_over(2 << 20, 1, Replication::OneSided);
    let mut now = 0;
    let a = common::object_at_0(&mut w, &mut now, 1);
    // Machine 2 sends decisions of transactions nobody recovers, which machine 0 keeps for a
    // restart until they are forgotten: more than its recovery log holds, until the queue from
    // machine 2 is full as well.
    let log_bytes = w[0].machine().params.layout.log_bytes;
    let mut flood = Flooder::new(&w);
    let mut sent = 0u64;
    let mut full = 0;
    while full < 100 {
        let msg = Message::Recovery {
            config: ConfigId(1),
            region: a.region,
            body: RecoveryBody::CommitRecovery(txn(sent)),
        };
        if flood.send(&w, &fabric, &msg) {
            sent += 1;
        } else {
            full += 1;
        }
        now += 1;
        w[0].poll(now);
    }
    assert!(
        sent as usize * 40 > log_bytes,
        "{sent} decisions sent, more than the recovery log holds"
    );
    assert!(w[0].stats().recovery_log_full > 0);
    // Machine 0 serves machine 1 as before.
    commit(&mut w, &mut now, a, 7);
}

/// Recovery messages for a configuration this machine has not drained yet are kept until it
/// has (`recovery.early`); a peer that names configurations further ahead than any peer can
/// (more than one beyond the newest view this machine installed: a member acknowledges
/// NEW-CONFIG only once installed, §5.2) is refused and counted, so that it cannot grow what
/// the worker keeps without limit. Before, every one was kept.
#[test]
fn recovery_messages_of_configurations_far_ahead_are_refused_and_counted() {
    let (mut w, fabric) = common::workers_over(2 << 20, 1, Replication::OneSided);
    let mut now = 0;
    let a = common::object_at_0(&mut w, &mut now, 1);
    let installed = w[0].machine().view().config.id;
    let mut flood = Flooder::new(&w);
    let mut send = |w: &mut [Worker], now: &mut u64, config: ConfigId, n: u64| {
        let mut sent = 0;
        while sent < n {
            let msg = Message::Recovery {
                config,
                region: a.region,
                body: RecoveryBody::RequestVote(txn(sent)),
            };
            if flood.send(w, &fabric, &msg) {
                sent += 1;
            }
            *now += 1;
            w[0].poll(*now);
        }
    };
    // The next configuration's messages may come before this machine installs it: kept.
    send(&mut w, &mut now, ConfigId(installed.0 + 1), 10);
    assert_eq!(w[0].recovery_messages_early(), 10);
    assert_eq!(w[0].stats().recovery_refused, 0);
    // Further ahead: refused, however many come.
    send(&mut w, &mut now, ConfigId(installed.0 + 1000), 20_000);
    assert_eq!(w[0].stats().recovery_refused, 20_000);
    assert_eq!(w[0].recovery_messages_early(), 10);
    // Machine 0 serves machine 1 as before.
    commit(&mut w, &mut now, a, 7);
}
