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
use std::sync::mpsc;
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
}

impl HardwareError {
    /// The step that failed, for ErrorInfo metadata and metrics.
    pub fn step(&self) -> &'static str {
        match self {
            HardwareError::Write { step, .. }
            | HardwareError::Read { step, .. }
            | HardwareError::Timeout { step, .. }
            | HardwareError::Driver { step, .. }
            | HardwareError::VfCount { step, .. } => step,
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
        self.write_within(address, step, path, value, self.step_timeout)
    }

    /// [`Self::write`], waiting at most `timeout` (for `sriov_numvfs`, the VF count
    /// timeout).
    pub fn write_within(
        &self,
        address: PciAddress,
        step: &'static str,
        path: &Path,
        value: &str,
        timeout: Duration,
    ) -> Result<(), HardwareError> {
        let (tx, rx) = mpsc::channel();
        let (p, v) = (path.to_path_buf(), value.to_string());
        let spawned = std::thread::Builder::new()
            .name("hostdevd-sysfs-write".into())
            .spawn(move || {
                // O_TRUNC as a shell's `echo v > attr`: sysfs ignores it; a regular
                // file (a test tree) then holds exactly the value.
                let r = std::fs::OpenOptions::new()
                    .write(true)
                    .truncate(true)
                    .open(&p)
                    .and_then(|mut f| f.write_all(v.as_bytes()));
                let _ = tx.send(r);
            });
        let fail = |source| HardwareError::Write {
            address,
            step,
            path: path.to_path_buf(),
            value: value.to_string(),
            source,
        };
        if let Err(e) = spawned {
            return Err(fail(e));
        }
        match rx.recv_timeout(timeout) {
            Ok(Ok(())) => {
                tracing::debug!(device = %address, step, path = %path.display(), value, "sysfs write");
                Ok(())
            }
            Ok(Err(e)) => Err(fail(e)),
            Err(_) => Err(HardwareError::Timeout {
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
        let link = self.device_dir(address).join("driver");
        crate::sysfs::attr::read_link_name(&link).map_err(|e| HardwareError::Read {
            address,
            step,
            path: link,
            detail: e.full_message(),
        })
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
