//! How backups acknowledge COMMIT-BACKUP (§4 step 3). With FaRM's one-sided replication the
//! coordinator waits only for the writes of the records into the backups' NVRAM logs, so a
//! commit completes while a backup's CPU is busy elsewhere; with RPC replication (Tailwind's
//! baseline) it waits until every backup's CPU has processed its record and answered.

mod common;

use common::{drive, start};
use farm_core::Addr;
use farm_txn::{Replication, Tx, TxError, Worker};

/// Machine 0 writes an object whose primary is machine 1 (backups: machines 2 and 0, so the
/// coordinator is a backup too) while machine 2 does not poll. Returns the workers, the object
/// and the commit's outcome within 2,000 polls.
fn write_with_a_busy_backup(
    replication: Replication,
) -> (Vec<Worker>, Addr, u64, Option<Result<(), TxError>>) {
    let mut w = common::workers_replicating(2 << 20, 2, replication);
    let mut now = 0;
    let mut obj = None;
    start(&mut w, 1, |tx| {
        obj = Some(tx.alloc(8, None)?);
        Ok(())
    });
    drive(&mut w, 1, &[0, 1, 2], &mut now, 1000)
        .expect("allocation commits")
        .unwrap();
    let obj = obj.unwrap();
    start(&mut w, 0, |tx| tx.write(obj, &7u64.to_le_bytes()));
    let r = drive(&mut w, 0, &[0, 1], &mut now, 2000);
    (w, obj, now, r)
}

#[test]
fn one_sided_replication_commits_without_the_backups_cpu() {
    let (mut w, obj, now, r) = write_with_a_busy_backup(Replication::OneSided);
    r.expect("the commit completes while machine 2 does not poll")
        .unwrap();
    assert_eq!(read(&mut w, obj, now), 7);
}

/// Reads `obj` at machine 0 once its primary, machine 1, applied COMMIT-PRIMARY (success was
/// reported on the record's ack).
fn read(w: &mut [Worker], obj: Addr, now: u64) -> u64 {
    w[1].poll(now + 1);
    let mut tx = Tx::new(&mut w[0]);
    let v = tx.read(obj, 8).unwrap();
    u64::from_le_bytes(v[..8].try_into().unwrap())
}

#[test]
fn rpc_replication_waits_for_every_backups_cpu() {
    let (mut w, obj, mut now, r) = write_with_a_busy_backup(Replication::Rpc);
    assert!(
        r.is_none(),
        "the commit completed before machine 2 processed its COMMIT-BACKUP: {r:?}"
    );
    // Machine 2 processes its log and answers: the commit completes, with the write.
    drive(&mut w, 0, &[0, 1, 2], &mut now, 2000)
        .expect("the commit completes once machine 2 answers")
        .unwrap();
    assert_eq!(read(&mut w, obj, now), 7);
}
