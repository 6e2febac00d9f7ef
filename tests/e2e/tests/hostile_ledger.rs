//! The adversarial suite, ledger files (issue "Hostile tenants"; `docs/security.md`): a
//! workload can write any byte of its ledger at any moment, and cut, grow or replace it. Each
//! attack is a real process (the helper binary `hostile-attacker`, `src/bin/`) working on the
//! attacker container's ledger while the agent operates on it (a process of that container is
//! killed during the attack, so the agent has a slot to reclaim there), and each asserts that
//! the agent is still running and serving `/metrics`, that a killed process of *another*
//! container is reclaimed within a second, and that the attacker's ledger is reported in
//! `vramguard audit` (`ledger_problems`) with the reason. At every step, neither the agent nor
//! any of its workers but the one of that ledger maps a ledger file ([`assert_no_ledger_mapped`]).
//! The negative control runs the same set-up without the attack: nothing is reported and the
//! attacker's dead slot is reclaimed.
//! Needs root; run with `cargo xtask test`.
//!
//! Bounds latency: /healthz answers within 250 ms under attack.
use std::{
    fs::OpenOptions,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use e2e::{
    agent::Agent,
    holding,
    hostile::{assert_no_ledger_mapped, assert_serving, worker_pids, workers_mapping, Bystander},
    ledgers, wait_for, FakeNode, Running, TempDir, GIB, MIB,
};
use agent::ledgers::worker::WorkerLimits;
use ledger::{Ledger, ProcessIdentity};

/// An attacker process, killed and reaped when dropped (also when a test fails), and the
/// lines it prints.
struct Attacker(Child, std::sync::mpsc::Receiver<String>);

impl Attacker {
    /// Waits (up to 10 s) for the attacker to print the line `what`.
    fn said(&mut self, what: &str) -> Result<()> {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.1.recv_timeout(left) {
                Ok(line) if line == what => return Ok(()),
                Ok(_) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => bail!("the attacker did not say {what:?} within 10 s"),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => bail!("the attacker ended without saying {what:?}"),
            }
        }
    }

    /// Kills and reaps it now.
    fn kill(mut self) -> Result<()> {
        self.0.kill()?;
        self.0.wait()?;
        Ok(())
    }
}

impl Drop for Attacker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the attacker helper (`src/bin/hostile-attacker.rs`) as a process of `kind` on
/// `ledger`; what it prints is read with [`Attacker::said`].
fn attack(kind: &str, ledger: &Path) -> Result<Attacker> {
    let child = Command::new(env!("CARGO_BIN_EXE_hostile-attacker"))
        .arg(kind)
        .arg(ledger)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start the attacker")?;
    let mut child = child;
    let stdout = child.stdout.take().context("the attacker's output")?;
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = sender.send(line);
        }
    });
    Ok(Attacker(child, receiver))
}

/// An agent watching `dir` with a bystander container and the attacker's container (two
/// hooked processes on `attacker`'s ledger).
struct Scene {
    dir: TempDir,
    agent: Agent,
    bystander: Bystander,
    ledger: PathBuf,
    processes: Vec<Running>,
}

impl Scene {
    fn new(tag: &str) -> Result<Scene> {
        let node = FakeNode::new(tag).with_env("FAKECUDA_CONTEXT_BYTES", "64m");
        let dir = TempDir::new(tag)?;
        let agent = Agent::watching(&dir.0, &[])?;
        let bystander = Bystander::start(&node, &dir, &agent)?;
        let ledger = dir.ledger("attacker")?;
        let processes = vec![
            holding(node.hooked(&ledger, GIB)?, &["ctx 0", "alloc a 100m"])?,
            holding(node.hooked(&ledger, GIB)?, &["ctx 0", "alloc b 100m"])?,
        ];
        // The agent watches the attacker's ledger before the attack begins.
        wait_for(Duration::from_secs(5), "the agent records the attacker's host pids", || {
            Ok(ledgers::slots(&ledger).is_ok_and(|s| s.len() == 2 && s.iter().all(|(_, host)| *host != 0)))
        })?;
        Ok(Scene { dir, agent, bystander, ledger, processes })
    }

    /// What `vramguard audit` reports about the attacker's ledger, if anything.
    fn problem(&self) -> Result<Option<String>> {
        let audit = self.agent.audit()?;
        Ok(audit["ledger_problems"][self.ledger.display().to_string()].as_str().map(str::to_string))
    }

    /// Kills one of the attacker container's processes (the agent then has a slot to
    /// reclaim in the attacked ledger), checks the agent serves and reclaims the bystander's.
    fn while_attacked(&mut self) -> Result<()> {
        if let Some(victim) = self.processes.pop() {
            victim.kill()?;
        }
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            self.assert_unmapped()?;
            assert_serving(&self.agent)?;
            self.bystander.kill_and_expect_reclaim(&self.agent)?;
        }
        self.assert_unmapped()?;
        assert_serving(&self.agent)
    }

    /// Waits (3 s) until the audit reports the attacker's ledger with a problem that
    /// `matches` (`what` it should say, for the error), checking at each poll that no
    /// ledger is mapped; returns what it says.
    fn reported(&self, what: &str, matches: impl Fn(&str) -> bool) -> Result<String> {
        let mut found = None;
        wait_for(Duration::from_secs(3), what, || {
            self.assert_unmapped()?;
            found = self.problem()?;
            Ok(found.as_deref().is_some_and(&matches))
        })
        .with_context(|| format!("reported: {found:?}; agent log:\n{}", self.agent.log()))?;
        found.context("reported")
    }

    /// [`assert_no_ledger_mapped`] for every ledger under the agent's directory.
    fn assert_unmapped(&self) -> Result<()> {
        assert_no_ledger_mapped(&self.agent, self.dir.path())
    }
}

#[test]
fn negative_control_nothing_reported_and_the_dead_slot_reclaimed() -> Result<()> {
    let mut scene = Scene::new("hostile-control")?;
    let victim = scene.processes[1].pid();
    scene.while_attacked()?;
    wait_for(Duration::from_secs(2), "the attacker container's dead slot reclaimed", || {
        Ok(ledgers::slots(&scene.ledger)?.iter().all(|(pid, _)| *pid != victim))
    })?;
    assert_eq!(scene.problem()?, None);
    // The reclaims ran in confined workers, children of the agent, still running (idle ones
    // stop after 60 s): uid and gid nobody, no capabilities, no new privileges, seccomp.
    let workers = workers_of(scene.agent.pid())?;
    assert!(!workers.is_empty(), "no ledger worker under the agent");
    // Their resource limits, as the agent computes them for its binary and default ledger
    // geometry (`agent::ledgers::worker`, "Resource limits").
    let limits = WorkerLimits::for_program(&e2e::agent::agent_bin()?, agent::ledgers::Limits::default().max_bytes);
    for (status, table) in &workers {
        let row = |name: &str| -> Result<Vec<String>> {
            let line = table.lines().find(|l| l.starts_with(name)).with_context(|| format!("{name} in {table}"))?;
            Ok(line[name.len()..].split_whitespace().map(str::to_string).collect())
        };
        let bytes = limits.address_space.to_string();
        assert_eq!(row("Max address space")?[..3], [bytes.clone(), bytes, "bytes".into()], "{table}");
        let cpu = limits.cpu_seconds;
        assert_eq!(row("Max cpu time")?[..3], [cpu.to_string(), (cpu + 1).to_string(), "seconds".into()], "{table}");
        // The address space it uses fits its limit: its peak (VmPeak) is below it.
        let peak = status.lines().find_map(|l| l.strip_prefix("VmPeak:")).and_then(|v| v.trim().strip_suffix("kB"));
        let peak: u64 = peak.and_then(|v| v.trim().parse().ok()).with_context(|| format!("VmPeak in {status}"))?;
        eprintln!("worker VmPeak {peak} kB, RLIMIT_AS {} kB", limits.address_space >> 10);
        assert!(peak << 10 <= limits.address_space, "VmPeak {peak} kB over RLIMIT_AS {}", limits.address_space);
    }
    for (status, _) in workers {
        for (field, want) in [("Uid:", "65534"), ("Gid:", "65534"), ("CapEff:", "0000000000000000"), ("CapPrm:", "0000000000000000"), ("NoNewPrivs:", "1"), ("Seccomp:", "2")] {
            let line = status.lines().find(|l| l.starts_with(field)).with_context(|| format!("{field} in {status}"))?;
            assert!(line.split_whitespace().skip(1).all(|v| v == want), "worker {line} (want {want})");
        }
    }
    Ok(())
}

/// `/proc/<pid>/status` and `/proc/<pid>/limits` of every `vramguard ledger-worker` child of
/// process `agent`.
fn workers_of(agent: u32) -> Result<Vec<(String, String)>> {
    let mut found = Vec::new();
    for pid in worker_pids(agent) {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap_or_default();
        found.push((status, limits));
    }
    Ok(found)
}

#[test]
fn lock_words_and_dirty_flag_rewritten_continuously() -> Result<()> {
    let mut scene = Scene::new("hostile-lock")?;
    let attacker = attack("lock", &scene.ledger)?;
    scene.while_attacked()?;
    let problem = scene.reported("the attacker's ledger reported", |_| true)?;
    attacker.kill()?;
    assert!(
        problem.contains("lock stayed held") || problem.contains("worker") || problem.contains("mutation in progress"),
        "{problem}"
    );
    Ok(())
}

#[test]
fn random_bytes_over_the_whole_file() -> Result<()> {
    let mut scene = Scene::new("hostile-random")?;
    let attacker = attack("random", &scene.ledger)?;
    scene.while_attacked()?;
    // Random bytes land in the header within the attack (its first ~1.2 KB of a file of a few
    // MB, hundreds of thousands of writes a second): the reason is the rewritten header, which
    // comes before any other.
    scene.reported("the attacker's ledger reported with its header rewritten", |p| {
        p.starts_with("tampered: its header was rewritten (") && p.contains("checksum no longer matches")
    })?;
    attacker.kill()?;
    scene.assert_unmapped()?;
    Ok(())
}

#[test]
fn truncated_grown_and_replaced() -> Result<()> {
    let mut scene = Scene::new("hostile-size")?;
    let file = OpenOptions::new().write(true).open(&scene.ledger)?;
    let size = file.metadata()?.len();
    // Cut to nothing under the agent (and the attacker's own processes).
    file.set_len(0)?;
    scene.while_attacked()?;
    let problem = scene.reported("the attacker's ledger reported", |_| true)?;
    assert!(problem.contains("unreadable") && problem.contains("truncated or resized"), "{problem}");
    // Grown past its size (zeros where its header was, since the cut): a size the agent
    // cannot read, or a header that is not the one it validated.
    file.set_len(size * 2)?;
    scene.while_attacked()?;
    let problem = scene.reported("the attacker's ledger reported", |_| true)?;
    assert!(problem.contains("truncated or resized") || problem.contains("tampered: its header was rewritten"), "{problem}");
    // Replaced with a ledger of eight times the quota while its processes still run: held to
    // the limits before, reported tampered.
    std::fs::remove_file(&scene.ledger)?;
    ledgers::create(&scene.ledger, 64, 256, 8 * GIB, 64 * MIB)?;
    scene.while_attacked()?;
    wait_for(Duration::from_secs(3), "the replaced ledger reported tampered", || {
        Ok(scene.problem()?.is_some_and(|p| p.contains("tampered") && p.contains("limit")))
    })
    .with_context(|| format!("reported: {:?}", scene.problem()))?;
    drop(file);
    Ok(())
}

#[test]
fn a_ledger_past_the_agents_geometry_is_skipped() -> Result<()> {
    let mut scene = Scene::new("hostile-geometry")?;
    // Past the default --max-ledger-slots (4096): skipped with the reason.
    let oversized = scene.dir.ledger("oversized")?;
    ledgers::create(&oversized, 8192, 1024, GIB, 64 * MIB)?;
    scene.while_attacked()?;
    wait_for(Duration::from_secs(3), "the oversized ledger reported skipped", || {
        let audit = scene.agent.audit()?;
        Ok(audit["ledger_problems"][oversized.display().to_string()].as_str().is_some_and(|p| p.contains("skipped") && p.contains("8192 slots")))
    })?;
    assert_serving(&scene.agent)?;
    Ok(())
}

#[test]
fn the_largest_ledger_allowed_with_its_dirty_flag_held() -> Result<()> {
    let mut scene = Scene::new("hostile-largest")?;
    // The largest the agent allows by default, every slot naming a dead process (work for the
    // reclaimer, all of it under the lock), its dirty flag held raised (every locked operation
    // on it repairs the whole ledger first).
    let largest = scene.dir.ledger("largest")?;
    ledgers::create(&largest, 4096, 1 << 18, 64 * GIB, 64 * MIB)?;
    {
        let ledger = Ledger::open(&largest)?;
        let pidns = std::fs::metadata("/proc/self/ns/pid").map(|m| std::os::unix::fs::MetadataExt::ino(&m))?;
        for pid in 0..4096 {
            ledger.register(ProcessIdentity { pid: 4_000_000 + pid, pidns, start_time: 1 })?;
        }
    }
    let attacker = attack("dirty", &largest)?;
    scene.while_attacked()?;
    let mut problem = None;
    wait_for(Duration::from_secs(3), "the largest ledger reported", || {
        let audit = scene.agent.audit()?;
        problem = audit["ledger_problems"][largest.display().to_string()].as_str().map(str::to_string);
        Ok(problem.as_deref().is_some_and(|p| p.contains("unsettled") || p.contains("worker")))
    })?;
    // Its worker maps it within the worker's RLIMIT_AS, which leaves room for the largest
    // ledger the agent allows (a mapping refused for want of address space would be reported).
    let problem = problem.unwrap_or_default();
    assert!(!problem.contains("refused the ledger"), "{problem}");
    let limits = WorkerLimits::for_program(&e2e::agent::agent_bin()?, agent::ledgers::Limits::default().max_bytes);
    // A single look can find no worker mapping it (one between two: restarted after a
    // failure, or backed off), as it did once in CI on a busy machine: looked at until one is
    // seen mapping it, for at most 5 s.
    let mut workers = Vec::new();
    let _ = wait_for(Duration::from_secs(5), "the largest ledger's worker mapping it", || {
        workers = workers_mapping(scene.agent.pid(), &largest)?;
        Ok(workers.len() == 1)
    });
    assert_eq!(workers.len(), 1, "the largest ledger's worker, mapping it: {workers:?}; reported: {problem}");
    let status = std::fs::read_to_string(format!("/proc/{}/status", workers[0]))?;
    let peak = status.lines().find_map(|l| l.strip_prefix("VmPeak:")).and_then(|v| v.trim().strip_suffix("kB"));
    let peak: u64 = peak.and_then(|v| v.trim().parse().ok()).with_context(|| format!("VmPeak in {status}"))?;
    eprintln!("the largest ledger's worker: VmPeak {peak} kB, RLIMIT_AS {} kB", limits.address_space >> 10);
    assert!(peak << 10 <= limits.address_space);
    attacker.kill()?;
    Ok(())
}

/// The worker's SIGBUS path (`agent/src/ledgers/worker.rs`): a process of the attacker's
/// container holds the ledger's lock; one of its processes dies, so the agent copies the
/// ledger (whole at that moment), finds the dead slot and asks the ledger's worker to free
/// it; the worker, the ledger mapped, waits for the lock; the attacker sees it wait (the lock
/// word's waiters bit), cuts the file after its state page and lets go: the worker takes the
/// lock and touches pages that are no longer there. It dies of SIGBUS, the agent reports
/// that (audit and log) and carries on (serves, reclaims for the bystander, maps nothing).
#[test]
fn cut_while_the_worker_waits_for_the_lock_kills_it_with_sigbus() -> Result<()> {
    let mut scene = Scene::new("hostile-sigbus")?;
    let mut attacker = attack("cut", &scene.ledger)?;
    attacker.said("holding")?;
    scene.while_attacked()?;
    attacker.said("done")?;
    scene.reported("the worker's death by SIGBUS reported", |p| {
        p.contains("worker failing: ") && p.contains("it died of signal 7 (SIGBUS: the file was cut under its mapping)")
    })?;
    let log = scene.agent.log();
    assert!(log.contains("it died of signal 7 (SIGBUS"), "not in the agent's log:\n{log}");
    // The agent carries on (the attacker's last process is killed too: nothing more to do
    // on a cut ledger).
    scene.while_attacked()?;
    Ok(())
}

/// The control of the SIGBUS test: the same lock held and let go when the worker waits,
/// without the cut: the worker carries on and frees the dead slot; nothing is reported.
#[test]
fn negative_control_the_lock_let_go_without_a_cut() -> Result<()> {
    let mut scene = Scene::new("hostile-held")?;
    let victim = scene.processes[1].pid();
    let mut attacker = attack("hold", &scene.ledger)?;
    attacker.said("holding")?;
    scene.while_attacked()?;
    attacker.said("done")?;
    wait_for(Duration::from_secs(2), "the attacker container's dead slot reclaimed", || {
        Ok(ledgers::slots(&scene.ledger)?.iter().all(|(pid, _)| *pid != victim))
    })?;
    assert_eq!(scene.problem()?, None);
    assert!(!scene.agent.log().contains("SIGBUS"));
    scene.assert_unmapped()?;
    Ok(())
}



/// Workers confine themselves or the agent does not start with `--ledger-dir`: without
/// CAP_SETUID and CAP_SETGID (dropped from the bounding set with `setpriv`) it says why.
#[test]
fn the_agent_refuses_ledgers_where_workers_cannot_confine_themselves() -> Result<()> {
    let dir = TempDir::new("no-setuid")?;
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let socket = dir.path().join("agent.sock");
    let mut setpriv = Command::new("setpriv");
    setpriv.args(["--bounding-set", "-setuid,-setgid", "--"]).arg(e2e::agent::agent_bin()?);
    setpriv.arg("run").arg("--no-discover").arg("--libcuda").arg(&libcuda).arg("--socket").arg(&socket).arg("--ledger-dir").arg(dir.path());
    let log = dir.path().join("refused.log");
    let mut child = setpriv.stdout(Stdio::null()).stderr(std::fs::File::create(&log)?).spawn()?;
    let mut status = None;
    let waited = wait_for(Duration::from_secs(20), "the agent without CAP_SETUID/CAP_SETGID exits", || {
        status = child.try_wait()?;
        Ok(status.is_some())
    });
    if waited.is_err() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stderr = std::fs::read_to_string(&log)?;
    waited.with_context(|| format!("it kept running: {stderr}"))?;
    assert!(status.is_some_and(|s| !s.success()), "started without CAP_SETUID/CAP_SETGID: {stderr}");
    assert!(stderr.contains("CAP_SETUID") && stderr.contains("cannot start confined"), "{stderr}");
    // The control: the same agent with every capability starts, answers, and stops cleanly.
    Agent::watching(dir.path(), &[])?.stop()?;
    Ok(())
}
