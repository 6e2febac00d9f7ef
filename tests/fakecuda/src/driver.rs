//! The fake driver's in-process state and semantics: contexts, allocations, stream-ordered
//! pools, VMM handles and reservations, device virtual addresses, and what each of them
//! charges to the machine-wide device state ([`crate::devfile`]).
//!
//! What a process holds on a device (its slot's `charged`) is, in bytes:
//! `contexts x FAKECUDA_CONTEXT_BYTES + large + round_up(small, 2 MiB) + pool reserved +
//! VMM + resources` (arrays and the graph memory pool, see [`crate::resources`]),
//! where `large` is the sum of allocations of 2 MiB or more, each rounded up to whole 2 MiB
//! pages, and `small` the sum of the sizes of live smaller allocations (packed into shared
//! 2 MiB pages per process and device). This reproduces the H100 figures of docs/design.md.
//!
//! Every change is computed first, then charged to the device file (which refuses with
//! `CUDA_ERROR_OUT_OF_MEMORY` and charges nothing when it does not fit, on the device or
//! under a hard limit of the process's cgroup, [`crate::limits`]), then committed here. Every
//! kind above is charged through that one path, so a cgroup's hard limit bounds all of them,
//! whatever copy of the library the process loaded. The process's cgroup is the one it was in
//! at `cuInit` (a move afterwards is not followed: what the real driver does then is not
//! known).
//!
//! Everything lives behind one process-wide mutex ([`call`]), which also serialises threads
//! for the device files' flock. A forked child sees the driver as not initialised until it
//! calls `cuInit` again, which starts it afresh.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_int;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once, PoisonError};

use cuda_abi::*;

use crate::api::Api;
use crate::config::Config;
use crate::devfile::{DeviceFile, SlotTag};
use crate::limits::LimitsFile;
use crate::errors::error_name;
use crate::procinfo::ProcId;

/// Page size of device memory and VMM granularity: 2 MiB.
pub const PAGE: u64 = 2 << 20;
/// Alignment of small allocations.
const SMALL_ALIGN: u64 = 256;

/// Handles are fake pointers in ranges no device pointer or other handle kind uses.
const PRIMARY_CTX_BASE: u64 = 0x0000_5ca1_0000_0000;
const CREATED_CTX_BASE: u64 = 0x0000_5ca2_0000_0000;
const POOL_BASE: u64 = 0x0000_5ca3_0000_0000;
/// VMM handles carry this tag in their top bits; device pointers stay below 2^47.
pub const VMM_HANDLE_TAG: u64 = 0xc0de_0000_0000_0000;

/// Device virtual address ranges: large allocations, VMM reservations, small allocations.
const LARGE_VA: (u64, u64) = (0x7000_0000_0000, 0x7e00_0000_0000);
const SMALL_VA: (u64, u64) = (0x7e00_0000_0000, 0x7f00_0000_0000);

type R<T> = Result<T, CUresult>;

fn round_up(n: u64, to: u64) -> Option<u64> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

/// What one process holds on one device, by kind.
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    contexts: u64,
    large: u64,
    small: u64,
    pool_reserved: u64,
    vmm: u64,
    /// Arrays and graph memory ([`crate::resources`]).
    resources: u64,
}

impl Usage {
    fn footprint(&self, context_bytes: u64) -> Option<u64> {
        self.contexts
            .checked_mul(context_bytes)?
            .checked_add(self.large)?
            .checked_add(round_up(self.small, PAGE)?)?
            .checked_add(self.pool_reserved)?
            .checked_add(self.vmm)?
            .checked_add(self.resources)
    }
}

/// One device as this process sees it.
pub struct Dev {
    pub file: DeviceFile,
    slot_hint: Option<usize>,
    usage: Usage,
    primary_refs: u32,
}

/// A stream-ordered memory pool (a device's default pool, or one from `cuMemPoolCreate`).
///
/// Like the driver's, its reserve is laid out in address order and an allocation takes one
/// contiguous free range of it: memory freed in pieces serves only what fits in a piece, so
/// a pool whose free part is large enough in sum may still grow (measured on an H200: a
/// PyTorch `cudaMallocAsync` job's pool grew by 64 MiB blocks with more than that free).
#[derive(Debug, Clone)]
pub struct Pool {
    pub dev: usize,
    /// Bytes held from the device (charged), grown in whole 2 MiB pages.
    pub reserved: u64,
    /// Bytes of live allocations.
    pub used: u64,
    pub reserved_high: u64,
    pub used_high: u64,
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`: reserved memory kept at a synchronization.
    pub release_threshold: u64,
    /// `CUmemPoolProps.maxSize` (0: no limit but the device's).
    pub max_size: u64,
    /// The three `CU_MEMPOOL_ATTR_REUSE_*` switches (1 by default).
    pub reuse: [i32; 3],
    /// Destroyed while allocations were live: goes once they are freed.
    destroyed: bool,
    /// The reserve's free ranges (offset → length): backed, unused, coalesced.
    free: BTreeMap<u64, u64>,
    /// Live allocations' ranges (address → offset, length).
    placed: HashMap<u64, (u64, u64)>,
    /// Where the next growth goes (offsets of released ranges are not reused).
    end: u64,
    /// Ranges `cuMemFreeAsync` freed that no synchronize has observed yet (with
    /// `FAKECUDA_TRIM_OBSERVED`: a trim keeps the pages they touch).
    unobserved: Vec<(u64, u64)>,
}

#[derive(Debug, Clone, Copy)]
struct Ctx {
    dev: usize,
    primary: bool,
    /// The `CU_CTX_*` flags it was created with.
    flags: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `cuMemAlloc_v2`, `cuMemAllocPitch_v2`: freed with the context that made it.
    Device,
    /// `cuMemAllocManaged`: charged as resident device memory; freed with its context.
    Managed,
    /// Stream-ordered, from the pool with this handle.
    Pool(u64),
}

#[derive(Debug, Clone, Copy)]
struct Alloc {
    dev: usize,
    ctx: u64,
    size: u64,
    kind: Kind,
}

/// Host memory backing a managed allocation, so the host can read and write it.
struct HostMap {
    addr: u64,
    len: usize,
}

impl HostMap {
    fn new(len: u64) -> R<HostMap> {
        let len = usize::try_from(len).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: an anonymous private mapping at an address the kernel picks; no memory of
        // this process is touched.
        let addr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if addr == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(HostMap { addr: addr as u64, len })
    }
}

impl Drop for HostMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made, which nothing else refers to once
        // the allocation is freed.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

#[derive(Debug)]
struct VmmHandle {
    /// `None`: host-located memory, which no device holds.
    dev: Option<usize>,
    size: u64,
    /// `cuMemCreate` and each `cuMemRetainAllocationHandle`, less each `cuMemRelease`.
    references: u32,
    mappings: u32,
}

#[derive(Debug)]
struct Reservation {
    size: u64,
    /// start -> (size, handle)
    mappings: BTreeMap<u64, (u64, u64)>,
}

/// A bump allocator with exact-size free lists, for one range of device addresses.
struct VaRegion {
    next: u64,
    end: u64,
    free: HashMap<u64, Vec<u64>>,
}

impl VaRegion {
    fn new((start, end): (u64, u64)) -> VaRegion {
        VaRegion { next: start, end, free: HashMap::new() }
    }

    fn alloc(&mut self, size: u64, align: u64) -> Option<u64> {
        if let Some(list) = self.free.get_mut(&size) {
            if let Some(i) = list.iter().rposition(|a| a % align == 0) {
                return Some(list.swap_remove(i));
            }
        }
        let at = round_up(self.next, align)?;
        let end = at.checked_add(size)?;
        if end > self.end {
            return None;
        }
        self.next = end;
        Some(at)
    }

    fn free(&mut self, addr: u64, size: u64) {
        self.free.entry(size).or_default().push(addr);
    }
}

/// The whole in-process driver.
pub struct Driver {
    pub me: ProcId,
    pub cfg: Config,
    pub devs: Vec<Dev>,
    /// The node's per-cgroup limits.
    limits: LimitsFile,
    /// This process's cgroup key at `cuInit` ([`crate::cgroup::key`]; 0: none).
    cgroup: u64,
    contexts: HashMap<u64, Ctx>,
    allocs: HashMap<u64, Alloc>,
    /// Host mappings of managed allocations, by address.
    host_maps: HashMap<u64, HostMap>,
    pools: HashMap<u64, Pool>,
    next_pool: u64,
    handles: HashMap<u64, VmmHandle>,
    reservations: BTreeMap<u64, Reservation>,
    large_va: VaRegion,
    small_va: VaRegion,
    next_ctx: u64,
    next_handle: u64,
    /// Arrays, graphs and the graph memory pools.
    pub(crate) resources: crate::resources::Resources,
    /// Imported external memory (never charged).
    pub(crate) external: crate::external::External,
}

static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);
/// The pid that initialised the driver; 0 in a forked child until it calls `cuInit` again.
/// Saves a `getpid` system call on every API call.
static INIT_PID: AtomicU32 = AtomicU32::new(0);
static ATFORK: Once = Once::new();

extern "C" fn forget_pid_in_child() {
    // Async-signal-safe: one atomic store.
    INIT_PID.store(0, Ordering::Relaxed);
}

/// Whether `d` belongs to this process (not to the parent of a fork).
pub fn is_ours(d: &Driver) -> bool {
    d.me.pid == INIT_PID.load(Ordering::Relaxed)
}

/// Marks `d` as this process's driver; a forked child will not see it as its own.
pub fn adopt(d: &Driver) {
    ATFORK.call_once(|| {
        // SAFETY: registers a child handler that only does an atomic store; the function lives
        // as long as the process (the library is never unloaded while in use).
        unsafe { libc::pthread_atfork(None, None, Some(forget_pid_in_child)) };
    });
    INIT_PID.store(d.me.pid, Ordering::Relaxed);
}
static CALLS: [AtomicU64; Api::COUNT] = [const { AtomicU64::new(0) }; Api::COUNT];

thread_local! {
    /// This thread's context stack; the top is the current context.
    static CTX_STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Locks the process-wide driver state.
pub fn lock() -> MutexGuard<'static, Option<Driver>> {
    DRIVER.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Counts a call of `api` (every export does, which also keeps exports' code distinct).
pub fn count(api: Api) {
    if let Some(c) = CALLS.get(api as usize) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// How often `api` was called in this process.
pub fn calls(api: Api) -> u64 {
    CALLS.get(api as usize).map(|c| c.load(Ordering::Relaxed)).unwrap_or(0)
}

/// Runs `f` on the initialised driver: the frame of every export that needs `cuInit`.
pub fn call(api: Api, f: impl FnOnce(&mut Driver) -> R<()>) -> CUresult {
    count(api);
    let mut guard = lock();
    let (rc, trace) = match guard.as_mut() {
        Some(d) if is_ours(d) => (f(d).err().unwrap_or(CUDA_SUCCESS), d.cfg.trace),
        _ => (CUDA_ERROR_NOT_INITIALIZED, false),
    };
    drop(guard);
    if trace {
        eprintln!("fakecuda[{}]: {} -> {}", std::process::id(), api.name(), error_name(rc));
    }
    rc
}

/// [`call`] for an export that answers through one out-pointer: a NULL `ptr` is
/// `CUDA_ERROR_INVALID_VALUE` before `f` runs, and what `f` returns is written to `ptr`.
///
/// # Safety
/// `ptr` must be NULL or valid for a write of `T` (the C caller's contract).
pub unsafe fn call_out<T>(api: Api, ptr: *mut T, f: impl FnOnce(&mut Driver) -> Result<T, CUresult>) -> CUresult {
    call(api, |d| {
        if ptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let value = f(d)?;
        // SAFETY: non-null, and valid for writes per this function's contract.
        unsafe { ptr.write(value) };
        Ok(())
    })
}

fn current_handle() -> u64 {
    CTX_STACK.try_with(|s| s.borrow().last().copied().unwrap_or(0)).unwrap_or(0)
}

fn with_stack(f: impl FnOnce(&mut Vec<u64>)) {
    let _ = CTX_STACK.try_with(|s| f(&mut s.borrow_mut()));
}

/// The handle of device `dev`'s primary context.
fn primary_handle(dev: usize) -> u64 {
    PRIMARY_CTX_BASE + dev as u64 * 0x1000
}

impl Pool {
    fn new(dev: usize, max_size: u64) -> Pool {
        Pool {
            dev,
            reserved: 0,
            used: 0,
            reserved_high: 0,
            used_high: 0,
            release_threshold: 0,
            max_size,
            reuse: [1; 3],
            destroyed: false,
            free: BTreeMap::new(),
            placed: HashMap::new(),
            end: 0,
            unobserved: Vec::new(),
        }
    }

    /// Where `size` bytes would go: the smallest free range that holds them, or else the
    /// growth (in whole pages) that makes room at the end, extending a free range there.
    fn place(&self, size: u64) -> R<(u64, u64)> {
        let fits = self.free.iter().filter(|(_, &len)| len >= size).min_by_key(|(&off, &len)| (len, off));
        if let Some((&off, _)) = fits {
            return Ok((off, 0));
        }
        let tail = self.free.iter().next_back().filter(|(&off, &len)| off + len == self.end);
        let (off, have) = tail.map_or((self.end, 0), |(&off, &len)| (off, len));
        Ok((off, round_up(size - have, PAGE).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?))
    }

    /// Takes `[off, off + size)`, after growing the reserve by `growth` at its end.
    fn take(&mut self, addr: u64, off: u64, size: u64, growth: u64) {
        if growth > 0 {
            let at = self.free.remove(&off).map_or(self.end, |_| off);
            self.free.insert(at, self.end + growth - at);
            self.end += growth;
            self.reserved += growth;
        }
        if let Some(len) = self.free.remove(&off) {
            if len > size {
                self.free.insert(off + size, len - size);
            }
        }
        self.placed.insert(addr, (off, size));
        self.used += size;
    }

    /// Gives allocation `addr`'s range back to the free part, joined with its neighbours;
    /// `unobserved`: until a synchronize observes it, a trim keeps it.
    fn give_back(&mut self, addr: u64, unobserved: bool) {
        let Some((mut off, mut len)) = self.placed.remove(&addr) else { return };
        if unobserved {
            self.unobserved.push((off, len));
        }
        self.used = self.used.saturating_sub(len);
        if let Some(next) = self.free.remove(&(off + len)) {
            len += next;
        }
        if let Some((&prev, &prev_len)) = self.free.range(..off).next_back().filter(|(&p, &l)| p + l == off) {
            self.free.remove(&prev);
            off = prev;
            len += prev_len;
        }
        self.free.insert(off, len);
    }

    /// Releases up to `bytes` (whole pages) of the free part, from the highest ranges down:
    /// only the pages a free range holds whole, as the driver gives back only chunks no live
    /// allocation shares (a free piece inside a page with a live allocation stays reserved).
    fn release(&mut self, mut bytes: u64) {
        let ranges: Vec<(u64, u64)> = self.free.iter().rev().map(|(&off, &len)| (off, len)).collect();
        for (off, len) in ranges {
            // The whole pages inside the range, from the top, that no unobserved free touches.
            let first = round_up(off, PAGE).unwrap_or(u64::MAX);
            let mut page = (off + len) / PAGE * PAGE;
            while bytes > 0 && page >= first + PAGE {
                let start = page - PAGE;
                if self.unobserved.iter().any(|&(o, l)| o < page && start < o + l) {
                    page = start;
                    continue;
                }
                self.cut(start, PAGE);
                bytes -= PAGE;
                page = start;
            }
        }
    }

    /// Releases `[start, start + len)`, which lies inside one free range.
    fn cut(&mut self, start: u64, len: u64) {
        let Some((&off, &range)) = self.free.range(..=start).next_back() else { return };
        self.free.remove(&off);
        if start > off {
            self.free.insert(off, start - off);
        }
        if off + range > start + len {
            self.free.insert(start + len, off + range - start - len);
        }
        self.reserved -= len;
    }
}

/// The handle of device `dev`'s default memory pool.
pub fn pool_handle(dev: usize) -> u64 {
    POOL_BASE + dev as u64 * 0x1000
}

/// Writes `value` through a caller's out-pointer, or fails on NULL.
///
/// # Safety
/// `ptr` must be NULL or valid for a write of `T` (the C caller's contract).
pub unsafe fn out<T>(ptr: *mut T, value: T) -> R<()> {
    if ptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for writes per this function's contract.
    unsafe { ptr.write(value) };
    Ok(())
}

impl Driver {
    /// Initialises the driver for this process: reads the configuration, opens (or creates)
    /// every device's state file and reaps dead processes' memory. Errors have been reported
    /// on stderr.
    pub fn init() -> R<Driver> {
        let cfg = Config::from_env().map_err(|e| {
            eprintln!("{e}");
            CUDA_ERROR_INVALID_VALUE
        })?;
        if cfg.device_count == 0 {
            return Err(CUDA_ERROR_NO_DEVICE);
        }
        let me = ProcId::current();
        let mut devs = Vec::new();
        for i in 0..cfg.device_count {
            let file = DeviceFile::open_or_create(&cfg.state_dir, &cfg.node, i, cfg.device_bytes).map_err(|e| {
                eprintln!("{}", e.message);
                e.code
            })?;
            let lock = file.lock()?;
            file.reap(&lock, &me);
            drop(lock);
            devs.push(Dev { file, slot_hint: None, usage: Usage::default(), primary_refs: 0 });
        }
        let limits = LimitsFile::open_or_create(&cfg.state_dir, &cfg.node).map_err(|e| {
            eprintln!("{}", e.message);
            e.code
        })?;
        let pools = (0..devs.len()).map(|d| (pool_handle(d), Pool::new(d, 0))).collect();
        Ok(Driver {
            me,
            cfg,
            devs,
            limits,
            cgroup: crate::cgroup::own_key(),
            contexts: HashMap::new(),
            allocs: HashMap::new(),
            host_maps: HashMap::new(),
            pools,
            next_pool: 0,
            handles: HashMap::new(),
            reservations: BTreeMap::new(),
            large_va: VaRegion::new(LARGE_VA),
            small_va: VaRegion::new(SMALL_VA),
            next_ctx: 0,
            next_handle: 1,
            resources: Default::default(),
            external: Default::default(),
        })
    }

    /// Checks a device ordinal.
    pub fn dev_index(&self, dev: c_int) -> R<usize> {
        usize::try_from(dev).ok().filter(|&d| d < self.devs.len()).ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    fn dev(&self, dev: usize) -> R<&Dev> {
        self.devs.get(dev).ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    /// Applies `change` to this process's usage of `dev`, charging the device for it first
    /// (within its cgroup's hard limit there, if any). `change` returns `None` on arithmetic
    /// overflow (reported as out of memory).
    fn recharge(&mut self, dev: usize, change: impl FnOnce(&mut Usage) -> Option<()>) -> R<()> {
        let context_bytes = self.cfg.context_bytes;
        let me = self.me;
        let flags = if self.cfg.no_channel { crate::devfile::FLAG_NO_CHANNEL } else { 0 };
        let tag = SlotTag { flags, cgroup: self.cgroup };
        let (limits, index) = (&self.limits, u32::try_from(dev).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?);
        let d = self.devs.get_mut(dev).ok_or(CUDA_ERROR_INVALID_DEVICE)?;
        let mut usage = d.usage;
        change(&mut usage).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let current = d.usage.footprint(context_bytes).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let new = usage.footprint(context_bytes).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let hard_limit = || {
            limits.hard_limit(tag.cgroup, index).map_err(|e| {
                eprintln!("fakecuda: cannot read the cgroup limits: {e}");
                CUDA_ERROR_OPERATING_SYSTEM
            })
        };
        d.file.recharge(&me, &mut d.slot_hint, current, new, tag, hard_limit)?;
        d.usage = usage;
        Ok(())
    }

    /// Charges `grow` more bytes of arrays or graph memory on `dev`, then gives back `shrink`.
    pub(crate) fn recharge_resources(&mut self, dev: usize, grow: u64, shrink: u64) -> R<()> {
        self.recharge(dev, |u| {
            u.resources = u.resources.checked_add(grow)?.checked_sub(shrink)?;
            Some(())
        })
    }

    // ---- contexts -------------------------------------------------------------------------

    /// The calling thread's current context and its device.
    pub fn current(&self) -> R<(u64, usize)> {
        let h = current_handle();
        self.contexts.get(&h).map(|c| (h, c.dev)).ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    /// The calling thread's current context handle (0 if none), without validating it.
    pub fn current_raw(&self) -> u64 {
        current_handle()
    }

    /// Sets the calling thread's current context (replacing the top of its stack); NULL pops.
    pub fn set_current(&self, ctx: u64) -> R<()> {
        if ctx != 0 && !self.contexts.contains_key(&ctx) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        with_stack(|s| {
            if ctx == 0 {
                s.pop();
            } else if let Some(top) = s.last_mut() {
                *top = ctx;
            } else {
                s.push(ctx);
            }
        });
        Ok(())
    }

    /// `cuCtxPushCurrent_v2`: `ctx` becomes current on top of the calling thread's stack.
    pub fn push_current(&self, ctx: u64) -> R<()> {
        if !self.contexts.contains_key(&ctx) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        with_stack(|s| s.push(ctx));
        Ok(())
    }

    /// `cuCtxPopCurrent_v2`: removes the current context from the calling thread's stack.
    pub fn pop_current(&self) -> R<u64> {
        let mut popped = None;
        with_stack(|s| popped = s.pop());
        popped.ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    /// The flags of the calling thread's current context.
    pub fn current_flags(&self) -> R<u32> {
        let (h, _) = self.current()?;
        self.contexts.get(&h).map(|c| c.flags).ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    /// Whether device `dev`'s primary context is active (retained at least once).
    pub fn primary_active(&self, dev: c_int) -> R<bool> {
        Ok(self.dev(self.dev_index(dev)?)?.primary_refs > 0)
    }

    /// `cuDevicePrimaryCtxRetain`: the first retain creates the context and charges its reserve.
    pub fn primary_retain(&mut self, dev: c_int) -> R<u64> {
        let dev = self.dev_index(dev)?;
        let h = primary_handle(dev);
        if self.dev(dev)?.primary_refs == 0 {
            self.recharge(dev, |u| {
                u.contexts += 1;
                Some(())
            })?;
            self.contexts.insert(h, Ctx { dev, primary: true, flags: 0 });
        }
        let d = self.devs.get_mut(dev).ok_or(CUDA_ERROR_INVALID_DEVICE)?;
        d.primary_refs = d.primary_refs.checked_add(1).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(h)
    }

    /// `cuDevicePrimaryCtxRelease`: the last release destroys the context.
    pub fn primary_release(&mut self, dev: c_int) -> R<()> {
        let dev = self.dev_index(dev)?;
        match self.dev(dev)?.primary_refs {
            0 => Err(CUDA_ERROR_INVALID_CONTEXT),
            1 => {
                self.destroy_context(primary_handle(dev))?;
                if let Some(d) = self.devs.get_mut(dev) {
                    d.primary_refs = 0;
                }
                Ok(())
            }
            _ => {
                if let Some(d) = self.devs.get_mut(dev) {
                    d.primary_refs -= 1;
                }
                Ok(())
            }
        }
    }

    /// `cuCtxCreate`: a new context, pushed on the calling thread's stack.
    pub fn ctx_create(&mut self, flags: u32, dev: c_int) -> R<u64> {
        if flags & !0xff != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = self.dev_index(dev)?;
        self.recharge(dev, |u| {
            u.contexts += 1;
            Some(())
        })?;
        self.next_ctx += 1;
        let h = CREATED_CTX_BASE + self.next_ctx * 0x1000;
        self.contexts.insert(h, Ctx { dev, primary: false, flags });
        with_stack(|s| s.push(h));
        Ok(h)
    }

    /// `cuCtxDestroy_v2` (not for primary contexts).
    pub fn ctx_destroy(&mut self, h: u64) -> R<()> {
        match self.contexts.get(&h) {
            Some(c) if !c.primary => {}
            _ => return Err(CUDA_ERROR_INVALID_CONTEXT),
        }
        self.destroy_context(h)?;
        with_stack(|s| {
            if s.last() == Some(&h) {
                s.pop();
            }
        });
        Ok(())
    }

    /// Frees a context's own allocations (as the real driver does) and its reserve.
    fn destroy_context(&mut self, h: u64) -> R<()> {
        let ctx = *self.contexts.get(&h).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        let owned: Vec<u64> = self
            .allocs
            .iter()
            .filter(|(_, a)| a.ctx == h && !matches!(a.kind, Kind::Pool(_)))
            .map(|(p, _)| *p)
            .collect();
        for p in owned {
            self.free(p, false)?;
        }
        self.recharge(ctx.dev, |u| {
            u.contexts = u.contexts.checked_sub(1)?;
            Some(())
        })?;
        self.contexts.remove(&h);
        Ok(())
    }

    // ---- cuMemAlloc family --------------------------------------------------------------

    fn take_va(&mut self, size: u64) -> R<(u64, bool)> {
        let small = size < PAGE;
        let addr = if small {
            let rounded = round_up(size, SMALL_ALIGN).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
            self.small_va.alloc(rounded, SMALL_ALIGN)
        } else {
            let rounded = round_up(size, PAGE).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
            self.large_va.alloc(rounded, PAGE)
        };
        addr.map(|a| (a, small)).ok_or(CUDA_ERROR_OUT_OF_MEMORY)
    }

    fn give_va(&mut self, addr: u64, size: u64) {
        if size < PAGE {
            if let Some(r) = round_up(size, SMALL_ALIGN) {
                self.small_va.free(addr, r);
            }
        } else if let Some(r) = round_up(size, PAGE) {
            self.large_va.free(addr, r);
        }
    }

    /// `cuMemAlloc_v2` / pitch / managed: `size` bytes on the current context's device.
    pub fn alloc(&mut self, size: u64, managed: bool) -> R<u64> {
        let (ctx, dev) = self.current()?;
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // Managed memory lives at its host mapping's address (the host can use it); other
        // allocations get a device address.
        let host = if managed { Some(HostMap::new(size)?) } else { None };
        let (addr, small) = match &host {
            Some(h) if self.allocs.contains_key(&h.addr) => return Err(CUDA_ERROR_OUT_OF_MEMORY),
            Some(h) => (h.addr, size < PAGE),
            None => self.take_va(size)?,
        };
        let charged = self.recharge(dev, |u| {
            if small {
                u.small = u.small.checked_add(size)?;
            } else {
                u.large = u.large.checked_add(round_up(size, PAGE)?)?;
            }
            Some(())
        });
        if let Err(e) = charged {
            if host.is_none() {
                self.give_va(addr, size);
            }
            return Err(e);
        }
        let kind = if managed { Kind::Managed } else { Kind::Device };
        self.allocs.insert(addr, Alloc { dev, ctx, size, kind });
        if let Some(h) = host {
            self.host_maps.insert(addr, h);
        }
        Ok(addr)
    }

    /// Frees any allocation made by this process (`async_only`: only pool allocations).
    pub fn free(&mut self, ptr: u64, async_only: bool) -> R<()> {
        let a = *self.allocs.get(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if async_only && !matches!(a.kind, Kind::Pool(_)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match a.kind {
            Kind::Device | Kind::Managed => self.recharge(a.dev, |u| {
                if a.size < PAGE {
                    u.small = u.small.checked_sub(a.size)?;
                } else {
                    u.large = u.large.checked_sub(round_up(a.size, PAGE)?)?;
                }
                Some(())
            })?,
            Kind::Pool(pool) => {
                // Freed memory stays reserved by the pool until trimmed or synchronized.
                let unobserved = async_only && self.cfg.trim_observed;
                let p = self.pools.get_mut(&pool).ok_or(CUDA_ERROR_INVALID_VALUE)?;
                p.give_back(ptr, unobserved);
                if p.destroyed && p.used == 0 {
                    p.unobserved.clear();
                    self.pool_trim(pool, 0)?;
                    self.pools.remove(&pool);
                }
            }
        }
        self.allocs.remove(&ptr);
        if self.host_maps.remove(&ptr).is_none() {
            self.give_va(ptr, a.size);
        }
        Ok(())
    }

    // ---- stream-ordered pools -------------------------------------------------------------

    /// A live pool of this process.
    pub fn pool(&self, pool: u64) -> R<&Pool> {
        self.pools.get(&pool).filter(|p| !p.destroyed).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// A live pool of this process, to change its attributes.
    pub fn pool_mut(&mut self, pool: u64) -> R<&mut Pool> {
        self.pools.get_mut(&pool).filter(|p| !p.destroyed).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// `cuMemPoolCreate`: an empty pool on device `dev` (reserves nothing yet).
    pub fn pool_create(&mut self, dev: usize, max_size: u64) -> R<u64> {
        self.dev(dev)?;
        self.next_pool += 1;
        let h = POOL_BASE + (self.devs.len() as u64 + self.next_pool) * 0x1000;
        self.pools.insert(h, Pool::new(dev, max_size));
        Ok(h)
    }

    /// `cuMemPoolDestroy`: not for a default pool. Its free memory goes back at once; memory
    /// of allocations still live goes when they are freed, as the driver defers it.
    pub fn pool_destroy(&mut self, pool: u64) -> R<()> {
        let dev = self.pool(pool)?.dev;
        if pool == pool_handle(dev) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if let Some(p) = self.pools.get_mut(&pool) {
            p.unobserved.clear(); // its free part goes back at once
        }
        self.pool_trim(pool, 0)?;
        if self.pool(pool)?.used == 0 {
            self.pools.remove(&pool);
        } else if let Some(p) = self.pools.get_mut(&pool) {
            p.destroyed = true;
        }
        Ok(())
    }

    /// An allocation from `pool`: from the smallest free range that holds it, else the pool's
    /// reserve grows at its end in 2 MiB steps (never past its `maxSize`), so a free part in
    /// pieces may not serve it though large enough in sum.
    pub fn pool_alloc(&mut self, pool: u64, size: u64) -> R<u64> {
        let (ctx, _) = self.current()?;
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = self.pool(pool)?;
        let dev = p.dev;
        let (off, growth) = p.place(size)?;
        let reserved = p.reserved.checked_add(growth).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        if p.max_size != 0 && reserved > p.max_size {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let (addr, _) = self.take_va(size)?;
        let charged = self.recharge(dev, |u| {
            u.pool_reserved = u.pool_reserved.checked_add(growth)?;
            Some(())
        });
        if let Err(e) = charged {
            self.give_va(addr, size);
            return Err(e);
        }
        if let Some(p) = self.pools.get_mut(&pool) {
            p.take(addr, off, size, growth);
            p.used_high = p.used_high.max(p.used);
            p.reserved_high = p.reserved_high.max(p.reserved);
        }
        self.allocs.insert(addr, Alloc { dev, ctx, size, kind: Kind::Pool(pool) });
        Ok(addr)
    }

    /// `cuMemPoolTrimTo`: releases free reserved memory down to
    /// `max(round_up(used, 2 MiB), round_up(min(reserved, keep), 2 MiB))`, as far as whole free
    /// pages allow ([`Pool::release`]). (A destroy's release too: `FAKECUDA_TRIM_KEEPS` is the
    /// callers', the application's trim and a synchronize.)
    pub fn pool_trim(&mut self, pool: u64, keep: u64) -> R<()> {
        let p = self.pools.get(&pool).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let floor = round_up(p.used, PAGE).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let kept = round_up(p.reserved.min(keep), PAGE).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let target = floor.max(kept);
        if target >= p.reserved {
            return Ok(());
        }
        let mut trimmed = p.clone();
        trimmed.release(p.reserved - target);
        let (dev, released) = (p.dev, p.reserved - trimmed.reserved);
        self.recharge(dev, |u| {
            u.pool_reserved = u.pool_reserved.checked_sub(released)?;
            Some(())
        })?;
        self.pools.insert(pool, trimmed);
        Ok(())
    }

    /// What a synchronization does to pools, as the driver: each pool of device `dev` (every
    /// device for `None`) gives back reserved memory above its release threshold.
    pub fn pools_synchronized(&mut self, dev: Option<usize>) -> R<()> {
        for p in self.pools.values_mut().filter(|p| dev.is_none_or(|d| d == p.dev)) {
            p.unobserved.clear(); // the synchronize observed every free before it
        }
        if self.cfg.trim_keeps {
            return Ok(());
        }
        let due: Vec<(u64, u64)> = self
            .pools
            .iter()
            .filter(|(_, p)| dev.is_none_or(|d| d == p.dev) && p.reserved > p.release_threshold)
            .map(|(h, p)| (*h, p.release_threshold))
            .collect();
        for (h, threshold) in due {
            self.pool_trim(h, threshold)?;
        }
        Ok(())
    }

    // ---- virtual memory management ----------------------------------------------------------

    /// Checks a `CUmemAllocationProp` for a device-located pinned allocation; returns the device.
    pub fn check_prop(&self, prop: &CUmemAllocationProp) -> R<usize> {
        if prop.type_ != CU_MEM_ALLOCATION_TYPE_PINNED || prop.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        usize::try_from(prop.location.id)
            .ok()
            .filter(|&d| d < self.devs.len())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// `cuMemCreate`: physical memory on a device, charged at once; or, at a host location
    /// (`CU_MEM_LOCATION_TYPE_HOST*`), host memory that no device holds.
    pub fn mem_create(&mut self, size: u64, prop: &CUmemAllocationProp, flags: u64) -> R<u64> {
        let host = [CU_MEM_LOCATION_TYPE_HOST, CU_MEM_LOCATION_TYPE_HOST_NUMA, CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT];
        let dev = if prop.type_ == CU_MEM_ALLOCATION_TYPE_PINNED && host.contains(&prop.location.type_) {
            None
        } else {
            Some(self.check_prop(prop)?)
        };
        if flags != 0 || size == 0 || !size.is_multiple_of(PAGE) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if let Some(dev) = dev {
            self.recharge(dev, |u| {
                u.vmm = u.vmm.checked_add(size)?;
                Some(())
            })?;
        }
        let h = VMM_HANDLE_TAG | self.next_handle;
        self.next_handle += 1;
        self.handles.insert(h, VmmHandle { dev, size, references: 1, mappings: 0 });
        Ok(h)
    }

    /// Uncharges a handle once it is both released and unmapped everywhere.
    fn settle_handle(&mut self, h: u64) -> R<()> {
        let (dev, size) = match self.handles.get(&h) {
            Some(v) if v.references == 0 && v.mappings == 0 => (v.dev, v.size),
            _ => return Ok(()),
        };
        if let Some(dev) = dev {
            self.recharge(dev, |u| {
                u.vmm = u.vmm.checked_sub(size)?;
                Some(())
            })?;
        }
        self.handles.remove(&h);
        Ok(())
    }

    /// `cuMemRelease`: memory goes back once every reference and mapping of it is gone too.
    pub fn mem_release(&mut self, h: u64) -> R<()> {
        match self.handles.get_mut(&h) {
            Some(v) if v.references > 0 => v.references -= 1,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        if let Err(e) = self.settle_handle(h) {
            if let Some(v) = self.handles.get_mut(&h) {
                v.references += 1;
            }
            return Err(e);
        }
        Ok(())
    }

    /// `cuMemRetainAllocationHandle`: the handle mapped at `addr`, with one more reference.
    pub fn mem_retain(&mut self, addr: u64) -> R<u64> {
        let r = self.reservation_of(addr, 1)?;
        let h = r
            .mappings
            .range(..=addr)
            .next_back()
            .filter(|(&start, &(size, _))| addr < start + size)
            .map(|(_, &(_, h))| h)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let v = self.handles.get_mut(&h).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        v.references = v.references.checked_add(1).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(h)
    }

    /// `cuMemAddressReserve` (the address hint is ignored, as the driver may).
    pub fn address_reserve(&mut self, size: u64, align: u64, flags: u64) -> R<u64> {
        if size == 0 || !size.is_multiple_of(PAGE) || flags != 0 || (align != 0 && !align.is_power_of_two()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let addr = self.large_va.alloc(size, align.max(PAGE)).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        self.reservations.insert(addr, Reservation { size, mappings: BTreeMap::new() });
        Ok(addr)
    }

    /// `cuMemAddressFree`: the whole reservation, with nothing mapped in it any more.
    pub fn address_free(&mut self, ptr: u64, size: u64) -> R<()> {
        match self.reservations.get(&ptr) {
            Some(r) if r.size == size && r.mappings.is_empty() => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        self.reservations.remove(&ptr);
        self.large_va.free(ptr, size);
        Ok(())
    }

    /// The reservation holding all of `[ptr, ptr + size)`.
    fn reservation_of(&mut self, ptr: u64, size: u64) -> R<&mut Reservation> {
        let end = ptr.checked_add(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        match self.reservations.range_mut(..=ptr).next_back() {
            Some((start, r)) if size > 0 && end <= start + r.size => Ok(r),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

    /// `cuMemMap`.
    pub fn mem_map(&mut self, ptr: u64, size: u64, offset: u64, h: u64, flags: u64) -> R<()> {
        if flags != 0 || size == 0 || !size.is_multiple_of(PAGE) || !offset.is_multiple_of(PAGE) || !ptr.is_multiple_of(PAGE) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match self.handles.get(&h) {
            Some(v) if v.references > 0 && offset.checked_add(size).is_some_and(|e| e <= v.size) => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        let r = self.reservation_of(ptr, size)?;
        let end = ptr + size;
        if r.mappings.iter().any(|(&s, &(sz, _))| s < end && ptr < s + sz) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        r.mappings.insert(ptr, (size, h));
        if let Some(v) = self.handles.get_mut(&h) {
            v.mappings += 1;
        }
        Ok(())
    }

    /// `cuMemUnmap`: every mapping inside the range goes; none may straddle its ends.
    pub fn mem_unmap(&mut self, ptr: u64, size: u64) -> R<()> {
        let r = self.reservation_of(ptr, size)?;
        let end = ptr + size;
        let hit: Vec<(u64, u64, u64)> = r
            .mappings
            .iter()
            .filter(|(&s, &(sz, _))| s < end && ptr < s + sz)
            .map(|(&s, &(sz, h))| (s, sz, h))
            .collect();
        if hit.is_empty() || hit.iter().any(|&(s, sz, _)| s < ptr || s + sz > end) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for &(s, _, _) in &hit {
            r.mappings.remove(&s);
        }
        for (_, _, h) in hit {
            if let Some(v) = self.handles.get_mut(&h) {
                v.mappings = v.mappings.saturating_sub(1);
            }
            self.settle_handle(h)?;
        }
        Ok(())
    }

    /// `cuMemSetAccess`: the range must be wholly mapped; descriptors must name devices.
    pub fn set_access(&mut self, ptr: u64, size: u64, descs: &[CUmemAccessDesc]) -> R<()> {
        if descs.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for d in descs {
            let known_flags = [CU_MEM_ACCESS_FLAGS_PROT_NONE, CU_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ACCESS_FLAGS_PROT_READWRITE];
            let dev_ok = usize::try_from(d.location.id).is_ok_and(|i| i < self.devs.len());
            if d.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE || !dev_ok || !known_flags.contains(&d.flags) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
        let r = self.reservation_of(ptr, size)?;
        let end = ptr + size;
        let mut covered = ptr;
        for (&s, &(sz, _)) in r.mappings.range(..end) {
            if s + sz <= covered {
                continue;
            }
            if s > covered {
                break;
            }
            covered = s + sz;
        }
        if covered < end {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }

    // ---- queries ------------------------------------------------------------------------------

    /// (used, total) of device `dev` across all processes, after reaping dead ones.
    pub fn device_usage(&self, dev: usize) -> R<(u64, u64)> {
        let file = &self.dev(dev)?.file;
        usage_of(file, &self.me)
    }
}

/// (used, total) of a device file, after reaping dead processes.
pub fn usage_of(file: &DeviceFile, me: &ProcId) -> R<(u64, u64)> {
    let lock = file.lock()?;
    file.reap(&lock, me);
    Ok((file.used(&lock), file.total()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn footprint_reproduces_the_h100_figures() {
        let page_sum = |sizes: &[(u64, u64)]| {
            let mut u = Usage::default();
            for &(n, size) in sizes {
                for _ in 0..n {
                    if size < PAGE {
                        u.small += size;
                    } else {
                        u.large += round_up(size, PAGE).expect("no overflow");
                    }
                }
            }
            u.footprint(0).expect("no overflow")
        };
        const MIB: u64 = 1 << 20;
        assert_eq!(page_sum(&[(1000, 512)]), 2 * MIB);
        assert_eq!(page_sum(&[(200, 64 << 10)]), 14 * MIB);
        assert_eq!(page_sum(&[(200, MIB)]), 200 * MIB);
        assert_eq!(page_sum(&[(100, 2 * MIB)]), 200 * MIB);
        assert_eq!(page_sum(&[(100, 3 * MIB)]), 400 * MIB);
    }

    #[test]
    fn va_regions_reuse_and_align() {
        let mut va = VaRegion::new((0x1000_0000, 0x2000_0000));
        let a = va.alloc(PAGE, PAGE).expect("space");
        let b = va.alloc(PAGE, PAGE).expect("space");
        assert_ne!(a, b);
        assert_eq!(a % PAGE, 0);
        va.free(a, PAGE);
        assert_eq!(va.alloc(PAGE, PAGE), Some(a));
        assert_eq!(va.alloc(1 << 40, PAGE), None);
    }
}
