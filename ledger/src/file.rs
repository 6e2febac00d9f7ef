//! Creating and opening ledger files.
//!
//! Creation is atomic: the file is built and initialised under a temporary name and then
//! hard-linked into place, which fails if a ledger already exists there; no process ever
//! sees a half-initialised ledger, and an existing one is never overwritten.
//!
//! Opening validates the header (read with `pread`, never through a mapping) before
//! anything is mapped: magic, version, sizes, checksum, and that every section lies inside
//! the file without overlapping another. Only the part after the header page is mapped, read
//! and write; the process keeps its validated copy of the header, so limits are never read
//! from memory a workload could write.
use std::{
    fs::{self, File, OpenOptions},
    io,
    os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use crate::{
    buddy,
    error::LedgerError,
    layout::{
        align_up, checksummed_bytes, fnv1a, DeviceConfig, Geometry, Header, Record, Slot, State,
        MAGIC, MAX_CHUNKS, MAX_DEVICES, MAX_RECORDS, MAX_SLOTS, MIN_CHUNK, PAGE, VERSION,
    },
};

/// A validated header and the mapping of the rest of the file.
pub struct Mapped {
    pub header: Header,
    /// Maps file bytes `[PAGE, total_size)`.
    pub map: memmap2::MmapRaw,
    pub path: PathBuf,
}

impl Mapped {
    /// Address of file offset `offset` (which must be at least PAGE and inside the file;
    /// validated offsets only).
    pub fn at(&self, offset: u64) -> *mut u8 {
        debug_assert!(offset >= PAGE && offset <= self.header.total_size);
        // SAFETY: callers pass offsets validated to lie inside [PAGE, total_size], the
        // mapped range, so the result stays inside (or one past) the mapping.
        unsafe { self.map.as_mut_ptr().add((offset - PAGE) as usize) }
    }
}

const ALIGN: u64 = 64;

/// Computes the header (offsets included) for `geometry`, validating it.
pub fn plan(geometry: &Geometry, creator: u32, now_secs: u64) -> Result<Header, LedgerError> {
    let invalid = |what: String| Err(LedgerError::InvalidConfig(what));
    if geometry.devices.is_empty() || geometry.devices.len() > MAX_DEVICES {
        return invalid(format!("a ledger describes 1 to {MAX_DEVICES} devices, not {}", geometry.devices.len()));
    }
    if geometry.slots == 0 || geometry.slots > MAX_SLOTS {
        return invalid(format!("slots must be 1 to {MAX_SLOTS}, not {}", geometry.slots));
    }
    if geometry.records == 0 || geometry.records > MAX_RECORDS {
        return invalid(format!("records must be 1 to {MAX_RECORDS}, not {}", geometry.records));
    }
    let mut header = Header {
        magic: MAGIC,
        version: VERSION,
        header_size: size_of::<Header>() as u32,
        total_size: 0,
        device_count: geometry.devices.len() as u32,
        slot_count: geometry.slots,
        record_count: geometry.records,
        creator,
        state_offset: PAGE,
        slots_offset: 0,
        records_offset: 0,
        created_unix_secs: now_secs,
        devices: [DeviceConfig::default(); MAX_DEVICES],
        checksum: 0,
    };
    let mut end = PAGE + size_of::<State>() as u64;
    header.slots_offset = align_up(end, ALIGN);
    end = header.slots_offset + u64::from(geometry.slots) * size_of::<Slot>() as u64;
    header.records_offset = align_up(end, ALIGN);
    end = header.records_offset + u64::from(geometry.records) * size_of::<Record>() as u64;
    for (index, wanted) in geometry.devices.iter().enumerate() {
        let chunk = wanted.chunk;
        if !chunk.is_power_of_two() || chunk < MIN_CHUNK {
            return invalid(format!("device {index}: chunk {chunk} is not a power of two of at least {MIN_CHUNK}"));
        }
        // The quota is kept in whole chunks: a limit is rounded down to a chunk multiple. A
        // limit of less than one chunk is a device with no space (no buddy words, no links):
        // every charge on it is refused.
        let chunks = wanted.limit / chunk;
        if chunks > MAX_CHUNKS {
            return invalid(format!("device {index}: limit {} is more than {MAX_CHUNKS} chunks of {chunk}", wanted.limit));
        }
        let limit = chunks * chunk;
        let words = match chunks {
            0 => 0,
            _ => buddy::layout_len(limit, chunk).map_err(|error| LedgerError::InvalidConfig(format!("device {index}: {error}")))?,
        };
        let buddy_offset = align_up(end, ALIGN);
        let links_offset = align_up(buddy_offset + words as u64 * 8, ALIGN);
        end = links_offset + chunks * 8;
        header.devices[index] = DeviceConfig {
            uuid: wanted.uuid,
            limit,
            chunk,
            context_reserve: wanted.context_reserve,
            chunks,
            buddy_offset,
            buddy_words: words as u64,
            links_offset,
        };
    }
    header.total_size = align_up(end, PAGE);
    header.checksum = fnv1a(checksummed_bytes(&header));
    Ok(header)
}

/// Checks everything the header says against itself and the file's size.
pub fn validate(header: &Header, file_size: u64, path: &Path) -> Result<(), LedgerError> {
    let corrupt = |what: String| Err(LedgerError::Corrupt { path: path.to_path_buf(), what });
    if header.magic != MAGIC {
        return Err(LedgerError::NotALedger { path: path.to_path_buf() });
    }
    if header.version != VERSION {
        return Err(LedgerError::Version { path: path.to_path_buf(), found: header.version, supported: VERSION });
    }
    if header.header_size as usize != size_of::<Header>() {
        return corrupt(format!("header size {} (expected {})", header.header_size, size_of::<Header>()));
    }
    if header.checksum != fnv1a(checksummed_bytes(header)) {
        return corrupt("header checksum mismatch (the header was modified or damaged)".into());
    }
    if file_size != header.total_size {
        return Err(LedgerError::Truncated { path: path.to_path_buf(), expected: header.total_size, actual: file_size });
    }
    // The layout is a pure function of the header's inputs: recompute it and compare.
    let geometry = Geometry {
        slots: header.slot_count,
        records: header.record_count,
        devices: header.devices.iter().take(header.device_count.min(MAX_DEVICES as u32) as usize).copied().collect(),
    };
    let expected = plan(&geometry, header.creator, header.created_unix_secs)
        .map_err(|error| LedgerError::Corrupt { path: path.to_path_buf(), what: error.to_string() })?;
    if expected.total_size != header.total_size
        || expected.slots_offset != header.slots_offset
        || expected.records_offset != header.records_offset
        || expected.state_offset != header.state_offset
        || expected.devices != header.devices
    {
        return corrupt("section offsets or device fields do not match the layout they describe".into());
    }
    Ok(())
}

/// Creates a ledger at `path` with `init` run on the file and its mapping before it becomes
/// visible.
pub fn create(
    path: &Path,
    header: &Header,
    init: impl FnOnce(&File, &Mapped) -> Result<(), LedgerError>,
) -> Result<Mapped, LedgerError> {
    let io_error = |source: io::Error| LedgerError::Io { path: path.to_path_buf(), source };
    let name = path.file_name().ok_or_else(|| LedgerError::InvalidConfig(format!("{} has no file name", path.display())))?;
    let temporary = path.with_file_name(format!(".{}.creating.{}", name.to_string_lossy(), std::process::id()));
    let _ = fs::remove_file(&temporary);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o666)
        .open(&temporary)
        .map_err(io_error)?;
    // Every process of a container, whatever its uid, shares the ledger: 0666 whatever the
    // creator's umask (fchmod is not masked). Set before the file appears under its name.
    file.set_permissions(fs::Permissions::from_mode(0o666)).map_err(io_error)?;
    let result = (|| {
        file.set_len(header.total_size).map_err(io_error)?;
        file.write_all_at(as_bytes(header), 0).map_err(io_error)?;
        let mapped = map(&file, *header, path)?;
        init(&file, &mapped)?;
        // No msync: every process reaches the file through the same page cache (a shared
        // mapping and pread agree on Linux), and a ledger outlives no reboot of its host (its
        // processes do not), so writing it back to disk first would only cost the first
        // process of every container tens of milliseconds.
        // link(2) fails with EEXIST instead of replacing an existing ledger.
        fs::hard_link(&temporary, path).map_err(|source| match source.kind() {
            io::ErrorKind::AlreadyExists => LedgerError::AlreadyExists { path: path.to_path_buf() },
            _ => io_error(source),
        })?;
        Ok(mapped)
    })();
    let _ = fs::remove_file(&temporary);
    result
}

/// Writes the record table of a new ledger (`header`'s, in `file`, whose bytes are all zero
/// so far) as [`crate::tables::repair`] leaves it: every record free, record `i` linking to
/// record `i + 1`, the last to none. Written with `pwrite` in whole pages from one small
/// buffer, so the kernel fills the pages by its write path (no page read or zeroed first)
/// instead of faulting them in through a mapping one by one: most of a new ledger's pages are
/// its records, and the free list links every one. The pages' bytes outside the table (the
/// end of the slot table before it, the start of the next section after it) are zero in a
/// new file and written as zero.
pub fn write_free_records(file: &File, header: &Header) -> io::Result<()> {
    const WINDOW: u64 = 16 * PAGE;
    const RECORD: u64 = size_of::<Record>() as u64;
    let link = std::mem::offset_of!(Record, next_free) as u64;
    let count = u64::from(header.record_count);
    let (table, table_end) = (header.records_offset, header.records_offset + count * RECORD);
    let end = table_end.next_multiple_of(PAGE).min(header.total_size);
    let mut buffer = vec![0u8; WINDOW as usize];
    let mut at = table / PAGE * PAGE;
    while at < end {
        let len = WINDOW.min(end - at);
        let window = &mut buffer[..len as usize];
        window.fill(0);
        // The records whose link lies in [at, at + len): a link is 4 bytes at an offset that
        // is a multiple of 8 (records start 64-aligned and are a multiple of 8 long), so
        // never split across windows.
        let first = at.saturating_sub(table + link).div_ceil(RECORD);
        for id in first..count {
            let offset = table + id * RECORD + link;
            if offset >= at + len {
                break;
            }
            // Links are record index + 1; 0 ends the list.
            let next = if id + 1 < count { id as u32 + 2 } else { 0 };
            let from = (offset - at) as usize;
            window[from..from + 4].copy_from_slice(&next.to_ne_bytes());
        }
        file.write_all_at(window, at)?;
        at += len;
    }
    Ok(())
}

/// An exclusive `flock` on `.<name>.lock` beside `path`, held until dropped: the turn to
/// create a missing ledger. The small lock file stays.
pub fn creation_lock(path: &Path) -> Result<File, LedgerError> {
    let io_error = |source: io::Error| LedgerError::Io { path: path.to_path_buf(), source };
    let name = path.file_name().ok_or_else(|| LedgerError::InvalidConfig(format!("{} has no file name", path.display())))?;
    let lock_path = path.with_file_name(format!(".{}.lock", name.to_string_lossy()));
    let file = OpenOptions::new().create(true).truncate(false).write(true).mode(0o666).open(&lock_path).map_err(io_error)?;
    // 0666 whatever the umask, for the container's other uids; only its owner can (and needs
    // to) change it, so a failure here is someone else's file, already shared.
    let _ = file.set_permissions(fs::Permissions::from_mode(0o666));
    // SAFETY: flock on a descriptor this function owns; released when the File is dropped.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) } != 0 {
        return Err(io_error(io::Error::last_os_error()));
    }
    Ok(file)
}

/// Opens and validates an existing ledger.
pub fn open(path: &Path) -> Result<Mapped, LedgerError> {
    let io_error = |source: io::Error| LedgerError::Io { path: path.to_path_buf(), source };
    let file = OpenOptions::new().read(true).write(true).open(path).map_err(io_error)?;
    open_file(&file, path)
}

/// Validates the ledger open as `file` (read and write) and maps it; `path` names it in
/// errors. For a process handed the descriptor rather than the path (the agent's ledger
/// worker).
pub fn open_file(file: &File, path: &Path) -> Result<Mapped, LedgerError> {
    let io_error = |source: io::Error| LedgerError::Io { path: path.to_path_buf(), source };
    let size = file.metadata().map_err(io_error)?.len();
    if size < PAGE {
        return Err(LedgerError::Truncated { path: path.to_path_buf(), expected: PAGE, actual: size });
    }
    let header = read_header(file).map_err(io_error)?;
    validate(&header, size, path)?;
    map(file, header, path)
}

/// Writes `host_pid` into slot `slot`'s `host_pid` field through the file (`pwrite`, never a
/// mapping): what the node agent learned from /proc. `header` must be one the caller
/// validated; nothing is read from the file, so a file its workload rewrote or resized cannot
/// turn the write into anything but 4 bytes inside the slot table the validated header
/// describes (out-of-range slots are refused). The field is a hint every reader verifies.
pub fn write_host_pid(file: &File, header: &Header, slot: u32, host_pid: u32) -> io::Result<()> {
    if slot >= header.slot_count {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("slot {slot} is past the ledger's {} slots", header.slot_count)));
    }
    let offset = header.slots_offset + u64::from(slot) * size_of::<Slot>() as u64 + std::mem::offset_of!(Slot, host_pid) as u64;
    file.write_all_at(&host_pid.to_ne_bytes(), offset)
}

/// Maps the ledger open as `file` with `header`, a header the caller validated earlier (the
/// node agent's record of it), whatever the file's own header says now: checked again
/// against the file's size, never read from the file. `path` names it in errors.
pub fn open_file_as(file: &File, header: Header, path: &Path) -> Result<Mapped, LedgerError> {
    let size = file.metadata().map_err(|source| LedgerError::Io { path: path.to_path_buf(), source })?.len();
    validate(&header, size, path)?;
    map(file, header, path)
}

/// The header's bytes (what [`header_from_bytes`] reads back).
pub fn header_bytes(header: &Header) -> &[u8] {
    as_bytes(header)
}

/// A header from `bytes` (exactly its size), unvalidated.
pub fn header_from_bytes(bytes: &[u8]) -> Option<Header> {
    (bytes.len() == size_of::<Header>()).then(|| {
        // SAFETY: exactly size_of::<Header>() bytes; Header is #[repr(C)] of integers and
        // byte arrays, valid for every bit pattern; read_unaligned copes with alignment.
        unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<Header>()) }
    })
}

/// The header `file` (a ledger file) holds now, unvalidated (what [`open`] validates; what
/// the agent compares with the header it validated, to see a file rewritten under its
/// processes).
pub fn read_header(file: &File) -> io::Result<Header> {
    let mut bytes = [0u8; size_of::<Header>()];
    file.read_exact_at(&mut bytes, 0)?;
    // SAFETY: Header is #[repr(C)] of integers and byte arrays only: every bit pattern is a
    // valid value; read_unaligned copes with the byte buffer's alignment.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
}

fn map(file: &File, header: Header, path: &Path) -> Result<Mapped, LedgerError> {
    let map = memmap2::MmapOptions::new()
        .offset(PAGE)
        .len((header.total_size - PAGE) as usize)
        .map_raw(file)
        .map_err(|source| LedgerError::Io { path: path.to_path_buf(), source })?;
    // The tables are read and written at random: a fault reads no pages ahead of it (on a
    // disk's filesystem, a new ledger's first fault would otherwise zero-fill a readahead
    // window of its holes). Advice only: where it is refused, faults read ahead as before.
    // SAFETY: the range is the mapping just made; the advice changes no byte of it.
    let _ = unsafe { libc::madvise(map.as_mut_ptr().cast(), map.len(), libc::MADV_RANDOM) };
    Ok(Mapped { header, map, path: path.to_path_buf() })
}

fn as_bytes(header: &Header) -> &[u8] {
    // SAFETY: Header is #[repr(C)] plain data without padding (checked by the layout's
    // construction: every field is 8-byte sized or paired to 8); reading it as bytes is valid.
    unsafe { std::slice::from_raw_parts((header as *const Header).cast::<u8>(), size_of::<Header>()) }
}
