//! The independent oracle: runs Debian's `lspci -D -nn -vmm -k` (on a fake tree via `-A linux-sysfs -O sysfs.path=...`) and parses its records.
//!
//! What lspci 3.9 prints, as seen on fake and real trees: `Slot`, `Class` ("Ethernet
//! controller [0200]": base class and subclass only; the prog-if is a separate `ProgIf`
//! line), `Vendor`/`Device` ("Intel Corporation [8086]"), `SVendor`/`SDevice` only when the
//! subsystem vendor is neither 0000 nor ffff, `Rev` only when the revision is not 00,
//! `Driver`, `Module` (when libkmod finds one), `NUMANode` only when it is not -1, and
//! `IOMMUGroup` when the `iommu_group` link exists.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// One `-vmm` record: each `Key:\tValue` line, keyed by the key.
#[derive(Debug, Clone, Default)]
pub struct LspciRecord {
    pub fields: BTreeMap<String, String>,
}

impl LspciRecord {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.fields.get(key).map(String::as_str)
    }

    /// The `[xxxx]` id at the end of a `-nn` value ("Intel Corporation [8086]" → "8086").
    pub fn id(&self, key: &str) -> Option<String> {
        let v = self.get(key)?;
        let open = v.rfind('[')?;
        let close = v.rfind(']')?;
        (close > open).then(|| v[open + 1..close].to_lowercase())
    }

    pub fn slot(&self) -> &str {
        self.get("Slot").unwrap_or("")
    }
}

/// Parses `lspci -vmm` output: records separated by blank lines.
pub fn parse_vmm(text: &str) -> Vec<LspciRecord> {
    let mut out = Vec::new();
    let mut cur = LspciRecord::default();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !cur.fields.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            continue;
        }
        if let Some((k, v)) = line.split_once(':') {
            cur.fields
                .insert(k.trim().to_string(), v.trim().to_string());
        }
    }
    if !cur.fields.is_empty() {
        out.push(cur);
    }
    out
}

const MISSING: &str =
    "lspci is required by the inventory tests as an independent oracle and was not \
     found; install it with `apt-get install pciutils` (it must not be skipped)";

fn run(args: &[&str]) -> Vec<LspciRecord> {
    let out = match Command::new("lspci").args(args).output() {
        Ok(o) => o,
        Err(e) => panic!("{MISSING}: {e}"),
    };
    assert!(
        out.status.success(),
        "lspci {args:?} failed with {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    parse_vmm(&String::from_utf8_lossy(&out.stdout))
}

/// lspci's view of a (fake) sysfs tree rooted at `sysfs_root`.
pub fn lspci_sysfs(sysfs_root: &Path) -> Vec<LspciRecord> {
    let opt = format!("sysfs.path={}", sysfs_root.join("bus/pci").display());
    // hwdb lookups would read the host's udev database, irrelevant for a fake tree.
    run(&[
        "-A",
        "linux-sysfs",
        "-O",
        &opt,
        "-O",
        "hwdb.disable=1",
        "-D",
        "-nn",
        "-vmm",
        "-k",
    ])
}

/// lspci's view of this machine.
pub fn lspci_host() -> Vec<LspciRecord> {
    run(&["-D", "-nn", "-vmm", "-k"])
}
