//! The fake's graphs and graph memory (state in [`GraphState`], part of the process's
//! [`crate::resources::Resources`]; the pools' memory is charged to the device as the
//! `resources` part of the process's footprint, see [`crate::driver`]).
//!
//! **Graphs**: `cuGraphCreate`, `cuGraphAddMemAllocNode` (device-located pinned pools only; the
//! node's `dptr` is written), child graph nodes, `cuGraphClone`, `cuGraphGetNodes`,
//! `cuGraphNodeGetType`, `cuGraphMemAllocNodeGetParams`, `cuGraphChildGraphNodeGetGraph`,
//! `cuGraphDestroy`. As on the real driver (measured: H100, driver 580.159), a graph holding
//! allocation or free nodes cannot be cloned (`cuGraphClone`) or cloned into a child graph node
//! (`cuGraphAddChildGraphNode`, or `cuGraphAddNode(_v2)` with
//! `CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE`): `CUDA_ERROR_NOT_SUPPORTED`. It can be *moved* into
//! one (`cuGraphAddNode(_v2)` with `CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE`, CUDA 12.9): the node
//! then owns it (it cannot be destroyed, instantiated or made a child again by itself).
//! `cuGraphAddNode(_v2)` adds child graph nodes only (other node types: not supported).
//! **Stream capture**: `cuStreamBeginCapture_v2`, `cuStreamEndCapture`, `cuStreamIsCapturing`
//! (each with its `_ptsz` form): while a stream is being captured, `cuMemAllocAsync` and
//! `cuMemAllocFromPoolAsync` on it add an allocation node to the capture's graph (and return
//! the node's address) and `cuMemFreeAsync` a free node, instead of allocating or freeing, as
//! the driver does; the legacy NULL stream cannot be captured.
//! **Executable graphs**: `cuGraphInstantiate` / `cuGraphInstantiate_v2` (the legacy exports),
//! `cuGraphInstantiateWithFlags`, `cuGraphInstantiateWithParams(_ptsz)`, `cuGraphLaunch(_ptsz)`,
//! `cuGraphUpload(_ptsz)`, `cuGraphExecDestroy`; the pools: `cuDeviceGraphMemTrim`,
//! `cuDeviceGetGraphMemAttribute`.
//!
//! Each device has one graph memory pool. A launch (or an upload, or an instantiation with
//! `CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD`) needs, on each device, the bytes of its graph's
//! allocation nodes, child graphs' included (each rounded up to 2 MiB): the pool grows to
//! cover them (charged to the device; over what the device has, the call fails with
//! `CUDA_ERROR_OUT_OF_MEMORY` and does nothing). Work is synchronous and every allocation is
//! taken to be freed inside its graph (as with a matching free node), so after a launch the
//! memory is back in the pool: reserved, unused, until `cuDeviceGraphMemTrim` gives it back.
//! Allocations that outlive their graph's launch are not modelled.

// CUDA's names and parameter names; the Safety section of `crate::exports` covers these too.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_uint, c_void};

use cuda_abi::*;

use crate::api::Api;
use crate::driver::{call, call_out, out, Driver, PAGE};
use crate::exports::exports_sharing_body;
use crate::resources::RESOURCE_BASE;

type R<T> = Result<T, CUresult>;

/// Device addresses handed to graph allocation nodes.
const GRAPH_VA_BASE: u64 = 0x7f00_0000_0000;
/// The handles of the legacy and the per-thread default stream (`CU_STREAM_LEGACY`,
/// `CU_STREAM_PER_THREAD`).
const STREAM_LEGACY: u64 = 1;
const STREAM_PER_THREAD: u64 = 2;

#[derive(Debug, Clone, Copy)]
enum Node {
    Alloc { dev: usize, bytesize: usize, dptr: u64 },
    Free,
    /// A child graph node: the node owns its copy of the graph.
    Child { graph: u64 },
}

/// The graph memory pool of one device.
#[derive(Debug, Clone, Copy, Default)]
struct GraphPool {
    reserved: u64,
    reserved_high: u64,
}

/// This process's graphs, nodes, executable graphs, captures and graph pools.
#[derive(Debug, Default)]
pub struct GraphState {
    /// Graph → its nodes, in the order they were added.
    graphs: HashMap<u64, Vec<u64>>,
    nodes: HashMap<u64, Node>,
    /// Executable graph → bytes it needs per device.
    execs: HashMap<u64, Vec<(usize, u64)>>,
    pools: HashMap<usize, GraphPool>,
    /// Stream being captured → the graph it records into.
    captures: HashMap<u64, u64>,
    /// Graphs moved into a child graph node (owned by the node).
    moved: HashSet<u64>,
}

fn state(d: &mut Driver) -> &mut GraphState {
    &mut d.resources.graphs
}

fn new_graph(d: &mut Driver) -> u64 {
    let h = d.resources.handle();
    state(d).graphs.insert(h, Vec::new());
    h
}

fn add_node(d: &mut Driver, graph: u64, node: impl FnOnce(u64) -> Node) -> R<u64> {
    if !state(d).graphs.contains_key(&graph) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let h = d.resources.handle();
    let s = state(d);
    s.nodes.insert(h, node(h));
    s.graphs.entry(graph).or_default().push(h);
    Ok(h)
}

/// Adds an allocation node of `bytesize` bytes on `dev` to `graph`: (node, its address).
fn add_alloc(d: &mut Driver, graph: u64, dev: usize, bytesize: usize) -> R<(u64, u64)> {
    if bytesize == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let node = add_node(d, graph, |h| Node::Alloc { dev, bytesize, dptr: GRAPH_VA_BASE + (h - RESOURCE_BASE) * 0x1000 })?;
    match state(d).nodes.get(&node) {
        Some(Node::Alloc { dptr, .. }) => Ok((node, *dptr)),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Whether `graph` (or a graph in it) holds allocation or free nodes.
fn has_memory_nodes(s: &GraphState, graph: u64) -> bool {
    s.graphs.get(&graph).into_iter().flatten().any(|node| match s.nodes.get(node) {
        Some(Node::Alloc { .. } | Node::Free) => true,
        Some(Node::Child { graph }) => has_memory_nodes(s, *graph),
        None => false,
    })
}

/// A graph the application may use by itself (not one moved into a node).
fn own_graph(d: &mut Driver, graph: u64) -> R<u64> {
    let s = state(d);
    if !s.graphs.contains_key(&graph) || s.moved.contains(&graph) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(graph)
}

/// A deep copy of `graph` (child graphs copied too); not of one with memory nodes, as the
/// driver.
fn clone_graph(d: &mut Driver, graph: u64) -> R<u64> {
    if has_memory_nodes(state(d), graph) {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let nodes = state(d).graphs.get(&graph).cloned().ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let copy = new_graph(d);
    for node in nodes {
        let node = state(d).nodes.get(&node).copied().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let node = match node {
            Node::Child { graph } => Node::Child { graph: clone_graph(d, graph)? },
            other => other,
        };
        add_node(d, copy, |_| node)?;
    }
    Ok(copy)
}

fn destroy_graph(d: &mut Driver, graph: u64) -> R<()> {
    state(d).moved.remove(&graph);
    let nodes = state(d).graphs.remove(&graph).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    for node in nodes {
        if let Some(Node::Child { graph }) = state(d).nodes.remove(&node) {
            destroy_graph(d, graph)?;
        }
    }
    Ok(())
}

/// Bytes `graph` allocates per device, child graphs included (each allocation in whole pages).
fn needs(s: &GraphState, graph: u64, total: &mut Vec<(usize, u64)>) -> R<()> {
    for node in s.graphs.get(&graph).ok_or(CUDA_ERROR_INVALID_VALUE)? {
        match s.nodes.get(node) {
            Some(Node::Alloc { dev, bytesize, .. }) => {
                let bytes = (*bytesize as u64).checked_next_multiple_of(PAGE).ok_or(CUDA_ERROR_INVALID_VALUE)?;
                match total.iter_mut().find(|(d, _)| d == dev) {
                    Some((_, t)) => *t = t.checked_add(bytes).ok_or(CUDA_ERROR_INVALID_VALUE)?,
                    None => total.push((*dev, bytes)),
                }
            }
            Some(Node::Child { graph }) => needs(s, *graph, total)?,
            _ => {}
        }
    }
    Ok(())
}

// ---- graphs ---------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuGraphCreate(phGraph: *mut CUgraph, flags: c_uint) -> CUresult {
    let create = |d: &mut Driver| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(new_graph(d) as CUgraph)
    };
    // SAFETY: the caller passes NULL or a valid CUgraph pointer.
    unsafe { call_out(Api::GraphCreate, phGraph, create) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphAddMemAllocNode(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    dependencies: *const CUgraphNode,
    numDependencies: usize,
    nodeParams: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    let add = |d: &mut Driver| {
        if numDependencies != 0 && dependencies.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes NULL or a valid parameter struct, which the driver writes.
        let params = unsafe { nodeParams.as_mut() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let props = params.pool_props;
        if props.alloc_type != CU_MEM_ALLOCATION_TYPE_PINNED || props.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = d.dev_index(props.location.id)?;
        let (node, dptr) = add_alloc(d, hGraph as u64, dev, params.bytesize)?;
        params.dptr = dptr;
        Ok(node as CUgraphNode)
    };
    // SAFETY: the caller passes NULL or a valid CUgraphNode pointer.
    unsafe { call_out(Api::GraphAddMemAllocNode, phGraphNode, add) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphAddChildGraphNode(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    dependencies: *const CUgraphNode,
    numDependencies: usize,
    childGraph: CUgraph,
) -> CUresult {
    let add = |d: &mut Driver| {
        if numDependencies != 0 && dependencies.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        add_child(d, hGraph as u64, childGraph as u64, CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE)
    };
    // SAFETY: the caller passes NULL or a valid CUgraphNode pointer.
    unsafe { call_out(Api::GraphAddChildGraphNode, phGraphNode, add) }
}

/// Adds a child graph node holding `child` to `graph`: a copy of it, or (`MOVE`) itself.
fn add_child(d: &mut Driver, graph: u64, child: u64, ownership: c_int) -> R<CUgraphNode> {
    own_graph(d, graph)?;
    let child = match ownership {
        CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE => {
            let child = own_graph(d, child)?;
            clone_graph(d, child)?
        }
        CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE if child != graph && !state(d).captures.values().any(|&g| g == child) => {
            own_graph(d, child)?
        }
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    let node = add_node(d, graph, |_| Node::Child { graph: child })?;
    if ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE {
        state(d).moved.insert(child);
    }
    Ok(node as CUgraphNode)
}

/// The shared body of `cuGraphAddNode` and `cuGraphAddNode_v2`: child graph nodes only.
///
/// # Safety
/// `params` must be NULL or a valid `CUgraphNodeParams`; `ph` NULL or valid for a write.
unsafe fn add_node_with_params(api: Api, ph: *mut CUgraphNode, graph: CUgraph, deps: *const CUgraphNode, n: usize, params: *mut CUgraphNodeParams) -> CUresult {
    let add = |d: &mut Driver| {
        if n != 0 && deps.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: NULL or the caller's valid parameters, per this function's contract.
        let params = unsafe { params.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if params.type_ != CU_GRAPH_NODE_TYPE_GRAPH {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        // SAFETY: for a child graph node the union holds CUDA_CHILD_GRAPH_NODE_PARAMS, which
        // fits in its 232 bytes and is 8-aligned like them.
        let child = unsafe { *params.params.as_ptr().cast::<CUDA_CHILD_GRAPH_NODE_PARAMS>() };
        add_child(d, graph as u64, child.graph as u64, child.ownership)
    };
    // SAFETY: per this function's contract.
    unsafe { call_out(api, ph, add) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphAddNode(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    dependencies: *const CUgraphNode,
    numDependencies: usize,
    nodeParams: *mut CUgraphNodeParams,
) -> CUresult {
    // SAFETY: the caller's arguments, per the C contract.
    unsafe { add_node_with_params(Api::GraphAddNode, phGraphNode, hGraph, dependencies, numDependencies, nodeParams) }
}

/// As `cuGraphAddNode`; the edge data (NULL: default edges) is not modelled.
#[no_mangle]
pub unsafe extern "C" fn cuGraphAddNode_v2(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    dependencies: *const CUgraphNode,
    dependencyData: *const c_void,
    numDependencies: usize,
    nodeParams: *mut CUgraphNodeParams,
) -> CUresult {
    let _ = dependencyData;
    // SAFETY: the caller's arguments, per the C contract.
    unsafe { add_node_with_params(Api::GraphAddNodeV2, phGraphNode, hGraph, dependencies, numDependencies, nodeParams) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphClone(phGraphClone: *mut CUgraph, originalGraph: CUgraph) -> CUresult {
    let clone = |d: &mut Driver| {
        let original = own_graph(d, originalGraph as u64)?;
        Ok(clone_graph(d, original)? as CUgraph)
    };
    // SAFETY: the caller passes NULL or a valid CUgraph pointer.
    unsafe { call_out(Api::GraphClone, phGraphClone, clone) }
}

/// `nodes` NULL: the count in `*numNodes`; else up to `*numNodes` nodes, the rest of the array
/// NULL and `*numNodes` lowered to the count when it was higher.
#[no_mangle]
pub unsafe extern "C" fn cuGraphGetNodes(hGraph: CUgraph, nodes: *mut CUgraphNode, numNodes: *mut usize) -> CUresult {
    call(Api::GraphGetNodes, |d| {
        let list = state(d).graphs.get(&(hGraph as u64)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if numNodes.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if nodes.is_null() {
            // SAFETY: non-null, a valid size_t pointer per the C contract.
            return unsafe { out(numNodes, list.len()) };
        }
        // SAFETY: non-null, a valid size_t pointer per the C contract.
        let room = unsafe { *numNodes };
        for i in 0..room {
            let node = list.get(i).map_or(std::ptr::null_mut(), |&n| n as CUgraphNode);
            // SAFETY: the caller's array has room for `room` handles.
            unsafe { nodes.add(i).write(node) };
        }
        // SAFETY: as above.
        unsafe { out(numNodes, room.min(list.len())) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphNodeGetType(hNode: CUgraphNode, type_: *mut c_int) -> CUresult {
    let get = |d: &mut Driver| match state(d).nodes.get(&(hNode as u64)).ok_or(CUDA_ERROR_INVALID_VALUE)? {
        Node::Alloc { .. } => Ok(CU_GRAPH_NODE_TYPE_MEM_ALLOC),
        Node::Free => Ok(CU_GRAPH_NODE_TYPE_MEM_FREE),
        Node::Child { .. } => Ok(CU_GRAPH_NODE_TYPE_GRAPH),
    };
    // SAFETY: the caller passes NULL or a valid CUgraphNodeType pointer.
    unsafe { call_out(Api::GraphNodeGetType, type_, get) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphMemAllocNodeGetParams(hNode: CUgraphNode, params_out: *mut CUDA_MEM_ALLOC_NODE_PARAMS) -> CUresult {
    let get = |d: &mut Driver| match state(d).nodes.get(&(hNode as u64)) {
        Some(&Node::Alloc { dev, bytesize, dptr }) => Ok(CUDA_MEM_ALLOC_NODE_PARAMS {
            pool_props: CUmemPoolProps {
                alloc_type: CU_MEM_ALLOCATION_TYPE_PINNED,
                handle_types: 0,
                location: CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: dev as c_int },
                win32_security_attributes: std::ptr::null_mut(),
                max_size: 0,
                usage: 0,
                reserved: [0; 54],
            },
            access_descs: std::ptr::null(),
            access_desc_count: 0,
            bytesize,
            dptr,
        }),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    };
    // SAFETY: the caller passes NULL or a valid parameter struct pointer.
    unsafe { call_out(Api::GraphMemAllocNodeGetParams, params_out, get) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphChildGraphNodeGetGraph(hNode: CUgraphNode, phGraph: *mut CUgraph) -> CUresult {
    let get = |d: &mut Driver| match state(d).nodes.get(&(hNode as u64)) {
        Some(&Node::Child { graph }) => Ok(graph as CUgraph),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    };
    // SAFETY: the caller passes NULL or a valid CUgraph pointer.
    unsafe { call_out(Api::GraphChildGraphNodeGetGraph, phGraph, get) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphDestroy(hGraph: CUgraph) -> CUresult {
    call(Api::GraphDestroy, |d| {
        let graph = own_graph(d, hGraph as u64)?;
        destroy_graph(d, graph)
    })
}

// ---- stream capture -------------------------------------------------------------------------------

/// The key of a stream's capture: its handle, or the per-thread stream's for the default
/// stream of a `_ptsz` call; the legacy stream cannot be captured.
fn capture_key(d: &Driver, stream: CUstream, ptsz: bool) -> R<u64> {
    crate::streams::stream_dev(d, stream)?;
    match stream as u64 {
        0 if ptsz => Ok(STREAM_PER_THREAD),
        0 | STREAM_LEGACY => Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        s => Ok(s),
    }
}

/// The graph `stream` is being captured into, if it is.
fn capture_of(d: &Driver, stream: CUstream, ptsz: bool) -> Option<u64> {
    let key = capture_key(d, stream, ptsz).ok()?;
    d.resources.graphs.captures.get(&key).copied()
}

/// For `cuMemAllocAsync` / `cuMemAllocFromPoolAsync` on `stream`: while it is captured, an
/// allocation node of `bytes` on device `dev` (asked only then) in its graph, and the node's
/// address.
pub(crate) fn capture_alloc(
    d: &mut Driver,
    stream: CUstream,
    ptsz: bool,
    dev: impl FnOnce(&Driver) -> R<usize>,
    bytes: u64,
) -> Option<R<u64>> {
    let graph = capture_of(d, stream, ptsz)?;
    let node = || {
        let (dev, bytesize) = (dev(d)?, usize::try_from(bytes).map_err(|_| CUDA_ERROR_INVALID_VALUE)?);
        add_alloc(d, graph, dev, bytesize).map(|(_, dptr)| dptr)
    };
    Some(node())
}

/// For `cuMemFreeAsync` on `stream`: while it is captured, a free node in its graph.
pub(crate) fn capture_free(d: &mut Driver, stream: CUstream, ptsz: bool) -> Option<R<()>> {
    let graph = capture_of(d, stream, ptsz)?;
    Some(add_node(d, graph, |_| Node::Free).map(|_| ()))
}

exports_sharing_body! {
    cuStreamBeginCapture_v2 = StreamBeginCaptureV2,
    cuStreamBeginCapture_v2_ptsz = StreamBeginCaptureV2Ptsz;
    fn(hStream: CUstream, mode: c_int) |api| {
        call(api, |d| {
            if !(CU_STREAM_CAPTURE_MODE_GLOBAL..=CU_STREAM_CAPTURE_MODE_RELAXED).contains(&mode) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let key = capture_key(d, hStream, api == Api::StreamBeginCaptureV2Ptsz)?;
            if state(d).captures.contains_key(&key) {
                return Err(CUDA_ERROR_ILLEGAL_STATE);
            }
            let graph = new_graph(d);
            state(d).captures.insert(key, graph);
            Ok(())
        })
    }
}

exports_sharing_body! {
    cuStreamEndCapture = StreamEndCapture,
    cuStreamEndCapture_ptsz = StreamEndCapturePtsz;
    fn(hStream: CUstream, phGraph: *mut CUgraph) |api| {
        let end = |d: &mut Driver| {
            let key = capture_key(d, hStream, api == Api::StreamEndCapturePtsz)?;
            Ok(state(d).captures.remove(&key).ok_or(CUDA_ERROR_ILLEGAL_STATE)? as CUgraph)
        };
        // SAFETY: the caller passes NULL or a valid CUgraph pointer.
        unsafe { call_out(api, phGraph, end) }
    }
}

exports_sharing_body! {
    cuStreamIsCapturing = StreamIsCapturing,
    cuStreamIsCapturing_ptsz = StreamIsCapturingPtsz;
    fn(hStream: CUstream, captureStatus: *mut c_int) |api| {
        let get = |d: &mut Driver| {
            crate::streams::stream_dev(d, hStream)?;
            Ok(match capture_of(d, hStream, api == Api::StreamIsCapturingPtsz) {
                Some(_) => CU_STREAM_CAPTURE_STATUS_ACTIVE,
                None => CU_STREAM_CAPTURE_STATUS_NONE,
            })
        };
        // SAFETY: the caller passes NULL or a valid CUstreamCaptureStatus pointer.
        unsafe { call_out(api, captureStatus, get) }
    }
}

// ---- executable graphs and the graph pools --------------------------------------------------------

/// Instantiates `graph`; with `upload`, grows the pools for it at once (all or nothing).
fn instantiate(d: &mut Driver, graph: u64, upload: bool) -> R<CUgraphExec> {
    let graph = own_graph(d, graph)?;
    let mut total = Vec::new();
    needs(state(d), graph, &mut total)?;
    let h = d.resources.handle();
    state(d).execs.insert(h, total);
    if upload {
        if let Err(e) = launch(d, h) {
            state(d).execs.remove(&h);
            return Err(e);
        }
    }
    Ok(h as CUgraphExec)
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(phGraphExec: *mut CUgraphExec, hGraph: CUgraph, flags: u64) -> CUresult {
    let instantiate = |d: &mut Driver| if flags != 0 { Err(CUDA_ERROR_INVALID_VALUE) } else { instantiate(d, hGraph as u64, false) };
    // SAFETY: the caller passes NULL or a valid CUgraphExec pointer.
    unsafe { call_out(Api::GraphInstantiateWithFlags, phGraphExec, instantiate) }
}

exports_sharing_body! {
    /// The legacy form `cuGraphInstantiate` stood for before CUDA 12: nothing fails in the
    /// fake's graphs, so the error node and log are left as they are.
    cuGraphInstantiate = GraphInstantiate,
    cuGraphInstantiate_v2 = GraphInstantiateV2;
    fn(phGraphExec: *mut CUgraphExec, hGraph: CUgraph, phErrorNode: *mut CUgraphNode, logBuffer: *mut c_char, bufferSize: usize) |api| {
        let _ = (phErrorNode, logBuffer, bufferSize);
        // SAFETY: the caller passes NULL or a valid CUgraphExec pointer.
        unsafe { call_out(api, phGraphExec, |d| instantiate(d, hGraph as u64, false)) }
    }
}

exports_sharing_body! {
    cuGraphInstantiateWithParams = GraphInstantiateWithParams,
    cuGraphInstantiateWithParams_ptsz = GraphInstantiateWithParamsPtsz;
    fn(phGraphExec: *mut CUgraphExec, hGraph: CUgraph, instantiateParams: *mut CUDA_GRAPH_INSTANTIATE_PARAMS) |api| {
        let instantiate = |d: &mut Driver| {
            // SAFETY: the caller passes NULL or a valid parameter struct, which the driver writes.
            let params = unsafe { instantiateParams.as_mut() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if params.flags & !CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let exec = instantiate(d, hGraph as u64, params.flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0);
            params.h_err_node_out = std::ptr::null_mut();
            params.result_out = if exec.is_ok() { 0 } else { 1 };
            exec
        };
        // SAFETY: the caller passes NULL or a valid CUgraphExec pointer.
        unsafe { call_out(api, phGraphExec, instantiate) }
    }
}

/// Grows each device's graph pool to cover what `exec` allocates (all or nothing).
fn launch(d: &mut Driver, exec: u64) -> R<()> {
    d.current()?;
    let needs = state(d).execs.get(&exec).cloned().ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let mut grown: Vec<(usize, u64)> = Vec::new();
    for (dev, bytes) in needs {
        let pool = state(d).pools.get(&dev).copied().unwrap_or_default();
        let growth = bytes.saturating_sub(pool.reserved);
        if let Err(e) = d.recharge_resources(dev, growth, 0) {
            for &(dev, growth) in &grown {
                let _ = d.recharge_resources(dev, 0, growth);
                if let Some(pool) = state(d).pools.get_mut(&dev) {
                    pool.reserved -= growth;
                }
            }
            return Err(e);
        }
        let pool = state(d).pools.entry(dev).or_default();
        pool.reserved += growth;
        pool.reserved_high = pool.reserved_high.max(pool.reserved);
        grown.push((dev, growth));
    }
    Ok(())
}

exports_sharing_body! {
    cuGraphLaunch = GraphLaunch,
    cuGraphLaunch_ptsz = GraphLaunchPtsz,
    /// Takes the graph's memory as a launch does (the fake's launches do no other work).
    cuGraphUpload = GraphUpload,
    cuGraphUpload_ptsz = GraphUploadPtsz;
    fn(hGraphExec: CUgraphExec, hStream: CUstream) |api| {
        let _ = hStream;
        call(api, |d| launch(d, hGraphExec as u64))
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGraphMemTrim(device: CUdevice) -> CUresult {
    call(Api::DeviceGraphMemTrim, |d| {
        let dev = d.dev_index(device)?;
        // Nothing is in use between launches: all of the reserve goes back.
        let reserved = state(d).pools.get(&dev).map_or(0, |p| p.reserved);
        d.recharge_resources(dev, 0, reserved)?;
        if let Some(pool) = state(d).pools.get_mut(&dev) {
            pool.reserved = 0;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetGraphMemAttribute(device: CUdevice, attr: c_int, value: *mut c_void) -> CUresult {
    let get = |d: &mut Driver| {
        let dev = d.dev_index(device)?;
        let pool = state(d).pools.get(&dev).copied().unwrap_or_default();
        match attr {
            // Used: nothing outlives a launch (see the module docs).
            CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT | 1 => Ok(0u64),
            CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT => Ok(pool.reserved),
            3 => Ok(pool.reserved_high),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    };
    // SAFETY: for these attributes the caller passes NULL or a valid cuuint64_t pointer.
    unsafe { call_out(Api::DeviceGetGraphMemAttribute, value.cast::<u64>(), get) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphExecDestroy(hGraphExec: CUgraphExec) -> CUresult {
    call(Api::GraphExecDestroy, |d| state(d).execs.remove(&(hGraphExec as u64)).map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE))
}
