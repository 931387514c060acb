//! Fuzz target: a whole `hostdevd::sysfs::scan` of a small fake tree (an SR-IOV PF with
//! two VFs and a plain device) whose attribute files and links are rewritten from the
//! input, then the inventory rendered and turned into ledger facts.
//!
//! Input: chunks separated by 0x00; each chunk's first byte picks a slot (device and
//! attribute or link), the rest is the new content (a lone 0xff removes the entry).
//! Properties: the scan never fails or panics, every device is still listed, each id
//! attribute is what `sysfs::attr` parses from the same bytes, and the tree is restored
//! after every input.
#![no_main]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use hostdevd::config::Config;
use hostdevd::simhost::{FakeSys, FakeTree};
use hostdevd::sysfs::attr::MAX_ATTR_LEN;
use hostdevd::sysfs::{self, attr, PciNames};
use libfuzzer_sys::fuzz_target;

const DEVICES: [&str; 4] = [
    "0000:3b:00.0",
    "0000:3b:10.0",
    "0000:3b:10.1",
    "0000:5e:00.0",
];
const FILES: [&str; 11] = [
    "vendor",
    "device",
    "subsystem_vendor",
    "subsystem_device",
    "class",
    "revision",
    "numa_node",
    "driver_override",
    "sriov_totalvfs",
    "sriov_numvfs",
    "sriov_vf_device",
];
const LINKS: [&str; 5] = ["iommu_group", "driver", "physfn", "virtfn0", "virtfn1"];

struct Host {
    tree: FakeTree,
    names: PciNames,
}

fn host() -> &'static Host {
    static HOST: OnceLock<Host> = OnceLock::new();
    HOST.get_or_init(|| {
        let mut f = FakeSys::new();
        f.pf(DEVICES[0], 0x8086, 0x1572, 8, 2)
            .driver(DEVICES[0], "i40e")
            .netdev(DEVICES[0], "ens1f0");
        f.iommu_group(DEVICES[0], 10)
            .vf_iommu_groups(DEVICES[0], 100)
            .vf_driver(DEVICES[0], "vfio-pci");
        f.device(DEVICES[3], 0x15b3, 0x1017)
            .iommu_group(DEVICES[3], 30);
        Host {
            tree: f.build(),
            names: PciNames::builtin(),
        }
    })
}

/// What was at a path before the input changed it.
enum Saved {
    Absent,
    File(Vec<u8>),
    Link(PathBuf),
}

fn save(p: &Path) -> Saved {
    match std::fs::symlink_metadata(p) {
        Err(_) => Saved::Absent,
        Ok(m) if m.file_type().is_symlink() => {
            Saved::Link(std::fs::read_link(p).expect("read the original link"))
        }
        Ok(_) => Saved::File(std::fs::read(p).expect("read the original file")),
    }
}

fn restore(p: &Path, s: &Saved) {
    let _ = std::fs::remove_file(p);
    match s {
        Saved::Absent => {}
        Saved::File(b) => std::fs::write(p, b).expect("restore file"),
        Saved::Link(t) => std::os::unix::fs::symlink(t, p).expect("restore link"),
    }
}

/// The value `scan` must report for an id-like attribute written with `content`.
fn expected<T>(content: &[u8], parse: impl Fn(&str) -> Option<T>) -> Option<T> {
    if content.len() > MAX_ATTR_LEN {
        return None;
    }
    let text = std::str::from_utf8(content).ok()?;
    parse(attr::trim_value(text))
}

fuzz_target!(|data: &[u8]| {
    let h = host();
    let slots = DEVICES.len() * (FILES.len() + LINKS.len());
    let mut changed: Vec<(PathBuf, Saved)> = Vec::new();
    // (device index, attribute, content) of the id attributes written last.
    let mut written: Vec<(usize, &str, Vec<u8>)> = Vec::new();
    for chunk in data.split(|b| *b == 0).take(8) {
        let Some((&sel, content)) = chunk.split_first() else {
            continue;
        };
        let slot = usize::from(sel) % slots;
        let dev = slot / (FILES.len() + LINKS.len());
        let which = slot % (FILES.len() + LINKS.len());
        let dir = h.tree.device_dir(DEVICES[dev]);
        let (name, is_link) = if which < FILES.len() {
            (FILES[which], false)
        } else {
            (LINKS[which - FILES.len()], true)
        };
        let path = dir.join(name);
        if !changed.iter().any(|(p, _)| *p == path) {
            changed.push((path.clone(), save(&path)));
        }
        let _ = std::fs::remove_file(&path);
        written.retain(|(d, n, _)| !(*d == dev && *n == name));
        if content == [0xff] {
            continue; // removed
        }
        if is_link {
            if !content.is_empty() {
                let _ = std::os::unix::fs::symlink(OsStr::from_bytes(content), &path);
            }
        } else {
            std::fs::write(&path, content).expect("write attribute");
            written.push((dev, name, content.to_vec()));
        }
    }

    let inv = sysfs::scan(h.tree.sysfs_root(), h.tree.dev_root(), &h.names)
        .expect("the bus directory is there, so the scan succeeds");
    assert_eq!(
        inv.devices.len(),
        DEVICES.len(),
        "a device vanished: {:?}",
        inv.errors
    );
    for (dev, name, content) in &written {
        let d = inv
            .get(DEVICES[*dev].parse().expect("address"))
            .expect("device listed");
        let p = Path::new("x");
        match *name {
            "vendor" => assert_eq!(
                d.vendor_id.map(|v| v.0),
                expected(content, |t| attr::parse_id16(p, t).ok())
            ),
            "device" => assert_eq!(
                d.device_id.map(|v| v.0),
                expected(content, |t| attr::parse_id16(p, t).ok())
            ),
            "class" => assert_eq!(d.class, expected(content, |t| attr::parse_class(p, t).ok())),
            "revision" => assert_eq!(
                d.revision,
                expected(content, |t| attr::parse_revision(p, t).ok())
            ),
            "numa_node" => {
                let want = expected(content, |t| attr::parse_numa_node(p, t).ok());
                // A VF without its own node takes its PF's; only check what it read.
                if let Some(n) = want {
                    if n.is_some() {
                        assert_eq!(d.numa_node, n);
                    }
                }
            }
            _ => {}
        }
    }
    for d in &inv.devices {
        for e in &d.errors {
            // Values are cut at 40 bytes; a link target is quoted whole, and the kernel
            // bounds it (PATH_MAX), as does this tree (no chunk is longer than the input).
            assert!(
                e.len() < 1024 + 3 * data.len(),
                "error of {} bytes: {e:.300}",
                e.len()
            );
        }
    }
    let table = sysfs::render::render_table(&inv);
    assert!(table.len() < 1 << 20);
    let facts = Config::default()
        .selection()
        .expect("default selection")
        .facts(&inv.devices);
    assert_eq!(facts.len(), inv.devices.len());

    for (p, s) in changed.iter().rev() {
        restore(p, s);
    }
});
