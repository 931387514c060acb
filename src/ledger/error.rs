//! Why the ledger rejected a request. Every variant carries what a client needs to decide
//! without another round trip (the device's current generation and owner).

use crate::ledger::model::{DomainRef, Outcome, Owner, Relation};
use crate::pci::{ConsumerId, Generation, PciAddress, RequestId};

/// A rejected ledger operation. A rejection never changes the ledger.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("unknown device {address}: no such PCI device is known on this host")]
    UnknownDevice { address: PciAddress },

    #[error(
        "stale generation for {address}: presented {presented}, current generation is {current}{}",
        owner_suffix(.owner)
    )]
    StaleGeneration {
        address: PciAddress,
        presented: Generation,
        current: Generation,
        owner: Option<Owner>,
    },

    #[error("{address} is already claimed by {owner}; current generation {generation}")]
    AlreadyClaimed {
        address: PciAddress,
        owner: Owner,
        generation: Generation,
    },

    #[error("{address} is not claimed; current generation {generation}")]
    NotClaimed {
        address: PciAddress,
        generation: Generation,
    },

    #[error(
        "{address} is claimed by {owner}, not by {presented}; current generation {generation}"
    )]
    WrongOwner {
        address: PciAddress,
        presented: ConsumerId,
        owner: Owner,
        generation: Generation,
    },

    #[error(
        "{address} is attached to domain {} ({}, uuid {}); current generation {generation}",
        .domain.name, if .domain.running { "running" } else { "defined" }, .domain.uuid
    )]
    Attached {
        address: PciAddress,
        domain: DomainRef,
        generation: Generation,
    },

    #[error(
        "{address} is blocked by the claim on {by}: {relation}; current generation {generation}"
    )]
    Blocked {
        address: PciAddress,
        by: PciAddress,
        relation: Relation,
        owner: Option<Owner>,
        generation: Generation,
    },

    #[error(
        "{address} is used by domain {} (uuid {}), which holds no claim on it; current generation {generation}",
        .domain.name, .domain.uuid
    )]
    InUseByDomain {
        address: PciAddress,
        domain: DomainRef,
        generation: Generation,
    },

    #[error("{address} is not in the managed device selection; current generation {generation}")]
    Unmanaged {
        address: PciAddress,
        generation: Generation,
    },

    #[error("{address} is lost (gone from sysfs); only its owner may release the claim")]
    Lost {
        address: PciAddress,
        owner: Owner,
        generation: Generation,
    },

    #[error("no free managed device matches {selector}")]
    NoMatch { selector: String },

    #[error("{address} is not an SR-IOV physical function; current generation {generation}")]
    NotPhysicalFunction {
        address: PciAddress,
        generation: Generation,
    },

    #[error("{pf} has a claimed VF, {vf} (owned by {owner}): its VF count cannot change; current generation {generation}")]
    VfClaimed {
        pf: PciAddress,
        vf: PciAddress,
        owner: Owner,
        generation: Generation,
    },

    #[error(
        "{address} cannot be bound to vfio-pci: the binding takes {member}, in its IOMMU group, along, and {used} is used by domain {} (uuid {}); nothing was changed; current generation {generation}",
        .domain.name, .domain.uuid
    )]
    GroupMemberInUse {
        address: PciAddress,
        /// The member of the device's IOMMU group the binding would move.
        member: PciAddress,
        /// What the domain references: the member, or a VF of it (moving a PF from its
        /// driver destroys its VFs).
        used: PciAddress,
        domain: DomainRef,
        generation: Generation,
    },

    #[error(
        "{address} cannot be released now: the release gives {member} its driver back (the claim's VFIO binding moved it to vfio-pci), and {used} is used by domain {} (uuid {}), which holds no claim on it{}; nothing was changed; detach it from the domain first; current generation {generation}",
        .domain.name, .domain.uuid,
        if .member != .used { ", and taking a PF from vfio-pci destroys its VFs" } else { "" }
    )]
    BindingMemberInUse {
        address: PciAddress,
        /// The member of the binding whose driver the release gives back.
        member: PciAddress,
        /// What the domain references: the member, or a VF of it.
        used: PciAddress,
        domain: DomainRef,
        generation: Generation,
    },

    #[error("{pf}'s VF count cannot change: its VF {vf} shares an IOMMU group with {claimed}, claimed by {owner}, whose VFIO binding takes the whole group; current generation {generation}")]
    VfGroupClaimed {
        pf: PciAddress,
        vf: PciAddress,
        claimed: PciAddress,
        owner: Owner,
        generation: Generation,
    },

    #[error("{address} cannot be claimed or bound now: the VF count of {pf} is being written, which destroys its VFs; nothing was changed, try again once the kernel has answered that write (a write past its timeout holds them until it does; a VF comes back as a new device, with a new generation); current generation {generation}")]
    VfCountChanging {
        address: PciAddress,
        pf: PciAddress,
        generation: Generation,
    },

    #[error(
        "{pf}'s VF count cannot change: {device} is used by domain {} (uuid {}), which holds no claim on it; current generation {generation}",
        .domain.name, .domain.uuid
    )]
    VfCountInUse {
        pf: PciAddress,
        /// The PF itself or one of its VFs.
        device: PciAddress,
        domain: DomainRef,
        generation: Generation,
    },

    /// A PF claimed while a domain uses one of its VFs without a claim: a PF claim is
    /// made to pass the PF through or bind it to vfio-pci, and unbinding its driver
    /// destroys every VF, under the VM using one.
    #[error(
        "{pf} cannot be claimed: its VF {vf} is used by domain {} (uuid {}), which holds no claim on it, and taking the PF from its driver destroys its VFs; current generation {generation}",
        .domain.name, .domain.uuid
    )]
    VfInUseByDomain {
        pf: PciAddress,
        vf: PciAddress,
        domain: DomainRef,
        generation: Generation,
    },

    #[error("{address} is in no IOMMU group, so it cannot be bound to vfio-pci; current generation {generation}")]
    NoIommuGroup {
        address: PciAddress,
        generation: Generation,
    },

    #[error(
        "request id {request_id} was already used by {consumer} for another operation ({previous:?})"
    )]
    RequestIdReused {
        consumer: ConsumerId,
        request_id: RequestId,
        previous: Outcome,
    },
}

fn owner_suffix(owner: &Option<Owner>) -> String {
    match owner {
        Some(o) => format!("; claimed by {o}"),
        None => "; not claimed".to_string(),
    }
}

impl LedgerError {
    /// The device the rejection is about, when there is one.
    pub fn address(&self) -> Option<PciAddress> {
        use LedgerError::*;
        match self {
            UnknownDevice { address }
            | StaleGeneration { address, .. }
            | AlreadyClaimed { address, .. }
            | NotClaimed { address, .. }
            | WrongOwner { address, .. }
            | Attached { address, .. }
            | Blocked { address, .. }
            | InUseByDomain { address, .. }
            | Unmanaged { address, .. }
            | Lost { address, .. }
            | NotPhysicalFunction { address, .. }
            | VfCountChanging { address, .. }
            | GroupMemberInUse { address, .. }
            | BindingMemberInUse { address, .. }
            | NoIommuGroup { address, .. } => Some(*address),
            VfClaimed { pf, .. }
            | VfGroupClaimed { pf, .. }
            | VfCountInUse { pf, .. }
            | VfInUseByDomain { pf, .. } => Some(*pf),
            NoMatch { .. } => None,
            RequestIdReused { previous, .. } => Some(previous.address()),
        }
    }

    /// The device's current generation, when the rejection is about one device.
    pub fn current_generation(&self) -> Option<Generation> {
        use LedgerError::*;
        match self {
            StaleGeneration { current, .. } => Some(*current),
            AlreadyClaimed { generation, .. }
            | NotClaimed { generation, .. }
            | WrongOwner { generation, .. }
            | Attached { generation, .. }
            | Blocked { generation, .. }
            | InUseByDomain { generation, .. }
            | Unmanaged { generation, .. }
            | Lost { generation, .. }
            | NotPhysicalFunction { generation, .. }
            | VfClaimed { generation, .. }
            | VfCountChanging { generation, .. }
            | GroupMemberInUse { generation, .. }
            | BindingMemberInUse { generation, .. }
            | VfGroupClaimed { generation, .. }
            | VfCountInUse { generation, .. }
            | VfInUseByDomain { generation, .. }
            | NoIommuGroup { generation, .. } => Some(*generation),
            UnknownDevice { .. } | NoMatch { .. } | RequestIdReused { .. } => None,
        }
    }

    /// The device's current owner, when it has one.
    pub fn current_owner(&self) -> Option<&Owner> {
        use LedgerError::*;
        match self {
            StaleGeneration { owner, .. } | Blocked { owner, .. } => owner.as_ref(),
            AlreadyClaimed { owner, .. }
            | WrongOwner { owner, .. }
            | Lost { owner, .. }
            | VfClaimed { owner, .. }
            | VfGroupClaimed { owner, .. } => Some(owner),
            _ => None,
        }
    }

    /// A short machine-readable reason (used in gRPC ErrorInfo and metrics labels).
    pub fn reason(&self) -> &'static str {
        use LedgerError::*;
        match self {
            UnknownDevice { .. } => "UNKNOWN_DEVICE",
            StaleGeneration { .. } => "STALE_GENERATION",
            AlreadyClaimed { .. } => "ALREADY_CLAIMED",
            NotClaimed { .. } => "NOT_CLAIMED",
            WrongOwner { .. } => "WRONG_OWNER",
            Attached { .. } => "ATTACHED",
            Blocked { .. } => "BLOCKED_BY_RELATED_CLAIM",
            InUseByDomain { .. } => "IN_USE_BY_DOMAIN",
            Unmanaged { .. } => "UNMANAGED",
            Lost { .. } => "LOST",
            NoMatch { .. } => "NO_MATCH",
            RequestIdReused { .. } => "REQUEST_ID_REUSED",
            NotPhysicalFunction { .. } => "NOT_A_PHYSICAL_FUNCTION",
            VfClaimed { .. } => "VF_CLAIMED",
            VfCountChanging { .. } => "VF_COUNT_CHANGING",
            GroupMemberInUse { .. } => "GROUP_MEMBER_IN_USE_BY_DOMAIN",
            BindingMemberInUse { .. } => "BINDING_MEMBER_IN_USE_BY_DOMAIN",
            VfGroupClaimed { .. } => "VF_GROUP_CLAIMED",
            // Both: a VF of this PF is used by a domain without a claim.
            VfCountInUse { .. } | VfInUseByDomain { .. } => "VF_IN_USE_BY_DOMAIN",
            NoIommuGroup { .. } => "NO_IOMMU_GROUP",
        }
    }
}
