//! The daemon's signals, on the real binary: SIGHUP reloads the managed-device selection
//! (a broken config is refused and the old selection stays), SIGTERM drains and exits
//! cleanly, removing the socket; the modes of the socket and the state files; a client
//! that outlives the daemon's restart; and a failed start that ends the process.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;

use hostdevd::api::proto;
use hostdevd::simhost::FakeSys;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

mod support;

use support::{notifications_until_ready, Daemon};

fn signal(daemon: &Daemon, s: Signal) {
    let pid = i32::try_from(daemon.0.id()).expect("pid fits");
    kill(Pid::from_raw(pid), s).expect("signal the daemon");
}

fn config(tree: &hostdevd::simhost::FakeTree, dir: &Path, pfs: &[&str]) -> String {
    let mut s = format!(
        "sysfs_root = {:?}\ndev_root = {:?}\nstate_dir = {:?}\n[api]\nsocket = {:?}\n",
        tree.sysfs_root(),
        tree.dev_root(),
        dir.join("state"),
        dir.join("hostdevd.sock"),
    );
    for pf in pfs {
        s.push_str(&format!("[[devices]]\npf_name = \"{pf}\"\nvf = true\n"));
    }
    s
}

/// Runs `hostdevd serve` once on a config file holding `text` (in `dir`): its exit code
/// and what it wrote to stderr.
fn serve_with(dir: &Path, text: &str) -> (Option<i32>, String) {
    let path = dir.join("bad.toml");
    std::fs::write(&path, text).expect("config");
    let out = Command::new(env!("CARGO_BIN_EXE_hostdevd"))
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn managed(socket: &Path) -> Vec<String> {
    let mut c = hostdevd::client::connect(socket).await.expect("connect");
    let list = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner();
    list.devices
        .into_iter()
        .filter(|d| d.managed)
        .map(|d| d.address)
        .collect()
}

/// Runs `cmd CONFIG` (the daemon, or a wrapper that execs it) until its socket answers.
async fn serve(cmd: &mut Command, cfg_path: &Path, socket: &Path) -> Daemon {
    Daemon::serve(cmd.arg(cfg_path), socket).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_selection_and_sigterm_stops_cleanly() {
    let mut f = FakeSys::new();
    f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2)
        .netdev("0000:3b:00.0", "ens1f0");
    f.pf("0000:86:00.0", 0x8086, 0x1572, 8, 2)
        .netdev("0000:86:00.0", "ens2f0");
    let tree = f.build();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg_path = dir.path().join("config.toml");
    std::fs::write(&cfg_path, config(&tree, dir.path(), &["ens1f0"])).expect("config");
    let socket = dir.path().join("hostdevd.sock");
    // What systemd would be told: READY once serving, and each reload's start and end.
    let notify_path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("notify socket");
    let daemon = serve(
        Command::new(env!("CARGO_BIN_EXE_hostdevd"))
            .env("NOTIFY_SOCKET", &notify_path)
            .args(["serve", "--config"]),
        &cfg_path,
        &socket,
    )
    .await;
    let started = notifications_until_ready(&notify);
    assert!(
        started.iter().all(|m| !m.contains("RELOADING=1")),
        "{started:?}"
    );
    let first = managed(&socket).await;
    assert_eq!(first.len(), 2, "only ens1f0's VFs: {first:?}");
    assert!(first.iter().all(|a| a.starts_with("0000:3b:")));

    // A broken config on reload is refused; the selection stays, and systemd is told
    // the reload began (with the monotonic clock systemd 253 matches it by) and how it
    // ended.
    std::fs::write(&cfg_path, "[[devices]]\nvendor = \"8086\"\n").expect("broken config");
    signal(&daemon, Signal::SIGHUP);
    let refused = notifications_until_ready(&notify).join("\n");
    let lines: Vec<&str> = refused.lines().collect();
    let at = |what: &str| lines.iter().position(|l| l.starts_with(what));
    let (began, done) = (at("RELOADING=1"), at("READY=1"));
    assert!(began.is_some() && began < done, "{lines:?}");
    assert!(at("MONOTONIC_USEC=").is_some(), "{lines:?}");
    let status = lines
        .iter()
        .find(|l| l.starts_with("STATUS="))
        .unwrap_or_else(|| panic!("no STATUS= after the reload: {lines:?}"));
    assert!(
        status.contains("reload refused") && status.contains("unknown field `vendor`"),
        "the status names the refusal and its reason: {status}"
    );
    assert_eq!(managed(&socket).await, first);

    // A good one is applied without a restart, and said to be.
    std::fs::write(&cfg_path, config(&tree, dir.path(), &["ens1f0", "ens2f0"])).expect("config");
    signal(&daemon, Signal::SIGHUP);
    let applied = notifications_until_ready(&notify).join("\n");
    assert!(applied.contains("RELOADING=1"), "{applied}");
    assert!(
        applied.contains("STATUS=serving; reloaded the device selection"),
        "{applied}"
    );
    assert_eq!(
        managed(&socket).await.len(),
        4,
        "READY=1 comes after the rescan"
    );

    daemon.terminate().await;
    assert!(!socket.exists(), "socket removed on a clean stop");
    // The agent waits for its writer thread to close the store, and closing copies the
    // write-ahead log into the database and removes it.
    let state = dir.path().join("state");
    assert!(state.join("hostdevd.db").exists(), "the database stays");
    assert!(
        !state.join("hostdevd.db-wal").exists(),
        "a clean stop closes the store: its write-ahead log is copied back and removed"
    );
}

/// A stop waits for the calls being answered, not for streams a client keeps open: a
/// health Watch (which ends only with the server) and a HostDev Watch whose reader never
/// reads again are left open, and SIGTERM still ends the agent within seconds, its store
/// closed. Before, the stop waited for them without end (systemd's stop timeout, then
/// SIGKILL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_does_not_wait_for_streams_left_open() {
    use tokio_stream::StreamExt;
    let mut f = FakeSys::new();
    f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2)
        .netdev("0000:3b:00.0", "ens1f0");
    let tree = f.build();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg_path = dir.path().join("config.toml");
    std::fs::write(&cfg_path, config(&tree, dir.path(), &["ens1f0"])).expect("config");
    let socket = dir.path().join("hostdevd.sock");
    let daemon = serve(
        Command::new(env!("CARGO_BIN_EXE_hostdevd")).args(["serve", "--config"]),
        &cfg_path,
        &socket,
    )
    .await;
    let transport = hostdevd::client::connect_transport(&socket)
        .await
        .expect("connect");
    let mut health = tonic_health::pb::health_client::HealthClient::new(transport);
    let mut health_watch = health
        .watch(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health watch")
        .into_inner();
    let first = health_watch.next().await.expect("a status").expect("ok");
    assert_eq!(
        first.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let mut c = hostdevd::client::connect(&socket).await.expect("connect");
    let _watch = c
        .watch(proto::WatchRequest {
            from_generation: 0,
            snapshot: true,
        })
        .await
        .expect("watch")
        .into_inner();
    let t = std::time::Instant::now();
    daemon.terminate().await;
    assert!(
        t.elapsed() < std::time::Duration::from_secs(20),
        "{:?}",
        t.elapsed()
    );
    assert!(!socket.exists(), "socket removed on a clean stop");
    assert!(
        !dir.path().join("state/hostdevd.db-wal").exists(),
        "the store closed"
    );
    drop(health_watch);
}

/// The socket and the state files have their intended modes whatever the umask: the
/// daemon runs here under umask 000, so every mode below is set by hostdevd itself.
/// The ledger names every consumer on the host, so it is owner-only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_and_state_files_have_their_modes_under_any_umask() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let mut f = FakeSys::new();
    f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2)
        .netdev("0000:3b:00.0", "ens1f0");
    let tree = f.build();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg_path = dir.path().join("config.toml");
    let mut cfg = config(&tree, dir.path(), &["ens1f0"]);
    cfg = cfg.replace("[api]\n", "[api]\nsocket_mode = \"0660\"\n");
    // No libvirt here: with one configured that never answers, claims would wait for it.
    cfg.push_str("[libvirt]\nenabled = false\n");
    std::fs::write(&cfg_path, cfg).expect("config");
    let socket = dir.path().join("hostdevd.sock");
    let _daemon = serve(
        Command::new("sh")
            .arg("-c")
            .arg("umask 000 && exec \"$0\" serve --config \"$1\"")
            .arg(env!("CARGO_BIN_EXE_hostdevd")),
        &cfg_path,
        &socket,
    )
    .await;
    // One claim, so that the write-ahead log and its index exist.
    let mut c = hostdevd::client::connect(&socket).await.expect("connect");
    let list = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner();
    let vf = list
        .devices
        .iter()
        .find(|d| d.managed)
        .expect("a managed VF");
    c.claim(proto::ClaimRequest {
        owner: Some(proto::Owner {
            consumer_id: uuid::Uuid::from_u128(1).to_string(),
            label: "vm-1".into(),
        }),
        request_id: "modes".into(),
        target: Some(proto::claim_request::Target::Address(proto::ByAddress {
            address: vf.address.clone(),
            expected_generation: vf.generation,
        })),
        vfio: false,
    })
    .await
    .expect("claim");
    let mode = |p: &Path| {
        std::fs::metadata(p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .permissions()
            .mode()
            & 0o7777
    };
    assert!(std::fs::metadata(&socket)
        .expect("socket")
        .file_type()
        .is_socket());
    let state = dir.path().join("state");
    let want = [
        (socket.clone(), 0o660),
        (state.clone(), 0o750),
        (state.join("hostdevd.lock"), 0o640),
        (state.join("hostdevd.db"), 0o600),
        (state.join("hostdevd.db-wal"), 0o600),
    ];
    // The database is the agent's alone (EXCLUSIVE locking): its WAL index lives in the
    // agent's memory, so no shared-memory file is made for others to read.
    assert!(
        !state.join("hostdevd.db-shm").exists(),
        "no -shm file beside an exclusively locked database"
    );
    let got: Vec<(PathBuf, u32)> = want.iter().map(|(p, _)| (p.clone(), mode(p))).collect();
    assert_eq!(
        got.iter()
            .map(|(p, m)| format!("{} {m:o}", p.display()))
            .collect::<Vec<_>>(),
        want.iter()
            .map(|(p, m)| format!("{} {m:o}", p.display()))
            .collect::<Vec<_>>()
    );
}

/// A start refused for its configuration exits 78 (EX_CONFIG, which the unit does not
/// restart on) with a message naming the key, before anything is loaded or written: an
/// unknown key, a value out of range, a log filter that would silence the agent, and a
/// socket group the host lacks (looked up first, not after the ledger and the scan).
#[test]
fn a_refused_configuration_exits_78_naming_the_key_and_writes_nothing() {
    let mut f = FakeSys::new();
    f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2);
    let tree = f.build();
    let dir = tempfile::tempdir().expect("tmp");
    let base = config(&tree, dir.path(), &[]);
    for (extra, names) in [
        (
            "[hotplug]\nreceive_buffer_bytes = 4294967296\n",
            "hotplug.receive_buffer_bytes",
        ),
        ("[log]\nfilter = \"infoo\"\n", "log.filter"),
        ("[libvirt]\nenabled = false\nbogus = 1\n", "bogus"),
    ] {
        let (code, stderr) = serve_with(dir.path(), &format!("{base}{extra}"));
        assert_eq!(code, Some(78), "{extra}: {stderr}");
        assert!(stderr.contains(names), "{extra}: {stderr}");
    }
    // The group: the key is in [api], after the socket the base config sets.
    let text = base.replace(
        "[api]\n",
        "[libvirt]\nenabled = false\n[hotplug]\nenabled = false\n[api]\nsocket_group = \"no-such-group-here\"\n",
    );
    let (code, stderr) = serve_with(dir.path(), &text);
    assert_eq!(code, Some(78), "{stderr}");
    assert!(stderr.contains("api.socket_group"), "{stderr}");
    assert!(
        !dir.path().join("state").exists(),
        "nothing was loaded or written before the group was looked up"
    );
}

/// A client (and its clone) outlives the agent's restart: with the agent gone, a call
/// fails as UNAVAILABLE, and so does the next one while none listens; once the agent is
/// back, the next calls of both, made at once, go out on a new connection, and the
/// agent is left with one connection open for the client and its clone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_connects_again_once_the_agent_is_back() {
    let mut f = FakeSys::new();
    f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2);
    let tree = f.build();
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("hostdevd.sock");
    let cfg_path = dir.path().join("config.toml");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("probe port")
        .port();
    let mut cfg = config(&tree, dir.path(), &[]);
    cfg.push_str(&format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"));
    std::fs::write(&cfg_path, cfg).expect("config");
    let hostdevd = || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hostdevd"));
        cmd.args(["serve", "--config"]);
        cmd
    };
    // On the client itself, not a clone per call: each keeps the connection it used.
    async fn status(c: &mut hostdevd::client::Client) -> Result<u64, tonic::Status> {
        c.get_status(proto::GetStatusRequest {})
            .await
            .map(|s| s.into_inner().host_generation)
    }
    let daemon = serve(&mut hostdevd(), &cfg_path, &socket).await;
    let mut c = hostdevd::client::connect(&socket).await.expect("connect");
    let mut other = c.clone();
    let first = status(&mut c).await.expect("the first agent answers");
    daemon.terminate().await;
    for _ in 0..2 {
        let e = status(&mut c).await.expect_err("no agent");
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    }
    let daemon = serve(&mut hostdevd(), &cfg_path, &socket).await;
    let (second, again) = tokio::join!(status(&mut c), status(&mut other));
    let second = second.expect("the second agent answers on a new connection");
    assert!(
        second > first,
        "{second} after {first}: a restart raises it"
    );
    assert_eq!(again.expect("the clone too"), second, "the same agent");
    for _ in 0..3 {
        status(&mut c).await.expect("again");
        status(&mut other).await.expect("again");
    }
    // The connection the readiness probe made closes on its own; the client's stays,
    // one for the client and its clone.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let open = support::scrape(port)
            .ok()
            .and_then(|t| support::value(&t, "hostdevd_connections"));
        if open == Some(1.0) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "connections open: {open:?}, not the client's one"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    status(&mut c).await.expect("still answered");
    daemon.terminate().await;
}

/// A start that fails after a blocking task got stuck (here a libvirt that accepts the
/// connection and never answers, then a metrics port already taken) still ends the
/// process, so that systemd can start it again: the runtime is shut down with a limit
/// on the error path as on a clean stop. Before, the process stayed up without a socket,
/// waiting for that task without end.
#[test]
fn a_failed_start_ends_the_process_while_libvirt_never_answers() {
    let mut f = FakeSys::new();
    f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2);
    let tree = f.build();
    let dir = tempfile::tempdir().expect("tmp");
    let silent = dir.path().join("libvirt-sock");
    let listener = std::os::unix::net::UnixListener::bind(&silent).expect("bind");
    // Accepts every connection and keeps it open, reading nothing and answering nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming().flatten() {
            held.push(s);
        }
    });
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = taken.local_addr().expect("addr").port();
    let text = format!(
        "{}[libvirt]\nuri = \"qemu+unix:///system?socket={}\"\ntimeout_ms = 300\nevents = false\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n",
        config(&tree, dir.path(), &[]),
        silent.display(),
    );
    let path = dir.path().join("stuck.toml");
    std::fs::write(&path, text).expect("config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_hostdevd"))
        .args(["serve", "--config"])
        .arg(&path)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the daemon did not exit within 60 s of a failed start");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr)
        .expect("stderr");
    assert!(!status.success(), "{status:?}: {stderr}");
    assert!(
        stderr.contains("libvirt did not answer at start"),
        "the listing was stuck, not refused: {stderr}"
    );
    assert!(
        stderr.contains(&port.to_string()),
        "the metrics port named: {stderr}"
    );
    drop(taken);
}
