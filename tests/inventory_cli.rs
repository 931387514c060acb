//! `hostdevd scan` end to end: the JSON shape, the table, and a 4096-VF tree against lspci.

mod support;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Instant;

use hostdevd::sysfs::{self, PciNames};
use serde_json::Value;
use support::fakesys::{addr, FakeTree};
use support::lspci::lspci_sysfs;
use support::FakeSys;

const PF: &str = "0000:3b:00.0";

fn tree() -> (FakeSys, FakeTree) {
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 64, 11)
        .driver(PF, "i40e")
        .iommu_group(PF, 10)
        .numa(PF, 1)
        .netdev(PF, "ens1f0")
        .vf_driver(PF, "vfio-pci")
        .vf_iommu_groups(PF, 100);
    f.device("0000:00:1f.3", 0x8086, 0xa1f0)
        .class("0000:00:1f.3", 0x040300);
    // A vendor id neither PCI ID database knows.
    f.device("0001:00:00.0", 0x0bad, 0xfff0);
    let t = f.build();
    t.vfio_node(100);
    t.remove_attr("0001:00:00.0", "revision");
    (f, t)
}

fn hostdevd(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_hostdevd"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run hostdevd");
    assert!(
        out.status.success(),
        "hostdevd {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn is_hex(v: &Value, digits: usize) -> bool {
    v.as_str().is_some_and(|s| {
        s.len() == digits
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

#[test]
fn json_has_exactly_the_documented_fields() {
    let (f, t) = tree();
    let root = t.sysfs_root().to_str().expect("utf-8 temp path");
    let dev = t.dev_root().to_str().expect("utf-8 temp path");
    let out = hostdevd(&["scan", "--sysfs-root", root, "--dev-root", dev, "--json"]);
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert_eq!(text.trim_end().lines().count(), 1, "one JSON object");
    let v: Value = serde_json::from_str(&text).expect("json");
    let obj = v.as_object().expect("object");
    assert_eq!(obj.keys().collect::<Vec<_>>(), ["devices"]);
    let devices = obj["devices"].as_array().expect("array");
    assert_eq!(devices.len(), f.addresses().len());
    let want: BTreeSet<&str> = [
        "address",
        "vendor_id",
        "device_id",
        "subsystem_vendor_id",
        "subsystem_device_id",
        "class",
        "revision",
        "vendor_name",
        "device_name",
        "driver",
        "iommu_group",
        "numa_node",
        "netdevs",
        "physfn",
        "vf_index",
        "sriov",
        "vfio_group",
        "vfio_device",
        "errors",
    ]
    .into();
    let addrs: Vec<String> = devices
        .iter()
        .map(|d| d["address"].as_str().expect("address").to_string())
        .collect();
    let mut sorted = addrs.clone();
    sorted.sort();
    assert_eq!(addrs, sorted, "sorted by address");
    for d in devices {
        let keys: BTreeSet<&str> = d
            .as_object()
            .expect("entry")
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys, want);
        for k in [
            "vendor_id",
            "device_id",
            "subsystem_vendor_id",
            "subsystem_device_id",
        ] {
            assert!(is_hex(&d[k], 4), "{k} = {}", d[k]);
        }
        assert!(is_hex(&d["class"], 6), "{}", d["class"]);
        assert!(d["netdevs"].is_array() && d["errors"].is_array());
    }
    let by = |a: &str| devices.iter().find(|d| d["address"] == a).expect(a);
    let pf = by(PF);
    assert_eq!(pf["revision"], "01");
    assert_eq!(pf["vendor_name"], "Intel Corporation");
    assert_eq!(pf["driver"], "i40e");
    assert_eq!(
        (pf["iommu_group"].as_u64(), pf["numa_node"].as_u64()),
        (Some(10), Some(1))
    );
    assert_eq!(pf["netdevs"], serde_json::json!(["ens1f0"]));
    assert_eq!(pf["physfn"], Value::Null);
    let vfs: Vec<String> = f.vfs(PF).iter().map(|a| a.to_string()).collect();
    assert_eq!(
        pf["sriov"],
        serde_json::json!({"total_vfs": 64, "num_vfs": 11, "vfs": vfs})
    );
    let vf0 = by(&vfs[0]);
    assert_eq!(
        (vf0["physfn"].as_str(), vf0["vf_index"].as_u64()),
        (Some(PF), Some(0))
    );
    assert_eq!(vf0["sriov"], Value::Null);
    assert_eq!(vf0["vfio_group"], format!("{dev}/vfio/100"));
    assert_eq!(by(&vfs[10])["vf_index"], 10);
    let odd = by("0001:00:00.0");
    assert_eq!(
        (odd["vendor_name"].clone(), odd["device_name"].clone()),
        (Value::Null, Value::Null)
    );
    assert_eq!(
        (odd["driver"].clone(), odd["iommu_group"].clone()),
        (Value::Null, Value::Null)
    );
    assert_eq!(odd["revision"], Value::Null);
    let errors = odd["errors"].as_array().expect("errors");
    assert_eq!(errors.len(), 1);
    assert!(errors[0]
        .as_str()
        .is_some_and(|e| e.starts_with("revision: ") && e.contains("0001:00:00.0/revision")));
}

#[test]
fn table_nests_vfs_under_their_pf() {
    let (f, t) = tree();
    let root = t.sysfs_root().to_str().expect("utf-8 temp path");
    let out = hostdevd(&[
        "scan",
        "--sysfs-root",
        root,
        "--dev-root",
        "/nonexistent-dev",
    ]);
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("ADDRESS"), "{text}");
    let pf_line = lines
        .iter()
        .position(|l| l.starts_with(PF))
        .expect("pf row");
    assert!(
        lines[pf_line].contains("11/64 VFs") && lines[pf_line].contains("i40e"),
        "{text}"
    );
    for (i, vf) in f.vfs(PF).iter().enumerate() {
        let l = lines[pf_line + 1 + i];
        assert!(l.starts_with(&format!("  {vf}")), "{text}");
        assert!(
            l.contains(&format!("vf {i}")) && l.contains("vfio-pci"),
            "{l}"
        );
    }
    assert!(text.contains("! revision: "), "{text}");
}

#[test]
fn missing_root_fails_with_the_path() {
    let out = Command::new(env!("CARGO_BIN_EXE_hostdevd"))
        .args(["scan", "--sysfs-root", "/nonexistent-sysfs-root"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent-sysfs-root/bus/pci/devices"),
        "{err}"
    );
}

/// 16 PFs with 256 VFs each: builds in seconds, scans, and agrees with lspci on count
/// and VF links.
#[test]
fn four_thousand_vfs() {
    let start = Instant::now();
    let mut f = FakeSys::new();
    let mut group = 1;
    for p in 0..16u32 {
        // Each PF owns two buses: its own and the next one for its 256 VFs.
        let pf = format!("0000:{:02x}:00.0", 0x10 + 2 * p);
        f.pf(&pf, 0x8086, 0x1572, 256, 256)
            .driver(&pf, "i40e")
            .iommu_group(&pf, group);
        f.vf_driver(&pf, "vfio-pci").vf_iommu_groups(&pf, group + 1);
        group += 257;
    }
    let t = f.build();
    let built = start.elapsed();
    eprintln!("built {} devices in {built:?}", f.addresses().len());
    assert!(built.as_secs() < 15, "4096-VF tree took {built:?} to build");

    let start = Instant::now();
    let inv = sysfs::scan(t.sysfs_root(), t.dev_root(), &PciNames::builtin()).expect("scan");
    eprintln!("scanned in {:?}", start.elapsed());
    assert_eq!(inv.devices.len(), 16 * 257);
    assert!(inv.devices.iter().all(|d| d.errors.is_empty()));
    let pf = inv.get(addr("0000:1e:00.0")).expect("last pf");
    let vfs = &pf.sriov.as_ref().expect("sriov").vfs;
    assert_eq!(vfs.len(), 256);
    assert_eq!(vfs, &f.vfs("0000:1e:00.0"));
    assert_eq!(inv.get(vfs[255]).and_then(|d| d.vf_index), Some(255));

    let recs = lspci_sysfs(t.sysfs_root());
    assert_eq!(recs.len(), inv.devices.len());
    assert!(recs
        .iter()
        .zip(&inv.devices)
        .all(|(r, d)| r.slot() == d.address.to_string()));
}
