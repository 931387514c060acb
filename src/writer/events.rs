//! Change events: what a watcher receives, and the log of recent ones the agent keeps
//! for watchers that resume, bounded in count and in memory.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::sync::broadcast;

use crate::ledger::{DeviceState, DeviceView};
use crate::pci::{Generation, PciAddress};

/// What a watcher receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Changed {
        generation: Generation,
        /// Shared by every watcher's queue: an event waiting for a slow client costs a
        /// pointer, not a copy.
        view: Arc<DeviceView>,
    },
    Removed {
        generation: Generation,
        address: PciAddress,
        /// The record removed was the present device at `address`; false: a lost claim
        /// (released), while a present device there may stay.
        present: bool,
    },
}

impl Event {
    pub fn generation(&self) -> Generation {
        match self {
            Event::Changed { generation, .. } | Event::Removed { generation, .. } => *generation,
        }
    }
}

/// How many recent events the agent keeps for resuming watchers: at most `events` of
/// them and `bytes` of memory (as the allocator hands it out), the oldest dropped first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventBuffer {
    pub events: usize,
    pub bytes: usize,
}

impl EventBuffer {
    /// Bounded by count only.
    pub fn events(events: usize) -> Self {
        EventBuffer {
            events,
            bytes: usize::MAX,
        }
    }
}

/// The live channel's slots, at most. Tokio's broadcast channel allocates every slot up
/// front (some 50 bytes each); a watcher that falls this far behind before its feed task
/// runs is cut off and resumes from the ring, so the channel need not be as long as the
/// ring.
const LIVE_SLOTS: usize = 8192;

/// The memory one event holds on to, as glibc's allocator hands it out: its shared view
/// (one allocation with the reference counts) and each string and list it owns, each
/// rounded up to the allocator's 16-byte chunks with their 8-byte header (32 at least).
/// Text shared with other records (the driver's name, physnet tags, an owner's label) is
/// counted as if the event held it alone: an upper bound.
fn event_bytes(ev: &Event) -> usize {
    use std::mem::size_of;
    fn alloc(n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (n + 8).div_ceil(16).max(2) * 16
        }
    }
    let text = |s: Option<&str>| s.map_or(0, |s| alloc(s.len()));
    let Event::Changed { view, .. } = ev else {
        return size_of::<Event>();
    };
    let r = &view.record;
    let mut n = size_of::<Event>() + alloc(size_of::<DeviceView>() + 2 * size_of::<usize>());
    n += text(r.facts.driver.as_deref());
    n += alloc(r.facts.physnets.len() * size_of::<crate::pci::PhysNet>());
    n += r
        .facts
        .physnets
        .iter()
        .map(|p| alloc(p.as_str().len()))
        .sum::<usize>();
    if let Some(c) = &r.claim {
        n += alloc(c.owner.label.as_str().len()) + alloc(c.request_id.as_str().len());
        if let Some(b) = &c.vfio {
            n += alloc(b.members.len() * size_of::<crate::ledger::BoundMember>());
            n += b
                .members
                .iter()
                .map(|m| text(m.original_driver.as_deref()))
                .sum::<usize>();
        }
    }
    if let Some(d) = &r.attached {
        n += alloc(d.name.len());
    }
    if let DeviceState::Unavailable {
        blocker: crate::ledger::Blocker::Domain(d),
    } = &view.state
    {
        n += alloc(d.name.len());
    }
    n
}

/// Recent events for resuming watchers, and the channel live events go out on.
#[derive(Debug)]
pub struct EventLog {
    /// Each event with its `event_bytes`.
    ring: VecDeque<(Event, usize)>,
    limit: EventBuffer,
    /// The sum of the ring's `event_bytes`.
    bytes: usize,
    /// Watchers may resume from any generation >= this.
    oldest: Generation,
    tx: broadcast::Sender<Event>,
}

impl EventLog {
    pub(super) fn new(limit: EventBuffer, start: Generation) -> Self {
        let limit = EventBuffer {
            events: limit.events.max(16),
            bytes: limit.bytes,
        };
        let (tx, _) = broadcast::channel(limit.events.min(LIVE_SLOTS));
        EventLog {
            ring: VecDeque::new(),
            limit,
            bytes: 0,
            oldest: start,
            tx,
        }
    }

    /// Keeps `ev` for resuming and sends it to every watcher; says whether any watcher
    /// was there to be sent it.
    pub(super) fn push(&mut self, ev: Event) -> bool {
        let size = event_bytes(&ev);
        while !self.ring.is_empty()
            && (self.ring.len() >= self.limit.events
                || self.bytes.saturating_add(size) > self.limit.bytes)
        {
            if let Some((old, old_size)) = self.ring.pop_front() {
                self.oldest = old.generation();
                self.bytes -= old_size;
            }
        }
        self.bytes += size;
        self.ring.push_back((ev.clone(), size));
        // No receivers is fine: nobody watches.
        self.tx.send(ev).is_ok()
    }

    /// Events kept for resuming and the memory they hold (approximately).
    pub fn kept(&self) -> (usize, usize) {
        (self.ring.len(), self.bytes)
    }

    /// The oldest generation a watcher may resume from.
    pub fn oldest(&self) -> Generation {
        self.oldest
    }

    /// Events after `from` still in the ring, and a receiver for what follows, taken
    /// together so no event falls between them. `None` when `from` is too old.
    pub fn resume(&self, from: Generation) -> Option<(Vec<Event>, broadcast::Receiver<Event>)> {
        if from < self.oldest {
            return None;
        }
        let rx = self.tx.subscribe();
        let backlog = self
            .ring
            .iter()
            .filter(|(e, _)| e.generation() > from)
            .map(|(e, _)| e.clone())
            .collect();
        Some((backlog, rx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::tests::facts;
    use crate::ledger::{DeviceRecord, RecordId};

    fn changed(g: u64, driver_len: usize) -> Event {
        let mut f = facts("0000:3b:02.0", Some(7), Some("0000:3b:00.0"));
        f.driver = Some("d".repeat(driver_len).into());
        Event::Changed {
            generation: Generation(g),
            view: Arc::new(DeviceView {
                record: DeviceRecord {
                    id: RecordId(g),
                    facts: f,
                    generation: Generation(g),
                    present: true,
                    claim: None,
                    attached: None,
                },
                state: DeviceState::Free,
            }),
        }
    }

    fn generations(log: &EventLog) -> Vec<u64> {
        log.ring.iter().map(|(e, _)| e.generation().0).collect()
    }

    #[test]
    fn the_count_bound_drops_the_oldest_and_moves_the_resume_floor() {
        let mut log = EventLog::new(EventBuffer::events(16), Generation(0));
        for g in 1..=20 {
            log.push(changed(g, 4));
        }
        assert_eq!(generations(&log), (5..=20).collect::<Vec<_>>());
        assert_eq!(log.oldest(), Generation(4));
        assert!(log.resume(Generation(3)).is_none());
        let (backlog, _rx) = log.resume(Generation(4)).expect("resumable");
        assert_eq!(backlog.len(), 16);
    }

    #[test]
    fn the_byte_bound_keeps_the_sum_of_sizes_under_the_limit() {
        let one = event_bytes(&changed(1, 100));
        let limit = EventBuffer {
            events: 1000,
            bytes: one * 10,
        };
        let mut log = EventLog::new(limit, Generation(0));
        for g in 1..=50 {
            log.push(changed(g, 100));
            let (n, bytes) = log.kept();
            assert!(bytes <= limit.bytes, "{bytes} > {}", limit.bytes);
            assert_eq!(bytes, n * one);
        }
        assert_eq!(generations(&log), (41..=50).collect::<Vec<_>>());
        assert_eq!(log.oldest(), Generation(40));
        // A bigger event pushes out as many as it needs, and is counted by its own size.
        let big = changed(51, 100 + 3 * one);
        let big_size = event_bytes(&big);
        let keep = (limit.bytes - big_size) / one;
        log.push(big);
        let (n, bytes) = log.kept();
        assert_eq!(bytes, big_size + keep * one);
        assert!(bytes <= limit.bytes);
        assert_eq!(n, keep + 1, "{:?}", generations(&log));
        assert_eq!(log.oldest(), Generation(50 - keep as u64));
    }

    #[test]
    fn an_event_larger_than_the_limit_is_still_kept_alone() {
        let mut log = EventLog::new(
            EventBuffer {
                events: 100,
                bytes: 10,
            },
            Generation(0),
        );
        log.push(changed(1, 0));
        log.push(changed(2, 0));
        assert_eq!(generations(&log), vec![2]);
        let (backlog, _rx) = log.resume(Generation(1)).expect("resumable");
        assert_eq!(backlog.len(), 1);
    }

    #[test]
    fn sizes_count_the_allocations_an_event_owns() {
        // A 1000-byte driver name: one chunk of 1000 + 8 bytes, rounded up to 16.
        assert_eq!(
            event_bytes(&changed(1, 1000)) - event_bytes(&changed(1, 0)),
            1008
        );
        // A short one still takes the smallest chunk.
        assert_eq!(
            event_bytes(&changed(1, 4)) - event_bytes(&changed(1, 0)),
            32
        );
        let removed = Event::Removed {
            generation: Generation(1),
            address: "0000:3b:02.0".parse().expect("address"),
            present: true,
        };
        assert!(event_bytes(&removed) < event_bytes(&changed(1, 0)));
    }
}
