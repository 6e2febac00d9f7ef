//! Enforcement for workloads that bypass the hook (issue "The agent", item 5): a limits file
//! gives a cgroup a GPU-memory limit; the eBPF entry probes count allocations that would pass
//! it (`audit`) or stop the process with a signal before the driver allocates (`signal`).
//! Needs root; run with `cargo xtask test`.
use std::{
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use e2e::{
    agent::Agent,
    cgroup::{TestCgroup, SEPARATES_CONTAINERS},
    FakeNode, MIB,
};

/// A limits file giving `cgroup` a limit of 1 GiB.
fn limits_file(cgroup: &TestCgroup) -> Result<PathBuf> {
    let path = std::env::temp_dir().join(format!("vramguard-limits-{}-{}", std::process::id(), cgroup.id));
    std::fs::write(&path, format!("# test\n{} 1g\n", cgroup.path))?;
    Ok(path)
}

/// An agent enforcing `limits` in `mode`; every workload these tests limit runs in a
/// [`TestCgroup`] of its own ([`SEPARATES_CONTAINERS`]).
fn agent(mode: &str, limits: &Path) -> Result<Agent> {
    Agent::start_on_fake_driver(&[
        "--limits".as_ref(),
        limits.as_os_str(),
        "--enforce".as_ref(),
        mode.as_ref(),
        SEPARATES_CONTAINERS.as_ref(),
    ])
}

fn stat(audit: &serde_json::Value, name: &str) -> u64 {
    Agent::stat(audit, name)
}

const STEPS: [&str; 5] = ["ctx 0", "alloc a 600m", "checkpoint one", "alloc b 600m", "checkpoint two"];

#[test]
fn signal_mode_stops_an_unhooked_workload_before_it_passes_its_limit() -> Result<()> {
    let cgroup = TestCgroup::create("signal")?;
    let limits = limits_file(&cgroup)?;
    let agent = agent("signal", &limits)?;
    let node = FakeNode::new("signal").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let mut workload = node.workload().in_cgroup(&cgroup).steps(STEPS).spawn()?;
    workload.wait_checkpoint("one")?;
    assert_eq!(node.used(0)?, 64 * MIB + 600 * MIB, "the first allocation is within the limit");
    workload.resume()?;
    let finished = workload.wait()?;
    assert_eq!(finished.status.signal(), Some(libc::SIGKILL), "stopped by SIGKILL: {:?}", finished.status);
    assert!(!finished.stdout.iter().any(|l| l.starts_with("ok alloc b")), "the driver never allocated b: {:?}", finished.stdout);
    let audit = agent.audit()?;
    assert!(stat(&audit, "signals_sent") >= 1, "{audit}");
    assert!(stat(&audit, "over_limit") >= 1, "{audit}");
    agent.stop()?;
    let _ = std::fs::remove_file(limits);
    Ok(())
}

#[test]
fn audit_mode_counts_but_lets_the_workload_through() -> Result<()> {
    let cgroup = TestCgroup::create("audit")?;
    let limits = limits_file(&cgroup)?;
    let agent = agent("audit", &limits)?;
    let node = FakeNode::new("audit");
    let mut workload = node.workload().in_cgroup(&cgroup).steps(STEPS).spawn()?;
    workload.wait_checkpoint("one")?;
    assert_eq!(stat(&agent.audit()?, "over_limit"), 0);
    workload.resume()?;
    workload.wait_checkpoint("two")?;
    let audit = agent.audit()?;
    assert_eq!(stat(&audit, "over_limit"), 1, "{audit}");
    assert_eq!(stat(&audit, "signals_sent"), 0, "{audit}");
    workload.resume()?;
    let finished = workload.wait()?.success()?;
    finished.line("ok alloc b ").context("audit mode lets the allocation through")?;
    agent.stop()?;
    let _ = std::fs::remove_file(limits);
    Ok(())
}

/// An edited limits file (a ConfigMap update) applies without restarting the agent, also to
/// a cgroup whose old limit the probes hold a copy of (its second allocation made the copy:
/// the agent's new generation of the limits makes them read the map again).
#[test]
fn a_changed_limits_file_applies_without_a_restart() -> Result<()> {
    let cgroup = TestCgroup::create("reload")?;
    let limits = limits_file(&cgroup)?;
    let agent = agent("audit", &limits)?;
    let node = FakeNode::new("reload");
    let steps = ["ctx 0", "alloc a 300m", "alloc c 300m", "checkpoint one", "alloc b 100m", "checkpoint two"];
    let mut workload = node.workload().in_cgroup(&cgroup).steps(steps).spawn()?;
    workload.wait_checkpoint("one")?;
    assert_eq!(stat(&agent.audit()?, "over_limit"), 0, "600 MiB is within 1 GiB");
    let pushes = || agent.log().matches("cgroup limits in the probes changed").count();
    let before = pushes();
    std::fs::write(&limits, format!("{} 256m\n", cgroup.path))?;
    e2e::wait_for(std::time::Duration::from_secs(3), "the edited rule in the probes", || Ok(pushes() > before))?;
    workload.resume()?;
    workload.wait_checkpoint("two")?;
    let audit = agent.audit()?;
    assert_eq!(stat(&audit, "over_limit"), 1, "b is past the new 256 MiB limit: {audit}");
    workload.resume()?;
    workload.wait()?.success()?;
    agent.stop()?;
    let _ = std::fs::remove_file(limits);
    Ok(())
}

/// A process of a hooked container that skips the hook (an SSH session, a static binary) is
/// held to the container's ledger limit by the probes: the agent pushes the ledger's limit
/// for the cgroups of the ledger's processes.
#[test]
fn a_process_skipping_the_hook_is_held_to_its_containers_ledger_limit() -> Result<()> {
    let cgroup = TestCgroup::create("bypass")?;
    let dir = e2e::TempDir::new("bypass")?;
    let ledger = dir.ledger("pod-x")?;
    let agent = Agent::start_on_fake_driver(&[
        "--ledger-dir".as_ref(),
        dir.0.as_os_str(),
        "--enforce".as_ref(),
        "signal".as_ref(),
        SEPARATES_CONTAINERS.as_ref(),
    ])?;
    let node = FakeNode::new("bypass").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let mut hooked = node.hooked(&ledger, 1 << 30)?.in_cgroup(&cgroup).steps(["ctx 0", "alloc h 600m", "checkpoint held", "hold"]).spawn()?;
    hooked.wait_checkpoint("held")?;
    e2e::wait_for(std::time::Duration::from_secs(5), "the ledger's limit pushed for the container's cgroup", || {
        Ok(stat(&agent.audit()?, "cgroup_limits") >= 1)
    })?;
    let mut bypass = node.workload().in_cgroup(&cgroup).steps(STEPS.map(|s| s.replace("600m", "300m"))).spawn()?;
    bypass.wait_checkpoint("one")?; // 600m + 300m: within the container's 1 GiB
    bypass.resume()?;
    let finished = bypass.wait()?; // 600m + 300m + 300m: past it
    assert_eq!(finished.status.signal(), Some(libc::SIGKILL), "stopped by SIGKILL: {:?} {:?}", finished.status, finished.stdout);
    assert!(!finished.stdout.iter().any(|l| l.starts_with("ok alloc b")), "{:?}", finished.stdout);
    hooked.kill()?;
    agent.stop()?;
    Ok(())
}

#[test]
fn deny_mode_says_why_it_is_unavailable() -> Result<()> {
    let cgroup = TestCgroup::create("deny")?;
    let limits = limits_file(&cgroup)?;
    let error = match agent("deny", &limits) {
        Ok(agent) => {
            agent.stop()?;
            anyhow::bail!("--enforce deny started although this build does not implement it");
        }
        Err(error) => format!("{error:#}"),
    };
    assert!(error.contains("--enforce deny is"), "unclear error: {error}");
    let _ = std::fs::remove_file(limits);
    Ok(())
}

#[test]
fn a_bad_limits_file_is_refused_with_its_line() -> Result<()> {
    let path = std::env::temp_dir().join(format!("vramguard-badlimits-{}", std::process::id()));
    std::fs::write(&path, "/ok 1g\n/bad lots\n")?;
    let error = match agent("signal", &path) {
        Ok(agent) => {
            agent.stop()?;
            anyhow::bail!("a bad limits file was accepted");
        }
        Err(error) => format!("{error:#}"),
    };
    assert!(error.contains("line 2") && error.contains("lots"), "unclear error: {error}");
    let _ = std::fs::remove_file(path);
    Ok(())
}

/// Whether this machine's cgroups are hybrid or v1: a cgroup v1 hierarchy with a
/// controller lists this process (a line of /proc/self/cgroup other than `0::`).
fn v1_controllers_in_use() -> Result<bool> {
    let text = std::fs::read_to_string("/proc/self/cgroup")?;
    Ok(text.lines().any(|line| {
        let mut fields = line.splitn(3, ':');
        let (id, controllers) = (fields.next().unwrap_or("0"), fields.next().unwrap_or(""));
        id != "0" && controllers.split(',').any(|c| !c.is_empty() && !c.starts_with("name="))
    }))
}

/// Preflight (issue "Hostile tenants", item 6): where cgroup v2 does not separate containers
/// (hybrid, as on the CI machines), `--enforce signal` is refused with the reason unless the
/// operator states that the runtime gives every container a cgroup2 group; audit still works.
/// On a pure cgroup v2 node signal enforcement needs no statement.
#[test]
fn signal_enforcement_is_refused_where_cgroup2_does_not_separate_containers() -> Result<()> {
    let cgroup = TestCgroup::create("preflight")?;
    let limits = limits_file(&cgroup)?;
    let plain = |mode: &str| {
        Agent::start_on_fake_driver(&["--limits".as_ref(), limits.as_os_str(), "--enforce".as_ref(), mode.as_ref()])
    };
    if v1_controllers_in_use()? {
        let error = match plain("signal") {
            Ok(agent) => {
                agent.stop()?;
                anyhow::bail!("--enforce signal started on a hybrid cgroup node without --cgroup2-separates-containers");
            }
            Err(error) => format!("{error:#}"),
        };
        assert!(
            error.contains("--enforce signal refused") && error.contains("hybrid") && error.contains(SEPARATES_CONTAINERS),
            "unclear refusal: {error}"
        );
    } else {
        plain("signal")?.stop()?;
    }
    // With the operator's statement it runs (the other tests of this file enforce with it).
    agent("signal", &limits)?.stop()?;
    // Audit needs no statement, and counts.
    let agent = plain("audit")?;
    let node = FakeNode::new("preflight");
    let finished = node.workload().in_cgroup(&cgroup).steps(["ctx 0", "alloc a 600m", "alloc b 600m"]).run()?.success()?;
    finished.line("ok alloc b ")?;
    assert_eq!(stat(&agent.audit()?, "over_limit"), 1);
    agent.stop()?;
    let _ = std::fs::remove_file(limits);
    Ok(())
}
