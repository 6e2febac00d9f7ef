//! The exported C entry points: exact CUDA driver API names and signatures (`cuda.h`), plus
//! two test-only extras (`fakecuda_device_usage`, `fakecuda_api_calls`).
//!
//! Each export only checks its raw pointers and hands over to [`crate::driver`] with its own
//! [`Api`] value; none calls another export, so a uprobe on an exported symbol fires once per
//! call of that symbol. Entry points that work before `cuInit`, as in the real driver:
//! `cuInit`, `cuDriverGetVersion`, `cuGetProcAddress{,_v2}`, `cuGetErrorString`,
//! `cuGetErrorName`, and the two extras. Every other one returns
//! `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`, and those that act on the current context
//! return `CUDA_ERROR_INVALID_CONTEXT` without one. Streams are accepted and ignored: work is
//! done synchronously.

//!
//! # Safety
//!
//! Every export is `unsafe` with the contract of its `cuda.h` declaration: pointer arguments
//! are NULL or valid for the documented access. NULL is checked and reported as
//! `CUDA_ERROR_INVALID_VALUE`; nothing else about a caller's pointer can be checked.

// CUDA's names and parameter names; the shared Safety section above covers every export.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use crate::api::Api;
use crate::config::Config;
use crate::devfile::DeviceFile;
use crate::driver::{self, call, count, out, Driver};
use crate::procaddr;
use crate::procinfo::ProcId;
use crate::types::*;

/// The driver version the fake reports (CUDA 13.0).
pub const DRIVER_VERSION: c_int = 13000;

/// Bytes -> `size_t`.
fn sz(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// A stable UUID for device `index` of node `node`: FNV-1a hashes, shaped as an RFC 9562
/// version-8 (custom) UUID.
fn device_uuid(node: &str, index: usize) -> [u8; 16] {
    let fnv = |seed: u64| {
        let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
        for b in node.bytes().chain(b"/dev".iter().copied()).chain(index.to_string().bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    };
    let mut u = [0u8; 16];
    u[..8].copy_from_slice(&fnv(0).to_be_bytes());
    u[8..].copy_from_slice(&fnv(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    u[6] = (u[6] & 0x0f) | 0x80;
    u[8] = (u[8] & 0x3f) | 0x80;
    u
}

// ---- initialisation and devices --------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuInit(Flags: c_uint) -> CUresult {
    count(Api::Init);
    if Flags != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let mut guard = driver::lock();
    if matches!(guard.as_ref(), Some(d) if driver::is_ours(d)) {
        return CUDA_SUCCESS;
    }
    match Driver::init() {
        Ok(d) => {
            driver::adopt(&d);
            *guard = Some(d);
            CUDA_SUCCESS
        }
        Err(e) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(driverVersion: *mut c_int) -> CUresult {
    count(Api::DriverGetVersion);
    // SAFETY: the caller passes NULL or a valid int pointer.
    unsafe { out(driverVersion, DRIVER_VERSION) }.err().unwrap_or(CUDA_SUCCESS)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    call(Api::DeviceGet, |d| {
        if device.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let i = d.dev_index(ordinal)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(device, i as CUdevice) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    call(Api::DeviceGetCount, |d| {
        // SAFETY: the caller passes NULL or a valid int pointer.
        unsafe { out(count, d.devs.len() as c_int) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    call(Api::DeviceGetName, |d| {
        if name.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let i = d.dev_index(dev)?;
        let text = format!("FakeCUDA Device {i} ({})", d.cfg.node);
        let n = text.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds `len` bytes and `n + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), name, n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

fn get_uuid(api: Api, uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    call(api, |d| {
        if uuid.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let i = d.dev_index(dev)?;
        let bytes = device_uuid(&d.cfg.node, i).map(|b| b as c_char);
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(uuid, CUuuid { bytes }) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    get_uuid(Api::DeviceGetUuid, uuid, dev)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    get_uuid(Api::DeviceGetUuidV2, uuid, dev)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    call(Api::DeviceTotalMemV2, |d| {
        if bytes.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let i = d.dev_index(dev)?;
        let total = d.devs.get(i).map(|x| x.file.total()).unwrap_or(0);
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(bytes, sz(total)) }
    })
}

// ---- contexts -------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    call(Api::DevicePrimaryCtxRetain, |d| {
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = d.primary_retain(dev)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(pctx, h as CUcontext) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    call(Api::DevicePrimaryCtxRelease, |d| d.primary_release(dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    call(Api::DevicePrimaryCtxReleaseV2, |d| d.primary_release(dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult {
    call(Api::CtxCreateV2, |d| {
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = d.ctx_create(flags, dev)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(pctx, h as CUcontext) }
    })
}

/// CUDA 13's `cuCtxCreate`. Execution-affinity and CIG parameters are not supported.
#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    ctxCreateParams: *mut CUctxCreateParams,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    call(Api::CtxCreateV4, |d| {
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes NULL or a valid CUctxCreateParams pointer.
        if let Some(p) = unsafe { ctxCreateParams.as_ref() } {
            if p.num_exec_affinity_params != 0 || !p.cig_params.is_null() {
                return Err(CUDA_ERROR_NOT_SUPPORTED);
            }
        }
        let h = d.ctx_create(flags, dev)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(pctx, h as CUcontext) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    call(Api::CtxDestroyV2, |d| d.ctx_destroy(ctx as u64))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    call(Api::CtxSetCurrent, |d| d.set_current(ctx as u64))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    call(Api::CtxGetCurrent, |d| {
        // SAFETY: the caller passes NULL or a valid CUcontext pointer.
        unsafe { out(pctx, d.current_raw() as CUcontext) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    call(Api::CtxGetDevice, |d| {
        if device.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (_, dev) = d.current()?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(device, dev as CUdevice) }
    })
}

// ---- cuMemAlloc family ------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    call(Api::MemAllocV2, |d| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = d.alloc(bytesize as u64, false)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(dptr, p) }
    })
}

/// Pitch = `WidthInBytes` rounded up to 512; charges `pitch x Height` like `cuMemAlloc_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pPitch: *mut usize,
    WidthInBytes: usize,
    Height: usize,
    ElementSizeBytes: c_uint,
) -> CUresult {
    call(Api::MemAllocPitchV2, |d| {
        if dptr.is_null() || pPitch.is_null() || WidthInBytes == 0 || Height == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if ![4, 8, 16].contains(&ElementSizeBytes) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let pitch = (WidthInBytes as u64).div_ceil(512).checked_mul(512).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let bytes = pitch.checked_mul(Height as u64).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let p = d.alloc(bytes, false)?;
        // SAFETY: both non-null, valid per the C contract.
        unsafe {
            out(pPitch, sz(pitch))?;
            out(dptr, p)
        }
    })
}

/// Managed memory is charged as resident device memory on the current device, with the same
/// granularity as `cuMemAlloc_v2` (the fake never migrates it to the host).
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytesize: usize, flags: c_uint) -> CUresult {
    call(Api::MemAllocManaged, |d| {
        if dptr.is_null() || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = d.alloc(bytesize as u64, true)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(dptr, p) }
    })
}

/// Frees any allocation of this process, stream-ordered ones included (their memory stays
/// reserved by the pool).
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    call(Api::MemFreeV2, |d| {
        d.current()?;
        d.free(dptr, false)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    call(Api::MemGetInfoV2, |d| {
        if free.is_null() || total.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (_, dev) = d.current()?;
        let (used, all) = d.device_usage(dev)?;
        // SAFETY: both non-null, valid per the C contract.
        unsafe {
            out(free, sz(all.saturating_sub(used)))?;
            out(total, sz(all))
        }
    })
}

// ---- stream-ordered allocation --------------------------------------------------------------------

fn alloc_async(api: Api, dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    call(api, |d| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (_, dev) = d.current()?;
        let p = d.pool_alloc(dev, bytesize as u64)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(dptr, p) }
    })
}

fn alloc_from_pool(api: Api, dptr: *mut CUdeviceptr, bytesize: usize, pool: CUmemoryPool) -> CUresult {
    call(api, |d| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = d.pool_dev(pool as u64)?;
        let p = d.pool_alloc(dev, bytesize as u64)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(dptr, p) }
    })
}

fn free_async(api: Api, dptr: CUdeviceptr) -> CUresult {
    call(api, |d| {
        d.current()?;
        d.free(dptr, true)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytesize: usize, hStream: CUstream) -> CUresult {
    let _ = hStream;
    alloc_async(Api::MemAllocAsync, dptr, bytesize)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, bytesize: usize, hStream: CUstream) -> CUresult {
    let _ = hStream;
    alloc_async(Api::MemAllocAsyncPtsz, dptr, bytesize)
}

/// Only for stream-ordered allocations; the memory stays reserved by the pool until trimmed.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
    let _ = hStream;
    free_async(Api::MemFreeAsync, dptr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
    let _ = hStream;
    free_async(Api::MemFreeAsyncPtsz, dptr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    hStream: CUstream,
) -> CUresult {
    let _ = hStream;
    alloc_from_pool(Api::MemAllocFromPoolAsync, dptr, bytesize, pool)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    hStream: CUstream,
) -> CUresult {
    let _ = hStream;
    alloc_from_pool(Api::MemAllocFromPoolAsyncPtsz, dptr, bytesize, pool)
}

/// The device's default pool (the only kind of pool the fake has).
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    call(Api::DeviceGetMemPool, |d| {
        if pool.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let i = d.dev_index(dev)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(pool, driver::pool_handle(i) as CUmemoryPool) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, minBytesToKeep: usize) -> CUresult {
    call(Api::MemPoolTrimTo, |d| {
        let dev = d.pool_dev(pool as u64)?;
        d.pool_trim(dev, minBytesToKeep as u64)
    })
}

// ---- virtual memory management ------------------------------------------------------------------------

/// Device-located pinned memory only; `size` must be a multiple of 2 MiB. Handles carry
/// [`driver::VMM_HANDLE_TAG`] in their top bits, so they never equal a device pointer.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    call(Api::MemCreate, |d| {
        // SAFETY: the caller passes NULL or a valid CUmemAllocationProp pointer.
        let prop = unsafe { prop.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = d.mem_create(size as u64, prop, flags)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(handle, h) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    call(Api::MemRelease, |d| d.mem_release(handle))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    addr: CUdeviceptr,
    flags: u64,
) -> CUresult {
    let _ = addr;
    call(Api::MemAddressReserve, |d| {
        if ptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = d.address_reserve(size as u64, alignment as u64, flags)?;
        // SAFETY: non-null, valid per the C contract.
        unsafe { out(ptr, p) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    call(Api::MemAddressFree, |d| d.address_free(ptr, size as u64))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    call(Api::MemMap, |d| d.mem_map(ptr, size as u64, offset as u64, handle, flags))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    call(Api::MemUnmap, |d| d.mem_unmap(ptr, size as u64))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    call(Api::MemSetAccess, |d| {
        if desc.is_null() || count == 0 || count > 1024 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes `count` valid descriptors at `desc` (checked non-null, and
        // `count` is bounded).
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        d.set_access(ptr, size as u64, descs)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    option: c_int,
) -> CUresult {
    call(Api::MemGetAllocationGranularity, |d| {
        // SAFETY: the caller passes NULL or a valid CUmemAllocationProp pointer.
        let prop = unsafe { prop.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        d.check_prop(prop)?;
        // SAFETY: the caller passes NULL or a valid size_t pointer.
        unsafe { out(granularity, sz(driver::PAGE)) }
    })
}

// ---- entry points and errors ----------------------------------------------------------------------------

/// Legacy (CUDA 11.3) form without the symbol status.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: u64,
) -> CUresult {
    count(Api::GetProcAddress);
    // SAFETY: the caller passes NULL or a NUL-terminated string, and NULL or a valid pointer.
    unsafe { procaddr::get_proc_address(symbol, pfn, cudaVersion, flags, std::ptr::null_mut()) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: u64,
    symbolStatus: *mut c_int,
) -> CUresult {
    count(Api::GetProcAddressV2);
    // SAFETY: the caller passes NULL or a NUL-terminated string, and NULL or valid pointers.
    unsafe { procaddr::get_proc_address(symbol, pfn, cudaVersion, flags, symbolStatus) }
}

fn error_string(api: Api, error: CUresult, pstr: *mut *const c_char, name: bool) -> CUresult {
    count(api);
    if pstr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let (text, rc) = match error_strings(error) {
        Some((n, s)) => ((if name { n } else { s }).as_ptr(), CUDA_SUCCESS),
        None => (std::ptr::null(), CUDA_ERROR_INVALID_VALUE),
    };
    // SAFETY: non-null, valid per the C contract.
    unsafe { pstr.write(text) };
    rc
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, pStr: *mut *const c_char) -> CUresult {
    error_string(Api::GetErrorString, error, pStr, false)
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, pStr: *mut *const c_char) -> CUresult {
    error_string(Api::GetErrorName, error, pStr, true)
}

// ---- test-only extras --------------------------------------------------------------------------------------

/// Device `dev`'s true use across all processes (dead ones reaped first) and its size. Needs
/// neither `cuInit` nor a context: without `cuInit` it reads the configuration from the
/// environment and opens (or creates) the device file itself.
#[no_mangle]
pub unsafe extern "C" fn fakecuda_device_usage(dev: c_int, used: *mut u64, total: *mut u64) -> CUresult {
    count(Api::DeviceUsage);
    if used.is_null() || total.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let guard = driver::lock();
    let result = match guard.as_ref() {
        Some(d) if driver::is_ours(d) => d.dev_index(dev).and_then(|i| d.device_usage(i)),
        _ => standalone_usage(dev),
    };
    drop(guard);
    match result {
        Ok((u, t)) => {
            // SAFETY: both non-null, valid per the C contract.
            unsafe {
                used.write(u);
                total.write(t);
            }
            CUDA_SUCCESS
        }
        Err(e) => e,
    }
}

fn standalone_usage(dev: c_int) -> Result<(u64, u64), CUresult> {
    let cfg = Config::from_env().map_err(|e| {
        eprintln!("{e}");
        CUDA_ERROR_INVALID_VALUE
    })?;
    let index = u32::try_from(dev).ok().filter(|&i| i < cfg.device_count).ok_or(CUDA_ERROR_INVALID_DEVICE)?;
    let file = DeviceFile::open_or_create(&cfg.state_dir, &cfg.node, index, cfg.device_bytes).map_err(|e| {
        eprintln!("{}", e.message);
        e.code
    })?;
    driver::usage_of(&file, &ProcId::current())
}

/// How many times this process called the exported entry point named `symbol` (any export,
/// however the caller found its address); 0 for unknown names.
#[no_mangle]
pub unsafe extern "C" fn fakecuda_api_calls(symbol: *const c_char) -> u64 {
    count(Api::ApiCalls);
    if symbol.is_null() {
        return 0;
    }
    // SAFETY: non-null, and the caller passes a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(symbol) };
    Api::ALL
        .iter()
        .find(|a| a.name().as_bytes() == name.to_bytes())
        .map(|&a| driver::calls(a))
        .unwrap_or(0)
}
