//! The exit path (issue 24, item 5): a killed process's slot is freed when its pidfd says it
//! exited, beside the reclaim task's periodic step, not behind it; and the periodic sweeps
//! judge the watched live processes without reading /proc. Counted, not timed: the periodic
//! step is held for seconds by the test-only fault `--fault delay:reclaim-scan:MS`, and the
//! reclaim must land while the step is still held (no sweep of every ledger completed in
//! between); the sweeps' reads of `/proc/<pid>` come from `vramguard_reclaim_proc_reads_total`,
//! the listings of the ledger directory from `vramguard_ledger_dir_listings_total`.
//! Beside each victim, a live holder whose slot must stay. Quiet ledgers are left unread by the
//! periodic sweeps, yet a dead process's slot written around the lock is still reclaimed.
//! Needs root; build first (`cargo build --workspace`), run one test at a time.
use std::{ffi::OsStr, path::{Path, PathBuf}, time::Duration};

use anyhow::{ensure, Result};
use e2e::{agent::Agent, holding, http, ledgers::slots, wait_for, FakeNode, Running, TempDir, GIB};

/// How long each periodic step is held by the fault.
const HELD: Duration = Duration::from_secs(4);

fn holder(node: &FakeNode, ledger: &Path) -> Result<Running> {
    holding(node.hooked(ledger, GIB)?, &["ctx 0", "alloc a 100m"])
}

fn metric(agent: &Agent, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
    Ok(http::metric(&http::fresh_scrape(agent.metrics_addr()?)?, name, labels).unwrap_or(0.0))
}

/// Waits until the agent recorded `pid`'s host pid in its slot of `ledger`.
fn recorded(ledger: &Path, pid: u32) -> Result<()> {
    wait_for(Duration::from_secs(15), "the agent records the holder's host pid", || Ok(slots(ledger)?.contains(&(pid, pid))))?;
    Ok(())
}

/// A fake node, an agent watching a ledger directory of its own, the ledger of a pod in it,
/// and two hooked holders in that ledger whose host pids the agent recorded.
struct TwoHolders {
    node: FakeNode,
    dir: TempDir,
    agent: Agent,
    ledger: PathBuf,
    first: Running,
    second: Running,
}

/// [`TwoHolders`], the agent started with `more` arguments.
fn two_holders(tag: &str, more: &[&OsStr]) -> Result<TwoHolders> {
    let node = FakeNode::new(tag);
    let dir = TempDir::new(tag)?;
    let agent = Agent::watching(dir.path(), more)?;
    std::fs::create_dir_all(dir.path().join("pod"))?;
    let ledger = dir.path().join("pod/ledger");
    let first = holder(&node, &ledger)?;
    let second = holder(&node, &ledger)?;
    recorded(&ledger, first.pid())?;
    recorded(&ledger, second.pid())?;
    Ok(TwoHolders { node, dir, agent, ledger, first, second })
}

#[test]
fn an_exit_during_a_held_periodic_step_is_reclaimed_without_waiting_for_it() -> Result<()> {
    let fault = format!("delay:reclaim-scan:{}", HELD.as_millis());
    let TwoHolders { node: _node, dir: _dir, agent, ledger, first: live, second: victim } =
        two_holders("exit-path-held", &[OsStr::new("--fault"), OsStr::new(&fault)])?;
    wait_for(Duration::from_secs(15), "both holders watched through pidfds", || Ok(metric(&agent, "vramguard_reclaim_watched", &[])? >= 2.0))?;

    // A periodic step begins (and is held for HELD): the sweeps of every ledger completed so
    // far are counted once it has.
    let delayed = |agent: &Agent| agent.log().matches("the periodic reclaim step is delayed").count();
    let before = delayed(&agent);
    wait_for(HELD * 3, "a periodic step held by the fault", || Ok(delayed(&agent) > before))?;
    let all_sweeps = metric(&agent, "vramguard_reclaim_sweeps_total", &[("sweep", "all")])?;

    let pid = victim.pid();
    victim.signal(libc::SIGKILL)?;
    wait_for(Duration::from_secs(1), "the killed holder's slot freed", || Ok(!slots(&ledger)?.iter().any(|&(p, _)| p == pid)))?;
    let after = metric(&agent, "vramguard_reclaim_sweeps_total", &[("sweep", "all")])?;
    ensure!(
        after == all_sweeps && delayed(&agent) == before + 1,
        "the slot was freed after a periodic step ended ({all_sweeps} sweeps of every ledger before the kill, {after} after): it waited for it"
    );
    let log = agent.log();
    let line = log
        .lines()
        .find(|line| line.contains("reclaimed the slot of a process that is gone") && line.contains(&format!("host_pid={pid}")));
    ensure!(
        line.is_some_and(|line| line.contains("exit path") && line.contains("from_exit_event=true")),
        "the reclaim of {pid} was the exit path's, measured from its exit event: {log}"
    );
    drop(victim); // reaped now

    // The live holder keeps its slot, through the held step and those after it.
    let sweeps = metric(&agent, "vramguard_reclaim_sweeps_total", &[("sweep", "all")])?;
    wait_for(HELD * 3, "a periodic step after the reclaim", || Ok(metric(&agent, "vramguard_reclaim_sweeps_total", &[("sweep", "all")])? > sweeps))?;
    ensure!(slots(&ledger)? == vec![(live.pid(), live.pid())], "the live holder's slot alone is left: {:?}", slots(&ledger)?);
    ensure!(!agent.log().contains("panicked"), "the agent panicked: {}", agent.log());
    agent.stop()?;
    Ok(())
}

#[test]
fn idle_sweeps_read_neither_proc_nor_the_directory_and_exits_still_free_slots() -> Result<()> {
    let node = FakeNode::new("exit-path-idle");
    let dir = TempDir::new("exit-path-idle")?;
    let agent = Agent::watching(dir.path(), &[])?;
    let mut holders = Vec::new();
    for pod in ["a", "b"] {
        std::fs::create_dir_all(dir.path().join(pod))?;
        let ledger = dir.path().join(pod).join("ledger");
        for _ in 0..2 {
            let running = holder(&node, &ledger)?;
            holders.push((ledger.clone(), running));
        }
    }
    for (ledger, running) in &holders {
        recorded(ledger, running.pid())?;
    }
    wait_for(Duration::from_secs(5), "every holder watched through a pidfd", || Ok(metric(&agent, "vramguard_reclaim_watched", &[])? >= 4.0))?;

    // Three sweeps of every ledger: not one read of /proc for the four live slots, and no
    // listing of the directory (nothing changed in it: inotify said nothing).
    let listings = |agent: &Agent| -> Result<f64> {
        Ok(http::samples(&http::fresh_scrape(agent.metrics_addr()?)?, "vramguard_ledger_dir_listings_total").map(|s| s.value).sum())
    };
    let reads = metric(&agent, "vramguard_reclaim_proc_reads_total", &[])?;
    let listed = listings(&agent)?;
    let sweeps = metric(&agent, "vramguard_reclaim_sweeps_total", &[("sweep", "all")])?;
    wait_for(Duration::from_secs(10), "three periodic sweeps", || Ok(metric(&agent, "vramguard_reclaim_sweeps_total", &[("sweep", "all")])? >= sweeps + 3.0))?;
    let more = metric(&agent, "vramguard_reclaim_proc_reads_total", &[])? - reads;
    ensure!(more == 0.0, "the idle sweeps read /proc {more} times for 4 watched processes");
    ensure!(listed > 0.0 && listings(&agent)? == listed, "the quiet directory was listed again ({listed} listings before)");

    // A new container's ledger is still found (inotify: its directory was made).
    std::fs::create_dir_all(dir.path().join("c"))?;
    let late = holder(&node, &dir.path().join("c/ledger"))?;
    recorded(&dir.path().join("c/ledger"), late.pid())?;

    // Still judged right: a killed holder's slot is freed by the exit path, the others stay.
    let (ledger, victim) = holders.remove(0);
    let pid = victim.pid();
    let exits = metric(&agent, "vramguard_reclaim_ledgers_read_total", &[("sweep", "exit")])?;
    victim.signal(libc::SIGKILL)?;
    wait_for(Duration::from_secs(1), "the killed holder's slot freed", || Ok(!slots(&ledger)?.iter().any(|&(p, _)| p == pid)))?;
    drop(victim);
    let read = metric(&agent, "vramguard_reclaim_ledgers_read_total", &[("sweep", "exit")])? - exits;
    ensure!(read == 1.0, "the exit read {read} ledgers, not its own one");
    std::thread::sleep(Duration::from_millis(1500));
    for (ledger, running) in &holders {
        ensure!(slots(ledger)?.contains(&(running.pid(), running.pid())), "live holder {} lost its slot", running.pid());
    }
    ensure!(metric(&agent, "vramguard_reclaim_watched", &[])? == 4.0, "the four live holders watched");
    drop(late);
    agent.stop()?;
    Ok(())
}

/// Quiet ledgers (every live slot's process watched through a pidfd) are left unread by the
/// periodic sweeps while their stamp (the mutation counter every locked operation moves, the
/// dirty flag, the slots' high-water mark) stays; a workload that writes a slot around the
/// lock leaves the stamp as it was, and still cannot hide a dead process's slot from reclaim:
/// every ledger is read again within `READ_ALL` (10 s) whatever its stamp says. A real
/// process (not hooked, no GPU memory: no exit event) is forged into a hole of the ledger
/// beside a live hooked holder, then killed; its slot must be freed, the holder's kept.
#[test]
fn a_dead_slot_written_around_the_lock_of_a_quiet_ledger_is_still_reclaimed() -> Result<()> {
    use e2e::ledgers::{forge_slot, slots_unlocked, stamp};
    const READ_ALL: Duration = Duration::from_secs(10);
    let TwoHolders { node: _node, dir: _dir, agent, ledger, first: live, second: gone } = two_holders("exit-path-forged", &[])?;
    // A hole below the slots' high-water mark: the second holder's slot, freed by the exit path.
    // (The reads with the lock, `slots`, move the stamp: the test uses them only before the
    // ledger turns quiet.)
    let hole = ledger::Ledger::open(&ledger)?.slots()?.into_iter().find(|view| view.slot.pid == gone.pid()).map(|view| view.id);
    let hole = hole.ok_or_else(|| anyhow::anyhow!("no slot of the second holder"))?;
    let pid = gone.pid();
    gone.signal(libc::SIGKILL)?;
    wait_for(Duration::from_secs(1), "the killed holder's slot freed", || Ok(!slots(&ledger)?.iter().any(|&(p, _)| p == pid)))?;
    drop(gone);

    // Quiet now: three periodic sweeps read the ledger at most once (a sweep of every ledger
    // comes every READ_ALL), where each read it before.
    let read = |agent: &Agent| metric(agent, "vramguard_reclaim_ledgers_read_total", &[("sweep", "all")]);
    let sweeps = |agent: &Agent| metric(agent, "vramguard_reclaim_sweeps_total", &[("sweep", "all")]);
    std::thread::sleep(Duration::from_millis(1500)); // the sweep after the reclaim read it
    let (reads_before, sweeps_before) = (read(&agent)?, sweeps(&agent)?);
    wait_for(Duration::from_secs(10), "three periodic sweeps", || Ok(sweeps(&agent)? >= sweeps_before + 3.0))?;
    let reads = read(&agent)? - reads_before;
    ensure!(reads <= 1.0, "a quiet ledger was read {reads} times in three periodic sweeps");

    // The tenant's forgery: a live slot of a real process, written around the lock.
    let mut victim = std::process::Command::new("sleep").arg("600").spawn()?;
    let process = ledger::ProcessIdentity {
        pid: victim.id(),
        pidns: ledger::ProcessIdentity::current()?.pidns,
        start_time: ledger::process::running_start_time_of(victim.id()).ok_or_else(|| anyhow::anyhow!("no start time"))?,
    };
    let before = stamp(&ledger)?;
    forge_slot(&ledger, hole, process)?;
    ensure!(stamp(&ledger)? == before, "the forgery moved the stamp");
    // (Read without the lock: a locked read is an operation, which moves the stamp.)
    ensure!(slots_unlocked(&ledger)?.contains(&(victim.id(), 0)), "the forged slot is live: {:?}", slots_unlocked(&ledger)?);
    victim.kill()?;
    victim.wait()?;
    let took = wait_for(READ_ALL + Duration::from_secs(5), "the forged slot of the dead process freed", || {
        Ok(!slots_unlocked(&ledger)?.iter().any(|&(p, _)| p == process.pid))
    })?;
    ensure!(slots(&ledger)? == vec![(live.pid(), live.pid())], "the live holder's slot alone is left: {:?}", slots(&ledger)?);
    eprintln!("the forged slot was freed {took:?} after its process died");
    ensure!(!agent.log().contains("panicked"), "the agent panicked: {}", agent.log());
    agent.stop()?;
    Ok(())
}
