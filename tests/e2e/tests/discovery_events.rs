//! Discovery told by the kernel (issue "The agent never takes the node down with it", item 5:
//! the agent idle at its floor): the agent reads the maps of the processes whose exec, `mmap`
//! or `mprotect` made something executable, and every process's only on its slow rescan
//! (`--full-rescan-ms`). Shown with real processes and real eBPF, counted from the agent's own
//! account (its debug line for each maps file it reads, and its metrics), never timed: an idle
//! process is not read again; a library mapped under a new name after the agent started is
//! found by its event; one whose events the agent does not hear (the `deaf` fault, as if they
//! were missed) is found by the rescan, and counted. Needs root; run with `cargo xtask test`.
//!
//! Runs alone: its agents discover libcuda on the whole node (they would probe the other test binaries' fake drivers).
use std::{
    ffi::OsStr,
    os::unix::fs::MetadataExt,
    path::Path,
    time::Duration,
};

use anyhow::{Context, Result};
use e2e::{
    agent::Agent,
    http::{fresh_scrape, metric},
    wait_for, FakeNode, Running, TempDir,
};

type FileId = (u64, u64);

fn id_of(path: &Path) -> Result<FileId> {
    let metadata = std::fs::metadata(path).with_context(|| format!("stat {}", path.display()))?;
    Ok((metadata.dev(), metadata.ino()))
}

/// An agent probing the fake driver and discovering every 100 ms, reading every process's
/// maps every `full_rescan_ms`, logging each maps file it reads; `extra` arguments after.
fn agent(ledgers: &TempDir, full_rescan_ms: &str, extra: &[&str]) -> Result<Agent> {
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let mut args: Vec<&OsStr> = e2e::agent::watching_args(&libcuda, ledgers.path());
    args.extend(["--rescan-ms", "100", "--full-rescan-ms", full_rescan_ms].map(OsStr::new));
    args.extend(extra.iter().map(OsStr::new));
    Agent::start_with_env(&args, &[("VRAMGUARD_LOG".into(), "info,agent::discovery=debug".into())])
}

/// Whether the agent has probes on `id`.
fn probed(agent: &Agent, id: FileId) -> Result<bool> {
    let audit = agent.audit()?;
    let files = audit["libcuda"].as_array().context("no libcuda list in the audit")?;
    Ok(files.iter().any(|f| f["dev"].as_u64() == Some(id.0) && f["ino"].as_u64() == Some(id.1)))
}

/// The agent's lines saying it read process `pid`'s maps, in `log`, for `reason` (any if `None`).
fn reads_of(log: &str, pid: u32, reason: Option<&str>) -> usize {
    let pid = format!("pid={pid} ");
    log.lines()
        .filter(|line| line.contains("reading a process's maps") && line.contains(&pid))
        .filter(|line| reason.is_none_or(|reason| line.contains(&format!("reason=\"{reason}\""))))
        .count()
}

/// A workload that maps `library` executable (as `dlopen` would) once resumed past its first
/// checkpoint, then holds.
fn mapper(node: &FakeNode, library: &Path) -> Result<Running> {
    let mut running = node
        .workload()
        .steps(["checkpoint started".to_string(), format!("map {}", library.display()), "checkpoint mapped".into(), "hold".into()])
        .spawn()?;
    running.wait_checkpoint("started")?;
    Ok(running)
}

/// A renamed copy of the fake driver (a libcuda by its exports, named like nothing CUDA).
fn renamed_copy(dir: &TempDir, name: &str) -> Result<std::path::PathBuf> {
    let copy = dir.path().join(name);
    std::fs::copy(e2e::fake_driver_lib()?, &copy)?;
    Ok(copy)
}

#[test]
fn an_idle_process_is_not_read_again_and_a_library_mapped_later_is_found_by_its_event() -> Result<()> {
    let ledgers = TempDir::new("de-event-ledgers")?;
    let files = TempDir::new("de-event-files")?;
    let library = renamed_copy(&files, "libquiet.so")?;
    let id = id_of(&library)?;
    // No rescan while the test runs: whatever is found, the kernel's word found.
    let agent = agent(&ledgers, "3600000", &[])?;
    let node = FakeNode::new("de-event");
    let mut holder = node.workload().steps(["ctx 0", "alloc a 10m", "checkpoint held", "hold"]).spawn()?;
    holder.wait_checkpoint("held")?;
    let mut mapper = mapper(&node, &library)?;
    // The reads their starts caused (an exec, the loader's mappings), and the reads again at
    // the scan after, are done within two scans (100 ms each).
    std::thread::sleep(Duration::from_secs(1));
    let settled = agent.log().len();
    // 20 scans of a node where these two do nothing.
    std::thread::sleep(Duration::from_secs(2));
    let quiet = agent.log()[settled..].to_string();
    for (what, pid) in [("the holder", holder.pid()), ("the mapper", mapper.pid())] {
        assert_eq!(reads_of(&quiet, pid, None), 0, "{what} (pid {pid}) did nothing, yet its maps were read:\n{quiet}");
    }
    assert!(!probed(&agent, id)?, "the copy is probed before any process maps it");

    mapper.resume()?;
    mapper.wait_checkpoint("mapped")?;
    wait_for(Duration::from_secs(5), "the renamed copy probed", || probed(&agent, id)).with_context(|| agent.log())?;
    let log = agent.log();
    assert!(reads_of(&log[settled..], mapper.pid(), Some("event")) >= 1, "the mapper's maps read for its event:\n{log}");
    let page = fresh_scrape(agent.metrics_addr()?)?;
    assert_eq!(metric(&page, "vramguard_discovery_rescans_total", &[]), Some(0.0), "no rescan ran: the event found it");
    assert!(metric(&page, "vramguard_discovery_maps_read_total", &[("reason", "event")]).is_some_and(|reads| reads >= 1.0));
    Ok(())
}

#[test]
fn a_library_whose_events_are_missed_is_found_by_the_rescan_and_counted() -> Result<()> {
    let ledgers = TempDir::new("de-rescan-ledgers")?;
    let files = TempDir::new("de-rescan-files")?;
    let library = renamed_copy(&files, "libunheard.so")?;
    let id = id_of(&library)?;
    // Every event of a fake workload unheard (`/proc/<pid>/comm` is the name's first 15 bytes).
    let agent = agent(&ledgers, "2000", &["--fault", "deaf:fakecuda-worklo"])?;
    let node = FakeNode::new("de-rescan");
    let mut mapper = mapper(&node, &library)?;
    mapper.resume()?;
    mapper.wait_checkpoint("mapped")?;
    // Within the rescan's period (2 s) and a margin for a loaded machine.
    wait_for(Duration::from_secs(10), "the unheard copy probed by the rescan", || probed(&agent, id)).with_context(|| agent.log())?;
    let log = agent.log();
    let pid = mapper.pid();
    assert_eq!(reads_of(&log, pid, Some("event")), 0, "the fault lets no event through:\n{log}");
    assert!(reads_of(&log, pid, Some("rescan")) >= 1, "the rescan read the mapper:\n{log}");
    let found = log.lines().find(|line| line.contains("a libcuda found by the rescan") && line.contains(&format!("ino={}", id.1)));
    assert!(found.is_some(), "the find is logged as the rescan's:\n{log}");
    let page = fresh_scrape(agent.metrics_addr()?)?;
    assert!(metric(&page, "vramguard_discovery_found_by_rescan_total", &[]).is_some_and(|found| found >= 1.0), "counted");
    assert!(metric(&page, "vramguard_discovery_rescans_total", &[]).is_some_and(|rescans| rescans >= 1.0));
    Ok(())
}

/// A library mapped by a process whose main thread exited alone (its leader a zombie: the
/// kernel let go of the leader's address space, so `/proc/<pid>/maps` and `map_files` show
/// nothing) is found by its event: the agent reads another of the process's threads'. Before,
/// such a process could load a renamed libcuda that no probe would ever be on.
#[test]
fn a_library_mapped_after_the_main_thread_exited_is_found() -> Result<()> {
    let ledgers = TempDir::new("de-leader-ledgers")?;
    let files = TempDir::new("de-leader-files")?;
    let library = renamed_copy(&files, "libafter.so")?;
    let id = id_of(&library)?;
    // No rescan while the test runs: whatever is found, the kernel's word found.
    let agent = agent(&ledgers, "3600000", &[])?;
    let node = FakeNode::new("de-leader");
    let mut mapper = node.workload().steps([format!("leader-exit {}", library.display())]).spawn()?;
    mapper.expect_prefix("leader-exit")?;
    mapper.expect_prefix("map ").with_context(|| mapper.stderr())?;
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", mapper.pid()))?;
    assert!(maps.is_empty(), "the leader's maps are empty once it exited: {maps}");
    wait_for(Duration::from_secs(5), "the renamed copy probed", || probed(&agent, id)).with_context(|| agent.log())?;
    mapper.kill()?;
    Ok(())
}
