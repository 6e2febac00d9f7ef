//! The API server's bad minute does not stop the node's containers (issue 24, item 4, Must
//! show): the agent runs as a real containerd's NRI plugin with `--kube` alone and
//! `--refuse-overcommit` on one GPU of 8 GiB, its pods created through CRI. The API server
//! (`kube_api/`) first serves the node's pods, then fails as a real one does: every request
//! answered 500, every request left unanswered (the agent's lookups time out), connections
//! refused. In each of these, with fresh pods:
//!
//! * a pod known to have no quota, a pod the node knows nothing of, and a static pod (its
//!   sandbox has the kubelet's `kubernetes.io/config.source: file`) are created, untouched;
//! * a pod known to have a quota (1 GiB, seen by the watch before) is provisioned with it;
//! * a pod known to have a quota that cannot be provisioned (8 GiB on a GPU that holds quotas
//!   already) is refused, with an error that says why;
//! * every answer comes within the runtime's deadline (no creation fails for time).
//!
//! When the server is back after the first outage and tells of the pod the node knew nothing
//! of, with a quota, that container (started untouched) is held to it by its cgroup limit.
//!
//! Then the agent restarts while the API server still refuses connections: what the node knew
//! before (the pod cache's last state in the state directory) still decides: a pod known to
//! have a quota is provisioned with it, one known without is untouched. The decisions made
//! without the API are counted by kind (`vramguard_provision_decisions_without_api_total`)
//! and logged.
//!
//! Needs root, the containerd cache (`cargo xtask setup`) and the built binaries.
mod kube_api;

use std::{os::unix::fs::MetadataExt as _, time::Instant};

use anyhow::{ensure, Context, Result};
use e2e::{
    agent::Agent,
    containerd::{ContainerId, ContainerSpec, Containerd},
    http, timeout, wait_for, FakeNode, TempDir, GIB,
};
use kube_api::{api_pod, ApiServer, Mode};
use serde_json::Value;

/// The pods the API server knows before it fails, for a round `tag`: one with a 1 GiB quota,
/// one with 8 GiB, one without.
fn known_pods(api: &ApiServer, tag: &str) {
    api.add_pod(api_pod("team-a", &format!("trainer-{tag}"), &format!("uid-trainer-{tag}"), Some("1Gi")), true);
    api.add_pod(api_pod("team-a", &format!("big-{tag}"), &format!("uid-big-{tag}"), Some("8Gi")), true);
    api.add_pod(api_pod("team-b", &format!("web-{tag}"), &format!("uid-web-{tag}"), None), true);
}

struct Round<'a> {
    containerd: &'a Containerd,
    fake: &'a FakeNode,
    agent: &'a Agent,
    tag: &'a str,
}

impl Round<'_> {
    /// Creates and starts container `main` of a new pod; the error of a refused creation.
    fn run(&self, name: &str, namespace: &str, annotations: &[(&str, &str)]) -> Result<ContainerId> {
        let name = format!("{name}-{}", self.tag);
        let pod = self.containerd.pod(&name, namespace, &format!("uid-{name}"), annotations)?;
        let began = Instant::now();
        let made = self.containerd.run_container(&pod, &ContainerSpec::new("main").fake_driver(self.fake)?);
        eprintln!("{name}: created in {:?}", began.elapsed());
        made
    }

    /// The agent's record of container `id`.
    fn record(&self, id: &ContainerId) -> Result<Option<Value>> {
        let audit = self.agent.audit()?;
        Ok(audit["provisioned"].as_array().and_then(|rows| rows.iter().find(|r| r["container_id"] == id.0.as_str()).cloned()))
    }

    /// Created, with nothing of the agent's: no record, no injected variable or mount.
    fn untouched(&self, name: &str, namespace: &str, annotations: &[(&str, &str)]) -> Result<ContainerId> {
        let id = self.run(name, namespace, annotations).with_context(|| format!("{name}-{} must be created", self.tag))?;
        let env = self.containerd.container_env(&id)?;
        ensure!(!env.iter().any(|e| e.starts_with("VRAMGUARD_") || e.starts_with("CUDA_DEVICE_MEMORY_LIMIT=")), "{name}: {env:?}");
        let mounts = self.containerd.container_mounts(&id)?;
        ensure!(!mounts.iter().any(|(dest, _, _)| dest.starts_with("/run/vramguard") || dest == "/etc/ld.so.preload"), "{name}: {mounts:?}");
        ensure!(self.record(&id)?.is_none(), "{name}: the agent has a record of it");
        Ok(id)
    }

    /// Provisioned with 1 GiB from `source`.
    fn provisioned(&self, name: &str, source: &str) -> Result<()> {
        let id = self.run(name, "team-a", &[]).with_context(|| format!("{name}-{} must be created", self.tag))?;
        let record = self.record(&id)?.with_context(|| format!("{name}-{} is not provisioned", self.tag))?;
        ensure!(record["quota"] == GIB && record["source"] == source, "{record}");
        ensure!(self.containerd.container_env(&id)?.contains(&format!("CUDA_DEVICE_MEMORY_LIMIT={GIB}")));
        Ok(())
    }

    /// Refused with the agent's reason.
    fn refused(&self, name: &str) -> Result<()> {
        let error = self.run(name, "team-a", &[]).map(|id| id.0).expect_err("an 8 GiB quota on a GPU holding quotas already");
        let error = format!("{error:#}");
        ensure!(error.contains("GPU 0 has") && error.contains("would overcommit") && !error.contains("not provisioned within"), "{error}");
        Ok(())
    }

    /// Every kind of pod, with the API server failing as it does now; the container of the
    /// pod the node knew nothing of.
    fn all_kinds(&self) -> Result<ContainerId> {
        self.untouched("web", "team-b", &[])?;
        let unknown = self.untouched("batch", "team-c", &[])?;
        self.untouched("etcd", "kube-system", &[("kubernetes.io/config.source", "file")])?;
        self.provisioned("trainer", "kubernetes")?;
        self.refused("big")?;
        Ok(unknown)
    }
}

fn decisions(agent: &Agent, decision: &str) -> Result<f64> {
    let all = http::fresh_scrape(agent.metrics_addr()?)?;
    Ok(http::metric(&all, "vramguard_provision_decisions_without_api_total", &[("decision", decision)]).unwrap_or(0.0))
}

#[test]
fn with_the_api_server_down_only_a_known_quota_that_cannot_be_provisioned_is_refused() -> Result<()> {
    let api = ApiServer::start()?;
    let dir = TempDir::new("kube-down")?;
    let account = dir.path().join("serviceaccount");
    api.service_account(&account)?;
    std::fs::create_dir_all(dir.path().join("ledgers"))?;
    for tag in ["up", "failing", "hanging", "refusing", "restart"] {
        known_pods(&api, tag);
    }
    let fake = FakeNode::new("kube-down").with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "518m");
    let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
    let agent = api.agent(&fake, dir.path(), &account, &["--refuse-overcommit"])?;
    wait_for(timeout(), "the agent watching the node's pods", || Ok(api.with(|s| !s.watches.is_empty()))).with_context(|| agent.log())?;
    let remembered = dir.path().join("state/pods.json");
    wait_for(timeout(), "the pod cache's state written", || Ok(std::fs::read_to_string(&remembered).is_ok_and(|t| t.contains("trainer-restart"))))?;

    // The API answers: decided by it (a control), nothing decided without it.
    let up = Round { containerd: &containerd, fake: &fake, agent: &agent, tag: "up" };
    up.untouched("web", "team-b", &[]).context("control")?;
    up.provisioned("trainer", "kubernetes").context("control")?;
    for kind in ["known_quota", "known_no_quota", "unknown", "static_pod", "refused"] {
        ensure!(decisions(&agent, kind)? == 0.0, "{kind} counted with the API up: {}", agent.log());
    }

    for (mode, tag) in [(Mode::Failing, "failing"), (Mode::Hanging, "hanging"), (Mode::Refusing, "refusing")] {
        api.set_mode(mode);
        eprintln!("the API server: {mode:?}");
        let unknown = Round { containerd: &containerd, fake: &fake, agent: &agent, tag }
            .all_kinds()
            .with_context(|| format!("{mode:?}: {}", agent.log()))?;
        if mode == Mode::Failing {
            // Back up, the server tells of the unknown pod, with a quota (its watch lagged the
            // kubelet's): its container, started untouched, is held to it by its cgroup.
            api.set_mode(Mode::Up);
            api.add_pod(api_pod("team-c", "batch-failing", "uid-batch-failing", Some("1Gi")), true);
            let cgroup = std::fs::metadata(containerd.container_cgroup(&unknown)?)?.ino();
            wait_for(timeout(), "the unknown pod's cgroup held to its quota", || {
                let audit = agent.audit()?;
                Ok(audit["kernel_maps"]["cgroup_limits"].as_array().is_some_and(|ids| ids.iter().any(|id| id.as_u64() == Some(cgroup))))
            })
            .with_context(|| agent.log())?;
            ensure!(agent.log().contains("a container created while its quota was unknown has one"), "{}", agent.log());
        }
    }
    ensure!(decisions(&agent, "unknown")? >= 3.0 && decisions(&agent, "static_pod")? >= 3.0, "{}", agent.log());
    let log = agent.log();
    ensure!(log.contains("decided without the Kubernetes API") && log.contains("static_pod") && log.contains("unknown"), "{log}");

    // Restarted while the API server refuses connections: the state on disk decides.
    drop(agent);
    let agent = api.agent(&fake, dir.path(), &account, &["--refuse-overcommit"])?;
    let restart = Round { containerd: &containerd, fake: &fake, agent: &agent, tag: "restart" };
    restart.provisioned("trainer", "kubernetes (last known state)")?;
    restart.untouched("web", "team-b", &[])?;
    restart.untouched("batch", "team-c", &[])?;
    restart.refused("big")?;
    for kind in ["known_quota", "known_no_quota", "unknown"] {
        ensure!(decisions(&agent, kind)? >= 1.0, "no {kind} decision counted: {}", agent.log());
    }
    drop(agent);
    fake.cleanup();
    Ok(())
}
