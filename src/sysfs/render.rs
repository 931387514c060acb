//! The human-readable inventory table printed by `hostdevd scan`: PFs with their VFs indented beneath.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use crate::pci::PciAddress;

use super::{Inventory, PciDevice};

const HEADERS: [&str; 8] = [
    "ADDRESS", "IDS", "CLASS", "DRIVER", "IOMMU", "NUMA", "SR-IOV", "NAME",
];

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

fn row(dev: &PciDevice, indent: bool) -> [String; 8] {
    let address = if indent {
        format!("  {}", dev.address)
    } else {
        dev.address.to_string()
    };
    let ids = format!("{}:{}", opt(dev.vendor_id), opt(dev.device_id));
    let sriov = match (&dev.sriov, dev.vf_index) {
        (Some(s), _) => format!("{}/{} VFs", s.num_vfs, s.total_vfs),
        (None, Some(i)) => format!("vf {i}"),
        (None, None) if dev.physfn.is_some() => "vf ?".to_string(),
        (None, None) => "-".to_string(),
    };
    let mut name = match (&dev.vendor_name, &dev.device_name) {
        (Some(v), Some(d)) => format!("{v} {d}"),
        (Some(v), None) => format!("{v} device {}", opt(dev.device_id)),
        (None, _) => "(unknown)".to_string(),
    };
    if !dev.netdevs.is_empty() {
        let _ = write!(name, " [{}]", dev.netdevs.join(","));
    }
    [
        address,
        ids,
        opt(dev.class),
        opt(dev.driver.as_deref()),
        opt(dev.iommu_group),
        opt(dev.numa_node),
        sriov,
        name,
    ]
}

/// Renders the inventory as an aligned table. Each VF is listed right under its PF (in
/// VF-index order), indented; VFs whose PF is missing stay at the top level.
pub fn render_table(inv: &Inventory) -> String {
    let present: HashSet<PciAddress> = inv.devices.iter().map(|d| d.address).collect();
    let by_addr: HashMap<PciAddress, &PciDevice> =
        inv.devices.iter().map(|d| (d.address, d)).collect();
    let nested = |d: &PciDevice| d.physfn.is_some_and(|p| present.contains(&p));

    let mut ordered: Vec<(&PciDevice, bool)> = Vec::with_capacity(inv.devices.len());
    for dev in inv.devices.iter().filter(|d| !nested(d)) {
        ordered.push((dev, false));
        if let Some(s) = &dev.sriov {
            for vf in s.vfs.iter().filter_map(|a| by_addr.get(a)) {
                // Only VFs that name this PF back; others are listed on their own.
                if vf.physfn == Some(dev.address) {
                    ordered.push((vf, true));
                }
            }
        }
    }
    // VFs naming a present PF that does not list them would otherwise be lost.
    let shown: HashSet<PciAddress> = ordered.iter().map(|(d, _)| d.address).collect();
    for dev in inv.devices.iter().filter(|d| !shown.contains(&d.address)) {
        ordered.push((dev, false));
    }

    let rows: Vec<([String; 8], &PciDevice)> =
        ordered.iter().map(|(d, i)| (row(d, *i), *d)).collect();
    let mut widths = HEADERS.map(str::len);
    for (r, _) in &rows {
        for (w, cell) in widths.iter_mut().zip(r.iter()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let push_line = |out: &mut String, cells: &[String]| {
        let mut line = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<w$}  ", w = widths[i]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    };
    push_line(&mut out, &HEADERS.map(str::to_string));
    for (r, dev) in &rows {
        push_line(&mut out, r);
        for e in &dev.errors {
            let _ = writeln!(out, "    ! {e}");
        }
    }
    let vfs = inv.devices.iter().filter(|d| d.is_vf()).count();
    let with_errors = inv.devices.iter().filter(|d| !d.errors.is_empty()).count();
    let _ = writeln!(
        out,
        "{} devices ({} VFs), {} with errors",
        inv.devices.len(),
        vfs,
        with_errors
    );
    for e in &inv.errors {
        let _ = writeln!(out, "! {e}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sysfs::SriovInfo;

    fn addr(s: &str) -> PciAddress {
        s.parse().expect("address")
    }

    #[test]
    fn vfs_sit_under_their_pf() {
        let mut pf = PciDevice::new(addr("0000:3b:00.0"));
        pf.sriov = Some(SriovInfo {
            total_vfs: 8,
            num_vfs: 1,
            vfs: vec![addr("0000:3b:10.0")],
        });
        pf.driver = Some("ixgbe".into());
        let mut vf = PciDevice::new(addr("0000:3b:10.0"));
        vf.physfn = Some(pf.address);
        vf.vf_index = Some(0);
        let mut other = PciDevice::new(addr("0000:3b:00.1"));
        other.errors.push("vendor: broken".into());
        let inv = Inventory {
            devices: vec![pf, other, vf],
            errors: vec![],
        };
        let t = render_table(&inv);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("ADDRESS"));
        assert!(lines[1].starts_with("0000:3b:00.0"), "{t}");
        assert!(lines[1].contains("1/8 VFs"), "{t}");
        assert!(lines[2].starts_with("  0000:3b:10.0"), "{t}");
        assert!(lines[2].contains("vf 0"), "{t}");
        assert!(lines[3].starts_with("0000:3b:00.1"), "{t}");
        assert!(lines[4].contains("! vendor: broken"), "{t}");
        assert!(t.contains("3 devices (1 VFs), 1 with errors"), "{t}");
    }
}
