//! The Kubernetes API side of provisioning: which quota a container asked for, and the
//! node's advertised capacity.
//!
//! * [`PodCache`] (`pods`): the pods on this node (list + watch), and
//!   [`PodCache::container_quota`]: a container's `vramguard.io/gpu-memory` limit in bytes.
//! * [`Capacity`] (`capacity`): `vramguard.io/gpu-memory` in the node's status, re-asserted.
//! * [`parse_quantity`] (`quantity`): Kubernetes quantities as exact bytes.
//! * [`KubeConfig`] (`config`) and [`Client`] (`client`): a narrow HTTP/1.1 client of the
//!   few calls above (hyper, rustls with ring), in-cluster or explicit configuration.
//! * [`KubeArgs`]: the command-line flags.
//!
//! The API server is trusted for quotas and pod identity (`docs/security.md`); its answers
//! are still bounded in size and decoded into typed values in `objects`.
mod capacity;
mod client;
mod config;
mod objects;
mod pods;
mod quantity;

use std::{path::PathBuf, time::Duration};

pub use capacity::{capacity_bytes, patch_body, Capacity, CapacityState, JSON_PATCH};
pub use client::Client;
pub use config::{KubeConfig, SERVICE_ACCOUNT_DIR};
pub use pods::{CacheState, PodCache, Tuning};
pub use quantity::parse_quantity;

/// The extended resource a container asks for its quota with, and the node advertises.
pub const RESOURCE: &str = "vramguard.io/gpu-memory";

/// The Kubernetes API flags of `vramguard run`.
#[derive(clap::Args, Clone, Debug)]
pub struct KubeArgs {
    /// Use the Kubernetes API: look up containers' `vramguard.io/gpu-memory` limits and
    /// advertise the node's capacity (off: nodes without Kubernetes).
    #[arg(long)]
    pub kube: bool,
    /// The API server's URL (default: in-cluster, from KUBERNETES_SERVICE_HOST/PORT and the
    /// service account's token and CA). `http://` only to a loopback address.
    #[arg(long, value_name = "URL", requires = "kube")]
    pub kube_api: Option<String>,
    /// The bearer token's file with --kube-api (re-read when it changes).
    #[arg(long, value_name = "PATH", requires = "kube_api")]
    pub kube_token_file: Option<PathBuf>,
    /// The PEM CA bundle that verifies --kube-api's certificate.
    #[arg(long, value_name = "PATH", requires = "kube_api")]
    pub kube_ca_file: Option<PathBuf>,
    /// This node's name, as the API server knows it (the DaemonSet passes spec.nodeName).
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
    /// The factor the GPUs' memory is multiplied by for the advertised capacity.
    #[arg(long, default_value_t = 1.0, value_name = "FACTOR")]
    pub overcommit: f64,
    /// How often the node's advertised capacity is checked and re-asserted, in seconds.
    #[arg(long, default_value_t = 60, value_name = "S")]
    pub capacity_every_s: u64,
}

impl KubeArgs {
    /// The API configuration the flags name: `None` without `--kube`.
    pub fn config(&self) -> Result<Option<KubeConfig>, KubeError> {
        if !self.kube {
            return Ok(None);
        }
        match &self.kube_api {
            Some(url) => KubeConfig::explicit(url, self.kube_token_file.clone(), self.kube_ca_file.clone()).map(Some),
            None => KubeConfig::in_cluster().map(Some),
        }
    }

    /// The node's name (required with `--kube`), checked.
    pub fn node(&self) -> Result<&str, KubeError> {
        let node = self
            .node_name
            .as_deref()
            .ok_or_else(|| KubeError::Config("--kube needs the node's name (--node-name or NODE_NAME)".into()))?;
        valid_name("node", node)?;
        Ok(node)
    }

    /// The capacity's period.
    pub fn capacity_every(&self) -> Duration {
        Duration::from_secs(self.capacity_every_s)
    }
}

/// What went wrong talking to the API server.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("Kubernetes API configuration: {0}")]
    Config(String),
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("connecting to the API server at {addr}: {source}")]
    Connect { addr: String, source: std::io::Error },
    #[error("TLS with the API server at {addr}: {source}")]
    Tls { addr: String, source: std::io::Error },
    #[error("HTTP with the API server: {0}")]
    Http(#[from] hyper::Error),
    #[error("the API server answered {code} to {what}: {message}")]
    Status { code: u16, what: String, message: String },
    #[error("{what}: the API server's answer is not what was expected: {reason}")]
    Decode { what: String, reason: String },
    #[error("{what}: no answer within {after:?}")]
    Timeout { what: String, after: Duration },
    #[error("pod {namespace}/{pod} with uid {uid} is not known to the API server")]
    PodNotFound { namespace: String, pod: String, uid: String },
    #[error("pod {namespace}/{pod} has no container {container}")]
    NoContainer { namespace: String, pod: String, container: String },
    #[error("{what}: {value:?} is not a whole number of bytes")]
    BadQuantity { what: String, value: String },
    #[error("{kind} name {name:?} is not a valid Kubernetes name")]
    BadName { kind: &'static str, name: String },
}

/// Checks a namespace, pod or node name before it goes into a path or a field selector: a
/// DNS subdomain (lowercase letters, digits, `-` and `.`, at most 253 bytes).
fn valid_name(kind: &'static str, name: &str) -> Result<(), KubeError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && name.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(KubeError::BadName { kind, name: name.to_owned() })
    }
}

/// Exponential backoff between `min` and `max`, with up to a quarter of jitter.
#[derive(Debug)]
struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new(min: Duration, max: Duration) -> Backoff {
        Backoff { min, max: max.max(min), next: min }
    }

    fn next(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(self.max);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| t.subsec_nanos());
        wait + wait / 4 * (nanos % 1000) / 1000
    }

    fn reset(&mut self) {
        self.next = self.min;
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        kube: KubeArgs,
    }

    #[test]
    fn names_are_checked() {
        for name in ["node-1", "a", "ip-10-0-0-1.ec2.internal", "default"] {
            assert!(valid_name("node", name).is_ok(), "{name}");
        }
        for name in ["", "Node", "a/b", "a b", "-a", "a-", "a%2Fb", "..", &"a".repeat(254)] {
            assert!(valid_name("node", name).is_err(), "{name}");
        }
    }

    #[test]
    fn flags() {
        let cli = Cli::try_parse_from(["x", "--kube", "--node-name", "n1", "--overcommit", "1.5"]).expect("flags");
        assert_eq!(cli.kube.node().ok(), Some("n1"));
        assert_eq!(cli.kube.capacity_every(), Duration::from_secs(60));
        assert!(Cli::try_parse_from(["x", "--kube-api", "http://127.0.0.1:1"]).is_err(), "--kube-api needs --kube");
        let off = Cli::try_parse_from(["x"]).expect("no flags");
        assert!(off.kube.config().expect("off").is_none());
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let waits: Vec<_> = (0..4).map(|_| backoff.next()).collect();
        let bases = [100, 200, 350, 350];
        for (wait, base) in waits.iter().zip(bases) {
            let base = Duration::from_millis(base);
            assert!(*wait >= base && *wait <= base + base / 4, "{wait:?} for {base:?}");
        }
        backoff.reset();
        assert!(backoff.next() < Duration::from_millis(126));
    }
}
