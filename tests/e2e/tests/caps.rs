//! The agent's memory never grows with tenants' choices (issue 23, item 5, Must show): the
//! agent runs as a real containerd's NRI plugin, in a memory cgroup of its own limited to the
//! DaemonSet's memory limit (640 MiB, `deploy/kubernetes/daemonset.yaml`), with the quota file
//! giving every container of namespace `team-a` a 1-byte quota. A pod of 200 containers is
//! created through CRI (`CreateContainer` only: the runtime's NRI `CreateContainer`, where
//! provisioning happens, runs within it; starting 200 containers would add nothing the agent
//! pays for). With `--max-provisioned-per-pod 120` and the node's default cap (128): the first
//! 120 are provisioned, each with a ledger sized to its quota (a device with no space, 128
//! slots: about 230 KiB, not the hook's 4.7 MiB; the first, started, has its workload's first
//! context refused by the hook, as a 1-byte quota says), and the 80 after fail with an error
//! naming the cap, counted in `vramguard_provision_refused_total{reason="pod_cap"}`, nothing
//! made for them. A second pod then gets the node's last 8 places and its ninth container fails on the
//! node's cap (`reason="node_cap"`); a container removed frees its place. The agent's memory is
//! measured throughout (VmRSS, VmHWM, and its memory cgroup's usage and peak, which count the
//! ledgers' tmpfs pages the agent wrote): it stays under the limit, and the cgroup was never
//! at it (no OOM, no failcnt).
//!
//! Needs root, the containerd cache (`cargo xtask setup`), the built binaries and a memory
//! cgroup controller (cgroup v2's, or v1's at /sys/fs/cgroup/memory as on the CI machines).
use std::{
    ffi::{OsStr, OsString},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{bail, ensure, Context, Result};
use e2e::{
    agent::{agent_bin, provisioning_args, watching_args, Agent},
    containerd::{ContainerSpec, Containerd},
    containerd::workload_path,
    http,
    ledgers::tmpfs_mounts,
    timeout, wait_for, FakeNode, TempDir,
};

/// The DaemonSet's memory limit for the agent (`deploy/kubernetes/daemonset.yaml`).
const LIMIT: u64 = 640 << 20;
const MIB: f64 = (1 << 20) as f64;
const PER_POD: usize = 120;
/// The node's cap by default (`--max-provisioned-containers`).
const NODE_CAP: usize = 128;

/// A memory cgroup made for the agent, limited to [`LIMIT`]: cgroup v2's where its root offers
/// the memory controller, else v1's. Removed on drop (once empty).
struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    fn create(tag: &str) -> Result<MemoryCgroup> {
        let name = format!("vramguard-e2e-{tag}-{}", std::process::id());
        let v2_root = Path::new("/sys/fs/cgroup");
        let v2 = std::fs::read_to_string(v2_root.join("cgroup.controllers")).is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"));
        let (dir, limit_file) = if v2 {
            let subtree = v2_root.join("cgroup.subtree_control");
            let _ = std::fs::write(&subtree, "+memory");
            (v2_root.join(&name), "memory.max")
        } else {
            let v1 = Path::new("/sys/fs/cgroup/memory");
            if !v1.join("memory.limit_in_bytes").exists() {
                bail!("no memory cgroup controller (neither cgroup v2's nor v1's at {})", v1.display());
            }
            (v1.join(&name), "memory.limit_in_bytes")
        };
        std::fs::create_dir(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let cgroup = MemoryCgroup { dir, v2 };
        std::fs::write(cgroup.dir.join(limit_file), LIMIT.to_string()).with_context(|| format!("cannot limit {}", cgroup.dir.display()))?;
        Ok(cgroup)
    }

    fn read(&self, file: &str) -> Result<String> {
        std::fs::read_to_string(self.dir.join(file)).with_context(|| format!("cannot read {file} of {}", self.dir.display()))
    }

    fn number(&self, file: &str) -> Result<u64> {
        self.read(file)?.trim().parse().with_context(|| format!("{file} is not a number"))
    }

    /// (usage now, the most it was) in bytes.
    fn usage(&self) -> Result<(u64, u64)> {
        match self.v2 {
            true => Ok((self.number("memory.current")?, self.number("memory.peak").or_else(|_| self.number("memory.current"))?)),
            false => Ok((self.number("memory.usage_in_bytes")?, self.number("memory.max_usage_in_bytes")?)),
        }
    }

    /// `shmem` of memory.stat (tmpfs pages charged here), in bytes.
    fn shmem(&self) -> Result<u64> {
        let stat = self.read("memory.stat")?;
        let line = stat.lines().find(|l| l.starts_with("shmem ")).context("no shmem in memory.stat")?;
        Ok(line.split_whitespace().nth(1).context("no shmem figure")?.parse()?)
    }

    /// Times the cgroup hit its limit (v1 `memory.failcnt`; v2 `max` in memory.events) and
    /// OOM kills in it.
    fn pressure(&self) -> Result<(u64, u64)> {
        if self.v2 {
            let events = self.read("memory.events")?;
            let field = |name: &str| events.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok()).unwrap_or(0);
            return Ok((field("max "), field("oom_kill ")));
        }
        let oom = self.read("memory.oom_control")?;
        let kills = oom.lines().find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok()).unwrap_or(0);
        Ok((self.number("memory.failcnt")?, kills))
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = wait_for(std::time::Duration::from_secs(5), "the agent's memory cgroup to go", || Ok(std::fs::remove_dir(&self.dir).is_ok()));
    }
}

/// The agent's memory now: VmRSS, VmHWM (from /proc), the cgroup's usage and peak, its shmem.
#[derive(Debug)]
struct Memory {
    rss: u64,
    hwm: u64,
    cgroup: u64,
    cgroup_peak: u64,
    shmem: u64,
}

impl Memory {
    fn of(pid: u32, cgroup: &MemoryCgroup) -> Result<Memory> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let kib = |name: &str| -> Result<u64> {
            let line = status.lines().find(|l| l.starts_with(name)).with_context(|| format!("no {name}"))?;
            Ok(line.split_whitespace().nth(1).context("no figure")?.parse::<u64>()? * 1024)
        };
        let (cgroup_now, cgroup_peak) = cgroup.usage()?;
        Ok(Memory { rss: kib("VmRSS:")?, hwm: kib("VmHWM:")?, cgroup: cgroup_now, cgroup_peak, shmem: cgroup.shmem()? })
    }

    fn line(&self) -> String {
        format!(
            "VmRSS {:.1} MiB, VmHWM {:.1} MiB, memory cgroup {:.1} MiB (peak {:.1} MiB, shmem {:.1} MiB)",
            self.rss as f64 / MIB,
            self.hwm as f64 / MIB,
            self.cgroup as f64 / MIB,
            self.cgroup_peak as f64 / MIB,
            self.shmem as f64 / MIB
        )
    }
}

/// Unmounts what the agent left under `ledgers` (a failed test) before the directory goes.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        for point in tmpfs_mounts(&self.0).unwrap_or_default() {
            let _ = std::process::Command::new("umount").arg("-l").arg(&point).status();
        }
    }
}

fn refused(addr: std::net::SocketAddr, reason: &str) -> Result<f64> {
    http::metric(&http::scrape(addr)?, "vramguard_provision_refused_total", &[("reason", reason)])
        .with_context(|| format!("no vramguard_provision_refused_total{{reason={reason:?}}}"))
}

fn provisioned(agent: &Agent) -> Result<usize> {
    Ok(agent.audit()?["provisioned"].as_array().context("no provisioned list in the audit")?.len())
}

#[test]
fn a_pod_of_200_one_byte_quotas_is_capped_and_the_agent_stays_under_its_memory_limit() -> Result<()> {
    let dir = TempDir::new("caps")?;
    let ledgers = dir.path().join("ledgers");
    std::fs::create_dir_all(&ledgers)?;
    std::fs::write(dir.path().join("quotas"), "namespace=team-a 1\n")?;
    let fake = FakeNode::new("caps").with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "518m");
    let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
    let memory = MemoryCgroup::create("caps")?;
    let procs = memory.dir.join("cgroup.procs");
    // The agent joins its memory cgroup before it starts (a wrapper that moves itself, then
    // execs it), so every page it touches is charged there.
    let wrapper = dir.path().join("vramguard-in-cgroup");
    std::fs::write(&wrapper, format!("#!/bin/sh\necho $$ > '{}' || exit 1\nexec '{}' \"$@\"\n", procs.display(), agent_bin()?.display()))?;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
    let args = provisioning_args(&dir.path().join("nri.sock"), &dir.path().join("state"), &dir.path().join("quotas"), "8g")?;
    let more: [OsString; 2] = ["--max-provisioned-per-pod".into(), PER_POD.to_string().into()];
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let mut all = watching_args(&libcuda, &ledgers);
    all.push(OsStr::new("--no-discover"));
    all.extend(args.iter().chain(&more).map(OsString::as_os_str));
    let _unmount = Unmount(ledgers.clone());
    let agent = Agent::start_binary(&wrapper, &all)?;
    ensure!(std::fs::read_to_string(&procs)?.split_whitespace().any(|p| p == agent.pid().to_string()), "the agent is not in its memory cgroup");
    wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true))
        .with_context(|| agent.log())?;
    let addr = agent.metrics_addr()?;
    let before = Memory::of(agent.pid(), &memory)?;
    eprintln!("agent started: {}", before.line());

    // The pod of 200 containers, each with a 1-byte quota.
    let pod = containerd.pod("many", "team-a", "uid-many", &[])?;
    let began = Instant::now();
    let (mut made, mut errors, mut at_110) = (Vec::new(), Vec::new(), None);
    for n in 0..200 {
        // The first runs the fake driver's workload later; the others are only created.
        let spec = match n {
            0 => ContainerSpec::new("c000").fake_driver(&fake)?,
            _ => ContainerSpec::new(&format!("c{n:03}")),
        };
        match containerd.create_container(&pod, &spec) {
            Ok(id) => made.push(id),
            Err(error) => errors.push((n, format!("{error:#}"))),
        }
        if made.len() == 110 && at_110.is_none() {
            ensure!(provisioned(&agent)? == 110, "110 created, not 110 provisioned");
            let now = Memory::of(agent.pid(), &memory)?;
            eprintln!("110 containers provisioned: {}", now.line());
            at_110 = Some(now);
        }
    }
    eprintln!("200 CRI CreateContainer calls in {:.1} s", began.elapsed().as_secs_f64());
    ensure!(made.len() == PER_POD, "{} created, {PER_POD} expected: first errors {:?}", made.len(), errors.iter().take(3).collect::<Vec<_>>());
    ensure!(errors.iter().map(|(n, _)| *n).eq(PER_POD..200), "the creations past the cap fail, and only they: {:?}", &errors[..errors.len().min(3)]);
    for (n, error) in &errors {
        ensure!(error.contains("--max-provisioned-per-pod 120") && error.contains("team-a/many"), "c{n:03}: the error names the cap: {error}");
    }
    ensure!(refused(addr, "pod_cap")? == 80.0, "80 refusals counted: {}", refused(addr, "pod_cap")?);
    let audit = agent.audit()?;
    let listed: std::collections::BTreeSet<&str> =
        audit["provisioned"].as_array().context("no provisioned list")?.iter().filter_map(|r| r["container_id"].as_str()).collect();
    ensure!(listed == made.iter().map(|id| id.0.as_str()).collect(), "the agent's provisioned list is the containers created");
    // Each provisioned container has its ledger, sized to its 1-byte quota; none was made for
    // a refused one.
    let mounts = tmpfs_mounts(&ledgers)?;
    ensure!(mounts.len() == PER_POD, "{} ledger tmpfs mounts", mounts.len());
    let env = containerd.container_env(&made[0])?;
    ensure!(env.iter().any(|e| e == "CUDA_DEVICE_MEMORY_LIMIT=1"), "the quota injected: {env:?}");
    let first = ledger::file::read_header(&std::fs::File::open(ledgers.join(&made[0].0).join("ledger"))?)?;
    ensure!(first.devices[0].chunks == 0 && first.total_size < 256 << 10, "a ledger of {} bytes, {} chunks", first.total_size, first.devices[0].chunks);
    // Provisioned means held to its quota: the hook refuses the first context (its 518 MiB
    // reserve) on a device of 1 byte.
    containerd.start_container(&made[0])?;
    let out = containerd.exec_sync(&made[0], &[workload_path().as_str(), "expect-oom ctx 0"])?;
    ensure!(out.exit_code == 0 && out.stdout.lines().any(|l| l == "oom ctx"), "a context under a 1-byte quota: {out:?}");
    let at_pod_cap = Memory::of(agent.pid(), &memory)?;
    eprintln!("{PER_POD} provisioned, 80 refused: {}", at_pod_cap.line());

    // A second pod: the node's last places, then the node's cap.
    let other = containerd.pod("other", "team-a", "uid-other", &[])?;
    for n in 0..NODE_CAP - PER_POD {
        containerd.create_container(&other, &ContainerSpec::new(&format!("o{n}")))?;
    }
    let error = containerd.create_container(&other, &ContainerSpec::new("late")).expect_err("past the node's cap");
    let error = format!("{error:#}");
    ensure!(error.contains("--max-provisioned-containers 128") && error.contains("the node has 128"), "{error}");
    ensure!(refused(addr, "node_cap")? == 1.0, "the node's refusal counted");
    let at_node_cap = Memory::of(agent.pid(), &memory)?;
    eprintln!("{NODE_CAP} provisioned (the node's cap): {}", at_node_cap.line());
    // A container removed frees its place.
    containerd.remove_container(&made[1])?;
    wait_for(timeout(), "the removed container's place freed", || Ok(provisioned(&agent)? == NODE_CAP - 1))?;
    containerd.create_container(&other, &ContainerSpec::new("late")).context("in the place freed")?;

    // Under its limit all along: the cgroup's peak, and it never hit the limit.
    let end = Memory::of(agent.pid(), &memory)?;
    eprintln!("at the end: {}", end.line());
    let (failcnt, oom_kills) = memory.pressure()?;
    ensure!(end.cgroup_peak < LIMIT && end.hwm < LIMIT, "over the limit: {}", end.line());
    ensure!((failcnt, oom_kills) == (0, 0), "the agent's cgroup hit its limit {failcnt} times, {oom_kills} OOM kills");
    // The ledgers' pages are what grows, charged to the agent: one small ledger per container
    // (its file's size), not 4.7 MiB.
    let per_container = (at_node_cap.shmem.saturating_sub(before.shmem)) / NODE_CAP as u64;
    eprintln!("shmem per provisioned container: {per_container} bytes (a ledger: {} bytes)", first.total_size);
    ensure!(per_container >= first.total_size && per_container < 256 << 10, "{per_container} bytes of tmpfs per container");
    ensure!(at_110.is_some(), "measured at 110");
    ensure!(agent.audit().is_ok(), "the agent answers");

    // The pods removed: every ledger goes with them.
    containerd.remove_pod(&pod)?;
    containerd.remove_pod(&other)?;
    wait_for(timeout(), "every ledger removed", || Ok(provisioned(&agent)? == 0 && tmpfs_mounts(&ledgers)?.is_empty()))?;
    agent.stop()?;
    fake.cleanup();
    Ok(())
}
