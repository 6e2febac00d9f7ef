//! No tenant-sized work on the agent's runtime threads (issue 24, item 3), the kernel side:
//! an exit sweeps the dead process's own allocation records, never the others' (the probes
//! journal each new record's key, the agent indexes them by process), a lost journal entry is
//! mended by one full sweep, and the cgroup2 tree is walked when it changed, not on a timer.
//! Counted, not timed: `records_swept_by_exit`, `full_sweeps`, `cgroup_tree_walks` in
//! `vramguard audit --json`'s stats and the matching metrics. Needs root; run with
//! `cargo xtask test`.
use std::{
    ffi::OsStr,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use e2e::{
    agent::Agent,
    cgroup::{TestCgroup, SEPARATES_CONTAINERS},
    field, http, wait_for, FakeNode, MIB,
};
use serde_json::Value;

fn stat(audit: &Value, name: &str) -> u64 {
    Agent::stat(audit, name)
}

/// The audit row of process `pid`.
fn process_row(audit: &Value, pid: u32) -> Option<Value> {
    audit["processes"].as_array()?.iter().find(|row| row["pid"].as_u64() == Some(u64::from(pid))).cloned()
}

/// A fake machine whose device holds `pages` 2 MiB pages beside a 2 MiB context: `fill 1 4k`
/// then makes 512 allocations a page (the driver packs small allocations into shared pages).
fn small_device(tag: &str, pages: u64) -> FakeNode {
    FakeNode::new(tag).with_env("FAKECUDA_CONTEXT_BYTES", "2m").with_env("FAKECUDA_DEVICE_BYTES", (2 * MIB + pages * 2 * MIB).to_string())
}

/// Waits up to 2 s for the agent's count of records to be `expected`; the audit that said so.
fn records_settle(agent: &Agent, expected: u64, when: &str) -> Result<Value> {
    agent.records_settle(expected, Duration::from_secs(2)).with_context(|| when.to_string())
}

/// 10,240 records of another live process in the map: a process's exit examines its own
/// three records and no other (counted), and the 10,240 stay; when that process dies in turn,
/// its exit examines its own. No full sweep runs meanwhile (nothing was lost).
#[test]
fn one_exit_sweeps_its_own_records_not_the_ten_thousand_of_another_process() -> Result<()> {
    const PAGES: u64 = 20;
    const HELD: u64 = PAGES * 512;
    let agent = Agent::start_on_fake_driver(&[OsStr::new("--metrics-addr"), OsStr::new("127.0.0.1:0")])?;
    let before = agent.audit()?;
    let records_before = stat(&before, "records");

    // The neighbour holds 10,000 records (no frees: no spares among them).
    let holder_cgroup = TestCgroup::create("sweepheld")?;
    let holder_node = small_device("sweepheld", PAGES);
    let mut holder = holder_node.workload().in_cgroup(&holder_cgroup).steps(["ctx 0", "fill 1 4k", "checkpoint filled", "hold"]).spawn()?;
    assert_eq!(field(&holder.expect_prefix("fill ")?, "allocations")?, HELD, "the holder's allocations");
    holder.wait_checkpoint("filled")?;
    let held = records_settle(&agent, records_before + HELD, "the holder's records")?;
    let row = process_row(&held, holder.pid()).context("the holder's row")?;
    assert_eq!(row["live_allocations"].as_u64(), Some(HELD), "{row}");

    // A process with three records exits.
    let exiter_cgroup = TestCgroup::create("sweepexit")?;
    let exiter_node = FakeNode::new("sweepexit");
    let mut exiter = exiter_node
        .workload()
        .in_cgroup(&exiter_cgroup)
        .steps(["ctx 0", "alloc a 6m", "async b 2m", "create c 2m", "checkpoint held", "exit 0"])
        .spawn()?;
    exiter.wait_checkpoint("held")?;
    let ready = records_settle(&agent, records_before + HELD + 3, "the exiter's records")?;
    exiter.resume()?;
    exiter.wait()?;
    let after = records_settle(&agent, records_before + HELD, "after the exiter's exit")?;
    let swept = |audit: &Value| stat(audit, "records_swept_by_exit");
    assert_eq!(swept(&after) - swept(&ready), 3, "the exit examined the exiter's own 3 records only: {}", after["stats"]);
    assert_eq!(stat(&after, "stale_records_removed") - stat(&ready, "stale_records_removed"), 3, "{}", after["stats"]);
    assert_eq!(stat(&after, "full_sweeps"), 0, "no full sweep: nothing was lost: {}", after["stats"]);
    assert_eq!(stat(&after, "records_swept_full"), 0, "{}", after["stats"]);
    assert_eq!(stat(&after, "journal_lost"), 0, "{}", after["stats"]);
    let row = process_row(&after, holder.pid()).context("the holder's row after the exit")?;
    assert_eq!(row["live_allocations"].as_u64(), Some(HELD), "the holder's records stay: {row}");
    // Its index holds the holder's keys, about one a record.
    assert!(stat(&after, "record_index_keys") >= HELD, "{}", after["stats"]);

    // The metrics say the same.
    let samples = http::fresh_scrape(agent.metrics_addr()?)?;
    let by = |by: &str| http::metric(&samples, "vramguard_records_swept_total", &[("by", by)]);
    assert_eq!(by("exit"), Some(swept(&after) as f64));
    assert_eq!(by("full"), Some(0.0));
    assert_eq!(http::metric(&samples, "vramguard_full_sweeps_total", &[]), Some(0.0));

    // The holder's own exit sweeps its own 10,000.
    holder.kill()?;
    let gone = records_settle(&agent, records_before, "after the holder's exit")?;
    assert_eq!(swept(&gone) - swept(&after), HELD, "the holder's exit examined its own records: {}", gone["stats"]);
    assert_eq!(stat(&gone, "full_sweeps"), 0, "{}", gone["stats"]);
    agent.stop()?;
    Ok(())
}

/// The fallback: a journal the agent does not drain in time loses keys (counted); the exit
/// then sweeps the records it knows of, and one full sweep at the `--sweep-ms` tick finds the
/// rest and rebuilds the index, after which exits are swept by process again.
#[test]
fn keys_lost_from_a_full_journal_are_swept_by_one_full_sweep() -> Result<()> {
    // A journal of one page (170 keys) that 10,240 records overflow whatever the drains do.
    const PAGES: u64 = 20;
    const HELD: u64 = PAGES * 512;
    let agent = Agent::start_on_fake_driver(&[
        OsStr::new("--journal-bytes"),
        OsStr::new("4096"),
        OsStr::new("--sweep-ms"),
        OsStr::new("500"),
    ])?;
    let records_before = stat(&agent.audit()?, "records");
    let cgroup = TestCgroup::create("sweeplost")?;
    let node = small_device("sweeplost", PAGES);
    let mut flooder = node.workload().in_cgroup(&cgroup).steps(["ctx 0", "fill 1 4k", "checkpoint filled", "exit 0"]).spawn()?;
    assert_eq!(field(&flooder.expect_prefix("fill ")?, "allocations")?, HELD);
    flooder.wait_checkpoint("filled")?;
    let held = records_settle(&agent, records_before + HELD, "the flooder's records")?;
    let lost = stat(&held, "journal_lost");
    assert!(lost > 0, "the journal overflowed: {}", held["stats"]);
    flooder.resume()?;
    flooder.wait()?;
    let gone = records_settle(&agent, records_before, "after the flooder's exit")?;
    assert!(stat(&gone, "full_sweeps") >= 1, "a full sweep mended the lost keys: {}", gone["stats"]);
    assert!(stat(&gone, "records_swept_full") >= lost, "{}", gone["stats"]);
    // Once mended, an exit is swept by process again: no further full sweep for it.
    let full = stat(&gone, "full_sweeps");
    let mut next = FakeNode::new("sweepnext").workload().in_cgroup(&cgroup).steps(["ctx 0", "alloc a 2m", "checkpoint held", "exit 0"]).spawn()?;
    next.wait_checkpoint("held")?;
    let ready = records_settle(&agent, records_before + 1, "the next process's record")?;
    next.resume()?;
    next.wait()?;
    let after = records_settle(&agent, records_before, "after the next process's exit")?;
    assert_eq!(stat(&after, "records_swept_by_exit") - stat(&ready, "records_swept_by_exit"), 1, "{}", after["stats"]);
    assert_eq!(stat(&after, "full_sweeps"), full, "{}", after["stats"]);
    agent.stop()?;
    Ok(())
}

/// Finds two seconds in a row during which the kernel counted no change of the cgroup tree
/// (other work on the machine may make cgroups; the first second lets the walks that follow
/// an earlier change end) and asserts that the agent walked the tree no time in the second,
/// while it pushed limits every 100 ms; fails if no such seconds come within 30.
fn assert_no_walk_while_unchanged(agent: &Agent) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut quiet_before = false;
    let mut start = agent.audit()?;
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let end = agent.audit()?;
        let changes = stat(&end, "cgroup_tree_changes") - stat(&start, "cgroup_tree_changes");
        let walks = stat(&end, "cgroup_tree_walks") - stat(&start, "cgroup_tree_walks");
        if changes == 0 && quiet_before {
            assert_eq!(walks, 0, "the tree was walked while it did not change: {}", end["stats"]);
            return Ok(());
        }
        quiet_before = changes == 0;
        if Instant::now() > deadline {
            bail!("the cgroup tree changed every other second for 30 s (other work on the machine): no quiet seconds to check");
        }
        start = end;
    }
}

/// A cgroup made after the agent started, named by a pattern of the limits file, gets its
/// limit from the walk its `mkdir` caused: the honest allocation within the limit goes
/// through, the one past it is stopped; and nothing is walked while the tree is unchanged,
/// though the limits are pushed every 100 ms.
#[test]
fn a_cgroup_made_later_gets_its_limit_from_the_walk_its_mkdir_caused_and_an_unchanged_tree_is_not_walked() -> Result<()> {
    let limits = std::env::temp_dir().join(format!("vramguard-limits-late-{}", std::process::id()));
    std::fs::write(&limits, format!("/vramguard-test-latecg-{}-* 1g\n", std::process::id()))?;
    let agent = Agent::start_on_fake_driver(&[
        "--limits".as_ref(),
        limits.as_os_str(),
        "--enforce".as_ref(),
        "signal".as_ref(),
        SEPARATES_CONTAINERS.as_ref(),
        "--rescan-ms".as_ref(),
        "100".as_ref(),
        "--sweep-ms".as_ref(),
        "100".as_ref(),
    ])?;
    let audit = agent.audit()?;
    assert!(stat(&audit, "cgroup_tree_walks") >= 1, "the tree was walked at start: {}", audit["stats"]);
    assert_no_walk_while_unchanged(&agent)?;

    let before = agent.audit()?;
    let cgroup = TestCgroup::create("latecg")?;
    wait_for(Duration::from_secs(5), "the new cgroup's limit in the probes", || {
        let audit = agent.audit()?;
        let limited = audit["kernel_maps"]["cgroup_limits"].as_array().is_some_and(|ids| ids.iter().any(|id| id.as_u64() == Some(cgroup.id)));
        Ok(limited)
    })?;
    let audit = agent.audit()?;
    assert!(stat(&audit, "cgroup_tree_changes") > stat(&before, "cgroup_tree_changes"), "the mkdir was counted: {}", audit["stats"]);
    assert!(stat(&audit, "cgroup_tree_walks") > stat(&before, "cgroup_tree_walks"), "the mkdir caused a walk: {}", audit["stats"]);

    let node = FakeNode::new("latecg").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let mut workload = node.workload().in_cgroup(&cgroup).steps(["ctx 0", "alloc a 600m", "checkpoint one", "alloc b 600m", "checkpoint two"]).spawn()?;
    workload.wait_checkpoint("one")?;
    assert_eq!(node.used(0)?, 64 * MIB + 600 * MIB, "the allocation within the limit went through");
    workload.resume()?;
    let finished = workload.wait()?;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(finished.status.signal(), Some(libc::SIGKILL), "stopped past its limit: {:?}", finished.status);
    assert!(!finished.stdout.iter().any(|l| l.starts_with("ok alloc b")), "the driver never allocated b: {:?}", finished.stdout);

    assert_no_walk_while_unchanged(&agent)?;
    agent.stop()?;
    let _ = std::fs::remove_file(limits);
    Ok(())
}
