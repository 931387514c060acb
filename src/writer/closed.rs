//! Request ids closed by GetRequestOutcome: once the agent has answered "no such request
//! was applied", nothing sent with that (consumer, request id) may apply afterwards, not
//! even a call the vanished client sent before asking, whose bytes the agent had not yet
//! read. Kept in memory by the writer (its thread, or a caller deciding in its place):
//! such a call cannot outlive the process.

use std::collections::{HashSet, VecDeque};

use crate::pci::{ConsumerId, RequestId};

/// How many closed ids are remembered (oldest forgotten first), as many as the request
/// log keeps outcomes.
const MAX_CLOSED: usize = 100_000;

/// The closed (consumer, request id) pairs, bounded.
#[derive(Debug, Default)]
pub(super) struct ClosedRequests {
    set: HashSet<(ConsumerId, RequestId)>,
    order: VecDeque<(ConsumerId, RequestId)>,
}

impl ClosedRequests {
    /// Closes the id; whether this closed it (false: it was closed already, and a
    /// [`Self::reopen`] of this close must not take back the earlier one).
    pub(super) fn close(&mut self, consumer: ConsumerId, request_id: RequestId) -> bool {
        let key = (consumer, request_id);
        let new = self.set.insert(key.clone());
        if new {
            self.order.push_back(key);
        }
        while self.order.len() > MAX_CLOSED {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        new
    }

    /// Takes back a close whose answer never went out (its batch failed to commit).
    pub(super) fn reopen(&mut self, consumer: ConsumerId, request_id: &RequestId) {
        let key = (consumer, request_id.clone());
        if self.set.remove(&key) {
            self.order.retain(|k| *k != key);
        }
    }

    pub(super) fn is_closed(&self, consumer: ConsumerId, request_id: &RequestId) -> bool {
        self.set.contains(&(consumer, request_id.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> RequestId {
        s.parse().expect("request id")
    }

    #[test]
    fn closed_ids_are_remembered_per_consumer_and_bounded() {
        let (a, b) = (
            ConsumerId(uuid::Uuid::from_u128(1)),
            ConsumerId(uuid::Uuid::from_u128(2)),
        );
        let mut c = ClosedRequests::default();
        c.close(a, id("r1"));
        c.close(a, id("r1"));
        assert!(c.is_closed(a, &id("r1")));
        assert!(!c.is_closed(b, &id("r1")), "per consumer");
        assert!(!c.is_closed(a, &id("r2")));
        for i in 0..MAX_CLOSED {
            c.close(b, id(&format!("x{i}")));
        }
        assert!(!c.is_closed(a, &id("r1")), "the oldest is forgotten first");
        assert!(c.is_closed(b, &id(&format!("x{}", MAX_CLOSED - 1))));
        assert_eq!(c.set.len(), MAX_CLOSED);
    }
}
