//! The ledger file's byte layout, and the validation of a file's header before anything in
//! it is trusted.
//!
//! ```text
//! offset 0            Header            page 0: magic, version, sizes, offsets, per-device
//!                                       limits; checksummed; read once at open, never
//!                                       mapped (the file itself stays writable: the agent
//!                                       watches for rewrites)
//! offset PAGE         State             the robust lock, the dirty flag, per-device usage,
//!                                       the container's names (informational)
//! slots_offset        [Slot; slots]     one per process
//! records_offset      [Record; records] one per allocation (and per small pool / context)
//! per device          buddy words       the device's buddy space (crate::buddy)
//! per device          links             one u64 per chunk: the block chains of records
//! ```
//!
//! Every section is at an offset stored in the header, 64-byte aligned; all structures are
//! `#[repr(C)]` of fixed-width integers, so every process maps the same bytes the same way.
use crate::{lock::RobustMutex, process::ProcessIdentity};

/// First bytes of every ledger file.
pub const MAGIC: [u8; 8] = *b"VRAMGRD\0";
/// Layout version: bumped on any incompatible change.
pub const VERSION: u32 = 3;
/// The header page; workloads map it read-only.
pub const PAGE: u64 = 4096;
/// Devices one ledger can describe (as HAMi-core's region).
pub const MAX_DEVICES: usize = 16;
/// Most process slots a ledger may have.
pub const MAX_SLOTS: u32 = 1 << 16;
/// Most allocation records a ledger may have.
pub const MAX_RECORDS: u32 = 1 << 22;
/// Smallest chunk (the kernel buddy's minimum page).
pub const MIN_CHUNK: u64 = 4096;
/// Most chunks one device may have: block offsets are kept in 32 bits.
pub const MAX_CHUNKS: u64 = 1 << 24;

/// What a file says about itself. Page 0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Header {
    pub magic: [u8; 8],
    pub version: u32,
    /// `size_of::<Header>()` of the writer.
    pub header_size: u32,
    /// The file's size in bytes.
    pub total_size: u64,
    pub device_count: u32,
    pub slot_count: u32,
    pub record_count: u32,
    /// Who created the file: [`CREATOR_AGENT`] or [`CREATOR_HOOK`].
    pub creator: u32,
    pub state_offset: u64,
    pub slots_offset: u64,
    pub records_offset: u64,
    pub created_unix_secs: u64,
    pub devices: [DeviceConfig; MAX_DEVICES],
    /// FNV-1a over every byte of the header before this field.
    pub checksum: u64,
}

pub const CREATOR_AGENT: u32 = 1;
/// A container's ledger as the hook creates it: process slots.
pub const CONTAINER_SLOTS: u32 = 1024;
/// ... allocation records (also the most a ledger the agent provisions has:
/// [`Geometry::provisioned`]).
pub const CONTAINER_RECORDS: u32 = 1 << 16;
/// Records a provisioned ledger has for each chunk its quota holds ([`Geometry::provisioned`]):
/// every allocation of a chunk or more holds at least one chunk, smaller ones are packed, so
/// this is room for allocations averaging 64 KiB at a 2 MiB chunk.
pub const RECORDS_PER_CHUNK: u64 = 32;
/// The fewest records a provisioned ledger has beyond its processes' pools and contexts.
pub const MIN_RECORDS: u64 = 1024;
/// ... the unit of the buddy allocator, in bytes (every charge is rounded up to it).
pub const CONTAINER_CHUNK: u64 = 2 << 20;
/// ... the charge once per process and device for its CUDA context (an H100's).
pub const CONTAINER_CONTEXT_RESERVE: u64 = 518 << 20;
pub const CREATOR_HOOK: u32 = 2;

/// One device's quota and the places of its buddy space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// The driver's device UUID (zero when the creator did not know it).
    pub uuid: [u8; 16],
    /// Quota in bytes (a multiple of `chunk`; 0 when the quota asked for was less than one
    /// chunk: a device with no space, no buddy words, no links, whose every charge is refused).
    pub limit: u64,
    /// Accounting granularity in bytes (a power of two, at least [`MIN_CHUNK`]).
    pub chunk: u64,
    /// Charged once per process that creates a context on this device.
    pub context_reserve: u64,
    /// `limit / chunk`.
    pub chunks: u64,
    /// Byte offset and length in u64 words of the buddy space.
    pub buddy_offset: u64,
    pub buddy_words: u64,
    /// Byte offset of the `chunks` u64 block links.
    pub links_offset: u64,
}

/// The writable part of the file after the header page.
#[repr(C)]
pub struct State {
    pub lock: RobustMutex,
    /// Non-zero while a mutation is in progress: a lock holder that finds it set (its
    /// predecessor died, or a repair itself died) rebuilds the derived state.
    pub dirty: u32,
    /// Head of the free-record list: record index + 1, 0 when none is free.
    pub free_record: u32,
    /// Every slot at this index or above is free (bounds scans of the slot table).
    pub slots_in_use: u32,
    /// Every record at this index or above is free (bounds scans of the record table).
    pub records_in_use: u32,
    /// Repairs performed over the file's life.
    pub repairs: u64,
    /// Mutations performed over the file's life.
    pub mutations: u64,
    pub devices: [DeviceUsage; MAX_DEVICES],
    /// The container's Kubernetes names, as a hook recorded them (see [`ContainerNames`]).
    pub names: ContainerNames,
}

/// Bytes of each name in [`ContainerNames`].
pub const NAME_BYTES: usize = 64;

/// A container's Kubernetes names (namespace, pod, container), each NUL-padded UTF-8 of at
/// most [`NAME_BYTES`] bytes (no terminating NUL when it fills them all). The hook copies them
/// from the downward API environment (`POD_NAMESPACE`, `POD_NAME`, `CONTAINER_NAME`) when it
/// opens the ledger ([`crate::Ledger::set_names`]); all zero when nobody recorded any.
///
/// They live in the workload's writable mapping: a workload can write anything there, so
/// they are informational only (labels for people), never an identity to enforce on. The
/// agent's identity of a container comes from the kernel (the cgroup path of the slots'
/// processes), and [`crate::Ledger::names`] validates the bytes before handing them out.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContainerNames {
    pub namespace: [u8; NAME_BYTES],
    pub pod: [u8; NAME_BYTES],
    pub container: [u8; NAME_BYTES],
}

impl Default for ContainerNames {
    fn default() -> Self {
        ContainerNames { namespace: [0; NAME_BYTES], pod: [0; NAME_BYTES], container: [0; NAME_BYTES] }
    }
}

impl ContainerNames {
    /// The names, each cut to [`NAME_BYTES`] bytes at a character boundary (a pod name may
    /// have up to 253) and at its first NUL, if any.
    pub fn new(namespace: &str, pod: &str, container: &str) -> ContainerNames {
        ContainerNames { namespace: field(namespace), pod: field(pod), container: field(container) }
    }

    /// Whether no name is recorded.
    pub fn is_empty(&self) -> bool {
        *self == ContainerNames::default()
    }

    /// (namespace, pod, container) as text: each field's bytes up to its first NUL, decoded
    /// as lossy UTF-8. `None` when every field is empty, or when any holds a control
    /// character (not something a hook wrote from the downward API: the bytes are not
    /// trusted at all then).
    pub fn text(&self) -> Option<(String, String, String)> {
        let text = |bytes: &[u8; NAME_BYTES]| -> Option<String> {
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(NAME_BYTES);
            let text = String::from_utf8_lossy(&bytes[..end]).into_owned();
            (!text.chars().any(char::is_control)).then_some(text)
        };
        let names = (text(&self.namespace)?, text(&self.pod)?, text(&self.container)?);
        (!(names.0.is_empty() && names.1.is_empty() && names.2.is_empty())).then_some(names)
    }
}

/// `text` as a NUL-padded field (cut as [`ContainerNames::new`] says).
fn field(text: &str) -> [u8; NAME_BYTES] {
    let text = text.split('\0').next().unwrap_or_default();
    let mut end = text.len().min(NAME_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut bytes = [0; NAME_BYTES];
    bytes[..end].copy_from_slice(&text.as_bytes()[..end]);
    bytes
}

/// Derived per-device totals.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceUsage {
    /// Chunks held by every live record of the device.
    pub used_chunks: u64,
    /// Reservations refused on this device.
    pub rejections: u64,
}

/// Allocation kinds, as the ledger charges them.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A chunk or more: charged whole chunks of its own.
    Data = 0,
    /// Less than a chunk: packed with the process's other small allocations on the device,
    /// which together are charged ceil(live small bytes / chunk) chunks.
    Small = 1,
    /// The per-(process, device) context reserve.
    Context = 2,
    /// Managed (unified) memory.
    Managed = 3,
}

/// Number of [`Kind`]s.
pub const KINDS: usize = 4;

impl Kind {
    pub const ALL: [Kind; KINDS] = [Kind::Data, Kind::Small, Kind::Context, Kind::Managed];

    pub fn from_u32(value: u32) -> Option<Kind> {
        Kind::ALL.get(value as usize).copied()
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Data => "data",
            Kind::Small => "small",
            Kind::Context => "context",
            Kind::Managed => "managed",
        }
    }
}

/// One process.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    /// [`SLOT_FREE`] or [`SLOT_LIVE`].
    pub state: u32,
    /// Pid in the process's own pid namespace.
    pub pid: u32,
    /// Inode of the process's pid namespace (`/proc/self/ns/pid`).
    pub pidns: u64,
    /// Process start time (`/proc/<pid>/stat` field 22): tells a reused pid apart.
    pub start_time: u64,
    /// Pid on the host, filled by the agent (0 until then).
    pub host_pid: u32,
    /// [`SLOT_FORKED`] or 0 (a hint the process writes: see the flag).
    pub flags: u32,
    pub allocs: u64,
    pub frees: u64,
    pub rejections: u64,
    pub devices: [SlotDevice; MAX_DEVICES],
}

pub const SLOT_FREE: u32 = 0;
pub const SLOT_LIVE: u32 = 1;
/// Slot flag: the process forked. A child shares its open device files and keeps its GPU
/// memory after it exits, until the last holder closes them, so its slot is freed only once the
/// driver says so (the agent's reclaimer asks NVML); [`crate::Ledger::reclaim_dead`] leaves
/// it alone. Written by the process (tenant-writable like every field): setting it only
/// delays the reclaim of the writer's own slots until the agent's next driver read.
pub const SLOT_FORKED: u32 = 1;

impl Slot {
    /// The process the slot records.
    pub fn process(&self) -> ProcessIdentity {
        ProcessIdentity { pid: self.pid, pidns: self.pidns, start_time: self.start_time }
    }

    /// Whether the slot is live and records `process`.
    pub fn describes(&self, process: &ProcessIdentity) -> bool {
        self.state == SLOT_LIVE && self.process() == *process
    }
}

/// A slot's usage of one device (derived from its records).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotDevice {
    /// Live requested bytes by [`Kind`].
    pub bytes: [u64; KINDS],
    /// Chunks charged by [`Kind`] (for `Small`: the chunks of the packed small pool).
    pub chunks: [u64; KINDS],
    /// Record index + 1 of the slot's small-pool record on this device (0: none).
    pub small_pool: u32,
    /// Record index + 1 of the slot's context record on this device (0: none).
    pub context: u32,
}

/// One allocation, small pool or context reserve.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// [`RECORD_FREE`], [`RECORD_LIVE`] or [`RECORD_POOL`]. Written last when a record is
    /// made and first when it is dropped: the one store that commits the change.
    pub state: u32,
    pub slot: u32,
    pub device: u32,
    /// A [`Kind`].
    pub kind: u32,
    /// The device pointer or handle (0 for pools and contexts).
    pub ptr: u64,
    /// Requested bytes.
    pub bytes: u64,
    /// Chunks held by the record's blocks.
    pub chunks: u64,
    /// First block of the record's chain: chunk offset + 1, 0 when it holds none.
    pub head: u64,
    /// Next free record + 1 while free.
    pub next_free: u32,
    pub _pad: u32,
}

pub const RECORD_FREE: u32 = 0;
/// A workload's allocation.
pub const RECORD_LIVE: u32 = 1;
/// The chunks of a slot's small pool on one device (its `bytes` is 0).
pub const RECORD_POOL: u32 = 2;

/// Sizes of a ledger to create.
#[derive(Clone, Debug)]
pub struct Geometry {
    pub slots: u32,
    pub records: u32,
    pub devices: Vec<DeviceConfig>,
}

impl Geometry {
    /// The geometry of a ledger the agent provisions for a container: one device at each of
    /// `limits` (bytes; rounded down to `chunk`s, a limit below one chunk is a device with no
    /// space), each charging `context_reserve` per context, with room for `processes` processes
    /// at once (slots) and records that follow the quota: [`RECORDS_PER_CHUNK`] per chunk of
    /// every device, plus a small pool and a context per process and device, at least
    /// [`MIN_RECORDS`] more, at most [`CONTAINER_RECORDS`]. So the file's size follows the
    /// quota and the process bound, never one fixed geometry: a tiny quota costs a few hundred
    /// KiB, the largest a few MiB (the buddy words and links grow with the quota's chunks).
    pub fn provisioned(limits: &[u64], chunk: u64, context_reserve: u64, processes: u32) -> Geometry {
        let chunks: u64 = limits.iter().map(|limit| limit / chunk.max(1)).fold(0, u64::saturating_add);
        let per_process = u64::from(processes).saturating_mul(2 * limits.len() as u64);
        let records = chunks.saturating_mul(RECORDS_PER_CHUNK).saturating_add(per_process).saturating_add(MIN_RECORDS);
        Geometry {
            slots: processes,
            records: records.min(u64::from(CONTAINER_RECORDS)) as u32,
            devices: limits.iter().map(|&limit| DeviceConfig { limit, chunk, context_reserve, ..Default::default() }).collect(),
        }
    }
}

/// Rounds `value` up to a multiple of `align` (a power of two).
pub const fn align_up(value: u64, align: u64) -> u64 {
    (value + align - 1) & !(align - 1)
}

/// FNV-1a 64 of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The header's bytes up to (not including) its checksum.
pub fn checksummed_bytes(header: &Header) -> &[u8] {
    let len = std::mem::offset_of!(Header, checksum);
    // SAFETY: Header is #[repr(C)] plain integers; the first `len` bytes are its fields before
    // `checksum`, and reading them as bytes is valid for its lifetime. Padding bytes inside
    // that range do not exist (every field is 8-aligned or followed by one that pads to 8).
    unsafe { std::slice::from_raw_parts((header as *const Header).cast::<u8>(), len) }
}

const _: () = assert!(std::mem::size_of::<Header>() as u64 <= PAGE);
const _: () = assert!(std::mem::size_of::<Slot>().is_multiple_of(8));
const _: () = assert!(std::mem::size_of::<Record>().is_multiple_of(8));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_cut_to_their_fields() {
        let names = ContainerNames::new("kube-system", "dns-0", "coredns");
        assert!(!names.is_empty());
        assert_eq!(names.text(), Some(("kube-system".into(), "dns-0".into(), "coredns".into())));
        assert!(ContainerNames::default().is_empty());
        assert_eq!(ContainerNames::default().text(), None);
        assert_eq!(ContainerNames::new("", "", "").text(), None);
        assert_eq!(ContainerNames::new("a\0b", "", "").text(), Some(("a".into(), String::new(), String::new())));
        let full = "x".repeat(NAME_BYTES + 10);
        assert_eq!(ContainerNames::new("", &full, "").text().map(|n| n.1.len()), Some(NAME_BYTES));
        let mut raw = ContainerNames::new("ns", "pod", "c");
        raw.pod[3] = 0x1b; // ESC after "pod"
        assert_eq!(raw.text(), None);
        raw.pod[3] = 0xff; // invalid UTF-8: replaced, still printable
        assert_eq!(raw.text().map(|n| n.1), Some("pod\u{fffd}".into()));
    }
}
