//! The agent's image and its DaemonSet, run as Kubernetes runs them (issue 19, items 1-2):
//! `cargo xtask image`'s OCI archive (`target/vramguard-image.tar`, built by `cargo xtask
//! test` before the e2e tests) is listed and imported into a real containerd, and the agent's
//! pod is made through CRI from the DaemonSet of `deploy/install/vramguard.yaml` itself (the
//! install file, `cargo xtask install-files`' copy of `deploy/kubernetes/daemonset.yaml`
//! and its companions): its containers, command and args, env, securityContext (exactly its capabilities, `readOnlyRootFilesystem`,
//! seccomp, `allowPrivilegeEscalation`), `hostPID` and volumes, the initContainer run to its
//! end first, as the kubelet does.
//!
//! The volumes are the test's directories, seen by containerd at the manifest's host paths:
//! containerd runs in a mount namespace of its own ([`Containerd::start_seeing`]) where the
//! test's `state` and `nri` directories are mounted at `/var/lib/vramguard` and
//! `/var/run/nri`, so the pod's `hostPath`s are the manifest's, and the agent's ledger mounts
//! made "on the host" (`--ledger-mount-namespace`) are made in containerd's namespace and reach
//! the workload's runtime there. What cannot apply here is mapped in one place,
//! [`adapt_arg`] and [`volume_source`], each with its reason.
//!
//! Needs root, the containerd cache and the image (`cargo xtask setup`, `cargo xtask image`).
//!
//! Runs alone: the DaemonSet's agent runs as shipped, discovering libcuda on the whole node (it would probe the other test binaries' fake drivers).
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{anyhow, bail, ensure, Context, Result};
use e2e::{
    containerd::{cri, host_pid_namespaces, workload_path, ContainerId, ContainerSpec, Containerd, PodId, FAKE_STATE_DIR},
    target_dir, timeout, wait_for, FakeNode, TempDir,
};
use serde_json::Value;

mod kube_api;

use kube_api::{api_pod, ApiServer};

/// The quota the test's quota file gives namespace `team-a` (what `--kube` would read from
/// the pod's `vramguard.io/gpu-memory`).
const QUOTA: u64 = 1 << 30;
/// A second process's context in the workload container, past its quota beside the first
/// process's context and 128 MiB.
const PAST_QUOTA: [&str; 1] = ["expect-oom ctx 0"];
/// Where the kubelet mounts a pod's service account (`automountServiceAccountToken`).
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The image archive `cargo xtask image` writes next to the build's profiles.
fn archive() -> Result<PathBuf> {
    let profile = target_dir()?;
    let path = profile.parent().ok_or_else(|| anyhow!("no target directory"))?.join("vramguard-image.tar");
    ensure!(path.is_file(), "{} is missing: run `cargo xtask image` (cargo xtask test does)", path.display());
    Ok(path)
}

/// The install file `deploy/install/vramguard.yaml`, which users apply, as JSON documents
/// (parsed by PyYAML in the project's Python environment, which `cargo xtask setup` installs
/// for the manifests' validator).
fn manifest() -> Result<Vec<Value>> {
    let profile = target_dir()?;
    let python = profile.parent().ok_or_else(|| anyhow!("no target directory"))?.join("pyenv/bin/python");
    let file = root().join("deploy/install/vramguard.yaml");
    let out = Command::new(&python)
        .args(["-c", "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))"])
        .arg(&file)
        .output()
        .with_context(|| format!("cannot run {} (cargo xtask setup installs it)", python.display()))?;
    ensure!(out.status.success(), "cannot parse {}: {}", file.display(), String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The DaemonSet's pod spec.
fn pod_spec() -> Result<Value> {
    let docs = manifest()?;
    let mut daemonsets = docs.iter().filter(|d| d["kind"] == "DaemonSet");
    let daemonset = daemonsets.next().context("no DaemonSet in vramguard.yaml")?;
    ensure!(daemonsets.next().is_none(), "two DaemonSets in vramguard.yaml");
    Ok(daemonset["spec"]["template"]["spec"].clone())
}

// ---- the image archive -------------------------------------------------------------------

/// One entry of a tar archive: name, type flag, link target, contents.
struct TarEntry {
    name: String,
    kind: u8,
    mode: u32,
    link: String,
    data: Vec<u8>,
}

/// The entries of a (ustar) tar archive.
fn tar_entries(bytes: &[u8]) -> Result<Vec<TarEntry>> {
    let text = |b: &[u8]| String::from_utf8_lossy(b.split(|&c| c == 0).next().unwrap_or_default()).into_owned();
    let octal = |b: &[u8]| u64::from_str_radix(text(b).trim(), 8).map_err(|e| anyhow!("bad octal field {:?}: {e}", text(b)));
    let mut out = Vec::new();
    let mut at = 0;
    while at + 512 <= bytes.len() && bytes[at..at + 512].iter().any(|&b| b != 0) {
        let header = &bytes[at..at + 512];
        let size = usize::try_from(octal(&header[124..136])?)?;
        let start = at + 512;
        let data = bytes.get(start..start + size).context("a tar entry runs past the archive's end")?.to_vec();
        out.push(TarEntry {
            name: text(&header[0..100]),
            kind: header[156],
            mode: u32::try_from(octal(&header[100..108])?)?,
            link: text(&header[157..257]),
            data,
        });
        at = start + size.div_ceil(512) * 512;
    }
    Ok(out)
}

/// The archive's one image: its config document and its layer's entries.
fn image_contents(archive: &[u8]) -> Result<(Value, Vec<TarEntry>)> {
    let outer = tar_entries(archive)?;
    let blob = |digest: &str| -> Result<&[u8]> {
        let name = format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
        Ok(&outer.iter().find(|e| e.name == name).with_context(|| format!("no {name} in the archive"))?.data)
    };
    let index: Value = serde_json::from_slice(&outer.iter().find(|e| e.name == "index.json").context("no index.json")?.data)?;
    let manifest: Value = serde_json::from_slice(blob(index["manifests"][0]["digest"].as_str().context("no manifest digest")?)?)?;
    let config: Value = serde_json::from_slice(blob(manifest["config"]["digest"].as_str().context("no config digest")?)?)?;
    let layers = manifest["layers"].as_array().context("no layers")?;
    ensure!(layers.len() == 1, "one layer expected: {manifest}");
    let layer = tar_entries(blob(layers[0]["digest"].as_str().context("no layer digest")?)?)?;
    Ok((config, layer))
}

/// `cargo xtask image` produces an OCI archive: its files and its config are exactly the
/// layout `xtask/src/image.rs` promises (and `deploy/README.md` lists), and it runs.
#[test]
fn the_image_holds_the_agent_the_hook_and_what_they_need_and_runs() -> Result<()> {
    let archive = archive()?;
    let bytes = std::fs::read(&archive)?;
    let (config, layer) = image_contents(&bytes)?;
    let listing: Vec<String> = layer
        .iter()
        .map(|e| match e.kind {
            b'2' => format!("{} -> {}", e.name, e.link),
            b'5' => e.name.clone(),
            _ => format!("{} ({:o}, {} bytes)", e.name, e.mode, e.data.len()),
        })
        .collect();
    eprintln!("{} ({} bytes):\n  {}", archive.display(), bytes.len(), listing.join("\n  "));
    let names: BTreeSet<&str> = layer.iter().map(|e| e.name.trim_end_matches('/')).collect();
    let want: BTreeSet<&str> = [
        "bin", "bin/busybox", "bin/sh", "bin/mkdir", "bin/cp", "bin/chmod", "bin/mv",
        "lib", "lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", "lib/x86_64-linux-gnu/libc.so.6",
        "lib/x86_64-linux-gnu/libm.so.6", "lib/x86_64-linux-gnu/libdl.so.2", "lib/x86_64-linux-gnu/libpthread.so.0",
        "lib/x86_64-linux-gnu/librt.so.1", "lib/x86_64-linux-gnu/libgcc_s.so.1", "lib64", "lib64/ld-linux-x86-64.so.2",
        "usr", "usr/local", "usr/local/bin", "usr/local/bin/vramguard", "usr/local/lib", "usr/local/lib/vramguard",
        "usr/local/lib/vramguard/libvramguard.so",
    ]
    .into_iter()
    .collect();
    ensure!(names == want, "the image's files differ: extra {:?}, missing {:?}", names.difference(&want), want.difference(&names));
    for entry in &layer {
        ensure!(entry.kind != b'0' || entry.mode == 0o755, "{} has mode {:o}", entry.name, entry.mode);
    }
    let inner = &config["config"];
    ensure!(inner["Entrypoint"] == serde_json::json!(["/usr/local/bin/vramguard"]), "entrypoint: {config}");
    ensure!(inner["Cmd"] == serde_json::json!(["run"]), "cmd: {config}");
    ensure!(inner["User"] == "0:0", "user: {config}");
    ensure!(inner["Labels"]["org.opencontainers.image.title"] == "vramguard", "labels: {config}");
    ensure!(inner["Labels"]["org.opencontainers.image.version"] == env!("CARGO_PKG_VERSION"), "labels: {config}");
    ensure!(config["architecture"] == "amd64" && config["os"] == "linux", "platform: {config}");

    // Run it: the entrypoint with `--version` (the image's own loader and glibc), and its
    // shell, in a containerd that imported the archive.
    let dir = TempDir::new("image-run")?;
    let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
    containerd.import(&archive)?;
    let image = image_name()?;
    let pod = containerd.pod("image", "default", "uid-image", &[])?;
    let version = ContainerSpec { image: Some(image.clone()), args: vec!["--version".into()], ..ContainerSpec::new("version") };
    let shell = ContainerSpec { image: Some(image), command: vec!["/bin/sh".into(), "-c".into(), "mkdir /made && echo shell ok".into()], ..ContainerSpec::new("shell") };
    for (spec, want) in [(version, format!("vramguard {}", env!("CARGO_PKG_VERSION"))), (shell, "shell ok".to_string())] {
        let id = containerd.run_container(&pod, &spec)?;
        wait_for(timeout(), "the container to exit", || Ok(state(&containerd, &id)? == cri::CONTAINER_EXITED))?;
        let log = containerd.container_log(&pod, &id)?;
        ensure!(exit_code(&containerd, &id)? == 0 && log.contains(&want), "{}: exit {}, log {log:?}", spec.name, exit_code(&containerd, &id)?);
    }
    Ok(())
}

/// The image name the DaemonSet runs (both of its containers name the same).
fn image_name() -> Result<String> {
    let spec = pod_spec()?;
    let mut images = BTreeSet::new();
    for key in ["initContainers", "containers"] {
        images.extend(spec[key].as_array().into_iter().flatten().filter_map(|c| c["image"].as_str().map(str::to_owned)));
    }
    ensure!(images.len() == 1, "the DaemonSet's containers name several images: {images:?}");
    images.into_iter().next().context("no image in the DaemonSet")
}

fn state(containerd: &Containerd, id: &ContainerId) -> Result<i32> {
    Ok(containerd.status(id)?.status.map(|s| s.state).unwrap_or(-1))
}

fn exit_code(containerd: &Containerd, id: &ContainerId) -> Result<i32> {
    Ok(containerd.status(id)?.status.map(|s| s.exit_code).unwrap_or(-1))
}

// ---- the DaemonSet's pod -----------------------------------------------------------------

/// A node running the DaemonSet's pod: containerd seeing the test's directories at the
/// manifest's host paths, the fake GPU, the agent's pod.
struct Node {
    dir: TempDir,
    /// The tests' API server: the pods' quotas (`--kube`), the node's advertised capacity.
    api: ApiServer,
    fake: FakeNode,
    containerd: Containerd,
    pod: PodId,
    /// The agent's container, once started.
    agent: Option<ContainerId>,
    /// The initContainers run so far.
    inits: Vec<ContainerId>,
    metrics_port: u16,
}

/// The test's directory standing for a host path of the manifest: `state` for
/// `/var/lib/vramguard`, `nri` for `/var/run/nri` (containerd sees them there).
const SEEN_AT: [(&str, &str); 2] = [("state", "/var/lib/vramguard"), ("nri", "/var/run/nri")];

/// Where a fake node installs its driver under the host's root, and how many GPUs of what
/// size it has.
struct Gpus {
    /// The install directory under the host's root (`usr/lib/x86_64-linux-gnu`: Debian's).
    driver_dir: &'static str,
    count: u32,
    /// `FAKECUDA_DEVICE_BYTES`.
    bytes: &'static str,
}

/// One GPU of 8 GiB, the driver where Debian and Ubuntu install it.
const ONE_GPU: Gpus = Gpus { driver_dir: "usr/lib/x86_64-linux-gnu", count: 1, bytes: "8g" };

impl Node {
    /// containerd with the image imported and the pod's sandbox made (no container yet), on a
    /// node of one GPU with the driver where Debian installs it.
    fn new(tag: &str) -> Result<Node> {
        Node::with_gpus(tag, &ONE_GPU)
    }

    /// [`Node::new`] on a node of `gpus`.
    fn with_gpus(tag: &str, gpus: &Gpus) -> Result<Node> {
        let dir = TempDir::new(tag)?;
        for sub in ["state", "nri", "limits", "run"] {
            std::fs::create_dir_all(dir.path().join(sub))?;
        }
        let api = ApiServer::start()?;
        api.service_account(&dir.path().join("serviceaccount"))?;
        // The host's root: the driver's libraries where this node's distribution has them. A
        // host's `/` is a shared mount (systemd makes it so), which the manifest's
        // HostToContainer propagation needs: the stand-in is bound onto itself, shared, in
        // containerd's namespace.
        let host_root = dir.path().join("host-root");
        e2e::install_fake_driver(&host_root, gpus.driver_dir)?;
        let mut binds: Vec<(PathBuf, PathBuf)> = SEEN_AT.iter().map(|(d, p)| (dir.path().join(d), PathBuf::from(p))).collect();
        binds.push((host_root.clone(), host_root));
        let containerd = Containerd::start_seeing(&dir.path().join("nri/nri.sock"), &binds)?;
        containerd.import(&archive()?)?;
        let fake = FakeNode::new(tag)
            .with_env("FAKECUDA_DEVICE_BYTES", gpus.bytes)
            .with_env("FAKECUDA_DEVICE_COUNT", gpus.count.to_string())
            .with_env("FAKECUDA_CONTEXT_BYTES", "518m");
        let pod = containerd.host_pid_pod("vramguard-agent-e2e", "vramguard-system", &format!("uid-{tag}"))?;
        let metrics_port = free_port()?;
        Ok(Node { dir, api, fake, containerd, pod, agent: None, inits: Vec::new(), metrics_port })
    }

    /// The manifest's volumes as host paths of this node, keyed by volume name.
    fn volume_source(&self, volume: &Value) -> Result<PathBuf> {
        let name = volume["name"].as_str().context("a volume without a name")?;
        if let Some(path) = volume["hostPath"]["path"].as_str() {
            return Ok(match path {
                // The host's root: here a directory of the test holding only the fake driver,
                // installed as the node's distribution does (`Node::with_gpus`), so that
                // `--host-root` stays as written and the agent finds it there itself.
                "/" => self.dir.path().join("host-root"),
                // Everything else is the host path itself: `state` and `nri` are the test's
                // directories there in containerd's namespace; tracefs and BTF the machine's.
                _ => PathBuf::from(path),
            });
        }
        if let Some(map) = volume["configMap"]["name"].as_str() {
            // A ConfigMap: its data (from the install file) written as files, as the kubelet does.
            let docs = manifest()?;
            let data = docs.iter().find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == map).with_context(|| format!("no ConfigMap {map}"))?;
            let dir = self.dir.path().join("limits");
            for (file, text) in data["data"].as_object().context("a ConfigMap without data")? {
                std::fs::write(dir.join(file), text.as_str().unwrap_or_default())?;
            }
            return Ok(dir);
        }
        if volume.get("emptyDir").is_some() {
            return Ok(self.dir.path().join(name));
        }
        bail!("volume {volume}: no mapping for this kind of volume")
    }

    /// A container of the manifest as the kubelet would give it to CRI; `without` drops one
    /// capability from those the manifest adds.
    fn container(&self, container: &Value, volumes: &[Value], without: Option<&str>) -> Result<ContainerSpec> {
        let name = container["name"].as_str().context("a container without a name")?;
        let strings = |v: &Value| -> Vec<String> { v.as_array().into_iter().flatten().filter_map(|s| s.as_str().map(str::to_owned)).collect() };
        let mut spec = ContainerSpec::new(name);
        spec.image = container["image"].as_str().map(str::to_owned);
        spec.command = strings(&container["command"]);
        spec.args = strings(&container["args"]).iter().map(|a| self.adapt_arg(a)).collect::<Result<Vec<_>>>()?.into_iter().flatten().collect();
        for env in container["env"].as_array().into_iter().flatten() {
            let key = env["name"].as_str().context("an env entry without a name")?;
            let value = match (env["value"].as_str(), env["valueFrom"]["fieldRef"]["fieldPath"].as_str()) {
                (Some(value), _) => value.to_string(),
                (None, Some("spec.nodeName")) => kube_api::NODE.to_string(),
                _ => bail!("env {key}: no mapping for {env}"),
            };
            spec = spec.env(key, &value);
        }
        for mount in container["volumeMounts"].as_array().into_iter().flatten() {
            let volume_name = mount["name"].as_str().context("a volume mount without a name")?;
            let volume = volumes.iter().find(|v| v["name"] == volume_name).with_context(|| format!("no volume {volume_name}"))?;
            let at = mount["mountPath"].as_str().context("a volume mount without mountPath")?;
            let propagation = match mount["mountPropagation"].as_str() {
                None | Some("None") => cri::PROPAGATION_PRIVATE,
                Some("HostToContainer") => cri::PROPAGATION_HOST_TO_CONTAINER,
                Some(other) => bail!("mountPropagation {other}: not mapped"),
            };
            spec = spec.mount_propagated(self.volume_source(volume)?, at, mount["readOnly"] == true, propagation);
        }
        spec.security = Some(security_context(&container["securityContext"], without)?);
        Ok(spec)
    }

    /// The one place where the manifest's agent arguments meet what this test can give.
    fn adapt_arg(&self, arg: &str) -> Result<Vec<String>> {
        let containerd_pid = self.containerd.pid().context("containerd is not running")?;
        Ok(match arg.split_once('=').map_or(arg, |(flag, _)| flag) {
            // The "host" of this test is containerd's mount namespace (where the pod's host
            // paths are the test's directories), not pid 1's.
            "--ledger-mount-namespace" => vec![format!("--ledger-mount-namespace=/proc/{containerd_pid}/ns/mnt")],
            // The pod shares the machine's network here (no CNI): free loopback ports instead
            // of 9400/9401 on every address.
            "--metrics-addr" => vec![format!("--metrics-addr=127.0.0.1:{}", self.metrics_port)],
            "--health-addr" => vec![format!("--health-addr=127.0.0.1:{}", free_port()?)],
            // Everything else as written (`--host-root=/host`: the volume is the test's stand-in
            // for the host's root, holding the fake driver).
            _ => vec![arg.to_string()],
        })
    }

    /// Runs the initContainer to its end, then starts the agent (`without` one capability).
    fn start(&mut self, without: Option<&str>) -> Result<ContainerId> {
        let spec = pod_spec()?;
        ensure!(spec["hostPID"] == true, "the DaemonSet no longer asks for hostPID");
        // runtimeClassName `nvidia` names the NVIDIA runtime, which gives the driver's device
        // nodes; there is none here: the pod runs on runc, and the fake NVML's "devices" (its
        // state directory and variables) are given to the agent below instead.
        ensure!(spec["runtimeClassName"] == "nvidia", "runtimeClassName: {}", spec["runtimeClassName"]);
        let volumes = spec["volumes"].as_array().cloned().unwrap_or_default();
        for init in spec["initContainers"].as_array().into_iter().flatten() {
            let container = self.container(init, &volumes, None)?;
            let id = self.containerd.run_container(&self.pod, &container)?;
            self.inits.push(id.clone());
            wait_for(timeout(), "the initContainer to finish", || Ok(state(&self.containerd, &id)? == cri::CONTAINER_EXITED))?;
            let log = self.containerd.container_log(&self.pod, &id)?;
            ensure!(exit_code(&self.containerd, &id)? == 0, "initContainer {} failed: {log}", container.name);
        }
        let agents = spec["containers"].as_array().context("no containers")?;
        ensure!(agents.len() == 1, "one container expected in the DaemonSet");
        let mut agent = self.container(&agents[0], &volumes, without)?;
        let mut env: Vec<(String, String)> = self.fake.env().iter().map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned())).collect();
        env.retain(|(k, _)| k != "FAKECUDA_STATE_DIR");
        for (key, value) in env {
            agent = agent.env(&key, &value);
        }
        agent = agent.env("FAKECUDA_STATE_DIR", FAKE_STATE_DIR).mount(self.fake.state_dir(), FAKE_STATE_DIR, false);
        // What the kubelet gives every pod that mounts its service account's token: the token,
        // CA and namespace at the standard path, and the API server's service variables (the
        // pod shares the machine's network here: the tests' API server on loopback).
        ensure!(spec["automountServiceAccountToken"] == true, "the DaemonSet no longer mounts its service account's token");
        agent = agent
            .mount(self.dir.path().join("serviceaccount"), SERVICE_ACCOUNT, true)
            .env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
            .env("KUBERNETES_SERVICE_PORT", &self.api.addr.port().to_string());
        let id = self.containerd.run_container(&self.pod, &agent)?;
        self.agent = Some(id.clone());
        Ok(id)
    }

    /// The pod replaced, as a DaemonSet's rolling update does: the agent stopped (SIGTERM,
    /// the manifest's grace) and its containers removed, then the initContainer and the agent
    /// run again. Returns the old agent's exit code and log.
    fn replace(&mut self) -> Result<(i32, String)> {
        let old = self.agent.take().context("no agent to replace")?;
        let grace = pod_spec()?["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
        self.containerd.stop_container(&old, Duration::from_secs(grace))?;
        let code = exit_code(&self.containerd, &old)?;
        let log = self.containerd.container_log(&self.pod, &old)?;
        for id in std::mem::take(&mut self.inits).iter().chain([&old]) {
            self.containerd.remove_container(id)?;
        }
        self.start(None)?;
        self.wait_ready()?;
        Ok((code, log))
    }

    /// Waits until the driver view (NVML) reads; its audit entry.
    fn driver_ok(&self) -> Result<Value> {
        wait_for(timeout(), "the driver view (NVML) ok", || Ok(self.audit()?["driver"]["state"] == "ok"))
            .with_context(|| format!("{}\n{}", self.audit().map(|a| a["driver"].clone()).unwrap_or_default(), self.agent_log()))?;
        Ok(self.audit()?["driver"].clone())
    }

    /// Waits until NVML reads, and checks the agent loaded it from `dir` under the host's root
    /// (`/host`) and says in the audit that it found the driver there (`layout`'s); the audit's
    /// driver entry.
    fn nvml_found(&self, dir: &str, layout: &str) -> Result<Value> {
        let driver = self.driver_ok()?;
        let library = format!("/host/{dir}/libnvidia-ml.so.{}", e2e::INSTALLED_VERSION);
        ensure!(driver["library"] == library.as_str(), "NVML was not loaded from {library}: {driver}");
        let install = format!("{dir} under /host ({layout})");
        ensure!(driver["install"].as_str().is_some_and(|found| found.starts_with(&install)), "the audit does not say {install:?}: {driver}");
        Ok(driver)
    }

    /// The agent's record of provisioned container `id`, from the audit.
    fn record(&self, id: &ContainerId) -> Result<Value> {
        let audit = self.audit()?;
        let record = audit["provisioned"].as_array().into_iter().flatten().find(|r| r["container_id"] == id.0.as_str()).cloned();
        record.with_context(|| format!("the agent has no record of container {}: {audit}", id.0))
    }

    fn agent(&self) -> Result<&ContainerId> {
        self.agent.as_ref().context("the agent is not started")
    }

    /// `kubectl exec <agent> -- vramguard audit --json`, through CRI.
    fn audit(&self) -> Result<Value> {
        let out = self.containerd.exec_sync(self.agent()?, &["vramguard", "audit", "--json"])?;
        ensure!(out.exit_code == 0, "vramguard audit: {out:?}");
        Ok(serde_json::from_str(&out.stdout)?)
    }

    fn agent_log(&self) -> String {
        self.agent.as_ref().and_then(|id| self.containerd.container_log(&self.pod, id).ok()).unwrap_or_default()
    }

    /// The agent's process as the host sees it (hostPID: its pid is the host's).
    fn agent_pid(&self) -> Result<u32> {
        self.containerd.container_pid(self.agent()?)
    }

    /// Waits until the agent answers audit and registered with containerd.
    fn wait_ready(&self) -> Result<()> {
        wait_for(timeout(), "the agent registered with containerd", || {
            if state(&self.containerd, self.agent()?)? == cri::CONTAINER_EXITED {
                bail!("the agent exited: {}", self.agent_log());
            }
            Ok(self.audit().is_ok_and(|a| a["nri_connected"] == true))
        })
        .with_context(|| self.agent_log())?;
        Ok(())
    }

    /// A workload pod of namespace team-a, provisioned by the agent through NRI; its
    /// container's process holds 128 MiB through the fake driver under the hook.
    fn workload(&self, uid: &str) -> Result<(PodId, ContainerId)> {
        // The pod as the API server has it: its container's vramguard.io/gpu-memory limit is
        // the quota (`--kube`).
        self.api.add_pod(api_pod("team-a", "trainer", uid, Some("1Gi")), true);
        let pod = self.containerd.pod("trainer", "team-a", uid, &[])?;
        let spec = ContainerSpec::new("main").command([workload_path().as_str(), "ctx 0", "alloc held 128m", "hold"]).fake_driver(&self.fake)?;
        let id = self.containerd.run_container(&pod, &spec)?;
        Ok((pod, id))
    }

    /// Runs the fake driver's workload in `container` with these steps.
    fn allocate(&self, container: &ContainerId, steps: &[&str]) -> Result<Vec<String>> {
        let workload = workload_path();
        let argv: Vec<&str> = [workload.as_str()].into_iter().chain(steps.iter().copied()).collect();
        let out = self.containerd.exec_sync(container, &argv)?;
        ensure!(out.exit_code == 0, "{argv:?} in the workload: {out:?}");
        Ok(out.stdout.lines().map(str::to_owned).collect())
    }
}

/// The kubelet's translation of a `securityContext` (plus the pod's `hostPID`); a field this
/// does not know fails, so a manifest change cannot be silently ignored.
fn security_context(context: &Value, without: Option<&str>) -> Result<cri::LinuxContainerSecurityContext> {
    let fields = context.as_object().context("a container without securityContext")?;
    let known = ["privileged", "runAsUser", "allowPrivilegeEscalation", "readOnlyRootFilesystem", "capabilities", "seccompProfile", "appArmorProfile"];
    if let Some(unknown) = fields.keys().find(|k| !known.contains(&k.as_str())) {
        bail!("securityContext.{unknown}: not mapped by this test");
    }
    let strings = |v: &Value| -> Vec<String> { v.as_array().into_iter().flatten().filter_map(|s| s.as_str().map(str::to_owned)).collect() };
    let mut add = strings(&context["capabilities"]["add"]);
    if let Some(dropped) = without {
        ensure!(add.iter().any(|c| c == dropped), "{dropped} is not among the manifest's capabilities {add:?}");
        add.retain(|c| c != dropped);
    }
    let profile = |v: &Value| -> Result<Option<cri::SecurityProfile>> {
        Ok(match v["type"].as_str() {
            None => None,
            Some("RuntimeDefault") => Some(cri::SecurityProfile { profile_type: cri::PROFILE_RUNTIME_DEFAULT, localhost_ref: String::new() }),
            Some("Unconfined") => Some(cri::SecurityProfile { profile_type: cri::PROFILE_UNCONFINED, localhost_ref: String::new() }),
            Some(other) => bail!("profile type {other}: not mapped"),
        })
    };
    Ok(cri::LinuxContainerSecurityContext {
        capabilities: Some(cri::Capability { add_capabilities: add, drop_capabilities: strings(&context["capabilities"]["drop"]) }),
        privileged: context["privileged"] == true,
        namespace_options: Some(host_pid_namespaces()),
        run_as_user: context["runAsUser"].as_i64().map(|value| cri::Int64Value { value }),
        readonly_rootfs: context["readOnlyRootFilesystem"] == true,
        no_new_privs: context["allowPrivilegeEscalation"] == false,
        seccomp: profile(&context["seccompProfile"])?,
        // containerd here runs with AppArmor disabled: Unconfined is what every container gets.
        apparmor: profile(&context["appArmorProfile"])?,
    })
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The capabilities the manifest adds to the agent.
fn manifest_capabilities() -> Result<Vec<String>> {
    let spec = pod_spec()?;
    let caps = spec["containers"][0]["securityContext"]["capabilities"]["add"].as_array().context("no capabilities added")?;
    Ok(caps.iter().filter_map(|c| c.as_str().map(str::to_owned)).collect())
}

/// The capability bits of a process (`CapEff` etc. of /proc/<pid>/status).
fn capability_set(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status.lines().find(|l| l.starts_with(&format!("{field}:"))).with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    Ok(u64::from_str_radix(line.split_whitespace().nth(1).unwrap_or_default(), 16)?)
}

/// Linux capability numbers of the names Kubernetes uses.
fn capability_bit(name: &str) -> Result<u64> {
    let number = match name {
        "CHOWN" => 0,
        "DAC_OVERRIDE" => 1,
        "DAC_READ_SEARCH" => 2,
        "FOWNER" => 3,
        "KILL" => 5,
        "SETGID" => 6,
        "SETUID" => 7,
        "SYS_CHROOT" => 18,
        "SYS_PTRACE" => 19,
        "SYS_ADMIN" => 21,
        "SYS_RESOURCE" => 24,
        "PERFMON" => 38,
        "BPF" => 39,
        other => bail!("capability {other}: number not known to this test"),
    };
    Ok(1 << number)
}

/// The agent's pod from the manifest: privileges exactly the manifest's, the initContainer's
/// hook installed, a provisioned workload held to its quota by that agent, audit through
/// CRI exec, a clean stop.
#[test]
fn the_daemonset_pod_runs_the_agent_with_the_manifest_privileges() -> Result<()> {
    let mut node = Node::new("ds-main")?;
    let agent = node.start(None)?;
    node.wait_ready()?;
    let pid = node.agent_pid()?;

    // Privileges: exactly the manifest's capabilities (effective, permitted and bounding),
    // uid 0, seccomp filtering, a read-only root and the host's pid namespace.
    let mut want = 0;
    for cap in manifest_capabilities()? {
        want |= capability_bit(&cap)?;
    }
    for field in ["CapEff", "CapPrm", "CapBnd"] {
        let have = capability_set(pid, field)?;
        ensure!(have == want, "{field} of the agent is {have:#x}, the manifest's capabilities are {want:#x}");
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    ensure!(status.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["Seccomp:", "2"]), "no seccomp filter: {status}");
    ensure!(status.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")), "not uid 0: {status}");
    let host_pidns = std::fs::read_link("/proc/self/ns/pid")?;
    ensure!(std::fs::read_link(format!("/proc/{pid}/ns/pid"))? == host_pidns, "the agent is not in the host's pid namespace");
    let write = node.containerd.exec_sync(&agent, &["mkdir", "/written"])?;
    ensure!(write.exit_code != 0 && write.stderr.contains("Read-only file system"), "the root file system is writable: {write:?}");

    // The initContainer installed the image's hook on the host (the state volume).
    let installed = node.dir.path().join("state/lib/libvramguard.so");
    let (_, layer) = image_contents(&std::fs::read(archive()?)?)?;
    let hook = layer.iter().find(|e| e.name == "usr/local/lib/vramguard/libvramguard.so").context("no hook in the image")?;
    ensure!(std::fs::read(&installed)? == hook.data, "{} is not the image's hook", installed.display());
    ensure!(node.dir.path().join("state/ledgers").is_dir(), "the ledger root was not made");

    // A workload container provisioned through NRI gets its quota from this agent.
    let (_pod, main) = node.workload("uid-trainer")?;
    let env = node.containerd.container_env(&main)?;
    ensure!(env.contains(&format!("CUDA_DEVICE_MEMORY_LIMIT={QUOTA}")), "no quota in the workload's env: {env:?}");
    // Its first process holds a context (518 MiB here) and 128 MiB; a second one's context
    // would take the container past its 1 GiB: refused, by the ledger the agent made.
    let lines = node.allocate(&main, &PAST_QUOTA)?;
    ensure!(lines.iter().any(|l| l.starts_with("oom ")), "the context past the quota was granted: {lines:?}");
    let record = node.record(&main)?;
    ensure!(record["quota"] == QUOTA && record["namespace"] == "team-a" && record["source"] == "kubernetes", "the pod spec's quota, through the API: {record}");
    // The driver's view: NVML found by the agent where Debian installs it under the host's
    // root, and reading; the install found is in the audit.
    node.nvml_found("usr/lib/x86_64-linux-gnu", "Debian and Ubuntu")?;
    // With the manifest's capabilities the kernel links the probes as uprobe_multi links
    // (removed in one grace period at a stop), not as a perf event each.
    let files = node.audit()?["libcuda"].as_array().cloned().unwrap_or_default();
    ensure!(!files.is_empty() && files.iter().all(|f| f["links"] == "uprobe_multi"), "the probes' links: {files:?}");

    // An upgrade: the pod replaced while the workload runs. The old agent stops cleanly; the
    // initContainer puts the hook in place again (copy, then rename: the workload keeps the
    // file it mapped); the new agent takes the provisioned container over (its ledger is the
    // same file, its record is on the host) and the quota still holds.
    let holder = node.containerd.container_pid(&main)?;
    let ledger_host = format!("/proc/{}/root/var/lib/vramguard/ledgers/{}/ledger", node.containerd.pid().context("no containerd")?, main.0);
    let before = std::fs::metadata(&ledger_host).with_context(|| format!("no ledger at {ledger_host}"))?;
    let (code, log) = node.replace()?;
    ensure!(code == 0 && log.contains("vramguard agent stopped"), "the old agent's stop: exit {code}, log {log}");
    let after = std::fs::metadata(&ledger_host)?;
    use std::os::unix::fs::MetadataExt as _;
    ensure!((before.dev(), before.ino()) == (after.dev(), after.ino()), "the workload's ledger was replaced");
    ensure!(Path::new(&format!("/proc/{holder}")).exists(), "the workload's process did not survive the upgrade");
    ensure!(node.record(&main)?["quota"] == QUOTA, "the new agent's record of the workload");
    wait_for(timeout(), "the new agent accounts the workload's process", || {
        let audit = node.audit()?;
        Ok(audit["processes"].as_array().into_iter().flatten().any(|p| p["pid"] == holder && p["state"] == "ok"))
    })
    .with_context(|| node.agent_log())?;
    let lines = node.allocate(&main, &PAST_QUOTA)?;
    ensure!(lines.iter().any(|l| l.starts_with("oom ")), "after the upgrade, the context past the quota was granted: {lines:?}");

    // A clean stop: SIGTERM (the manifest's grace period), exit 0, probes detached.
    let agent = node.agent()?.clone();
    let grace = pod_spec()?["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
    node.containerd.stop_container(&agent, Duration::from_secs(grace))?;
    ensure!(exit_code(&node.containerd, &agent)? == 0, "the agent's exit code: {}; log: {}", exit_code(&node.containerd, &agent)?, node.agent_log());
    ensure!(node.agent_log().contains("vramguard agent stopped"), "no clean stop in the log: {}", node.agent_log());
    Ok(())
}

/// The same install file, unedited, on a node of 8 GPUs of 141 GiB whose driver the NVIDIA GPU
/// operator installed (its driver root, `/run/nvidia/driver`, on a RHEL-like image): the
/// agent finds the driver there, sizes the node from NVML (no `--gpu-memory` in the file), and
/// a workload the runtime did not say the GPUs of is held to its quota on all 8.
#[test]
fn the_daemonset_runs_unedited_on_a_node_of_eight_gpus_of_another_size_and_driver_root() -> Result<()> {
    let gpus = Gpus { driver_dir: "run/nvidia/driver/usr/lib64", count: 8, bytes: "141g" };
    let mut node = Node::with_gpus("ds-eight", &gpus)?;
    let args = pod_spec()?["containers"][0]["args"].clone();
    ensure!(!args.to_string().contains("--gpu-memory"), "the DaemonSet sizes GPUs by flag: {args}");
    node.start(None)?;
    node.wait_ready()?;
    let driver = node.nvml_found("run/nvidia/driver/usr/lib64", "the NVIDIA GPU operator's driver root")?;
    let memory: Vec<u64> = driver["devices"].as_array().into_iter().flatten().filter_map(|d| d["memory"][0].as_u64()).collect();
    ensure!(memory == vec![141 << 30; 8], "NVML's GPUs: {driver}");
    let log = node.agent_log();
    ensure!(log.contains("the driver's libraries: run/nvidia/driver/usr/lib64 under /host"), "the install found is not logged: {log}");
    // The node advertises NVML's 8 GPUs' memory (`--kube`, no --gpu-memory in the file).
    let capacity = (8u64 * (141 << 30)).to_string();
    wait_for(timeout(), "the node's capacity: NVML's 8 GPUs", || Ok(node.api.with(|s| s.node["status"]["capacity"][kube_api::RESOURCE] == capacity.as_str())))
        .with_context(|| format!("{}\n{}", node.api.with(|s| s.node["status"].clone()), node.agent_log()))?;

    let (_pod, main) = node.workload("uid-eight")?;
    let record = node.record(&main)?;
    ensure!(record["devices"] == 8 && record["gpus"] == serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7]), "the node's 8 GPUs from NVML: {record}");
    let lines = node.allocate(&main, &PAST_QUOTA)?;
    ensure!(lines.iter().any(|l| l.starts_with("oom ")), "the context past the quota was granted: {lines:?}");
    Ok(())
}

/// Whether a node with `labels` satisfies the pod spec's required node affinity, as the
/// scheduler and the DaemonSet controller read it (Kubernetes' NodeSelectorRequirement: terms
/// ORed, expressions ANDed; `In`, `NotIn` (true where the label is absent), `Exists`,
/// `DoesNotExist`). An operator this does not know fails.
fn schedules_on(spec: &Value, labels: &[(&str, &str)]) -> Result<bool> {
    let terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"].as_array().context("no required node affinity")?;
    let label = |key: &str| labels.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
    let mut any = false;
    for term in terms {
        let mut all = true;
        for expression in term["matchExpressions"].as_array().context("a term without matchExpressions")? {
            let key = expression["key"].as_str().context("an expression without a key")?;
            let values: Vec<&str> = expression["values"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
            all &= match expression["operator"].as_str() {
                Some("In") => label(key).is_some_and(|v| values.contains(&v)),
                Some("NotIn") => label(key).is_none_or(|v| !values.contains(&v)),
                Some("Exists") => label(key).is_some(),
                Some("DoesNotExist") => label(key).is_none(),
                other => bail!("operator {other:?}: not modelled"),
            };
        }
        any |= all;
    }
    Ok(any)
}

/// The DaemonSet's nodes, as the shipped file's affinity selects them: GPU nodes as the usual
/// labellers mark them, not those the GPU operator gives to VMs, and not while the operator's
/// driver or MIG manager has paused the NVML clients (`nvidia.com/gpu.deploy.client` off
/// `true`) to unload the driver; back when it is `true` again, and always where the label is
/// absent.
#[test]
fn the_daemonset_runs_on_gpu_nodes_and_leaves_while_the_gpu_operator_unloads_the_driver() -> Result<()> {
    let spec = pod_spec()?;
    let gfd = ("nvidia.com/gpu.present", "true");
    let client = |value| ("nvidia.com/gpu.deploy.client", value);
    for (labels, runs) in [
        (vec![gfd], true),
        (vec![gfd, client("true")], true),
        (vec![gfd, client("paused-for-driver-upgrade")], false),
        (vec![gfd, client("paused-for-mig-change")], false),
        (vec![gfd, client("false")], false),
        (vec![("feature.node.kubernetes.io/pci-10de.present", "true")], true),
        (vec![("feature.node.kubernetes.io/pci-0302_10de.present", "true")], true),
        (vec![("feature.node.kubernetes.io/pci-0300_10de.present", "true"), client("paused-for-driver-upgrade")], false),
        (vec![gfd, ("nvidia.com/gpu.workload.config", "vm-passthrough")], false),
        (vec![gfd, ("nvidia.com/gpu.workload.config", "container")], true),
        (vec![("vramguard.io/gpu-node", "true")], true),
        (vec![("vramguard.io/gpu-node", "true"), client("paused-for-driver-upgrade")], false),
        (vec![("kubernetes.io/os", "linux")], false),
    ] {
        ensure!(schedules_on(&spec, &labels)? == runs, "a node labelled {labels:?} {} run the agent", if runs { "must" } else { "must not" });
    }
    Ok(())
}

/// What the agent's pod achieved: the first step that failed, with what it said.
#[derive(Debug)]
enum Outcome {
    /// The agent exited, or never registered with containerd: the end of its log.
    NotStarted(String),
    /// containerd's CreateContainer of the provisioned workload failed: its error.
    WorkloadRefused(String),
    /// The workload ran but the allocation past its quota was granted: its output.
    QuotaNotHeld(String),
    /// The agent's view of the workload's process, when it is not `ok`: the audit's row.
    NotAccounted(String),
    /// Everything worked.
    Works,
}

/// Runs the pod (without `cap`, or with every capability) through the main test's steps and
/// says which first failed.
fn exercise(tag: &str, without: Option<&str>) -> Result<Outcome> {
    let mut node = Node::new(tag)?;
    node.start(without)?;
    let tail = |log: String| log.lines().rev().take(6).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    if let Err(error) = node.wait_ready() {
        return Ok(Outcome::NotStarted(format!("{error:#}\n{}", tail(node.agent_log()))));
    }
    let (_pod, main) = match node.workload(&format!("uid-{tag}-w")) {
        Ok(made) => made,
        Err(error) => return Ok(Outcome::WorkloadRefused(format!("{error:#}"))),
    };
    let lines = match node.allocate(&main, &PAST_QUOTA) {
        Ok(lines) => lines,
        Err(error) => return Ok(Outcome::QuotaNotHeld(format!("{error:#}"))),
    };
    if !lines.iter().any(|l| l.starts_with("oom ")) {
        return Ok(Outcome::QuotaNotHeld(lines.join("\n")));
    }
    let pid = node.containerd.container_pid(&main)?;
    let mut row = Value::Null;
    let seen = wait_for(Duration::from_secs(10), "the workload's process accounted", || {
        let audit = node.audit()?;
        row = audit["processes"].as_array().into_iter().flatten().find(|p| p["pid"] == pid).cloned().unwrap_or(Value::Null);
        Ok(row["state"] == "ok")
    });
    if seen.is_err() {
        return Ok(Outcome::NotAccounted(format!("{row}\n{}", tail(node.agent_log()))));
    }
    Ok(Outcome::Works)
}

/// Exploration: every capability of the manifest dropped in turn (run by hand with
/// `--ignored --nocapture`; deploy/README.md's table is what it printed).
#[test]
#[ignore]
fn explore_capabilities() -> Result<()> {
    for cap in manifest_capabilities()? {
        let outcome = exercise(&format!("ds-{}", cap.to_lowercase().replace('_', "-")), Some(&cap))?;
        eprintln!("==== without {cap}: {outcome:?}");
    }
    Ok(())
}

/// What fails without each capability the manifest adds (measured by
/// [`explore_capabilities`]; deploy/README.md's table). A capability of the manifest missing
/// here fails the test: one that nothing needs is removed from the manifest.
const NEEDED: [(&str, &str, &str); 5] = [
    // No eBPF map can be created: the agent stops before it loads anything. (With it,
    // bpf(2) and perf_event_open(2) need neither BPF nor PERFMON, measured: both were removed;
    // with BPF and PERFMON but not SYS_ADMIN, the uprobes' perf_event_open fails: EACCES.)
    ("SYS_ADMIN", "not started", "the kernel refused the eBPF object"),
    // The host's mount namespace cannot be opened (/proc/<pid>/ns/mnt of another process's
    // credentials): no provisioned ledger can be mounted, the container is refused.
    ("SYS_PTRACE", "workload refused", "Permission denied"),
    // The ledger workers cannot switch to uid/gid 65534: the agent refuses to start.
    ("SETUID", "not started", "ledger workers, which switch to uid 65534"),
    ("SETGID", "not started", "ledger workers, which switch to uid 65534"),
    // setns(2) into the host's mount namespace also needs CAP_SYS_CHROOT: refused containers.
    ("SYS_CHROOT", "workload refused", "Operation not permitted"),
];

/// Each capability the manifest gives the agent is needed: without it (the others kept),
/// the pod fails exactly as deploy/README.md says.
#[test]
fn without_each_capability_of_the_manifest_the_agent_fails() -> Result<()> {
    let manifest: BTreeSet<String> = manifest_capabilities()?.into_iter().collect();
    let table: BTreeSet<String> = NEEDED.iter().map(|(cap, _, _)| cap.to_string()).collect();
    ensure!(manifest == table, "the manifest adds {manifest:?}, the measured table needs {table:?}");
    for (cap, step, says) in NEEDED {
        let outcome = exercise(&format!("ds-no-{}", cap.to_lowercase().replace('_', "-")), Some(cap))?;
        let (failed, message) = match &outcome {
            Outcome::NotStarted(m) => ("not started", m),
            Outcome::WorkloadRefused(m) => ("workload refused", m),
            Outcome::QuotaNotHeld(m) => ("quota not held", m),
            Outcome::NotAccounted(m) => ("not accounted", m),
            Outcome::Works => bail!("without {cap} the agent still works: the manifest need not give it"),
        };
        ensure!(failed == step && message.contains(says), "without {cap}: expected {step} saying {says:?}, got {failed}: {message}");
        eprintln!("without {cap}: {failed} ({says})");
    }
    Ok(())
}
