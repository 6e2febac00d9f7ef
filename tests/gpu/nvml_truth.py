"""What NVML reports on a real driver, beside what a process asked for (issue 23, item 4).

ctypes on libcuda and libnvidia-ml, no framework. One JSON line per step; exit status 0 when
every check held (the facts themselves are recorded, not judged: they are what the agent's
join must be built on).

  nvml_truth.py facts         one process: NVML's row for it and the device's used memory
                              before any context, with its primary context, a second context,
                              a 1 GiB cuMemAlloc, an 8192^2 float4 array, a 256 MiB graph
                              memory node (launched, then trimmed), a stream-ordered pool
                              (700 MiB allocated and freed, before and after the synchronize,
                              with the release threshold at 0 and at 1 GiB) and a CUDA IPC
                              import of 1 GiB by a second process (both processes' rows)
  nvml_truth.py fork [exec]   allocates 900 MiB, forks a child that makes no CUDA call (with
                              `exec`: the child execs `sleep`) and `_exit`s at once; the
                              observer (this script, in its `observe-fork` role) reads NVML's
                              rows and the device's used memory while the child lives and
                              after it exits: does the child keep the parent's memory, and
                              which pid does NVML list?
  nvml_truth.py hold BYTES SECONDS [OUT]
                              allocates BYTES with cuMemAlloc (refused: prints the error and
                              exits 3), prints `held`, holds; with OUT, forks a child that
                              holds the device files and sleeps SECONDS, and the parent
                              `_exit`s (run under the hook by truth.sh: the agent's books)
"""
import ctypes
import json
import os
import subprocess
import sys
import time

from cudatypes import (
    GIB, MIB, RELEASE_THRESHOLD, RESERVED_MEM_CURRENT, AccessDesc, ArrayDescriptor, IpcMemHandle, Location, MemAllocNodeParams, PoolProps,
    c_int, c_size, c_u64, c_uint, c_void_p,
)

failures = []


def say(**fields):
    print(json.dumps(fields), flush=True)


def expect(name, ok, **detail):
    say(check=name, ok=bool(ok), **detail)
    if not ok:
        failures.append(name)


class Nvml:
    """nvmlInit_v2, device 0, its memory and its processes' rows (compute and graphics `_v3`)."""

    class Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    class MemoryV2(ctypes.Structure):
        _fields_ = [("version", c_uint), ("total", ctypes.c_ulonglong), ("reserved", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    class Process(ctypes.Structure):
        _fields_ = [("pid", c_uint), ("used", ctypes.c_ulonglong), ("gpu_instance", c_uint), ("compute_instance", c_uint)]

    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        rc = self.lib.nvmlInit_v2()
        if rc != 0:
            raise SystemExit(f"nvmlInit_v2: NVML error {rc}")
        self.dev = c_void_p()
        rc = self.lib.nvmlDeviceGetHandleByIndex_v2(c_uint(0), ctypes.byref(self.dev))
        if rc != 0:
            raise SystemExit(f"nvmlDeviceGetHandleByIndex_v2: NVML error {rc}")

    def memory(self):
        """(used, reserved or None): v2 where the library has it (its used includes reserved)."""
        if hasattr(self.lib, "nvmlDeviceGetMemoryInfo_v2"):
            mem = Nvml.MemoryV2(version=ctypes.sizeof(Nvml.MemoryV2) | (2 << 24))
            if self.lib.nvmlDeviceGetMemoryInfo_v2(self.dev, ctypes.byref(mem)) == 0:
                return mem.used, mem.reserved
        mem = Nvml.Memory()
        rc = self.lib.nvmlDeviceGetMemoryInfo(self.dev, ctypes.byref(mem))
        return (mem.used if rc == 0 else None), None

    def rows(self):
        """{pid: bytes or None (not available)} over the compute and graphics lists."""
        out = {}
        for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3"):
            fn = getattr(self.lib, name, None)
            if fn is None:
                continue
            count = c_uint(256)
            buf = (Nvml.Process * 256)()
            rc = fn(self.dev, ctypes.byref(count), buf)
            if rc != 0:
                say(nvml_error=name, rc=rc)
                continue
            for row in buf[: count.value]:
                used = None if row.used == (1 << 64) - 1 else row.used
                out[row.pid] = (out.get(row.pid) or 0) + used if used is not None else out.get(row.pid)
        return out

    def view(self, *pids):
        rows = self.rows()
        used, reserved = self.memory()
        return {
            "device_used_mib": mib(used),
            "device_reserved_mib": mib(reserved),
            "rows_sum_mib": mib(sum(v or 0 for v in rows.values())),
            "rows": {str(p): mib(v) for p, v in rows.items()},
            **{f"row_{p}_mib": mib(rows.get(p)) for p in pids},
        }


def mib(value):
    return None if value is None else round(value / MIB, 2)


class Cuda:
    """cuInit, device 0 and its primary context, current."""

    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.check(self.cu.cuInit(0), "cuInit")
        self.dev = c_int()
        self.check(self.cu.cuDeviceGet(ctypes.byref(self.dev), 0), "cuDeviceGet")
        self.primary = c_void_p()
        self.check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.primary), self.dev), "cuDevicePrimaryCtxRetain")
        self.check(self.cu.cuCtxSetCurrent(self.primary), "cuCtxSetCurrent")

    @staticmethod
    def check(rc, what):
        if rc != 0:
            raise SystemExit(f"{what}: CUDA error {rc}")

    def alloc(self, size):
        ptr = c_u64()
        rc = self.cu.cuMemAlloc_v2(ctypes.byref(ptr), c_size(size))
        return rc, ptr.value

    def sync(self):
        self.check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")


def facts():
    nvml = Nvml()
    me = os.getpid()
    say(step="before cuInit", **nvml.view(me))
    cuda = Cuda()
    cuda.sync()
    base = nvml.view(me)
    say(step="primary context", **base)
    own = lambda: nvml.rows().get(me) or 0  # noqa: E731

    def delta(step, before, **extra):
        now = own()
        say(step=step, row_delta_mib=mib(now - before), row_mib=mib(now), **extra)
        return now

    ctx_row = own()
    section("contexts", lambda: contexts(cuda, delta, ctx_row))
    section("allocations and arrays", lambda: allocations(cuda, delta, ctx_row))
    section("graph memory", lambda: graph_memory(cuda, delta, ctx_row))
    section("stream-ordered pool", lambda: pool(cuda, delta, ctx_row))
    section("CUDA IPC", lambda: ipc(cuda, nvml, me))
    say(step="end", **nvml.view(me))


def section(name, run):
    """Runs one part of the facts; a driver error or a missing symbol is recorded, not fatal."""
    try:
        run()
    except (SystemExit, AttributeError, OSError) as error:
        say(step=name, error=str(error))
        failures.append(name)


def contexts(cuda, delta, ctx_row):
    cu = cuda.cu
    ctx = c_void_p()
    cuda.check(cu.cuCtxCreate_v2(ctypes.byref(ctx), c_uint(0), cuda.dev), "cuCtxCreate_v2")
    cuda.sync()
    delta("second context (cuCtxCreate_v2)", ctx_row)
    cuda.check(cu.cuCtxDestroy_v2(ctx), "cuCtxDestroy_v2")
    cuda.check(cu.cuCtxSetCurrent(cuda.primary), "cuCtxSetCurrent")
    delta("second context destroyed", ctx_row)


def allocations(cuda, delta, ctx_row):
    cu = cuda.cu
    rc, ptr = cuda.alloc(GIB)
    cuda.check(rc, "cuMemAlloc_v2")
    delta("cuMemAlloc_v2 1 GiB", ctx_row)
    cuda.check(cu.cuMemFree_v2(c_u64(ptr)), "cuMemFree_v2")
    delta("cuMemFree_v2 of it", ctx_row)
    for size in (1, 4096, 2 * MIB + 1):
        rc, ptr = cuda.alloc(size)
        cuda.check(rc, "cuMemAlloc_v2")
        delta(f"cuMemAlloc_v2 {size} bytes (the page the driver backs it with)", ctx_row)
        cuda.check(cu.cuMemFree_v2(c_u64(ptr)), "cuMemFree_v2")

    arr = c_void_p()
    desc = ArrayDescriptor(width=8192, height=8192, format=0x20, channels=4)
    cuda.check(cu.cuArrayCreate_v2(ctypes.byref(arr), ctypes.byref(desc)), "cuArrayCreate_v2")
    delta("8192x8192 float4 array (1024 MiB logical)", ctx_row)
    cuda.check(cu.cuArrayDestroy(arr), "cuArrayDestroy")
    delta("array destroyed", ctx_row)


def graph_memory(cuda, delta, ctx_row):
    cu = cuda.cu
    access = AccessDesc(location=Location(type=1, id=cuda.dev.value), flags=3)
    g = c_void_p()
    cuda.check(cu.cuGraphCreate(ctypes.byref(g), c_uint(0)), "cuGraphCreate")
    params = MemAllocNodeParams(pool=PoolProps(alloc_type=1, location=Location(type=1, id=cuda.dev.value)), access=ctypes.pointer(access), access_count=1, bytesize=256 * MIB)
    node, free_node, exe = c_void_p(), c_void_p(), c_void_p()
    cuda.check(cu.cuGraphAddMemAllocNode(ctypes.byref(node), g, None, c_size(0), ctypes.byref(params)), "cuGraphAddMemAllocNode")
    cuda.check(cu.cuGraphAddMemFreeNode(ctypes.byref(free_node), g, ctypes.byref(node), c_size(1), c_u64(params.dptr)), "cuGraphAddMemFreeNode")
    cuda.check(cu.cuGraphInstantiateWithFlags(ctypes.byref(exe), g, c_u64(0)), "cuGraphInstantiateWithFlags")
    delta("graph with a 256 MiB allocation node, instantiated", ctx_row)
    cuda.check(cu.cuGraphLaunch(exe, c_void_p(0)), "cuGraphLaunch")
    cuda.check(cu.cuStreamSynchronize(c_void_p(0)), "cuStreamSynchronize")
    delta("graph launched", ctx_row)
    cuda.check(cu.cuDeviceGraphMemTrim(cuda.dev), "cuDeviceGraphMemTrim")
    delta("cuDeviceGraphMemTrim", ctx_row)
    cu.cuGraphExecDestroy(exe)
    cu.cuGraphDestroy(g)


def pool(cuda, delta, ctx_row):
    cu = cuda.cu
    pool = c_void_p()
    cuda.check(cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), cuda.dev), "cuDeviceGetDefaultMemPool")

    def reserved():
        value = c_u64()
        cuda.check(cu.cuMemPoolGetAttribute(pool, c_int(RESERVED_MEM_CURRENT), ctypes.byref(value)), "cuMemPoolGetAttribute")
        return mib(value.value)

    for threshold in (0, GIB):
        value = c_u64(threshold)
        cuda.check(cu.cuMemPoolSetAttribute(pool, c_int(RELEASE_THRESHOLD), ctypes.byref(value)), "cuMemPoolSetAttribute")
        ptr = c_u64()
        cuda.check(cu.cuMemAllocAsync(ctypes.byref(ptr), c_size(700 * MIB), c_void_p(0)), "cuMemAllocAsync")
        cuda.check(cu.cuStreamSynchronize(c_void_p(0)), "cuStreamSynchronize")
        delta(f"pool (threshold {threshold >> 20} MiB): 700 MiB allocated", ctx_row, pool_reserved_mib=reserved())
        cuda.check(cu.cuMemFreeAsync(c_u64(ptr.value), c_void_p(0)), "cuMemFreeAsync")
        delta(f"pool (threshold {threshold >> 20} MiB): freed, no synchronize yet", ctx_row, pool_reserved_mib=reserved())
        cuda.check(cu.cuStreamSynchronize(c_void_p(0)), "cuStreamSynchronize")
        delta(f"pool (threshold {threshold >> 20} MiB): after cuStreamSynchronize", ctx_row, pool_reserved_mib=reserved())
    cuda.check(cu.cuMemPoolTrimTo(pool, c_size(0)), "cuMemPoolTrimTo")
    delta("pool trimmed to 0", ctx_row, pool_reserved_mib=reserved())


def ipc(cuda, nvml, me):
    cu = cuda.cu
    if not hasattr(cu, "cuIpcGetMemHandle"):
        say(step="CUDA IPC", skipped="this libcuda has no cuIpcGetMemHandle")
    else:
        rc, ptr = cuda.alloc(GIB)
        cuda.check(rc, "cuMemAlloc_v2")
        handle = IpcMemHandle()
        cuda.check(cu.cuIpcGetMemHandle(ctypes.byref(handle), c_u64(ptr)), "cuIpcGetMemHandle")
        before = nvml.view(me)
        child = subprocess.Popen([sys.executable, __file__, "ipc-import", bytes(handle).hex()], stdout=subprocess.PIPE, text=True)
        line = child.stdout.readline()
        say(step="CUDA IPC: a second process imported the exporter's 1 GiB", importer=child.pid, importer_says=line.strip(), exporter_row_before_mib=before[f"row_{me}_mib"], device_used_before_mib=before["device_used_mib"], **nvml.view(me, child.pid))
        child.stdin = None
        child.terminate()
        child.wait()
        cuda.check(cu.cuMemFree_v2(c_u64(ptr)), "cuMemFree_v2")


def ipc_import(hexhandle):
    nvml = Nvml()
    cuda = Cuda()
    cuda.sync()
    me = os.getpid()
    before = nvml.rows().get(me) or 0
    free_before = c_size()
    total = c_size()
    cuda.check(cuda.cu.cuMemGetInfo_v2(ctypes.byref(free_before), ctypes.byref(total)), "cuMemGetInfo_v2")
    handle = IpcMemHandle.from_buffer_copy(bytes.fromhex(hexhandle))
    ptr = c_u64()
    # The handle is a struct passed by value (a bare ctypes array would be passed as a pointer).
    cuda.cu.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(c_u64), IpcMemHandle, c_uint]
    cuda.check(cuda.cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, c_uint(1)), "cuIpcOpenMemHandle_v2")
    cuda.sync()
    free_after = c_size()
    cuda.check(cuda.cu.cuMemGetInfo_v2(ctypes.byref(free_after), ctypes.byref(total)), "cuMemGetInfo_v2")
    after = nvml.rows().get(me) or 0
    print(json.dumps({"imported": True, "own_row_before_mib": mib(before), "own_row_after_mib": mib(after), "free_drop_mib": mib(free_before.value - free_after.value)}), flush=True)
    time.sleep(60)


def fork_child(mode):
    """Parent: 900 MiB, a child that keeps the device files (sleeps, or execs sleep), `_exit`."""
    cuda = Cuda()
    rc, _ = cuda.alloc(900 * MIB)
    cuda.check(rc, "cuMemAlloc_v2")
    cuda.sync()
    print(json.dumps({"parent": os.getpid()}), flush=True)
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        if mode == "exec":
            os.execvp("sleep", ["sleep", "4"])
        time.sleep(4)
        os._exit(0)
    print(json.dumps({"child": child}), flush=True)
    time.sleep(1.0)  # the observer reads the parent's row while both live
    os._exit(0)


def observe_fork(mode):
    """Runs `fork` and reads NVML while the parent lives, after it `_exit`ed, after the child."""
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the orphaned child is reaped here
    nvml = Nvml()
    start_used = nvml.memory()[0]
    proc = subprocess.Popen([sys.executable, __file__, "fork-child", mode], stdout=subprocess.PIPE, text=True)
    parent = json.loads(proc.stdout.readline())["parent"]
    child = json.loads(proc.stdout.readline())["child"]
    say(step=f"fork ({mode}): parent holds 900 MiB, child forked", parent=parent, child=child, device_used_delta_mib=mib(nvml.memory()[0] - start_used), **nvml.view(parent, child))
    proc.wait()
    time.sleep(0.5)
    view = nvml.view(parent, child)
    say(step=f"fork ({mode}): parent exited, child alive", child_device_files=device_files(child), device_used_delta_mib=mib(nvml.memory()[0] - start_used), **view)
    kept = nvml.memory()[0] - start_used
    os.waitpid(child, 0)
    time.sleep(0.5)
    gone = nvml.memory()[0] - start_used
    say(step=f"fork ({mode}): child exited", device_used_delta_mib=mib(gone), **nvml.view(parent, child))
    expect(f"fork ({mode}): memory released once the last process holding the device files is gone", gone < 64 * MIB, kept_while_child_lived_mib=mib(kept), left_mib=mib(gone))


def device_files(pid):
    """The /dev/nvidia* files process `pid` holds open."""
    found = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/nvidia") or "fakecuda" in target:
                found.append(target)
    except OSError as error:
        return str(error)
    return sorted(found)


def hold(size, seconds, forked):
    cuda = Cuda()
    rc, _ = cuda.alloc(size)
    if rc != 0:
        print(json.dumps({"refused": rc}), flush=True)
        sys.exit(3)
    cuda.sync()
    print(json.dumps({"held": size, "pid": os.getpid()}), flush=True)
    if forked:
        child = os.fork()
        if child == 0:
            time.sleep(seconds)
            with open(forked + ".done", "w") as out:
                out.write("slept\n")  # the child was not stopped
            os._exit(0)
        with open(forked, "w") as out:
            out.write(str(child))
        os._exit(0)
    time.sleep(seconds)


args = sys.argv[1:]
if args == ["facts"]:
    facts()
elif args[:1] == ["ipc-import"]:
    ipc_import(args[1])
    sys.exit(0)
elif args[:1] == ["fork"]:
    observe_fork(args[1] if len(args) > 1 else "sleep")
elif args[:1] == ["fork-child"]:
    fork_child(args[1])
elif args[:1] == ["hold"]:
    hold(int(args[1]), float(args[2]), args[3] if len(args) > 3 else None)
    sys.exit(0)
else:
    raise SystemExit(__doc__)
say(summary="nvml truth", failed=failures)
sys.exit(1 if failures else 0)
