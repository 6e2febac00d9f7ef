//! The DRA driver's whole chain on one node (issue 25, the first Must show; on containerd 2 as
//! well, `*_on_containerd_2`): a real containerd (1.7.24, CDI and NRI on) with the agent binary
//! as its NRI plugin and as the kubelet plugin (`--nri --kube --dra`, two GPUs of 8 GiB, its
//! CDI specs in containerd's CDI directory, the GPUs' device nodes stand-ins in the test's
//! directory: `--dra-device-dir`), the tests' API server (`kube_api/`) holding the
//! ResourceClaims, and the test kubelet (`dra/kubelet.rs`) that finds the plugin through its
//! registration socket, prepares the claims a pod needs and creates its container through CRI
//! with the CDI devices the plugin returned (`CDI_devices`).
//!
//! The claims are allocated by the test allocator (`tests/allocator/`) from the ResourceSlice pool
//! the agent published: the scheduler's consumable-capacity allocation with the published
//! request policy (rounding, the sum of `consumedCapacity` on a GPU at most its capacity, a
//! fresh `shareID`), so that the two claims the containers get land on one GPU,
//! the other one full. Shown:
//!
//! * prepare answers each claim's CDI device and share; the spec the agent wrote gives the
//!   allocated GPU's node from `--dra-device-dir`, and the driver's control nodes found there
//!   (`nvidiactl`, `nvidia-uvm`), which the runtime gives the container beside its GPU and
//!   the NRI side counts as no GPU;
//! * inside the container, the hooked workload sees its claim's rounded memory as the GPU's,
//!   its honest allocations up to it are granted, one past it is refused;
//! * the second claim on the same GPU has its own quota (its own rounded memory, granted where
//!   the first claim's container is refused);
//! * unprepared while its container runs (no kubelet does it, an agent must survive it), a
//!   claim keeps its ledger (counted as `kept`) and its workload is still held to its share;
//! * its container stopped as the kubelet stops it, unprepare removes the claim's CDI spec,
//!   its directory, its checkpoint entry and at once its ledger (`<ledger-dir>/dra-<uid>/`, its
//!   tmpfs unmounted, the container's record gone), before any RemoveContainer; the
//!   containers removed later (the kubelet's garbage collection), nothing is left and nothing
//!   fails; the ledger kept goes with its claim's last container.
//!
//! Needs root, the containerd cache (`cargo xtask setup`) and the built binaries.
use std::{
    ffi::{OsStr, OsString},
    path::PathBuf,
    time::Duration,
};

use agent::dra::cdi;
use anyhow::{bail, ensure, Context, Result};
use e2e::{
    agent::Agent,
    containerd::{ContainerId, ContainerSpec, Containerd, PodId, Version},
    timeout, wait_for, FakeNode, TempDir, GIB, MIB,
};
use serde_json::{json, Value};

mod allocator;
mod dra;
mod kube_api;

use allocator::{Allocator, Refused};
use dra::{
    kubelet::{self, Kubelet, Plugin},
    node::{ledger_devices, provisioned, stand_in_gpu_node, stand_in_node},
};
use kube_api::{resource, ApiServer, NODE};

const DRIVER: &str = "gpu.vramguard.io";
const NAMESPACE: &str = "team-a";
/// A namespace labelled `resource.kubernetes.io/admin-access: "true"` (its claims may ask admin access).
const ADMIN_NAMESPACE: &str = "gpu-monitoring";
/// Each GPU's memory (`--gpu-memory`): the devices' `memory` capacity.
const GPU_MEMORY: u64 = 8 * GIB;

/// A claim the test kubelet prepared: its UID, what it consumes, the plugin's answer.
struct Prepared {
    name: &'static str,
    uid: &'static str,
    memory: u64,
    share_id: String,
    cdi_devices: Vec<String>,
}

/// The node: containerd, the agent (NRI plugin and DRA kubelet plugin), the API server, the
/// test kubelet with the plugin registered, and the scheduler.
struct Node {
    dir: TempDir,
    api: ApiServer,
    fake: FakeNode,
    containerd: Containerd,
    agent: Agent,
    kubelet: Kubelet,
    plugin: Plugin,
    /// The scheduler: the test allocator, from the pool the agent published.
    scheduler: Allocator,
}

impl Node {
    fn new(tag: &str) -> Result<Node> {
        Node::on_driver(tag, None)
    }

    /// [`Node::new`] whose fake driver calls itself `version` (`FAKECUDA_DRIVER_VERSION`:
    /// from 615 on, it takes per-cgroup limits).
    fn on_driver(tag: &str, version: Option<&str>) -> Result<Node> {
        let api = ApiServer::start()?;
        let dir = TempDir::new(tag)?;
        let account = dir.path().join("serviceaccount");
        api.service_account(&account)?;
        for sub in ["ledgers", "nodes"] {
            std::fs::create_dir_all(dir.path().join(sub))?;
        }
        for n in [0, 1] {
            stand_in_gpu_node(&dir.path().join("nodes"), n)?;
        }
        // The driver's control nodes this node has (no nvidia-uvm-tools, no nvidia-modeset).
        for name in ["nvidiactl", "nvidia-uvm"] {
            stand_in_node(&dir.path().join("nodes"), name)?;
        }
        // One fake GPU of 8 GiB, whichever of the node's GPUs a container gets; contexts
        // charged what the agent's ledgers reserve (518 MiB).
        let mut fake = FakeNode::new(tag).with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "518m");
        if let Some(version) = version {
            fake = fake.with_env("FAKECUDA_DRIVER_VERSION", version);
        }
        let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
        let path = |sub: &str| OsString::from(dir.path().join(sub));
        let mut args = e2e::agent::kube_node_args(dir.path(), "8Gi,8Gi")?;
        args.extend([
            "--dra".into(),
            "--kubelet-registry-dir".into(),
            path("registry"),
            "--kubelet-plugins-dir".into(),
            path("plugins"),
            "--cdi-dir".into(),
            containerd.cdi_dir().into(),
            "--dra-device-dir".into(),
            path("nodes"),
            // The published capacity is each GPU's whole memory, as --gpu-memory gives it.
            "--dra-memory-reserve".into(),
            "0".into(),
            // Claims gone from the API server are looked at each second, with no window.
            "--dra-stale-after-s".into(),
            "0".into(),
            "--dra-stale-every-s".into(),
            "1".into(),
        ]);
        let mut env = api.pod_env(&account);
        env.extend(fake.env().iter().cloned());
        // The agent's NVML sees the node's two GPUs (a container sees the one it is given).
        env.push(("FAKECUDA_DEVICE_COUNT".into(), "2".into()));
        let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
        let agent = Agent::start_with_env(&args, &env)?;
        wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true)).with_context(|| agent.log())?;
        let kubelet = Kubelet::new(&dir.path().join("registry"))?;
        let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
        // The scheduler allocates from the pool the agent published (its request policy).
        let published = || -> Vec<Value> { api.with(|state| state.resource.slices.values().cloned().collect()) };
        wait_for(timeout(), "the agent's ResourceSlice pool", || {
            Ok(published().iter().map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len)).sum::<usize>() == 2)
        })
        .with_context(|| agent.log())?;
        let slices = published();
        let scheduler = Allocator::new(&slices)?;
        ensure!(scheduler.devices.iter().all(|d| d.capacity == GPU_MEMORY && d.policy.is_some()), "the published pool: {:?}", scheduler.devices);
        Ok(Node { dir, api, fake, containerd, agent, kubelet, plugin, scheduler })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Claim `name` asking `memory`, allocated by the scheduler for pod `name` and put in the
    /// API server, then prepared through the kubelet plugin.
    fn claim(&mut self, name: &'static str, uid: &'static str, memory: &str) -> Result<Prepared> {
        let unallocated = resource::claim(NAMESPACE, name, uid, memory, None);
        let consumer = json!({"resource": "pods", "name": name, "uid": format!("uid-{name}")});
        let allocated = self.scheduler.allocate(&unallocated, &consumer)?.map_err(|refused| anyhow::anyhow!("{name}: {refused:?}"))?;
        let result = allocated["status"]["allocation"]["devices"]["results"][0].clone();
        self.api.put_claim(allocated);
        let answer = self.kubelet.prepare(&self.plugin, vec![kubelet::claim(NAMESPACE, name, uid)])?;
        let prepared = answer.claims.get(uid).with_context(|| format!("no answer for {name}: {answer:?}"))?;
        ensure!(prepared.error.is_empty(), "{name}: {}\n{}", prepared.error, self.agent.log());
        let [device] = prepared.devices.as_slice() else { bail!("{name}: one device expected: {prepared:?}") };
        ensure!(device.pool_name == NODE && device.device_name == result["device"] && device.request_names == ["gpu"], "{name}: {device:?} for {result}");
        ensure!(device.share_id.as_ref().is_some_and(|s| result["shareID"] == s.as_str()), "{name}: the scheduler's shareID: {device:?} for {result}");
        let memory = result["consumedCapacity"]["memory"].as_str().and_then(|q| q.parse().ok()).context("consumedCapacity")?;
        Ok(Prepared { name, uid, memory, share_id: result["shareID"].as_str().unwrap_or_default().to_owned(), cdi_devices: device.cdi_device_ids.clone() })
    }

    /// The kubelet's part of running `claim`'s pod: a sandbox, and its container `main` created
    /// through CRI with the plugin's CDI devices (`CDI_devices`) and the fake driver, started
    /// (it sleeps).
    fn run(&self, claim: &Prepared) -> Result<(PodId, ContainerId)> {
        let pod = self.containerd.pod(claim.name, NAMESPACE, &format!("uid-{}", claim.name), &[])?;
        // As a CUDA image says it (NVIDIA's runtime would give such a container every GPU).
        let mut spec = ContainerSpec::new("main").fake_driver(&self.fake)?.env("NVIDIA_VISIBLE_DEVICES", "all");
        for device in &claim.cdi_devices {
            spec = spec.cdi_device(device);
        }
        let id = self.containerd.run_container(&pod, &spec).with_context(|| self.agent.log())?;
        Ok((pod, id))
    }

    /// Claim `uid`'s ledger directory on the host.
    fn ledger_dir(&self, uid: &str) -> PathBuf {
        self.path("ledgers").join(format!("dra-{uid}"))
    }

    /// (index, limit) of each device of claim `uid`'s ledger.
    fn ledger_limits(&self, uid: &str) -> Result<Vec<(u64, u64)>> {
        ledger_devices(&self.ledger_dir(uid).join("ledger"), "limit_bytes")
    }

    /// `vramguard_dra_unprepared_ledgers_total{result}` on the agent's page.
    fn unprepared_ledgers(&self, result: &str) -> Result<f64> {
        self.metric("vramguard_dra_unprepared_ledgers_total", &[("result", result)])?.context("no vramguard_dra_unprepared_ledgers_total")
    }

    /// `name{labels}` on the agent's page now.
    fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Result<Option<f64>> {
        Ok(e2e::http::metric(&e2e::http::scrape(self.agent.metrics_addr()?)?, name, labels))
    }

    /// Checks that `id` is provisioned from `claim` on GPU 1 alone and that its workload is
    /// held to the claim's memory there: `honest` granted (the last line `meminfo`, whose total
    /// is the claim's memory), `refused` (an allocation named `x`) refused.
    fn held_to(&self, claim: &Prepared, id: &ContainerId, steps: &[&str]) -> Result<()> {
        let record = provisioned(&self.agent, id)?.with_context(|| format!("{} not provisioned:\n{}", claim.name, self.agent.log()))?;
        ensure!(record["claim"] == claim.uid && record["source"] == "dra claim", "{}: {record}", claim.name);
        ensure!(record["gpus"] == json!([1]) && record["quota"] == claim.memory, "{}: GPU 1 at the claim's memory: {record}", claim.name);
        ensure!(self.ledger_limits(claim.uid)? == [(0, claim.memory)], "{}: the ledger's one device: {:?}", claim.name, self.ledger_limits(claim.uid)?);
        let lines = dra::node::workload(&self.containerd, id, steps).with_context(|| self.agent.log())?;
        eprintln!("{}: {lines:?}", claim.name);
        ensure!(lines.iter().any(|l| l == "oom x"), "{}: the allocation past the claim's memory is refused: {lines:?}", claim.name);
        ensure!(!lines.iter().any(|l| l.starts_with("oom ") && l != "oom x"), "{}: an honest allocation refused: {lines:?}", claim.name);
        ensure!(lines.iter().any(|l| l.contains(&format!("total={}", claim.memory))), "{}: the GPU's memory is the claim's: {lines:?}", claim.name);
        Ok(())
    }
}

#[test]
fn a_claim_allocated_prepared_and_run_through_cri_is_held_to_its_share_of_one_gpu() -> Result<()> {
    let mut node = Node::new("dra-chain")?;

    // GPU 0 mostly taken: 5900 MiB consumes 6 GiB (1 GiB and 20 steps). "train" asks 2500 MiB
    // (2.5 GiB: 1 GiB and 6 steps), with no room left on GPU 0: GPU 1. "serve" asks 4700 MiB
    // (4.75 GiB), no room on GPU 0 either: GPU 1 beside "train" (7.25 of 8 GiB). Then GPU 0
    // has 2 GiB and GPU 1 768 MiB left: 2100 MiB (2.25 GiB) fits nowhere.
    let fill = node.claim("fill", "8e0d2c4a-1b3f-4e5d-9a6b-0c1d2e3f4a01", "5900Mi")?;
    let train = node.claim("train", "8e0d2c4a-1b3f-4e5d-9a6b-0c1d2e3f4a02", "2500Mi")?;
    let serve = node.claim("serve", "8e0d2c4a-1b3f-4e5d-9a6b-0c1d2e3f4a03", "4700Mi")?;
    ensure!((fill.memory, train.memory, serve.memory) == (6 * GIB, 2560 * MIB, 4864 * MIB), "rounded by the policy");
    let over = resource::claim(NAMESPACE, "over", "8e0d2c4a-1b3f-4e5d-9a6b-0c1d2e3f4a04", "2100Mi", None);
    let refused = node.scheduler.allocate(&over, &json!({}))?;
    ensure!(matches!(refused, Err(Refused::Unschedulable { .. })), "no GPU has 2.25 GiB left: {refused:?}");
    for claim in [&train, &serve] {
        ensure!(claim.cdi_devices == [cdi::qualified(claim.uid, 1)], "{}: GPU 1's device: {:?}", claim.name, claim.cdi_devices);
    }
    ensure!(train.share_id != serve.share_id, "each share its own ID");

    // The spec the agent wrote: GPU 1's node from --dra-device-dir.
    let spec_path = cdi::spec_path(&node.containerd.cdi_dir(), train.uid);
    let spec: Value = serde_json::from_slice(&std::fs::read(&spec_path).context("the CDI spec")?)?;
    let device_node = &spec["devices"][0]["containerEdits"]["deviceNodes"][0];
    ensure!(spec["cdiVersion"] == cdi::CDI_VERSION_HOST_PATH, "{spec}");
    ensure!(device_node["path"] == "/dev/nvidia1" && device_node["hostPath"] == json!(node.path("nodes/nvidia1")), "{spec}");
    let controls = json!([
        {"path": "/dev/nvidiactl", "hostPath": node.path("nodes/nvidiactl")},
        {"path": "/dev/nvidia-uvm", "hostPath": node.path("nodes/nvidia-uvm")},
    ]);
    ensure!(spec["containerEdits"]["deviceNodes"] == controls, "the control nodes the node has: {spec}");

    // train (2560 MiB): a context (518 MiB), 1 GiB and 768 MiB granted (2310 MiB); 512 MiB
    // more refused (2822 MiB); 192 MiB more granted (2502 MiB).
    let (pod_train, train_id) = node.run(&train)?;
    node.held_to(&train, &train_id, &["ctx 0", "alloc a 1g", "alloc b 768m", "expect-oom alloc x 512m", "alloc c 192m", "meminfo"])?;
    // serve, on the same GPU, has its own 4864 MiB: a context and 4 GiB granted (4614 MiB, more
    // than train's whole quota), 512 MiB more refused (5126 MiB), 200 MiB granted (4814 MiB).
    let (pod_serve, serve_id) = node.run(&serve)?;
    node.held_to(&serve, &serve_id, &["ctx 0", "alloc a 4g", "expect-oom alloc x 512m", "alloc c 200m", "meminfo"])?;
    let runtime = node.containerd.runtime_spec(&serve_id)?;
    let devices: Vec<&str> = runtime["linux"]["devices"].as_array().into_iter().flatten().filter_map(|d| d["path"].as_str()).collect();
    ensure!(devices.contains(&"/dev/nvidia1") && !devices.contains(&"/dev/nvidia0"), "the runtime gave GPU 1's node alone: {devices:?}");
    // With the control nodes, which the NRI side counts as no GPU (serve is held to GPU 1 alone).
    ensure!(devices.contains(&"/dev/nvidiactl") && devices.contains(&"/dev/nvidia-uvm"), "the control nodes: {devices:?}");
    // NVIDIA's runtime is told the claim's GPU alone (by the UUID the pool publishes), not the
    // image's `all`.
    let uuid = uuid_of(&node, "gpu-1")?;
    let env: Vec<&str> = runtime["process"]["env"].as_array().into_iter().flatten().filter_map(Value::as_str).filter(|e| e.starts_with("NVIDIA_VISIBLE_DEVICES=")).collect();
    ensure!(env == [format!("NVIDIA_VISIBLE_DEVICES={uuid}")], "the claim's GPU alone, the image's value replaced: {env:?}");

    // serve unprepared while its container runs: its ledger is kept, its workload still held.
    let answer = node.kubelet.unprepare(&node.plugin, vec![kubelet::claim(NAMESPACE, serve.name, serve.uid)])?;
    ensure!(answer.claims.get(serve.uid).is_some_and(|c| c.error.is_empty()), "{answer:?}\n{}", node.agent.log());
    ensure!(!cdi::spec_path(&node.containerd.cdi_dir(), serve.uid).exists(), "serve's CDI spec is removed");
    ensure!(node.ledger_dir(serve.uid).join("ledger").exists() && mounted(&node.ledger_dir(serve.uid))?, "serve's ledger is kept while it runs");
    ensure!(node.unprepared_ledgers("kept")? == 1.0 && node.unprepared_ledgers("removed")? == 0.0, "counted as kept");
    node.held_to(&serve, &serve_id, &["ctx 0", "alloc a 4g", "expect-oom alloc x 512m", "alloc c 200m", "meminfo"])?;

    // train's pod ends: its container stopped as the kubelet stops it, then unprepared: its
    // spec, claim directory, checkpoint entry and ledger go at once, before any removal.
    node.containerd.stop_container(&train_id, Duration::from_secs(1))?;
    let answer = node.kubelet.unprepare(&node.plugin, vec![kubelet::claim(NAMESPACE, train.name, train.uid)])?;
    ensure!(answer.claims.get(train.uid).is_some_and(|c| c.error.is_empty()), "{answer:?}\n{}", node.agent.log());
    let checkpoint = std::fs::read_to_string(node.path("state/dra/checkpoint.json"))?;
    for claim in [&train, &serve] {
        ensure!(!cdi::spec_path(&node.containerd.cdi_dir(), claim.uid).exists(), "{}: the CDI spec is removed", claim.name);
        ensure!(!cdi::claim_dir(&node.path("state"), claim.uid).exists(), "{}: the claim's directory is removed", claim.name);
        ensure!(!checkpoint.contains(claim.uid), "{}: the checkpoint forgot it: {checkpoint}", claim.name);
    }
    ensure!(checkpoint.contains(fill.uid), "fill is still prepared: {checkpoint}");
    ensure!(!node.ledger_dir(train.uid).exists(), "train's ledger is removed at unprepare:\n{}", node.agent.log());
    ensure!(!mounted(&node.ledger_dir(train.uid))?, "train's ledger tmpfs is unmounted");
    ensure!(!node.path(&format!("state/containers/dra-{}", train.uid)).exists(), "train's ledger header is removed");
    ensure!(provisioned(&node.agent, &train_id)?.is_none(), "train's container is forgotten");
    ensure!(node.unprepared_ledgers("removed")? == 1.0, "counted as removed");
    // Unprepare again (the kubelet retries): nothing left to do, no error.
    let answer = node.kubelet.unprepare(&node.plugin, vec![kubelet::claim(NAMESPACE, train.name, train.uid)])?;
    ensure!(answer.claims.get(train.uid).is_some_and(|c| c.error.is_empty()), "{answer:?}");

    // The containers removed (the kubelet's garbage collection): train's finds nothing left,
    // serve's ledger goes with its last container.
    node.containerd.remove_container(&train_id)?;
    node.containerd.stop_container(&serve_id, Duration::from_secs(1))?;
    for pod in [&pod_train, &pod_serve] {
        node.containerd.remove_pod(pod)?;
    }
    wait_for(timeout(), "serve's ledger removed with its container", || Ok(!node.ledger_dir(serve.uid).exists())).with_context(|| node.agent.log())?;
    ensure!(!mounted(&node.ledger_dir(serve.uid))?, "serve's ledger tmpfs is unmounted");
    ensure!(node.unprepared_ledgers("removed")? == 1.0, "serve's ledger went with its container, not at unprepare");
    let log = node.agent.log();
    ensure!(!log.contains("panicked") && !log.contains("cannot remove"), "{log}");
    node.fake.cleanup();
    Ok(())
}

/// Whether something is mounted at `dir` (the agent mounts the ledgers' tmpfs in its own mount
/// namespace, the test's).
fn mounted(dir: &std::path::Path) -> Result<bool> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let dir = dir.to_str().context("a UTF-8 path")?;
    Ok(mountinfo.lines().any(|line| line.split_whitespace().nth(4) == Some(dir)))
}

/// The same chain on containerd 2 (Debian unstable's; CDI and NRI on by default, its version 3
/// configuration): the kubelet's `CDI_devices` reach runc and the NRI side alike.
#[test]
fn a_claim_allocated_prepared_and_run_through_cri_is_held_to_its_share_of_one_gpu_on_containerd_2() -> Result<()> {
    Version::V2.run(a_claim_allocated_prepared_and_run_through_cri_is_held_to_its_share_of_one_gpu)
}

/// A claim of `requests` (`(name, count, memory)`), allocated by the scheduler, prepared: the
/// allocated claim and the plugin's answer for it.
fn claim_of(node: &mut Node, name: &str, uid: &str, requests: &[(&str, u64, &str)]) -> Result<(Value, agent::dra::proto::v1::NodePrepareResourceResponse)> {
    let requests: Vec<Value> = requests
        .iter()
        .map(|(request, count, memory)| {
            json!({"name": request, "exactly": {
                "deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": count,
                "capacity": {"requests": {"memory": memory}}
            }})
        })
        .collect();
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": NAMESPACE, "name": name, "uid": uid},
        "spec": {"devices": {"requests": requests}}
    });
    let allocated = node.scheduler.allocate(&claim, &json!({"resource": "pods", "name": name, "uid": format!("uid-{name}")}))?.map_err(|r| anyhow::anyhow!("{name}: {r:?}"))?;
    node.api.put_claim(allocated.clone());
    let answer = node.kubelet.prepare(&node.plugin, vec![kubelet::claim(NAMESPACE, name, uid)])?;
    let answer = answer.claims.get(uid).cloned().with_context(|| format!("no answer for {name}"))?;
    Ok((allocated, answer))
}

/// A ResourceClaim of one request of the driver's class with admin access (a monitoring claim:
/// no capacity asked).
fn admin_claim(namespace: &str, name: &str, uid: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 1, "adminAccess": true
        }}]}}
    })
}

/// The results' devices of an allocated claim.
/// The UUID the published pool gives device `device` (`gpu-N`).
fn uuid_of(node: &Node, device: &str) -> Result<String> {
    let uuid = node.api.with(|state| {
        state.resource.slices.values().flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default()).find(|d| d["name"] == device).map(|d| d["attributes"]["uuid"]["string"].clone())
    });
    uuid.and_then(|u| u.as_str().map(str::to_owned)).with_context(|| format!("{device}'s uuid"))
}

fn devices_of(allocated: &Value) -> Vec<String> {
    allocated["status"]["allocation"]["devices"]["results"].as_array().into_iter().flatten().filter_map(|r| r["device"].as_str().map(str::to_owned)).collect()
}

/// The CDI devices the kubelet hands a container that names `request` of the claim (`None`:
/// the whole claim), as the kubelet picks them from the plugin's answer.
fn cdi_for(answer: &agent::dra::proto::v1::NodePrepareResourceResponse, request: Option<&str>) -> Vec<String> {
    let mut ids: Vec<String> = answer
        .devices
        .iter()
        .filter(|d| request.is_none_or(|r| d.request_names.iter().any(|n| n == r)))
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// Claims as resource.k8s.io/v1 allows them (issue 38, item 4), on two GPUs of 8 GiB: a
/// request of `count: 2` (a share on each GPU), two requests of one claim on one GPU (their
/// sum its quota there; with NVIDIA's device plugin's GPU beside it, refused), two requests
/// on two GPUs, a container naming one request of that claim (refused: its ledger is the
/// claim's, GPU by GPU), and a claim with admin access (KEP-5018: allocated by the scheduler
/// beside a claim that fills the GPU, prepared without counting against it, its container run
/// with the GPU and no quota; refused by the API server in a namespace not labelled for it).
#[test]
fn claims_of_several_requests_counts_and_admin_access_are_prepared_and_held_or_refused_with_why() -> Result<()> {
    // On a driver with per-cgroup limits: a claim's containers get them on each GPU.
    let mut node = Node::on_driver("dra-requests", Some("615.20.01"))?;
    let held = |node: &Node, name: &str, id: &ContainerId, uid: &str, limits: &[(u64, u64)]| -> Result<()> {
        let record = provisioned(&node.agent, id)?.with_context(|| format!("{name} not provisioned:\n{}", node.agent.log()))?;
        ensure!(record["claim"] == uid, "{name}: {record}");
        ensure!(node.ledger_limits(uid)? == limits, "{name}: the ledger {:?}", node.ledger_limits(uid)?);
        let over = format!("{}m", limits[0].1 / MIB);
        let lines = dra::node::workload(&node.containerd, id, &["ctx 0", &format!("expect-oom alloc x {over}")]).with_context(|| node.agent.log())?;
        ensure!(lines.iter().any(|l| l == "oom x"), "{name}: {lines:?}");
        Ok(())
    };
    let run = |node: &Node, name: &str, cdi: &[String]| -> Result<ContainerId> {
        let pod = node.containerd.pod(name, NAMESPACE, &format!("uid-{name}"), &[])?;
        let mut spec = ContainerSpec::new("main").fake_driver(&node.fake)?;
        for device in cdi {
            spec = spec.cdi_device(device);
        }
        node.containerd.run_container(&pod, &spec)
    };
    let release = |node: &mut Node, name: &str, uid: &str, id: &ContainerId| -> Result<()> {
        node.containerd.stop_container(id, Duration::from_secs(1))?;
        let answer = node.kubelet.unprepare(&node.plugin, vec![kubelet::claim(NAMESPACE, name, uid)])?;
        ensure!(answer.claims.get(uid).is_some_and(|c| c.error.is_empty()), "{answer:?}");
        node.scheduler.release(uid);
        Ok(())
    };

    // count: 2, 2 GiB each: one share on each GPU, one CDI device each.
    let uid = "5a0e2c4a-1b3f-4e5d-9a6b-0c1d2e3f4b01";
    let (allocated, answer) = claim_of(&mut node, "pair", uid, &[("gpu", 2, "2Gi")])?;
    ensure!(devices_of(&allocated) == ["gpu-0", "gpu-1"] && answer.error.is_empty(), "{allocated}\n{answer:?}");
    let id = run(&node, "pair", &cdi_for(&answer, None))?;
    held(&node, "pair", &id, uid, &[(0, 2 * GIB), (1, 2 * GIB)])?;
    // The driver's limit on each of the claim's GPUs, on the container's cgroup.
    let cgroup = node.containerd.container_cgroup_path(&id)?;
    wait_for(timeout(), "the claim's limits in the driver on both GPUs", || {
        let audit = node.agent.audit()?;
        let limits = &audit["driver_limits"]["containers"][id.0.as_str()];
        let hard: Vec<(u64, u64)> = limits["gpus"].as_array().map_or_else(Vec::new, |gpus| {
            gpus.iter().filter_map(|g| Some((g["gpu"].as_u64()?, g["hard"].as_u64()?))).collect()
        });
        Ok(limits["held"] == true && hard == [(0, 2 * GIB), (1, 2 * GIB)])
    })
    .with_context(|| node.agent.log())?;
    for gpu in [0, 1] {
        ensure!(node.fake.driver_limit(&cgroup, gpu)?.is_some_and(|(_, hard, _)| hard == 2 * GIB), "the fake driver holds GPU {gpu}");
    }
    release(&mut node, "pair", uid, &id)?;

    // Two requests on one GPU: one CDI device, the quota their sum.
    let uid = "5a0e2c4a-1b3f-4e5d-9a6b-0c1d2e3f4b02";
    let (allocated, answer) = claim_of(&mut node, "twin", uid, &[("a", 1, "1Gi"), ("b", 1, "2Gi")])?;
    ensure!(devices_of(&allocated) == ["gpu-0", "gpu-0"] && answer.error.is_empty(), "{allocated}\n{answer:?}");
    ensure!(answer.devices.iter().map(|d| d.request_names.clone()).collect::<Vec<_>>() == [vec!["a".to_owned()], vec!["b".to_owned()]], "{answer:?}");
    ensure!(cdi_for(&answer, None).len() == 1, "one GPU, one CDI device: {answer:?}");
    let id = run(&node, "twin", &cdi_for(&answer, None))?;
    held(&node, "twin", &id, uid, &[(0, 3 * GIB)])?;
    // A container naming request a alone gets the same GPU: the claim's quota there.
    let alone = run(&node, "twin-a", &cdi_for(&answer, Some("a")))?;
    held(&node, "twin-a", &alone, uid, &[(0, 3 * GIB)])?;
    node.containerd.stop_container(&alone, Duration::from_secs(1))?;
    // NVIDIA's device plugin beside it: its CDI device for GPU 1 as well (the pod asked
    // nvidia.com/gpu too): refused, saying why.
    let nvidia = json!({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
        {"name": "1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1", "hostPath": node.path("nodes/nvidia1")}]}}
    ]});
    std::fs::write(node.containerd.cdi_dir().join("nvidia.json"), serde_json::to_vec(&nvidia)?)?;
    let mut both = cdi_for(&answer, None);
    both.push("nvidia.com/gpu=1".into());
    let error = format!("{:#}", run(&node, "twin-plugin", &both).expect_err("GPUs from both"));
    ensure!(error.contains("also has GPUs [1]") && error.contains("nvidia.com/gpu"), "{error}");
    ensure!(node.metric("vramguard_dra_containers_refused_total", &[("reason", "foreign_gpus")])? == Some(1.0), "counted");
    // The device plugin's default `envvar` strategy gives no device node before the NVIDIA
    // runtime reads the variable: NVIDIA_VISIBLE_DEVICES naming GPU 1 by its UUID (as the
    // device plugin names GPUs) beside the claim: refused too, naming the variable.
    // A container of the claim's CDI devices, with what `device_plugin` adds.
    let beside = |name: &str, device_plugin: &dyn Fn(ContainerSpec) -> ContainerSpec| -> Result<ContainerId> {
        let pod = node.containerd.pod(name, NAMESPACE, &format!("uid-{name}"), &[])?;
        let mut spec = device_plugin(ContainerSpec::new("main").fake_driver(&node.fake)?);
        for device in cdi_for(&answer, None) {
            spec = spec.cdi_device(&device);
        }
        node.containerd.run_container(&pod, &spec)
    };
    let gpu1 = uuid_of(&node, "gpu-1")?;
    let error = format!("{:#}", beside("twin-envvar", &|spec| spec.env("NVIDIA_VISIBLE_DEVICES", &gpu1)).expect_err("GPU 1 from the device plugin's variable"));
    ensure!(error.contains(&format!("NVIDIA_VISIBLE_DEVICES={gpu1}")) && error.contains("remove nvidia.com/gpu"), "{error}");
    // Its `volume-mounts` strategy: /dev/null mounted at a name the NVIDIA runtime reads as a
    // GPU.
    let mount = |spec: ContainerSpec| spec.mount("/dev/null", format!("/var/run/nvidia-container-devices/{gpu1}"), true);
    let error = format!("{:#}", beside("twin-mounts", &mount).expect_err("GPU 1 from the device plugin's mount"));
    ensure!(error.contains("volume-mounts strategy: /var/run/nvidia-container-devices/"), "{error}");
    ensure!(node.metric("vramguard_dra_containers_refused_total", &[("reason", "foreign_gpus")])? == Some(3.0), "each counted");
    // The claim's own GPU by UUID, as an operator may write it: created.
    let own = uuid_of(&node, "gpu-0")?;
    let mine = beside("twin-own", &|spec| spec.env("NVIDIA_VISIBLE_DEVICES", &own)).with_context(|| node.agent.log())?;
    node.containerd.stop_container(&mine, Duration::from_secs(1))?;
    release(&mut node, "twin", uid, &id)?;

    // Two requests on two GPUs (6 GiB do not fit twice on one of 8).
    let uid = "5a0e2c4a-1b3f-4e5d-9a6b-0c1d2e3f4b03";
    let (allocated, answer) = claim_of(&mut node, "split", uid, &[("a", 1, "6Gi"), ("b", 1, "6Gi")])?;
    ensure!(devices_of(&allocated) == ["gpu-0", "gpu-1"] && answer.error.is_empty(), "{allocated}\n{answer:?}");
    let id = run(&node, "split", &cdi_for(&answer, None))?;
    held(&node, "split", &id, uid, &[(0, 6 * GIB), (1, 6 * GIB)])?;
    // A container naming request b alone gets GPU 1 of the claim's two: refused, saying why.
    let error = run(&node, "split-b", &cdi_for(&answer, Some("b"))).expect_err("a part of the claim");
    let error = format!("{error:#}");
    ensure!(error.contains("has GPUs [1] of its claim's [0, 1]") && error.contains("name the claim without `request`"), "{error}");
    ensure!(node.metric("vramguard_dra_containers_refused_total", &[("reason", "partial_claim")])? == Some(1.0), "counted");
    release(&mut node, "split", uid, &id)?;

    // Admin access (KEP-5018). A claim fills GPU 0 (8 GiB of 8); a monitoring claim with admin
    // access, in a namespace labelled for it, is allocated GPU 0 all the same (the scheduler
    // ignores the device's other allocations for it), its result marked `adminAccess`.
    let full = "5a0e2c4a-1b3f-4e5d-9a6b-0c1d2e3f4b04";
    let (allocated, answer) = claim_of(&mut node, "full", full, &[("gpu", 1, "8Gi")])?;
    ensure!(devices_of(&allocated) == ["gpu-0"] && answer.error.is_empty(), "{allocated}\n{answer:?}");
    node.api.label_namespace(ADMIN_NAMESPACE, json!({resource::ADMIN_ACCESS_LABEL: "true"}));
    let uid = "5a0e2c4a-1b3f-4e5d-9a6b-0c1d2e3f4b05";
    node.api.create_claim(admin_claim(ADMIN_NAMESPACE, "watch", uid)).map_err(anyhow::Error::msg)?;
    let consumer = json!({"resource": "pods", "name": "watch", "uid": "uid-watch"});
    let allocated = node.scheduler.allocate(&admin_claim(ADMIN_NAMESPACE, "watch", uid), &consumer)?.map_err(|r| anyhow::anyhow!("watch: {r:?}"))?;
    let result = &allocated["status"]["allocation"]["devices"]["results"][0];
    ensure!(result["device"] == "gpu-0" && result["adminAccess"] == true, "beside the full claim: {allocated}");
    node.api.put_claim(allocated.clone());
    // Prepared: GPU 0's CDI device, its spec GPU 0's node; not counted against GPU 0 (the
    // full claim's 8 GiB and this one's would be over it).
    let answer = node.kubelet.prepare(&node.plugin, vec![kubelet::claim(ADMIN_NAMESPACE, "watch", uid)])?;
    let answer = answer.claims.get(uid).cloned().context("no answer for watch")?;
    ensure!(answer.error.is_empty() && cdi_for(&answer, None) == [cdi::qualified(uid, 0)], "{answer:?}\n{}", node.agent.log());
    let spec: Value = serde_json::from_slice(&std::fs::read(cdi::spec_path(&node.containerd.cdi_dir(), uid)).context("watch's CDI spec")?)?;
    ensure!(spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] == "/dev/nvidia0", "{spec}");
    ensure!(node.metric("vramguard_dra_admin_access_claims", &[])? == Some(1.0), "shown as admin access");
    // Its container runs through containerd with GPU 0 and no quota: not provisioned (no
    // ledger, no limit in the driver), its allocations past any claim's share granted.
    let pod = node.containerd.pod("watch", ADMIN_NAMESPACE, "uid-watch", &[])?;
    let mut spec = ContainerSpec::new("main").fake_driver(&node.fake)?;
    for device in cdi_for(&answer, None) {
        spec = spec.cdi_device(&device);
    }
    let id = node.containerd.run_container(&pod, &spec).with_context(|| node.agent.log())?;
    ensure!(provisioned(&node.agent, &id)?.is_none() && !node.ledger_dir(uid).exists(), "no ledger for admin access:\n{}", node.agent.log());
    let lines = dra::node::workload(&node.containerd, &id, &["ctx 0", "alloc a 6g", "meminfo"]).with_context(|| node.agent.log())?;
    ensure!(!lines.iter().any(|l| l.starts_with("oom ")) && lines.iter().any(|l| l.contains(&format!("total={GPU_MEMORY}"))), "not limited: {lines:?}");
    let cgroup = node.containerd.container_cgroup_path(&id)?;
    ensure!((0..2).all(|gpu| node.fake.driver_limit(&cgroup, gpu).is_ok_and(|l| l.is_none())), "no limit in the driver");
    ensure!(node.agent.audit()?["driver_limits"]["containers"][id.0.as_str()].is_null(), "no limit asked of the driver");
    ensure!(node.agent.log().contains("admin access: created with its GPUs and no quota"), "logged as admin access");
    // A namespace without the label: the API server refuses the claim, nothing is stored.
    let refused = node.api.create_claim(admin_claim(NAMESPACE, "sneak", "5a0e2c4a-1b3f-4e5d-9a6b-0c1d2e3f4b06")).expect_err("not labelled");
    ensure!(refused.contains("spec.devices.requests[0].exactly.adminAccess: Forbidden: admin access to devices requires the `resource.kubernetes.io/admin-access: true` label"), "{refused}");
    ensure!(node.api.with(|s| !s.resource.claims.contains_key(&(NAMESPACE.to_owned(), "sneak".to_owned()))), "not stored");
    node.fake.cleanup();
    Ok(())
}

/// A claim deleted from the API server while its container runs (its finalizer stripped, or
/// its pod force-deleted while the kubelet was down) keeps its entry, and so its share of the
/// GPU, while the container may run; once it has stopped, the entry is dropped.
#[test]
fn a_claim_deleted_under_a_running_container_keeps_its_share_until_the_container_stops() -> Result<()> {
    let mut node = Node::new("dra-stale-running")?;
    let held = node.claim("held", "6b1f3d5a-1b3f-4e5d-9a6b-0c1d2e3f4c01", "4Gi")?;
    let (_pod, id) = node.run(&held)?;
    node.api.delete_claim(NAMESPACE, held.name);
    wait_for(timeout(), "the sweep keeps the running claim", || Ok(node.metric("vramguard_dra_stale_claims_in_use", &[])? == Some(1.0))).with_context(|| node.agent.log())?;
    ensure!(cdi::spec_path(&node.containerd.cdi_dir(), held.uid).exists(), "kept while its container runs");
    ensure!(std::fs::read_to_string(node.path("state/dra/checkpoint.json"))?.contains(held.uid), "its share still counts");
    node.containerd.stop_container(&id, Duration::from_secs(1))?;
    wait_for(timeout(), "dropped once its container stopped", || Ok(node.metric("vramguard_dra_stale_claims_dropped_total", &[])? == Some(1.0))).with_context(|| node.agent.log())?;
    ensure!(!cdi::spec_path(&node.containerd.cdi_dir(), held.uid).exists(), "its spec removed");
    ensure!(!node.ledger_dir(held.uid).exists(), "its ledger removed with it");
    node.fake.cleanup();
    Ok(())
}

/// An init container and the main container of one pod name the same claim (the webhook's
/// sharing: init containers run alone, before the main ones): the init container takes most
/// of the claim's quota and exits; its slot is the claim's ledger's no more, and the main
/// container then has the whole quota (the pod holds the larger of the two, not their sum).
#[test]
fn an_init_container_and_the_main_container_of_one_claim_each_have_its_whole_quota_in_turn() -> Result<()> {
    let mut node = Node::new("dra-init")?;
    let shared = node.claim("shared", "6b1f3d5a-1b3f-4e5d-9a6b-0c1d2e3f4d01", "4Gi")?;
    let pod = node.containerd.pod(shared.name, NAMESPACE, "uid-shared", &[])?;
    let spec = |name: &str| -> Result<ContainerSpec> {
        let mut spec = ContainerSpec::new(name).fake_driver(&node.fake)?;
        for device in &shared.cdi_devices {
            spec = spec.cdi_device(device);
        }
        Ok(spec)
    };
    // The init container: a context and 3 GiB of the 4, then it ends.
    let init = spec("init")?.command([e2e::containerd::workload_path().as_str(), "ctx 0", "alloc a 3g", "meminfo"]);
    let init = node.containerd.run_container(&pod, &init).with_context(|| node.agent.log())?;
    wait_for(timeout(), "the init container to end", || Ok(node.containerd.status(&init)?.status.map(|s| s.state) == Some(e2e::containerd::cri::CONTAINER_EXITED)))?;
    ensure!(node.containerd.status(&init)?.status.map(|s| s.exit_code) == Some(0), "the init container's allocations were granted:\n{}", node.agent.log());
    // Its slot reclaimed from the claim's ledger (the agent saw it exit).
    let ledger = node.ledger_dir(shared.uid).join("ledger");
    wait_for(timeout(), "the init container's slot reclaimed", || Ok(ledger_devices(&ledger, "used_bytes")? == [(0, 0)])).with_context(|| node.agent.log())?;
    // The main container: the same 3 GiB again (granted: the init's are gone with it), and
    // past the quota refused.
    let main = node.containerd.run_container(&pod, &spec("main")?).with_context(|| node.agent.log())?;
    let record = provisioned(&node.agent, &main)?.context("main provisioned")?;
    ensure!(record["claim"] == shared.uid && record["quota"] == 4 * GIB, "{record}");
    let lines = dra::node::workload(&node.containerd, &main, &["ctx 0", "alloc a 3g", "expect-oom alloc x 1g", "meminfo"]).with_context(|| node.agent.log())?;
    ensure!(lines.iter().any(|l| l == "oom x") && !lines.iter().any(|l| l == "oom a"), "{lines:?}\n{}", node.agent.log());
    node.fake.cleanup();
    Ok(())
}

/// The claims of issue 38 (several requests, `count`, a request named, NVIDIA's device
/// plugin beside a claim, admin access) on containerd 2.
#[test]
fn claims_of_several_requests_counts_and_admin_access_are_prepared_and_held_or_refused_with_why_on_containerd_2() -> Result<()> {
    Version::V2.run(claims_of_several_requests_counts_and_admin_access_are_prepared_and_held_or_refused_with_why)
}

/// The init container and the main container of one claim on containerd 2.
#[test]
fn an_init_container_and_the_main_container_of_one_claim_each_have_its_whole_quota_in_turn_on_containerd_2() -> Result<()> {
    Version::V2.run(an_init_container_and_the_main_container_of_one_claim_each_have_its_whole_quota_in_turn)
}
