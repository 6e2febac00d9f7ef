//! The driver API this library exports in place of libcuda's: each wrapper admits the
//! allocation in the ledger before calling the real driver, rolls the reservation back if
//! the driver fails, and releases it when the memory is freed. Also `dlsym` and
//! `cuGetProcAddress(_v2)`, which hand out these wrappers instead of the real entry points,
//! so every route to the driver is covered.
//!
//! NVML's memory queries (`nvmlDeviceGetMemoryInfo(_v2)`) are wrapped too, exported and
//! handed out by `dlsym`, so a tool asking NVML sees what `cuMemGetInfo_v2` shows.
//!
//! Signatures are those of `cuda.h` (CUDA 12/13) and `nvml.h` exactly.
#![allow(non_snake_case)]

use std::{
    cell::Cell,
    ffi::{c_char, c_int, c_uint, c_void, CStr},
    sync::atomic::{AtomicBool, Ordering},
};

use cuda_abi::{
    nvml::{
        nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlReturn_t, NVML_DEVICE_UUID_V2_BUFFER_SIZE, NVML_ERROR_FUNCTION_NOT_FOUND,
        NVML_ERROR_LIBRARY_NOT_FOUND, NVML_SUCCESS,
    },
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUmemoryPool, CUresult, CUstream, CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CU_STREAM_CAPTURE_STATUS_NONE,
};
use ledger::{Charge, RecordId, ReserveError};

use crate::{
    arrays, contexts, graphs,
    pools::{PoolOutcome, Source},
    real::{self, Driver, Nvml},
    session::{self, mode, say, Mode, Session, Space},
    vmm,
};

// ---- admission -----------------------------------------------------------------------------

pub(crate) enum Admission {
    /// Not enforced here: call the driver as is.
    Pass,
    /// Refused: return CUDA_ERROR_OUT_OF_MEMORY without calling the driver.
    Refuse,
    Charged(&'static Session, u32, RecordId),
}

/// Reserves `charge` on the ledger device of `ordinal` (default: the current context's).
// Inlined into the wrappers, with the refusal path kept out of line (`after_refusal`): the
// granted path is then 30 instructions shorter than with a call here (callgrind, alloc+free
// pair on the fake driver).
#[inline]
pub(crate) fn admit(driver: &Driver, charge: Charge, ordinal: Option<CUdevice>) -> Admission {
    let session = match mode() {
        Mode::PassThrough => return Admission::Pass,
        Mode::Refuse(_) => return Admission::Refuse,
        Mode::Enforce(session) => session,
    };
    let Some(ordinal) = ordinal.or_else(|| current_device(driver)) else {
        return Admission::Pass; // no context: the driver refuses the call itself
    };
    let Some(device) = session.ledger_device(ordinal) else {
        return if session.refuses(ordinal) { Admission::Refuse } else { Admission::Pass };
    };
    match reserve_or_report(session, device, charge, 0) {
        Some(record) => Admission::Charged(session, device, record),
        None => Admission::Refuse,
    }
}

/// Reserves `charge` on ledger `device`. A refusal is final only after the quota the ledger
/// may hold in error was recovered (see [`after_refusal`]); the process's first refusal is
/// reported on stderr. A granted reservation costs the ledger operation alone.
pub(crate) fn reserve_or_report(session: &Session, device: u32, charge: Charge, ptr: u64) -> Option<RecordId> {
    match session.ledger.reserve(session.slot, device, charge, ptr) {
        Ok(record) => Some(record),
        Err(error) => {
            let mut settle = || real::driver().is_ok_and(|driver| session.pools.settle_all(session, driver));
            after_refusal(session, device, charge, ptr, error, &mut settle)
        }
    }
}

/// [`reserve_or_report`] inside a pool operation, which holds the pools' lock: `settle` is
/// that operation's way to settle every pool ([`crate::pools::Pools::allocate`]).
pub(crate) fn reserve_in_pool(session: &Session, device: u32, charge: Charge, ptr: u64, settle: &mut dyn FnMut() -> bool) -> Option<RecordId> {
    match session.ledger.reserve(session.slot, device, charge, ptr) {
        Ok(record) => Some(record),
        Err(error) => after_refusal(session, device, charge, ptr, error, settle),
    }
}

/// After the ledger refused `charge` (`error`): dead processes' slots are swept, and this
/// process's pool charges brought down to what the driver reports the pools hold now
/// (`settle_pools`, [`crate::pools::Pools::settle_all`]: a synchronize may have given pool
/// memory back), each at most once with one more try after it; then the refusal is final and
/// reported (once a process).
#[cold]
#[inline(never)]
fn after_refusal(
    session: &Session,
    device: u32,
    charge: Charge,
    ptr: u64,
    error: ReserveError,
    settle_pools: &mut dyn FnMut() -> bool,
) -> Option<RecordId> {
    let (mut swept, mut settled) = (false, false);
    let mut outcome = Err(error);
    loop {
        match outcome {
            Ok(record) => return Some(record),
            Err(ReserveError::OverQuota { device, requested, used, limit }) => {
                // Processes that died without a word may still hold quota: sweep once.
                let retry = if !swept && session.ledger.reclaim_dead().is_ok_and(|dead| !dead.is_empty()) {
                    swept = true;
                    true
                } else if !settled {
                    settled = true;
                    settle_pools()
                } else {
                    false
                };
                if !retry {
                    static REPORTED: AtomicBool = AtomicBool::new(false);
                    if !REPORTED.swap(true, Ordering::Relaxed) {
                        say(&format!(
                            "GPU memory quota exceeded on device {device}: {requested} bytes requested, {used} of {limit} bytes in use \
                             (ledger {}); returning CUDA_ERROR_OUT_OF_MEMORY",
                            session.ledger.path().display()
                        ));
                    }
                    return None;
                }
            }
            Err(ReserveError::Ledger(error)) => {
                static REPORTED: AtomicBool = AtomicBool::new(false);
                if !REPORTED.swap(true, Ordering::Relaxed) {
                    say(&format!("ledger error, refusing the allocation: {error}"));
                }
                return None;
            }
        }
        outcome = session.ledger.reserve(session.slot, device, charge, ptr);
    }
}

pub(crate) fn current_device(driver: &Driver) -> Option<CUdevice> {
    let get = driver.ctx_get_device?;
    let mut device: CUdevice = 0;
    // SAFETY: the out-pointer is a live local.
    (unsafe { get(&mut device) } == CUDA_SUCCESS).then_some(device)
}

/// Admits `charge`, calls the driver, and records (or rolls back) the result.
///
/// # Safety
/// `out` is the caller's out-pointer of the driver call (read after a successful call).
pub(crate) unsafe fn allocate(
    driver: &Driver,
    space: Space,
    charge: Charge,
    ordinal: Option<CUdevice>,
    out: *mut u64,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    if out.is_null() {
        return call(); // the driver answers a NULL out-pointer as it always does
    }
    match admit(driver, charge, ordinal) {
        Admission::Pass => call(),
        Admission::Refuse => CUDA_ERROR_OUT_OF_MEMORY,
        Admission::Charged(session, device, record) => {
            let result = call();
            if result == CUDA_SUCCESS {
                // SAFETY: the driver succeeded, so it wrote the out-pointer (caller's contract).
                let address = unsafe { *out };
                session.ledger.note_pointer(record, address);
                session.remember(space, address, device, record);
            } else {
                let _ = session.ledger.release(session.slot, record);
            }
            result
        }
    }
}

/// Calls the driver's free and, if it succeeds, releases what the hook charged.
pub(crate) fn free(space: Space, address: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let Mode::Enforce(session) = mode() else { return call() };
    let entry = session.forget(space, address);
    let result = call();
    match entry {
        Some((_, record)) if result == CUDA_SUCCESS => {
            let _ = session.ledger.release(session.slot, record);
        }
        Some(entry) => session.restore(space, address, entry),
        None => {} // not ours: the driver decided
    }
    result
}

/// Frees a device pointer (stream-ordered on `stream` for `cuMemFreeAsync`): a pool
/// allocation settles its pool, anything else releases what was charged for it.
fn free_pointer(driver: &Driver, address: u64, stream: Option<CUstream>, call: impl FnOnce() -> CUresult) -> CUresult {
    if let Mode::Enforce(session) = mode() {
        if session.pools.owns(address) {
            return session.pools.free(session, driver, address, stream, call);
        }
    }
    free(Space::Pointer, address, call)
}

/// The real driver, or the error every wrapper returns without one.
pub(crate) fn driver() -> Result<&'static Driver, CUresult> {
    real::driver().map_err(|error| {
        static REPORTED: AtomicBool = AtomicBool::new(false);
        if !REPORTED.swap(true, Ordering::Relaxed) {
            say(error);
        }
        CUDA_ERROR_NOT_INITIALIZED
    })
}

macro_rules! real_or_return {
    ($driver:expr, $field:ident) => {
        match $driver.$field {
            Some(f) => f,
            None => return cuda_abi::CUDA_ERROR_NOT_FOUND,
        }
    };
}
pub(crate) use real_or_return;

macro_rules! driver_or_return {
    () => {
        match $crate::exports::driver() {
            Ok(driver) => driver,
            Err(code) => return code,
        }
    };
}
pub(crate) use driver_or_return;

// ---- allocation and free ---------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_alloc);
    // SAFETY: forwards the caller's arguments unchanged.
    unsafe { allocate(driver, Space::Pointer, Charge::Device(bytesize as u64), None, dptr, || real(dptr, bytesize)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytesize: usize, flags: c_uint) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_alloc_managed);
    // SAFETY: forwards the caller's arguments unchanged.
    unsafe { allocate(driver, Space::Pointer, Charge::Managed(bytesize as u64), None, dptr, || real(dptr, bytesize, flags)) }
}

/// Pitch alignment the charge assumes before the driver says the real pitch.
const PITCH_ALIGNMENT: usize = 512;

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pPitch: *mut usize,
    WidthInBytes: usize,
    Height: usize,
    ElementSizeBytes: c_uint,
) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_alloc_pitch);
    let call = || {
        // SAFETY: forwards the caller's arguments unchanged.
        unsafe { real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes) }
    };
    if pPitch.is_null() {
        return call();
    }
    let estimate = (WidthInBytes.div_ceil(PITCH_ALIGNMENT) * PITCH_ALIGNMENT).saturating_mul(Height) as u64;
    // SAFETY: dptr is the caller's out-pointer for this call.
    let result = unsafe { allocate(driver, Space::Pointer, Charge::Device(estimate), None, dptr, call) };
    if result != CUDA_SUCCESS {
        return result;
    }
    // Charge the real pitch x height if the driver chose another pitch.
    // SAFETY: the driver succeeded, so both out-pointers are written.
    let (address, actual) = unsafe { (*dptr, (*pPitch).saturating_mul(Height) as u64) };
    settle_estimate(Space::Pointer, address, estimate, actual, || {
        if let Some(free) = driver.mem_free {
            // SAFETY: frees the allocation the driver just made.
            unsafe { free(address) };
        }
    })
}

/// Re-charges `(space, address)`, admitted for `estimate` bytes, at the `actual` bytes the
/// driver says it took. If that does not fit in the quota, `undo` frees it again and the
/// allocation is refused (`CUDA_ERROR_OUT_OF_MEMORY`).
pub(crate) fn settle_estimate(space: Space, address: u64, estimate: u64, actual: u64, undo: impl FnOnce()) -> CUresult {
    if actual == estimate {
        return CUDA_SUCCESS;
    }
    let Mode::Enforce(session) = mode() else { return CUDA_SUCCESS };
    let Some((device, estimated)) = session.forget(space, address) else { return CUDA_SUCCESS };
    // The estimate goes first, so an actual size below it always fits in its place.
    let _ = session.ledger.release(session.slot, estimated);
    match session.ledger.reserve(session.slot, device, Charge::Device(actual), address) {
        Ok(record) => {
            session.remember(space, address, device, record);
            CUDA_SUCCESS
        }
        Err(_) => {
            undo();
            CUDA_ERROR_OUT_OF_MEMORY
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_free);
    // SAFETY: forwards the caller's argument unchanged.
    free_pointer(driver, dptr, None, || unsafe { real(dptr) })
}

/// A stream-ordered allocation's stream, and the driver's calls on it in the allocation's
/// form (`_ptsz` or not: the NULL stream means the per-thread one there).
struct OnStream {
    stream: CUstream,
    /// `cuStreamIsCapturing`.
    is_capturing: Option<IsCapturing>,
    /// `cuMemFreeAsync`.
    free: Option<unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult>,
    /// Whether this is a `_ptsz` call.
    per_thread: bool,
}

impl OnStream {
    /// Queues the free of pool allocation `address`, which the application has not seen, on
    /// its stream; that stream as `cuStreamQuery` takes it, if the driver took the free.
    fn give_back(&self, driver: &Driver, address: u64) -> Option<usize> {
        let free = self.free?;
        // SAFETY: an allocation the driver just made on the caller's stream, freed once.
        let queued = crate::pools::relaxed(driver, || unsafe { free(address as CUdeviceptr, self.stream) }) == CUDA_SUCCESS;
        let stream = match self.stream as usize {
            0 if self.per_thread => cuda_abi::CU_STREAM_PER_THREAD,
            stream => stream,
        };
        queued.then_some(stream)
    }
}

/// An allocation from a stream-ordered pool (`None`: the current device's current pool) on
/// `on.stream`, charged for what the pool holds (see `pools`); passed through while the stream
/// is being captured.
///
/// # Safety
/// `dptr` is the caller's out-pointer of the driver call.
unsafe fn pool_allocate(
    driver: &Driver,
    pool: Option<CUmemoryPool>,
    on: OnStream,
    dptr: *mut CUdeviceptr,
    size: usize,
    mut call: impl FnMut() -> CUresult,
) -> CUresult {
    if dptr.is_null() {
        return call();
    }
    let session = match mode() {
        Mode::PassThrough => return call(),
        Mode::Refuse(_) => return CUDA_ERROR_OUT_OF_MEMORY,
        Mode::Enforce(session) => session,
    };
    let Some(ordinal) = current_device(driver) else { return call() };
    let Some(device) = session.ledger_device(ordinal) else {
        return if session.refuses(ordinal) { CUDA_ERROR_OUT_OF_MEMORY } else { call() };
    };
    if capturing(on.is_capturing, on.stream) {
        return call();
    }
    let pool = pool.or_else(|| current_pool(driver, ordinal));
    let mut give_back = |address: u64| on.give_back(driver, address);
    let outcome = pool.and_then(|pool| {
        session.pools.allocate(
            session,
            driver,
            Source::Pool(pool),
            device,
            size as u64,
            |charge, settle| reserve_in_pool(session, device, charge, pool as u64, settle),
            || {
                let result = call();
                // SAFETY: the driver succeeded, so it wrote the out-pointer.
                (result, (result == CUDA_SUCCESS).then(|| unsafe { *dptr }))
            },
            Some(&mut give_back),
        )
    });
    match outcome {
        Some(PoolOutcome::Called(result)) => result,
        Some(PoolOutcome::Refused) => CUDA_ERROR_OUT_OF_MEMORY,
        Some(PoolOutcome::GivenBack) => {
            // SAFETY: the caller's out-pointer (non-NULL, checked above): no longer a pointer.
            unsafe { *dptr = 0 };
            CUDA_ERROR_OUT_OF_MEMORY
        }
        // The driver cannot say what the pool holds (`allocate` called nothing): charge the
        // allocation itself.
        // SAFETY: as this function's contract.
        None => unsafe { allocate(driver, Space::Pointer, Charge::Device(size as u64), None, dptr, call) },
    }
}

fn current_pool(driver: &Driver, ordinal: CUdevice) -> Option<CUmemoryPool> {
    let get = driver.device_get_mem_pool?;
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the out-pointer is a live local.
    (unsafe { get(&mut pool, ordinal) } == CUDA_SUCCESS && !pool.is_null()).then_some(pool)
}

/// `cuStreamIsCapturing(CUstream, CUstreamCaptureStatus *)`.
type IsCapturing = unsafe extern "C" fn(CUstream, *mut c_int) -> CUresult;

/// Whether `stream` is being captured into a graph (`is_capturing`: `cuStreamIsCapturing` or
/// its `_ptsz` form, as the allocation's): then a stream-ordered allocation on it only adds an
/// allocation node to the graph, whose memory is charged when the graph is launched (see
/// `graphs`), so it is neither admitted nor charged here.
fn capturing(is_capturing: Option<IsCapturing>, stream: CUstream) -> bool {
    let Some(is_capturing) = is_capturing else { return false };
    let mut status = CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's stream, and a live local for the status.
    (unsafe { is_capturing(stream, &mut status) }) == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE
}

macro_rules! async_alloc {
    ($name:ident, $field:ident, $capturing:ident, $free:ident, $per_thread:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(dptr: *mut CUdeviceptr, bytesize: usize, hStream: CUstream) -> CUresult {
            let driver = driver_or_return!();
            let real = real_or_return!(driver, $field);
            let on = OnStream { stream: hStream, is_capturing: driver.$capturing, free: driver.$free, per_thread: $per_thread };
            // SAFETY: forwards the caller's arguments unchanged.
            unsafe { pool_allocate(driver, None, on, dptr, bytesize, || real(dptr, bytesize, hStream)) }
        }
    };
}
async_alloc!(cuMemAllocAsync, mem_alloc_async, stream_is_capturing, mem_free_async, false);
async_alloc!(cuMemAllocAsync_ptsz, mem_alloc_async_ptsz, stream_is_capturing_ptsz, mem_free_async_ptsz, true);

macro_rules! pool_alloc {
    ($name:ident, $field:ident, $capturing:ident, $free:ident, $per_thread:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(dptr: *mut CUdeviceptr, bytesize: usize, pool: CUmemoryPool, hStream: CUstream) -> CUresult {
            let driver = driver_or_return!();
            let real = real_or_return!(driver, $field);
            let on = OnStream { stream: hStream, is_capturing: driver.$capturing, free: driver.$free, per_thread: $per_thread };
            // SAFETY: forwards the caller's arguments unchanged.
            unsafe { pool_allocate(driver, Some(pool), on, dptr, bytesize, || real(dptr, bytesize, pool, hStream)) }
        }
    };
}
pool_alloc!(cuMemAllocFromPoolAsync, mem_alloc_from_pool, stream_is_capturing, mem_free_async, false);
pool_alloc!(cuMemAllocFromPoolAsync_ptsz, mem_alloc_from_pool_ptsz, stream_is_capturing_ptsz, mem_free_async_ptsz, true);

macro_rules! async_free {
    ($name:ident, $field:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
            let driver = driver_or_return!();
            let real = real_or_return!(driver, $field);
            // SAFETY: forwards the caller's arguments unchanged.
            free_pointer(driver, dptr, Some(hStream), || unsafe { real(dptr, hStream) })
        }
    };
}
async_free!(cuMemFreeAsync, mem_free_async);
async_free!(cuMemFreeAsync_ptsz, mem_free_async_ptsz);

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, minBytesToKeep: usize) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_pool_trim_to);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(pool, minBytesToKeep) };
    match mode() {
        Mode::Enforce(session) => session.pools.after(session, driver, Source::Pool(pool), call),
        _ => call(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_pool_destroy);
    // SAFETY: forwards the caller's argument unchanged.
    let call = || unsafe { real(pool) };
    match mode() {
        Mode::Enforce(session) => session.pools.destroy(session, driver, pool, call),
        _ => call(),
    }
}

// ---- synchronizes -------------------------------------------------------------------------------

/// A synchronize: the driver's call, then this process's pool charges settled (see `pools`).
fn synchronize(driver: &Driver, call: impl FnOnce() -> CUresult) -> CUresult {
    match mode() {
        Mode::Enforce(session) => session.pools.synchronize(session, driver, call),
        _ => call(),
    }
}

macro_rules! synchronize_export {
    ($name:ident, $field:ident, $arg:ident: $ty:ty) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name($arg: $ty) -> CUresult {
            let driver = driver_or_return!();
            let real = real_or_return!(driver, $field);
            // SAFETY: forwards the caller's argument unchanged.
            synchronize(driver, || unsafe { real($arg) })
        }
    };
}
synchronize_export!(cuStreamSynchronize, stream_synchronize, hStream: CUstream);
synchronize_export!(cuStreamSynchronize_ptsz, stream_synchronize_ptsz, hStream: CUstream);
synchronize_export!(cuEventSynchronize, event_synchronize, hEvent: CUevent);
synchronize_export!(cuCtxSynchronize_v2, ctx_synchronize_v2, ctx: CUcontext);

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, ctx_synchronize);
    // SAFETY: the call takes no arguments.
    synchronize(driver, || unsafe { real() })
}

// ---- what the workload sees --------------------------------------------------------------------

/// (quota, bytes in use) of the ledger device behind `ordinal`, when enforced.
fn quota(ordinal: CUdevice) -> Option<(u64, u64)> {
    let Mode::Enforce(session) = mode() else { return None };
    session.quota(session.ledger_device(ordinal)?)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_get_info);
    // SAFETY: forwards the caller's arguments unchanged; NULLs get the driver's answer.
    let result = unsafe { real(free, total) };
    if result != CUDA_SUCCESS {
        return result;
    }
    let Some((limit, used)) = current_device(driver).and_then(quota) else { return result };
    // SAFETY: the driver succeeded, so the pointers it wrote are valid; NULL ones are skipped.
    unsafe {
        if !total.is_null() {
            *total = (*total).min(limit as usize);
        }
        if !free.is_null() {
            *free = (*free).min(limit.saturating_sub(used) as usize);
        }
    }
    result
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, device_total_mem);
    // SAFETY: forwards the caller's arguments unchanged.
    let result = unsafe { real(bytes, dev) };
    if result == CUDA_SUCCESS && !bytes.is_null() {
        if let Some((limit, _)) = quota(dev) {
            // SAFETY: the driver succeeded and wrote *bytes.
            unsafe { *bytes = (*bytes).min(limit as usize) };
        }
    }
    result
}

// ---- NVML ----------------------------------------------------------------------------------------

/// What a workload is shown of a device whose real memory is `real` (NVML's numbers; only
/// `total`, `reserved` and `free` are read) when its container has a quota of `limit` bytes
/// and uses `usage` of them: `total = min(total, limit)`, `free = min(free, limit - usage)`
/// (never below 0), `used = total - free`, as `cuMemGetInfo_v2` shows it. `reserved` (what
/// the driver sets aside, counted in NVML's `used`) stays as the driver says, clamped to at
/// most `used`, so `reserved <= used <= total` and `free + used = total` still hold.
fn shown_memory(real: nvmlMemory_v2_t, limit: u64, usage: u64) -> nvmlMemory_v2_t {
    let total = real.total.min(limit);
    let free = real.free.min(limit.saturating_sub(usage)).min(total);
    let used = total - free;
    nvmlMemory_v2_t { version: real.version, total, reserved: real.reserved.min(used), free, used }
}

/// The process's NVML, loaded with the `dlsym` guard up (its initialisers may look symbols up
/// while it is half loaded), or the error each NVML wrapper returns without one.
fn nvml() -> Result<&'static Nvml, nvmlReturn_t> {
    loading(real::nvml).map_err(|error| {
        static REPORTED: AtomicBool = AtomicBool::new(false);
        if !REPORTED.swap(true, Ordering::Relaxed) {
            say(error);
        }
        NVML_ERROR_LIBRARY_NOT_FOUND
    })
}

/// (quota, usage) of the enforced ledger device that NVML's `device` is, found by its UUID.
fn nvml_quota(nvml: &Nvml, device: nvmlDevice_t) -> Option<(u64, u64)> {
    let get_uuid = nvml.device_get_uuid?;
    let mut buffer = [0 as c_char; NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    // SAFETY: the caller's device handle, and a live buffer of the length passed.
    if unsafe { get_uuid(device, buffer.as_mut_ptr(), buffer.len() as c_uint) } != NVML_SUCCESS {
        return None;
    }
    let bytes = buffer.map(|c| u8::from_ne_bytes(c.to_ne_bytes())); // c_char: i8 or u8 by target
    let uuid = CStr::from_bytes_until_nul(&bytes).ok()?.to_str().ok()?;
    session::quota_by_uuid(uuid)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> nvmlReturn_t {
    let nvml = match nvml() {
        Ok(nvml) => nvml,
        Err(code) => return code,
    };
    let Some(real) = nvml.device_get_memory_info else { return NVML_ERROR_FUNCTION_NOT_FOUND };
    // SAFETY: forwards the caller's arguments unchanged; a NULL gets NVML's answer.
    let result = unsafe { real(device, memory) };
    if result != NVML_SUCCESS || memory.is_null() {
        return result;
    }
    if let Some((limit, usage)) = nvml_quota(nvml, device) {
        // SAFETY: NVML succeeded, so `memory` is the caller's valid struct, written.
        let memory = unsafe { &mut *memory };
        let reported = nvmlMemory_v2_t { version: 0, total: memory.total, reserved: 0, free: memory.free, used: memory.used };
        let shown = shown_memory(reported, limit, usage);
        *memory = nvmlMemory_t { total: shown.total, free: shown.free, used: shown.used };
    }
    result
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) -> nvmlReturn_t {
    let nvml = match nvml() {
        Ok(nvml) => nvml,
        Err(code) => return code,
    };
    let Some(real) = nvml.device_get_memory_info_v2 else { return NVML_ERROR_FUNCTION_NOT_FOUND };
    // SAFETY: forwards the caller's arguments unchanged; a NULL or a wrong version gets
    // NVML's answer.
    let result = unsafe { real(device, memory) };
    if result != NVML_SUCCESS || memory.is_null() {
        return result;
    }
    if let Some((limit, usage)) = nvml_quota(nvml, device) {
        // SAFETY: NVML succeeded, so `memory` is the caller's valid struct, written.
        let memory = unsafe { &mut *memory };
        *memory = shown_memory(*memory, limit, usage);
    }
    result
}

// ---- the routes to entry points ----------------------------------------------------------------

/// Our wrapper for a real NVML entry point's address, if we wrap it. NVML is only looked at
/// if the process has loaded it.
fn nvml_wrapper_for(real_address: usize) -> Option<usize> {
    let nvml = real::nvml_if_loaded()?;
    nvml.real_addresses()
        .into_iter()
        .find(|(real, _)| *real == real_address)
        .and_then(|(_, symbol)| wrapper_named(symbol))
}

/// Our wrapper for a real libcuda entry point's address, if we wrap it.
fn wrapper_for(real_address: usize) -> Option<usize> {
    static TABLE: real::Racy<Vec<(usize, usize)>> = real::Racy::new();
    let driver = real::driver().ok()?;
    let table = TABLE.get_or_init(|| {
        driver
            .real_addresses()
            .into_iter()
            .filter_map(|(real, symbol)| Some((real, wrapper_named(symbol)?)))
            .collect()
    });
    table.iter().find(|(real, _)| *real == real_address).map(|(_, wrapper)| *wrapper)
}

fn wrapper_named(symbol: &CStr) -> Option<usize> {
    Some(match symbol.to_bytes() {
        b"cuMemAlloc_v2" => cuMemAlloc_v2 as *const () as usize,
        b"cuMemAllocPitch_v2" => cuMemAllocPitch_v2 as *const () as usize,
        b"cuMemAllocManaged" => cuMemAllocManaged as *const () as usize,
        b"cuMemFree_v2" => cuMemFree_v2 as *const () as usize,
        b"cuMemAllocAsync" => cuMemAllocAsync as *const () as usize,
        b"cuMemAllocAsync_ptsz" => cuMemAllocAsync_ptsz as *const () as usize,
        b"cuMemAllocFromPoolAsync" => cuMemAllocFromPoolAsync as *const () as usize,
        b"cuMemAllocFromPoolAsync_ptsz" => cuMemAllocFromPoolAsync_ptsz as *const () as usize,
        b"cuMemFreeAsync" => cuMemFreeAsync as *const () as usize,
        b"cuMemFreeAsync_ptsz" => cuMemFreeAsync_ptsz as *const () as usize,
        b"cuMemPoolTrimTo" => cuMemPoolTrimTo as *const () as usize,
        b"cuMemPoolDestroy" => cuMemPoolDestroy as *const () as usize,
        b"cuStreamSynchronize" => cuStreamSynchronize as *const () as usize,
        b"cuStreamSynchronize_ptsz" => cuStreamSynchronize_ptsz as *const () as usize,
        b"cuEventSynchronize" => cuEventSynchronize as *const () as usize,
        b"cuCtxSynchronize" => cuCtxSynchronize as *const () as usize,
        b"cuCtxSynchronize_v2" => cuCtxSynchronize_v2 as *const () as usize,
        b"cuMemCreate" => vmm::cuMemCreate as *const () as usize,
        b"cuMemRelease" => vmm::cuMemRelease as *const () as usize,
        b"cuMemMap" => vmm::cuMemMap as *const () as usize,
        b"cuMemUnmap" => vmm::cuMemUnmap as *const () as usize,
        b"cuMemRetainAllocationHandle" => vmm::cuMemRetainAllocationHandle as *const () as usize,
        b"cuDevicePrimaryCtxRetain" => contexts::cuDevicePrimaryCtxRetain as *const () as usize,
        b"cuDevicePrimaryCtxRelease" => contexts::cuDevicePrimaryCtxRelease as *const () as usize,
        b"cuDevicePrimaryCtxRelease_v2" => contexts::cuDevicePrimaryCtxRelease_v2 as *const () as usize,
        b"cuCtxCreate_v2" => contexts::cuCtxCreate_v2 as *const () as usize,
        b"cuCtxCreate_v3" => contexts::cuCtxCreate_v3 as *const () as usize,
        b"cuCtxCreate_v4" => contexts::cuCtxCreate_v4 as *const () as usize,
        b"cuCtxDestroy_v2" => contexts::cuCtxDestroy_v2 as *const () as usize,
        b"cuArrayCreate_v2" => arrays::cuArrayCreate_v2 as *const () as usize,
        b"cuArray3DCreate_v2" => arrays::cuArray3DCreate_v2 as *const () as usize,
        b"cuArrayDestroy" => arrays::cuArrayDestroy as *const () as usize,
        b"cuMipmappedArrayCreate" => arrays::cuMipmappedArrayCreate as *const () as usize,
        b"cuMipmappedArrayDestroy" => arrays::cuMipmappedArrayDestroy as *const () as usize,
        b"cuGraphInstantiate" => graphs::cuGraphInstantiate as *const () as usize,
        b"cuGraphInstantiate_v2" => graphs::cuGraphInstantiate_v2 as *const () as usize,
        b"cuGraphInstantiateWithFlags" => graphs::cuGraphInstantiateWithFlags as *const () as usize,
        b"cuGraphInstantiateWithParams" => graphs::cuGraphInstantiateWithParams as *const () as usize,
        b"cuGraphInstantiateWithParams_ptsz" => graphs::cuGraphInstantiateWithParams_ptsz as *const () as usize,
        b"cuGraphLaunch" => graphs::cuGraphLaunch as *const () as usize,
        b"cuGraphLaunch_ptsz" => graphs::cuGraphLaunch_ptsz as *const () as usize,
        b"cuGraphUpload" => graphs::cuGraphUpload as *const () as usize,
        b"cuGraphUpload_ptsz" => graphs::cuGraphUpload_ptsz as *const () as usize,
        b"cuGraphExecDestroy" => graphs::cuGraphExecDestroy as *const () as usize,
        b"cuDeviceGraphMemTrim" => graphs::cuDeviceGraphMemTrim as *const () as usize,
        b"cuMemGetInfo_v2" => cuMemGetInfo_v2 as *const () as usize,
        b"cuDeviceTotalMem_v2" => cuDeviceTotalMem_v2 as *const () as usize,
        b"cuGetProcAddress" => cuGetProcAddress as *const () as usize,
        b"cuGetProcAddress_v2" => cuGetProcAddress_v2 as *const () as usize,
        b"nvmlDeviceGetMemoryInfo" => nvmlDeviceGetMemoryInfo as *const () as usize,
        b"nvmlDeviceGetMemoryInfo_v2" => nvmlDeviceGetMemoryInfo_v2 as *const () as usize,
        _ => return None,
    })
}

/// Replaces a real entry point in `*pfn` by our wrapper.
///
/// # Safety
/// `pfn` is null or points to a written function pointer.
unsafe fn substitute(pfn: *mut *mut c_void) {
    if pfn.is_null() {
        return;
    }
    // SAFETY: per the contract.
    unsafe {
        if let Some(wrapper) = wrapper_for(*pfn as usize) {
            *pfn = wrapper as *mut c_void;
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, cudaVersion: c_int, flags: u64) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, get_proc_address);
    // SAFETY: forwards the caller's arguments unchanged, then edits its out-pointer.
    unsafe {
        let result = real(symbol, pfn, cudaVersion, flags);
        if result == CUDA_SUCCESS {
            substitute(pfn);
        }
        result
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: u64,
    symbolStatus: *mut c_int,
) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, get_proc_address_v2);
    // SAFETY: forwards the caller's arguments unchanged, then edits its out-pointer.
    unsafe {
        let result = real(symbol, pfn, cudaVersion, flags, symbolStatus);
        if result == CUDA_SUCCESS {
            substitute(pfn);
        }
        result
    }
}

thread_local! {
    /// Set while this thread loads the real driver or NVML (their initialisers may look
    /// symbols up while the library is half loaded): lookups then get the C library's answer.
    static LOADING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's `dlsym` substitution off (it may load a library whose
/// initialisers look symbols up).
fn loading<T>(f: impl FnOnce() -> T) -> T {
    let was = LOADING.with(|loading| loading.replace(true));
    let result = f();
    LOADING.with(|loading| loading.set(was));
    result
}

// ---- dlsym and dlvsym ----------------------------------------------------------------------
//
// Both are exported as small assembly trampolines, so that a lookup the hook has nothing to do
// with reaches the C library's function as a tail call, with the application's own return
// address: glibc resolves `RTLD_NEXT` (and a caller's namespace) from that address, so every
// such lookup gets exactly glibc's answer. Only a name the hook wraps (an exact name from
// [`wrapper_named`]) is answered here: looked up as glibc would (`RTLD_NEXT` among the objects
// after the caller's, [`crate::symbols`]), and a real libcuda or NVML entry point replaced by
// our wrapper. Nothing here loads libcuda or NVML: an address can only be one of theirs if the
// process has loaded them already. The trampolines take no lock.

/// What a trampoline does next: 0, return what the route wrote to its `out`; else jump to this
/// address (the C library's function) with the caller's arguments and return address.
type Next = usize;

/// Whether `symbol` is a name this library answers for (null or unknown: glibc's).
///
/// # Safety
/// `symbol` is null or a NUL-terminated string.
unsafe fn wrapped_name<'a>(symbol: *const c_char) -> Option<&'a CStr> {
    if symbol.is_null() {
        return None;
    }
    // SAFETY: per the contract.
    let name = unsafe { CStr::from_ptr(symbol) };
    (wrapper_named(name).is_some() && !LOADING.with(Cell::get)).then_some(name)
}

/// `found` (the definition of `name` glibc's lookup gives), or our wrapper where it is the real
/// driver's or NVML's entry point of that name. Neither is loaded by this: an address can only
/// be one of theirs if the process has loaded them already.
fn substitute_found(name: &CStr, found: *mut c_void) -> *mut c_void {
    if found.is_null() || wrapper_named(name) == Some(found as usize) {
        return found; // nothing, or our own wrapper (found first where the hook is preloaded)
    }
    let wrapper = if name.to_bytes().starts_with(b"nvml") {
        loading(|| nvml_wrapper_for(found as usize))
    } else if real::driver_loaded() {
        loading(|| wrapper_for(found as usize))
    } else {
        None // libcuda is not loaded: `found` is not one of its entry points
    };
    wrapper.map_or(found, |w| w as *mut c_void)
}

/// The route of a lookup of `symbol` (of `version`, for `dlvsym`) on `handle` called from
/// return address `caller`: `real` is the C library's function (its address), `lookup` calls it
/// with the caller's arguments.
///
/// # Safety
/// `symbol` is null or NUL-terminated; `out` is writable.
unsafe fn route(
    handle: *mut c_void,
    symbol: *const c_char,
    version: Option<&CStr>,
    caller: usize,
    out: *mut *mut c_void,
    real: Option<Next>,
    lookup: impl FnOnce() -> *mut c_void,
) -> Next {
    let Some(real) = real else {
        // SAFETY: per the contract.
        unsafe { *out = std::ptr::null_mut() };
        return 0;
    };
    // SAFETY: per the contract.
    let Some(name) = (unsafe { wrapped_name(symbol) }) else { return real };
    let found = if handle == libc::RTLD_NEXT {
        match crate::symbols::next_definition(caller, name, version) {
            Some(found) => found as *mut c_void,
            None => return real, // not found: glibc's answer (and dlerror)
        }
    } else {
        // Other handles of the caller's namespace do not depend on who calls.
        lookup()
    };
    // SAFETY: per the contract.
    unsafe { *out = substitute_found(name, found) };
    0
}

/// The route of `dlsym(handle, symbol)` called from return address `caller` (`_version` is
/// whatever the trampoline found in the third argument's register).
///
/// # Safety
/// The caller's `dlsym` arguments; `out` is writable.
unsafe extern "C" fn dlsym_route(
    handle: *mut c_void,
    symbol: *const c_char,
    _version: *const c_char,
    caller: usize,
    out: *mut *mut c_void,
) -> Next {
    let real = real::real_dlsym();
    // SAFETY: per the contract; the lookup forwards the caller's arguments.
    unsafe { route(handle, symbol, None, caller, out, real.map(|f| f as Next), || real.map_or(std::ptr::null_mut(), |f| f(handle, symbol))) }
}

/// The route of `dlvsym(handle, symbol, version)` called from return address `caller`: as
/// `dlsym`'s, `RTLD_NEXT` finding only a definition of that version as glibc matches it. The
/// real driver's and NVML's entry points are unversioned in objects that have version tables,
/// so glibc finds none of them through `dlvsym`, whatever the version, and neither does this;
/// a driver entry point glibc does return (from an object without version tables) comes back
/// as our wrapper, as through `dlsym`. A null version is glibc's to answer.
///
/// # Safety
/// The caller's `dlvsym` arguments; `out` is writable.
unsafe extern "C" fn dlvsym_route(
    handle: *mut c_void,
    symbol: *const c_char,
    version: *const c_char,
    caller: usize,
    out: *mut *mut c_void,
) -> Next {
    let real = real::real_dlvsym();
    if version.is_null() {
        if let Some(real) = real {
            return real as Next;
        }
    }
    // SAFETY: per the contract, `version` is null or NUL-terminated.
    let wanted = (!version.is_null()).then(|| unsafe { CStr::from_ptr(version) });
    // SAFETY: per the contract; the lookup forwards the caller's arguments.
    unsafe {
        route(handle, symbol, wanted, caller, out, real.map(|f| f as Next), || real.map_or(std::ptr::null_mut(), |f| f(handle, symbol, version)))
    }
}

/// Defines an exported lookup function as a trampoline into `$route(arg0, arg1, arg2, caller's
/// return address, &answer)`: it returns the answer, or jumps to the address the route returns
/// with the caller's arguments and return address untouched.
macro_rules! lookup_trampoline {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) => $route:ident) => {
        $(#[$doc])*
        #[cfg(target_arch = "x86_64")]
        #[unsafe(naked)]
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> *mut c_void {
            // Frame: [rsp] = the answer, [rsp+16] = rdx, [rsp+24] = rsi, [rsp+32] = rdi,
            // [rsp+40] = the caller's return address (rsp is 16-byte aligned at the call).
            std::arch::naked_asm!(
                "endbr64",
                "push rdi",
                "push rsi",
                "push rdx",
                "sub rsp, 16",
                "mov rcx, [rsp + 40]",
                "mov r8, rsp",
                "call {route}",
                "mov r11, rax",
                "mov rax, [rsp]",
                "add rsp, 16",
                "pop rdx",
                "pop rsi",
                "pop rdi",
                "test r11, r11",
                "jnz 2f",
                "ret",
                "2:",
                "jmp r11",
                route = sym $route,
            )
        }

        $(#[$doc])*
        #[cfg(target_arch = "aarch64")]
        #[unsafe(naked)]
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> *mut c_void {
            // Frame (48 bytes): x29/x30, x0/x1 at +16, x2 at +32, the answer at +40; the
            // caller's return address is x30.
            std::arch::naked_asm!(
                "bti c",
                "stp x29, x30, [sp, #-48]!",
                "mov x29, sp",
                "stp x0, x1, [sp, #16]",
                "str x2, [sp, #32]",
                "mov x3, x30",
                "add x4, sp, #40",
                "bl {route}",
                "mov x16, x0",
                "ldr x17, [sp, #40]",
                "ldp x0, x1, [sp, #16]",
                "ldr x2, [sp, #32]",
                "ldp x29, x30, [sp], #48",
                "cbnz x16, 2f",
                "mov x0, x17",
                "ret",
                "2:",
                "br x16",
                route = sym $route,
            )
        }
    };
}

lookup_trampoline! {
    /// `dlsym` as the C library's, except that a CUDA or NVML entry point we wrap comes back
    /// as our wrapper, whichever handle it was looked up on.
    fn dlsym(handle: *mut c_void, symbol: *const c_char) => dlsym_route
}

lookup_trampoline! {
    /// `dlvsym` as the C library's, except that a CUDA or NVML entry point we wrap comes back
    /// as our wrapper.
    fn dlvsym(handle: *mut c_void, symbol: *const c_char, version: *const c_char) => dlvsym_route
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(total: u64, reserved: u64, free: u64) -> nvmlMemory_v2_t {
        nvmlMemory_v2_t { version: 7, total, reserved, free, used: total - free }
    }

    #[test]
    fn nvml_shows_the_quota_like_cu_mem_get_info() {
        const G: u64 = 1 << 30;
        // 80 GiB device, 10 GiB used machine-wide (0.5 GiB reserved); 8 GiB quota, 3 used.
        let shown = shown_memory(memory(80 * G, G / 2, 70 * G), 8 * G, 3 * G);
        assert_eq!(shown, nvmlMemory_v2_t { version: 7, total: 8 * G, reserved: G / 2, free: 5 * G, used: 3 * G });
        // The device is fuller than the quota says: free is what the device has.
        let shown = shown_memory(memory(80 * G, G / 2, 2 * G), 8 * G, 3 * G);
        assert_eq!((shown.total, shown.free, shown.used), (8 * G, 2 * G, 6 * G));
        // Usage past the quota: free is 0, never negative; reserved stays within used.
        let shown = shown_memory(memory(80 * G, G / 2, 70 * G), 8 * G, 9 * G);
        assert_eq!((shown.total, shown.free, shown.used, shown.reserved), (8 * G, 0, 8 * G, G / 2));
        // Nothing used yet: reserved is clamped to used so the parts still add up.
        let shown = shown_memory(memory(80 * G, G / 2, 80 * G), 8 * G, 0);
        assert_eq!((shown.total, shown.free, shown.used, shown.reserved), (8 * G, 8 * G, 0, 0));
        // A quota larger than the device: the device's own numbers.
        let real = memory(16 * G, 0, 12 * G);
        assert_eq!(shown_memory(real, 1 << 52, 4 * G), real);
    }
}
