//! The C ABI of the CUDA driver API subset the fake implements: typedefs, the structs it reads
//! from callers, result codes and their names, all as declared in `cuda.h`.
//!
//! C enums are `int`-sized; fields and arguments of enum type are read as `c_int` and checked,
//! never transmuted into Rust enums.

use std::ffi::{c_char, c_int, c_void, CStr};

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

/// The anonymous `allocFlags` struct inside `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy)]
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

// CUresult values used by the fake.
pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
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

// CUmemAttach_flags (cuMemAllocManaged).
pub const CU_MEM_ATTACH_GLOBAL: u32 = 1;
pub const CU_MEM_ATTACH_HOST: u32 = 2;

// CUdriverProcAddress_flags (a bit set).
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1 << 0;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

// CUdriverProcAddressQueryResult.
pub const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: c_int = 2;

/// Name and description of every `CUresult` the fake knows, for `cuGetErrorName` /
/// `cuGetErrorString` (a subset of `cuda.h`, including every code the fake returns).
const ERRORS: &[(CUresult, &CStr, &CStr)] = &[
    (0, c"CUDA_SUCCESS", c"no error"),
    (1, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (4, c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
    (100, c"CUDA_ERROR_NO_DEVICE", c"no CUDA-capable device is detected"),
    (101, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (200, c"CUDA_ERROR_INVALID_IMAGE", c"device kernel image is invalid"),
    (201, c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
    (304, c"CUDA_ERROR_OPERATING_SYSTEM", c"OS call failed or operation not supported on this OS"),
    (400, c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
    (500, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (600, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (708, c"CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", c"primary context active"),
    (709, c"CUDA_ERROR_CONTEXT_IS_DESTROYED", c"context is destroyed"),
    (800, c"CUDA_ERROR_NOT_PERMITTED", c"operation not permitted"),
    (801, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// `(name, description)` of a result code, if the fake knows it.
pub fn error_strings(code: CUresult) -> Option<(&'static CStr, &'static CStr)> {
    ERRORS
        .iter()
        .find(|(c, _, _)| *c == code)
        .map(|(_, name, text)| (*name, *text))
}

/// Name of a result code as a Rust string, for trace output.
pub fn error_name(code: CUresult) -> &'static str {
    error_strings(code)
        .and_then(|(name, _)| name.to_str().ok())
        .unwrap_or("CUDA_ERROR_?")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_layouts_match_cuda_h() {
        assert_eq!(std::mem::size_of::<CUmemLocation>(), 8);
        assert_eq!(std::mem::size_of::<CUmemAllocationProp>(), 32);
        assert_eq!(std::mem::offset_of!(CUmemAllocationProp, location), 8);
        assert_eq!(std::mem::offset_of!(CUmemAllocationProp, win32_handle_meta_data), 16);
        assert_eq!(std::mem::offset_of!(CUmemAllocationProp, alloc_flags), 24);
        assert_eq!(std::mem::size_of::<CUmemAccessDesc>(), 12);
        assert_eq!(std::mem::size_of::<CUuuid>(), 16);
        assert_eq!(std::mem::size_of::<CUctxCreateParams>(), 24);
    }
}
