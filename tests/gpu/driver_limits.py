"""The driver's own per-cgroup GPU memory limits (NVIDIA driver r615 and later, CUDA 13.4), on a
real GPU: what nvml.h promises, checked, and what it leaves open, measured. ctypes on
libnvidia-ml and libcuda, nothing else; run as root on the GPU node:

    sudo python3 tests/gpu/driver_limits.py [--hard-mib 2048]

By hand, on one cgroup (a container's: its full path under the cgroup2 mount), on GPU 0:

    sudo python3 tests/gpu/driver_limits.py get PATH
    sudo python3 tests/gpu/driver_limits.py set PATH SOFT_MIB HARD_MIB
    sudo python3 tests/gpu/driver_limits.py clear PATH

It prints the driver version first. When the library has no nvmlDeviceSetMemoryLimits_v1 /
nvmlDeviceGetMemoryLimits_v1, or Set answers NVML_ERROR_NOT_SUPPORTED, it prints a SKIP line
and exits 0: nothing was tested, and that is not a pass (run.sh lists it as skipped).
Otherwise, on GPU 0 (NVML's index 0; the CUDA side finds the same GPU by its PCI bus id):

HARD, the hard limit, is 2 GiB unless --hard-mib says otherwise: room for three contexts (518 MiB
each on the driver 580 GPUs measured, docs/gpu.md) and HARD/4 beside them.

  setup      the cgroup2 mount (/proc/self/mountinfo), the root's dmem.capacity lines naming
             nvidia/ (or: the kernel has no dmem controller), whether an MPS daemon runs; a
             fresh cgroup under the cgroup2 root, removed at the end, even on a failure
  contract   Set soft 0 / hard HARD and Get it back (round trip), again with a soft limit;
             soft > hard, a hard limit above the GPU's memory -> NVML_ERROR_INVALID_ARGUMENT;
             a path that does not exist -> NVML_ERROR_OPERATING_SYSTEM; Get on a cgroup
             with no limit -> NVML_ERROR_NOT_FOUND (or soft 0 / hard MAX, nvml.h's other
             way of saying "no limit")
  limit      a process moved into the cgroup before its first CUDA call (it waits on its
             stdin until its pid is in cgroup.procs) allocates with cuMemAlloc_v2, 64 MiB
             then 2 MiB blocks, until refused: the refusal's CUresult, what it got, Get's
             currentUsed with no context, with the context, at the limit, after the free;
             what cuMemGetInfo_v2 and NVML report inside the cgroup; the hard limit lowered
             below what the cgroup holds
  fork       a process holding HARD/4 forks a child that makes no CUDA call and exits: is
             the memory the child keeps still counted, and does it still limit another
             process of the cgroup?
  ipc        HARD/4 exported (cuIpcGetMemHandle) by a process in another cgroup, imported
             (cuIpcOpenMemHandle_v2) by one in this cgroup: whose currentUsed moves, and does
             the import use up the importer's limit?
  pool       HARD/4 through the default stream-ordered pool (cuMemAllocAsync, cuMemFreeAsync,
             release threshold at the maximum, no trim): does currentUsed keep what the pool
             keeps, does it limit a cuMemAlloc_v2, does the driver trim the pool to make room?
  clear      soft 0 / hard NVML_DEVICE_MEMORY_LIMIT_MAX; Get then reads no limit; a limit on
             a removed cgroup is gone when a cgroup of the same path is made again

Wherever the cgroup has a dmem.current (or dmem.max, dmem.min), its line for the GPU is printed
next to currentUsed. Output lines:

  CHECK ok|FAILED NAME: DETAIL   a contract nvml.h documents (exit 1 when one failed)
  FINDING NAME: VALUE            what nvml.h leaves open, as the run saw it (never judged)
  INCOMPLETE PART: WHY           a part that could not run to its end (a CUDA failure, by
                                 its code name; a worker that stopped answering)
  SKIP: WHY                      nothing was tested

The full check's exit status is 1 only for a broken documented contract: the round trip, the documented
errors, the clearing, an allocation past the hard limit granted (by hand: 1 when a call
failed). docs/gpu.md says where the findings are recorded.
"""
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time

from cudatypes import MIB, RELEASE_THRESHOLD, RESERVED_MEM_CURRENT, IpcMemHandle, c_int, c_size, c_u64, c_uint, c_void_p

LIMIT_MAX = (1 << 64) - 1  # NVML_DEVICE_MEMORY_LIMIT_MAX: hard limit "none"
SET, GET = "nvmlDeviceSetMemoryLimits_v1", "nvmlDeviceGetMemoryLimits_v1"
SUCCESS, INVALID_ARGUMENT, NOT_SUPPORTED, NOT_FOUND, OPERATING_SYSTEM = 0, 2, 3, 6, 17
NVML_RETURN = {
    0: "NVML_SUCCESS", 1: "NVML_ERROR_UNINITIALIZED", 2: "NVML_ERROR_INVALID_ARGUMENT", 3: "NVML_ERROR_NOT_SUPPORTED",
    4: "NVML_ERROR_NO_PERMISSION", 5: "NVML_ERROR_ALREADY_INITIALIZED", 6: "NVML_ERROR_NOT_FOUND",
    7: "NVML_ERROR_INSUFFICIENT_SIZE", 8: "NVML_ERROR_INSUFFICIENT_POWER", 9: "NVML_ERROR_DRIVER_NOT_LOADED",
    10: "NVML_ERROR_TIMEOUT", 11: "NVML_ERROR_IRQ_ISSUE", 12: "NVML_ERROR_LIBRARY_NOT_FOUND",
    13: "NVML_ERROR_FUNCTION_NOT_FOUND", 14: "NVML_ERROR_CORRUPTED_INFOROM", 15: "NVML_ERROR_GPU_IS_LOST",
    16: "NVML_ERROR_RESET_REQUIRED", 17: "NVML_ERROR_OPERATING_SYSTEM", 18: "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
    19: "NVML_ERROR_IN_USE", 20: "NVML_ERROR_MEMORY", 21: "NVML_ERROR_NO_DATA", 22: "NVML_ERROR_VGPU_ECC_NOT_SUPPORTED",
    23: "NVML_ERROR_INSUFFICIENT_RESOURCES", 24: "NVML_ERROR_FREQ_NOT_SUPPORTED",
    25: "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 26: "NVML_ERROR_DEPRECATED", 27: "NVML_ERROR_NOT_READY",
    28: "NVML_ERROR_GPU_NOT_FOUND", 29: "NVML_ERROR_INVALID_STATE", 999: "NVML_ERROR_UNKNOWN",
}
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
ANSWER_S = 120  # the longest a worker may take over one step


def nvml_name(rc):
    return NVML_RETURN.get(rc, f"NVML error {rc}")


def mib(value):
    return "?" if value is None else f"{value / MIB:.1f} MiB"


def prctl(option, value):
    try:
        ctypes.CDLL(None, use_errno=True).prctl(c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------------------
# The worker: a child process that runs in the cgroup under test. It makes no CUDA call (it does
# not even load libcuda) until its parent has written its pid into cgroup.procs and said `go`;
# then it answers one JSON line per command read from its stdin.
# ---------------------------------------------------------------------------------------------


class CudaFailure(Exception):
    def __init__(self, call, code):
        super().__init__(f"{call}: {code}")
        self.call, self.code = call, code


def read_line(fd):
    """One line from `fd`, read a byte at a time (no buffer a forked child could inherit)."""
    data = bytearray()
    while True:
        byte = os.read(fd, 1)
        if not byte:
            return data.decode() if data else None
        if byte == b"\n":
            return data.decode()
        data += byte


def answer(**fields):
    try:
        os.write(1, (json.dumps(fields) + "\n").encode())
    except OSError:
        pass  # the parent is gone


def own_cgroup():
    try:
        with open("/proc/self/cgroup") as text:
            return next((line[3:].strip() for line in text if line.startswith("0::")), None)
    except OSError:
        return None


def device_files(pid):
    """How many /dev/nvidia* files process `pid` holds open (None: unreadable)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    count = 0
    for fd in fds:
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia")
        except OSError:
            pass
    return count


class Gpu:
    """The worker's CUDA side: the GPU, its primary context and what the worker holds."""

    def __init__(self, bus_id):
        self.bus_id = bus_id
        self.cu = None
        self.dev = c_int()
        self.held = []  # (device pointer, bytes) from cuMemAlloc_v2
        self.pool = None

    def name(self, rc):
        text = ctypes.c_char_p()
        try:
            if self.cu.cuGetErrorName(c_int(rc), ctypes.byref(text)) == 0 and text.value:
                return text.value.decode()
        except AttributeError:
            pass
        return f"CUDA error {rc}"

    def call(self, fn, *args):
        try:
            function = getattr(self.cu, fn)
        except AttributeError:
            raise CudaFailure(fn, "not exported by this libcuda") from None
        rc = function(*args)
        if rc != 0:
            raise CudaFailure(fn, self.name(rc))

    def held_bytes(self):
        return sum(size for _, size in self.held)

    def init(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.call("cuInit", c_uint(0))
        how = "CUDA device 0"
        found = False
        if self.bus_id != "-" and hasattr(self.cu, "cuDeviceGetByPCIBusId"):
            rc = self.cu.cuDeviceGetByPCIBusId(ctypes.byref(self.dev), self.bus_id.encode())
            found = rc == 0
            how = f"PCI {self.bus_id}" if found else f"CUDA device 0 (cuDeviceGetByPCIBusId: {self.name(rc)})"
        if not found:
            self.call("cuDeviceGet", ctypes.byref(self.dev), c_int(0))
        ctx = c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.dev)
        self.call("cuCtxSetCurrent", ctx)
        self.call("cuCtxSynchronize")
        return {"device": how}

    def meminfo(self):
        free, total = c_size(), c_size()
        self.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return {"free": free.value, "total": total.value}

    def nvml_memory(self):
        """NVML's memory figures for GPU 0, asked from inside the cgroup (nvml.h: the limits
        are to be cross-referenced with nvmlDeviceGetMemoryInfo_v2 "while in that cgroup")."""
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        rc = lib.nvmlInit_v2()
        if rc != 0:
            return {"failed": "nvmlInit_v2", "code": nvml_name(rc)}
        dev = c_void_p()
        rc = lib.nvmlDeviceGetHandleByIndex_v2(c_uint(0), ctypes.byref(dev))
        if rc != 0:
            return {"failed": "nvmlDeviceGetHandleByIndex_v2", "code": nvml_name(rc)}
        memory = MemoryV2(version=ctypes.sizeof(MemoryV2) | (2 << 24))
        rc = lib.nvmlDeviceGetMemoryInfo_v2(dev, ctypes.byref(memory))
        if rc != 0:
            return {"failed": "nvmlDeviceGetMemoryInfo_v2", "code": nvml_name(rc)}
        return {"total": memory.total, "reserved": memory.reserved, "free": memory.free, "used": memory.used}

    def alloc(self, size):
        ptr = c_u64()
        rc = self.cu.cuMemAlloc_v2(ctypes.byref(ptr), c_size(size))
        if rc == 0:
            self.held.append((ptr.value, size))
        return rc

    def fill(self, block, cap):
        """cuMemAlloc_v2 of `block` bytes until refused, or until this fill reached `cap`."""
        granted, refused = 0, None
        while granted + block <= cap:
            rc = self.alloc(block)
            if rc != 0:
                refused = self.name(rc)
                break
            granted += block
        return {"granted": granted, "refused": refused, "held": self.held_bytes()}

    def free(self):
        count = len(self.held)
        while self.held:
            ptr, _ = self.held.pop()
            self.call("cuMemFree_v2", c_u64(ptr))
        return {"freed": count}

    def pool_reserved(self):
        value = c_u64()
        self.call("cuMemPoolGetAttribute", self.pool, c_int(RESERVED_MEM_CURRENT), ctypes.byref(value))
        return value.value

    def pool_keep(self, size):
        """`size` through the default pool, freed and synchronized, the pool told to keep all."""
        self.pool = c_void_p()
        self.call("cuDeviceGetDefaultMemPool", ctypes.byref(self.pool), self.dev)
        keep = c_u64(LIMIT_MAX)
        self.call("cuMemPoolSetAttribute", self.pool, c_int(RELEASE_THRESHOLD), ctypes.byref(keep))
        ptr = c_u64()
        self.call("cuMemAllocAsync", ctypes.byref(ptr), c_size(size), c_void_p(0))
        self.call("cuStreamSynchronize", c_void_p(0))
        self.call("cuMemFreeAsync", c_u64(ptr.value), c_void_p(0))
        self.call("cuStreamSynchronize", c_void_p(0))
        return {"pool_reserved": self.pool_reserved()}

    def pool_trim(self):
        self.call("cuMemPoolTrimTo", self.pool, c_size(0))
        return {"pool_reserved": self.pool_reserved()}

    def ipc_export(self, size):
        rc = self.alloc(size)
        if rc != 0:
            raise CudaFailure("cuMemAlloc_v2", self.name(rc))
        handle = IpcMemHandle()
        self.call("cuIpcGetMemHandle", ctypes.byref(handle), c_u64(self.held[-1][0]))
        return {"handle": bytes(handle).hex()}

    def ipc_import(self, hexhandle):
        handle = IpcMemHandle.from_buffer_copy(bytes.fromhex(hexhandle))
        ptr = c_u64()
        if hasattr(self.cu, "cuIpcOpenMemHandle_v2"):
            # The handle is a struct passed by value; flag 1: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
            self.cu.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(c_u64), IpcMemHandle, c_uint]
        self.call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), handle, c_uint(1))
        return {"imported": True}


class MemoryV2(ctypes.Structure):  # nvmlMemory_v2_t
    _fields_ = [("version", c_uint), ("total", ctypes.c_ulonglong), ("reserved", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def worker(bus_id):
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if read_line(0) != "go":
        os._exit(0)
    answer(ready=True, pid=os.getpid(), cgroup=own_cgroup())
    gpu = Gpu(bus_id)
    while True:
        line = read_line(0)
        if line is None or line == "exit":
            os._exit(0)
        words = line.split() or [""]
        command, args = words[0], words[1:]
        try:
            if command == "fork-exit":
                # A child that inherits the device files and makes no CUDA call; this process exits.
                child = os.fork()
                if child == 0:
                    read_line(0)  # `release`, or the end of the pipe
                    answer(released=True, pid=os.getpid())
                    os._exit(0)
                answer(child=child)
                os._exit(0)
            steps = {
                "init": lambda: gpu.init(),
                "meminfo": lambda: gpu.meminfo(),
                "nvml-memory": lambda: gpu.nvml_memory(),
                "fill": lambda: gpu.fill(int(args[0]), int(args[1])),
                "free": lambda: gpu.free(),
                "pool-keep": lambda: gpu.pool_keep(int(args[0])),
                "pool-stat": lambda: {"pool_reserved": gpu.pool_reserved()},
                "pool-trim": lambda: gpu.pool_trim(),
                "ipc-export": lambda: gpu.ipc_export(int(args[0])),
                "ipc-import": lambda: gpu.ipc_import(args[0]),
            }
            if command == "alloc":
                rc = gpu.alloc(int(args[0]))
                answer(code=None if rc == 0 else gpu.name(rc), held=gpu.held_bytes())
            elif command in steps:
                answer(**steps[command]())
            else:
                answer(failed=command, code="unknown command")
        except CudaFailure as failure:
            answer(failed=failure.call, code=failure.code)
        except Exception as error:  # noqa: BLE001 - reported to the parent, which judges
            answer(failed=command, code=f"{type(error).__name__}: {error}")


# ---------------------------------------------------------------------------------------------
# The parent: NVML, the cgroups it makes, the workers it starts, the report.
# ---------------------------------------------------------------------------------------------


class Skip(Exception):
    """Nothing (more) can be tested here: not a pass."""


class Incomplete(Exception):
    """A part could not run to its end."""


class Stop(Exception):
    """A failure that leaves nothing else worth running (the limit cannot be set at all)."""


class Report:
    def __init__(self):
        self.checks, self.failed, self.findings, self.incomplete = 0, [], 0, []

    def check(self, name, ok, detail):
        self.checks += 1
        if not ok:
            self.failed.append(name)
        print(f"CHECK {'ok' if ok else 'FAILED'} {name}: {detail}", flush=True)
        return ok

    def finding(self, name, value):
        self.findings += 1
        print(f"FINDING {name}: {value}", flush=True)

    def gap(self, part, why):
        self.incomplete.append(part)
        print(f"INCOMPLETE {part}: {why}", flush=True)


class SetLimits(ctypes.Structure):  # nvmlSetMemoryLimits_v1_t (no version field)
    _fields_ = [("name_space", ctypes.c_char_p), ("soft", c_u64), ("hard", c_u64)]


class GetLimits(ctypes.Structure):  # nvmlGetMemoryLimits_v1_t
    _fields_ = [("name_space", ctypes.c_char_p), ("soft", c_u64), ("hard", c_u64), ("used", c_u64)]


class PciInfo(ctypes.Structure):  # nvmlPciInfo_t
    _fields_ = [
        ("bus_id_legacy", ctypes.c_char * 16), ("domain", c_uint), ("bus", c_uint), ("device", c_uint),
        ("pci_device_id", c_uint), ("pci_subsystem_id", c_uint), ("bus_id", ctypes.c_char * 32),
    ]


class MemoryV1(ctypes.Structure):  # nvmlMemory_t
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class Nvml:
    def __init__(self, lib):
        self.lib = lib
        self.dev = c_void_p()

    def driver_version(self):
        text = ctypes.create_string_buffer(96)
        try:
            rc = self.lib.nvmlSystemGetDriverVersion(text, c_uint(96))
        except AttributeError:
            return "unknown (no nvmlSystemGetDriverVersion)"
        return text.value.decode() if rc == 0 else f"unknown ({nvml_name(rc)})"

    def cuda_version(self):
        version = c_int()
        fn = getattr(self.lib, "nvmlSystemGetCudaDriverVersion_v2", None) or getattr(self.lib, "nvmlSystemGetCudaDriverVersion", None)
        if fn is None or fn(ctypes.byref(version)) != 0:
            return "?"
        return f"{version.value // 1000}.{version.value % 1000 // 10}"

    def name(self):
        text = ctypes.create_string_buffer(96)
        return text.value.decode() if self.lib.nvmlDeviceGetName(self.dev, text, c_uint(96)) == 0 else "?"

    def total(self):
        memory = MemoryV1()
        rc = self.lib.nvmlDeviceGetMemoryInfo(self.dev, ctypes.byref(memory))
        return memory.total if rc == 0 else None

    def bus_id(self):
        """The legacy `dddd:bb:dd.f` form (what cuDeviceGetByPCIBusId and the kernel take)."""
        info = PciInfo()
        fn = getattr(self.lib, "nvmlDeviceGetPciInfo_v3", None)
        if fn is None or fn(self.dev, ctypes.byref(info)) != 0:
            return None
        return info.bus_id_legacy.decode() or None

    def mig_mode(self):
        current, pending = c_uint(), c_uint()
        fn = getattr(self.lib, "nvmlDeviceGetMigMode", None)
        if fn is None:
            return "unknown"
        rc = fn(self.dev, ctypes.byref(current), ctypes.byref(pending))
        if rc != 0:
            return f"unknown ({nvml_name(rc)})"  # NOT_SUPPORTED: a GPU without MIG
        return f"current {current.value}, pending {pending.value}"

    def set(self, path, soft, hard):
        limits = SetLimits(name_space=path.encode(), soft=soft, hard=hard)
        return getattr(self.lib, SET)(self.dev, ctypes.byref(limits))

    def get(self, path):
        """(rc, soft, hard, currentUsed)."""
        limits = GetLimits(name_space=path.encode())
        rc = getattr(self.lib, GET)(self.dev, ctypes.byref(limits))
        return rc, limits.soft, limits.hard, limits.used


def cgroup2_mount():
    """(mount point, the mount's root inside the hierarchy) of the first cgroup2 mount."""
    try:
        with open("/proc/self/mountinfo") as text:
            for line in text:
                left, _, right = line.partition(" - ")
                if right.split()[:1] == ["cgroup2"]:
                    fields = left.split()
                    return fields[4], fields[3]
    except OSError:
        pass
    return None, None


def parse_pci(text):
    """(domain, bus, device, function) of `dddd:bb:dd.f` (any case, any domain width)."""
    try:
        domain, bus, rest = text.strip().split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        return None


def read(path):
    try:
        with open(path) as text:
            return text.read()
    except OSError:
        return None


class Cgroups:
    """The cgroups this run makes under the cgroup2 root, and their removal."""

    def __init__(self, root):
        self.root = root
        self.made = []

    def path(self, name):
        return os.path.join(self.root, f"vramguard-driver-limits-{os.getpid()}-{name}")

    def make(self, name):
        path = self.path(name)
        os.mkdir(path)
        self.made.append(path)
        return path

    def move(self, pid, path):
        with open(os.path.join(path, "cgroup.procs"), "w") as procs:
            procs.write(str(pid))

    def relative(self, path):
        return "/" + os.path.relpath(path, self.root)

    def remove(self, path):
        """Ends what is left in it (only this run's processes can be there), then rmdir."""
        pids = [int(p) for p in (read(os.path.join(path, "cgroup.procs")) or "").split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 15
        while True:
            reap()
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError as error:
                if time.monotonic() > deadline:
                    print(f"warning: could not remove {path}: {error}", flush=True)
                    return False
                time.sleep(0.1)
        if path in self.made:
            self.made.remove(path)
        return True

    def remove_all(self):
        for path in list(reversed(self.made)):
            self.remove(path)


def reap():
    """Collects exited children (workers, and orphans this process became the reaper of)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class Worker:
    """A worker process, moved into `cgroup` before it makes any CUDA call."""

    def __init__(self, run, cgroup, label):
        self.label = label
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUDA_DEVICE_MEMORY_LIMIT", "VRAMGUARD_LEDGER")}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", run.bus_id or "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0
        )
        run.workers.append(self)
        self.buffer = b""
        run.cgroups.move(self.proc.pid, cgroup)
        ready = self.ask("go")
        want = run.cgroups.relative(cgroup)
        if ready.get("cgroup") != want:
            raise Incomplete(f"{label} (pid {self.proc.pid}) is in cgroup {ready.get('cgroup')}, not {want}")

    def send(self, line):
        try:
            self.proc.stdin.write((line + "\n").encode())
        except OSError as error:
            raise Incomplete(f"{self.label}: cannot write to it ({error})") from None

    def receive(self, what):
        deadline = time.monotonic() + ANSWER_S
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise Incomplete(f"{self.label}: no answer to `{what}` within {ANSWER_S} s (killed)")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise Incomplete(f"{self.label}: exited before answering `{what}` (status {self.proc.poll()})")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def ask(self, line):
        """Sends one command; its answer (a failure is data here)."""
        self.send(line)
        return self.receive(line.split()[0])

    def do(self, line):
        """Sends one command; its answer, or Incomplete naming the CUDA call that failed."""
        reply = self.ask(line)
        if "failed" in reply:
            raise Incomplete(f"{self.label}: `{line.split()[0]}`: {reply['failed']} -> {reply['code']}")
        return reply

    def wait_exit(self, seconds=15):
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.kill()
            raise Incomplete(f"{self.label}: still running {seconds} s after it was to exit (killed)") from None

    def finish(self):
        if self.proc.poll() is None:
            self.send("exit")
            self.wait_exit()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Run:
    def __init__(self, nvml, report, cgroups, hard, total, bus_id, regions):
        self.nvml, self.report, self.cgroups = nvml, report, cgroups
        self.hard, self.total, self.bus_id, self.regions = hard, total, bus_id, regions
        self.form = None  # how the cgroup's path is spelled for the driver (learned at the first Set)
        self.workers, self.orphans = [], []
        self.a = None
        self.alone = None  # what one process of the cgroup got alone (the limit part)

    def ns(self, path):
        return self.form[1](path) if self.form else path

    def set(self, path, soft, hard):
        return self.nvml.set(self.ns(path), soft, hard)

    def get(self, path):
        return self.nvml.get(self.ns(path))

    def dmem(self, path, name):
        """The cgroup's `name` (dmem.current, dmem.max, dmem.min) for this GPU's regions."""
        text = read(os.path.join(path, name))
        if text is None:
            return None
        lines = [line.strip() for line in text.splitlines() if line.split()[:1] and line.split()[0] in self.regions]
        if not lines:
            lines = [line.strip() for line in text.splitlines() if line.startswith("nvidia/")]
        return "; ".join(lines) if lines else "(no nvidia/ line)"

    def dmem_limits(self, path):
        return "; ".join(f"{name} {self.dmem(path, name) or '(no such file)'}" for name in ("dmem.max", "dmem.min"))

    def used(self, name, path, note=""):
        """Get's currentUsed for `path` as a FINDING, dmem.current beside it; the bytes or None."""
        rc, soft, hard, used = self.get(path)
        text = f"currentUsed {mib(used)} ({used} bytes)" if rc == SUCCESS else f"Get: {nvml_name(rc)}"
        current = self.dmem(path, "dmem.current")
        if current is not None:
            text += f"; dmem.current {current}"
        self.report.finding(name, text + (f" ({note})" if note else ""))
        return used if rc == SUCCESS else None

    def worker(self, cgroup, label):
        return Worker(self, cgroup, label)

    def limit_set(self):
        """Soft 0 / hard HARD on the cgroup under test, as each part starts (a part before it
        may have stopped with another limit in place)."""
        rc = self.set(self.a, 0, self.hard)
        if rc != SUCCESS:
            raise Incomplete(f"Set soft 0, hard {self.hard} on {self.a}: {nvml_name(rc)}")

    def end_workers(self):
        for worker in self.workers:
            worker.kill()
        self.workers = []
        for pid in self.orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.orphans = []
        time.sleep(0.2)
        reap()

    def fill_to_limit(self, worker, check_name):
        """The worker allocates 64 MiB blocks, then 2 MiB ones, until refused (at most the hard
        limit + 512 MiB): checks that nothing past the hard limit was granted."""
        cap = self.hard + 512 * MIB
        coarse = worker.do(f"fill {64 * MIB} {cap}")
        refused, held = coarse["refused"], coarse["held"]
        if refused is not None:
            fine = worker.do(f"fill {2 * MIB} {cap - coarse['granted']}")
            held = fine["held"]
        self.report.check(
            check_name,
            refused is not None and held <= self.hard,
            f"{worker.label} holds {mib(held)} of cuMemAlloc_v2 blocks (64 MiB, then 2 MiB), hard limit {mib(self.hard)}; "
            + (f"the first refusal: {refused}" if refused else f"nothing refused up to {mib(cap)}: past the hard limit"),
        )
        return held, refused


def part_contract(run):
    r, hard, total = run.report, run.hard, run.total
    a = run.a = run.cgroups.make("a")
    root = run.cgroups.root
    before = sorted(f for f in os.listdir(a) if f.startswith("dmem."))
    forms = [
        ("the directory's absolute path", lambda p: p),
        ("the absolute path with a trailing slash", lambda p: p + "/"),
        ("the path below the cgroup2 root", lambda p: "/" + os.path.relpath(p, root)),
    ]
    tried = []
    for form in forms:
        rc = run.nvml.set(form[1](a), 0, hard)
        tried.append(f"{form[0]} ({form[1](a)}): {nvml_name(rc)}")
        if rc == NOT_SUPPORTED and len(tried) == 1:
            raise Skip(f"NOT_SUPPORTED: {SET} on {a} answered {nvml_name(rc)}")
        if rc == SUCCESS:
            run.form = form
            break
    r.finding("namespace_form", "; ".join(tried))
    if not r.check("set_on_a_fresh_cgroup", run.form is not None, f"soft 0, hard {mib(hard)}: " + "; ".join(tried)):
        subtree = (read(os.path.join(root, "cgroup.subtree_control")) or "").split()
        hint = "" if "dmem" in subtree or not os.path.exists(os.path.join(root, "dmem.capacity")) else " (the root's cgroup.subtree_control has no dmem: this check enables nothing)"
        raise Stop("no spelling of the cgroup's path was taken: nothing else can be checked" + hint)

    rc, soft, got_hard, used = run.get(a)
    r.check("get_round_trip", rc == SUCCESS and soft == 0 and got_hard == hard, f"Get: {nvml_name(rc)}, soft {soft}, hard {got_hard} (set: soft 0, hard {hard})")
    r.finding("used_no_process", f"currentUsed {mib(used)}" if rc == SUCCESS else nvml_name(rc))
    after = sorted(f for f in os.listdir(a) if f.startswith("dmem."))
    r.finding("dmem_files_in_cgroup", f"before Set: {', '.join(before) or 'none'}; after: {', '.join(after) or 'none'}")
    r.finding("dmem_after_set", run.dmem_limits(a))

    soft_want = min(256 * MIB, hard // 2)
    rc = run.set(a, soft_want, hard)
    got = run.get(a)
    r.check(
        "set_get_round_trip_with_soft",
        rc == SUCCESS and got[0] == SUCCESS and got[1:3] == (soft_want, hard),
        f"Set soft {soft_want}, hard {hard}: {nvml_name(rc)}; Get: {nvml_name(got[0])}, soft {got[1]}, hard {got[2]}",
    )
    r.finding("dmem_after_soft", run.dmem_limits(a))

    rc = run.set(a, 2 * hard, hard)
    r.check("soft_above_hard_refused", rc == INVALID_ARGUMENT, f"soft {2 * hard}, hard {hard}: {nvml_name(rc)} (documented: NVML_ERROR_INVALID_ARGUMENT)")
    got = run.get(a)
    r.finding("limits_after_a_refused_set", f"Get: {nvml_name(got[0])}, soft {got[1]}, hard {got[2]} (before it: soft {soft_want}, hard {hard})")
    if total:
        rc = run.set(a, 0, 2 * total)
        r.check("hard_above_device_memory_refused", rc == INVALID_ARGUMENT, f"hard {2 * total} (twice the GPU's {total}): {nvml_name(rc)} (documented: NVML_ERROR_INVALID_ARGUMENT)")
        rc = run.set(a, 0, total)
        r.finding("hard_equal_to_device_memory", f"hard {total} (NVML's total): {nvml_name(rc)}")
    else:
        r.gap("contract", "nvmlDeviceGetMemoryInfo gave no total: the limit above the GPU's memory is not checked")
    rc = run.set(a, 0, hard)
    if not r.check("set_again", rc == SUCCESS, f"soft 0, hard {hard}: {nvml_name(rc)}"):
        raise Stop("the limit the other parts need cannot be set")

    absent = run.cgroups.path("absent")
    if os.path.exists(absent):
        r.gap("contract", f"{absent} exists: the nonexistent-path error is not checked")
    else:
        rc = run.set(absent, 0, hard)
        r.check("set_on_a_nonexistent_path", rc == OPERATING_SYSTEM, f"{run.ns(absent)}: {nvml_name(rc)} (documented: NVML_ERROR_OPERATING_SYSTEM)")
        got = run.get(absent)
        r.check("get_on_a_nonexistent_path", got[0] in (OPERATING_SYSTEM, NOT_FOUND), f"{nvml_name(got[0])} (documented: NVML_ERROR_OPERATING_SYSTEM; NOT_FOUND accepted)")

    none = run.cgroups.make("none")
    got = run.get(none)
    r.check("get_without_a_limit", no_limit(got), f"a fresh cgroup: Get {nvml_name(got[0])}, soft {got[1]}, hard {got[2]} (documented: NVML_ERROR_NOT_FOUND; success with soft 0, hard MAX accepted)")
    run.cgroups.remove(none)


def no_limit(got):
    rc, soft, hard, _ = got
    return rc == NOT_FOUND or (rc == SUCCESS and soft == 0 and hard == LIMIT_MAX)


def part_limit(run):
    r, a, hard = run.report, run.a, run.hard
    run.limit_set()
    job = run.worker(a, "job")
    run.used("used_process_before_cuda", a, f"pid {job.proc.pid} in the cgroup, no CUDA call yet")
    init = job.ask("init")
    if "failed" in init:
        r.finding("context_under_the_limit", f"{init['failed']} -> {init['code']}")
        raise Incomplete(f"job: no context under a {mib(hard)} limit ({init['failed']} -> {init['code']})")
    r.finding("device_found_by", init["device"])
    context = run.used("used_with_context", a, "primary context, no allocation")
    info = job.do("meminfo")
    r.finding("cuMemGetInfo_in_cgroup", f"total {mib(info['total'])}, free {mib(info['free'])} (the GPU's total {mib(run.total)}, hard limit {mib(hard)})")
    seen = job.ask("nvml-memory")
    if "failed" in seen:
        r.finding("nvml_memory_in_cgroup", f"{seen['failed']} -> {seen['code']}")
    else:
        r.finding("nvml_memory_in_cgroup", f"nvmlDeviceGetMemoryInfo_v2 total {mib(seen['total'])}, reserved {mib(seen['reserved'])}, free {mib(seen['free'])}, used {mib(seen['used'])}")

    held, refused = run.fill_to_limit(job, "hard_limit_refuses_an_allocation")
    run.alone = held
    r.finding("refused_allocation_code", refused or "none (nothing refused)")
    full = run.used("used_at_the_limit", a, f"{mib(held)} of allocations held")
    if full is not None:
        r.finding("used_beyond_allocations", f"{mib(full - held)} (currentUsed less the allocations: the context's part, if it is counted; with context only: {mib(context)})")
    info = job.do("meminfo")
    r.finding("cuMemGetInfo_at_the_limit", f"total {mib(info['total'])}, free {mib(info['free'])}")

    low = min(256 * MIB, hard // 4)
    rc = run.set(a, 0, low)
    got = run.get(a)
    try:
        alive = job.ask("meminfo")
    except Incomplete as gone:
        alive = {"failed": "meminfo", "code": str(gone)}
    r.finding(
        "hard_lowered_below_used",
        f"Set hard {mib(low)} while the cgroup holds {mib(full)}: {nvml_name(rc)}; Get {nvml_name(got[0])}, hard {got[2]}, currentUsed {mib(got[3])}; "
        + (f"the job still answers (free {mib(alive['free'])})" if "failed" not in alive else f"the job: {alive['failed']} -> {alive['code']}"),
    )
    rc = run.set(a, 0, hard)
    if not r.check("set_back", rc == SUCCESS, f"soft 0, hard {hard}: {nvml_name(rc)}"):
        raise Stop("the limit the other parts need cannot be set again")
    job.do("free")
    run.used("used_after_free", a, "the context kept")
    job.finish()
    time.sleep(0.5)
    run.used("used_after_exit", a)


def part_fork(run):
    r, a, size = run.report, run.a, run.hard // 4
    run.limit_set()
    parent = run.worker(a, "parent")
    parent.do("init")
    got = parent.ask(f"alloc {size}")
    if got["code"]:
        raise Incomplete(f"parent: cuMemAlloc_v2 of {mib(size)} -> {got['code']}")
    run.used("fork_parent_holds", a, f"the parent holds {mib(size)}")
    child = parent.do("fork-exit")["child"]
    run.orphans.append(child)
    parent.wait_exit()
    time.sleep(0.5)
    files = device_files(child)
    run.used("fork_child_keeps_after_parent_exit", a, f"the parent exited; its child {child} lives, holding {files} /dev/nvidia* files, no CUDA call of its own")
    other = run.worker(a, "other")
    init = other.ask("init")
    if "failed" in init:
        r.finding("fork_child_counts_toward_the_limit", f"another process of the cgroup could not make a context beside the child: {init['failed']} -> {init['code']}")
    else:
        held, _ = run.fill_to_limit(other, "hard_limit_refuses_beside_a_forked_child")
        r.finding("fork_child_counts_toward_the_limit", f"another process of the cgroup got {mib(held)} beside the child (alone it got {mib(run.alone)}; the child keeps {mib(size)})")
    other.finish()
    parent.send("release")  # the child reads the pipe it inherited from the parent
    parent.receive("release")
    deadline = time.monotonic() + 15
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        reap()
        time.sleep(0.1)
    run.orphans.remove(child)
    time.sleep(0.5)
    run.used("fork_after_the_child_exits", a)


def part_ipc(run):
    r, a, size = run.report, run.a, run.hard // 4
    run.limit_set()
    b = run.cgroups.make("exporter")
    rc = run.set(b, 0, run.hard)
    if rc != SUCCESS:
        raise Incomplete(f"the exporter's cgroup: Set {nvml_name(rc)}")
    exporter = run.worker(b, "exporter")
    exporter.do("init")
    handle = exporter.do(f"ipc-export {size}")["handle"]
    run.used("ipc_exporter_holds", b, f"the exporter's cgroup ({run.cgroups.relative(b)}), {mib(size)} exported")
    importer = run.worker(a, "importer")
    importer.do("init")
    base = run.used("ipc_importer_with_context", a)
    imported = importer.ask(f"ipc-import {handle}")
    r.finding("ipc_import", "granted" if "failed" not in imported else f"{imported['failed']} -> {imported['code']}")
    if "failed" in imported:
        raise Incomplete(f"importer: {imported['failed']} -> {imported['code']}")
    after = run.used("ipc_importer_after_import", a, f"{mib(size)} imported")
    run.used("ipc_exporter_after_import", b)
    if base is not None and after is not None:
        r.finding("ipc_import_charged_to_the_importer", f"{mib(after - base)} of the {mib(size)} imported")
    held, _ = run.fill_to_limit(importer, "hard_limit_refuses_beside_an_ipc_import")
    r.finding("ipc_import_counts_toward_the_limit", f"the importer got {mib(held)} beside its import (alone a process got {mib(run.alone)})")
    importer.finish()
    exporter.finish()
    time.sleep(0.5)
    run.used("ipc_importer_cgroup_after_both_exit", a)
    run.cgroups.remove(b)


def part_pool(run):
    r, a, size = run.report, run.a, run.hard // 4
    run.limit_set()
    job = run.worker(a, "pool job")
    job.do("init")
    base = run.used("pool_job_with_context", a)
    kept = job.do(f"pool-keep {size}")["pool_reserved"]
    now = run.used("pool_keeps_after_free", a, f"{mib(size)} allocated and freed through the default pool; it keeps {mib(kept)}")
    if base is not None and now is not None:
        r.finding("pool_kept_memory_counted", f"{mib(now - base)} above the context, the pool keeping {mib(kept)}")
    held, _ = run.fill_to_limit(job, "hard_limit_refuses_beside_a_pool")
    after = job.do("pool-stat")["pool_reserved"]
    r.finding("pool_kept_memory_counts_toward_the_limit", f"cuMemAlloc_v2 got {mib(held)} beside the pool (alone a process got {mib(run.alone)})")
    r.finding("pool_after_the_refusal", f"the pool keeps {mib(after)} (before the fill: {mib(kept)}; less: the driver trimmed it to make room)")
    job.do("free")
    job.do("pool-trim")
    run.used("pool_after_trim", a, "allocations freed, the pool trimmed to 0")
    job.finish()


def part_clear(run):
    r, a = run.report, run.a
    rc = run.set(a, 0, LIMIT_MAX)
    r.check("clear_accepted", rc == SUCCESS, f"soft 0, hard NVML_DEVICE_MEMORY_LIMIT_MAX: {nvml_name(rc)}")
    got = run.get(a)
    r.check("cleared_reads_as_no_limit", no_limit(got), f"Get {nvml_name(got[0])}, soft {got[1]}, hard {got[2]} (NOT_FOUND, or soft 0 and hard MAX)")
    r.finding("dmem_after_clear", run.dmem_limits(a))
    rc = run.set(a, 0, run.hard)
    if rc != SUCCESS:
        raise Incomplete(f"Set before the removal: {nvml_name(rc)}")
    if not run.cgroups.remove(a):
        raise Incomplete("the cgroup could not be removed")
    a = run.a = run.cgroups.make("a")  # the same path again
    got = run.get(a)
    r.check("removal_clears", no_limit(got), f"a cgroup made again at the removed one's path: Get {nvml_name(got[0])}, soft {got[1]}, hard {got[2]}")


def mps_running():
    names = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            comm = (read(f"/proc/{pid}/comm") or "").strip()
            if comm.startswith("nvidia-cuda-mps"):
                names.append(f"{comm} ({pid})")
    return names


def by_hand(nvml, argv):
    """`get PATH`, `set PATH SOFT_MIB HARD_MIB`, `clear PATH`: one cgroup's limits on GPU 0, the
    path used as given (a container's cgroup: docs/gpu.md). Exit 0 when each call succeeded."""
    command, path = argv[0], argv[1]
    ok = True
    if command in ("set", "clear"):
        soft, hard = (int(argv[2]) * MIB, int(argv[3]) * MIB) if command == "set" else (0, LIMIT_MAX)
        rc = nvml.set(path, soft, hard)
        print(f"{SET} {path} soft {soft} hard {'MAX' if hard == LIMIT_MAX else hard}: {nvml_name(rc)}", flush=True)
        ok = rc == SUCCESS
    rc, soft, hard, used = nvml.get(path)
    limits = f", soft {soft}, hard {'MAX' if hard == LIMIT_MAX else hard}, currentUsed {used} ({mib(used)})" if rc == SUCCESS else ""
    print(f"{GET} {path}: {nvml_name(rc)}{limits}", flush=True)
    for name in ("dmem.max", "dmem.min", "dmem.current"):
        text = read(os.path.join(path, name))
        lines = [line.strip() for line in (text or "").splitlines() if line.startswith("nvidia/")]
        print(f"{name}: {'; '.join(lines) if lines else ('(no such file)' if text is None else '(no nvidia/ line)')}", flush=True)
    return 0 if ok and rc in (SUCCESS, NOT_FOUND) else 1


def main(argv):
    hard = 2048 * MIB
    if argv[:1] == ["--hard-mib"] and len(argv) == 2 and argv[1].isdigit() and int(argv[1]) >= 64:
        hard = int(argv[1]) * MIB
    elif not (argv == [] or (argv[:1] in (["get"], ["clear"]) and len(argv) == 2) or (argv[:1] == ["set"] and len(argv) == 4)):
        raise SystemExit(__doc__)
    report = Report()
    print(f"date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} kernel: {os.uname().release}", flush=True)

    def skip(why):
        print(f"SKIP: {why}", flush=True)
        print("summary: SKIPPED, not a pass: nothing was tested", flush=True)
        return 0

    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as error:
        return skip(f"skipped: no NVIDIA driver here (libnvidia-ml.so.1: {error})")
    try:
        rc = lib.nvmlInit_v2()
    except AttributeError:
        rc = lib.nvmlInit()
    if rc != SUCCESS:
        return skip(f"skipped: nvmlInit_v2 answered {nvml_name(rc)}")
    nvml = Nvml(lib)
    version = nvml.driver_version()
    print(f"driver: {version} (CUDA {nvml.cuda_version()})", flush=True)
    missing = [name for name in (SET, GET) if not hasattr(lib, name)]
    if missing:
        return skip(f"skipped: driver {version} has no per-cgroup limits (its libnvidia-ml.so.1 has no {' or '.join(missing)})")
    rc = lib.nvmlDeviceGetHandleByIndex_v2(c_uint(0), ctypes.byref(nvml.dev))
    if rc != SUCCESS:
        return skip(f"skipped: no GPU 0 (nvmlDeviceGetHandleByIndex_v2: {nvml_name(rc)})")
    total, bus_id, mig = nvml.total(), nvml.bus_id(), nvml.mig_mode()
    print(f"gpu 0: {nvml.name()}, {mib(total)}, PCI {bus_id}, MIG mode {mig}", flush=True)
    if argv[:1] in (["get"], ["set"], ["clear"]):
        return by_hand(nvml, argv)
    if os.geteuid() != 0:
        return skip(f"skipped: driver {version} has {SET}, but setting a limit needs root: sudo python3 {sys.argv[0]}")
    root, mount_root = cgroup2_mount()
    if root is None:
        return skip(f"skipped: no cgroup2 mount (/proc/self/mountinfo): driver {version}'s limits need cgroup v2")
    hybrid = any(line.split(" - ")[1].split()[:1] == ["cgroup"] for line in (read("/proc/self/mountinfo") or "").splitlines() if " - " in line)
    print(f"cgroup2: {root} (the mount shows {mount_root} of the hierarchy; {'hybrid: v1 hierarchies mounted too' if hybrid else 'no v1 hierarchy mounted'})", flush=True)
    report.finding("driver_version", f"{version} (CUDA {nvml.cuda_version()}), kernel {os.uname().release}, {nvml.name()}")

    capacity = read(os.path.join(root, "dmem.capacity"))
    regions = set()
    if capacity is None:
        report.finding("dmem_capacity", f"no {root}/dmem.capacity: the kernel has no dmem controller (the driver's internal fallback applies); cgroup.controllers: {(read(os.path.join(root, 'cgroup.controllers')) or '?').strip()}")
    else:
        lines = [line.strip() for line in capacity.splitlines() if line.startswith("nvidia/")]
        want = parse_pci(bus_id or "")
        regions = {line.split()[0] for line in lines if want and parse_pci(line.split()[0].split("/")[1]) == want}
        report.finding("dmem_capacity", " | ".join(lines) if lines else f"{root}/dmem.capacity names no nvidia/ region ({len(capacity.splitlines())} lines)")
        report.finding("dmem_region_of_gpu_0", ", ".join(sorted(regions)) or f"none matches PCI {bus_id}")
        report.finding("dmem_in_root_subtree_control", (read(os.path.join(root, "cgroup.subtree_control")) or "?").strip() or "(empty)")
    mps = mps_running()
    report.finding("mps", ", ".join(mps) if mps else "no MPS daemon or server running: the limits below are measured without MPS")

    prctl(PR_SET_CHILD_SUBREAPER, 1)  # a forked child whose parent exits is reaped here

    def stopped(signum, _frame):
        print(f"INCOMPLETE run: stopped by signal {signum}; removing what it made", flush=True)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGHUP, stopped)
    cgroups = Cgroups(root)
    run = Run(nvml, report, cgroups, hard, total, bus_id, regions)
    skipped = None
    try:
        for name, part in (("contract", part_contract), ("limit", part_limit), ("fork", part_fork), ("ipc", part_ipc), ("pool", part_pool), ("clear", part_clear)):
            print(f"== {name}", flush=True)
            try:
                part(run)
            except Incomplete as gap:
                report.gap(name, str(gap))
            except OSError as error:
                report.gap(name, f"{type(error).__name__}: {error}")
            finally:
                run.end_workers()
            if name == "contract" and run.form is None:
                break
    except Skip as why:
        skipped = f"skipped: driver {version} has no per-cgroup limits on GPU 0 ({why}{'; MIG mode ' + mig if 'current 1' in mig else ''})"
    except Stop as why:
        report.gap("run", str(why))
    finally:
        run.end_workers()
        cgroups.remove_all()
    if skipped:
        return skip(skipped)
    print(
        f"summary: {report.checks} checks, {len(report.failed)} failed {report.failed}; {report.findings} findings; incomplete: {report.incomplete or 'none'}",
        flush=True,
    )
    return 1 if report.failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    sys.exit(main(sys.argv[1:]))
