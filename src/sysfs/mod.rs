//! The read-only inventory of PCI devices under a sysfs root: ids, names, driver, IOMMU group, NUMA node, SR-IOV links, netdevs, VFIO group and device nodes.
//!
//! The sysfs root and the dev root are always passed in ([`DEFAULT_SYSFS_ROOT`] and
//! [`DEFAULT_DEV_ROOT`] exist only as defaults for configuration), so tests point the
//! same code at a fake tree. A scan never aborts because of one device: whatever could
//! not be read is named, with its path, in that device's [`PciDevice::errors`], and every
//! other device is still listed.
//!
//! - [`attr`]: reading and parsing single attributes and links.
//! - [`names`]: the PCI ID database.
//! - [`render`]: the human-readable table of `hostdevd scan`.

pub mod attr;
pub mod names;
pub mod render;
mod scan;

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::pci::{DeviceId, PciAddress, VendorId};

pub use names::PciNames;
pub use scan::{scan, scan_one, settle, Settled};

/// The kernel's uevent sequence number now (`<sysfs_root>/kernel/uevent_seqnum`): every
/// uevent sent so far has a number at most this. Read before a scan, it tells an event
/// the scan already saw the effect of from one it did not. `None` where the file is
/// missing or unreadable (a test tree).
pub fn uevent_seqnum(sysfs_root: &Path) -> Option<u64> {
    attr::read_optional_text(&sysfs_root.join("kernel/uevent_seqnum"))
        .ok()
        .flatten()
        .and_then(|v| v.parse().ok())
}

/// The PCI function behind network interface `name` (`<sysfs_root>/class/net/<name>/device`,
/// the link the kernel makes for an interface of a device): how a domain's `<interface
/// type='direct'>` (macvtap on a VF's interface) names the VF it uses. The device may
/// be an auxiliary device of the function (an mlx5 sub-function's interface): the
/// function above it, through auxiliary devices only. `None` for a name no interface
/// has, or one that could not be a name (a path), for an interface without a device (a
/// bridge, a bond) or whose device is gone, and for one on another bus (USB: the
/// controller above it is not what the interface uses).
pub fn netdev_device(sysfs_root: &Path, name: &str) -> Result<Option<PciAddress>, SysfsError> {
    // IFNAMSIZ is 16 with its NUL; a slash or a dot name would leave class/net.
    if name.is_empty() || name.len() > 15 || name.contains('/') || name == "." || name == ".." {
        return Ok(None);
    }
    let link = sysfs_root.join("class/net").join(name).join("device");
    let auxiliary = |dir: &Path| {
        attr::read_link_name(&dir.join("subsystem"))
            .ok()
            .flatten()
            .as_deref()
            == Some("auxiliary")
    };
    pci_function_through(sysfs_root, &link, auxiliary)
}

/// The PCI function a mediated device (`<hostdev type='mdev'>`, a vGPU or another slice
/// of a function) is made on: its parent in the device tree
/// (`<sysfs_root>/bus/mdev/devices/<uuid>` links into the parent's directory). `None`
/// for a UUID no mdev has now (not created, or removed), for one that is not a UUID, and
/// for an mdev whose parent is no PCI function (s390's channel and crypto devices).
pub fn mdev_device(sysfs_root: &Path, uuid: &str) -> Result<Option<PciAddress>, SysfsError> {
    let Ok(uuid) = uuid::Uuid::parse_str(uuid) else {
        return Ok(None);
    };
    let link = sysfs_root.join("bus/mdev/devices").join(uuid.to_string());
    pci_function_above(sysfs_root, &link)
}

/// The PCI function a vDPA device is on, from its vhost-vdpa character device as a
/// domain names it (`/dev/vhost-vdpa-N`): `<sysfs_root>/class/vhost-vdpa/vhost-vdpa-N`
/// sits under the vDPA device, which sits under its PCI function (directly, or under an
/// auxiliary device of it, as mlx5's does). `None` for a path that is not a vhost-vdpa
/// node, for one no device has now, and for a vDPA device on no PCI function (VDUSE, a
/// simulator).
pub fn vhost_vdpa_device(sysfs_root: &Path, path: &str) -> Result<Option<PciAddress>, SysfsError> {
    let name = path.rsplit('/').next().unwrap_or_default();
    let numbered = name
        .strip_prefix("vhost-vdpa-")
        .is_some_and(|n| !n.is_empty() && n.len() <= 10 && n.bytes().all(|b| b.is_ascii_digit()));
    if !numbered {
        return Ok(None);
    }
    let link = sysfs_root.join("class/vhost-vdpa").join(name);
    pci_function_above(sysfs_root, &link)
}

/// Where the kernel lists mediated devices and vhost-vdpa nodes, relative to the sysfs
/// root: each directory exists only while its module is loaded (mdev, vhost_vdpa).
const MDEV_DEVICES: &str = "bus/mdev/devices";
const VHOST_VDPA_CLASS: &str = "class/vhost-vdpa";

/// Devices made on a PCI function that a process can hold open without opening any node
/// of the function itself: mediated devices (a vGPU or another slice, each in an IOMMU
/// group of its own) and vDPA devices' vhost-vdpa nodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MadeOn {
    /// Each mediated device's directory, with the IOMMU group it is in (`None` while it
    /// is in none: bound to no VFIO driver).
    pub mdevs: Vec<(PathBuf, Option<u32>)>,
    /// The names of the vhost-vdpa nodes (`vhost-vdpa-N`) of vDPA devices on it.
    pub vhost_vdpa: Vec<String>,
}

/// Whether any device can be made on a PCI function under this root now: false only when
/// neither the mdev bus nor the vhost-vdpa class exists (neither module loaded). Any other
/// failure to stat them proves nothing, so it counts as possible.
pub fn made_on_possible(sysfs_root: &Path) -> bool {
    [MDEV_DEVICES, VHOST_VDPA_CLASS]
        .iter()
        .any(|d| match sysfs_root.join(d).symlink_metadata() {
            Err(e) => e.kind() != io::ErrorKind::NotFound,
            Ok(_) => true,
        })
}

/// The mediated devices and vhost-vdpa nodes made on each of the functions at
/// `addresses` now (see [`MadeOn`]), found from the kernel's lists of them (each read
/// once, however many functions are asked about): an mdev whose parent is the function,
/// a vhost-vdpa node anywhere below it (under an auxiliary device, as mlx5's are).
/// Functions with none are left out. A list that cannot be read is an error, never an
/// empty answer: a device left out could be one in use.
pub fn made_on(
    sysfs_root: &Path,
    addresses: &[PciAddress],
) -> Result<BTreeMap<PciAddress, MadeOn>, SysfsError> {
    let mut out: BTreeMap<PciAddress, MadeOn> = BTreeMap::new();
    if addresses.is_empty() {
        return Ok(out);
    }
    let root = std::fs::canonicalize(sysfs_root).unwrap_or_else(|_| sysfs_root.to_path_buf());
    let wanted: std::collections::BTreeSet<PciAddress> = addresses.iter().copied().collect();
    let asked = |a: Option<PciAddress>| a.filter(|a| wanted.contains(a));
    for (name, target) in listed(&sysfs_root.join(MDEV_DEVICES))? {
        let parent = target
            .parent()
            .filter(|p| p.starts_with(&root))
            .and_then(Path::file_name)
            .and_then(|n| n.to_str()?.parse().ok());
        if let (true, Some(function)) = (uuid::Uuid::parse_str(&name).is_ok(), asked(parent)) {
            let group =
                attr::read_link_name(&target.join("iommu_group"))?.and_then(|g| g.parse().ok());
            out.entry(function).or_default().mdevs.push((target, group));
        }
    }
    for (name, target) in listed(&sysfs_root.join(VHOST_VDPA_CLASS))? {
        let numbered = attr::numbered("vhost-vdpa-", &name).is_some();
        if let (true, Some(function)) = (numbered, asked(function_above(&root, &target))) {
            out.entry(function).or_default().vhost_vdpa.push(name);
        }
    }
    Ok(out)
}

/// Each entry of the kernel's list `dir` (links to devices) with the directory it
/// resolves to, sorted by name; none when the list does not exist. An entry removed while
/// it is read is left out: that device is gone.
fn listed(dir: &Path) -> Result<Vec<(String, PathBuf)>, SysfsError> {
    let mut out = Vec::new();
    for name in attr::names_in(dir)? {
        if let Some(target) = resolved(&dir.join(&name))? {
            out.push((name, target));
        }
    }
    Ok(out)
}

/// The nearest directory above `link`'s target, within the sysfs tree, named as a PCI
/// function. `None` when the link is absent or dangling (the device is gone) or no PCI
/// function is above it.
fn pci_function_above(sysfs_root: &Path, link: &Path) -> Result<Option<PciAddress>, SysfsError> {
    pci_function_through(sysfs_root, link, |_| true)
}

/// [`pci_function_above`], passing only through directories that `pass` lets through
/// on the way up (`None` at the first it does not).
fn pci_function_through(
    sysfs_root: &Path,
    link: &Path,
    pass: impl Fn(&Path) -> bool,
) -> Result<Option<PciAddress>, SysfsError> {
    let Some(target) = resolved(link)? else {
        return Ok(None);
    };
    let root = std::fs::canonicalize(sysfs_root).unwrap_or_else(|_| sysfs_root.to_path_buf());
    Ok(function_through(&root, &target, pass))
}

/// Where `link` leads, resolved; `None` when it is absent or dangling (the device is
/// gone).
fn resolved(link: &Path) -> Result<Option<PathBuf>, SysfsError> {
    match std::fs::canonicalize(link) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(SysfsError::ReadLink {
            path: link.to_path_buf(),
            source,
        }),
    }
}

/// The nearest directory at or above `target` (resolved), below the resolved sysfs
/// `root`, named as a PCI function.
fn function_above(root: &Path, target: &Path) -> Option<PciAddress> {
    function_through(root, target, |_| true)
}

/// [`function_above`], passing only through directories that `pass` lets through.
fn function_through(
    root: &Path,
    target: &Path,
    pass: impl Fn(&Path) -> bool,
) -> Option<PciAddress> {
    for dir in target
        .ancestors()
        .take_while(|dir| *dir != root && dir.starts_with(root))
    {
        if let Some(a) = dir.file_name().and_then(|n| n.to_str()?.parse().ok()) {
            return Some(a);
        }
        if !pass(dir) {
            return None;
        }
    }
    None
}

/// The default sysfs mount point. The only place this literal may appear; everything
/// else receives the root as a parameter.
pub const DEFAULT_SYSFS_ROOT: &str = "/sys";

/// The default device node root (for `/dev/vfio/N`). Same rule as [`DEFAULT_SYSFS_ROOT`].
pub const DEFAULT_DEV_ROOT: &str = "/dev";

/// The name under which the kernel registers the VFIO PCI driver.
pub const VFIO_PCI_DRIVER: &str = "vfio-pci";

/// Where the PCI bus lists its devices, relative to the sysfs root.
pub(crate) const BUS_DEVICES: &str = "bus/pci/devices";

/// A device's directory as the PCI bus lists it: `<sysfs_root>/bus/pci/devices/<address>`
/// (a link to the device's place in the tree).
pub fn device_dir(sysfs_root: &Path, address: PciAddress) -> PathBuf {
    sysfs_root.join(BUS_DEVICES).join(address.to_string())
}

/// The instance of the device at `address` now: its directory's inode number, as a
/// scan reads it ([`PciDevice::instance`]); `None` where no device is there.
pub fn device_instance(sysfs_root: &Path, address: PciAddress) -> Option<u64> {
    let m = std::fs::metadata(device_dir(sysfs_root, address)).ok()?;
    m.is_dir().then(|| std::os::unix::fs::MetadataExt::ino(&m))
}

/// Where the iommufd interface's device nodes live: `<dev_root>/vfio/devices`.
pub fn vfio_device_nodes_dir(dev_root: &Path) -> PathBuf {
    dev_root.join("vfio/devices")
}

/// The device nodes sysfs lists for the device at `device_dir` (`vfio-dev/vfioX`), as
/// paths under [`vfio_device_nodes_dir`], whether or not each exists; none when the
/// device is not bound to vfio-pci or is gone.
pub fn vfio_device_nodes(device_dir: &Path, dev_root: &Path) -> Result<Vec<PathBuf>, SysfsError> {
    let nodes = vfio_device_nodes_dir(dev_root);
    Ok(attr::vfio_device_names(device_dir)?
        .into_iter()
        .map(|n| nodes.join(n))
        .collect())
}

/// Why something in a sysfs tree could not be read. Every message names the path; the
/// underlying cause is kept as the error's `source()` (see [`SysfsError::full_message`]).
#[derive(Debug, thiserror::Error)]
pub enum SysfsError {
    #[error("could not list the directory {path}")]
    ListDir { path: PathBuf, source: io::Error },
    #[error("could not read {path}")]
    Read { path: PathBuf, source: io::Error },
    #[error("could not read the link {path}")]
    ReadLink { path: PathBuf, source: io::Error },
    #[error("the link {path} points to {target}, which does not exist")]
    DanglingLink {
        path: PathBuf,
        target: PathBuf,
        source: io::Error,
    },
    #[error("the link {path} points to {target}, whose name is not {expected}")]
    BadLink {
        path: PathBuf,
        target: PathBuf,
        expected: &'static str,
    },
    #[error("{path} is longer than {limit} bytes, so it is not a kernel attribute")]
    TooLong { path: PathBuf, limit: usize },
    #[error("{path} is not valid UTF-8")]
    NotUtf8 {
        path: PathBuf,
        source: std::str::Utf8Error,
    },
    #[error("{path} holds {value:?}, expected {expected}")]
    Malformed {
        path: PathBuf,
        value: String,
        expected: &'static str,
    },
    /// A read the kernel did not answer within `after`, or (`earlier`) not started
    /// because an earlier read of the same path still waits.
    #[error("{path} did not answer {}: the kernel holds the device, as it does while a VF count change runs", waited(.after, .earlier))]
    NoAnswer {
        path: PathBuf,
        after: Duration,
        earlier: bool,
    },
    #[error("the device directory {path} of {address} vanished or is unreadable")]
    DeviceGone {
        address: PciAddress,
        path: PathBuf,
        source: io::Error,
    },
}

/// How long a read the kernel did not answer waited, in words.
pub fn waited(after: &Duration, earlier: &bool) -> String {
    if *earlier {
        "(an earlier read of it still waits in the kernel)".to_string()
    } else {
        format!("within {after:?}")
    }
}

impl SysfsError {
    /// The message followed by its chain of causes, for places that keep only text
    /// (a device's `errors`).
    pub fn full_message(&self) -> String {
        let mut msg = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(c) = cause {
            msg.push_str(": ");
            msg.push_str(&c.to_string());
            cause = c.source();
        }
        msg
    }
}

/// A 24-bit PCI class code (base class, subclass, programming interface), shown and
/// serialized as 6 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClassCode(pub u32);

impl ClassCode {
    pub fn base(&self) -> u8 {
        (self.0 >> 16) as u8
    }
    pub fn subclass(&self) -> u8 {
        (self.0 >> 8) as u8
    }
    pub fn prog_if(&self) -> u8 {
        self.0 as u8
    }

    /// Whether a function of this class has a bridge's configuration header (a PCI-to-PCI
    /// bridge, 0x0604, a semi-transparent one, 0x0609, or a CardBus bridge, 0x0607): no
    /// device for vfio-pci, which binds only normal (type 0) headers, and none a guest
    /// needs of its IOMMU group.
    pub fn is_bridge(&self) -> bool {
        self.base() == 0x06 && matches!(self.subclass(), 0x04 | 0x07 | 0x09)
    }
}

impl fmt::Display for ClassCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:06x}", self.0)
    }
}

impl Serialize for ClassCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// An 8-bit PCI revision id, shown and serialized as 2 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Revision(pub u8);

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02x}", self.0)
    }
}

impl Serialize for Revision {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The SR-IOV side of a physical function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SriovInfo {
    /// `sriov_totalvfs`: the most VFs the PF can create (0 if unreadable).
    pub total_vfs: u32,
    /// `sriov_numvfs`: how many VFs are enabled now; when it cannot be read, the number
    /// of VFs in `vfs`.
    pub num_vfs: u32,
    /// The VFs from the PF's `virtfnN` links, in VF-index order (`virtfn10` after
    /// `virtfn9`); links that point nowhere are left out and named in `errors`.
    pub vfs: Vec<PciAddress>,
}

/// One PCI function as sysfs describes it. The serialized form is the JSON entry of
/// `hostdevd scan --json`; fields marked `skip` are for the daemon's own use.
///
/// Id fields are `None` (JSON null) only when their attribute could not be read, and then
/// `errors` says why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PciDevice {
    pub address: PciAddress,
    pub vendor_id: Option<VendorId>,
    pub device_id: Option<DeviceId>,
    pub subsystem_vendor_id: Option<VendorId>,
    pub subsystem_device_id: Option<DeviceId>,
    pub class: Option<ClassCode>,
    pub revision: Option<Revision>,
    /// Shared by every device with the same name (see [`PciNames`]).
    pub vendor_name: Option<Arc<str>>,
    pub device_name: Option<Arc<str>>,
    /// The bound driver's name; `None` when unbound.
    pub driver: Option<Arc<str>>,
    pub iommu_group: Option<u32>,
    /// `None` when the kernel reports -1 (no affinity) or has no NUMA support.
    pub numa_node: Option<u32>,
    /// Network interfaces under the device's `net/`, sorted.
    pub netdevs: Vec<String>,
    /// For a VF: its physical function.
    pub physfn: Option<PciAddress>,
    /// For a VF: N such that `physfn/virtfnN` points back to it.
    pub vf_index: Option<u32>,
    /// For a PF (a device with `sriov_totalvfs`).
    pub sriov: Option<SriovInfo>,
    /// `<devroot>/vfio/N` when bound to vfio-pci and in IOMMU group N.
    pub vfio_group: Option<PathBuf>,
    /// `<devroot>/vfio/devices/vfioX` when bound to vfio-pci, listed by sysfs as
    /// `vfio-dev/vfioX`, and the node exists (the iommufd interface, Linux 6.6 and
    /// later; older kernels list the name but have no node).
    pub vfio_device: Option<PathBuf>,
    /// One sentence per attribute or link that could not be read, each naming it.
    pub errors: Vec<String>,
    /// The other devices in the same IOMMU group (this device excluded), sorted.
    #[serde(skip)]
    pub iommu_group_peers: Vec<PciAddress>,
    /// Whether `vfio_group` exists as a node under the dev root.
    #[serde(skip)]
    pub vfio_group_exists: bool,
    /// Whether its entry on the bus was there but its directory was not (a device removed
    /// while the scan read it): listed, with the problem in `errors`, but not a device
    /// the host has (see [`scan::settle`]).
    #[serde(skip)]
    pub vanished: bool,
    /// Whether the kernel held the device past [`attr::LOCKED_READ_LIMIT`] (a PF whose
    /// `sriov_numvfs` did not answer: a VF count change runs on it): what was read of
    /// it and of its VFs is mid-change, to be read again once the change is done.
    #[serde(skip)]
    pub held: bool,
    /// Which instance of a device at this address it is: the inode number of its sysfs
    /// directory. The kernel gives every directory it makes a number of its own (sysfs
    /// numbers them in sequence and does not reuse one), so a function removed and made
    /// again (a hot-unplug and re-add, VFs destroyed and created) reads as another
    /// number, even where no uevent said so. Only comparable within one boot.
    #[serde(skip)]
    pub instance: Option<u64>,
}

impl PciDevice {
    /// A record with only the address filled in; the scan fills the rest.
    pub fn new(address: PciAddress) -> Self {
        Self {
            address,
            vendor_id: None,
            device_id: None,
            subsystem_vendor_id: None,
            subsystem_device_id: None,
            class: None,
            revision: None,
            vendor_name: None,
            device_name: None,
            driver: None,
            iommu_group: None,
            numa_node: None,
            netdevs: Vec::new(),
            physfn: None,
            vf_index: None,
            sriov: None,
            vfio_group: None,
            vfio_device: None,
            errors: Vec::new(),
            iommu_group_peers: Vec::new(),
            vfio_group_exists: false,
            vanished: false,
            held: false,
            instance: None,
        }
    }

    /// Whether the device is bound to vfio-pci.
    pub fn is_vfio_bound(&self) -> bool {
        self.driver.as_deref() == Some(VFIO_PCI_DRIVER)
    }

    /// Whether this is an SR-IOV virtual function.
    pub fn is_vf(&self) -> bool {
        self.physfn.is_some()
    }

    /// Whether this is an SR-IOV physical function.
    pub fn is_pf(&self) -> bool {
        self.sriov.is_some()
    }

    /// Records that the directory `path` (under `attribute`) could not be listed, or not
    /// to its end: the list read from it is short.
    pub(crate) fn listing_problem(&mut self, attribute: &str, path: &Path, source: io::Error) {
        let path = path.to_path_buf();
        self.problem(attribute, &SysfsError::ListDir { path, source });
    }

    /// Records a problem with one attribute or link.
    pub(crate) fn problem(&mut self, attribute: &str, err: &SysfsError) {
        tracing::debug!(address = %self.address, attribute, error = %err, "sysfs attribute problem");
        self.errors
            .push(format!("{attribute}: {}", err.full_message()));
    }
}

/// Every PCI device under a sysfs root, sorted by address.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct Inventory {
    pub devices: Vec<PciDevice>,
    /// Entries of `bus/pci/devices` that are not devices at all (a name that is not a PCI
    /// address), one sentence each. Not part of the JSON.
    #[serde(skip)]
    pub errors: Vec<String>,
}

impl Inventory {
    /// The device at `address`, if present.
    pub fn get(&self, address: PciAddress) -> Option<&PciDevice> {
        self.devices
            .binary_search_by_key(&address, |d| d.address)
            .ok()
            .and_then(|i| self.devices.get(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simhost::{addr, FakeSys};

    #[test]
    fn bridges_are_told_by_their_class() {
        for c in [0x060400, 0x060401, 0x060700, 0x060900] {
            assert!(ClassCode(c).is_bridge(), "{c:06x}");
        }
        // A host bridge, an ISA bridge and an Ethernet controller have normal headers.
        for c in [0x060000, 0x060100, 0x020000, 0x010802] {
            assert!(!ClassCode(c).is_bridge(), "{c:06x}");
        }
    }

    #[test]
    fn an_interface_names_the_pci_function_it_is_on() {
        let mut f = FakeSys::new();
        f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2)
            .netdev("0000:3b:00.0", "ens1f0");
        let vf = f.vfs("0000:3b:00.0")[1].to_string();
        f.netdev(&vf, "ens1f0v1");
        let t = f.build();
        let root = t.sysfs_root();
        assert_eq!(
            netdev_device(root, "ens1f0v1").expect("read"),
            Some(addr(&vf))
        );
        assert_eq!(
            netdev_device(root, "ens1f0").expect("read"),
            Some(addr("0000:3b:00.0"))
        );
        // No such interface, names that are paths or too long, an interface without a
        // device (a bridge), one on another bus, one whose device is gone.
        for name in ["eth9", "", ".", "..", "../net/ens1f0", "ens1f0v1ens1f0v1"] {
            assert_eq!(netdev_device(root, name).expect(name), None, "{name}");
        }
        let net = root.join("class/net");
        std::fs::create_dir_all(net.join("br0")).expect("bridge");
        std::fs::create_dir_all(root.join("devices/usb1/1-1:1.0")).expect("usb device");
        std::fs::create_dir_all(net.join("usb0")).expect("usb interface");
        std::os::unix::fs::symlink("../../../devices/usb1/1-1:1.0", net.join("usb0/device"))
            .expect("link");
        std::fs::create_dir_all(net.join("gone0")).expect("interface");
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:00/0000:00:09.0",
            net.join("gone0/device"),
        )
        .expect("link");
        for name in ["br0", "usb0", "gone0"] {
            assert_eq!(netdev_device(root, name).expect(name), None, "{name}");
        }
        // An mlx5 sub-function's interface: its device is an auxiliary device of the PF
        // (and the interface's own auxiliary device under it), so the PF is what it uses.
        let sf = root.join("devices/pci0000:3b/0000:3b:00.0/mlx5_core.sf.2");
        std::fs::create_dir_all(sf.join("mlx5_core.eth.2")).expect("sf");
        std::fs::create_dir_all(root.join("bus/auxiliary")).expect("bus");
        for dir in [sf.clone(), sf.join("mlx5_core.eth.2")] {
            let up = "../".repeat(dir.strip_prefix(root).expect("under").components().count());
            std::os::unix::fs::symlink(format!("{up}bus/auxiliary"), dir.join("subsystem"))
                .expect("subsystem");
        }
        for (name, device) in [
            ("enp59s0f0s2", "mlx5_core.sf.2"),
            ("sf2eth", "mlx5_core.sf.2/mlx5_core.eth.2"),
        ] {
            std::fs::create_dir_all(net.join(name)).expect("interface");
            std::os::unix::fs::symlink(
                format!("../../../devices/pci0000:3b/0000:3b:00.0/{device}"),
                net.join(name).join("device"),
            )
            .expect("link");
            assert_eq!(
                netdev_device(root, name).expect(name),
                Some(addr("0000:3b:00.0")),
                "{name}"
            );
        }
    }

    /// mlx5's layout: vDPA device 7, with its vhost-vdpa node, under an auxiliary device
    /// of the function 0000:5e:00.0.
    fn mlx5_vdpa_on_5e(root: &Path) {
        let aux = root.join("devices/pci0000:5e/0000:5e:00.0/mlx5_core.vnet.0/vdpa7");
        std::fs::create_dir_all(aux.join("vhost-vdpa-7")).expect("aux");
        std::os::unix::fs::symlink(
            "../../devices/pci0000:5e/0000:5e:00.0/mlx5_core.vnet.0/vdpa7/vhost-vdpa-7",
            root.join("class/vhost-vdpa/vhost-vdpa-7"),
        )
        .expect("link");
    }

    /// A mediated device names the function it is made on, and a vhost-vdpa node the
    /// function its vDPA device sits on, directly or under an auxiliary device (mlx5's
    /// layout); names that are not theirs, devices gone and devices on no PCI function
    /// name none.
    #[test]
    fn an_mdev_and_a_vdpa_device_name_the_pci_function_they_are_on() {
        let gpu = "0000:5e:00.0";
        let uuid = "c2177883-f1bb-47f0-914d-32a22e3a8804";
        let mut f = FakeSys::new();
        f.device(gpu, 0x10de, 0x1eb8).mdev(gpu, uuid);
        f.pf("0000:3b:00.0", 0x15b3, 0x101d, 8, 2);
        let vf = f.vfs("0000:3b:00.0")[1].to_string();
        f.vhost_vdpa(&vf, 3);
        let t = f.build();
        let root = t.sysfs_root();
        assert_eq!(mdev_device(root, uuid).expect("read"), Some(addr(gpu)));
        assert_eq!(
            mdev_device(root, &uuid.to_uppercase()).expect("read"),
            Some(addr(gpu)),
            "libvirt may write the UUID in capitals; the kernel's name is lower case"
        );
        assert_eq!(
            vhost_vdpa_device(root, "/dev/vhost-vdpa-3").expect("read"),
            Some(addr(&vf))
        );
        for name in [
            "0c7b4d6a-0000-4000-8000-000000000000",
            "",
            "../../..",
            "not-a-uuid",
        ] {
            assert_eq!(mdev_device(root, name).expect(name), None, "{name}");
        }
        for path in [
            "/dev/vhost-vdpa-9",
            "/dev/vhost-vdpa-",
            "/dev/vhost-vdpa-../../x",
            "/dev/sda",
            "",
        ] {
            assert_eq!(vhost_vdpa_device(root, path).expect(path), None, "{path}");
        }
        // mlx5: the vDPA device under an auxiliary device of the function.
        mlx5_vdpa_on_5e(root);
        assert_eq!(
            vhost_vdpa_device(root, "/dev/vhost-vdpa-7").expect("read"),
            Some(addr(gpu))
        );
        // VDUSE: on no PCI function. And one whose device is gone (a dangling link).
        let vduse = root.join("devices/virtual/vduse/vdpa8/vhost-vdpa-8");
        std::fs::create_dir_all(&vduse).expect("vduse");
        std::os::unix::fs::symlink(
            "../../devices/virtual/vduse/vdpa8/vhost-vdpa-8",
            root.join("class/vhost-vdpa/vhost-vdpa-8"),
        )
        .expect("link");
        std::os::unix::fs::symlink(
            "../../devices/pci0000:00/0000:00:09.0/vdpa9/vhost-vdpa-9",
            root.join("class/vhost-vdpa/vhost-vdpa-9"),
        )
        .expect("link");
        for path in ["/dev/vhost-vdpa-8", "/dev/vhost-vdpa-9"] {
            assert_eq!(vhost_vdpa_device(root, path).expect(path), None, "{path}");
        }
    }

    /// The devices made on functions, read from the kernel's lists once for all the
    /// functions asked about: an mdev by its parent (with its IOMMU group once it has
    /// one), a vhost-vdpa node by the function above it, also under an auxiliary device;
    /// functions asked about with none, and devices on functions not asked about, are
    /// left out. Without either list nothing is possible; a list that cannot be read is
    /// an error.
    #[test]
    fn devices_made_on_functions_are_found_from_the_kernels_lists() {
        let gpu = "0000:5e:00.0";
        let (m1, m2) = (
            "c2177883-f1bb-47f0-914d-32a22e3a8804",
            "0b3e7c1d-4a5f-4e6a-8b7c-9d0e1f2a3b4c",
        );
        let bare = FakeSys::new().build();
        assert!(!made_on_possible(bare.sysfs_root()));
        assert_eq!(
            made_on(bare.sysfs_root(), &[addr(gpu)]).expect("read"),
            BTreeMap::new()
        );

        let mut f = FakeSys::new();
        f.device(gpu, 0x10de, 0x1eb8).mdev(gpu, m1).mdev(gpu, m2);
        f.pf("0000:3b:00.0", 0x15b3, 0x101d, 8, 3);
        let vfs: Vec<String> = f
            .vfs("0000:3b:00.0")
            .iter()
            .map(|a| a.to_string())
            .collect();
        f.vhost_vdpa(&vfs[1], 3).vhost_vdpa(&vfs[2], 4);
        let t = f.build();
        let root = t.sysfs_root();
        assert!(made_on_possible(root));
        let group_node = t.mdev_vfio_node(m2, 300);
        assert_eq!(group_node, t.dev_root().join("vfio/300"));
        // mlx5: a vDPA device under an auxiliary device of the GPU's function (as good a
        // PCI function as any for the test).
        mlx5_vdpa_on_5e(root);
        let asked = [addr(gpu), addr(&vfs[0]), addr(&vfs[1])];
        let made = made_on(root, &asked).expect("read");
        assert_eq!(
            made.keys().copied().collect::<Vec<_>>(),
            vec![addr(&vfs[1]), addr(gpu)],
            "VF0 has none, VF2 was not asked about"
        );
        let on_gpu = &made[&addr(gpu)];
        let mut groups: Vec<(String, Option<u32>)> = on_gpu
            .mdevs
            .iter()
            .map(|(dir, g)| {
                (
                    dir.file_name()
                        .expect("a name")
                        .to_string_lossy()
                        .into_owned(),
                    *g,
                )
            })
            .collect();
        groups.sort();
        assert_eq!(
            groups,
            vec![(m2.to_string(), Some(300)), (m1.to_string(), None)]
        );
        assert_eq!(on_gpu.vhost_vdpa, vec!["vhost-vdpa-7".to_string()]);
        assert_eq!(
            made[&addr(&vfs[1])].vhost_vdpa,
            vec!["vhost-vdpa-3".to_string()]
        );
        assert!(made[&addr(&vfs[1])].mdevs.is_empty());

        // A list that cannot be read (here not a directory, which even root cannot list):
        // an error naming it, not an empty answer.
        let class = root.join("class/vhost-vdpa");
        std::fs::remove_dir_all(&class).expect("rm");
        std::fs::write(&class, "").expect("a file where the list was");
        let err = made_on(root, &asked).expect_err("unreadable list");
        assert!(err.to_string().contains("class/vhost-vdpa"), "{err}");
    }
}
