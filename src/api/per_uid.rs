//! Places counted by caller against a limit: a caller (a Unix-socket peer uid, or `None`
//! for one without credentials; a TCP peer's address: [`Caller`]) holds at most
//! `limit` at once, and a place is given back when its holder is dropped. The
//! connections, the Watch streams and the calls of one uid, and the TCP connections of
//! one peer, are each bounded this way.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo, UdsConnectInfo};

/// Who a call or a Watch stream is counted against: a Unix-socket peer by its uid
/// (`None`: the kernel gave no credentials), or a TCP peer by its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Caller {
    Uid(Option<u32>),
    Peer(IpAddr),
}

impl Caller {
    /// The caller of a request, from what its connection recorded in its extensions.
    pub fn of(extensions: &http::Extensions) -> Caller {
        if let Some(i) = extensions.get::<UdsConnectInfo>() {
            return Caller::Uid(i.peer_cred.map(|c| c.uid()));
        }
        let tcp = extensions
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|i| i.get_ref().remote_addr());
        match tcp {
            Some(addr) => Caller::Peer(crate::tcp::peer_of(addr)),
            None => Caller::Uid(None),
        }
    }

    /// "uid 0", "TCP peer 10.0.0.7", "callers without peer credentials": for messages.
    pub fn name(&self) -> String {
        match self {
            Caller::Uid(Some(u)) => format!("uid {u}"),
            Caller::Uid(None) => "callers without peer credentials".to_string(),
            Caller::Peer(ip) => format!("TCP peer {ip}"),
        }
    }

    /// "uid 0 has", "callers without peer credentials have": for messages.
    pub fn has(&self) -> String {
        let verb = if *self == Caller::Uid(None) {
            "have"
        } else {
            "has"
        };
        format!("{} {verb}", self.name())
    }

    /// The ErrorInfo metadata that names the caller: `uid` or `peer` (none without
    /// credentials).
    pub fn metadata(&self) -> Option<(&'static str, String)> {
        match self {
            Caller::Uid(Some(u)) => Some(("uid", u.to_string())),
            Caller::Uid(None) => None,
            Caller::Peer(ip) => Some(("peer", ip.to_string())),
        }
    }
}

/// The places each caller holds now, against one limit for every caller. A caller is
/// named by `K`: a Unix-socket peer uid unless said otherwise.
#[derive(Debug)]
pub struct PerUid<K = Option<u32>> {
    limit: usize,
    held: Mutex<HashMap<K, usize>>,
}

/// One place of one caller, given back when dropped.
#[derive(Debug)]
pub struct Place<K: Copy + Eq + Hash = Option<u32>> {
    of: Arc<PerUid<K>>,
    who: K,
}

impl<K: Copy + Eq + Hash> PerUid<K> {
    pub fn new(limit: usize) -> Arc<PerUid<K>> {
        Arc::new(PerUid {
            limit,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// The places one caller may hold at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// One more place for `who`; `None` while it holds [`PerUid::limit`]. No entry is
    /// made for a caller refused.
    pub fn take(self: &Arc<Self>, who: K) -> Option<Place<K>> {
        let mut held = self.lock();
        if held.get(&who).copied().unwrap_or(0) >= self.limit {
            return None;
        }
        *held.entry(who).or_default() += 1;
        Some(Place {
            of: Arc::clone(self),
            who,
        })
    }

    /// The places `who` holds now.
    pub fn held_by(&self, who: K) -> usize {
        self.lock().get(&who).copied().unwrap_or(0)
    }

    /// The places held now, by every caller.
    pub fn held(&self) -> usize {
        self.lock().values().sum()
    }

    /// Whether no caller holds a place (and none is remembered).
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The counts, whatever a panic elsewhere left them as: each change to them is one
    /// statement, so they are whole.
    fn lock(&self) -> MutexGuard<'_, HashMap<K, usize>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<K: Copy + Eq + Hash> Drop for Place<K> {
    fn drop(&mut self) {
        let mut held = self.of.lock();
        if let Some(n) = held.get_mut(&self.who) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.who);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_is_named_by_its_uid_or_its_tcp_peer_address() {
        let peer = Caller::Peer([10, 0, 0, 7].into());
        assert_eq!(Caller::Uid(Some(0)).has(), "uid 0 has");
        assert_eq!(
            Caller::Uid(None).has(),
            "callers without peer credentials have"
        );
        assert_eq!(peer.has(), "TCP peer 10.0.0.7 has");
        assert_eq!(
            Caller::Uid(Some(7)).metadata(),
            Some(("uid", "7".to_string()))
        );
        assert_eq!(peer.metadata(), Some(("peer", "10.0.0.7".to_string())));
        assert_eq!(Caller::Uid(None).metadata(), None);
        // A request with no connection information (none of the agent's listeners makes
        // one) counts with the callers without credentials.
        assert_eq!(Caller::of(&http::Extensions::new()), Caller::Uid(None));
    }

    #[test]
    fn a_caller_holds_at_most_the_limit_and_a_dropped_place_comes_back() {
        let p: Arc<PerUid> = PerUid::new(2);
        let a1 = p.take(Some(1)).expect("first");
        let a2 = p.take(Some(1)).expect("second");
        assert!(p.take(Some(1)).is_none(), "a third for uid 1");
        // Others keep theirs; a caller without credentials counts as one more.
        let b = p.take(Some(2)).expect("uid 2");
        let n = p.take(None).expect("no credentials");
        assert_eq!((p.held(), p.held_by(Some(1)), p.held_by(None)), (4, 2, 1));
        drop(a1);
        assert_eq!(p.held_by(Some(1)), 1);
        let a3 = p.take(Some(1)).expect("the place given back");
        drop((a2, a3, b, n));
        assert_eq!(p.held(), 0);
        assert!(
            p.is_empty(),
            "no caller is remembered once it holds nothing"
        );
    }

    #[test]
    fn a_limit_of_zero_gives_no_place_and_keeps_no_entry() {
        let p: Arc<PerUid> = PerUid::new(0);
        assert!(p.take(Some(7)).is_none());
        assert!(p.is_empty());
    }
}
