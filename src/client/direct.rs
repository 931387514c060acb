//! A gRPC transport straight over one HTTP/2 connection on the Unix socket, for unary and
//! server-streaming calls: each request goes out whole (its headers and its one message
//! in one write), with no task between the caller and the connection; once that
//! connection is gone, the next call makes another.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};

/// Flow-control windows as hyper's HTTP/2 client sets them (tonic's `Channel` before):
/// a stream's and the whole connection's, in bytes. The connection's also bounds how many
/// small messages may wait unread before h2 closes the connection as abusive (half of
/// it), which a client with many Watch streams on one connection reaches at h2's default
/// of 64 KiB.
const STREAM_WINDOW: u32 = 2 << 20;
const CONNECTION_WINDOW: u32 = 5 << 20;
/// The largest header block accepted in an answer.
const MAX_HEADER_LIST: u32 = 16 << 10;

/// What can go wrong on a call through [`Direct`].
pub type DirectError = Box<dyn std::error::Error + Send + Sync>;

/// One HTTP/2 connection, shared by every clone (each call is a stream of its own).
/// Made on a socket path ([`super::connect`]), it is made again when it is gone (the
/// agent restarted, or closed it): a call under way then fails as ever, and the next
/// call, from any clone, goes out on a new connection (one for all of them), or fails
/// if none can be made, and the one after tries again. A call is never sent twice.
#[derive(Clone)]
pub struct Direct {
    send: h2::client::SendRequest<Bytes>,
    /// Where the connection is made again (`None`: made on a stream of the caller's).
    again: Option<Arc<Again>>,
    /// How many connections [`Self::again`] made before the one `send` is on.
    made: u64,
    /// `send`'s connection is gone: the next call takes the newest one, made again if
    /// it is the same.
    gone: bool,
}

/// The socket a [`Direct`] connects to again, and its newest connection, shared by its
/// clones.
struct Again {
    path: PathBuf,
    limit: Duration,
    /// The newest connection, with how many were made before it.
    newest: tokio::sync::Mutex<(u64, h2::client::SendRequest<Bytes>)>,
    /// That number, read without the lock: a clone on an older connection takes the
    /// newest before it tries its own.
    made: AtomicU64,
}

impl Again {
    /// The newest connection, made again first if it is the one numbered `gone`.
    async fn connection(&self, gone: u64) -> Result<h2::client::SendRequest<Bytes>, DirectError> {
        let mut newest = self.newest.lock().await;
        if newest.0 == gone {
            // UNAVAILABLE, as gRPC answers a call that found no server: try again.
            let (made, _) = super::connect_within(&self.path, self.limit)
                .await
                .map_err(|e| DirectError::from(tonic::Status::unavailable(e.to_string())))?;
            *newest = (gone + 1, made.send);
            self.made.store(gone + 1, Ordering::Release);
            tracing::debug!(socket = %self.path.display(), "connected to hostdevd again");
        }
        Ok(newest.1.clone())
    }
}

impl std::fmt::Debug for Direct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Direct").finish_non_exhaustive()
    }
}

impl Direct {
    /// Makes the HTTP/2 handshake on `io`, runs the connection on a task of its own, and
    /// waits for the agent to answer a ping: a connection the agent closed at once fails
    /// here, not at the first call. (One over its limit per uid is answered: its calls
    /// fail with RESOURCE_EXHAUSTED, TOO_MANY_CONNECTIONS.)
    pub async fn handshake<T>(io: T) -> std::io::Result<Direct>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (send, mut conn) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_header_list_size(MAX_HEADER_LIST)
            .enable_push(false)
            .handshake(io)
            .await
            .map_err(to_io)?;
        let mut ping = conn.ping_pong();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "the connection to hostdevd ended");
            }
        });
        if let Some(ping) = &mut ping {
            ping.ping(h2::Ping::opaque()).await.map_err(to_io)?;
        }
        let send = send.ready().await.map_err(to_io)?;
        Ok(Direct {
            send,
            again: None,
            made: 0,
            gone: false,
        })
    }

    /// This connection, made again on `path` (waiting at most `limit` for each new one)
    /// once it is gone.
    pub(super) fn again_on(mut self, path: PathBuf, limit: Duration) -> Direct {
        self.again = Some(Arc::new(Again {
            path,
            limit,
            newest: tokio::sync::Mutex::new((0, self.send.clone())),
            made: AtomicU64::new(0),
        }));
        self
    }
}

/// An HTTP/2 error as the I/O error it wraps, if it does (a closed or refused socket).
fn to_io(e: h2::Error) -> std::io::Error {
    if e.is_io() {
        e.into_io()
            .unwrap_or_else(|| std::io::Error::other("the connection failed"))
    } else {
        std::io::Error::other(e)
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for Direct {
    type Response = http::Response<Received>;
    type Error = DirectError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, DirectError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), DirectError>> {
        if let Some(a) = &self.again {
            // Another clone made the connection again: take it (a clone of a client
            // made before the agent restarted goes straight to the new connection).
            if a.made.load(Ordering::Acquire) > self.made {
                if let Ok(newest) = a.newest.try_lock() {
                    (self.made, self.send, self.gone) = (newest.0, newest.1.clone(), false);
                }
            }
            if self.gone {
                // `call` makes it again (or waits for the clone that does).
                return Poll::Ready(Ok(()));
            }
        }
        match self.send.poll_ready(cx) {
            Poll::Ready(Err(e)) if self.again.is_some() => {
                tracing::debug!(error = %e, "the connection to hostdevd is gone");
                self.gone = true;
                Poll::Ready(Ok(()))
            }
            polled => polled.map_err(Into::into),
        }
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        if let (true, Some(again)) = (self.gone, &self.again) {
            let (again, made) = (again.clone(), self.made);
            // The call's deadline covers making the connection again too: an agent that
            // takes the new connection and never answers must not hold the caller for
            // the connect limit, nor one clone after another for it each.
            let deadline = call_deadline(req.headers());
            return Box::pin(async move {
                let attempt = async {
                    let send = again.connection(made).await?.ready().await?;
                    send_on(send, req).await
                };
                match deadline {
                    Some(limit) => tokio::time::timeout(limit, attempt)
                        .await
                        .map_err(|_| past_deadline(limit))?,
                    None => attempt.await,
                }
            });
        }
        let ready = self.send.clone();
        let ready = std::mem::replace(&mut self.send, ready);
        Box::pin(send_on(ready, req))
    }
}

async fn send_on(
    mut ready: h2::client::SendRequest<Bytes>,
    req: http::Request<tonic::body::Body>,
) -> Result<http::Response<Received>, DirectError> {
    let (mut parts, mut body) = req.into_parts();
    // A unary or server-streaming request's body is one message, ready at once (tonic
    // encodes it as one frame; any more are joined).
    let mut message = Bytes::new();
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if let Ok(data) = frame?.into_data() {
            message = if message.is_empty() {
                data
            } else {
                [message, data].concat().into()
            };
        }
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    parts.uri = http::Uri::builder()
        .scheme("http")
        .authority("localhost")
        .path_and_query(path)
        .build()?;
    // The caller's deadline (`tonic::Request::set_timeout`, sent as `grpc-timeout`), kept
    // here as tonic's own transport keeps it: an agent that takes the call and never
    // answers (stopped, wedged) must not hold the caller for ever.
    let deadline = call_deadline(&parts.headers);
    let head = http::Request::from_parts(parts, ());
    let (answer, mut stream) = ready.send_request(head, message.is_empty())?;
    if !message.is_empty() {
        stream.send_data(message, true)?;
    }
    let answer = match deadline {
        // Dropping the stream's two halves on expiry resets it.
        Some(limit) => tokio::time::timeout(limit, answer)
            .await
            .map_err(|_| past_deadline(limit))??,
        None => answer.await?,
    };
    Ok(answer.map(|recv| Received {
        recv,
        data_done: false,
    }))
}

/// The call's deadline, as its `grpc-timeout` header gives it.
fn call_deadline(headers: &http::HeaderMap) -> Option<Duration> {
    headers
        .get("grpc-timeout")
        .and_then(|v| grpc_timeout(v.to_str().ok()?))
}

/// The error of a call that reached its deadline, `limit` after it began.
fn past_deadline(limit: Duration) -> DirectError {
    DirectError::from(tonic::Status::deadline_exceeded(format!(
        "hostdevd did not answer within the call's deadline ({} ms)",
        limit.as_millis()
    )))
}

/// A `grpc-timeout` header's value: at most eight digits and a unit (hours, minutes,
/// seconds, milli-, micro- or nanoseconds).
fn grpc_timeout(v: &str) -> Option<Duration> {
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// An answer's body: its messages, then its trailers (gRPC's status).
#[derive(Debug)]
pub struct Received {
    recv: h2::RecvStream,
    data_done: bool,
}

impl Body for Received {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        if !self.data_done {
            match std::task::ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => self.data_done = true,
            }
        }
        match std::task::ready!(self.recv.poll_trailers(cx)) {
            Ok(Some(t)) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_read_as_the_spec_writes_them() {
        assert_eq!(grpc_timeout("200m"), Some(Duration::from_millis(200)));
        assert_eq!(grpc_timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(
            grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "m", "123456789m", "12x", "-1S", "1.5S"] {
            assert_eq!(grpc_timeout(bad), None, "{bad}");
        }
    }

    /// An agent that takes the connection and the call and never answers: a call with a
    /// deadline ends with DEADLINE_EXCEEDED at that deadline. Before, it waited for ever.
    #[tokio::test]
    async fn a_call_past_its_deadline_ends_deadline_exceeded() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("silent.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        let server = tokio::spawn(async move {
            let (io, _) = listener.accept().await.expect("accept");
            let mut conn = h2::server::handshake(io).await.expect("handshake");
            let mut held = Vec::new();
            // Takes every call and answers none.
            while let Some(Ok(call)) = conn.accept().await {
                held.push(call);
            }
        });
        let mut c = crate::client::connect(&path).await.expect("connect");
        let mut req = tonic::Request::new(crate::api::proto::GetStatusRequest {});
        req.set_timeout(Duration::from_millis(200));
        let started = std::time::Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(10), c.get_status(req))
            .await
            .expect("the call ends by its deadline")
            .expect_err("no answer");
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        server.abort();
    }

    /// The agent closes the connection, and its next one is taken and never answered (it
    /// restarted and is stopped): the next call's deadline covers making the connection
    /// again, and it ends DEADLINE_EXCEEDED at that deadline, not after the connect limit.
    #[tokio::test]
    async fn a_deadline_covers_making_the_connection_again() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("restarted.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        let server = tokio::spawn(async move {
            let (io, _) = listener.accept().await.expect("accept");
            let mut conn = h2::server::handshake(io).await.expect("handshake");
            // Answers the client's ping, then closes.
            let _ = tokio::time::timeout(Duration::from_millis(300), conn.accept()).await;
            drop(conn);
            let mut held = Vec::new();
            while let Ok((io, _)) = listener.accept().await {
                held.push(io);
            }
        });
        let mut c = crate::client::connect(&path).await.expect("connect");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut req = tonic::Request::new(crate::api::proto::GetStatusRequest {});
        req.set_timeout(Duration::from_millis(200));
        let started = std::time::Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(10), c.get_status(req))
            .await
            .expect("the call ends")
            .expect_err("no answer");
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
        // Well under the 5 s the reconnect alone would wait.
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{:?}",
            started.elapsed()
        );
        server.abort();
    }
}
