//! A workload that stops inside its ledger's lock does not stop the agent (never hang on a
//! lock a workload controls): the agent reads ledgers from copies without the lock, its
//! worker for that ledger waits at most 50 ms for the lock and says so, and the agent goes on
//! serving the other containers: `vramguard audit` and `/metrics` answer, a killed process of
//! another container has its slot reclaimed within a second, and the dead process of the
//! wedged container is reclaimed once the lock is released.
//! Needs root; run with `cargo xtask test`.
use std::time::Duration;

use anyhow::Result;
use e2e::{agent::Agent, holding, http, ledgers, wait_for, FakeNode, TempDir, GIB};
use ledger::Ledger;

#[test]
fn a_ledger_locked_for_good_does_not_stop_the_agent() -> Result<()> {
    let node = FakeNode::new("wedged").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let dir = TempDir::new("wedged")?;
    let (wedged, healthy) = (dir.ledger("pod-w")?, dir.ledger("pod-h")?);
    let agent = Agent::watching(&dir.0, &[])?;
    let addr = agent.metrics_addr()?;
    let stuck = holding(node.hooked(&wedged, GIB)?, &["ctx 0", "alloc w 100m"])?;
    let keeper = holding(node.hooked(&healthy, GIB)?, &["ctx 0", "alloc k 100m"])?;
    let victim = holding(node.hooked(&healthy, GIB)?, &["ctx 0", "alloc v 100m"])?;
    wait_for(Duration::from_secs(5), "the agent records every slot's host pid", || {
        Ok([&wedged, &healthy].iter().all(|l| ledgers::slots(l).is_ok_and(|s| s.iter().all(|(_, host)| *host != 0))))
    })?;

    // The lock of pod-w held for 6 s, as by a process stopped inside it; a process of pod-w
    // dies meanwhile, so the agent has something to do under that lock.
    let holder_path = wedged.clone();
    let holder = std::thread::spawn(move || -> Result<()> {
        Ledger::open(&holder_path)?.hold_lock_for(Duration::from_secs(6))?;
        Ok(())
    });
    std::thread::sleep(Duration::from_millis(100));
    let stuck_pid = stuck.pid();
    stuck.kill()?;
    wait_for(Duration::from_secs(5), "the agent's worker gives up on the held lock", || {
        Ok(agent.log().contains("its lock stayed held for 50ms"))
    })?;

    // The agent still reads every ledger (copies need no lock), answers, and reclaims in the
    // other container.
    let audit = agent.audit()?;
    assert!(audit["processes"].as_array().is_some_and(|rows| !rows.is_empty()), "{audit}");
    let all = http::fresh_scrape(addr)?;
    assert_eq!(http::metric(&all, "vramguard_ledgers_unreadable", &[]), Some(0.0), "a held lock does not stop reading");
    let victim_pid = victim.pid();
    victim.kill()?;
    let latency = wait_for(Duration::from_secs(1), "the killed process's slot reclaimed beside the held lock", || {
        Ok(ledgers::slots(&healthy)?.iter().all(|(pid, _)| *pid != victim_pid))
    })?;
    eprintln!("reclaimed {latency:?} after the kill while another ledger's lock was held");

    holder.join().map_err(|_| anyhow::anyhow!("the lock holder panicked"))??;
    // Released: the dead process of pod-w is reclaimed too.
    wait_for(Duration::from_secs(5), "the wedged container's dead slot reclaimed once the lock is free", || {
        Ok(ledgers::slots(&wedged)?.iter().all(|(pid, _)| *pid != stuck_pid))
    })?;
    drop(keeper);
    agent.stop()?;
    Ok(())
}
