//! The driver's own per-cgroup limits (NVIDIA r615 and later, CUDA 13.4).
//!
//! Such a driver holds a cgroup to a hard limit per GPU (`nvmlDeviceSetMemoryLimits_v1`,
//! read back with `nvmlDeviceGetMemoryLimits_v1`, whose `currentUsed` is what every process of
//! the cgroup holds on the GPU as the driver counts it): an allocation past it fails with
//! out-of-memory, whatever library made it. This room owns that: the limits thread (an
//! [`Nvml`] of its own: a call here never waits on the driver view's reads), which GPUs take
//! the limits and why not, and each provisioned container's limits as set and read back,
//! published as a [`DriverLimits`].
//!
//! * **Detect, per GPU**, when NVML is loaded and again every [`REPROBE`]: a library without
//!   both functions (a driver before r615), a GPU in MIG mode (NVML takes no MIG handle for
//!   limits) and a Get on the cgroup2 root answering `NOT_SUPPORTED` (driver 580) leave the
//!   GPU without; any other answer leaves it with (the root's own limits mean nothing here).
//!   Logged once per change, in `vramguard audit` and in `vramguard_driver_limits_in_force{gpu}`.
//! * **Set**: a container's hard limit is its quota on each GPU the runtime gave it, and its
//!   largest share on every other GPU of the node (a limits file rule's cgroup: the rule's
//!   limit on every GPU, a bound the probes' total for the cgroup stays under) (which it should not be able to open: a limit
//!   there costs nothing, and holds it should the runtime's word about its GPUs be wrong); each
//!   cut to the GPU's memory (NVML refuses a limit above it); soft 0 (no guarantee asked: the
//!   over-commit policy is the operator's, not the driver's). The NRI side asks at
//!   StartContainer ([`Limiter::apply`]): the runtime has made the container's cgroup (`runc
//!   create`) and starts its process only once answered, so no CUDA call of the container
//!   precedes its limit. Every [`EVERY`] the provisioned set is gone over (a Get, then a Set
//!   where the limit is missing or different; one pass at a time): an agent restart, or a
//!   container started while the agent was away, gets its limits back. A limit goes with its
//!   container: the driver clears a cgroup's limits when the cgroup is removed.
//! * **Never a refusal**: a Set that fails leaves the container as an older driver would (the
//!   hook, the probes and, under `--enforce signal`, the agent's signals hold it), logged and
//!   counted in `vramguard_driver_limits_errors_total{call,error}` once per container and GPU;
//!   the container starts. A cgroup not there (yet, or any more) is no error.
//! * **Held**: a container whose limit reads back on every GPU of the node, each of them taking
//!   limits, is held by the driver: its cgroup gets no probe limit and no signal (an escaping
//!   process meets the driver's out-of-memory instead), and its figure is the driver's
//!   `currentUsed`. A node with a GPU that takes none (MIG) holds no container. Held is the
//!   last pass's word only while passes answer: a limits thread silent for [`STALE`] (a hung
//!   NVML call) publishes nobody held, so the probes and the signals come back.
use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::CString,
    path::{Path, PathBuf},
    sync::mpsc as std_mpsc,
    time::{Duration, Instant},
};

use cuda_abi::nvml::{nvmlReturn_t, NVML_ERROR_NOT_SUPPORTED};
use prometheus::{IntCounterVec, IntGaugeVec, Opts};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};
use tracing::{info, warn};

use crate::{
    driver::nvml::{LimitDevice, Nvml},
    task::Heartbeat,
};

/// How often the provisioned set is gone over.
pub const EVERY: Duration = Duration::from_secs(1);
/// How long a heartbeat may lapse.
pub const ALLOWED: Duration = Duration::from_secs(10);
/// How long the limits thread may leave a pass unanswered before nobody is held.
pub const STALE: Duration = Duration::from_secs(5);
/// How often which GPUs take limits is asked again (a MIG change, a driver that answers).
pub const REPROBE: Duration = Duration::from_secs(30);

/// The driver's own per-cgroup GPU memory limits, as the agent set and last read them back.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverLimits {
    /// The NVML file the limits go through, once one is loaded.
    pub library: Option<String>,
    /// Why no GPU has them (no NVML, no cgroup v2, the limits thread silent), when that is so
    /// for the whole node.
    pub reason: Option<String>,
    /// Each GPU (by minor number): whether the driver's limits are in force there, and why not.
    pub gpus: Vec<GpuLimits>,
    /// Each provisioned container with a quota, by container id.
    pub containers: BTreeMap<String, ContainerLimits>,
}

/// Whether one GPU takes the driver's per-cgroup limits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLimits {
    pub gpu: u32,
    pub in_force: bool,
    /// Why not (`NOT_SUPPORTED`, MIG mode, no symbol), where not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why_not: Option<String>,
    /// The GPU's memory (a limit is cut to it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
}

/// One container's driver limits: per GPU of the node, the limit asked and what the driver
/// read back.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerLimits {
    /// The container's cgroup, relative to the cgroup2 root.
    pub cgroup: String,
    pub gpus: Vec<ContainerGpuLimit>,
    /// The driver holds the container to its quota on every GPU: its cgroup gets no probe
    /// limit and no signal, and its figure is the driver's.
    pub held: bool,
    /// Why it is not held, where that is the container's and not one GPU's (its cgroup not
    /// there yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why_not: Option<String>,
}

/// A container's driver limit on one GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerGpuLimit {
    pub gpu: u32,
    /// The hard limit asked for: the quota there (the largest share on a GPU the runtime did
    /// not give the container), cut to the GPU's memory.
    pub quota: u64,
    /// The hard limit the driver read back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hard: Option<u64>,
    /// What the driver counts against it (`currentUsed`): every process of the cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<u64>,
    /// Why the limit is not in force here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl DriverLimits {
    /// The cgroups (relative to the cgroup2 root) the driver holds to their quota.
    pub fn held_cgroups(&self) -> BTreeSet<String> {
        self.containers.values().filter(|c| c.held).map(|c| c.cgroup.clone()).collect()
    }
}

/// What the agent asks of the driver for one cgroup: a provisioned container's quota on each
/// GPU it was given, or a limits file rule's limit on every GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Want {
    /// The container's id, or `limits file: <cgroup>` for a rule's cgroup.
    pub container: String,
    /// The cgroup, relative to the cgroup2 root.
    pub cgroup: String,
    /// (GPU minor number, quota in bytes).
    pub quotas: Vec<(u32, u64)>,
    /// The limit on every other GPU of the node.
    pub others: u64,
    /// Whether a limit read back on every GPU holds the cgroup (its probe limit and signals
    /// stand down): a provisioned container's quota is per GPU, as the driver's limit; a
    /// rule's limit is the cgroup's over all its GPUs together, which the probes keep.
    pub hold: bool,
}

impl Want {
    /// A limits file rule's cgroup: `limit` on every GPU, the probes' total kept.
    pub fn ruled(cgroup: &str, limit: u64) -> Want {
        Want { container: format!("limits file: {cgroup}"), cgroup: cgroup.to_string(), quotas: Vec::new(), others: limit, hold: false }
    }
}

enum Job {
    /// Every container: set what is missing or different, read all back.
    Pass(Vec<Want>, oneshot::Sender<DriverLimits>),
    /// One container, now (StartContainer).
    Apply(Want, oneshot::Sender<ContainerLimits>),
}

/// The NRI side's handle: asks the limits thread for one container's limits.
#[derive(Clone)]
pub struct Limiter {
    jobs: std_mpsc::SyncSender<Job>,
}

impl Limiter {
    /// Sets `want`'s limits and reads them back, waiting at most `budget`; `None` past it, or
    /// when the limits thread's queue is full or gone (the container then starts as on an
    /// older driver, and the next pass sets its limits).
    pub async fn apply(&self, want: Want, budget: Duration) -> Option<ContainerLimits> {
        let (reply, answer) = oneshot::channel();
        self.jobs.try_send(Job::Apply(want, reply)).ok()?;
        tokio::time::timeout(budget, answer).await.ok()?.ok()
    }
}

/// The metrics the room keeps (registered by the caller).
#[derive(Clone)]
pub struct Metrics {
    in_force: IntGaugeVec,
    errors: IntCounterVec,
    held: prometheus::IntGauge,
}

impl Metrics {
    pub fn new() -> prometheus::Result<Metrics> {
        Ok(Metrics {
            in_force: IntGaugeVec::new(
                Opts::new("vramguard_driver_limits_in_force", "1 where the driver holds cgroups to per-GPU memory limits (NVIDIA r615+), 0 where it does not (see vramguard audit for why)"),
                &["gpu"],
            )?,
            errors: IntCounterVec::new(
                Opts::new("vramguard_driver_limits_errors_total", "Driver per-cgroup limit calls that failed, by call (set, get) and NVML error, once per container and GPU while it lasts; the container runs held by the hook and the probes"),
                &["call", "error"],
            )?,
            held: prometheus::IntGauge::new("vramguard_driver_limits_held_containers", "Provisioned containers the driver holds to their quota on every GPU")?,
        })
    }

    pub fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![Box::new(self.in_force.clone()), Box::new(self.errors.clone()), Box::new(self.held.clone())]
    }
}

/// The limits task: the thread's owner and the publisher.
pub struct Task {
    /// The NVML files to try ([`crate::driver::locate`]).
    pub candidates: Vec<PathBuf>,
    /// The cgroup2 mount (`None`: no cgroup v2, no limits).
    pub cgroup_root: Option<PathBuf>,
    /// The provisioned containers' wants, asked at each pass.
    pub wants: Box<dyn Fn() -> Vec<Want> + Send>,
    /// Rings when the provisioned set changes.
    pub changes: watch::Receiver<u64>,
    pub metrics: Metrics,
}

/// Makes the handle and the thread's queue; [`Task::run`] takes the queue.
pub fn channel() -> (Limiter, Queue) {
    let (jobs, queue) = std_mpsc::sync_channel(64);
    (Limiter { jobs: jobs.clone() }, Queue { jobs, queue })
}

/// The limits thread's queue (and a sender, for the passes).
pub struct Queue {
    jobs: std_mpsc::SyncSender<Job>,
    queue: std_mpsc::Receiver<Job>,
}

impl Task {
    /// Runs until `stop` turns true, publishing into `view`.
    pub async fn run(self, queue: Queue, view: watch::Sender<DriverLimits>, heartbeat: Heartbeat, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
        let Queue { jobs, queue } = queue;
        let Task { candidates, cgroup_root, wants, changes, metrics } = self;
        let thread_metrics = metrics.clone();
        // The thread's state is made on it: NVML's handles stay on the thread that got them.
        std::thread::Builder::new().name("vramguard-limits".into()).spawn(move || {
            let thread = Thread { candidates, root: cgroup_root, nvml: None, devices: Vec::new(), support: None, metrics: thread_metrics, told: DriverLimits::default(), last: BTreeMap::new() };
            thread.serve(queue)
        })?;
        let mut changes = Some(changes);
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // One pass at a time: the one asked, and since when.
        let mut pending: Option<(oneshot::Receiver<DriverLimits>, Instant)> = None;
        loop {
            heartbeat.beat();
            tokio::select! {
                _ = stop.changed() => return Ok(()),
                _ = tick.tick() => {}
                () = crate::task::changed(&mut changes) => {}
                answer = async { pending.as_mut().map(|(rx, _)| rx).expect("guarded by the condition").await }, if pending.is_some() => {
                    pending = None;
                    let Ok(limits) = answer else { anyhow::bail!("the limits thread ended") };
                    metrics.held.set(limits.containers.values().filter(|c| c.held).count() as i64);
                    view.send_if_modified(|old| std::mem::replace(old, limits.clone()) != limits);
                    continue;
                }
            }
            match &pending {
                None => {
                    let (reply, answer) = oneshot::channel();
                    match jobs.try_send(Job::Pass(wants(), reply)) {
                        Ok(()) => pending = Some((answer, Instant::now())),
                        Err(std_mpsc::TrySendError::Full(_)) => {}
                        Err(std_mpsc::TrySendError::Disconnected(_)) => anyhow::bail!("the limits thread ended"),
                    }
                }
                Some((_, since)) if since.elapsed() > STALE && !view.borrow().held_cgroups().is_empty() => {
                    let reason = format!("the limits thread has not answered for {} s (an NVML call hangs?): nobody is held by the driver until it does", since.elapsed().as_secs());
                    warn!(%reason, "driver limits");
                    metrics.held.set(0);
                    view.send_modify(|limits| {
                        limits.reason = Some(reason);
                        for container in limits.containers.values_mut() {
                            container.held = false;
                        }
                    });
                }
                Some(_) => {}
            }
        }
    }
}

/// The limits thread's state: NVML and the GPUs as it addresses them.
struct Thread {
    candidates: Vec<PathBuf>,
    root: Option<PathBuf>,
    nvml: Option<Nvml>,
    devices: Vec<LimitDevice>,
    /// Which GPUs take limits, and when that was asked.
    support: Option<(DriverLimits, Instant)>,
    metrics: Metrics,
    /// What was last said about the GPUs (for logging changes once).
    told: DriverLimits,
    /// Each container's limits as last applied (a failure is logged and counted when it is
    /// new, not at every pass).
    last: BTreeMap<String, ContainerLimits>,
}

impl Thread {
    fn serve(mut self, queue: std_mpsc::Receiver<Job>) {
        while let Ok(job) = queue.recv() {
            let support = self.support();
            match job {
                Job::Pass(wants, reply) => {
                    let containers: BTreeMap<String, ContainerLimits> = wants.iter().map(|want| (want.container.clone(), self.apply(want, &support))).collect();
                    self.last = containers.clone();
                    let _ = reply.send(DriverLimits { containers, ..support });
                }
                Job::Apply(want, reply) => {
                    let applied = self.apply(&want, &support);
                    if applied.held {
                        info!(container = %want.container, cgroup = %want.cgroup, "driver limits set before the container starts");
                    }
                    self.last.insert(want.container.clone(), applied.clone());
                    let _ = reply.send(applied);
                }
            }
        }
    }

    /// Which GPUs take limits: asked when NVML is loaded and every [`REPROBE`] (NVML is loaded
    /// again at most that often while it is not).
    fn support(&mut self) -> DriverLimits {
        if let Some((support, at)) = &self.support {
            if at.elapsed() < REPROBE {
                return support.clone();
            }
        }
        let support = self.probe();
        let support = self.tell(support);
        self.support = Some((support.clone(), Instant::now()));
        support
    }

    fn probe(&mut self) -> DriverLimits {
        if self.nvml.is_none() {
            match Nvml::open(&self.candidates).map_err(|t| t.reason) {
                Ok(nvml) => self.nvml = Some(nvml),
                Err(reason) => return DriverLimits { reason: Some(format!("no NVML: {reason}")), ..Default::default() },
            }
        }
        let Some(nvml) = &self.nvml else { return DriverLimits::default() };
        let library = Some(nvml.path().display().to_string());
        // The GPUs again (a MIG change, a GPU lost since).
        match nvml.limit_devices() {
            Ok(devices) => self.devices = devices,
            Err(reason) => return DriverLimits { library, reason: Some(format!("NVML lists no GPUs: {reason}")), ..Default::default() },
        }
        let Some(root) = &self.root else {
            return DriverLimits { library, reason: Some("no cgroup v2 mount: the driver's limits are set on cgroup v2 directories".into()), ..Default::default() };
        };
        let probe = CString::new(root.as_os_str().as_encoded_bytes()).unwrap_or_default();
        let gpus = self
            .devices
            .iter()
            .map(|device| {
                let why_not = if !nvml.has_limits() {
                    Some("the driver's NVML has no nvmlDeviceSetMemoryLimits_v1 (a driver before r615)".to_string())
                } else if device.mig {
                    Some("MIG mode: NVML takes no MIG device for limits".to_string())
                } else {
                    match nvml.get_limit(device, &probe) {
                        Err(e) if e.rc == NVML_ERROR_NOT_SUPPORTED => Some(format!("the driver answers {} (a driver before r615, or a GPU without the feature)", e.text)),
                        _ => None,
                    }
                };
                GpuLimits { gpu: device.minor, in_force: why_not.is_none(), why_not, memory: device.memory }
            })
            .collect();
        DriverLimits { library, reason: None, gpus, containers: BTreeMap::new() }
    }

    /// Logs and sets the gauges on a change of which GPUs take limits; returns `now`.
    fn tell(&mut self, now: DriverLimits) -> DriverLimits {
        if (&now.reason, &now.gpus) != (&self.told.reason, &self.told.gpus) {
            if let Some(reason) = &now.reason {
                warn!(%reason, "driver limits: none; quotas are held by the hook, the probes and --enforce");
            }
            self.metrics.in_force.reset();
            for gpu in &now.gpus {
                self.metrics.in_force.with_label_values(&[&gpu.gpu.to_string()]).set(i64::from(gpu.in_force));
                match &gpu.why_not {
                    None => info!(gpu = gpu.gpu, "driver limits in force: each provisioned container's quota is also set in the driver"),
                    Some(why) => info!(gpu = gpu.gpu, why = %why, "driver limits not in force on this GPU"),
                }
            }
            self.told = now.clone();
        }
        now
    }

    /// Sets (where missing or different) and reads back one container's limits on every GPU
    /// of the node. A failed call is logged and counted when it was not the container's
    /// failure on that GPU before.
    fn apply(&self, want: &Want, support: &DriverLimits) -> ContainerLimits {
        let mut limits = ContainerLimits { cgroup: want.cgroup.clone(), ..Default::default() };
        let (Some(nvml), Some(root)) = (&self.nvml, &self.root) else {
            limits.why_not = Some(support.reason.clone().unwrap_or_else(|| "no NVML".into()));
            return limits;
        };
        let path = cgroup_path(root, &want.cgroup);
        if !path.is_dir() {
            limits.why_not = Some(format!("its cgroup {} is not there (yet, or any more)", path.display()));
            return limits;
        }
        let Ok(path) = CString::new(path.into_os_string().into_encoded_bytes()) else {
            limits.why_not = Some(format!("cgroup {:?}: a NUL in its path", want.cgroup));
            return limits;
        };
        for gpu in &support.gpus {
            let asked = want.quotas.iter().find(|&&(g, _)| g == gpu.gpu).map_or(want.others, |&(_, quota)| quota);
            let quota = gpu.memory.map_or(asked, |memory| asked.min(memory));
            let mut limit = ContainerGpuLimit { gpu: gpu.gpu, quota, ..Default::default() };
            let device = self.devices.iter().find(|d| d.minor == gpu.gpu);
            match (&gpu.why_not, device) {
                (Some(why), _) => limit.error = Some(why.clone()),
                (None, None) => limit.error = Some("not among NVML's GPUs any more".into()),
                (None, Some(device)) => match set_and_read(nvml, device, &path, quota) {
                    Ok((hard, used)) => (limit.hard, limit.used) = (Some(hard), Some(used)),
                    Err((call, rc, text)) => {
                        let error = format!("{call}: {text}");
                        let before = self.last.get(&want.container).and_then(|c| c.gpus.iter().find(|g| g.gpu == gpu.gpu)).and_then(|g| g.error.as_ref());
                        if before != Some(&error) {
                            self.metrics.errors.with_label_values(&[call, &rc.to_string()]).inc();
                            warn!(container = %want.container, cgroup = %want.cgroup, gpu = gpu.gpu, %error, "driver limits: a call failed; the container is held by the hook and the probes");
                        }
                        limit.error = Some(error);
                    }
                },
            }
            limits.gpus.push(limit);
        }
        limits.held = want.hold && !limits.gpus.is_empty() && limits.gpus.iter().all(|g| g.hard == Some(g.quota));
        limits
    }
}

/// A Get, then a Set where the limit is not `quota` with soft 0, then a Get: (hard, used) as
/// the driver reads them back, or the failed call, its code and NVML's text.
fn set_and_read(nvml: &Nvml, device: &LimitDevice, cgroup: &CString, quota: u64) -> Result<(u64, u64), (&'static str, nvmlReturn_t, String)> {
    let get = || nvml.get_limit(device, cgroup).map_err(|e| ("get", e.rc, e.text));
    if let Some(limit) = get()?.filter(|l| l.hard == quota && l.soft == 0) {
        return Ok((limit.hard, limit.used));
    }
    nvml.set_limit(device, cgroup, 0, quota).map_err(|e| ("set", e.rc, e.text))?;
    let limit = get()?.ok_or(("get", cuda_abi::nvml::NVML_ERROR_NOT_FOUND, "the driver took the limit and reads none back".to_string()))?;
    Ok((limit.hard, limit.used))
}

/// A cgroup's sysfs directory: `root` joined with the path relative to it.
fn cgroup_path(root: &Path, cgroup: &str) -> PathBuf {
    root.join(cgroup.trim_start_matches('/'))
}
