//! The agent's handle on one ledger file: the descriptor it opened, the header it validated,
//! bounded private copies of the rest ([`ledger::copy`]), host pids written with `pwrite`, and
//! the ledger's confined worker for the operations that need the lock ([`super::worker`]).
use std::{
    fs::{self, File},
    path::{Path, PathBuf},
    sync::Mutex,
};

use ledger::{
    copy::LedgerCopy,
    layout::{Header, Slot},
    Kind, LedgerError, ProcessIdentity, SlotView,
};

use super::{
    directory::FileKey,
    worker::{AccessError, Launcher, Request, Worker},
    Limits,
};

/// The agent's handle on one watched ledger: its descriptor, the header it validated, and
/// its worker. Everything it hands out is a private copy.
pub struct LedgerHandle {
    path: PathBuf,
    pub(super) key: FileKey,
    /// Open read-write (the worker maps it; host pids are written with `pwrite`).
    pub(super) file: File,
    /// The header the agent holds the ledger to: the one it validated when it opened the
    /// file, or, for a file that replaced one still in use at the same path, that one's.
    /// (How the header on disk differs from it is [`super::Ledgers`]'s to know: a handle is
    /// shared by the agent's tasks and never changes.)
    pub(super) validated: Header,
    pub(super) worker: Mutex<Worker>,
    /// The stamp the last scan read with the header ([`LedgerHandle::header_and_stamp`]),
    /// until the periodic sweep after it takes it ([`LedgerHandle::scanned_stamp`]).
    scanned: Mutex<Option<ledger::copy::Stamp>>,
}

/// What a live slot claims, as the reconcile pass reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotClaim {
    pub process: ProcessIdentity,
    /// The host pid the agent recorded (0 until then).
    pub host_pid: u32,
    /// The requested bytes it charges ([`slot_bytes`]).
    pub bytes: u64,
    /// Its context records beyond the first on each device ([`slot_extra_contexts`]).
    pub extra_contexts: u64,
}

/// Requested bytes a slot charges, context excluded (see [`crate::reconcile`]'s module doc).
pub fn slot_bytes(slot: &Slot, devices: usize) -> u64 {
    slot.devices
        .iter()
        .take(devices)
        .flat_map(|device| [Kind::Data, Kind::Small, Kind::Managed].map(|kind| device.bytes[kind as usize]))
        .fold(0u64, u64::saturating_add)
}

/// Bytes of a slot's context records beyond the first on each device (`devices`: its ledger's
/// validated devices, whose reserve each record is).
pub fn slot_extra_contexts(slot: &Slot, devices: &[ledger::layout::DeviceConfig]) -> u64 {
    slot.devices
        .iter()
        .zip(devices)
        .map(|(used, device)| used.bytes[Kind::Context as usize].saturating_sub(device.context_reserve))
        .fold(0u64, u64::saturating_add)
}

impl LedgerHandle {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The header the agent validated (its limits and geometry).
    pub fn header(&self) -> &Header {
        &self.validated
    }

    /// A private copy of the ledger's state and live slots ([`ledger::copy::read`]).
    pub fn copy(&self) -> Result<LedgerCopy, LedgerError> {
        ledger::copy::read(&self.file, &self.validated, &self.path)
    }

    /// The ledger's stamp ([`ledger::copy::stamp`]: one `pread`).
    pub fn stamp(&self) -> Result<ledger::copy::Stamp, LedgerError> {
        ledger::copy::stamp(&self.file, &self.validated, &self.path)
    }

    /// The header the file holds now, read with its stamp in one `pread` where the layout
    /// allows ([`ledger::copy::header_and_stamp`]); the stamp is kept for
    /// [`LedgerHandle::scanned_stamp`].
    pub(super) fn header_and_stamp(&self) -> Result<Header, String> {
        let both = ledger::copy::header_and_stamp(&self.file, &self.validated, &self.path).ok().flatten();
        let header = match both {
            Some((header, stamp)) => {
                *self.scanned.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(stamp);
                header
            }
            None => ledger::file::read_header(&self.file).map_err(|error| error.to_string())?,
        };
        Ok(header)
    }

    /// The stamp the last scan read, if no one took it since; else one read now.
    pub fn scanned_stamp(&self) -> Result<ledger::copy::Stamp, LedgerError> {
        let scanned = self.scanned.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        scanned.map_or_else(|| self.stamp(), Ok)
    }

    /// Copies of the live slots.
    pub fn slots(&self) -> Result<Vec<SlotView>, LedgerError> {
        Ok(self.copy()?.live_slots())
    }

    /// Calls `f` with what every live slot of a fresh copy claims (the reconcile pass's read,
    /// every second). Always a copy, never the last one's claims while the stamp stands: a
    /// workload that writes its own slot around the lock (a slot zeroed under its memory) is
    /// seen by the next pass, within a second, as `tampered`.
    pub fn for_each_claim(&self, mut f: impl FnMut(&SlotClaim)) -> Result<(), LedgerError> {
        let copy = self.copy()?;
        let devices = (self.validated.device_count as usize).min(self.validated.devices.len());
        copy.for_each_live(|_, slot| {
            f(&SlotClaim {
                process: slot.process(),
                host_pid: slot.host_pid,
                bytes: slot_bytes(slot, devices),
                extra_contexts: slot_extra_contexts(slot, &self.validated.devices[..devices]),
            })
        });
        Ok(())
    }

    /// Records the host pid of `slot`'s process in the file (a hint for readers, who verify
    /// it): a `pwrite` inside the slot table the validated header describes.
    pub fn set_host_pid(&self, slot: u32, host_pid: u32) -> std::io::Result<()> {
        ledger::file::write_host_pid(&self.file, &self.validated, slot, host_pid)
    }

    /// Frees `slot` if it still describes `process` ([`ledger::Ledger::reclaim_process`], in
    /// the ledger's worker).
    pub fn reclaim_process(&self, slot: u32, process: ProcessIdentity) -> Result<Option<u64>, AccessError> {
        self.with_worker(|worker, file, header, path| worker.reclaim(file, header, path, slot, process))
    }

    /// Starts the ledger's worker ahead of a call ([`Worker::warm`]), unless one runs or
    /// another thread is using it.
    pub fn warm_worker(&self) -> Result<(), AccessError> {
        let Ok(mut worker) = self.worker.try_lock() else { return Ok(()) };
        worker.warm(&self.file, &self.validated, &self.path)
    }

    /// Whether no worker runs for the ledger (`false` while a thread uses it: it waits for
    /// none).
    pub fn worker_cold(&self) -> bool {
        self.worker.try_lock().is_ok_and(|worker| !worker.running())
    }

    /// Gives `process` a slot ([`ledger::Ledger::register`], in the ledger's worker).
    pub fn register(&self, process: ProcessIdentity) -> Result<u32, AccessError> {
        self.with_worker(|worker, file, header, path| worker.register(file, header, path, process))
    }

    /// [`ledger::Ledger::recharge`], in the ledger's worker.
    pub fn recharge(
        &self,
        slot: u32,
        process: ProcessIdentity,
        device: u32,
        previous: Option<u32>,
        bytes: u64,
    ) -> Result<(Option<u32>, u64), AccessError> {
        let request = Request::Recharge { slot, process: process.into(), device, previous, bytes };
        self.with_worker(|worker, file, header, path| worker.recharge(file, header, path, &request))
    }

    /// Whether the ledger is backed off ([`Worker::backed_off`]); `false` while another thread
    /// uses its worker (a call then waits for that one, as any call does).
    pub fn backed_off(&self) -> bool {
        self.worker.try_lock().is_ok_and(|worker| worker.backed_off())
    }

    /// Whether the ledger's worker process runs now.
    pub fn worker_running(&self) -> bool {
        self.worker.lock().is_ok_and(|worker| worker.running())
    }

    /// Why the ledger's worker is failing, while it is.
    pub fn failing(&self) -> Option<String> {
        self.worker.lock().ok()?.failing()
    }

    /// Why the last call to the ledger's worker failed, if none succeeded since.
    pub fn last_failure(&self) -> Option<String> {
        self.worker.lock().ok()?.last_failure()
    }

    fn with_worker<R>(
        &self,
        f: impl FnOnce(&mut Worker, &File, &Header, &Path) -> Result<R, AccessError>,
    ) -> Result<R, AccessError> {
        let mut worker = self.worker.lock().map_err(|_| AccessError::Worker("its handle was poisoned".into()))?;
        f(&mut worker, &self.file, &self.validated, &self.path)
    }
}

impl LedgerHandle {
    /// The ledger at `path` (an operator's command line: `vramguard reclaim`), opened without
    /// following a final symbolic link, validated within `limits`.
    pub fn open(path: &Path, limits: &Limits) -> Result<LedgerHandle, String> {
        let file = open_no_follow(path, true).map_err(|error| format!("cannot open {}: {error}", path.display()))?;
        let (key, header) = examine(&file, path, limits)?;
        Ok(LedgerHandle::new(path, key, file, header, Launcher::for_ledgers(limits.max_bytes)))
    }

    pub(super) fn new(path: &Path, key: FileKey, file: File, validated: Header, launcher: Launcher) -> LedgerHandle {
        LedgerHandle { path: path.to_path_buf(), key, file, validated, worker: Mutex::new(Worker::new(launcher)), scanned: Mutex::new(None) }
    }

    /// The same file held to `validated` instead, with a worker of its own (a pin that came
    /// after the file was opened).
    pub(super) fn held_to(&self, validated: Header, launcher: Launcher) -> std::io::Result<LedgerHandle> {
        Ok(LedgerHandle::new(&self.path, self.key, self.file.try_clone()?, validated, launcher))
    }
}

/// Opens `path` (given by an operator) for reading, and writing if `write`, without following a
/// final symbolic link and without blocking on a FIFO.
pub fn open_no_follow(path: &Path, write: bool) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
}

/// Checks that `file` (at `path`) is a regular file holding a valid ledger within `limits`:
/// its key and header, or the reason it is not one.
pub(super) fn examine(file: &File, path: &Path, limits: &Limits) -> Result<(FileKey, Header), String> {
    examine_as(file, path, limits, None).map(|(key, header, _)| (key, header))
}

/// [`examine`] for a ledger held to `pinned` (one the agent created) when given: the file must
/// fit that header or be a valid ledger of its own (re-created), and is held to `pinned`
/// either way; its own header is returned to compare. Returns the key, the file's header and
/// the header to hold the ledger to.
pub(super) fn examine_as(file: &File, path: &Path, limits: &Limits, pinned: Option<&Header>) -> Result<(FileKey, Header, Header), String> {
    let metadata = file.metadata().map_err(|error| format!("cannot stat it: {error}"))?;
    if !metadata.is_file() {
        return Err("not a regular file".into());
    }
    if metadata.len() > limits.max_bytes {
        return Err(format!("{} bytes, more than the {} the agent allows (--max-ledger-bytes)", metadata.len(), limits.max_bytes));
    }
    if metadata.len() < ledger::layout::PAGE {
        return Err(LedgerError::Truncated { path: path.to_path_buf(), expected: ledger::layout::PAGE, actual: metadata.len() }.to_string());
    }
    let found = ledger::file::read_header(file).map_err(|error| format!("cannot read its header: {error}"))?;
    // Validation bounds every count by the format's maxima before anything is sized by them.
    let valid = |header: &Header| ledger::file::validate(header, metadata.len(), path).map_err(|error| error.to_string());
    let held = match pinned {
        Some(pinned) if valid(pinned).is_ok() => *pinned,
        Some(pinned) => valid(&found).map(|()| *pinned)?,
        None => valid(&found).map(|()| found)?,
    };
    if let Some(reason) = limits.exceeded_by(&held) {
        return Err(reason);
    }
    Ok((FileKey::of(&metadata), found, held))
}
