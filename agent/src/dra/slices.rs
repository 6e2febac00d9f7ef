//! The node's ResourceSlice pool (`--dra`): one pool named after the node, one device per GPU
//! of the [`inventory`](crate::inventory) (`gpu-<N>`, attributes `uuid`, `index`, `product`,
//! `memory`, `source`; `allowMultipleAllocations`; a `memory` capacity with the request
//! [`policy`](super::policy)), at most [`DEVICES_PER_SLICE`] devices a slice, the slices named
//! `<node>-gpu.vramguard.io-<k>`.
//!
//! The publisher task owns what it published. At start, and every `--dra-slices-every-s`, it
//! lists this driver's slices on its node (field selectors `spec.nodeName`, `spec.driver`):
//! when they are not the pool it published last (none yet, the kubelet deleted them at its
//! start or after the plugin deregistered, someone changed them) it writes the pool again
//! with a generation higher than any it found or wrote (updating the slices that exist,
//! creating the others, deleting the stale ones). A change of the inventory (a GPU NVML no
//! longer lists) writes it at once, with the generation bumped. A request that fails or finds
//! no answer within [`REQUEST_TIMEOUT`] is retried with a doubling backoff up to the period,
//! logged and counted (`vramguard_dra_slice_syncs_total{result="error"}`).
//!
//! The slices are owned by the node's Node object (an ownerReference with its UID, read from
//! the API server before the first write), so the API server's garbage collector removes them
//! with a deleted node.
//!
//! # Where `DRAConsumableCapacity` is off
//!
//! On Kubernetes 1.34 and 1.35 the gate is off by default, and the API server then drops what
//! it guards from every write: a device's `allowMultipleAllocations`, a capacity's
//! `requestPolicy` (and, in claims, the requests' capacity and the results'
//! `consumedCapacity` and `shareID`). At every check the publisher asks the API server with a
//! dry-run create ([`Publisher::probe`]: admitted and answered as a create, nothing stored)
//! of a slice in the shared form, and reads the answer: a device sent shared that comes back
//! without `allowMultipleAllocations` means the gate is off. It then publishes each GPU as a
//! whole device ([`Sharing::Whole`]: its `memory` capacity and no policy, which the scheduler
//! gives to one claim at a time), written once in that form, and follows the gate when it is
//! turned off or on (a dry-run create has no old object whose use of the fields would keep
//! them). Prepare gives a result without `consumedCapacity` the GPU's whole capacity. The
//! answer to each real write is read the same way, in case the probe could not tell.
//! `vramguard audit` and `vramguard_dra_sharing` say which form is published.
//!
//! A GPU a prepared claim holds whole (a result without a `shareID`, allocated while the gate
//! was off) is published whole in either form until that claim is unprepared: once a device
//! is published shared the scheduler weighs only the shares on it, not a dedicated
//! allocation, and would place shares beside the claim that has it all.
//!
//! Before its first sync it withdraws the node-wide extended resource: if the node's
//! `status.capacity` holds `vramguard.io/gpu-memory` (an agent without `--dra` put it there),
//! it is removed (a JSON patch of the status subresource, as the capacity task adds it), so
//! that the scheduler stops placing quotas on the node's sum once its GPUs are DRA devices.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::Duration,
};

use k8s_openapi::{
    api::core::v1::Node,
    api::resource::v1::{Device, DeviceAttribute, DeviceCapacity, ResourcePool, ResourceSlice, ResourceSliceSpec},
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{ObjectMeta, OwnerReference},
    },
};
use kube::{
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
    Api, Client,
};
use prometheus::{core::Collector, IntCounterVec, IntGauge, IntGaugeVec, Opts};
use tokio::{sync::watch, time::Instant};
use tracing::{info, warn};

use super::{device_name, policy::Settings, DRIVER, MEMORY};
use crate::{
    inventory::{self, Inventory},
    provision::kube::{KubeError, RESOURCE},
    snapshot::DraStatus,
    task::Heartbeat,
};

/// At most this many devices in one ResourceSlice (the API's limit).
pub const DEVICES_PER_SLICE: usize = 128;

/// How long one request to the API server may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the task may go without coming round its loop before `/healthz` fails: it comes
/// round at every driver read (each second) and every check, whose requests time out.
pub const ALLOWED: Duration = Duration::from_secs(300);

/// The first wait after a failed sync (doubling up to the period).
const FIRST_RETRY: Duration = Duration::from_millis(500);

/// The driver's flags (with `--dra`).
#[derive(clap::Args, Clone, Debug)]
pub struct SliceArgs {
    /// The smallest `memory` share a claim gets on a GPU (bytes, or k/m/g/t): smaller requests
    /// are rounded up to it.
    #[arg(long, default_value = "1g", value_name = "SIZE", value_parser = parse_size, requires = "dra")]
    pub dra_memory_min: u64,
    /// The grid of `memory` shares above the minimum: a request is rounded up to
    /// min + a whole number of steps.
    #[arg(long, default_value = "256m", value_name = "SIZE", value_parser = parse_size, requires = "dra")]
    pub dra_memory_step: u64,
    /// What a claim that names no `memory` gets: a size, or `all` (the whole GPU).
    #[arg(long, default_value = "all", value_name = "SIZE|all", value_parser = parse_default, requires = "dra")]
    pub dra_memory_default: MemoryDefault,
    /// Memory of each GPU no claim can have: what the driver keeps for itself (the agent
    /// measures it: `vramguard_device_driver_reserve_bytes`). A GPU's `memory` capacity is
    /// its memory less this.
    #[arg(long, default_value = "1g", value_name = "SIZE", value_parser = parse_size, requires = "dra")]
    pub dra_memory_reserve: u64,
    /// How often the published slices are checked (and written again if they are gone or
    /// changed), in seconds.
    #[arg(long, default_value_t = 30, value_name = "S", requires = "dra")]
    pub dra_slices_every_s: u64,
}

/// `--dra-memory-default`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryDefault {
    All,
    Bytes(u64),
}

fn parse_size(text: &str) -> Result<u64, String> {
    cuda_abi::parse_size(text).ok_or_else(|| format!("{text:?} is not a size (bytes, or a number with k, m, g or t)"))
}

fn parse_default(text: &str) -> Result<MemoryDefault, String> {
    if text == "all" {
        return Ok(MemoryDefault::All);
    }
    parse_size(text).map(MemoryDefault::Bytes)
}

impl SliceArgs {
    /// The request policy's settings, checked.
    pub fn settings(&self) -> Result<Settings, String> {
        let default = match self.dra_memory_default {
            MemoryDefault::All => None,
            MemoryDefault::Bytes(bytes) => Some(bytes),
        };
        let settings = Settings { min: self.dra_memory_min, step: self.dra_memory_step, default };
        settings.check()?;
        Ok(settings)
    }
}

/// How the pool's GPUs are published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// Devices that allow multiple allocations, a `memory` capacity with a request policy:
    /// claims share a GPU, each its `consumedCapacity`.
    Shared,
    /// Each GPU a device of one claim at a time (the API server drops the shared form:
    /// `DRAConsumableCapacity` off).
    Whole,
}

impl Sharing {
    pub fn name(self) -> &'static str {
        match self {
            Sharing::Shared => "shared",
            Sharing::Whole => "whole",
        }
    }
}

/// The names of the pool's slices: `<node>-gpu.vramguard.io-<k>`.
pub fn slice_name(node: &str, k: usize) -> String {
    format!("{node}-{DRIVER}-{k}")
}

/// The pool's slices for `inventory` at `generation` (at least one, empty when no GPU can
/// take a claim), and the GPUs left out (less capacity than the policy's minimum), shared.
pub fn build(node: &str, inventory: &Inventory, settings: &Settings, generation: i64) -> (Vec<ResourceSlice>, Vec<u32>) {
    build_as(node, None, inventory, settings, generation, Sharing::Shared, &BTreeSet::new())
}

/// [`build`], owned by the Node `owner` (its UID) where given, in the `sharing` form, the
/// GPUs in `whole` (held whole by a prepared claim) whole whatever the form.
pub fn build_as(
    node: &str,
    owner: Option<&str>,
    inventory: &Inventory,
    settings: &Settings,
    generation: i64,
    sharing: Sharing,
    whole: &BTreeSet<u32>,
) -> (Vec<ResourceSlice>, Vec<u32>) {
    let mut left_out = Vec::new();
    let devices: Vec<Device> = inventory
        .gpus
        .iter()
        .filter_map(|gpu| {
            let Some(policy) = settings.policy_for(gpu.capacity) else {
                left_out.push(gpu.index);
                return None;
            };
            let mut attributes = BTreeMap::new();
            let string = |s: &str| DeviceAttribute { string: Some(s.to_owned()), ..DeviceAttribute::default() };
            let int = |i: i64| DeviceAttribute { int: Some(i), ..DeviceAttribute::default() };
            attributes.insert("index".to_owned(), int(i64::from(gpu.index)));
            attributes.insert("product".to_owned(), string(&gpu.product));
            attributes.insert("memory".to_owned(), int(i64::try_from(gpu.memory).unwrap_or(i64::MAX)));
            attributes.insert("source".to_owned(), string(inventory.source.name()));
            if let Some(uuid) = &gpu.uuid {
                attributes.insert("uuid".to_owned(), string(uuid));
            }
            let shared = sharing == Sharing::Shared && !whole.contains(&gpu.index);
            let capacity = DeviceCapacity { value: Quantity(gpu.capacity.to_string()), request_policy: shared.then(|| policy.to_api()) };
            Some(Device {
                name: device_name(gpu.index),
                attributes: Some(attributes),
                allow_multiple_allocations: shared.then_some(true),
                capacity: Some(BTreeMap::from([(MEMORY.to_owned(), capacity)])),
                ..Device::default()
            })
        })
        .collect();
    let chunks: Vec<Vec<Device>> = if devices.is_empty() { vec![Vec::new()] } else { devices.chunks(DEVICES_PER_SLICE).map(<[Device]>::to_vec).collect() };
    let count = chunks.len() as i64;
    let slices = chunks
        .into_iter()
        .enumerate()
        .map(|(k, devices)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(slice_name(node, k)),
                owner_references: owner.map(|uid| {
                    vec![OwnerReference { api_version: "v1".into(), kind: "Node".into(), name: node.to_owned(), uid: uid.to_owned(), controller: Some(true), ..OwnerReference::default() }]
                }),
                ..ObjectMeta::default()
            },
            spec: ResourceSliceSpec {
                driver: DRIVER.to_owned(),
                node_name: Some(node.to_owned()),
                pool: ResourcePool { name: node.to_owned(), generation, resource_slice_count: count },
                devices: Some(devices),
                ..ResourceSliceSpec::default()
            },
        })
        .collect();
    (slices, left_out)
}

/// The publisher's counters, for the agent's page.
#[derive(Clone)]
pub struct SliceMetrics {
    syncs: IntCounterVec,
    generation: IntGauge,
    devices: IntGauge,
    sharing: IntGaugeVec,
}

impl SliceMetrics {
    pub fn new() -> prometheus::Result<SliceMetrics> {
        Ok(SliceMetrics {
            syncs: IntCounterVec::new(
                Opts::new("vramguard_dra_slice_syncs_total", "Checks of the node's ResourceSlice pool by result: published (written), unchanged, error"),
                &["result"],
            )?,
            generation: IntGauge::new("vramguard_dra_slice_generation", "The generation of the ResourceSlice pool last published")?,
            devices: IntGauge::new("vramguard_dra_devices", "GPUs in the ResourceSlice pool last published")?,
            sharing: IntGaugeVec::new(
                Opts::new(
                    "vramguard_dra_sharing",
                    "1 for the form the node's GPUs are published in: shared (consumable capacity), or whole (the API server drops the shared form: DRAConsumableCapacity is off)",
                ),
                &["form"],
            )?,
        })
    }

    pub fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![Box::new(self.syncs.clone()), Box::new(self.generation.clone()), Box::new(self.devices.clone()), Box::new(self.sharing.clone())]
    }
}

/// What was published last.
#[derive(Clone, Debug, PartialEq)]
struct Published {
    generation: i64,
    inventory: Inventory,
    sharing: Sharing,
    /// The GPUs published whole because a prepared claim holds them whole.
    whole: BTreeSet<u32>,
}

/// What the publisher has learned of its node and the API server.
struct Learned {
    /// The Node's UID (the slices' owner), once read.
    owner: Option<String>,
    /// Whether the node-wide extended resource was withdrawn.
    withdrawn: bool,
    sharing: Sharing,
    /// The GPUs prepared claims hold whole, as the plugin last said.
    whole: BTreeSet<u32>,
}

/// The publisher task's state.
pub struct Publisher {
    api: Api<ResourceSlice>,
    nodes: Api<Node>,
    node: String,
    settings: Settings,
    every: Duration,
    metrics: SliceMetrics,
    heartbeat: Heartbeat,
    status: watch::Sender<DraStatus>,
}

impl Publisher {
    /// The publisher `--dra` asks for: the API server and node of `--kube`.
    pub async fn start(args: &SliceArgs, node: &super::plugin::Node, heartbeat: Heartbeat) -> anyhow::Result<Publisher> {
        let Some(client) = node.kube.clone() else {
            anyhow::bail!("--dra publishes the node's GPUs through the Kubernetes API: it needs --kube");
        };
        let metrics = SliceMetrics::new()?;
        Publisher::new(client, &node.name, args, metrics, heartbeat).map_err(anyhow::Error::msg)
    }

    /// The publisher's metric families, for the agent's page.
    pub fn collectors(&self) -> Vec<Box<dyn Collector>> {
        self.metrics.collectors()
    }

    pub fn new(client: Client, node: &str, args: &SliceArgs, metrics: SliceMetrics, heartbeat: Heartbeat) -> Result<Publisher, String> {
        let settings = args.settings()?;
        if args.dra_slices_every_s == 0 {
            return Err("--dra-slices-every-s must be at least 1".into());
        }
        if slice_name(node, 0).len() > 253 {
            return Err(format!("node name {node:?} is too long for its ResourceSlices' names"));
        }
        Ok(Publisher {
            api: Api::all(client.clone()),
            nodes: Api::all(client),
            node: node.to_owned(),
            settings,
            every: Duration::from_secs(args.dra_slices_every_s),
            metrics,
            heartbeat,
            status: watch::channel(DraStatus::default()).0,
        })
    }

    /// What the publisher last published, for `vramguard audit`.
    pub fn status(&self) -> watch::Receiver<DraStatus> {
        self.status.subscribe()
    }

    /// Keeps the pool of the node's [`inventory`] published until `stop` turns true.
    /// `whole`: the GPUs prepared claims hold whole (the plugin's), published whole.
    pub async fn run(self, mut gpus: inventory::Shared, mut whole: watch::Receiver<BTreeSet<u32>>, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
        let mut inventory: Option<Arc<Inventory>> = None;
        let mut published: Option<Published> = None;
        let mut retry = FIRST_RETRY;
        let mut due = Instant::now();
        let mut waiting_logged = false;
        let mut learned = Learned { owner: None, withdrawn: false, sharing: Sharing::Shared, whole: whole.borrow().clone() };
        loop {
            self.heartbeat.beat();
            let seen = gpus.borrow_and_update().clone();
            if let Some(seen) = seen.filter(|seen| inventory.as_ref() != Some(seen)) {
                inventory = Some(seen);
                due = Instant::now();
            }
            let held = whole.borrow_and_update().clone();
            if held != learned.whole {
                learned.whole = held;
                due = Instant::now();
            }
            if Instant::now() >= due {
                match &inventory {
                    None => {
                        if !waiting_logged {
                            warn!("dra: no GPU inventory yet (NVML not read, or absent and no --gpu-memory): nothing published");
                            waiting_logged = true;
                        }
                        due = Instant::now() + self.every;
                    }
                    Some(inventory) => match self.publish(inventory, published.as_ref(), &mut learned).await {
                        Ok(now) => {
                            self.report(&now);
                            published = Some(now);
                            retry = FIRST_RETRY;
                            due = Instant::now() + self.every;
                        }
                        Err(error) => {
                            warn!(node = %self.node, "dra: publishing the node's ResourceSlices: {error} (again in {retry:?})");
                            self.metrics.syncs.with_label_values(&["error"]).inc();
                            due = Instant::now() + retry;
                            retry = (retry * 2).min(self.every);
                        }
                    },
                }
            }
            tokio::select! {
                _ = stop.changed() => return Ok(()),
                changed = gpus.changed() => {
                    if changed.is_err() {
                        if *stop.borrow() {
                            return Ok(());
                        }
                        anyhow::bail!("the node's inventory is no longer published");
                    }
                }
                // The plugin's word; once it is gone (its task ended, which ends the agent) the
                // GPUs held whole stay as last told.
                Ok(()) = whole.changed() => {}
                () = tokio::time::sleep_until(due) => {}
            }
            if *stop.borrow() {
                return Ok(());
            }
        }
    }

    /// [`Publisher::withdraw`], then [`Publisher::sync`]; again at once in the whole form if
    /// the API server dropped the shared one.
    async fn publish(&self, inventory: &Inventory, published: Option<&Published>, learned: &mut Learned) -> Result<Published, KubeError> {
        self.withdraw(learned).await?;
        if let Some(sharing) = self.probe(inventory, learned).await? {
            if sharing != learned.sharing {
                match sharing {
                    Sharing::Whole => warn!(
                        node = %self.node,
                        "dra: the API server drops allowMultipleAllocations and the request policy (the DRAConsumableCapacity feature gate \
                         is off): each GPU is published whole, for one claim at a time"
                    ),
                    Sharing::Shared => info!(node = %self.node, "dra: the API server keeps the shared form (DRAConsumableCapacity is on): GPUs are published shared"),
                }
                learned.sharing = sharing;
            }
        }
        let (now, dropped) = self.sync(inventory, published, learned).await?;
        if !dropped {
            return Ok(now);
        }
        warn!(
            node = %self.node,
            "dra: the API server dropped allowMultipleAllocations and the request policy from the node's ResourceSlices \
             (the DRAConsumableCapacity feature gate is off): each GPU is published whole, for one claim at a time"
        );
        learned.sharing = Sharing::Whole;
        Ok(self.sync(inventory, Some(&now), learned).await?.0)
    }

    /// What the API server does with the shared form now: a dry-run create (nothing stored,
    /// admission and the fields' dropping as for a real one) of a slice of the node's first
    /// GPU in the shared form, its answer read back. `Some(Whole)` where it drops
    /// `allowMultipleAllocations` or the request policy (`DRAConsumableCapacity` off: asked at
    /// every check, so a gate turned off or on is followed without a restart and without a
    /// write of the wrong form); `None` where there is no GPU to ask with, or the probe's name
    /// is taken (the form stays as it is).
    async fn probe(&self, inventory: &Inventory, learned: &Learned) -> Result<Option<Sharing>, KubeError> {
        let mut first = inventory.clone();
        first.gpus.truncate(1);
        let (slices, _) = build_as(&self.node, learned.owner.as_deref(), &first, &self.settings, 1, Sharing::Shared, &BTreeSet::new());
        let Some(mut slice) = slices.into_iter().next().filter(|s| s.spec.devices.as_ref().is_some_and(|d| !d.is_empty())) else { return Ok(None) };
        slice.metadata.name = Some(format!("{}-probe", slice_name(&self.node, 0)));
        let params = PostParams { dry_run: true, field_manager: Some("vramguard".into()) };
        match timed(format!("probing the API server with a dry-run ResourceSlice of node {}", self.node), self.api.create(&params, &slice)).await {
            Ok(answer) => Ok(Some(if shared_form_dropped(&slice, &answer) { Sharing::Whole } else { Sharing::Shared })),
            Err(KubeError::Status { code: 409, .. }) => {
                warn!(node = %self.node, "dra: a ResourceSlice has the probe's name: the form of the GPUs stays {}", learned.sharing.name());
                Ok(None)
            }
            Err(error) => Err(error),
        }
    }

    /// Tells the audit and the metrics what is published.
    fn report(&self, published: &Published) {
        for form in [Sharing::Shared, Sharing::Whole] {
            self.metrics.sharing.with_label_values(&[form.name()]).set(i64::from(form == published.sharing));
        }
        let gpus = published.inventory.gpus.iter().map(|gpu| (gpu.index, gpu.capacity)).collect();
        self.status.send_replace(DraStatus {
            sharing: published.sharing.name().into(),
            generation: published.generation,
            source: published.inventory.source.name().into(),
            gpus,
        });
    }

    /// Reads the Node (its UID, the slices' owner: at every check) and removes the node-wide
    /// extended resource from its capacity, once.
    async fn withdraw(&self, learned: &mut Learned) -> Result<(), KubeError> {
        // Read at every check: a Node deleted and made again under the same name has another
        // UID, and slices owned by the old one would be collected.
        let node = timed(format!("reading node {}", self.node), self.nodes.get(&self.node)).await?;
        learned.owner = node.metadata.uid.clone();
        if learned.withdrawn {
            return Ok(());
        }
        let capacity = node.status.as_ref().and_then(|s| s.capacity.as_ref());
        if let Some(old) = capacity.and_then(|c| c.get(RESOURCE)) {
            let path = format!("/status/capacity/{}", RESOURCE.replace('~', "~0").replace('/', "~1"));
            let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([{"op": "remove", "path": path}]))
                .map_err(|e| KubeError::Config(format!("the capacity's JSON patch: {e}")))?;
            let params = PatchParams { field_manager: Some("vramguard".into()), ..PatchParams::default() };
            let what = format!("removing {RESOURCE} from node {}'s status", self.node);
            timed(what, self.nodes.patch_status(&self.node, &params, &Patch::<()>::Json(patch))).await?;
            info!(node = %self.node, was = %old.0, "dra: the node no longer advertises {RESOURCE} (its GPUs are DRA devices)");
        }
        learned.withdrawn = true;
        Ok(())
    }

    /// Lists the node's slices of this driver and writes the pool if they are not what was
    /// published for `inventory`; also says whether the API server dropped the shared form's
    /// fields from what it wrote (read in its answers).
    async fn sync(&self, inventory: &Inventory, published: Option<&Published>, learned: &Learned) -> Result<(Published, bool), KubeError> {
        let (sharing, owner, whole) = (learned.sharing, learned.owner.as_deref(), &learned.whole);
        let selector = format!("spec.nodeName={},spec.driver={DRIVER}", self.node);
        let what = format!("listing the ResourceSlices of node {}", self.node);
        let found = timed(what, self.api.list(&ListParams::default().fields(&selector))).await?.items;
        let found_generation = found.iter().map(|s| s.spec.pool.generation).max();
        if let Some(published) = published.filter(|p| &p.inventory == inventory && p.sharing == sharing && &p.whole == whole) {
            let (wanted, _) = build_as(&self.node, owner, inventory, &self.settings, published.generation, sharing, whole);
            if same_pool(&found, &wanted) {
                self.metrics.syncs.with_label_values(&["unchanged"]).inc();
                return Ok((published.clone(), false));
            }
        }
        let generation = found_generation.into_iter().chain(published.map(|p| p.generation)).max().unwrap_or(0) + 1;
        let (wanted, left_out) = build_as(&self.node, owner, inventory, &self.settings, generation, sharing, whole);
        if !left_out.is_empty() {
            warn!(gpus = ?left_out, min = self.settings.min, "dra: GPUs with less memory than --dra-memory-min (after --dra-memory-reserve) are not published");
        }
        let by_name: BTreeMap<&str, &ResourceSlice> = found.iter().filter_map(|s| Some((s.metadata.name.as_deref()?, s))).collect();
        let params = PostParams { field_manager: Some("vramguard".into()), ..PostParams::default() };
        let mut dropped = false;
        for slice in &wanted {
            let name = slice.metadata.name.clone().unwrap_or_default();
            let written = match by_name.get(name.as_str()) {
                Some(existing) => {
                    let mut slice = slice.clone();
                    slice.metadata.resource_version = existing.metadata.resource_version.clone();
                    timed(format!("updating ResourceSlice {name}"), self.api.replace(&name, &params, &slice)).await?
                }
                None => timed(format!("creating ResourceSlice {name}"), self.api.create(&params, slice)).await?,
            };
            dropped |= shared_form_dropped(slice, &written);
        }
        for stale in by_name.keys().filter(|name| !wanted.iter().any(|w| w.metadata.name.as_deref() == Some(**name))) {
            match timed(format!("deleting stale ResourceSlice {stale}"), self.api.delete(stale, &DeleteParams::default())).await {
                Ok(_) | Err(KubeError::Status { code: 404, .. }) => {}
                Err(error) => return Err(error),
            }
        }
        let devices: usize = wanted.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).sum();
        info!(node = %self.node, generation, slices = wanted.len(), devices, replaced = found.len(), sharing = sharing.name(), "dra: published the node's ResourceSlice pool");
        self.metrics.syncs.with_label_values(&["published"]).inc();
        self.metrics.generation.set(generation);
        self.metrics.devices.set(devices as i64);
        Ok((Published { generation, inventory: inventory.clone(), sharing, whole: whole.clone() }, dropped))
    }
}

/// Whether the API server's copy of a slice it wrote (`written`) lacks what `sent` had of the
/// shared form: a device's `allowMultipleAllocations`, or a capacity's request policy (what
/// it drops where `DRAConsumableCapacity` is off).
fn shared_form_dropped(sent: &ResourceSlice, written: &ResourceSlice) -> bool {
    let devices = |slice: &ResourceSlice| slice.spec.devices.clone().unwrap_or_default();
    let written = devices(written);
    devices(sent).iter().any(|device| {
        let Some(copy) = written.iter().find(|w| w.name == device.name) else { return false };
        let policies = |d: &Device| d.capacity.iter().flat_map(|c| c.values()).filter(|c| c.request_policy.is_some()).count();
        (device.allow_multiple_allocations == Some(true) && copy.allow_multiple_allocations != Some(true)) || policies(copy) < policies(device)
    })
}

/// Whether `found` is the pool `wanted`: the same slices by name, each at the wanted
/// generation and slice count, with the same devices (quantities compared as bytes: the API
/// server writes them back in its canonical form, `79Gi` for `84825604096`).
fn same_pool(found: &[ResourceSlice], wanted: &[ResourceSlice]) -> bool {
    let devices = |slice: &ResourceSlice| slice.spec.devices.clone().map(|d| d.into_iter().map(canonical).collect::<Vec<_>>());
    found.len() == wanted.len()
        && wanted.iter().all(|w| {
            found.iter().any(|f| {
                f.metadata.name == w.metadata.name
                    && owners(f) == owners(w)
                    && f.spec.pool == w.spec.pool
                    && f.spec.node_name == w.spec.node_name
                    && devices(f) == devices(w)
            })
        })
}

/// The (kind, name, uid) of a slice's owners.
fn owners(slice: &ResourceSlice) -> Vec<(&str, &str, &str)> {
    slice.metadata.owner_references.iter().flatten().map(|o| (o.kind.as_str(), o.name.as_str(), o.uid.as_str())).collect()
}

/// `device` with its capacities' quantities in bytes (a quantity that is not a whole number
/// of bytes stays as it is, and so differs).
fn canonical(mut device: Device) -> Device {
    let bytes = |q: &mut Quantity| {
        if let Some(b) = crate::quantity::parse_quantity(&q.0) {
            q.0 = b.to_string();
        }
    };
    for capacity in device.capacity.iter_mut().flat_map(|c| c.values_mut()) {
        bytes(&mut capacity.value);
        if let Some(policy) = capacity.request_policy.as_mut() {
            policy.default.iter_mut().for_each(bytes);
            policy.valid_values.iter_mut().flatten().for_each(bytes);
            if let Some(range) = policy.valid_range.as_mut() {
                bytes(&mut range.min);
                range.step.iter_mut().chain(range.max.iter_mut()).for_each(bytes);
            }
        }
    }
    device
}

/// `request`, given up on after [`REQUEST_TIMEOUT`].
async fn timed<T>(what: String, request: impl std::future::Future<Output = Result<T, kube::Error>>) -> Result<T, KubeError> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(answer) => answer.map_err(|e| KubeError::from_kube(what, e)),
        Err(_) => Err(KubeError::Timeout { what, after: REQUEST_TIMEOUT }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{from_flag, Gpu, Source};

    const GIB: u64 = 1 << 30;

    fn gpus(n: u32) -> Inventory {
        let gpus = (0..n)
            .map(|index| Gpu { index, uuid: Some(format!("GPU-{index}")), product: "NVIDIA H100 80GB HBM3".into(), memory: 80 * GIB, capacity: 79 * GIB })
            .collect();
        Inventory { source: Source::Nvml, gpus }
    }

    #[test]
    fn one_device_per_gpu_with_shared_memory_capacity_and_its_policy() {
        let (slices, left_out) = build("node-a", &gpus(4), &Settings::default(), 3);
        assert!(left_out.is_empty());
        assert_eq!(slices.len(), 1);
        let body = serde_json::to_value(&slices[0]).expect("json");
        assert_eq!(body["metadata"]["name"], "node-a-gpu.vramguard.io-0");
        assert_eq!(body["spec"]["driver"], "gpu.vramguard.io");
        assert_eq!(body["spec"]["nodeName"], "node-a");
        assert_eq!(body["spec"]["pool"], serde_json::json!({"name": "node-a", "generation": 3, "resourceSliceCount": 1}));
        let device = &body["spec"]["devices"][2];
        assert_eq!(device["name"], "gpu-2");
        assert_eq!(device["allowMultipleAllocations"], true);
        assert_eq!(device["attributes"]["index"]["int"], 2);
        assert_eq!(device["attributes"]["uuid"]["string"], "GPU-2");
        assert_eq!(device["attributes"]["product"]["string"], "NVIDIA H100 80GB HBM3");
        assert_eq!(device["attributes"]["memory"]["int"], 80 * GIB);
        let memory = &device["capacity"]["memory"];
        assert_eq!(memory["value"], (79 * GIB).to_string());
        assert_eq!(memory["requestPolicy"]["default"], (79 * GIB).to_string());
        assert_eq!(memory["requestPolicy"]["validRange"], serde_json::json!({"min": "1073741824", "step": "268435456", "max": (79 * GIB).to_string()}));
    }

    #[test]
    fn more_than_128_gpus_take_more_slices_and_small_gpus_are_left_out() {
        let (slices, _) = build("n", &gpus(200), &Settings::default(), 1);
        assert_eq!(slices.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).collect::<Vec<_>>(), [128, 72]);
        assert!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 2));
        assert_eq!(slices[1].metadata.name.as_deref(), Some("n-gpu.vramguard.io-1"));
        let (slices, left_out) = build("n", &from_flag(&[8 * GIB, GIB], GIB), &Settings::default(), 1);
        assert_eq!(left_out, [1], "1 GiB less a 1 GiB reserve");
        let devices = slices[0].spec.devices.clone().unwrap_or_default();
        assert_eq!(devices.len(), 1);
        let attributes = devices[0].attributes.clone().unwrap_or_default();
        assert!(!attributes.contains_key("uuid"), "the fake inventory has no UUID");
        assert_eq!(attributes["source"].string.as_deref(), Some("gpu-memory"));
        // No GPU at all: one empty slice, so that the pool says so.
        let (slices, _) = build("n", &gpus(0), &Settings::default(), 1);
        assert_eq!(slices.len(), 1);
        assert_eq!(slices[0].spec.devices.as_ref().map(Vec::len), Some(0));
    }

    #[test]
    fn the_same_pool_is_recognized_and_any_difference_is_not() {
        let (wanted, _) = build("n", &gpus(2), &Settings::default(), 5);
        assert!(same_pool(&wanted, &wanted));
        let (older, _) = build("n", &gpus(2), &Settings::default(), 4);
        assert!(!same_pool(&older, &wanted));
        let (fewer, _) = build("n", &gpus(1), &Settings::default(), 5);
        assert!(!same_pool(&fewer, &wanted));
        assert!(!same_pool(&[], &wanted));
        // As the API server writes the quantities back: the same pool.
        let mut written = serde_json::to_value(&wanted).expect("json");
        let memory = &mut written[0]["spec"]["devices"][0]["capacity"]["memory"];
        memory["value"] = "79Gi".into();
        memory["requestPolicy"]["validRange"]["min"] = "1Gi".into();
        memory["requestPolicy"]["validRange"]["step"] = "256Mi".into();
        let written: Vec<ResourceSlice> = serde_json::from_value(written).expect("slices");
        assert!(same_pool(&written, &wanted));
        let mut other = written.clone();
        if let Some(capacity) = other[0].spec.devices.as_mut().and_then(|d| d[0].capacity.as_mut()) {
            capacity.get_mut(MEMORY).expect("memory").value = Quantity("78Gi".into());
        }
        assert!(!same_pool(&other, &wanted));
    }

    #[test]
    fn flags() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            plugin: crate::dra::plugin::DraArgs,
            #[command(flatten)]
            dra: SliceArgs,
        }
        let cli = Cli::try_parse_from(["x", "--dra"]).expect("flags");
        assert!(cli.plugin.dra);
        assert_eq!(cli.dra.settings(), Ok(Settings::default()));
        assert_eq!(cli.dra.dra_memory_reserve, GIB);
        let cli = Cli::try_parse_from(["x", "--dra", "--dra-memory-min", "2g", "--dra-memory-step", "1g", "--dra-memory-default", "8g"]).expect("flags");
        assert_eq!(cli.dra.settings(), Ok(Settings { min: 2 * GIB, step: GIB, default: Some(8 * GIB) }));
        assert!(Cli::try_parse_from(["x", "--dra-memory-min", "2g"]).is_err(), "needs --dra");
        assert!(Cli::try_parse_from(["x", "--dra", "--dra-memory-default", "lots"]).is_err());
        let cli = Cli::try_parse_from(["x", "--dra", "--dra-memory-step", "0"]).expect("parsed");
        assert!(cli.dra.settings().is_err(), "a zero step is refused");
    }
}
