//! Cgroup v2 membership and paths, as the per-cgroup memory limits ([`crate::limits`]) need
//! them.
//!
//! A cgroup is named by its path relative to the cgroup2 hierarchy's root (`/a/b/c`; `/` is
//! the root), and keyed by the FNV-1a hash of that text ([`key`]): the key is what a device
//! slot records of its process ([`crate::devfile`]). A process's own cgroup is the `0::<path>`
//! line of `/proc/self/cgroup`. A `nameSpace` handed to NVML is a directory path: it becomes
//! a relative path by stripping the cgroup2 mount point it lies under, as
//! `/proc/self/mountinfo` lists it (and prefixing that mount's root within the hierarchy).
//! Containers on the hybrid hosts the tests run on have no cgroup namespace, so the paths
//! are the host's everywhere.

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

/// FNV-1a (64-bit) of `bytes`, starting from the offset basis XORed with `seed`.
pub fn fnv1a(seed: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325u64 ^ seed, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The key of the cgroup at `rel` (a path relative to the cgroup2 root). Never 0, which
/// stands for "no cgroup2 membership known".
pub fn key(rel: &str) -> u64 {
    fnv1a(0, rel.bytes()).max(1)
}

/// The calling process's cgroup2 path (`0::<path>` of `/proc/self/cgroup`), if it has one.
pub fn own_path() -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|l| l.strip_prefix("0::")).map(str::to_owned)
}

/// The calling process's cgroup key; 0 when it has no cgroup2 membership (no limit can
/// apply to it).
pub fn own_key() -> u64 {
    own_path().map_or(0, |p| key(&p))
}

/// One cgroup2 mount of this process's mount namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Where it is mounted.
    pub point: PathBuf,
    /// The directory of the hierarchy mounted there (`/` for the whole of it).
    pub root: String,
}

/// Undoes mountinfo's octal escapes (`\040` for a space, and so on).
fn unescape(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8).wrapping_add(c - b'0')));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    out
}

/// The cgroup2 mounts listed in a mountinfo text.
pub fn parse_mounts(mountinfo: &str) -> Vec<Mount> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            if right.split_whitespace().next()? != "cgroup2" {
                return None;
            }
            let mut fields = left.split_whitespace();
            let root = String::from_utf8(unescape(fields.nth(3)?)).ok()?;
            let point = PathBuf::from(std::ffi::OsStr::from_bytes(&unescape(fields.next()?)));
            Some(Mount { point, root })
        })
        .collect()
}

/// This process's cgroup2 mounts (none when `/proc/self/mountinfo` cannot be read).
pub fn mounts() -> Vec<Mount> {
    std::fs::read_to_string("/proc/self/mountinfo").map(|t| parse_mounts(&t)).unwrap_or_default()
}

/// `root` joined with the normal components of `rest`, as a cgroup path (`/` alone for none).
fn join_rel(root: &str, rest: &Path) -> String {
    let mut rel = root.trim_end_matches('/').to_owned();
    for c in rest.components() {
        if let Component::Normal(part) = c {
            rel.push('/');
            rel.push_str(&part.to_string_lossy());
        }
    }
    if rel.is_empty() {
        rel.push('/');
    }
    rel
}

/// A cgroup directory found from a `nameSpace`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Its path relative to the cgroup2 root.
    pub rel: String,
    /// The inode of its directory: the cgroup's id, which a cgroup made again at the same
    /// path does not share.
    pub id: u64,
}

/// Resolves `name_space` (a directory path) to a live cgroup: it must exist, be a directory
/// on a cgroup2 file system, and lie under one of `mounts`. `None` otherwise (NVML's
/// "the cgroup path cannot be opened").
pub fn resolve(name_space: &Path, mounts: &[Mount]) -> Option<Found> {
    let path = std::fs::canonicalize(name_space).ok()?;
    let meta = std::fs::metadata(&path).ok()?;
    if !meta.is_dir() || !is_cgroup2(&path) {
        return None;
    }
    let (mount, rest) = mounts
        .iter()
        .filter_map(|m| Some((m, path.strip_prefix(&m.point).ok()?)))
        .max_by_key(|(m, _)| m.point.as_os_str().len())?;
    Some(Found { rel: join_rel(&mount.root, rest), id: meta.ino() })
}

/// Whether `path` lies on a cgroup2 file system.
fn is_cgroup2(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return false };
    // SAFETY: an all-zero statfs is a valid value for the kernel to overwrite.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid statfs pointer.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_type == libc::CGROUP2_SUPER_MAGIC
}

/// What this process can tell of the cgroup at a relative path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Its directory exists, with this id (inode).
    Id(u64),
    /// No directory: the cgroup was removed.
    Gone,
    /// No cgroup2 mount of this process shows it: it cannot tell.
    Unseen,
}

/// Looks the cgroup at `rel` up through the first of `mounts` whose root holds it.
pub fn seen(rel: &str, mounts: &[Mount]) -> Seen {
    let dir = mounts.iter().find_map(|m| {
        let root = m.root.trim_end_matches('/');
        let rest = rel.strip_prefix(root).filter(|r| r.is_empty() || r.starts_with('/'))?;
        Some(m.point.join(rest.trim_start_matches('/')))
    });
    match dir.map(std::fs::metadata) {
        None => Seen::Unseen,
        Some(Ok(meta)) if meta.is_dir() => Seen::Id(meta.ino()),
        Some(_) => Seen::Gone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_and_paths() {
        let info = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                    41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n\
                    52 31 0:38 /a\\040b /mnt/cg\\040x rw shared:9 - cgroup2 cgroup2 rw\n\
                    35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory";
        let mounts = parse_mounts(info);
        assert_eq!(
            mounts,
            vec![
                Mount { point: "/sys/fs/cgroup/unified".into(), root: "/".into() },
                Mount { point: "/mnt/cg x".into(), root: "/a b".into() },
            ]
        );
        assert_eq!(join_rel("/", Path::new("")), "/");
        assert_eq!(join_rel("/", Path::new("x/y")), "/x/y");
        assert_eq!(join_rel("/a b", Path::new("c")), "/a b/c");
        assert_ne!(key("/x"), key("/x/"));
        assert_eq!(key("/x"), fnv1a(0, *b"/x"));
        assert_eq!(fnv1a(0, []), 0xcbf2_9ce4_8422_2325);
    }

    #[test]
    fn resolves_real_cgroups_and_refuses_others() {
        let mounts = mounts();
        // A directory that is no cgroup, and one that does not exist.
        assert_eq!(resolve(Path::new("/tmp"), &mounts), None);
        assert_eq!(resolve(Path::new("/no/such/cgroup"), &mounts), None);
        let Some(m) = mounts.iter().find(|m| m.root == "/") else { return };
        let root = resolve(&m.point, &mounts).expect("the cgroup2 root");
        assert_eq!(root.rel, "/");
        assert_eq!(seen("/", &mounts), Seen::Id(root.id));
        assert_eq!(seen("/fakecuda-no-such-cgroup", &mounts), Seen::Gone);
        assert_eq!(seen("/x", &[]), Seen::Unseen);
        if let Some(own) = own_path() {
            let dir = m.point.join(own.trim_start_matches('/'));
            assert_eq!(resolve(&dir, &mounts).map(|f| f.rel), Some(own));
        }
    }
}
