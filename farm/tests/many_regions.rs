//! A cluster of 4,096 regions (§3): its views no longer fit one control datagram, so
//! NEW-CONFIG travels in pieces (`farm_cm::control::Reassembly`); it reconfigures after a
//! machine is killed (§5.2), recovers (§5.3-5.4), and restarts from its NVRAM after a power
//! loss.

use std::sync::Arc;
use std::time::{Duration, Instant};

use farm::{Cluster, ConfigId, EmbeddedStore, MachineId};

const REGIONS: usize = 4096;

#[test]
fn a_cluster_of_4096_regions_reconfigures_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(EmbeddedStore::new());
    let builder = Cluster::builder()
        .machines(4)
        .workers(1)
        .replicas(3)
        .regions_per_machine(REGIONS as u32 / 4)
        .region_bytes(2 << 20)
        .lease(Duration::from_millis(100))
        .nvram_dir(dir.path())
        .store(store);
    let c = builder.clone().build().unwrap();
    assert_eq!(c.view(MachineId(0)).map.iter().count(), REGIONS);
    let a = c.txn(MachineId(1), |tx| tx.alloc(&7u64, None)).unwrap();
    c.kill(MachineId(3));
    let deadline = Instant::now() + Duration::from_secs(60);
    let settled = |m: u16| {
        let v = c.view(MachineId(m));
        v.config.id >= ConfigId(2) && !v.config.contains(MachineId(3))
    };
    while !(0..3).all(settled) {
        assert!(
            Instant::now() < deadline,
            "no configuration without machine 3"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Every region that machine 3 held has a replica elsewhere, and transactions go on.
    let v = c.view(MachineId(0));
    assert_eq!(v.map.iter().count(), REGIONS);
    assert!(v.map.iter().all(|(_, p)| !p.holds(MachineId(3))));
    // The members installed it from NEW-CONFIG in pieces.
    let encoded = farm_core::codec::encode_view(&v.config, &v.map, &v.changes);
    assert!(
        encoded.len() > farm_cm::control::DATAGRAM_BYTES_MAX,
        "the view ({} bytes) fits one datagram: no pieces tested",
        encoded.len()
    );
    c.txn(MachineId(0), |tx| {
        let x: u64 = tx.read(a)?;
        tx.write(a, &(x + 1))
    })
    .unwrap();
    c.power_off();
    drop(c);
    let c = builder.restart().build().unwrap();
    assert_eq!(c.view(MachineId(0)).map.iter().count(), REGIONS);
    assert_eq!(c.txn(MachineId(2), |tx| tx.read::<u64>(a)).unwrap(), 8);
}
