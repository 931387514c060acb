//! Integration tests of the gRPC API: the real server on a temp Unix socket over a fake
//! sysfs tree, every RPC, error codes with their google.rpc details, watch resume and
//! OUT_OF_RANGE, the permission check from a second uid, and concurrent clients.

mod support;

use std::collections::BTreeSet;

use hostdevd::api::proto::{self};
use hostdevd::client::Client;
use hostdevd::config::Config;
use support::FakeSys;
use tokio_stream::StreamExt;
use tonic::Code;
use tonic_types::StatusExt;

const PF: &str = "0000:3b:00.0";

type Server = support::server::TestServer;

/// A PF with `vfs` VFs (own IOMMU groups, NUMA split 0/1) and one plain device; every
/// device managed (address wildcard), so PF/VF blocking is visible.
async fn start(vfs: u32) -> Server {
    start_tuned(vfs, |_| {}).await
}

/// [`start`] with the configuration changed by `tune` first.
async fn start_tuned(vfs: u32, tune: impl FnOnce(&mut Config)) -> Server {
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 64, vfs)
        .driver(PF, "i40e")
        .netdev(PF, "ens1f0");
    f.iommu_group(PF, 10)
        .vf_iommu_groups(PF, 100)
        .vf_driver(PF, "iavf");
    for (i, vf) in f.vfs(PF).iter().enumerate() {
        f.numa(&vf.to_string(), (i % 2) as i32);
    }
    f.device("0000:5e:00.0", 0x15b3, 0x1017)
        .iommu_group("0000:5e:00.0", 30);
    let tree = f.build();
    let mut cfg = Config::parse("[[devices]]\naddress = \"*:*:*.*\"\nphysnets = [\"physnet1\"]\n")
        .expect("config");
    cfg.sysfs_root = tree.sysfs_root().to_path_buf();
    cfg.dev_root = tree.dev_root().to_path_buf();
    // In-process test driver: no libvirtd, and no domain references a VF.
    cfg.libvirt.uri = "test:///default".into();
    let uids = vec![0, nix::unistd::getuid().as_raw()];
    tune(&mut cfg);
    Server::start(cfg, 0o666, uids, Some(tree)).await
}

fn owner(n: u128) -> proto::Owner {
    proto::Owner {
        consumer_id: uuid::Uuid::from_u128(n).to_string(),
        label: format!("instance-{n:08x}"),
    }
}

async fn device(c: &mut Client, a: &str) -> proto::Device {
    c.get_device(proto::GetDeviceRequest { address: a.into() })
        .await
        .expect("get device")
        .into_inner()
        .device
        .expect("present")
}

async fn claim(
    c: &mut Client,
    a: &str,
    who: u128,
    req: &str,
    g: u64,
) -> Result<proto::ClaimResponse, tonic::Status> {
    c.claim(proto::ClaimRequest {
        vfio: false,
        owner: Some(owner(who)),
        request_id: req.into(),
        target: Some(proto::claim_request::Target::Address(proto::ByAddress {
            address: a.into(),
            expected_generation: g,
        })),
    })
    .await
    .map(|r| r.into_inner())
}

async fn release(
    c: &mut Client,
    a: &str,
    who: u128,
    req: &str,
    g: u64,
) -> Result<proto::ReleaseResponse, tonic::Status> {
    c.release(proto::ReleaseRequest {
        address: a.into(),
        owner: Some(owner(who)),
        request_id: req.into(),
        generation: g,
    })
    .await
    .map(|r| r.into_inner())
}

fn info(s: &tonic::Status) -> (String, std::collections::HashMap<String, String>) {
    let i = s.get_details_error_info().expect("ErrorInfo detail");
    assert_eq!(i.domain, "hostdev.v1");
    (i.reason, i.metadata)
}

async fn listing(c: &mut Client) -> proto::ListDevicesResponse {
    c.list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_claim_release_round_trip() {
    let s = start(4).await;
    let mut c = s.client().await;
    let list = listing(&mut c).await;
    assert_eq!(list.devices.len(), 6);
    assert!(list.host_generation >= 6);
    let vf = "0000:3b:10.1";
    let d = list
        .devices
        .iter()
        .find(|d| d.address == vf)
        .expect("vf listed");
    assert_eq!(d.state, proto::DeviceState::Free as i32);
    assert_eq!(d.physfn, PF);
    let pf = list.devices.iter().find(|d| d.address == PF).expect("pf");
    assert_eq!(pf.sriov.as_ref().map(|s| s.vfs.len()), Some(4));
    assert_eq!(pf.netdevs, vec!["ens1f0".to_string()]);

    let claimed = claim(&mut c, vf, 1, "boot-1", d.generation)
        .await
        .expect("claim");
    assert!(claimed.generation > list.host_generation);
    assert!(!claimed.replayed);
    let dev = claimed.device.expect("device in reply");
    assert_eq!(dev.state, proto::DeviceState::Claimed as i32);
    assert_eq!(dev.owner.expect("owner").consumer_id, owner(1).consumer_id);
    // The PF is now blocked by its claimed VF.
    let pfd = device(&mut c, PF).await;
    assert_eq!(pfd.state, proto::DeviceState::Unavailable as i32);
    assert_eq!(pfd.blocker.expect("blocker").address, vf);

    // Retry after a "timeout": same answer, replayed.
    let again = claim(&mut c, vf, 1, "boot-1", d.generation)
        .await
        .expect("retry");
    assert_eq!(again.generation, claimed.generation);
    assert!(again.replayed);

    let out = support::request_outcome(&mut c, owner(1).consumer_id, "boot-1".into()).await;
    assert_eq!(out.operation, "claimed");
    assert_eq!(out.generation, claimed.generation);

    // No outcome for a request: NOT_FOUND, and final. The id is closed, so a late copy
    // of a lost call is refused (ABORTED, REQUEST_CLOSED), not applied; a new id works.
    let e = c
        .get_request_outcome(proto::GetRequestOutcomeRequest {
            consumer_id: owner(2).consumer_id,
            request_id: "lost-call".into(),
        })
        .await
        .expect_err("never sent");
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("new request id"), "{}", e.message());
    let other = "0000:5e:00.0";
    let g = device(&mut c, other).await.generation;
    let e = claim(&mut c, other, 2, "lost-call", g)
        .await
        .expect_err("closed");
    assert_eq!(e.code(), Code::Aborted);
    assert_eq!(
        e.get_details_error_info().expect("info").reason,
        "REQUEST_CLOSED"
    );
    assert_eq!(device(&mut c, other).await.generation, g, "nothing changed");
    let ok = claim(&mut c, other, 2, "lost-call-2", g)
        .await
        .expect("a new request id");
    release(&mut c, other, 2, "lost-call-2-free", ok.generation)
        .await
        .expect("release");

    let rel = release(&mut c, vf, 1, "free-1", claimed.generation)
        .await
        .expect("release");
    assert!(rel.generation > claimed.generation);
    assert_eq!(
        device(&mut c, vf).await.state,
        proto::DeviceState::Free as i32
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rejection_has_its_code_and_details_and_changes_nothing() {
    let s = start(4).await;
    let mut c = s.client().await;
    let vf = "0000:3b:10.0";
    let g0 = device(&mut c, vf).await.generation;
    let g1 = claim(&mut c, vf, 1, "r1", g0)
        .await
        .expect("claim")
        .generation;
    let before = listing(&mut c).await;

    // Stale generation: ABORTED, with the current generation and owner.
    let e = release(&mut c, vf, 1, "audit", g0)
        .await
        .expect_err("stale");
    assert_eq!(e.code(), Code::Aborted);
    let (reason, meta) = info(&e);
    assert_eq!(reason, "STALE_GENERATION");
    assert_eq!(meta["current_generation"], g1.to_string());
    assert_eq!(meta["owner_consumer_id"], owner(1).consumer_id);
    assert!(e.get_details_precondition_failure().is_some());

    // Wrong owner.
    let e = release(&mut c, vf, 2, "x", g1)
        .await
        .expect_err("wrong owner");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(info(&e).0, "WRONG_OWNER");

    // Already claimed (fresh generation, other consumer).
    let e = claim(&mut c, vf, 2, "x2", g1).await.expect_err("claimed");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(info(&e).0, "ALREADY_CLAIMED");

    // Blocked by a related claim.
    let pf_gen = device(&mut c, PF).await.generation;
    let e = claim(&mut c, PF, 2, "pf", pf_gen)
        .await
        .expect_err("blocked");
    assert_eq!(e.code(), Code::FailedPrecondition);
    let (reason, meta) = info(&e);
    assert_eq!(reason, "BLOCKED_BY_RELATED_CLAIM");
    assert_eq!(meta["blocked_by"], vf);

    // Unknown device.
    let e = claim(&mut c, "0000:99:00.0", 2, "u", 1)
        .await
        .expect_err("unknown");
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .get_device(proto::GetDeviceRequest {
            address: "0000:99:00.0".into(),
        })
        .await
        .expect_err("unknown");
    assert_eq!(e.code(), Code::NotFound);

    // Bad input: malformed address, non-UUID owner, huge request id, control bytes,
    // missing target, reused request id.
    for (a, o, r) in [
        ("0000:3b:02", owner(2), "ok"),
        ("zz", owner(2), "ok"),
        (
            vf,
            proto::Owner {
                consumer_id: "not-a-uuid".into(),
                label: String::new(),
            },
            "ok",
        ),
        (vf, owner(2), &"r".repeat(100_000)[..]),
        (vf, owner(2), "a\u{7}b"),
        (vf, owner(2), ""),
    ] {
        let e = c
            .claim(proto::ClaimRequest {
                vfio: false,
                owner: Some(o),
                request_id: r.into(),
                target: Some(proto::claim_request::Target::Address(proto::ByAddress {
                    address: a.into(),
                    expected_generation: g1,
                })),
            })
            .await
            .expect_err("bad input");
        assert_eq!(e.code(), Code::InvalidArgument, "{a} {r:.20}: {e:?}");
        assert!(e.message().len() < 400, "error echoes bounded input");
    }
    let e = c
        .claim(proto::ClaimRequest {
            vfio: false,
            owner: Some(owner(2)),
            request_id: "t".into(),
            target: None,
        })
        .await
        .expect_err("no target");
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = claim(&mut c, "0000:3b:10.2", 1, "r1", 0)
        .await
        .expect_err("reuse");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(info(&e).0, "REQUEST_ID_REUSED");

    // Nothing changed through all of that.
    let after = listing(&mut c).await;
    assert_eq!(before, after);
    s.stop().await;
}

/// The ledger keeps only the newest request-log entries in memory; a retry of an older
/// request is answered from the store as the first time, by every path that looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_older_than_memory_holds_are_answered_from_disk() {
    let s = start_tuned(2, |cfg| cfg.api.request_log_in_memory = 2).await;
    let mut c = s.client().await;
    let (vf, other) = ("0000:3b:10.0", "0000:3b:10.1");
    // Pushes every earlier entry out of memory: 2 kept, 16 logged.
    async fn churn(c: &mut Client, a: &str, round: u32) {
        for i in 0..8 {
            let g = device(c, a).await.generation;
            let r = claim(c, a, 9, &format!("churn-{round}-{i}"), g)
                .await
                .expect("claim");
            release(c, a, 9, &format!("unchurn-{round}-{i}"), r.generation)
                .await
                .expect("release");
        }
    }

    let g = device(&mut c, vf).await.generation;
    let first = claim(&mut c, vf, 1, "boot", g).await.expect("claim");
    churn(&mut c, other, 0).await;
    let again = claim(&mut c, vf, 1, "boot", g).await.expect("retry");
    assert!(again.replayed, "the claim is replayed from disk");
    assert_eq!(again.generation, first.generation);
    let out = support::request_outcome(&mut c, owner(1).consumer_id, "boot".into()).await;
    assert_eq!(
        (out.operation.as_str(), out.generation),
        ("claimed", first.generation)
    );

    // A release, forgotten by memory while the device went to another owner: its
    // retry replays and frees nothing.
    let freed = release(&mut c, vf, 1, "shutdown", first.generation)
        .await
        .expect("release");
    churn(&mut c, other, 1).await;
    let next = claim(&mut c, vf, 2, "next-boot", freed.generation)
        .await
        .expect("claim by the next owner");
    churn(&mut c, other, 2).await;
    let retried = release(&mut c, vf, 1, "shutdown", first.generation)
        .await
        .expect("retry of the release");
    assert!(retried.replayed);
    assert_eq!(retried.generation, freed.generation);
    let now = device(&mut c, vf).await;
    assert_eq!(now.generation, next.generation, "nothing changed");
    assert_eq!(
        now.owner.expect("still claimed").consumer_id,
        owner(2).consumer_id
    );
    s.stop().await;
}

/// The request log on disk keeps `request_log_entries`: past it the oldest go, and a
/// retry of one of those is a new request again (here refused: its generation is stale).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_log_on_disk_is_pruned_oldest_first() {
    let s = start_tuned(2, |cfg| {
        cfg.api.request_log_entries = 10;
        cfg.api.request_log_in_memory = 4;
    })
    .await;
    let mut c = s.client().await;
    let vf = "0000:3b:10.0";
    let g0 = device(&mut c, vf).await.generation;
    let first = claim(&mut c, vf, 1, "first", g0).await.expect("claim");
    let mut g = release(&mut c, vf, 1, "first-release", first.generation)
        .await
        .expect("release")
        .generation;
    // The database is the agent's alone while it runs (EXCLUSIVE locking), so the
    // count on disk is the store's own, kept in step with every commit and prune (the
    // store's unit tests check it against the table, across a reopen too).
    let rows = || s.metrics.request_log_entries();
    // The oldest entries go first: the order logged.
    let mut most = 0;
    let mut last_claim = 0;
    for i in 0..20 {
        let r = claim(&mut c, vf, 2, &format!("c{i:02}"), g)
            .await
            .expect("claim");
        last_claim = r.generation;
        g = release(&mut c, vf, 2, &format!("r{i:02}"), r.generation)
            .await
            .expect("release")
            .generation;
        // The prune runs on the writer thread once a batch is answered: wait for it.
        c.get_request_outcome(proto::GetRequestOutcomeRequest {
            consumer_id: owner(2).consumer_id,
            request_id: format!("r{i:02}"),
        })
        .await
        .expect("outcome");
        most = most.max(rows());
    }
    // Pruned after each batch once past 10, down to 9: never more than 11 between.
    assert!(most <= 11, "{most} entries on disk, limit 10");
    assert!(rows() >= 9);
    let err = claim(&mut c, vf, 1, "first", g0)
        .await
        .expect_err("pruned: a new request, at a stale generation");
    assert_eq!(info(&err).0, "STALE_GENERATION");
    let last = release(&mut c, vf, 2, "r19", last_claim)
        .await
        .expect("kept: replayed");
    assert!(last.replayed);
    assert_eq!(last.generation, g);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_by_selector_prefers_numa_and_runs_out_cleanly() {
    let s = start(4).await;
    let mut c = s.client().await;
    let sel = |numa: Option<u32>| proto::Selector {
        vendor_id: "8086".into(),
        pf_address: PF.into(),
        physnet: "physnet1".into(),
        numa_node: numa,
        ..Default::default()
    };
    let mut got = BTreeSet::new();
    for i in 0..4u128 {
        let r = c
            .claim(proto::ClaimRequest {
                vfio: false,
                owner: Some(owner(10 + i)),
                request_id: format!("s{i}"),
                target: Some(proto::claim_request::Target::Selector(sel(Some(1)))),
            })
            .await
            .expect("selector claim")
            .into_inner();
        let d = r.device.expect("device");
        if i < 2 {
            assert_eq!(d.numa_node, Some(1), "preferred node first");
        }
        assert!(got.insert(d.address));
    }
    let e = c
        .claim(proto::ClaimRequest {
            vfio: false,
            owner: Some(owner(99)),
            request_id: "none".into(),
            target: Some(proto::claim_request::Target::Selector(sel(None))),
        })
        .await
        .expect_err("exhausted");
    assert_eq!(e.code(), Code::ResourceExhausted);
    let e = c
        .claim(proto::ClaimRequest {
            vfio: false,
            owner: Some(owner(99)),
            request_id: "bad".into(),
            target: Some(proto::claim_request::Target::Selector(proto::Selector {
                vendor_id: "80866".into(),
                ..Default::default()
            })),
        })
        .await
        .expect_err("bad selector");
    assert_eq!(e.code(), Code::InvalidArgument);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_delivers_resumes_and_refuses_unknown_generations() {
    let s = start(4).await;
    let mut c = s.client().await;
    let start_gen = listing(&mut c).await.host_generation;
    let mut stream = c
        .clone()
        .watch(proto::WatchRequest {
            from_generation: start_gen,
            snapshot: false,
        })
        .await
        .expect("watch")
        .into_inner();
    let vf = "0000:3b:10.3";
    let g = device(&mut c, vf).await.generation;
    let claimed = claim(&mut c, vf, 1, "w1", g).await.expect("claim");
    // The claimed VF's event, and the PF's derived change (now unavailable).
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let ev = stream.next().await.expect("event").expect("ok");
        seen.push(ev);
    }
    let ev = seen.iter().find(|e| e.address == vf).expect("vf event");
    assert_eq!(ev.kind, proto::WatchEventKind::Changed as i32);
    assert_eq!(ev.generation, claimed.generation);
    assert!(seen.iter().any(|e| e.address == PF));
    let last = seen.iter().map(|e| e.generation).max().unwrap_or(0);
    drop(stream);

    // While disconnected: a release. Resuming from the last generation replays it.
    let rel = release(&mut c, vf, 1, "w2", claimed.generation)
        .await
        .expect("release");
    let mut resumed = c
        .clone()
        .watch(proto::WatchRequest {
            from_generation: last,
            snapshot: false,
        })
        .await
        .expect("resume")
        .into_inner();
    let mut replay = Vec::new();
    while replay.len() < 2 {
        let ev = resumed.next().await.expect("event").expect("ok");
        replay.push(ev);
    }
    let ev = replay
        .into_iter()
        .find(|e| e.address == vf)
        .expect("the release is replayed");
    assert_eq!(ev.generation, rel.generation);
    assert_eq!(
        ev.device.expect("device").state,
        proto::DeviceState::Free as i32
    );

    // A generation this agent has not reached: OUT_OF_RANGE, re-list.
    let e = c
        .watch(proto::WatchRequest {
            from_generation: rel.generation + 1000,
            snapshot: false,
        })
        .await
        .expect_err("future generation");
    assert_eq!(e.code(), Code::OutOfRange);
    assert_eq!(info(&e).0, "WATCH_TOO_OLD");

    // A snapshot watch starts with every device, then an end marker.
    let mut snap = c
        .watch(proto::WatchRequest {
            from_generation: 0,
            snapshot: true,
        })
        .await
        .expect("snapshot")
        .into_inner();
    let mut n = 0;
    loop {
        let ev = snap.next().await.expect("event").expect("ok");
        if ev.kind == proto::WatchEventKind::SnapshotEnd as i32 {
            break;
        }
        assert_eq!(ev.kind, proto::WatchEventKind::Snapshot as i32);
        n += 1;
    }
    assert_eq!(n, 6);
    s.stop().await;
}

/// Every watcher, each on its own connection, receives the same events for a change, and
/// each event's device is the device as GetDevice reads it afterwards: the VF claimed, and
/// its PF (now unavailable) with its list of VFs. The agent builds and encodes a change
/// once for all its watchers (`src/api/wire.rs`); what arrives must decode whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_watcher_gets_the_same_events_and_they_match_the_devices() {
    let s = start(8).await;
    let mut c = s.client().await;
    let from = listing(&mut c).await.host_generation;
    let mut streams = Vec::new();
    for _ in 0..5 {
        let mut wc = s.client().await;
        streams.push(
            wc.watch(proto::WatchRequest {
                from_generation: from,
                snapshot: false,
            })
            .await
            .expect("watch")
            .into_inner(),
        );
    }
    let vf = "0000:3b:10.5";
    let g = device(&mut c, vf).await.generation;
    let claimed = claim(&mut c, vf, 1, "same-1", g).await.expect("claim");
    let mut got = Vec::new();
    for stream in &mut streams {
        let mut seen = Vec::new();
        while seen.len() < 2 {
            seen.push(stream.next().await.expect("event").expect("ok"));
        }
        seen.sort_by_key(|e| e.generation);
        got.push(seen);
    }
    for other in &got[1..] {
        assert_eq!(other, &got[0]);
    }
    let vf_event = got[0].iter().find(|e| e.address == vf).expect("vf event");
    assert_eq!(vf_event.generation, claimed.generation);
    assert_eq!(vf_event.device.as_ref(), Some(&device(&mut c, vf).await));
    let pf_event = got[0].iter().find(|e| e.address == PF).expect("pf event");
    let pf = device(&mut c, PF).await;
    assert_eq!(pf.sriov.as_ref().map(|s| s.vfs.len()), Some(8));
    assert_eq!(pf_event.device.as_ref(), Some(&pf));
    s.stop().await;
}

/// A server shutting down ends every open Watch stream with UNAVAILABLE and ErrorInfo
/// SHUTTING_DOWN, so a client can tell the agent stopping from a connection that broke
/// (which carries no ErrorInfo of ours). Before, the status had no ErrorInfo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_open_watch_streams_saying_so() {
    let s = start(2).await;
    let mut c = s.client().await;
    let from = listing(&mut c).await.host_generation;
    let mut stream = c
        .watch(proto::WatchRequest {
            from_generation: from,
            snapshot: false,
        })
        .await
        .expect("watch")
        .into_inner();
    let stopping = tokio::spawn(s.stop());
    let ended = stream
        .next()
        .await
        .expect("the stream ends with a status")
        .expect_err("no event, the end");
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    assert_eq!(info(&ended).0, "SHUTTING_DOWN", "{ended:?}");
    assert!(
        ended.message().contains("resume with Watch"),
        "{}",
        ended.message()
    );
    stopping.await.expect("the server stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_reports_then_frees_only_unchanged_orphans() {
    let s = start(4).await;
    let mut c = s.client().await;
    let live = 1u128;
    let dead = 2u128;
    let g = device(&mut c, "0000:3b:10.0").await.generation;
    claim(&mut c, "0000:3b:10.0", live, "a", g)
        .await
        .expect("live claim");
    let g = device(&mut c, "0000:3b:10.1").await.generation;
    claim(&mut c, "0000:3b:10.1", dead, "b", g)
        .await
        .expect("dead claim");
    let snapshot = listing(&mut c).await.host_generation;
    // A claim made after the controller's snapshot: changed, never acted on.
    let g = device(&mut c, "0000:3b:10.2").await.generation;
    claim(&mut c, "0000:3b:10.2", 3, "c", g)
        .await
        .expect("late claim");
    let req = |act| proto::ReconcileRequest {
        expected_consumer_ids: vec![owner(live).consumer_id],
        snapshot_generation: snapshot,
        act,
        request_id: "audit-1".into(),
    };
    // A snapshot past the agent's host generation was not read from it (another host's
    // agent, a state dir restored since): every claim would look unchanged since it.
    // Refused, acting or not, and nothing is freed.
    let current = listing(&mut c).await.host_generation;
    for act in [false, true] {
        let ahead = c
            .reconcile(proto::ReconcileRequest {
                snapshot_generation: current + 1,
                ..req(act)
            })
            .await
            .expect_err("a snapshot from the future");
        assert_eq!(ahead.code(), Code::OutOfRange, "{ahead:?}");
        let (why, meta) = info(&ahead);
        assert_eq!(why, "SNAPSHOT_AHEAD");
        assert_eq!(meta["current_generation"], current.to_string());
        assert_eq!(meta["snapshot_generation"], (current + 1).to_string());
    }
    assert_eq!(listing(&mut c).await.host_generation, current);
    let dry = c.reconcile(req(false)).await.expect("dry run").into_inner();
    assert!(!dry.acted);
    let orphans: Vec<&str> = dry
        .orphans
        .iter()
        .filter_map(|o| o.device.as_ref().map(|d| d.address.as_str()))
        .collect();
    assert_eq!(orphans, vec!["0000:3b:10.1"]);
    assert_eq!(dry.changed.len(), 1);
    assert_eq!(dry.changed[0].address, "0000:3b:10.2");
    // The dry run changed nothing.
    assert_eq!(
        device(&mut c, "0000:3b:10.1").await.state,
        proto::DeviceState::Claimed as i32
    );
    let acted = c.reconcile(req(true)).await.expect("act").into_inner();
    assert!(acted.acted);
    assert!(acted.orphans[0].freed_generation > snapshot);
    assert_eq!(
        device(&mut c, "0000:3b:10.1").await.state,
        proto::DeviceState::Free as i32
    );
    assert_eq!(
        device(&mut c, "0000:3b:10.2").await.state,
        proto::DeviceState::Claimed as i32
    );
    assert_eq!(
        device(&mut c, "0000:3b:10.0").await.state,
        proto::DeviceState::Claimed as i32
    );
    s.stop().await;
}

/// A dead instance that held two VFs: one acting audit frees both (each orphan's free is
/// its own request, "<audit id>@<address>"), a retry of the audit frees nothing more but
/// lists what the first attempt freed, and an audit id too long to carry an address is
/// refused before anything is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_frees_every_orphan_of_one_owner() {
    let s = start(4).await;
    let mut c = s.client().await;
    let dead = 2u128;
    for (vf, req) in [("0000:3b:10.1", "b1"), ("0000:3b:10.3", "b2")] {
        let g = device(&mut c, vf).await.generation;
        claim(&mut c, vf, dead, req, g).await.expect("dead claim");
    }
    let snapshot = listing(&mut c).await.host_generation;
    let req = |request_id: &str| proto::ReconcileRequest {
        expected_consumer_ids: vec![],
        snapshot_generation: snapshot,
        act: true,
        request_id: request_id.into(),
    };
    let too_long = c
        .reconcile(req(&"x".repeat(112)))
        .await
        .expect_err("an id with no room for an address");
    assert_eq!(too_long.code(), Code::InvalidArgument, "{too_long:?}");
    assert!(too_long.message().contains("111"), "{}", too_long.message());
    assert_eq!(
        device(&mut c, "0000:3b:10.1").await.state,
        proto::DeviceState::Claimed as i32,
        "the refused audit freed nothing"
    );

    let acted = c
        .reconcile(req(&"a".repeat(111)))
        .await
        .expect("act")
        .into_inner();
    let freed: Vec<(&str, bool)> = acted
        .orphans
        .iter()
        .map(|o| {
            let d = o.device.as_ref().expect("device");
            (
                d.address.as_str(),
                o.freed_generation > snapshot && o.kept_because.is_empty(),
            )
        })
        .collect();
    assert_eq!(freed, vec![("0000:3b:10.1", true), ("0000:3b:10.3", true)]);
    for vf in ["0000:3b:10.1", "0000:3b:10.3"] {
        assert_eq!(
            device(&mut c, vf).await.state,
            proto::DeviceState::Free as i32
        );
    }
    // Each free is logged under its own id.
    let out = support::request_outcome(
        &mut c,
        owner(dead).consumer_id,
        format!("{}@0000:3b:10.3", "a".repeat(111)),
    )
    .await;
    assert_eq!(out.operation, "released");

    // The retry of a caller that lost that answer: nothing is freed again, and the
    // answer lists what the first attempt freed, with the same generations.
    let again = c
        .reconcile(req(&"a".repeat(111)))
        .await
        .expect("retry")
        .into_inner();
    assert_eq!(
        again.host_generation, acted.host_generation,
        "nothing freed again"
    );
    let replayed: Vec<(&str, u64, bool, i32)> = again
        .orphans
        .iter()
        .map(|o| {
            let d = o.device.as_ref().expect("the device as it is now");
            (
                d.address.as_str(),
                o.freed_generation,
                o.earlier_attempt,
                d.state,
            )
        })
        .collect();
    let first: Vec<(&str, u64, bool, i32)> = acted
        .orphans
        .iter()
        .map(|o| {
            let d = o.device.as_ref().expect("device");
            (
                d.address.as_str(),
                o.freed_generation,
                true,
                proto::DeviceState::Free as i32,
            )
        })
        .collect();
    assert_eq!(replayed, first, "{again:?}");
    assert!(acted.orphans.iter().all(|o| !o.earlier_attempt));
    // Another audit id is another audit: nothing to free, nothing to recall.
    let other = c
        .reconcile(req("b"))
        .await
        .expect("another audit")
        .into_inner();
    assert!(other.orphans.is_empty(), "{other:?}");

    // The audit's id used again, by a later audit that finds the device orphaned once
    // more: the free logged under that id is not this one. The orphan is kept, saying
    // why; before, the earlier free was replayed and reported as this one's, with its
    // old generation, while the device stayed claimed.
    let g = device(&mut c, "0000:3b:10.1").await.generation;
    claim(&mut c, "0000:3b:10.1", dead, "b3", g)
        .await
        .expect("claimed again");
    let later = listing(&mut c).await.host_generation;
    let reused = c
        .reconcile(proto::ReconcileRequest {
            snapshot_generation: later,
            ..req(&"a".repeat(111))
        })
        .await
        .expect("an audit id used again")
        .into_inner();
    let orphan = reused
        .orphans
        .iter()
        .find(|o| !o.earlier_attempt)
        .expect("the orphan");
    assert_eq!(
        orphan.device.as_ref().expect("device").address,
        "0000:3b:10.1"
    );
    assert_eq!(orphan.freed_generation, 0, "{orphan:?}");
    assert!(orphan.kept_because.contains("used before"), "{orphan:?}");
    assert_eq!(
        device(&mut c, "0000:3b:10.1").await.state,
        proto::DeviceState::Claimed as i32
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_clients_never_share_a_device() {
    let s = start(48).await;
    let mut tasks = Vec::new();
    for i in 0..64u128 {
        let socket = s.socket.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = hostdevd::client::connect(&socket).await.expect("connect");
            c.claim(proto::ClaimRequest {
                vfio: false,
                owner: Some(owner(100 + i)),
                request_id: format!("c{i}"),
                target: Some(proto::claim_request::Target::Selector(proto::Selector {
                    pf_address: PF.into(),
                    ..Default::default()
                })),
            })
            .await
        }));
    }
    let mut addrs = BTreeSet::new();
    let mut exhausted = 0;
    for t in tasks {
        match t.await.expect("join") {
            Ok(r) => {
                let a = r.into_inner().device.expect("device").address;
                assert!(addrs.insert(a.clone()), "{a} handed out twice");
            }
            Err(e) if e.code() == Code::ResourceExhausted => exhausted += 1,
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    assert_eq!(addrs.len(), 48);
    assert_eq!(exhausted, 16);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_generation_and_counts() {
    let s = start(4).await;
    let mut c = s.client().await;
    let st = c
        .get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert_eq!(st.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(st.host_generation, listing(&mut c).await.host_generation);
    assert!(st.store.expect("store health").ok);
    assert_eq!(st.devices_by_state.get("free").copied(), Some(6));
    s.stop().await;
}

#[test]
fn a_second_uid_may_read_but_not_mutate() {
    if !nix::unistd::getuid().is_root() {
        panic!("this test needs root to run a child as another uid (CI runs as root)");
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let s = rt.block_on(start(2));
    // The child runs as nobody (65534); the server's writers are root and this uid.
    let child = |args: &[&str]| {
        use std::os::unix::process::CommandExt;
        std::process::Command::new(env!("CARGO_BIN_EXE_hostdevctl"))
            .arg("--socket")
            .arg(&s.socket)
            .args(args)
            .uid(65534)
            .gid(65534)
            .output()
            .expect("run hostdevctl as nobody")
    };
    let read = child(&["status"]);
    assert!(
        read.status.success(),
        "read as nobody: {}",
        String::from_utf8_lossy(&read.stderr)
    );
    let write = child(&[
        "claim",
        "0000:3b:10.0",
        "--owner",
        "00000000-0000-0000-0000-000000000001",
    ]);
    assert!(!write.status.success());
    let err = String::from_utf8_lossy(&write.stderr);
    assert!(err.contains("uid 65534"), "{err}");
    // A reader asking for an unknown request's outcome only looks: the id stays open.
    let asked = child(&[
        "outcome",
        "--owner",
        &owner(1).consumer_id,
        "--request-id",
        "asked-by-a-reader",
    ]);
    assert!(!asked.status.success());
    let err = String::from_utf8_lossy(&asked.stderr);
    assert!(err.contains("not applied so far"), "{err}");
    rt.block_on(async {
        let mut c = s.client().await;
        let g = device(&mut c, "0000:3b:10.0").await.generation;
        assert_eq!(
            device(&mut c, "0000:3b:10.0").await.state,
            proto::DeviceState::Free as i32
        );
        claim(&mut c, "0000:3b:10.0", 1, "asked-by-a-reader", g)
            .await
            .expect("a reader's question closes nothing");
        s.stop().await;
    });
}
