//! One device's machine-wide state: a shared-memory file `<STATE_DIR>/<NODE>-dev<i>` that every
//! process using the device maps, so that processes compete for the same memory like they do
//! on a real GPU.
//!
//! Layout (little-endian, offsets in bytes; version 2):
//!
//! ```text
//! header (HEADER_SIZE bytes)
//!   0  magic        [u8; 8]  b"FAKECUDA"
//!   8  version      u32      2 (see below for 1)
//!  12  header_size  u32      HEADER_SIZE
//!  16  slot_size    u32      SLOT_SIZE
//!  20  slot_count   u32      SLOT_COUNT
//!  24  total_bytes  u64      device memory, fixed by the creator
//!  32  index        u32      device ordinal
//!  36  high_water   u32      slots [0, high_water) may be in use; only grows (atomic)
//!  40  limited      u32      entries for this device in the node's limits file, as the
//!                            last set left them (atomic; 0: the file need not be read)
//! slots (slot_count x SLOT_SIZE bytes), one per process holding memory
//!   0  pid          u32      0 = free slot
//!   4  flags        u32      FLAG_NO_CHANNEL: NVML does not list the slot (0 in files
//!                            written before the field: every slot listed)
//!   8  start_time   u64      /proc/<pid>/stat field 22
//!  16  pidns        u64      pid-namespace inode
//!  24  charged      u64      bytes this process holds on the device
//!  32  cgroup       u64      key of the process's cgroup when it claimed the slot
//!                            ([`crate::cgroup::key`]; 0: no cgroup2 membership known)
//!  40  (reserved to SLOT_SIZE, zero)
//! ```
//!
//! Version 1 was this layout without the `cgroup` and `limited` fields, which no version-1
//! writer touched (zero, as "no cgroup known" and "no limits" are): a version-1 file (a state
//! file left by an older build) is taken as it is and marked version 2 when opened, after
//! which an older build refuses it.
//!
//! The file is created complete under a temporary name and then hard-linked into place, so no
//! process ever sees it half-initialised; the first creator fixes its size, later processes
//! take the size from the file. The header is validated on every open.
//!
//! Locking: `flock(LOCK_EX)` on the file excludes other processes and is dropped by the kernel
//! if its holder dies. It does not exclude threads sharing one open file, so callers hold the
//! driver's in-process mutex as well (every `DeviceFile` lives behind it).
//!
//! Device use is the sum of the `charged` fields of live slots; a cgroup's use is the sum over
//! the live slots that carry its key. A process that grows its charge is refused when its
//! cgroup has a hard limit on the device ([`crate::limits`]) that the cgroup's use would pass,
//! checked under the lock, so two processes of one cgroup cannot both pass it.
//!
//! # Lifetime: the memory lives as long as the open file
//!
//! The real driver ties a process's memory to its open device files (`/dev/nvidiactl`,
//! `/dev/nvidia<N>`), not to its pid: it is released when the last descriptor of those files
//! closes. A child made by `fork` shares its parent's open files, so it keeps the parent's
//! memory after the parent exits, until the child closes them or exits (docs/gpu.md has the
//! facts this mirrors). The fake models it with an open-file-description lock
//! (`F_OFD_SETLK`, one byte past the end of the file at [`LOCK_BASE`] + slot index): the
//! process that claims a slot locks its byte through its own descriptor of this file; the
//! kernel drops the lock when the last descriptor sharing that open file closes, whoever
//! holds it (a forked child included), and at no other time. A slot whose byte no one holds
//! is dead and is reaped by [`DeviceFile::reap`] (a zombie has closed its files: dead too).
//! The rule holds across pid namespaces: the kernel's locks are the machine's.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use cuda_abi::{CUresult, CUDA_ERROR_OPERATING_SYSTEM, CUDA_ERROR_OUT_OF_MEMORY};

use crate::procinfo::ProcId;

pub const MAGIC: [u8; 8] = *b"FAKECUDA";
pub const VERSION: u32 = 2;
pub const HEADER_SIZE: usize = 4096;
pub const SLOT_SIZE: usize = 64;
pub const SLOT_COUNT: usize = 1024;
const FILE_SIZE: usize = HEADER_SIZE + SLOT_SIZE * SLOT_COUNT;

const OFF_HIGH_WATER: usize = 36;
const OFF_LIMITED: usize = 40;
const OFF_PID: usize = 0;
const OFF_FLAGS: usize = 4;
const OFF_START: usize = 8;
const OFF_PIDNS: usize = 16;
const OFF_CHARGED: usize = 24;
const OFF_CGROUP: usize = 32;

/// Slot flag: the process is a driver client without a channel, which NVML's running-process
/// lists leave out (its memory counts in the device's `used` all the same).
pub const FLAG_NO_CHANNEL: u32 = 1;

/// Offset of slot 0's lock byte: past the end of any valid file (locks may lie beyond it).
pub const LOCK_BASE: i64 = 1 << 40;

/// Why a device file could not be used: a one-line message for stderr and the result code.
#[derive(Debug)]
pub struct OpenError {
    pub message: String,
    pub code: CUresult,
}

/// A mapped device state file.
pub struct DeviceFile {
    path: PathBuf,
    file: File,
    map: *mut u8,
    slot_count: usize,
    total: u64,
}

// SAFETY: the mapping is shared memory owned by this value; every access goes through `&self`
// methods that the driver calls with its process-wide mutex held, and other processes are
// excluded by flock, so moving the value between threads is sound.
unsafe impl Send for DeviceFile {}

/// Holds the device's flock until dropped.
pub struct Locked<'a> {
    dev: &'a DeviceFile,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // SAFETY: flock on a descriptor this value keeps open.
        unsafe { libc::flock(self.dev.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Drop for DeviceFile {
    fn drop(&mut self) {
        // SAFETY: `map` is a live mapping of exactly this length made in `map_file`, and no
        // reference into it outlives `self`.
        unsafe { libc::munmap(self.map.cast(), self.len()) };
    }
}

fn header_bytes(total: u64, index: u32) -> Vec<u8> {
    let mut h = vec![0u8; HEADER_SIZE];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(HEADER_SIZE as u32).to_le_bytes());
    h[16..20].copy_from_slice(&(SLOT_SIZE as u32).to_le_bytes());
    h[20..24].copy_from_slice(&(SLOT_COUNT as u32).to_le_bytes());
    h[24..32].copy_from_slice(&total.to_le_bytes());
    h[32..36].copy_from_slice(&index.to_le_bytes());
    h
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Path of device `index`'s state file.
pub fn device_path(dir: &Path, node: &str, index: u32) -> PathBuf {
    dir.join(format!("{node}-dev{index}"))
}

/// Opens the shared state file at `path` read-write (read-only where its `mode` lets this
/// process do no more), or creates it: complete (`init` fills it) under a temporary name next
/// to it, then hard-linked into place, so no process ever sees it half-initialised; when
/// another process links its own first, that one is used. It gets `mode` whatever the umask
/// (0666 for a device file: a GPU is shared). `what` names the file in errors.
pub(crate) fn open_or_create_shared(path: &Path, what: &str, mode: u32, init: impl Fn(&File) -> io::Result<()>) -> Result<File, OpenError> {
    let os_err = |doing: &str, e: io::Error| OpenError {
        message: format!("fakecuda: {doing} {}: {e}", path.display()),
        code: CUDA_ERROR_OPERATING_SYSTEM,
    };
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(os_err(&format!("no place for the {what}"), io::ErrorKind::InvalidInput.into()));
    };
    for _ in 0..8 {
        let opened = match OpenOptions::new().read(true).write(true).open(path) {
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => OpenOptions::new().read(true).open(path),
            other => other,
        };
        match opened {
            Ok(file) => return Ok(file),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(os_err(&format!("cannot open {what}"), e)),
        }
        let tmp = dir.join(format!(
            ".{}.{}.{}.tmp",
            name.to_string_lossy(),
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
            .map_err(|e| os_err("cannot create a temporary file next to", e))?;
        let made = (|| -> io::Result<()> {
            file.set_permissions(std::fs::Permissions::from_mode(mode))?;
            init(&file)?;
            std::fs::hard_link(&tmp, path)
        })();
        let _ = std::fs::remove_file(&tmp);
        match made {
            Ok(()) => return Ok(file),
            // Another process created it first: use theirs.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(os_err(&format!("cannot create {what}"), e)),
        }
    }
    Err(OpenError { message: format!("fakecuda: {what} {} keeps disappearing", path.display()), code: CUDA_ERROR_OPERATING_SYSTEM })
}

impl DeviceFile {
    /// Opens device `index`'s state file, creating it with `total` bytes of memory if it does
    /// not exist yet. An existing file keeps the size its creator gave it.
    pub fn open_or_create(dir: &Path, node: &str, index: u32, total: u64) -> Result<DeviceFile, OpenError> {
        let path = device_path(dir, node, index);
        let file = open_or_create_shared(&path, "device state file", 0o666, |file| {
            file.set_len(FILE_SIZE as u64)?;
            file.write_all_at(&header_bytes(total, index), 0)
        })?;
        Self::validate(path, file, index)
    }

    fn validate(path: PathBuf, file: File, index: u32) -> Result<DeviceFile, OpenError> {
        let invalid = |why: String| OpenError {
            message: format!("fakecuda: {} is not a valid device state file: {why}", path.display()),
            code: CUDA_ERROR_OPERATING_SYSTEM,
        };
        let len = file.metadata().map_err(|e| invalid(e.to_string()))?.len();
        let mut h = [0u8; 64];
        file.read_exact_at(&mut h, 0).map_err(|e| invalid(format!("cannot read the header ({e})")))?;
        if h[0..8] != MAGIC {
            return Err(invalid("bad magic".into()));
        }
        let version = le_u32(&h, 8);
        if version != VERSION && version != 1 {
            return Err(invalid(format!("layout version {version}, expected {VERSION}")));
        }
        let (header_size, slot_size, slot_count) =
            (le_u32(&h, 12) as usize, le_u32(&h, 16) as usize, le_u32(&h, 20) as usize);
        if header_size != HEADER_SIZE || slot_size != SLOT_SIZE || !(1..=65536).contains(&slot_count) {
            return Err(invalid(format!(
                "header_size {header_size}, slot_size {slot_size}, slot_count {slot_count}"
            )));
        }
        let expected = (HEADER_SIZE + SLOT_SIZE * slot_count) as u64;
        if len != expected {
            return Err(invalid(format!("size {len}, expected {expected}")));
        }
        let total = le_u64(&h, 24);
        if total == 0 {
            return Err(invalid("device size 0".into()));
        }
        let file_index = le_u32(&h, 32);
        if file_index != index {
            return Err(invalid(format!("holds device {file_index}, expected {index}")));
        }
        // SAFETY: maps the whole file (its length was just checked) shared and read-write; the
        // result is checked against MAP_FAILED before use.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                expected as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(invalid(format!("mmap failed: {}", io::Error::last_os_error())));
        }
        // SAFETY: the 4-byte, 4-aligned version field of the page-aligned mapping just made;
        // other processes read it only at open.
        let version = unsafe { &*map.cast::<u8>().add(8).cast::<AtomicU32>() };
        let _ = version.compare_exchange(1, VERSION, Ordering::Relaxed, Ordering::Relaxed);
        Ok(DeviceFile { path, file, map: map.cast(), slot_count, total })
    }

    fn len(&self) -> usize {
        HEADER_SIZE + SLOT_SIZE * self.slot_count
    }

    /// The device's memory in bytes.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Takes the cross-process lock.
    pub fn lock(&self) -> Result<Locked<'_>, CUresult> {
        loop {
            // SAFETY: flock on a descriptor owned by `self.file`.
            let rc = unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(Locked { dev: self });
            }
            if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return Err(CUDA_ERROR_OPERATING_SYSTEM);
            }
        }
    }

    fn high_water(&self) -> &AtomicU32 {
        // SAFETY: a 4-byte, 4-aligned header field inside the page-aligned mapping, which lives
        // as long as `self`; other processes access it only atomically.
        unsafe { &*self.map.add(OFF_HIGH_WATER).cast::<AtomicU32>() }
    }

    fn limited_field(&self) -> &AtomicU32 {
        // SAFETY: as in `high_water`, for the 4-byte, 4-aligned `limited` field.
        unsafe { &*self.map.add(OFF_LIMITED).cast::<AtomicU32>() }
    }

    /// Records how many entries the node's limits file holds for this device (the setter
    /// does, holding the limits file's lock).
    pub fn set_limited(&self, entries: u32) {
        self.limited_field().store(entries, Ordering::Relaxed);
    }

    /// Whether the node's limits file may hold entries for this device.
    pub fn limited(&self) -> bool {
        self.limited_field().load(Ordering::Relaxed) != 0
    }

    /// The slots that may be in use: `0..high_water` (clamped to the file's slot count).
    fn live_slots(&self) -> std::ops::Range<usize> {
        0..(self.high_water().load(Ordering::Relaxed) as usize).min(self.slot_count)
    }

    fn u32_at(&self, slot: usize, off: usize) -> &AtomicU32 {
        debug_assert!(slot < self.slot_count && off.is_multiple_of(4) && off + 4 <= SLOT_SIZE);
        // SAFETY: `slot < slot_count` (every caller takes it from `0..slot_count` or from
        // `live_slots`, which is clamped to it), so the 4-byte, 4-aligned
        // field lies inside the page-aligned mapping, which lives as long as `self`. Other
        // processes write it only through the same atomic accesses.
        unsafe { &*self.map.add(HEADER_SIZE + slot * SLOT_SIZE + off).cast::<AtomicU32>() }
    }

    fn u64_at(&self, slot: usize, off: usize) -> &AtomicU64 {
        debug_assert!(slot < self.slot_count && off.is_multiple_of(8) && off + 8 <= SLOT_SIZE);
        // SAFETY: as in `u32_at`, for an 8-byte, 8-aligned field.
        unsafe { &*self.map.add(HEADER_SIZE + slot * SLOT_SIZE + off).cast::<AtomicU64>() }
    }

    fn slot_owner(&self, slot: usize) -> ProcId {
        ProcId {
            pid: self.u32_at(slot, OFF_PID).load(Ordering::Relaxed),
            start_time: self.u64_at(slot, OFF_START).load(Ordering::Relaxed),
            pidns: self.u64_at(slot, OFF_PIDNS).load(Ordering::Relaxed),
        }
    }

    /// One OFD-lock request on `slot`'s byte: `F_OFD_SETLK` with `F_WRLCK` (take),
    /// `F_UNLCK` (give back), or `F_OFD_GETLK` (ask). Returns the `flock` as the kernel left it.
    fn slot_lock(&self, slot: usize, cmd: libc::c_int, kind: libc::c_short) -> io::Result<libc::flock> {
        // SAFETY: an all-zero flock is a valid value (l_pid must be 0 for OFD locks).
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = kind;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = LOCK_BASE + slot as i64;
        fl.l_len = 1;
        loop {
            // SAFETY: fcntl on a descriptor owned by `self.file`, with a valid flock pointer.
            let rc = unsafe { libc::fcntl(self.file.as_raw_fd(), cmd, &mut fl) };
            if rc == 0 {
                return Ok(fl);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Whether some open file of this device file other than ours holds `slot`'s lock: its
    /// memory is still held. An error of the kernel counts as held (never free what may be
    /// in use).
    fn held_elsewhere(&self, slot: usize) -> bool {
        self.slot_lock(slot, libc::F_OFD_GETLK, libc::F_WRLCK as libc::c_short)
            .map_or(true, |fl| fl.l_type != libc::F_UNLCK as libc::c_short)
    }

    fn clear_slot(&self, slot: usize) {
        self.u64_at(slot, OFF_CHARGED).store(0, Ordering::Relaxed);
        self.u64_at(slot, OFF_CGROUP).store(0, Ordering::Relaxed);
        self.u32_at(slot, OFF_FLAGS).store(0, Ordering::Relaxed);
        self.u64_at(slot, OFF_START).store(0, Ordering::Relaxed);
        self.u64_at(slot, OFF_PIDNS).store(0, Ordering::Relaxed);
        self.u32_at(slot, OFF_PID).store(0, Ordering::Relaxed);
    }

    /// Bytes in use on the device: the sum over occupied slots.
    pub fn used(&self, _lock: &Locked<'_>) -> u64 {
        self.live_slots()
            .filter(|&s| self.u32_at(s, OFF_PID).load(Ordering::Relaxed) != 0)
            .fold(0u64, |sum, s| sum.saturating_add(self.u64_at(s, OFF_CHARGED).load(Ordering::Relaxed)))
    }

    /// Bytes the processes of the cgroup with key `cgroup` hold on the device: the sum over
    /// occupied slots that carry the key (reap first to leave dead processes out).
    pub fn cgroup_used(&self, _lock: &Locked<'_>, cgroup: u64) -> u64 {
        self.live_slots()
            .filter(|&s| self.u32_at(s, OFF_PID).load(Ordering::Relaxed) != 0 && self.u64_at(s, OFF_CGROUP).load(Ordering::Relaxed) == cgroup)
            .fold(0u64, |sum, s| sum.saturating_add(self.u64_at(s, OFF_CHARGED).load(Ordering::Relaxed)))
    }

    /// `(who, bytes, flags)` of every process holding memory on the device.
    pub fn holders(&self, _lock: &Locked<'_>) -> Vec<(ProcId, u64, u32)> {
        self.live_slots()
            .map(|s| (self.slot_owner(s), self.u64_at(s, OFF_CHARGED).load(Ordering::Relaxed), self.u32_at(s, OFF_FLAGS).load(Ordering::Relaxed)))
            .filter(|&(owner, bytes, _)| owner.pid != 0 && bytes != 0)
            .collect()
    }

    /// Frees the slots whose memory no open file holds any more (see the module doc); returns
    /// how many bytes that gave back. `me`'s own slot is never freed here.
    pub fn reap(&self, _lock: &Locked<'_>, me: &ProcId) -> u64 {
        let mut freed = 0u64;
        for s in self.live_slots() {
            let owner = self.slot_owner(s);
            if owner.pid == 0 || owner == *me || self.held_elsewhere(s) {
                continue;
            }
            freed = freed.saturating_add(self.u64_at(s, OFF_CHARGED).load(Ordering::Relaxed));
            self.clear_slot(s);
        }
        freed
    }

    /// Finds `me`'s slot (trying `hint` first), or claims a free one (recording `tag`).
    fn slot_for(&self, me: &ProcId, hint: Option<usize>, claim: bool, tag: SlotTag) -> Option<usize> {
        if let Some(h) = hint.filter(|&h| self.live_slots().contains(&h)) {
            if self.slot_owner(h) == *me {
                return Some(h);
            }
        }
        if let Some(s) = self.live_slots().find(|&s| self.slot_owner(s) == *me) {
            return Some(s);
        }
        if !claim {
            return None;
        }
        // The lowest free slot whose lock this open file can take, so the high-water mark
        // stays low.
        let s = (0..self.slot_count).find(|&s| {
            self.u32_at(s, OFF_PID).load(Ordering::Relaxed) == 0
                && self.slot_lock(s, libc::F_OFD_SETLK, libc::F_WRLCK as libc::c_short).is_ok()
        })?;
        if s >= self.live_slots().end {
            self.high_water().store(s as u32 + 1, Ordering::Relaxed);
        }
        self.u64_at(s, OFF_CHARGED).store(0, Ordering::Relaxed);
        self.u64_at(s, OFF_CGROUP).store(tag.cgroup, Ordering::Relaxed);
        self.u32_at(s, OFF_FLAGS).store(tag.flags, Ordering::Relaxed);
        self.u64_at(s, OFF_START).store(me.start_time, Ordering::Relaxed);
        self.u64_at(s, OFF_PIDNS).store(me.pidns, Ordering::Relaxed);
        self.u32_at(s, OFF_PID).store(me.pid, Ordering::Relaxed);
        Some(s)
    }

    /// Changes what `me` holds on the device from `current` to `new` bytes. Growing fails with
    /// `CUDA_ERROR_OUT_OF_MEMORY` (charging nothing) when the device cannot hold it, or when
    /// `hard_limit` (asked under the lock, only to grow, and only when the device is
    /// [`limited`](Self::limited)) gives a limit on `me`'s cgroup that the cgroup's use would
    /// pass, each after reaping dead processes once. `hint` caches
    /// `me`'s slot index between calls; `tag` goes into a slot this call claims.
    pub fn recharge(
        &self,
        me: &ProcId,
        hint: &mut Option<usize>,
        current: u64,
        new: u64,
        tag: SlotTag,
        hard_limit: impl FnOnce() -> Result<Option<u64>, CUresult>,
    ) -> Result<(), CUresult> {
        if current == new {
            return Ok(());
        }
        let lock = self.lock()?;
        if new > current {
            let need = new - current;
            let limit = if self.limited() { hard_limit()? } else { None };
            // Our own slot holds `current` (or nothing if it was lost); count it as ours.
            let mine = |dev: &Self| {
                dev.slot_for(me, *hint, false, tag).map(|s| dev.u64_at(s, OFF_CHARGED).load(Ordering::Relaxed)).unwrap_or(0)
            };
            let fits = |dev: &Self| {
                let mine = mine(dev);
                let on_device = dev.used(&lock).saturating_sub(mine).checked_add(new).is_some_and(|t| t <= dev.total);
                let in_cgroup = limit.is_none_or(|hard| {
                    dev.cgroup_used(&lock, tag.cgroup).saturating_sub(mine).checked_add(new).is_some_and(|t| t <= hard)
                });
                on_device && in_cgroup
            };
            if need > self.total || !fits(self) {
                self.reap(&lock, me);
                if !fits(self) {
                    return Err(CUDA_ERROR_OUT_OF_MEMORY);
                }
            }
        }
        if new == 0 {
            if let Some(s) = self.slot_for(me, *hint, false, tag) {
                self.clear_slot(s);
            }
            *hint = None;
            return Ok(());
        }
        let slot = match self.slot_for(me, *hint, true, tag) {
            Some(s) => s,
            None => {
                self.reap(&lock, me);
                self.slot_for(me, None, true, tag).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?
            }
        };
        self.u64_at(slot, OFF_CHARGED).store(new, Ordering::Relaxed);
        *hint = Some(slot);
        Ok(())
    }
}

/// What a slot records of its process besides who it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotTag {
    /// [`FLAG_NO_CHANNEL`] or 0.
    pub flags: u32,
    /// The process's cgroup key ([`crate::cgroup::key`]; 0: none known).
    pub cgroup: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_1_file_is_taken_and_marked_version_2() {
        let dir = std::env::temp_dir().join(format!("fakecuda-devfile-v1-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = device_path(&dir, "v1", 0);
        let mut header = header_bytes(1 << 30, 0);
        header[8..12].copy_from_slice(&1u32.to_le_bytes());
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(&path).expect("create");
        file.set_len(FILE_SIZE as u64).expect("size");
        file.write_all_at(&header, 0).expect("header");
        let dev = DeviceFile::open_or_create(&dir, "v1", 0, 1 << 30).expect("a version-1 file opens");
        let mut version = [0u8; 4];
        file.read_exact_at(&mut version, 8).expect("read");
        assert_eq!(u32::from_le_bytes(version), VERSION);
        let me = ProcId::current();
        let mut hint = None;
        let tag = SlotTag { flags: 0, cgroup: 7 };
        dev.recharge(&me, &mut hint, 0, 8 << 20, tag, || Ok(Some(6 << 20))).expect("the limits file is not read while no limit is set");
        dev.recharge(&me, &mut hint, 8 << 20, 0, tag, || Ok(Some(0))).expect("shrinking is never refused");
        dev.set_limited(1);
        dev.recharge(&me, &mut hint, 0, 4 << 20, tag, || Ok(Some(6 << 20))).expect("under the limit");
        assert_eq!(dev.recharge(&me, &mut hint, 4 << 20, 8 << 20, tag, || Ok(Some(6 << 20))), Err(CUDA_ERROR_OUT_OF_MEMORY));
        dev.recharge(&me, &mut hint, 4 << 20, 8 << 20, tag, || Ok(None)).expect("no limit");
        let lock = dev.lock().expect("lock");
        assert_eq!((dev.cgroup_used(&lock, 7), dev.cgroup_used(&lock, 8), dev.used(&lock)), (8 << 20, 0, 8 << 20));
        drop(lock);
        header[8..12].copy_from_slice(&3u32.to_le_bytes());
        file.write_all_at(&header, 0).expect("header");
        assert!(DeviceFile::open_or_create(&dir, "v1", 0, 1 << 30).is_err(), "version 3 is refused");
        drop(dev);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
