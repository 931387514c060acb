//! A stand-in for the kernel's side of a fake sysfs tree: it answers writes to
//! `drivers_probe`, `drivers/*/bind|unbind`, `driver_override` and `sriov_numvfs = 0`
//! by changing the tree as the kernel would, and sends the uevents the kernel would
//! send (on the real netlink uevent group, which needs root).
//!
//! It polls the files (every 2 ms), so the agent's writes land in regular files first:
//! what the agent's own step checks see is exactly the kernel's delayed answer.

use std::collections::HashSet;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::socket::{
    bind, sendto, socket, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};

/// Sends one kernel-style PCI uevent to the uevent multicast group.
pub fn send_uevent(action: &str, address: &str) {
    send_uevent_numbered(action, address, 1);
}

/// [`send_uevent`] with the kernel's sequence number `seqnum`.
pub fn send_uevent_numbered(action: &str, address: &str, seqnum: u64) {
    let devpath = format!("/devices/pci0000:00/{address}");
    send(&format!(
        "{action}@{devpath}\0ACTION={action}\0DEVPATH={devpath}\0SUBSYSTEM=pci\0PCI_SLOT_NAME={address}\0SEQNUM={seqnum}\0"
    ));
}

/// Sends the uevent the kernel sends when `address`'s network interface `old` becomes
/// `new` (udev renaming it): subsystem `net`, action `move`.
pub fn send_rename_uevent(address: &str, old: &str, new: &str) {
    let parent = format!("/devices/pci0000:00/{address}/net");
    send(&format!(
        "move@{parent}/{new}\0ACTION=move\0DEVPATH={parent}/{new}\0DEVPATH_OLD={parent}/{old}\0SUBSYSTEM=net\0INTERFACE={new}\0SEQNUM=2\0"
    ));
}

/// Sends one message to the kernel's uevent multicast group, as the kernel would.
fn send(msg: &str) {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkKObjectUEvent,
    )
    .expect("netlink socket (needs root)");
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).expect("bind netlink");
    sendto(
        fd.as_raw_fd(),
        msg.as_bytes(),
        &NetlinkAddr::new(0, 1),
        MsgFlags::empty(),
    )
    .expect("send uevent (needs root)");
}

/// The running stand-in; stops when dropped.
pub struct FakeKernel {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl FakeKernel {
    pub fn start(sysfs: &Path, dev: &Path) -> FakeKernel {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, d, flag) = (sysfs.to_path_buf(), dev.to_path_buf(), stop.clone());
        let handle = std::thread::spawn(move || {
            let mut empty_overrides = HashSet::new();
            while !flag.load(Ordering::Relaxed) {
                tick(&s, &d, &mut empty_overrides);
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        FakeKernel {
            stop,
            handle: Some(handle),
        }
    }
}

impl Drop for FakeKernel {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Takes what was written to a request file and empties it.
fn take(p: &Path) -> Option<String> {
    let s = fs::read_to_string(p).ok()?;
    let s = s.trim().to_string();
    if s.is_empty() {
        return None;
    }
    fs::write(p, "").ok()?;
    Some(s)
}

fn dev_dir(sysfs: &Path, a: &str) -> Option<PathBuf> {
    fs::canonicalize(sysfs.join("bus/pci/devices").join(a)).ok()
}

fn link_name(p: &Path) -> Option<String> {
    fs::read_link(p)
        .ok()?
        .file_name()?
        .to_str()
        .map(str::to_string)
}

fn do_bind(sysfs: &Path, dev: &Path, a: &str, drv: &str) {
    let Some(dir) = dev_dir(sysfs, a) else { return };
    let drv_dir = sysfs.join("bus/pci/drivers").join(drv);
    if !drv_dir.is_dir() || dir.join("driver").exists() {
        return;
    }
    let _ = symlink(
        fs::canonicalize(&drv_dir).unwrap_or(drv_dir.clone()),
        dir.join("driver"),
    );
    let _ = symlink(&dir, drv_dir.join(a));
    if drv == "vfio-pci" {
        if let Some(g) = link_name(&dir.join("iommu_group")) {
            let _ = fs::create_dir_all(dev.join("vfio"));
            let _ = fs::write(dev.join("vfio").join(g), "");
        }
    }
    send_uevent("bind", a);
}

fn do_unbind(sysfs: &Path, dev: &Path, a: &str) {
    let Some(dir) = dev_dir(sysfs, a) else { return };
    let Some(drv) = link_name(&dir.join("driver")) else {
        return;
    };
    let _ = fs::remove_file(dir.join("driver"));
    let _ = fs::remove_file(sysfs.join("bus/pci/drivers").join(&drv).join(a));
    if drv == "vfio-pci" {
        if let Some(g) = link_name(&dir.join("iommu_group")) {
            let _ = fs::remove_file(dev.join("vfio").join(g));
        }
    }
    send_uevent("unbind", a);
}

fn tick(sysfs: &Path, dev: &Path, empty_overrides: &mut HashSet<PathBuf>) {
    let bus = sysfs.join("bus/pci");
    if let Ok(drivers) = fs::read_dir(bus.join("drivers")) {
        for d in drivers.flatten() {
            let name = d.file_name().to_string_lossy().to_string();
            if let Some(a) = take(&d.path().join("unbind")) {
                do_unbind(sysfs, dev, &a);
            }
            if let Some(a) = take(&d.path().join("bind")) {
                do_bind(sysfs, dev, &a, &name);
            }
        }
    }
    if let Some(a) = take(&bus.join("drivers_probe")) {
        if let Some(dir) = dev_dir(sysfs, &a) {
            let ov = fs::read_to_string(dir.join("driver_override")).unwrap_or_default();
            let ov = ov.trim();
            if dir.join("driver").exists() {
                // The kernel's unbind is synchronous; here it may still be pending in
                // its file: probe on a later tick, after it.
                let _ = fs::write(bus.join("drivers_probe"), &a);
            } else if !ov.is_empty() && ov != "(null)" {
                do_bind(sysfs, dev, &a, ov);
            }
        }
    }
    let Ok(devices) = fs::read_dir(bus.join("devices")) else {
        return;
    };
    for e in devices.flatten() {
        let Ok(dir) = fs::canonicalize(e.path()) else {
            continue;
        };
        // A cleared override reads "(null)". Only an override found empty on two ticks
        // in a row is rewritten: one seen once may be the agent's own write between its
        // O_TRUNC and its write(2).
        let ov = dir.join("driver_override");
        if fs::read_to_string(&ov).is_ok_and(|s| s.trim().is_empty()) {
            if !empty_overrides.insert(ov.clone()) {
                let _ = fs::write(&ov, "(null)\n");
                empty_overrides.remove(&ov);
            }
        } else {
            empty_overrides.remove(&ov);
        }
        // sriov_numvfs = 0: the kernel removes every VF, each with a remove event.
        let numvfs = fs::read_to_string(dir.join("sriov_numvfs")).unwrap_or_default();
        if numvfs.trim() == "0" {
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for v in entries.flatten() {
                let n = v.file_name().to_string_lossy().to_string();
                if !n.starts_with("virtfn") {
                    continue;
                }
                if let Ok(vf) = fs::canonicalize(v.path()) {
                    let a = vf
                        .file_name()
                        .map(|f| f.to_string_lossy().to_string())
                        .unwrap_or_default();
                    if let Some(g) = link_name(&vf.join("iommu_group")) {
                        let _ = fs::remove_file(
                            sysfs
                                .join("kernel/iommu_groups")
                                .join(g)
                                .join("devices")
                                .join(&a),
                        );
                    }
                    if let Some(drv) = link_name(&vf.join("driver")) {
                        let _ = fs::remove_file(bus.join("drivers").join(drv).join(&a));
                    }
                    let _ = fs::remove_file(bus.join("devices").join(&a));
                    let _ = fs::remove_dir_all(&vf);
                    send_uevent("remove", &a);
                }
                let _ = fs::remove_file(v.path());
            }
        }
    }
}
