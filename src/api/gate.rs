//! A turn for each Reconcile call before its message is read: at most
//! [`RECONCILES_AT_ONCE`] run at once for one caller (a Unix-socket peer uid; TCP clients
//! share one count), and one more is refused at once, unread.
//!
//! A Reconcile may carry 100,000 consumer ids (about 3.8 MB on the wire, several times
//! that decoded) and waits, with them in memory, for the free checks' pass over `/proc`.
//! Every other call is checked and refused, or sent on, as soon as it is decoded. Without
//! a turn, any client allowed on the socket could have as many of them decoded at once as
//! its connections carry calls: 400 dry runs of 100,000 ids from 40 connections took the
//! agent's resident memory from 32 MB to 560 MB. The call over the count is refused
//! rather than kept waiting: a waiting call's unread message holds its connection's
//! HTTP/2 flow-control window, and the calls running on that connection could then no
//! longer receive theirs (tried: 197 of 200 timed out).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::Either;
use tonic::transport::server::UdsConnectInfo;
use tower::Service;

use crate::api::per_uid::PerUid;
use crate::api::status::{to_status, trailers_only, ApiError};
use crate::metrics::Metrics;

/// Reconcile calls one caller may have running at once. A compute manager audits every
/// few minutes, one audit at a time; an operator's dry run comes now and then.
pub const RECONCILES_AT_ONCE: usize = 2;

/// The gRPC path whose calls take a turn.
const RECONCILE_PATH: &str = "/hostdev.v1.HostDev/Reconcile";

/// `inner` (the API's generated server), with each Reconcile call taking a turn first.
#[derive(Debug, Clone)]
pub struct Gate<S> {
    inner: S,
    turns: Arc<Turns>,
}

/// Reconcile calls running, by caller.
#[derive(Debug)]
struct Turns {
    running: Arc<PerUid>,
    /// Counts refusals among the rejections (`TOO_MANY_RECONCILES`).
    metrics: Arc<Metrics>,
}

impl<S> Gate<S> {
    pub fn new(inner: S, metrics: Arc<Metrics>) -> Gate<S> {
        Gate::with_turns(inner, RECONCILES_AT_ONCE, metrics)
    }

    /// With `per_caller` Reconcile calls at once (tests).
    pub fn with_turns(inner: S, per_caller: usize, metrics: Arc<Metrics>) -> Gate<S> {
        Gate {
            inner,
            turns: Arc::new(Turns {
                running: PerUid::new(per_caller),
                metrics,
            }),
        }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Gate<S> {
    const NAME: &'static str = S::NAME;
}

/// A Reconcile that has its turn: the inner call, holding the turn until it ends.
type Running<R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send>>;

impl<S, B, A> Service<http::Request<B>> for Gate<S>
where
    S: Service<http::Request<B>, Response = http::Response<A>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    A: Default + Send + 'static,
{
    type Response = http::Response<A>;
    type Error = S::Error;
    type Future = Either<S::Future, Running<http::Response<A>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != RECONCILE_PATH {
            return Either::Left(self.inner.call(req));
        }
        let caller = req
            .extensions()
            .get::<UdsConnectInfo>()
            .and_then(|i| i.peer_cred)
            .map(|c| c.uid());
        let Some(turn) = self.turns.running.take(caller) else {
            let refusal = ApiError::TooManyReconciles {
                limit: self.turns.running.limit(),
                uid: caller,
            };
            if let Some(reason) = refusal.check_reason() {
                self.turns.metrics.rejected(reason);
            }
            // The message is dropped unread, which frees its share of the window.
            let answer = trailers_only(&to_status(&refusal));
            return Either::Right(Box::pin(async move { Ok(answer) }));
        };
        let call = self.inner.call(req);
        Either::Right(Box::pin(async move {
            let answer = call.await;
            drop(turn);
            answer
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use tower::ServiceExt;

    /// Counts the calls it is running, the most at once, and answers after a pause.
    #[derive(Clone, Default)]
    struct Slow {
        running: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
    }

    impl Service<http::Request<()>> for Slow {
        type Response = http::Response<()>;
        type Error = std::convert::Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<http::Response<()>, Self::Error>> + Send>>;

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
                Ok(http::Response::new(()))
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

    fn own_uid() -> Option<u32> {
        Some(nix::unistd::getuid().as_raw())
    }

    /// The grpc-status of each answer, `None` for one the inner service gave.
    async fn all_at_once(gate: &Gate<Slow>, calls: &[(&str, bool)]) -> Vec<Option<String>> {
        let tasks: Vec<_> = calls
            .iter()
            .map(|(path, cred)| tokio::spawn(gate.clone().oneshot(call_to(path, *cred))))
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            let answer = t.await.expect("task").expect("answer");
            out.push(
                answer
                    .headers()
                    .get("grpc-status")
                    .map(|v| v.to_str().unwrap_or("?").to_string()),
            );
        }
        out
    }

    #[tokio::test]
    async fn a_caller_runs_its_turns_and_one_more_is_refused_at_once() {
        let slow = Slow::default();
        let metrics = Metrics::new();
        let gate = Gate::with_turns(slow.clone(), 2, Arc::clone(&metrics));
        let calls = [(RECONCILE_PATH, true); 3];
        let answers = all_at_once(&gate, &calls).await;
        let refused: Vec<_> = answers.iter().filter(|a| a.is_some()).collect();
        assert_eq!(refused, [&Some("8".to_string())], "{answers:?}");
        assert_eq!(slow.most.load(Ordering::SeqCst), 2);
        assert_eq!(metrics.rejections("TOO_MANY_RECONCILES"), 1);
        // Their turns are given back once answered.
        let again = all_at_once(&gate, &calls[..2]).await;
        assert_eq!(again, [None, None]);
        assert!(gate.turns.running.is_empty());
    }

    #[tokio::test]
    async fn callers_have_turns_of_their_own_and_other_calls_take_none() {
        let slow = Slow::default();
        let gate = Gate::with_turns(slow.clone(), 1, Metrics::new());
        let calls = [
            (RECONCILE_PATH, true),
            (RECONCILE_PATH, false),
            ("/hostdev.v1.HostDev/Claim", true),
            ("/hostdev.v1.HostDev/Claim", true),
        ];
        let answers = all_at_once(&gate, &calls).await;
        assert_eq!(answers, [None, None, None, None]);
        assert_eq!(slow.most.load(Ordering::SeqCst), 4);
    }

    /// A call dropped while it runs (its client gone) gives its turn back.
    #[tokio::test]
    async fn a_call_dropped_while_running_gives_its_turn_back() {
        let slow = Slow::default();
        let gate = Gate::with_turns(slow.clone(), 1, Metrics::new());
        let running = tokio::spawn(gate.clone().oneshot(call_to(RECONCILE_PATH, true)));
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(gate.turns.running.held_by(own_uid()), 1);
        running.abort();
        let _ = running.await;
        assert!(gate.turns.running.is_empty());
        let answers = all_at_once(&gate, &[(RECONCILE_PATH, true)]).await;
        assert_eq!(answers, [None]);
    }
}
