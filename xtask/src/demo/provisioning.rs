//! The demo's second scene: quotas provisioned by the runtime. A private containerd with NRI
//! (`e2e::containerd`, from the cache `cargo xtask setup` fills) and `vramguard run --nri`
//! with a quota file selecting namespace [`QUOTA_NAMESPACE`]; two pods made through the CRI
//! API as a kubelet would, [`PROVISIONED`] in that namespace and [`PLAIN`] in another, each
//! running a fake-driver workload that holds memory. The scene prints what the runtime
//! injected into each container (the vramguard env and mounts of the runtime spec containerd
//! gave runc), the same allocations exec'd in both (refused past the quota in the provisioned
//! one, also with `CUDA_DEVICE_MEMORY_LIMIT=64g` in its environment; granted in the other),
//! the `vramguard audit` table (`ok` and `unhooked`) and the agent's provisioned list; then
//! it removes the pods (the agent drops their ledgers), stops the agent and containerd.
//!
//! [`check_transcript`] and [`check_clean`] are this scene's part of the demo's check.
use std::{
    ffi::{OsStr, OsString},
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, ensure, Context, Result};
use e2e::{
    agent::{provisioning_args, Agent},
    cgroup,
    containerd::{workload_path, ContainerId, ContainerSpec, Containerd},
    timeout, wait_for, FakeNode, TempDir, GIB,
};

use super::{audit, audit_states, states, Transcript, AGENT_STOPPED};

/// The namespace the quota file gives a quota, and the quota.
const QUOTA_NAMESPACE: &str = "team-a";
const QUOTA: u64 = 2 * GIB;
const QUOTA_FILE: &str = "namespace=team-a 2g\n";

/// A pod of the scene: its name, namespace, uid, and the steps its container's workload
/// holds memory with.
struct Pod {
    name: &'static str,
    namespace: &'static str,
    uid: &'static str,
    holds: &'static [&'static str],
    what: &'static str,
}

/// In the quota's namespace: provisioned.
const PROVISIONED: Pod = Pod {
    name: "trainer",
    namespace: QUOTA_NAMESPACE,
    uid: "demo-trainer",
    holds: &["ctx 0", "alloc weights 256m", "hold"],
    what: "a quota-file rule selects it: provisioned; holds a context + 256 MiB",
};

/// In a namespace no rule names: left alone.
const PLAIN: Pod = Pod {
    name: "web",
    namespace: "team-b",
    uid: "demo-web",
    holds: &["ctx 0", "alloc scratch 2g", "hold"],
    what: "no rule names its namespace: not provisioned; holds a context + 2 GiB",
};

/// What both containers are asked to do once they hold their memory: 256 MiB and then 1 GiB
/// more, which the provisioned one's quota cannot fit (its two contexts, 518 MiB each, and
/// 256 MiB held + 256 MiB: 1.5 GiB of 2 GiB).
const ASK: [&str; 4] = ["ctx 0", "meminfo", "alloc a 256m", "alloc b 1g"];
/// The workload's line for the refused step.
const REFUSED: &str = "oom b";
/// The environment the provisioned workload is re-run with: a lie about its limit.
const LYING_ENV: &str = "CUDA_DEVICE_MEMORY_LIMIT=64g";
/// The scene's heading.
const SCENE: &str = "######## scene 2";
/// How the scene's agent's log lines are prefixed in the transcript.
const AGENT_PREFIX: &str = "   nri agent: ";
/// What an un-provisioned container's injection shows as.
const NOTHING_INJECTED: &str = "nothing injected";

/// What the scene made, to be found gone afterwards, and what the check looks for.
pub struct Footprint {
    /// Host pids of the two containers' workloads.
    pub provisioned_pid: u32,
    pub plain_pid: u32,
    /// Their container ids.
    pub provisioned_id: String,
    pub plain_id: String,
    /// The scene's directory (NRI socket, quota file, state and ledger directories).
    pub dir: PathBuf,
    /// containerd's own directory (its root, state, sockets; the shims name it).
    pub containerd_dir: PathBuf,
    /// containerd's cgroup parent under the cgroup2 mount (every pod's cgroup is below it).
    pub cgroup_parent: PathBuf,
    /// The agent's directory (socket, log).
    pub agent_dir: PathBuf,
    /// The fake node's name and the directory of its device files.
    pub node: String,
    pub state_dir: PathBuf,
}

/// The scene, on the fake driver (see [`why_fake_only`] for `--libcuda`).
pub fn show(out: &mut Transcript, real_driver: Option<&Path>) -> Result<Footprint> {
    writeln!(out, "\n\n{SCENE}: quotas provisioned by the runtime (containerd's NRI) ########")?;
    if let Some(path) = real_driver {
        writeln!(out, "   (this scene runs on the fake driver, not on {}: {})", path.display(), why_fake_only())?;
    }
    let dir = TempDir::new("demo-nri")?;
    let path = |name: &str| dir.path().join(name);
    let node = FakeNode::new("demo-nri").with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "518m");
    fs::create_dir_all(path("ledgers"))?;
    fs::write(path("quotas"), QUOTA_FILE)?;
    let containerd = Containerd::start(&path("nri.sock"))
        .context("starting a private containerd with NRI (its binaries come from `cargo xtask setup`)")?;
    let versions: Vec<&str> = containerd.cache().versions().lines().collect();
    writeln!(out, "== a private containerd with NRI on {} ({})", path("nri.sock").display(), versions.join(", "))?;
    writeln!(out, "   a fake GPU of 8 GiB (FAKECUDA_NODE={}) whose contexts take 518 MiB, as the agent's ledgers charge them", node.name())?;
    writeln!(out, "   quota file {}: {}", path("quotas").display(), QUOTA_FILE.trim_end())?;

    let args = provisioning_args(&path("nri.sock"), &path("state"), &path("quotas"), "8g")?;
    let shown: Vec<String> = args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    writeln!(out, "== starting: vramguard run {} --ledger-dir {}", shown.join(" "), path("ledgers").display())?;
    let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
    let agent = Agent::watching(&path("ledgers"), &args)?;
    wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true))
        .with_context(|| format!("the agent's log: {}", agent.log()))?;
    writeln!(out, "   registered with containerd as an NRI plugin: containerd asks it about every container it creates")?;

    writeln!(out, "\n== two pods, made through the CRI API as a kubelet makes them; each runs the fake-driver workload")?;
    let mut made = Vec::new();
    for pod in [&PROVISIONED, &PLAIN] {
        let pod_id = containerd.pod(pod.name, pod.namespace, pod.uid, &[])?;
        let command: Vec<String> = [workload_path()].into_iter().chain(pod.holds.iter().map(|s| s.to_string())).collect();
        let spec = ContainerSpec::new("main").command(command).fake_driver(&node)?;
        let id = containerd.run_container(&pod_id, &spec)?;
        let pid = containerd.container_pid(&id)?;
        writeln!(out, "-- {}/{}: container main {}, pid {pid}: {}", pod.namespace, pod.name, short(&id.0), pod.what)?;
        made.push((pod, pod_id, id, pid));
    }
    let [(_, provisioned_pod, provisioned, provisioned_pid), (_, plain_pod, plain, plain_pid)] = &made[..] else {
        bail!("two pods were made");
    };

    writeln!(out, "\n== what the runtime injected (vramguard's env and mounts in the spec containerd gave runc)")?;
    for (pod, id) in [(&PROVISIONED, provisioned), (&PLAIN, plain)] {
        injected(out, &containerd, pod, id)?;
    }

    writeln!(out, "\n== the same workload exec'd in each: {}", ASK.join(", "))?;
    let asked_provisioned: Vec<String> = ASK.iter().map(|s| if s.ends_with(" 1g") { format!("expect-oom {s}") } else { s.to_string() }).collect();
    let asked_provisioned: Vec<&str> = asked_provisioned.iter().map(String::as_str).collect();
    writeln!(out, "-- {}: the hook, preloaded through the injected /etc/ld.so.preload, holds it to its ledger's 2 GiB", PROVISIONED.name)?;
    exec(out, &containerd, provisioned, PROVISIONED.name, &[], &asked_provisioned)?;
    writeln!(out, "-- {} again with {LYING_ENV} in its environment: the limit is the agent's ledger's, not the env's", PROVISIONED.name)?;
    exec(out, &containerd, provisioned, &format!("{} ({LYING_ENV})", PROVISIONED.name), &[LYING_ENV], &asked_provisioned)?;
    writeln!(out, "-- {}: nothing preloaded, so nothing refuses (the fake GPU's 8 GiB is the only bound)", PLAIN.name)?;
    exec(out, &containerd, plain, PLAIN.name, &[], &ASK)?;

    wait_for(timeout(), "the agent reports the provisioned workload ok and the other unhooked", || {
        let states = states(&agent)?;
        Ok([(*provisioned_pid, "ok"), (*plain_pid, "unhooked")].iter().all(|(pid, want)| states.iter().any(|(p, s)| p == pid && s == want)))
    })
    .with_context(|| format!("the agent's log: {}", agent.log()))?;
    audit(out, &agent, &format!("both containers hold GPU memory (pid {provisioned_pid}: {}, pid {plain_pid}: {})", PROVISIONED.name, PLAIN.name))?;
    provisioned_list(out, &agent)?;

    writeln!(out, "\n== removing both pods through CRI: the agent drops the provisioned container's ledger and record")?;
    for pod_id in [provisioned_pod, plain_pod] {
        containerd.remove_pod(pod_id)?;
    }
    let ledger = path("ledgers").join(&provisioned.0);
    wait_for(timeout(), "the removed container's ledger and record gone", || {
        Ok(agent.audit()?["provisioned"].as_array().is_some_and(Vec::is_empty) && !ledger.exists())
    })
    .with_context(|| format!("the agent's log: {}", agent.log()))?;
    writeln!(out, "   provisioned list empty, {} gone", ledger.display())?;

    let footprint = Footprint {
        provisioned_pid: *provisioned_pid,
        plain_pid: *plain_pid,
        provisioned_id: provisioned.0.clone(),
        plain_id: plain.0.clone(),
        dir: dir.path().to_path_buf(),
        containerd_dir: containerd.socket().parent().map(Path::to_path_buf).context("containerd's socket has no directory")?,
        cgroup_parent: cgroup::cgroup2_root()?.join(containerd.cgroup_parent().trim_start_matches('/')),
        agent_dir: agent.dir().to_path_buf(),
        node: node.name().to_string(),
        state_dir: node.state_dir().to_path_buf(),
    };
    writeln!(out, "\n== stopping the agent (SIGTERM) and containerd")?;
    let log = agent.stop().context("the NRI agent did not stop cleanly")?;
    for line in log.lines().filter(|l| ["provisioned container gone", AGENT_STOPPED].iter().any(|w| l.contains(w))) {
        writeln!(out, "{AGENT_PREFIX}{line}")?;
    }
    drop(containerd);
    drop(node);
    drop(dir);
    writeln!(out, "== done: containerd and its shims stopped; its cgroups, mounts and directories, the fake device's files removed")?;
    Ok(footprint)
}

/// Why `--libcuda` does not carry into this scene.
pub fn why_fake_only() -> &'static str {
    "the test harness's containers get no GPU device nodes (/dev/nvidia*: no CRI devices are passed), \
     so a real libcuda inside them could not open the GPU"
}

/// The first 12 characters of a container id, as `crictl` shows them.
fn short(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

/// Whether an env entry or a mount destination is one vramguard's provisioning adds.
fn ours_env(entry: &str) -> bool {
    let name = entry.split('=').next().unwrap_or_default();
    name.starts_with("VRAMGUARD_")
        || name.starts_with("CUDA_DEVICE_MEMORY_")
        || ["POD_NAME", "POD_NAMESPACE", "POD_UID", "CONTAINER_NAME", "LD_PRELOAD"].contains(&name)
}

fn ours_mount(destination: &str) -> bool {
    destination.starts_with("/run/vramguard") || destination.starts_with("/usr/lib/vramguard") || destination == "/etc/ld.so.preload"
}

/// Prints vramguard's env entries and mounts in the container's runtime spec.
fn injected(out: &mut Transcript, containerd: &Containerd, pod: &Pod, id: &ContainerId) -> Result<()> {
    let label = format!("{}/{}", pod.namespace, pod.name);
    let env: Vec<String> = containerd.container_env(id)?.into_iter().filter(|e| ours_env(e)).collect();
    let mounts: Vec<(String, String, Vec<String>)> =
        containerd.container_mounts(id)?.into_iter().filter(|(dest, _, _)| ours_mount(dest)).collect();
    if env.is_empty() && mounts.is_empty() {
        writeln!(out, "   {label}: {NOTHING_INJECTED} (no VRAMGUARD_/CUDA_DEVICE_MEMORY_ env, no hook, no ledger)")?;
        return Ok(());
    }
    for entry in env {
        writeln!(out, "   {label}: env   {entry}")?;
    }
    for (dest, source, options) in mounts {
        let mode = if options.iter().any(|o| o == "ro") { "ro" } else { "rw" };
        writeln!(out, "   {label}: mount {dest} ({mode}) <- {source}")?;
    }
    Ok(())
}

/// Runs the workload with `steps` in `container` (after `env`), printing its output.
fn exec(out: &mut Transcript, containerd: &Containerd, container: &ContainerId, label: &str, env: &[&str], steps: &[&str]) -> Result<()> {
    let workload = workload_path();
    let argv: Vec<&str> = ["env"].into_iter().chain(env.iter().copied()).chain([workload.as_str()]).chain(steps.iter().copied()).collect();
    let result = containerd.exec_sync(container, &argv)?;
    // `ready pid=<n>` names the pid in the container's namespace: only confusing here.
    for line in result.stdout.lines().filter(|l| !l.starts_with("ready ")) {
        writeln!(out, "   {label}: {line}")?;
    }
    for line in result.stderr.lines() {
        writeln!(out, "   {label} (stderr): {line}")?;
    }
    ensure!(result.exit_code == 0, "{argv:?} in container {} exited with {}", short(&container.0), result.exit_code);
    Ok(())
}

/// Prints the agent's provisioned list (`vramguard audit --json`, `provisioned`).
fn provisioned_list(out: &mut Transcript, agent: &Agent) -> Result<()> {
    writeln!(out, "-- provisioned (vramguard audit --json: .provisioned)")?;
    let audit = agent.audit()?;
    let rows = audit["provisioned"].as_array().context("the audit has no provisioned list")?;
    for row in rows {
        let text = |key: &str| row[key].as_str().unwrap_or("?").to_string();
        let quota = row["quota"].as_u64().map_or_else(|| "?".into(), |q| format!("{} MiB", q >> 20));
        writeln!(
            out,
            "   {}  {}/{}/{}  quota {} per GPU  from the {}  cgroup {}",
            short(&text("container_id")),
            text("namespace"),
            text("pod"),
            text("container"),
            quota,
            text("source"),
            text("cgroups_path")
        )?;
    }
    if rows.is_empty() {
        writeln!(out, "   (none)")?;
    }
    Ok(())
}

/// Checks the scene's text: injection in the provisioned container and none in the other,
/// the refusal (also under the lying env), the other's allocation granted, the audit's `ok`
/// and `unhooked`, the provisioned list naming only the provisioned container, and the
/// agent's clean stop.
pub fn check_transcript(text: &str, footprint: &Footprint) -> Result<()> {
    let Some((_, scene)) = text.split_once(SCENE) else {
        bail!("the transcript has no {SCENE:?} (provisioning through containerd)");
    };
    let lines: Vec<&str> = scene.lines().map(str::trim).collect();
    let has = |line: &str| lines.contains(&line);
    let provisioned = format!("{}/{}:", PROVISIONED.namespace, PROVISIONED.name);
    for want in [
        format!("{provisioned} env   VRAMGUARD_LEDGER=/run/vramguard/ledger"),
        format!("{provisioned} env   CUDA_DEVICE_MEMORY_LIMIT={QUOTA}"),
    ] {
        ensure!(has(&want), "no {want:?} line: the provisioned container's env was not injected");
    }
    for dest in ["/etc/ld.so.preload", "/run/vramguard/ledger", "/usr/lib/vramguard/libvramguard.so"] {
        let want = format!("{provisioned} mount {dest} ");
        ensure!(lines.iter().any(|l| l.starts_with(&want)), "no {want:?} line: the provisioned container got no mount at {dest}");
    }
    let plain = format!("{}/{}:", PLAIN.namespace, PLAIN.name);
    ensure!(
        lines.iter().any(|l| l.starts_with(&format!("{plain} {NOTHING_INJECTED}"))),
        "no \"{plain} {NOTHING_INJECTED}\" line for the un-provisioned container"
    );
    ensure!(
        !lines.iter().any(|l| l.starts_with(&format!("{plain} env")) || l.starts_with(&format!("{plain} mount"))),
        "the un-provisioned container shows injected env or mounts"
    );
    for label in [PROVISIONED.name.to_string(), format!("{} ({LYING_ENV})", PROVISIONED.name)] {
        let want = format!("{label}: {REFUSED}");
        ensure!(has(&want), "no {want:?} line: the provisioned container's over-quota allocation was not refused");
    }
    ensure!(
        lines.iter().any(|l| l.starts_with(&format!("{}: ok alloc b ", PLAIN.name))),
        "no \"{}: ok alloc b\" line: the un-provisioned container's allocation was not granted",
        PLAIN.name
    );
    for (name, pid, want) in [(PROVISIONED.name, footprint.provisioned_pid, "ok"), (PLAIN.name, footprint.plain_pid, "unhooked")] {
        let states = audit_states(scene, pid);
        ensure!(states.contains(&want), "no audit row shows the {name} workload (pid {pid}) {want}: its rows say {states:?}");
    }
    let listed = |id: &str| lines.iter().any(|l| l.starts_with(short(id)) && l.contains(" quota "));
    ensure!(listed(&footprint.provisioned_id), "the provisioned list does not name container {}", short(&footprint.provisioned_id));
    ensure!(!listed(&footprint.plain_id), "the provisioned list names the un-provisioned container {}", short(&footprint.plain_id));
    ensure!(
        scene.lines().any(|l| l.starts_with(AGENT_PREFIX) && l.contains(AGENT_STOPPED)),
        "the NRI agent's {AGENT_STOPPED:?} line is missing"
    );
    Ok(())
}

/// What the scene left behind: its directories and cgroups, mounts under its directories,
/// processes naming containerd's directory (containerd, its shims), the fake node's files.
pub fn leftovers(footprint: &Footprint) -> Result<Vec<String>> {
    let mut left = Vec::new();
    for dir in [&footprint.dir, &footprint.containerd_dir, &footprint.cgroup_parent, &footprint.agent_dir] {
        if fs::symlink_metadata(dir).is_ok() {
            left.push(dir.display().to_string());
        }
    }
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").context("cannot read /proc/self/mountinfo")?;
    for point in mountinfo.lines().filter_map(|line| line.split_whitespace().nth(4)) {
        if [&footprint.dir, &footprint.containerd_dir].iter().any(|dir| Path::new(point).starts_with(dir)) {
            left.push(format!("mount {point}"));
        }
    }
    let needle = footprint.containerd_dir.to_string_lossy().into_owned();
    for entry in fs::read_dir("/proc").context("cannot list /proc")?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        // A process that exits meanwhile has no cmdline to read: gone.
        let Ok(cmdline) = fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(&needle) {
            left.push(format!("process {pid} ({})", cmdline.trim_end()));
        }
    }
    left.extend(super::node_files(&footprint.node, &footprint.state_dir)?);
    Ok(left)
}
