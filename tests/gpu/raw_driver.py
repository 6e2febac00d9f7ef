"""A raw driver program (ctypes on libcuda, no framework) through the allocation paths of
issue 11, on a real GPU. One JSON line per step, then a summary; exit status 0 when every
check held.

  raw_driver.py facts     no hook: what the real driver takes (cuMemGetInfo_v2 deltas) for a
                          second context, a CUDA array (and what cuArrayGetMemoryRequirements
                          says), a graph memory node at launch, a VMM handle mapped/released
  raw_driver.py hooked    under libvramguard.so with CUDA_DEVICE_MEMORY_LIMIT=QUOTA (run.sh
                          sets it to the context reserve + 1 GiB + 64 MiB): six 1 GiB VMM
                          handles created, mapped and released, still mapped: the first fits,
                          the rest are refused; unmapping frees; an array, a second context
                          and a graph memory node are charged (the quota as cuMemGetInfo shows
                          it moves) and refused past the quota; everything given back.
"""
import ctypes
import json
import os
import sys

from cudatypes import (
    GIB, MIB, OOM, AccessDesc, AllocationProp, ArrayDescriptor, ArrayRequirements, Location, MemAllocNodeParams, PoolProps,
    c_int, c_size, c_u64, c_uint, c_void_p,
)

cu = ctypes.CDLL("libcuda.so.1")
failures = []


def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what}: CUDA error {rc}")


def expect(name, ok, **detail):
    print(json.dumps({"check": name, "ok": bool(ok), **detail}), flush=True)
    if not ok:
        failures.append(name)


def free_bytes():
    free, total = c_size(), c_size()
    check(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
    return free.value, total.value


check(cu.cuInit(0), "cuInit")
dev = c_int()
check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
primary = c_void_p()
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev), "cuDevicePrimaryCtxRetain")
check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
prop = AllocationProp(type=1, location=Location(type=1, id=dev.value))
access = AccessDesc(location=Location(type=1, id=dev.value), flags=3)


def vmm(size):
    """cuMemCreate + reserve + map + set access; (rc of the create, handle, va)."""
    handle = c_u64()
    rc = cu.cuMemCreate(ctypes.byref(handle), c_size(size), ctypes.byref(prop), c_u64(0))
    if rc != 0:
        return rc, None, None
    va = c_u64()
    check(cu.cuMemAddressReserve(ctypes.byref(va), c_size(size), c_size(0), c_u64(0), c_u64(0)), "cuMemAddressReserve")
    check(cu.cuMemMap(c_u64(va.value), c_size(size), c_size(0), c_u64(handle.value), c_u64(0)), "cuMemMap")
    check(cu.cuMemSetAccess(c_u64(va.value), c_size(size), ctypes.byref(access), c_size(1)), "cuMemSetAccess")
    return 0, handle.value, va.value


def unmap(va, size):
    check(cu.cuMemUnmap(c_u64(va), c_size(size)), "cuMemUnmap")
    check(cu.cuMemAddressFree(c_u64(va), c_size(size)), "cuMemAddressFree")


def array(width, height):
    """A float x 4 array; (rc, handle)."""
    handle = c_void_p()
    desc = ArrayDescriptor(width=width, height=height, format=0x20, channels=4)
    return cu.cuArrayCreate_v2(ctypes.byref(handle), ctypes.byref(desc)), handle


def graph(size):
    """A graph with one allocation node and its free node, instantiated; (exec, graph)."""
    g = c_void_p()
    check(cu.cuGraphCreate(ctypes.byref(g), c_uint(0)), "cuGraphCreate")
    params = MemAllocNodeParams(
        pool=PoolProps(alloc_type=1, location=Location(type=1, id=dev.value)), access=ctypes.pointer(access), access_count=1, bytesize=size
    )
    node = c_void_p()
    check(cu.cuGraphAddMemAllocNode(ctypes.byref(node), g, None, c_size(0), ctypes.byref(params)), "cuGraphAddMemAllocNode")
    free_node = c_void_p()
    check(cu.cuGraphAddMemFreeNode(ctypes.byref(free_node), g, ctypes.byref(node), c_size(1), c_u64(params.dptr)), "cuGraphAddMemFreeNode")
    exe = c_void_p()
    check(cu.cuGraphInstantiateWithFlags(ctypes.byref(exe), g, c_u64(0)), "cuGraphInstantiateWithFlags")
    return exe, g


def launch(exe):
    rc = cu.cuGraphLaunch(exe, c_void_p(0))
    if rc == 0:
        check(cu.cuStreamSynchronize(c_void_p(0)), "cuStreamSynchronize")
    return rc


def facts():
    base, total = free_bytes()
    print(json.dumps({"fact": "device", "total": total, "free_after_primary_context": base}), flush=True)
    ctx = c_void_p()
    check(cu.cuCtxCreate_v2(ctypes.byref(ctx), c_uint(0), dev), "cuCtxCreate_v2")
    print(json.dumps({"fact": "second context", "takes_mib": (base - free_bytes()[0]) / MIB}), flush=True)
    check(cu.cuCtxDestroy_v2(ctx), "cuCtxDestroy_v2")
    check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    base = free_bytes()[0]
    rc, arr = array(8192, 8192)
    check(rc, "cuArrayCreate_v2")
    req = ArrayRequirements()
    asked = cu.cuArrayGetMemoryRequirements(ctypes.byref(req), arr, dev)
    print(json.dumps({"fact": "8192x8192 float4 array", "takes_mib": (base - free_bytes()[0]) / MIB, "requirements_rc": asked, "requirements_mib": req.size / MIB, "logical_mib": 8192 * 8192 * 16 / MIB}), flush=True)
    check(cu.cuArrayDestroy(arr), "cuArrayDestroy")
    base = free_bytes()[0]
    exe, g = graph(256 * MIB)
    after_instantiate = free_bytes()[0]
    check(launch(exe), "cuGraphLaunch")
    after_launch = free_bytes()[0]
    check(cu.cuDeviceGraphMemTrim(dev), "cuDeviceGraphMemTrim")
    print(json.dumps({"fact": "graph with a 256 MiB allocation node", "instantiate_takes_mib": (base - after_instantiate) / MIB, "launch_takes_mib": (base - after_launch) / MIB, "after_trim_mib": (base - free_bytes()[0]) / MIB}), flush=True)
    base = free_bytes()[0]
    rc, handle, va = vmm(GIB)
    check(rc, "cuMemCreate")
    check(cu.cuMemRelease(c_u64(handle)), "cuMemRelease")
    released = free_bytes()[0]
    unmap(va, GIB)
    print(json.dumps({"fact": "1 GiB VMM handle", "released_but_mapped_mib": (base - released) / MIB, "unmapped_mib": (base - free_bytes()[0]) / MIB}), flush=True)


def hooked():
    quota_total = free_bytes()[1]
    expect("cuMemGetInfo shows the quota", quota_total == int(os.environ["CUDA_DEVICE_MEMORY_LIMIT"]), total=quota_total)
    start = free_bytes()[0]
    held, codes = [], []
    for _ in range(6):
        rc, handle, va = vmm(GIB)
        codes.append(rc)
        if rc == 0:
            check(cu.cuMemRelease(c_u64(handle)), "cuMemRelease")
            held.append(va)
    expect("six 1 GiB VMM handles, released but mapped: the first fits, the rest refused", codes == [0] + [OOM] * 5, codes=codes)
    expect("released but mapped memory stays charged", start - free_bytes()[0] >= GIB, charged_mib=(start - free_bytes()[0]) / MIB)
    for va in held:
        unmap(va, GIB)
    expect("unmapping gives it back", free_bytes()[0] == start, free_mib=free_bytes()[0] / MIB, start_mib=start / MIB)
    rc, arr = array(4096, 4096)
    expect("an array that fits (4096 x 4096 float4, 256 MiB) is created", rc == 0, rc=rc)
    if rc == 0:
        expect("the array is charged", free_bytes()[0] < start, charged_mib=(start - free_bytes()[0]) / MIB)
        check(cu.cuArrayDestroy(arr), "cuArrayDestroy")
        expect("destroying the array gives it back", free_bytes()[0] == start)
    rc, _ = array(16384, 16384)
    expect("an array past the quota (16384 x 16384 float4, 4 GiB) is refused", rc == OOM, rc=rc)
    ctx = c_void_p()
    rc = cu.cuCtxCreate_v2(ctypes.byref(ctx), c_uint(0), dev)
    expect("a second context that fits is created", rc == 0, rc=rc)
    if rc == 0:
        check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
        expect("the second context is charged", free_bytes()[0] < start, charged_mib=(start - free_bytes()[0]) / MIB)
        check(cu.cuCtxDestroy_v2(ctx), "cuCtxDestroy_v2")
        check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
        expect("destroying it gives it back", free_bytes()[0] == start)
    exe, g = graph(256 * MIB)
    rc = launch(exe)
    expect("a graph memory node that fits is launched", rc == 0, rc=rc)
    expect("graph memory is charged once launched", free_bytes()[0] < start, charged_mib=(start - free_bytes()[0]) / MIB)
    check(cu.cuDeviceGraphMemTrim(dev), "cuDeviceGraphMemTrim")
    expect("cuDeviceGraphMemTrim gives it back", free_bytes()[0] == start)
    big, _ = graph(2 * GIB)
    rc = launch(big)
    expect("a graph memory node past the quota is refused at launch", rc == OOM, rc=rc)


if sys.argv[1:] == ["facts"]:
    facts()
elif sys.argv[1:] == ["hooked"]:
    hooked()
else:
    raise SystemExit("usage: raw_driver.py facts|hooked")
print(json.dumps({"summary": "raw driver", "failed": failures}))
sys.exit(1 if failures else 0)
