//! The `verbs` queue-pair layer on a real RDMA device (cargo feature `verbs`): two queue pairs
//! of one device connected to each other, one-sided WRITEs and a READ posted as one batch,
//! their completions polled. Where the machine has no RDMA device (this project's machines
//! have none), the test says why and checks only that opening a device failed cleanly.
#![cfg(feature = "verbs")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use farm_core::nvram::Nvram;
use farm_fabric::verbs::{Completion, Device, Op, WorkRequest};

const BYTES: usize = 1 << 16;
const PAGE: usize = 4096;

#[test]
fn a_batch_of_writes_and_a_read_complete_in_order_on_a_loopback_queue_pair() {
    let device = match Device::open().expect("opening an RDMA device failed") {
        Ok(device) => device,
        Err(why) => {
            eprintln!("skipped: {why}; the verbs queue pairs were not exercised");
            return;
        }
    };
    eprintln!("on RDMA device {}", device.name());
    let (a_mem, b_mem) = (
        Arc::new(Nvram::anonymous(BYTES).unwrap()),
        Arc::new(Nvram::anonymous(BYTES).unwrap()),
    );
    let pattern: Vec<u8> = (0..BYTES).map(|i| (i * 7 + 3) as u8).collect();
    a_mem.write(0, &pattern);
    let (a, b) = (
        device.register(a_mem.clone()).unwrap(),
        device.register(b_mem.clone()).unwrap(),
    );
    let (mut qa, mut qb) = (
        device.queue_pair(64).unwrap(),
        device.queue_pair(64).unwrap(),
    );
    let (at_a, at_b) = (qa.address(), qb.address());
    qa.connect(&at_b).unwrap();
    qb.connect(&at_a).unwrap();

    // Four pages written from a to b, unsignaled but the last, then the first page read back
    // from b into a's second half: one doorbell, and the read sees the writes before it.
    let mut batch: Vec<WorkRequest> = (0..4u64)
        .map(|i| WorkRequest {
            id: i,
            op: Op::Write,
            local: a.local(i as usize * PAGE, PAGE),
            remote: b.remote(),
            offset: i * PAGE as u64,
            signaled: i == 3,
        })
        .collect();
    batch.push(WorkRequest {
        id: 100,
        op: Op::Read,
        local: a.local(BYTES / 2, PAGE),
        remote: b.remote(),
        offset: 0,
        signaled: true,
    });
    qa.post(&batch).unwrap();

    let mut done: Vec<Completion> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while done.len() < 2 {
        qa.poll(&mut done).unwrap();
        assert!(Instant::now() < deadline, "completions: {done:?}");
        std::hint::spin_loop();
    }
    let ids: Vec<u64> = done.iter().map(|c| c.id).collect();
    assert_eq!(ids, [3, 100], "signaled requests complete in order");
    assert!(done.iter().all(|c| c.status.is_ok()), "{done:?}");

    let mut got = vec![0u8; 4 * PAGE];
    b_mem.read(0, &mut got);
    assert_eq!(got, pattern[..4 * PAGE], "the writes landed at b");
    let mut read = vec![0u8; PAGE];
    a_mem.read(BYTES / 2, &mut read);
    assert_eq!(
        read,
        pattern[..PAGE],
        "the read brought b's first page back"
    );
    let mut untouched = vec![0u8; PAGE];
    b_mem.read(4 * PAGE, &mut untouched);
    assert!(untouched.iter().all(|&x| x == 0), "nothing past the writes");
}
