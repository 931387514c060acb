//! The evacuation race and its relatives, replayed deterministically against the real
//! writer and a durable store: each unsafe order loses nothing.

use std::collections::BTreeSet;

use hostdevd::ledger::{
    ClaimRequest, ClaimTarget, DeviceFacts, DomainDevices, DomainRef, Ledger, LedgerError, Owner,
    ReleaseRequest, TransferRequest,
};
use hostdevd::pci::{ConsumerId, DeviceId, Generation, OwnerLabel, PciAddress, VendorId};
use hostdevd::store::Store;
use hostdevd::writer::{WriteError, Writer};

fn addr(s: &str) -> PciAddress {
    s.parse().expect("address")
}

fn owner(n: u128, label: &str) -> Owner {
    Owner {
        consumer: ConsumerId(uuid::Uuid::from_u128(n)),
        label: OwnerLabel::try_from(label.to_string()).expect("label"),
    }
}

fn vf(i: u8) -> DeviceFacts {
    DeviceFacts {
        address: addr(&format!("0000:3b:02.{i}")),
        vendor_id: VendorId(0x8086),
        device_id: DeviceId(0x154c),
        driver: Some("iavf".into()),
        iommu_group: Some(40 + u32::from(i)),
        numa_node: Some(0),
        physfn: Some(addr("0000:3b:00.0")),
        is_pf: false,
        physnets: vec![],
        managed: true,
        instance: None,
    }
}

struct Host {
    writer: Writer,
    _dir: tempfile::TempDir,
}

async fn host() -> Host {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("store");
    let (writer, _t) = Writer::start(Ledger::new(), store, 1024).expect("writer");
    writer
        .inventory((0..4).map(vf).collect())
        .await
        .expect("inventory");
    Host { writer, _dir: dir }
}

impl Host {
    fn generation(&self, a: &str) -> Generation {
        self.writer
            .view()
            .device(addr(a))
            .find(|v| v.record.present)
            .map(|v| v.record.generation)
            .expect("present")
    }

    fn owner_of(&self, a: &str) -> Option<ConsumerId> {
        self.writer
            .view()
            .device(addr(a))
            .find(|v| v.record.present)
            .and_then(|v| v.record.claim.as_ref().map(|c| c.owner.consumer))
    }

    async fn claim(
        &self,
        a: &str,
        who: &Owner,
        req: &str,
        g: Generation,
    ) -> Result<Generation, WriteError> {
        self.writer
            .claim(ClaimRequest {
                target: ClaimTarget::Address {
                    address: addr(a),
                    expected_generation: g,
                },
                owner: who.clone(),
                request_id: req.parse().expect("rid"),
            })
            .await
            .map(|a| a.outcome.generation())
    }

    async fn release(
        &self,
        a: &str,
        who: &Owner,
        req: &str,
        g: Generation,
    ) -> Result<Generation, WriteError> {
        self.writer
            .release(ReleaseRequest {
                address: addr(a),
                consumer: who.consumer,
                request_id: req.parse().expect("rid"),
                generation: g,
            })
            .await
            .map(|a| a.outcome.generation())
    }
}

fn reason(e: &WriteError) -> &'static str {
    match e {
        WriteError::Ledger(l) => l.reason(),
        _ => "OTHER",
    }
}

/// On the test's single-threaded runtime every command goes through the writer thread.
#[tokio::test]
async fn seed_stale_audit_after_evacuation_claim_is_rejected() {
    let dest = host().await;
    seed_scenario(&dest).await;
    assert_eq!(
        dest.writer.metrics().inline_batches(),
        0,
        "no worker to spare"
    );
}

/// On a multi-threaded runtime an idle writer lets the requesting worker decide and
/// commit in place: the same race, the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_scenario_decided_in_place_gives_the_same_answers() {
    let dest = host().await;
    seed_scenario(&dest).await;
    // Then a client's run of claims and releases: with nothing else queued, they are
    // decided in place, save the few that find the writer thread holding the lock for
    // its own chores (the trim after the start-up inventory, a prune check).
    let who = owner(0x2c, "instance-0000002c");
    let mut g = dest.generation("0000:3b:02.3");
    for i in 0..20 {
        g = dest
            .claim("0000:3b:02.3", &who, &format!("c{i}"), g)
            .await
            .expect("claim");
        g = dest
            .release("0000:3b:02.3", &who, &format!("r{i}"), g)
            .await
            .expect("release");
    }
    let inline = dest.writer.metrics().inline_batches();
    assert!(inline > 0, "none of 43 requests was decided in place");
    assert!(inline <= 43, "{inline} in place, of 43 requests");
}

/// Many controllers race for one VF at one generation, some decided in place and some
/// queued for the writer thread: exactly one wins, and the ledger names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_claims_in_place_and_queued_have_one_winner() {
    let dest = std::sync::Arc::new(host().await);
    let g0 = dest.generation("0000:3b:02.2");
    let tasks: Vec<_> = (0..32u128)
        .map(|i| {
            let dest = dest.clone();
            tokio::spawn(async move {
                let who = owner(0x100 + i, "racer");
                let r = dest
                    .claim("0000:3b:02.2", &who, &format!("race-{i}"), g0)
                    .await;
                (who.consumer, r)
            })
        })
        .collect();
    let mut winners = Vec::new();
    for t in tasks {
        let (who, r) = t.await.expect("task");
        match r {
            Ok(_) => winners.push(who),
            Err(e) => assert!(
                matches!(reason(&e), "STALE_GENERATION" | "ALREADY_CLAIMED"),
                "{e}"
            ),
        }
    }
    assert_eq!(winners.len(), 1, "one winner: {winners:?}");
    assert_eq!(dest.owner_of("0000:3b:02.2"), Some(winners[0]));
}

async fn seed_scenario(dest: &Host) {
    let instance = owner(0x2a, "instance-0000002a");
    // The audit reads its snapshot first: the VF is free at generation g0.
    let g0 = dest.generation("0000:3b:02.1");
    // The evacuation claims the VF on the destination for the instance.
    dest.claim("0000:3b:02.1", &instance, "evacuate-1", g0)
        .await
        .expect("evacuation claim");
    // The audit, seeing the instance in neither list, frees with its snapshot's generation.
    let err = dest
        .release("0000:3b:02.1", &instance, "audit-1", g0)
        .await
        .expect_err("stale audit must be refused");
    assert_eq!(reason(&err), "STALE_GENERATION");
    assert_eq!(dest.owner_of("0000:3b:02.1"), Some(instance.consumer));
    // The next boot asking for any VF does not get this one.
    let other = owner(0x2b, "instance-0000002b");
    let g = dest.generation("0000:3b:02.1");
    let err = dest
        .claim("0000:3b:02.1", &other, "boot-2", g)
        .await
        .expect_err("still owned");
    assert_eq!(reason(&err), "ALREADY_CLAIMED");
}

#[tokio::test]
async fn fresh_audit_while_domain_runs_is_rejected_because_attached() {
    let dest = host().await;
    let instance = owner(0x2a, "instance-0000002a");
    let g0 = dest.generation("0000:3b:02.1");
    dest.claim("0000:3b:02.1", &instance, "evacuate-1", g0)
        .await
        .expect("claim");
    dest.writer
        .domains(vec![DomainDevices {
            domain: DomainRef {
                uuid: instance.consumer.0,
                name: "instance-0000002a".into(),
                running: true,
            },
            addresses: vec![addr("0000:3b:02.1")],
        }])
        .await
        .expect("domains");
    // The audit's snapshot is taken after the claim: its generation is current.
    let fresh = dest.generation("0000:3b:02.1");
    let err = dest
        .release("0000:3b:02.1", &instance, "audit-2", fresh)
        .await
        .expect_err("attached");
    assert_eq!(reason(&err), "ATTACHED");
    assert!(err.to_string().contains("instance-0000002a"), "{err}");
    assert_eq!(dest.owner_of("0000:3b:02.1"), Some(instance.consumer));
    // The server-side audit agrees: the claim is protected, not an orphan.
    let report = dest.writer.view().ledger.audit(&BTreeSet::new(), fresh);
    assert!(report.orphans.is_empty());
    assert_eq!(report.protected.len(), 1);
}

#[tokio::test]
async fn resize_revert_keeps_both_claims_apart() {
    // Source and destination hosts, one ledger each.
    let source = host().await;
    let dest = host().await;
    let instance = owner(0x2a, "instance");
    let migration = owner(0x99, "migration");
    let gs = source.generation("0000:3b:02.0");
    let src_gen = source
        .claim("0000:3b:02.0", &instance, "boot", gs)
        .await
        .expect("source claim");
    let gd = dest.generation("0000:3b:02.0");
    let dest_gen = dest
        .claim("0000:3b:02.0", &migration, "resize", gd)
        .await
        .expect("destination claim under the migration id");
    // An audit on the source that believes the instance moved frees with a generation it
    // read before the resize began: refused.
    let err = source
        .release("0000:3b:02.0", &instance, "audit", gs)
        .await
        .expect_err("stale");
    assert_eq!(reason(&err), "STALE_GENERATION");
    // Someone freeing the destination claim as the instance: wrong owner.
    let err = dest
        .release("0000:3b:02.0", &instance, "confused", dest_gen)
        .await
        .expect_err("wrong owner");
    assert_eq!(reason(&err), "WRONG_OWNER");
    // Revert: the migration's claim on the destination is dropped by its owner.
    dest.release("0000:3b:02.0", &migration, "revert", dest_gen)
        .await
        .expect("revert frees the migration claim");
    assert_eq!(source.owner_of("0000:3b:02.0"), Some(instance.consumer));
    assert_eq!(source.generation("0000:3b:02.0"), src_gen);
    // Confirm path on another VF: the migration's claim becomes the instance's in one step.
    let g = dest.generation("0000:3b:02.2");
    let mig_gen = dest
        .claim("0000:3b:02.2", &migration, "resize-2", g)
        .await
        .expect("claim");
    let t = dest
        .writer
        .transfer(TransferRequest {
            address: addr("0000:3b:02.2"),
            from: migration.consumer,
            to: instance.clone(),
            request_id: "confirm".parse().expect("rid"),
            generation: mig_gen,
        })
        .await
        .expect("transfer");
    assert!(t.outcome.generation() > mig_gen);
    assert_eq!(dest.owner_of("0000:3b:02.2"), Some(instance.consumer));
}

#[tokio::test]
async fn two_controllers_claiming_one_vf_at_once_exactly_one_wins() {
    let h = host().await;
    for round in 0..20 {
        let a = format!("0000:3b:02.{}", round % 4);
        // Free it first if a previous round left it claimed.
        if let Some(c) = h.owner_of(&a) {
            let who = Owner {
                consumer: c,
                label: OwnerLabel::try_from(String::new()).expect("label"),
            };
            let g = h.generation(&a);
            h.release(&a, &who, &format!("cleanup-{round}"), g)
                .await
                .expect("cleanup");
        }
        let g = h.generation(&a);
        let mut tasks = Vec::new();
        for c in 0..8u128 {
            let w = h.writer.clone();
            let a = addr(&a);
            tasks.push(tokio::spawn(async move {
                w.claim(ClaimRequest {
                    target: ClaimTarget::Address {
                        address: a,
                        expected_generation: g,
                    },
                    owner: owner(1000 + c, "controller"),
                    request_id: format!("r{round}").parse().expect("rid"),
                })
                .await
            }));
        }
        let mut wins = 0;
        for t in tasks {
            match t.await.expect("join") {
                Ok(_) => wins += 1,
                Err(WriteError::Ledger(LedgerError::StaleGeneration { .. }))
                | Err(WriteError::Ledger(LedgerError::AlreadyClaimed { .. })) => {}
                Err(e) => panic!("unexpected {e}"),
            }
        }
        assert_eq!(wins, 1, "round {round}");
    }
}

#[tokio::test]
async fn claim_retried_after_timeout_is_one_claim() {
    let h = host().await;
    let instance = owner(0x2a, "instance");
    let g = h.generation("0000:3b:02.3");
    let first = h
        .claim("0000:3b:02.3", &instance, "boot-1", g)
        .await
        .expect("first");
    // The client timed out and retries with the same request id and its old generation.
    let again = h
        .claim("0000:3b:02.3", &instance, "boot-1", g)
        .await
        .expect("retry answers the first result");
    assert_eq!(first, again);
    let claims = h
        .writer
        .view()
        .devices()
        .iter()
        .filter(|v| v.record.claim.is_some())
        .count();
    assert_eq!(claims, 1);
    assert_eq!(
        h.generation("0000:3b:02.3"),
        first,
        "the retry changed nothing"
    );
}
