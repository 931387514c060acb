//! Shared helpers for the integration tests: a fake sysfs tree builder and the lspci oracle.
//!
//! Each integration test file includes this with `mod support;`, and every file uses a
//! different subset, so unused items are expected here.
#![allow(dead_code, unused_imports)]

pub use hostdevd::simhost as fakesys;
pub mod fakekernel;
pub mod faultfs;
pub mod libvirtd;
pub mod lspci;
pub mod server;

pub use fakesys::{FakeSys, PfLayout};

/// A command that runs the `hostdevd` binary under test limited to `open_files`
/// descriptors, soft and hard, through util-linux's `prlimit`; without a limit, the
/// binary itself.
pub fn hostdevd_limited(open_files: Option<u32>) -> std::process::Command {
    let bin = env!("CARGO_BIN_EXE_hostdevd");
    match open_files {
        None => std::process::Command::new(bin),
        Some(n) => {
            let mut c = std::process::Command::new("prlimit");
            c.arg(format!("--nofile={n}:{n}")).arg("--").arg(bin);
            c
        }
    }
}

/// `GET /metrics` from the agent's metrics listener on 127.0.0.1:`port`: the whole
/// HTTP response.
pub fn scrape(port: u16) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// The value of one series (name and labels, exactly) in a scrape.
pub fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l[series.len()..].trim().parse().ok())
}

/// A child process (a daemon started by a test) that is killed and reaped when the
/// test ends, pass or fail.
pub struct Daemon(pub std::process::Child);

impl Daemon {
    /// Spawns `cmd` (`hostdevd serve`, or a wrapper that execs it) and waits until its
    /// socket accepts a connection; fails loudly if it exits first or takes over 30 s.
    pub async fn serve(cmd: &mut std::process::Command, socket: &std::path::Path) -> Daemon {
        let mut daemon = Daemon(
            cmd.stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::inherit())
                .spawn()
                .expect("start hostdevd"),
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if let Some(status) = daemon.0.try_wait().expect("try_wait") {
                panic!("hostdevd exited during start: {status}");
            }
            if hostdevd::client::connect(socket).await.is_ok() {
                return daemon;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "hostdevd did not answer on {} in 30 s",
                socket.display()
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Sends SIGTERM and waits up to 30 s for the daemon to exit; fails unless it exits
    /// successfully (a clean stop: calls drained, store closed).
    pub async fn terminate(mut self) {
        let pid = i32::try_from(self.0.id()).expect("pid fits");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("signal the daemon");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let status = loop {
            if let Some(s) = self.0.try_wait().expect("wait") {
                break s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "hostdevd did not stop on SIGTERM"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        assert!(status.success(), "exit status {status}");
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a daemon told systemd (`NOTIFY_SOCKET` bound to `sock`), read without waiting
/// longer than `wait` for the first datagram or 200 ms for each next: each as text.
pub fn notifications(
    sock: &std::os::unix::net::UnixDatagram,
    wait: std::time::Duration,
) -> Vec<String> {
    sock.set_read_timeout(Some(wait)).expect("read timeout");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = sock.recv(&mut buf) {
        got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        sock.set_read_timeout(Some(std::time::Duration::from_millis(200)))
            .expect("read timeout");
    }
    got
}

/// The datagrams a daemon sends systemd up to and including the first that says
/// READY=1; fails loudly after 30 s without one.
pub fn notifications_until_ready(sock: &std::os::unix::net::UnixDatagram) -> Vec<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "no READY=1 within 30 s; got {got:?}");
        sock.set_read_timeout(Some(left)).expect("read timeout");
        match sock.recv(&mut buf) {
            Ok(n) => {
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                let ready = text.lines().any(|l| l == "READY=1");
                got.push(text);
                if ready {
                    return got;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!("no READY=1 within 30 s ({e}); got {got:?}"),
        }
    }
}

/// A config for a daemon on `tree` with libvirt off: its socket at
/// `<dir>/hostdevd.sock`, its state in `state`, then `extra` (more TOML).
pub fn config_in(
    tree: &hostdevd::simhost::FakeTree,
    dir: &std::path::Path,
    state: &std::path::Path,
    extra: &str,
) -> String {
    format!(
        "sysfs_root = {:?}\ndev_root = {:?}\nstate_dir = {:?}\n[api]\nsocket = {:?}\n\
         [libvirt]\nenabled = false\n{extra}",
        tree.sysfs_root(),
        tree.dev_root(),
        state,
        dir.join("hostdevd.sock"),
    )
}

impl Daemon {
    /// Starts `hostdevd serve` on `<dir>/config.toml` (see [`config_in`]); returns it and
    /// a client once it answers.
    pub async fn serve_in(dir: &std::path::Path) -> (Daemon, hostdevd::client::Client) {
        let socket = dir.join("hostdevd.sock");
        let daemon = Daemon::serve(
            std::process::Command::new(env!("CARGO_BIN_EXE_hostdevd"))
                .args(["serve", "--config"])
                .arg(dir.join("config.toml")),
            &socket,
        )
        .await;
        let c = hostdevd::client::connect(&socket).await.expect("connect");
        (daemon, c)
    }
}

/// Owner `n`: consumer uuid `n`, label `vm-<n>`.
pub fn owner(n: u128) -> hostdevd::api::proto::Owner {
    hostdevd::api::proto::Owner {
        consumer_id: uuid::Uuid::from_u128(n).to_string(),
        label: format!("vm-{n}"),
    }
}

/// The recorded outcome of request `request_id` of consumer `consumer_id`, which must
/// have one.
pub async fn request_outcome(
    c: &mut hostdevd::client::Client,
    consumer_id: String,
    request_id: String,
) -> hostdevd::api::proto::RequestOutcome {
    let asked = hostdevd::api::proto::GetRequestOutcomeRequest {
        consumer_id,
        request_id,
    };
    let what = format!("the outcome of {asked:?}");
    c.get_request_outcome(asked)
        .await
        .expect(&what)
        .into_inner()
}

/// The present device at `a`.
pub async fn device(c: &mut hostdevd::client::Client, a: &str) -> hostdevd::api::proto::Device {
    c.get_device(hostdevd::api::proto::GetDeviceRequest { address: a.into() })
        .await
        .expect("get")
        .into_inner()
        .device
        .expect("present")
}
