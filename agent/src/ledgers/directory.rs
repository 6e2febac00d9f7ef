//! Listing and opening what is under `--ledger-dir` without following anything a workload
//! put there: directories and files opened with `openat2` beneath the root and no symbolic
//! links, at most [`MAX_ENTRIES`] entries of a directory read, at most `max_per_dir` files of
//! one considered.
use std::{
    collections::BTreeMap,
    fs::{self, File},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
    path::{Path, PathBuf},
};

use nix::{
    fcntl::{openat2, OFlag, OpenHow, ResolveFlag},
    sys::stat::Mode,
};

use super::Limits;

/// Most directory entries read from one directory per scan (a workload can fill its own).
pub const MAX_ENTRIES: usize = 256;

/// Tells a file apart from the one that was at the same path before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FileKey {
    pub(super) dev: u64,
    pub(super) ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl FileKey {
    pub(super) fn of(metadata: &fs::Metadata) -> FileKey {
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
    pub(super) fn same_inode(&self, other: &FileKey) -> bool {
        self.dev == other.dev && self.ino == other.ino
    }
}

/// Opens `path` (under `root`) read-write, resolved beneath `root` without following any
/// symbolic link, and without blocking on a FIFO.
pub(super) fn open_beneath(root: &Path, path: &Path) -> std::io::Result<File> {
    let relative = path.strip_prefix(root).map_err(|_| std::io::Error::other("not under the ledger directory"))?;
    let root = File::open(root)?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDWR | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY)
        .mode(Mode::empty())
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd = openat2(root.as_raw_fd(), relative, how).map_err(std::io::Error::from)?;
    // SAFETY: openat2 returned a new descriptor that nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The key of the regular file at `path` (under `root`), looked up directly, resolved beneath
/// `root` without following any link and without opening the file itself (`O_PATH`); `None`
/// if there is no regular file there.
pub(super) fn key_beneath(root: &Path, path: &Path) -> Option<FileKey> {
    let relative = path.strip_prefix(root).ok()?;
    let root = File::open(root).ok()?;
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd = openat2(root.as_raw_fd(), relative, how).ok()?;
    // SAFETY: openat2 returned a new descriptor that nothing else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let stat = nix::sys::stat::fstat(file.as_raw_fd()).ok()?;
    (stat.st_mode & libc::S_IFMT == libc::S_IFREG).then(|| FileKey::from_stat(&stat))
}

/// Regular files (not hidden, not links) in `dir` and its direct subdirectories, at most
/// `limits.max_per_dir` a directory; the directories that held more (with what); and the
/// subdirectories listed.
#[allow(clippy::type_complexity)]
pub(super) fn candidates(dir: &Path, limits: &Limits) -> std::io::Result<(BTreeMap<PathBuf, FileKey>, BTreeMap<PathBuf, String>, Vec<PathBuf>)> {
    let mut found = BTreeMap::new();
    let mut crowded = BTreeMap::new();
    let root = File::open(dir)?;
    let (files, subdirs) = list(&root, dir, limits, &mut crowded)?;
    found.extend(files);
    let mut listed = Vec::with_capacity(subdirs.len());
    for name in subdirs {
        // Opened beneath the root without following links: a directory swapped for a link
        // between the listing and now is not entered.
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        let Ok(fd) = openat2(root.as_raw_fd(), name.as_os_str(), how) else { continue };
        // SAFETY: openat2 returned a new descriptor that nothing else owns.
        let sub = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        // A directory that vanished or cannot be read holds no ledger for now.
        if let Ok((files, _)) = list(&sub, &dir.join(&name), limits, &mut crowded) {
            found.extend(files);
        }
        listed.push(dir.join(&name));
    }
    Ok((found, crowded, listed))
}

/// The regular files (at most `limits.max_per_dir`) and subdirectory names of the directory
/// open as `handle` (at `path`), reading at most [`MAX_ENTRIES`] entries.
#[allow(clippy::type_complexity)]
fn list(
    handle: &File,
    path: &Path,
    limits: &Limits,
    crowded: &mut BTreeMap<PathBuf, String>,
) -> std::io::Result<(Vec<(PathBuf, FileKey)>, Vec<std::ffi::OsString>)> {
    use std::os::unix::ffi::OsStrExt;
    let fd = nix::unistd::dup(handle.as_raw_fd()).map_err(std::io::Error::from)?;
    let mut entries = nix::dir::Dir::from_fd(fd).map_err(std::io::Error::from)?;
    let (mut files, mut dirs) = (Vec::new(), Vec::new());
    let mut read = 0;
    for entry in entries.iter() {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        // Hidden entries count too: a directory a workload fills with them is not read whole.
        read += 1;
        if read > MAX_ENTRIES {
            crowded.insert(path.to_path_buf(), format!("more than {MAX_ENTRIES} entries"));
            break;
        }
        if name.first() == Some(&b'.') {
            continue;
        }
        let name = std::ffi::OsStr::from_bytes(name).to_os_string();
        // Of the entry itself, never of what a link points at.
        let Ok(stat) = nix::sys::stat::fstatat(Some(handle.as_raw_fd()), name.as_os_str(), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) else {
            continue;
        };
        match stat.st_mode & libc::S_IFMT {
            libc::S_IFREG if files.len() < limits.max_per_dir => files.push((path.join(&name), FileKey::from_stat(&stat))),
            libc::S_IFREG => {
                crowded.insert(path.to_path_buf(), format!("more than {} files (--max-ledgers-per-dir)", limits.max_per_dir));
            }
            libc::S_IFDIR => dirs.push(name),
            _ => {}
        }
    }
    Ok((files, dirs))
}

impl FileKey {
    fn from_stat(stat: &nix::sys::stat::FileStat) -> FileKey {
        FileKey {
            dev: stat.st_dev,
            ino: stat.st_ino,
            len: stat.st_size as u64,
            mtime: stat.st_mtime,
            mtime_nsec: stat.st_mtime_nsec,
        }
    }
}
