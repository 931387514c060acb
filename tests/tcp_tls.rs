//! The optional TCP listener: the real daemon with mutual TLS, certificates made in the
//! test. A client with a certificate from the configured CA may list and claim; a client
//! without a certificate, or with one from another CA, never reaches an RPC. READY=1
//! reaches systemd only once the listener is set up.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hostdevd::api::proto::{self, host_dev_client::HostDevClient};
use hostdevd::simhost::FakeSys;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

mod support;

use support::{notifications, scrape, value, Daemon};

struct Pem {
    cert: String,
    key: String,
}

fn ca(name: &str) -> (Pem, Issuer<'static, KeyPair>) {
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    let key = KeyPair::generate().expect("ca key");
    let cert = p.self_signed(&key).expect("ca cert");
    let pem = Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    };
    (pem, Issuer::new(p, key))
}

fn leaf(names: &[&str], cn: &str, issuer: &Issuer<'static, KeyPair>) -> Pem {
    let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .expect("leaf params");
    p.distinguished_name.push(DnType::CommonName, cn);
    let key = KeyPair::generate().expect("leaf key");
    let cert = p.signed_by(&key, issuer).expect("sign leaf");
    Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("probe port");
    l.local_addr().expect("addr").port()
}

async fn connect(
    port: u16,
    ca: &Pem,
    client: Option<&Pem>,
) -> Result<HostDevClient<Channel>, String> {
    connect_from(None, port, ca, client).await
}

/// As [`connect`], from the local address `from` where one is given.
async fn connect_from(
    from: Option<std::net::IpAddr>,
    port: u16,
    ca: &Pem,
    client: Option<&Pem>,
) -> Result<HostDevClient<Channel>, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&ca.cert))
        .domain_name("localhost");
    if let Some(c) = client {
        tls = tls.identity(Identity::from_pem(&c.cert, &c.key));
    }
    let channel = Channel::from_shared(format!("https://127.0.0.1:{port}"))
        .map_err(|e| e.to_string())?
        .local_address(from)
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(HostDevClient::new(channel))
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write file");
    p
}

/// The real daemon with a TCP listener (mutual TLS, certificates made here) on a fake
/// host, its config followed by `extra` (TOML), limited to `open_files` descriptors
/// (through util-linux's `prlimit`) where one is given.
struct TlsAgent {
    _daemon: Daemon,
    port: u16,
    ca: Pem,
    /// Signed by the configured CA.
    client: Pem,
    /// Signed by another CA.
    rogue: Pem,
    _dir: tempfile::TempDir,
    _tree: hostdevd::simhost::FakeTree,
}

impl TlsAgent {
    fn start(extra: &str, open_files: Option<u32>) -> TlsAgent {
        TlsAgent::start_with(extra, "", "", open_files)
    }

    /// As [`TlsAgent::start`], with `api` and `tcp` (TOML) added to the `[api]` and
    /// `[api.tcp]` sections.
    fn start_with(extra: &str, api: &str, tcp: &str, open_files: Option<u32>) -> TlsAgent {
        let mut f = FakeSys::new();
        f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2)
            .vf_iommu_groups("0000:3b:00.0", 50);
        let tree = f.build();
        let dir = tempfile::tempdir().expect("tempdir");
        let (ca_pem, issuer) = ca("hostdevd test CA");
        let server = leaf(&["localhost"], "hostdevd", &issuer);
        let client = leaf(&[], "nova-compute", &issuer);
        let (_, rogue_issuer) = ca("someone else");
        let rogue = leaf(&[], "intruder", &rogue_issuer);
        let port = free_port();
        let cfg = format!(
            "sysfs_root = {:?}\ndev_root = {:?}\nstate_dir = {:?}\n{extra}\n[libvirt]\nenabled = false\n[api]\nsocket = {:?}\n{api}\n[api.tcp]\nlisten = \"127.0.0.1:{port}\"\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n{tcp}\n",
            tree.sysfs_root(),
            tree.dev_root(),
            dir.path().join("state"),
            dir.path().join("hostdevd.sock"),
            write(dir.path(), "server.pem", &server.cert),
            write(dir.path(), "server.key", &server.key),
            write(dir.path(), "ca.pem", &ca_pem.cert),
        );
        let cfg_path = write(dir.path(), "config.toml", &cfg);
        let mut cmd = support::hostdevd_limited(open_files);
        let daemon = Daemon(
            cmd.args(["serve", "--config"])
                .arg(&cfg_path)
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start hostdevd"),
        );
        TlsAgent {
            _daemon: daemon,
            port,
            ca: ca_pem,
            client,
            rogue,
            _dir: dir,
            _tree: tree,
        }
    }

    /// As [`TlsAgent::start_with`], with a metrics listener, whose port comes back too,
    /// and `tcp` in `[api.tcp]`.
    fn with_metrics(tcp: &str) -> (TlsAgent, u16) {
        let metrics = free_port();
        let extra = format!("[metrics]\nlisten = \"127.0.0.1:{metrics}\"");
        (TlsAgent::start_with(&extra, "", tcp, None), metrics)
    }

    /// A client with the CA-signed certificate, once the listener serves (30 s at most).
    async fn client(&self) -> HostDevClient<Channel> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match connect(self.port, &self.ca, Some(&self.client)).await {
                Ok(c) => return c,
                Err(e) if Instant::now() > deadline => panic!("daemon never served TLS: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_requires_a_client_certificate_from_the_configured_ca() {
    let a = TlsAgent::start("", None);
    let (port, ca_pem, rogue) = (a.port, &a.ca, &a.rogue);
    let mut c = a.client().await;
    let list = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list over mTLS")
        .into_inner();
    let vf = list
        .devices
        .iter()
        .find(|d| d.state == proto::DeviceState::Free as i32)
        .expect("a free VF")
        .clone();
    let claimed = c
        .claim(proto::ClaimRequest {
            vfio: false,
            owner: Some(proto::Owner {
                consumer_id: "00000000-0000-0000-0000-00000000002a".into(),
                label: "instance-0000002a".into(),
            }),
            request_id: "tcp-1".into(),
            target: Some(proto::claim_request::Target::Address(proto::ByAddress {
                address: vf.address.clone(),
                expected_generation: vf.generation,
            })),
        })
        .await
        .expect("a CA-signed client may mutate")
        .into_inner();
    assert!(claimed.generation > vf.generation);

    // No client certificate: the handshake (or the first call) fails; no RPC runs.
    match connect(port, ca_pem, None).await {
        Err(_) => {}
        Ok(mut anon) => {
            let r = anon.list_devices(proto::ListDevicesRequest {}).await;
            assert!(r.is_err(), "a client without a certificate was served");
        }
    }
    // A certificate from another CA: refused the same way.
    match connect(port, ca_pem, Some(rogue)).await {
        Err(_) => {}
        Ok(mut r) => {
            let res = r.list_devices(proto::ListDevicesRequest {}).await;
            assert!(
                res.is_err(),
                "a client with a foreign certificate was served"
            );
        }
    }
    // The claim made over TCP is still the only one.
    let after = c
        .list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner();
    let claimed_now = after.devices.iter().filter(|d| d.owner.is_some()).count();
    assert_eq!(claimed_now, 1);
}

/// An agent whose descriptors are all taken by TCP connections (a limit of 64, a flood
/// of 100 that never starts a handshake) pauses accepting on the TCP listener as on the
/// Unix socket (`tests/api_abuse.rs`): about one failed accept per 100 ms pause while the
/// flood is held, not one after another as fast as they fail. Once the flood closes, a
/// client with a certificate is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_flood_that_takes_every_descriptor_pauses_accepting() {
    const FLOOD: usize = 100;
    const HOLD: Duration = Duration::from_secs(2);
    let metrics = free_port();
    let a = TlsAgent::start(
        &format!("[metrics]\nlisten = \"127.0.0.1:{metrics}\""),
        Some(64),
    );
    let mut c = a.client().await;
    c.list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list over mTLS");
    drop(c);
    let failures = |text: &str| value(text, "hostdevd_accept_failures_total").expect("the counter");
    let at_start = failures(&scrape(metrics).expect("scrape"));
    let flood: Vec<std::net::TcpStream> = (0..FLOOD)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", a.port)).expect("connect"))
        .collect();
    tokio::time::sleep(HOLD).await;
    drop(flood);
    let mut c = a.client().await;
    c.list_devices(proto::ListDevicesRequest {})
        .await
        .expect("served again after the flood");
    let failed = failures(&scrape(metrics).expect("scrape after the flood")) - at_start;
    eprintln!("{failed} TCP accepts failed while {FLOOD} connections were held for {HOLD:?}");
    // About 20 with the pause (a slow machine makes fewer, never more); without it, the
    // accept loop fails as fast as it can retry.
    assert!(
        (1.0..=100.0).contains(&failed),
        "{failed} accepts failed while the flood held every descriptor for {HOLD:?} (expected 1 to 100)"
    );
}

/// The agent's gauge of open TCP connections, and its count of refused ones.
const OPEN: &str = "hostdevd_tcp_connections";
const REFUSED: &str = "hostdevd_tcp_connections_refused_total";

/// Waits (10 s at most) until the agent's metric `name`, scraped from its metrics port,
/// satisfies `ok`; `what` names what that shows.
async fn until_metric(metrics: u16, name: &str, ok: impl Fn(f64) -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = value(&scrape(metrics).expect("scrape"), name).expect(name);
        if ok(now) {
            return;
        }
        assert!(Instant::now() < deadline, "never {what}: {name} is {now}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One peer address holds at most `[api.tcp] max_connections_per_peer` connections,
/// counted from the accept: with 2, two clients are served, a third connection is closed
/// before its TLS handshake (counted in the metrics), and once one of the two closes a
/// new client is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_address_holds_at_most_its_tcp_connections() {
    let (a, metrics) = TlsAgent::with_metrics("max_connections_per_peer = 2");
    let list = |mut c: HostDevClient<Channel>| async move {
        c.list_devices(proto::ListDevicesRequest {})
            .await
            .map(|_| c)
    };
    let first = list(a.client().await)
        .await
        .expect("the first connection is served");
    let second = connect(a.port, &a.ca, Some(&a.client))
        .await
        .expect("a second connection");
    let second = list(second).await.expect("the second connection is served");
    let gauge = |name: &str| value(&scrape(metrics).expect("scrape"), name).expect(name);
    assert_eq!(gauge(OPEN), 2.0);
    // The third: closed before its handshake, so the connect (or its first call) fails.
    match connect(a.port, &a.ca, Some(&a.client)).await {
        Err(_) => {}
        Ok(third) => {
            let r = list(third).await;
            assert!(r.is_err(), "a third connection of the same peer was served");
        }
    }
    assert!(gauge(REFUSED) >= 1.0);
    assert_eq!(gauge(OPEN), 2.0);
    // A place comes back when its connection closes.
    drop(second);
    until_metric(
        metrics,
        OPEN,
        |n| n == 1.0,
        "the closed connection's place back",
    )
    .await;
    let again = connect(a.port, &a.ca, Some(&a.client))
        .await
        .expect("a connection once a place is free");
    list(again).await.expect("served once a place is free");
    list(first)
        .await
        .expect("the first connection is still served");
}

/// A connection that never sends its first TLS message is closed once
/// `[api.tcp] handshake_timeout_ms` has passed, and its place goes back: with one place
/// for the peer, the agent closes a silent connection that holds it, and a client with
/// a certificate is served after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_finishes_its_handshake_is_closed() {
    use std::io::Read;
    let (a, metrics) =
        TlsAgent::with_metrics("max_connections_per_peer = 1\nhandshake_timeout_ms = 300");
    drop(a.client().await);
    until_metric(metrics, OPEN, |n| n == 0.0, "the first client's place back").await;
    let mut silent = std::net::TcpStream::connect(("127.0.0.1", a.port)).expect("connect");
    until_metric(
        metrics,
        OPEN,
        |n| n == 1.0,
        "the silent connection accepted",
    )
    .await;
    // The agent closes the silent connection: the read ends instead of waiting (a
    // 30 s bound on the read, far past the 300 ms allowed).
    silent
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    let mut buf = [0u8; 16];
    let closed = match silent.read(&mut buf) {
        Ok(0) => true,
        Ok(n) => panic!("the agent sent {n} bytes to a client that never said hello"),
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    };
    assert!(closed, "the silent connection was never closed");
    let mut c = a.client().await;
    c.list_devices(proto::ListDevicesRequest {})
        .await
        .expect("served once the silent connection is gone");
}

/// The cap is per peer address, not for the listener: with one peer's two places held
/// (connections that have not begun their handshakes), a third from that address is
/// closed while one from another loopback address (127.0.0.2) is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_peer_address_has_places_of_its_own() {
    let (a, metrics) = TlsAgent::with_metrics("max_connections_per_peer = 2");
    let gauge = |name: &str| value(&scrape(metrics).expect("scrape"), name).expect(name);
    drop(a.client().await);
    until_metric(metrics, OPEN, |n| n == 0.0, "the first client's place back").await;
    let from = |ip: &str| {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(format!("{ip}:0").parse().expect("source"))
            .expect("bind the source address");
        socket.connect(([127, 0, 0, 1], a.port).into())
    };
    let _held = (
        from("127.0.0.1").await.expect("first"),
        from("127.0.0.1").await.expect("second"),
    );
    until_metric(
        metrics,
        OPEN,
        |n| n == 2.0,
        "the first address's two accepted",
    )
    .await;
    let refused = gauge(REFUSED);
    let _third = from("127.0.0.1")
        .await
        .expect("the kernel accepts the third");
    until_metric(metrics, REFUSED, |n| n > refused, "the third refused").await;
    let _other = from("127.0.0.2").await.expect("another address");
    until_metric(metrics, OPEN, |n| n == 3.0, "the other address's accepted").await;
    assert_eq!(
        gauge(REFUSED),
        refused + 1.0,
        "only the third connection of the first address was refused"
    );
}

/// Over TCP, each peer address has Watch streams of its own, as a uid does on the Unix
/// socket (`[api] max_watch_streams_per_uid`): with 1, a peer's second stream is refused
/// naming the peer, while another address (127.0.0.2) opens its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tcp_peer_has_watch_streams_of_its_own() {
    let a = TlsAgent::start_with("", "max_watch_streams_per_uid = 1", "", None);
    let watch = |mut c: HostDevClient<Channel>| async move {
        let r = c
            .watch(proto::WatchRequest {
                from_generation: 0,
                snapshot: true,
            })
            .await;
        (c, r)
    };
    let (c, first) = watch(a.client().await).await;
    let _first = first.expect("the first peer's stream");
    let (_c, second) = watch(c).await;
    let refused = second
        .map(|_| ())
        .expect_err("the first peer's second stream");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("for TCP peer 127.0.0.1"),
        "{}",
        refused.message()
    );
    let other = connect_from(Some([127, 0, 0, 2].into()), a.port, &a.ca, Some(&a.client))
        .await
        .expect("a client from another address");
    let (_other, theirs) = watch(other).await;
    theirs.expect("another peer's stream");
}

#[test]
fn tcp_without_tls_files_is_refused_at_config_time() {
    let err = hostdevd::config::Config::parse("[api.tcp]\nlisten = \"127.0.0.1:7443\"\n")
        .expect_err("TCP without TLS");
    assert!(err.to_string().contains("missing field"), "{err}");
}

/// READY=1 goes to systemd only once every listener is bound: a TCP listener whose
/// certificate cannot be read ends the start with an error and no READY, so systemd
/// reports a failed start instead of a ready service that stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_is_sent_only_after_the_tcp_listener_is_set_up() {
    let mut f = FakeSys::new();
    f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2)
        .vf_iommu_groups("0000:3b:00.0", 50);
    let tree = f.build();
    let dir = tempfile::tempdir().expect("tempdir");
    let notify_path = dir.path().join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).expect("notify socket");
    let socket = dir.path().join("hostdevd.sock");
    let base = format!(
        "sysfs_root = {:?}\ndev_root = {:?}\nstate_dir = {:?}\n[libvirt]\nenabled = false\n[api]\nsocket = {:?}\n",
        tree.sysfs_root(),
        tree.dev_root(),
        dir.path().join("state"),
        socket,
    );
    let daemon = |cfg_path: &Path| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hostdevd"));
        cmd.args(["serve", "--config"])
            .arg(cfg_path)
            .env("NOTIFY_SOCKET", &notify_path);
        cmd
    };

    // Without TCP the daemon says READY once it serves (the test sees what systemd would).
    let plain = write(dir.path(), "plain.toml", &base);
    let d = Daemon::serve(&mut daemon(&plain), &socket).await;
    let got = notifications(&notify, Duration::from_secs(10));
    assert!(got.iter().any(|m| m.contains("READY=1")), "{got:?}");
    d.terminate().await;

    // A TCP listener whose certificate is missing: the start fails, and no READY.
    let (ca_pem, issuer) = ca("hostdevd test CA");
    let missing = dir.path().join("no-such-cert.pem");
    let cfg = format!(
        "{base}[api.tcp]\nlisten = \"127.0.0.1:{}\"\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n",
        free_port(),
        missing,
        dir.path().join("no-such-key.pem"),
        write(dir.path(), "ca.pem", &ca_pem.cert),
    );
    let broken = write(dir.path(), "broken.toml", &cfg);
    let out = daemon(&broken)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("run hostdevd");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the start must fail: {stderr}");
    assert!(
        stderr.contains(&missing.display().to_string()),
        "fails on the certificate: {stderr}"
    );
    let got = notifications(&notify, Duration::from_millis(500));
    assert!(
        got.iter().all(|m| !m.contains("READY=1")),
        "READY was sent by a daemon that then failed to start: {got:?}"
    );

    // Files that read but make no TLS server: a client CA file holding a key and no
    // certificate. The start fails, naming the TLS set-up, and no READY; before, the
    // daemon said READY and the listener ended unseen at its first serve.
    let server = leaf(&["localhost"], "hostdevd", &issuer);
    let cfg = format!(
        "{base}[api.tcp]\nlisten = \"127.0.0.1:{}\"\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n",
        free_port(),
        write(dir.path(), "server.pem", &server.cert),
        write(dir.path(), "server.key", &server.key),
        write(dir.path(), "not-a-ca.pem", &ca_pem.key),
    );
    let broken = write(dir.path(), "no-ca.toml", &cfg);
    let mut child = daemon(&broken)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run hostdevd");
    let t = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if t.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("the daemon went on serving with a TLS set-up that cannot work");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("its output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the start must fail: {stderr}");
    assert!(
        stderr.contains("invalid TLS configuration"),
        "fails on the TLS set-up: {stderr}"
    );
    let got = notifications(&notify, Duration::from_millis(500));
    assert!(
        got.iter().all(|m| !m.contains("READY=1")),
        "READY was sent by a daemon whose TLS set-up fails: {got:?}"
    );
}
