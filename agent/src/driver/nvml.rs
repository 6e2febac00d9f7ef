//! NVML loaded with `libloading`, with `nvml.h`'s signatures ([`cuda_abi::nvml`]): init, the
//! devices, and each device's running processes (compute `_v3`, and graphics `_v3` when the
//! library has it); a GPU in MIG mode is read per MIG device (see [`super`]). Where the
//! library has them, each GPU's minor number (`nvmlDeviceGetMinorNumber`: its device file,
//! [`super::holders`]), UUID, product name and memory (`nvmlDeviceGetMemoryInfo`) are read too.
//! Where the driver has them (r615 and later), the per-cgroup memory limits
//! (`nvmlDeviceSetMemoryLimits_v1`, `nvmlDeviceGetMemoryLimits_v1`, [`Nvml::set_limit`],
//! [`Nvml::get_limit`]). Each thread that calls NVML owns an [`Nvml`] of its own: the driver
//! task's reader thread ([`super::task`]) and the limits thread
//! ([`crate::driver_limits`]); NVML counts its inits.
use std::{
    collections::BTreeMap,
    ffi::{c_uint, CStr},
    path::{Path, PathBuf},
};

use cuda_abi::nvml::*;
use libloading::Library;

use super::{DeviceMemory, MigDevice, Read, State};

/// `nvmlDeviceGetMinorNumber`.
type NvmlDeviceGetMinorNumber = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetUUID`.
type NvmlDeviceGetUuid = unsafe extern "C" fn(nvmlDevice_t, *mut std::ffi::c_char, c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetName` (same shape as `nvmlDeviceGetUUID`).
type NvmlDeviceGetName = NvmlDeviceGetUuid;
/// `nvmlDeviceGetMemoryInfo`.
type NvmlDeviceGetMemoryInfo = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;

/// `nvmlDeviceGetMigMode` (current and pending mode).
type NvmlDeviceGetMigMode = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetMaxMigDeviceCount`.
type NvmlDeviceGetMaxMigDeviceCount = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetMigDeviceHandleByIndex`.
type NvmlDeviceGetMigDeviceHandleByIndex = unsafe extern "C" fn(nvmlDevice_t, c_uint, *mut nvmlDevice_t) -> nvmlReturn_t;
/// `NVML_DEVICE_MIG_ENABLE`.
const NVML_DEVICE_MIG_ENABLE: c_uint = 1;

/// Most processes asked for per device and call (a device holds a few hundred at most).
const MAX_PROCESSES: usize = 4096;

/// A loaded, initialized NVML.
pub struct Nvml {
    path: PathBuf,
    device_count: NvmlDeviceGetCountV2,
    handle: NvmlDeviceGetHandleByIndexV2,
    compute: NvmlDeviceGetRunningProcessesV3,
    graphics: Option<NvmlDeviceGetRunningProcessesV3>,
    error_string: Option<NvmlErrorString>,
    /// Absent from NVMLs older than MIG: no GPU is then taken for one in MIG mode.
    mig_mode: Option<NvmlDeviceGetMigMode>,
    /// What reads a MIG GPU's instances, if the library has both.
    mig_devices: Option<(NvmlDeviceGetMaxMigDeviceCount, NvmlDeviceGetMigDeviceHandleByIndex)>,
    minor: Option<NvmlDeviceGetMinorNumber>,
    uuid: Option<NvmlDeviceGetUuid>,
    name: Option<NvmlDeviceGetName>,
    memory: Option<NvmlDeviceGetMemoryInfo>,
    /// Both per-cgroup limit functions, where the library has both (drivers r615 and later).
    limits: Option<(NvmlDeviceSetMemoryLimitsV1, NvmlDeviceGetMemoryLimitsV1)>,
    /// Keeps the functions above loaded; last, so it is dropped after them.
    _library: Library,
}

/// Why NVML gave no view: the state it puts the driver view in, and the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trouble {
    pub state: State,
    pub reason: String,
}

impl Trouble {
    fn absent(reason: String) -> Trouble {
        Trouble { state: State::Absent, reason }
    }

    fn failing(reason: String) -> Trouble {
        Trouble { state: State::Failing, reason }
    }
}

impl Nvml {
    /// Loads and initializes the first of `candidates` that exists and does (a library that
    /// cannot be loaded or initialized, say a stale copy of another driver version, gives way
    /// to the next); where none does, the trouble of the first that failed (one whose NVML
    /// failed rather than was absent, if any: a driver there that errs is not a node without
    /// one), the others' said after it.
    pub fn open(candidates: &[PathBuf]) -> Result<Nvml, Trouble> {
        let mut troubles: Vec<Trouble> = Vec::new();
        for path in candidates.iter().filter(|path| path.exists()) {
            match Nvml::open_one(path) {
                Ok(nvml) => return Ok(nvml),
                Err(trouble) => troubles.push(trouble),
            }
        }
        if let Some(failing) = troubles.iter().position(|trouble| trouble.state == State::Failing) {
            let first = troubles.remove(failing);
            troubles.insert(0, first);
        }
        let mut troubles = troubles.into_iter();
        let Some(mut first) = troubles.next() else {
            let tried: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            return Err(Trouble::absent(format!("no {} at {}", super::LIBRARY, tried.join(", "))));
        };
        for other in troubles {
            first.reason = format!("{}; then {}", first.reason, other.reason);
        }
        Err(first)
    }

    fn open_one(path: &Path) -> Result<Nvml, Trouble> {
        let nvml = Nvml::load(path)?;
        // SAFETY: nvmlInit_v2 takes no argument; the library stays loaded while `nvml` lives.
        let rc = unsafe { (nvml.init_fn()?)() };
        if rc != NVML_SUCCESS {
            let reason = format!("nvmlInit_v2 in {}: {}", path.display(), nvml.error(rc));
            // No driver behind the library (a node without GPUs, a fake without devices).
            let absent = matches!(rc, NVML_ERROR_DRIVER_NOT_LOADED | NVML_ERROR_LIBRARY_NOT_FOUND);
            return Err(if absent { Trouble::absent(reason) } else { Trouble::failing(reason) });
        }
        Ok(nvml)
    }

    fn init_fn(&self) -> Result<NvmlInitV2, Trouble> {
        // SAFETY: the symbol has nvml.h's nvmlInit_v2 signature.
        unsafe { symbol::<NvmlInitV2>(&self._library, &self.path, "nvmlInit_v2") }
    }

    fn load(path: &Path) -> Result<Nvml, Trouble> {
        // SAFETY: loading runs the library's initializers: the operator's NVML, the one beside
        // the operator's libcuda, or one at the system's install paths (root-owned).
        let library = unsafe { Library::new(path) }.map_err(|error| Trouble::absent(format!("cannot load {}: {error}", path.display())))?;
        // SAFETY (each symbol): looked up by its nvml.h name, with that declaration's type.
        unsafe {
            let device_count = symbol::<NvmlDeviceGetCountV2>(&library, path, "nvmlDeviceGetCount_v2")?;
            let handle = symbol::<NvmlDeviceGetHandleByIndexV2>(&library, path, "nvmlDeviceGetHandleByIndex_v2")?;
            let compute = symbol::<NvmlDeviceGetRunningProcessesV3>(&library, path, "nvmlDeviceGetComputeRunningProcesses_v3")?;
            let graphics = symbol::<NvmlDeviceGetRunningProcessesV3>(&library, path, "nvmlDeviceGetGraphicsRunningProcesses_v3").ok();
            let error_string = symbol::<NvmlErrorString>(&library, path, "nvmlErrorString").ok();
            let mig_mode = symbol::<NvmlDeviceGetMigMode>(&library, path, "nvmlDeviceGetMigMode").ok();
            let max_mig = symbol::<NvmlDeviceGetMaxMigDeviceCount>(&library, path, "nvmlDeviceGetMaxMigDeviceCount").ok();
            let mig_handle = symbol::<NvmlDeviceGetMigDeviceHandleByIndex>(&library, path, "nvmlDeviceGetMigDeviceHandleByIndex").ok();
            let minor = symbol::<NvmlDeviceGetMinorNumber>(&library, path, "nvmlDeviceGetMinorNumber").ok();
            let uuid = symbol::<NvmlDeviceGetUuid>(&library, path, "nvmlDeviceGetUUID").ok();
            let name = symbol::<NvmlDeviceGetName>(&library, path, "nvmlDeviceGetName").ok();
            let memory = symbol::<NvmlDeviceGetMemoryInfo>(&library, path, "nvmlDeviceGetMemoryInfo").ok();
            let set_limits = symbol::<NvmlDeviceSetMemoryLimitsV1>(&library, path, "nvmlDeviceSetMemoryLimits_v1").ok();
            let get_limits = symbol::<NvmlDeviceGetMemoryLimitsV1>(&library, path, "nvmlDeviceGetMemoryLimits_v1").ok();
            symbol::<NvmlInitV2>(&library, path, "nvmlInit_v2")?;
            Ok(Nvml {
                path: path.to_path_buf(),
                device_count,
                handle,
                compute,
                graphics,
                error_string,
                mig_mode,
                mig_devices: max_mig.zip(mig_handle),
                minor,
                uuid,
                name,
                memory,
                limits: set_limits.zip(get_limits),
                _library: library,
            })
        }
    }

    /// The file loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// NVML's text for a result code.
    pub fn error(&self, rc: nvmlReturn_t) -> String {
        let text = self.error_string.and_then(|f| {
            // SAFETY: nvmlErrorString returns NULL or a static NUL-terminated string.
            let ptr = unsafe { f(rc) };
            // SAFETY: non-null, NUL-terminated and static, as above.
            (!ptr.is_null()).then(|| unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned())
        });
        format!("{} ({rc})", text.unwrap_or_else(|| "unknown".into()))
    }

    /// Every device's running processes: host pid -> bytes over devices (start times are
    /// the caller's to fill in), the GPUs in MIG mode, and each GPU's memory.
    pub fn read(&self) -> Result<Read, Trouble> {
        let mut count: c_uint = 0;
        // SAFETY: a valid out-pointer.
        let rc = unsafe { (self.device_count)(&mut count) };
        if rc != NVML_SUCCESS {
            return Err(Trouble::failing(format!("nvmlDeviceGetCount_v2: {}", self.error(rc))));
        }
        let mut read = Read::default();
        for index in 0..count {
            let mut device: nvmlDevice_t = std::ptr::null_mut();
            // SAFETY: a valid out-pointer; `index` below the count NVML gave.
            let rc = unsafe { (self.handle)(index, &mut device) };
            if rc != NVML_SUCCESS {
                return Err(Trouble::failing(format!("nvmlDeviceGetHandleByIndex_v2({index}): {}", self.error(rc))));
            }
            let described = self.describe(index, device);
            if !self.in_mig_mode(device) {
                let infos = self.processes_of(device).map_err(|reason| Trouble::failing(format!("{reason} on device {index}")))?;
                let described = add_device(&mut read, described, &infos);
                read.devices.push(described);
                continue;
            }
            // Each MIG device on its own; the parent's aggregate list never.
            let mut mig = MigDevice { index, instances: 0, unread: None };
            let instances = self.mig_instances(device).and_then(|handles| {
                handles.into_iter().map(|handle| self.processes_of(handle)).collect::<Result<Vec<_>, String>>()
            });
            match instances {
                Ok(lists) => {
                    mig.instances = lists.len() as u32;
                    // The GPU's memory against the rows of all its instances (a GPU whose
                    // instances are not read has no rows to compare, and is left out).
                    let mut described = described;
                    for infos in &lists {
                        let instance = add_device(&mut read, DeviceMemory { listed: 0, unfigured: 0, processes: 0, ..described.clone() }, infos);
                        described.listed = described.listed.saturating_add(instance.listed);
                        described.unfigured += instance.unfigured;
                        described.processes += instance.processes;
                    }
                    read.devices.push(described);
                }
                Err(reason) => mig.unread = Some(format!("{reason}: the processes of this GPU in MIG mode are left out")),
            }
            read.mig.push(mig);
        }
        Ok(read)
    }

    /// A GPU's minor number (its index where NVML has none), UUID (empty where it has none)
    /// and memory (where NVML answers), before its processes are added.
    fn describe(&self, index: c_uint, device: nvmlDevice_t) -> DeviceMemory {
        let mut minor: c_uint = index;
        if let Some(get) = self.minor {
            let mut got: c_uint = 0;
            // SAFETY: a handle NVML gave and a valid out-pointer.
            if unsafe { get(device, &mut got) } == NVML_SUCCESS {
                minor = got;
            }
        }
        let uuid = self.uuid.and_then(|get| text(get, device, NVML_DEVICE_UUID_V2_BUFFER_SIZE));
        let name = self.name.and_then(|get| text(get, device, NVML_DEVICE_NAME_V2_BUFFER_SIZE));
        let memory = self.memory.and_then(|get| {
            let mut info = nvmlMemory_t::default();
            // SAFETY: a handle NVML gave and a valid out-pointer.
            (unsafe { get(device, &mut info) } == NVML_SUCCESS).then_some((info.total, info.used))
        });
        DeviceMemory { index, minor, uuid: uuid.unwrap_or_default(), name: name.unwrap_or_default(), memory, listed: 0, unfigured: 0, processes: 0, gap: Default::default() }
    }

    /// Whether `device` is a GPU in MIG mode (false without `nvmlDeviceGetMigMode`, and for a
    /// GPU that does not support MIG).
    fn in_mig_mode(&self, device: nvmlDevice_t) -> bool {
        let Some(mig_mode) = self.mig_mode else { return false };
        let (mut current, mut pending): (c_uint, c_uint) = (0, 0);
        // SAFETY: a handle NVML gave and two valid out-pointers.
        let rc = unsafe { mig_mode(device, &mut current, &mut pending) };
        rc == NVML_SUCCESS && current == NVML_DEVICE_MIG_ENABLE
    }

    /// The MIG devices of a GPU in MIG mode.
    fn mig_instances(&self, device: nvmlDevice_t) -> Result<Vec<nvmlDevice_t>, String> {
        let Some((max_count, by_index)) = self.mig_devices else {
            return Err(format!("{} has no nvmlDeviceGetMaxMigDeviceCount or nvmlDeviceGetMigDeviceHandleByIndex", self.path.display()));
        };
        let mut max: c_uint = 0;
        // SAFETY: a handle NVML gave and a valid out-pointer.
        let rc = unsafe { max_count(device, &mut max) };
        if rc != NVML_SUCCESS {
            return Err(format!("nvmlDeviceGetMaxMigDeviceCount: {}", self.error(rc)));
        }
        let mut handles = Vec::new();
        for index in 0..max {
            let mut handle: nvmlDevice_t = std::ptr::null_mut();
            // SAFETY: a handle NVML gave, an index below its maximum, a valid out-pointer.
            match unsafe { by_index(device, index, &mut handle) } {
                NVML_SUCCESS => handles.push(handle),
                NVML_ERROR_NOT_FOUND => {} // no MIG device at this index
                rc => return Err(format!("nvmlDeviceGetMigDeviceHandleByIndex({index}): {}", self.error(rc))),
            }
        }
        Ok(handles)
    }

    /// One device's (or MIG device's) compute and graphics processes.
    fn processes_of(&self, device: nvmlDevice_t) -> Result<Vec<nvmlProcessInfo_t>, String> {
        let lists = [Some((self.compute, "nvmlDeviceGetComputeRunningProcesses_v3")), self.graphics.map(|f| (f, "nvmlDeviceGetGraphicsRunningProcesses_v3"))];
        let mut all = Vec::new();
        for (function, name) in lists.into_iter().flatten() {
            all.extend(self.list(function, device).map_err(|rc| format!("{name}: {}", self.error(rc)))?);
        }
        Ok(all)
    }

    /// One device's list: asked with room for what NVML said it has, again if it grew.
    fn list(&self, function: NvmlDeviceGetRunningProcessesV3, device: nvmlDevice_t) -> Result<Vec<nvmlProcessInfo_t>, nvmlReturn_t> {
        let mut room = 16usize;
        for _ in 0..4 {
            let mut infos = vec![nvmlProcessInfo_t::default(); room];
            let mut count = room as c_uint;
            // SAFETY: `infos` holds `count` entries; both pointers valid for the call.
            let rc = unsafe { function(device, &mut count, infos.as_mut_ptr()) };
            match rc {
                NVML_SUCCESS => {
                    infos.truncate((count as usize).min(room));
                    return Ok(infos);
                }
                NVML_ERROR_INSUFFICIENT_SIZE if (count as usize) > room => room = (count as usize + 8).min(MAX_PROCESSES),
                _ => return Err(rc),
            }
        }
        Err(NVML_ERROR_INSUFFICIENT_SIZE)
    }
}

/// A GPU as the limits side addresses it: its minor number, whether it is in MIG mode
/// (NVML takes no MIG handle for limits) and its handle (valid while its [`Nvml`] lives).
pub struct LimitDevice {
    pub minor: u32,
    pub mig: bool,
    /// Its memory, where NVML says (a limit above it is refused).
    pub memory: Option<u64>,
    handle: nvmlDevice_t,
}

/// A cgroup's limits on one device as the driver reads them back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupLimit {
    pub soft: u64,
    pub hard: u64,
    /// What the cgroup's processes hold on the device, as the driver counts it.
    pub used: u64,
}

/// A per-cgroup limit call that did not succeed: its result code and NVML's text for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitError {
    pub rc: nvmlReturn_t,
    pub text: String,
}

impl Nvml {
    /// Whether the library has both per-cgroup limit functions.
    pub fn has_limits(&self) -> bool {
        self.limits.is_some()
    }

    /// The GPUs, in NVML's order, as the limits side addresses them.
    pub fn limit_devices(&self) -> Result<Vec<LimitDevice>, String> {
        let mut count: c_uint = 0;
        // SAFETY: a valid out-pointer.
        let rc = unsafe { (self.device_count)(&mut count) };
        if rc != NVML_SUCCESS {
            return Err(format!("nvmlDeviceGetCount_v2: {}", self.error(rc)));
        }
        (0..count)
            .map(|index| {
                let mut handle: nvmlDevice_t = std::ptr::null_mut();
                // SAFETY: a valid out-pointer; `index` below the count NVML gave.
                let rc = unsafe { (self.handle)(index, &mut handle) };
                if rc != NVML_SUCCESS {
                    return Err(format!("nvmlDeviceGetHandleByIndex_v2({index}): {}", self.error(rc)));
                }
                let described = self.describe(index, handle);
                Ok(LimitDevice { minor: described.minor, mig: self.in_mig_mode(handle), memory: described.memory.map(|(total, _)| total), handle })
            })
            .collect()
    }

    /// `nvmlDeviceGetMemoryLimits_v1` for the cgroup directory `cgroup` (its full sysfs
    /// path): `None` where the driver has no limit for it (`NVML_ERROR_NOT_FOUND`).
    pub fn get_limit(&self, device: &LimitDevice, cgroup: &CStr) -> Result<Option<CgroupLimit>, LimitError> {
        let Some((_, get)) = self.limits else { return Err(self.no_limits()) };
        let mut limits = nvmlGetMemoryLimits_v1_t { name_space: cgroup.as_ptr(), soft_limit: 0, hard_limit: 0, current_used: 0 };
        // SAFETY: a handle NVML gave; the struct is valid for the call and its path a
        // NUL-terminated string that outlives it.
        match unsafe { get(device.handle, &mut limits) } {
            NVML_SUCCESS => Ok(Some(CgroupLimit { soft: limits.soft_limit, hard: limits.hard_limit, used: limits.current_used })),
            NVML_ERROR_NOT_FOUND => Ok(None),
            rc => Err(LimitError { rc, text: self.error(rc) }),
        }
    }

    /// `nvmlDeviceSetMemoryLimits_v1` for the cgroup directory `cgroup` (its full sysfs path).
    pub fn set_limit(&self, device: &LimitDevice, cgroup: &CStr, soft: u64, hard: u64) -> Result<(), LimitError> {
        let Some((set, _)) = self.limits else { return Err(self.no_limits()) };
        let mut limits = nvmlSetMemoryLimits_v1_t { name_space: cgroup.as_ptr(), soft_limit: soft, hard_limit: hard };
        // SAFETY: as in `get_limit`.
        match unsafe { set(device.handle, &mut limits) } {
            NVML_SUCCESS => Ok(()),
            rc => Err(LimitError { rc, text: self.error(rc) }),
        }
    }

    fn no_limits(&self) -> LimitError {
        LimitError { rc: NVML_ERROR_FUNCTION_NOT_FOUND, text: format!("{} has no nvmlDeviceSetMemoryLimits_v1 (a driver before r615)", self.path.display()) }
    }
}

/// Adds one device's processes (compute and graphics lists together) to `read`: a process in
/// both lists holds one amount on the device (NVML reports its total in each). A row without
/// a figure (`NVML_VALUE_NOT_AVAILABLE`) is counted (`unfigured`, and the pid in
/// `read.unfigured`), never taken for 0 bytes. Each row's pid is noted against the device's
/// minor number. Returns `device` with the sum of the figures listed on it.
fn add_device(read: &mut Read, mut device: DeviceMemory, infos: &[nvmlProcessInfo_t]) -> DeviceMemory {
    let mut on_device: BTreeMap<u32, u64> = BTreeMap::new();
    for info in infos {
        let minors = read.minors.entry(info.pid).or_default();
        if !minors.contains(&device.minor) {
            minors.push(device.minor);
        }
        if info.used_gpu_memory == NVML_VALUE_NOT_AVAILABLE {
            device.unfigured += 1;
            if !read.unfigured.contains(&info.pid) {
                read.unfigured.push(info.pid);
            }
            continue;
        }
        let held = on_device.entry(info.pid).or_default();
        *held = (*held).max(info.used_gpu_memory);
    }
    for (pid, bytes) in on_device {
        device.listed = device.listed.saturating_add(bytes);
        device.processes += 1;
        let process = read.processes.entry(pid).or_default();
        process.bytes = process.bytes.saturating_add(bytes);
        process.devices += 1;
    }
    device
}

/// A device's text (UUID, name) through `get`, into a buffer of `size` bytes.
fn text(get: NvmlDeviceGetUuid, device: nvmlDevice_t, size: usize) -> Option<String> {
    let mut buf = vec![0 as std::ffi::c_char; size];
    // SAFETY: a handle NVML gave and a buffer of the length passed.
    let rc = unsafe { get(device, buf.as_mut_ptr(), buf.len() as c_uint) };
    // SAFETY: NVML wrote a NUL-terminated string into the buffer; the last byte is set to NUL
    // first so that a library that did not cannot make the read run on.
    (rc == NVML_SUCCESS).then(|| {
        buf[size - 1] = 0;
        unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
    })
}

/// `name` from `library` as a `T` (copied out: valid while the library stays loaded).
///
/// # Safety
/// `T` must be the function type of the symbol's C declaration.
unsafe fn symbol<T: Copy>(library: &Library, path: &Path, name: &str) -> Result<T, Trouble> {
    // SAFETY: per this function's contract.
    unsafe { library.get::<T>(name.as_bytes()) }
        .map(|symbol| *symbol)
        .map_err(|error| Trouble::absent(format!("{} has no {name}: {error}", path.display())))
}

#[cfg(test)]
mod tests {
    //! The read path over a stand-in NVML: device 0 is a GPU in MIG mode with MIG devices at
    //! indices 0 and 2 (none at 1), device 1 a plain GPU. Handles are small numbers.
    use std::ffi::c_void;

    use super::*;

    const MIB: u64 = 1 << 20;

    fn as_handle(n: usize) -> nvmlDevice_t {
        n as *mut c_void
    }

    unsafe extern "C" fn count(n: *mut c_uint) -> nvmlReturn_t {
        // SAFETY: the reader passes a valid out-pointer.
        unsafe { *n = 2 };
        NVML_SUCCESS
    }

    unsafe extern "C" fn handle(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
        // SAFETY: as above.
        unsafe { *device = as_handle(index as usize + 1) };
        NVML_SUCCESS
    }

    unsafe extern "C" fn mig_mode(device: nvmlDevice_t, current: *mut c_uint, pending: *mut c_uint) -> nvmlReturn_t {
        if device as usize != 1 {
            return NVML_ERROR_NOT_SUPPORTED;
        }
        // SAFETY: as above.
        unsafe { (*current, *pending) = (NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE) };
        NVML_SUCCESS
    }

    unsafe extern "C" fn max_mig(_: nvmlDevice_t, n: *mut c_uint) -> nvmlReturn_t {
        // SAFETY: as above.
        unsafe { *n = 3 };
        NVML_SUCCESS
    }

    unsafe extern "C" fn mig_handle(_: nvmlDevice_t, index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
        if index == 1 {
            return NVML_ERROR_NOT_FOUND;
        }
        // SAFETY: as above.
        unsafe { *device = as_handle(0x10 + index as usize) };
        NVML_SUCCESS
    }

    unsafe extern "C" fn compute(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t {
        let rows: &[(u32, u64)] = match device as usize {
            // The MIG GPU's aggregate list: never to be read.
            1 => &[(100, 999 * MIB)],
            2 => &[(200, 10 * MIB)],
            0x10 => &[(100, 5 * MIB), (101, MIB)],
            0x12 => &[(100, 7 * MIB)],
            _ => &[],
        };
        // SAFETY: `count` valid; `infos` holds `*count` entries (the reader's contract).
        unsafe {
            if (*count as usize) < rows.len() {
                *count = rows.len() as c_uint;
                return NVML_ERROR_INSUFFICIENT_SIZE;
            }
            for (i, (pid, bytes)) in rows.iter().enumerate() {
                *infos.add(i) = nvmlProcessInfo_t { pid: *pid, used_gpu_memory: *bytes, ..Default::default() };
            }
            *count = rows.len() as c_uint;
        }
        NVML_SUCCESS
    }

    fn stand_in(mig_devices: bool) -> Nvml {
        Nvml {
            path: PathBuf::from("stand-in"),
            device_count: count,
            handle,
            compute,
            graphics: None,
            error_string: None,
            mig_mode: Some(mig_mode),
            mig_devices: mig_devices.then_some((max_mig as NvmlDeviceGetMaxMigDeviceCount, mig_handle as NvmlDeviceGetMigDeviceHandleByIndex)),
            minor: None,
            uuid: None,
            name: None,
            memory: None,
            limits: None,
            _library: Library::from(libloading::os::unix::Library::this()),
        }
    }

    #[test]
    fn a_gpu_in_mig_mode_is_read_per_mig_device_never_from_its_aggregate() {
        let read = stand_in(true).read().expect("read");
        let got: Vec<(u32, u64, u32)> = read.processes.iter().map(|(pid, p)| (*pid, p.bytes, p.devices)).collect();
        // 100 on two MIG devices (a context on each), 101 on one, 200 on the plain GPU.
        assert_eq!(got, [(100, 12 * MIB, 2), (101, MIB, 1), (200, 10 * MIB, 1)]);
        assert_eq!(read.mig, [MigDevice { index: 0, instances: 2, unread: None }]);

        // Without the MIG device functions: the MIG GPU's processes are left out, and why.
        let read = stand_in(false).read().expect("read");
        assert_eq!(read.processes.keys().copied().collect::<Vec<_>>(), [200]);
        let unread = read.mig[0].unread.clone().unwrap_or_default();
        assert!(unread.contains("nvmlDeviceGetMigDeviceHandleByIndex") && unread.contains("left out"), "{unread}");
    }

    #[test]
    fn a_candidate_that_cannot_be_loaded_gives_way_to_the_next_and_every_trouble_is_said() {
        let dir = std::env::temp_dir().join(format!("vramguard-nvml-open-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (stale, broken) = (dir.join("stale/libnvidia-ml.so.1"), dir.join("broken/libnvidia-ml.so.1"));
        for file in [&stale, &broken] {
            std::fs::create_dir_all(file.parent().expect("parent")).expect("dir");
            std::fs::write(file, b"not a library").expect("write");
        }
        let missing = dir.join("missing/libnvidia-ml.so.1");
        let trouble = Nvml::open(&[missing.clone(), stale.clone(), broken.clone()]).err().expect("no candidate loads");
        assert_eq!(trouble.state, State::Absent);
        let (first, then) = trouble.reason.split_once("; then ").expect("both said");
        assert!(first.contains(&format!("cannot load {}", stale.display())), "{}", trouble.reason);
        assert!(then.contains(&format!("cannot load {}", broken.display())), "{}", trouble.reason);
        assert!(!trouble.reason.contains("missing"), "a missing file is not tried: {}", trouble.reason);
        let trouble = Nvml::open(std::slice::from_ref(&missing)).err().expect("none there");
        assert!(trouble.reason.starts_with("no libnvidia-ml.so.1 at") && trouble.reason.contains("missing"), "{}", trouble.reason);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
