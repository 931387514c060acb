//! The request log's index in memory: a 32-bit fingerprint of each logged (consumer,
//! request id) and the entry's place in the log, so that the log on disk is appended in
//! order and a lookup reads a row only where a fingerprint matches.
//!
//! Why not SQLite's own index: a key of (consumer, request id) puts each new entry at a
//! random place in a tree of thousands of pages, so every entry of a commit wrote a page
//! of its own, plus the pages a split rebalanced. Appended in order, a commit's entries
//! share one or two pages.
//!
//! Each entry takes 8 bytes here: the fingerprint, and the low 32 bits of its sequence
//! number (the log's row id). A fingerprint is a keyed hash with a key drawn at start, so
//! no client can choose request ids that collide. A lookup reads every row whose
//! fingerprint matches and compares the whole key, newest first, so a collision costs one
//! row read and never a wrong answer.
//!
//! Beside it, the entries an acting Reconcile logged (`<audit id>@<address>`, one per
//! orphan freed) by a fingerprint of the audit id alone, so that a retry of the audit
//! finds what its first attempt freed without knowing the addresses. Only ids of that
//! form are held there, a few in a log of claims and releases.

use std::hash::{BuildHasher, RandomState};

/// New entries wait, sorted, in a short list that is merged into the long one once it
/// holds this many: one linear merge per 4,096 entries instead of a move of the long
/// list per entry.
const RECENT_MAX: usize = 4096;

/// One entry: the fingerprint in the high half, the sequence number's low half below.
type Packed = u64;

const LOW: u64 = 1 << 32;

/// The index. Sequence numbers grow by one per entry logged; the entries held are those
/// from `oldest` to `newest`.
pub(crate) struct RequestIndex {
    key: RandomState,
    /// Sorted.
    long: Vec<Packed>,
    /// Sorted; at most [`RECENT_MAX`] entries.
    recent: Vec<Packed>,
    /// The newest sequence number added (0: none yet).
    newest: i64,
    /// The oldest sequence number still held.
    oldest: i64,
    /// The per-device entries of acting audits: (fingerprint of the audit id, sequence
    /// number), in the order logged.
    parts: Vec<(u32, i64)>,
}

impl std::fmt::Debug for RequestIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestIndex")
            .field("entries", &self.len())
            .field("oldest", &self.oldest)
            .field("newest", &self.newest)
            .finish_non_exhaustive()
    }
}

impl RequestIndex {
    /// An empty index; [`Self::load`] the log's entries into it, then [`Self::seal`] it.
    pub(crate) fn empty() -> Self {
        RequestIndex {
            key: RandomState::new(),
            long: Vec::new(),
            recent: Vec::new(),
            newest: 0,
            oldest: i64::MAX,
            parts: Vec::new(),
        }
    }

    /// Adds an entry read from the log at open, in any order.
    pub(crate) fn load(&mut self, seq: i64, consumer: &str, request_id: &str) {
        let fingerprint = self.fingerprint(consumer, request_id);
        if let Some(part) = self.part_fingerprint(request_id) {
            self.parts.push((part, seq));
        }
        self.long.push(pack(fingerprint, seq));
        self.newest = self.newest.max(seq);
        self.oldest = self.oldest.min(seq);
    }

    /// Ready for lookups once every entry is loaded.
    pub(crate) fn seal(&mut self) {
        self.long.sort_unstable();
        self.long.shrink_to_fit();
        self.parts.sort_unstable_by_key(|&(_, seq)| seq);
        if self.long.is_empty() {
            self.oldest = 1;
        }
    }

    /// An index of the given entries (sequence number, consumer, request id).
    #[cfg(test)]
    fn build<'a>(entries: impl IntoIterator<Item = (i64, &'a str, &'a str)>) -> Self {
        let mut index = RequestIndex::empty();
        for (seq, consumer, request_id) in entries {
            index.load(seq, consumer, request_id);
        }
        index.seal();
        index
    }

    /// The fingerprint of a consumer's request id (the consumer as its UUID text).
    pub(crate) fn fingerprint(&self, consumer: &str, request_id: &str) -> u32 {
        // The low half of the keyed hash; truncation is the point.
        self.key.hash_one((consumer, request_id)) as u32
    }

    /// For a request id of an acting audit's form (`<audit id>@<address>`), the
    /// fingerprint of its audit id; `None` for any other id.
    pub(crate) fn part_fingerprint(&self, request_id: &str) -> Option<u32> {
        crate::pci::RequestId::split_per_device(request_id)
            .map(|(audit, _)| self.audit_fingerprint(audit))
    }

    /// The fingerprint an audit id's per-device entries are held under.
    pub(crate) fn audit_fingerprint(&self, audit: &str) -> u32 {
        // Hashed with a marker, so that it is not the fingerprint of any whole key.
        self.key.hash_one(("@", audit)) as u32
    }

    /// The sequence numbers of the per-device entries whose audit id has `fingerprint`,
    /// oldest first.
    pub(crate) fn part_candidates(&self, fingerprint: u32) -> Vec<i64> {
        self.parts
            .iter()
            .filter(|&&(f, seq)| f == fingerprint && seq >= self.oldest)
            .map(|&(_, seq)| seq)
            .collect()
    }

    /// The sequence number the next entry logged gets.
    pub(crate) fn next_seq(&self) -> i64 {
        self.newest.saturating_add(1)
    }

    /// How many entries are held.
    pub(crate) fn len(&self) -> usize {
        self.long.len() + self.recent.len()
    }

    /// Adds an entry logged under `seq`, which must be [`Self::next_seq`] or later (the
    /// store adds what a commit logged, in order, once it is durable); `part` is its
    /// [`Self::part_fingerprint`].
    pub(crate) fn add(&mut self, fingerprint: u32, part: Option<u32>, seq: i64) {
        debug_assert!(seq > self.newest, "sequence numbers only grow");
        if self.len() == 0 {
            self.oldest = seq;
        }
        if let Some(part) = part {
            self.parts.push((part, seq));
        }
        self.newest = self.newest.max(seq);
        let packed = pack(fingerprint, seq);
        let at = lower_bound(&self.recent, packed);
        self.recent.insert(at, packed);
        if self.recent.len() >= RECENT_MAX {
            self.merge();
        }
    }

    /// The sequence numbers whose fingerprint is `fingerprint`, newest first.
    pub(crate) fn candidates(&self, fingerprint: u32) -> Vec<i64> {
        let from = pack(fingerprint, 0);
        let to = from | (LOW - 1);
        let mut found = Vec::new();
        for list in [&self.long, &self.recent] {
            let start = lower_bound(list, from);
            for &p in list[start..].iter().take_while(|&&p| p <= to) {
                self.unpack_into(p, &mut found);
            }
        }
        found.sort_unstable_by(|a, b| b.cmp(a));
        found.dedup();
        found
    }

    /// Forgets the entries before `oldest` (the log's prune deleted them).
    pub(crate) fn forget_before(&mut self, oldest: i64) {
        if oldest <= self.oldest {
            return;
        }
        let window = self.newest.saturating_sub(self.oldest);
        self.oldest = oldest;
        self.parts.retain(|&(_, seq)| seq >= oldest);
        if window >= LOW as i64 {
            // Too long a log to tell a low half's age: keep them all; a lookup skips the
            // rows that are gone.
            return;
        }
        let newest = self.newest;
        let keep = |&p: &Packed| seq_of(newest, p) >= oldest;
        self.long.retain(keep);
        self.recent.retain(keep);
        self.long.shrink_to_fit();
    }

    /// Every sequence number from `oldest` to `newest` whose low half is `p`'s (one,
    /// unless the log spans more than 2^32 entries).
    fn unpack_into(&self, p: Packed, out: &mut Vec<i64>) {
        let mut seq = seq_of(self.newest, p);
        while seq >= self.oldest && seq > 0 {
            out.push(seq);
            seq = seq.saturating_sub(LOW as i64);
        }
    }

    /// Moves the recent entries into the long list: one merge from the back, in place.
    fn merge(&mut self) {
        let (n, m) = (self.long.len(), self.recent.len());
        self.long.reserve_exact(m);
        self.long.resize(n + m, 0);
        let (mut i, mut j) = (n, m);
        for k in (0..n + m).rev() {
            if j == 0 {
                break;
            }
            if i > 0 && self.long[i - 1] > self.recent[j - 1] {
                self.long[k] = self.long[i - 1];
                i -= 1;
            } else {
                self.long[k] = self.recent[j - 1];
                j -= 1;
            }
        }
        self.recent.clear();
    }
}

/// The first place in the sorted `list` whose entry is not below `key`, as
/// `list.partition_point(|&p| p < key)` gives it, found from where a uniform spread of
/// fingerprints puts it: a fingerprint is a keyed hash, so an entry's place is close to
/// its fingerprint's share of 2^32 times the list's length. A lookup then reads one or
/// two cache lines of a list of 100,000 entries (800 KB) where a binary search from the
/// middle read about seventeen, most of them cold (about 1 µs a lookup, the writer's
/// largest own cost under load). Galloping out from the guess keeps the worst case,
/// whatever the spread, to twice a binary search's reads.
fn lower_bound(list: &[Packed], key: Packed) -> usize {
    let n = list.len();
    if n == 0 {
        return 0;
    }
    // (key's high half) × n / 2^32 < n, since the high half is below 2^32.
    let guess = ((u128::from(key >> 32) * n as u128) >> 32) as usize;
    if list[guess] < key {
        // The place is after the guess: widen the step until an entry is not below key.
        let (mut below, mut step) = (guess, 1);
        loop {
            let probe = below.saturating_add(step);
            if probe >= n || list[probe] >= key {
                let end = probe.min(n);
                return below + 1 + list[below + 1..end].partition_point(|&p| p < key);
            }
            below = probe;
            step *= 2;
        }
    } else {
        // The place is at the guess or before it.
        let (mut at_or_after, mut step) = (guess, 1);
        loop {
            if at_or_after < step || list[at_or_after - step] < key {
                let start = at_or_after.saturating_sub(step);
                return start + list[start..at_or_after].partition_point(|&p| p < key);
            }
            at_or_after -= step;
            step *= 2;
        }
    }
}

fn pack(fingerprint: u32, seq: i64) -> Packed {
    // The low half of the sequence number; `seq_of` finds the rest from the newest.
    (u64::from(fingerprint) << 32) | (seq as u64 & (LOW - 1))
}

/// The newest sequence number, up to `newest`, whose low half is `p`'s.
fn seq_of(newest: i64, p: Packed) -> i64 {
    let low = (p & (LOW - 1)) as u32;
    let back = (newest as u32).wrapping_sub(low);
    newest - i64::from(back)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn finds_what_was_added_and_nothing_else() {
        let mut index = RequestIndex::build(std::iter::empty());
        assert_eq!(index.next_seq(), 1);
        let a = index.fingerprint("c1", "r1");
        let b = index.fingerprint("c1", "r2");
        index.add(a, None, 1);
        index.add(b, None, 2);
        assert!(index.candidates(a).contains(&1));
        assert!(index.candidates(b).contains(&2));
        assert_eq!(index.next_seq(), 3);
        assert_eq!(index.len(), 2);
        let unseen = (0u32..3)
            .find(|f| *f != a && *f != b)
            .expect("one of three");
        assert!(index.candidates(unseen).is_empty());
    }

    #[test]
    fn a_rebuilt_index_matches_the_one_it_replaces() {
        let keys: Vec<(i64, String)> = (1..=10_000).map(|n| (n, format!("r{n}"))).collect();
        let index = RequestIndex::build(keys.iter().map(|(s, r)| (*s, "c", r.as_str())));
        assert_eq!(index.len(), 10_000);
        assert_eq!(index.next_seq(), 10_001);
        for (seq, r) in keys.iter().step_by(97) {
            assert!(index.candidates(index.fingerprint("c", r)).contains(seq));
        }
    }

    #[test]
    fn the_low_half_is_read_back_across_its_wrap() {
        let mut index = RequestIndex::build([(LOW as i64 - 2, "c", "a")]);
        let fp = index.fingerprint("c", "b");
        index.add(fp, None, LOW as i64 + 5);
        assert_eq!(index.candidates(fp), vec![LOW as i64 + 5]);
        let old = index.fingerprint("c", "a");
        assert_eq!(index.candidates(old), vec![LOW as i64 - 2]);
        index.forget_before(LOW as i64);
        assert!(index.candidates(old).is_empty());
        assert_eq!(index.candidates(fp), vec![LOW as i64 + 5]);
    }

    #[test]
    fn a_log_longer_than_the_low_half_gives_every_possible_entry() {
        let mut index = RequestIndex::build([(1, "c", "a")]);
        let fp = index.fingerprint("c", "a");
        index.add(index.fingerprint("c", "z"), None, 2 * LOW as i64 + 10);
        // Entry 1 reads back as every number with its low half, newest first; the
        // store reads each row and keeps the one whose key matches.
        assert_eq!(
            index.candidates(fp),
            vec![2 * LOW as i64 + 1, LOW as i64 + 1, 1]
        );
    }

    #[test]
    fn an_audits_entries_are_found_by_its_id_until_pruned() {
        let mut index = RequestIndex::build([
            (1, "c1", "claim-1"),
            (2, "c1", "audit-1@0000:3b:10.1"),
            (3, "c2", "audit-2@0000:3b:10.2"),
        ]);
        let one = index.audit_fingerprint("audit-1");
        assert_eq!(index.part_candidates(one), vec![2]);
        let id = "audit-1@0000:3b:10.3";
        let seq = index.next_seq();
        index.add(index.fingerprint("c3", id), index.part_fingerprint(id), seq);
        assert_eq!(index.part_candidates(one), vec![2, 4]);
        assert_eq!(index.part_fingerprint("claim-1"), None);
        assert_eq!(
            index.part_fingerprint("audit-1@3b:10.3"),
            None,
            "not canonical"
        );
        index.forget_before(3);
        assert_eq!(index.part_candidates(one), vec![4]);
        assert_eq!(
            index.part_candidates(index.audit_fingerprint("audit-2")),
            vec![3]
        );
    }

    proptest! {
        /// The guessed search finds what a binary search finds, on any sorted list: the
        /// uniform spread it guesses from is not needed for a right answer.
        #[test]
        fn the_guessed_place_is_the_binary_searchs(
            mut list in prop_oneof![
                // Spread as fingerprints are; bunched low; few distinct; all high.
                proptest::collection::vec(any::<u64>(), 0..300),
                proptest::collection::vec(0u64..64, 0..300),
                proptest::collection::vec((0u64..8).prop_map(|n| n << 60), 0..300),
                proptest::collection::vec(any::<u64>().prop_map(|n| n | 1 << 63), 0..300),
            ],
            probes in proptest::collection::vec(any::<u64>(), 1..20),
        ) {
            list.sort_unstable();
            for key in probes.into_iter().chain(list.iter().copied()).chain([0, u64::MAX]) {
                prop_assert_eq!(lower_bound(&list, key), list.partition_point(|&p| p < key));
            }
        }

        /// Against a map of every entry: adds (with merges), prunes and rebuilds keep
        /// every held entry a candidate of its fingerprint, and hold nothing pruned.
        #[test]
        fn every_held_entry_is_found(
            ops in proptest::collection::vec((0u8..10, 0u16..300), 1..3000)
        ) {
            let mut index = RequestIndex::build(std::iter::empty());
            let mut model: BTreeMap<i64, String> = BTreeMap::new();
            for (op, n) in ops {
                match op {
                    0 => {
                        // Prune the oldest `n` entries.
                        let cut = model.keys().nth(usize::from(n)).copied()
                            .unwrap_or(index.next_seq());
                        model = model.split_off(&cut);
                        index.forget_before(cut);
                    }
                    1 if n < 20 => {
                        let entries: Vec<(i64, &str, &str)> =
                            model.iter().map(|(s, r)| (*s, "c", r.as_str())).collect();
                        index = RequestIndex::build(entries);
                    }
                    _ => {
                        let seq = index.next_seq();
                        let id = format!("r{n}");
                        index.add(index.fingerprint("c", &id), index.part_fingerprint(&id), seq);
                        model.insert(seq, id);
                    }
                }
                prop_assert_eq!(index.len(), model.len());
            }
            for (seq, id) in &model {
                prop_assert!(index.candidates(index.fingerprint("c", id)).contains(seq));
            }
            let mut all: Vec<Packed> = index.long.clone();
            all.extend(&index.recent);
            prop_assert!(index.long.windows(2).all(|w| w[0] <= w[1]));
            prop_assert!(index.recent.windows(2).all(|w| w[0] <= w[1]));
            prop_assert_eq!(all.len(), model.len());
        }
    }
}
