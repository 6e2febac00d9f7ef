//! The exported C entry points: exact CUDA driver API names and signatures (`cuda.h`), plus
//! two test-only extras (`fakecuda_device_usage`, `fakecuda_api_calls`). The NVML entry
//! points are in [`crate::nvml`].
//!
//! Each export only checks its raw pointers and hands over to [`crate::driver`] with its own
//! [`Api`] value (through [`call`], or [`call_out`] for the many that answer through one
//! out-pointer); none calls another export, so a uprobe on an exported symbol fires once per
//! call of that symbol. Exports that differ only in name (`_v2` and `_ptsz` twins) are written
//! once with `exports_sharing_body!`, which expands the body into each of them with its own
//! [`Api`] value, so their machine code still differs and they never share an address.
//!
//! Entry points that work before `cuInit`, as in the real driver: `cuInit`,
//! `cuDriverGetVersion`, `cuGetProcAddress{,_v2}`, `cuGetErrorString`, `cuGetErrorName`, and
//! the two extras. Every other one returns `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`, and
//! those that act on the current context return `CUDA_ERROR_INVALID_CONTEXT` without one.
//! Streams are accepted and ignored: work is done synchronously.
//!
//! # Safety
//!
//! Every export is `unsafe` with the contract of its `cuda.h` declaration: pointer arguments
//! are NULL or valid for the documented access. NULL is checked and reported as
//! `CUDA_ERROR_INVALID_VALUE`; nothing else about a caller's pointer can be checked.

// CUDA's names and parameter names; the shared Safety section above covers every export.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use cuda_abi::*;

use crate::api::Api;
use crate::config::Config;
use crate::devfile::DeviceFile;
use crate::driver::{self, call, call_out, count, out, Driver};
use crate::errors::error_strings;
use crate::procaddr;
use crate::procinfo::ProcId;

/// Defines exports that share one `cuda.h` signature and one body. Each is a function of its
/// own: the body is expanded into every one of them with that export's [`Api`] value bound to
/// `$api`, so no export calls another and their machine code differs (one address per symbol).
macro_rules! exports_sharing_body {
    (
        $($(#[$doc:meta])* $name:ident = $variant:ident),+;
        fn $params:tt |$api:ident| $body:block
    ) => {
        $(
            $(#[$doc])*
            #[no_mangle]
            pub unsafe extern "C" fn $name $params -> CUresult {
                let $api = Api::$variant;
                $body
            }
        )+
    };
}
pub(crate) use exports_sharing_body;

/// Bytes -> `size_t`.
fn sz(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// A stable UUID for device `index` of node `node`: FNV-1a hashes, shaped as an RFC 9562
/// version-8 (custom) UUID. The fake NVML reports the same bytes ([`crate::nvml`]).
pub(crate) fn device_uuid(node: &str, index: usize) -> [u8; 16] {
    let fnv = |seed: u64| crate::cgroup::fnv1a(seed, node.bytes().chain(*b"/dev").chain(index.to_string().bytes()));
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

/// CUDA 13.0, or 13.4 for a `FAKECUDA_DRIVER_VERSION` of r615 or later ([`crate::config`]),
/// read from the environment at each call (it works before `cuInit`).
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(driverVersion: *mut c_int) -> CUresult {
    count(Api::DriverGetVersion);
    let version = crate::config::DriverVersion::from_env().cuda_version();
    // SAFETY: the caller passes NULL or a valid int pointer.
    unsafe { out(driverVersion, version) }.err().unwrap_or(CUDA_SUCCESS)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    // SAFETY: the caller passes NULL or a valid CUdevice pointer.
    unsafe { call_out(Api::DeviceGet, device, |d| Ok(d.dev_index(ordinal)? as CUdevice)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    // SAFETY: the caller passes NULL or a valid int pointer.
    unsafe { call_out(Api::DeviceGetCount, count, |d| Ok(d.devs.len() as c_int)) }
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

exports_sharing_body! {
    cuDeviceGetUuid = DeviceGetUuid,
    cuDeviceGetUuid_v2 = DeviceGetUuidV2;
    fn(uuid: *mut CUuuid, dev: CUdevice) |api| {
        let uuid_of = |d: &mut Driver| {
            let i = d.dev_index(dev)?;
            Ok(CUuuid { bytes: device_uuid(&d.cfg.node, i).map(|b| b as c_char) })
        };
        // SAFETY: the caller passes NULL or a valid CUuuid pointer.
        unsafe { call_out(api, uuid, uuid_of) }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let total = |d: &mut Driver| {
        let i = d.dev_index(dev)?;
        Ok(sz(d.devs.get(i).map(|x| x.file.total()).unwrap_or(0)))
    };
    // SAFETY: the caller passes NULL or a valid size_t pointer.
    unsafe { call_out(Api::DeviceTotalMemV2, bytes, total) }
}

// ---- contexts -------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    // SAFETY: the caller passes NULL or a valid CUcontext pointer.
    unsafe { call_out(Api::DevicePrimaryCtxRetain, pctx, |d| Ok(d.primary_retain(dev)? as CUcontext)) }
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
    // SAFETY: the caller passes NULL or a valid CUcontext pointer.
    unsafe { call_out(Api::CtxCreateV2, pctx, |d| Ok(d.ctx_create(flags, dev)? as CUcontext)) }
}

/// CUDA 11.4's `cuCtxCreate` (execution-affinity parameters are not supported).
#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    paramsArray: *mut c_void,
    numParams: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let create = |d: &mut Driver| {
        if numParams != 0 || !paramsArray.is_null() {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        Ok(d.ctx_create(flags, dev)? as CUcontext)
    };
    // SAFETY: the caller passes NULL or a valid CUcontext pointer.
    unsafe { call_out(Api::CtxCreateV3, pctx, create) }
}

/// CUDA 12.5's `cuCtxCreate` (the one CUDA 13's header names). Execution-affinity and CIG parameters are not supported.
#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    ctxCreateParams: *mut CUctxCreateParams,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let create = |d: &mut Driver| {
        // SAFETY: the caller passes NULL or a valid CUctxCreateParams pointer.
        if let Some(p) = unsafe { ctxCreateParams.as_ref() } {
            if p.num_exec_affinity_params != 0 || !p.cig_params.is_null() {
                return Err(CUDA_ERROR_NOT_SUPPORTED);
            }
        }
        Ok(d.ctx_create(flags, dev)? as CUcontext)
    };
    // SAFETY: the caller passes NULL or a valid CUcontext pointer.
    unsafe { call_out(Api::CtxCreateV4, pctx, create) }
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
    // SAFETY: the caller passes NULL or a valid CUcontext pointer.
    unsafe { call_out(Api::CtxGetCurrent, pctx, |d| Ok(d.current_raw() as CUcontext)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    // SAFETY: the caller passes NULL or a valid CUdevice pointer.
    unsafe { call_out(Api::CtxGetDevice, device, |d| Ok(d.current()?.1 as CUdevice)) }
}

// ---- cuMemAlloc family ------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    // SAFETY: the caller passes NULL or a valid CUdeviceptr pointer.
    unsafe { call_out(Api::MemAllocV2, dptr, |d| d.alloc(bytesize as u64, false)) }
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
    let alloc = |d: &mut Driver| {
        if flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        d.alloc(bytesize as u64, true)
    };
    // SAFETY: the caller passes NULL or a valid CUdeviceptr pointer.
    unsafe { call_out(Api::MemAllocManaged, dptr, alloc) }
}

/// Frees any allocation of this process, stream-ordered ones included (their memory stays
/// reserved by the pool).
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    call(Api::MemFreeV2, |d| {
        let (_, dev) = d.current()?;
        d.free(dptr, false)?;
        if d.cfg.free_synchronizes {
            d.pools_synchronized(Some(dev))?;
        }
        Ok(())
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

exports_sharing_body! {
    cuMemAllocAsync = MemAllocAsync,
    cuMemAllocAsync_ptsz = MemAllocAsyncPtsz;
    fn(dptr: *mut CUdeviceptr, bytesize: usize, hStream: CUstream) |api| {
        let alloc = |d: &mut Driver| {
            let (_, dev) = d.current()?;
            // While the stream is captured: an allocation node (crate::graphs).
            if let Some(node) = crate::graphs::capture_alloc(d, hStream, api == Api::MemAllocAsyncPtsz, |_| Ok(dev), bytesize as u64) {
                return node;
            }
            d.pool_alloc(driver::pool_handle(dev), bytesize as u64)
        };
        // SAFETY: the caller passes NULL or a valid CUdeviceptr pointer.
        unsafe { call_out(api, dptr, alloc) }
    }
}

exports_sharing_body! {
    /// Only for stream-ordered allocations; the memory stays reserved by the pool until trimmed.
    cuMemFreeAsync = MemFreeAsync,
    cuMemFreeAsync_ptsz = MemFreeAsyncPtsz;
    fn(dptr: CUdeviceptr, hStream: CUstream) |api| {
        call(api, |d| {
            d.current()?;
            // While the stream is captured: a free node (crate::graphs).
            if let Some(node) = crate::graphs::capture_free(d, hStream, api == Api::MemFreeAsyncPtsz) {
                return node;
            }
            d.free(dptr, true)?;
            if d.cfg.stream_busy_ms > 0 {
                crate::streams::mark_busy(hStream, api == Api::MemFreeAsyncPtsz, d.cfg.stream_busy_ms);
            }
            Ok(())
        })
    }
}

exports_sharing_body! {
    cuMemAllocFromPoolAsync = MemAllocFromPoolAsync,
    cuMemAllocFromPoolAsync_ptsz = MemAllocFromPoolAsyncPtsz;
    fn(dptr: *mut CUdeviceptr, bytesize: usize, pool: CUmemoryPool, hStream: CUstream) |api| {
        let alloc = |d: &mut Driver| {
            // While the stream is captured: an allocation node on the pool's device (crate::graphs).
            let ptsz = api == Api::MemAllocFromPoolAsyncPtsz;
            if let Some(node) = crate::graphs::capture_alloc(d, hStream, ptsz, |d| Ok(d.pool(pool as u64)?.dev), bytesize as u64) {
                return node;
            }
            d.pool_alloc(pool as u64, bytesize as u64)
        };
        // SAFETY: the caller passes NULL or a valid CUdeviceptr pointer.
        unsafe { call_out(api, dptr, alloc) }
    }
}

/// The device's current pool: always its default pool (`cuDeviceSetMemPool` is not modelled).
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    let handle = |d: &mut Driver| Ok(driver::pool_handle(d.dev_index(dev)?) as CUmemoryPool);
    // SAFETY: the caller passes NULL or a valid CUmemoryPool pointer.
    unsafe { call_out(Api::DeviceGetMemPool, pool, handle) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, minBytesToKeep: usize) -> CUresult {
    call(Api::MemPoolTrimTo, |d| {
        d.pool(pool as u64)?;
        if d.cfg.trim_keeps {
            return Ok(()); // FAKECUDA_TRIM_KEEPS: a driver that keeps what its pools reserved
        }
        d.pool_trim(pool as u64, minBytesToKeep as u64)
    })
}

// ---- virtual memory management ------------------------------------------------------------------------

/// Pinned memory located on a device (charged to it) or on the host (`CU_MEM_LOCATION_TYPE_HOST*`:
/// charged to no device); `size` must be a multiple of 2 MiB. Handles carry
/// [`driver::VMM_HANDLE_TAG`] in their top bits, so they never equal a device pointer.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    let create = |d: &mut Driver| {
        // SAFETY: the caller passes NULL or a valid CUmemAllocationProp pointer.
        let prop = unsafe { prop.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        d.mem_create(size as u64, prop, flags)
    };
    // SAFETY: the caller passes NULL or a valid CUmemGenericAllocationHandle pointer.
    unsafe { call_out(Api::MemCreate, handle, create) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    call(Api::MemRelease, |d| d.mem_release(handle))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) -> CUresult {
    // SAFETY: the caller passes NULL or a valid CUmemGenericAllocationHandle pointer.
    unsafe { call_out(Api::MemRetainAllocationHandle, handle, |d| d.mem_retain(addr as u64)) }
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
    let reserve = |d: &mut Driver| d.address_reserve(size as u64, alignment as u64, flags);
    // SAFETY: the caller passes NULL or a valid CUdeviceptr pointer.
    unsafe { call_out(Api::MemAddressReserve, ptr, reserve) }
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
    let granularity_of = |d: &mut Driver| {
        // SAFETY: the caller passes NULL or a valid CUmemAllocationProp pointer.
        let prop = unsafe { prop.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        d.check_prop(prop)?;
        Ok(sz(driver::PAGE))
    };
    // SAFETY: the caller passes NULL or a valid size_t pointer.
    unsafe { call_out(Api::MemGetAllocationGranularity, granularity, granularity_of) }
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
