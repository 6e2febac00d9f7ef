//! Reconciliation (issue "The agent", item 3, with its audit and metrics): a real
//! `vramguard run --ledger-dir DIR --metrics-addr 127.0.0.1:0` probes the fake driver while
//! four workloads hold GPU memory: A hooked within its quota (`ok`, its ledger bytes equal
//! to its eBPF bytes), B hooked and refused past its quota (the refusal counted in
//! `vramguard_container_rejections_total`), C not hooked at all (`unhooked`), and T hooked,
//! whose slot's usage is then written to zero in the ledger file from outside, as a process
//! scribbling on its own slot would (`tampered`, logged by the agent's own passes within 3 s,
//! with no scrape or audit to prompt it).
//! Needs root; build first with `cargo xtask test` (or `cargo build -p agent -p hook -p
//! fakecuda -p workload`), and run one test at a time.
use std::{path::Path, time::Duration};

use anyhow::{ensure, Context, Result};
use e2e::{
    agent::Agent,
    holding,
    http::{fresh_scrape, metric, Sample},
    ledgers::zero_slot_bytes,
    wait_for, FakeNode, TempDir, GIB, MIB,
};
use ledger::Ledger;
use serde_json::Value;

const LIMIT: u64 = GIB;

/// The `vramguard audit --json` row of `pid`.
fn row(audit: &Value, pid: u32) -> Option<Value> {
    audit["processes"].as_array()?.iter().find(|r| r["pid"].as_u64() == Some(u64::from(pid))).cloned()
}

#[test]
fn reconcile_reports_ok_unhooked_tampered_and_counts_rejections() -> Result<()> {
    let node = FakeNode::new("reconcile").with_env("FAKECUDA_DEVICE_BYTES", "4g").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let dir = TempDir::new("reconcile")?;
    let (ledger_a, ledger_b, ledger_t) = (dir.ledger("pod-a")?, dir.ledger("pod-b")?, dir.ledger("pod-t")?);
    let agent = Agent::watching(&dir.0, &[])?;
    let addr = agent.metrics_addr()?;

    let a = holding(node.hooked(&ledger_a, LIMIT)?, &["ctx 0", "alloc a 100m"])?;
    let b = holding(node.hooked(&ledger_b, LIMIT)?, &["ctx 0", "alloc b1 600m", "expect-oom alloc b2 600m"])?;
    let c = holding(node.workload(), &["ctx 0", "alloc c 300m"])?;
    let t = holding(node.hooked(&ledger_t, LIMIT)?, &["ctx 0", "alloc t 200m"])?;

    // Every process in its state once the agent has picked the new ledgers up (it scans
    // every second), and the views agree where they should.
    let want = [(a.pid(), "ok"), (b.pid(), "ok"), (c.pid(), "unhooked"), (t.pid(), "ok")];
    wait_for(Duration::from_secs(5), "every process reconciled", || {
        let audit = agent.audit()?;
        Ok(want.iter().all(|&(pid, state)| row(&audit, pid).is_some_and(|r| r["state"] == state)))
    })?;
    let audit = agent.audit()?;
    let expect = |pid: u32, state: &str, ledger: Option<&Path>, bytes: u64| -> Result<()> {
        let r = row(&audit, pid).with_context(|| format!("no audit row for {pid}: {audit}"))?;
        ensure!(r["state"] == state, "pid {pid} is {} (want {state}): {r}", r["state"]);
        ensure!(r["total_bytes"].as_u64() == Some(bytes), "pid {pid}'s eBPF bytes: {r}");
        match ledger {
            Some(path) => {
                ensure!(r["ledger"].as_str() == Some(path.to_str().unwrap_or_default()), "pid {pid}'s ledger: {r}");
                ensure!(r["ledger_bytes"].as_u64() == Some(bytes), "pid {pid}: ledger bytes equal eBPF bytes: {r}");
            }
            None => ensure!(r["ledger"].is_null() && r["ledger_bytes"].is_null(), "pid {pid} has no ledger: {r}"),
        }
        Ok(())
    };
    expect(a.pid(), "ok", Some(&ledger_a), 100 * MIB)?;
    expect(b.pid(), "ok", Some(&ledger_b), 600 * MIB)?;
    expect(c.pid(), "unhooked", None, 300 * MIB)?;
    expect(t.pid(), "ok", Some(&ledger_t), 200 * MIB)?;
    let table = agent.audit_table()?;
    let table = String::from_utf8_lossy(&table.stdout);
    ensure!(table.contains("STATE") && table.lines().any(|l| l.contains(&c.pid().to_string()) && l.contains("unhooked")), "{table}");

    let all = fresh_scrape(addr)?;
    let state = |all: &[Sample], pid: u32, state: &str| metric(all, "vramguard_process_state", &[("pid", &pid.to_string()), ("state", state)]);
    assert_eq!(state(&all, a.pid(), "ok"), Some(1.0));
    assert_eq!(state(&all, a.pid(), "tampered"), Some(0.0));
    assert_eq!(state(&all, c.pid(), "unhooked"), Some(1.0));
    assert_eq!(state(&all, c.pid(), "ok"), Some(0.0));
    assert_eq!(metric(&all, "vramguard_unhooked_processes", &[]), Some(1.0));
    let ebpf_of = |all: &[Sample], ledger: &Path| {
        metric(all, "vramguard_container_ebpf_memory_bytes", &[("ledger", ledger.to_str().unwrap_or_default())])
    };
    assert_eq!(ebpf_of(&all, &ledger_a), Some((100 * MIB) as f64));
    assert_eq!(ebpf_of(&all, &ledger_b), Some((600 * MIB) as f64));
    // The ledger's data bytes (whole chunks here) are the same figure.
    let data = metric(&all, "vramguard_container_memory_used_bytes", &[("ledger", ledger_a.to_str().unwrap_or_default()), ("kind", "data")]);
    assert_eq!(data, Some((100 * MIB) as f64));

    // B's refusal, as its ledger counts it.
    let refused = Ledger::open(&ledger_b)?.device_usage()?[0].rejections;
    assert_eq!(refused, 1, "the hook refused b2 once");
    let rejections = |ledger: &Path| {
        metric(&all, "vramguard_container_rejections_total", &[("ledger", ledger.to_str().unwrap_or_default()), ("device_index", "0")])
    };
    assert_eq!(rejections(&ledger_b), Some(1.0));
    assert_eq!(rejections(&ledger_a), Some(0.0));

    // T's slot written down to zero: tampered, found by the agent's own passes.
    let before = zero_slot_bytes(&ledger_t, t.pid())?;
    assert_eq!(before, 200 * MIB + 64 * MIB, "T's allocation and its context reserve");
    let marker = format!("pid={} ", t.pid());
    let latency = wait_for(Duration::from_secs(3), "the tampered slot reported", || {
        Ok(agent.log().lines().any(|l| l.contains("process state changed") && l.contains(&marker) && l.contains("to=tampered")))
    })?;
    eprintln!("slot zeroed to `tampered` in the agent's log: {latency:?}");
    let all = fresh_scrape(addr)?;
    assert_eq!(state(&all, t.pid(), "tampered"), Some(1.0));
    assert_eq!(state(&all, t.pid(), "ok"), Some(0.0));
    assert_eq!(state(&all, a.pid(), "ok"), Some(1.0), "A is unaffected");
    let audit = agent.audit()?;
    let r = row(&audit, t.pid()).context("no audit row for T")?;
    ensure!(r["state"] == "tampered" && r["ledger_bytes"] == 0 && r["total_bytes"].as_u64() == Some(200 * MIB), "{r}");

    drop((a, b, c, t));
    agent.stop()?;
    Ok(())
}
