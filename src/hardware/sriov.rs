//! Setting a PF's VF count through `sriov_numvfs` (0 first when changing between two
//! non-zero counts, as the kernel requires), optionally with `sriov_drivers_autoprobe`.
//! Each `sriov_numvfs` write waits at most the VF count timeout: the kernel makes or
//! removes every VF within that one write (tens of seconds on some NICs).

use std::sync::Arc;

use crate::pci::PciAddress;

use super::{Hardware, HardwareError};

/// What a VF count change wrote before it ended, or failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// Nothing: refused before any write, or nothing to write.
    Nothing,
    /// `sriov_drivers_autoprobe` only; the PF's VFs are as they were.
    Autoprobe,
    /// A `sriov_numvfs` write went through or timed out (and may still finish): the VFs
    /// the PF had may be gone.
    Vfs,
}

impl Hardware {
    /// Reads one numeric SR-IOV attribute of a PF.
    fn sriov_attr(
        &self,
        pf: PciAddress,
        name: &str,
        step: &'static str,
    ) -> Result<u32, HardwareError> {
        let path = self.device_dir(pf).join(name);
        match self.read_within(pf, step, &path)? {
            Some(v) => {
                crate::sysfs::attr::parse_u32(&path, v.trim()).map_err(|e| HardwareError::Read {
                    address: pf,
                    step,
                    path: path.clone(),
                    detail: e.full_message(),
                })
            }
            // No such file: not a PF, unless the device itself is gone.
            None => self
                .still_there(pf, step)
                .and(Err(HardwareError::NotPhysicalFunction { address: pf })),
        }
    }

    /// The most VFs a PF supports (`sriov_totalvfs`).
    pub fn total_vfs(&self, pf: PciAddress) -> Result<u32, HardwareError> {
        self.sriov_attr(pf, "sriov_totalvfs", "read sriov_totalvfs")
    }

    /// Checks that `pf` can take `count` VFs (reads only, so an error here changed
    /// nothing): the VF count it has now.
    pub fn vf_count_now(&self, pf: PciAddress, count: u32) -> Result<u32, HardwareError> {
        let total = self.total_vfs(pf)?;
        if count > total {
            return Err(HardwareError::TooManyVfs {
                address: pf,
                requested: count,
                total,
            });
        }
        self.sriov_attr(pf, "sriov_numvfs", "read sriov_numvfs")
    }

    /// Sets the VF count of `pf` from `before` (as [`Self::vf_count_now`] read it) to
    /// `count`; `autoprobe`, when given, is written to `sriov_drivers_autoprobe` first
    /// (false: new VFs stay unbound until bound on purpose). Any error may come after a
    /// write, so the PF may have changed; the second value says what was written. The
    /// VFs the PF had may be gone ([`Written::Vfs`]) once a `sriov_numvfs` write went
    /// through or timed out (and may still finish), not when the count stays, nor when
    /// the kernel refused the first one outright. Each `sriov_numvfs` write holds a
    /// clone of `hold` until the kernel answers it, even past its timeout.
    pub fn write_num_vfs(
        &self,
        pf: PciAddress,
        before: u32,
        count: u32,
        autoprobe: Option<bool>,
        hold: &Arc<()>,
    ) -> (Result<(), HardwareError>, Written) {
        let dir = self.device_dir(pf);
        let mut written = Written::Nothing;
        if let Some(on) = autoprobe {
            let path = dir.join("sriov_drivers_autoprobe");
            let value = if on { "1" } else { "0" };
            if let Err(e) = self.write(pf, "set sriov_drivers_autoprobe", &path, value) {
                return (Err(e), written);
            }
            written = Written::Autoprobe;
        }
        if before == count {
            return (Ok(()), written);
        }
        let numvfs = dir.join("sriov_numvfs");
        let write_numvfs = |step, value: &str| {
            let (timeout, hold) = (self.vf_count_timeout, hold.clone());
            self.write_within(pf, step, &numvfs, value, timeout, hold)
        };
        let zero_first = before != 0 && count != 0;
        let first = if zero_first {
            write_numvfs("disable VFs (write 0)", "0")
        } else {
            write_numvfs("write sriov_numvfs", &count.to_string())
        };
        match first {
            Ok(()) => {}
            Err(e @ HardwareError::Write { .. }) => return (Err(e), written),
            Err(e) => return (Err(e), Written::Vfs),
        }
        let rest = (|| {
            if zero_first {
                write_numvfs("write sriov_numvfs", &count.to_string())?;
            }
            let after = self.sriov_attr(pf, "sriov_numvfs", "verify sriov_numvfs")?;
            if after != count {
                return Err(HardwareError::VfCount {
                    address: pf,
                    step: "verify sriov_numvfs",
                    expected: count,
                    found: after,
                });
            }
            Ok(())
        })();
        (rest, Written::Vfs)
    }
}
