//! What every attack test of the adversarial suite (`tests/hostile_*.rs`) checks while its
//! attack runs (`../shared/security.md`, "How we test it"): the agent is still alive and still
//! serving `/metrics` ([`assert_serving`]), and it still reclaims the slot of a SIGKILLed
//! process of *another* container within a second ([`Bystander`]), and `/healthz` answers
//! in time throughout ([`HealthProbe`]). [`HostileLedgers`] is the many-tenants attack
//! (issue 17): ledgers whose locks are held and that are owed reclaims and charges.
use std::{
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
    /// slot is freed within [`RECLAIM_WITHIN`]; returns how long the reclaim took.
    pub fn kill_and_expect_reclaim(&mut self, agent: &Agent) -> Result<Duration> {
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
        Ok(took)
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

    /// Stops probing; fails unless every answer was `200` within [`HEALTH_WITHIN`] (and there
    /// were some); returns the slowest.
    pub fn finish(self) -> Result<Duration> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let answers = self.thread.join().map_err(|_| anyhow::anyhow!("the health prober panicked"))?;
        let slowest = answers.iter().map(|(took, _)| *took).max().context("no /healthz probe ran")?;
        let bad: Vec<_> = answers.iter().filter(|(took, answer)| *took > HEALTH_WITHIN || !matches!(answer, Ok(200))).collect();
        eprintln!("/healthz: {} probes, slowest {slowest:?}, {} late or failed", answers.len(), bad.len());
        if !bad.is_empty() {
            bail!("/healthz late (over {HEALTH_WITHIN:?}) or failing: {bad:?}");
        }
        Ok(slowest)
    }
}

/// What the agent says of a ledger whose lock it could not take (`ledger_problems`).
pub const LOCK_HELD: &str = "lock stayed held";

/// Hostile ledgers, as many small tenants would leave them: each at
/// `<dir>/hostile-NN/ledger`, with a slot of a process that does not exist (dead: the agent
/// owes it a reclaim, which needs the lock) and its lock held by a thread of the test for a
/// given time; the first `owed` of them also have a hooked process that allocated, then wrote
/// its own charge down (tampered: the agent owes the ledger a charge, which needs the lock
/// too). Dropping it kills those processes; the lock holders let go by themselves.
pub struct HostileLedgers {
    paths: Vec<PathBuf>,
    holders: Vec<JoinHandle<()>>,
    _processes: Vec<Running>,
    _node: FakeNode,
}

impl HostileLedgers {
    /// Makes `count` hostile ledgers under `dir` (the agent's `--ledger-dir`, made before the
    /// agent starts so that it watches them) and returns once every lock is taken, to be held
    /// for `held_for` (longer than the test's attack: see [`HostileLedgers::held`]).
    pub fn make(dir: &Path, count: usize, owed: usize, held_for: Duration) -> Result<HostileLedgers> {
        let node = FakeNode::new("hostile-ledgers").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
        let pidns = std::fs::metadata("/proc/self/ns/pid").map(|m| std::os::unix::fs::MetadataExt::ino(&m))?;
        let (mut paths, mut processes) = (Vec::new(), Vec::new());
        for i in 0..count {
            let container = dir.join(format!("hostile-{i:02}"));
            std::fs::create_dir_all(&container).with_context(|| format!("cannot create {}", container.display()))?;
            let path = container.join("ledger");
            ledgers::create(&path, 16, 256, GIB, 64 * MIB)?;
            if i < owed {
                // A hooked process that allocates, then writes its charge down: tampered, and
                // the agent owes its ledger what the probes see beyond the charge.
                let running = holding(node.hooked(&path, GIB)?, &["ctx 0", "alloc a 128m"])?;
                ledgers::zero_slot_bytes(&path, running.pid())?;
                processes.push(running);
            }
            // A slot no process has: dead, owed a reclaim. Registered after the hooked
            // process started: the hook frees dead slots when it opens its session.
            Ledger::open(&path)?.register(ProcessIdentity { pid: 4_100_000 + i as u32, pidns, start_time: 1 })?;
            paths.push(path);
        }
        // Every lock taken before the agent looks, and held (by a live process: this one)
        // for `held_for`.
        let taken = Arc::new(Barrier::new(count + 1));
        let holders = paths
            .iter()
            .map(|path| {
                let ledger = Ledger::open(path)?;
                let taken = taken.clone();
                Ok(std::thread::spawn(move || {
                    let holding = std::thread::spawn(move || ledger.hold_lock_for(held_for));
                    std::thread::sleep(Duration::from_millis(200));
                    taken.wait();
                    let _ = holding.join();
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        taken.wait();
        Ok(HostileLedgers { paths, holders, _processes: processes, _node: node })
    }

    /// The ledger files.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Every lock is still held (no holder has let go yet): the attack is in effect.
    pub fn held(&self) -> bool {
        self.holders.iter().all(|h| !h.is_finished())
    }

    /// Waits up to `within` until `vramguard audit` reports every hostile ledger in
    /// `ledger_problems` with the reason [`LOCK_HELD`] (its reclaim and its charge refused by
    /// its lock); with none, checks nothing.
    pub fn wait_reported(&self, agent: &Agent, within: Duration) -> Result<()> {
        let names: Vec<String> = self.paths.iter().map(|p| p.display().to_string()).collect();
        wait_for(within, "every hostile ledger reported as backed off", || {
            let audit = agent.audit()?;
            let problems = &audit["ledger_problems"];
            Ok(names.iter().all(|name| problems[name.as_str()].as_str().is_some_and(|p| p.contains(LOCK_HELD))))
        })
        .with_context(|| {
            let problems = agent.audit().map(|a| a["ledger_problems"].to_string()).unwrap_or_default();
            format!("audit: {problems}\nlog:\n{}", agent.log())
        })?;
        Ok(())
    }
}
