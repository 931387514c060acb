//! Ownership tied to libvirt domains and VFIO holders, against real libvirt (its
//! in-process `test:///` driver) and a fake proc tree: attach and detach, strays, the
//! fresh query before a free, libvirt unreachable, a real libvirtd killed and restarted
//! under the agent, VFIO holders, and the real daemon binary over a
//! `test:///PATH/host.xml` host file.
//!
//! The test driver's `test:///default` state is shared by every connection in this
//! process, so each test uses its own PCI bus and its own domain names.

mod support;

use std::collections::HashMap;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::{Duration, Instant};

use hostdevd::api::proto::{self};
use hostdevd::client::Client;
use hostdevd::config::Config;
use hostdevd::simhost::{FakeSys, FakeTree};
use tonic::Code;
use tonic_types::StatusExt;
use virt::connect::Connect;

const INSTALL: &str = "apt-get install libvirt0 libvirt-dev";

/// A connection to the in-process test driver, or a loud failure naming the packages.
fn test_driver() -> Connect {
    Connect::open(Some("test:///default")).unwrap_or_else(|e| {
        panic!("libvirt's test driver cannot be opened ({e}); install libvirt: {INSTALL}")
    })
}

struct Host {
    tree: FakeTree,
    vfs: Vec<String>,
    pf: String,
}

impl Host {
    /// The host `f` describes, with PF `pf` and its VFs.
    fn built(f: &FakeSys, pf: &str) -> Host {
        Host {
            tree: f.build(),
            vfs: f.vfs(pf).iter().map(|a| a.to_string()).collect(),
            pf: pf.into(),
        }
    }
}

/// A PF on `bus` with 4 VFs (own IOMMU groups from `group`); VF0 is bound to vfio-pci
/// and has its group node.
fn host(bus: u8, group: u32) -> Host {
    let pf = format!("0000:{bus:02x}:00.0");
    let mut f = FakeSys::new();
    f.pf(&pf, 0x8086, 0x1572, 64, 4)
        .driver(&pf, "i40e")
        .netdev(&pf, &format!("ens{bus}f0"))
        .iommu_group(&pf, group - 1)
        .vf_iommu_groups(&pf, group)
        .vf_driver(&pf, "iavf");
    let vfs: Vec<String> = f.vfs(&pf).iter().map(|a| a.to_string()).collect();
    f.driver(&vfs[0], "vfio-pci");
    let tree = f.build();
    tree.vfio_node(group);
    Host { tree, vfs, pf }
}

/// An mlx5 PF at `pf` in IOMMU group `group` with 4 VFs in the groups after it, every
/// function on mlx5_core: the host and its VFs' addresses.
fn mlx5(pf: &str, group: u32) -> (FakeSys, Vec<String>) {
    let mut f = FakeSys::new();
    f.pf(pf, 0x15b3, 0x101d, 64, 4)
        .driver(pf, "mlx5_core")
        .iommu_group(pf, group)
        .vf_iommu_groups(pf, group + 1)
        .vf_driver(pf, "mlx5_core");
    let vfs = f.vfs(pf).iter().map(|a| a.to_string()).collect();
    (f, vfs)
}

/// An i40e PF at `pf` in IOMMU group `group` with `n` VFs in the groups after it, every
/// VF on vfio-pci: the host and its VFs' addresses.
fn vfio_pci_vfs(pf: &str, n: u32, group: u32) -> (FakeSys, Vec<String>) {
    let mut f = FakeSys::new();
    f.pf(pf, 0x8086, 0x1572, 64, n)
        .driver(pf, "i40e")
        .iommu_group(pf, group)
        .vf_iommu_groups(pf, group + 1);
    let vfs: Vec<String> = f.vfs(pf).iter().map(|a| a.to_string()).collect();
    for vf in &vfs {
        f.driver(vf, "vfio-pci");
    }
    (f, vfs)
}

type Server = support::server::TestServer;

async fn start(h: &Host, proc_root: &Path, libvirt: &str, poll_ms: u64) -> Server {
    start_with(h, proc_root, libvirt, poll_ms, |_| {}).await
}

/// [`start`], with `tweak` applied to the config last.
async fn start_with(
    h: &Host,
    proc_root: &Path,
    libvirt: &str,
    poll_ms: u64,
    tweak: impl FnOnce(&mut Config),
) -> Server {
    let mut cfg = Config::parse("[[devices]]\naddress = \"*:*:*.*\"\n").expect("config");
    cfg.sysfs_root = h.tree.sysfs_root().to_path_buf();
    cfg.dev_root = h.tree.dev_root().to_path_buf();
    cfg.proc_root = proc_root.to_path_buf();
    if libvirt.is_empty() {
        cfg.libvirt.enabled = false;
    } else {
        cfg.libvirt.uri = libvirt.into();
    }
    cfg.libvirt.poll_interval_ms = poll_ms;
    cfg.libvirt.timeout_ms = 3000;
    tweak(&mut cfg);
    Server::start(cfg, 0o600, vec![nix::unistd::getuid().as_raw()], None).await
}

fn uuid(n: u128) -> String {
    uuid::Uuid::from_u128(n).to_string()
}

fn owner(n: u128) -> proto::Owner {
    proto::Owner {
        consumer_id: uuid(n),
        label: format!("instance-{n:08x}"),
    }
}

/// Test-driver domain XML referencing `hostdevs` as `<hostdev>` and `ifaces` as
/// `<interface type='hostdev'>`.
fn domain_xml(name: &str, id: u128, hostdevs: &[&str], ifaces: &[&str]) -> String {
    let addr = |a: &str, ty: &str| {
        let (d, rest) = a.split_once(':').expect("domain");
        let (b, rest) = rest.split_once(':').expect("bus");
        let (s, f) = rest.split_once('.').expect("slot");
        format!("<address {ty}domain='0x{d}' bus='0x{b}' slot='0x{s}' function='0x{f}'/>")
    };
    let mut devs = String::new();
    for a in hostdevs {
        devs += &format!(
            "<hostdev mode='subsystem' type='pci' managed='yes'><source>{}</source></hostdev>",
            addr(a, "")
        );
    }
    for a in ifaces {
        devs += &format!(
            "<interface type='hostdev' managed='yes'><source>{}</source></interface>",
            addr(a, "type='pci' ")
        );
    }
    format!(
        "<domain type='test'><name>{name}</name><uuid>{}</uuid><memory>1048576</memory><os><type>hvm</type></os><devices>{devs}</devices></domain>",
        uuid(id)
    )
}

async fn device(c: &mut Client, a: &str) -> proto::Device {
    c.get_device(proto::GetDeviceRequest { address: a.into() })
        .await
        .expect("get device")
        .into_inner()
        .device
        .expect("present")
}

async fn claim(c: &mut Client, a: &str, who: u128) -> proto::ClaimResponse {
    let g = device(c, a).await.generation;
    c.claim(proto::ClaimRequest {
        vfio: false,
        owner: Some(owner(who)),
        request_id: uuid::Uuid::new_v4().to_string(),
        target: Some(proto::claim_request::Target::Address(proto::ByAddress {
            address: a.into(),
            expected_generation: g,
        })),
    })
    .await
    .expect("claim")
    .into_inner()
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
        request_id: uuid::Uuid::new_v4().to_string(),
        generation: g,
    })
    .await
    .map(|r| r.into_inner())
}

/// Releases each `(address, consumer, generation)` of `held` at once, each from a
/// client of its own: each address with its answer, in `held`'s order.
async fn release_at_once(
    s: &Server,
    held: &[(String, u128, u64)],
) -> Vec<(String, Result<proto::ReleaseResponse, tonic::Status>)> {
    let mut clients = Vec::new();
    for _ in held {
        clients.push(s.client().await);
    }
    let tasks: Vec<_> = held
        .iter()
        .cloned()
        .zip(clients)
        .map(|((vf, who, g), mut c)| {
            tokio::spawn(async move { (vf.clone(), release(&mut c, &vf, who, g).await) })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.expect("release task"));
    }
    answers
}

async fn reconcile(
    c: &mut Client,
    expected: &[u128],
    act: bool,
) -> Result<proto::ReconcileResponse, tonic::Status> {
    let snapshot = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner()
        .host_generation;
    c.reconcile(proto::ReconcileRequest {
        expected_consumer_ids: expected.iter().map(|n| uuid(*n)).collect(),
        snapshot_generation: snapshot,
        act,
        request_id: uuid::Uuid::new_v4().to_string(),
    })
    .await
    .map(|r| r.into_inner())
}

/// An audit's protected devices with their holders' pids, by address.
fn protected(rep: &proto::ReconcileResponse) -> Vec<(String, u32)> {
    let mut protected: Vec<(String, u32)> = rep
        .protections
        .iter()
        .map(|p| (p.address.clone(), p.holder_pid))
        .collect();
    protected.sort();
    protected
}

fn info(s: &tonic::Status) -> (String, HashMap<String, String>) {
    let i = s.get_details_error_info().expect("ErrorInfo detail");
    (i.reason, i.metadata)
}

const ATTACHED: i32 = proto::DeviceState::Attached as i32;
const CLAIMED: i32 = proto::DeviceState::Claimed as i32;
const FREE: i32 = proto::DeviceState::Free as i32;

/// The fresh query before a free, with the poller effectively off (an hour's interval):
/// whatever the agent's last view, Release decides with libvirt's domains of right now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_queries_libvirt_afresh_attach_and_detach() {
    let lv = test_driver();
    let h = host(0x3b, 110);
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start(&h, proc_dir.path(), "test:///default", 3_600_000).await;
    let mut c = s.client().await;
    let vf = h.vfs[1].as_str();
    let claimed = claim(&mut c, vf, 0x3b01).await;
    assert_eq!(claimed.device.as_ref().map(|d| d.state), Some(CLAIMED));

    // A domain (not the owner) starts using the VF after the controller's last look.
    let dom = lv
        .define_domain_xml(&domain_xml("fresh-3b-a", 0x3b0a, &[vf], &[]))
        .expect("define");
    dom.create().expect("start");
    let t = Instant::now();
    let err = release(&mut c, vf, 0x3b01, claimed.generation)
        .await
        .expect_err("a device a running domain references must not be freed");
    let fresh_ms = t.elapsed().as_millis();
    // Applying the fresh list gave the device a new generation: the stale one is refused.
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    let d = device(&mut c, vf).await;
    assert_eq!(d.state, ATTACHED);
    assert!(d.generation > claimed.generation);
    let dom_info = d.attached_domain.clone().expect("domain named");
    assert_eq!(
        (dom_info.name.as_str(), dom_info.running),
        ("fresh-3b-a", true)
    );
    // With the current generation: refused because attached, naming the domain.
    let err = release(&mut c, vf, 0x3b01, d.generation)
        .await
        .expect_err("attached");
    assert_eq!(err.code(), Code::FailedPrecondition);
    let (reason, meta) = info(&err);
    assert_eq!(reason, "ATTACHED");
    assert_eq!(meta["domain_name"], "fresh-3b-a");
    assert!(err.message().contains("fresh-3b-a"), "{}", err.message());
    assert_eq!(device(&mut c, vf).await.generation, d.generation);

    // The domain stops and is undefined: back to claimed (new generation), never free.
    dom.destroy().expect("destroy");
    dom.undefine().expect("undefine");
    let err = release(&mut c, vf, 0x3b01, d.generation)
        .await
        .expect_err("stale after the detach");
    assert_eq!(err.code(), Code::Aborted);
    let back = device(&mut c, vf).await;
    assert_eq!(back.state, CLAIMED);
    assert!(back.generation > d.generation && back.attached_domain.is_none());
    let r = release(&mut c, vf, 0x3b01, back.generation)
        .await
        .expect("the owner frees it");
    assert_eq!(device(&mut c, vf).await.state, FREE);
    assert!(r.generation > back.generation);
    eprintln!("fresh libvirt query + refused release: {fresh_ms} ms");
    s.stop().await;
}

/// The release of `vf` by `who` at `generation`, the first since domain `domain` began to
/// use it, is refused (ABORTED: the fresh listing moved its generation on), and the
/// device reads attached to that domain; returns the device.
async fn attached_by_the_fresh_listing(
    c: &mut Client,
    vf: &str,
    who: u128,
    generation: u64,
    domain: &str,
) -> proto::Device {
    let err = release(c, vf, who, generation)
        .await
        .expect_err("the fresh listing attaches it");
    assert_eq!(err.code(), Code::Aborted, "{vf}: {err:?}");
    let d = device(c, vf).await;
    assert_eq!(d.state, ATTACHED, "{d:?}");
    assert_eq!(
        d.attached_domain.as_ref().map(|d| d.name.as_str()),
        Some(domain)
    );
    d
}

/// `stray` (unclaimed, used by a domain) is listed as a stray, and an acting audit that
/// expects no consumer frees none of `attached`, which stay attached.
async fn a_stray_and_kept_by_an_audit(c: &mut Client, stray: &str, attached: &[&str]) {
    let list = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner();
    assert!(
        list.strays.iter().any(|s| s.address == stray),
        "the unclaimed VF it uses is a stray: {:?}",
        list.strays
    );
    let rep = reconcile(c, &[], true).await.expect("audit");
    assert!(rep.orphans.is_empty(), "{rep:?}");
    for vf in attached {
        assert_eq!(device(c, vf).await.state, ATTACHED, "{vf}");
    }
}

/// A domain that uses a VF through macvtap (`<interface type='direct'>` in passthrough
/// mode on the VF's interface, as a `macvtap` port is plugged) names the VF only by its
/// interface's name: the agent finds the VF through sysfs, so the claim attaches and a
/// free is refused, and an unclaimed VF used that way is a stray. Before, such a VF read
/// as unused: an audit could free it under a running VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vf_used_through_macvtap_is_attached() {
    let lv = test_driver();
    let pf = "0000:45:00.0";
    let mut f = FakeSys::new();
    f.pf(pf, 0x8086, 0x1572, 64, 4)
        .driver(pf, "i40e")
        .netdev(pf, "ens45f0")
        .iommu_group(pf, 149)
        .vf_iommu_groups(pf, 150)
        .vf_driver(pf, "iavf");
    let vfs: Vec<String> = f.vfs(pf).iter().map(|a| a.to_string()).collect();
    for (i, vf) in vfs.iter().enumerate() {
        f.netdev(vf, &format!("ens45f0v{i}"));
    }
    let h = Host::built(&f, pf);
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start(&h, proc_dir.path(), "test:///default", 3_600_000).await;
    let mut c = s.client().await;
    let (vf1, vf2) = (h.vfs[1].as_str(), h.vfs[2].as_str());
    let claimed = claim(&mut c, vf1, 0x4501).await;
    let xml = format!(
        "<domain type='test'><name>instance-4501</name><uuid>{}</uuid><memory>1048576</memory><os><type>hvm</type></os><devices>\
         <interface type='direct'><mac address='52:54:00:45:01:01'/><source dev='ens45f0v1' mode='passthrough'/></interface>\
         <interface type='direct'><mac address='52:54:00:45:01:02'/><source dev='ens45f0v2' mode='passthrough'/></interface>\
         <interface type='direct'><mac address='52:54:00:45:01:03'/><source dev='eth-none' mode='bridge'/></interface>\
         </devices></domain>",
        uuid(0x4501)
    );
    let dom = lv.define_domain_xml(&xml).expect("define");
    let d = attached_by_the_fresh_listing(&mut c, vf1, 0x4501, claimed.generation, "instance-4501")
        .await;
    let err = release(&mut c, vf1, 0x4501, d.generation)
        .await
        .expect_err("attached");
    assert_eq!(info(&err).0, "ATTACHED", "{err:?}");
    a_stray_and_kept_by_an_audit(&mut c, vf2, &[vf1]).await;
    dom.undefine().expect("undefine");
    s.stop().await;
}

/// A domain that uses a vGPU made on a VF (`<hostdev type='mdev'>`, by the mediated
/// device's UUID) or a vDPA device on a VF (`<interface type='vdpa'>`, by the vhost-vdpa
/// node; a `<disk type='vhostvdpa'>` is read the same, but needs a newer libvirt than
/// the test driver here) names the VF only through sysfs: the agent
/// finds it there, so the claim attaches, a free is refused and an audit keeps it, and an
/// unclaimed VF used that way is a stray. Before, such a VF read as unused: an audit
/// could free it under a running VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfs_used_through_an_mdev_or_a_vdpa_device_are_attached() {
    let lv = test_driver();
    let pf = "0000:46:00.0";
    let mdev = "5b0c8e3a-2f1d-4c7e-9a66-0d9f1e2c3b4a";
    let (mut f, vfs) = mlx5(pf, 159);
    f.mdev(&vfs[1], mdev);
    f.vhost_vdpa(&vfs[2], 0).vhost_vdpa(&vfs[3], 1);
    let h = Host::built(&f, pf);
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start(&h, proc_dir.path(), "test:///default", 3_600_000).await;
    let mut c = s.client().await;
    let (vf1, vf2, vf3) = (h.vfs[1].as_str(), h.vfs[2].as_str(), h.vfs[3].as_str());
    // Claimed by another consumer than the domain's own UUID (a claim of the domain's
    // own is attached to it whatever it references): only the mapping attaches these.
    let claims = [
        (vf1, claim(&mut c, vf1, 0x4699).await),
        (vf2, claim(&mut c, vf2, 0x4699).await),
    ];
    let xml = format!(
        "<domain type='test'><name>instance-4601</name><uuid>{}</uuid><memory>1048576</memory><os><type>hvm</type></os><devices>\
         <hostdev mode='subsystem' type='mdev' model='vfio-pci'><source><address uuid='{mdev}'/></source></hostdev>\
         <interface type='vdpa'><mac address='52:54:00:46:01:02'/><source dev='/dev/vhost-vdpa-0'/></interface>\
         <interface type='vdpa'><mac address='52:54:00:46:01:03'/><source dev='/dev/vhost-vdpa-1'/></interface>\
         </devices></domain>",
        uuid(0x4601)
    );
    let dom = lv.define_domain_xml(&xml).expect("define");
    for (vf, claimed) in &claims {
        attached_by_the_fresh_listing(&mut c, vf, 0x4699, claimed.generation, "instance-4601")
            .await;
    }
    // An audit that expects neither consumer frees neither VF: both are in use.
    a_stray_and_kept_by_an_audit(&mut c, vf3, &[vf1, vf2]).await;
    dom.undefine().expect("undefine");
    s.stop().await;
}

/// Releases sent at once share fresh listings of the domains, and each still decides
/// with a listing that began after it was sent: a domain started just before them
/// protects its VF from all of them, and the other VFs are freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_releases_each_see_a_domain_started_before_them() {
    let lv = test_driver();
    let h = host(0x3c, 130);
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start(&h, proc_dir.path(), "test:///default", 3_600_000).await;
    let mut c = s.client().await;
    let vfs = &h.vfs[1..4];
    let mut held = Vec::new();
    for (k, vf) in vfs.iter().enumerate() {
        let who = 0x3c01 + k as u128;
        held.push((vf.clone(), who, claim(&mut c, vf, who).await.generation));
    }
    // Another VM starts on the middle VF after the controller's last look.
    let dom = lv
        .define_domain_xml(&domain_xml("fresh-3c-b", 0x3c0b, &[&vfs[1]], &[]))
        .expect("define");
    dom.create().expect("start");
    let mut freed = Vec::new();
    for (vf, r) in release_at_once(&s, &held).await {
        match r {
            Ok(_) => freed.push(vf),
            Err(e) => {
                assert_eq!(
                    vf, vfs[1],
                    "only the VF the new domain uses is refused: {e:?}"
                );
                assert_eq!(e.code(), Code::Aborted, "{e:?}");
            }
        }
    }
    freed.sort();
    freed.dedup();
    assert_eq!(freed, [vfs[0].clone(), vfs[2].clone()]);
    let d = device(&mut c, &vfs[1]).await;
    assert_eq!(d.state, ATTACHED);
    assert_eq!(
        d.attached_domain.map(|a| a.name).as_deref(),
        Some("fresh-3c-b")
    );
    for vf in [&vfs[0], &vfs[2]] {
        assert_eq!(device(&mut c, vf).await.state, FREE);
    }
    dom.destroy().expect("destroy");
    dom.undefine().expect("undefine");
    s.stop().await;
}

/// The poller keeps views current: a defined (not running) domain that is the owner
/// attaches its claim, an `<interface type='hostdev'>` of an unclaimed VF is a stray,
/// GetStatus shows libvirt healthy, and an acting audit protects the attached claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poller_attaches_reports_strays_and_audit_protects() {
    let lv = test_driver();
    let h = host(0x3c, 120);
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start(&h, proc_dir.path(), "test:///default", 50).await;
    let mut c = s.client().await;
    let (vf1, vf2) = (h.vfs[1].as_str(), h.vfs[2].as_str());
    let claimed = claim(&mut c, vf1, 0x3c01).await;
    let _dom = lv
        .define_domain_xml(&domain_xml("instance-3c01", 0x3c01, &[], &[vf1, vf2]))
        .expect("define");
    let deadline = Instant::now() + Duration::from_secs(10);
    let d = loop {
        let d = device(&mut c, vf1).await;
        if d.state == ATTACHED || Instant::now() > deadline {
            break d;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(d.state, ATTACHED, "the poller never attached {vf1}: {d:?}");
    assert!(d.generation > claimed.generation);
    let dom = d.attached_domain.expect("domain");
    assert_eq!((dom.name.as_str(), dom.running), ("instance-3c01", false));

    let list = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner();
    let stray = list
        .strays
        .iter()
        .find(|s| s.address == vf2)
        .expect("the unclaimed VF the domain uses is a stray");
    assert_eq!(
        stray.domain.as_ref().map(|d| d.name.as_str()),
        Some("instance-3c01")
    );
    assert!(stray.known_device && stray.claimed_by.is_none());
    let status = c
        .get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    let health = status.libvirt.expect("libvirt health");
    assert!(
        health.ok && health.detail.contains("test:///default"),
        "{health:?}"
    );
    assert!(status.strays >= 1);

    // An audit that believes nobody lives here frees nothing attached, and says why.
    let rep = reconcile(&mut c, &[], true).await.expect("reconcile");
    assert!(rep.acted && rep.orphans.is_empty(), "{rep:?}");
    assert!(rep.strays.iter().any(|s| s.address == vf2));
    assert_eq!(
        rep.protected
            .iter()
            .map(|d| d.address.as_str())
            .collect::<Vec<_>>(),
        vec![vf1]
    );
    assert!(
        rep.protections[0].reason.contains("instance-3c01"),
        "{:?}",
        rep.protections
    );
    assert_eq!(device(&mut c, vf1).await.state, ATTACHED);
    _dom.undefine().expect("undefine");
    s.stop().await;
}

/// libvirt unreachable since the start: no device is claimed (a domain could use one
/// without a claim, and it would read as free; an earlier version handed it out) and no
/// acting audit runs (UNAVAILABLE, nothing changes) until it answers; with libvirt
/// disabled in config the status says so and claims and frees go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_libvirt_refuses_frees_and_disabled_says_so() {
    let _lv = test_driver();
    let h = host(0x3d, 130);
    let proc_dir = tempfile::tempdir().expect("proc");
    let host_xml = proc_dir.path().join("missing-host.xml");
    let uri = format!("test://{}", host_xml.display());
    let s = start(&h, proc_dir.path(), &uri, 3_600_000).await;
    let mut c = s.client().await;
    let vf = h.vfs[1].as_str();
    let free = device(&mut c, vf).await;
    let blind = c
        .claim(proto::ClaimRequest {
            vfio: false,
            owner: Some(owner(0x3d01)),
            request_id: "while-blind".into(),
            target: Some(proto::claim_request::Target::Address(proto::ByAddress {
                address: vf.into(),
                expected_generation: free.generation,
            })),
        })
        .await
        .expect_err("libvirt has never answered");
    assert_eq!(blind.code(), Code::Unavailable, "{blind:?}");
    assert_eq!(info(&blind).0, "LIBVIRT_UNREACHABLE");
    assert!(
        blind
            .message()
            .contains("has not answered since this agent started"),
        "{}",
        blind.message()
    );
    let still = device(&mut c, vf).await;
    assert_eq!((still.state, still.generation), (FREE, free.generation));
    let err = reconcile(&mut c, &[], true)
        .await
        .expect_err("no acting audit");
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(info(&err).0, "LIBVIRT_UNREACHABLE");
    assert!(
        err.message().starts_with(&format!(
            "cannot prove the orphans unused: libvirt at {uri} unreachable"
        )),
        "{}",
        err.message()
    );
    let status = c
        .get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert!(!status.libvirt.expect("health").ok);
    // libvirt answers (its host file appears): the next acting audit lists the domains,
    // and claims and frees go on from then. (A libvirt that goes away after answering,
    // and the frees it then refuses, are libvirtd_killed_and_restarted_under_the_agent.)
    std::fs::write(
        &host_xml,
        "<node xmlns:test='http://libvirt.org/schemas/domain/test/1.0'></node>",
    )
    .expect("host file");
    reconcile(&mut c, &[], true)
        .await
        .expect("an acting audit lists the domains");
    let claimed = claim(&mut c, vf, 0x3d01).await;
    release(&mut c, vf, 0x3d01, claimed.generation)
        .await
        .expect("libvirt answered: the release is checked and goes through");
    s.stop().await;

    let s = start(&h, proc_dir.path(), "", 3_600_000).await;
    let mut c = s.client().await;
    let status = c
        .get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    let health = status.libvirt.expect("health");
    assert!(health.detail.contains("disabled"), "{health:?}");
    let g = claim(&mut c, vf, 0x3d01).await.generation;
    release(&mut c, vf, 0x3d01, g)
        .await
        .expect("without libvirt, the generation and VFIO checks decide");
    s.stop().await;
}

/// libvirt silent at start, then answering: the poller tries again within seconds, as
/// after any failed poll, not a whole poll interval (here an hour) later. Before, a
/// failed listing at start put the first retry a full interval away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_failed_at_start_is_retried_within_seconds() {
    let _lv = test_driver();
    let h = host(0x46, 160);
    let proc_dir = tempfile::tempdir().expect("proc");
    let host_xml = proc_dir.path().join("late-host.xml");
    let uri = format!("test://{}", host_xml.display());
    let s = start(&h, proc_dir.path(), &uri, 3_600_000).await;
    let mut c = s.client().await;
    until_libvirt(&mut c, false).await;
    std::fs::write(
        &host_xml,
        "<node xmlns:test='http://libvirt.org/schemas/domain/test/1.0'></node>",
    )
    .expect("host file");
    // Within until_libvirt's 30 s, with nothing else asking for a listing.
    until_libvirt(&mut c, true).await;
    s.stop().await;
}

/// Claims wait for libvirt's first answer since the start, but a retry of a claim made
/// before a restart is answered as the first time (I7), not refused for that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_retried_after_a_restart_is_answered_while_libvirt_is_silent() {
    let _lv = test_driver();
    let h = host(0x3c, 120);
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("proc")).expect("proc");
    let host_xml = dir.path().join("host.xml");
    std::fs::write(
        &host_xml,
        "<node xmlns:test='http://libvirt.org/schemas/domain/test/1.0'></node>",
    )
    .expect("host.xml");
    let libvirt = format!("[libvirt]\nuri = \"test://{}\"\n", host_xml.display());
    let (vf, other) = (h.vfs[1].clone(), h.vfs[2].clone());
    let request = |g: u64, id: &str, a: &str| proto::ClaimRequest {
        vfio: false,
        owner: Some(owner(0x3c01)),
        request_id: id.into(),
        target: Some(proto::claim_request::Target::Address(proto::ByAddress {
            address: a.into(),
            expected_generation: g,
        })),
    };
    let (child, socket, _log) = spawn_hostdevd(&h, dir.path(), &libvirt).await;
    let mut child = KillOnDrop(child);
    let mut c = hostdevd::client::connect(&socket).await.expect("connect");
    let g = device(&mut c, &vf).await.generation;
    let first = c
        .claim(request(g, "boot-1", &vf))
        .await
        .expect("claim while libvirt answers")
        .into_inner();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.0.id()).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("stop");
    assert!(child.0.wait().expect("wait").success());

    // libvirt is gone when the agent starts again.
    std::fs::remove_file(&host_xml).expect("libvirt goes");
    let (child, socket, _log) = spawn_hostdevd(&h, dir.path(), &libvirt).await;
    let _child = KillOnDrop(child);
    let mut c = hostdevd::client::connect(&socket).await.expect("connect");
    let again = c
        .claim(request(g, "boot-1", &vf))
        .await
        .expect("the retry is answered")
        .into_inner();
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.generation, first.generation);
    let g2 = device(&mut c, &other).await.generation;
    let refused = c
        .claim(request(g2, "boot-2", &other))
        .await
        .expect_err("a new claim waits for libvirt");
    assert_eq!(info(&refused).0, "LIBVIRT_UNREACHABLE", "{refused:?}");
}

/// A spawned agent, killed when the test ends, failed or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A fake proc tree with a QEMU holding the VF's VFIO group: Release is refused naming
/// the process, an audit protects it; once the process is gone the release succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfio_holder_blocks_the_free_until_it_exits() {
    let _lv = test_driver();
    let h = host(0x3e, 140);
    let vf = h.vfs[0].as_str();
    let node = h.tree.dev_root().join("vfio/140");
    let proc_dir = tempfile::tempdir().expect("proc");
    // An unrelated open file, and the group node.
    let log = proc_dir.path().join("log");
    let p = fake_qemu(proc_dir.path(), 4242, 0x3e01, &[&log, &node]);
    let s = start(&h, proc_dir.path(), "test:///default", 3_600_000).await;
    let mut c = s.client().await;
    let d = device(&mut c, vf).await;
    assert_eq!(d.vfio_group, node.display().to_string());
    let claimed = claim(&mut c, vf, 0x3e01).await;

    let err = release(&mut c, vf, 0x3e01, claimed.generation)
        .await
        .expect_err("held open");
    held_by(&err, 4242, "instance-3e01");

    let rep = reconcile(&mut c, &[], true).await.expect("reconcile");
    assert!(rep.orphans.is_empty(), "{rep:?}");
    assert_eq!(rep.protected.len(), 1);
    let p0 = &rep.protections[0];
    assert_eq!((p0.address.as_str(), p0.holder_pid), (vf, 4242));
    assert!(p0.reason.contains("qemu-system-x86"), "{}", p0.reason);
    assert_eq!(device(&mut c, vf).await.generation, claimed.generation);

    // QEMU exits (its proc entry vanishes): the free goes through.
    std::fs::remove_dir_all(&p).expect("process gone");
    release(&mut c, vf, 0x3e01, claimed.generation)
        .await
        .expect("nobody holds the group any more");
    assert_eq!(device(&mut c, vf).await.state, FREE);
    s.stop().await;
}

/// An evacuation's burst of releases on a host with VFIO nodes: every release needs a
/// pass over the proc tree that began after it arrived, and they share passes instead
/// of making one each, all at once; each is still answered from its own devices' nodes
/// (the one VF a process holds is refused, the rest are freed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_releases_shares_the_passes_over_the_proc_tree() {
    let _lv = test_driver();
    let pf = "0000:48:00.0";
    let (f, vfs) = vfio_pci_vfs(pf, 24, 499);
    let tree = f.build();
    for g in 500..500 + vfs.len() as u32 {
        tree.vfio_node(g);
    }
    let held_node = tree.dev_root().join("vfio/505");
    let h = Host {
        tree,
        vfs: vfs.clone(),
        pf: pf.into(),
    };
    // A host's worth of processes, so that a pass takes a while; one holds VF5's group.
    let proc_dir = tempfile::tempdir_in(hostdevd::simhost::scratch_base()).expect("proc");
    let log = proc_dir.path().join("log");
    for pid in 1000..2500 {
        let fd = proc_dir.path().join(format!("{pid}/fd"));
        std::fs::create_dir_all(&fd).expect("fd dir");
        for n in 0..8 {
            symlink(&log, fd.join(n.to_string())).expect("fd");
        }
    }
    fake_qemu(proc_dir.path(), 4848, 0x4805, &[&held_node]);
    let s = start(&h, proc_dir.path(), "test:///default", 3_600_000).await;
    let mut c = s.client().await;
    let mut claims = Vec::new();
    for (k, vf) in vfs.iter().enumerate() {
        let who = 0x4800 + k as u128;
        claims.push((vf.clone(), who, claim(&mut c, vf, who).await.generation));
    }
    let passes_before = s.writer.metrics().holder_scans();
    for (vf, r) in release_at_once(&s, &claims).await {
        if vf == vfs[5] {
            held_by(&r.expect_err("VF5's group is held"), 4848, "instance-4805");
        } else {
            r.unwrap_or_else(|e| panic!("{vf}: {e:?}"));
            assert_eq!(device(&mut c, &vf).await.state, FREE, "{vf}");
        }
    }
    let passes = s.writer.metrics().holder_scans() - passes_before;
    assert!(
        (1..=vfs.len() as u64 / 2).contains(&passes),
        "{} releases at once made {passes} passes over the proc tree",
        vfs.len()
    );
    s.stop().await;
}

/// A device attached to a domain whose QEMU holds its VFIO group open: Release fails the
/// fresh checks (the group is held), but the ledger refuses it anyway, so the answer is
/// the ledger's, FAILED_PRECONDITION ATTACHED naming the domain, which says what to do
/// (detach it first). Before, the holder check answered VFIO_GROUP_IN_USE. Nothing
/// changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attached_device_held_open_is_refused_as_attached() {
    let lv = test_driver();
    let h = host(0x44, 210);
    let vf = h.vfs[0].as_str();
    let node = h.tree.dev_root().join("vfio/210");
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start_with(&h, proc_dir.path(), "test:///default", 3_600_000, |cfg| {
        cfg.libvirt.events = false;
    })
    .await;
    let mut c = s.client().await;
    let claimed = claim(&mut c, vf, 0x4401).await;
    let dom = lv
        .define_domain_xml(&domain_xml("attached-44", 0x4401, &[vf], &[]))
        .expect("define");
    dom.create().expect("start");
    // The fresh listing attaches the device, which moves its generation on.
    let err = release(&mut c, vf, 0x4401, claimed.generation)
        .await
        .expect_err("stale once attached");
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    let d = device(&mut c, vf).await;
    assert_eq!(d.state, ATTACHED);

    // QEMU for the domain holds the group open.
    let qemu = fake_qemu(proc_dir.path(), 4444, 0x4401, &[&node]);
    let err = release(&mut c, vf, 0x4401, d.generation)
        .await
        .expect_err("attached and held open");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let (reason, meta) = info(&err);
    assert_eq!(reason, "ATTACHED", "{err:?}");
    assert_eq!(meta["domain_name"], "attached-44");
    assert!(err.message().contains("attached-44"), "{}", err.message());
    let now = device(&mut c, vf).await;
    assert_eq!((now.state, now.generation), (ATTACHED, d.generation));

    std::fs::remove_dir_all(&qemu).expect("QEMU exits");
    dom.destroy().expect("destroy");
    dom.undefine().expect("undefine");
    s.stop().await;
}

/// A VF count change destroys every VF, so it is checked like a free of the PF and each
/// VF: a domain using one without a claim (listed afresh: the poller is effectively off
/// and so are domain events) and a process holding one's VFIO group refuse it, and
/// nothing is written until neither does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vf_count_change_is_refused_while_a_domain_or_a_vfio_holder_uses_a_vf() {
    let lv = test_driver();
    let h = host(0x43, 200);
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start_with(&h, proc_dir.path(), "test:///default", 3_600_000, |cfg| {
        cfg.libvirt.events = false;
    })
    .await;
    let mut c = s.client().await;
    let g = device(&mut c, &h.pf).await.generation;
    let numvfs = h.tree.bus_link(&h.pf).join("sriov_numvfs");
    let set = |c: &mut Client, generation: u64| {
        let mut c = c.clone();
        let pf = h.pf.clone();
        async move {
            c.set_vf_count(proto::SetVfCountRequest {
                address: pf,
                vf_count: 2,
                generation,
                drivers_autoprobe: None,
                ..Default::default()
            })
            .await
        }
    };

    // A domain started after the agent's last look uses VF 2 without a claim.
    let dom = lv
        .define_domain_xml(&domain_xml("vf-user-43", 0x4302, &[&h.vfs[2]], &[]))
        .expect("define");
    dom.create().expect("start");
    let err = set(&mut c, g).await.expect_err("a domain uses VF 2");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let (reason, meta) = info(&err);
    assert_eq!(reason, "VF_IN_USE_BY_DOMAIN");
    assert_eq!(meta["device_in_use"], h.vfs[2]);
    assert_eq!(meta["domain_name"], "vf-user-43");
    assert!(err.message().contains("vf-user-43"), "{}", err.message());
    assert_eq!(
        std::fs::read_to_string(&numvfs).expect("numvfs").trim(),
        "4"
    );
    assert_eq!(device(&mut c, &h.pf).await.generation, g, "nothing changed");
    // For the same reason the PF itself is unavailable, and a claim of it is refused:
    // taking it from its driver would destroy VF 2 under the domain.
    let blocker = device(&mut c, &h.pf).await.blocker.expect("PF blocked");
    assert_eq!(
        (blocker.relation.as_str(), blocker.address.as_str()),
        ("virtual_function_in_use", h.vfs[2].as_str())
    );
    assert_eq!(blocker.domain.expect("domain").name, "vf-user-43");
    let err = c
        .claim(proto::ClaimRequest {
            vfio: true,
            owner: Some(owner(43)),
            request_id: "pf-43".into(),
            target: Some(proto::claim_request::Target::Address(proto::ByAddress {
                address: h.pf.clone(),
                expected_generation: g,
            })),
        })
        .await
        .expect_err("a VF of the PF is in use");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(info(&err).0, "VF_IN_USE_BY_DOMAIN");
    assert_eq!(device(&mut c, &h.pf).await.owner, None, "nothing claimed");
    dom.destroy().expect("destroy");
    dom.undefine().expect("undefine");

    // QEMU holds VF 0's group open (a VM the host's libvirt does not list).
    let node = h.tree.dev_root().join("vfio/200");
    let qemu = fake_qemu(proc_dir.path(), 4343, 0x4301, &[&node]);
    let err = set(&mut c, g).await.expect_err("VF 0's group is held open");
    let meta = held_by(&err, 4343, "instance-4301");
    assert_eq!(meta["address"], h.vfs[0]);
    assert_eq!(
        std::fs::read_to_string(&numvfs).expect("numvfs").trim(),
        "4"
    );
    assert_eq!(device(&mut c, &h.pf).await.generation, g, "nothing changed");

    // Neither any more: the count is written.
    std::fs::remove_dir_all(&qemu).expect("QEMU exits");
    let done = set(&mut c, g).await.expect("unused now").into_inner();
    assert_eq!(done.previous_vf_count, 4);
    assert!(done.generation > g);
    assert_eq!(
        std::fs::read_to_string(&numvfs).expect("numvfs").trim(),
        "2"
    );
    s.stop().await;
}

/// Checks that `err` refuses a free because a VFIO node is held open by `pid`, a fake
/// QEMU for `domain`; returns the status's metadata.
fn held_by(err: &tonic::Status, pid: u32, domain: &str) -> HashMap<String, String> {
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let (reason, meta) = info(err);
    assert_eq!(reason, "VFIO_GROUP_IN_USE");
    assert_eq!(meta["holder_pid"], pid.to_string());
    assert_eq!(meta["holder_command"], "qemu-system-x86");
    assert_eq!(meta["domain_name"], domain);
    assert!(
        err.message().contains(&format!("pid {pid}")),
        "{}",
        err.message()
    );
    meta
}

/// A fake QEMU process under a fake proc root: `comm`, a libvirt-style command line and
/// one fd linked to each of `nodes`.
fn fake_qemu(proc_root: &Path, pid: u32, domain: u128, nodes: &[&Path]) -> std::path::PathBuf {
    let p = proc_root.join(pid.to_string());
    std::fs::create_dir_all(p.join("fd")).expect("fd dir");
    std::fs::write(p.join("comm"), "qemu-system-x86\n").expect("comm");
    std::fs::write(
        p.join("cmdline"),
        format!(
            "/usr/bin/qemu-system-x86_64\0-name\0guest=instance-{domain:x},debug-threads=on\0-uuid\0{}\0",
            uuid(domain)
        ),
    )
    .expect("cmdline");
    for (fd, node) in nodes.iter().enumerate() {
        symlink(node, p.join(format!("fd/{}", 30 + fd))).expect("fd");
    }
    p
}

/// The iommufd interface (Linux 6.6 and later): QEMU holds a VF's own VFIO device node
/// (`/dev/vfio/devices/vfioN`), not its group node. Release is refused naming the
/// process, and so is the release of a VF whose IOMMU group peer's device node is held;
/// an acting audit protects both; a `vfio-dev` directory that cannot be listed refuses
/// the free as unprovable. None of the refusals changes anything, and once the processes
/// are gone the releases go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_vfio_device_node_blocks_the_free() {
    let _lv = test_driver();
    let pf = "0000:3f:00.0";
    let (mut f, vfs) = vfio_pci_vfs(pf, 4, 159);
    // VF2 and VF3 share IOMMU group 162.
    f.iommu_group(&vfs[3], 162);
    let tree = f.build();
    for g in 160..=162 {
        tree.vfio_node(g);
    }
    let node = tree.vfio_device_node(&vfs[0], 0);
    let peer_node = tree.vfio_device_node(&vfs[3], 3);
    let h = Host {
        tree,
        vfs: vfs.clone(),
        pf: pf.into(),
    };
    let proc_dir = tempfile::tempdir().expect("proc");
    let iommu = h.tree.dev_root().join("iommu");
    let q1 = fake_qemu(proc_dir.path(), 4343, 0x3f01, &[&iommu, &node]);
    let q2 = fake_qemu(proc_dir.path(), 4344, 0x3f02, &[&iommu, &peer_node]);
    let s = start(&h, proc_dir.path(), "test:///default", 3_600_000).await;
    let mut c = s.client().await;
    let (vf, peer) = (vfs[0].as_str(), vfs[2].as_str());
    assert_eq!(
        device(&mut c, vf).await.vfio_device,
        node.display().to_string()
    );
    assert_eq!(device(&mut c, peer).await.vfio_device, "");
    let claimed = claim(&mut c, vf, 0x3f01).await;
    let peer_claimed = claim(&mut c, peer, 0x3f02).await;

    let err = release(&mut c, vf, 0x3f01, claimed.generation)
        .await
        .expect_err("its device node is held open");
    let meta = held_by(&err, 4343, "instance-3f01");
    assert_eq!(meta["vfio_group"], node.display().to_string());
    assert!(
        err.message()
            .contains(&format!("VFIO device node {}", node.display())),
        "{}",
        err.message()
    );
    let err = release(&mut c, peer, 0x3f02, peer_claimed.generation)
        .await
        .expect_err("its IOMMU group peer's device node is held open");
    held_by(&err, 4344, "instance-3f02");

    let rep = reconcile(&mut c, &[], true).await.expect("reconcile");
    assert!(rep.orphans.is_empty(), "{rep:?}");
    assert_eq!(protected(&rep), [(vf.into(), 4343), (peer.into(), 4344)]);
    assert!(
        rep.protections
            .iter()
            .all(|p| p.reason.contains("VFIO device node")),
        "{:?}",
        rep.protections
    );

    // QEMU exits, but the device's vfio-dev directory cannot be listed: nothing proves
    // the device unused, so the free is refused and nothing changes.
    std::fs::remove_dir_all(&q1).expect("process gone");
    let vfio_dev = h.tree.device_dir(vf).join("vfio-dev");
    std::fs::remove_dir_all(&vfio_dev).expect("rmdir");
    std::fs::write(&vfio_dev, "").expect("odd file");
    let err = release(&mut c, vf, 0x3f01, claimed.generation)
        .await
        .expect_err("device nodes unknown");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(info(&err).0, "VFIO_HOLDERS_UNKNOWN");
    for (a, g) in [(vf, claimed.generation), (peer, peer_claimed.generation)] {
        let d = device(&mut c, a).await;
        assert_eq!((d.state, d.generation), (CLAIMED, g), "{a}");
    }

    std::fs::remove_file(&vfio_dev).expect("rm");
    release(&mut c, vf, 0x3f01, claimed.generation)
        .await
        .expect("nobody holds the device node any more");
    std::fs::remove_dir_all(&q2).expect("process gone");
    release(&mut c, peer, 0x3f02, peer_claimed.generation)
        .await
        .expect("nobody holds the peer's device node any more");
    for a in [vf, peer] {
        assert_eq!(device(&mut c, a).await.state, FREE, "{a}");
    }
    s.stop().await;
}

/// A process outside libvirt (a QEMU started by hand, a DPDK application, a container
/// runtime) that holds a mediated device made on a VF (its own VFIO group) or a vDPA
/// device's vhost-vdpa node uses the VF though it holds none of the VF's own nodes:
/// Release is refused naming it, an acting audit protects both VFs, and the list of
/// such devices that cannot be read refuses the free as unprovable. None of the
/// refusals changes anything; once the processes are gone the releases go through.
/// Before, both VFs read as unused to the holder check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_mdev_or_vhost_vdpa_node_made_on_a_vf_blocks_the_free() {
    let _lv = test_driver();
    let pf = "0000:47:00.0";
    let mdev = "7e1d2c3b-4a5f-4e6a-8b7c-9d0e1f2a3b4c";
    let (mut f, vfs) = mlx5(pf, 169);
    f.mdev(&vfs[1], mdev).vhost_vdpa(&vfs[2], 5);
    let h = Host::built(&f, pf);
    let mdev_group = h.tree.mdev_vfio_node(mdev, 400);
    let vdpa_node = h.tree.vhost_vdpa_node(5);
    let proc_dir = tempfile::tempdir().expect("proc");
    let q1 = fake_qemu(proc_dir.path(), 4747, 0x4701, &[&mdev_group]);
    let q2 = fake_qemu(proc_dir.path(), 4748, 0x4702, &[&vdpa_node]);
    let s = start(&h, proc_dir.path(), "test:///default", 3_600_000).await;
    let mut c = s.client().await;
    let (vf0, vf1, vf2) = (h.vfs[0].as_str(), h.vfs[1].as_str(), h.vfs[2].as_str());
    let claims = [
        (vf0, claim(&mut c, vf0, 0x4700).await.generation),
        (vf1, claim(&mut c, vf1, 0x4701).await.generation),
        (vf2, claim(&mut c, vf2, 0x4702).await.generation),
    ];

    let err = release(&mut c, vf1, 0x4701, claims[1].1)
        .await
        .expect_err("an mdev made on it is held open");
    let meta = held_by(&err, 4747, "instance-4701");
    assert_eq!(meta["vfio_group"], mdev_group.display().to_string());
    let err = release(&mut c, vf2, 0x4702, claims[2].1)
        .await
        .expect_err("its vDPA device's vhost-vdpa node is held open");
    held_by(&err, 4748, "instance-4702");
    assert!(
        err.message()
            .contains(&format!("vhost-vdpa node {}", vdpa_node.display())),
        "{}",
        err.message()
    );

    let rep = reconcile(&mut c, &[], true).await.expect("reconcile");
    assert_eq!(protected(&rep), [(vf1.into(), 4747), (vf2.into(), 4748)]);
    let orphans: Vec<&str> = rep
        .orphans
        .iter()
        .filter_map(|o| o.device.as_ref().map(|d| d.address.as_str()))
        .collect();
    assert_eq!(orphans, vec![vf0], "only VF0 is unused: {rep:?}");
    assert_eq!(device(&mut c, vf0).await.state, FREE, "the audit freed VF0");
    for (a, g) in &claims[1..] {
        let d = device(&mut c, a).await;
        assert_eq!((d.state, d.generation), (CLAIMED, *g), "{a}");
    }

    // Both processes exit, but the kernel's list of vhost-vdpa nodes cannot be read:
    // nothing proves either VF unused, so the free is refused and nothing changes.
    std::fs::remove_dir_all(&q1).expect("process gone");
    std::fs::remove_dir_all(&q2).expect("process gone");
    let class = h.tree.sysfs_root().join("class/vhost-vdpa");
    let aside = h.tree.sysfs_root().join("class/vhost-vdpa.aside");
    std::fs::rename(&class, &aside).expect("set the list aside");
    std::fs::write(&class, "").expect("odd file");
    let err = release(&mut c, vf1, 0x4701, claims[1].1)
        .await
        .expect_err("the devices made on it are unknown");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(info(&err).0, "VFIO_HOLDERS_UNKNOWN");
    assert!(
        err.message().contains("class/vhost-vdpa"),
        "{}",
        err.message()
    );
    assert_eq!(device(&mut c, vf1).await.generation, claims[1].1);

    std::fs::remove_file(&class).expect("rm");
    std::fs::rename(&aside, &class).expect("the list back");
    for (a, g) in &claims[1..] {
        let who = if *a == vf1 { 0x4701 } else { 0x4702 };
        release(&mut c, a, who, *g)
            .await
            .unwrap_or_else(|e| panic!("nobody holds what is made on {a} any more: {e:?}"));
        assert_eq!(device(&mut c, a).await.state, FREE, "{a}");
    }
    s.stop().await;
}

/// The real daemon binary over a `test:///PATH/host.xml` that pre-defines a running
/// domain: attached on claim by its own UUID, strays reported, a foreign claim refused
/// naming the domain, an acting audit with a wrong owner list frees nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_binary_with_a_host_file() {
    let _lv = test_driver();
    let h = host(0x3f, 150);
    let dir = tempfile::tempdir().expect("dir");
    let (vf1, vf2, vf3) = (h.vfs[1].as_str(), h.vfs[2].as_str(), h.vfs[3].as_str());
    let host_xml = dir.path().join("host.xml");
    let dom = domain_xml("instance-3f01", 0x3f01, &[vf1], &[vf2]);
    let stopped = domain_xml("stopped-3f02", 0x3f02, &[vf3], &[])
        .replace("</devices>", "</devices><test:runstate>5</test:runstate>");
    std::fs::write(
        &host_xml,
        format!(
            "<node xmlns:test='http://libvirt.org/schemas/domain/test/1.0'>{dom}{stopped}</node>"
        ),
    )
    .expect("host.xml");
    let (mut child, socket, log) = spawn_hostdevd(
        &h,
        dir.path(),
        &format!(
            "[libvirt]\nuri = \"test://{}\"\npoll_interval_ms = 100\n",
            host_xml.display()
        ),
    )
    .await;
    let mut c = hostdevd::client::connect(&socket).await.expect("connect");
    let list = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner();
    let strays: Vec<(&str, &str)> = list
        .strays
        .iter()
        .map(|s| {
            (
                s.address.as_str(),
                s.domain.as_ref().map(|d| d.name.as_str()).unwrap_or(""),
            )
        })
        .collect();
    assert!(strays.contains(&(vf1, "instance-3f01")), "{strays:?}");
    assert!(strays.contains(&(vf2, "instance-3f01")), "{strays:?}");
    assert!(strays.contains(&(vf3, "stopped-3f02")), "{strays:?}");

    // Another consumer may not take a VF a domain uses.
    let g = device(&mut c, vf1).await.generation;
    let err = c
        .claim(proto::ClaimRequest {
            vfio: false,
            owner: Some(owner(0x3f99)),
            request_id: uuid::Uuid::new_v4().to_string(),
            target: Some(proto::claim_request::Target::Address(proto::ByAddress {
                address: vf1.into(),
                expected_generation: g,
            })),
        })
        .await
        .expect_err("in use by a domain");
    assert_eq!(info(&err).0, "IN_USE_BY_DOMAIN");
    assert_eq!(info(&err).1["domain_name"], "instance-3f01");

    // The domain's own instance adopts it: attached at once.
    let mine = claim(&mut c, vf1, 0x3f01).await;
    let d = mine.device.expect("device");
    assert_eq!(d.state, ATTACHED);
    let err = release(&mut c, vf1, 0x3f01, mine.generation)
        .await
        .expect_err("attached");
    assert_eq!(info(&err).0, "ATTACHED");
    assert_eq!(info(&err).1["domain_name"], "instance-3f01");
    let rep = reconcile(&mut c, &[0x3f99], true).await.expect("reconcile");
    assert!(
        rep.orphans.is_empty() && rep.protected.len() == 1,
        "{rep:?}"
    );
    assert!(rep.protections[0].reason.contains("instance-3f01"));
    assert_eq!(device(&mut c, vf1).await.state, ATTACHED);
    let status = c
        .get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    let health = status.libvirt.expect("health");
    assert!(health.ok, "{health:?}");
    assert!(
        health.detail.contains("2 domains (1 running)"),
        "{health:?}"
    );
    let _ = &h.pf;
    assert!(
        maps(&child).contains("libvirt.so.0"),
        "the agent loads libvirt's client library once it queries"
    );

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let st = child.wait().expect("wait");
    assert!(
        st.success(),
        "{st}: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

/// Starts the real daemon binary on `h`'s tree with `libvirt` as its `[libvirt]` table and
/// waits for its socket: the child, the socket and the stderr log.
async fn spawn_hostdevd(
    h: &Host,
    dir: &Path,
    libvirt: &str,
) -> (std::process::Child, std::path::PathBuf, std::path::PathBuf) {
    let socket = dir.join("hostdevd.sock");
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        format!(
            "sysfs_root = {:?}\ndev_root = {:?}\nproc_root = {:?}\nstate_dir = {:?}\n\
             [api]\nsocket = {:?}\nsocket_mode = \"0600\"\nwriter_uids = [{}]\n\
             {libvirt}\
             [[devices]]\naddress = \"*:*:*.*\"\n",
            h.tree.sysfs_root(),
            h.tree.dev_root(),
            dir.join("proc"),
            dir.join("state"),
            socket,
            nix::unistd::getuid().as_raw(),
        ),
    )
    .expect("config");
    let log = dir.join("hostdevd.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_hostdevd"))
        .args(["serve", "--config"])
        .arg(&config)
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("spawn hostdevd");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!(
                "hostdevd exited with {st}:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "hostdevd did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (child, socket, log)
}

/// The files a running child has mapped (/proc/PID/maps).
fn maps(child: &std::process::Child) -> String {
    std::fs::read_to_string(format!("/proc/{}/maps", child.id())).expect("maps")
}

/// With `[libvirt] enabled = false` the agent serves without ever loading libvirt's client
/// library (nor the 56 libraries it pulls in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_with_libvirt_disabled_never_loads_it() {
    let h = host(0x3e, 160);
    let dir = tempfile::tempdir().expect("dir");
    let (mut child, socket, _log) =
        spawn_hostdevd(&h, dir.path(), "[libvirt]\nenabled = false\n").await;
    let mut c = hostdevd::client::connect(&socket).await.expect("connect");
    let status = c
        .get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert!(status.libvirt.is_some());
    let m = maps(&child);
    let _ = child.kill();
    let _ = child.wait();
    assert!(!m.contains("libvirt"), "libvirt mapped:\n{m}");
    assert!(!m.contains("libglib"), "glib mapped:\n{m}");
}

/// Polls GetDevice until `f` holds, or fails after 30 s.
async fn until_device(
    c: &mut Client,
    a: &str,
    what: &str,
    f: impl Fn(&proto::Device) -> bool,
) -> proto::Device {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let d = device(c, a).await;
        if f(&d) {
            return d;
        }
        assert!(Instant::now() < deadline, "{a}: never {what}: {d:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Ten minutes: in the tests below, anything that happens within their 30 s deadlines
/// happened because of an event, not a poll.
const NO_POLL_MS: u64 = 600_000;

/// Domain events, from the in-process test driver: with the poll ten minutes away, a
/// domain defined with the owner's UUID attaches its claim, starting it changes the
/// record, and undefining it takes the claim back to claimed, each at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn domain_events_attach_and_detach_between_polls() {
    let lv = test_driver();
    let h = host(0x40, 170);
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start(&h, proc_dir.path(), "test:///default", NO_POLL_MS).await;
    let mut c = s.client().await;
    let vf = h.vfs[1].as_str();
    claim(&mut c, vf, 0x4001).await;
    until_libvirt_says(&mut c, "domain events subscribed").await;
    until_events(&mut c, true, "subscribed on test:///default").await;

    let dom = lv
        .define_domain_xml(&domain_xml("instance-4001", 0x4001, &[vf], &[]))
        .expect("define");
    let d = until_device(&mut c, vf, "attached by the define event", |d| {
        d.state == ATTACHED
    })
    .await;
    assert!(!d.attached_domain.expect("domain").running);
    dom.create().expect("start");
    until_device(&mut c, vf, "running by the start event", |d| {
        d.attached_domain.as_ref().is_some_and(|a| a.running)
    })
    .await;
    dom.destroy().expect("stop");
    dom.undefine().expect("undefine");
    until_device(&mut c, vf, "claimed again by the undefine event", |d| {
        d.state == CLAIMED
    })
    .await;
    s.stop().await;
}

/// Events not wanted are healthy and say why: turned off with `[libvirt] events = false`
/// (the agent polls only, holds no subscription, and the gauge says 0), or libvirt
/// disabled altogether.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn domain_events_turned_off_are_healthy_and_say_why() {
    let h = host(0x42, 190);
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start_with(&h, proc_dir.path(), "test:///default", 200, |cfg| {
        cfg.libvirt.events = false;
    })
    .await;
    let mut c = s.client().await;
    until_events(&mut c, true, "off ([libvirt] events = false)").await;
    until_libvirt_says(&mut c, "domain events off").await;
    assert!(!s.metrics.libvirt_events_subscribed());
    s.stop().await;

    let s = start(&h, proc_dir.path(), "", 200).await;
    let mut c = s.client().await;
    until_events(&mut c, true, "[libvirt] enabled = false").await;
    assert!(!s.metrics.libvirt_events_subscribed());
    s.stop().await;
}

/// Domain events over libvirt's remote protocol (a real libvirtd): with the poll ten
/// minutes away, a define reaches the agent as an event; libvirtd's death reaches it
/// through the connection's close (libvirt unhealthy at once, frees refused); once
/// libvirtd is back the agent reconnects within its backoff, subscribes again, and the
/// next define reaches it as an event too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libvirtd_events_and_its_death_reach_the_agent_between_polls() {
    let mut lvd = support::libvirtd::Libvirtd::start();
    let uri = lvd.uri();
    let h = host(0x41, 180);
    let vf = h.vfs[1].clone();
    let holder = Connect::open(Some(uri.as_str())).expect("holder connection");
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start(&h, proc_dir.path(), &uri, NO_POLL_MS).await;
    let mut c = s.client().await;
    claim(&mut c, &vf, 0x4101).await;
    until_libvirt_says(&mut c, "domain events subscribed").await;
    let _dom = holder
        .define_domain_xml(&domain_xml("vm-4101", 0x4101, &[&vf], &[]))
        .expect("define");
    until_device(&mut c, &vf, "attached by the define event", |d| {
        d.state == ATTACHED
    })
    .await;

    until_events(&mut c, true, &format!("subscribed on {uri}")).await;
    // The metrics' gauge follows the subscription.
    assert!(s.metrics.libvirt_events_subscribed());

    lvd.kill();
    drop(holder);
    until_libvirt(&mut c, false).await;
    until_events(&mut c, false, "not subscribed").await;
    assert!(!s.metrics.libvirt_events_subscribed());

    lvd.restart();
    let holder = Connect::open(Some(uri.as_str())).expect("holder connection");
    until_libvirt_says(&mut c, "domain events subscribed").await;
    until_events(&mut c, true, "subscribed on").await;
    assert!(s.metrics.libvirt_events_subscribed());
    // The restarted test driver starts empty: the domain is gone, the claim detached.
    until_device(&mut c, &vf, "claimed once the domain is gone", |d| {
        d.state == CLAIMED
    })
    .await;
    let _dom = holder
        .define_domain_xml(&domain_xml("vm-4101", 0x4101, &[&vf], &[]))
        .expect("define again");
    until_device(&mut c, &vf, "attached by the next define event", |d| {
        d.state == ATTACHED
    })
    .await;
    drop(holder);
    s.stop().await;
}

/// Polls GetStatus until libvirt's health satisfies `f`, or fails after 30 s.
async fn until_health(c: &mut Client, what: &str, f: impl Fn(&proto::Health) -> bool) {
    until_status(c, "libvirt", |s| s.libvirt, what, f).await
}

/// Polls GetStatus until the health `which` picks (named `name`) satisfies `f`, or fails
/// after 30 s.
async fn until_status(
    c: &mut Client,
    name: &str,
    which: impl Fn(proto::AgentStatus) -> Option<proto::Health>,
    what: &str,
    f: impl Fn(&proto::Health) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = c
            .get_status(proto::GetStatusRequest {})
            .await
            .expect("status")
            .into_inner();
        let h = which(s).expect("health");
        if f(&h) {
            return;
        }
        assert!(Instant::now() < deadline, "{name} never {what}: {h:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Until libvirt's health is `ok`.
async fn until_libvirt(c: &mut Client, ok: bool) {
    until_health(c, &format!("healthy = {ok}"), |h| h.ok == ok).await;
}

/// Until the domain-event subscription's health is `ok` and its detail contains `needle`.
async fn until_events(c: &mut Client, ok: bool, needle: &str) {
    until_status(
        c,
        "libvirt_events",
        |s| s.libvirt_events,
        &format!("healthy = {ok} saying {needle:?}"),
        |h| h.ok == ok && h.detail.contains(needle),
    )
    .await;
}

/// Until libvirt is healthy and its detail contains `needle`.
async fn until_libvirt_says(c: &mut Client, needle: &str) {
    until_health(c, &format!("said {needle:?}"), |h| {
        h.ok && h.detail.contains(needle)
    })
    .await;
}

/// A libvirtd that takes calls and answers none (wedged; here stopped with SIGSTOP, so
/// that not even its keepalives go out for the 30 s the client's keepalive allows): the
/// agent's poll gives up after `[libvirt] timeout_ms` as a free's listing does, so the
/// health says so within seconds and a release is refused as libvirt unreachable, not
/// as the free checks being busy. Before, the poll waited inside libvirt holding the
/// lock every free takes, and the health said libvirt answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_libvirtd_that_stops_answering_is_seen_within_the_timeout() {
    let lvd = support::libvirtd::Libvirtd::start();
    let uri = lvd.uri();
    let h = host(0x47, 220);
    let holder = Connect::open(Some(&uri)).expect("holder connection");
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start_with(&h, proc_dir.path(), &uri, 100, |cfg| {
        cfg.libvirt.timeout_ms = 1000;
        cfg.libvirt.events = false;
    })
    .await;
    let mut c = s.client().await;
    let vf = h.vfs[1].clone();
    let claimed = claim(&mut c, &vf, 0x4701).await;
    until_libvirt(&mut c, true).await;
    let paused = lvd.pause();
    let t = Instant::now();
    until_libvirt(&mut c, false).await;
    let seen = t.elapsed();
    assert!(seen < Duration::from_secs(10), "{seen:?}");
    let err = release(&mut c, &vf, 0x4701, claimed.generation)
        .await
        .expect_err("libvirt does not answer");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(info(&err).0, "LIBVIRT_UNREACHABLE", "{err:?}");
    let d = device(&mut c, &vf).await;
    assert_eq!((d.state, d.generation), (CLAIMED, claimed.generation));
    // Answering again, it is used again.
    drop(paused);
    until_libvirt(&mut c, true).await;
    release(&mut c, &vf, 0x4701, claimed.generation)
        .await
        .expect("libvirt answers");
    drop(holder);
    s.stop().await;
}

/// A real libvirtd (session mode, its test driver) killed and restarted under the agent.
/// While it is down every free is refused with UNAVAILABLE and changes nothing, and an
/// attached device stays attached: a lost connection is not an empty domain list. Once
/// it is back the agent reconnects by itself, frees what no domain uses, and still
/// refuses what a domain uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libvirtd_killed_and_restarted_under_the_agent() {
    let mut lvd = support::libvirtd::Libvirtd::start();
    let uri = lvd.uri();
    let h = host(0x3e, 150);
    let (used, unused) = (h.vfs[1].clone(), h.vfs[2].clone());
    // The test driver's state lives while a connection holds it: this one, which also
    // defines and starts the domain that uses `used`.
    let define = |uri: &str| {
        let conn = Connect::open(Some(uri)).expect("holder connection");
        let dom = conn
            .define_domain_xml(&domain_xml("vm-3e", 0x3e01, &[&used], &[]))
            .expect("define");
        dom.create().expect("start");
        conn
    };
    let holder = define(&uri);
    let proc_dir = tempfile::tempdir().expect("proc");
    let s = start(&h, proc_dir.path(), &uri, 100).await;
    let mut c = s.client().await;
    claim(&mut c, &used, 0x3e01).await;
    claim(&mut c, &unused, 0x3e02).await;
    until_libvirt(&mut c, true).await;
    let attached = until_device(&mut c, &used, "attached", |d| d.state == ATTACHED).await;
    let idle = device(&mut c, &unused).await;
    assert_eq!(idle.state, CLAIMED);

    // libvirt crashes.
    lvd.kill();
    drop(holder);
    let err = release(&mut c, &unused, 0x3e02, idle.generation)
        .await
        .expect_err("libvirt is down");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(info(&err).0, "LIBVIRT_UNREACHABLE");
    // The ledger refuses it anyway, as attached: that refusal is the answer, not the
    // failed listing.
    let err = release(&mut c, &used, 0x3e01, attached.generation)
        .await
        .expect_err("attached, and libvirt is down");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let (reason, meta) = info(&err);
    assert_eq!(reason, "ATTACHED", "{err:?}");
    assert_eq!(meta["domain_name"], "vm-3e");
    let err = reconcile(&mut c, &[], true)
        .await
        .expect_err("no acting audit without libvirt");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    until_libvirt(&mut c, false).await;
    // Several poll intervals with libvirt down: nothing moved.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let d = device(&mut c, &used).await;
    assert_eq!((d.state, d.generation), (ATTACHED, attached.generation));
    let d = device(&mut c, &unused).await;
    assert_eq!((d.state, d.generation), (CLAIMED, idle.generation));

    // libvirt comes back (the test driver starts empty; the domain is defined again, as
    // a real libvirtd reloads its persistent domains).
    lvd.restart();
    let holder = define(&uri);
    until_libvirt(&mut c, true).await;
    let d = until_device(&mut c, &used, "attached again", |d| d.state == ATTACHED).await;
    let err = release(&mut c, &used, 0x3e01, d.generation)
        .await
        .expect_err("a running domain uses it");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(info(&err).1["domain_name"], "vm-3e");
    let g = device(&mut c, &unused).await.generation;
    release(&mut c, &unused, 0x3e02, g)
        .await
        .expect("libvirt is back and no domain uses it");
    assert_eq!(device(&mut c, &unused).await.state, FREE);
    drop(holder);
    s.stop().await;
}
