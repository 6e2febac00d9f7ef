//! A process whose main thread exits alone runs on (review of the exit path): its other threads
//! hold its memory, its pidfd is not readable and the kernel's exit of the process has not
//! come, yet `/proc/<pid>/stat` shows its leader a zombie. Neither the hook of another process
//! in its container (which frees the slots of dead processes before it refuses an allocation
//! past the quota) nor the agent's sweeps may take it for dead: its slot stays, the quota
//! holds, and the slot is freed once its last thread is gone. Real processes, the fake driver,
//! real eBPF. Needs root; build first (`cargo build --workspace`), run one test at a time.
use std::{ffi::OsStr, os::unix::process::ExitStatusExt, time::Duration};

use anyhow::{ensure, Context, Result};
use e2e::{agent::Agent, http, ledgers::slots, wait_for, FakeNode, TempDir, GIB};

/// The state letter of `/proc/<pid>/stat`.
fn state(pid: u32) -> Result<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("/proc/{pid}/stat"))?;
    stat[stat.rfind(')').context("no command name")? + 1..].trim_start().chars().next().context("no state")
}

#[test]
fn a_process_whose_main_thread_exited_keeps_its_slot_until_its_last_thread_exits() -> Result<()> {
    let node = FakeNode::new("leader-exit");
    let dir = TempDir::new("leader-exit")?;
    // The driver view on this node's fake NVML, a row joined only with a process holding the
    // node's device file open (`--gpu-device-file`).
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let device_file = node.state_dir().join(format!("{}-dev{{minor}}", node.name())).into_os_string();
    let mut args = e2e::agent::watching_args(&libcuda, dir.path());
    args.extend([OsStr::new("--no-discover"), OsStr::new("--gpu-device-file"), device_file.as_os_str()]);
    let agent = Agent::start_with_env(&args, node.env())?;
    std::fs::create_dir_all(dir.path().join("pod"))?;
    let ledger = dir.path().join("pod/ledger");

    // 600 MiB of a 1 GiB quota, then its main thread exits at once (before a sweep can have
    // seen it alive and watched it through a pidfd, most of the time: then the sweeps judge it
    // from /proc alone).
    let mut holder = node.hooked(&ledger, GIB)?.steps(["ctx 0", "alloc a 600m", "leader-exit"]).spawn()?;
    holder.expect_prefix("leader-exit")?;
    let pid = holder.pid();
    wait_for(Duration::from_secs(5), "the holder's leader a zombie", || Ok(state(pid)? == 'Z'))?;
    ensure!(std::fs::read_dir(format!("/proc/{pid}/task"))?.count() == 2, "the holder's other thread runs");

    // Another process of the container past the quota is refused: its hook's sweep of dead
    // slots does not free the holder's.
    let second = node.hooked(&ledger, GIB)?.steps(["ctx 0", "expect-oom alloc b 600m"]).run()?.success()?;
    second.line("oom b")?;
    ensure!(slots(&ledger)?.iter().any(|&(p, _)| p == pid), "the holder's slot was freed by the second process's hook");

    // The agent records it as alive (its host pid written in), and three sweeps later still.
    wait_for(Duration::from_secs(15), "the agent records the holder's host pid", || Ok(slots(&ledger)?.contains(&(pid, pid))))?;
    // And joins it with its slot and with the driver's row: its leader's /proc/<pid>/maps and
    // fd are empty (the kernel let go of the leader's address space and descriptor table), yet
    // the process maps its ledger and holds the device file. Taken for an un-hooked process,
    // its memory would be charged to the container a second time; its driver row unproven,
    // what it holds beyond the probes would be seen by no one.
    let ledger_path = ledger.to_string_lossy().into_owned();
    wait_for(Duration::from_secs(5), "the holder joined with its slot (state ok) and its driver row", || {
        let audit = agent.audit()?;
        let row = audit["processes"].as_array().and_then(|rows| rows.iter().find(|r| r["pid"] == pid)).cloned();
        Ok(row.is_some_and(|r| {
            r["state"] == "ok" && r["ledger"] == ledger_path.as_str() && r["driver_bytes"].as_u64().is_some_and(|b| b >= 600 << 20)
        }))
    })
    .with_context(|| format!("the audit: {}", agent.audit().map(|a| a["processes"].to_string()).unwrap_or_default()))?;
    let metric = |name: &str, labels: &[(&str, &str)]| -> Result<f64> {
        Ok(http::metric(&http::fresh_scrape(agent.metrics_addr()?)?, name, labels).unwrap_or(0.0))
    };
    let sweeps = metric("vramguard_reclaim_sweeps_total", &[("sweep", "all")])?;
    wait_for(Duration::from_secs(15), "three sweeps of every ledger", || Ok(metric("vramguard_reclaim_sweeps_total", &[("sweep", "all")])? >= sweeps + 3.0))?;
    ensure!(slots(&ledger)?.contains(&(pid, pid)), "the agent freed the slot of a running process: {}", agent.log());
    ensure!(state(pid)? == 'Z', "the holder's leader still a zombie, its thread running");
    node.hooked(&ledger, GIB)?.steps(["ctx 0", "expect-oom alloc c 600m"]).run()?.success()?.line("oom c")?;

    // Its last thread killed: the slot is freed, and the quota is whole again.
    let finished = holder.kill()?;
    ensure!(finished.status.signal() == Some(libc::SIGKILL), "the holder ended by SIGKILL: {:?}", finished.status);
    wait_for(Duration::from_secs(5), "the holder's slot freed", || Ok(!slots(&ledger)?.iter().any(|&(p, _)| p == pid)))?;
    node.hooked(&ledger, GIB)?.steps(["ctx 0", "alloc d 600m"]).run()?.success()?;
    ensure!(!agent.log().contains("panicked"), "the agent panicked: {}", agent.log());
    agent.stop()?;
    Ok(())
}
