//! Conversions between protobuf messages and the ledger's types. Parsing untrusted fields
//! happens here, once, into validated newtypes; a bad field is an `ApiError` naming it.

use std::str::FromStr;

use crate::api::proto;
use crate::api::status::ApiError;
use crate::ledger::{
    Blocker, DeviceState, DeviceView, DomainRef, Owner, Relation, Selector, Stray,
};
use crate::pci::{ConsumerId, DeviceId, OwnerLabel, PciAddress, PhysNet, RequestId, VendorId};
use crate::sysfs::PciDevice;

pub fn address(field: &'static str, s: &str) -> Result<PciAddress, ApiError> {
    PciAddress::from_str(s).map_err(ApiError::bad_id(field))
}

pub fn consumer(field: &'static str, s: &str) -> Result<ConsumerId, ApiError> {
    ConsumerId::from_str(s).map_err(ApiError::bad_id(field))
}

pub fn request_id(s: &str) -> Result<RequestId, ApiError> {
    RequestId::from_str(s).map_err(ApiError::bad_id("request_id"))
}

/// An acting Reconcile's request id: short enough that each orphan's free can be logged
/// under the id with the device's address added ([`RequestId::per_device`]).
pub fn audit_request_id(s: &str) -> Result<RequestId, ApiError> {
    let id = request_id(s)?;
    let max = RequestId::MAX_LEN - RequestId::PER_DEVICE_SUFFIX;
    if id.as_str().len() > max {
        return Err(ApiError::BadField {
            field: "request_id",
            reason: format!(
                "{} bytes is longer than the limit of {max} for an acting audit (each orphan's free is logged as \"<request_id>@<address>\")",
                id.as_str().len()
            ),
        });
    }
    Ok(id)
}

pub fn owner(field: &'static str, o: Option<&proto::Owner>) -> Result<Owner, ApiError> {
    let o = o.ok_or(ApiError::BadField {
        field,
        reason: "an owner with a consumer_id is required".into(),
    })?;
    Ok(Owner {
        consumer: consumer("owner.consumer_id", &o.consumer_id)?,
        label: OwnerLabel::from_str(&o.label).map_err(ApiError::bad_id("owner.label"))?,
    })
}

fn opt<T: FromStr<Err = crate::pci::IdError>>(
    field: &'static str,
    s: &str,
) -> Result<Option<T>, ApiError> {
    if s.is_empty() {
        Ok(None)
    } else {
        T::from_str(s).map(Some).map_err(ApiError::bad_id(field))
    }
}

pub fn selector(s: &proto::Selector) -> Result<Selector, ApiError> {
    if s.driver.len() > 64 || s.driver.chars().any(|c| c.is_control()) {
        return Err(ApiError::BadField {
            field: "selector.driver",
            reason: "a driver name is at most 64 printable bytes".into(),
        });
    }
    Ok(Selector {
        vendor_id: opt::<VendorId>("selector.vendor_id", &s.vendor_id)?,
        device_id: opt::<DeviceId>("selector.device_id", &s.device_id)?,
        pf: opt::<PciAddress>("selector.pf_address", &s.pf_address)?,
        physnet: opt::<PhysNet>("selector.physnet", &s.physnet)?,
        numa_node: s.numa_node,
        driver: (!s.driver.is_empty()).then(|| s.driver.clone()),
    })
}

pub fn owner_to_proto(o: &Owner) -> proto::Owner {
    proto::Owner {
        consumer_id: o.consumer.to_string(),
        label: o.label.to_string(),
    }
}

pub fn domain_to_proto(d: &DomainRef) -> proto::Domain {
    proto::Domain {
        uuid: d.uuid.to_string(),
        name: d.name.clone(),
        running: d.running,
    }
}

fn state_to_proto(s: &DeviceState) -> proto::DeviceState {
    match s {
        DeviceState::Free => proto::DeviceState::Free,
        DeviceState::Claimed => proto::DeviceState::Claimed,
        DeviceState::Attached => proto::DeviceState::Attached,
        DeviceState::Lost => proto::DeviceState::Lost,
        DeviceState::Unavailable { .. } => proto::DeviceState::Unavailable,
        DeviceState::Unmanaged => proto::DeviceState::Unmanaged,
    }
}

fn blocker_to_proto(b: &Blocker) -> proto::Blocker {
    match b {
        Blocker::Related { address, relation } => proto::Blocker {
            address: address.to_string(),
            relation: match relation {
                Relation::PhysicalFunction => "physical_function",
                Relation::VirtualFunction => "virtual_function",
                Relation::IommuGroup => "iommu_group",
            }
            .into(),
            domain: None,
        },
        Blocker::Domain(d) => proto::Blocker {
            address: String::new(),
            relation: "domain".into(),
            domain: Some(domain_to_proto(d)),
        },
        Blocker::VfInUse { vf, domain } => proto::Blocker {
            address: vf.to_string(),
            relation: "virtual_function_in_use".into(),
            domain: Some(domain_to_proto(domain)),
        },
    }
}

/// A device view as a message, enriched with inventory details when the device is present.
pub fn device_to_proto(v: &DeviceView, inv: Option<&PciDevice>) -> proto::Device {
    let r = &v.record;
    let f = &r.facts;
    let inv = inv.filter(|_| r.present);
    proto::Device {
        address: r.address().to_string(),
        generation: r.generation.0,
        state: state_to_proto(&v.state) as i32,
        present: r.present,
        vendor_id: f.vendor_id.to_string(),
        device_id: f.device_id.to_string(),
        vendor_name: inv
            .and_then(|d| d.vendor_name.as_deref())
            .unwrap_or_default()
            .to_string(),
        device_name: inv
            .and_then(|d| d.device_name.as_deref())
            .unwrap_or_default()
            .to_string(),
        driver: f.driver.as_deref().unwrap_or_default().to_string(),
        iommu_group: f.iommu_group,
        numa_node: f.numa_node,
        physfn: f.physfn.map(|a| a.to_string()).unwrap_or_default(),
        vf_index: inv.and_then(|d| d.vf_index),
        sriov: inv.and_then(|d| d.sriov.as_ref()).map(|s| proto::Sriov {
            total_vfs: s.total_vfs,
            num_vfs: s.num_vfs,
            vfs: s.vfs.iter().map(|a| a.to_string()).collect(),
        }),
        netdevs: inv.map(|d| d.netdevs.clone()).unwrap_or_default(),
        physnets: f.physnets.iter().map(|p| p.to_string()).collect(),
        managed: f.managed,
        owner: r.claim.as_ref().map(|c| owner_to_proto(&c.owner)),
        request_id: r
            .claim
            .as_ref()
            .map(|c| c.request_id.to_string())
            .unwrap_or_default(),
        claimed_at_unix: r.claim.as_ref().map(|c| c.claimed_at).unwrap_or(0),
        attached_domain: r.attached.as_ref().map(domain_to_proto),
        blocker: match &v.state {
            DeviceState::Unavailable { blocker } => Some(blocker_to_proto(blocker)),
            _ => None,
        },
        vfio_group: inv
            .filter(|d| d.driver.as_deref() == Some("vfio-pci"))
            .and_then(|d| d.vfio_group.as_ref())
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        vfio_device: inv
            .filter(|d| d.driver.as_deref() == Some("vfio-pci"))
            .and_then(|d| d.vfio_device.as_ref())
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        vfio_binding: r
            .claim
            .as_ref()
            .and_then(|c| c.vfio.as_ref())
            .map(|b| b.members.iter().map(bound_member_to_proto).collect())
            .unwrap_or_default(),
    }
}

pub fn bound_member_to_proto(m: &crate::ledger::BoundMember) -> proto::BoundMember {
    proto::BoundMember {
        address: m.address.to_string(),
        original_driver: m.original_driver.clone().unwrap_or_default(),
    }
}

pub fn stray_to_proto(s: &Stray) -> proto::Stray {
    proto::Stray {
        address: s.address.to_string(),
        domain: Some(domain_to_proto(&s.domain)),
        claimed_by: s.claimed_by.as_ref().map(owner_to_proto),
        known_device: s.known_device,
    }
}
