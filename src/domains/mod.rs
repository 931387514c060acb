//! libvirt: the domains defined on this host (running or not) and the host PCI
//! addresses each references (a `direct` interface's by the PCI function of the host
//! interface it names, looked up in sysfs), read through libvirt's client library (loaded on first use,
//! see [`ffi`]), and the background poller
//! that keeps the writer's domain set current and reports libvirt's health.
//!
//! Every call here blocks (libvirt's API is synchronous), so callers run it on a plain
//! thread or `spawn_blocking`, never on an async worker. The poller only keeps views and
//! `GetStatus` current: a free never trusts it, it queries afresh (see `api::guard`).
//! The poller lists the domains every `poll_interval_ms`, and at once whenever libvirt
//! reports a domain event (defined, undefined, started, stopped, a device attached or
//! detached live) or the event connection closes: an event only says "list again now",
//! the listing is the truth. The check at free time is always a fresh full query.

pub mod ffi;
pub mod xml;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use ffi::Connection;

use crate::api::HealthInfo;
use crate::ledger::{DomainDevices, DomainRef};
use crate::writer::{WriteError, Writer};
pub use xml::{references, References, XmlError};

/// Why the domains could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum DomainsError {
    #[error("libvirt at {uri} unreachable: {source}")]
    Unreachable {
        uri: String,
        #[source]
        source: ffi::Error,
    },
    #[error("libvirt at {uri} unreachable: {what} failed: {source}")]
    Call {
        uri: String,
        what: &'static str,
        #[source]
        source: ffi::Error,
    },
    #[error("libvirt at {uri} unreachable: no answer within {ms} ms")]
    Timeout { uri: String, ms: u128 },
    #[error("cannot read the XML of domain {name} ({uuid}) from libvirt at {uri}: {source}")]
    Xml {
        uri: String,
        name: String,
        uuid: uuid::Uuid,
        #[source]
        source: Box<XmlError>,
    },
    #[error("cannot tell which PCI function {what} of domain {name} ({uuid}) from libvirt at {uri} is on: {source}")]
    HostDevice {
        uri: String,
        name: String,
        uuid: uuid::Uuid,
        /// What the domain names, e.g. "the interface ens1f0v3".
        what: String,
        #[source]
        source: Box<crate::sysfs::SysfsError>,
    },
    #[error("the libvirt query thread failed: {0}")]
    Thread(String),
    #[error("libvirt at {uri} has not answered since this agent started, so a domain that uses a device without a claim would not be seen; claims wait for its first answer")]
    NotYetListed { uri: String },
}

/// A libvirt connection by URI, opened on first use and reopened after a failure.
pub struct Libvirt {
    uri: String,
    /// Where a `direct` interface's name is looked up to find its PCI function.
    sysfs_root: PathBuf,
    conn: Mutex<Option<Arc<Connection>>>,
}

impl std::fmt::Debug for Libvirt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Libvirt").field("uri", &self.uri).finish()
    }
}

impl Libvirt {
    /// A connection to `uri`, whose domains' `direct` interfaces are looked up under
    /// `sysfs_root`.
    pub fn new(uri: impl Into<String>, sysfs_root: impl Into<PathBuf>) -> Libvirt {
        Libvirt {
            uri: uri.into(),
            sysfs_root: sysfs_root.into(),
            conn: Mutex::new(None),
        }
    }

    pub fn uri(&self) -> &str {
        &self.uri
    }

    fn cached(&self) -> Option<Arc<Connection>> {
        match self.conn.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn set(&self, c: Option<Arc<Connection>>) {
        match self.conn.lock() {
            Ok(mut g) => *g = c,
            Err(p) => *p.into_inner() = c,
        }
    }

    /// A fresh full list of the domains defined on the host, with the PCI addresses each
    /// references in its live or its persistent definition (blocking). A cached
    /// connection that fails is dropped and one new connection is tried at once, so a
    /// libvirtd restart between two calls costs no refusal.
    pub fn list(&self) -> Result<Vec<DomainDevices>, DomainsError> {
        if let Some(c) = self.cached() {
            match list_on(&c, &self.uri, &self.sysfs_root) {
                Ok(v) => return Ok(v),
                Err(e @ (DomainsError::Xml { .. } | DomainsError::HostDevice { .. })) => {
                    return Err(e)
                }
                Err(e) => {
                    tracing::debug!(error = %e, "libvirt connection failed; reconnecting");
                    self.set(None);
                }
            }
        }
        let c = Connection::open(&self.uri)
            .map(Arc::new)
            .map_err(|source| DomainsError::Unreachable {
                uri: self.uri.clone(),
                source,
            })?;
        let v = list_on(&c, &self.uri, &self.sysfs_root)?;
        self.set(Some(c));
        Ok(v)
    }

    /// [`Libvirt::list`] on a blocking thread, bounded by `timeout`: a hung libvirtd
    /// reads as unreachable rather than stalling the caller.
    pub async fn list_fresh(
        self: &Arc<Self>,
        timeout: Duration,
    ) -> Result<Vec<DomainDevices>, DomainsError> {
        let this = self.clone();
        let task = tokio::task::spawn_blocking(move || this.list());
        match tokio::time::timeout(timeout, task).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(DomainsError::Thread(e.to_string())),
            Err(_) => Err(DomainsError::Timeout {
                uri: self.uri.clone(),
                ms: timeout.as_millis(),
            }),
        }
    }
}

fn list_on(
    c: &Connection,
    uri: &str,
    sysfs_root: &Path,
) -> Result<Vec<DomainDevices>, DomainsError> {
    let call = |what| {
        move |source| DomainsError::Call {
            uri: uri.to_string(),
            what,
            source,
        }
    };
    // Flags 0: every domain, active and inactive, persistent and transient.
    let doms = c.list_all_domains(0).map_err(call("listing domains"))?;
    let mut out = Vec::with_capacity(doms.len());
    for d in doms {
        match describe(&d, uri, sysfs_root) {
            Ok(dd) => out.push(dd),
            // Undefined between the list and this call: it no longer references anything.
            Err(DomainsError::Call { source, .. }) if is_no_domain(&source) => continue,
            Err(e) => return Err(e),
        }
    }
    out.sort_by(|a, b| a.domain.cmp(&b.domain));
    Ok(out)
}

/// What a domain names that sysfs maps to a PCI function.
enum Through {
    Netdev(String),
    Mdev(String),
    Vdpa(String),
}

fn is_no_domain(e: &ffi::Error) -> bool {
    e.code == ffi::ERR_NO_DOMAIN
}

fn describe(d: &ffi::Domain, uri: &str, sysfs_root: &Path) -> Result<DomainDevices, DomainsError> {
    let call = |what| {
        move |source| DomainsError::Call {
            uri: uri.to_string(),
            what,
            source,
        }
    };
    let uuid = d.uuid().map_err(call("reading a domain's UUID"))?;
    let name = d.name().map_err(call("reading a domain's name"))?;
    let running = d.is_active().map_err(call("reading a domain's state"))?;
    let xml_err = |source| DomainsError::Xml {
        uri: uri.to_string(),
        name: name.clone(),
        uuid,
        source: Box::new(source),
    };
    let live = d.xml_desc(0).map_err(call("reading a domain's XML"))?;
    let mut refs = references(&live).map_err(xml_err)?;
    if running {
        // A running domain's next boot may use devices its live definition does not
        // (edited config), and either one makes the device referenced (I3).
        let persistent = d
            .xml_desc(ffi::XML_INACTIVE)
            .map_err(call("reading a domain's persistent XML"))?;
        let more = references(&persistent).map_err(xml_err)?;
        refs.addresses.extend(more.addresses);
        refs.netdevs.extend(more.netdevs);
        refs.mdevs.extend(more.mdevs);
        refs.vdpa.extend(more.vdpa);
    }
    let mut addresses = refs.addresses;
    // A `direct` interface uses the PCI function whose interface it names, an mdev the
    // function it is made on, a vDPA device the function it sits on; one that names none
    // now (a bridge, an mdev not created, a name no device has) uses none. One that
    // cannot be read fails the listing: the device behind it would otherwise read as
    // unused.
    let through = refs
        .netdevs
        .into_iter()
        .map(|n| (format!("the interface {n}"), Through::Netdev(n)))
        .chain(
            refs.mdevs
                .into_iter()
                .map(|m| (format!("the mediated device {m}"), Through::Mdev(m))),
        )
        .chain(
            refs.vdpa
                .into_iter()
                .map(|v| (format!("the vDPA device {v}"), Through::Vdpa(v))),
        );
    for (what, t) in through {
        let found = match &t {
            Through::Netdev(n) => crate::sysfs::netdev_device(sysfs_root, n),
            Through::Mdev(m) => crate::sysfs::mdev_device(sysfs_root, m),
            Through::Vdpa(v) => crate::sysfs::vhost_vdpa_device(sysfs_root, v),
        };
        match found {
            Ok(Some(a)) => addresses.push(a),
            Ok(None) => {}
            Err(source) => {
                return Err(DomainsError::HostDevice {
                    uri: uri.to_string(),
                    name: name.clone(),
                    uuid,
                    what,
                    source: Box::new(source),
                })
            }
        }
    }
    addresses.sort();
    addresses.dedup();
    Ok(DomainDevices {
        domain: DomainRef {
            uuid,
            name,
            running,
        },
        addresses,
    })
}

/// Sets a health slot.
pub fn set_health(slot: &RwLock<HealthInfo>, ok: bool, detail: String) {
    let h = HealthInfo { ok, detail };
    match slot.write() {
        Ok(mut g) => *g = h,
        Err(p) => *p.into_inner() = h,
    }
}

/// A one-line health summary of a successful listing.
pub fn healthy_detail(uri: &str, domains: &[DomainDevices]) -> String {
    let refs: usize = domains.iter().map(|d| d.addresses.len()).sum();
    let running = domains.iter().filter(|d| d.domain.running).count();
    format!(
        "connected to {uri}: {} domains ({running} running), {refs} PCI references",
        domains.len()
    )
}

/// How the poller runs.
#[derive(Debug, Clone)]
pub struct PollSettings {
    pub interval: Duration,
    /// The longest wait between reconnect attempts (backoff doubles up to this).
    pub max_backoff: Duration,
    /// Whether to subscribe to libvirt's domain events and list again on each.
    pub events: bool,
    /// How long a listing may take before the poll counts as failed (`[libvirt]
    /// timeout_ms`, as for a free's listing).
    pub timeout: Duration,
}

/// How long the poller gathers events after the first before it lists the domains.
const EVENT_SETTLE: Duration = Duration::from_millis(100);

/// What wakes the poller before its interval is up.
enum Wake {
    Stop,
    /// A domain event, or the event connection closed.
    Event,
}

/// The poller's domain-event subscription, made again whenever its connection dies.
struct Events {
    uri: String,
    nudge: ffi::Nudge,
    watch: Option<ffi::EventWatch>,
    /// Why events are off for good, if they are.
    off: Option<Off>,
    /// The last failure to subscribe, logged once until a subscription succeeds.
    failing: Option<String>,
}

/// Why domain events are off for good.
enum Off {
    /// `[libvirt] events = false`.
    Config,
    /// The driver has none (libvirt's error).
    Unsupported(String),
}

impl std::fmt::Display for Off {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Off::Config => f.write_str("[libvirt] events = false"),
            Off::Unsupported(e) => write!(f, "not supported: {e}"),
        }
    }
}

/// Where the subscription stands, for [`Events::report`] and [`Events::describe`].
enum Standing<'a> {
    Off(&'a Off),
    Live,
    /// Not held: the last attempt failed with this error.
    Failing(&'a str),
    /// Not held: the connection closed since the last subscription.
    Closed,
}

impl Events {
    /// Subscribes when there is no live subscription; true when a new one was made (the
    /// caller lists again, for whatever changed before it).
    fn ensure(&mut self) -> bool {
        if self.off.is_some() || self.live() {
            return false;
        }
        self.watch = None;
        match ffi::EventWatch::subscribe(&self.uri, self.nudge.clone()) {
            Ok(w) => {
                tracing::info!(uri = %self.uri, "subscribed to libvirt's domain events");
                self.watch = Some(w);
                self.failing = None;
                true
            }
            Err(e) if e.code == ffi::ERR_NO_SUPPORT => {
                tracing::warn!(uri = %self.uri, error = %e, "libvirt has no domain events here; polling only");
                self.off = Some(Off::Unsupported(e.to_string()));
                false
            }
            Err(e) => {
                let e = e.to_string();
                if self.failing.as_ref() != Some(&e) {
                    tracing::warn!(uri = %self.uri, error = %e, "cannot subscribe to libvirt's domain events; polling meanwhile");
                }
                self.failing = Some(e);
                false
            }
        }
    }

    /// Whether a subscription is held and its connection still open.
    fn live(&self) -> bool {
        self.watch.as_ref().is_some_and(|w| w.is_alive())
    }

    fn standing(&self) -> Standing<'_> {
        match (&self.off, self.live(), &self.failing) {
            (Some(why), _, _) => Standing::Off(why),
            (None, true, _) => Standing::Live,
            (None, false, Some(e)) => Standing::Failing(e),
            (None, false, None) => Standing::Closed,
        }
    }

    /// The subscription's own health (GetStatus `libvirt_events`), kept in `slot`, and
    /// the metrics' gauge: healthy while subscribed, or when turned off in config.
    fn report(&self, slot: &RwLock<HealthInfo>, metrics: &crate::metrics::Metrics) {
        let standing = self.standing();
        metrics.set_libvirt_events_subscribed(matches!(standing, Standing::Live));
        let (ok, detail) = match standing {
            Standing::Off(why) => (
                matches!(why, Off::Config),
                format!("off ({why}): domains are seen at each poll only"),
            ),
            Standing::Live => (true, format!("subscribed on {}", self.uri)),
            Standing::Failing(e) => (
                false,
                format!("not subscribed ({e}): domains are seen at each poll until a subscription succeeds"),
            ),
            Standing::Closed => (
                false,
                "not subscribed: the event connection closed; subscribing again".into(),
            ),
        };
        set_health(slot, ok, detail);
    }

    /// For the libvirt health detail.
    fn describe(&self) -> String {
        match self.standing() {
            Standing::Off(why) => format!("domain events off ({why})"),
            Standing::Live => "domain events subscribed".into(),
            Standing::Failing(e) => format!("domain events not subscribed ({e})"),
            Standing::Closed => "domain events not subscribed".into(),
        }
    }
}

/// The running poller; dropping it (or [`Poller::stop`]) ends the thread.
#[derive(Debug)]
pub struct Poller {
    stop: Option<std::sync::mpsc::Sender<Wake>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Poller {
    /// Stops the poller and waits for its thread.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        // The event subscription holds a sender too: say stop rather than hang up.
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(Wake::Stop);
        }
        // The thread ends at once unless libvirt holds it (a subscription's connect to a
        // libvirtd that never answers): then it is left to end with the process, rather
        // than hold the stop for ever.
        if let Some(t) = self.thread.take() {
            let deadline = Instant::now() + HALT_LIMIT;
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                tracing::warn!(
                    "the libvirt poller is still waiting on libvirt; left to end with the process"
                );
            }
        }
    }
}

/// How long stopping the poller waits for its thread.
const HALT_LIMIT: Duration = Duration::from_secs(2);

impl Drop for Poller {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Starts the poller thread: lists the domains every `interval`, and at once on a domain
/// event, and applies them with `writer.domains`, under `order` (the lock a fresh
/// free-time check also takes, so an older poll result can never be applied after a
/// fresher one). On failure it keeps the last domain set, marks libvirt unhealthy, and
/// retries after the interval or a second, whichever is shorter, doubling up to
/// `max_backoff`.
pub fn spawn_poller(
    libvirt: Arc<Libvirt>,
    writer: Writer,
    health: Arc<crate::api::AgentInfo>,
    order: Arc<tokio::sync::Mutex<()>>,
    settings: PollSettings,
    rt: tokio::runtime::Handle,
) -> std::io::Result<Poller> {
    let (stop_tx, wake) = std::sync::mpsc::channel::<Wake>();
    let nudge_tx = stop_tx.clone();
    let metrics = writer.metrics().clone();
    let mut events = Events {
        uri: libvirt.uri().to_string(),
        nudge: Arc::new(move || {
            metrics.libvirt_event();
            let _ = nudge_tx.send(Wake::Event);
        }),
        watch: None,
        off: (!settings.events).then_some(Off::Config),
        failing: None,
    };
    let thread = std::thread::Builder::new()
        .name("hostdevd-libvirt".into())
        .spawn(move || {
            // Log transitions only; the agent logged the first listing itself.
            let started_ok = match health.libvirt.read() {
                Ok(g) => g.ok,
                Err(p) => p.into_inner().ok,
            };
            let mut was_ok = Some(started_ok);
            // A listing that libvirt has not answered within the timeout, still out.
            let mut stuck: Option<tokio::task::JoinHandle<Result<Vec<DomainDevices>, DomainsError>>> =
                None;
            // After a listing at start that failed, the first retry comes as after any
            // failure (within a second), not a whole interval later.
            let mut wait = if started_ok {
                settings.interval
            } else {
                settings.interval.min(Duration::from_secs(1))
            };
            loop {
                // The agent listed the domains once before serving; poll after a pause,
                // or at once after a new subscription (for what changed before it), or
                // EVENT_SETTLE after an event: a burst of events (defined, then started;
                // a host starting its domains) is one listing, at most one per settle.
                if events.ensure() {
                    wait = Duration::ZERO;
                }
                events.report(&health.libvirt_events, writer.metrics());
                match wake.recv_timeout(wait) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Ok(Wake::Event) => {
                        let settled = Instant::now() + EVENT_SETTLE;
                        loop {
                            let left = settled.saturating_duration_since(Instant::now());
                            if left.is_zero() {
                                break;
                            }
                            match wake.recv_timeout(left) {
                                Ok(Wake::Event) => {}
                                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => break,
                                Ok(Wake::Stop) | Err(_) => return,
                            }
                        }
                    }
                    Ok(Wake::Stop) | Err(_) => return,
                }
                // An event may have been the connection's close: say so before listing.
                events.report(&health.libvirt_events, writer.metrics());
                let started = Instant::now();
                let result = {
                    let _order = order.blocking_lock();
                    // Bounded, as a free's listing is: a libvirtd that takes the call and
                    // never answers must not hold the order lock, which every free waits
                    // for, nor keep the health saying it answers. One listing at a time:
                    // while one libvirt has not answered is still out, none more is sent.
                    let listed = match stuck.take() {
                        Some(earlier) if !earlier.is_finished() => {
                            stuck = Some(earlier);
                            Err(DomainsError::Timeout {
                                uri: libvirt.uri().to_string(),
                                ms: settings.timeout.as_millis(),
                            })
                        }
                        _ => {
                            let lv = libvirt.clone();
                            let mut task = rt.spawn_blocking(move || lv.list());
                            // The timer is made inside the runtime: this thread is not one of its.
                            let timed = rt.block_on(async {
                                tokio::time::timeout(settings.timeout, &mut task).await
                            });
                            match timed {
                                Ok(Ok(r)) => r,
                                Ok(Err(e)) => Err(DomainsError::Thread(e.to_string())),
                                Err(_) => {
                                    stuck = Some(task);
                                    Err(DomainsError::Timeout {
                                        uri: libvirt.uri().to_string(),
                                        ms: settings.timeout.as_millis(),
                                    })
                                }
                            }
                        }
                    };
                    match listed {
                        Ok(list) => {
                            let detail = format!(
                                "{}; {}",
                                healthy_detail(libvirt.uri(), &list),
                                events.describe()
                            );
                            match rt.block_on(writer.domains(list)) {
                                Ok(()) => Ok(detail),
                                Err(WriteError::ShuttingDown) => return,
                                Err(e) => Err(format!("applying the domains failed: {e}")),
                            }
                        }
                        Err(e) => Err(e.to_string()),
                    }
                };
                match result {
                    Ok(detail) => {
                        if was_ok != Some(true) {
                            tracing::info!(uri = %libvirt.uri(), took_ms = started.elapsed().as_millis() as u64, "{detail}");
                        }
                        set_health(&health.libvirt, true, detail);
                        was_ok = Some(true);
                        wait = settings.interval;
                    }
                    Err(e) => {
                        if was_ok != Some(false) {
                            tracing::warn!(uri = %libvirt.uri(), error = %e, "libvirt poll failed; frees are refused until it answers");
                        }
                        // Retry after at most a second, doubling up to the cap: with events
                        // on, the interval may be long, and reconnecting must not wait it.
                        let first = settings.interval.min(Duration::from_secs(1));
                        wait = if was_ok == Some(false) {
                            (wait.max(first) * 2).min(settings.max_backoff.max(first))
                        } else {
                            first
                        };
                        set_health(
                            &health.libvirt,
                            false,
                            format!("{e}; retrying in {} ms", wait.as_millis()),
                        );
                        was_ok = Some(false);
                    }
                }
            }
        })?;
    Ok(Poller {
        stop: Some(stop_tx),
        thread: Some(thread),
    })
}
