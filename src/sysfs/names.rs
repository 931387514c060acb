//! Vendor and device names from the PCI ID database: the system's `pci.ids` when it is newer, else the `pci-ids` crate's copy.
//!
//! Distributions update `pci.ids` more often than this crate is rebuilt, but an old
//! system file should not hide names the crate already knows; so the two are compared by
//! the `# Version: YYYY.MM.DD` header and the newer wins. Only the header is read when
//! choosing; the system file is parsed once, on the first lookup.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use pci_ids::FromId;

use crate::pci::{DeviceId, VendorId};

/// Where distributions install `pci.ids`: Debian's `pci.ids` package, then hwdata
/// (Fedora, RHEL, SUSE).
pub const DEFAULT_PCI_IDS_PATHS: &[&str] =
    &["/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids"];

/// The `# Version:` date of the database built into the `pci-ids` crate, as (year,
/// month, day). Taken from the header of `pciids/pci.ids` in the crate's source for
/// pci-ids 0.2.6 (the version in Cargo.lock); update it when the crate is upgraded.
pub const BUILTIN_DB_DATE: DbDate = DbDate(2025, 7, 11);

/// A `pci.ids` version date; compares chronologically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DbDate(pub u16, pub u8, pub u8);

impl std::fmt::Display for DbDate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:04}.{:02}.{:02}", self.0, self.1, self.2)
    }
}

impl DbDate {
    /// Parses `YYYY.MM.DD`.
    pub fn parse(s: &str) -> Option<Self> {
        let mut it = s.trim().splitn(3, '.');
        let y = it.next()?.parse().ok()?;
        let m = it.next()?.parse().ok()?;
        let d = it.next()?.parse().ok()?;
        ((1..=12).contains(&m) && (1..=31).contains(&d)).then_some(DbDate(y, m, d))
    }
}

/// Which database answers lookups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NamesSource {
    /// The copy compiled into the `pci-ids` crate, dated [`BUILTIN_DB_DATE`].
    Builtin,
    /// A system `pci.ids` file with a newer version date.
    System { path: PathBuf, date: DbDate },
}

/// Vendors and their devices from a parsed `pci.ids` file.
#[derive(Debug, Default)]
struct SystemDb {
    vendors: HashMap<u16, (String, HashMap<u16, String>)>,
}

/// The PCI ID database used to name devices. Cheap to build; lookups are read-only and
/// the type is `Sync`, so one instance can be shared by every scan.
#[derive(Debug)]
pub struct PciNames {
    source: NamesSource,
    /// The parsed system file; `None` inside when it could not be read after all, in
    /// which case lookups fall back to the built-in copy.
    system: OnceLock<Option<SystemDb>>,
    /// Every name handed to a scanned device (vendor, device, driver), one shared copy
    /// each: a host's thousands of VFs carry the same three names, which would otherwise
    /// be three strings per VF in the inventory and the ledger the agent keeps.
    shared: Mutex<HashSet<Arc<str>>>,
}

impl PciNames {
    /// Names from the crate's built-in database only.
    pub fn builtin() -> Self {
        Self {
            source: NamesSource::Builtin,
            system: OnceLock::new(),
            shared: Mutex::default(),
        }
    }

    /// Picks the newest of the `pci.ids` files among `paths` (those present and with a
    /// readable version header) if it is strictly newer than the built-in copy.
    pub fn from_search_paths<P: AsRef<Path>>(paths: &[P]) -> Self {
        let best = paths
            .iter()
            .filter_map(|p| read_version(p.as_ref()).map(|d| (d, p.as_ref().to_path_buf())))
            .max_by_key(|(d, _)| *d);
        match best {
            Some((date, path)) if date > BUILTIN_DB_DATE => {
                tracing::debug!(path = %path.display(), %date, "using the system PCI ID database");
                Self {
                    source: NamesSource::System { path, date },
                    system: OnceLock::new(),
                    shared: Mutex::default(),
                }
            }
            _ => Self::builtin(),
        }
    }

    /// [`Self::from_search_paths`] over [`DEFAULT_PCI_IDS_PATHS`].
    pub fn system_default() -> Self {
        Self::from_search_paths(DEFAULT_PCI_IDS_PATHS)
    }

    /// Which database answers lookups.
    pub fn source(&self) -> &NamesSource {
        &self.source
    }

    fn system_db(&self) -> Option<&SystemDb> {
        let NamesSource::System { path, .. } = &self.source else {
            return None;
        };
        self.system
            .get_or_init(|| match parse_file(path) {
                Ok(db) => Some(db),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e,
                        "could not read the PCI ID database; using the built-in copy");
                    None
                }
            })
            .as_ref()
    }

    /// The vendor's name, if the database knows it.
    pub fn vendor_name(&self, vendor: VendorId) -> Option<&str> {
        match self.system_db() {
            Some(db) => db.vendors.get(&vendor.0).map(|(n, _)| n.as_str()),
            None => pci_ids::Vendor::from_id(vendor.0).map(|v| v.name()),
        }
    }

    /// The device's name, if the database knows it.
    pub fn device_name(&self, vendor: VendorId, device: DeviceId) -> Option<&str> {
        match self.system_db() {
            Some(db) => db
                .vendors
                .get(&vendor.0)
                .and_then(|(_, devs)| devs.get(&device.0))
                .map(String::as_str),
            None => pci_ids::Device::from_vid_pid(vendor.0, device.0).map(|d| d.name()),
        }
    }

    /// [`Self::vendor_name`], as the one copy every device with it shares.
    pub fn shared_vendor_name(&self, vendor: VendorId) -> Option<Arc<str>> {
        self.vendor_name(vendor).map(|n| self.share(n))
    }

    /// [`Self::device_name`], as the one copy every device with it shares.
    pub fn shared_device_name(&self, vendor: VendorId, device: DeviceId) -> Option<Arc<str>> {
        self.device_name(vendor, device).map(|n| self.share(n))
    }

    /// The one shared copy of `name` (see [`Self::shared_vendor_name`]); for names a scan
    /// reads from sysfs, such as a driver's.
    pub fn share(&self, name: &str) -> Arc<str> {
        let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = shared.get(name) {
            return n.clone();
        }
        let n: Arc<str> = Arc::from(name);
        shared.insert(n.clone());
        n
    }
}

/// Reads the `# Version:` date from the comment block at the top of a `pci.ids` file.
fn read_version(path: &Path) -> Option<DbDate> {
    let file = File::open(path).ok()?;
    // The header sits in the first few dozen lines; stop at the first entry line.
    for line in BufReader::new(file).lines().take(100) {
        let line = line.ok()?;
        let Some(comment) = line.strip_prefix('#') else {
            if line.trim().is_empty() {
                continue;
            }
            return None;
        };
        if let Some(v) = comment.trim().strip_prefix("Version:") {
            return DbDate::parse(v);
        }
    }
    None
}

fn parse_file(path: &Path) -> std::io::Result<SystemDb> {
    let bytes = std::fs::read(path)?;
    // The file is UTF-8 in practice; a stray byte costs one name, not the database.
    Ok(parse_db(&String::from_utf8_lossy(&bytes)))
}

/// Splits `"8086  Intel Corporation"` into the hex id and the name.
fn id_and_name(s: &str) -> Option<(u16, &str)> {
    let (id, name) = s.split_once([' ', '\t'])?;
    if id.len() != 4 {
        return None;
    }
    Some((u16::from_str_radix(id, 16).ok()?, name.trim()))
}

/// Parses the vendor section of `pci.ids`: `vvvv  name` lines, each followed by
/// `\tdddd  name` device lines (and `\t\t` subsystem lines, ignored). The class section
/// (`C cc  name`) comes after all vendors, so parsing stops there.
fn parse_db(text: &str) -> SystemDb {
    let mut db = SystemDb::default();
    let mut current: Option<u16> = None;
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        if line.starts_with("C ") {
            break;
        }
        if line.starts_with("\t\t") {
            continue;
        }
        if let Some(dev) = line.strip_prefix('\t') {
            if let (Some(v), Some((id, name))) = (current, id_and_name(dev)) {
                if let Some((_, devs)) = db.vendors.get_mut(&v) {
                    devs.insert(id, name.to_string());
                }
            }
            continue;
        }
        current = id_and_name(line).map(|(id, name)| {
            db.vendors.insert(id, (name.to_string(), HashMap::new()));
            id
        });
    }
    db
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str =
        "#\n#\tList of PCI ID's\n#\n#\tVersion: 2099.01.02\n#\tDate:    2099-01-02 03:15:02\n\n\
        8086  Intel Corporation (test)\n\t10fb  82599 test NIC\n\t\t8086 000c  X520 test\n\
        1af4  Red Hat, Inc.\n# comment inside\n\t1041  Virtio net\n\
        C 02  Network controller\n\t00  Ethernet controller\nffff  Not a vendor\n";

    #[test]
    fn parses_vendors_and_devices_not_classes() {
        let db = parse_db(SAMPLE);
        assert_eq!(db.vendors[&0x8086].0, "Intel Corporation (test)");
        assert_eq!(db.vendors[&0x8086].1[&0x10fb], "82599 test NIC");
        assert_eq!(db.vendors[&0x1af4].1[&0x1041], "Virtio net");
        assert!(!db.vendors.contains_key(&0xffff), "class section ignored");
        assert!(
            !db.vendors[&0x8086].1.contains_key(&0x8086),
            "subsystems ignored"
        );
    }

    #[test]
    fn newer_system_file_wins_older_loses() {
        let dir = tempfile::tempdir().expect("tempdir");
        let new = dir.path().join("new.ids");
        std::fs::write(&new, SAMPLE).expect("write");
        let old = dir.path().join("old.ids");
        std::fs::write(&old, SAMPLE.replace("2099.01.02", "2001.01.01")).expect("write");
        let missing = dir.path().join("missing.ids");

        let names = PciNames::from_search_paths(&[&missing, &old, &new]);
        assert_eq!(
            names.source(),
            &NamesSource::System {
                path: new.clone(),
                date: DbDate(2099, 1, 2)
            }
        );
        assert_eq!(
            names.device_name(VendorId(0x8086), DeviceId(0x10fb)),
            Some("82599 test NIC")
        );
        assert_eq!(
            names.vendor_name(VendorId(0x8086)),
            Some("Intel Corporation (test)")
        );

        let names = PciNames::from_search_paths(&[&old, &missing]);
        assert_eq!(names.source(), &NamesSource::Builtin);
        assert_eq!(
            names.vendor_name(VendorId(0x8086)),
            Some("Intel Corporation")
        );
        assert_eq!(names.device_name(VendorId(0x8086), DeviceId(0xfffe)), None);
    }

    #[test]
    fn devices_share_one_copy_of_each_name() {
        let names = PciNames::builtin();
        let a = names.shared_vendor_name(VendorId(0x8086)).expect("Intel");
        let b = names.shared_vendor_name(VendorId(0x8086)).expect("Intel");
        assert_eq!(&*a, "Intel Corporation");
        assert!(Arc::ptr_eq(&a, &b), "one copy");
        let d = names
            .shared_device_name(VendorId(0x8086), DeviceId(0x10fb))
            .expect("82599");
        assert_eq!(
            Some(&*d),
            names.device_name(VendorId(0x8086), DeviceId(0x10fb))
        );
        assert!(!Arc::ptr_eq(&a, &d));
        assert_eq!(
            names.shared_device_name(VendorId(0x8086), DeviceId(0xfffe)),
            None
        );
    }

    #[test]
    fn system_file_removed_after_choice_falls_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let new = dir.path().join("pci.ids");
        std::fs::write(&new, SAMPLE).expect("write");
        let names = PciNames::from_search_paths(&[&new]);
        std::fs::remove_file(&new).expect("rm");
        assert_eq!(
            names.vendor_name(VendorId(0x8086)),
            Some("Intel Corporation")
        );
    }

    #[test]
    fn dates() {
        assert_eq!(DbDate::parse(" 2023.04.10"), Some(DbDate(2023, 4, 10)));
        assert_eq!(DbDate::parse("2023.13.10"), None);
        assert_eq!(DbDate::parse("soon"), None);
        assert!(DbDate(2023, 4, 10) < BUILTIN_DB_DATE);
        assert_eq!(BUILTIN_DB_DATE.to_string(), "2025.07.11");
    }
}
