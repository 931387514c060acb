//! The single writer: one lock owns the ledger and the store, one thread applies the
//! queued commands in batches (group commit), and each durable commit publishes a read
//! snapshot and change events.
//!
//! Why one writer: every mutation is decided against the same in-memory ledger in one
//! order, so two controllers racing for one VF get exactly one winner. Why batches: the
//! fsync is the cost of a change, so every command waiting when the writer wakes is
//! decided in order and made durable by one transaction. Each caller is answered only
//! after the transaction that holds its change has committed (I4); if the commit fails,
//! every change of the batch is undone in memory and every caller whose answer rested on
//! it gets the error (a refusal or a replay decided before any change of the batch keeps
//! its own answer).
//!
//! Why a lock and not only the thread: with nothing queued, a claim, release or transfer
//! is decided and committed on the async worker that received it, under the same lock,
//! instead of waking the writer thread and then being woken by it. On a quiet host those
//! two wake-ups were a tenth of a request's round trip (see `Core::try_inline`).

use std::collections::VecDeque;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use imbl::OrdMap;
use tokio::sync::{mpsc, oneshot};

use crate::hardware::{Hardware, HardwareError};
use crate::ledger::{
    ChangeSet, ClaimRequest, DeviceFacts, DeviceState, DeviceView, DomainDevices, Ledger,
    LedgerError, Outcome, RecordId, ReleaseRequest, RequestEntry, RequestKey, Stray,
    TransferRequest,
};
use crate::metrics::{Metrics, Op};
use crate::pci::{ConsumerId, Generation, PciAddress, RequestId};
use crate::store::{Store, StoreError};
use crate::sysfs::PciDevice;

mod closed;
mod events;
mod hardware;
#[cfg(test)]
mod tests;
pub use events::{Event, EventBuffer, EventLog};
pub use hardware::{BindVfio, Bound, SetVfCount, VfBegun, VfChange, VfCountSet, VfWritten};

/// How many commands one batch takes at most.
const MAX_BATCH: usize = 512;
/// Batches that touch more records than this re-derive every device state (a rescan).
const INCREMENTAL_LIMIT: usize = 256;
/// How often at most the writer hands freed memory back to the kernel when it goes idle.
const TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Why the writer could not carry out a command.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("the change was not made durable, so it was not made: {0}")]
    Store(#[source] Arc<StoreError>),
    #[error("the agent is shutting down; nothing was changed")]
    ShuttingDown,
    /// The disk failed while the commit holding this change was made durable: the
    /// change may stand or not. The agent stops; its next start reads back what the
    /// disk holds, and GetRequestOutcome then answers.
    #[error("{0}: this change may or may not have been made; the agent stops so that its next start reads back what the disk holds, and GetRequestOutcome then answers for this request id")]
    OutcomeUnknown(#[source] Arc<StoreError>),
    /// An earlier commit's outcome is unknown (see `OutcomeUnknown`): nothing more is
    /// decided until the agent has started again.
    #[error("the agent's store failed mid-commit ({0}); nothing was changed; the agent is stopping so that its next start reads back what the disk holds")]
    StoreFailed(String),
    #[error(transparent)]
    Hardware(#[from] HardwareError),
    /// A release reached the device's generation only after the service had looked at
    /// the device, so the checks a free needs were not made for it: nothing was freed.
    #[error("{address} reached generation {generation} while this release was on its way, after the agent had looked at it, so it was not checked free of domains and VFIO holders at that generation; nothing was freed; read the device again and release it with its generation")]
    ChangedWhileChecked {
        address: PciAddress,
        generation: Generation,
    },
    /// GetRequestOutcome already answered that this request id was not applied.
    #[error("request {request_id} of consumer {consumer} was closed: GetRequestOutcome answered that it was not applied, so nothing sent with it applies afterwards; nothing was changed; send the request again with a new request id")]
    RequestClosed {
        consumer: ConsumerId,
        request_id: RequestId,
    },
    /// The request id names a VF count change that wrote to sysfs and was not logged.
    #[error("request {request_id} of consumer {consumer} changed the VF count of {pf} and was not recorded (its write failed part way or ended past its timeout, or the disk refused its record): it is neither applied as asked nor undone; the PF as listed now says what it has; nothing is closed")]
    VfCountNotRecorded {
        consumer: ConsumerId,
        request_id: RequestId,
        pf: PciAddress,
    },
    /// The scan made at start is not stored yet (see [`Writer::changes_wait_for_scan`]).
    #[error("{0}, so the ledger may not match the devices present: nothing is changed until that scan, tried again, is stored; nothing was changed; try again shortly")]
    ScanNotStored(&'static str),
    /// A binding's retry would move devices again (a member is off vfio-pci now), and the
    /// caller did not list the domains afresh first: it is to list them and ask again.
    #[error("the binding of {address} would move devices again, which needs libvirt's domains listed afresh first; nothing was changed; try again")]
    ListingNeeded { address: PciAddress },
    /// The request id names a VF count change still under way: neither applied nor
    /// refused yet.
    #[error("request {request_id} of consumer {consumer} is still being applied: the VF count of {pf} is being written (or its record waits for the disk); nothing was changed by this call; ask again once the kernel has answered that write")]
    RequestInProgress {
        consumer: ConsumerId,
        request_id: RequestId,
        pf: PciAddress,
    },
}

type Reply<T> = oneshot::Sender<Result<T, WriteError>>;

/// The answer to a mutating request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub outcome: Outcome,
    /// True when the ledger replayed an earlier identical request (nothing changed).
    pub replayed: bool,
}

/// One orphan to free during an acting reconcile: freed only if its record still has
/// this generation and owner. Logged under `request_id`, its own (the audit's id with the
/// device's address, [`RequestId::per_device`]): an owner's orphans are separate requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrphanFree {
    pub address: PciAddress,
    pub consumer: ConsumerId,
    pub generation: Generation,
    pub request_id: RequestId,
}

/// What an acting reconcile's frees came to.
#[derive(Debug)]
pub struct OrphansFreed {
    /// For each orphan sent, in order.
    pub results: Vec<Result<Applied, WriteError>>,
    /// The frees that earlier attempts with the same audit id logged, oldest first
    /// (empty on a first attempt): a retry whose first answer was lost learns them here,
    /// since those devices are no longer orphans. A client's own request logged under an
    /// id of the same form (`<audit id>@<address>`) would show here too.
    pub earlier: Vec<RequestEntry>,
}

/// What sysfs showed of each present device (names, driver, netdevs, SR-IOV, IOMMU),
/// as of the scan the ledger last took: published in every view with the ledger, so that
/// an answer's hardware details and its claims come from the same moment.
pub type SysfsDevices = OrdMap<PciAddress, Arc<PciDevice>>;

/// A command for the writer.
#[derive(Debug)]
pub enum Command {
    Claim(ClaimRequest, Reply<Applied>),
    /// A release, and whether its caller checked the device free to release at the
    /// presented generation (see [`Writer::release`]).
    Release(ReleaseRequest, bool, Reply<Applied>),
    Transfer(TransferRequest, Reply<Applied>),
    /// A full inventory scan, with what sysfs showed of every device after it (`None`:
    /// left as it is).
    Inventory(Vec<DeviceFacts>, Option<SysfsDevices>, Reply<()>),
    /// Some devices rescanned (`None` means gone), with what sysfs showed of every device
    /// after them (`None`: left as it is).
    Devices(
        Vec<(PciAddress, Option<DeviceFacts>)>,
        Option<SysfsDevices>,
        Reply<()>,
    ),
    Domains(Vec<DomainDevices>, Reply<()>),
    /// Answered once every command queued before it is decided and committed.
    Sync(Reply<()>),
    /// Like `Sync`, then the request's recorded outcome (from memory or the store); with
    /// `close` and no outcome, the request id is closed, so that nothing sent with it
    /// applies afterwards.
    Settle {
        consumer: ConsumerId,
        request_id: RequestId,
        close: bool,
        reply: Reply<Option<RequestEntry>>,
    },
    /// Free orphans found by an acting reconcile with the given audit id (each result in
    /// order), and say what earlier attempts with that id freed.
    FreeOrphans(RequestId, Vec<OrphanFree>, Reply<OrphansFreed>),
    /// Bind a claimed device's IOMMU group to vfio-pci (decided and done alone).
    BindVfio(BindVfio, Reply<Bound>),
    /// Begin a change of a PF's VF count: checked, and its devices held back from
    /// claims, while the writes run elsewhere.
    BeginVfCount(SetVfCount, Reply<VfBegun>),
    /// Record what a VF count change wrote, and end it.
    EndVfCount(Box<VfWritten>, Reply<VfCountSet>),
}

/// A consistent read view, published after every commit.
///
/// Publishing one is cheap: the ledger is a structurally shared clone, the derived states
/// are a structurally shared map in which a batch of claims and releases re-derives only
/// the records around the ones it changed, and the per-device list is built on first
/// read. Batches that change the inventory or the domains re-derive every state.
#[derive(Debug, Default)]
pub struct View {
    pub host_generation: Generation,
    /// What sysfs showed of each present device, as of the scan this view's ledger took.
    pub sysfs: SysfsDevices,
    /// The strays by address (only addresses that have one).
    strays: OrdMap<PciAddress, Vec<Stray>>,
    /// The committed ledger (records, request log), shared with the writer's copy.
    pub ledger: Ledger,
    states: OrdMap<RecordId, DeviceState>,
    devices: std::sync::OnceLock<Vec<DeviceView>>,
}

impl View {
    fn new(ledger: &Ledger) -> View {
        let d = Derived::all(ledger);
        View::with(ledger, d.states, d.strays, SysfsDevices::new())
    }

    fn with(
        ledger: &Ledger,
        states: OrdMap<RecordId, DeviceState>,
        strays: OrdMap<PciAddress, Vec<Stray>>,
        sysfs: SysfsDevices,
    ) -> View {
        View {
            host_generation: ledger.host_generation(),
            sysfs,
            strays,
            states,
            ledger: ledger.clone(),
            devices: std::sync::OnceLock::new(),
        }
    }

    /// What sysfs showed of the device at `address`, as of this view.
    pub fn sysfs_device(&self, address: &PciAddress) -> Option<&PciDevice> {
        self.sysfs.get(address).map(|d| &**d)
    }

    /// Every record with its derived state, by address (present first, then lost).
    pub fn devices(&self) -> &[DeviceView] {
        self.devices
            .get_or_init(|| self.ledger.views_with(|id| self.states.get(&id)))
    }

    /// Domains that use a device without holding its claim, by address.
    pub fn strays(&self) -> impl Iterator<Item = &Stray> {
        self.strays.values().flatten()
    }

    /// How many strays [`View::strays`] lists.
    pub fn stray_count(&self) -> usize {
        self.strays.values().map(Vec::len).sum()
    }

    /// Every record's derived state, by record id.
    pub fn states(&self) -> &OrdMap<RecordId, DeviceState> {
        &self.states
    }

    /// The derived state of a record in this view.
    pub fn state(&self, id: RecordId) -> Option<&DeviceState> {
        self.states.get(&id)
    }

    /// The records at one address (the present instance first, then lost claims), without
    /// building the whole device list.
    pub fn device(&self, address: PciAddress) -> impl Iterator<Item = DeviceView> + '_ {
        self.ledger.records_at(address).filter_map(|r| {
            self.states.get(&r.id).map(|s| DeviceView {
                record: r.clone(),
                state: s.clone(),
            })
        })
    }
}

/// The handle the rest of the agent uses: send commands, read views, follow events.
#[derive(Debug, Clone)]
pub struct Writer {
    tx: mpsc::Sender<Command>,
    core: Arc<Core>,
    view: Arc<RwLock<Arc<View>>>,
    events: Arc<Mutex<EventLog>>,
    /// The last commit's error, cleared by the next successful commit.
    store_error: Arc<Mutex<Option<String>>>,
    metrics: Arc<Metrics>,
    /// Turns true once a commit's outcome is unknown (the writer then decides nothing).
    failed: tokio::sync::watch::Receiver<bool>,
    /// Whether a listing of libvirt's domains was applied since this agent started.
    domains_listed: Arc<std::sync::atomic::AtomicBool>,
    /// Why no change may be made yet: the start's scan could not be stored (a full
    /// disk), so the ledger may not match the devices present until it is.
    scan_owed: Arc<Mutex<Option<&'static str>>>,
}

/// How many unrecorded VF count changes' request ids are remembered.
const UNRECORDED_VF_REQUESTS: usize = 1024;

fn lock_scan<'a>(
    m: &'a Mutex<Option<&'static str>>,
) -> std::sync::MutexGuard<'a, Option<&'static str>> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Writer {
    /// Starts the writer thread over a loaded ledger and its store. The thread ends when
    /// every `Writer` handle is dropped; `join` on the returned handle waits for it.
    pub fn start(
        ledger: Ledger,
        store: Store,
        event_capacity: usize,
    ) -> std::io::Result<(Writer, std::thread::JoinHandle<()>)> {
        Self::start_with(ledger, store, EventBuffer::events(event_capacity), None)
    }

    /// Like [`Writer::start`], with hardware actions (vfio-pci binding, VF counts) on
    /// the given sysfs root; `None` refuses them.
    pub fn start_with(
        ledger: Ledger,
        store: Store,
        events: EventBuffer,
        hardware: Option<Hardware>,
    ) -> std::io::Result<(Writer, std::thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel(4096);
        let worker = Worker::new(ledger, store, events, hardware);
        let (view, events, store_error, metrics, failed) = (
            worker.view.clone(),
            worker.events.clone(),
            worker.store_error.clone(),
            worker.metrics.clone(),
            worker.failed_tx.subscribe(),
        );
        let core = Arc::new(Core {
            failed_tx: worker.failed_tx.clone(),
            store_error: worker.store_error.clone(),
            worker: Mutex::new(worker),
            queued: AtomicUsize::new(0),
        });
        let thread_core = core.clone();
        let handle = std::thread::Builder::new()
            .name("hostdevd-writer".into())
            .spawn(move || {
                let run = std::panic::AssertUnwindSafe(|| thread_core.run(rx));
                if std::panic::catch_unwind(run).is_err() {
                    thread_core.broken();
                }
            })?;
        Ok((
            Writer {
                tx,
                core,
                view,
                events,
                store_error,
                metrics,
                failed,
                domains_listed: Arc::default(),
                scan_owed: Arc::default(),
            },
            handle,
        ))
    }

    /// Resolves once a commit's outcome is unknown (the disk failed mid-commit): the
    /// agent must stop, so that its next start reads back what the disk holds.
    pub async fn failed(&self) {
        let mut rx = self.failed.clone();
        if rx.wait_for(|f| *f).await.is_err() {
            // The writer is gone without failing: never.
            std::future::pending::<()>().await;
        }
    }

    /// Why the writer stopped deciding, once a commit's outcome is unknown.
    pub fn failure(&self) -> Option<String> {
        (*self.failed.borrow()).then(|| self.store_health().unwrap_or_default())
    }

    /// The latest committed view.
    pub fn view(&self) -> Arc<View> {
        match self.view.read() {
            Ok(v) => v.clone(),
            // A poisoned lock means a writer panic mid-publish; the Arc inside is still a
            // complete earlier view.
            Err(p) => p.into_inner().clone(),
        }
    }

    pub fn events(&self) -> &Arc<Mutex<EventLog>> {
        &self.events
    }

    /// The agent's counters (requests, rejections, commit latency).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// `None` when the last commit succeeded and no scan is owed, else why not.
    pub fn store_health(&self) -> Option<String> {
        let error = match self.store_error.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        };
        error.or_else(|| {
            self.scan_owed().map(|why| {
                format!("{why}: changes are refused until the scan, tried again, is stored")
            })
        })
    }

    /// Refuses every change from now until [`Self::scan_stored`]: the scan made at start
    /// (`why`: it could not be stored) has to reach the ledger first, or a change could
    /// be decided on devices that are gone or made again while the agent was stopped.
    pub fn changes_wait_for_scan(&self, why: &'static str) {
        *lock_scan(&self.scan_owed) = Some(why);
    }

    /// A full scan was stored: changes are decided again.
    pub fn scan_stored(&self) {
        *lock_scan(&self.scan_owed) = None;
    }

    fn scan_owed(&self) -> Option<&'static str> {
        *lock_scan(&self.scan_owed)
    }

    /// Refused while a scan is owed (see [`Self::changes_wait_for_scan`]), unless the
    /// request id (`request`) is logged: a retry of a request applied before is
    /// answered from the log as ever, changing nothing (told "unavailable", its client
    /// could give up on a claim that stands). Checked before the change is sent: once
    /// cleared the flag is never set again, so a change let through is decided on a
    /// ledger that took the scan.
    async fn check_scan(
        &self,
        request: Option<(ConsumerId, &RequestId)>,
    ) -> Result<(), WriteError> {
        let Some(why) = self.scan_owed() else {
            return Ok(());
        };
        if let Some((consumer, request_id)) = request {
            if self.lookup(consumer, request_id.clone()).await?.is_some() {
                return Ok(());
            }
        }
        Err(WriteError::ScanNotStored(why))
    }

    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, WriteError> {
        let (reply, rx) = oneshot::channel();
        match self.core.try_inline(make(reply)) {
            Inline::Queue(cmd) => {
                // Counted only once its place in the queue is taken: a caller dropped
                // while waiting for room (its client gone) leaves no count behind.
                let permit = self
                    .tx
                    .reserve()
                    .await
                    .map_err(|_| WriteError::ShuttingDown)?;
                self.core.queued.fetch_add(1, Ordering::SeqCst);
                permit.send(cmd);
            }
            Inline::Done {
                chores,
                woke_watchers,
            } => {
                if chores {
                    // The request log's prune and the memory trim are the writer
                    // thread's (they take milliseconds, which no request should wait
                    // for): an empty batch wakes it for them. A full queue means the
                    // thread is busy and does them after that batch.
                    let (nudge, _) = oneshot::channel();
                    self.core.queued.fetch_add(1, Ordering::SeqCst);
                    if self.tx.try_send(Command::Sync(nudge)).is_err() {
                        self.core.queued.fetch_sub(1, Ordering::SeqCst);
                    }
                }
                // The commit woke the watchers onto this worker's queue: let them go
                // before this caller's answer, as they would have with the writer
                // thread. Without this, a busy client answered at once kept 100
                // watchers' p99 at 12-18 ms (4 ms with it, on two CPUs that also ran
                // the watchers' clients). With no watcher there is nobody to let go
                // first, and the yield would cost the answer a poll of the I/O driver
                // and a wake-up of another async worker: about two context switches a
                // lone call (benches/HISTORY.md).
                if woke_watchers {
                    tokio::task::yield_now().await;
                }
            }
        }
        rx.await.map_err(|_| WriteError::ShuttingDown)?
    }

    pub async fn claim(&self, req: ClaimRequest) -> Result<Applied, WriteError> {
        self.check_scan(Some((req.owner.consumer, &req.request_id)))
            .await?;
        self.call(|r| Command::Claim(req, r)).await
    }
    /// A release whose caller checked, for the presented generation, what a free needs
    /// beyond the ledger (the service: libvirt listed afresh, no VFIO holder).
    pub async fn release(&self, req: ReleaseRequest) -> Result<Applied, WriteError> {
        self.check_scan(Some((req.consumer, &req.request_id)))
            .await?;
        self.call(|r| Command::Release(req, true, r)).await
    }

    /// A release whose caller did not check the device, because the presented
    /// generation was not the device's when it looked (the ledger will refuse it as
    /// stale, or replay it). Should the device reach that generation before the writer
    /// decides, it is refused all the same ([`WriteError::ChangedWhileChecked`]): a
    /// release frees a present device only after the checks for its generation.
    pub async fn release_unchecked(&self, req: ReleaseRequest) -> Result<Applied, WriteError> {
        self.check_scan(Some((req.consumer, &req.request_id)))
            .await?;
        self.call(|r| Command::Release(req, false, r)).await
    }
    pub async fn transfer(&self, req: TransferRequest) -> Result<Applied, WriteError> {
        self.check_scan(Some((req.from, &req.request_id))).await?;
        self.call(|r| Command::Transfer(req, r)).await
    }
    pub async fn inventory(&self, facts: Vec<DeviceFacts>) -> Result<(), WriteError> {
        self.call(|r| Command::Inventory(facts, None, r)).await
    }
    /// A full scan's facts and what sysfs showed of every device, published together.
    pub async fn scanned(
        &self,
        facts: Vec<DeviceFacts>,
        sysfs: SysfsDevices,
    ) -> Result<(), WriteError> {
        self.call(|r| Command::Inventory(facts, Some(sysfs), r))
            .await
    }
    pub async fn devices(
        &self,
        changes: Vec<(PciAddress, Option<DeviceFacts>)>,
    ) -> Result<(), WriteError> {
        self.call(|r| Command::Devices(changes, None, r)).await
    }
    /// Some devices' new facts (`None`: gone) and what sysfs showed of every device after
    /// them, published together.
    pub async fn rescanned(
        &self,
        changes: Vec<(PciAddress, Option<DeviceFacts>)>,
        sysfs: SysfsDevices,
    ) -> Result<(), WriteError> {
        self.call(|r| Command::Devices(changes, Some(sysfs), r))
            .await
    }
    /// Returns once every command sent before it has been decided and committed.
    pub async fn sync(&self) -> Result<(), WriteError> {
        self.call(Command::Sync).await
    }
    /// Once every command sent before it is decided and committed: the request's
    /// recorded outcome, or `None`, and then the request id is closed (a later Claim,
    /// Release or Transfer with it is refused with [`WriteError::RequestClosed`]).
    pub async fn settle(
        &self,
        consumer: ConsumerId,
        request_id: RequestId,
    ) -> Result<Option<RequestEntry>, WriteError> {
        self.settle_or_look(consumer, request_id, true).await
    }
    /// Once every command sent before it is decided and committed: the request's
    /// recorded outcome, or `None`. Closes nothing.
    pub async fn lookup(
        &self,
        consumer: ConsumerId,
        request_id: RequestId,
    ) -> Result<Option<RequestEntry>, WriteError> {
        self.settle_or_look(consumer, request_id, false).await
    }
    async fn settle_or_look(
        &self,
        consumer: ConsumerId,
        request_id: RequestId,
        close: bool,
    ) -> Result<Option<RequestEntry>, WriteError> {
        self.call(|reply| Command::Settle {
            consumer,
            request_id,
            close,
            reply,
        })
        .await
    }
    pub async fn domains(&self, domains: Vec<DomainDevices>) -> Result<(), WriteError> {
        self.call(|r| Command::Domains(domains, r)).await?;
        self.domains_listed.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Whether a listing of libvirt's domains was applied since this agent started:
    /// until then the ledger cannot see a domain that uses a device without a claim.
    pub fn domains_listed(&self) -> bool {
        self.domains_listed.load(Ordering::SeqCst)
    }
    pub async fn free_orphans(
        &self,
        audit: RequestId,
        orphans: Vec<OrphanFree>,
    ) -> Result<OrphansFreed, WriteError> {
        self.check_scan(None).await?;
        self.call(|r| Command::FreeOrphans(audit, orphans, r)).await
    }
    pub async fn bind_vfio(&self, req: BindVfio) -> Result<Bound, WriteError> {
        let logged = req.request_id.as_ref().map(|id| (req.consumer, id));
        self.check_scan(logged).await?;
        self.call(|r| Command::BindVfio(req, r)).await
    }
    /// Changes a PF's VF count: checked and recorded by the writer, written off its
    /// thread, so that requests on the host's other devices are decided meanwhile (the
    /// kernel may take minutes); the PF and its VFs are held back from claims until it
    /// is recorded.
    ///
    /// Whatever becomes of the writes, the change is recorded: where their task ends
    /// without an answer (it panicked), or this future is dropped before the end is
    /// recorded, as a write that may have destroyed the VFs (the side that hands no
    /// destroyed VF out), with the PF's devices held back until then.
    pub async fn set_vf_count(&self, req: SetVfCount) -> Result<VfCountSet, WriteError> {
        let logged = req.request.as_ref().map(|(c, id)| (*c, id));
        self.check_scan(logged).await?;
        let change = match self.call(|r| Command::BeginVfCount(req, r)).await? {
            VfBegun::Change(change) => change,
            VfBegun::Replayed(first) => return Ok(first),
        };
        let mut unanswered = EndOnDrop {
            writer: self.clone(),
            end: Some(change.unanswered("the change was dropped before it was recorded")),
        };
        let written = match tokio::task::spawn_blocking(move || change.write()).await {
            Ok(w) => w,
            Err(e) => {
                tracing::error!(error = %e, "the task writing a VF count ended without an answer");
                let Some(mut end) = unanswered.end.take() else {
                    return Err(WriteError::ShuttingDown);
                };
                end.abandoned(e.to_string());
                end
            }
        };
        // Recorded from a task of its own, so that this future dropped while the end
        // waits for room in the queue cannot drop the end with it.
        let writer = self.clone();
        let recorded = tokio::spawn(async move {
            writer
                .call(|r| Command::EndVfCount(Box::new(written), r))
                .await
        });
        unanswered.end = None;
        recorded.await.unwrap_or(Err(WriteError::ShuttingDown))
    }
}

/// Records a VF count change's end as unanswered if dropped while it still holds one
/// (the future carrying the change was dropped): queued without waiting, so a drop
/// never blocks; a full queue or a stopped writer drops it, and with it the change's
/// token, which lets the devices go.
struct EndOnDrop {
    writer: Writer,
    end: Option<VfWritten>,
}

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        let Some(end) = self.end.take() else {
            return;
        };
        let (reply, _) = oneshot::channel();
        self.writer.core.queued.fetch_add(1, Ordering::SeqCst);
        if self
            .writer
            .tx
            .try_send(Command::EndVfCount(Box::new(end), reply))
            .is_err()
        {
            self.writer.core.queued.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A decided command waiting for its batch to commit.
enum Pending {
    Applied(Reply<Applied>, Op, Result<Applied, LedgerError>),
    /// Refused before the ledger was asked (a closed request id, or a request log that
    /// could not be read).
    Refused(Reply<Applied>, WriteError),
    /// GetRequestOutcome's answer, and the request id it closed, if it did.
    Entry(
        Reply<Option<RequestEntry>>,
        Result<Option<RequestEntry>, WriteError>,
        Option<RequestKey>,
    ),
    Unit(Reply<()>),
    Orphans(Reply<OrphansFreed>, OrphansFreed),
}

/// The writer's state and who may use it: the writer thread, or a caller deciding its
/// own command in place when nothing else is waiting (see [`Core::try_inline`]).
struct Core {
    worker: Mutex<Worker>,
    /// Commands sent to the writer thread and not yet taken up by it (a command the
    /// thread set aside to run alone after the current batch still counts).
    queued: AtomicUsize,
    /// The worker's, reachable without its lock: a panic mid-decision poisons the lock
    /// and leaves the worker's state unknown, and the agent must then stop as for a
    /// commit whose outcome is unknown ([`Core::broken`]).
    failed_tx: Arc<tokio::sync::watch::Sender<bool>>,
    store_error: Arc<Mutex<Option<String>>>,
}

impl Core {
    /// A decision panicked (on the writer thread, or on a caller deciding in its place):
    /// what it changed in memory is unknown, so nothing more is decided, and the agent
    /// stops (as [`Writer::failed`] says) so that its next start reads back what the disk
    /// holds. Until then every change is refused.
    fn broken(&self) {
        let why = "a decision failed unexpectedly (a panic; see the log); nothing more is decided, and the agent stops so that its next start reads back what the disk holds".to_string();
        tracing::error!("{why}");
        match self.store_error.lock() {
            Ok(mut g) => *g = Some(why),
            Err(p) => *p.into_inner() = Some(why),
        }
        self.failed_tx.send_replace(true);
    }
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("queued", &self.queued.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Core {
    /// Decides and commits a claim, release or transfer on the caller's thread when the
    /// writer is idle, saving the two thread wake-ups of a trip through the writer
    /// thread (one there, one back), which on a lightly loaded host are a good part of a
    /// request's latency. Returns the command when it must go to the writer thread
    /// instead: other commands are queued or being decided (so nothing is overtaken and
    /// group commit under load is kept), the command acts on hardware, or the caller is
    /// not on a multi-threaded runtime with another worker to keep serving while this
    /// one waits for the commit. The answer goes to the command's reply either way.
    fn try_inline(&self, cmd: Command) -> Inline {
        if !matches!(
            cmd,
            Command::Claim(..) | Command::Release(..) | Command::Transfer(..)
        ) || self.queued.load(Ordering::SeqCst) != 0
            || !spare_worker()
        {
            return Inline::Queue(cmd);
        }
        let mut worker = match self.worker.try_lock() {
            Ok(w) => w,
            Err(std::sync::TryLockError::WouldBlock) => return Inline::Queue(cmd),
            Err(std::sync::TryLockError::Poisoned(_)) => {
                self.broken();
                return Inline::Queue(cmd);
            }
        };
        if worker.acts_on_hardware(&cmd) {
            return Inline::Queue(cmd);
        }
        worker.woke_watchers = false;
        worker.run_batch(vec![cmd]);
        worker.metrics.inline_batch();
        Inline::Done {
            chores: worker.store.prune_due() || worker.trimmer.due(),
            woke_watchers: std::mem::take(&mut worker.woke_watchers),
        }
    }

    /// The writer thread: takes every command queued, in order, in batches. Ends when
    /// every sender is gone, or when the worker's lock was poisoned by a panic mid-batch
    /// (the senders then see [`WriteError::ShuttingDown`], and the agent is told to stop:
    /// [`Core::broken`]).
    fn run(&self, mut rx: mpsc::Receiver<Command>) {
        // A command that acts on hardware ends the batch before it and runs alone: its
        // sysfs writes happen between two commits, with no other decision in between.
        let mut next: Option<Command> = None;
        loop {
            let first = match next.take() {
                Some(c) => c,
                None => match rx.try_recv() {
                    Ok(c) => c,
                    Err(_) => {
                        // Nothing waiting: a moment to give back what the last burst freed.
                        match self.worker.lock() {
                            Ok(mut w) => w.trimmer.maybe_trim(),
                            Err(_) => return self.broken(),
                        };
                        match rx.blocking_recv() {
                            Some(c) => c,
                            None => return,
                        }
                    }
                },
            };
            let Ok(mut worker) = self.worker.lock() else {
                return self.broken();
            };
            // Taken out of the queue under the lock, so nothing can overtake them now:
            // they stop counting before their answers go out, and a caller answered
            // here finds the queue as it is for its next command.
            if worker.acts_on_hardware(&first) {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                worker.run_alone(first);
                worker.prune();
                continue;
            }
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(cmd) if worker.acts_on_hardware(&cmd) => {
                        next = Some(cmd);
                        break;
                    }
                    Ok(cmd) => batch.push(cmd),
                    Err(_) => break,
                }
            }
            self.queued.fetch_sub(batch.len(), Ordering::SeqCst);
            worker.run_batch(batch);
            worker.prune();
        }
    }
}

/// Every record's derived state and the strays by address, as a view holds them.
struct Derived {
    states: OrdMap<RecordId, DeviceState>,
    strays: OrdMap<PciAddress, Vec<Stray>>,
}

impl Derived {
    /// Derived afresh from the whole ledger.
    fn all(ledger: &Ledger) -> Derived {
        let mut strays: OrdMap<PciAddress, Vec<Stray>> = OrdMap::new();
        for s in ledger.strays() {
            strays.entry(s.address).or_default().push(s);
        }
        Derived {
            states: ledger.states().into_iter().collect(),
            strays,
        }
    }
}

/// A batch worked out before its commit, to publish once it is durable.
struct Prepared {
    view: View,
    /// Sorted by generation, each generation once.
    events: Vec<Event>,
    /// The generation each written record had before the batch (for the log).
    old_generations: BTreeMap<RecordId, Generation>,
    new_strays: Vec<Stray>,
    /// The host generation raised past the events' generations (see `prepare`), as a
    /// change to store where the batch stores nothing else.
    raised: Option<ChangeSet>,
}

/// What an incremental view re-derived: the records whose states it derived again, and
/// the addresses whose strays it listed again.
struct Rederived {
    ids: BTreeSet<RecordId>,
    stray_addresses: Vec<PciAddress>,
}

/// What became of a command offered to [`Core::try_inline`].
enum Inline {
    /// Decided and committed; its reply is sent. `chores`: the writer thread has a
    /// prune or a memory trim to do. `woke_watchers`: the commit's events were sent to
    /// at least one watcher.
    Done { chores: bool, woke_watchers: bool },
    /// For the writer thread.
    Queue(Command),
}

/// Whether the caller runs on a multi-threaded tokio runtime with at least two workers,
/// so that blocking this one for a commit leaves another to serve.
fn spare_worker() -> bool {
    tokio::runtime::Handle::try_current().is_ok_and(|h| {
        h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
            && h.metrics().num_workers() >= 2
    })
}

struct Worker {
    ledger: Ledger,
    store: Store,
    view: Arc<RwLock<Arc<View>>>,
    events: Arc<Mutex<EventLog>>,
    store_error: Arc<Mutex<Option<String>>>,
    metrics: Arc<Metrics>,
    hardware: Option<Hardware>,
    /// What a scan in the batch being decided brings, published only once it commits
    /// (until then, every view carries the last view's).
    next_sysfs: Option<SysfsDevices>,
    /// Hands the pages freed by bursts of work back to the kernel once the writer is
    /// idle (see `memory`).
    trimmer: crate::memory::Trimmer,
    /// Request ids GetRequestOutcome answered as not applied.
    closed: closed::ClosedRequests,
    /// Set once a commit's outcome is unknown: from then on nothing is decided.
    failed: Option<String>,
    failed_tx: Arc<tokio::sync::watch::Sender<bool>>,
    /// The tokens of VF count changes whose record the store refused (a full disk):
    /// each holds its PF and VFs back from claims until a full scan commits.
    unrecorded_vf_changes: Vec<Arc<()>>,
    /// The request ids of VF count changes that wrote to sysfs and were not logged (their
    /// write failed or ended late, or their record was refused), newest last, at most
    /// [`UNRECORDED_VF_REQUESTS`]: GetRequestOutcome must not answer them "never applied".
    unrecorded_vf_requests: VecDeque<(ConsumerId, RequestId, PciAddress)>,
    /// Set when a published event was sent to a watcher; cleared by whoever reads it
    /// (see [`Core::try_inline`]).
    woke_watchers: bool,
}

/// Keeps a decided change for the batch's commit (a replay changes nothing) and says
/// whether it was one.
fn keep(changes: &mut Vec<ChangeSet>, (outcome, cs): (Outcome, ChangeSet)) -> Applied {
    let replayed = cs.is_empty();
    if !replayed {
        changes.push(cs);
    }
    Applied { outcome, replayed }
}

impl OrphanFree {
    /// The release of this orphan, by its owner, at the generation the audit saw.
    fn release_request(&self) -> ReleaseRequest {
        ReleaseRequest {
            address: self.address,
            consumer: self.consumer,
            request_id: self.request_id.clone(),
            generation: self.generation,
        }
    }
}

impl Worker {
    fn new(
        ledger: Ledger,
        store: Store,
        events: EventBuffer,
        hardware: Option<Hardware>,
    ) -> Worker {
        let metrics = Metrics::new();
        metrics.stored_requests(store.request_log_len());
        Worker {
            view: Arc::new(RwLock::new(Arc::new(View::new(&ledger)))),
            events: Arc::new(Mutex::new(EventLog::new(events, ledger.host_generation()))),
            store_error: Arc::new(Mutex::new(None)),
            metrics,
            ledger,
            store,
            hardware,
            next_sysfs: None,
            trimmer: crate::memory::Trimmer::new(TRIM_INTERVAL),
            closed: closed::ClosedRequests::default(),
            failed: None,
            failed_tx: Arc::new(tokio::sync::watch::channel(false).0),
            unrecorded_vf_changes: Vec::new(),
            unrecorded_vf_requests: VecDeque::new(),
            woke_watchers: false,
        }
    }

    /// Answers every command with the failure that stopped the writer, if one did;
    /// returns the commands otherwise.
    fn refuse_if_failed(&self, batch: Vec<Command>) -> Option<Vec<Command>> {
        let Some(why) = &self.failed else {
            return Some(batch);
        };
        let e = || WriteError::StoreFailed(why.clone());
        for cmd in batch {
            match cmd {
                Command::Claim(_, r) | Command::Release(_, _, r) | Command::Transfer(_, r) => {
                    let _ = r.send(Err(e()));
                }
                Command::Inventory(_, _, r)
                | Command::Devices(_, _, r)
                | Command::Domains(_, r)
                | Command::Sync(r) => {
                    let _ = r.send(Err(e()));
                }
                Command::Settle { reply, .. } => {
                    let _ = reply.send(Err(e()));
                }
                Command::FreeOrphans(_, _, r) => {
                    let _ = r.send(Err(e()));
                }
                Command::BindVfio(_, r) => {
                    let _ = r.send(Err(e()));
                }
                Command::BeginVfCount(_, r) => {
                    let _ = r.send(Err(e()));
                }
                Command::EndVfCount(_, r) => {
                    let _ = r.send(Err(e()));
                }
            }
        }
        None
    }

    fn set_store_error(&self, e: Option<String>) {
        match self.store_error.lock() {
            Ok(mut g) => *g = e,
            Err(p) => *p.into_inner() = e,
        }
    }

    fn decide(&mut self, cmd: Command, now: u64, changes: &mut Vec<ChangeSet>) -> Pending {
        let key = match &cmd {
            Command::Claim(req, _) => Some((req.owner.consumer, &req.request_id)),
            Command::Release(req, _, _) => Some((req.consumer, &req.request_id)),
            Command::Transfer(req, _) => Some((req.from, &req.request_id)),
            _ => None,
        };
        // A retry of a request that memory no longer holds is answered from the store, or
        // from this batch if it was decided here.
        let recalled = match key {
            Some((c, r)) => self.recall(c, r, changes),
            None => Ok(()),
        };
        let opened = recalled.and_then(|()| match key {
            Some((c, r)) => self.open_request(c, r),
            None => Ok(()),
        });
        if let Err(refused) = opened {
            match cmd {
                Command::Claim(_, reply)
                | Command::Release(_, _, reply)
                | Command::Transfer(_, reply) => return Pending::Refused(reply, refused),
                _ => {}
            }
        }
        match cmd {
            Command::Claim(req, reply) => Pending::Applied(
                reply,
                Op::Claim,
                self.ledger
                    .claim(&req, now)
                    .map(|decided| keep(changes, decided)),
            ),
            Command::Release(req, checked, reply) => match self.unchecked_free(&req, checked) {
                Err(refused) => Pending::Refused(reply, refused),
                Ok(()) => Pending::Applied(
                    reply,
                    Op::Release,
                    self.ledger
                        .release(&req, now)
                        .map(|decided| keep(changes, decided)),
                ),
            },
            Command::Transfer(req, reply) => Pending::Applied(
                reply,
                Op::Transfer,
                self.ledger
                    .transfer(&req, now)
                    .map(|decided| keep(changes, decided)),
            ),
            Command::FreeOrphans(audit, list, reply) => {
                let earlier = match self.earlier_frees(&audit, changes) {
                    Ok(found) => found,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return Pending::Unit(oneshot::channel().0);
                    }
                };
                let mut results = Vec::with_capacity(list.len());
                for o in list {
                    // Each free is its own request: one whose id GetRequestOutcome
                    // closed must not apply, as any claim or release.
                    let freed = self
                        .recall(o.consumer, &o.request_id, changes)
                        .and_then(|()| self.open_request(o.consumer, &o.request_id))
                        .and_then(|()| {
                            self.ledger
                                .release(&o.release_request(), now)
                                .map_err(WriteError::Ledger)
                        });
                    results.push(freed.map(|decided| keep(changes, decided)));
                }
                Pending::Orphans(reply, OrphansFreed { results, earlier })
            }
            Command::Inventory(facts, sysfs, reply) => {
                changes.push(self.ledger.apply_inventory(facts));
                if sysfs.is_some() {
                    self.next_sysfs = sysfs;
                }
                Pending::Unit(reply)
            }
            Command::Devices(list, sysfs, reply) => {
                changes.push(self.ledger.apply_devices(list));
                if sysfs.is_some() {
                    self.next_sysfs = sysfs;
                }
                Pending::Unit(reply)
            }
            Command::Domains(domains, reply) => {
                changes.push(self.ledger.apply_domains(domains));
                Pending::Unit(reply)
            }
            Command::Sync(reply) => Pending::Unit(reply),
            Command::Settle {
                consumer,
                request_id,
                close,
                reply,
            } => {
                // A VF count change asked with this id and still under way is not to be
                // told "never applied": it may yet be.
                // One that wrote and was not logged is not either, unless the id was
                // logged since (a retry that went through).
                let entry = match self.ledger.vf_change_in_flight(consumer, &request_id) {
                    Some(pf) => Err(WriteError::RequestInProgress {
                        consumer,
                        request_id: request_id.clone(),
                        pf,
                    }),
                    None => match self
                        .recall(consumer, &request_id, changes)
                        .map(|()| self.ledger.request(consumer, &request_id))
                    {
                        Ok(None) => match self
                            .unrecorded_vf_requests
                            .iter()
                            .find(|(c, id, _)| *c == consumer && *id == request_id)
                            .map(|(_, _, pf)| *pf)
                        {
                            Some(pf) => Err(WriteError::VfCountNotRecorded {
                                consumer,
                                request_id: request_id.clone(),
                                pf,
                            }),
                            None => Ok(None),
                        },
                        found => found,
                    },
                };
                // Only a close made here is taken back if the batch fails: one made by an
                // earlier answer stands.
                let closed = (close
                    && matches!(entry, Ok(None))
                    && self.closed.close(consumer, request_id.clone()))
                .then_some((consumer, request_id));
                Pending::Entry(reply, entry, closed)
            }
            // Routed to `run_alone` by `run`; answered here only if one slips through.
            Command::BindVfio(_, reply) => {
                let _ = reply.send(Err(WriteError::Hardware(HardwareError::Disabled)));
                Pending::Unit(oneshot::channel().0)
            }
            Command::BeginVfCount(_, reply) => {
                let _ = reply.send(Err(WriteError::Hardware(HardwareError::Disabled)));
                Pending::Unit(oneshot::channel().0)
            }
            Command::EndVfCount(_, reply) => {
                let _ = reply.send(Err(WriteError::Hardware(HardwareError::Disabled)));
                Pending::Unit(oneshot::channel().0)
            }
        }
    }

    fn run_batch(&mut self, batch: Vec<Command>) {
        let Some(batch) = self.refuse_if_failed(batch) else {
            return;
        };
        self.trimmer.worked();
        // A full inventory (start-up, a reload, a resync) frees a whole scan's worth of
        // memory once applied: give it back right after.
        if self.apply_batch(batch) {
            self.trimmer.trim_now();
        }
    }

    /// Decides and commits `batch`; says whether it held a full scan.
    fn apply_batch(&mut self, batch: Vec<Command>) -> bool {
        let now = now_unix();
        let before = self.view_now();
        let full_scan = batch.iter().any(|c| matches!(c, Command::Inventory(..)));
        let mut changes: Vec<ChangeSet> = Vec::new();
        // Each decision with whether it came after one that a failed commit would undo
        // (a change, or a request id closed): only an answer decided before any such may
        // stand when the commit fails, since a later one may rest on what is undone.
        let mut undoable = false;
        let mut pending: Vec<(Pending, bool)> = Vec::with_capacity(batch.len());
        for cmd in batch {
            let decided_before = changes.len();
            let p = self.decide(cmd, now, &mut changes);
            let after_undoable = undoable;
            undoable |= changes[decided_before..].iter().any(|c| !c.is_empty())
                || matches!(p, Pending::Entry(_, _, Some(_)));
            pending.push((p, after_undoable));
        }
        let committed = self.commit_changes(&before, &changes);
        match committed {
            Ok(()) => {
                for (p, _) in pending {
                    match p {
                        Pending::Applied(r, op, res) => {
                            match &res {
                                Ok(a) => self.metrics.applied(op, a.replayed),
                                Err(e) => self.metrics.rejected(e.reason()),
                            }
                            let _ = r.send(res.map_err(WriteError::from));
                        }
                        Pending::Refused(r, e) => {
                            self.count_refused(&e);
                            let _ = r.send(Err(e));
                        }
                        Pending::Entry(r, entry, _) => {
                            let _ = r.send(entry);
                        }
                        Pending::Unit(r) => {
                            let _ = r.send(Ok(()));
                        }
                        Pending::Orphans(r, res) => {
                            let _ = r.send(Ok(res));
                        }
                    }
                }
                self.metrics.stored_requests(self.store.request_log_len());
                self.store_instances();
                if full_scan && !self.unrecorded_vf_changes.is_empty() {
                    // The scan read the PFs whose VF count changes went unrecorded, and
                    // their VFs as they are now: their devices are free to claim again.
                    tracing::info!(
                        changes = self.unrecorded_vf_changes.len(),
                        "a full scan applied: the PFs of unrecorded VF count changes are no longer held back"
                    );
                    self.unrecorded_vf_changes.clear();
                }
            }
            Err(e) => {
                tracing::error!(error = %e, changes = changes.len(), "store commit failed; the batch is undone");
                let e = Arc::new(e);
                let lost = || {
                    if e.is_outcome_unknown() {
                        WriteError::OutcomeUnknown(e.clone())
                    } else {
                        WriteError::Store(e.clone())
                    }
                };
                for (p, after_undoable) in pending {
                    // A request the ledger rejected changed nothing: its own answer stands,
                    // unless it was decided after something now undone (it may name an
                    // owner or a generation that never reached the disk).
                    match p {
                        Pending::Applied(r, _, Err(le)) if !after_undoable => {
                            self.metrics.rejected(le.reason());
                            let _ = r.send(Err(WriteError::Ledger(le)));
                        }
                        // Likewise a replay: it answers from a request log entry already
                        // on disk, which this failure does not touch. "Not made" would be
                        // false, and its caller might give up on a claim it holds.
                        Pending::Applied(r, op, Ok(a)) if a.replayed && !after_undoable => {
                            self.metrics.applied(op, true);
                            let _ = r.send(Ok(a));
                        }
                        Pending::Refused(r, refused) if !after_undoable => {
                            self.count_refused(&refused);
                            let _ = r.send(Err(refused));
                        }
                        Pending::Applied(r, _, _) | Pending::Refused(r, _) => {
                            let _ = r.send(Err(lost()));
                        }
                        Pending::Entry(r, _, closed) => {
                            // Answered with the error, so nothing was closed either.
                            if let Some((consumer, request_id)) = closed {
                                self.closed.reopen(consumer, &request_id);
                            }
                            let _ = r.send(Err(lost()));
                        }
                        Pending::Unit(r) => {
                            let _ = r.send(Err(lost()));
                        }
                        Pending::Orphans(r, _) => {
                            let _ = r.send(Err(lost()));
                        }
                    }
                }
            }
        }
        full_scan
    }

    /// The request log's prune, when due, in a transaction of its own (a failed one is
    /// logged and tried again later). The writer thread runs it once a batch is
    /// answered.
    fn prune(&mut self) {
        // A store that failed mid-commit is not written again before the restart.
        if self.failed.is_some() {
            return;
        }
        if let Err(e) = self.store.prune_request_log() {
            tracing::warn!(error = %e, "pruning the request log failed; it is tried again later");
        }
        self.metrics.stored_requests(self.store.request_log_len());
    }

    /// Counts a request refused before the ledger was asked. A store that could not be
    /// read is no rejection of the request: it was logged as an error by `recall`.
    fn count_refused(&self, e: &WriteError) {
        match e {
            WriteError::RequestClosed { .. } => self.metrics.rejected("REQUEST_CLOSED"),
            WriteError::RequestInProgress { .. } => self.metrics.rejected("REQUEST_IN_PROGRESS"),
            WriteError::VfCountNotRecorded { .. } => self.metrics.rejected("VF_COUNT_NOT_RECORDED"),
            WriteError::ChangedWhileChecked { .. } => {
                self.metrics.rejected("CHANGED_WHILE_CHECKED")
            }
            _ => {}
        }
    }

    /// What earlier attempts of acting audit `audit` freed: committed, or decided earlier
    /// in this batch (`batch`; the order lock keeps two attempts apart, but it costs
    /// nothing to look).
    fn earlier_frees(
        &self,
        audit: &RequestId,
        batch: &[ChangeSet],
    ) -> Result<Vec<RequestEntry>, WriteError> {
        let mut found = self.store.audit_entries(audit).map_err(|e| {
            tracing::error!(error = %e, "reading the request log failed");
            WriteError::Store(Arc::new(e))
        })?;
        found.extend(
            batch
                .iter()
                .flat_map(|cs| cs.requests.iter())
                .filter(|e| {
                    RequestId::split_per_device(e.request_id.as_str())
                        .is_some_and(|(a, _)| a == audit.as_str())
                })
                .cloned(),
        );
        Ok(found)
    }

    /// Makes sure the ledger holds the request's logged outcome if the store does: the
    /// ledger keeps only the newest entries in memory.
    ///
    /// `batch`: the changes decided so far in the batch being decided, not yet on disk.
    /// An entry one of them logged may have been pushed out of memory since (the window
    /// drops its oldest by time, and a busy second fills it), and the store cannot know it
    /// before the commit: a retry within the same batch finds it there.
    fn recall(
        &mut self,
        consumer: ConsumerId,
        request_id: &RequestId,
        batch: &[ChangeSet],
    ) -> Result<(), WriteError> {
        if self.ledger.knows_request(consumer, request_id) {
            return Ok(());
        }
        let decided_here = batch
            .iter()
            .rev()
            .flat_map(|cs| cs.requests.iter())
            .find(|e| e.consumer == consumer && e.request_id == *request_id);
        if let Some(entry) = decided_here {
            self.ledger.recall(entry.clone());
            return Ok(());
        }
        let found = self.store.request(consumer, request_id).map_err(|e| {
            tracing::error!(error = %e, "reading the request log failed");
            WriteError::Store(Arc::new(e))
        })?;
        if let Some(entry) = found {
            self.ledger.recall(entry);
        }
        Ok(())
    }

    /// Refuses a release its caller did not check (see [`Writer::release_unchecked`])
    /// where the ledger would free a present device with it: the device reached the
    /// presented generation after the caller looked, and nothing checked that no domain
    /// and no VFIO holder uses it at that generation. A replay, a refusal and the release
    /// of a lost claim (its device gone) go on to the ledger.
    fn unchecked_free(&self, req: &ReleaseRequest, checked: bool) -> Result<(), WriteError> {
        if checked || self.ledger.request(req.consumer, &req.request_id).is_some() {
            return Ok(());
        }
        let present_at = self
            .ledger
            .record_at(req.address)
            .is_some_and(|r| r.generation == req.generation);
        if present_at && self.ledger.check_release(req).is_ok() {
            return Err(WriteError::ChangedWhileChecked {
                address: req.address,
                generation: req.generation,
            });
        }
        Ok(())
    }

    /// Refuses a request whose id GetRequestOutcome closed, unless its outcome is recorded
    /// (then the ledger replays it: a retry of an applied request keeps its answer), and
    /// one whose id a VF count change still under way was asked with: that change is
    /// logged under the id once written, so nothing else may be meanwhile.
    fn open_request(&self, consumer: ConsumerId, request_id: &RequestId) -> Result<(), WriteError> {
        if self.ledger.request(consumer, request_id).is_some() {
            return Ok(());
        }
        if self.closed.is_closed(consumer, request_id) {
            return Err(WriteError::RequestClosed {
                consumer,
                request_id: request_id.clone(),
            });
        }
        if let Some(pf) = self.ledger.vf_change_in_flight(consumer, request_id) {
            return Err(WriteError::RequestInProgress {
                consumer,
                request_id: request_id.clone(),
                pf,
            });
        }
        Ok(())
    }

    /// For a command decided alone (nothing decided and not yet committed): a logged
    /// request that memory no longer holds is put back from the store, so that a retry is
    /// answered as the first time, a request id that GetRequestOutcome closed without an
    /// outcome stays closed, and one a VF count change under way holds is refused.
    fn recall_alone(
        &mut self,
        consumer: ConsumerId,
        request_id: &RequestId,
    ) -> Result<(), WriteError> {
        self.recall(consumer, request_id, &[])?;
        self.open_request(consumer, request_id)
    }

    fn view_now(&self) -> Arc<View> {
        match self.view.read() {
            Ok(v) => v.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Makes `changes` durable in one transaction and then publishes them: the new view,
    /// a log line per state change, and the watch events. On failure every change is
    /// undone in memory (in reverse) and nothing is published.
    ///
    /// The events are worked out before the commit, because a device whose derived state
    /// changed without its record changing (a PF whose VF was claimed, a free device a
    /// domain now uses) is given a host generation of its own for its event, taken from
    /// the counter with the batch: every event then has a generation no other event
    /// has, so a watcher that resumes from the last one it received misses none, and a
    /// state change that touched no record is not below the generation of a watcher that
    /// started before it.
    fn commit_changes(&mut self, before: &View, changes: &[ChangeSet]) -> Result<(), StoreError> {
        // A scan's sysfs details go out with the view of the commit that holds its facts,
        // or not at all.
        let sysfs = self
            .next_sysfs
            .take()
            .unwrap_or_else(|| before.sysfs.clone());
        let mut prepared = (!changes.is_empty()).then(|| self.prepare(before, changes, sysfs));
        let raised = prepared.as_mut().and_then(|p| p.raised.take());
        let mut durable: Vec<&ChangeSet> = changes.iter().filter(|c| !c.is_empty()).collect();
        // A batch that stores nothing else (a listing of the domains that changed only
        // derived states) stores the generations its events took: with nothing after it,
        // a restart behind the clock would hand them out again. The next commit would
        // store past them too, but there may be many such batches before one.
        if durable.is_empty() {
            durable.extend(raised.as_ref());
        }
        let committed = if durable.is_empty() {
            Ok(())
        } else {
            let started = std::time::Instant::now();
            let r = self.store.commit(&durable);
            self.metrics.commit(started.elapsed(), r.is_ok());
            r
        };
        // A batch with nothing to write (a lookup, a refusal, a replay) says nothing of
        // the disk: the last commit's error stands until a commit goes through.
        if !durable.is_empty() {
            self.set_store_error(committed.as_ref().err().map(|e| e.to_string()));
        }
        match committed {
            Ok(()) => {
                if let Some(p) = prepared {
                    self.publish(p);
                }
                Ok(())
            }
            Err(e) => {
                for cs in changes.iter().rev() {
                    self.ledger.undo(cs);
                }
                self.stop_if_unknown(&e);
                Err(e)
            }
        }
    }

    /// A commit whose outcome is unknown: memory is put back as it was, but the disk may
    /// hold the commit, so no decision made from here on could be trusted. The agent
    /// stops, and its next start reads back what the disk holds.
    fn stop_if_unknown(&mut self, e: &StoreError) {
        if e.is_outcome_unknown() {
            tracing::error!(error = %e, "the outcome of a commit is unknown; the writer decides nothing more and the agent stops");
            self.failed = Some(e.to_string());
            self.failed_tx.send_replace(true);
        }
    }

    /// Writes the instances learnt for claimed devices since the last commit (after a
    /// start, in a new boot or on a first run of a build that reads them), in a commit of
    /// their own that moves no generation and tells no watcher anything: without it a
    /// claim not written again in this boot could not be told from a device made again
    /// while the agent was stopped. A failure (a full disk) is logged and the write tried
    /// after the next commit; it undoes nothing, since nothing was decided.
    fn store_instances(&mut self) {
        if self.failed.is_some() {
            return;
        }
        let Some(cs) = self.ledger.take_unwritten_instances() else {
            return;
        };
        if let Err(e) = self.store.commit(&[&cs]) {
            tracing::warn!(error = %e, devices = cs.upserts.len(), "the claimed devices' instances are not written yet; tried again after the next commit");
            self.ledger.unwritten_again(&cs);
            self.stop_if_unknown(&e);
        }
    }

    /// Every derived state and stray after `changes`, and what was re-derived (`None`:
    /// everything). Claims, releases and transfers re-derive around what they touched; a
    /// batch that changed domains, or many records, derives every state and stray again.
    fn next_states(&self, before: &View, changes: &[ChangeSet]) -> (Derived, Option<Rederived>) {
        let domains_changed = changes.iter().any(|cs| cs.before_domains.is_some());
        let touched: usize = changes.iter().map(|cs| cs.before.len()).sum();
        if domains_changed || touched > INCREMENTAL_LIMIT {
            return (Derived::all(&self.ledger), None);
        }
        let (removed, around) = self.ledger.rederive(changes);
        let mut ids = BTreeSet::new();
        let mut states = before.states.clone();
        for id in removed {
            states.remove(&id);
            ids.insert(id);
        }
        for (id, state) in around {
            ids.insert(id);
            states.insert(id, state);
        }
        // Strays likewise: only those at the addresses the batch touched can change.
        let mut strays = before.strays.clone();
        let mut stray_addresses = Vec::new();
        for (address, now) in self.ledger.strays_around(changes) {
            stray_addresses.push(address);
            if now.is_empty() {
                strays.remove(&address);
            } else {
                strays.insert(address, now);
            }
        }
        debug_assert_eq!(
            states,
            self.ledger.states().into_iter().collect::<OrdMap<_, _>>(),
            "re-deriving around the changed records gives every state"
        );
        debug_assert_eq!(
            strays.values().flatten().cloned().collect::<Vec<_>>(),
            self.ledger.strays(),
            "the strays at the touched addresses, and the rest as they were, are every stray"
        );
        (
            Derived { states, strays },
            Some(Rederived {
                ids,
                stray_addresses,
            }),
        )
    }

    /// The view and the events after `changes` (decided, not yet committed): one event
    /// per changed or removed record, with the generation the change gave it, and one per
    /// device whose derived state changed because of a relative or a domain, with a
    /// generation of its own taken from the host counter now.
    fn prepare(&mut self, before: &View, changes: &[ChangeSet], sysfs: SysfsDevices) -> Prepared {
        let (derived, rederived) = self.next_states(before, changes);
        let mut written: BTreeSet<RecordId> = BTreeSet::new();
        let mut events = Vec::new();
        for cs in changes.iter() {
            for r in &cs.upserts {
                written.insert(r.id);
            }
            for (address, generation, present) in &cs.removed {
                events.push(Event::Removed {
                    generation: *generation,
                    address: *address,
                    present: *present,
                });
            }
        }
        // Only a re-derived or written record can have a new state; `None` means every
        // state was derived afresh. Record-id order either way.
        let candidates: Box<dyn Iterator<Item = (&RecordId, &DeviceState)>> = match &rederived {
            None => Box::new(derived.states.iter()),
            Some(r) => Box::new(
                r.ids
                    .union(&written)
                    .filter_map(|id| derived.states.get(id).map(|st| (id, st))),
            ),
        };
        let mut changed = BTreeMap::new();
        let mut relatives = Vec::new();
        for (id, state) in candidates {
            let written = written.contains(id);
            if !written && before.states.get(id).is_none_or(|old| old == state) {
                continue;
            }
            let Some(record) = self.ledger.record(*id) else {
                continue;
            };
            let v = Arc::new(DeviceView {
                record: record.clone(),
                state: state.clone(),
            });
            if written {
                let old = before
                    .ledger
                    .record(*id)
                    .map(|r| r.generation)
                    .unwrap_or_default();
                changed.insert(*id, old);
                events.push(Event::Changed {
                    generation: v.record.generation,
                    view: v,
                });
            } else if before.states.contains_key(id) {
                relatives.push(v);
            }
        }
        let mut next = self.ledger.host_generation();
        for view in relatives {
            next = next.next();
            events.push(Event::Changed {
                generation: next,
                view,
            });
        }
        // Raised in memory only where the batch stores records: they carry the
        // generations a restart must not hand out again, and every later change's
        // generation is above `next`, so the next commit stores a host generation past
        // it. Storing it too would write the meta row's page in most commits (a claim
        // changes its PF's state) for nothing: a restart raises the counter past the
        // stored one by one a record at least (`Ledger::start_floor`), more than one
        // batch's events can take, whatever the clock says (I5). A batch that stores
        // nothing else stores the raise (`commit_changes`). A failed commit undoes the
        // raise with the batch.
        let raised = self.ledger.raise_host_generation(next);
        // Only the strays at re-derived addresses can be new.
        let addresses: Box<dyn Iterator<Item = &PciAddress>> = match &rederived {
            None => Box::new(derived.strays.keys()),
            Some(r) => Box::new(r.stray_addresses.iter()),
        };
        let new_strays = addresses
            .flat_map(|address| {
                let was = before.strays.get(address);
                let now = derived.strays.get(address).into_iter().flatten();
                now.filter(move |s| was.is_none_or(|was| !was.contains(s)))
            })
            .cloned()
            .collect();
        events.sort_by_key(|e| e.generation());
        Prepared {
            view: View::with(&self.ledger, derived.states, derived.strays, sysfs),
            events,
            old_generations: changed,
            new_strays,
            raised,
        }
    }

    /// Publishes a committed batch: logs each state change and each new stray, then the
    /// view, then the events.
    fn publish(&mut self, p: Prepared) {
        for e in &p.events {
            match e {
                Event::Removed {
                    generation,
                    address,
                    present,
                } => {
                    tracing::info!(device = %address, new_generation = %generation, lost_claim = !present, "device record removed");
                }
                Event::Changed { view, .. } => {
                    let Some(old) = p.old_generations.get(&view.record.id) else {
                        // A relative's derived state: its record did not change.
                        continue;
                    };
                    tracing::info!(
                        device = %view.record.address(),
                        state = view.state.name(),
                        owner = %view.record.claim.as_ref().map(|c| c.owner.to_string()).unwrap_or_default(),
                        old_generation = %old,
                        new_generation = %view.record.generation,
                        "device changed"
                    );
                }
            }
        }
        for s in &p.new_strays {
            tracing::warn!(
                device = %s.address,
                domain = %s.domain.name,
                domain_uuid = %s.domain.uuid,
                claimed_by = %s.claimed_by.as_ref().map(|o| o.to_string()).unwrap_or_else(|| "nobody".into()),
                known_device = s.known_device,
                "stray: a domain uses a device without holding its claim"
            );
        }
        let view = Arc::new(p.view);
        // Publish the view before the events, so a watcher that re-lists after an event
        // sees at least that event's state.
        match self.view.write() {
            Ok(mut g) => *g = view,
            Err(p) => *p.into_inner() = view,
        }
        let mut log = match self.events.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        for e in p.events {
            self.woke_watchers |= log.push(e);
        }
    }
}
