//! Watch events in their encoded form, as the server sends them: each change is built and
//! encoded once, by whichever watcher takes it first, and the bytes are shared by every
//! other stream it goes to.
//!
//! With 100 watchers, building a change's `WatchEvent` (its device's strings, a PF's list
//! of VF addresses) and encoding it for each of them took most of the agent's CPU: the
//! generated server's Watch stream carries a [`WireEvent`] instead (see `build.rs`),
//! whose bytes are exactly a `WatchEvent`'s, so clients are unchanged.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::{Buf, BufMut, Bytes};
use prost::encoding::{DecodeContext, WireType};
use prost::{DecodeError, Message};

use super::proto::WatchEvent;
use crate::ledger::DeviceView;
use crate::pci::Generation;
use crate::writer::Event;

/// A `WatchEvent`, encoded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WireEvent(Bytes);

impl From<&WatchEvent> for WireEvent {
    fn from(e: &WatchEvent) -> Self {
        WireEvent(Bytes::from(e.encode_to_vec()))
    }
}

impl WireEvent {
    /// The event these bytes encode.
    pub fn decode_event(&self) -> Result<WatchEvent, DecodeError> {
        WatchEvent::decode(self.0.clone())
    }
}

impl Message for WireEvent {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.0);
    }

    /// The server never decodes one (clients decode a `WatchEvent`); kept correct all
    /// the same: the field joins the event decoded so far.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        let mut e = self.decode_event()?;
        e.merge_field(tag, wire_type, buf, ctx)?;
        *self = WireEvent::from(&e);
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0 = Bytes::new();
    }
}

/// How many recent changes keep their encoded form, at most, and how many bytes of it.
/// Live watchers take a change within a few of its commit; one further behind (replaying a
/// backlog) builds its own, and keeps it only if it is newer than a change kept.
const KEPT: usize = 64;
const KEPT_BYTES: usize = 128 << 10;

/// One change's encoded form. Holding the change's view keeps its address from being
/// reused, so that the same pointer and generation mean the same change.
#[derive(Debug)]
struct Kept {
    view: Arc<DeviceView>,
    generation: Generation,
    wire: WireEvent,
}

/// The change kept for `view` at `generation`, newest first (live watchers ask for the
/// newest).
fn kept_for<'a>(
    kept: &'a VecDeque<Kept>,
    view: &Arc<DeviceView>,
    generation: Generation,
) -> Option<&'a Kept> {
    kept.iter()
        .rev()
        .find(|k| k.generation == generation && Arc::ptr_eq(&k.view, view))
}

/// The bytes the kept changes' encoded forms take (64 at most: counted when needed).
fn bytes_of(kept: &VecDeque<Kept>) -> usize {
    kept.iter().map(|k| k.wire.encoded_len()).sum()
}

/// The encoded form of the most recent changes, shared by every Watch stream.
#[derive(Debug, Default)]
pub struct RecentWire {
    kept: Mutex<VecDeque<Kept>>,
}

impl RecentWire {
    /// `e` encoded: the form kept for it, or `build(e)` encoded (and kept, if a change).
    /// A removal is small and rare, and is built each time.
    pub fn get_or_build(&self, e: &Event, build: impl FnOnce(&Event) -> WatchEvent) -> WireEvent {
        let Event::Changed { generation, view } = e else {
            return WireEvent::from(&build(e));
        };
        if let Some(k) = kept_for(&self.lock(), view, *generation) {
            return k.wire.clone();
        }
        // Built outside the lock: two watchers may both build it; the first kept wins,
        // so that every stream sends the same bytes.
        let wire = WireEvent::from(&build(e));
        let mut kept = self.lock();
        if let Some(k) = kept_for(&kept, view, *generation) {
            return k.wire.clone();
        }
        // A watcher replaying an old backlog takes changes older than every one kept:
        // keeping those would push out the changes the live watchers are taking.
        let full = kept.len() >= KEPT || bytes_of(&kept) + wire.encoded_len() > KEPT_BYTES;
        if full && kept.iter().all(|k| k.generation > *generation) {
            return wire;
        }
        kept.push_back(Kept {
            view: view.clone(),
            generation: *generation,
            wire: wire.clone(),
        });
        while kept.len() > KEPT || (kept.len() > 1 && bytes_of(&kept) > KEPT_BYTES) {
            kept.pop_front();
        }
        wire
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Kept>> {
        // Each change of the list is one push or pop: a poisoned lock is still
        // consistent.
        match self.kept.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// How many changes and bytes are kept.
    #[cfg(test)]
    fn kept(&self) -> (usize, usize) {
        let kept = self.lock();
        (kept.len(), bytes_of(&kept))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::api::proto;
    use crate::ledger::tests::facts;
    use crate::ledger::{DeviceRecord, DeviceState, RecordId};

    fn changed(g: u64) -> Event {
        Event::Changed {
            generation: Generation(g),
            view: Arc::new(DeviceView {
                record: DeviceRecord {
                    id: RecordId(g),
                    facts: facts("0000:3b:02.0", Some(7), Some("0000:3b:00.0")),
                    generation: Generation(g),
                    present: true,
                    claim: None,
                    attached: None,
                },
                state: DeviceState::Free,
            }),
        }
    }

    /// An event with `pad` bytes of address, marked with how many builds came before.
    fn builder(builds: &AtomicUsize, pad: usize) -> impl Fn(&Event) -> WatchEvent + '_ {
        move |e: &Event| WatchEvent {
            kind: proto::WatchEventKind::Changed as i32,
            generation: e.generation().0,
            address: "x".repeat(pad),
            device: Some(proto::Device {
                request_id: builds.fetch_add(1, Ordering::SeqCst).to_string(),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn the_bytes_are_the_events_and_decode_back_through_the_trait() {
        let e = WatchEvent {
            kind: proto::WatchEventKind::Removed as i32,
            generation: 42,
            address: "0000:3b:02.0".into(),
            device: Some(proto::Device {
                address: "0000:3b:02.0".into(),
                ..Default::default()
            }),
        };
        let w = WireEvent::from(&e);
        assert_eq!(w.encode_to_vec(), e.encode_to_vec());
        assert_eq!(w.encoded_len(), e.encoded_len());
        assert_eq!(w.decode_event().expect("decode"), e);
        // Decoded as a WireEvent, field by field, it encodes the same event again.
        let back = WireEvent::decode(e.encode_to_vec().as_slice()).expect("decode");
        assert_eq!(back.decode_event().expect("decode"), e);
        // A field that does not decode is refused.
        assert!(WireEvent::decode(&[0x1a, 0x05, b'a'][..]).is_err());
        let mut cleared = w;
        cleared.clear();
        assert_eq!(cleared.encoded_len(), 0);
        assert_eq!(
            cleared.decode_event().expect("empty"),
            WatchEvent::default()
        );
    }

    #[test]
    fn a_change_is_built_once_for_every_watcher_and_a_removal_each_time() {
        let builds = AtomicUsize::new(0);
        let build = builder(&builds, 4);
        let cache = RecentWire::default();
        let a = changed(7);
        let first = cache.get_or_build(&a, &build);
        for _ in 0..99 {
            // A watcher's copy of the change shares its view.
            assert_eq!(cache.get_or_build(&a.clone(), &build), first);
        }
        assert_eq!(builds.load(Ordering::SeqCst), 1);
        assert_eq!(first.decode_event().expect("decode").generation, 7);
        // The same generation with another view (not the same change) is built anew.
        let other = cache.get_or_build(&changed(7), &build);
        assert_ne!(other, first);
        assert_eq!(builds.load(Ordering::SeqCst), 2);
        let removed = Event::Removed {
            generation: Generation(8),
            address: "0000:3b:02.0".parse().expect("address"),
            present: true,
        };
        cache.get_or_build(&removed, &build);
        cache.get_or_build(&removed, &build);
        assert_eq!(builds.load(Ordering::SeqCst), 4);
        assert_eq!(cache.kept().0, 2);
    }

    #[test]
    fn it_keeps_the_newest_changes_within_its_bounds() {
        let builds = AtomicUsize::new(0);
        let cache = RecentWire::default();
        let events: Vec<Event> = (0..KEPT as u64 + 10).map(changed).collect();
        let small = builder(&builds, 4);
        for e in &events {
            cache.get_or_build(e, &small);
        }
        let (count, bytes) = cache.kept();
        assert_eq!(count, KEPT);
        assert!(bytes > 0 && bytes <= KEPT_BYTES);
        // The newest are kept; the oldest were let go and are built again.
        let before = builds.load(Ordering::SeqCst);
        cache.get_or_build(&events[events.len() - 1], &small);
        assert_eq!(builds.load(Ordering::SeqCst), before);
        cache.get_or_build(&events[0], &small);
        assert_eq!(builds.load(Ordering::SeqCst), before + 1);
        // A change older than every one kept (a backlog replayed) is built and not kept:
        // the newest stay.
        let old = changed(3);
        cache.get_or_build(&old, &small);
        cache.get_or_build(&old, &small);
        assert_eq!(builds.load(Ordering::SeqCst), before + 3);
        assert_eq!(cache.kept().0, KEPT);
        cache.get_or_build(&events[events.len() - 1], &small);
        assert_eq!(builds.load(Ordering::SeqCst), before + 3);
        // Large events are bounded by bytes; one larger than the bound is still kept.
        let big = builder(&builds, KEPT_BYTES / 4);
        for g in 1000..1010 {
            cache.get_or_build(&changed(g), &big);
            assert!(cache.kept().1 <= KEPT_BYTES);
        }
        assert!(cache.kept().0 < 5);
        let huge = builder(&builds, KEPT_BYTES * 2);
        cache.get_or_build(&changed(2000), &huge);
        assert_eq!(cache.kept().0, 1);
    }
}
