//! Provisioning: quotas that belong to the operator.
//!
//! A container whose quota comes from a trusted party (the pod spec's
//! `vramguard.io/gpu-memory` limit through [`kube`], the operator's quota file, or, behind an
//! admin flag, a pod annotation: [`quota`]) gets, before it starts, injected by the container
//! runtime through NRI ([`nri`]):
//!
//! | in the container | from the host | |
//! |---|---|---|
//! | [`ledger::provisioned::LEDGER`] | `<ledger-dir>/<container id>/ledger`, created by the agent with the quota on each GPU the runtime gave the container, in a tmpfs of the ledger's size ([`mount`]) | read-write, alone: it can be written, not removed, replaced or grown past its size |
//! | [`ledger::provisioned::LIMITS`] | the header of that ledger as the agent created it ([`store`]) | read-only: the hook's only source of limits |
//! | [`ledger::provisioned::HOOK`] | `--hook-library` | read-only |
//! | [`ledger::provisioned::PRELOAD`] | `<state-dir>/ld.so.preload`, naming the hook | read-only: every dynamically linked process loads the hook |
//! | env `VRAMGUARD_LEDGER`, `CUDA_DEVICE_MEMORY_LIMIT`, `POD_NAME`, `POD_NAMESPACE`, `CONTAINER_NAME` | the agent's values (they win over the pod's) | for tools; the hook ignores them here |
//! | env `NVIDIA_VISIBLE_DEVICES` (a DRA claim's containers) | the claim's GPUs by UUID (`none` where one is not known) | NVIDIA's runtime gives the container those GPUs alone (and the driver's libraries), whatever the image's `all` |
//!
//! The agent holds the ledger to the header it created ([`crate::ledgers::Ledgers::set_pins`]: a
//! rewritten or re-created file is `tampered`, never adopted) and pushes the container's
//! cgroup limit (the quota times the GPUs it was given) to the eBPF probes, the backstop for
//! processes the hook does not see. Pods without a quota are not touched.
//!
//! The GPUs a container was given are the runtime's word ([`gpus`]: its device nodes and CDI
//! devices), never the container's environment: the ledger has one device per such GPU (in
//! the node's order, as the driver numbers them in the container), the cgroup limit and the
//! over-commit check count them. A container whose GPUs the runtime does not say gets the
//! quota on every GPU, a log line and a count ([`Provisioner::gpus_undetermined`]).
//!
//! * [`nri`]: the NRI plugin: the runtime's socket, its wire protocol, the event loop.
//! * [`claim`]: containers of a DRA claim, provisioned from the claim's shares (one ledger
//!   per claim, shared by its containers).
//! * [`gpus`]: which GPUs the runtime gave a container.
//! * [`kube`]: the Kubernetes API side: pod lookup, the node's advertised capacity.
//! * [`quota`]: the quota file and the annotation.
//! * [`store`]: what the agent keeps on the host per provisioned container.
//! * [`mount`]: the size-capped tmpfs of each provisioned ledger.
//! * [`metrics`]: provisioning's counters.
//!
//! # Within the runtime's deadline
//!
//! The runtime waits for CreateContainer's answer a bounded time (the agent answers by
//! [`nri::Config::handler_deadline`], under the runtime's own). Looking the quota up is bounded
//! below it (the Kubernetes lookup's deadline); the steps that block (the tmpfs mount, the
//! ledger's pages, the record's files) run on tokio's blocking pool, never on the runtime's
//! threads. A creation the runtime was answered about at the deadline (it then fails the
//! container) is abandoned ([`Provisioner::abandon`]): what it made is removed at once, or, if
//! its blocking step is still running, by that step when it ends; it is never recorded as
//! provisioned. Counted in `vramguard_provision_timed_out_total` and
//! `vramguard_provision_timed_out_removed_total{what}`.
//!
//! # When the Kubernetes API cannot answer
//!
//! A container is refused only if it is known to have a quota that cannot be provisioned.
//! With `--kube`, the quota comes from the pod cache (the node's pods as the watch last saw
//! them) or a direct lookup; when neither answers (the API server down, an error, past the
//! lookup deadline, a pod it does not know), the node decides from what it knows
//! (`Provisioner::decide_without_api`): the pod cache, then the cache's last state on disk
//! (`<state-dir>/pods.json`, written by the watch, read at start): a pod known to have a
//! quota is provisioned with it (limits cannot change for a pod UID), one known without is
//! created untouched; a static pod (the kubelet's `kubernetes.io/config.source` annotation on
//! the sandbox is not `api`) and a pod the node knows nothing of are created untouched, and
//! looked at again whenever the pod cache changes: one found to have a quota then is held to
//! it by its cgroup limit (`Provisioner::recheck_undecided`). Each such decision is a log
//! line and a count in `vramguard_provision_decisions_without_api_total{decision}`.
pub mod claim;
pub mod gpus;
pub mod kube;
pub mod metrics;
pub mod mount;
pub mod nri;
pub mod quota;
pub mod store;

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use ledger::provisioned;
use tracing::{info, warn};

use metrics::{Counters, Decision, Refusal};
use nri::{Adjustment, Mount};
pub use store::{Provisioned, Record};
use quota::{QuotaFile, Subject};
use store::Store;

/// The most containers of unknown quota kept to be looked at again.
const MAX_UNDECIDED: usize = 4096;

/// The NVIDIA container runtime's variable naming the GPUs it gives a container.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// `--max-provisioned-containers` by default: a bit over the kubelet's default 110 pods, each
/// with one container with a GPU-memory quota (the usual GPU pod).
pub const DEFAULT_MAX_CONTAINERS: usize = 128;
/// `--max-provisioned-per-pod` by default.
pub const DEFAULT_MAX_PER_POD: usize = 16;

/// The sandbox annotation the kubelet puts on every pod with where it came from (`api`, or
/// `file` and `http` for static pods).
pub const CONFIG_SOURCE: &str = "kubernetes.io/config.source";

/// Whether a sandbox's annotations say it is a static pod (its source is not the API server).
pub fn is_static_pod(annotations: &BTreeMap<String, String>) -> bool {
    annotations.get(CONFIG_SOURCE).is_some_and(|source| source != "api")
}

/// The flags of provisioning (`vramguard run`).
#[derive(clap::Args, Clone, Debug)]
pub struct ProvisionArgs {
    /// Provision containers through the container runtime's NRI socket (needs --ledger-dir
    /// and a quota source: --kube, --quota-file or --quota-from-annotation).
    #[arg(long)]
    pub nri: bool,
    /// The runtime's NRI socket.
    #[arg(long, default_value = "/var/run/nri/nri.sock")]
    pub nri_socket: PathBuf,
    /// Where the agent keeps what it provisioned (only the agent may write there).
    #[arg(long, default_value = "/var/lib/vramguard")]
    pub state_dir: PathBuf,
    /// The hook library on the host, mounted read-only into provisioned containers.
    #[arg(long, default_value = "/var/lib/vramguard/lib/libvramguard.so")]
    pub hook_library: PathBuf,
    /// A file of quota rules (selectors on namespace, pod, pod UID, container, cgroup; see
    /// docs/operations.md), for nodes without Kubernetes.
    #[arg(long)]
    pub quota_file: Option<PathBuf>,
    /// Take quotas from the pod annotation `vramguard.io/gpu-memory[.<container>]`: only
    /// where whoever creates pods is trusted to set quotas.
    #[arg(long)]
    pub quota_from_annotation: bool,
    /// Each GPU's memory, one size per GPU (Kubernetes quantities or sizes: `80Gi,80Gi`): the
    /// ledgers' devices, the overcommit check and the capacity advertised with --kube (their
    /// sum times --overcommit; none without it).
    #[arg(long, value_delimiter = ',', value_parser = parse_size_arg)]
    pub gpu_memory: Vec<u64>,
    /// Refuse a container whose quota would make a GPU's summed quotas exceed its memory.
    #[arg(long)]
    pub refuse_overcommit: bool,
    /// The mount namespace where the runtime finds the ledgers' host paths, as a
    /// `/proc/<pid>/ns/mnt` path (the DaemonSet: `/proc/1/ns/mnt`, the host's): each
    /// provisioned ledger's size-capped tmpfs is mounted there. Without it: the agent's own
    /// (an agent running on the host).
    #[arg(long)]
    pub ledger_mount_namespace: Option<PathBuf>,
    /// The most containers provisioned on the node at once: past it, a container with a quota
    /// is refused (its creation fails, counted in `vramguard_provision_refused_total{reason="node_cap"}`).
    /// Bounds what the ledgers cost the node (see docs/limits.md).
    #[arg(long, default_value_t = DEFAULT_MAX_CONTAINERS, value_name = "N")]
    pub max_provisioned_containers: usize,
    /// The most containers of one pod provisioned at once (`reason="pod_cap"` past it).
    #[arg(long, default_value_t = DEFAULT_MAX_PER_POD, value_name = "N")]
    pub max_provisioned_per_pod: usize,
    /// The most memory the provisioned containers' ledgers take together (each is a tmpfs the
    /// agent fills, charged to its memory cgroup): past it, a container is refused
    /// (`reason="ledger_memory"`). Sizes as --gpu-memory's.
    #[arg(long, default_value = "512Mi", value_parser = parse_size_arg, value_name = "BYTES")]
    pub max_ledger_memory: u64,
    /// Processes of one provisioned container that may use the GPU at once: the slots of its
    /// ledger (a process past them gets its GPU allocations refused by the hook).
    #[arg(long, default_value_t = store::DEFAULT_PROCESSES, value_parser = clap::value_parser!(u32).range(1..=i64::from(ledger::layout::MAX_SLOTS)), value_name = "N")]
    pub max_processes_per_container: u32,
    #[command(flatten)]
    pub kube: kube::KubeArgs,
}


fn parse_size_arg(text: &str) -> Result<u64, String> {
    parse_quota(text).ok_or_else(|| format!("{text:?} is not a size (bytes, k/m/g/t, or a Kubernetes quantity such as 80Gi)"))
}

/// A size as a quota is written: a Kubernetes quantity (`8Gi`, `8G`, `8589934592`) or the
/// hook's sizes (`8g`, 1024-based).
pub fn parse_quota(text: &str) -> Option<u64> {
    kube::parse_quantity(text).or_else(|| cuda_abi::parse_size(text))
}

/// A container being created, as the runtime describes it.
#[derive(Clone, Debug, Default)]
pub struct Workload {
    pub pod_id: String,
    pub pod_uid: String,
    pub namespace: String,
    pub pod: String,
    pub container_id: String,
    pub container: String,
    pub cgroups_path: String,
    /// The paths of the OCI spec's device nodes (the runtime's).
    pub devices: Vec<String>,
    /// The CDI devices the runtime reports.
    pub cdi_devices: Vec<String>,
    /// The OCI spec's mounts (the runtime's: a DRA claim's CDI spec adds one, [`claim`]).
    pub mounts: Vec<Mount>,
    /// The container's annotations (the CDI ones are the kubelet's).
    pub container_annotations: BTreeMap<String, String>,
    /// The pod's annotations.
    pub annotations: BTreeMap<String, String>,
    /// The NVIDIA toolkit's memory variables the container's own environment sets
    /// ([`TOOLKIT_MEMORY_VARS`]): the agent overrides them, and adds none.
    pub toolkit_vars: Vec<String>,
    /// `NVIDIA_VISIBLE_DEVICES` as the container's environment has it (the image's, the pod
    /// spec's, or NVIDIA's device plugin's under its `envvar` strategy), for a claim's
    /// containers only ([`claim::device_plugin_gpus`]): never trusted to give GPUs.
    pub visible_devices: Option<String>,
}

/// Where quotas come from, in this order: the Kubernetes pod spec, the quota file, the
/// annotation.
#[derive(Default)]
pub struct Sources {
    pub kube: Option<kube::PodCache>,
    pub file: Option<QuotaFile>,
    pub annotation: bool,
}

/// The provisioned containers and how to provision more.
pub struct Provisioner {
    store: Store,
    /// `--state-dir`: where the DRA checkpoint and claims' directories are ([`claim`]).
    state_dir: PathBuf,
    /// The DRA claims' shared ledgers.
    claims: claim::Claims,
    /// Where the cgroup2 tree is mounted (`None`: none is): unprepare's word on whether a
    /// claim's containers still run ([`claim::liveness`]).
    cgroup_root: Option<PathBuf>,
    sources: Sources,
    hook: PathBuf,
    preload: PathBuf,
    /// `--gpu-memory`: its count is the node's GPUs where nothing else says (see
    /// [`Self::node_gpus`]).
    gpu_memory: Vec<u64>,
    /// The node's GPUs as the agent's [`crate::inventory`] has them (NVML's where it answers,
    /// `--gpu-memory`'s where NVML is absent): what the DRA driver publishes and prepares
    /// from, and what the NRI side sizes with; wins over `gpu_memory`.
    gpus: crate::inventory::Shared,
    /// The host's GPU device files (patterns: `/dev/nvidia{minor}`, the GPU operator's driver
    /// root's), counted where the inventory does not say how many GPUs the node has.
    device_files: Vec<String>,
    /// Where the driver's own per-cgroup limits are asked for at StartContainer (`None`:
    /// not asked; the limits task's passes still set them).
    limiter: Option<crate::driver_limits::Limiter>,
    refuse_overcommit: bool,
    /// `--max-provisioned-containers`, `--max-provisioned-per-pod`.
    max_containers: usize,
    max_per_pod: usize,
    /// `--max-ledger-memory`.
    max_ledger_memory: u64,
    /// By container id.
    containers: Arc<Mutex<BTreeMap<String, Provisioned>>>,
    /// Creations whose blocking step runs now, by container id.
    in_flight: Flights,
    counters: Counters,
    /// Containers with a quota that the runtime created while the agent was away (found in
    /// Synchronize): not provisioned (no hook, no ledger), held by their cgroup limit only.
    /// By container id: (pod sandbox id, cgroup path, limit).
    unprovisioned: Mutex<BTreeMap<String, (String, String, u64)>>,
    /// Containers created untouched because neither the API nor the node could tell their
    /// quota, by container id: looked at again when the pod cache changes.
    undecided: Mutex<BTreeMap<String, Workload>>,
    /// Containers the runtime has whose GPUs it did not say (held to every GPU), by container
    /// id: their pod sandbox id. Each is logged once.
    undetermined: Mutex<BTreeMap<String, String>>,
    /// How many containers were held to every GPU because their GPUs were undetermined.
    undetermined_total: AtomicU64,
    /// Bumped at every change, for the agent's loop.
    generation: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Provisioner {
    /// Checks the files it injects, writes the preload list, and reads back what it
    /// provisioned before a restart.
    pub fn new(args: &ProvisionArgs, ledger_dir: &Path, sources: Sources) -> Result<Provisioner, String> {
        let mounts = mount::Mounter::new(args.ledger_mount_namespace.clone());
        Provisioner::with_mounts(args, ledger_dir, sources, Some(mounts))
    }

    /// [`Provisioner::new`] with ledger directories mounted by `mounts` (`None`: plain
    /// directories, for unit tests).
    fn with_mounts(args: &ProvisionArgs, ledger_dir: &Path, sources: Sources, mounts: Option<mount::Mounter>) -> Result<Provisioner, String> {
        let hook = std::fs::metadata(&args.hook_library)
            .map_err(|e| format!("--hook-library {}: {e}", args.hook_library.display()))?;
        if !hook.is_file() {
            return Err(format!("--hook-library {} is not a file", args.hook_library.display()));
        }
        let sizing = store::Sizing { processes: args.max_processes_per_container, gpus: crate::inventory::fixed(None) };
        let store = Store::open(&args.state_dir, ledger_dir, mounts)?.sized(sizing);
        let preload = args.state_dir.join("ld.so.preload");
        std::fs::write(&preload, format!("{}\n", provisioned::HOOK)).map_err(|e| format!("cannot write {}: {e}", preload.display()))?;
        store.remove_unfinished();
        store.unmount_leftovers();
        let (found, problems) = store.load();
        for problem in problems {
            warn!(%problem, "a provisioned container's record cannot be read: it is not restored");
        }
        let (ledgers, found): (Vec<Provisioned>, Vec<Provisioned>) = found.into_iter().partition(|p| claim::is_ledger_id(&p.record.container_id));
        info!(containers = found.len(), state_dir = %args.state_dir.display(), "provisioned containers restored from the state directory");
        let claims = claim::Claims::restore(&store, ledgers, &found);
        let containers = found.into_iter().map(|p| (p.record.container_id.clone(), p)).collect();
        if let Some(pods) = &sources.kube {
            pods.remember_in(&args.state_dir.join(kube::REMEMBERED));
        }
        Ok(Provisioner {
            store,
            state_dir: args.state_dir.clone(),
            claims,
            cgroup_root: crate::cgroup::cgroup2_mount(),
            sources,
            hook: args.hook_library.clone(),
            preload,
            gpu_memory: args.gpu_memory.clone(),
            gpus: crate::inventory::fixed(None),
            device_files: Vec::new(),
            limiter: None,
            refuse_overcommit: args.refuse_overcommit,
            max_containers: args.max_provisioned_containers,
            max_per_pod: args.max_provisioned_per_pod,
            max_ledger_memory: args.max_ledger_memory,
            containers: Arc::new(Mutex::new(containers)),
            in_flight: Arc::new(Mutex::new(HashMap::new())),
            counters: Counters::new().map_err(|e| format!("provisioning's metrics: {e}"))?,
            unprovisioned: Mutex::new(BTreeMap::new()),
            undecided: Mutex::new(BTreeMap::new()),
            undetermined: Mutex::new(BTreeMap::new()),
            undetermined_total: AtomicU64::new(0),
            generation: Arc::new(tokio::sync::watch::channel(0).0),
        })
    }

    /// Provisioning's counters (their families join the agent's page).
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// A receiver that sees every change of the provisioned set.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }

    fn changed(&self) {
        self.generation.send_modify(|generation| *generation += 1);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Provisioned>> {
        self.containers.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether the Kubernetes pod cache has its first list (`None` without `--kube`).
    /// The pod cache (with `--kube`).
    pub fn kube_pods(&self) -> Option<&kube::PodCache> {
        self.sources.kube.as_ref()
    }

    pub fn kube_synced(&self) -> Option<bool> {
        self.sources.kube.as_ref().map(|pods| pods.state().synced())
    }

    /// The provisioner that sizes the node, and its ledgers, by `gpus` (the agent's
    /// inventory) where it has one, else counts the GPUs by the host's device files
    /// (`device_files`, `{minor}` standing for the number: see [`Self::node_gpus`]).
    pub fn with_inventory(self, gpus: crate::inventory::Shared, device_files: Vec<String>) -> Provisioner {
        let store = self.store.resized(gpus.clone());
        Provisioner { gpus, store, device_files, ..self }
    }

    /// Asks `limiter` for the driver's own limits of each provisioned container as it starts.
    pub fn with_driver_limits(self, limiter: crate::driver_limits::Limiter) -> Provisioner {
        Provisioner { limiter: Some(limiter), ..self }
    }

    /// What the driver is asked for each provisioned container: its quota on each of its
    /// GPUs, on its cgroup (one whose cgroup path cannot be named is left out).
    /// A container held to its quota by its cgroup limit alone (created while its quota could
    /// not be told, found since: no ledger, no hook) gets that limit on every GPU as a bound,
    /// the probes keeping its total (never held by the driver).
    pub fn driver_wants(&self) -> Vec<crate::driver_limits::Want> {
        let mut wants: Vec<crate::driver_limits::Want> = self.lock().values().filter_map(|p| driver_want(&p.record)).collect();
        if let Ok(late) = self.unprovisioned.lock() {
            wants.extend(late.iter().map(|(id, (_, cgroup, limit))| crate::driver_limits::Want {
                container: id.clone(),
                cgroup: cgroup.clone(),
                quotas: Vec::new(),
                others: *limit,
                hold: false,
            }));
        }
        wants
    }

    /// The range of the node's GPU indices: the inventory's (NVML's minor numbers; the
    /// flag's where NVML is absent), else (NVML not read yet, or failing before it ever
    /// answered: a container created then is still held to the GPUs it was given) one past the
    /// highest minor number of the host's GPU device files, else `--gpu-memory`'s count; one
    /// when none says.
    fn node_gpus(&self) -> u32 {
        let known = self.gpus.borrow().as_ref().map(|inventory| inventory.index_bound()).filter(|&bound| bound > 0);
        let files = || crate::inventory::device_files(&self.device_files).last().map_or(0, |minor| minor + 1);
        let flag = || u32::try_from(self.gpu_memory.len()).unwrap_or(u32::MAX);
        known.unwrap_or_else(|| Some(files()).filter(|&files| files > 0).unwrap_or_else(flag)).max(1)
    }

    /// GPU `index`'s memory: the inventory's (unknown before it has one).
    fn gpu_memory_of(&self, index: usize) -> Option<u64> {
        crate::inventory::memory_of(&self.gpus, index)
    }

    /// How many containers with a quota were held to every GPU since the agent started because
    /// the runtime did not say which GPUs they were given (each counted once).
    pub fn gpus_undetermined(&self) -> u64 {
        self.undetermined_total.load(Ordering::Relaxed)
    }

    /// The GPUs the runtime gave `workload`, as indices of the node's; every GPU when it does
    /// not say (logged and counted once per container).
    fn given_gpus(&self, workload: &Workload) -> Vec<usize> {
        let gpus = self.node_gpus();
        match gpus::given(&workload.devices, &workload.cdi_devices, &workload.container_annotations, gpus) {
            Ok(given) => given,
            Err(reason) => {
                let first = self
                    .undetermined
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .insert(workload.container_id.clone(), workload.pod_id.clone())
                    .is_none();
                if first {
                    self.undetermined_total.fetch_add(1, Ordering::Relaxed);
                    warn!(
                        namespace = %workload.namespace, pod = %workload.pod, container = %workload.container,
                        id = %workload.container_id, %reason, gpus,
                        "the runtime does not say which GPUs the container was given: its quota holds on every GPU"
                    );
                }
                (0..gpus as usize).collect()
            }
        }
    }

    /// Forgets the containers of unknown quota `gone` says are gone.
    fn forget_undecided(&self, gone: impl Fn(&str, &Workload) -> bool) {
        self.undecided.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).retain(|id, w| !gone(id, w));
    }

    /// Forgets the undetermined containers `gone` says are gone.
    fn forget_undetermined(&self, gone: impl Fn(&str, &str) -> bool) {
        self.undetermined.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).retain(|id, pod| !gone(id, pod));
    }

    /// How many containers are provisioned now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The provisioned containers now.
    pub fn provisioned(&self) -> Vec<Provisioned> {
        self.lock().values().cloned().collect()
    }

    /// The provisioned containers' ledgers, each held to the header the agent created it with
    /// and named as the runtime named its container.
    pub fn pins(&self) -> BTreeMap<PathBuf, crate::ledgers::Pin> {
        self.provisioned()
            .into_iter()
            .map(|p| {
                let r = p.record;
                (p.ledger, crate::ledgers::Pin { header: p.header, names: [r.namespace, r.pod, r.container, r.pod_uid] })
            })
            .collect()
    }

    /// Keeps `pins` (for the reclaim task) and `limits` (cgroup path -> bytes, for the kernel
    /// task) in step with the provisioned set, for as long as the agent runs.
    pub async fn publish(
        self: Arc<Self>,
        pins: tokio::sync::watch::Sender<BTreeMap<PathBuf, crate::ledgers::Pin>>,
        limits: tokio::sync::watch::Sender<BTreeMap<String, u64>>,
    ) {
        let mut changes = self.changes();
        let mut pods = self.sources.kube.as_ref().map(kube::PodCache::changes);
        loop {
            pins.send_replace(self.pins());
            limits.send_replace(self.cgroup_limits());
            let pods_changed = async {
                let changed = match pods.as_mut() {
                    Some(pods) => pods.changed().await.is_ok(),
                    None => false,
                };
                if !changed {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                () = pods_changed => self.recheck_undecided(),
            }
        }
    }

    /// Containers created untouched because neither the API nor the node could tell their
    /// quota, looked at again now that the pod cache changed: one the cache now knows to have
    /// a quota is held to it by its cgroup limit (the eBPF probes' backstop: it runs without
    /// the hook), logged; one it knows to have none is forgotten.
    fn recheck_undecided(&self) {
        let Some(pods) = &self.sources.kube else { return };
        let mut held = false;
        let undecided = std::mem::take(&mut *self.undecided.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        let mut still = BTreeMap::new();
        for (id, w) in undecided {
            match pods.known(&w.namespace, &w.pod, &w.pod_uid, &w.container) {
                None => {
                    still.insert(id, w);
                }
                Some((Ok(Some(quota)), _)) if quota > 0 => {
                    let Some(cgroup) = cgroup_dir(&w.cgroups_path) else { continue };
                    let limit = store::cgroup_limit(quota, self.given_gpus(&w).len());
                    warn!(
                        namespace = %w.namespace, pod = %w.pod, container = %w.container, id = %id, quota, cgroup = %cgroup,
                        "a container created while its quota was unknown has one: it runs without the hook; its cgroup is held to its limit by the eBPF probes"
                    );
                    if let Ok(mut late) = self.unprovisioned.lock() {
                        late.insert(id, (w.pod_id.clone(), cgroup, limit));
                    }
                    held = true;
                }
                Some((limit, _)) => {
                    if let Err(value) = limit {
                        warn!(namespace = %w.namespace, pod = %w.pod, container = %w.container, %value, "a container created while its quota was unknown has a limit that is not whole bytes: not held");
                    }
                }
            }
        }
        self.undecided.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).extend(still);
        if held {
            self.changed();
        }
    }

    /// The container's quota per GPU and where it came from; `None`: not provisioned.
    async fn quota(&self, workload: &Workload) -> Result<Option<(u64, &'static str)>, String> {
        if let Some(kube) = &self.sources.kube {
            if let Some(quota) = self.kube_quota(kube, workload).await? {
                return Ok(Some(quota));
            }
        }
        if let Some(file) = &self.sources.file {
            let cgroup = cgroup_dir(&workload.cgroups_path).unwrap_or_default();
            let subject = Subject {
                namespace: &workload.namespace,
                pod: &workload.pod,
                pod_uid: &workload.pod_uid,
                container: &workload.container,
                cgroup: &cgroup,
            };
            if let Some(quota) = file.quota(&subject) {
                return Ok(Some((quota, "quota file")));
            }
        }
        if self.sources.annotation {
            if let Some(quota) = quota::from_annotations(&workload.annotations, &workload.container)? {
                return Ok(Some((quota, "annotation")));
            }
        }
        Ok(None)
    }

    /// The container's quota from the pod spec: what the node knows of the pod (the pod
    /// cache, its last state on disk), else a lookup in the API; when the API cannot answer,
    /// decided by what the node knows (`Provisioner::decide_without_api`). Err: the
    /// container is known to have a quota that cannot be provisioned.
    async fn kube_quota(&self, pods: &kube::PodCache, w: &Workload) -> Result<Option<(u64, &'static str)>, String> {
        if let Some((limit, from)) = pods.known(&w.namespace, &w.pod, &w.pod_uid, &w.container) {
            let quota = limit.map_err(|value| {
                format!("vramguard: container {} of pod {}/{} has a {} limit of {value:?}, not a whole number of bytes: it cannot be provisioned", w.container, w.namespace, w.pod, kube::RESOURCE)
            });
            let (source, without_api) = match from {
                kube::Known::Watch => ("kubernetes", !pods.state().connected()),
                kube::Known::Disk => ("kubernetes (last known state)", true),
            };
            if without_api {
                let decision = match &quota {
                    Ok(Some(_)) => Decision::KnownQuota,
                    Ok(None) => Decision::KnownNoQuota,
                    Err(_) => Decision::Refused,
                };
                self.decided(w, decision, &format!("the pod as the node last saw it ({})", from.what()));
            }
            return quota.map(|quota| quota.map(|quota| (quota, source)));
        }
        match pods.container_quota(&w.namespace, &w.pod, &w.pod_uid, &w.container).await {
            Ok(quota) => Ok(quota.map(|quota| (quota, "kubernetes"))),
            Err(error @ kube::KubeError::BadQuantity { .. }) => Err(format!("vramguard: {error}: it cannot be provisioned")),
            Err(error) => {
                self.decide_without_api(w, &error);
                Ok(None)
            }
        }
    }

    /// A container the API could not answer for and the node knows nothing of: created
    /// untouched (a static pod, or any other: fail safe), logged and counted.
    fn decide_without_api(&self, w: &Workload, error: &kube::KubeError) {
        let decision = if is_static_pod(&w.annotations) { Decision::StaticPod } else { Decision::Unknown };
        self.decided(w, decision, &error.to_string());
        // Looked at again when the pod cache learns more (`Provisioner::recheck_undecided`).
        let mut undecided = self.undecided.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if undecided.len() < MAX_UNDECIDED {
            undecided.insert(w.container_id.clone(), w.clone());
        } else {
            warn!(id = %w.container_id, max = MAX_UNDECIDED, "too many containers of unknown quota to look at again: this one is not");
        }
    }

    /// Logs and counts a decision made without the API's answer.
    fn decided(&self, w: &Workload, decision: Decision, why: &str) {
        self.counters.decided(decision);
        let outcome = match decision {
            Decision::KnownQuota => "its quota is the one the node knows",
            Decision::KnownNoQuota => "known to have no quota: created untouched",
            Decision::Refused => "known to have a quota that cannot be provisioned: refused",
            Decision::StaticPod => "a static pod the node knows nothing of: created untouched",
            Decision::Unknown => "a pod the node knows nothing of: created untouched (fail safe)",
        };
        warn!(
            namespace = %w.namespace, pod = %w.pod, container = %w.container, id = %w.container_id,
            decision = decision.label(), why, "decided without the Kubernetes API: {outcome}"
        );
    }

    /// Provisions `workload` if it has a quota: what the runtime must add to it, or why it
    /// must not be created (the error fails the creation). The blocking steps (the tmpfs, the
    /// ledger, the record) run on the blocking pool; the container is recorded as provisioned
    /// at their end unless the creation was abandoned meanwhile ([`Provisioner::abandon`]).
    pub async fn create_container(&self, workload: &Workload) -> Result<Adjustment, String> {
        if claim::is_ledger_id(&workload.container_id) {
            return Err(format!("vramguard: container id {:?} is reserved for DRA claims' ledgers", workload.container_id));
        }
        let record = match self.claim_of(workload).await? {
            Some(claimed) if claimed.admin_access => return Ok(self.admin_access_container(workload, &claimed)),
            Some(claimed) => self.claim_record(workload, &claimed),
            None => {
                let Some((quota, source)) = self.quota(workload).await? else {
                    return Ok(Adjustment::default());
                };
                if quota == 0 {
                    info!(namespace = %workload.namespace, pod = %workload.pod, container = %workload.container, source, "quota 0: not provisioned");
                    return Ok(Adjustment::default());
                }
                let seen = self.given_gpus(workload);
                self.record(workload, quota, source, &seen)
            }
        };
        let (quota, source) = (record.quota, record.source.clone());
        let id = record.container_id.clone();
        {
            // Checked and registered at once: creations in flight count in the check. A
            // claim's containers are the scheduler's to place: in no sum ([`claim`]).
            let mut flights = self.flights();
            if flights.contains_key(&id) {
                return Err(format!("vramguard: container {id} is being provisioned already"));
            }
            let seen: Vec<usize> = record.gpus.iter().map(|&gpu| gpu as usize).collect();
            // The caps count a claim's containers like any other (a claim's shared ledger is
            // counted with each of them: an over-estimate, never an under-estimate).
            let bytes = self.store.ledger_bytes(&record)?;
            if let Err((refusal, error)) = self.check_caps(&record, bytes, &flights) {
                self.counters.refused(refusal);
                return Err(error);
            }
            if self.refuse_overcommit && record.claim.is_none() {
                self.check_overcommit(&record, &seen, &flights).inspect_err(|_| self.counters.refused(Refusal::Overcommit))?;
            }
            let gpus = if record.claim.is_none() { record.gpus.clone() } else { Vec::new() };
            flights.insert(id.clone(), Flight { abandoned: false, quota: record.quota, gpus, pod_id: record.pod_id.clone(), bytes });
        }
        let step = Creation {
            claims: self.claims.clone(),
            store: self.store.clone(),
            containers: self.containers.clone(),
            in_flight: self.in_flight.clone(),
            generation: self.generation.clone(),
            counters: self.counters.clone(),
        };
        let made = match tokio::task::spawn_blocking(move || step.run(record)).await {
            Ok(made) => made?,
            Err(error) => {
                self.flights().remove(&id);
                return Err(format!("vramguard: provisioning container {id} failed: {error}"));
            }
        };
        info!(
            namespace = %workload.namespace, pod = %workload.pod, container = %workload.container,
            id = %workload.container_id, quota, source, ledger = %made.ledger.display(),
            "container provisioned"
        );
        let mut adjustment = self.injection(&made);
        adjustment.env.extend(toolkit_overrides(&made.record, &workload.toolkit_vars));
        Ok(adjustment)
    }

    /// What the agent records of `workload` provisioned with `quota` on the GPUs `seen`.
    fn record(&self, workload: &Workload, quota: u64, source: &str, seen: &[usize]) -> Record {
        Record {
            container_id: workload.container_id.clone(),
            pod_id: workload.pod_id.clone(),
            pod_uid: workload.pod_uid.clone(),
            namespace: workload.namespace.clone(),
            pod: workload.pod.clone(),
            container: workload.container.clone(),
            cgroups_path: workload.cgroups_path.clone(),
            quota,
            devices: self.node_gpus(),
            gpus: seen.iter().map(|&gpu| gpu as u32).collect(),
            source: source.to_string(),
            claim: None,
            quotas: Vec::new(),
        }
    }

    fn flights(&self) -> std::sync::MutexGuard<'_, HashMap<String, Flight>> {
        self.in_flight.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The runtime was answered about container `id`'s creation without it (past the
    /// deadline, or the handler failed): the runtime fails the creation, so whatever it made
    /// goes now. A blocking step still running is told to remove what it makes when it ends.
    pub async fn abandon(&self, id: &str) {
        self.counters.timed_out();
        if let Some(flight) = self.flights().get_mut(id) {
            flight.abandoned = true;
            warn!(id, "creation abandoned while its ledger is being made: removed when that step ends");
            return;
        }
        let made = self.lock().remove(id);
        if made.is_none() {
            info!(id, "creation abandoned before anything was made");
            return;
        }
        self.changed();
        let (store, counters, owned, claims) = (self.store.clone(), self.counters.clone(), id.to_string(), self.claims.clone());
        let removed = tokio::task::spawn_blocking(move || {
            let removed = store.remove_counted(&owned);
            claims.forget(&store, &owned);
            if let Ok(removed) = &removed {
                counters.removed(*removed);
            }
            removed
        })
        .await;
        match removed {
            Ok(Ok(removed)) => warn!(id, ?removed, "creation abandoned: what it made is removed"),
            Ok(Err(error)) => warn!(id, %error, "creation abandoned: cannot remove what it made"),
            Err(error) => warn!(id, %error, "creation abandoned: the removal failed"),
        }
    }

    /// Refuses `record` (its ledger of `bytes`) if the node, or its pod, holds as many
    /// provisioned containers as its cap allows, or if the ledgers would take more than
    /// `--max-ledger-memory`, counting the creations in `flights` (a container provisioned
    /// already, the runtime retrying, is not refused).
    fn check_caps(&self, record: &Record, bytes: u64, flights: &HashMap<String, Flight>) -> Result<(), (Refusal, String)> {
        let containers = self.lock();
        if containers.contains_key(&record.container_id) {
            return Ok(());
        }
        let node = containers.len() + flights.len();
        if node >= self.max_containers {
            return Err((
                Refusal::NodeCap,
                format!(
                    "vramguard: the node has {node} provisioned containers, its cap (--max-provisioned-containers {}): container {} of pod {}/{} with a GPU-memory quota is refused",
                    self.max_containers, record.container, record.namespace, record.pod
                ),
            ));
        }
        let pod = containers.values().filter(|p| p.record.pod_id == record.pod_id).count()
            + flights.values().filter(|f| f.pod_id == record.pod_id).count();
        if pod >= self.max_per_pod {
            return Err((
                Refusal::PodCap,
                format!(
                    "vramguard: pod {}/{} has {pod} provisioned containers, its cap (--max-provisioned-per-pod {}): container {} with a GPU-memory quota is refused",
                    record.namespace, record.pod, self.max_per_pod, record.container
                ),
            ));
        }
        let held = containers.values().map(|p| p.header.total_size).chain(flights.values().map(|f| f.bytes)).fold(0, u64::saturating_add);
        if held.saturating_add(bytes) > self.max_ledger_memory {
            return Err((
                Refusal::LedgerMemory,
                format!(
                    "vramguard: the provisioned ledgers take {held} bytes; container {} of pod {}/{} needs {bytes} more, past --max-ledger-memory {}: refused",
                    record.container, record.namespace, record.pod, self.max_ledger_memory
                ),
            ));
        }
        Ok(())
    }

    /// Refuses `record` if a GPU it was given would have more quota than memory, counting
    /// the provisioned containers and the creations in `flights`.
    fn check_overcommit(&self, record: &Record, seen: &[usize], flights: &HashMap<String, Flight>) -> Result<(), String> {
        let containers = self.lock();
        for &gpu in seen {
            let Some(memory) = self.gpu_memory_of(gpu) else { continue };
            let gpu = gpu as u32;
            let made = containers.values().filter(|p| p.record.claim.is_none()).map(|p| (&p.record.container_id, p.record.quota, &p.record.gpus));
            let flying = flights.iter().map(|(id, f)| (id, f.quota, &f.gpus));
            let others: u64 = made
                .chain(flying)
                .filter(|(id, _, gpus)| **id != record.container_id && gpus.contains(&gpu))
                .map(|(_, quota, _)| quota)
                .sum();
            if others.saturating_add(record.quota) > memory {
                return Err(format!(
                    "vramguard: GPU {gpu} has {memory} bytes and {others} bytes of quotas already: {} more would overcommit it (--refuse-overcommit)",
                    record.quota
                ));
            }
        }
        Ok(())
    }

    fn injection(&self, made: &Provisioned) -> Adjustment {
        let r = &made.record;
        let bind = |source: &Path, destination: &str, read_only| Mount {
            source: source.to_path_buf(),
            destination: destination.to_string(),
            read_only,
        };
        Adjustment {
            mounts: vec![
                bind(&made.ledger, provisioned::LEDGER, false),
                bind(&made.limits, provisioned::LIMITS, true),
                bind(&self.hook, provisioned::HOOK, true),
                bind(&self.preload, provisioned::PRELOAD, true),
            ],
            env: [
                ("VRAMGUARD_LEDGER".into(), provisioned::LEDGER.into()),
                ("CUDA_DEVICE_MEMORY_LIMIT".into(), r.quota.to_string()),
                ("POD_NAME".into(), r.pod.clone()),
                ("POD_NAMESPACE".into(), r.namespace.clone()),
                ("CONTAINER_NAME".into(), r.container.clone()),
            ]
            .into_iter()
            .chain(r.claim.is_some().then(|| (NVIDIA_VISIBLE_DEVICES.into(), self.claim_visible_devices(&r.gpus))))
            .collect(),
        }
    }

    /// What NVIDIA's container runtime is told to give a claim's container
    /// (`NVIDIA_VISIBLE_DEVICES`): the claim's GPUs by UUID, whatever the image or the pod
    /// says (CUDA images say `all`, and under the NVIDIA runtime its hook would add every GPU
    /// of the node beside the claim's, after NRI has seen the spec); `none` (the driver's
    /// libraries and no GPU of the NVIDIA runtime's: the claim's CDI spec gave its GPUs' nodes)
    /// where a UUID is not known, since a GPU index there is NVML's, not the minor number the
    /// claim names.
    fn claim_visible_devices(&self, gpus: &[u32]) -> String {
        let inventory = self.gpus.borrow();
        let uuids: Option<Vec<String>> = gpus.iter().map(|&gpu| inventory.as_ref()?.gpu(gpu)?.uuid.clone()).collect();
        match uuids {
            Some(uuids) if !uuids.is_empty() => uuids.join(","),
            _ => "none".into(),
        }
    }

    /// Forgets containers `gone` says are gone, and removes their files (on the blocking pool).
    async fn remove_where(&self, gone: impl Fn(&Record) -> bool) {
        let removed: Vec<String> = {
            let mut containers = self.lock();
            let ids: Vec<String> = containers.values().filter(|p| gone(&p.record)).map(|p| p.record.container_id.clone()).collect();
            for id in &ids {
                containers.remove(id);
            }
            ids
        };
        if removed.is_empty() {
            return;
        }
        self.changed();
        let (store, claims) = (self.store.clone(), self.claims.clone());
        let removal = tokio::task::spawn_blocking(move || {
            for id in &removed {
                match store.remove(id) {
                    Ok(()) => info!(id = %id, "provisioned container gone: its ledger and record removed"),
                    Err(error) => warn!(id = %id, %error, "cannot remove a gone container's ledger and record"),
                }
                claims.forget(&store, id);
            }
        });
        if let Err(error) = removal.await {
            warn!(%error, "the removal of gone containers' ledgers failed");
        }
    }

    /// The runtime removed container `id`.
    pub async fn remove_container(&self, id: &str) {
        if let Ok(mut late) = self.unprovisioned.lock() {
            late.remove(id);
        }
        self.forget_undecided(|container, _| container == id);
        self.forget_undetermined(|container, _| container == id);
        self.remove_where(|record| record.container_id == id).await;
    }

    /// The runtime removed pod sandbox `pod_id`: its containers' files go.
    pub async fn remove_pod(&self, pod_id: &str) {
        if let Ok(mut late) = self.unprovisioned.lock() {
            late.retain(|_, (pod, _, _)| pod != pod_id);
        }
        self.forget_undecided(|_, w| w.pod_id == pod_id);
        self.forget_undetermined(|_, pod| pod == pod_id);
        self.remove_where(|record| record.pod_id == pod_id).await;
    }

    /// The runtime's full list of containers (NRI Synchronize): records of containers it
    /// does not have are removed.
    pub async fn synchronize(&self, existing: &[String]) {
        self.remove_where(|record| !existing.contains(&record.container_id)).await;
        if let Ok(mut late) = self.unprovisioned.lock() {
            late.retain(|id, _| existing.contains(id));
        }
        self.forget_undetermined(|id, _| !existing.iter().any(|e| e == id));
        self.forget_undecided(|id, _| !existing.iter().any(|e| e == id));
        info!(containers = self.lock().len(), "synchronized with the runtime");
    }

    /// Containers the runtime has, with a quota, that the agent did not provision (created
    /// while it was away): they run without the hook, so their cgroups get their limit (the
    /// quota times the GPUs the runtime gave them), the eBPF probes' backstop; each is logged.
    pub async fn hold_unprovisioned(&self, workloads: &[Workload]) {
        for workload in workloads {
            if self.lock().contains_key(&workload.container_id) {
                continue;
            }
            if let Ok(Ok(Some(claimed))) = self.look_up_claim(workload).await {
                if claimed.admin_access {
                    continue; // no quota to hold it to
                }
                let Some(cgroup) = cgroup_dir(&workload.cgroups_path) else { continue };
                let limit = self.claim_record(workload, &claimed).cgroup_limit();
                warn!(
                    namespace = %workload.namespace, pod = %workload.pod, container = %workload.container, claim = %claimed.uid, cgroup = %cgroup,
                    "a container of a DRA claim was created while the agent was away: it runs without the hook; its cgroup is held to the claim's quota by the eBPF probes"
                );
                if let Ok(mut late) = self.unprovisioned.lock() {
                    late.insert(workload.container_id.clone(), (workload.pod_id.clone(), cgroup, limit));
                }
                continue;
            }
            let quota = match self.quota(workload).await {
                Ok(Some((quota, _))) if quota > 0 => quota,
                Ok(_) => continue,
                Err(error) => {
                    warn!(namespace = %workload.namespace, pod = %workload.pod, container = %workload.container, %error, "cannot tell the quota of a container created while the agent was away");
                    continue;
                }
            };
            let Some(cgroup) = cgroup_dir(&workload.cgroups_path) else { continue };
            let limit = store::cgroup_limit(quota, self.given_gpus(workload).len());
            warn!(
                namespace = %workload.namespace, pod = %workload.pod, container = %workload.container, quota, cgroup = %cgroup,
                "a container with a quota was created while the agent was away: it runs without the hook; its cgroup is held to its limit by the eBPF probes"
            );
            if let Ok(mut late) = self.unprovisioned.lock() {
                late.insert(workload.container_id.clone(), (workload.pod_id.clone(), cgroup, limit));
            }
        }
        self.changed();
    }

    /// The cgroup limits of the provisioned containers: cgroup path (relative to the cgroup2
    /// root) -> bytes (the quota times the GPUs each was given).
    pub fn cgroup_limits(&self) -> BTreeMap<String, u64> {
        let mut limits: BTreeMap<String, u64> = self
            .lock()
            .values()
            .filter_map(|p| Some((cgroup_dir(&p.record.cgroups_path)?, p.record.cgroup_limit())))
            .collect();
        if let Ok(late) = self.unprovisioned.lock() {
            limits.extend(late.values().map(|(_, cgroup, limit)| (cgroup.clone(), *limit)));
        }
        limits
    }
}

impl Workload {
    /// The container `container` of `pod` as the runtime describes it.
    pub fn of(pod: &nri::Pod, container: &nri::Container) -> Workload {
        Workload {
            pod_id: pod.id.clone(),
            pod_uid: pod.uid.clone(),
            namespace: pod.namespace.clone(),
            pod: pod.name.clone(),
            container_id: container.id.clone(),
            container: container.name.clone(),
            cgroups_path: container.cgroups_path.clone(),
            devices: container.devices.clone(),
            cdi_devices: container.cdi_devices.clone(),
            mounts: container.mounts.clone(),
            container_annotations: container.annotations.clone(),
            annotations: pod.annotations.clone(),
            toolkit_vars: container.env.iter().map(|(k, _)| k).filter(|k| TOOLKIT_MEMORY_VARS.contains(&k.as_str())).cloned().collect(),
            visible_devices: container.env.iter().rev().find(|(k, _)| k == "NVIDIA_VISIBLE_DEVICES").map(|(_, v)| v.clone()),
        }
    }
}

impl nri::Handler for Provisioner {
    async fn synchronize(&self, pods: Vec<nri::Pod>, containers: Vec<nri::Container>) {
        let existing: Vec<String> = containers.iter().map(|c| c.id.clone()).collect();
        Provisioner::synchronize(self, &existing).await;
        let workloads: Vec<Workload> = containers
            .iter()
            .filter_map(|container| pods.iter().find(|pod| pod.id == container.pod_id).map(|pod| Workload::of(pod, container)))
            .collect();
        self.hold_unprovisioned(&workloads).await;
    }

    async fn create_container(&self, pod: nri::Pod, container: nri::Container) -> Result<Adjustment, String> {
        let workload = Workload::of(&pod, &container);
        let answer = Provisioner::create_container(self, &workload).await;
        if let Err(error) = &answer {
            warn!(namespace = %pod.namespace, pod = %pod.name, container = %container.name, %error, "container refused");
        }
        answer
    }

    async fn abandon_container(&self, container: nri::Container) {
        Provisioner::abandon(self, &container.id).await;
    }

    async fn start_container(&self, _pod: nri::Pod, container: nri::Container, budget: std::time::Duration) {
        let Some(limiter) = &self.limiter else { return };
        let want = self.lock().get(&container.id).and_then(|p| driver_want(&p.record));
        if let Some(want) = want {
            if limiter.apply(want, budget).await.is_none() {
                warn!(container = %container.id, "driver limits: not set before the container starts (the limits thread did not answer in time); the next pass sets them");
            }
        }
    }

    async fn remove_container(&self, _pod: nri::Pod, container: nri::Container) {
        Provisioner::remove_container(self, &container.id).await;
    }

    async fn remove_pod(&self, pod: nri::Pod) {
        Provisioner::remove_pod(self, &pod.id).await;
    }
}

/// A creation whose blocking step runs.
struct Flight {
    /// The runtime was answered without it meanwhile: the step removes what it made.
    abandoned: bool,
    /// What it will hold, for the over-commit check.
    quota: u64,
    gpus: Vec<u32>,
    /// Its pod sandbox, for the per-pod cap.
    pod_id: String,
    /// Its ledger's size, for `--max-ledger-memory`.
    bytes: u64,
}

/// The creations in flight, by container id.
type Flights = Arc<Mutex<HashMap<String, Flight>>>;

/// A creation's blocking step, with what it needs of the provisioner.
struct Creation {
    claims: claim::Claims,
    store: Store,
    containers: Arc<Mutex<BTreeMap<String, Provisioned>>>,
    in_flight: Flights,
    generation: Arc<tokio::sync::watch::Sender<u64>>,
    counters: Counters,
}

impl Creation {
    /// Makes the container's tmpfs, ledger and record; records it as provisioned, unless the
    /// creation was abandoned meanwhile: then removes what it made. What a failed step made
    /// is removed too.
    fn run(self, record: Record) -> Result<Provisioned, String> {
        let id = record.container_id.clone();
        let container = record.container.clone();
        let made = match record.claim {
            Some(_) => self.claims.create_member(&self.store, record),
            None => self.store.create(record),
        };
        // Test only: a step that outlives the runtime's deadline (crate::fault).
        if let Some(by) = crate::fault::delay("create-container").or_else(|| crate::fault::delay(&format!("create-container.{container}"))) {
            warn!(id, ?by, "fault injected: the creation's blocking step is delayed");
            std::thread::sleep(by);
        }
        let mut flights = self.in_flight.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let abandoned = flights.remove(&id).is_some_and(|flight| flight.abandoned);
        match made {
            Ok(made) if !abandoned => {
                // Recorded while the flight is held: an abandon now finds it recorded.
                self.containers.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).insert(id, made.clone());
                drop(flights);
                self.generation.send_modify(|generation| *generation += 1);
                Ok(made)
            }
            Ok(_) => {
                drop(flights);
                let removed = self.store.remove_counted(&id);
                self.claims.forget(&self.store, &id);
                match removed {
                    Ok(removed) => {
                        self.counters.removed(removed);
                        warn!(id, ?removed, "creation abandoned (the runtime was answered at its deadline): what it made is removed");
                    }
                    Err(error) => warn!(id, %error, "creation abandoned: cannot remove what it made"),
                }
                Err(format!("vramguard: container {id} was abandoned while it was provisioned"))
            }
            Err(error) => {
                drop(flights);
                if !store::valid_container_id(&id) {
                    return Err(error);
                }
                if let Err(problem) = self.store.remove(&id) {
                    warn!(id, %problem, "cannot remove what a failed provisioning made");
                }
                self.claims.forget(&self.store, &id);
                Err(error)
            }
        }
    }
}

/// The variables NVIDIA's container toolkit reads for the driver's limit: its CDI hook
/// (`nvidia-cdi-hook apply-cuda-memory-limits`, a `createRuntime` hook) sets the container's
/// cgroup to soft `_REQUEST(S)` and hard `_LIMIT(S)` MiB when both of a pair are set, and does
/// nothing otherwise (some versions read the plural names first).
pub const TOOLKIT_MEMORY_VARS: [&str; 4] =
    ["NVIDIA_GPU_MEMORY_LIMIT", "NVIDIA_GPU_MEMORY_REQUEST", "NVIDIA_GPU_MEMORY_LIMITS", "NVIDIA_GPU_MEMORY_REQUESTS"];

/// What the agent sets in a provisioned container whose own environment sets `present` of
/// [`TOOLKIT_MEMORY_VARS`]: those, and only those, each limit to the quota in whole MiB (a
/// claim's smallest share: the hook sets one figure on every GPU), each request to 0 (soft 0,
/// as the agent sets it), so a pod cannot pick its own limit through the toolkit. A variable
/// the pod did not set is not added: where the pod did not turn the hook on, the agent does
/// not either (it would fail the container's creation where it cannot work: a driver before
/// r615, a host without a pure cgroup v2). NRI cannot remove a variable (its adaptation drops
/// removal markers). The agent's own Set, at StartContainer (after `runc create` ran the hook,
/// before the process starts), is the one that stands.
fn toolkit_overrides(record: &Record, present: &[String]) -> Vec<(String, String)> {
    let quota = (0..record.gpus.len().max(1)).map(|i| record.quota_on(i)).min().unwrap_or(record.quota);
    let mib = (quota >> 20).to_string();
    present.iter().map(|name| (name.clone(), if name.contains("LIMIT") { mib.clone() } else { "0".into() })).collect()
}

/// What the driver is asked for `record`'s container (`None`: its cgroup cannot be named).
fn driver_want(record: &Record) -> Option<crate::driver_limits::Want> {
    let quotas: Vec<(u32, u64)> = record.gpus.iter().enumerate().map(|(i, &gpu)| (gpu, record.quota_on(i))).collect();
    let others = quotas.iter().map(|&(_, quota)| quota).max().unwrap_or(record.quota);
    Some(crate::driver_limits::Want { container: record.container_id.clone(), cgroup: cgroup_dir(&record.cgroups_path)?, quotas, others, hold: true })
}

/// The cgroup directory, relative to the cgroup2 root, of a runtime's `cgroups_path`: a
/// path (cgroupfs driver, `/k8s.io/<id>`) as it is; systemd's `slice:prefix:name` as
/// systemd lays it out (`a-b.slice` under `a.slice`, the unit `prefix-name.scope` in it).
pub fn cgroup_dir(cgroups_path: &str) -> Option<String> {
    if cgroups_path.starts_with('/') {
        return Some(cgroups_path.trim_end_matches('/').to_string()).filter(|p| !p.is_empty());
    }
    let mut parts = cgroups_path.split(':');
    let (Some(slice), Some(prefix), Some(name), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return None;
    };
    let mut path = String::new();
    if !slice.is_empty() && slice != "-.slice" {
        let stem = slice.strip_suffix(".slice")?;
        let mut acc = String::new();
        for piece in stem.split('-') {
            if !acc.is_empty() {
                acc.push('-');
            }
            acc.push_str(piece);
            path.push('/');
            path.push_str(&acc);
            path.push_str(".slice");
        }
    }
    let unit = if prefix.is_empty() { format!("{name}.scope") } else { format!("{prefix}-{name}.scope") };
    path.push('/');
    path.push_str(&unit);
    Some(path)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    #[test]
    fn cgroup_dirs() {
        assert_eq!(cgroup_dir("/k8s.io/abc").as_deref(), Some("/k8s.io/abc"));
        assert_eq!(
            cgroup_dir("kubepods-besteffort-pod12.slice:cri-containerd:abc").as_deref(),
            Some("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod12.slice/cri-containerd-abc.scope")
        );
        assert_eq!(cgroup_dir("system.slice:docker:abc").as_deref(), Some("/system.slice/docker-abc.scope"));
        assert_eq!(cgroup_dir(""), None);
        assert_eq!(cgroup_dir("a:b"), None);
    }

    /// The flags of a provisioner under `root` with 2 GPUs of 8 GiB.
    fn args(root: &Path, refuse_overcommit: bool) -> ProvisionArgs {
        let kube = clap::Command::new("x");
        let kube = <kube::KubeArgs as clap::Args>::augment_args(kube).get_matches_from(["x"]);
        ProvisionArgs {
            nri: true,
            nri_socket: root.join("nri.sock"),
            state_dir: root.join("state"),
            hook_library: root.join("hook.so"),
            quota_file: Some(root.join("quotas")),
            quota_from_annotation: false,
            gpu_memory: vec![8 << 30, 8 << 30],
            refuse_overcommit,
            ledger_mount_namespace: None,
            max_provisioned_containers: 6,
            max_provisioned_per_pod: 3,
            max_ledger_memory: 64 << 20,
            max_processes_per_container: 8,
            kube: <kube::KubeArgs as clap::FromArgMatches>::from_arg_matches(&kube).expect("kube args"),
        }
    }

    /// A provisioner of [`args`] over `root`'s quota file, on a node without NVML: its
    /// inventory is `--gpu-memory`'s (two GPUs of 8 GiB), as the agent's inventory task makes it.
    pub(super) fn provisioner_in(root: &Path, refuse_overcommit: bool) -> Provisioner {
        let file = QuotaFile::open(&root.join("quotas")).expect("quota file");
        let sources = Sources { kube: None, file: Some(file), annotation: false };
        let args = args(root, refuse_overcommit);
        let gpus = crate::inventory::fixed(Some(crate::inventory::from_flag(&args.gpu_memory, 0)));
        Provisioner::with_mounts(&args, &root.join("ledgers"), sources, None).expect("provisioner").with_inventory(gpus, Vec::new())
    }

    /// A provisioner under a fresh directory, with `rules` as its quota file.
    pub(super) fn provisioner(tag: &str, rules: &str, refuse_overcommit: bool) -> (PathBuf, Provisioner) {
        let root = std::env::temp_dir().join(format!("vramguard-provision-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("ledgers")).expect("mkdir");
        std::fs::write(root.join("hook.so"), b"").expect("hook");
        std::fs::write(root.join("quotas"), rules).expect("quotas");
        let provisioner = provisioner_in(&root, refuse_overcommit);
        (root, provisioner)
    }

    /// Container `id` of `pod` as the runtime hands it over, given the device nodes of `gpus`
    /// (`"0,1"`: `/dev/nvidia0` and `/dev/nvidia1`; `""`: none) beside `/dev/nvidiactl`,
    /// with an environment that names every GPU (which must not count).
    fn workload(namespace: &str, pod: &str, id: &str, gpus: &str) -> Workload {
        let mut devices = vec!["/dev/null".to_string(), "/dev/nvidiactl".to_string()];
        devices.extend(gpus.split(',').filter(|g| !g.is_empty()).map(|g| format!("/dev/nvidia{g}")));
        let pod = nri::Pod {
            id: format!("sandbox-{pod}"),
            uid: format!("uid-{pod}"),
            namespace: namespace.into(),
            name: pod.into(),
            ..nri::Pod::default()
        };
        let container = nri::Container {
            id: id.into(),
            pod_id: pod.id.clone(),
            name: "main".into(),
            env: vec![("NVIDIA_VISIBLE_DEVICES".into(), "0,1".into())],
            cgroups_path: format!("/k8s.io/{id}"),
            devices,
            ..nri::Container::default()
        };
        Workload::of(&pod, &container)
    }

    pub(super) fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(future)
    }

    #[test]
    fn before_nvml_answers_and_without_gpu_memory_the_gpus_are_counted_by_the_host_s_device_files() {
        let (root, p) = provisioner("devfiles", "namespace=team-a 1g\n", false);
        std::fs::create_dir_all(root.join("dev")).expect("dev");
        for name in ["nvidia0", "nvidia1", "nvidia3", "nvidiactl"] {
            std::fs::write(root.join("dev").join(name), b"").expect("a device file stand-in");
        }
        let p = Provisioner { gpu_memory: Vec::new(), ..p }.with_inventory(crate::inventory::fixed(None), vec![format!("{}/dev/nvidia{{minor}}", root.display())]);
        block_on(p.create_container(&workload("team-a", "trainer", "c1", "3"))).expect("provisioned");
        let made = &p.provisioned()[0];
        assert_eq!((made.record.gpus.as_slice(), made.record.devices), (&[3][..], 4), "GPU 3 of the host's 4 minors, as given");
        assert_eq!(p.gpus_undetermined(), 0);
        // Without the files either: one GPU assumed, and GPU 3 is past it (held to every GPU).
        let none = Provisioner { gpu_memory: Vec::new(), ..provisioner_in(&root, false) }.with_inventory(crate::inventory::fixed(None), Vec::new());
        assert_eq!(none.node_gpus(), 1);
        // A --gpu-memory of another count (an old DaemonSet's one 80Gi) does not hide the files.
        let flagged = provisioner_in(&root, false).with_inventory(crate::inventory::fixed(None), vec![format!("{}/dev/nvidia{{minor}}", root.display())]);
        assert_eq!((flagged.gpu_memory.len(), flagged.node_gpus()), (2, 4));
        assert_eq!(flagged.gpu_memory_of(0), None, "the flag's sizes are not NVML's: unknown until it answers");
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn a_container_with_a_quota_is_provisioned_and_one_without_is_not() {
        let (root, p) = provisioner("create", "namespace=team-a 1g\nnamespace=team-z 0\n", false);
        let adjustment = block_on(p.create_container(&workload("team-a", "trainer", "c1", "1"))).expect("provisioned");
        let at: Vec<(&str, bool)> = adjustment.mounts.iter().map(|m| (m.destination.as_str(), m.read_only)).collect();
        assert_eq!(at, [(provisioned::LEDGER, false), (provisioned::LIMITS, true), (provisioned::HOOK, true), (provisioned::PRELOAD, true)]);
        assert_eq!(adjustment.mounts[0].source, root.join("ledgers/c1/ledger"));
        assert!(adjustment.env.contains(&("CUDA_DEVICE_MEMORY_LIMIT".into(), (1u64 << 30).to_string())));
        assert!(adjustment.env.contains(&("POD_NAMESPACE".into(), "team-a".into())));
        assert_eq!(std::fs::read_to_string(root.join("state/ld.so.preload")).expect("preload"), format!("{}\n", provisioned::HOOK));
        // The ledger and the cgroup: the quota on the one GPU the runtime gave (not the two
        // of its environment).
        let made = &p.provisioned()[0];
        assert_eq!((made.header.device_count, made.record.gpus.as_slice()), (1, &[1][..]));
        assert_eq!(p.cgroup_limits(), BTreeMap::from([("/k8s.io/c1".to_string(), 1 << 30)]));
        // No rule, or a rule of 0: untouched.
        assert_eq!(block_on(p.create_container(&workload("team-b", "web", "c2", "0"))), Ok(Adjustment::default()));
        assert_eq!(block_on(p.create_container(&workload("team-z", "web", "c3", "0"))), Ok(Adjustment::default()));
        assert_eq!(p.len(), 1);
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn overcommit_is_refused_per_gpu_when_asked() {
        let (root, p) = provisioner("overcommit", "namespace=team-a 5g\n", true);
        block_on(p.create_container(&workload("team-a", "a", "c1", "0"))).expect("5 of GPU 0's 8 GiB");
        // A creation in flight on GPU 1 counts as if it were made.
        p.flights().insert("f1".into(), Flight { abandoned: false, quota: 5 << 30, gpus: vec![1], pod_id: "sandbox-f".into(), bytes: 0 });
        let error = block_on(p.create_container(&workload("team-a", "b", "c2", "1"))).expect_err("GPU 1 holds f1's 5 GiB");
        assert!(error.contains("GPU 1 has 8589934592 bytes and 5368709120 bytes"), "{error}");
        p.flights().remove("f1");
        block_on(p.create_container(&workload("team-a", "b", "c2", "1"))).expect("GPU 1 is free");
        let error = block_on(p.create_container(&workload("team-a", "c", "c3", "0"))).expect_err("10 GiB on GPU 0");
        assert!(error.contains("GPU 0 has 8589934592 bytes") && error.contains("--refuse-overcommit"), "{error}");
        assert!(!root.join("ledgers/c3").exists(), "nothing made for a refused container");
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn the_runtime_s_devices_decide_and_the_environment_does_not() {
        let (root, p) = provisioner("runtime-gpus", "namespace=team-a 5g\n", true);
        // Its environment names GPUs 0 and 1; the runtime gave GPU 1: the ledger holds one
        // device at the quota, the cgroup one quota, the over-commit check counts GPU 1 alone.
        block_on(p.create_container(&workload("team-a", "a", "c1", "1"))).expect("5 of GPU 1's 8 GiB");
        let made = &p.provisioned()[0];
        assert_eq!((made.record.gpus.as_slice(), made.header.device_count, made.header.devices[0].limit), (&[1][..], 1, 5 << 30));
        assert_eq!(p.cgroup_limits(), BTreeMap::from([("/k8s.io/c1".to_string(), 5 << 30)]));
        block_on(p.create_container(&workload("team-a", "b", "c2", "0"))).expect("GPU 0 is free whatever c1's env says");
        let error = block_on(p.create_container(&workload("team-a", "c", "c3", "1"))).expect_err("10 GiB on GPU 1");
        assert!(error.contains("GPU 1 has"), "{error}");
        // CDI names, when the spec has no GPU device nodes yet.
        let mut cdi = workload("team-a", "d", "c4", "");
        cdi.cdi_devices = vec!["nvidia.com/gpu=1".into()];
        assert!(block_on(p.create_container(&cdi)).is_err(), "GPU 1 is full: the CDI name counts");
        assert_eq!(p.gpus_undetermined(), 0);
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    /// Runs `f` with this thread's logs in the returned text.
    fn logged<T>(f: impl FnOnce() -> T) -> (T, String) {
        #[derive(Clone, Default)]
        struct Sink(std::sync::Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Sink {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let sink = Sink::default();
        let writer = sink.clone();
        let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
        let out = tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8_lossy(&sink.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
        (out, text)
    }

    #[test]
    fn undetermined_gpus_hold_every_gpu_logged_and_counted_once_per_container() {
        let (root, p) = provisioner("undetermined", "namespace=team-a 1g\n", false);
        let ((), logs) = logged(|| {
            // No GPU device node, no CDI device (its env names GPUs 0 and 1: no matter).
            block_on(p.create_container(&workload("team-a", "a", "c1", ""))).expect("provisioned");
            // The runtime tries the same container again; a Synchronize lists it.
            block_on(p.create_container(&workload("team-a", "a", "c1", ""))).expect("again");
            block_on(p.hold_unprovisioned(&[workload("team-a", "a", "c1", "")]));
        });
        assert_eq!(logs.matches("does not say which GPUs").count(), 1, "{logs}");
        assert!(logs.contains("c1") && logs.contains("no GPU device node"), "{logs}");
        assert_eq!(p.gpus_undetermined(), 1);
        let made = &p.provisioned()[0];
        assert_eq!((made.record.gpus.as_slice(), made.header.device_count), (&[0, 1][..], 2));
        assert_eq!(p.cgroup_limits(), BTreeMap::from([("/k8s.io/c1".to_string(), 2 << 30)]));
        // A GPU index past the node's: undetermined too; a container created while the agent
        // was away the same.
        let mut past = workload("team-a", "b", "c2", "");
        past.cdi_devices = vec!["nvidia.com/gpu=5".into()];
        let ((), logs) = logged(|| {
            block_on(p.create_container(&past)).expect("provisioned");
            block_on(p.hold_unprovisioned(&[workload("team-a", "c", "c3", "")]));
        });
        assert!(logs.contains("names GPU 5, the node has 2"), "{logs}");
        assert_eq!(p.gpus_undetermined(), 3);
        assert_eq!(p.cgroup_limits().get("/k8s.io/c3"), Some(&(2 << 30)));
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn removal_and_synchronize_clean_up_and_a_restart_restores() {
        let (root, p) = provisioner("cleanup", "namespace=team-a 1g\n", false);
        for (pod, id) in [("a", "c1"), ("a", "c2"), ("b", "c3"), ("c", "c4")] {
            block_on(p.create_container(&workload("team-a", pod, id, "0"))).expect("provisioned");
        }
        block_on(p.remove_container("c2"));
        block_on(p.remove_pod("sandbox-b"));
        assert_eq!(p.provisioned().iter().map(|x| x.record.container_id.as_str()).collect::<Vec<_>>(), ["c1", "c4"]);
        assert!(!root.join("ledgers/c2").exists() && !root.join("ledgers/c3").exists());
        drop(p);
        // Restarted: both records back; the runtime then says only c4 exists.
        let again = provisioner_in(&root, false);
        assert_eq!(again.len(), 2);
        block_on(again.synchronize(&["c4".to_string(), "unrelated".to_string()]));
        assert_eq!(again.provisioned().iter().map(|x| x.record.container_id.as_str()).collect::<Vec<_>>(), ["c4"]);
        assert!(!root.join("ledgers/c1").exists() && !root.join("state/containers/c1").exists());
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    /// Abandoned after it was recorded (the answer missed the deadline by a hair), and
    /// abandoned while its blocking step runs: nothing of either is left, and both counted.
    #[test]
    fn an_abandoned_creation_leaves_nothing_behind() {
        let (root, p) = provisioner("abandon", "namespace=team-a 1g\n", false);
        block_on(p.create_container(&workload("team-a", "a", "c1", "0"))).expect("provisioned");
        assert!(root.join("ledgers/c1/ledger").exists() && root.join("state/containers/c1/record.json").exists());
        let mut changes = p.changes();
        changes.mark_unchanged();
        block_on(p.abandon("c1"));
        assert!(p.is_empty() && changes.has_changed().expect("sender"), "forgotten, and published");
        assert!(!root.join("ledgers/c1").exists() && !root.join("state/containers/c1").exists());
        assert_eq!((p.counters().timed_out_total(), p.counters().removed_totals()), (1, [1, 0, 1]), "no mount without a Mounter");

        // The step runs while the runtime is answered: it finds itself abandoned when it ends.
        p.flights().insert("c2".into(), Flight { abandoned: false, quota: 1 << 30, gpus: vec![0], pod_id: "sandbox-b".into(), bytes: 0 });
        block_on(p.abandon("c2"));
        let step = Creation {
            claims: p.claims.clone(),
            store: p.store.clone(),
            containers: p.containers.clone(),
            in_flight: p.in_flight.clone(),
            generation: p.generation.clone(),
            counters: p.counters.clone(),
        };
        let record = p.record(&workload("team-a", "b", "c2", "0"), 1 << 30, "quota file", &[0]);
        let error = step.run(record).expect_err("abandoned");
        assert!(error.contains("abandoned"), "{error}");
        assert!(p.is_empty() && p.flights().is_empty());
        assert!(!root.join("ledgers/c2").exists() && !root.join("state/containers/c2").exists());
        assert_eq!((p.counters().timed_out_total(), p.counters().removed_totals()), (2, [2, 0, 2]));

        // Nothing made yet (cut short in the lookup): counted, nothing to remove.
        block_on(p.abandon("c3"));
        assert_eq!((p.counters().timed_out_total(), p.counters().removed_totals()), (3, [2, 0, 2]));
        // The same container again, not abandoned: provisioned.
        block_on(p.create_container(&workload("team-a", "b", "c2", "0"))).expect("provisioned");
        assert_eq!(p.len(), 1);
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn containers_created_while_the_agent_was_away_get_their_cgroup_limit() {
        let (root, p) = provisioner("late", "namespace=team-a 1g\n", false);
        block_on(p.create_container(&workload("team-a", "a", "c1", "0"))).expect("provisioned");
        let late = [workload("team-a", "b", "c2", "0,1"), workload("team-b", "c", "c3", "0")];
        block_on(p.hold_unprovisioned(&late));
        // c1 is provisioned (its own limit), c2 held to 2 GPUs' quota, c3 has no quota.
        let want = BTreeMap::from([("/k8s.io/c1".to_string(), 1 << 30), ("/k8s.io/c2".to_string(), 2 << 30)]);
        assert_eq!(p.cgroup_limits(), want);
        assert_eq!(p.len(), 1, "c2 is not provisioned (no ledger)");
        block_on(p.remove_pod("sandbox-b"));
        assert_eq!(p.cgroup_limits().len(), 1);
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn static_pods_are_those_the_kubelet_did_not_get_from_the_api() {
        let source = |value: &str| BTreeMap::from([(CONFIG_SOURCE.to_string(), value.to_string())]);
        assert!(is_static_pod(&source("file")) && is_static_pod(&source("http")));
        assert!(!is_static_pod(&source("api")));
        assert!(!is_static_pod(&BTreeMap::new()), "not the kubelet's: not known to be static");
    }

    /// Past the per-pod cap (3 here) and the node's (6), a container with a quota is refused
    /// with an error naming the cap, counted by reason, and nothing is made for it; the runtime
    /// retrying a provisioned container is not refused; a creation in flight takes a place; a
    /// removed container frees its place. 1-byte quotas, as a tenant may ask.
    #[test]
    fn caps_on_provisioned_containers_refuse_count_and_free_their_places() {
        let (root, p) = provisioner("caps", "namespace=team-a 1\n", false);
        for n in 0..5 {
            let answer = block_on(p.create_container(&workload("team-a", "big", &format!("b{n}"), "0")));
            match n {
                0..3 => assert!(answer.is_ok(), "b{n}: {answer:?}"),
                _ => {
                    let error = answer.expect_err("past the pod's cap");
                    assert!(error.contains("--max-provisioned-per-pod 3") && error.contains("pod team-a/big has 3"), "{error}");
                    assert!(!root.join(format!("ledgers/b{n}")).exists(), "nothing made for a refused container");
                }
            }
        }
        assert_eq!((p.counters().refused_total(Refusal::PodCap), p.counters().refused_total(Refusal::NodeCap)), (2, 0));
        assert!(block_on(p.create_container(&workload("team-a", "big", "b0", "0"))).is_ok(), "a retry of a provisioned one");
        block_on(p.create_container(&workload("team-a", "x", "x0", "0"))).expect("4 of 6");
        block_on(p.create_container(&workload("team-a", "y", "y0", "1"))).expect("5 of 6");
        // A creation in flight takes the sixth place.
        p.flights().insert("f1".into(), Flight { abandoned: false, quota: 1, gpus: vec![0], pod_id: "sandbox-f".into(), bytes: 0 });
        let error = block_on(p.create_container(&workload("team-a", "z", "z0", "0"))).expect_err("past the node's cap");
        assert!(error.contains("--max-provisioned-containers 6") && error.contains("the node has 6"), "{error}");
        assert_eq!(p.counters().refused_total(Refusal::NodeCap), 1);
        p.flights().remove("f1");
        block_on(p.create_container(&workload("team-a", "z", "z0", "0"))).expect("6 of 6");
        assert!(block_on(p.create_container(&workload("team-a", "z", "z1", "0"))).is_err());
        assert_eq!(p.counters().refused_total(Refusal::NodeCap), 2);
        // A removed container frees its place, in its pod and on the node.
        block_on(p.remove_container("b1"));
        block_on(p.create_container(&workload("team-a", "big", "b3", "0"))).expect("b1's place");
        assert_eq!(p.len(), 6);
        // Each ledger of a 1-byte quota: a device with no space, 8 slots (the flag).
        let made = p.provisioned();
        assert!(made.iter().all(|m| m.header.devices[0].chunks == 0 && m.header.slot_count == 8), "{made:?}");
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    /// Past `--max-ledger-memory` (10 MiB here; an 8 GiB quota's ledger is about 4 MiB), a
    /// container is refused with the reason, counted; a removal gives the bytes back.
    #[test]
    fn the_ledgers_memory_is_capped_too() {
        let (root, _) = provisioner("budget", "namespace=team-a 8g\n", false);
        let file = QuotaFile::open(&root.join("quotas")).expect("quota file");
        let sources = Sources { kube: None, file: Some(file), annotation: false };
        let args = ProvisionArgs { max_ledger_memory: 10 << 20, ..args(&root, false) };
        let p = Provisioner::with_mounts(&args, &root.join("ledgers"), sources, None).expect("provisioner");
        block_on(p.create_container(&workload("team-a", "a", "c1", "0"))).expect("c1");
        block_on(p.create_container(&workload("team-a", "b", "c2", "0"))).expect("c2");
        let size = p.provisioned()[0].header.total_size;
        assert!(size > 3 << 20 && 3 * size > 10 << 20, "{size}");
        let error = block_on(p.create_container(&workload("team-a", "c", "c3", "0"))).expect_err("past the budget");
        assert!(error.contains("--max-ledger-memory 10485760") && error.contains(&format!("take {}", 2 * size)), "{error}");
        assert_eq!(p.counters().refused_total(Refusal::LedgerMemory), 1);
        assert!(!root.join("ledgers/c3").exists());
        block_on(p.remove_container("c1"));
        block_on(p.create_container(&workload("team-a", "c", "c3", "0"))).expect("c1's bytes");
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn quotas_are_quantities_or_sizes() {
        assert_eq!(parse_quota("1Gi"), Some(1 << 30));
        assert_eq!(parse_quota("1g"), Some(1 << 30));
        assert_eq!(parse_quota("1G"), Some(1_000_000_000));
        assert_eq!(parse_quota("1024"), Some(1024));
        assert_eq!(parse_quota("lots"), None);
    }
}
