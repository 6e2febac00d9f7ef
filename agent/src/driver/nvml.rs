//! NVML loaded with `libloading`, with `nvml.h`'s signatures ([`cuda_abi::nvml`]): init, the
//! devices, and each device's running processes (compute `_v3`, and graphics `_v3` when the
//! library has it). Used only from the driver task's reader thread ([`super::task`]).
use std::{
    collections::BTreeMap,
    ffi::{c_uint, CStr},
    path::{Path, PathBuf},
};

use cuda_abi::nvml::*;
use libloading::Library;

use super::{DriverProcess, State};

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
    /// Loads the first of `candidates` that exists and initializes it.
    pub fn open(candidates: &[PathBuf]) -> Result<Nvml, Trouble> {
        let Some(path) = candidates.iter().find(|path| path.exists()) else {
            let tried: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            return Err(Trouble::absent(format!("no {} at {}", super::LIBRARY, tried.join(", "))));
        };
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
            symbol::<NvmlInitV2>(&library, path, "nvmlInit_v2")?;
            Ok(Nvml { path: path.to_path_buf(), device_count, handle, compute, graphics, error_string, _library: library })
        }
    }

    /// The file loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// NVML's text for a result code.
    fn error(&self, rc: nvmlReturn_t) -> String {
        let text = self.error_string.and_then(|f| {
            // SAFETY: nvmlErrorString returns NULL or a static NUL-terminated string.
            let ptr = unsafe { f(rc) };
            // SAFETY: non-null, NUL-terminated and static, as above.
            (!ptr.is_null()).then(|| unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned())
        });
        format!("{} ({rc})", text.unwrap_or_else(|| "unknown".into()))
    }

    /// Every device's running processes: host pid -> bytes over devices.
    pub fn read(&self) -> Result<BTreeMap<u32, DriverProcess>, Trouble> {
        let mut count: c_uint = 0;
        // SAFETY: a valid out-pointer.
        let rc = unsafe { (self.device_count)(&mut count) };
        if rc != NVML_SUCCESS {
            return Err(Trouble::failing(format!("nvmlDeviceGetCount_v2: {}", self.error(rc))));
        }
        let mut processes: BTreeMap<u32, DriverProcess> = BTreeMap::new();
        for index in 0..count {
            let mut device: nvmlDevice_t = std::ptr::null_mut();
            // SAFETY: a valid out-pointer; `index` below the count NVML gave.
            let rc = unsafe { (self.handle)(index, &mut device) };
            if rc != NVML_SUCCESS {
                return Err(Trouble::failing(format!("nvmlDeviceGetHandleByIndex_v2({index}): {}", self.error(rc))));
            }
            // A process in both lists holds one amount (NVML reports its total in each).
            let mut on_device: BTreeMap<u32, u64> = BTreeMap::new();
            let lists = [Some((self.compute, "nvmlDeviceGetComputeRunningProcesses_v3")), self.graphics.map(|f| (f, "nvmlDeviceGetGraphicsRunningProcesses_v3"))];
            for (function, name) in lists.into_iter().flatten() {
                for info in self.list(function, device).map_err(|rc| Trouble::failing(format!("{name}({index}): {}", self.error(rc))))? {
                    if info.used_gpu_memory == NVML_VALUE_NOT_AVAILABLE {
                        continue;
                    }
                    let held = on_device.entry(info.pid).or_default();
                    *held = (*held).max(info.used_gpu_memory);
                }
            }
            for (pid, bytes) in on_device {
                let process = processes.entry(pid).or_default();
                process.bytes = process.bytes.saturating_add(bytes);
                process.devices += 1;
            }
        }
        Ok(processes)
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
