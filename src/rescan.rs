//! Keeping the ledger true to sysfs: a full scan (at start, on reload, after lost
//! uevents) or a rescan of only the devices a hotplug event or a hardware action names,
//! with their PF/VF relatives. Scans run off the async threads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::config::Selection;
use crate::ledger::{DeviceFacts, Instance, RecordId};
use crate::pci::PciAddress;
use crate::sysfs::{self, PciDevice, PciNames, Settled, SysfsError};
use crate::writer::{SysfsDevices, WriteError, Writer};

/// Why a rescan could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum RescanError {
    #[error("cannot scan PCI devices: {0}")]
    Sysfs(#[from] SysfsError),
    #[error("cannot apply the scan: {0}")]
    Write(#[from] WriteError),
    #[error("the scan thread failed: {0}")]
    Thread(String),
}

/// How long the devices of a PF held by the kernel wait before they are read again.
pub const HELD_RETRY: Duration = Duration::from_secs(1);

/// A read of some devices, settled (see [`sysfs::settle`]).
#[derive(Debug, Default)]
struct Sorted {
    /// To apply as read.
    read: Vec<PciDevice>,
    /// Removed while they were read: gone.
    gone: Vec<PciAddress>,
    /// To keep as the ledger has them: they kept changing while they were read, or
    /// their PF (or they themselves, a PF) were held by the kernel, mid-change.
    kept: Vec<PciAddress>,
    /// Those of `kept` held by the kernel (a PF and its VFs): read again once it lets go.
    held: BTreeSet<PciAddress>,
}

/// Settles each device read with problems, and sets aside a PF the kernel held (a VF
/// count change runs on it: its `sriov_numvfs` did not answer) with its VFs, those it
/// lists and those that name it: what was read of them is mid-change, and applied, it
/// would bring back VFs the change is destroying.
fn sort(
    root: &Path,
    dev: &Path,
    names: &PciNames,
    devices: Vec<PciDevice>,
) -> Result<Sorted, SysfsError> {
    let held_pfs: BTreeSet<PciAddress> = devices
        .iter()
        .filter(|d| d.held)
        .map(|d| d.address)
        .collect();
    let mut sorted = Sorted::default();
    for d in &devices {
        if d.held {
            sorted.held.insert(d.address);
            sorted
                .held
                .extend(d.sriov.iter().flat_map(|s| s.vfs.iter().copied()));
        } else if d.physfn.is_some_and(|pf| held_pfs.contains(&pf)) {
            sorted.held.insert(d.address);
        }
    }
    for d in devices {
        let a = d.address;
        if sorted.held.contains(&a) {
            sorted.kept.push(a);
            continue;
        }
        match sysfs::settle(root, dev, names, d)? {
            Settled::Read(d) if d.held => {
                // Held since it was first read.
                tracing::warn!(device = %a, "the kernel holds the device now; kept as it was");
                sorted.held.insert(a);
                sorted.kept.push(a);
            }
            Settled::Read(d) => sorted.read.push(d),
            Settled::Gone => sorted.gone.push(a),
            Settled::Unsettled(d) => {
                tracing::warn!(device = %a, problems = ?d.errors, "device changed while it was read; kept as it was");
                sorted.kept.push(a);
            }
        }
    }
    if !held_pfs.is_empty() {
        tracing::warn!(pfs = ?held_pfs, "a VF count change runs on these PFs: they and their VFs are kept as they were, and read again every second until it is done");
    }
    Ok(sorted)
}

/// PCI functions the kernel said it removed, each with the highest sequence number of
/// its `remove` events (`None`: one came without a number).
pub type Removals = BTreeMap<PciAddress, Option<u64>>;

/// Scans sysfs and applies what it finds to the ledger.
#[derive(Debug)]
pub struct Rescanner {
    sysfs_root: PathBuf,
    dev_root: PathBuf,
    names: Arc<PciNames>,
    selection: RwLock<Selection>,
    writer: Writer,
    /// Taken by each rescan from before it reads sysfs until the ledger has applied what
    /// it read, so rescans apply in the order they read. Without it a hotplug rescan and
    /// a hardware action's rescan could overlap, and the one that read sysfs first (a VF
    /// still there) could apply last, over the fresher one (the VF gone), with no event
    /// left to correct it. An async mutex: it is meant to be held across the awaits of
    /// the scan thread and the writer. Lock order with the free checks' order lock
    /// (`api::guard`): no one waits for this turn while holding that lock (an acting
    /// audit holding it only tries this turn, and otherwise lets it go, waits here, then
    /// takes it again).
    turn: Arc<tokio::sync::Mutex<()>>,
    /// The boot's tag, for the devices' instances (see [`Instance`]).
    boot: Option<u64>,
    /// For each present device whose ledger record a scan created, the kernel's uevent
    /// sequence number read just before that scan (none where the kernel shows none, or
    /// where the record was there before the scan): a removal numbered at or below it
    /// happened before the record was made, so it is not that device's removal. A scan
    /// that finds a device and keeps its record says nothing of which device it is (it
    /// may be a new one whose removal is still to be read), so it does not count.
    seen_at: RwLock<BTreeMap<PciAddress, u64>>,
    /// Devices kept as they were because the kernel held their PF, to read again every
    /// [`HELD_RETRY`]; one task at a time does, while any are left.
    held: Mutex<HeldRetry>,
    /// Full scans owed (see [`Rescanner::owe_full_scan`]).
    owed: Mutex<OwedScan>,
}

/// See [`Rescanner::owed`]: how many full scans were owed, and whether a task is trying
/// one.
#[derive(Debug, Default)]
struct OwedScan {
    owed: u64,
    running: bool,
}

/// See [`Rescanner::held`].
#[derive(Debug, Default)]
struct HeldRetry {
    addresses: BTreeSet<PciAddress>,
    running: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    match l.read() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    match l.write() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Rescanner {
    /// `boot`: the boot's tag, which each device's instance carries (`None`: instances are
    /// not recorded).
    pub fn new(
        sysfs_root: PathBuf,
        dev_root: PathBuf,
        names: Arc<PciNames>,
        selection: Selection,
        writer: Writer,
        boot: Option<u64>,
    ) -> Self {
        Rescanner {
            sysfs_root,
            dev_root,
            names,
            selection: RwLock::new(selection),
            writer,
            boot,
            turn: Arc::new(tokio::sync::Mutex::new(())),
            seen_at: RwLock::new(BTreeMap::new()),
            held: Mutex::new(HeldRetry::default()),
            owed: Mutex::new(OwedScan::default()),
        }
    }

    /// Owes a full scan that the ledger must take (`why`: what could not be stored, a
    /// full disk above all): one task tries it after a wait that doubles from one second
    /// to half a minute, until a scan that began after the last owing applies.
    pub fn owe_full_scan(self: &Arc<Self>, why: &'static str) {
        {
            let mut owed = lock(&self.owed);
            owed.owed += 1;
            if owed.running {
                return;
            }
            owed.running = true;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let mut wait = Duration::from_secs(1);
            loop {
                let target = lock(&me.owed).owed;
                tokio::time::sleep(wait).await;
                match me.full(None).await {
                    Ok(()) => {
                        let mut owed = lock(&me.owed);
                        if owed.owed == target {
                            owed.running = false;
                            drop(owed);
                            me.writer.scan_stored();
                            tracing::info!(why, "the full scan owed is applied and stored");
                            return;
                        }
                        // Owed again while it ran: once more.
                        wait = Duration::from_secs(1);
                    }
                    Err(e) => {
                        wait = (wait * 2).min(Duration::from_secs(30));
                        tracing::warn!(error = %e, why, retry_in_s = wait.as_secs(), "the full scan owed still cannot be applied");
                    }
                }
            }
        });
    }

    /// The instance of a device whose sysfs directory has inode number `ino`, in this boot.
    fn instance(&self, ino: Option<u64>) -> Option<Instance> {
        Some(Instance {
            boot: self.boot?,
            ino: ino?,
        })
    }

    /// A full scan, applied to the ledger; with `selection`, that selection is used from
    /// now on (a reload).
    pub async fn full(self: &Arc<Self>, selection: Option<Selection>) -> Result<(), RescanError> {
        let _turn = self.turn.lock().await;
        let (root, dev, names) = (
            self.sysfs_root.clone(),
            self.dev_root.clone(),
            self.names.clone(),
        );
        let (seq, errors, sorted) = tokio::task::spawn_blocking(move || {
            let seq = sysfs::uevent_seqnum(&root);
            let inv = sysfs::scan(&root, &dev, &names)?;
            let sorted = sort(&root, &dev, &names, inv.devices)?;
            Ok::<_, SysfsError>((seq, inv.errors, sorted))
        })
        .await
        .map_err(|e| RescanError::Thread(e.to_string()))??;
        for e in &errors {
            tracing::warn!(problem = %e, "sysfs entry skipped");
        }
        let Sorted {
            read: mut devices,
            kept,
            held,
            ..
        } = sorted;
        for d in devices.iter().filter(|d| !d.errors.is_empty()) {
            tracing::warn!(device = %d.address, problems = ?d.errors, "device read with problems");
        }
        // A device kept as it was (see `Sorted::kept`) stays as the ledger has it, with
        // the details last published for it, under the selection in force now; one the
        // ledger lacks (or has gone) waits for its next read.
        let mut facts_kept = Vec::new();
        {
            let view = self.writer.view();
            for a in kept {
                if let Some(r) = view.ledger.record_at(a) {
                    match view.sysfs_device(&a) {
                        Some(last) => devices.push(last.clone()),
                        None => facts_kept.push(r.facts.clone()),
                    }
                }
            }
        }
        let sel = selection.unwrap_or_else(|| read(&self.selection).clone());
        // One fact per device, in order.
        let mut facts = sel.facts(&devices);
        for (f, d) in facts.iter_mut().zip(&devices) {
            f.instance = self.instance(d.instance);
        }
        facts.extend(facts_kept);
        // The sysfs details go out with the facts, in the same view; the selection
        // changes only once the ledger took the scan: a scan the ledger refused (a full
        // disk) leaves both as they were, and a retry finds the same differences again
        // (an owed hotplug rescan is retried; a refused reload is logged, and applies at
        // the next SIGHUP).
        let found: BTreeSet<PciAddress> = facts.iter().map(|f| f.address).collect();
        let before = self.present_records(found.iter().copied());
        let details: SysfsDevices = devices
            .into_iter()
            .map(|d| (d.address, Arc::new(d)))
            .collect();
        self.writer.scanned(facts, details).await?;
        *write(&self.selection) = sel;
        write(&self.seen_at).retain(|a, _| found.contains(a));
        self.note_found(seq, found.into_iter(), &before);
        self.read_again_when_let_go(held);
        Ok(())
    }

    /// The present record at each of `addresses` in the ledger now.
    fn present_records(
        &self,
        addresses: impl Iterator<Item = PciAddress>,
    ) -> BTreeMap<PciAddress, RecordId> {
        let view = self.writer.view();
        addresses
            .filter_map(|a| view.ledger.record_at(a).map(|r| (a, r.id)))
            .collect()
    }

    /// After a scan read at sequence number `seq` was applied: each of `found` (present
    /// in it) whose ledger record is new since `before` was made by this scan.
    fn note_found(
        &self,
        seq: Option<u64>,
        found: impl Iterator<Item = PciAddress>,
        before: &BTreeMap<PciAddress, RecordId>,
    ) {
        let now = self.present_records(found);
        let mut seen_at = write(&self.seen_at);
        for (a, id) in now {
            if before.get(&a) == Some(&id) {
                continue;
            }
            match seq {
                Some(seq) => seen_at.insert(a, seq),
                None => seen_at.remove(&a),
            };
        }
    }

    /// The removals that are of the device the ledger has at their address now: each
    /// numbered past the scan that made that device's record, or of unknown order. One
    /// at or below it is stale: that scan already found the device that came after it (the
    /// kernel sends the removals of the VFs a count change destroys while the change's
    /// own rescan finds the new ones), and applying it would take that new device, and
    /// any claim made on it since, for a removed one.
    ///
    /// `read_now` gives the inode number of the device directory at an address as read
    /// after the removals were received. Where it is the present record's instance, the
    /// removal is stale too, whatever its number: the kernel removes a device's directory
    /// before it sends the removal, so that device was not removed. (A scan that read
    /// the sequence number, then the device made again after a removal numbered above
    /// it, took that removal for its new device's before this.)
    fn own_removals(
        &self,
        removed: &Removals,
        read_now: impl Fn(PciAddress) -> Option<u64>,
    ) -> Vec<PciAddress> {
        let view = self.writer.view();
        let seen_at = read(&self.seen_at);
        removed
            .iter()
            .filter(|(a, seq)| match (seq, seen_at.get(a)) {
                (Some(seq), Some(seen)) => seen < seq,
                _ => true,
            })
            .filter(|(a, _)| {
                let present = view.ledger.record_at(**a).and_then(|r| r.facts.instance);
                let now = self.instance(read_now(**a));
                !(present.is_some() && present == now)
            })
            .map(|(a, _)| *a)
            .collect()
    }

    /// A full scan (lost uevents) after `removed`, PCI functions the kernel said it
    /// removed, leave the ledger: a device at one of their addresses now is a new one.
    pub async fn full_after(self: &Arc<Self>, removed: &Removals) -> Result<(), RescanError> {
        if !removed.is_empty() {
            let _turn = self.turn.lock().await;
            let root = self.sysfs_root.clone();
            let addresses: Vec<PciAddress> = removed.keys().copied().collect();
            let inodes: BTreeMap<PciAddress, u64> = tokio::task::spawn_blocking(move || {
                addresses
                    .into_iter()
                    .filter_map(|a| Some((a, sysfs::device_instance(&root, a)?)))
                    .collect()
            })
            .await
            .map_err(|e| RescanError::Thread(e.to_string()))?;
            let gone = self.own_removals(removed, |a| inodes.get(&a).copied());
            if !gone.is_empty() {
                let mut details = self.writer.view().sysfs.clone();
                for a in &gone {
                    details.remove(a);
                }
                self.writer
                    .rescanned(gone.iter().map(|a| (*a, None)).collect(), details)
                    .await?;
                let mut seen_at = write(&self.seen_at);
                for a in &gone {
                    seen_at.remove(a);
                }
            }
        }
        self.full(None).await
    }

    /// Rescans `addresses` and their PF/VF relatives (before and after the change), and
    /// applies only those devices: O(changed devices), not a full scan. Each of
    /// `removed` (a subset of `addresses`: PCI functions the kernel said it removed)
    /// leaves the ledger first, so a device found at its address now is a new one,
    /// without the old one's claim (which is kept, lost).
    pub async fn devices(
        self: &Arc<Self>,
        addresses: BTreeSet<PciAddress>,
        removed: &Removals,
    ) -> Result<(), RescanError> {
        if addresses.is_empty() {
            return Ok(());
        }
        let _turn = self.turn.lock().await;
        self.devices_in_turn(addresses, removed).await
    }

    /// Holds every other rescan off until the guard is dropped: taken before a hardware
    /// action, and handed to [`Self::around`].
    pub async fn hold(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.turn.clone().lock_owned().await
    }

    /// [`Self::hold`] without waiting: `None` while a rescan or a hardware action has the
    /// turn. For a caller that holds a lock which no one waiting for the turn may wait on
    /// (an acting audit holds the free checks' order).
    pub fn try_hold(&self) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        self.turn.clone().try_lock_owned().ok()
    }

    /// Runs a hardware action (a VF count change, a vfio-pci binding) with every other
    /// rescan held off (`held`, from [`Self::hold`]), then rescans the devices `then`
    /// names from its result, before any other rescan may apply. Without it, a hotplug
    /// rescan that read sysfs before the action and applied after it would bring back,
    /// free and claimable, the VFs the action destroyed (until their own events were
    /// read). Where the action left a PF held by the kernel (a VF count change that
    /// outlived its timeout), it and its VFs stay as the ledger has them until the kernel
    /// lets go (one task reads them again every second).
    pub async fn around<T>(
        self: &Arc<Self>,
        held: tokio::sync::OwnedMutexGuard<()>,
        action: impl std::future::Future<Output = T>,
        then: impl FnOnce(&T) -> BTreeSet<PciAddress>,
    ) -> (T, Result<(), RescanError>) {
        let _turn = held;
        let out = action.await;
        let addresses = then(&out);
        let rescanned = if addresses.is_empty() {
            Ok(())
        } else {
            self.devices_in_turn(addresses, &Removals::new()).await
        };
        (out, rescanned)
    }

    /// Reads `addresses` (kept as they were because the kernel held their PF) again
    /// every [`HELD_RETRY`], each rescan applying what the kernel lets go and keeping the
    /// rest for the next; one task does it while any are left, however many rescans
    /// meet the PF meanwhile (a client retrying a VF count change every second adds none).
    /// A uevent's rescan may get to them first: each reads what is there then.
    fn read_again_when_let_go(self: &Arc<Self>, addresses: BTreeSet<PciAddress>) {
        if addresses.is_empty() {
            return;
        }
        {
            let mut held = lock(&self.held);
            held.addresses.extend(addresses);
            if std::mem::replace(&mut held.running, true) {
                return;
            }
        }
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(HELD_RETRY).await;
                let addresses = {
                    let mut held = lock(&this.held);
                    if held.addresses.is_empty() {
                        held.running = false;
                        return;
                    }
                    std::mem::take(&mut held.addresses)
                };
                // Those still held come back to the set through this rescan.
                let n = addresses.len();
                match this.devices(addresses, &Removals::new()).await {
                    Ok(()) => tracing::debug!(devices = n, "devices of a held PF read again"),
                    // The uevents that follow a change rescan them again.
                    Err(e) => {
                        tracing::warn!(error = %e, "rescan of the devices of a held PF failed")
                    }
                }
            }
        });
    }

    /// [`Self::devices`], with the turn already taken.
    async fn devices_in_turn(
        self: &Arc<Self>,
        addresses: BTreeSet<PciAddress>,
        removed: &Removals,
    ) -> Result<(), RescanError> {
        // One level of relatives only: a VF's event rescans its PF (whose VF list
        // changed), not all the PF's other VFs, which have events of their own.
        let named = addresses;
        let mut wanted = named.clone();
        // Only rescans change the sysfs details, and they take turns: the published ones
        // are the last rescan's.
        let mut details = self.writer.view().sysfs.clone();
        for a in &named {
            relatives(details.get(a).map(|d| &**d), &mut wanted);
        }
        let (root, dev, names) = (
            self.sysfs_root.clone(),
            self.dev_root.clone(),
            self.names.clone(),
        );
        let (seq, scanned, held) = tokio::task::spawn_blocking(move || {
            let seq = sysfs::uevent_seqnum(&root);
            let mut out: BTreeMap<PciAddress, Option<PciDevice>> = BTreeMap::new();
            let mut queue: Vec<PciAddress> = wanted.into_iter().collect();
            while let Some(a) = queue.pop() {
                if out.contains_key(&a) {
                    continue;
                }
                let d = sysfs::scan_one(&root, &dev, &names, a)?;
                if named.contains(&a) {
                    let mut more = BTreeSet::new();
                    relatives(d.as_ref(), &mut more);
                    queue.extend(more.into_iter().filter(|m| !out.contains_key(m)));
                }
                out.insert(a, d);
            }
            // As in a full scan: a device removed while it was read is gone, and one kept
            // as it was has no change at all.
            let mut settled = BTreeMap::new();
            let mut present = Vec::with_capacity(out.len());
            for (a, d) in out {
                match d {
                    Some(d) => present.push(d),
                    None => {
                        settled.insert(a, None);
                    }
                }
            }
            let sorted = sort(&root, &dev, &names, present)?;
            settled.extend(sorted.gone.into_iter().map(|a| (a, None)));
            settled.extend(sorted.read.into_iter().map(|d| (d.address, Some(d))));
            Ok::<_, SysfsError>((seq, settled, sorted.held))
        })
        .await
        .map_err(|e| RescanError::Thread(e.to_string()))??;
        let gone = self.own_removals(removed, |a| {
            scanned
                .get(&a)
                .and_then(|d| d.as_ref())
                .and_then(|d| d.instance)
        });
        let mut changes: Vec<(PciAddress, Option<DeviceFacts>)> =
            gone.iter().map(|a| (*a, None)).collect();
        {
            let sel = read(&self.selection);
            for (a, d) in &scanned {
                let facts = d.as_ref().map(|d| {
                    if !d.errors.is_empty() {
                        tracing::warn!(device = %a, problems = ?d.errors, "device read with problems");
                    }
                    // The PF as just scanned, else as the inventory has it.
                    let pf_netdevs: &[String] = d
                        .physfn
                        .and_then(|pf| match scanned.get(&pf) {
                            Some(fresh) => fresh.as_ref(),
                            None => details.get(&pf).map(|d| &**d),
                        })
                        .map(|pf| pf.netdevs.as_slice())
                        .unwrap_or(&[]);
                    DeviceFacts {
                        instance: self.instance(d.instance),
                        ..sel.fact(d, pf_netdevs)
                    }
                });
                changes.push((*a, facts));
            }
        }
        tracing::debug!(
            devices = changes.len(),
            removed = gone.len(),
            stale_removals = removed.len() - gone.len(),
            "partial rescan"
        );
        // As for a full scan: the sysfs details go out with the facts.
        let before = self.present_records(scanned.keys().copied());
        for (a, d) in &scanned {
            match d {
                Some(d) => {
                    details.insert(*a, Arc::new(d.clone()));
                }
                None => {
                    details.remove(a);
                }
            }
        }
        self.writer.rescanned(changes, details).await?;
        let found: Vec<PciAddress> = scanned
            .iter()
            .filter(|(_, d)| d.is_some())
            .map(|(a, _)| *a)
            .collect();
        {
            let mut seen_at = write(&self.seen_at);
            for (a, d) in &scanned {
                if d.is_none() {
                    seen_at.remove(a);
                }
            }
        }
        self.note_found(seq, found.into_iter(), &before);
        self.read_again_when_let_go(held);
        Ok(())
    }
}

/// Adds a device's PF and VFs to `set`.
fn relatives(dev: Option<&PciDevice>, set: &mut BTreeSet<PciAddress>) {
    let Some(d) = dev else { return };
    if let Some(pf) = d.physfn {
        set.insert(pf);
    }
    if let Some(s) = &d.sriov {
        set.extend(s.vfs.iter().copied());
    }
}
