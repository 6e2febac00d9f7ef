//! The fake driver's configuration: the `FAKECUDA_*` environment variables, parsed and checked.
//!
//! | variable                 | meaning                                        | default    |
//! |--------------------------|------------------------------------------------|------------|
//! | `FAKECUDA_DEVICE_COUNT`  | number of devices, 0..=8 (0: `cuInit` returns `CUDA_ERROR_NO_DEVICE`) | 1 |
//! | `FAKECUDA_DEVICE_BYTES`  | memory of each device, when this process creates its state file | 16g |
//! | `FAKECUDA_CONTEXT_BYTES` | memory each context holds on its device        | 64m        |
//! | `FAKECUDA_NODE`          | name prefix of the device state files          | `fakecuda` |
//! | `FAKECUDA_STATE_DIR`     | directory of the device state files            | `/dev/shm` |
//! | `FAKECUDA_TRACE`         | `1`: one stderr line per API call              | `0`        |
//! | `FAKECUDA_FREE_SYNCHRONIZES` | `1`: `cuMemFree_v2` synchronizes the device, releasing its pools above their threshold as `cuCtxSynchronize` does (the programming guide says `cudaFree` synchronizes; whether the real driver's implicit synchronization releases pools is not documented: the knob stands for a release at a call after which the hook does not settle pools) | `0` |
//! | `FAKECUDA_NO_CHANNEL`    | `1`: this process is a driver client without a channel: the memory it holds counts in each device's used memory, and NVML's running-process lists leave it out (see [`crate::devfile`] and docs/gpu.md) | `0` |
//! | `FAKECUDA_UNLISTED_BYTES` | of what each process NVML lists holds on a device, the bytes its row leaves out (they count in the device's used memory, as the real driver's own memory beside each process's row does: 5.6-8.8 MiB a process on an H200, docs/gpu.md); read by the process that calls NVML | 0 |
//! | `FAKECUDA_TRIM_OBSERVED` | `1`: `cuMemPoolTrimTo` keeps what `cuMemFreeAsync` freed until a synchronize of its device observed it (`cuda.h`: such allocations "can count as outstanding"; on the H200 a trim after `cuStreamQuery` alone released nothing of a just-freed block, docs/gpu.md) | `0` |
//! | `FAKECUDA_TRIM_KEEPS`    | `1`: `cuMemPoolTrimTo` releases nothing, nor does a synchronize (a driver that keeps what a pool reserved: the case the hook's pools must survive without charging less than the device holds); a destroyed pool's memory still goes back | `0` |
//! | `FAKECUDA_STREAM_BUSY_MS` | after a `cuMemFreeAsync`, its stream has work queued for this long: `cuStreamQuery` answers `CUDA_ERROR_NOT_READY` and `cuStreamSynchronize` waits until it has run | 0 |
//! | `FAKECUDA_NVML`          | `absent`, `fail` or `hang`: NVML misbehaves ([`crate::nvml`]) | unset |
//! | `FAKECUDA_NVML_HANG_MS`  | how long `hang` sleeps per NVML call           | 10000      |
//! | `FAKECUDA_DRIVER_VERSION` | the driver version NVML reports (`MAJOR.MINOR[.PATCH]`, digits); a major of 615 or more is a driver with per-cgroup memory limits ([`crate::limits`]) and CUDA 13.4 (`cuDriverGetVersion` 13040), below it CUDA 13.0 (13000) and no limits | `580.65.06` |
//!
//! Sizes are plain bytes or a number with a `k`/`m`/`g`/`t` suffix (1024-based, parsed by
//! [`cuda_abi::parse_size`]). An empty variable counts as unset.

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;

use cuda_abi::parse_size;

/// Most devices the fake offers.
pub const MAX_DEVICES: u32 = 8;

/// The parsed configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub device_count: u32,
    pub device_bytes: u64,
    pub context_bytes: u64,
    pub node: String,
    pub state_dir: PathBuf,
    pub trace: bool,
    /// `cuMemFree_v2` also does what a synchronize does to the device's pools.
    pub free_synchronizes: bool,
    /// This process's memory is not listed by NVML (a client without a channel).
    pub no_channel: bool,
    /// Bytes NVML's row of each listed process leaves out (counted in `used` all the same).
    pub unlisted_bytes: u64,
    /// A trim keeps stream-ordered frees no synchronize has observed yet.
    pub trim_observed: bool,
    /// A trim (or a synchronize) releases nothing of a pool.
    pub trim_keeps: bool,
    /// How long a stream stays busy after a `cuMemFreeAsync` on it (ms; 0: never busy).
    pub stream_busy_ms: u64,
    /// The driver version this process sees (`FAKECUDA_DRIVER_VERSION`).
    pub driver_version: DriverVersion,
}

/// A driver version as NVML reports it (`580.65.06`), and what it implies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverVersion {
    text: String,
    major: u32,
}

impl DriverVersion {
    /// What the fake reports when `FAKECUDA_DRIVER_VERSION` is unset: a CUDA 13.0 driver.
    pub const DEFAULT: &'static str = "580.65.06";
    /// The first driver branch with per-cgroup memory limits (`nvmlDeviceSetMemoryLimits_v1`).
    pub const MEMORY_LIMITS_MAJOR: u32 = 615;

    /// Parses `MAJOR.MINOR[.PATCH]` (digits, at most 32 characters).
    pub fn parse(text: &str) -> Option<DriverVersion> {
        let text = text.trim();
        let parts: Vec<&str> = text.split('.').collect();
        let digits = |p: &&str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
        if text.len() > 32 || !(2..=3).contains(&parts.len()) || !parts.iter().all(digits) {
            return None;
        }
        Some(DriverVersion { text: text.to_owned(), major: parts[0].parse().ok()? })
    }

    /// The version from the environment of this process, the default when unset or unusable
    /// (for the entry points that work before `cuInit`; `cuInit` and `nvmlInit` report a bad
    /// value).
    pub fn from_env() -> DriverVersion {
        std::env::var("FAKECUDA_DRIVER_VERSION").ok().and_then(|v| Self::parse(&v)).unwrap_or_default()
    }

    /// The text NVML reports.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether this driver has per-cgroup memory limits (r615 and later).
    pub fn has_memory_limits(&self) -> bool {
        self.major >= Self::MEMORY_LIMITS_MAJOR
    }

    /// The CUDA version the driver reports (`cuDriverGetVersion`): 13.4 from r615 on, else 13.0.
    pub fn cuda_version(&self) -> i32 {
        if self.has_memory_limits() {
            13040
        } else {
            13000
        }
    }
}

impl Default for DriverVersion {
    fn default() -> DriverVersion {
        DriverVersion { text: Self::DEFAULT.to_owned(), major: 580 }
    }
}

/// A variable with a value the fake cannot use.
#[derive(Debug)]
pub struct ConfigError {
    pub var: &'static str,
    pub value: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fakecuda: bad {}={:?}: {}", self.var, self.value, self.reason)
    }
}

impl Config {
    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        Self::from_lookup(|name| std::env::var_os(name))
    }

    /// Reads the configuration through `lookup` (the environment, or a table in tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Result<Config, ConfigError> {
        let get = |var: &'static str| -> Result<Option<String>, ConfigError> {
            match lookup(var) {
                None => Ok(None),
                Some(v) if v.is_empty() => Ok(None),
                Some(v) => v.into_string().map(Some).map_err(|v| ConfigError {
                    var,
                    value: v.to_string_lossy().into_owned(),
                    reason: "not valid UTF-8".into(),
                }),
            }
        };
        let bad = |var: &'static str, value: &str, reason: &str| ConfigError {
            var,
            value: value.to_owned(),
            reason: reason.to_owned(),
        };

        let device_count = match get("FAKECUDA_DEVICE_COUNT")? {
            None => 1,
            Some(v) => match v.trim().parse::<u32>() {
                Ok(n) if n <= MAX_DEVICES => n,
                _ => {
                    return Err(bad(
                        "FAKECUDA_DEVICE_COUNT",
                        &v,
                        "expected a whole number of devices from 0 to 8",
                    ))
                }
            },
        };
        let size = |var: &'static str, default: u64, min: u64| -> Result<u64, ConfigError> {
            match get(var)? {
                None => Ok(default),
                Some(v) => match parse_size(&v) {
                    Some(n) if n >= min => Ok(n),
                    Some(_) => Err(bad(var, &v, &format!("must be at least {min} bytes"))),
                    None => Err(bad(
                        var,
                        &v,
                        "expected bytes, or a number with a k/m/g/t suffix (1024-based)",
                    )),
                },
            }
        };
        let device_bytes = size("FAKECUDA_DEVICE_BYTES", 16 << 30, 1)?;
        let context_bytes = size("FAKECUDA_CONTEXT_BYTES", 64 << 20, 0)?;
        let unlisted_bytes = size("FAKECUDA_UNLISTED_BYTES", 0, 0)?;

        let node = match get("FAKECUDA_NODE")? {
            None => "fakecuda".to_owned(),
            Some(v) => {
                let ok = v.len() <= 128
                    && !v.starts_with('.')
                    && v.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
                if !ok {
                    return Err(bad(
                        "FAKECUDA_NODE",
                        &v,
                        "expected at most 128 characters from [A-Za-z0-9._-], not starting with '.'",
                    ));
                }
                v
            }
        };
        let state_dir = match get("FAKECUDA_STATE_DIR")? {
            None => PathBuf::from("/dev/shm"),
            Some(v) => {
                let path = PathBuf::from(&v);
                if !path.is_dir() {
                    return Err(bad("FAKECUDA_STATE_DIR", &v, "not an existing directory"));
                }
                path
            }
        };
        let flag = |var: &'static str| -> Result<bool, ConfigError> {
            match get(var)?.as_deref() {
                None | Some("0") => Ok(false),
                Some("1") => Ok(true),
                Some(v) => Err(bad(var, v, "expected 0 or 1")),
            }
        };
        let trace = flag("FAKECUDA_TRACE")?;
        let free_synchronizes = flag("FAKECUDA_FREE_SYNCHRONIZES")?;
        let no_channel = flag("FAKECUDA_NO_CHANNEL")?;
        let trim_observed = flag("FAKECUDA_TRIM_OBSERVED")?;
        let trim_keeps = flag("FAKECUDA_TRIM_KEEPS")?;
        let stream_busy_ms = match get("FAKECUDA_STREAM_BUSY_MS")? {
            None => 0,
            Some(v) => v.parse::<u64>().ok().filter(|&ms| ms <= 60_000).ok_or_else(|| bad("FAKECUDA_STREAM_BUSY_MS", &v, "expected milliseconds, at most 60000"))?,
        };
        let driver_version = match get("FAKECUDA_DRIVER_VERSION")? {
            None => DriverVersion::default(),
            Some(v) => DriverVersion::parse(&v).ok_or_else(|| bad("FAKECUDA_DRIVER_VERSION", &v, "expected MAJOR.MINOR[.PATCH] in digits, e.g. 615.10.02"))?,
        };
        Ok(Config { device_count, device_bytes, context_bytes, node, state_dir, trace, free_synchronizes, no_channel, unlisted_bytes, trim_observed, trim_keeps, stream_busy_ms, driver_version })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let vars: Vec<(String, String)> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(|name| {
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| OsString::from(v))
        })
    }

    #[test]
    fn defaults_and_errors() {
        let c = cfg(&[]).expect("defaults");
        assert_eq!(c.device_count, 1);
        assert_eq!(c.device_bytes, 16 << 30);
        assert_eq!(c.context_bytes, 64 << 20);
        assert_eq!(c.node, "fakecuda");
        let e = cfg(&[("FAKECUDA_DEVICE_BYTES", "12q")]).expect_err("bad size");
        assert_eq!(e.var, "FAKECUDA_DEVICE_BYTES");
        assert!(e.to_string().contains("\"12q\""));
        assert!(cfg(&[("FAKECUDA_DEVICE_COUNT", "9")]).is_err());
        assert!(cfg(&[("FAKECUDA_NODE", "a/b")]).is_err());
        assert!(cfg(&[("FAKECUDA_DEVICE_BYTES", "0")]).is_err());
        assert_eq!(cfg(&[("FAKECUDA_DEVICE_COUNT", "")]).expect("empty is unset").device_count, 1);
        let sized = cfg(&[("FAKECUDA_DEVICE_BYTES", "1T"), ("FAKECUDA_CONTEXT_BYTES", " 32m ")]).expect("sizes");
        assert_eq!((sized.device_bytes, sized.context_bytes), (1 << 40, 32 << 20));
        assert!(cfg(&[("FAKECUDA_CONTEXT_BYTES", "16777216t")]).is_err(), "overflow");
        assert!(!c.free_synchronizes);
        assert!(cfg(&[("FAKECUDA_FREE_SYNCHRONIZES", "1")]).expect("flag").free_synchronizes);
        assert_eq!(cfg(&[("FAKECUDA_FREE_SYNCHRONIZES", "yes")]).expect_err("bad flag").var, "FAKECUDA_FREE_SYNCHRONIZES");
        assert!(!c.no_channel);
        assert!(cfg(&[("FAKECUDA_NO_CHANNEL", "1")]).expect("flag").no_channel);
        assert!(!c.trim_observed && cfg(&[("FAKECUDA_TRIM_OBSERVED", "1")]).expect("flag").trim_observed);
        assert!(!c.trim_keeps && cfg(&[("FAKECUDA_TRIM_KEEPS", "1")]).expect("flag").trim_keeps);
        assert_eq!((c.stream_busy_ms, cfg(&[("FAKECUDA_STREAM_BUSY_MS", "600")]).expect("ms").stream_busy_ms), (0, 600));
        assert_eq!(cfg(&[("FAKECUDA_STREAM_BUSY_MS", "1s")]).expect_err("not ms").var, "FAKECUDA_STREAM_BUSY_MS");
        assert!(cfg(&[("FAKECUDA_STREAM_BUSY_MS", "60001")]).is_err());
    }

    #[test]
    fn driver_versions() {
        let old = cfg(&[]).expect("defaults").driver_version;
        assert_eq!((old.text(), old.has_memory_limits(), old.cuda_version()), ("580.65.06", false, 13000));
        let new = cfg(&[("FAKECUDA_DRIVER_VERSION", "615.10.02")]).expect("r615").driver_version;
        assert_eq!((new.text(), new.has_memory_limits(), new.cuda_version()), ("615.10.02", true, 13040));
        assert!(DriverVersion::parse("614.99").is_some_and(|v| !v.has_memory_limits()));
        assert!(DriverVersion::parse("700.1").is_some_and(|v| v.has_memory_limits()));
        for bad in ["615", "615.", "r615.1", "615.1.2.3", "615.x.1"] {
            assert_eq!(cfg(&[("FAKECUDA_DRIVER_VERSION", bad)]).expect_err(bad).var, "FAKECUDA_DRIVER_VERSION");
        }
    }
}
