//! The API socket's accept loop: at most `[api] max_connections_per_uid` open
//! connections for one peer uid (one more is answered with a gRPC status that says so,
//! then closed), and a pause, not a spin, while accepting fails for want of file
//! descriptors or memory.
//!
//! Every connection holds a descriptor for as long as its client keeps it. A client that
//! leaks connections (a channel made per call and never closed) would otherwise take
//! every descriptor the agent may open, and then the agent's own reads of sysfs and
//! `/proc` fail too. And once accepting fails with `EMFILE`, the connection stays queued,
//! so the next accept fails the same way at once: tonic's loop retries without pause, and
//! one CPU spins for as long as the descriptors stay taken (measured: 2.99 s of CPU in a
//! 3 s flood at a limit of 64 descriptors).

use std::hash::Hash;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tonic::transport::server::Connected;

use crate::api::per_uid::{PerUid, Place};
use crate::api::status::{to_status, trailers_only, ApiError};
use crate::metrics::Metrics;

/// What a connection may hold and how long it may stay silent, from `[api]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections one Unix-socket peer uid may hold open.
    pub per_uid: usize,
    /// Calls open at once on one connection (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS).
    pub streams: u32,
    /// Calls one caller may have open at once over all its connections (`api::gate`).
    pub calls_per_uid: usize,
    /// How long a connection may stay silent before the agent pings it (HTTP/2 PING).
    pub keepalive_interval: Duration,
    /// How long a ping may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// How long a stop waits for the calls being answered (streams aside): longer than
    /// the longest a call may take at the configured timeouts, a VF count change's (its
    /// fresh domain listing, the autoprobe write, and two `sriov_numvfs` writes).
    pub drain: Duration,
}

impl ConnectionLimits {
    pub fn from_config(cfg: &crate::config::Config) -> ConnectionLimits {
        let api = &cfg.api;
        let ms = cfg
            .libvirt
            .timeout_ms
            .saturating_add(cfg.hardware.step_timeout_ms)
            .saturating_add(cfg.hardware.vf_count_timeout_ms.saturating_mul(2))
            .saturating_add(15_000);
        ConnectionLimits {
            drain: Duration::from_millis(ms),
            per_uid: api.max_connections_per_uid,
            // At most 2^20, checked with the config.
            streams: u32::try_from(api.max_streams_per_connection).unwrap_or(u32::MAX),
            calls_per_uid: api.max_calls_per_uid,
            keepalive_interval: Duration::from_millis(api.keepalive_interval_ms),
            keepalive_timeout: Duration::from_millis(api.keepalive_timeout_ms),
        }
    }
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits::from_config(&crate::config::Config::default())
    }
}

/// How long accepting pauses after it failed for want of descriptors or memory.
pub const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// Refused connections answered at once, at most: one more is closed without an answer.
/// Each answer holds a descriptor for at most [`REFUSAL_TIME`].
pub const REFUSALS_ANSWERED_AT_ONCE: usize = 8;

/// How long a refused connection may take to send its first call and read the answer.
pub const REFUSAL_TIME: Duration = Duration::from_secs(2);

/// How often at most a warning is logged for refused connections or failed accepts (each
/// names how many there were since the last one).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Open connections by peer uid (`None`: the kernel gave no credentials), against the
/// limits they were made under.
#[derive(Debug)]
pub struct Connections {
    limits: ConnectionLimits,
    open: Arc<PerUid>,
    /// Keeps the `hostdevd_connections` gauge and the refusal counters.
    metrics: Arc<Metrics>,
}

impl Connections {
    pub fn new(limits: ConnectionLimits, metrics: Arc<Metrics>) -> Arc<Connections> {
        Arc::new(Connections {
            open: PerUid::new(limits.per_uid),
            limits,
            metrics,
        })
    }

    /// What one connection may do, and how long it may stay silent.
    pub fn limits(&self) -> &ConnectionLimits {
        &self.limits
    }

    /// A place for one more connection of `uid`; `None` while it holds `per_uid`.
    pub fn admit(self: &Arc<Self>, uid: Option<u32>) -> Option<Slot> {
        let place = self.open.take(uid)?;
        Some(Slot::new(
            place,
            Arc::clone(&self.metrics),
            Metrics::connection_opened,
            Metrics::connection_closed,
        ))
    }

    /// Connections open now, over all uids (the gauge in `metrics` says the same; this
    /// reads the accounting itself).
    #[cfg(test)]
    fn open(&self) -> usize {
        self.open.held()
    }

    /// The agent's metrics, which count the connections and the failed accepts.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Connections open now for `uid`.
    #[cfg(test)]
    fn open_for(&self, uid: Option<u32>) -> usize {
        self.open.held_by(uid)
    }
}

/// One connection's place among its caller's (a uid's on the Unix socket, a peer
/// address's on the TCP listener), given back when it is dropped (when the connection
/// closes), and its listener's gauge of open connections, raised while it lives.
#[derive(Debug)]
pub struct Slot<K: Copy + Eq + Hash = Option<u32>> {
    metrics: Arc<Metrics>,
    closed: fn(&Metrics),
    _place: Place<K>,
}

impl<K: Copy + Eq + Hash> Slot<K> {
    /// Holds `place`; the gauge is raised by `opened` now and lowered by `closed` when
    /// the slot is dropped.
    pub fn new(
        place: Place<K>,
        metrics: Arc<Metrics>,
        opened: fn(&Metrics),
        closed: fn(&Metrics),
    ) -> Slot<K> {
        opened(&metrics);
        Slot {
            metrics,
            closed,
            _place: place,
        }
    }
}

impl<K: Copy + Eq + Hash> Drop for Slot<K> {
    fn drop(&mut self) {
        (self.closed)(&self.metrics);
    }
}

/// An accepted connection on the Unix socket, holding its place.
pub type Conn = Held<UnixStream, Slot>;

/// An accepted connection (`stream`) and what it holds while it is open (`hold`: its
/// place among its caller's, given back when the connection closes); read and written as
/// the stream itself. The Unix socket's connections and the TCP listener's are both one.
#[derive(Debug)]
pub struct Held<S, H> {
    stream: S,
    _hold: H,
}

impl<S, H> Held<S, H> {
    pub fn new(stream: S, hold: H) -> Held<S, H> {
        Held {
            stream,
            _hold: hold,
        }
    }
}

impl<S: Connected, H> Connected for Held<S, H> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> S::ConnectInfo {
        self.stream.connect_info()
    }
}

impl<S: AsyncRead + Unpin, H: Unpin> AsyncRead for Held<S, H> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin, H: Unpin> AsyncWrite for Held<S, H> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Whether an accept failed for want of something that closing connections gives back:
/// retrying at once would fail the same way.
fn exhausted(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// A warning at most every [`WARN_EVERY`], counting what happened in between.
#[derive(Debug, Default)]
pub(crate) struct Quiet {
    last: Option<Instant>,
    since: u64,
}

impl Quiet {
    /// Counts one more; the count to report when a warning is due.
    pub(crate) fn due(&mut self) -> Option<u64> {
        self.since += 1;
        let now = Instant::now();
        if self
            .last
            .is_some_and(|l| now.duration_since(l) < WARN_EVERY)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.since))
    }
}

struct Accepting {
    listener: UnixListener,
    conns: Arc<Connections>,
    refused: Quiet,
    /// A permit for each refused connection being answered now.
    answering: Arc<Semaphore>,
}

/// The connections accepted on `listener` that `conns` admits. A connection over its
/// uid's limit is not served: its calls are answered RESOURCE_EXHAUSTED
/// (TOO_MANY_CONNECTIONS, naming the setting) and it is closed, or,
/// while [`REFUSALS_ANSWERED_AT_ONCE`] are being answered, closed at once. Either way
/// the agent logs it and counts it in `hostdevd_connections_refused_total`. Failed
/// accepts are handled as [`pausing`] says.
pub fn incoming(
    listener: UnixListener,
    conns: Arc<Connections>,
) -> impl Stream<Item = io::Result<Conn>> {
    let metrics = Arc::clone(&conns.metrics);
    let state = Accepting {
        listener,
        conns,
        refused: Quiet::default(),
        answering: Arc::new(Semaphore::new(REFUSALS_ANSWERED_AT_ONCE)),
    };
    let admitted = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            let stream = match s.listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => return Some((Err(e), s)),
            };
            let uid = stream.peer_cred().ok().map(|c| c.uid());
            if let Some(slot) = s.conns.admit(uid) {
                return Some((Ok(Held::new(stream, slot)), s));
            }
            let refusal = ApiError::TooManyConnections {
                limit: s.conns.limits.per_uid,
                uid,
            };
            refuse(stream, &refusal, &s.answering);
            s.conns.metrics.connection_refused();
            if let Some(n) = s.refused.due() {
                tracing::warn!(
                    uid = ?uid,
                    limit = s.conns.limits.per_uid,
                    refused = n,
                    "connection refused: its uid holds as many open connections as [api] max_connections_per_uid allows (a client that opens a connection per call and keeps them?)"
                );
            }
        }
    });
    pausing(admitted, metrics, "the Unix socket")
}

/// Answers a refused connection on a task of its own, unless
/// [`REFUSALS_ANSWERED_AT_ONCE`] are being answered already: then it is closed now.
fn refuse(stream: UnixStream, why: &ApiError, answering: &Arc<Semaphore>) {
    let Ok(permit) = Arc::clone(answering).try_acquire_owned() else {
        return;
    };
    let status = to_status(why);
    tokio::spawn(async move {
        // Whatever the client does, the connection is closed by the time limit.
        let _ = tokio::time::timeout(REFUSAL_TIME, answer_refused(stream, status)).await;
        drop(permit);
    });
}

/// Speaks HTTP/2 on a refused connection for as long as it takes to answer each call it
/// opens with `status` (no message is read), then closes it: its client learns why from
/// the call it made, where a connection closed at once ends that call with a bare
/// transport error.
async fn answer_refused<T>(io: T, status: tonic::Status)
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let head = trailers_only::<()>(&status);
    let Ok(mut conn) = h2::server::Builder::new()
        .max_concurrent_streams(1)
        .handshake::<_, bytes::Bytes>(io)
        .await
    else {
        return;
    };
    let mut answered = false;
    while let Some(Ok((_, mut respond))) = conn.accept().await {
        let mut answer = http::Response::new(());
        *answer.headers_mut() = head.headers().clone();
        // The status alone ends the stream: a trailers-only answer.
        let _ = respond.send_response(answer, true);
        if !answered {
            answered = true;
            conn.graceful_shutdown();
        }
    }
}

/// `accepted` (a listener's accepts), where an accept that failed for want of
/// descriptors or memory is counted in `hostdevd_accept_failures_total`, logged at most
/// every 10 s, and followed by a pause of [`ACCEPT_PAUSE`] instead of going to the
/// server, whose loop would retry at once. Other failures (a connection reset before it
/// was accepted) go to the server, which goes on.
pub fn pausing<T>(
    accepted: impl Stream<Item = io::Result<T>>,
    metrics: Arc<Metrics>,
    listener: &'static str,
) -> impl Stream<Item = io::Result<T>> {
    let state = (Box::pin(accepted), metrics, Quiet::default());
    futures_util::stream::unfold(
        state,
        move |(mut accepted, metrics, mut failed)| async move {
            loop {
                match accepted.next().await? {
                    Err(e) if exhausted(&e) => {
                        metrics.accept_failed();
                        if let Some(n) = failed.due() {
                            tracing::warn!(
                                error = %e,
                                failed = n,
                                unix_connections = metrics.connections(),
                                "accepting a connection on {listener} failed for want of file descriptors or memory; accepting pauses {} ms after each failure",
                                ACCEPT_PAUSE.as_millis()
                            );
                        }
                        tokio::time::sleep(ACCEPT_PAUSE).await;
                    }
                    other => return Some((other, (accepted, metrics, failed))),
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call on a connection the agent refused: the status it was answered with.
    async fn refused_call(io: UnixStream) -> tonic::Status {
        let direct = crate::client::Direct::handshake(io)
            .await
            .expect("a refused connection still speaks HTTP/2");
        let mut c = crate::api::proto::host_dev_client::HostDevClient::new(direct);
        tokio::time::timeout(
            Duration::from_secs(10),
            c.get_status(crate::api::proto::GetStatusRequest {}),
        )
        .await
        .expect("an answer")
        .expect_err("a refused connection serves nothing")
    }

    /// Reads `io` until the agent closes it, which must be within `most`.
    async fn closed_within(mut io: UnixStream, most: Duration) {
        let mut buf = [0u8; 256];
        loop {
            let n = tokio::time::timeout(most, tokio::io::AsyncReadExt::read(&mut io, &mut buf))
                .await
                .expect("the connection is closed in time")
                .unwrap_or(0);
            if n == 0 {
                return;
            }
        }
    }

    /// Refused connections being answered now, of at most [`REFUSALS_ANSWERED_AT_ONCE`].
    fn being_answered(answering: &Semaphore) -> usize {
        REFUSALS_ANSWERED_AT_ONCE - answering.available_permits()
    }

    /// The refusal's answer carries the reason and its facts, for clients that act on
    /// ErrorInfo, and the connection is closed once it went out.
    #[tokio::test]
    async fn a_refused_connection_is_told_why_and_closed() {
        let (agent, client) = UnixStream::pair().expect("pair");
        let answering = Arc::new(Semaphore::new(REFUSALS_ANSWERED_AT_ONCE));
        let why = ApiError::TooManyConnections {
            limit: 512,
            uid: Some(1000),
        };
        refuse(agent, &why, &answering);
        assert_eq!(being_answered(&answering), 1);
        let direct = crate::client::Direct::handshake(client)
            .await
            .expect("handshake");
        let mut c = crate::api::proto::host_dev_client::HostDevClient::new(direct);
        let status = c
            .list_devices(crate::api::proto::ListDevicesRequest {})
            .await
            .expect_err("refused");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(
            status
                .message()
                .starts_with("hostdevd refused this connection: uid 1000 holds 512 connections"),
            "{status:?}"
        );
        let info = tonic_types::StatusExt::get_details_error_info(&status).expect("ErrorInfo");
        assert_eq!(info.reason, "TOO_MANY_CONNECTIONS");
        assert_eq!(info.metadata.get("uid").map(String::as_str), Some("1000"));
        assert_eq!(
            info.metadata
                .get("max_connections_per_uid")
                .map(String::as_str),
            Some("512")
        );
        // A second call on it finds the connection going away, not served.
        assert!(c
            .get_status(crate::api::proto::GetStatusRequest {})
            .await
            .is_err());
        let deadline = Instant::now() + REFUSAL_TIME + Duration::from_secs(10);
        while being_answered(&answering) != 0 {
            assert!(Instant::now() < deadline, "the answering task never ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A refused peer that says nothing holds its descriptor for [`REFUSAL_TIME`] at
    /// most, and past [`REFUSALS_ANSWERED_AT_ONCE`] being answered, one more is closed at
    /// once without a word.
    #[tokio::test]
    async fn refusals_are_bounded_in_number_and_time() {
        let answering = Arc::new(Semaphore::new(REFUSALS_ANSWERED_AT_ONCE));
        let why = ApiError::TooManyConnections {
            limit: 1,
            uid: None,
        };
        let mut silent = Vec::new();
        for _ in 0..REFUSALS_ANSWERED_AT_ONCE {
            let (agent, client) = UnixStream::pair().expect("pair");
            refuse(agent, &why, &answering);
            silent.push(client);
        }
        assert_eq!(being_answered(&answering), REFUSALS_ANSWERED_AT_ONCE);
        let (agent, mut client) = UnixStream::pair().expect("pair");
        refuse(agent, &why, &answering);
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::io::AsyncReadExt::read(&mut client, &mut byte),
        )
        .await
        .expect("closed at once")
        .unwrap_or(0);
        assert_eq!(n, 0, "one past the answers under way is closed without one");
        assert_eq!(being_answered(&answering), REFUSALS_ANSWERED_AT_ONCE);
        for s in silent {
            closed_within(s, REFUSAL_TIME + Duration::from_secs(10)).await;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while being_answered(&answering) != 0 {
            assert!(Instant::now() < deadline, "the answering tasks never ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The default limits but `per_uid` connections for one uid.
    fn per_uid(per_uid: usize) -> ConnectionLimits {
        ConnectionLimits {
            per_uid,
            ..ConnectionLimits::default()
        }
    }

    #[test]
    fn a_uid_holds_at_most_its_limit_and_a_closed_connection_gives_its_place_back() {
        let c = Connections::new(per_uid(2), Metrics::new());
        let a1 = c.admit(Some(1)).expect("first");
        let a2 = c.admit(Some(1)).expect("second");
        assert!(c.admit(Some(1)).is_none(), "a third for uid 1");
        // Others keep theirs, and a peer without credentials counts as one more uid.
        let b = c.admit(Some(2)).expect("uid 2");
        let n1 = c.admit(None).expect("no credentials");
        let n2 = c.admit(None).expect("no credentials, second");
        assert!(c.admit(None).is_none(), "a third without credentials");
        assert_eq!(c.open(), 5);
        assert_eq!(c.open_for(Some(1)), 2);
        drop(a1);
        assert_eq!(c.open_for(Some(1)), 1);
        let a3 = c.admit(Some(1)).expect("the place given back");
        assert_eq!(c.metrics.connections(), 5);
        drop((a2, a3, b, n1, n2));
        assert_eq!(c.open(), 0);
        assert_eq!(c.metrics.connections(), 0);
        assert!(
            c.open.is_empty(),
            "no uid is kept once it has no connection"
        );
    }

    #[test]
    fn a_limit_of_zero_admits_nothing_and_keeps_no_entry() {
        let c = Connections::new(per_uid(0), Metrics::new());
        assert!(c.admit(Some(7)).is_none());
        assert!(c.open.is_empty());
    }

    #[test]
    fn only_exhausted_resources_pause_accepting() {
        for errno in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert!(exhausted(&io::Error::from_raw_os_error(errno)), "{errno}");
        }
        for errno in [libc::ECONNABORTED, libc::EINTR, libc::EPROTO] {
            assert!(!exhausted(&io::Error::from_raw_os_error(errno)), "{errno}");
        }
    }

    #[test]
    fn warnings_are_spaced_and_count_what_they_skipped() {
        let mut q = Quiet::default();
        assert_eq!(q.due(), Some(1));
        assert_eq!(q.due(), None);
        assert_eq!(q.due(), None);
        q.last = Some(Instant::now() - WARN_EVERY);
        assert_eq!(q.due(), Some(3), "the two skipped and this one");
    }

    #[tokio::test]
    async fn connections_over_the_limit_are_closed_and_the_rest_served() {
        let dir = tempfile::tempdir_in(crate::simhost::scratch_base()).expect("tempdir");
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let metrics = Metrics::new();
        let conns = Connections::new(per_uid(2), Arc::clone(&metrics));
        let accepted = incoming(listener, Arc::clone(&conns));
        let mut accepted = Box::pin(accepted);
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(UnixStream::connect(&path).await.expect("connect"));
        }
        let first = accepted.next().await.expect("one").expect("accepted");
        let second = accepted.next().await.expect("two").expect("accepted");
        assert_eq!(conns.open(), 2);
        // The third is refused while the stream waits for a fourth: its call is answered
        // with the reason, and the connection closed.
        let waiting = tokio::spawn(async move {
            let fourth = accepted.next().await;
            (fourth, accepted)
        });
        let third = clients.pop().expect("third");
        let status = refused_call(third).await;
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(
            status.message().contains("[api] max_connections_per_uid")
                && status.message().contains("holds 2 connections"),
            "{status:?}"
        );
        assert_eq!(metrics.connections_refused(), 1);
        drop(first);
        let _again = UnixStream::connect(&path).await.expect("connect again");
        let (fourth, _accepted) = waiting.await.expect("task");
        let _fourth = fourth
            .expect("four")
            .expect("admitted once a place was free");
        assert_eq!(conns.open(), 2);
        drop(second);
    }
}
