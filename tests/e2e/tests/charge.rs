//! What a hooked container holds outside its ledger is charged to it (issue "The agent",
//! item 3), and a ledger whose limits are rewritten under its processes is reported
//! (`tampered`). A real `vramguard run --ledger-dir DIR` probes the fake driver; one
//! container (a cgroup) has a hooked process holding memory and a process that skips the
//! preload: the agent charges the second one's memory to the container's ledger, so a new
//! hooked process of the container is refused what would pass the quota counting it, and
//! the charge goes when that process dies. Then the ledger's header is rewritten with a
//! valid checksum, as a workload could, and every process of the ledger is reported
//! `tampered`.
//! Needs root; run with `cargo xtask test`.
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use e2e::{
    agent::Agent,
    cgroup::TestCgroup,
    holding,
    http::{fresh_scrape, metric},
    ledgers::{rewrite_header, used},
    wait_for, FakeNode, TempDir, GIB, MIB,
};

#[test]
fn unhooked_memory_of_a_hooked_container_is_charged_and_a_rewritten_header_is_tampering() -> Result<()> {
    let node = FakeNode::new("charge").with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let dir = TempDir::new("charge")?;
    let ledger = dir.ledger("pod-x")?;
    let container = TestCgroup::create("charge-x")?;
    let agent = Agent::watching(&dir.0, &[])?;
    let addr = agent.metrics_addr()?;
    let ledger_label = ledger.to_str().context("ledger path")?.to_string();

    let hooked = holding(node.hooked(&ledger, GIB)?.in_cgroup(&container), &["ctx 0", "alloc h 200m"])?;
    let bypass = holding(node.workload().in_cgroup(&container), &["ctx 0", "alloc u 512m"])?;
    // The ledger charges the hooked process's context and allocation, then the agent adds
    // the 512 MiB it sees the un-hooked process of the same container hold.
    let own = 64 * MIB + 200 * MIB;
    let latency = wait_for(Duration::from_secs(5), "the un-hooked memory charged to the ledger", || Ok(used(&ledger)? == own + 512 * MIB))?;
    eprintln!("un-hooked memory charged to the container's ledger after {latency:?}");
    let all = fresh_scrape(addr)?;
    assert_eq!(metric(&all, "vramguard_container_unaccounted_bytes", &[("ledger", &ledger_label)]), Some((512 * MIB) as f64));
    let state = |pid: u32| -> Result<String> {
        let audit = agent.audit()?;
        let row = audit["processes"].as_array().and_then(|rows| rows.iter().find(|r| r["pid"].as_u64() == Some(u64::from(pid))).cloned());
        Ok(row.map(|r| r["state"].as_str().unwrap_or_default().to_string()).unwrap_or_default())
    };
    assert_eq!(state(bypass.pid())?, "unhooked");
    assert_eq!(state(hooked.pid())?, "ok");

    // A new hooked process of the container: its context (64 MiB) fits, 256 MiB more would
    // pass the quota with the un-hooked memory counted (64+200+512+64+256 > 1024), 128 MiB fits.
    let late = node
        .hooked(&ledger, GIB)?
        .in_cgroup(&container)
        .steps(["ctx 0", "expect-oom alloc big 256m", "alloc small 128m"])
        .run()?
        .success()?;
    ensure!(late.stdout.iter().any(|l| l.starts_with("ok alloc small")), "{:?}", late.stdout);

    // The un-hooked process dies: its charge goes.
    bypass.kill()?;
    wait_for(Duration::from_secs(5), "the charge dropped", || Ok(used(&ledger)? == own))?;
    let all = fresh_scrape(addr)?;
    assert_eq!(metric(&all, "vramguard_container_unaccounted_bytes", &[("ledger", &ledger_label)]), Some(0.0));

    // The header rewritten under the running process (valid checksum, context reserve 0):
    // tampered.
    let before = rewrite_header(&ledger, |header| header.devices[0].context_reserve = 0)?;
    assert_eq!(before.devices[0].context_reserve, 64 * MIB);
    let marker = format!("pid={} ", hooked.pid());
    wait_for(Duration::from_secs(3), "the rewritten header reported", || {
        Ok(agent.log().lines().any(|l| l.contains("process state changed") && l.contains(&marker) && l.contains("to=tampered")))
    })?;
    ensure!(agent.log().contains("device 0 context_reserve 67108864 -> 0"), "the agent says what changed: {}", agent.log());
    assert_eq!(state(hooked.pid())?, "tampered");
    let all = fresh_scrape(addr)?;
    let pid = hooked.pid().to_string();
    assert_eq!(metric(&all, "vramguard_process_state", &[("pid", &pid), ("state", "tampered")]), Some(1.0));

    // The hooked process dies: its slot is reclaimed, the agent's own stays until it stops.
    drop(hooked);
    wait_for(Duration::from_secs(3), "the hooked slot reclaimed", || Ok(e2e::ledgers::slots(&ledger)?.len() == 1))?;
    let log = agent.stop()?;
    // A clean stop frees the agent's own slot.
    wait_for(Duration::from_secs(3), "every slot freed", || Ok(e2e::ledgers::slots(&ledger)?.is_empty()))
        .with_context(|| format!("slots left: {:?}\n{log}", e2e::ledgers::slots(&ledger)))?;
    Ok(())
}
