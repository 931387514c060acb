//! Hardware actions and hotplug through the real agent on a real socket, on a fake
//! sysfs tree whose kernel side is played by `support::fakekernel` (it answers sysfs
//! writes as the kernel would and sends real netlink uevents, so this needs root, which
//! CI has). Write faults (EBUSY, EIO, EINVAL) come from `support::faultfs`, a FUSE file
//! planted in the tree. The same actions against a real kernel are in tests/vm/.

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hostdevd::api::proto::{self};
use hostdevd::client::Client;
use hostdevd::config::Config;
use hostdevd::simhost::{FakeSys, FakeTree};
use support::fakekernel::{send_rename_uevent, send_uevent, send_uevent_numbered, FakeKernel};
use tokio_stream::StreamExt;
use tonic::Code;
use tonic_types::StatusExt;

const PF: &str = "0000:3b:00.0";

/// Held by each test while it runs: the tests take turns. Their uevents go to one
/// multicast group that every test daemon in this process listens on, so one test's
/// burst would overflow the others' sockets, and their stand-in kernels would compete
/// for the two cores.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Checks for root and waits for this test's turn.
async fn alone() -> tokio::sync::MutexGuard<'static, ()> {
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "tests/hardware.rs needs root (netlink uevents are sent as the kernel would); CI runs as root"
    );
    ALONE.lock().await
}

/// A PF with 4 VFs on iavf, each VF in its own IOMMU group, and a device on vfio-pci
/// (so the vfio-pci driver is "loaded").
fn tree() -> FakeTree {
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 8, 4).driver(PF, "i40e");
    f.vf_driver(PF, "iavf").vf_iommu_groups(PF, 40);
    f.device("0000:5e:00.0", 0x10de, 0x1db6)
        .driver("0000:5e:00.0", "vfio-pci")
        .iommu_group("0000:5e:00.0", 90);
    f.build()
}

async fn start(t: &FakeTree, step_timeout_ms: u64, rcvbuf: usize) -> support::server::TestServer {
    start_tuned(t, step_timeout_ms, rcvbuf, |_| {}).await
}

/// [`start`] with the configuration changed by `tune` last.
async fn start_tuned(
    t: &FakeTree,
    step_timeout_ms: u64,
    rcvbuf: usize,
    tune: impl FnOnce(&mut Config),
) -> support::server::TestServer {
    let mut cfg = Config {
        sysfs_root: t.sysfs_root().to_path_buf(),
        dev_root: t.dev_root().to_path_buf(),
        ..Config::default()
    };
    cfg.libvirt.enabled = false;
    cfg.hardware.step_timeout_ms = step_timeout_ms;
    cfg.hotplug.receive_buffer_bytes = rcvbuf;
    // A proc tree of the test's own: empty unless a test plants a holder in it, but for
    // the boot's id, which the devices' instances are read in.
    cfg.proc_root = t.sysfs_root().join("fake-proc");
    std::fs::create_dir_all(cfg.proc_root.join("sys/kernel/random")).expect("fake proc");
    std::fs::write(
        cfg.proc_root.join("sys/kernel/random/boot_id"),
        "3c9d5e2a-6b1f-4e8d-a7c3-2f4b6d8e0a1c\n",
    )
    .expect("boot id");
    tune(&mut cfg);
    support::server::TestServer::start(cfg, 0o600, vec![0], None).await
}

fn owner(n: u128) -> proto::Owner {
    proto::Owner {
        consumer_id: uuid::Uuid::from_u128(n).to_string(),
        label: format!("vm-{n}"),
    }
}

async fn device(c: &mut Client, a: &str) -> Option<proto::Device> {
    c.get_device(proto::GetDeviceRequest { address: a.into() })
        .await
        .ok()
        .and_then(|r| r.into_inner().device)
}

async fn vf(c: &mut Client, i: usize) -> String {
    let pf = device(c, PF).await.expect("PF");
    pf.sriov.expect("sriov").vfs[i].clone()
}

/// Polls until `f` holds of the device list, or fails after 30 s.
async fn until(
    c: &mut Client,
    what: &str,
    f: impl Fn(&[proto::Device]) -> bool,
) -> Vec<proto::Device> {
    let start = Instant::now();
    loop {
        let list = c
            .list_devices(proto::ListDevicesRequest {})
            .await
            .expect("list")
            .into_inner()
            .devices;
        if f(&list) {
            return list;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn reason(s: &tonic::Status) -> (String, HashMap<String, String>) {
    let i = s.get_details_error_info().expect("ErrorInfo");
    (i.reason, i.metadata)
}

/// Claims `a` at its generation now, with a request id of its own.
async fn claim(
    c: &mut Client,
    a: &str,
    who: u128,
    vfio: bool,
) -> Result<proto::ClaimResponse, tonic::Status> {
    let g = device(c, a).await.expect("device").generation;
    claim_as(c, a, who, vfio, &format!("claim-{a}-{g}"), g).await
}

/// Claims `a` with a given request id and expected generation (a retry sends the same).
async fn claim_as(
    c: &mut Client,
    a: &str,
    who: u128,
    vfio: bool,
    request_id: &str,
    g: u64,
) -> Result<proto::ClaimResponse, tonic::Status> {
    c.claim(proto::ClaimRequest {
        owner: Some(owner(who)),
        request_id: request_id.into(),
        target: Some(proto::claim_request::Target::Address(proto::ByAddress {
            address: a.into(),
            expected_generation: g,
        })),
        vfio,
    })
    .await
    .map(|r| r.into_inner())
}

/// Releases `a` at its generation now, with a request id of its own.
async fn release(
    c: &mut Client,
    a: &str,
    who: u128,
) -> Result<proto::ReleaseResponse, tonic::Status> {
    let g = device(c, a).await.expect("device").generation;
    release_as(c, a, who, &format!("release-{a}-{g}"), g).await
}

/// Releases `a` with a given request id and generation (a retry sends the same).
async fn release_as(
    c: &mut Client,
    a: &str,
    who: u128,
    request_id: &str,
    g: u64,
) -> Result<proto::ReleaseResponse, tonic::Status> {
    c.release(proto::ReleaseRequest {
        address: a.into(),
        owner: Some(owner(who)),
        request_id: request_id.into(),
        generation: g,
    })
    .await
    .map(|r| r.into_inner())
}

async fn set_vfs(
    c: &mut Client,
    count: u32,
    generation: u64,
) -> Result<proto::SetVfCountResponse, tonic::Status> {
    c.set_vf_count(proto::SetVfCountRequest {
        address: PF.into(),
        vf_count: count,
        generation,
        drivers_autoprobe: Some(false),
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_with_vfio_binds_and_release_restores_the_driver() {
    let _alone = alone().await;
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 1).await;

    let r = claim(&mut c, &a, 7, true).await.expect("claim --vfio");
    let d = device(&mut c, &a).await.expect("device");
    assert_eq!(d.driver, "vfio-pci");
    assert_eq!(
        d.generation, r.generation,
        "the answer carries the generation after binding"
    );
    assert_eq!(d.vfio_binding.len(), 1);
    assert_eq!(d.vfio_binding[0].original_driver, "iavf");
    assert!(
        t.dev_root().join("vfio/41").exists(),
        "the group node appeared"
    );
    assert!(d.vfio_group.ends_with("vfio/41"), "{:?}", d.vfio_group);
    let override_now =
        std::fs::read_to_string(t.bus_link(&a).join("driver_override")).expect("override");
    assert_eq!(override_now.trim(), "vfio-pci");

    // A stale generation binds nothing.
    let e = c
        .prepare_vfio(proto::PrepareVfioRequest {
            address: a.clone(),
            owner: Some(owner(7)),
            generation: 1,
            request_id: String::new(),
        })
        .await
        .expect_err("stale");
    assert_eq!(e.code(), Code::Aborted);

    // A process holding the group open (as QEMU would) blocks the release, and the
    // device stays on vfio-pci.
    let holder = plant_holder(&t, 4242, "vm-7", &t.dev_root().join("vfio/41"));
    let e = release(&mut c, &a, 7).await.expect_err("held open");
    assert_eq!(e.code(), Code::FailedPrecondition);
    let (why, meta) = reason(&e);
    assert_eq!(why, "VFIO_GROUP_IN_USE");
    assert_eq!(meta.get("holder_pid").map(String::as_str), Some("4242"));
    assert_eq!(device(&mut c, &a).await.expect("device").driver, "vfio-pci");
    // A release the ledger refuses anyway gets the ledger's own answer, not the check's:
    // a stale generation, another owner.
    let stale = release_as(&mut c, &a, 7, "stale", 1)
        .await
        .expect_err("stale");
    assert_eq!(
        (stale.code(), reason(&stale).0.as_str()),
        (Code::Aborted, "STALE_GENERATION")
    );
    let g = device(&mut c, &a).await.expect("device").generation;
    let theirs = release_as(&mut c, &a, 8, "not-mine", g)
        .await
        .expect_err("another owner");
    assert_eq!(reason(&theirs).0, "WRONG_OWNER", "{theirs:?}");
    assert_eq!(device(&mut c, &a).await.expect("device").generation, g);
    std::fs::remove_dir_all(&holder).expect("holder exits");

    release(&mut c, &a, 7).await.expect("release");
    let d = device(&mut c, &a).await.expect("device");
    assert_eq!(d.driver, "iavf", "original driver back");
    assert_eq!(d.state, proto::DeviceState::Free as i32);
    assert!(d.vfio_binding.is_empty());
    assert!(!t.dev_root().join("vfio/41").exists());
    // The cleared override reads "(null)" once the stand-in kernel has seen it.
    let override_path = t.bus_link(&a).join("driver_override");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = std::fs::read_to_string(&override_path).expect("override");
        if now.trim() == "(null)" {
            break;
        }
        assert!(Instant::now() < deadline, "the override reads {now:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.stop().await;
}

/// Plants a process holding `node` open (as QEMU holds its VFIO group for `domain`) in
/// the test's proc tree; returns its directory, whose removal is the process exiting.
fn plant_holder(
    t: &FakeTree,
    pid: u32,
    domain: &str,
    node: &std::path::Path,
) -> std::path::PathBuf {
    let holder = t.sysfs_root().join("fake-proc").join(pid.to_string());
    std::fs::create_dir_all(holder.join("fd")).expect("holder");
    std::fs::write(holder.join("comm"), "qemu-system-x86\n").expect("comm");
    std::fs::write(
        holder.join("cmdline"),
        format!("qemu-system-x86_64\0-name\0guest={domain}\0"),
    )
    .expect("cmdline");
    std::os::unix::fs::symlink(node, holder.join("fd/12")).expect("fd");
    holder
}

/// A process that holds a VFIO device's descriptor and closed its group's (or was handed
/// the device descriptor alone) keeps the group open, and `/proc` names no node for it,
/// only `anon_inode:[vfio-device]`: a release of a device on vfio-pci is refused while
/// such a process runs, naming it, and goes through once it is gone. Before, it was
/// freed under that process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vfio_device_descriptor_alone_blocks_a_release() {
    let _alone = alone().await;
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 1).await;
    claim(&mut c, &a, 7, true).await.expect("claim --vfio");
    let holder = plant_holder(
        &t,
        4343,
        "vm-7",
        std::path::Path::new("anon_inode:[vfio-device]"),
    );
    let e = release(&mut c, &a, 7)
        .await
        .expect_err("a device descriptor is held");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let (why, meta) = reason(&e);
    assert_eq!(why, "VFIO_GROUP_IN_USE");
    assert_eq!(meta.get("holder_pid").map(String::as_str), Some("4343"));
    assert!(
        e.message().contains("VFIO device descriptor"),
        "{}",
        e.message()
    );
    assert_eq!(device(&mut c, &a).await.expect("device").driver, "vfio-pci");
    // The container node it keeps for its DMA mappings names no device either.
    std::os::unix::fs::symlink(t.dev_root().join("vfio/vfio"), holder.join("fd/14")).expect("fd");
    let e = release(&mut c, &a, 7)
        .await
        .expect_err("a device descriptor and the container");
    assert_eq!(
        reason(&e).1.get("holder_pid").map(String::as_str),
        Some("4343")
    );
    // Nor does a vhost-vdpa node.
    std::os::unix::fs::symlink(t.dev_root().join("vhost-vdpa-0"), holder.join("fd/15"))
        .expect("fd");
    let e = release(&mut c, &a, 7)
        .await
        .expect_err("a device descriptor and a vhost-vdpa node");
    assert_eq!(
        reason(&e).1.get("holder_pid").map(String::as_str),
        Some("4343")
    );
    // A process that holds the same kind of descriptor and a group node too is the
    // group's holder, and only that group's: another device's release goes through.
    std::fs::remove_dir_all(&holder).expect("the process ends");
    let b = vf(&mut c, 2).await;
    claim(&mut c, &b, 8, true).await.expect("claim --vfio");
    let other = plant_holder(&t, 4444, "vm-8", &t.dev_root().join("vfio/42"));
    std::os::unix::fs::symlink("anon_inode:[vfio-device]", other.join("fd/13")).expect("fd");
    release(&mut c, &a, 7)
        .await
        .expect("nothing holds the first VF now");
    let e = release(&mut c, &b, 8).await.expect_err("its group is held");
    assert_eq!(
        reason(&e).1.get("holder_pid").map(String::as_str),
        Some("4444")
    );
    std::fs::remove_dir_all(&other).expect("the process ends");
    release(&mut c, &b, 8).await.expect("released");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claims_release_is_not_checked_against_the_device_now_at_its_address() {
    let _alone = alone().await;
    let t = tree();
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 2).await;
    claim(&mut c, &a, 10, false).await.expect("claim");

    // The VF goes, and the same function comes back: a new device at the address, while
    // the first claim stays lost until its owner releases it.
    t.remove_device(&a);
    send_uevent("remove", &a);
    until(&mut c, "claimed VF lost", |l| {
        l.iter().any(|d| d.address == a && !d.present)
    })
    .await;
    t.replug_device(&a);
    send_uevent("add", &a);
    until(&mut c, "VF back", |l| {
        l.iter().any(|d| d.address == a && d.present)
    })
    .await;
    let lost_generation = |c: &mut Client| {
        let mut c = c.clone();
        let a = a.clone();
        async move {
            let r = c
                .get_device(proto::GetDeviceRequest { address: a })
                .await
                .expect("get")
                .into_inner();
            r.lost.iter().map(|d| d.generation).collect::<Vec<_>>()
        }
    };
    let lost = lost_generation(&mut c).await;
    assert_eq!(lost.len(), 1, "one lost claim at {a}");

    // Another consumer claims the new device, and a VM holds its VFIO group open: its
    // own release is refused for that.
    claim(&mut c, &a, 11, false)
        .await
        .expect("claim the new device");
    let now = device(&mut c, &a).await.expect("device");
    assert_eq!(now.state, proto::DeviceState::Claimed as i32);
    let group = now.iommu_group.expect("group");
    let holder = plant_holder(&t, 4343, "vm-11", &t.vfio_node(group));
    let e = release(&mut c, &a, 11).await.expect_err("held open");
    assert_eq!(
        (e.code(), reason(&e).0.as_str()),
        (Code::FailedPrecondition, "VFIO_GROUP_IN_USE")
    );

    // The lost claim's owner frees its lost claim: that device is gone, the held one is
    // another's and is not what this release frees, so it is not checked against it. A
    // watcher is told which of the two records at the address went.
    let from = c
        .get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner()
        .host_generation;
    let mut watch = c
        .watch(proto::WatchRequest {
            from_generation: from,
            snapshot: false,
        })
        .await
        .expect("watch")
        .into_inner();
    let r = release_as(&mut c, &a, 10, "free-the-lost-one", lost[0])
        .await
        .expect("the lost claim is released");
    let removed = loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .expect("an event in time")
            .expect("the stream is open")
            .expect("an event");
        if ev.kind == proto::WatchEventKind::Removed as i32 {
            break ev;
        }
    };
    assert_eq!(removed.address, a);
    let gone = removed.device.expect("which record went");
    assert!(
        !gone.present,
        "the lost claim went, not the present device: {gone:?}"
    );
    drop(watch);
    assert_eq!(r.address, a);
    assert!(!r.replayed);
    assert!(
        lost_generation(&mut c).await.is_empty(),
        "no lost claim left"
    );
    let after = device(&mut c, &a).await.expect("device");
    assert_eq!(
        (after.generation, after.state),
        (now.generation, now.state),
        "the device at the address now is untouched"
    );
    assert_eq!(after.owner, Some(owner(11)));
    // Its owner's release, once the VM is gone, goes through.
    std::fs::remove_dir_all(&holder).expect("holder exits");
    release(&mut c, &a, 11).await.expect("release");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_restore_keeps_the_claim_and_names_the_step() {
    let _alone = alone().await;
    let t = tree();
    let k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 300, 1 << 20).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 2).await;
    claim(&mut c, &a, 8, true).await.expect("claim --vfio");
    // The kernel stops answering: the unbind is written but never happens.
    drop(k);
    let before = device(&mut c, &a).await.expect("device");
    let e = release(&mut c, &a, 8)
        .await
        .expect_err("restore cannot finish");
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    let (why, meta) = reason(&e);
    assert_eq!(why, "HARDWARE_STEP_FAILED");
    assert_eq!(
        meta.get("step").map(String::as_str),
        Some("unbind vfio-pci"),
        "{meta:?}"
    );
    let after = device(&mut c, &a).await.expect("device");
    assert_eq!(after.owner, before.owner, "the claim stands");
    assert_eq!(after.state, proto::DeviceState::Claimed as i32);
    assert_eq!(
        after.vfio_binding, before.vfio_binding,
        "the binding is still recorded"
    );
    // Once the kernel answers again, the same release goes through.
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    // The pending unbind now happens, and its uevent gives the device a new generation:
    // a client re-reads and retries, as after any stale answer.
    let mut tries = 0;
    loop {
        match release(&mut c, &a, 8).await {
            Ok(_) => break,
            Err(e) if e.code() == Code::Aborted && tries < 50 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("release after the kernel answers: {e:?}"),
        }
    }
    let d = device(&mut c, &a).await.expect("device");
    assert_eq!(d.driver, "iavf");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vf_count_changes_are_fenced_and_refused_while_a_vf_is_claimed() {
    let _alone = alone().await;
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let pf = device(&mut c, PF).await.expect("PF");
    let listing = |l: &[proto::Device]| {
        l.iter()
            .map(|d| (d.address.clone(), d.generation, d.state))
            .collect::<Vec<_>>()
    };
    let all_before = until(&mut c, "listing", |_| true).await;

    let e = set_vfs(&mut c, 0, pf.generation + 100)
        .await
        .expect_err("stale");
    assert_eq!(e.code(), Code::Aborted);
    let e = set_vfs(&mut c, 9, pf.generation)
        .await
        .expect_err("more than total");
    assert_eq!(reason(&e).0, "HARDWARE_PRECONDITION", "{e:?}");
    let plain = device(&mut c, "0000:5e:00.0").await.expect("plain");
    let e = c
        .set_vf_count(proto::SetVfCountRequest {
            address: "0000:5e:00.0".into(),
            vf_count: 1,
            generation: plain.generation,
            drivers_autoprobe: None,
            ..Default::default()
        })
        .await
        .expect_err("not a PF");
    assert_eq!(reason(&e).0, "NOT_A_PHYSICAL_FUNCTION");
    assert_eq!(
        listing(&until(&mut c, "listing", |_| true).await),
        listing(&all_before),
        "refusals change nothing"
    );

    let a = vf(&mut c, 0).await;
    claim(&mut c, &a, 9, false).await.expect("claim");
    let pf = device(&mut c, PF).await.expect("PF");
    let e = set_vfs(&mut c, 0, pf.generation)
        .await
        .expect_err("a VF is claimed");
    assert_eq!(e.code(), Code::FailedPrecondition);
    let (why, meta) = reason(&e);
    assert_eq!(why, "VF_CLAIMED");
    assert_eq!(meta.get("claimed_vf"), Some(&a));
    let numvfs = std::fs::read_to_string(t.bus_link(PF).join("sriov_numvfs")).expect("numvfs");
    assert_eq!(numvfs.trim(), "4", "nothing was written");

    release(&mut c, &a, 9).await.expect("release");
    let pf = device(&mut c, PF).await.expect("PF");
    let r = set_vfs(&mut c, 0, pf.generation).await.expect("set 0");
    assert_eq!(r.previous_vf_count, 4);
    assert!(r.generation > pf.generation, "the PF moved on");
    let autoprobe =
        std::fs::read_to_string(t.bus_link(PF).join("sriov_drivers_autoprobe")).expect("autoprobe");
    assert_eq!(autoprobe.trim(), "0");
    // The VFs' remove uevents take them out of the ledger.
    until(&mut c, "VFs gone", |l| !l.iter().any(|d| d.physfn == PF)).await;
    let pf_now = device(&mut c, PF).await.expect("PF");
    assert_eq!(pf_now.sriov.expect("sriov").num_vfs, 0);
    let e = set_vfs(&mut c, 0, pf.generation)
        .await
        .expect_err("old generation");
    assert_eq!(e.code(), Code::Aborted);
    s.stop().await;
}

/// SetVfCount with the caller's consumer id and a request id: the change written in full
/// is logged (GetRequestOutcome: "vf_count_set"), and the same request again, whatever
/// generation it presents, is the first answer (the count before it, 4, where a change
/// made again would find 0) and changes nothing. The ids are refused for another count,
/// and a request id alone; without ids, the same retry is stale. (The stand-in kernel
/// carries out a count of 0 only.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vf_count_change_with_a_request_id_is_answered_once() {
    let _alone = alone().await;
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let numvfs = || {
        std::fs::read_to_string(t.bus_link(PF).join("sriov_numvfs"))
            .expect("numvfs")
            .trim()
            .to_string()
    };
    let g = device(&mut c, PF).await.expect("PF").generation;
    let req = |count: u32, generation: u64| proto::SetVfCountRequest {
        address: PF.into(),
        vf_count: count,
        generation,
        drivers_autoprobe: Some(false),
        consumer_id: owner(9).consumer_id,
        request_id: "vfs-1".into(),
    };

    let e = c
        .set_vf_count(proto::SetVfCountRequest {
            consumer_id: String::new(),
            ..req(0, g)
        })
        .await
        .expect_err("a request id without a consumer id");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(numvfs(), "4", "nothing was written");

    let first = c.set_vf_count(req(0, g)).await.expect("set 0").into_inner();
    assert!(!first.replayed);
    assert_eq!(first.previous_vf_count, 4);
    until(&mut c, "VFs gone", |l| !l.iter().any(|d| d.physfn == PF)).await;
    let o = c
        .get_request_outcome(proto::GetRequestOutcomeRequest {
            consumer_id: owner(9).consumer_id,
            request_id: "vfs-1".into(),
        })
        .await
        .expect("the change's outcome")
        .into_inner();
    assert_eq!(
        (o.operation.as_str(), o.address.as_str()),
        ("vf_count_set", PF)
    );
    assert!(
        o.generation > g && o.generation <= first.generation,
        "{o:?}"
    );

    // Without ids, the same retry is a stale generation.
    let e = c
        .set_vf_count(proto::SetVfCountRequest {
            consumer_id: String::new(),
            request_id: String::new(),
            ..req(0, g)
        })
        .await
        .expect_err("stale");
    assert_eq!(e.code(), Code::Aborted, "{e:?}");

    // With them, the retry is the first answer.
    let now = device(&mut c, PF).await.expect("PF").generation;
    let again = c
        .set_vf_count(req(0, g))
        .await
        .expect("the retry is the first answer")
        .into_inner();
    assert!(again.replayed);
    assert_eq!(
        (again.generation, again.previous_vf_count),
        (o.generation, 4)
    );
    assert_eq!(device(&mut c, PF).await.expect("PF").generation, now);

    // Another count under the same ids is another request: refused, nothing written.
    let e = c
        .set_vf_count(req(1, now))
        .await
        .expect_err("another count");
    assert_eq!(
        (e.code(), reason(&e).0.as_str()),
        (Code::InvalidArgument, "REQUEST_ID_REUSED")
    );
    assert_eq!(numvfs(), "0");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hotplug_removal_marks_a_claim_lost_and_an_overflow_rescans_everything() {
    let _alone = alone().await;
    let t = tree();
    // The smallest receive buffer the kernel allows, so a burst overflows it.
    let s = start(&t, 3000, 1).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 3).await;
    let b = vf(&mut c, 2).await;
    claim(&mut c, &a, 10, false).await.expect("claim");

    t.remove_device(&a);
    send_uevent("remove", &a);
    until(&mut c, "claimed VF lost", |l| {
        l.iter()
            .any(|d| d.address == a && d.state == proto::DeviceState::Lost as i32 && !d.present)
    })
    .await;
    let pf = device(&mut c, PF).await.expect("PF");
    assert!(
        !pf.sriov.expect("sriov").vfs.contains(&a),
        "the PF was rescanned with it"
    );

    // A free VF vanishes with no event, then a burst overflows the socket: the full
    // rescan that follows finds the silent removal too. A listener that keeps up with one
    // burst (the sender slowed by a busy machine) gets another, up to ten.
    t.remove_device(&b);
    let resyncs = |s: proto::AgentStatus| s.uevent_resyncs;
    let before = resyncs(
        c.get_status(proto::GetStatusRequest {})
            .await
            .expect("status")
            .into_inner(),
    );
    let mut bursts = 0;
    loop {
        for i in 0..3_000u32 {
            send_uevent("change", &format!("0000:fe:{:02x}.{}", (i / 8) % 32, i % 8));
        }
        bursts += 1;
        let seen = Instant::now() + Duration::from_secs(3);
        let overflowed = loop {
            let now = resyncs(
                c.get_status(proto::GetStatusRequest {})
                    .await
                    .expect("status")
                    .into_inner(),
            );
            if now > before || Instant::now() > seen {
                break now > before;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if overflowed {
            break;
        }
        assert!(
            bursts < 10,
            "10 bursts of 3,000 uevents never overflowed the socket"
        );
    }
    until(&mut c, "silently removed VF gone after the resync", |l| {
        !l.iter().any(|d| d.address == b)
    })
    .await;
    let st = c
        .get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert!(st.uevent_resyncs >= 1, "an overflow was seen: {st:?}");
    assert!(st.hotplug.expect("hotplug").detail.contains("full rescan"));
    s.stop().await;
}

/// A rescan that catches a claimed VF in the middle of its removal (its entry still on
/// the bus, its directory already gone) takes it for gone: lost, its claim kept. An
/// earlier version took it for a present device whose identity, PF and IOMMU group
/// could not be read, replaced what the ledger knew of it with those unknowns and gave
/// it a new generation. And a device whose odd attribute stays odd is read as it is,
/// each time: its other facts still follow the hardware.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_caught_mid_removal_is_gone_and_an_odd_file_that_stays_odd_is_read() {
    let _alone = alone().await;
    let t = tree();
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let (a, b) = (vf(&mut c, 1).await, vf(&mut c, 2).await);
    claim(&mut c, &a, 11, false).await.expect("claim");
    let claimed = device(&mut c, &a).await.expect("claimed VF");

    let dir = std::fs::canonicalize(t.bus_link(&a)).expect("VF directory");
    std::fs::remove_dir_all(&dir).expect("remove the directory, keep the bus link");
    send_uevent("change", &a);
    let l = until(&mut c, "the VF caught mid-removal lost", |l| {
        l.iter().any(|d| d.address == a && !d.present)
    })
    .await;
    let lost = l.iter().find(|d| d.address == a).expect("still listed");
    assert_eq!(lost.state, proto::DeviceState::Lost as i32, "{lost:?}");
    assert_eq!(lost.owner, claimed.owner, "the claim is kept");
    assert_eq!(
        (&lost.vendor_id, &lost.device_id, &lost.physfn),
        (&claimed.vendor_id, &claimed.device_id, &claimed.physfn),
        "what the ledger knew of it is kept"
    );

    // An odd NUMA node that stays odd, and a driver change read with it.
    let link = t.bus_link(&b);
    std::fs::write(link.join("numa_node"), "seven\n").expect("odd numa_node");
    let driver = std::fs::canonicalize(link.join("driver")).expect("driver");
    let other = driver.with_file_name("vfio-pci");
    std::fs::create_dir_all(&other).expect("driver directory");
    std::fs::remove_file(link.join("driver")).expect("unlink driver");
    std::os::unix::fs::symlink(&other, link.join("driver")).expect("link driver");
    send_uevent("change", &b);
    let l = until(&mut c, "the odd VF read again", |l| {
        l.iter().any(|d| d.address == b && d.driver == "vfio-pci")
    })
    .await;
    let odd = l.iter().find(|d| d.address == b).expect("listed");
    assert!(odd.present && odd.numa_node.is_none(), "{odd:?}");
    s.stop().await;
}

/// A VF count change that writes nothing changes nothing: the count asked for is the
/// count the PF has (and no autoprobe setting), or the kernel refuses the first write
/// (here `sriov_drivers_autoprobe` is missing, as before Linux 4.12). The PF keeps its
/// generation either way; an earlier version gave it a new one, so the caller's next
/// call with the generation it held was refused as stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vf_count_change_that_writes_nothing_keeps_the_pf_generation() {
    let _alone = alone().await;
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let pf = device(&mut c, PF).await.expect("PF");
    let vfs = pf.sriov.as_ref().expect("sriov").num_vfs;

    let same = c
        .set_vf_count(proto::SetVfCountRequest {
            address: PF.into(),
            vf_count: vfs,
            generation: pf.generation,
            drivers_autoprobe: None,
            ..Default::default()
        })
        .await
        .expect("the count it has")
        .into_inner();
    assert_eq!(same.generation, pf.generation, "{same:?}");
    assert_eq!(
        device(&mut c, PF).await.expect("PF").generation,
        pf.generation
    );

    t.remove_attr(PF, "sriov_drivers_autoprobe");
    let e = set_vfs(&mut c, 2, pf.generation)
        .await
        .expect_err("no sriov_drivers_autoprobe to write");
    assert_eq!(reason(&e).0, "HARDWARE_STEP_FAILED", "{e:?}");
    assert_eq!(
        reason(&e).1.get("step").map(String::as_str),
        Some("set sriov_drivers_autoprobe")
    );
    let after = device(&mut c, PF).await.expect("PF");
    assert_eq!(after.generation, pf.generation, "nothing was written");
    assert_eq!(after.sriov.expect("sriov").num_vfs, vfs);
    s.stop().await;
}

/// A claimed VF hot-removed and a function added back at its address before the agent
/// rescanned it (the remove's rescan found the new one there): the kernel said the
/// function was removed, so the claim is kept, lost, and the function there now is a new
/// device, free. An earlier version reduced events to addresses and, finding a device at
/// the address, kept the old claim on the new device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_seen_before_the_device_came_back_does_not_carry_its_claim_over() {
    let _alone = alone().await;
    let t = tree();
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 1).await;
    claim(&mut c, &a, 10, false).await.expect("claim");
    let claimed = device(&mut c, &a).await.expect("VF");

    // Removed and back before either event is read.
    t.remove_device(&a);
    t.replug_device(&a);
    send_uevent("remove", &a);
    send_uevent("add", &a);
    let l = until_lost_and_replaced(&mut c, &a).await;
    assert_eq!(l.iter().filter(|d| d.address == a).count(), 2, "{l:?}");
    let lost = l
        .iter()
        .find(|d| d.address == a && !d.present)
        .expect("lost record");
    assert_eq!(
        lost.owner, claimed.owner,
        "the claim is kept, on the lost record"
    );
    let new = l
        .iter()
        .find(|d| d.address == a && d.present)
        .expect("the new device");
    assert!(new.owner.is_none(), "the new device carries no claim");
    assert!(new.generation > claimed.generation);
    s.stop().await;
}

/// Shows `n` as the kernel's last uevent sequence number in the fake tree.
fn set_seqnum(t: &FakeTree, n: u64) {
    let seqnum = t.sysfs_root().join("kernel/uevent_seqnum");
    std::fs::create_dir_all(seqnum.parent().expect("kernel dir")).expect("mkdir");
    std::fs::write(&seqnum, format!("{n}\n")).expect("seqnum");
}

/// Waits until the claim at `a` is lost and a new, free device is present there.
async fn until_lost_and_replaced(c: &mut Client, a: &str) -> Vec<proto::Device> {
    until(c, "the claim lost and the new device free", |l| {
        let here: Vec<&proto::Device> = l.iter().filter(|d| d.address == a).collect();
        here.iter()
            .any(|d| !d.present && d.state == proto::DeviceState::Lost as i32)
            && here
                .iter()
                .any(|d| d.present && d.state == proto::DeviceState::Free as i32)
    })
    .await
}

/// The agent on `t` at uevent number 10, with VF 1 claimed by owner 10 and then removed
/// and made again in the tree (no event sent yet): the agent, a client and the VF.
async fn a_claimed_vf_removed_and_back(
    t: &FakeTree,
) -> (support::server::TestServer, Client, String) {
    set_seqnum(t, 10);
    let s = start(t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 1).await;
    claim(&mut c, &a, 10, false).await.expect("claim");
    t.remove_device(&a);
    t.replug_device(&a);
    (s, c, a)
}

/// Sends the removal (11) and the addition (12) of `a` late, then a PF event numbered
/// `barrier`: once its change shows, theirs were applied (events are taken in order,
/// those waiting together in one rescan). The listing then.
async fn late_removal_and_addition(
    t: &FakeTree,
    c: &mut Client,
    a: &str,
    barrier: u64,
) -> Vec<proto::Device> {
    send_uevent_numbered("remove", a, 11);
    send_uevent_numbered("add", a, 12);
    set_seqnum(t, barrier);
    t.write_attr(PF, "numa_node", b"0\n");
    send_uevent_numbered("change", PF, barrier);
    until(c, "the PF's second event handled", |l| {
        l.iter().any(|d| d.address == PF && d.numa_node == Some(0))
    })
    .await
}

/// The kernel numbers its uevents (`/sys/kernel/uevent_seqnum` is the last number sent),
/// and the agent reads that number before each scan. A removal numbered past the scan
/// that found the device at its address is that device's: the claim goes lost. One
/// numbered at or before it is stale (the kernel sends the removals of the VFs a count
/// change destroys while the change's own rescan already finds the new ones): the device
/// found and the claim made on it since stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_older_than_the_scan_that_found_the_device_is_not_its_own() {
    let _alone = alone().await;
    let t = tree();
    // Removed (11) and back (12), after the scan at 10: the claim goes lost.
    let (s, mut c, a) = a_claimed_vf_removed_and_back(&t).await;
    set_seqnum(&t, 12);
    send_uevent_numbered("remove", &a, 11);
    send_uevent_numbered("add", &a, 12);
    until_lost_and_replaced(&mut c, &a).await;
    // The new device, found by a scan at 12, is claimed; then a removal numbered 11
    // arrives again (late, or a duplicate): not this device's.
    claim(&mut c, &a, 11, false)
        .await
        .expect("claim the new device");
    let claimed = device(&mut c, &a).await.expect("the new device");
    send_uevent_numbered("remove", &a, 11);
    // A later event on another device shows the stale one was handled before it.
    let other = vf(&mut c, 2).await;
    t.write_attr(&other, "numa_node", b"1\n");
    send_uevent_numbered("change", &other, 13);
    until(&mut c, "the later event handled", |l| {
        l.iter()
            .any(|d| d.address == other && d.numa_node == Some(1))
    })
    .await;
    let now = device(&mut c, &a).await.expect("still present");
    assert_eq!(
        (now.generation, now.owner.clone(), now.present),
        (claimed.generation, Some(owner(11)), true),
        "a stale removal took the device found after it"
    );
    s.stop().await;
}

/// A scan that finds a device at a recorded address (here the PF's rescan, which takes
/// in its VFs) tells a new one from the recorded one by its directory's inode number:
/// the VF was removed and made again, so the claim goes lost and the new VF comes free
/// at once, before the removal and addition are read; those then change nothing more.
/// (Before the instance was read, such a rescan kept the record, and only the removal's
/// number, past the scan that made the record, said that the claimed device was gone.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_that_finds_another_instance_replaces_the_record_before_its_events() {
    let _alone = alone().await;
    let t = tree();
    // Removed (11) and back (12); a PF event (13) is read first, and its rescan finds
    // another VF at the address.
    let (s, mut c, a) = a_claimed_vf_removed_and_back(&t).await;
    set_seqnum(&t, 13);
    t.write_attr(PF, "numa_node", b"1\n");
    send_uevent_numbered("change", PF, 13);
    let seen = until_lost_and_replaced(&mut c, &a).await;
    assert!(
        seen.iter()
            .any(|d| d.address == PF && d.numa_node == Some(1)),
        "the PF's own rescan did it"
    );
    let here = |l: &[proto::Device]| -> Vec<(bool, u64, Option<proto::Owner>)> {
        l.iter()
            .filter(|d| d.address == a)
            .map(|d| (d.present, d.generation, d.owner.clone()))
            .collect()
    };
    let before = here(&seen);
    assert_eq!(before.len(), 2, "{seen:?}");
    let after = late_removal_and_addition(&t, &mut c, &a, 14).await;
    assert_eq!(here(&after), before, "the late events changed nothing");
    s.stop().await;
}

/// The same, with the removal numbered after the number the rescan read: the PF's rescan
/// reads the sequence number (10), then the VF made again after a removal (11) and an
/// addition (12) the kernel sends while it reads. The new VF is claimed at once; when the
/// two events arrive, the removal is of the old VF, whose directory was gone before it
/// was sent, not of the new one, which is still there: the new claim stands. Before,
/// the removal was taken for the new VF's (numbered past its scan), its claim was marked
/// lost and a free record made for the same VF, claimable by anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_sent_while_a_rescan_read_the_device_again_leaves_the_new_claim() {
    let _alone = alone().await;
    let t = tree();
    // Removed and back while a PF rescan reads at number 10.
    let (s, mut c, a) = a_claimed_vf_removed_and_back(&t).await;
    t.write_attr(PF, "numa_node", b"1\n");
    send_uevent_numbered("change", PF, 10);
    until_lost_and_replaced(&mut c, &a).await;
    let new = claim(&mut c, &a, 11, false)
        .await
        .expect("the new VF claimed");
    let mine = |l: &[proto::Device]| -> Vec<(bool, u64, Option<String>)> {
        let mut v: Vec<_> = l
            .iter()
            .filter(|d| d.address == a)
            .map(|d| {
                let who = d.owner.as_ref().map(|o| o.consumer_id.clone());
                (d.present, d.generation, who)
            })
            .collect();
        v.sort();
        v
    };
    let before = mine(&until(&mut c, "the claim listed", |_| true).await);
    assert!(
        before
            .iter()
            .any(|(present, g, _)| *present && *g == new.generation),
        "{before:?}"
    );
    set_seqnum(&t, 12);
    let after = late_removal_and_addition(&t, &mut c, &a, 13).await;
    assert_eq!(mine(&after), before, "the late events changed nothing");
    s.stop().await;
}

/// An acting audit frees a dead instance's VF that was bound to vfio-pci: its driver is
/// given back, and the answer comes once the agent has rescanned it, so the listing
/// right after shows the VF on its own driver again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audit_gives_a_bound_orphan_its_driver_back() {
    let _alone = alone().await;
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 1).await;
    claim(&mut c, &a, 7, true).await.expect("claim --vfio");
    assert_eq!(device(&mut c, &a).await.expect("VF").driver, "vfio-pci");
    let snapshot = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner()
        .host_generation;
    let r = c
        .reconcile(proto::ReconcileRequest {
            expected_consumer_ids: vec![],
            snapshot_generation: snapshot,
            act: true,
            request_id: "audit-1".into(),
        })
        .await
        .expect("acting audit")
        .into_inner();
    freed_with_its_driver_back(&mut c, &r, snapshot, &a).await;
    s.stop().await;
}

/// The acting audit `r` (after `snapshot`) freed `a` alone, its only orphan, and gave it
/// its driver back: on iavf, unowned, with no binding recorded.
async fn freed_with_its_driver_back(
    c: &mut Client,
    r: &proto::ReconcileResponse,
    snapshot: u64,
    a: &str,
) {
    let freed: Vec<(&str, bool)> = r
        .orphans
        .iter()
        .map(|o| {
            (
                o.device.as_ref().expect("device").address.as_str(),
                o.freed_generation > snapshot,
            )
        })
        .collect();
    assert_eq!(freed, vec![(a, true)], "{r:?}");
    let d = device(c, a).await.expect("VF");
    assert_eq!(
        (d.driver.as_str(), d.owner.clone()),
        ("iavf", None),
        "{d:?}"
    );
    assert!(d.vfio_binding.is_empty());
}

// ---- sysfs write faults -------------------------------------------------------------
//
// The kernel's own errors on sysfs writes, returned through a FUSE file planted in the
// tree (support::faultfs): each failure names the step and the errno, keeps the claim
// and its recorded binding, and leaves the device's other records unchanged.

/// Every device but the PF, with its generation.
async fn vf_generations(c: &mut Client) -> Vec<(String, u64)> {
    c.list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner()
        .devices
        .into_iter()
        .filter(|d| d.address != PF)
        .map(|d| (d.address, d.generation))
        .collect()
}

fn errno_of(s: &tonic::Status) -> String {
    reason(s).1.get("errno").cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sriov_numvfs_write_errors_are_reported_and_the_vfs_are_kept() {
    use nix::errno::Errno;
    let _alone = alone().await;
    let t = tree();
    let fs = support::faultfs::FaultFs::mount(&[("sriov_numvfs", "4\n")]);
    fs.plant(&t.bus_link(PF).join("sriov_numvfs"), "sriov_numvfs");
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let vfs_before = vf_generations(&mut c).await;
    for errno in [Errno::EBUSY, Errno::EIO, Errno::EINVAL] {
        fs.fail_writes("sriov_numvfs", Some(errno));
        let pf = device(&mut c, PF).await.expect("PF");
        let tries = fs.attempts("sriov_numvfs").len();
        let e = set_vfs(&mut c, 2, pf.generation)
            .await
            .expect_err("the kernel refused the write");
        assert_eq!(e.code(), Code::Internal, "{errno}: {e:?}");
        let (why, meta) = reason(&e);
        assert_eq!(why, "HARDWARE_STEP_FAILED", "{errno}");
        assert_eq!(errno_of(&e), errno.to_string(), "{errno}: {meta:?}");
        assert!(
            e.message().contains("sriov_numvfs")
                && e.message().contains(&format!("os error {}", errno as i32)),
            "the message names the file and the kernel's error: {}",
            e.message()
        );
        // Going from 4 to 2 writes 0 first: that first write failed, nothing followed.
        assert_eq!(fs.attempts("sriov_numvfs")[tries..], ["0".to_string()]);
        assert_eq!(fs.content("sriov_numvfs"), "4\n");
        // The PF takes a new generation (a refused write may still have changed the
        // hardware); every VF keeps its record and generation.
        let pf_after = device(&mut c, PF).await.expect("PF");
        assert!(pf_after.generation > pf.generation, "{errno}");
        assert_eq!(
            vf_generations(&mut c).await,
            vfs_before,
            "{errno}: the VFs were left alone"
        );
    }
}

/// A `sriov_numvfs` write waits for the VF count timeout, not the step timeout: the
/// kernel makes or removes every VF inside that one write, which takes tens of seconds
/// on some NICs. With a 300 ms step timeout, writes that take 800 ms each succeed under
/// a 10 s VF count timeout, and time out under a 300 ms one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sriov_numvfs_writes_wait_for_the_vf_count_timeout() {
    let _alone = alone().await;
    for (vf_count_timeout_ms, succeeds) in [(10_000, true), (300, false)] {
        let t = tree();
        let fs = support::faultfs::FaultFs::mount(&[("sriov_numvfs", "4\n")]);
        fs.plant(&t.bus_link(PF).join("sriov_numvfs"), "sriov_numvfs");
        fs.during_write("sriov_numvfs", || {
            std::thread::sleep(Duration::from_millis(800))
        });
        let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
        let s = start_tuned(&t, 300, 1 << 20, |cfg| {
            cfg.hardware.vf_count_timeout_ms = vf_count_timeout_ms;
        })
        .await;
        let mut c = s.client().await;
        let pf = device(&mut c, PF).await.expect("PF");
        let r = set_vfs(&mut c, 2, pf.generation).await;
        if succeeds {
            let r = r.expect("slow writes within the VF count timeout");
            assert_eq!(r.previous_vf_count, 4);
            assert_eq!(fs.attempts("sriov_numvfs"), ["0", "2"]);
        } else {
            let e = r.expect_err("past the VF count timeout");
            assert_eq!(reason(&e).0, "HARDWARE_STEP_TIMEOUT", "{e:?}");
        }
        s.stop().await;
    }
}

/// A switch for a fault-filesystem hook that waits while it is on, at most 20 s (long
/// past any bound the tests wait for): the kernel holding a device.
/// The fake host with the PF's `sriov_numvfs` on the fault filesystem, where a write
/// hangs (as the kernel's device lock keeps one) until the hold is released, and an
/// agent whose VF count writes give up after `vf_count_timeout_ms`, managing the PF as
/// well as its VFs when `manage_pf`.
async fn hung_vf_count_write(
    vf_count_timeout_ms: u64,
    manage_pf: bool,
) -> (
    FakeTree,
    support::faultfs::FaultFs,
    Hold,
    support::server::TestServer,
) {
    let t = tree();
    let fs = support::faultfs::FaultFs::mount(&[("sriov_numvfs", "4\n")]);
    fs.plant(&t.bus_link(PF).join("sriov_numvfs"), "sriov_numvfs");
    let hang = Hold::on();
    fs.during_write("sriov_numvfs", hang.hook());
    let s = start_tuned(&t, 300, 1 << 20, |cfg| {
        cfg.hardware.vf_count_timeout_ms = vf_count_timeout_ms;
        if manage_pf {
            cfg.devices = vec![hostdevd::config::DeviceSpec {
                address: Some("0000:3b:*.*".into()),
                ..Default::default()
            }];
        }
    })
    .await;
    (t, fs, hang, s)
}

#[derive(Clone)]
struct Hold(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Hold {
    fn on() -> Hold {
        Hold(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
            true,
        )))
    }

    fn is_on(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn release(&self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    fn hook(&self) -> impl Fn() + Send + 'static {
        let hold = self.clone();
        move || {
            let start = Instant::now();
            while hold.is_on() && start.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// A VF count change that outlives its timeout keeps the PF locked in the kernel, and a
/// read of its `sriov_numvfs` waits for it (here the fault filesystem answers nothing
/// while a write hangs, as the kernel's device lock does). The rescan after the failed
/// change gives that read up instead of waiting with the rescanners' turn held, and
/// keeps the PF and its VFs as the ledger has them rather than read mid-change: the
/// change is answered while its write still hangs, its VFs (which the kernel may be
/// destroying) and the PF itself stay out of reach (claims and another change are
/// refused while the write is in the kernel, not only until it timed out), and once the
/// kernel lets go they are read again, with no uevent to prompt it, and claimable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vf_count_change_left_running_does_not_hold_the_rescans() {
    let _alone = alone().await;
    let (_t, fs, hang, s) = hung_vf_count_write(300, true).await;
    let mut c = s.client().await;
    let v = vf(&mut c, 0).await;
    let pf = device(&mut c, PF).await.expect("PF");
    // Threads another test left to finish alone count here too.
    let before = sysfs_threads();
    let answered = tokio::time::timeout(Duration::from_secs(10), set_vfs(&mut c, 2, pf.generation))
        .await
        .expect("the change is answered while its write still hangs");
    let e = answered.expect_err("past the VF count timeout");
    assert_eq!(reason(&e).0, "HARDWARE_STEP_TIMEOUT", "{e:?}");
    assert!(hang.is_on(), "still hanging");
    // Read again every second meanwhile, the PF keeps one read waiting in the kernel,
    // not one a try (and the agent's hung write its own thread).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let waiting = sysfs_threads();
    assert!(
        waiting <= before + 2,
        "{waiting} sysfs threads after three tries ({before} before the change)"
    );
    // Reads are served meanwhile, and the VFs mid-change cannot be claimed.
    let during = device(&mut c, &v).await;
    assert!(!during.as_ref().is_some_and(|d| d.present), "{during:?}");
    let g = during.map_or(0, |d| d.generation);
    claim_as(&mut c, &v, 1, false, "mid-change", g)
        .await
        .map(|_| ())
        .expect_err("a VF of a PF mid-change");
    // The PF too, at its current generation (the failed change gave it a new one), and
    // a second change of its count, which would wait on the same lock in the kernel.
    let held = device(&mut c, PF).await.expect("PF");
    assert!(held.generation > pf.generation, "{held:?} after {pf:?}");
    let e = claim_as(&mut c, PF, 1, false, "pf-mid-change", held.generation)
        .await
        .map(|_| ())
        .expect_err("the PF while its write is in the kernel");
    assert_eq!(reason(&e).0, "VF_COUNT_CHANGING", "{e:?}");
    assert_eq!(
        reason(&e).1.get("changing_pf").map(String::as_str),
        Some(PF)
    );
    let e = set_vfs(&mut c, 1, held.generation)
        .await
        .map(|_| ())
        .expect_err("a second change while the first is in the kernel");
    assert_eq!(reason(&e).0, "VF_COUNT_CHANGING", "{e:?}");
    let unchanged = device(&mut c, PF).await.expect("PF");
    assert_eq!(
        unchanged.generation, held.generation,
        "refusals change nothing"
    );
    assert!(unchanged.owner.is_none(), "{unchanged:?}");
    hang.release();
    until(&mut c, "the VF read again once the PF answers", |l| {
        l.iter().any(|d| d.address == v && d.present)
    })
    .await;
    claim(&mut c, PF, 2, false)
        .await
        .expect("the PF claimable once the kernel answered");
    release(&mut c, PF, 2).await.expect("the PF released");
    claim(&mut c, &v, 1, false).await.expect("claimable again");
    assert_eq!(fs.attempts("sriov_numvfs"), ["0"]);
    s.stop().await;
}

/// An agent that starts while a VF count change runs on a PF (started by another tool:
/// the kernel holds the PF, and a read of its `sriov_numvfs` waits) becomes ready all the
/// same, with the PF and its VFs set aside rather than read mid-change; once the kernel
/// lets go they are read, with no uevent to prompt it, and claimable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_starting_while_a_pf_is_held_is_ready_and_reads_it_later() {
    let _alone = alone().await;
    let t = tree();
    let fs = support::faultfs::FaultFs::mount(&[("sriov_numvfs", "4\n")]);
    let hang = Hold::on();
    fs.during_read("sriov_numvfs", hang.hook());
    let v = virtfn(&t, 0);
    fs.plant(&t.bus_link(PF).join("sriov_numvfs"), "sriov_numvfs");
    let s = tokio::time::timeout(Duration::from_secs(10), start(&t, 300, 1 << 20))
        .await
        .expect("ready while the PF is held");
    let mut c = s.client().await;
    assert!(hang.is_on(), "still held");
    assert_eq!(
        device(&mut c, PF).await.map(|d| d.present),
        None,
        "the PF set aside"
    );
    assert_eq!(
        device(&mut c, &v).await.map(|d| d.present),
        None,
        "its VF too"
    );
    assert!(
        device(&mut c, "0000:5e:00.0")
            .await
            .is_some_and(|d| d.present),
        "the other devices read"
    );
    hang.release();
    until(&mut c, "the PF and its VFs read once it is let go", |l| {
        [PF, v.as_str()]
            .iter()
            .all(|a| l.iter().any(|d| d.address == *a && d.present))
    })
    .await;
    claim(&mut c, &v, 1, false).await.expect("claimable");
    s.stop().await;
}

/// A VF count change may keep the kernel busy for minutes (125 VFs on mlx5 take over
/// one), and it is written off the writer's thread: claims and releases of the host's
/// other devices are answered meanwhile, while a claim of one of the PF's VFs is refused
/// `VF_COUNT_CHANGING` (retryable) rather than left waiting. Before, the change ran on
/// the writer's thread and every write on the host waited for the kernel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_devices_are_claimed_and_released_while_a_vf_count_is_written() {
    const PF2: &str = "0000:af:00.0";
    let _alone = alone().await;
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 8, 4).driver(PF, "i40e");
    f.vf_driver(PF, "iavf").vf_iommu_groups(PF, 40);
    f.pf(PF2, 0x8086, 0x1572, 8, 2).driver(PF2, "i40e");
    f.vf_driver(PF2, "iavf").vf_iommu_groups(PF2, 60);
    let t = f.build();
    let fs = support::faultfs::FaultFs::mount(&[("sriov_numvfs", "4\n")]);
    fs.plant(&t.bus_link(PF).join("sriov_numvfs"), "sriov_numvfs");
    let hang = Hold::on();
    let writing = Hold(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
        false,
    )));
    let (hook, started) = (hang.hook(), writing.clone());
    fs.during_write("sriov_numvfs", move || {
        started.0.store(true, std::sync::atomic::Ordering::SeqCst);
        hook()
    });
    let s = start_tuned(&t, 300, 1 << 20, |cfg| {
        cfg.hardware.vf_count_timeout_ms = 30_000
    })
    .await;
    let mut c = s.client().await;
    let v = vf(&mut c, 0).await;
    let pf = device(&mut c, PF).await.expect("PF");
    let mut changer = s.client().await;
    let change = tokio::spawn(async move { set_vfs(&mut changer, 2, pf.generation).await });
    let start = Instant::now();
    while !writing.is_on() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the change never wrote"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let others = device(&mut c, PF2)
        .await
        .expect("PF2")
        .sriov
        .expect("sriov")
        .vfs;
    tokio::time::timeout(Duration::from_secs(5), async {
        claim(&mut c, &others[1], 1, false)
            .await
            .expect("claimed meanwhile");
        release(&mut c, &others[1], 1)
            .await
            .expect("released meanwhile");
    })
    .await
    .expect("answered while the VF count is written");
    let g = device(&mut c, &v).await.expect("VF").generation;
    let e = claim_as(&mut c, &v, 2, false, "vf-mid-change", g)
        .await
        .expect_err("a VF of the PF being changed");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    let (why, meta) = reason(&e);
    assert_eq!(why, "VF_COUNT_CHANGING", "{e:?}");
    assert_eq!(meta.get("changing_pf").map(String::as_str), Some(PF));
    assert!(!change.is_finished(), "the change still runs");
    hang.release();
    let r = change
        .await
        .expect("change task")
        .expect("the VF count change once the kernel lets go");
    assert_eq!(r.previous_vf_count, 4);
    assert_eq!(fs.attempts("sriov_numvfs"), ["0", "2"]);
    // The VF the claim was refused for is gone with the change.
    let after = device(&mut c, &v).await;
    assert!(after.as_ref().is_none_or(|d| d.generation > g), "{after:?}");
    s.stop().await;
}

/// A VF count change whose caller goes away while the kernel still works (the writer's
/// future dropped mid-write) is recorded all the same, as a write that may have
/// destroyed the VFs: they leave the ledger rather than turn claimable again while the
/// kernel destroys them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vf_count_change_dropped_mid_write_is_recorded_as_destroying_the_vfs() {
    let _alone = alone().await;
    let (_t, _fs, hang, s) = hung_vf_count_write(30_000, false).await;
    let mut c = s.client().await;
    let v = vf(&mut c, 0).await;
    let old = device(&mut c, &v).await.expect("VF").generation;
    let pf = device(&mut c, PF).await.expect("PF");
    let change = s.writer.set_vf_count(hostdevd::writer::SetVfCount {
        pf: PF.parse().expect("address"),
        generation: hostdevd::pci::Generation(pf.generation),
        count: 2,
        autoprobe: None,
        request: None,
    });
    tokio::time::timeout(Duration::from_secs(1), change)
        .await
        .expect_err("the write still hangs: the future is dropped mid-write");
    until(
        &mut c,
        "the change recorded once its future is dropped",
        |l| {
            !l.iter().any(|d| d.address == v)
                && l.iter()
                    .any(|d| d.address == PF && d.generation > pf.generation)
        },
    )
    .await;
    assert!(hang.is_on(), "recorded while the kernel still works");
    let e = claim_as(&mut c, &v, 1, false, "late", old)
        .await
        .expect_err("a VF the change may have destroyed");
    assert_eq!(reason(&e).0, "UNKNOWN_DEVICE", "{e:?}");
    hang.release();
    s.stop().await;
}

/// An acting audit that gives a bound orphan its driver back needs the rescans' turn,
/// which a rescan may hold for a while (a full one on a large host, or one that waits on
/// a PF the kernel holds). The audit waits for the turn without holding the free
/// checks' order, so a Release meanwhile is answered, not refused `FREE_CHECK_BUSY`
/// once the libvirt timeout passes (as it was when the audit waited holding the order);
/// the audit then frees its orphan once it has the turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_are_answered_while_an_acting_audit_waits_for_the_rescans_turn() {
    let _alone = alone().await;
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start_tuned(&t, 3000, 1 << 20, |cfg| cfg.libvirt.timeout_ms = 300).await;
    let mut c = s.client().await;
    let (bound, plain) = (vf(&mut c, 0).await, vf(&mut c, 1).await);
    claim(&mut c, &bound, 7, true).await.expect("claim --vfio");
    claim(&mut c, &plain, 8, false).await.expect("claim");
    let snapshot = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner()
        .host_generation;
    let rescan = s.rescanner.hold().await;
    let mut auditor = s.client().await;
    let audit = tokio::spawn(async move {
        auditor
            .reconcile(proto::ReconcileRequest {
                expected_consumer_ids: vec![owner(8).consumer_id],
                snapshot_generation: snapshot,
                act: true,
                request_id: "audit-behind-a-rescan".into(),
            })
            .await
    });
    // Long enough for the audit to reach the turn; a release waiting behind it would
    // be refused after the libvirt timeout (0.3 s).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!audit.is_finished(), "the audit waits for the rescan");
    let released = tokio::time::timeout(Duration::from_secs(10), release(&mut c, &plain, 8))
        .await
        .expect("answered while the audit waits");
    released.expect("released while the audit waits for the turn");
    assert!(!audit.is_finished(), "the audit still waits for the rescan");
    drop(rescan);
    let r = tokio::time::timeout(Duration::from_secs(10), audit)
        .await
        .expect("the audit ends once it has the turn")
        .expect("audit task")
        .expect("acting audit")
        .into_inner();
    freed_with_its_driver_back(&mut c, &r, snapshot, &bound).await;
    s.stop().await;
}

/// A release that gives drivers back waits for the rescans' turn (held here, as a VF count
/// change would hold it) before its checks, not between them and the action: a process
/// that opens the device's VFIO group while the release waits is found, and the release
/// refused, the device left on vfio-pci. Before, the checks ran first and went stale
/// while the release waited, and the driver was given back under the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_opened_while_a_release_waits_for_the_rescans_turn_blocks_it() {
    let _alone = alone().await;
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 0).await;
    claim(&mut c, &a, 7, true).await.expect("claim --vfio");
    let group = device(&mut c, &a).await.expect("device").vfio_group;
    assert!(!group.is_empty(), "the group node is known");
    let rescan = s.rescanner.hold().await;
    let mut releaser = s.client().await;
    let target = a.clone();
    let pending = tokio::spawn(async move { release(&mut releaser, &target, 7).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!pending.is_finished(), "the release waits for the turn");
    let _holder = plant_holder(&t, 4243, "vm-7", std::path::Path::new(&group));
    drop(rescan);
    let e = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("answered once the turn is free")
        .expect("release task")
        .expect_err("the group is held open");
    let (why, meta) = reason(&e);
    assert_eq!(
        (e.code(), why.as_str()),
        (Code::FailedPrecondition, "VFIO_GROUP_IN_USE")
    );
    assert_eq!(meta.get("holder_pid").map(String::as_str), Some("4243"));
    let d = device(&mut c, &a).await.expect("device");
    assert_eq!(d.driver, "vfio-pci");
    assert!(d.owner.is_some(), "still claimed");
    s.stop().await;
}

/// How many of this process's threads are the agent's sysfs reads and writes (their
/// names cut to the kernel's 15 bytes).
fn sysfs_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("hostdevd-sysfs-"))
        .count()
}

/// A VF's address from the tree itself (before any agent runs): its PF's `virtfn{i}`.
/// libvirt at `uri`, with no events and an hour between polls: the agent learns of a
/// domain only by listing afresh, waiting `timeout_ms` for an answer.
fn listing_only(cfg: &mut Config, uri: &str, timeout_ms: u64) {
    cfg.libvirt.enabled = true;
    cfg.libvirt.uri = uri.into();
    cfg.libvirt.events = false;
    cfg.libvirt.poll_interval_ms = 3_600_000;
    cfg.libvirt.timeout_ms = timeout_ms;
}

/// A PF with two VFs on iavf, in the IOMMU groups given (`None`: in none), and a device
/// on vfio-pci (so the driver is "loaded"): the tree and the two VFs' addresses.
fn two_vfs(first: Option<u32>, second: Option<u32>) -> (FakeTree, String, String) {
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 8, 2).driver(PF, "i40e");
    f.vf_driver(PF, "iavf");
    let vfs: Vec<String> = f.vfs(PF).iter().map(|a| a.to_string()).collect();
    for (vf, group) in vfs.iter().zip([first, second]) {
        if let Some(g) = group {
            f.iommu_group(vf, g);
        }
    }
    f.device("0000:5e:00.0", 0x10de, 0x1db6)
        .driver("0000:5e:00.0", "vfio-pci")
        .iommu_group("0000:5e:00.0", 90);
    (f.build(), vfs[0].clone(), vfs[1].clone())
}

fn virtfn(t: &FakeTree, i: u32) -> String {
    std::fs::canonicalize(t.bus_link(PF).join(format!("virtfn{i}")))
        .expect("virtfn")
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned()
}

/// A device vanishing between the check and the act: the VF is hot-removed while the
/// agent's first bind write is in the kernel, which then fails it with ENODEV. The
/// claim is kept and turns lost (never dropped), and its owner releases it with the lost
/// record's generation; nothing is written to a device that is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_vanishing_during_its_vfio_bind_turns_lost_and_is_released() {
    use nix::errno::Errno;
    let _alone = alone().await;
    let t = std::sync::Arc::new(tree());
    let a = virtfn(&t, 2);
    let fs = support::faultfs::FaultFs::mount(&[("driver_override", "(null)\n")]);
    fs.plant(&t.bus_link(&a).join("driver_override"), "driver_override");
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    {
        let (t, a) = (t.clone(), a.clone());
        fs.during_write("driver_override", move || {
            t.remove_device(&a);
            send_uevent("remove", &a);
        });
    }
    fs.fail_writes("driver_override", Some(Errno::ENODEV));
    let g = device(&mut c, &a).await.expect("VF").generation;
    let request_id = format!("claim-{a}-{g}");
    let e = claim_as(&mut c, &a, 11, true, &request_id, g)
        .await
        .expect_err("the device went away under the bind");
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    assert_eq!(
        reason(&e).1.get("step").map(String::as_str),
        Some("set driver_override")
    );
    assert_eq!(errno_of(&e), Errno::ENODEV.to_string());
    // The answer says the claim stands, though its device is gone, with the generation
    // its owner releases it with (the address is rescanned before the answer goes).
    let meta = reason(&e).1;
    assert_eq!(
        meta.get("claim_stands").map(String::as_str),
        Some("true"),
        "{e:?}"
    );
    let list = until(&mut c, "the claimed VF lost", |l| {
        l.iter()
            .any(|d| d.address == a && d.state == proto::DeviceState::Lost as i32 && !d.present)
    })
    .await;
    let lost = list.into_iter().find(|d| d.address == a).expect("lost VF");
    assert_eq!(lost.owner, Some(owner(11)), "the claim is kept");
    assert_eq!(
        meta.get("claim_generation").map(String::as_str),
        Some(lost.generation.to_string().as_str()),
        "the lost claim's generation"
    );
    // Asked later, the request's outcome names the claim's generation now, as for a
    // claim whose device is still there.
    let outcome = support::request_outcome(&mut c, owner(11).consumer_id, request_id).await;
    assert_eq!(
        (outcome.operation.as_str(), outcome.generation),
        ("claimed", lost.generation)
    );
    assert_eq!(
        lost.vfio_binding.len(),
        1,
        "with the binding it was recording"
    );
    let writes = fs.attempts("driver_override").len();
    c.release(proto::ReleaseRequest {
        address: a.clone(),
        owner: Some(owner(11)),
        request_id: "release-lost".into(),
        generation: lost.generation,
    })
    .await
    .expect("the owner releases the lost claim");
    assert_eq!(
        fs.attempts("driver_override").len(),
        writes,
        "nothing is restored on a device that is gone"
    );
    assert!(
        device(&mut c, &a).await.is_none_or(|d| d.owner.is_none()),
        "no claim remains"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_vfio_bind_keeps_the_claim_and_a_failed_restore_keeps_the_binding() {
    use nix::errno::Errno;
    let _alone = alone().await;
    let t = tree();
    let a = virtfn(&t, 0);
    let fs =
        support::faultfs::FaultFs::mount(&[("driver_override", "(null)\n"), ("vfio_unbind", "")]);
    fs.plant(&t.bus_link(&a).join("driver_override"), "driver_override");
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;

    // 1. The first bind step fails with EIO: the claim stands, with its binding recorded
    // (the original driver, so that a release restores it), and the device is untouched.
    fs.fail_writes("driver_override", Some(Errno::EIO));
    let e = claim(&mut c, &a, 7, true)
        .await
        .expect_err("driver_override refused");
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    assert_eq!(reason(&e).0, "HARDWARE_STEP_FAILED");
    assert_eq!(
        reason(&e).1.get("step").map(String::as_str),
        Some("set driver_override")
    );
    assert_eq!(errno_of(&e), Errno::EIO.to_string());
    let d = device(&mut c, &a).await.expect("device");
    assert_eq!(d.driver, "iavf", "nothing was unbound");
    assert_eq!(d.owner, Some(owner(7)), "the claim stands");
    assert_eq!(d.vfio_binding.len(), 1);
    assert_eq!(d.vfio_binding[0].original_driver, "iavf");

    // 2. With the fault gone, a release restores (nothing to undo but the override) and
    // frees the device.
    fs.fail_writes("driver_override", None);
    release(&mut c, &a, 7)
        .await
        .expect("release after a failed bind");
    let d = device(&mut c, &a).await.expect("device");
    assert!(d.owner.is_none(), "released");
    assert_eq!(d.driver, "iavf");
    assert!(
        fs.attempts("driver_override").contains(&"\n".to_string()),
        "the release cleared the override: {:?}",
        fs.attempts("driver_override")
    );
    // The stand-in kernel shows the cleared override as "(null)" a tick later (the
    // kernel does so at once); wait for it, so it cannot land on the next bind's write.
    let deadline = Instant::now() + Duration::from_secs(10);
    while fs.content("driver_override") != "(null)\n" {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            fs.content("driver_override")
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // 3. A bound VF whose restore fails with EINVAL at "unbind vfio-pci": the release is
    // refused, the claim, binding and generation stay, and the device stays on vfio-pci.
    claim(&mut c, &a, 8, true).await.expect("claim --vfio");
    let bound = device(&mut c, &a).await.expect("device");
    assert_eq!(bound.driver, "vfio-pci");
    fs.plant(
        &t.sysfs_root().join("bus/pci/drivers/vfio-pci/unbind"),
        "vfio_unbind",
    );
    fs.fail_writes("vfio_unbind", Some(Errno::EINVAL));
    let e = release(&mut c, &a, 8).await.expect_err("unbind refused");
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    assert_eq!(
        reason(&e).1.get("step").map(String::as_str),
        Some("unbind vfio-pci")
    );
    assert_eq!(errno_of(&e), Errno::EINVAL.to_string());
    assert_eq!(fs.attempts("vfio_unbind"), vec![a.clone()]);
    let d = device(&mut c, &a).await.expect("device");
    assert_eq!(
        d.generation, bound.generation,
        "a refused release changes nothing"
    );
    assert_eq!(d.driver, "vfio-pci");
    assert_eq!(d.vfio_binding, bound.vfio_binding);
    assert_eq!((d.owner, d.state), (bound.owner, bound.state));

    // 4. Once the kernel accepts the unbind, the same release goes through and the
    // original driver is back.
    fs.fail_writes("vfio_unbind", None);
    release(&mut c, &a, 8)
        .await
        .expect("release once the unbind works");
    let d = until(&mut c, "VF back on iavf", |l| {
        l.iter()
            .any(|d| d.address == a && d.driver == "iavf" && d.owner.is_none())
    })
    .await;
    assert!(d.iter().any(|d| d.address == a));
}

/// A claim with vfio whose first bind failed part way (the binding is recorded before the
/// sysfs writes), retried with the same request id once the fault is gone: the retry binds
/// what the first call could not, and every answer carries the claim's generation now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_vfio_claim_binds_what_the_first_call_could_not() {
    use nix::errno::Errno;
    let _alone = alone().await;
    let t = tree();
    let a = virtfn(&t, 2);
    let fs = support::faultfs::FaultFs::mount(&[("driver_override", "(null)\n")]);
    fs.plant(&t.bus_link(&a).join("driver_override"), "driver_override");
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let g = device(&mut c, &a).await.expect("device").generation;
    fs.fail_writes("driver_override", Some(Errno::EIO));
    let e = claim_as(&mut c, &a, 7, true, "boot", g)
        .await
        .expect_err("the bind fails");
    assert_eq!(reason(&e).0, "HARDWARE_STEP_FAILED");
    assert_eq!(device(&mut c, &a).await.expect("device").driver, "iavf");

    fs.fail_writes("driver_override", None);
    let retry = claim_as(&mut c, &a, 7, true, "boot", g)
        .await
        .expect("the retry binds");
    assert!(retry.replayed);
    let d = until(&mut c, "VF on vfio-pci", |l| {
        l.iter().any(|d| d.address == a && d.driver == "vfio-pci")
    })
    .await;
    let d = d.iter().find(|d| d.address == a).expect("device");
    assert_eq!(retry.generation, d.generation, "the generation now");
    assert_eq!(d.owner, Some(owner(7)));

    // Bound already: a further retry binds nothing and changes nothing.
    let again = claim_as(&mut c, &a, 7, true, "boot", g)
        .await
        .expect("retry once bound");
    assert!(again.replayed);
    assert_eq!(again.generation, d.generation);
    assert_eq!(
        device(&mut c, &a).await.expect("device").generation,
        d.generation,
        "nothing changed"
    );

    // Released since: a late retry is replayed as it was, and binds nothing.
    release(&mut c, &a, 7).await.expect("release");
    let freed = until(&mut c, "VF back on iavf", |l| {
        l.iter()
            .any(|d| d.address == a && d.driver == "iavf" && d.owner.is_none())
    })
    .await;
    let freed = freed
        .iter()
        .find(|d| d.address == a)
        .expect("device")
        .clone();
    let late = claim_as(&mut c, &a, 7, true, "boot", g)
        .await
        .expect("a late retry is replayed");
    assert!(late.replayed);
    let now = device(&mut c, &a).await.expect("device");
    assert_eq!((now.generation, now.owner), (freed.generation, None));
    s.stop().await;
}

/// A client that lost the answer to a Claim with `vfio` asks GetRequestOutcome: the log
/// holds the claim's first generation, but the binding recorded after it moved the claim
/// on. The outcome answers the claim's generation now, the one the Claim answered, so the
/// owner's release with it goes through (an earlier version answered the old one, and
/// the release was refused ABORTED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outcome_of_a_vfio_claim_is_the_generation_after_its_binding() {
    let _alone = alone().await;
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 2).await;
    let g = device(&mut c, &a).await.expect("device").generation;
    let claimed = claim_as(&mut c, &a, 7, true, "lost-answer", g)
        .await
        .expect("claim --vfio");
    let outcome =
        support::request_outcome(&mut c, owner(7).consumer_id, "lost-answer".into()).await;
    assert_eq!(
        (outcome.operation.as_str(), outcome.address.as_str()),
        ("claimed", a.as_str())
    );
    assert_eq!(
        outcome.generation, claimed.generation,
        "the claim's generation after its binding"
    );
    release_as(&mut c, &a, 7, "after-outcome", outcome.generation)
        .await
        .expect("a release with the outcome's generation");
    s.stop().await;
}

/// A release retried after memory forgot it, while the device is bound for its next
/// owner (so the release runs alone, where drivers are restored): it is answered from the
/// request log on disk, as any other retry, and frees nothing. (The service looks such a
/// retry up before the writer decides it; the writer's own look-up for a release run
/// alone is tested in src/writer/tests.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_release_of_a_device_bound_since_is_answered_from_disk() {
    let _alone = alone().await;
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start_tuned(&t, 3000, 1 << 20, |cfg| cfg.api.request_log_in_memory = 2).await;
    let mut c = s.client().await;
    let (a, other) = (vf(&mut c, 1).await, vf(&mut c, 3).await);
    let first = claim(&mut c, &a, 7, true).await.expect("claim --vfio");
    let freed = release_as(&mut c, &a, 7, "stop", first.generation)
        .await
        .expect("release");
    until(&mut c, "VF back on iavf", |l| {
        l.iter().any(|d| d.address == a && d.driver == "iavf")
    })
    .await;
    let next = claim(&mut c, &a, 8, true)
        .await
        .expect("the next owner binds it");
    // Pushes the release out of memory (2 entries kept).
    for _ in 0..3 {
        claim(&mut c, &other, 9, false).await.expect("churn claim");
        release(&mut c, &other, 9).await.expect("churn release");
    }

    let retried = release_as(&mut c, &a, 7, "stop", first.generation)
        .await
        .expect("the retry replays");
    assert!(retried.replayed);
    assert_eq!(retried.generation, freed.generation);
    let d = device(&mut c, &a).await.expect("device");
    assert_eq!(d.owner, Some(owner(8)), "still the next owner's");
    assert_eq!(d.generation, next.generation, "nothing changed");
    assert_eq!(d.driver, "vfio-pci");
    s.stop().await;
}

/// A binding moves every member of the IOMMU group to vfio-pci, so it is decided on the
/// domains listed afresh, as a free is: a domain that took the group's other VF since the
/// agent last listed (no event came; the poll is an hour away) is seen, the binding
/// refused, and that VF keeps its driver. Before, the binding went by the listing the
/// agent had (none at all after a start while libvirt was down) and took the VF from
/// under the domain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binding_lists_the_domains_afresh() {
    let _alone = alone().await;
    // Both VFs in one group (no ACS between them).
    let (t, claimed, other) = two_vfs(Some(41), Some(41));
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let lv = virt::connect::Connect::open(Some("test:///default"))
        .expect("libvirt's test driver (install libvirt)");
    // No events and an hour between polls: the agent learns of the domain only by
    // listing afresh.
    let s = start_tuned(&t, 3000, 1 << 20, |cfg| {
        listing_only(cfg, "test:///default", 3000)
    })
    .await;
    let mut c = s.client().await;
    let r = claim(&mut c, &claimed, 7, false).await.expect("claim");
    // A domain now runs with the other VF of the group.
    let (d, rest) = other.split_once(':').expect("domain");
    let (b, rest) = rest.split_once(':').expect("bus");
    let (sl, fun) = rest.split_once('.').expect("slot");
    let domain = lv
        .define_domain_xml(&format!(
            "<domain type='test'><name>vm-other</name><uuid>{}</uuid><memory>1048576</memory><os><type>hvm</type></os><devices><hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0x{d}' bus='0x{b}' slot='0x{sl}' function='0x{fun}'/></source></hostdev></devices></domain>",
            uuid::Uuid::from_u128(0x5e11).as_hyphenated()
        ))
        .expect("define");
    domain.create().expect("start");
    let e = c
        .prepare_vfio(proto::PrepareVfioRequest {
            address: claimed.clone(),
            owner: Some(owner(7)),
            generation: r.generation,
            request_id: "bind-1".into(),
        })
        .await
        .expect_err("the group's other VF is a domain's");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(reason(&e).0, "GROUP_MEMBER_IN_USE_BY_DOMAIN", "{e:?}");
    let now = device(&mut c, &other).await.expect("the other VF");
    assert_eq!(now.driver, "iavf", "the domain's VF keeps its driver");
    let mine = device(&mut c, &claimed).await.expect("the claimed VF");
    assert_eq!(
        (mine.driver.as_str(), mine.generation),
        ("iavf", r.generation),
        "a refused binding changes nothing"
    );
    domain.destroy().expect("destroy");
    domain.undefine().expect("undefine");
    s.stop().await;
}

/// A retry of a logged binding that moves nothing now (every member on vfio-pci) is
/// answered from the log while libvirt is down, as any retry is: the fresh listing a
/// binding needs is for one that moves devices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bindings_retry_is_answered_while_libvirt_is_down() {
    let _alone = alone().await;
    let mut lvd = support::libvirtd::Libvirtd::start();
    let uri = lvd.uri();
    let holder = virt::connect::Connect::open(Some(&uri)).expect("holder connection");
    let t = tree();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start_tuned(&t, 3000, 1 << 20, |cfg| listing_only(cfg, &uri, 1000)).await;
    let mut c = s.client().await;
    let a = vf(&mut c, 1).await;
    let r = claim(&mut c, &a, 7, false).await.expect("claim");
    let prepare = proto::PrepareVfioRequest {
        address: a.clone(),
        owner: Some(owner(7)),
        generation: r.generation,
        request_id: "bind-once".into(),
    };
    let first = c
        .prepare_vfio(prepare.clone())
        .await
        .expect("bound")
        .into_inner();
    assert!(!first.replayed);
    drop(holder);
    lvd.kill();
    let again = c
        .prepare_vfio(prepare.clone())
        .await
        .expect("the retry is answered from the log")
        .into_inner();
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.generation, first.generation);
    // The device leaves vfio-pci and the agent has not seen it yet (no uevent, so no
    // rescan): the retry would move it again, which needs the listing libvirt cannot
    // give now. Refused, and nothing bound.
    std::fs::remove_file(t.bus_link(&a).join("driver")).expect("unbound behind the agent");
    let e = c
        .prepare_vfio(prepare.clone())
        .await
        .expect_err("a retry that would bind again needs libvirt");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(reason(&e).0, "LIBVIRT_UNREACHABLE");
    assert!(
        !t.bus_link(&a).join("driver").exists(),
        "nothing was bound without a listing"
    );
    // A new binding still needs libvirt.
    let b = vf(&mut c, 2).await;
    let r = claim(&mut c, &b, 7, false).await.expect("claim");
    let e = c
        .prepare_vfio(proto::PrepareVfioRequest {
            address: b.clone(),
            owner: Some(owner(7)),
            generation: r.generation,
            request_id: "bind-new".into(),
        })
        .await
        .expect_err("libvirt is down");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(reason(&e).0, "LIBVIRT_UNREACHABLE");
    s.stop().await;
}

/// A root port without ACS shares the IOMMU group of the device behind it: binding the
/// device leaves the port on pcieport (vfio-pci binds no bridge, and taking the port from
/// its driver ends its hotplug and error handling), and the binding covers the device
/// alone. Before, the port came first in the binding, was unbound from pcieport, and
/// the kernel's refusal of vfio-pci stopped the binding there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_in_the_group_keeps_its_driver() {
    let _alone = alone().await;
    let (port, dev) = ("0000:00:01.0", "0000:01:00.0");
    let mut f = FakeSys::new();
    f.bridge(port, 0x8086, 0x1901)
        .iommu_group(port, 41)
        .device(dev, 0x144d, 0xa808)
        .behind(dev, port)
        .driver(dev, "nvme")
        .iommu_group(dev, 41);
    f.device("0000:5e:00.0", 0x10de, 0x1db6)
        .driver("0000:5e:00.0", "vfio-pci")
        .iommu_group("0000:5e:00.0", 90);
    let t = f.build();
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start_tuned(&t, 3000, 1 << 20, |cfg| {
        cfg.devices = vec![hostdevd::config::DeviceSpec {
            address: Some(dev.into()),
            ..Default::default()
        }];
    })
    .await;
    let mut c = s.client().await;
    let r = claim(&mut c, dev, 7, true).await.expect("claim --vfio");
    let d = device(&mut c, dev).await.expect("device");
    assert_eq!(d.driver, "vfio-pci");
    assert_eq!(d.generation, r.generation);
    let members: Vec<&str> = d.vfio_binding.iter().map(|m| m.address.as_str()).collect();
    assert_eq!(members, vec![dev], "the binding covers the device alone");
    let p = device(&mut c, port).await.expect("port");
    assert_eq!(p.driver, "pcieport", "the port keeps its driver");
    let override_now =
        std::fs::read_to_string(t.bus_link(port).join("driver_override")).expect("override");
    assert_eq!(override_now.trim(), "(null)");
    // The release gives the device its driver back and leaves the port as it is.
    release(&mut c, dev, 7).await.expect("release");
    until(&mut c, "the device back on nvme", |l| {
        l.iter().any(|d| d.address == dev && d.driver == "nvme")
    })
    .await;
    assert_eq!(device(&mut c, port).await.expect("port").driver, "pcieport");
    s.stop().await;
}

/// A release that gives a binding's drivers back and fails part way (here the second
/// member's `driver_override` write fails) binds the members it had given back to
/// vfio-pci again: the claim stands with its binding recorded, as the answer says, and
/// the hardware agrees. Before, the first member was left on its own driver under a
/// claim that said it was bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_fails_part_way_binds_back_what_it_gave_back() {
    use nix::errno::Errno;
    let _alone = alone().await;
    let (t, first, second) = two_vfs(Some(41), Some(41));
    let fs = support::faultfs::FaultFs::mount(&[("driver_override", "(null)\n")]);
    fs.plant(
        &t.bus_link(&second).join("driver_override"),
        "driver_override",
    );
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    claim(&mut c, &first, 7, true).await.expect("claim --vfio");
    until(&mut c, "both VFs on vfio-pci", |l| {
        l.iter()
            .filter(|d| (d.address == first || d.address == second) && d.driver == "vfio-pci")
            .count()
            == 2
    })
    .await;
    let bound = device(&mut c, &first).await.expect("device");
    fs.fail_writes("driver_override", Some(Errno::EIO));
    let e = release(&mut c, &first, 7)
        .await
        .expect_err("the second member's driver cannot be given back");
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    fs.fail_writes("driver_override", None);
    let d = device(&mut c, &first).await.expect("device");
    assert_eq!(
        (d.state, d.generation, d.vfio_binding.len()),
        (proto::DeviceState::Claimed as i32, bound.generation, 2),
        "the claim stands with its binding"
    );
    for (member, which) in [
        (&first, "the first member"),
        (&second, "the failing member"),
    ] {
        let driver = std::fs::read_link(t.bus_link(member).join("driver")).expect("a driver");
        assert!(
            driver.ends_with("vfio-pci"),
            "{which} is bound again: {driver:?}"
        );
    }
    // With the cause gone, the release goes through and gives both back.
    release(&mut c, &first, 7).await.expect("release");
    until(&mut c, "both VFs back on iavf", |l| {
        l.iter()
            .filter(|d| (d.address == first || d.address == second) && d.driver == "iavf")
            .count()
            == 2
    })
    .await;
    s.stop().await;
}

/// A Claim with `vfio` whose claim is committed but whose binding fails says that the
/// claim stands, with its generation now, whatever stopped the binding: a device with no
/// IOMMU group (FAILED_PRECONDITION), or a sysfs write the kernel refused after the
/// binding was recorded (INTERNAL, the generation moved on). The owner can release it
/// with that generation, or send the same request again to bind once the cause is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_binding_fails_says_the_claim_stands() {
    use nix::errno::Errno;
    let _alone = alone().await;
    // The second VF has a group; the first has none.
    let (t, ungrouped, grouped) = two_vfs(None, Some(41));
    let fs = support::faultfs::FaultFs::mount(&[("driver_override", "(null)\n")]);
    fs.plant(
        &t.bus_link(&grouped).join("driver_override"),
        "driver_override",
    );
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;

    let stands = |e: &tonic::Status, a: &str| -> u64 {
        let (_, meta) = reason(e);
        assert_eq!(
            meta.get("claim_stands").map(String::as_str),
            Some("true"),
            "{e:?}"
        );
        assert_eq!(meta.get("claimed_address").map(String::as_str), Some(a));
        assert!(e.message().contains("the claim stands"), "{}", e.message());
        meta["claim_generation"].parse().expect("claim_generation")
    };

    // No IOMMU group: refused as a precondition, the claim kept.
    let g = device(&mut c, &ungrouped).await.expect("VF").generation;
    let e = claim_as(&mut c, &ungrouped, 7, true, "no-group", g)
        .await
        .expect_err("no IOMMU group to bind");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(reason(&e).0, "NO_IOMMU_GROUP");
    let claimed = stands(&e, &ungrouped);
    let d = device(&mut c, &ungrouped).await.expect("VF");
    assert_eq!(
        (d.state, d.generation, d.owner),
        (proto::DeviceState::Claimed as i32, claimed, Some(owner(7)))
    );
    // The same request again answers the same way, and claims nothing more.
    let again = claim_as(&mut c, &ungrouped, 7, true, "no-group", g)
        .await
        .expect_err("still no group");
    assert_eq!(stands(&again, &ungrouped), claimed);
    release_as(&mut c, &ungrouped, 7, "no-group-release", claimed)
        .await
        .expect("released with the generation the error gave");

    // A sysfs write refused after the binding was recorded: the generation moved on.
    fs.fail_writes("driver_override", Some(Errno::EIO));
    let g = device(&mut c, &grouped).await.expect("VF").generation;
    let e = claim_as(&mut c, &grouped, 8, true, "eio", g)
        .await
        .expect_err("the kernel refused the override");
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    assert_eq!(reason(&e).0, "HARDWARE_STEP_FAILED");
    let now = stands(&e, &grouped);
    assert!(now > g, "claimed and the binding recorded: {now} > {g}");
    assert_eq!(device(&mut c, &grouped).await.expect("VF").generation, now);
    // With the cause gone, the same request binds.
    fs.fail_writes("driver_override", None);
    let r = claim_as(&mut c, &grouped, 8, true, "eio", g)
        .await
        .expect("bound on the retry");
    assert!(r.replayed);
    until(&mut c, "the VF on vfio-pci", |l| {
        l.iter()
            .any(|d| d.address == grouped && d.driver == "vfio-pci")
    })
    .await;
    s.stop().await;
}

/// PrepareVfio on a claimed device: refused before anything is recorded when vfio-pci is
/// not loaded (the generation stays), and, when a sysfs step fails after the binding was
/// recorded, the answer carries the claim's new generation (an earlier version recorded
/// the binding first in both cases and answered as if nothing had changed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_vfio_failures_say_what_changed() {
    use nix::errno::Errno;
    let _alone = alone().await;
    let t = tree();
    let a = virtfn(&t, 0);
    let fs = support::faultfs::FaultFs::mount(&[("driver_override", "(null)\n")]);
    fs.plant(&t.bus_link(&a).join("driver_override"), "driver_override");
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    claim(&mut c, &a, 7, false).await.expect("claim");
    let prepare = |generation: u64| proto::PrepareVfioRequest {
        address: a.clone(),
        owner: Some(owner(7)),
        generation,
        request_id: String::new(),
    };

    // vfio-pci not loaded (its driver directory gone): nothing recorded.
    let drivers = t.sysfs_root().join("bus/pci/drivers");
    std::fs::rename(drivers.join("vfio-pci"), drivers.join("vfio-pci.away")).expect("unload");
    let before = device(&mut c, &a).await.expect("VF");
    let e = c
        .prepare_vfio(prepare(before.generation))
        .await
        .expect_err("vfio-pci is not loaded");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(reason(&e).0, "DRIVER_NOT_LOADED");
    let d = device(&mut c, &a).await.expect("VF");
    assert_eq!(d.generation, before.generation, "a refusal changes nothing");
    assert!(d.vfio_binding.is_empty(), "{:?}", d.vfio_binding);
    std::fs::rename(drivers.join("vfio-pci.away"), drivers.join("vfio-pci")).expect("load");

    // A sysfs write refused after the binding was recorded: the claim's generation now.
    fs.fail_writes("driver_override", Some(Errno::EIO));
    let e = c
        .prepare_vfio(prepare(before.generation))
        .await
        .expect_err("the kernel refused the override");
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    let (why, meta) = reason(&e);
    assert_eq!(why, "HARDWARE_STEP_FAILED");
    assert_eq!(meta.get("claim_stands").map(String::as_str), Some("true"));
    let now: u64 = meta["claim_generation"].parse().expect("claim_generation");
    assert!(now > before.generation, "{now} > {}", before.generation);
    let d = device(&mut c, &a).await.expect("VF");
    assert_eq!((d.generation, d.vfio_binding.len()), (now, 1));
    assert!(e.message().contains("PrepareVfio again"), "{}", e.message());
    // With the cause gone, PrepareVfio with that generation finishes the binding.
    fs.fail_writes("driver_override", None);
    c.prepare_vfio(prepare(now))
        .await
        .expect("bound with the generation the error gave");
    until(&mut c, "the VF on vfio-pci", |l| {
        l.iter().any(|d| d.address == a && d.driver == "vfio-pci")
    })
    .await;
    s.stop().await;
}

/// PrepareVfio with a request id is answered once: the binding is logged under it
/// (GetRequestOutcome: "bound"); a retry of a binding whose sysfs step failed after it
/// was recorded binds again, and one after a lost answer is the first answer, whatever
/// generation either presents; once the claim has ended, a retry binds nothing. The id
/// is the binding's: a binding at another address or a release with it is refused.
/// Without an id, the same retry presents a generation the first call moved on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_vfio_with_a_request_id_is_answered_once() {
    use nix::errno::Errno;
    let _alone = alone().await;
    let t = tree();
    let a = virtfn(&t, 0);
    let b = virtfn(&t, 1);
    let fs = support::faultfs::FaultFs::mount(&[("driver_override", "(null)\n")]);
    fs.plant(&t.bus_link(&a).join("driver_override"), "driver_override");
    let _k = FakeKernel::start(t.sysfs_root(), t.dev_root());
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    claim(&mut c, &a, 7, false).await.expect("claim");
    claim(&mut c, &b, 7, false)
        .await
        .expect("claim the other VF");
    let prepare = |address: &str, generation: u64, request_id: &str| proto::PrepareVfioRequest {
        address: address.into(),
        owner: Some(owner(7)),
        generation,
        request_id: request_id.into(),
    };
    let outcome = |c: &mut Client| {
        let mut c = c.clone();
        async move {
            c.get_request_outcome(proto::GetRequestOutcomeRequest {
                consumer_id: owner(7).consumer_id,
                request_id: "bind-1".into(),
            })
            .await
            .expect("the binding's outcome")
            .into_inner()
        }
    };
    let first = device(&mut c, &a).await.expect("VF").generation;
    let e = c
        .prepare_vfio(prepare(&a, first, &"r".repeat(129)))
        .await
        .expect_err("a request id over 128 bytes");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(device(&mut c, &a).await.expect("VF").generation, first);

    // The binding is recorded and logged, then the kernel refuses the override.
    fs.fail_writes("driver_override", Some(Errno::EIO));
    let e = c
        .prepare_vfio(prepare(&a, first, "bind-1"))
        .await
        .expect_err("the kernel refused the override");
    let (why, meta) = reason(&e);
    assert_eq!(why, "HARDWARE_STEP_FAILED", "{e:?}");
    let recorded: u64 = meta["claim_generation"].parse().expect("claim_generation");
    let o = outcome(&mut c).await;
    assert_eq!(
        (o.operation.as_str(), o.address.as_str(), o.generation),
        ("bound", a.as_str(), recorded)
    );

    // The same request again, with the generation it first presented: bound this time.
    fs.fail_writes("driver_override", None);
    let r = c
        .prepare_vfio(prepare(&a, first, "bind-1"))
        .await
        .expect("the retry binds")
        .into_inner();
    assert!(r.replayed);
    assert_eq!(r.members.len(), 1, "{:?}", r.members);
    let d = device(&mut c, &a).await.expect("VF");
    assert_eq!(
        (d.driver.as_str(), d.generation),
        ("vfio-pci", r.generation)
    );
    assert!(r.generation > recorded, "bound again at a new generation");
    assert_eq!(
        outcome(&mut c).await.generation,
        r.generation,
        "the claim's now"
    );

    // A lost answer: the retry is the same answer, and changes nothing.
    let again = c
        .prepare_vfio(prepare(&a, first, "bind-1"))
        .await
        .expect("replayed")
        .into_inner();
    assert!(again.replayed);
    assert_eq!(
        (again.generation, &again.members),
        (r.generation, &r.members)
    );
    assert_eq!(
        device(&mut c, &a).await.expect("VF").generation,
        r.generation
    );
    // Without a request id, that retry is a stale generation.
    let e = c
        .prepare_vfio(prepare(&a, first, ""))
        .await
        .expect_err("stale");
    assert_eq!(
        (e.code(), reason(&e).0.as_str()),
        (Code::Aborted, "STALE_GENERATION")
    );

    // The id is the binding's: not for another address, nor for a release.
    let gb = device(&mut c, &b).await.expect("VF").generation;
    let e = c
        .prepare_vfio(prepare(&b, gb, "bind-1"))
        .await
        .expect_err("another address");
    assert_eq!(
        (e.code(), reason(&e).0.as_str()),
        (Code::InvalidArgument, "REQUEST_ID_REUSED")
    );
    let e = release_as(&mut c, &a, 7, "bind-1", r.generation)
        .await
        .expect_err("a release");
    assert_eq!(reason(&e).0, "REQUEST_ID_REUSED");
    assert_eq!(device(&mut c, &b).await.expect("VF").generation, gb);
    assert_eq!(
        device(&mut c, &a).await.expect("VF").generation,
        r.generation
    );

    // Released since: a retry binds nothing and answers the logged generation.
    release(&mut c, &a, 7).await.expect("release");
    let freed = device(&mut c, &a).await.expect("VF");
    assert_eq!(freed.driver, "iavf");
    let logged = outcome(&mut c).await.generation;
    let late = c
        .prepare_vfio(prepare(&a, first, "bind-1"))
        .await
        .expect("replayed after the release")
        .into_inner();
    assert!(late.replayed && late.members.is_empty(), "{late:?}");
    assert_eq!(late.generation, logged);
    let d = device(&mut c, &a).await.expect("VF");
    assert_eq!(
        (d.driver.as_str(), d.generation),
        ("iavf", freed.generation)
    );
    s.stop().await;
}

/// A PCI function's network interface renamed after its own events were read (udev
/// renaming eth0 to ens1f0) reaches the inventory through the interface's `move` uevent:
/// the function is rescanned, so its netdev names (which device specs match on) are not
/// left stale until some later PCI event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interface_renamed_by_udev_is_seen_without_a_pci_event() {
    let _alone = alone().await;
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 8, 2)
        .driver(PF, "i40e")
        .netdev(PF, "eth0");
    let t = f.build();
    let s = start(&t, 3000, 1 << 20).await;
    let mut c = s.client().await;
    assert_eq!(device(&mut c, PF).await.expect("PF").netdevs, ["eth0"]);
    let net = t.device_dir(PF).join("net");
    std::fs::rename(net.join("eth0"), net.join("ens1f0")).expect("rename");
    send_rename_uevent(PF, "eth0", "ens1f0");
    until(&mut c, "the new interface name", |l| {
        l.iter().any(|d| d.address == PF && d.netdevs == ["ens1f0"])
    })
    .await;
    s.stop().await;
}
