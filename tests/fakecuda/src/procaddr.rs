//! `cuGetProcAddress{,_v2}`: resolves a driver API base name (as cudart and the CUDA headers
//! ask for it, e.g. `"cuMemAlloc"`) at a CUDA version to the exported function the real driver
//! would return, e.g. `cuMemAlloc_v2` from 3.2 on. The pointer handed out is the address of
//! the exported symbol itself, so uprobes on that symbol see calls made through it.
//!
//! Rules follow the CUDA headers' `#define`s: `cuMemAlloc`, `cuMemAllocPitch`, `cuMemFree`,
//! `cuMemGetInfo`, `cuDeviceTotalMem` -> `_v2` (>= 3020); `cuCtxDestroy` -> `_v2` (>= 4000);
//! `cuCtxCreate` -> `_v2` (>= 3020), `_v4` from 13000 as in CUDA 13's header;
//! `cuDevicePrimaryCtxRelease` -> `_v2` (>= 11000); `cuDeviceGetUuid` -> `_v2` (>= 11040);
//! `cuGetProcAddress` -> `_v2` (>= 12000). With `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`
//! (flag value 2, `1 << 1` in `cuda.h`) the stream-ordered calls resolve to their `_ptsz`
//! variants. Versioned names (`"cuMemAlloc_v2"`), names the fake does not implement, and the
//! pre-3.2 `_v1` entry points are `CUDA_ERROR_NOT_FOUND` with status
//! `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`; a version older than the symbol is
//! `CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`.

use std::ffi::{c_char, c_int, c_void, CStr};

use cuda_abi::*;

use crate::exports as e;

/// The address an entry point resolves to, or the query status explaining why none.
pub fn resolve(symbol: &str, version: c_int, flags: u64) -> Result<usize, c_int> {
    let ptds = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let v = version;
    let (since, addr): (c_int, usize) = match symbol {
        "cuInit" => (2000, e::cuInit as *const () as usize),
        "cuDriverGetVersion" => (2020, e::cuDriverGetVersion as *const () as usize),
        "cuDeviceGet" => (2000, e::cuDeviceGet as *const () as usize),
        "cuDeviceGetCount" => (2000, e::cuDeviceGetCount as *const () as usize),
        "cuDeviceGetName" => (2000, e::cuDeviceGetName as *const () as usize),
        "cuDeviceGetUuid" if v >= 11040 => (11040, e::cuDeviceGetUuid_v2 as *const () as usize),
        "cuDeviceGetUuid" => (9020, e::cuDeviceGetUuid as *const () as usize),
        "cuDeviceTotalMem" => (3020, e::cuDeviceTotalMem_v2 as *const () as usize),
        "cuDevicePrimaryCtxRetain" => (7000, e::cuDevicePrimaryCtxRetain as *const () as usize),
        "cuDevicePrimaryCtxRelease" if v >= 11000 => (11000, e::cuDevicePrimaryCtxRelease_v2 as *const () as usize),
        "cuDevicePrimaryCtxRelease" => (7000, e::cuDevicePrimaryCtxRelease as *const () as usize),
        "cuCtxCreate" if v >= 13000 => (13000, e::cuCtxCreate_v4 as *const () as usize),
        "cuCtxCreate" => (3020, e::cuCtxCreate_v2 as *const () as usize),
        "cuCtxDestroy" => (4000, e::cuCtxDestroy_v2 as *const () as usize),
        "cuCtxSetCurrent" => (4000, e::cuCtxSetCurrent as *const () as usize),
        "cuCtxGetCurrent" => (4000, e::cuCtxGetCurrent as *const () as usize),
        "cuCtxGetDevice" => (2000, e::cuCtxGetDevice as *const () as usize),
        "cuMemAlloc" => (3020, e::cuMemAlloc_v2 as *const () as usize),
        "cuMemAllocPitch" => (3020, e::cuMemAllocPitch_v2 as *const () as usize),
        "cuMemAllocManaged" => (6000, e::cuMemAllocManaged as *const () as usize),
        "cuMemFree" => (3020, e::cuMemFree_v2 as *const () as usize),
        "cuMemGetInfo" => (3020, e::cuMemGetInfo_v2 as *const () as usize),
        "cuMemAllocAsync" if ptds => (11020, e::cuMemAllocAsync_ptsz as *const () as usize),
        "cuMemAllocAsync" => (11020, e::cuMemAllocAsync as *const () as usize),
        "cuMemFreeAsync" if ptds => (11020, e::cuMemFreeAsync_ptsz as *const () as usize),
        "cuMemFreeAsync" => (11020, e::cuMemFreeAsync as *const () as usize),
        "cuMemAllocFromPoolAsync" if ptds => (11020, e::cuMemAllocFromPoolAsync_ptsz as *const () as usize),
        "cuMemAllocFromPoolAsync" => (11020, e::cuMemAllocFromPoolAsync as *const () as usize),
        "cuDeviceGetMemPool" => (11020, e::cuDeviceGetMemPool as *const () as usize),
        "cuMemPoolTrimTo" => (11020, e::cuMemPoolTrimTo as *const () as usize),
        "cuMemPoolGetAttribute" => (11020, e::cuMemPoolGetAttribute as *const () as usize),
        "cuMemCreate" => (10020, e::cuMemCreate as *const () as usize),
        "cuMemRelease" => (10020, e::cuMemRelease as *const () as usize),
        "cuMemAddressReserve" => (10020, e::cuMemAddressReserve as *const () as usize),
        "cuMemAddressFree" => (10020, e::cuMemAddressFree as *const () as usize),
        "cuMemMap" => (10020, e::cuMemMap as *const () as usize),
        "cuMemUnmap" => (10020, e::cuMemUnmap as *const () as usize),
        "cuMemSetAccess" => (10020, e::cuMemSetAccess as *const () as usize),
        "cuMemGetAllocationGranularity" => (10020, e::cuMemGetAllocationGranularity as *const () as usize),
        "cuGetProcAddress" if v >= 12000 => (12000, e::cuGetProcAddress_v2 as *const () as usize),
        "cuGetProcAddress" => (11030, e::cuGetProcAddress as *const () as usize),
        "cuGetErrorString" => (6000, e::cuGetErrorString as *const () as usize),
        "cuGetErrorName" => (6000, e::cuGetErrorName as *const () as usize),
        _ => return Err(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND),
    };
    if v < since {
        return Err(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    }
    Ok(addr)
}

/// The shared body of both exported forms (`status` may be NULL).
///
/// # Safety
/// `symbol` must be NULL or NUL-terminated; `pfn` and `status` NULL or valid for writes.
pub unsafe fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    let report = |s: c_int| {
        if !status.is_null() {
            // SAFETY: non-null, valid per this function's contract.
            unsafe { status.write(s) };
        }
    };
    let known = CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    if symbol.is_null() || pfn.is_null() || flags & !known != 0 || flags == known {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    let name = unsafe { CStr::from_ptr(symbol) };
    let found = name.to_str().map_err(|_| CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND).and_then(|n| resolve(n, version, flags));
    match found {
        Ok(addr) => {
            // SAFETY: non-null, valid per this function's contract.
            unsafe { pfn.write(addr as *mut c_void) };
            report(CU_GET_PROC_ADDRESS_SUCCESS);
            CUDA_SUCCESS
        }
        Err(s) => {
            // SAFETY: as above.
            unsafe { pfn.write(std::ptr::null_mut()) };
            report(s);
            CUDA_ERROR_NOT_FOUND
        }
    }
}
