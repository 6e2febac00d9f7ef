//! The C ABI of the CUDA driver API subset vramguard deals with: typedefs, structs, result
//! codes and flag values, each as declared in `cuda.h` (CUDA 13). The hook (`hook/`)
//! interposes these functions, the fake driver (`tests/fakecuda`) implements them and the
//! workload (`tests/workload`) calls them; all use these definitions, so they cannot drift
//! apart. The layouts are checked against `cuda.h` in the tests below.
//!
//! C enums are `int`-sized; fields and arguments of enum type are `c_int` (or the integer type
//! of the parameter that carries them) and are compared with the constants here, never
//! transmuted into Rust enums.
//!
//! [`nvml`] holds the same for the NVML subset (`nvml.h`), with [`gpu_uuid_text`], the
//! `GPU-…` form of a device UUID that NVML, `nvidia-smi` and `vramguard inspect` print.
//!
//! Also here: [`parse_size`], the `4m`/`16g` size syntax (1024-based, as HAMi-core's
//! `CUDA_DEVICE_MEMORY_LIMIT`) that the hook's limits, the fake's `FAKECUDA_*` variables and
//! the workload's steps share.

use std::ffi::{c_char, c_int, c_uint, c_void};

pub mod nvml;
mod resources;
mod size;

pub use nvml::gpu_uuid_text;
pub use resources::*;
pub use size::parse_size;

/// `CUresult` (a C enum).
pub type CUresult = c_int;
/// `CUdevice` (`int`).
pub type CUdevice = c_int;
/// `CUdeviceptr` (`unsigned long long` on 64-bit platforms).
pub type CUdeviceptr = u64;
/// `CUcontext` (`struct CUctx_st *`).
pub type CUcontext = *mut c_void;
/// `CUstream` (`struct CUstream_st *`).
pub type CUstream = *mut c_void;
/// `CUevent` (`struct CUevent_st *`).
pub type CUevent = *mut c_void;
/// `CUmemoryPool` (`struct CUmemPoolHandle_st *`).
pub type CUmemoryPool = *mut c_void;
/// `CUmemGenericAllocationHandle` (`unsigned long long`).
pub type CUmemGenericAllocationHandle = u64;

/// `CUuuid`: `struct { char bytes[16]; }`.
#[repr(C)]
pub struct CUuuid {
    pub bytes: [c_char; 16],
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemLocation {
    /// `CUmemLocationType`.
    pub type_: c_int,
    pub id: c_int,
}

/// The anonymous `allocFlags` struct inside `CUmemAllocationProp` (all zero by default).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CUmemAllocFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp` (`CUmemAllocationProp_v1`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAllocationProp {
    /// `CUmemAllocationType`.
    pub type_: c_int,
    /// `CUmemAllocationHandleType`.
    pub requested_handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: CUmemAllocFlags,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    /// `CUmemAccess_flags`.
    pub flags: c_int,
}

/// `CUctxCreateParams` (`cuCtxCreate_v4`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUctxCreateParams {
    pub exec_affinity_params: *mut c_void,
    pub num_exec_affinity_params: c_int,
    pub cig_params: *mut c_void,
}

// CUresult values (those the fake returns or the workload tests for).
pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;

// CUmemAllocationType / CUmemLocationType / CUmemAccess_flags.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_NONE: c_int = 0;
pub const CU_MEM_ACCESS_FLAGS_PROT_READ: c_int = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;

// CUmemAllocationGranularity_flags.
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: c_int = 1;

// CUmemAttach_flags (the `unsigned int flags` of cuMemAllocManaged).
pub const CU_MEM_ATTACH_GLOBAL: c_uint = 1;
pub const CU_MEM_ATTACH_HOST: c_uint = 2;

// `CUmemPool_attribute`: the `REUSE_*` switches are `int`, the others `cuuint64_t`.
pub const CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: c_int = 1;
pub const CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: c_int = 2;
pub const CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: c_int = 3;
pub const CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: c_int = 4;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: c_int = 6;
pub const CU_MEMPOOL_ATTR_USED_MEM_CURRENT: c_int = 7;
pub const CU_MEMPOOL_ATTR_USED_MEM_HIGH: c_int = 8;

/// `CUmemPoolProps` (`CUmemPoolProps_v1`, 88 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemPoolProps {
    /// `CUmemAllocationType`.
    pub alloc_type: c_int,
    /// `CUmemAllocationHandleType`.
    pub handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_security_attributes: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

// CUdriverProcAddress_flags (a bit set, passed as `cuuint64_t flags`).
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1 << 0;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;
/// `CU_STREAM_PER_THREAD`: the per-thread default stream's handle (what NULL means to a
/// `_ptsz` call), as an address.
pub const CU_STREAM_PER_THREAD: usize = 0x2;

// CUdriverProcAddressQueryResult.
pub const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: c_int = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn struct_layouts_match_cuda_h() {
        assert_eq!(size_of::<CUmemLocation>(), 8);
        assert_eq!(size_of::<CUmemAllocFlags>(), 8);
        assert_eq!(size_of::<CUmemAllocationProp>(), 32);
        assert_eq!(offset_of!(CUmemAllocationProp, location), 8);
        assert_eq!(offset_of!(CUmemAllocationProp, win32_handle_meta_data), 16);
        assert_eq!(offset_of!(CUmemAllocationProp, alloc_flags), 24);
        assert_eq!(size_of::<CUmemAccessDesc>(), 12);
        assert_eq!(size_of::<CUuuid>(), 16);
        assert_eq!(size_of::<CUctxCreateParams>(), 24);
    }

    #[test]
    fn alloc_flags_default_to_zero() {
        let f = CUmemAllocFlags::default();
        assert_eq!((f.compression_type, f.gpu_direct_rdma_capable, f.usage, f.reserved), (0, 0, 0, [0; 4]));
    }
}
