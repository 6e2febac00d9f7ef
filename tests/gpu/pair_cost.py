"""The cost of a cuMemAlloc_v2 + cuMemFree_v2 pair on the real driver (ctypes on libcuda), for
`run.sh` to time with no probes, with vramguard's probes attached (a `vramguard run` beside it)
and under the hook. Usage: pair_cost.py PAIRS SIZE_BYTES; prints `pairs N size S ns_per_pair
MEDIAN (batches ...)`, the median of 7 batches after a warm-up batch.
"""
import ctypes
import statistics
import sys
import time

cu = ctypes.CDLL("libcuda.so.1")
pairs, size = int(sys.argv[1]), int(sys.argv[2])


def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what}: CUDA error {rc}")


check(cu.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
alloc, free = cu.cuMemAlloc_v2, cu.cuMemFree_v2
ptr, nbytes = ctypes.c_uint64(), ctypes.c_size_t(size)
out = ctypes.byref(ptr)
batches = []
for batch in range(8):
    start = time.perf_counter_ns()
    for _ in range(pairs):
        check(alloc(out, nbytes), "cuMemAlloc_v2")
        check(free(ctypes.c_uint64(ptr.value)), "cuMemFree_v2")
    if batch:
        batches.append((time.perf_counter_ns() - start) / pairs)
print(f"pairs {pairs} size {size} ns_per_pair {statistics.median(batches):.0f} (batches {' '.join(f'{b:.0f}' for b in batches)})")
