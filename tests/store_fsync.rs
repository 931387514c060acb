//! A disk whose sync fails after the data reached it, on the real binary: the commit's
//! outcome is unknown, so its caller hears exactly that (never "nothing was changed"),
//! the agent stops with a failure, and the next start reads back what the disk holds,
//! which GetRequestOutcome then reports and the listing agrees with. The state
//! directory is a FUSE pass-through (`benches/support/slowsync.rs`) told to fail every
//! sync with EIO; needs /dev/fuse and root (CI runs as root), and fails loudly without.

use std::time::Duration;

use hostdevd::api::proto::{self};
use hostdevd::simhost::FakeSys;
use tonic_types::StatusExt;

#[path = "../benches/support/slowsync.rs"]
mod slowsync;
mod support;

use support::{config_in, device, owner, Daemon};

const PF: &str = "0000:3b:00.0";

async fn claim(
    c: &mut hostdevd::client::Client,
    a: &str,
    who: u128,
    request_id: &str,
) -> Result<proto::ClaimResponse, tonic::Status> {
    let g = device(c, a).await.generation;
    c.claim(proto::ClaimRequest {
        owner: Some(owner(who)),
        request_id: request_id.into(),
        target: Some(proto::claim_request::Target::Address(proto::ByAddress {
            address: a.into(),
            expected_generation: g,
        })),
        vfio: false,
    })
    .await
    .map(|r| r.into_inner())
}

/// A temp dir and, in it, a FUSE pass-through whose syncs a test can make fail (for the
/// state directory).
fn failing_disk() -> (tempfile::TempDir, slowsync::SlowSync) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/store_fsync.rs mounts a FUSE filesystem as root (CI runs as root)"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = slowsync::SlowSync::mount(dir.path(), Duration::ZERO);
    (dir, disk)
}

/// Waits up to 30 s for the agent to stop by itself after a failed commit: its status.
async fn stopped_by_itself(daemon: &mut Daemon) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(s) = daemon.0.try_wait().expect("wait") {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent did not stop after the failed commit"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_sync_leaves_the_outcome_unknown_and_the_restart_reads_it_back() {
    let (dir, disk) = failing_disk();
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 8, 2)
        .driver(PF, "i40e")
        .vf_iommu_groups(PF, 40);
    let vfs: Vec<String> = f.vfs(PF).iter().map(|a| a.to_string()).collect();
    let tree = f.build();
    std::fs::write(
        dir.path().join("config.toml"),
        config_in(&tree, dir.path(), disk.path(), ""),
    )
    .expect("config");

    let (mut daemon, mut c) = Daemon::serve_in(dir.path()).await;
    claim(&mut c, &vfs[0], 1, "before")
        .await
        .expect("a good disk");

    disk.fail_syncs(true);
    let e = claim(&mut c, &vfs[1], 2, "during")
        .await
        .expect_err("the sync failed");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    let reason = e.get_details_error_info().expect("ErrorInfo").reason;
    assert_eq!(reason, "STORE_OUTCOME_UNKNOWN", "{e:?}");
    assert!(e.message().contains("may or may not"), "{}", e.message());

    // The agent stops by itself, with a failure (systemd would start it again).
    let status = stopped_by_itself(&mut daemon).await;
    assert!(!status.success(), "exit status {status}");

    // The disk recovers; the next start reads back what it holds, and the request's
    // outcome, the listing and the first claim all agree with it.
    disk.fail_syncs(false);
    let (daemon, mut c) = Daemon::serve_in(dir.path()).await;
    assert_eq!(device(&mut c, &vfs[0]).await.owner, Some(owner(1)), "kept");
    let outcome = c
        .get_request_outcome(proto::GetRequestOutcomeRequest {
            consumer_id: owner(2).consumer_id,
            request_id: "during".into(),
        })
        .await;
    let vf1 = device(&mut c, &vfs[1]).await;
    match outcome {
        Ok(o) => {
            assert_eq!(o.into_inner().address, vfs[1]);
            assert_eq!(vf1.owner, Some(owner(2)), "applied, and listed so");
            println!("store fsync: the failed commit was read back as applied");
        }
        Err(e) => {
            assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
            assert_eq!(vf1.owner, None, "not applied, and listed so");
            println!("store fsync: the failed commit was not on the disk");
        }
    }
    daemon.terminate().await;
}

/// A release that gave its binding's drivers back and then failed to sync has an unknown
/// outcome: it may have freed the claim with the only record of the original drivers.
/// The drivers stay given back (never bound to vfio-pci again, where nothing would give
/// them back after a start that reads the release as applied), and after the restart the
/// device is on its own driver whichever way the commit went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_commit_is_unknown_leaves_the_drivers_given_back() {
    let (dir, disk) = failing_disk();
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 8, 2)
        .driver(PF, "i40e")
        .vf_iommu_groups(PF, 40)
        .vf_driver(PF, "iavf");
    // A device on vfio-pci: the driver is "loaded".
    f.device("0000:5e:00.0", 0x10de, 0x1db6)
        .driver("0000:5e:00.0", "vfio-pci")
        .iommu_group("0000:5e:00.0", 90);
    let vf = f.vfs(PF)[0].to_string();
    let tree = f.build();
    let _k = support::fakekernel::FakeKernel::start(tree.sysfs_root(), tree.dev_root());
    // A proc tree of the test's own: no process holds the VF's group.
    let proc_root = dir.path().join("proc");
    std::fs::create_dir_all(proc_root.join("sys/kernel/random")).expect("proc");
    std::fs::write(
        proc_root.join("sys/kernel/random/boot_id"),
        "3c9d5e2a-6b1f-4e8d-a7c3-2f4b6d8e0a1c\n",
    )
    .expect("boot id");
    std::fs::write(
        dir.path().join("config.toml"),
        format!(
            "proc_root = {proc_root:?}\n{}",
            config_in(&tree, dir.path(), disk.path(), "")
        ),
    )
    .expect("config");
    let driver = || {
        std::fs::read_link(tree.bus_link(&vf).join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    };
    let (mut daemon, mut c) = Daemon::serve_in(dir.path()).await;
    let g = device(&mut c, &vf).await.generation;
    c.claim(proto::ClaimRequest {
        owner: Some(owner(1)),
        request_id: "bind".into(),
        target: Some(proto::claim_request::Target::Address(proto::ByAddress {
            address: vf.clone(),
            expected_generation: g,
        })),
        vfio: true,
    })
    .await
    .expect("claimed and bound");
    assert_eq!(driver().as_deref(), Some("vfio-pci"));
    let g = device(&mut c, &vf).await.generation;

    disk.fail_syncs(true);
    let e = c
        .release(proto::ReleaseRequest {
            address: vf.clone(),
            owner: Some(owner(1)),
            request_id: "stop".into(),
            generation: g,
        })
        .await
        .expect_err("the sync failed");
    let reason = e.get_details_error_info().expect("ErrorInfo").reason;
    assert_eq!(reason, "STORE_OUTCOME_UNKNOWN", "{e:?}");
    assert_eq!(
        driver().as_deref(),
        Some("iavf"),
        "the driver stays given back"
    );
    stopped_by_itself(&mut daemon).await;
    disk.fail_syncs(false);
    let (daemon, mut c) = Daemon::serve_in(dir.path()).await;
    let d = device(&mut c, &vf).await;
    if d.owner.is_some() {
        // Not applied: the claim stands, and the release, sent again, finds the driver
        // given back already.
        c.release(proto::ReleaseRequest {
            address: vf.clone(),
            owner: Some(owner(1)),
            request_id: "stop".into(),
            generation: d.generation,
        })
        .await
        .expect("released");
    }
    assert_eq!(device(&mut c, &vf).await.owner, None);
    assert_eq!(driver().as_deref(), Some("iavf"));
    daemon.terminate().await;
}
