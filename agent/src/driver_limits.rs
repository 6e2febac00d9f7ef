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
//! * **Detect, per GPU**: a library without both functions (a driver before r615), a GPU in
//!   MIG mode (NVML takes no MIG handle for limits) and a Get on the cgroup2 root answering
//!   anything but success or `NOT_FOUND` (`NOT_SUPPORTED` on driver 580) leave the GPU
//!   without; logged once per change, in `vramguard audit` and in
//!   `vramguard_driver_limits_in_force{gpu}`.
//! * **Set**: a container's hard limit is its quota on each of its GPUs, soft 0 (no
//!   guarantee asked: the over-commit policy is the operator's, not the driver's). The NRI side
//!   asks at StartContainer ([`Limiter::apply`]): the runtime has made the container's cgroup
//!   (`runc create`) and starts its process only once the answer is in, so no CUDA call of the
//!   container precedes its limit. Every [`EVERY`] the provisioned set is gone over (a Get,
//!   then a Set where the limit is missing or different): an agent restart, or a container
//!   started while the agent was away, gets its limits back. A limit goes with its container:
//!   the driver clears a cgroup's limits when the cgroup is removed.
//! * **Never a refusal**: a Set that fails leaves the container as an older driver would (the
//!   hook, the probes and, under `--enforce signal`, the agent's signals hold it), logged and
//!   counted in `vramguard_driver_limits_errors_total{call,error}`; the container starts.
//! * **Held**: a container whose every GPU reads back its quota as the hard limit is held by
//!   the driver: its cgroup gets no probe limit and no signal (an escaping process meets the
//!   driver's out-of-memory instead), and its figure is the driver's `currentUsed`.
use std::{
    collections::BTreeMap,
    ffi::CString,
    path::{Path, PathBuf},
    sync::mpsc as std_mpsc,
    time::{Duration, Instant},
};

use cuda_abi::nvml::{nvmlReturn_t, NVML_ERROR_NOT_SUPPORTED};
use prometheus::{IntCounterVec, IntGaugeVec, Opts};
use tokio::sync::{oneshot, watch};
use tracing::{info, warn};

use crate::{
    driver::nvml::{LimitDevice, Nvml},
    snapshot::{ContainerGpuLimit, ContainerLimits, DriverLimits, GpuLimits},
    task::Heartbeat,
};

/// How often the provisioned set is gone over.
pub const EVERY: Duration = Duration::from_secs(1);
/// How long a heartbeat may lapse (a pass waits for the limits thread up to [`PASS_BUDGET`]).
pub const ALLOWED: Duration = Duration::from_secs(10);
/// How long a pass waits for the limits thread before it publishes what it had.
pub const PASS_BUDGET: Duration = Duration::from_secs(3);
/// How often the thread tries again to load NVML while it has none.
pub const RETRY: Duration = Duration::from_secs(30);

/// What the agent asks of the driver for one container: its quota on each of its GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Want {
    pub container: String,
    /// The container's cgroup, relative to the cgroup2 root.
    pub cgroup: String,
    /// (GPU minor number, quota in bytes).
    pub quotas: Vec<(u32, u64)>,
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
    /// when the limits thread is busy or gone (the container then starts as on an older
    /// driver; the next pass sets its limits).
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
                Opts::new("vramguard_driver_limits_errors_total", "Driver per-cgroup limit calls that failed, by call (set, get) and NVML error; the container runs held by the hook and the probes"),
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
    pub async fn run(mut self, queue: Queue, view: watch::Sender<DriverLimits>, heartbeat: Heartbeat, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
        let Queue { jobs, queue } = queue;
        let (candidates, root, metrics) = (self.candidates, self.cgroup_root.clone(), self.metrics.clone());
        std::thread::Builder::new()
            .name("vramguard-limits".into())
            .spawn(move || Thread { candidates, root, nvml: None, devices: Vec::new(), tried: None, metrics, told: DriverLimits::default(), last: BTreeMap::new() }.serve(queue))?;
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            heartbeat.beat();
            tokio::select! {
                _ = stop.changed() => return Ok(()),
                _ = tick.tick() => {}
                changed = self.changes.changed() => if changed.is_err() { self.changes = watch::channel(0).1 },
            }
            let (reply, answer) = oneshot::channel();
            match jobs.try_send(Job::Pass((self.wants)(), reply)) {
                Ok(()) => {}
                Err(std_mpsc::TrySendError::Full(_)) => continue,
                Err(std_mpsc::TrySendError::Disconnected(_)) => anyhow::bail!("the limits thread ended"),
            }
            if let Ok(Ok(limits)) = tokio::time::timeout(PASS_BUDGET, answer).await {
                self.metrics.held.set(limits.containers.values().filter(|c| c.held).count() as i64);
                view.send_if_modified(|old| std::mem::replace(old, limits.clone()) != limits);
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
    /// When loading NVML last failed.
    tried: Option<Instant>,
    metrics: Metrics,
    /// What was last published about the GPUs (for logging changes once).
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

    /// Loads NVML if it has none (at most every [`RETRY`]) and says which GPUs take limits.
    fn support(&mut self) -> DriverLimits {
        if self.nvml.is_none() && self.tried.is_none_or(|at| at.elapsed() >= RETRY) {
            match Nvml::open(&self.candidates).map_err(|t| t.reason).and_then(|nvml| Ok((nvml.limit_devices()?, nvml))) {
                Ok((devices, nvml)) => (self.devices, self.nvml, self.tried) = (devices, Some(nvml), None),
                Err(reason) => {
                    self.tried = Some(Instant::now());
                    return self.tell(DriverLimits { reason: Some(format!("no NVML: {reason}")), ..Default::default() });
                }
            }
        }
        let Some(nvml) = &self.nvml else {
            return self.told.clone();
        };
        let library = Some(nvml.path().display().to_string());
        let Some(root) = &self.root else {
            return self.tell(DriverLimits { library, reason: Some("no cgroup v2 mount: the driver's limits are set on cgroup v2 directories".into()), ..Default::default() });
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
                        Ok(_) => None,
                        Err(e) if e.rc == NVML_ERROR_NOT_SUPPORTED => Some(format!("the driver answers {} (a driver before r615, or a GPU without the feature)", e.text)),
                        Err(e) => Some(format!("nvmlDeviceGetMemoryLimits_v1 on {}: {}", root.display(), e.text)),
                    }
                };
                GpuLimits { gpu: device.minor, in_force: why_not.is_none(), why_not }
            })
            .collect();
        self.tell(DriverLimits { library, reason: None, gpus, containers: BTreeMap::new() })
    }

    /// Logs and counts a change of which GPUs take limits; returns `now`.
    fn tell(&mut self, now: DriverLimits) -> DriverLimits {
        if (&now.reason, &now.gpus) != (&self.told.reason, &self.told.gpus) {
            if let Some(reason) = &now.reason {
                warn!(%reason, "driver limits: none; quotas are held by the hook, the probes and --enforce");
            }
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

    /// Sets (where missing or different) and reads back one container's limits. A failed
    /// call on a GPU that takes limits is logged and counted when it was not the container's
    /// failure there before.
    fn apply(&self, want: &Want, support: &DriverLimits) -> ContainerLimits {
        let mut gpus = Vec::with_capacity(want.quotas.len());
        for &(gpu, quota) in &want.quotas {
            let mut limit = ContainerGpuLimit { gpu, quota, ..Default::default() };
            match self.one(want, gpu, quota, support) {
                Ok((hard, used)) => (limit.hard, limit.used) = (Some(hard), Some(used)),
                Err(Failure::NotInForce(why)) => limit.error = Some(why),
                Err(Failure::Call(call, rc, text)) => {
                    let error = format!("{call}: {text}");
                    let before = self.last.get(&want.container).and_then(|c| c.gpus.iter().find(|g| g.gpu == gpu)).and_then(|g| g.error.as_ref());
                    if before != Some(&error) {
                        self.metrics.errors.with_label_values(&[call, &rc.to_string()]).inc();
                        warn!(container = %want.container, cgroup = %want.cgroup, gpu, %error, "driver limits: a call failed; the container is held by the hook and the probes");
                    }
                    limit.error = Some(error);
                }
            }
            gpus.push(limit);
        }
        let held = !gpus.is_empty() && gpus.iter().all(|g| g.hard == Some(g.quota));
        ContainerLimits { cgroup: want.cgroup.clone(), gpus, held }
    }

    /// One GPU of one container: (hard limit, used) as read back after any Set.
    fn one(&self, want: &Want, gpu: u32, quota: u64, support: &DriverLimits) -> Result<(u64, u64), Failure> {
        let (Some(nvml), Some(root)) = (&self.nvml, &self.root) else {
            return Err(Failure::NotInForce(support.reason.clone().unwrap_or_else(|| "no NVML".into())));
        };
        match support.gpus.iter().find(|g| g.gpu == gpu) {
            Some(GpuLimits { in_force: true, .. }) => {}
            Some(GpuLimits { why_not, .. }) => return Err(Failure::NotInForce(why_not.clone().unwrap_or_default())),
            None => return Err(Failure::NotInForce(format!("GPU {gpu} is not among NVML's"))),
        }
        let device = self.devices.iter().find(|d| d.minor == gpu).ok_or_else(|| Failure::NotInForce(format!("GPU {gpu} is not among NVML's")))?;
        let path = CString::new(cgroup_path(root, &want.cgroup).into_os_string().into_encoded_bytes())
            .map_err(|_| Failure::NotInForce(format!("cgroup {:?}: a NUL in its path", want.cgroup)))?;
        let get = |path: &CString| nvml.get_limit(device, path).map_err(|e| Failure::Call("get", e.rc, e.text));
        if let Some(limit) = get(&path)?.filter(|l| l.hard == quota && l.soft == 0) {
            return Ok((limit.hard, limit.used));
        }
        nvml.set_limit(device, &path, 0, quota).map_err(|e| Failure::Call("set", e.rc, e.text))?;
        let limit = get(&path)?.ok_or(Failure::Call("get", cuda_abi::nvml::NVML_ERROR_NOT_FOUND, "the driver took the limit and reads none back".into()))?;
        Ok((limit.hard, limit.used))
    }
}

/// Why a container has no driver limit on a GPU.
enum Failure {
    /// The GPU (or the node) takes none: said once for the GPU, not per container.
    NotInForce(String),
    /// A call failed: (call, result code, NVML's text).
    Call(&'static str, nvmlReturn_t, String),
}

/// A cgroup's sysfs directory: `root` joined with the path relative to it.
fn cgroup_path(root: &Path, cgroup: &str) -> PathBuf {
    root.join(cgroup.trim_start_matches('/'))
}
