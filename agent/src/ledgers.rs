//! Discovery of the ledgers under `--ledger-dir`: the DaemonSet mounts one directory per
//! container there, holding that container's ledger file. Every regular file directly in
//! the directory or in one of its direct subdirectories is a candidate; names starting with
//! `.` are the hook's temporaries and lock files and are ignored, and symbolic links are
//! not followed. A candidate that opens as a ledger is watched; one that fails validation is
//! skipped and logged once with the reason (again only if the file is replaced or
//! rewritten). [`Ledgers::scan`] runs at start and every second: new files are opened,
//! removed or replaced ones dropped.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use ledger::Ledger;
use tracing::{info, warn};

/// Tells a file apart from the one that was at the same path before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileKey {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl FileKey {
    fn of(metadata: &fs::Metadata) -> FileKey {
        FileKey {
            dev: metadata.dev(),
            ino: metadata.ino(),
            len: metadata.len(),
            mtime: metadata.mtime(),
            mtime_nsec: metadata.mtime_nsec(),
        }
    }

    /// The same file (a ledger's size is fixed, and the hook writes it through a mapping,
    /// which moves its mtime: only the inode identifies an open ledger).
    fn same_inode(&self, other: &FileKey) -> bool {
        self.dev == other.dev && self.ino == other.ino
    }
}

struct Watched {
    ledger: Ledger,
    key: FileKey,
}

/// The ledgers under one directory.
pub struct Ledgers {
    dir: PathBuf,
    open: BTreeMap<PathBuf, Watched>,
    /// Files that failed validation, as they were when they did.
    skipped: BTreeMap<PathBuf, FileKey>,
    /// The last error listing the directory (logged once until it changes).
    dir_error: Option<String>,
}

impl Ledgers {
    pub fn new(dir: PathBuf) -> Ledgers {
        Ledgers { dir, open: BTreeMap::new(), skipped: BTreeMap::new(), dir_error: None }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The watched ledgers, by path.
    pub fn iter(&self) -> impl Iterator<Item = (&Path, &Ledger)> {
        self.open.iter().map(|(path, watched)| (path.as_path(), &watched.ledger))
    }

    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// Files skipped because they are not valid ledgers.
    pub fn skipped(&self) -> usize {
        self.skipped.len()
    }

    /// Brings the set up to date with the directory.
    pub fn scan(&mut self) {
        let candidates = match candidates(&self.dir) {
            Ok(candidates) => {
                if self.dir_error.take().is_some() {
                    info!(dir = %self.dir.display(), "the ledger directory is readable again");
                }
                candidates
            }
            Err(error) => {
                let text = error.to_string();
                if self.dir_error.as_deref() != Some(text.as_str()) {
                    warn!(dir = %self.dir.display(), reason = %text, "cannot list the ledger directory");
                    self.dir_error = Some(text);
                }
                BTreeMap::new()
            }
        };
        let gone: Vec<PathBuf> = self
            .open
            .iter()
            .filter(|(path, watched)| !candidates.get(*path).is_some_and(|key| key.same_inode(&watched.key)))
            .map(|(path, _)| path.clone())
            .collect();
        for path in gone {
            self.open.remove(&path);
            info!(ledger = %path.display(), "ledger removed or replaced: no longer watched");
        }
        self.skipped.retain(|path, key| candidates.get(path) == Some(key));
        for (path, key) in candidates {
            if self.open.contains_key(&path) || self.skipped.contains_key(&path) {
                continue;
            }
            match Ledger::open(&path) {
                Ok(ledger) => {
                    info!(ledger = %path.display(), devices = ledger.header().device_count, "watching ledger");
                    self.open.insert(path, Watched { ledger, key });
                }
                Err(error) => {
                    warn!(file = %path.display(), reason = %error, "skipping a file that is not a valid ledger");
                    self.skipped.insert(path, key);
                }
            }
        }
    }
}

/// Regular files (not hidden, not links) in `dir` and its direct subdirectories.
fn candidates(dir: &Path) -> std::io::Result<BTreeMap<PathBuf, FileKey>> {
    let mut found = BTreeMap::new();
    let mut subdirs = BTreeSet::new();
    for entry in fs::read_dir(dir)?.flatten() {
        if entry.file_name().as_encoded_bytes().first() == Some(&b'.') {
            continue;
        }
        let Ok(metadata) = fs::symlink_metadata(entry.path()) else { continue };
        if metadata.is_file() {
            found.insert(entry.path(), FileKey::of(&metadata));
        } else if metadata.is_dir() {
            subdirs.insert(entry.path());
        }
    }
    for sub in subdirs {
        // A directory that vanished or cannot be read holds no ledger for now.
        let Ok(entries) = fs::read_dir(&sub) else { continue };
        for entry in entries.flatten() {
            if entry.file_name().as_encoded_bytes().first() == Some(&b'.') {
                continue;
            }
            let Ok(metadata) = fs::symlink_metadata(entry.path()) else { continue };
            if metadata.is_file() {
                found.insert(entry.path(), FileKey::of(&metadata));
            }
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ledger::{layout::CREATOR_AGENT, DeviceConfig, Geometry};

    fn geometry() -> Geometry {
        Geometry {
            slots: 4,
            records: 64,
            devices: vec![DeviceConfig { limit: 64 << 20, chunk: 2 << 20, ..Default::default() }],
        }
    }

    #[test]
    fn finds_ledgers_skips_the_rest_and_follows_changes() {
        let dir = std::env::temp_dir().join(format!("vramguard-ledgers-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("a")).expect("mkdir");
        fs::create_dir_all(dir.join("b/deeper")).expect("mkdir");
        Ledger::create(&dir.join("a/ledger"), &geometry(), CREATOR_AGENT).expect("create a");
        Ledger::create(&dir.join("top"), &geometry(), CREATOR_AGENT).expect("create top");
        Ledger::create(&dir.join("b/deeper/too-deep"), &geometry(), CREATOR_AGENT).expect("create deep");
        fs::write(dir.join("b/garbage"), b"not a ledger").expect("write");
        fs::write(dir.join("a/.ledger.lock"), b"").expect("write");

        let mut ledgers = Ledgers::new(dir.clone());
        ledgers.scan();
        let paths: Vec<PathBuf> = ledgers.iter().map(|(p, _)| p.to_path_buf()).collect();
        assert_eq!(paths, vec![dir.join("a/ledger"), dir.join("top")]);
        assert_eq!(ledgers.skipped(), 1);

        fs::remove_file(dir.join("top")).expect("rm");
        fs::create_dir_all(dir.join("c")).expect("mkdir");
        Ledger::create(&dir.join("c/ledger"), &geometry(), CREATOR_AGENT).expect("create c");
        ledgers.scan();
        let paths: Vec<PathBuf> = ledgers.iter().map(|(p, _)| p.to_path_buf()).collect();
        assert_eq!(paths, vec![dir.join("a/ledger"), dir.join("c/ledger")]);

        // A skipped file that becomes a ledger is picked up.
        fs::remove_file(dir.join("b/garbage")).expect("rm");
        Ledger::create(&dir.join("b/garbage"), &geometry(), CREATOR_AGENT).expect("create b");
        ledgers.scan();
        assert_eq!(ledgers.len(), 3);
        assert_eq!(ledgers.skipped(), 0);

        fs::remove_dir_all(&dir).expect("cleanup");
        ledgers.scan();
        assert_eq!(ledgers.len(), 0);
    }
}
