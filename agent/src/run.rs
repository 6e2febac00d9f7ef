//! `vramguard run`: load and attach the eBPF programs, keep the view current, answer the
//! control socket, watch the ledgers under `--ledger-dir` (reclaiming the slots of dead
//! processes on their exit events and every `--ledger-scan-ms`), reconcile the ledgers with
//! the eBPF view (after drains and sweeps, and every second), render the metrics page that
//! `--metrics-addr` serves when a scrape finds it older than the last pass ([`crate::serve`]),
//! forward the eBPF programs' log lines into the agent's log, and detach cleanly on SIGINT or
//! SIGTERM.
use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{programs::TracePoint, EbpfLoader};
use bytes::Bytes;
use tokio::{
    io::unix::AsyncFd,
    net::UnixStream,
    signal::unix::{signal, SignalKind},
    sync::Notify,
    time::{interval, MissedTickBehavior},
};
use tracing::{info, warn};

use crate::{
    kernel::accounting::Accounting,
    cgroup::CgroupNames,
    ledgers::charge::Charger,
    kernel::enforce,
    serve::control,
    discovery::{self, Caps, Discovery},
    kernel,
    ledgers::{self, Ledgers, Limits, Pin},
    serve::metrics::Metrics,
    preflight,
    kernel::probes::{self, Attacher},
    provision::{self, ProvisionArgs, Provisioner},
    ledgers::reclaim::Reclaimer,
    reconcile::{self, Reconciler},
    serve::{self, Published, Publisher},
    snapshot::Snapshot,
};

/// How often a reconcile pass runs however quiet the node is.
const RECONCILE_EVERY: Duration = Duration::from_secs(1);

/// How long the agent takes at most to answer the runtime's NRI calls (its own limit is 2 s).
const NRI_DEADLINE: Duration = Duration::from_millis(1500);

/// How often an exit event whose process is not a zombie yet is looked at again.
const EXIT_RETRY: Duration = Duration::from_millis(5);

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
    /// At most this many libcuda files found in one container's (cgroup's) processes get
    /// probes; more are logged once and counted.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub max_probed_per_container: usize,
    /// At most this many libcuda files found in processes get probes on the node
    /// (`--libcuda` files and those at the usual install paths are not counted).
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub max_probed_files: usize,
    /// On a hybrid cgroup node (controllers on cgroup v1, cgroup2 mounted beside them), allow
    /// `--enforce signal`: the operator states that the container runtime places every
    /// container in a cgroup2 group of its own (as systemd-managed runtimes do).
    #[arg(long)]
    pub cgroup2_separates_containers: bool,
    /// How often to look for libcuda files not probed yet in the maps of the processes that
    /// appeared in the last minute, in milliseconds (every 10th time in those of every process).
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub rescan_ms: u64,
    /// How often to drain the event ring buffer, in milliseconds (exits wake the agent at
    /// once, and their records are swept then).
    #[arg(long, default_value_t = 100, value_name = "MS")]
    pub drain_ms: u64,
    /// How often to sweep every allocation record for dead processes regardless of exit
    /// events (a fallback for exit events lost to a full ring buffer), in milliseconds.
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
    /// Also publish the ledgers' used and limit bytes under HAMi's monitor names
    /// (`hami_vgpu_memory_used_bytes`, `hami_vgpu_memory_limit_bytes`), for its dashboards.
    #[arg(long)]
    pub hami_metrics: bool,
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
    #[command(flatten)]
    pub provision: ProvisionArgs,
}

fn parse_threshold(text: &str) -> Result<u64, String> {
    cuda_abi::parse_size(text).ok_or_else(|| format!("{text:?} is not a size (bytes, or a number with k, m, g or t)"))
}

enum Wake {
    Stop(&'static str),
    Events,
    Drain,
    Sweep,
    Rescan,
    Ledgers,
    Limits,
    Reconcile,
    ExitRetry,
    Client(UnixStream),
    Render,
    Provisioned,
}

pub async fn run(args: RunArgs) -> Result<()> {
    if args.rescan_ms == 0 || args.drain_ms == 0 || args.sweep_ms == 0 || args.ledger_scan_ms == 0 {
        bail!("--rescan-ms, --drain-ms, --sweep-ms and --ledger-scan-ms must be at least 1");
    }
    if args.max_alloc_records_per_cgroup == 0 || args.max_alloc_records_per_cgroup > args.max_alloc_records {
        bail!(
            "--max-alloc-records-per-cgroup ({}) must be between 1 and --max-alloc-records ({})",
            args.max_alloc_records_per_cgroup,
            args.max_alloc_records
        );
    }
    let platform = preflight::check()?;
    let layout = preflight::cgroup_layout();
    if args.enforce == enforce::Mode::Signal {
        preflight::allow_signal_enforcement(&layout, args.cgroup2_separates_containers)?;
    }
    let records_cap = u64::from(args.max_alloc_records_per_cgroup);
    let (rmdir_root, rmdir_id) = match &platform.rmdir_offsets {
        Ok(offsets) => (offsets.root, offsets.id),
        Err(_) => (0, 0),
    };
    let mut ebpf = EbpfLoader::new()
        .override_global(common::names::GROUP_DEAD_OFFSET, &platform.group_dead_offset, true)
        .override_global(common::names::MAX_RECORDS_PER_CGROUP, &records_cap, true)
        .override_global(common::names::MAX_SPARES_PER_PROCESS, &args.max_spare_records_per_process, true)
        .override_global(common::names::RMDIR_ROOT_OFFSET, &rmdir_root, true)
        .override_global(common::names::RMDIR_ID_OFFSET, &rmdir_id, true)
        .map_max_entries(common::names::ALLOCS, args.max_alloc_records)
        .load(EBPF_OBJECT)
        .context("the kernel refused the eBPF object")?;
    // Before any program runs, so that no line is lost.
    let mut kernel_log = kernel::log::init(&mut ebpf)?;
    let exit: &mut TracePoint = ebpf
        .program_mut(common::names::PROCESS_EXIT)
        .ok_or_else(|| anyhow!("the embedded eBPF object has no `process_exit` program"))?
        .try_into()?;
    exit.load().context("the kernel refused the process-exit program")?;
    exit.attach("sched", "sched_process_exit")
        .context("cannot attach to the sched:sched_process_exit tracepoint")?;
    let ext_exit: &mut TracePoint = ebpf
        .program_mut(common::extmem::names::EXIT)
        .ok_or_else(|| anyhow!("the embedded eBPF object has no `{}` program", common::extmem::names::EXIT))?
        .try_into()?;
    ext_exit.load().context("the kernel refused the external-memory exit program")?;
    ext_exit
        .attach("sched", "sched_process_exit")
        .context("cannot attach the external-memory exit program to sched:sched_process_exit")?;
    match &platform.rmdir_offsets {
        Ok(_) => {
            let rmdir: &mut TracePoint = ebpf
                .program_mut(common::names::CGROUP_RMDIR)
                .ok_or_else(|| anyhow!("the embedded eBPF object has no `cgroup_rmdir` program"))?
                .try_into()?;
            rmdir.load().context("the kernel refused the cgroup-removal program")?;
            rmdir
                .attach("cgroup", "cgroup_rmdir")
                .context("cannot attach to the cgroup:cgroup_rmdir tracepoint")?;
        }
        Err(reason) => warn!(
            %reason,
            "no cgroup:cgroup_rmdir tracepoint: removed cgroups' map entries are deleted by the sweep (--sweep-ms) only"
        ),
    }
    probes::load_programs(&mut ebpf)?;
    match (enforce::deny_support(&mut ebpf), args.enforce) {
        (Ok(()), _) => info!("deny mode: this kernel lets uprobes write registers, but this build does not implement deny yet"),
        (Err(reason), enforce::Mode::Deny) => bail!("--enforce deny is unavailable: {reason}; use --enforce signal or audit"),
        (Err(reason), _) => info!("deny mode unavailable: {reason}"),
    }
    if args.enforce == enforce::Mode::Deny {
        bail!("--enforce deny is not implemented by this build; use --enforce signal or audit");
    }
    if args.enforce != enforce::Mode::Audit && args.limits.is_none() && args.ledger_dir.is_none() {
        bail!("--enforce {} needs limits: --limits FILE and/or --ledger-dir DIR", args.enforce.name());
    }
    let mut limits = if args.limits.is_some() || args.ledger_dir.is_some() {
        Some(enforce::Limits::new(&mut ebpf, args.limits.as_deref(), args.enforce, args.signal)?)
    } else {
        None
    };
    let mut cgroups = CgroupNames::new();
    if let Some(limits) = limits.as_mut() {
        limits.refresh(&mut cgroups);
        info!(mode = ?args.enforce, cgroups = limits.applied(), "cgroup limits pushed to the probes");
    }
    let (mut accounting, exits_ring) = Accounting::new(&mut ebpf, records_cap)?;
    // Exits wake the agent (allocations and frees emit no events: the maps say them).
    // SAFETY: the ring buffer owns its map fd, which stays open and unchanged until the
    // AsyncFd (which owns the ring buffer) is dropped.
    let mut exits = unsafe { AsyncFd::register_with_interest(exits_ring, tokio::io::Interest::READABLE) }
        .map_err(|error| anyhow!("cannot poll the exit ring buffer: {error}"))?;
    info!(
        max_alloc_records = args.max_alloc_records,
        max_alloc_records_per_cgroup = records_cap,
        max_spare_records_per_process = args.max_spare_records_per_process,
        "allocation records: node-wide and per-cgroup caps, spares a process may keep"
    );

    let mut discovery = Discovery::new(Caps { per_container: args.max_probed_per_container, per_node: args.max_probed_files });
    for path in &args.libcuda {
        discovery.add_operator_file(path, &mut Attacher(&mut ebpf))?;
    }
    if !args.no_discover {
        discovery.add_well_known(&mut Attacher(&mut ebpf));
        discovery.scan(&mut Attacher(&mut ebpf));
    }
    if discovery.probed().next().is_none() {
        bail!(
            "no libcuda found: none given with --libcuda, none mapped by a running process, none \
             at {} ({} files skipped: see the log). Give --libcuda PATH (the host's libcuda.so.1)",
            discovery::well_known_paths(),
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
    let (provisioner, _capacity) = provisioner(&args)?.unzip();
    let mut provisioned_changes = provisioner.as_ref().map(|p| p.changes());
    let provisioning = match provisioner.as_ref() {
        Some(provisioner) => {
            apply_provisioned(provisioner, ledgers.as_mut(), limits.as_mut());
            let (connected_tx, connected) = tokio::sync::watch::channel(false);
            spawn_nri(&args.provision, provisioner.clone(), connected_tx);
            Some(Provisioning { provisioner: provisioner.clone(), connected })
        }
        None => None,
    };
    let mut reclaimer = Reclaimer::new(ledgers.is_some());
    let mut metrics = Metrics::new(args.hami_metrics)?;
    let reconciler = Reconciler::new(reconcile::Config {
        threshold: args.drift_threshold,
        grace: Duration::from_millis(args.drift_grace_ms),
    });
    let mut judge = Judge { reconciler, charger: Charger::new(), passes: 0 };
    if let Some(ledgers) = ledgers.as_mut() {
        ledgers.scan();
        info!(dir = %ledgers.dir().display(), ledgers = ledgers.len(), skipped = ledgers.skipped(), "watching ledgers");
        for latency in reclaimer.sweep(ledgers) {
            metrics.reclaimed(latency);
        }
    }
    // The listener serves the pages the loop renders (the first one before it listens) and
    // rings `render_wanted` when a scrape finds the page older than the last pass.
    let render_wanted = Arc::new(Notify::new());
    let (metrics_addr, publisher) = match args.metrics_addr {
        Some(addr) => {
            let connections = serve::http::Connections::new()?;
            metrics.register(connections.collector())?;
            judge.pass(ledgers.as_ref(), &accounting, &metrics);
            let now = view(&mut accounting, &discovery, ledgers.as_ref(), &reclaimer, &judge, limits.as_ref());
            let first = render(&mut metrics, ledgers.as_ref(), &judge, &now, provisioning.as_ref());
            let (publisher, board) = Publisher::new(first, render_wanted.clone());
            let bound = serve::http::serve(addr, serve::http::LIMITS, board, connections).await?;
            info!(metrics_addr = %bound, limits = ?serve::http::LIMITS, "serving /metrics, /healthz and /readyz");
            (Some(bound), Some(publisher))
        }
        None => (None, None),
    };

    let listener = control::bind(&args.socket)?;
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut drain = interval(Duration::from_millis(args.drain_ms));
    drain.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut sweep = interval(Duration::from_millis(args.sweep_ms));
    sweep.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut rescan = interval(Duration::from_millis(args.rescan_ms));
    rescan.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut ledger_scan = interval(Duration::from_millis(args.ledger_scan_ms));
    ledger_scan.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut limits_refresh = interval(Duration::from_millis(args.rescan_ms));
    limits_refresh.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut reconcile_tick = interval(RECONCILE_EVERY);
    reconcile_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut exit_retry = interval(EXIT_RETRY);
    exit_retry.set_missed_tick_behavior(MissedTickBehavior::Delay);
    info!(socket = %args.socket.display(), files = discovery.probed().count(), cgroups = ?layout, "vramguard agent running");

    loop {
        let wake = tokio::select! {
            _ = sigterm.recv() => Wake::Stop("SIGTERM"),
            _ = sigint.recv() => Wake::Stop("SIGINT"),
            guard = exits.readable_mut() => {
                guard.context("polling the exit ring buffer")?.clear_ready();
                Wake::Events
            }
            guard = kernel_log.readable_mut() => {
                let mut guard = guard.context("polling the eBPF programs' log")?;
                guard.get_inner_mut().flush();
                guard.clear_ready();
                continue;
            }
            _ = drain.tick() => Wake::Drain,
            _ = sweep.tick() => Wake::Sweep,
            _ = rescan.tick(), if !args.no_discover => Wake::Rescan,
            _ = ledger_scan.tick(), if ledgers.is_some() => Wake::Ledgers,
            _ = limits_refresh.tick(), if limits.is_some() => Wake::Limits,
            _ = reconcile_tick.tick() => Wake::Reconcile,
            _ = exit_retry.tick(), if ledgers.is_some() && reclaimer.pending() => Wake::ExitRetry,
            _ = render_wanted.notified() => Wake::Render,
            _ = changed(&mut provisioned_changes) => Wake::Provisioned,
            client = listener.accept() => match client {
                Ok((stream, _)) => Wake::Client(stream),
                Err(error) => { warn!(%error, "control socket accept failed"); continue; }
            },
        };
        match wake {
            Wake::Stop(signal) => {
                info!(signal, "stopping: detaching probes");
                break;
            }
            Wake::Limits => {
                if let Some(limits) = limits.as_mut() {
                    if let Some(ledgers) = ledgers.as_ref() {
                        limits.set_ledger_limits(ledger_cgroup_limits(ledgers, &judge.reconciler));
                    }
                    limits.refresh(&mut cgroups);
                }
            }
            Wake::Events | Wake::Drain => {
                let drained = accounting.drain(exits.get_mut());
                let exits = accounting.take_exits();
                if let Some(ledgers) = ledgers.as_ref().filter(|_| !exits.is_empty()) {
                    for (tgid, at) in exits {
                        reclaimer.exited(tgid, at);
                    }
                    for latency in reclaimer.sweep(ledgers) {
                        metrics.reclaimed(latency);
                    }
                }
                if accounting.sweep_due() {
                    accounting.sweep();
                }
                // Something changed: pass now (a quiet node gets the timer's pass only).
                if drained > 0 && judge.reconciler.due() {
                    judge.pass(ledgers.as_ref(), &accounting, &metrics);
                }
            }
            Wake::Reconcile => {
                accounting.drain(exits.get_mut());
                judge.pass(ledgers.as_ref(), &accounting, &metrics);
            }
            Wake::Ledgers | Wake::ExitRetry => {
                if let Some(ledgers) = ledgers.as_mut() {
                    if matches!(wake, Wake::Ledgers) {
                        ledgers.scan();
                    }
                    let reclaimed = reclaimer.sweep(ledgers);
                    for latency in &reclaimed {
                        metrics.reclaimed(*latency);
                    }
                    if !reclaimed.is_empty() && judge.reconciler.due() {
                        judge.pass(Some(ledgers), &accounting, &metrics);
                    }
                }
            }
            Wake::Sweep => {
                accounting.drain(exits.get_mut());
                accounting.sweep();
                kernel::cgroups::sweep(&mut accounting, limits.as_mut(), &mut cgroups);
            }
            Wake::Rescan => {
                discovery.scan(&mut Attacher(&mut ebpf));
            }
            Wake::Client(stream) => {
                accounting.drain(exits.get_mut());
                judge.pass(ledgers.as_ref(), &accounting, &metrics);
                let mut snapshot = view(&mut accounting, &discovery, ledgers.as_ref(), &reclaimer, &judge, limits.as_ref());
                snapshot.metrics_addr = metrics_addr.map(|addr| addr.to_string());
                // For audit only (the metrics page does not show it): a copy of each ledger.
                snapshot.ledger_problems = ledgers.as_ref().map(Ledgers::problems).unwrap_or_default();
                if let Some(p) = provisioning.as_ref() {
                    snapshot.provisioned = p.provisioner.provisioned().into_iter().map(|p| p.record).collect();
                    snapshot.nri_connected = Some(*p.connected.borrow());
                }
                // The answer awaits the client, and the listener may answer meanwhile: the
                // pass is the last one from now on.
                if let Some(publisher) = publisher.as_ref() {
                    publisher.passed(judge.passes);
                }
                if let Err(error) = control::serve(stream, &snapshot).await {
                    warn!(%error, "answering a control client failed");
                }
            }
            Wake::Provisioned => {
                if let Some(provisioner) = provisioner.as_ref() {
                    apply_provisioned(provisioner, ledgers.as_mut(), limits.as_mut());
                    if let Some(ledgers) = ledgers.as_mut() {
                        ledgers.scan();
                    }
                }
            }
            // A scrape found the page older than the last pass: render that pass's (once,
            // however many scrapes asked).
            Wake::Render => {
                if let Some(publisher) = publisher.as_ref().filter(|p| p.behind()) {
                    let now = view(&mut accounting, &discovery, ledgers.as_ref(), &reclaimer, &judge, limits.as_ref());
                    publisher.publish(render(&mut metrics, ledgers.as_ref(), &judge, &now, provisioning.as_ref()));
                }
            }
        }
        if let Some(publisher) = publisher.as_ref() {
            publisher.passed(judge.passes);
        }
    }
    if let Some(ledgers) = ledgers.as_ref() {
        judge.charger.release_all(ledgers);
    }
    drop(listener);
    let _ = std::fs::remove_file(&args.socket);
    drop(accounting);
    drop(exits);
    kernel_log.get_mut().flush();
    drop(kernel_log);
    drop(ebpf); // dropping the programs detaches every uprobe and the tracepoint
    info!("vramguard agent stopped");
    Ok(())
}

/// The reconciler and the charges that follow its passes.
struct Judge {
    reconciler: Reconciler,
    charger: Charger,
    /// Passes run so far.
    passes: u64,
}

impl Judge {
    /// One reconcile pass, then the agent's charges brought in line with it; timed.
    fn pass(&mut self, ledgers: Option<&Ledgers>, accounting: &Accounting, metrics: &Metrics) {
        let started = std::time::Instant::now();
        self.reconciler.pass(ledgers, &accounting.processes());
        if let Some(ledgers) = ledgers {
            self.charger.update(ledgers, &self.reconciler.unaccounted_by_ledger(), self.reconciler.unreadable());
        }
        metrics.passed(started.elapsed());
        self.passes += 1;
    }
}

/// The current view for `vramguard audit` and the metrics: the probes' maps as they are now,
/// with the states of the last reconcile pass.
fn view(
    accounting: &mut Accounting,
    discovery: &Discovery,
    ledgers: Option<&Ledgers>,
    reclaimer: &Reclaimer,
    judge: &Judge,
    limits: Option<&enforce::Limits>,
) -> Snapshot {
    let mut snapshot = accounting.snapshot();
    judge.reconciler.annotate(&mut snapshot);
    snapshot.libcuda = discovery.probed().cloned().collect();
    snapshot.discovery = discovery.stats();
    snapshot.ledgers = ledgers.map(|l| l.iter().map(|(path, _)| path.display().to_string()).collect()).unwrap_or_default();
    snapshot.stats.slots_reclaimed = reclaimer.total;
    snapshot.stats.cgroup_limits = limits.map_or(0, |l| l.applied() as u64);
    snapshot.kernel_maps.cgroup_limits = limits.map_or_else(Vec::new, |l| l.ids());
    snapshot
}

/// A page for `--metrics-addr`: the metrics rendered from `view` (as of the last pass), and
/// the readiness (a libcuda probed: always, after start-up).
fn render(metrics: &mut Metrics, ledgers: Option<&Ledgers>, judge: &Judge, view: &Snapshot, provisioning: Option<&Provisioning>) -> Published {
    metrics.refresh(ledgers, view, &judge.reconciler, &judge.charger.charged());
    let nri_down = provisioning.is_some_and(|p| !*p.connected.borrow());
    if let Some(p) = provisioning {
        metrics.set_provisioning(p.provisioner.len(), !nri_down);
    }
    let not_ready = if view.libcuda.is_empty() {
        Some("no libcuda probed")
    } else if nri_down {
        Some("not registered with the container runtime (NRI): new containers start without their quota")
    } else if provisioning.and_then(|p| p.provisioner.kube_synced()) == Some(false) {
        Some("the pods of this node are not listed from the Kubernetes API yet")
    } else {
        None
    };
    Published { metrics: metrics.encode().map(Bytes::from).map_err(|error| format!("{error:#}")), not_ready, passes: judge.passes }
}

/// Provisioning as the loop sees it: the provisioner and whether NRI is connected.
struct Provisioning {
    provisioner: Arc<Provisioner>,
    connected: tokio::sync::watch::Receiver<bool>,
}

/// The provisioner `--nri` asks for, with its quota sources, and the node's advertised
/// capacity (with `--kube` and `--gpu-memory`); `None` without `--nri`.
fn provisioner(args: &RunArgs) -> Result<Option<(Arc<Provisioner>, Option<provision::kube::Capacity>)>> {
    let wanted = &args.provision;
    if !wanted.nri {
        if wanted.quota_file.is_some() || wanted.quota_from_annotation || wanted.refuse_overcommit || wanted.kube.kube {
            bail!("--kube, --quota-file, --quota-from-annotation and --refuse-overcommit provision containers: they need --nri");
        }
        return Ok(None);
    }
    let Some(ledger_dir) = args.ledger_dir.as_deref() else {
        bail!("--nri needs --ledger-dir: the ledgers of provisioned containers are created and watched there");
    };
    let file = wanted.quota_file.as_deref().map(provision::quota::QuotaFile::open).transpose().map_err(|e| anyhow!(e))?;
    let (kube, capacity) = match wanted.kube.config()? {
        Some(config) => {
            let node = wanted.kube.node()?;
            let client = provision::kube::Client::new(&config)?;
            let pods = provision::kube::PodCache::start(client.clone(), node)?;
            let capacity = if wanted.gpu_memory.is_empty() {
                warn!("no --gpu-memory: the node's vramguard.io/gpu-memory capacity is not advertised");
                None
            } else {
                let every = wanted.kube.capacity_every();
                Some(provision::kube::Capacity::start(client, node, wanted.gpu_memory.clone(), wanted.kube.overcommit, every)?)
            };
            (Some(pods), capacity)
        }
        None => (None, None),
    };
    let sources = provision::Sources { kube, file, annotation: wanted.quota_from_annotation };
    if sources.kube.is_none() && sources.file.is_none() && !sources.annotation {
        bail!("--nri needs a quota source: --kube, --quota-file FILE or --quota-from-annotation");
    }
    let provisioner = Provisioner::new(wanted, ledger_dir, sources).map_err(|e| anyhow!("cannot provision containers: {e}"))?;
    Ok(Some((Arc::new(provisioner), capacity)))
}

/// Starts the NRI plugin (it reconnects by itself for as long as the agent runs).
fn spawn_nri(args: &ProvisionArgs, provisioner: Arc<Provisioner>, connected: tokio::sync::watch::Sender<bool>) {
    let config = provision::nri::Config {
        socket: args.nri_socket.clone(),
        name: "vramguard".into(),
        index: "10".into(),
        handler_deadline: NRI_DEADLINE,
    };
    tokio::spawn(provision::nri::run(config, provisioner, connected));
}

/// Holds the provisioned containers' ledgers to the agent's headers and their cgroups to
/// their limits.
fn apply_provisioned(provisioner: &Provisioner, ledgers: Option<&mut Ledgers>, limits: Option<&mut enforce::Limits>) {
    if let Some(ledgers) = ledgers {
        let pins = provisioner
            .provisioned()
            .into_iter()
            .map(|p| {
                let r = p.record;
                (p.ledger, Pin { header: p.header, names: [r.namespace, r.pod, r.container, r.pod_uid] })
            })
            .collect();
        ledgers.set_pins(pins);
    }
    if let Some(limits) = limits {
        limits.set_provisioned(provisioner.cgroup_limits());
    }
}

/// The next change of the provisioned set; never, without provisioning.
async fn changed(changes: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    if let Some(changes) = changes {
        if changes.changed().await.is_ok() {
            return;
        }
    }
    std::future::pending().await

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
