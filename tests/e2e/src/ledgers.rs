//! Reading ledger files from a test, and writing one behind the ledger's back as a workload
//! scribbling on its own mapping would.
use std::{
    fs::{File, OpenOptions},
    mem::{offset_of, size_of},
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use ledger::{
    layout::{checksummed_bytes, fnv1a, Header, Slot, SlotDevice, CREATOR_AGENT, KINDS, SLOT_LIVE},
    DeviceConfig, Geometry, Ledger,
};

use crate::MIB;

/// What the ledger at `path` charges on device 0, in bytes.
pub fn used(path: &Path) -> Result<u64> {
    let ledger = Ledger::open(path)?;
    Ok(ledger.device_usage()?[0].used_chunks * ledger.header().devices[0].chunk)
}

/// (pid, host pid) of each live slot.
pub fn slots(path: &Path) -> Result<Vec<(u32, u32)>> {
    Ok(Ledger::open(path)?.slots()?.into_iter().map(|v| (v.slot.pid, v.slot.host_pid)).collect())
}

/// Writes zero over `devices[0].bytes` of `pid`'s slot in the ledger file at `path`, through
/// the file with `write_at` at the offset the layout gives, not the ledger's API (no lock
/// taken, as a workload writing its own slot down would); returns what the slot charged
/// before.
pub fn zero_slot_bytes(path: &Path, pid: u32) -> Result<u64> {
    Ok(write_slot_bytes(path, pid, [0; KINDS])?.iter().sum())
}

/// Writes `bytes` over `devices[0].bytes` of `pid`'s slot in the ledger file at `path`, as
/// [`zero_slot_bytes`] does (a workload forging its own slot); returns the bytes before.
pub fn write_slot_bytes(path: &Path, pid: u32, bytes: [u64; KINDS]) -> Result<[u64; KINDS]> {
    let ledger = Ledger::open(path)?;
    let view = ledger.slots()?.into_iter().find(|v| v.slot.pid == pid).context("no slot for the process")?;
    let before = view.slot.devices[0].bytes;
    let offset = ledger.header().slots_offset
        + u64::from(view.id) * size_of::<Slot>() as u64
        + offset_of!(Slot, devices) as u64
        + offset_of!(SlotDevice, bytes) as u64;
    let file = OpenOptions::new().write(true).open(path)?;
    let raw: Vec<u8> = bytes.iter().flat_map(|b| b.to_ne_bytes()).collect();
    file.write_all_at(&raw, offset)?;
    let after = Ledger::open(path)?.slots()?.into_iter().find(|v| v.id == view.id).context("the slot vanished")?;
    if after.slot.devices[0].bytes != bytes {
        bail!("the write missed the slot's bytes: {:?}", after.slot.devices[0]);
    }
    Ok(before)
}

/// Creates a ledger at `path` as the agent does (`CREATOR_AGENT`): `slots` process slots,
/// `records` allocation records and one device with a quota of `limit` bytes, 2 MiB chunks
/// and `context_reserve` bytes charged per context. Fails if the file exists.
pub fn create(path: &Path, slots: u32, records: u32, limit: u64, context_reserve: u64) -> Result<()> {
    let device = DeviceConfig { limit, chunk: 2 * MIB, context_reserve, ..Default::default() };
    let geometry = Geometry { slots, records, devices: vec![device] };
    Ledger::create(path, &geometry, CREATOR_AGENT).with_context(|| format!("cannot create the ledger {}", path.display()))?;
    Ok(())
}

/// Finds the live slot of process `pid` (its pid in the slot, or the host pid the agent
/// recorded) in the ledger at `path`, and returns a check of whether that slot still holds
/// the process: it reads the slot's `state` and `pid` with one `pread` of the file, without
/// the ledger's lock, so polling it does not contend with whoever frees the slot.
pub fn slot_watch(path: &Path, pid: u32) -> Result<impl FnMut() -> Result<bool>> {
    let ledger = Ledger::open(path)?;
    let view = ledger
        .slots()?
        .into_iter()
        .find(|v| v.slot.pid == pid || v.slot.host_pid == pid)
        .with_context(|| format!("no live slot of process {pid} in {}", path.display()))?;
    let offset = ledger.header().slots_offset + u64::from(view.id) * size_of::<Slot>() as u64;
    let (state_at, pid_at) = (offset_of!(Slot, state), offset_of!(Slot, pid));
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut bytes = vec![0u8; state_at.max(pid_at) + 4];
    Ok(move || {
        file.read_exact_at(&mut bytes, offset).context("reading the slot")?;
        let word = |at: usize| u32::from_ne_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        Ok(word(state_at) == SLOT_LIVE && word(pid_at) == view.slot.pid)
    })
}

/// The [`ledger::copy::Stamp`] of the ledger file at `path` (the words every locked operation
/// moves), read as the agent reads it.
pub fn stamp(path: &Path) -> Result<ledger::copy::Stamp> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let header = ledger::file::read_header(&file)?;
    Ok(ledger::copy::stamp(&file, &header, path)?)
}

/// [`slots`] read as the agent reads them, from a copy made without the lock: unlike
/// [`slots`] (whose locked read is an operation that moves the stamp), it leaves the file as it
/// was.
pub fn slots_unlocked(path: &Path) -> Result<Vec<(u32, u32)>> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let header = ledger::file::read_header(&file)?;
    Ok(ledger::copy::read(&file, &header, path)?.live_slots().into_iter().map(|v| (v.slot.pid, v.slot.host_pid)).collect())
}

/// Writes a live slot of `process` (no charges, no host pid) over slot `index` of the ledger
/// file at `path` with `pwrite`, without its lock and without moving its mutation counter or
/// its slots' high-water mark: a workload hiding a slot from readers that trust the counter.
pub fn forge_slot(path: &Path, index: u32, process: ledger::ProcessIdentity) -> Result<()> {
    let header = *Ledger::open(path)?.header();
    if index >= header.slot_count {
        bail!("slot {index} is past the {} of {}", header.slot_count, path.display());
    }
    let at = header.slots_offset + u64::from(index) * size_of::<Slot>() as u64;
    let file = OpenOptions::new().write(true).open(path)?;
    // The identity first, the state last (as a hook would fill a slot).
    file.write_all_at(&process.pid.to_ne_bytes(), at + offset_of!(Slot, pid) as u64)?;
    file.write_all_at(&process.pidns.to_ne_bytes(), at + offset_of!(Slot, pidns) as u64)?;
    file.write_all_at(&process.start_time.to_ne_bytes(), at + offset_of!(Slot, start_time) as u64)?;
    file.write_all_at(&0u32.to_ne_bytes(), at + offset_of!(Slot, host_pid) as u64)?;
    file.write_all_at(&0u32.to_ne_bytes(), at + offset_of!(Slot, flags) as u64)?;
    file.write_all_at(&SLOT_LIVE.to_ne_bytes(), at + offset_of!(Slot, state) as u64)?;
    Ok(())
}

/// Rewrites the header of the ledger file at `path` through the file, as a workload could:
/// `change` edits a copy of the header, whose checksum is then recomputed so that a process
/// opening the file afterwards accepts it. Returns the header as it was.
pub fn rewrite_header(path: &Path, change: impl FnOnce(&mut Header)) -> Result<Header> {
    let before = *Ledger::open(path)?.header();
    let mut header = before;
    change(&mut header);
    header.checksum = fnv1a(checksummed_bytes(&header));
    let mut bytes = checksummed_bytes(&header).to_vec();
    bytes.extend_from_slice(&header.checksum.to_ne_bytes());
    OpenOptions::new().write(true).open(path)?.write_all_at(&bytes, 0)?;
    Ok(before)
}

/// The provisioned ledgers' tmpfs mounts (source `vramguard-ledger`) directly under `ledgers`
/// in this process's mount table (the agent mounts in the host's namespace, the tests').
pub fn tmpfs_mounts(ledgers: &Path) -> Result<Vec<PathBuf>> {
    let table = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(table
        .lines()
        .filter(|line| line.contains(" - tmpfs vramguard-ledger "))
        .filter_map(|line| line.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|point| point.parent() == Some(ledgers))
        .collect())
}
