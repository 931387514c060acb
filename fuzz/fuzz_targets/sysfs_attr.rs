//! Fuzz target: the sysfs attribute parsers of `hostdevd::sysfs::attr` on arbitrary
//! values (ids, class, revision, counts, NUMA node, driver_override, virtfnN names).
//! Properties: no panic, bounded errors, and every accepted value agrees with the
//! kernel's own formatting of the number it parsed to.
#![no_main]

use std::path::Path;

use hostdevd::sysfs::attr;
use hostdevd::sysfs::SysfsError;
use libfuzzer_sys::fuzz_target;

fn bounded(e: &SysfsError) {
    let m = e.full_message();
    // The value is cut at 40 bytes before it is quoted ({:?}: up to 10 bytes a byte).
    assert!(
        m.len() < 1024,
        "error message of {} bytes: {m:.600}",
        m.len()
    );
}

fuzz_target!(|data: &[u8]| {
    // read_text refuses non-UTF-8 before any parser runs; the parsers see text.
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("/sys/bus/pci/devices/0000:00:00.0/attr");
    let v = attr::trim_value(raw);
    assert!(raw.contains(v), "trim_value returns a slice of its input");
    assert_eq!(attr::trim_value(v), v, "trim_value is idempotent");

    match attr::parse_id16(path, v) {
        Ok(id) => {
            assert_eq!(
                attr::parse_id16(path, &format!("0x{id:04x}")).ok(),
                Some(id)
            );
            assert!(v.len() <= 6, "{v:?} is longer than 0xffff");
        }
        Err(e) => bounded(&e),
    }
    match attr::parse_class(path, v) {
        Ok(c) => {
            assert!(c.0 <= 0xff_ffff);
            let again = attr::parse_class(path, &format!("0x{:06x}", c.0)).ok();
            assert_eq!(again, Some(c));
            assert_eq!(
                (u32::from(c.base()) << 16)
                    | (u32::from(c.subclass()) << 8)
                    | u32::from(c.prog_if()),
                c.0
            );
        }
        Err(e) => bounded(&e),
    }
    match attr::parse_revision(path, v) {
        Ok(r) => assert_eq!(
            attr::parse_revision(path, &format!("0x{:02x}", r.0)).ok(),
            Some(r)
        ),
        Err(e) => bounded(&e),
    }
    match attr::parse_u32(path, v) {
        Ok(n) => {
            assert!(
                v.bytes().all(|b| b.is_ascii_digit()),
                "{v:?} accepted as a number"
            );
            assert_eq!(attr::parse_u32(path, &n.to_string()).ok(), Some(n));
        }
        Err(e) => bounded(&e),
    }
    match attr::parse_numa_node(path, v) {
        Ok(None) => assert_eq!(v, "-1"),
        Ok(Some(n)) => assert_eq!(attr::parse_u32(path, v).ok(), Some(n)),
        Err(e) => bounded(&e),
    }
    match attr::parse_driver_override(v) {
        Some(d) => {
            assert_eq!(d, v);
            assert!(!d.is_empty() && d != "(null)");
        }
        None => assert!(v.is_empty() || v == "(null)"),
    }
    if let Some(i) = attr::virtfn_index(v) {
        assert_eq!(attr::virtfn_index(&format!("virtfn{i}")), Some(i));
        assert!(v.starts_with("virtfn"));
    }
});
