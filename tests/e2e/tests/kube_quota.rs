//! Quotas through Kubernetes, end to end (issue "Ship what operators install", item 5): the
//! agent runs as containerd's NRI plugin with `--kube` alone (no quota file), reaching an API
//! server as a pod does: in-cluster configuration (`KUBERNETES_SERVICE_HOST`/`PORT`, the
//! service account's token and CA in a directory it is told about), TLS, a list and a watch of
//! its node's pods. The API server is a small one of the tests' (`kube_api/`), serving pods as
//! the real one writes them and recording what it is asked.
//!
//! Shown: a pod whose container asks `vramguard.io/gpu-memory: 1Gi`, and sets
//! `CUDA_DEVICE_MEMORY_LIMIT=64g` in its own spec, is held to 1 GiB (a hooked workload in it is
//! refused past it, whatever its environment says); that pod reaches the agent only through
//! the watch (the server answers 404 to a direct GET of it), so the quota came from the API's
//! pod spec; the node's capacity is published through the status subresource; a pod with the
//! same environment and no resource is untouched (no ledger, no hook): the container's own
//! environment never provisions anything.
//!
//! Needs root, the containerd cache (`cargo xtask setup`) and the built binaries.
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use e2e::{
    containerd::{workload_path, ContainerId, ContainerSpec, Containerd},
    timeout, wait_for, FakeNode, TempDir, GIB,
};

mod kube_api;

use kube_api::{api_pod, ApiServer, NODE, RESOURCE, TOKEN};

/// Allocations that fit a 1 GiB quota with one 518 MiB context (256 MiB) and one that does
/// not (512 MiB more).
const OVER: [&str; 4] = ["ctx 0", "alloc a 256m", "expect-oom alloc b 512m", "meminfo"];

fn run_workload(containerd: &Containerd, container: &ContainerId, env: &[&str]) -> Result<Vec<String>> {
    let workload = workload_path();
    let argv: Vec<&str> = ["env"].into_iter().chain(env.iter().copied()).chain([workload.as_str()]).chain(OVER).collect();
    let out = containerd.exec_sync(container, &argv)?;
    ensure!(out.exit_code == 0, "{argv:?} in the container: {out:?}");
    Ok(out.stdout.lines().map(str::to_owned).collect())
}

#[test]
fn the_quota_comes_from_the_pod_spec_through_the_api_and_the_capacity_is_published() -> Result<()> {
    let api = ApiServer::start()?;
    let dir = TempDir::new("kube-quota")?;
    let account = dir.path().join("serviceaccount");
    api.service_account(&account)?;
    std::fs::create_dir_all(dir.path().join("ledgers"))?;
    // The pod without the resource is there from the start (the agent's list has it).
    api.add_pod(api_pod("team-b", "web", "uid-kube-b", None), true);

    let fake = FakeNode::new("kube-quota").with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "518m");
    let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
    let agent = api.agent(&fake, dir.path(), &account, &[])?;
    wait_for(timeout(), "the agent watching the node's pods", || Ok(api.with(|s| !s.watches.is_empty()))).with_context(|| agent.log())?;

    // The node's capacity: the 8 GiB GPU, through the status subresource.
    wait_for(timeout(), "the node's capacity published", || Ok(api.with(|s| s.node["status"]["capacity"][RESOURCE] == "8589934592")))
        .with_context(|| agent.log())?;
    let seen = api.seen();
    let patch = seen.iter().find(|r| r.method == "PATCH").context("no PATCH")?;
    ensure!(patch.target.starts_with(&format!("/api/v1/nodes/{NODE}/status")), "{patch:?}");
    ensure!(patch.body.contains(r#""path":"/status/capacity/vramguard.io~1gpu-memory""#), "{patch:?}");
    let list = seen.iter().find(|r| r.target.starts_with("/api/v1/pods?") && !r.target.contains("watch=")).context("no list")?;
    ensure!(list.target.contains(&format!("fieldSelector=spec.nodeName%3D{NODE}")), "{list:?}");

    // The pod with the quota reaches the agent through the watch only.
    api.add_pod(api_pod("team-a", "trainer", "uid-kube-a", Some("1Gi")), false);
    // (The event is on a loopback connection the agent reads at once; this only leaves it
    // the moment to, before the runtime asks about the pod.)
    std::thread::sleep(Duration::from_secs(1));
    let spec = || -> Result<ContainerSpec> { ContainerSpec::new("main").env("CUDA_DEVICE_MEMORY_LIMIT", "64g").fake_driver(&fake) };
    let pod = containerd.pod("trainer", "team-a", "uid-kube-a", &[])?;
    let main = containerd.run_container(&pod, &spec()?)?;
    let env = containerd.container_env(&main)?;
    ensure!(env.contains(&format!("CUDA_DEVICE_MEMORY_LIMIT={GIB}")), "the agent's value replaces the spec's: {env:?}");
    ensure!(env.iter().any(|e| e == "VRAMGUARD_LEDGER=/run/vramguard/ledger"), "{env:?}");
    let audit = agent.audit()?;
    let record = audit["provisioned"].as_array().and_then(|rows| rows.iter().find(|r| r["container_id"] == main.0.as_str()).cloned());
    let record = record.context("the agent has no record of the container")?;
    ensure!(record["quota"] == GIB && record["source"] == "kubernetes", "{record}");
    ensure!(!api.seen().iter().any(|r| r.target.starts_with("/api/v1/namespaces/team-a/pods/trainer")), "a GET of the pod: the quota must have come from the watch");
    for lines in [run_workload(&containerd, &main, &[])?, run_workload(&containerd, &main, &["CUDA_DEVICE_MEMORY_LIMIT=64g"])?] {
        ensure!(lines.iter().any(|l| l == "oom b"), "past 1 GiB must be refused: {lines:?}");
        let meminfo = lines.iter().find(|l| l.starts_with("meminfo")).context("no meminfo line")?;
        ensure!(meminfo.contains(&format!("total={GIB}")), "the quota is the GPU the workload sees: {meminfo}");
    }

    // Negative control: the same environment, no resource: untouched.
    let pod = containerd.pod("web", "team-b", "uid-kube-b", &[])?;
    let web = containerd.run_container(&pod, &spec()?)?;
    let env = containerd.container_env(&web)?;
    ensure!(!env.iter().any(|e| e.starts_with("VRAMGUARD_")), "{env:?}");
    ensure!(env.iter().any(|e| e == "CUDA_DEVICE_MEMORY_LIMIT=64g"), "its own value, unchanged: {env:?}");
    let mounts = containerd.container_mounts(&web)?;
    let injected = |dest: &str| dest.starts_with("/run/vramguard") || dest.starts_with("/usr/lib/vramguard") || dest == "/etc/ld.so.preload";
    ensure!(!mounts.iter().any(|(dest, _, _)| injected(dest)), "{mounts:?}");
    let audit = agent.audit()?;
    ensure!(!audit["provisioned"].as_array().is_some_and(|rows| rows.iter().any(|r| r["container_id"] == web.0.as_str())), "no record for it");
    ensure!(api.seen().iter().all(|r| r.authorization.as_deref() == Some(&format!("Bearer {TOKEN}"))), "every request carries the token");
    drop(agent);
    fake.cleanup();
    Ok(())
}
