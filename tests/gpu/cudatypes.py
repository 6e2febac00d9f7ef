"""The CUDA driver API's structs and constants that the ctypes scripts here share
(raw_driver.py, nvml_truth.py): declarations only, nothing loaded or called at import."""
import ctypes

MIB, GIB = 1 << 20, 1 << 30
c_size, c_u64, c_int, c_uint, c_void_p = ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p

OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
RELEASE_THRESHOLD, RESERVED_MEM_CURRENT = 4, 5  # CUmemPool_attribute


class Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", c_int), ("id", c_int)]


class AllocFlags(ctypes.Structure):  # CUmemAllocationProp's allocFlags
    _fields_ = [("compression", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", c_int), ("handle_types", c_int), ("location", Location), ("win32", c_void_p), ("flags", AllocFlags)]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", c_int)]


class ArrayDescriptor(ctypes.Structure):  # CUDA_ARRAY_DESCRIPTOR
    _fields_ = [("width", c_size), ("height", c_size), ("format", c_int), ("channels", c_uint)]


class ArrayRequirements(ctypes.Structure):  # CUDA_ARRAY_MEMORY_REQUIREMENTS
    _fields_ = [("size", c_size), ("alignment", c_size), ("reserved", c_uint * 4)]


class PoolProps(ctypes.Structure):  # CUmemPoolProps
    _fields_ = [
        ("alloc_type", c_int), ("handle_types", c_int), ("location", Location), ("win32", c_void_p),
        ("max_size", c_size), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 54),
    ]


class MemAllocNodeParams(ctypes.Structure):  # CUDA_MEM_ALLOC_NODE_PARAMS
    _fields_ = [("pool", PoolProps), ("access", ctypes.POINTER(AccessDesc)), ("access_count", c_size), ("bytesize", c_size), ("dptr", c_u64)]


class IpcMemHandle(ctypes.Structure):  # CUipcMemHandle: 64 bytes, passed by value to cuIpcOpenMemHandle
    _fields_ = [("reserved", ctypes.c_char * 64)]
