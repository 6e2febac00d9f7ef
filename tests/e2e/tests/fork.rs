//! The driver's word on what a dead process still holds (issue 23, item 2): the driver keeps
//! a process's memory while any process holds its device files, so a workload that allocates,
//! forks a child that only sleeps and `_exit`s still holds the memory, through the child. The
//! agent keeps the dead process's ledger slot (its container stays charged: a second hooked
//! process is refused past the quota, `vramguard audit` and `/metrics` show it) until the
//! driver lets go, and then frees it within 2 s. Real processes on the fake driver, which
//! keeps the memory the same way (docs/gpu.md); the agent reads the fake's NVML. Needs root;
//! run with `cargo xtask test`. Its agents probe its own fake driver alone (`--no-discover`),
//! so it shares the node with the other test binaries.
use std::{ffi::OsStr, path::Path, time::Duration};

use anyhow::{Context, Result};
use e2e::{agent::Agent, cgroup::TestCgroup, field, http, wait_for, FakeNode, TempDir, GIB, MIB};
use serde_json::Value;

/// Kills a process the test did not start itself (the workload's forked child) when dropped.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: kill(2) of a pid the test's workload forked and printed.
        unsafe { libc::kill(self.0 as libc::pid_t, libc::SIGKILL) };
    }
}

/// Process `pid`'s row of an audit.
fn row(audit: &Value, pid: u64) -> Option<Value> {
    audit["processes"].as_array()?.iter().find(|r| r["pid"].as_u64() == Some(pid)).cloned()
}

/// What `/metrics` says `ledger` charges on device 0 (every kind), as of a pass begun now.
fn metrics_used(agent: &Agent, ledger: &Path) -> Result<u64> {
    let samples = http::fresh_scrape(agent.metrics_addr()?)?;
    let name = ledger.display().to_string();
    Ok(http::samples(&samples, "vramguard_container_memory_used_bytes")
        .filter(|s| s.label("ledger") == name && s.label("device_index") == "0")
        .map(|s| s.value as u64)
        .sum())
}

/// A hooked workload of `cgroup` that allocates 900 MiB under a 1 GiB quota, forks a child
/// that sleeps without a CUDA call when `fork` is set, and `_exit`s: (its pid, the child's).
fn allocate_and_exit(node: &FakeNode, ledger: &Path, cgroup: &TestCgroup, fork: bool) -> Result<(u64, Option<u32>)> {
    let mut steps = vec!["ctx 0", "alloc a 900m"];
    if fork {
        steps.push("fork-hold");
    }
    steps.push("_exit 0");
    let out = node.hooked(ledger, GIB)?.in_cgroup(cgroup).steps(steps).run()?.success()?;
    let pid = field(out.line("ready pid=")?, "pid")?;
    let child = if fork { Some(u32::try_from(field(out.line("fork-hold ")?, "child")?)?) } else { None };
    Ok((pid, child))
}

#[test]
fn a_forked_child_keeps_its_dead_parents_memory_charged_until_it_exits() -> Result<()> {
    let dir = TempDir::new("fork-ledgers")?;
    // No context memory: the quota's arithmetic is the allocations' alone.
    let node = FakeNode::new("fork").with_env("FAKECUDA_CONTEXT_BYTES", "0").with_env("FAKECUDA_DEVICE_BYTES", "8g");
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let mut args = e2e::agent::watching_args(&libcuda, dir.path());
    args.extend([OsStr::new("--no-discover"), OsStr::new("--context-allowance"), OsStr::new("64m")]);
    let agent = Agent::start_with_env(&args, node.env())?;
    let cgroup = TestCgroup::create("fork")?;
    let ledger = dir.ledger("fork")?;

    let (parent, child) = allocate_and_exit(&node, &ledger, &cgroup, true)?;
    let child = KillOnDrop(child.context("no child")?);
    assert_eq!(node.used(0)?, 900 * MIB, "the fake driver: the child holds the memory");
    // The agent has seen the parent die (its exit event, its sweeps) and the driver still
    // list it: the slot stays, through several driver reads.
    wait_for(e2e::timeout(), "the agent keeps the dead parent's slot", || {
        Ok(agent.log().lines().any(|l| l.contains("slot is kept") && l.contains(&format!("host_pid={parent}"))))
    })
    .with_context(|| agent.log())?;
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(e2e::ledgers::used(&ledger)?, 900 * MIB, "the dead parent's slot still charges its 900 MiB");

    // A second hooked process of the container: refused past the quota, granted within it.
    let out = node.hooked(&ledger, GIB)?.in_cgroup(&cgroup).steps(["ctx 0", "expect-oom alloc big 200m", "alloc small 100m"]).run()?.success()?;
    assert!(out.stdout.iter().any(|l| l == "oom big"), "{:?}", out.stdout);
    assert!(out.stdout.iter().any(|l| l.starts_with("ok alloc small ")), "{:?}", out.stdout);

    // The container's figure, in the audit and the metrics, includes the 900 MiB.
    let audit = agent.audit()?;
    let stale = row(&audit, parent).with_context(|| format!("no row for the parent {parent}: {audit}"))?;
    assert_eq!(stale["state"], "stale", "{stale}");
    assert_eq!(stale["ledger_bytes"].as_u64(), Some(900 * MIB), "{stale}");
    assert_eq!(metrics_used(&agent, &ledger)?, 900 * MIB);

    // The child exits: released from the books within 2 s.
    drop(child);
    let took = wait_for(Duration::from_secs(2), "the slot freed once the child exited", || {
        std::thread::sleep(Duration::from_millis(10));
        Ok(e2e::ledgers::used(&ledger)? == 0)
    })
    .with_context(|| agent.log())?;
    eprintln!("freed {took:?} after the child was killed");
    assert_eq!(metrics_used(&agent, &ledger)?, 0);
    assert_eq!(node.used(0)?, 0);

    // Control: without the child, the slot is reclaimed as before (never kept).
    let (alone, _) = allocate_and_exit(&node, &ledger, &cgroup, false)?;
    wait_for(Duration::from_secs(2), "the slot of a parent without a child freed", || Ok(e2e::ledgers::used(&ledger)? == 0))?;
    assert!(!agent.log().lines().any(|l| l.contains("slot is kept") && l.contains(&format!("host_pid={alone}"))), "{}", agent.log());
    let log = agent.stop()?;
    assert!(!log.contains("panicked"), "{log}");
    Ok(())
}

/// The agent's arguments for the restart test: the fake's device files as the GPUs' files,
/// the join's table kept under `state`, signals on.
fn restart_args<'a>(libcuda: &'a Path, ledgers: &'a Path, state: &'a Path, device_file: &'a OsStr) -> Vec<&'a OsStr> {
    let mut args = e2e::agent::watching_args(libcuda, ledgers);
    args.extend([
        OsStr::new("--no-discover"),
        OsStr::new("--context-allowance"),
        OsStr::new("64m"),
        OsStr::new("--state-dir"),
        state.as_os_str(),
        OsStr::new("--gpu-device-file"),
        device_file,
        OsStr::new("--enforce"),
        OsStr::new("signal"),
        OsStr::new(e2e::cgroup::SEPARATES_CONTAINERS),
    ]);
    args
}

/// Starts `workload` as pid `pid` (the kernel's `ns_last_pid`: the next fork of this pid
/// namespace gets the pid after it, if no other process forks first; tried again until it
/// does).
fn spawn_as(pid: u32, workload: &e2e::Workload) -> Result<e2e::Running> {
    for _ in 0..200 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).context("ns_last_pid")?;
        let running = workload.spawn()?;
        if running.pid() == pid {
            return Ok(running);
        }
        drop(running);
    }
    anyhow::bail!("no fork got pid {pid} in 200 tries")
}

/// The driver's reads since an agent started.
fn reads(audit: &Value) -> u64 {
    audit["driver"]["reads"].as_u64().unwrap_or(0)
}

/// Issue 23, item 3: the agent restarted while the driver lists a pid that another process
/// now has. A process allocates 900 MiB, forks a child that keeps it and `_exit`s: the driver
/// keeps listing its pid. The agent stops; a hooked process of another container is given
/// that pid; the agent starts again. The join's table, restored from the state directory,
/// says the row is the earlier process's: the new one is not joined, not charged (its ledger
/// holds its own allocations only, and it is granted up to its quota) and not signalled.
/// Control: an agent started without the table joins it and charges it the row.
#[test]
fn after_a_restart_a_reused_pid_the_driver_lists_is_not_joined() -> Result<()> {
    let ledgers = TempDir::new("restart-ledgers")?;
    let state = TempDir::new("restart-state")?;
    let fresh = TempDir::new("restart-fresh")?;
    let node = FakeNode::new("restart").with_env("FAKECUDA_CONTEXT_BYTES", "64m").with_env("FAKECUDA_DEVICE_BYTES", "8g");
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let device_file = node.state_dir().join(format!("{}-dev{{minor}}", node.name())).into_os_string();
    let agent = Agent::start_with_env(&restart_args(&libcuda, ledgers.path(), state.path(), &device_file), node.env())?;

    // The first process, listed (and joined) while it lives, then gone, its child holding.
    let mut first = node.workload().steps(["ctx 0", "alloc a 900m", "checkpoint held", "fork-hold", "_exit 0"]).spawn()?;
    first.wait_checkpoint("held")?;
    let pid = first.pid();
    wait_for(e2e::timeout(), "the driver's row joined with the first process", || {
        std::thread::sleep(Duration::from_millis(50));
        Ok(row(&agent.audit()?, u64::from(pid)).is_some_and(|r| r["driver_bytes"].as_u64() == Some(900 * MIB + 64 * MIB)))
    })?;
    first.resume()?;
    let out = first.wait()?.success()?;
    let _child = KillOnDrop(u32::try_from(field(out.line("fork-hold ")?, "child")?)?);
    wait_for(e2e::timeout(), "the dead pid still listed", || {
        let audit = agent.audit()?;
        Ok(audit["driver"]["unjoined"].as_array().is_some_and(|rows| rows.iter().any(|r| r["pid"].as_u64() == Some(u64::from(pid)))))
    })?;
    agent.stop()?;
    assert!(state.path().join("driver-listed.json").exists(), "the table is saved");

    // Another container's hooked process gets the pid.
    let cgroup = TestCgroup::create("restart")?;
    let ledger = ledgers.ledger("reused")?;
    let workload = node.hooked(&ledger, GIB)?.in_cgroup(&cgroup).steps(["ctx 0", "alloc b 100m", "checkpoint held", "alloc c 800m", "checkpoint more", "hold"]);
    let mut reused = spawn_as(pid, &workload)?;
    reused.wait_checkpoint("held")?;
    let own = 64 * MIB + 100 * MIB;

    let agent = Agent::start_with_env(&restart_args(&libcuda, ledgers.path(), state.path(), &device_file), node.env())?;
    wait_for(e2e::timeout(), "the join's table restored", || Ok(agent.log().contains("restored from the state directory"))).with_context(|| agent.log())?;
    wait_for(e2e::timeout(), "three driver reads and the ledger watched", || {
        std::thread::sleep(Duration::from_millis(50));
        let audit = agent.audit()?;
        Ok(reads(&audit) >= 3 && row(&audit, u64::from(pid)).is_some_and(|r| r["ledger"].is_string()))
    })
    .with_context(|| agent.log())?;
    std::thread::sleep(Duration::from_secs(2));
    let audit = agent.audit()?;
    let seen = row(&audit, u64::from(pid)).context("no row for the reused pid")?;
    assert!(seen["driver_bytes"].is_null(), "joined: {seen}");
    assert_eq!(seen["state"], "ok", "{seen}");
    let unjoined = audit["driver"]["unjoined"].as_array().context("no unjoined rows")?;
    assert!(unjoined.iter().any(|r| r["pid"].as_u64() == Some(u64::from(pid)) && r["reason"].as_str().is_some_and(|s| s.contains("reused"))), "{unjoined:?}");
    assert_eq!(e2e::ledgers::used(&ledger)?, own, "charged only its own allocations");
    // Granted up to its quota (64 + 100 + 800 MiB of 1 GiB), never signalled.
    reused.resume()?;
    reused.wait_checkpoint("more").with_context(|| agent.log())?;
    std::thread::sleep(Duration::from_secs(2));
    assert!(!agent.log().contains("signalled a process"), "{}", agent.log());
    assert_eq!(e2e::ledgers::used(&ledger)?, own + 800 * MIB);
    agent.stop()?;

    // Control: an agent without the table joins the row with the process that has the pid.
    let agent = Agent::start_with_env(&restart_args(&libcuda, ledgers.path(), fresh.path(), &device_file), node.env())?;
    wait_for(e2e::timeout(), "without the table, the reused pid is joined with the row", || {
        std::thread::sleep(Duration::from_millis(50));
        Ok(row(&agent.audit()?, u64::from(pid)).is_some_and(|r| r["driver_bytes"].as_u64().is_some_and(|b| b >= 900 * MIB)))
    })
    .with_context(|| agent.log())?;
    drop(reused);
    agent.stop()?;
    Ok(())
}
