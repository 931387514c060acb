//! Property tests: random sequences of claims, releases, stale retries, inventory and
//! domain changes, VF count changes (begun, recorded, abandoned) and restarts from
//! several actors, checked against a simple model and invariants I1, I2, I5, I6 and I7
//! after every step, and the audit's promise against the history.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::tests::{addr, host, owner, rid};
use super::*;

#[derive(Debug, Clone)]
enum Op {
    /// Claim device `dev`; `stale` uses the actor's remembered generation.
    Claim {
        actor: u8,
        dev: u8,
        stale: bool,
    },
    ClaimAny {
        actor: u8,
        numa: Option<u32>,
    },
    Release {
        actor: u8,
        dev: u8,
        stale: bool,
    },
    /// Repeat the actor's last request verbatim.
    Retry {
        actor: u8,
    },
    Transfer {
        actor: u8,
        to: u8,
        dev: u8,
    },
    /// Record a vfio-pci binding of device `dev`'s group, logged under a request id.
    Bind {
        actor: u8,
        dev: u8,
        stale: bool,
    },
    /// Retry the actor's last logged binding, whatever happened since.
    RetryBind {
        actor: u8,
    },
    Vanish {
        dev: u8,
    },
    Return {
        dev: u8,
    },
    /// Device `dev` is removed and made again between two scans, with no removal seen:
    /// the next scan finds another instance at its address.
    Remake {
        dev: u8,
    },
    /// A rescan finds device `dev` in another IOMMU group (a reboot renumbers groups, or
    /// the IOMMU was turned on or off): `None` for none, else one of a few groups, some
    /// shared with other devices.
    Regroup {
        dev: u8,
        group: Option<u32>,
    },
    Domains {
        actor: u8,
        devs: Vec<u8>,
    },
    NoDomains,
    /// A restart that raises the host generation to a floor this far ahead (0: none).
    Raise {
        ahead: u32,
    },
    /// A change of the PF's VF count begins (if it may): the PF and its VFs are held
    /// back until it ends.
    BeginVfChange,
    /// The change is recorded: the VFs it had are gone when `destroyed`; logged under a
    /// request id of actor 0 when `logged` (a change written in full).
    EndVfChange {
        destroyed: bool,
        logged: bool,
    },
    /// The change's task ends unanswered: its token is dropped, the change never
    /// recorded.
    AbandonVfChange,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u8..7, any::<bool>()).prop_map(|(actor, dev, stale)| Op::Claim { actor, dev, stale }),
        1 => (0u8..3, proptest::option::of(0u32..2)).prop_map(|(actor, numa)| Op::ClaimAny { actor, numa }),
        4 => (0u8..3, 0u8..7, any::<bool>()).prop_map(|(actor, dev, stale)| Op::Release { actor, dev, stale }),
        2 => (0u8..3).prop_map(|actor| Op::Retry { actor }),
        1 => (0u8..3, 0u8..3, 0u8..7).prop_map(|(actor, to, dev)| Op::Transfer { actor, to, dev }),
        2 => (0u8..3, 0u8..7, any::<bool>()).prop_map(|(actor, dev, stale)| Op::Bind { actor, dev, stale }),
        2 => (0u8..3).prop_map(|actor| Op::RetryBind { actor }),
        1 => (0u8..7).prop_map(|dev| Op::Vanish { dev }),
        1 => (0u8..7).prop_map(|dev| Op::Return { dev }),
        1 => (0u8..7).prop_map(|dev| Op::Remake { dev }),
        1 => (0u8..7, proptest::option::of(prop_oneof![Just(20u32), Just(21), Just(30), Just(99)]))
            .prop_map(|(dev, group)| Op::Regroup { dev, group }),
        1 => (0u8..3, proptest::collection::vec(0u8..7, 0..3)).prop_map(|(actor, devs)| Op::Domains { actor, devs }),
        1 => Just(Op::NoDomains),
        1 => (0u32..3).prop_map(|ahead| Op::Raise { ahead: ahead * 1000 }),
        1 => Just(Op::BeginVfChange),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(destroyed, logged)| Op::EndVfChange { destroyed, logged }),
        1 => Just(Op::AbandonVfChange),
    ]
}

#[derive(Debug, Clone)]
enum LastReq {
    Claim(ClaimRequest, Outcome),
    Release(ReleaseRequest, Outcome),
}

/// A binding logged under a request id: what it recorded.
#[derive(Debug, Clone)]
struct LoggedBind {
    address: PciAddress,
    record: RecordId,
    request_id: RequestId,
    first: Generation,
}

struct World {
    ledger: Ledger,
    inventory: Vec<DeviceFacts>,
    present: Vec<bool>,
    /// Model: record id -> owning consumer, for every live claim.
    claims: BTreeMap<RecordId, ConsumerId>,
    /// Each actor's remembered generation per device (its possibly stale view).
    seen: BTreeMap<(u8, u8), Generation>,
    last: BTreeMap<u8, LastReq>,
    /// Each actor's last logged binding.
    binds: BTreeMap<u8, LoggedBind>,
    seq: u64,
    /// A VF count change under way: its token, and the PF and the VFs it had (the
    /// addresses no claim may take meanwhile).
    changing: Option<(std::sync::Arc<()>, Vec<PciAddress>)>,
}

fn consumer(actor: u8) -> ConsumerId {
    owner(u128::from(actor) + 1).consumer
}

impl World {
    fn new() -> Self {
        // Two NUMA nodes, so that a selector's node preference has a choice to make.
        let mut inventory = host();
        for (i, f) in inventory.iter_mut().enumerate() {
            f.numa_node = Some((i % 2) as u32);
            f.instance = Some(Instance { boot: 1, ino: 1 });
        }
        let mut ledger = Ledger::new();
        ledger.apply_inventory(inventory.clone());
        World {
            present: vec![true; inventory.len()],
            inventory,
            ledger,
            claims: BTreeMap::new(),
            seen: BTreeMap::new(),
            last: BTreeMap::new(),
            binds: BTreeMap::new(),
            seq: 0,
            changing: None,
        }
    }

    /// The claimed records at these addresses, present or lost.
    fn claims_at(&self, addresses: &[PciAddress]) -> Vec<RecordId> {
        addresses
            .iter()
            .flat_map(|a| self.ledger.records_at(*a))
            .filter(|r| r.claim.is_some())
            .map(|r| r.id)
            .collect()
    }

    fn address(&self, dev: u8) -> PciAddress {
        self.inventory[usize::from(dev)].address
    }

    fn current_inventory(&self) -> Vec<DeviceFacts> {
        self.inventory
            .iter()
            .zip(&self.present)
            .filter(|(_, p)| **p)
            .map(|(f, _)| f.clone())
            .collect()
    }

    fn next_rid(&mut self) -> RequestId {
        self.seq += 1;
        rid(&format!("req-{}", self.seq))
    }

    /// The generation an actor presents: its remembered one when stale, else the truth
    /// (the present record, or the actor's own lost claim).
    fn presented(&mut self, actor: u8, dev: u8, stale: bool) -> Generation {
        let a = self.address(dev);
        let fresh = self
            .ledger
            .records()
            .filter(|r| r.address() == a)
            .find(|r| {
                r.claim
                    .as_ref()
                    .is_some_and(|c| c.owner.consumer == consumer(actor))
            })
            .or_else(|| self.ledger.record_at(a))
            .map(|r| r.generation)
            .unwrap_or_default();
        let g = if stale {
            self.seen.get(&(actor, dev)).copied().unwrap_or_default()
        } else {
            fresh
        };
        self.seen.insert((actor, dev), fresh);
        g
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        // The hold itself is no change of a record: begun, ended or abandoned outside the
        // change-set checks below (what a failed commit undoes is the recorded change).
        let pf = self.address(0);
        let mut ended: Vec<PciAddress> = Vec::new();
        match op {
            Op::BeginVfChange if self.changing.is_none() => {
                let prev_gen = self.ledger.host_generation();
                let g = self.ledger.record_at(pf).map(|r| r.generation);
                let before = self.ledger.clone();
                match g.map(|g| self.ledger.check_vf_change(pf, g)) {
                    Some(Ok(vfs)) => {
                        let token = std::sync::Arc::new(());
                        self.ledger
                            .vf_change_began(pf, std::sync::Arc::downgrade(&token), None);
                        let held: Vec<PciAddress> = std::iter::once(pf).chain(vfs).collect();
                        prop_assert!(self.claims_at(&held).is_empty(), "begun with a claim");
                        self.changing = Some((token, held));
                        // Nothing a view shows changed: states and records as before.
                        prop_assert_eq!(self.ledger.states(), before.states());
                    }
                    _ => prop_assert_eq!(&self.ledger, &before),
                }
                return self.check_invariants(prev_gen);
            }
            Op::EndVfChange { .. } => {
                if let Some((token, held)) = self.changing.take() {
                    self.ledger.vf_change_ended(pf);
                    drop(token);
                    ended = held.into_iter().filter(|a| *a != pf).collect();
                }
            }
            Op::AbandonVfChange => {
                self.changing = None;
                return self.check_invariants(self.ledger.host_generation());
            }
            _ => {}
        }
        let before = self.ledger.clone();
        let prev_gen = before.host_generation();
        // The generation the op presented, for the I2 check below.
        let mut presented: Option<Generation> = None;
        let result: Result<(Option<Outcome>, ChangeSet), LedgerError> = match op {
            Op::Claim { actor, dev, stale } => {
                let g = self.presented(*actor, *dev, *stale);
                presented = Some(g);
                let req = ClaimRequest {
                    target: ClaimTarget::Address {
                        address: self.address(*dev),
                        expected_generation: g,
                    },
                    owner: owner(u128::from(*actor) + 1),
                    request_id: self.next_rid(),
                };
                self.ledger.claim(&req, self.seq).map(|(o, cs)| {
                    self.last.insert(*actor, LastReq::Claim(req, o.clone()));
                    (Some(o), cs)
                })
            }
            Op::ClaimAny { actor, numa } => {
                let req = ClaimRequest {
                    target: ClaimTarget::Selector(Selector {
                        numa_node: *numa,
                        ..Selector::default()
                    }),
                    owner: owner(u128::from(*actor) + 1),
                    request_id: self.next_rid(),
                };
                // The pick by the rule as written: of every claimable present device, the
                // one on the requested node first, then the lowest address.
                let mut claimable: Vec<&DeviceRecord> = before
                    .records()
                    .filter(|r| r.present)
                    .filter(|r| before.check_claimable(r, consumer(*actor)).is_ok())
                    .collect();
                claimable
                    .sort_by_key(|r| (numa.is_some() && r.facts.numa_node != *numa, r.address()));
                let expected = claimable.first().map(|r| r.address());
                let result = self.ledger.claim(&req, self.seq);
                let picked = match &result {
                    Ok((Outcome::Claimed { address, .. }, _)) => Some(*address),
                    _ => None,
                };
                prop_assert_eq!(picked, expected);
                result.map(|(o, cs)| {
                    self.last.insert(*actor, LastReq::Claim(req, o.clone()));
                    (Some(o), cs)
                })
            }
            Op::Release { actor, dev, stale } => {
                let g = self.presented(*actor, *dev, *stale);
                presented = Some(g);
                let req = ReleaseRequest {
                    address: self.address(*dev),
                    consumer: consumer(*actor),
                    request_id: self.next_rid(),
                    generation: g,
                };
                self.ledger.release(&req, self.seq).map(|(o, cs)| {
                    self.last.insert(*actor, LastReq::Release(req, o.clone()));
                    (Some(o), cs)
                })
            }
            Op::Retry { actor } => {
                match self.last.get(actor).cloned() {
                    None => Ok((None, self.ledger.empty_change())),
                    // I7: a retry returns the first answer and changes nothing.
                    Some(LastReq::Claim(req, first)) => {
                        let (o, cs) = self
                            .ledger
                            .claim(&req, self.seq)
                            .map_err(|e| TestCaseError::fail(format!("retry failed: {e}")))?;
                        prop_assert_eq!(&o, &first);
                        prop_assert!(cs.is_empty());
                        Ok((None, cs))
                    }
                    Some(LastReq::Release(req, first)) => {
                        let (o, cs) = self
                            .ledger
                            .release(&req, self.seq)
                            .map_err(|e| TestCaseError::fail(format!("retry failed: {e}")))?;
                        prop_assert_eq!(&o, &first);
                        prop_assert!(cs.is_empty());
                        Ok((None, cs))
                    }
                }
            }
            // A binding's retry is answered from the log and the claim as it stands now:
            // its generation now while the actor's bound claim stands on the present
            // device, else the first one. It changes nothing.
            Op::RetryBind { actor } => match self.binds.get(actor).cloned() {
                None => Ok((None, self.ledger.empty_change())),
                Some(b) => {
                    let retry = self
                        .ledger
                        .bind_retry(b.address, consumer(*actor), &b.request_id)
                        .map_err(|e| TestCaseError::fail(format!("retry failed: {e}")))?;
                    let standing = self
                        .ledger
                        .record(b.record)
                        .filter(|r| {
                            r.present
                                && r.claim.as_ref().is_some_and(|c| {
                                    c.owner.consumer == consumer(*actor) && c.vfio.is_some()
                                })
                        })
                        .map(|r| r.generation);
                    match (retry, standing) {
                        (Some(BindRetry::Standing { generation, .. }), Some(now)) => {
                            prop_assert_eq!(generation, now);
                        }
                        (Some(BindRetry::Ended { generation }), None) => {
                            prop_assert_eq!(generation, b.first);
                        }
                        (other, now) => {
                            return Err(TestCaseError::fail(format!(
                                "a binding's retry answered {other:?} with the claim at {now:?}"
                            )))
                        }
                    }
                    Ok((None, self.ledger.empty_change()))
                }
            },
            Op::Bind { actor, dev, stale } => {
                // Mostly one of the actor's own claims (a binding of anything else is
                // refused), so that bindings are made, and then released, moved or lost.
                let own: Vec<u8> = (0..7u8)
                    .filter(|d| {
                        self.ledger.record_at(self.address(*d)).is_some_and(|r| {
                            r.claim
                                .as_ref()
                                .is_some_and(|c| c.owner.consumer == consumer(*actor))
                        })
                    })
                    .collect();
                let dev = match own.len() {
                    0 => *dev,
                    n => own[usize::from(*dev) % n],
                };
                let g = self.presented(*actor, dev, *stale);
                presented = Some(g);
                let address = self.address(dev);
                let request_id = self.next_rid();
                let members = vec![BoundMember {
                    address,
                    original_driver: None,
                    original_override: None,
                    identity: None,
                }];
                let now = self.seq;
                self.ledger
                    .record_binding(
                        address,
                        consumer(*actor),
                        g,
                        members,
                        Some((&request_id, now)),
                    )
                    .map(|(first, cs)| {
                        let record = match cs.requests.as_slice() {
                            [RequestEntry {
                                outcome: Outcome::Bound { record, .. },
                                ..
                            }] => *record,
                            other => panic!("a logged binding logs itself once: {other:?}"),
                        };
                        let logged = LoggedBind {
                            address,
                            record,
                            request_id,
                            first,
                        };
                        self.binds.insert(*actor, logged);
                        (None, cs)
                    })
            }
            Op::Transfer { actor, to, dev } => {
                let g = self.presented(*actor, *dev, false);
                presented = Some(g);
                let req = TransferRequest {
                    address: self.address(*dev),
                    from: consumer(*actor),
                    to: owner(u128::from(*to) + 1),
                    request_id: self.next_rid(),
                    generation: g,
                };
                self.ledger
                    .transfer(&req, self.seq)
                    .map(|(o, cs)| (Some(o), cs))
            }
            Op::Vanish { dev } => {
                self.present[usize::from(*dev)] = false;
                Ok((None, self.ledger.apply_inventory(self.current_inventory())))
            }
            Op::Return { dev } => {
                self.present[usize::from(*dev)] = true;
                Ok((None, self.ledger.apply_inventory(self.current_inventory())))
            }
            Op::Remake { dev } => {
                let f = &mut self.inventory[usize::from(*dev)];
                f.instance = f.instance.map(|i| Instance {
                    ino: i.ino + 1,
                    ..i
                });
                Ok((None, self.ledger.apply_inventory(self.current_inventory())))
            }
            Op::Regroup { dev, group } => {
                // Two claims the hardware put into one group are no claim the ledger
                // made (I1 is about what it decides): such a move is left out.
                let address = self.address(*dev);
                let claimed_here = self
                    .ledger
                    .record_at(address)
                    .is_some_and(|r| r.claim.is_some());
                let joins_a_claim = group.is_some()
                    && self.ledger.records().any(|r| {
                        r.present
                            && r.claim.is_some()
                            && r.address() != address
                            && r.facts.iommu_group == *group
                    });
                if !(claimed_here && joins_a_claim) {
                    self.inventory[usize::from(*dev)].iommu_group = *group;
                }
                Ok((None, self.ledger.apply_inventory(self.current_inventory())))
            }
            Op::Domains { actor, devs } => {
                let d = DomainDevices {
                    domain: DomainRef {
                        uuid: consumer(*actor).0,
                        name: format!("vm{actor}"),
                        running: true,
                    },
                    addresses: devs.iter().map(|d| self.address(*d)).collect(),
                };
                Ok((None, self.ledger.apply_domains(vec![d])))
            }
            Op::NoDomains => Ok((None, self.ledger.apply_domains(vec![]))),
            Op::Raise { ahead } => {
                let now = self.ledger.host_generation();
                let floor = Generation(now.0 + u64::from(*ahead));
                let cs = self.ledger.raise_host_generation(floor);
                prop_assert_eq!(cs.is_some(), *ahead > 0);
                prop_assert_eq!(self.ledger.host_generation(), floor);
                Ok((None, cs.unwrap_or_else(|| Tx::new(now).cs)))
            }
            Op::BeginVfChange | Op::AbandonVfChange => Ok((None, self.ledger.empty_change())),
            Op::EndVfChange { destroyed, logged } if !ended.is_empty() || self.present[0] => {
                let request_id = self.next_rid();
                let log = logged.then_some(VfCountLog {
                    consumer: consumer(0),
                    request_id: &request_id,
                    count: 2,
                    before: 4,
                    at: self.seq,
                });
                let cs = self.ledger.vf_count_written(pf, &ended, *destroyed, log);
                // A logged change is replayed to its retry (the same PF and count) with
                // the generation it gave the PF, and its id refused for anything else.
                let retry = self.ledger.vf_count_retry(pf, 2, consumer(0), &request_id);
                if *logged {
                    let first = VfCountReplay {
                        generation: cs.host_generation,
                        before: 4,
                    };
                    prop_assert_eq!(retry, Ok(Some(first)));
                    let other = self.ledger.vf_count_retry(pf, 3, consumer(0), &request_id);
                    prop_assert!(
                        matches!(other, Err(LedgerError::RequestIdReused { .. })),
                        "{:?}",
                        other
                    );
                } else {
                    prop_assert_eq!(retry, Ok(None));
                }
                Ok((None, cs))
            }
            Op::EndVfChange { .. } => Ok((None, self.ledger.empty_change())),
        };

        // Oracles of their own, from the state before the op (each op sends a new request
        // id, so none of these is a replay):
        // - I2: a change made by a request names the generation its record had before.
        // - I3: nothing attached is released or bound.
        // - I6: a device made again at a claimed address is a new record, free, and the
        //   claim stays with the old one, lost.
        if let (Some(g), Ok((_, cs))) = (presented, &result) {
            let acted_on = match (op, cs.requests.as_slice()) {
                (
                    Op::Claim { .. } | Op::Release { .. } | Op::Transfer { .. } | Op::Bind { .. },
                    [entry],
                ) => Some(match &entry.outcome {
                    Outcome::Claimed { record, .. }
                    | Outcome::Released { record, .. }
                    | Outcome::Transferred { record, .. }
                    | Outcome::Bound { record, .. } => *record,
                    Outcome::VfCountSet { .. } => {
                        return Err(TestCaseError::fail("a VF count logged by a request"))
                    }
                }),
                _ => None,
            };
            if let Some(id) = acted_on {
                let was = before
                    .record(id)
                    .ok_or_else(|| TestCaseError::fail("acted on a record not there before"))?;
                prop_assert_eq!(was.generation, g, "I2: a change at another generation");
                if matches!(op, Op::Release { .. } | Op::Bind { .. }) {
                    prop_assert!(
                        was.attached.is_none(),
                        "I3: an attached device released or bound"
                    );
                }
            }
        }
        if let Op::Remake { dev } = op {
            let address = self.address(*dev);
            let old = before.record_at(address).filter(|r| r.claim.is_some());
            if let (Some(old), true) = (old, self.present[usize::from(*dev)]) {
                let new = self
                    .ledger
                    .record_at(address)
                    .ok_or_else(|| TestCaseError::fail("a device made again is present"))?;
                prop_assert!(new.id != old.id, "I6: the old record kept for a new device");
                prop_assert!(new.claim.is_none(), "I6: a new device came with a claim");
                let kept = self.ledger.record(old.id);
                prop_assert!(
                    kept.is_some_and(|r| !r.present && r.claim == old.claim),
                    "I6: the old claim kept, lost"
                );
            }
        }

        match result {
            // I2: a rejected request changes nothing.
            Err(_) => prop_assert_eq!(&self.ledger, &before),
            Ok((outcome, cs)) => {
                // Undo restores exactly the state before (what a failed commit relies on).
                let mut undone = self.ledger.clone();
                undone.undo(&cs);
                prop_assert_eq!(&undone, &before);
                // Re-deriving only around the touched records (what the writer publishes
                // after a batch without domain changes) gives every state.
                if cs.before_domains.is_none() {
                    let mut states = before.states();
                    let (removed, around) = self.ledger.rederive(std::slice::from_ref(&cs));
                    for id in &removed {
                        states.remove(id);
                    }
                    states.extend(around);
                    prop_assert_eq!(&states, &self.ledger.states());
                    // The same for the strays (what the writer keeps in its view).
                    let mut strays: BTreeMap<PciAddress, Vec<Stray>> = BTreeMap::new();
                    for s in before.strays() {
                        strays.entry(s.address).or_default().push(s);
                    }
                    for (address, now) in self.ledger.strays_around(std::slice::from_ref(&cs)) {
                        strays.insert(address, now);
                    }
                    let strays: Vec<Stray> = strays.into_values().flatten().collect();
                    prop_assert_eq!(strays, self.ledger.strays());
                }
                // I5: generations only grow; every written record got a new one.
                prop_assert!(cs.host_generation >= prev_gen);
                for r in &cs.upserts {
                    prop_assert!(r.generation > prev_gen);
                }
                match (op, outcome) {
                    (_, Some(Outcome::Claimed { record, .. })) => {
                        let actor = match op {
                            Op::Claim { actor, .. } | Op::ClaimAny { actor, .. } => *actor,
                            _ => unreachable!("claimed only from claim ops"),
                        };
                        prop_assert!(self.claims.insert(record, consumer(actor)).is_none());
                    }
                    (Op::Release { actor, .. }, Some(Outcome::Released { record, .. })) => {
                        prop_assert_eq!(self.claims.remove(&record), Some(consumer(*actor)));
                    }
                    (Op::Transfer { to, .. }, Some(Outcome::Transferred { record, .. })) => {
                        prop_assert!(self.claims.insert(record, consumer(*to)).is_some());
                    }
                    _ => {}
                }
            }
        }
        self.check_invariants(prev_gen)
    }

    fn check_invariants(&self, prev_gen: Generation) -> Result<(), TestCaseError> {
        let l = &self.ledger;
        prop_assert!(l.host_generation() >= prev_gen);
        // While a VF count change is under way, nothing it holds back is claimed, present
        // or lost (a change begins only with none): not at the addresses of the PF and
        // the VFs it had, nor any VF of the PF found meanwhile.
        if let Some((_, held)) = &self.changing {
            let pf = self.address(0);
            let mut claimed: Vec<PciAddress> = self
                .claims_at(held)
                .iter()
                .map(|id| l.records[id].address())
                .collect();
            claimed.extend(
                l.records()
                    .filter(|r| r.claim.is_some() && r.facts.physfn == Some(pf))
                    .map(DeviceRecord::address),
            );
            prop_assert!(
                claimed.is_empty(),
                "claims at {:?} while their PF's VF count changes",
                claimed
            );
        }
        // I6 and the model: exactly the modelled claims exist, none dropped silently.
        let actual: BTreeMap<RecordId, ConsumerId> = l
            .records()
            .filter_map(|r| r.claim.as_ref().map(|c| (r.id, c.owner.consumer)))
            .collect();
        prop_assert_eq!(&actual, &self.claims);
        let mut present_addrs = std::collections::BTreeSet::new();
        for r in l.records() {
            prop_assert!(r.generation <= l.host_generation());
            prop_assert!(r.present || r.claim.is_some(), "lost records keep a claim");
            if r.present {
                prop_assert!(
                    present_addrs.insert(r.address()),
                    "one instance per address"
                );
            }
        }
        // I1: no PF claimed together with one of its VFs; no two claims in one group.
        let claimed: Vec<&DeviceRecord> = l.records().filter(|r| r.claim.is_some()).collect();
        for a in &claimed {
            for b in &claimed {
                if a.id == b.id {
                    continue;
                }
                prop_assert!(
                    b.facts.physfn != Some(a.address()),
                    "PF and VF both claimed"
                );
                if a.present && b.present {
                    prop_assert!(
                        a.facts.iommu_group.is_none() || a.facts.iommu_group != b.facts.iommu_group,
                        "two claims in one IOMMU group"
                    );
                }
            }
        }
        // Every derived state, read from the related index, is what a walk over every
        // claim finds.
        prop_assert_eq!(l.states(), states_by_walking_every_claim(l));
        // I3: nothing attached was freed (attachment implies a claim).
        for r in l.records() {
            prop_assert!(r.attached.is_none() || r.claim.is_some());
        }
        Ok(())
    }
}

/// The derived states by the rule as written, walking every claim for each record: the
/// oracle for `Ledger::blocker`, which reads only the records related to one. Where several
/// claims block a record, the one with the lowest record id is named.
fn states_by_walking_every_claim(l: &Ledger) -> BTreeMap<RecordId, DeviceState> {
    let claims: Vec<&DeviceRecord> = l.records().filter(|r| r.claim.is_some()).collect();
    let related = |r: &DeviceRecord| -> Option<Blocker> {
        let addr = r.address();
        let blocked = |address, relation| Some(Blocker::Related { address, relation });
        if let Some(pf) = r.facts.physfn {
            if claims.iter().any(|c| c.address() == pf) {
                return blocked(pf, Relation::PhysicalFunction);
            }
        }
        if let Some(vf) = claims.iter().find(|c| c.facts.physfn == Some(addr)) {
            return blocked(vf.address(), Relation::VirtualFunction);
        }
        let group = r.facts.iommu_group?;
        let first = claims
            .iter()
            .find(|c| c.present && c.facts.iommu_group == Some(group))?;
        (first.address() != addr)
            .then_some(first.address())
            .and_then(|a| blocked(a, Relation::IommuGroup))
    };
    l.records()
        .map(|r| {
            let state = if !r.present {
                DeviceState::Lost
            } else if r.claim.is_some() && r.attached.is_some() {
                DeviceState::Attached
            } else if r.claim.is_some() {
                DeviceState::Claimed
            } else if let Some(blocker) = related(r)
                .or_else(|| {
                    // A VF that a domain uses, the first by record id.
                    l.records()
                        .filter(|v| v.facts.physfn == Some(r.address()))
                        .find_map(|v| {
                            let d = l.refs.get(&v.address())?.first()?;
                            Some(Blocker::VfInUse {
                                vf: v.address(),
                                domain: d.clone(),
                            })
                        })
                })
                .or_else(|| {
                    let domain = l.refs.get(&r.address()).and_then(|v| v.first());
                    domain.map(|d| Blocker::Domain(d.clone()))
                })
            {
                DeviceState::Unavailable { blocker }
            } else if !r.facts.managed {
                DeviceState::Unmanaged
            } else {
                DeviceState::Free
            };
            (r.id, state)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_histories_keep_the_invariants(ops in proptest::collection::vec(op(), 1..60)) {
        let mut w = World::new();
        for op in &ops {
            w.step(op)?;
        }
    }

    #[test]
    fn snapshot_reload_is_identical(ops in proptest::collection::vec(op(), 1..40)) {
        let mut w = World::new();
        for op in &ops {
            w.step(op)?;
        }
        // A VF count change under way is not stored either: it does not outlive the
        // agent that makes it.
        let mut l = w.ledger.clone();
        l.vf_change_ended(w.address(0));
        let l = &l;
        let snap = Snapshot {
            host_generation: l.host_generation(),
            records: l.records().map(|r| (r.id, r.clone())).collect(),
            requests: l.request_log().collect(),
        };
        let mut rebuilt = Ledger::from_snapshot(snap);
        // Domains are not stored (libvirt is asked again at start).
        rebuilt.apply_domains(l.domains().to_vec());
        prop_assert_eq!(&rebuilt, l);
    }

    /// The audit's promise, against the history rather than the generations: whatever
    /// happens after a controller reads its snapshot (claims, releases, transfers,
    /// devices vanishing and returning, domains, restarts), an audit with that snapshot
    /// and any belief names as orphans only claims that stood, unchanged and with the same
    /// owner, at the snapshot; and every claim of an unexpected consumer is reported
    /// in exactly one list.
    #[test]
    fn an_audit_frees_only_claims_that_stood_unchanged_at_its_snapshot(
        before in proptest::collection::vec(op(), 0..30),
        after in proptest::collection::vec(op(), 0..30),
        believed in proptest::collection::vec(any::<bool>(), 3),
    ) {
        let mut w = World::new();
        for op in &before {
            w.step(op)?;
        }
        let snapshot = w.ledger.host_generation();
        let stood: BTreeMap<RecordId, DeviceRecord> = w
            .ledger
            .records()
            .filter(|r| r.claim.is_some())
            .map(|r| (r.id, r.clone()))
            .collect();
        for op in &after {
            w.step(op)?;
        }
        let expected: BTreeSet<ConsumerId> = (0u8..3)
            .filter(|a| believed[usize::from(*a)])
            .map(consumer)
            .collect();
        let report = w.ledger.audit(&expected, snapshot);
        for r in &report.orphans {
            prop_assert_eq!(stood.get(&r.id), Some(r), "an orphan stood as it is at the snapshot");
            prop_assert!(r.present && r.attached.is_none());
        }
        let unexpected: BTreeSet<RecordId> = w
            .ledger
            .records()
            .filter(|r| r.claim.as_ref().is_some_and(|c| !expected.contains(&c.owner.consumer) || !r.present))
            .map(|r| r.id)
            .collect();
        let mut listed: Vec<RecordId> = report
            .orphans
            .iter()
            .chain(&report.changed)
            .chain(&report.protected)
            .chain(&report.lost)
            .map(|r| r.id)
            .collect();
        listed.sort();
        prop_assert_eq!(listed, unexpected.into_iter().collect::<Vec<_>>());
        // Acting, each orphan is freed by a release of its own at the generation the
        // audit saw; none is refused, since none changed.
        for (i, r) in report.orphans.iter().enumerate() {
            let owner = r.claim.as_ref().map(|c| c.owner.consumer).expect("claimed");
            let freed = w.ledger.release(
                &ReleaseRequest {
                    address: r.address(),
                    consumer: owner,
                    request_id: rid(&format!("audit@{i}")),
                    generation: r.generation,
                },
                w.seq,
            );
            prop_assert!(freed.is_ok(), "{:?}", freed);
        }
    }
}

#[test]
fn stale_audit_never_frees_a_claim_it_did_not_see() {
    // The seed, compressed: the audit's generation predates the destination claim.
    let mut w = World::new();
    let audit_view = w
        .ledger
        .record_at(addr("0000:3b:02.1"))
        .map(|r| r.generation);
    w.step(&Op::Claim {
        actor: 0,
        dev: 2,
        stale: false,
    })
    .expect("claim");
    let err = w
        .ledger
        .release(
            &ReleaseRequest {
                address: addr("0000:3b:02.1"),
                consumer: consumer(0),
                request_id: rid("audit"),
                generation: audit_view.unwrap_or_default(),
            },
            1,
        )
        .expect_err("stale");
    assert_eq!(err.reason(), "STALE_GENERATION");
}
