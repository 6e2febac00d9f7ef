//! Naming cgroups: the eBPF side knows a cgroup by its id (`bpf_get_current_cgroup_id`, the
//! inode number of its cgroup2 directory); people know it by its path. This module finds the
//! cgroup2 mount and turns ids into paths relative to the cgroup2 root.
use std::{
    collections::HashMap,
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

/// Resolves cgroup ids to paths, caching what it walked.
pub struct CgroupNames {
    root: Option<PathBuf>,
    known: HashMap<u64, String>,
}

impl Default for CgroupNames {
    fn default() -> Self {
        Self::new()
    }
}

impl CgroupNames {
    pub fn new() -> Self {
        CgroupNames { root: cgroup2_mount(), known: HashMap::new() }
    }

    /// The path (`/kubepods.slice/...`, `/` for the root) of cgroup `id`, or `None` if no
    /// cgroup has that id now.
    pub fn path(&mut self, id: u64) -> Option<String> {
        if let Some(path) = self.known.get(&id) {
            return Some(path.clone());
        }
        let root = self.root.clone()?;
        self.known.clear();
        walk(&root, &root, &mut self.known);
        self.known.get(&id).cloned()
    }

    /// The cgroups found by the last walk ([`CgroupNames::all`]).
    pub fn known(&self) -> &HashMap<u64, String> {
        &self.known
    }

    /// Every cgroup now: id -> path (walks the whole tree).
    pub fn all(&mut self) -> &HashMap<u64, String> {
        self.known.clear();
        if let Some(root) = self.root.clone() {
            walk(&root, &root, &mut self.known);
        }
        &self.known
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
