//! Provisioning through NRI with a real containerd (issue "Quotas belong to the operator",
//! Must show): the agent runs as containerd's NRI plugin with a quota file (`namespace=team-a
//! 1g`), pods are created through the CRI API, and workloads inside the containers allocate
//! through the fake driver. Issue 17's NRI part of "many hostile tenants" is here too: pods
//! created beside 50 hostile ledgers ([`e2e::hostile::HostileLedgers`]) get their answer from
//! the agent within the runtime's NRI deadline. Every test but that pair also runs on
//! containerd 2 (`*_on_containerd_2`).
//!
//! Needs the containerd cache (`cargo xtask setup`) and the built binaries (`cargo xtask test`).
use std::{
    ffi::{OsStr, OsString},
    os::unix::fs::{FileExt as _, MetadataExt as _},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use e2e::{
    agent::{agent_bin, provisioning_args, Agent},
    containerd::{workload_path, ContainerId, ContainerSpec, Containerd, PodId, Version},
    hostile::{HealthProbe, HostileLedgers, OWED},
    timeout, wait_for, FakeNode, TempDir, GIB,
};
use serde_json::Value;

const QUOTA: u64 = GIB;

/// The `--gpu-memory` every agent here is given: one GPU of 1 GiB, which no node here has.
/// Where NVML answers (the fake driver's, here always) the flag is ignored: the overcommit
/// check and the GPUs' count below hold only if the agent sizes the node from NVML.
const WRONG_GPU_MEMORY: &str = "1g";

/// A node: the fake GPU (8 GiB, contexts charged what the agent's ledgers reserve), a
/// containerd with NRI, and the agent provisioning from a quota file.
struct Node {
    dir: TempDir,
    fake: FakeNode,
    containerd: Containerd,
    agent: Option<Agent>,
}

impl Node {
    fn new(tag: &str) -> Result<Node> {
        Node::with_agent_args(tag, &[])
    }

    fn with_agent_args(tag: &str, more: &[&OsStr]) -> Result<Node> {
        Node::with_gpus(tag, "8g", more)
    }

    /// A node of the GPUs `gpu_memory` lists (one size per GPU, all the same: the fake
    /// driver's, which the agent's NVML reads, and sizes the node by), whose agent is given
    /// `more` and a `--gpu-memory` that says otherwise ([`WRONG_GPU_MEMORY`]: NVML wins).
    fn with_gpus(tag: &str, gpu_memory: &str, more: &[&OsStr]) -> Result<Node> {
        let mut node = Node::without_agent(tag, gpu_memory)?;
        node.start_agent_with(more)?;
        Ok(node)
    }

    /// The node with its containerd running and its ledger directory made, the agent not
    /// started yet (see [`Node::start_agent_with`]).
    fn without_agent(tag: &str, gpu_memory: &str) -> Result<Node> {
        let dir = TempDir::new(tag)?;
        let sizes: Vec<u64> = gpu_memory.split(',').map(|size| agent::provision::parse_quota(size).with_context(|| format!("{size:?}"))).collect::<Result<_>>()?;
        ensure!(sizes.iter().all(|&size| size == sizes[0]), "the fake driver's GPUs have one size: {gpu_memory}");
        let fake = FakeNode::new(tag)
            .with_env("FAKECUDA_DEVICE_BYTES", sizes[0].to_string())
            .with_env("FAKECUDA_DEVICE_COUNT", sizes.len().to_string())
            .with_env("FAKECUDA_CONTEXT_BYTES", "518m");
        std::fs::create_dir_all(dir.path().join("ledgers"))?;
        std::fs::write(dir.path().join("quotas"), "namespace=team-a 1g\n")?;
        let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
        Ok(Node { dir, fake, containerd, agent: None })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn start_agent(&mut self) -> Result<()> {
        self.start_agent_with(&[])
    }

    fn start_agent_with(&mut self, more: &[&OsStr]) -> Result<()> {
        let args = provisioning_args(&self.path("nri.sock"), &self.path("state"), &self.path("quotas"), WRONG_GPU_MEMORY)?;
        let args: Vec<&OsStr> =
            args.iter().map(OsString::as_os_str).chain([OsStr::new("--hami-metrics")]).chain(more.iter().copied()).collect();
        let agent = Agent::watching_node(&self.path("ledgers"), &args, self.fake.env())?;
        let began = Instant::now();
        wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true))
            .with_context(|| agent.log())?;
        eprintln!("agent registered as an NRI plugin {:?} after it answered", began.elapsed());
        // NVML read: the node's GPUs are the inventory's from here on, not the flag's.
        wait_for(timeout(), "the driver view (NVML) ok", || Ok(agent.audit()?["driver"]["state"] == "ok")).with_context(|| agent.log())?;
        self.agent = Some(agent);
        Ok(())
    }

    fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("the agent runs")
    }

    /// A pod and its container `main`, sleeping, with the fake driver.
    fn pod(&self, name: &str, namespace: &str, uid: &str) -> Result<(PodId, ContainerId)> {
        let (pod, container, _) = self.timed_pod(name, namespace, uid)?;
        Ok((pod, container))
    }

    /// [`Node::pod`], also returning how long the CRI `CreateContainer` call took (the
    /// runtime's NRI `CreateContainer` round trip to the agent is within it).
    fn timed_pod(&self, name: &str, namespace: &str, uid: &str) -> Result<(PodId, ContainerId, Duration)> {
        let pod = self.containerd.pod(name, namespace, uid, &[])?;
        let spec = ContainerSpec::new("main").fake_driver(&self.fake)?;
        let began = Instant::now();
        let container = self.containerd.create_container(&pod, &spec)?;
        let took = began.elapsed();
        self.containerd.start_container(&container)?;
        Ok((pod, container, took))
    }

    /// Runs `fakecuda-workload` in `container` with `env` (through `env`) and these steps.
    fn workload(&self, container: &ContainerId, env: &[&str], steps: &[&str]) -> Result<Vec<String>> {
        let workload = workload_path();
        let argv: Vec<&str> = ["env"].into_iter().chain(env.iter().copied()).chain([workload.as_str()]).chain(steps.iter().copied()).collect();
        let out = self.containerd.exec_sync(container, &argv)?;
        ensure!(out.exit_code == 0, "{argv:?} in the container: {out:?}");
        Ok(out.stdout.lines().map(str::to_owned).collect())
    }

    /// The agent's record of provisioned container `id`.
    fn provisioned(&self, id: &ContainerId) -> Result<Option<Value>> {
        let audit = self.agent().audit()?;
        let rows = audit["provisioned"].as_array().context("no provisioned list in the audit")?;
        Ok(rows.iter().find(|r| r["container_id"] == id.0.as_str()).cloned())
    }

    /// The agent's problem with the ledger of container `id`, if it has one.
    fn ledger_problem(&self, id: &ContainerId) -> Result<Option<String>> {
        let audit = self.agent().audit()?;
        let path = self.ledger_of(id).display().to_string();
        Ok(audit["ledger_problems"][path.as_str()].as_str().map(str::to_owned))
    }

    /// The host path of container `id`'s ledger.
    fn ledger_of(&self, id: &ContainerId) -> PathBuf {
        self.path("ledgers").join(&id.0).join("ledger")
    }
}

/// Allocations that fit a 1 GiB quota with one 518 MiB context (256 MiB) and one that does
/// not (512 MiB more).
const OVER: [&str; 4] = ["ctx 0", "alloc a 256m", "expect-oom alloc b 512m", "meminfo"];

fn assert_held(lines: &[String]) -> Result<()> {
    ensure!(lines.iter().any(|l| l == "oom b"), "b must be refused: {lines:?}");
    let meminfo = lines.iter().find(|l| l.starts_with("meminfo")).context("no meminfo line")?;
    ensure!(meminfo.contains(&format!("total={QUOTA}")), "the quota is the GPU the workload sees: {meminfo}");
    Ok(())
}

/// Rewrites the first device's limit in the ledger header at `path` to 64 GiB, as the
/// container (which can write its ledger) could.
fn lift_limit(path: &Path) -> Result<()> {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    let mut header = ledger::file::read_header(&file)?;
    header.devices[0].limit = 64 * GIB;
    header.checksum = ledger::layout::fnv1a(ledger::layout::checksummed_bytes(&header));
    file.write_all_at(ledger::file::header_bytes(&header), 0)?;
    Ok(())
}

#[test]
fn a_container_with_a_quota_gets_hook_env_and_ledger_and_is_held_to_it() -> Result<()> {
    let node = Node::new("prov-main")?;
    let (_pod, main) = node.pod("trainer", "team-a", "uid-a")?;

    // Injected: the env (the agent's values), the four mounts, the agent's record.
    let env = node.containerd.container_env(&main)?;
    for want in [
        "VRAMGUARD_LEDGER=/run/vramguard/ledger".to_string(),
        format!("CUDA_DEVICE_MEMORY_LIMIT={QUOTA}"),
        "POD_NAME=trainer".into(),
        "POD_NAMESPACE=team-a".into(),
        "CONTAINER_NAME=main".into(),
    ] {
        ensure!(env.contains(&want), "{want} not in the container's env: {env:?}");
    }
    let mounts = node.containerd.container_mounts(&main)?;
    let mount = |at: &str| mounts.iter().find(|(dest, _, _)| dest == at).cloned();
    for (at, read_only) in [
        ("/run/vramguard/ledger", false),
        ("/run/vramguard/limits", true),
        ("/usr/lib/vramguard/libvramguard.so", true),
        ("/etc/ld.so.preload", true),
    ] {
        let (_, _, options) = mount(at).with_context(|| format!("no mount at {at}: {mounts:?}"))?;
        ensure!(options.iter().any(|o| o == "ro") == read_only, "{at}: options {options:?}");
    }
    let record = node.provisioned(&main)?.context("the agent has no record of the container")?;
    ensure!(record["quota"] == QUOTA && record["namespace"] == "team-a" && record["source"] == "quota file", "{record}");

    // Past the quota: refused. Re-exec'd with a lying environment: still refused.
    assert_held(&node.workload(&main, &[], &OVER)?)?;
    assert_held(&node.workload(&main, &["CUDA_DEVICE_MEMORY_LIMIT=64g", "VRAMGUARD_LEDGER=/tmp/mine", "VRAMGUARD_FAIL_OPEN=1"], &OVER)?)?;
    let out = node.containerd.exec_sync(&main, &["ls", "/tmp/mine"])?;
    ensure!(out.exit_code != 0, "the environment's ledger was created: {out:?}");

    // The container's cgroup has its limit in the probes' map.
    let cgroup = std::fs::metadata(node.containerd.container_cgroup(&main)?)?.ino();
    wait_for(Duration::from_secs(5), "the container's cgroup limit pushed", || {
        let audit = node.agent().audit()?;
        Ok(audit["kernel_maps"]["cgroup_limits"].as_array().is_some_and(|ids| ids.iter().any(|id| id.as_u64() == Some(cgroup))))
    })?;

    // HAMi's families carry the runtime's names (not what a hook wrote) and zone="vGPU".
    let labels = [("namespace", "team-a"), ("pod", "trainer"), ("container", "main"), ("vdevice_index", "0"), ("zone", "vGPU")];
    let addr = node.agent().metrics_addr()?;
    wait_for(Duration::from_secs(5), "the HAMi limit series of the provisioned container", || {
        Ok(e2e::http::metric(&e2e::http::scrape(addr)?, "hami_vgpu_memory_limit_bytes", &labels) == Some(QUOTA as f64))
    })?;

    // Inside, the files cannot be removed, replaced or written where read-only.
    for argv in [&["rm", "/run/vramguard/ledger"][..], &["sh", "-c", "echo 64g > /run/vramguard/limits"], &["rm", "/etc/ld.so.preload"]] {
        let out = node.containerd.exec_sync(&main, argv)?;
        ensure!(out.exit_code != 0, "{argv:?} succeeded in the container: {out:?}");
    }

    // The ledger's header rewritten (the container can write its ledger): tampered, and
    // nothing changes.
    lift_limit(&node.ledger_of(&main))?;
    wait_for(Duration::from_secs(5), "the rewritten header reported", || Ok(node.ledger_problem(&main)?.is_some_and(|p| p.starts_with("tampered"))))?;
    assert_held(&node.workload(&main, &[], &OVER)?)?;

    // Deleted and re-created with a larger quota on the host side: tampered too, and the
    // container still holds the agent's ledger. (The ledger's tmpfs is full, and the
    // container's mount keeps the deleted file's pages: host root makes room first.)
    let ledger_path = node.ledger_of(&main);
    let header = ledger::file::read_header(&std::fs::File::open(&ledger_path)?)?;
    let dir = ledger_path.parent().context("ledger dir")?;
    let remount = format!("remount,size={}", 4 * header.total_size);
    let status = std::process::Command::new("mount").args(["-o", &remount]).arg(dir).status()?;
    ensure!(status.success(), "mount -o {remount} {}: {status}", dir.display());
    std::fs::remove_file(&ledger_path)?;
    let bigger = ledger::Geometry {
        slots: header.slot_count,
        records: header.record_count,
        devices: vec![ledger::DeviceConfig { limit: 8 * GIB, chunk: header.devices[0].chunk, ..Default::default() }],
    };
    drop(ledger::Ledger::create(&ledger_path, &bigger, ledger::layout::CREATOR_HOOK)?);
    wait_for(Duration::from_secs(5), "the re-created ledger reported", || {
        Ok(node.ledger_problem(&main)?.is_some_and(|p| p.starts_with("tampered") && p.contains("limit")))
    })?;
    assert_held(&node.workload(&main, &[], &OVER)?)?;
    node.fake.cleanup();
    Ok(())
}

/// A hostile process that gets out of the hook's reach (a user and mount namespace of its
/// own, a tmpfs over /run/vramguard: the hook then finds no limits and follows the
/// environment's 64 GiB) is still held to the container's quota by its cgroup's limit in the
/// eBPF probes: with `--enforce signal`, killed before the driver allocates.
#[test]
fn a_process_that_escapes_the_hook_is_held_by_the_cgroup_limit() -> Result<()> {
    let signal: [&OsStr; 3] = [OsStr::new("--enforce"), OsStr::new("signal"), OsStr::new("--cgroup2-separates-containers")];
    let node = Node::with_agent_args("prov-escape", &signal)?;
    let (_pod, main) = node.pod("trainer", "team-a", "uid-e")?;
    let cgroup = std::fs::metadata(node.containerd.container_cgroup(&main)?)?.ino();
    wait_for(Duration::from_secs(5), "the container's cgroup limit pushed", || {
        let audit = node.agent().audit()?;
        Ok(audit["kernel_maps"]["cgroup_limits"].as_array().is_some_and(|ids| ids.iter().any(|id| id.as_u64() == Some(cgroup))))
    })?;
    let escape = |steps: &str| -> Result<e2e::containerd::Exec> {
        let script = format!(
            "mount -t tmpfs tmpfs /run/vramguard && test ! -e /run/vramguard/limits && exec env CUDA_DEVICE_MEMORY_LIMIT=64g {} {steps}",
            workload_path()
        );
        node.containerd.exec_sync(&main, &["busybox", "unshare", "-r", "-m", "sh", "-c", &script])
    };
    // Within the quota the escaped process runs (the escape itself works here).
    let fits = escape("'ctx 0' 'alloc a 256m' meminfo")?;
    ensure!(fits.exit_code == 0, "{fits:?}");
    ensure!(fits.stdout.contains("total=8589934592"), "the hook saw no limits (the device's 8 GiB): {fits:?}");
    // Past it: killed at the allocation by the probes (SIGKILL: 128 + 9).
    let over = escape("'ctx 0' 'alloc a 2g' 'alloc b 2g'")?;
    ensure!(over.exit_code == 137, "the escaped process must be killed: {over:?}");
    ensure!(!over.stdout.contains("ok alloc b"), "{over:?}");
    node.fake.cleanup();
    Ok(())
}

#[test]
fn a_container_without_a_quota_is_untouched_and_unhooked() -> Result<()> {
    let node = Node::new("prov-none")?;
    let pod = node.containerd.pod("web", "team-b", "uid-b", &[])?;
    let workload = workload_path();
    let spec = ContainerSpec::new("app").command([workload.as_str(), "ctx 0", "alloc a 64m", "hold"]).fake_driver(&node.fake)?;
    let app = node.containerd.run_container(&pod, &spec)?;
    let env = node.containerd.container_env(&app)?;
    ensure!(!env.iter().any(|e| e.starts_with("VRAMGUARD_") || e.starts_with("CUDA_DEVICE_MEMORY_LIMIT")), "{env:?}");
    let mounts = node.containerd.container_mounts(&app)?;
    let injected = |dest: &str| dest.starts_with("/run/vramguard") || dest.starts_with("/usr/lib/vramguard") || dest == "/etc/ld.so.preload";
    ensure!(!mounts.iter().any(|(dest, _, _)| injected(dest)), "{mounts:?}");
    ensure!(node.provisioned(&app)?.is_none(), "no record for it");
    let pid = node.containerd.container_pid(&app)?;
    wait_for(timeout(), "the un-hooked allocation judged", || {
        let audit = node.agent().audit()?;
        let row = audit["processes"].as_array().and_then(|rows| rows.iter().find(|r| r["pid"].as_u64() == Some(u64::from(pid))).cloned());
        Ok(row.is_some_and(|r| r["state"] == "unhooked"))
    })
    .with_context(|| node.agent().log())?;
    node.fake.cleanup();
    Ok(())
}

#[test]
fn the_plugin_is_back_after_the_runtime_restarts() -> Result<()> {
    let mut node = Node::new("prov-restart")?;
    node.containerd.restart()?;
    let began = Instant::now();
    wait_for(Duration::from_secs(10), "the plugin registered again", || Ok(node.agent().audit()?["nri_connected"] == true))
        .with_context(|| node.agent().log())?;
    eprintln!("plugin back {:?} after containerd restarted", began.elapsed());
    // It provisions again.
    let (_pod, main) = node.pod("trainer", "team-a", "uid-r")?;
    ensure!(node.provisioned(&main)?.is_some(), "not provisioned after the restart");
    assert_held(&node.workload(&main, &[], &OVER)?)?;
    node.fake.cleanup();
    Ok(())
}

#[test]
fn a_restarted_agent_restores_its_state_and_synchronize_prunes_it() -> Result<()> {
    let mut node = Node::new("prov-agent")?;
    let (_kept_pod, kept) = node.pod("kept", "team-a", "uid-k")?;
    let (gone_pod, gone) = node.pod("gone", "team-a", "uid-g")?;
    ensure!(node.provisioned(&kept)?.is_some() && node.provisioned(&gone)?.is_some(), "both provisioned");
    node.agent.take().context("agent")?.stop()?;
    // While the agent is away: one pod goes, and the other's ledger header is rewritten.
    node.containerd.stop_container(&gone, Duration::from_secs(1))?;
    node.containerd.remove_pod(&gone_pod)?;
    lift_limit(&node.ledger_of(&kept))?;
    let (_late_pod, late) = node.pod("late", "team-a", "uid-l")?;
    ensure!(!node.containerd.container_env(&late)?.iter().any(|e| e.starts_with("VRAMGUARD_LEDGER=")), "nobody to inject it");
    node.start_agent()?;
    // The container made while the agent was away: not provisioned, but its cgroup is held
    // to its quota by the probes.
    ensure!(node.provisioned(&late)?.is_none(), "a running container cannot be provisioned");
    let cgroup = std::fs::metadata(node.containerd.container_cgroup(&late)?)?.ino();
    wait_for(Duration::from_secs(5), "the late container's cgroup limit pushed", || {
        let audit = node.agent().audit()?;
        Ok(audit["kernel_maps"]["cgroup_limits"].as_array().is_some_and(|ids| ids.iter().any(|id| id.as_u64() == Some(cgroup))))
    })?;
    ensure!(node.provisioned(&kept)?.is_some(), "the kept container's record restored");
    wait_for(Duration::from_secs(5), "the gone container's files removed", || {
        Ok(node.provisioned(&gone)?.is_none() && !node.ledger_of(&gone).exists() && !node.path("state/containers").join(&gone.0).exists())
    })?;
    // The restored record still holds the ledger to the agent's header.
    wait_for(Duration::from_secs(5), "the rewritten header reported", || Ok(node.ledger_problem(&kept)?.is_some_and(|p| p.starts_with("tampered"))))
        .with_context(|| format!("audit: {}\nlog: {}", node.agent().audit().map(|a| a.to_string()).unwrap_or_default(), node.agent().log()))?;
    assert_held(&node.workload(&kept, &[], &OVER)?)?;
    node.fake.cleanup();
    Ok(())
}

/// Free bytes of the filesystem holding `path`.
fn free_bytes(path: &Path) -> Result<u64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    // SAFETY: statvfs(2) into a zeroed struct, with a NUL-terminated path.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    ensure!(unsafe { libc::statvfs(c.as_ptr(), &mut stat) } == 0, "statvfs {}: {}", path.display(), std::io::Error::last_os_error());
    Ok(stat.f_bavail * stat.f_frsize)
}

/// The ledger tmpfs mounts (the agent's, by their source name) whose mount point is `dir`.
fn ledger_mounts_at(dir: &Path) -> Result<usize> {
    let table = std::fs::read_to_string("/proc/self/mountinfo")?;
    let point = dir.display().to_string();
    Ok(table.lines().filter(|l| l.split(' ').nth(4) == Some(point.as_str()) && l.contains(" - tmpfs vramguard-ledger ")).count())
}

const MIB: u64 = 1 << 20;

/// Issue 17, "Ledgers cannot grow the node's disk": a provisioned container writes past its
/// ledger's size (`dd`), allocates past it (`fallocate`) and extends it (`truncate`), as
/// busybox does with write(2), fallocate(2) and ftruncate(2). The first two fail with ENOSPC
/// at the ledger's end; the third succeeds (a tmpfs file is sparse and cannot be sealed) but
/// allocates nothing, and a write into the extension fails with ENOSPC. The host filesystem
/// under the ledger directory does not lose the space; the same commands on a plain host
/// directory mounted into the container (the negative control) take it. The hook still
/// holds the container afterwards, and the ledger's tmpfs is unmounted when the pod goes.
#[test]
fn a_provisioned_container_cannot_grow_the_node_disk_through_its_ledger() -> Result<()> {
    let node = Node::new("prov-disk")?;
    let scratch = node.path("scratch");
    std::fs::create_dir_all(&scratch)?;
    let pod = node.containerd.pod("filler", "team-a", "uid-d", &[])?;
    let spec = ContainerSpec::new("main").fake_driver(&node.fake)?.mount(&scratch, "/scratch", false);
    let main = node.containerd.run_container(&pod, &spec)?;
    ensure!(node.provisioned(&main)?.is_some(), "not provisioned");
    assert_held(&node.workload(&main, &[], &OVER)?)?;

    let ledger = node.ledger_of(&main);
    let dir = ledger.parent().context("ledger dir")?.to_path_buf();
    ensure!(ledger_mounts_at(&dir)? == 1, "the ledger directory is not the agent's tmpfs");
    let size = std::fs::metadata(&ledger)?.len();
    let blocks = std::fs::metadata(&ledger)?.blocks();
    ensure!(size % 4096 == 0 && blocks * 512 == size, "the ledger ({size} bytes) is allocated whole: {blocks} blocks");
    let run = |argv: &[&str]| node.containerd.exec_sync(&main, argv);
    let refused = |argv: &[&str]| -> Result<()> {
        let out = run(argv)?;
        ensure!(out.exit_code != 0 && out.stderr.contains("No space left on device"), "{argv:?} must fail with ENOSPC: {out:?}");
        Ok(())
    };
    let pages = (size / 4096).to_string();
    let past = size.to_string();
    let disk_before = free_bytes(&node.path("ledgers"))?;

    // write(2): 256 MiB from the ledger's end; fallocate(2): 1 GiB from it.
    let seek = format!("seek={pages}");
    refused(&["busybox", "dd", "if=/dev/zero", "of=/run/vramguard/ledger", "bs=4096", "count=65536", &seek, "conv=notrunc"])?;
    refused(&["busybox", "fallocate", "-o", &past, "-l", "1073741824", "/run/vramguard/ledger"])?;
    // One byte past the end is already refused (the error is at the size, not later).
    refused(&["busybox", "dd", "if=/dev/zero", "of=/run/vramguard/ledger", "bs=1", "count=1", &format!("seek={size}"), "conv=notrunc"])?;
    ensure!(std::fs::metadata(&ledger)?.len() == size, "the ledger's size changed");
    // ftruncate(2) to 4 GiB: allowed by tmpfs, nothing allocated; a write into it refused.
    let grown = run(&["busybox", "truncate", "-s", "4294967296", "/run/vramguard/ledger"])?;
    ensure!(grown.exit_code == 0, "{grown:?}");
    let meta = std::fs::metadata(&ledger)?;
    ensure!(meta.len() == 4 << 30 && meta.blocks() == blocks, "an extended ledger allocates nothing: {} bytes, {} blocks", meta.len(), meta.blocks());
    refused(&["busybox", "dd", "if=/dev/zero", "of=/run/vramguard/ledger", "bs=1048576", "count=64", "seek=1024", "conv=notrunc"])?;
    let disk_after = free_bytes(&node.path("ledgers"))?;
    let lost = disk_before.saturating_sub(disk_after);
    eprintln!("host filesystem: {lost} bytes fewer free after 1.25 GiB written or allocated past the ledger");
    // Other processes of the machine write too: a margin, far below what was tried.
    ensure!(lost < 64 * MIB, "the node's disk lost {lost} bytes to the ledger's container");
    // Shrunk back (allowed: the ledger's bytes are intact), the hook holds the container still.
    let back = run(&["busybox", "truncate", "-s", &past, "/run/vramguard/ledger"])?;
    ensure!(back.exit_code == 0, "{back:?}");
    assert_held(&node.workload(&main, &[], &OVER)?)?;

    // Negative control: the same writes to a plain file of a host directory take the disk.
    // Other processes of the machine free space too (test binaries beside this one remove
    // their files): the control is tried again, up to three times, until the filesystem's free
    // space shows its 128 MiB. (Only the control: a retry of the ledger's writes could not
    // show a loss the first try made.)
    let control = scratch.join("file");
    let mut seen = Vec::new();
    for _ in 0..3 {
        let before = free_bytes(&scratch)?;
        let out = run(&["busybox", "dd", "if=/dev/zero", "of=/scratch/file", "bs=1048576", "count=64", "conv=fsync"])?;
        ensure!(out.exit_code == 0, "{out:?}");
        let out = run(&["busybox", "fallocate", "-o", &(64 * MIB).to_string(), "-l", &(64 * MIB).to_string(), "/scratch/file"])?;
        ensure!(out.exit_code == 0, "{out:?}");
        let taken = std::fs::metadata(&control)?.blocks() * 512;
        let lost = before.saturating_sub(free_bytes(&scratch)?);
        std::fs::remove_file(&control)?;
        eprintln!("control: {taken} bytes allocated, host filesystem {lost} bytes fewer free");
        ensure!(taken >= 128 * MIB, "the control file must be allocated: {taken} bytes");
        seen.push(lost);
        if lost >= 96 * MIB {
            break;
        }
    }
    ensure!(seen.iter().any(|&lost| lost >= 96 * MIB), "the control file must take the disk: {seen:?} bytes fewer free in each try");

    // The pod gone: its ledger's tmpfs unmounted and its directory removed.
    node.containerd.stop_container(&main, Duration::from_secs(1))?;
    node.containerd.remove_pod(&pod)?;
    wait_for(Duration::from_secs(5), "the ledger's tmpfs unmounted", || Ok(ledger_mounts_at(&dir)? == 0 && !dir.exists()))?;
    node.fake.cleanup();
    Ok(())
}

/// A stand-in for the GPU device node `/dev/nvidia<n>` a device plugin would give: a character
/// device with /dev/null's numbers (1, 3) at `<dir>/nvidia<n>`, for the runtime to put in a
/// container's `linux.devices` at `/dev/nvidia<n>`.
fn fake_gpu_node(node: &Node, n: u32) -> Result<PathBuf> {
    let path = node.path(&format!("nvidia{n}"));
    if !path.exists() {
        let out = std::process::Command::new("mknod").arg(&path).args(["c", "1", "3"]).output()?;
        ensure!(out.status.success(), "mknod {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    }
    Ok(path)
}

/// `vramguard inspect --json` of container `id`'s ledger: (index, limit) of each device.
fn ledger_limits(node: &Node, id: &ContainerId) -> Result<Vec<(u64, u64)>> {
    let out = std::process::Command::new(agent_bin()?).args(["inspect", "--json"]).arg(node.ledger_of(id)).output()?;
    ensure!(out.status.success(), "inspect: {}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout)?;
    let devices = report["devices"].as_array().with_context(|| format!("no devices in {report}"))?;
    devices
        .iter()
        .map(|d| Ok((d["index"].as_u64().context("index")?, d["limit_bytes"].as_u64().context("limit_bytes")?)))
        .collect()
}

/// Issue 17, item 7: the GPUs a container was given are the runtime's (its device nodes),
/// never its environment's. Four GPUs of 2.5 GiB, a 1 GiB quota, `--refuse-overcommit`.
#[test]
fn a_container_whose_env_names_gpus_it_was_not_given_is_held_to_the_runtime_s() -> Result<()> {
    let node = Node::with_gpus("prov-gpus", "2560Mi,2560Mi,2560Mi,2560Mi", &[OsStr::new("--refuse-overcommit")])?;
    let spec = |env: &str, gpus: &[u32]| -> Result<ContainerSpec> {
        let mut spec = ContainerSpec::new("main").fake_driver(&node.fake)?.env("NVIDIA_VISIBLE_DEVICES", env);
        for &n in gpus {
            spec = spec.device(fake_gpu_node(&node, n)?, &format!("/dev/nvidia{n}"));
        }
        Ok(spec)
    };
    let run = |name: &str, spec: &ContainerSpec| -> Result<ContainerId> {
        let pod = node.containerd.pod(name, "team-a", &format!("uid-{name}"), &[])?;
        node.containerd.run_container(&pod, spec)
    };
    let gpus_of = |id: &ContainerId| -> Result<Value> {
        Ok(node.provisioned(id)?.with_context(|| format!("{} not provisioned", id.0))?["gpus"].clone())
    };

    // Its env names all four GPUs; the runtime gave GPU 1: the ledger holds the quota on that
    // one GPU, the record says GPU 1.
    let liar = run("liar", &spec("0,1,2,3", &[1])?)?;
    let out = node.containerd.exec_sync(&liar, &["ls", "/dev/nvidia1"])?;
    ensure!(out.exit_code == 0, "the runtime's device is in the container: {out:?}");
    ensure!(gpus_of(&liar)? == serde_json::json!([1]), "{}", gpus_of(&liar)?);
    ensure!(ledger_limits(&node, &liar)? == [(0, QUOTA)], "one device at the quota: {:?}", ledger_limits(&node, &liar)?);
    assert_held(&node.workload(&liar, &[], &OVER)?)?;

    // Negative control: given all four by the runtime (its env names one): all four.
    let given = run("given", &spec("1", &[0, 1, 2, 3])?)?;
    ensure!(gpus_of(&given)? == serde_json::json!([0, 1, 2, 3]), "{}", gpus_of(&given)?);
    let want: Vec<(u64, u64)> = (0..4).map(|i| (i, QUOTA)).collect();
    ensure!(ledger_limits(&node, &given)? == want, "four devices at the quota: {:?}", ledger_limits(&node, &given)?);

    // GPU 1 now holds 2 GiB of quotas, the others 1 GiB. The over-commit check counts the
    // runtime's devices: a container on GPU 2 whose env names GPU 1 is admitted...
    let fits = run("fits", &spec("1", &[2])?)?;
    ensure!(gpus_of(&fits)? == serde_json::json!([2]), "{}", gpus_of(&fits)?);
    // ... and one given GPU 1 whose env names GPU 3 is refused (GPU 1 would hold 3 GiB).
    let error = run("full", &spec("3", &[1])?).expect_err("a third quota on GPU 1 overcommits it");
    let error = format!("{error:#}");
    ensure!(error.contains("GPU 1 has") && error.contains("--refuse-overcommit"), "{error}");
    node.fake.cleanup();
    Ok(())
}

/// The same through CDI, as the kubelet asks for a device plugin's CDI devices: a CDI spec of
/// kind `nvidia.com/gpu` whose device `2` is a stand-in `/dev/nvidia2`, named in the
/// container's `cdi.k8s.io/` annotation; containerd injects the node, the agent counts GPU 2
/// alone although the env names all four. Control: `nvidia.com/gpu=0` and `=3` give two.
#[test]
fn a_container_given_gpus_by_cdi_is_held_to_them_whatever_its_env_says() -> Result<()> {
    let node = Node::with_gpus("prov-cdi", "8g,8g,8g,8g", &[])?;
    let devices: Vec<Value> = (0..4)
        .map(|n| -> Result<Value> {
            let host = fake_gpu_node(&node, n)?;
            Ok(serde_json::json!({
                "name": n.to_string(),
                "containerEdits": { "deviceNodes": [{ "path": format!("/dev/nvidia{n}"), "hostPath": host }] }
            }))
        })
        .collect::<Result<_>>()?;
    let spec = serde_json::json!({ "cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices });
    std::fs::write(node.containerd.cdi_dir().join("gpus.json"), serde_json::to_vec(&spec)?)?;
    let run = |name: &str, cdi: &str| -> Result<ContainerId> {
        let pod = node.containerd.pod(name, "team-a", &format!("uid-{name}"), &[])?;
        let spec = ContainerSpec::new("main")
            .fake_driver(&node.fake)?
            .env("NVIDIA_VISIBLE_DEVICES", "0,1,2,3")
            .annotation("cdi.k8s.io/vramguard-test_main", cdi);
        node.containerd.run_container(&pod, &spec)
    };
    let one = run("one", "nvidia.com/gpu=2")?;
    let out = node.containerd.exec_sync(&one, &["ls", "/dev/nvidia2"])?;
    ensure!(out.exit_code == 0, "containerd injected the CDI device: {out:?}");
    let record = node.provisioned(&one)?.context("not provisioned")?;
    ensure!(record["gpus"] == serde_json::json!([2]), "{record}");
    ensure!(ledger_limits(&node, &one)? == [(0, QUOTA)], "{:?}", ledger_limits(&node, &one)?);
    assert_held(&node.workload(&one, &[], &OVER)?)?;

    let two = run("two", "nvidia.com/gpu=0,nvidia.com/gpu=3")?;
    let record = node.provisioned(&two)?.context("not provisioned")?;
    ensure!(record["gpus"] == serde_json::json!([0, 3]), "{record}");
    ensure!(ledger_limits(&node, &two)? == [(0, QUOTA), (1, QUOTA)], "{:?}", ledger_limits(&node, &two)?);
    node.fake.cleanup();
    Ok(())
}

/// How long the runtime waits for an NRI plugin's answer: containerd's default
/// `plugin_request_timeout` (the harness's containerd keeps it), the deadline issue 17 names.
const NRI_DEADLINE: Duration = Duration::from_secs(2);

/// Issue 17, "many hostile tenants", the NRI part: 50 hostile ledgers in the agent's
/// `--ledger-dir` (made before it starts, so it watches them; not provisioned): each with its
/// lock held by a thread of this test, a dead slot owed a reclaim, and in ten a hooked process
/// that wrote its charge down (a charge owed). Pods are created through CRI as soon as the
/// agent is registered with the runtime, and again once it has reported every hostile ledger: each CRI `CreateContainer`
/// returns within the runtime's NRI deadline, each container is provisioned (record, env,
/// ledger), and `/healthz` on the health listener answers within 250 ms every 100 ms
/// throughout. The attack is shown in effect: every hostile ledger reported with its lock
/// held, the locks still held at the end. The negative control runs the same without them.
fn provisioning_beside_hostile_ledgers(hostile: usize) -> Result<()> {
    const PODS: usize = 4;
    // Longer than the scene (containerd's start, the agent's, four pods, the checks).
    const HELD_FOR: Duration = Duration::from_secs(120);
    let mut node = Node::without_agent(if hostile > 0 { "prov-hostile" } else { "prov-hostile-control" }, "8g")?;
    let mut attack = HostileLedgers::make(&node.path("ledgers"), hostile, OWED.min(hostile))?;
    node.start_agent_with(&[OsStr::new("--health-addr"), OsStr::new("127.0.0.1:0")])?;
    let probe = HealthProbe::start(node.agent().health_addr()?, Duration::from_millis(100));
    attack.attack(HELD_FOR)?;

    let mut made = Vec::new();
    for i in 0..PODS {
        if i == PODS / 2 {
            // Every hostile ledger found and reported: its lock stays held (the reclaim of
            // its dead slot, and the charge it is owed, are refused by its lock).
            attack.wait_reported(node.agent(), Duration::from_secs(20))?;
        }
        let (_pod, container, took) = node.timed_pod(&format!("trainer-{i}"), "team-a", &format!("uid-h{i}"))?;
        eprintln!("{hostile} hostile ledgers: CreateContainer of pod {i} took {took:?}");
        made.push((container, took));
    }
    for (id, took) in &made {
        ensure!(*took < NRI_DEADLINE, "CreateContainer of {} took {took:?}, past the NRI deadline {NRI_DEADLINE:?}", id.0);
        let record = node.provisioned(id)?.with_context(|| format!("{} not provisioned; log:\n{}", id.0, node.agent().log()))?;
        ensure!(record["quota"] == QUOTA && record["namespace"] == "team-a", "{record}");
        let env = node.containerd.container_env(id)?;
        for want in ["VRAMGUARD_LEDGER=/run/vramguard/ledger".to_string(), format!("CUDA_DEVICE_MEMORY_LIMIT={QUOTA}")] {
            ensure!(env.contains(&want), "{want} not in {}'s env: {env:?}", id.0);
        }
        ensure!(node.ledger_of(id).is_file(), "{}: no ledger at {}", id.0, node.ledger_of(id).display());
        ensure!(node.ledger_problem(id)?.is_none(), "{}: {:?}", id.0, node.ledger_problem(id)?);
    }
    // The provisioned ledger holds its container, hostile neighbours or not.
    assert_held(&node.workload(&made[0].0, &[], &OVER)?)?;

    // The attack was in effect throughout: the locks are still held, still reported.
    ensure!(hostile == 0 || attack.held(), "a hostile ledger's lock was let go before the checks ended (HELD_FOR too short)");
    attack.wait_reported(node.agent(), Duration::from_secs(1))?;
    if hostile == 0 {
        let audit = node.agent().audit()?;
        ensure!(audit["ledger_problems"].as_object().is_none_or(|p| p.is_empty()), "problems without an attack: {}", audit["ledger_problems"]);
    }
    probe.finish()?;
    let log = node.agent().log();
    ensure!(!log.contains("panicked"), "the agent panicked: {log}");
    node.fake.cleanup();
    Ok(())
}

/// Bounds latency: /healthz within 250 ms and CreateContainer within the NRI deadline, under attack.
#[test]
fn fifty_hostile_ledgers_delay_neither_nri_create_container_nor_health() -> Result<()> {
    provisioning_beside_hostile_ledgers(50)
}

/// Bounds latency: the control of the test above, under the same conditions.
#[test]
fn negative_control_the_same_pods_without_hostile_ledgers() -> Result<()> {
    provisioning_beside_hostile_ledgers(0)
}

// The tests above on containerd 2 (Debian unstable's, NRI and CDI on by default): each runs
// the same body with the kit's containerd 2 (the hostile-ledger pair, which bounds latencies,
// runs on 1.7 only).

#[test]
fn a_container_with_a_quota_gets_hook_env_and_ledger_and_is_held_to_it_on_containerd_2() -> Result<()> {
    Version::V2.run(a_container_with_a_quota_gets_hook_env_and_ledger_and_is_held_to_it)
}

#[test]
fn a_process_that_escapes_the_hook_is_held_by_the_cgroup_limit_on_containerd_2() -> Result<()> {
    Version::V2.run(a_process_that_escapes_the_hook_is_held_by_the_cgroup_limit)
}

#[test]
fn a_container_without_a_quota_is_untouched_and_unhooked_on_containerd_2() -> Result<()> {
    Version::V2.run(a_container_without_a_quota_is_untouched_and_unhooked)
}

#[test]
fn the_plugin_is_back_after_the_runtime_restarts_on_containerd_2() -> Result<()> {
    Version::V2.run(the_plugin_is_back_after_the_runtime_restarts)
}

#[test]
fn a_restarted_agent_restores_its_state_and_synchronize_prunes_it_on_containerd_2() -> Result<()> {
    Version::V2.run(a_restarted_agent_restores_its_state_and_synchronize_prunes_it)
}

#[test]
fn a_provisioned_container_cannot_grow_the_node_disk_through_its_ledger_on_containerd_2() -> Result<()> {
    Version::V2.run(a_provisioned_container_cannot_grow_the_node_disk_through_its_ledger)
}

#[test]
fn a_container_whose_env_names_gpus_it_was_not_given_is_held_to_the_runtime_s_on_containerd_2() -> Result<()> {
    Version::V2.run(a_container_whose_env_names_gpus_it_was_not_given_is_held_to_the_runtime_s)
}

#[test]
fn a_container_given_gpus_by_cdi_is_held_to_them_whatever_its_env_says_on_containerd_2() -> Result<()> {
    Version::V2.run(a_container_given_gpus_by_cdi_is_held_to_them_whatever_its_env_says)
}
