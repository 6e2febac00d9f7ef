//! The DRA driver's ResourceSlice pool, end to end (issue 25, item 1): the real agent with
//! `--dra`, NVML (the fake's, four GPUs of 80 GiB) and a Kubernetes API server (the tests'
//! own, `kube_api/`, TLS, the service account's files) that serves ResourceSlices as the real
//! one does (list and watch with field selectors, create, update, delete, validated).
//!
//! Shown: the pool is published (one slice on the node, one device per GPU, the wire body in
//! resource.k8s.io/v1's field names: `spec.driver`, `spec.nodeName`, `spec.pool.generation`,
//! `devices[].allowMultipleAllocations`, `devices[].capacity.memory.value`, its
//! `requestPolicy.validRange`); an agent restarted publishes again with a higher generation,
//! updating its slice in place and deleting a stale one of an earlier pool, never touching
//! another driver's or another node's slices; an unchanged pool is left alone; a GPU removed
//! from the bus (NVML no longer counts it) is gone from the pool, with the generation bumped;
//! slices the kubelet deletes
//! (it does at its start) are published again, also after a spell of API failures. With
//! `--dra` the node's `vramguard.io/gpu-memory` is not advertised even with `--gpu-memory`, and
//! the capacity an agent without `--dra` left in the node's status is removed. On a node
//! without NVML, `--gpu-memory` is the inventory, and the devices say so.
//!
//! Where the API server's `DRAConsumableCapacity` gate is off (1.34, 1.35), the agent reads in
//! the server's answer that it dropped the shared form (a dry run of the shared form tells it,
//! before any write), publishes each GPU whole once (one write in all: the slice's create,
//! none at the checks after), says so in the audit and its metrics, and
//! prepares a claim the scheduler gave a GPU whole (no `consumedCapacity`) as that GPU's
//! published capacity.
//!
//! Needs root and the built binaries (no containerd: the agent's NRI side waits for one).
use std::{
    ffi::{OsStr, OsString},
    path::Path,
};

use anyhow::{ensure, Context, Result};
use e2e::{agent::Agent, http, timeout, wait_for, FakeNode, TempDir, GIB};
use serde_json::{json, Value};

mod allocator;
mod dra;
mod kube_api;

use dra::kubelet::{self, Kubelet};
use kube_api::{resource, ApiServer, Mode, NODE};

const DRIVER: &str = "gpu.vramguard.io";

/// The agent with `--dra` on the fake's GPUs (`--gpu-memory` four of 80 GiB), reaching `api`
/// as a pod does.
fn agent(api: &ApiServer, fake: &FakeNode, dir: &Path, account: &Path) -> Result<Agent> {
    agent_with(api, fake, dir, account, "80g,80g,80g,80g")
}

fn agent_with(api: &ApiServer, fake: &FakeNode, dir: &Path, account: &Path, gpu_memory: &str) -> Result<Agent> {
    // --gpu-memory, the extended resource's sizing: not advertised with --dra.
    let mut args = e2e::agent::kube_node_args(dir, gpu_memory)?;
    args.extend(["--dra", "--dra-slices-every-s", "1"].map(OsString::from));
    let mut env: Vec<(OsString, OsString)> = fake.env().to_vec();
    env.extend(api.pod_env(account));
    let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
    Agent::start_with_env(&args, &env)
}

/// This driver's slices on the node.
fn pool(api: &ApiServer) -> Vec<Value> {
    api.with(|s| s.resource.slices.values().filter(|v| v["spec"]["driver"] == DRIVER && v["spec"]["nodeName"] == NODE).cloned().collect())
}

/// The pool's generation and its devices' names, when it is one slice.
fn published(api: &ApiServer) -> Option<(i64, Vec<String>)> {
    let pool = pool(api);
    let [slice] = pool.as_slice() else { return None };
    let devices = slice["spec"]["devices"].as_array()?.iter().filter_map(|d| d["name"].as_str().map(str::to_owned)).collect();
    Some((slice["spec"]["pool"]["generation"].as_i64()?, devices))
}

fn gpus(n: u32) -> Vec<String> {
    (0..n).map(|i| format!("gpu-{i}")).collect()
}

/// Someone else's slice, which the agent must leave alone.
fn foreign(name: &str, driver: &str, node: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name, "resourceVersion": "5"},
        "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 9, "resourceSliceCount": 1}, "devices": [{"name": "gpu-0"}]}
    })
}

#[test]
fn the_pool_is_published_republished_with_a_higher_generation_and_follows_the_gpus() -> Result<()> {
    let api = ApiServer::start()?;
    let dir = TempDir::new("dra-slices")?;
    let account = dir.path().join("serviceaccount");
    api.service_account(&account)?;
    std::fs::create_dir_all(dir.path().join("ledgers"))?;
    let fake = FakeNode::new("dra-slices").with_env("FAKECUDA_DEVICE_COUNT", "4").with_env("FAKECUDA_DEVICE_BYTES", "80g");
    // An agent without --dra advertised the node-wide resource before.
    api.with(|s| s.node["status"]["capacity"][kube_api::RESOURCE] = json!((320 * GIB).to_string()));
    api.with(|s| {
        for (name, driver, node) in [("other-driver", "gpu.nvidia.com", NODE), ("other-node", DRIVER, "gpu-node-8")] {
            s.resource.slices.insert(name.into(), foreign(name, driver, node));
        }
    });

    // Published: one slice, four devices.
    let first = agent(&api, &fake, dir.path(), &account)?;
    wait_for(timeout(), "the pool published with four GPUs", || Ok(published(&api).is_some_and(|(_, d)| d == gpus(4))))
        .with_context(|| first.log())?;
    let (generation, _) = published(&api).context("the pool")?;
    ensure!(generation >= 1, "{generation}");

    // The wire: the list with both field selectors, the create's body in v1's names.
    let seen = api.seen();
    let list = seen.iter().find(|r| r.method == "GET" && r.target.starts_with("/apis/resource.k8s.io/v1/resourceslices?")).context("no list")?;
    ensure!(list.target.contains(&format!("spec.nodeName%3D{NODE}")) && list.target.contains(&format!("spec.driver%3D{DRIVER}")), "{list:?}");
    let create = seen
        .iter()
        .find(|r| r.method == "POST" && r.target.starts_with("/apis/resource.k8s.io/v1/resourceslices") && !r.target.contains("dryRun=All"))
        .context("no create")?;
    // Asked first with a dry run of the shared form (what the API server keeps of it).
    let probe = seen.iter().find(|r| r.method == "POST" && r.target.contains("dryRun=All")).context("no dry run")?;
    ensure!(probe.body.contains("\"allowMultipleAllocations\":true") && probe.body.contains(&format!("{NODE}-{DRIVER}-0-probe")), "{probe:?}");
    let body: Value = serde_json::from_str(&create.body)?;
    ensure!(body["apiVersion"] == "resource.k8s.io/v1" && body["kind"] == "ResourceSlice", "{body}");
    let spec = &body["spec"];
    ensure!(spec["driver"] == DRIVER && spec["nodeName"] == NODE, "{spec}");
    ensure!(spec["pool"]["name"] == NODE && spec["pool"]["generation"] == generation && spec["pool"]["resourceSliceCount"] == 1, "{spec}");
    let devices = spec["devices"].as_array().context("devices")?;
    ensure!(devices.len() == 4, "{spec}");
    for (index, device) in devices.iter().enumerate() {
        ensure!(device["name"] == format!("gpu-{index}"), "{device}");
        ensure!(device["allowMultipleAllocations"] == true, "{device}");
        let attributes = &device["attributes"];
        ensure!(attributes["index"]["int"] == index, "{device}");
        ensure!(attributes["uuid"]["string"].as_str().is_some_and(|u| u.starts_with("GPU-")), "{device}");
        ensure!(attributes["product"]["string"] == "NVIDIA H100 80GB HBM3", "{device}");
        ensure!(attributes["memory"]["int"] == 80 * GIB, "{device}");
        ensure!(attributes["source"]["string"] == "nvml", "{device}");
        let memory = &device["capacity"]["memory"];
        // Quantities are strings of bytes on the wire.
        let bytes = |v: &Value| v.as_str().and_then(|q| q.parse::<u64>().ok());
        // 80 GiB less the default 1 GiB reserve; min 1 GiB, step 256 MiB, the whole GPU by default.
        ensure!(bytes(&memory["value"]) == Some(79 * GIB), "{device}");
        let policy = &memory["requestPolicy"];
        ensure!(bytes(&policy["validRange"]["min"]) == Some(GIB), "{device}");
        ensure!(bytes(&policy["validRange"]["step"]) == Some(256 << 20), "{device}");
        ensure!(bytes(&policy["validRange"]["max"]) == Some(79 * GIB), "{device}");
        ensure!(bytes(&policy["default"]) == Some(79 * GIB), "{device}");
    }
    let metrics = http::fresh_scrape(first.metrics_addr()?)?;
    ensure!(http::metric(&metrics, "vramguard_dra_slice_generation", &[]) == Some(generation as f64), "{metrics:?}");
    ensure!(http::metric(&metrics, "vramguard_dra_devices", &[]) == Some(4.0), "{metrics:?}");
    ensure!(http::metric(&metrics, "vramguard_dra_slice_syncs_total", &[("result", "published")]).is_some_and(|n| n >= 1.0), "{metrics:?}");
    let log = first.stop()?;

    // A stale slice of an earlier pool (say, of more GPUs) is there when the agent restarts.
    let stale = format!("{NODE}-{DRIVER}-1");
    api.with(|s| {
        let mut slice = s.resource.slices.values().find(|v| v["spec"]["driver"] == DRIVER && v["spec"]["nodeName"] == NODE).cloned().unwrap_or_default();
        slice["metadata"]["name"] = json!(stale);
        s.resource.slices.insert(stale.clone(), slice);
    });
    let writes_before = api.seen().len();
    let second = agent(&api, &fake, dir.path(), &account).with_context(|| log.clone())?;
    wait_for(timeout(), "the pool published again with a higher generation, the stale slice gone", || {
        Ok(published(&api).is_some_and(|(g, d)| g > generation && d == gpus(4)))
    })
    .with_context(|| second.log())?;
    let (restarted, _) = published(&api).context("the pool")?;
    let since: Vec<_> = api.seen().into_iter().skip(writes_before).collect();
    ensure!(since.iter().any(|r| r.method == "PUT" && r.target.starts_with(&format!("/apis/resource.k8s.io/v1/resourceslices/{NODE}-{DRIVER}-0"))), "updated in place: {since:?}");
    ensure!(since.iter().any(|r| r.method == "DELETE" && r.target.starts_with(&format!("/apis/resource.k8s.io/v1/resourceslices/{stale}"))), "{since:?}");
    ensure!(!since.iter().any(|r| r.method == "POST" && !r.target.contains("dryRun=All")), "no second slice created: {since:?}");
    ensure!(api.with(|s| s.resource.slices.contains_key("other-driver") && s.resource.slices.contains_key("other-node")), "others' slices untouched");

    // Unchanged, the pool is checked and left alone: no new generation.
    wait_for(timeout(), "three checks that found the pool unchanged", || {
        let metrics = http::fresh_scrape(second.metrics_addr()?)?;
        Ok(http::metric(&metrics, "vramguard_dra_slice_syncs_total", &[("result", "unchanged")]).is_some_and(|n| n >= 3.0))
    })
    .with_context(|| second.log())?;
    ensure!(published(&api).is_some_and(|(g, _)| g == restarted), "a pool left as it was");

    // A GPU removed from the bus: NVML counts three; the pool follows, generation bumped.
    std::fs::remove_file(fake.device_file(3))?;
    wait_for(timeout(), "the pool without gpu-3", || Ok(published(&api).is_some_and(|(g, d)| g > restarted && d == gpus(3))))
        .with_context(|| second.log())?;
    let (removed, _) = published(&api).context("the pool")?;

    // The kubelet deletes the node's slices (at its start): published again.
    api.with(|s| s.resource.slices.retain(|_, v| v["spec"]["driver"] != DRIVER || v["spec"]["nodeName"] != NODE));
    wait_for(timeout(), "the pool published again after the kubelet deleted it", || Ok(published(&api).is_some_and(|(g, d)| g > removed && d == gpus(3))))
        .with_context(|| second.log())?;
    let (again, _) = published(&api).context("the pool")?;

    // The API server fails for a while, the slices deleted meanwhile: retried, published.
    api.set_mode(Mode::Failing);
    api.with(|s| s.resource.slices.retain(|_, v| v["spec"]["driver"] != DRIVER || v["spec"]["nodeName"] != NODE));
    wait_for(timeout(), "a failed sync counted", || {
        let metrics = http::fresh_scrape(second.metrics_addr()?)?;
        Ok(http::metric(&metrics, "vramguard_dra_slice_syncs_total", &[("result", "error")]).is_some_and(|n| n >= 2.0))
    })
    .with_context(|| second.log())?;
    api.set_mode(Mode::Up);
    wait_for(timeout(), "the pool published once the API server answers", || Ok(published(&api).is_some_and(|(g, d)| g > again && d == gpus(3))))
        .with_context(|| second.log())?;

    // With --dra the node-wide extended resource is withdrawn (once) and never advertised.
    let patches: Vec<_> = api.seen().into_iter().filter(|r| r.method == "PATCH").collect();
    ensure!(patches.len() == 1, "one patch of the node's status: {patches:?}");
    ensure!(patches[0].body == r#"[{"op":"remove","path":"/status/capacity/vramguard.io~1gpu-memory"}]"#, "{patches:?}");
    ensure!(api.with(|s| s.node["status"]["capacity"].get(kube_api::RESOURCE).is_none()), "no vramguard.io/gpu-memory capacity");
    ensure!(api.with(|s| s.node["status"]["capacity"]["cpu"] == "16"), "the rest of the capacity untouched");
    let log = second.stop()?;
    ensure!(log.contains("not advertised"), "the agent says why: {log}");
    fake.cleanup();
    Ok(())
}

#[test]
fn without_nvml_the_gpu_memory_flag_is_a_fake_inventory_and_says_so() -> Result<()> {
    let api = ApiServer::start()?;
    let dir = TempDir::new("dra-slices-flag")?;
    let account = dir.path().join("serviceaccount");
    api.service_account(&account)?;
    std::fs::create_dir_all(dir.path().join("ledgers"))?;
    // A node without the driver: NVML's init answers NVML_ERROR_DRIVER_NOT_LOADED.
    let fake = FakeNode::new("dra-slices-flag").with_env("FAKECUDA_NVML", "absent");
    let agent = agent_with(&api, &fake, dir.path(), &account, "16Gi,24Gi")?;
    wait_for(timeout(), "the pool published from --gpu-memory", || Ok(published(&api).is_some_and(|(_, d)| d == gpus(2))))
        .with_context(|| agent.log())?;
    let pool = pool(&api);
    let devices = pool[0]["spec"]["devices"].as_array().context("devices")?;
    for (device, memory) in devices.iter().zip([16 * GIB, 24 * GIB]) {
        let attributes = &device["attributes"];
        ensure!(attributes["source"]["string"] == "gpu-memory" && attributes["product"]["string"] == "unknown", "{device}");
        ensure!(attributes.get("uuid").is_none(), "no UUID to give: {device}");
        ensure!(attributes["memory"]["int"] == memory, "{device}");
        ensure!(device["capacity"]["memory"]["value"].as_str() == Some(&*(memory - GIB).to_string()), "{device}");
    }
    drop(agent);
    fake.cleanup();
    Ok(())
}

/// A node of two 80 GiB GPUs whose API server has `DRAConsumableCapacity` off, with the
/// kubelet's directories for the plugin.
struct GateOff {
    api: ApiServer,
    dir: TempDir,
    account: std::path::PathBuf,
    fake: FakeNode,
    /// The runtime whose NRI the agent connects to (it prepares nothing without).
    _runtime: e2e::containerd::Containerd,
}

impl GateOff {
    fn new(tag: &str) -> Result<GateOff> {
        let api = ApiServer::start()?;
        api.set_consumable_capacity(false);
        let dir = TempDir::new(tag)?;
        let account = dir.path().join("serviceaccount");
        api.service_account(&account)?;
        std::fs::create_dir_all(dir.path().join("ledgers"))?;
        let fake = FakeNode::new(tag).with_env("FAKECUDA_DEVICE_COUNT", "2").with_env("FAKECUDA_DEVICE_BYTES", "80g");
        let runtime = e2e::containerd::Containerd::start(&dir.path().join("nri.sock"))?;
        Ok(GateOff { api, dir, account, fake, _runtime: runtime })
    }

    /// The agent with `--dra`, its slices checked each second.
    fn agent(&self) -> Result<Agent> {
        let mut args = e2e::agent::kube_node_args(self.dir.path(), "80g")?;
        for (flag, sub) in [("--kubelet-registry-dir", "registry"), ("--kubelet-plugins-dir", "plugins"), ("--cdi-dir", "cdi")] {
            args.extend([OsString::from(flag), self.dir.path().join(sub).into()]);
        }
        args.extend(["--dra", "--dra-slices-every-s", "1"].map(OsString::from));
        let mut env: Vec<(OsString, OsString)> = self.fake.env().to_vec();
        env.extend(self.api.pod_env(&self.account));
        let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
        let agent = Agent::start_with_env(&args, &env)?;
        wait_for(timeout(), "the agent connected to the runtime's NRI", || Ok(agent.audit()?["nri_connected"] == true)).with_context(|| agent.log())?;
        Ok(agent)
    }
}

/// The agent's writes of ResourceSlices (creates and updates; not its dry runs) the API
/// server received.
fn slice_writes(api: &ApiServer) -> usize {
    api.seen()
        .iter()
        .filter(|r| matches!(r.method.as_str(), "POST" | "PUT") && r.target.starts_with("/apis/resource.k8s.io/v1/resourceslices") && !r.target.contains("dryRun=All"))
        .count()
}

#[test]
fn with_the_consumable_capacity_gate_off_each_gpu_is_published_whole_once_and_a_claim_gets_it_whole() -> Result<()> {
    let scene = GateOff::new("dra-slices-gate-off")?;
    let (api, dir, fake) = (&scene.api, &scene.dir, &scene.fake);
    let agent = scene.agent()?;
    let whole = |api: &ApiServer| {
        pool(api).iter().flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default()).filter(|d| d.get("allowMultipleAllocations").is_none()).count()
    };
    wait_for(timeout(), "the pool published whole", || Ok(whole(api) == 2 && agent.audit()?["dra"]["sharing"] == "whole")).with_context(|| agent.log())?;
    // Five checks later: no write but the whole form's create.
    std::thread::sleep(std::time::Duration::from_secs(5));
    ensure!(slice_writes(api) == 1, "one create, whole (the dry run told the form), then none: {}\n{}", slice_writes(api), agent.log());
    let checks = http::metric(&http::scrape(agent.metrics_addr()?)?, "vramguard_dra_slice_syncs_total", &[("result", "unchanged")]).unwrap_or(0.0);
    ensure!(checks >= 3.0, "the checks ran and found the pool as published: {checks}");
    let samples = http::scrape(agent.metrics_addr()?)?;
    ensure!(http::metric(&samples, "vramguard_dra_sharing", &[("form", "whole")]) == Some(1.0), "the metric says whole");
    ensure!(http::metric(&samples, "vramguard_dra_sharing", &[("form", "shared")]) == Some(0.0), "and not shared");
    let audit = agent.audit()?;
    ensure!(audit["dra"]["gpus"] == json!([[0, 79 * GIB], [1, 79 * GIB]]), "{}", audit["dra"]);
    let table = std::process::Command::new(e2e::agent::agent_bin()?).args(["audit", "--socket"]).arg(agent.socket()).output()?;
    let table = String::from_utf8_lossy(&table.stdout);
    ensure!(table.contains("whole: each GPU goes to one claim") && table.contains("DRAConsumableCapacity is off"), "{table}");

    // The scheduler (gate off) gives a claim GPU 0 whole; the API server dropped the
    // claim's capacity request and its result has no consumedCapacity, no shareID.
    let mut scheduler = allocator::Allocator::new(&pool(api))?;
    ensure!(scheduler.devices.iter().all(|d| !d.shared), "{:?}", scheduler.devices);
    let uid = "3f2e1d0c-0000-4000-8000-00000000aa01";
    let mut asked = resource::claim("team-a", "whole", uid, "8Gi", None);
    resource::drop_gated(&mut asked);
    let allocated = scheduler.allocate(&asked, &json!({"resource": "pods", "name": "p", "uid": "p"}))?.map_err(|r| anyhow::anyhow!("{r:?}"))?;
    api.put_claim(allocated.clone());
    let result = &allocated["status"]["allocation"]["devices"]["results"][0];
    ensure!(result.get("consumedCapacity").is_none() && result.get("shareID").is_none() && result["device"] == "gpu-0", "{result}");
    let second = resource::claim("team-a", "next", "3f2e1d0c-0000-4000-8000-00000000aa02", "1Gi", None);
    let placed = scheduler.allocate(&second, &json!({}))?.map_err(|r| anyhow::anyhow!("{r:?}"))?;
    ensure!(placed["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1", "GPU 0 is taken whole: {placed}");
    let kubelet = Kubelet::new(&dir.path().join("registry"))?;
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
    let answer = kubelet.prepare(&plugin, vec![kubelet::claim("team-a", "whole", uid)])?;
    let prepared = &answer.claims[uid];
    ensure!(prepared.error.is_empty() && prepared.devices.len() == 1 && prepared.devices[0].share_id.is_none(), "{prepared:?}\n{}", agent.log());
    let checkpoint: Value = serde_json::from_slice(&std::fs::read(dir.path().join("state/dra/checkpoint.json"))?)?;
    ensure!(checkpoint["claims"][uid]["shares"][0]["memory"] == 79 * GIB, "the GPU's whole published capacity: {checkpoint}");
    drop(agent);
    fake.cleanup();
    Ok(())
}

/// Whether each GPU of the pool is published shared (`allowMultipleAllocations`), by name.
fn shared_by_gpu(api: &ApiServer) -> Vec<(String, bool)> {
    let mut out: Vec<(String, bool)> = pool(api)
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .map(|d| (d["name"].as_str().unwrap_or_default().to_owned(), d["allowMultipleAllocations"] == true))
        .collect();
    out.sort();
    out
}

#[test]
fn a_gpu_a_claim_holds_whole_stays_whole_after_the_gate_is_turned_on_until_the_claim_is_unprepared() -> Result<()> {
    let scene = GateOff::new("dra-slices-gate-on")?;
    let (api, dir, fake) = (&scene.api, &scene.dir, &scene.fake);
    let start = || scene.agent();
    let kubelet = Kubelet::new(&dir.path().join("registry"))?;

    // Gate off: a claim gets GPU 0 whole.
    let agent = start()?;
    wait_for(timeout(), "the pool published whole", || Ok(shared_by_gpu(api) == [("gpu-0".into(), false), ("gpu-1".into(), false)])).with_context(|| agent.log())?;
    let mut scheduler = allocator::Allocator::new(&pool(api))?;
    let whole_uid = "3f2e1d0c-0000-4000-8000-00000000bb01";
    let mut asked = resource::claim("team-a", "whole", whole_uid, "8Gi", None);
    resource::drop_gated(&mut asked);
    let allocated = scheduler.allocate(&asked, &json!({}))?.map_err(|r| anyhow::anyhow!("{r:?}"))?;
    ensure!(allocated["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0", "{allocated}");
    api.put_claim(allocated);
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
    ensure!(kubelet.prepare(&plugin, vec![kubelet::claim("team-a", "whole", whole_uid)])?.claims[whole_uid].error.is_empty(), "{}", agent.log());
    agent.stop()?;

    // The gate turned on, the agents restarted: GPU 1 is shared, GPU 0 stays whole while the
    // claim holds it (the scheduler would place shares on it beside the dedicated claim).
    api.set_consumable_capacity(true);
    let agent = start()?;
    wait_for(timeout(), "GPU 1 shared, GPU 0 whole", || Ok(shared_by_gpu(api) == [("gpu-0".into(), false), ("gpu-1".into(), true)])).with_context(|| agent.log())?;
    ensure!(agent.audit()?["dra"]["sharing"] == "shared", "{}", agent.audit()?["dra"]);
    scheduler.refresh(&pool(api))?;
    let shared_uid = "3f2e1d0c-0000-4000-8000-00000000bb02";
    let allocated = scheduler.allocate(&resource::claim("team-a", "shared", shared_uid, "8Gi", None), &json!({}))?.map_err(|r| anyhow::anyhow!("{r:?}"))?;
    ensure!(allocated["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1", "not beside the whole claim: {allocated}");
    api.put_claim(allocated);
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
    let answer = kubelet.prepare(&plugin, vec![kubelet::claim("team-a", "shared", shared_uid)])?;
    ensure!(answer.claims[shared_uid].error.is_empty(), "{answer:?}\n{}", agent.log());

    // The whole claim unprepared: GPU 0 is shared again.
    ensure!(kubelet.unprepare(&plugin, vec![kubelet::claim("team-a", "whole", whole_uid)])?.claims[whole_uid].error.is_empty(), "unprepared");
    scheduler.release(whole_uid);
    wait_for(timeout(), "both GPUs shared", || Ok(shared_by_gpu(api) == [("gpu-0".into(), true), ("gpu-1".into(), true)])).with_context(|| agent.log())?;
    // The gate turned off again, the agent running: the next check publishes both whole.
    api.set_consumable_capacity(false);
    wait_for(timeout(), "both GPUs whole again", || Ok(shared_by_gpu(api) == [("gpu-0".into(), false), ("gpu-1".into(), false)] && agent.audit()?["dra"]["sharing"] == "whole"))
        .with_context(|| agent.log())?;
    agent.stop()?;
    fake.cleanup();
    Ok(())
}
