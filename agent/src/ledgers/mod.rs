//! The ledgers under `--ledger-dir`, and the agent's only ways of touching them.
//!
//! # Discovery
//!
//! The DaemonSet mounts one directory per container there, holding that container's ledger
//! file. Every regular file directly in the directory or in one of its direct subdirectories
//! is a candidate; names starting with `.` are the hook's temporaries and lock files and are
//! ignored. The directories belong to the workloads, so nothing found there is followed or
//! trusted: subdirectories are opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`
//! relative to the ledger directory, files with `O_NOFOLLOW | O_NONBLOCK` relative to their
//! directory's descriptor, and only a regular file whose descriptor is the inode the listing
//! showed is opened as a ledger ([`Limits`]: at most `max_per_dir` files a directory and
//! `max_ledgers` in all are considered, at most [`MAX_ENTRIES`] entries of a directory read).
//! A file is validated from its descriptor (header read with `pread`, never mapped) and
//! skipped, with the reason logged once and kept for `vramguard audit`, if it is not a valid
//! ledger or its geometry exceeds what the agent allows; again only if it changes.
//! The ledgers the agent created (pinned, below) are looked up at their paths directly, not
//! found by listing, and count against no cap. A directory that holds more than the agent
//! reads is reported (`crowded` in `vramguard audit`, `vramguard_ledger_dirs_crowded`).
//! [`Ledgers::scan`] runs at start and every second, in the reclaim task ([`task`]); it lists
//! the directory only when inotify says it changed, and every [`changes::RESCAN`] ([`changes`]).
//!
//! # Access
//!
//! The agent never maps a ledger and never takes its lock (`docs/security.md`, rule 1):
//! [`LedgerHandle`] reads bounded private copies ([`ledger::copy`]), writes host pids with
//! `pwrite` at offsets from the validated header, and hands the operations that need the
//! lock (reclaim, the agent's own charge) to a confined worker process per ledger
//! ([`worker`]) that it waits on for a bounded time.
//!
//! # Headers
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
//!
//! A ledger the agent created itself (a provisioned container's, [`crate::provision`]) is
//! *pinned* ([`Ledgers::set_pins`]): whatever file is at its path, whenever it was opened, is held
//! to the header the agent created, and any other header is tampering.
pub mod changes;
pub mod charge;
mod directory;
pub mod exits;
mod handle;
pub mod reclaim;
pub mod sandbox;
pub mod task;
pub mod worker;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use ledger::layout::{checksummed_bytes, fnv1a, Header};
use tracing::{info, warn};

use changes::Listing;
use directory::{candidates, open_beneath, FileKey};
use handle::examine_as;
pub use directory::MAX_ENTRIES;
pub use handle::{open_no_follow, slot_bytes, slot_extra_contexts, LedgerHandle, SlotClaim};
pub use worker::AccessError;
use worker::Launcher;

/// How long a ledger worker waits for a ledger's lock before it answers that it is busy (a
/// workload stopped inside it must not stop the agent; see
/// [`ledger::Ledger::with_lock_timeout`]).
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// How [`Ledgers::header_change`] begins when the header could not be read at all.
const HEADER_UNREADABLE: &str = "its header cannot be read";

/// What the agent accepts under `--ledger-dir` (flags of `vramguard run`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Ledgers watched in all.
    pub max_ledgers: usize,
    /// Candidate files considered in one directory (a container's).
    pub max_per_dir: usize,
    /// Most process slots of a ledger.
    pub max_slots: u32,
    /// Most allocation records of a ledger.
    pub max_records: u32,
    /// Largest ledger file, in bytes.
    pub max_bytes: u64,
}

impl Default for Limits {
    /// Room for the hook's ledgers (1024 slots, 65,536 records, a few MiB) four times over.
    fn default() -> Limits {
        Limits { max_ledgers: 1024, max_per_dir: 4, max_slots: 4096, max_records: 1 << 18, max_bytes: 64 << 20 }
    }
}

impl Limits {
    /// Why `header` is more than the agent allows, if it is.
    fn exceeded_by(&self, header: &Header) -> Option<String> {
        if header.slot_count > self.max_slots {
            return Some(format!("{} slots, more than the {} the agent allows (--max-ledger-slots)", header.slot_count, self.max_slots));
        }
        if header.record_count > self.max_records {
            return Some(format!("{} records, more than the {} the agent allows (--max-ledger-records)", header.record_count, self.max_records));
        }
        if header.total_size > self.max_bytes {
            return Some(format!("{} bytes, more than the {} the agent allows (--max-ledger-bytes)", header.total_size, self.max_bytes));
        }
        None
    }
}

/// A file under the directory the agent does not watch, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Skipped {
    key: FileKey,
    reason: String,
}

/// The ledgers under one directory. The task that scans owns it; a clone (cheap: the handles
/// are shared) is what the other tasks read.
#[derive(Clone)]
pub struct Ledgers {
    dir: PathBuf,
    limits: Limits,
    launcher: Launcher,
    open: BTreeMap<PathBuf, Arc<LedgerHandle>>,
    /// How the header on disk of a watched ledger differs from the one the agent holds it
    /// to, where it does.
    changes: BTreeMap<PathBuf, String>,
    /// Files not watched, as they were when they were skipped.
    skipped: BTreeMap<PathBuf, Skipped>,
    /// The last error listing the directory (logged once until it changes).
    dir_error: Option<String>,
    /// Directories whose surplus entries were logged (once until they shrink).
    crowded: BTreeMap<PathBuf, String>,
    /// The validated headers of ledgers removed or replaced while they had live slots: a
    /// file that appears at the same path is held to it.
    replaced: BTreeMap<PathBuf, Header>,
    /// The ledgers the agent created (see the module doc).
    pinned: BTreeMap<PathBuf, Pin>,
    /// The last listing of the directory and whether it still holds ([`changes`]); shared
    /// by the clones, used by the scans (the reclaim task's).
    listing: Arc<Mutex<Listing>>,
    /// The live processes of the ledgers' slots watched through pidfds ([`exits::Watch`]),
    /// once the reclaim task watches them; shared by the clones.
    watch: Option<Arc<exits::Watch>>,
}

/// A ledger the agent created: the header it created it with and the container's names as
/// the runtime gave them (trusted, unlike the names a hook writes into a ledger).
#[derive(Clone, Debug)]
pub struct Pin {
    pub header: Header,
    /// Namespace, pod, container, pod UID.
    pub names: [String; 4],
}

impl Ledgers {
    pub fn new(dir: PathBuf) -> Ledgers {
        Ledgers::with_limits(dir, Limits::default())
    }

    pub fn with_limits(dir: PathBuf, limits: Limits) -> Ledgers {
        Ledgers {
            launcher: Launcher::for_ledgers(limits.max_bytes),
            limits,
            open: BTreeMap::new(),
            changes: BTreeMap::new(),
            skipped: BTreeMap::new(),
            dir_error: None,
            crowded: BTreeMap::new(),
            replaced: BTreeMap::new(),
            pinned: BTreeMap::new(),
            listing: Arc::new(Mutex::new(Listing::new(&dir))),
            dir,
            watch: None,
        }
    }

    /// Shares the pidfd watch of the slots' live processes with the readers of the set.
    pub fn set_watch(&mut self, watch: Arc<exits::Watch>) {
        self.watch = Some(watch);
    }

    /// Whether host pid `host` runs `process`, as a pidfd watch of it says without a read of
    /// /proc: `false` also when it is not watched (ask /proc then).
    pub fn watched_alive(&self, host: u32, process: &ledger::ProcessIdentity) -> bool {
        self.watch.as_ref().is_some_and(|watch| watch.alive(host, process))
    }

    /// Listings of the directory the scans made, by why ([`changes::Why::ALL`]'s order).
    pub fn listings(&self) -> [u64; 4] {
        self.listing.lock().map_or([0; 4], |listing| listing.counts)
    }

    /// Holds the ledgers at these paths to these headers, the ones the agent created (see
    /// the module doc); paths pinned before and not in `pins` are let go. Takes effect at
    /// once for a file already watched (its header is compared at the next scan).
    pub fn set_pins(&mut self, pins: BTreeMap<PathBuf, Pin>) {
        for (path, pin) in &pins {
            let Some(handle) = self.open.get_mut(path) else { continue };
            if checksummed_bytes(&handle.validated) == checksummed_bytes(&pin.header) {
                continue;
            }
            match handle.held_to(pin.header, self.launcher.clone()) {
                Ok(held) => *handle = Arc::new(held),
                Err(error) => {
                    // Opened again (with the pin) by the next scan.
                    warn!(ledger = %path.display(), %error, "cannot hold a watched ledger to its pin");
                    self.open.remove(path);
                }
            }
        }
        self.pinned = pins;
    }

    /// The pin of the ledger at `path`, if the agent created it.
    pub fn pinned(&self, path: &Path) -> Option<&Pin> {
        self.pinned.get(path)
    }

    /// The file (device, inode) of the ledger at `path`.
    pub fn file_id(&self, path: &Path) -> Option<(u64, u64)> {
        let key = self.open.get(path)?.key;
        Some((key.dev, key.ino))
    }

    /// The header the agent holds the ledger at `path` to (its limits), see [`LedgerHandle`].
    pub fn validated_header(&self, path: &Path) -> Option<&Header> {
        Some(&self.open.get(path)?.validated)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The watched ledgers, by path.
    pub fn iter(&self) -> impl Iterator<Item = (&Path, &LedgerHandle)> {
        self.open.iter().map(|(path, handle)| (path.as_path(), handle.as_ref()))
    }

    /// The watched ledgers, by path, with their shared handles.
    pub fn shared(&self) -> impl Iterator<Item = (&Path, &Arc<LedgerHandle>)> {
        self.open.iter().map(|(path, handle)| (path.as_path(), handle))
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
        self.changes.get(path).map(String::as_str)
    }

    /// Ledger worker processes running now.
    pub fn workers(&self) -> usize {
        self.open.values().filter(|handle| handle.worker_running()).count()
    }

    /// Ledgers left alone for a while (their lock stayed held, their worker failed).
    pub fn backed_off(&self) -> usize {
        self.open.values().filter(|handle| handle.failing().is_some()).count()
    }

    /// Directories holding more than the agent reads.
    pub fn crowded(&self) -> usize {
        self.crowded.len()
    }

    /// Files skipped (not valid ledgers, too large, past a cap).
    pub fn skipped(&self) -> usize {
        self.skipped.len()
    }

    /// Every file under the directory the agent does not work on as it should, with the
    /// reason: skipped (not a ledger, too large, past a cap), header rewritten (`tampered`),
    /// unreadable now (cut, grown), or its worker failing (crashed, timed out).
    pub fn problems(&self) -> BTreeMap<String, String> {
        let mut problems: BTreeMap<String, String> =
            self.skipped.iter().map(|(path, skipped)| (path.display().to_string(), format!("skipped: {}", skipped.reason))).collect();
        for (dir, what) in &self.crowded {
            problems.insert(dir.display().to_string(), format!("crowded: {what} (the rest is not watched)"));
        }
        for (path, handle) in &self.open {
            // A rewritten header first (a replaced file is also another size), unless the
            // header went with a cut.
            let rewritten = self.changes.get(path).filter(|change| !change.starts_with(HEADER_UNREADABLE));
            let problem = match (rewritten, handle.copy()) {
                (Some(change), _) => Some(format!("tampered: its header was rewritten ({change})")),
                // A worker that died of the damage (SIGBUS on a cut file) says so too, for as
                // long as the file stays unreadable (its worker is not called again).
                (None, Err(error)) => Some(match handle.last_failure() {
                    Some(reason) => format!("unreadable: {error}; worker failing: {reason}"),
                    None => format!("unreadable: {error}"),
                }),
                (None, Ok(copy)) => handle.failing().map(|reason| format!("worker failing: {reason}")).or_else(|| {
                    (!copy.settled).then(|| "unsettled: every copy caught a mutation in progress (dirty flag held raised?)".to_string())
                }),
            };
            if let Some(problem) = problem {
                problems.insert(path.display().to_string(), problem);
            }
        }
        problems
    }

    /// Brings the set up to date with the directory: lists it if it changed since the last
    /// listing, or if that is [`changes::RESCAN`] old ([`changes`]).
    pub fn scan(&mut self) {
        let listing = Arc::clone(&self.listing);
        let mut listing = listing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let last = match listing.due() {
            None => listing.last.clone(),
            Some(_) => None,
        };
        let (candidates, crowded) = match last {
            Some(last) => last,
            None => match candidates(&self.dir, &self.limits) {
                Ok((found, crowded, subdirs)) => {
                    if self.dir_error.take().is_some() {
                        info!(dir = %self.dir.display(), "the ledger directory is readable again");
                    }
                    listing.listed(Some((found.clone(), crowded.clone())), &subdirs);
                    (found, crowded)
                }
                Err(error) => {
                    let text = error.to_string();
                    if self.dir_error.as_deref() != Some(text.as_str()) {
                        warn!(dir = %self.dir.display(), reason = %text, "cannot list the ledger directory");
                        self.dir_error = Some(text);
                    }
                    listing.listed(None, &[]);
                    (BTreeMap::new(), BTreeMap::new())
                }
            },
        };
        drop(listing);
        // The ledgers the agent created are looked up directly: however many entries a
        // workload makes around them, they are watched.
        let mut candidates = candidates;
        for path in self.pinned.keys() {
            if !candidates.contains_key(path) {
                if let Some(key) = directory::key_beneath(&self.dir, path) {
                    candidates.insert(path.clone(), key);
                }
            }
        }
        for (dir, what) in &crowded {
            if self.crowded.get(dir) != Some(what) {
                warn!(dir = %dir.display(), what = %what, "a ledger directory holds more than the agent reads: the rest is ignored");
            }
        }
        self.crowded = crowded;
        let gone: Vec<PathBuf> = self
            .open
            .iter()
            .filter(|(path, handle)| !candidates.get(*path).is_some_and(|key| key.same_inode(&handle.key)))
            .map(|(path, _)| path.clone())
            .collect();
        for path in gone {
            let Some(handle) = self.open.remove(&path) else { continue };
            let in_use = handle.slots().map(|slots| !slots.is_empty()).unwrap_or(true);
            if in_use {
                warn!(ledger = %path.display(), "ledger removed or replaced while processes used it: a file at its path is held to its limits");
                self.replaced.insert(path, handle.validated);
            } else {
                info!(ledger = %path.display(), "ledger removed or replaced: no longer watched");
            }
        }
        for (path, handle) in &self.open {
            if let Ok(mut worker) = handle.worker.lock() {
                if let Some(reason) = worker.reap_if_dead() {
                    warn!(ledger = %path.display(), %reason, "the ledger's worker died between calls: reaped, no worker for this ledger for a while");
                }
                worker.stop_if_idle(worker::IDLE);
            }
        }
        if !self.open.is_empty() {
            // The first reclaim in a ledger without a worker does not wait for one to start.
            worker::prepare_spare(&self.launcher);
        }
        self.changes.retain(|path, _| self.open.contains_key(path));
        for (path, handle) in &self.open {
            // With the stamp the periodic sweep compares next ([`reclaim`]'s quiet ledgers).
            let change = match handle.header_and_stamp() {
                Ok(now) => header_change(&handle.validated, &now),
                Err(error) => Some(format!("{HEADER_UNREADABLE}: {error}")),
            };
            if change.as_ref() != self.changes.get(path) {
                match change {
                    Some(what) => {
                        warn!(ledger = %path.display(), change = %what, "ledger header rewritten since the agent validated it: its processes are reported tampered, the validated limits stay enforced");
                        self.changes.insert(path.clone(), what);
                    }
                    None => {
                        info!(ledger = %path.display(), "ledger header back to the one the agent validated");
                        self.changes.remove(path);
                    }
                }
            }
        }
        self.skipped.retain(|path, skipped| candidates.get(path) == Some(&skipped.key));
        for (path, key) in candidates {
            if self.open.contains_key(&path) || self.skipped.contains_key(&path) {
                continue;
            }
            let opened = if self.open.len() >= self.limits.max_ledgers && !self.pinned.contains_key(&path) {
                Err(format!("the agent already watches {} ledgers (--max-ledgers)", self.limits.max_ledgers))
            } else {
                self.open_ledger(&path, key)
            };
            match opened {
                Ok((handle, change)) => {
                    info!(ledger = %path.display(), devices = handle.validated.device_count, "watching ledger");
                    if let Some(change) = change {
                        self.changes.insert(path.clone(), change);
                    }
                    self.open.insert(path, Arc::new(handle));
                }
                Err(reason) => {
                    warn!(file = %path.display(), reason = %reason, "skipping a file that is not a valid ledger (or more than the agent allows)");
                    self.skipped.insert(path, Skipped { key, reason });
                }
            }
        }
    }

    /// Opens `path` (listed as `key`) without following links, validates it as a ledger
    /// within the agent's limits; the reason if it is not one.
    /// Also says how the file's header differs from the one it is held to, if it does.
    fn open_ledger(&mut self, path: &Path, key: FileKey) -> Result<(LedgerHandle, Option<String>), String> {
        let file = open_beneath(&self.dir, path).map_err(|error| format!("cannot open it: {error}"))?;
        let pinned = self.pinned.get(path).map(|pin| pin.header);
        let (opened, header, held) = examine_as(&file, path, &self.limits, pinned.as_ref())?;
        if !opened.same_inode(&key) {
            return Err("replaced while being opened".into());
        }
        let replaced = self.replaced.remove(path);
        let validated = if pinned.is_some() { held } else { replaced.unwrap_or(held) };
        let change = header_change(&validated, &header);
        if let Some(what) = &change {
            warn!(ledger = %path.display(), change = %what, "ledger replaced under running processes with other limits: its processes are reported tampered, the limits before stay enforced");
        }
        Ok((LedgerHandle::new(path, opened, file, validated, self.launcher.clone()), change))
    }
}

/// How `now` differs from `validated` (the fields that set limits and layout), if it does.
pub(super) fn header_change(validated: &Header, now: &Header) -> Option<String> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    use ledger::{layout::CREATOR_AGENT, DeviceConfig, Geometry, Ledger};

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
    fn lists_the_directory_only_when_inotify_says_it_changed() {
        let (dir, _, _ledger) = one_ledger("inotify");
        let mut ledgers = Ledgers::new(dir.clone());
        let listed = |ledgers: &Ledgers| ledgers.listings().iter().sum::<u64>();
        ledgers.scan();
        assert_eq!(ledgers.listings(), [1, 0, 0, 0], "the first scan lists");
        ledgers.scan(); // `a` was watched after the first listing: listed once more
        assert_eq!(listed(&ledgers), 2);
        for _ in 0..3 {
            ledgers.scan();
        }
        assert_eq!(listed(&ledgers), 2, "nothing changed: the last listing holds");
        assert_eq!(ledgers.len(), 1);

        // A ledger in a new subdirectory, and one beside the first: each found by the next scan.
        fs::create_dir_all(dir.join("b")).expect("mkdir");
        Ledger::create(&dir.join("b/ledger"), &geometry(), CREATOR_AGENT).expect("create b");
        ledgers.scan();
        assert_eq!(ledgers.len(), 2);
        Ledger::create(&dir.join("a/other"), &geometry(), CREATOR_AGENT).expect("create a/other");
        ledgers.scan();
        ledgers.scan();
        assert_eq!(ledgers.len(), 3);
        let before = listed(&ledgers);
        ledgers.scan();
        assert_eq!(listed(&ledgers), before, "quiet again");
        // A removed ledger is let go at the next scan.
        fs::remove_file(dir.join("a/other")).expect("rm");
        ledgers.scan();
        assert_eq!(ledgers.len(), 2);
        assert_eq!(ledgers.listings()[2], 0, "no periodic full listing within {:?}", changes::RESCAN);
        fs::remove_dir_all(&dir).expect("cleanup");
        ledgers.scan();
        assert_eq!(ledgers.len(), 0);
    }

    #[test]
    fn hidden_entries_count_against_the_entries_read_from_a_directory() {
        let (dir, _, _ledger) = one_ledger("hidden");
        let mut ledgers = Ledgers::new(dir.clone());
        ledgers.scan();
        assert_eq!((ledgers.len(), ledgers.crowded()), (1, 0));
        // A workload fills its own directory with hidden files: the listing stops at the bound
        // (the directory is reported crowded), however many there are.
        fs::create_dir_all(dir.join("b")).expect("mkdir");
        for i in 0..=directory::MAX_ENTRIES {
            fs::write(dir.join(format!("b/.hidden-{i}")), b"").expect("write");
        }
        ledgers.scan();
        assert_eq!(ledgers.crowded(), 1, "{:?}", ledgers.problems());
        let problem = ledgers.problems().remove(&dir.join("b").display().to_string());
        assert!(problem.is_some_and(|p| p.contains(&format!("more than {} entries", directory::MAX_ENTRIES))));
        assert_eq!(ledgers.len(), 1, "the other directory's ledger still watched");
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_subdirectory_that_cannot_be_watched_makes_every_scan_list_as_unwatched() {
        let (dir, _, _ledger) = one_ledger("unwatched");
        let mut listing = changes::Listing::new(&dir);
        let unwatched = changes::Why::ALL.iter().position(|why| *why == changes::Why::Unwatched).expect("a why");
        assert_eq!(listing.due(), Some(changes::Why::First));
        // A subdirectory gone before its watch was added (as when it races with its removal,
        // or the kernel's watch limit is reached): the next scans list, and say why.
        listing.listed(Some(Default::default()), &[dir.join("a"), dir.join("gone")]);
        for _ in 0..3 {
            assert_eq!(listing.due(), Some(changes::Why::Unwatched));
            listing.listed(Some(Default::default()), &[dir.join("a"), dir.join("gone")]);
        }
        assert_eq!(listing.counts[unwatched], 3);
        // Once every subdirectory is watched: quiet.
        listing.listed(Some(Default::default()), &[dir.join("a")]);
        assert_eq!(listing.due(), None);
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    /// A fresh directory `vramguard-ledgers-<tag>-<pid>` with one ledger at `a/ledger`.
    fn one_ledger(tag: &str) -> (PathBuf, PathBuf, Ledger) {
        let dir = std::env::temp_dir().join(format!("vramguard-ledgers-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("a")).expect("mkdir");
        let path = dir.join("a/ledger");
        let ledger = Ledger::create(&path, &geometry(), CREATOR_AGENT).expect("create");
        (dir, path, ledger)
    }

    #[test]
    fn the_reconcile_read_sees_a_write_around_the_lock_at_once() {
        let (dir, _, ledger) = one_ledger("claims");
        let me = ledger::ProcessIdentity::current().expect("identity");
        let slot = ledger.register(me).expect("register");
        ledger.reserve(slot, 0, ledger::Charge::Device(32 << 20), 0).expect("charge");
        let mut ledgers = Ledgers::new(dir.clone());
        ledgers.scan();
        let (_, handle) = ledgers.iter().next().expect("watched");
        let claims = || {
            let mut seen = Vec::new();
            handle.for_each_claim(|claim| seen.push((claim.process.pid, claim.host_pid, claim.bytes))).expect("read");
            seen
        };
        assert_eq!(claims(), vec![(me.pid, 0, 32 << 20)]);
        // Written around the lock (the stamp stays): the host pid and a slot zeroed under its
        // memory are both seen by the next read.
        ledger.set_host_pid(slot, 4242);
        assert_eq!(claims(), vec![(me.pid, 4242, 32 << 20)]);
        let bytes = ledger.header().slots_offset
            + u64::from(slot) * std::mem::size_of::<ledger::layout::Slot>() as u64
            + std::mem::offset_of!(ledger::layout::Slot, devices) as u64
            + std::mem::offset_of!(ledger::layout::SlotDevice, bytes) as u64;
        let file = fs::OpenOptions::new().write(true).open(dir.join("a/ledger")).expect("open");
        std::os::unix::fs::FileExt::write_all_at(&file, &[0u8; 8 * ledger::layout::KINDS], bytes).expect("zeroed");
        assert_eq!(claims(), vec![(me.pid, 4242, 0)]);
        // The agent's own write.
        handle.set_host_pid(slot, 7).expect("written");
        assert_eq!(claims(), vec![(me.pid, 7, 0)]);
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_dead_slot_is_freed_through_the_worker_which_stops_when_idle() {
        let (dir, _, ledger) = one_ledger("worker");
        let gone = ledger::ProcessIdentity { pid: 1, pidns: 1, start_time: 1 };
        let slot = ledger.register(gone).expect("register");
        let mut ledgers = Ledgers::new(dir.clone());
        ledgers.scan();
        let (_, handle) = ledgers.iter().next().expect("watched");
        assert!(!handle.worker_running(), "started only when needed");
        // Not the slot's process: nothing freed.
        assert_eq!(handle.reclaim_process(slot, ledger::ProcessIdentity { start_time: 2, ..gone }).expect("asked"), None);
        assert!(handle.reclaim_process(slot, gone).expect("reclaimed").is_some());
        assert!(ledger.slots().expect("slots").is_empty());
        assert_eq!(ledgers.workers(), 1);
        if let Ok(mut worker) = ledgers.iter().next().expect("watched").1.worker.lock() {
            worker.stop_if_idle(std::time::Duration::from_secs(3600));
            assert!(worker.running(), "not idle long enough");
            worker.stop_if_idle(std::time::Duration::ZERO);
        }
        assert_eq!(ledgers.workers(), 0);
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_header_rewritten_under_the_agent_is_noticed() {
        use std::os::unix::fs::FileExt;
        let (dir, path, ledger) = one_ledger("header");
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

    #[test]
    fn a_pinned_ledger_is_held_to_the_agents_header_whatever_the_file_says() {
        let (dir, path, ledger) = one_ledger("pinned");
        let agents = *ledger.header();
        drop(ledger);
        let mut ledgers = Ledgers::new(dir.clone());
        let names = ["ns", "pod", "c", "uid"].map(String::from);
        ledgers.set_pins(BTreeMap::from([(path.clone(), Pin { header: agents, names })]));
        assert!(ledgers.pinned(&path).is_some());
        ledgers.scan();
        assert_eq!(ledgers.header_change(&path), None);
        // Deleted and re-created with a larger limit, nobody using it: still the agent's
        // header (an unpinned ledger would start afresh here).
        fs::remove_file(&path).expect("rm");
        ledgers.scan();
        let bigger = Geometry { devices: vec![DeviceConfig { limit: 8 << 30, chunk: 2 << 20, ..Default::default() }], ..geometry() };
        Ledger::create(&path, &bigger, CREATOR_AGENT).expect("re-create");
        ledgers.scan();
        let change = ledgers.header_change(&path).expect("tampered");
        assert!(change.contains("device 0 limit 67108864 -> 8589934592"), "{change}");
        assert_eq!(ledgers.validated_header(&path).map(|h| h.devices[0].limit), Some(64 << 20));
        assert!(ledgers.problems().get(&path.display().to_string()).is_some_and(|p| p.starts_with("tampered")));
        // A fresh agent (restarted) finds a file whose header says another limit without the
        // layout to match (invalid on its own): held to the pin, tampered, not skipped.
        fs::remove_file(&path).expect("rm");
        let again = Ledger::create(&path, &geometry(), CREATOR_AGENT).expect("re-create");
        let mut lifted = *again.header();
        drop(again);
        lifted.devices[0].limit = 8 << 30;
        lifted.checksum = fnv1a(checksummed_bytes(&lifted));
        {
            use std::os::unix::fs::FileExt;
            let file = fs::OpenOptions::new().write(true).open(&path).expect("open");
            file.write_all_at(ledger::file::header_bytes(&lifted), 0).expect("write");
        }
        let mut restarted = Ledgers::new(dir.clone());
        let names = ["ns", "pod", "c", "uid"].map(String::from);
        restarted.set_pins(BTreeMap::from([(path.clone(), Pin { header: agents, names })]));
        restarted.scan();
        assert_eq!(restarted.skipped(), 0);
        assert!(restarted.header_change(&path).is_some_and(|c| c.contains("limit 67108864 -> 8589934592")));
        ledgers.set_pins(BTreeMap::new());
        assert!(ledgers.pinned(&path).is_none());
        fs::remove_dir_all(&dir).expect("cleanup");
    }
}
