//! Streams, events, synchronization and the context calls clients make around them:
//! `cuStreamCreate`, `cuStreamCreateWithPriority`, `cuStreamDestroy_v2`,
//! `cuStreamSynchronize`, `cuStreamQuery`, `cuEventCreate`, `cuEventRecord`,
//! `cuEventQuery`, `cuEventSynchronize`, `cuEventDestroy_v2`, `cuCtxSynchronize`,
//! `cuCtxPushCurrent_v2`, `cuCtxPopCurrent_v2`, `cuCtxGetFlags`, `cuCtxGetApiVersion`,
//! `cuCtxGetStreamPriorityRange`, `cuDevicePrimaryCtxGetState`.
//!
//! The fake does all work synchronously, so every stream and event is always complete
//! (`CUDA_SUCCESS` from the queries). What a synchronization does that matters for memory
//! is modelled: stream-ordered pools give reserved memory above their release threshold
//! back (`cuStreamSynchronize`, `cuEventSynchronize`, `cuCtxSynchronize`; see
//! [`crate::driver::Driver::pools_synchronized`]). Streams and events are handles of this
//! process, checked on use (an unknown one is `CUDA_ERROR_INVALID_HANDLE`); the NULL
//! stream and the legacy/per-thread default stream handles (1, 2) are always valid.
//!
//! # Safety
//!
//! Every export is `unsafe` with the contract of its `cuda.h` declaration (see
//! [`crate::exports`]).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use cuda_abi::*;

use crate::api::Api;
use crate::driver::{call, call_out, out, Driver};

const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`.
const DEFAULT_STREAMS: [u64; 3] = [0, 1, 2];
const STREAM_BASE: u64 = 0x0000_5ca4_0000_0000;
const EVENT_BASE: u64 = 0x0000_5ca5_0000_0000;

/// Handle -> device of the context it was made in, for streams and events.
struct Handles {
    streams: BTreeMap<u64, usize>,
    events: BTreeMap<u64, usize>,
    next: u64,
}

/// Streams with work queued (`FAKECUDA_STREAM_BUSY_MS`), by handle: until when.
static BUSY: Mutex<BTreeMap<u64, Instant>> = Mutex::new(BTreeMap::new());

/// `stream` (NULL of a `_ptsz` call is the per-thread stream) has work queued for `ms`.
pub(crate) fn mark_busy(stream: CUstream, per_thread: bool, ms: u64) {
    let key = match stream as u64 {
        0 if per_thread => CU_STREAM_PER_THREAD as u64,
        s => s,
    };
    BUSY.lock().unwrap_or_else(PoisonError::into_inner).insert(key, Instant::now() + Duration::from_millis(ms));
}

/// Until when `stream` has work queued, if it has.
fn busy_until(stream: CUstream) -> Option<Instant> {
    let busy = BUSY.lock().unwrap_or_else(PoisonError::into_inner);
    busy.get(&(stream as u64)).copied().filter(|&until| until > Instant::now())
}

static HANDLES: Mutex<Handles> = Mutex::new(Handles { streams: BTreeMap::new(), events: BTreeMap::new(), next: 0 });

fn handles() -> std::sync::MutexGuard<'static, Handles> {
    HANDLES.lock().unwrap_or_else(PoisonError::into_inner)
}

fn new_handle(d: &Driver, base: u64, events: bool) -> Result<u64, CUresult> {
    let (_, dev) = d.current()?;
    let mut h = handles();
    h.next += 1;
    let handle = base + h.next * 0x10;
    if events { h.events.insert(handle, dev) } else { h.streams.insert(handle, dev) };
    Ok(handle)
}

/// The device a stream belongs to (`None` for the default streams: the current context's).
pub(crate) fn stream_dev(d: &Driver, stream: CUstream) -> Result<usize, CUresult> {
    let s = stream as u64;
    if DEFAULT_STREAMS.contains(&s) {
        return Ok(d.current()?.1);
    }
    handles().streams.get(&s).copied().ok_or(CUDA_ERROR_INVALID_HANDLE)
}

fn event_dev(event: CUevent) -> Result<usize, CUresult> {
    handles().events.get(&(event as u64)).copied().ok_or(CUDA_ERROR_INVALID_HANDLE)
}

/// The shared body of the two stream constructors (priorities are accepted and ignored).
///
/// # Safety
/// `ph` must be NULL or valid for a write.
unsafe fn stream_create(api: Api, ph: *mut CUstream, flags: c_uint) -> CUresult {
    let create = |d: &mut Driver| {
        if flags > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(new_handle(d, STREAM_BASE, false)? as CUstream)
    };
    // SAFETY: per this function's contract.
    unsafe { call_out(api, ph, create) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(phStream: *mut CUstream, Flags: c_uint) -> CUresult {
    // SAFETY: the caller passes NULL or a valid CUstream pointer.
    unsafe { stream_create(Api::StreamCreate, phStream, Flags) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(phStream: *mut CUstream, flags: c_uint, priority: c_int) -> CUresult {
    let _ = priority;
    // SAFETY: the caller passes NULL or a valid CUstream pointer.
    unsafe { stream_create(Api::StreamCreateWithPriority, phStream, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(hStream: CUstream) -> CUresult {
    call(Api::StreamDestroyV2, |_| handles().streams.remove(&(hStream as u64)).map(|_| ()).ok_or(CUDA_ERROR_INVALID_HANDLE))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(hStream: CUstream) -> CUresult {
    if let Some(until) = busy_until(hStream) {
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
    }
    call(Api::StreamSynchronize, |d| {
        let dev = stream_dev(d, hStream)?;
        d.pools_synchronized(Some(dev))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(hStream: CUstream) -> CUresult {
    call(Api::StreamQuery, |d| {
        stream_dev(d, hStream)?;
        match busy_until(hStream) {
            Some(_) => Err(CUDA_ERROR_NOT_READY),
            None => Ok(()),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(phEvent: *mut CUevent, Flags: c_uint) -> CUresult {
    let create = |d: &mut Driver| {
        if Flags > 0xf {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(new_handle(d, EVENT_BASE, true)? as CUevent)
    };
    // SAFETY: the caller passes NULL or a valid CUevent pointer.
    unsafe { call_out(Api::EventCreate, phEvent, create) }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(hEvent: CUevent, hStream: CUstream) -> CUresult {
    call(Api::EventRecord, |d| {
        event_dev(hEvent)?;
        stream_dev(d, hStream).map(|_| ())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(hEvent: CUevent) -> CUresult {
    call(Api::EventQuery, |_| event_dev(hEvent).map(|_| ()))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(hEvent: CUevent) -> CUresult {
    call(Api::EventSynchronize, |d| {
        let dev = event_dev(hEvent)?;
        d.pools_synchronized(Some(dev))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(hEvent: CUevent) -> CUresult {
    call(Api::EventDestroyV2, |_| handles().events.remove(&(hEvent as u64)).map(|_| ()).ok_or(CUDA_ERROR_INVALID_HANDLE))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    call(Api::CtxSynchronize, |d| {
        let (_, dev) = d.current()?;
        d.pools_synchronized(Some(dev))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    call(Api::CtxPushCurrentV2, |d| d.push_current(ctx as u64))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    call(Api::CtxPopCurrentV2, |d| {
        let popped = d.pop_current()?;
        if pctx.is_null() {
            return Ok(());
        }
        // SAFETY: non-null, and the caller passes a valid CUcontext pointer.
        unsafe { out(pctx, popped as CUcontext) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetFlags(flags: *mut c_uint) -> CUresult {
    // SAFETY: the caller passes NULL or a valid unsigned int pointer.
    unsafe { call_out(Api::CtxGetFlags, flags, |d| d.current_flags()) }
}

/// The API version of a context (3020 for every context made through the `_v2` API on).
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetApiVersion(ctx: CUcontext, version: *mut c_uint) -> CUresult {
    let _ = ctx;
    // SAFETY: the caller passes NULL or a valid unsigned int pointer.
    unsafe { call_out(Api::CtxGetApiVersion, version, |d| d.current().map(|_| 3020)) }
}

/// H100's range: priorities 0 (least) to -5 (greatest).
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(leastPriority: *mut c_int, greatestPriority: *mut c_int) -> CUresult {
    call(Api::CtxGetStreamPriorityRange, |d| {
        d.current()?;
        // SAFETY: each is NULL (skipped) or a valid int pointer.
        unsafe {
            if !leastPriority.is_null() {
                out(leastPriority, 0)?;
            }
            if !greatestPriority.is_null() {
                out(greatestPriority, -5)?;
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult {
    call(Api::DevicePrimaryCtxGetState, |d| {
        let on = d.primary_active(dev)?;
        // SAFETY: both must be valid pointers (NULL is refused by `out`).
        unsafe {
            out(flags, 0)?;
            out(active, c_int::from(on))
        }
    })
}
