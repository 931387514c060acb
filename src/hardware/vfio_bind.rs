//! Binding a device to vfio-pci (`driver_override`, unbind, `drivers_probe`) and giving
//! it back to its original driver, one named step at a time.

use crate::pci::PciAddress;

use super::{Hardware, HardwareError, VFIO_PCI_DRIVER};

impl Hardware {
    /// Binds `address` to vfio-pci and returns the driver it had before (`None`:
    /// unbound). Already on vfio-pci: nothing is written and the answer is vfio-pci.
    ///
    /// Steps: check vfio-pci is loaded; write "vfio-pci" to `driver_override` (so no
    /// other driver can take the device in between); unbind from the current driver;
    /// write the address to `bus/pci/drivers_probe`; wait until the `driver` link names
    /// vfio-pci.
    pub fn bind_vfio(&self, address: PciAddress) -> Result<Option<String>, HardwareError> {
        let original = self.driver(address, "read current driver")?;
        if original.as_deref() == Some(VFIO_PCI_DRIVER) {
            return Ok(original);
        }
        let drv = self.bus_path(&format!("drivers/{VFIO_PCI_DRIVER}"));
        if !drv.is_dir() {
            return Err(HardwareError::DriverMissing {
                address,
                driver: VFIO_PCI_DRIVER.into(),
                path: drv,
            });
        }
        let dir = self.device_dir(address);
        let addr = address.to_string();
        self.write(
            address,
            "set driver_override",
            &dir.join("driver_override"),
            VFIO_PCI_DRIVER,
        )?;
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

    /// Gives `address` back to `original` (or leaves it unbound for `None`): clears
    /// `driver_override`, unbinds from vfio-pci, then binds the original driver through
    /// its `bind` file, and waits until the `driver` link names it. An original of
    /// vfio-pci itself means the device was on vfio-pci before hostdevd touched it:
    /// only the override is cleared.
    pub fn restore_driver(
        &self,
        address: PciAddress,
        original: Option<&str>,
    ) -> Result<(), HardwareError> {
        let dir = self.device_dir(address);
        let addr = address.to_string();
        // An empty line clears the override (the kernel then shows "(null)").
        self.write(
            address,
            "clear driver_override",
            &dir.join("driver_override"),
            "\n",
        )?;
        if original == Some(VFIO_PCI_DRIVER) {
            return Ok(());
        }
        let now = self.driver(address, "read current driver")?;
        if now.is_some() && now.as_deref() != original {
            self.write(
                address,
                "unbind vfio-pci",
                &dir.join("driver/unbind"),
                &addr,
            )?;
            self.wait_driver(address, "unbind vfio-pci", None)?;
        }
        if let Some(orig) = original {
            if now.as_deref() != Some(orig) {
                let bind = self.bus_path(&format!("drivers/{orig}/bind"));
                if !bind.exists() {
                    return Err(HardwareError::DriverMissing {
                        address,
                        driver: orig.to_string(),
                        path: bind,
                    });
                }
                self.write(address, "bind original driver", &bind, &addr)?;
            }
        }
        self.wait_driver(address, "bind original driver", original)
    }
}
