//! The NRI plugin: the agent's connection to the container runtime's NRI socket.
//!
//! The plugin dials the runtime (containerd ≥ 1.7, CRI-O ≥ 1.26), registers under a name and
//! an index, subscribes to CreateContainer, StartContainer, RemoveContainer and RemovePodSandbox, receives the
//! runtime's pods and containers (Synchronize), and from then on answers each event through a
//! [`Handler`]. CreateContainer's answer is an [`Adjustment`] (bind mounts and environment
//! variables; an environment variable set there replaces the container's own of that name) or
//! an error, which makes the runtime fail the container's creation. When the connection ends,
//! the plugin dials again, with backoff, for ever.
//!
//! This module owns the protocol from the socket's bytes to the handler's typed calls: the
//! multiplexer and ttRPC framing ([`wire`]), the protobuf messages ([`proto`]), one
//! connection's life ([`session`]), and the reconnecting loop ([`run`]). Bytes from the runtime
//! become [`Pod`] and [`Container`] here; anything malformed ends the connection, logged.
use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::{debug, warn};

mod proto;
mod session;
mod wire;

#[cfg(test)]
mod tests;

/// Where containerd and CRI-O put NRI's socket unless configured otherwise.
pub const DEFAULT_SOCKET: &str = "/var/run/nri/nri.sock";

/// The first wait before dialling again; it doubles on each failure up to [`BACKOFF_MAX`], and
/// starts over once a connection got as far as Synchronize.
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// A pod sandbox, as the runtime describes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pod {
    pub id: String,
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub annotations: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
}

/// A container, as the runtime describes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Container {
    pub id: String,
    pub pod_id: String,
    pub name: String,
    /// The container's environment as the runtime will start it (before this plugin's
    /// adjustment), in order; entries without `=` are left out. The pod spec's to set: never
    /// a source of what the container was given.
    pub env: Vec<(String, String)>,
    pub annotations: BTreeMap<String, String>,
    /// The OCI spec's mounts as the runtime made them (CDI's edits included): a `source`
    /// host path is the runtime's word, set from the CDI spec or the pod's volumes.
    pub mounts: Vec<Mount>,
    /// The OCI spec's `linux.cgroupsPath` (systemd `slice:prefix:name` or a path).
    pub cgroups_path: String,
    /// The paths in the container of the OCI spec's `linux.devices` (the runtime's).
    pub devices: Vec<String>,
    /// The CDI devices the runtime injected, fully qualified (newer NRI; empty otherwise).
    pub cdi_devices: Vec<String>,
    /// The container's first process, once it has one (Synchronize of running containers).
    pub pid: Option<u32>,
}

/// A bind mount into the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// An absolute host path: a file or a directory.
    pub source: PathBuf,
    /// An absolute path in the container.
    pub destination: String,
    pub read_only: bool,
}

/// What the runtime adds to a container being created.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Adjustment {
    /// Bind mounts (`rbind`, `rprivate`, `ro` or `rw`); one replaces a mount of the container's
    /// at the same destination.
    pub mounts: Vec<Mount>,
    /// Environment variables; one replaces the container's own variable of that name.
    pub env: Vec<(String, String)>,
}

/// What the agent does on the runtime's events. Each call is answered to the runtime when it
/// returns or at [`Config::handler_deadline`], whichever comes first.
pub trait Handler: Send + Sync + 'static {
    /// Every pod and container the runtime has, on each (re)connection. Past the deadline the
    /// runtime is answered and the call goes on.
    fn synchronize(
        &self,
        pods: Vec<Pod>,
        containers: Vec<Container>,
    ) -> impl Future<Output = ()> + Send;
    /// A container is being created. Err(message): the runtime fails the creation with it.
    /// Past the deadline the runtime is answered with an error, this call is cancelled (the
    /// future dropped) and [`Handler::abandon_container`] follows.
    fn create_container(
        &self,
        pod: Pod,
        container: Container,
    ) -> impl Future<Output = Result<Adjustment, String>> + Send;
    /// The runtime was answered about this container's creation without the handler's
    /// adjustment (past the deadline, or the handler panicked), so it fails the creation:
    /// whatever [`Handler::create_container`] made for it is to go. Called once the cancelled
    /// call has stopped; the answer to the runtime is not waiting for it.
    fn abandon_container(&self, container: Container) -> impl Future<Output = ()> + Send {
        let _ = container;
        async {}
    }
    /// A container is about to start: the runtime made it (its cgroup is there) and starts its
    /// process once answered. Answered within `budget` (the deadline) whatever this does; it
    /// never fails the start.
    fn start_container(&self, pod: Pod, container: Container, budget: Duration) -> impl Future<Output = ()> + Send {
        let _ = (pod, container, budget);
        async {}
    }
    /// A container was removed. Past the deadline the runtime is answered and the call goes on.
    fn remove_container(&self, pod: Pod, container: Container) -> impl Future<Output = ()> + Send;
    /// A pod sandbox was removed. Past the deadline the runtime is answered and the call goes on.
    fn remove_pod(&self, pod: Pod) -> impl Future<Output = ()> + Send;
}

/// How the plugin connects and registers.
#[derive(Debug, Clone)]
pub struct Config {
    /// The runtime's NRI socket ([`DEFAULT_SOCKET`]).
    pub socket: PathBuf,
    /// The plugin's name (e.g. `vramguard`): the runtime knows it as `<index>-<name>`.
    pub name: String,
    /// Two digits; the runtime calls plugins in ascending index order.
    pub index: String,
    /// How long a handler call may take. Keep it under the runtime's request timeout (2 s by
    /// default; a plugin that misses it is disconnected); the runtime's own deadline, when it
    /// sends one, shortens it to 3/4 of that.
    pub handler_deadline: Duration,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("NRI plugin index {0:?}: two digits expected")]
    Index(String),
    #[error(
        "NRI plugin name {0:?}: a non-empty name of letters, digits, '-', '_' or '.' expected"
    )]
    Name(String),
    #[error("NRI handler deadline: more than zero expected")]
    Deadline,
}

impl Config {
    /// Checks what the runtime would refuse.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.index.len() != 2 || !self.index.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ConfigError::Index(self.index.clone()));
        }
        let name_ok = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.');
        if self.name.is_empty() || !self.name.bytes().all(name_ok) {
            return Err(ConfigError::Name(self.name.clone()));
        }
        if self.handler_deadline.is_zero() {
            return Err(ConfigError::Deadline);
        }
        Ok(())
    }
}

/// Connects, registers, serves; on disconnect reconnects with backoff ([`BACKOFF_MIN`]
/// doubling to [`BACKOFF_MAX`]), for ever. `connected` says whether a registered, synchronized
/// connection is up now. Returns only if `config` fails [`Config::check`] (logged).
pub async fn run<H: Handler>(config: Config, handler: Arc<H>, connected: watch::Sender<bool>) {
    if let Err(error) = config.check() {
        warn!("NRI plugin not started: {error}");
        return;
    }
    let mut backoff = BACKOFF_MIN;
    let mut failures: u64 = 0;
    loop {
        let outcome = session::serve(&config, &handler, &connected).await;
        set_connected(&connected, false);
        if outcome.synced {
            backoff = BACKOFF_MIN;
            failures = 0;
        }
        let socket = config.socket.display();
        let error = &outcome.error;
        if failures == 0 {
            warn!(%socket, "NRI: connection ended: {error}; dialling again in {backoff:?}");
        } else {
            debug!(%socket, failures, "NRI: connection ended: {error}; dialling again in {backoff:?}");
        }
        failures += 1;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Sets `connected`, waking its watchers only on a change.
fn set_connected(connected: &watch::Sender<bool>, up: bool) {
    connected.send_if_modified(|now| std::mem::replace(now, up) != up);
}

impl From<proto::PodSandbox> for Pod {
    fn from(pod: proto::PodSandbox) -> Self {
        Self {
            id: pod.id,
            name: pod.name,
            namespace: pod.namespace,
            uid: pod.uid,
            annotations: pod.annotations,
            labels: pod.labels,
        }
    }
}

impl From<proto::Container> for Container {
    fn from(container: proto::Container) -> Self {
        let env = container
            .env
            .into_iter()
            .filter_map(|entry| {
                entry
                    .split_once('=')
                    .map(|(key, value)| (key.to_owned(), value.to_owned()))
            })
            .collect();
        let linux = container.linux.unwrap_or_default();
        let mounts = container
            .mounts
            .into_iter()
            .map(|mount| Mount {
                read_only: mount.options.iter().any(|option| option == "ro"),
                source: PathBuf::from(mount.source),
                destination: mount.destination,
            })
            .collect();
        Self {
            id: container.id,
            pod_id: container.pod_sandbox_id,
            name: container.name,
            env,
            annotations: container.annotations,
            mounts,
            cgroups_path: linux.cgroups_path,
            devices: linux.devices.into_iter().map(|device| device.path).collect(),
            cdi_devices: container
                .cdi_devices
                .into_iter()
                .map(|device| device.name)
                .collect(),
            pid: (container.pid != 0).then_some(container.pid),
        }
    }
}
