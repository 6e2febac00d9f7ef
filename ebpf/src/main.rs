//! vramguard's eBPF programs: GPU-memory accounting from uprobes on libcuda.
//!
//! Each allocation API gets an entry uprobe (one program per API family, which saves the
//! out-pointer and size of the call per thread in `PENDING`) and the shared return probe
//! `alloc_return` (which, only when the driver returned `CUDA_SUCCESS`, reads the new pointer
//! or handle and charges it). Each free API gets an entry uprobe that uncharges a known
//! allocation. Accounting lives in maps: one record per live allocation keyed by
//! (tgid, space, pointer/handle), usage per process (`PROC_USAGE`) and per cgroup
//! (`CGROUP_USAGE`). The `process_exit` tracepoint drops a dead process's usage at once and
//! tells the agent, which then deletes its records. Allocation and free events go to the
//! `EVENTS` ring buffer without a wake-up (the agent drains it on a timer); exits go to a ring
//! buffer of their own, `EXITS`, and wake the agent, so no flood of allocations can make an
//! exit event lost.
//!
//! Bounded per tenant: a cgroup may have at most `MAX_RECORDS_PER_CGROUP` live records in
//! `ALLOCS` (set by the agent at load time). Past it, an allocation is still charged (the
//! cgroup's limit keeps working) but gets no record (`Usage::unrecorded`): the cgroup is
//! *capped*, and the other cgroups keep being recorded. The `cgroup_rmdir` tracepoint deletes
//! a removed cgroup's `CGROUP_USAGE` and `CGROUP_LIMITS` entries. Trouble (a full map, a lost
//! event, a capped cgroup) is counted in the per-CPU `STATS` and logged through aya-log, at
//! most `trouble::LINES_PER_SECOND` lines per kind per second (`LOG_WINDOWS`).
//!
//! The agent decides which symbol each program is attached to (agent/src/probes.rs).
#![no_std]
#![no_main]
// The BPF target has atomic add but no compare-and-swap, so core's Atomic* types do not offer
// fetch_add there; the intrinsic compiles to the BPF atomic add instruction.
#![allow(internal_features)]
#![feature(core_intrinsics)]

use core::intrinsics::{atomic_xadd, AtomicOrdering};

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
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
use common::{
    enforce, stat, trouble, AddrSpace, AllocKey, AllocKind, AllocRecord, CgroupLimit, Event, EventKind, LogWindow,
    PendingAlloc, ProcUsage, Usage, DEFAULT_MAX_ALLOCS, DEFAULT_RECORDS_PER_CGROUP, EVENTS_BYTES, EXITS_BYTES,
    KIND_COUNT, MAX_CGROUPS, MAX_PROCS,
};

/// `BPF_RB_NO_WAKEUP`: do not wake the consumer; it polls on a timer.
const RB_NO_WAKEUP: u64 = 1;

/// Byte offset of `group_dead` in the `sched_process_exit` record, read by the agent from the
/// tracepoint's format file and set at load time. 0 means "not set": exits are then ignored.
#[no_mangle]
static GROUP_DEAD_OFFSET: u32 = 0;

/// Live records a cgroup may have in `ALLOCS` (set by the agent at load time).
#[no_mangle]
static MAX_RECORDS_PER_CGROUP: u64 = DEFAULT_RECORDS_PER_CGROUP as u64;

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

/// Per-thread state between an allocation's entry and return. LRU, so entries of threads
/// that never returned (killed inside the driver) cannot fill it.
#[map]
static PENDING: LruHashMap<u64, PendingAlloc> = LruHashMap::with_max_entries(16384, 0);

#[map]
static PROC_USAGE: HashMap<u32, ProcUsage> =
    HashMap::with_max_entries(MAX_PROCS, BPF_F_NO_PREALLOC);

#[map]
static CGROUP_USAGE: HashMap<u64, Usage> =
    HashMap::with_max_entries(MAX_CGROUPS, BPF_F_NO_PREALLOC);

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);

/// Exits only: an alloc flood that fills `EVENTS` cannot crowd them out.
#[map]
static EXITS: RingBuf = RingBuf::with_byte_size(EXITS_BYTES, 0);

/// Counters of `stat`, per CPU (no contention on the hot paths; the agent sums them).
#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(stat::LEN, 0);

/// Node-wide rate limit of the trouble log, one window per `trouble` kind.
#[map]
static LOG_WINDOWS: Array<LogWindow> = Array::with_max_entries(trouble::COUNT, 0);

/// Per-cgroup limits the entry probes enforce (filled by the agent).
#[map]
static CGROUP_LIMITS: HashMap<u64, CgroupLimit> = HashMap::with_max_entries(MAX_CGROUPS, BPF_F_NO_PREALLOC);

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
/// unsigned long long flags)`.
#[uprobe]
pub fn mem_create(ctx: ProbeContext) -> u32 {
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
        check_limit(width.wrapping_mul(height));
    }
    save(PendingAlloc {
        out_ptr,
        size: height,
        pitch_ptr,
        kind: AllocKind::Device as u32,
        space: AddrSpace::Pointer as u32,
    })
}

fn save_sized(ctx: &ProbeContext, kind: AllocKind, space: AddrSpace) -> u32 {
    let (Some(out_ptr), Some(size)) = (ctx.arg::<u64>(0), ctx.arg::<u64>(1)) else {
        return 0;
    };
    check_limit(size);
    save(PendingAlloc {
        out_ptr,
        size,
        pitch_ptr: 0,
        kind: kind as u32,
        space: space as u32,
    })
}

/// If the calling process's cgroup has a limit that `size` more bytes would pass, counts it
/// and, in signal mode, signals the process: the signal is delivered on the way back to user
/// space, before the driver runs, so a fatal one stops the allocation from ever happening.
fn check_limit(size: u64) {
    // SAFETY: plain helper call without arguments.
    let cgroup_id = unsafe { bpf_get_current_cgroup_id() };
    // SAFETY: copied out at once.
    let Some(limit) = (unsafe { CGROUP_LIMITS.get(&cgroup_id) }).copied() else {
        return;
    };
    // SAFETY: copied out at once.
    let used = unsafe { CGROUP_USAGE.get(&cgroup_id) }.map_or(0, |usage| usage.total_bytes());
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

fn save(pending: PendingAlloc) -> u32 {
    // A failed insert can only mean memory pressure in the kernel; the return probe then
    // counts an orphan return.
    let _ = PENDING.insert(&bpf_get_current_pid_tgid(), &pending, 0);
    0
}

// ---- the shared return probe -------------------------------------------------------------

/// Return of every allocation API: on `CUDA_SUCCESS`, record and charge the allocation.
#[uretprobe]
pub fn alloc_return(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: the value is copied out at once; PENDING entries are only written by this
    // thread's own entry probe, which cannot run concurrently with its return probe.
    let Some(pending) = (unsafe { PENDING.get(&pid_tgid) }).copied() else {
        bump(stat::ORPHAN_RETURNS, 1);
        return 0;
    };
    let _ = PENDING.remove(&pid_tgid);
    // CUresult is a C enum (int): only the low 32 bits of the return register are defined.
    let result: u64 = ctx.ret();
    if result as u32 != 0 {
        return 0; // the driver refused: nothing was allocated
    }
    // SAFETY: bpf_probe_read_user checks the user address and fails cleanly if it is bad.
    let Ok(addr) = (unsafe { bpf_probe_read_user(pending.out_ptr as *const u64) }) else {
        bump(stat::UNTRACKED_ALLOCS, 1);
        return 0;
    };
    let size = if pending.pitch_ptr != 0 {
        // SAFETY: as above.
        match unsafe { bpf_probe_read_user(pending.pitch_ptr as *const u64) } {
            Ok(pitch) => pitch.wrapping_mul(pending.size),
            Err(_) => {
                bump(stat::UNTRACKED_ALLOCS, 1);
                return 0;
            }
        }
    } else {
        pending.size
    };
    record_alloc(&ctx, pid_tgid, pending.kind, pending.space, addr, size);
    0
}

fn record_alloc<C: EbpfContext>(ctx: &C, pid_tgid: u64, kind: u32, space: u32, addr: u64, size: u64) {
    let tgid = (pid_tgid >> 32) as u32;
    let Some(proc_usage) = proc_entry(tgid) else {
        bump(stat::UNTRACKED_ALLOCS, 1);
        bump(stat::PROCS_FULL, 1);
        if may_log(trouble::PROCS_FULL) {
            warn!(ctx, "process usage map full: pid {}'s allocation of {} bytes is not accounted", tgid, size);
        }
        return;
    };
    // SAFETY: the pointer comes from a successful map lookup and stays valid for this
    // program's run (RCU); the two fields read here are written once, at creation.
    let (cgroup_id, generation) = unsafe { ((*proc_usage).cgroup_id, (*proc_usage).generation) };
    let cgroup = cgroup_entry(cgroup_id);
    if cgroup.is_none() {
        bump(stat::CGROUPS_FULL, 1);
        if may_log(trouble::CGROUPS_FULL) {
            warn!(ctx, "cgroup usage map full: cgroup {} is not accounted", cgroup_id);
        }
    }
    let key = AllocKey { tgid, space, addr };
    // SAFETY: the record is copied out at once.
    let replaces = match unsafe { ALLOCS.get(&key) }.copied() {
        Some(old) => {
            // The driver handed out an address this process still had on record: the old
            // allocation was freed by a path no probe saw. Retire it before recording the
            // new one (which then takes its place: no new entry).
            if old.generation == generation && ALLOCS.remove(&key).is_ok() {
                uncharge(proc_usage, &old);
            }
            true
        }
        None => false,
    };
    // The cap: a new entry only while the cgroup has fewer live records than its cap.
    // SAFETY: cgroup is a live map value; a plain read of two counters (a racing update can
    // let a few records more in, never fewer).
    let at_cap = !replaces
        && cgroup.is_some_and(|c| unsafe { (*c).live_allocations() } as i64 >= max_records_per_cgroup());
    let record = AllocRecord { size, cgroup_id, generation, kind, _pad: 0 };
    let recorded = if at_cap {
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
    } else if ALLOCS.insert(&key, &record, 0).is_err() {
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
    } else {
        true
    };
    // SAFETY: proc_usage is a live map value (see above); the field is updated atomically.
    charge_new(unsafe { &mut (*proc_usage).usage }, kind, size, recorded);
    if let Some(cgroup) = cgroup {
        // SAFETY: cgroup is a live map value; the field is updated atomically.
        charge_new(unsafe { &mut *cgroup }, kind, size, recorded);
    }
    if recorded {
        emit(ctx, EventKind::Alloc, kind, pid_tgid, cgroup_id, generation, addr, size);
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
    let fresh = ProcUsage {
        // SAFETY: plain helper calls without arguments.
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        generation: unsafe { bpf_ktime_get_ns() },
        usage: Usage::default(),
    };
    // Two threads of one process may race here: NOEXIST lets exactly one create it.
    let _ = PROC_USAGE.insert(&tgid, &fresh, BPF_NOEXIST as u64);
    PROC_USAGE.get_ptr_mut(&tgid)
}

fn cgroup_entry(cgroup_id: u64) -> Option<*mut Usage> {
    if let Some(entry) = CGROUP_USAGE.get_ptr_mut(&cgroup_id) {
        return Some(entry);
    }
    let _ = CGROUP_USAGE.insert(&cgroup_id, &Usage::default(), BPF_NOEXIST as u64);
    CGROUP_USAGE.get_ptr_mut(&cgroup_id)
}

// ---- entry probes of the free APIs -------------------------------------------------------

/// `cuMemFree_v2(CUdeviceptr)`, `cuMemFreeAsync(CUdeviceptr, CUstream)` and `_ptsz`.
///
/// Uncharged at entry, not at return: once the driver has freed the address another thread
/// may receive it again, and a late uncharge would then hit the new allocation.
#[uprobe]
pub fn mem_free(ctx: ProbeContext) -> u32 {
    free(&ctx, AddrSpace::Pointer)
}

/// `cuMemRelease(CUmemGenericAllocationHandle)`.
#[uprobe]
pub fn mem_release(ctx: ProbeContext) -> u32 {
    free(&ctx, AddrSpace::Handle)
}

fn free(ctx: &ProbeContext, space: AddrSpace) -> u32 {
    let Some(addr) = ctx.arg::<u64>(0) else {
        return 0;
    };
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let key = AllocKey { tgid, space: space as u32, addr };
    // SAFETY: the record is copied out at once.
    let Some(record) = (unsafe { ALLOCS.get(&key) }).copied() else {
        return 0; // not an allocation we saw: the driver will say what it is
    };
    // Of two threads freeing the same pointer, only the one whose delete succeeds uncharges.
    if ALLOCS.remove(&key).is_err() {
        return 0;
    }
    let Some(proc_usage) = PROC_USAGE.get_ptr_mut(&tgid) else {
        return 0;
    };
    // SAFETY: live map value; generation is written once, at creation.
    if unsafe { (*proc_usage).generation } != record.generation {
        return 0; // a record left by an earlier process with this pid
    }
    uncharge(proc_usage, &record);
    emit(ctx, EventKind::Free, record.kind, pid_tgid, record.cgroup_id, record.generation, addr, record.size);
    0
}

fn uncharge(proc_usage: *mut ProcUsage, record: &AllocRecord) {
    // SAFETY: live map value; fields are updated atomically.
    charge(unsafe { &mut (*proc_usage).usage }, record.kind, record.size, true);
    if let Some(cgroup) = CGROUP_USAGE.get_ptr_mut(&record.cgroup_id) {
        // SAFETY: live map value; fields are updated atomically.
        charge(unsafe { &mut *cgroup }, record.kind, record.size, true);
    }
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
    // SAFETY: a volatile read of a global the loader may have rewritten.
    let offset = unsafe { core::ptr::read_volatile(&GROUP_DEAD_OFFSET) };
    if offset == 0 || offset > 256 {
        return 0;
    }
    // SAFETY: bpf_probe_read_kernel of one byte inside the tracepoint record.
    let group_dead: u8 = match unsafe { ctx.read_at(offset as usize) } {
        Ok(value) => value,
        Err(_) => return 0,
    };
    if group_dead == 0 {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: copied out at once.
    let Some(dead) = (unsafe { PROC_USAGE.get(&tgid) }).copied() else {
        return 0; // never had GPU memory
    };
    if let Some(cgroup) = CGROUP_USAGE.get_ptr_mut(&dead.cgroup_id) {
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
    }
    let _ = PROC_USAGE.remove(&tgid);
    emit(&ctx, EventKind::Exit, 0, pid_tgid, dead.cgroup_id, dead.generation, 0, dead.usage.total_bytes());
    0
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
    let usage = CGROUP_USAGE.remove(&id).is_ok();
    let limit = CGROUP_LIMITS.remove(&id).is_ok();
    if usage || limit {
        bump(stat::CGROUPS_REMOVED, 1);
    }
    0
}

// ---- helpers -----------------------------------------------------------------------------

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

fn bump(index: u32, value: u64) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        // SAFETY: this CPU's element of a per-CPU array, valid for the program's run; a
        // program is not preempted by another on the same CPU mid-update.
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

/// Queues one event: exits on `EXITS`, waking the agent; allocations and frees on `EVENTS`
/// without a wake-up. A full ring buffer is counted and logged.
#[allow(clippy::too_many_arguments)]
fn emit<C: EbpfContext>(
    ctx: &C,
    event: EventKind,
    kind: u32,
    pid_tgid: u64,
    cgroup_id: u64,
    generation: u64,
    addr: u64,
    size: u64,
) {
    let record = Event {
        event: event as u32,
        kind,
        tgid: (pid_tgid >> 32) as u32,
        tid: pid_tgid as u32,
        cgroup_id,
        generation,
        addr,
        size,
    };
    if matches!(event, EventKind::Exit) {
        if EXITS.output::<Event>(&record, 0).is_err() {
            bump(stat::EXITS_LOST, 1);
            if may_log(trouble::EXIT_LOST) {
                warn!(ctx, "exit ring buffer full: the exit of pid {} is not reported (the agent's sweep finds it)", record.tgid);
            }
        }
    } else if EVENTS.output::<Event>(&record, RB_NO_WAKEUP).is_err() {
        bump(stat::EVENTS_LOST, 1);
        if may_log(trouble::EVENT_LOST) {
            warn!(ctx, "event ring buffer full: an allocation or free event of pid {} is dropped", record.tgid);
        }
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
