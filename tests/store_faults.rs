//! Store behaviour on real filesystem faults: a read-only state directory and a full disk,
//! staged with tmpfs and bind mounts, and the real daemon restarted on a full disk. These
//! tests need root (CI runs as root) and fail loudly without it rather than skip.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use hostdevd::api::proto::{self};
use hostdevd::ledger::model::{
    ChangeSet, Claim, DeviceFacts, DeviceRecord, Outcome, Owner, RecordId, RequestEntry, Snapshot,
};
use hostdevd::pci::{ConsumerId, DeviceId, Generation, PciAddress, PhysNet, VendorId};
use hostdevd::store::{Store, StoreError, DB_FILE};
use tempfile::TempDir;
use tonic::Code;

mod support;

fn require_root(test: &str) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "{test} needs root: it mounts tmpfs file systems to stage a full disk and a \
         read-only state directory (run the test suite as root, as CI does)"
    );
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run mount/umount");
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A mount that is undone when the guard drops, even when the test panics.
struct Mount {
    target: PathBuf,
}

impl Mount {
    fn tmpfs(target: &Path, size: &str) -> Mount {
        fs::create_dir_all(target).expect("mount point");
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={size},mode=0750"))
            .arg("tmpfs")
            .arg(target));
        Mount {
            target: target.to_path_buf(),
        }
    }

    /// A read-only view of `source` at `target` (what systemd's ReadOnlyPaths= does).
    fn bind_read_only(source: &Path, target: &Path) -> Mount {
        fs::create_dir_all(target).expect("mount point");
        run(Command::new("mount").arg("--bind").arg(source).arg(target));
        let guard = Mount {
            target: target.to_path_buf(),
        };
        run(Command::new("mount")
            .args(["-o", "remount,bind,ro"])
            .arg(target));
        guard
    }

    fn remount(&self, mode: &str) {
        run(Command::new("mount")
            .arg("-o")
            .arg(format!("remount,{mode}"))
            .arg(&self.target));
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        // Lazy, so a store a failed assertion left open cannot keep the mount around.
        let _ = Command::new("umount").arg("-l").arg(&self.target).status();
    }
}

fn consumer(n: u64) -> ConsumerId {
    ConsumerId(uuid::Uuid::from_u64_pair(0x5eed, n))
}

/// A record with a fat facts section, so each commit takes a few pages of the log.
fn record(id: u64, generation: u64, owner: Option<u64>) -> DeviceRecord {
    let function = (id % 8) as u8;
    let slot = ((id / 8) % 32) as u8;
    DeviceRecord {
        id: RecordId(id),
        facts: DeviceFacts {
            address: PciAddress::new(0, 0x5e, slot, function).expect("address"),
            vendor_id: VendorId(0x15b3),
            device_id: DeviceId(0x101e),
            driver: Some("mlx5_core".into()),
            iommu_group: Some(100 + id as u32),
            numa_node: Some(0),
            physfn: None,
            is_pf: false,
            physnets: (0..12)
                .map(|i| {
                    format!("physnet-{i:02}-{}", "x".repeat(40))
                        .parse::<PhysNet>()
                        .expect("physnet")
                })
                .collect(),
            managed: true,
            instance: None,
        },
        generation: Generation(generation),
        present: true,
        claim: owner.map(|n| Claim {
            owner: Owner {
                consumer: consumer(n),
                label: "faults".parse().expect("label"),
            },
            request_id: format!("r-{generation}").parse().expect("request id"),
            claimed_at: generation,
            since: None,
            vfio: None,
        }),
        attached: None,
    }
}

/// The change set of step `step`: four records rewritten and one request logged.
fn step_change(step: u64) -> ChangeSet {
    let upserts: Vec<DeviceRecord> = (0..4)
        .map(|k| record(step * 4 + k + 1, step + 1, Some(step)))
        .collect();
    let first = &upserts[0];
    ChangeSet {
        prev_host_generation: Generation(step),
        host_generation: Generation(step + 1),
        requests: vec![RequestEntry {
            consumer: consumer(step),
            request_id: format!("r-{}", step + 1).parse().expect("request id"),
            outcome: Outcome::Claimed {
                address: first.address(),
                record: first.id,
                generation: first.generation,
            },
            at: step,
        }],
        upserts,
        ..ChangeSet::default()
    }
}

/// What the store must hold after the acknowledged change sets.
fn expected(acked: &[ChangeSet]) -> Snapshot {
    let mut snap = Snapshot::default();
    for cs in acked {
        for r in &cs.upserts {
            snap.records.insert(r.id, r.clone());
        }
        snap.requests.extend(cs.requests.iter().cloned());
        snap.host_generation = cs.host_generation;
    }
    // `at` grows with each step, so this is already the store's order.
    snap
}

/// Commits successive steps until the disk is full; returns the failed change set.
fn fill(store: &mut Store, acked: &mut Vec<ChangeSet>) -> ChangeSet {
    for _ in 0..10_000 {
        let cs = step_change(acked.len() as u64);
        match store.commit(std::slice::from_ref(&cs)) {
            Ok(()) => acked.push(cs),
            Err(e) => {
                assert!(e.is_disk_full(), "expected a full disk, got {e}: {e:?}");
                let text = e.to_string();
                assert!(text.contains(DB_FILE), "names the file: {text}");
                eprintln!(
                    "disk full after {} acknowledged commits: {text} (cause: {})",
                    acked.len(),
                    std::error::Error::source(&e)
                        .map(|s| s.to_string())
                        .unwrap_or_default()
                );
                return cs;
            }
        }
    }
    panic!("the tmpfs never filled up");
}

#[test]
fn a_full_disk_rejects_the_batch_and_loses_nothing_acknowledged() {
    require_root("a_full_disk_rejects_the_batch_and_loses_nothing_acknowledged");
    let tmp = TempDir::new().expect("tempdir");
    let mnt = tmp.path().join("full");
    let _mount = Mount::tmpfs(&mnt, "512k");
    let dir = mnt.join("state");
    // Two fillers to free later, one per recovery below.
    let filler = |n: u32| mnt.join(format!("filler{n}"));
    fs::write(filler(1), vec![0u8; 64 * 1024]).expect("filler 1");
    fs::write(filler(2), vec![0u8; 64 * 1024]).expect("filler 2");

    let mut store = Store::open(&dir).expect("open on tmpfs");
    let mut acked = Vec::new();
    let failed = fill(&mut store, &mut acked);
    assert!(acked.len() > 3, "a few commits fit before the disk fills");
    // The same store still reads, and holds exactly what was acknowledged.
    assert_eq!(store.load().expect("load when full"), expected(&acked));
    // Retrying while full fails the same way and changes nothing.
    let again = store
        .commit(std::slice::from_ref(&failed))
        .expect_err("still full");
    assert!(again.is_disk_full(), "{again}");
    assert_eq!(store.load().expect("load"), expected(&acked));

    // Space comes back: the same connection commits again.
    fs::remove_file(filler(1)).expect("free filler 1");
    store
        .commit(std::slice::from_ref(&failed))
        .expect("commit once space is back");
    acked.push(failed);
    assert_eq!(store.load().expect("load"), expected(&acked));

    // Fill again, then restart the daemon while the disk is full.
    let failed = fill(&mut store, &mut acked);
    drop(store);
    let mut store = Store::open(&dir).expect("reopen on a full disk");
    assert_eq!(
        store.load().expect("load after reopen"),
        expected(&acked),
        "exactly the acknowledged changes after a restart on a full disk"
    );

    fs::remove_file(filler(2)).expect("free filler 2");
    store
        .commit(std::slice::from_ref(&failed))
        .expect("commit after reopen once space is back");
    acked.push(failed);
    drop(store);
    let store = Store::open(&dir).expect("reopen");
    assert_eq!(store.load().expect("load"), expected(&acked));
    eprintln!("acknowledged {} commits in all, none lost", acked.len());
}

/// Populates a store in `dir` and returns what it holds and the database's bytes.
fn populate(dir: &Path) -> (Snapshot, Vec<u8>) {
    let mut store = Store::open(dir).expect("open");
    let batch: Vec<ChangeSet> = (0..3).map(step_change).collect();
    store.commit(&batch).expect("commit");
    let snap = store.load().expect("load");
    drop(store);
    let bytes = fs::read(dir.join(DB_FILE)).expect("db bytes");
    (snap, bytes)
}

fn assert_read_only_refusal(dir: &Path, what: &str) {
    let err = Store::open(dir).expect_err(what);
    assert!(
        matches!(err, StoreError::ReadOnly { .. }),
        "{what}: expected ReadOnly, got {err}: {err:?}"
    );
    assert!(
        err.to_string().contains(&dir.display().to_string()),
        "{what}: names the state directory: {err}"
    );
}

#[test]
fn a_read_only_state_dir_is_refused_and_left_untouched() {
    require_root("a_read_only_state_dir_is_refused_and_left_untouched");
    let tmp = TempDir::new().expect("tempdir");
    let mnt = tmp.path().join("ro");
    let mount = Mount::tmpfs(&mnt, "4m");
    let dir = mnt.join("state");
    let (snap, bytes) = populate(&dir);
    fs::create_dir(mnt.join("empty")).expect("empty dir");

    mount.remount("ro");
    assert_read_only_refusal(&dir, "existing store on a read-only mount");
    assert_eq!(fs::read(dir.join(DB_FILE)).expect("db"), bytes, "untouched");
    assert_read_only_refusal(&mnt.join("empty"), "empty dir on a read-only mount");
    assert_read_only_refusal(&mnt.join("absent"), "absent dir on a read-only mount");
    assert!(!mnt.join("absent").exists());

    mount.remount("rw");
    let store = Store::open(&dir).expect("open once writable");
    assert_eq!(store.load().expect("load"), snap);
}

#[test]
fn a_read_only_bind_mount_is_refused_and_left_untouched() {
    require_root("a_read_only_bind_mount_is_refused_and_left_untouched");
    let tmp = TempDir::new().expect("tempdir");
    let source = tmp.path().join("source");
    let (snap, bytes) = populate(&source);
    let view = tmp.path().join("view");
    let bind = Mount::bind_read_only(&source, &view);
    assert_read_only_refusal(&view, "store through a read-only bind mount");
    drop(bind);
    assert_eq!(
        fs::read(source.join(DB_FILE)).expect("db"),
        bytes,
        "untouched"
    );
    let store = Store::open(&source).expect("open the writable original");
    assert_eq!(store.load().expect("load"), snap);
}

/// Through the writer: claims on a filling disk are refused with a store error, the
/// published view (the ledger in memory) is exactly what was acknowledged, and claims
/// work again once space is back.
#[test]
fn a_full_disk_rejects_claims_through_the_writer_and_memory_stays_acknowledged() {
    use hostdevd::ledger::{ClaimRequest, ClaimTarget, DeviceFacts, Ledger, Owner};
    use hostdevd::pci::{DeviceId, OwnerLabel, PciAddress, VendorId};
    use hostdevd::writer::{WriteError, Writer};

    require_root("a_full_disk_rejects_claims_through_the_writer_and_memory_stays_acknowledged");
    let outer = tempfile::tempdir().expect("tempdir");
    let _m = Mount::tmpfs(outer.path(), "512k");
    let dir = outer.path().join("state");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let store = Store::open(&dir).expect("open");
    let (writer, _t) = Writer::start(Ledger::new(), store, 64).expect("writer");
    let facts: Vec<DeviceFacts> = (0..200u32)
        .map(|i| DeviceFacts {
            address: PciAddress::new(0, (i / 32) as u8 + 0x10, (i % 32) as u8, 0).expect("addr"),
            vendor_id: VendorId(0x8086),
            device_id: DeviceId(0x154c),
            driver: None,
            iommu_group: None,
            numa_node: None,
            physfn: None,
            is_pf: false,
            physnets: vec![],
            managed: true,
            instance: None,
        })
        .collect();
    rt.block_on(writer.inventory(facts.clone()))
        .expect("inventory fits");
    // Fill the rest of the file system.
    let mut chunk = 0;
    while std::fs::write(
        outer.path().join(format!("filler{chunk}")),
        vec![0u8; 16 << 10],
    )
    .is_ok()
    {
        chunk += 1;
    }
    let mut acked = 0;
    let mut refused = None;
    for (i, f) in facts.iter().enumerate() {
        let before = writer.view();
        let g = before
            .device(f.address)
            .next()
            .map(|v| v.record.generation)
            .expect("device");
        let res = rt.block_on(writer.claim(ClaimRequest {
            target: ClaimTarget::Address {
                address: f.address,
                expected_generation: g,
            },
            owner: Owner {
                consumer: consumer(i as u64 + 1),
                label: OwnerLabel::try_from(String::new()).expect("label"),
            },
            request_id: format!("r{i}").parse().expect("rid"),
        }));
        match res {
            Ok(_) => acked += 1,
            Err(WriteError::Store(e)) => {
                assert!(e.is_disk_full(), "{e}");
                let after = writer.view();
                assert_eq!(
                    after.ledger, before.ledger,
                    "memory unchanged by the refused claim"
                );
                refused = Some(f.address);
                break;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    let refused = refused.expect("the disk filled up before 200 claims");
    let claimed = writer
        .view()
        .devices()
        .iter()
        .filter(|v| v.record.claim.is_some())
        .count();
    assert_eq!(claimed, acked);
    // Space comes back: the same claim now succeeds.
    for c in 0..chunk {
        let _ = std::fs::remove_file(outer.path().join(format!("filler{c}")));
    }
    let g = writer
        .view()
        .device(refused)
        .next()
        .map(|v| v.record.generation)
        .expect("device");
    rt.block_on(writer.claim(ClaimRequest {
        target: ClaimTarget::Address {
            address: refused,
            expected_generation: g,
        },
        owner: Owner {
            consumer: consumer(9999),
            label: OwnerLabel::try_from(String::new()).expect("label"),
        },
        request_id: "after".parse().expect("rid"),
    }))
    .expect("claim after space is back");
    drop(writer);
}

/// Writes zeros to `path` until the file system is full (ENOSPC).
fn fill_up(path: &Path) {
    use std::io::Write;
    let mut f = fs::File::create(path).expect("filler");
    let block = vec![0u8; 4096];
    loop {
        match f.write(&block) {
            Ok(n) if n > 0 => {}
            Ok(_) => panic!("a zero-byte write on {}", path.display()),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
                return;
            }
        }
    }
}

use hostdevd::client::Client;

/// Starts the real daemon on `cfg_path`; returns it and a client once its socket answers.
async fn start(cfg_path: &Path, socket: &Path) -> (support::Daemon, Client) {
    let daemon = support::Daemon::serve(
        Command::new(env!("CARGO_BIN_EXE_hostdevd"))
            .args(["serve", "--config"])
            .arg(cfg_path),
        socket,
    )
    .await;
    let c = hostdevd::client::connect(socket).await.expect("connect");
    (daemon, c)
}

async fn list(c: &mut Client) -> Vec<proto::Device> {
    c.list_devices(proto::ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner()
        .devices
}

/// The device at `a` in a listing, which must hold it.
fn listed(devices: &[proto::Device], a: &str) -> proto::Device {
    devices
        .iter()
        .find(|d| d.address == a)
        .unwrap_or_else(|| panic!("{a} listed"))
        .clone()
}

/// A claim of `d` while the disk is full: refused as UNAVAILABLE, nothing written.
async fn refused_while_full(c: &mut Client, d: &proto::Device) {
    let refused = c
        .claim(claim(d, "while-full"))
        .await
        .expect_err("nothing can be written");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
}

/// Why a call was refused: its ErrorInfo reason.
fn reason(s: &tonic::Status) -> String {
    use tonic_types::StatusExt;
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

/// Claims the device at `address` as listed now, once the scan owed since the start is
/// stored: until then every change is refused as UNAVAILABLE, SCAN_NOT_STORED (the
/// ledger may not match the devices). Its generation.
async fn claim_once_scanned(c: &mut Client, address: &str, id: &str) -> u64 {
    let start = std::time::Instant::now();
    loop {
        let d = listed(&list(c).await, address);
        match c.claim(claim(&d, id)).await {
            Ok(r) => return r.into_inner().generation,
            Err(e) if e.code() == Code::Unavailable && reason(&e) == "SCAN_NOT_STORED" => {
                assert!(
                    start.elapsed() < std::time::Duration::from_secs(40),
                    "the owed scan was stored once space was back: {e:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => panic!("claim of {address}: {e:?}"),
        }
    }
}

async fn host_generation(c: &mut Client) -> u64 {
    c.get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner()
        .host_generation
}

fn claim(vf: &proto::Device, id: &str) -> proto::ClaimRequest {
    proto::ClaimRequest {
        owner: Some(proto::Owner {
            consumer_id: uuid::Uuid::from_u128(1).to_string(),
            label: "vm-1".into(),
        }),
        request_id: id.into(),
        target: Some(proto::claim_request::Target::Address(proto::ByAddress {
            address: vf.address.clone(),
            expected_generation: vf.generation,
        })),
        vfio: false,
    }
}

/// A host for the full-disk tests: a PF with 2 VFs, and a config whose state dir is on a
/// 1 MiB tmpfs (`mnt`, filled up with [`fill_up`]), libvirt off, uevents as `hotplug`,
/// and `top` (top-level keys) before the tables.
struct SmallDisk {
    tree: hostdevd::simhost::FakeTree,
    // Unmounted before the directory it is in is removed: fields drop in this order.
    _mount: Mount,
    mnt: PathBuf,
    socket: PathBuf,
    cfg_path: PathBuf,
    /// The VFs' addresses.
    vfs: Vec<String>,
    _tmp: TempDir,
}

impl SmallDisk {
    fn new(hotplug: bool, top: &str) -> SmallDisk {
        let mut f = hostdevd::simhost::FakeSys::new();
        f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2)
            .vf_iommu_groups("0000:3b:00.0", 40);
        let vfs = f
            .vfs("0000:3b:00.0")
            .iter()
            .map(|a| a.to_string())
            .collect();
        let tree = f.build();
        let tmp = TempDir::new().expect("tempdir");
        let mnt = tmp.path().join("full");
        let mount = Mount::tmpfs(&mnt, "1m");
        let socket = tmp.path().join("hostdevd.sock");
        let cfg_path = tmp.path().join("config.toml");
        fs::write(
            &cfg_path,
            format!(
                "{top}sysfs_root = {:?}\ndev_root = {:?}\nstate_dir = {:?}\n\
                 [api]\nsocket = {:?}\n[libvirt]\nenabled = false\n[hotplug]\nenabled = {hotplug}\n",
                tree.sysfs_root(),
                tree.dev_root(),
                mnt.join("state"),
                socket,
            ),
        )
        .expect("config");
        SmallDisk {
            tree,
            _mount: mount,
            mnt,
            socket,
            cfg_path,
            vfs,
            _tmp: tmp,
        }
    }
}

/// The real daemon restarted on a state dir whose disk is 100% full, after a clean stop
/// (no write-ahead log left), and again after a reboot: it starts and serves reads,
/// although neither the host generation it raises at start nor a new boot id can be
/// stored; changes are refused as UNAVAILABLE until space is freed, and then go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_on_a_full_disk_serves_reads() {
    require_root("a_restart_on_a_full_disk_serves_reads");
    // A proc tree of the test's own, for the boot id.
    let tmp_proc = TempDir::new().expect("tempdir");
    let proc_root = tmp_proc.path().join("proc");
    let boot_id = proc_root.join("sys/kernel/random/boot_id");
    fs::create_dir_all(boot_id.parent().expect("dir")).expect("proc");
    fs::write(&boot_id, "first-boot\n").expect("boot id");
    let disk = SmallDisk::new(false, &format!("proc_root = {proc_root:?}\n"));
    let (mnt, socket, cfg_path) = (disk.mnt.clone(), disk.socket.clone(), disk.cfg_path.clone());
    // A first run claims VF 0 and stops cleanly.
    let (daemon, mut c) = start(&cfg_path, &socket).await;
    let devices = list(&mut c).await;
    let vfs: Vec<proto::Device> = devices.into_iter().filter(|d| d.managed).collect();
    assert_eq!(vfs.len(), 2, "{vfs:?}");
    let first = c
        .claim(claim(&vfs[0], "first"))
        .await
        .expect("claim")
        .into_inner()
        .generation;
    daemon.terminate().await;
    let state = mnt.join("state");
    assert!(!state.join("hostdevd.db-wal").exists(), "a clean stop");

    // The disk fills up; the daemon starts again, the same boot, and serves reads.
    fill_up(&mnt.join("filler"));
    let (daemon, mut c) = start(&cfg_path, &socket).await;
    let raised = host_generation(&mut c).await;
    assert!(raised > first, "{raised} > {first}");
    daemon.terminate().await;

    // And after a reboot, whose new boot id cannot be stored either.
    fs::write(&boot_id, "second-boot\n").expect("boot id");
    let (daemon, mut c) = start(&cfg_path, &socket).await;
    let devices = list(&mut c).await;
    let raised = host_generation(&mut c).await;
    assert!(raised > first, "{raised} > {first}");
    let vf0 = listed(&devices, &vfs[0].address);
    assert_eq!(vf0.generation, first, "the claim as stored");
    assert!(vf0.owner.is_some(), "still claimed");
    let vf1 = listed(&devices, &vfs[1].address);
    refused_while_full(&mut c, &vf1).await;

    // Space is freed: once the new boot's scan is stored, the next change goes through,
    // past the generation raised in memory, and is stored with it.
    fs::remove_file(mnt.join("filler")).expect("free space");
    let after = claim_once_scanned(&mut c, &vf1.address, "after").await;
    assert!(after > raised, "{after} > {raised}");
    daemon.terminate().await;
    let store = Store::open(&state).expect("open");
    assert!(
        store.host_generation().expect("host generation") >= Generation(after),
        "the raised generation was stored with the next commit"
    );
}

/// The real daemon restarted on a full disk after the hardware changed while it was
/// stopped (a VF now on another NUMA node): its first scan cannot be stored, yet it
/// starts and serves reads (the ledger as the disk holds it, the store's health saying
/// why), refuses changes as UNAVAILABLE, and applies the scan once space is back. An
/// earlier version failed the start, and so would have looped under systemd without
/// serving even a listing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_scan_refused_by_a_full_disk_does_not_stop_the_start() {
    require_root("a_first_scan_refused_by_a_full_disk_does_not_stop_the_start");
    let disk = SmallDisk::new(false, "");
    let tree = &disk.tree;
    let (mnt, socket, cfg_path) = (disk.mnt.clone(), disk.socket.clone(), disk.cfg_path.clone());
    let vf = disk.vfs[0].clone();
    let numa = |devices: &[proto::Device]| listed(devices, &vf).numa_node;
    let (daemon, mut c) = start(&cfg_path, &socket).await;
    let devices = list(&mut c).await;
    let before = numa(&devices);
    assert_ne!(before, Some(1));
    // The other VF, claimed before the stop.
    let other = listed(&devices, &disk.vfs[1]);
    let first = c
        .claim(claim(&other, "before-the-stop"))
        .await
        .expect("claim")
        .into_inner()
        .generation;
    daemon.terminate().await;

    fill_up(&mnt.join("filler"));
    tree.write_attr(&vf, "numa_node", b"1\n");
    let (daemon, mut c) = start(&cfg_path, &socket).await;
    let devices = list(&mut c).await;
    assert_eq!(numa(&devices), before, "the ledger as stored");
    let store = c
        .get_status(proto::GetStatusRequest {})
        .await
        .expect("status")
        .into_inner()
        .store
        .expect("store health");
    assert!(!store.ok, "{store:?}");
    let free = listed(&devices, &vf);
    refused_while_full(&mut c, &free).await;

    // Space is freed between two tries of the scan (one second after the start, then
    // three): a change at once is still refused, since the ledger does not yet know the
    // VF moved, and so is any until that scan is stored. Before, the claim went through
    // on the old record, to be marked lost by the scan a moment later.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    fs::remove_file(mnt.join("filler")).expect("free space");
    let early = c
        .claim(claim(&free, "before-the-scan"))
        .await
        .expect_err("the scan is not stored yet");
    assert_eq!(
        (early.code(), reason(&early).as_str()),
        (Code::Unavailable, "SCAN_NOT_STORED"),
        "{early:?}"
    );
    // A retry of the claim applied before the stop is answered from the log meanwhile,
    // as the first answer: told "unavailable", its client could give up on it.
    let replay = c
        .claim(claim(&other, "before-the-stop"))
        .await
        .expect("a retry of an applied claim")
        .into_inner();
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(replay.generation, first);
    let start = std::time::Instant::now();
    let devices = loop {
        let devices = list(&mut c).await;
        if numa(&devices) == Some(1) {
            break devices;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the first scan applied once space is back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let now = listed(&devices, &vf);
    c.claim(claim(&now, "after"))
        .await
        .expect("claim once space is back");
    daemon.terminate().await;
}

/// A hotplug removal whose rescan the ledger cannot take (the disk is full) is owed, not
/// dropped: the agent tries it again until it is applied, and the removed VF leaves the
/// listing once space is back. An earlier version logged the failure and forgot the
/// event, so the VF stayed listed (free and claimable) until the next full rescan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hotplug_rescan_refused_by_a_full_disk_is_retried_until_applied() {
    require_root("a_hotplug_rescan_refused_by_a_full_disk_is_retried_until_applied");
    let disk = SmallDisk::new(true, "");
    let tree = &disk.tree;
    let (mnt, socket, cfg_path) = (disk.mnt.clone(), disk.socket.clone(), disk.cfg_path.clone());
    // A first run writes the ledger and stops cleanly (no write-ahead log left), so that
    // on the full disk the next commit has nowhere to go.
    let (daemon, _c) = start(&cfg_path, &socket).await;
    daemon.terminate().await;
    fill_up(&mnt.join("filler"));
    let (daemon, mut c) = start(&cfg_path, &socket).await;
    let vf = list(&mut c)
        .await
        .into_iter()
        .find(|d| d.managed)
        .expect("a VF")
        .address;

    tree.remove_device(&vf);
    support::fakekernel::send_uevent("remove", &vf);
    let hotplug = |s: proto::AgentStatus| s.hotplug.expect("hotplug health");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let h = hotplug(
            c.get_status(proto::GetStatusRequest {})
                .await
                .expect("status")
                .into_inner(),
        );
        if !h.ok {
            assert!(h.detail.contains("retried"), "{}", h.detail);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the rescan never failed on the full disk: {}",
            h.detail
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(
        list(&mut c).await.iter().any(|d| d.address == vf),
        "the ledger could not take the removal yet"
    );

    // Space is back: the owed rescan goes through without another event.
    fs::remove_file(mnt.join("filler")).expect("free space");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while list(&mut c).await.iter().any(|d| d.address == vf) {
        assert!(
            std::time::Instant::now() < deadline,
            "the removed VF is still listed a minute after space came back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let h = hotplug(
        c.get_status(proto::GetStatusRequest {})
            .await
            .expect("status")
            .into_inner(),
    );
    assert!(h.ok, "healthy again once applied: {}", h.detail);
    daemon.terminate().await;
}

/// A VF count change whose record the full disk refuses leaves the ledger listing the
/// VFs the kernel may have destroyed: the PF and its VFs stay held back (claims refused
/// `VF_COUNT_CHANGING`, answered without a write, not taken), and once space is back the
/// full scan the change owes applies with no other event or call, and the PF is
/// claimable again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vf_count_change_refused_by_a_full_disk_holds_its_pf_until_a_full_scan() {
    use tonic_types::StatusExt;
    require_root("a_vf_count_change_refused_by_a_full_disk_holds_its_pf_until_a_full_scan");
    let disk = SmallDisk::new(false, "");
    let (mnt, socket, cfg_path) = (disk.mnt.clone(), disk.socket.clone(), disk.cfg_path.clone());
    const PF: &str = "0000:3b:00.0";
    // The PF managed as well as its VFs.
    let mut cfg = fs::read_to_string(&cfg_path).expect("config");
    cfg.push_str("[[devices]]\naddress = \"0000:3b:*.*\"\n");
    fs::write(&cfg_path, cfg).expect("config");
    // A first run writes the ledger and stops cleanly (no write-ahead log left), so that
    // on the full disk the next commit has nowhere to go.
    let (daemon, _c) = start(&cfg_path, &socket).await;
    daemon.terminate().await;
    fill_up(&mnt.join("filler"));
    let (daemon, mut c) = start(&cfg_path, &socket).await;
    let pf = listed(&list(&mut c).await, PF);
    let e = c
        .set_vf_count(proto::SetVfCountRequest {
            address: PF.into(),
            vf_count: 1,
            generation: pf.generation,
            ..Default::default()
        })
        .await
        .expect_err("the change's record refused");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    let reason = |e: &tonic::Status| e.get_details_error_info().expect("ErrorInfo").reason;
    let before = list(&mut c).await;
    for a in [PF, disk.vfs[0].as_str()] {
        let now = listed(&before, a);
        let e = c
            .claim(claim(&now, &format!("while-full-{a}")))
            .await
            .expect_err("held back");
        assert_eq!(reason(&e), "VF_COUNT_CHANGING", "{a}: {e:?}");
    }
    assert_eq!(list(&mut c).await, before, "refusals change nothing");

    // Space is back: the owed full scan applies, and the PF is claimable.
    fs::remove_file(mnt.join("filler")).expect("free space");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let now = listed(&list(&mut c).await, PF);
        match c
            .claim(claim(&now, &format!("after-{}", now.generation)))
            .await
        {
            Ok(_) => break,
            Err(e) => {
                assert_eq!(reason(&e), "VF_COUNT_CHANGING", "{e:?}");
                assert!(
                    std::time::Instant::now() < deadline,
                    "the PF still held back a minute after space came back"
                );
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    daemon.terminate().await;
}
