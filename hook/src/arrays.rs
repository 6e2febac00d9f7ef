//! CUDA arrays and mipmapped arrays (`cuArrayCreate_v2`, `cuArray3DCreate_v2`,
//! `cuMipmappedArrayCreate`, freed by `cuArrayDestroy` / `cuMipmappedArrayDestroy`), charged
//! by their real footprint: an estimate from the descriptor is admitted before the driver
//! call, then the charge is settled to what the driver says the array takes
//! (`cuArrayGetMemoryRequirements` / `cuMipmappedArrayGetMemoryRequirements`, CUDA 11.6+);
//! where the driver cannot say, the estimate stands.
//!
//! The estimate ([`footprint`]): each level's rows of `width x channels x bytes per channel`
//! padded to [`ROW_ALIGNMENT`], times its height and depth (layers for layered and cubemap
//! arrays), summed over the mip levels (each half the width and height of the one before, at
//! least 1; the depth is kept, an over-estimate for 3D mipmaps until the driver answers).
//! Formats other than the basic integer, half and float ones count 4 bytes per channel.
#![allow(non_snake_case)] // parameter names as in cuda.h
use std::ffi::c_uint;

use cuda_abi::{
    array_format_bytes, CUarray, CUdevice, CUmipmappedArray, CUresult, CUDA_ARRAY3D_DESCRIPTOR, CUDA_ARRAY_DESCRIPTOR,
    CUDA_ARRAY_MEMORY_REQUIREMENTS, CUDA_SUCCESS,
};
use ledger::Charge;

use crate::{
    exports::{allocate, current_device, driver_or_return, free, real_or_return, settle_estimate},
    real::Driver,
    session::Space,
};

/// Row alignment of the estimate (the driver's texture pitch alignment).
pub const ROW_ALIGNMENT: u64 = 512;

/// Estimated bytes of an array of `levels` mip levels (1: a plain array).
pub fn footprint(width: u64, height: u64, depth: u64, format: i32, channels: u32, levels: u32) -> u64 {
    let texel = array_format_bytes(format).unwrap_or(4).saturating_mul(u64::from(channels.max(1)));
    let (mut w, mut h, d) = (width.max(1), height.max(1), depth.max(1));
    let mut total: u64 = 0;
    for _ in 0..levels.max(1) {
        let row = w.saturating_mul(texel).div_ceil(ROW_ALIGNMENT).saturating_mul(ROW_ALIGNMENT);
        total = total.saturating_add(row.saturating_mul(h).saturating_mul(d));
        (w, h) = ((w / 2).max(1), (h / 2).max(1));
    }
    total
}

/// `cuArrayGetMemoryRequirements` and `cuMipmappedArrayGetMemoryRequirements` (both handle
/// types are opaque pointers).
type Requirements = unsafe extern "C" fn(*mut CUDA_ARRAY_MEMORY_REQUIREMENTS, CUarray, CUdevice) -> CUresult;

/// What the driver says `array` takes on the current device.
fn requirements(driver: &Driver, get: Option<Requirements>, array: CUarray) -> Option<u64> {
    let get = get?;
    let ordinal = current_device(driver)?;
    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
    // SAFETY: a live out-struct, the array the driver just created and a device ordinal.
    (unsafe { get(&mut req, array, ordinal) } == CUDA_SUCCESS && req.size > 0).then_some(req.size as u64)
}

/// Admits `estimate`, creates an array (`space`: `Array` or `Mipmap`) with `call`, then
/// settles to the driver's figure (destroying the array again if that is over the quota).
///
/// # Safety
/// `out` is the caller's out-pointer of the creation call.
unsafe fn create(driver: &Driver, space: Space, estimate: u64, out: *mut CUarray, call: impl FnOnce() -> CUresult) -> CUresult {
    let (get, destroy) = match space {
        Space::Mipmap => (driver.mipmapped_array_get_memory_requirements, driver.mipmapped_array_destroy),
        _ => (driver.array_get_memory_requirements, driver.array_destroy),
    };
    let destroy = |array| {
        if let Some(destroy) = destroy {
            // SAFETY: destroys the array the driver just created.
            unsafe { destroy(array) };
        }
    };
    // SAFETY: out is the caller's out-pointer (a pointer-sized handle), per this contract.
    let result = unsafe { allocate(driver, space, Charge::Device(estimate), None, out.cast::<u64>(), call) };
    if result != CUDA_SUCCESS || out.is_null() {
        return result;
    }
    // SAFETY: the driver succeeded, so it wrote the handle.
    let array = unsafe { *out };
    match requirements(driver, get, array) {
        Some(actual) => settle_estimate(space, array as u64, estimate, actual, || destroy(array)),
        None => result,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuArrayCreate_v2(pHandle: *mut CUarray, pAllocateArray: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, array_create);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(pHandle, pAllocateArray) };
    if pAllocateArray.is_null() {
        return call();
    }
    // SAFETY: non-null: the caller's descriptor.
    let d = unsafe { *pAllocateArray };
    let estimate = footprint(d.width as u64, d.height as u64, 1, d.format, d.num_channels, 1);
    // SAFETY: pHandle is the caller's out-pointer for this call.
    unsafe { create(driver, Space::Array, estimate, pHandle, call) }
}

#[no_mangle]
pub unsafe extern "C" fn cuArray3DCreate_v2(pHandle: *mut CUarray, pAllocateArray: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, array_3d_create);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(pHandle, pAllocateArray) };
    if pAllocateArray.is_null() {
        return call();
    }
    // SAFETY: non-null: the caller's descriptor.
    let d = unsafe { *pAllocateArray };
    let estimate = footprint(d.width as u64, d.height as u64, d.depth as u64, d.format, d.num_channels, 1);
    // SAFETY: pHandle is the caller's out-pointer for this call.
    unsafe { create(driver, Space::Array, estimate, pHandle, call) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    pHandle: *mut CUmipmappedArray,
    pMipmappedArrayDesc: *const CUDA_ARRAY3D_DESCRIPTOR,
    numMipmapLevels: c_uint,
) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mipmapped_array_create);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(pHandle, pMipmappedArrayDesc, numMipmapLevels) };
    if pMipmappedArrayDesc.is_null() {
        return call();
    }
    // SAFETY: non-null: the caller's descriptor.
    let d = unsafe { *pMipmappedArrayDesc };
    let estimate = footprint(d.width as u64, d.height as u64, d.depth as u64, d.format, d.num_channels, numMipmapLevels);
    // SAFETY: pHandle is the caller's out-pointer for this call.
    unsafe { create(driver, Space::Mipmap, estimate, pHandle, call) }
}

#[no_mangle]
pub unsafe extern "C" fn cuArrayDestroy(hArray: CUarray) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, array_destroy);
    // SAFETY: forwards the caller's argument unchanged.
    free(Space::Array, hArray as u64, || unsafe { real(hArray) })
}

#[no_mangle]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(hMipmappedArray: CUmipmappedArray) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mipmapped_array_destroy);
    // SAFETY: forwards the caller's argument unchanged.
    free(Space::Mipmap, hMipmappedArray as u64, || unsafe { real(hMipmappedArray) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuda_abi::{CU_AD_FORMAT_FLOAT, CU_AD_FORMAT_UNSIGNED_INT8};

    #[test]
    fn the_estimate_pads_rows_and_sums_mip_levels() {
        // 1000 x 1000 float4: rows of 16000 bytes padded to 16384.
        assert_eq!(footprint(1000, 1000, 0, CU_AD_FORMAT_FLOAT, 4, 1), 16384 * 1000);
        // A 1D array of 100 bytes: one padded row.
        assert_eq!(footprint(100, 0, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 1), 512);
        // 3D: depth multiplies.
        assert_eq!(footprint(128, 128, 8, CU_AD_FORMAT_UNSIGNED_INT8, 1, 1), 512 * 128 * 8);
        // Mip levels 1024², 512², 256² of float4 (rows 16384, 8192, 4096 bytes).
        assert_eq!(footprint(1024, 1024, 0, CU_AD_FORMAT_FLOAT, 4, 3), 16384 * 1024 + 8192 * 512 + 4096 * 256);
        // An unknown format counts 4 bytes a channel.
        assert_eq!(footprint(128, 1, 0, 0xb0, 1, 1), 512);
    }
}
