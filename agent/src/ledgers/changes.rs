//! Whether `--ledger-dir` must be listed again: inotify on the directory and on each of its
//! subdirectories (files created, deleted, moved in or out, closed after writing; the
//! directory itself removed or moved) says something changed since the last listing; without
//! a change, a scan reuses the last listing ([`super::Ledgers::scan`] still reads every
//! watched ledger's header and pinned ledgers are still looked up at their paths).
//!
//! The directories belong to the workloads: a workload that keeps changing its own makes the
//! agent list at every scan, as it did before inotify, never more. What inotify cannot say is
//! covered by a full listing every [`RESCAN`] whatever it says: a skipped file rewritten
//! through a mapping (no event) is looked at again by then, and a subdirectory that could not
//! be watched (the kernel's watch limit, a race with its removal) makes every scan list until
//! one can (logged once while it lasts). A file made in a new subdirectory before its watch
//! was added is found by the listing at the next scan (a newly watched subdirectory asks for
//! one). Listings are counted by why (`vramguard_ledger_dir_listings_total{why}`: `first`,
//! `changed`, `rescan`, `unwatched`: no inotify, or a subdirectory not watched).
use std::{
    collections::{BTreeMap, HashMap},
    ffi::CString,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use tracing::warn;

use super::directory::FileKey;

/// A full listing at least this often, whatever inotify says.
pub const RESCAN: Duration = Duration::from_secs(30);

/// What the watches report.
const MASK: u32 = libc::IN_CREATE
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_CLOSE_WRITE
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF
    | libc::IN_ONLYDIR
    | libc::IN_DONT_FOLLOW;

/// Reads of the inotify queue per scan at most (4 KiB each): a workload that floods events
/// costs a listing, not an unbounded drain.
const DRAINS: usize = 16;

/// Why a scan lists the directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    First,
    Changed,
    Rescan,
    /// No inotify (or a subdirectory not watched): every scan lists.
    Unwatched,
}

impl Why {
    pub const ALL: [Why; 4] = [Why::First, Why::Changed, Why::Rescan, Why::Unwatched];

    pub fn label(self) -> &'static str {
        match self {
            Why::First => "first",
            Why::Changed => "changed",
            Why::Rescan => "rescan",
            Why::Unwatched => "unwatched",
        }
    }
}

/// The last listing and the watches that say whether it still holds.
pub(super) struct Listing {
    inotify: Option<OwnedFd>,
    /// Watched subdirectories, by path.
    watched: HashMap<PathBuf, i32>,
    /// The last listing: the candidates and the crowded directories.
    pub(super) last: Option<(BTreeMap<PathBuf, FileKey>, BTreeMap<PathBuf, String>)>,
    listed_at: Instant,
    /// List again at the next scan (a subdirectory newly watched).
    again: bool,
    /// A subdirectory could not be watched at the last listing (the kernel's watch limit, a
    /// race with its removal): every scan lists, as [`Why::Unwatched`], until one can.
    unwatched: bool,
    /// Listings made, by [`Why`] (in [`Why::ALL`]'s order).
    pub(super) counts: [u64; 4],
}

impl Listing {
    /// Watches `dir` (without inotify, every scan lists).
    pub(super) fn new(dir: &Path) -> Listing {
        // SAFETY: inotify_init1(2) takes flags and returns a new descriptor or -1.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        // SAFETY: `fd` is a descriptor inotify_init1 just returned, owned by nothing else.
        let inotify = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) });
        let inotify = inotify.filter(|inotify| add_watch(inotify, dir).is_ok());
        Listing { inotify, watched: HashMap::new(), last: None, listed_at: Instant::now(), again: false, unwatched: false, counts: [0; 4] }
    }

    /// Whether the directory must be listed now, and why.
    pub(super) fn due(&mut self) -> Option<Why> {
        let why = if let Some(inotify) = &self.inotify {
            let changed = drain(inotify);
            if self.last.is_none() {
                Some(Why::First)
            } else if self.unwatched {
                Some(Why::Unwatched)
            } else if changed || self.again {
                Some(Why::Changed)
            } else if self.listed_at.elapsed() >= RESCAN {
                Some(Why::Rescan)
            } else {
                None
            }
        } else {
            Some(Why::Unwatched)
        };
        if let Some(why) = why {
            self.counts[Why::ALL.iter().position(|w| *w == why).unwrap_or(0)] += 1;
        }
        why
    }

    /// Keeps `listed` (`None`: the listing failed, list again next time) and watches the
    /// subdirectories it found (`subdirs`), no longer the others.
    pub(super) fn listed(&mut self, listed: Option<(BTreeMap<PathBuf, FileKey>, BTreeMap<PathBuf, String>)>, subdirs: &[PathBuf]) {
        self.listed_at = Instant::now();
        self.again = false;
        let was_unwatched = std::mem::take(&mut self.unwatched);
        let Some(inotify) = &self.inotify else { return };
        self.last = listed;
        self.watched.retain(|path, wd| {
            let keep = subdirs.contains(path);
            if !keep {
                // SAFETY: inotify_rm_watch(2) takes two integers; a watch the kernel already
                // dropped (its directory removed) gives EINVAL, nothing else.
                unsafe { libc::inotify_rm_watch(inotify.as_raw_fd(), *wd) };
            }
            keep
        });
        for path in subdirs {
            if self.watched.contains_key(path) {
                continue;
            }
            // Whatever was made there before the watch is found by the next listing.
            self.again = true;
            match add_watch(inotify, path) {
                Ok(wd) => {
                    self.watched.insert(path.clone(), wd);
                }
                Err(error) => {
                    if !was_unwatched && !self.unwatched {
                        warn!(dir = %path.display(), %error, "cannot watch a ledger subdirectory with inotify: every scan lists the ledger directory until it can (said once while it lasts)");
                    }
                    self.unwatched = true;
                }
            }
        }
    }
}

/// Watches `path` (a directory, not followed if a link); the watch descriptor.
fn add_watch(inotify: &OwnedFd, path: &Path) -> std::io::Result<i32> {
    let path = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: inotify_add_watch(2) reads the NUL-terminated path, which lives across the call.
    let wd = unsafe { libc::inotify_add_watch(inotify.as_raw_fd(), path.as_ptr(), MASK) };
    if wd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(wd)
}

/// Empties the inotify queue (at most [`DRAINS`] reads); whether it held anything (or could
/// not be read).
fn drain(inotify: &OwnedFd) -> bool {
    let mut buffer = [0u8; 4096];
    let mut changed = false;
    for _ in 0..DRAINS {
        // SAFETY: read(2) writes at most `buffer.len()` bytes into `buffer`, which lives
        // across the call.
        let read = unsafe { libc::read(inotify.as_raw_fd(), buffer.as_mut_ptr().cast(), buffer.len()) };
        if read > 0 {
            changed = true;
            continue;
        }
        let again = read < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN);
        return changed || !again;
    }
    true
}
