//! eBPF accounting end to end (issue "Foundation"): a real `vramguard run` probes the fake
//! driver's libcuda, workloads run in cgroups of their own, and what `vramguard audit --json`
//! reports is compared with what the workloads did. Needs root; run with
//! `cargo xtask test` (one test at a time: uprobes see every process on the machine).
use std::ffi::OsStr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use e2e::{agent::Agent, cgroup::TestCgroup, fake_driver_dir, FakeNode, Running, Via, MIB};
use serde_json::Value;

fn agent() -> Result<Agent> {
    Agent::start(&fake_driver_dir()?.join("libcuda.so.1"))
}

/// The audit row of cgroup `id`, if it holds anything.
fn cgroup_row(audit: &Value, id: u64) -> Option<Value> {
    rows(audit, "cgroups").into_iter().find(|row| row["cgroup_id"].as_u64() == Some(id))
}

/// The audit row of process `pid`, if it holds anything.
fn process_row(audit: &Value, pid: u32) -> Option<Value> {
    rows(audit, "processes").into_iter().find(|row| row["pid"].as_u64() == Some(pid as u64))
}

fn rows(audit: &Value, table: &str) -> Vec<Value> {
    audit[table].as_array().cloned().unwrap_or_default()
}

/// Bytes by kind of a row as (device, managed, async, vmm).
fn kinds(row: &Value) -> (u64, u64, u64, u64) {
    let bytes = &row["bytes"];
    let get = |kind: &str| bytes[kind].as_u64().unwrap_or(u64::MAX);
    (get("device"), get("managed"), get("async"), get("vmm"))
}

fn stat(audit: &Value, name: &str) -> u64 {
    Agent::stat(audit, name)
}

/// Asserts that both the cgroup's and the process's usage are exactly `expected`
/// (device, managed, async, vmm) with `live` allocations.
fn assert_usage(
    agent: &Agent,
    cgroup: &TestCgroup,
    pid: u32,
    expected: (u64, u64, u64, u64),
    live: u64,
    when: &str,
) -> Result<()> {
    let audit = agent.audit()?;
    let total = expected.0 + expected.1 + expected.2 + expected.3;
    let process = process_row(&audit, pid).with_context(|| format!("{when}: no row for pid {pid}: {audit}"))?;
    assert_eq!(kinds(&process), expected, "{when}: process {pid} usage by kind");
    assert_eq!(process["total_bytes"].as_u64(), Some(total), "{when}: process total");
    assert_eq!(process["live_allocations"].as_u64(), Some(live), "{when}: process live allocations");
    assert_eq!(process["cgroup"].as_str(), Some(cgroup.path.as_str()), "{when}: process cgroup path");
    match cgroup_row(&audit, cgroup.id) {
        Some(row) => {
            assert_eq!(kinds(&row), expected, "{when}: cgroup usage by kind");
            assert_eq!(row["live_allocations"].as_u64(), Some(live), "{when}: cgroup live allocations");
        }
        None => assert_eq!(total, 0, "{when}: cgroup {} missing from {audit}", cgroup.path),
    }
    Ok(())
}

/// The known sequence across every API family, with checkpoints.
const SEQUENCE: [&str; 19] = [
    "ctx 0",
    "alloc a 4m",
    "pitch p 1000 300 4", // pitch 1024 x 300 rows = 307200 bytes
    "managed m 8m",
    "async s 3m",
    "async-ptsz t 1m",
    "pool q 5m",
    "pool-ptsz r 2m",
    "create h 4m",
    "checkpoint all",
    "free a",
    "free-async s",
    "release h",
    "checkpoint some",
    "free p",
    "free m",
    "free-async-ptsz t",
    "free-async q",
    "free-async r",
];

const ALL: (u64, u64, u64, u64) = (4 * MIB + 307_200, 8 * MIB, 11 * MIB, 4 * MIB);
const SOME: (u64, u64, u64, u64) = (307_200, 8 * MIB, 8 * MIB, 0);

/// Runs SEQUENCE through `via` in a fresh cgroup and checks every checkpoint.
fn run_sequence(agent: &Agent, via: Via) -> Result<()> {
    let node = FakeNode::new("sequence");
    let cgroup = TestCgroup::create("sequence")?;
    let mut workload = node
        .workload()
        .via(via)
        .in_cgroup(&cgroup)
        .steps(SEQUENCE)
        .step("checkpoint none")
        .spawn()?;
    let pid = workload.pid();
    workload.wait_checkpoint("all")?;
    assert_usage(agent, &cgroup, pid, ALL, 8, "after every allocation")?;
    workload.resume()?;
    workload.wait_checkpoint("some")?;
    assert_usage(agent, &cgroup, pid, SOME, 5, "after the first frees")?;
    workload.resume()?;
    workload.wait_checkpoint("none")?;
    assert_usage(agent, &cgroup, pid, (0, 0, 0, 0), 0, "after every free")?;
    workload.resume()?;
    workload.wait()?.success()?;
    Ok(())
}

/// How the kernel links the probes of the one libcuda `agent` probes (`uprobe_multi` or
/// `perf_event`), as its audit says.
fn links(agent: &Agent) -> Result<String> {
    let audit = agent.audit()?;
    let files = rows(&audit, "libcuda");
    let [file] = files.as_slice() else { bail!("one libcuda probed: {audit}") };
    Ok(file["links"].as_str().unwrap_or_default().to_string())
}

/// Runs the sequence of every API family under an agent started with `args`, whose probes
/// the kernel links as `links`.
fn every_family(args: &[&OsStr], expected: &str) -> Result<()> {
    let agent = Agent::start_on_fake_driver(args)?;
    assert_eq!(links(&agent)?, expected);
    run_sequence(&agent, Via::Dlsym)?;
    agent.stop()?;
    Ok(())
}

/// This kernel (6.18) has uprobe_multi links: the agent uses them by default.
#[test]
fn every_api_family_is_accounted_exactly_per_cgroup_and_process() -> Result<()> {
    every_family(&[], "uprobe_multi")
}

/// The perf events a kernel without uprobe_multi links gets (forced here): the same figures.
#[test]
fn every_api_family_is_accounted_exactly_through_perf_event_probes_too() -> Result<()> {
    every_family(&[OsStr::new("--uprobe-links"), OsStr::new("perf")], "perf_event")
}

/// A kernel that refuses uprobe_multi links (as before 6.6; injected here past a file's first
/// link, which is made and removed again): the agent says so once and probes with perf events,
/// the same figures.
#[test]
fn a_kernel_that_refuses_uprobe_multi_links_gets_perf_events_with_the_same_figures() -> Result<()> {
    let agent = Agent::start_on_fake_driver(&[OsStr::new("--fault"), OsStr::new("refuse:uprobe-multi")])?;
    assert_eq!(links(&agent)?, "perf_event");
    run_sequence(&agent, Via::Dlsym)?;
    let log = agent.stop()?;
    ensure!(log.matches("the kernel refuses uprobe_multi links").count() == 1, "said once: {log}");
    // Every probe detached at the stop: the perf events, none of the links made and removed.
    ensure!(log.contains("probes detached links=28 "), "the stop's detaching: {log}");
    Ok(())
}

#[test]
fn pointers_from_cu_get_proc_address_are_seen_like_dlsym_ones() -> Result<()> {
    let agent = agent()?;
    run_sequence(&agent, Via::Getproc)?;
    agent.stop()?;
    Ok(())
}

/// Starts a workload that allocates 3 blocks (no frees) and waits at checkpoint "held".
fn holder(node: &FakeNode, cgroup: &TestCgroup, last: &str) -> Result<Running> {
    let mut workload = node
        .workload()
        .in_cgroup(cgroup)
        .steps(["ctx 0", "alloc a 6m", "async b 2m", "create c 2m", "checkpoint held", last])
        .spawn()?;
    workload.wait_checkpoint("held")?;
    Ok(workload)
}

/// After the process is reaped its usage is gone at once (the exit tracepoint drops it
/// synchronously); its records are swept within 1 s.
fn assert_gone_after_exit(agent: &Agent, cgroup: &TestCgroup, pid: u32, records_before: u64) -> Result<()> {
    let reaped = Instant::now();
    let audit = agent.audit()?;
    assert!(process_row(&audit, pid).is_none(), "process {pid} still accounted after exit: {audit}");
    assert!(cgroup_row(&audit, cgroup.id).is_none(), "cgroup still holds memory after its only process exited: {audit}");
    loop {
        let audit = agent.audit()?;
        if stat(&audit, "records") == records_before {
            println!("records of pid {pid} swept {:?} after it was reaped", reaped.elapsed());
            return Ok(());
        }
        if reaped.elapsed() > Duration::from_secs(1) {
            bail!("records of pid {pid} still present 1 s after exit: {audit}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_process_that_exits_without_freeing_disappears() -> Result<()> {
    let agent = agent()?;
    let node = FakeNode::new("exit");
    let cgroup = TestCgroup::create("exit")?;
    let records_before = stat(&agent.audit()?, "records");
    let mut workload = holder(&node, &cgroup, "exit 0")?;
    let pid = workload.pid();
    assert_usage(&agent, &cgroup, pid, (6 * MIB, 0, 2 * MIB, 2 * MIB), 3, "while held")?;
    assert_eq!(stat(&agent.audit()?, "records"), records_before + 3);
    workload.resume()?;
    workload.wait()?;
    assert_gone_after_exit(&agent, &cgroup, pid, records_before)?;
    agent.stop()?;
    Ok(())
}

#[test]
fn a_sigkilled_process_disappears() -> Result<()> {
    let agent = agent()?;
    let node = FakeNode::new("sigkill");
    let cgroup = TestCgroup::create("sigkill")?;
    let records_before = stat(&agent.audit()?, "records");
    let workload = holder(&node, &cgroup, "hold")?;
    let pid = workload.pid();
    assert_usage(&agent, &cgroup, pid, (6 * MIB, 0, 2 * MIB, 2 * MIB), 3, "while held")?;
    workload.kill()?;
    assert_gone_after_exit(&agent, &cgroup, pid, records_before)?;
    agent.stop()?;
    Ok(())
}

#[test]
fn failed_allocations_are_not_counted() -> Result<()> {
    let agent = agent()?;
    let node = FakeNode::new("oom")
        .with_env("FAKECUDA_DEVICE_BYTES", "256m")
        .with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let cgroup = TestCgroup::create("oom")?;
    let mut workload = node
        .workload()
        .in_cgroup(&cgroup)
        .steps([
            "ctx 0",
            "alloc a 100m",
            "expect-oom alloc b 1g",
            "expect-oom async c 1g",
            "expect-oom create d 1g",
            "expect-oom managed e 1g",
            "checkpoint after",
            "free a",
        ])
        .spawn()?;
    let pid = workload.pid();
    workload.wait_checkpoint("after")?;
    assert_usage(&agent, &cgroup, pid, (100 * MIB, 0, 0, 0), 1, "after four refused allocations")?;
    let process = process_row(&agent.audit()?, pid).context("process row")?;
    assert_eq!(process["allocs"].as_u64(), Some(1), "refused allocations counted as allocations");
    workload.resume()?;
    workload.wait()?.success()?;
    agent.stop()?;
    Ok(())
}

/// VMM memory lives as the driver keeps it (issue 11, item 1): a handle released while still
/// mapped stays charged to its process and cgroup until its last mapping goes; a reference
/// from `cuMemRetainAllocationHandle` keeps it after release and unmap until it is released
/// too; a handle released unmapped is uncharged at once (the control); host-located
/// `cuMemCreate` (NCCL's host buffers) is never GPU memory.
#[test]
fn vmm_memory_stays_charged_until_released_and_unmapped_and_host_memory_never_counts() -> Result<()> {
    let agent = agent()?;
    let node = FakeNode::new("vmmlife").with_env("FAKECUDA_DEVICE_BYTES", "8g");
    let cgroup = TestCgroup::create("vmmlife")?;
    let mut workload = node
        .workload()
        .in_cgroup(&cgroup)
        .steps([
            "ctx 0",
            "create-host n 64m",
            "checkpoint host",
            "create c 16m",
            "release c",
            "vmm a 64m",
            "vmm b 32m",
            "release a",
            "release b",
            "checkpoint mapped",
            "unmap a",
            "checkpoint one",
            "unmap b",
            "checkpoint none",
            "vmm r 8m",
            "retain r",
            "release r",
            "unmap r",
            "checkpoint retained",
            "release r",
            "checkpoint gone",
            "release n",
        ])
        .spawn()?;
    let pid = workload.pid();
    workload.wait_checkpoint("host")?;
    let audit = agent.audit()?;
    assert!(
        process_row(&audit, pid).is_none_or(|row| row["total_bytes"].as_u64() == Some(0)),
        "host memory counted as GPU memory: {audit}"
    );
    workload.resume()?;
    workload.wait_checkpoint("mapped")?;
    assert_usage(&agent, &cgroup, pid, (0, 0, 0, 96 * MIB), 2, "two released handles still mapped")?;
    workload.resume()?;
    workload.wait_checkpoint("one")?;
    assert_usage(&agent, &cgroup, pid, (0, 0, 0, 32 * MIB), 1, "after the first unmap")?;
    workload.resume()?;
    workload.wait_checkpoint("none")?;
    assert_usage(&agent, &cgroup, pid, (0, 0, 0, 0), 0, "after the last unmap")?;
    workload.resume()?;
    workload.wait_checkpoint("retained")?;
    assert_usage(&agent, &cgroup, pid, (0, 0, 0, 8 * MIB), 1, "released and unmapped, one retained reference left")?;
    workload.resume()?;
    workload.wait_checkpoint("gone")?;
    assert_usage(&agent, &cgroup, pid, (0, 0, 0, 0), 0, "the retained reference released")?;
    workload.resume()?;
    workload.wait()?.success()?;
    assert_eq!(stat(&agent.audit()?, "vmm_pinned"), 0, "no mapping went unrecorded");
    agent.stop()?;
    Ok(())
}

#[test]
fn eight_processes_of_four_threads_100k_pairs_leave_nothing() -> Result<()> {
    const PROCESSES: u64 = 8;
    const THREADS: u64 = 4;
    const PAIRS_PER_THREAD: u64 = 3125; // 8 x 4 x 3125 = 100,000 alloc/free pairs
    let agent = agent()?;
    let node = FakeNode::new("stress").with_env("FAKECUDA_DEVICE_BYTES", "64g");
    let cgroup = TestCgroup::create("stress")?;
    let before = agent.audit()?;
    let events_before = stat(&before, "events_alloc") + stat(&before, "events_free") + stat(&before, "events_exit");
    let lost_before = stat(&before, "exit_events_lost");
    let workloads: Vec<Running> = (0..PROCESSES)
        .map(|_| {
            node.workload()
                .in_cgroup(&cgroup)
                .steps(["ctx 0".to_string(), format!("stress {THREADS} {PAIRS_PER_THREAD} 1m")])
                .spawn()
        })
        .collect::<Result<_>>()?;
    for workload in workloads {
        let finished = workload.wait()?.success()?;
        finished.line("stress ")?;
    }
    let audit = agent.audit()?;
    assert!(cgroup_row(&audit, cgroup.id).is_none(), "usage left in the cgroup: {audit}");
    assert_eq!(stat(&audit, "untracked_allocs"), 0, "allocations the maps could not hold");
    // Their spare records go with their other records, swept once they exited.
    let audit = agent.records_settle(stat(&before, "records"), Duration::from_secs(1))?;
    let pairs = PROCESSES * THREADS * PAIRS_PER_THREAD;
    let received = stat(&audit, "events_alloc") + stat(&audit, "events_free") + stat(&audit, "events_exit") - events_before;
    let lost = stat(&audit, "exit_events_lost") - lost_before;
    // Every pair is an allocation and a free the kernel counted, and every process one exit,
    // received or counted lost.
    assert_eq!(received + lost, 2 * pairs + PROCESSES, "pairs or exits neither counted nor counted as lost");
    println!("{pairs} pairs: {received} events received, {lost} counted lost");
    agent.stop()?;
    Ok(())
}

/// Asserts the records in the kernel map, and the spares among them, since `before`.
fn assert_records(agent: &Agent, before: u64, records: u64, spares: u64, when: &str) -> Result<()> {
    let audit = agent.audit()?;
    assert_eq!(stat(&audit, "records") - before, records, "{when}: records ({audit})");
    assert_eq!(stat(&audit, "spare_records"), spares, "{when}: spare records ({audit})");
    Ok(())
}

/// The probe-cost work of issue 11: a freed device pointer's record stays as a spare, and an
/// allocation the driver hands the same address takes it over in place (no map insert or
/// delete). The books are exact throughout; a process keeps at most 16 spares (the rest of
/// its frees delete their records), an allocation at an address without a spare gets a new
/// record, and a process's spares go with it.
#[test]
fn a_freed_pointer_s_record_is_kept_as_a_spare_and_taken_over_when_the_address_returns() -> Result<()> {
    let agent = agent()?;
    let node = FakeNode::new("spares").with_env("FAKECUDA_DEVICE_BYTES", "8g");
    let cgroup = TestCgroup::create("spares")?;
    let before = stat(&agent.audit()?, "records");
    let mut steps = vec!["ctx 0".to_string(), "bench 1000 1m".to_string(), "checkpoint cycled".to_string()];
    // Twenty sizes, twenty addresses (the fake driver, like the real one, hands a freed
    // address out again for an allocation of its size).
    steps.extend((1..=20).map(|i| format!("alloc d{i} {}m", i + 1)));
    steps.extend((1..=20).map(|i| format!("free d{i}")));
    steps.extend(["checkpoint freed", "alloc again 5m", "checkpoint again", "alloc fresh 18m", "checkpoint fresh"].map(String::from));
    let mut workload = node.workload().in_cgroup(&cgroup).steps(steps).step("exit 0").spawn()?;
    let pid = workload.pid();
    workload.wait_checkpoint("cycled")?;
    assert_usage(&agent, &cgroup, pid, (0, 0, 0, 0), 0, "after 1000 pairs at one address")?;
    let row = process_row(&agent.audit()?, pid).context("process row")?;
    assert_eq!((row["allocs"].as_u64(), row["frees"].as_u64()), (Some(1000), Some(1000)), "every pair counted: {row}");
    assert_records(&agent, before, 1, 1, "after 1000 pairs at one address")?;
    workload.resume()?;
    workload.wait_checkpoint("freed")?;
    assert_usage(&agent, &cgroup, pid, (0, 0, 0, 0), 0, "after twenty frees")?;
    assert_records(&agent, before, 16, 16, "after twenty frees (the 1 MiB spare and fifteen more)")?;
    workload.resume()?;
    workload.wait_checkpoint("again")?;
    assert_usage(&agent, &cgroup, pid, (5 * MIB, 0, 0, 0), 1, "5 MiB again, at a spare's address")?;
    assert_records(&agent, before, 16, 15, "5 MiB again")?;
    workload.resume()?;
    workload.wait_checkpoint("fresh")?;
    assert_usage(&agent, &cgroup, pid, (23 * MIB, 0, 0, 0), 2, "18 MiB, whose record was deleted")?;
    assert_records(&agent, before, 17, 15, "18 MiB at an address without a spare")?;
    workload.resume()?;
    workload.wait()?.success()?;
    assert_gone_after_exit(&agent, &cgroup, pid, before)?;
    agent.stop()?;
    Ok(())
}

/// Spares never crowd out a cgroup's records: none is kept while the cgroup holds half its
/// cap (`--max-alloc-records-per-cgroup 8`: of six frees, those made at 4 or more records
/// delete theirs).
#[test]
fn no_spare_is_kept_while_the_cgroup_holds_half_its_cap_of_records() -> Result<()> {
    let agent = Agent::start_on_fake_driver(&[OsStr::new("--max-alloc-records-per-cgroup"), OsStr::new("8")])?;
    let node = FakeNode::new("sparecap");
    let cgroup = TestCgroup::create("sparecap")?;
    let before = stat(&agent.audit()?, "records");
    let mut steps = vec!["ctx 0".to_string()];
    steps.extend((1..=6).map(|i| format!("alloc a{i} {i}m")));
    steps.push("checkpoint held".to_string());
    steps.extend((1..=6).map(|i| format!("free a{i}")));
    let mut workload = node.workload().in_cgroup(&cgroup).steps(steps).step("checkpoint freed").spawn()?;
    let pid = workload.pid();
    workload.wait_checkpoint("held")?;
    assert_records(&agent, before, 6, 0, "six held")?;
    workload.resume()?;
    workload.wait_checkpoint("freed")?;
    assert_usage(&agent, &cgroup, pid, (0, 0, 0, 0), 0, "all freed")?;
    assert_records(&agent, before, 3, 3, "six freed at 6, 5, 4, 3, 3, 3 records")?;
    workload.resume()?;
    workload.wait()?.success()?;
    agent.stop()?;
    Ok(())
}

/// `--max-spare-records-per-process 0` keeps none: every free deletes its record, as before
/// spares (the control of the test above: the same pairs keep one spare with the default).
#[test]
fn with_no_spares_allowed_every_free_deletes_its_record() -> Result<()> {
    let agent = Agent::start_on_fake_driver(&[OsStr::new("--max-spare-records-per-process"), OsStr::new("0")])?;
    let node = FakeNode::new("nospares");
    let cgroup = TestCgroup::create("nospares")?;
    let before = stat(&agent.audit()?, "records");
    let mut workload = node
        .workload()
        .in_cgroup(&cgroup)
        .steps(["ctx 0", "bench 100 1m", "alloc a 2m", "alloc b 3m", "free a", "checkpoint cycled", "free b"])
        .spawn()?;
    let pid = workload.pid();
    workload.wait_checkpoint("cycled")?;
    assert_usage(&agent, &cgroup, pid, (3 * MIB, 0, 0, 0), 1, "100 pairs and a free, no spares")?;
    assert_records(&agent, before, 1, 0, "100 pairs and a free: only the live allocation's record")?;
    workload.resume()?;
    workload.wait()?.success()?;
    agent.stop()?;
    Ok(())
}

/// Hostile: eight threads free the same pointer at once, 2000 times over (each time at the
/// address the spare of the previous round holds). The driver takes one free of each; the
/// books take exactly one too: nothing is uncharged twice, so the 3 MiB the process keeps
/// stay charged.
#[test]
fn a_pointer_freed_by_eight_threads_at_once_is_uncharged_once() -> Result<()> {
    racing_frees_uncharge_once(&[])
}

/// The same with no spares kept: each free claims the record before deleting it, so of the
/// racing frees only the claim's winner uncharges.
#[test]
fn a_pointer_freed_by_eight_threads_at_once_is_uncharged_once_without_spares() -> Result<()> {
    racing_frees_uncharge_once(&[OsStr::new("--max-spare-records-per-process"), OsStr::new("0")])
}

fn racing_frees_uncharge_once(agent_args: &[&OsStr]) -> Result<()> {
    let agent = Agent::start_on_fake_driver(agent_args)?;
    let node = FakeNode::new("racefree");
    let cgroup = TestCgroup::create("racefree")?;
    let mut workload = node
        .workload()
        .in_cgroup(&cgroup)
        .steps(["ctx 0", "alloc keep 3m", "race-free 8 2000 1m", "checkpoint raced"])
        .spawn()?;
    let pid = workload.pid();
    workload.wait_checkpoint("raced")?;
    assert_usage(&agent, &cgroup, pid, (3 * MIB, 0, 0, 0), 1, "after 2000 rounds of eight racing frees")?;
    let audit = agent.audit()?;
    let row = process_row(&audit, pid).context("process row")?;
    assert_eq!((row["allocs"].as_u64(), row["frees"].as_u64()), (Some(2001), Some(2000)), "frees counted: {row}");
    let cgroup_totals = cgroup_row(&audit, cgroup.id).context("cgroup row")?;
    assert_eq!(cgroup_totals["frees"].as_u64(), Some(2000), "cgroup frees: {cgroup_totals}");
    workload.resume()?;
    let finished = workload.wait()?.success()?;
    assert_eq!(finished.line("race-free ")?, "race-free rounds=2000 freed=2000", "the driver took one free a round");
    agent.stop()?;
    Ok(())
}

#[test]
fn audit_without_an_agent_says_so() -> Result<()> {
    let output = std::process::Command::new(e2e::agent::agent_bin()?)
        .args(["audit", "--socket", "/nonexistent/vramguard.sock"])
        .output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("is `vramguard run` running"), "unclear error: {stderr}");
    Ok(())
}

#[test]
fn run_refuses_a_missing_libcuda_and_non_root() -> Result<()> {
    let output = std::process::Command::new(e2e::agent::agent_bin()?)
        .args(["run", "--no-discover", "--libcuda", "/nonexistent/libcuda.so.1", "--socket", "/tmp/vramguard-e2e-none.sock"])
        .output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/libcuda.so.1"), "error does not name the file: {stderr}");

    let output = std::process::Command::new(e2e::agent::agent_bin()?)
        .args(["run", "--no-discover", "--socket", "/tmp/vramguard-e2e-none.sock"])
        .output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no libcuda found"), "unclear error: {stderr}");

    let mut as_nobody = std::process::Command::new(e2e::agent::agent_bin()?);
    as_nobody.args(["run", "--socket", "/tmp/vramguard-e2e-none.sock"]);
    std::os::unix::process::CommandExt::uid(&mut as_nobody, 65534);
    let output = as_nobody.output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("must run as root"), "unclear error: {stderr}");
    Ok(())
}

/// The agent finds libcuda files through /proc/<pid>/maps, at start and on re-scans, and
/// probes each file once whatever path reaches it.
/// Runs alone: its agent discovers libcuda on the whole node (it would probe the other test binaries' fake drivers).
#[test]
fn discovery_probes_every_libcuda_that_processes_map() -> Result<()> {
    // A second, distinct libcuda file (another inode) that only a later process will map.
    let late_dir = std::env::temp_dir().join(format!("vramguard-e2e-late-{}", std::process::id()));
    std::fs::create_dir_all(&late_dir)?;
    std::fs::copy(e2e::fake_driver_lib()?, late_dir.join("libcuda.so.1"))?;

    let node = FakeNode::new("discovery");
    let cgroup = TestCgroup::create("discovery")?;
    // Maps the workspace's fake libcuda before the agent starts.
    let mut early = node
        .workload()
        .in_cgroup(&cgroup)
        .steps(["ctx 0", "checkpoint mapped", "alloc a 4m", "checkpoint allocated", "free a"])
        .spawn()?;
    early.wait_checkpoint("mapped")?;
    let agent = Agent::start_with(&["--rescan-ms".as_ref(), "100".as_ref()])?;
    early.resume()?;
    early.wait_checkpoint("allocated")?;
    assert_usage(&agent, &cgroup, early.pid(), (4 * MIB, 0, 0, 0), 1, "allocation through the discovered file")?;
    early.resume()?;
    early.wait()?.success()?;

    let mut late = node
        .workload()
        .lib_dir(&late_dir)
        .in_cgroup(&cgroup)
        .steps(["ctx 0", "checkpoint mapped", "alloc b 2m", "checkpoint allocated", "free b"])
        .spawn()?;
    late.wait_checkpoint("mapped")?;
    let late_path = late_dir.join("libcuda.so.1");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let audit = agent.audit()?;
        let probed: Vec<String> = rows(&audit, "libcuda").iter().filter_map(|f| f["path"].as_str().map(String::from)).collect();
        if probed.iter().any(|p| p.ends_with(&*late_path.to_string_lossy())) {
            // Each file once (other processes of a shared machine may map driver copies of
            // their own, which are probed too).
            let mut ids: Vec<(u64, u64)> =
                rows(&audit, "libcuda").iter().map(|f| (f["dev"].as_u64().unwrap_or(0), f["ino"].as_u64().unwrap_or(0))).collect();
            let count = ids.len();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), count, "each file probed once: {probed:?}");
            let ours = [e2e::fake_driver_lib()?, late_path.clone()];
            for path in &ours {
                assert!(probed.iter().filter(|p| p.ends_with(&*path.to_string_lossy())).count() == 1, "{} once: {probed:?}", path.display());
            }
            break;
        }
        if Instant::now() > deadline {
            bail!("the re-scan did not probe {} within 5 s: {probed:?}", late_path.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    late.resume()?;
    late.wait_checkpoint("allocated")?;
    assert_usage(&agent, &cgroup, late.pid(), (2 * MIB, 0, 0, 0), 1, "allocation through the re-scanned file")?;
    late.resume()?;
    late.wait()?.success()?;
    agent.stop()?;
    let _ = std::fs::remove_dir_all(&late_dir);
    Ok(())
}
