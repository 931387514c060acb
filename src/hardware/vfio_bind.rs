//! Binding a device to vfio-pci (`driver_override`, unbind, `drivers_probe`) and giving
//! it back to its original driver, one named step at a time.

use crate::pci::PciAddress;

use super::{Hardware, HardwareError, VFIO_PCI_DRIVER};

impl Hardware {
    /// Binds `address` to vfio-pci and returns the driver it had before (`None`:
    /// unbound). Already on vfio-pci: nothing is written and the answer is vfio-pci.
    ///
    /// Steps: check vfio-pci is loaded; write "vfio-pci" to `driver_override` unless it
    /// names vfio-pci already (so no other driver can take the device in between);
    /// unbind from the current driver; write the address to `bus/pci/drivers_probe`; wait
    /// until the `driver` link names vfio-pci.
    pub fn bind_vfio(&self, address: PciAddress) -> Result<Option<String>, HardwareError> {
        let original = self.driver(address, "read current driver")?;
        if original.as_deref() == Some(VFIO_PCI_DRIVER) {
            return Ok(original);
        }
        self.require_driver(address, VFIO_PCI_DRIVER)?;
        let dir = self.device_dir(address);
        let addr = address.to_string();
        // Set already (a release that failed part way left it so, its own write to
        // clear it refused): not written again.
        if self.driver_override(address)?.as_deref() != Some(VFIO_PCI_DRIVER) {
            self.write(
                address,
                "set driver_override",
                &dir.join("driver_override"),
                VFIO_PCI_DRIVER,
            )?;
        }
        if original.is_some() {
            self.write(
                address,
                "unbind current driver",
                &dir.join("driver/unbind"),
                &addr,
            )?;
        }
        self.write(
            address,
            "probe vfio-pci",
            &self.bus_path("drivers_probe"),
            &addr,
        )?;
        self.wait_driver(address, "probe vfio-pci", Some(VFIO_PCI_DRIVER))?;
        Ok(original)
    }

    /// The device's `driver_override` now (`None`: unset, shown as "(null)"). Read on a
    /// thread of its own within the step timeout: the kernel shows the file under the
    /// device's lock, so the read waits out any bind, unbind or probe of the device, and
    /// one that hangs must not hold the caller (the writer) with it.
    pub fn driver_override(&self, address: PciAddress) -> Result<Option<String>, HardwareError> {
        let path = self.device_dir(address).join("driver_override");
        let v = self.read_within(address, "read driver_override", &path)?;
        Ok(v.as_deref()
            .and_then(crate::sysfs::attr::parse_driver_override))
    }

    /// Gives `address` back to `original` (or leaves it unbound for `None`): unbinds
    /// vfio-pci, then names the original driver in `driver_override` and probes, which
    /// works even for a VF whose PF has `sriov_drivers_autoprobe` off (the kernel probes
    /// a VF only with autoprobe on or an override set); then puts the override back as
    /// it was (`original_override`, or cleared). An original of vfio-pci itself means
    /// the device was on vfio-pci before hostdevd touched it: only the override is put
    /// back. An original driver that is not loaded is reported before anything is
    /// written, so the device stays on vfio-pci.
    pub fn restore_driver(
        &self,
        address: PciAddress,
        original: Option<&str>,
        original_override: Option<&str>,
    ) -> Result<(), HardwareError> {
        let dir = self.device_dir(address);
        let addr = address.to_string();
        let override_path = dir.join("driver_override");
        // An empty line clears the override (the kernel then shows "(null)").
        let put_back = original_override.unwrap_or("\n");
        if original == Some(VFIO_PCI_DRIVER) {
            return self.write(address, "restore driver_override", &override_path, put_back);
        }
        let now = self.driver(address, "read current driver")?;
        // The original driver must be there before anything is written: found missing
        // after the unbind, it would leave the device on no driver with the override
        // still naming vfio-pci.
        if let Some(orig) = original.filter(|o| now.as_deref() != Some(*o)) {
            self.require_driver(address, orig)?;
        }
        if now.is_some() && now.as_deref() != original {
            self.write(
                address,
                "unbind vfio-pci",
                &dir.join("driver/unbind"),
                &addr,
            )?;
            self.wait_driver(address, "unbind vfio-pci", None)?;
        }
        match original {
            Some(orig) if now.as_deref() != Some(orig) => {
                self.write(
                    address,
                    "name the original driver in driver_override",
                    &override_path,
                    orig,
                )?;
                self.write(
                    address,
                    "probe original driver",
                    &self.bus_path("drivers_probe"),
                    &addr,
                )?;
                self.wait_driver(address, "probe original driver", Some(orig))?;
            }
            _ => {}
        }
        self.write(address, "restore driver_override", &override_path, put_back)?;
        if original.is_none() {
            self.wait_driver(address, "leave unbound", None)?;
        }
        Ok(())
    }
}

impl Hardware {
    /// Checks that `driver` is loaded (its directory under `bus/pci/drivers`) before a
    /// step that would leave `address` waiting on it.
    pub fn require_driver(&self, address: PciAddress, driver: &str) -> Result<(), HardwareError> {
        let path = self.bus_path(&format!("drivers/{driver}"));
        if path.is_dir() {
            return Ok(());
        }
        Err(HardwareError::DriverMissing {
            address,
            driver: driver.to_string(),
            path,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::simhost::{addr, FakeSys};

    const VF: &str = "0000:3b:02.0";

    #[test]
    fn a_missing_original_driver_is_refused_before_any_write() {
        let mut f = FakeSys::new();
        f.device(VF, 0x8086, 0x10ed)
            .driver(VF, VFIO_PCI_DRIVER)
            .driver_override(VF, VFIO_PCI_DRIVER);
        let tree = f.build();
        let hw = Hardware {
            sysfs_root: tree.sysfs_root().to_path_buf(),
            step_timeout: Duration::from_secs(5),
            vf_count_timeout: Duration::from_secs(5),
        };
        let err = hw
            .restore_driver(addr(VF), Some("ixgbevf"), None)
            .expect_err("ixgbevf is not loaded");
        assert!(
            matches!(&err, HardwareError::DriverMissing { driver, .. } if driver == "ixgbevf"),
            "{err}"
        );
        let unbind = tree
            .sysfs_root()
            .join("bus/pci/drivers")
            .join(VFIO_PCI_DRIVER)
            .join("unbind");
        assert_eq!(
            std::fs::read_to_string(unbind).expect("unbind"),
            "",
            "vfio-pci was not unbound"
        );
        assert_eq!(
            hw.driver_override(addr(VF)).expect("override").as_deref(),
            Some(VFIO_PCI_DRIVER),
            "the override is unchanged"
        );
        assert_eq!(
            hw.driver(addr(VF), "check").expect("driver").as_deref(),
            Some(VFIO_PCI_DRIVER)
        );
    }

    /// A device removed in the middle of a binding has no `driver` link, as an unbound
    /// one has: it is reported gone, never taken for unbound (which would record "no
    /// driver" as the one to give back, or end a wait for an unbind).
    #[test]
    fn a_removed_device_is_not_taken_for_an_unbound_one() {
        let mut f = FakeSys::new();
        f.device(VF, 0x8086, 0x10ed);
        let tree = f.build();
        let hw = Hardware {
            sysfs_root: tree.sysfs_root().to_path_buf(),
            step_timeout: Duration::from_secs(5),
            vf_count_timeout: Duration::from_secs(5),
        };
        assert_eq!(hw.driver(addr(VF), "check").expect("unbound"), None);
        let dir = std::fs::canonicalize(hw.device_dir(addr(VF))).expect("directory");
        std::fs::remove_dir_all(dir).expect("remove, the bus link left dangling");
        let err = hw.driver(addr(VF), "check").expect_err("gone");
        assert!(err.to_string().contains("the device is gone"), "{err}");
        let err = hw.bind_vfio(addr(VF)).expect_err("nothing to bind");
        assert!(err.to_string().contains("the device is gone"), "{err}");
    }
}
