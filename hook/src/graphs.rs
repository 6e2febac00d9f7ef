//! Graph memory (`cuGraphAddMemAllocNode`): a graph's allocations take physical memory from the
//! device's graph memory pool when the graph is *launched*, and the pool keeps it reserved,
//! for later launches, until `cuDeviceGraphMemTrim` gives back what no launched graph uses.
//! So the graph pool is charged like a stream-ordered pool (see `pools`): before a launch, the
//! growth the launch may need (the bytes of the executable graph's allocation nodes, less what
//! the pool holds unused) is admitted, or the launch is refused with
//! `CUDA_ERROR_OUT_OF_MEMORY` and never reaches the driver; after it, and after each trim, the
//! charge is settled to the pool's reserved memory (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`).
//!
//! The bytes of an executable graph are known from the allocation nodes added with
//! `cuGraphAddMemAllocNode` to the graph it was instantiated from with
//! `cuGraphInstantiateWithFlags` (what `cuGraphInstantiate` is in CUDA 12/13). Graphs built
//! otherwise (stream capture of `cuMemAllocAsync`, clones, `cuGraphInstantiateWithParams`)
//! are not known before their launch: their pool growth is charged after it, when settled,
//! and reported on stderr if it is over the quota.
#![allow(non_snake_case)] // parameter names as in cuda.h
use std::{collections::HashMap, sync::Mutex};

use cuda_abi::{
    CUdevice, CUgraph, CUgraphExec, CUgraphNode, CUresult, CUstream, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_OUT_OF_MEMORY, CUDA_MEM_ALLOC_NODE_PARAMS,
    CUDA_SUCCESS, CU_MEM_LOCATION_TYPE_DEVICE,
};

use crate::{
    exports::{current_device, driver_or_return, real_or_return, reserve_or_report},
    pools::{PoolOutcome, Source},
    real::Driver,
    session::{mode, Mode},
};

/// Bytes of allocation nodes, by driver ordinal.
type Needs = Vec<(CUdevice, u64)>;

fn add(needs: &mut Needs, ordinal: CUdevice, bytes: u64) {
    match needs.iter_mut().find(|(o, _)| *o == ordinal) {
        Some((_, total)) => *total = total.saturating_add(bytes),
        None => needs.push((ordinal, bytes)),
    }
}

#[derive(Default)]
struct State {
    graphs: HashMap<u64, Needs>,
    execs: HashMap<u64, Needs>,
}

/// What this process's graphs and executable graphs allocate.
#[derive(Default)]
pub struct Graphs {
    state: Mutex<State>,
}

impl Graphs {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphAddMemAllocNode(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    dependencies: *const CUgraphNode,
    numDependencies: usize,
    nodeParams: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, graph_add_mem_alloc_node);
    // SAFETY: forwards the caller's arguments unchanged.
    let result = unsafe { real(phGraphNode, hGraph, dependencies, numDependencies, nodeParams) };
    if result != CUDA_SUCCESS || nodeParams.is_null() {
        return result;
    }
    let Mode::Enforce(session) = mode() else { return result };
    // SAFETY: non-null, and the driver accepted it: the caller's parameters.
    let params = unsafe { *nodeParams };
    if params.pool_props.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE {
        let mut state = session.graphs.lock();
        add(state.graphs.entry(hGraph as u64).or_default(), params.pool_props.location.id, params.bytesize as u64);
    }
    result
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(phGraphExec: *mut CUgraphExec, hGraph: CUgraph, flags: u64) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, graph_instantiate_with_flags);
    // SAFETY: forwards the caller's arguments unchanged.
    let result = unsafe { real(phGraphExec, hGraph, flags) };
    if result != CUDA_SUCCESS || phGraphExec.is_null() {
        return result;
    }
    let Mode::Enforce(session) = mode() else { return result };
    // SAFETY: the driver succeeded, so it wrote the caller's out-pointer.
    let exec = unsafe { *phGraphExec } as u64;
    let mut state = session.graphs.lock();
    if let Some(needs) = state.graphs.get(&(hGraph as u64)).cloned() {
        state.execs.insert(exec, needs);
    }
    result
}

/// Launches `exec` with `call`, admitting the growth of each device's graph pool first.
fn launch(driver: &Driver, exec: CUgraphExec, call: impl FnOnce() -> CUresult) -> CUresult {
    let session = match mode() {
        Mode::Enforce(session) => session,
        Mode::Refuse(_) => return CUDA_ERROR_OUT_OF_MEMORY,
        Mode::PassThrough => return call(),
    };
    let needs = session.graphs.lock().execs.get(&(exec as u64)).cloned().unwrap_or_default();
    let enforced: Vec<(CUdevice, u32, u64)> =
        needs.iter().filter_map(|&(ordinal, bytes)| Some((ordinal, session.ledger_device(ordinal)?, bytes))).collect();
    match enforced.as_slice() {
        // The common case: a graph allocating on one device is admitted as one pool growth.
        [(ordinal, device, bytes)] => {
            let mut call = Some(call);
            let outcome = session.pools.allocate(
                session,
                driver,
                Source::Graph(*ordinal),
                *device,
                *bytes,
                |charge| reserve_or_report(session, *device, charge, 0),
                || (call.take().map_or(CUDA_ERROR_NOT_FOUND, |call| call()), None),
            );
            match (outcome, call) {
                (Some(PoolOutcome::Called(result)), _) => result,
                (Some(PoolOutcome::Refused), _) => CUDA_ERROR_OUT_OF_MEMORY,
                // The driver cannot report its graph pool: nothing to settle to.
                (None, Some(call)) => call(),
                (None, None) => CUDA_ERROR_NOT_FOUND, // unreachable: no outcome means no call
            }
        }
        // Unknown (or several devices): launch, then settle what the pools hold.
        _ => {
            let ordinals: Vec<CUdevice> = if enforced.is_empty() {
                current_device(driver).into_iter().collect()
            } else {
                enforced.iter().map(|&(ordinal, _, _)| ordinal).collect()
            };
            let mut result = Some(call());
            for ordinal in ordinals {
                if let Some(device) = session.ledger_device(ordinal) {
                    let call = || result.take().unwrap_or(CUDA_SUCCESS);
                    let settled = session.pools.settle_after(session, driver, Source::Graph(ordinal), device, call);
                    result = Some(settled);
                }
            }
            result.unwrap_or(CUDA_SUCCESS)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphLaunch(hGraphExec: CUgraphExec, hStream: CUstream) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, graph_launch);
    // SAFETY: forwards the caller's arguments unchanged.
    launch(driver, hGraphExec, || unsafe { real(hGraphExec, hStream) })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphLaunch_ptsz(hGraphExec: CUgraphExec, hStream: CUstream) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, graph_launch_ptsz);
    // SAFETY: forwards the caller's arguments unchanged.
    launch(driver, hGraphExec, || unsafe { real(hGraphExec, hStream) })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGraphMemTrim(device: CUdevice) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, device_graph_mem_trim);
    // SAFETY: forwards the caller's argument unchanged.
    let call = || unsafe { real(device) };
    match mode() {
        Mode::Enforce(session) => match session.ledger_device(device) {
            Some(ledger_device) => session.pools.settle_after(session, driver, Source::Graph(device), ledger_device, call),
            None => call(),
        },
        _ => call(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphExecDestroy(hGraphExec: CUgraphExec) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, graph_exec_destroy);
    // SAFETY: forwards the caller's argument unchanged.
    let result = unsafe { real(hGraphExec) };
    // What it launched stays in the device's graph pool until trimmed.
    if let (CUDA_SUCCESS, Mode::Enforce(session)) = (result, mode()) {
        session.graphs.lock().execs.remove(&(hGraphExec as u64));
    }
    result
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphDestroy(hGraph: CUgraph) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, graph_destroy);
    // SAFETY: forwards the caller's argument unchanged.
    let result = unsafe { real(hGraph) };
    if let (CUDA_SUCCESS, Mode::Enforce(session)) = (result, mode()) {
        session.graphs.lock().graphs.remove(&(hGraph as u64));
    }
    result
}
