//! The hook's settings, from the environment (HAMi-core's variables, so the hook can stand in
//! for `libvgpu.so`, plus vramguard's own):
//!
//! | variable | meaning |
//! |---|---|
//! | `CUDA_DEVICE_MEMORY_LIMIT` | quota of every device (bytes, or `k`/`m`/`g`/`t`, 1024-based; 0 = none) |
//! | `CUDA_DEVICE_MEMORY_LIMIT_<i>` | quota of visible device `i`, overriding the above |
//! | `VRAMGUARD_LEDGER` | the ledger file (else `CUDA_DEVICE_MEMORY_SHARED_CACHE`, else `/tmp/vramguard.ledger`) |
//! | `VRAMGUARD_CONTEXT_RESERVE` | charged once per process and device for its CUDA context (default `518m`, an H100's) |
//! | `VRAMGUARD_FAIL_OPEN` | `1`: when the ledger is unusable, a setting above is not, or a GPU is not in the ledger, run without limits (said once on stderr) instead of refusing allocations |
//! | `POD_NAMESPACE`, `POD_NAME`, `CONTAINER_NAME` | the container's names (from the downward API), recorded in the ledger for the agent's metrics |
//!
//! Limits only matter when the hook creates the ledger: an existing ledger (written by the
//! agent, or by the container's first process) is authoritative.
//!
//! # Provisioned containers
//!
//! In a container the agent provisioned (issue 10: the quota is the operator's), the runtime
//! mounted the agent's copy of the ledger's header read-only at
//! [`ledger::provisioned::LIMITS`]. When that file exists, every variable above is ignored:
//! the ledger is [`ledger::provisioned::LEDGER`], its limits are those of the agent's header
//! (whatever the ledger file's own header says), and `VRAMGUARD_FAIL_OPEN` does not apply (a
//! process cannot lift its container's quota by its environment). A limits file that exists
//! but cannot be read or is not a header the agent wrote is an error: allocations are refused.
use std::{io::Read, path::{Path, PathBuf}};

use ledger::{
    layout::{Header, MAX_DEVICES},
    provisioned, ContainerNames,
};

pub const DEFAULT_LEDGER: &str = "/tmp/vramguard.ledger";
pub const DEFAULT_CONTEXT_RESERVE: u64 = ledger::layout::CONTAINER_CONTEXT_RESERVE;
pub const CHUNK: u64 = ledger::layout::CONTAINER_CHUNK;

#[derive(Debug, Clone)]
pub struct Config {
    pub ledger: PathBuf,
    /// Per visible device: its quota, `None` when unlimited.
    pub limits: [Option<u64>; MAX_DEVICES],
    pub context_reserve: u64,
    pub fail_open: bool,
    /// The container's names from the downward API (empty where unset): labels only.
    pub names: ContainerNames,
    /// In a provisioned container: the agent's header, the ledger's only source of limits.
    pub provisioned: Option<Header>,
}

impl Config {
    /// The agent's limits when this is a provisioned container, else the environment; an
    /// unusable value is an error naming the file or the variable.
    pub fn from_env() -> Result<Config, String> {
        match provisioned_header(Path::new(provisioned::LIMITS))? {
            Some(header) => Ok(Config::provisioned(header)),
            None => Self::from_lookup(|name| std::env::var(name).ok()),
        }
    }

    /// The settings of a provisioned container whose agent wrote `header`.
    pub fn provisioned(header: Header) -> Config {
        let count = (header.device_count as usize).min(MAX_DEVICES);
        let mut limits = [None; MAX_DEVICES];
        for (limit, device) in limits.iter_mut().zip(&header.devices[..count]) {
            *limit = Some(device.limit);
        }
        Config {
            ledger: PathBuf::from(provisioned::LEDGER),
            limits,
            context_reserve: header.devices.first().map_or(DEFAULT_CONTEXT_RESERVE, |d| d.context_reserve),
            fail_open: false,
            names: ContainerNames::default(),
            provisioned: Some(header),
        }
    }

    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, String> {
        let size = |name: &str| -> Result<Option<u64>, String> {
            match get(name).filter(|v| !v.trim().is_empty()) {
                None => Ok(None),
                Some(text) => cuda_abi::parse_size(&text)
                    .map(Some)
                    .ok_or_else(|| format!("{name}={text:?} is not a size (bytes, or a number with k, m, g or t)")),
            }
        };
        let all = size("CUDA_DEVICE_MEMORY_LIMIT")?;
        let mut limits = [None; MAX_DEVICES];
        for (index, limit) in limits.iter_mut().enumerate() {
            *limit = size(&format!("CUDA_DEVICE_MEMORY_LIMIT_{index}"))?.or(all).filter(|&l| l > 0);
        }
        let ledger = ["VRAMGUARD_LEDGER", "CUDA_DEVICE_MEMORY_SHARED_CACHE"]
            .iter()
            .find_map(|name| get(name).filter(|v| !v.is_empty()))
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_LEDGER));
        let context_reserve = size("VRAMGUARD_CONTEXT_RESERVE")?.unwrap_or(DEFAULT_CONTEXT_RESERVE);
        let fail_open = match get("VRAMGUARD_FAIL_OPEN").as_deref() {
            None | Some("") | Some("0") => false,
            Some("1") => true,
            Some(other) => return Err(format!("VRAMGUARD_FAIL_OPEN={other:?} must be 0 or 1")),
        };
        let name = |key: &str| get(key).map(|v| v.trim().to_string()).unwrap_or_default();
        let names = ContainerNames::new(&name("POD_NAMESPACE"), &name("POD_NAME"), &name("CONTAINER_NAME"));
        Ok(Config { ledger, limits, context_reserve, fail_open, names, provisioned: None })
    }

    /// Whether any device has a quota.
    pub fn has_limits(&self) -> bool {
        self.limits.iter().any(Option::is_some)
    }
}

/// Whether the environment asks for fail-open (`VRAMGUARD_FAIL_OPEN=1`), read on its own: the
/// answer when another setting is unusable.
pub fn fail_open_asked() -> bool {
    std::env::var_os("VRAMGUARD_FAIL_OPEN").is_some_and(|v| v == "1")
}

/// The header the agent wrote at `path` (a provisioned container's limits), `None` when there
/// is no such file (not a provisioned container).
pub fn provisioned_header(path: &Path) -> Result<Option<Header>, String> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(format!("{} (this container's limits, from the agent) cannot be opened: {error}", path.display())),
    };
    let size = std::mem::size_of::<Header>();
    let mut bytes = Vec::with_capacity(size + 1);
    // One byte more than a header: a longer file is not one.
    file.take(size as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| format!("{} (this container's limits, from the agent) cannot be read: {error}", path.display()))?;
    // Validated with the ledger file, when the session maps it (`Ledger::from_file_as`).
    let header = ledger::file::header_from_bytes(&bytes)
        .ok_or_else(|| format!("{} is not a ledger header written by the agent ({} bytes)", path.display(), bytes.len()))?;
    Ok(Some(header))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(vars: &[(&str, &str)]) -> Result<Config, String> {
        Config::from_lookup(|name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn hami_variables() {
        let c = config(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g"), ("CUDA_DEVICE_MEMORY_LIMIT_1", "512m"), ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/x/cache")]).unwrap();
        assert_eq!(c.limits[0], Some(1 << 30));
        assert_eq!(c.limits[1], Some(512 << 20));
        assert_eq!(c.limits[2], Some(1 << 30));
        assert_eq!(c.ledger, PathBuf::from("/x/cache"));
        assert!(!c.fail_open);
        assert_eq!(c.context_reserve, DEFAULT_CONTEXT_RESERVE);
        assert!(c.names.is_empty());
    }

    #[test]
    fn downward_api_names() {
        let c = config(&[("POD_NAMESPACE", "team-a"), ("POD_NAME", "trainer-0"), ("CONTAINER_NAME", "main")]).unwrap();
        assert_eq!(c.names.text(), Some(("team-a".into(), "trainer-0".into(), "main".into())));
        let c = config(&[("POD_NAME", "solo")]).unwrap();
        assert_eq!(c.names.text(), Some((String::new(), "solo".into(), String::new())));
    }

    #[test]
    fn zero_or_unset_is_unlimited_and_vramguard_ledger_wins() {
        let c = config(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "0"), ("VRAMGUARD_LEDGER", "/a"), ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/b")]).unwrap();
        assert!(!c.has_limits());
        assert_eq!(c.ledger, PathBuf::from("/a"));
        assert_eq!(config(&[]).unwrap().ledger, PathBuf::from(DEFAULT_LEDGER));
    }

    #[test]
    fn bad_values_name_the_variable() {
        let error = config(&[("CUDA_DEVICE_MEMORY_LIMIT_3", "lots")]).unwrap_err();
        assert!(error.contains("CUDA_DEVICE_MEMORY_LIMIT_3"), "{error}");
        let error = config(&[("VRAMGUARD_FAIL_OPEN", "yes")]).unwrap_err();
        assert!(error.contains("VRAMGUARD_FAIL_OPEN"), "{error}");
    }

    #[test]
    fn a_provisioned_containers_limits_come_from_the_agents_header_only() {
        let dir = std::env::temp_dir().join(format!("vramguard-hook-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("limits");
        assert!(provisioned_header(&path).expect("no file is fine").is_none(), "no file: not provisioned");

        let geometry = ledger::Geometry {
            slots: 4,
            records: 64,
            devices: vec![ledger::DeviceConfig { limit: 1 << 30, chunk: CHUNK, context_reserve: 1 << 20, ..Default::default() }; 2],
        };
        let header = ledger::file::plan(&geometry, ledger::layout::CREATOR_AGENT, 0).expect("plan");
        std::fs::write(&path, ledger::file::header_bytes(&header)).expect("write");
        let config = Config::provisioned(provisioned_header(&path).expect("read").expect("provisioned"));
        assert_eq!(config.ledger, PathBuf::from(provisioned::LEDGER));
        assert_eq!(&config.limits[..3], &[Some(1 << 30), Some(1 << 30), None]);
        assert_eq!(config.context_reserve, 1 << 20);
        assert!(!config.fail_open);

        std::fs::write(&path, b"8g").expect("write");
        let error = provisioned_header(&path).expect_err("not a header");
        assert!(error.contains("not a ledger header written by the agent"), "{error}");
        let mut longer = ledger::file::header_bytes(&header).to_vec();
        longer.push(0);
        std::fs::write(&path, longer).expect("write");
        assert!(provisioned_header(&path).is_err(), "a longer file is not a header");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
