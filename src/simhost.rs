//! A simulated host: a builder for fake sysfs trees with the kernel's real PCI layout, used by the demo, the tests and the benchmarks.
//!
//! The tree is what a kernel shows, so that both hostdevd and `lspci -A linux-sysfs -O
//! sysfs.path=ROOT/bus/pci` read it:
//!
//! - device directories under `devices/pciDDDD:BB/[bridge/...]/<bdf>`, where `BB` is the
//!   bus of the topmost device; SR-IOV VFs are siblings of their PF (same parent);
//! - `bus/pci/devices/<bdf>` as relative links (`../../../devices/pci0000:00/<bdf>`);
//! - `driver` links into `bus/pci/drivers/<name>/` (which has `bind`, `unbind`, `new_id`,
//!   `remove_id` and a link back to each bound device);
//! - `iommu_group` links into `kernel/iommu_groups/N/` (with `devices/<bdf>` links back
//!   and a `type` file);
//! - `physfn` / `virtfnN` links, `sriov_totalvfs`, `sriov_numvfs`,
//!   `sriov_drivers_autoprobe`, `sriov_offset`, `sriov_stride`, `sriov_vf_device`;
//! - attribute files with the kernel's formatting (`vendor` is "0x8086\n", `class`
//!   "0x020000\n", `revision` "0x01\n", `numa_node` "-1\n" when unset, `driver_override`
//!   "(null)\n" when unset), `net/<ifname>/` directories, `uevent`, `irq`, `resource`, and a 256-byte
//!   `config` whose standard header agrees with the attribute files;
//! - mediated devices as `<uuid>/` under their function, linked from
//!   `bus/mdev/devices/<uuid>`, and vDPA devices as `vdpaN/vhost-vdpa-N/` under theirs,
//!   linked from `bus/vdpa/devices/vdpaN` and `class/vhost-vdpa/vhost-vdpa-N`.
//!
//! A dev root (`<tmp>/dev`) sits next to the sysfs root (`<tmp>/sys`) for `vfio/N` nodes;
//! `<tmp>` is a fresh directory under [`scratch_base`], removed when the [`FakeTree`] drops.
//!
//! ```ignore
//! let mut f = FakeSys::new();
//! f.pf("0000:3b:00.0", 0x8086, 0x1572, 64, 4).driver("0000:3b:00.0", "i40e");
//! f.vf_driver("0000:3b:00.0", "vfio-pci").numa("0000:3b:00.0", 1);
//! let tree = f.build();
//! let inv = hostdevd::sysfs::scan(tree.sysfs_root(), tree.dev_root(), &names);
//! ```
//!
//! This is a fixture, not part of the agent: builder methods take addresses as strings
//! and panic on nonsense or on an I/O error while writing the tree, which is what its
//! callers (tests, benchmarks, the demo's fixed host) want. The daemon never calls it.
//! Thousands of VFs are fine: a 4096-VF tree builds in a few seconds on tmpfs.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use crate::pci::PciAddress;
use tempfile::TempDir;

/// Where a PF's VFs land: VF i has routing id `PF rid + offset + i * stride` (as the
/// SR-IOV capability's First VF Offset and VF Stride say), so VFs may spill onto the
/// next bus numbers, as on real hardware.
#[derive(Debug, Clone, Copy)]
pub struct PfLayout {
    /// The VFs' device id (`sriov_vf_device`).
    pub vf_device: u16,
    pub offset: u16,
    pub stride: u16,
}

impl PfLayout {
    /// The default for a PF with device id `device`: VF device id `device + 1`, first
    /// VF 0x80 routing ids after the PF (16 slots later), stride 1.
    pub fn for_device(device: u16) -> Self {
        Self {
            vf_device: device.wrapping_add(1),
            offset: 0x80,
            stride: 1,
        }
    }
}

#[derive(Debug, Clone)]
struct Sriov {
    total: u32,
    num: u32,
    layout: PfLayout,
    vfs: Vec<PciAddress>,
}

/// One function of the fake tree, as it will be written.
#[derive(Debug, Clone)]
pub struct FakeDevice {
    pub address: PciAddress,
    pub vendor: u16,
    pub device: u16,
    pub subsystem_vendor: u16,
    pub subsystem_device: u16,
    pub class: u32,
    pub revision: u8,
    pub driver: Option<String>,
    pub driver_override: Option<String>,
    pub iommu_group: Option<u32>,
    /// `None` writes the kernel's -1 (for a VF: its PF's node).
    pub numa_node: Option<i32>,
    pub netdevs: Vec<String>,
    /// Mediated devices made on this function, by UUID (`<uuid>/` under it, linked from
    /// `bus/mdev/devices`).
    pub mdevs: Vec<String>,
    /// vDPA devices on this function, by number N (`vdpaN/vhost-vdpa-N/` under it,
    /// linked from `class/vhost-vdpa`).
    pub vdpa: Vec<u32>,
    /// The bridge this function sits behind; `None` for the root bus.
    pub parent: Option<PciAddress>,
    /// For a VF: its PF and VF index.
    pub physfn: Option<(PciAddress, u32)>,
    sriov: Option<Sriov>,
}

/// Builds a fake sysfs tree; see the module documentation for the layout.
#[derive(Debug, Clone, Default)]
pub struct FakeSys {
    devices: BTreeMap<PciAddress, FakeDevice>,
}

/// Where fake trees go: `$FAKESYS_TMPDIR` if set, else the RAM-backed `/dev/shm` when it
/// is a writable directory, else the system temp dir. A tree is tens of thousands of tiny
/// files and links; on a disk file system that takes ten times longer than on tmpfs
/// (real sysfs lives in RAM too), which matters for the 4096-VF trees.
pub fn scratch_base() -> PathBuf {
    if let Some(d) = std::env::var_os("FAKESYS_TMPDIR") {
        return PathBuf::from(d);
    }
    let shm = Path::new("/dev/shm");
    let writable = tempfile::Builder::new()
        .prefix("fakesys-probe")
        .tempfile_in(shm)
        .is_ok();
    if writable {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// Parses an address in test code.
pub fn addr(s: &str) -> PciAddress {
    s.parse()
        .unwrap_or_else(|e| panic!("test uses a bad PCI address {s:?}: {e}"))
}

fn from_rid(domain: u32, rid: u32) -> PciAddress {
    assert!(rid <= 0xffff, "routing id {rid:#x} is past bus ff");
    PciAddress::new(
        domain,
        (rid >> 8) as u8,
        ((rid >> 3) & 0x1f) as u8,
        (rid & 7) as u8,
    )
    .unwrap_or_else(|| panic!("routing id {rid:#x} gives no address"))
}

fn rid(a: PciAddress) -> u32 {
    (u32::from(a.bus()) << 8) | (u32::from(a.device()) << 3) | u32::from(a.function())
}

impl FakeSys {
    pub fn new() -> Self {
        Self::default()
    }

    fn get(&mut self, a: &str) -> &mut FakeDevice {
        let a = addr(a);
        self.devices
            .get_mut(&a)
            .unwrap_or_else(|| panic!("fake device {a} was not added before being configured"))
    }

    fn insert(&mut self, dev: FakeDevice) {
        let a = dev.address;
        assert!(
            self.devices.insert(a, dev).is_none(),
            "fake device {a} added twice"
        );
    }

    /// Adds a plain function: an Ethernet controller (class 0x020000), revision 0x01,
    /// subsystem ids equal to its ids, no driver, no IOMMU group, NUMA node -1.
    pub fn device(&mut self, a: &str, vendor: u16, device: u16) -> &mut Self {
        self.insert(FakeDevice {
            address: addr(a),
            vendor,
            device,
            subsystem_vendor: vendor,
            subsystem_device: device,
            class: 0x020000,
            revision: 0x01,
            driver: None,
            driver_override: None,
            iommu_group: None,
            numa_node: None,
            netdevs: Vec::new(),
            mdevs: Vec::new(),
            vdpa: Vec::new(),
            parent: None,
            physfn: None,
            sriov: None,
        });
        self
    }

    /// Adds a PCIe bridge (root port, class 0x060400) that later devices can sit behind
    /// with [`Self::behind`].
    pub fn bridge(&mut self, a: &str, vendor: u16, device: u16) -> &mut Self {
        self.device(a, vendor, device);
        let d = self.get(a);
        d.class = 0x060400;
        d.driver = Some("pcieport".into());
        self
    }

    /// Places `a` (and, for a PF, its VFs) behind the bridge `bridge`.
    pub fn behind(&mut self, a: &str, bridge: &str) -> &mut Self {
        let b = addr(bridge);
        assert!(self.devices.contains_key(&b), "bridge {b} not added");
        let vfs = self.vfs(a);
        self.get(a).parent = Some(b);
        for vf in vfs {
            self.get(&vf.to_string()).parent = Some(b);
        }
        self
    }

    /// Adds an SR-IOV PF with `num_vfs` of `total_vfs` VFs enabled, laid out by
    /// [`PfLayout::for_device`].
    pub fn pf(
        &mut self,
        a: &str,
        vendor: u16,
        device: u16,
        total_vfs: u32,
        num_vfs: u32,
    ) -> &mut Self {
        self.pf_with(
            a,
            vendor,
            device,
            total_vfs,
            num_vfs,
            PfLayout::for_device(device),
        )
    }

    /// [`Self::pf`] with an explicit VF layout.
    pub fn pf_with(
        &mut self,
        a: &str,
        vendor: u16,
        device: u16,
        total_vfs: u32,
        num_vfs: u32,
        layout: PfLayout,
    ) -> &mut Self {
        assert!(
            num_vfs <= total_vfs,
            "{a}: num_vfs {num_vfs} > total_vfs {total_vfs}"
        );
        self.device(a, vendor, device);
        let pf = addr(a);
        let mut vfs = Vec::with_capacity(num_vfs as usize);
        for i in 0..num_vfs {
            let r = rid(pf) + u32::from(layout.offset) + i * u32::from(layout.stride);
            let va = from_rid(pf.domain(), r);
            self.insert(FakeDevice {
                address: va,
                vendor,
                device: layout.vf_device,
                subsystem_vendor: vendor,
                subsystem_device: layout.vf_device,
                class: 0x020000,
                revision: 0x01,
                driver: None,
                driver_override: None,
                iommu_group: None,
                numa_node: None,
                netdevs: Vec::new(),
                mdevs: Vec::new(),
                vdpa: Vec::new(),
                parent: None,
                physfn: Some((pf, i)),
                sriov: None,
            });
            vfs.push(va);
        }
        self.get(a).sriov = Some(Sriov {
            total: total_vfs,
            num: num_vfs,
            layout,
            vfs,
        });
        self
    }

    /// The VFs of PF `pf` in VF-index order (empty for a non-PF).
    pub fn vfs(&self, pf: &str) -> Vec<PciAddress> {
        self.devices
            .get(&addr(pf))
            .and_then(|d| d.sriov.as_ref())
            .map(|s| s.vfs.clone())
            .unwrap_or_default()
    }

    /// Every function added so far, sorted by address.
    pub fn addresses(&self) -> Vec<PciAddress> {
        self.devices.keys().copied().collect()
    }

    /// The description of one function (to derive expectations in tests).
    pub fn fake_device(&self, a: &str) -> &FakeDevice {
        self.devices
            .get(&addr(a))
            .unwrap_or_else(|| panic!("fake device {a} not added"))
    }

    /// Binds `a` to driver `name`.
    pub fn driver(&mut self, a: &str, name: &str) -> &mut Self {
        self.get(a).driver = Some(name.into());
        self
    }

    /// Binds every VF of `pf` to driver `name`.
    pub fn vf_driver(&mut self, pf: &str, name: &str) -> &mut Self {
        for vf in self.vfs(pf) {
            self.driver(&vf.to_string(), name);
        }
        self
    }

    pub fn driver_override(&mut self, a: &str, name: &str) -> &mut Self {
        self.get(a).driver_override = Some(name.into());
        self
    }

    /// Puts `a` in IOMMU group `group` (several devices may share one).
    pub fn iommu_group(&mut self, a: &str, group: u32) -> &mut Self {
        self.get(a).iommu_group = Some(group);
        self
    }

    /// Gives each VF of `pf` its own IOMMU group, `first`, `first + 1`, ... in VF order.
    pub fn vf_iommu_groups(&mut self, pf: &str, first: u32) -> &mut Self {
        for (i, vf) in self.vfs(pf).into_iter().enumerate() {
            let g = first + u32::try_from(i).unwrap_or_else(|_| panic!("too many VFs"));
            self.iommu_group(&vf.to_string(), g);
        }
        self
    }

    /// Sets `numa_node` (-1 for none). VFs without their own value inherit their PF's.
    pub fn numa(&mut self, a: &str, node: i32) -> &mut Self {
        self.get(a).numa_node = Some(node);
        self
    }

    /// Adds a network interface directory `net/<ifname>`.
    pub fn netdev(&mut self, a: &str, ifname: &str) -> &mut Self {
        self.get(a).netdevs.push(ifname.into());
        self
    }

    /// Adds a mediated device (a vGPU, say) made on this function.
    pub fn mdev(&mut self, a: &str, uuid: &str) -> &mut Self {
        self.get(a).mdevs.push(uuid.into());
        self
    }

    /// Adds vDPA device `vdpa<n>` on this function, with its `vhost-vdpa-<n>` node.
    pub fn vhost_vdpa(&mut self, a: &str, n: u32) -> &mut Self {
        self.get(a).vdpa.push(n);
        self
    }

    /// Sets the 24-bit class code (base class, subclass, prog-if).
    pub fn class(&mut self, a: &str, class: u32) -> &mut Self {
        self.get(a).class = class;
        self
    }

    pub fn revision(&mut self, a: &str, revision: u8) -> &mut Self {
        self.get(a).revision = revision;
        self
    }

    pub fn subsystem(&mut self, a: &str, vendor: u16, device: u16) -> &mut Self {
        let d = self.get(a);
        d.subsystem_vendor = vendor;
        d.subsystem_device = device;
        self
    }

    /// Writes the tree into a new temporary directory under [`scratch_base`].
    pub fn build(&self) -> FakeTree {
        self.build_in(&scratch_base())
    }

    /// Writes the tree into a new temporary directory under `base`.
    pub fn build_in(&self, base: &Path) -> FakeTree {
        let tmp = tempfile::Builder::new()
            .prefix("fakesys")
            .tempdir_in(base)
            .unwrap_or_else(|e| {
                panic!(
                    "create a temp dir for a fake sysfs in {}: {e}",
                    base.display()
                )
            });
        let tree = FakeTree {
            sysfs: tmp.path().join("sys"),
            dev: tmp.path().join("dev"),
            dirs: BTreeMap::new(),
            tmp,
        };
        self.write(tree)
    }

    /// The directory of `a` relative to the sysfs root.
    fn rel_dir(&self, a: PciAddress) -> PathBuf {
        // A VF is a sibling of its PF, whichever bus number it got.
        if let Some((pf, _)) = self.devices.get(&a).and_then(|d| d.physfn) {
            let pf_dir = self.rel_dir(pf);
            let parent = pf_dir.parent().unwrap_or_else(|| Path::new("devices"));
            return parent.join(a.to_string());
        }
        let mut chain = vec![a];
        let mut cur = a;
        while let Some(p) = self.devices.get(&cur).and_then(|d| d.parent) {
            assert!(chain.len() < 64, "bridge loop at {p}");
            chain.push(p);
            cur = p;
        }
        let top = cur;
        let mut path =
            PathBuf::from("devices").join(format!("pci{:04x}:{:02x}", top.domain(), top.bus()));
        for d in chain.iter().rev() {
            path.push(d.to_string());
        }
        path
    }

    fn write(&self, mut tree: FakeTree) -> FakeTree {
        let root = tree.sysfs.clone();
        for d in [
            "bus/pci/devices",
            "bus/pci/drivers",
            "kernel/iommu_groups",
            "bus/pci/slots",
        ] {
            mkdir(&root.join(d));
        }
        for f in ["bus/pci/drivers_probe", "bus/pci/rescan"] {
            write(&root.join(f), "");
        }
        write(&root.join("bus/pci/drivers_autoprobe"), "1\n");
        mkdir(&tree.dev);

        // Slots with a non-VF function other than 0 are multi-function.
        let multi: BTreeSet<(u32, u8, u8)> = self
            .devices
            .values()
            .filter(|d| d.physfn.is_none() && d.address.function() != 0)
            .map(|d| (d.address.domain(), d.address.bus(), d.address.device()))
            .collect();

        // For bridges: (secondary, subordinate) bus numbers of the devices behind them.
        let mut buses: BTreeMap<PciAddress, (u8, u8)> = BTreeMap::new();
        for d in self.devices.values() {
            if let Some(p) = d.parent {
                let b = d.address.bus();
                let e = buses.entry(p).or_insert((b, b));
                *e = (e.0.min(b), e.1.max(b));
            }
        }

        let mut drivers: BTreeSet<&str> = BTreeSet::new();
        let mut groups: BTreeSet<u32> = BTreeSet::new();
        for d in self.devices.values() {
            let rel = self.rel_dir(d.address);
            let dir = root.join(&rel);
            mkdir(&dir);
            tree.dirs.insert(d.address, rel.clone());
            let bdf = d.address.to_string();

            let numa = d
                .numa_node
                .or_else(|| {
                    d.physfn
                        .and_then(|(pf, _)| self.devices.get(&pf))
                        .and_then(|p| p.numa_node)
                })
                .unwrap_or(-1);
            write(&dir.join("vendor"), &format!("0x{:04x}\n", d.vendor));
            write(&dir.join("device"), &format!("0x{:04x}\n", d.device));
            write(
                &dir.join("subsystem_vendor"),
                &format!("0x{:04x}\n", d.subsystem_vendor),
            );
            write(
                &dir.join("subsystem_device"),
                &format!("0x{:04x}\n", d.subsystem_device),
            );
            write(&dir.join("class"), &format!("0x{:06x}\n", d.class));
            write(&dir.join("revision"), &format!("0x{:02x}\n", d.revision));
            write(&dir.join("numa_node"), &format!("{numa}\n"));
            write(
                &dir.join("driver_override"),
                &format!("{}\n", d.driver_override.as_deref().unwrap_or("(null)")),
            );
            write(&dir.join("enable"), "1\n");
            // `lspci -v` reads these; all-zero resources mean "no BARs assigned".
            write(&dir.join("irq"), "0\n");
            write(&dir.join("resource"), &RESOURCE_ZEROS.repeat(13));
            write(&dir.join("uevent"), &uevent(d));
            let is_multi = d.physfn.is_none()
                && multi.contains(&(d.address.domain(), d.address.bus(), d.address.device()));
            let secondary = buses.get(&d.address).copied();
            fs::write(dir.join("config"), config_space(d, is_multi, secondary))
                .expect("write config");

            link(&root, &rel, "subsystem", Path::new("bus/pci"));
            link(&root, Path::new("bus/pci/devices"), &bdf, &rel);
            if let Some(drv) = &d.driver {
                let drel = PathBuf::from("bus/pci/drivers").join(drv);
                if drivers.insert(drv.as_str()) {
                    mkdir(&root.join(&drel));
                    for f in ["bind", "unbind", "new_id", "remove_id", "uevent"] {
                        write(&root.join(&drel).join(f), "");
                    }
                }
                link(&root, &rel, "driver", &drel);
                link(&root, &drel, &bdf, &rel);
            }
            if let Some(g) = d.iommu_group {
                let grel = PathBuf::from("kernel/iommu_groups").join(g.to_string());
                if groups.insert(g) {
                    mkdir(&root.join(&grel).join("devices"));
                    write(&root.join(&grel).join("type"), "DMA\n");
                    write(&root.join(&grel).join("reserved_regions"), "");
                }
                link(&root, &rel, "iommu_group", &grel);
                link(&root, &grel.join("devices"), &bdf, &rel);
            }
            if !d.netdevs.is_empty() {
                mkdir(&root.join("class/net"));
                for n in &d.netdevs {
                    let nrel = rel.join("net").join(n);
                    mkdir(&root.join(&nrel));
                    write(&root.join(&nrel).join("operstate"), "up\n");
                    // As the kernel links them: the interface to its device, and the
                    // class directory to the interface.
                    link(&root, &nrel, "device", &rel);
                    link(&root, Path::new("class/net"), n, &nrel);
                }
            }
            for uuid in &d.mdevs {
                let mrel = rel.join(uuid);
                mkdir(&root.join(&mrel));
                mkdir(&root.join("bus/mdev/devices"));
                link(&root, Path::new("bus/mdev/devices"), uuid, &mrel);
            }
            for n in &d.vdpa {
                let vrel = rel.join(format!("vdpa{n}"));
                let crel = vrel.join(format!("vhost-vdpa-{n}"));
                mkdir(&root.join(&crel));
                write(&root.join(&crel).join("dev"), &format!("240:{n}\n"));
                mkdir(&root.join("bus/vdpa/devices"));
                mkdir(&root.join("class/vhost-vdpa"));
                link(
                    &root,
                    Path::new("bus/vdpa/devices"),
                    &format!("vdpa{n}"),
                    &vrel,
                );
                link(
                    &root,
                    Path::new("class/vhost-vdpa"),
                    &format!("vhost-vdpa-{n}"),
                    &crel,
                );
            }
            if let Some(s) = &d.sriov {
                write(&dir.join("sriov_totalvfs"), &format!("{}\n", s.total));
                write(&dir.join("sriov_numvfs"), &format!("{}\n", s.num));
                write(&dir.join("sriov_drivers_autoprobe"), "1\n");
                write(&dir.join("sriov_offset"), &format!("{}\n", s.layout.offset));
                write(&dir.join("sriov_stride"), &format!("{}\n", s.layout.stride));
                write(
                    &dir.join("sriov_vf_device"),
                    &format!("{:x}\n", s.layout.vf_device),
                );
                for (i, vf) in s.vfs.iter().enumerate() {
                    link(&root, &rel, &format!("virtfn{i}"), &self.rel_dir(*vf));
                }
            }
            if let Some((pf, _)) = d.physfn {
                link(&root, &rel, "physfn", &self.rel_dir(pf));
            }
        }
        tree
    }
}

const RESOURCE_ZEROS: &str = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n";

fn uevent(d: &FakeDevice) -> String {
    let mut s = String::new();
    if let Some(drv) = &d.driver {
        s.push_str(&format!("DRIVER={drv}\n"));
    }
    s.push_str(&format!(
        "PCI_CLASS={:X}\nPCI_ID={:04X}:{:04X}\nPCI_SUBSYS_ID={:04X}:{:04X}\nPCI_SLOT_NAME={}\n\
         MODALIAS=pci:v{:08X}d{:08X}sv{:08X}sd{:08X}bc{:02X}sc{:02X}i{:02X}\n",
        d.class,
        d.vendor,
        d.device,
        d.subsystem_vendor,
        d.subsystem_device,
        d.address,
        d.vendor,
        d.device,
        d.subsystem_vendor,
        d.subsystem_device,
        d.class >> 16,
        (d.class >> 8) & 0xff,
        d.class & 0xff
    ));
    s
}

/// The standard 64-byte header (type 0 endpoint or type 1 bridge), zero-padded to the
/// 256 bytes of conventional config space that sysfs shows to unprivileged readers.
fn config_space(d: &FakeDevice, multi: bool, secondary: Option<(u8, u8)>) -> Vec<u8> {
    let mut c = vec![0u8; 256];
    c[0..2].copy_from_slice(&d.vendor.to_le_bytes());
    c[2..4].copy_from_slice(&d.device.to_le_bytes());
    c[8] = d.revision;
    c[9] = (d.class & 0xff) as u8;
    c[10] = ((d.class >> 8) & 0xff) as u8;
    c[11] = ((d.class >> 16) & 0xff) as u8;
    let bridge = d.class >> 8 == 0x0604;
    c[0x0e] = u8::from(bridge) | if multi { 0x80 } else { 0 };
    if bridge {
        let (sec, sub) = secondary.unwrap_or((0, 0));
        c[0x18] = d.address.bus();
        c[0x19] = sec;
        c[0x1a] = sub;
    } else {
        c[0x2c..0x2e].copy_from_slice(&d.subsystem_vendor.to_le_bytes());
        c[0x2e..0x30].copy_from_slice(&d.subsystem_device.to_le_bytes());
    }
    c
}

fn mkdir(p: &Path) {
    fs::create_dir_all(p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
}

fn write(p: &Path, s: &str) {
    fs::write(p, s).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
}

/// Creates `root/from_dir/name` as a relative link to `root/to`, the way the kernel's
/// links are relative ("../../../devices/...").
fn link(root: &Path, from_dir: &Path, name: &str, to: &Path) {
    let mut target = PathBuf::new();
    for _ in from_dir.components() {
        target.push("..");
    }
    target.push(to);
    let at = root.join(from_dir).join(name);
    symlink(&target, &at)
        .unwrap_or_else(|e| panic!("symlink {} -> {}: {e}", at.display(), target.display()));
}

/// A built fake tree; removed from disk when dropped.
#[derive(Debug)]
pub struct FakeTree {
    sysfs: PathBuf,
    dev: PathBuf,
    dirs: BTreeMap<PciAddress, PathBuf>,
    tmp: TempDir,
}

impl FakeTree {
    /// The sysfs root to scan (`<tmp>/sys`).
    pub fn sysfs_root(&self) -> &Path {
        &self.sysfs
    }

    /// The dev root (`<tmp>/dev`), initially without a `vfio/` directory.
    pub fn dev_root(&self) -> &Path {
        &self.dev
    }

    /// The real directory of device `a` (not the `bus/pci/devices` link).
    pub fn device_dir(&self, a: &str) -> PathBuf {
        let rel = self
            .dirs
            .get(&addr(a))
            .unwrap_or_else(|| panic!("fake device {a} not in the tree"));
        self.sysfs.join(rel)
    }

    /// The `bus/pci/devices/<bdf>` link of device `a`.
    pub fn bus_link(&self, a: &str) -> PathBuf {
        self.sysfs.join("bus/pci/devices").join(addr(a).to_string())
    }

    /// Overwrites (or creates) attribute `name` of device `a` with raw bytes.
    pub fn write_attr(&self, a: &str, name: &str, value: &[u8]) {
        let p = self.device_dir(a).join(name);
        fs::write(&p, value).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
    }

    /// Removes attribute file `name` of device `a`.
    pub fn remove_attr(&self, a: &str, name: &str) {
        let p = self.device_dir(a).join(name);
        fs::remove_file(&p).unwrap_or_else(|e| panic!("remove {}: {e}", p.display()));
    }

    /// Replaces attribute or link `name` of device `a` with an empty directory, which
    /// fails to read even for root (EISDIR), unlike a chmod.
    pub fn make_attr_unreadable(&self, a: &str, name: &str) {
        let p = self.device_dir(a).join(name);
        let _ = fs::remove_file(&p);
        mkdir(&p);
    }

    /// Replaces link `name` of device `a` with one to `target` (any text, so it may
    /// dangle).
    pub fn relink(&self, a: &str, name: &str, target: &str) {
        let p = self.device_dir(a).join(name);
        let _ = fs::remove_file(&p);
        symlink(target, &p).unwrap_or_else(|e| panic!("symlink {}: {e}", p.display()));
    }

    /// Creates the device node `<dev>/vfio/N` (a regular file stands in for the
    /// character device) and `<dev>/vfio/vfio`.
    pub fn vfio_node(&self, group: u32) -> PathBuf {
        let dir = self.dev.join("vfio");
        mkdir(&dir);
        write(&dir.join("vfio"), "");
        let p = dir.join(group.to_string());
        write(&p, "");
        p
    }

    /// Puts mediated device `uuid` (made with [`FakeSys::mdev`]) in IOMMU group `group`
    /// the way binding it to vfio_mdev does: its `iommu_group` link, the group's
    /// directory, and the group node `<dev>/vfio/N`, which is returned.
    pub fn mdev_vfio_node(&self, uuid: &str, group: u32) -> PathBuf {
        let mdev = fs::canonicalize(self.sysfs.join("bus/mdev/devices").join(uuid))
            .unwrap_or_else(|e| panic!("mdev {uuid}: {e}"));
        let grel = PathBuf::from("kernel/iommu_groups").join(group.to_string());
        mkdir(&self.sysfs.join(&grel).join("devices"));
        let rel = mdev
            .strip_prefix(fs::canonicalize(&self.sysfs).expect("sysfs root"))
            .expect("the mdev is in the tree")
            .to_path_buf();
        link(&self.sysfs, &rel, "iommu_group", &grel);
        link(&self.sysfs, &grel.join("devices"), uuid, &rel);
        self.vfio_node(group)
    }

    /// Creates the vhost-vdpa node `<dev>/vhost-vdpa-N` (a regular file stands in for the
    /// character device) of a vDPA device made with [`FakeSys::vhost_vdpa`].
    pub fn vhost_vdpa_node(&self, n: u32) -> PathBuf {
        mkdir(&self.dev);
        let p = self.dev.join(format!("vhost-vdpa-{n}"));
        write(&p, "");
        p
    }

    /// Gives device `a` the iommufd interface's device node `vfioN` the way a kernel of
    /// Linux 6.6 or later does once it is bound to vfio-pci: the directory
    /// `vfio-dev/vfioN` under the device, and `<dev>/vfio/devices/vfioN` (a regular file
    /// stands in for the character device). Returns the node.
    pub fn vfio_device_node(&self, a: &str, n: u32) -> PathBuf {
        let name = format!("vfio{n}");
        mkdir(&self.device_dir(a).join("vfio-dev").join(&name));
        let dir = self.dev.join("vfio/devices");
        mkdir(&dir);
        let p = dir.join(name);
        write(&p, "");
        p
    }

    /// Removes device `a` the way a hot-unplug would: its directory, its bus link, and
    /// the driver, IOMMU group and PF links that point at it. Leaves VFs of a removed PF
    /// alone (the kernel removes VFs first; do that explicitly if needed). The directory
    /// is set aside outside the tree, so that [`FakeTree::replug_device`] can bring the
    /// same function back.
    pub fn remove_device(&self, a: &str) {
        let a = addr(a);
        let bdf = a.to_string();
        let dir = self.device_dir(&bdf);
        let stash = self.unplugged(&bdf);
        let _ = fs::remove_dir_all(&stash);
        let _ = fs::remove_file(self.unplugged_virtfn(&bdf));
        mkdir(&self.tmp.path().join("unplugged"));
        if let Ok(t) = fs::read_link(dir.join("driver")) {
            let _ = fs::remove_file(dir.join(t).join(&bdf));
        }
        if let Ok(t) = fs::read_link(dir.join("iommu_group")) {
            let _ = fs::remove_file(dir.join(t).join("devices").join(&bdf));
        }
        if let Ok(pf) = fs::read_link(dir.join("physfn")) {
            let pf_dir = dir.join(pf);
            if let Ok(entries) = fs::read_dir(&pf_dir) {
                for e in entries.flatten() {
                    let name = e.file_name();
                    let is_virtfn = name.to_str().is_some_and(|n| n.starts_with("virtfn"));
                    if is_virtfn
                        && fs::read_link(e.path())
                            .ok()
                            .and_then(|t| t.file_name().map(|f| f == bdf.as_str()))
                            == Some(true)
                    {
                        let _ = fs::remove_file(e.path());
                        write(&self.unplugged_virtfn(&bdf), &name.to_string_lossy());
                    }
                }
            }
        }
        let _ = fs::remove_file(self.bus_link(&bdf));
        fs::rename(&dir, &stash).unwrap_or_else(|e| panic!("remove {}: {e}", dir.display()));
    }

    /// Brings back device `a`, removed by [`FakeTree::remove_device`], the way a hot-add
    /// of the same function would: its directory's contents as they were when removed,
    /// its bus link, and the driver, IOMMU group and PF links that point at it. The
    /// directory itself is a new one, with an inode number of its own, as the kernel
    /// makes a new one for a device it adds.
    pub fn replug_device(&self, a: &str) {
        let a = addr(a);
        let bdf = a.to_string();
        let dir = self.device_dir(&bdf);
        let stash = self.unplugged(&bdf);
        let entries = fs::read_dir(&stash)
            .unwrap_or_else(|e| panic!("{bdf} was not removed ({}): {e}", stash.display()));
        mkdir(&dir);
        for e in entries {
            let e = e.unwrap_or_else(|e| panic!("list {}: {e}", stash.display()));
            fs::rename(e.path(), dir.join(e.file_name()))
                .unwrap_or_else(|err| panic!("put back {}: {err}", e.path().display()));
        }
        fs::remove_dir(&stash).unwrap_or_else(|e| panic!("remove {}: {e}", stash.display()));
        link(
            &self.sysfs,
            Path::new("bus/pci/devices"),
            &bdf,
            &self.dirs[&a],
        );
        // A relative target resolves from the device's directory; an absolute one (as
        // the stand-in kernel writes them) replaces it.
        let target = |name: &str| fs::read_link(dir.join(name)).ok().map(|t| dir.join(t));
        if let Some(drv) = target("driver") {
            let _ = symlink(&dir, drv.join(&bdf));
        }
        if let Some(group) = target("iommu_group") {
            let _ = symlink(&dir, group.join("devices").join(&bdf));
        }
        if let (Some(pf), Ok(virtfn)) = (
            target("physfn"),
            fs::read_to_string(self.unplugged_virtfn(&bdf)),
        ) {
            let _ = symlink(&dir, pf.join(virtfn));
            let _ = fs::remove_file(self.unplugged_virtfn(&bdf));
        }
    }

    /// Where a removed device's directory is set aside.
    fn unplugged(&self, bdf: &str) -> PathBuf {
        self.tmp.path().join("unplugged").join(bdf)
    }

    /// Where a removed VF's link name under its PF (`virtfnN`) is kept.
    fn unplugged_virtfn(&self, bdf: &str) -> PathBuf {
        self.tmp
            .path()
            .join("unplugged")
            .join(format!("{bdf}.virtfn"))
    }
}
