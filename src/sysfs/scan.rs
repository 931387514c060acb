//! Walking `bus/pci/devices` under a sysfs root into an [`Inventory`], and rescanning one device.
//!
//! Cost matters (thousands of VFs per host): each attribute is read once, each IOMMU
//! group's `devices/` directory is listed once per scan and shared by its members, and a
//! VF's index comes from its PF's already-read `virtfnN` links instead of re-listing the
//! PF directory once per VF.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::pci::{DeviceId, PciAddress, VendorId};

use super::attr::{self, read_link_address, read_link_name, read_link_number, read_text};
use super::{Inventory, PciDevice, PciNames, SriovInfo, SysfsError, BUS_DEVICES, VFIO_PCI_DRIVER};

/// Where the IOMMU groups live, relative to the sysfs root.
const IOMMU_GROUPS: &str = "kernel/iommu_groups";

/// A PF's VFs as (VF index, address), sorted by index.
type VfList = Vec<(u32, PciAddress)>;

/// The members of each IOMMU group seen so far in one scan, or why the group's
/// `devices/` directory could not be listed.
type GroupCache = HashMap<u32, Result<Vec<PciAddress>, String>>;

struct Ctx<'a> {
    sysfs_root: &'a Path,
    dev_root: &'a Path,
    names: &'a PciNames,
    groups: GroupCache,
}

/// Scans every PCI device under `sysfs_root`, sorted by address.
///
/// Fails only when `<sysfs_root>/bus/pci/devices` itself cannot be listed (a wrong root,
/// or no PCI bus), or its listing breaks off part way: a shorter list would read as
/// devices gone. Problems with single devices never fail the scan; they are reported in
/// each device's `errors`.
pub fn scan(sysfs_root: &Path, dev_root: &Path, names: &PciNames) -> Result<Inventory, SysfsError> {
    let bus = sysfs_root.join(BUS_DEVICES);
    let entries = fs::read_dir(&bus).map_err(|source| SysfsError::ListDir {
        path: bus.clone(),
        source,
    })?;
    let mut inventory = Inventory::default();
    let mut addresses = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| SysfsError::ListDir {
            path: bus.clone(),
            source,
        })?;
        let name = entry.file_name();
        match name.to_str().map(str::parse::<PciAddress>) {
            Some(Ok(a)) => addresses.push(a),
            _ => inventory.errors.push(format!(
                "{} is not named after a PCI address, so it was skipped",
                entry.path().display()
            )),
        }
    }
    addresses.sort_unstable();
    addresses.dedup();

    let mut ctx = Ctx {
        sysfs_root,
        dev_root,
        names,
        groups: GroupCache::new(),
    };
    let mut vf_lists: HashMap<PciAddress, VfList> = HashMap::new();
    for &addr in &addresses {
        let (dev, vfs) = read_device(&mut ctx, addr);
        if let Some(vfs) = vfs {
            vf_lists.insert(addr, vfs);
        }
        inventory.devices.push(dev);
    }
    for dev in &mut inventory.devices {
        let Some(pf) = dev.physfn else { continue };
        match vf_lists.get(&pf) {
            Some(vfs) => set_vf_index(dev, pf, vfs),
            // The PF is not listed on the bus (or has no sriov_totalvfs): ask its
            // directory directly.
            None => resolve_vf_index(sysfs_root, dev),
        }
    }
    for e in &inventory.errors {
        tracing::warn!("{e}");
    }
    Ok(inventory)
}

/// Rescans a single device (after a hotplug event). `Ok(None)` when no entry for it
/// exists under `bus/pci/devices`; a device whose entry exists but whose attributes
/// cannot be read is returned with its `errors`, as in [`scan`].
pub fn scan_one(
    sysfs_root: &Path,
    dev_root: &Path,
    names: &PciNames,
    address: PciAddress,
) -> Result<Option<PciDevice>, SysfsError> {
    let link = super::device_dir(sysfs_root, address);
    match fs::symlink_metadata(&link) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(SysfsError::Read { path: link, source }),
    }
    let mut ctx = Ctx {
        sysfs_root,
        dev_root,
        names,
        groups: GroupCache::new(),
    };
    let (mut dev, _) = read_device(&mut ctx, address);
    if dev.physfn.is_some() {
        resolve_vf_index(sysfs_root, &mut dev);
    }
    Ok(Some(dev))
}

/// How many times [`settle`] reads a device again before it gives up.
const SETTLE_READS: usize = 3;

/// What a device read with problems turned out to be (see [`settle`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Settled {
    /// The device as it is: read without problems, or with the same problems twice
    /// running (an odd file that stays odd).
    Read(PciDevice),
    /// Not on the host: removed while it was read.
    Gone,
    /// Every read found other problems than the one before: something under it kept
    /// changing. The last read, for its details.
    Unsettled(PciDevice),
}

/// Tells a device whose read found problems from one that changed while it was read, by
/// reading it again: a device removed in the middle of its read (a VF count change, a
/// hot-unplug) would otherwise be taken for a present device whose identity, driver,
/// PF and IOMMU group are unknown, and those unknowns would replace what the ledger knew
/// of it. A device read without problems is returned as it is, at no cost.
pub fn settle(
    sysfs_root: &Path,
    dev_root: &Path,
    names: &PciNames,
    dev: PciDevice,
) -> Result<Settled, SysfsError> {
    settle_with(dev, |a| scan_one(sysfs_root, dev_root, names, a))
}

/// [`settle`], reading the device again with `read_again`.
fn settle_with(
    dev: PciDevice,
    mut read_again: impl FnMut(PciAddress) -> Result<Option<PciDevice>, SysfsError>,
) -> Result<Settled, SysfsError> {
    if dev.errors.is_empty() {
        return Ok(Settled::Read(dev));
    }
    let mut last = dev;
    for _ in 0..SETTLE_READS {
        if last.vanished {
            return Ok(Settled::Gone);
        }
        let Some(again) = read_again(last.address)? else {
            return Ok(Settled::Gone);
        };
        if !again.vanished && (again.errors.is_empty() || again.errors == last.errors) {
            return Ok(Settled::Read(again));
        }
        last = again;
    }
    Ok(if last.vanished {
        Settled::Gone
    } else {
        Settled::Unsettled(last)
    })
}

/// Reads every attribute of one device; also returns a PF's VF list for the VF-index pass.
fn read_device(ctx: &mut Ctx<'_>, address: PciAddress) -> (PciDevice, Option<VfList>) {
    let mut dev = PciDevice::new(address);
    let dir = super::device_dir(ctx.sysfs_root, address);

    // A dangling bus link (the device was removed after the directory was listed) or a
    // non-directory: every attribute read would fail the same way, so report it once.
    match fs::metadata(&dir) {
        Ok(m) if m.is_dir() => dev.instance = Some(std::os::unix::fs::MetadataExt::ino(&m)),
        Ok(_) => {
            let err = SysfsError::DeviceGone {
                address,
                path: dir.clone(),
                source: io::Error::from(io::ErrorKind::NotADirectory),
            };
            dev.problem("device", &err);
            return (dev, None);
        }
        Err(source) => {
            dev.vanished = source.kind() == io::ErrorKind::NotFound;
            let err = SysfsError::DeviceGone {
                address,
                path: dir.clone(),
                source,
            };
            dev.problem("device", &err);
            return (dev, None);
        }
    }

    dev.vendor_id = read_parsed(&mut dev, &dir, "vendor", |p, v| {
        attr::parse_id16(p, v).map(VendorId)
    });
    dev.device_id = read_parsed(&mut dev, &dir, "device", |p, v| {
        attr::parse_id16(p, v).map(DeviceId)
    });
    dev.subsystem_vendor_id = read_parsed(&mut dev, &dir, "subsystem_vendor", |p, v| {
        attr::parse_id16(p, v).map(VendorId)
    });
    dev.subsystem_device_id = read_parsed(&mut dev, &dir, "subsystem_device", |p, v| {
        attr::parse_id16(p, v).map(DeviceId)
    });
    dev.class = read_parsed(&mut dev, &dir, "class", attr::parse_class);
    dev.revision = read_parsed(&mut dev, &dir, "revision", attr::parse_revision);

    if let Some(v) = dev.vendor_id {
        dev.vendor_name = ctx.names.shared_vendor_name(v);
        if let Some(d) = dev.device_id {
            dev.device_name = ctx.names.shared_device_name(v, d);
        }
    }

    match read_link_name(&dir.join("driver")) {
        Ok(d) => dev.driver = d.map(|d| ctx.names.share(&d)),
        Err(e) => dev.problem("driver", &e),
    }
    // Not `driver_override`: the kernel shows it under the device's lock, so reading it
    // waits out any bind, unbind or probe of the device, and nothing here needs it (a
    // hardware action reads it itself when it must).
    // Absent without CONFIG_NUMA: no affinity, not an error.
    match attr::read_optional_text(&dir.join("numa_node")) {
        Ok(Some(v)) => match attr::parse_numa_node(&dir.join("numa_node"), &v) {
            Ok(n) => dev.numa_node = n,
            Err(e) => dev.problem("numa_node", &e),
        },
        Ok(None) => {}
        Err(e) => dev.problem("numa_node", &e),
    }

    read_iommu(ctx, &mut dev, &dir);
    read_netdevs(&mut dev, &dir);
    let vfs = read_sriov(&mut dev, &dir);

    match read_link_address(&dir.join("physfn")) {
        Ok(p) => dev.physfn = p,
        Err(e) => dev.problem("physfn", &e),
    }

    if dev.driver.as_deref() == Some(VFIO_PCI_DRIVER) {
        if let Some(group) = dev.iommu_group {
            let vfio = ctx.dev_root.join("vfio");
            let node = vfio.join(group.to_string());
            // Without an IOMMU, vfio's unsafe no-IOMMU mode names the node noiommu-N.
            let noiommu = vfio.join(format!("noiommu-{group}"));
            let (path, exists) =
                if node.symlink_metadata().is_err() && noiommu.symlink_metadata().is_ok() {
                    (noiommu, true)
                } else {
                    let exists = node.symlink_metadata().is_ok();
                    (node, exists)
                };
            dev.vfio_group = Some(path);
            dev.vfio_group_exists = exists;
        }
        match super::vfio_device_nodes(&dir, ctx.dev_root) {
            Ok(nodes) => {
                dev.vfio_device = nodes
                    .into_iter()
                    .find(|node| node.symlink_metadata().is_ok());
            }
            Err(e) => dev.problem("vfio-dev", &e),
        }
    }
    (dev, vfs)
}

/// Reads and parses one required attribute, recording any problem under its name.
fn read_parsed<T>(
    dev: &mut PciDevice,
    dir: &Path,
    name: &str,
    parse: impl FnOnce(&Path, &str) -> Result<T, SysfsError>,
) -> Option<T> {
    let path = dir.join(name);
    match read_text(&path).and_then(|v| parse(&path, &v)) {
        Ok(v) => Some(v),
        Err(e) => {
            dev.problem(name, &e);
            None
        }
    }
}

fn read_iommu(ctx: &mut Ctx<'_>, dev: &mut PciDevice, dir: &Path) {
    let group = match read_link_number(&dir.join("iommu_group")) {
        Ok(Some(g)) => g,
        Ok(None) => return,
        Err(e) => {
            dev.problem("iommu_group", &e);
            return;
        }
    };
    dev.iommu_group = Some(group);
    let sysfs_root = ctx.sysfs_root;
    let members = ctx
        .groups
        .entry(group)
        .or_insert_with(|| list_group(sysfs_root, group));
    match members {
        Ok(m) => {
            dev.iommu_group_peers = m.iter().copied().filter(|a| *a != dev.address).collect();
        }
        Err(e) => {
            let msg = format!("iommu_group: {e}");
            dev.errors.push(msg);
        }
    }
}

/// Lists `kernel/iommu_groups/N/devices`, whose entries are named after the members.
fn list_group(sysfs_root: &Path, group: u32) -> Result<Vec<PciAddress>, String> {
    let path = sysfs_root
        .join(IOMMU_GROUPS)
        .join(group.to_string())
        .join("devices");
    let failed = |source| {
        SysfsError::ListDir {
            path: path.clone(),
            source,
        }
        .full_message()
    };
    let entries = fs::read_dir(&path).map_err(failed)?;
    let mut members: Vec<PciAddress> = Vec::new();
    for entry in entries {
        // A listing cut short would hide members, whose VFIO nodes a free must check.
        let entry = entry.map_err(failed)?;
        // Non-PCI members (rare: platform devices) are not ours to report.
        if let Some(a) = entry.file_name().to_str().and_then(|n| n.parse().ok()) {
            members.push(a);
        }
    }
    members.sort_unstable();
    Ok(members)
}

fn read_netdevs(dev: &mut PciDevice, dir: &Path) {
    let net = dir.join("net");
    let entries = match fs::read_dir(&net) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return,
        Err(source) => {
            dev.listing_problem("net", &net, source);
            return;
        }
    };
    for entry in entries {
        match entry {
            Ok(e) => match e.file_name().into_string() {
                Ok(name) => dev.netdevs.push(name),
                Err(raw) => dev.errors.push(format!(
                    "net: the interface name {raw:?} under {} is not UTF-8",
                    net.display()
                )),
            },
            Err(source) => dev.listing_problem("net", &net, source),
        }
    }
    dev.netdevs.sort();
}

/// Fills `sriov` for a PF and returns its VFs by index; `None` for a non-PF.
fn read_sriov(dev: &mut PciDevice, dir: &Path) -> Option<VfList> {
    let total_path = dir.join("sriov_totalvfs");
    let total = match attr::read_optional_text(&total_path) {
        Ok(None) => return None,
        Ok(Some(v)) => attr::parse_u32(&total_path, &v).unwrap_or_else(|e| {
            dev.problem("sriov_totalvfs", &e);
            0
        }),
        Err(e) => {
            dev.problem("sriov_totalvfs", &e);
            0
        }
    };
    // Shown under the PF's lock in the kernel, so read with a limit: a VF count change
    // still running holds it for as long as it takes, and the scan must not wait with
    // it. When it cannot be read, the VFs the PF shows are the best count there is.
    let num_path = dir.join("sriov_numvfs");
    let num = attr::read_text_within(&num_path, attr::LOCKED_READ_LIMIT)
        .and_then(|v| attr::parse_u32(&num_path, &v))
        .map_err(|e| {
            dev.held |= matches!(e, SysfsError::NoAnswer { .. });
            dev.problem("sriov_numvfs", &e)
        })
        .ok();
    let vfs = list_virtfns(dev, dir);
    dev.sriov = Some(SriovInfo {
        total_vfs: total,
        num_vfs: num.unwrap_or(vfs.len() as u32),
        vfs: vfs.iter().map(|(_, a)| *a).collect(),
    });
    Some(vfs)
}

/// The `virtfnN` links of a PF directory that resolve, sorted by N; the others are
/// recorded as problems of `dev`.
fn list_virtfns(dev: &mut PciDevice, dir: &Path) -> VfList {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(source) => {
            dev.listing_problem("virtfn", dir, source);
            return Vec::new();
        }
    };
    let mut vfs = Vec::new();
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(source) => {
                // Named, as a link that cannot be read is: the list is short.
                dev.listing_problem("virtfn", dir, source);
                break;
            }
        };
        let name = entry.file_name();
        let Some(index) = name.to_str().and_then(attr::virtfn_index) else {
            continue;
        };
        let link = entry.path();
        match read_link_address(&link) {
            Ok(Some(a)) => vfs.push((index, a)),
            // Listed a moment ago, gone now: the VF is being destroyed.
            Ok(None) => {}
            Err(e) => dev.problem(&format!("virtfn{index}"), &e),
        }
    }
    vfs.sort_unstable();
    vfs
}

fn set_vf_index(dev: &mut PciDevice, pf: PciAddress, vfs: &VfList) {
    match vfs.iter().find(|(_, a)| *a == dev.address) {
        Some((i, _)) => dev.vf_index = Some(*i),
        None => dev.errors.push(format!(
            "physfn: no virtfnN link of the physical function {pf} points back to this device"
        )),
    }
}

/// Finds a VF's index by listing its PF's directory (for a single-device rescan).
fn resolve_vf_index(sysfs_root: &Path, dev: &mut PciDevice) {
    let Some(pf) = dev.physfn else { return };
    let pf_dir: PathBuf = super::device_dir(sysfs_root, pf);
    let mut pf_rec = PciDevice::new(pf);
    let vfs = list_virtfns(&mut pf_rec, &pf_dir);
    // Problems with the PF's other links belong to the PF, not to this VF.
    set_vf_index(dev, pf, &vfs);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(errors: &[&str], vanished: bool) -> PciDevice {
        let mut d = PciDevice::new("0000:3b:02.1".parse().expect("address"));
        d.errors = errors.iter().map(|e| e.to_string()).collect();
        d.vanished = vanished;
        d
    }

    /// `first` settled with the reads of `then` in turn; also how many were asked for.
    fn settled(first: PciDevice, then: Vec<Option<PciDevice>>) -> (Settled, usize) {
        let mut reads = then.into_iter();
        let mut asked = 0;
        let out = settle_with(first, |_| {
            asked += 1;
            Ok(reads.next().expect("no more reads than given"))
        })
        .expect("settle");
        (out, asked)
    }

    #[test]
    fn a_clean_read_stands_unread_again() {
        let clean = read(&[], false);
        assert_eq!(settled(clean.clone(), vec![]), (Settled::Read(clean), 0));
    }

    #[test]
    fn a_device_removed_while_read_is_gone() {
        // Its directory gone with its bus entry still there.
        assert_eq!(
            settled(read(&["device: gone"], true), vec![]).0,
            Settled::Gone
        );
        // Its entry gone by the next read.
        assert_eq!(
            settled(read(&["vendor: gone"], false), vec![None]),
            (Settled::Gone, 1)
        );
        assert_eq!(
            settled(
                read(&["vendor: gone"], false),
                vec![Some(read(&["device: gone"], true))]
            )
            .0,
            Settled::Gone
        );
    }

    #[test]
    fn problems_seen_twice_are_the_devices_and_a_clean_second_read_stands() {
        let odd = read(&["numa_node: holds \"seven\""], false);
        assert_eq!(
            settled(odd.clone(), vec![Some(odd.clone())]),
            (Settled::Read(odd.clone()), 1)
        );
        let clean = read(&[], false);
        assert_eq!(
            settled(odd, vec![Some(clean.clone())]),
            (Settled::Read(clean), 1)
        );
    }

    #[test]
    fn problems_that_keep_changing_leave_it_unsettled() {
        let reads: Vec<Option<PciDevice>> = (0..SETTLE_READS)
            .map(|n| Some(read(&[&format!("driver: read {n}")], false)))
            .collect();
        let last = reads.last().cloned().flatten().expect("a read");
        assert_eq!(
            settled(read(&["driver: first"], false), reads),
            (Settled::Unsettled(last), SETTLE_READS)
        );
    }
}
