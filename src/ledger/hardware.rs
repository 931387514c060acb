//! The ledger's side of acting on hardware: who may bind a device to vfio-pci or change
//! a PF's VF count, the IOMMU group a binding covers, and recording what was done.
//! The sysfs writes themselves happen outside (the writer calls `crate::hardware`).

use std::sync::{Arc, Weak};

use super::{
    BoundMember, ChangeSet, DeviceRecord, Ledger, LedgerError, Link, Outcome, RequestEntry, Tx,
    VfioBinding,
};
use crate::pci::{ConsumerId, Generation, PciAddress, RequestId};

/// What a release gives back of its claim's binding ([`Ledger::restore_plan`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestorePlan {
    /// The members to give their drivers back to.
    pub restore: Vec<BoundMember>,
    /// The members left as they are, and why.
    pub left: Vec<(PciAddress, &'static str)>,
}

/// What binding a claimed device to vfio-pci covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindPlan {
    /// The claimed device and every present member of its IOMMU group, sorted.
    pub members: Vec<PciAddress>,
    /// The binding recorded by an earlier call, if any (a retry keeps its originals).
    pub existing: Option<VfioBinding>,
}

/// How a retry of a binding that the request log holds is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BindRetry {
    /// The claim it bound stands on the present device, still its owner's: the claim's
    /// generation now, and the binding recorded on it (to be carried out again where a
    /// member is off vfio-pci, as when a sysfs step failed after it was recorded).
    Standing {
        generation: Generation,
        binding: VfioBinding,
    },
    /// The claim has ended since (released, moved to another owner, or its device gone):
    /// the first answer's generation, and nothing to bind.
    Ended { generation: Generation },
}

/// A VF count change under way, by its PF: whether whoever carries it out still holds it
/// (the change's token, see [`Ledger::vf_change_began`]).
#[derive(Debug, Clone)]
pub(crate) struct Changing {
    alive: Weak<()>,
    /// The request id the change was asked with: until it is recorded, that request is
    /// in flight, neither applied nor refused.
    request: Option<(ConsumerId, RequestId)>,
}

impl Changing {
    fn holds(&self) -> bool {
        self.alive.strong_count() > 0
    }
}

impl PartialEq for Changing {
    fn eq(&self, other: &Changing) -> bool {
        self.alive.ptr_eq(&other.alive)
    }
}

impl Eq for Changing {}

impl Ledger {
    /// Checks that `consumer` may bind `address` (its present, unattached claim, named by
    /// the current generation) and lists the IOMMU group members the binding covers.
    pub fn bind_plan(
        &self,
        address: PciAddress,
        consumer: ConsumerId,
        generation: Generation,
    ) -> Result<BindPlan, LedgerError> {
        let id = self.resolve_claimed(address, consumer, generation)?;
        let rec = &self.records[&id];
        let claim = rec.claim.as_ref().ok_or(LedgerError::NotClaimed {
            address,
            generation: rec.generation,
        })?;
        if !rec.present {
            return Err(LedgerError::Lost {
                address,
                owner: claim.owner.clone(),
                generation: rec.generation,
            });
        }
        if let Some(domain) = &rec.attached {
            return Err(LedgerError::Attached {
                address,
                domain: domain.clone(),
                generation: rec.generation,
            });
        }
        // A PF claimed before a domain started using one of its VFs: binding it would
        // take it from its driver, destroying that VF under the domain.
        if let Some((vf, domain)) = self.vf_in_use(address) {
            return Err(LedgerError::VfInUseByDomain {
                pf: address,
                vf,
                domain,
                generation: rec.generation,
            });
        }
        let group = rec.facts.iommu_group.ok_or(LedgerError::NoIommuGroup {
            address,
            generation: rec.generation,
        })?;
        let mut members = Vec::new();
        for r in self
            .linked(Link::Group(group))
            .filter_map(|id| self.records.get(&id))
            .filter(|r| r.present)
        {
            // A member whose PF's VF count is being written may be destroyed under the
            // binding.
            self.check_not_changing(r)?;
            // Another member that a domain uses (or, for a PF, one of whose VFs a domain
            // uses): moving it to vfio-pci takes it from under that domain.
            if r.address() != address {
                let used = self
                    .refs
                    .get(&r.address())
                    .and_then(|d| d.first())
                    .map(|d| (r.address(), d.clone()))
                    .or_else(|| self.vf_in_use(r.address()));
                if let Some((used, domain)) = used {
                    return Err(LedgerError::GroupMemberInUse {
                        address,
                        member: r.address(),
                        used,
                        domain,
                        generation: rec.generation,
                    });
                }
            }
            members.push(r.address());
        }
        members.sort();
        Ok(BindPlan {
            members,
            existing: claim.vfio.clone(),
        })
    }

    /// Records the binding on the claim at `address` (checked again as in
    /// [`Ledger::bind_plan`]), with the next generation; with `logged`, also logs it
    /// under that request id at that time (seconds since the Unix epoch), in the same
    /// change set. A request id the log holds already is refused: a retry is answered by
    /// [`Ledger::bind_retry`] before it gets here.
    pub fn record_binding(
        &mut self,
        address: PciAddress,
        consumer: ConsumerId,
        generation: Generation,
        members: Vec<BoundMember>,
        logged: Option<(&RequestId, u64)>,
    ) -> Result<(Generation, ChangeSet), LedgerError> {
        if let Some((request_id, _)) = logged {
            if let Some(entry) = self.request(consumer, request_id) {
                return Err(LedgerError::RequestIdReused {
                    consumer,
                    request_id: request_id.clone(),
                    previous: entry.outcome,
                });
            }
        }
        self.bind_plan(address, consumer, generation)?;
        let id = self.resolve_claimed(address, consumer, generation)?;
        let mut tx = Tx::new(self.host_generation);
        let g = self.modify(&mut tx, id, |r| {
            if let Some(c) = r.claim.as_mut() {
                c.vfio = Some(VfioBinding { members });
            }
        });
        if let Some((request_id, now)) = logged {
            let outcome = Outcome::Bound {
                address,
                record: id,
                generation: g,
            };
            self.log_request(&mut tx, consumer, request_id, &outcome, now);
        }
        Ok((g, tx.cs))
    }

    /// The record whose claim a logged binding bound, while that claim stands: the same
    /// owner's, and the same claim (made before the binding; a claim released and made
    /// again by the owner is another). `None` for another outcome.
    pub fn binding_standing(
        &self,
        outcome: &Outcome,
        consumer: ConsumerId,
    ) -> Option<&DeviceRecord> {
        let Outcome::Bound {
            record, generation, ..
        } = outcome
        else {
            return None;
        };
        self.records.get(record).filter(|r| {
            r.claim.as_ref().is_some_and(|c| {
                c.owner.consumer == consumer && c.since.is_none_or(|since| since < *generation)
            })
        })
    }

    /// What a binding request with a request id the log holds is answered (`None`: the
    /// log does not hold it, and it is a new request). A request id logged for another
    /// operation, or for a binding at another address, is refused. Changes nothing.
    pub fn bind_retry(
        &self,
        address: PciAddress,
        consumer: ConsumerId,
        request_id: &RequestId,
    ) -> Result<Option<BindRetry>, LedgerError> {
        let Some(entry) = self.request(consumer, request_id) else {
            return Ok(None);
        };
        let generation = match &entry.outcome {
            Outcome::Bound {
                address: bound_at,
                generation,
                ..
            } if *bound_at == address => *generation,
            previous => {
                return Err(LedgerError::RequestIdReused {
                    consumer,
                    request_id: request_id.clone(),
                    previous: previous.clone(),
                })
            }
        };
        let standing = self
            .binding_standing(&entry.outcome, consumer)
            .filter(|r| r.present)
            .and_then(|r| {
                let binding = r.claim.as_ref()?.vfio.clone()?;
                Some((r.generation, binding))
            });
        Ok(Some(match standing {
            Some((generation, binding)) => BindRetry::Standing {
                generation,
                binding,
            },
            None => BindRetry::Ended { generation },
        }))
    }

    /// The binding to give back when the claim at `address` is released by `consumer`
    /// with `generation`; `None` when there is none or the release would be refused (the
    /// release itself then gives the reason).
    pub fn binding_to_restore(
        &self,
        address: PciAddress,
        consumer: ConsumerId,
        generation: Generation,
    ) -> Option<VfioBinding> {
        self.restorable(address, consumer, generation)
            .map(|(_, binding)| binding.clone())
    }

    /// The claim's record and its binding, for [`Self::binding_to_restore`].
    fn restorable(
        &self,
        address: PciAddress,
        consumer: ConsumerId,
        generation: Generation,
    ) -> Option<(&DeviceRecord, &VfioBinding)> {
        let id = self.resolve_claimed(address, consumer, generation).ok()?;
        let rec = &self.records[&id];
        if !rec.present || rec.attached.is_some() {
            return None;
        }
        Some((rec, rec.claim.as_ref()?.vfio.as_ref()?))
    }

    /// What a release of the claim at `address` by `consumer` with `generation` gives
    /// back of its binding: `None` when there is none or the release would be refused
    /// (the release itself then gives the reason). Refused where giving a member its
    /// driver back takes a device from under a domain that holds no claim on it: the
    /// member itself (a stray on it, on vfio-pci), or a VF of it (unbinding vfio-pci from
    /// a PF turns SR-IOV off). A member that is no longer the bound device's to give
    /// back is left as it is: gone, another device at its address, claimed by another
    /// record, or out of the device's IOMMU group now (groups can change at a reboot).
    pub fn restore_plan(
        &self,
        address: PciAddress,
        consumer: ConsumerId,
        generation: Generation,
    ) -> Result<Option<RestorePlan>, LedgerError> {
        let Some((rec, binding)) = self.restorable(address, consumer, generation) else {
            return Ok(None);
        };
        let mut plan = RestorePlan::default();
        for m in &binding.members {
            let Some(now) = self.record_at(m.address).filter(|r| r.present) else {
                plan.left.push((m.address, "it is gone"));
                continue;
            };
            if now.id != rec.id {
                let why = m
                    .identity
                    .as_ref()
                    .and_then(|i| i.other_device(now))
                    .or_else(|| now.claim.is_some().then_some("another claim holds it"))
                    .or_else(|| {
                        (now.facts.iommu_group != rec.facts.iommu_group)
                            .then_some("it is no longer in the device's IOMMU group")
                    });
                if let Some(why) = why {
                    plan.left.push((m.address, why));
                    continue;
                }
                if let Some(domain) = self.refs.get(&m.address).and_then(|d| d.first()) {
                    return Err(LedgerError::BindingMemberInUse {
                        address,
                        member: m.address,
                        used: m.address,
                        domain: domain.clone(),
                        generation: rec.generation,
                    });
                }
            }
            if let Some((vf, domain)) = self.vf_in_use(m.address) {
                return Err(LedgerError::BindingMemberInUse {
                    address,
                    member: m.address,
                    used: vf,
                    domain,
                    generation: rec.generation,
                });
            }
            plan.restore.push(m.clone());
        }
        Ok(Some(plan))
    }

    /// Whether `address` holds a recorded VFIO binding (any owner, any generation).
    pub fn has_binding(&self, address: PciAddress) -> bool {
        self.record_at(address)
            .and_then(|r| r.claim.as_ref())
            .is_some_and(|c| c.vfio.is_some())
    }

    /// Checks that the VF count of `pf` may change: it is a present SR-IOV PF with the
    /// presented generation, unclaimed, none of its VFs (present or lost) is claimed, and
    /// no domain uses the PF or a VF without a claim (writing the count destroys every
    /// VF, under the VM using it: I3). Returns its VFs now present.
    pub fn check_vf_change(
        &self,
        pf: PciAddress,
        generation: Generation,
    ) -> Result<Vec<PciAddress>, LedgerError> {
        let rec = self
            .record_at(pf)
            .ok_or(LedgerError::UnknownDevice { address: pf })?;
        if rec.generation != generation {
            return Err(LedgerError::StaleGeneration {
                address: pf,
                presented: generation,
                current: rec.generation,
                owner: rec.claim.as_ref().map(|c| c.owner.clone()),
            });
        }
        if !rec.facts.is_pf {
            return Err(LedgerError::NotPhysicalFunction {
                address: pf,
                generation,
            });
        }
        self.check_not_changing(rec)?;
        // A lost claim at the PF's address counts too (an earlier instance of the PF that
        // vanished and came back): its owner may still believe it holds the PF and its
        // VFs, as their states say.
        if let Some(c) = self.records_at(pf).find_map(|r| r.claim.as_ref()) {
            return Err(LedgerError::AlreadyClaimed {
                address: pf,
                owner: c.owner.clone(),
                generation,
            });
        }
        let mut vfs = Vec::new();
        for r in self
            .linked(Link::VfOf(pf))
            .filter_map(|id| self.records.get(&id))
        {
            if let Some(c) = &r.claim {
                return Err(LedgerError::VfClaimed {
                    pf,
                    vf: r.address(),
                    owner: c.owner.clone(),
                    generation,
                });
            }
            if r.present {
                vfs.push(r.address());
            }
        }
        vfs.sort();
        // A claim of another device in a VF's IOMMU group (none of the PF's own VFs, which
        // were refused above): its VFIO binding covers the VF, or will, and the change
        // would destroy the VF under it.
        for vf in vfs.iter().filter_map(|a| self.record_at(*a)) {
            let Some(group) = vf.facts.iommu_group else {
                continue;
            };
            let claimed = self
                .linked(Link::Group(group))
                .filter_map(|id| self.records.get(&id))
                .filter(|o| o.present)
                .find_map(|o| Some((o.address(), o.claim.as_ref()?)));
            if let Some((claimed, c)) = claimed {
                return Err(LedgerError::VfGroupClaimed {
                    pf,
                    vf: vf.address(),
                    claimed,
                    owner: c.owner.clone(),
                    generation,
                });
            }
        }
        for device in std::iter::once(pf).chain(vfs.iter().copied()) {
            if let Some(domain) = self.refs.get(&device).and_then(|d| d.first()) {
                return Err(LedgerError::VfCountInUse {
                    pf,
                    device,
                    domain: domain.clone(),
                    generation,
                });
            }
        }
        Ok(vfs)
    }

    /// Refuses a PF whose VF count is being written, and any VF of it: those it had and
    /// any a rescan finds meanwhile (the kernel creates them one by one, and may destroy
    /// them again if the write fails part way).
    pub(crate) fn check_not_changing(&self, rec: &DeviceRecord) -> Result<(), LedgerError> {
        if self.changing.is_empty() {
            return Ok(());
        }
        let held = |pf: PciAddress| self.changing.get(&pf).is_some_and(Changing::holds);
        let pf = std::iter::once(rec.address())
            .chain(rec.facts.physfn)
            .find(|a| held(*a));
        match pf {
            Some(pf) => Err(LedgerError::VfCountChanging {
                address: rec.address(),
                pf,
                generation: rec.generation,
            }),
            None => Ok(()),
        }
    }

    /// A VF count change of `pf` begins (after [`Self::check_vf_change`]): until
    /// [`Self::vf_change_ended`], or until every strong reference to the change's token
    /// (`alive`) is dropped (its task ended without an answer), no claim takes the PF or
    /// a VF of it, no binding covers one, and no other change of the PF's count begins.
    /// Changes no record: the writer decides other requests meanwhile, on the host's other
    /// devices.
    pub fn vf_change_began(
        &mut self,
        pf: PciAddress,
        alive: Weak<()>,
        request: Option<(ConsumerId, RequestId)>,
    ) {
        let changing = Arc::make_mut(&mut self.changing);
        changing.retain(|_, c| c.holds());
        changing.insert(pf, Changing { alive, request });
    }

    /// The PF whose VF count change, asked with this request id, is still held (its
    /// writes under way, or not yet recorded): the request is neither applied nor
    /// refused yet, so nobody may be told it never will be.
    pub fn vf_change_in_flight(
        &self,
        consumer: ConsumerId,
        request_id: &RequestId,
    ) -> Option<PciAddress> {
        self.changing.iter().find_map(|(pf, c)| {
            let (c_consumer, c_id) = c.request.as_ref()?;
            (c.holds() && *c_consumer == consumer && c_id == request_id).then_some(*pf)
        })
    }

    /// The change of `pf`'s VF count is over (written, failed or given up): its devices
    /// are no longer held back.
    pub fn vf_change_ended(&mut self, pf: PciAddress) {
        if self.changing.contains_key(&pf) {
            Arc::make_mut(&mut self.changing).remove(&pf);
        }
    }

    /// After a PF's VF count was written (or a write was tried and failed part way): the
    /// PF takes the next generation, so a second writer holding the old one is refused,
    /// and each of `vfs` (its VFs that were present, as [`Self::check_vf_change`] listed
    /// them) is gone when `destroyed`. The kernel removes every VF before it creates the
    /// new count, so a VF at one of these addresses afterwards is a new device instance
    /// (I6), found by the rescan that follows; until then a claim presenting the old VF's
    /// generation finds no device. Only VFs that are not claimed may be listed (a claimed
    /// one would be kept, lost).
    ///
    /// With `logged` (a change written in full, asked for with a request id), the change
    /// is also logged under that request id, in the same change set, unless the log
    /// holds the id already (used meanwhile for another request: that one keeps it).
    pub fn vf_count_written(
        &mut self,
        pf: PciAddress,
        vfs: &[PciAddress],
        destroyed: bool,
        logged: Option<VfCountLog<'_>>,
    ) -> ChangeSet {
        let mut tx = Tx::new(self.host_generation);
        if destroyed {
            for vf in vfs {
                self.vanish(&mut tx, *vf);
            }
        }
        // Last, so that the PF's new generation is the change's.
        if let Some(id) = self.present.get(&pf).copied() {
            self.modify(&mut tx, id, |_| {});
        }
        if let Some(l) = logged.filter(|l| self.request(l.consumer, l.request_id).is_none()) {
            let outcome = Outcome::VfCountSet {
                address: pf,
                generation: tx.cs.host_generation,
                count: l.count,
                before: l.before,
            };
            self.log_request(&mut tx, l.consumer, l.request_id, &outcome, l.at);
        }
        tx.cs
    }

    /// How a VF count change with a request id the log holds is answered (`None`: the
    /// log does not hold it, and it is a new request); see [`vf_count_replay`]. Changes
    /// nothing.
    pub fn vf_count_retry(
        &self,
        pf: PciAddress,
        count: u32,
        consumer: ConsumerId,
        request_id: &RequestId,
    ) -> Result<Option<VfCountReplay>, LedgerError> {
        self.request(consumer, request_id)
            .map(|entry| vf_count_replay(&entry, pf, count))
            .transpose()
    }
}

/// What a VF count change logs with its request id.
#[derive(Debug, Clone, Copy)]
pub struct VfCountLog<'a> {
    pub consumer: ConsumerId,
    pub request_id: &'a RequestId,
    /// The count written.
    pub count: u32,
    /// The count before.
    pub before: u32,
    /// Seconds since the Unix epoch.
    pub at: u64,
}

/// The first answer of a VF count change, replayed to a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VfCountReplay {
    /// The generation the change gave the PF.
    pub generation: Generation,
    /// The count before the change.
    pub before: u32,
}

/// A retry of a VF count change answered from its logged entry: the same PF and count
/// replay it, anything else under that request id is refused (`RequestIdReused`).
pub fn vf_count_replay(
    entry: &RequestEntry,
    pf: PciAddress,
    count: u32,
) -> Result<VfCountReplay, LedgerError> {
    match entry.outcome {
        Outcome::VfCountSet {
            address,
            generation,
            count: written,
            before,
        } if address == pf && written == count => Ok(VfCountReplay { generation, before }),
        _ => Err(LedgerError::RequestIdReused {
            consumer: entry.consumer,
            request_id: entry.request_id.clone(),
            previous: entry.outcome.clone(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{addr, domain, ledger, owner, rid};
    use super::*;
    use crate::ledger::{ClaimRequest, ClaimTarget, ReleaseRequest};

    fn claim(l: &mut Ledger, a: &str, who: u128) -> Generation {
        let g = l.record_at(addr(a)).expect("present").generation;
        let (o, _) = l
            .claim(
                &ClaimRequest {
                    target: ClaimTarget::Address {
                        address: addr(a),
                        expected_generation: g,
                    },
                    owner: owner(who),
                    request_id: rid(&format!("c-{a}")),
                },
                1,
            )
            .expect("claim");
        o.generation()
    }

    #[test]
    fn a_binding_covers_the_iommu_group_and_is_checked_like_a_release() {
        let mut l = ledger();
        let g = claim(&mut l, "0000:5e:00.0", 1);
        let plan = l
            .bind_plan(addr("0000:5e:00.0"), owner(1).consumer, g)
            .expect("plan");
        assert_eq!(
            plan.members,
            vec![addr("0000:5e:00.0"), addr("0000:5e:00.1")]
        );
        let before = l.clone();
        assert!(matches!(
            l.record_binding(addr("0000:5e:00.0"), owner(2).consumer, g, vec![], None),
            Err(LedgerError::WrongOwner { .. })
        ));
        assert!(matches!(
            l.record_binding(
                addr("0000:5e:00.0"),
                owner(1).consumer,
                Generation(g.0 - 1),
                vec![],
                None
            ),
            Err(LedgerError::StaleGeneration { .. })
        ));
        assert_eq!(l, before, "refusals change nothing");
        let members = vec![BoundMember {
            address: addr("0000:5e:00.0"),
            original_driver: Some("iavf".into()),
            original_override: None,
            identity: None,
        }];
        let (g2, cs) = l
            .record_binding(
                addr("0000:5e:00.0"),
                owner(1).consumer,
                g,
                members.clone(),
                None,
            )
            .expect("recorded");
        assert!(g2 > g);
        assert_eq!(cs.upserts.len(), 1);
        assert!(l.has_binding(addr("0000:5e:00.0")));
        assert_eq!(
            l.binding_to_restore(addr("0000:5e:00.0"), owner(1).consumer, g2)
                .map(|b| b.members),
            Some(members)
        );
        // Undo (a failed commit) forgets the binding.
        l.undo(&cs);
        assert_eq!(l, before);
    }

    /// A binding logged under a request id: a retry is answered from the log and the
    /// claim as it stands, the id is refused for anything else, and once the claim has
    /// ended the retry gets the first generation and nothing to bind.
    #[test]
    fn a_logged_binding_is_retried_by_its_request_id_only() {
        let mut l = ledger();
        let a = addr("0000:5e:00.0");
        let who = owner(1).consumer;
        let g = claim(&mut l, "0000:5e:00.0", 1);
        assert_eq!(
            l.bind_retry(a, who, &rid("bind")),
            Ok(None),
            "not logged yet"
        );
        let members = vec![BoundMember {
            address: a,
            original_driver: Some("iavf".into()),
            original_override: None,
            identity: None,
        }];
        let before = l.clone();
        let (g2, cs) = l
            .record_binding(a, who, g, members.clone(), Some((&rid("bind"), 7)))
            .expect("recorded");
        assert_eq!(cs.requests.len(), 1, "logged in the binding's change set");
        assert_eq!(cs.requests[0].outcome.operation(), "bound");
        let standing = BindRetry::Standing {
            generation: g2,
            binding: VfioBinding {
                members: members.clone(),
            },
        };
        assert_eq!(l.bind_retry(a, who, &rid("bind")), Ok(Some(standing)));
        // Another owner's id of that name is another request.
        assert_eq!(l.bind_retry(a, owner(2).consumer, &rid("bind")), Ok(None));

        let after = l.clone();
        fn reused(e: Option<LedgerError>) -> bool {
            matches!(
                e,
                Some(LedgerError::RequestIdReused {
                    previous: Outcome::Bound { .. },
                    ..
                })
            )
        }
        assert!(reused(
            l.bind_retry(addr("0000:5e:00.1"), who, &rid("bind")).err()
        ));
        assert!(reused(
            l.record_binding(a, who, g2, members.clone(), Some((&rid("bind"), 8)))
                .err()
        ));
        let release = |id: &str, generation| ReleaseRequest {
            address: a,
            consumer: who,
            request_id: rid(id),
            generation,
        };
        assert!(reused(l.release(&release("bind", g2), 8).err()));
        assert_eq!(l, after, "refusals change nothing");

        let (freed, _) = l.release(&release("r", g2), 9).expect("release");
        assert!(freed.generation() > g2);
        assert_eq!(
            l.bind_retry(a, who, &rid("bind")),
            Ok(Some(BindRetry::Ended { generation: g2 }))
        );
        // The same owner claims the device again (the same record) and binds it under
        // another id: the first binding's claim is still over, and its retry says so,
        // neither answering with the new claim nor binding anything for it. Before, it was
        // answered as standing, and could record the binding again.
        let (claimed, _) = l
            .claim(
                &ClaimRequest {
                    target: ClaimTarget::Address {
                        address: a,
                        expected_generation: freed.generation(),
                    },
                    owner: owner(1),
                    request_id: rid("again"),
                },
                10,
            )
            .expect("claim again");
        let (g5, _) = l
            .record_binding(
                a,
                who,
                claimed.generation(),
                members.clone(),
                Some((&rid("bind-2"), 11)),
            )
            .expect("bound again");
        assert_eq!(
            l.bind_retry(a, who, &rid("bind")),
            Ok(Some(BindRetry::Ended { generation: g2 }))
        );
        assert!(matches!(
            l.bind_retry(a, who, &rid("bind-2")),
            Ok(Some(BindRetry::Standing { generation, .. })) if generation == g5
        ));
        // Undo of the binding's change set takes its log entry back too.
        let mut undone = after;
        undone.undo(&cs);
        assert_eq!(undone, before);
        assert_eq!(undone.bind_retry(a, who, &rid("bind")), Ok(None));
    }

    #[test]
    fn vf_count_changes_need_the_pf_generation_and_no_claimed_vf() {
        let mut l = ledger();
        let pf = addr("0000:3b:00.0");
        let g = l.record_at(pf).expect("pf").generation;
        assert_eq!(l.check_vf_change(pf, g).expect("free").len(), 4);
        assert!(matches!(
            l.check_vf_change(
                addr("0000:5e:00.0"),
                l.record_at(addr("0000:5e:00.0")).expect("d").generation
            ),
            Err(LedgerError::NotPhysicalFunction { .. })
        ));
        let vg = claim(&mut l, "0000:3b:02.1", 3);
        let err = l.check_vf_change(pf, g).expect_err("claimed VF");
        assert!(matches!(err, LedgerError::VfClaimed { vf, .. } if vf == addr("0000:3b:02.1")));
        l.release(
            &ReleaseRequest {
                address: addr("0000:3b:02.1"),
                consumer: owner(3).consumer,
                request_id: rid("r"),
                generation: vg,
            },
            2,
        )
        .expect("release");
        l.check_vf_change(pf, g).expect("free again");
        let cs = l.vf_count_written(pf, &[], false, None);
        assert!(matches!(
            l.check_vf_change(pf, g),
            Err(LedgerError::StaleGeneration { .. })
        ));
        l.check_vf_change(pf, cs.host_generation)
            .expect("new generation");
    }

    fn claim_of(a: &str, g: Generation, who: u128, req: &str) -> ClaimRequest {
        ClaimRequest {
            target: ClaimTarget::Address {
                address: addr(a),
                expected_generation: g,
            },
            owner: owner(who),
            request_id: rid(req),
        }
    }

    #[test]
    fn a_pf_whose_vf_count_is_being_written_and_its_vfs_are_held_back_until_it_ends() {
        let mut l = ledger();
        let pf = addr("0000:3b:00.0");
        let g = l.record_at(pf).expect("pf").generation;
        let vfs = l.check_vf_change(pf, g).expect("free");
        let token = std::sync::Arc::new(());
        l.vf_change_began(pf, std::sync::Arc::downgrade(&token), None);
        let before = l.clone();
        let vg = l.record_at(vfs[1]).expect("vf").generation;
        let err = l
            .claim(&claim_of("0000:3b:02.1", vg, 1, "c1"), 2)
            .expect_err("a VF of a PF being changed");
        assert!(
            matches!(err, LedgerError::VfCountChanging { address, pf: p, .. } if address == vfs[1] && p == pf),
            "{err:?}"
        );
        assert_eq!(err.reason(), "VF_COUNT_CHANGING");
        l.claim(&claim_of("0000:3b:00.0", g, 1, "c2"), 2)
            .expect_err("the PF itself");
        // A VF the kernel creates meanwhile, found by a rescan at a new address, is held
        // back too (the write may yet fail and the kernel destroy it again).
        let mut probe = l.clone();
        let new_vf = super::super::tests::facts("0000:3b:02.4", Some(24), Some("0000:3b:00.0"));
        probe.apply_devices(vec![(new_vf.address, Some(new_vf))]);
        let ng = probe
            .record_at(addr("0000:3b:02.4"))
            .expect("new VF")
            .generation;
        let err = probe
            .claim(&claim_of("0000:3b:02.4", ng, 1, "c-new"), 2)
            .expect_err("a VF found while its PF changes");
        assert!(
            matches!(err, LedgerError::VfCountChanging { pf: p, .. } if p == pf),
            "{err:?}"
        );
        assert!(matches!(
            l.check_vf_change(pf, g),
            Err(LedgerError::VfCountChanging { .. })
        ));
        // A selector passes over them; the host's other devices are claimed as ever.
        let any = |n: &str| ClaimRequest {
            target: ClaimTarget::Selector(crate::ledger::Selector::default()),
            owner: owner(2),
            request_id: rid(n),
        };
        let (o, _) = l.claim(&any("s1"), 2).expect("another device");
        assert_eq!(o.address(), addr("0000:5e:00.0"));
        // Its group's other function is blocked by it: the PF and its VFs are all that
        // is left, and the selector takes none of them.
        let mut refused = l.clone();
        let err = refused
            .claim(&any("s2"), 2)
            .expect_err("nothing left but the held devices");
        assert!(matches!(err, LedgerError::NoMatch { .. }), "{err:?}");
        // Refusals change nothing; the change's end lets them go.
        let mut l2 = before.clone();
        l2.claim(&claim_of("0000:3b:02.1", vg, 1, "c1"), 2)
            .expect_err("held");
        assert_eq!(l2, before);
        l.vf_change_ended(pf);
        l.claim(&claim_of("0000:3b:02.1", vg, 1, "c3"), 3)
            .expect("claimable once the change ended");
        // A change whose token is dropped unanswered (its task gone) holds nothing.
        let mut l = before;
        drop(token);
        l.claim(&claim_of("0000:3b:02.1", vg, 1, "c4"), 3)
            .expect("claimable once the change is gone");
    }

    #[test]
    fn a_lost_claim_of_the_pf_refuses_a_vf_count_change() {
        let mut l = ledger();
        let pf = addr("0000:3b:00.0");
        claim(&mut l, "0000:3b:00.0", 1);
        // The PF vanishes and comes back: its claim stays, lost, and a new instance is
        // present at the address.
        let inventory = super::super::tests::host();
        l.apply_inventory(inventory[1..].to_vec());
        l.apply_inventory(inventory);
        let g = l.record_at(pf).expect("present again").generation;
        assert!(l.record_at(pf).is_some_and(|r| r.claim.is_none()));
        let err = l
            .check_vf_change(pf, g)
            .expect_err("a lost claim of the PF");
        assert!(
            matches!(&err, LedgerError::AlreadyClaimed { address, owner: o, .. } if *address == pf && *o == owner(1)),
            "{err:?}"
        );
    }

    /// The test host with 0000:5e:00.0 in the IOMMU group of the PF's first VF,
    /// 0000:3b:02.0 (no ACS between them).
    fn five_e_in_the_first_vfs_group() -> Ledger {
        let mut inventory = super::super::tests::host();
        for f in &mut inventory {
            if f.address == addr("0000:5e:00.0") {
                f.iommu_group = Some(20);
            }
        }
        let mut l = Ledger::new();
        l.apply_inventory(inventory);
        l
    }

    #[test]
    fn a_binding_that_covers_a_vf_whose_pf_is_changing_is_refused() {
        // Binding 0000:5e:00.0 would take the PF's first VF too, which the change may
        // destroy.
        let mut l = five_e_in_the_first_vfs_group();
        let vf = addr("0000:3b:02.0");
        let pf = addr("0000:3b:00.0");
        l.check_vf_change(pf, l.record_at(pf).expect("pf").generation)
            .expect("nothing claimed");
        let token = std::sync::Arc::new(());
        l.vf_change_began(pf, std::sync::Arc::downgrade(&token), None);
        // The device itself is claimed meanwhile (it is no VF of the PF).
        let g = claim(&mut l, "0000:5e:00.0", 1);
        let err = l
            .bind_plan(addr("0000:5e:00.0"), owner(1).consumer, g)
            .expect_err("a member is held back");
        assert!(
            matches!(err, LedgerError::VfCountChanging { address, .. } if address == vf),
            "{err:?}"
        );
        l.vf_change_ended(pf);
        let plan = l
            .bind_plan(addr("0000:5e:00.0"), owner(1).consumer, g)
            .expect("once the change ended");
        assert!(plan.members.contains(&vf));
    }

    /// The reverse: a claim of a device that shares its IOMMU group with a VF (its
    /// binding takes that VF along) refuses the PF's VF count change, which would
    /// destroy the VF under it; once released, the change may go on.
    #[test]
    fn a_vf_count_change_is_refused_while_a_claim_in_a_vfs_group_stands() {
        let mut l = five_e_in_the_first_vfs_group();
        let g = claim(&mut l, "0000:5e:00.0", 1);
        let pf = addr("0000:3b:00.0");
        let pf_g = l.record_at(pf).expect("pf").generation;
        let err = l
            .check_vf_change(pf, pf_g)
            .expect_err("a VF's group is claimed");
        assert!(
            matches!(&err, LedgerError::VfGroupClaimed { vf, claimed, owner: o, .. }
                if *vf == addr("0000:3b:02.0") && *claimed == addr("0000:5e:00.0") && *o == owner(1)),
            "{err:?}"
        );
        l.release(
            &ReleaseRequest {
                address: addr("0000:5e:00.0"),
                consumer: owner(1).consumer,
                request_id: rid("r"),
                generation: g,
            },
            2,
        )
        .expect("release");
        l.check_vf_change(pf, pf_g).expect("nothing claimed now");
    }

    /// A binding moves every member of the device's IOMMU group to vfio-pci: a member that
    /// a domain uses without a claim would be taken from under it, so the binding is
    /// refused, naming the member and the domain; once the domain no longer uses it,
    /// the binding covers both.
    #[test]
    fn a_binding_that_takes_a_group_member_a_domain_uses_is_refused() {
        let mut l = ledger();
        l.apply_domains(vec![super::super::tests::domain(
            9,
            "vm9",
            &["0000:5e:00.1"],
        )]);
        let g = claim(&mut l, "0000:5e:00.0", 1);
        let err = l
            .bind_plan(addr("0000:5e:00.0"), owner(1).consumer, g)
            .expect_err("the neighbour is in use");
        assert!(
            matches!(&err, LedgerError::GroupMemberInUse { member, used, domain, .. }
                if *member == addr("0000:5e:00.1") && *used == *member && domain.name == "vm9"),
            "{err:?}"
        );
        l.apply_domains(Vec::new());
        let g = l
            .record_at(addr("0000:5e:00.0"))
            .expect("present")
            .generation;
        let plan = l
            .bind_plan(addr("0000:5e:00.0"), owner(1).consumer, g)
            .expect("nobody uses the neighbour now");
        assert_eq!(
            plan.members,
            vec![addr("0000:5e:00.0"), addr("0000:5e:00.1")]
        );
    }

    /// Records a binding of `members` for `who`'s claim at `a`, each with the identity of
    /// the device at its address now; the claim's generation after.
    fn bind(l: &mut Ledger, a: &str, who: u128, members: &[&str]) -> Generation {
        let g = l.record_at(addr(a)).expect("present").generation;
        let members = members
            .iter()
            .map(|m| BoundMember {
                address: addr(m),
                original_driver: Some("iavf".into()),
                original_override: None,
                identity: l.record_at(addr(m)).map(crate::ledger::MemberIdentity::of),
            })
            .collect();
        l.record_binding(addr(a), owner(who).consumer, g, members, None)
            .expect("recorded")
            .0
    }

    fn restoring(l: &Ledger, a: &str, who: u128) -> Result<Option<RestorePlan>, LedgerError> {
        let g = l.record_at(addr(a)).expect("present").generation;
        l.restore_plan(addr(a), owner(who).consumer, g)
    }

    /// Giving a bound PF its driver back unbinds vfio-pci from it, which turns SR-IOV off:
    /// while a domain uses one of its VFs without a claim, the release is refused, naming
    /// the VF and the domain; once it does not, the PF is given back.
    #[test]
    fn a_release_that_would_destroy_a_vf_a_domain_uses_is_refused() {
        let mut l = ledger();
        let pf = "0000:3b:00.0";
        claim(&mut l, pf, 1);
        bind(&mut l, pf, 1, &[pf]);
        l.apply_domains(vec![super::super::tests::domain(
            9,
            "vm9",
            &["0000:3b:02.1"],
        )]);
        let err = restoring(&l, pf, 1).expect_err("its VF is a domain's");
        assert!(
            matches!(&err, LedgerError::BindingMemberInUse { member, used, domain, .. }
                if *member == addr(pf) && *used == addr("0000:3b:02.1") && domain.name == "vm9"),
            "{err:?}"
        );
        assert_eq!(err.reason(), "BINDING_MEMBER_IN_USE_BY_DOMAIN");
        l.apply_domains(Vec::new());
        let plan = restoring(&l, pf, 1)
            .expect("nobody uses a VF")
            .expect("bound");
        assert_eq!(
            plan.restore.iter().map(|m| m.address).collect::<Vec<_>>(),
            vec![addr(pf)]
        );
    }

    /// A release gives a member its driver back only while it is still the binding's: a
    /// member a domain uses without a claim refuses the release; one that left the
    /// device's IOMMU group (groups can change at a reboot), one another claim holds, and
    /// another device at the member's address are left as they are.
    #[test]
    fn a_release_gives_back_only_what_is_still_the_bindings() {
        let (x, m) = ("0000:5e:00.0", "0000:5e:00.1");
        let mut l = ledger();
        claim(&mut l, x, 1);
        bind(&mut l, x, 1, &[x, m]);
        let addrs = |p: &RestorePlan| {
            (
                p.restore.iter().map(|m| m.address).collect::<Vec<_>>(),
                p.left.iter().map(|(a, why)| (*a, *why)).collect::<Vec<_>>(),
            )
        };
        let plan = restoring(&l, x, 1).expect("plan").expect("bound");
        assert_eq!(addrs(&plan), (vec![addr(x), addr(m)], vec![]));
        // A domain took the member (on vfio-pci) without a claim.
        l.apply_domains(vec![super::super::tests::domain(9, "vm9", &[m])]);
        let err = restoring(&l, x, 1).expect_err("the member is a domain's");
        assert!(
            matches!(&err, LedgerError::BindingMemberInUse { member, used, .. }
                if *member == addr(m) && *used == addr(m)),
            "{err:?}"
        );
        l.apply_domains(Vec::new());
        // The member in a group of its own now.
        let mut host = super::super::tests::host();
        host[6].iommu_group = Some(31);
        l.apply_inventory(host.clone());
        let plan = restoring(&l, x, 1).expect("plan").expect("bound");
        assert_eq!(
            addrs(&plan),
            (
                vec![addr(x)],
                vec![(addr(m), "it is no longer in the device's IOMMU group")]
            )
        );
        // Claimed by another consumer.
        claim(&mut l, m, 2);
        let plan = restoring(&l, x, 1).expect("plan").expect("bound");
        assert_eq!(addrs(&plan).1, vec![(addr(m), "another claim holds it")]);
        // Another device at the member's address, back in the group.
        l.apply_devices(vec![(addr(m), None)]);
        host[6].iommu_group = Some(30);
        l.apply_devices(vec![(addr(m), Some(host[6].clone()))]);
        assert!(l
            .record_at(addr(m))
            .is_some_and(|r| r.present && r.claim.is_none()));
        let plan = restoring(&l, x, 1).expect("plan").expect("bound");
        assert_eq!(
            addrs(&plan).1,
            vec![(addr(m), "another device record is at its address")]
        );
    }

    #[test]
    fn a_written_vf_count_takes_the_old_vfs_away_in_the_same_change() {
        let mut l = ledger();
        let pf = addr("0000:3b:00.0");
        let g = l.record_at(pf).expect("pf").generation;
        let vfs = l.check_vf_change(pf, g).expect("free");
        let vf = addr("0000:3b:02.1");
        let old = l.record_at(vf).expect("vf").clone();
        let cs = l.vf_count_written(pf, &vfs, true, None);
        assert_eq!(cs.removals.len(), vfs.len(), "every VF gone: {cs:?}");
        assert!(vfs.iter().all(|a| l.record_at(*a).is_none()));
        assert_eq!(l.record_at(pf).expect("pf").generation, cs.host_generation);
        assert!(cs.host_generation > g);
        // A claim with the generation listed before the change finds no device.
        let err = l
            .claim(
                &ClaimRequest {
                    target: ClaimTarget::Address {
                        address: vf,
                        expected_generation: old.generation,
                    },
                    owner: owner(1),
                    request_id: rid("late"),
                },
                3,
            )
            .expect_err("the VF was destroyed");
        assert!(matches!(err, LedgerError::UnknownDevice { .. }), "{err:?}");
        // The VF the kernel creates at the same address is a new instance.
        l.apply_devices(vec![(vf, Some(old.facts.clone()))]);
        let new = l.record_at(vf).expect("new VF");
        assert!(new.id != old.id && new.generation > old.generation);
        // Undone, the change gives back the PF's generation and every VF as it was.
        let mut again = ledger();
        let before = again.clone();
        let cs = again.vf_count_written(pf, &vfs, true, None);
        again.undo(&cs);
        assert_eq!(again, before);
    }

    #[test]
    fn vf_count_changes_are_refused_while_a_domain_uses_the_pf_or_a_vf_unclaimed() {
        let mut l = ledger();
        let pf = addr("0000:3b:00.0");
        for (used, name) in [("0000:3b:02.2", "vm-vf"), ("0000:3b:00.0", "vm-pf")] {
            l.apply_domains(vec![domain(9, name, &[used])]);
            let g = l.record_at(pf).expect("pf").generation;
            let before = l.clone();
            match l.check_vf_change(pf, g) {
                Err(LedgerError::VfCountInUse {
                    pf: p,
                    device,
                    domain,
                    generation,
                }) => {
                    assert_eq!((p, device, generation), (pf, addr(used), g));
                    assert_eq!(domain.name, name);
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(l, before);
        }
        l.apply_domains(vec![domain(9, "elsewhere", &["0000:5e:00.0"])]);
        let g = l.record_at(pf).expect("pf").generation;
        assert_eq!(l.check_vf_change(pf, g).expect("unused").len(), 4);
    }
}
