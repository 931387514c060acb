//! The writer's hardware commands: each is decided against the ledger, acted on through
//! sysfs and committed with no other decision in between, so no claim can slip between
//! a check ("no VF of this PF is claimed") and the write that relies on it.
//!
//! Order of durability: a vfio-pci binding is recorded (original drivers included)
//! before the first sysfs write, so a crash mid-bind still knows what to give back. A
//! release restores the drivers first and commits the free only once that worked; a
//! failed restore leaves the claim in place and names the step.

use std::sync::Arc;

use super::{now_unix, Applied, Command, Worker, WriteError, UNRECORDED_VF_REQUESTS};
use crate::hardware::sriov::Written;
use crate::hardware::{Hardware, HardwareError};
use crate::ledger::{
    BindRetry, BoundMember, ChangeSet, MemberIdentity, ReleaseRequest, VfCountLog,
};
use crate::metrics::Op;
use crate::pci::{ConsumerId, Generation, PciAddress, RequestId};

/// Bind the IOMMU group of a claimed device to vfio-pci.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindVfio {
    pub address: PciAddress,
    pub consumer: ConsumerId,
    pub generation: Generation,
    /// Logged with the binding, so that a retry is answered as the first call (a
    /// Claim's own binding has none: the claim's request id covers it).
    pub request_id: Option<RequestId>,
    /// Whether the caller listed libvirt's domains afresh for this call: a retry that
    /// would move devices again is refused without ([`WriteError::ListingNeeded`]).
    pub listed: bool,
}

/// What a binding did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    /// The device's generation after the binding was recorded (a retry whose claim has
    /// ended since: the first call's).
    pub generation: Generation,
    /// The members bound (a retry whose claim has ended since: none).
    pub members: Vec<BoundMember>,
    /// A retry of a logged request: answered from the log and the claim as it stands,
    /// bound again only where a member was off vfio-pci.
    pub replayed: bool,
}

/// Set the VF count of a PF.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetVfCount {
    pub pf: PciAddress,
    pub generation: Generation,
    pub count: u32,
    /// Written to `sriov_drivers_autoprobe` first, when given.
    pub autoprobe: Option<bool>,
    /// The caller's consumer id and request id: a change written in full is logged
    /// under them, and a retry is answered as the first call.
    pub request: Option<(ConsumerId, RequestId)>,
}

/// How a VF count change begins: written, or answered from the request log.
#[derive(Debug)]
pub enum VfBegun {
    /// Checked, its devices held back: to be written, then recorded.
    Change(VfChange),
    /// A retry of a change logged under its request id: its first answer.
    Replayed(VfCountSet),
}

/// A VF count change begun: checked against the ledger, with the PF and its VFs held
/// back from claims ([`crate::ledger::Ledger::vf_change_began`]) while the sysfs writes
/// run off the writer thread, so that the rest of the host's requests are decided
/// meanwhile (the kernel may take minutes).
#[derive(Debug)]
pub struct VfChange {
    req: SetVfCount,
    /// The PF's VFs when the change began.
    vfs: Vec<PciAddress>,
    hw: Hardware,
    /// Holds the devices back while it lives: a change dropped unanswered (its task
    /// gone) lets them go rather than hold them forever, and a `sriov_numvfs` write
    /// still in the kernel (past its timeout) holds a clone until it returns.
    token: Arc<()>,
}

/// What the sysfs side of a VF count change did, for the writer to record.
#[derive(Debug)]
pub struct VfWritten {
    req: SetVfCount,
    vfs: Vec<PciAddress>,
    /// The VF count before (0 where it could not be read).
    before: u32,
    result: Result<(), HardwareError>,
    written: Written,
    token: Arc<()>,
}

impl VfChange {
    /// What to record if the writes never answer: a write that may have destroyed the
    /// VFs, under a token of its own that holds the devices back until it is recorded.
    pub fn unanswered(&self, why: &str) -> VfWritten {
        let mut end = VfWritten {
            req: self.req.clone(),
            vfs: self.vfs.clone(),
            before: 0,
            result: Ok(()),
            written: Written::Vfs,
            token: self.token.clone(),
        };
        end.abandoned(why.to_string());
        end
    }

    /// Reads the PF's counts and writes the new one (blocking: each write is waited on
    /// with its timeout). Reads refused here change nothing.
    pub fn write(self) -> VfWritten {
        let VfChange {
            req,
            vfs,
            hw,
            token,
        } = self;
        let (before, result, written) = match hw.vf_count_now(req.pf, req.count) {
            Err(e) => (0, Err(e), Written::Nothing),
            Ok(before) => {
                let (result, written) =
                    hw.write_num_vfs(req.pf, before, req.count, req.autoprobe, &token);
                (before, result, written)
            }
        };
        VfWritten {
            req,
            vfs,
            before,
            result,
            written,
            token,
        }
    }
}

impl VfWritten {
    /// Says why the writes never answered.
    pub fn abandoned(&mut self, why: String) {
        self.result = Err(HardwareError::Abandoned {
            address: self.req.pf,
            step: "write sriov_numvfs",
            why,
        });
    }
}

/// What a VF-count change did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VfCountSet {
    /// The PF's generation after the change.
    pub generation: Generation,
    /// The VF count before.
    pub before: u32,
    /// A retry answered from the request log: nothing was written.
    pub replayed: bool,
}

impl Worker {
    /// Whether a command must run alone (it writes to sysfs).
    pub(super) fn acts_on_hardware(&self, cmd: &Command) -> bool {
        match cmd {
            Command::BindVfio(..) | Command::BeginVfCount(..) | Command::EndVfCount(..) => true,
            Command::Release(req, _, _) => self.ledger.has_binding(req.address),
            Command::FreeOrphans(_, list, _) => {
                list.iter().any(|o| self.ledger.has_binding(o.address))
            }
            _ => false,
        }
    }

    pub(super) fn run_alone(&mut self, cmd: Command) {
        let Some(cmd) = self.refuse_if_failed(vec![cmd]).and_then(|mut c| c.pop()) else {
            return;
        };
        match cmd {
            Command::BindVfio(req, reply) => {
                let r = self.bind_vfio(&req);
                match &r {
                    Ok(b) if b.replayed => self.metrics.applied(Op::BindVfio, true),
                    _ => self.count(Op::BindVfio, &r),
                }
                let _ = reply.send(r);
            }
            Command::BeginVfCount(req, reply) => {
                let r = self.begin_vf_count(req);
                match &r {
                    Ok(VfBegun::Change(_)) => {}
                    Ok(VfBegun::Replayed(_)) => self.metrics.applied(Op::SetVfCount, true),
                    Err(_) => self.count(Op::SetVfCount, &r),
                }
                let _ = reply.send(r);
            }
            Command::EndVfCount(written, reply) => {
                let r = self.end_vf_count(*written);
                self.count(Op::SetVfCount, &r);
                let _ = reply.send(r);
            }
            Command::Release(req, checked, reply) => {
                let r = self
                    .unchecked_free(&req, checked)
                    .and_then(|()| self.release_restoring(&req));
                self.count(Op::Release, &r);
                let _ = reply.send(r);
            }
            Command::FreeOrphans(audit, list, reply) => {
                let earlier = match self.earlier_frees(&audit, &[]) {
                    Ok(found) => found,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                };
                let mut out = Vec::with_capacity(list.len());
                for orphan in list {
                    let r = self.release_restoring(&orphan.release_request());
                    if let Err(e) = &r {
                        tracing::warn!(device = %orphan.address, error = %e, "orphan not freed");
                    }
                    out.push(r);
                }
                let _ = reply.send(Ok(super::OrphansFreed {
                    results: out,
                    earlier,
                }));
            }
            other => self.run_batch(vec![other]),
        }
    }

    fn count<T>(&self, op: Op, r: &Result<T, WriteError>) {
        match r {
            Ok(_) => self.metrics.applied(op, false),
            Err(WriteError::Ledger(e)) => self.metrics.rejected(e.reason()),
            Err(WriteError::Hardware(_)) => self.metrics.rejected("HARDWARE_STEP_FAILED"),
            Err(_) => {}
        }
    }

    /// Refuses to act once a commit's outcome was unknown (the store failed): the
    /// checks at the start of a batch cover one command, but a command that acts more
    /// than once (an acting audit's frees, each with its sysfs writes) must stop at the
    /// first such commit, not write sysfs and commit again after it.
    fn still_sound(&self) -> Result<(), WriteError> {
        match &self.failed {
            Some(why) => Err(WriteError::StoreFailed(why.clone())),
            None => Ok(()),
        }
    }

    /// Commits one change set on its own and publishes it; on failure it is undone.
    pub(super) fn commit_one(&mut self, cs: ChangeSet) -> Result<(), WriteError> {
        if cs.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.still_sound() {
            self.ledger.undo(&cs);
            return Err(e);
        }
        let before = self.view_now();
        self.commit_changes(&before, std::slice::from_ref(&cs))
            .map_err(|e| {
                tracing::error!(error = %e, "store commit failed; the change is undone");
                if e.is_outcome_unknown() {
                    WriteError::OutcomeUnknown(Arc::new(e))
                } else {
                    WriteError::Store(Arc::new(e))
                }
            })
    }

    fn bind_vfio(&mut self, req: &BindVfio) -> Result<Bound, WriteError> {
        let hw = self.hardware.clone().ok_or(HardwareError::Disabled)?;
        let mut generation = req.generation;
        let mut logged = req.request_id.as_ref();
        if let Some(request_id) = &req.request_id {
            self.recall_alone(req.consumer, request_id)?;
            match self
                .ledger
                .bind_retry(req.address, req.consumer, request_id)?
            {
                None => {}
                Some(BindRetry::Ended { generation }) => {
                    return Ok(Bound {
                        generation,
                        members: Vec::new(),
                        replayed: true,
                    })
                }
                Some(BindRetry::Standing {
                    generation: now,
                    binding,
                }) => {
                    let on_vfio = binding.members.iter().all(|m| {
                        matches!(hw.driver(m.address, "read current driver"),
                            Ok(Some(d)) if d == crate::hardware::VFIO_PCI_DRIVER)
                    });
                    if on_vfio {
                        return Ok(Bound {
                            generation: now,
                            members: binding.members,
                            replayed: true,
                        });
                    }
                    // The first call stopped part way: bind again, at the claim's
                    // generation now, without logging the request a second time.
                    generation = now;
                    logged = None;
                }
            }
        }
        // Whatever comes next moves devices: never without the domains listed afresh.
        if !req.listed {
            return Err(WriteError::ListingNeeded {
                address: req.address,
            });
        }
        let mut plan = self
            .ledger
            .bind_plan(req.address, req.consumer, generation)?;
        // A bridge in the group (a root or switch port without ACS) keeps its driver:
        // vfio-pci refuses it, and taking it from pcieport ends its hotplug and error
        // handling.
        let view = self.view_now();
        plan.members.retain(|m| {
            let bridge = *m != req.address
                && view
                    .sysfs_device(m)
                    .and_then(|d| d.class)
                    .is_some_and(|c| c.is_bridge());
            if bridge {
                tracing::info!(device = %m, claimed = %req.address, "a bridge in the IOMMU group keeps its driver");
            }
            !bridge
        });
        drop(view);
        let mut members = Vec::with_capacity(plan.members.len());
        for m in &plan.members {
            let recorded = plan
                .existing
                .as_ref()
                .and_then(|b| b.members.iter().find(|x| x.address == *m));
            let member = match recorded {
                Some(r) => r.clone(),
                None => BoundMember {
                    address: *m,
                    original_driver: hw.driver(*m, "read current driver")?,
                    original_override: hw.driver_override(*m)?,
                    identity: self
                        .ledger
                        .record_at(*m)
                        .filter(|r| r.present)
                        .map(MemberIdentity::of),
                },
            };
            members.push(member);
        }
        // Without vfio-pci loaded nothing can be bound: refused before the binding is
        // recorded (a new generation), so the refusal changes nothing. Where a member is
        // on vfio-pci already, the driver is loaded.
        hw.require_driver(req.address, crate::hardware::VFIO_PCI_DRIVER)?;
        let (recorded, cs) = self.ledger.record_binding(
            req.address,
            req.consumer,
            generation,
            members.clone(),
            logged.map(|id| (id, now_unix())),
        )?;
        self.commit_one(cs)?;
        for m in &members {
            hw.bind_vfio(m.address)?;
            tracing::info!(device = %m.address, claimed = %req.address, original_driver = m.original_driver.as_deref().unwrap_or("none"), "bound to vfio-pci");
        }
        Ok(Bound {
            generation: recorded,
            members,
            replayed: req.request_id.is_some() && logged.is_none(),
        })
    }

    /// A release that first gives a recorded binding back (only if the ledger would
    /// accept the release: checked on an O(1) copy of it).
    pub(super) fn release_restoring(
        &mut self,
        req: &ReleaseRequest,
    ) -> Result<Applied, WriteError> {
        self.still_sound()?;
        self.recall_alone(req.consumer, &req.request_id)?;
        let now = now_unix();
        // The members given their drivers back so far: bound again should the release
        // fail after all (a later member's step, or the commit), since the claim then
        // stands with its binding recorded, and its answer says nothing changed.
        let mut restored = Vec::new();
        if let Some(plan) = self
            .ledger
            .restore_plan(req.address, req.consumer, req.generation)?
        {
            let mut trial = self.ledger.clone();
            trial.release(req, now)?;
            let hw = self.hardware.clone().ok_or(HardwareError::Disabled)?;
            for (member, why) in &plan.left {
                tracing::warn!(device = %member, claimed = %req.address, why, "bound member left as it is: its driver is not given back");
            }
            for m in &plan.restore {
                // Counted before its steps: one that fails may come after the unbind.
                restored.push(m.address);
                if let Err(e) = hw.restore_driver(
                    m.address,
                    m.original_driver.as_deref(),
                    m.original_override.as_deref(),
                ) {
                    bind_back(&hw, req.address, &restored);
                    return Err(e.into());
                }
                tracing::info!(device = %m.address, driver = m.original_driver.as_deref().unwrap_or("none"), "original driver restored");
            }
        }
        let (outcome, cs) = self.ledger.release(req, now)?;
        let replayed = cs.is_empty();
        if let Err(e) = self.commit_one(cs) {
            // A commit whose outcome is unknown may have freed the claim, with the only
            // record of the original drivers: the drivers stay given back (the next
            // start reads which it was; a claim still standing is bound again by its
            // PrepareVfio, a release again finds the drivers back).
            match (&e, &self.hardware) {
                (WriteError::OutcomeUnknown(_), _) => {
                    tracing::warn!(claimed = %req.address, "the release's commit has an unknown outcome: its members' drivers stay given back");
                }
                (_, Some(hw)) => bind_back(hw, req.address, &restored),
                (_, None) => {}
            }
            return Err(e);
        }
        Ok(Applied { outcome, replayed })
    }

    /// Checks a VF count change against the ledger and holds the PF and its VFs back
    /// from claims until [`Self::end_vf_count`]; the writes happen off this thread.
    fn begin_vf_count(&mut self, req: SetVfCount) -> Result<VfBegun, WriteError> {
        let hw = self.hardware.clone().ok_or(HardwareError::Disabled)?;
        if let Some((consumer, request_id)) = &req.request {
            self.recall_alone(*consumer, request_id)?;
            if let Some(first) = self
                .ledger
                .vf_count_retry(req.pf, req.count, *consumer, request_id)?
            {
                return Ok(VfBegun::Replayed(VfCountSet {
                    generation: first.generation,
                    before: first.before,
                    replayed: true,
                }));
            }
        }
        let vfs = self.ledger.check_vf_change(req.pf, req.generation)?;
        let token = Arc::new(());
        self.ledger
            .vf_change_began(req.pf, Arc::downgrade(&token), req.request.clone());
        Ok(VfBegun::Change(VfChange {
            req,
            vfs,
            hw,
            token,
        }))
    }

    /// Records what a VF count change wrote, and lets the PF and its VFs go: at once,
    /// or once the kernel answers a write still in it, or, where the record could not
    /// be stored, once a full scan applies.
    fn end_vf_count(&mut self, w: VfWritten) -> Result<VfCountSet, WriteError> {
        let VfWritten {
            req,
            vfs,
            before,
            result,
            written,
            token,
        } = w;
        if written == Written::Nothing {
            // Nothing reached sysfs (refused at the first write, or nothing to write):
            // nothing changed, and the caller's generation stays good.
            self.ledger.vf_change_ended(req.pf);
            drop(token);
            result?;
            return Ok(VfCountSet {
                generation: req.generation,
                before,
                replayed: false,
            });
        }
        // Written or half-written, the PF gets a new generation (whoever holds the old
        // one must look again), and where the VFs it had may be gone, they are gone in
        // the same commit: the kernel destroys them all first, so a claim must not take
        // one before the rescan finds what is there now.
        // Logged only when written in full: a retry of a change that failed part way is a
        // new request (its generation moved: refused as stale).
        let logged =
            req.request
                .as_ref()
                .filter(|_| result.is_ok())
                .map(|(consumer, request_id)| VfCountLog {
                    consumer: *consumer,
                    request_id,
                    count: req.count,
                    before,
                    at: now_unix(),
                });
        let was_logged = logged.is_some();
        let cs = self
            .ledger
            .vf_count_written(req.pf, &vfs, written == Written::Vfs, logged);
        let generation = cs.host_generation;
        let committed = self.commit_one(cs);
        // Written but not logged: told so, not "never applied", by GetRequestOutcome.
        if let Some((consumer, request_id)) = &req.request {
            if !was_logged || committed.is_err() {
                self.unrecorded_vf_requests
                    .push_back((*consumer, request_id.clone(), req.pf));
                if self.unrecorded_vf_requests.len() > UNRECORDED_VF_REQUESTS {
                    self.unrecorded_vf_requests.pop_front();
                }
            }
        }
        if let Err(e) = committed {
            // The ledger still lists the VFs the kernel may have destroyed (and may have
            // made again, as other devices, at the same addresses): the PF and its VFs
            // stay held back until a full scan applies, which reads what is there now
            // (the caller owes one, tried until the disk takes it).
            tracing::warn!(pf = %req.pf, error = %e, "a VF count change could not be recorded: the PF and its VFs stay held back until a full scan applies");
            self.unrecorded_vf_changes.push(token);
            return Err(e);
        }
        // A `sriov_numvfs` write the kernel has not answered (past its timeout, or its
        // task gone before it ended) holds a clone of the token until it returns, so the
        // PF and its VFs stay held back from claims and another change until the kernel
        // lets the PF go. Any other end lets them go now.
        let in_kernel = written == Written::Vfs
            && matches!(
                result,
                Err(HardwareError::Timeout { .. } | HardwareError::Abandoned { .. })
            );
        if in_kernel {
            tracing::warn!(pf = %req.pf, "a VF count write is still in the kernel: the PF and its VFs stay held back until it returns");
        } else {
            self.ledger.vf_change_ended(req.pf);
        }
        drop(token);
        tracing::info!(pf = %req.pf, count = req.count, before, ok = result.is_ok(), "VF count written");
        result?;
        Ok(VfCountSet {
            generation,
            before,
            replayed: false,
        })
    }
}

/// Binds `restored`, members of the binding of the claim at `claimed` that a release
/// that then failed gave their drivers back, to vfio-pci again: the claim stands, with
/// its binding recorded. A member that cannot be bound again is logged (the claim's
/// owner binds it with PrepareVfio, or releases again).
fn bind_back(hw: &Hardware, claimed: PciAddress, restored: &[PciAddress]) {
    for a in restored {
        match hw.bind_vfio(*a) {
            Ok(_) => {
                tracing::warn!(device = %a, claimed = %claimed, "the release failed: bound to vfio-pci again")
            }
            Err(e) => {
                tracing::error!(device = %a, claimed = %claimed, error = %e, "the release failed and the device could not be bound to vfio-pci again: the claim stands with its binding recorded; PrepareVfio binds it again")
            }
        }
    }
}
