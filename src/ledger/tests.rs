//! Unit tests of the ledger's rules, one rule per test.

use super::*;
use crate::pci::{DeviceId, OwnerLabel, PhysNet, VendorId};

pub(crate) fn addr(s: &str) -> PciAddress {
    s.parse().expect("test address")
}

pub(crate) fn facts(a: &str, group: Option<u32>, physfn: Option<&str>) -> DeviceFacts {
    DeviceFacts {
        address: addr(a),
        vendor_id: VendorId(0x8086),
        device_id: DeviceId(if physfn.is_some() { 0x154c } else { 0x1572 }),
        driver: Some("iavf".into()),
        iommu_group: group,
        numa_node: Some(0),
        physfn: physfn.map(addr),
        is_pf: false,
        physnets: vec![],
        managed: true,
        instance: None,
    }
}

pub(crate) fn owner(n: u128) -> Owner {
    Owner {
        consumer: ConsumerId(uuid::Uuid::from_u128(n)),
        label: OwnerLabel::try_from(String::new()).expect("empty label"),
    }
}

pub(crate) fn rid(s: &str) -> RequestId {
    s.parse().expect("request id")
}

/// A PF 0000:3b:00.0 (group 10) with VFs 3b:02.0..3b:02.3 (groups 20..23), and two
/// functions of one plain device sharing group 30.
pub(crate) fn host() -> Vec<DeviceFacts> {
    let mut v = vec![facts("0000:3b:00.0", Some(10), None)];
    v[0].is_pf = true;
    for i in 0..4u32 {
        v.push(facts(
            &format!("0000:3b:02.{i}"),
            Some(20 + i),
            Some("0000:3b:00.0"),
        ));
    }
    v.push(facts("0000:5e:00.0", Some(30), None));
    v.push(facts("0000:5e:00.1", Some(30), None));
    v
}

pub(crate) fn ledger() -> Ledger {
    let mut l = Ledger::new();
    let cs = l.apply_inventory(host());
    assert_eq!(cs.upserts.len(), 7);
    l
}

fn gen_of(l: &Ledger, a: &str) -> Generation {
    l.record_at(addr(a)).expect("present").generation
}

fn claim(l: &mut Ledger, a: &str, who: u128, req: &str) -> Result<Outcome, LedgerError> {
    let g = gen_of(l, a);
    l.claim(
        &ClaimRequest {
            target: ClaimTarget::Address {
                address: addr(a),
                expected_generation: g,
            },
            owner: owner(who),
            request_id: rid(req),
        },
        1,
    )
    .map(|(o, _)| o)
}

fn release(
    l: &mut Ledger,
    a: &str,
    who: u128,
    req: &str,
    g: Generation,
) -> Result<Outcome, LedgerError> {
    l.release(
        &ReleaseRequest {
            address: addr(a),
            consumer: owner(who).consumer,
            request_id: rid(req),
            generation: g,
        },
        2,
    )
    .map(|(o, _)| o)
}

pub(crate) fn domain(n: u128, name: &str, addrs: &[&str]) -> DomainDevices {
    DomainDevices {
        domain: DomainRef {
            uuid: uuid::Uuid::from_u128(n),
            name: name.into(),
            running: true,
        },
        addresses: addrs.iter().map(|a| addr(a)).collect(),
    }
}

#[test]
fn inventory_gives_each_device_its_own_generation() {
    let l = ledger();
    let gens: BTreeSet<Generation> = l.records().map(|r| r.generation).collect();
    assert_eq!(gens.len(), 7);
    assert_eq!(l.host_generation(), Generation(7));
    assert!(l.views().iter().all(|v| v.state == DeviceState::Free));
}

/// A damaged row whose id is past every stored generation: the counter goes past the id
/// too, so the next device found gets an id of its own rather than that record's (which
/// the ledger would have overwritten, claim and all).
#[test]
fn a_stored_id_past_the_counter_is_never_given_again() {
    let l = ledger();
    let mut records: BTreeMap<RecordId, DeviceRecord> =
        l.records().map(|r| (r.id, r.clone())).collect();
    let (_, mut odd) = records.pop_first().expect("a record");
    odd.id = RecordId(l.host_generation().0 + 5);
    records.insert(odd.id, odd.clone());
    let mut loaded = Ledger::from_snapshot(Snapshot {
        host_generation: l.host_generation(),
        records,
        requests: Vec::new(),
    });
    assert!(loaded.host_generation().0 >= odd.id.0);
    let f = facts("0000:5f:00.0", Some(40), None);
    let cs = loaded.apply_devices(vec![(f.address, Some(f))]);
    let new = &cs.upserts[0];
    assert!(new.id.0 > odd.id.0, "{new:?}");
    assert_eq!(
        loaded.records().filter(|r| r.id == odd.id).count(),
        1,
        "the damaged record is kept"
    );
}

/// At start the counter goes past the stored one by one a record, and past the clock:
/// a clock behind the stored counter does not hand out again the generations the last
/// run published for derived-state events without storing them.
#[test]
fn the_start_floor_is_past_every_unstored_generation_whatever_the_clock() {
    let l = ledger();
    let records = l.records().count() as u64;
    assert_eq!(l.host_generation(), Generation(7));
    let behind = std::time::Duration::from_micros(3);
    assert_eq!(l.start_floor(behind), Generation(7 + records + 1));
    let ahead = std::time::Duration::from_secs(1_800_000_000);
    assert_eq!(
        l.start_floor(ahead),
        Generation::clock_floor(ahead),
        "the clock's floor when it is the higher"
    );
}

#[test]
fn claim_then_release_with_fresh_generation() {
    let mut l = ledger();
    let out = claim(&mut l, "0000:3b:02.1", 1, "r1").expect("claim");
    assert_eq!(out.generation(), Generation(8));
    assert_eq!(gen_of(&l, "0000:3b:02.1"), Generation(8));
    let rel = release(&mut l, "0000:3b:02.1", 1, "r2", Generation(8)).expect("release");
    assert_eq!(rel.generation(), Generation(9));
    assert!(l
        .record_at(addr("0000:3b:02.1"))
        .expect("present")
        .claim
        .is_none());
}

#[test]
fn stale_generation_is_rejected_and_changes_nothing() {
    let mut l = ledger();
    let stale = gen_of(&l, "0000:3b:02.1");
    claim(&mut l, "0000:3b:02.1", 1, "r1").expect("claim");
    let before = l.clone();
    let err = release(&mut l, "0000:3b:02.1", 1, "r2", stale).expect_err("stale");
    match &err {
        LedgerError::StaleGeneration {
            current, owner: o, ..
        } => {
            assert_eq!(*current, Generation(8));
            assert_eq!(o.as_ref(), Some(&owner(1)));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(l, before);
    assert!(err.to_string().contains("current generation is 8"), "{err}");
}

#[test]
fn wrong_owner_cannot_release() {
    let mut l = ledger();
    claim(&mut l, "0000:3b:02.1", 1, "r1").expect("claim");
    let before = l.clone();
    let err = release(&mut l, "0000:3b:02.1", 2, "x", Generation(8)).expect_err("wrong owner");
    assert_eq!(err.reason(), "WRONG_OWNER");
    assert_eq!(err.current_owner(), Some(&owner(1)));
    assert_eq!(l, before);
}

#[test]
fn second_claim_loses() {
    let mut l = ledger();
    let g = gen_of(&l, "0000:3b:02.1");
    claim(&mut l, "0000:3b:02.1", 1, "r1").expect("first");
    let err = l
        .claim(
            &ClaimRequest {
                target: ClaimTarget::Address {
                    address: addr("0000:3b:02.1"),
                    expected_generation: g,
                },
                owner: owner(2),
                request_id: rid("r1"),
            },
            1,
        )
        .expect_err("second");
    assert_eq!(err.reason(), "STALE_GENERATION");
    let err = claim(&mut l, "0000:3b:02.1", 2, "r9").expect_err("fresh gen, still claimed");
    assert_eq!(err.reason(), "ALREADY_CLAIMED");
}

#[test]
fn retried_claim_returns_first_answer() {
    let mut l = ledger();
    let g = gen_of(&l, "0000:3b:02.1");
    let req = ClaimRequest {
        target: ClaimTarget::Address {
            address: addr("0000:3b:02.1"),
            expected_generation: g,
        },
        owner: owner(1),
        request_id: rid("r1"),
    };
    let (first, cs) = l.claim(&req, 1).expect("first");
    assert!(!cs.is_empty());
    let after_first = l.clone();
    let (again, cs2) = l.claim(&req, 5).expect("retry");
    assert_eq!(first, again);
    assert!(cs2.is_empty());
    assert_eq!(l, after_first);
    // The same request id for another device is a client bug, named as such.
    let mut other = req.clone();
    other.target = ClaimTarget::Address {
        address: addr("0000:3b:02.2"),
        expected_generation: gen_of(&l, "0000:3b:02.2"),
    };
    assert_eq!(
        l.claim(&other, 1).expect_err("reuse").reason(),
        "REQUEST_ID_REUSED"
    );
}

#[test]
fn retried_release_is_idempotent() {
    let mut l = ledger();
    claim(&mut l, "0000:3b:02.1", 1, "r1").expect("claim");
    let first = release(&mut l, "0000:3b:02.1", 1, "rel", Generation(8)).expect("release");
    let again = release(&mut l, "0000:3b:02.1", 1, "rel", Generation(8)).expect("retry");
    assert_eq!(first, again);
}

#[test]
fn pf_and_vf_block_each_other() {
    let mut l = ledger();
    claim(&mut l, "0000:3b:02.0", 1, "r1").expect("vf");
    let err = claim(&mut l, "0000:3b:00.0", 2, "r2").expect_err("pf blocked");
    match err {
        LedgerError::Blocked { by, relation, .. } => {
            assert_eq!(by, addr("0000:3b:02.0"));
            assert_eq!(relation, Relation::VirtualFunction);
        }
        other => panic!("unexpected {other:?}"),
    }
    let mut l = ledger();
    claim(&mut l, "0000:3b:00.0", 1, "r1").expect("pf");
    let err = claim(&mut l, "0000:3b:02.3", 2, "r2").expect_err("vf blocked");
    assert_eq!(err.reason(), "BLOCKED_BY_RELATED_CLAIM");
    let state = l.state_of(l.record_at(addr("0000:3b:02.3")).expect("present"));
    assert!(matches!(state, DeviceState::Unavailable { .. }));
}

#[test]
fn iommu_group_members_block_each_other() {
    let mut l = ledger();
    claim(&mut l, "0000:5e:00.0", 1, "r1").expect("fn 0");
    let err = claim(&mut l, "0000:5e:00.1", 2, "r2").expect_err("group");
    assert!(matches!(
        err,
        LedgerError::Blocked {
            relation: Relation::IommuGroup,
            ..
        }
    ));
}

/// IOMMU groups renumbered by a rescan (a reboot, the IOMMU turned on): the related
/// index follows, so the new group mates block each other and a binding covers the new
/// group. An earlier version changed the record in place before comparing its links, so
/// the index kept the old groups until a restart rebuilt it.
#[test]
fn a_device_moved_to_another_iommu_group_is_related_by_its_new_group() {
    let mut l = ledger();
    claim(&mut l, "0000:3b:02.0", 1, "r1").expect("claim");
    let mut inv = host();
    for f in &mut inv {
        if f.address == addr("0000:3b:02.0") || f.address == addr("0000:3b:02.1") {
            f.iommu_group = Some(99);
        }
    }
    l.apply_inventory(inv);
    let err = claim(&mut l, "0000:3b:02.1", 2, "r2").expect_err("shares group 99 now");
    assert!(
        matches!(
            err,
            LedgerError::Blocked {
                relation: Relation::IommuGroup,
                ..
            }
        ),
        "{err:?}"
    );
    let g = gen_of(&l, "0000:3b:02.0");
    let plan = l
        .bind_plan(addr("0000:3b:02.0"), owner(1).consumer, g)
        .expect("plan");
    assert_eq!(
        plan.members,
        vec![addr("0000:3b:02.0"), addr("0000:3b:02.1")]
    );
    assert_eq!(l.states(), {
        let snap = Snapshot {
            host_generation: l.host_generation(),
            records: l.records().map(|r| (r.id, r.clone())).collect(),
            requests: l.request_log().collect(),
        };
        Ledger::from_snapshot(snap).states()
    });
}

#[test]
fn vanished_claim_is_lost_and_returning_address_is_new_instance() {
    let mut l = ledger();
    claim(&mut l, "0000:3b:02.3", 1, "r1").expect("claim");
    let old_id = l.record_at(addr("0000:3b:02.3")).expect("present").id;
    let without: Vec<DeviceFacts> = host()
        .into_iter()
        .filter(|f| f.address != addr("0000:3b:02.3"))
        .collect();
    l.apply_inventory(without);
    assert!(l.record_at(addr("0000:3b:02.3")).is_none());
    let lost: Vec<_> = l.lost().collect();
    assert_eq!(lost.len(), 1);
    let lost_gen = lost[0].generation;
    assert_eq!(
        lost[0].claim.as_ref().map(|c| c.owner.clone()),
        Some(owner(1))
    );
    // It comes back: a new, free instance; the lost claim stays visible.
    l.apply_inventory(host());
    let back = l.record_at(addr("0000:3b:02.3")).expect("back");
    assert_ne!(back.id, old_id);
    assert!(back.claim.is_none());
    assert_eq!(l.lost().count(), 1);
    // Another consumer may claim the new instance; the lost claim is released by its owner.
    claim(&mut l, "0000:3b:02.3", 2, "r2").expect("new instance");
    release(&mut l, "0000:3b:02.3", 1, "r3", lost_gen).expect("release lost");
    assert_eq!(l.lost().count(), 0);
    assert_eq!(
        l.record_at(addr("0000:3b:02.3"))
            .and_then(|r| r.claim.as_ref())
            .map(|c| c.owner.clone()),
        Some(owner(2))
    );
}

/// A host whose every device has an instance (its sysfs directory's number) read in
/// boot 1, the VF 3b:02.3 as `vf_instance`.
fn host_with_instances(vf_instance: u64) -> Vec<DeviceFacts> {
    host_in_boot(1, vf_instance)
}

/// [`host_with_instances`] read in boot `boot`.
fn host_in_boot(boot: u64, vf_instance: u64) -> Vec<DeviceFacts> {
    host()
        .into_iter()
        .enumerate()
        .map(|(i, mut f)| {
            let ino = if f.address == addr("0000:3b:02.3") {
                vf_instance
            } else {
                1000 + i as u64
            };
            f.instance = Some(Instance { boot, ino });
            f
        })
        .collect()
}

#[test]
fn another_instance_at_a_claimed_address_leaves_the_claim_lost_and_the_new_device_free() {
    let mut l = Ledger::new();
    l.apply_inventory(host_with_instances(7));
    claim(&mut l, "0000:3b:02.3", 1, "r1").expect("claim");
    let old = l.record_at(addr("0000:3b:02.3")).expect("present").clone();
    // The same instance scanned again: nothing changes.
    assert!(l.apply_inventory(host_with_instances(7)).is_empty());
    // Removed and made again with no removal seen in between: the scan finds another.
    let cs = l.apply_inventory(host_with_instances(8));
    assert_eq!(
        cs.upserts.len(),
        2,
        "the lost claim and the new device: {cs:?}"
    );
    let new = l.record_at(addr("0000:3b:02.3")).expect("present");
    assert_ne!(new.id, old.id);
    assert!(new.claim.is_none() && new.present);
    assert_eq!(new.facts.instance.map(|i| i.ino), Some(8));
    let lost: Vec<_> = l.lost().collect();
    assert_eq!(lost.len(), 1);
    assert_eq!(lost[0].id, old.id);
    assert_eq!(
        lost[0].claim.as_ref().map(|c| c.owner.clone()),
        Some(owner(1))
    );
    assert!(lost[0].generation > old.generation);
    // Its owner releases it with the lost record's generation; the new one is claimable.
    let lost_gen = lost[0].generation;
    release(&mut l, "0000:3b:02.3", 1, "r2", lost_gen).expect("release lost");
    claim(&mut l, "0000:3b:02.3", 2, "r3").expect("new instance");
}

#[test]
fn an_unknown_instance_on_either_side_keeps_the_record() {
    let mut l = Ledger::new();
    // Recorded without an instance (a record from a build that did not read it).
    l.apply_inventory(host());
    claim(&mut l, "0000:3b:02.3", 1, "r1").expect("claim");
    let id = l.record_at(addr("0000:3b:02.3")).expect("present").id;
    let g = gen_of(&l, "0000:3b:02.3");
    // Learning which instance each is changes no device: no generation, nothing to write.
    let cs = l.apply_inventory(host_with_instances(7));
    assert!(cs.is_empty() && l.lost().count() == 0, "{cs:?}");
    let kept = l.record_at(addr("0000:3b:02.3")).expect("present");
    assert_eq!((kept.id, kept.facts.instance.map(|i| i.ino)), (id, Some(7)));
    assert!(kept.claim.is_some());
    assert_eq!(kept.generation, g);
    // A scan that could not tell the instance keeps it too, and forgets the number.
    assert!(l.apply_inventory(host()).is_empty());
    let kept = l.record_at(addr("0000:3b:02.3")).expect("present");
    assert_eq!((kept.id, kept.facts.instance), (id, None));
}

#[test]
fn instances_of_another_boot_are_taken_afresh_without_losing_a_claim() {
    let mut l = Ledger::new();
    l.apply_inventory(host_in_boot(1, 7));
    claim(&mut l, "0000:3b:02.3", 1, "r1").expect("claim");
    let id = l.record_at(addr("0000:3b:02.3")).expect("present").id;
    let g = gen_of(&l, "0000:3b:02.3");
    // After a reboot every directory has another number, and none is comparable.
    let cs = l.apply_inventory(host_in_boot(2, 3));
    assert!(cs.is_empty() && l.lost().count() == 0, "{cs:?}");
    let kept = l.record_at(addr("0000:3b:02.3")).expect("present");
    assert_eq!(kept.id, id);
    assert_eq!(kept.facts.instance, Some(Instance { boot: 2, ino: 3 }));
    assert_eq!(kept.generation, g);
    assert!(kept.claim.is_some());
    // From then on the new boot's numbers count.
    l.apply_inventory(host_in_boot(2, 4));
    assert_eq!(l.lost().count(), 1);
}

#[test]
fn instances_learnt_without_a_change_are_handed_out_once_for_claimed_devices() {
    let mut l = Ledger::new();
    l.apply_inventory(host_in_boot(1, 7));
    claim(&mut l, "0000:3b:02.3", 1, "r1").expect("claim");
    assert_eq!(l.take_unwritten_instances(), None, "nothing learnt yet");
    let before = l.record_at(addr("0000:3b:02.3")).expect("present").clone();
    // A new boot: every number is learnt again, none written.
    assert!(l.apply_inventory(host_in_boot(2, 3)).is_empty());
    let cs = l.take_unwritten_instances().expect("the claimed VF's");
    assert_eq!(cs.upserts.len(), 1, "only the claimed device: {cs:?}");
    let r = &cs.upserts[0];
    assert_eq!((r.id, r.generation), (before.id, before.generation));
    assert_eq!(r.facts.instance, Some(Instance { boot: 2, ino: 3 }));
    assert_eq!(cs.host_generation, cs.prev_host_generation);
    assert!(cs.removals.is_empty() && cs.requests.is_empty());
    assert_eq!(l.take_unwritten_instances(), None, "handed out once");
    // A failed write puts it back.
    l.unwritten_again(&cs);
    assert_eq!(l.take_unwritten_instances(), Some(cs));
}

#[test]
fn unclaimed_device_that_vanishes_is_dropped() {
    let mut l = ledger();
    let without: Vec<DeviceFacts> = host().into_iter().skip(1).collect();
    let cs = l.apply_inventory(without);
    assert_eq!(cs.removals.len(), 1);
    assert_eq!(l.records().count(), 6);
}

#[test]
fn attached_device_is_never_released() {
    let mut l = ledger();
    let out = claim(&mut l, "0000:3b:02.1", 1, "r1").expect("claim");
    l.apply_domains(vec![domain(1, "instance-0000002a", &["0000:3b:02.1"])]);
    let rec = l.record_at(addr("0000:3b:02.1")).expect("present");
    assert!(rec.generation > out.generation(), "attach is a change");
    let g = rec.generation;
    let before = l.clone();
    let err = release(&mut l, "0000:3b:02.1", 1, "r2", g).expect_err("attached");
    assert!(err.to_string().contains("instance-0000002a"), "{err}");
    assert_eq!(l, before);
    // The domain goes away: back to claimed, not free.
    l.apply_domains(vec![]);
    let rec = l.record_at(addr("0000:3b:02.1")).expect("present");
    assert!(rec.claim.is_some() && rec.attached.is_none());
    let g = rec.generation;
    release(&mut l, "0000:3b:02.1", 1, "r3", g).expect("now free");
}

#[test]
fn a_listing_like_the_last_changes_nothing_yet_fixes_attachments_loaded_from_disk() {
    let mut l = ledger();
    let a = "0000:3b:02.1";
    claim(&mut l, a, 1, "r1").expect("claim");
    let listing = vec![domain(1, "instance-0000002a", &[a])];
    let first = l.apply_domains(listing.clone());
    assert!(first.before_domains.is_some() && first.upserts.len() == 1);
    // The same listing again: no change set for the writer to re-derive every state from.
    let before = l.clone();
    let again = l.apply_domains(listing.clone());
    assert!(
        again.is_empty() && again.before_domains.is_none(),
        "{again:?}"
    );
    assert_eq!(l, before);
    // Loaded from disk, the record still says attached, though this agent has listed
    // no domain yet; a first listing of none, the same as the (empty) domains it
    // starts with, must still detach it.
    let mut loaded = Ledger::from_snapshot(Snapshot {
        host_generation: l.host_generation(),
        records: l.records().map(|r| (r.id, r.clone())).collect(),
        requests: l.request_log().collect(),
    });
    assert!(loaded
        .record_at(addr(a))
        .is_some_and(|r| r.attached.is_some()));
    let cs = loaded.apply_domains(vec![]);
    assert!(cs.before_domains.is_none());
    assert_eq!(cs.upserts.len(), 1, "the stale attachment is a change");
    assert!(loaded
        .record_at(addr(a))
        .is_some_and(|r| r.attached.is_none()));
    assert_eq!(
        loaded.state_of(loaded.record_at(addr(a)).expect("present")),
        DeviceState::Claimed
    );
}

#[test]
fn check_release_names_the_refusal_release_would_answer() {
    let mut l = ledger();
    let a = "0000:3b:02.1";
    claim(&mut l, a, 1, "r1").expect("claim");
    l.apply_domains(vec![domain(1, "instance-0000002a", &[a])]);
    let g = gen_of(&l, a);
    let req = |who: u128, id: &str, g: Generation| ReleaseRequest {
        address: addr(a),
        consumer: owner(who).consumer,
        request_id: rid(id),
        generation: g,
    };
    let reason = |r: Result<(), LedgerError>| r.err().map(|e| e.reason());
    assert_eq!(reason(l.check_release(&req(1, "r2", g))), Some("ATTACHED"));
    assert_eq!(
        reason(l.check_release(&req(1, "r2", Generation(1)))),
        Some("STALE_GENERATION")
    );
    assert_eq!(
        reason(l.check_release(&req(2, "r2", g))),
        Some("WRONG_OWNER")
    );
    assert_eq!(
        reason(l.check_release(&req(1, "r1", g))),
        Some("REQUEST_ID_REUSED")
    );
    l.apply_domains(vec![]);
    let g = gen_of(&l, a);
    let before = l.clone();
    l.check_release(&req(1, "r2", g)).expect("releasable");
    assert_eq!(l, before, "a check changes nothing");
    release(&mut l, a, 1, "r2", g).expect("released");
    // A retry of the recorded release is no refusal: it is replayed.
    l.check_release(&req(1, "r2", g)).expect("a retry");
}

#[test]
fn owner_domain_attaches_even_without_reference() {
    let mut l = ledger();
    claim(&mut l, "0000:3b:02.1", 7, "r1").expect("claim");
    l.apply_domains(vec![domain(7, "vm7", &[])]);
    assert_eq!(
        l.state_of(l.record_at(addr("0000:3b:02.1")).expect("present")),
        DeviceState::Attached
    );
}

#[test]
fn strays_are_reported_and_block_other_claimants() {
    let mut l = ledger();
    claim(&mut l, "0000:3b:02.0", 1, "r1").expect("claim");
    l.apply_domains(vec![domain(
        9,
        "intruder",
        &["0000:3b:02.0", "0000:3b:02.2", "0000:aa:00.0"],
    )]);
    let strays = l.strays();
    assert_eq!(strays.len(), 3);
    assert!(strays.iter().any(|s| s.claimed_by == Some(owner(1))));
    assert!(strays.iter().any(|s| !s.known_device));
    let err = claim(&mut l, "0000:3b:02.2", 2, "r2").expect_err("in use");
    assert_eq!(err.reason(), "IN_USE_BY_DOMAIN");
    // The domain's own consumer may adopt it.
    claim(&mut l, "0000:3b:02.2", 9, "r3").expect("adopt");
}

#[test]
fn a_domain_adopts_its_device_only_when_no_other_domain_references_it() {
    for (first, second) in [(1u128, 2u128), (2, 1)] {
        let mut l = ledger();
        l.apply_domains(vec![
            domain(first, "vm-a", &["0000:3b:02.2"]),
            domain(second, "vm-b", &["0000:3b:02.2"]),
        ]);
        let g = gen_of(&l, "0000:3b:02.2");
        // Either domain's consumer would take a device the other VM uses.
        for who in [first, second] {
            let err = claim(&mut l, "0000:3b:02.2", who, "r1").expect_err("other VM uses it");
            assert_eq!(err.reason(), "IN_USE_BY_DOMAIN");
            let LedgerError::InUseByDomain { domain, .. } = err else {
                unreachable!()
            };
            assert_ne!(domain.uuid, owner(who).consumer.0, "names the other domain");
        }
        assert_eq!(gen_of(&l, "0000:3b:02.2"), g, "refusals change nothing");
        // Once the other VM is gone, the remaining one's consumer adopts it.
        l.apply_domains(vec![domain(second, "vm-b", &["0000:3b:02.2"])]);
        claim(&mut l, "0000:3b:02.2", second, "r2").expect("adopt");
    }
}

/// A domain using a VF without a claim blocks the VF's PF as a claimed VF does: a PF is
/// claimed to be passed through or bound to vfio-pci, and taking it from its driver
/// destroys its VFs, under that domain. A PF claimed before the domain started using
/// the VF may not be bound either.
#[test]
fn a_vf_a_domain_uses_blocks_its_pf() {
    let mut l = ledger();
    let pf = addr("0000:3b:00.0");
    l.apply_domains(vec![domain(9, "vm9", &["0000:3b:02.2"])]);
    assert!(matches!(
        l.state_of(l.record_at(pf).expect("pf")),
        DeviceState::Unavailable {
            blocker: Blocker::VfInUse { vf, .. }
        } if vf == addr("0000:3b:02.2")
    ));
    let g = gen_of(&l, "0000:3b:00.0");
    let before = l.clone();
    let err = claim(&mut l, "0000:3b:00.0", 1, "pf").expect_err("a VF is in use");
    assert_eq!(err.reason(), "VF_IN_USE_BY_DOMAIN");
    let LedgerError::VfInUseByDomain { vf, domain: d, .. } = &err else {
        unreachable!()
    };
    assert_eq!((*vf, d.name.as_str()), (addr("0000:3b:02.2"), "vm9"));
    assert_eq!(l, before, "the refusal changed nothing");
    // The domain's own consumer may not take the PF either.
    assert_eq!(
        claim(&mut l, "0000:3b:00.0", 9, "pf9")
            .expect_err("in use")
            .reason(),
        "VF_IN_USE_BY_DOMAIN"
    );

    // Without the domain the PF is free and claimable; once the domain uses the VF
    // again, the claim stands but the PF may not be bound.
    l.apply_domains(vec![]);
    assert_eq!(gen_of(&l, "0000:3b:00.0"), g);
    claim(&mut l, "0000:3b:00.0", 1, "pf").expect("free now");
    let g = gen_of(&l, "0000:3b:00.0");
    l.bind_plan(pf, owner(1).consumer, g)
        .expect("nothing uses its VFs");
    l.apply_domains(vec![domain(9, "vm9", &["0000:3b:02.2"])]);
    assert_eq!(
        l.bind_plan(pf, owner(1).consumer, g)
            .expect_err("a VF is in use")
            .reason(),
        "VF_IN_USE_BY_DOMAIN"
    );
}

#[test]
fn selector_prefers_numa_node_then_lowest_address() {
    let mut l = Ledger::new();
    let mut inv = host();
    for f in inv.iter_mut().skip(1).take(4) {
        f.physnets = vec![PhysNet::try_from("physnet1".to_string()).expect("tag")];
    }
    inv[3].numa_node = Some(1);
    l.apply_inventory(inv);
    let req = |n: u128, node| ClaimRequest {
        target: ClaimTarget::Selector(Selector {
            physnet: Some("physnet1".parse().expect("tag")),
            numa_node: node,
            ..Selector::default()
        }),
        owner: owner(n),
        request_id: rid("s"),
    };
    let (o, _) = l.claim(&req(1, Some(1)), 1).expect("numa 1");
    assert_eq!(o.address(), addr("0000:3b:02.2"));
    let (o, _) = l.claim(&req(2, Some(1)), 1).expect("falls back");
    assert_eq!(o.address(), addr("0000:3b:02.0"));
    l.claim(&req(3, None), 1).expect("third");
    l.claim(&req(4, None), 1).expect("fourth");
    let err = l.claim(&req(5, None), 1).expect_err("none left");
    assert_eq!(err.reason(), "NO_MATCH");
}

#[test]
fn transfer_moves_claim_atomically() {
    let mut l = ledger();
    let out = claim(&mut l, "0000:3b:02.1", 100, "mig").expect("migration claim");
    let (t, _) = l
        .transfer(
            &TransferRequest {
                address: addr("0000:3b:02.1"),
                from: owner(100).consumer,
                to: owner(1),
                request_id: rid("confirm"),
                generation: out.generation(),
            },
            3,
        )
        .expect("transfer");
    let rec = l.record_at(addr("0000:3b:02.1")).expect("present");
    assert_eq!(rec.claim.as_ref().map(|c| c.owner.clone()), Some(owner(1)));
    assert_eq!(rec.generation, t.generation());
}

#[test]
fn unmanaged_devices_cannot_be_claimed_but_claims_survive_leaving_the_selection() {
    let mut l = ledger();
    claim(&mut l, "0000:3b:02.0", 1, "r1").expect("claim");
    let mut inv = host();
    for f in &mut inv {
        f.managed = false;
    }
    l.apply_inventory(inv);
    let err = claim(&mut l, "0000:3b:02.1", 2, "r2").expect_err("unmanaged");
    assert_eq!(err.reason(), "UNMANAGED");
    let rec = l.record_at(addr("0000:3b:02.0")).expect("kept");
    assert_eq!(rec.claim.as_ref().map(|c| c.owner.clone()), Some(owner(1)));
}

#[test]
fn undo_restores_exactly() {
    let mut l = ledger();
    let before = l.clone();
    let g = gen_of(&l, "0000:3b:02.1");
    let (_, cs) = l
        .claim(
            &ClaimRequest {
                target: ClaimTarget::Address {
                    address: addr("0000:3b:02.1"),
                    expected_generation: g,
                },
                owner: owner(1),
                request_id: rid("r1"),
            },
            1,
        )
        .expect("claim");
    l.undo(&cs);
    assert_eq!(l, before);
    let cs = l.apply_inventory(vec![]);
    l.undo(&cs);
    assert_eq!(l, before);
}

#[test]
fn the_host_generation_is_raised_only_upwards_and_the_next_change_follows_it() {
    let mut l = ledger();
    let before = l.clone();
    let now = l.host_generation();
    assert_eq!(l.raise_host_generation(now), None, "not past it");
    assert_eq!(l.raise_host_generation(Generation(0)), None, "never down");
    assert_eq!(l, before);
    let floor = Generation(now.0 + 1_000_000);
    let cs = l.raise_host_generation(floor).expect("raised");
    assert_eq!((cs.prev_host_generation, cs.host_generation), (now, floor));
    assert!(!cs.is_empty(), "the store writes it");
    assert!(cs.upserts.is_empty() && cs.before.is_empty() && cs.requests.is_empty());
    assert_eq!(l.host_generation(), floor);
    let claimed = claim(&mut l, "0000:3b:02.1", 1, "r1").expect("claim");
    assert_eq!(claimed.generation(), floor.next());
    let mut undone = before.clone();
    let cs = undone.raise_host_generation(floor).expect("raised");
    undone.undo(&cs);
    assert_eq!(undone, before);
}

#[test]
fn snapshot_round_trip_rebuilds_the_same_ledger() {
    let mut l = ledger();
    claim(&mut l, "0000:3b:02.1", 1, "r1").expect("claim");
    let snap = Snapshot {
        host_generation: l.host_generation(),
        records: l.records().map(|r| (r.id, r.clone())).collect(),
        requests: l.request_log().collect(),
    };
    let rebuilt = Ledger::from_snapshot(snap);
    assert_eq!(rebuilt, l);
}

#[test]
fn request_log_is_pruned_oldest_first_and_a_recalled_entry_is_replayed() {
    let mut l = ledger();
    l.set_request_log_limit(10);
    let mut first = None;
    for i in 0..10u64 {
        let r = format!("r{i}");
        let g = gen_of(&l, "0000:3b:02.1");
        let (o, _) = l
            .claim(
                &ClaimRequest {
                    target: ClaimTarget::Address {
                        address: addr("0000:3b:02.1"),
                        expected_generation: g,
                    },
                    owner: owner(1),
                    request_id: rid(&r),
                },
                i,
            )
            .expect("claim");
        first.get_or_insert((g, l.request(owner(1).consumer, &rid("r0"))));
        release(&mut l, "0000:3b:02.1", 1, &format!("x{i}"), o.generation()).expect("rel");
    }
    assert!(l.requests.len() <= 10);
    assert!(l.request(owner(1).consumer, &rid("r9")).is_some());
    assert!(l.request(owner(1).consumer, &rid("r0")).is_none());

    // What the store gives back for it: a retry is the first answer again, changing
    // nothing (without it, the stale generation would be refused).
    let Some((g0, Some(entry))) = first else {
        panic!("the first claim was logged");
    };
    l.recall(entry.clone());
    assert!(l.knows_request(owner(1).consumer, &rid("r0")));
    assert!(l.requests.len() <= 10);
    let before = l.clone();
    let (outcome, cs) = l
        .claim(
            &ClaimRequest {
                target: ClaimTarget::Address {
                    address: addr("0000:3b:02.1"),
                    expected_generation: g0,
                },
                owner: owner(1),
                request_id: rid("r0"),
            },
            99,
        )
        .expect("replayed");
    assert_eq!(outcome, entry.outcome);
    assert!(cs.is_empty());
    assert_eq!(l, before);
}

#[test]
fn a_key_of_the_related_index_keeps_its_records_in_order_and_one_inline() {
    let id = RecordId;
    let one = Linked::One(id(5));
    let two = one.and(id(3));
    assert_eq!(two.ids(), &[id(3), id(5)]);
    let three = two.and(id(9));
    assert_eq!(three.ids(), &[id(3), id(5), id(9)]);
    assert_eq!(three.but(1).expect("two left").ids(), &[id(3), id(9)]);
    // One left is kept inline again, so equal ledgers hold equal indexes.
    assert_eq!(two.but(0), Some(Linked::One(id(5))));
    assert_eq!(two.but(1), Some(Linked::One(id(3))));
    assert_eq!(one.but(0), None);
}
