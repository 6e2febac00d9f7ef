//! Naming cgroups: the eBPF side knows a cgroup by its id (`bpf_get_current_cgroup_id`, the
//! inode number of its cgroup2 directory); people know it by its path. This module finds the
//! cgroup2 mount and turns ids into paths relative to the cgroup2 root.
//!
//! Walking the tree costs a `stat` and a `readdir` per cgroup, so it is walked on change,
//! not on a timer: a [`CgroupNames`] with a [`TreeWatch`] (the kernel's count of the tree's
//! changes, kept by the `cgroup_mkdir`, `cgroup_rmdir` and `cgroup_rename` tracepoints) walks
//! only when the count moved since its last walk; then once more at its next look at least
//! [`SETTLE`] later (the mkdir tracepoint fires just before the new directory shows in its
//! parent); and once every [`SAFETY_WALK`] whatever the count says. A walk during which the
//! count moved is walked again (a rename can hide a directory from a walk). Without a watch
//! (a kernel without those tracepoints) it walks whenever it is asked, as it always did.
use std::{
    collections::HashMap,
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

/// How long after a walk that followed a change the tree is walked once more.
pub const SETTLE: Duration = Duration::from_millis(50);
/// The longest a watched tree goes unwalked (a slow safety net; nothing is known to need it).
pub const SAFETY_WALK: Duration = Duration::from_secs(600);

/// The count of the cgroup2 tree's changes, shared by every [`CgroupNames`] of the agent, and
/// the count of their walks. The default watches nothing: its names walk whenever asked.
#[derive(Clone, Default)]
pub struct TreeWatch(Arc<Watch>);

type Changes = Box<dyn Fn() -> Option<u64> + Send + Sync>;

#[derive(Default)]
struct Watch {
    /// The tree's change count now (`None`: unknown, walk).
    changes: Option<Changes>,
    /// Walks of the tree, by every `CgroupNames` sharing the watch.
    walks: AtomicU64,
}

impl TreeWatch {
    /// A watch that reads the tree's change count with `changes`.
    pub fn new(changes: impl Fn() -> Option<u64> + Send + Sync + 'static) -> TreeWatch {
        TreeWatch(Arc::new(Watch { changes: Some(Box::new(changes)), walks: AtomicU64::new(0) }))
    }

    /// Whether the tree's changes are counted (else the names walk whenever asked).
    pub fn is_watching(&self) -> bool {
        self.0.changes.is_some()
    }

    /// Walks of the tree so far.
    pub fn walks(&self) -> u64 {
        self.0.walks.load(Ordering::Relaxed)
    }

    /// The tree's change count now, if it is counted.
    pub fn changes(&self) -> Option<u64> {
        self.0.changes.as_ref().and_then(|changes| changes())
    }
}

/// Resolves cgroup ids to paths, caching what it walked.
pub struct CgroupNames {
    root: Option<PathBuf>,
    known: HashMap<u64, String>,
    watch: TreeWatch,
    /// The change count `known` was walked at, when, and whether it was walked again since
    /// (settled); `None`: walk at the next look.
    walked: Option<(u64, Instant, bool)>,
}

impl Default for CgroupNames {
    fn default() -> Self {
        Self::new()
    }
}

impl CgroupNames {
    /// Names that walk the tree whenever asked.
    pub fn new() -> Self {
        Self::watched(TreeWatch::default())
    }

    /// Names that walk the tree only when `watch` says it changed (see the module doc).
    pub fn watched(watch: TreeWatch) -> Self {
        CgroupNames { root: cgroup2_mount(), known: HashMap::new(), watch, walked: None }
    }

    /// The path (`/kubepods.slice/...`, `/` for the root) of cgroup `id`, or `None` if no
    /// cgroup has that id now.
    pub fn path(&mut self, id: u64) -> Option<String> {
        if let Some(path) = self.known.get(&id) {
            return Some(path.clone());
        }
        self.refresh();
        self.known.get(&id).cloned()
    }

    /// What says when the tree changed, and counts the walks.
    pub fn watch(&self) -> &TreeWatch {
        &self.watch
    }

    /// The tree's change count now, if it is watched.
    pub fn tree_changes(&self) -> Option<u64> {
        self.watch.changes()
    }

    /// The cgroups found by the last walk ([`CgroupNames::all`]).
    pub fn known(&self) -> &HashMap<u64, String> {
        &self.known
    }

    /// Every cgroup now: id -> path (walks the tree if it may have changed).
    pub fn all(&mut self) -> &HashMap<u64, String> {
        self.refresh();
        &self.known
    }

    /// Walks the tree unless it is watched and known unchanged since the last walk; whether
    /// it walked.
    fn refresh(&mut self) -> bool {
        let Some(root) = self.root.clone() else { return false };
        let now = self.watch.changes();
        if let (Some(now), Some((count, at, settled))) = (now, self.walked) {
            let age = at.elapsed();
            if now == count && age < SAFETY_WALK && (settled || age < SETTLE) {
                return false;
            }
            if now == count && !settled {
                // The walk after a change, confirmed.
                self.walk(&root);
                self.walked = Some((count, Instant::now(), true));
                return true;
            }
        }
        // Walked again while the count moves under the walk (at most three times; a walk that
        // saw the count move leaves `walked` at the count before it, so the next look walks).
        for _ in 0..3 {
            let before = self.watch.changes();
            self.walk(&root);
            self.walked = before.map(|count| (count, Instant::now(), false));
            if self.watch.changes() == before {
                break;
            }
        }
        true
    }

    fn walk(&mut self, root: &Path) {
        self.known.clear();
        walk(root, root, &mut self.known);
        self.watch.0.walks.fetch_add(1, Ordering::Relaxed);
    }
}

fn walk(root: &Path, dir: &Path, known: &mut HashMap<u64, String>) {
    let Ok(metadata) = fs::metadata(dir) else { return };
    let relative = dir.strip_prefix(root).map(|p| format!("/{}", p.display())).unwrap_or_default();
    known.insert(metadata.ino(), relative);
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            walk(root, &entry.path(), known);
        }
    }
}

/// The cgroup id (cgroup2 directory inode) of host process `pid`, from the `0::` line of
/// `/proc/<pid>/cgroup`.
pub fn id_of_pid(pid: u32) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let path = text.lines().find_map(|line| line.strip_prefix("0::"))?;
    let root = cgroup2_mount()?;
    fs::metadata(root.join(path.trim_start_matches('/'))).ok().map(|m| m.ino())
}

/// Where the cgroup2 hierarchy is mounted: `/sys/fs/cgroup` on pure v2 hosts,
/// `/sys/fs/cgroup/unified` on hybrid ones. Read from /proc/self/mountinfo once (a cgroup2
/// mount does not move under a running agent).
pub fn cgroup2_mount() -> Option<PathBuf> {
    static MOUNT: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    MOUNT.get_or_init(find_cgroup2_mount).clone()
}

fn find_cgroup2_mount() -> Option<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        // id parent major:minor root mount-point options ... - fstype source super-options
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_whitespace().next()?;
        let mount_point = left.split_whitespace().nth(4)?;
        (fstype == "cgroup2").then(|| PathBuf::from(mount_point))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watched_tree_is_walked_when_it_changed_and_once_more_to_settle_never_while_unchanged() {
        if cgroup2_mount().is_none() {
            return;
        }
        let count = Arc::new(AtomicU64::new(7));
        let seen = count.clone();
        let watch = TreeWatch::new(move || Some(seen.load(Ordering::Relaxed)));
        let mut names = CgroupNames::watched(watch.clone());
        assert!(!names.all().is_empty());
        assert_eq!(watch.walks(), 1, "the first look walks");
        // Unchanged: no walk, not even for an id no cgroup has.
        assert_eq!(names.path(u64::MAX), None);
        let _ = names.all();
        assert_eq!(watch.walks(), 1);
        // Once more, a settle's time after the walk that followed a change; then never.
        std::thread::sleep(SETTLE);
        let _ = names.all();
        assert_eq!(watch.walks(), 2, "the settling walk");
        for _ in 0..10 {
            let _ = names.all();
            assert_eq!(names.path(u64::MAX), None);
        }
        assert_eq!(watch.walks(), 2, "nothing walked while the tree is unchanged");
        // A change: walked at the next look.
        count.fetch_add(1, Ordering::Relaxed);
        assert_eq!(names.path(u64::MAX), None);
        assert_eq!(watch.walks(), 3);
        // Unwatched names walk whenever asked.
        let mut unwatched = CgroupNames::new();
        let _ = unwatched.all();
        let _ = unwatched.all();
        assert_eq!(unwatched.watch().walks(), 2);
    }
}
