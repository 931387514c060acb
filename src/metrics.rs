//! Prometheus metrics: counters kept by the writer, gauges read from the published view,
//! rendered in the text exposition format on an optional HTTP listener.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::api::per_uid::{PerUid, Place};
use crate::ledger::DeviceState;
use crate::writer::Writer;

/// Upper bounds (seconds) of the store commit latency histogram.
const COMMIT_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// Counters and the commit histogram. Cheap to update from the writer thread.
#[derive(Debug, Default)]
pub struct Metrics {
    claims: AtomicU64,
    releases: AtomicU64,
    transfers: AtomicU64,
    vfio_binds: AtomicU64,
    vf_counts: AtomicU64,
    replays: AtomicU64,
    rejections: Mutex<BTreeMap<&'static str, u64>>,
    commits: AtomicU64,
    commit_failures: AtomicU64,
    commit_buckets: [AtomicU64; COMMIT_BUCKETS.len()],
    commit_sum_us: AtomicU64,
    uevents: AtomicU64,
    uevent_resyncs: AtomicU64,
    libvirt_events: AtomicU64,
    /// Whether the poller holds a live subscription to libvirt's domain events.
    libvirt_events_subscribed: AtomicBool,
    /// Request-log entries on disk, as of the last commit.
    stored_requests: AtomicU64,
    /// Batches decided and committed on the requesting worker's thread, the writer
    /// thread being idle.
    inline_batches: AtomicU64,
    /// Passes over the proc tree for VFIO holders.
    holder_scans: AtomicU64,
    /// Connections open on the API socket.
    connections: AtomicU64,
    /// Connections refused (answered with the reason, or closed at once): their uid held
    /// `[api] max_connections_per_uid`.
    connections_refused: AtomicU64,
    /// Accepts on the API's listeners that failed for want of descriptors or memory.
    accept_failures: AtomicU64,
    /// Connections open on the TCP listener (from the accept, the TLS handshake included).
    tcp_connections: AtomicU64,
    /// TCP connections closed at once: their peer address held `[api.tcp]
    /// max_connections_per_peer`.
    tcp_connections_refused: AtomicU64,
}

/// What a request did, for counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Claim,
    Release,
    Transfer,
    /// A claimed device bound to vfio-pci.
    BindVfio,
    /// A PF's VF count written.
    SetVfCount,
}

/// Lowers a gauge by one, never below zero, whatever the order of updates.
fn lower(gauge: &AtomicU64) {
    let _ = gauge.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        Arc::new(Metrics::default())
    }

    /// A request that changed the ledger (or was replayed from the request log).
    pub fn applied(&self, op: Op, replayed: bool) {
        if replayed {
            self.replays.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let c = match op {
            Op::Claim => &self.claims,
            Op::Release => &self.releases,
            Op::Transfer => &self.transfers,
            Op::BindVfio => &self.vfio_binds,
            Op::SetVfCount => &self.vf_counts,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// A request the agent refused, by machine-readable reason.
    pub fn rejected(&self, reason: &'static str) {
        let mut g = match self.rejections.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        *g.entry(reason).or_default() += 1;
    }

    /// How many requests were refused for `reason` so far.
    pub fn rejections(&self, reason: &str) -> u64 {
        let g = match self.rejections.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.get(reason).copied().unwrap_or(0)
    }

    /// How many request-log entries the store holds now.
    pub fn stored_requests(&self, n: u64) {
        self.stored_requests.store(n, Ordering::Relaxed);
    }

    /// A batch decided on the requesting worker's thread instead of the writer thread.
    pub fn inline_batch(&self) {
        self.inline_batches.fetch_add(1, Ordering::Relaxed);
    }

    /// How many batches were decided on the requesting worker's thread.
    pub fn inline_batches(&self) -> u64 {
        self.inline_batches.load(Ordering::Relaxed)
    }

    /// Request-log entries on disk, as of the last commit or prune.
    pub fn request_log_entries(&self) -> u64 {
        self.stored_requests.load(Ordering::Relaxed)
    }

    /// One store commit and how long it took.
    pub fn commit(&self, took: Duration, ok: bool) {
        if !ok {
            self.commit_failures.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.commits.fetch_add(1, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        for (i, b) in COMMIT_BUCKETS.iter().enumerate() {
            if secs <= *b {
                self.commit_buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.commit_sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// One kernel uevent handled.
    pub fn uevent(&self) {
        self.uevents.fetch_add(1, Ordering::Relaxed);
    }

    /// A pass over the proc tree for the holders of VFIO and vhost-vdpa nodes, made for
    /// the checks before frees and in audits (shared by those that waited for it).
    pub fn holder_scan(&self) {
        self.holder_scans.fetch_add(1, Ordering::Relaxed);
    }

    /// Passes over the proc tree made so far (see [`Self::holder_scan`]).
    pub fn holder_scans(&self) -> u64 {
        self.holder_scans.load(Ordering::Relaxed)
    }

    /// A connection admitted on the API socket.
    pub fn connection_opened(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }

    /// An admitted connection closed.
    pub fn connection_closed(&self) {
        lower(&self.connections);
    }

    /// Connections open on the API socket now.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// A connection refused, its uid holding as many as it may.
    pub fn connection_refused(&self) {
        self.connections_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Connections refused so far (see [`Self::connection_refused`]).
    pub fn connections_refused(&self) -> u64 {
        self.connections_refused.load(Ordering::Relaxed)
    }

    /// A connection admitted on the TCP listener.
    pub fn tcp_connection_opened(&self) {
        self.tcp_connections.fetch_add(1, Ordering::Relaxed);
    }

    /// An admitted TCP connection closed.
    pub fn tcp_connection_closed(&self) {
        lower(&self.tcp_connections);
    }

    /// Connections open on the TCP listener now.
    pub fn tcp_connections(&self) -> u64 {
        self.tcp_connections.load(Ordering::Relaxed)
    }

    /// A TCP connection refused, its peer address holding as many as it may.
    pub fn tcp_connection_refused(&self) {
        self.tcp_connections_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// TCP connections refused so far (see [`Self::tcp_connection_refused`]).
    pub fn tcp_connections_refused(&self) -> u64 {
        self.tcp_connections_refused.load(Ordering::Relaxed)
    }

    /// An accept that failed for want of file descriptors or memory.
    pub fn accept_failed(&self) {
        self.accept_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Accepts failed so far (see [`Self::accept_failed`]).
    pub fn accept_failures(&self) -> u64 {
        self.accept_failures.load(Ordering::Relaxed)
    }

    /// A full rescan because uevents were lost (overflow) or the socket failed.
    pub fn uevent_resync(&self) {
        self.uevent_resyncs.fetch_add(1, Ordering::Relaxed);
    }

    /// One libvirt domain event, or the close of the event connection.
    pub fn libvirt_event(&self) {
        self.libvirt_events.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether a live subscription to libvirt's domain events is held: set by the poller.
    pub fn set_libvirt_events_subscribed(&self, subscribed: bool) {
        self.libvirt_events_subscribed
            .store(subscribed, Ordering::Relaxed);
    }

    /// Whether the poller last found a live subscription to libvirt's domain events.
    pub fn libvirt_events_subscribed(&self) -> bool {
        self.libvirt_events_subscribed.load(Ordering::Relaxed)
    }

    /// (uevents handled, full rescans after lost events).
    pub fn uevent_counts(&self) -> (u64, u64) {
        (
            self.uevents.load(Ordering::Relaxed),
            self.uevent_resyncs.load(Ordering::Relaxed),
        )
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// A metric of one series without labels: its header, then its value.
fn single(out: &mut String, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
    header(out, name, kind, help);
    let _ = writeln!(out, "{name} {value}");
}

/// Renders every metric in the Prometheus text format.
pub fn render(m: &Metrics, writer: &Writer, libvirt_up: bool) -> String {
    let view = writer.view();
    let mut out = String::new();
    let mut by_state: BTreeMap<&'static str, u64> = [
        "free",
        "claimed",
        "attached",
        "lost",
        "unavailable",
        "unmanaged",
    ]
    .into_iter()
    .map(|s| (s, 0))
    .collect();
    for st in view.states().values() {
        *by_state.entry(st.name()).or_default() += 1;
    }
    header(
        &mut out,
        "hostdevd_devices",
        "gauge",
        "Devices by ownership state.",
    );
    for (s, n) in &by_state {
        let _ = writeln!(out, "hostdevd_devices{{state=\"{s}\"}} {n}");
    }
    single(
        &mut out,
        "hostdevd_host_generation",
        "gauge",
        "The host-wide generation counter.",
        view.host_generation,
    );
    single(
        &mut out,
        "hostdevd_strays",
        "gauge",
        "Domains referencing devices without holding their claim.",
        view.stray_count(),
    );
    let lost = view
        .states()
        .values()
        .filter(|s| **s == DeviceState::Lost)
        .count();
    single(
        &mut out,
        "hostdevd_lost_devices",
        "gauge",
        "Claims whose device is gone from sysfs.",
        lost,
    );
    single(
        &mut out,
        "hostdevd_request_log_entries",
        "gauge",
        "Request-log entries kept on disk for retries ([api] request_log_entries at most).",
        m.request_log_entries(),
    );
    single(
        &mut out,
        "hostdevd_inline_requests_total",
        "counter",
        "Claims, releases and transfers decided (and committed, when they changed something) on the async worker that received them, the writer thread being idle.",
        m.inline_batches(),
    );
    single(
        &mut out,
        "hostdevd_connections",
        "gauge",
        "Connections open on the API's Unix socket.",
        m.connections(),
    );
    single(
        &mut out,
        "hostdevd_connections_refused_total",
        "counter",
        "Connections on the API's Unix socket refused, served nothing: their peer uid held [api] max_connections_per_uid open connections.",
        m.connections_refused(),
    );
    single(
        &mut out,
        "hostdevd_tcp_connections",
        "gauge",
        "Connections open on the TCP listener, from the accept (the TLS handshake included).",
        m.tcp_connections(),
    );
    single(
        &mut out,
        "hostdevd_tcp_connections_refused_total",
        "counter",
        "Connections on the TCP listener closed at once, before the TLS handshake: their peer address held [api.tcp] max_connections_per_peer open connections.",
        m.tcp_connections_refused(),
    );
    single(
        &mut out,
        "hostdevd_accept_failures_total",
        "counter",
        &format!(
            "Accepts on the API's listeners (the Unix socket, the TCP listener) that failed for want of file descriptors or memory (each followed by a {} ms pause).",
            crate::api::connections::ACCEPT_PAUSE.as_millis()
        ),
        m.accept_failures(),
    );
    single(
        &mut out,
        "hostdevd_request_log_in_memory",
        "gauge",
        "The newest of them also kept in memory ([api] request_log_in_memory at most).",
        view.ledger.request_log_len(),
    );
    let (kept, kept_bytes) = match writer.events().lock() {
        Ok(g) => g.kept(),
        Err(p) => p.into_inner().kept(),
    };
    single(
        &mut out,
        "hostdevd_watch_buffer_events",
        "gauge",
        "Changes kept for resuming watchers ([api] watch_buffer at most).",
        kept,
    );
    single(
        &mut out,
        "hostdevd_watch_buffer_bytes",
        "gauge",
        "Memory those changes hold ([api] watch_buffer_bytes at most).",
        kept_bytes,
    );
    header(
        &mut out,
        "hostdevd_requests_total",
        "counter",
        "Mutating requests applied, by operation (replays counted apart).",
    );
    for (op, c) in [
        ("claim", &m.claims),
        ("release", &m.releases),
        ("transfer", &m.transfers),
        ("bind_vfio", &m.vfio_binds),
        ("set_vf_count", &m.vf_counts),
        ("replay", &m.replays),
    ] {
        let _ = writeln!(
            out,
            "hostdevd_requests_total{{op=\"{op}\"}} {}",
            c.load(Ordering::Relaxed)
        );
    }
    header(
        &mut out,
        "hostdevd_rejections_total",
        "counter",
        "Requests refused by the ledger, by reason.",
    );
    {
        let g = match m.rejections.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        for (r, n) in g.iter() {
            let _ = writeln!(out, "hostdevd_rejections_total{{reason=\"{r}\"}} {n}");
        }
    }
    header(
        &mut out,
        "hostdevd_store_commit_seconds",
        "histogram",
        "Latency of durable store commits (one per batch).",
    );
    for (i, b) in COMMIT_BUCKETS.iter().enumerate() {
        let _ = writeln!(
            out,
            "hostdevd_store_commit_seconds_bucket{{le=\"{b}\"}} {}",
            m.commit_buckets[i].load(Ordering::Relaxed)
        );
    }
    let count = m.commits.load(Ordering::Relaxed);
    let _ = writeln!(
        out,
        "hostdevd_store_commit_seconds_bucket{{le=\"+Inf\"}} {count}"
    );
    let _ = writeln!(
        out,
        "hostdevd_store_commit_seconds_sum {}",
        m.commit_sum_us.load(Ordering::Relaxed) as f64 / 1e6
    );
    let _ = writeln!(out, "hostdevd_store_commit_seconds_count {count}");
    single(
        &mut out,
        "hostdevd_store_commit_failures_total",
        "counter",
        "Store commits that failed (the batch was undone).",
        m.commit_failures.load(Ordering::Relaxed),
    );
    single(
        &mut out,
        "hostdevd_libvirt_up",
        "gauge",
        "1 when libvirt answered the last query.",
        u8::from(libvirt_up),
    );
    single(
        &mut out,
        "hostdevd_vfio_holder_scans_total",
        "counter",
        "Passes over /proc for processes holding VFIO or vhost-vdpa nodes, before frees and in audits; checks that arrive while one runs share the next.",
        m.holder_scans.load(Ordering::Relaxed),
    );
    single(
        &mut out,
        "hostdevd_uevents_total",
        "counter",
        "Kernel uevents handled.",
        m.uevents.load(Ordering::Relaxed),
    );
    single(
        &mut out,
        "hostdevd_uevent_resyncs_total",
        "counter",
        "Full rescans after uevents were lost (socket overflow, ENOBUFS) or the socket failed.",
        m.uevent_resyncs.load(Ordering::Relaxed),
    );
    single(
        &mut out,
        "hostdevd_libvirt_events_total",
        "counter",
        "libvirt domain events received, and closes of the event connection; each makes the poller list the domains again.",
        m.libvirt_events.load(Ordering::Relaxed),
    );
    single(
        &mut out,
        "hostdevd_libvirt_events_subscribed",
        "gauge",
        "1 while the agent holds a live subscription to libvirt's domain events; 0 when it is down, failing, or not wanted.",
        u8::from(m.libvirt_events_subscribed()),
    );
    out
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    writer: Writer,
    libvirt_up: impl Fn() -> bool + Clone + Send + Sync + 'static,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let (m, w, up) = (metrics.clone(), writer.clone(), libvirt_up.clone());
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    render(&m, &w, up()),
                )
            }
        }),
    );
    let listener = Capped {
        inner: listener,
        per_peer: PerUid::new(METRICS_PER_PEER),
        all: PerUid::new(METRICS_CONNECTIONS),
        refused: 0,
        warned: None,
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Connections one peer address may hold open to the metrics listener (a scraper keeps
/// one), and all peers together: each is a descriptor of the agent's, which its frees'
/// checks of `/proc` and its sysfs scans need too.
const METRICS_PER_PEER: usize = 4;
const METRICS_CONNECTIONS: usize = 64;

/// How long a metrics connection may go without sending a byte before it is closed (a
/// scraper sends its next request every scrape interval, seconds apart).
const METRICS_IDLE: Duration = Duration::from_secs(60);

/// The metrics listener with its connections capped by peer address and in all; one over
/// a cap is closed at once (logged at most every 10 s).
struct Capped {
    inner: tokio::net::TcpListener,
    per_peer: Arc<PerUid<crate::tcp::Peer>>,
    all: Arc<PerUid<()>>,
    refused: u64,
    warned: Option<std::time::Instant>,
}

impl axum::serve::Listener for Capped {
    type Io = Held;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Held, std::net::SocketAddr) {
        loop {
            let (io, addr) = axum::serve::Listener::accept(&mut self.inner).await;
            let places = self
                .all
                .take(())
                .and_then(|all| Some((all, self.per_peer.take(crate::tcp::peer_of(addr))?)));
            match places {
                Some(places) => {
                    return (
                        Held {
                            io,
                            _places: places,
                            idle: Box::pin(tokio::time::sleep(METRICS_IDLE)),
                        },
                        addr,
                    )
                }
                None => {
                    drop(io);
                    self.refused += 1;
                    if self
                        .warned
                        .is_none_or(|w| w.elapsed() >= Duration::from_secs(10))
                    {
                        tracing::warn!(peer = %addr.ip(), refused = self.refused, per_peer = METRICS_PER_PEER, all = METRICS_CONNECTIONS, "metrics connections over their cap closed");
                        self.warned = Some(std::time::Instant::now());
                        self.refused = 0;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.inner.local_addr()
    }
}

/// A metrics connection: its places in the caps, and closed once it has sent nothing for
/// [`METRICS_IDLE`].
struct Held {
    io: tokio::net::TcpStream,
    _places: (Place<()>, Place<crate::tcp::Peer>),
    idle: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl tokio::io::AsyncRead for Held {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let before = buf.filled().len();
        match std::pin::Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    let next = tokio::time::Instant::now() + METRICS_IDLE;
                    self.idle.as_mut().reset(next);
                }
                Poll::Ready(r)
            }
            Poll::Pending => match std::future::Future::poll(self.idle.as_mut(), cx) {
                Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the metrics connection sent nothing for too long",
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl tokio::io::AsyncWrite for Held {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
