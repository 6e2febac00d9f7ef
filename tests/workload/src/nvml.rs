//! NVML the way a monitoring tool reaches it: `dlopen("libnvidia-ml.so.1")` (so
//! `LD_LIBRARY_PATH` decides which NVML; in the global scope, as a library a program links
//! against is), `nvmlInit_v2`, and each entry point by `dlsym` on that library's handle or,
//! for the `global` form of `nvml-meminfo`, by `dlsym(RTLD_DEFAULT, …)` as a program linked
//! against NVML binds (a preloaded library's export comes first there). Signatures are
//! `nvml.h`'s; types and constants come from [`cuda_abi::nvml`].

use std::ffi::{c_char, c_uint, c_void, CStr, CString};

use cuda_abi::nvml::*;
use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

type MemoryInfo = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;
type MemoryInfoV2 = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_v2_t) -> nvmlReturn_t;

/// An NVML failure: the call and its result.
pub struct NvmlError {
    pub call: &'static str,
    pub code: nvmlReturn_t,
}

type R<T> = Result<T, NvmlError>;

/// The loaded and initialised NVML.
pub struct Nvml {
    lib: Library,
    error_string: Option<unsafe extern "C" fn(nvmlReturn_t) -> *const c_char>,
}

/// Both memory queries' answers.
pub struct Meminfo {
    pub v1: nvmlMemory_t,
    pub v2: nvmlMemory_v2_t,
}

impl Nvml {
    /// `dlopen("libnvidia-ml.so.1")` and `nvmlInit_v2`.
    pub fn load() -> Result<Nvml, String> {
        // SAFETY: loading a shared library runs its initialisers; NVML is meant for that.
        let lib = unsafe { Library::open(Some("libnvidia-ml.so.1"), RTLD_NOW | RTLD_GLOBAL) }
            .map_err(|e| format!("cannot load libnvidia-ml.so.1: {e}"))?;
        // SAFETY: the type is nvmlErrorString's signature in nvml.h.
        let error_string = unsafe { lib.get::<unsafe extern "C" fn(nvmlReturn_t) -> *const c_char>(b"nvmlErrorString") }
            .ok()
            .map(|s| *s);
        let nvml = Nvml { lib, error_string };
        // SAFETY: the type is nvmlInit_v2's signature in nvml.h.
        let init = unsafe { nvml.lib.get::<unsafe extern "C" fn() -> nvmlReturn_t>(b"nvmlInit_v2") }
            .map_err(|e| format!("libnvidia-ml.so.1 has no nvmlInit_v2: {e}"))?;
        // SAFETY: nvmlInit_v2 takes no arguments.
        let rc = unsafe { init() };
        if rc != NVML_SUCCESS {
            return Err(format!("nvmlInit_v2: {rc} {}", nvml.error_text(rc)));
        }
        Ok(nvml)
    }

    /// NVML's description of a result code.
    pub fn error_text(&self, code: nvmlReturn_t) -> String {
        let Some(f) = self.error_string else { return format!("NVML error {code}") };
        // SAFETY: nvmlErrorString returns NULL or a static NUL-terminated string.
        let text = unsafe { f(code) };
        if text.is_null() {
            return format!("NVML error {code}");
        }
        // SAFETY: non-null, a static NUL-terminated string.
        unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
    }

    /// The address of `name`: on NVML's handle, or in the global scope.
    fn symbol(&self, name: &'static str, global: bool) -> R<*mut c_void> {
        let missing = || NvmlError { call: name, code: NVML_ERROR_FUNCTION_NOT_FOUND };
        let address = if global {
            let c_name = CString::new(name).map_err(|_| missing())?;
            // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name.
            unsafe { libc::dlsym(libc::RTLD_DEFAULT, c_name.as_ptr()) }
        } else {
            // SAFETY: the symbol is only used as an address here.
            unsafe { self.lib.get::<*mut c_void>(name.as_bytes()) }.map(|s| *s).unwrap_or(std::ptr::null_mut())
        };
        if address.is_null() {
            Err(missing())
        } else {
            Ok(address)
        }
    }

    fn memory_info(&self, global: bool) -> R<MemoryInfo> {
        let address = self.symbol("nvmlDeviceGetMemoryInfo", global)?;
        // SAFETY: the symbol of that name has this signature in nvml.h.
        Ok(unsafe { std::mem::transmute::<*mut c_void, MemoryInfo>(address) })
    }

    fn memory_info_v2(&self, global: bool) -> R<MemoryInfoV2> {
        let address = self.symbol("nvmlDeviceGetMemoryInfo_v2", global)?;
        // SAFETY: the symbol of that name has this signature in nvml.h.
        Ok(unsafe { std::mem::transmute::<*mut c_void, MemoryInfoV2>(address) })
    }

    /// `nvmlDeviceGetHandleByIndex_v2`.
    pub fn device(&self, index: u32) -> R<nvmlDevice_t> {
        let address = self.symbol("nvmlDeviceGetHandleByIndex_v2", false)?;
        type F = unsafe extern "C" fn(c_uint, *mut nvmlDevice_t) -> nvmlReturn_t;
        // SAFETY: the symbol of that name has this signature in nvml.h.
        let f = unsafe { std::mem::transmute::<*mut c_void, F>(address) };
        let mut device: nvmlDevice_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        match unsafe { f(index, &mut device) } {
            NVML_SUCCESS => Ok(device),
            code => Err(NvmlError { call: "nvmlDeviceGetHandleByIndex_v2", code }),
        }
    }

    /// `nvmlDeviceGetUUID` of device `index`.
    pub fn uuid(&self, index: u32) -> R<String> {
        let device = self.device(index)?;
        let address = self.symbol("nvmlDeviceGetUUID", false)?;
        type F = unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t;
        // SAFETY: the symbol of that name has this signature in nvml.h.
        let f = unsafe { std::mem::transmute::<*mut c_void, F>(address) };
        let mut buffer = [0 as c_char; NVML_DEVICE_UUID_V2_BUFFER_SIZE];
        // SAFETY: a live buffer of the length passed.
        match unsafe { f(device, buffer.as_mut_ptr(), buffer.len() as c_uint) } {
            NVML_SUCCESS => {
                let bytes = buffer.map(|c| c as u8);
                let text = CStr::from_bytes_until_nul(&bytes).map_err(|_| NvmlError { call: "nvmlDeviceGetUUID", code: NVML_ERROR_UNKNOWN })?;
                Ok(text.to_string_lossy().into_owned())
            }
            code => Err(NvmlError { call: "nvmlDeviceGetUUID", code }),
        }
    }

    /// `nvmlDeviceGetMemoryInfo` and `nvmlDeviceGetMemoryInfo_v2` of device `index`.
    pub fn meminfo(&self, index: u32, global: bool) -> R<Meminfo> {
        let device = self.device(index)?;
        let (v1_fn, v2_fn) = (self.memory_info(global)?, self.memory_info_v2(global)?);
        let mut v1 = nvmlMemory_t::default();
        // SAFETY: NVML's device handle and a valid out-pointer.
        let rc = unsafe { v1_fn(device, &mut v1) };
        if rc != NVML_SUCCESS {
            return Err(NvmlError { call: "nvmlDeviceGetMemoryInfo", code: rc });
        }
        let mut v2 = nvmlMemory_v2_t { version: NVML_MEMORY_V2, ..Default::default() };
        // SAFETY: as above, with the version nvml.h requires.
        let rc = unsafe { v2_fn(device, &mut v2) };
        if rc != NVML_SUCCESS {
            return Err(NvmlError { call: "nvmlDeviceGetMemoryInfo_v2", code: rc });
        }
        Ok(Meminfo { v1, v2 })
    }

    /// `nvmlDeviceGetComputeRunningProcesses_v3` of device `index`: (pid, used bytes) of each
    /// process (asked with room for 64, the most a test runs at once).
    pub fn processes(&self, index: u32) -> R<Vec<(u32, u64)>> {
        let device = self.device(index)?;
        let name = "nvmlDeviceGetComputeRunningProcesses_v3";
        let address = self.symbol(name, false)?;
        // SAFETY: the symbol of that name has this signature in nvml.h.
        let f = unsafe { std::mem::transmute::<*mut c_void, NvmlDeviceGetRunningProcessesV3>(address) };
        let mut infos = [nvmlProcessInfo_t::default(); 64];
        let mut count = infos.len() as c_uint;
        // SAFETY: a live array of `count` entries and a valid count pointer.
        match unsafe { f(device, &mut count, infos.as_mut_ptr()) } {
            NVML_SUCCESS => Ok(infos.iter().take(count as usize).map(|i| (i.pid, i.used_gpu_memory)).collect()),
            code => Err(NvmlError { call: name, code }),
        }
    }

    /// The result codes of both memory queries with a NULL struct, and of the v2 one with a
    /// struct of version 0.
    pub fn null_codes(&self, index: u32) -> R<(nvmlReturn_t, nvmlReturn_t, nvmlReturn_t)> {
        let device = self.device(index)?;
        let (v1_fn, v2_fn) = (self.memory_info(false)?, self.memory_info_v2(false)?);
        let mut unversioned = nvmlMemory_v2_t::default();
        // SAFETY: NULL out-pointers, which NVML must answer with an error and never write
        // through; then a valid struct of a version NVML must refuse.
        unsafe {
            Ok((
                v1_fn(device, std::ptr::null_mut()),
                v2_fn(device, std::ptr::null_mut()),
                v2_fn(device, &mut unversioned),
            ))
        }
    }
}
