//! `cuDeviceGetAttribute`: the attributes clients ask for at start (numba-cuda, cuda-core,
//! cuda-bindings' samples), with an H100 SXM's values (compute capability 9.0, 132 SMs).
//! Attributes the fake does not model are `CUDA_ERROR_INVALID_VALUE`, as the driver
//! answers an attribute it does not know.
//!
//! # Safety
//!
//! The export is `unsafe` with the contract of its `cuda.h` declaration (see
//! [`crate::exports`]).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::c_int;

use cuda_abi::*;

use crate::api::Api;
use crate::driver::call_out;

/// `(CUdevice_attribute, value)`, numbered as `cuda.h`'s enum.
const ATTRIBUTES: &[(c_int, c_int)] = &[
    (1, 1024),        // MAX_THREADS_PER_BLOCK
    (2, 1024),        // MAX_BLOCK_DIM_X
    (3, 1024),        // MAX_BLOCK_DIM_Y
    (4, 64),          // MAX_BLOCK_DIM_Z
    (5, 2147483647),  // MAX_GRID_DIM_X
    (6, 65535),       // MAX_GRID_DIM_Y
    (7, 65535),       // MAX_GRID_DIM_Z
    (8, 49152),       // MAX_SHARED_MEMORY_PER_BLOCK
    (9, 65536),       // TOTAL_CONSTANT_MEMORY
    (10, 32),         // WARP_SIZE
    (11, 2147483647), // MAX_PITCH
    (12, 65536),      // MAX_REGISTERS_PER_BLOCK
    (13, 1980000),    // CLOCK_RATE (kHz)
    (14, 512),        // TEXTURE_ALIGNMENT
    (15, 1),          // GPU_OVERLAP
    (16, 132),        // MULTIPROCESSOR_COUNT
    (17, 0),          // KERNEL_EXEC_TIMEOUT
    (18, 0),          // INTEGRATED
    (19, 1),          // CAN_MAP_HOST_MEMORY
    (20, 0),          // COMPUTE_MODE (default)
    (31, 1),          // CONCURRENT_KERNELS
    (32, 1),          // ECC_ENABLED
    (35, 0),          // TCC_DRIVER
    (36, 2619000),    // MEMORY_CLOCK_RATE (kHz)
    (37, 5120),       // GLOBAL_MEMORY_BUS_WIDTH
    (38, 52428800),   // L2_CACHE_SIZE
    (39, 2048),       // MAX_THREADS_PER_MULTIPROCESSOR
    (40, 3),          // ASYNC_ENGINE_COUNT
    (41, 1),          // UNIFIED_ADDRESSING
    (75, 9),          // COMPUTE_CAPABILITY_MAJOR
    (76, 0),          // COMPUTE_CAPABILITY_MINOR
    (81, 233472),     // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    (82, 65536),      // MAX_REGISTERS_PER_MULTIPROCESSOR
    (83, 1),          // MANAGED_MEMORY
    (84, 0),          // MULTI_GPU_BOARD
    (88, 0),          // PAGEABLE_MEMORY_ACCESS
    (89, 1),          // CONCURRENT_MANAGED_ACCESS
    (95, 1),          // COOPERATIVE_LAUNCH
    (97, 232448),     // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    (102, 1),         // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    (103, 1),         // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    (106, 32),        // MAX_BLOCKS_PER_MULTIPROCESSOR
    (115, 1),         // MEMORY_POOLS_SUPPORTED
    (119, 1),         // MEMORY_POOL_SUPPORTED_HANDLE_TYPES (POSIX file descriptor)
];

/// The fake's value of attribute `attrib`, if it models it.
pub fn attribute(attrib: c_int) -> Option<c_int> {
    ATTRIBUTES.iter().find(|(a, _)| *a == attrib).map(|(_, v)| *v)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(pi: *mut c_int, attrib: c_int, dev: CUdevice) -> CUresult {
    let value = |d: &mut crate::driver::Driver| {
        d.dev_index(dev)?;
        attribute(attrib).ok_or(CUDA_ERROR_INVALID_VALUE)
    };
    // SAFETY: the caller passes NULL or a valid int pointer.
    unsafe { call_out(Api::DeviceGetAttribute, pi, value) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_unique_and_h100_like() {
        for (i, (a, _)) in ATTRIBUTES.iter().enumerate() {
            assert!(ATTRIBUTES[i + 1..].iter().all(|(b, _)| b != a), "attribute {a} listed twice");
        }
        assert_eq!((attribute(75), attribute(76)), (Some(9), Some(0)));
        assert_eq!(attribute(10), Some(32));
        assert_eq!(attribute(115), Some(1));
        assert_eq!(attribute(9999), None);
    }
}
