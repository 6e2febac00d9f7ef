//! What every attack test of the adversarial suite (`tests/hostile_*.rs`) checks while its
//! attack runs (`docs/security.md`, "How the rules are tested"): the agent is still alive and still
//! serving `/metrics` ([`assert_serving`]), it still reclaims the slot of a SIGKILLed
//! process of *another* container within a second ([`Bystander`]), `/healthz` answers in
//! time throughout ([`HealthProbe`]), and it never maps a ledger file, nor does any of its
//! workers but the one ledger it works on ([`assert_no_ledger_mapped`]). [`HostileLedgers`] is
//! the many-tenants attack (issue 17): ledgers whose locks are held and that are owed reclaims
//! and charges.
use std::{
    collections::BTreeSet,
    os::unix::fs::{FileExt, MetadataExt},
    path::{Path, PathBuf},
    sync::{Arc, Barrier},
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{bail, Context, Result};
use ledger::{Ledger, ProcessIdentity};

use crate::{agent::Agent, holding, http, ledgers, wait_for, FakeNode, Running, TempDir, GIB, MIB};

/// How soon the slot of a killed bystander process must be free.
pub const RECLAIM_WITHIN: Duration = Duration::from_secs(1);

/// Another container beside the attacker's: hooked fake-driver workloads holding memory in
/// a ledger of their own under the agent's `--ledger-dir`. Each
/// [`Bystander::kill_and_expect_reclaim`] kills one of them; a new one is started first, so
/// the container keeps a live process and the agent keeps working on its ledger.
pub struct Bystander {
    node: FakeNode,
    ledger: PathBuf,
    processes: Vec<Running>,
}

impl Bystander {
    /// Two processes of a container named `bystander` under `dir`, 100 MiB each under a 1 GiB
    /// quota, on a fake machine of their own (not the attacker's `_node`, which the attack may
    /// fill or damage on purpose); returns once the agent has recorded the host
    /// pid of each of their slots (it has seen them).
    pub fn start(_node: &FakeNode, dir: &TempDir, agent: &Agent) -> Result<Bystander> {
        let node = FakeNode::new("bystander").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
        let ledger = dir.ledger("bystander")?;
        let mut bystander = Bystander { node, ledger, processes: Vec::new() };
        bystander.spawn()?;
        bystander.spawn()?;
        bystander.wait_recorded(agent)?;
        Ok(bystander)
    }

    /// The bystander's ledger file.
    pub fn ledger(&self) -> &std::path::Path {
        &self.ledger
    }

    fn spawn(&mut self) -> Result<()> {
        let index = self.processes.len();
        let running = holding(self.node.hooked(&self.ledger, GIB)?, &["ctx 0", &format!("alloc b{index} 100m")])?;
        self.processes.push(running);
        Ok(())
    }

    fn wait_recorded(&self, agent: &Agent) -> Result<()> {
        let ledger = self.ledger.clone();
        wait_for(Duration::from_secs(5), "the agent records the bystander's host pids", || {
            if !agent_alive(agent) {
                bail!("the agent died: {}", agent.log());
            }
            Ok(ledgers::slots(&ledger).is_ok_and(|s| !s.is_empty() && s.iter().all(|(_, host)| *host != 0)))
        })?;
        Ok(())
    }

    /// Starts a fresh process of the container, then SIGKILLs the oldest and fails unless its
    /// slot is freed within [`RECLAIM_WITHIN`]; returns the killed process's pid.
    pub fn kill_and_expect_reclaim(&mut self, agent: &Agent) -> Result<u32> {
        self.spawn()?;
        self.wait_recorded(agent)?;
        let victim = self.processes.remove(0);
        let pid = victim.pid();
        victim.kill()?;
        let ledger = self.ledger.clone();
        let took = wait_for(RECLAIM_WITHIN, "a killed bystander process's slot reclaimed by the agent", || {
            Ok(ledgers::slots(&ledger)?.iter().all(|(slot_pid, _)| *slot_pid != pid))
        })
        .with_context(|| format!("agent log:\n{}", agent.log()))?;
        eprintln!("bystander process {pid} reclaimed {took:?} after its kill");
        Ok(pid)
    }
}

fn agent_alive(agent: &Agent) -> bool {
    // kill(pid, 0): the process exists (a zombie is not reaped until the Agent is dropped,
    // so also check its state).
    let status = std::fs::read_to_string(format!("/proc/{}/stat", agent.pid())).unwrap_or_default();
    let state = status.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
    matches!(state, Some(s) if s != "Z" && s != "X")
}

/// The agent process is alive (not a zombie) and `/metrics` answers 200 with metrics.
pub fn assert_serving(agent: &Agent) -> Result<()> {
    if !agent_alive(agent) {
        bail!("the agent is not running any more; its log:\n{}", agent.log());
    }
    let addr = agent.metrics_addr()?;
    let (status, body) = http::get(addr, "/metrics").with_context(|| format!("scraping {addr}; agent log:\n{}", agent.log()))?;
    if status != 200 || !body.contains("vramguard_") {
        bail!("/metrics answered {status}: {body:.200}");
    }
    Ok(())
}

/// How fast `/healthz` must answer while an attack runs (issue 17).
pub const HEALTH_WITHIN: Duration = Duration::from_millis(250);

/// `/healthz` asked every `every` on a thread of its own while an attack runs; each answer's
/// status and latency kept.
pub struct HealthProbe {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(Duration, Result<u16, String>)>>,
}

impl HealthProbe {
    pub fn start(addr: std::net::SocketAddr, every: Duration) -> HealthProbe {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut answers = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                let start = std::time::Instant::now();
                let answer = http::get(addr, "/healthz").map(|(status, _)| status).map_err(|e| format!("{e:#}"));
                answers.push((start.elapsed(), answer));
                std::thread::sleep(every.saturating_sub(start.elapsed()));
            }
            answers
        });
        HealthProbe { stop, thread }
    }

    /// Stops probing; returns every probe's latency and answer (its status, or why none
    /// came), in the order they were made.
    pub fn answers(self) -> Result<Vec<(Duration, Result<u16, String>)>> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().map_err(|_| anyhow::anyhow!("the health prober panicked"))
    }

    /// Stops probing; fails unless every answer was `200` within [`HEALTH_WITHIN`] (and there
    /// were some); returns how many there were.
    pub fn finish(self) -> Result<usize> {
        let answers = self.answers()?;
        let slowest = answers.iter().map(|(took, _)| *took).max().context("no /healthz probe ran")?;
        let bad: Vec<_> = answers.iter().filter(|(took, answer)| *took > HEALTH_WITHIN || !matches!(answer, Ok(200))).collect();
        eprintln!("/healthz: {} probes, slowest {slowest:?}, {} late or failed", answers.len(), bad.len());
        if !bad.is_empty() {
            bail!("/healthz late (over {HEALTH_WITHIN:?}) or failing: {bad:?}");
        }
        Ok(answers.len())
    }
}

/// The pids of the `vramguard ledger-worker` children of process `agent`.
pub fn worker_pids(agent: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !cmdline.split(|b| *b == 0).any(|arg| arg == b"ledger-worker") {
            continue;
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        if status.lines().any(|l| l.starts_with("PPid:") && l.split_whitespace().nth(1) == Some(&agent.to_string())) {
            found.push(pid);
        }
    }
    found
}

/// The rule "the agent never maps a ledger" (`docs/security.md`, rule 1), read from the
/// kernel: no file under `dir` (the agent's `--ledger-dir`: every ledger of the test, those
/// removed or replaced since included) is in `/proc/<agent>/maps`, and each of the agent's
/// ledger workers maps at most one (the ledger it works on, as designed).
pub fn assert_no_ledger_mapped(agent: &Agent, dir: &Path) -> Result<()> {
    let dir = dir.canonicalize().with_context(|| format!("cannot resolve {}", dir.display()))?;
    let mut files = BTreeSet::new();
    regular_files(&dir, 3, &mut files);
    let mapped = ledgers_mapped(agent.pid(), &dir, &files);
    if !mapped.is_empty() {
        bail!("the agent (pid {}) maps ledger files: {mapped:?}", agent.pid());
    }
    for worker in worker_pids(agent.pid()) {
        let mapped = ledgers_mapped(worker, &dir, &files);
        if mapped.len() > 1 {
            bail!("ledger worker {worker} maps more than its one ledger: {mapped:?}");
        }
    }
    Ok(())
}

/// The ledger workers of process `agent` that map the file `ledger` (its own worker, while
/// it runs).
pub fn workers_mapping(agent: u32, ledger: &Path) -> Result<Vec<u32>> {
    let metadata = ledger.metadata().with_context(|| format!("cannot stat {}", ledger.display()))?;
    let file = BTreeSet::from([(dev_of_maps(metadata.dev()), metadata.ino())]);
    // A path no mapping has: only the file's identity counts.
    let nowhere = Path::new("/nonexistent-vramguard-dir");
    Ok(worker_pids(agent).into_iter().filter(|pid| !ledgers_mapped(*pid, nowhere, &file).is_empty()).collect())
}

/// (device, inode) of the regular files under `dir`, `depth` levels down.
fn regular_files(dir: &Path, depth: u32, found: &mut BTreeSet<(u64, u64)>) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(metadata) = entry.path().symlink_metadata() else { continue };
        if metadata.is_file() {
            found.insert((dev_of_maps(metadata.dev()), metadata.ino()));
        } else if metadata.is_dir() && depth > 1 {
            regular_files(&entry.path(), depth - 1, found);
        }
    }
}

/// A `st_dev` as `/proc/<pid>/maps` writes it: major and minor in one number, `major << 32 | minor`.
fn dev_of_maps(dev: u64) -> u64 {
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    major << 32 | minor
}

/// The distinct files of `files` (or named under `dir`: removed ones) that process `pid`
/// maps, as `/proc/<pid>/maps` names them (nothing for a process that is gone).
fn ledgers_mapped(pid: u32, dir: &Path, files: &BTreeSet<(u64, u64)>) -> BTreeSet<String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let mut mapped = BTreeSet::new();
    for line in maps.lines() {
        // address perms offset dev inode path
        let mut fields = line.split_whitespace();
        let (Some(dev), Some(inode)) = (fields.nth(3), fields.next()) else { continue };
        let path = fields.collect::<Vec<_>>().join(" ");
        let key = dev.split_once(':').and_then(|(major, minor)| {
            let major = u64::from_str_radix(major, 16).ok()?;
            let minor = u64::from_str_radix(minor, 16).ok()?;
            Some((major << 32 | minor, inode.parse::<u64>().ok()?))
        });
        if key.is_some_and(|key| key.1 != 0 && files.contains(&key)) || Path::new(&path).starts_with(dir) {
            mapped.insert(format!("{path} ({dev} {inode})"));
        }
    }
    mapped
}

/// How many of the hostile ledgers are owed a charge in the tests and the bench.
pub const OWED: usize = 10;

/// What the agent says of a ledger whose lock it could not take (`ledger_problems`).
pub const LOCK_HELD: &str = "lock stayed held";

/// Hostile ledgers, as many small tenants would leave them, at `<dir>/hostile-NN/ledger`:
/// made before the agent starts ([`HostileLedgers::make`], so that it watches them), then,
/// once it runs, attacked ([`HostileLedgers::attack`]): each gets a slot of a process that does
/// not exist (dead: the agent owes it a reclaim, which needs the lock) and its lock held by a
/// thread of the test for a given time, with the `dirty` flag the holder raised written down
/// again through the file, as a tenant would (so that the agent's copies settle and it goes
/// for the lock: a ledger left dirty is only reported unsettled); the first `owed` of them
/// also get a hooked process that allocates (seen by the agent's probes), then writes its own
/// charge down (tampered: the agent owes the ledger a charge, which needs the lock too).
/// Dropping it kills those processes; the lock holders let go by themselves.
pub struct HostileLedgers {
    paths: Vec<PathBuf>,
    owed: usize,
    holders: Vec<JoinHandle<()>>,
    processes: Vec<Running>,
    node: FakeNode,
}

impl HostileLedgers {
    /// `count` ledgers under `dir` (the agent's `--ledger-dir`), `owed` of which will be owed a
    /// charge.
    pub fn make(dir: &Path, count: usize, owed: usize) -> Result<HostileLedgers> {
        let paths = (0..count)
            .map(|i| {
                let container = dir.join(format!("hostile-{i:02}"));
                std::fs::create_dir_all(&container).with_context(|| format!("cannot create {}", container.display()))?;
                let path = container.join("ledger");
                ledgers::create(&path, 16, 256, GIB, 64 * MIB)?;
                Ok(path)
            })
            .collect::<Result<Vec<_>>>()?;
        let node = FakeNode::new("hostile-ledgers").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
        Ok(HostileLedgers { paths, owed, holders: Vec::new(), processes: Vec::new(), node })
    }

    /// The attack, once the agent runs (its probes see the owed processes allocate); returns
    /// once every lock is taken, to be held for `held_for` (longer than the test's checks: see
    /// [`HostileLedgers::held`]).
    pub fn attack(&mut self, held_for: Duration) -> Result<()> {
        let pidns = std::fs::metadata("/proc/self/ns/pid").map(|m| m.ino())?;
        for (i, path) in self.paths.iter().enumerate() {
            if i < self.owed {
                let running = holding(self.node.hooked(path, GIB)?, &["ctx 0", "alloc a 128m"])?;
                ledgers::zero_slot_bytes(path, running.pid())?;
                self.processes.push(running);
            }
            // Registered after the hooked process started: a hook frees the dead slots of its
            // pid namespace when it opens its session.
            Ledger::open(path)?.register(ProcessIdentity { pid: 4_100_000 + i as u32, pidns, start_time: 1 })?;
        }
        let dirty = ledger::layout::PAGE + std::mem::offset_of!(ledger::layout::State, dirty) as u64;
        let taken = Arc::new(Barrier::new(self.paths.len() + 1));
        self.holders = self
            .paths
            .iter()
            .map(|path| {
                let ledger = Ledger::open(path)?;
                let file = std::fs::OpenOptions::new().write(true).open(path)?;
                let taken = taken.clone();
                Ok(std::thread::spawn(move || {
                    let holding = std::thread::spawn(move || ledger.hold_lock_for(held_for));
                    std::thread::sleep(Duration::from_millis(200));
                    let _ = file.write_all_at(&0u32.to_ne_bytes(), dirty);
                    taken.wait();
                    let _ = holding.join();
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        taken.wait();
        Ok(())
    }

    /// The ledger files.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// The pids of the processes that wrote their charge down.
    pub fn owed_pids(&self) -> Vec<u32> {
        self.processes.iter().map(Running::pid).collect()
    }

    /// Every lock is still held (no holder has let go yet): the attack is in effect.
    pub fn held(&self) -> bool {
        !self.holders.is_empty() && self.holders.iter().all(|h| !h.is_finished())
    }

    /// Waits up to `within` until `vramguard audit` reports every hostile ledger in
    /// `ledger_problems` with the reason [`LOCK_HELD`] (its reclaim and its charge refused by
    /// its lock), and every process that wrote its charge down `tampered`.
    pub fn wait_reported(&self, agent: &Agent, within: Duration) -> Result<()> {
        let names: Vec<String> = self.paths.iter().map(|p| p.display().to_string()).collect();
        let owed = self.owed_pids();
        wait_for(within, "every hostile ledger reported as backed off, every owed process tampered", || {
            let audit = agent.audit()?;
            let problems = &audit["ledger_problems"];
            let rows = audit["processes"].as_array().cloned().unwrap_or_default();
            let tampered = |pid: u32| rows.iter().any(|row| row["pid"].as_u64() == Some(u64::from(pid)) && row["state"] == "tampered");
            Ok(names.iter().all(|name| problems[name.as_str()].as_str().is_some_and(|p| p.contains(LOCK_HELD)))
                && owed.iter().all(|pid| tampered(*pid)))
        })
        .with_context(|| {
            let problems = agent.audit().map(|a| a["ledger_problems"].to_string()).unwrap_or_default();
            format!("audit: {problems}\nlog:\n{}", agent.log())
        })?;
        Ok(())
    }
}
