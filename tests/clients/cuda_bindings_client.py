"""Drives NVIDIA's cuda-bindings (the `cuda.bindings.driver` API) through the allocation
families it exposes, one step per argument, printing one line per step for the e2e test
(tests/e2e/tests/clients.rs) to assert.

Steps: `meminfo`; `alloc SIZE` (cuMemAlloc); `async SIZE` (cuMemAllocAsync on the default
pool); `pool SIZE` (cuMemPoolCreate + cuMemAllocFromPoolAsync, then the pool's attributes
before and after a synchronization with release threshold 0, then the pool destroyed);
`vmm SIZE` (cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess); `managed SIZE`
(cuMemAllocManaged, written and read back by the host); `calls NAME` (how often this process
called the fake driver's export NAME). SIZE takes k/m/g suffixes. Allocations stay held
until the process exits.
"""
import ctypes
import sys

from cuda.bindings import driver as cu

UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def size(text):
    if text[-1] in UNITS:
        return int(text[:-1]) * UNITS[text[-1]]
    return int(text)


def name(err):
    return err.name


def check(result):
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"setup call failed: {name(err)}")
    return result[1] if len(result) == 2 else result[1:]


def main(steps):
    check((cu.cuInit(0)[0], None))
    dev = check(cu.cuDeviceGet(0))
    # cuda-bindings resolves cuCtxCreate at 12050: the fake must hand out cuCtxCreate_v4.
    ctx = check(cu.cuCtxCreate(None, 0, dev))
    print(f"context {int(ctx):#x}", flush=True)
    stream = check(cu.cuStreamCreate(0))
    for i, step in enumerate(steps):
        op, _, arg = step.partition(" ")
        if op == "meminfo":
            free, total = check(cu.cuMemGetInfo())
            print(f"meminfo free={free} total={total}", flush=True)
        elif op == "alloc":
            err, _ = cu.cuMemAlloc(size(arg))
            print(f"alloc {arg} {name(err)}", flush=True)
        elif op == "async":
            err, _ = cu.cuMemAllocAsync(size(arg), stream)
            print(f"async {arg} {name(err)}", flush=True)
        elif op == "pool":
            pool_step(dev, stream, arg)
        elif op == "vmm":
            vmm_step(dev, arg)
        elif op == "managed":
            managed_step(arg)
        elif op == "calls":
            lib = ctypes.CDLL("libcuda.so.1")
            lib.fakecuda_api_calls.restype = ctypes.c_uint64
            print(f"calls {arg} {lib.fakecuda_api_calls(arg.encode())}", flush=True)
        else:
            raise SystemExit(f"unknown step {step!r}")
    check((cu.cuCtxSynchronize()[0], None))


def pool_attrs(pool):
    a = cu.CUmemPool_attribute
    return {
        key: int(check(cu.cuMemPoolGetAttribute(pool, attr)))
        for key, attr in [
            ("reserved", a.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            ("used", a.CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
            ("reserved_high", a.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH),
            ("threshold", a.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD),
        ]
    }


def pool_step(dev, stream, arg):
    props = cu.CUmemPoolProps()
    props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = int(dev)
    pool = check(cu.cuMemPoolCreate(props))
    err, ptr = cu.cuMemAllocFromPoolAsync(size(arg), pool, stream)
    print(f"pool {arg} {name(err)}", flush=True)
    if err == cu.CUresult.CUDA_SUCCESS:
        held = pool_attrs(pool)
        check((cu.cuMemFreeAsync(ptr, stream)[0], None))
        freed = pool_attrs(pool)
        check((cu.cuStreamSynchronize(stream)[0], None))
        synced = pool_attrs(pool)
        for label, attrs in [("held", held), ("freed", freed), ("synced", synced)]:
            print("pool-attrs " + label + " " + " ".join(f"{k}={v}" for k, v in attrs.items()), flush=True)
    check((cu.cuMemPoolDestroy(pool)[0], None))


def vmm_step(dev, arg):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(dev)
    gran = check(cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    n = (size(arg) + gran - 1) // gran * gran
    err, handle = cu.cuMemCreate(n, prop, 0)
    print(f"vmm {arg} {name(err)}", flush=True)
    if err != cu.CUresult.CUDA_SUCCESS:
        return
    va = check(cu.cuMemAddressReserve(n, 0, 0, 0))
    check((cu.cuMemMap(va, n, 0, handle, 0)[0], None))
    desc = cu.CUmemAccessDesc()
    desc.location = prop.location
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check((cu.cuMemSetAccess(va, n, [desc], 1)[0], None))


def managed_step(arg):
    n = size(arg)
    err, ptr = cu.cuMemAllocManaged(n, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)
    if err != cu.CUresult.CUDA_SUCCESS:
        print(f"managed {arg} {name(err)}", flush=True)
        return
    buf = (ctypes.c_ubyte * n).from_address(int(ptr))
    buf[0], buf[n - 1] = 0x5A, 0xA5
    print(f"managed {arg} {name(err)} host-readback={buf[0]:#x},{buf[n - 1]:#x}", flush=True)


if __name__ == "__main__":
    # The e2e kit passes `-- STEP...`.
    main([a for a in sys.argv[1:] if a != "--"])
