//! The ledger's operations: registering processes, admitting and releasing allocations,
//! reclaiming dead processes, repairing after a lock holder died, and checking invariants.
//!
//! Every operation runs under the file's robust lock. Records are the source of truth: a
//! record is committed (or dropped) by the single store of its `state` field; everything
//! else (the buddy spaces, the block chains, per-slot and per-device usage, the free-record
//! list) is derived from the live records and can be rebuilt. Each mutation raises the
//! `dirty` flag first and lowers it last, so a lock holder that finds it raised (its
//! predecessor died mid-update, whether or not the mutex reported `EOWNERDEAD`) rebuilds the
//! derived state before going on.
//!
//! Accounting rules (docs/design.md, "The ledger"): a device allocation of a chunk or more takes
//! ceil(bytes / chunk) whole chunks of its own; smaller ones are packed per (process,
//! device), which is charged ceil(live small bytes / chunk) chunks; a context reserve is
//! charged once per (process, device); managed memory takes whole chunks like data.
use std::path::Path;

use crate::{
    buddy::{self, Buddy},
    error::{LedgerError, ReserveError},
    file::{self, Mapped},
    layout::{ContainerNames, DeviceUsage, Geometry, Header, Slot, State, RECORD_LIVE, SLOT_FREE, SLOT_LIVE},
    process::ProcessIdentity,
    tables::{check, fresh, release, reclaim, repair, reserve, zeroed_slot, Tables},
};

/// Index of a process slot.
pub type SlotId = u32;
/// Index of an allocation record.
pub type RecordId = u32;

/// What a caller asks to charge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Charge {
    /// Device memory of `bytes` (packed with the process's other small allocations when it is
    /// less than a chunk).
    Device(u64),
    /// Managed memory of `bytes`.
    Managed(u64),
    /// The context reserve of the device (once per process; again returns the same record).
    Context,
    /// The context reserve of one more context of the process on the device (each
    /// `cuCtxCreate` and each primary context is one): a record of its own every time.
    AnotherContext,
}

/// A mapped, validated ledger file.
pub struct Ledger {
    mapped: Mapped,
    /// Buddy geometry of each device (derived from the validated header).
    geometries: Vec<Option<buddy::Geometry>>,
    /// How long an operation waits for the lock ([`Ledger::with_lock_timeout`]); `None`:
    /// as long as it takes.
    lock_timeout: Option<std::time::Duration>,
}

/// A live slot as [`Ledger::slots`] reports it.
#[derive(Clone, Copy, Debug)]
pub struct SlotView {
    pub id: SlotId,
    pub slot: Slot,
}

impl Ledger {
    /// Creates a new ledger at `path`; fails if one exists.
    pub fn create(path: &Path, geometry: &Geometry, creator: u32) -> Result<Ledger, LedgerError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let header = file::plan(geometry, creator, now)?;
        let geometries = geometries(&header)?;
        let mapped = file::create(path, &header, |file, mapped| initialise(file, mapped, &geometries))?;
        Ok(Ledger { mapped, geometries, lock_timeout: None })
    }

    /// Opens and validates an existing ledger.
    pub fn open(path: &Path) -> Result<Ledger, LedgerError> {
        Ledger::attach(file::open(path)?)
    }

    /// Validates and maps the ledger open as `file` (read and write); `path` names it in
    /// errors. For a process handed the descriptor rather than the path.
    pub fn from_file(file: &std::fs::File, path: &Path) -> Result<Ledger, LedgerError> {
        Ledger::attach(file::open_file(file, path)?)
    }

    /// A private copy of the ledger open as `file` (at most `max_bytes`), in memory only this
    /// process can write (a sealed-off `memfd`), with a fresh lock: for a reader that must
    /// run the ledger's own code (`check`, `records`) on a file it cannot trust, without
    /// mapping that file or running the lock's code on its bytes. The copy is taken without
    /// the lock, so it may hold a mutation half-done (a raised `dirty` flag is copied too, and
    /// makes the first operation on the copy repair it).
    pub fn private_copy(file: &std::fs::File, path: &Path, max_bytes: u64) -> Result<Ledger, LedgerError> {
        use std::os::unix::fs::FileExt;
        let io_error = |source: std::io::Error| LedgerError::Io { path: path.to_path_buf(), source };
        let size = file.metadata().map_err(io_error)?.len();
        if size > max_bytes {
            return Err(LedgerError::InvalidConfig(format!("{} is {size} bytes, more than the {max_bytes} allowed", path.display())));
        }
        let mut bytes = vec![0u8; size as usize];
        file.read_exact_at(&mut bytes, 0).map_err(io_error)?;
        // SAFETY: memfd_create with a valid C string and flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"vramguard-ledger-copy".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io_error(std::io::Error::last_os_error()));
        }
        // SAFETY: memfd_create returned a new descriptor nothing else owns.
        let copy = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        copy.write_all_at(&bytes, 0).map_err(io_error)?;
        let mapped = file::open_file(&copy, path)?;
        // SAFETY: the mapping is of the private copy, which no other thread or process uses.
        unsafe { crate::lock::RobustMutex::init(std::ptr::addr_of_mut!((*state_ptr(&mapped)).lock)) }.map_err(io_error)?;
        Ledger::attach(mapped)
    }

    /// [`Ledger::from_file`] with `header`, one the caller validated earlier, instead of the
    /// file's own (the node agent's worker: the agent's limits hold whatever the file's
    /// header was rewritten to).
    pub fn from_file_as(file: &std::fs::File, header: Header, path: &Path) -> Result<Ledger, LedgerError> {
        Ledger::attach(file::open_file_as(file, header, path)?)
    }

    fn attach(mapped: Mapped) -> Result<Ledger, LedgerError> {
        let path = mapped.path.clone();
        let path = path.as_path();
        let geometries = geometries(&mapped.header)?;
        let ledger = Ledger { mapped, geometries, lock_timeout: None };
        let mut tables = tables(&ledger.mapped, &ledger.geometries);
        for device in 0..ledger.mapped.header.device_count as usize {
            if let Some((words, _)) = tables.device(device) {
                Buddy::attach(words).map_err(|error| LedgerError::Corrupt {
                    path: path.to_path_buf(),
                    what: format!("device {device}'s buddy space: {error}"),
                })?;
            }
        }
        Ok(ledger)
    }

    /// Opens the ledger at `path`, creating it with `geometry` if there is none.
    ///
    /// Processes that find no ledger take turns through an exclusive `flock` on a sibling
    /// `.<name>.lock` file, so one of them builds the file while the others wait and then open
    /// it (instead of every one building a copy and all but one throwing it away).
    pub fn open_or_create(path: &Path, geometry: &Geometry, creator: u32) -> Result<Ledger, LedgerError> {
        let not_found = |result: &Result<Ledger, LedgerError>| {
            matches!(result, Err(LedgerError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound)
        };
        let first = Ledger::open(path);
        if !not_found(&first) {
            return first;
        }
        let _turn = file::creation_lock(path)?;
        let second = Ledger::open(path);
        if !not_found(&second) {
            return second;
        }
        match Ledger::create(path, geometry, creator) {
            Err(LedgerError::AlreadyExists { .. }) => Ledger::open(path),
            other => other,
        }
    }

    /// Makes every operation wait at most `timeout` for the lock and then fail with
    /// [`LedgerError::Busy`] (the node agent's ledgers: a workload that stops inside the lock
    /// must not stop the agent). Workloads wait as long as it takes: the lock is robust, so a
    /// holder that dies hands it on at once.
    pub fn with_lock_timeout(mut self, timeout: std::time::Duration) -> Ledger {
        self.lock_timeout = Some(timeout);
        self
    }

    /// The validated header (limits, geometry).
    pub fn header(&self) -> &Header {
        &self.mapped.header
    }

    pub fn path(&self) -> &Path {
        &self.mapped.path
    }

    /// Gives `process` a slot. A live slot with the same identity (the process called exec)
    /// is reclaimed and reused: an exec'd image starts clean.
    pub fn register(&self, process: ProcessIdentity) -> Result<SlotId, LedgerError> {
        self.locked(|t| {
            if t.slots.get(t.used_slots()).is_some_and(|s| s.state != SLOT_FREE) {
                repair(t); // a damaged high-water mark: rebuild it
            }
            let used = t.used_slots();
            let same = t.slots[..used].iter().position(|s| s.describes(&process));
            let id = match same {
                Some(id) => {
                    reclaim(t, id as SlotId);
                    id
                }
                None => t.slots[..used]
                    .iter()
                    .position(|s| s.state == SLOT_FREE)
                    .or((used < t.slots.len()).then_some(used))
                    .ok_or(LedgerError::NoFreeSlot(t.header.slot_count))?,
            };
            t.state.slots_in_use = t.state.slots_in_use.max(id as u32 + 1);
            let slot = &mut t.slots[id];
            *slot = zeroed_slot();
            slot.pid = process.pid;
            slot.pidns = process.pidns;
            slot.start_time = process.start_time;
            slot.state = SLOT_LIVE;
            Ok(id as SlotId)
        })?
    }

    /// Admits a charge for `slot` on `device`, or refuses it when the quota cannot hold it.
    /// `ptr` is the device pointer or handle, for inspection and reconciliation.
    pub fn reserve(&self, slot: SlotId, device: u32, charge: Charge, ptr: u64) -> Result<RecordId, ReserveError> {
        self.locked(|t| reserve(t, slot, device, charge, ptr))?
    }

    /// Notes the device pointer or handle of a record the caller reserved, for inspection.
    /// A single atomic store, without the lock: only the record's owner writes the field.
    pub fn note_pointer(&self, record: RecordId, ptr: u64) {
        let h = &self.mapped.header;
        if record >= h.record_count {
            return;
        }
        let offset = h.records_offset
            + u64::from(record) * size_of::<crate::layout::Record>() as u64
            + std::mem::offset_of!(crate::layout::Record, ptr) as u64;
        // SAFETY: the offset lies inside the validated records section and is 8-aligned
        // (records are 8-aligned, `ptr` is at an 8-aligned offset within one).
        unsafe { std::sync::atomic::AtomicU64::from_ptr(self.mapped.at(offset).cast()) }
            .store(ptr, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records the pid `slot`'s process has on the host (the agent learns it from /proc).
    /// A single atomic store, without the lock: only the agent writes the field, and it is a
    /// hint (the agent verifies a process's identity before acting on it), so a store that
    /// races with the slot being freed and reused is harmless. Out-of-range slots are ignored.
    pub fn set_host_pid(&self, slot: SlotId, host_pid: u32) {
        let h = &self.mapped.header;
        if slot >= h.slot_count {
            return;
        }
        let offset = h.slots_offset
            + u64::from(slot) * size_of::<Slot>() as u64
            + std::mem::offset_of!(Slot, host_pid) as u64;
        // SAFETY: the offset lies inside the validated slots section and is 4-aligned (slots
        // are 8-aligned, `host_pid` is at a 4-aligned offset within one).
        unsafe { std::sync::atomic::AtomicU32::from_ptr(self.mapped.at(offset).cast()) }
            .store(host_pid, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets [`crate::layout::SLOT_FORKED`] in `slot`'s flags: one atomic OR without the lock
    /// (a hint, like [`Ledger::set_host_pid`]; safe after `fork` in the parent). Out-of-range
    /// slots are ignored.
    pub fn mark_forked(&self, slot: SlotId) {
        let h = &self.mapped.header;
        if slot >= h.slot_count {
            return;
        }
        let offset = h.slots_offset + u64::from(slot) * size_of::<Slot>() as u64 + std::mem::offset_of!(Slot, flags) as u64;
        // SAFETY: the offset lies inside the validated slots section and is 4-aligned (slots
        // are 8-aligned, `flags` is at a 4-aligned offset within one).
        unsafe { std::sync::atomic::AtomicU32::from_ptr(self.mapped.at(offset).cast()) }
            .fetch_or(crate::layout::SLOT_FORKED, std::sync::atomic::Ordering::Relaxed);
    }

    /// Releases a record of `slot`.
    pub fn release(&self, slot: SlotId, record: RecordId) -> Result<(), LedgerError> {
        self.locked(|t| {
            let valid = t.records.get(record as usize).is_some_and(|r| r.state == RECORD_LIVE && r.slot == slot);
            if !valid {
                return Err(LedgerError::UnknownRecord(record));
            }
            release(t, record);
            Ok(())
        })?
    }

    /// Frees every block and record of `slot` and the slot itself; returns the chunks freed.
    pub fn reclaim(&self, slot: SlotId) -> Result<u64, LedgerError> {
        self.locked(|t| {
            if t.slots.get(slot as usize).is_none_or(|s| s.state != SLOT_LIVE) {
                return Err(LedgerError::UnknownSlot(slot));
            }
            Ok(reclaim(t, slot))
        })?
    }

    /// Frees `slot` as [`Ledger::reclaim`] does, but only if it is still live and still
    /// describes `process` (checked under the lock): a caller that judged the process dead
    /// without the lock never frees a slot that was freed and reused meanwhile. Returns the
    /// chunks freed, or `None` when the slot no longer describes `process`.
    pub fn reclaim_process(&self, slot: SlotId, process: ProcessIdentity) -> Result<Option<u64>, LedgerError> {
        self.locked(|t| {
            let same = t.slots.get(slot as usize).is_some_and(|s| s.describes(&process));
            same.then(|| reclaim(t, slot))
        })
    }

    /// Reclaims every slot whose process is gone, as judged from this process's pid
    /// namespace (slots of other namespaces are left to the agent), except those of
    /// processes that forked ([`crate::layout::SLOT_FORKED`]: a child may hold their memory;
    /// the agent frees them on the driver's word). Returns those reclaimed.
    ///
    /// The processes are looked up in /proc without the lock held; each slot found dead is
    /// then reclaimed under the lock only if it still describes the same process.
    pub fn reclaim_dead(&self) -> Result<Vec<SlotId>, LedgerError> {
        let candidates: Vec<(SlotId, ProcessIdentity)> = self
            .slots()?
            .into_iter()
            .filter(|view| view.slot.flags & crate::layout::SLOT_FORKED == 0)
            .map(|view| (view.id, view.slot.process()))
            .filter(|(_, process)| process.is_alive() == Some(false))
            .collect();
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        self.locked(|t| {
            let mut reclaimed = Vec::new();
            for (id, process) in candidates {
                if t.slots[id as usize].describes(&process) {
                    reclaim(t, id);
                    reclaimed.push(id);
                }
            }
            reclaimed
        })
    }

    /// Copies of the live slots.
    pub fn slots(&self) -> Result<Vec<SlotView>, LedgerError> {
        let mut views = Vec::new();
        self.for_each_slot(|id, slot| views.push(SlotView { id, slot: *slot }))?;
        Ok(views)
    }

    /// Calls `f` with every live slot, under the lock and without copying the slots (for a
    /// caller that reads a few fields of many slots). `f` must not call into this ledger.
    pub fn for_each_slot(&self, mut f: impl FnMut(SlotId, &Slot)) -> Result<(), LedgerError> {
        self.locked(|t| {
            for (id, slot) in t.slots[..t.used_slots()].iter().enumerate() {
                if slot.state == SLOT_LIVE {
                    f(id as SlotId, slot);
                }
            }
        })
    }

    /// Makes `slot`'s charge on `device` `bytes` of device memory, replacing `previous` (a
    /// record of `slot` an earlier call returned, if any) in one step under the lock: what
    /// the node agent charges a container for memory its processes hold outside the ledger.
    /// Over quota the charge is cut to what the quota still holds (the memory is in use
    /// whether or not the quota has room for it). Returns the new record, if any, and the
    /// bytes it charges.
    ///
    /// `slot` must still describe `process` (checked under the lock, like
    /// [`Ledger::reclaim_process`]): otherwise nothing changes and the error is
    /// [`LedgerError::UnknownSlot`].
    pub fn recharge(
        &self,
        slot: SlotId,
        process: ProcessIdentity,
        device: u32,
        previous: Option<RecordId>,
        bytes: u64,
    ) -> Result<(Option<RecordId>, u64), LedgerError> {
        self.locked(|t| {
            let ours = t.slots.get(slot as usize).is_some_and(|s| s.describes(&process));
            if !ours {
                return Err(LedgerError::UnknownSlot(slot));
            }
            if let Some(record) = previous {
                let valid = t.records.get(record as usize).is_some_and(|r| r.state == RECORD_LIVE && r.slot == slot);
                if valid {
                    release(t, record);
                }
            }
            if bytes == 0 {
                return Ok((None, 0));
            }
            match reserve(t, slot, device, Charge::Device(bytes), 0) {
                Ok(record) => Ok((Some(record), bytes)),
                Err(ReserveError::OverQuota { used, limit, .. }) if limit > used => {
                    let room = limit - used;
                    match reserve(t, slot, device, Charge::Device(room), 0) {
                        Ok(record) => Ok((Some(record), room)),
                        Err(ReserveError::OverQuota { .. }) => Ok((None, 0)),
                        Err(ReserveError::Ledger(error)) => Err(error),
                    }
                }
                Err(ReserveError::OverQuota { .. }) => Ok((None, 0)),
                Err(ReserveError::Ledger(error)) => Err(error),
            }
        })?
    }

    /// Copies of the records in use (allocations, small pools, context reserves).
    pub fn records(&self) -> Result<Vec<(RecordId, crate::layout::Record)>, LedgerError> {
        self.locked(|t| {
            t.records[..t.used_records()]
                .iter()
                .enumerate()
                .filter(|(_, r)| r.state != crate::layout::RECORD_FREE)
                .map(|(id, r)| (id as RecordId, *r))
                .collect()
        })
    }

    /// Per-device totals.
    pub fn device_usage(&self) -> Result<Vec<DeviceUsage>, LedgerError> {
        self.locked(|t| t.state.devices[..t.header.device_count as usize].to_vec())
    }

    /// Records the container's names (see [`ContainerNames`]: informational only, a workload
    /// can write them too). Under the lock; written only when `names` is not empty and what
    /// the ledger holds is empty or different, so every process of a container opening the
    /// ledger with the same names writes nothing, and the last process with different names
    /// wins. Returns whether the ledger changed.
    pub fn set_names(&self, names: &ContainerNames) -> Result<bool, LedgerError> {
        if names.is_empty() {
            return Ok(false);
        }
        self.locked(|t| {
            if t.state.names == *names {
                return false;
            }
            t.state.names = *names;
            true
        })
    }

    /// The container's names (namespace, pod, container) if a hook recorded them: lossy
    /// UTF-8, each cut at its first NUL, `None` when there are none or when a field holds a
    /// control character ([`ContainerNames::text`]). Informational only: a workload could
    /// have written them.
    pub fn names(&self) -> Option<(String, String, String)> {
        self.locked(|t| t.state.names).ok()?.text()
    }

    /// Repairs performed over the file's life.
    pub fn repairs(&self) -> Result<u64, LedgerError> {
        self.locked(|t| t.state.repairs)
    }

    /// Verifies every invariant; returns the violations found (none: the ledger is sound).
    pub fn check(&self) -> Result<Vec<String>, LedgerError> {
        self.locked(check)
    }

    /// Panics inside the lock halfway through a mutation (tests of the containment in
    /// `locked`).
    #[doc(hidden)]
    pub fn panic_inside_lock(&self) -> Result<(), LedgerError> {
        self.locked(|t| {
            t.state.devices[0].used_chunks = t.state.devices[0].used_chunks.wrapping_add(1);
            panic!("a test panicked inside the ledger's lock");
        })
    }

    /// Holds the lock for `duration` (the crash tests kill processes inside the lock).
    #[doc(hidden)]
    pub fn hold_lock_for(&self, duration: std::time::Duration) -> Result<(), LedgerError> {
        self.locked(|t| {
            t.state.dirty = 1;
            std::thread::sleep(duration);
            t.state.dirty = 0;
        })
    }

    /// Runs `f` under the lock, repairing first if the last holder left a mess.
    fn locked<R>(&self, f: impl FnOnce(&mut Tables<'_>) -> R) -> Result<R, LedgerError> {
        // SAFETY: the state lies inside the mapping, validated at open, for self's lifetime.
        let lock = unsafe { &(*state_ptr(&self.mapped)).lock };
        let mut guard = match self.lock_timeout {
            None => lock.lock()?,
            Some(waited) => lock.lock_within(waited)?.ok_or_else(|| LedgerError::Busy { path: self.path().to_path_buf(), waited })?,
        };
        let mut tables = tables(&self.mapped, &self.geometries);
        let owner_died = guard.acquired() == crate::lock::Acquired::OwnerDied;
        // The file is writable by every process of the container: bookkeeping damaged in a
        // way no check foresaw must not abort the process (a panic cannot cross the hook's C
        // ABI) nor the agent. A panic here leaves `dirty` raised, so the next holder rebuilds
        // the derived state, and this operation reports the ledger damaged.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // Raised before the repair too: a repair that stops halfway is done again.
            let damaged = owner_died || tables.state.dirty != 0;
            tables.state.dirty = 1;
            if damaged {
                repair(&mut tables);
            }
            let result = f(&mut tables);
            tables.state.mutations = tables.state.mutations.wrapping_add(1);
            tables.state.dirty = 0;
            result
        }));
        guard.mark_consistent();
        drop(guard);
        result.map_err(|_| LedgerError::Corrupt {
            path: self.path().to_path_buf(),
            what: "an operation met damaged bookkeeping and stopped; the next one rebuilds it from the records".into(),
        })
    }
}

/// Builds a new ledger's derived state in its zeroed file (`file`, mapped as `mapped`), before
/// anyone else can see the file: its lock, and what the first repair would build (buddy
/// spaces, free-record list) without writing the tables' zeros ([`file::write_free_records`],
/// [`fresh`]).
fn initialise(file: &std::fs::File, mapped: &Mapped, geometries: &[Option<buddy::Geometry>]) -> Result<(), LedgerError> {
    let io_error = |source| LedgerError::Io { path: mapped.path.clone(), source };
    // The records first, before any page is touched through the mapping: the first fault
    // would read ahead (zero-fill) the pages around it, which the writes then find cached.
    file::write_free_records(file, &mapped.header).map_err(io_error)?;
    // SAFETY: the file is new and only this thread can see it.
    unsafe { crate::lock::RobustMutex::init(std::ptr::addr_of_mut!((*state_ptr(mapped)).lock)) }.map_err(io_error)?;
    fresh(&mut tables(mapped, geometries));
    Ok(())
}

fn state_ptr(mapped: &Mapped) -> *mut State {
    mapped.at(mapped.header.state_offset).cast()
}

/// The mapped tables. Callers hold the lock (or own the file exclusively), so no other
/// process mutates them meanwhile.
fn tables<'a>(mapped: &'a Mapped, geometries: &'a [Option<buddy::Geometry>]) -> Tables<'a> {
    let h = &mapped.header;
    // SAFETY: every offset and count below was validated against the file size and the
    // layout by `file::validate` (or computed by `file::plan` at creation); the sections do
    // not overlap, are 8-aligned, and hold plain integers valid for any bit pattern.
    unsafe {
        Tables {
            header: h,
            state: &mut *state_ptr(mapped),
            slots: std::slice::from_raw_parts_mut(mapped.at(h.slots_offset).cast(), h.slot_count as usize),
            records: std::slice::from_raw_parts_mut(mapped.at(h.records_offset).cast(), h.record_count as usize),
            mapped,
            geometries,
        }
    }
}

/// Each device's buddy geometry (`None`: a device with no space, see [`crate::file::plan`]).
fn geometries(header: &Header) -> Result<Vec<Option<buddy::Geometry>>, LedgerError> {
    header.devices[..header.device_count as usize]
        .iter()
        .map(|device| {
            if device.chunks == 0 {
                return Ok(None);
            }
            buddy::Geometry::for_space(device.limit, device.chunk)
                .map(Some)
                .map_err(|error| LedgerError::InvalidConfig(format!("buddy geometry: {error}")))
        })
        .collect()
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::{layout::CREATOR_HOOK, DeviceConfig};

    /// A new ledger is what the first repair of its zeroed file makes, byte for byte: the
    /// creation that skips the zeros (`initialise`) builds the same file as the one that
    /// repaired it (the previous creation), for geometries with one device, several, a device
    /// without space, and the hook's own.
    #[test]
    fn a_new_ledger_is_its_zeroed_files_repair_byte_for_byte() {
        let dir = std::env::temp_dir().join(format!("ledger-fresh-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let device = |limit: u64, chunk: u64| DeviceConfig { limit, chunk, context_reserve: 1 << 20, ..Default::default() };
        let geometries = [
            Geometry { slots: 4, records: 64, devices: vec![device(1 << 30, 2 << 20)] },
            Geometry { slots: 3, records: 1000, devices: vec![device(1 << 30, 2 << 20), device(100, 4096), device(7 << 20, 4096)] },
            Geometry::provisioned(&[1], crate::layout::CONTAINER_CHUNK, 518 << 20, 128),
            Geometry {
                slots: crate::layout::CONTAINER_SLOTS,
                records: crate::layout::CONTAINER_RECORDS,
                devices: vec![device(32 << 30, crate::layout::CONTAINER_CHUNK); 2],
            },
        ];
        for (i, geometry) in geometries.iter().enumerate() {
            let header = file::plan(geometry, CREATOR_HOOK, 1_700_000_000).unwrap();
            let geometries = super::geometries(&header).unwrap();
            let made = |name: &str, repaired: bool| {
                let path = dir.join(format!("{i}-{name}"));
                let _ = std::fs::remove_file(&path);
                let mapped = file::create(&path, &header, |file, mapped| {
                    if repaired {
                        // The creation before: the lock, then a repair of the zeroed file.
                        // SAFETY: the file is new and only this thread can see it.
                        unsafe { crate::lock::RobustMutex::init(std::ptr::addr_of_mut!((*state_ptr(mapped)).lock)) }.unwrap();
                        repair(&mut tables(mapped, &geometries));
                        Ok(())
                    } else {
                        initialise(file, mapped, &geometries)
                    }
                })
                .unwrap();
                drop(mapped);
                let bytes = std::fs::read(&path).unwrap();
                std::fs::remove_file(&path).unwrap();
                bytes
            };
            let (fresh_bytes, repaired_bytes) = (made("fresh", false), made("repaired", true));
            assert_eq!(fresh_bytes.len() as u64, header.total_size);
            assert!(fresh_bytes == repaired_bytes, "geometry {i}: the fresh ledger differs from the repaired one");
            // And it is a valid, empty ledger.
            let path = dir.join(format!("{i}-ledger"));
            let ledger = Ledger::create(&path, geometry, CREATOR_HOOK).unwrap();
            assert!(ledger.check().unwrap().is_empty(), "geometry {i}: {:?}", ledger.check());
            assert_eq!(ledger.repairs().unwrap(), 1);
            drop(ledger);
            std::fs::remove_file(&path).unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
