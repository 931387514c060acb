//! Places for every call, taken before its message is read: one caller (a Unix-socket
//! peer uid, or a TCP peer address: `Caller`) may have at most `[api] max_calls_per_uid`
//! calls open at once (the API's, health checks and reflection together), from a call's
//! arrival until its answer has been handed to HTTP/2 or dropped (a Watch stream: until
//! it ends), and of them at most [`HEAVY`]'s number of each heavy call: a Reconcile
//! (whose message may be large) and a ListDevices (whose answer is). One more is refused
//! at once, unread.
//!
//! Without them, any client allowed on the socket could make the agent hold as many
//! calls as its connections carry (1,024 each, 512 connections a uid), each a few KiB
//! while open, and of the heavy ones far more. A Reconcile may carry 100,000 consumer
//! ids (about 3.8 MB on the wire, several times that decoded) and waits with them for
//! the free checks' pass over `/proc`: 400 dry runs from 40 connections took the agent's
//! resident memory from 32 MB to 560 MB. A listing's answer
//! waits, whole, until its client reads it: 4,000 listings of a 64-VF host that the
//! client never read added 37 MB, and a 4096-VF host's answer is some sixty times larger.
//! A call over the count is refused rather than kept waiting: a waiting call's unread
//! message holds its connection's HTTP/2 flow-control window, and the calls running on
//! that connection could then no longer receive theirs (tried: 197 of 200 timed out).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::{Frame, SizeHint};
use tonic::body::Body;
use tower::Service;

use crate::api::per_uid::{Caller, PerUid, Place};
use crate::api::status::{to_status, trailers_only, ApiError};
use crate::metrics::Metrics;

/// The heavy calls: gRPC method, and how many one caller may have open at once. A compute
/// manager audits every few minutes, one audit at a time, and lists now and then; an
/// operator's command adds one.
pub const HEAVY: &[(&str, usize)] = &[("Reconcile", 2), ("ListDevices", 8)];

/// The service whose methods [`HEAVY`] names.
const SERVICE_PATH: &str = "/hostdev.v1.HostDev/";

/// The streaming calls served beside the API's: they last as long as their client
/// reads, so a stop does not wait for them (see [`Answering`]).
const STREAMS: &[&str] = &[
    "/hostdev.v1.HostDev/Watch",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
];

/// The calls being answered on a listener, streams not counted: a stop waits for these
/// (a claim's commit, a binding's sysfs writes), not for a stream that a client keeps
/// open (a Watch whose reader stopped reading, a health Watch, which ends only with the
/// server).
#[derive(Debug, Default)]
pub struct Answering {
    open: AtomicUsize,
    idle: tokio::sync::Notify,
}

impl Answering {
    /// Calls being answered now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Returns once no call is being answered.
    pub async fn idle(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.open() == 0 {
                return;
            }
            idle.await;
        }
    }

    fn begin(self: &Arc<Self>) -> AnsweringOne {
        self.open.fetch_add(1, Ordering::SeqCst);
        AnsweringOne(Arc::clone(self))
    }
}

/// One call counted in [`Answering`] until it is dropped.
#[derive(Debug)]
struct AnsweringOne(Arc<Answering>);

impl Drop for AnsweringOne {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// `inner` (the API's generated server), with each call taking a place first.
#[derive(Debug, Clone)]
pub struct Gate<S> {
    inner: S,
    turns: Arc<Turns>,
}

/// The calls open, by caller, and the heavy ones by method and caller.
#[derive(Debug)]
struct Turns {
    calls: Arc<PerUid<Caller>>,
    /// One count per entry of [`HEAVY`], in its order.
    heavy: Vec<(&'static str, Arc<PerUid<Caller>>)>,
    /// Counts refusals among the rejections (`TOO_MANY_CALLS`, `TOO_MANY_AT_ONCE`).
    metrics: Arc<Metrics>,
    /// The calls being answered, streams not counted.
    answering: Arc<Answering>,
}

impl<S> Gate<S> {
    /// `calls_per_uid` calls open at once for one caller, the heavy ones as [`HEAVY`] says.
    pub fn new(inner: S, calls_per_uid: usize, metrics: Arc<Metrics>) -> Gate<S> {
        Gate::with_turns(inner, calls_per_uid, HEAVY, metrics)
    }

    /// `inner` (another service on the same listener) taking its places from the same
    /// counts as this gate's calls.
    pub fn beside<T>(&self, inner: T) -> Gate<T> {
        Gate {
            inner,
            turns: Arc::clone(&self.turns),
        }
    }

    /// With other counts for the heavy calls than [`HEAVY`]'s (tests).
    pub fn with_turns(
        inner: S,
        calls_per_uid: usize,
        heavy: &[(&'static str, usize)],
        metrics: Arc<Metrics>,
    ) -> Gate<S> {
        Gate {
            inner,
            turns: Arc::new(Turns {
                calls: PerUid::new(calls_per_uid),
                heavy: heavy
                    .iter()
                    .map(|(rpc, n)| (*rpc, PerUid::new(*n)))
                    .collect(),
                metrics,
                answering: Arc::default(),
            }),
        }
    }

    /// The calls this gate's listener is answering, streams not counted.
    pub fn answering(&self) -> Arc<Answering> {
        Arc::clone(&self.turns.answering)
    }
}

impl Turns {
    /// The answer refusing a call for `why`, counted among the rejections.
    fn refuse(&self, why: ApiError) -> http::Response<Body> {
        if let Some(reason) = why.check_reason() {
            self.metrics.rejected(reason);
        }
        // The message is dropped unread, which frees its share of the window.
        trailers_only(&to_status(&why))
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Gate<S> {
    const NAME: &'static str = S::NAME;
}

/// A call with its place: the inner call, whose answer keeps the place; or a refusal.
type Taken<E> = Pin<Box<dyn Future<Output = Result<http::Response<Body>, E>> + Send>>;

impl<S, B> Service<http::Request<B>> for Gate<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Taken<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let caller = Caller::of(req.extensions());
        let turns = &self.turns;
        let Some(place) = turns.calls.take(caller) else {
            let answer = turns.refuse(ApiError::TooManyCalls {
                limit: turns.calls.limit(),
                caller,
            });
            return Box::pin(async move { Ok(answer) });
        };
        let method = req.uri().path().strip_prefix(SERVICE_PATH);
        let heavy = match turns.heavy.iter().find(|(rpc, _)| method == Some(*rpc)) {
            None => None,
            Some((rpc, open)) => match open.take(caller) {
                Some(turn) => Some(turn),
                None => {
                    let answer = turns.refuse(ApiError::TooManyAtOnce {
                        rpc,
                        limit: open.limit(),
                        caller,
                    });
                    return Box::pin(async move { Ok(answer) });
                }
            },
        };
        let answering = (!STREAMS.contains(&req.uri().path())).then(|| turns.answering.begin());
        let call = self.inner.call(req);
        Box::pin(async move {
            let answer = call.await?;
            Ok(answer.map(|body| {
                Body::new(Holding {
                    body,
                    _places: (place, heavy),
                    _answering: answering,
                })
            }))
        })
    }
}

/// An answer's body that keeps its call's places until HTTP/2 has taken all of it, or
/// dropped it (the client gone, the stream reset): the caller's, and a heavy call's turn;
/// and, but for a stream, its count among the calls being answered.
struct Holding {
    body: Body,
    _places: (Place<Caller>, Option<Place<Caller>>),
    _answering: Option<AnsweringOne>,
}

impl http_body::Body for Holding {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<bytes::Bytes>, tonic::Status>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use tonic::transport::server::UdsConnectInfo;
    use tower::ServiceExt;

    const RECONCILE: &str = "/hostdev.v1.HostDev/Reconcile";
    const LIST: &str = "/hostdev.v1.HostDev/ListDevices";
    const CLAIM: &str = "/hostdev.v1.HostDev/Claim";

    /// Counts the calls it is running, the most at once, and answers after a pause.
    #[derive(Clone, Default)]
    struct Slow {
        running: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
    }

    impl Service<http::Request<()>> for Slow {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future =
            Pin<Box<dyn Future<Output = Result<http::Response<Body>, Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            let (running, most) = (self.running.clone(), self.most.clone());
            Box::pin(async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok(http::Response::new(Body::new(String::from("answer"))))
            })
        }
    }

    /// A call from this process's own uid (credentials as the socket gives them), or from
    /// a caller without credentials.
    fn call_to(path: &str, with_cred: bool) -> http::Request<()> {
        let mut req = http::Request::builder()
            .uri(path)
            .body(())
            .expect("request");
        if with_cred {
            let (ours, _theirs) = tokio::net::UnixStream::pair().expect("pair");
            req.extensions_mut().insert(UdsConnectInfo {
                peer_addr: None,
                peer_cred: Some(ours.peer_cred().expect("peer credentials")),
            });
        }
        req
    }

    fn own_uid() -> Caller {
        Caller::Uid(Some(nix::unistd::getuid().as_raw()))
    }

    fn gate(slow: &Slow, reconciles: usize, metrics: Arc<Metrics>) -> Gate<Slow> {
        Gate::with_turns(
            slow.clone(),
            64,
            &[("Reconcile", reconciles), ("ListDevices", 1)],
            metrics,
        )
    }

    /// Each call's answer, its body read to the end (which gives its turn back): the
    /// grpc-status of a refusal, `None` for an answer of the inner service.
    async fn all_at_once(gate: &Gate<Slow>, calls: &[(&str, bool)]) -> Vec<Option<String>> {
        let tasks: Vec<_> = calls
            .iter()
            .map(|(path, cred)| tokio::spawn(gate.clone().oneshot(call_to(path, *cred))))
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            let answer = t.await.expect("task").expect("answer");
            let status = answer
                .headers()
                .get("grpc-status")
                .map(|v| v.to_str().unwrap_or("?").to_string());
            let mut body = answer.into_body();
            while let Some(frame) =
                std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
            {
                frame.expect("frame");
            }
            out.push(status);
        }
        out
    }

    #[tokio::test]
    async fn a_caller_runs_its_turns_and_one_more_is_refused_at_once() {
        let slow = Slow::default();
        let metrics = Metrics::new();
        let gate = gate(&slow, 2, Arc::clone(&metrics));
        let calls = [(RECONCILE, true); 3];
        let answers = all_at_once(&gate, &calls).await;
        let refused: Vec<_> = answers.iter().filter(|a| a.is_some()).collect();
        assert_eq!(refused, [&Some("8".to_string())], "{answers:?}");
        assert_eq!(slow.most.load(Ordering::SeqCst), 2);
        assert_eq!(metrics.rejections("TOO_MANY_AT_ONCE"), 1);
        // Their turns are given back once answered and read.
        let again = all_at_once(&gate, &calls[..2]).await;
        assert_eq!(again, [None, None]);
        assert!(gate.turns.heavy.iter().all(|(_, o)| o.is_empty()));
        assert!(gate.turns.calls.is_empty());
    }

    /// Every call takes one of its caller's places, heavy or not, until its answer is
    /// read; one past the limit is refused, and the places come back.
    #[tokio::test]
    async fn a_caller_has_at_most_its_calls_open() {
        let slow = Slow::default();
        let metrics = Metrics::new();
        let gate = Gate::with_turns(slow.clone(), 3, &[("Reconcile", 2)], Arc::clone(&metrics));
        let calls = [
            (CLAIM, true),
            (RECONCILE, true),
            (LIST, true),
            (CLAIM, true),
        ];
        let answers = all_at_once(&gate, &calls).await;
        assert_eq!(answers, [None, None, None, Some("8".to_string())]);
        assert_eq!(metrics.rejections("TOO_MANY_CALLS"), 1);
        // Another caller has places of its own.
        let unread = gate
            .clone()
            .oneshot(call_to(CLAIM, true))
            .await
            .expect("answer");
        assert_eq!(gate.turns.calls.held_by(own_uid()), 1);
        assert_eq!(all_at_once(&gate, &[(CLAIM, false)]).await, [None]);
        drop(unread);
        assert!(gate.turns.calls.is_empty());
    }

    /// A call counts among those being answered from its arrival until its answer is
    /// taken or dropped; a Watch stream never does, so a stop that waits for the calls
    /// being answered does not wait for a stream its client keeps open.
    #[tokio::test]
    async fn a_stop_waits_for_calls_not_for_streams() {
        let slow = Slow::default();
        let gate = Gate::new(slow.clone(), 10, Metrics::new());
        let answering = gate.answering();
        let watch = gate
            .clone()
            .oneshot(call_to("/hostdev.v1.HostDev/Watch", true))
            .await
            .expect("answer");
        let health = gate
            .clone()
            .oneshot(call_to("/grpc.health.v1.Health/Watch", true))
            .await
            .expect("answer");
        assert_eq!(answering.open(), 0, "streams are not counted");
        tokio::time::timeout(Duration::from_secs(1), answering.idle())
            .await
            .expect("idle with only streams open");
        let call = tokio::spawn(gate.clone().oneshot(call_to(CLAIM, true)));
        while slow.running.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(answering.open(), 1);
        let unread = call.await.expect("task").expect("answer");
        assert_eq!(answering.open(), 1, "until its answer is taken");
        let idle = tokio::spawn({
            let answering = Arc::clone(&answering);
            async move { answering.idle().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!idle.is_finished());
        drop(unread);
        tokio::time::timeout(Duration::from_secs(1), idle)
            .await
            .expect("idle once the answer is gone")
            .expect("task");
        drop((watch, health));
    }

    #[tokio::test]
    async fn methods_and_callers_have_turns_of_their_own_and_other_calls_take_none() {
        let slow = Slow::default();
        let gate = gate(&slow, 1, Metrics::new());
        let calls = [
            (RECONCILE, true),
            (RECONCILE, false),
            (LIST, true),
            (CLAIM, true),
            (CLAIM, true),
        ];
        let answers = all_at_once(&gate, &calls).await;
        assert_eq!(answers, [None, None, None, None, None]);
        assert_eq!(slow.most.load(Ordering::SeqCst), 5);
    }

    /// An answer not yet read keeps its turn; dropped unread, it gives the turn back.
    #[tokio::test]
    async fn an_answer_keeps_its_turn_until_read_or_dropped() {
        let slow = Slow::default();
        let gate = gate(&slow, 1, Metrics::new());
        let unread = gate
            .clone()
            .oneshot(call_to(LIST, true))
            .await
            .expect("answer");
        let (_, list_open) = &gate.turns.heavy[1];
        assert_eq!(list_open.held_by(own_uid()), 1);
        assert_eq!(
            all_at_once(&gate, &[(LIST, true)]).await,
            [Some("8".to_string())]
        );
        drop(unread);
        assert!(list_open.is_empty());
        assert_eq!(all_at_once(&gate, &[(LIST, true)]).await, [None]);
    }

    /// A call dropped while it runs (its client gone) gives its turn back.
    #[tokio::test]
    async fn a_call_dropped_while_running_gives_its_turn_back() {
        let slow = Slow::default();
        let gate = gate(&slow, 1, Metrics::new());
        let running = tokio::spawn(gate.clone().oneshot(call_to(RECONCILE, true)));
        tokio::time::sleep(Duration::from_millis(5)).await;
        let (_, reconciles) = &gate.turns.heavy[0];
        assert_eq!(reconciles.held_by(own_uid()), 1);
        running.abort();
        let _ = running.await;
        assert!(reconciles.is_empty());
        assert_eq!(all_at_once(&gate, &[(RECONCILE, true)]).await, [None]);
    }
}
