//! Stream-ordered memory pools beyond the default one: `cuMemPoolCreate`,
//! `cuMemPoolDestroy`, `cuMemPoolGetAttribute`, `cuMemPoolSetAttribute`,
//! `cuDeviceGetDefaultMemPool`. The pools themselves (reserve, trim, release at
//! synchronization) are [`crate::driver`]'s; this module is their C surface.
//!
//! Attributes as `cuda.h` documents them: `RELEASE_THRESHOLD` (read/write, default 0: every
//! synchronization gives unused reserved memory back), `RESERVED_MEM_CURRENT` and
//! `USED_MEM_CURRENT` (read-only), `RESERVED_MEM_HIGH` and `USED_MEM_HIGH` (read; set only to
//! 0, which resets the mark to the current value), and the three `REUSE_*` switches (`int`,
//! default 1, stored but without effect: the fake does work synchronously).
//!
//! # Safety
//!
//! Every export is `unsafe` with the contract of its `cuda.h` declaration (see
//! [`crate::exports`]).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_int, c_void};

use cuda_abi::*;

use crate::api::Api;
use crate::driver::{self, call, call_out, Driver};

/// Pools are device-located and pinned; `maxSize` bounds the reserve.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolCreate(pool: *mut CUmemoryPool, poolProps: *const CUmemPoolProps) -> CUresult {
    let create = |d: &mut Driver| {
        // SAFETY: the caller passes NULL or a valid CUmemPoolProps pointer.
        let props = unsafe { poolProps.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if props.alloc_type != CU_MEM_ALLOCATION_TYPE_PINNED || props.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = d.dev_index(props.location.id).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        Ok(d.pool_create(dev, props.max_size as u64)? as CUmemoryPool)
    };
    // SAFETY: the caller passes NULL or a valid CUmemoryPool pointer.
    unsafe { call_out(Api::MemPoolCreate, pool, create) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    call(Api::MemPoolDestroy, |d| d.pool_destroy(pool as u64))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    let handle = |d: &mut Driver| Ok(driver::pool_handle(d.dev_index(dev)?) as CUmemoryPool);
    // SAFETY: the caller passes NULL or a valid CUmemoryPool pointer.
    unsafe { call_out(Api::DeviceGetDefaultMemPool, pool, handle) }
}

/// The index of a `REUSE_*` attribute in [`driver::Pool::reuse`].
fn reuse_index(attr: c_int) -> Option<usize> {
    match attr {
        CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES => Some(0),
        CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC => Some(1),
        CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => Some(2),
        _ => None,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAttribute(pool: CUmemoryPool, attr: c_int, value: *mut c_void) -> CUresult {
    call(Api::MemPoolGetAttribute, |d| {
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = d.pool(pool as u64)?;
        if let Some(i) = reuse_index(attr) {
            // SAFETY: non-null; for these attributes the caller passes an int.
            unsafe { value.cast::<c_int>().write(p.reuse[i]) };
            return Ok(());
        }
        let v = match attr {
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => p.release_threshold,
            CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT => p.reserved,
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH => p.reserved_high,
            CU_MEMPOOL_ATTR_USED_MEM_CURRENT => p.used,
            CU_MEMPOOL_ATTR_USED_MEM_HIGH => p.used_high,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: non-null; for these attributes the caller passes a cuuint64_t.
        unsafe { value.cast::<u64>().write(v) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAttribute(pool: CUmemoryPool, attr: c_int, value: *mut c_void) -> CUresult {
    call(Api::MemPoolSetAttribute, |d| {
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = d.pool_mut(pool as u64)?;
        if let Some(i) = reuse_index(attr) {
            // SAFETY: non-null; for these attributes the caller passes an int.
            p.reuse[i] = i32::from(unsafe { value.cast::<c_int>().read() } != 0);
            return Ok(());
        }
        // SAFETY: non-null; for the other attributes the caller passes a cuuint64_t.
        let v = unsafe { value.cast::<u64>().read() };
        match attr {
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => p.release_threshold = v,
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH if v == 0 => p.reserved_high = p.reserved,
            CU_MEMPOOL_ATTR_USED_MEM_HIGH if v == 0 => p.used_high = p.used,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        Ok(())
    })
}
