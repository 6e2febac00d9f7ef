//! Per-cgroup GPU memory limits, as drivers r615 and later keep them
//! (`nvmlDeviceSetMemoryLimits_v1` / `nvmlDeviceGetMemoryLimits_v1`, [`crate::nvml`]): the
//! machine-wide table of them, in one file per node, `<STATE_DIR>/<NODE>-limits`.
//!
//! The file is text, created complete like the device files
//! ([`crate::devfile::open_or_create_shared`]) but writable by its owner alone (0644: setting
//! limits needs root, as the real driver's do), read under `flock(LOCK_SH)` and rewritten in
//! place under `flock(LOCK_EX)`. Its first line is [`HEADER`]; then one line an entry, five
//! space-separated fields and the path, which may hold spaces and runs to the end of the line:
//!
//! ```text
//! fakecuda-limits 1
//! <key: 16 hex digits> <device index> <soft> <hard> <cgroup id> <path>
//! 9a3c41e07f22b815 0 0 1073741824 4242 /vramguard-test-x-1234-0
//! ```
//!
//! `path` is the cgroup's path relative to the cgroup2 root, `key` its FNV-1a hash
//! ([`crate::cgroup::key`]: what device slots record), `soft` and `hard` are bytes (`hard`
//! 18446744073709551615, `NVML_DEVICE_MEMORY_LIMIT_MAX`, is no hard limit), `cgroup id` the
//! inode of the cgroup's directory when the limits were set. There is at most one entry per
//! (key, device); setting soft 0 and hard MAX removes it.
//!
//! Removing a cgroup clears its limits, as the real driver's do: an entry counts only while a
//! directory at its path exists with its id, so a cgroup made again at the same path starts
//! without limits. (Entries of removed cgroups are dropped from the file at the next set.)
//!
//! Each set also records in every device file how many entries there are for its device
//! ([`crate::devfile::DeviceFile::set_limited`]), so that a process growing its memory on a
//! device no limit names does not read this file.
//!
//! Only the hard limit is enforced ([`crate::devfile::DeviceFile::recharge`]): an allocation
//! that would take the cgroup's use on the device past it fails with
//! `CUDA_ERROR_OUT_OF_MEMORY`. The soft limit ("guaranteed before allocations may fail due to
//! memory pressure", `nvml.h`) is kept and reported, nothing more: the fake has no memory
//! pressure to model. A hard limit below what the cgroup already holds takes nothing back;
//! its processes' growth fails until their use is under it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use cuda_abi::nvml::NVML_DEVICE_MEMORY_LIMIT_MAX;

use crate::cgroup::{self, Found, Mount, Seen};
use crate::devfile::{open_or_create_shared, OpenError};

/// The first line of a limits file (format version 1).
pub const HEADER: &str = "fakecuda-limits 1";

/// Path of node `node`'s limits file.
pub fn limits_path(dir: &Path, node: &str) -> PathBuf {
    dir.join(format!("{node}-limits"))
}

/// One cgroup's limits on one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: u64,
    pub dev: u32,
    pub soft: u64,
    pub hard: u64,
    /// The cgroup's id (its directory's inode) when the limits were set.
    pub id: u64,
    /// The cgroup's path relative to the cgroup2 root.
    pub rel: String,
}

/// Whether `soft` and `hard` say "no limit" (`nvml.h`: soft 0, hard MAX).
pub fn is_clear(soft: u64, hard: u64) -> bool {
    soft == 0 && hard == NVML_DEVICE_MEMORY_LIMIT_MAX
}

/// Parses a limits file's text; `None` when it is not one.
pub fn parse(text: &str) -> Option<Vec<Entry>> {
    let mut lines = text.lines();
    if lines.next()? != HEADER {
        return None;
    }
    lines
        .filter(|l| !l.is_empty())
        .map(|line| {
            let mut f = line.splitn(6, ' ');
            let key = f.next().filter(|k| k.len() == 16).and_then(|k| u64::from_str_radix(k, 16).ok())?;
            let mut num = || f.next()?.parse::<u64>().ok();
            let (dev, soft, hard, id) = (u32::try_from(num()?).ok()?, num()?, num()?, num()?);
            let rel = f.next().filter(|r| r.starts_with('/'))?.to_owned();
            Some(Entry { key, dev, soft, hard, id, rel })
        })
        .collect()
}

/// The text of a limits file holding `entries`.
pub fn format(entries: &[Entry]) -> String {
    let mut text = format!("{HEADER}\n");
    for e in entries {
        text.push_str(&format!("{:016x} {} {} {} {} {}\n", e.key, e.dev, e.soft, e.hard, e.id, e.rel));
    }
    text
}

/// Holds a `flock` on the limits file until dropped.
struct Flocked<'a>(&'a File);

impl Drop for Flocked<'_> {
    fn drop(&mut self) {
        // SAFETY: flock on a descriptor the borrowed file keeps open.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// A node's open limits file, with the cgroup2 mounts of the process that opened it.
pub struct LimitsFile {
    path: PathBuf,
    file: File,
    mounts: Vec<Mount>,
}

impl LimitsFile {
    /// Opens node `node`'s limits file, creating it empty if it does not exist yet.
    pub fn open_or_create(dir: &Path, node: &str) -> Result<LimitsFile, OpenError> {
        let path = limits_path(dir, node);
        let file = open_or_create_shared(&path, "limits file", 0o644, |f| f.write_all_at(format!("{HEADER}\n").as_bytes(), 0))?;
        let limits = LimitsFile { path, file, mounts: cgroup::mounts() };
        limits.entries().map_err(|e| OpenError { message: format!("fakecuda: {e}"), code: cuda_abi::CUDA_ERROR_OPERATING_SYSTEM })?;
        Ok(limits)
    }

    /// The cgroup2 mounts this process saw when it opened the file.
    pub fn mounts(&self) -> &[Mount] {
        &self.mounts
    }

    fn flock(&self, how: libc::c_int) -> io::Result<Flocked<'_>> {
        loop {
            // SAFETY: flock on a descriptor owned by `self.file`.
            if unsafe { libc::flock(self.file.as_raw_fd(), how) } == 0 {
                return Ok(Flocked(&self.file));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// The entries, read with the lock held by the caller.
    fn read(&self, _held: &Flocked<'_>) -> io::Result<Vec<Entry>> {
        let len = self.file.metadata()?.len();
        let mut buf = vec![0u8; usize::try_from(len).map_err(|_| io::ErrorKind::InvalidData)?];
        self.file.read_exact_at(&mut buf, 0)?;
        let text = String::from_utf8(buf).ok();
        text.as_deref().and_then(parse).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, format!("{} is not a valid limits file", self.path.display()))
        })
    }

    /// Every entry, live or not.
    pub fn entries(&self) -> io::Result<Vec<Entry>> {
        let held = self.flock(libc::LOCK_SH)?;
        self.read(&held)
    }

    /// Whether `e`'s cgroup is the one its limits were set on, as this process can tell
    /// (`Unseen`: it cannot, and the entry counts).
    fn live(&self, e: &Entry) -> bool {
        match cgroup::seen(&e.rel, &self.mounts) {
            Seen::Id(id) => id == e.id,
            Seen::Gone => false,
            Seen::Unseen => true,
        }
    }

    /// Sets (or with soft 0 and hard MAX, clears) the limits of cgroup `cg` on device `dev`.
    /// The caller has checked the values. Entries of removed cgroups go at the same time.
    /// `written` is given the entries the file then holds, with its lock still held (to mark
    /// the device files [`limited`](crate::devfile::DeviceFile::limited) in the same order
    /// as the sets).
    pub fn set(&self, cg: &Found, dev: u32, soft: u64, hard: u64, written: impl FnOnce(&[Entry])) -> io::Result<()> {
        if cg.rel.contains('\n') {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a cgroup path with a newline"));
        }
        let key = cgroup::key(&cg.rel);
        let held = self.flock(libc::LOCK_EX)?;
        let mut entries = self.read(&held)?;
        entries.retain(|e| !(e.key == key && e.dev == dev) && self.live(e));
        if !is_clear(soft, hard) {
            entries.push(Entry { key, dev, soft, hard, id: cg.id, rel: cg.rel.clone() });
        }
        let text = format(&entries);
        self.file.write_all_at(text.as_bytes(), 0)?;
        self.file.set_len(text.len() as u64)?;
        written(&entries);
        Ok(())
    }

    /// The limits of cgroup `cg` on device `dev`, if set on this very cgroup (not on one
    /// removed since at the same path).
    pub fn get(&self, cg: &Found, dev: u32) -> io::Result<Option<Entry>> {
        let key = cgroup::key(&cg.rel);
        Ok(self.entries()?.into_iter().find(|e| e.key == key && e.dev == dev && e.id == cg.id))
    }

    /// The hard limit on device `dev` of the cgroup with key `key`, when one is set and its
    /// cgroup lives: what an allocation of a process of that cgroup is checked against.
    pub fn hard_limit(&self, key: u64, dev: u32) -> io::Result<Option<u64>> {
        if key == 0 {
            return Ok(None);
        }
        let entry = self.entries()?.into_iter().find(|e| e.key == key && e.dev == dev);
        Ok(entry.filter(|e| e.hard != NVML_DEVICE_MEMORY_LIMIT_MAX && self.live(e)).map(|e| e.hard))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trips() {
        let entries = vec![
            Entry { key: 0x1a, dev: 0, soft: 0, hard: 1 << 30, id: 7, rel: "/a b/c".into() },
            Entry { key: u64::MAX, dev: 7, soft: 5, hard: NVML_DEVICE_MEMORY_LIMIT_MAX, id: 8, rel: "/".into() },
        ];
        let text = format(&entries);
        assert!(text.starts_with("fakecuda-limits 1\n000000000000001a 0 0 1073741824 7 /a b/c\n"));
        assert_eq!(parse(&text), Some(entries));
        assert_eq!(parse("fakecuda-limits 1\n"), Some(vec![]));
        assert_eq!(parse(""), None);
        assert_eq!(parse("fakecuda-limits 2\n"), None);
        assert_eq!(parse("fakecuda-limits 1\n000000000000001a 0 0 1 7 relative\n"), None);
        assert_eq!(parse("fakecuda-limits 1\n000000000000001a 0 0 1\n"), None);
        assert!(is_clear(0, NVML_DEVICE_MEMORY_LIMIT_MAX) && !is_clear(1, NVML_DEVICE_MEMORY_LIMIT_MAX));
    }
}
