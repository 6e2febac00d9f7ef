//! The hook's settings, from the environment (HAMi-core's variables, so the hook can stand in
//! for `libvgpu.so`, plus vramguard's own):
//!
//! | variable | meaning |
//! |---|---|
//! | `CUDA_DEVICE_MEMORY_LIMIT` | quota of every device (bytes, or `k`/`m`/`g`/`t`, 1024-based; 0 = none) |
//! | `CUDA_DEVICE_MEMORY_LIMIT_<i>` | quota of visible device `i`, overriding the above |
//! | `VRAMGUARD_LEDGER` | the ledger file (else `CUDA_DEVICE_MEMORY_SHARED_CACHE`, else `/tmp/vramguard.ledger`) |
//! | `VRAMGUARD_CONTEXT_RESERVE` | charged once per process and device for its CUDA context (default `518m`, an H100's) |
//! | `VRAMGUARD_FAIL_OPEN` | `1`: when the ledger is unusable, run without limits instead of refusing allocations |
//! | `POD_NAMESPACE`, `POD_NAME`, `CONTAINER_NAME` | the container's names (from the downward API), recorded in the ledger for the agent's metrics |
//!
//! Limits only matter when the hook creates the ledger: an existing ledger (written by the
//! agent, or by the container's first process) is authoritative.
use std::path::PathBuf;

use ledger::{layout::MAX_DEVICES, ContainerNames};

pub const DEFAULT_LEDGER: &str = "/tmp/vramguard.ledger";
pub const DEFAULT_CONTEXT_RESERVE: u64 = 518 << 20;
pub const CHUNK: u64 = 2 << 20;

#[derive(Debug, Clone)]
pub struct Config {
    pub ledger: PathBuf,
    /// Per visible device: its quota, `None` when unlimited.
    pub limits: [Option<u64>; MAX_DEVICES],
    pub context_reserve: u64,
    pub fail_open: bool,
    /// The container's names from the downward API (empty where unset): labels only.
    pub names: ContainerNames,
}

impl Config {
    /// Reads the environment; an unusable value is an error naming the variable.
    pub fn from_env() -> Result<Config, String> {
        Self::from_lookup(|name| std::env::var(name).ok())
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
        Ok(Config { ledger, limits, context_reserve, fail_open, names })
    }

    /// Whether any device has a quota.
    pub fn has_limits(&self) -> bool {
        self.limits.iter().any(Option::is_some)
    }
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
}
