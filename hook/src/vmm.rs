//! VMM lifetimes (`cuMemCreate` and friends): the physical memory of a handle stays allocated
//! from `cuMemCreate` until the handle is released *and* its last mapping is unmapped, so its
//! charge lives exactly as long. A handle is referenced once by `cuMemCreate` and once more by
//! each `cuMemRetainAllocationHandle`, each `cuMemRelease` drops one reference, and each
//! `cuMemMap` of it is a mapping until the `cuMemUnmap` that covers it. Only device-located
//! handles are charged: host-located ones (`CU_MEM_LOCATION_TYPE_HOST*`) are host memory.
//! Handles this process did not create (imported from another process, created before the
//! ledger enforced anything) are not charged here and are left to the driver.
#![allow(non_snake_case)] // parameter names as in cuda.h
use std::{
    collections::{BTreeMap, HashMap},
    ffi::c_void,
    sync::Mutex,
};

use cuda_abi::{CUdeviceptr, CUmemAllocationProp, CUresult, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CU_MEM_LOCATION_TYPE_DEVICE};
use ledger::{Charge, RecordId};

use crate::{
    exports::{admit, driver_or_return, real_or_return, Admission},
    session::{mode, Mode, Session},
};

/// One charged handle.
struct Handle {
    record: RecordId,
    /// `cuMemCreate` and each `cuMemRetainAllocationHandle`, less each `cuMemRelease`.
    references: u32,
    /// Live `cuMemMap`s of it.
    mappings: u32,
}

#[derive(Default)]
struct State {
    handles: HashMap<u64, Handle>,
    /// Live mappings of charged handles: start → (size, handle).
    mappings: BTreeMap<u64, (u64, u64)>,
}

/// This process's charged VMM handles and their mappings.
#[derive(Default)]
pub struct Vmm {
    state: Mutex<State>,
}

impl Vmm {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl State {
    /// Releases the charge of `handle` once nothing holds it any more.
    fn settle(&mut self, session: &Session, handle: u64) {
        if self.handles.get(&handle).is_some_and(|h| h.references == 0 && h.mappings == 0) {
            if let Some(h) = self.handles.remove(&handle) {
                let _ = session.ledger.release(session.slot, h.record);
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(handle: *mut u64, size: usize, prop: *const CUmemAllocationProp, flags: u64) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_create);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(handle, size, prop, flags) };
    // Only device-located physical memory counts against the GPU quota.
    // SAFETY: a non-null prop points to the caller's CUmemAllocationProp.
    let location = (!prop.is_null()).then(|| unsafe { (*prop).location });
    let Some(location) = location.filter(|l| l.type_ == CU_MEM_LOCATION_TYPE_DEVICE) else { return call() };
    if handle.is_null() {
        return call();
    }
    match admit(driver, Charge::Device(size as u64), Some(location.id)) {
        Admission::Pass => call(),
        Admission::Refuse => CUDA_ERROR_OUT_OF_MEMORY,
        Admission::Charged(session, _, record) => {
            let result = call();
            if result != CUDA_SUCCESS {
                let _ = session.ledger.release(session.slot, record);
                return result;
            }
            // SAFETY: the driver succeeded, so it wrote the caller's out-pointer.
            let created = unsafe { *handle };
            session.ledger.note_pointer(record, created);
            session.vmm.lock().handles.insert(created, Handle { record, references: 1, mappings: 0 });
            result
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_release);
    // SAFETY: forwards the caller's argument unchanged.
    let call = || unsafe { real(handle) };
    let Mode::Enforce(session) = mode() else { return call() };
    let mut state = session.vmm.lock();
    let result = call();
    if result == CUDA_SUCCESS {
        if let Some(h) = state.handles.get_mut(&handle) {
            h.references = h.references.saturating_sub(1);
            state.settle(session, handle);
        }
    }
    result
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_retain_allocation_handle);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(handle, addr) };
    let Mode::Enforce(session) = mode() else { return call() };
    let mut state = session.vmm.lock();
    let result = call();
    if result == CUDA_SUCCESS && !handle.is_null() {
        // SAFETY: the driver succeeded, so it wrote the caller's out-pointer.
        let retained = unsafe { *handle };
        if let Some(h) = state.handles.get_mut(&retained) {
            h.references = h.references.saturating_add(1);
        }
    }
    result
}

#[no_mangle]
pub unsafe extern "C" fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: u64, flags: u64) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_map);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(ptr, size, offset, handle, flags) };
    let Mode::Enforce(session) = mode() else { return call() };
    let mut state = session.vmm.lock();
    let result = call();
    if result == CUDA_SUCCESS {
        if let Some(h) = state.handles.get_mut(&handle) {
            h.mappings = h.mappings.saturating_add(1);
            state.mappings.insert(ptr, (size as u64, handle));
        }
    }
    result
}

#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, mem_unmap);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(ptr, size) };
    let Mode::Enforce(session) = mode() else { return call() };
    let mut state = session.vmm.lock();
    let result = call();
    if result == CUDA_SUCCESS {
        // Every mapping inside the range is gone (the driver refuses ranges that cut one).
        let end = ptr.saturating_add(size as u64);
        let gone: Vec<(u64, u64)> = state.mappings.range(ptr..end).map(|(&start, &(_, handle))| (start, handle)).collect();
        for (start, handle) in gone {
            state.mappings.remove(&start);
            if let Some(h) = state.handles.get_mut(&handle) {
                h.mappings = h.mappings.saturating_sub(1);
                state.settle(session, handle);
            }
        }
    }
    result
}
