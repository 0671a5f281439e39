//! The restart decision (`farm_txn::machine::restart_view`): which view a whole-cluster restart
//! resumes from, and when it must refuse.

use std::collections::BTreeMap;

use farm_core::codec::StoredView;
use farm_core::config::{Configuration, RegionMap};
use farm_core::{ConfigId, MachineId};
use farm_txn::machine::restart_view;

fn view(id: u64, members: &[u16], regions: u32) -> StoredView {
    let mut config = Configuration::initial(5);
    config.id = ConfigId(id);
    config.members = members.iter().map(|m| MachineId(*m)).collect();
    config.failure_domains.retain(|m, _| members.contains(&m.0));
    config.cm = config.members[0];
    StoredView {
        config,
        map: RegionMap::striped(3, regions, 2),
        changes: BTreeMap::new(),
    }
}

#[test]
fn resumes_from_the_newest_view_with_the_most_regions() {
    let persisted = vec![
        Some((view(4, &[0, 1, 2], 1), ConfigId(4))),
        Some((view(4, &[0, 1, 2], 2), ConfigId(4))), // saw one more region allocated
        Some((view(4, &[0, 1, 2], 1), ConfigId(4))),
        Some((view(2, &[0, 1, 2, 3], 1), ConfigId(2))), // removed in 3: not a member
        None,                                           // a spare that never ran
    ];
    let v = restart_view(ConfigId(4), &persisted).unwrap();
    assert_eq!(v.config.id, ConfigId(4));
    assert_eq!(v.map.iter().count(), 6);
}

#[test]
fn refuses_a_cluster_that_stopped_mid_reconfiguration_or_mid_recovery() {
    let settled = |id| Some((view(id, &[0, 1, 2], 1), ConfigId(id)));
    // The store moved on to 5, no machine installed it.
    let e = restart_view(ConfigId(5), &[settled(4), settled(4), settled(4)]).unwrap_err();
    assert!(e.contains("middle of a reconfiguration"), "{e}");
    // Machine 1 installed 4 but had not finished recovering it.
    let unsettled = Some((view(4, &[0, 1, 2], 1), ConfigId(3)));
    let e = restart_view(ConfigId(4), &[settled(4), unsettled, settled(4)]).unwrap_err();
    assert!(
        e.contains("machine m1 had not finished recovering configuration 4"),
        "{e}"
    );
    // A member left nothing.
    let e = restart_view(ConfigId(4), &[settled(4), settled(4), None]).unwrap_err();
    assert!(e.contains("machine m2"), "{e}");
    assert!(restart_view(ConfigId(1), &[None, None]).is_err());
}
