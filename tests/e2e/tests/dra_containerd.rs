//! The NRI side of the DRA driver with a real containerd (1.7.24, CDI and NRI on; the same on
//! containerd 2, `*_on_containerd_2`), issue 25 item 2: a claim prepared as the kubelet plugin
//! prepares it (its checkpoint entry and CDI spec, written through `agent::dra`), a container
//! created through CRI with the claim's CDI device, provisioned from the claim's share.
//!
//! Needs root, the containerd cache (`cargo xtask setup`) and the built binaries.
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Mutex};
use std::time::Duration;

use std::ffi::{OsStr, OsString};

use agent::dra::{cdi, checkpoint::Checkpoint, Prepared, Share};
use agent::provision::nri::{Adjustment, Container, Handler, Pod};
use anyhow::{ensure, Context, Result};
use e2e::agent::{provisioning_args, Agent};
use e2e::containerd::{workload_path, ContainerId, ContainerSpec, Containerd, PodId, Version};
use e2e::{timeout, wait_for, FakeNode, TempDir, GIB};
use serde_json::Value;

mod dra;
mod nri_thread;

use dra::node::stand_in_gpu_node;

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
fn recorder(socket: &Path) -> nri_thread::Plugin<Container> {
    let (tx, seen) = mpsc::channel();
    nri_thread::Plugin::start(socket, "recorder", Recorder(Mutex::new(tx)), seen)
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
                device: agent::dra::device_name(gpu),
                gpu,
                share_id: Some(format!("00000000-0000-4000-8000-00000000000{gpu}")),
                memory,
                cdi_device: cdi::qualified(uid, gpu),
                admin_access: false,
            })
            .collect(),
    }
}

/// Prepares `claim` as the kubelet plugin does: its CDI spec, then its checkpoint entry.
fn prepare(containerd: &Containerd, state: &Path, nodes: &Path, prepared: &Prepared) -> Result<()> {
    cdi::write_in(&containerd.cdi_dir(), state, &cdi::Nodes::at(nodes), prepared).map_err(anyhow::Error::msg)?;
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
    stand_in_gpu_node(&nodes, 1)?;
    let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
    let uid = "6f1c0d36-0000-4000-8000-0000000000a1";
    prepare(&containerd, &state, &nodes, &claim(uid, GIB, &[1]))?;
    let plugin = recorder(containerd.nri_socket());
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

/// A node: a fake GPU of 8 GiB (contexts charged what the agent's ledgers reserve, 518 MiB)
/// standing for GPUs 0 and 1 of `--gpu-memory 8g,8g` (their device nodes stand-ins in the
/// test's directory), a containerd with CDI and NRI, and the agent provisioning through NRI,
/// its quota file for another namespace (team-a's containers get quotas from claims only).
struct Node {
    dir: TempDir,
    fake: FakeNode,
    containerd: Containerd,
    agent: Agent,
}

impl Node {
    fn new(tag: &str) -> Result<Node> {
        let dir = TempDir::new(tag)?;
        let fake = FakeNode::new(tag).with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "518m");
        for sub in ["ledgers", "nodes"] {
            std::fs::create_dir_all(dir.path().join(sub))?;
        }
        for n in [0, 1] {
            stand_in_gpu_node(&dir.path().join("nodes"), n)?;
        }
        std::fs::write(dir.path().join("quotas"), "namespace=elsewhere 1g\n")?;
        let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
        let args = provisioning_args(&dir.path().join("nri.sock"), &dir.path().join("state"), &dir.path().join("quotas"), "8g,8g")?;
        let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
        let agent = Agent::watching(&dir.path().join("ledgers"), &args)?;
        wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true)).with_context(|| agent.log())?;
        Ok(Node { dir, fake, containerd, agent })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Prepares `claim` as the kubelet plugin does.
    fn prepare(&self, claim: &Prepared) -> Result<()> {
        prepare(&self.containerd, &self.path("state"), &self.path("nodes"), claim)
    }

    /// Unprepares claim `uid` as the kubelet plugin does: its CDI spec, then its checkpoint entry.
    fn unprepare(&self, uid: &str) -> Result<()> {
        cdi::remove(&self.containerd.cdi_dir(), &self.path("state"), uid).map_err(anyhow::Error::msg)?;
        Checkpoint::open(&self.path("state")).and_then(|mut book| book.remove(uid)).map_err(anyhow::Error::msg)?;
        Ok(())
    }

    /// Runs container `main` of a new pod with the fake driver, given `cdi` (CRI's
    /// `CDI_devices`, as the kubelet passes a DRA driver's devices), running `command` (empty:
    /// it sleeps).
    fn run(&self, pod: &str, cdi: &[String], env: &[(&str, &str)], command: &[&str]) -> Result<(PodId, ContainerId)> {
        let pod = self.containerd.pod(pod, "team-a", &format!("uid-{pod}"), &[])?;
        let mut spec = ContainerSpec::new("main").fake_driver(&self.fake)?.command(command.iter().copied());
        for device in cdi {
            spec = spec.cdi_device(device);
        }
        for (key, value) in env {
            spec = spec.env(key, value);
        }
        let id = self.containerd.run_container(&pod, &spec)?;
        Ok((pod, id))
    }

    /// Runs `fakecuda-workload` with these steps in `container`; its output lines.
    fn workload(&self, container: &ContainerId, steps: &[&str]) -> Result<Vec<String>> {
        dra::node::workload(&self.containerd, container, steps)
    }

    /// The agent's record of provisioned container `id`.
    fn provisioned(&self, id: &ContainerId) -> Result<Option<Value>> {
        dra::node::provisioned(&self.agent, id)
    }

    /// The claim's ledger on the host.
    fn claim_ledger(&self, uid: &str) -> PathBuf {
        self.path("ledgers").join(format!("dra-{uid}")).join("ledger")
    }

    /// (index, limit) of each device of the ledger at `path` (`vramguard inspect --json`).
    fn ledger_limits(&self, path: &Path) -> Result<Vec<(u64, u64)>> {
        self.ledger_devices(path, "limit_bytes")
    }

    /// (index, `field`) of each device of the ledger at `path` (`vramguard inspect --json`).
    fn ledger_devices(&self, path: &Path, field: &str) -> Result<Vec<(u64, u64)>> {
        dra::node::ledger_devices(path, field)
    }

    /// The agent's `vramguard_dra_containers_refused_total{reason}`.
    fn refused(&self, reason: &str) -> Result<f64> {
        let samples = e2e::http::scrape(self.agent.metrics_addr()?)?;
        Ok(e2e::http::metric(&samples, "vramguard_dra_containers_refused_total", &[("reason", reason)]).unwrap_or(0.0))
    }
}

/// Issue 25, item 2's node half: two claims on GPU 1 (3 GiB and 1 GiB, the scheduler's
/// `consumedCapacity`), prepared as the plugin prepares them; containers created through CRI
/// with a claim's CDI device are provisioned from it: one ledger per claim, its quota the
/// claim's memory on that one GPU, shared by the claim's two containers (in two pods), held
/// there by the hook, honest allocations near the quota granted; the second claim has its
/// own quota; a container whose env names a claim gets nothing; a claim's CDI spec without
/// a prepared claim is refused and counted; after unprepare the spec is gone, and the
/// claim's ledger goes with its last container.
#[test]
fn containers_of_a_claim_are_held_to_its_share_of_the_gpu_and_share_it() -> Result<()> {
    let node = Node::new("dra-containerd")?;
    let (u1, u2) = ("6f1c0d36-0000-4000-8000-0000000000b1", "6f1c0d36-0000-4000-8000-0000000000b2");
    node.prepare(&claim(u1, 3 * GIB, &[1]))?;
    node.prepare(&claim(u2, GIB, &[1]))?;
    let device = |uid: &str| vec![cdi::qualified(uid, 1)];

    // A holds a context (518 MiB) and 1 GiB of claim u1's 3 GiB, and keeps them.
    let wl = workload_path();
    let (pod_a, a) = node.run("a", &device(u1), &[], &[wl.as_str(), "ctx 0", "alloc a 1g", "meminfo", "hold"])?;
    wait_for(timeout(), "A holds its memory", || Ok(node.containerd.container_log(&pod_a, &a)?.contains("meminfo")))?;
    let log = node.containerd.container_log(&pod_a, &a)?;
    ensure!(log.contains(&format!("total={}", 3 * GIB)), "the claim's quota is the GPU A sees: {log}");
    let record = node.provisioned(&a)?.with_context(|| format!("A not provisioned; log:\n{}", node.agent.log()))?;
    ensure!(record["claim"] == u1 && record["gpus"] == serde_json::json!([1]) && record["quota"] == 3 * GIB && record["source"] == "dra claim", "{record}");
    ensure!(node.ledger_limits(&node.claim_ledger(u1))? == [(0, 3 * GIB)], "one device, GPU 1, at the claim's memory: {:?}", node.ledger_limits(&node.claim_ledger(u1))?);
    let mounts = node.containerd.container_mounts(&a)?;
    ensure!(
        mounts.iter().any(|(at, source, _)| at == "/run/vramguard/ledger" && Path::new(source) == node.claim_ledger(u1)),
        "A maps the claim's ledger: {mounts:?}"
    );

    // B, of the same claim in another pod: its own honest allocations are granted up to what A
    // leaves (1542 MiB held of 3 GiB): a context, 512 MiB, 256 MiB more (2822 MiB in all);
    // 1 GiB, which B alone would have room for, is refused.
    let (pod_b, b) = node.run("b", &device(u1), &[], &[])?;
    let lines = node.workload(&b, &["ctx 0", "alloc b 512m", "expect-oom alloc c 1g", "alloc d 256m", "meminfo"])?;
    ensure!(lines.iter().any(|l| l == "oom c"), "c refused: B and A share the claim's 3 GiB: {lines:?}");
    let record = node.provisioned(&b)?.context("B not provisioned")?;
    ensure!(record["claim"] == u1, "{record}");

    // The second claim on GPU 1 has its own 1 GiB: a context and 256 MiB granted, 512 MiB more
    // refused, although C's env names claim u1 (the value u1's CDI spec sets).
    let (_pod_c, c) = node.run("c", &device(u2), &[(cdi::CLAIM_ENV, u1)], &[])?;
    let record = node.provisioned(&c)?.context("C not provisioned")?;
    ensure!(record["claim"] == u2 && record["quota"] == GIB, "{record}");
    ensure!(node.ledger_limits(&node.claim_ledger(u2))? == [(0, GIB)], "{:?}", node.ledger_limits(&node.claim_ledger(u2))?);
    let lines = node.workload(&c, &["ctx 0", "alloc a 256m", "expect-oom alloc b 512m", "meminfo"])?;
    ensure!(lines.iter().any(|l| l == "oom b") && lines.iter().any(|l| l.contains(&format!("total={GIB}"))), "{lines:?}");

    // Its env names claim u1 (the value the CDI spec sets) without the claim's device: nothing.
    let (_pod_l, liar) = node.run("liar", &[], &[(cdi::CLAIM_ENV, u1)], &[])?;
    ensure!(node.provisioned(&liar)?.is_none(), "a container is provisioned from its env: {:?}", node.provisioned(&liar)?);
    let out = node.containerd.exec_sync(&liar, &["ls", "/run/vramguard/ledger"])?;
    ensure!(out.exit_code != 0, "the liar got a ledger: {out:?}");

    // A CDI spec of a claim the checkpoint does not hold: refused with the reason, counted.
    let u3 = "6f1c0d36-0000-4000-8000-0000000000b3";
    cdi::write_in(&node.containerd.cdi_dir(), &node.path("state"), &cdi::Nodes::at(&node.path("nodes")), &claim(u3, GIB, &[0])).map_err(anyhow::Error::msg)?;
    let before = node.refused("not_prepared")?;
    let error = node.run("stray", &device_of(u3, 0), &[], &[]).expect_err("a claim not prepared");
    ensure!(format!("{error:#}").contains(&format!("DRA claim {u3} is not prepared")), "{error:#}");
    ensure!(node.refused("not_prepared")? == before + 1.0, "counted");
    ensure!(!node.claim_ledger(u3).exists());

    // Unprepared while B still runs: the spec is gone, the claim's ledger stays for B; gone
    // with B, the claim's last container (A's pod went first).
    node.containerd.remove_pod(&pod_a)?;
    node.unprepare(u1)?;
    ensure!(!cdi::spec_path(&node.containerd.cdi_dir(), u1).exists(), "the CDI spec is removed");
    ensure!(node.claim_ledger(u1).exists(), "B still maps the claim's ledger");
    // A's process was killed with its pod: the agent reclaims what it held in the claim's
    // ledger, and B has the claim's room again.
    wait_for(timeout(), "A's share reclaimed from the claim's ledger", || Ok(node.ledger_devices(&node.claim_ledger(u1), "used_bytes")? == [(0, 0)]))?;
    node.workload(&b, &["ctx 0", "alloc a 2g", "meminfo"])?;
    node.containerd.remove_pod(&pod_b)?;
    wait_for(Duration::from_secs(5), "the claim's ledger removed with its last container", || Ok(!node.claim_ledger(u1).exists()))?;
    ensure!(node.claim_ledger(u2).exists(), "claim u2's container still runs");
    let log = node.agent.log();
    ensure!(!log.contains("panicked"), "{log}");
    node.fake.cleanup();
    Ok(())
}

/// Claim `uid`'s CDI device on GPU `gpu`, as CRI's `CDI_devices` carries it.
fn device_of(uid: &str, gpu: u32) -> Vec<String> {
    vec![cdi::qualified(uid, gpu)]
}

/// [`nri_sees_the_claim_s_cdi_edits`] on containerd 2: its NRI sees the CDI edits as 1.7's does.
#[test]
fn nri_sees_the_claim_s_cdi_edits_on_containerd_2() -> Result<()> {
    Version::V2.run(nri_sees_the_claim_s_cdi_edits)
}

/// [`containers_of_a_claim_are_held_to_its_share_of_the_gpu_and_share_it`] on containerd 2.
#[test]
fn containers_of_a_claim_are_held_to_its_share_of_the_gpu_and_share_it_on_containerd_2() -> Result<()> {
    Version::V2.run(containers_of_a_claim_are_held_to_its_share_of_the_gpu_and_share_it)
}
