//! The driver's word on what a dead process still holds (issue 23, item 2): the driver keeps
//! a process's memory while any process holds its device files, so a workload that allocates,
//! forks a child that only sleeps and `_exit`s still holds the memory, through the child. The
//! agent keeps the dead process's ledger slot (its container stays charged: a second hooked
//! process is refused past the quota, `vramguard audit` and `/metrics` show it) until the
//! driver lets go, and then frees it within 2 s. Real processes on the fake driver, which
//! keeps the memory the same way (docs/gpu.md); the agent reads the fake's NVML. Needs root;
//! run with `cargo xtask test` (one e2e test at a time).
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
    args.extend([OsStr::new("--context-allowance"), OsStr::new("64m")]);
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
