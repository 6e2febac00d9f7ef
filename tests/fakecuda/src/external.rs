//! The fake's external memory: `cuImportExternalMemory`, `cuExternalMemoryGetMappedBuffer`,
//! `cuDestroyExternalMemory`. Imported memory belongs to whoever exported it (a Vulkan or D3D
//! allocation, an fd), so nothing is charged to a device: an import only records the
//! descriptor's size under a new handle. Only `CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD` is
//! accepted (with an fd of 0 or more, which is not looked at), with a non-zero size; a mapped
//! buffer must lie inside the import and gets a device address in a range of its own (it is
//! not backed: the fake never touches device memory). Destroying the import ends its buffers.

// CUDA's names and parameter names; the Safety section of `crate::exports` covers these too.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::HashMap;

use cuda_abi::*;

use crate::api::Api;
use crate::driver::{call, call_out, Driver};

/// Handles of imports, in a range of their own.
const HANDLE_BASE: u64 = 0x0000_e8e0_0000_0000;
/// Device addresses of mapped buffers: each import has a 1 TiB window.
const BUFFER_VA_BASE: u64 = 0x7e00_0000_0000;
const WINDOW: u64 = 1 << 40;

/// This process's imports: handle → size.
#[derive(Debug, Default)]
pub struct External {
    next: u64,
    imports: HashMap<u64, u64>,
}

fn import(external: &mut External, desc: &CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR) -> Result<CUexternalMemory, CUresult> {
    if desc.type_ != CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    // SAFETY: for an opaque-fd descriptor the union holds `fd`; any int is a valid value.
    let fd = unsafe { desc.handle.fd };
    if fd < 0 || desc.size == 0 || desc.size >= WINDOW {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    external.next += 1;
    let handle = HANDLE_BASE + external.next * 0x100;
    external.imports.insert(handle, desc.size);
    Ok(handle as CUexternalMemory)
}

fn mapped_buffer(external: &External, handle: u64, desc: &CUDA_EXTERNAL_MEMORY_BUFFER_DESC) -> Result<CUdeviceptr, CUresult> {
    let size = *external.imports.get(&handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let end = desc.offset.checked_add(desc.size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if desc.size == 0 || end > size {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let index = (handle - HANDLE_BASE) / 0x100;
    Ok(BUFFER_VA_BASE + index * WINDOW + desc.offset)
}

#[no_mangle]
pub unsafe extern "C" fn cuImportExternalMemory(
    extMem_out: *mut CUexternalMemory,
    memHandleDesc: *const CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR,
) -> CUresult {
    let import_it = |d: &mut Driver| {
        // SAFETY: the caller passes NULL or a valid descriptor.
        let desc = unsafe { memHandleDesc.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        import(&mut d.external, desc)
    };
    // SAFETY: the caller passes NULL or a valid CUexternalMemory pointer.
    unsafe { call_out(Api::ImportExternalMemory, extMem_out, import_it) }
}

#[no_mangle]
pub unsafe extern "C" fn cuExternalMemoryGetMappedBuffer(
    devPtr: *mut CUdeviceptr,
    extMem: CUexternalMemory,
    bufferDesc: *const CUDA_EXTERNAL_MEMORY_BUFFER_DESC,
) -> CUresult {
    let map = |d: &mut Driver| {
        // SAFETY: the caller passes NULL or a valid descriptor.
        let desc = unsafe { bufferDesc.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        mapped_buffer(&d.external, extMem as u64, desc)
    };
    // SAFETY: the caller passes NULL or a valid CUdeviceptr pointer.
    unsafe { call_out(Api::ExternalMemoryGetMappedBuffer, devPtr, map) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDestroyExternalMemory(extMem: CUexternalMemory) -> CUresult {
    call(Api::DestroyExternalMemory, |d| {
        d.external.imports.remove(&(extMem as u64)).map(drop).ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(type_: i32, fd: i32, size: u64) -> CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR {
        CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR {
            type_,
            handle: CUexternalMemoryHandle { fd },
            size,
            flags: 0,
            reserved: [0; 16],
        }
    }

    #[test]
    fn imports_are_recorded_mapped_inside_and_destroyed_once() {
        let mut d = External::default();
        let handle = import(&mut d, &descriptor(CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD, 3, 1 << 20)).expect("import") as u64;
        let inside = CUDA_EXTERNAL_MEMORY_BUFFER_DESC { offset: 4096, size: 8192, ..Default::default() };
        let ptr = mapped_buffer(&d, handle, &inside).expect("map inside");
        assert_eq!(ptr % 4096, 0);
        let outside = CUDA_EXTERNAL_MEMORY_BUFFER_DESC { offset: 1 << 20, size: 1, ..Default::default() };
        assert_eq!(mapped_buffer(&d, handle, &outside), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(d.imports.remove(&handle), Some(1 << 20));
        assert_eq!(mapped_buffer(&d, handle, &inside), Err(CUDA_ERROR_INVALID_HANDLE));
    }

    #[test]
    fn only_opaque_fds_of_some_size_are_accepted() {
        let mut d = External::default();
        assert_eq!(import(&mut d, &descriptor(CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_WIN32, 3, 1 << 20)), Err(CUDA_ERROR_NOT_SUPPORTED));
        assert_eq!(import(&mut d, &descriptor(CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD, -1, 1 << 20)), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(import(&mut d, &descriptor(CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD, 3, 0)), Err(CUDA_ERROR_INVALID_VALUE));
    }
}
