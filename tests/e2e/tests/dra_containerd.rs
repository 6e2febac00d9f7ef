//! The NRI side of the DRA driver with a real containerd (1.7.24, CDI and NRI on), issue 25
//! item 2: a claim prepared as the kubelet plugin prepares it (its checkpoint entry and CDI
//! spec, written through `agent::dra`), a container created through CRI with the claim's CDI
//! device, provisioned from the claim's share.
//!
//! Needs root, the containerd cache (`cargo xtask setup`) and the built binaries.
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use agent::dra::{self, cdi, checkpoint::Checkpoint, Prepared, Share};
use agent::provision::nri::{self, Adjustment, Container, Handler, Pod};
use anyhow::{ensure, Context, Result};
use e2e::containerd::{ContainerSpec, Containerd};
use e2e::{timeout, wait_for, TempDir, GIB};

/// A handler that records what the runtime hands over at CreateContainer.
struct Recorder(Mutex<mpsc::Sender<Container>>);

impl Handler for Recorder {
    async fn synchronize(&self, _pods: Vec<Pod>, _containers: Vec<Container>) {}
    async fn create_container(&self, _pod: Pod, container: Container) -> Result<Adjustment, String> {
        if let Ok(tx) = self.0.lock() {
            let _ = tx.send(container);
        }
        Ok(Adjustment::default())
    }
    async fn remove_container(&self, _pod: Pod, _container: Container) {}
    async fn remove_pod(&self, _pod: Pod) {}
}

/// The recorder as an NRI plugin on a thread of its own.
struct Plugin {
    seen: mpsc::Receiver<Container>,
    connected: tokio::sync::watch::Receiver<bool>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Plugin {
    fn start(socket: &Path) -> Plugin {
        let (tx, seen) = mpsc::channel();
        let handler = Arc::new(Recorder(Mutex::new(tx)));
        let (connected_tx, connected) = tokio::sync::watch::channel(false);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let config = nri::Config { socket: socket.to_path_buf(), name: "recorder".into(), index: "10".into(), handler_deadline: Duration::from_millis(1500) };
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime");
            runtime.block_on(async move {
                tokio::select! {
                    () = nri::run(config, handler, connected_tx) => {}
                    _ = stopped => {}
                }
            });
        });
        Plugin { seen, connected, stop: Some(stop), thread: Some(thread) }
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A stand-in for GPU `n`'s device node: a character device with /dev/null's numbers at
/// `<dir>/nvidia<n>` (made in the test's own directory, never in /dev).
fn fake_gpu_node(dir: &Path, n: u32) -> Result<PathBuf> {
    let path = dir.join(format!("nvidia{n}"));
    if !path.exists() {
        let out = std::process::Command::new("mknod").arg(&path).args(["c", "1", "3"]).output()?;
        ensure!(out.status.success(), "mknod {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    }
    Ok(path)
}

/// A claim of `uid` with one share of `memory` on each of `gpus`.
fn claim(uid: &str, memory: u64, gpus: &[u32]) -> Prepared {
    Prepared {
        uid: uid.into(),
        namespace: "team-a".into(),
        name: format!("claim-{uid}"),
        shares: gpus
            .iter()
            .map(|&gpu| Share {
                request: "gpu".into(),
                pool: "node-1".into(),
                device: dra::device_name(gpu),
                gpu,
                share_id: Some(format!("00000000-0000-4000-8000-00000000000{gpu}")),
                memory,
                cdi_device: cdi::qualified(uid, gpu),
            })
            .collect(),
    }
}

/// Prepares `claim` as the kubelet plugin does: its CDI spec, then its checkpoint entry.
fn prepare(containerd: &Containerd, state: &Path, nodes: &Path, prepared: &Prepared) -> Result<()> {
    cdi::write_in(&containerd.cdi_dir(), state, nodes, prepared).map_err(anyhow::Error::msg)?;
    Checkpoint::open(state).and_then(|mut book| book.insert(prepared.clone())).map_err(anyhow::Error::msg)
}

/// What NRI's CreateContainer sees of a DRA claim's CDI device on containerd 1.7.24, through
/// the kubelet's `cdi.k8s.io/` annotation and through CRI's `CDI_devices` field: the spec's
/// mount of the claim's directory (host path and all), the GPU's device node, its env value.
#[test]
fn nri_sees_the_claim_s_cdi_edits() -> Result<()> {
    let dir = TempDir::new("dra-nri-sees")?;
    let state = dir.path().join("state");
    let nodes = dir.path().join("nodes");
    std::fs::create_dir_all(&nodes)?;
    fake_gpu_node(&nodes, 1)?;
    let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
    let uid = "6f1c0d36-0000-4000-8000-0000000000a1";
    prepare(&containerd, &state, &nodes, &claim(uid, GIB, &[1]))?;
    let plugin = Plugin::start(containerd.nri_socket());
    wait_for(timeout(), "the recorder registered", || Ok(*plugin.connected.borrow()))?;

    let by_annotation = ContainerSpec::new("annotated").annotation("cdi.k8s.io/gpu.vramguard.io_claim", &cdi::qualified(uid, 1));
    let by_field = ContainerSpec::new("field").cdi_device(&cdi::qualified(uid, 1));
    for (how, spec) in [("the cdi.k8s.io/ annotation", by_annotation), ("CRI's CDI_devices", by_field)] {
        let pod = containerd.pod(&spec.name, "team-a", &format!("uid-{}", spec.name), &[])?;
        let id = containerd.create_container(&pod, &spec).with_context(|| how.to_string())?;
        let seen = plugin.seen.recv_timeout(timeout()).context("CreateContainer reached the plugin")?;
        eprintln!("through {how}: NRI CreateContainer saw\n  mounts {:?}\n  devices {:?}\n  cdi_devices {:?}\n  env {:?}", seen.mounts, seen.devices, seen.cdi_devices, seen.env);
        let mount = seen.mounts.iter().find(|m| m.destination == cdi::claim_mount(uid));
        ensure!(mount.is_some_and(|m| m.source == cdi::claim_dir(&state, uid) && m.read_only), "through {how}: no claim mount in {:?}", seen.mounts);
        ensure!(seen.devices.contains(&"/dev/nvidia1".to_string()), "through {how}: no GPU node in {:?}", seen.devices);
        ensure!(seen.env.contains(&(cdi::CLAIM_ENV.to_string(), uid.to_string())), "through {how}: {:?}", seen.env);
        containerd.remove_container(&id)?;
    }
    Ok(())
}
