//! Setting a PF's VF count through `sriov_numvfs` (0 first when changing between two
//! non-zero counts, as the kernel requires), optionally with `sriov_drivers_autoprobe`.

use crate::pci::PciAddress;

use super::{Hardware, HardwareError};

impl Hardware {
    /// Reads one numeric SR-IOV attribute of a PF.
    fn sriov_attr(
        &self,
        pf: PciAddress,
        name: &str,
        step: &'static str,
    ) -> Result<u32, HardwareError> {
        let path = self.device_dir(pf).join(name);
        match crate::sysfs::attr::read_optional_text(&path) {
            Ok(Some(v)) => v.trim().parse::<u32>().map_err(|e| HardwareError::Read {
                address: pf,
                step,
                path,
                detail: format!("{v:?} is not a count: {e}"),
            }),
            Ok(None) => Err(HardwareError::NotPhysicalFunction { address: pf }),
            Err(e) => Err(HardwareError::Read {
                address: pf,
                step,
                path,
                detail: e.full_message(),
            }),
        }
    }

    /// The most VFs a PF supports (`sriov_totalvfs`).
    pub fn total_vfs(&self, pf: PciAddress) -> Result<u32, HardwareError> {
        self.sriov_attr(pf, "sriov_totalvfs", "read sriov_totalvfs")
    }

    /// Sets the VF count of `pf` to `count`; `autoprobe`, when given, is written to
    /// `sriov_drivers_autoprobe` first (false: new VFs stay unbound until bound on
    /// purpose). Returns the count before.
    pub fn set_num_vfs(
        &self,
        pf: PciAddress,
        count: u32,
        autoprobe: Option<bool>,
    ) -> Result<u32, HardwareError> {
        let total = self.total_vfs(pf)?;
        if count > total {
            return Err(HardwareError::TooManyVfs {
                address: pf,
                requested: count,
                total,
            });
        }
        let dir = self.device_dir(pf);
        if let Some(on) = autoprobe {
            self.write(
                pf,
                "set sriov_drivers_autoprobe",
                &dir.join("sriov_drivers_autoprobe"),
                if on { "1" } else { "0" },
            )?;
        }
        let before = self.sriov_attr(pf, "sriov_numvfs", "read sriov_numvfs")?;
        if before == count {
            return Ok(before);
        }
        let numvfs = dir.join("sriov_numvfs");
        if before != 0 && count != 0 {
            self.write(pf, "disable VFs (write 0)", &numvfs, "0")?;
        }
        self.write(pf, "write sriov_numvfs", &numvfs, &count.to_string())?;
        let after = self.sriov_attr(pf, "sriov_numvfs", "verify sriov_numvfs")?;
        if after != count {
            return Err(HardwareError::VfCount {
                address: pf,
                step: "verify sriov_numvfs",
                expected: count,
                found: after,
            });
        }
        Ok(before)
    }
}
