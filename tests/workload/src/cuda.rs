//! Loading the CUDA driver the way an application does: `dlopen("libcuda.so.1")` (so
//! `LD_LIBRARY_PATH` decides which driver), then each entry point either by `dlsym` of its
//! exported name or through `cuGetProcAddress_v2` by its base name at CUDA version 12000,
//! the way cudart does. FFI signatures are those of `cuda.h`; the types and constants they use
//! come from [`cuda_abi`] (re-exported here), shared with the fake driver.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

use libloading::Library;

pub use cuda_abi::*;

/// The CUDA version the workload asks `cuGetProcAddress_v2` for.
pub const GETPROC_VERSION: c_int = 12000;

/// The version a base name is asked for at: [`GETPROC_VERSION`], except `cuCtxCreate`, which
/// stands for `cuCtxCreate_v3` from 11040 in `cuda.h` and is asked for at 11030 so that it is
/// still the `cuCtxCreate_v2` the workload calls, `cuGraphInstantiate`, which stands for
/// `cuGraphInstantiateWithFlags` from 12000 and is asked for at 11000, where it is the legacy
/// `cuGraphInstantiate_v2`, and `cuGraphAddNode`, which is `cuGraphAddNode_v2` from 12030.
pub fn getproc_version(query: &str) -> c_int {
    match query {
        "cuCtxCreate" => 11030,
        "cuGraphInstantiate" => 11000,
        "cuGraphAddNode" => 12030,
        _ => GETPROC_VERSION,
    }
}

pub type FnGetProcAddressV2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

/// How entry points are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Dlsym,
    Getproc,
}

macro_rules! entry_points {
    ($($field:ident: fn($($arg:ty),*) = $export:literal / $query:literal / $flags:expr;)*) => {
        /// The driver's entry points the workload uses (`None`: the driver lacks it).
        #[derive(Clone, Copy)]
        pub struct Fns {
            $(pub $field: Option<unsafe extern "C" fn($($arg),*) -> CUresult>,)*
        }

        impl Fns {
            fn load(lib: &Library, via: Via, getproc: Option<FnGetProcAddressV2>) -> Fns {
                Fns {
                    $($field: match via {
                        // SAFETY: the type is the symbol's signature in cuda.h.
                        Via::Dlsym => unsafe { lib.get::<unsafe extern "C" fn($($arg),*) -> CUresult>($export.as_bytes()) }
                            .ok()
                            .map(|s| *s),
                        Via::Getproc => getproc_raw(getproc, $query, getproc_version($query), $flags)
                            .ok()
                            // SAFETY: cuGetProcAddress_v2 returned the entry point for this
                            // base name, whose signature in cuda.h is this type.
                            .map(|p| unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> CUresult>(p) }),
                    },)*
                }
            }
        }
    };
}

entry_points! {
    init: fn(c_uint) = "cuInit" / "cuInit" / 0;
    device_get: fn(*mut CUdevice, c_int) = "cuDeviceGet" / "cuDeviceGet" / 0;
    device_get_uuid: fn(*mut CUuuid, CUdevice) = "cuDeviceGetUuid_v2" / "cuDeviceGetUuid" / 0;
    primary_retain: fn(*mut CUcontext, CUdevice) = "cuDevicePrimaryCtxRetain" / "cuDevicePrimaryCtxRetain" / 0;
    primary_release: fn(CUdevice) = "cuDevicePrimaryCtxRelease_v2" / "cuDevicePrimaryCtxRelease" / 0;
    ctx_create: fn(*mut CUcontext, c_uint, CUdevice) = "cuCtxCreate_v2" / "cuCtxCreate" / 0;
    ctx_destroy: fn(CUcontext) = "cuCtxDestroy_v2" / "cuCtxDestroy" / 0;
    ctx_set_current: fn(CUcontext) = "cuCtxSetCurrent" / "cuCtxSetCurrent" / 0;
    ctx_get_current: fn(*mut CUcontext) = "cuCtxGetCurrent" / "cuCtxGetCurrent" / 0;
    ctx_get_device: fn(*mut CUdevice) = "cuCtxGetDevice" / "cuCtxGetDevice" / 0;
    mem_alloc: fn(*mut CUdeviceptr, usize) = "cuMemAlloc_v2" / "cuMemAlloc" / 0;
    mem_alloc_pitch: fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) = "cuMemAllocPitch_v2" / "cuMemAllocPitch" / 0;
    mem_alloc_managed: fn(*mut CUdeviceptr, usize, c_uint) = "cuMemAllocManaged" / "cuMemAllocManaged" / 0;
    mem_free: fn(CUdeviceptr) = "cuMemFree_v2" / "cuMemFree" / 0;
    mem_get_info: fn(*mut usize, *mut usize) = "cuMemGetInfo_v2" / "cuMemGetInfo" / 0;
    mem_alloc_async: fn(*mut CUdeviceptr, usize, CUstream) = "cuMemAllocAsync" / "cuMemAllocAsync" / 0;
    mem_alloc_async_ptsz: fn(*mut CUdeviceptr, usize, CUstream) = "cuMemAllocAsync_ptsz" / "cuMemAllocAsync" / CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    mem_free_async: fn(CUdeviceptr, CUstream) = "cuMemFreeAsync" / "cuMemFreeAsync" / 0;
    mem_free_async_ptsz: fn(CUdeviceptr, CUstream) = "cuMemFreeAsync_ptsz" / "cuMemFreeAsync" / CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    mem_alloc_from_pool: fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) = "cuMemAllocFromPoolAsync" / "cuMemAllocFromPoolAsync" / 0;
    mem_alloc_from_pool_ptsz: fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) = "cuMemAllocFromPoolAsync_ptsz" / "cuMemAllocFromPoolAsync" / CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    device_get_mem_pool: fn(*mut CUmemoryPool, CUdevice) = "cuDeviceGetMemPool" / "cuDeviceGetMemPool" / 0;
    mem_pool_trim_to: fn(CUmemoryPool, usize) = "cuMemPoolTrimTo" / "cuMemPoolTrimTo" / 0;
    mem_pool_create: fn(*mut CUmemoryPool, *const CUmemPoolProps) = "cuMemPoolCreate" / "cuMemPoolCreate" / 0;
    mem_pool_destroy: fn(CUmemoryPool) = "cuMemPoolDestroy" / "cuMemPoolDestroy" / 0;
    mem_create: fn(*mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, u64) = "cuMemCreate" / "cuMemCreate" / 0;
    mem_release: fn(CUmemGenericAllocationHandle) = "cuMemRelease" / "cuMemRelease" / 0;
    mem_address_reserve: fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64) = "cuMemAddressReserve" / "cuMemAddressReserve" / 0;
    mem_address_free: fn(CUdeviceptr, usize) = "cuMemAddressFree" / "cuMemAddressFree" / 0;
    mem_map: fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64) = "cuMemMap" / "cuMemMap" / 0;
    mem_unmap: fn(CUdeviceptr, usize) = "cuMemUnmap" / "cuMemUnmap" / 0;
    mem_set_access: fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize) = "cuMemSetAccess" / "cuMemSetAccess" / 0;
    get_error_name: fn(CUresult, *mut *const c_char) = "cuGetErrorName" / "cuGetErrorName" / 0;
    // Lifetimes: VMM references, context variants, arrays, graph memory.
    mem_retain_allocation_handle: fn(*mut CUmemGenericAllocationHandle, *mut c_void) = "cuMemRetainAllocationHandle" / "cuMemRetainAllocationHandle" / 0;
    ctx_create_v3: fn(*mut CUcontext, *mut c_void, c_int, c_uint, CUdevice) = "cuCtxCreate_v3" / "cuCtxCreate_v3" / 0;
    ctx_create_v4: fn(*mut CUcontext, *mut CUctxCreateParams, c_uint, CUdevice) = "cuCtxCreate_v4" / "cuCtxCreate_v4" / 0;
    array_create: fn(*mut CUarray, *const CUDA_ARRAY_DESCRIPTOR) = "cuArrayCreate_v2" / "cuArrayCreate" / 0;
    array_3d_create: fn(*mut CUarray, *const CUDA_ARRAY3D_DESCRIPTOR) = "cuArray3DCreate_v2" / "cuArray3DCreate" / 0;
    array_destroy: fn(CUarray) = "cuArrayDestroy" / "cuArrayDestroy" / 0;
    mipmapped_array_create: fn(*mut CUmipmappedArray, *const CUDA_ARRAY3D_DESCRIPTOR, c_uint) = "cuMipmappedArrayCreate" / "cuMipmappedArrayCreate" / 0;
    mipmapped_array_destroy: fn(CUmipmappedArray) = "cuMipmappedArrayDestroy" / "cuMipmappedArrayDestroy" / 0;
    graph_create: fn(*mut CUgraph, c_uint) = "cuGraphCreate" / "cuGraphCreate" / 0;
    graph_add_mem_alloc_node: fn(*mut CUgraphNode, CUgraph, *const CUgraphNode, usize, *mut CUDA_MEM_ALLOC_NODE_PARAMS) = "cuGraphAddMemAllocNode" / "cuGraphAddMemAllocNode" / 0;
    graph_instantiate_with_flags: fn(*mut CUgraphExec, CUgraph, u64) = "cuGraphInstantiateWithFlags" / "cuGraphInstantiateWithFlags" / 0;
    graph_launch: fn(CUgraphExec, CUstream) = "cuGraphLaunch" / "cuGraphLaunch" / 0;
    graph_exec_destroy: fn(CUgraphExec) = "cuGraphExecDestroy" / "cuGraphExecDestroy" / 0;
    graph_destroy: fn(CUgraph) = "cuGraphDestroy" / "cuGraphDestroy" / 0;
    device_graph_mem_trim: fn(CUdevice) = "cuDeviceGraphMemTrim" / "cuDeviceGraphMemTrim" / 0;
    // Graphs captured from a stream, cloned, nested; their instantiation entry points.
    stream_create: fn(*mut CUstream, c_uint) = "cuStreamCreate" / "cuStreamCreate" / 0;
    stream_destroy: fn(CUstream) = "cuStreamDestroy_v2" / "cuStreamDestroy" / 0;
    // Synchronization (where pools give memory back) and pool attributes.
    stream_synchronize: fn(CUstream) = "cuStreamSynchronize" / "cuStreamSynchronize" / 0;
    ctx_synchronize: fn() = "cuCtxSynchronize" / "cuCtxSynchronize" / 0;
    event_create: fn(*mut CUevent, c_uint) = "cuEventCreate" / "cuEventCreate" / 0;
    event_record: fn(CUevent, CUstream) = "cuEventRecord" / "cuEventRecord" / 0;
    event_synchronize: fn(CUevent) = "cuEventSynchronize" / "cuEventSynchronize" / 0;
    event_destroy: fn(CUevent) = "cuEventDestroy_v2" / "cuEventDestroy" / 0;
    mem_pool_set_attribute: fn(CUmemoryPool, c_int, *mut c_void) = "cuMemPoolSetAttribute" / "cuMemPoolSetAttribute" / 0;
    mem_pool_get_attribute: fn(CUmemoryPool, c_int, *mut c_void) = "cuMemPoolGetAttribute" / "cuMemPoolGetAttribute" / 0;
    stream_begin_capture: fn(CUstream, c_int) = "cuStreamBeginCapture_v2" / "cuStreamBeginCapture" / 0;
    stream_end_capture: fn(CUstream, *mut CUgraph) = "cuStreamEndCapture" / "cuStreamEndCapture" / 0;
    graph_clone: fn(*mut CUgraph, CUgraph) = "cuGraphClone" / "cuGraphClone" / 0;
    graph_add_node_v2: fn(*mut CUgraphNode, CUgraph, *const CUgraphNode, *const c_void, usize, *mut CUgraphNodeParams) = "cuGraphAddNode_v2" / "cuGraphAddNode" / 0;
    graph_instantiate_v2: fn(*mut CUgraphExec, CUgraph, *mut CUgraphNode, *mut c_char, usize) = "cuGraphInstantiate_v2" / "cuGraphInstantiate" / 0;
    graph_instantiate_with_params: fn(*mut CUgraphExec, CUgraph, *mut CUDA_GRAPH_INSTANTIATE_PARAMS) = "cuGraphInstantiateWithParams" / "cuGraphInstantiateWithParams" / 0;
    graph_upload: fn(CUgraphExec, CUstream) = "cuGraphUpload" / "cuGraphUpload" / 0;
    import_external_memory: fn(*mut CUexternalMemory, *const CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR) = "cuImportExternalMemory" / "cuImportExternalMemory" / 0;
    external_memory_get_mapped_buffer: fn(*mut CUdeviceptr, CUexternalMemory, *const CUDA_EXTERNAL_MEMORY_BUFFER_DESC) = "cuExternalMemoryGetMappedBuffer" / "cuExternalMemoryGetMappedBuffer" / 0;
    destroy_external_memory: fn(CUexternalMemory) = "cuDestroyExternalMemory" / "cuDestroyExternalMemory" / 0;
}

/// `cuGetProcAddress_v2(query, version, flags)`: the address, or (result, symbol status).
pub fn getproc_raw(
    getproc: Option<FnGetProcAddressV2>,
    query: &str,
    version: c_int,
    flags: u64,
) -> Result<*mut c_void, (CUresult, c_int)> {
    let f = getproc.ok_or((CUDA_ERROR_NOT_FOUND, -1))?;
    let name = CString::new(query).map_err(|_| (CUDA_ERROR_NOT_FOUND, -1))?;
    let mut pfn: *mut c_void = std::ptr::null_mut();
    let mut status: c_int = -1;
    // SAFETY: a NUL-terminated name and valid out-pointers, per the cuda.h signature.
    let rc = unsafe { f(name.as_ptr(), &mut pfn, version, flags, &mut status) };
    if rc == CUDA_SUCCESS && !pfn.is_null() {
        Ok(pfn)
    } else {
        Err((rc, status))
    }
}

/// The loaded driver.
pub struct Driver {
    lib: Library,
    pub fns: Fns,
    getproc: Option<FnGetProcAddressV2>,
}

impl Driver {
    /// `dlopen("libcuda.so.1")` and resolve every entry point `via` the chosen path.
    pub fn load(via: Via) -> Result<Driver, String> {
        // SAFETY: loading a shared library runs its initialisers; libcuda is meant for that.
        let lib = unsafe { Library::new("libcuda.so.1") }.map_err(|e| format!("cannot load libcuda.so.1: {e}"))?;
        // SAFETY: the type is cuGetProcAddress_v2's signature in cuda.h.
        let getproc = unsafe { lib.get::<FnGetProcAddressV2>(b"cuGetProcAddress_v2") }.ok().map(|s| *s);
        if via == Via::Getproc && getproc.is_none() {
            return Err("libcuda.so.1 does not export cuGetProcAddress_v2".into());
        }
        let fns = Fns::load(&lib, via, getproc);
        Ok(Driver { lib, fns, getproc })
    }

    /// `dlsym` of an exported name (NULL if absent).
    pub fn dlsym(&self, name: &str) -> *mut c_void {
        // SAFETY: the symbol is only used as an address, never called through this type.
        unsafe { self.lib.get::<*mut c_void>(name.as_bytes()) }
            .map(|s| *s)
            .unwrap_or(std::ptr::null_mut())
    }

    /// `cuGetProcAddress_v2` (looked up with dlsym in either mode).
    pub fn getproc(&self, query: &str, version: c_int, flags: u64) -> Result<*mut c_void, (CUresult, c_int)> {
        getproc_raw(self.getproc, query, version, flags)
    }

    /// The driver's own name for a result code, or a generic one.
    pub fn error_name(&self, code: CUresult) -> String {
        if let Some(f) = self.fns.get_error_name {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: a valid out-pointer, per the cuda.h signature.
            if unsafe { f(code, &mut p) } == CUDA_SUCCESS && !p.is_null() {
                // SAFETY: the driver returns a static NUL-terminated string.
                return unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
            }
        }
        format!("CUDA_ERROR_{code}")
    }
}
