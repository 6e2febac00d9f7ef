//! The Kubernetes API side of provisioning: which quota a container asked for, and the
//! node's advertised capacity, on `kube` (kube-rs) and `k8s-openapi`.
//!
//! * [`PodCache`] (`pods`): the pods on this node, kept by kube's watcher (paged list, watch
//!   with bookmarks, relist on `410 Gone`, backoff), and [`PodCache::container_quota`]: a
//!   container's `vramguard.io/gpu-memory` limit in bytes.
//!   [`PodCache::known`]: what the node knows without asking, the cache and its last state
//!   on disk (`remembered`, `<state-dir>/pods.json`).
//! * [`Capacity`] (`capacity`): `vramguard.io/gpu-memory` in the node's status, re-asserted.
//! * [`parse_quantity`] (`quantity`): Kubernetes quantities as exact bytes. This is the one
//!   piece kube does not have: `k8s-openapi`'s `Quantity` is the quantity's text, with no
//!   arithmetic.
//! * [`KubeConfig`] (`config`): kube's client configuration, in-cluster (from a service
//!   account directory), from a kubeconfig file, or explicit (tests, out-of-cluster runs).
//!   kube's client does the rest: TLS (rustls with ring), the bearer token re-read from its
//!   file (kube reloads it once its copy is a minute old), the CA bundle likewise.
//! * [`KubeArgs`]: the command-line flags; [`ApiArgs`], how to reach the API server, the flags
//!   `vramguard run --kube` shares with `vramguard webhook`.
//!
//! The API server is trusted for quotas and pod identity (`docs/security.md`); its answers
//! are decoded into `k8s-openapi`'s typed objects by kube, and only a pod's limits are kept.
mod capacity;
mod config;
mod objects;
mod pods;
mod remembered;

use std::{path::PathBuf, time::Duration};

pub use capacity::{capacity_bytes, patch_body, Capacity, CapacityState, JSON_PATCH};
pub use config::{KubeConfig, SERVICE_ACCOUNT_DIR};
pub use kube::Client;
pub use pods::{CacheState, Known, PodCache, Tuning};
pub use crate::quantity::parse_quantity;
pub use remembered::REMEMBERED;

/// The extended resource a container asks for its quota with, and the node advertises.
pub const RESOURCE: &str = "vramguard.io/gpu-memory";

/// How to reach the API server: the flags `vramguard run` (with `--kube`, [`KubeArgs`]) and
/// `vramguard webhook` share.
#[derive(clap::Args, Clone, Debug)]
pub struct ApiArgs {
    /// The API server's URL (default: in-cluster, from KUBERNETES_SERVICE_HOST/PORT and the
    /// service account's token and CA). `http://` only to a loopback address.
    #[arg(long, value_name = "URL", conflicts_with = "kubeconfig")]
    pub kube_api: Option<String>,
    /// A kubeconfig file to reach the API server with (its current context), instead of the
    /// in-cluster service account.
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// The in-cluster service account's directory: its `token`, `ca.crt` and `namespace`
    /// files (a pod's, unless the agent runs elsewhere with the same files).
    #[arg(long, env = "VRAMGUARD_KUBE_SERVICE_ACCOUNT_DIR", value_name = "DIR", default_value = SERVICE_ACCOUNT_DIR)]
    pub kube_service_account_dir: PathBuf,
    /// The bearer token's file with --kube-api (re-read when it changes).
    #[arg(long, value_name = "PATH", requires = "kube_api")]
    pub kube_token_file: Option<PathBuf>,
    /// The PEM CA bundle that verifies --kube-api's certificate.
    #[arg(long, value_name = "PATH", requires = "kube_api")]
    pub kube_ca_file: Option<PathBuf>,
}

impl ApiArgs {
    /// The API configuration the flags name: --kube-api, else --kubeconfig, else in-cluster.
    pub async fn config(&self) -> Result<KubeConfig, KubeError> {
        match (&self.kube_api, &self.kubeconfig) {
            (Some(url), _) => KubeConfig::explicit(url, self.kube_token_file.clone(), self.kube_ca_file.clone()),
            (None, Some(path)) => KubeConfig::kubeconfig(path).await,
            (None, None) => KubeConfig::in_cluster(&self.kube_service_account_dir),
        }
    }
}

/// The Kubernetes API flags of `vramguard run`: where the API server is ([`ApiArgs`]) means
/// nothing without `--kube`.
#[derive(clap::Args, Clone, Debug)]
#[command(mut_arg("kube_api", |arg| arg.requires("kube")), mut_arg("kubeconfig", |arg| arg.requires("kube")))]
pub struct KubeArgs {
    /// Use the Kubernetes API: look up containers' `vramguard.io/gpu-memory` limits and
    /// advertise the node's capacity (off: nodes without Kubernetes).
    #[arg(long)]
    pub kube: bool,
    #[command(flatten)]
    pub api: ApiArgs,
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
    pub async fn config(&self) -> Result<Option<KubeConfig>, KubeError> {
        if !self.kube {
            return Ok(None);
        }
        self.api.config().await.map(Some)
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
    #[error("TLS with the API server: {what}: {source}")]
    Tls { what: String, source: kube::Error },
    #[error("{what}: {source}")]
    Client { what: String, source: kube::Error },
    #[error("the API server answered {code} to {what}: {message}")]
    Status { code: u16, what: String, message: String },
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

impl KubeError {
    /// kube's error for `what`: the API's `Status` answers by their code, a failed TLS
    /// handshake (rustls' error anywhere in the chain) as [`KubeError::Tls`].
    pub(crate) fn from_kube(what: impl Into<String>, error: kube::Error) -> KubeError {
        let what = what.into();
        match error {
            kube::Error::Api(status) => {
                let message = if status.reason.is_empty() { status.message } else { format!("{}: {}", status.reason, status.message) };
                KubeError::Status { code: status.code, what, message }
            }
            error if is_tls(&error) => KubeError::Tls { what, source: error },
            error => KubeError::Client { what, source: error },
        }
    }
}

/// Whether a rustls error is in `error`'s chain. An `io::Error` carries its cause as a
/// payload that `source()` skips (tokio-rustls' error inside hyper's connect error is two of
/// them), so payloads are followed too.
fn is_tls(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<rustls::Error>() {
            return true;
        }
        next = match error.downcast_ref::<std::io::Error>().and_then(std::io::Error::get_ref) {
            Some(payload) => Some(payload as &(dyn std::error::Error + 'static)),
            None => error.source(),
        };
    }
    false
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

/// Exponential backoff between `min` and `max`, with up to a quarter of jitter; kube's
/// watcher waits by it after each error and resets it on each event.
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

    fn next_wait(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(self.max);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| t.subsec_nanos());
        wait + wait / 4 * (nanos % 1000) / 1000
    }
}

impl Iterator for Backoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(self.next_wait())
    }
}

impl kube::runtime::utils::Backoff for Backoff {
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
        assert!(Cli::try_parse_from(["x", "--kubeconfig", "k"]).is_err(), "--kubeconfig needs --kube");
        assert!(Cli::try_parse_from(["x", "--kube", "--kube-token-file", "t"]).is_err(), "a token file needs --kube-api");
        assert_eq!(cli.kube.api.kube_service_account_dir, PathBuf::from(SERVICE_ACCOUNT_DIR));
        assert!(Cli::try_parse_from(["x", "--kube", "--kube-api", "http://127.0.0.1:1", "--kubeconfig", "k"]).is_err());
        let off = Cli::try_parse_from(["x"]).expect("no flags");
        let config = tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(off.kube.config());
        assert!(config.expect("off").is_none());
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let waits: Vec<_> = (0..4).map(|_| backoff.next_wait()).collect();
        let bases = [100, 200, 350, 350];
        for (wait, base) in waits.iter().zip(bases) {
            let base = Duration::from_millis(base);
            assert!(*wait >= base && *wait <= base + base / 4, "{wait:?} for {base:?}");
        }
        kube::runtime::utils::Backoff::reset(&mut backoff);
        assert!(backoff.next_wait() < Duration::from_millis(126));
    }
}
