//! `vramguard doctor` end to end (issue 40, item 4): the built binary with `--json`, on a
//! node made of files (`--root`: the kernel's files, the host's mount table, containerd's
//! config, a listening NRI socket, the device files as links to `/dev/null`), the fake NVML
//! (`--nvml`, the fake's GPUs through a [`FakeNode`]) and the tests' API server (`--kube`,
//! reached as the DaemonSet's pod reaches it).
//!
//! Shown: a node with everything in place passes (exit 0, no `fail`), the API checks
//! included; a containerd 1.7-style config (`version = 2`, nothing about NRI) with no NRI
//! socket fails `nri` (exit 1) and says how to turn it on; a GPU NVML lists without its
//! device file fails `device-files`, naming the file; an API server with
//! `DRAConsumableCapacity` off warns `dra-gate` with the reason, and NVIDIA's device plugin
//! and DRA driver on the node each warn, with exit 0; a driver before r615 warns
//! `driver-limits`.
//!
//! Needs the built binaries (`vramguard`, the fake driver); no root, no containerd.
use std::{
    collections::BTreeMap,
    ffi::OsString,
    os::unix::net::UnixListener,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{ensure, Context, Result};
use e2e::{agent::agent_bin, FakeNode, TempDir};
use serde_json::{json, Value};

mod kube_api;

use kube_api::{ApiServer, NODE};

/// containerd 2.x's config on a node set up for the agent (NRI and CDI on by default).
const READY_CONFIG: &str = r#"version = 3
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options]
    BinaryName = "/usr/bin/nvidia-container-runtime"
"#;

/// containerd 1.7's config as many nodes have it: version 2, nothing about NRI (off in 1.7).
const CONTAINERD_1_7_CONFIG: &str = r#"version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.9"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
    runtime_type = "io.containerd.runc.v2"
"#;

const UNIFIED_MOUNTS: &str = "25 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
    30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";

/// A node of files under `<dir>/root`, its GPUs the fake's.
struct Node {
    dir: TempDir,
    fake: FakeNode,
    /// containerd's NRI socket, listening while the node lives (where it has one).
    _socket: Option<UnixListener>,
}

impl Node {
    /// A node with `gpus` GPUs (the fake's), containerd's config `config`, an NRI socket if
    /// `nri`, and the device files of `device_files` GPUs.
    fn new(tag: &str, gpus: u32, config: &str, nri: bool, device_files: u32) -> Result<Node> {
        let dir = TempDir::new(tag)?;
        let root = dir.path().join("root");
        let files = [
            ("proc/sys/kernel/osrelease", "6.8.0-45-generic\n"),
            ("proc/1/mountinfo", UNIFIED_MOUNTS),
            ("proc/1/cgroup", "0::/init.scope\n"),
            ("sys/kernel/btf/vmlinux", ""),
            ("sys/bus/event_source/devices/uprobe/type", "7\n"),
            ("sys/kernel/tracing/events/sched/sched_process_exit/format", "name: sched_process_exit\n"),
            ("etc/containerd/config.toml", config),
        ];
        for (path, text) in files {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().context("a parent")?)?;
            std::fs::write(&path, text).with_context(|| path.display().to_string())?;
        }
        let nri_dir = root.join("var/run/nri");
        std::fs::create_dir_all(&nri_dir)?;
        let socket = if nri { Some(UnixListener::bind(nri_dir.join("nri.sock")).context("the NRI socket")?) } else { None };
        let dev = root.join("dev");
        std::fs::create_dir_all(&dev)?;
        let names = (0..device_files).map(|minor| format!("nvidia{minor}")).chain(["nvidiactl".into(), "nvidia-uvm".into()]);
        for name in names {
            std::os::unix::fs::symlink("/dev/null", dev.join(name))?;
        }
        let fake = FakeNode::new(tag).with_env("FAKECUDA_DEVICE_COUNT", gpus.to_string());
        Ok(Node { dir, fake, _socket: socket })
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    /// `vramguard doctor --json --root ROOT --nvml FAKE` and `more`, in the fake node's
    /// environment and `env`: the exit code and each check's line by name.
    fn doctor(&self, more: &[&str], env: &[(OsString, OsString)]) -> Result<(i32, BTreeMap<String, Value>)> {
        let nvml = e2e::fake_driver_dir()?.join("libnvidia-ml.so.1");
        let output = Command::new(agent_bin()?)
            .args(["doctor", "--json", "--root"])
            .arg(self.root())
            .arg("--nvml")
            .arg(nvml)
            .args(more)
            .env_remove("NODE_NAME")
            .envs(self.fake.env().iter().cloned())
            .envs(env.iter().cloned())
            .output()?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let checks: Vec<Value> = serde_json::from_str(&stdout).with_context(|| format!("not JSON: {stdout}\nstderr: {stderr}"))?;
        let by_name = checks.into_iter().map(|c| (c["check"].as_str().unwrap_or_default().to_owned(), c)).collect();
        Ok((output.status.code().unwrap_or(-1), by_name))
    }
}

/// Fails unless the check `name` is there with the status `want` and a detail that says `says`.
fn expect(checks: &BTreeMap<String, Value>, name: &str, want: &str, says: &str) -> Result<()> {
    let check = checks.get(name).cloned().unwrap_or_default();
    ensure!(check["status"] == want && check["detail"].as_str().is_some_and(|d| d.contains(says)), "{name}: not {want} saying {says:?}: {check:#}");
    Ok(())
}

/// The checks that failed.
fn failed(checks: &BTreeMap<String, Value>) -> Vec<&str> {
    checks.iter().filter(|(_, c)| c["status"] == "fail").map(|(name, _)| name.as_str()).collect()
}

/// The tests' API server, its service account's files in `dir`, and the pod's environment.
fn api(dir: &Path) -> Result<(ApiServer, Vec<(OsString, OsString)>)> {
    let api = ApiServer::start()?;
    let account = dir.join("serviceaccount");
    api.service_account(&account)?;
    let env = api.pod_env(&account);
    Ok((api, env))
}

#[test]
fn a_node_with_everything_in_place_passes() -> Result<()> {
    let node = Node::new("doctor-ok", 2, READY_CONFIG, true, 2)?;
    let (_api, env) = api(node.dir.path())?;
    let (code, checks) = node.doctor(&["--kube"], &env)?;
    ensure!(code == 0 && failed(&checks).is_empty(), "exit {code}: {checks:#?}");
    // driver-limits depends on the driver's version and on this machine's cgroup2 mount.
    let host = ["kernel", "btf", "uprobes", "tracefs", "cgroups", "cgroup-namespace", "containerd-config", "nri", "cdi", "nvidia-runtime", "mig"];
    let kube = ["kube-api", "kube-rbac", "device-plugin", "dra-drivers", "dra-gate"];
    for name in host.into_iter().chain(kube) {
        expect(&checks, name, "ok", "")?;
    }
    expect(&checks, "nvml", "ok", "2 GPU(s)")?;
    expect(&checks, "device-files", "ok", "nvidia0, nvidia1, nvidiactl, nvidia-uvm")?;
    for check in checks.values() {
        ensure!(check["docs"].as_str().is_some_and(|d| d.starts_with("docs/operations.md#doctor-")), "{check}");
    }
    Ok(())
}

#[test]
fn a_containerd_1_7_config_without_nri_fails() -> Result<()> {
    let node = Node::new("doctor-nri", 1, CONTAINERD_1_7_CONFIG, false, 1)?;
    let (code, checks) = node.doctor(&[], &[])?;
    ensure!(code == 1 && failed(&checks) == ["nri"], "exit {code}, only nri fails: {checks:#?}");
    expect(&checks, "containerd-config", "ok", "version 2")?;
    expect(&checks, "nri", "fail", "NRI is off")?;
    let fix = checks["nri"]["fix"].as_str().unwrap_or_default();
    ensure!(fix.contains(r#"[plugins."io.containerd.nri.v1.nri"]"#) && fix.contains("disable = false"), "{fix}");
    // CDI is not set in a version 2 config: off in 1.7.
    expect(&checks, "cdi", "warn", "enable_cdi not set")?;
    Ok(())
}

#[test]
fn a_gpu_without_its_device_file_fails() -> Result<()> {
    let node = Node::new("doctor-dev", 2, READY_CONFIG, true, 1)?;
    let (code, checks) = node.doctor(&[], &[])?;
    ensure!(code == 1 && failed(&checks) == ["device-files"], "exit {code}: {checks:#?}");
    expect(&checks, "device-files", "fail", "/dev: nvidia1 (NVML lists GPU(s) with minor numbers 0, 1)")?;
    expect(&checks, "nvml", "ok", "2 GPU(s)")?;
    // The same node given another --dev-dir with both files passes.
    let dev = node.dir.path().join("dev");
    std::fs::create_dir_all(&dev)?;
    for name in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
        std::os::unix::fs::symlink("/dev/null", dev.join(name))?;
    }
    let (code, checks) = node.doctor(&["--dev-dir", &dev.display().to_string()], &[])?;
    ensure!(code == 0, "exit {code}: {checks:#?}");
    expect(&checks, "device-files", "ok", "nvidia0, nvidia1, nvidiactl, nvidia-uvm")?;
    Ok(())
}

#[test]
fn the_gate_off_and_nvidias_plugins_warn_with_the_reason() -> Result<()> {
    let node = Node::new("doctor-gate", 1, READY_CONFIG, true, 1)?;
    let (api, env) = api(node.dir.path())?;
    api.set_consumable_capacity(false);
    api.with(|s| {
        s.node["status"]["allocatable"] = json!({"cpu": "16", "nvidia.com/gpu": "8"});
        let slice = json!({
            "kind": "ResourceSlice", "apiVersion": "resource.k8s.io/v1",
            "metadata": {"name": format!("{NODE}-gpu.nvidia.com-abcde"), "resourceVersion": "50"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}, "devices": [{"name": "gpu-0"}]}
        });
        s.resource.slices.insert(format!("{NODE}-gpu.nvidia.com-abcde"), slice);
    });
    let (code, checks) = node.doctor(&["--kube"], &env)?;
    ensure!(code == 0 && failed(&checks).is_empty(), "warnings only: exit {code}: {checks:#?}");
    expect(&checks, "dra-gate", "warn", "DRAConsumableCapacity off: each GPU goes whole to one claim")?;
    expect(&checks, "device-plugin", "warn", "also published by NVIDIA's device plugin: keep it off DRA nodes")?;
    expect(&checks, "dra-drivers", "warn", "gpu.nvidia.com (1)")?;
    expect(&checks, "kube-api", "ok", NODE)?;
    expect(&checks, "kube-rbac", "ok", "")?;
    // The fake's default driver is 580: no limits of the driver's own.
    expect(&checks, "driver-limits", "warn", "before r615: quotas held by the hook and probes only")?;
    // Nothing was stored by the dry runs.
    ensure!(api.with(|s| s.resource.slices.len()) == 1, "the dry-run create stored nothing");
    let dry: Vec<String> = api.seen().iter().filter(|r| r.method != "GET").map(|r| r.target.clone()).collect();
    ensure!(dry.len() == 2 && dry.iter().all(|t| t.contains("dryRun=All")), "{dry:?}");
    Ok(())
}
