//! Discovery of the ledgers under `--ledger-dir`: the DaemonSet mounts one directory per
//! container there, holding that container's ledger file. Every regular file directly in
//! the directory or in one of its direct subdirectories is a candidate; names starting with
//! `.` are the hook's temporaries and lock files and are ignored, and symbolic links are
//! not followed. A candidate that opens as a ledger is watched; one that fails validation is
//! skipped and logged once with the reason (again only if the file is replaced or
//! rewritten). [`Ledgers::scan`] runs at start and every second: new files are opened,
//! removed or replaced ones dropped.
//!
//! The header (the limits) is what the agent validated when it opened the file. Every scan
//! also reads the header the file holds now: one that differs was rewritten under the
//! ledger's processes (by a workload: the file is writable in its container), and processes
//! started afterwards would take its values. [`Ledgers::header_change`] says how it differs;
//! [`crate::reconcile`] reports the ledger's processes `tampered`, and the agent keeps
//! enforcing the limits it validated ([`Ledgers::validated_header`]). A file removed or
//! replaced while it had live slots passes its validated header on to the next file at its
//! path: a workload cannot lift its limits by re-creating its ledger either (a new pod, whose
//! predecessor's processes are gone and reclaimed, starts afresh).
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use ledger::{
    layout::{checksummed_bytes, fnv1a, Header},
    Ledger,
};
use tracing::{info, warn};

/// How long the agent waits for a ledger's lock before it gives up on that ledger for the
/// moment (a workload stopped inside it must not stop the agent; see
/// [`ledger::Ledger::with_lock_timeout`]).
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

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
    /// The file, open for reading its header every scan without opening it again.
    file: fs::File,
    /// The header the agent holds the ledger to: the one it validated when it opened the
    /// file, or, for a file that replaced one still in use at the same path, that one's.
    validated: Header,
    /// How the header on disk differs from `validated`, if it does.
    header_change: Option<String>,
}

/// The ledgers under one directory.
pub struct Ledgers {
    dir: PathBuf,
    open: BTreeMap<PathBuf, Watched>,
    /// Files that failed validation, as they were when they did.
    skipped: BTreeMap<PathBuf, FileKey>,
    /// The last error listing the directory (logged once until it changes).
    dir_error: Option<String>,
    /// The validated headers of ledgers removed or replaced while they had live slots: a
    /// file that appears at the same path is held to it.
    replaced: BTreeMap<PathBuf, Header>,
}

impl Ledgers {
    pub fn new(dir: PathBuf) -> Ledgers {
        Ledgers { dir, open: BTreeMap::new(), skipped: BTreeMap::new(), dir_error: None, replaced: BTreeMap::new() }
    }

    /// The file (device, inode) of the ledger at `path`.
    pub fn file_id(&self, path: &Path) -> Option<(u64, u64)> {
        let key = self.open.get(path)?.key;
        Some((key.dev, key.ino))
    }

    /// The header the agent holds the ledger at `path` to (its limits), see [`Watched`].
    pub fn validated_header(&self, path: &Path) -> Option<&Header> {
        Some(&self.open.get(path)?.validated)
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

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// How the header of the ledger at `path` now differs from the one the agent validated
    /// (see the module doc), if it does.
    pub fn header_change(&self, path: &Path) -> Option<&str> {
        self.open.get(path)?.header_change.as_deref()
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
            let Some(watched) = self.open.remove(&path) else { continue };
            let in_use = watched.ledger.slots().map(|slots| !slots.is_empty()).unwrap_or(true);
            if in_use {
                warn!(ledger = %path.display(), "ledger removed or replaced while processes used it: a file at its path is held to its limits");
                self.replaced.insert(path, watched.validated);
            } else {
                info!(ledger = %path.display(), "ledger removed or replaced: no longer watched");
            }
        }
        for (path, watched) in self.open.iter_mut() {
            let change = match ledger::file::read_header(&watched.file) {
                Ok(now) => header_change(&watched.validated, &now),
                Err(error) => Some(format!("its header cannot be read: {error}")),
            };
            if change != watched.header_change {
                match &change {
                    Some(what) => warn!(ledger = %path.display(), change = %what, "ledger header rewritten since the agent validated it: its processes are reported tampered, the validated limits stay enforced"),
                    None => info!(ledger = %path.display(), "ledger header back to the one the agent validated"),
                }
                watched.header_change = change;
            }
        }
        self.skipped.retain(|path, key| candidates.get(path) == Some(key));
        for (path, key) in candidates {
            if self.open.contains_key(&path) || self.skipped.contains_key(&path) {
                continue;
            }
            let opened = Ledger::open(&path).map(|ledger| ledger.with_lock_timeout(LOCK_WAIT)).and_then(|ledger| {
                let file = fs::File::open(&path).map_err(|source| ledger::LedgerError::Io { path: path.clone(), source })?;
                Ok((ledger, file))
            });
            match opened {
                Ok((ledger, file)) => {
                    info!(ledger = %path.display(), devices = ledger.header().device_count, "watching ledger");
                    let validated = self.replaced.remove(&path).unwrap_or(*ledger.header());
                    let header_change = header_change(&validated, ledger.header());
                    if let Some(what) = &header_change {
                        warn!(ledger = %path.display(), change = %what, "ledger replaced under running processes with other limits: its processes are reported tampered, the limits before stay enforced");
                    }
                    self.open.insert(path, Watched { ledger, key, file, validated, header_change });
                }
                Err(error) => {
                    warn!(file = %path.display(), reason = %error, "skipping a file that is not a valid ledger");
                    self.skipped.insert(path, key);
                }
            }
        }
    }
}

/// How `now` differs from `validated` (the fields that set limits and layout), if it does.
fn header_change(validated: &Header, now: &Header) -> Option<String> {
    let mut changes = Vec::new();
    if now.checksum != fnv1a(checksummed_bytes(now)) {
        changes.push("checksum no longer matches".to_string());
    }
    let count = validated.device_count as usize;
    if now.device_count != validated.device_count {
        changes.push(format!("device_count {} -> {}", validated.device_count, now.device_count));
    }
    for (index, (was, is)) in validated.devices[..count].iter().zip(&now.devices[..count]).enumerate() {
        for (field, before, after) in [
            ("limit", was.limit, is.limit),
            ("chunk", was.chunk, is.chunk),
            ("context_reserve", was.context_reserve, is.context_reserve),
            ("chunks", was.chunks, is.chunks),
        ] {
            if before != after {
                changes.push(format!("device {index} {field} {before} -> {after}"));
            }
        }
        if was.uuid != is.uuid {
            changes.push(format!("device {index} uuid changed"));
        }
    }
    if changes.is_empty() && checksummed_bytes(validated) != checksummed_bytes(now) {
        changes.push("layout fields changed".to_string());
    }
    (!changes.is_empty()).then(|| changes.join(", "))
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

    #[test]
    fn a_header_rewritten_under_the_agent_is_noticed() {
        use std::os::unix::fs::FileExt;
        let dir = std::env::temp_dir().join(format!("vramguard-ledgers-header-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("a")).expect("mkdir");
        let path = dir.join("a/ledger");
        let ledger = Ledger::create(&path, &geometry(), CREATOR_AGENT).expect("create");
        let mut ledgers = Ledgers::new(dir.clone());
        ledgers.scan();
        assert_eq!(ledgers.header_change(&path), None);

        let write = |header: &Header| {
            let bytes = checksummed_bytes(header).to_vec();
            let file = fs::OpenOptions::new().write(true).open(&path).expect("open");
            file.write_all_at(&bytes, 0).expect("write");
            file.write_all_at(&header.checksum.to_ne_bytes(), bytes.len() as u64).expect("write checksum");
        };
        let mut rewritten = *ledger.header();
        rewritten.devices[0].limit *= 2;
        write(&rewritten);
        ledgers.scan();
        let change = ledgers.header_change(&path).expect("noticed");
        assert!(change.contains("device 0 limit 67108864 -> 134217728"), "{change}");
        assert!(change.contains("checksum no longer matches"), "{change}");

        // Put back: no longer reported.
        write(ledger.header());
        ledgers.scan();
        assert_eq!(ledgers.header_change(&path), None);

        // Re-created with twice the limit while a process uses it: held to the old one.
        ledger.register(ledger::ProcessIdentity { pid: 1, pidns: 1, start_time: 1 }).expect("register");
        fs::remove_file(&path).expect("rm");
        let bigger = Geometry { devices: vec![DeviceConfig { limit: 128 << 20, chunk: 2 << 20, ..Default::default() }], ..geometry() };
        Ledger::create(&path, &bigger, CREATOR_AGENT).expect("re-create");
        ledgers.scan();
        let change = ledgers.header_change(&path).expect("noticed");
        assert!(change.contains("device 0 limit 67108864 -> 134217728"), "{change}");
        assert_eq!(ledgers.validated_header(&path).map(|h| h.devices[0].limit), Some(64 << 20));
        // Re-created when nobody used it (a new pod): a fresh start.
        fs::remove_file(&path).expect("rm");
        ledgers.scan();
        Ledger::create(&path, &bigger, CREATOR_AGENT).expect("re-create");
        ledgers.scan();
        assert_eq!(ledgers.header_change(&path), None);
        assert_eq!(ledgers.validated_header(&path).map(|h| h.devices[0].limit), Some(128 << 20));
        fs::remove_dir_all(&dir).expect("cleanup");
    }
}
