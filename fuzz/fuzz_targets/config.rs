//! Fuzz target: the TOML configuration loader (`Config::parse`: TOML, unknown keys,
//! device-selection compilation, socket mode, metrics and libvirt checks), and the
//! selection applied to a small fixed inventory.
//! Properties: no panic, bounded error messages, a parsed config's selection compiles
//! and its socket mode is a file mode.
#![no_main]

use std::sync::OnceLock;

use hostdevd::config::Config;
use hostdevd::simhost::FakeSys;
use hostdevd::sysfs::{self, PciDevice, PciNames};
use libfuzzer_sys::fuzz_target;

fn inventory() -> &'static [PciDevice] {
    static INV: OnceLock<Vec<PciDevice>> = OnceLock::new();
    INV.get_or_init(|| {
        let mut f = FakeSys::new();
        f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2)
            .driver("0000:3b:00.0", "i40e")
            .netdev("0000:3b:00.0", "ens1f0");
        f.vf_driver("0000:3b:00.0", "vfio-pci");
        f.device("0000:5e:00.0", 0x15b3, 0x1017);
        let tree = f.build();
        sysfs::scan(tree.sysfs_root(), tree.dev_root(), &PciNames::builtin())
            .expect("scan")
            .devices
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Config::parse(text) {
        Ok(cfg) => {
            let sel = cfg
                .selection()
                .expect("a parsed config's selection compiles");
            let _ = sel.to_string();
            let mode = cfg
                .socket_mode()
                .expect("a parsed config's socket mode is valid");
            assert!(mode <= 0o777);
            let facts = sel.facts(inventory());
            assert_eq!(facts.len(), inventory().len());
            if cfg.devices.is_empty() {
                // Without [[devices]], exactly the VFs are managed.
                for (f, d) in facts.iter().zip(inventory()) {
                    assert_eq!(f.managed, d.physfn.is_some(), "{}", d.address);
                }
            }
            assert!(cfg.libvirt.poll_interval_ms > 0 && cfg.libvirt.timeout_ms > 0);
        }
        Err(e) => {
            // TOML errors quote the offending line; nothing beyond that.
            let m = e.to_string();
            assert!(
                m.len() < 4096 + 2 * text.lines().map(str::len).max().unwrap_or(0),
                "error message of {} bytes",
                m.len()
            );
        }
    }
});
