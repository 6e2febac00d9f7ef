//! The reclaim task: owns the watched [`Ledgers`] (the only task that scans `--ledger-dir` and
//! applies the provisioned ledgers' pins) and the [`Reclaimer`], frees the slots of dead
//! processes on their exit events and every `--ledger-scan-ms`, and publishes each new state
//! of the set (a cheap clone: the handles are shared) for the reconcile task.
//!
//! Exits do not wait for its steps: the exit path ([`super::exits`]) runs beside them, in the
//! same task, frees the slot of a watched process when its pidfd says it exited, and hands the
//! task the exits it leaves to the sweeps (through the same queue the kernel task's exits took).
//!
//! Its steps run on the blocking pool, its state moved there and back, so a slow file never
//! holds a runtime thread; a step on one ledger is bounded as [`super::reclaim`] says (every
//! ledger's dead slots freed on a thread of its own, under a budget), and nothing a reconcile
//! pass does (copies, charges) runs here: reclaim for one tenant waits on no other tenant's
//! pass.
use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Duration};
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};

use tokio::{
    sync::{mpsc, watch, Notify},
    time::{interval, MissedTickBehavior},
};
use tracing::{info, warn};

use super::{
    exits::{ExitPath, Watch},
    reclaim::Reclaimer,
    Ledgers, Pin,
};
use crate::{driver::DriverView, task::{changed, Heartbeat}};

/// How often an exit event whose process is not a zombie yet is looked at again: its sweep
/// reads the ledgers the process was found in ([`Reclaimer::exit_scope`]), or all of them
/// if it was in none (then less often).
const EXIT_RETRY: Duration = Duration::from_millis(1);
const EXIT_RETRY_ALL: Duration = Duration::from_millis(5);

/// Exits the exit path hands on to the sweeps, queued at most.
const EXIT_QUEUE: usize = 4096;

/// How the task is told things and what it tells.
pub struct Wiring {
    /// Exits from the kernel task (tgid, arrival).
    pub exits: mpsc::Receiver<(u32, std::time::Instant)>,
    /// The provisioned containers' ledgers and what they are held to.
    pub pins: Option<watch::Receiver<BTreeMap<PathBuf, Pin>>>,
    /// Every new state of the set.
    pub published: watch::Sender<Arc<Ledgers>>,
    /// Rung when slots were reclaimed (a pass is worth running).
    pub changed: Arc<Notify>,
    /// The driver task's latest view: whether a dead process's memory is still held
    /// ([`super::reclaim`]); each new read sweeps again while slots are kept for it.
    pub driver: Option<watch::Receiver<Arc<DriverView>>>,
    pub reclaims: Reclaims,
    pub heartbeat: Heartbeat,
    pub stop: watch::Receiver<bool>,
}

/// The task's state.
pub struct Reclaim {
    pub ledgers: Ledgers,
    pub reclaimer: Reclaimer,
}

/// What a step asks for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    /// List the directory first, then sweep every ledger.
    Scan,
    /// [`Step::Scan`], every `--ledger-scan-ms` (the step the test-only fault `delay:reclaim-scan:MS`
    /// lengthens, [`crate::fault`]).
    Periodic,
    /// Sweep every ledger.
    Sweep,
    /// Sweep for the pending exits: the ledgers their processes were found in.
    Exits,
}

impl Reclaim {
    /// Scans and sweeps once (before the agent reports itself running), then runs until
    /// `stop` turns true, with the exit path beside it.
    pub async fn run(mut self, scan_every: Duration, mut wiring: Wiring) -> anyhow::Result<()> {
        let events = std::mem::replace(&mut wiring.exits, mpsc::channel(1).1);
        let (watch, fired) = Watch::new(tokio::runtime::Handle::current(), Some(wiring.reclaims.watched.clone()));
        self.reclaimer.set_watch(Arc::clone(&watch));
        self.ledgers.set_watch(Arc::clone(&watch));
        let (forward, exits) = mpsc::channel(EXIT_QUEUE);
        let exit_path = ExitPath { watch, fired, events, forward, reclaims: wiring.reclaims.clone(), changed: wiring.changed.clone() };
        let stop = wiring.stop.clone();
        tokio::try_join!(self.serve(scan_every, wiring, exits), exit_path.run(stop))?;
        Ok(())
    }

    /// The task's loop: steps for the exits the exit path hands on, every `scan_every`, for
    /// new driver reads while slots are kept, and for new pins.
    async fn serve(mut self, scan_every: Duration, mut wiring: Wiring, mut exits: mpsc::Receiver<(u32, std::time::Instant)>) -> anyhow::Result<()> {
        self = self.step(Step::Scan, &mut exits, &mut wiring).await?;
        info!(dir = %self.ledgers.dir().display(), ledgers = self.ledgers.len(), skipped = self.ledgers.skipped(), "watching ledgers");
        let mut scan = interval(scan_every);
        scan.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut retry = interval(EXIT_RETRY);
        retry.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut retry_all = interval(EXIT_RETRY_ALL);
        retry_all.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut pins = wiring.pins.clone();
        let mut driver = wiring.driver.clone();
        loop {
            wiring.heartbeat.beat();
            let step = tokio::select! {
                _ = wiring.stop.changed() => break,
                exit = exits.recv() => {
                    let Some((tgid, at)) = exit else { break };
                    self.reclaimer.exited(tgid, at);
                    Step::Exits
                }
                _ = retry.tick(), if self.reclaimer.pending() && self.reclaimer.pending_located() => Step::Exits,
                _ = retry_all.tick(), if self.reclaimer.pending() && !self.reclaimer.pending_located() => Step::Exits,
                _ = scan.tick() => Step::Periodic,
                _ = changed(&mut driver) => {
                    if self.reclaimer.kept() == 0 {
                        continue;
                    }
                    Step::Sweep
                }
                _ = changed(&mut pins) => {
                    if let Some(pins) = pins.as_mut() {
                        self.ledgers.set_pins(pins.borrow_and_update().clone());
                    }
                    Step::Scan
                }
            };
            self = self.step(step, &mut exits, &mut wiring).await?;
        }
        // The agent's charges go with it, whatever became of the reconcile task.
        let ledgers = self.ledgers;
        let freed = tokio::task::spawn_blocking(move || super::charge::release_own(&ledgers)).await?;
        if freed > 0 {
            info!(slots = freed, "freed the agent's own slots left in the ledgers");
        }
        Ok(())
    }

    /// One step on the blocking pool; publishes the set after a scan.
    /// The exits queued meanwhile are taken at the start of the step and at the end of its
    /// sweep (the queue moves to the blocking pool with the state, and back).
    async fn step(self, step: Step, exits: &mut mpsc::Receiver<(u32, std::time::Instant)>, wiring: &mut Wiring) -> anyhow::Result<Reclaim> {
        let reclaims = wiring.reclaims.clone();
        let heartbeat = wiring.heartbeat.clone();
        let driver = wiring.driver.as_ref().map(|view| view.borrow().clone());
        let (_, mut queue) = mpsc::channel(1);
        std::mem::swap(exits, &mut queue);
        let work = tokio::task::spawn_blocking(move || {
            let mut state = self;
            state.reclaimer.set_driver(driver);
            let mut late = || std::iter::from_fn(|| queue.try_recv().ok()).collect::<Vec<_>>();
            for (tgid, at) in late() {
                state.reclaimer.exited(tgid, at);
            }
            if step == Step::Periodic {
                if let Some(by) = crate::fault::delay("reclaim-scan") {
                    warn!(?by, "fault injected: the periodic reclaim step is delayed");
                    std::thread::sleep(by);
                }
            }
            if matches!(step, Step::Scan | Step::Periodic) {
                state.ledgers.scan();
                reclaims.listed(state.ledgers.listings());
            }
            heartbeat.beat();
            let scope = match step {
                Step::Exits => state.reclaimer.exit_scope(),
                // Quiet ledgers whose stamp has not moved are left unread ([`super::reclaim`]).
                Step::Periodic => state.reclaimer.periodic_scope(&state.ledgers),
                Step::Scan | Step::Sweep => None,
            };
            let (read_before, proc_before) = (state.reclaimer.ledgers_read, state.reclaimer.proc_reads);
            let reclaimed = state.reclaimer.sweep_with(&state.ledgers, scope.as_ref(), &mut late);
            reclaims.read(step == Step::Exits, state.reclaimer.ledgers_read - read_before);
            reclaims.proc_reads.inc_by(state.reclaimer.proc_reads - proc_before);
            for latency in &reclaimed {
                reclaims.observe(*latency);
            }
            (state, !reclaimed.is_empty(), queue)
        });
        match work.await {
            Ok((state, reclaimed, queue)) => {
                *exits = queue;
                if matches!(step, Step::Scan | Step::Periodic) {
                    wiring.published.send_replace(Arc::new(state.ledgers.clone()));
                }
                if reclaimed {
                    wiring.changed.notify_one();
                }
                Ok(state)
            }
            // A panic in a sweep is a bug; the task cannot go on without its state.
            Err(error) => Err(anyhow::anyhow!("a reclaim step failed: {error}")),
        }
    }
}

/// The reclaim counters, shared with the task that reclaims.
#[derive(Clone)]
pub struct Reclaims {
    count: IntCounter,
    latency: Histogram,
    /// Sweeps, and the ledgers they read, by `sweep` (`exit`: for exits, `all`).
    sweeps: IntCounterVec,
    ledgers_read: IntCounterVec,
    /// Reads of `/proc/<pid>` the sweeps made to judge slots.
    pub proc_reads: IntCounter,
    /// Processes watched through pidfds ([`super::exits`]).
    pub watched: IntGauge,
    /// Listings of the ledger directory, by why ([`super::changes`]).
    pub listings: IntCounterVec,
}

impl Reclaims {
    pub fn new(count: IntCounter, latency: Histogram, sweeps: IntCounterVec, ledgers_read: IntCounterVec, proc_reads: IntCounter, watched: IntGauge, listings: IntCounterVec) -> Reclaims {
        Reclaims { count, latency, sweeps, ledgers_read, proc_reads, watched, listings }
    }

    /// Brings the listings' counters up to the scans' counts ([`Ledgers::listings`]).
    pub fn listed(&self, counts: [u64; 4]) {
        for (why, count) in super::changes::Why::ALL.iter().zip(counts) {
            let counter = self.listings.with_label_values(&[why.label()]);
            counter.inc_by(count.saturating_sub(counter.get()));
        }
    }

    /// Counts one sweep and the ledgers it read.
    pub fn read(&self, for_exits: bool, ledgers: u64) {
        let sweep = if for_exits { "exit" } else { "all" };
        self.sweeps.with_label_values(&[sweep]).inc();
        self.ledgers_read.with_label_values(&[sweep]).inc_by(ledgers);
    }

    /// Counts one reclaim.
    pub fn observe(&self, latency: Duration) {
        self.count.inc();
        self.latency.observe(latency.as_secs_f64());
    }

    /// Reclaims so far.
    pub fn total(&self) -> u64 {
        self.count.get()
    }
}


