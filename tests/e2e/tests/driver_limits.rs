//! The driver's own limit (issue "The driver's own limit", Must show), with a real containerd
//! and the fake driver as an r615 driver (`FAKECUDA_DRIVER_VERSION=615.…`: per-cgroup limits
//! through NVML, an allocation past a cgroup's hard limit refused) or as driver 580 (the
//! limits answer `NOT_SUPPORTED`): the agent provisions from a quota file (`team-a` 1 GiB)
//! under `--enforce signal`.
//!
//! * On "r615": an un-hooked process, a renamed libcuda copy used at once and a forked child
//!   of a provisioned container are refused by the driver at the quota, nobody is signalled,
//!   and the audit shows the driver's figure; an honest job at its quota is refused by the
//!   hook, never stopped; the limit is set before the container's first process runs; an
//!   agent restart sets a limit gone meanwhile; removing the container clears its limits; a
//!   pod's own `NVIDIA_GPU_MEMORY_LIMIT` is replaced by the operator's quota.
//! * On "580": the agent says why the driver's limits are not in force, and the same escaping
//!   process is stopped by the probes' signal, as before.
//!
//! The StartContainer and environment tests also run on containerd 2 (`*_on_containerd_2`).
//!
//! Needs the containerd cache (`cargo xtask setup`) and the built binaries (`cargo xtask test`).
use std::{
    ffi::{OsStr, OsString},
    path::PathBuf,
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use e2e::{
    agent::{provisioning_args, Agent},
    containerd::{workload_path, ContainerId, ContainerSpec, Containerd, Exec, PodId},
    timeout, wait_for, FakeNode, TempDir, GIB, MIB,
};
use serde_json::Value;

const QUOTA: u64 = GIB;
/// What a driver of r615 or later calls itself here.
const R615: &str = e2e::R615_DRIVER_VERSION;

/// A node whose fake driver is `version`, a containerd with NRI, and the agent provisioning
/// `team-a` at 1 GiB under `--enforce signal`.
struct Node {
    dir: TempDir,
    fake: FakeNode,
    containerd: Containerd,
    agent: Option<Agent>,
}

impl Node {
    fn new(tag: &str, version: &str) -> Result<Node> {
        Node::with_env(tag, version, &[])
    }

    /// [`Node::new`] with these `FAKECUDA_*` settings too.
    fn with_env(tag: &str, version: &str, env: &[(&str, &str)]) -> Result<Node> {
        let dir = TempDir::new(tag)?;
        // Contexts of 64 MiB: the driver counts them against the limit, as it counts all a
        // cgroup's processes hold.
        let fake = FakeNode::new(tag)
            .with_env("FAKECUDA_DEVICE_BYTES", "8g")
            .with_env("FAKECUDA_CONTEXT_BYTES", "64m")
            .with_env("FAKECUDA_DRIVER_VERSION", version);
        let fake = env.iter().fold(fake, |fake, (key, value)| fake.with_env(key, value));
        std::fs::create_dir_all(dir.path().join("ledgers"))?;
        std::fs::write(dir.path().join("quotas"), "namespace=team-a 1g\n")?;
        let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
        let mut node = Node { dir, fake, containerd, agent: None };
        node.start_agent()?;
        Ok(node)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn start_agent(&mut self) -> Result<()> {
        let mut args = provisioning_args(&self.path("nri.sock"), &self.path("state"), &self.path("quotas"), "8g")?;
        if self.path("limits").exists() {
            args.extend(["--limits".into(), self.path("limits").into()]);
        }
        let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
        let mut all: Vec<OsString> = vec![
            "--libcuda".into(),
            libcuda.into(),
            "--no-discover".into(),
            "--ledger-dir".into(),
            self.path("ledgers").into(),
            "--metrics-addr".into(),
            "127.0.0.1:0".into(),
            "--enforce".into(),
            "signal".into(),
            "--cgroup2-separates-containers".into(),
        ];
        all.extend(args);
        let all: Vec<&OsStr> = all.iter().map(OsString::as_os_str).collect();
        let agent = Agent::start_with_env(&all, self.fake.env())?;
        wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true)).with_context(|| agent.log())?;
        self.agent = Some(agent);
        Ok(())
    }

    fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("the agent runs")
    }

    /// A `team-a` pod and its container `main` running `command` (sleeping where empty),
    /// with the fake driver and `env`.
    fn pod(&self, name: &str, uid: &str, env: &[(&str, &str)], command: &[&str]) -> Result<(PodId, ContainerId)> {
        let pod = self.containerd.pod(name, "team-a", uid, &[])?;
        let mut spec = ContainerSpec::new("main").fake_driver(&self.fake)?;
        for (key, value) in env {
            spec = spec.env(key, value);
        }
        if !command.is_empty() {
            spec = spec.command(command.iter().copied());
        }
        let container = self.containerd.run_container(&pod, &spec)?;
        Ok((pod, container))
    }

    /// The container's driver limits as the agent last read them back (`vramguard audit`).
    fn limits(&self, id: &ContainerId) -> Result<Value> {
        let audit = self.agent().audit()?;
        Ok(audit["driver_limits"]["containers"][id.0.as_str()].clone())
    }

    /// Waits until the agent reads back the quota as the container's hard limit on GPU 0.
    fn wait_held(&self, id: &ContainerId) -> Result<Value> {
        wait_value("the container held by the driver", || {
            let limits = self.limits(id)?;
            Ok((limits["held"] == true && limits["gpus"][0]["hard"].as_u64() == Some(QUOTA)).then_some(limits))
        })
        .with_context(|| format!("audit: {}", self.agent().audit().map(|a| a["driver_limits"].to_string()).unwrap_or_default()))
    }

    /// Whether the probes hold container `id`'s cgroup to a limit (the kernel's map has it).
    fn probe_limited(&self, id: &ContainerId) -> Result<bool> {
        let cgroup_id = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(self.containerd.container_cgroup(id)?)?);
        let audit = self.agent().audit()?;
        Ok(audit["kernel_maps"]["cgroup_limits"].as_array().is_some_and(|ids| ids.iter().any(|id| id.as_u64() == Some(cgroup_id))))
    }

    /// The cgroup of container `id`, relative to the cgroup2 root.
    fn cgroup(&self, id: &ContainerId) -> Result<String> {
        self.containerd.container_cgroup_path(id)
    }

    /// Runs the workload's `steps` in `main` outside the hook: in a mount namespace of its
    /// own with an empty `/run/vramguard` (the hook finds no limits) and `LD_LIBRARY_PATH` at
    /// `libs` where given (a renamed copy of the driver).
    fn escape(&self, main: &ContainerId, libs: Option<&str>, steps: &str) -> Result<Exec> {
        let path = libs.map(|l| format!("LD_LIBRARY_PATH={l} ")).unwrap_or_default();
        let script = format!(
            "mount -t tmpfs tmpfs /run/vramguard && test ! -e /run/vramguard/limits && exec env {path}CUDA_DEVICE_MEMORY_LIMIT=64g {} {steps}",
            workload_path()
        );
        self.containerd.exec_sync(main, &["busybox", "unshare", "-r", "-m", "sh", "-c", &script])
    }

    /// The signals the agent and the probes sent.
    fn signals(&self) -> Result<u64> {
        let audit = self.agent().audit()?;
        audit["stats"]["signals_sent"].as_u64().context("no signals_sent in the audit")
    }
}

/// Waits until `check` gives a value (within the e2e timeout) and returns it.
fn wait_value<T>(what: &str, mut check: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let mut got = None;
    wait_for(timeout(), what, || {
        got = check()?;
        Ok(got.is_some())
    })?;
    got.context("wait_for returned without a value")
}

/// A renamed copy of the fake driver inside the container, made at once before its use:
/// the directory to put on `LD_LIBRARY_PATH`.
const RENAMED: &str = "mkdir -p /tmp/renamed && cp \"$LD_LIBRARY_PATH/libcuda.so.1\" /tmp/renamed/libnotcuda.so && ln -sf /tmp/renamed/libnotcuda.so /tmp/renamed/libcuda.so.1";

#[test]
fn on_an_r615_node_escaping_processes_meet_the_driver_s_limit_and_nobody_is_signalled() -> Result<()> {
    let node = Node::new("dl-615", R615)?;
    let audit = node.agent().audit()?;
    ensure!(audit["driver_limits"]["gpus"][0]["in_force"] == true, "the driver's limits are in force on GPU 0: {}", audit["driver_limits"]);
    // The container's own process: hooked, honest, holding 300 MiB and its context.
    let workload = workload_path();
    let (_pod, main) = node.pod("trainer", "uid-615", &[], &[workload.as_str(), "ctx 0", "alloc a 300m", "hold"])?;
    let limits = node.wait_held(&main)?;
    ensure!(node.fake.driver_limit(&node.cgroup(&main)?, 0)?.is_some_and(|(soft, hard, _)| soft == 0 && hard == QUOTA), "the fake driver holds the quota");
    eprintln!("driver limits read back: {limits}");
    // The cgroup the driver holds gets no probe limit.
    wait_for(timeout(), "no probe limit on the held cgroup", || Ok(!node.probe_limited(&main)?))?;
    // The audit shows the driver's figure for the container: all its processes hold.
    let seen = wait_value("the driver's figure in the audit", || {
        let used = node.limits(&main)?["gpus"][0]["used"].as_u64().unwrap_or(0);
        Ok((used >= 364 * MIB).then_some(used))
    })?;
    eprintln!("the driver counts {} MiB in the container", seen / MIB);

    // 660 MiB of the quota left. Un-hooked (the hook sees no limits): the driver refuses
    // what passes the quota, and the process goes on (it is not killed).
    let unhooked = node.escape(&main, None, "'ctx 0' 'alloc a 256m' 'expect-oom alloc b 512m' 'alloc c 128m'")?;
    ensure!(unhooked.exit_code == 0, "the un-hooked process runs on: {unhooked:?}");
    ensure!(unhooked.stdout.contains("oom b") && unhooked.stdout.contains("ok alloc c"), "refused past the quota, granted within it: {unhooked:?}");

    // A renamed copy of libcuda, used at once.
    let made = node.containerd.exec_sync(&main, &["sh", "-c", RENAMED])?;
    ensure!(made.exit_code == 0, "{made:?}");
    let renamed = node.escape(&main, Some("/tmp/renamed"), "'ctx 0' 'alloc a 256m' 'expect-oom alloc b 512m'")?;
    ensure!(renamed.exit_code == 0 && renamed.stdout.contains("oom b"), "the copy is held by the driver: {renamed:?}");

    // A forked child: the parent's 256 MiB and the child's context and 512 MiB would pass
    // the quota together: the child is refused.
    let forked = node.escape(&main, None, "'ctx 0' 'alloc a 256m' 'fork ctx 0; expect-oom alloc b 512m'")?;
    ensure!(forked.exit_code == 0 && forked.stdout.contains("child oom b"), "the child is held by the driver: {forked:?}");
    ensure!(node.signals()? == 0, "nobody was signalled: {}", node.agent().audit()?["stats"]);
    node.fake.cleanup();
    Ok(())
}

#[test]
fn on_an_r615_node_an_honest_job_at_its_quota_is_refused_never_stopped() -> Result<()> {
    let node = Node::new("dl-honest", R615)?;
    let (_pod, main) = node.pod("trainer", "uid-honest", &[], &[])?;
    node.wait_held(&main)?;
    let workload = workload_path();
    // The hook's ledger reserves the agent's context allowance (518 MiB) for the context.
    let out = node.containerd.exec_sync(&main, &[workload.as_str(), "ctx 0", "alloc a 256m", "expect-oom alloc b 512m", "alloc c 128m", "meminfo"])?;
    ensure!(out.exit_code == 0, "the honest job runs on: {out:?}");
    ensure!(out.stdout.contains("oom b") && out.stdout.contains("ok alloc c"), "{out:?}");
    ensure!(out.stdout.contains(&format!("total={QUOTA}")), "the hook shows the quota: {out:?}");
    std::thread::sleep(Duration::from_secs(2));
    ensure!(node.signals()? == 0, "nobody was signalled");
    node.fake.cleanup();
    Ok(())
}

#[test]
fn the_limit_is_set_before_the_first_process_runs_and_goes_with_the_container() -> Result<()> {
    let node = Node::new("dl-first", R615)?;
    // The container's own first process allocates past the quota at once, outside the hook
    // (its limits hidden under an empty /run/vramguard): the driver's limit is already there.
    let script = format!(
        "mount -t tmpfs tmpfs /run/vramguard && exec env CUDA_DEVICE_MEMORY_LIMIT=64g {} 'ctx 0' 'expect-oom alloc a 1100m' 'alloc b 512m' hold",
        workload_path()
    );
    let (pod, main) = node.pod("first", "uid-first", &[], &["busybox", "unshare", "-r", "-m", "sh", "-c", &script])?;
    let log = wait_value("the first process's answer", || {
        let log = node.containerd.container_log(&pod, &main)?;
        Ok(log.contains("ok alloc b").then_some(log))
    })?;
    ensure!(log.contains("oom a"), "refused by the driver at its very first allocation: {log:?}");
    let cgroup = node.cgroup(&main)?;
    ensure!(node.fake.driver_limit(&cgroup, 0)?.is_some(), "set");
    node.containerd.remove_pod(&pod)?;
    wait_for(timeout(), "the limit gone with the container", || Ok(node.fake.driver_limit(&cgroup, 0)?.is_none()))?;
    wait_for(timeout(), "the container gone from the audit", || Ok(node.limits(&main)?.is_null()))?;
    node.fake.cleanup();
    Ok(())
}

/// NVML hangs (every call sleeps 5 s, as a lost GPU's can): the container is answered within
/// the runtime's deadline and starts, nobody is held by the driver, and the probes hold the
/// quota as on an older driver.
#[test]
fn a_hung_nvml_delays_no_container_and_holds_nobody() -> Result<()> {
    let node = Node::with_env("dl-hang", R615, &[("FAKECUDA_NVML", "hang"), ("FAKECUDA_NVML_HANG_MS", "5000")])?;
    let began = std::time::Instant::now();
    let (_pod, main) = node.pod("trainer", "uid-hang", &[], &[])?;
    eprintln!("created and started in {:?} with NVML hanging", began.elapsed());
    ensure!(node.limits(&main)?["held"] != true, "not held");
    wait_for(timeout(), "the container's cgroup limit pushed to the probes", || node.probe_limited(&main))?;
    let over = node.escape(&main, None, "'ctx 0' 'alloc a 512m' 'alloc b 1g'")?;
    ensure!(over.exit_code == 137, "the escaped process is killed by the probes: {over:?}");
    node.fake.cleanup();
    Ok(())
}

/// A cgroup the limits file names (a pod without a quota) gets the rule's limit in the driver
/// on every GPU too; the probes keep holding it to the rule's total (not held by the driver).
#[test]
fn a_limits_file_rule_s_cgroups_get_the_driver_s_limit_too() -> Result<()> {
    let mut node = Node::new("dl-rules", R615)?;
    let parent = node.containerd.cgroup_parent().to_string();
    std::fs::write(node.path("limits"), format!("{parent}/poduid-ruled/* 512m\n"))?;
    node.agent.take().context("agent")?.stop()?;
    node.start_agent()?;
    let pod = node.containerd.pod("web", "team-b", "uid-ruled", &[])?;
    let main = node.containerd.run_container(&pod, &ContainerSpec::new("main").fake_driver(&node.fake)?)?;
    let cgroup = node.cgroup(&main)?;
    wait_for(timeout(), "the rule's limit in the driver", || Ok(node.fake.driver_limit(&cgroup, 0)?.is_some_and(|(_, hard, _)| hard == 512 * MIB)))
        .with_context(|| node.agent().log())?;
    let audit = node.agent().audit()?;
    let row = &audit["driver_limits"]["containers"][format!("limits file: {cgroup}").as_str()];
    ensure!(row["held"] == false && row["gpus"][0]["hard"].as_u64() == Some(512 * MIB), "set, not held: {}", audit["driver_limits"]);
    node.fake.cleanup();
    Ok(())
}

#[test]
fn an_agent_restart_sets_a_limit_gone_meanwhile() -> Result<()> {
    let mut node = Node::new("dl-restart", R615)?;
    let (_pod, main) = node.pod("trainer", "uid-restart", &[], &[])?;
    node.wait_held(&main)?;
    node.agent.take().context("agent")?.stop()?;
    let cgroup = node.cgroup(&main)?;
    node.fake.clear_driver_limit(&cgroup, 0)?;
    ensure!(node.fake.driver_limit(&cgroup, 0)?.is_none(), "cleared while the agent was away");
    // A container made while the agent was away: never provisioned (no hook), held by its
    // cgroup limit once the agent is back, and bounded by the driver too.
    let (_late_pod, late) = node.pod("late", "uid-late", &[], &[])?;
    node.start_agent()?;
    node.wait_held(&main)?;
    ensure!(node.fake.driver_limit(&cgroup, 0)?.is_some_and(|(_, hard, _)| hard == QUOTA), "set again");
    let late_cgroup = node.cgroup(&late)?;
    wait_for(timeout(), "the late container's bound in the driver", || Ok(node.fake.driver_limit(&late_cgroup, 0)?.is_some_and(|(_, hard, _)| hard == QUOTA)))
        .with_context(|| node.agent().log())?;
    ensure!(node.limits(&late)?["held"] == false, "a bound, not held: the probes keep it");
    node.fake.cleanup();
    Ok(())
}

/// A stand-in for NVIDIA's toolkit CDI hook `apply-cuda-memory-limits` (a `createRuntime`
/// hook): it reads the container's environment from the bundle's `config.json`, does nothing
/// unless both `NVIDIA_GPU_MEMORY_REQUEST` and `_LIMIT` are set, parses each as whole MiB
/// (failing the creation, as the toolkit does, on anything else) and records the soft and hard
/// limits it would set, in bytes, in the file its argument names.
const TOOLKIT_HOOK: &str = r#"
import json, os, sys
state = json.load(sys.stdin)
config = json.load(open(os.path.join(state["bundle"], "config.json")))
env = dict(e.split("=", 1) for e in config["process"]["env"] if "=" in e)
out = sys.argv[1]
request, limit = env.get("NVIDIA_GPU_MEMORY_REQUEST"), env.get("NVIDIA_GPU_MEMORY_LIMIT")
if request is None or limit is None:
    open(out, "w").write("off\n")
    sys.exit(0)
try:
    soft, hard = int(request) * 1024 * 1024, int(limit) * 1024 * 1024
except ValueError:
    sys.stderr.write("apply-cuda-memory-limits: not MiB: %r %r\n" % (request, limit))
    sys.exit(1)
open(out, "w").write("set soft=%d hard=%d\n" % (soft, hard))
"#;

/// The NVIDIA toolkit's CDI device `nvidia.com/gpu=0` in the node's CDI directory, carrying
/// [`TOOLKIT_HOOK`] writing to `out`.
fn toolkit_cdi(node: &Node, out: &std::path::Path) -> Result<()> {
    let script = node.path("apply-cuda-memory-limits.py");
    std::fs::write(&script, TOOLKIT_HOOK)?;
    let spec = serde_json::json!({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [{"name": "0", "containerEdits": {
        "env": ["TOOLKIT_GPU=0"],
        "hooks": [{"hookName": "createRuntime", "path": "/usr/bin/python3", "args": ["python3", script, out]}]
    }}]});
    std::fs::write(node.containerd.cdi_dir().join("nvidia.json"), serde_json::to_vec(&spec)?)?;
    Ok(())
}

#[test]
fn a_pod_s_own_nvidia_gpu_memory_limit_is_replaced_by_the_operator_s_quota() -> Result<()> {
    let node = Node::new("dl-env", R615)?;
    let out = node.path("toolkit-hook");
    toolkit_cdi(&node, &out)?;
    let run = |name: &str, env: &[(&str, &str)]| -> Result<ContainerId> {
        let pod = node.containerd.pod(name, "team-a", &format!("uid-{name}"), &[])?;
        let mut spec = ContainerSpec::new("main").fake_driver(&node.fake)?.cdi_device("nvidia.com/gpu=0");
        for (key, value) in env {
            spec = spec.env(key, value);
        }
        node.containerd.run_container(&pod, &spec)
    };
    // A pod asking the toolkit for 80 GiB (in a form the hook would refuse, too): the hook
    // sees the operator's quota in MiB and a request of 0, the container is created, and the
    // driver holds it to the quota.
    let greedy = run("greedy", &[("NVIDIA_GPU_MEMORY_LIMIT", "80g"), ("NVIDIA_GPU_MEMORY_REQUEST", "80g"), ("NVIDIA_GPU_MEMORY_LIMITS", "81920")])?;
    let env = node.containerd.container_env(&greedy)?;
    let toolkit: Vec<&String> = env.iter().filter(|e| e.starts_with("NVIDIA_GPU_MEMORY_")).collect();
    ensure!(
        toolkit == [&format!("NVIDIA_GPU_MEMORY_LIMIT={}", QUOTA >> 20), "NVIDIA_GPU_MEMORY_REQUEST=0", &format!("NVIDIA_GPU_MEMORY_LIMITS={}", QUOTA >> 20)],
        "the operator's quota, the pod's names only: {env:?}"
    );
    let hook = std::fs::read_to_string(&out)?;
    ensure!(hook == format!("set soft=0 hard={QUOTA}\n"), "the toolkit's hook: {hook:?}");
    node.wait_held(&greedy)?;
    ensure!(node.fake.driver_limit(&node.cgroup(&greedy)?, 0)?.is_some_and(|(soft, hard, _)| soft == 0 && hard == QUOTA), "the agent's limit stands");
    let escaped = node.escape(&greedy, None, "'ctx 0' 'alloc a 900m' 'expect-oom alloc b 512m'")?;
    ensure!(escaped.exit_code == 0 && escaped.stdout.contains("oom b"), "{escaped:?}");
    // A pod that sets neither: none is added, the hook stays off.
    let plain = run("plain", &[])?;
    let env = node.containerd.container_env(&plain)?;
    ensure!(!env.iter().any(|e| e.starts_with("NVIDIA_GPU_MEMORY_")), "none added: {env:?}");
    ensure!(std::fs::read_to_string(&out)? == "off\n", "the hook stays off");
    node.wait_held(&plain)?;
    node.fake.cleanup();
    Ok(())
}

#[test]
fn on_a_580_node_the_agent_says_why_not_and_holds_the_quota_as_before() -> Result<()> {
    let node = Node::new("dl-580", "580.65.06")?;
    let (_pod, main) = node.pod("trainer", "uid-580", &[], &[])?;
    let why = wait_value("the audit says why the driver's limits are not in force", || {
        let audit = node.agent().audit()?;
        let gpu = &audit["driver_limits"]["gpus"][0];
        Ok((gpu["in_force"] == false).then(|| gpu["why_not"].as_str().unwrap_or_default().to_string()))
    })?;
    ensure!(why.to_lowercase().contains("not supported") || why.contains("NOT_SUPPORTED"), "{why:?}");
    ensure!(node.limits(&main)?["held"] == false, "not held by the driver");
    wait_for(timeout(), "the container's cgroup limit pushed to the probes", || node.probe_limited(&main))?;
    // As before: the escaped process is killed at the allocation by the probes, and so is a
    // forked child's allocation past the quota.
    let over = node.escape(&main, None, "'ctx 0' 'alloc a 512m' 'alloc b 1g'")?;
    ensure!(over.exit_code == 137, "the escaped process must be killed: {over:?}");
    let forked = node.escape(&main, None, "'ctx 0' 'alloc a 256m' 'fork ctx 0; alloc b 1g'")?;
    ensure!(forked.stdout.contains("signal=9"), "the child must be killed: {forked:?}");
    // A renamed copy no probe is on: the driver's view shows its memory, and the agent
    // signals it once two reads showed the container over its quota (the driver's figure
    // less a context at the agent's allowance, 1 GiB by default, and a page).
    let made = node.containerd.exec_sync(&main, &["sh", "-c", RENAMED])?;
    ensure!(made.exit_code == 0, "{made:?}");
    let renamed = node.escape(&main, Some("/tmp/renamed"), "'ctx 0' 'alloc a 1g' 'alloc b 1100m' hold")?;
    ensure!(renamed.exit_code == 137 && renamed.stdout.contains("ok alloc b"), "the copy's holder must be signalled: {renamed:?}");
    ensure!(node.signals()? >= 1, "signalled");
    ensure!(node.fake.driver_limit(&node.cgroup(&main)?, 0)?.is_none(), "no driver limit on a 580 node");
    node.fake.cleanup();
    Ok(())
}

#[test]
fn the_limit_is_set_before_the_first_process_runs_and_goes_with_the_container_on_containerd_2() -> Result<()> {
    e2e::containerd::Version::V2.run(the_limit_is_set_before_the_first_process_runs_and_goes_with_the_container)
}

#[test]
fn a_pod_s_own_nvidia_gpu_memory_limit_is_replaced_by_the_operator_s_quota_on_containerd_2() -> Result<()> {
    e2e::containerd::Version::V2.run(a_pod_s_own_nvidia_gpu_memory_limit_is_replaced_by_the_operator_s_quota)
}
