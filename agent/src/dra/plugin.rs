//! The kubelet plugin (`--dra`): two gRPC servers on the kubelet's Unix sockets.
//!
//! * Registration (`<--kubelet-registry-dir>/gpu.vramguard.io-reg.sock`): the kubelet finds
//!   the socket there, asks [`GetInfo`](Registration::get_info) (a `DRAPlugin` named
//!   [`DRIVER`], its endpoint the DRA socket's absolute path, the services it serves) and tells
//!   the result ([`NotifyRegistrationStatus`](Registration::notify_registration_status):
//!   logged, counted, and the `vramguard_dra_registered` gauge).
//! * DRA v1 (`<--kubelet-plugins-dir>/gpu.vramguard.io/dra.sock`): `NodePrepareResources` and
//!   `NodeUnprepareResources`, each claim answered on its own by the [`Preparer`] (one claim's
//!   failure is its `error`, never the call's); on the same socket, the devices' health
//!   (`v1alpha1.DRAResourceHealth`, [`super::health`]).
//!
//! Stale socket files (an earlier agent's) are removed at start; both are removed at the stop,
//! which the kubelet sees as the plugin going away.
//!
//! Metrics ([`Metrics`], on the agent's page):
//!
//! | family | counts |
//! |---|---|
//! | `vramguard_dra_prepares_total{result}` | claims prepared: `prepared`, `repeated` (answered from the checkpoint), `refused` |
//! | `vramguard_dra_prepare_refusals_total{reason}` | refused claims by [`Reason`] (`over_capacity`: the scheduler over-committed a GPU) |
//! | `vramguard_dra_unprepares_total{result}` | claims unprepared: `unprepared`, `not_prepared` (unknown UID: success), `failed` |
//! | `vramguard_dra_prepared_claims` | claims prepared on the node (the checkpoint's) |
//! | `vramguard_dra_admin_access_claims` | of those, claims with admin access (KEP-5018: monitoring, no quota, counted against no GPU) |
//! | `vramguard_dra_stale_claims_dropped_total` | prepared claims dropped because the API server no longer had them for `--dra-stale-after-s` |
//! | `vramguard_dra_stale_claims_in_use` | such claims kept at the last sweep because a container of theirs may still run |
//! | `vramguard_dra_registration_notifications_total{result}` | the kubelet's word on the registration: `registered`, `failed` |
//! | `vramguard_dra_registered` | 1 while the kubelet's last word was that the plugin is registered |
use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{Context, Result};
use futures_util::future::join_all;
use prometheus::{core::Collector, IntCounterVec, IntGauge, Opts};
use tokio::{net::UnixListener, sync::watch};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::{
    health::Health,
    prepare::{Asked, Claims, Outcome, Preparer, Reason},
    proto::{
        health::dra_resource_health_server::DraResourceHealthServer,
        registration::{
            registration_server::{Registration, RegistrationServer},
            InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
        },
        v1::{
            dra_plugin_server::{DraPlugin, DraPluginServer},
            Device, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
            NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
        },
    },
    Prepared, DRIVER,
};

/// The plugin type a DRA driver registers as.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// How long the stop waits for the calls in flight.
const DRAIN: std::time::Duration = std::time::Duration::from_millis(500);

/// The DRA service this plugin serves, as the registration names it.
pub const DRA_SERVICE: &str = "v1.DRAPlugin";

/// The kubelet's directories (`--kubelet-registry-dir`, `--kubelet-plugins-dir`).
#[derive(Clone, Debug)]
pub struct Sockets {
    pub registry_dir: PathBuf,
    pub plugins_dir: PathBuf,
}

impl Sockets {
    /// The registration socket, where the kubelet looks for plugins.
    pub fn registration(&self) -> PathBuf {
        self.registry_dir.join(format!("{DRIVER}-reg.sock"))
    }

    /// The DRA service's socket (the registration's endpoint).
    pub fn dra(&self) -> PathBuf {
        self.plugins_dir.join(DRIVER).join("dra.sock")
    }
}

/// The plugin's metrics (see the module's table).
#[derive(Clone)]
pub struct Metrics {
    prepares: IntCounterVec,
    refusals: IntCounterVec,
    unprepares: IntCounterVec,
    prepared: IntGauge,
    admin_access: IntGauge,
    stale: prometheus::IntCounter,
    stale_in_use: IntGauge,
    notifications: IntCounterVec,
    registered: IntGauge,
}

impl Metrics {
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let vec = |name: &str, help: &str, label: &str| IntCounterVec::new(Opts::new(name, help), &[label]);
        let metrics = Metrics {
            prepares: vec("vramguard_dra_prepares_total", "Claims the kubelet asked the DRA driver to prepare, by result: prepared, repeated (from the checkpoint), refused", "result")?,
            refusals: vec("vramguard_dra_prepare_refusals_total", "Claims the DRA driver refused to prepare, by reason (over_capacity: the allocation over-commits a GPU)", "reason")?,
            unprepares: vec("vramguard_dra_unprepares_total", "Claims the kubelet asked the DRA driver to unprepare, by result: unprepared, not_prepared, failed", "result")?,
            prepared: IntGauge::new("vramguard_dra_prepared_claims", "Claims prepared on this node by the DRA driver (its checkpoint's)")?,
            admin_access: IntGauge::new(
                "vramguard_dra_admin_access_claims",
                "Prepared claims with admin access (monitoring: their containers have no quota and count against no GPU)",
            )?,
            stale: prometheus::IntCounter::new(
                "vramguard_dra_stale_claims_dropped_total",
                "Prepared claims the DRA driver dropped because the API server no longer had them (deleted, or another UID) for --dra-stale-after-s",
            )?,
            stale_in_use: IntGauge::new(
                "vramguard_dra_stale_claims_in_use",
                "Prepared claims gone from the API server past --dra-stale-after-s kept because a container of theirs may still run (at the last sweep)",
            )?,
            notifications: vec("vramguard_dra_registration_notifications_total", "The kubelet's registration status notifications to the DRA plugin: registered, failed", "result")?,
            registered: IntGauge::new("vramguard_dra_registered", "1 while the kubelet's last word was that the DRA plugin is registered")?,
        };
        // Every series from the start, at zero.
        for result in ["prepared", "repeated", "refused"] {
            metrics.prepares.with_label_values(&[result]);
        }
        for reason in Reason::ALL {
            metrics.refusals.with_label_values(&[reason.label()]);
        }
        for result in ["unprepared", "not_prepared", "failed"] {
            metrics.unprepares.with_label_values(&[result]);
        }
        for result in ["registered", "failed"] {
            metrics.notifications.with_label_values(&[result]);
        }
        Ok(metrics)
    }

    /// The families, for the agent's page.
    pub fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.prepares.clone()),
            Box::new(self.refusals.clone()),
            Box::new(self.unprepares.clone()),
            Box::new(self.prepared.clone()),
            Box::new(self.admin_access.clone()),
            Box::new(self.stale.clone()),
            Box::new(self.stale_in_use.clone()),
            Box::new(self.notifications.clone()),
            Box::new(self.registered.clone()),
        ]
    }
}

/// The registration service.
struct Registrar {
    endpoint: PathBuf,
    metrics: Metrics,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: DRIVER.into(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: vec![DRA_SERVICE.into(), super::health::SERVICE.into()],
        }))
    }

    async fn notify_registration_status(&self, request: Request<RegistrationStatus>) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            info!(driver = DRIVER, "the kubelet registered the DRA plugin");
            self.metrics.notifications.with_label_values(&["registered"]).inc();
            self.metrics.registered.set(1);
        } else {
            warn!(driver = DRIVER, error = %status.error, "the kubelet did not register the DRA plugin");
            self.metrics.notifications.with_label_values(&["failed"]).inc();
            self.metrics.registered.set(0);
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// The DRA v1 service.
struct Driver<C> {
    preparer: Preparer<C>,
    metrics: Metrics,
}

fn asked(claim: super::proto::v1::Claim) -> Asked {
    Asked { namespace: claim.namespace, uid: claim.uid, name: claim.name }
}

/// The devices the kubelet is answered for a prepared claim: one per share.
pub fn devices(prepared: &Prepared) -> Vec<Device> {
    prepared
        .shares
        .iter()
        .map(|share| Device {
            request_names: vec![share.request.clone()],
            pool_name: share.pool.clone(),
            device_name: share.device.clone(),
            cdi_device_ids: vec![share.cdi_device.clone()],
            share_id: share.share_id.clone(),
        })
        .collect()
}

impl<C: Claims> Driver<C> {
    async fn prepare_one(&self, asked: Asked) -> (String, NodePrepareResourceResponse) {
        let answer = match self.preparer.prepare(&asked).await {
            Ok(outcome) => {
                let result = match &outcome {
                    Outcome::Prepared(prepared) => {
                        let shares: Vec<_> = prepared.shares.iter().map(|s| (s.gpu, s.memory)).collect();
                        info!(claim = %format!("{}/{}", asked.namespace, asked.name), uid = %asked.uid, ?shares, "prepared a claim");
                        "prepared"
                    }
                    Outcome::Repeated(_) => "repeated",
                };
                self.metrics.prepares.with_label_values(&[result]).inc();
                NodePrepareResourceResponse { devices: devices(outcome.prepared()), error: String::new() }
            }
            Err(refusal) => {
                warn!(uid = %asked.uid, reason = refusal.reason.label(), "refused to prepare a claim: {}", refusal.message);
                self.metrics.prepares.with_label_values(&["refused"]).inc();
                self.metrics.refusals.with_label_values(&[refusal.reason.label()]).inc();
                NodePrepareResourceResponse { devices: Vec::new(), error: refusal.message }
            }
        };
        (asked.uid, answer)
    }

    async fn unprepare_one(&self, asked: Asked) -> (String, NodeUnprepareResourceResponse) {
        let error = match self.preparer.unprepare(&asked).await {
            Ok(known) => {
                let result = if known { "unprepared" } else { "not_prepared" };
                info!(uid = %asked.uid, result, "unprepared a claim");
                self.metrics.unprepares.with_label_values(&[result]).inc();
                String::new()
            }
            Err(error) => {
                warn!(uid = %asked.uid, "cannot unprepare a claim: {error}");
                self.metrics.unprepares.with_label_values(&["failed"]).inc();
                error
            }
        };
        (asked.uid, NodeUnprepareResourceResponse { error })
    }

    async fn count(&self) {
        self.metrics.prepared.set(self.preparer.prepared_claims().await as i64);
        self.metrics.admin_access.set(self.preparer.admin_access_claims().await as i64);
    }
}

#[tonic::async_trait]
impl<C: Claims> DraPlugin for Driver<C> {
    async fn node_prepare_resources(&self, request: Request<NodePrepareResourcesRequest>) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims;
        let answers = join_all(claims.into_iter().map(|claim| self.prepare_one(asked(claim)))).await;
        self.count().await;
        Ok(Response::new(NodePrepareResourcesResponse { claims: answers.into_iter().collect() }))
    }

    async fn node_unprepare_resources(&self, request: Request<NodeUnprepareResourcesRequest>) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims;
        let answers = join_all(claims.into_iter().map(|claim| self.unprepare_one(asked(claim)))).await;
        self.count().await;
        Ok(Response::new(NodeUnprepareResourcesResponse { claims: answers.into_iter().collect() }))
    }
}

/// A Unix listener on `path` (mode 0600), its directory made and a stale socket file removed
/// first.
fn listen(path: &Path) -> Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => info!(socket = %path.display(), "removed a stale socket"),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error).with_context(|| format!("cannot remove the stale socket {}", path.display())),
    }
    let listener = UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))?;
    // The kubelet's (root's) alone: whoever connects prepares claims.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).with_context(|| format!("cannot restrict {}", path.display()))?;
    Ok(listener)
}

/// Binds both sockets (the DRA one first: the kubelet connects to it once it has the
/// registration's answer) and returns the plugin's task: it serves until `stop`, then removes
/// the sockets; a server's failure ends it with the error.
pub fn start<C: Claims>(
    sockets: Sockets,
    preparer: Preparer<C>,
    health: Health,
    metrics: Metrics,
    stale: Stale,
    mut stop: watch::Receiver<bool>,
) -> Result<impl std::future::Future<Output = Result<()>> + Send + 'static> {
    let dra_path = std::path::absolute(sockets.dra()).context("the DRA socket's absolute path")?;
    let registration_path = sockets.registration();
    let dra_listener = listen(&dra_path)?;
    let registration_listener = listen(&registration_path)?;
    info!(registration = %registration_path.display(), dra = %dra_path.display(), "serving the DRA kubelet plugin");
    let registrar = Registrar { endpoint: dra_path.clone(), metrics: metrics.clone() };
    let driver = Arc::new(Driver { preparer, metrics });
    let sweeper = driver.clone();
    Ok(async move {
        let stopped = async move {
            let _ = stop.wait_for(|stop| *stop).await;
        };
        let stopped = futures_util::future::FutureExt::shared(Box::pin(stopped));
        let stopping = stopped.clone();
        let sweep_stop = stopped.clone();
        driver.count().await;
        let dra = tonic::transport::Server::builder()
            .add_service(DraPluginServer::from_arc(driver))
            .add_service(DraResourceHealthServer::new(Arc::new(health)))
            .serve_with_incoming_shutdown(UnixListenerStream::new(dra_listener), stopped.clone());
        let registration = tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(registrar))
            .serve_with_incoming_shutdown(UnixListenerStream::new(registration_listener), stopped);
        // Claims gone from the API server, looked up between sweeps' sleeps; the stop ends it
        // at a sleep (a sweep under way is finished, as the calls in flight are).
        let sweeping = async move {
            let mut gone = std::collections::BTreeMap::new();
            let mut sweep_stop = std::pin::pin!(sweep_stop);
            loop {
                tokio::select! {
                    () = tokio::time::sleep(stale.every) => {}
                    () = &mut sweep_stop => return,
                }
                let swept = sweeper.preparer.sweep(&mut gone, stale.after).await;
                sweeper.metrics.stale.inc_by(swept.dropped.len() as u64);
                sweeper.metrics.stale_in_use.set(swept.in_use as i64);
                if !swept.dropped.is_empty() {
                    sweeper.count().await;
                }
            }
        };
        let served = async {
            tokio::try_join!(
                async { dra.await.context("the DRA service failed") },
                async { registration.await.context("the registration service failed") },
                async {
                    sweeping.await;
                    Ok::<(), anyhow::Error>(())
                },
            )
        };
        let mut served = std::pin::pin!(served);
        let failed = tokio::select! {
            // Before the stop, only a failure ends the servers.
            served = &mut served => Some(served),
            () = stopping => None,
        };
        // The kubelet's watcher sees the registration socket go: the plugin is deregistered.
        for path in [&registration_path, &dra_path] {
            let _ = std::fs::remove_file(path);
        }
        if let Some(served) = failed {
            return served.map(|_| ());
        }
        // Calls in flight are answered; an idle connection the kubelet keeps is not waited for.
        let _ = tokio::time::timeout(DRAIN, served).await;
        Ok(())
    })
}

/// When prepared claims gone from the API server are dropped ([`Preparer::sweep`]).
#[derive(Clone, Copy, Debug)]
pub struct Stale {
    pub after: std::time::Duration,
    pub every: std::time::Duration,
}

/// The DRA driver's flags of `vramguard run`.
#[derive(clap::Args, Clone, Debug)]
pub struct DraArgs {
    /// Be the DRA driver gpu.vramguard.io: publish the node's GPUs (NVML's; --gpu-memory's
    /// where there is no NVML) as a ResourceSlice pool and run the kubelet plugin that
    /// prepares the ResourceClaims allocated on them; the node-wide `vramguard.io/gpu-memory`
    /// is no longer advertised. Needs --kube (the API server) and --nri (no GPU is handed out
    /// without the ledger and limit the NRI side gives the claim's containers).
    #[arg(long)]
    pub dra: bool,
    /// The kubelet's plugin registry directory, where the registration socket is created.
    #[arg(long, default_value = "/var/lib/kubelet/plugins_registry", value_name = "DIR")]
    pub kubelet_registry_dir: PathBuf,
    /// The kubelet's plugins directory: the DRA socket is `<DIR>/gpu.vramguard.io/dra.sock`.
    #[arg(long, default_value = "/var/lib/kubelet/plugins", value_name = "DIR")]
    pub kubelet_plugins_dir: PathBuf,
    /// Where the prepared claims' CDI specs are written (a directory the runtime reads specs from).
    #[arg(long, default_value = "/var/run/cdi", value_name = "DIR")]
    pub cdi_dir: PathBuf,
    /// Where the GPUs' device nodes (`nvidia<N>`) are on the host: a prepared claim's CDI spec
    /// gives its containers `/dev/nvidia<N>`, and the driver's control nodes (`nvidiactl`,
    /// `nvidia-uvm`, ...) the host has, from there (the tests point it at stand-ins).
    #[arg(long, default_value = "/dev", value_name = "DIR")]
    pub dra_device_dir: PathBuf,
    /// Where the agent sees --dra-device-dir, to find which control nodes the host has (the
    /// DaemonSet mounts the host's /dev read-only at /host/dev: the agent container's own
    /// /dev is what its runtime gave it, without nvidia-uvm under the NVIDIA runtime's
    /// `utility` capability). Default: --dra-device-dir itself.
    #[arg(long, value_name = "DIR")]
    pub dra_host_dev: Option<PathBuf>,
    /// How long a prepared claim must be gone from the API server (deleted, or made again
    /// with another UID) before its entry is dropped without the kubelet's unprepare, in
    /// seconds (the kubelet unprepares a claim when its pods end; an entry left would hold
    /// its share of the GPU for good).
    #[arg(long, default_value_t = 600, value_name = "S")]
    pub dra_stale_after_s: u64,
    /// How often the prepared claims are looked up in the API server for that, in seconds.
    #[arg(long, default_value_t = 60, value_name = "S")]
    pub dra_stale_every_s: u64,
}

impl DraArgs {
    /// The GPUs' device nodes, on the host and as the agent sees them.
    pub fn nodes(&self) -> super::cdi::Nodes {
        let view = self.dra_host_dev.clone().unwrap_or_else(|| self.dra_device_dir.clone());
        super::cdi::Nodes { dir: self.dra_device_dir.clone(), view }
    }
}

/// What the plugin is given from the rest of the agent's configuration: the API server
/// (`--kube`), the node's name, the state directory.
#[derive(Clone, Default)]
pub struct Node {
    /// A client of the API server `--kube` names.
    pub kube: Option<kube::Client>,
    pub name: String,
    /// How many GPUs `--gpu-memory` names (the health's list until NVML first answers).
    pub flag_gpus: usize,
    pub state_dir: PathBuf,
    /// The NRI side's provisioner (`--nri`), whose claims' ledgers unprepare removes.
    pub ledgers: Option<Arc<crate::provision::Provisioner>>,
    /// Whether the NRI side is connected to the runtime: nothing is prepared while it is not.
    pub nri: Option<watch::Receiver<bool>>,
}

impl Node {
    /// The node as the agent's provisioning flags describe it.
    pub async fn of(provision: &crate::provision::ProvisionArgs) -> Result<Node> {
        let kube = match provision.kube.config().await? {
            Some(config) => Some(config.client()?),
            None => None,
        };
        let name = if kube.is_some() { provision.kube.node()?.to_owned() } else { String::new() };
        Ok(Node { kube, name, flag_gpus: provision.gpu_memory.len(), state_dir: provision.state_dir.clone(), ledgers: None, nri: None })
    }

    /// The node whose claims' ledgers are `provisioner`'s (`None` without `--nri`).
    pub fn with_ledgers(self, provisioner: Option<Arc<crate::provision::Provisioner>>) -> Node {
        Node { ledgers: provisioner, ..self }
    }

    /// The node whose NRI side says through `connected` whether it is connected to the runtime.
    pub fn with_nri(self, connected: Option<watch::Receiver<bool>>) -> Node {
        Node { nri: connected, ..self }
    }
}

/// The plugin as [`wire`] makes it.
pub struct Wired<T> {
    pub task: T,
    /// Its metrics' families.
    pub collectors: Vec<Box<dyn Collector>>,
    /// The GPUs its prepared claims hold whole, for the slices.
    pub held_whole: watch::Receiver<std::collections::BTreeSet<u32>>,
}

/// The plugin's task and its metrics' families as `--dra` asks for them (`None` without it):
/// the claims from the API server `--kube` names, the node's GPUs (the [`crate::inventory`]
/// the slices publish), the checkpoint in `--state-dir` (every recorded claim's CDI spec
/// restored before the sockets are served), the GPUs' health from the driver task's view.
pub async fn wire(
    args: &DraArgs,
    node: Node,
    gpus: crate::inventory::Shared,
    driver: watch::Receiver<Arc<crate::driver::DriverView>>,
    stop: watch::Receiver<bool>,
) -> Result<Option<Wired<impl std::future::Future<Output = Result<()>> + Send + 'static>>> {
    if !args.dra {
        return Ok(None);
    }
    let Some(client) = node.kube else {
        anyhow::bail!("--dra needs --kube: the DRA driver gets the claims it prepares from the API server");
    };
    let Node { name: node, state_dir, ledgers, flag_gpus, nri, .. } = node;
    if ledgers.is_none() {
        anyhow::bail!(
            "--dra needs --nri: a claim's GPU goes to its containers only with the ledger, hook and limit the NRI side gives them; \
             without it the containers would get the GPU and nothing behind their claim"
        );
    }
    let checkpoint_dir = state_dir.clone();
    let checkpoint = tokio::task::spawn_blocking(move || super::checkpoint::Checkpoint::own(&checkpoint_dir))
        .await
        .context("opening the DRA checkpoint")?
        .map_err(anyhow::Error::msg)?;
    info!(claims = checkpoint.claims().count(), path = %checkpoint.path().display(), "the DRA checkpoint");
    let claims = super::prepare::KubeClaims(client);
    // Before NVML answers: the flag's GPUs and those of the claims prepared already.
    let known: std::collections::BTreeSet<u32> = (0u32..).take(flag_gpus).chain(checkpoint.claims().flat_map(|c| c.shares.iter().map(|s| s.gpu))).collect();
    let health = Health { pool: node.clone(), gpus: gpus.clone(), known: std::sync::Mutex::new(known), driver };
    let preparer = Preparer::new(claims, node, gpus, args.cdi_dir.clone(), state_dir, checkpoint).with_nodes(args.nodes()).with_ledgers(ledgers).with_nri(nri);
    let (written, removed) = preparer.restore().await.map_err(|e| anyhow::anyhow!("restoring the prepared claims' CDI specs: {e}"))?;
    info!(written, removed, cdi_dir = %args.cdi_dir.display(), "the prepared claims' CDI specs restored (written: missing or different; removed: of claims not recorded)");
    let metrics = Metrics::new()?;
    let sockets = Sockets { registry_dir: args.kubelet_registry_dir.clone(), plugins_dir: args.kubelet_plugins_dir.clone() };
    if args.dra_stale_every_s == 0 {
        anyhow::bail!("--dra-stale-every-s must be at least 1");
    }
    let stale = Stale { after: std::time::Duration::from_secs(args.dra_stale_after_s), every: std::time::Duration::from_secs(args.dra_stale_every_s) };
    let held_whole = preparer.held_whole();
    let task = start(sockets, preparer, health, metrics.clone(), stale, stop)?;
    Ok(Some(Wired { task, collectors: metrics.collectors(), held_whole }))
}
