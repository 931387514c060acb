//! Bad input never aborts a scan: each broken device is reported with the problem named (attribute and path), and every other device is still listed.

mod support;

use std::os::unix::fs::symlink;

use hostdevd::pci::PciAddress;
use hostdevd::sysfs::{self, Inventory, PciDevice, PciNames, SysfsError};
use support::fakesys::{addr, FakeTree};
use support::FakeSys;

const PF: &str = "0000:3b:00.0";
const OTHER: &str = "0000:00:1f.3";

/// A PF with 12 VFs (own groups, vfio-pci), a plain device, and a spare device to break.
fn base() -> FakeSys {
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 64, 12)
        .driver(PF, "i40e")
        .iommu_group(PF, 10)
        .numa(PF, 1)
        .vf_driver(PF, "vfio-pci")
        .vf_iommu_groups(PF, 100);
    f.device(OTHER, 0x8086, 0xa1f0)
        .driver(OTHER, "snd_hda_intel");
    f.device("0000:00:1f.4", 0x8086, 0xa1a3)
        .iommu_group("0000:00:1f.4", 30);
    f
}

fn scan(t: &FakeTree) -> Inventory {
    sysfs::scan(t.sysfs_root(), t.dev_root(), &PciNames::builtin()).expect("scan")
}

fn dev(inv: &Inventory, a: &str) -> PciDevice {
    inv.get(addr(a))
        .unwrap_or_else(|| panic!("{a} missing from {inv:#?}"))
        .clone()
}

/// Exactly the devices of the fake tree are listed, and only `broken` have errors.
fn assert_others_clean(f: &FakeSys, inv: &Inventory, broken: &[&str]) {
    let listed: Vec<PciAddress> = inv.devices.iter().map(|d| d.address).collect();
    assert_eq!(listed, f.addresses());
    for d in &inv.devices {
        if !broken.contains(&d.address.to_string().as_str()) {
            assert!(
                d.errors.is_empty(),
                "{} should be clean: {:?}",
                d.address,
                d.errors
            );
        }
    }
}

/// The single error of `d` names `attribute` at the start and contains `path_part`.
fn assert_one_error(d: &PciDevice, attribute: &str, path_part: &str) -> String {
    assert_eq!(d.errors.len(), 1, "{}: {:?}", d.address, d.errors);
    let e = &d.errors[0];
    assert!(e.starts_with(&format!("{attribute}: ")), "{e}");
    assert!(e.contains(path_part), "{e} should name {path_part}");
    e.clone()
}

#[test]
fn clean_tree_has_no_errors() {
    let f = base();
    let t = f.build();
    let inv = scan(&t);
    assert_others_clean(&f, &inv, &[]);
    assert!(inv.errors.is_empty());
}

#[test]
fn dangling_bus_link_is_a_vanished_device() {
    let f = base();
    let t = f.build();
    // Listed on the bus, directory gone: what a scan racing a hot-unplug sees.
    symlink(
        "../../../devices/pci0000:00/0000:00:09.0",
        t.sysfs_root().join("bus/pci/devices/0000:00:09.0"),
    )
    .expect("symlink");
    let inv = scan(&t);
    let gone = dev(&inv, "0000:00:09.0");
    let e = assert_one_error(&gone, "device", "bus/pci/devices/0000:00:09.0");
    assert!(e.contains("vanished"), "{e}");
    assert_eq!(gone.vendor_id, None);
    assert_eq!(inv.devices.len(), f.addresses().len() + 1);
    for d in inv.devices.iter().filter(|d| d.address != gone.address) {
        assert!(d.errors.is_empty(), "{:?}", d.errors);
    }
}

#[test]
fn device_removed_with_its_links_disappears() {
    let f = base();
    let t = f.build();
    t.remove_device(OTHER);
    let inv = scan(&t);
    assert!(inv.get(addr(OTHER)).is_none());
    assert_eq!(inv.devices.len(), f.addresses().len() - 1);
    assert!(inv.devices.iter().all(|d| d.errors.is_empty()));
}

#[test]
fn removed_devices_plugged_back_scan_as_before() {
    let f = base();
    let t = f.build();
    let before = scan(&t);
    let vf = f.vfs(PF)[5].to_string();
    t.remove_device(&vf);
    t.remove_device(OTHER);
    let without = scan(&t);
    assert!(without.get(addr(&vf)).is_none() && without.get(addr(OTHER)).is_none());
    assert!(!dev(&without, PF)
        .sriov
        .expect("sriov")
        .vfs
        .contains(&addr(&vf)));
    t.replug_device(&vf);
    t.replug_device(OTHER);
    let after = scan(&t);
    // Each device made again is another instance (a new directory); nothing else differs.
    let replugged = [addr(&vf), addr(OTHER)];
    for (b, a) in before.devices.iter().zip(&after.devices) {
        assert_eq!(
            a.instance != b.instance,
            replugged.contains(&a.address),
            "{}: {:?} then {:?}",
            a.address,
            b.instance,
            a.instance
        );
        assert!(a.instance.is_some(), "{}", a.address);
    }
    let without_instance = |devices: &[PciDevice]| -> Vec<PciDevice> {
        devices
            .iter()
            .map(|d| PciDevice {
                instance: None,
                ..d.clone()
            })
            .collect()
    };
    assert_eq!(
        without_instance(&after.devices),
        without_instance(&before.devices),
        "driver, group and PF links are back"
    );
    assert_eq!(after.errors, before.errors);
}

#[test]
fn removed_attribute_is_named() {
    let f = base();
    let t = f.build();
    t.remove_attr(OTHER, "vendor");
    let inv = scan(&t);
    let d = dev(&inv, OTHER);
    let e = assert_one_error(&d, "vendor", "0000:00:1f.3/vendor");
    assert!(e.contains("No such file"), "cause kept: {e}");
    assert_eq!((d.vendor_id, d.vendor_name.as_deref()), (None, None));
    assert_eq!(
        d.device_id.map(|v| v.0),
        Some(0xa1f0),
        "the other attributes still read"
    );
    assert_eq!(d.driver.as_deref(), Some("snd_hda_intel"));
    assert_others_clean(&f, &inv, &[OTHER]);
}

#[test]
fn unreadable_attribute_is_named() {
    let f = base();
    let t = f.build();
    // A directory in place of the file: unreadable even for root (EISDIR).
    t.make_attr_unreadable(OTHER, "class");
    let inv = scan(&t);
    let d = dev(&inv, OTHER);
    let e = assert_one_error(&d, "class", "0000:00:1f.3/class");
    assert!(e.contains("directory"), "{e}");
    assert_eq!(d.class, None);
    assert_others_clean(&f, &inv, &[OTHER]);
}

#[test]
fn fifo_attribute_does_not_hang() {
    let f = base();
    let t = f.build();
    let p = t.device_dir(OTHER).join("revision");
    std::fs::remove_file(&p).expect("rm");
    nix::unistd::mkfifo(&p, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    let inv = scan(&t);
    let d = dev(&inv, OTHER);
    assert_one_error(&d, "revision", "0000:00:1f.3/revision");
    assert_others_clean(&f, &inv, &[OTHER]);
}

#[test]
fn malformed_values_are_named() {
    let f = base();
    let t = f.build();
    t.write_attr(OTHER, "device", b"zzzz\n");
    t.write_attr(OTHER, "revision", b"");
    t.write_attr(OTHER, "subsystem_vendor", &vec![b'7'; 100_000]);
    t.write_attr(OTHER, "numa_node", b"abc\n");
    t.write_attr(OTHER, "class", b"0x1234567\n");
    let inv = scan(&t);
    let d = dev(&inv, OTHER);
    assert_eq!(d.errors.len(), 5, "{:?}", d.errors);
    let find = |attr: &str| {
        d.errors
            .iter()
            .find(|e| e.starts_with(&format!("{attr}: ")))
            .unwrap_or_else(|| panic!("no {attr} error in {:?}", d.errors))
            .clone()
    };
    assert!(find("device").contains("\"zzzz\""));
    assert!(find("device").contains("0000:00:1f.3/device"));
    assert!(find("revision").contains("\"\""));
    assert!(find("subsystem_vendor").contains("longer than 4096 bytes"));
    assert!(find("numa_node").contains("\"abc\""));
    assert!(find("class").contains("24-bit"));
    assert!(
        d.errors.iter().all(|e| e.len() < 400),
        "bad values are echoed shortened"
    );
    assert_eq!(d.device_name, None, "no name without a device id");
    assert_eq!(d.vendor_id.map(|v| v.0), Some(0x8086));
    assert_others_clean(&f, &inv, &[OTHER]);
}

#[test]
fn non_utf8_value_is_named() {
    let f = base();
    let t = f.build();
    t.write_attr(OTHER, "subsystem_device", b"0x\xff\xfe\n");
    t.write_attr(OTHER, "numa_node", b"\xc3\x28\n");
    let inv = scan(&t);
    let d = dev(&inv, OTHER);
    assert_eq!(d.errors.len(), 2, "{:?}", d.errors);
    assert!(d
        .errors
        .iter()
        .any(|e| e.starts_with("subsystem_device: ") && e.contains("not valid UTF-8")));
    assert!(d
        .errors
        .iter()
        .any(|e| e.starts_with("numa_node: ") && e.contains("0000:00:1f.3/numa_node")));
    assert_others_clean(&f, &inv, &[OTHER]);
}

#[test]
fn dangling_driver_and_group_links_are_named() {
    let f = base();
    let t = f.build();
    t.relink(OTHER, "driver", "../../../bus/pci/drivers/gone");
    t.relink(
        "0000:00:1f.4",
        "iommu_group",
        "../../../kernel/iommu_groups/999",
    );
    let inv = scan(&t);
    let d = dev(&inv, OTHER);
    let e = assert_one_error(&d, "driver", "0000:00:1f.3/driver");
    assert!(
        e.contains("does not exist") && e.contains("drivers/gone"),
        "{e}"
    );
    assert_eq!(d.driver, None);
    let g = dev(&inv, "0000:00:1f.4");
    assert_one_error(&g, "iommu_group", "0000:00:1f.4/iommu_group");
    assert_eq!(g.iommu_group, None);
    assert_others_clean(&f, &inv, &[OTHER, "0000:00:1f.4"]);
}

#[test]
fn dangling_physfn_is_named() {
    let f = base();
    let t = f.build();
    let vf = f.vfs(PF)[3].to_string();
    t.relink(&vf, "physfn", "../0000:3b:00.7");
    let inv = scan(&t);
    let d = dev(&inv, &vf);
    assert_one_error(&d, "physfn", &format!("{vf}/physfn"));
    assert_eq!((d.physfn, d.vf_index), (None, None));
    // The PF still lists it: its virtfn3 link is fine.
    assert_eq!(dev(&inv, PF).sriov.expect("sriov").vfs.len(), 12);
    assert_others_clean(&f, &inv, &[vf.as_str()]);
}

#[test]
fn virtfn_pointing_nowhere_is_named_on_the_pf() {
    let f = base();
    let t = f.build();
    let vfs = f.vfs(PF);
    t.relink(PF, "virtfn10", "../0000:3b:1f.7");
    let inv = scan(&t);
    let pf = dev(&inv, PF);
    assert_one_error(&pf, "virtfn10", "0000:3b:00.0/virtfn10");
    let s = pf.sriov.expect("sriov");
    assert_eq!(s.num_vfs, 12);
    let mut expected = vfs.clone();
    expected.remove(10);
    assert_eq!(s.vfs, expected, "dangling VF left out, order kept");
    // The VF behind virtfn10 still names its PF, but no link points back to it.
    let orphan = dev(&inv, &vfs[10].to_string());
    assert_eq!(orphan.physfn, Some(addr(PF)));
    assert_eq!(orphan.vf_index, None);
    assert_one_error(&orphan, "physfn", PF);
    assert_eq!(dev(&inv, &vfs[11].to_string()).vf_index, Some(11));
    assert_others_clean(&f, &inv, &[PF, vfs[10].to_string().as_str()]);
}

#[test]
fn numa_minus_one_is_none_without_error() {
    let f = base();
    let t = f.build();
    t.write_attr(OTHER, "numa_node", b"-1\n");
    let inv = scan(&t);
    let d = dev(&inv, OTHER);
    assert_eq!(d.numa_node, None);
    assert!(d.errors.is_empty());
    assert_eq!(dev(&inv, PF).numa_node, Some(1));
}

#[test]
fn absent_optional_attributes_are_not_errors() {
    let f = base();
    let t = f.build();
    t.remove_attr(OTHER, "numa_node");
    t.remove_attr(OTHER, "driver_override");
    let inv = scan(&t);
    let d = dev(&inv, OTHER);
    assert!(d.errors.is_empty(), "{:?}", d.errors);
    assert_eq!(d.numa_node, None);
}

#[test]
fn non_address_bus_entry_is_an_inventory_error() {
    let f = base();
    let t = f.build();
    std::fs::create_dir(t.sysfs_root().join("bus/pci/devices/not-a-device")).expect("mkdir");
    let inv = scan(&t);
    assert_others_clean(&f, &inv, &[]);
    assert_eq!(inv.errors.len(), 1);
    assert!(inv.errors[0].contains("not-a-device"), "{:?}", inv.errors);
}

#[test]
fn missing_root_is_an_error_naming_the_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = sysfs::scan(&dir.path().join("nope"), dir.path(), &PciNames::builtin())
        .expect_err("no bus");
    assert!(matches!(err, SysfsError::ListDir { .. }));
    assert!(err.to_string().contains("nope/bus/pci/devices"), "{err}");
    assert!(std::error::Error::source(&err).is_some(), "cause kept");
}

/// A scan never reads `driver_override`: the kernel takes the device's lock to show it,
/// so a read waits out any bind, unbind or probe of that device (minutes for a driver
/// whose remove hangs), and the inventory has no use for it. An unreadable one is no
/// problem of the scan's.
#[test]
fn group_peers_are_kept_and_driver_override_is_not_read() {
    let mut f = base();
    f.driver_override(OTHER, "vfio-pci").iommu_group(OTHER, 30);
    let t = f.build();
    t.make_attr_unreadable(OTHER, "driver_override");
    let inv = scan(&t);
    let d = dev(&inv, OTHER);
    assert!(d.errors.is_empty(), "{:?}", d.errors);
    assert_eq!(d.iommu_group_peers, vec![addr("0000:00:1f.4")]);
    assert_eq!(
        dev(&inv, "0000:00:1f.4").iommu_group_peers,
        vec![addr(OTHER)]
    );
}

#[test]
fn vfio_group_node_is_found() {
    let f = base();
    let t = f.build();
    let vfs = f.vfs(PF);
    t.vfio_node(100);
    let inv = scan(&t);
    let v0 = dev(&inv, &vfs[0].to_string());
    assert!(v0.is_vfio_bound());
    assert_eq!(v0.vfio_group, Some(t.dev_root().join("vfio/100")));
    assert!(v0.vfio_group_exists);
    let v1 = dev(&inv, &vfs[1].to_string());
    assert_eq!(v1.vfio_group, Some(t.dev_root().join("vfio/101")));
    assert!(!v1.vfio_group_exists);
    assert_eq!(dev(&inv, PF).vfio_group, None, "not bound to vfio-pci");
}

/// The iommufd interface's device node: found where sysfs lists it and the node exists;
/// not reported where a kernel older than the interface lists the name but has no node,
/// nor for a device not on vfio-pci; a `vfio-dev` that cannot be listed is named in that
/// device's errors and nothing else is lost.
#[test]
fn vfio_device_node_is_found_where_the_kernel_has_one() {
    let f = base();
    let t = f.build();
    let vfs: Vec<String> = f.vfs(PF).iter().map(|a| a.to_string()).collect();
    let node = t.vfio_device_node(&vfs[0], 0);
    std::fs::create_dir_all(t.device_dir(&vfs[1]).join("vfio-dev/vfio1")).expect("mkdir");
    std::fs::write(t.device_dir(&vfs[2]).join("vfio-dev"), "").expect("odd file");
    std::fs::create_dir_all(t.device_dir(OTHER).join("vfio-dev/vfio9")).expect("mkdir");
    let inv = scan(&t);
    assert_eq!(dev(&inv, &vfs[0]).vfio_device, Some(node));
    assert_eq!(dev(&inv, &vfs[1]).vfio_device, None, "listed, but no node");
    let v2 = dev(&inv, &vfs[2]);
    assert_eq!(v2.vfio_device, None);
    assert!(
        v2.errors.iter().any(|e| e.starts_with("vfio-dev:")),
        "{:?}",
        v2.errors
    );
    assert_eq!(v2.vfio_group, Some(t.dev_root().join("vfio/102")));
    assert_eq!(dev(&inv, OTHER).vfio_device, None, "not bound to vfio-pci");
    assert!(dev(&inv, &vfs[3]).errors.is_empty());
}

#[test]
fn scan_one_matches_scan() {
    let f = base();
    let t = f.build();
    let names = PciNames::builtin();
    let inv = scan(&t);
    for a in f.addresses() {
        let one = sysfs::scan_one(t.sysfs_root(), t.dev_root(), &names, a)
            .expect("scan_one")
            .expect("present");
        assert_eq!(&one, inv.get(a).expect("in scan"), "{a}");
    }
    let absent =
        sysfs::scan_one(t.sysfs_root(), t.dev_root(), &names, addr("0000:77:00.0")).expect("ok");
    assert_eq!(absent, None);
    // A dangling bus link is present-but-broken, not absent.
    symlink(
        "../../../devices/pci0000:00/0000:00:09.0",
        t.sysfs_root().join("bus/pci/devices/0000:00:09.0"),
    )
    .expect("symlink");
    let gone = sysfs::scan_one(t.sysfs_root(), t.dev_root(), &names, addr("0000:00:09.0"))
        .expect("ok")
        .expect("listed");
    assert_eq!(gone.errors.len(), 1);
}
