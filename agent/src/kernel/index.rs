//! The agent's index of the probes' records by process: the keys of `ALLOCS` and `EXTMEM`
//! records, by tgid, learnt from the `JOURNAL` ring buffer (every record the probes insert is
//! journaled; taking a spare over inserts nothing). A hash map keyed by (tgid, space, address)
//! cannot be read by tgid, so this is what lets a process's exit cost a sweep of its own
//! records ([`super::accounting`]).
//!
//! The index learns of inserts only, so it holds keys whose records the probes have deleted
//! since: a process's keys are compacted (those without a record dropped, duplicates merged)
//! each time they reach twice what they were after the last compaction (at least
//! [`MIN_COMPACT`]), which keeps each process's keys within about twice its live records and
//! costs at most two map lookups per journaled record. The whole index holds at most `cap`
//! keys; a key past it is dropped and the index marked incomplete, which a full sweep of the
//! maps mends by rebuilding it from what they hold ([`Index::rebuild`]).
use std::collections::HashMap;

use common::AllocKey;

/// Keys a process may hold before its first compaction.
pub const MIN_COMPACT: usize = 64;

/// A record's key less its tgid: (space, address); space `common::journal::EXTERNAL` is an
/// `EXTMEM` record.
pub type Key = (u32, u64);

#[derive(Default)]
struct Keys {
    keys: Vec<Key>,
    /// Compact when `keys` is this long.
    compact_at: usize,
}

/// Record keys by tgid.
pub struct Index {
    by_process: HashMap<u32, Keys>,
    len: usize,
    cap: usize,
    complete: bool,
    /// Keys dropped at the cap.
    pub overflows: u64,
}

impl Index {
    /// An empty (complete) index of at most `cap` keys.
    pub fn new(cap: usize) -> Index {
        Index { by_process: HashMap::new(), len: 0, cap, complete: true, overflows: 0 }
    }

    /// Keys held.
    pub fn keys_held(&self) -> usize {
        self.len
    }

    /// Whether every record inserted since the last rebuild has its key here (none was
    /// dropped at the cap).
    pub fn complete(&self) -> bool {
        self.complete
    }

    /// Adds a journaled key; returns its tgid if that process's keys are due for compaction
    /// ([`Index::take`] them, keep those with a record, [`Index::put_back`]).
    pub fn add(&mut self, key: &AllocKey) -> Option<u32> {
        if self.len >= self.cap {
            self.overflows += 1;
            self.complete = false;
            return None;
        }
        let keys = self.by_process.entry(key.tgid).or_insert_with(|| Keys { keys: Vec::new(), compact_at: MIN_COMPACT });
        keys.keys.push((key.space, key.addr));
        self.len += 1;
        (keys.keys.len() >= keys.compact_at).then_some(key.tgid)
    }

    /// Takes process `tgid`'s keys out, without duplicates.
    pub fn take(&mut self, tgid: u32) -> Vec<Key> {
        let Some(Keys { mut keys, .. }) = self.by_process.remove(&tgid) else { return Vec::new() };
        self.len -= keys.len();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// Puts back those of process `tgid`'s keys that still have a record; its next compaction
    /// is due at twice as many (at least [`MIN_COMPACT`]).
    pub fn put_back(&mut self, tgid: u32, keys: Vec<Key>) {
        if keys.is_empty() {
            return;
        }
        let compact_at = keys.len().saturating_mul(2).max(MIN_COMPACT);
        let entry = self.by_process.entry(tgid).or_default();
        self.len += keys.len();
        // Keys journaled meanwhile (none, as the agent uses it: take and put back happen in
        // one turn of the kernel task) stay.
        entry.keys.extend(keys);
        entry.compact_at = compact_at.max(entry.keys.len().saturating_mul(2));
    }

    /// Replaces the index by `keys` (every record a full sweep found), complete again unless
    /// they pass the cap.
    pub fn rebuild(&mut self, keys: impl IntoIterator<Item = AllocKey>) {
        self.by_process.clear();
        self.len = 0;
        self.complete = true;
        for key in keys {
            let _ = self.add(&key);
        }
        for keys in self.by_process.values_mut() {
            keys.compact_at = keys.keys.len().saturating_mul(2).max(MIN_COMPACT);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tgid: u32, addr: u64) -> AllocKey {
        AllocKey { tgid, space: 0, addr }
    }

    #[test]
    fn a_process_s_keys_are_its_own_and_compaction_keeps_them_near_its_live_records() {
        let mut index = Index::new(1 << 20);
        // Process 1 is due for compaction from its 64th key on (the agent compacts it then).
        let due: Vec<usize> = (0..100).filter(|addr| index.add(&key(1, *addr)).is_some()).map(|addr| addr as usize).collect();
        assert_eq!(due.first(), Some(&63));
        // Another process's keys are not process 2's.
        assert_eq!(index.add(&key(2, 7)), None);
        assert_eq!(index.take(2), vec![(0, 7)]);
        assert_eq!(index.keys_held(), 100);
        // Compacted to its 100 live records: due again at 200 keys, not before.
        let keys = index.take(1);
        assert_eq!(keys.len(), 100);
        index.put_back(1, keys);
        let due_at = (100..300).find(|addr| index.add(&key(1, *addr)).is_some());
        assert_eq!(due_at, Some(199), "the 200th key");
        // Compacted to one live record: due again at 64.
        let _ = index.take(1);
        index.put_back(1, vec![(0, 5)]);
        assert_eq!(index.keys_held(), 1);
        assert_eq!((1..100).find(|addr| index.add(&key(1, 1000 + *addr)).is_some()), Some(63));
    }

    #[test]
    fn duplicates_are_merged_and_the_cap_makes_the_index_incomplete_until_rebuilt() {
        let mut index = Index::new(3);
        for addr in [1, 1, 2] {
            let _ = index.add(&key(9, addr));
        }
        assert!(index.complete());
        assert_eq!(index.add(&key(9, 3)), None);
        assert!(!index.complete());
        assert_eq!(index.overflows, 1);
        assert_eq!(index.take(9), vec![(0, 1), (0, 2)]);
        index.rebuild([key(9, 1), key(10, 4)]);
        assert!(index.complete());
        assert_eq!(index.keys_held(), 2);
        assert_eq!(index.take(10), vec![(0, 4)]);
    }
}
