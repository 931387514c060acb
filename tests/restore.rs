//! A state directory restored from an older copy, on the real binary: the agent never
//! hands out a generation again that it handed out before the restore (I5), so a
//! controller's snapshot from before it can never cover a claim made after it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use hostdevd::api::proto::{self};
use hostdevd::client::Client;
use hostdevd::simhost::FakeSys;

mod support;

use support::{config_in, device, owner, Daemon};

const PF: &str = "0000:3b:00.0";

/// Copies the state directory's files, modes included (what a backup and its restore
/// both do).
fn copy_state(from: &Path, to: &Path) {
    std::fs::create_dir(to).expect("mkdir");
    let mode = std::fs::metadata(from).expect("stat").permissions().mode();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode)).expect("chmod");
    for e in std::fs::read_dir(from).expect("list the state dir") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

async fn host_generation(c: &mut Client) -> u64 {
    c.get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner()
        .host_generation
}

/// Claims `a` at its generation now; returns the claim's generation.
async fn claim(c: &mut Client, a: &str, who: u128) -> u64 {
    let g = device(c, a).await.generation;
    c.claim(proto::ClaimRequest {
        owner: Some(owner(who)),
        request_id: format!("claim-{a}-{g}"),
        target: Some(proto::claim_request::Target::Address(proto::ByAddress {
            address: a.into(),
            expected_generation: g,
        })),
        vfio: false,
    })
    .await
    .expect("claim")
    .into_inner()
    .generation
}

async fn release(
    c: &mut Client,
    a: &str,
    who: u128,
    g: u64,
) -> Result<proto::ReleaseResponse, tonic::Status> {
    c.release(proto::ReleaseRequest {
        address: a.into(),
        owner: Some(owner(who)),
        request_id: format!("release-{a}-{g}"),
        generation: g,
    })
    .await
    .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_state_dir_never_hands_out_a_generation_again() {
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 8, 4)
        .netdev(PF, "ens1f0")
        .vf_iommu_groups(PF, 40);
    let vfs: Vec<String> = f.vfs(PF).iter().map(|a| a.to_string()).collect();
    let tree = f.build();
    let dir = tempfile::tempdir().expect("tempdir");
    let devices = "[[devices]]\npf_name = \"ens1f0\"\nvf = true\n";
    let config = config_in(&tree, dir.path(), &dir.path().join("state"), devices);
    std::fs::write(dir.path().join("config.toml"), config).expect("config");
    let state = dir.path().join("state");
    let backup = dir.path().join("backup");

    // The backup: VF 0 claimed by A.
    let (daemon, mut c) = Daemon::serve_in(dir.path()).await;
    let a_claim = claim(&mut c, &vfs[0], 1).await;
    daemon.terminate().await;
    copy_state(&state, &backup);

    // After it: A frees VF 0, B takes it and VF 1. The controller's audit reads the host
    // generation here, the belief it then forms knowing every consumer up to it.
    let (daemon, mut c) = Daemon::serve_in(dir.path()).await;
    release(&mut c, &vfs[0], 1, a_claim)
        .await
        .expect("A frees VF 0");
    let b_claim = claim(&mut c, &vfs[0], 2).await;
    claim(&mut c, &vfs[1], 2).await;
    let snapshot = host_generation(&mut c).await;
    daemon.terminate().await;

    // The state dir comes back from the backup.
    std::fs::remove_dir_all(&state).expect("remove the state dir");
    copy_state(&backup, &state);
    let (daemon, mut c) = Daemon::serve_in(dir.path()).await;
    let restored = host_generation(&mut c).await;
    assert!(
        restored > snapshot,
        "the host generation after the restore ({restored}) is past every one handed out before it ({snapshot})"
    );
    let d = device(&mut c, &vfs[0]).await;
    assert_eq!(d.owner, Some(owner(1)), "the backup's claim, as it was");
    assert_eq!(d.generation, a_claim);
    let e = release(&mut c, &vfs[0], 2, b_claim)
        .await
        .expect_err("B's token names a claim the restored ledger never saw");
    assert_eq!(e.code(), tonic::Code::Aborted, "{e:?}");

    // A new consumer claims VF 2 after the restore. An audit still working from the
    // snapshot taken before it (expecting only A and B) must see this claim as changed
    // since, never as an orphan to free.
    let d_claim = claim(&mut c, &vfs[2], 4).await;
    assert!(d_claim > snapshot, "{d_claim} is a new generation");
    let audit = c
        .reconcile(proto::ReconcileRequest {
            expected_consumer_ids: vec![owner(1).consumer_id, owner(2).consumer_id],
            snapshot_generation: snapshot,
            act: true,
            request_id: "audit-before-the-restore".into(),
        })
        .await
        .expect("reconcile")
        .into_inner();
    assert!(
        audit
            .orphans
            .iter()
            .all(|o| o.device.as_ref().map(|d| d.address.as_str()) != Some(vfs[2].as_str())),
        "{audit:?}"
    );
    assert!(
        audit.changed.iter().any(|d| d.address == vfs[2]),
        "{audit:?}"
    );
    assert_eq!(
        device(&mut c, &vfs[2]).await.owner,
        Some(owner(4)),
        "still claimed"
    );
    daemon.terminate().await;
}
