//! `cuGetProcAddress{,_v2}`: resolves a driver API base name (as cudart, cuda-bindings and
//! the CUDA headers ask for it, e.g. `"cuCtxCreate"`) at a CUDA version to the exported
//! function the real driver would return. The pointer handed out is the address of the
//! exported symbol itself, so uprobes on that symbol see calls made through it.
//!
//! [`TABLE`] is `cuda.h`'s versioned names as data: for each base name, the CUDA version from
//! which each of its versioned forms is the one the name stands for (`cuCtxCreate`: `_v2`
//! from 3020, `_v3` from 11040, `_v4` from 12050), the same versions NVIDIA's cuda-bindings
//! requests them with. A request at version `v` gets the form with the highest version not
//! above `v`; a form the fake does not export (the pre-3.2 `_v1` entry points) is
//! `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`, and a version older than every form is
//! `CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`. With
//! `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` (flag value 2, `1 << 1` in `cuda.h`) the
//! stream-ordered calls resolve to their `_ptsz` variants. Versioned names
//! (`"cuMemAlloc_v2"`) and names not in the table are `CUDA_ERROR_NOT_FOUND` with status
//! `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`. A test checks that every exported CUDA entry
//! point is reachable through the table.

use std::ffi::{c_char, c_int, c_void, CStr};

use cuda_abi::*;

use crate::{attributes as a, exports as e, external as x, graphs as g, pools as p, resources as r, streams as s};

/// One base name: `(since, export)` per versioned form, oldest first (`None`: a form the
/// fake does not export), and the `_ptsz` export used under per-thread default streams.
pub struct Entry {
    pub base: &'static str,
    pub forms: &'static [(c_int, Option<&'static str>)],
    pub ptsz: Option<&'static str>,
}

macro_rules! table {
    ($($base:literal: [$($since:literal => $form:tt),+] $(ptsz $ptsz:literal)?;)*) => {
        /// `cuda.h`'s versioned names for every entry point the fake exports.
        pub const TABLE: &[Entry] = &[$(Entry {
            base: $base,
            forms: &[$(($since, table!(@form $form))),+],
            ptsz: table!(@ptsz $($ptsz)?),
        },)*];
    };
    (@form -) => { None };
    (@form $name:literal) => { Some($name) };
    (@ptsz) => { None };
    (@ptsz $name:literal) => { Some($name) };
}

table! {
    "cuInit": [2000 => "cuInit"];
    "cuDriverGetVersion": [2020 => "cuDriverGetVersion"];
    "cuDeviceGet": [2000 => "cuDeviceGet"];
    "cuDeviceGetCount": [2000 => "cuDeviceGetCount"];
    "cuDeviceGetName": [2000 => "cuDeviceGetName"];
    "cuDeviceGetUuid": [9020 => "cuDeviceGetUuid", 11040 => "cuDeviceGetUuid_v2"];
    "cuDeviceTotalMem": [2000 => -, 3020 => "cuDeviceTotalMem_v2"];
    "cuDeviceGetAttribute": [2000 => "cuDeviceGetAttribute"];
    "cuDevicePrimaryCtxRetain": [7000 => "cuDevicePrimaryCtxRetain"];
    "cuDevicePrimaryCtxRelease": [7000 => "cuDevicePrimaryCtxRelease", 11000 => "cuDevicePrimaryCtxRelease_v2"];
    "cuDevicePrimaryCtxGetState": [7000 => "cuDevicePrimaryCtxGetState"];
    "cuCtxCreate": [2000 => -, 3020 => "cuCtxCreate_v2", 11040 => "cuCtxCreate_v3", 12050 => "cuCtxCreate_v4"];
    "cuCtxDestroy": [2000 => -, 4000 => "cuCtxDestroy_v2"];
    "cuCtxPushCurrent": [2000 => -, 4000 => "cuCtxPushCurrent_v2"];
    "cuCtxPopCurrent": [2000 => -, 4000 => "cuCtxPopCurrent_v2"];
    "cuCtxSetCurrent": [4000 => "cuCtxSetCurrent"];
    "cuCtxGetCurrent": [4000 => "cuCtxGetCurrent"];
    "cuCtxGetDevice": [2000 => "cuCtxGetDevice"];
    "cuCtxGetFlags": [7000 => "cuCtxGetFlags"];
    "cuCtxGetApiVersion": [3020 => "cuCtxGetApiVersion"];
    "cuCtxGetStreamPriorityRange": [5050 => "cuCtxGetStreamPriorityRange"];
    "cuCtxSynchronize": [2000 => "cuCtxSynchronize"];
    "cuMemGetInfo": [2000 => -, 3020 => "cuMemGetInfo_v2"];
    "cuMemAlloc": [2000 => -, 3020 => "cuMemAlloc_v2"];
    "cuMemAllocPitch": [2000 => -, 3020 => "cuMemAllocPitch_v2"];
    "cuMemFree": [2000 => -, 3020 => "cuMemFree_v2"];
    "cuMemAllocManaged": [6000 => "cuMemAllocManaged"];
    "cuMemAllocAsync": [11020 => "cuMemAllocAsync"] ptsz "cuMemAllocAsync_ptsz";
    "cuMemFreeAsync": [11020 => "cuMemFreeAsync"] ptsz "cuMemFreeAsync_ptsz";
    "cuMemAllocFromPoolAsync": [11020 => "cuMemAllocFromPoolAsync"] ptsz "cuMemAllocFromPoolAsync_ptsz";
    "cuDeviceGetMemPool": [11020 => "cuDeviceGetMemPool"];
    "cuDeviceGetDefaultMemPool": [11020 => "cuDeviceGetDefaultMemPool"];
    "cuMemPoolCreate": [11020 => "cuMemPoolCreate"];
    "cuMemPoolDestroy": [11020 => "cuMemPoolDestroy"];
    "cuMemPoolTrimTo": [11020 => "cuMemPoolTrimTo"];
    "cuMemPoolGetAttribute": [11020 => "cuMemPoolGetAttribute"];
    "cuMemPoolSetAttribute": [11020 => "cuMemPoolSetAttribute"];
    "cuMemCreate": [10020 => "cuMemCreate"];
    "cuMemRelease": [10020 => "cuMemRelease"];
    "cuMemAddressReserve": [10020 => "cuMemAddressReserve"];
    "cuMemAddressFree": [10020 => "cuMemAddressFree"];
    "cuMemMap": [10020 => "cuMemMap"];
    "cuMemUnmap": [10020 => "cuMemUnmap"];
    "cuMemSetAccess": [10020 => "cuMemSetAccess"];
    "cuMemGetAllocationGranularity": [10020 => "cuMemGetAllocationGranularity"];
    "cuMemRetainAllocationHandle": [11000 => "cuMemRetainAllocationHandle"];
    "cuArrayCreate": [2000 => -, 3020 => "cuArrayCreate_v2"];
    "cuArray3DCreate": [2000 => -, 3020 => "cuArray3DCreate_v2"];
    "cuArrayDestroy": [2000 => "cuArrayDestroy"];
    "cuArrayGetMemoryRequirements": [11060 => "cuArrayGetMemoryRequirements"];
    "cuMipmappedArrayCreate": [5000 => "cuMipmappedArrayCreate"];
    "cuMipmappedArrayDestroy": [5000 => "cuMipmappedArrayDestroy"];
    "cuMipmappedArrayGetMemoryRequirements": [11060 => "cuMipmappedArrayGetMemoryRequirements"];
    "cuGraphCreate": [10000 => "cuGraphCreate"];
    "cuGraphAddMemAllocNode": [11040 => "cuGraphAddMemAllocNode"];
    "cuGraphInstantiate": [10000 => "cuGraphInstantiate", 11000 => "cuGraphInstantiate_v2", 12000 => "cuGraphInstantiateWithFlags"];
    "cuGraphInstantiateWithFlags": [11040 => "cuGraphInstantiateWithFlags"];
    "cuGraphLaunch": [10000 => "cuGraphLaunch"] ptsz "cuGraphLaunch_ptsz";
    "cuGraphExecDestroy": [10000 => "cuGraphExecDestroy"];
    "cuGraphDestroy": [10000 => "cuGraphDestroy"];
    "cuDeviceGraphMemTrim": [11040 => "cuDeviceGraphMemTrim"];
    "cuDeviceGetGraphMemAttribute": [11040 => "cuDeviceGetGraphMemAttribute"];
    // ---- graphs: capture, clones, child graphs, instantiation (crate::graphs) ----
    "cuGraphAddChildGraphNode": [10000 => "cuGraphAddChildGraphNode"];
    "cuGraphAddNode": [12020 => "cuGraphAddNode", 12030 => "cuGraphAddNode_v2"];
    "cuGraphClone": [10000 => "cuGraphClone"];
    "cuGraphGetNodes": [10000 => "cuGraphGetNodes"];
    "cuGraphNodeGetType": [10000 => "cuGraphNodeGetType"];
    "cuGraphMemAllocNodeGetParams": [11040 => "cuGraphMemAllocNodeGetParams"];
    "cuGraphChildGraphNodeGetGraph": [10000 => "cuGraphChildGraphNodeGetGraph"];
    "cuGraphInstantiateWithParams": [12000 => "cuGraphInstantiateWithParams"] ptsz "cuGraphInstantiateWithParams_ptsz";
    "cuGraphUpload": [11010 => "cuGraphUpload"] ptsz "cuGraphUpload_ptsz";
    "cuStreamBeginCapture": [10000 => -, 10010 => "cuStreamBeginCapture_v2"] ptsz "cuStreamBeginCapture_v2_ptsz";
    "cuStreamEndCapture": [10000 => "cuStreamEndCapture"] ptsz "cuStreamEndCapture_ptsz";
    "cuStreamIsCapturing": [10000 => "cuStreamIsCapturing"] ptsz "cuStreamIsCapturing_ptsz";
    // ---- end graphs ----
    "cuImportExternalMemory": [10000 => "cuImportExternalMemory"];
    "cuExternalMemoryGetMappedBuffer": [10000 => "cuExternalMemoryGetMappedBuffer"];
    "cuDestroyExternalMemory": [10000 => "cuDestroyExternalMemory"];
    "cuStreamCreate": [2000 => "cuStreamCreate"];
    "cuStreamCreateWithPriority": [5050 => "cuStreamCreateWithPriority"];
    "cuStreamDestroy": [2000 => -, 4000 => "cuStreamDestroy_v2"];
    "cuStreamSynchronize": [2000 => "cuStreamSynchronize"];
    "cuStreamQuery": [2000 => "cuStreamQuery"];
    "cuEventCreate": [2000 => "cuEventCreate"];
    "cuEventRecord": [2000 => "cuEventRecord"];
    "cuEventQuery": [2000 => "cuEventQuery"];
    "cuEventSynchronize": [2000 => "cuEventSynchronize"];
    "cuEventDestroy": [2000 => -, 4000 => "cuEventDestroy_v2"];
    "cuGetProcAddress": [11030 => "cuGetProcAddress", 12000 => "cuGetProcAddress_v2"];
    "cuGetErrorString": [6000 => "cuGetErrorString"];
    "cuGetErrorName": [6000 => "cuGetErrorName"];
}

/// The address of the exported function named `export`, if the fake exports it.
pub fn address(export: &str) -> Option<usize> {
    macro_rules! by_name {
        ($($m:ident::$f:ident),* $(,)?) => {
            match export {
                $(stringify!($f) => Some($m::$f as *const () as usize),)*
                _ => None,
            }
        };
    }
    by_name!(
        e::cuInit, e::cuDriverGetVersion, e::cuDeviceGet, e::cuDeviceGetCount, e::cuDeviceGetName,
        e::cuDeviceGetUuid, e::cuDeviceGetUuid_v2, e::cuDeviceTotalMem_v2, a::cuDeviceGetAttribute,
        e::cuDevicePrimaryCtxRetain, e::cuDevicePrimaryCtxRelease, e::cuDevicePrimaryCtxRelease_v2,
        s::cuDevicePrimaryCtxGetState, e::cuCtxCreate_v2, e::cuCtxCreate_v3, e::cuCtxCreate_v4,
        e::cuCtxDestroy_v2, s::cuCtxPushCurrent_v2, s::cuCtxPopCurrent_v2, e::cuCtxSetCurrent,
        e::cuCtxGetCurrent, e::cuCtxGetDevice, s::cuCtxGetFlags, s::cuCtxGetApiVersion,
        s::cuCtxGetStreamPriorityRange, s::cuCtxSynchronize, e::cuMemGetInfo_v2, e::cuMemAlloc_v2,
        e::cuMemAllocPitch_v2, e::cuMemFree_v2, e::cuMemAllocManaged, e::cuMemAllocAsync,
        e::cuMemAllocAsync_ptsz, e::cuMemFreeAsync, e::cuMemFreeAsync_ptsz, e::cuMemAllocFromPoolAsync,
        e::cuMemAllocFromPoolAsync_ptsz, e::cuDeviceGetMemPool, p::cuDeviceGetDefaultMemPool,
        p::cuMemPoolCreate, p::cuMemPoolDestroy, e::cuMemPoolTrimTo, p::cuMemPoolGetAttribute,
        p::cuMemPoolSetAttribute, e::cuMemCreate, e::cuMemRelease, e::cuMemAddressReserve,
        e::cuMemAddressFree, e::cuMemMap, e::cuMemUnmap, e::cuMemSetAccess,
        e::cuMemGetAllocationGranularity, s::cuStreamCreate, s::cuStreamCreateWithPriority,
        s::cuStreamDestroy_v2, s::cuStreamSynchronize, s::cuStreamQuery, s::cuEventCreate,
        s::cuEventRecord, s::cuEventQuery, s::cuEventSynchronize, s::cuEventDestroy_v2,
        e::cuGetProcAddress, e::cuGetProcAddress_v2, e::cuGetErrorString, e::cuGetErrorName,
        e::cuMemRetainAllocationHandle, r::cuArrayCreate_v2, r::cuArray3DCreate_v2, r::cuArrayDestroy,
        r::cuArrayGetMemoryRequirements, r::cuMipmappedArrayCreate, r::cuMipmappedArrayDestroy,
        r::cuMipmappedArrayGetMemoryRequirements,
        // ---- graphs (crate::graphs) ----
        g::cuGraphCreate, g::cuGraphAddMemAllocNode, g::cuGraphInstantiateWithFlags, g::cuGraphLaunch,
        g::cuGraphLaunch_ptsz, g::cuGraphExecDestroy, g::cuGraphDestroy, g::cuDeviceGraphMemTrim,
        g::cuDeviceGetGraphMemAttribute, g::cuGraphAddChildGraphNode, g::cuGraphAddNode, g::cuGraphAddNode_v2, g::cuGraphClone, g::cuGraphGetNodes,
        g::cuGraphNodeGetType, g::cuGraphMemAllocNodeGetParams, g::cuGraphChildGraphNodeGetGraph,
        g::cuGraphInstantiate, g::cuGraphInstantiate_v2, g::cuGraphInstantiateWithParams,
        g::cuGraphInstantiateWithParams_ptsz, g::cuGraphUpload, g::cuGraphUpload_ptsz,
        g::cuStreamBeginCapture_v2, g::cuStreamBeginCapture_v2_ptsz, g::cuStreamEndCapture,
        g::cuStreamEndCapture_ptsz, g::cuStreamIsCapturing, g::cuStreamIsCapturing_ptsz,
        // ---- end graphs ----
        x::cuImportExternalMemory, x::cuExternalMemoryGetMappedBuffer, x::cuDestroyExternalMemory,
    )
}

/// The name of the export `symbol` resolves to at `version`, or the query status saying why
/// none.
pub fn resolve_name(symbol: &str, version: c_int, flags: u64) -> Result<&'static str, c_int> {
    let entry = TABLE.iter().find(|e| e.base == symbol).ok_or(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)?;
    if flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0 {
        if let Some(ptsz) = entry.ptsz {
            if entry.forms.first().is_some_and(|(since, _)| *since <= version) {
                return Ok(ptsz);
            }
        }
    }
    let (_, form) = entry
        .forms
        .iter()
        .rev()
        .find(|(since, _)| *since <= version)
        .ok_or(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)?;
    form.ok_or(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
}

/// The address an entry point resolves to, or the query status explaining why none.
pub fn resolve(symbol: &str, version: c_int, flags: u64) -> Result<usize, c_int> {
    let name = resolve_name(symbol, version, flags)?;
    address(name).ok_or(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Api;

    #[test]
    fn versions_follow_cuda_h() {
        assert_eq!(resolve_name("cuCtxCreate", 3020, 0), Ok("cuCtxCreate_v2"));
        assert_eq!(resolve_name("cuCtxCreate", 11030, 0), Ok("cuCtxCreate_v2"));
        assert_eq!(resolve_name("cuCtxCreate", 11040, 0), Ok("cuCtxCreate_v3"));
        assert_eq!(resolve_name("cuCtxCreate", 12040, 0), Ok("cuCtxCreate_v3"));
        assert_eq!(resolve_name("cuCtxCreate", 12050, 0), Ok("cuCtxCreate_v4"));
        assert_eq!(resolve_name("cuCtxCreate", 13000, 0), Ok("cuCtxCreate_v4"));
        assert_eq!(resolve_name("cuCtxCreate", 2000, 0), Err(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND));
        assert_eq!(resolve_name("cuCtxCreate", 1000, 0), Err(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT));
        assert_eq!(resolve_name("cuDeviceGetUuid", 11030, 0), Ok("cuDeviceGetUuid"));
        assert_eq!(resolve_name("cuMemAlloc", 12000, 0), Ok("cuMemAlloc_v2"));
        assert_eq!(resolve_name("cuMemAllocAsync", 12000, 2), Ok("cuMemAllocAsync_ptsz"));
        assert_eq!(resolve_name("cuMemAllocAsync", 11010, 2), Err(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT));
        assert_eq!(resolve_name("cuMemAlloc_v2", 12000, 0), Err(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND));
        assert_eq!(resolve_name("cuGraphInstantiate", 10020, 0), Ok("cuGraphInstantiate"));
        assert_eq!(resolve_name("cuGraphInstantiate", 11080, 0), Ok("cuGraphInstantiate_v2"));
        assert_eq!(resolve_name("cuGraphInstantiate", 12000, 0), Ok("cuGraphInstantiateWithFlags"));
        assert_eq!(resolve_name("cuStreamBeginCapture", 10010, 2), Ok("cuStreamBeginCapture_v2_ptsz"));
        assert_eq!(resolve_name("cuNoSuchThing", 12000, 0), Err(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND));
    }

    #[test]
    fn every_export_is_in_the_table_and_every_form_is_exported() {
        let forms: Vec<&str> = TABLE.iter().flat_map(|e| e.forms.iter().filter_map(|f| f.1).chain(e.ptsz)).collect();
        for name in &forms {
            assert!(address(name).is_some(), "{name} is in the table but not exported");
        }
        for api in Api::ALL {
            let n = api.name();
            if n.starts_with("cu") {
                assert!(forms.contains(&n), "{n} is exported but cuGetProcAddress cannot reach it");
            }
        }
        for (i, e) in TABLE.iter().enumerate() {
            assert!(e.forms.windows(2).all(|w| w[0].0 < w[1].0), "{}: versions not ascending", e.base);
            assert!(TABLE[i + 1..].iter().all(|o| o.base != e.base), "{} listed twice", e.base);
        }
    }
}
