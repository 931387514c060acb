//! The queue between one Watch stream's feed and its client: bounded in events and in
//! bytes, and emptied at once when the watcher is cut off, so that a client that stops
//! reading costs the agent one queued status, not a buffer of events it will never read.
//!
//! A plain bounded channel cannot do this: its receiver, which owns the buffered events,
//! lives inside the HTTP/2 response body, and that body is not polled (so not dropped)
//! while the client's flow-control window is full. Here the sender can clear the queue.
//!
//! Live changes wait as the writer's shared [`Event`]s and are turned into protobuf only
//! when the client takes them (built and encoded once for every watcher, see
//! [`super::wire`]), so a queue full of changes costs a pointer per change;
//! the snapshot, built for this client alone, waits already converted and is bounded in
//! bytes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use prost::Message;
use tokio::sync::Notify;
use tonic::Status;

use super::proto::WatchEvent;
use super::wire::WireEvent;
use crate::writer::Event;

/// Something waiting for the client.
#[derive(Debug)]
pub enum Pending {
    /// Built for this client (the snapshot).
    Ready(Box<WatchEvent>),
    /// A change, shared with every other watcher until it is taken.
    Shared(Event),
}

impl Pending {
    /// What it holds in memory of its own: the encoded size of a built event, one slot
    /// for a shared change.
    fn cost(&self) -> usize {
        match self {
            Pending::Ready(e) => e.encoded_len(),
            Pending::Shared(_) => std::mem::size_of::<Pending>(),
        }
    }
}

/// Turns a change into the encoded protobuf the client receives.
pub type Convert = Box<dyn Fn(&Event) -> WireEvent + Send + Sync>;

/// How much one watcher may have waiting before it is cut off.
///
/// A change is refused only for the changes ahead of it: the snapshot a client asked for
/// may still fill the queue's bytes when the live changes start, and counting them
/// against it would cut off a client that reads its snapshot at its own pace after a
/// handful of changes (before, a snapshot queued to its end left room for four to eight).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLimits {
    /// Events waiting for the client: built ones and changes alike, for a built event;
    /// changes alone, for a change.
    pub events: usize,
    /// Bytes waiting for the client (built events by their encoded size, shared changes
    /// by their slot), for a built event. One event larger than this is still sent when
    /// nothing else waits.
    pub bytes: usize,
}

type Item = Result<Pending, Status>;

#[derive(Debug, Default)]
struct Inner {
    /// Each item with its encoded size.
    items: VecDeque<(Item, usize)>,
    bytes: usize,
    /// How many of `items` are shared changes.
    changes: usize,
    /// No item will follow the ones queued (the feed ended or cut the watcher off).
    ended: bool,
    /// The client's stream was dropped: nothing more is wanted.
    reader_gone: bool,
    /// The client asked for a snapshot and has not yet taken its end: cut off now, it
    /// holds part of a snapshot at most, and must start again with one.
    snapshot_unfinished: bool,
}

#[derive(Debug)]
struct Shared {
    inner: Mutex<Inner>,
    /// Woken when an item is queued or the feed ends (one reader).
    readable: Notify,
    /// Woken when room is made or the reader goes (one feed).
    writable: Notify,
    limits: QueueLimits,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave the queue inconsistent (each
        // method does one push or pop), so a poisoned lock is still usable.
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
}

/// Why an event was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The queue is at its event or byte limit.
    Full,
    /// The client's stream is gone, or the feed already ended it.
    Gone,
}

/// The feed's end.
#[derive(Debug)]
pub struct WatchSender(Arc<Shared>);

/// The client's end; the slot in the stream limit is held until it is dropped.
pub struct WatchReceiver {
    shared: Arc<Shared>,
    convert: Convert,
    _slot: Option<Slot>,
}

impl std::fmt::Debug for WatchReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchReceiver")
            .field("shared", &self.shared)
            .finish_non_exhaustive()
    }
}

/// What a watcher holds while its stream is open: its places in the stream limits,
/// given back when dropped.
pub type Slot = Box<dyn std::any::Any + Send + Sync>;

/// A queue for one watcher; `slot` is its place among the open watch streams, and
/// `convert` builds a shared change's protobuf when the client takes it.
pub fn queue(
    limits: QueueLimits,
    convert: Convert,
    slot: Option<Slot>,
) -> (WatchSender, WatchReceiver) {
    let shared = Arc::new(Shared {
        inner: Mutex::new(Inner::default()),
        readable: Notify::new(),
        writable: Notify::new(),
        limits,
    });
    (
        WatchSender(shared.clone()),
        WatchReceiver {
            shared,
            convert,
            _slot: slot,
        },
    )
}

impl WatchSender {
    /// The client asked for a snapshot: until it takes the snapshot's end (an event of
    /// kind `SNAPSHOT_END`), a cut-off says it holds part of one only.
    pub fn snapshot_asked(&self) {
        self.0.lock().snapshot_unfinished = true;
    }

    fn push(&self, item: Item) -> Result<(), (Refused, Item)> {
        let mut g = self.0.lock();
        if g.reader_gone || g.ended {
            return Err((Refused::Gone, item));
        }
        let size = match &item {
            Ok(p) => p.cost(),
            Err(s) => s.message().len(),
        };
        let limits = self.0.limits;
        let change = matches!(item, Ok(Pending::Shared(_)));
        let full = if change {
            g.changes >= limits.events
        } else {
            !g.items.is_empty()
                && (g.items.len() >= limits.events || g.bytes.saturating_add(size) > limits.bytes)
        };
        if full {
            return Err((Refused::Full, item));
        }
        g.bytes += size;
        g.changes += usize::from(change);
        g.items.push_back((item, size));
        drop(g);
        self.0.readable.notify_one();
        Ok(())
    }

    /// Queues an event if there is room now.
    pub fn try_send(&self, event: Pending) -> Result<(), Refused> {
        self.push(Ok(event)).map_err(|(r, _)| r)
    }

    /// Queues an event, waiting for room (the snapshot and the replayed backlog, which
    /// the client asked for and reads at its own pace). Fails only when the client left.
    pub async fn send(&self, event: Pending) -> Result<(), Refused> {
        let mut item = Ok(event);
        loop {
            match self.push(item) {
                Ok(()) => return Ok(()),
                Err((Refused::Gone, _)) => return Err(Refused::Gone),
                Err((Refused::Full, back)) => {
                    item = back;
                    // One feed per queue: a permit stored by a pop between the push
                    // and this wait wakes it at once, so no room is missed.
                    self.0.writable.notified().await;
                }
            }
        }
    }

    /// [`Self::send`] that leaves the event in `slot` while it waits, so that the wait
    /// can be given up (in a `select!`) without losing it; `slot` is empty once queued.
    pub async fn send_from(&self, slot: &mut Option<Pending>) -> Result<(), Refused> {
        loop {
            let Some(event) = slot.take() else {
                return Ok(());
            };
            match self.push(Ok(event)) {
                Ok(()) => return Ok(()),
                Err((Refused::Gone, _)) => return Err(Refused::Gone),
                Err((Refused::Full, back)) => {
                    *slot = back.ok();
                    self.0.writable.notified().await;
                }
            }
        }
    }

    /// Ends the stream with the status `status` makes as its last item, dropping every
    /// event still queued. `status` is told whether the client is still in its snapshot
    /// (it asked for one and has not taken its end, which may be among the events
    /// dropped): such a client must start again with a snapshot; any other resumes from
    /// the last generation it received.
    pub fn cut_off(&self, status: impl FnOnce(bool) -> Status) {
        let mut g = self.0.lock();
        if g.ended || g.reader_gone {
            return;
        }
        let status = status(g.snapshot_unfinished);
        g.items.clear();
        g.items.shrink_to_fit();
        g.changes = 0;
        let size = status.message().len();
        g.bytes = size;
        g.items.push_back((Err(status), size));
        g.ended = true;
        drop(g);
        self.0.readable.notify_one();
    }

    /// Resolves once the client's stream is gone.
    pub async fn closed(&self) {
        loop {
            if self.0.lock().reader_gone {
                return;
            }
            self.0.writable.notified().await;
        }
    }

    /// Items and bytes waiting for the client.
    #[cfg(test)]
    fn queued(&self) -> (usize, usize) {
        let g = self.0.lock();
        (g.items.len(), g.bytes)
    }
}

impl Drop for WatchSender {
    fn drop(&mut self) {
        self.0.lock().ended = true;
        self.0.readable.notify_one();
    }
}

impl WatchReceiver {
    /// The next item, or `None` once the feed ended and everything queued was read.
    pub async fn recv(&self) -> Option<Result<WireEvent, Status>> {
        loop {
            let next = {
                let mut g = self.shared.lock();
                match g.items.pop_front() {
                    Some((item, size)) => {
                        g.bytes -= size;
                        g.changes -= usize::from(matches!(item, Ok(Pending::Shared(_))));
                        if matches!(&item, Ok(Pending::Ready(e))
                            if e.kind == super::proto::WatchEventKind::SnapshotEnd as i32)
                        {
                            g.snapshot_unfinished = false;
                        }
                        Some(item)
                    }
                    None if g.ended => return None,
                    None => None,
                }
            };
            if let Some(item) = next {
                self.shared.writable.notify_one();
                return Some(item.map(|p| match p {
                    Pending::Ready(e) => WireEvent::from(&*e),
                    Pending::Shared(e) => (self.convert)(&e),
                }));
            }
            self.shared.readable.notified().await;
        }
    }

    /// The stream a tonic response carries.
    pub fn into_stream(
        self,
    ) -> impl tokio_stream::Stream<Item = Result<WireEvent, Status>> + Send + 'static {
        futures_util::stream::unfold(self, |r| async move {
            let item = r.recv().await?;
            Some((item, r))
        })
    }
}

impl Drop for WatchReceiver {
    fn drop(&mut self) {
        let mut g = self.shared.lock();
        g.reader_gone = true;
        g.items.clear();
        g.bytes = 0;
        g.changes = 0;
        drop(g);
        // Wake a waiting send and a waiting `closed` alike, and leave a permit for a
        // feed that is about to wait.
        self.shared.writable.notify_waiters();
        self.shared.writable.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    fn ev(generation: u64, pad: usize) -> Pending {
        Pending::Ready(Box::new(WatchEvent {
            kind: 1,
            generation,
            address: "x".repeat(pad),
            device: None,
        }))
    }

    fn removed(generation: u64) -> Pending {
        Pending::Shared(Event::Removed {
            generation: crate::pci::Generation(generation),
            address: "0000:3b:10.0".parse().expect("address"),
            present: true,
        })
    }

    /// A converter that marks what it built, so a test sees it ran at delivery.
    fn convert() -> Convert {
        Box::new(|e: &Event| {
            WireEvent::from(&WatchEvent {
                kind: 2,
                generation: e.generation().0,
                address: "converted".into(),
                device: None,
            })
        })
    }

    /// The generation of the next event the reader takes.
    async fn next_generation(rx: &WatchReceiver) -> u64 {
        let item = rx.recv().await.expect("item").expect("event");
        item.decode_event().expect("decode").generation
    }

    const LIMITS: QueueLimits = QueueLimits {
        events: 4,
        bytes: 1000,
    };

    #[tokio::test]
    async fn events_arrive_in_order_and_the_stream_ends_with_the_feed() {
        let (tx, rx) = queue(LIMITS, convert(), None);
        for g in 1..=3 {
            tx.try_send(ev(g, 1)).expect("room");
        }
        drop(tx);
        let got: Vec<u64> = rx
            .into_stream()
            .map(|i| i.expect("event").decode_event().expect("decode").generation)
            .collect()
            .await;
        assert_eq!(got, vec![1, 2, 3]);
    }

    #[tokio::test]
    async fn the_event_limit_and_the_byte_limit_both_refuse() {
        let (tx, _rx) = queue(LIMITS, convert(), None);
        for g in 1..=4 {
            tx.try_send(ev(g, 1)).expect("room");
        }
        assert_eq!(tx.try_send(ev(5, 1)), Err(Refused::Full));
        let (tx, _rx) = queue(LIMITS, convert(), None);
        tx.try_send(ev(1, 600)).expect("room");
        assert_eq!(tx.try_send(ev(2, 600)), Err(Refused::Full));
        assert_eq!(tx.queued().0, 1);
    }

    #[tokio::test]
    async fn one_event_over_the_byte_limit_still_goes_alone() {
        let (tx, rx) = queue(LIMITS, convert(), None);
        tx.try_send(ev(1, 5000))
            .expect("an empty queue takes any event");
        assert_eq!(tx.try_send(ev(2, 1)), Err(Refused::Full));
        assert_eq!(next_generation(&rx).await, 1);
        tx.try_send(ev(2, 1)).expect("room again");
    }

    #[tokio::test]
    async fn shared_changes_cost_a_slot_and_are_built_when_taken() {
        let (tx, rx) = queue(LIMITS, convert(), None);
        for g in 1..=4 {
            tx.try_send(removed(g)).expect("room");
        }
        assert_eq!(
            tx.try_send(removed(5)),
            Err(Refused::Full),
            "the event limit"
        );
        assert!(tx.queued().1 <= 4 * std::mem::size_of::<Pending>());
        let e = rx
            .recv()
            .await
            .expect("item")
            .expect("event")
            .decode_event()
            .expect("decode");
        assert_eq!((e.generation, e.address.as_str()), (1, "converted"));
    }

    /// A snapshot queued to its end, filling the queue's bytes, leaves the changes
    /// after it their whole event limit: a client reading its snapshot at its own pace
    /// is cut off only once more changes than that wait. Before, the snapshot's bytes
    /// counted against the changes too, and the second change here was refused.
    #[tokio::test]
    async fn changes_after_a_snapshot_that_fills_the_bytes_have_their_own_limit() {
        let (tx, rx) = queue(LIMITS, convert(), None);
        tx.try_send(ev(1, 500)).expect("room");
        tx.try_send(ev(2, 450)).expect("room");
        assert_eq!(tx.try_send(ev(3, 100)), Err(Refused::Full), "the bytes");
        for g in 3..=6 {
            tx.try_send(removed(g)).expect("a change has room");
        }
        assert_eq!(
            tx.try_send(removed(7)),
            Err(Refused::Full),
            "the event limit"
        );
        assert_eq!(tx.queued().0, 6);
        // A change taken makes room for one more; the snapshot's taken, none.
        assert_eq!(next_generation(&rx).await, 1);
        assert_eq!(tx.try_send(removed(7)), Err(Refused::Full));
        assert_eq!(next_generation(&rx).await, 2);
        assert_eq!(next_generation(&rx).await, 3);
        tx.try_send(removed(7)).expect("room again");
        let got: Vec<u64> = {
            drop(tx);
            rx.into_stream()
                .map(|i| i.expect("event").decode_event().expect("decode").generation)
                .collect()
                .await
        };
        assert_eq!(got, vec![4, 5, 6, 7]);
    }

    /// A snapshot is unfinished until the client takes its end: queued is not enough,
    /// since a cut-off drops what is queued. Before, the feed counted the end as sent
    /// once it was queued, and a client cut off with it still waiting was told to resume
    /// from a generation, holding part of a snapshot.
    #[tokio::test]
    async fn a_snapshot_is_unfinished_until_its_end_is_taken() {
        let end = || {
            Pending::Ready(Box::new(WatchEvent {
                kind: super::super::proto::WatchEventKind::SnapshotEnd as i32,
                generation: 7,
                address: String::new(),
                device: None,
            }))
        };
        let in_snapshot_at_cut_off = |tx: &WatchSender| {
            let mut told = None;
            tx.cut_off(|in_snapshot| {
                told = Some(in_snapshot);
                Status::resource_exhausted("behind")
            });
            told.expect("a cut-off asks")
        };
        // Its end queued, not taken.
        let (tx, rx) = queue(LIMITS, convert(), None);
        tx.snapshot_asked();
        tx.try_send(ev(1, 1)).expect("room");
        tx.try_send(end()).expect("room");
        assert_eq!(next_generation(&rx).await, 1);
        assert!(in_snapshot_at_cut_off(&tx));
        // Its end taken, then changes queued.
        let (tx, rx) = queue(LIMITS, convert(), None);
        tx.snapshot_asked();
        tx.try_send(end()).expect("room");
        tx.try_send(ev(8, 1)).expect("room");
        assert_eq!(next_generation(&rx).await, 7);
        assert!(!in_snapshot_at_cut_off(&tx));
        // No snapshot asked for.
        let (tx, _rx) = queue(LIMITS, convert(), None);
        tx.try_send(ev(1, 1)).expect("room");
        assert!(!in_snapshot_at_cut_off(&tx));
    }

    #[tokio::test]
    async fn a_cut_off_empties_the_queue_and_ends_with_the_status() {
        let (tx, rx) = queue(LIMITS, convert(), None);
        for g in 1..=4 {
            tx.try_send(ev(g, 100)).expect("room");
        }
        tx.cut_off(|_| Status::resource_exhausted("behind"));
        assert_eq!(tx.queued().0, 1, "only the status is kept");
        assert_eq!(tx.queued().1, "behind".len());
        assert_eq!(tx.try_send(ev(9, 1)), Err(Refused::Gone));
        let items: Vec<Result<WireEvent, Status>> = rx.into_stream().collect().await;
        assert_eq!(items.len(), 1);
        let status = items[0].as_ref().expect_err("the status");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    }

    #[tokio::test]
    async fn send_waits_for_room_and_fails_when_the_reader_leaves() {
        let (tx, rx) = queue(LIMITS, convert(), None);
        let tx = Arc::new(tx);
        for g in 1..=4 {
            tx.try_send(ev(g, 1)).expect("room");
        }
        let feed = {
            let tx = tx.clone();
            tokio::spawn(async move { tx.send(ev(5, 1)).await })
        };
        tokio::task::yield_now().await;
        assert!(!feed.is_finished(), "send waits while the queue is full");
        assert_eq!(next_generation(&rx).await, 1);
        feed.await.expect("join").expect("room was made");
        assert_eq!(tx.queued().0, 4);
        let blocked = {
            let tx = tx.clone();
            tokio::spawn(async move { tx.send(ev(6, 1)).await })
        };
        let closed = {
            let tx = tx.clone();
            tokio::spawn(async move { tx.closed().await })
        };
        drop(rx);
        assert_eq!(blocked.await.expect("join"), Err(Refused::Gone));
        closed
            .await
            .expect("closed resolves once the reader is gone");
        assert_eq!(tx.queued(), (0, 0), "a departed reader's events are freed");
    }

    #[tokio::test]
    async fn the_slot_is_released_with_the_reader() {
        let slots = Arc::new(tokio::sync::Semaphore::new(1));
        let permit = slots.clone().try_acquire_owned().expect("one slot");
        let (_tx, rx) = queue(LIMITS, convert(), Some(Box::new(permit)));
        assert!(slots.clone().try_acquire_owned().is_err());
        drop(rx);
        assert!(slots.try_acquire_owned().is_ok());
    }
}
