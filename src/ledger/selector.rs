//! Device selectors for claim-by-selector: which free devices a request will accept.

use std::fmt;

use crate::ledger::model::DeviceFacts;
use crate::pci::{DeviceId, PciAddress, PhysNet, VendorId};

/// What a claim by selector accepts. Every set field must match, except `numa_node`,
/// which is a preference: a device on that node is chosen when one is free.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    pub vendor_id: Option<VendorId>,
    pub device_id: Option<DeviceId>,
    /// Only VFs of this PF.
    pub pf: Option<PciAddress>,
    pub physnet: Option<PhysNet>,
    pub numa_node: Option<u32>,
    pub driver: Option<String>,
}

impl Selector {
    /// True when the device satisfies every required field (not the NUMA preference).
    pub fn matches(&self, f: &DeviceFacts) -> bool {
        self.vendor_id.is_none_or(|v| v == f.vendor_id)
            && self.device_id.is_none_or(|d| d == f.device_id)
            && self.pf.is_none_or(|pf| f.physfn == Some(pf))
            && self.physnet.as_ref().is_none_or(|p| f.physnets.contains(p))
            && self
                .driver
                .as_ref()
                .is_none_or(|d| f.driver.as_deref() == Some(d.as_str()))
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(v) = self.vendor_id {
            parts.push(format!("vendor {v}"));
        }
        if let Some(d) = self.device_id {
            parts.push(format!("device {d}"));
        }
        if let Some(p) = self.pf {
            parts.push(format!("pf {p}"));
        }
        if let Some(p) = &self.physnet {
            parts.push(format!("physnet {p}"));
        }
        if let Some(d) = &self.driver {
            parts.push(format!("driver {d}"));
        }
        if let Some(n) = self.numa_node {
            parts.push(format!("preferring numa node {n}"));
        }
        if parts.is_empty() {
            f.write_str("any device")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}
