//! The ledger's data model: device records, claims, owners, domains and the change sets
//! that the store persists. Plain data with serde, no behaviour beyond derived views.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use std::sync::Arc;

use crate::pci::{
    ConsumerId, DeviceId, Generation, OwnerLabel, PciAddress, PhysNet, RequestId, VendorId,
};

/// Identifies one device *instance*: the same address seen again after it vanished is a
/// new instance with a new id. The id is the host generation at which the instance first
/// appeared, so it is unique and never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RecordId(pub u64);

/// Who holds a claim: a consumer (instance or migration UUID) and a free-text label.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub consumer: ConsumerId,
    pub label: OwnerLabel,
}

/// A claim on a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    pub owner: Owner,
    /// The client request id that made (or last transferred) the claim.
    pub request_id: RequestId,
    /// Seconds since the Unix epoch when the claim was made.
    pub claimed_at: u64,
    /// The generation the claim was made at, kept when it is transferred: a binding
    /// logged before it belonged to an earlier claim of the record, released since.
    /// Absent in records stored before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Generation>,
    /// Set once the claim's IOMMU group was bound to vfio-pci by the agent: what to give
    /// back on release. Recorded before the first sysfs write, so a crash mid-bind still
    /// knows each member's original driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vfio: Option<VfioBinding>,
}

/// The members of a claimed device's IOMMU group that the agent moved to vfio-pci, each
/// with the driver it had before (`None`: it was unbound).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VfioBinding {
    pub members: Vec<BoundMember>,
}

/// One device the agent bound to vfio-pci.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoundMember {
    pub address: PciAddress,
    pub original_driver: Option<String>,
    /// Its `driver_override` before (put back on release): with
    /// `sriov_drivers_autoprobe` off, an override is how a VF got its driver at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_override: Option<String>,
    /// Which device it was when bound (none in bindings recorded before this was kept):
    /// a release gives the driver back only to that device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<MemberIdentity>,
}

/// Which device a bound member was: its record, its ids and its instance then.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberIdentity {
    pub record: RecordId,
    pub vendor_id: VendorId,
    pub device_id: DeviceId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<Instance>,
}

impl MemberIdentity {
    /// The identity of the device `rec` holds now.
    pub fn of(rec: &DeviceRecord) -> MemberIdentity {
        MemberIdentity {
            record: rec.id,
            vendor_id: rec.facts.vendor_id,
            device_id: rec.facts.device_id,
            instance: rec.facts.instance,
        }
    }

    /// Why `rec`, the present record at the member's address, is another device than
    /// the one bound, if it is: another record (the ledger saw it replaced), other ids,
    /// or another instance read in the same boot.
    pub fn other_device(&self, rec: &DeviceRecord) -> Option<&'static str> {
        if rec.id != self.record {
            Some("another device record is at its address")
        } else if (rec.facts.vendor_id, rec.facts.device_id) != (self.vendor_id, self.device_id) {
            Some("its vendor and device ids changed")
        } else if matches!((&self.instance, &rec.facts.instance), (Some(a), Some(b)) if a.replaced_by(b))
        {
            Some("it was replaced (another sysfs instance)")
        } else {
            None
        }
    }
}

/// A libvirt domain as the ledger sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DomainRef {
    pub uuid: uuid::Uuid,
    pub name: String,
    pub running: bool,
}

/// A domain and the PCI addresses it references (`<hostdev>` and
/// `<interface type='hostdev'>` sources).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainDevices {
    pub domain: DomainRef,
    pub addresses: Vec<PciAddress>,
}

/// What the inventory says about a device, as far as ownership rules need it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceFacts {
    pub address: PciAddress,
    pub vendor_id: VendorId,
    pub device_id: DeviceId,
    pub driver: Option<Arc<str>>,
    pub iommu_group: Option<u32>,
    pub numa_node: Option<u32>,
    /// The PF of a VF.
    pub physfn: Option<PciAddress>,
    /// True for a PF with SR-IOV capability.
    pub is_pf: bool,
    /// Physical network tags given to this device by the managed-device selection.
    pub physnets: Vec<PhysNet>,
    /// Whether the managed-device selection includes this device. Unmanaged devices are
    /// listed but cannot be claimed; a claimed device that leaves the selection keeps its
    /// claim.
    pub managed: bool,
    /// Which instance of a device at this address the scan found; `None` where unknown
    /// (the boot could not be told, or a record from a build that did not record it).
    /// Two of the same boot that differ mean another device at the same address (I6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<Instance>,
}

/// One instance of a device: its sysfs directory's inode number (see
/// [`crate::sysfs::PciDevice::instance`]) and the boot it was read in, since the numbers
/// start again at every boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// The boot's id (`/proc/sys/kernel/random/boot_id`), folded to 64 bits.
    pub boot: u64,
    pub ino: u64,
}

impl Instance {
    /// Whether `other` is known to be another device than this one: read in the same
    /// boot, with another number. Of two boots nothing can be told.
    pub fn replaced_by(&self, other: &Instance) -> bool {
        self.boot == other.boot && self.ino != other.ino
    }
}

/// One device instance in the ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    pub id: RecordId,
    pub facts: DeviceFacts,
    /// The host generation of this record's last change.
    pub generation: Generation,
    /// False once the device has vanished from sysfs (a lost claim).
    pub present: bool,
    pub claim: Option<Claim>,
    /// The domain that makes this claim attached (references the device, or is the owner).
    pub attached: Option<DomainRef>,
}

impl DeviceRecord {
    pub fn address(&self) -> PciAddress {
        self.facts.address
    }

    /// The devices its claim bound to vfio-pci, which a free gives their drivers back.
    pub fn bound_members(&self) -> impl Iterator<Item = PciAddress> + '_ {
        self.claim
            .iter()
            .filter_map(|c| c.vfio.as_ref())
            .flat_map(|b| b.members.iter().map(|m| m.address))
    }
}

/// The externally visible state of a device, derived from its record and its relatives.
/// Blocking (`Unavailable`) is always derived, never stored, so it cannot drift.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum DeviceState {
    Free,
    Claimed,
    Attached,
    /// Claimed but gone from sysfs.
    Lost,
    /// Free itself, but blocked: by a related claim (its PF, one of its VFs, another
    /// member of its IOMMU group) or by a domain that references it without a claim.
    Unavailable {
        blocker: Blocker,
    },
    /// Not in the managed-device selection and unclaimed.
    Unmanaged,
}

impl DeviceState {
    pub fn name(&self) -> &'static str {
        match self {
            DeviceState::Free => "free",
            DeviceState::Claimed => "claimed",
            DeviceState::Attached => "attached",
            DeviceState::Lost => "lost",
            DeviceState::Unavailable { .. } => "unavailable",
            DeviceState::Unmanaged => "unmanaged",
        }
    }
}

/// Why a free device cannot be claimed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Blocker {
    /// A related device's claim.
    Related {
        address: PciAddress,
        relation: Relation,
    },
    /// A libvirt domain references the device but holds no claim for it (a stray).
    Domain(DomainRef),
    /// A libvirt domain uses one of the PF's VFs without a claim: taking the PF from its
    /// driver would destroy that VF under the domain.
    VfInUse { vf: PciAddress, domain: DomainRef },
}

/// How a blocking device is related to the blocked one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Relation {
    /// The blocked device is a VF of the claimed PF.
    PhysicalFunction,
    /// The blocked device is the PF of a claimed VF.
    VirtualFunction,
    /// Both are members of the same IOMMU group.
    IommuGroup,
}

impl std::fmt::Display for Relation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Relation::PhysicalFunction => "its physical function is claimed",
            Relation::VirtualFunction => "one of its virtual functions is claimed",
            Relation::IommuGroup => "another member of its IOMMU group is claimed",
        })
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.label.as_str().is_empty() {
            write!(f, "{}", self.consumer)
        } else {
            write!(f, "{} ({})", self.consumer, self.label)
        }
    }
}

/// What a mutating request did; kept in the request log so a retry with the same owner
/// and request id returns exactly the first answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Claimed {
        address: PciAddress,
        record: RecordId,
        generation: Generation,
    },
    Released {
        address: PciAddress,
        record: RecordId,
        generation: Generation,
    },
    Transferred {
        address: PciAddress,
        record: RecordId,
        generation: Generation,
        to: ConsumerId,
    },
    /// A claim bound to vfio-pci (PrepareVfio with a request id): the claim's record and
    /// the generation the recorded binding gave it.
    Bound {
        address: PciAddress,
        record: RecordId,
        generation: Generation,
    },
    /// A PF's VF count written in full (SetVfCount with a request id): the generation the
    /// change gave the PF, the count written and the count before.
    VfCountSet {
        address: PciAddress,
        generation: Generation,
        count: u32,
        before: u32,
    },
}

impl Outcome {
    pub fn address(&self) -> PciAddress {
        match self {
            Outcome::Claimed { address, .. }
            | Outcome::Released { address, .. }
            | Outcome::Transferred { address, .. }
            | Outcome::Bound { address, .. }
            | Outcome::VfCountSet { address, .. } => *address,
        }
    }
    pub fn generation(&self) -> Generation {
        match self {
            Outcome::Claimed { generation, .. }
            | Outcome::Released { generation, .. }
            | Outcome::Transferred { generation, .. }
            | Outcome::Bound { generation, .. }
            | Outcome::VfCountSet { generation, .. } => *generation,
        }
    }
    /// The operation's name, as GetRequestOutcome and the logs give it.
    pub fn operation(&self) -> &'static str {
        match self {
            Outcome::Claimed { .. } => "claimed",
            Outcome::Released { .. } => "released",
            Outcome::Transferred { .. } => "transferred",
            Outcome::Bound { .. } => "bound",
            Outcome::VfCountSet { .. } => "vf_count_set",
        }
    }
}

/// Key of the request log.
pub type RequestKey = (ConsumerId, RequestId);

/// A logged request: its outcome and when it was made (for pruning).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestEntry {
    pub consumer: ConsumerId,
    pub request_id: RequestId,
    pub outcome: Outcome,
    /// Seconds since the Unix epoch.
    pub at: u64,
}

/// Everything one ledger operation changed: what the store must persist in one
/// transaction, and what the ledger needs to undo the operation if that commit fails.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangeSet {
    /// Host generation before the operation.
    pub prev_host_generation: Generation,
    /// Host generation after the operation (equal to prev when nothing changed).
    pub host_generation: Generation,
    /// Records as they are now, written (inserted or replaced) by id.
    pub upserts: Vec<DeviceRecord>,
    /// Records deleted by id.
    pub removals: Vec<RecordId>,
    /// For each removal: the address, the generation the removal was given, and whether
    /// the record removed was the present device there (false: a lost claim): what
    /// watchers see, since a lost claim and a present device may share an address.
    pub removed: Vec<(PciAddress, Generation, bool)>,
    /// Each touched record as it was before (None: it did not exist). For undo only.
    pub before: Vec<(RecordId, Option<DeviceRecord>)>,
    /// Request-log entries added.
    pub requests: Vec<RequestEntry>,
    /// Entries the ledger dropped from its in-memory window of the request log (the
    /// store keeps them). For undo only.
    pub before_requests: Vec<RequestEntry>,
    /// The domain set before a domain update. For undo only (domains are not stored:
    /// libvirt is asked again at start).
    pub before_domains: Option<Vec<DomainDevices>>,
}

impl ChangeSet {
    pub fn is_empty(&self) -> bool {
        self.upserts.is_empty()
            && self.removals.is_empty()
            && self.requests.is_empty()
            && self.host_generation == self.prev_host_generation
    }
}

/// Everything the store keeps, loaded at start: the ledger is rebuilt from this plus a
/// fresh inventory scan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub host_generation: Generation,
    pub records: BTreeMap<RecordId, DeviceRecord>,
    pub requests: Vec<RequestEntry>,
}
