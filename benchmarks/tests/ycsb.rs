//! YCSB workload A end to end in both replication modes: two clients run the mix, every value
//! is then one a PUT wrote for its key, PUTs are about half of the operations, and the backups
//! answered COMMIT-BACKUP with their CPUs exactly when the cluster replicates by RPC.

use std::sync::Arc;

use farm::{Cluster, Replication};
use farm_benchmarks::runner::Workload;
use farm_benchmarks::ycsb::{Mix, Ycsb};
use farm_workloads::Rand;

const OPS: u64 = 10_000;

fn run(replication: Replication) -> farm::Stats {
    let c = Arc::new(
        Cluster::builder()
            .machines(3)
            .replicas(3)
            .region_bytes(64 << 20)
            .replication(replication)
            .build()
            .unwrap(),
    );
    let ycsb = Arc::new(Ycsb::populate(&c, 3_000, 100, Mix::A, 0.99, 2, &|_| {}).unwrap());
    let clients: Vec<_> = (0..2u64)
        .map(|id| {
            let (c, y) = (c.clone(), ycsb.clone());
            std::thread::spawn(move || {
                let session = c.session();
                let mut rng = Rand::new(id + 1);
                let (mut puts, mut attempts) = (0u64, 0u64);
                for _ in 0..OPS {
                    let (kind, r) =
                        y.run_one(&session, id as usize, &mut rng, &[false; 3], &mut attempts);
                    assert!(r.unwrap(), "{} failed", y.kinds()[kind]);
                    puts += (kind == 1) as u64;
                }
                assert!(attempts >= OPS);
                puts
            })
        })
        .collect();
    let puts: u64 = clients.into_iter().map(|h| h.join().unwrap()).sum();
    let n = 2 * OPS;
    let sd = (n as f64 * 0.25).sqrt();
    assert!(
        (puts as f64 - n as f64 / 2.0).abs() < 4.0 * sd,
        "{puts} PUTs of {n} operations"
    );
    ycsb.check(&c).unwrap();
    c.quiesce();
    c.stats()
}

#[test]
fn workload_a_keeps_every_value_whole_with_either_replication() {
    let one_sided = run(Replication::OneSided);
    assert_eq!(one_sided.backup_acks, 0, "one-sided backups answered");
    let rpc = run(Replication::Rpc);
    // Every PUT's COMMIT-BACKUP went to two backups, each of which answered.
    assert!(
        rpc.backup_acks >= 2 * 8_000,
        "only {} BACKUP-ACKs for about 10,000 PUTs",
        rpc.backup_acks
    );
}
