//! End-to-end tests of the `hostdevctl` CLI against the real `hostdevd serve` binary on a
//! simulated host: every subcommand's text and JSON output, refusals and exit statuses.

// Tests fail by panicking, with the value in the message.
#![allow(clippy::unwrap_used)]

use std::io::ErrorKind;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use hostdevd::simhost::{FakeSys, FakeTree};
use serde_json::Value;

const PF: &str = "0000:3b:00.0";
const NVME: &str = "0000:00:04.0";
const INSTANCE: &str = "5f0c2d4e-8a52-4c1b-9d6e-0a1b2c3d4e5f";
const OTHER: &str = "0b9f7c1e-3d2a-4e5f-8a6b-7c8d9e0f1a2b";

/// A running daemon on its own fake tree, socket and state dir; killed on drop.
struct Agent {
    child: Child,
    /// What `hostdevd` was started with, to start it again.
    args: Vec<std::ffi::OsString>,
    socket: PathBuf,
    log: PathBuf,
    vfs: Vec<String>,
    tree: FakeTree,
    /// The agent's proc tree: empty unless a test plants a VFIO holder in it.
    proc: PathBuf,
    _dir: tempfile::TempDir,
}

impl Agent {
    /// One i40e PF with 4 iavf VFs on NUMA node 1, and an NVMe controller (unmanaged).
    fn start() -> Agent {
        Self::start_with(nix::unistd::getuid().as_raw(), "")
    }

    fn start_with_writer(writer_uid: u32) -> Agent {
        Self::start_with(writer_uid, "")
    }

    /// [`Agent::start`] with `writer_uid` the one uid allowed to mutate, and `config`
    /// (TOML) as its config file, under the command line's settings.
    fn start_with(writer_uid: u32, config: &str) -> Agent {
        let mut f = FakeSys::new();
        f.pf(PF, 0x8086, 0x1572, 64, 4)
            .driver(PF, "i40e")
            .netdev(PF, "ens1f0")
            .numa(PF, 1)
            .iommu_group(PF, 20)
            .vf_driver(PF, "iavf")
            .vf_iommu_groups(PF, 21);
        f.device(NVME, 0x8086, 0x0953)
            .class(NVME, 0x010802)
            .driver(NVME, "nvme");
        let vfs = f.vfs(PF).iter().map(|a| a.to_string()).collect();
        let tree = f.build();
        let dir = tempfile::Builder::new()
            .prefix("hostdevctl")
            .tempdir()
            .unwrap();
        let socket = dir.path().join("hostdevd.sock");
        let log = dir.path().join("hostdevd.log");
        let proc = dir.path().join("proc");
        // The boot's id, as the kernel shows it: a restart within it compares what it
        // scans with what the last run recorded.
        std::fs::create_dir_all(proc.join("sys/kernel/random")).unwrap();
        std::fs::write(
            proc.join("sys/kernel/random/boot_id"),
            "1f0c2b5e-8d1a-4c3e-9f27-6a5b4c3d2e1f\n",
        )
        .unwrap();
        let config_path = dir.path().join("config.toml");
        std::fs::write(&config_path, config).unwrap();
        let args: Vec<std::ffi::OsString> = vec![
            "serve".into(),
            "--config".into(),
            config_path.into(),
            "--sysfs-root".into(),
            tree.sysfs_root().into(),
            "--dev-root".into(),
            tree.dev_root().into(),
            "--proc-root".into(),
            proc.clone().into(),
            "--state-dir".into(),
            dir.path().join("state").into(),
            "--socket".into(),
            socket.clone().into(),
            "--writer-uid".into(),
            writer_uid.to_string().into(),
            // In-process test driver: no libvirtd, and no domain references a VF.
            "--libvirt-uri".into(),
            "test:///default".into(),
        ];
        std::fs::File::create(&log).unwrap();
        let child = spawn_agent(&args, &log);
        let mut agent = Agent {
            child,
            args,
            socket,
            log,
            vfs,
            tree,
            proc,
            _dir: dir,
        };
        agent.wait_ready();
        agent
    }

    /// Stops the agent (SIGTERM) and starts it again on the same state, tree and socket.
    fn restart(&mut self) {
        self.restart_after(|_| {});
    }

    /// [`Agent::restart`], doing `meanwhile` to the tree while the agent is stopped.
    fn restart_after(&mut self, meanwhile: impl FnOnce(&FakeTree)) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "hostdevd stopped with {status}");
        meanwhile(&self.tree);
        self.child = spawn_agent(&self.args, &self.log);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("hostdevd exited with {status}:\n{}", self.log_text());
            }
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "hostdevd did not listen on {} in 20 s:\n{}",
                self.socket.display(),
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Asks the daemon to rescan (SIGHUP) and waits until `done` holds.
    fn rescan_until(&self, what: &str, done: impl Fn(&Agent) -> bool) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(self) {
            assert!(
                Instant::now() < deadline,
                "no {what} after SIGHUP:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn vf(&self, i: usize) -> &str {
        &self.vfs[i]
    }

    /// Runs hostdevctl against this agent.
    fn ctl(&self, args: &[&str]) -> Run {
        ctl_at(&self.socket, args)
    }

    /// Runs hostdevctl and expects success; returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let r = self.ctl(args);
        assert_eq!(
            r.code,
            0,
            "hostdevctl {args:?} failed: {}\n{}",
            r.stderr,
            self.log_text()
        );
        r.stdout
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.ok(&all);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
    }

    fn generation(&self, address: &str) -> u64 {
        self.json(&["show", address])["device"]["generation"]
            .as_u64()
            .unwrap()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `hostdevd` with `args`, its log appended to `log`.
fn spawn_agent(args: &[std::ffi::OsString], log: &Path) -> Child {
    let log = std::fs::OpenOptions::new().append(true).open(log).unwrap();
    Command::new(env!("CARGO_BIN_EXE_hostdevd"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl From<Output> for Run {
    fn from(o: Output) -> Run {
        Run {
            code: o
                .status
                .code()
                .unwrap_or_else(|| panic!("hostdevctl killed by signal {:?}", o.status.signal())),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

fn ctl_at(socket: &Path, args: &[&str]) -> Run {
    let child = Command::new(env!("CARGO_BIN_EXE_hostdevctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env_remove("HOSTDEVD_SOCKET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // No command may hang a test: watch gets --count, everything else answers at once.
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(out) => out.unwrap().into(),
        Err(_) => {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            panic!("hostdevctl {args:?} did not finish in 30 s");
        }
    }
}

/// The one line hostdevctl prints on stderr for a refusal.
fn refusal(r: &Run, code: i32) -> String {
    assert_eq!(r.code, code, "expected exit {code}: {r:?}");
    let lines: Vec<&str> = r
        .stderr
        .lines()
        .filter(|l| {
            !l.starts_with("hostdevctl: claiming") && !l.starts_with("hostdevctl: changing")
        })
        .collect();
    assert_eq!(lines.len(), 1, "expected one error line: {r:?}");
    assert!(lines[0].starts_with("hostdevctl: "), "{r:?}");
    lines[0].to_string()
}

#[test]
fn list_shows_the_pf_tree_in_text_and_json() {
    let a = Agent::start();
    let text = a.ok(&["list"]);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("host generation "), "{text}");
    assert!(lines[1].starts_with("ADDRESS"), "{text}");
    for col in ["STATE", "GEN", "NUMA", "DRIVER", "OWNER"] {
        assert!(lines[1].contains(col), "{text}");
    }
    // Tree order: the NVMe controller, the PF, then its VFs indented under it.
    let addr_col: Vec<&str> = lines[2..]
        .iter()
        .map(|l| l.split("  ").next().unwrap_or(""))
        .collect();
    assert!(lines[2].starts_with(NVME), "{text}");
    assert!(lines[3].starts_with(PF), "{text}");
    for i in 0..4 {
        let l = lines[4 + i];
        assert!(
            l.starts_with(&format!("  {}", a.vf(i))),
            "VF {i} not under its PF:\n{text}"
        );
        let cells: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(&cells[1..5], &["free", cells[2], "1", "iavf"][..], "{l}");
    }
    assert_eq!(addr_col.len(), 6, "{text}");
    assert!(
        lines[3].contains("unmanaged") && lines[3].contains("i40e"),
        "{text}"
    );

    let j = a.json(&["list"]);
    let host_gen = j["host_generation"].as_u64().unwrap();
    let devices = j["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 6);
    assert!(lines[0].contains(&host_gen.to_string()), "{text}");
    let vf0 = devices.iter().find(|d| d["address"] == a.vf(0)).unwrap();
    assert_eq!(vf0["state"], "free");
    assert_eq!(vf0["physfn"], PF);
    assert_eq!(vf0["vf_index"], 0);
    assert_eq!(vf0["numa_node"], 1);
    assert_eq!(vf0["driver"], "iavf");
    assert_eq!(vf0["managed"], true);
    assert_eq!(vf0["owner"], Value::Null);
    let pf = devices.iter().find(|d| d["address"] == PF).unwrap();
    assert_eq!(pf["sriov"]["total_vfs"], 64);
    assert_eq!(pf["sriov"]["vfs"].as_array().unwrap().len(), 4);
    assert_eq!(pf["netdevs"][0], "ens1f0");
    assert!(devices
        .iter()
        .all(|d| d["generation"].as_u64().unwrap() <= host_gen));

    let show = a.ok(&["show", a.vf(2)]);
    assert!(
        show.contains(&format!("physfn       {PF} (VF 2)")),
        "{show}"
    );
    assert!(show.contains("state        free"), "{show}");
    let s = a.json(&["show", a.vf(2)]);
    assert_eq!(s["device"]["address"], a.vf(2));
    assert_eq!(s["lost"].as_array().unwrap().len(), 0);

    let status = a.ok(&["status"]);
    assert!(status.contains("free 4, unmanaged 2"), "{status}");
    let st = a.json(&["status"]);
    assert_eq!(st["host_generation"].as_u64(), Some(host_gen));
    assert_eq!(st["devices_by_state"]["free"], 4);
    assert_eq!(st["store"]["ok"], true);
    // The domain-event subscription has a line of its own (what it says, and when it
    // changes, is tests/libvirt.rs's).
    assert!(
        status.lines().any(|l| l.starts_with("libvirt events   ")),
        "{status}"
    );
    assert!(st["libvirt_events"]["ok"].is_boolean(), "{st}");
    assert!(st["libvirt_events"]["detail"].is_string(), "{st}");
}

#[test]
fn claim_release_transfer_and_their_refusals() {
    let a = Agent::start();
    let vf = a.vf(1).to_string();
    let listed = a.generation(&vf);

    // Claim with an explicit generation and request id.
    let out = a.ok(&[
        "claim",
        &vf,
        "--owner",
        INSTANCE,
        "--label",
        "instance-0000002a",
        "--generation",
        &listed.to_string(),
        "--request-id",
        "boot-1",
    ]);
    assert!(
        out.starts_with(&format!(
            "claimed {vf} for {INSTANCE} (instance-0000002a) at generation "
        )),
        "{out}"
    );
    let claimed = a.generation(&vf);
    assert!(claimed > listed);
    // A retry with the same request id replays the first answer.
    let again = a.json(&[
        "claim",
        &vf,
        "--owner",
        INSTANCE,
        "--label",
        "instance-0000002a",
        "--generation",
        &listed.to_string(),
        "--request-id",
        "boot-1",
    ]);
    assert_eq!(again["replayed"], true);
    assert_eq!(again["generation"].as_u64(), Some(claimed));
    assert_eq!(again["device"]["owner"]["consumer_id"], INSTANCE);

    // The outcome of the claim is on record.
    let o = a.ok(&["outcome", "--owner", INSTANCE, "--request-id", "boot-1"]);
    assert_eq!(
        o.trim_end().rsplit_once(" (").unwrap().0,
        format!("claimed {vf} at generation {claimed}")
    );
    let oj = a.json(&["outcome", "--owner", INSTANCE, "--request-id", "boot-1"]);
    assert_eq!(oj["operation"], "claimed");
    let missing = a.ctl(&["outcome", "--owner", INSTANCE, "--request-id", "never"]);
    assert!(
        refusal(&missing, 1).contains("with a new request id"),
        "{missing:?}"
    );

    // The table shows the owner and the PF blocked by the claim.
    let list = a.ok(&["list"]);
    let row = list
        .lines()
        .find(|l| l.trim_start().starts_with(&vf))
        .unwrap();
    assert!(
        row.contains("claimed") && row.contains(INSTANCE) && row.contains("(instance-0000002a)"),
        "{row}"
    );
    let pf_row = list.lines().find(|l| l.starts_with(PF)).unwrap();
    assert!(
        pf_row.contains("unavailable") && pf_row.contains(&format!("blocked by {vf}")),
        "{pf_row}"
    );

    // A stale audit: release with the generation from before the claim.
    let stale = a.ctl(&[
        "release",
        &vf,
        "--owner",
        INSTANCE,
        "--generation",
        &listed.to_string(),
    ]);
    let line = refusal(&stale, 1);
    assert!(
        line.starts_with("hostdevctl: release refused: stale generation"),
        "{line}"
    );
    assert!(
        line.contains(&format!("current generation is {claimed}")),
        "{line}"
    );
    assert!(line.contains(INSTANCE), "{line}");
    assert_eq!(
        a.generation(&vf),
        claimed,
        "a refused release changed the device"
    );

    // The wrong owner, with the right generation.
    let wrong = a.ctl(&[
        "release",
        &vf,
        "--owner",
        OTHER,
        "--generation",
        &claimed.to_string(),
    ]);
    let line = refusal(&wrong, 1);
    assert!(line.starts_with("hostdevctl: release refused: "), "{line}");
    assert!(
        line.contains(&format!("is claimed by {INSTANCE}"))
            && line.contains(&format!("not by {OTHER}")),
        "{line}"
    );

    // Already claimed by someone else.
    let taken = a.ctl(&[
        "claim",
        &vf,
        "--owner",
        OTHER,
        "--generation",
        &claimed.to_string(),
    ]);
    assert!(refusal(&taken, 1).contains("already claimed"), "{taken:?}");

    // Unknown device, unmanaged device, malformed address, bad UUID.
    let unknown = a.ctl(&["show", "0000:99:00.0"]);
    assert_eq!(
        refusal(&unknown, 1),
        "hostdevctl: show failed: unknown device 0000:99:00.0: no such PCI device is known on this host"
    );
    let unknown = a.ctl(&[
        "release",
        "0000:99:00.0",
        "--owner",
        INSTANCE,
        "--generation",
        "1",
    ]);
    assert!(
        refusal(&unknown, 1).contains("unknown device 0000:99:00.0"),
        "{unknown:?}"
    );
    let unmanaged = a.ctl(&["claim", NVME, "--owner", INSTANCE]);
    assert!(
        refusal(&unmanaged, 1).contains("not in the managed device selection"),
        "{unmanaged:?}"
    );
    let bad = a.ctl(&["show", "0000:3b:02"]);
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(
        bad.stderr.contains("0000:3b:02") && bad.stderr.contains("missing '.function'"),
        "{bad:?}"
    );
    let bad = a.ctl(&["claim", &vf, "--owner", "not-a-uuid"]);
    assert_eq!(bad.code, 2, "{bad:?}");

    // Transfer to the migration consumer, then the old owner's release is refused.
    let t = a.ok(&[
        "transfer",
        &vf,
        "--from",
        INSTANCE,
        "--to",
        OTHER,
        "--label",
        "migration",
        "--generation",
        &claimed.to_string(),
    ]);
    assert!(
        t.starts_with(&format!(
            "transferred {vf} from {INSTANCE} to {OTHER} (migration) at generation "
        )),
        "{t}"
    );
    let moved = a.generation(&vf);
    assert!(moved > claimed);
    let old = a.ctl(&[
        "release",
        &vf,
        "--owner",
        INSTANCE,
        "--generation",
        &moved.to_string(),
    ]);
    assert!(
        refusal(&old, 1).contains(&format!("not by {INSTANCE}")),
        "{old:?}"
    );
    let stale_t = a.ctl(&[
        "transfer",
        &vf,
        "--from",
        OTHER,
        "--to",
        INSTANCE,
        "--generation",
        &claimed.to_string(),
    ]);
    assert!(
        refusal(&stale_t, 1).starts_with("hostdevctl: transfer refused: stale generation"),
        "{stale_t:?}"
    );

    // The owner releases with the fresh generation.
    let r = a.json(&[
        "release",
        &vf,
        "--owner",
        OTHER,
        "--generation",
        &moved.to_string(),
        "--request-id",
        "rel-1",
    ]);
    assert_eq!(r["address"], vf.as_str());
    assert_eq!(r["replayed"], false);
    assert_eq!(r["request_id"], "rel-1");
    let released = r["generation"].as_u64().unwrap();
    assert!(released > moved);
    assert_eq!(a.json(&["show", &vf])["device"]["state"], "free");
    // Releasing again with the same request id is not an error.
    let again = a.json(&[
        "release",
        &vf,
        "--owner",
        OTHER,
        "--generation",
        &moved.to_string(),
        "--request-id",
        "rel-1",
    ]);
    assert_eq!(again["replayed"], true);

    // Claim without --generation reads it first and says so on stderr.
    let r = a.ctl(&["claim", &vf, "--owner", INSTANCE]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stderr
            .contains(&format!("at its current generation {released}")),
        "{r:?}"
    );
}

#[test]
fn claim_by_selector() {
    let a = Agent::start();
    let j = a.json(&[
        "claim", "--select", "--vendor", "8086", "--pf", PF, "--numa", "1", "--owner", INSTANCE,
    ]);
    let got = j["device"]["address"].as_str().unwrap().to_string();
    assert!(a.vfs.contains(&got), "{j}");
    assert_eq!(j["device"]["state"], "claimed");
    let none = a.ctl(&["claim", "--select", "--vendor", "15b3", "--owner", INSTANCE]);
    let line = refusal(&none, 1);
    assert!(
        line.starts_with("hostdevctl: claim refused: no free device"),
        "{line}"
    );
    let usage = a.ctl(&["claim", "--vendor", "8086", "--owner", INSTANCE]);
    assert_eq!(usage.code, 2, "{usage:?}");
    let usage = a.ctl(&["claim", a.vf(0), "--select", "--owner", INSTANCE]);
    assert_eq!(usage.code, 2, "{usage:?}");
}

#[test]
fn watch_replays_and_reconcile_reports() {
    let a = Agent::start();
    let start = a.json(&["list"])["host_generation"].as_u64().unwrap();
    let (v0, v3) = (a.vf(0).to_string(), a.vf(3).to_string());
    a.ok(&[
        "claim",
        &v0,
        "--owner",
        INSTANCE,
        "--label",
        "instance-0000002a",
    ]);
    let c3 = a.json(&[
        "claim",
        &v3,
        "--owner",
        OTHER,
        "--label",
        "instance-0000002b",
    ]);
    let g3 = c3["generation"].as_u64().unwrap();
    let g0 = a.generation(&v0);

    // Text: one line per event, generation first; the PF is re-reported as unavailable
    // when its first VF is claimed, with a generation of its own for the event (its
    // record's is unchanged).
    let pf_event = g0 + 1;
    assert_eq!(
        g3,
        pf_event + 1,
        "the PF's event took one generation between the claims"
    );
    let w = a.ok(&["watch", "--from", &start.to_string(), "--count", "3"]);
    let lines: Vec<&str> = w.lines().collect();
    assert_eq!(
        lines,
        [
            format!("{g0} changed {v0} claimed owner={INSTANCE}(instance-0000002a)"),
            format!(
                "{pf_event} changed {PF} unavailable owner=- blocked by {v0} (virtual_function)"
            ),
            format!("{g3} changed {v3} claimed owner={OTHER}(instance-0000002b)"),
        ],
        "{w}"
    );

    // JSON lines, resuming after the PF's event.
    let w = a.ok(&[
        "--json",
        "watch",
        "--from",
        &pf_event.to_string(),
        "--count",
        "1",
    ]);
    let ev: Value = serde_json::from_str(w.trim_end()).unwrap();
    assert_eq!(ev["kind"], "changed");
    assert_eq!(ev["generation"].as_u64(), Some(g3));
    assert_eq!(ev["address"], v3.as_str());
    assert_eq!(ev["device"]["owner"]["consumer_id"], OTHER);

    // A snapshot: one line per device, then its end.
    let w = a.ok(&["--json", "watch", "--snapshot", "--count", "7"]);
    let evs: Vec<Value> = w
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(evs[..6].iter().all(|e| e["kind"] == "snapshot"), "{w}");
    // Each at the generation the snapshot was read at; the device's own is in the device.
    assert!(
        evs[..6]
            .iter()
            .all(|e| e["generation"].as_u64() == Some(g3)),
        "{w}"
    );
    assert_eq!(evs[6]["kind"], "snapshot-end");
    assert_eq!(evs[6]["generation"].as_u64(), Some(g3));

    // A future generation cannot be resumed.
    let future = a.ctl(&["watch", "--from", &(g3 + 100).to_string(), "--count", "1"]);
    assert!(
        refusal(&future, 1).starts_with("hostdevctl: watch failed: cannot resume"),
        "{future:?}"
    );

    // Reconcile: a dry run reports the other instance's VF as an orphan and frees nothing.
    let snap = g3.to_string();
    let r = a.ok(&[
        "reconcile",
        "--expected",
        INSTANCE,
        "--snapshot-generation",
        &snap,
    ]);
    assert!(
        r.starts_with(&format!(
            "reconcile (dry run) against snapshot generation {g3}"
        )),
        "{r}"
    );
    assert!(r.contains(&format!("orphan     {v3} owner {OTHER} (instance-0000002b) generation {g3}; would be freed with --act")), "{r}");
    assert!(
        r.contains("1 orphans, 0 strays, 0 lost, 0 changed, 0 protected"),
        "{r}"
    );
    let dry = a.json(&[
        "reconcile",
        "--expected",
        INSTANCE,
        "--snapshot-generation",
        &snap,
        "--dry-run",
    ]);
    assert_eq!(dry["acted"], false);
    assert_eq!(dry["orphans"][0]["device"]["address"], v3.as_str());
    assert_eq!(a.generation(&v3), g3, "a dry run changed the orphan");
    // A snapshot older than the claim: reported as changed, never an orphan.
    let old = a.json(&[
        "reconcile",
        "--expected",
        INSTANCE,
        "--snapshot-generation",
        &start.to_string(),
    ]);
    assert_eq!(old["orphans"].as_array().unwrap().len(), 0, "{old}");
    assert!(
        old["changed"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["address"] == v3.as_str()),
        "{old}"
    );
    let none = a.json(&["reconcile", "--expect-none", "--snapshot-generation", &snap]);
    assert_eq!(none["orphans"].as_array().unwrap().len(), 2, "{none}");
    let both = a.json(&[
        "reconcile",
        "--expected",
        &format!("{INSTANCE},{OTHER}"),
        "--snapshot-generation",
        &snap,
    ]);
    assert_eq!(both["orphans"].as_array().unwrap().len(), 0, "{both}");

    // --act frees the orphan.
    let acted = a.json(&[
        "reconcile",
        "--expected",
        INSTANCE,
        "--snapshot-generation",
        &snap,
        "--act",
    ]);
    assert_eq!(acted["acted"], true, "{acted}");
    assert!(
        acted["orphans"][0]["freed_generation"].as_u64().unwrap() > g3,
        "{acted}"
    );
    // The audit's made-up request id is shown: the same again lists what it freed, as
    // freed by an earlier attempt, and frees nothing more.
    let id = acted["request_id"]
        .as_str()
        .expect("the request id shown")
        .to_string();
    let again = a.json(&[
        "reconcile",
        "--expected",
        INSTANCE,
        "--snapshot-generation",
        &snap,
        "--act",
        "--request-id",
        &id,
    ]);
    assert_eq!(again["orphans"][0]["earlier_attempt"], true, "{again}");
    assert_eq!(
        again["orphans"][0]["freed_generation"], acted["orphans"][0]["freed_generation"],
        "{again}"
    );
    assert_eq!(a.json(&["show", &v3])["device"]["state"], "free");
    assert_eq!(a.json(&["show", &v0])["device"]["state"], "claimed");

    let usage = a.ctl(&["reconcile", "--snapshot-generation", &snap]);
    assert_eq!(usage.code, 2, "{usage:?}");
    let usage = a.ctl(&[
        "reconcile",
        "--expected",
        INSTANCE,
        "--snapshot-generation",
        &snap,
        "--act",
        "--dry-run",
    ]);
    assert_eq!(usage.code, 2, "{usage:?}");
}

#[test]
fn a_caller_without_write_access_is_refused() {
    let uid = nix::unistd::getuid().as_raw();
    let a = Agent::start_with_writer(uid.wrapping_add(1));
    let r = a.ctl(&["claim", a.vf(0), "--owner", INSTANCE, "--generation", "1"]);
    let line = refusal(&r, 1);
    assert!(
        line.starts_with("hostdevctl: claim refused: permission denied: uid "),
        "{line}"
    );
    // Reads are open to anyone who can connect.
    a.ok(&["list"]);
    a.ok(&["reconcile", "--expect-none", "--snapshot-generation", "1"]);
    let act = a.ctl(&[
        "reconcile",
        "--expect-none",
        "--snapshot-generation",
        "1",
        "--act",
    ]);
    assert!(refusal(&act, 1).contains("permission denied"), "{act:?}");
}

#[test]
fn no_daemon_is_exit_3_naming_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("absent.sock");
    let r = ctl_at(&sock, &["status"]);
    let line = refusal(&r, 3);
    assert!(line.contains(&sock.display().to_string()), "{line}");
    assert!(line.contains("daemon running"), "{line}");
    // The environment variable names the socket when --socket is absent.
    let o: Run = Command::new(env!("CARGO_BIN_EXE_hostdevctl"))
        .arg("list")
        .env("HOSTDEVD_SOCKET", &sock)
        .output()
        .unwrap()
        .into();
    assert_eq!(o.code, 3, "{o:?}");
    assert!(o.stderr.contains(&sock.display().to_string()), "{o:?}");
    // Usage errors are 2 and need no daemon.
    let o: Run = Command::new(env!("CARGO_BIN_EXE_hostdevctl"))
        .arg("frobnicate")
        .output()
        .unwrap()
        .into();
    assert_eq!(o.code, 2, "{o:?}");
    let help: Run = Command::new(env!("CARGO_BIN_EXE_hostdevctl"))
        .args(["claim", "--help"])
        .output()
        .unwrap()
        .into();
    assert_eq!(help.code, 0);
    assert!(
        help.stdout.contains("NOT for controllers"),
        "{}",
        help.stdout
    );
}

/// A connection the agent refuses (its uid holds `max_connections_per_uid` already) is
/// answered with the reason, which hostdevctl prints, exit 3 (no agent reached), not as
/// a refused or cancelled call.
#[test]
fn a_connection_over_the_uid_limit_says_so() {
    let a = Agent::start_with(
        nix::unistd::getuid().as_raw(),
        "[api]\nmax_connections_per_uid = 1\n",
    );
    // Holds the uid's one place. Admitted or refused (while the readiness probe's
    // connection still held the place), a connection gets the agent's HTTP/2 SETTINGS;
    // a refused one that sends nothing is closed within the refusal's time (EOF), and is
    // tried again. One still open after that was admitted.
    let held = loop {
        let s = std::os::unix::net::UnixStream::connect(&a.socket).unwrap();
        s.set_read_timeout(Some(
            hostdevd::api::connections::REFUSAL_TIME + Duration::from_secs(1),
        ))
        .unwrap();
        let mut buf = [0u8; 256];
        let admitted = loop {
            match std::io::Read::read(&mut &s, &mut buf) {
                Ok(0) => break false,
                Ok(_) => continue,
                Err(e) => break matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            }
        };
        if admitted {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for _ in 0..5 {
        let r = ctl_at(&a.socket, &["status"]);
        let line = refusal(&r, 3);
        assert!(
            line.contains("hostdevd refused this connection: uid"),
            "{line}"
        );
        assert!(line.contains("max_connections_per_uid"), "{line}");
        assert!(!line.contains("daemon running"), "{line}");
    }
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(30);
    while ctl_at(&a.socket, &["status"]).code != 0 {
        assert!(Instant::now() < deadline, "the place never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A socket whose listener accepts and never answers (an agent stopped with SIGSTOP, or
/// wedged) is given up on after the connect timeout and said so, exit 3: not taken for a
/// refused connection, and no hang.
#[test]
fn an_agent_that_never_answers_is_given_up_on_and_said_so() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        for s in listener.incoming().flatten() {
            kept.push(s);
        }
    });
    let t = Instant::now();
    let line = refusal(&ctl_at(&socket, &["status"]), 3);
    assert!(line.contains("did not answer"), "{line}");
    assert!(!line.contains("max_connections_per_uid"), "{line}");
    assert!(!line.contains("daemon running"), "{line}");
    assert!(
        t.elapsed() >= hostdevd::client::CONNECT_TIMEOUT,
        "{:?}",
        t.elapsed()
    );
}

/// An agent that takes the connection and the call and never answers (wedged): each call
/// ends at `--deadline`, exit 4, "timed out"; a claim's line names its request id, whose
/// outcome is open. Before, hostdevctl waited for ever.
#[test]
fn a_call_the_agent_never_answers_ends_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("wedged.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::UnixListener::from_std(listener).unwrap();
            let mut held = Vec::new();
            loop {
                let Ok((io, _)) = listener.accept().await else {
                    continue;
                };
                // Every connection's HTTP/2 handshake made; every call taken, none answered.
                held.push(tokio::spawn(async move {
                    let Ok(mut conn) = h2::server::handshake(io).await else {
                        return;
                    };
                    let mut calls = Vec::new();
                    while let Some(Ok(call)) = conn.accept().await {
                        calls.push(call);
                    }
                }));
            }
        });
    });
    let t = Instant::now();
    let line = refusal(&ctl_at(&socket, &["--deadline", "1", "status"]), 4);
    assert!(line.contains("timed out"), "{line}");
    assert!(t.elapsed() >= Duration::from_secs(1), "{:?}", t.elapsed());
    let line = refusal(
        &ctl_at(
            &socket,
            &[
                "--deadline",
                "1",
                "claim",
                "0000:3b:02.0",
                "--owner",
                INSTANCE,
                "--generation",
                "1",
                "--request-id",
                "wedged-1",
            ],
        ),
        4,
    );
    assert!(line.contains("claim failed: timed out"), "{line}");
    assert!(
        line.contains(&format!(
            "hostdevctl outcome --owner {INSTANCE} --request-id wedged-1"
        )),
        "{line}"
    );
    let usage = ctl_at(&socket, &["--deadline", "0", "status"]);
    assert_eq!(usage.code, 2, "{usage:?}");
}

#[test]
fn a_vanished_claimed_vf_is_shown_lost_until_released() {
    let a = Agent::start();
    let vf = a.vf(1).to_string();
    a.ok(&[
        "claim",
        &vf,
        "--owner",
        INSTANCE,
        "--label",
        "instance-0000002a",
    ]);
    a.tree.remove_device(&vf);
    a.rescan_until("lost claim", |a| {
        a.json(&["show", &vf])["lost"]
            .as_array()
            .is_some_and(|l| !l.is_empty())
    });

    let list = a.ok(&["list"]);
    let rows: Vec<&str> = list.lines().collect();
    let at = rows
        .iter()
        .position(|l| l.trim_start().starts_with(&vf))
        .unwrap();
    // Still under its PF, in its place between VF 0 and VF 2.
    assert!(rows[at].starts_with(&format!("  {vf}")), "{list}");
    assert!(
        rows[at - 1].starts_with(&format!("  {}", a.vf(0))),
        "{list}"
    );
    assert!(
        rows[at + 1].starts_with(&format!("  {}", a.vf(2))),
        "{list}"
    );
    assert!(
        rows[at].contains("lost")
            && rows[at].contains(INSTANCE)
            && rows[at].ends_with("gone from sysfs"),
        "{list}"
    );

    let show = a.ok(&["show", &vf]);
    assert!(
        show.starts_with(&format!("{vf}: no present device (only lost claims)")),
        "{show}"
    );
    assert!(show.contains("lost claim at this address:"), "{show}");
    let j = a.json(&["show", &vf]);
    assert_eq!(j["device"], Value::Null);
    let lost = &j["lost"][0];
    assert_eq!(lost["state"], "lost");
    assert_eq!(lost["present"], false);
    let g = lost["generation"].as_u64().unwrap();
    assert_eq!(a.json(&["status"])["lost"], 1);

    // Claiming needs a present device; only the owner can release the lost claim.
    let r = a.ctl(&["claim", &vf, "--owner", OTHER]);
    assert!(refusal(&r, 1).contains("not present"), "{r:?}");
    let r = a.ctl(&[
        "release",
        &vf,
        "--owner",
        OTHER,
        "--generation",
        &g.to_string(),
    ]);
    assert_eq!(r.code, 1, "{r:?}");
    a.ok(&[
        "release",
        &vf,
        "--owner",
        INSTANCE,
        "--generation",
        &g.to_string(),
    ]);
    let gone = a.ctl(&["show", &vf]);
    assert!(refusal(&gone, 1).contains("unknown device"), "{gone:?}");
}

/// The request id an error line names: "(request id ID: ...".
fn request_id_in(line: &str) -> String {
    line.split("(request id ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .unwrap_or_else(|| panic!("no request id in: {line}"))
        .to_string()
}

/// A claim whose outcome the error leaves open (here: claimed, but the binding it asked
/// for failed) names the generated request id and how to ask about it, so that the
/// operator can look it up or send it again rather than claim a second device.
#[test]
fn a_claim_whose_outcome_is_open_names_its_request_id() {
    let a = Agent::start();
    let v = a.vf(1).to_string();
    a.tree.remove_attr(&v, "iommu_group");
    a.rescan_until("the VF without its IOMMU group", |a| {
        a.json(&["show", &v])["device"]["iommu_group"].is_null()
    });
    let r = a.ctl(&["claim", &v, "--owner", INSTANCE, "--vfio"]);
    let line = refusal(&r, 1);
    assert!(line.contains("the claim stands"), "{line}");
    let id = request_id_in(&line);
    assert!(
        line.contains(&format!(
            "hostdevctl outcome --owner {INSTANCE} --request-id {id}"
        )),
        "{line}"
    );
    // Resending and asking are alternatives: asking closes an id that did not apply.
    assert!(
        line.contains(&format!(
            "either send the same claim again with --request-id {id}"
        )),
        "{line}"
    );
    assert!(line.contains("closes the id if it did not"), "{line}");
    let o = a.json(&["outcome", "--owner", INSTANCE, "--request-id", &id]);
    assert_eq!(o["address"], v.as_str(), "{o}");
    // A plain refusal that changed nothing does not send the operator looking.
    let r = a.ctl(&["claim", &v, "--owner", OTHER]);
    assert!(!refusal(&r, 1).contains("request id"), "{r:?}");
}

/// prepare-vfio sends a request id of its own and prints it, with the two ways on, when
/// a sysfs step fails after the binding was recorded (here no kernel answers the bind,
/// so the step times out); the outcome names the binding, and the same request sent
/// again with that id is the same binding retried, not a stale generation.
#[test]
fn a_binding_whose_outcome_is_open_names_its_request_id() {
    let a = Agent::start_with(
        nix::unistd::getuid().as_raw(),
        "[hardware]\nstep_timeout_ms = 100\n",
    );
    // vfio-pci "loaded": its driver directory exists; nothing binds a device to it.
    std::fs::create_dir_all(a.tree.sysfs_root().join("bus/pci/drivers/vfio-pci")).unwrap();
    let v = a.vf(2).to_string();
    a.ok(&["claim", &v, "--owner", INSTANCE, "--request-id", "boot"]);
    let g = a.generation(&v).to_string();
    let r = a.ctl(&["prepare-vfio", &v, "--owner", INSTANCE, "--generation", &g]);
    let line = refusal(&r, 1);
    assert!(line.contains("after the binding was recorded"), "{line}");
    let id = request_id_in(&line);
    assert!(
        line.contains(&format!(
            "either send the same prepare-vfio again with --request-id {id}"
        )),
        "{line}"
    );
    let o = a.json(&["outcome", "--owner", INSTANCE, "--request-id", &id]);
    assert_eq!(
        (o["operation"].as_str(), o["address"].as_str()),
        (Some("bound"), Some(v.as_str())),
        "{o}"
    );
    let now = a.generation(&v);
    assert_eq!(o["generation"].as_u64(), Some(now), "{o}");
    // The same request again: the binding retried (it fails the same way here, at a
    // new generation), where without the id the generation it presents is stale.
    let again = a.ctl(&[
        "prepare-vfio",
        &v,
        "--owner",
        INSTANCE,
        "--generation",
        &g,
        "--request-id",
        &id,
    ]);
    assert!(
        refusal(&again, 1).contains("after the binding was recorded"),
        "{again:?}"
    );
    assert!(a.generation(&v) > now);
    let stale = a.ctl(&["prepare-vfio", &v, "--owner", INSTANCE, "--generation", &g]);
    assert!(refusal(&stale, 1).contains("stale"), "{stale:?}");
}

/// A watch that the agent ends because it is stopping (SIGTERM) says so, and exits 4 as
/// an answer that the agent cannot serve now (worth trying again), not 3 as a
/// connection that broke, nor 1 as a refusal.
#[test]
fn a_watch_ended_by_the_agent_stopping_says_so() {
    use std::io::BufRead;
    let a = Agent::start();
    let mut watch = Command::new(env!("CARGO_BIN_EXE_hostdevctl"))
        .arg("--socket")
        .arg(&a.socket)
        .arg("watch")
        .env_remove("HOSTDEVD_SOCKET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(watch.stderr.take().unwrap());
    // hostdevctl says it is watching once the agent has accepted the stream.
    let mut first = String::new();
    stderr.read_line(&mut first).unwrap();
    assert!(
        first.starts_with("hostdevctl: watching changes after generation"),
        "{first}"
    );
    let pid = nix::unistd::Pid::from_raw(a.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
        let _ = tx.send((watch.wait(), rest));
    });
    let (status, rest) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("hostdevctl watch ends when the agent stops");
    assert_eq!(status.unwrap().code(), Some(4), "{rest}");
    assert!(
        rest.starts_with("hostdevctl: watch failed: agent stopping: the agent is shutting down"),
        "{rest}"
    );
}

/// A VF removed and made again with no uevent said (lost, or not sent to this agent),
/// or while the agent was stopped, is another device: the next scan (a reload, a
/// restart) reads its directory as another instance, leaves the claim lost and shows the
/// new VF free (I6). A restart with nothing made again keeps every claim as it was.
#[test]
fn a_vf_made_again_unseen_is_another_device() {
    let mut a = Agent::start();
    let (first, second, third) = (
        a.vf(1).to_string(),
        a.vf(2).to_string(),
        a.vf(3).to_string(),
    );
    for vf in [&first, &second, &third] {
        a.ok(&["claim", vf, "--owner", INSTANCE]);
    }
    let made_again = |a: &Agent, vf: &str| {
        let j = a.json(&["show", vf]);
        j["device"]["state"] == "free"
            && j["lost"].as_array().is_some_and(|l| {
                l.len() == 1 && l[0]["state"] == "lost" && l[0]["owner"]["consumer_id"] == INSTANCE
            })
    };
    a.tree.remove_device(&first);
    a.tree.replug_device(&first);
    a.rescan_until("the claim lost and the VF free", |a| made_again(a, &first));

    let kept = a.json(&["show", &third]);
    a.restart_after(|tree| {
        tree.remove_device(&second);
        tree.replug_device(&second);
    });
    assert!(made_again(&a, &second), "{}", a.ok(&["show", &second]));
    assert!(made_again(&a, &first), "{}", a.ok(&["show", &first]));
    let now = a.json(&["show", &third]);
    assert_eq!(
        (&now["device"], &now["lost"]),
        (&kept["device"], &kept["lost"]),
        "the restart kept the third as it was, generation included"
    );
    assert_eq!(a.json(&["status"])["lost"], 2);
}

/// A claim made in an earlier boot is told from a device made again too: at the first
/// start in a new boot the agent writes the claimed devices' instances it learnt, so a
/// restart in that boot, after the VF was made again while the agent was stopped, finds
/// the claim's device gone.
#[test]
fn a_claim_from_an_earlier_boot_is_checked_after_the_next_start() {
    let mut a = Agent::start();
    let (vf, kept) = (a.vf(1).to_string(), a.vf(2).to_string());
    for v in [&vf, &kept] {
        a.ok(&["claim", v, "--owner", INSTANCE]);
    }
    let boot_id = a.proc.join("sys/kernel/random/boot_id");
    a.restart_after(|_| {
        std::fs::write(&boot_id, "7d3e1a9c-2b4f-4c6d-8e0a-5f1b3c7d9e2a\n").unwrap();
    });
    let held = a.json(&["show", &kept]);
    a.restart_after(|tree| {
        tree.remove_device(&vf);
        tree.replug_device(&vf);
    });
    let j = a.json(&["show", &vf]);
    assert_eq!(j["device"]["state"], "free", "{j}");
    assert_eq!(j["lost"][0]["owner"]["consumer_id"], INSTANCE, "{j}");
    let now = a.json(&["show", &kept]);
    assert_eq!(
        now["device"], held["device"],
        "the other claim kept as it was"
    );
}

/// `reload` signals the agent and waits for the reload it asked for: a config the agent
/// refuses is exit 1 with the reason (and the status says so), a good one exit 0; a PID
/// that is not the agent's is refused before anything is signalled.
#[test]
fn reload_waits_for_the_agent_and_says_how_it_ended() {
    let a = Agent::start();
    let config = a._dir.path().join("config.toml");
    let status = a.json(&["status"]);
    assert_eq!(status["reloads"]["finished"], 0, "{status}");
    assert!(status["reloads"]["last"].is_null(), "{status}");
    let text = a.ok(&["status"]);
    assert!(text.contains("none since the start"), "{text}");

    // Without --pid: the process listening on the socket. A config that does not parse.
    std::fs::write(&config, "[[devices]]\nvendor = \"8086\"\n").unwrap();
    let r = a.ctl(&["reload"]);
    let why = refusal(&r, 1);
    assert!(
        why.contains("reload refused") && why.contains("unknown field `vendor`"),
        "{why}"
    );
    let status = a.json(&["status"]);
    assert_eq!(status["reloads"]["finished"], 1, "{status}");
    assert_eq!(status["reloads"]["last"]["ok"], false, "{status}");

    // With the agent's own PID, as systemd passes it: a good config is applied.
    std::fs::write(&config, "").unwrap();
    let pid = a.child.id().to_string();
    let said = a.ok(&["reload", "--pid", &pid]);
    assert!(
        said.starts_with("reloaded the device selection (agent PID "),
        "{said}"
    );
    let done = a.json(&["reload", "--pid", &pid]);
    assert_eq!(done["reloaded"], true, "{done}");
    assert_eq!(done["reloads_finished"], 3, "{done}");
    let text = a.ok(&["status"]);
    assert!(
        text.contains("3 done, the last ok (reloaded the device selection)"),
        "{text}"
    );

    // Another process's PID (this test's own) is not signalled: the count stays.
    let other = std::process::id().to_string();
    let why = refusal(&a.ctl(&["reload", "--pid", &other]), 1);
    assert!(
        why.contains(&format!("PID {other} is not the agent listening on"))
            && why.contains("nothing was signalled"),
        "{why}"
    );
    // A PID of 1 or less (a process group for kill) is a usage error.
    assert_eq!(a.ctl(&["reload", "--pid", "0"]).code, 2);
    assert_eq!(a.ctl(&["reload", "--pid", "-1"]).code, 2);
    assert_eq!(a.json(&["status"])["reloads"]["started"], 3);
}

/// `watch --follow` goes on across a restart of the agent: the stream ends, hostdevctl
/// connects again and, since a restarted agent cannot replay from before its start,
/// begins again with a snapshot, and the next claim reaches it. Without --follow the
/// same watch ends (the test above).
#[test]
fn a_followed_watch_goes_on_across_a_restart() {
    use std::io::BufRead;
    let mut a = Agent::start();
    let mut watch = Command::new(env!("CARGO_BIN_EXE_hostdevctl"))
        .args(["--json", "--socket"])
        .arg(&a.socket)
        .args(["watch", "--follow", "--snapshot"])
        .env_remove("HOSTDEVD_SOCKET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Value>();
    let stdout = std::io::BufReader::new(watch.stdout.take().unwrap());
    std::thread::spawn(move || {
        for line in stdout.lines() {
            let Ok(line) = line else { return };
            let Ok(v) = serde_json::from_str(&line) else {
                return;
            };
            if tx.send(v).is_err() {
                return;
            }
        }
    });
    let (etx, erx) = std::sync::mpsc::channel::<String>();
    let stderr = std::io::BufReader::new(watch.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = etx.send(line);
        }
    });
    type Events = std::sync::mpsc::Receiver<Value>;
    let until = |rx: &Events, what: &str, f: &dyn Fn(&Value) -> bool| loop {
        let e = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("no {what} within 30 s"));
        if f(&e) {
            return e;
        }
    };
    let until_claimed = |rx: &Events, vf: &str| {
        until(rx, vf, &|e| {
            e["kind"] == "changed" && e["address"] == vf && e["device"]["state"] == "claimed"
        })
    };
    // In JSON hostdevctl says nothing on stderr once it watches: the snapshot's end says
    // that the stream is open.
    until(&rx, "snapshot's end", &|e| e["kind"] == "snapshot-end");
    let v0 = a.vf(0).to_string();
    a.ok(&["claim", &v0, "--owner", INSTANCE]);
    until_claimed(&rx, &v0);

    a.restart();
    // The restarted agent cannot replay from before its start: the watch begins again
    // with a snapshot, and the changes after it follow.
    until(&rx, "new snapshot's end", &|e| e["kind"] == "snapshot-end");
    let v1 = a.vf(1).to_string();
    a.ok(&["claim", &v1, "--owner", INSTANCE]);
    let e = until_claimed(&rx, &v1);
    assert!(e["generation"].as_u64() > Some(0), "{e}");
    let said: Vec<String> = erx.try_iter().collect();
    assert!(
        said.iter()
            .any(|l| l.starts_with("hostdevctl: watch interrupted")
                && l.ends_with("starting again with a snapshot")),
        "{said:?}"
    );
    assert!(
        watch.try_wait().unwrap().is_none(),
        "the watch is still running: {said:?}"
    );
    let _ = watch.kill();
    let _ = watch.wait();
}

/// A protected device says why it is kept: the text names the process holding its VFIO
/// group, and the JSON lists the protections (reason, holder, domain). Before, neither
/// said why.
#[test]
fn reconcile_says_why_a_protected_device_is_kept() {
    let a = Agent::start();
    let v = a.vf(1).to_string();
    a.ok(&[
        "claim",
        &v,
        "--owner",
        OTHER,
        "--label",
        "instance-0000002b",
    ]);
    let group = a.json(&["show", &v])["device"]["iommu_group"]
        .as_u64()
        .unwrap();
    // QEMU for the claim's VM holds the VF's VFIO group open.
    let qemu = a.proc.join("4242");
    std::fs::create_dir_all(qemu.join("fd")).unwrap();
    std::fs::write(qemu.join("comm"), "qemu-system-x86\n").unwrap();
    std::fs::write(
        qemu.join("cmdline"),
        format!("qemu-system-x86_64\0-name\0guest=instance-0000002b\0-uuid\0{OTHER}\0"),
    )
    .unwrap();
    let node = a.tree.vfio_node(u32::try_from(group).unwrap());
    std::os::unix::fs::symlink(node, qemu.join("fd/12")).unwrap();
    let snap = a.json(&["list"])["host_generation"]
        .as_u64()
        .unwrap()
        .to_string();

    let r = a.ok(&["reconcile", "--expect-none", "--snapshot-generation", &snap]);
    let line = r
        .lines()
        .find(|l| l.starts_with("protected "))
        .unwrap_or_else(|| panic!("no protected device: {r}"));
    assert!(line.contains(&v), "{r}");
    assert!(
        line.contains("; kept because its VFIO group")
            && line.contains(&format!(
                "held open by pid 4242 (qemu-system-x86, domain instance-0000002b {OTHER})"
            )),
        "{r}"
    );
    assert!(
        r.contains("0 orphans, 0 strays, 0 lost, 0 changed, 1 protected"),
        "{r}"
    );

    let j = a.json(&["reconcile", "--expect-none", "--snapshot-generation", &snap]);
    let p = &j["protections"][0];
    assert_eq!(p["address"], v.as_str(), "{j}");
    assert_eq!(p["holder_pid"], 4242, "{j}");
    assert_eq!(p["holder_command"], "qemu-system-x86", "{j}");
    assert_eq!(p["domain"]["name"], "instance-0000002b", "{j}");
    assert_eq!(p["domain"]["uuid"], OTHER, "{j}");
    assert!(p["reason"].as_str().unwrap().contains("pid 4242"), "{j}");
    assert_eq!(j["protections"].as_array().unwrap().len(), 1, "{j}");
}
