//! External memory end to end (issue 11, item 1: "external-memory imports at least visible in
//! audit"): a real `vramguard run` probes the fake driver, a workload imports memory with
//! `cuImportExternalMemory` (and maps it with `cuExternalMemoryGetMappedBuffer`), and the
//! audit and the metrics show the bytes per process and cgroup while they are imported, none
//! once destroyed or once the process is gone, while the process's and the cgroup's GPU usage
//! (what the limits enforce) never move. Needs root; run one test at a time.
use std::{ffi::OsStr, time::Duration};

use anyhow::{Context, Result};
use e2e::{
    agent::Agent,
    cgroup::TestCgroup,
    http::{fresh_scrape, metric},
    wait_for, FakeNode, MIB,
};
use serde_json::Value;

/// The external-memory row of `key` = `id` in `table` (`processes` or `cgroups`).
fn external(audit: &Value, table: &str, key: &str, id: u64) -> Option<Value> {
    audit["external_memory"][table].as_array()?.iter().find(|row| row[key].as_u64() == Some(id)).cloned()
}

/// (bytes, imports) of the process's and of the cgroup's external-memory rows; (0, 0) for a
/// missing row.
fn imported(audit: &Value, pid: u32, cgroup: u64) -> [(u64, u64); 2] {
    let pair = |row: Option<Value>| {
        row.map_or((0, 0), |r| (r["bytes"].as_u64().unwrap_or(u64::MAX), r["imports"].as_u64().unwrap_or(u64::MAX)))
    };
    [pair(external(audit, "processes", "pid", u64::from(pid))), pair(external(audit, "cgroups", "cgroup_id", cgroup))]
}

/// The GPU usage (total bytes) of the process's and of the cgroup's accounting rows.
fn gpu_usage(audit: &Value, pid: u32, cgroup: u64) -> [Option<u64>; 2] {
    let find = |table: &str, key: &str, id: u64| {
        audit[table].as_array().and_then(|rows| rows.iter().find(|row| row[key].as_u64() == Some(id))).and_then(|row| row["total_bytes"].as_u64())
    };
    [find("processes", "pid", u64::from(pid)), find("cgroups", "cgroup_id", cgroup)]
}

#[test]
fn imported_external_memory_is_shown_never_charged_and_goes_with_destroy_and_exit() -> Result<()> {
    let agent = Agent::start_on_fake_driver(&[OsStr::new("--metrics-addr"), OsStr::new("127.0.0.1:0")])?;
    let addr = agent.metrics_addr()?;
    let node = FakeNode::new("extmem");
    let cgroup = TestCgroup::create("extmem")?;
    let mut workload = node
        .workload()
        .in_cgroup(&cgroup)
        .steps([
            "ctx 0",
            "alloc a 4m",
            "checkpoint before",
            "import x 64m",
            "import y 16m",
            "checkpoint imported",
            "import-destroy x",
            "checkpoint one",
            "import-destroy y",
            "checkpoint destroyed",
            "free a",
        ])
        .spawn()?;
    let pid = workload.pid();
    let charged = [Some(4 * MIB), Some(4 * MIB)];

    workload.wait_checkpoint("before")?;
    let audit = agent.audit()?;
    assert_eq!(imported(&audit, pid, cgroup.id), [(0, 0); 2], "nothing imported yet: {audit}");
    assert_eq!(gpu_usage(&audit, pid, cgroup.id), charged, "the allocation is charged: {audit}");

    workload.resume()?;
    workload.wait_checkpoint("imported")?;
    let audit = agent.audit()?;
    assert_eq!(imported(&audit, pid, cgroup.id), [(80 * MIB, 2); 2], "both imports shown: {audit}");
    assert_eq!(gpu_usage(&audit, pid, cgroup.id), charged, "imports are not charged: {audit}");
    let row = external(&audit, "processes", "pid", u64::from(pid)).context("process row")?;
    assert_eq!(row["cgroup"].as_str(), Some(cgroup.path.as_str()));
    let table = String::from_utf8_lossy(&agent.audit_table()?.stdout).into_owned();
    assert!(table.contains(&format!("external memory (imported, not charged): pid {pid}")), "{table}");
    let id = cgroup.id.to_string();
    let scrape = fresh_scrape(addr)?;
    assert_eq!(
        metric(&scrape, "vramguard_external_memory_bytes", &[("cgroup_id", id.as_str())]),
        Some((80 * MIB) as f64),
        "the metric shows the cgroup's imports"
    );

    workload.resume()?;
    workload.wait_checkpoint("one")?;
    let audit = agent.audit()?;
    assert_eq!(imported(&audit, pid, cgroup.id), [(16 * MIB, 1); 2], "one import destroyed: {audit}");

    workload.resume()?;
    workload.wait_checkpoint("destroyed")?;
    let audit = agent.audit()?;
    assert_eq!(imported(&audit, pid, cgroup.id), [(0, 0); 2], "both destroyed: {audit}");
    assert_eq!(gpu_usage(&audit, pid, cgroup.id), charged, "destroying imports uncharges nothing: {audit}");
    let scrape = fresh_scrape(addr)?;
    assert_eq!(metric(&scrape, "vramguard_external_memory_bytes", &[("cgroup_id", id.as_str())]), None, "its series goes");
    workload.resume()?;
    workload.wait()?.success()?;

    // A process that exits holding an import: its bytes leave its cgroup's at once, its
    // record is swept.
    let mut leaver = node.workload().in_cgroup(&cgroup).steps(["ctx 0", "import z 8m", "checkpoint held", "exit 0"]).spawn()?;
    let leaver_pid = leaver.pid();
    leaver.wait_checkpoint("held")?;
    let audit = agent.audit()?;
    assert_eq!(imported(&audit, leaver_pid, cgroup.id), [(8 * MIB, 1); 2], "the leaver's import: {audit}");
    let records = Agent::stat(&audit, "stale_records_removed");
    leaver.resume()?;
    leaver.wait()?;
    let audit = agent.audit()?;
    assert_eq!(imported(&audit, leaver_pid, cgroup.id), [(0, 0); 2], "gone with its process: {audit}");
    wait_for(Duration::from_secs(15), "the dead process's import record is swept", || {
        Ok(Agent::stat(&agent.audit()?, "stale_records_removed") > records)
    })?;
    agent.stop()?;
    Ok(())
}

/// A cgroup's import records are bounded by `--max-alloc-records-per-cgroup`: past it an import
/// is counted as unrecorded (bytes unknown), and a destroy below the cap makes room again.
#[test]
fn import_records_stop_at_the_per_cgroup_cap() -> Result<()> {
    let agent = Agent::start_on_fake_driver(&[OsStr::new("--max-alloc-records-per-cgroup"), OsStr::new("2")])?;
    let node = FakeNode::new("extcap");
    let cgroup = TestCgroup::create("extcap")?;
    let mut workload = node
        .workload()
        .in_cgroup(&cgroup)
        .steps([
            "ctx 0",
            "import a 1m",
            "import b 2m",
            "import c 4m",
            "checkpoint capped",
            "import-destroy a",
            "import d 8m",
            "checkpoint room",
        ])
        .spawn()?;
    let pid = workload.pid();
    workload.wait_checkpoint("capped")?;
    let audit = agent.audit()?;
    assert_eq!(imported(&audit, pid, cgroup.id), [(3 * MIB, 2); 2], "two records, the third past the cap: {audit}");
    let row = external(&audit, "cgroups", "cgroup_id", cgroup.id).context("cgroup row")?;
    assert_eq!(row["unrecorded"].as_u64(), Some(1), "the import past the cap is counted: {audit}");
    workload.resume()?;
    workload.wait_checkpoint("room")?;
    let audit = agent.audit()?;
    assert_eq!(imported(&audit, pid, cgroup.id), [(10 * MIB, 2); 2], "a destroy below the cap made room: {audit}");
    assert_eq!(gpu_usage(&audit, pid, cgroup.id), [None, None], "nothing charged: {audit}");
    workload.resume()?;
    workload.wait()?.success()?;
    agent.stop()?;
    Ok(())
}
