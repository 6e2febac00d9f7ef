//! The adversarial suite, ledger files (issue "Hostile tenants"; `../shared/security.md`): a
//! workload can write any byte of its ledger at any moment, and cut, grow or replace it. Each
//! attack is a real process (this test binary run again as [`attacker`]) working on the
//! attacker container's ledger while the agent operates on it (a process of that container is
//! killed during the attack, so the agent has a slot to reclaim there), and each asserts that
//! the agent is still running and serving `/metrics`, that a killed process of *another*
//! container is reclaimed within a second, and that the attacker's ledger is reported in
//! `vramguard audit` (`ledger_problems`) with the reason. The negative control runs the same
//! set-up without the attack: nothing is reported and the attacker's dead slot is reclaimed.
//! Needs root; run with `cargo xtask test`.
use std::{
    fs::OpenOptions,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use e2e::{
    agent::Agent,
    holding,
    hostile::{assert_serving, Bystander},
    ledgers, wait_for, FakeNode, Running, TempDir, GIB, MIB,
};
use ledger::{Ledger, ProcessIdentity};

/// What an attacker process does, from `VRAMGUARD_ATTACK=<kind>` and `VRAMGUARD_ATTACK_FILE`.
const KIND: &str = "VRAMGUARD_ATTACK";
const FILE: &str = "VRAMGUARD_ATTACK_FILE";

/// Not a test: the attacker's body when this binary is started with [`KIND`] set (a no-op
/// otherwise). Writes through `pwrite` for ever (until killed):
/// - `lock`: the lock's owner word and robust-list pointers, and the `dirty` flag;
/// - `random`: random bytes at random offsets over the whole file, header included;
#[test]
fn attacker() -> Result<()> {
    let (Ok(kind), Some(path)) = (std::env::var(KIND), std::env::var_os(FILE)) else { return Ok(()) };
    // Never outlives the test thread that started it, nor two minutes.
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(120);
    let file = OpenOptions::new().read(true).write(true).open(&path)?;
    let size = file.metadata()?.len();
    let state = ledger::layout::PAGE;
    let dirty = state + std::mem::offset_of!(ledger::layout::State, dirty) as u64;
    let mut seed = u64::from(std::process::id()) | 1;
    let mut next = move || {
        // xorshift64
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    while Instant::now() < deadline {
        match kind.as_str() {
            "lock" => {
                // glibc's x86-64 pthread_mutex_t: owner tid at 8, robust list prev/next at 24/32.
                let _ = file.write_all_at(&(next() as u32).to_ne_bytes(), state + 8);
                let _ = file.write_all_at(&0x4141_4141_4141_4141u64.to_ne_bytes(), state + 24);
                let _ = file.write_all_at(&next().to_ne_bytes(), state + 32);
                let _ = file.write_all_at(&1u32.to_ne_bytes(), dirty);
            }
            "random" => {
                let offset = next() % size;
                let _ = file.write_all_at(&next().to_ne_bytes()[..(1 + next() % 8) as usize], offset);
            }
            "dirty" => {
                let _ = file.write_all_at(&1u32.to_ne_bytes(), dirty);
            }
            other => bail!("unknown attack {other}"),
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// An attacker process, killed and reaped when dropped (also when a test fails).
struct Attacker(Child);

impl Attacker {
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

/// Starts this binary as an attacker process of `kind` on `ledger`.
fn attack(kind: &str, ledger: &Path) -> Result<Attacker> {
    let child = Command::new(std::env::current_exe()?)
        .args(["--exact", "attacker", "--nocapture", "--test-threads=1"])
        .env(KIND, kind)
        .env(FILE, ledger)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start the attacker")?;
    Ok(Attacker(child))
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
            assert_serving(&self.agent)?;
            self.bystander.kill_and_expect_reclaim(&self.agent)?;
        }
        assert_serving(&self.agent)
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
    for status in workers {
        for (field, want) in [("Uid:", "65534"), ("Gid:", "65534"), ("CapEff:", "0000000000000000"), ("CapPrm:", "0000000000000000"), ("NoNewPrivs:", "1"), ("Seccomp:", "2")] {
            let line = status.lines().find(|l| l.starts_with(field)).with_context(|| format!("{field} in {status}"))?;
            assert!(line.split_whitespace().skip(1).all(|v| v == want), "worker {line} (want {want})");
        }
    }
    Ok(())
}

/// `/proc/<pid>/status` of every `vramguard ledger-worker` child of process `agent`.
fn workers_of(agent: u32) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !cmdline.split(|b| *b == 0).any(|arg| arg == b"ledger-worker") {
            continue;
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        if status.lines().any(|l| l.starts_with("PPid:") && l.split_whitespace().nth(1) == Some(&agent.to_string())) {
            found.push(status);
        }
    }
    Ok(found)
}

#[test]
fn lock_words_and_dirty_flag_rewritten_continuously() -> Result<()> {
    let mut scene = Scene::new("hostile-lock")?;
    let attacker = attack("lock", &scene.ledger)?;
    scene.while_attacked()?;
    let problem = wait_for_problem(&scene)?;
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
    let problem = wait_for_problem(&scene)?;
    attacker.kill()?;
    eprintln!("reported: {problem}");
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
    let problem = wait_for_problem(&scene)?;
    assert!(problem.contains("unreadable") && problem.contains("truncated or resized"), "{problem}");
    // Grown past its size (zeros where its header was, since the cut): a size the agent
    // cannot read, or a header that is not the one it validated.
    file.set_len(size * 2)?;
    scene.while_attacked()?;
    let problem = wait_for_problem(&scene)?;
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
    wait_for(Duration::from_secs(3), "the largest ledger reported", || {
        let audit = scene.agent.audit()?;
        Ok(audit["ledger_problems"][largest.display().to_string()].as_str().is_some_and(|p| p.contains("unsettled") || p.contains("worker")))
    })?;
    attacker.kill()?;
    Ok(())
}

/// Waits until the audit reports the attacker's ledger; returns what it says.
fn wait_for_problem(scene: &Scene) -> Result<String> {
    let mut found = None;
    wait_for(Duration::from_secs(3), "the attacker's ledger reported", || {
        found = scene.problem()?;
        Ok(found.is_some())
    })
    .with_context(|| format!("agent log:\n{}", scene.agent.log()))?;
    found.context("reported")
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
