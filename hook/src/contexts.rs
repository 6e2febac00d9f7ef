//! Context lifetimes: every CUDA context holds device memory of its own (docs/design.md,
//! "Platform facts": 518 MiB on an H100), so each is charged the device's context reserve
//! for as long as it lives. A created context (`cuCtxCreate_v2/_v3/_v4`) from its creation
//! to its `cuCtxDestroy_v2`; a device's primary context from the retain that creates it to
//! the release that drops its last reference (`cuDevicePrimaryCtxRetain` /
//! `cuDevicePrimaryCtxRelease(_v2)`).
//!
//! Context creation and destruction are serialised per process, so a second thread cannot slip
//! a context past a charge that is about to be refused. Not covered: the legacy `cuCtxCreate`
//! and `cuCtxDestroy` (pre-3.2 ABI) and `cuDevicePrimaryCtxReset(_v2)` (the driver keeps the
//! primary context's references through a reset). The allocations a destroyed context takes
//! with it (the driver frees them) stay charged until the process frees them or exits: an
//! over-charge, never an under-charge.
#![allow(non_snake_case)] // parameter names as in cuda.h
use std::{collections::HashMap, ffi::c_int, ffi::c_uint, ffi::c_void, sync::Mutex};

use cuda_abi::{CUcontext, CUctxCreateParams, CUdevice, CUresult, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS};
use ledger::{Charge, RecordId};

use crate::{
    exports::{admit, driver_or_return, real_or_return, Admission},
    session::{mode, Mode, Session},
};

/// A device's primary context.
#[derive(Default)]
struct Primary {
    references: u32,
    record: Option<RecordId>,
}

#[derive(Default)]
struct State {
    /// Created contexts → their charge.
    created: HashMap<u64, RecordId>,
    /// Primary contexts by driver ordinal.
    primary: HashMap<CUdevice, Primary>,
}

/// This process's charged contexts.
#[derive(Default)]
pub struct Contexts {
    state: Mutex<State>,
}

impl Contexts {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn release(session: &Session, record: RecordId) {
    let _ = session.ledger.release(session.slot, record);
}

/// Charges a new context on `ordinal`, creates it with `call` and remembers it by the handle
/// the driver writes to `pctx`.
fn create(ordinal: CUdevice, pctx: *mut CUcontext, call: impl FnOnce() -> CUresult) -> CUresult {
    let driver = driver_or_return!();
    let session = match mode() {
        Mode::Enforce(session) => session,
        // A context is real device memory too: an unusable ledger refuses it.
        Mode::Refuse(_) => return CUDA_ERROR_OUT_OF_MEMORY,
        Mode::PassThrough => return call(),
    };
    if pctx.is_null() {
        return call();
    }
    let mut state = session.contexts.lock();
    match admit(driver, Charge::AnotherContext, Some(ordinal)) {
        Admission::Pass => call(),
        Admission::Refuse => CUDA_ERROR_OUT_OF_MEMORY,
        Admission::Charged(session, _, record) => {
            let result = call();
            if result == CUDA_SUCCESS {
                // SAFETY: the driver succeeded, so it wrote the caller's out-pointer.
                let context = unsafe { *pctx } as u64;
                session.ledger.note_pointer(record, context);
                state.created.insert(context, record);
            } else {
                release(session, record);
            }
            result
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, ctx_create);
    // SAFETY: forwards the caller's arguments unchanged.
    create(dev, pctx, || unsafe { real(pctx, flags, dev) })
}

/// `cuCtxCreate_v3(CUcontext *, CUexecAffinityParam *, int, unsigned int, CUdevice)`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    paramsArray: *mut c_void,
    numParams: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, ctx_create_v3);
    // SAFETY: forwards the caller's arguments unchanged.
    create(dev, pctx, || unsafe { real(pctx, paramsArray, numParams, flags, dev) })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v4(pctx: *mut CUcontext, params: *mut CUctxCreateParams, flags: c_uint, dev: CUdevice) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, ctx_create_v4);
    // SAFETY: forwards the caller's arguments unchanged.
    create(dev, pctx, || unsafe { real(pctx, params, flags, dev) })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, ctx_destroy);
    // SAFETY: forwards the caller's argument unchanged.
    let call = || unsafe { real(ctx) };
    let Mode::Enforce(session) = mode() else { return call() };
    let mut state = session.contexts.lock();
    let result = call();
    if result == CUDA_SUCCESS {
        if let Some(record) = state.created.remove(&(ctx as u64)) {
            release(session, record);
        }
    }
    result
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, primary_ctx_retain);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(pctx, dev) };
    let session = match mode() {
        Mode::Enforce(session) => session,
        Mode::Refuse(_) => return CUDA_ERROR_OUT_OF_MEMORY,
        Mode::PassThrough => return call(),
    };
    let mut state = session.contexts.lock();
    let primary = state.primary.entry(dev).or_default();
    // Only the retain that creates the context charges it.
    let charged = if primary.references == 0 {
        match admit(driver, Charge::AnotherContext, Some(dev)) {
            Admission::Refuse => return CUDA_ERROR_OUT_OF_MEMORY,
            Admission::Pass => None,
            Admission::Charged(_, _, record) => Some(record),
        }
    } else {
        None
    };
    let result = call();
    if result == CUDA_SUCCESS {
        primary.references = primary.references.saturating_add(1);
        primary.record = primary.record.or(charged);
    } else if let Some(record) = charged {
        release(session, record);
    }
    result
}

/// Drops one reference to `dev`'s primary context with `call`; the last one releases its charge.
fn primary_release(dev: CUdevice, call: impl FnOnce() -> CUresult) -> CUresult {
    let Mode::Enforce(session) = mode() else { return call() };
    let mut state = session.contexts.lock();
    let result = call();
    if result == CUDA_SUCCESS {
        if let Some(primary) = state.primary.get_mut(&dev) {
            primary.references = primary.references.saturating_sub(1);
            if primary.references == 0 {
                if let Some(record) = primary.record.take() {
                    release(session, record);
                }
            }
        }
    }
    result
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, primary_ctx_release);
    // SAFETY: forwards the caller's argument unchanged.
    primary_release(dev, || unsafe { real(dev) })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, primary_ctx_release_v2);
    // SAFETY: forwards the caller's argument unchanged.
    primary_release(dev, || unsafe { real(dev) })
}
