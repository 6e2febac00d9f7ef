//! A minimal fake NVML (`libnvidia-ml.so.1`), exported from the same library as the fake
//! driver: the e2e kit's driver directory links `libnvidia-ml.so.1` to it too. It covers what
//! a tool asks a GPU's memory with, and what pynvml-based tools (nvitop, gpustat) call at
//! start: `nvmlInit_v2` / `nvmlInit` / `nvmlInitWithFlags`, `nvmlShutdown`,
//! `nvmlSystemGetDriverVersion`, `nvmlSystemGetCudaDriverVersion(_v2)`,
//! `nvmlDeviceGetCount_v2`, `nvmlDeviceGetHandleByIndex_v2`, `nvmlDeviceGetIndex`,
//! `nvmlDeviceGetMinorNumber` (the index: device `i`'s file is `<node>-dev<i>`, as
//! `/dev/nvidia<minor>` is a real GPU's),
//! `nvmlDeviceGetName`, `nvmlDeviceGetUUID`, `nvmlDeviceGetMemoryInfo`,
//! `nvmlDeviceGetMemoryInfo_v2`, `nvmlDeviceGetComputeRunningProcesses_v3`,
//! `nvmlDeviceSetMemoryLimits_v1`, `nvmlDeviceGetMemoryLimits_v1` and
//! `nvmlErrorString`, with `nvml.h`'s signatures and result codes ([`cuda_abi::nvml`]).
//! A tool's other queries find no symbol, which pynvml reports as
//! `NVML_ERROR_FUNCTION_NOT_FOUND` and the tools show as N/A.
//!
//! Running processes are those with a channel: a process started with
//! `FAKECUDA_NO_CHANNEL=1` holds memory (in `used`) that no list shows, as a real driver
//! client without a channel does (docs/gpu.md). With `FAKECUDA_UNLISTED_BYTES` (in the
//! caller's environment), each row leaves that much of its process's memory out, as the real
//! driver's own memory beside each process's row is in `used` and in no row.
//!
//! Names are `NVIDIA H100 80GB HBM3` (the fake's devices are H100-like, see
//! [`crate::attributes`]); the driver version is `FAKECUDA_DRIVER_VERSION` as the process saw
//! it at init, `580.65.06` by default (a CUDA 13.0 driver; `nvmlSystemGetCudaDriverVersion`
//! says 13000 as `cuDriverGetVersion` does, 13040 for r615 and later). Running processes are
//! every live process's slot in the device file, with the bytes it holds (`usedGpuMemory`: its
//! contexts, allocations, VMM handles and pools' reserved memory through every copy of the
//! fake, a pool's going down at
//! the synchronize that releases it, and all of it when the last holder of the process's open
//! device file closes it: at its exit, or a forked child's, [`crate::devfile`]); the pids are those the processes have in
//! the caller's pid namespace, as the real NVML reports them (a process the caller cannot
//! see, in another container's namespace seen from inside one, is left out).
//!
//! Semantics, as the real library's:
//! * Like `nvidia-smi`, NVML needs no `cuInit`: `nvmlInit_v2` reads the `FAKECUDA_*`
//!   configuration and opens (or creates) every device's state file itself. Init calls are
//!   counted; the matching number of `nvmlShutdown`s ends the session, and every other call
//!   outside one is `NVML_ERROR_UNINITIALIZED` (`nvmlErrorString` excepted).
//! * Memory is the device's, machine-wide: `used` is what every live process holds (dead
//!   ones reaped first, as `fakecuda_device_usage` does), `free = total - used`; the v2
//!   struct must carry `nvmlMemory_v2` as its version (else
//!   `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`) and reports `reserved = 0` (the fake sets nothing
//!   aside).
//! * `nvmlDeviceGetUUID` writes `GPU-…` text of the 16 bytes `cuDeviceGetUuid_v2` returns
//!   for the same index; a buffer shorter than the text and its NUL is
//!   `NVML_ERROR_INSUFFICIENT_SIZE`.
//! * A GPU removed from the bus (unbound, hot-unplugged) is no longer counted: removing a
//!   device's state file (`<node>-dev<i>` in `FAKECUDA_STATE_DIR`) while NVML is initialized
//!   makes `nvmlDeviceGetCount_v2` count only the devices before it (the fake does not
//!   renumber those after it: remove the last one to remove one GPU). The count is read at
//!   each call, as the real one's after a removal.
//! * NULL out-pointers, indices past the device count and unknown device handles are
//!   `NVML_ERROR_INVALID_ARGUMENT`.
//!
//! # Per-cgroup memory limits (driver r615+, CUDA 13.4)
//!
//! `nvmlDeviceSetMemoryLimits_v1` and `nvmlDeviceGetMemoryLimits_v1` keep a soft and a hard
//! limit per (cgroup, device) in the node's limits file ([`crate::limits`]); every copy of
//! the fake libcuda refuses an allocation (of any kind it charges) that would take a cgroup
//! past its hard limit on the device, with `CUDA_ERROR_OUT_OF_MEMORY`. Checks, in this order:
//! * outside a session: `NVML_ERROR_UNINITIALIZED`;
//! * an unknown device handle, a NULL struct or a NULL `nameSpace`:
//!   `NVML_ERROR_INVALID_ARGUMENT`;
//! * a driver before r615 (`FAKECUDA_DRIVER_VERSION`'s major below 615, the default 580
//!   included): `NVML_ERROR_NOT_SUPPORTED`;
//! * set only: a caller whose effective uid is not 0: `NVML_ERROR_NO_PERMISSION`;
//! * a `nameSpace` that is not an existing directory of a cgroup2 file system under a cgroup2
//!   mount of the caller (`/proc/self/mountinfo`): `NVML_ERROR_OPERATING_SYSTEM` ("the cgroup
//!   path cannot be opened"; a removed cgroup's path is one);
//! * set only: soft above hard, or a limit above the device's memory (hard
//!   `NVML_DEVICE_MEMORY_LIMIT_MAX` is no limit and allowed): `NVML_ERROR_INVALID_ARGUMENT`;
//!   soft 0 with hard MAX clears the entry (clearing what is not set succeeds);
//! * get only: no entry for the cgroup and device, or one set on a cgroup removed since and
//!   made again at the same path (removing a cgroup clears its limits):
//!   `NVML_ERROR_NOT_FOUND`; else soft, hard and `currentUsed`.
//! * the limits file unreadable: `NVML_ERROR_UNKNOWN`.
//!
//! `currentUsed` is the sum of what every live process of the cgroup holds on the device:
//! the per-process figure of the device file (contexts, allocations, VMM, pools; the
//! `usedGpuMemory` above, with no `FAKECUDA_UNLISTED_BYTES` taken off), dead processes reaped
//! first; memory a forked child keeps after its parent died counts, in the parent's cgroup.
//! What the real r615 driver counts there (its own per-process memory? a process moved
//! between cgroups?) is owed to a run on a real GPU; so is whether it refuses with out of
//! memory at the limit exactly or earlier. The soft limit is stored and reported only.
//!
//! A knob for the tests of NVML's callers, read from the environment of the process that
//! loads the fake at each call: `FAKECUDA_NVML=absent` makes the init calls return
//! `NVML_ERROR_DRIVER_NOT_LOADED` (a node without the driver), `fail` makes every call after
//! a successful init return `NVML_ERROR_UNKNOWN`, `hang` makes every call but
//! `nvmlErrorString` sleep `FAKECUDA_NVML_HANG_MS` (default 10000) before it answers.
//!
//! Device handles are the addresses of a static array's elements, one per possible device.
//!
//! # Safety
//!
//! Every export is `unsafe` with the contract of its `nvml.h` declaration: pointer arguments
//! are NULL or valid for the documented access (a UUID buffer for `length` bytes).

// NVML's names and parameter names; the shared Safety section above covers every export.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::os::unix::ffi::OsStrExt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use cuda_abi::nvml::*;
use cuda_abi::gpu_uuid_text;

use crate::api::Api;
use crate::config::{Config, MAX_DEVICES};
use crate::cgroup::{self, Found};
use crate::devfile::{DeviceFile, FLAG_NO_CHANNEL};
use crate::driver::{self, count};
use crate::exports::device_uuid;
use crate::limits::{self, LimitsFile};
use crate::procinfo::{self, ProcId};

/// One NVML session of this process (between the first init and the last shutdown).
struct Nvml {
    refs: u32,
    cfg: Config,
    /// Opened by the process in `me` (reopened in a forked child, whose flock must be its own).
    devs: Vec<DeviceFile>,
    /// The node's per-cgroup limits (reopened in a forked child, as `devs`).
    limits: LimitsFile,
    me: ProcId,
}

static NVML: Mutex<Option<Nvml>> = Mutex::new(None);

/// Device handles: `&HANDLES[i]` is device `i`'s `nvmlDevice_t`.
static HANDLES: [u64; MAX_DEVICES as usize] = [0; MAX_DEVICES as usize];

type R<T> = Result<T, nvmlReturn_t>;

/// What `FAKECUDA_NVML` asks of this call (see the module doc): `Some(rc)` to fail with it.
fn knob(init: bool) -> Option<nvmlReturn_t> {
    match std::env::var("FAKECUDA_NVML").as_deref() {
        Ok("absent") if init => Some(NVML_ERROR_DRIVER_NOT_LOADED),
        Ok("fail") if !init => Some(NVML_ERROR_UNKNOWN),
        Ok("hang") => {
            let ms = std::env::var("FAKECUDA_NVML_HANG_MS").ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(10_000);
            std::thread::sleep(std::time::Duration::from_millis(ms));
            None
        }
        _ => None,
    }
}

fn lock() -> MutexGuard<'static, Option<Nvml>> {
    NVML.lock().unwrap_or_else(PoisonError::into_inner)
}

fn open_files(cfg: &Config) -> R<(Vec<DeviceFile>, LimitsFile)> {
    let reported = |e: crate::devfile::OpenError| {
        eprintln!("{}", e.message);
        NVML_ERROR_UNKNOWN
    };
    let devs = (0..cfg.device_count)
        .map(|i| DeviceFile::open_or_create(&cfg.state_dir, &cfg.node, i, cfg.device_bytes).map_err(reported))
        .collect::<R<Vec<_>>>()?;
    Ok((devs, LimitsFile::open_or_create(&cfg.state_dir, &cfg.node).map_err(reported)?))
}

impl Nvml {
    /// Reopens the device files and the limits file in a forked child.
    fn refresh(&mut self) -> R<()> {
        if self.me.pid != std::process::id() {
            (self.devs, self.limits) = open_files(&self.cfg)?;
            self.me = ProcId::current();
        }
        Ok(())
    }

    /// The devices on the bus: those before the first whose state file is gone (see the
    /// module doc).
    fn present(&self) -> usize {
        self.devs.iter().take_while(|d| d.path().exists()).count()
    }

    /// The index of a device handle.
    fn index(&self, device: nvmlDevice_t) -> R<usize> {
        HANDLES
            .iter()
            .position(|h| std::ptr::eq(h, device.cast_const().cast()))
            .filter(|&i| i < self.devs.len())
            .ok_or(NVML_ERROR_INVALID_ARGUMENT)
    }

    /// (total, used) of a device, across all processes.
    fn memory(&self, device: nvmlDevice_t) -> R<(u64, u64)> {
        let file = self.devs.get(self.index(device)?).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let (used, total) = driver::usage_of(file, &self.me).map_err(|_| NVML_ERROR_UNKNOWN)?;
        Ok((total, used.min(total)))
    }

    /// The checks both limits calls begin with, in order (module doc): the device (its
    /// index), the caller's struct (read), its `nameSpace`, the feature, root (for `root`),
    /// the cgroup the `nameSpace` names.
    ///
    /// # Safety
    /// `limits` must be NULL or valid for a read of `T`, whose `nameSpace` (`name_space` gives
    /// it) is NULL or a NUL-terminated string.
    unsafe fn limits_args<T>(&self, device: nvmlDevice_t, limits: *mut T, name_space: impl Fn(&T) -> *const c_char, root: bool) -> R<(usize, T, Found)> {
        let i = self.index(device)?;
        if limits.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and valid for a read per this function's contract.
        let l = unsafe { limits.read() };
        let ns = name_space(&l);
        if ns.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if !self.cfg.driver_version.has_memory_limits() {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        // SAFETY: geteuid has no preconditions.
        if root && unsafe { libc::geteuid() } != 0 {
            return Err(NVML_ERROR_NO_PERMISSION);
        }
        // SAFETY: non-null and NUL-terminated per this function's contract.
        let path = std::ffi::OsStr::from_bytes(unsafe { CStr::from_ptr(ns) }.to_bytes());
        let cg = cgroup::resolve(std::path::Path::new(path), self.limits.mounts()).ok_or(NVML_ERROR_OPERATING_SYSTEM)?;
        Ok((i, l, cg))
    }
}

/// Runs `f` in this process's NVML session: the frame of every export but init and
/// `nvmlErrorString`.
fn with_nvml(api: Api, f: impl FnOnce(&mut Nvml) -> R<()>) -> nvmlReturn_t {
    count(api);
    if let Some(rc) = knob(false) {
        return rc;
    }
    let mut guard = lock();
    let (rc, trace) = match guard.as_mut() {
        Some(n) => (n.refresh().and_then(|()| f(n)).err().unwrap_or(NVML_SUCCESS), n.cfg.trace),
        None => (NVML_ERROR_UNINITIALIZED, false),
    };
    drop(guard);
    if trace {
        eprintln!("fakecuda[{}]: {} -> {}", std::process::id(), api.name(), error_text(rc));
    }
    rc
}

/// Writes `value` through a caller's out-pointer, or fails on NULL.
///
/// # Safety
/// `ptr` must be NULL or valid for a write of `T` (the C caller's contract).
unsafe fn out<T>(ptr: *mut T, value: T) -> R<()> {
    if ptr.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and valid for writes per this function's contract.
    unsafe { ptr.write(value) };
    Ok(())
}

fn init(api: Api) -> nvmlReturn_t {
    count(api);
    if let Some(rc) = knob(true) {
        return rc;
    }
    let mut guard = lock();
    if let Some(n) = guard.as_mut() {
        n.refs = n.refs.saturating_add(1);
        return NVML_SUCCESS;
    }
    let cfg = match Config::from_env() {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("{e}");
            return NVML_ERROR_UNKNOWN;
        }
    };
    match open_files(&cfg) {
        Ok((devs, limits)) => {
            *guard = Some(Nvml { refs: 1, cfg, devs, limits, me: ProcId::current() });
            NVML_SUCCESS
        }
        Err(e) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    init(Api::NvmlInitV2)
}

/// The pre-v2 init (the same here: the fake has no devices NVML could fail to attach).
#[no_mangle]
pub unsafe extern "C" fn nvmlInit() -> nvmlReturn_t {
    init(Api::NvmlInit)
}

/// Flags (`NVML_INIT_FLAG_NO_GPUS`, `NVML_INIT_FLAG_NO_ATTACH`) change nothing here.
#[no_mangle]
pub unsafe extern "C" fn nvmlInitWithFlags(flags: c_uint) -> nvmlReturn_t {
    let _ = flags;
    init(Api::NvmlInitWithFlags)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    count(Api::NvmlShutdown);
    let mut guard = lock();
    match guard.as_mut() {
        None => NVML_ERROR_UNINITIALIZED,
        Some(n) if n.refs > 1 => {
            n.refs -= 1;
            NVML_SUCCESS
        }
        Some(_) => {
            *guard = None;
            NVML_SUCCESS
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(deviceCount: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: the caller passes NULL or a valid unsigned int pointer.
    with_nvml(Api::NvmlDeviceGetCountV2, |n| unsafe { out(deviceCount, n.present() as c_uint) })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    with_nvml(Api::NvmlDeviceGetHandleByIndexV2, |n| {
        let i = usize::try_from(index).ok().filter(|&i| i < n.devs.len()).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let handle = HANDLES.get(i).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        // SAFETY: the caller passes NULL or a valid nvmlDevice_t pointer.
        unsafe { out(device, (handle as *const u64).cast_mut().cast()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint) -> nvmlReturn_t {
    with_nvml(Api::NvmlDeviceGetUuid, |n| {
        let i = n.index(device)?;
        let text = gpu_uuid_text(&device_uuid(&n.cfg.node, i));
        // SAFETY: the caller passes NULL or a buffer of `length` bytes.
        unsafe { write_text(uuid, length, &text) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> nvmlReturn_t {
    with_nvml(Api::NvmlDeviceGetMemoryInfo, |n| {
        let (total, used) = n.memory(device)?;
        // SAFETY: the caller passes NULL or a valid nvmlMemory_t pointer.
        unsafe { out(memory, nvmlMemory_t { total, free: total - used, used }) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) -> nvmlReturn_t {
    with_nvml(Api::NvmlDeviceGetMemoryInfoV2, |n| {
        let (total, used) = n.memory(device)?;
        if memory.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and the caller passes a valid nvmlMemory_v2_t pointer.
        let version = unsafe { (*memory).version };
        if version != NVML_MEMORY_V2 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let value = nvmlMemory_v2_t { version, total, reserved: 0, free: total - used, used };
        // SAFETY: as above.
        unsafe { out(memory, value) }
    })
}

/// The device name NVML reports.
pub const DEVICE_NAME: &str = "NVIDIA H100 80GB HBM3";

/// Copies `text` and a NUL into a caller's buffer of `length` bytes.
///
/// # Safety
/// `buf` must be NULL or valid for `length` bytes of writes.
unsafe fn write_text(buf: *mut c_char, length: c_uint, text: &str) -> R<()> {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (length as usize) < text.len() + 1 {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: the buffer holds `length` bytes, at least the text and its NUL.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, text.len());
        buf.add(text.len()).write(0);
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    // SAFETY: the caller passes NULL or a buffer of `length` bytes.
    with_nvml(Api::NvmlSystemGetDriverVersion, |n| unsafe { write_text(version, length, n.cfg.driver_version.text()) })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> nvmlReturn_t {
    // SAFETY: the caller passes NULL or a valid int pointer.
    with_nvml(Api::NvmlSystemGetCudaDriverVersion, |n| unsafe { out(version, n.cfg.driver_version.cuda_version()) })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    // SAFETY: the caller passes NULL or a valid int pointer.
    with_nvml(Api::NvmlSystemGetCudaDriverVersionV2, |n| unsafe { out(version, n.cfg.driver_version.cuda_version()) })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(device: nvmlDevice_t, name: *mut c_char, length: c_uint) -> nvmlReturn_t {
    with_nvml(Api::NvmlDeviceGetName, |n| {
        n.index(device)?;
        // SAFETY: the caller passes NULL or a buffer of `length` bytes.
        unsafe { write_text(name, length, DEVICE_NAME) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    with_nvml(Api::NvmlDeviceGetIndex, |n| {
        let i = n.index(device)?;
        // SAFETY: the caller passes NULL or a valid unsigned int pointer.
        unsafe { out(index, i as c_uint) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minorNumber: *mut c_uint) -> nvmlReturn_t {
    with_nvml(Api::NvmlDeviceGetMinorNumber, |n| {
        let i = n.index(device)?;
        // SAFETY: the caller passes NULL or a valid unsigned int pointer.
        unsafe { out(minorNumber, i as c_uint) }
    })
}

/// As NVML: with `*infoCount` too small (or `infos` NULL while processes exist) the count
/// needed is written and `NVML_ERROR_INSUFFICIENT_SIZE` returned.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    with_nvml(Api::NvmlDeviceGetComputeRunningProcessesV3, |n| {
        let file = n.devs.get(n.index(device)?).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        if infoCount.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let holders = {
            let lock = file.lock().map_err(|_| NVML_ERROR_UNKNOWN)?;
            file.reap(&lock, &n.me);
            file.holders(&lock)
        };
        // Pids as the caller sees them; processes it cannot see are left out.
        // Clients without a channel are not running processes to NVML (their memory is in
        // the device's `used` all the same); a listed process's row leaves out
        // `FAKECUDA_UNLISTED_BYTES` of what it holds, as the real driver's rows do.
        let unlisted = n.cfg.unlisted_bytes;
        let procs: Vec<(u32, u64)> = holders
            .iter()
            .filter(|(_, _, flags)| flags & FLAG_NO_CHANNEL == 0)
            .filter_map(|(owner, bytes, _)| Some((procinfo::pid_seen_by(owner, &n.me)?, bytes.saturating_sub(unlisted))))
            .collect();
        // SAFETY: non-null, and the caller passes a valid unsigned int pointer.
        let room = unsafe { infoCount.read() } as usize;
        // SAFETY: as above.
        unsafe { infoCount.write(procs.len() as c_uint) };
        if procs.is_empty() {
            return Ok(());
        }
        if infos.is_null() || room < procs.len() {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        for (i, (pid, bytes)) in procs.into_iter().enumerate() {
            let info = nvmlProcessInfo_t { pid, used_gpu_memory: bytes, gpu_instance_id: u32::MAX, compute_instance_id: u32::MAX };
            // SAFETY: `i < procs.len() <= room`: inside the caller's array of `room` entries.
            unsafe { infos.add(i).write(info) };
        }
        Ok(())
    })
}

/// Sets (or clears) a cgroup's memory limits on a device (module doc: the checks, in order).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceSetMemoryLimits_v1(device: nvmlDevice_t, limits: *mut nvmlSetMemoryLimits_v1_t) -> nvmlReturn_t {
    with_nvml(Api::NvmlDeviceSetMemoryLimitsV1, |n| {
        // SAFETY: the caller passes NULL or a valid struct whose nameSpace is NULL or a path.
        let (i, l, cg) = unsafe { n.limits_args(device, limits, |l| l.name_space, true) }?;
        let total = n.devs.get(i).ok_or(NVML_ERROR_INVALID_ARGUMENT)?.total();
        let hard_ok = l.hard_limit <= total || l.hard_limit == NVML_DEVICE_MEMORY_LIMIT_MAX;
        if l.soft_limit > l.hard_limit || l.soft_limit > total || !hard_ok {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let mark = |entries: &[limits::Entry]| {
            for (d, file) in (0u32..).zip(&n.devs) {
                file.set_limited(entries.iter().filter(|e| e.dev == d).count() as u32);
            }
        };
        n.limits.set(&cg, i as u32, l.soft_limit, l.hard_limit, mark).map_err(|e| {
            eprintln!("fakecuda: cannot set the limits of cgroup {}: {e}", cg.rel);
            NVML_ERROR_UNKNOWN
        })
    })
}

/// A cgroup's memory limits on a device, and what its processes hold there (module doc).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryLimits_v1(device: nvmlDevice_t, limits: *mut nvmlGetMemoryLimits_v1_t) -> nvmlReturn_t {
    with_nvml(Api::NvmlDeviceGetMemoryLimitsV1, |n| {
        // SAFETY: the caller passes NULL or a valid struct whose nameSpace is NULL or a path.
        let (i, mut l, cg) = unsafe { n.limits_args(device, limits, |l| l.name_space, false) }?;
        let unknown = |e: std::io::Error| {
            eprintln!("fakecuda: cannot read the cgroup limits: {e}");
            NVML_ERROR_UNKNOWN
        };
        let entry = n.limits.get(&cg, i as u32).map_err(unknown)?.ok_or(NVML_ERROR_NOT_FOUND)?;
        let file = n.devs.get(i).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let used = {
            let lock = file.lock().map_err(|_| NVML_ERROR_UNKNOWN)?;
            file.reap(&lock, &n.me);
            file.cgroup_used(&lock, entry.key)
        };
        (l.soft_limit, l.hard_limit, l.current_used) = (entry.soft, entry.hard, used);
        // SAFETY: non-null (checked above) and valid for writes per the caller's contract.
        unsafe { out(limits, l) }
    })
}

/// Descriptions of the result codes the fake returns (NVML's wording).
const ERRORS: &[(nvmlReturn_t, &CStr)] = &[
    (NVML_SUCCESS, c"Success"),
    (NVML_ERROR_UNINITIALIZED, c"Uninitialized"),
    (NVML_ERROR_INVALID_ARGUMENT, c"Invalid Argument"),
    (NVML_ERROR_NOT_SUPPORTED, c"Not Supported"),
    (NVML_ERROR_NO_PERMISSION, c"Insufficient Permissions"),
    (NVML_ERROR_NOT_FOUND, c"Not Found"),
    (NVML_ERROR_INSUFFICIENT_SIZE, c"Insufficient Size"),
    (NVML_ERROR_DRIVER_NOT_LOADED, c"Driver Not Loaded"),
    (NVML_ERROR_LIBRARY_NOT_FOUND, c"NVML Shared Library Not Found"),
    (NVML_ERROR_FUNCTION_NOT_FOUND, c"Function Not Found"),
    (NVML_ERROR_OPERATING_SYSTEM, c"Operating System Error"),
    (NVML_ERROR_ARGUMENT_VERSION_MISMATCH, c"Argument Version Mismatch"),
];

fn error_cstr(result: nvmlReturn_t) -> &'static CStr {
    ERRORS.iter().find(|(code, _)| *code == result).map(|(_, text)| *text).unwrap_or(c"Unknown Error")
}

fn error_text(result: nvmlReturn_t) -> &'static str {
    error_cstr(result).to_str().unwrap_or("Unknown Error")
}

/// A static description of any result code (works outside an NVML session).
#[no_mangle]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    count(Api::NvmlErrorString);
    error_cstr(result).as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_answers_like_nvml() {
        let dir = std::env::temp_dir().join(format!("fakecuda-nvml-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        // The only test in this binary that reads the environment.
        std::env::set_var("FAKECUDA_STATE_DIR", &dir);
        std::env::set_var("FAKECUDA_NODE", "nvml-unit");
        std::env::set_var("FAKECUDA_DEVICE_COUNT", "2");
        std::env::set_var("FAKECUDA_DEVICE_BYTES", "3g");
        // SAFETY (all calls below): valid out-pointers and buffers of the stated lengths.
        unsafe {
            let mut count: c_uint = 0;
            assert_eq!(nvmlDeviceGetCount_v2(&mut count), NVML_ERROR_UNINITIALIZED);
            assert_eq!(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
            assert_eq!(nvmlInit_v2(), NVML_SUCCESS);
            assert_eq!(nvmlInit(), NVML_SUCCESS);
            assert_eq!(nvmlDeviceGetCount_v2(&mut count), NVML_SUCCESS);
            assert_eq!(count, 2);
            assert_eq!(nvmlDeviceGetCount_v2(std::ptr::null_mut()), NVML_ERROR_INVALID_ARGUMENT);
            let mut dev: nvmlDevice_t = std::ptr::null_mut();
            assert_eq!(nvmlDeviceGetHandleByIndex_v2(2, &mut dev), NVML_ERROR_INVALID_ARGUMENT);
            assert_eq!(nvmlDeviceGetHandleByIndex_v2(1, std::ptr::null_mut()), NVML_ERROR_INVALID_ARGUMENT);
            assert_eq!(nvmlDeviceGetHandleByIndex_v2(1, &mut dev), NVML_SUCCESS);

            let mut buf = [0 as c_char; NVML_DEVICE_UUID_BUFFER_SIZE];
            assert_eq!(nvmlDeviceGetUUID(dev, buf.as_mut_ptr(), 40), NVML_ERROR_INSUFFICIENT_SIZE);
            assert_eq!(nvmlDeviceGetUUID(dev, std::ptr::null_mut(), 80), NVML_ERROR_INVALID_ARGUMENT);
            assert_eq!(nvmlDeviceGetUUID(dev, buf.as_mut_ptr(), 41), NVML_SUCCESS);
            let text = CStr::from_ptr(buf.as_ptr()).to_str().expect("ASCII");
            assert_eq!(text, gpu_uuid_text(&device_uuid("nvml-unit", 1)));

            let mut v1 = nvmlMemory_t::default();
            assert_eq!(nvmlDeviceGetMemoryInfo(dev, &mut v1), NVML_SUCCESS);
            assert_eq!(v1, nvmlMemory_t { total: 3 << 30, free: 3 << 30, used: 0 });
            assert_eq!(nvmlDeviceGetMemoryInfo(dev, std::ptr::null_mut()), NVML_ERROR_INVALID_ARGUMENT);
            let bogus = (&HANDLES[7] as *const u64).cast_mut().cast();
            assert_eq!(nvmlDeviceGetMemoryInfo(bogus, &mut v1), NVML_ERROR_INVALID_ARGUMENT);
            let mut v2 = nvmlMemory_v2_t::default();
            assert_eq!(nvmlDeviceGetMemoryInfo_v2(dev, &mut v2), NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
            v2.version = NVML_MEMORY_V2;
            assert_eq!(nvmlDeviceGetMemoryInfo_v2(dev, &mut v2), NVML_SUCCESS);
            assert_eq!((v2.total, v2.reserved, v2.free, v2.used), (3 << 30, 0, 3 << 30, 0));

            assert_eq!(CStr::from_ptr(nvmlErrorString(NVML_ERROR_INSUFFICIENT_SIZE)), c"Insufficient Size");
            assert_eq!(CStr::from_ptr(nvmlErrorString(12345)), c"Unknown Error");
            assert_eq!(nvmlShutdown(), NVML_SUCCESS);
            assert_eq!(nvmlDeviceGetCount_v2(&mut count), NVML_SUCCESS, "one init is still open");
            assert_eq!(nvmlShutdown(), NVML_SUCCESS);
            assert_eq!(nvmlDeviceGetCount_v2(&mut count), NVML_ERROR_UNINITIALIZED);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
