//! Acting on hardware through sysfs: binding devices to vfio-pci and back, and setting a
//! PF's VF count. Each write is one named step with a timeout; a failure names the step,
//! the file, the value and the kernel's error, so the device is left in a stated state.
//!
//! These functions block (sysfs writes can take seconds in the kernel's probe paths).
//! The writer thread calls them, never an async worker thread. Each write runs on a
//! short-lived thread of its own so that a write stuck in the kernel cannot stall the
//! caller past its step timeout; the stuck thread is left to finish on its own.

pub mod sriov;
pub mod vfio_bind;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::pci::PciAddress;

/// The driver name of VFIO's PCI driver.
pub use crate::sysfs::VFIO_PCI_DRIVER;

/// Where hardware actions act: the sysfs root and how long each step may take.
#[derive(Debug, Clone)]
pub struct Hardware {
    pub sysfs_root: PathBuf,
    /// How long one step may take: every write but `sriov_numvfs`, and each wait for a
    /// driver.
    pub step_timeout: Duration,
    /// How long one `sriov_numvfs` write may take (see [`Hardware::write_within`]): the
    /// kernel creates or destroys every VF within it, which takes minutes on some NICs.
    pub vf_count_timeout: Duration,
}

/// Why a hardware step failed. Every variant names the device and the step.
#[derive(Debug, thiserror::Error)]
pub enum HardwareError {
    #[error("{address}: {step}: writing {value:?} to {path} failed: {source}")]
    Write {
        address: PciAddress,
        step: &'static str,
        path: PathBuf,
        value: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{address}: {step}: reading {path} failed: {detail}")]
    Read {
        address: PciAddress,
        step: &'static str,
        path: PathBuf,
        detail: String,
    },
    #[error("{address}: {step}: no answer from the kernel within {after:?} (writing {path}); the device is in whatever state that write leaves it")]
    Timeout {
        address: PciAddress,
        step: &'static str,
        path: PathBuf,
        after: Duration,
    },
    #[error("{address}: {step}: no answer from the kernel {} reading {path} (the kernel holds the device while it changes it: a VF count change or a driver probe still running?)", crate::sysfs::waited(.after, .earlier))]
    ReadTimeout {
        address: PciAddress,
        step: &'static str,
        path: PathBuf,
        after: Duration,
        /// Not started: an earlier read of the path still waits in the kernel.
        earlier: bool,
    },
    #[error("{address}: {step}: expected driver {expected}, found {found}")]
    Driver {
        address: PciAddress,
        step: &'static str,
        expected: String,
        found: String,
    },
    #[error("{address}: the {driver} driver is not loaded (no {path}); load it first (modprobe {driver})")]
    DriverMissing {
        address: PciAddress,
        driver: String,
        path: PathBuf,
    },
    #[error("{address} is not an SR-IOV physical function (no sriov_totalvfs)")]
    NotPhysicalFunction { address: PciAddress },
    #[error("{address} supports at most {total} VFs; {requested} were asked for")]
    TooManyVfs {
        address: PciAddress,
        requested: u32,
        total: u32,
    },
    #[error("{address}: {step}: sriov_numvfs reads {found} after writing {expected}")]
    VfCount {
        address: PciAddress,
        step: &'static str,
        expected: u32,
        found: u32,
    },
    #[error("{address} is in no IOMMU group: it cannot be used through VFIO")]
    NoIommuGroup { address: PciAddress },
    #[error("hardware actions are not available in this agent")]
    Disabled,
    /// The task running a step ended without its answer (it panicked, or the agent is
    /// stopping): whether the step wrote anything is unknown.
    #[error("{address}: {step}: its task ended without an answer ({why}); whether sysfs was written is unknown")]
    Abandoned {
        address: PciAddress,
        step: &'static str,
        why: String,
    },
}

impl HardwareError {
    /// The step that failed, for ErrorInfo metadata and metrics.
    pub fn step(&self) -> &'static str {
        match self {
            HardwareError::Write { step, .. }
            | HardwareError::Read { step, .. }
            | HardwareError::Timeout { step, .. }
            | HardwareError::ReadTimeout { step, .. }
            | HardwareError::Driver { step, .. }
            | HardwareError::VfCount { step, .. }
            | HardwareError::Abandoned { step, .. } => step,
            HardwareError::DriverMissing { .. } => "driver present",
            HardwareError::NotPhysicalFunction { .. } | HardwareError::TooManyVfs { .. } => {
                "check VF count"
            }
            HardwareError::NoIommuGroup { .. } => "check IOMMU group",
            HardwareError::Disabled => "none",
        }
    }

    /// The kernel's errno name for a failed write (EBUSY, EIO, EINVAL, ...), if any.
    pub fn errno(&self) -> Option<String> {
        match self {
            HardwareError::Write { source, .. } => source
                .raw_os_error()
                .map(|n| nix::errno::Errno::from_raw(n).to_string()),
            _ => None,
        }
    }
}

impl Hardware {
    /// `<sysfs_root>/bus/pci/devices/<address>`.
    pub fn device_dir(&self, address: PciAddress) -> PathBuf {
        crate::sysfs::device_dir(&self.sysfs_root, address)
    }

    /// `<sysfs_root>/bus/pci/<rel>`.
    pub fn bus_path(&self, rel: &str) -> PathBuf {
        self.sysfs_root.join("bus/pci").join(rel)
    }

    /// Writes `value` to `path` as one write(2), on a thread of its own, waiting at most
    /// the step timeout.
    pub fn write(
        &self,
        address: PciAddress,
        step: &'static str,
        path: &Path,
        value: &str,
    ) -> Result<(), HardwareError> {
        self.write_within(address, step, path, value, self.step_timeout, ())
    }

    /// Reads an attribute the kernel shows under the device's lock (`sriov_numvfs`),
    /// waiting at most the step timeout: a VF count change still running (one that
    /// outlived its own timeout) holds that lock for as long as it takes, and the caller
    /// (the writer thread) must not wait with it. `Ok(None)`: no such attribute.
    pub fn read_within(
        &self,
        address: PciAddress,
        step: &'static str,
        path: &Path,
    ) -> Result<Option<String>, HardwareError> {
        // At most one read of a path waits in the kernel: a client retrying every second
        // while a PF is held is answered at once, with no thread more. (Reads of one
        // path by the writer and by scans take turns, under the rescanners' turn, so an
        // earlier read still waiting is one that timed out.)
        crate::sysfs::attr::read_optional_text_within(path, self.step_timeout).map_err(
            |e| match e {
                crate::sysfs::SysfsError::NoAnswer { earlier, .. } => HardwareError::ReadTimeout {
                    address,
                    step,
                    path: path.to_path_buf(),
                    after: self.step_timeout,
                    earlier,
                },
                e => HardwareError::Read {
                    address,
                    step,
                    path: path.to_path_buf(),
                    detail: e.full_message(),
                },
            },
        )
    }

    /// [`Self::write`], waiting at most `timeout` (for `sriov_numvfs`, the VF count
    /// timeout). `keep` is dropped when the write returns, not when the wait ends: a
    /// write past its timeout keeps it for as long as the kernel takes (a VF count
    /// change's token, which holds the PF back from claims until then).
    pub fn write_within(
        &self,
        address: PciAddress,
        step: &'static str,
        path: &Path,
        value: &str,
        timeout: Duration,
        keep: impl Send + 'static,
    ) -> Result<(), HardwareError> {
        let (p, v) = (path.to_path_buf(), value.to_string());
        let started = std::time::Instant::now();
        let written = crate::sysfs::attr::on_thread("hostdevd-sysfs-write", timeout, move || {
            // O_TRUNC as a shell's `echo v > attr`: sysfs ignores it; a regular file (a
            // test tree) then holds exactly the value.
            let written = std::fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(&p)
                .and_then(|mut f| f.write_all(v.as_bytes()));
            let took = started.elapsed();
            if took > timeout {
                tracing::warn!(
                    device = %address, step, path = %p.display(), value = %v, ?took,
                    ok = written.is_ok(),
                    "the kernel answered a write after its timeout"
                );
            }
            drop(keep);
            written
        });
        let fail = |source| HardwareError::Write {
            address,
            step,
            path: path.to_path_buf(),
            value: value.to_string(),
            source,
        };
        match written {
            Err(e) => Err(fail(e)),
            Ok(Some(Ok(()))) => {
                tracing::debug!(device = %address, step, path = %path.display(), value, "sysfs write");
                Ok(())
            }
            Ok(Some(Err(e))) => Err(fail(e)),
            Ok(None) => Err(HardwareError::Timeout {
                address,
                step,
                path: path.to_path_buf(),
                after: timeout,
            }),
        }
    }

    /// The driver bound to a device now (`None`: unbound).
    pub fn driver(
        &self,
        address: PciAddress,
        step: &'static str,
    ) -> Result<Option<String>, HardwareError> {
        let dir = self.device_dir(address);
        let link = dir.join("driver");
        let failed = |path, detail| HardwareError::Read {
            address,
            step,
            path,
            detail,
        };
        let driver = crate::sysfs::attr::read_link_name(&link)
            .map_err(|e| failed(link, e.full_message()))?;
        // No link is no driver only while the device is there: a removed device has no
        // link either, and taking it for unbound would record "no driver" as the one to
        // give it back to, or end a wait for the unbind.
        if driver.is_none() {
            self.still_there(address, step)?;
        }
        Ok(driver)
    }

    /// Fails "the device is gone" when the device's directory is not there: a missing
    /// attribute or link is then no answer about the device.
    pub(crate) fn still_there(
        &self,
        address: PciAddress,
        step: &'static str,
    ) -> Result<(), HardwareError> {
        let dir = self.device_dir(address);
        match std::fs::metadata(&dir) {
            Ok(_) => Ok(()),
            Err(e) => Err(HardwareError::Read {
                address,
                step,
                path: dir,
                detail: format!("the device is gone: {e}"),
            }),
        }
    }

    /// Polls until the device's driver is `want`, up to the step timeout (the kernel's
    /// probe normally finishes within the write; this covers asynchronous probing).
    pub fn wait_driver(
        &self,
        address: PciAddress,
        step: &'static str,
        want: Option<&str>,
    ) -> Result<(), HardwareError> {
        let deadline = Instant::now() + self.step_timeout;
        loop {
            let now = self.driver(address, step)?;
            if now.as_deref() == want {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(HardwareError::Driver {
                    address,
                    step,
                    expected: want.unwrap_or("none").to_string(),
                    found: now.unwrap_or_else(|| "none".into()),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A PF's counts are plain decimal numbers, as the scan reads them ("+4" is not
    /// one), and a PF that is gone is gone, not "no PF".
    #[test]
    fn sriov_counts_are_plain_numbers_and_a_gone_pf_is_not_a_non_pf() {
        let pf = "0000:3b:00.0";
        let mut f = crate::simhost::FakeSys::new();
        f.pf(pf, 0x8086, 0x1572, 8, 2);
        let tree = f.build();
        let hw = Hardware {
            sysfs_root: tree.sysfs_root().to_path_buf(),
            step_timeout: Duration::from_secs(5),
            vf_count_timeout: Duration::from_secs(5),
        };
        let a = crate::simhost::addr(pf);
        assert_eq!(hw.total_vfs(a).expect("total"), 8);
        let dir = std::fs::canonicalize(hw.device_dir(a)).expect("directory");
        std::fs::write(dir.join("sriov_totalvfs"), "+8\n").expect("write");
        let err = hw.total_vfs(a).expect_err("not a plain number");
        assert!(err.to_string().contains("+8"), "{err}");
        std::fs::remove_dir_all(&dir).expect("remove the PF, its bus link left");
        let err = hw.total_vfs(a).expect_err("gone");
        assert!(err.to_string().contains("the device is gone"), "{err}");
    }
}
