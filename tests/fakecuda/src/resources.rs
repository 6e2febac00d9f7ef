//! The fake's CUDA arrays and the handles of its graph objects: state ([`Resources`], part of
//! the process's [`Driver`]) and exports, charged to the device like everything else
//! (the `resources` part of a process's footprint, see [`crate::driver`]).
//!
//! **Arrays** (`cuArrayCreate_v2`, `cuArray3DCreate_v2`, `cuMipmappedArrayCreate`): each mip
//! level is laid out in rows of `width x channels x bytes per channel` padded to 512 bytes,
//! its height padded to a multiple of 8 rows (the block-linear tile height), times its depth;
//! levels halve width, height and (for a 3D array, not a layered or cubemap one) depth, down
//! to 1. The array takes whole 2 MiB pages, like any allocation of 2 MiB or more; that rounded
//! size is what `cuArrayGetMemoryRequirements` / `cuMipmappedArrayGetMemoryRequirements`
//! report (alignment 2 MiB). Formats: the basic integer, half and float ones; 1, 2 or 4
//! channels.
//!
//! **Graph memory**: see [`crate::graphs`]; its state is kept here, with the handles.

// CUDA's names and parameter names; the Safety section of `crate::exports` covers these too.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::{c_int, c_uint};

use cuda_abi::*;

use crate::api::Api;
use crate::driver::{call, call_out, Driver, PAGE};

type R<T> = Result<T, CUresult>;

/// Handles of arrays, graphs, nodes and executable graphs: fake pointers in a range of their own.
pub(crate) const RESOURCE_BASE: u64 = 0x0000_5ca4_0000_0000;

#[derive(Debug, Clone, Copy)]
struct Array {
    dev: usize,
    bytes: u64,
    mipmapped: bool,
}

/// This process's arrays, graphs and graph pools.
#[derive(Debug, Default)]
pub struct Resources {
    next: u64,
    arrays: HashMap<u64, Array>,
    /// Graphs, their nodes, executable graphs, captures and the graph pools.
    pub(crate) graphs: crate::graphs::GraphState,
}

impl Resources {
    /// A new handle, never handed out before in this process.
    pub(crate) fn handle(&mut self) -> u64 {
        self.next += 1;
        RESOURCE_BASE + self.next * 0x100
    }
}

/// Bytes an array of these dimensions takes (see the module docs).
pub fn array_bytes(width: u64, height: u64, depth: u64, format: c_int, channels: u32, levels: u32, shrink_depth: bool) -> R<u64> {
    let per_channel = array_format_bytes(format).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if width == 0 || ![1, 2, 4].contains(&channels) || levels == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let texel = per_channel * u64::from(channels);
    let (mut w, mut h, mut d) = (width, height.max(1), depth.max(1));
    let mut total: u64 = 0;
    for _ in 0..levels {
        let row = w.checked_mul(texel).and_then(|b| b.checked_next_multiple_of(512)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let level = row
            .checked_mul(h.checked_next_multiple_of(8).ok_or(CUDA_ERROR_INVALID_VALUE)?)
            .and_then(|b| b.checked_mul(d))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        total = total.checked_add(level).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        (w, h) = ((w / 2).max(1), (h / 2).max(1));
        if shrink_depth {
            d = (d / 2).max(1);
        }
    }
    total.checked_next_multiple_of(PAGE).ok_or(CUDA_ERROR_INVALID_VALUE)
}

fn create_array(d: &mut Driver, bytes: u64, mipmapped: bool) -> R<u64> {
    let (_, dev) = d.current()?;
    d.recharge_resources(dev, bytes, 0)?;
    let h = d.resources.handle();
    d.resources.arrays.insert(h, Array { dev, bytes, mipmapped });
    Ok(h)
}

fn destroy_array(d: &mut Driver, h: u64, mipmapped: bool) -> R<()> {
    let a = match d.resources.arrays.get(&h) {
        Some(a) if a.mipmapped == mipmapped => *a,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    d.recharge_resources(a.dev, 0, a.bytes)?;
    d.resources.arrays.remove(&h);
    Ok(())
}

fn requirements(d: &mut Driver, h: u64, mipmapped: bool, dev: CUdevice) -> R<CUDA_ARRAY_MEMORY_REQUIREMENTS> {
    let dev = d.dev_index(dev)?;
    match d.resources.arrays.get(&h) {
        Some(a) if a.mipmapped == mipmapped && a.dev == dev => {
            Ok(CUDA_ARRAY_MEMORY_REQUIREMENTS { size: a.bytes as usize, alignment: PAGE as usize, reserved: [0; 4] })
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Flags of `CUDA_ARRAY3D_DESCRIPTOR` whose depth counts layers (which mip levels keep).
const CUDA_ARRAY3D_LAYERED: c_uint = 0x01;
const CUDA_ARRAY3D_CUBEMAP: c_uint = 0x04;

#[no_mangle]
pub unsafe extern "C" fn cuArrayCreate_v2(pHandle: *mut CUarray, pAllocateArray: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult {
    let create = |d: &mut Driver| {
        // SAFETY: the caller passes NULL or a valid descriptor.
        let a = unsafe { pAllocateArray.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let bytes = array_bytes(a.width as u64, a.height as u64, 1, a.format, a.num_channels, 1, false)?;
        Ok(create_array(d, bytes, false)? as CUarray)
    };
    // SAFETY: the caller passes NULL or a valid CUarray pointer.
    unsafe { call_out(Api::ArrayCreateV2, pHandle, create) }
}

#[no_mangle]
pub unsafe extern "C" fn cuArray3DCreate_v2(pHandle: *mut CUarray, pAllocateArray: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult {
    let create = |d: &mut Driver| {
        // SAFETY: the caller passes NULL or a valid descriptor.
        let a = unsafe { pAllocateArray.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let bytes = array_bytes(a.width as u64, a.height as u64, a.depth as u64, a.format, a.num_channels, 1, false)?;
        Ok(create_array(d, bytes, false)? as CUarray)
    };
    // SAFETY: the caller passes NULL or a valid CUarray pointer.
    unsafe { call_out(Api::Array3DCreateV2, pHandle, create) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    pHandle: *mut CUmipmappedArray,
    pMipmappedArrayDesc: *const CUDA_ARRAY3D_DESCRIPTOR,
    numMipmapLevels: c_uint,
) -> CUresult {
    let create = |d: &mut Driver| {
        // SAFETY: the caller passes NULL or a valid descriptor.
        let a = unsafe { pMipmappedArrayDesc.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let layers = a.flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP) != 0;
        let bytes = array_bytes(a.width as u64, a.height as u64, a.depth as u64, a.format, a.num_channels, numMipmapLevels, !layers)?;
        Ok(create_array(d, bytes, true)? as CUmipmappedArray)
    };
    // SAFETY: the caller passes NULL or a valid CUmipmappedArray pointer.
    unsafe { call_out(Api::MipmappedArrayCreate, pHandle, create) }
}

#[no_mangle]
pub unsafe extern "C" fn cuArrayDestroy(hArray: CUarray) -> CUresult {
    call(Api::ArrayDestroy, |d| destroy_array(d, hArray as u64, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(hMipmappedArray: CUmipmappedArray) -> CUresult {
    call(Api::MipmappedArrayDestroy, |d| destroy_array(d, hMipmappedArray as u64, true))
}

#[no_mangle]
pub unsafe extern "C" fn cuArrayGetMemoryRequirements(
    memoryRequirements: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS,
    array: CUarray,
    device: CUdevice,
) -> CUresult {
    // SAFETY: the caller passes NULL or a valid struct pointer.
    unsafe { call_out(Api::ArrayGetMemoryRequirements, memoryRequirements, |d| requirements(d, array as u64, false, device)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMipmappedArrayGetMemoryRequirements(
    memoryRequirements: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS,
    mipmap: CUmipmappedArray,
    device: CUdevice,
) -> CUresult {
    // SAFETY: the caller passes NULL or a valid struct pointer.
    unsafe { call_out(Api::MipmappedArrayGetMemoryRequirements, memoryRequirements, |d| requirements(d, mipmap as u64, true, device)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn arrays_take_padded_tiles_in_whole_pages() {
        // 1000 x 1000 float4: 16384-byte rows x 1000 (a multiple of 8) = 15.6 MiB -> 16 MiB.
        assert_eq!(array_bytes(1000, 1000, 0, CU_AD_FORMAT_FLOAT, 4, 1, false), Ok(16 * MIB));
        // A tiny array still takes a page.
        assert_eq!(array_bytes(16, 0, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 1, false), Ok(2 * MIB));
        // Mipmapped 3D, 256³ float4, 2 levels: 256 MiB + 2048 x 128 x 128 = 32 MiB.
        assert_eq!(array_bytes(256, 256, 256, CU_AD_FORMAT_FLOAT, 4, 2, true), Ok(288 * MIB));
        // Layered: the layers stay at every level.
        assert_eq!(array_bytes(256, 256, 256, CU_AD_FORMAT_FLOAT, 4, 2, false), Ok(320 * MIB));
        assert_eq!(array_bytes(16, 16, 1, 0x77, 1, 1, false), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(array_bytes(16, 16, 1, CU_AD_FORMAT_FLOAT, 3, 1, false), Err(CUDA_ERROR_INVALID_VALUE));
    }
}
