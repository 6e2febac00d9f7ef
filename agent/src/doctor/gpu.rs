//! NVML's side: the library (found as `run` finds it), the driver's version, the driver's
//! per-cgroup limits (r615+: both functions, and a Get on the cgroup2 root that the driver
//! answers), the GPUs in MIG mode, and each GPU NVML lists against the device files.
use std::{
    collections::BTreeMap,
    ffi::{c_char, c_uint, CStr, CString},
    os::unix::fs::FileTypeExt,
    path::{Path, PathBuf},
    time::Duration,
};

use cuda_abi::nvml::{nvmlReturn_t, NVML_ERROR_NOT_SUPPORTED, NVML_SUCCESS, NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE};

use super::Check;
use crate::driver::{self, nvml::Nvml, MigDevice, State};

/// How long NVML may take to answer all the questions (a hung driver is a finding too).
pub const NVML_BUDGET: Duration = Duration::from_secs(20);

/// The driver's control files every NVML and CUDA process opens beside a GPU's own.
const CONTROL_FILES: [&str; 2] = ["nvidiactl", "nvidia-uvm"];

/// `nvmlSystemGetDriverVersion(char *version, unsigned int length)`.
type NvmlSystemGetDriverVersion = unsafe extern "C" fn(*mut c_char, c_uint) -> nvmlReturn_t;

/// A GPU as NVML lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    pub index: u32,
    pub minor: u32,
    pub name: String,
}

/// What a Get of the cgroup2 root's limits on one GPU said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// Success or `NOT_FOUND`: the driver takes limits on this GPU.
    Takes,
    /// A GPU in MIG mode (NVML takes no MIG device for limits): not asked.
    Mig,
    /// Another answer: its code and NVML's text.
    Refused(nvmlReturn_t, String),
}

/// Whether the driver takes per-cgroup limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Limits {
    /// The library lacks `nvmlDeviceSetMemoryLimits_v1` or `nvmlDeviceGetMemoryLimits_v1`.
    NoFunctions,
    /// No cgroup2 mount to ask with.
    NoCgroup2,
    /// The GPUs could not be listed for it.
    Unread(String),
    /// Each GPU's minor number and the answer.
    PerGpu(Vec<(u32, Probe)>),
}

/// What a loaded NVML said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    pub library: PathBuf,
    pub version: Result<String, String>,
    pub gpus: Result<Vec<Gpu>, String>,
    pub mig: Vec<MigDevice>,
    pub limits: Limits,
}

/// What a device file is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum File {
    Missing,
    CharDevice,
    Other,
}

/// What the GPU checks read.
#[derive(Clone, Debug)]
pub struct Facts {
    /// NVML, or why none: its state (`absent`, `failing`, `hung`) and the reason.
    pub nvml: Result<Loaded, (State, String)>,
    pub dev_dir: PathBuf,
    /// The device files asked about, by name.
    pub files: BTreeMap<String, File>,
}

impl Facts {
    /// Loads NVML as `run` would (`--nvml`, else beside `--libcuda`, else where the driver's
    /// install under the host's `root` has it, else the usual places), on a thread of its
    /// own, waiting [`NVML_BUDGET`] at most; then looks at the device files.
    pub fn read(nvml: Option<&Path>, libcuda: &[PathBuf], root: &Path, dev_dir: &Path) -> Facts {
        let installed = driver::install::find(root);
        let candidates = driver::locate(nvml, libcuda, Some(&installed));
        let (sender, receiver) = std::sync::mpsc::channel();
        let asked = std::thread::Builder::new().name("vramguard-doctor-nvml".into()).spawn(move || {
            let _ = sender.send(ask(&candidates));
        });
        let nvml = match asked {
            Ok(_) => receiver
                .recv_timeout(NVML_BUDGET)
                .unwrap_or_else(|_| Err((State::Hung, format!("NVML did not answer within {NVML_BUDGET:?}")))),
            Err(error) => Err((State::Failing, format!("cannot start a thread for NVML: {error}"))),
        };
        let mut names: Vec<String> = CONTROL_FILES.map(str::to_owned).to_vec();
        if let Ok(Ok(gpus)) = nvml.as_ref().map(|n| &n.gpus) {
            names.extend(gpus.iter().map(|gpu| format!("nvidia{}", gpu.minor)));
        }
        let files = names
            .into_iter()
            .map(|name| {
                let file = match std::fs::metadata(dev_dir.join(&name)) {
                    Ok(meta) if meta.file_type().is_char_device() => File::CharDevice,
                    Ok(_) => File::Other,
                    Err(_) => File::Missing,
                };
                (name, file)
            })
            .collect();
        Facts { nvml, dev_dir: dev_dir.to_path_buf(), files }
    }
}

/// Everything asked of NVML, on the calling thread.
fn ask(candidates: &[PathBuf]) -> Result<Loaded, (State, String)> {
    let nvml = Nvml::open(candidates).map_err(|trouble| (trouble.state, trouble.reason))?;
    let read = nvml.read();
    let gpus = read.as_ref().map(|r| r.devices.iter().map(|d| Gpu { index: d.index, minor: d.minor, name: d.name.clone() }).collect()).map_err(|t| t.reason.clone());
    let mig = read.map(|r| r.mig).unwrap_or_default();
    let limits = if !nvml.has_limits() {
        Limits::NoFunctions
    } else if let Some(root) = crate::cgroup::cgroup2_mount() {
        let probe = CString::new(root.as_os_str().as_encoded_bytes()).unwrap_or_default();
        match nvml.limit_devices() {
            Ok(devices) => Limits::PerGpu(
                devices
                    .iter()
                    .map(|device| {
                        let answer = if device.mig {
                            Probe::Mig
                        } else {
                            match nvml.get_limit(device, &probe) {
                                Ok(_) => Probe::Takes,
                                Err(error) => Probe::Refused(error.rc, error.text),
                            }
                        };
                        (device.minor, answer)
                    })
                    .collect(),
            ),
            Err(reason) => Limits::Unread(reason),
        }
    } else {
        Limits::NoCgroup2
    };
    Ok(Loaded { library: nvml.path().to_path_buf(), version: driver_version(&nvml), gpus, mig, limits })
}

/// `nvmlSystemGetDriverVersion` of the library `nvml` loaded (and initialized).
fn driver_version(nvml: &Nvml) -> Result<String, String> {
    // SAFETY: the file `nvml` has loaded: opening it again takes another reference to the same
    // library, whose initializers have run.
    let library = unsafe { libloading::Library::new(nvml.path()) }.map_err(|error| format!("cannot load {}: {error}", nvml.path().display()))?;
    // SAFETY: looked up by its nvml.h name, with that declaration's type.
    let get = unsafe { library.get::<NvmlSystemGetDriverVersion>(b"nvmlSystemGetDriverVersion") }.map_err(|error| format!("no nvmlSystemGetDriverVersion: {error}"))?;
    let mut buf = vec![0 as c_char; NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    // SAFETY: a buffer of the length passed; NVML is initialized while `nvml` lives.
    let rc = unsafe { get(buf.as_mut_ptr(), buf.len() as c_uint) };
    if rc != NVML_SUCCESS {
        return Err(format!("nvmlSystemGetDriverVersion: {}", nvml.error(rc)));
    }
    buf[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE - 1] = 0;
    // SAFETY: NUL-terminated (the last byte at least).
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

pub fn checks(facts: &Facts) -> Vec<Check> {
    vec![nvml(facts), driver_limits(facts), mig(facts), device_files(facts)]
}

/// The driver's version for a line: `driver 580.65.06`, or why it is unknown.
fn version_of(loaded: &Loaded) -> String {
    loaded.version.as_ref().map(|v| format!("driver {v}")).unwrap_or_else(|error| format!("driver version unknown ({error})"))
}

/// The GPUs NVML listed, where it did and listed some.
fn gpus(facts: &Facts) -> Option<&[Gpu]> {
    facts.nvml.as_ref().ok().and_then(|n| n.gpus.as_deref().ok())
}

pub fn nvml(facts: &Facts) -> Check {
    let loaded = match &facts.nvml {
        Ok(loaded) => loaded,
        Err((State::Absent, reason)) => {
            return Check::warn(
                "nvml",
                format!("no NVML: {reason}; the agent runs without the driver's view (memory the probes miss, the driver's limits)"),
                "give --nvml (or --libcuda beside it); in the pod, keep the `driver` volume and `runtimeClassName: nvidia` (or CDI)",
            )
        }
        Err((_, reason)) => {
            return Check::fail("nvml", format!("NVML does not work: {reason}"), "check the driver on the host (`nvidia-smi`); in the pod, the device files the NVIDIA runtime gives it")
        }
    };
    let library = loaded.library.display();
    match &loaded.gpus {
        Err(reason) => Check::fail("nvml", format!("{library}: {}; reading the GPUs: {reason}", version_of(loaded)), "check the driver on the host (`nvidia-smi`)"),
        Ok(gpus) if gpus.is_empty() => Check::warn("nvml", format!("{library}: {}, no GPU listed", version_of(loaded)), "check that this node has GPUs the driver sees (`nvidia-smi -L`)"),
        Ok(gpus) => {
            let listed: Vec<String> = gpus.iter().map(|g| format!("{} {}", g.index, if g.name.is_empty() { "(no name)" } else { &g.name })).collect();
            Check::ok("nvml", format!("{library}: {}, {} GPU(s): {}", version_of(loaded), gpus.len(), listed.join(", ")))
        }
    }
}

pub fn driver_limits(facts: &Facts) -> Check {
    /// Said for a driver without the limits, whichever way it shows it.
    const BEFORE_615: &str = "quotas held by the hook and probes only";
    const UPGRADE: &str = "a driver r615 or later holds each provisioned container to its quota itself (nothing to do otherwise)";
    let Ok(loaded) = &facts.nvml else {
        return Check::warn("driver-limits", "not checked: no NVML", "see the nvml line");
    };
    let version = version_of(loaded);
    match &loaded.limits {
        Limits::NoFunctions => Check::warn("driver-limits", format!("{version}: driver before r615: {BEFORE_615} (no nvmlDeviceSetMemoryLimits_v1)"), UPGRADE),
        Limits::NoCgroup2 => Check::warn("driver-limits", "no cgroup v2 mount: the driver's limits are set on cgroup v2 directories", "see the cgroups line"),
        Limits::Unread(reason) => Check::warn("driver-limits", format!("cannot list the GPUs: {reason}"), "see the nvml line"),
        Limits::PerGpu(gpus) => {
            let takes: Vec<String> = gpus.iter().filter(|(_, p)| *p == Probe::Takes).map(|(minor, _)| minor.to_string()).collect();
            let mut not: Vec<String> = Vec::new();
            let mut unsupported = false;
            for (minor, probe) in gpus {
                match probe {
                    Probe::Takes => {}
                    Probe::Mig => not.push(format!("GPU {minor}: MIG mode (NVML takes no MIG device for limits)")),
                    Probe::Refused(rc, text) => {
                        unsupported |= *rc == NVML_ERROR_NOT_SUPPORTED;
                        not.push(format!("GPU {minor}: nvmlDeviceGetMemoryLimits_v1 answers {text}"));
                    }
                }
            }
            match (not.is_empty(), unsupported) {
                (true, _) if takes.is_empty() => Check::warn("driver-limits", "no GPU to set limits on", "see the nvml line"),
                (true, _) => Check::ok("driver-limits", format!("{version}: the driver takes per-cgroup limits on GPU(s) {}", takes.join(", "))),
                (false, true) => Check::warn("driver-limits", format!("{version}: driver before r615: {BEFORE_615} ({})", not.join("; ")), UPGRADE),
                (false, false) => Check::warn("driver-limits", format!("{version}: not on every GPU: {}; {BEFORE_615} there", not.join("; ")), "see docs/provisioning.md, \"The driver's own limit\""),
            }
        }
    }
}

pub fn mig(facts: &Facts) -> Check {
    let Ok(loaded) = &facts.nvml else {
        return Check::warn("mig", "not checked: no NVML", "see the nvml line");
    };
    if loaded.mig.is_empty() {
        return Check::ok("mig", "no GPU in MIG mode");
    }
    let said: Vec<String> = loaded
        .mig
        .iter()
        .map(|m| match &m.unread {
            None => format!("GPU {} in MIG mode, read per MIG device ({} read)", m.index, m.instances),
            Some(reason) => format!("GPU {} in MIG mode: {reason}", m.index),
        })
        .collect();
    if loaded.mig.iter().any(|m| m.unread.is_some()) {
        Check::warn("mig", said.join("; "), "give the agent's NVML the MIG devices (the NVIDIA runtime's `NVIDIA_VISIBLE_DEVICES=all`, or CDI `nvidia.com/gpu=all`)")
    } else {
        Check::ok("mig", format!("{}; no driver limits on a GPU in MIG mode", said.join("; ")))
    }
}

pub fn device_files(facts: &Facts) -> Check {
    let dir = facts.dev_dir.display();
    let Some(gpus) = gpus(facts).filter(|g| !g.is_empty()) else {
        return Check::warn("device-files", format!("not checked against NVML's GPUs (none listed); in {dir}: {}", present(facts)), "see the nvml line");
    };
    let missing = |name: &str| facts.files.get(name).is_none_or(|f| *f == File::Missing);
    let gpu_files: Vec<String> = gpus.iter().map(|g| format!("nvidia{}", g.minor)).collect();
    let lacking: Vec<&str> = gpu_files.iter().map(String::as_str).chain(["nvidiactl"]).filter(|name| missing(name)).collect();
    if !lacking.is_empty() {
        return Check::fail(
            "device-files",
            format!("missing in {dir}: {} (NVML lists GPU(s) with minor numbers {})", lacking.join(", "), gpus.iter().map(|g| g.minor.to_string()).collect::<Vec<_>>().join(", ")),
            "in the pod, give it every GPU (`NVIDIA_VISIBLE_DEVICES=all` with the NVIDIA runtime, or CDI `nvidia.com/gpu=all`); on the host, `nvidia-modprobe` or the driver's udev rules make them",
        );
    }
    let odd: Vec<&String> = facts.files.iter().filter(|(_, f)| **f == File::Other).map(|(name, _)| name).collect();
    if !odd.is_empty() {
        return Check::warn("device-files", format!("in {dir}, not character devices: {odd:?}"), "check what put them there: the driver's device files are character devices");
    }
    if missing("nvidia-uvm") {
        return Check::warn(
            "device-files",
            format!("{} and nvidiactl in {dir}; nvidia-uvm missing: CUDA workloads need it (NVML does not)", gpu_files.join(", ")),
            "load the nvidia-uvm module (`nvidia-modprobe -u -c=0`)",
        );
    }
    Check::ok("device-files", format!("{}, nvidiactl, nvidia-uvm in {dir}", gpu_files.join(", ")))
}

/// The device files asked about that exist.
fn present(facts: &Facts) -> String {
    let names: Vec<&str> = facts.files.iter().filter(|(_, f)| **f != File::Missing).map(|(n, _)| n.as_str()).collect();
    if names.is_empty() {
        "none of nvidiactl, nvidia-uvm".into()
    } else {
        names.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    fn loaded(limits: Limits) -> Loaded {
        Loaded {
            library: "/host/driver/libnvidia-ml.so.1".into(),
            version: Ok("580.65.06".into()),
            gpus: Ok(vec![Gpu { index: 0, minor: 0, name: "NVIDIA H100 80GB HBM3".into() }, Gpu { index: 1, minor: 3, name: String::new() }]),
            mig: Vec::new(),
            limits,
        }
    }

    fn facts(nvml: Result<Loaded, (State, String)>, files: &[(&str, File)]) -> Facts {
        Facts { nvml, dev_dir: "/dev".into(), files: files.iter().map(|(n, f)| (n.to_string(), *f)).collect() }
    }

    const ALL: [(&str, File); 4] = [("nvidia0", File::CharDevice), ("nvidia3", File::CharDevice), ("nvidiactl", File::CharDevice), ("nvidia-uvm", File::CharDevice)];

    #[test]
    fn nvml_absent_warns_and_broken_fails() {
        let ok = nvml(&facts(Ok(loaded(Limits::NoFunctions)), &ALL));
        assert_eq!(ok.status, Status::Ok);
        assert!(ok.detail.contains("driver 580.65.06, 2 GPU(s): 0 NVIDIA H100 80GB HBM3, 1 (no name)"), "{ok:?}");
        assert_eq!(nvml(&facts(Err((State::Absent, "no libnvidia-ml.so.1".into())), &[])).status, Status::Warn);
        assert_eq!(nvml(&facts(Err((State::Failing, "nvmlInit_v2: Insufficient Permissions".into())), &[])).status, Status::Fail);
        assert_eq!(nvml(&facts(Err((State::Hung, "no answer".into())), &[])).status, Status::Fail);
        let mut unread = loaded(Limits::NoFunctions);
        unread.gpus = Err("nvmlDeviceGetCount_v2: Unknown Error (999)".into());
        assert_eq!(nvml(&facts(Ok(unread), &[])).status, Status::Fail);
    }

    #[test]
    fn a_driver_before_r615_warns() {
        let check = driver_limits(&facts(Ok(loaded(Limits::NoFunctions)), &ALL));
        assert_eq!(check.status, Status::Warn);
        assert!(check.detail.contains("driver 580.65.06: driver before r615: quotas held by the hook and probes only"), "{check:?}");
        let not_supported = Limits::PerGpu(vec![(0, Probe::Refused(NVML_ERROR_NOT_SUPPORTED, "Not Supported (3)".into())), (3, Probe::Takes)]);
        let check = driver_limits(&facts(Ok(loaded(not_supported)), &ALL));
        assert_eq!(check.status, Status::Warn);
        assert!(check.detail.contains("driver before r615: quotas held by the hook and probes only") && check.detail.contains("Not Supported"), "{check:?}");
        let takes = driver_limits(&facts(Ok(loaded(Limits::PerGpu(vec![(0, Probe::Takes), (3, Probe::Takes)]))), &ALL));
        assert_eq!(takes.status, Status::Ok);
        assert!(takes.detail.contains("GPU(s) 0, 3"), "{takes:?}");
        let mig = driver_limits(&facts(Ok(loaded(Limits::PerGpu(vec![(0, Probe::Mig), (3, Probe::Takes)]))), &ALL));
        assert_eq!(mig.status, Status::Warn);
        assert!(mig.detail.contains("MIG"), "{mig:?}");
        assert_eq!(driver_limits(&facts(Ok(loaded(Limits::NoCgroup2)), &ALL)).status, Status::Warn);
        assert_eq!(driver_limits(&facts(Err((State::Absent, "none".into())), &ALL)).status, Status::Warn);
    }

    #[test]
    fn mig_read_per_instance_or_not() {
        assert_eq!(mig(&facts(Ok(loaded(Limits::NoFunctions)), &ALL)).status, Status::Ok);
        let mut on = loaded(Limits::NoFunctions);
        on.mig = vec![MigDevice { index: 0, instances: 2, unread: None }];
        let check = mig(&facts(Ok(on.clone()), &ALL));
        assert_eq!(check.status, Status::Ok);
        assert!(check.detail.contains("2 read"), "{check:?}");
        on.mig[0].unread = Some("nvmlDeviceGetMigDeviceHandleByIndex(0): Insufficient Permissions".into());
        assert_eq!(mig(&facts(Ok(on), &ALL)).status, Status::Warn);
    }

    #[test]
    fn a_gpus_missing_device_file_fails() {
        let all = facts(Ok(loaded(Limits::NoFunctions)), &ALL);
        assert_eq!(device_files(&all).status, Status::Ok);
        let without_3 = facts(Ok(loaded(Limits::NoFunctions)), &[ALL[0], ("nvidia3", File::Missing), ALL[2], ALL[3]]);
        let check = device_files(&without_3);
        assert_eq!(check.status, Status::Fail);
        assert!(check.detail.contains("missing in /dev: nvidia3") && check.detail.contains("minor numbers 0, 3"), "{check:?}");
        let without_ctl = facts(Ok(loaded(Limits::NoFunctions)), &[ALL[0], ALL[1], ALL[3]]);
        assert_eq!(device_files(&without_ctl).status, Status::Fail);
        let without_uvm = facts(Ok(loaded(Limits::NoFunctions)), &ALL[..3]);
        assert_eq!(device_files(&without_uvm).status, Status::Warn);
        let regular = facts(Ok(loaded(Limits::NoFunctions)), &[ALL[0], ("nvidia3", File::Other), ALL[2], ALL[3]]);
        assert_eq!(device_files(&regular).status, Status::Warn);
        let no_nvml = facts(Err((State::Absent, "none".into())), &[("nvidiactl", File::CharDevice)]);
        let check = device_files(&no_nvml);
        assert_eq!(check.status, Status::Warn);
        assert!(check.detail.contains("nvidiactl"), "{check:?}");
    }

    #[test]
    fn reads_no_nvml_where_there_is_none() {
        let dir = std::env::temp_dir();
        let facts = Facts::read(Some(Path::new("/nonexistent/libnvidia-ml.so.1")), &[], &dir, &dir);
        assert!(matches!(&facts.nvml, Err((State::Absent, _))), "{:?}", facts.nvml);
        assert_eq!(nvml(&facts).status, Status::Warn);
        assert_eq!(facts.files.keys().collect::<Vec<_>>(), ["nvidia-uvm", "nvidiactl"]);
    }
}
