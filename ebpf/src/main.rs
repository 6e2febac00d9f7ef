//! vramguard's eBPF programs: GPU-memory accounting from uprobes on libcuda.
//!
//! Each allocation API gets an entry uprobe (one program per API family, which saves the
//! out-pointer and size of the call in the thread's `PENDING` entry, rewritten in place) and
//! the shared return probe `alloc_return` (which, only when the driver returned
//! `CUDA_SUCCESS`, reads the new pointer or handle and charges it). Each free API gets an
//! entry uprobe that uncharges a known allocation. Accounting lives in maps: one record per
//! live allocation keyed by (tgid, space, pointer/handle), usage per process (`PROC_USAGE`)
//! and per cgroup (`CGROUP_USAGE`). A freed device pointer's record is kept as a spare
//! ([`common::spare`]) that the next allocation the driver hands the same address takes over
//! in place: the usual alloc/free cycle then does no map insert or delete. Allocations and
//! frees emit no event (the maps say it all; `STATS` counts them); the `process_exit` tracepoint drops a dead process's usage at once
//! and tells the agent on the `EXITS` ring buffer, which wakes it; the agent then deletes the
//! process's records. It finds them by the `JOURNAL` ring buffer, which carries the key of
//! every record inserted (not of a spare taken over: that inserts nothing), without waking the
//! agent; a full journal is counted (`JOURNAL_LOST`) and makes the agent sweep the whole map
//! once. Inserts and deletes of records are counted (`RECORDS_ADDED`, `RECORDS_DELETED`), so
//! the agent knows how many there are without reading the map through.
//!
//! VMM memory lives as the driver keeps it: a handle's physical memory is charged from
//! `cuMemCreate` until its last reference is released (`cuMemRelease`; references also come
//! from `cuMemRetainAllocationHandle`) *and* its last mapping is unmapped. `cuMemMap` records
//! each mapping (space `Mapping`, keyed by its start address, naming its handle);
//! `cuMemUnmap` removes the run of adjacent mappings that exactly covers its range. The
//! handle record's `link` word counts references and mappings ([`common::vmm`]); whoever
//! brings it to 0 uncharges. A `cuMemCreate` located on the host is not GPU memory and is not
//! charged.
//!
//! Bounded per tenant: a cgroup may have at most `MAX_RECORDS_PER_CGROUP` live records in
//! `ALLOCS`, allocations and mappings together (set by the agent at load time). Past it, an
//! allocation is still charged (the cgroup's limit keeps working) but gets no record
//! (`Usage::unrecorded`), and a mapping gets no record but pins its handle's charge until
//! the process exits: the cgroup is *capped*, and the other cgroups keep being recorded. The `cgroup_rmdir` tracepoint deletes
//! a removed cgroup's `CGROUP_USAGE` and `CGROUP_LIMITS` entries; it, `cgroup_mkdir` and
//! `cgroup_rename` count the cgroup2 tree's changes (`CGROUP_TREE`), which the agent reads to
//! walk the tree only when it changed. Trouble (a full map, a lost
//! event, a capped cgroup) is counted in the per-CPU `STATS` and logged through aya-log, at
//! most `trouble::LINES_PER_SECOND` lines per kind per second (`LOG_WINDOWS`).
//!
//! Discovery is told which processes to read the maps of: `exec_started`, `exec_mmap` and
//! `exec_mprotect` put a process that execs, maps a file with `PROT_EXEC` or adds `PROT_EXEC`
//! to a mapping in `EXEC_MAPPED`, which the agent takes and empties at each scan, and which a
//! process leaves when it exits (a full map is counted in `EXEC_MAPPED_LOST`: the agent then
//! reads every process's maps).
//!
//! The agent decides which symbol each program is attached to (agent/src/kernel/probes.rs).
#![no_std]
#![no_main]
// core's Atomic* types offer no fetch_add or compare_exchange on the BPF target; the
// intrinsics compile to the BPF atomic instructions (the fetching add and compare-and-swap
// need ISA v3: ebpf/.cargo/config.toml).
#![allow(internal_features)]
#![feature(core_intrinsics)]

use core::intrinsics::{atomic_cxchg, atomic_xadd, AtomicOrdering};

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST, BPF_RB_NO_WAKEUP},
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user,
        bpf_send_signal,
    },
    macros::{map, tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::{ProbeContext, RetProbeContext, TracePointContext},
    EbpfContext,
};
use aya_log_ebpf::warn;
use common::extmem::{self, ExtKey, ExtPending, ExtRecord, ExtUsage};
use common::{
    enforce, exec_mapped, journal, pending, spare, stat, trouble, vmm, AddrSpace, AllocKey, AllocKind, AllocRecord, CgroupLimit, CgroupUsage, Event, EventKind,
    LimitCache,
    LogWindow, PendingAlloc, ProcUsage, Usage, DEFAULT_MAX_ALLOCS, DEFAULT_RECORDS_PER_CGROUP, EXITS_BYTES,
    HOST_LOCATION_TYPES, KIND_COUNT, MAX_CGROUPS, MAX_PROCS, PROP_LOCATION_TYPE_OFFSET,
};

/// `EEXIST`, as a map update returns it.
const EEXIST: i32 = -17;

/// Byte offset of `group_dead` in the `sched_process_exit` record, read by the agent from the
/// tracepoint's format file and set at load time. 0 means "not set": exits are then ignored.
#[no_mangle]
static GROUP_DEAD_OFFSET: u32 = 0;

/// Live records a cgroup may have in `ALLOCS` (set by the agent at load time).
#[no_mangle]
static MAX_RECORDS_PER_CGROUP: u64 = DEFAULT_RECORDS_PER_CGROUP as u64;

/// Spare records a process may keep (set by the agent at load time; 0: none).
#[no_mangle]
static MAX_SPARES_PER_PROCESS: u64 = spare::MAX_SPARES_PER_PROCESS;

/// Byte offsets of `root` (the hierarchy: 0 is cgroup2) and `id` in the `cgroup_rmdir`
/// record, read by the agent from the tracepoint's format file; 0: not set (ignored).
#[no_mangle]
static RMDIR_ROOT_OFFSET: u32 = 0;
#[no_mangle]
static RMDIR_ID_OFFSET: u32 = 0;

/// Sized by the agent at load time (`--max-alloc-records`).
#[map]
static ALLOCS: HashMap<AllocKey, AllocRecord> =
    HashMap::with_max_entries(DEFAULT_MAX_ALLOCS, BPF_F_NO_PREALLOC);

/// Per-thread state between a call's entry and return, one entry per thread that ever called,
/// rewritten in place. LRU, so entries of threads that are gone cannot fill it.
#[map]
static PENDING: LruHashMap<u64, PendingAlloc> = LruHashMap::with_max_entries(16384, 0);

#[map]
static PROC_USAGE: HashMap<u32, ProcUsage> =
    HashMap::with_max_entries(MAX_PROCS, BPF_F_NO_PREALLOC);

#[map]
static CGROUP_USAGE: HashMap<u64, CgroupUsage> =
    HashMap::with_max_entries(MAX_CGROUPS, BPF_F_NO_PREALLOC);

/// Exits of processes that had GPU memory (allocations emit no events, so none can crowd an
/// exit out).
#[map]
static EXITS: RingBuf = RingBuf::with_byte_size(EXITS_BYTES, 0);

/// The key of every record inserted into `ALLOCS` or `EXTMEM` (`common::journal`), queued
/// without waking the agent; read at its next drain, so that an exit sweeps only the dead
/// process's own records. A full ring is counted (`JOURNAL_LOST`): the agent then sweeps the
/// whole map once.
#[map]
static JOURNAL: RingBuf = RingBuf::with_byte_size(journal::BYTES, 0);

/// One word: the cgroup2 tree's change count (mkdir, rmdir, rename), read by the agent to
/// walk the tree only when it changed.
#[map]
static CGROUP_TREE: Array<u64> = Array::with_max_entries(1, 0);

/// One zeroed `CgroupUsage` per CPU, from which new cgroup entries are made.
#[map]
static CGROUP_SCRATCH: PerCpuArray<CgroupUsage> = PerCpuArray::with_max_entries(1, 0);

/// Counters of `stat`, per CPU (no contention on the hot paths; the agent sums them).
#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(stat::LEN, 0);

/// Node-wide rate limit of the trouble log, one window per `trouble` kind.
#[map]
static LOG_WINDOWS: Array<LogWindow> = Array::with_max_entries(trouble::COUNT, 0);

/// Per-cgroup limits the entry probes enforce (filled by the agent).
#[map]
static CGROUP_LIMITS: HashMap<u64, CgroupLimit> = HashMap::with_max_entries(MAX_CGROUPS, BPF_F_NO_PREALLOC);

/// One word: 0 while `CGROUP_LIMITS` holds no entry, else the generation of its contents
/// ([`CgroupUsage`]'s cache). The agent makes it non-zero before it pushes a limit, moves it
/// on after every change of the map, and clears it only once it has removed every limit it
/// pushed, so an entry probe that reads 0 can skip the cgroup lookup (an array read the
/// verifier inlines, where the lookup is a helper call and a hash).
#[map]
static LIMITS_ON: Array<u32> = Array::with_max_entries(1, 0);

// ---- entry probes of the allocation APIs -------------------------------------------------

/// `cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)`.
#[uprobe]
pub fn mem_alloc(ctx: ProbeContext) -> u32 {
    save_sized(&ctx, AllocKind::Device, AddrSpace::Pointer)
}

/// `cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)`.
#[uprobe]
pub fn mem_alloc_managed(ctx: ProbeContext) -> u32 {
    save_sized(&ctx, AllocKind::Managed, AddrSpace::Pointer)
}

/// `cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream)` and
/// `cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool, CUstream)`,
/// with their `_ptsz` variants.
#[uprobe]
pub fn mem_alloc_async(ctx: ProbeContext) -> u32 {
    save_sized(&ctx, AllocKind::Async, AddrSpace::Pointer)
}

/// `cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *,
/// unsigned long long flags)`: host-located memory (the property's `location.type`, read from
/// the caller's memory) is not GPU memory and is not charged; anything else is, even a
/// property that cannot be read (the driver then refuses the call, so nothing is charged).
#[uprobe]
pub fn mem_create(ctx: ProbeContext) -> u32 {
    if let Some(prop) = ctx.arg::<u64>(2) {
        // SAFETY: bpf_probe_read_user checks the user address and fails cleanly if it is bad.
        let location = unsafe { bpf_probe_read_user((prop.wrapping_add(PROP_LOCATION_TYPE_OFFSET)) as *const i32) };
        if location.is_ok_and(|t| HOST_LOCATION_TYPES.contains(&t)) {
            return save(Call::new(pending::IGNORE));
        }
    }
    save_sized(&ctx, AllocKind::Vmm, AddrSpace::Handle)
}

/// `cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
/// unsigned int ElementSizeBytes)`: the charge is the returned pitch times the height.
#[uprobe]
pub fn mem_alloc_pitch(ctx: ProbeContext) -> u32 {
    let (Some(out_ptr), Some(pitch_ptr), Some(height)) =
        (ctx.arg::<u64>(0), ctx.arg::<u64>(1), ctx.arg::<u64>(3))
    else {
        return 0;
    };
    // The pitch is not known before the call: the width stands for it.
    if let Some(width) = ctx.arg::<u64>(2) {
        check_limit(width.wrapping_mul(height), false);
    }
    save(Call {
        out_ptr,
        size: height,
        extra: pitch_ptr,
        kind: AllocKind::Device as u32,
        space: AddrSpace::Pointer as u32,
        op: pending::ALLOC,
    })
}

/// `cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle,
/// unsigned long long flags)`: recorded at return, if the driver mapped it.
#[uprobe]
pub fn mem_map(ctx: ProbeContext) -> u32 {
    let (Some(addr), Some(size), Some(handle)) = (ctx.arg::<u64>(0), ctx.arg::<u64>(1), ctx.arg::<u64>(3)) else {
        return 0;
    };
    save(Call { out_ptr: addr, size, extra: handle, ..Call::new(pending::MAP) })
}

/// `cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)`: one more
/// reference on the handle it returns.
#[uprobe]
pub fn mem_retain(ctx: ProbeContext) -> u32 {
    let Some(out_ptr) = ctx.arg::<u64>(0) else {
        return 0;
    };
    save(Call { out_ptr, ..Call::new(pending::RETAIN) })
}

fn save_sized(ctx: &ProbeContext, kind: AllocKind, space: AddrSpace) -> u32 {
    let (Some(out_ptr), Some(size)) = (ctx.arg::<u64>(0), ctx.arg::<u64>(1)) else {
        return 0;
    };
    check_limit(size, matches!(kind, AllocKind::Async));
    save(Call { out_ptr, size, extra: 0, kind: kind as u32, space: space as u32, op: pending::ALLOC })
}

/// Of a stream-ordered allocation of `size` bytes, what the calling process's pools cannot
/// serve from what they keep of what it freed (its `pool_kept`): only that is new memory the
/// driver may take. A pool that keeps what it freed serves the next allocation from it, so
/// a process that takes back its own pool's memory adds nothing to its cgroup and is never
/// stopped for it. The kept figure is an upper bound (a pool with a low release threshold
/// gives memory back at a synchronize no probe sees): what passes here on a figure the driver
/// no longer holds is new memory all the same, counted live at return, and the agent stops
/// the process if the driver confirms its cgroup over its limit
/// (`agent/src/kernel/enforce.rs`).
#[inline(always)]
fn beyond_kept(size: u64) -> u64 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: a plain read of a live map value's field, which changes only atomically.
    let kept = PROC_USAGE.get_ptr(&tgid).map_or(0, |usage| unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*usage).pool_kept)) });
    if kept as i64 <= 0 {
        size
    } else {
        size.saturating_sub(kept)
    }
}

/// If the calling process's cgroup has a limit that `size` more bytes would pass, counts it
/// and, in signal mode, signals the process: the signal is delivered on the way back to user
/// space, before the driver runs, so a fatal one stops the allocation from ever happening.
/// A stream-ordered allocation (`from_pool`) is checked for what its process's pools cannot
/// serve from what they keep ([`beyond_kept`]).
fn check_limit(size: u64, from_pool: bool) {
    // SAFETY: a plain read of a live array element.
    let generation = LIMITS_ON.get_ptr(0).map_or(0, |on| unsafe { core::ptr::read_volatile(on) });
    if generation == 0 {
        return; // no limit pushed: nothing to check
    }
    let size = if from_pool { beyond_kept(size) } else { size };
    if size == 0 {
        return; // served from what the pools keep: nothing new
    }
    // SAFETY: plain helper call without arguments.
    let cgroup_id = unsafe { bpf_get_current_cgroup_id() };
    let cgroup = CGROUP_USAGE.get_ptr_mut(&cgroup_id);
    let limit = match cgroup {
        Some(cgroup) => cached_limit(cgroup, cgroup_id, u64::from(generation)),
        // SAFETY: copied out at once.
        None => (unsafe { CGROUP_LIMITS.get(&cgroup_id) }).copied(),
    };
    let Some(limit) = limit else {
        return;
    };
    // SAFETY: a live map value; its counters are read plainly.
    let used = cgroup.map_or(0, |cgroup| unsafe { (*cgroup).usage.total_bytes() });
    if used.saturating_add(size) <= limit.limit {
        return;
    }
    bump(stat::OVER_LIMIT, 1);
    if limit.mode == enforce::SIGNAL {
        // SAFETY: sends a signal to the current process, which is what this mode is for.
        if unsafe { bpf_send_signal(limit.signal) } == 0 {
            bump(stat::SIGNALS_SENT, 1);
        }
    }
}

/// The cgroup's limit as of `generation`: from the cache in its usage entry if that is of this
/// generation, else from `CGROUP_LIMITS`, then cached (if no other probe is writing the
/// cache). See [`CgroupUsage`] for why a reader never uses a half-written cache.
#[inline(always)]
fn cached_limit(cgroup: *mut CgroupUsage, cgroup_id: u64, generation: u64) -> Option<CgroupLimit> {
    use core::ptr::{addr_of_mut, read_volatile, write_volatile};
    // SAFETY: a live map value; the cache's generation changes only by compare-and-swap (to
    // WRITING) and by the writer that won it, its other fields only in between.
    unsafe {
        let cache = addr_of_mut!((*cgroup).cache);
        let seen = read_volatile(addr_of_mut!((*cache).generation));
        if seen == generation {
            let limit = read_volatile(addr_of_mut!((*cache).limit));
            if read_volatile(addr_of_mut!((*cache).generation)) == generation {
                return (limit.mode != LimitCache::NONE).then_some(limit);
            }
        }
        let fresh = CGROUP_LIMITS.get(&cgroup_id).copied();
        if seen != LimitCache::WRITING && swap_if(addr_of_mut!((*cache).generation), seen, LimitCache::WRITING) {
            let limit = fresh.unwrap_or(CgroupLimit { limit: 0, mode: LimitCache::NONE, signal: 0 });
            write_volatile(addr_of_mut!((*cache).limit), limit);
            write_volatile(addr_of_mut!((*cache).generation), generation);
        }
        fresh
    }
}

/// Writes the thread's pending call: in place when the thread has an entry (every call after
/// its first), else as a new entry.
fn save(call: Call) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if let Some(entry) = PENDING.get_ptr_mut(&pid_tgid) {
        // SAFETY: a live map value, written only by this thread's own probes, which do not
        // run concurrently with each other.
        unsafe { call.write(entry) };
        return 0;
    }
    let mut fresh = core::mem::MaybeUninit::<PendingAlloc>::uninit();
    // SAFETY: every field of the stack value is written before it is read.
    let fresh = unsafe {
        call.write(fresh.as_mut_ptr());
        fresh.assume_init_ref()
    };
    // A failed insert can only mean memory pressure in the kernel; the return probe then
    // counts an orphan return.
    let _ = PENDING.insert(&pid_tgid, fresh, 0);
    0
}

/// The fields of a [`PendingAlloc`], written one by one: a struct literal with zero fields
/// would compile to a call of a byte-wise `memset` (which the verifier also refuses).
#[derive(Clone, Copy)]
struct Call {
    out_ptr: u64,
    size: u64,
    extra: u64,
    kind: u32,
    space: u32,
    op: u32,
}

impl Call {
    const fn new(op: u32) -> Call {
        Call { out_ptr: 0, size: 0, extra: 0, kind: 0, space: 0, op }
    }

    /// # Safety
    /// `to` must be valid for writes of a `PendingAlloc`.
    #[inline(always)]
    unsafe fn write(self, to: *mut PendingAlloc) {
        use core::ptr::{addr_of_mut, write_volatile};
        // SAFETY: the caller's promise.
        unsafe {
            write_volatile(addr_of_mut!((*to).out_ptr), self.out_ptr);
            write_volatile(addr_of_mut!((*to).size), self.size);
            write_volatile(addr_of_mut!((*to).pitch_ptr), self.extra);
            write_volatile(addr_of_mut!((*to).kind), self.kind);
            write_volatile(addr_of_mut!((*to).space), self.space);
            write_volatile(addr_of_mut!((*to).op), self.op);
            write_volatile(addr_of_mut!((*to)._pad), 0);
        }
    }
}

// ---- the shared return probe -------------------------------------------------------------

/// Return of every allocation API, `cuMemMap` and `cuMemRetainAllocationHandle`: on
/// `CUDA_SUCCESS`, complete what the entry saved.
#[uretprobe]
pub fn alloc_return(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(entry) = PENDING.get_ptr_mut(&pid_tgid) else {
        bump(stat::ORPHAN_RETURNS, 1);
        return 0;
    };
    // SAFETY: a live map value, written only by this thread's own probes (see `save`); copied
    // out, then marked done.
    let call = unsafe {
        let call = *entry;
        (*entry).op = pending::NONE;
        call
    };
    // CUresult is a C enum (int): only the low 32 bits of the return register are defined.
    let result: u64 = ctx.ret();
    match call.op {
        pending::NONE => bump(stat::ORPHAN_RETURNS, 1),
        _ if result as u32 != 0 => {} // the driver refused: nothing was allocated
        pending::ALLOC => complete_alloc(&ctx, pid_tgid, &call),
        pending::MAP => record_mapping(&ctx, pid_tgid, call.out_ptr, call.size, call.pitch_ptr),
        pending::RETAIN => {
            // SAFETY: as in complete_alloc.
            if let Ok(handle) = unsafe { bpf_probe_read_user(call.out_ptr as *const u64) } {
                let tgid = (pid_tgid >> 32) as u32;
                if let Some(record) = handle_record(tgid, handle) {
                    step_handle(tgid, handle, record, vmm::REF);
                }
            }
        }
        _ => {} // IGNORE
    }
    0
}

fn complete_alloc(ctx: &RetProbeContext, pid_tgid: u64, call: &PendingAlloc) {
    // SAFETY: bpf_probe_read_user checks the user address and fails cleanly if it is bad.
    let Ok(addr) = (unsafe { bpf_probe_read_user(call.out_ptr as *const u64) }) else {
        bump(stat::UNTRACKED_ALLOCS, 1);
        return;
    };
    let size = if call.pitch_ptr != 0 {
        // SAFETY: as above.
        match unsafe { bpf_probe_read_user(call.pitch_ptr as *const u64) } {
            Ok(pitch) => pitch.wrapping_mul(call.size),
            Err(_) => {
                bump(stat::UNTRACKED_ALLOCS, 1);
                return;
            }
        }
    } else {
        call.size
    };
    record_alloc(ctx, pid_tgid, call.kind, call.space, addr, size);
}

/// The process's and its cgroup's usage entries, made on first use, with the cgroup's id and
/// the process's generation; `None` (counted and logged) if the process's cannot be made. The
/// cgroup's is null if it cannot be made (a null pointer rather than an `Option`: LLVM moves
/// the undefined payload of a `None` between registers, which the verifier refuses).
#[inline(always)]
fn owner<C: EbpfContext>(ctx: &C, tgid: u32, size: u64) -> Option<(*mut ProcUsage, u64, u64, *mut Usage)> {
    let Some(proc_usage) = proc_entry(tgid) else {
        bump(stat::UNTRACKED_ALLOCS, 1);
        bump(stat::PROCS_FULL, 1);
        if may_log(trouble::PROCS_FULL) {
            warn!(ctx, "process usage map full: pid {}'s allocation of {} bytes is not accounted", tgid, size);
        }
        return None;
    };
    // SAFETY: the pointer comes from a successful map lookup and stays valid for this
    // program's run (RCU); the two fields read here are written once, at creation.
    let (cgroup_id, generation) = unsafe { ((*proc_usage).cgroup_id, (*proc_usage).generation) };
    let cgroup = cgroup_entry(cgroup_id).unwrap_or(core::ptr::null_mut());
    if cgroup.is_null() {
        bump(stat::CGROUPS_FULL, 1);
        if may_log(trouble::CGROUPS_FULL) {
            warn!(ctx, "cgroup usage map full: cgroup {} is not accounted", cgroup_id);
        }
    }
    Some((proc_usage, cgroup_id, generation, cgroup))
}

/// Whether the cgroup holds its cap of records (a plain read of counters: a racing update can
/// let a few records more in, never fewer).
fn at_cap(cgroup: *mut Usage) -> bool {
    // SAFETY: null or a live map value; plain reads of counters.
    !cgroup.is_null() && unsafe { (*cgroup).live_records() } as i64 >= max_records_per_cgroup()
}

fn record_alloc<C: EbpfContext>(ctx: &C, pid_tgid: u64, kind: u32, space: u32, addr: u64, size: u64) {
    let tgid = (pid_tgid >> 32) as u32;
    let Some((proc_usage, cgroup_id, generation, cgroup)) = owner(ctx, tgid, size) else {
        return;
    };
    if kind == AllocKind::Async as u32 {
        take_kept(proc_usage, size);
    }
    let key = AllocKey { tgid, space, addr };
    if space == AddrSpace::Pointer as u32 {
        if let Some(existing) = ALLOCS.get_ptr_mut(&key) {
            let recorded = take_over(existing, proc_usage, cgroup, generation, kind, size, cgroup_id);
            // SAFETY: proc_usage is a live map value (see `owner`); the fields are updated atomically.
            charge_new(unsafe { &mut (*proc_usage).usage }, kind, size, recorded);
            if !cgroup.is_null() {
                // SAFETY: as above.
                charge_new(unsafe { &mut *cgroup }, kind, size, recorded);
            }
            bump(stat::ALLOCS_SEEN, 1);
            return;
        }
    }
    // A VMM handle starts with the reference its creation holds.
    let link = if space == AddrSpace::Handle as u32 { vmm::REF } else { 0 };
    let record = AllocRecord { size, cgroup_id, generation, kind, _pad: 0, link };
    let recorded = if at_cap(cgroup) {
        bump(stat::RECORDS_CAPPED, 1);
        if may_log(trouble::RECORDS_CAPPED) {
            warn!(
                ctx,
                "cgroup {} is at its cap of {} allocation records: pid {}'s allocation of {} bytes is charged without a record",
                cgroup_id,
                max_records_per_cgroup(),
                tgid,
                size
            );
        }
        false
    } else {
        match ALLOCS.insert(&key, &record, BPF_NOEXIST as u64) {
            Ok(()) => journal(&key),
            // A device pointer's record made since the lookup above, by a racing probe: the
            // allocation is charged without a record.
            Err(EEXIST) if space == AddrSpace::Pointer as u32 => false,
            Err(EEXIST) => {
                // The driver handed out a handle this process still had on record: the old
                // allocation was freed by a path no probe saw. Retire it (an earlier
                // process's is simply deleted); the new record takes its place (no new
                // entry, so no cap check).
                // SAFETY: the record is copied out at once.
                if let Some(old) = unsafe { ALLOCS.get(&key) }.copied() {
                    if delete(&key) && old.generation == generation {
                        uncharge(proc_usage, &old);
                    }
                }
                ALLOCS.insert(&key, &record, BPF_NOEXIST as u64).is_ok() && journal(&key)
            }
            Err(_) => {
                bump(stat::ALLOCS_FULL, 1);
                if may_log(trouble::ALLOCS_FULL) {
                    warn!(
                        ctx,
                        "allocation records map full: pid {} (cgroup {})'s allocation of {} bytes is charged without a record",
                        tgid,
                        cgroup_id,
                        size
                    );
                }
                false
            }
        }
    };
    // SAFETY: proc_usage is a live map value (see `owner`); the field is updated atomically.
    charge_new(unsafe { &mut (*proc_usage).usage }, kind, size, recorded);
    if !cgroup.is_null() {
        // SAFETY: cgroup is a live map value; the field is updated atomically.
        charge_new(unsafe { &mut *cgroup }, kind, size, recorded);
    }
    bump(stat::ALLOCS_SEEN, 1);
}

/// Makes the record of a device pointer the driver just handed out (again) the record of
/// this allocation, in place: a spare, or a live record whose free no probe saw (a stale one:
/// its allocation is uncharged first). Records of an earlier process with this pid left the
/// books with it and are simply taken. `false` if another probe is rewriting the record (the
/// allocation is then charged without a record).
#[inline(always)]
fn take_over(
    record: *mut AllocRecord,
    proc_usage: *mut ProcUsage,
    cgroup: *mut Usage,
    generation: u64,
    kind: u32,
    size: u64,
    cgroup_id: u64,
) -> bool {
    // SAFETY: a live map value; its word changes only by compare-and-swap, and its other
    // fields only between a successful swap to BUSY and the swap back (see `common::spare`),
    // so the copy is the record the word said once the claim below succeeds.
    let (word, old) = unsafe { (core::ptr::read_volatile(core::ptr::addr_of!((*record).link)), core::ptr::read_volatile(record)) };
    let state = word & spare::STATE;
    // SAFETY: as above.
    if state == spare::BUSY || !unsafe { swap_if(&mut (*record).link, word, (word & !spare::STATE) | spare::BUSY) } {
        return false;
    }
    if old.generation == generation {
        if state == spare::SPARE {
            count_spare(proc_usage, cgroup, 1u64.wrapping_neg());
        } else {
            uncharge_from(proc_usage, cgroup, &old);
        }
    }
    // SAFETY: the record is this probe's until the word is published again.
    unsafe {
        use core::ptr::{addr_of_mut, write_volatile};
        write_volatile(addr_of_mut!((*record).size), size);
        write_volatile(addr_of_mut!((*record).cgroup_id), cgroup_id);
        write_volatile(addr_of_mut!((*record).generation), generation);
        write_volatile(addr_of_mut!((*record).kind), kind);
        write_volatile(addr_of_mut!((*record).link), (word & !spare::STATE).wrapping_add(spare::EPOCH) | spare::LIVE);
    }
    true
}

/// Adds `delta` to the spares of a process and its cgroup (null if it has no entry).
fn count_spare(proc_usage: *mut ProcUsage, cgroup: *mut Usage, delta: u64) {
    // SAFETY: live map values; the fields are updated atomically.
    add(unsafe { &mut (*proc_usage).usage.spares }, delta);
    if !cgroup.is_null() {
        // SAFETY: as above.
        add(unsafe { &mut (*cgroup).spares }, delta);
    }
}

/// Whether a freed pointer's record may be kept as a spare: the process keeps fewer than
/// its share (`MAX_SPARES_PER_PROCESS`) and the cgroup holds less than half its cap of records.
fn may_keep_spare(proc_usage: *mut ProcUsage, cgroup: *mut Usage) -> bool {
    // SAFETY: live map values (or a null cgroup); plain reads of counters.
    unsafe {
        (*proc_usage).usage.spares < core::ptr::read_volatile(&MAX_SPARES_PER_PROCESS)
            && (cgroup.is_null() || ((*cgroup).live_records() as i64) < max_records_per_cgroup() / 2)
    }
}

fn max_records_per_cgroup() -> i64 {
    // SAFETY: a volatile read of a global the loader may have rewritten.
    unsafe { core::ptr::read_volatile(&MAX_RECORDS_PER_CGROUP) as i64 }
}

/// The usage entry of `tgid`, created (charged to the current cgroup) on first use.
fn proc_entry(tgid: u32) -> Option<*mut ProcUsage> {
    if let Some(entry) = PROC_USAGE.get_ptr_mut(&tgid) {
        return Some(entry);
    }
    // On the stack, not in a per-CPU scratch value: a uprobe program runs with migration
    // disabled but may be preempted, and another task's program on this CPU would rewrite the
    // scratch value's cgroup between these lines and the insert.
    let mut fresh = core::mem::MaybeUninit::<ProcUsage>::uninit();
    // SAFETY: every word of the stack value is written before it is read.
    let fresh = unsafe {
        zero_words(fresh.as_mut_ptr());
        core::ptr::write_volatile(core::ptr::addr_of_mut!((*fresh.as_mut_ptr()).cgroup_id), bpf_get_current_cgroup_id());
        core::ptr::write_volatile(core::ptr::addr_of_mut!((*fresh.as_mut_ptr()).generation), bpf_ktime_get_ns());
        fresh.assume_init_ref()
    };
    // Two threads of one process may race here: NOEXIST lets exactly one create it.
    let _ = PROC_USAGE.insert(&tgid, fresh, BPF_NOEXIST as u64);
    PROC_USAGE.get_ptr_mut(&tgid)
}

fn cgroup_entry(cgroup_id: u64) -> Option<*mut Usage> {
    if let Some(entry) = cgroup_usage(cgroup_id) {
        return Some(entry);
    }
    // SAFETY: this CPU's scratch value, never written, so all zero (the cache's generation 0
    // is none).
    let zero = unsafe { &*CGROUP_SCRATCH.get_ptr(0)? };
    let _ = CGROUP_USAGE.insert(&cgroup_id, zero, BPF_NOEXIST as u64);
    cgroup_usage(cgroup_id)
}

/// The usage in `cgroup_id`'s `CGROUP_USAGE` entry, if it has one.
#[inline(always)]
fn cgroup_usage(cgroup_id: u64) -> Option<*mut Usage> {
    // SAFETY: only the field's address is taken.
    CGROUP_USAGE.get_ptr_mut(&cgroup_id).map(|entry| unsafe { core::ptr::addr_of_mut!((*entry).usage) })
}

// ---- VMM handles and mappings ------------------------------------------------------------

/// The live record of `handle` in process `tgid`.
fn handle_record(tgid: u32, handle: u64) -> Option<*mut AllocRecord> {
    ALLOCS.get_ptr_mut(&AllocKey { tgid, space: AddrSpace::Handle as u32, addr: handle })
}

/// Adds `delta` to a handle's lifetime word; the change that brings it to 0 deletes the
/// record and uncharges the handle (only one can: the word changes atomically, and of two
/// deletes only one succeeds).
fn step_handle(tgid: u32, handle: u64, record: *mut AllocRecord, delta: u64) {
    // SAFETY: a live map value, 8-aligned; other CPUs change the word only through atomic
    // adds too.
    let old = unsafe { fetch_add(&mut (*record).link, delta) };
    if old.wrapping_add(delta) == 0 {
        settle(&AllocKey { tgid, space: AddrSpace::Handle as u32, addr: handle });
    }
}

/// Deletes an allocation's record and uncharges it, if this call's delete is the one that
/// succeeds and the record belongs to the process now holding the pid.
fn settle(key: &AllocKey) {
    // SAFETY: the record is copied out at once.
    let Some(record) = (unsafe { ALLOCS.get(key) }).copied() else {
        return; // not an allocation we saw: the driver will say what it is
    };
    // Of two threads freeing the same pointer, only the one whose delete succeeds uncharges.
    if !delete(key) {
        return;
    }
    let Some(proc_usage) = PROC_USAGE.get_ptr_mut(&key.tgid) else {
        return;
    };
    // SAFETY: live map value; generation is written once, at creation.
    if unsafe { (*proc_usage).generation } != record.generation {
        return; // a record left by an earlier process with this pid
    }
    uncharge(proc_usage, &record);
    bump(stat::FREES_SEEN, 1);
}

/// Records a successful `cuMemMap` of a recorded handle: one more mapping on the handle, and
/// a record of the mapping (counted against the cgroup's cap) for `cuMemUnmap` to find. A
/// mapping that cannot be recorded pins the handle's charge until the process exits.
fn record_mapping<C: EbpfContext>(ctx: &C, pid_tgid: u64, addr: u64, size: u64, handle: u64) {
    let tgid = (pid_tgid >> 32) as u32;
    let Some(handle_ptr) = handle_record(tgid, handle) else {
        return; // not a handle we charge (host memory, made before the probes, not this process's)
    };
    let Some((proc_usage, _, generation, cgroup)) = owner(ctx, tgid, size) else {
        return;
    };
    // SAFETY: a live map value; both fields are written once, at creation.
    let (handle_generation, cgroup_id) = unsafe { ((*handle_ptr).generation, (*handle_ptr).cgroup_id) };
    if handle_generation != generation {
        return; // a record left by an earlier process with this pid
    }
    step_handle(tgid, handle, handle_ptr, vmm::MAP);
    let key = AllocKey { tgid, space: AddrSpace::Mapping as u32, addr };
    let record = AllocRecord { size, cgroup_id, generation, kind: AllocKind::Vmm as u32, _pad: 0, link: handle };
    let recorded = !at_cap(cgroup)
        && match ALLOCS.insert(&key, &record, BPF_NOEXIST as u64) {
            Ok(()) => journal(&key),
            Err(EEXIST) => {
                // The driver mapped an address this process still had a mapping on record
                // at: that mapping went by a path no probe saw. Retire it first.
                // SAFETY: the record is copied out at once.
                if let Some(old) = unsafe { ALLOCS.get(&key) }.copied() {
                    if delete(&key) {
                        unlink_mapping(tgid, &old);
                    }
                }
                ALLOCS.insert(&key, &record, BPF_NOEXIST as u64).is_ok() && journal(&key)
            }
            Err(_) => false,
        };
    if !recorded {
        // The handle's word can no longer reach 0: it stays charged until the process exits.
        bump(stat::VMM_PINNED, 1);
        // SAFETY: as in step_handle.
        unsafe { add(&mut (*handle_ptr).link, vmm::PINNED) };
        return;
    }
    // SAFETY: live map values; the fields are updated atomically.
    add(unsafe { &mut (*proc_usage).usage.mapped }, 1);
    if !cgroup.is_null() {
        // SAFETY: as above.
        add(unsafe { &mut (*cgroup).mapped }, 1);
    }
}

/// A mapping record just deleted: one mapping less on its handle and its owners.
fn unlink_mapping(tgid: u32, mapping: &AllocRecord) {
    let Some(proc_usage) = PROC_USAGE.get_ptr_mut(&tgid) else {
        return;
    };
    // SAFETY: live map value; generation is written once, at creation.
    if unsafe { (*proc_usage).generation } != mapping.generation {
        return; // a record left by an earlier process with this pid
    }
    // SAFETY: live map values; the fields are updated atomically.
    add(unsafe { &mut (*proc_usage).usage.mapped }, 1u64.wrapping_neg());
    if let Some(cgroup) = cgroup_usage(mapping.cgroup_id) {
        // SAFETY: as above.
        add(unsafe { &mut (*cgroup).mapped }, 1u64.wrapping_neg());
    }
    if let Some(handle) = handle_record(tgid, mapping.link) {
        // SAFETY: live map value; written once, at creation.
        if unsafe { (*handle).generation } == mapping.generation {
            step_handle(tgid, mapping.link, handle, vmm::MAP.wrapping_neg());
        }
    }
}

/// `cuMemUnmap(CUdeviceptr ptr, size_t size)`: the driver unmaps whole mappings only, so the
/// range is a run of adjacent mappings starting at `ptr`. Only a run of recorded mappings
/// that covers the range exactly is removed (anything else the driver refuses, or leaves
/// something unrecorded mapped: then nothing is uncharged). Done at entry: once the driver
/// has unmapped, another thread may map the address again.
#[uprobe]
pub fn mem_unmap(ctx: ProbeContext) -> u32 {
    let (Some(addr), Some(size)) = (ctx.arg::<u64>(0), ctx.arg::<u64>(1)) else {
        return 0;
    };
    let Some(end) = addr.checked_add(size) else {
        return 0;
    };
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let mut key = AllocKey { tgid, space: AddrSpace::Mapping as u32, addr };
    // First pass: does the run cover [addr, end) exactly?
    let mut at = addr;
    let mut i = 0;
    while i < vmm::MAX_UNMAP_RUN && at < end {
        key.addr = at;
        // SAFETY: a plain read of one field of a live map value.
        let Some(length) = (unsafe { ALLOCS.get(&key) }).map(|m| m.size) else {
            break;
        };
        at = at.wrapping_add(length);
        i += 1;
    }
    if at != end || i == 0 {
        return 0;
    }
    let run = i;
    // Second pass: remove them.
    let mut at = addr;
    let mut i = 0;
    while i < run {
        key.addr = at;
        // SAFETY: the record is copied out at once.
        let Some(mapping) = (unsafe { ALLOCS.get(&key) }).copied() else {
            break; // another thread unmapped it meanwhile
        };
        if delete(&key) {
            unlink_mapping(tgid, &mapping);
        }
        at = at.wrapping_add(mapping.size);
        i += 1;
    }
    0
}

// ---- entry probes of the free APIs -------------------------------------------------------

/// `cuMemFree_v2(CUdeviceptr)`, `cuMemFreeAsync(CUdeviceptr, CUstream)` and `_ptsz`.
///
/// Uncharged at entry, not at return: once the driver has freed the address another thread
/// may receive it again, and a late uncharge would then hit the new allocation.
#[uprobe]
pub fn mem_free(ctx: ProbeContext) -> u32 {
    let Some(addr) = ctx.arg::<u64>(0) else {
        return 0;
    };
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let key = AllocKey { tgid, space: AddrSpace::Pointer as u32, addr };
    let Some(record) = ALLOCS.get_ptr_mut(&key) else {
        return 0; // not an allocation we saw: the driver will say what it is
    };
    // SAFETY: as in take_over: the copy is the record the word said if the swap succeeds.
    let (word, old) = unsafe { (core::ptr::read_volatile(core::ptr::addr_of!((*record).link)), core::ptr::read_volatile(record)) };
    if word & spare::STATE != spare::LIVE {
        return 0; // freed already (a spare), or being rewritten: nothing live here
    }
    let proc_usage = PROC_USAGE.get_ptr_mut(&tgid).unwrap_or(core::ptr::null_mut());
    // SAFETY: null or a live map value; generation is written once, at creation.
    let ours = !proc_usage.is_null() && unsafe { (*proc_usage).generation } == old.generation;
    let cgroup = cgroup_usage(old.cgroup_id).unwrap_or(core::ptr::null_mut());
    if ours && may_keep_spare(proc_usage, cgroup) {
        // SAFETY: a live map value's word, changed only by compare-and-swap.
        if !unsafe { swap_if(&mut (*record).link, word, word | spare::SPARE) } {
            return 0; // another free of it came first
        }
        count_spare(proc_usage, cgroup, 1);
    } else {
        // Claimed first, so that of a racing free and this one only one uncharges.
        // SAFETY: as above.
        if !unsafe { swap_if(&mut (*record).link, word, word | spare::BUSY) } || !delete(&key) {
            return 0;
        }
        if !ours {
            return 0; // a record left by an earlier process with this pid
        }
    }
    uncharge_from(proc_usage, cgroup, &old);
    if old.kind == AllocKind::Async as u32 {
        // The pool it came from may keep it (its release threshold decides).
        // SAFETY: `ours`: a live map value; the field is updated atomically.
        add(unsafe { &mut (*proc_usage).pool_kept }, old.size);
    }
    bump(stat::FREES_SEEN, 1);
    0
}

/// A new stream-ordered allocation of `size` bytes is served by its pool from what it keeps
/// first: as much comes off the process's `pool_kept` (one compare-and-swap; if another
/// allocation raced it, an atomic subtraction, which may take a little too much).
#[inline(always)]
fn take_kept(proc_usage: *mut ProcUsage, size: u64) {
    // SAFETY: a live map value (see `owner`); the field changes only atomically.
    let kept = unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*proc_usage).pool_kept)) };
    if kept as i64 <= 0 {
        return;
    }
    let take = if kept < size { kept } else { size };
    // SAFETY: as above.
    if !unsafe { swap_if(&mut (*proc_usage).pool_kept, kept, kept - take) } {
        // SAFETY: as above.
        add(unsafe { &mut (*proc_usage).pool_kept }, take.wrapping_neg());
    }
}

/// `cuMemRelease(CUmemGenericAllocationHandle)`: one reference less; the handle is uncharged
/// once no reference and no mapping is left. A release of a handle with no reference left on
/// record (which the driver refuses) is undone.
#[uprobe]
pub fn mem_release(ctx: ProbeContext) -> u32 {
    let Some(handle) = ctx.arg::<u64>(0) else {
        return 0;
    };
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let Some(record) = handle_record(tgid, handle) else {
        return 0;
    };
    // SAFETY: as in step_handle.
    let old = unsafe { fetch_add(&mut (*record).link, vmm::REF.wrapping_neg()) };
    if old < vmm::REF {
        // No reference was left: undo (and settle, should a racing unmap have been the last).
        step_handle(tgid, handle, record, vmm::REF);
    } else if old == vmm::REF {
        settle(&AllocKey { tgid, space: AddrSpace::Handle as u32, addr: handle });
    }
    0
}

fn uncharge(proc_usage: *mut ProcUsage, record: &AllocRecord) {
    let cgroup = cgroup_usage(record.cgroup_id).unwrap_or(core::ptr::null_mut());
    uncharge_from(proc_usage, cgroup, record);
}

/// Uncharges `record` from its process and its cgroup (null if it has no entry).
fn uncharge_from(proc_usage: *mut ProcUsage, cgroup: *mut Usage, record: &AllocRecord) {
    // SAFETY: live map value; fields are updated atomically.
    charge(unsafe { &mut (*proc_usage).usage }, record.kind, record.size, true);
    if !cgroup.is_null() {
        // SAFETY: live map value; fields are updated atomically.
        charge(unsafe { &mut *cgroup }, record.kind, record.size, true);
    }
}

// ---- the kernel's floor, for the benchmark -----------------------------------------------

/// Does nothing: `cargo xtask bench` attaches it where the agent attaches its entry probes,
/// to measure what a uprobe costs before any work. Never attached by the agent.
#[uprobe]
pub fn nop_entry(_ctx: ProbeContext) -> u32 {
    0
}

/// Does nothing, as [`nop_entry`], on the return of a call.
#[uretprobe]
pub fn nop_return(_ctx: RetProbeContext) -> u32 {
    0
}

// ---- deny mode detection --------------------------------------------------------------

/// Never attached: the agent only loads it, to learn whether this kernel lets a uprobe
/// program write its context (so that an entry probe could make a call return
/// `CUDA_ERROR_OUT_OF_MEMORY` without reaching the driver). Kernels that do not allow it
/// refuse to load it.
#[uprobe]
pub fn deny_probe(ctx: ProbeContext) -> u32 {
    // SAFETY: a write into the probe's own register context; the verifier decides whether
    // this program may exist at all.
    unsafe { core::ptr::write_volatile(core::ptr::addr_of_mut!((*ctx.regs).rax), 2) };
    0
}

// ---- process exit ------------------------------------------------------------------------

/// `sched:sched_process_exit`, once per exiting thread; acts when the whole process is gone.
#[tracepoint]
pub fn process_exit(ctx: TracePointContext) -> u32 {
    if !group_dead(&ctx) {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // A dead process's maps need no reading: a storm of short-lived processes that map
    // executable files must not fill the map for the scan (and force a read of every process's).
    let _ = EXEC_MAPPED.remove(&tgid);
    // SAFETY: copied out at once.
    let Some(dead) = (unsafe { PROC_USAGE.get(&tgid) }).copied() else {
        return 0; // never had GPU memory
    };
    if let Some(cgroup) = cgroup_usage(dead.cgroup_id) {
        let mut i = 0;
        while i < KIND_COUNT {
            // SAFETY: live map value; fields are updated atomically.
            add(unsafe { &mut (*cgroup).bytes[i] }, dead.usage.bytes[i].wrapping_neg());
            i += 1;
        }
        // Its live allocations end with it: count them as freed so allocs - frees stays the
        // number of live allocations in the cgroup; its unrecorded ones end too.
        // SAFETY: as above.
        add(unsafe { &mut (*cgroup).frees }, dead.usage.live_allocations());
        // SAFETY: as above.
        add(unsafe { &mut (*cgroup).unrecorded }, dead.usage.unrecorded.wrapping_neg());
        // Its mapping records go with its other records (the agent's sweep deletes them).
        // SAFETY: as above.
        add(unsafe { &mut (*cgroup).mapped }, dead.usage.mapped.wrapping_neg());
        // SAFETY: as above.
        add(unsafe { &mut (*cgroup).spares }, dead.usage.spares.wrapping_neg());
    }
    let _ = PROC_USAGE.remove(&tgid);
    emit_exit(&ctx, EventKind::Exit, pid_tgid, dead.cgroup_id, dead.generation, dead.usage.total_bytes());
    0
}

/// Whether this `sched_process_exit` is the exit of the whole process (its last thread).
#[inline(always)]
fn group_dead(ctx: &TracePointContext) -> bool {
    // SAFETY: a volatile read of a global the loader may have rewritten.
    let offset = unsafe { core::ptr::read_volatile(&GROUP_DEAD_OFFSET) };
    if offset == 0 || offset > 256 {
        return false;
    }
    // SAFETY: bpf_probe_read_kernel of one byte inside the tracepoint record.
    let group_dead: Result<u8, _> = unsafe { ctx.read_at(offset as usize) };
    group_dead.is_ok_and(|value| value != 0)
}

// ---- cgroup removal ----------------------------------------------------------------------

/// `cgroup:cgroup_rmdir`: a removed cgroup2 cgroup's usage and limit entries go with it (an id
/// is never reused while the node runs, so nothing else would ever delete them).
#[tracepoint]
pub fn cgroup_rmdir(ctx: TracePointContext) -> u32 {
    // SAFETY: volatile reads of globals the loader may have rewritten.
    let (root_offset, id_offset) =
        unsafe { (core::ptr::read_volatile(&RMDIR_ROOT_OFFSET), core::ptr::read_volatile(&RMDIR_ID_OFFSET)) };
    if root_offset == 0 || id_offset == 0 || root_offset > 256 || id_offset > 256 {
        return 0;
    }
    // SAFETY: bpf_probe_read_kernel of fields inside the tracepoint record.
    let (Ok(root), Ok(id)) = (unsafe { ctx.read_at::<i32>(root_offset as usize) }, unsafe {
        ctx.read_at::<u64>(id_offset as usize)
    }) else {
        return 0;
    };
    // Hierarchy 0 is cgroup2, whose ids bpf_get_current_cgroup_id returns; a v1 hierarchy's
    // ids are another numbering.
    if root != 0 {
        return 0;
    }
    tree_changed();
    let usage = CGROUP_USAGE.remove(&id).is_ok();
    let limit = CGROUP_LIMITS.remove(&id).is_ok();
    if usage || limit {
        bump(stat::CGROUPS_REMOVED, 1);
    }
    0
}

/// `cgroup:cgroup_mkdir` and `cgroup:cgroup_rename` (one record layout, the `cgroup` class's,
/// so `cgroup_rmdir`'s offsets): a cgroup2 directory made or renamed moves the tree's change
/// count on, which tells the agent to walk the tree again (it never walks an unchanged one).
#[tracepoint]
pub fn cgroup_tree_changed(ctx: TracePointContext) -> u32 {
    // SAFETY: a volatile read of a global the loader may have rewritten.
    let root_offset = unsafe { core::ptr::read_volatile(&RMDIR_ROOT_OFFSET) };
    if root_offset == 0 || root_offset > 256 {
        return 0;
    }
    // SAFETY: bpf_probe_read_kernel of a field inside the tracepoint record.
    if unsafe { ctx.read_at::<i32>(root_offset as usize) }.is_ok_and(|root| root == 0) {
        tree_changed();
    }
    0
}

/// One more change of the cgroup2 tree.
#[inline(always)]
fn tree_changed() {
    if let Some(count) = CGROUP_TREE.get_ptr_mut(0) {
        // SAFETY: an array element, valid and 8-aligned for the program's run; every writer
        // adds atomically.
        add(unsafe { &mut *count }, 1);
    }
}

// ---- external memory: visible, never charged ----------------------------------------------
//
// `cuImportExternalMemory` brings in memory another API (Vulkan, D3D, an fd, NvSciBuf)
// exported: it belongs to the exporter and is not charged to any quota, but it is kept here
// (apart from the accounting maps, which no limit reads) so the agent can show it. One record
// per imported handle (at most `MAX_RECORDS_PER_CGROUP` per cgroup), totals per process and
// per cgroup; `ext_exit` takes a dead process's totals out of its cgroup's, and the agent's
// sweep deletes its records.

#[map]
static EXTMEM: HashMap<ExtKey, ExtRecord> = HashMap::with_max_entries(extmem::MAX_RECORDS, BPF_F_NO_PREALLOC);

/// Per-thread `cuImportExternalMemory` between entry and return (LRU: gone threads' entries
/// cannot fill it).
#[map]
static EXTMEM_PENDING: LruHashMap<u64, ExtPending> = LruHashMap::with_max_entries(4096, 0);

#[map]
static EXTMEM_PROCS: HashMap<u32, ExtUsage> = HashMap::with_max_entries(MAX_PROCS, BPF_F_NO_PREALLOC);

#[map]
static EXTMEM_CGROUPS: HashMap<u64, ExtUsage> = HashMap::with_max_entries(MAX_CGROUPS, BPF_F_NO_PREALLOC);

/// `cuImportExternalMemory(CUexternalMemory *extMem_out, const
/// CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR *memHandleDesc)`: saves the out pointer and the
/// descriptor's `size` (read from the caller's memory; a descriptor that cannot be read is one
/// the driver refuses too).
#[uprobe]
pub fn ext_import(ctx: ProbeContext) -> u32 {
    let (Some(out_ptr), Some(desc)) = (ctx.arg::<u64>(0), ctx.arg::<u64>(1)) else {
        return 0;
    };
    // SAFETY: bpf_probe_read_user checks the user address and fails cleanly if it is bad.
    let size = unsafe { bpf_probe_read_user(desc.wrapping_add(extmem::DESCRIPTOR_SIZE_OFFSET) as *const u64) };
    let pending = ExtPending { out_ptr, size: size.unwrap_or(0) };
    let _ = EXTMEM_PENDING.insert(&bpf_get_current_pid_tgid(), &pending, 0);
    0
}

/// Return of `cuImportExternalMemory`: on `CUDA_SUCCESS`, records the handle it wrote.
#[uretprobe]
pub fn ext_import_return(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: copied out at once.
    let Some(pending) = (unsafe { EXTMEM_PENDING.get(&pid_tgid) }).copied() else {
        return 0;
    };
    let _ = EXTMEM_PENDING.remove(&pid_tgid);
    let result: u64 = ctx.ret();
    if result as u32 != 0 {
        return 0;
    }
    // SAFETY: bpf_probe_read_user checks the user address and fails cleanly if it is bad.
    let Ok(handle) = (unsafe { bpf_probe_read_user(pending.out_ptr as *const u64) }) else {
        return 0;
    };
    let tgid = (pid_tgid >> 32) as u32;
    let Some(proc_usage) = ext_entry(&EXTMEM_PROCS, &tgid, true) else {
        return 0;
    };
    // SAFETY: a live map value; these two fields are written once, at creation.
    let (cgroup_id, generation) = unsafe { ((*proc_usage).cgroup_id, (*proc_usage).generation) };
    let Some(cgroup) = ext_entry(&EXTMEM_CGROUPS, &cgroup_id, false) else {
        return 0;
    };
    // SAFETY: a plain read of a counter of a live map value.
    if unsafe { (*cgroup).imports } as i64 >= max_records_per_cgroup() {
        // SAFETY: live map values; the fields are updated atomically.
        unsafe {
            add(&mut (*cgroup).unrecorded, 1);
            add(&mut (*proc_usage).unrecorded, 1);
        }
        return 0;
    }
    let record = ExtRecord { size: pending.size, cgroup_id, generation };
    if EXTMEM.insert(&ExtKey { tgid, _pad: 0, handle }, &record, BPF_NOEXIST as u64).is_err() {
        return 0;
    }
    journal_key(&AllocKey { tgid, space: journal::EXTERNAL, addr: handle });
    // SAFETY: live map values; the fields are updated atomically.
    unsafe {
        add(&mut (*proc_usage).bytes, pending.size);
        add(&mut (*proc_usage).imports, 1);
        add(&mut (*cgroup).bytes, pending.size);
        add(&mut (*cgroup).imports, 1);
    }
    0
}

/// `cuDestroyExternalMemory(CUexternalMemory)`: the import leaves the totals. At entry, as
/// the frees: once destroyed, the driver may hand the handle out again.
#[uprobe]
pub fn ext_destroy(ctx: ProbeContext) -> u32 {
    let Some(handle) = ctx.arg::<u64>(0) else {
        return 0;
    };
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let key = ExtKey { tgid, _pad: 0, handle };
    // SAFETY: copied out at once.
    let Some(record) = (unsafe { EXTMEM.get(&key) }).copied() else {
        return 0;
    };
    if EXTMEM.remove(&key).is_err() {
        return 0; // another thread destroyed it meanwhile
    }
    let Some(proc_usage) = EXTMEM_PROCS.get_ptr_mut(&tgid) else {
        return 0;
    };
    // SAFETY: live map values; generation is written once, at creation; the counters are
    // updated atomically. A record of an earlier process with this pid left its totals when
    // that process exited.
    unsafe {
        if (*proc_usage).generation != record.generation {
            return 0;
        }
        add(&mut (*proc_usage).bytes, record.size.wrapping_neg());
        add(&mut (*proc_usage).imports, 1u64.wrapping_neg());
    }
    if let Some(cgroup) = EXTMEM_CGROUPS.get_ptr_mut(&record.cgroup_id) {
        // SAFETY: as above.
        unsafe {
            add(&mut (*cgroup).bytes, record.size.wrapping_neg());
            add(&mut (*cgroup).imports, 1u64.wrapping_neg());
        }
    }
    0
}

/// `sched:sched_process_exit`: a dead process's imports leave its cgroup's totals and its
/// entry goes (its records are the agent's sweep's).
#[tracepoint]
pub fn ext_exit(ctx: TracePointContext) -> u32 {
    if !group_dead(&ctx) {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: copied out at once.
    let Some(dead) = (unsafe { EXTMEM_PROCS.get(&tgid) }).copied() else {
        return 0;
    };
    if let Some(cgroup) = EXTMEM_CGROUPS.get_ptr_mut(&dead.cgroup_id) {
        // SAFETY: a live map value; the fields are updated atomically.
        unsafe {
            add(&mut (*cgroup).bytes, dead.bytes.wrapping_neg());
            add(&mut (*cgroup).imports, dead.imports.wrapping_neg());
            add(&mut (*cgroup).unrecorded, dead.unrecorded.wrapping_neg());
        }
    }
    let _ = EXTMEM_PROCS.remove(&tgid);
    // The agent sweeps its import records by this exit (the `process_exit` program tells only
    // of processes that allocated).
    emit_exit(&ctx, EventKind::ExternalExit, pid_tgid, dead.cgroup_id, dead.generation, 0);
    0
}

/// The entry of `key` in `map`, made from a zeroed value on first use; a process's (`owner`)
/// carries the current cgroup and a new generation.
#[inline(always)]
fn ext_entry<K>(map: &HashMap<K, ExtUsage>, key: &K, owner: bool) -> Option<*mut ExtUsage> {
    if let Some(entry) = map.get_ptr_mut(key) {
        return Some(entry);
    }
    // On the stack, as in `proc_entry` (a per-CPU scratch value could be rewritten by a
    // program of another task that preempts this one).
    let mut fresh = core::mem::MaybeUninit::<ExtUsage>::uninit();
    // SAFETY: every word of the stack value is written before it is read.
    let fresh = unsafe {
        zero_words(fresh.as_mut_ptr());
        if owner {
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*fresh.as_mut_ptr()).cgroup_id), bpf_get_current_cgroup_id());
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*fresh.as_mut_ptr()).generation), bpf_ktime_get_ns());
        }
        fresh.assume_init_ref()
    };
    // Two threads may race here: NOEXIST lets exactly one create it.
    let _ = map.insert(key, fresh, BPF_NOEXIST as u64);
    map.get_ptr_mut(key)
}

// ---- helpers -----------------------------------------------------------------------------

/// Zeroes the value at `to`, a word at a time (volatile stores: a zeroing the compiler merged
/// would be a call to `memset`, which eBPF has not).
///
/// # Safety
/// `to` points to writable memory of a `T` whose size is a multiple of 8 bytes, aligned to 8.
#[inline(always)]
unsafe fn zero_words<T>(to: *mut T) {
    const { assert!(core::mem::size_of::<T>() % 8 == 0 && core::mem::align_of::<T>() >= 8) };
    let words = to.cast::<u64>();
    let mut i = 0;
    while i < core::mem::size_of::<T>() / 8 {
        // SAFETY: word `i` lies inside the value (the caller's promise).
        unsafe { core::ptr::write_volatile(words.add(i), 0) };
        i += 1;
    }
}

/// Charges a new allocation of `size` bytes of `kind` to `usage`: a recorded one (counted in
/// `allocs`) or one without a record (counted in `unrecorded`).
fn charge_new(usage: &mut Usage, kind: u32, size: u64, recorded: bool) {
    if recorded {
        charge(usage, kind, size, false);
        return;
    }
    let index = kind as usize;
    if index >= KIND_COUNT {
        return;
    }
    add(&mut usage.bytes[index], size);
    add(&mut usage.unrecorded, 1);
}

/// Adds (or, with `negate`, subtracts) one allocation of `size` bytes of `kind` to `usage`.
fn charge(usage: &mut Usage, kind: u32, size: u64, negate: bool) {
    let index = kind as usize;
    if index >= KIND_COUNT {
        return;
    }
    if negate {
        add(&mut usage.bytes[index], size.wrapping_neg());
        add(&mut usage.frees, 1);
    } else {
        add(&mut usage.bytes[index], size);
        add(&mut usage.allocs, 1);
    }
}

/// Atomic add whose result is unused, so it compiles to a plain BPF atomic add.
#[inline(always)]
fn add(field: &mut u64, value: u64) {
    // SAFETY: `field` points into a map value, valid and 8-aligned for the program's run;
    // other CPUs update it only through atomic adds too.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(field, value) };
}

/// Atomic add that returns the old value (BPF ISA v3's fetch-add). Sequentially consistent:
/// LLVM lowers a relaxed add to the fetch-less instruction even when its result is used.
#[inline(always)]
unsafe fn fetch_add(field: *mut u64, value: u64) -> u64 {
    // SAFETY: the caller's `field` points into a map value, valid and 8-aligned for the
    // program's run; other CPUs update it only through atomic adds too.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(field, value) }
}

/// Atomic compare-and-swap (BPF ISA v3): whether `field` held `old`, now replaced by `new`.
#[inline(always)]
unsafe fn swap_if(field: *mut u64, old: u64, new: u64) -> bool {
    // SAFETY: the caller's `field` points into a map value, valid and 8-aligned for the
    // program's run; other CPUs change it only atomically too.
    unsafe { atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(field, old, new).1 }
}

fn bump(index: u32, value: u64) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        // SAFETY: this CPU's element of a per-CPU array, valid for the program's run. Not an
        // atomic add (the hot paths' cost): a uprobe program runs preemptibly, and one
        // preempted mid-update by another task's program bumping the same counter on this CPU
        // loses one of the two counts; the counters say how much moved and whether anything
        // did, and a counter that loses one count still moves.
        unsafe { *counter += value };
    }
}

/// Whether one more line of trouble `kind` may be logged this second (node-wide); counts the
/// line as suppressed if not. Racing CPUs can let a few more through at a second's turn,
/// never an unbounded number.
fn may_log(kind: u32) -> bool {
    let Some(window) = LOG_WINDOWS.get_ptr_mut(kind) else {
        return false;
    };
    // SAFETY: plain helper call without arguments.
    let second = unsafe { bpf_ktime_get_ns() } / 1_000_000_000;
    // SAFETY: an array element, valid for the program's run; volatile so the second's check
    // and reset are real loads and stores; the line count is updated atomically.
    // Once the second's budget is spent the shared count is only read, not written: a flood
    // of trouble does not keep every CPU writing one cache line.
    let lines = unsafe {
        if core::ptr::read_volatile(&(*window).second) != second {
            core::ptr::write_volatile(&mut (*window).second, second);
            core::ptr::write_volatile(&mut (*window).lines, 0);
        }
        let seen = core::ptr::read_volatile(&(*window).lines);
        if seen <= trouble::LINES_PER_SECOND {
            add(&mut (*window).lines, 1);
            seen + 1
        } else {
            seen
        }
    };
    if lines <= trouble::LINES_PER_SECOND {
        return true;
    }
    bump(stat::LOG_SUPPRESSED, 1);
    false
}

/// Counts a record just inserted into `ALLOCS` (`RECORDS_ADDED`) and queues its key on
/// `JOURNAL` (see [`journal_key`]). Always `true` (the record is in the map either way).
#[inline(always)]
fn journal(key: &AllocKey) -> bool {
    bump(stat::RECORDS_ADDED, 1);
    journal_key(key);
    true
}

/// Queues the key of a record just inserted on `JOURNAL` without waking the agent; a full
/// ring is counted.
#[inline(always)]
fn journal_key(key: &AllocKey) {
    if JOURNAL.output::<AllocKey>(key, BPF_RB_NO_WAKEUP as u64).is_err() {
        bump(stat::JOURNAL_LOST, 1);
    }
}

/// Deletes a record from `ALLOCS`; whether this call deleted it (counted: `RECORDS_DELETED`).
#[inline(always)]
fn delete(key: &AllocKey) -> bool {
    let deleted = ALLOCS.remove(key).is_ok();
    if deleted {
        bump(stat::RECORDS_DELETED, 1);
    }
    deleted
}

/// Queues the exit of a process on `EXITS`, waking the agent; a full ring buffer is counted
/// and logged (the agent's sweep still finds the process gone).
fn emit_exit<C: EbpfContext>(ctx: &C, kind: EventKind, pid_tgid: u64, cgroup_id: u64, generation: u64, size: u64) {
    let record = Event {
        event: kind as u32,
        kind: 0,
        tgid: (pid_tgid >> 32) as u32,
        tid: pid_tgid as u32,
        cgroup_id,
        generation,
        addr: 0,
        size,
        // SAFETY: a helper without arguments, callable from any program.
        at_ns: unsafe { bpf_ktime_get_ns() },
    };
    if EXITS.output::<Event>(&record, 0).is_err() {
        bump(stat::EXITS_LOST, 1);
        if may_log(trouble::EXIT_LOST) {
            warn!(ctx, "exit ring buffer full: the exit of pid {} is not reported (the agent's sweep finds it)", record.tgid);
        }
    }
}

// ---- processes that may have mapped a new executable file (for discovery) -----------------
//
// Discovery reads a process's maps only when one of these says it may have a new executable
// file mapping (an exec; an `mmap` of a file with `PROT_EXEC`; an `mprotect` adding
// `PROT_EXEC`, which may be of a file's mapping), and every process's on its slow rescan. The
// process is put in `EXEC_MAPPED` (once, however many events it has); an event that finds the
// map full is counted in `EXEC_MAPPED_LOST`, and discovery then reads every process's maps.

#[map]
static EXEC_MAPPED: HashMap<u32, u8> = HashMap::with_max_entries(exec_mapped::MAX_PIDS, BPF_F_NO_PREALLOC);

#[map]
static EXEC_MAPPED_LOST: Array<u64> = Array::with_max_entries(1, 0);

/// `sched:sched_process_exec`: a new program image (its own file and its interpreter mapped).
#[tracepoint]
pub fn exec_started(_ctx: TracePointContext) -> u32 {
    exec_mapped_by_current();
    0
}

/// `syscalls:sys_enter_mmap`: a file mapped executable.
#[tracepoint]
pub fn exec_mmap(ctx: TracePointContext) -> u32 {
    // SAFETY: bpf_probe_read_kernel of fields inside the tracepoint record.
    let (Ok(prot), Ok(flags)) = (unsafe { ctx.read_at::<u64>(exec_mapped::PROT_OFFSET) }, unsafe {
        ctx.read_at::<u64>(exec_mapped::FLAGS_OFFSET)
    }) else {
        return 0;
    };
    if prot & exec_mapped::PROT_EXEC != 0 && flags & exec_mapped::MAP_ANONYMOUS == 0 {
        exec_mapped_by_current();
    }
    0
}

/// `syscalls:sys_enter_mprotect` and `syscalls:sys_enter_pkey_mprotect`: a mapping made
/// executable (of a file or not: the program cannot tell, discovery reads the maps).
#[tracepoint]
pub fn exec_mprotect(ctx: TracePointContext) -> u32 {
    // SAFETY: bpf_probe_read_kernel of a field inside the tracepoint record.
    if unsafe { ctx.read_at::<u64>(exec_mapped::PROT_OFFSET) }.is_ok_and(|prot| prot & exec_mapped::PROT_EXEC != 0) {
        exec_mapped_by_current();
    }
    0
}

/// Puts the current process in `EXEC_MAPPED`, or counts the event lost.
#[inline(always)]
fn exec_mapped_by_current() {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if EXEC_MAPPED.get_ptr(&tgid).is_some() {
        return;
    }
    // Inserted by another thread of the process meanwhile: not lost.
    if EXEC_MAPPED.insert(&tgid, &1, BPF_NOEXIST as u64).is_err() && EXEC_MAPPED.get_ptr(&tgid).is_none() {
        if let Some(lost) = EXEC_MAPPED_LOST.get_ptr_mut(0) {
            // SAFETY: an array element, valid and 8-aligned for the program's run; every
            // writer adds atomically.
            add(unsafe { &mut *lost }, 1);
        }
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
