//! What discovery decided about each file, so that no file is read twice while it has not
//! changed: probed, not a libcuda, refused by a cap, or failed (unreadable, malformed,
//! too large, refused by the kernel). A file is known by `(dev, ino)` and its [`Stamp`]; a
//! changed stamp makes the file new again. The memo is bounded: when full, every verdict but
//! `Probed` is forgotten (those files are read again when next seen).
use std::collections::HashMap;

pub use crate::libcuda::Stamp;
use crate::libcuda::FileId;

/// The decision about one version of a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Probes attached (the inode keeps them whatever happens to the file later).
    Probed,
    /// A readable ELF file that does not export what identifies a libcuda.
    NotLibcuda,
    /// A libcuda that a cap kept from being probed.
    Capped,
    /// Unreadable, malformed, too large, or refused by the kernel: the reason.
    Failed(String),
}

/// How many files the memo remembers.
pub const MEMO_ENTRIES: usize = 16384;

#[derive(Default)]
pub struct Memo {
    entries: HashMap<FileId, (Stamp, Verdict)>,
}

impl Memo {
    /// The verdict on this version of the file, if there is one. A probed file stays probed
    /// whatever its stamp says: its probes are on the inode.
    pub fn get(&self, id: FileId, stamp: Stamp) -> Option<&Verdict> {
        let (known, verdict) = self.entries.get(&id)?;
        (*known == stamp || *verdict == Verdict::Probed).then_some(verdict)
    }

    /// Whether the file has probes.
    pub fn probed(&self, id: FileId) -> bool {
        matches!(self.entries.get(&id), Some((_, Verdict::Probed)))
    }

    /// Records the verdict on this version of the file.
    pub fn put(&mut self, id: FileId, stamp: Stamp, verdict: Verdict) {
        if self.entries.len() >= MEMO_ENTRIES && !self.entries.contains_key(&id) {
            self.entries.retain(|_, (_, verdict)| *verdict == Verdict::Probed);
            tracing::info!(entries = MEMO_ENTRIES, "discovery memo full: forgot every verdict but the probed files");
        }
        self.entries.insert(id, (stamp, verdict));
    }

    /// How many remembered files have this verdict (`Failed` of any reason counts as one kind).
    pub fn count(&self, kind: fn(&Verdict) -> bool) -> usize {
        self.entries.values().filter(|(_, verdict)| kind(verdict)).count()
    }

    #[cfg(test)]
    fn entries(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(mtime: i64, ctime: i64) -> Stamp {
        Stamp { mtime: (mtime, 0), ctime: (ctime, 0), size: 10 }
    }

    #[test]
    fn a_verdict_holds_until_the_file_changes() {
        let mut memo = Memo::default();
        memo.put((1, 2), stamp(5, 5), Verdict::Failed("not an ELF file".into()));
        assert_eq!(memo.get((1, 2), stamp(5, 5)), Some(&Verdict::Failed("not an ELF file".into())));
        assert_eq!(memo.get((1, 2), stamp(6, 6)), None, "rewritten: a new file");
        assert_eq!(memo.get((1, 2), stamp(5, 7)), None, "mtime set back after a rewrite: ctime tells");
        assert_eq!(memo.get((1, 3), stamp(5, 5)), None, "another inode");
        memo.put((1, 2), stamp(6, 6), Verdict::NotLibcuda);
        assert_eq!(memo.get((1, 2), stamp(6, 6)), Some(&Verdict::NotLibcuda));
    }

    #[test]
    fn probed_files_stay_probed_and_survive_a_full_memo() {
        let mut memo = Memo::default();
        memo.put((0, 0), stamp(1, 1), Verdict::Probed);
        assert_eq!(memo.get((0, 0), stamp(2, 2)), Some(&Verdict::Probed));
        for ino in 1..MEMO_ENTRIES as u64 {
            memo.put((1, ino), stamp(1, 1), Verdict::NotLibcuda);
        }
        assert_eq!(memo.entries(), MEMO_ENTRIES);
        memo.put((2, 0), stamp(1, 1), Verdict::Capped);
        assert_eq!(memo.entries(), 2, "the probed file and the new one");
        assert!(memo.probed((0, 0)));
        assert_eq!(memo.count(|v| *v == Verdict::Capped), 1);
    }
}
