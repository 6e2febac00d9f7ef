//! What every attack test of the adversarial suite (`tests/hostile_*.rs`) checks while its
//! attack runs (`../shared/security.md`, "How we test it"): the agent is still alive and still
//! serving `/metrics` ([`assert_serving`]), and it still reclaims the slot of a SIGKILLed
//! process of *another* container within a second ([`Bystander`]).
use std::{path::PathBuf, time::Duration};

use anyhow::{bail, Context, Result};

use crate::{agent::Agent, holding, http, ledgers, wait_for, FakeNode, Running, TempDir, GIB};

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
