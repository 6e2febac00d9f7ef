//! The size cap on what a provisioned container can write: each provisioned ledger directory
//! (`<ledger-dir>/<container id>/`) is a tmpfs of its own, mounted by the agent before it
//! creates the ledger in it, sized to the ledger (its size rounded up to pages) with room for
//! four inodes. The container gets the ledger file alone (read-write), so whatever it does to
//! that file lands in that tmpfs: a `write` or `fallocate` past the size fails with `ENOSPC`;
//! an `ftruncate` that extends the file succeeds (tmpfs files are sparse and cannot be sealed)
//! but allocates nothing, and every store into the extended range then fails (`ENOSPC`, or
//! `SIGBUS` through a mapping). The node's disk is never touched; the memory is the ledger's
//! size, charged to the agent's memory cgroup (it allocates every page when it creates the
//! ledger: the free-record list spans the records, the rest is `fallocate`d).
//!
//! The runtime resolves the ledger's host path in the host's mount namespace, so the tmpfs
//! must be mounted there: with `--ledger-mount-namespace` (the DaemonSet passes
//! `/proc/1/ns/mnt`, its pod has hostPID), mounts and unmounts run on a thread of their own
//! that enters that namespace (`unshare(CLONE_FS)` then `setns`), and the agent sees the
//! mount through its volume's `HostToContainer` propagation; without it, in the agent's own
//! (a plain root process on the host). Mounts are recognized by their source name
//! ([`SOURCE`]); those of containers that are gone are unmounted when they are removed and,
//! for what a crash left, when the agent starts ([`Mounter::ours`]).
use std::{
    ffi::CString,
    os::{fd::AsRawFd as _, unix::ffi::OsStrExt as _},
    path::{Path, PathBuf},
};

/// The source name of every ledger tmpfs (how the agent tells its mounts from others).
pub const SOURCE: &str = "vramguard-ledger";

/// Inodes in one ledger tmpfs: its root, the ledger, and the ledger's temporary name while
/// it is created (the same inode), with one to spare.
const INODES: u32 = 4;

const PAGE: u64 = 4096;

/// Where and how ledger directories are mounted.
#[derive(Clone, Debug, Default)]
pub struct Mounter {
    /// The mount namespace to mount in (`None`: the agent's own).
    namespace: Option<PathBuf>,
}

impl Mounter {
    /// A mounter for `namespace` (a `/proc/<pid>/ns/mnt` path), or the agent's own.
    pub fn new(namespace: Option<PathBuf>) -> Mounter {
        Mounter { namespace }
    }

    /// Mounts a tmpfs of `bytes` (rounded up to pages) at `dir`, an existing directory.
    pub fn mount(&self, dir: &Path, bytes: u64) -> Result<(), String> {
        let size = bytes.div_ceil(PAGE).max(1) * PAGE;
        let options = format!("size={size},nr_inodes={INODES},mode=0755,huge=never");
        let target = c_path(dir)?;
        let (source, fstype, data) = (c_str(SOURCE)?, c_str("tmpfs")?, c_str(&options)?);
        let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        self.in_namespace(move || {
            // SAFETY: every pointer is a NUL-terminated string that lives across the call.
            let rc = unsafe { libc::mount(source.as_ptr(), target.as_ptr(), fstype.as_ptr(), flags, data.as_ptr().cast()) };
            if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
        })
        .map_err(|e| format!("cannot mount a tmpfs of {size} bytes at {}: {e}", dir.display()))
    }

    /// Unmounts the tmpfs at `dir` (lazily: a container that still has its ledger keeps it
    /// until its own mount goes); `dir` not being a mount point is not an error. Whether
    /// something was unmounted.
    pub fn unmount(&self, dir: &Path) -> Result<bool, String> {
        let target = c_path(dir)?;
        let result = self.in_namespace(move || {
            // SAFETY: a NUL-terminated path that lives across the call.
            let rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) };
            if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
        });
        match result {
            Ok(()) => Ok(true),
            // Not a mount point (EINVAL), or gone (ENOENT).
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => Ok(false),
            Err(e) => Err(format!("cannot unmount {}: {e}", dir.display())),
        }
    }

    /// The ledger tmpfs mounts directly under `ledger_dir`, as the agent sees them (its own
    /// mount table; the namespace's, through propagation, in the DaemonSet).
    pub fn ours(&self, ledger_dir: &Path) -> Vec<PathBuf> {
        match std::fs::read_to_string("/proc/self/mountinfo") {
            Ok(table) => mounts_under(&table, ledger_dir),
            Err(_) => Vec::new(),
        }
    }

    /// Runs `act` in the mount namespace: on this thread for the agent's own, on a thread of
    /// its own (which ends with it) for another.
    fn in_namespace<F>(&self, act: F) -> std::io::Result<()>
    where
        F: FnOnce() -> std::io::Result<()> + Send + 'static,
    {
        let Some(namespace) = self.namespace.clone() else { return act() };
        let thread = std::thread::Builder::new().name("vramguard-mount".into()).spawn(move || {
            let ns = std::fs::File::open(&namespace)?;
            // SAFETY: unshare(2) with a flag: this thread gets a filesystem context of its own,
            // which setns(2) into a mount namespace requires.
            if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: setns(2) on an open descriptor of a mount namespace; only this thread
            // (which ends after `act`) moves.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            act()
        })?;
        thread.join().unwrap_or_else(|_| Err(std::io::Error::other("the mount thread panicked")))
    }
}

/// The mount points of [`SOURCE`] tmpfs mounts directly under `dir` in a mountinfo `table`.
pub fn mounts_under(table: &str, dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = table
        .lines()
        .filter_map(|line| {
            // "<id> <parent> <maj:min> <root> <mount point> <options> [optional...] - <fstype> <source> <super options>"
            let (before, after) = line.split_once(" - ")?;
            let point = unescape(before.split(' ').nth(4)?);
            let mut rest = after.split(' ');
            let (fstype, source) = (rest.next()?, rest.next()?);
            (fstype == "tmpfs" && source == SOURCE && point.parent() == Some(dir)).then_some(point)
        })
        .collect();
    found.sort();
    found.dedup();
    found
}

/// A mountinfo path: `\ooo` octal escapes (space, tab, newline, backslash) decoded.
fn unescape(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') << 6 | (d[1] - b'0') << 3 | (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(out))
}

fn c_path(path: &Path) -> Result<CString, String> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| format!("{} has a NUL byte", path.display()))
}

fn c_str(text: &str) -> Result<CString, String> {
    CString::new(text).map_err(|_| format!("{text:?} has a NUL byte"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_mounts_are_found_by_source_and_place() {
        let table = "\
36 25 0:31 / /var/lib/vramguard/ledgers/abc rw,nosuid - tmpfs vramguard-ledger rw,size=8192k
37 25 0:32 / /var/lib/vramguard/ledgers/a\\040b rw shared:5 - tmpfs vramguard-ledger rw
38 25 0:33 / /var/lib/vramguard/ledgers/other rw - tmpfs tmpfs rw
39 25 0:34 / /var/lib/vramguard/ledgers/x/deeper rw - tmpfs vramguard-ledger rw
40 25 0:35 / /elsewhere/abc rw - tmpfs vramguard-ledger rw
41 25 0:36 / /var/lib/vramguard/ledgers/ext rw - ext4 vramguard-ledger rw
";
        let dir = Path::new("/var/lib/vramguard/ledgers");
        assert_eq!(mounts_under(table, dir), [dir.join("a b"), dir.join("abc")]);
    }

    /// Through a namespace path (here the agent's own, entered by the mount thread), as the
    /// DaemonSet's `/proc/1/ns/mnt`: mounted, seen, unmounted.
    #[test]
    fn mounts_through_a_namespace_path() {
        let root = std::env::temp_dir().join(format!("vramguard-mount-ns-{}", std::process::id()));
        let dir = root.join("c1");
        std::fs::create_dir_all(&dir).expect("mkdir");
        let mounter = Mounter::new(Some(PathBuf::from("/proc/self/ns/mnt")));
        mounter.mount(&dir, 10_000).expect("mount");
        assert_eq!(mounter.ours(&root), std::slice::from_ref(&dir));
        let free = nix::sys::statvfs::statvfs(&dir).expect("statvfs");
        assert_eq!(free.blocks() as u64 * free.fragment_size() as u64, 12_288, "rounded up to pages");
        assert_eq!(mounter.unmount(&dir), Ok(true));
        assert_eq!(mounter.unmount(&dir), Ok(false), "not mounted: fine");
        assert!(mounter.ours(&root).is_empty());
        std::fs::remove_dir_all(&root).expect("cleanup");
    }
}
