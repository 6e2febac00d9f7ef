//! `vramguard inspect` and `vramguard reclaim` on a ledger file (issue "The agent", item 7):
//! inspect reports the slots (a dead process's as gone) and the invariants; reclaim frees the
//! slots of processes that are gone and never a running process's, and refuses to run at
//! all outside the host's pid namespace, where a running process of another namespace would
//! look dead. Needs root (a new pid namespace); run with `cargo xtask test`.
use std::process::{Command, Output};

use anyhow::{ensure, Context, Result};
use e2e::{agent::agent_bin, holding, ledgers, FakeNode, TempDir, GIB, MIB};
use serde_json::Value;

fn vramguard(args: &[&str], ledger: &std::path::Path) -> Result<Output> {
    Command::new(agent_bin()?).args(args).arg(ledger).output().context("cannot run vramguard")
}

#[test]
fn inspect_shows_the_slots_and_reclaim_frees_only_dead_ones_from_the_host_namespace() -> Result<()> {
    let node = FakeNode::new("cli").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let dir = TempDir::new("cli")?;
    let ledger = dir.ledger("pod")?;
    let live = holding(node.hooked(&ledger, GIB)?, &["ctx 0", "alloc keep 100m"])?;
    let victim = holding(node.hooked(&ledger, GIB)?, &["ctx 0", "alloc lost 200m"])?;
    let victim_pid = victim.pid();
    victim.kill()?; // no agent runs: its slot stays, charged
    assert_eq!(ledgers::used(&ledger)?, 2 * 64 * MIB + 300 * MIB);

    let output = vramguard(&["inspect", "--json"], &ledger)?;
    ensure!(output.status.success(), "inspect: {}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout)?;
    let slots = report["slots"].as_array().context("slots")?;
    let host_pid_of = |pid: u32| slots.iter().find(|s| s["pid"].as_u64() == Some(u64::from(pid))).map(|s| s["host_pid"].clone());
    assert_eq!(host_pid_of(live.pid()), Some(Value::from(live.pid())), "{report}");
    assert_eq!(host_pid_of(victim_pid), Some(Value::Null), "the killed process is gone: {report}");
    assert_eq!(report["violations"], Value::Array(vec![]), "{report}");

    // From a pid namespace of its own, every process of the ledger looks dead: refused.
    let output = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc"])
        .arg(agent_bin()?)
        .arg("reclaim")
        .arg(&ledger)
        .output()
        .context("cannot run unshare")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(!output.status.success() && stderr.contains("host's pid namespace"), "not refused: {stderr}");
    assert_eq!(ledgers::slots(&ledger)?.len(), 2, "nothing freed");

    // A running process's slot, named: refused.
    let live_slot = slots.iter().find(|s| s["pid"].as_u64() == Some(u64::from(live.pid()))).and_then(|s| s["slot"].as_u64()).context("live slot")?;
    let output = vramguard(&["reclaim", "--slot", &live_slot.to_string()], &ledger)?;
    ensure!(!output.status.success() && String::from_utf8_lossy(&output.stderr).contains("running process"), "{output:?}");

    // From the host: the dead slot freed, the live one kept.
    let output = vramguard(&["reclaim"], &ledger)?;
    ensure!(output.status.success(), "reclaim: {}", String::from_utf8_lossy(&output.stderr));
    ensure!(String::from_utf8_lossy(&output.stdout).contains("1 slot(s) reclaimed"), "{output:?}");
    let left: Vec<u32> = ledgers::slots(&ledger)?.into_iter().map(|(pid, _)| pid).collect();
    assert_eq!(left, vec![live.pid()]);
    assert_eq!(ledgers::used(&ledger)?, 64 * MIB + 100 * MIB);
    drop(live);
    Ok(())
}
