//! Prometheus metrics, scraped over HTTP from the real daemon binary after real claims
//! and real rejections, the ledger's and the service's own checks'.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hostdevd::api::proto;
use hostdevd::simhost::FakeSys;

mod support;

use support::{scrape, value, Daemon};

/// Spawns the daemon binary on `tree`, its state, socket (`hostdevd.sock`) and proc tree
/// (`proc`, empty until a test plants a holder in it) in `dir`, with its metrics on a
/// free loopback port: the daemon and that port.
fn spawn_with_metrics(tree: &hostdevd::simhost::FakeTree, dir: &std::path::Path) -> (Daemon, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("probe port")
        .port();
    let proc_root = dir.join("proc");
    std::fs::create_dir(&proc_root).expect("proc");
    let cfg = format!(
        "sysfs_root = {:?}\ndev_root = {:?}\nproc_root = {:?}\nstate_dir = {:?}\n[api]\nsocket = {:?}\n[libvirt]\nenabled = false\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n",
        tree.sysfs_root(),
        tree.dev_root(),
        proc_root,
        dir.join("state"),
        dir.join("hostdevd.sock"),
    );
    let cfg_path = dir.join("config.toml");
    std::fs::write(&cfg_path, cfg).expect("config");
    let daemon = Daemon(
        Command::new(env!("CARGO_BIN_EXE_hostdevd"))
            .args(["serve", "--config"])
            .arg(&cfg_path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start hostdevd"),
    );
    (daemon, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_states_requests_rejections_and_commits() {
    let mut f = FakeSys::new();
    f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 3)
        .vf_iommu_groups("0000:3b:00.0", 50);
    let tree = f.build();
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("hostdevd.sock");
    let proc_root = dir.path().join("proc");
    let (_d, port) = spawn_with_metrics(&tree, dir.path());
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut c = loop {
        match hostdevd::client::connect(&socket).await {
            Ok(c) => break c,
            Err(e) if Instant::now() > deadline => panic!("daemon did not start: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let before = scrape(port).expect("scrape");
    assert!(before.starts_with("HTTP/1.1 200"), "{before}");
    assert_eq!(
        value(&before, "hostdevd_devices{state=\"free\"}"),
        Some(3.0)
    );
    assert_eq!(
        value(&before, "hostdevd_devices{state=\"claimed\"}"),
        Some(0.0)
    );

    let list = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner();
    let vf = list
        .devices
        .iter()
        .find(|d| d.state == proto::DeviceState::Free as i32)
        .expect("free vf")
        .clone();
    let claim = |g: u64, r: &str| proto::ClaimRequest {
        vfio: false,
        owner: Some(proto::Owner {
            consumer_id: "00000000-0000-0000-0000-000000000001".into(),
            label: String::new(),
        }),
        request_id: r.into(),
        target: Some(proto::claim_request::Target::Address(proto::ByAddress {
            address: vf.address.clone(),
            expected_generation: g,
        })),
    };
    c.claim(claim(vf.generation, "m1")).await.expect("claim");
    c.claim(claim(vf.generation, "m2"))
        .await
        .expect_err("stale generation");

    let after = scrape(port).expect("scrape");
    assert_eq!(
        value(&after, "hostdevd_devices{state=\"claimed\"}"),
        Some(1.0)
    );
    assert_eq!(
        value(&after, "hostdevd_requests_total{op=\"claim\"}"),
        Some(1.0)
    );
    assert_eq!(
        value(
            &after,
            "hostdevd_rejections_total{reason=\"STALE_GENERATION\"}"
        ),
        Some(1.0)
    );
    let commits = value(&after, "hostdevd_store_commit_seconds_count").expect("histogram count");
    assert!(commits >= 2.0, "inventory and claim commits: {commits}");
    // The two claims were decided in place or, if the writer thread was busy, by it;
    // nothing else is ever decided in place.
    let inline = value(&after, "hostdevd_inline_requests_total").expect("in-place requests");
    assert!(inline <= 2.0, "{inline} in place, of two claims");
    assert_eq!(value(&after, "hostdevd_libvirt_up"), Some(0.0));
    assert_eq!(value(&after, "hostdevd_libvirt_events_total"), Some(0.0));
    assert_eq!(
        value(&after, "hostdevd_libvirt_events_subscribed"),
        Some(0.0)
    );
    // The claim is logged for retries (the refused one is not), and its change is kept
    // for resuming watchers.
    assert_eq!(value(&before, "hostdevd_request_log_entries"), Some(0.0));
    assert_eq!(value(&after, "hostdevd_request_log_entries"), Some(1.0));
    assert_eq!(value(&before, "hostdevd_request_log_in_memory"), Some(0.0));
    assert_eq!(value(&after, "hostdevd_request_log_in_memory"), Some(1.0));
    let kept = |t: &str| value(t, "hostdevd_watch_buffer_events").expect("ring events");
    assert!(kept(&after) > kept(&before), "{after}");
    let bytes = value(&after, "hostdevd_watch_buffer_bytes").expect("ring bytes");
    assert!(bytes > 0.0 && bytes <= 4194304.0, "{bytes}");
    assert!(after.contains("# TYPE hostdevd_store_commit_seconds histogram"));

    // Refusals the service's own checks decide are counted too: a release while a
    // process holds the VF's group open, and an audit snapshot from the future.
    let group = vf.iommu_group.expect("group");
    let node = tree.vfio_node(group);
    let holder = proc_root.join("77");
    std::fs::create_dir_all(holder.join("fd")).expect("holder");
    std::fs::write(holder.join("comm"), "qemu-system-x86\n").expect("comm");
    std::os::unix::fs::symlink(&node, holder.join("fd/3")).expect("fd");
    let now = c
        .get_device(proto::GetDeviceRequest {
            address: vf.address.clone(),
        })
        .await
        .expect("device")
        .into_inner()
        .device
        .expect("present");
    c.release(proto::ReleaseRequest {
        address: vf.address.clone(),
        owner: claim(0, "").owner,
        request_id: "m3".into(),
        generation: now.generation,
    })
    .await
    .expect_err("held open");
    let host = c
        .get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner()
        .host_generation;
    c.reconcile(proto::ReconcileRequest {
        expected_consumer_ids: vec![],
        snapshot_generation: host + 1,
        act: false,
        request_id: String::new(),
    })
    .await
    .expect_err("a snapshot from the future");
    let checked = scrape(port).expect("scrape");
    for reason in ["VFIO_GROUP_IN_USE", "SNAPSHOT_AHEAD"] {
        let series = format!("hostdevd_rejections_total{{reason=\"{reason}\"}}");
        assert_eq!(value(&checked, &series), Some(1.0), "{series}");
    }
}

#[test]
fn metrics_stay_on_loopback_unless_allowed() {
    let err = hostdevd::config::Config::parse("[metrics]\nlisten = \"0.0.0.0:9464\"\n")
        .expect_err("remote metrics without allow_remote");
    assert!(err.to_string().contains("allow_remote"), "{err}");
    hostdevd::config::Config::parse("[metrics]\nlisten = \"0.0.0.0:9464\"\nallow_remote = true\n")
        .expect("allowed explicitly");
}

/// The metrics listener holds at most 4 connections from one peer address: one more is
/// closed unanswered, and once one of the 4 closes a scrape is answered again. Before,
/// any local user could hold as many idle connections as the agent had descriptors,
/// which its frees' checks of `/proc` and its sysfs scans need.
#[test]
fn metrics_connections_are_capped_by_peer() {
    use std::io::Read;
    let tree = FakeSys::new().build();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_d, port) = spawn_with_metrics(&tree, dir.path());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !scrape(port).is_ok_and(|t| t.starts_with("HTTP/1.1 200")) {
        assert!(Instant::now() < deadline, "no metrics");
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut held: Vec<std::net::TcpStream> = (0..4)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect"))
        .collect();
    // Accepted, each holding its place (the agent takes them in turn).
    std::thread::sleep(Duration::from_millis(300));
    let mut over = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    over.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut got = Vec::new();
    let _ = over.read_to_end(&mut got);
    assert!(
        got.is_empty(),
        "the fifth was answered: {:?}",
        String::from_utf8_lossy(&got)
    );
    assert!(
        !scrape(port).is_ok_and(|t| t.starts_with("HTTP/1.1 200")),
        "a scrape over the cap"
    );
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !scrape(port).is_ok_and(|t| t.starts_with("HTTP/1.1 200")) {
        assert!(Instant::now() < deadline, "a place never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
}
