//! The restart decision (`farm_cm::restart::restart_view`): which view a whole-cluster restart
//! resumes from, which replicas it treats as incomplete, and when it must refuse.

use std::collections::BTreeMap;

use farm_cm::control::ControlMsg;
use farm_cm::restart::{decide, restart_view, LeaveOut, Persisted};
use farm_core::codec::StoredView;
use farm_core::config::{Configuration, Placement, RegionMap};
use farm_core::{ConfigId, MachineId, RegionId};

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

fn left(view: StoredView) -> Option<Persisted> {
    Some(Persisted {
        view,
        copying: BTreeMap::new(),
    })
}

/// Three machines that left `view`, those in `machines` still copying `region`.
fn copying(view: &StoredView, region: RegionId, machines: &[MachineId]) -> Vec<Option<Persisted>> {
    (0..3u16)
        .map(|m| {
            let mut p = left(view.clone())?;
            if machines.contains(&MachineId(m)) {
                p.copying.insert(region, false);
            }
            Some(p)
        })
        .collect()
}

#[test]
fn resumes_from_the_newest_view_with_the_most_regions() {
    let persisted = vec![
        left(view(4, &[0, 1, 2], 1)),
        left(view(4, &[0, 1, 2], 2)), // saw one more region allocated
        left(view(4, &[0, 1, 2], 1)),
        left(view(2, &[0, 1, 2, 3], 1)), // removed in 3: not a member
        None,                            // a spare that never ran
    ];
    let v = restart_view(ConfigId(4), &persisted).unwrap();
    assert_eq!(v.config.id, ConfigId(4));
    assert_eq!(v.map.iter().count(), 6);
}

#[test]
fn resumes_in_the_middle_of_a_reconfiguration() {
    // The store moved on to 5 and no machine installed it: the newest view is 4's.
    let v = restart_view(ConfigId(5), &vec![left(view(4, &[0, 1, 2], 1)); 3]).unwrap();
    assert_eq!(v.config.id, ConfigId(4));
    // Machine 2 installed 5 (which removed machine 3), the others had not yet.
    let persisted = [
        left(view(4, &[0, 1, 2, 3], 1)),
        left(view(4, &[0, 1, 2, 3], 1)),
        left(view(5, &[0, 1, 2], 1)),
        left(view(4, &[0, 1, 2, 3], 1)),
    ];
    let v = restart_view(ConfigId(5), &persisted).unwrap();
    assert_eq!(v.config.id, ConfigId(5));
    assert!(!v.config.contains(MachineId(3)));
}

#[test]
fn an_incomplete_primary_gives_way_to_a_complete_backup() {
    let mut v = view(4, &[0, 1, 2], 1);
    let r = RegionId(0);
    let p = v.map.get(r).unwrap().clone();
    let (primary, backup) = (p.primary, p.backups[0]);
    // The primary was still copying the region (a new backup promoted by a reconfiguration
    // that never committed, say): its copy cannot serve.
    let persisted = copying(&v, r, &[primary]);
    let out = restart_view(ConfigId(4), &persisted).unwrap();
    let q = out.map.get(r).unwrap();
    assert_eq!(q.primary, backup);
    assert!(
        q.backups.contains(&primary),
        "the old primary stays a replica"
    );
    // The plan travels to every machine in a Restart message and is installed and persisted
    // before the restart configuration: it is a view like any other, changed no later than
    // its own configuration (every region's primary changes at the restart, which the
    // reopening machines stamp in the restart configuration's view).
    let msg = ControlMsg::Restart {
        restart: ConfigId(5),
        from: out.clone(),
        life: 3,
    };
    assert_eq!(ControlMsg::decode(&msg.encode()), Some(msg));
    // No replica complete: the data is gone, and the restart says so.
    v.map.insert(
        r,
        Placement {
            primary,
            backups: vec![backup],
        },
    );
    let persisted = copying(&v, r, &[primary, backup]);
    let e = restart_view(ConfigId(4), &persisted).unwrap_err();
    assert!(e.contains("region 0 has no complete replica"), "{e}");
}

/// The power went while the CM committed an allocation (§3): configuration 5 adds region 3 on
/// machines 1 and 2, and only machine 0 installed it. No replica of region 3 ever held it, so
/// the allocation never committed (every member acknowledges first) and nothing can be in
/// it: the restart goes on without it. So it does when a replica installed it but another
/// member did not (the configuration did not commit either); once every member installed
/// configuration 5, the region is kept.
#[test]
fn regions_of_an_allocation_that_no_replica_installed_are_left_out() {
    let mut five = view(5, &[0, 1, 2], 1);
    let placement = Placement {
        primary: MachineId(1),
        backups: vec![MachineId(2)],
    };
    five.map.insert(RegionId(3), placement);
    let four = view(4, &[0, 1, 2], 1);
    let persisted = [left(five.clone()), left(four.clone()), left(four.clone())];
    let v = restart_view(ConfigId(5), &persisted).unwrap();
    assert_eq!(v.config.id, ConfigId(5));
    assert_eq!(v.map.get(RegionId(3)), None, "{:?}", v.map);
    assert_eq!(v.map.iter().count(), 3);
    // Machine 2, a replica, installed it too; machine 1 did not.
    let persisted = [left(five.clone()), left(four.clone()), left(five.clone())];
    let v = restart_view(ConfigId(5), &persisted).unwrap();
    assert_eq!(v.map.get(RegionId(3)), None, "{:?}", v.map);
    // Primary and backup installed it, and so did machine 0: configuration 5 committed.
    let persisted = [left(five.clone()), left(five.clone()), left(five.clone())];
    let v = restart_view(ConfigId(5), &persisted).unwrap();
    assert_eq!(
        v.map.get(RegionId(3)).map(|p| p.primary),
        Some(MachineId(1))
    );
    // A joiner that installed nothing yet says nothing of what committed.
    let mut joiner = four;
    joiner.map = RegionMap::default();
    let persisted = [left(five.clone()), left(five.clone()), left(joiner)];
    let v = restart_view(ConfigId(5), &persisted).unwrap();
    assert!(v.map.get(RegionId(3)).is_some());
}

#[test]
fn refuses_what_cannot_be_restarted() {
    // Machines installed a configuration the store never held: another store.
    let e = restart_view(ConfigId(3), &vec![left(view(4, &[0, 1, 2], 1)); 3]).unwrap_err();
    assert!(e.contains("the store the cluster ran with"), "{e}");
    assert!(restart_view(ConfigId(1), &[None, None]).is_err());
}

/// A view of configuration 4 with `members` and regions placed as `placements` says
/// (primary first).
fn placed(members: &[u16], placements: &[&[u16]]) -> StoredView {
    let mut v = view(4, members, 1);
    v.map = RegionMap::default();
    for (r, p) in placements.iter().enumerate() {
        v.map.insert(
            RegionId(r as u32),
            Placement {
                primary: MachineId(p[0]),
                backups: p[1..].iter().map(|m| MachineId(*m)).collect(),
            },
        );
    }
    v
}

/// A restart without a member that did not come back (machine 2 here) needs a complete replica
/// of each of its regions elsewhere: a region whose other replica was still copying is lost,
/// and so is one held only by machines that did not come back; neither is taken for a region
/// that no replica installed. Without `LeaveOut` the restart waits for every member instead.
#[test]
fn a_restart_without_a_machine_needs_a_complete_replica_of_its_regions() {
    let leave_out = LeaveOut {
        after: 1,
        replicas: 2,
        regions_max: 64,
    };
    let v = placed(&[0, 1, 2], &[&[0, 1], &[1, 2], &[2, 0]]);
    let persisted = [left(v.clone()), left(v.clone()), None];
    let e = decide(ConfigId(4), &persisted, 3, None).unwrap_err();
    assert!(e.contains("left nothing"), "{e}");
    let plan = decide(ConfigId(4), &persisted, 3, Some(leave_out)).unwrap();
    assert_eq!(plan.config.members, [MachineId(0), MachineId(1)]);
    let p = |r: u32| plan.from.map.get(RegionId(r)).unwrap().clone();
    assert_eq!(
        (p(1).primary, p(1).backups.clone()),
        (MachineId(1), vec![MachineId(0)])
    );
    assert_eq!(
        (p(2).primary, p(2).backups.clone()),
        (MachineId(0), vec![MachineId(1)])
    );
    // Machine 0 was still copying region 2, whose primary did not come back.
    let persisted = copying(&v, RegionId(2), &[MachineId(0)]);
    let persisted = [persisted[0].clone(), persisted[1].clone(), None];
    let e = decide(ConfigId(4), &persisted, 3, Some(leave_out)).unwrap_err();
    assert!(e.contains("region 2 has no complete replica"), "{e}");
    // Regions on pairs of five machines; 3 and 4 do not come back: region 2 (3 and 4) is lost.
    let v = placed(&[0, 1, 2, 3, 4], &[&[0, 1], &[2, 3], &[3, 4]]);
    let persisted = [
        left(v.clone()),
        left(v.clone()),
        left(v.clone()),
        None,
        None,
    ];
    let e = decide(ConfigId(4), &persisted, 5, Some(leave_out)).unwrap_err();
    assert!(e.contains("region 2 has no complete replica"), "{e}");
}
