//! A stand-in for the kubelet's side of the DRA plugin protocol: it finds plugins as the
//! kubelet's plugin watcher does (sockets in its registry directory), asks each `GetInfo`,
//! checks what a DRA plugin must answer (type `DRAPlugin`, an absolute endpoint that exists,
//! `v1.DRAPlugin` among its services), tells it the result (`NotifyRegistrationStatus`),
//! connects to its endpoint and prepares and unprepares claims through it (the agent's
//! generated clients).
use std::{
    os::unix::fs::FileTypeExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use agent::dra::proto::{
    health::{dra_resource_health_client::DraResourceHealthClient, NodeWatchResourcesRequest, NodeWatchResourcesResponse},
    registration::{registration_client::RegistrationClient, InfoRequest, PluginInfo, RegistrationStatus},
    v1::{
        dra_plugin_client::DraPluginClient, Claim, NodePrepareResourcesRequest, NodePrepareResourcesResponse, NodeUnprepareResourcesRequest,
        NodeUnprepareResourcesResponse,
    },
};
use anyhow::{bail, Context, Result};
use tonic::{
    transport::{Channel, Endpoint},
    Streaming,
};

/// How long the kubelet waits for a plugin's answer (its own DRA timeout).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// The test kubelet.
pub struct Kubelet {
    registry_dir: PathBuf,
    runtime: tokio::runtime::Runtime,
}

/// A plugin the kubelet registered: what it said of itself and a connection to its endpoint.
pub struct Plugin {
    pub info: PluginInfo,
    /// The registration socket it was found at.
    pub socket: PathBuf,
    channel: Channel,
}

/// A claim as the kubelet names it.
pub fn claim(namespace: &str, name: &str, uid: &str) -> Claim {
    Claim { namespace: namespace.into(), uid: uid.into(), name: name.into() }
}

/// A channel to a gRPC server on the Unix socket `path`.
async fn connect(path: &Path) -> Result<Channel> {
    let endpoint = Endpoint::try_from(format!("unix://{}", path.display()))?.timeout(CALL_TIMEOUT);
    endpoint.connect().await.with_context(|| format!("cannot connect to {}", path.display()))
}

impl Kubelet {
    pub fn new(registry_dir: &Path) -> Result<Kubelet> {
        std::fs::create_dir_all(registry_dir)?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        Ok(Kubelet { registry_dir: registry_dir.to_owned(), runtime })
    }

    /// Waits up to `within` for a socket in the registry directory whose plugin answers
    /// `GetInfo` with `driver`'s name, checks its answer, notifies it of its registration and
    /// connects to its endpoint. A plugin whose answer is not a DRA plugin's is told so
    /// (`plugin_registered: false`) and the call fails.
    pub fn register(&self, driver: &str, within: Duration) -> Result<Plugin> {
        let deadline = Instant::now() + within;
        loop {
            for socket in self.sockets()? {
                let Ok(info) = self.runtime.block_on(get_info(&socket)) else { continue };
                if info.name != driver {
                    continue;
                }
                let problem = check(&info);
                self.runtime.block_on(notify(&socket, problem.clone()))?;
                if let Some(problem) = problem {
                    bail!("the plugin at {} is not a DRA plugin: {problem} ({info:?})", socket.display());
                }
                let channel = self.runtime.block_on(connect(Path::new(&info.endpoint)))?;
                return Ok(Plugin { info, socket, channel });
            }
            if Instant::now() > deadline {
                bail!("no plugin {driver} registered in {} within {within:?}", self.registry_dir.display());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The socket files in the registry directory.
    fn sockets(&self) -> Result<Vec<PathBuf>> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&self.registry_dir)? {
            let entry = entry?;
            if entry.file_type()?.is_socket() {
                found.push(entry.path());
            }
        }
        Ok(found)
    }

    /// `NodePrepareResources` of `claims`.
    pub fn prepare(&self, plugin: &Plugin, claims: Vec<Claim>) -> Result<NodePrepareResourcesResponse> {
        let mut client = DraPluginClient::new(plugin.channel.clone());
        let answer = self.runtime.block_on(client.node_prepare_resources(NodePrepareResourcesRequest { claims }))?;
        Ok(answer.into_inner())
    }

    /// `NodeUnprepareResources` of `claims`.
    pub fn unprepare(&self, plugin: &Plugin, claims: Vec<Claim>) -> Result<NodeUnprepareResourcesResponse> {
        let mut client = DraPluginClient::new(plugin.channel.clone());
        let answer = self.runtime.block_on(client.node_unprepare_resources(NodeUnprepareResourcesRequest { claims }))?;
        Ok(answer.into_inner())
    }
}

impl Kubelet {
    /// Starts watching the plugin's devices' health (`NodeWatchResources`).
    pub fn watch_health(&self, plugin: &Plugin) -> Result<Streaming<NodeWatchResourcesResponse>> {
        let mut client = DraResourceHealthClient::new(plugin.channel.clone());
        Ok(self.runtime.block_on(client.node_watch_resources(NodeWatchResourcesRequest {}))?.into_inner())
    }

    /// Reads the health watch until a message satisfies `wanted` (within `within`): that one.
    pub fn health_until(
        &self,
        watch: &mut Streaming<NodeWatchResourcesResponse>,
        within: Duration,
        wanted: impl Fn(&NodeWatchResourcesResponse) -> bool,
    ) -> Result<NodeWatchResourcesResponse> {
        self.runtime.block_on(async {
            let mut last = None;
            let reading = async {
                while let Some(message) = watch.message().await? {
                    if wanted(&message) {
                        return Ok(message);
                    }
                    last = Some(message);
                }
                bail!("the health watch ended")
            };
            match tokio::time::timeout(within, reading).await {
                Ok(read) => read,
                Err(_) => bail!("no such health within {within:?}; the last: {last:?}"),
            }
        })
    }
}

async fn get_info(socket: &Path) -> Result<PluginInfo> {
    let mut client = RegistrationClient::new(connect(socket).await?);
    Ok(client.get_info(InfoRequest {}).await?.into_inner())
}

async fn notify(socket: &Path, problem: Option<String>) -> Result<()> {
    let mut client = RegistrationClient::new(connect(socket).await?);
    let status = RegistrationStatus { plugin_registered: problem.is_none(), error: problem.unwrap_or_default() };
    client.notify_registration_status(status).await?;
    Ok(())
}

/// What the kubelet refuses in a DRA plugin's `GetInfo` answer.
fn check(info: &PluginInfo) -> Option<String> {
    if info.r#type != "DRAPlugin" {
        return Some(format!("type {:?}, not DRAPlugin", info.r#type));
    }
    let endpoint = Path::new(&info.endpoint);
    if !endpoint.is_absolute() || !std::fs::metadata(endpoint).is_ok_and(|m| m.file_type().is_socket()) {
        return Some(format!("endpoint {:?} is not an absolute path to a socket", info.endpoint));
    }
    if !info.supported_versions.iter().any(|v| v == "v1.DRAPlugin") {
        return Some(format!("no supported version this kubelet speaks in {:?}", info.supported_versions));
    }
    None
}
