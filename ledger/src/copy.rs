//! Reading a ledger without mapping it or taking its lock: a bounded copy of its shared state
//! and live slots, made with `pread` into private memory and checked against a header the
//! reader validated earlier. This is how the node agent reads ledgers (`docs/security.md`,
//! rule 1): the file is writable by its workload at any moment, so the agent never maps it (a
//! truncated mapping kills the reader with SIGBUS) and never runs the lock's code on it (glibc
//! writes through pointers stored inside a robust mutex).
//!
//! A copy is taken without the lock, so it may catch a mutation half-done: it is retried
//! while the file's mutation counter moves or its `dirty` flag is raised, a few times, and
//! then handed out as [`LedgerCopy::settled`] `false`. Every field of a copy is plain data
//! the workload may have written: callers treat it as a claim to verify (a slot's process
//! against /proc), never as an address, a length to allocate, or a limit. The amount read is
//! bounded by the validated header (its slot count), never by a count in the file.
use std::{fs::File, io, mem::offset_of, os::unix::fs::FileExt, path::Path};

use crate::{
    error::LedgerError,
    layout::{ContainerNames, DeviceUsage, Header, Slot, State, MAX_DEVICES, PAGE, SLOT_LIVE},
    SlotView,
};

/// How many times a copy is retried while a mutation is seen in progress.
const ATTEMPTS: usize = 3;

/// A private copy of a ledger's state and slot table.
#[derive(Clone, Debug)]
pub struct LedgerCopy {
    /// The slot table up to its high-water mark (live and free slots), by index.
    table: Vec<Slot>,
    /// Per-device totals (`device_count` of the validated header).
    pub devices: Vec<DeviceUsage>,
    /// The container's names as a hook recorded them (informational; see [`ContainerNames`]).
    pub names: ContainerNames,
    /// Repairs performed over the file's life (as the file says).
    pub repairs: u64,
    /// Whether the copy saw no mutation in progress (else it may mix two states).
    pub settled: bool,
    /// The file's [`Stamp`] as the copy read it (of its last attempt).
    pub stamp: Stamp,
}

/// The words of a ledger's state that every locked operation moves: its mutation counter
/// (bumped by each), its dirty flag and its slot table's high-water mark, read with one
/// `pread` ([`stamp`]). A stamp equal to the one of an earlier settled copy says that no
/// locked operation ran since; it says nothing of bytes written around the lock (a workload
/// can write its own ledger file as it likes, counter included), so a reader that skips
/// copies on it must still copy now and then (the node agent: `agent/src/ledgers/reclaim.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stamp {
    pub mutations: u64,
    pub slots_in_use: u32,
    pub dirty: u32,
}

/// The bytes of [`State`] that hold a [`Stamp`]: from `dirty` to the end of `mutations`.
const STAMP_START: usize = offset_of!(State, dirty);
const STAMP_END: usize = offset_of!(State, mutations) + size_of::<u64>();

impl Stamp {
    /// The stamp in `bytes`, which start at [`State`]'s `offset` within the state.
    fn of(bytes: &[u8], offset: usize) -> Stamp {
        Stamp {
            mutations: field::<u64>(bytes, offset_of!(State, mutations) - offset),
            slots_in_use: field::<u32>(bytes, offset_of!(State, slots_in_use) - offset),
            dirty: field::<u32>(bytes, offset_of!(State, dirty) - offset),
        }
    }
}

/// The [`Stamp`] of the ledger open as `file` (validated as `header`), with one `pread`.
pub fn stamp(file: &File, header: &Header, path: &Path) -> Result<Stamp, LedgerError> {
    let mut bytes = [0u8; STAMP_END - STAMP_START];
    read_exact(file, &mut bytes, header.state_offset + STAMP_START as u64, header, path)?;
    Ok(Stamp::of(&bytes, STAMP_START))
}

/// The header the file holds now (unvalidated, as [`crate::file::read_header`] reads it) and
/// the ledger's [`Stamp`], with one `pread` from the file's start to the stamp's end (the
/// state follows the header's page); `None` where that is not the layout (two reads then).
pub fn header_and_stamp(file: &File, header: &Header, path: &Path) -> Result<Option<(Header, Stamp)>, LedgerError> {
    let end = header.state_offset as usize + STAMP_END;
    let mut bytes = [0u8; 2 * PAGE as usize];
    if header.state_offset < size_of::<Header>() as u64 || end > bytes.len() {
        return Ok(None);
    }
    read_exact(file, &mut bytes[..end], 0, header, path)?;
    let now = crate::file::header_from_bytes(&bytes[..size_of::<Header>()]);
    Ok(now.map(|now| (now, Stamp::of(&bytes[end - (STAMP_END - STAMP_START)..end], STAMP_START))))
}

impl LedgerCopy {
    /// Calls `f` with every live slot, in place (no copy of the slots).
    pub fn for_each_live(&self, mut f: impl FnMut(u32, &Slot)) {
        for (id, slot) in self.table.iter().enumerate() {
            if slot.state == SLOT_LIVE {
                f(id as u32, slot);
            }
        }
    }

    /// Copies of the live slots.
    pub fn live_slots(&self) -> Vec<SlotView> {
        let mut views = Vec::new();
        self.for_each_live(|id, slot| views.push(SlotView { id, slot: *slot }));
        views
    }
}

/// Copies the state and live slots of the ledger open as `file`, whose header the caller
/// validated as `header` (`path` names it in errors). Fails with [`LedgerError::Truncated`]
/// when the file is no longer the size `header` gives (cut or grown under the reader).
pub fn read(file: &File, header: &Header, path: &Path) -> Result<LedgerCopy, LedgerError> {
    let io_error = |source: io::Error| LedgerError::Io { path: path.to_path_buf(), source };
    let size = file.metadata().map_err(io_error)?.len();
    if size != header.total_size {
        return Err(LedgerError::Truncated { path: path.to_path_buf(), expected: header.total_size, actual: size });
    }
    let mut state = vec![0u8; size_of::<State>()];
    let mut table: Vec<Slot> = Vec::new();
    let mut settled = false;
    for _ in 0..ATTEMPTS {
        read_exact(file, &mut state, header.state_offset, header, path)?;
        let before = (field::<u64>(&state, offset_of!(State, mutations)), field::<u32>(&state, offset_of!(State, dirty)));
        // The high-water mark bounds the read; the validated slot count bounds the mark.
        let used = field::<u32>(&state, offset_of!(State, slots_in_use)).min(header.slot_count) as usize;
        // SAFETY: an all-zero Slot is a valid value (plain integers).
        table.resize(used, unsafe { std::mem::zeroed() });
        read_exact(file, slot_bytes(&mut table), header.slots_offset, header, path)?;
        let mut after = [0u8; 8];
        read_exact(file, &mut after, header.state_offset + offset_of!(State, mutations) as u64, header, path)?;
        if before.1 == 0 && u64::from_ne_bytes(after) == before.0 {
            settled = true;
            break;
        }
    }
    let devices = (0..(header.device_count as usize).min(MAX_DEVICES))
        .map(|device| field::<DeviceUsage>(&state, offset_of!(State, devices) + device * size_of::<DeviceUsage>()))
        .collect();
    Ok(LedgerCopy {
        stamp: Stamp::of(&state, 0),
        table,
        devices,
        names: field(&state, offset_of!(State, names)),
        repairs: field(&state, offset_of!(State, repairs)),
        settled,
    })
}

/// The bytes of `table`, for reading the file's slot table straight into it.
fn slot_bytes(table: &mut [Slot]) -> &mut [u8] {
    // SAFETY: Slot is #[repr(C)] plain integers without padding (its size is a multiple of 8
    // and every field is 4- or 8-byte sized in 8-byte pairs): any bytes written through this
    // slice leave valid Slots; the slice covers exactly the table's memory.
    unsafe { std::slice::from_raw_parts_mut(table.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(table)) }
}

fn read_exact(file: &File, buffer: &mut [u8], offset: u64, header: &Header, path: &Path) -> Result<(), LedgerError> {
    file.read_exact_at(buffer, offset).map_err(|source| match source.kind() {
        // Cut between the size check and the read.
        io::ErrorKind::UnexpectedEof => {
            let actual = file.metadata().map(|m| m.len()).unwrap_or(0);
            LedgerError::Truncated { path: path.to_path_buf(), expected: header.total_size, actual }
        }
        _ => LedgerError::Io { path: path.to_path_buf(), source },
    })
}

/// Plain-data types a copy is read as: `#[repr(C)]` integers and byte arrays only, for which
/// every bit pattern is a valid value.
trait PlainData: Copy {}
impl PlainData for u32 {}
impl PlainData for u64 {}
impl PlainData for DeviceUsage {}
impl PlainData for ContainerNames {}

/// The `T` at `offset` of `bytes` (which must hold it: offsets come from the layout).
fn field<T: PlainData>(bytes: &[u8], offset: usize) -> T {
    let bytes = &bytes[offset..offset + size_of::<T>()];
    // SAFETY: `bytes` holds exactly size_of::<T>() bytes (the slice above panics otherwise),
    // T is plain data valid for any bit pattern (PlainData), and read_unaligned copes with
    // the buffer's alignment.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{layout::CREATOR_AGENT, Charge, DeviceConfig, Geometry, Ledger, ProcessIdentity};

    const MIB: u64 = 1 << 20;

    fn ledger(tag: &str) -> (std::path::PathBuf, Ledger) {
        let path = std::env::temp_dir().join(format!("vramguard-copy-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let geometry = Geometry { slots: 8, records: 64, devices: vec![DeviceConfig { limit: 64 * MIB, chunk: 2 * MIB, ..Default::default() }] };
        (path.clone(), Ledger::create(&path, &geometry, CREATOR_AGENT).expect("create"))
    }

    #[test]
    fn a_copy_holds_what_the_ledger_holds() {
        let (path, ledger) = ledger("same");
        let a = ledger.register(ProcessIdentity { pid: 10, pidns: 1, start_time: 5 }).expect("register");
        let b = ledger.register(ProcessIdentity { pid: 11, pidns: 1, start_time: 6 }).expect("register");
        ledger.reserve(b, 0, Charge::Device(4 * MIB), 0).expect("reserve");
        ledger.reclaim(a).expect("reclaim");
        ledger.set_names(&ContainerNames::new("ns", "pod", "c")).expect("names");
        let file = File::open(&path).expect("open");
        let copy = read(&file, ledger.header(), &path).expect("copy");
        assert!(copy.settled);
        let live = copy.live_slots();
        assert_eq!(live.len(), 1);
        assert_eq!(live[0].id, b);
        assert_eq!(live[0].slot.pid, 11);
        assert_eq!(copy.devices, ledger.device_usage().expect("usage"));
        assert_eq!(copy.devices[0].used_chunks, 2);
        assert_eq!(copy.names.text(), Some(("ns".into(), "pod".into(), "c".into())));
        std::fs::remove_file(&path).expect("rm");
    }

    #[test]
    fn a_cut_or_grown_file_is_refused_and_a_held_dirty_flag_is_unsettled() {
        let (path, ledger) = ledger("cut");
        ledger.register(ProcessIdentity { pid: 10, pidns: 1, start_time: 5 }).expect("register");
        let header = *ledger.header();
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("open");
        // A raised dirty flag (a workload holding it): still read, but not settled.
        file.write_all_at(&1u32.to_ne_bytes(), header.state_offset + offset_of!(State, dirty) as u64).expect("dirty");
        let copy = read(&file, &header, &path).expect("copy");
        assert!(!copy.settled);
        assert_eq!(copy.live_slots().len(), 1);
        // A slots_in_use past the table: bounded by the validated header.
        file.write_all_at(&u32::MAX.to_ne_bytes(), header.state_offset + offset_of!(State, slots_in_use) as u64).expect("mark");
        assert_eq!(read(&file, &header, &path).expect("copy").live_slots().len(), 1);
        file.set_len(header.total_size / 2).expect("truncate");
        assert!(matches!(read(&file, &header, &path), Err(LedgerError::Truncated { .. })));
        file.set_len(header.total_size * 2).expect("grow");
        assert!(matches!(read(&file, &header, &path), Err(LedgerError::Truncated { .. })));
        drop(ledger);
        std::fs::remove_file(&path).expect("rm");
    }

    #[test]
    fn a_stamp_moves_with_each_locked_operation_and_matches_the_copys() {
        let (path, ledger) = ledger("stamp");
        let header = *ledger.header();
        let file = File::open(&path).expect("open");
        let before = stamp(&file, &header, &path).expect("stamp");
        assert_eq!(before, read(&file, &header, &path).expect("copy").stamp);
        let slot = ledger.register(ProcessIdentity { pid: 10, pidns: 1, start_time: 5 }).expect("register");
        let after = stamp(&file, &header, &path).expect("stamp");
        assert_eq!(after.mutations, before.mutations.wrapping_add(1));
        assert_eq!((after.slots_in_use, after.dirty), (slot + 1, 0));
        assert_eq!(after, read(&file, &header, &path).expect("copy").stamp);
        let (now, both) = header_and_stamp(&file, &header, &path).expect("read").expect("the layout");
        assert_eq!((crate::file::header_bytes(&now), both), (crate::file::header_bytes(&header), after));
        // Bytes written around the lock (the host pid here) leave it as it was.
        let writable = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("open");
        crate::file::write_host_pid(&writable, &header, slot, 4242).expect("write");
        assert_eq!(stamp(&file, &header, &path).expect("stamp"), after);
        std::fs::remove_file(&path).expect("rm");
    }

    #[test]
    fn host_pids_are_written_only_inside_the_slot_table() {
        let (path, ledger) = ledger("hostpid");
        let slot = ledger.register(ProcessIdentity { pid: 10, pidns: 1, start_time: 5 }).expect("register");
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("open");
        crate::file::write_host_pid(&file, ledger.header(), slot, 4242).expect("write");
        assert_eq!(ledger.slots().expect("slots")[0].slot.host_pid, 4242);
        assert!(crate::file::write_host_pid(&file, ledger.header(), 8, 1).is_err());
        std::fs::remove_file(&path).expect("rm");
    }
}
