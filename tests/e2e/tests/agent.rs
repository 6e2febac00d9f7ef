//! The agent's ledger side (issue "The agent", slice: discovery, reclaim, metrics): a real
//! `vramguard run --ledger-dir DIR --metrics-addr 127.0.0.1:0` probes the fake driver while
//! hooked workloads keep their ledger in a container directory under DIR. Its `/metrics` are
//! scraped with a plain HTTP GET and compared with the ledger; SIGKILLed holders that their
//! parent (this test) does not reap must lose their slots to the agent within 1 s, a live
//! process's slot never; a corrupt file in DIR is skipped with its reason logged.
//! Needs root; build first with `cargo xtask test` (or `cargo build -p agent -p hook -p
//! fakecuda -p workload`), and run one test at a time.
use std::{path::Path, time::Duration};

use anyhow::{ensure, Context, Result};
use e2e::{
    agent::Agent,
    holding, http,
    http::{fresh_scrape, samples, scrape, Sample},
    ledgers::{slots, used as ledger_used},
    wait_for, FakeNode, Running, TempDir, GIB, MIB,
};

const LIMIT: u64 = GIB;
const CTX: u64 = 64 * MIB;
/// Killed holders, one after another (for a latency figure, not just one sample).
const VICTIMS: usize = 5;

fn single(all: &[Sample], name: &str) -> Result<f64> {
    samples(all, name).next().map(|s| s.value).with_context(|| format!("no {name} in the scrape"))
}

/// (used bytes summed over kinds, limit bytes) of device 0 of `ledger` in a scrape.
fn ledger_metrics(all: &[Sample], ledger: &Path) -> (Option<u64>, Option<u64>) {
    let path = ledger.display().to_string();
    let ours = |s: &&Sample| s.label("ledger") == path && s.label("device_index") == "0";
    let used: Vec<u64> = samples(all, "vramguard_container_memory_used_bytes").filter(ours).map(|s| s.value as u64).collect();
    let limit = samples(all, "vramguard_container_memory_limit_bytes").find(ours).map(|s| s.value as u64);
    ((!used.is_empty()).then(|| used.iter().sum()), limit)
}

fn process_state(pid: u32) -> Result<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rfind(')').map(|i| &stat[i + 1..]).context("unreadable stat")?;
    after.trim_start().chars().next().context("no state in stat")
}

fn holder(node: &FakeNode, ledger: &Path, size: &str) -> Result<Running> {
    holding(node.hooked(ledger, LIMIT)?, &["ctx 0", &format!("alloc a {size}")])
}

#[test]
fn the_agent_watches_ledgers_reclaims_dead_slots_and_exports_metrics() -> Result<()> {
    let node = FakeNode::new("agent").with_env("FAKECUDA_DEVICE_BYTES", "4g").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let dir = TempDir::new("ledgers")?;
    // A container directory holding garbage, there before the agent starts.
    std::fs::create_dir_all(dir.0.join("broken"))?;
    let corrupt = dir.0.join("broken/ledger");
    std::fs::write(&corrupt, b"this is not a ledger\n".repeat(512))?;
    // The workloads' container directory; the hook creates the ledger after the agent started.
    std::fs::create_dir_all(dir.0.join("pod-a"))?;
    let ledger = dir.0.join("pod-a/ledger");

    let agent = Agent::watching(&dir.0, &[])?;
    let addr = agent.metrics_addr()?;
    ensure!(addr.ip().is_loopback(), "metrics on {addr}");
    assert_eq!(http::get(addr, "/healthz")?.0, 200);
    assert_eq!(http::get(addr, "/readyz")?.0, 200);
    assert_eq!(http::get(addr, "/nothing")?.0, 404);
    let log = agent.log();
    ensure!(
        log.contains("skipping a file that is not a valid ledger") && log.contains(&corrupt.display().to_string()),
        "the corrupt file's skip is logged: {log}"
    );
    ensure!(log.contains("bad magic"), "with its reason: {log}");

    // A live holder: the agent picks its new ledger up and records its host pid.
    let live = holder(&node, &ledger, "100m")?;
    wait_for(Duration::from_secs(3), "the agent records the live holder's host pid", || {
        Ok(slots(&ledger)?.contains(&(live.pid(), live.pid())))
    })?;
    let all = fresh_scrape(addr)?;
    assert_eq!(single(&all, "vramguard_ledgers")?, 1.0);
    assert_eq!(single(&all, "vramguard_ledgers_skipped")?, 1.0);
    assert_eq!(ledger_metrics(&all, &ledger), (Some(ledger_used(&ledger)?), Some(LIMIT)));
    assert_eq!(ledger_used(&ledger)?, CTX + 100 * MIB);
    let ebpf = samples(&all, "vramguard_ebpf_process_memory_bytes")
        .find(|s| s.label("pid") == live.pid().to_string())
        .map(|s| s.value as u64);
    assert_eq!(ebpf, Some(100 * MIB), "the eBPF view of the live holder");
    let probes = samples(&all, "vramguard_probes_attached").filter(|s| s.label("links") == "uprobe_multi").map(|s| s.value).sum::<f64>();
    ensure!(probes > 0.0, "probes attached through uprobe_multi links: {probes}");
    assert_eq!(single(&all, "vramguard_events_lost_total")?, 0.0);

    // Holders SIGKILLed and left unreaped: the agent (nothing else touches the ledger)
    // frees their slots within 1 s; the live holder keeps its own.
    let mut latencies = Vec::new();
    let mut killed = Vec::new();
    for round in 0..VICTIMS {
        let victim = holder(&node, &ledger, "200m")?;
        let pid = victim.pid();
        killed.push(pid);
        wait_for(Duration::from_secs(3), "the victim's slot and usage", || {
            Ok(slots(&ledger)?.iter().any(|&(p, _)| p == pid) && ledger_used(&ledger)? == 2 * CTX + 300 * MIB)
        })?;
        let all = fresh_scrape(addr)?;
        assert_eq!(ledger_metrics(&all, &ledger).0, Some(2 * CTX + 300 * MIB), "round {round}: used with the victim");
        victim.signal(libc::SIGKILL)?;
        let elapsed = wait_for(Duration::from_secs(1), "the killed holder's slot reclaimed", || {
            Ok(!slots(&ledger)?.iter().any(|&(p, _)| p == pid))
        })?;
        assert_eq!(process_state(pid)?, 'Z', "round {round}: still unreaped when its slot was freed");
        latencies.push(elapsed);
        assert_eq!(slots(&ledger)?, vec![(live.pid(), live.pid())], "round {round}: only the live slot is left");
        assert_eq!(ledger_used(&ledger)?, CTX + 100 * MIB, "round {round}: its usage went with it");
        drop(victim); // reaped now
    }
    latencies.sort();
    eprintln!(
        "SIGKILL to slot reclaimed (seen from the test, {VICTIMS} rounds): min {:?}, median {:?}, max {:?}",
        latencies[0],
        latencies[VICTIMS / 2],
        latencies[VICTIMS - 1]
    );
    let all = fresh_scrape(addr)?;
    assert_eq!(single(&all, "vramguard_reclaims_total")?, VICTIMS as f64);
    let count = single(&all, "vramguard_reclaim_latency_seconds_count")?;
    let sum = single(&all, "vramguard_reclaim_latency_seconds_sum")?;
    assert_eq!(count, VICTIMS as f64);
    eprintln!("the agent's own figure: mean exit-event-to-reclaim latency {:.3} ms", sum / count * 1e3);
    let under_1s = samples(&all, "vramguard_reclaim_latency_seconds_bucket").find(|s| s.label("le") == "1");
    assert_eq!(under_1s.map(|s| s.value), Some(VICTIMS as f64), "every reclaim within 1 s by the agent's clock");
    // Each reclaim was measured from its process's exit event: the probes saw every exit
    // (whether the exit path, woken by a pidfd, or a sweep freed the slot).
    for &pid in &killed {
        let line = agent.reclaim_line(pid)?;
        ensure!(line.contains("from_exit_event=true"), "the reclaim of {pid} without its exit event: {line}");
    }
    assert_eq!(ledger_metrics(&all, &ledger), (Some(CTX + 100 * MIB), Some(LIMIT)));

    // More than a second later the live slot is still there (sweeps never take it).
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(slots(&ledger)?, vec![(live.pid(), live.pid())]);

    // A second corrupt file, added while the agent runs, is skipped too; the agent stays healthy.
    std::fs::create_dir_all(dir.0.join("broken-too"))?;
    let corrupt_too = dir.0.join("broken-too/ledger");
    std::fs::write(&corrupt_too, vec![0u8; 8192])?;
    wait_for(Duration::from_secs(3), "the second corrupt file is skipped", || {
        Ok(agent.log().contains(&corrupt_too.display().to_string()))
    })?;
    assert_eq!(single(&fresh_scrape(addr)?, "vramguard_ledgers_skipped")?, 2.0);
    assert_eq!(http::get(addr, "/healthz")?.0, 200);

    // A removed container directory is dropped.
    let live_pid = live.pid();
    drop(live);
    wait_for(Duration::from_secs(3), "the live holder's slot reclaimed once it is gone", || {
        Ok(!slots(&ledger)?.iter().any(|&(p, _)| p == live_pid))
    })?;
    std::fs::remove_dir_all(dir.0.join("pod-a"))?;
    wait_for(Duration::from_secs(3), "the removed ledger dropped", || {
        let all = scrape(addr)?;
        Ok(single(&all, "vramguard_ledgers")? == 0.0 && ledger_metrics(&all, &ledger) == (None, None))
    })?;
    assert_eq!(http::get(addr, "/healthz")?.0, 200);
    let log = agent.stop()?;
    ensure!(log.contains("no longer watched"), "{log}");
    Ok(())
}
