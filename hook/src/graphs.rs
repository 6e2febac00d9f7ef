//! Graph memory: a graph's allocation nodes (`cuGraphAddMemAllocNode`, or `cuMemAllocAsync` /
//! `cuMemAllocFromPoolAsync` on a stream being captured) take physical memory from the
//! device's graph memory pool when the executable graph is *launched* (or uploaded), and the
//! pool keeps it reserved, for later launches, until `cuDeviceGraphMemTrim` gives back what no
//! launched graph uses. So the graph pool is charged like a stream-ordered pool (see `pools`):
//! before a launch, the growth the launch may need (the bytes of the executable graph's
//! allocation nodes, less what the pool holds unused) is admitted, or the launch is refused
//! with `CUDA_ERROR_OUT_OF_MEMORY` and never reaches the driver; after it, and after each
//! trim, the charge is settled to the pool's reserved memory
//! (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`).
//!
//! This module owns what each executable graph of the process allocates. It learns that when
//! the graph is instantiated (`cuGraphInstantiateWithFlags`, `cuGraphInstantiateWithParams`
//! and its `_ptsz` form, and the legacy exports `cuGraphInstantiate` / `cuGraphInstantiate_v2`
//! that `cuGraphInstantiate` stood for before CUDA 12), by asking the driver about the graph
//! itself: its nodes (`cuGraphGetNodes`, `cuGraphNodeGetType`), the parameters of each
//! allocation node (`cuGraphMemAllocNodeGetParams`) and, recursively, the graphs of child
//! graph nodes (`cuGraphChildGraphNodeGetGraph`). So graphs built node by node, captured from
//! streams (`cuMemAllocAsync` on a capturing stream adds an allocation node) or nested (a graph
//! moved into a child graph node with `cuGraphAddNode`, CUDA 12.9) are all known the same way;
//! so would clones be, though drivers refuse to clone allocation nodes (measured on an H100,
//! driver 580.159: `cuGraphClone` and `cuGraphAddChildGraphNode` return
//! `CUDA_ERROR_NOT_SUPPORTED`). The same driver confirmed what this relies on: a captured
//! allocation is a `CU_GRAPH_NODE_TYPE_MEM_ALLOC` node with the requested `bytesize`, the pool
//! grows at launch, at `cuGraphUpload` and at instantiation with the upload flag, never at a
//! plain instantiation. The walk is bounded
//! ([`MAX_NODES`] nodes in all, [`MAX_DEPTH`] levels of child graphs): a graph past the bounds,
//! or a driver without those entry points, leaves the executable graph unknown, and an unknown
//! graph's launch is charged after it instead (the pool's growth settled, and reported on
//! stderr if it is over the quota); the first such graph is reported on stderr. Instantiation
//! with `CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD` grows the pool at once, so it is admitted like a
//! launch; so is `cuGraphUpload`.
#![allow(non_snake_case)] // parameter names as in cuda.h
use std::{
    collections::HashMap,
    ffi::c_char,
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
};

use cuda_abi::{
    CUdevice, CUgraph, CUgraphExec, CUgraphNode, CUresult, CUstream, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD, CUDA_GRAPH_INSTANTIATE_PARAMS, CUDA_MEM_ALLOC_NODE_PARAMS, CUDA_SUCCESS, CU_GRAPH_NODE_TYPE_GRAPH,
    CU_GRAPH_NODE_TYPE_MEM_ALLOC, CU_MEM_LOCATION_TYPE_DEVICE,
};

use crate::{
    exports::{current_device, driver_or_return, real_or_return, reserve_in_pool},
    pools::{PoolOutcome, Source},
    real::Driver,
    session::{mode, say, Mode},
};

/// The most nodes one walk reads, over the graph and all its child graphs.
pub const MAX_NODES: usize = 1 << 20;
/// The most levels of child graphs one walk descends.
pub const MAX_DEPTH: u32 = 64;

/// Bytes of allocation nodes, by driver ordinal.
type Needs = Vec<(CUdevice, u64)>;

fn add(needs: &mut Needs, ordinal: CUdevice, bytes: u64) {
    match needs.iter_mut().find(|(o, _)| *o == ordinal) {
        Some((_, total)) => *total = total.saturating_add(bytes),
        None => needs.push((ordinal, bytes)),
    }
}

/// What this process's executable graphs allocate (those whose walk succeeded).
#[derive(Default)]
pub struct Graphs {
    execs: Mutex<HashMap<u64, Needs>>,
}

impl Graphs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Needs>> {
        self.execs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The device memory `graph`'s allocation nodes take, its child graphs' included, as the
/// driver reports the graph; why not, where it cannot be known.
fn needs_of(driver: &Driver, graph: CUgraph) -> Result<Needs, String> {
    let get_nodes = driver.graph_get_nodes.ok_or("the driver has no cuGraphGetNodes")?;
    let get_type = driver.graph_node_get_type.ok_or("the driver has no cuGraphNodeGetType")?;
    let mut needs = Needs::new();
    let mut budget = MAX_NODES;
    let mut pending = vec![(graph, 0u32)];
    while let Some((graph, depth)) = pending.pop() {
        for node in nodes_of(get_nodes, graph, &mut budget)? {
            let mut kind = -1;
            // SAFETY: a node of a live graph, as the driver listed it; the out-pointer is a live local.
            let result = unsafe { get_type(node, &mut kind) };
            if result != CUDA_SUCCESS {
                return Err(format!("cuGraphNodeGetType failed ({result})"));
            }
            match kind {
                CU_GRAPH_NODE_TYPE_MEM_ALLOC => {
                    let get = driver.graph_mem_alloc_node_get_params.ok_or("the driver has no cuGraphMemAllocNodeGetParams")?;
                    // SAFETY: all-zero bytes are a valid value of this struct of integers and raw pointers.
                    let mut params: CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
                    // SAFETY: an allocation node of a live graph; the driver writes the live local.
                    let result = unsafe { get(node, &mut params) };
                    if result != CUDA_SUCCESS {
                        return Err(format!("cuGraphMemAllocNodeGetParams failed ({result})"));
                    }
                    if params.pool_props.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE {
                        add(&mut needs, params.pool_props.location.id, params.bytesize as u64);
                    }
                }
                CU_GRAPH_NODE_TYPE_GRAPH => {
                    if depth >= MAX_DEPTH {
                        return Err(format!("its child graphs nest deeper than {MAX_DEPTH} levels"));
                    }
                    let get = driver.graph_child_graph_node_get_graph.ok_or("the driver has no cuGraphChildGraphNodeGetGraph")?;
                    let mut child: CUgraph = std::ptr::null_mut();
                    // SAFETY: a child graph node of a live graph; the out-pointer is a live local.
                    let result = unsafe { get(node, &mut child) };
                    if result != CUDA_SUCCESS || child.is_null() {
                        return Err(format!("cuGraphChildGraphNodeGetGraph failed ({result})"));
                    }
                    pending.push((child, depth + 1));
                }
                _ => {}
            }
        }
    }
    Ok(needs)
}

type GetNodes = unsafe extern "C" fn(CUgraph, *mut CUgraphNode, *mut usize) -> CUresult;

/// The nodes of `graph`, taken out of `budget`.
fn nodes_of(get_nodes: GetNodes, graph: CUgraph, budget: &mut usize) -> Result<Vec<CUgraphNode>, String> {
    let mut count: usize = 0;
    // SAFETY: a NULL node array asks for the count only, written to the live local.
    let result = unsafe { get_nodes(graph, std::ptr::null_mut(), &mut count) };
    if result != CUDA_SUCCESS {
        return Err(format!("cuGraphGetNodes failed ({result})"));
    }
    *budget = budget.checked_sub(count).ok_or_else(|| format!("it has more than {MAX_NODES} nodes"))?;
    let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); count];
    let mut filled = count;
    // SAFETY: the array has room for `filled` handles, as the driver is told.
    let result = unsafe { get_nodes(graph, nodes.as_mut_ptr(), &mut filled) };
    if result != CUDA_SUCCESS {
        return Err(format!("cuGraphGetNodes failed ({result})"));
    }
    nodes.truncate(filled.min(count));
    nodes.retain(|node| !node.is_null());
    Ok(nodes)
}

/// Says once per process why a graph's memory is charged only after its launches.
fn unknown(why: &str) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        say(&format!(
            "cannot tell what an executable graph allocates ({why}): graph memory of such graphs is charged after their launch, not admitted before"
        ));
    }
}

/// After an instantiation returned `result`: records what executable graph `*phGraphExec`
/// (instantiated from `hGraph`) allocates.
fn instantiated(driver: &Driver, result: CUresult, phGraphExec: *mut CUgraphExec, hGraph: CUgraph) -> CUresult {
    instantiated_as(result, phGraphExec, || needs_of(driver, hGraph))
}

/// [`instantiated`] with the graph's needs from `walk` (a walk already made is not made twice).
fn instantiated_as(result: CUresult, phGraphExec: *mut CUgraphExec, walk: impl FnOnce() -> Result<Needs, String>) -> CUresult {
    if result != CUDA_SUCCESS || phGraphExec.is_null() {
        return result;
    }
    let Mode::Enforce(session) = mode() else { return result };
    // SAFETY: the driver succeeded, so it wrote the caller's out-pointer.
    let exec = unsafe { *phGraphExec } as u64;
    match walk() {
        Ok(needs) => {
            session.graphs.lock().insert(exec, needs);
        }
        Err(why) => {
            // A handle the driver hands out again must not keep a destroyed graph's bytes.
            session.graphs.lock().remove(&exec);
            unknown(&why);
        }
    }
    result
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(phGraphExec: *mut CUgraphExec, hGraph: CUgraph, flags: u64) -> CUresult {
    let driver = driver_or_return!();
    let real = real_or_return!(driver, graph_instantiate_with_flags);
    // SAFETY: forwards the caller's arguments unchanged.
    let result = unsafe { real(phGraphExec, hGraph, flags) };
    instantiated(driver, result, phGraphExec, hGraph)
}

macro_rules! instantiate_legacy {
    ($name:ident, $field:ident) => {
        /// The export `cuGraphInstantiate` stood for before CUDA 12 (error node and log buffer).
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            phGraphExec: *mut CUgraphExec,
            hGraph: CUgraph,
            phErrorNode: *mut CUgraphNode,
            logBuffer: *mut c_char,
            bufferSize: usize,
        ) -> CUresult {
            let driver = driver_or_return!();
            let real = real_or_return!(driver, $field);
            // SAFETY: forwards the caller's arguments unchanged.
            let result = unsafe { real(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize) };
            instantiated(driver, result, phGraphExec, hGraph)
        }
    };
}
instantiate_legacy!(cuGraphInstantiate, graph_instantiate);
instantiate_legacy!(cuGraphInstantiate_v2, graph_instantiate_v2);

macro_rules! instantiate_with_params {
    ($name:ident, $field:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            phGraphExec: *mut CUgraphExec,
            hGraph: CUgraph,
            instantiateParams: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
        ) -> CUresult {
            let driver = driver_or_return!();
            let real = real_or_return!(driver, $field);
            // SAFETY: forwards the caller's arguments unchanged.
            let call = || unsafe { real(phGraphExec, hGraph, instantiateParams) };
            // SAFETY: NULL or the caller's parameters (the driver validates them too).
            let upload = unsafe { instantiateParams.as_ref() }.is_some_and(|p| p.flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0);
            match (upload, mode()) {
                // Uploading grows the graph pool now: admitted like a launch, with one walk.
                (true, Mode::Enforce(_)) => {
                    let needs = needs_of(driver, hGraph);
                    let result = grow(driver, needs.clone().ok(), call);
                    instantiated_as(result, phGraphExec, || needs)
                }
                _ => instantiated(driver, call(), phGraphExec, hGraph),
            }
        }
    };
}
instantiate_with_params!(cuGraphInstantiateWithParams, graph_instantiate_with_params);
instantiate_with_params!(cuGraphInstantiateWithParams_ptsz, graph_instantiate_with_params_ptsz);

/// Launches (or uploads) `exec` with `call`, admitting the growth of its device's graph pool first.
fn launch(exec: CUgraphExec, driver: &Driver, call: impl FnOnce() -> CUresult) -> CUresult {
    let needs = match mode() {
        Mode::Enforce(session) => session.graphs.lock().get(&(exec as u64)).cloned(),
        _ => None,
    };
    grow(driver, needs, call)
}

/// Runs `call`, which may grow graph pools by `needs` (`None`: not known), admitting the
/// growth first where it is known.
fn grow(driver: &Driver, needs: Option<Needs>, call: impl FnOnce() -> CUresult) -> CUresult {
    let session = match mode() {
        Mode::Enforce(session) => session,
        Mode::Refuse(_) => return CUDA_ERROR_OUT_OF_MEMORY,
        Mode::PassThrough => return call(),
    };
    let enforced: Vec<(CUdevice, u32, u64)> = needs
        .iter()
        .flatten()
        .filter_map(|&(ordinal, bytes)| Some((ordinal, session.ledger_device(ordinal)?, bytes)))
        .collect();
    match (needs.as_deref(), enforced.as_slice()) {
        // Known to allocate nothing on an enforced device: the pools it charges do not grow.
        (Some(_), []) => call(),
        // The common case: a graph allocating on one device is admitted as one pool growth.
        (Some(_), [(ordinal, device, bytes)]) => {
            let mut call = Some(call);
            let outcome = session.pools.allocate(
                session,
                driver,
                Source::Graph(*ordinal),
                *device,
                *bytes,
                |charge, settle| reserve_in_pool(session, *device, charge, 0, settle),
                || (call.take().map_or(CUDA_ERROR_NOT_FOUND, |call| call()), None),
                None,
            );
            match (outcome, call) {
                (Some(PoolOutcome::Called(result)), _) => result,
                // A launch is never given back (no `give_back` above): refused either way.
                (Some(PoolOutcome::Refused | PoolOutcome::GivenBack), _) => CUDA_ERROR_OUT_OF_MEMORY,
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

macro_rules! launch_like {
    ($name:ident, $field:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(hGraphExec: CUgraphExec, hStream: CUstream) -> CUresult {
            let driver = driver_or_return!();
            let real = real_or_return!(driver, $field);
            // SAFETY: forwards the caller's arguments unchanged.
            launch(hGraphExec, driver, || unsafe { real(hGraphExec, hStream) })
        }
    };
}
launch_like!(cuGraphLaunch, graph_launch);
launch_like!(cuGraphLaunch_ptsz, graph_launch_ptsz);
launch_like!(cuGraphUpload, graph_upload);
launch_like!(cuGraphUpload_ptsz, graph_upload_ptsz);

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
        session.graphs.lock().remove(&(hGraphExec as u64));
    }
    result
}
