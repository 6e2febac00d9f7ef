//! The reconcile task: owns the [`Reconciler`], the agent's charges ([`Charging`]: worker
//! calls on a thread of their own, which no pass waits for) and the
//! metrics registry, and does the work tenants can make expensive that joins the views: a
//! pass (copies of every ledger, the probes' processes, `/proc` look-ups), the charges that
//! follow it (handed to the charging thread), the metrics page a scrape asks for, and the snapshot `vramguard
//! audit` asks for. Each of those runs on the blocking pool with the task's state moved there
//! and back; nothing critical waits for it: it reads the kernel task's view and the reclaim
//! task's ledgers when it needs them, and hands on the limits of the ledgers' containers
//! (cgroup id -> bytes) and what each cgroup's processes hold as two driver reads showed it
//! ([`super::Reconciler::holders_by_cgroup`]), for the kernel
//! task to push and enforce: the kernel task never waits for NVML or for a pass.
//!
//! Passes run every second, after a drain or a reclaim that changed something ([`super::SETTLE`]
//! after it, and [`super::MIN_INTERVAL`] after the last pass at the soonest), and for every
//! `audit`.
use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::Duration};

use bytes::Bytes;
use tokio::{
    sync::{mpsc, oneshot, watch, Notify},
    time::{interval, timeout, MissedTickBehavior},
};

use super::{HoldersByCgroup, Reconciler};
use crate::{
    discovery::task::Found,
    driver::DriverView,
    kernel::task::KernelView,
    ledgers::{charge::Charging, Ledgers},
    provision::Provisioner,
    reconcile::metrics::Metrics,
    serve::{Published, Publisher},
    snapshot::Snapshot,
    task::Heartbeat,
};

/// How often a pass runs however quiet the node is.
pub const EVERY: Duration = Duration::from_secs(1);

/// How long a pass waits for the kernel task's view (it answers within a drain).
const KERNEL_WAIT: Duration = Duration::from_secs(2);

/// Provisioning as this task reports it: the provisioner and whether NRI is connected.
#[derive(Clone)]
pub struct Provisioning {
    pub provisioner: Arc<Provisioner>,
    pub connected: watch::Receiver<bool>,
}

/// How the task is told things and what it tells.
pub struct Wiring {
    /// Asks the kernel task for its view.
    pub kernel: mpsc::Sender<oneshot::Sender<KernelView>>,
    /// The reclaim task's ledgers (none without `--ledger-dir`).
    pub ledgers: Option<watch::Receiver<Arc<Ledgers>>>,
    pub found: watch::Receiver<Arc<Found>>,
    /// The driver task's latest view (NVML), read as it is when a pass starts.
    pub driver: watch::Receiver<Arc<DriverView>>,
    /// The limits of the ledgers' containers, for the kernel task.
    pub ledger_limits: watch::Sender<BTreeMap<u64, u64>>,
    /// What each cgroup's processes hold, for the kernel task.
    pub holders: watch::Sender<Arc<HoldersByCgroup>>,
    /// The metrics listener's board (none without `--metrics-addr`), and its bell.
    pub publisher: Option<(Publisher, Arc<Notify>)>,
    /// Rung by the kernel and reclaim tasks when a pass is worth running.
    pub changed: Arc<Notify>,
    /// `vramguard audit`'s requests.
    pub audits: mpsc::Receiver<oneshot::Sender<Snapshot>>,
    pub provisioning: Option<Provisioning>,
    /// The DRA driver's published pool (`--dra`), for the audit.
    pub dra: Option<watch::Receiver<crate::snapshot::DraStatus>>,
    /// The driver's own per-cgroup limits (`--nri`), for the audit and the figure.
    pub driver_limits: Option<watch::Receiver<crate::driver_limits::DriverLimits>>,
    pub metrics_addr: Option<SocketAddr>,
    pub health_addr: Option<SocketAddr>,
    pub heartbeat: Heartbeat,
    pub stop: watch::Receiver<bool>,
}

/// The task's state.
pub struct Judge {
    pub reconciler: Reconciler,
    pub charging: Charging,
    pub metrics: Metrics,
    /// Passes run so far.
    pub passes: u64,
    /// The kernel's view of the last pass.
    pub view: Option<Snapshot>,
}

/// What a step is for.
enum Step {
    Pass,
    Render,
    Audit(oneshot::Sender<Snapshot>),
}

impl Judge {
    /// Runs until `stop` turns true; then frees the agent's charges. A step that panics ends
    /// the task (and the agent: its charges go with the agent's slots, freed by the reclaim
    /// task's stop).
    pub async fn run(mut self, mut wiring: Wiring) -> anyhow::Result<()> {
        let mut tick = interval(EVERY);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let wanted = wiring.publisher.as_ref().map(|(_, wanted)| wanted.clone());
        // A pass at the moment what the last one saw can be confirmed (a slot written down).
        let mut confirm = None;
        // A pass an event called for, once it settled ([`super::SETTLE`]).
        let mut settled = None;
        loop {
            wiring.heartbeat.beat();
            let step = tokio::select! {
                _ = wiring.stop.changed() => break,
                _ = tick.tick() => Step::Pass,
                _ = at(confirm) => Step::Pass,
                _ = at(settled) => Step::Pass,
                _ = wiring.changed.notified() => {
                    if settled.is_none() {
                        settled = Some(tokio::time::Instant::from_std(self.reconciler.event_pass_at()));
                    }
                    continue;
                }
                _ = rung(wanted.as_deref()) => Step::Render,
                request = wiring.audits.recv() => match request {
                    Some(reply) => Step::Audit(reply),
                    None => continue,
                },
            };
            if matches!(step, Step::Pass | Step::Audit(_)) {
                settled = None;
            }
            self = self.step(step, &wiring).await?;
            confirm = self.reconciler.next_confirmation().map(tokio::time::Instant::from_std);
        }
        let charging = self.charging;
        let ledgers = wiring.ledgers.as_ref().map(|l| l.borrow().clone());
        tokio::task::spawn_blocking(move || match ledgers {
            Some(ledgers) => charging.release_all(&ledgers),
            None => charging.release_all(&Ledgers::new(std::path::PathBuf::new())),
        })
        .await?;
        Ok(())
    }

    async fn step(self, step: Step, wiring: &Wiring) -> anyhow::Result<Judge> {
        let ledgers = wiring.ledgers.as_ref().map(|l| l.borrow().clone());
        let found = wiring.found.borrow().clone();
        let driver = wiring.driver.borrow().clone();
        let provisioning = wiring.provisioning.clone();
        let dra = wiring.dra.clone();
        let driver_limits = wiring.driver_limits.clone();
        let (metrics_addr, health_addr) = (wiring.metrics_addr, wiring.health_addr);
        let page_behind = wiring.publisher.as_ref().is_some_and(|(publisher, _)| publisher.behind());
        let kernel = match step {
            Step::Render => None,
            Step::Pass | Step::Audit(_) => {
                let (ask, answer) = oneshot::channel();
                match wiring.kernel.send(ask).await {
                    Ok(()) => timeout(KERNEL_WAIT, answer).await.ok().and_then(Result::ok),
                    Err(_) => None,
                }
            }
        };
        if matches!(step, Step::Render) && !page_behind {
            return Ok(self);
        }
        let stopping = wiring.stop.clone();
        let work = tokio::task::spawn_blocking(move || {
            let mut state = self;
            let shared = ledgers.clone();
            let ledgers = ledgers.as_deref();
            state.reconciler.set_driver(Some(driver));
            state.reconciler.set_driver_held(driver_held(driver_limits.as_ref()));
            let mut failed = None;
            if let Some(view) = kernel {
                // Once the agent stops, no charge is made that its stop would not free.
                let charging = !*stopping.borrow();
                failed = state.pass(shared.filter(|_| charging), ledgers, view).err();
            }
            let out = match step {
                Step::Pass => Out::Passed,
                Step::Render => Out::Page(Box::new(state.render(ledgers, &found, provisioning.as_ref()))),
                Step::Audit(reply) => {
                    let mut snapshot = state.snapshot(ledgers, &found);
                    snapshot.metrics_addr = metrics_addr.map(|addr| addr.to_string());
                    snapshot.health_addr = health_addr.map(|addr| addr.to_string());
                    // For audit only (the metrics page does not show it): a copy of each ledger.
                    snapshot.ledger_problems = ledgers.map(Ledgers::problems).unwrap_or_default();
                    if let Some(p) = provisioning.as_ref() {
                        snapshot.provisioned = p.provisioner.provisioned().into_iter().map(|p| p.record).collect();
                        snapshot.nri_connected = Some(*p.connected.borrow());
                    }
                    snapshot.dra = dra.as_ref().map(|dra| dra.borrow().clone());
                    snapshot.driver_limits = driver_limits.as_ref().map(|limits| limits.borrow().clone());
                    Out::Audit(reply, Box::new(snapshot))
                }
            };
            let limits = ledgers.map(|l| ledger_cgroup_limits(l, &state.reconciler)).unwrap_or_default();
            let holders = state.reconciler.holders_by_cgroup();
            (state, out, limits, holders, failed)
        });
        // A panic in a pass is a bug; the task cannot go on without its state.
        let (state, out, limits, holders, failed) = work.await.map_err(|error| anyhow::anyhow!("a reconcile step failed: {error}"))?;
        if let Some(error) = failed {
            anyhow::bail!("the agent's charges cannot be made: {error}");
        }
        wiring.ledger_limits.send_if_modified(|held| {
            let changed = *held != limits;
            *held = limits;
            changed
        });
        wiring.holders.send_if_modified(|held| {
            let changed = **held != holders;
            if changed {
                *held = Arc::new(holders);
            }
            changed
        });
        if let Some((publisher, _)) = wiring.publisher.as_ref() {
            if let Out::Page(page) = out {
                publisher.publish(*page);
            } else {
                publisher.passed(state.passes);
                if let Out::Audit(reply, snapshot) = out {
                    let _ = reply.send(*snapshot);
                }
            }
        } else if let Out::Audit(reply, snapshot) = out {
            let _ = reply.send(*snapshot);
        }
        Ok(state)
    }

    /// One reconcile pass, then the charges it wants handed to the charging thread (in
    /// `charged`, the ledgers, unless the agent stops); timed (the charges are not its time).
    fn pass(&mut self, charged: Option<Arc<Ledgers>>, ledgers: Option<&Ledgers>, view: KernelView) -> Result<(), String> {
        let started = std::time::Instant::now();
        self.reconciler.pass(ledgers, &view.processes);
        let submitted = match charged {
            Some(ledgers) => self.charging.submit(ledgers, self.reconciler.unaccounted_by_ledger(), self.reconciler.unreadable().clone()),
            None => Ok(()),
        };
        self.metrics.passed(started.elapsed());
        self.passes += 1;
        self.view = Some(view.snapshot);
        submitted
    }

    /// The current view for `vramguard audit` and the metrics: the probes' maps as of the
    /// last pass, with that pass's states.
    pub fn snapshot(&self, ledgers: Option<&Ledgers>, found: &Found) -> Snapshot {
        let mut snapshot = self.view.clone().unwrap_or_default();
        self.reconciler.annotate(&mut snapshot);
        snapshot.libcuda = found.probed.clone();
        snapshot.discovery = found.stats.clone();
        snapshot.ledgers = ledgers.map(|l| l.iter().map(|(path, _)| path.display().to_string()).collect()).unwrap_or_default();
        snapshot.stats.slots_reclaimed = self.metrics.reclaims().total();
        snapshot.driver = self.reconciler.driver_status();
        snapshot
    }

    /// A page for `--metrics-addr`: the metrics as of the last pass, and the readiness.
    pub fn render(&mut self, ledgers: Option<&Ledgers>, found: &Found, provisioning: Option<&Provisioning>) -> Published {
        let view = self.snapshot(ledgers, found);
        let charged = self.charging.charged();
        self.metrics.refresh(ledgers, &view, &self.reconciler, &charged.iter().map(|(path, bytes)| (path.as_str(), *bytes)).collect());
        if let Some(p) = provisioning {
            self.metrics.set_provisioning(p.provisioner.len(), *p.connected.borrow(), p.provisioner.gpus_undetermined());
        }
        let not_ready = not_ready(found, provisioning);
        Published { metrics: self.metrics.encode().map(Bytes::from).map_err(|error| format!("{error:#}")), not_ready, passes: self.passes }
    }
}

/// What a step produced.
enum Out {
    Passed,
    Page(Box<Published>),
    Audit(oneshot::Sender<Snapshot>, Box<Snapshot>),
}

/// Why the agent is not ready, if it is not: nothing probed, not registered with the runtime,
/// or the node's pods not listed yet.
pub fn not_ready(found: &Found, provisioning: Option<&Provisioning>) -> Option<&'static str> {
    if found.probed.is_empty() {
        Some("no libcuda probed")
    } else if provisioning.is_some_and(|p| !*p.connected.borrow()) {
        Some("not registered with the container runtime (NRI): new containers start without their quota")
    } else if provisioning.and_then(|p| p.provisioner.kube_synced()) == Some(false) {
        Some("the pods of this node are not listed from the Kubernetes API yet")
    } else {
        None
    }
}

/// Waits until `deadline`, or forever without one.
async fn at(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The bell's next ring; never, without a metrics listener.
async fn rung(bell: Option<&Notify>) {
    match bell {
        Some(bell) => bell.notified().await,
        None => std::future::pending().await,
    }
}

/// The cgroups of each watched ledger's live processes (as the last reconcile pass found
/// them) and the ledger's limit as the agent validated it (the sum of its devices' limits). A
/// cgroup with processes of several ledgers is held to the smallest of their limits: a
/// workload cannot lift its cgroup's limit by registering a process in a second ledger.
fn ledger_cgroup_limits(ledgers: &Ledgers, reconciler: &Reconciler) -> BTreeMap<u64, u64> {
    let mut limits = BTreeMap::new();
    for (path, ledger) in ledgers.iter() {
        let header = ledgers.validated_header(path).unwrap_or(ledger.header());
        let limit: u64 = header.devices[..header.device_count as usize].iter().map(|d| d.limit).sum();
        let Some(cgroups) = reconciler.ledger_cgroups().get(&path.display().to_string()) else { continue };
        for cgroup in cgroups {
            limits.entry(*cgroup).and_modify(|held: &mut u64| *held = (*held).min(limit)).or_insert(limit);
        }
    }
    limits
}

/// The cgroups the driver holds to their quota, by id (the inode of the cgroup2 directory),
/// with what it counts in each over the container's GPUs; a cgroup gone since is left out.
fn driver_held(limits: Option<&watch::Receiver<crate::driver_limits::DriverLimits>>) -> BTreeMap<u64, u64> {
    use std::os::unix::fs::MetadataExt;
    let Some(limits) = limits else { return BTreeMap::new() };
    let limits = limits.borrow().clone();
    if !limits.containers.values().any(|c| c.held) {
        return BTreeMap::new();
    }
    // The cgroup2 mount does not move while the agent runs: read once, not at every pass.
    static ROOT: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    let Some(root) = ROOT.get_or_init(crate::cgroup::cgroup2_mount) else { return BTreeMap::new() };
    limits
        .containers
        .values()
        .filter(|c| c.held)
        .filter_map(|c| {
            let id = std::fs::metadata(root.join(c.cgroup.trim_start_matches('/'))).ok()?.ino();
            Some((id, c.gpus.iter().filter_map(|g| g.used).fold(0u64, u64::saturating_add)))
        })
        .collect()
}
