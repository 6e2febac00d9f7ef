"""Graph memory under libvramguard.so on the real driver (ctypes on libcuda, no framework).

Graphs whose allocation nodes come from stream capture of cuMemAllocAsync, directly or inside a
child graph node (cuGraphAddNode_v2 moving the graph into the node, CUDA 12.9 drivers on), and
a clone (which drivers refuse for graphs with allocation nodes; recorded): a launch that would grow the graph
pool past the quota must fail with CUDA_ERROR_OUT_OF_MEMORY before the driver runs it (the
pool's reserved memory does not move), one that fits must run, and cuDeviceGraphMemTrim must
give the pool back. Without the hook (`--control`), the big launch must run.

Prints one JSON line; exit status 0 when every check held. Run with LD_PRELOAD,
CUDA_DEVICE_MEMORY_LIMIT=LIMIT and VRAMGUARD_LEDGER set (see run.sh): hook_graphs.py LIMIT.
"""
import ctypes
import json
import sys

limit = int(sys.argv[1])
control = "--control" in sys.argv
cu = ctypes.CDLL("libcuda.so.1")
P = ctypes.c_void_p
GIB = 1 << 30
RESERVED_MEM_CURRENT = 2  # CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT
result = {"limit": limit, "control": control, "calls": {}}


def call(name, *args):
    rc = getattr(cu, name)(*args)
    result["calls"].setdefault(name, []).append(rc)
    return rc


def must(name, *args):
    rc = call(name, *args)
    if rc != 0:
        raise SystemExit(json.dumps({**result, "fatal": f"{name} -> {rc}"}))


def reserved():
    value = ctypes.c_uint64()
    must("cuDeviceGetGraphMemAttribute", 0, RESERVED_MEM_CURRENT, ctypes.byref(value))
    return value.value


def captured(size):
    stream, graph, dptr = P(), P(), ctypes.c_uint64()
    must("cuStreamCreate", ctypes.byref(stream), 1)
    must("cuStreamBeginCapture_v2", stream, 0)
    must("cuMemAllocAsync", ctypes.byref(dptr), ctypes.c_size_t(size), stream)
    must("cuMemFreeAsync", dptr, stream)
    must("cuStreamEndCapture", stream, ctypes.byref(graph))
    must("cuStreamDestroy_v2", stream)
    return graph


def instantiate(graph):
    exec_ = P()
    must("cuGraphInstantiateWithFlags", ctypes.byref(exec_), graph, ctypes.c_uint64(0))
    return exec_


def launch(exec_):
    rc = call("cuGraphLaunch", exec_, P(0))
    if rc == 0:
        must("cuCtxSynchronize")
    return rc


must("cuInit", 0)
ctx = P()
must("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
must("cuCtxSetCurrent", ctx)
checks = {}
small, big = GIB, limit + GIB
g = captured(small)
h = captured(big)  # capturing takes no memory: never refused
clone = P()
clone_rc = call("cuGraphClone", ctypes.byref(clone), h)
result["clone_with_alloc_node"] = clone_rc
class NodeParams(ctypes.Structure):  # CUgraphNodeParams with its CUDA_CHILD_GRAPH_NODE_PARAMS member
    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3), ("graph", P), ("ownership", ctypes.c_int),
                ("pad", ctypes.c_int), ("rest", ctypes.c_int64 * 28)]


parent, node = P(), P()
must("cuGraphCreate", ctypes.byref(parent), 0)
moved = NodeParams(type=4, graph=captured(big), ownership=1)  # CU_GRAPH_NODE_TYPE_GRAPH, OWNERSHIP_MOVE
child_rc = call("cuGraphAddNode_v2", ctypes.byref(node), parent, None, None, ctypes.c_size_t(0), ctypes.byref(moved))
result["child_graph_with_alloc_node"] = child_rc
execs = {"captured": instantiate(h)}
if clone_rc == 0:
    execs["clone"] = instantiate(clone)
if child_rc == 0:
    execs["child"] = instantiate(parent)
small_exec = instantiate(g)
before = reserved()
for what, exec_ in execs.items():
    rc = launch(exec_)
    result[f"launch_{what}_over_quota"] = rc
    if control:
        checks[f"{what}_ran_without_hook"] = rc == 0
        must("cuDeviceGraphMemTrim", 0)
    else:
        checks[f"{what}_refused"] = rc == 2
        checks[f"{what}_pool_unchanged"] = reserved() == before
if not control:
    checks["fits_runs"] = launch(small_exec) == 0
    result["reserved_after_launch"] = reserved()
    checks["pool_holds_it"] = reserved() >= small
    must("cuDeviceGraphMemTrim", 0)
    result["reserved_after_trim"] = reserved()
    checks["trim_gives_it_back"] = reserved() == 0
result["checks"] = checks
print(json.dumps(result))
sys.exit(0 if all(checks.values()) else 1)
