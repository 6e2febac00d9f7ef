//! The C ABI of the NVML subset vramguard deals with (`nvml.h`): the memory queries a
//! workload can ask a GPU's size with, and what it takes to reach them (init, device handles,
//! UUIDs), and the per-cgroup memory limits of drivers r615 and later. The hook (`hook/`) wraps the memory queries, the fake driver (`tests/fakecuda`)
//! implements them all, and the workload (`tests/workload`) calls them.
//!
//! `nvmlReturn_t` is a C enum (`int`-sized), kept as `c_int` and compared with the constants
//! here. Versioned structs carry `NVML_STRUCT_VERSION(name, ver)`: the struct's size with the
//! version in the top byte (`sizeof | ver << 24`).
#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_void};

/// `nvmlReturn_t` (a C enum).
pub type nvmlReturn_t = c_int;
/// `nvmlDevice_t` (`struct nvmlDevice_st *`).
pub type nvmlDevice_t = *mut c_void;

/// `nvmlMemory_t`: `total = free + used`, `used` including what the driver reserves.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlMemory_t {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`: `version` must be [`NVML_MEMORY_V2`]; `used` includes `reserved`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2`: `NVML_STRUCT_VERSION(Memory, 2)`.
pub const NVML_MEMORY_V2: c_uint = std::mem::size_of::<nvmlMemory_v2_t>() as c_uint | (2 << 24);

// nvmlReturn_t values (those the fake returns or the hook and workload test for).
pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
pub const NVML_ERROR_NO_PERMISSION: nvmlReturn_t = 4;
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_DRIVER_NOT_LOADED: nvmlReturn_t = 9;
pub const NVML_ERROR_GPU_IS_LOST: nvmlReturn_t = 15;
pub const NVML_ERROR_OPERATING_SYSTEM: nvmlReturn_t = 17;
pub const NVML_ERROR_LIBRARY_NOT_FOUND: nvmlReturn_t = 12;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: nvmlReturn_t = 13;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

/// `NVML_DEVICE_UUID_BUFFER_SIZE` and `NVML_DEVICE_UUID_V2_BUFFER_SIZE`: buffers that always
/// hold a UUID string with its NUL.
pub const NVML_DEVICE_UUID_BUFFER_SIZE: usize = 80;
pub const NVML_DEVICE_NAME_V2_BUFFER_SIZE: usize = 96;
pub const NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE: usize = 80;

/// `nvmlProcessInfo_t` as `nvmlDeviceGetComputeRunningProcesses_v3` fills it (`_v2` layout).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct nvmlProcessInfo_t {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}
pub const NVML_DEVICE_UUID_V2_BUFFER_SIZE: usize = 96;

/// `NVML_VALUE_NOT_AVAILABLE` as `usedGpuMemory` holds it (`(unsigned long long)-1`): the
/// driver does not say (e.g. without the rights to see the process).
pub const NVML_VALUE_NOT_AVAILABLE: u64 = u64::MAX;

/// `NVML_DEVICE_MEMORY_LIMIT_MAX`: the hard limit that means "none".
pub const NVML_DEVICE_MEMORY_LIMIT_MAX: u64 = 0xFFFF_FFFF_FFFF_FFFF;

/// `nvmlSetMemoryLimits_v1_t` (driver r615+, CUDA 13.4): a cgroup's limits on one device.
/// `nameSpace` is the full sysfs path of the cgroup's directory (NUL-terminated); no limit is
/// soft 0 and hard [`NVML_DEVICE_MEMORY_LIMIT_MAX`]. The struct carries no version field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlSetMemoryLimits_v1_t {
    pub name_space: *const std::ffi::c_char,
    pub soft_limit: u64,
    pub hard_limit: u64,
}

/// `nvmlGetMemoryLimits_v1_t`: `nameSpace` in; the limits and `currentUsed` (what the cgroup's
/// processes hold on the device, as the driver counts it) out.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlGetMemoryLimits_v1_t {
    pub name_space: *const std::ffi::c_char,
    pub soft_limit: u64,
    pub hard_limit: u64,
    pub current_used: u64,
}

/// `nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits)`.
pub type NvmlDeviceSetMemoryLimitsV1 = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlSetMemoryLimits_v1_t) -> nvmlReturn_t;
/// `nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits)`.
pub type NvmlDeviceGetMemoryLimitsV1 = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlGetMemoryLimits_v1_t) -> nvmlReturn_t;

/// `nvmlInit_v2`.
pub type NvmlInitV2 = unsafe extern "C" fn() -> nvmlReturn_t;
/// `nvmlDeviceGetCount_v2(unsigned int *deviceCount)`.
pub type NvmlDeviceGetCountV2 = unsafe extern "C" fn(*mut c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)`.
pub type NvmlDeviceGetHandleByIndexV2 = unsafe extern "C" fn(c_uint, *mut nvmlDevice_t) -> nvmlReturn_t;
/// `nvmlDeviceGetComputeRunningProcesses_v3` and `nvmlDeviceGetGraphicsRunningProcesses_v3`
/// `(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos)`.
pub type NvmlDeviceGetRunningProcessesV3 = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_t) -> nvmlReturn_t;
/// `const char *nvmlErrorString(nvmlReturn_t result)`.
pub type NvmlErrorString = unsafe extern "C" fn(nvmlReturn_t) -> *const std::ffi::c_char;

/// A GPU's UUID as NVML and `nvidia-smi` write it:
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, lower-case hex of the 16 bytes
/// `cuDeviceGetUuid_v2` returns, in order.
pub fn gpu_uuid_text(uuid: &[u8; 16]) -> String {
    let mut text = String::with_capacity(40);
    text.push_str("GPU-");
    for (i, byte) in uuid.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            text.push('-');
        }
        text.push_str(&format!("{byte:02x}"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_and_versions_match_nvml_h() {
        assert_eq!(size_of::<nvmlMemory_t>(), 24);
        assert_eq!(size_of::<nvmlMemory_v2_t>(), 40);
        assert_eq!(offset_of!(nvmlMemory_v2_t, total), 8);
        assert_eq!(offset_of!(nvmlMemory_v2_t, reserved), 16);
        assert_eq!(offset_of!(nvmlMemory_v2_t, free), 24);
        assert_eq!(offset_of!(nvmlMemory_v2_t, used), 32);
        assert_eq!(NVML_MEMORY_V2, 0x0200_0028);
        // nvmlProcessInfo_t (v2 layout): pid, padding, usedGpuMemory, two instance ids.
        assert_eq!(size_of::<nvmlProcessInfo_t>(), 24);
        assert_eq!(offset_of!(nvmlProcessInfo_t, used_gpu_memory), 8);
        assert_eq!(offset_of!(nvmlProcessInfo_t, gpu_instance_id), 16);
        assert_eq!(offset_of!(nvmlProcessInfo_t, compute_instance_id), 20);
    }

    #[test]
    fn uuid_text_is_nvidia_smis() {
        let uuid = [0x5c, 0x6c, 0x3f, 0x3e, 0x0a, 0x1b, 0x82, 0xc4, 0x9d, 0x00, 0xff, 0x10, 0x20, 0x30, 0x40, 0x5e];
        let text = gpu_uuid_text(&uuid);
        assert_eq!(text, "GPU-5c6c3f3e-0a1b-82c4-9d00-ff102030405e");
        assert_eq!(text.len(), 40);
        assert_eq!(gpu_uuid_text(&[0; 16]), "GPU-00000000-0000-0000-0000-000000000000");
    }
}
