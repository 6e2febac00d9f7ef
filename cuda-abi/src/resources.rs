//! The driver API's other holders of device memory, as `cuda.h` (CUDA 12/13) declares them:
//! CUDA arrays and mipmapped arrays, graph memory nodes (and what reads a graph's nodes:
//! node types, instantiation parameters, stream capture), context creation with execution
//! affinity (`cuCtxCreate_v3`), the host locations of VMM allocations and external memory
//! (`cuImportExternalMemory`). Fields are in snake
//! case, as in the rest of this crate.
#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_void};

use crate::{CUdeviceptr, CUmemAccessDesc, CUmemPoolProps};

/// `CUarray` (`struct CUarray_st *`).
pub type CUarray = *mut c_void;
/// `CUmipmappedArray` (`struct CUmipmappedArray_st *`).
pub type CUmipmappedArray = *mut c_void;
/// `CUgraph` (`struct CUgraph_st *`).
pub type CUgraph = *mut c_void;
/// `CUgraphNode` (`struct CUgraphNode_st *`).
pub type CUgraphNode = *mut c_void;
/// `CUgraphExec` (`struct CUgraphExec_st *`).
pub type CUgraphExec = *mut c_void;
/// `CUexternalMemory` (`struct CUextMemory_st *`).
pub type CUexternalMemory = *mut c_void;

/// `CUDA_ARRAY_DESCRIPTOR` (`_v2`: `cuArrayCreate_v2`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    /// `CUarray_format`.
    pub format: c_int,
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (`_v2`: `cuArray3DCreate_v2`, `cuMipmappedArrayCreate`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    /// `CUarray_format`.
    pub format: c_int,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

/// `CUDA_ARRAY_MEMORY_REQUIREMENTS` (`_v1`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY_MEMORY_REQUIREMENTS {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [c_uint; 4],
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (`_v1`, `cuGraphAddMemAllocNode`); the driver writes `dptr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_MEM_ALLOC_NODE_PARAMS {
    pub pool_props: CUmemPoolProps,
    pub access_descs: *const CUmemAccessDesc,
    pub access_desc_count: usize,
    pub bytesize: usize,
    pub dptr: CUdeviceptr,
}

/// The `win32` member of the handle union of [`CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR`].
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUexternalMemoryWin32Handle {
    pub handle: *mut c_void,
    pub name: *const c_void,
}

/// The handle union of [`CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR`]: which member holds the
/// handle depends on the descriptor's `type_`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union CUexternalMemoryHandle {
    pub fd: c_int,
    pub win32: CUexternalMemoryWin32Handle,
    pub nv_sci_buf_object: *const c_void,
}

/// `CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR` (`_v1`, `cuImportExternalMemory`): `size` is the
/// bytes of the imported memory.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR {
    /// `CUexternalMemoryHandleType`.
    pub type_: c_int,
    pub handle: CUexternalMemoryHandle,
    pub size: u64,
    pub flags: c_uint,
    pub reserved: [c_uint; 16],
}

/// Byte offset of `size` in [`CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR`] (the eBPF probe reads
/// it from the caller's memory).
pub const EXTERNAL_MEMORY_SIZE_OFFSET: u64 = std::mem::offset_of!(CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR, size) as u64;

/// `CUDA_EXTERNAL_MEMORY_BUFFER_DESC` (`_v1`, `cuExternalMemoryGetMappedBuffer`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_EXTERNAL_MEMORY_BUFFER_DESC {
    pub offset: u64,
    pub size: u64,
    pub flags: c_uint,
    pub reserved: [c_uint; 16],
}

// CUexternalMemoryHandleType.
pub const CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD: c_int = 1;
pub const CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_WIN32: c_int = 2;
pub const CU_EXTERNAL_MEMORY_HANDLE_TYPE_NVSCIBUF: c_int = 8;

// CUarray_format (the basic formats; the driver knows more).
pub const CU_AD_FORMAT_UNSIGNED_INT8: c_int = 0x01;
pub const CU_AD_FORMAT_UNSIGNED_INT16: c_int = 0x02;
pub const CU_AD_FORMAT_UNSIGNED_INT32: c_int = 0x03;
pub const CU_AD_FORMAT_SIGNED_INT8: c_int = 0x08;
pub const CU_AD_FORMAT_SIGNED_INT16: c_int = 0x09;
pub const CU_AD_FORMAT_SIGNED_INT32: c_int = 0x0a;
pub const CU_AD_FORMAT_HALF: c_int = 0x10;
pub const CU_AD_FORMAT_FLOAT: c_int = 0x20;

/// Bytes of one channel of the basic `CUarray_format`s (`None`: another format).
pub fn array_format_bytes(format: c_int) -> Option<u64> {
    match format {
        CU_AD_FORMAT_UNSIGNED_INT8 | CU_AD_FORMAT_SIGNED_INT8 => Some(1),
        CU_AD_FORMAT_UNSIGNED_INT16 | CU_AD_FORMAT_SIGNED_INT16 | CU_AD_FORMAT_HALF => Some(2),
        CU_AD_FORMAT_UNSIGNED_INT32 | CU_AD_FORMAT_SIGNED_INT32 | CU_AD_FORMAT_FLOAT => Some(4),
        _ => None,
    }
}

// CUmemLocationType: the host locations (memory in the host's RAM, never the GPU's).
pub const CU_MEM_LOCATION_TYPE_HOST: c_int = 2;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA: c_int = 3;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: c_int = 4;

/// `CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD`: instantiation uploads the graph (and so grows the
/// graph memory pool) at once.
pub const CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD: u64 = 2;

/// `CUDA_GRAPH_INSTANTIATE_PARAMS` (`cuGraphInstantiateWithParams`): the driver writes
/// `h_err_node_out` and `result_out`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_GRAPH_INSTANTIATE_PARAMS {
    pub flags: u64,
    pub h_upload_stream: crate::CUstream,
    pub h_err_node_out: CUgraphNode,
    /// `CUgraphInstantiateResult`.
    pub result_out: c_int,
}

/// `CUgraphNodeParams` (`cuGraphAddNode`, `cuGraphAddNode_v2`, 256 bytes): `params` is the
/// union of each node type's parameters, read as the member `type_` names (for
/// `CU_GRAPH_NODE_TYPE_GRAPH`, a [`CUDA_CHILD_GRAPH_NODE_PARAMS`] at its start).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUgraphNodeParams {
    /// `CUgraphNodeType`.
    pub type_: c_int,
    pub reserved0: [c_int; 3],
    pub params: [i64; 29],
    pub reserved2: i64,
}

/// `CUDA_CHILD_GRAPH_NODE_PARAMS`: the child graph member of [`CUgraphNodeParams`].
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_CHILD_GRAPH_NODE_PARAMS {
    pub graph: CUgraph,
    /// `CUgraphChildGraphNodeOwnership`.
    pub ownership: c_int,
}

// CUgraphChildGraphNodeOwnership: CLONE (the default) copies the child graph into the node and
// refuses allocation/free nodes in it; MOVE (CUDA 12.9) hands the graph itself to the node,
// allocation nodes included.
pub const CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE: c_int = 0;
pub const CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE: c_int = 1;

// CUgraphNodeType (the kinds that hold or contain graph memory).
pub const CU_GRAPH_NODE_TYPE_GRAPH: c_int = 4;
pub const CU_GRAPH_NODE_TYPE_EMPTY: c_int = 5;
pub const CU_GRAPH_NODE_TYPE_MEM_ALLOC: c_int = 10;
pub const CU_GRAPH_NODE_TYPE_MEM_FREE: c_int = 11;

// CUstreamCaptureMode and CUstreamCaptureStatus.
pub const CU_STREAM_CAPTURE_MODE_GLOBAL: c_int = 0;
pub const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: c_int = 1;
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: c_int = 1;
pub const CU_STREAM_CAPTURE_STATUS_INVALIDATED: c_int = 2;

// CUresult values of stream capture.
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: crate::CUresult = 900;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: crate::CUresult = 901;
pub const CUDA_ERROR_ILLEGAL_STATE: crate::CUresult = 401;

// CUgraphMem_attribute (values are `cuuint64_t`).
pub const CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT: c_int = 0;
pub const CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: c_int = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_cuda_h() {
        assert_eq!(size_of::<CUDA_ARRAY_DESCRIPTOR>(), 24);
        assert_eq!(size_of::<CUDA_ARRAY3D_DESCRIPTOR>(), 40);
        assert_eq!(offset_of!(CUDA_ARRAY3D_DESCRIPTOR, flags), 32);
        assert_eq!(size_of::<CUDA_ARRAY_MEMORY_REQUIREMENTS>(), 32);
        assert_eq!(size_of::<CUmemPoolProps>(), 88);
        assert_eq!(offset_of!(CUmemPoolProps, max_size), 24);
        assert_eq!(size_of::<CUDA_MEM_ALLOC_NODE_PARAMS>(), 120);
        assert_eq!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, bytesize), 104);
        assert_eq!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, dptr), 112);
        assert_eq!(size_of::<CUDA_GRAPH_INSTANTIATE_PARAMS>(), 32);
        assert_eq!(size_of::<CUgraphNodeParams>(), 256);
        assert_eq!(offset_of!(CUgraphNodeParams, params), 16);
        assert_eq!(size_of::<CUDA_CHILD_GRAPH_NODE_PARAMS>(), 16);
        assert_eq!(offset_of!(CUDA_GRAPH_INSTANTIATE_PARAMS, result_out), 24);
        assert_eq!(size_of::<CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR>(), 104);
        assert_eq!(offset_of!(CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR, handle), 8);
        assert_eq!(size_of::<CUexternalMemoryHandle>(), 16);
        assert_eq!(offset_of!(CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR, size), 24);
        assert_eq!(EXTERNAL_MEMORY_SIZE_OFFSET, 24);
        assert_eq!(offset_of!(CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR, flags), 32);
        assert_eq!(offset_of!(CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR, reserved), 36);
        assert_eq!(size_of::<CUDA_EXTERNAL_MEMORY_BUFFER_DESC>(), 88);
        assert_eq!(offset_of!(CUDA_EXTERNAL_MEMORY_BUFFER_DESC, flags), 16);
    }
}
