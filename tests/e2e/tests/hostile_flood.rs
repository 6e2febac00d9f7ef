//! Hostile tenants against the eBPF side (issue 12, item 4): one cgroup floods allocations and
//! events; the kernel maps and ring buffers must stay useful for everyone else. Each attack
//! asserts, while it runs, that the agent still serves `/metrics` and still reclaims a killed
//! process of another container within a second (`e2e::hostile`).
//!
//! The agent runs with small limits so that the flood is quick: a node-wide record map of
//! 8192 entries and a cap of 1000 live records per cgroup. Allocations and frees emit no
//! events (the maps and the kernel's counters say them), so the flood has no queue to fill;
//! exits have a ring buffer of their own. Needs root; run with `cargo xtask test`.
//!
//! Bounds latency: /healthz answers within 250 ms under attack.
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use e2e::{
    agent::Agent,
    cgroup::TestCgroup,
    field, holding,
    hostile::{assert_serving, Bystander},
    http, wait_for, FakeNode, Running, TempDir, MIB,
};
use serde_json::Value;

const NODE_RECORDS: u64 = 8192;
const CAP: u64 = 1000;
/// What the kernel's rate limit lets through per kind per second
/// (`common::trouble::LINES_PER_SECOND`).
const LINES_PER_SECOND: u64 = 5;
/// The log line of a record refused by the cap.
const CAPPED_LINE: &str = "is at its cap of 1000 allocation records";

fn flood_agent(dir: &TempDir, more: &[&str]) -> Result<Agent> {
    let mut args = vec![
        "--max-alloc-records",
        "8192",
        "--max-alloc-records-per-cgroup",
        "1000",
        // The counters read only by the once-a-second pass.
        "--drain-ms",
        "10000",
    ];
    args.extend_from_slice(more);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
    Agent::watching(dir.path(), &args)
}

/// A fake machine whose device holds `small` bytes of small allocations beside a 2 MiB
/// context: `fill N 4k` then makes `small / 4 KiB` allocations.
fn small_device(tag: &str, small: u64) -> FakeNode {
    FakeNode::new(tag).with_env("FAKECUDA_CONTEXT_BYTES", "2m").with_env("FAKECUDA_DEVICE_BYTES", (2 * MIB + small).to_string())
}

fn row(audit: &Value, table: &str, key: &str, id: u64) -> Option<Value> {
    audit[table].as_array()?.iter().find(|row| row[key].as_u64() == Some(id)).cloned()
}

fn cgroup_row(audit: &Value, cgroup: &TestCgroup) -> Result<Value> {
    row(audit, "cgroups", "cgroup_id", cgroup.id).with_context(|| format!("no audit row for cgroup {}: {audit}", cgroup.path))
}

fn stat(audit: &Value, name: &str) -> u64 {
    Agent::stat(audit, name)
}

fn u(value: &Value) -> u64 {
    value.as_u64().unwrap_or(u64::MAX)
}

/// The agent's log lines that contain `text`.
fn log_lines(agent: &Agent, text: &str) -> Vec<String> {
    agent.log().lines().filter(|line| line.contains(text)).map(String::from).collect()
}

/// Fails if more lines of one kind were logged than the kernel's rate limit allows in
/// `elapsed` (each started second, plus one second's worth for CPUs racing at its turn).
fn assert_rate_limited(lines: usize, elapsed: Duration, what: &str) {
    let seconds = elapsed.as_secs() + 1;
    let allowed = LINES_PER_SECOND * (seconds + 1);
    assert!(lines as u64 <= allowed, "{lines} `{what}` lines in {elapsed:?}: more than {allowed}");
}

/// One cgroup allocates past its cap (and past the node's whole record map), then floods the
/// probes with alloc/free pairs. Meanwhile another cgroup's allocations are
/// recorded and charged exactly, a third container's killed process is reclaimed within a
/// second with its exit event seen, the flooder is reported capped in audit and metrics, and
/// the kernel's trouble is counted and logged, rate-limited.
#[test]
fn an_alloc_flood_caps_its_cgroup_and_blinds_nobody_else() -> Result<()> {
    let started = Instant::now();
    let dir = TempDir::new("flood")?;
    let agent = flood_agent(&dir, &[])?;
    let flood_node = small_device("flood", 64 * MIB);
    let mut bystander = Bystander::start(&flood_node, &dir, &agent)?;

    // The flood: 16384 live allocations of 4 KiB from one cgroup, twice the node's map.
    let flood_cgroup = TestCgroup::create("flood")?;
    let mut flooder = flood_node
        .workload()
        .in_cgroup(&flood_cgroup)
        .steps(["ctx 0", "fill 2 4k", "checkpoint capped", "free-fill", "checkpoint freed", "stress 2 1000000000 4k"])
        .spawn()?;
    let filled = flooder.expect_prefix("fill ")?;
    let allocations = field(&filled, "allocations")?;
    assert!(allocations > NODE_RECORDS, "the flood must exceed the node's record map: {filled}");
    flooder.wait_checkpoint("capped")?;
    let audit = agent.audit()?;
    let flood = cgroup_row(&audit, &flood_cgroup)?;
    assert_eq!(flood["capped"], true, "the flooder is marked capped: {flood}");
    let live = u(&flood["live_allocations"]);
    assert!((CAP..=CAP + 2).contains(&live), "the flooder keeps its cap of records (two threads may race one past): {flood}");
    assert_eq!(u(&flood["unrecorded"]), allocations - live, "the rest is charged without a record: {flood}");
    assert_eq!(u(&flood["total_bytes"]), allocations * 4096, "every allocation is still charged: {flood}");
    assert_eq!(stat(&audit, "records_capped"), allocations - live, "{audit}");
    assert_eq!(stat(&audit, "allocs_map_full"), 0, "the node's record map never filled: {audit}");
    assert!(stat(&audit, "records") < NODE_RECORDS, "{audit}");

    // Its recorded allocations freed, it floods the probes with alloc/free pairs.
    flooder.resume()?;
    flooder.wait_checkpoint("freed")?;
    let seen_before = stat(&agent.audit()?, "events_alloc");
    flooder.resume()?;
    wait_for(Duration::from_secs(10), "the flood's allocations counted", || {
        Ok(stat(&agent.audit()?, "events_alloc") > seen_before + 10_000)
    })?;

    // During the flood: another cgroup's allocations are seen exactly.
    let neighbour_node = FakeNode::new("neighbour");
    let neighbour_cgroup = TestCgroup::create("neighbour")?;
    let neighbour: Running =
        holding(neighbour_node.workload().in_cgroup(&neighbour_cgroup), &["ctx 0", "alloc a 3m", "alloc b 5m", "managed m 2m"])?;
    let audit = agent.audit()?;
    let row_n = cgroup_row(&audit, &neighbour_cgroup)?;
    assert_eq!(u(&row_n["total_bytes"]), 10 * MIB, "{row_n}");
    assert_eq!(u(&row_n["live_allocations"]), 3, "every allocation of the neighbour is recorded: {row_n}");
    assert_eq!(u(&row_n["unrecorded"]), 0, "{row_n}");
    assert_eq!(row_n["capped"], false, "{row_n}");
    let process = row(&audit, "processes", "pid", u64::from(neighbour.pid())).context("no row for the neighbour's process")?;
    assert_eq!(u(&process["total_bytes"]), 10 * MIB, "{process}");
    assert_eq!(cgroup_row(&audit, &flood_cgroup)?["capped"], true, "still capped while its unrecorded memory lives");

    // During the flood: a third container's killed process is reclaimed, its exit seen.
    let before = agent.audit()?;
    bystander.kill_and_expect_reclaim(&agent)?;
    wait_for(Duration::from_secs(2), "the bystander's exit event", || {
        Ok(stat(&agent.audit()?, "events_exit") > stat(&before, "events_exit"))
    })?;
    let audit = agent.audit()?;
    eprintln!("during the flood: {}", audit["stats"]);
    assert!(stat(&audit, "events_alloc") > stat(&before, "events_alloc"), "the flood was still running: {audit}");
    assert_eq!(stat(&audit, "events_lost"), 0, "allocations queue no events, so none are lost: {audit}");
    assert_eq!(stat(&audit, "exit_events_lost"), 0, "no exit is lost to an alloc flood: {audit}");
    assert_serving(&agent)?;

    // Metrics: the flooder capped, the neighbour not; the trouble counted.
    let samples = http::scrape(agent.metrics_addr()?)?;
    let capped = |cgroup: &TestCgroup| http::metric(&samples, "vramguard_cgroup_alloc_records_capped", &[("cgroup", cgroup.path.as_str())]);
    assert_eq!(capped(&flood_cgroup), Some(1.0));
    assert_eq!(capped(&neighbour_cgroup), None);
    let neighbour_pid = neighbour.pid().to_string();
    assert_eq!(
        http::metric(&samples, "vramguard_ebpf_process_memory_bytes", &[("pid", neighbour_pid.as_str())]),
        Some((10 * MIB) as f64)
    );
    let trouble = |kind: &str| http::metric(&samples, "vramguard_kernel_trouble_total", &[("kind", kind)]).unwrap_or(0.0);
    assert!(trouble("records_capped") >= (allocations - live) as f64);
    assert_eq!(trouble("events_lost"), 0.0);
    assert!(trouble("log_lines_suppressed") > 0.0, "the kernel held lines back");
    assert_eq!(trouble("exit_events_lost"), 0.0);

    // The log: the trouble reported by the kernel, at most its rate.
    let elapsed = started.elapsed();
    let capped_lines = log_lines(&agent, CAPPED_LINE);
    assert!(!capped_lines.is_empty(), "no `{CAPPED_LINE}` line in the agent's log:\n{}", agent.log());
    assert!(capped_lines.iter().all(|line| line.contains("vramguard::kernel")), "{capped_lines:?}");
    assert_rate_limited(capped_lines.len(), elapsed, CAPPED_LINE);
    assert!(log_lines(&agent, "ring buffer full").is_empty(), "no event was lost:\n{}", agent.log());

    flooder.kill()?;
    neighbour.kill()?;
    agent.stop()?;
    Ok(())
}

/// The negative control: a cgroup below its cap is recorded in full and never marked.
#[test]
fn below_the_cap_a_cgroup_is_recorded_in_full_and_not_marked() -> Result<()> {
    let dir = TempDir::new("calm")?;
    let agent = flood_agent(&dir, &[])?;
    let node = small_device("calm", 2 * MIB);
    let mut bystander = Bystander::start(&node, &dir, &agent)?;
    let cgroup = TestCgroup::create("calm")?;
    let mut calm = node.workload().in_cgroup(&cgroup).steps(["ctx 0", "fill 1 4k", "checkpoint filled", "hold"]).spawn()?;
    let allocations = field(&calm.expect_prefix("fill ")?, "allocations")?;
    assert!((1..CAP).contains(&allocations), "below the cap: {allocations}");
    calm.wait_checkpoint("filled")?;
    bystander.kill_and_expect_reclaim(&agent)?;
    assert_serving(&agent)?;
    let audit = agent.audit()?;
    let row = cgroup_row(&audit, &cgroup)?;
    assert_eq!(row["capped"], false, "{row}");
    assert_eq!(u(&row["live_allocations"]), allocations, "{row}");
    assert_eq!(u(&row["unrecorded"]), 0, "{row}");
    assert_eq!(stat(&audit, "records_capped"), 0, "{audit}");
    let samples = http::scrape(agent.metrics_addr()?)?;
    assert_eq!(http::samples(&samples, "vramguard_cgroup_alloc_records_capped").count(), 0);
    assert_eq!(http::metric(&samples, "vramguard_kernel_trouble_total", &[("kind", "records_capped")]), Some(0.0));
    assert!(log_lines(&agent, CAPPED_LINE).is_empty(), "{}", agent.log());
    calm.kill()?;
    agent.stop()?;
    Ok(())
}

/// Ids in `audit.kernel_maps[map]`.
fn map_ids(audit: &Value, map: &str) -> Vec<u64> {
    audit["kernel_maps"][map].as_array().map(|ids| ids.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
}

/// A cgroup removed after its processes allocated loses its `CGROUP_USAGE` and
/// `CGROUP_LIMITS` entries at once (the `cgroup_rmdir` tracepoint; the agent's own sweep is
/// kept out of the way), and the agent's re-assertion of limits does not bring them back; a
/// cgroup that still exists keeps its entries. Churning cgroups can then never fill the maps.
#[test]
fn a_removed_cgroups_map_entries_go_with_it() -> Result<()> {
    let dir = TempDir::new("rmdir")?;
    let gone = TestCgroup::create("gone")?;
    let kept = TestCgroup::create("kept")?;
    // Not under the ledger directory, where it would be taken for a ledger.
    let limits: PathBuf = std::env::temp_dir().join(format!("vramguard-rmdir-limits-{}", std::process::id()));
    std::fs::write(&limits, format!("{} 1g\n{} 1g\n", gone.path, kept.path))?;
    let limits_arg = limits.display().to_string();
    let agent = Agent::watching(
        dir.path(),
        &["--limits".as_ref(), limits_arg.as_ref(), "--sweep-ms".as_ref(), "600000".as_ref(), "--rescan-ms".as_ref(), "200".as_ref()],
    )?;
    let node = FakeNode::new("rmdir");
    let mut bystander = Bystander::start(&node, &dir, &agent)?;
    let in_gone = holding(node.workload().in_cgroup(&gone), &["ctx 0", "alloc a 4m"])?;
    let in_kept = holding(node.workload().in_cgroup(&kept), &["ctx 0", "alloc a 4m"])?;
    let has = |audit: &Value, map: &str, cgroup: &TestCgroup| map_ids(audit, map).contains(&cgroup.id);
    wait_for(Duration::from_secs(5), "both cgroups' usage and limits in the kernel maps", || {
        let audit = agent.audit()?;
        Ok([&gone, &kept].iter().all(|c| has(&audit, "cgroup_usage", c) && has(&audit, "cgroup_limits", c)))
    })?;

    let gone_id = gone.id;
    in_gone.kill()?;
    drop(gone); // rmdir
    bystander.kill_and_expect_reclaim(&agent)?;
    assert_serving(&agent)?;
    wait_for(Duration::from_secs(5), "the removed cgroup's entries deleted", || {
        let audit = agent.audit()?;
        Ok(!["cgroup_usage", "cgroup_limits"].iter().any(|map| map_ids(&audit, map).contains(&gone_id)))
    })?;
    let audit = agent.audit()?;
    assert!(stat(&audit, "cgroups_removed_by_kernel") >= 1, "deleted by the kernel's tracepoint: {audit}");
    assert_eq!(stat(&audit, "cgroup_entries_swept"), 0, "not by the agent's sweep: {audit}");

    // The agent re-asserts its limits every --rescan-ms: a few rounds must not re-create it.
    let rounds = Instant::now();
    while rounds.elapsed() < Duration::from_secs(1) {
        let audit = agent.audit()?;
        for map in ["cgroup_usage", "cgroup_limits"] {
            if map_ids(&audit, map).contains(&gone_id) {
                bail!("the removed cgroup's {map} entry came back: {audit}");
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let audit = agent.audit()?;
    assert!(has(&audit, "cgroup_usage", &kept) && has(&audit, "cgroup_limits", &kept), "a live cgroup keeps its entries: {audit}");
    in_kept.kill()?;
    agent.stop()?;
    let _ = std::fs::remove_file(limits);
    Ok(())
}
