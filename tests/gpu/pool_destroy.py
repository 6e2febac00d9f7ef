"""What the real driver does with a destroyed memory pool's memory (no PyTorch: ctypes on
libcuda). Prints, after each step, how much device memory the process holds beyond its
starting point (cuMemGetInfo_v2 deltas, MiB) and the pool's attributes where it can still
be asked:

  1. a pool (release threshold: keep everything) with two 256 MiB allocations, one freed;
  2. cuMemPoolDestroy with the other still live;
  3. cuMemFreeAsync of it (before and after synchronizing the stream);
  4. a new pool: does it get the old handle?
  5. a pool with freed (reserved, unused) memory only, destroyed.

With `--hooked` (run under libvramguard.so with a quota: run.sh), cuMemGetInfo_v2 shows the
ledger, so the deltas are what the hook charges; it then exits 1 unless the device's total is
the quota (CUDA_DEVICE_MEMORY_LIMIT, in bytes: the hook is in), the live allocation
stays charged after the destroy (at least 256 MiB) and the charge is all given back once it is
freed and synchronized (step 3) and once the emptied pool is destroyed (step 5), within 2 MiB.
"""
import ctypes
import os
import sys

args = [a for a in sys.argv[1:] if not a.startswith("--")]
hooked = "--hooked" in sys.argv
cu = ctypes.CDLL(args[0] if args else "libcuda.so.1")
seen = {}
MIB = 1 << 20
RESERVED, USED, THRESHOLD = 5, 7, 4


def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what}: CUDA error {rc}")


check(cu.cuInit(0), "cuInit")
dev = ctypes.c_int()
check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
check(cu.cuCtxSetCurrent(ctx), "set current")
stream = ctypes.c_void_p()
check(cu.cuStreamCreate(ctypes.byref(stream), 0), "cuStreamCreate")


def free_bytes():
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
    return free.value


base = free_bytes()


def report(what, pool=None):
    held = (base - free_bytes()) / MIB
    attrs = ""
    if pool is not None:
        value = ctypes.c_uint64()
        rc_r = cu.cuMemPoolGetAttribute(pool, RESERVED, ctypes.byref(value))
        reserved = value.value if rc_r == 0 else None
        rc_u = cu.cuMemPoolGetAttribute(pool, USED, ctypes.byref(value))
        used = value.value if rc_u == 0 else None
        attrs = f" reserved_attr={'rc=%d' % rc_r if reserved is None else reserved // MIB} used_attr={'rc=%d' % rc_u if used is None else used // MIB}"
    seen[what] = held
    print(f"{what}: held={held:.0f} MiB{attrs}", flush=True)


def make_pool():
    props = (ctypes.c_ubyte * 128)()
    ctypes.memmove(props, (ctypes.c_int * 4)(1, 0, 1, dev.value), 16)  # pinned, no handle, device
    pool = ctypes.c_void_p()
    check(cu.cuMemPoolCreate(ctypes.byref(pool), props), "cuMemPoolCreate")
    keep = ctypes.c_uint64(0xFFFF_FFFF_FFFF_FFFF)
    check(cu.cuMemPoolSetAttribute(pool, THRESHOLD, ctypes.byref(keep)), "set threshold")
    return pool


def alloc(pool, size):
    p = ctypes.c_uint64()
    check(cu.cuMemAllocFromPoolAsync(ctypes.byref(p), ctypes.c_size_t(size), pool, stream), "alloc from pool")
    return p


def sync():
    check(cu.cuStreamSynchronize(stream), "sync")


pool = make_pool()
print(f"pool handle {pool.value:#x}")
a, b = alloc(pool, 256 * MIB), alloc(pool, 256 * MIB)
sync()
report("1 two allocations", pool)
check(cu.cuMemFreeAsync(b, stream), "free b")
sync()
report("1 one freed", pool)
rc = cu.cuMemPoolDestroy(pool)
print(f"2 destroy rc={rc}")
report("2 destroyed, one live", pool)
sync()
report("2 destroyed, one live, synchronized", pool)
check(cu.cuMemFreeAsync(a, stream), "free a")
report("3 last freed, not synchronized")
sync()
report("3 last freed, synchronized")
check(cu.cuCtxSynchronize(), "ctx sync")
report("3 context synchronized")

again = make_pool()
print(f"4 new pool handle {again.value:#x} (old {pool.value:#x}) same={again.value == pool.value}")
c = alloc(again, 128 * MIB)
sync()
check(cu.cuMemFreeAsync(c, stream), "free c")
sync()
report("5 freed only", again)
print(f"5 destroy rc={cu.cuMemPoolDestroy(again)}")
report("5 destroyed empty")
third = make_pool()
print(f"6 third pool handle {third.value:#x} same-as-second={third.value == again.value}")
print(f"6 destroy rc={cu.cuMemPoolDestroy(third)}")
if hooked:
    wrong = []
    # Under the hook the device's total is the quota: the deltas above are the ledger's.
    total = ctypes.c_size_t()
    check(cu.cuMemGetInfo_v2(ctypes.byref(ctypes.c_size_t()), ctypes.byref(total)), "cuMemGetInfo_v2")
    limit = int(os.environ.get("CUDA_DEVICE_MEMORY_LIMIT", "0"))
    if total.value != limit:
        wrong.append(f"the device's total is {total.value}, not the quota {limit}: not hooked")
    if seen["2 destroyed, one live, synchronized"] < 256:
        wrong.append("the live allocation of a destroyed pool is not charged")
    for step in ("3 last freed, synchronized", "5 destroyed empty"):
        if abs(seen[step]) > 2:
            wrong.append(f"{step}: {seen[step]:.0f} MiB still charged")
    print("hooked:", "; ".join(wrong) or "the charge follows the driver", flush=True)
    sys.exit(1 if wrong else 0)
