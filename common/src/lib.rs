//! Types shared by the eBPF programs (`ebpf/`) and the agent (`agent/`): the keys and values
//! of the accounting maps, the events on the ring buffer, and the names both sides use for
//! them.
//!
//! Everything here is `#[repr(C)]`, padded explicitly and made of plain integers, so the
//! kernel side and user space read the same bytes. With the `user` feature the types
//! implement [`aya::Pod`] so the agent can read them out of maps.
#![no_std]

pub mod extmem;

/// What kind of GPU memory an allocation is, by the family of driver API that made it.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocKind {
    /// `cuMemAlloc_v2`, `cuMemAllocPitch_v2`: ordinary device memory.
    Device = 0,
    /// `cuMemAllocManaged`: unified memory.
    Managed = 1,
    /// `cuMemAllocAsync`, `cuMemAllocFromPoolAsync` (and `_ptsz`): stream-ordered pools.
    Async = 2,
    /// `cuMemCreate`: physical memory of the virtual-memory-management API.
    Vmm = 3,
}

/// Number of [`AllocKind`]s; the length of [`Usage::bytes`].
pub const KIND_COUNT: usize = 4;

impl AllocKind {
    /// Every kind, in index order.
    pub const ALL: [AllocKind; KIND_COUNT] = [
        AllocKind::Device,
        AllocKind::Managed,
        AllocKind::Async,
        AllocKind::Vmm,
    ];

    /// The kind with this index, if there is one.
    pub const fn from_index(index: u32) -> Option<AllocKind> {
        match index {
            0 => Some(AllocKind::Device),
            1 => Some(AllocKind::Managed),
            2 => Some(AllocKind::Async),
            3 => Some(AllocKind::Vmm),
            _ => None,
        }
    }

    /// The short lower-case name used in tables, JSON and metric labels.
    pub const fn name(self) -> &'static str {
        match self {
            AllocKind::Device => "device",
            AllocKind::Managed => "managed",
            AllocKind::Async => "async",
            AllocKind::Vmm => "vmm",
        }
    }
}

/// The namespace an allocation's identifier lives in: device pointers and VMM handles are
/// different things and may collide numerically.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddrSpace {
    /// A `CUdeviceptr`.
    Pointer = 0,
    /// A `CUmemGenericAllocationHandle`.
    Handle = 1,
    /// The start of a VMM mapping (`cuMemMap`) of a recorded handle: its record is not an
    /// allocation (nothing is charged for it) but keeps its handle charged until unmapped.
    Mapping = 2,
}

/// The lifetime of a VMM handle's charge, kept in its record's [`AllocRecord::link`]: the
/// driver's references (`cuMemCreate`, `cuMemRetainAllocationHandle`, each undone by a
/// `cuMemRelease`) in the high 32 bits, its live recorded mappings in the low 32. Every
/// change is one atomic fetch-add; the one that brings the word to exactly 0 deletes the
/// record and uncharges the handle.
pub mod vmm {
    /// One reference.
    pub const REF: u64 = 1 << 32;
    /// One mapping.
    pub const MAP: u64 = 1;
    /// Added once to a handle one of whose mappings could not be recorded (map full, cgroup
    /// at its cap): the word can then never come back to 0, so the handle stays charged
    /// until its process exits (over-counted, never under-counted).
    pub const PINNED: u64 = 1 << 31;
    /// Mappings one `cuMemUnmap` may remove (the driver unmaps a range of whole adjacent
    /// mappings); a longer run is left charged until the process exits.
    pub const MAX_UNMAP_RUN: u32 = 16;
}

/// The life of a device pointer's record ([`AddrSpace::Pointer`]), kept in its
/// [`AllocRecord::link`]: a state in the low two bits and, above them, an epoch that grows
/// every time the record is taken for a new allocation. Every change of state is one
/// compare-and-swap of the whole word, so a probe that read a record can tell whether it is
/// still the record it read, and of two racing probes exactly one changes it.
///
/// A freed pointer's record is kept as a *spare* rather than deleted (at most
/// [`MAX_SPARES_PER_PROCESS`](spare::MAX_SPARES_PER_PROCESS) per process, and none while the
/// cgroup holds more than half its cap of records): drivers hand a freed address out again
/// for the next allocation of its size, which then takes the spare over in place. An
/// allocation and a free then cost map lookups only, where a new record costs a map insert
/// and a delete (each takes a bucket lock and the map's allocator). Spares count against the
/// cgroup's cap of records ([`Usage::spares`]) and go with their process's other records.
pub mod spare {
    /// The record is a live allocation.
    pub const LIVE: u64 = 0;
    /// The record is a spare: its allocation was freed and uncharged.
    pub const SPARE: u64 = 1;
    /// A probe is rewriting the record (it will be live again, or deleted).
    pub const BUSY: u64 = 2;
    /// The state bits.
    pub const STATE: u64 = 3;
    /// One step of the epoch.
    pub const EPOCH: u64 = 4;
    /// Spares one process may keep by default (the agent's `--max-spare-records-per-process`;
    /// 0 keeps none: every free deletes its record).
    pub const MAX_SPARES_PER_PROCESS: u64 = 16;
}

/// `CUmemLocationType`s of host memory (`HOST`, `HOST_NUMA`, `HOST_NUMA_CURRENT`): a
/// `cuMemCreate` located there is not GPU memory and is never charged.
pub const HOST_LOCATION_TYPES: [i32; 3] = [2, 3, 4];
/// Byte offset of `location.type` in `CUmemAllocationProp`.
pub const PROP_LOCATION_TYPE_OFFSET: u64 = 8;

/// Key of the `ALLOCS` map: one live allocation of one process.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocKey {
    /// Process (thread-group) id, as the host sees it.
    pub tgid: u32,
    /// An [`AddrSpace`] as `u32`.
    pub space: u32,
    /// The device pointer or handle the driver returned.
    pub addr: u64,
}

/// Value of the `ALLOCS` map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocRecord {
    /// Bytes charged for this allocation.
    pub size: u64,
    /// The cgroup that was charged.
    pub cgroup_id: u64,
    /// The [`ProcUsage::generation`] of the process that made it; a record whose generation
    /// differs from its tgid's current one belongs to an earlier process with a reused pid.
    pub generation: u64,
    /// An [`AllocKind`] as `u32`.
    pub kind: u32,
    pub _pad: u32,
    /// For a [`AddrSpace::Pointer`] record, its state and epoch ([`spare`]); for a
    /// [`AddrSpace::Handle`] record, the handle's lifetime word ([`vmm`]); for a
    /// [`AddrSpace::Mapping`] record, the handle it maps.
    pub link: u64,
}

/// Value of the `PENDING` map (key: the thread's `pid_tgid`): what a call's entry probe saw,
/// for its return probe to complete. A thread's entry stays in the map between calls and is
/// rewritten in place (`op` [`pending::NONE`] once its return has been seen), so a pair
/// costs two lookups and no insert or delete.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingAlloc {
    /// User address where the driver will write the pointer or handle; for `cuMemMap`, the
    /// mapped address.
    pub out_ptr: u64,
    /// Requested bytes; for a pitched allocation, the height in rows.
    pub size: u64,
    /// For `cuMemAllocPitch_v2`, the user address of the returned pitch; for `cuMemMap`, the
    /// handle; 0 otherwise.
    pub pitch_ptr: u64,
    /// An [`AllocKind`] as `u32`.
    pub kind: u32,
    /// An [`AddrSpace`] as `u32`.
    pub space: u32,
    /// What the return probe completes: a [`pending`] value.
    pub op: u32,
    pub _pad: u32,
}

/// Values of [`PendingAlloc::op`].
pub mod pending {
    /// Nothing: the entry's call has returned (or its entry probe was not seen).
    pub const NONE: u32 = 0;
    /// An allocation: charge it on success.
    pub const ALLOC: u32 = 1;
    /// `cuMemMap`: record the mapping on success.
    pub const MAP: u32 = 2;
    /// `cuMemRetainAllocationHandle`: one more reference on success.
    pub const RETAIN: u32 = 3;
    /// A call that charges nothing (a host-located `cuMemCreate`).
    pub const IGNORE: u32 = 4;
}

/// GPU memory in use, by kind, with call counters. Value of `CGROUP_USAGE` (key: cgroup id)
/// and part of [`ProcUsage`]. Fields are updated with atomic adds; subtraction is the
/// addition of a two's-complement negative, so every field is read as wrapping `u64`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Live bytes by [`AllocKind`] index.
    pub bytes: [u64; KIND_COUNT],
    /// Successful allocations seen.
    pub allocs: u64,
    /// Frees of known allocations seen.
    pub frees: u64,
    /// Allocations charged without a record, because the cgroup was at its cap of live
    /// records (`MAX_RECORDS_PER_CGROUP`) or the node's `ALLOCS` map was full. Their bytes
    /// stay charged (so a cgroup limit still fires) until their process exits, since their
    /// frees cannot be matched. For a cgroup, those of its exited processes are taken off.
    pub unrecorded: u64,
    /// Live records of VMM mappings ([`AddrSpace::Mapping`]); they count against the
    /// cgroup's cap of records with its live allocations.
    pub mapped: u64,
    /// Records of freed device pointers kept for the driver's reuse of the address
    /// ([`spare`]); they count against the cgroup's cap of records too.
    pub spares: u64,
}

impl Usage {
    /// Live bytes of every kind together.
    pub fn total_bytes(&self) -> u64 {
        let mut total: u64 = 0;
        let mut i = 0;
        while i < KIND_COUNT {
            total = total.wrapping_add(self.bytes[i]);
            i += 1;
        }
        total
    }

    /// Allocations not yet freed (with a record: `unrecorded` ones are not in it).
    pub fn live_allocations(&self) -> u64 {
        self.allocs.wrapping_sub(self.frees)
    }

    /// Records this usage holds in `ALLOCS`: live allocations, mappings and spares.
    pub fn live_records(&self) -> u64 {
        self.live_allocations().wrapping_add(self.mapped).wrapping_add(self.spares)
    }
}

/// Value of `PROC_USAGE` (key: tgid): one process's usage and the cgroup it is charged to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcUsage {
    /// The cgroup charged for this process: its cgroup at its first allocation. Charging one
    /// cgroup for the process's whole life keeps per-cgroup usage exact when it exits.
    pub cgroup_id: u64,
    /// Distinguishes this process from an earlier one with the same pid (its first
    /// allocation's `bpf_ktime_get_ns`).
    pub generation: u64,
    pub usage: Usage,
    /// Bytes of stream-ordered allocations (`Async`) this process freed that their pools may
    /// still keep: a free of one adds its size, a new one takes its size off (as far as there
    /// is any: a pool serves it from what it keeps first). Updated without a lock, so a race
    /// of two allocations may take a little too much: read as a signed figure, at least 0.
    /// An upper bound on what the pools keep of what the probes saw: the agent's reconcile
    /// holds it to what the driver says the process holds.
    pub pool_kept: u64,
}

impl ProcUsage {
    /// [`ProcUsage::pool_kept`] read as the signed figure it is, never below 0.
    pub fn pool_kept(&self) -> u64 {
        if (self.pool_kept as i64) < 0 { 0 } else { self.pool_kept }
    }
}

/// What an [`Event`] reports. Allocations and frees are not events: the maps say them, and
/// `STATS` counts them ([`stat::ALLOCS_SEEN`], [`stat::FREES_SEEN`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// The last thread of a process that had GPU memory exited; `size` is what it still held.
    Exit = 3,
    /// The last thread of a process that had imported external memory exited (its import
    /// records are swept by it; an `Exit` of the same process may come too).
    ExternalExit = 4,
}

/// One entry of the `EXITS` ring buffer (exits only, each waking the agent).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// An [`EventKind`] as `u32`.
    pub event: u32,
    /// An [`AllocKind`] as `u32` (0 for exits).
    pub kind: u32,
    pub tgid: u32,
    pub tid: u32,
    pub cgroup_id: u64,
    pub generation: u64,
    /// Pointer or handle (0 for exits).
    pub addr: u64,
    pub size: u64,
    /// When it happened (`bpf_ktime_get_ns`: CLOCK_MONOTONIC), so that the agent times what
    /// follows an exit from the exit itself, not from when it read the event.
    pub at_ns: u64,
}

/// Value of `CGROUP_USAGE` (key: cgroup id): the cgroup's usage, and the limit the entry
/// probes last read for it from `CGROUP_LIMITS`.
///
/// The cache spares the entry probe one map lookup per allocation. It is good for one
/// generation of the limits: the agent writes `LIMITS_ON` (0: no limit anywhere; else a
/// generation) after every change of `CGROUP_LIMITS`, and an entry whose `generation` is not
/// the current one is read again from the map. A probe takes the cache for writing by a
/// compare-and-swap of `generation` to [`LimitCache::WRITING`] and publishes it by writing the
/// generation back last; a reader checks the generation before and after reading the values
/// (else it reads the map), so it never uses a half-written entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CgroupUsage {
    pub usage: Usage,
    pub cache: LimitCache,
}

/// A copy of a cgroup's `CGROUP_LIMITS` entry, or of its absence (see [`CgroupUsage`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitCache {
    /// The `LIMITS_ON` generation the copy was read at; 0: none yet.
    pub generation: u64,
    /// The limit, if `mode` is not [`LimitCache::NONE`].
    pub limit: CgroupLimit,
}

impl LimitCache {
    /// `generation` while a probe writes the entry.
    pub const WRITING: u64 = u64::MAX;
    /// `limit.mode` of a cgroup without a limit.
    pub const NONE: u32 = u32::MAX;
}

/// A cgroup's GPU-memory limit as the eBPF entry probes enforce it (value of
/// `CGROUP_LIMITS`, key: cgroup id).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CgroupLimit {
    /// Bytes the cgroup's live allocations may total.
    pub limit: u64,
    /// [`enforce::AUDIT`] or [`enforce::SIGNAL`].
    pub mode: u32,
    /// The signal sent in [`enforce::SIGNAL`] mode.
    pub signal: u32,
}

/// What an entry probe does with an allocation that would pass its cgroup's limit.
pub mod enforce {
    /// Count it (`STATS[OVER_LIMIT]`), let it through.
    pub const AUDIT: u32 = 0;
    /// Send the limit's signal to the calling process before the driver allocates.
    pub const SIGNAL: u32 = 1;
}

/// Indices into the `STATS` per-CPU array map (the agent sums the CPUs): the kernel side's
/// counts of its own trouble.
pub mod stat {
    /// Allocation and free events lost to a full ring buffer: none since the probes stopped
    /// emitting them (the maps and [`ALLOCS_SEEN`]/[`FREES_SEEN`] say what they said); the
    /// index stays so the agent's `events_lost` keeps its meaning (0).
    pub const EVENTS_LOST: u32 = 0;
    /// Successful allocations neither recorded nor charged: the process's entry could not be
    /// made (`PROC_USAGE` full) or the driver's result could not be read.
    pub const UNTRACKED_ALLOCS: u32 = 1;
    /// Return probes that found no saved entry (the entry probe was attached late).
    pub const ORPHAN_RETURNS: u32 = 2;
    /// Allocations that would have passed their cgroup's limit.
    pub const OVER_LIMIT: u32 = 3;
    /// Signals sent to stop such allocations.
    pub const SIGNALS_SENT: u32 = 4;
    /// Allocations refused a record because their cgroup was at its cap (charged anyway).
    pub const RECORDS_CAPPED: u32 = 5;
    /// Allocations refused a record because `ALLOCS` was full node-wide (charged anyway).
    pub const ALLOCS_FULL: u32 = 6;
    /// Processes whose usage entry could not be made (`PROC_USAGE` full).
    pub const PROCS_FULL: u32 = 7;
    /// Cgroups whose usage entry could not be made (`CGROUP_USAGE` full).
    pub const CGROUPS_FULL: u32 = 8;
    /// Exit events that did not fit in the `EXITS` ring buffer (the agent's sweep still
    /// finds the process gone).
    pub const EXITS_LOST: u32 = 9;
    /// Log lines about trouble not written because their kind had had its
    /// [`trouble::LINES_PER_SECOND`] this second.
    pub const LOG_SUPPRESSED: u32 = 10;
    /// Removed cgroups whose `CGROUP_USAGE` or `CGROUP_LIMITS` entry the `cgroup_rmdir`
    /// tracepoint deleted.
    pub const CGROUPS_REMOVED: u32 = 11;
    /// Allocations the probes charged (with a record or not).
    pub const ALLOCS_SEEN: u32 = 12;
    /// Frees (and VMM handles settled by their last release or unmap) the probes uncharged.
    pub const FREES_SEEN: u32 = 13;
    /// VMM handles left charged until their process exits because a mapping of theirs could
    /// not be recorded (cgroup at its cap, map full) or an unmap could not be matched.
    pub const VMM_PINNED: u32 = 14;
    /// New records whose key did not fit in the `JOURNAL` ring buffer: the agent's index of
    /// records by process misses them, so its `--sweep-ms` timer sweeps the whole map once.
    pub const JOURNAL_LOST: u32 = 15;
    /// Records the probes inserted into `ALLOCS`, and those they deleted: with the agent's
    /// own deletions, the records in the map (counted, so that no one has to read the map
    /// through to know).
    pub const RECORDS_ADDED: u32 = 16;
    pub const RECORDS_DELETED: u32 = 17;
    /// Number of entries.
    pub const LEN: u32 = 18;
}

/// The kinds of kernel-side trouble the programs log (through aya-log), each rate-limited on
/// its own: at most [`trouble::LINES_PER_SECOND`] lines per kind per second, node-wide, so
/// a tenant cannot flood the agent's log. Indices into `LOG_WINDOWS`.
pub mod trouble {
    /// A cgroup at its cap of live allocation records.
    pub const RECORDS_CAPPED: u32 = 0;
    /// `ALLOCS` full node-wide.
    pub const ALLOCS_FULL: u32 = 1;
    /// `PROC_USAGE` full.
    pub const PROCS_FULL: u32 = 2;
    /// `CGROUP_USAGE` full.
    pub const CGROUPS_FULL: u32 = 3;
    /// An exit event dropped (`EXITS` full).
    pub const EXIT_LOST: u32 = 4;
    /// Number of kinds.
    pub const COUNT: u32 = 5;
    /// Lines per kind per second.
    pub const LINES_PER_SECOND: u64 = 5;
}

/// The `JOURNAL` ring buffer: the key of every record the probes insert into `ALLOCS` (or
/// `EXTMEM`), in the layout of an [`AllocKey`], queued without waking the agent
/// (`BPF_RB_NO_WAKEUP`) and read at its next drain. From it the agent keeps an index of each
/// process's records, so that a process's exit costs a sweep of its own records only, never of
/// the whole map. Taking a spare over inserts nothing and journals nothing.
pub mod journal {
    /// [`AllocKey::space`] of a journaled `EXTMEM` key (`addr` is the import's handle).
    pub const EXTERNAL: u32 = 0x100;
    /// Bytes in the ring (an entry takes 24: about 43,000 new records between two drains).
    pub const BYTES: u32 = 1 << 20;
}

/// Value of `LOG_WINDOWS` (key: a [`trouble`] kind): the second (of `bpf_ktime_get_ns`)
/// being counted and the lines of that kind logged in it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogWindow {
    pub second: u64,
    pub lines: u64,
}

/// Names of the maps, programs and globals in the eBPF object.
pub mod names {
    pub const ALLOCS: &str = "ALLOCS";
    pub const PENDING: &str = "PENDING";
    pub const PROC_USAGE: &str = "PROC_USAGE";
    pub const CGROUP_USAGE: &str = "CGROUP_USAGE";
    pub const EXITS: &str = "EXITS";
    pub const STATS: &str = "STATS";
    pub const CGROUP_LIMITS: &str = "CGROUP_LIMITS";
    /// One-word array: non-zero while `CGROUP_LIMITS` may hold an entry (the entry probes
    /// skip the limit check while it is 0).
    pub const LIMITS_ON: &str = "LIMITS_ON";
    /// A program that writes its context's return register: loads only where the kernel lets
    /// uprobes change registers (the "deny" mode's prerequisite).
    pub const DENY_PROBE: &str = "deny_probe";
    /// Global: byte offset of `group_dead` in the `sched_process_exit` record.
    pub const GROUP_DEAD_OFFSET: &str = "GROUP_DEAD_OFFSET";
    pub const PROCESS_EXIT: &str = "process_exit";
    /// Global: live allocation records a cgroup may have in `ALLOCS`.
    pub const MAX_RECORDS_PER_CGROUP: &str = "MAX_RECORDS_PER_CGROUP";
    /// Global: spare records a process may keep (`common::spare`), set at load time.
    pub const MAX_SPARES_PER_PROCESS: &str = "MAX_SPARES_PER_PROCESS";
    /// Globals: byte offsets of `root` and `id` in the `cgroup_rmdir` record.
    pub const RMDIR_ROOT_OFFSET: &str = "RMDIR_ROOT_OFFSET";
    pub const RMDIR_ID_OFFSET: &str = "RMDIR_ID_OFFSET";
    pub const CGROUP_RMDIR: &str = "cgroup_rmdir";
    /// The program on `cgroup:cgroup_mkdir` and `cgroup:cgroup_rename`: counts the tree's
    /// changes in `CGROUP_TREE`.
    pub const CGROUP_TREE_CHANGED: &str = "cgroup_tree_changed";
    /// One-word array: how many times the cgroup2 tree changed (a directory made, removed or
    /// renamed, counted by the `cgroup_mkdir`, `cgroup_rmdir` and `cgroup_rename`
    /// tracepoints). The agent walks the tree only when it moved.
    pub const CGROUP_TREE: &str = "CGROUP_TREE";
    /// Ring buffer of the keys of new records (`crate::journal`).
    pub const JOURNAL: &str = "JOURNAL";
    /// The programs that tell discovery which processes may have a new executable file
    /// mapping (`crate::exec_mapped`): on `sched:sched_process_exec`, on
    /// `syscalls:sys_enter_mmap`, and on `syscalls:sys_enter_mprotect` and
    /// `syscalls:sys_enter_pkey_mprotect`.
    pub const EXEC_STARTED: &str = "exec_started";
    pub const EXEC_MMAP: &str = "exec_mmap";
    pub const EXEC_MPROTECT: &str = "exec_mprotect";
    /// Hash map: the processes (tgid -> 1) with such an event since discovery last took them.
    pub const EXEC_MAPPED: &str = "EXEC_MAPPED";
    /// One-word array: events that found `EXEC_MAPPED` full (discovery then reads every
    /// process's maps).
    pub const EXEC_MAPPED_LOST: &str = "EXEC_MAPPED_LOST";
    pub const ALLOC_RETURN: &str = "alloc_return";
    /// Programs that do nothing, never attached by the agent: `cargo xtask bench` puts them
    /// where the agent puts its own, to measure the kernel's floor (an entry and a return
    /// probe).
    pub const NOP_ENTRY: &str = "nop_entry";
    pub const NOP_RETURN: &str = "nop_return";
}

/// Default capacity of the `ALLOCS` map (live allocations recorded across the node; the
/// agent sets it at load time, `--max-alloc-records`): 64 cgroups at the default cap.
pub const DEFAULT_MAX_ALLOCS: u32 = 1 << 20;
/// Default cap on one cgroup's live allocation records (`--max-alloc-records-per-cgroup`).
pub const DEFAULT_RECORDS_PER_CGROUP: u32 = 1 << 14;
/// Capacity of `PROC_USAGE`: processes with GPU memory at once.
/// What tells discovery which processes to read the maps of (the `EXEC_MAPPED` map, taken
/// and emptied by discovery at each of its scans).
pub mod exec_mapped {
    /// Processes remembered between two scans; an event of another one is lost (counted in
    /// `EXEC_MAPPED_LOST`, and discovery reads every process's maps at its next scan).
    pub const MAX_PIDS: u32 = 8192;
    /// `PROT_EXEC` and `MAP_ANONYMOUS` (the same on every Linux architecture).
    pub const PROT_EXEC: u64 = 0x4;
    pub const MAP_ANONYMOUS: u64 = 0x20;
    /// Byte offsets in a `syscalls:sys_enter_*` record (the common header, the syscall's
    /// number, then each argument as an unsigned long): `prot` is the third argument of
    /// `mmap`, `mprotect` and `pkey_mprotect`, `flags` the fourth of `mmap`.
    pub const PROT_OFFSET: usize = 16 + 2 * 8;
    pub const FLAGS_OFFSET: usize = 16 + 3 * 8;
}

pub const MAX_PROCS: u32 = 1 << 14;
/// Capacity of `CGROUP_USAGE`.
pub const MAX_CGROUPS: u32 = 1 << 12;
/// Bytes in the `EXITS` ring buffer (about 4,600 exits between two drains).
pub const EXITS_BYTES: u32 = 1 << 18;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: each type is #[repr(C)], made only of integers (and arrays of them), with
    // explicit padding fields, so every bit pattern is a valid value and there are no
    // uninitialised padding bytes.
    unsafe impl aya::Pod for super::AllocKey {}
    unsafe impl aya::Pod for super::AllocRecord {}
    unsafe impl aya::Pod for super::PendingAlloc {}
    unsafe impl aya::Pod for super::Usage {}
    unsafe impl aya::Pod for super::ProcUsage {}
    unsafe impl aya::Pod for super::Event {}
    unsafe impl aya::Pod for super::CgroupLimit {}
    unsafe impl aya::Pod for super::CgroupUsage {}
    unsafe impl aya::Pod for super::LogWindow {}
}
