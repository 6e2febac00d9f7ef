//! Reading ledger files from a test, and writing one behind the ledger's back as a workload
//! scribbling on its own mapping would.
use std::{
    fs::OpenOptions,
    mem::{offset_of, size_of},
    os::unix::fs::FileExt,
    path::Path,
};

use anyhow::{bail, Context, Result};
use ledger::{
    layout::{Slot, SlotDevice, KINDS},
    Ledger,
};

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
    let ledger = Ledger::open(path)?;
    let view = ledger.slots()?.into_iter().find(|v| v.slot.pid == pid).context("no slot for the process")?;
    let before = view.slot.devices[0].bytes.iter().sum();
    let offset = ledger.header().slots_offset
        + u64::from(view.id) * size_of::<Slot>() as u64
        + offset_of!(Slot, devices) as u64
        + offset_of!(SlotDevice, bytes) as u64;
    let file = OpenOptions::new().write(true).open(path)?;
    file.write_all_at(&[0u8; 8 * KINDS], offset)?;
    let after = Ledger::open(path)?.slots()?.into_iter().find(|v| v.id == view.id).context("the slot vanished")?;
    if after.slot.devices[0].bytes != [0; KINDS] {
        bail!("the write missed the slot's bytes: {:?}", after.slot.devices[0]);
    }
    Ok(before)
}
