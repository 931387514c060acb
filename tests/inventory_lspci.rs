//! The inventory checked against lspci, an independent reader of the same trees: generated fake trees and this machine's own sysfs.

mod support;

use std::collections::BTreeMap;
use std::path::Path;

use hostdevd::sysfs::{self, Inventory, PciDevice, PciNames, DEFAULT_DEV_ROOT, DEFAULT_SYSFS_ROOT};
use support::fakesys::addr;
use support::lspci::{lspci_host, lspci_sysfs, LspciRecord};
use support::{FakeSys, PfLayout};

fn hex4(v: Option<impl std::fmt::Display>) -> Option<String> {
    v.map(|v| v.to_string())
}

/// Every address, id, class, revision, driver, NUMA node and IOMMU group must agree,
/// given lspci's rules for leaving lines out (see `support::lspci`).
fn assert_agrees(inv: &Inventory, recs: &[LspciRecord]) {
    let ours: BTreeMap<String, &PciDevice> = inv
        .devices
        .iter()
        .map(|d| (d.address.to_string(), d))
        .collect();
    let theirs: BTreeMap<String, &LspciRecord> =
        recs.iter().map(|r| (r.slot().to_string(), r)).collect();
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>(),
        "the two device lists differ"
    );
    for (slot, d) in &ours {
        let r = theirs[slot];
        let ctx = format!("{slot}: ours {d:?}\nlspci {:?}", r.fields);
        assert!(d.errors.is_empty(), "{ctx}");
        assert_eq!(hex4(d.vendor_id), r.id("Vendor"), "vendor of {ctx}");
        assert_eq!(hex4(d.device_id), r.id("Device"), "device of {ctx}");
        let class = d.class.expect("class read");
        assert_eq!(
            Some(format!("{:04x}", class.0 >> 8)),
            r.id("Class"),
            "class of {ctx}"
        );
        assert_eq!(
            Some(format!("{:02x}", class.prog_if())),
            r.get("ProgIf").map(str::to_string),
            "prog-if of {ctx}"
        );
        let rev = d.revision.expect("revision read");
        let want_rev = (rev.0 != 0).then(|| rev.to_string());
        assert_eq!(
            want_rev,
            r.get("Rev").map(str::to_string),
            "revision of {ctx}"
        );
        let sv = d.subsystem_vendor_id.expect("subsystem vendor read");
        if sv.0 != 0 && sv.0 != 0xffff {
            assert_eq!(
                Some(sv.to_string()),
                r.id("SVendor"),
                "subsystem vendor of {ctx}"
            );
            assert_eq!(
                hex4(d.subsystem_device_id),
                r.id("SDevice"),
                "subsystem device of {ctx}"
            );
        } else {
            assert_eq!(r.get("SVendor"), None, "{ctx}");
        }
        assert_eq!(d.driver.as_deref(), r.get("Driver"), "driver of {ctx}");
        assert_eq!(
            d.numa_node.map(|n| n.to_string()).as_deref(),
            r.get("NUMANode"),
            "NUMA node of {ctx}"
        );
        assert_eq!(
            d.iommu_group.map(|n| n.to_string()).as_deref(),
            r.get("IOMMUGroup"),
            "IOMMU group of {ctx}"
        );
    }
}

fn check_tree(f: &FakeSys) -> Inventory {
    let tree = f.build();
    let names = PciNames::builtin();
    let inv = sysfs::scan(tree.sysfs_root(), tree.dev_root(), &names).expect("scan");
    assert_agrees(&inv, &lspci_sysfs(tree.sysfs_root()));
    inv
}

/// Several PFs with VFs (one with more than 10), a second PCI domain, a PF with 0 VFs,
/// devices without driver or IOMMU group, multi-function devices sharing a group, a
/// bridge, revision 0 and subsystem 0 (which lspci leaves out).
fn mixed_tree() -> FakeSys {
    let mut f = FakeSys::new();
    f.device("0000:00:00.0", 0x8086, 0x0d57)
        .class("0000:00:00.0", 0x060000)
        .revision("0000:00:00.0", 0)
        .subsystem("0000:00:00.0", 0, 0);
    f.bridge("0000:00:01.0", 0x8086, 0x2030)
        .iommu_group("0000:00:01.0", 1);
    f.pf("0000:3b:00.0", 0x8086, 0x1572, 64, 12)
        .behind("0000:3b:00.0", "0000:00:01.0")
        .driver("0000:3b:00.0", "i40e")
        .iommu_group("0000:3b:00.0", 10)
        .numa("0000:3b:00.0", 1)
        .netdev("0000:3b:00.0", "ens1f0")
        .vf_driver("0000:3b:00.0", "iavf")
        .vf_iommu_groups("0000:3b:00.0", 100);
    // Its VFs start after PF 0's 64 possible VFs, as real First VF Offsets arrange.
    f.pf_with(
        "0000:3b:00.1",
        0x8086,
        0x1572,
        64,
        3,
        PfLayout {
            offset: 0x80 + 63,
            ..PfLayout::for_device(0x1572)
        },
    )
    .behind("0000:3b:00.1", "0000:00:01.0")
    .driver("0000:3b:00.1", "i40e")
    .iommu_group("0000:3b:00.1", 11)
    .numa("0000:3b:00.1", 1)
    .vf_driver("0000:3b:00.1", "vfio-pci");
    // A PF whose VFs are not enabled.
    f.pf("0000:5e:00.0", 0x15b3, 0x1017, 8, 0)
        .driver("0000:5e:00.0", "mlx5_core")
        .iommu_group("0000:5e:00.0", 20);
    // Multi-function device, both functions in one group.
    f.device("0000:00:1f.0", 0x8086, 0xa1c1)
        .class("0000:00:1f.0", 0x060100)
        .iommu_group("0000:00:1f.0", 30);
    f.device("0000:00:1f.3", 0x8086, 0xa1f0)
        .class("0000:00:1f.3", 0x040300)
        .driver("0000:00:1f.3", "snd_hda_intel")
        .iommu_group("0000:00:1f.3", 30);
    // No driver, no group.
    f.device("0000:00:1f.4", 0x8086, 0xa1a3)
        .class("0000:00:1f.4", 0x0c0500);
    // A second PCI domain with its own PF.
    f.device("0001:00:00.0", 0x8086, 0x09ab)
        .class("0001:00:00.0", 0x088000);
    f.pf_with(
        "0001:00:02.0",
        0x14e4,
        0x16d7,
        16,
        2,
        PfLayout {
            vf_device: 0x16dc,
            offset: 8,
            stride: 2,
        },
    )
    .driver("0001:00:02.0", "bnxt_en")
    .numa("0001:00:02.0", 0);
    f
}

#[test]
fn mixed_tree_agrees_with_lspci() {
    let f = mixed_tree();
    let inv = check_tree(&f);
    let pf = inv.get(addr("0000:3b:00.0")).expect("pf");
    let s = pf.sriov.as_ref().expect("sriov");
    assert_eq!((s.total_vfs, s.num_vfs), (64, 12));
    assert_eq!(
        s.vfs,
        f.vfs("0000:3b:00.0"),
        "VF-index order, virtfn10 after virtfn9"
    );
    for (i, vf) in f.vfs("0000:3b:00.0").iter().enumerate() {
        let d = inv.get(*vf).expect("vf");
        assert_eq!(d.physfn, Some(pf.address));
        assert_eq!(d.vf_index, Some(i as u32));
        assert_eq!(d.numa_node, Some(1), "VFs inherit the PF's node");
        assert_eq!(d.iommu_group, Some(100 + i as u32));
        assert!(d.iommu_group_peers.is_empty());
    }
    let none = inv.get(addr("0000:5e:00.0")).expect("pf 0 vfs");
    assert_eq!(
        none.sriov
            .as_ref()
            .map(|s| (s.total_vfs, s.num_vfs, s.vfs.len())),
        Some((8, 0, 0))
    );
    let lpc = inv.get(addr("0000:00:1f.0")).expect("lpc");
    assert_eq!(lpc.iommu_group_peers, vec![addr("0000:00:1f.3")]);
    let bare = inv.get(addr("0000:00:1f.4")).expect("bare");
    assert_eq!(
        (bare.driver.as_deref(), bare.iommu_group, bare.numa_node),
        (None, None, None)
    );
    assert_eq!(pf.netdevs, vec!["ens1f0".to_string()]);
    let d1 = f.vfs("0001:00:02.0");
    assert_eq!(
        d1.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        ["0001:00:03.0", "0001:00:03.2"]
    );
    assert_eq!(inv.get(d1[1]).and_then(|d| d.vf_index), Some(1));
}

/// A small deterministic generator (no extra crate): a few PFs with random VF counts,
/// drivers, groups and NUMA nodes, across two domains.
fn generated_tree(seed: u64) -> FakeSys {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let mut f = FakeSys::new();
    let mut group = 1;
    for p in 0..(1 + next(4)) {
        let domain = next(2);
        let bus = 0x10 + p * 0x10;
        let a = format!("{domain:04x}:{bus:02x}:00.0");
        let total = 1 + next(40) as u32;
        let num = next(u64::from(total) + 1) as u32;
        f.pf(&a, 0x8086, 0x1572, total, num);
        if next(3) > 0 {
            f.driver(&a, "i40e");
        }
        if next(2) == 0 {
            f.numa(&a, next(4) as i32);
        }
        f.iommu_group(&a, group);
        group += 1;
        for vf in f.vfs(&a) {
            let vf = vf.to_string();
            match next(3) {
                0 => {}
                1 => {
                    f.driver(&vf, "iavf");
                }
                _ => {
                    f.driver(&vf, "vfio-pci");
                }
            }
            if next(4) > 0 {
                f.iommu_group(&vf, group);
                group += 1;
            }
        }
        // A multi-function sibling sharing the PF's group half of the time.
        if next(2) == 0 {
            let sib = format!("{domain:04x}:{bus:02x}:00.1");
            f.device(&sib, 0x8086, 0x1572).revision(&sib, next(3) as u8);
            f.iommu_group(&sib, group - 1);
        }
    }
    f
}

#[test]
fn generated_trees_agree_with_lspci() {
    for seed in 0..8 {
        let f = generated_tree(seed);
        let inv = check_tree(&f);
        assert_eq!(inv.devices.len(), f.addresses().len(), "seed {seed}");
    }
}

/// This machine's real sysfs, read by both.
#[test]
fn host_sysfs_agrees_with_lspci() {
    let names = PciNames::system_default();
    let inv = sysfs::scan(
        Path::new(DEFAULT_SYSFS_ROOT),
        Path::new(DEFAULT_DEV_ROOT),
        &names,
    )
    .expect("scan the host's sysfs");
    assert!(!inv.devices.is_empty(), "this host has PCI devices");
    assert_agrees(&inv, &lspci_host());
}
