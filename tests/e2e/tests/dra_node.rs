//! The DRA driver as operators run it (issue 38, Must show 1 and 2): the agent started with the
//! arguments of the DaemonSet in `deploy/install/vramguard-dra.yaml` (the DRA install file:
//! `deploy/kubernetes/daemonset.yaml` with `deploy/dra/patch/daemonset.json` applied), on a
//! fake node of 8 GPUs of 80 GiB beside a real containerd.
//!
//! Only what must be redirected is: each path argument is followed through the pod's
//! `volumeMounts` to its volume's host path, and each host path of the node to the test's
//! stand-in for it ([`HostPaths`]); the agent's defaults the manifest relies on (the kubelet's
//! directories, the CDI directory, where the host's device nodes are) are followed the same
//! way and passed. A path the manifest does not mount cannot be followed and fails the test.
//! Ports become free loopback ports, and the host's mount namespace the test's (containerd's).
//! The driver's libraries are found by the agent under the host's root (`--host-root`), where
//! the test installed the fake driver as Debian does; no `--gpu-memory`: NVML lists the
//! node's 8 GPUs.
//!
//! Shown:
//! * the published pool is NVML's 8 GPUs (each an H100's 81559 MiB less the default 1 GiB
//!   reserve), owned by the Node; the health lists the
//!   same 8;
//! * a claim on each of the 8 GPUs, allocated by the tests' scheduler from that pool, is
//!   prepared, and its container, made through CRI with the plugin's CDI devices, is
//!   provisioned on that GPU and held to its claim's memory (an allocation past it refused);
//! * the control nodes in the specs are the host's (`--dra-host-dev`, the host's `/dev`
//!   mounted read-only), though the agent's own view lacks `nvidia-uvm`;
//! * a reboot: the agent stopped, the CDI directory emptied (a tmpfs), the checkpoint kept;
//!   the new agent writes every checkpointed claim's spec before it serves, a repeated
//!   prepare answers the same devices, and a container made from them after the reboot starts
//!   and is held to its claim.
//!
//! Runs alone: the agent runs with the shipped arguments, which discover libcuda on the whole
//! node (no --no-discover).
use std::{
    ffi::{OsStr, OsString},
    path::{Path, PathBuf},
};

use agent::dra::cdi;
use anyhow::{bail, ensure, Context, Result};
use e2e::{
    agent::Agent,
    containerd::{ContainerId, ContainerSpec, Containerd},
    timeout, wait_for, FakeNode, TempDir, GIB, MIB,
};
use serde_json::{json, Value};

mod allocator;
mod dra;
mod kube_api;

use allocator::Allocator;
use dra::{
    kubelet::{self, Kubelet},
    node::{ledger_devices, provisioned, stand_in_gpu_node, stand_in_node},
};
use kube_api::{resource, ApiServer, NODE};

const DRIVER: &str = "gpu.vramguard.io";
const NAMESPACE: &str = "team-a";
const GPUS: u32 = 8;
/// NVML's total memory of an H100 80GB HBM3, in MiB.
const H100_MIB: u64 = 81559;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The pod spec of the DaemonSet the DRA install file ships (`deploy/install/vramguard-dra.yaml`:
/// `cargo xtask install-files` applied the DRA patch to `deploy/kubernetes/daemonset.yaml`).
fn shipped_pod_spec() -> Result<Value> {
    let text = std::fs::read_to_string(root().join("deploy/install/vramguard-dra.yaml"))?;
    let mut daemonset = None;
    for document in text.split("\n---\n") {
        let value: Value = serde_yaml::from_str(document).context("vramguard-dra.yaml")?;
        if value["kind"] == "DaemonSet" {
            ensure!(daemonset.is_none(), "two DaemonSets in vramguard-dra.yaml");
            daemonset = Some(value);
        }
    }
    let daemonset = daemonset.context("no DaemonSet in vramguard-dra.yaml")?;
    Ok(daemonset["spec"]["template"]["spec"].clone())
}

/// The node's host paths the manifest names, and the test's stand-in for each.
struct HostPaths(Vec<(&'static str, PathBuf)>);

impl HostPaths {
    /// Where the host path `path` is here.
    fn host(&self, path: &str) -> Result<PathBuf> {
        for (host, here) in &self.0 {
            if let Some(rest) = path.strip_prefix(host).filter(|rest| rest.is_empty() || rest.starts_with('/')) {
                return Ok(here.join(rest.trim_start_matches('/')));
            }
        }
        bail!("the host path {path} has no stand-in in this test")
    }
}

/// Where the container path `path` of the agent container is on the host: through the
/// `volumeMounts` of `container` to its volume's `hostPath`.
fn host_path_of(pod: &Value, container: &Value, path: &str) -> Result<String> {
    let mounts = container["volumeMounts"].as_array().context("no volumeMounts")?;
    let (mount, rest) = mounts
        .iter()
        .filter_map(|m| {
            let at = m["mountPath"].as_str()?;
            let rest = path.strip_prefix(at).filter(|rest| rest.is_empty() || rest.starts_with('/'))?;
            Some((m, rest))
        })
        .max_by_key(|(m, _)| m["mountPath"].as_str().map_or(0, str::len))
        .with_context(|| format!("{path} is on no volume the agent container mounts"))?;
    let name = mount["name"].as_str().context("a mount without a name")?;
    let volume = pod["volumes"].as_array().into_iter().flatten().find(|v| v["name"] == name).with_context(|| format!("no volume {name}"))?;
    let host = volume["hostPath"]["path"].as_str().with_context(|| format!("volume {name} is not a hostPath: {volume}"))?;
    Ok(format!("{host}{rest}"))
}

/// The agent's arguments as shipped, redirected (see the module doc), and its environment.
/// An environment variable.
type Var = (OsString, OsString);

fn shipped_agent(pod: &Value, hosts: &HostPaths, limits: &Path) -> Result<(Vec<OsString>, Vec<Var>)> {
    let container = pod["containers"].as_array().and_then(|c| c.iter().find(|c| c["name"] == "agent")).context("no agent container")?;
    let args: Vec<&str> = container["args"].as_array().context("no args")?.iter().filter_map(Value::as_str).collect();
    ensure!(args.first() == Some(&"run"), "the agent runs `vramguard run`: {args:?}");
    let through = |path: &str| -> Result<OsString> { Ok(hosts.host(&host_path_of(pod, container, path)?)?.into()) };
    let mut out: Vec<OsString> = Vec::new();
    for arg in &args[1..] {
        let (flag, value) = arg.split_once('=').map_or((*arg, None), |(f, v)| (f, Some(v)));
        let redirected = match (flag, value) {
            ("--metrics-addr" | "--health-addr", Some(_)) => Some(OsString::from("127.0.0.1:0")),
            // The test's mount namespace is its containerd's host.
            ("--ledger-mount-namespace", Some(_)) => Some(OsString::from("/proc/self/ns/mnt")),
            // A ConfigMap, not a hostPath: its data written to a file of the test's.
            ("--limits", Some(_)) => Some(limits.into()),
            (_, Some(value)) if value.starts_with('/') => Some(through(value)?),
            _ => None,
        };
        match redirected {
            Some(value) => {
                let mut pair = OsString::from(format!("{flag}="));
                pair.push(value);
                out.push(pair);
            }
            None => out.push(arg.into()),
        }
    }
    // The defaults the manifest relies on: container paths through its mounts, and where the
    // device nodes are on the host.
    for (flag, default) in [("--kubelet-registry-dir", "/var/lib/kubelet/plugins_registry"), ("--cdi-dir", "/var/run/cdi")] {
        ensure!(!args.iter().any(|a| a.starts_with(flag)), "{flag} is set in the manifest: follow it instead");
        let mut pair = OsString::from(format!("{flag}="));
        pair.push(through(default)?);
        out.push(pair);
    }
    // The kubelet's plugins directory: the manifest mounts the driver's own subdirectory.
    let plugin = PathBuf::from(through(&format!("/var/lib/kubelet/plugins/{DRIVER}"))?);
    out.push(OsString::from("--kubelet-plugins-dir"));
    out.push(plugin.parent().context("the plugin directory's parent")?.into());
    out.push(OsString::from("--dra-device-dir"));
    out.push(hosts.host("/dev")?.into());
    let mut env: Vec<Var> = Vec::new();
    for var in container["env"].as_array().into_iter().flatten() {
        if let (Some(name), Some(value)) = (var["name"].as_str(), var["value"].as_str()) {
            env.push((name.into(), value.into()));
        }
    }
    Ok((out, env))
}

/// The node: containerd, the API server, the fake driver of 8 GPUs, the host's stand-ins.
struct Node {
    dir: TempDir,
    api: ApiServer,
    account: PathBuf,
    fake: FakeNode,
    containerd: Containerd,
    pod: Value,
    hosts: HostPaths,
}

impl Node {
    fn new(tag: &str) -> Result<Node> {
        let api = ApiServer::start()?;
        let dir = TempDir::new(tag)?;
        let account = dir.path().join("serviceaccount");
        api.service_account(&account)?;
        let path = |sub: &str| dir.path().join(sub);
        for sub in ["host-dev", "state/lib", "state/ledgers", "kubelet/plugins_registry", "kubelet/plugins", "nri"] {
            std::fs::create_dir_all(path(sub))?;
        }
        // The host's /dev: the GPUs' nodes and the driver's control nodes, nvidia-uvm among
        // them (the agent's own /dev, here the machine's, has none).
        for n in 0..GPUS {
            stand_in_gpu_node(&path("host-dev"), n)?;
        }
        for name in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"] {
            stand_in_node(&path("host-dev"), name)?;
        }
        ensure!(!Path::new("/dev/nvidia-uvm").exists(), "this machine has nvidia-uvm: the test needs a /dev without it");
        // 8 GPUs for the agent's NVML, each with what NVML says of an H100 80GB (81559 MiB);
        // a container sees the one it is given.
        let fake = FakeNode::new(tag).with_env("FAKECUDA_DEVICE_BYTES", format!("{H100_MIB}m")).with_env("FAKECUDA_CONTEXT_BYTES", "518m");
        let containerd = Containerd::start(&path("nri/nri.sock"))?;
        // The host's root holds the driver where Debian installs it: the agent finds it there.
        e2e::install_fake_driver(&path("host-root"), "usr/lib/x86_64-linux-gnu")?;
        let hosts = HostPaths(vec![
            ("/var/lib/vramguard", path("state")),
            ("/var/run/nri", path("nri")),
            ("/var/run/cdi", containerd.cdi_dir()),
            ("/var/lib/kubelet", path("kubelet")),
            ("/dev", path("host-dev")),
            // Only `/` itself: every other host path has its own stand-in above.
            ("/", path("host-root")),
        ]);
        // The initContainer's work: the hook where provisioned containers get it from.
        std::fs::copy(e2e::hook_lib()?, path("state/lib/libvramguard.so"))?;
        Ok(Node { pod: shipped_pod_spec()?, dir, api, account, fake, containerd, hosts })
    }

    fn path(&self, sub: &str) -> PathBuf {
        self.dir.path().join(sub)
    }

    /// The agent, as shipped.
    fn agent(&self) -> Result<Agent> {
        let limits = self.path("limits");
        let configmap: Value = serde_yaml::from_str(&std::fs::read_to_string(root().join("deploy/kubernetes/configmap.yaml"))?)?;
        std::fs::write(&limits, configmap["data"]["limits"].as_str().context("the ConfigMap's limits")?)?;
        let (args, mut env) = shipped_agent(&self.pod, &self.hosts, &limits)?;
        env.extend(self.api.pod_env(&self.account));
        env.extend(self.fake.env().iter().cloned());
        env.push(("FAKECUDA_DEVICE_COUNT".into(), GPUS.to_string().into()));
        eprintln!("the agent's arguments: {args:?}");
        let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
        let agent = Agent::start_with_env(&args, &env)?;
        wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true)).with_context(|| agent.log())?;
        Ok(agent)
    }

    fn published(&self) -> Vec<Value> {
        self.api.with(|state| state.resource.slices.values().cloned().collect())
    }
}

/// A claim of `memory` allocated by the scheduler, put in the API server.
fn allocate(node: &Node, scheduler: &mut Allocator, name: &str, uid: &str, memory: &str) -> Result<Value> {
    let claim = resource::claim(NAMESPACE, name, uid, memory, None);
    let consumer = json!({"resource": "pods", "name": name, "uid": format!("uid-{name}")});
    let allocated = scheduler.allocate(&claim, &consumer)?.map_err(|refused| anyhow::anyhow!("{name}: {refused:?}"))?;
    node.api.put_claim(allocated.clone());
    Ok(allocated)
}

/// Runs a container of `name` with `devices` and checks it is provisioned on `gpu` and held
/// to `memory` there.
fn run_held(node: &Node, agent: &Agent, name: &str, uid: &str, devices: &[String], gpu: u32, memory: u64) -> Result<ContainerId> {
    let pod = node.containerd.pod(name, NAMESPACE, &format!("uid-{name}"), &[])?;
    let mut spec = ContainerSpec::new("main").fake_driver(&node.fake)?;
    for device in devices {
        spec = spec.cdi_device(device);
    }
    let id = node.containerd.run_container(&pod, &spec).with_context(|| agent.log())?;
    let record = provisioned(agent, &id)?.with_context(|| format!("{name} not provisioned:\n{}", agent.log()))?;
    ensure!(record["claim"] == uid && record["gpus"] == json!([gpu]) && record["quota"] == memory, "{name}: {record}");
    let ledger = node.path(&format!("state/ledgers/dra-{uid}/ledger"));
    ensure!(ledger_devices(&ledger, "limit_bytes")? == [(0, memory)], "{name}: the ledger's one device");
    let over = format!("{}m", memory / (1 << 20));
    let lines = dra::node::workload(&node.containerd, &id, &["ctx 0", "alloc a 1g", &format!("expect-oom alloc x {over}"), "meminfo"]).with_context(|| agent.log())?;
    ensure!(lines.iter().any(|l| l == "oom x") && !lines.iter().any(|l| l.starts_with("oom ") && l != "oom x"), "{name}: {lines:?}");
    ensure!(lines.iter().any(|l| l.contains(&format!("total={memory}"))), "{name}: the GPU's memory is the claim's: {lines:?}");
    Ok(id)
}

#[test]
fn the_shipped_daemonset_prepares_and_enforces_claims_on_each_of_eight_gpus_and_survives_a_reboot() -> Result<()> {
    let node = Node::new("dra-node")?;
    let agent = node.agent()?;
    let kubelet = Kubelet::new(&node.path("kubelet/plugins_registry"))?;
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;

    // The pool is NVML's 8 GPUs, owned by the Node.
    wait_for(timeout(), "the pool of 8 GPUs", || Ok(node.published().iter().map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len)).sum::<usize>() == GPUS as usize))
        .with_context(|| agent.log())?;
    let slices = node.published();
    let node_uid = node.api.with(|s| s.node["metadata"]["uid"].clone());
    for slice in &slices {
        let owner = &slice["metadata"]["ownerReferences"][0];
        ensure!(owner["kind"] == "Node" && owner["name"] == NODE && owner["uid"] == node_uid && owner["apiVersion"] == "v1", "owned by the Node: {slice}");
    }
    let mut scheduler = Allocator::new(&slices)?;
    ensure!(scheduler.devices.iter().all(|d| d.capacity == H100_MIB * MIB - GIB), "NVML's memory less the 1 GiB reserve: {:?}", scheduler.devices);
    // The driver's libraries, found under the host's root where Debian installs them.
    let audit = agent.audit()?;
    let library = audit["driver"]["library"].as_str().unwrap_or_default().to_string();
    ensure!(library.ends_with(&format!("host-root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{}", e2e::INSTALLED_VERSION)), "NVML from the host's root: {}", audit["driver"]);
    ensure!(audit["driver"]["install"].as_str().is_some_and(|found| found.contains("(Debian and Ubuntu)")), "{}", audit["driver"]);
    let mut health = kubelet.watch_health(&plugin)?;
    let healthy = kubelet.health_until(&mut health, timeout(), |m| m.devices.len() == GPUS as usize).with_context(|| agent.log())?;
    let listed: Vec<String> = healthy.devices.iter().filter_map(|d| d.device.as_ref()).map(|d| d.device_name.clone()).collect();
    ensure!(listed == (0..GPUS).map(|n| format!("gpu-{n}")).collect::<Vec<_>>(), "the health lists the pool's GPUs: {listed:?}");
    drop(health);

    // A claim on each GPU: 70 GiB, so that no two fit on one.
    let mut claims = Vec::new();
    for n in 0..GPUS {
        let (name, uid) = (format!("train-{n}"), format!("7d3c1b2a-0000-4000-8000-00000000000{n}"));
        let allocated = allocate(&node, &mut scheduler, &name, &uid, "70Gi")?;
        let result = &allocated["status"]["allocation"]["devices"]["results"][0];
        ensure!(result["device"] == format!("gpu-{n}"), "{name} on GPU {n}: {result}");
        let answer = kubelet.prepare(&plugin, vec![kubelet::claim(NAMESPACE, &name, &uid)])?;
        let prepared = answer.claims.get(&uid).with_context(|| format!("no answer for {name}"))?;
        ensure!(prepared.error.is_empty(), "{name}: {}\n{}", prepared.error, agent.log());
        let devices: Vec<String> = prepared.devices.iter().flat_map(|d| d.cdi_device_ids.clone()).collect();
        ensure!(devices == [cdi::qualified(&uid, n)], "{name}: {devices:?}");
        claims.push((name, uid, devices, n));
    }
    // The control nodes are the host's, nvidia-uvm among them.
    let spec: Value = serde_json::from_slice(&std::fs::read(cdi::spec_path(&node.containerd.cdi_dir(), &claims[0].1))?)?;
    let controls: Vec<&str> = spec["containerEdits"]["deviceNodes"].as_array().into_iter().flatten().filter_map(|n| n["path"].as_str()).collect();
    ensure!(controls == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"], "the host's control nodes: {spec}");
    ensure!(spec["containerEdits"]["deviceNodes"][1]["hostPath"] == json!(node.path("host-dev/nvidia-uvm")), "{spec}");
    let mut containers = Vec::new();
    for (name, uid, devices, n) in &claims {
        containers.push(run_held(&node, &agent, name, uid, devices, *n, 70 * GIB)?);
    }
    for id in &containers {
        node.containerd.stop_container(id, std::time::Duration::from_secs(1))?;
    }

    // The reboot: the agent gone, /var/run/cdi (a tmpfs) emptied, the checkpoint kept.
    agent.stop()?;
    for entry in std::fs::read_dir(node.containerd.cdi_dir())? {
        std::fs::remove_file(entry?.path())?;
    }
    let agent = node.agent()?;
    for (name, uid, _, _) in &claims {
        ensure!(cdi::spec_path(&node.containerd.cdi_dir(), uid).exists(), "{name}'s spec is written again at start:\n{}", agent.log());
    }
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
    // The kubelet prepares again after the reboot: the same devices.
    let (name, uid, devices, n) = &claims[GPUS as usize - 1];
    std::fs::remove_file(cdi::spec_path(&node.containerd.cdi_dir(), uid))?;
    let answer = kubelet.prepare(&plugin, vec![kubelet::claim(NAMESPACE, name, uid)])?;
    let again = &answer.claims[uid.as_str()];
    ensure!(again.error.is_empty() && again.devices.iter().flat_map(|d| d.cdi_device_ids.clone()).collect::<Vec<_>>() == *devices, "{again:?}");
    ensure!(cdi::spec_path(&node.containerd.cdi_dir(), uid).exists(), "a repeated prepare writes a missing spec before it answers");
    // And a container made from them starts, held to its claim.
    run_held(&node, &agent, &format!("{name}-again"), uid, devices, *n, 70 * GIB)?;
    let log = agent.log();
    ensure!(!log.contains("panicked"), "{log}");
    agent.stop()?;
    node.fake.cleanup();
    Ok(())
}
