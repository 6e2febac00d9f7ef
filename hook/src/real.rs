//! The real driver: the libcuda the process would have loaded (found with libloading, so
//! `LD_LIBRARY_PATH` decides which), its entry points behind our wrappers, and the real
//! `dlsym`; likewise the process's own NVML (`libnvidia-ml.so.1`), for the memory queries
//! this library wraps.
//!
//! Lookups go through the C library's `dlsym`, found in its symbol table ([`crate::symbols`]),
//! never through the `dlsym` this library exports (which would hand back our own wrappers).
//! Nothing here waits on a lock of the hook's own: values are published with [`Racy`], so a
//! child forked while another thread loads the driver does not hang.
use std::{
    ffi::{c_char, c_int, c_uint, c_void, CStr},
    sync::atomic::{AtomicPtr, Ordering},
};

use cuda_abi::{
    nvml::{nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t},
    CUarray, CUcontext, CUctxCreateParams, CUdevice, CUdeviceptr, CUevent, CUgraph, CUgraphExec, CUgraphNode, CUmemAllocationProp,
    CUmemoryPool, CUmipmappedArray, CUresult, CUstream, CUuuid, CUDA_ARRAY3D_DESCRIPTOR, CUDA_ARRAY_DESCRIPTOR,
    CUDA_ARRAY_MEMORY_REQUIREMENTS, CUDA_GRAPH_INSTANTIATE_PARAMS, CUDA_MEM_ALLOC_NODE_PARAMS,
};

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
type DlvsymFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> *mut c_void;

/// A value computed on first use and published without a lock: threads that race compute it
/// each and all but the first drop theirs. Nothing waits, so a child forked while another
/// thread computes it is never left waiting for a thread it does not have.
pub struct Racy<T>(AtomicPtr<T>);

impl<T> Default for Racy<T> {
    fn default() -> Racy<T> {
        Racy::new()
    }
}

impl<T> Racy<T> {
    pub const fn new() -> Racy<T> {
        Racy(AtomicPtr::new(std::ptr::null_mut()))
    }

    pub fn get(&self) -> Option<&T> {
        // SAFETY: a non-null pointer is a leaked box, never freed.
        unsafe { self.0.load(Ordering::Acquire).as_ref() }
    }

    pub fn get_or_init(&self, init: impl FnOnce() -> T) -> &T {
        if let Some(value) = self.get() {
            return value;
        }
        let mine = Box::into_raw(Box::new(init()));
        match self.0.compare_exchange(std::ptr::null_mut(), mine, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: just published; never freed.
            Ok(_) => unsafe { &*mine },
            Err(theirs) => {
                // SAFETY: `mine` was never shared; `theirs` is a published, leaked box.
                drop(unsafe { Box::from_raw(mine) });
                unsafe { &*theirs }
            }
        }
    }
}

/// The C library's function `name`: its definition next after this library, found in the
/// objects' symbol tables ([`crate::symbols`]), since this library's own `dlsym` and
/// `dlvsym` are the ones a lookup through those names would reach.
fn libc_function(name: &CStr) -> Option<usize> {
    crate::symbols::next_after_this_library(name)
}

/// The C library's `dlsym`.
pub fn real_dlsym() -> Option<DlsymFn> {
    static REAL: Racy<Option<usize>> = Racy::new();
    let address = *REAL.get_or_init(|| libc_function(c"dlsym"));
    // SAFETY: the address is the C library's dlsym, whose signature this type spells.
    address.map(|a| unsafe { std::mem::transmute::<usize, DlsymFn>(a) })
}

/// The C library's `dlvsym`.
pub fn real_dlvsym() -> Option<DlvsymFn> {
    static REAL: Racy<Option<usize>> = Racy::new();
    let address = *REAL.get_or_init(|| libc_function(c"dlvsym"));
    // SAFETY: the address is the C library's dlvsym, whose signature this type spells.
    address.map(|a| unsafe { std::mem::transmute::<usize, DlvsymFn>(a) })
}

/// Defines a library's entry points as a struct of optional function pointers (`CUresult` and
/// `nvmlReturn_t` are both `int`), resolved with the real `dlsym`.
macro_rules! driver_api {
    ($(#[$doc:meta])* $name:ident { $( $field:ident = $symbol:literal : fn($($arg:ty),*); )* }) => {
        $(#[$doc])*
        pub struct $name {
            _library: libloading::Library,
            $( pub $field: Option<unsafe extern "C" fn($($arg),*) -> CUresult>, )*
        }

        impl $name {
            fn resolve(library: libloading::Library, dlsym: DlsymFn) -> $name {
                use libloading::os::unix::Library as UnixLibrary;
                let unix: UnixLibrary = library.into();
                let handle = unix.into_raw();
                // SAFETY: `handle` is the live handle just obtained (re-wrapped below);
                // dlsym only reads the NUL-terminated names.
                let lookup = |name: &CStr| unsafe { dlsym(handle, name.as_ptr()) };
                // SAFETY: re-wraps the handle taken out above, keeping the library loaded.
                let library: libloading::Library = unsafe { UnixLibrary::from_raw(handle) }.into();
                $name {
                    _library: library,
                    $( $field: {
                        let address = lookup($symbol);
                        // SAFETY: the exported symbol of that name has the CUDA signature
                        // the field's type spells (cuda.h); a null address stays None.
                        (!address.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, _>(address) })
                    }, )*
                }
            }

            /// (real address, symbol) of every entry point resolved here.
            pub fn real_addresses(&self) -> Vec<(usize, &'static CStr)> {
                let mut all = Vec::new();
                $( if let Some(f) = self.$field { all.push((f as *const () as usize, $symbol)); } )*
                all
            }
        }
    };
}

driver_api! {
    /// Entry points of the real driver (`None` where this libcuda lacks one).
    Driver {
        mem_alloc = c"cuMemAlloc_v2": fn(*mut CUdeviceptr, usize);
        mem_alloc_pitch = c"cuMemAllocPitch_v2": fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint);
        mem_alloc_managed = c"cuMemAllocManaged": fn(*mut CUdeviceptr, usize, c_uint);
        mem_free = c"cuMemFree_v2": fn(CUdeviceptr);
        mem_alloc_async = c"cuMemAllocAsync": fn(*mut CUdeviceptr, usize, CUstream);
        mem_alloc_async_ptsz = c"cuMemAllocAsync_ptsz": fn(*mut CUdeviceptr, usize, CUstream);
        mem_alloc_from_pool = c"cuMemAllocFromPoolAsync": fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream);
        mem_alloc_from_pool_ptsz = c"cuMemAllocFromPoolAsync_ptsz": fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream);
        mem_free_async = c"cuMemFreeAsync": fn(CUdeviceptr, CUstream);
        mem_free_async_ptsz = c"cuMemFreeAsync_ptsz": fn(CUdeviceptr, CUstream);
        device_get_mem_pool = c"cuDeviceGetMemPool": fn(*mut CUmemoryPool, CUdevice);
        mem_pool_trim_to = c"cuMemPoolTrimTo": fn(CUmemoryPool, usize);
        mem_pool_get_attribute = c"cuMemPoolGetAttribute": fn(CUmemoryPool, c_int, *mut c_void);
        // A destroyed pool's charge (see `pools`).
        mem_pool_destroy = c"cuMemPoolDestroy": fn(CUmemoryPool);
        stream_query = c"cuStreamQuery": fn(CUstream);
        // Driver calls the hook makes of its own run in the relaxed capture mode (see `pools`).
        thread_exchange_stream_capture_mode = c"cuThreadExchangeStreamCaptureMode": fn(*mut c_int);
        // Synchronizes, where pools give memory back (see `pools`).
        stream_synchronize = c"cuStreamSynchronize": fn(CUstream);
        stream_synchronize_ptsz = c"cuStreamSynchronize_ptsz": fn(CUstream);
        event_synchronize = c"cuEventSynchronize": fn(CUevent);
        ctx_synchronize = c"cuCtxSynchronize": fn();
        ctx_synchronize_v2 = c"cuCtxSynchronize_v2": fn(CUcontext);
        mem_create = c"cuMemCreate": fn(*mut u64, usize, *const CUmemAllocationProp, u64);
        mem_release = c"cuMemRelease": fn(u64);
        primary_ctx_retain = c"cuDevicePrimaryCtxRetain": fn(*mut CUcontext, CUdevice);
        ctx_create = c"cuCtxCreate_v2": fn(*mut CUcontext, c_uint, CUdevice);
        ctx_create_v4 = c"cuCtxCreate_v4": fn(*mut CUcontext, *mut CUctxCreateParams, c_uint, CUdevice);
        mem_get_info = c"cuMemGetInfo_v2": fn(*mut usize, *mut usize);
        device_total_mem = c"cuDeviceTotalMem_v2": fn(*mut usize, CUdevice);
        get_proc_address = c"cuGetProcAddress": fn(*const c_char, *mut *mut c_void, c_int, u64);
        get_proc_address_v2 = c"cuGetProcAddress_v2": fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int);
        ctx_get_device = c"cuCtxGetDevice": fn(*mut CUdevice);
        device_get_count = c"cuDeviceGetCount": fn(*mut c_int);
        device_get_uuid = c"cuDeviceGetUuid_v2": fn(*mut CUuuid, CUdevice);
        // Lifetimes (see `vmm`, `contexts`, `arrays`, `graphs`).
        mem_map = c"cuMemMap": fn(CUdeviceptr, usize, usize, u64, u64);
        mem_unmap = c"cuMemUnmap": fn(CUdeviceptr, usize);
        mem_retain_allocation_handle = c"cuMemRetainAllocationHandle": fn(*mut u64, *mut c_void);
        ctx_create_v3 = c"cuCtxCreate_v3": fn(*mut CUcontext, *mut c_void, c_int, c_uint, CUdevice);
        ctx_destroy = c"cuCtxDestroy_v2": fn(CUcontext);
        primary_ctx_release = c"cuDevicePrimaryCtxRelease": fn(CUdevice);
        primary_ctx_release_v2 = c"cuDevicePrimaryCtxRelease_v2": fn(CUdevice);
        array_create = c"cuArrayCreate_v2": fn(*mut CUarray, *const CUDA_ARRAY_DESCRIPTOR);
        array_3d_create = c"cuArray3DCreate_v2": fn(*mut CUarray, *const CUDA_ARRAY3D_DESCRIPTOR);
        array_destroy = c"cuArrayDestroy": fn(CUarray);
        array_get_memory_requirements = c"cuArrayGetMemoryRequirements": fn(*mut CUDA_ARRAY_MEMORY_REQUIREMENTS, CUarray, CUdevice);
        mipmapped_array_create = c"cuMipmappedArrayCreate": fn(*mut CUmipmappedArray, *const CUDA_ARRAY3D_DESCRIPTOR, c_uint);
        mipmapped_array_destroy = c"cuMipmappedArrayDestroy": fn(CUmipmappedArray);
        mipmapped_array_get_memory_requirements = c"cuMipmappedArrayGetMemoryRequirements": fn(*mut CUDA_ARRAY_MEMORY_REQUIREMENTS, CUmipmappedArray, CUdevice);
        graph_instantiate_with_flags = c"cuGraphInstantiateWithFlags": fn(*mut CUgraphExec, CUgraph, u64);
        graph_launch = c"cuGraphLaunch": fn(CUgraphExec, CUstream);
        graph_launch_ptsz = c"cuGraphLaunch_ptsz": fn(CUgraphExec, CUstream);
        // What an executable graph allocates, read from its graph (see `graphs`).
        graph_instantiate = c"cuGraphInstantiate": fn(*mut CUgraphExec, CUgraph, *mut CUgraphNode, *mut c_char, usize);
        graph_instantiate_v2 = c"cuGraphInstantiate_v2": fn(*mut CUgraphExec, CUgraph, *mut CUgraphNode, *mut c_char, usize);
        graph_instantiate_with_params = c"cuGraphInstantiateWithParams": fn(*mut CUgraphExec, CUgraph, *mut CUDA_GRAPH_INSTANTIATE_PARAMS);
        graph_instantiate_with_params_ptsz = c"cuGraphInstantiateWithParams_ptsz": fn(*mut CUgraphExec, CUgraph, *mut CUDA_GRAPH_INSTANTIATE_PARAMS);
        graph_upload = c"cuGraphUpload": fn(CUgraphExec, CUstream);
        graph_upload_ptsz = c"cuGraphUpload_ptsz": fn(CUgraphExec, CUstream);
        graph_get_nodes = c"cuGraphGetNodes": fn(CUgraph, *mut CUgraphNode, *mut usize);
        graph_node_get_type = c"cuGraphNodeGetType": fn(CUgraphNode, *mut c_int);
        graph_mem_alloc_node_get_params = c"cuGraphMemAllocNodeGetParams": fn(CUgraphNode, *mut CUDA_MEM_ALLOC_NODE_PARAMS);
        graph_child_graph_node_get_graph = c"cuGraphChildGraphNodeGetGraph": fn(CUgraphNode, *mut CUgraph);
        stream_is_capturing = c"cuStreamIsCapturing": fn(CUstream, *mut c_int);
        stream_is_capturing_ptsz = c"cuStreamIsCapturing_ptsz": fn(CUstream, *mut c_int);
        graph_exec_destroy = c"cuGraphExecDestroy": fn(CUgraphExec);
        device_graph_mem_trim = c"cuDeviceGraphMemTrim": fn(CUdevice);
        device_get_graph_mem_attribute = c"cuDeviceGetGraphMemAttribute": fn(CUdevice, c_int, *mut c_void);
    }
}

driver_api! {
    /// Entry points of the process's NVML (`None` where this libnvidia-ml lacks one).
    Nvml {
        device_get_memory_info = c"nvmlDeviceGetMemoryInfo": fn(nvmlDevice_t, *mut nvmlMemory_t);
        device_get_memory_info_v2 = c"nvmlDeviceGetMemoryInfo_v2": fn(nvmlDevice_t, *mut nvmlMemory_v2_t);
        device_get_uuid = c"nvmlDeviceGetUUID": fn(nvmlDevice_t, *mut c_char, c_uint);
    }
}

/// Why the real driver is not available.
pub type DriverError = String;

static DRIVER: Racy<Result<Driver, DriverError>> = Racy::new();

/// The real driver, loaded on first use.
pub fn driver() -> Result<&'static Driver, &'static DriverError> {
    DRIVER
        .get_or_init(|| {
            let dlsym = real_dlsym().ok_or("cannot find the C library's dlsym")?;
            // SAFETY: loading libcuda runs its initialisers, as any CUDA program does.
            let library = unsafe { libloading::Library::new("libcuda.so.1") }
                .map_err(|error| format!("cannot load the real libcuda.so.1: {error}"))?;
            Ok(Driver::resolve(library, dlsym))
        })
        .as_ref()
}

/// Whether the process has libcuda loaded (asking never loads it: an NVML-only process, like
/// `nvidia-smi`, must not get the driver's initialisers run by an NVML query).
pub fn driver_loaded() -> bool {
    DRIVER.get().is_some_and(Result::is_ok) || already_loaded("libcuda.so.1").is_some()
}

/// NVML's soname, as applications load it.
const NVML_SONAME: &str = "libnvidia-ml.so.1";

static NVML: Racy<Result<Nvml, String>> = Racy::new();

/// The process's NVML: the `libnvidia-ml.so.1` already loaded (looked up with `RTLD_NOLOAD`,
/// so it is the one the application uses), else the one the process would load. Only the
/// NVML wrappers ask for it: an application that reaches them uses NVML anyway.
pub fn nvml() -> Result<&'static Nvml, &'static String> {
    NVML.get_or_init(|| {
        let dlsym = real_dlsym().ok_or("cannot find the C library's dlsym")?;
        let library = match already_loaded(NVML_SONAME) {
            Some(library) => library,
            // SAFETY: loading NVML runs its initialisers, as any NVML program does.
            None => unsafe { libloading::Library::new(NVML_SONAME) }
                .map_err(|error| format!("cannot load the real {NVML_SONAME}: {error}"))?,
        };
        Ok(Nvml::resolve(library, dlsym))
    })
    .as_ref()
}

/// The process's NVML if it is loaded already (never loads it: a symbol lookup must not pull
/// NVML into a process that does not use it).
pub fn nvml_if_loaded() -> Option<&'static Nvml> {
    if let Some(nvml) = NVML.get() {
        return nvml.as_ref().ok();
    }
    let library = already_loaded(NVML_SONAME)?;
    let dlsym = real_dlsym()?;
    // Another thread may have set it meanwhile: then this reference is dropped (dlclose only
    // lowers the count of a library that stays loaded).
    NVML.get_or_init(|| Ok(Nvml::resolve(library, dlsym))).as_ref().ok()
}

/// A reference to the library `name` if the process has it loaded already.
fn already_loaded(name: &str) -> Option<libloading::Library> {
    use libloading::os::unix::{Library as UnixLibrary, RTLD_NOW};
    // SAFETY: with RTLD_NOLOAD, dlopen only takes a reference to an already loaded library,
    // whose initialisers have run; it loads nothing.
    unsafe { UnixLibrary::open(Some(name), RTLD_NOW | libc::RTLD_NOLOAD) }.ok().map(Into::into)
}
