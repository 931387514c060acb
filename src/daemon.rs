//! The daemon: startup order (store, scan, reconcile, then serve and report ready),
//! the Unix socket, health and reflection services, signals and shutdown.

use std::collections::BTreeSet;
use std::future::Future;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::net::UnixListener;

use crate::api::connections::ConnectionLimits;
use crate::api::guard::FreeGuard;
use crate::api::server::host_dev_server::HostDevServer;
use crate::api::{proto, Access, AgentInfo, HealthInfo, HostDevService, Reloads, WatchLimits};
use crate::config::{Config, ConfigError, Selection};
use crate::hardware::Hardware;
use crate::hotplug::{Notice, UeventSocket};
use crate::ledger::Ledger;
use crate::rescan::{RescanError, Rescanner};
use crate::store::{Store, StoreError};
use crate::sysfs::{PciNames, SysfsError};
use crate::writer::{WriteError, Writer};

/// Why the daemon could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot open the ledger: {0}")]
    Store(#[from] StoreError),
    #[error("cannot scan PCI devices: {0}")]
    Sysfs(#[from] SysfsError),
    #[error("cannot apply the first inventory: {0}")]
    Write(#[from] WriteError),
    #[error(transparent)]
    Rescan(#[from] RescanError),
    #[error("cannot open the kernel uevent socket (set [hotplug] enabled = false to run without hotplug): {0}")]
    Uevents(#[source] std::io::Error),
    #[error("cannot set up socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("TCP listener: {detail}")]
    Tls {
        detail: String,
        #[source]
        source: Option<std::io::Error>,
    },
    #[error("cannot install the signal handlers: {0}")]
    Signal(#[source] std::io::Error),
    #[error("cannot start the writer thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("cannot build the reflection service: {0}")]
    Reflection(String),
    #[error("the gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("stopped because the writer stopped deciding ({0}); the next start reads back what the disk holds")]
    StoreFailed(String),
}

/// The agent's async runtime: one worker per CPU, plus one. A claim, release or transfer
/// arriving while the writer is idle is committed on the worker that took it (see
/// `writer`), which then waits out the fsync; the extra worker keeps every CPU serving
/// meanwhile (Watch fan-out, other requests).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cpus + 1)
        .enable_all()
        .build()
}

/// A running agent's core: the writer (whose views hold the inventory) and the rescanner.
#[derive(Debug, Clone)]
pub struct Agent {
    pub writer: Writer,
    pub info: Arc<AgentInfo>,
    pub rescanner: Arc<Rescanner>,
    guard: Arc<FreeGuard>,
    /// Keeps the libvirt poller running while any clone of the agent lives.
    _poller: Option<Arc<crate::domains::Poller>>,
}

/// What a started agent leaves to wait for once it is done: the writer thread, which closes the store
/// once the last handle to the writer is gone. SQLite copies the write-ahead log into
/// the database and removes it when the store closes; a process that exits first leaves
/// the log for the next start to read back (nothing is lost either way, but a clean
/// stop should leave a closed database).
#[derive(Debug)]
pub struct Closing(std::thread::JoinHandle<()>);

impl Closing {
    /// Call once the async runtime is dropped (which drops every task's handle to the
    /// writer). Waits up to `limit` for the writer thread to close the store; returns
    /// whether it did.
    pub fn wait(self, limit: Duration) -> bool {
        let thread = self.0;
        let deadline = Instant::now() + limit;
        while !thread.is_finished() {
            if Instant::now() >= deadline {
                tracing::warn!(
                    "the writer thread did not end in time; exiting without closing the store (the next start reads its log back)"
                );
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        thread.join().is_ok()
    }
}

/// Raises the soft limit on open files to the hard one. systemd starts services with a
/// soft limit of 1024 (and a hard one of 524288), and every API connection holds a
/// descriptor: clients up to `[api] max_connections_per_uid` each, with the agent's own
/// reads of sysfs and /proc beside them, need more than 1024. A limit that cannot be
/// read or raised is left as it is, with a warning.
fn raise_open_files_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "open files limit raised"),
            Err(e) => {
                tracing::warn!(error = %e, soft, hard, "the open files limit could not be raised")
            }
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "the open files limit could not be read"),
    }
}

/// The boot's id folded to 64 bits, which tells the devices' instances of one boot from
/// another's; `None` where it could not be read (nothing is then compared).
fn boot_tag(boot: &str) -> Option<u64> {
    let id = uuid::Uuid::parse_str(boot).ok()?.as_u128();
    Some((id >> 64) as u64 ^ id as u64)
}

fn boot_id(proc_root: &Path) -> String {
    std::fs::read_to_string(proc_root.join("sys/kernel/random/boot_id"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

impl Agent {
    /// Loads the store, scans sysfs and applies the inventory: everything before serving.
    /// Also returns the writer thread, for a clean stop to wait on (see [`Closing`]).
    pub async fn start(cfg: &Config) -> Result<(Agent, Closing), DaemonError> {
        let started = Instant::now();
        let selection = cfg.selection()?;
        let state_dir = cfg.state_dir.clone();
        let in_memory = cfg.api.request_log_in_memory;
        let (store, snapshot) = tokio::task::spawn_blocking(move || {
            let store = Store::open(&state_dir)?;
            let snapshot = store.load_recent(in_memory)?;
            Ok::<_, StoreError>((store, snapshot))
        })
        .await
        .map_err(|e| DaemonError::Thread(std::io::Error::other(e.to_string())))??;
        let boot = boot_id(&cfg.proc_root);
        let mut store = store;
        // Written only when it changed: a restart on a full disk writes nothing here.
        let prev = store.meta_get("boot_id")?;
        if prev.as_deref() != Some(boot.as_str()) {
            if let Some(prev) = &prev {
                tracing::warn!(previous = %prev, current = %boot, "new boot: claims are kept and checked against the new inventory");
            }
            match store.meta_set("boot_id", &boot) {
                Ok(()) => {}
                // It only tells the next start whether the host rebooted: not kept, the
                // next start reports a new boot once more.
                Err(e) if e.is_disk_full() => {
                    tracing::warn!(error = %e, "the boot id is not stored: the disk is full");
                }
                Err(e) => return Err(e.into()),
            }
        }
        store.set_request_log_limit(cfg.api.request_log_entries);
        let mut ledger = Ledger::from_snapshot(snapshot);
        ledger.set_request_log_limit(in_memory);
        // I5 across restores: a state dir restored from an older copy must not hand out
        // again the generations handed out after that copy was taken.
        let stored = ledger.host_generation();
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        if let Some(raised) = ledger.raise_host_generation(ledger.start_floor(since_epoch)) {
            match store.commit(&[raised]) {
                Ok(()) => tracing::info!(
                    stored = %stored,
                    host_generation = %ledger.host_generation(),
                    "host generation raised to the clock's floor, or past what the last run may have published"
                ),
                // A full disk must not stop a restart: the agent would loop, and even
                // listing would be lost. The raised value stays in the ledger's memory
                // and the agent serves reads; every write fails as UNAVAILABLE until
                // space is freed. I5 still holds: each commit stores the host generation
                // of its last change set (in the meta row or a record it carries), and
                // those all follow from the raised value, so the first commit that goes
                // through stores at least the raised value. A restart before that raises
                // again, from a later clock.
                Err(e) if e.is_disk_full() => tracing::warn!(
                    error = %e,
                    stored = %stored,
                    host_generation = %ledger.host_generation(),
                    "the disk is full: the host generation is raised to the clock's floor in memory only, until the next commit; changes fail until space is freed"
                ),
                Err(e) => return Err(e.into()),
            }
        }
        tracing::info!(
            host_generation = %ledger.host_generation(),
            records = ledger.records().count(),
            db = %store.path().display(),
            "ledger loaded"
        );
        let hardware = Hardware {
            sysfs_root: cfg.sysfs_root.clone(),
            step_timeout: Duration::from_millis(cfg.hardware.step_timeout_ms),
            vf_count_timeout: Duration::from_millis(cfg.hardware.vf_count_timeout_ms),
        };
        let (writer, writer_thread) = Writer::start_with(
            ledger,
            store,
            crate::writer::EventBuffer {
                events: cfg.api.watch_buffer,
                bytes: cfg.api.watch_buffer_bytes,
            },
            Some(hardware),
        )
        .map_err(DaemonError::Thread)?;
        let names = Arc::new(PciNames::system_default());
        // Subscribe before the first scan: the kernel queues what changes meanwhile.
        let uevents = if cfg.hotplug.enabled {
            Some(
                UeventSocket::open(cfg.hotplug.receive_buffer_bytes)
                    .map_err(DaemonError::Uevents)?,
            )
        } else {
            None
        };
        let rescanner = Arc::new(Rescanner::new(
            cfg.sysfs_root.clone(),
            cfg.dev_root.clone(),
            names,
            selection,
            writer.clone(),
            boot_tag(&boot),
        ));
        let guard = Arc::new(FreeGuard::from_config(cfg, writer.metrics().clone()));
        let agent = Agent {
            writer,
            rescanner,
            info: Arc::new(AgentInfo {
                started,
                boot_id: boot,
                libvirt: RwLock::new(HealthInfo {
                    ok: false,
                    detail: "libvirt has not been asked yet".into(),
                }),
                // The poller sets it from its first moment; libvirt disabled, there is none.
                libvirt_events: RwLock::new(if cfg.libvirt.enabled {
                    HealthInfo {
                        ok: !cfg.libvirt.events,
                        detail: "not subscribed yet".into(),
                    }
                } else {
                    HealthInfo {
                        ok: true,
                        detail:
                            "not wanted: libvirt is disabled in config ([libvirt] enabled = false)"
                                .into(),
                    }
                }),
                hotplug: Arc::new(RwLock::new(HealthInfo {
                    ok: !cfg.hotplug.enabled,
                    detail: if cfg.hotplug.enabled {
                        "the uevent listener has not started yet".into()
                    } else {
                        "disabled in config ([hotplug] enabled = false): the inventory changes only at start and on SIGHUP".into()
                    },
                })),
                reloads: RwLock::new(Reloads::default()),
            }),
            guard,
            _poller: None,
        };
        match agent.rescanner.full(None).await {
            Ok(()) => {}
            // A full disk must not stop a start (the agent would loop under systemd, and
            // even reading would be lost): the ledger stays as the disk holds it, the
            // store's health says why, every change is refused as UNAVAILABLE, and the
            // scan is tried again until it applies.
            Err(RescanError::Write(WriteError::Store(e))) if e.is_disk_full() => {
                tracing::warn!(error = %e, "the first scan cannot be stored: the disk is full; serving the ledger as stored, refusing changes, and trying the scan again until it applies");
                let why = "the first scan could not be stored";
                agent.writer.changes_wait_for_scan(why);
                agent.rescanner.owe_full_scan(why);
            }
            Err(e) => return Err(e.into()),
        }
        if let Some(socket) = uevents {
            agent.start_hotplug(socket, cfg.hotplug.receive_buffer_bytes)?;
        }
        Ok((agent.start_libvirt(cfg).await?, Closing(writer_thread)))
    }

    /// Starts the uevent listener thread and the task that rescans what events name
    /// (events waiting together are coalesced into one rescan). A lost event or socket
    /// means a full rescan, logged. A rescan that fails (the ledger could not take it: a
    /// full disk) is owed, not dropped: it is tried again, with what arrived meanwhile,
    /// after a wait that doubles from one second to half a minute, until it is applied.
    fn start_hotplug(&self, socket: UeventSocket, rcvbuf: usize) -> Result<(), DaemonError> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        crate::hotplug::spawn(socket, rcvbuf, tx).map_err(DaemonError::Thread)?;
        let rescanner = self.rescanner.clone();
        let metrics = self.writer.metrics().clone();
        let hotplug = self.info.hotplug.clone();
        crate::domains::set_health(&hotplug, true, "listening for PCI uevents".into());
        tokio::spawn(async move {
            let mut owed = Owed::default();
            let mut retry_in: Option<std::time::Duration> = None;
            // Why the socket is down, until it is open again: no rescan's success says
            // the agent is listening meanwhile.
            let mut down: Option<String> = None;
            loop {
                let mut take = |owed: &mut Owed, n: Notice| match n {
                    Notice::Device(ev) => {
                        metrics.uevent();
                        tracing::debug!(action = %ev.action, device = %ev.address, "uevent");
                        owed.addresses.insert(ev.address);
                        if ev.removal {
                            // The latest of its removals; one without a number wins.
                            let seq = owed.removed.entry(ev.address).or_insert(ev.seqnum);
                            *seq = seq.zip(ev.seqnum).map(|(a, b)| a.max(b));
                        }
                    }
                    Notice::Resync(why) => {
                        metrics.uevent_resync();
                        tracing::warn!(reason = %why, "uevents were lost: full rescan");
                        let (events, resyncs) = metrics.uevent_counts();
                        crate::domains::set_health(
                            &hotplug,
                            true,
                            format!("listening for PCI uevents; {events} handled, {resyncs} full rescan(s) after lost events (last: {why})"),
                        );
                        owed.resync = Some(why);
                        down = None;
                    }
                    Notice::Down(why) => {
                        tracing::error!(reason = %why, "no uevents are received until the socket is reopened");
                        crate::domains::set_health(
                            &hotplug,
                            false,
                            format!("not listening for PCI uevents: {why}; reopening it, then a full rescan"),
                        );
                        down = Some(why);
                    }
                };
                match retry_in {
                    // Wait for an event.
                    None => match rx.recv().await {
                        Some(n) => take(&mut owed, n),
                        None => break,
                    },
                    // A rescan is owed: gather what arrives meanwhile, and try again only
                    // once the wait is over (a stream of events must not turn the wait
                    // into a retry per event while the disk is full).
                    Some(wait) => {
                        let due = tokio::time::Instant::now() + wait;
                        loop {
                            tokio::select! {
                                n = rx.recv() => match n {
                                    Some(n) => take(&mut owed, n),
                                    None => return,
                                },
                                _ = tokio::time::sleep_until(due) => break,
                            }
                        }
                    }
                }
                while let Ok(n) = rx.try_recv() {
                    take(&mut owed, n);
                }
                let result = match &owed.resync {
                    Some(_) => rescanner.full_after(&owed.removed).await,
                    None => {
                        rescanner
                            .devices(owed.addresses.clone(), &owed.removed)
                            .await
                    }
                };
                match result {
                    Ok(()) => {
                        if retry_in.take().is_some() && down.is_none() {
                            tracing::info!("the owed rescan is applied");
                            let (events, resyncs) = metrics.uevent_counts();
                            crate::domains::set_health(
                                &hotplug,
                                true,
                                format!("listening for PCI uevents; {events} handled, {resyncs} full rescan(s) after lost events"),
                            );
                        }
                        owed = Owed::default();
                    }
                    Err(e) => {
                        let wait =
                            retry_in.map_or(RESCAN_RETRY_FIRST, |w| (w * 2).min(RESCAN_RETRY_MAX));
                        retry_in = Some(wait);
                        tracing::error!(error = %e, retry_in_ms = wait.as_millis() as u64, "rescan after uevent failed; it is owed and tried again");
                        crate::domains::set_health(
                            &hotplug,
                            false,
                            format!("a rescan after uevents failed ({e}); the inventory may be stale until it is retried, in {} ms", wait.as_millis()),
                        );
                    }
                }
            }
        });
        Ok(())
    }

    /// Lists the domains once before serving (a failure to list or to apply the listing
    /// is reported, not fatal: frees are refused until one is applied), then starts the
    /// poller.
    async fn start_libvirt(mut self, cfg: &Config) -> Result<Agent, DaemonError> {
        let Some(lv) = self.guard.libvirt.clone() else {
            crate::domains::set_health(
                &self.info.libvirt,
                true,
                "disabled in config ([libvirt] enabled = false): no domain is tracked; frees are checked by generation and VFIO holders only".into(),
            );
            return Ok(self);
        };
        let started = Instant::now();
        match lv.list_fresh(self.guard.timeout).await {
            Ok(list) => {
                let detail = crate::domains::healthy_detail(lv.uri(), &list);
                match self.writer.domains(list).await {
                    Ok(()) => {
                        tracing::info!(took_ms = started.elapsed().as_millis() as u64, "{detail}");
                        crate::domains::set_health(&self.info.libvirt, true, detail);
                    }
                    // Not fatal either (a full disk must not stop a restart): the listing
                    // is not applied, so frees and claims wait for the poller's next one,
                    // as when libvirt does not answer.
                    Err(e) => {
                        tracing::warn!(error = %e, "the first listing of the domains could not be applied; frees and claims wait for the next one");
                        crate::domains::set_health(
                            &self.info.libvirt,
                            false,
                            format!("the listing of the domains could not be applied: {e}"),
                        );
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "libvirt did not answer at start; frees are refused until it does");
                crate::domains::set_health(&self.info.libvirt, false, e.to_string());
            }
        }
        let poller = crate::domains::spawn_poller(
            lv,
            self.writer.clone(),
            self.info.clone(),
            self.guard.order.clone(),
            crate::domains::PollSettings {
                interval: std::time::Duration::from_millis(cfg.libvirt.poll_interval_ms),
                max_backoff: std::time::Duration::from_secs(30),
                events: cfg.libvirt.events,
                timeout: std::time::Duration::from_millis(cfg.libvirt.timeout_ms),
            },
            tokio::runtime::Handle::current(),
        )
        .map_err(DaemonError::Thread)?;
        self._poller = Some(Arc::new(poller));
        Ok(self)
    }

    /// Updates the count of configuration reloads that GetStatus reports.
    fn reloads(&self, update: impl FnOnce(&mut Reloads)) {
        match self.info.reloads.write() {
            Ok(mut g) => update(&mut g),
            Err(p) => update(&mut p.into_inner()),
        }
    }

    /// A full scan with a (new) selection, applied to the ledger (off the async threads).
    pub async fn rescan(&self, selection: &Selection) -> Result<(), DaemonError> {
        Ok(self.rescanner.full(Some(selection.clone())).await?)
    }

    /// The gRPC service over this agent.
    pub fn service(&self, access: Access) -> HostDevService {
        HostDevService::new(
            self.writer.clone(),
            access,
            self.rescanner.clone(),
            self.info.clone(),
            self.guard.clone(),
        )
    }
}

/// The first wait before an owed rescan is tried again, and the longest.
const RESCAN_RETRY_FIRST: std::time::Duration = std::time::Duration::from_secs(1);
const RESCAN_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// What the hotplug task still has to apply: the devices events named (and which of them
/// the kernel removed), and whether a full rescan is needed.
#[derive(Debug, Default)]
struct Owed {
    addresses: BTreeSet<crate::pci::PciAddress>,
    removed: crate::rescan::Removals,
    resync: Option<String>,
}

/// The group `api.socket_group` names, looked up before anything else starts: a group
/// that does not exist is a configuration error, found at once and naming the key, not
/// after the ledger is loaded and the host scanned.
pub fn socket_group(group: Option<&str>) -> Result<Option<nix::unistd::Gid>, DaemonError> {
    let Some(g) = group else {
        return Ok(None);
    };
    let invalid = |why: String| {
        DaemonError::Config(ConfigError::Invalid(format!(
            "api.socket_group = {:?}: {why}",
            crate::pci::shown(g)
        )))
    };
    match nix::unistd::Group::from_name(g) {
        Ok(Some(group)) => Ok(Some(group.gid)),
        Ok(None) => Err(invalid("no such group on this host".into())),
        Err(e) => Err(invalid(format!("the group cannot be looked up: {e}"))),
    }
}

/// Binds the Unix socket: creates its directory, replaces a stale socket (never any
/// other kind of file), applies mode and group (see [`socket_group`]).
pub fn bind_socket(
    path: &Path,
    mode: u32,
    group: Option<nix::unistd::Gid>,
) -> Result<UnixListener, DaemonError> {
    let err = |source| DaemonError::Socket {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).map_err(err)?,
        Ok(_) => {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists and is not a socket; refusing to replace it",
            )))
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(err)?;
    if let Some(gid) = group {
        nix::unistd::chown(path, None, Some(gid)).map_err(|e| err(std::io::Error::from(e)))?;
    }
    Ok(listener)
}

/// Serves the API, health and reflection on a listener until `shutdown` completes;
/// in-flight calls drain before it returns. Connections are admitted through the
/// service's per-uid limit ([`crate::api::connections`]).
pub async fn serve(
    listener: UnixListener,
    service: HostDevService,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DaemonError> {
    let incoming = crate::api::connections::incoming(listener, service.connections().clone());
    serve_draining(
        tonic::transport::Server::builder(),
        service,
        incoming,
        shutdown,
    )
    .await
}

/// How long a stop waits for the streams once no call is being answered: a Watch told
/// `SHUTTING_DOWN` ends at once where its client reads.
const STREAM_GRACE: Duration = Duration::from_secs(2);

/// Serves [`routes`] on `incoming` until `shutdown` completes; then every Watch is told
/// the agent is stopping, and the calls being answered drain, for at most the service's
/// drain limit ([`ConnectionLimits::drain`]), and the streams for [`STREAM_GRACE`] after
/// them. A stream its client
/// keeps open (a Watch whose reader stopped reading, so its last message never goes out;
/// a health Watch, which ends only with the server) is then left to the runtime's end:
/// before, a stop waited for it without end, and a stop after a failed commit, which no
/// signal follows, never ended the process.
pub(crate) async fn serve_draining<IO, IE>(
    builder: tonic::transport::Server,
    service: HostDevService,
    incoming: impl futures_util::Stream<Item = Result<IO, IE>>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DaemonError>
where
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let streams = service.clone();
    let drain_limit = service.connection_limits().drain;
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown.await;
        streams.stop_streams();
        let _ = stopping_tx.send(());
    };
    let (router, answering) = routes(builder, service).await?;
    let served = router.serve_with_incoming_shutdown(incoming, shutdown);
    tokio::pin!(served);
    tokio::select! {
        r = &mut served => return Ok(r?),
        Ok(()) = stopping_rx => {}
    }
    let drained = async {
        answering.idle().await;
        tokio::time::sleep(STREAM_GRACE).await;
    };
    tokio::select! {
        r = &mut served => Ok(r?),
        _ = tokio::time::timeout(drain_limit, drained) => {
            tracing::warn!(
                calls = answering.open(),
                "connections still open after the stop (streams their clients keep open, or calls past the drain limit): left to close with the process"
            );
            Ok(())
        }
    }
}

/// Every service the agent serves on a listener: the API, grpc.health.v1 and server
/// reflection (v1 and v1alpha, for older tools), with the service's connection limits:
/// calls open at once on one connection, and pings to a connection gone silent (a
/// controller whose host died leaves a TCP connection, and its Watch stream, open
/// otherwise; a stopped local client its Unix one). Each call, health and reflection
/// included, first takes one of its caller's places ([`crate::api::gate`]).
pub(crate) async fn routes(
    builder: tonic::transport::Server,
    service: HostDevService,
) -> Result<
    (
        tonic::transport::server::Router,
        Arc<crate::api::gate::Answering>,
    ),
    DaemonError,
> {
    let limits = service.connection_limits();
    let metrics = Arc::clone(service.connections().metrics());
    let calls_per_uid = limits.calls_per_uid;
    let mut builder = builder
        .max_concurrent_streams(limits.streams)
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout));
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<HostDevServer<HostDevService>>().await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| DaemonError::Reflection(e.to_string()))?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| DaemonError::Reflection(e.to_string()))?;
    // One count of places per caller for every service served here.
    let api = crate::api::gate::Gate::new(
        HostDevServer::new(service).max_decoding_message_size(4 << 20),
        calls_per_uid,
        metrics,
    );
    let answering = api.answering();
    Ok((
        builder
            .add_service(api.beside(health_service))
            .add_service(api.beside(reflection_v1))
            .add_service(api.beside(reflection_v1alpha))
            .add_service(api),
        answering,
    ))
}

/// The whole daemon: start, bind, notify systemd, serve until SIGTERM/SIGINT; SIGHUP
/// reloads the managed-device selection from `config_path` and rescans.
pub async fn run(cfg: Config, config_path: Option<PathBuf>) -> Result<Closing, DaemonError> {
    // Take SIGHUP before anything else: its default action would end the daemon.
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(DaemonError::Signal)?;
    let group = socket_group(cfg.api.socket_group.as_deref())?;
    raise_open_files_limit();
    let (agent, closing) = Agent::start(&cfg).await?;
    let listener = bind_socket(&cfg.api.socket, cfg.socket_mode()?, group)?;
    let service = agent
        .service(Access {
            writer_uids: cfg.api.writer_uids.clone(),
            writer_gids: cfg.api.writer_gids.clone(),
        })
        .with_watch_limits(WatchLimits::from_config(&cfg.api))
        .with_connection_limits(ConnectionLimits::from_config(&cfg));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    if let Some(addr) = cfg.metrics.listen {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| DaemonError::Metrics { addr, source })?;
        let info = agent.info.clone();
        // "Up" means libvirt answered; a disabled connection is not up, however healthy
        // the agent considers itself without it.
        let enabled = cfg.libvirt.enabled;
        let up = move || {
            enabled
                && match info.libvirt.read() {
                    Ok(g) => g.ok,
                    Err(p) => p.into_inner().ok,
                }
        };
        let mut rx = stop_rx.clone();
        let writer = agent.writer.clone();
        tracing::info!(listen = %addr, "serving metrics");
        tokio::spawn(async move {
            let stop = async move {
                let _ = rx.wait_for(|s| *s).await;
            };
            if let Err(e) =
                crate::metrics::serve(l, writer.metrics().clone(), writer, up, stop).await
            {
                tracing::error!(error = %e, "metrics listener failed");
            }
        });
    }
    let socket = cfg.api.socket.clone();
    let tcp_task = match &cfg.api.tcp {
        Some(tcp) => {
            let tls = crate::tcp::tls_server(tcp)?;
            let tcp_listener = crate::tcp::bind(tcp).await?;
            let per_peer = tcp.max_connections_per_peer;
            tracing::info!(listen = %tcp.listen, "serving over TCP with mutual TLS");
            let mut rx = stop_rx.clone();
            let svc = service.clone();
            Some(tokio::spawn(async move {
                let served = crate::tcp::serve_tls(tcp_listener, tls, per_peer, svc, async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await;
                if let Err(e) = &served {
                    tracing::error!(error = %e, "the TCP listener stopped");
                }
                served
            }))
        }
        None => None,
    };
    drop(stop_rx);
    let initial_selection = cfg.selection()?;
    tracing::info!(socket = %cfg.api.socket.display(), "serving");
    // READY only now: store loaded, first scan applied, and every listener (the socket,
    // metrics, TCP with its TLS files read) bound. A failure before here exits without
    // it, so systemd sees a failed start rather than a ready service that then stops.
    notify_systemd(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status("serving"),
    ]);
    let reload_agent = agent.clone();
    let running = cfg.clone();
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            // Counted as begun before the config is read, so that a caller who read the
            // count before signalling knows which reload's end answers it (GetStatus;
            // `hostdevctl reload`).
            reload_agent.reloads(|r| r.started += 1);
            // systemd shows the unit reloading until READY=1 comes back, and the outcome
            // in its status line (MONOTONIC_USEC is what systemd 253's notify-reload
            // units match the reload by; older ones ignore it).
            let mut reloading = vec![sd_notify::NotifyState::Reloading];
            reloading.extend(sd_notify::NotifyState::monotonic_usec_now().ok());
            notify_systemd(&reloading);
            let selection = match &config_path {
                Some(p) => Config::load(p).and_then(|c| {
                    let later = running.restart_only_changes(&c);
                    if !later.is_empty() {
                        tracing::warn!(
                            sections = %later.join(", "),
                            "a reload applies [[devices]] only: these changed sections take effect at the next restart"
                        );
                    }
                    c.selection()
                }),
                None => Ok(initial_selection.clone()),
            };
            let (applied, outcome) = match selection {
                Ok(sel) => match reload_agent.rescan(&sel).await {
                    Ok(()) => {
                        tracing::info!(selection = %sel, "reloaded device selection");
                        (true, "reloaded the device selection".to_string())
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "rescan after reload failed");
                        (false, format!("the rescan after a reload failed: {e}"))
                    }
                },
                Err(e) => {
                    tracing::error!(error = %e, "reload refused; the previous selection stays");
                    (
                        false,
                        format!("reload refused, the previous selection stays: {e}"),
                    )
                }
            };
            let outcome = one_line(&outcome);
            notify_systemd(&[
                sd_notify::NotifyState::Ready,
                sd_notify::NotifyState::Status(&format!("serving; {outcome}")),
            ]);
            reload_agent.reloads(|r| {
                r.finished += 1;
                r.last = Some(HealthInfo {
                    ok: applied,
                    detail: outcome,
                });
            });
        }
    });
    // A commit whose outcome is unknown (the disk failed mid-commit) stops the agent as
    // a signal would, and the exit is a failure: systemd starts it again, and that start
    // reads back what the disk holds.
    let writer = agent.writer.clone();
    let stop = async move {
        tokio::select! {
            _ = shutdown_signal() => {}
            _ = writer.failed() => {
                tracing::error!(
                    why = %writer.failure().unwrap_or_default(),
                    "the writer stopped deciding (a commit whose outcome is unknown, or a decision that failed unexpectedly): stopping, so that the next start reads back what the disk holds"
                );
            }
        }
        let _ = stop_tx.send(true);
    };
    serve(listener, service, stop).await?;
    if let Some(why) = agent.writer.failure() {
        let _ = std::fs::remove_file(&socket);
        return Err(DaemonError::StoreFailed(why));
    }
    if let Some(t) = tcp_task {
        match t.await {
            Ok(r) => r?,
            Err(e) => tracing::error!(error = %e, "TCP listener task failed"),
        }
    }
    let _ = std::fs::remove_file(&socket);
    tracing::info!("stopped");
    Ok(closing)
}

/// Tells systemd `states` when it runs the agent (`NOTIFY_SOCKET`); elsewhere nothing.
fn notify_systemd(states: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::debug!(error = %e, "systemd notify failed (not under systemd?)");
    }
}

/// `text` as one status line for systemd: each run of white space or control
/// characters (a newline would end the STATUS field) becomes one space, and it is cut
/// at 400 bytes, on a character boundary.
fn one_line(text: &str) -> String {
    let mut line = text
        .split(|c: char| c.is_whitespace() || c.is_control())
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    if line.len() > 400 {
        let mut end = 400;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
    line
}

/// Completes on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => {},
                _ = i.recv() => {},
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("shutdown requested; draining in-flight calls");
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn a_status_is_one_line_of_at_most_400_bytes() {
        assert_eq!(
            one_line("refused: line 2\n  | vendor\r\n\tx"),
            "refused: line 2 | vendor x"
        );
        let long = "é".repeat(300);
        let cut = one_line(&long);
        assert!(cut.len() <= 400 && cut.len() >= 399, "{}", cut.len());
        assert!(cut.chars().all(|c| c == 'é'));
        assert_eq!(one_line(""), "");
    }
}
