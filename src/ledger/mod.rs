//! The ownership state machine: pure, synchronous, no I/O.
//!
//! Every operation either returns an error and leaves the ledger exactly as it was, or
//! applies its effect and returns the [`ChangeSet`] that the store must make durable
//! before the caller is answered. If that commit fails, [`Ledger::undo`] reverts the
//! change set, so memory never runs ahead of disk.
//!
//! Rules (see the architecture's invariants):
//! - every change to a record stamps it with the next host generation (I5);
//! - claim, release and transfer must present the record's current generation (I2);
//! - a device referenced by a domain (attached) is never released (I3);
//! - a claimed device that vanishes is kept as lost; the address coming back is a new
//!   record (I6);
//! - a retried request (same consumer and request id) returns the first outcome (I7);
//! - blocking between PF, VFs and IOMMU group members is derived on every decision from
//!   the claims and the inventory, never stored (I1).

mod error;
mod hardware;
pub mod model;
#[cfg(test)]
mod proptests;
mod selector;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub use error::LedgerError;
pub use hardware::{vf_count_replay, BindRetry, RestorePlan, VfCountLog, VfCountReplay};
pub use model::*;
pub use selector::Selector;

use crate::pci::{ConsumerId, Generation, PciAddress, RequestId};

/// How many request-log entries the ledger keeps in memory: the newest, which is where
/// retries land. The store keeps the whole log (see [`crate::store`]); the writer
/// recalls an older entry from there before the ledger decides (see [`Ledger::recall`]).
pub const DEFAULT_REQUEST_LOG_LIMIT: usize = 1024;

/// A claim request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    pub target: ClaimTarget,
    pub owner: Owner,
    pub request_id: RequestId,
}

/// What to claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimTarget {
    /// This device, if its generation is still the expected one.
    Address {
        address: PciAddress,
        expected_generation: Generation,
    },
    /// Any free managed device matching the selector; the ledger picks.
    Selector(Selector),
}

/// A release request. `generation` must be the record's current generation; for a lost
/// claim it names which lost record (the present device at that address may be another).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseRequest {
    pub address: PciAddress,
    pub consumer: ConsumerId,
    pub request_id: RequestId,
    pub generation: Generation,
}

/// An atomic move of a claim from one consumer to another (a migration's claim becoming
/// the instance's, or back on revert). Never a release followed by a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferRequest {
    pub address: PciAddress,
    pub from: ConsumerId,
    pub to: Owner,
    pub request_id: RequestId,
    pub generation: Generation,
}

/// A domain that references a device without holding its claim.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Stray {
    pub address: PciAddress,
    pub domain: DomainRef,
    /// The claim's owner, if another consumer holds it.
    pub claimed_by: Option<Owner>,
    /// False when the address is not in the inventory at all.
    pub known_device: bool,
}

/// A device as clients see it: the record plus its derived state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceView {
    pub record: DeviceRecord,
    pub state: DeviceState,
}

/// A request-log entry without its key.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Logged {
    outcome: Outcome,
    at: u64,
}

impl Logged {
    fn split(e: RequestEntry) -> (RequestKey, Logged) {
        (
            (e.consumer, e.request_id),
            Logged {
                outcome: e.outcome,
                at: e.at,
            },
        )
    }

    fn entry(&self, key: &RequestKey) -> RequestEntry {
        RequestEntry {
            consumer: key.0,
            request_id: key.1.clone(),
            outcome: self.outcome.clone(),
            at: self.at,
        }
    }
}

/// The ownership ledger.
///
/// The maps are persistent (structurally shared), so a clone for a published read view
/// costs O(1) and a change copies only the path to the changed entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    host_generation: Generation,
    records: imbl::OrdMap<RecordId, DeviceRecord>,
    /// The present instance at each address.
    present: imbl::OrdMap<PciAddress, RecordId>,
    /// The newest entries of the request log (the store holds all of it): each entry's
    /// key holds its consumer and request id, which the value does not repeat.
    requests: imbl::OrdMap<RequestKey, Logged>,
    /// Domains on the host and what they reference.
    /// Shared with the published views, like `refs`: replaced whole when libvirt is
    /// listed, never changed in place, so a view's copy of the ledger costs no copy of
    /// them (it cost 0.4 ms a batch with 500 domains).
    domains: Arc<Vec<DomainDevices>>,
    /// Derived from `domains`: which domains reference each address.
    refs: Arc<BTreeMap<PciAddress, Vec<DomainRef>>>,
    /// Derived from `records`: each record under the keys that relate it to others (its
    /// address, its physical function, its IOMMU group), so that a record's state, and
    /// re-deriving the states around a change, read the related records, not every
    /// device or every claim.
    ///
    /// Each key's records are in record-id order, and stay shared with the published
    /// views until a record joins or leaves them (a claim or release changes none): a
    /// lookup is one search of the map, with nothing allocated to walk it.
    related: imbl::OrdMap<Link, Linked>,
    request_log_limit: usize,
    /// The PFs whose VF count is being written, each with its change: no claim may take
    /// one, or a VF of one, until the change is done. In memory only (a change does not
    /// outlive the agent that makes it), and empty but for the seconds or minutes the
    /// kernel takes.
    changing: Arc<BTreeMap<PciAddress, hardware::Changing>>,
    /// Records whose instance was learnt without a change (see [`Ledger::apply_devices`]),
    /// and so is not on disk yet: [`Ledger::take_unwritten_instances`] hands the claimed
    /// ones to the writer, which stores them apart from any decision.
    unwritten: Arc<BTreeSet<RecordId>>,
}

/// A key of the `related` index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Link {
    /// Records at this address (the present one and lost ones).
    At(PciAddress),
    /// Virtual functions of the physical function at this address.
    VfOf(PciAddress),
    /// Members of this IOMMU group.
    Group(u32),
}

impl Link {
    /// The keys a record is indexed under.
    fn of(r: &DeviceRecord) -> [Option<Link>; 3] {
        [
            Some(Link::At(r.address())),
            r.facts.physfn.map(Link::VfOf),
            r.facts.iommu_group.map(Link::Group),
        ]
    }
}

/// The records under one key of the `related` index, in record-id order, never none.
/// Most keys (an address, a one-device IOMMU group) hold one, kept inline: an allocation
/// for each would add about half a megabyte at 4,096 devices.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Linked {
    One(RecordId),
    /// Two or more.
    Many(Arc<[RecordId]>),
}

impl Linked {
    fn ids(&self) -> &[RecordId] {
        match self {
            Linked::One(id) => std::slice::from_ref(id),
            Linked::Many(ids) => ids,
        }
    }

    /// These records and `id`, which is not among them.
    fn and(&self, id: RecordId) -> Linked {
        let ids = self.ids();
        let at = ids.partition_point(|&other| other < id);
        let mut all = Vec::with_capacity(ids.len() + 1);
        all.extend_from_slice(&ids[..at]);
        all.push(id);
        all.extend_from_slice(&ids[at..]);
        Linked::Many(all.into())
    }

    /// These records but the one at `at`; `None` when it was the only one.
    fn but(&self, at: usize) -> Option<Linked> {
        let ids = self.ids();
        match ids.len() {
            0 | 1 => None,
            2 => Some(Linked::One(ids[1 - at])),
            _ => {
                let mut rest = ids.to_vec();
                rest.remove(at);
                Some(Linked::Many(rest.into()))
            }
        }
    }
}

/// Collects one operation's changes and before-images while it mutates the ledger.
struct Tx {
    cs: ChangeSet,
    touched: BTreeSet<RecordId>,
}

/// Pushes onto one of a change set's lists of records, which a claim, release or transfer
/// fills with one: the first push makes room for exactly one. Without it a Vec makes room
/// for four, over 1 KiB for records, which glibc serves from the shared arena under its
/// lock rather than from the thread's own cache (see `memory`). Later pushes grow as
/// usual.
fn push_one_more<T>(list: &mut Vec<T>, item: T) {
    if list.capacity() == 0 {
        list.reserve_exact(1);
    }
    list.push(item);
}

impl Tx {
    fn new(host_generation: Generation) -> Self {
        Tx {
            cs: ChangeSet {
                prev_host_generation: host_generation,
                host_generation,
                ..ChangeSet::default()
            },
            touched: BTreeSet::new(),
        }
    }
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Ledger {
            request_log_limit: DEFAULT_REQUEST_LOG_LIMIT,
            ..Ledger::default()
        }
    }

    /// Rebuilds the ledger from what the store loaded. Blocking state is derived, so
    /// nothing else is needed; the caller then applies a fresh inventory scan.
    pub fn from_snapshot(snapshot: Snapshot) -> Self {
        let mut ledger = Ledger::new();
        ledger.host_generation = snapshot.host_generation;
        for (id, rec) in snapshot.records {
            // A record newer than the stored host generation would break I5; trust the
            // larger of the two so the counter never goes backwards. Likewise its id
            // (the generation it was made at, so never above its generation unless a
            // row was damaged): the next record made takes the next generation as its
            // id, which must be no stored record's.
            ledger.host_generation = ledger
                .host_generation
                .max(rec.generation)
                .max(Generation(id.0));
            if rec.present {
                ledger.present.insert(rec.address(), id);
            }
            ledger.store_record(rec);
        }
        for entry in snapshot.requests {
            let (key, logged) = Logged::split(entry);
            ledger.requests.insert(key, logged);
        }
        ledger
    }

    /// The floor the host generation is raised to at start: the clock's (see
    /// [`Generation::clock_floor`]), and in any case past every generation the last run
    /// may have published without storing it. A batch's events for the records whose
    /// derived state changed around it (a VF's claim changes its PF's state) take one
    /// generation each above the counter its commit stored, and are stored only with the
    /// next commit: a stop in between leaves up to one per record unstored, which a
    /// clock behind the stored counter would hand out again (to a watcher resuming from
    /// one, or an audit whose snapshot is one, a later change would read as older).
    pub fn start_floor(&self, since_epoch: std::time::Duration) -> Generation {
        let unstored = u64::try_from(self.records.len())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        Generation::clock_floor(since_epoch)
            .max(Generation(self.host_generation.0.saturating_add(unstored)))
    }

    /// Raises the host generation to `floor` if it is below it (see
    /// [`Generation::clock_floor`]): the change to commit, which touches no record, or
    /// `None` when the counter is at or past the floor already.
    pub fn raise_host_generation(&mut self, floor: Generation) -> Option<ChangeSet> {
        if floor <= self.host_generation {
            return None;
        }
        let mut tx = Tx::new(self.host_generation);
        self.host_generation = floor;
        tx.cs.host_generation = floor;
        Some(tx.cs)
    }

    /// Sets how many request-log entries are kept in memory (at least 1).
    pub fn set_request_log_limit(&mut self, limit: usize) {
        self.request_log_limit = limit.max(1);
    }

    /// Whether the in-memory window of the request log holds this request.
    pub fn knows_request(&self, consumer: ConsumerId, request_id: &RequestId) -> bool {
        self.requests.contains_key(&(consumer, request_id.clone()))
    }

    /// Puts back an entry that the store holds but memory no longer does, so that a
    /// retry of it is answered as the first time (I7). It is durable already: no change
    /// set. The oldest entries make room if the window is full (the store keeps them).
    pub fn recall(&mut self, entry: RequestEntry) {
        let (key, logged) = Logged::split(entry);
        self.requests.insert(key.clone(), logged);
        self.prune_requests(&key);
    }

    pub fn host_generation(&self) -> Generation {
        self.host_generation
    }

    /// The present instance at an address.
    pub fn record_at(&self, address: PciAddress) -> Option<&DeviceRecord> {
        self.present
            .get(&address)
            .and_then(|id| self.records.get(id))
    }

    /// Every record, present and lost, in record-id order.
    pub fn records(&self) -> impl Iterator<Item = &DeviceRecord> {
        self.records.values()
    }

    /// Every record at an address: the present instance first, then the lost ones (in
    /// record-id order).
    pub fn records_at(&self, address: PciAddress) -> impl Iterator<Item = &DeviceRecord> {
        self.record_at(address).into_iter().chain(
            self.linked(Link::At(address))
                .filter_map(|id| self.records.get(&id))
                .filter(|r| !r.present),
        )
    }

    /// Lost records (claimed, gone from sysfs), in record-id order. A lost record always
    /// holds its claim (releasing one removes it). Walks every record: nothing on a
    /// request's path asks for them.
    pub fn lost(&self) -> impl Iterator<Item = &DeviceRecord> {
        self.records.values().filter(|r| !r.present)
    }

    pub fn request(&self, consumer: ConsumerId, request_id: &RequestId) -> Option<RequestEntry> {
        let key = (consumer, request_id.clone());
        self.requests.get(&key).map(|l| l.entry(&key))
    }

    /// How many request-log entries are kept.
    pub fn request_log_len(&self) -> usize {
        self.requests.len()
    }

    /// The whole request log, in (consumer, request id) order.
    pub fn request_log(&self) -> impl Iterator<Item = RequestEntry> + '_ {
        self.requests.iter().map(|(k, l)| l.entry(k))
    }

    pub fn domains(&self) -> &[DomainDevices] {
        &self.domains
    }

    /// Every device with its derived state, ordered by address (present before lost).
    pub fn views(&self) -> Vec<DeviceView> {
        let states = self.states();
        self.views_with(|id| states.get(&id))
    }

    /// [`Self::views`] from states already derived (by [`Self::states`], or kept up to
    /// date by the writer), looked up by record id.
    pub fn views_with<'s>(
        &self,
        state: impl Fn(RecordId) -> Option<&'s DeviceState>,
    ) -> Vec<DeviceView> {
        let mut out: Vec<DeviceView> = self
            .records
            .values()
            .filter_map(|r| {
                state(r.id).map(|s| DeviceView {
                    record: r.clone(),
                    state: s.clone(),
                })
            })
            .collect();
        out.sort_by_key(|v| (v.record.address(), !v.record.present, v.record.id));
        out
    }

    /// The derived state of every record (O(records): each reads only its related ones).
    pub fn states(&self) -> BTreeMap<RecordId, DeviceState> {
        self.records
            .values()
            .map(|r| (r.id, self.state_of(r)))
            .collect()
    }

    /// The derived states that a change of `touched` records can have changed, while the
    /// domains stayed the same: each touched record still here, and every record whose
    /// state reads one of them (see `blocker`): its physical function, its virtual
    /// functions, the members of its IOMMU group, any record at its address. `touched`
    /// holds both versions of each changed record (before and after), so a record that
    /// moved group or lost its PF is covered on both sides. Lookups in the `related`
    /// index only, never a walk over every claim; the result is in record-id order.
    pub fn states_around(&self, touched: &[&DeviceRecord]) -> Vec<(RecordId, DeviceState)> {
        let mut ids = BTreeSet::new();
        for t in touched {
            ids.insert(t.id);
            let keys = [
                Some(Link::At(t.address())),
                Some(Link::VfOf(t.address())),
                t.facts.physfn.map(Link::At),
                t.facts.iommu_group.map(Link::Group),
            ];
            for key in keys.into_iter().flatten() {
                ids.extend(self.linked(key));
            }
        }
        ids.into_iter()
            .filter_map(|id| self.records.get(&id))
            .map(|r| (r.id, self.state_of(r)))
            .collect()
    }

    /// What `changes` (applied to this ledger, none of them changing the domains) did to
    /// the derived states: the records they removed, and the state of every record
    /// [`Self::states_around`] the ones they touched, before and after.
    pub fn rederive(&self, changes: &[ChangeSet]) -> (Vec<RecordId>, Vec<(RecordId, DeviceState)>) {
        let mut versions: Vec<&DeviceRecord> = Vec::new();
        let mut removed = Vec::new();
        for cs in changes {
            for (id, old) in &cs.before {
                versions.extend(old.iter());
                match self.records.get(id) {
                    Some(now) => versions.push(now),
                    None => removed.push(*id),
                }
            }
        }
        (removed, self.states_around(&versions))
    }

    /// One record by id (present or lost).
    pub fn record(&self, id: RecordId) -> Option<&DeviceRecord> {
        self.records.get(&id)
    }

    /// The derived state of one record.
    pub fn state_of(&self, r: &DeviceRecord) -> DeviceState {
        if !r.present {
            return DeviceState::Lost;
        }
        if r.claim.is_some() {
            return if r.attached.is_some() {
                DeviceState::Attached
            } else {
                DeviceState::Claimed
            };
        }
        if let Some(blocker) = self.blocker(r) {
            return DeviceState::Unavailable { blocker };
        }
        if !r.facts.managed {
            return DeviceState::Unmanaged;
        }
        DeviceState::Free
    }

    /// Why an unclaimed present record cannot be claimed by anyone, if it cannot. Reads
    /// only the records related to it in the `related` index (the records at its PF's
    /// address, its VFs, its IOMMU group), so the cost does not grow with the number of
    /// claims on the host. Where several block it, the one with the lowest record id is
    /// named.
    fn blocker(&self, r: &DeviceRecord) -> Option<Blocker> {
        let addr = r.address();
        let claimed = |key| {
            self.linked(key)
                .filter_map(|id| self.records.get(&id))
                .filter(|other| other.claim.is_some())
        };
        // A claimed PF blocks its VFs, present or lost: a lost PF claim's owner may still
        // believe it holds them.
        if let Some(pf) = r.facts.physfn {
            if claimed(Link::At(pf)).next().is_some() {
                return Some(Blocker::Related {
                    address: pf,
                    relation: Relation::PhysicalFunction,
                });
            }
        }
        if let Some(vf) = claimed(Link::VfOf(addr)).next() {
            return Some(Blocker::Related {
                address: vf.address(),
                relation: Relation::VirtualFunction,
            });
        }
        if let Some(group) = r.facts.iommu_group {
            // Group numbers of lost devices are stale (they change across reboots), so
            // only present members block their group.
            if let Some(other) = claimed(Link::Group(group)).find(|other| other.present) {
                if other.address() != addr {
                    return Some(Blocker::Related {
                        address: other.address(),
                        relation: Relation::IommuGroup,
                    });
                }
            }
        }
        // A VF that a domain uses without a claim blocks its PF as a claimed one does.
        if let Some((vf, domain)) = self.vf_in_use(addr) {
            return Some(Blocker::VfInUse { vf, domain });
        }
        if let Some(d) = self.refs.get(&addr).and_then(|v| v.first()) {
            return Some(Blocker::Domain(d.clone()));
        }
        None
    }

    /// The first VF of `pf` (by record id) that a domain references, with that domain:
    /// taking the PF from its driver would destroy that VF under the domain.
    pub(crate) fn vf_in_use(&self, pf: PciAddress) -> Option<(PciAddress, DomainRef)> {
        self.linked(Link::VfOf(pf))
            .filter_map(|id| self.records.get(&id))
            .find_map(|vf| {
                let d = self.refs.get(&vf.address())?.first()?;
                Some((vf.address(), d.clone()))
            })
    }

    /// Domains that reference devices without holding their claim, by address (O(every
    /// referenced device): the writer keeps them up to date with [`Self::strays_around`]).
    pub fn strays(&self) -> Vec<Stray> {
        self.refs
            .iter()
            .flat_map(|(addr, domains)| self.strays_at(*addr, domains))
            .collect()
    }

    /// The strays at each address that `changes` (applied to this ledger, none of them
    /// changing the domains) touched, as they are now (an empty list: none there now).
    /// A stray reads only the domains, which did not change, and the record at its own
    /// address, so every other address keeps the strays it had. In address order.
    pub fn strays_around(&self, changes: &[ChangeSet]) -> Vec<(PciAddress, Vec<Stray>)> {
        let mut touched = BTreeSet::new();
        for cs in changes {
            touched.extend(
                cs.before
                    .iter()
                    .filter_map(|(_, old)| old.as_ref())
                    .map(|r| r.address()),
            );
            touched.extend(cs.upserts.iter().map(|r| r.address()));
            touched.extend(cs.removed.iter().map(|(addr, _, _)| *addr));
        }
        touched
            .into_iter()
            .map(|addr| {
                let domains = self.refs.get(&addr).map(Vec::as_slice).unwrap_or_default();
                (addr, self.strays_at(addr, domains).collect())
            })
            .collect()
    }

    /// The domains among `domains` (those referencing `addr`) that do not hold the claim
    /// of the device there.
    fn strays_at<'a>(
        &'a self,
        addr: PciAddress,
        domains: &'a [DomainRef],
    ) -> impl Iterator<Item = Stray> + 'a {
        let rec = self.record_at(addr);
        let owner = rec.and_then(|r| r.claim.as_ref()).map(|c| &c.owner);
        domains
            .iter()
            .filter(move |d| owner.map(|o| o.consumer.0) != Some(d.uuid))
            .map(move |d| Stray {
                address: addr,
                domain: d.clone(),
                claimed_by: owner.cloned(),
                known_device: rec.is_some(),
            })
    }

    // ---- mutations -------------------------------------------------------------------

    /// Claims a device, by address (with the expected generation) or by selector.
    pub fn claim(
        &mut self,
        req: &ClaimRequest,
        now: u64,
    ) -> Result<(Outcome, ChangeSet), LedgerError> {
        let consumer = req.owner.consumer;
        if let Some(entry) = self.requests.get(&(consumer, req.request_id.clone())) {
            let same = match (&entry.outcome, &req.target) {
                (Outcome::Claimed { address, .. }, ClaimTarget::Address { address: a, .. }) => {
                    address == a
                }
                (Outcome::Claimed { .. }, ClaimTarget::Selector(_)) => true,
                _ => false,
            };
            return if same {
                Ok((entry.outcome.clone(), self.empty_change()))
            } else {
                Err(LedgerError::RequestIdReused {
                    consumer,
                    request_id: req.request_id.clone(),
                    previous: entry.outcome.clone(),
                })
            };
        }
        let id = match &req.target {
            ClaimTarget::Address {
                address,
                expected_generation,
            } => {
                let rec = self
                    .record_at(*address)
                    .ok_or(LedgerError::UnknownDevice { address: *address })?;
                if rec.generation != *expected_generation {
                    return Err(LedgerError::StaleGeneration {
                        address: *address,
                        presented: *expected_generation,
                        current: rec.generation,
                        owner: rec.claim.as_ref().map(|c| c.owner.clone()),
                    });
                }
                self.check_claimable(rec, consumer)?;
                rec.id
            }
            ClaimTarget::Selector(sel) => {
                self.pick(sel, consumer)
                    .ok_or_else(|| LedgerError::NoMatch {
                        selector: sel.to_string(),
                    })?
            }
        };
        let mut tx = Tx::new(self.host_generation);
        let generation = self.modify_at(&mut tx, id, |r, generation| {
            r.claim = Some(Claim {
                owner: req.owner.clone(),
                request_id: req.request_id.clone(),
                claimed_at: now,
                since: Some(generation),
                vfio: None,
            });
        });
        let address = self.records[&id].address();
        let outcome = Outcome::Claimed {
            address,
            record: id,
            generation,
        };
        self.log_request(&mut tx, consumer, &req.request_id, &outcome, now);
        Ok((outcome, tx.cs))
    }

    fn check_claimable(&self, rec: &DeviceRecord, consumer: ConsumerId) -> Result<(), LedgerError> {
        let address = rec.address();
        let generation = rec.generation;
        self.check_not_changing(rec)?;
        if let Some(c) = &rec.claim {
            return Err(LedgerError::AlreadyClaimed {
                address,
                owner: c.owner.clone(),
                generation,
            });
        }
        match self.blocker(rec) {
            Some(Blocker::Related {
                address: by,
                relation,
            }) => {
                let owner = self
                    .record_at(by)
                    .or_else(|| self.records_at(by).find(|r| !r.present))
                    .and_then(|r| r.claim.as_ref())
                    .map(|c| c.owner.clone());
                return Err(LedgerError::Blocked {
                    address,
                    by,
                    relation,
                    owner,
                    generation,
                });
            }
            // A domain that references the device and is the claimant itself is adopting
            // its own device; any other domain that references it too is a VM using it,
            // whichever of them the blocker names first.
            Some(Blocker::Domain(_)) => {
                let refs = self
                    .refs
                    .get(&address)
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                if let Some(d) = refs.iter().find(|d| d.uuid != consumer.0) {
                    return Err(LedgerError::InUseByDomain {
                        address,
                        domain: d.clone(),
                        generation,
                    });
                }
            }
            Some(Blocker::VfInUse { vf, domain }) => {
                return Err(LedgerError::VfInUseByDomain {
                    pf: address,
                    vf,
                    domain,
                    generation,
                })
            }
            None => {}
        }
        if !rec.facts.managed {
            return Err(LedgerError::Unmanaged {
                address,
                generation,
            });
        }
        Ok(())
    }

    /// Picks a free device for a selector: matching, claimable, preferring the requested
    /// NUMA node, then the lowest address (deterministic). The devices are visited in
    /// address order, so the first one on the requested node (or the first at all, with
    /// no node asked for) is the pick, and the walk stops there.
    fn pick(&self, sel: &Selector, consumer: ConsumerId) -> Option<RecordId> {
        let mut off_node_first: Option<RecordId> = None;
        for id in self.present.values() {
            let Some(rec) = self.records.get(id) else {
                continue;
            };
            if !sel.matches(&rec.facts) {
                continue;
            }
            let off_node = sel.numa_node.is_some() && rec.facts.numa_node != sel.numa_node;
            // Off the node, only the first claimable device can be picked.
            if off_node && off_node_first.is_some() {
                continue;
            }
            if self.check_claimable(rec, consumer).is_err() {
                continue;
            }
            if !off_node {
                return Some(*id);
            }
            off_node_first = Some(*id);
        }
        off_node_first
    }

    /// Releases a claim: only by its owner, only with the current generation, never while
    /// attached. A lost claim is dropped; a present device becomes free.
    pub fn release(
        &mut self,
        req: &ReleaseRequest,
        now: u64,
    ) -> Result<(Outcome, ChangeSet), LedgerError> {
        if let Some(entry) = self.requests.get(&(req.consumer, req.request_id.clone())) {
            return match &entry.outcome {
                Outcome::Released { address, .. } if *address == req.address => {
                    Ok((entry.outcome.clone(), self.empty_change()))
                }
                other => Err(LedgerError::RequestIdReused {
                    consumer: req.consumer,
                    request_id: req.request_id.clone(),
                    previous: other.clone(),
                }),
            };
        }
        let id = self.releasable(req)?;
        let rec = &self.records[&id];
        let mut tx = Tx::new(self.host_generation);
        let generation = if rec.present {
            self.modify(&mut tx, id, |r| {
                r.claim = None;
                r.attached = None;
            })
        } else {
            self.remove(&mut tx, id)
        };
        let outcome = Outcome::Released {
            address: req.address,
            record: id,
            generation,
        };
        self.log_request(&mut tx, req.consumer, &req.request_id, &outcome, now);
        Ok((outcome, tx.cs))
    }

    /// The refusal [`Self::release`] would answer now, without applying anything: a
    /// request id recorded for another operation, a stale generation, another owner, a
    /// device not claimed or attached. A retry of a recorded release is no refusal.
    pub fn check_release(&self, req: &ReleaseRequest) -> Result<(), LedgerError> {
        if let Some(entry) = self.requests.get(&(req.consumer, req.request_id.clone())) {
            return match &entry.outcome {
                Outcome::Released { address, .. } if *address == req.address => Ok(()),
                other => Err(LedgerError::RequestIdReused {
                    consumer: req.consumer,
                    request_id: req.request_id.clone(),
                    previous: other.clone(),
                }),
            };
        }
        self.releasable(req).map(|_| ())
    }

    /// The claim a release frees: the owner's, at the presented generation, and not
    /// attached to a domain.
    fn releasable(&self, req: &ReleaseRequest) -> Result<RecordId, LedgerError> {
        let id = self.resolve_claimed(req.address, req.consumer, req.generation)?;
        let rec = &self.records[&id];
        if let Some(domain) = &rec.attached {
            return Err(LedgerError::Attached {
                address: req.address,
                domain: domain.clone(),
                generation: rec.generation,
            });
        }
        Ok(id)
    }

    /// Moves a claim atomically from one consumer to another.
    pub fn transfer(
        &mut self,
        req: &TransferRequest,
        now: u64,
    ) -> Result<(Outcome, ChangeSet), LedgerError> {
        if let Some(entry) = self.requests.get(&(req.from, req.request_id.clone())) {
            return match &entry.outcome {
                Outcome::Transferred { address, to, .. }
                    if *address == req.address && *to == req.to.consumer =>
                {
                    Ok((entry.outcome.clone(), self.empty_change()))
                }
                other => Err(LedgerError::RequestIdReused {
                    consumer: req.from,
                    request_id: req.request_id.clone(),
                    previous: other.clone(),
                }),
            };
        }
        let id = self.resolve_claimed(req.address, req.from, req.generation)?;
        let rec = &self.records[&id];
        if !rec.present {
            if let Some(c) = &rec.claim {
                return Err(LedgerError::Lost {
                    address: req.address,
                    owner: c.owner.clone(),
                    generation: rec.generation,
                });
            }
        }
        let mut tx = Tx::new(self.host_generation);
        // The VFIO binding moves with the claim: the new owner's release restores it.
        let vfio = rec.claim.as_ref().and_then(|c| c.vfio.clone());
        let since = rec.claim.as_ref().and_then(|c| c.since);
        let generation = self.modify(&mut tx, id, |r| {
            r.claim = Some(Claim {
                owner: req.to.clone(),
                request_id: req.request_id.clone(),
                claimed_at: now,
                since,
                vfio,
            });
        });
        let outcome = Outcome::Transferred {
            address: req.address,
            record: id,
            generation,
            to: req.to.consumer,
        };
        self.log_request(&mut tx, req.from, &req.request_id, &outcome, now);
        Ok((outcome, tx.cs))
    }

    /// Finds the claimed record at `address` that `consumer` names by `generation`: the
    /// present instance, or a lost one. Checks generation first, then owner.
    fn resolve_claimed(
        &self,
        address: PciAddress,
        consumer: ConsumerId,
        generation: Generation,
    ) -> Result<RecordId, LedgerError> {
        let mut candidates: Vec<&DeviceRecord> = self.records_at(address).collect();
        candidates.sort_by_key(|r| r.id);
        if candidates.is_empty() {
            return Err(LedgerError::UnknownDevice { address });
        }
        let rec = match candidates.iter().position(|r| r.generation == generation) {
            Some(i) => candidates.swap_remove(i),
            None => {
                // Report against the record the caller most likely means: its own claim,
                // else the present device.
                let primary = candidates
                    .iter()
                    .find(|r| {
                        r.claim
                            .as_ref()
                            .is_some_and(|c| c.owner.consumer == consumer)
                    })
                    .or_else(|| candidates.iter().find(|r| r.present))
                    .or(candidates.first())
                    .copied();
                let Some(rec) = primary else {
                    return Err(LedgerError::UnknownDevice { address });
                };
                return Err(LedgerError::StaleGeneration {
                    address,
                    presented: generation,
                    current: rec.generation,
                    owner: rec.claim.as_ref().map(|c| c.owner.clone()),
                });
            }
        };
        match &rec.claim {
            None => Err(LedgerError::NotClaimed {
                address,
                generation: rec.generation,
            }),
            Some(c) if c.owner.consumer != consumer => Err(LedgerError::WrongOwner {
                address,
                presented: consumer,
                owner: c.owner.clone(),
                generation: rec.generation,
            }),
            Some(_) => Ok(rec.id),
        }
    }

    /// Applies a full inventory: the complete set of devices now present.
    pub fn apply_inventory(&mut self, facts: Vec<DeviceFacts>) -> ChangeSet {
        let seen: BTreeSet<PciAddress> = facts.iter().map(|f| f.address).collect();
        let gone: Vec<PciAddress> = self
            .present
            .keys()
            .filter(|a| !seen.contains(a))
            .copied()
            .collect();
        let mut changes: Vec<(PciAddress, Option<DeviceFacts>)> =
            gone.into_iter().map(|a| (a, None)).collect();
        changes.extend(facts.into_iter().map(|f| (f.address, Some(f))));
        self.apply_devices(changes)
    }

    /// Applies changes for some devices only (a hotplug rescan): `Some(facts)` for a device
    /// now present, `None` for one that is gone.
    pub fn apply_devices(&mut self, changes: Vec<(PciAddress, Option<DeviceFacts>)>) -> ChangeSet {
        let mut tx = Tx::new(self.host_generation);
        for (address, facts) in changes {
            let current = self.present.get(&address).copied();
            match (current, facts) {
                // Another device at the same address: the kernel removed the one recorded
                // and made a new one (a hot-unplug and re-add, VFs destroyed and created)
                // while no uevent said so, or while the agent was not running. The old
                // instance went as a removal would take it (a claim kept, lost: I6), and
                // the new one comes free.
                (Some(id), Some(facts))
                    if self.records[&id]
                        .facts
                        .instance
                        .zip(facts.instance)
                        .is_some_and(|(was, is)| was.replaced_by(&is)) =>
                {
                    self.vanish(&mut tx, address);
                    self.appear(&mut tx, facts);
                }
                (Some(id), Some(facts)) => {
                    let was = &self.records[&id].facts;
                    if *was == facts {
                        continue;
                    }
                    let instance_only = was.instance != facts.instance
                        && (DeviceFacts {
                            instance: facts.instance,
                            ..was.clone()
                        }) == facts;
                    if instance_only {
                        // Only which instance it is became known (in a new boot, or
                        // first read by this build) or unknown: the device did not
                        // change, and gets no new generation, nor a write of its own (a
                        // restart on a full disk must not fail over it). Kept in memory:
                        // a claimed one's is written apart by the writer (see
                        // `take_unwritten_instances`), any with the record's next change.
                        if let Some(r) = self.records.get_mut(&id) {
                            r.facts.instance = facts.instance;
                            Arc::make_mut(&mut self.unwritten).insert(id);
                        }
                    } else {
                        self.modify(&mut tx, id, |r| r.facts = facts);
                    }
                }
                (None, Some(facts)) => self.appear(&mut tx, facts),
                (Some(_), None) => self.vanish(&mut tx, address),
                (None, None) => {}
            }
        }
        tx.cs
    }

    /// The claimed present records whose instance was learnt but not written, as a change
    /// set that moves no generation (nothing about the device changed), once: the writer
    /// stores it apart, so that a restart in this boot can tell the device from one made
    /// again meanwhile. `None` when there is none. An unclaimed device's number is left to
    /// its record's next write: nothing is lost if it goes unseen.
    pub fn take_unwritten_instances(&mut self) -> Option<ChangeSet> {
        if self.unwritten.is_empty() {
            return None;
        }
        let ids = std::mem::take(Arc::make_mut(&mut self.unwritten));
        let upserts: Vec<DeviceRecord> = ids
            .iter()
            .filter_map(|id| self.records.get(id))
            .filter(|r| r.present && r.claim.is_some())
            .cloned()
            .collect();
        (!upserts.is_empty()).then(|| ChangeSet {
            prev_host_generation: self.host_generation,
            host_generation: self.host_generation,
            upserts,
            ..ChangeSet::default()
        })
    }

    /// Puts back what [`Ledger::take_unwritten_instances`] took, when its write failed.
    pub fn unwritten_again(&mut self, cs: &ChangeSet) {
        Arc::make_mut(&mut self.unwritten).extend(cs.upserts.iter().map(|r| r.id));
    }

    /// A device now present where none was: a record of its own, free.
    fn appear(&mut self, tx: &mut Tx, facts: DeviceFacts) {
        let generation = self.bump(tx);
        let id = RecordId(generation.0);
        let address = facts.address;
        let mut rec = DeviceRecord {
            id,
            facts,
            generation,
            present: true,
            claim: None,
            attached: None,
        };
        rec.attached = self.attachment_for(&rec);
        self.present.insert(address, id);
        self.put(tx, rec);
    }

    /// The device present at `address` is gone: a claimed one is kept, marked lost (I6);
    /// an unclaimed one's record is removed.
    fn vanish(&mut self, tx: &mut Tx, address: PciAddress) {
        let Some(id) = self.present.remove(&address) else {
            return;
        };
        if self.records[&id].claim.is_some() {
            self.modify(tx, id, |r| r.present = false);
        } else {
            self.remove(tx, id);
        }
    }

    /// Replaces the set of domains on the host and recomputes attachments. A device whose
    /// domain goes away returns to claimed, never to free. A listing the same as the
    /// last (every poll and every free's fresh listing on a quiet host) is not indexed
    /// again, and the change set then names no domains: the writer re-derives only
    /// around the records whose attachment it fixed (usually none; a ledger loaded from
    /// disk may hold attachments older than any listing), not every state.
    pub fn apply_domains(&mut self, domains: Vec<DomainDevices>) -> ChangeSet {
        let mut tx = Tx::new(self.host_generation);
        if *self.domains != domains {
            let refs = Self::index_domains(&domains);
            let before = std::mem::replace(&mut self.domains, Arc::new(domains));
            tx.cs.before_domains = Some(Arc::unwrap_or_clone(before));
            self.refs = Arc::new(refs);
        }
        // An attachment reads only the domains and the record's own claim, so fixing one
        // record changes no other's.
        let stale: Vec<(RecordId, Option<DomainRef>)> = self
            .records
            .values()
            .filter_map(|r| {
                let want = self.attachment(r);
                (r.attached.as_ref() != want).then(|| (r.id, want.cloned()))
            })
            .collect();
        for (id, want) in stale {
            self.modify(&mut tx, id, |r| r.attached = want);
        }
        tx.cs
    }

    fn index_domains(domains: &[DomainDevices]) -> BTreeMap<PciAddress, Vec<DomainRef>> {
        let mut refs: BTreeMap<PciAddress, Vec<DomainRef>> = BTreeMap::new();
        for d in domains {
            for a in &d.addresses {
                let list = refs.entry(*a).or_default();
                if !list.contains(&d.domain) {
                    list.push(d.domain.clone());
                }
            }
        }
        for list in refs.values_mut() {
            list.sort();
        }
        refs
    }

    /// The domain that makes a claimed record attached: one that references its address,
    /// else one whose UUID is the claim's owner.
    fn attachment_for(&self, rec: &DeviceRecord) -> Option<DomainRef> {
        self.attachment(rec).cloned()
    }

    /// [`Self::attachment_for`], borrowed.
    fn attachment(&self, rec: &DeviceRecord) -> Option<&DomainRef> {
        let claim = rec.claim.as_ref()?;
        if let Some(d) = self.refs.get(&rec.address()).and_then(|v| v.first()) {
            return Some(d);
        }
        self.domains
            .iter()
            .map(|d| &d.domain)
            .filter(|d| d.uuid == claim.owner.consumer.0)
            .min()
    }

    /// Reverts a change set that this ledger applied last (its commit failed). Change sets
    /// of one batch must be undone in reverse order.
    pub fn undo(&mut self, cs: &ChangeSet) {
        for (id, before) in cs.before.iter().rev() {
            if let Some(now) = self.drop_record(*id) {
                if now.present && self.present.get(&now.address()) == Some(id) {
                    self.present.remove(&now.address());
                }
            }
            if let Some(rec) = before {
                if rec.present {
                    self.present.insert(rec.address(), *id);
                }
                self.store_record(rec.clone());
            }
        }
        for e in &cs.requests {
            self.requests.remove(&(e.consumer, e.request_id.clone()));
        }
        for e in &cs.before_requests {
            let (key, logged) = Logged::split(e.clone());
            self.requests.insert(key, logged);
        }
        if let Some(domains) = &cs.before_domains {
            self.refs = Arc::new(Self::index_domains(domains));
            self.domains = Arc::new(domains.clone());
        }
        self.host_generation = cs.prev_host_generation;
    }

    // ---- helpers that record before-images --------------------------------------------

    fn empty_change(&self) -> ChangeSet {
        Tx::new(self.host_generation).cs
    }

    fn bump(&mut self, tx: &mut Tx) -> Generation {
        self.host_generation = self.host_generation.next();
        tx.cs.host_generation = self.host_generation;
        self.host_generation
    }

    fn remember(&self, tx: &mut Tx, id: RecordId) {
        if tx.touched.insert(id) {
            push_one_more(&mut tx.cs.before, (id, self.records.get(&id).cloned()));
        }
    }

    /// Changes a record, gives it the next generation, recomputes its attachment.
    fn modify(
        &mut self,
        tx: &mut Tx,
        id: RecordId,
        f: impl FnOnce(&mut DeviceRecord),
    ) -> Generation {
        self.modify_at(tx, id, |r, _| f(r))
    }

    /// [`Self::modify`], telling `f` the generation the record gets.
    fn modify_at(
        &mut self,
        tx: &mut Tx,
        id: RecordId,
        f: impl FnOnce(&mut DeviceRecord, Generation),
    ) -> Generation {
        self.remember(tx, id);
        let generation = self.bump(tx);
        // Changed on a copy: `store_record` compares the record's links (IOMMU group,
        // PF) before and after to keep the `related` index in step, so the stored
        // record must still be the old one when it does.
        let Some(mut updated) = self.records.get(&id).cloned() else {
            return generation;
        };
        f(&mut updated, generation);
        updated.generation = generation;
        updated.attached = self.attachment_for(&updated);
        self.store_record(updated.clone());
        tx.cs.upserts.retain(|r| r.id != id);
        push_one_more(&mut tx.cs.upserts, updated);
        generation
    }

    fn put(&mut self, tx: &mut Tx, rec: DeviceRecord) {
        self.remember(tx, rec.id);
        tx.cs.upserts.retain(|r| r.id != rec.id);
        push_one_more(&mut tx.cs.upserts, rec.clone());
        self.store_record(rec);
    }

    /// Stores a record (new or a new version), keeping the derived indexes in step.
    fn store_record(&mut self, rec: DeviceRecord) {
        let (id, links) = (rec.id, Link::of(&rec));
        let old = self.records.insert(id, rec).map(|old| Link::of(&old));
        if old != Some(links) {
            for key in old.iter().flatten().flatten() {
                self.unlink(*key, id);
            }
            for key in links.into_iter().flatten() {
                self.link(key, id);
            }
        }
    }

    /// Removes a record and its entries in the derived indexes.
    fn drop_record(&mut self, id: RecordId) -> Option<DeviceRecord> {
        let rec = self.records.remove(&id)?;
        for key in Link::of(&rec).into_iter().flatten() {
            self.unlink(key, id);
        }
        Some(rec)
    }

    /// Puts a record under one key of the `related` index.
    fn link(&mut self, key: Link, id: RecordId) {
        let now = match self.related.get(&key) {
            None => Linked::One(id),
            Some(l) if l.ids().binary_search(&id).is_ok() => return,
            Some(l) => l.and(id),
        };
        self.related.insert(key, now);
    }

    /// Takes a record from under one key of the `related` index; a key left with no
    /// record goes.
    fn unlink(&mut self, key: Link, id: RecordId) {
        let Some(l) = self.related.get(&key) else {
            return;
        };
        let Ok(at) = l.ids().binary_search(&id) else {
            return;
        };
        match l.but(at) {
            Some(rest) => {
                self.related.insert(key, rest);
            }
            None => {
                self.related.remove(&key);
            }
        }
    }

    /// The ids of the records under one key of the `related` index, in id order.
    fn linked(&self, key: Link) -> impl Iterator<Item = RecordId> + '_ {
        self.related
            .get(&key)
            .into_iter()
            .flat_map(|l| l.ids().iter().copied())
    }

    /// Deletes a record; the removal itself is a change with its own generation.
    fn remove(&mut self, tx: &mut Tx, id: RecordId) -> Generation {
        self.remember(tx, id);
        let generation = self.bump(tx);
        if let Some(rec) = self.drop_record(id) {
            if self.present.get(&rec.address()) == Some(&id) {
                self.present.remove(&rec.address());
            }
            tx.cs.removed.push((rec.address(), generation, rec.present));
        }
        tx.cs.upserts.retain(|r| r.id != id);
        tx.cs.removals.push(id);
        generation
    }

    fn log_request(
        &mut self,
        tx: &mut Tx,
        consumer: ConsumerId,
        request_id: &RequestId,
        outcome: &Outcome,
        now: u64,
    ) {
        let entry = RequestEntry {
            consumer,
            request_id: request_id.clone(),
            outcome: outcome.clone(),
            at: now,
        };
        let (key, logged) = Logged::split(entry.clone());
        self.requests.insert(key.clone(), logged);
        tx.cs.requests.push(entry);
        tx.cs.before_requests.extend(self.prune_requests(&key));
    }

    /// Drops the oldest tenth of the in-memory window once it is over its limit (so this
    /// is rare), never `keep`; returns what it dropped.
    fn prune_requests(&mut self, keep: &RequestKey) -> Vec<RequestEntry> {
        if self.requests.len() <= self.request_log_limit {
            return Vec::new();
        }
        let excess = self.requests.len() - self.request_log_limit + self.request_log_limit / 10;
        // The `excess` oldest by (time, key), found without copying every key.
        let mut by_age: Vec<(u64, &RequestKey)> = self
            .requests
            .iter()
            .filter(|(k, _)| *k != keep)
            .map(|(k, l)| (l.at, k))
            .collect();
        let excess = excess.min(by_age.len());
        if excess > 0 && excess < by_age.len() {
            by_age.select_nth_unstable(excess - 1);
        }
        let oldest: Vec<RequestKey> = by_age[..excess].iter().map(|(_, k)| (*k).clone()).collect();
        oldest
            .into_iter()
            .filter_map(|key| self.requests.remove(&key).map(|old| old.entry(&key)))
            .collect()
    }
}

/// What a server-side audit found. Only `orphans` may ever be freed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// Present, claimed by a consumer not in the expected list, not attached, unchanged
    /// since the snapshot.
    pub orphans: Vec<DeviceRecord>,
    /// Claimed by an unexpected consumer but changed after the snapshot: never acted on.
    pub changed: Vec<DeviceRecord>,
    /// Claimed by an unexpected consumer but attached to a domain: never freed.
    pub protected: Vec<DeviceRecord>,
    /// Every lost claim (reported; freed only by its owner).
    pub lost: Vec<DeviceRecord>,
    pub strays: Vec<Stray>,
}

impl Ledger {
    /// The server-side audit: compares the claims with the consumers the controller
    /// believes live here, as of the host generation it read before forming that belief.
    /// It infers nothing from absence beyond listing candidates; freeing is a separate,
    /// generation-checked release of each orphan.
    pub fn audit(&self, expected: &BTreeSet<ConsumerId>, snapshot: Generation) -> AuditReport {
        let mut report = AuditReport {
            strays: self.strays(),
            ..AuditReport::default()
        };
        for r in self.records.values() {
            let Some(claim) = &r.claim else { continue };
            if !r.present {
                report.lost.push(r.clone());
                continue;
            }
            if expected.contains(&claim.owner.consumer) {
                continue;
            }
            if r.generation > snapshot {
                report.changed.push(r.clone());
            } else if r.attached.is_some() {
                report.protected.push(r.clone());
            } else {
                report.orphans.push(r.clone());
            }
        }
        report
    }
}

#[cfg(test)]
pub(crate) mod tests;
