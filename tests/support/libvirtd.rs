//! A real libvirtd (Debian's libvirt-daemon) in session mode, run as the unprivileged
//! user `nobody` with its own config, socket and home in a temp dir, so that a test can
//! kill and restart libvirt under the agent. Clients reach its test driver at
//! `test+unix:///default?socket=DIR/libvirt-sock`; the driver's state lives while at
//! least one client connection is open.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LIBVIRTD: &str = "/usr/sbin/libvirtd";

pub struct Libvirtd {
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Libvirtd {
    /// Starts libvirtd and waits for its socket to accept a connection.
    pub fn start() -> Libvirtd {
        assert!(
            Path::new(LIBVIRTD).exists(),
            "{LIBVIRTD} is missing: install Debian's libvirt-daemon (scripts/deps.sh --tests)"
        );
        assert!(
            nix::unistd::Uid::effective().is_root(),
            "starting libvirtd as another user needs root (CI runs as root)"
        );
        let dir = tempfile::tempdir().expect("libvirtd dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        for sub in ["sock", "home", "run"] {
            std::fs::create_dir(dir.path().join(sub)).expect("mkdir");
        }
        std::fs::write(
            dir.path().join("libvirtd.conf"),
            format!(
                "unix_sock_dir = \"{}\"\nauth_unix_rw = \"none\"\nauth_unix_ro = \"none\"\nunix_sock_rw_perms = \"0777\"\nunix_sock_ro_perms = \"0777\"\n",
                dir.path().join("sock").display()
            ),
        )
        .expect("libvirtd.conf");
        let nobody = nix::unistd::User::from_name("nobody")
            .expect("passwd")
            .expect("the user nobody");
        for e in walk(dir.path()) {
            nix::unistd::chown(&e, Some(nobody.uid), Some(nobody.gid)).expect("chown");
        }
        let mut d = Libvirtd { dir, child: None };
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        let d = self.dir.path();
        let _ = std::fs::remove_file(self.socket());
        let log = std::fs::File::create(d.join("libvirtd.log")).expect("log");
        let nobody = nix::unistd::User::from_name("nobody")
            .expect("passwd")
            .expect("nobody");
        let _ = nix::unistd::chown(&d.join("libvirtd.log"), Some(nobody.uid), Some(nobody.gid));
        let child = Command::new("setpriv")
            .args([
                "--reuid=nobody",
                "--regid=nogroup",
                "--clear-groups",
                LIBVIRTD,
                "-f",
            ])
            .arg(d.join("libvirtd.conf"))
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("HOME", d.join("home"))
            .env("XDG_RUNTIME_DIR", d.join("run"))
            .env("XDG_CONFIG_HOME", d.join("home/.config"))
            .env("XDG_CACHE_HOME", d.join("home/.cache"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start libvirtd (setpriv from util-linux)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if virt::connect::Connect::open(Some(&self.uri())).is_ok() {
                return;
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!("libvirtd exited at start ({st}): {}", self.log());
                }
            }
            assert!(
                Instant::now() < deadline,
                "libvirtd never answered on {}: {}",
                self.socket().display(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("sock/libvirt-sock")
    }

    /// The URI of its test driver.
    pub fn uri(&self) -> String {
        format!("test+unix:///default?socket={}", self.socket().display())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("libvirtd.log")).unwrap_or_default()
    }

    /// Kills libvirtd with SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops it with SIGSTOP: its socket still accepts, and nothing is answered, not even
    /// the clients' keepalives (a libvirtd wedged), until the guard is dropped (a test
    /// that fails meanwhile must not hang closing its own connections).
    pub fn pause(&self) -> Paused<'_> {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
        Paused(self)
    }

    fn signal(&self, s: nix::sys::signal::Signal) {
        let c = self.child.as_ref().expect("libvirtd running");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(c.id()).expect("pid fits"));
        nix::sys::signal::kill(pid, s).expect("signal libvirtd");
    }

    /// Starts it again on the same socket (the test driver's state starts afresh).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

/// A paused libvirtd ([`Libvirtd::pause`]), let go on when dropped.
pub struct Paused<'a>(&'a Libvirtd);

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        self.0.signal(nix::sys::signal::Signal::SIGCONT);
    }
}

impl Drop for Libvirtd {
    fn drop(&mut self) {
        self.kill();
    }
}

fn walk(p: &Path) -> Vec<PathBuf> {
    let mut out = vec![p.to_path_buf()];
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            out.extend(walk(&e.path()));
        }
    }
    out
}
