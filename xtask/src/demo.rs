//! `cargo xtask demo`, and the check of it that `cargo xtask test` runs.
//!
//! The demo starts `vramguard run --ledger-dir DIR --metrics-addr 127.0.0.1:0` against the
//! fake driver (no GPU needed), DIR holding one directory per container with its ledger, as
//! the DaemonSet mounts them, and runs three containers, each a cgroup of its own:
//! [`TRAINING`] (hooked, within its quota), [`INFERENCE`] (hooked, one allocation refused over
//! its quota with `CUDA_ERROR_OUT_OF_MEMORY`) and [`BATCH`] (not hooked at all). It prints the
//! `vramguard audit` table and the interesting lines of `/metrics` at each stage, SIGKILLs the
//! training workload to show its ledger slot reclaimed, lets the others exit, stops the agent
//! and removes everything it made.
//!
//! A second scene ([`provisioning`]) shows quotas provisioned by the runtime: a private
//! containerd with NRI, `vramguard run --nri` with a quota file, a pod the file gives a quota
//! next to one it does not, what containerd injected into each, the same allocations refused
//! in one and granted in the other, and the audit (`ok`, `unhooked`). It runs on the fake
//! driver also under `--libcuda` (and says why); without the containerd cache of `cargo xtask
//! setup` the demo fails with that advice.
//!
//! One implementation serves both uses: [`show`] writes through a [`Transcript`] (stdout, and
//! kept as text). `cargo xtask demo` is [`demo`]: build, then [`show`]. `cargo xtask test`
//! (and `cargo xtask demo --check`) runs [`check`]: the same [`show`], then
//! [`check_transcript`] on its text (the refusal, the un-hooked process reported `unhooked`,
//! the reclaim, the agent stopped cleanly; scene 2's injection, refusals and states) and
//! [`check_clean`] on the machine (no cgroup, fake device file, directory, mount, child
//! process, containerd or shim left behind).
use std::{
    ffi::OsStr,
    fmt::Write as _,
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use e2e::{
    agent::Agent,
    cgroup::{self, TestCgroup},
    http::{self, Sample},
    ledgers, wait_for, FakeNode, Running, TempDir, Workload, GIB,
};

use crate::{build_ebpf, cargo, run, setup};

mod provisioning;

/// A container of the demo: its name (also its ledger's directory and its pod name), its
/// quota under the hook (`None`: not hooked), and its workload's steps, which reach a
/// `checkpoint up` holding their memory.
pub struct Container {
    pub name: &'static str,
    pub quota: Option<u64>,
    pub steps: &'static [&'static str],
    pub what: &'static str,
}

/// Hooked, within its quota; SIGKILLed later without freeing, so its slot is reclaimed.
pub const TRAINING: Container = Container {
    name: "training",
    quota: Some(4 * GIB),
    steps: &["ctx 0", "alloc weights 1g", "alloc activations 512m", "managed staging 64m", "checkpoint up", "hold"],
    what: "hooked, 4 GiB quota, holds 1.5 GiB + 64 MiB managed",
};

/// Hooked, pushed over its quota: its second allocation is refused by the hook.
pub const INFERENCE: Container = Container {
    name: "inference",
    quota: Some(GIB),
    steps: &["ctx 0", "meminfo", "alloc model 512m", "expect-oom alloc cache 1g", "checkpoint up", "free model"],
    what: "hooked, 1 GiB quota, asks for 512 MiB and then 1 GiB more",
};

/// Not hooked at all (no `LD_PRELOAD`): only the eBPF probes see it.
pub const BATCH: Container = Container {
    name: "batch",
    quota: None,
    steps: &["ctx 0", "alloc scratch 2g", "vmm cache 512m", "checkpoint up", "free scratch", "vmm-free cache"],
    what: "not hooked, holds 2 GiB + 512 MiB of VMM memory",
};

/// Which driver the demo runs on.
#[derive(Clone, Debug)]
pub enum Driver {
    /// The fake driver (`tests/fakecuda`): a 16 GiB fake GPU of the demo's own, 64 MiB contexts.
    Fake,
    /// The libcuda file at this path (a real GPU's driver): the agent probes it and the
    /// workloads load the `libcuda.so.1` of its directory. Contexts are bigger there (the
    /// hook charges 518 MiB each by default), so every quota is raised by [`REAL_SLACK`].
    Real(PathBuf),
}

/// What a real driver's quotas get on top of the fake's: a real context (518 MiB charged)
/// against the fake's 64 MiB, rounded up. [`INFERENCE`]'s refusal still happens (518 MiB +
/// 512 MiB fits 2 GiB, 1 GiB more does not).
pub const REAL_SLACK: u64 = GIB;

/// The step of [`INFERENCE`] that its quota refuses, as the workload reports it.
const REFUSED: &str = "oom cache";

/// The agent's last log line on a clean stop (agent/src/run.rs).
const AGENT_STOPPED: &str = "vramguard agent stopped";

/// What the demo prints: echoed to stdout as it is written, and kept.
#[derive(Default)]
pub struct Transcript {
    text: String,
}

impl Transcript {
    pub fn text(&self) -> &str {
        &self.text
    }
}

impl std::fmt::Write for Transcript {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        print!("{s}");
        self.text.push_str(s);
        Ok(())
    }
}

/// What one run of the demo made, to be found gone afterwards, and its workloads' pids.
pub struct Footprint {
    pub training: u32,
    pub inference: u32,
    pub batch: u32,
    /// The fake node's name (`FAKECUDA_NODE`) and the directory of its device files.
    node: String,
    state_dir: PathBuf,
    /// The ledger root given to `--ledger-dir`.
    ledger_root: PathBuf,
    /// The agent's own directory (socket, log).
    agent_dir: PathBuf,
    /// The cgroups' directories.
    cgroups: Vec<PathBuf>,
    /// What the second scene (provisioning through containerd) made.
    provisioning: provisioning::Footprint,
}

/// `cargo xtask demo [--check] [--libcuda PATH]`: builds what it runs, then [`show`] (with
/// `--check`: [`check`], as `cargo xtask test` runs it).
pub fn demo(checked: bool, driver: Driver) -> Result<()> {
    require_root()?;
    if let Driver::Real(path) = &driver {
        ensure!(path.is_file(), "--libcuda {}: no such file", path.display());
    }
    setup::setup()?;
    build_ebpf()?;
    run(cargo().args(["build", "-p", "agent", "-p", "fakecuda", "-p", "workload", "-p", "hook"]))?;
    if checked {
        check(&driver)?;
        println!("the demo's output and clean-up check: ok");
        return Ok(());
    }
    show(&mut Transcript::default(), &driver).map(|_| ())
}

/// The demo's check in `cargo xtask test` (the binaries are built by then): [`show`], then
/// [`check_transcript`] and [`check_clean`].
pub fn check(driver: &Driver) -> Result<()> {
    require_root()?;
    let mut transcript = Transcript::default();
    let footprint = show(&mut transcript, driver)?;
    check_transcript(transcript.text(), &footprint).context("the demo's output")?;
    check_clean(&footprint, Children::All).context("the demo's clean-up")
}

fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the demo loads eBPF programs and creates cgroups: run it as root");
    }
    Ok(())
}

/// Runs the demo on `driver`, writing to `out`; everything it made is gone when it returns.
pub fn show(out: &mut Transcript, driver: &Driver) -> Result<Footprint> {
    let node = FakeNode::new("demo").with_env("FAKECUDA_DEVICE_BYTES", "16g");
    let root = TempDir::new("demo")?;
    let libcuda = match driver {
        Driver::Fake => {
            writeln!(out, "== a fake GPU of 16 GiB (FAKECUDA_NODE={}); ledger root {}", node.name(), root.path().display())?;
            e2e::fake_driver_dir()?.join("libcuda.so.1")
        }
        Driver::Real(path) => {
            writeln!(out, "== the driver at {}; ledger root {}", path.display(), root.path().display())?;
            writeln!(out, "   (every quota below is raised by {} MiB for the real driver's bigger contexts)", REAL_SLACK >> 20)?;
            path.clone()
        }
    };
    writeln!(
        out,
        "== starting: vramguard run --libcuda {} --no-discover --ledger-dir {} --metrics-addr 127.0.0.1:0",
        libcuda.display(),
        root.path().display()
    )?;
    // The agent gets the fake node's variables, so that the fake NVML it loads reads the
    // node's devices (without them it answers for a node of its own, with no process on it,
    // and the audit's DRIVER column stays empty while the driver view says `ok`).
    let env = match driver {
        Driver::Fake => node.env(),
        Driver::Real(_) => &[],
    };
    let agent = Agent::start_with_env(
        &[
            OsStr::new("--libcuda"),
            libcuda.as_os_str(),
            OsStr::new("--no-discover"),
            OsStr::new("--ledger-dir"),
            root.path().as_os_str(),
            OsStr::new("--metrics-addr"),
            OsStr::new("127.0.0.1:0"),
        ],
        env,
    )?;
    let addr = agent.metrics_addr()?;
    writeln!(out, "   serving http://{addr}/metrics")?;

    let cgroup_root = cgroup::cgroup2_root()?;
    let mut cgroups = Vec::new();
    let mut running = Vec::new();
    writeln!(out, "\n== three containers, each in a cgroup of its own")?;
    for container in [&TRAINING, &INFERENCE, &BATCH] {
        let group = TestCgroup::create(&format!("demo-{}", container.name))?;
        let mut workload = match (container.quota, driver) {
            (Some(quota), Driver::Fake) => node.hooked(&root.ledger(container.name)?, quota)?,
            (Some(quota), Driver::Real(path)) => real_driver_workload(path)
                .env("LD_PRELOAD", e2e::hook_lib()?)
                .env("CUDA_DEVICE_MEMORY_LIMIT", (quota + REAL_SLACK).to_string())
                .env("VRAMGUARD_LEDGER", root.ledger(container.name)?),
            (None, Driver::Fake) => node.workload(),
            (None, Driver::Real(path)) => real_driver_workload(path),
        };
        if container.quota.is_some() {
            workload = workload.env("POD_NAMESPACE", "demo").env("POD_NAME", container.name).env("CONTAINER_NAME", "main");
        }
        workload = workload.in_cgroup(&group).steps(container.steps.iter().copied());
        let mut process = workload.spawn()?;
        writeln!(out, "-- {}: pid {}, {} ({})", container.name, process.pid(), container.what, group.path)?;
        until_up(out, container, &mut process)?;
        cgroups.push(cgroup_root.join(group.path.trim_start_matches('/')));
        running.push((process, group));
    }
    let [(training, _), (inference, _), (batch, _)] = &running[..] else {
        bail!("three workloads were started");
    };
    let pids = (training.pid(), inference.pid(), batch.pid());
    wait_for(Duration::from_secs(10), "the agent reports the hooked workloads ok and the other unhooked", || {
        let states = states(&agent)?;
        Ok([(pids.0, "ok"), (pids.1, "ok"), (pids.2, "unhooked")]
            .iter()
            .all(|(pid, want)| states.iter().any(|(p, state)| p == pid && state == want)))
    })
    .with_context(|| format!("the agent's log: {}", agent.log()))?;
    audit(out, &agent, "all three hold GPU memory")?;
    let families = [
        "vramguard_container_memory_limit_bytes",
        "vramguard_container_memory_used_bytes",
        "vramguard_container_ebpf_memory_bytes",
        "vramguard_container_rejections_total",
        "vramguard_ebpf_process_memory_bytes",
        "vramguard_process_state",
        "vramguard_unhooked_processes",
    ];
    // Of the per-kind and per-state series, only those that say something.
    let telling = |s: &Sample| match s.name.as_str() {
        "vramguard_container_memory_used_bytes" => s.value != 0.0,
        "vramguard_process_state" => s.value == 1.0,
        name => families.contains(&name),
    };
    metrics(out, addr, telling)?;

    let (training, training_group) = running.remove(0);
    let training_ledger = root.ledger(TRAINING.name)?;
    writeln!(out, "\n== SIGKILL the training workload (pid {}): it frees nothing", pids.0)?;
    let killed = Instant::now();
    training.kill()?;
    drop(training_group);
    wait_for(Duration::from_secs(5), "the killed workload's ledger slot reclaimed", || Ok(ledgers::slots(&training_ledger)?.is_empty()))
        .with_context(|| format!("the agent's log: {}", agent.log()))?;
    writeln!(out, "   its ledger slot was reclaimed {} ms after the kill", killed.elapsed().as_millis())?;
    audit(out, &agent, "after the reclaim")?;
    let training_path = training_ledger.display().to_string();
    metrics(out, addr, |s| {
        matches!(s.name.as_str(), "vramguard_reclaims_total" | "vramguard_reclaim_latency_seconds_count")
            || (s.name == "vramguard_container_memory_used_bytes" && s.label("ledger") == training_path)
    })?;

    writeln!(out, "\n== the inference and batch workloads free their memory and exit")?;
    for (process, group) in running.drain(..) {
        process.wait()?.success()?;
        drop(group);
    }
    // Uprobes are global: other processes using the fake driver on this machine may show too.
    wait_for(Duration::from_secs(5), "the agent sees none of the demo's processes", || {
        Ok(states(&agent)?.iter().all(|(pid, _)| ![pids.1, pids.2].contains(pid)))
    })?;
    audit(out, &agent, "everything freed")?;

    let agent_dir = agent.dir().to_path_buf();
    writeln!(out, "\n== stopping the agent (SIGTERM)")?;
    let log = agent.stop().context("the agent did not stop cleanly")?;
    for line in log.lines().filter(|l| ["reclaimed the slot", "stopping", AGENT_STOPPED].iter().any(|w| l.contains(w))) {
        writeln!(out, "   agent: {line}")?;
    }
    let (node_name, state_dir, ledger_root) = (node.name().to_string(), node.state_dir().to_path_buf(), root.path().to_path_buf());
    drop(node);
    drop(root);
    writeln!(out, "== done: probes detached; the cgroups, the fake device's files and the ledger root removed")?;

    let real = match driver {
        Driver::Fake => None,
        Driver::Real(path) => Some(path.as_path()),
    };
    let provisioning = provisioning::show(out, real)?;
    Ok(Footprint {
        training: pids.0,
        inference: pids.1,
        batch: pids.2,
        node: node_name,
        state_dir,
        ledger_root,
        agent_dir,
        cgroups,
        provisioning,
    })
}

/// A workload that loads the `libcuda.so.1` (and NVML) of `libcuda`'s directory.
fn real_driver_workload(libcuda: &Path) -> Workload {
    let dir = libcuda.parent().map_or_else(|| PathBuf::from("/"), Path::to_path_buf);
    Workload::new().lib_dir(dir)
}

/// Echoes the workload's lines (and what the hook said on its stderr) until `checkpoint up`.
fn until_up(out: &mut Transcript, container: &Container, process: &mut Running) -> Result<()> {
    loop {
        let line = process.next_line()?;
        if line == "checkpoint up" {
            break;
        }
        writeln!(out, "   {}: {line}", container.name)?;
    }
    if container.steps.iter().any(|s| s.starts_with("expect-oom")) {
        // The hook's one line about the first refusal is written before the refusal returns;
        // the thread collecting stderr may lag behind stdout a little. Not there: shown as such.
        let said = wait_for(Duration::from_secs(2), "the hook's refusal message", || Ok(!process.stderr().is_empty()));
        if said.is_err() {
            writeln!(out, "   {} (stderr): nothing", container.name)?;
        }
    }
    for line in process.stderr().lines() {
        writeln!(out, "   {} (stderr): {line}", container.name)?;
    }
    Ok(())
}

/// (pid, state) of every process in the agent's audit.
fn states(agent: &Agent) -> Result<Vec<(u32, String)>> {
    let audit = agent.audit()?;
    let rows = audit["processes"].as_array().context("the audit has no process list")?;
    Ok(rows
        .iter()
        .filter_map(|row| {
            let pid = u32::try_from(row["pid"].as_u64()?).ok()?;
            Some((pid, row["state"].as_str().unwrap_or("-").to_string()))
        })
        .collect())
}

/// Prints `vramguard audit` as the agent answers it now.
fn audit(out: &mut Transcript, agent: &Agent, stage: &str) -> Result<()> {
    writeln!(out, "\n== {stage}: vramguard audit")?;
    let output = agent.audit_table()?;
    if !output.status.success() {
        bail!("vramguard audit failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    write!(out, "{}", String::from_utf8_lossy(&output.stdout))?;
    Ok(())
}

/// Prints the lines of a `/metrics` scrape whose sample `wanted` keeps, as they were served.
fn metrics(out: &mut Transcript, addr: SocketAddr, wanted: impl Fn(&Sample) -> bool) -> Result<()> {
    writeln!(out, "-- GET /metrics (selected lines)")?;
    let body = http::fresh(addr)?;
    for line in body.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
        if http::parse_metrics(line)?.iter().any(&wanted) {
            writeln!(out, "   {line}")?;
        }
    }
    Ok(())
}

/// The metric samples the transcript shows.
fn shown_samples(text: &str) -> Result<Vec<Sample>> {
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| l.starts_with("vramguard_")).collect();
    http::parse_metrics(&lines.join("\n"))
}

/// The states an audit table in the transcript gave process `pid` (its rows: the pid first,
/// the state last).
fn audit_states(text: &str, pid: u32) -> Vec<&str> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next()?.parse::<u32>().ok()? == pid).then(|| words.last()).flatten()
        })
        .collect()
}

/// The DRIVER column of `pid`'s rows in the audit tables of `text` (`-` where the driver view
/// has no figure for it; a figure ends with its unit).
fn audit_driver(text: &str, pid: u32) -> Vec<&str> {
    text.lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            (words.first()?.parse::<u32>().ok()? == pid && words.len() >= 2).then(|| words[words.len() - 2])
        })
        .collect()
}

/// Checks the demo's text: the over-quota allocation refused (the workload's `oom` line, the
/// hook's message, the rejection counted), the hooked workloads `ok` and the un-hooked one
/// `unhooked` in an audit table (and counted), the killed workload's slot reclaimed, and the
/// agent stopped cleanly.
pub fn check_transcript(text: &str, footprint: &Footprint) -> Result<()> {
    let refused = format!("{}: {REFUSED}", INFERENCE.name);
    ensure!(text.lines().any(|l| l.trim() == refused), "no {refused:?} line: the over-quota allocation was not refused");
    let hook_said = format!("{} (stderr): vramguard: GPU memory quota exceeded", INFERENCE.name);
    ensure!(
        text.lines().any(|l| l.trim().starts_with(&hook_said) && l.contains("returning CUDA_ERROR_OUT_OF_MEMORY")),
        "no line from the hook saying it refused the over-quota allocation ({hook_said:?} ... CUDA_ERROR_OUT_OF_MEMORY)"
    );
    let samples = shown_samples(text)?;
    let over_quota_ledger = format!("/{}/ledger", INFERENCE.name);
    ensure!(
        samples
            .iter()
            .any(|s| s.name == "vramguard_container_rejections_total" && s.label("ledger").ends_with(&over_quota_ledger) && s.value >= 1.0),
        "no vramguard_container_rejections_total of the {} ledger counting the refusal",
        INFERENCE.name
    );
    for (name, pid, want) in
        [(TRAINING.name, footprint.training, "ok"), (INFERENCE.name, footprint.inference, "ok"), (BATCH.name, footprint.batch, "unhooked")]
    {
        let states = audit_states(text, pid);
        ensure!(states.contains(&want), "no audit row shows the {name} workload (pid {pid}) {want}: its rows say {states:?}");
        // The driver's figure for each workload, beside the ledger's and the probes'.
        let driver = audit_driver(text, pid);
        ensure!(driver.iter().any(|d| *d != "-"), "no audit row shows the driver's figure for the {name} workload (pid {pid}): its DRIVER column says {driver:?}");
    }
    ensure!(
        samples.iter().any(|s| s.name == "vramguard_unhooked_processes" && s.value >= 1.0),
        "vramguard_unhooked_processes never counted the un-hooked workload"
    );
    ensure!(
        samples.iter().any(|s| s.name == "vramguard_reclaims_total" && s.value >= 1.0),
        "vramguard_reclaims_total never counted the killed workload's slot"
    );
    ensure!(text.lines().any(|l| l.starts_with("   agent: ") && l.contains(AGENT_STOPPED)), "the agent's {AGENT_STOPPED:?} line is missing");
    provisioning::check_transcript(text, &footprint.provisioning).context("scene 2 (provisioning through containerd)")
}

/// The child processes of this one that [`check_clean`] answers for.
#[derive(Clone, Copy, Debug)]
pub enum Children<'a> {
    /// Every child: the demo's check, where this process runs nothing but the demo.
    All,
    /// Only the children with these pids: a unit test, which shares its process with other
    /// tests spawning children of their own on other threads.
    #[cfg_attr(not(test), allow(dead_code))]
    Only(&'a [u32]),
}

impl Children<'_> {
    fn answers_for(self, pid: u32) -> bool {
        match self {
            Children::All => true,
            Children::Only(pids) => pids.contains(&pid),
        }
    }
}

/// Checks that nothing the demo made is left: its cgroups, the fake node's device files, the
/// ledger root, the agent's directory, any child process of this one that `children` answers
/// for (running or not reaped), and what [`provisioning::leftovers`] looks for (containerd,
/// its shims, mounts).
pub fn check_clean(footprint: &Footprint, children: Children<'_>) -> Result<()> {
    let mut left: Vec<String> = Vec::new();
    for dir in footprint.cgroups.iter().chain([&footprint.ledger_root, &footprint.agent_dir]) {
        if fs::symlink_metadata(dir).is_ok() {
            left.push(dir.display().to_string());
        }
    }
    left.extend(node_files(&footprint.node, &footprint.state_dir)?);
    for (pid, comm) in children_of(std::process::id())?.into_iter().filter(|(pid, _)| children.answers_for(*pid)) {
        left.push(format!("process {pid} ({comm})"));
    }
    left.extend(provisioning::leftovers(&footprint.provisioning)?);
    ensure!(left.is_empty(), "left behind: {}", left.join(", "));
    Ok(())
}

/// The files fake node `node` has in `state_dir`: `<node>-dev<i>`, `<node>.ledger`, and
/// their temporaries (`.<node>…`).
fn node_files(node: &str, state_dir: &Path) -> Result<Vec<String>> {
    let ours = |name: &str| {
        let name = name.strip_prefix('.').unwrap_or(name);
        name.strip_prefix(node).is_some_and(|rest| rest.starts_with(['-', '.']))
    };
    let entries = fs::read_dir(state_dir).with_context(|| format!("cannot list {}", state_dir.display()))?;
    let mut left = Vec::new();
    for entry in entries {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if ours(&name) {
            left.push(state_dir.join(name).display().to_string());
        }
    }
    Ok(left)
}

/// (pid, command) of every process whose parent is `parent`, zombies included.
fn children_of(parent: u32) -> Result<Vec<(u32, String)>> {
    let mut children = Vec::new();
    for entry in fs::read_dir("/proc").context("cannot list /proc")?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        // A process that exits meanwhile has no status file: not a child any more.
        let Ok(status) = fs::read_to_string(entry.path().join("status")) else { continue };
        let field = |key: &str| status.lines().find_map(|line| line.strip_prefix(key)).map(str::trim);
        if field("PPid:").and_then(|ppid| ppid.parse::<u32>().ok()) == Some(parent) {
            children.push((pid, field("Name:").unwrap_or("?").to_string()));
        }
    }
    Ok(children)
}

#[cfg(test)]
mod tests {
    use std::{os::unix::process::CommandExt as _, path::Path};

    use super::*;

    fn footprint(dir: &Path) -> Footprint {
        Footprint {
            training: 101,
            inference: 102,
            batch: 103,
            node: "e2e-demo-1-0".into(),
            state_dir: dir.join("shm"),
            ledger_root: dir.join("ledgers"),
            agent_dir: dir.join("agent"),
            cgroups: vec![dir.join("cgroup")],
            provisioning: provisioning::Footprint {
                provisioned_pid: 201,
                plain_pid: 202,
                provisioned_id: "734a3ca099690e7117be9959fe80a007e1f8a8faeed1abae617be32c64564ac1".into(),
                plain_id: "6c6af85a802b6dd3e8f1e37be76b0a2d6b418551763d75cdadfd0395241d34df".into(),
                dir: dir.join("nri"),
                containerd_dir: dir.join("containerd"),
                cgroup_parent: dir.join("containerd-cgroup"),
                agent_dir: dir.join("nri-agent"),
                node: "e2e-demo-nri-1-5".into(),
                state_dir: dir.join("shm"),
            },
        }
    }

    /// An abridged transcript of a real run (pids changed to [`footprint`]'s).
    const GOOD: &str = r#"== starting: vramguard run --libcuda /x/fakecuda/libcuda.so.1 --no-discover --ledger-dir /tmp/r --metrics-addr 127.0.0.1:0
-- inference: pid 102, hooked, 1 GiB quota, asks for 512 MiB and then 1 GiB more (/vramguard-test-demo-inference-1-1)
   inference: meminfo free=1006632960 total=1073741824
   inference: ok alloc model 0x7f0000000000 536870912
   inference: oom cache
   inference (stderr): vramguard: GPU memory quota exceeded on device 0: 1073741824 bytes requested, 603979776 of 1073741824 bytes in use (ledger /tmp/r/inference/ledger); returning CUDA_ERROR_OUT_OF_MEMORY

== all three hold GPU memory: vramguard audit
     PID  COMM             CGROUP                                       DEVICE    MANAGED      ASYNC        VMM      TOTAL  ALLOCS     LEDGER     DRIVER  STATE
     101  fakecuda-worklo  /vramguard-test-demo-training-1-0           1.5 GiB   64.0 MiB        0 B        0 B    1.6 GiB       3    1.6 GiB    1.7 GiB  ok
     102  fakecuda-worklo  /vramguard-test-demo-inference-1-1        512.0 MiB        0 B        0 B        0 B  512.0 MiB       1  512.0 MiB  576.0 MiB  ok
     103  fakecuda-worklo  /vramguard-test-demo-batch-1-2              2.0 GiB        0 B        0 B  512.0 MiB    2.5 GiB       2          -    2.6 GiB  unhooked
libcuda probed: /x/fakecuda/libcuda.so.1; events: 9 received, 0 lost
-- GET /metrics (selected lines)
   vramguard_container_rejections_total{container="main",device_index="0",ledger="/tmp/r/inference/ledger",namespace="demo",pod="inference",pod_uid=""} 1
   vramguard_unhooked_processes 1
   vramguard_reclaims_total 1
   agent: 2026-05-20T10:00:00.000000Z  INFO vramguard::run: vramguard agent stopped


######## scene 2: quotas provisioned by the runtime (containerd's NRI) ########
== what the runtime injected (vramguard's env and mounts in the spec containerd gave runc)
   team-a/trainer: env   VRAMGUARD_LEDGER=/run/vramguard/ledger
   team-a/trainer: env   CUDA_DEVICE_MEMORY_LIMIT=2147483648
   team-a/trainer: env   POD_NAMESPACE=team-a
   team-a/trainer: mount /etc/ld.so.preload (ro) <- /tmp/n/state/ld.so.preload
   team-a/trainer: mount /run/vramguard/ledger (rw) <- /tmp/n/ledgers/734a3ca099690e7117be9959fe80a007e1f8a8faeed1abae617be32c64564ac1/ledger
   team-a/trainer: mount /usr/lib/vramguard/libvramguard.so (ro) <- /x/libvramguard.so
   team-b/web: nothing injected (no VRAMGUARD_/CUDA_DEVICE_MEMORY_ env, no hook, no ledger)
   trainer: ok alloc a 0x700000000000 268435456
   trainer: oom b
   trainer (CUDA_DEVICE_MEMORY_LIMIT=64g): ok alloc a 0x700000000000 268435456
   trainer (CUDA_DEVICE_MEMORY_LIMIT=64g): oom b
   web: ok alloc a 0x700000000000 268435456
   web: ok alloc b 0x700010000000 1073741824
     PID  COMM             CGROUP                                       DEVICE    MANAGED      ASYNC        VMM      TOTAL  ALLOCS     LEDGER  STATE
     201  fakecuda-worklo  …e80a007e1f8a8faeed1abae617be32c64564ac1  256.0 MiB        0 B        0 B        0 B  256.0 MiB       1  256.0 MiB  ok
     202  fakecuda-worklo  …d6b418551763d75cdadfd0395241d34df1a6398    2.0 GiB        0 B        0 B        0 B    2.0 GiB       1          -  unhooked
-- provisioned (vramguard audit --json: .provisioned)
   734a3ca09969  team-a/trainer/main  quota 2048 MiB per GPU  from the quota file  cgroup /c/poddemo-trainer/734a3ca099690e7117be9959fe80a007e1f8a8faeed1abae617be32c64564ac1
   nri agent: 2026-11-23T23:20:39.745546Z  INFO agent::run: vramguard agent stopped
"#;

    #[test]
    fn a_good_transcript_passes() {
        check_transcript(GOOD, &footprint(Path::new("/nonexistent"))).expect("the good transcript passes");
    }

    #[test]
    fn each_missing_fact_fails_the_check() {
        let footprint = footprint(Path::new("/nonexistent"));
        let without = |needle: &str| GOOD.lines().filter(|l| !l.contains(needle)).collect::<Vec<_>>().join("\n");
        let cases = [
            ("the workload's refusal", without("inference: oom cache")),
            ("the hook's refusal message", without("(stderr): vramguard: GPU memory quota exceeded")),
            ("the rejection metric", without("vramguard_container_rejections_total")),
            ("the unhooked row", GOOD.replace("-  unhooked", "-  ok")),
            ("a hooked row", without("/vramguard-test-demo-training-")),
            ("the unhooked count", without("vramguard_unhooked_processes")),
            ("the reclaim", without("vramguard_reclaims_total")),
            ("the clean stop", GOOD.replace("   agent: ", "   ")),
            ("scene 2", GOOD.split("\n\n######## scene 2").next().expect("scene 1").to_string()),
            ("the injected ledger env", without("trainer: env   VRAMGUARD_LEDGER=")),
            ("the injected quota env", without("trainer: env   CUDA_DEVICE_MEMORY_LIMIT=")),
            ("the injected preload", without("trainer: mount /etc/ld.so.preload")),
            ("the injected ledger mount", without("trainer: mount /run/vramguard/ledger")),
            ("the injected hook", without("trainer: mount /usr/lib/vramguard/")),
            ("the plain container's clean spec", without("team-b/web: nothing injected")),
            ("the plain container's clean spec", GOOD.replace("   team-b/web: nothing injected", "   team-b/web: env   LD_PRELOAD=/x.so\n   team-b/web: nothing injected")),
            ("the provisioned refusal", without("   trainer: oom b")),
            ("the refusal under the lying env", without("(CUDA_DEVICE_MEMORY_LIMIT=64g): oom b")),
            ("the plain container's grant", without("web: ok alloc b")),
            ("the provisioned process ok", GOOD.replace("256.0 MiB  ok", "256.0 MiB  drift")),
            ("the plain process unhooked", GOOD.replace("-  unhooked\n-- provisioned", "-  ok\n-- provisioned")),
            ("the provisioned list", without("734a3ca09969  team-a/trainer/main")),
            (
                "the provisioned list",
                GOOD.replace("   734a3ca09969  team-a", "   6c6af85a802b  team-b/web/main  quota 2048 MiB per GPU\n   734a3ca09969  team-a"),
            ),
            ("scene 2's clean stop", without("nri agent: ")),
        ];
        for (what, text) in cases {
            assert!(check_transcript(&text, &footprint).is_err(), "a transcript without {what} must fail the check");
        }
    }

    #[test]
    fn leftovers_fail_the_clean_up_check() {
        let dir = std::env::temp_dir().join(format!("vramguard-xtask-demo-check-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("shm")).expect("mkdir");
        let footprint = footprint(&dir);
        // Other tests of this binary spawn children on other threads meanwhile (`objdump` in
        // image's): each check below answers only for the children this test spawned.
        let none = Children::Only(&[]);
        check_clean(&footprint, none).expect("nothing left yet");

        let scene = &footprint.provisioning;
        for leftover in [dir.join("cgroup"), dir.join("ledgers"), dir.join("agent"), scene.dir.clone(), scene.containerd_dir.clone(), scene.cgroup_parent.clone(), scene.agent_dir.clone()] {
            fs::create_dir(&leftover).expect("mkdir");
            let error = check_clean(&footprint, none).expect_err("a directory left behind");
            assert!(format!("{error:#}").contains(&leftover.display().to_string()), "{error:#}");
            fs::remove_dir(&leftover).expect("rmdir");
        }
        for name in ["e2e-demo-1-0-dev0", ".e2e-demo-1-0-dev0.tmp", "e2e-demo-1-0.ledger", "e2e-demo-nri-1-5-dev0"] {
            fs::write(dir.join("shm").join(name), b"").expect("write");
            assert!(check_clean(&footprint, none).is_err(), "{name} left behind");
            fs::remove_file(dir.join("shm").join(name)).expect("rm");
        }
        for name in ["e2e-demo-1-00-dev0", "e2e-other-1-0-dev0"] {
            fs::write(dir.join("shm").join(name), b"").expect("write");
        }
        check_clean(&footprint, none).expect("other nodes' files are not the demo's");

        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let pids = [child.id()];
        let ours = Children::Only(&pids);
        let error = check_clean(&footprint, ours).expect_err("a running child");
        // Named by its pid: its name may still be this thread's (the kernel sets a new
        // program's name after closing the descriptors whose closing ends `spawn`'s wait).
        assert!(format!("{error:#}").contains(&format!("process {} (", child.id())), "{error:#}");
        check_clean(&footprint, none).expect("a child the check does not answer for is not reported");
        child.kill().expect("kill");
        assert!(check_clean(&footprint, ours).is_err(), "a child not reaped yet (a zombie) is still left behind");
        child.wait().expect("wait");
        check_clean(&footprint, ours).expect("clean again");

        // A process naming containerd's directory in its command line, as its shims do: caught
        // by that alone (a real shim is no child of the demo, and this one is not answered for
        // as a child here).
        let arg0 = scene.containerd_dir.join("containerd-shim-runc-v2");
        let mut shim = std::process::Command::new("sleep").arg0(&arg0).arg("30").spawn().expect("spawn sleep");
        until_exec(shim.id(), &arg0);
        let error = check_clean(&footprint, none).expect_err("a process naming containerd's directory");
        assert!(format!("{error:#}").contains(&format!("process {} ({}", shim.id(), scene.containerd_dir.display())), "{error:#}");
        shim.kill().expect("kill");
        shim.wait().expect("wait");
        check_clean(&footprint, Children::Only(&[shim.id()])).expect("clean again");
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    /// Waits until process `pid` runs the program it was spawned with, `arg0` first on its
    /// command line: `spawn` can return while the kernel is still in the middle of the exec,
    /// and until the new program's arguments are set up /proc shows this test binary's
    /// command line or an empty one, not the one a check of command lines looks for.
    fn until_exec(pid: u32, arg0: &Path) {
        use std::os::unix::ffi::OsStrExt as _;
        wait_for(Duration::from_secs(10), &format!("process {pid} running {}", arg0.display()), || {
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).context("the spawned process's cmdline")?;
            Ok(cmdline.split(|b| *b == 0).next() == Some(arg0.as_os_str().as_bytes()))
        })
        .expect("the spawned process runs its program");
    }
}
