//! In-process micro-benchmarks (criterion): address parsing, ledger decisions, one
//! durable store commit, a group commit of 32 changes, and request-log lookups.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use hostdevd::ledger::{
    ChangeSet, ClaimRequest, ClaimTarget, DeviceFacts, DomainDevices, DomainRef, Ledger, Outcome,
    Owner, ReleaseRequest, Selector,
};
use hostdevd::pci::{ConsumerId, DeviceId, OwnerLabel, PciAddress, VendorId};
use hostdevd::store::Store;

fn facts(n: u32) -> Vec<DeviceFacts> {
    (0..n)
        .map(|i| DeviceFacts {
            address: PciAddress::new(
                0,
                (i / 256) as u8 + 0x10,
                ((i / 8) % 32) as u8,
                (i % 8) as u8,
            )
            .expect("address"),
            vendor_id: VendorId(0x8086),
            device_id: DeviceId(0x154c),
            driver: Some("iavf".into()),
            iommu_group: Some(1000 + i),
            numa_node: Some(i % 2),
            physfn: None,
            is_pf: false,
            physnets: vec![],
            managed: true,
            instance: None,
        })
        .collect()
}

fn owner() -> Owner {
    Owner {
        consumer: ConsumerId(uuid::Uuid::from_u128(42)),
        label: OwnerLabel::try_from(String::new()).expect("label"),
    }
}

/// A store in a fresh temporary directory (kept while the returned guard lives), holding
/// a host of 64 devices, and the ledger that wrote it.
fn store_with_host() -> (tempfile::TempDir, Store, Ledger) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = Store::open(dir.path()).expect("store");
    let mut ledger = Ledger::new();
    store
        .commit(&[ledger.apply_inventory(facts(64))])
        .expect("inventory");
    (dir, store, ledger)
}

/// `n` consumers (UUIDs from `first_consumer` on), each with a device of its own: the
/// host's devices in address order from device `first_device` of bus 0x10.
fn owners(n: u32, first_device: u8, first_consumer: u128) -> Vec<(PciAddress, Owner)> {
    (0..n)
        .map(|i| {
            let address = PciAddress::new(0, 0x10, (i / 8) as u8 + first_device, (i % 8) as u8)
                .expect("address");
            let owner = Owner {
                consumer: ConsumerId(uuid::Uuid::from_u128(first_consumer + u128::from(i))),
                label: OwnerLabel::try_from(String::new()).expect("label"),
            };
            (address, owner)
        })
        .collect()
}

/// Claims the device at `address` at its current generation for `owner`.
fn claim(
    ledger: &mut Ledger,
    address: PciAddress,
    owner: &Owner,
    request_id: &str,
    now: u64,
) -> (Outcome, ChangeSet) {
    let g = ledger.record_at(address).expect("present").generation;
    ledger
        .claim(
            &ClaimRequest {
                target: ClaimTarget::Address {
                    address,
                    expected_generation: g,
                },
                owner: owner.clone(),
                request_id: request_id.parse().expect("rid"),
            },
            now,
        )
        .expect("claim")
}

/// Releases what `claimed` claimed at `address`, for `consumer`.
fn release(
    ledger: &mut Ledger,
    address: PciAddress,
    consumer: ConsumerId,
    claimed: &Outcome,
    request_id: &str,
    now: u64,
) -> (Outcome, ChangeSet) {
    ledger
        .release(
            &ReleaseRequest {
                address,
                consumer,
                request_id: request_id.parse().expect("rid"),
                generation: claimed.generation(),
            },
            now,
        )
        .expect("release")
}

/// A ledger of 4,096 devices with `claimed` of them, never `spare`, claimed by another
/// consumer.
fn host_with_claims(claimed: usize, spare: PciAddress) -> Ledger {
    let mut ledger = Ledger::new();
    ledger.apply_inventory(facts(4096));
    let other = Owner {
        consumer: ConsumerId(uuid::Uuid::from_u128(7)),
        label: OwnerLabel::try_from(String::new()).expect("label"),
    };
    let others: Vec<PciAddress> = ledger
        .records()
        .map(|r| r.address())
        .filter(|a| *a != spare)
        .take(claimed)
        .collect();
    for (i, a) in others.into_iter().enumerate() {
        claim(&mut ledger, a, &other, &format!("fill{i}"), 0);
    }
    ledger
}

fn bench(c: &mut Criterion) {
    c.bench_function("parse PCI address", |b| {
        b.iter(|| black_box("0000:3b:02.1").parse::<PciAddress>())
    });

    // The same decisions on an empty host and on a nearly full one (4,000 of the 4,096
    // devices claimed by another consumer): a decision reads the devices related to its
    // own, so the second should cost about what the first does.
    let addr = PciAddress::new(0, 0x17, 3, 1).expect("address");
    let mut n = 0u64;
    for claimed in [0usize, 4000] {
        let mut ledger = host_with_claims(claimed, addr);
        let host = format!("4096 devices, {claimed} claimed");
        c.bench_function(&format!("ledger claim+release, {host}"), |b| {
            b.iter(|| {
                n += 1;
                let (o, _) = claim(&mut ledger, addr, &owner(), &format!("c{n}"), n);
                release(&mut ledger, addr, owner().consumer, &o, &format!("r{n}"), n)
            })
        });

        // What the writer re-derives after one claim: the states around the claimed device.
        let (_, claimed) = claim(&mut ledger, addr, &owner(), "rederive", n + 1);
        c.bench_function(&format!("ledger rederive after one claim, {host}"), |b| {
            b.iter(|| black_box(ledger.rederive(std::slice::from_ref(&claimed)).1.len()))
        });
        ledger.undo(&claimed);
    }

    // A claim by selector (any device on NUMA node 1, or any at all) on the empty host:
    // the first matching claimable device in address order is the one picked.
    let mut ledger = host_with_claims(0, addr);
    for (what, numa_node) in [("NUMA node 1", Some(1)), ("any device", None)] {
        c.bench_function(
            &format!("ledger claim by selector ({what}) + release, 4096 devices"),
            |b| {
                b.iter(|| {
                    n += 1;
                    let (o, _) = ledger
                        .claim(
                            &ClaimRequest {
                                target: ClaimTarget::Selector(Selector {
                                    numa_node,
                                    ..Selector::default()
                                }),
                                owner: owner(),
                                request_id: format!("s{n}").parse().expect("rid"),
                            },
                            n,
                        )
                        .expect("claim by selector");
                    let Outcome::Claimed { address, .. } = o else {
                        panic!("claimed");
                    };
                    release(
                        &mut ledger,
                        address,
                        owner().consumer,
                        &o,
                        &format!("t{n}"),
                        n,
                    )
                })
            },
        );
    }

    let ledger = host_with_claims(4000, addr);
    c.bench_function("ledger views (list), 4096 devices, 4000 claimed", |b| {
        b.iter(|| black_box(ledger.views().len()))
    });

    // A host whose running domains use 4,000 of its devices, each domain holding the
    // claims of its own 8 (so none is a stray): what listing the strays costs.
    let mut ledger = Ledger::new();
    ledger.apply_inventory(facts(4096));
    let used: Vec<PciAddress> = ledger.records().map(|r| r.address()).take(4000).collect();
    let domains: Vec<DomainDevices> = used
        .chunks(8)
        .enumerate()
        .map(|(i, addresses)| {
            let vm = Owner {
                consumer: ConsumerId(uuid::Uuid::from_u128(100_000 + i as u128)),
                label: OwnerLabel::try_from(String::new()).expect("label"),
            };
            for a in addresses {
                claim(&mut ledger, *a, &vm, &format!("vm{i}-{a}"), 0);
            }
            DomainDevices {
                domain: DomainRef {
                    uuid: vm.consumer.0,
                    name: format!("vm{i}"),
                    running: true,
                },
                addresses: addresses.to_vec(),
            }
        })
        .collect();
    ledger.apply_domains(domains);
    c.bench_function("ledger strays, 4096 devices, 4000 in 500 domains", |b| {
        b.iter(|| black_box(ledger.strays().len()))
    });
    // What the writer lists again after a claim there: the strays at its address only.
    let spare = ledger
        .records()
        .map(|r| r.address())
        .nth(4000)
        .expect("a spare device");
    let (_, claimed) = claim(&mut ledger, spare, &owner(), "strays", 1);
    c.bench_function(
        "ledger strays around one claim, 4096 devices, 4000 in 500 domains",
        |b| b.iter(|| black_box(ledger.strays_around(std::slice::from_ref(&claimed)).len())),
    );
    // A listing of libvirt's domains the same as the last: every poll, and every free's
    // fresh listing, on a quiet host.
    let listing = ledger.domains().to_vec();
    c.bench_function(
        "ledger domains applied again unchanged, 4096 devices, 4000 in 500 domains",
        |b| b.iter(|| black_box(ledger.apply_domains(listing.clone()).is_empty())),
    );
    // The copy of the ledger that every batch's published view holds.
    c.bench_function(
        "ledger copy for a published view, 4096 devices, 4000 in 500 domains",
        |b| b.iter(|| black_box(ledger.clone())),
    );

    let (_dir, mut store, mut l2) = store_with_host();
    let a2 = PciAddress::new(0, 0x10, 0, 1).expect("address");
    let mut k = 0u64;
    c.bench_function("store commit (claim, fsync), on the temp dir's disk", |b| {
        b.iter(|| {
            k += 1;
            let g = l2.record_at(a2).expect("present").generation;
            let req = ClaimRequest {
                target: ClaimTarget::Address {
                    address: a2,
                    expected_generation: g,
                },
                owner: owner(),
                request_id: format!("s{k}").parse().expect("rid"),
            };
            let (o, cs) = l2.claim(&req, k).expect("claim");
            store.commit(&[cs]).expect("commit");
            let (_, cs) = release(&mut l2, a2, owner().consumer, &o, &format!("t{k}"), k);
            store.commit(&[cs]).expect("commit");
        })
    });

    // Group commit as the writer does it under load: 32 consumers each claim their own
    // device, in one transaction, then each releases it, in another. Per change this is
    // what the writer thread pays for the store with 64 clients (each change writes its
    // record's page and its consumer's request-log page).
    let batch = owners(32, 1, 1000);
    c.bench_function(
        "store commit (32 claims in one batch, then 32 releases in another, fsync each)",
        |b| {
            b.iter(|| {
                k += 1;
                let claimed: Vec<(Outcome, ChangeSet)> = batch
                    .iter()
                    .map(|(address, owner)| claim(&mut l2, *address, owner, &format!("b{k}"), k))
                    .collect();
                let sets: Vec<&ChangeSet> = claimed.iter().map(|(_, cs)| cs).collect();
                store.commit(&sets).expect("commit");
                let released: Vec<ChangeSet> = batch
                    .iter()
                    .zip(&claimed)
                    .map(|((address, owner), (o, _))| {
                        release(&mut l2, *address, owner.consumer, o, &format!("u{k}"), k).1
                    })
                    .collect();
                store.commit(&released).expect("commit");
            })
        },
    );

    // The request log as the writer asks it: every claim, release or transfer whose id
    // the ledger's newest entries in memory lack is looked up in the store first. The log
    // holds 100,000 entries (the default limit) from 64 consumers.
    let (_dir3, mut store, mut l3) = store_with_host();
    let consumers = owners(64, 0, 5000);
    let mut pending: Vec<ChangeSet> = Vec::new();
    for round in 0..(100_000 / (2 * consumers.len())) {
        for (address, owner) in &consumers {
            let (o, cs) = claim(&mut l3, *address, owner, &format!("c{round}"), 1);
            pending.push(cs);
            let (_, cs) = release(
                &mut l3,
                *address,
                owner.consumer,
                &o,
                &format!("r{round}"),
                1,
            );
            pending.push(cs);
        }
        if pending.len() >= 2048 {
            store.commit(&pending).expect("commit");
            pending.clear();
        }
    }
    store.commit(&pending).expect("commit");
    let logged = consumers[7].1.consumer;
    let rid = |s: &str| -> hostdevd::pci::RequestId { s.parse().expect("rid") };
    let (old, new) = (rid("c100"), rid("never-logged"));
    assert!(store.request(logged, &old).expect("lookup").is_some());
    c.bench_function(
        "store request-log lookup, 100,000 entries: an id never logged",
        |b| b.iter(|| black_box(store.request(logged, &new).expect("lookup"))),
    );
    // As a server sees them: a new id each time, so each lookup reads its own part of
    // the index rather than the one the last lookup left in the cache.
    let fresh: Vec<hostdevd::pci::RequestId> =
        (0..4096).map(|n| rid(&format!("fresh-{n}"))).collect();
    let mut next = fresh.iter().cycle();
    c.bench_function(
        "store request-log lookup, 100,000 entries: ids never logged, a new one each time",
        |b| {
            b.iter(|| {
                let id = next.next().expect("cycles");
                black_box(store.request(logged, id).expect("lookup"))
            })
        },
    );
    c.bench_function(
        "store request-log lookup, 100,000 entries: a logged id",
        |b| b.iter(|| black_box(store.request(logged, &old).expect("lookup"))),
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
