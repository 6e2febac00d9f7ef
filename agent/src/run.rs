//! `vramguard run`: loads the eBPF programs ([`kernel::load`]), then wires the agent's tasks
//! and waits for SIGTERM or SIGINT, or for any task's end. Each task owns its state and lives
//! in its room; this module only starts them under their names ([`Tasks`]) and connects them
//! with bounded channels and watches:
//!
//! | task | owns | does | tenants can lengthen it |
//! |---|---|---|---|
//! | health ([`serve::health`]) | its listener | `/healthz`, `/readyz` from the tasks' heartbeats | no |
//! | kernel ([`kernel::task`]) | the programs, accounting maps, exit ring, cgroup limits, programs' log | drains exits, sweeps records, pushes limits, attaches probes for discovery | no |
//! | reclaim ([`ledgers::task`]) | the watched ledgers, the reclaimer | scans `--ledger-dir`, frees dead processes' slots | within per-ledger budgets |
//! | reconcile ([`reconcile::task`]) | reconciler, charges, metrics registry | passes, charges, metrics page, audit snapshots | yes (bounded per ledger) |
//! | driver ([`driver::task`]) | NVML, its reader thread | reads every device's processes once a second, within a budget | no |
//! | driver-limits ([`driver_limits`]) | its NVML, the limits thread | `--nri`: each provisioned container's quota set in the driver (r615+) and read back, once a second and at StartContainer | no |
//! | inventory ([`inventory::Tracker`]) | nothing | the node's GPUs from the driver's view, for the DRA driver and the NRI side | no |
//! | discovery ([`discovery::task`]) | discovery state | finds libcuda files, asks the kernel task to probe them | yes (bounded per file) |
//! | nri ([`provision::nri`]) | its connection | answers the runtime within [`NRI_DEADLINE`] | no |
//! | publish ([`provision`]) | nothing | hands the provisioned containers' pins and limits on | no |
//! | pod-cache, capacity ([`provision::kube`]) | their watch, their patch | `--kube`: the node's pods, its advertised capacity | no |
//! | dra-plugin ([`crate::dra::plugin`]) | its sockets, the prepared claims | `--dra`: the kubelet's prepare and unprepare, each claim bounded | no |
//! | dra-slices ([`crate::dra::slices`]) | the published pool | `--dra`: the node's GPUs as a ResourceSlice pool | no |
//! | metrics ([`serve::http`]), control ([`serve::control`]) | their listeners | `/metrics`; audits handed to reconcile | no |
//!
//! No task ends while the agent runs: the first that does (returns, fails or panics) stops
//! the agent, which exits non-zero naming it, so that the kubelet restarts it at once. The
//! stop gives each task a deadline and aborts it past it (a stuck task cannot hold it): the
//! reconcile task first (it frees the agent's charges), with the kernel task (its programs
//! go with it: the kernel waits a grace period for each link, at once for the uprobe_multi
//! links, on a thread of its own that the process waits for), then the others (the reclaim
//! task frees whatever of the agent's slots is left).
//!
//! Blocking and tenant-sized work runs on tokio's blocking pool (bounded in `main`), the
//! task's state moved there and back; the critical tasks (health, kernel, reclaim, NRI) never
//! wait for a reconcile pass, a discovery scan or a metrics render.
use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::{anyhow, bail, Context, Result};
use tokio::{
    signal::unix::{signal, SignalKind},
    sync::{mpsc, watch, Notify},
};
use tracing::{error, info, warn};

use crate::{
    driver::{self, task::Driver, DriverView},
    driver_limits,
    inventory,
    discovery::{
        self,
        task::{Found, RemoteAttacher, Scanner},
        Caps, Discovery,
    },
    kernel::{self, enforce},
    ledgers::{self, charge::{Charger, Charging}, reclaim::Reclaimer, task::Reclaim, Ledgers, Limits},
    preflight,
    provision::{self, ProvisionArgs, Provisioner},
    reconcile::{
        self,
        metrics::Metrics,
        task::{not_ready, Judge, Provisioning},
        Reconciler,
    },
    serve::{self, control, health::Health, Publisher},
    task::{Liveness, Tasks},
};

/// How long the runtime's NRI calls wait at most for the agent (the runtime's own limit is 2 s).
const NRI_DEADLINE: Duration = Duration::from_millis(1500);

/// Requests for the kernel task's view waiting at once (the reconcile task asks one at a time).
const KERNEL_REQUESTS: usize = 4;

/// Exits waiting for the reclaim task (past it, an exit is dropped and its process found dead
/// by the next sweep, within `--ledger-scan-ms`).
const EXIT_QUEUE: usize = 4096;

/// Discovery's attach requests waiting for the kernel task (discovery asks one at a time).
const ATTACH_REQUESTS: usize = 1;

/// How long the stop waits for the reconcile task (it frees the agent's charges), the other
/// tasks (together) and the kernel task (its programs go with it) before aborting them: well
/// within the kubelet's grace period (30 s by default), whatever state a task is in.
const STOP_RECONCILE: Duration = Duration::from_millis(1500);
const STOP_OTHERS: Duration = Duration::from_millis(1500);
/// (A kernel task that runs ends at once when told: it is past this only if stuck.)
const STOP_KERNEL: Duration = Duration::from_millis(300);

/// `vramguard audit` requests waiting for the reconcile task.
const AUDIT_QUEUE: usize = 16;

/// How long the kernel task may go without coming round its loop before `/healthz` fails (it
/// comes round at every drain, 100 ms by default).
const KERNEL_ALLOWED: Duration = Duration::from_secs(10);

/// ... the reclaim task (a sweep is bounded: a worker deadline and a budget per ledger, every
/// ledger in parallel).
const RECLAIM_ALLOWED: Duration = Duration::from_secs(20);

/// ... the reconcile and discovery tasks, whose steps tenants can lengthen within their
/// budgets: they fail health only when really stuck.
const TENANT_WORK_ALLOWED: Duration = Duration::from_secs(300);

/// ... the driver task (it never waits for NVML: a read past its budget is reported `hung`).
const DRIVER_ALLOWED: Duration = Duration::from_secs(10);

/// The eBPF object built by `cargo xtask build-ebpf`, embedded at build time.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vramguard.bpf.o"));

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// A libcuda file to probe (repeatable). Added to those found by discovery.
    #[arg(long = "libcuda", value_name = "PATH")]
    pub libcuda: Vec<PathBuf>,
    /// Probe only the --libcuda files: do not scan processes and the usual install paths.
    #[arg(long)]
    pub no_discover: bool,
    /// The host's root directory as the agent sees it (the DaemonSet mounts the host's `/`
    /// read-only at `/host`): the driver's libcuda and NVML are looked for at the known
    /// install directories under it (the GPU operator's `/run/nvidia/driver` first, then
    /// Debian's, RHEL's, GKE's, ...), symlinks resolved inside it; the one found is logged and
    /// in `vramguard audit`. Default: `/` (an agent running on the host).
    #[arg(long, default_value = "/", value_name = "DIR")]
    pub host_root: PathBuf,
    /// At most this many libcuda files found in one container's (cgroup's) processes get
    /// probes; more are logged once and counted.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub max_probed_per_container: usize,
    /// At most this many libcuda files found in processes get probes on the node
    /// (`--libcuda` files and those at the usual install paths are not counted).
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub max_probed_files: usize,
    /// How the probes are linked in the kernel: `auto`, one uprobe_multi link per program and
    /// file where the kernel has them (Linux 6.6 and later; removed in about 0.1 s at a stop),
    /// else a perf event per probe; `perf`, a perf event per probe always (a libcuda's 28 take
    /// about 3 s to remove, one at a time across the node). `vramguard audit` says which each
    /// file got.
    #[arg(long, value_enum, default_value_t = kernel::probes::LinkKind::Auto, value_name = "KIND")]
    pub uprobe_links: kernel::probes::LinkKind,
    /// On a hybrid cgroup node (controllers on cgroup v1, cgroup2 mounted beside them), allow
    /// `--enforce signal`: the operator states that the container runtime places every
    /// container in a cgroup2 group of its own (as systemd-managed runtimes do).
    #[arg(long)]
    pub cgroup2_separates_containers: bool,
    /// How often to look for libcuda files not probed yet in the maps of the processes that
    /// appeared in the last minute, in milliseconds (every 10th time in those of every process).
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub rescan_ms: u64,
    /// How often discovery reads every process's maps however quiet the kernel is, in
    /// milliseconds: the safety net for an executable mapping no event announced (between
    /// two, only the processes the kernel names are read, every --rescan-ms).
    #[arg(long, default_value_t = discovery::RESCAN_EVERY.as_millis() as u64, value_name = "MS")]
    pub full_rescan_ms: u64,
    /// How often to drain the event ring buffer, in milliseconds (exits wake the agent at
    /// once, and their records are swept then); on an idle node the period doubles after each
    /// drain that finds nothing, up to 1 s.
    #[arg(long, default_value_t = 100, value_name = "MS")]
    pub drain_ms: u64,
    /// How often to check whether exits or new records' keys were lost (then every allocation
    /// record is swept once) and, if the cgroup tree changed, to delete removed cgroups' map
    /// entries, in milliseconds (an exit sweeps its own process's records at once).
    #[arg(long, default_value_t = 5000, value_name = "MS")]
    pub sweep_ms: u64,
    /// The control socket `vramguard audit` connects to.
    #[arg(long, default_value = control::DEFAULT_SOCKET, value_name = "PATH")]
    pub socket: PathBuf,
    /// Watch the ledgers in this directory and its direct subdirectories (one per container):
    /// record their processes' host pids and reclaim the slots of processes that are gone.
    #[arg(long, value_name = "DIR")]
    pub ledger_dir: Option<PathBuf>,
    /// How often to re-scan --ledger-dir and sweep its ledgers for dead processes, in
    /// milliseconds (exit events trigger a sweep at once).
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub ledger_scan_ms: u64,
    /// Most ledgers watched in all (files past it are skipped, with the reason).
    #[arg(long, default_value_t = Limits::default().max_ledgers, value_name = "NUM")]
    pub max_ledgers: usize,
    /// Most files considered in one directory under --ledger-dir (a container's).
    #[arg(long, default_value_t = Limits::default().max_per_dir, value_name = "NUM")]
    pub max_ledgers_per_dir: usize,
    /// Largest ledger geometry the agent works on: process slots...
    #[arg(long, default_value_t = Limits::default().max_slots, value_name = "NUM")]
    pub max_ledger_slots: u32,
    /// ... allocation records ...
    #[arg(long, default_value_t = Limits::default().max_records, value_name = "NUM")]
    pub max_ledger_records: u32,
    /// ... and file size in bytes. A larger ledger is skipped, with the reason.
    #[arg(long, default_value_t = Limits::default().max_bytes, value_name = "BYTES")]
    pub max_ledger_bytes: u64,
    /// Serve Prometheus metrics (`/metrics`), `/healthz` and `/readyz` on this address (port
    /// 0: any free port; the bound address is logged and reported by `vramguard audit`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Serve `/healthz` and `/readyz` on this address, on a listener of their own that no
    /// scrape and no tenant's work can delay (port 0: any free port; the bound address is
    /// logged and reported by `vramguard audit`). The DaemonSet's probes point there.
    #[arg(long, value_name = "ADDR")]
    pub health_addr: Option<SocketAddr>,
    /// Also publish the ledgers' used and limit bytes under HAMi's monitor names
    /// (`hami_vgpu_memory_used_bytes`, `hami_vgpu_memory_limit_bytes`), for its dashboards.
    #[arg(long)]
    pub hami_metrics: bool,
    /// Leave the driver's own per-cgroup limits (NVIDIA r615+) alone: neither set nor read,
    /// every provisioned container held by the hook, the probes and `--enforce` as on an older
    /// driver (docs/provisioning.md, "The driver's own limit").
    #[arg(long)]
    pub no_driver_limits: bool,
    /// A limits file (`CGROUP_PATTERN LIMIT` per line) for workloads that bypass the hook;
    /// its cgroups' allocations over their limit are handled as `--enforce` says.
    #[arg(long, value_name = "FILE")]
    pub limits: Option<PathBuf>,
    /// What the probes do with an allocation over its cgroup's limit.
    #[arg(long, value_enum, default_value = "audit")]
    pub enforce: enforce::Mode,
    /// The signal `--enforce signal` sends (default SIGKILL).
    #[arg(long, default_value_t = 9, value_name = "NUM")]
    pub signal: i32,
    /// How far a process's ledger charge and its eBPF-observed usage may differ (bytes, or
    /// k/m/g/t): beyond it the process is `drift` after the grace period, or `tampered` at
    /// once when the ledger is the lower.
    #[arg(long, default_value = "64m", value_name = "SIZE", value_parser = parse_threshold)]
    pub drift_threshold: u64,
    /// How long a difference beyond --drift-threshold (ledger ahead) may last before the
    /// process is reported `drift`, in milliseconds.
    #[arg(long, default_value_t = reconcile::DEFAULT_GRACE_MS, value_name = "MS")]
    pub drift_grace_ms: u64,
    /// The NVML library to read each process's GPU memory from (default: `libnvidia-ml.so.1`
    /// beside each --libcuda file, else at the usual install paths). Without one the agent runs
    /// on the probes and the ledgers alone, and says so.
    #[arg(long, value_name = "PATH")]
    pub nvml: Option<PathBuf>,
    /// Each GPU's device file, `{minor}` standing for NVML's minor number of the GPU: a driver
    /// row is joined only with a process holding it open (docs/security.md).
    #[arg(long, default_value = driver::task::DEFAULT_DEVICE_FILE, value_name = "PATTERN")]
    pub gpu_device_file: String,
    /// What the context of any process, hooked or not, and what comes with it (module images,
    /// local memory) may hold on one device (bytes, or k/m/g/t): beyond it plus a 2 MiB page,
    /// memory the driver reports and the probes and the ledger do not explain makes the
    /// process `unprobed` (docs/gpu.md: 518 MiB of context and up to 310 MiB of kernels and
    /// library handles for PyTorch jobs loading modules lazily, the CUDA default; about
    /// 1.5 GiB more with `CUDA_MODULE_LOADING=EAGER`).
    #[arg(long, default_value = "1g", value_name = "SIZE", value_parser = parse_threshold)]
    pub context_allowance: u64,
    /// Live allocation records the probes keep across the node (the kernel map's size; each
    /// takes about 100 bytes of kernel memory while it exists).
    #[arg(long, default_value_t = common::DEFAULT_MAX_ALLOCS, value_name = "NUM")]
    pub max_alloc_records: u32,
    /// Live allocation records one cgroup may have: past it, its allocations are still
    /// charged but not recorded (their frees go unseen until the process exits) and the
    /// cgroup is reported `capped`, so one tenant cannot fill the node's records.
    #[arg(long, default_value_t = common::DEFAULT_RECORDS_PER_CGROUP, value_name = "NUM")]
    pub max_alloc_records_per_cgroup: u32,
    /// Records of freed device pointers one process may keep for the driver's reuse of the
    /// address (the next allocation there takes the record over: no map insert or delete);
    /// they count against the cgroup's records, and none is kept while the cgroup holds half
    /// its cap. 0 keeps none.
    #[arg(long, default_value_t = common::spare::MAX_SPARES_PER_PROCESS, value_name = "NUM")]
    pub max_spare_records_per_process: u64,
    /// Bytes of the ring buffer that carries the keys of new allocation records to the agent
    /// (24 bytes a record, read at every drain); a record that finds it full makes one sweep
    /// of every record due at the next --sweep-ms tick. A power of two, at least 4096.
    #[arg(long, default_value_t = common::journal::BYTES, value_name = "BYTES")]
    pub journal_bytes: u32,
    #[command(flatten)]
    pub provision: ProvisionArgs,
    #[command(flatten)]
    pub dra: crate::dra::plugin::DraArgs,
    #[command(flatten)]
    pub dra_slices: crate::dra::slices::SliceArgs,
    /// Test only: a fault to inject (repeatable; see `agent/src/fault.rs`).
    #[arg(long = "fault", hide = true, value_name = "KIND:WHERE", value_parser = crate::fault::parse)]
    pub faults: Vec<crate::fault::Fault>,
}

fn parse_threshold(text: &str) -> Result<u64, String> {
    cuda_abi::parse_size(text).ok_or_else(|| format!("{text:?} is not a size (bytes, or a number with k, m, g or t)"))
}


pub async fn run(args: RunArgs) -> Result<()> {
    if args.rescan_ms == 0 || args.full_rescan_ms == 0 || args.drain_ms == 0 || args.sweep_ms == 0 || args.ledger_scan_ms == 0 {
        bail!("--rescan-ms, --full-rescan-ms, --drain-ms, --sweep-ms and --ledger-scan-ms must be at least 1");
    }
    if args.max_alloc_records_per_cgroup == 0 || args.max_alloc_records_per_cgroup > args.max_alloc_records {
        bail!(
            "--max-alloc-records-per-cgroup ({}) must be between 1 and --max-alloc-records ({})",
            args.max_alloc_records_per_cgroup,
            args.max_alloc_records
        );
    }
    crate::fault::arm(args.faults.clone());
    // Every task goes here, under its name: the first to end ends the agent.
    let mut tasks = Tasks::default();
    // Health first: it answers while the agent starts, and whatever it does after.
    let liveness = Liveness::new();
    let health = Health::new(liveness.clone());
    let health_connections = serve::http::Connections::named(
        "vramguard_health_connections_total",
        "Connections to --health-addr by how they ended: answered, closed, refused (past the cap), evicted (idle past the cap), timed_out, bad_request, error",
    )?;
    let health_addr = match args.health_addr {
        Some(addr) => {
            let site = serve::http::Site::Health(health.clone());
            let (bound, serving) = serve::http::serve_site(addr, serve::http::LIMITS, site, health_connections.clone()).await?;
            tasks.spawn_abortable("health", serving);
            info!(health_addr = %bound, "serving /healthz and /readyz");
            Some(bound)
        }
        None => None,
    };
    let platform = preflight::check()?;
    let layout = preflight::cgroup_layout();
    if args.enforce == enforce::Mode::Signal {
        preflight::allow_signal_enforcement(&layout, args.cgroup2_separates_containers)?;
    }
    let settings = kernel::load::Settings {
        max_alloc_records: args.max_alloc_records,
        records_per_cgroup: u64::from(args.max_alloc_records_per_cgroup),
        spares_per_process: args.max_spare_records_per_process,
        journal_bytes: args.journal_bytes,
        enforce: args.enforce,
        signal: args.signal,
        limits: args.limits.clone(),
        ledger_limits: args.ledger_dir.is_some(),
        links: args.uprobe_links,
    };
    let mut kernel = kernel::load::load(&settings, &platform, EBPF_OBJECT)?;

    let mut discovery = Discovery::new(Caps { per_container: args.max_probed_per_container, per_node: args.max_probed_files })
        .rescan_every(Duration::from_millis(args.full_rescan_ms));
    for path in &args.libcuda {
        discovery.add_operator_file(path, &mut kernel.attacher())?;
    }
    // The driver's libraries where the host installed them (none looked for with
    // --no-discover: the operator named every file).
    let installed = (!args.no_discover).then(|| driver::install::find(&args.host_root));
    if let Some(found) = &installed {
        match &found.libcuda {
            Some(_) => info!(host_root = %args.host_root.display(), "the driver's libraries: {}", found.describe()),
            None => warn!(host_root = %args.host_root.display(), "the driver's libraries: {}", found.describe()),
        }
    }
    if !args.no_discover {
        discovery.add_well_known(installed.as_ref().and_then(|found| found.libcuda.as_deref()), &mut kernel.attacher());
        // The first scan, on the blocking pool (health answers meanwhile): the agent starts
        // with what the running processes map already probed.
        let scanned = tokio::task::spawn_blocking(move || {
            discovery.scan(None, &mut kernel.attacher());
            (discovery, kernel)
        });
        (discovery, kernel) = scanned.await.context("the first discovery scan failed")?;
    }
    if discovery.probed().next().is_none() {
        bail!(
            "no libcuda found: none given with --libcuda, none mapped by a running process, none \
             at {} and {} ({} files skipped: see the log). Give --host-root DIR (the host's / as the agent sees it) \
             or --libcuda PATH (the host's libcuda.so.1)",
            discovery::well_known_paths(),
            installed.as_ref().map_or_else(|| "(--no-discover)".to_string(), driver::install::Found::describe),
            discovery.stats().skipped.len()
        );
    }

    let ledger_limits = Limits {
        max_ledgers: args.max_ledgers,
        max_per_dir: args.max_ledgers_per_dir,
        max_slots: args.max_ledger_slots,
        max_records: args.max_ledger_records,
        max_bytes: args.max_ledger_bytes,
    };
    if args.ledger_dir.is_some() {
        ledgers::worker::check().context(
            "--ledger-dir needs ledger workers, which switch to uid 65534 and install a seccomp filter before they \
             touch a ledger: give the agent CAP_SETUID and CAP_SETGID, and a seccomp profile that allows seccomp(2) \
             (docs/security.md)",
        )?;
    }
    let mut ledgers = args.ledger_dir.clone().map(|dir| Ledgers::with_limits(dir, ledger_limits));
    // The node's GPUs, one inventory for the slices, prepare, health and the NRI side.
    let (gpus_tx, gpus_rx) = watch::channel(None);
    let (limiter, limits_queue) = driver_limits::channel();
    let (provisioner, capacity) = provisioner(&args, gpus_rx.clone(), limiter).await?.unzip();
    let mut capacity = capacity.flatten();
    let metrics = Metrics::new(args.hami_metrics)?;
    let mut judge = Judge {
        reconciler: Reconciler::new(reconcile::Config {
            threshold: args.drift_threshold,
            grace: Duration::from_millis(args.drift_grace_ms),
            context_allowance: args.context_allowance,
        }),
        charging: Charging::start(Charger::new()).context("cannot start the thread that makes the agent's charges")?,
        metrics,
        passes: 0,
        view: None,
    };
    for family in provisioner.iter().flat_map(|p| p.counters().collectors()) {
        judge.metrics.register(family)?;
    }

    // The wiring: every task owns its state; these are all they share.
    // The reconcile task is told to stop first (it frees the agent's charges), with the kernel
    // task (detaching the probes takes the kernel seconds: it starts at once); the others after.
    let (stop_first_tx, stop_first) = watch::channel(false);
    let (stop_tx, stop) = watch::channel(false);
    let changed = Arc::new(Notify::new());
    let (kernel_tx, kernel_rx) = mpsc::channel(KERNEL_REQUESTS);
    let (attach_tx, attach_rx) = mpsc::channel(ATTACH_REQUESTS);
    let (exits_tx, exits_rx) = mpsc::channel(EXIT_QUEUE);
    let (ledger_limits_tx, ledger_limits_rx) = watch::channel(BTreeMap::new());
    let (holders_tx, holders_rx) = watch::channel(Arc::new(BTreeMap::new()));
    let (found_tx, found_rx) = watch::channel(Arc::new(Found::of(&discovery)));
    let (audits_tx, audits_rx) = mpsc::channel(AUDIT_QUEUE);
    let first_view = DriverView { status: driver::DriverStatus { install: installed.as_ref().map(driver::install::Found::describe), ..Default::default() }, ..Default::default() };
    let (driver_tx, driver_rx) = watch::channel(Arc::new(first_view));
    let mut provisioned_limits = None;
    let mut pins = None;
    let provisioning = match provisioner.as_ref() {
        Some(provisioner) => {
            let (pins_tx, pins_rx) = watch::channel(provisioner.pins());
            let (limits_tx, limits_rx) = watch::channel(provisioner.cgroup_limits());
            if let Some(ledgers) = ledgers.as_mut() {
                ledgers.set_pins(provisioner.pins());
            }
            if let Some(limits) = kernel.limits.as_mut() {
                limits.set_provisioned(provisioner.cgroup_limits());
            }
            tasks.spawn_abortable("publish", provisioner.clone().publish(pins_tx, limits_tx));
            (pins, provisioned_limits) = (Some(pins_rx), Some(limits_rx));
            let (connected_tx, connected) = watch::channel(false);
            tasks.spawn_abortable("nri", provision::nri::run(nri_config(&args.provision), provisioner.clone(), connected_tx));
            if let Some(alive) = provisioner.kube_pods().and_then(provision::kube::PodCache::take_alive) {
                tasks.spawn_abortable("pod-cache", alive.ended());
            }
            Some(Provisioning { provisioner: provisioner.clone(), connected })
        }
        None => None,
    };
    if let Some(alive) = capacity.as_mut().and_then(provision::kube::Capacity::take_alive) {
        tasks.spawn_abortable("capacity", alive.ended());
    }
    let dra_node = if args.dra.dra {
        let connected = provisioning.as_ref().map(|p| p.connected.clone());
        crate::dra::plugin::Node::of(&args.provision).await?.with_ledgers(provisioner.clone()).with_nri(connected)
    } else {
        Default::default()
    };
    let mut held_whole = None;
    if let Some(plugin) = crate::dra::plugin::wire(&args.dra, dra_node.clone(), gpus_rx.clone(), driver_rx.clone(), stop.clone()).await? {
        for family in plugin.collectors {
            judge.metrics.register(family)?;
        }
        held_whole = Some(plugin.held_whole);
        tasks.spawn("dra-plugin", plugin.task);
    }

    let ledgers_rx = ledgers.map(|ledgers| {
        let (published_tx, published_rx) = watch::channel(Arc::new(ledgers.clone()));
        let wiring = ledgers::task::Wiring {
            exits: exits_rx,
            pins,
            published: published_tx,
            changed: changed.clone(),
            driver: Some(driver_rx.clone()),
            reclaims: judge.metrics.reclaims(),
            heartbeat: liveness.register("reclaim", RECLAIM_ALLOWED),
            stop: stop.clone(),
        };
        let task = Reclaim { ledgers, reclaimer: Reclaimer::new(true) };
        tasks.spawn("reclaim", task.run(Duration::from_millis(args.ledger_scan_ms), wiring));
        published_rx
    });

    // The metrics listener serves the pages the reconcile task renders (the first one before
    // it listens) and rings `render_wanted` when a scrape finds the page older than the last
    // pass.
    let (metrics_addr, publisher) = match args.metrics_addr {
        Some(addr) => {
            let connections = serve::http::Connections::new()?;
            judge.metrics.register(connections.collector())?;
            judge.metrics.register(health_connections.collector())?;
            let first = judge.render(None, &found_rx.borrow(), provisioning.as_ref());
            let render_wanted = Arc::new(Notify::new());
            let (publisher, mut board) = Publisher::new(first, render_wanted.clone());
            board.liveness = Some(liveness.clone());
            let (bound, serving) = serve::http::serve(addr, serve::http::LIMITS, board, connections).await?;
            tasks.spawn_abortable("metrics", serving);
            info!(metrics_addr = %bound, limits = ?serve::http::LIMITS, "serving /metrics, /healthz and /readyz");
            (Some(bound), Some((publisher, render_wanted)))
        }
        None => (None, None),
    };
    // The driver's own per-cgroup limits (r615+), for the provisioned containers.
    let (driver_limits_tx, driver_limits_rx) = watch::channel(crate::driver_limits::DriverLimits::default());
    let (ruled_tx, ruled_rx) = watch::channel(BTreeMap::<String, u64>::new());
    let driver_limits_rx = match provisioner.as_ref().filter(|_| !args.no_driver_limits) {
        Some(provisioner) => {
            let metrics = driver_limits::Metrics::new()?;
            for family in metrics.collectors() {
                judge.metrics.register(family)?;
            }
            let wanted = provisioner.clone();
            let task = driver_limits::Task {
                candidates: driver::locate(args.nvml.as_deref(), &args.libcuda, installed.as_ref()),
                cgroup_root: crate::cgroup::cgroup2_mount(),
                // The provisioned containers', then the limits file's other cgroups'.
                wants: Box::new(move || {
                    let mut wants = wanted.driver_wants();
                    let provisioned: std::collections::BTreeSet<String> = wants.iter().map(|w| w.cgroup.clone()).collect();
                    let ruled = ruled_rx.borrow();
                    wants.extend(ruled.iter().filter(|(cgroup, _)| !provisioned.contains(*cgroup)).map(|(cgroup, limit)| driver_limits::Want::ruled(cgroup, *limit)));
                    wants
                }),
                changes: provisioner.changes(),
                metrics,
            };
            tasks.spawn("driver-limits", task.run(limits_queue, driver_limits_tx, liveness.register("driver-limits", driver_limits::ALLOWED), stop.clone()));
            Some(driver_limits_rx)
        }
        None => None,
    };
    let kernel_wiring = kernel::task::Wiring {
        requests: kernel_rx,
        attach: attach_rx,
        ledger_limits: ledger_limits_rx,
        holders: holders_rx,
        provisioned: provisioned_limits,
        driver_limits: driver_limits_rx.clone(),
        ruled: Some(ruled_tx),
        exits: exits_tx,
        changed: changed.clone(),
        heartbeat: liveness.register("kernel", KERNEL_ALLOWED),
        stop: stop_first.clone(),
    };
    let every = kernel::task::Every {
        drain: Duration::from_millis(args.drain_ms),
        sweep: Duration::from_millis(args.sweep_ms),
        limits: Duration::from_millis(args.rescan_ms),
    };
    let kernel_told = kernel.exec_mapped.take();
    tasks.spawn("kernel", kernel.run(every, kernel_wiring));
    let probed_files = discovery.probed().count();
    let scanner = Scanner { discovery, attacher: RemoteAttacher(attach_tx), told: kernel_told };
    tasks.spawn(
        "discovery",
        scanner.run(
            Duration::from_millis(args.rescan_ms),
            !args.no_discover,
            found_tx,
            liveness.register("discovery", TENANT_WORK_ALLOWED),
            stop.clone(),
        ),
    );
    let read_seconds = driver::task::read_seconds()?;
    judge.metrics.register(Box::new(read_seconds.clone()))?;
    let driver_task = Driver {
        candidates: driver::locate(args.nvml.as_deref(), &args.libcuda, installed.as_ref()),
        read_seconds,
        device_file: args.gpu_device_file.clone(),
        state_dir: Some(args.provision.state_dir.clone()),
    };
    tasks.spawn_unit("driver", driver_task.run(driver_tx, liveness.register("driver", DRIVER_ALLOWED), stop.clone()));
    let reserve = if args.dra.dra { args.dra_slices.dra_memory_reserve } else { 0 };
    tasks.spawn("inventory", inventory::Tracker { flag: args.provision.gpu_memory.clone(), reserve, device_files: host_device_files(&args.host_root) }.run(driver_rx.clone(), gpus_tx, stop.clone()));
    let mut dra_status = None;
    if args.dra.dra {
        let slices = crate::dra::slices::Publisher::start(&args.dra_slices, &dra_node, liveness.register("dra-slices", crate::dra::slices::ALLOWED)).await?;
        for family in slices.collectors() {
            judge.metrics.register(family)?;
        }
        dra_status = Some(slices.status());
        let held_whole = held_whole.take().context("--dra: the plugin is wired before the slices")?;
        tasks.spawn("dra-slices", slices.run(gpus_rx.clone(), held_whole, stop.clone()));
    }
    let judge_wiring = reconcile::task::Wiring {
        kernel: kernel_tx,
        ledgers: ledgers_rx,
        found: found_rx.clone(),
        driver: driver_rx,
        ledger_limits: ledger_limits_tx,
        holders: holders_tx,
        publisher,
        changed,
        audits: audits_rx,
        provisioning: provisioning.clone(),
        dra: dra_status,
        driver_limits: driver_limits_rx,
        metrics_addr,
        health_addr,
        heartbeat: liveness.register("reconcile", TENANT_WORK_ALLOWED),
        stop: stop_first,
    };
    tasks.spawn("reconcile", judge.run(judge_wiring));
    let listener = control::bind(&args.socket)?;
    tasks.spawn_abortable("control", control::listen(listener, audits_tx));
    let _ = health.ready.set(Box::new(move || not_ready(&found_rx.borrow(), provisioning.as_ref())));
    info!(socket = %args.socket.display(), files = probed_files, cgroups = ?layout, tasks = ?tasks.names(), "vramguard agent running");

    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    // Until a signal, or the end of any task: none ends by itself while the agent runs, so
    // an end (a return, an error, a panic) stops the agent, saying which task and why, and
    // the kubelet restarts it at once.
    let ended = tokio::select! {
        _ = sigterm.recv() => None,
        _ = sigint.recv() => None,
        ended = tasks.first_end() => Some(ended),
    };
    match &ended {
        None => info!("stopping: SIGTERM or SIGINT"),
        Some(ended) => error!(task = ended.task, "stopping: {ended}"),
    }
    // The stop: the reconcile task frees the agent's charges while the ledgers are still
    // open, as the kernel task starts detaching the probes; then the others stop (the reclaim
    // task frees whatever of the agent's slots is left); then the kernel task's end is
    // awaited. Each is given a deadline and aborted past it, so a stuck task cannot hold the
    // stop.
    let _ = stop_first_tx.send(true);
    let mut late = Vec::new();
    late.extend(tasks.stop("reconcile", STOP_RECONCILE).await);
    let _ = stop_tx.send(true);
    late.extend(tasks.stop_all_but("kernel", STOP_OTHERS).await);
    late.extend(tasks.stop("kernel", STOP_KERNEL).await);
    for stopped in late.iter().filter(|e| e.failure.is_some()) {
        warn!(task = stopped.task, "while stopping: {stopped}");
    }
    let _ = std::fs::remove_file(&args.socket);
    if let Some(ended) = ended {
        bail!("{ended}: the agent stopped (its probes detached, its charges released)");
    }
    info!("vramguard agent stopped");
    Ok(())
}

/// The provisioner `--nri` asks for, with its quota sources, and the node's advertised
/// capacity (with `--kube`, without `--dra`: the inventory's GPUs); `None` without `--nri`.
async fn provisioner(args: &RunArgs, gpus: inventory::Shared, limiter: driver_limits::Limiter) -> Result<Option<(Arc<Provisioner>, Option<provision::kube::Capacity>)>> {
    let wanted = &args.provision;
    if !wanted.nri {
        if args.dra.dra {
            bail!(
                "--dra needs --nri: a claim's GPU is handed to its containers only with the ledger, hook and limit the NRI side gives \
                 them (without it they would get the GPU and nothing behind their claim)"
            );
        }
        if wanted.quota_file.is_some() || wanted.quota_from_annotation || wanted.refuse_overcommit || (wanted.kube.kube && !args.dra.dra) {
            bail!("--kube (without --dra), --quota-file, --quota-from-annotation and --refuse-overcommit provision containers: they need --nri");
        }
        return Ok(None);
    }
    let Some(ledger_dir) = args.ledger_dir.as_deref() else {
        bail!("--nri needs --ledger-dir: the ledgers of provisioned containers are created and watched there");
    };
    let file = wanted.quota_file.as_deref().map(provision::quota::QuotaFile::open).transpose().map_err(|e| anyhow!(e))?;
    let (kube, capacity) = match wanted.kube.config().await? {
        Some(config) => {
            let node = wanted.kube.node()?;
            let client = config.client()?;
            let pods = provision::kube::PodCache::start(client.clone(), node)?;
            let capacity = if args.dra.dra {
                info!("--dra: the node's GPUs are published as DRA devices; the node-wide vramguard.io/gpu-memory is not advertised");
                None
            } else {
                let every = wanted.kube.capacity_every();
                Some(provision::kube::Capacity::start(client, node, gpus.clone(), wanted.kube.overcommit, every)?)
            };
            (Some(pods), capacity)
        }
        None => (None, None),
    };
    let sources = provision::Sources { kube, file, annotation: wanted.quota_from_annotation };
    if sources.kube.is_none() && sources.file.is_none() && !sources.annotation {
        bail!("--nri needs a quota source: --kube, --quota-file FILE or --quota-from-annotation");
    }
    let mut provisioner = Provisioner::new(wanted, ledger_dir, sources).map_err(|e| anyhow!("cannot provision containers: {e}"))?;
    if !args.no_driver_limits {
        provisioner = provisioner.with_driver_limits(limiter);
    }
    // The NRI side sizes the node by the agent's inventory (NVML's; --gpu-memory's where NVML
    // is absent), as the DRA driver does.
    let provisioner = provisioner.with_inventory(gpus, host_device_files(&args.host_root));
    Ok(Some((Arc::new(provisioner), capacity)))
}

/// The host's GPU device files, `{minor}` standing for the number: `/dev/nvidia{minor}` under
/// `--host-root` (the host's, whatever the runtime gave the agent's container), and the GPU
/// operator's driver root's (its driver container makes the GPUs' nodes there, the host's
/// `/dev` getting the control nodes only). The node's GPUs are counted by them where NVML has
/// not said.
fn host_device_files(host_root: &std::path::Path) -> Vec<String> {
    [host_root.join("dev"), host_root.join(driver::install::OPERATOR_ROOT).join("dev")]
        .iter()
        .map(|dev| format!("{}/nvidia{{minor}}", dev.display()))
        .collect()
}

/// The NRI plugin's settings (it reconnects by itself for as long as the agent runs).
fn nri_config(args: &ProvisionArgs) -> provision::nri::Config {
    provision::nri::Config {
        socket: args.nri_socket.clone(),
        name: "vramguard".into(),
        index: "10".into(),
        handler_deadline: NRI_DEADLINE,
    }
}
