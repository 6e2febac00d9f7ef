//! `vramguard run`: load and attach the eBPF programs, keep the view current, answer the
//! control socket, and detach cleanly on SIGINT or SIGTERM.
use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::Duration,
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{programs::TracePoint, EbpfLoader};
use tokio::{
    io::unix::AsyncFd,
    net::UnixStream,
    signal::unix::{signal, SignalKind},
    time::{interval, MissedTickBehavior},
};
use tracing::{info, warn};

use crate::{
    accounting::Accounting,
    control,
    libcuda::{self, FileId, LibcudaFile},
    preflight,
    probes::{self, AttachReport},
};

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
    /// How often to scan /proc/*/maps for libcuda files not probed yet, in milliseconds.
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
}

enum Wake {
    Stop(&'static str),
    Events,
    Drain,
    Sweep,
    Rescan,
    Client(UnixStream),
}

pub async fn run(args: RunArgs) -> Result<()> {
    if args.rescan_ms == 0 || args.drain_ms == 0 || args.sweep_ms == 0 {
        bail!("--rescan-ms, --drain-ms and --sweep-ms must be at least 1");
    }
    let platform = preflight::check()?;
    let mut ebpf = EbpfLoader::new()
        .override_global(common::names::GROUP_DEAD_OFFSET, &platform.group_dead_offset, true)
        .load(EBPF_OBJECT)
        .context("the kernel refused the eBPF object")?;
    let exit: &mut TracePoint = ebpf
        .program_mut(common::names::PROCESS_EXIT)
        .ok_or_else(|| anyhow!("the embedded eBPF object has no `process_exit` program"))?
        .try_into()?;
    exit.load().context("the kernel refused the process-exit program")?;
    exit.attach("sched", "sched_process_exit")
        .context("cannot attach to the sched:sched_process_exit tracepoint")?;
    probes::load_programs(&mut ebpf)?;
    let (mut accounting, events) = Accounting::new(&mut ebpf)?;
    // SAFETY: the ring buffer owns its map fd, which stays open and unchanged until the
    // AsyncFd (which owns the ring buffer) is dropped.
    let mut events = unsafe { AsyncFd::register_with_interest(events, tokio::io::Interest::READABLE) }
        .map_err(|error| anyhow!("cannot poll the event ring buffer: {error}"))?;

    let mut attached: BTreeMap<FileId, AttachReport> = BTreeMap::new();
    let mut initial: Vec<LibcudaFile> = Vec::new();
    for path in &args.libcuda {
        initial.push(libcuda::from_path(path)?);
    }
    if !args.no_discover {
        initial.extend(libcuda::mapped_by_processes());
        initial.extend(libcuda::well_known());
    }
    if initial.is_empty() {
        bail!(
            "no libcuda found: none given with --libcuda, none mapped by a running process, none \
             at {}. Give --libcuda PATH (the host's libcuda.so.1)",
            libcuda::well_known_paths()
        );
    }
    for file in initial {
        attach(&mut ebpf, &mut attached, file)?;
    }

    let listener = control::bind(&args.socket)?;
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut drain = interval(Duration::from_millis(args.drain_ms));
    drain.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut sweep = interval(Duration::from_millis(args.sweep_ms));
    sweep.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut rescan = interval(Duration::from_millis(args.rescan_ms));
    rescan.set_missed_tick_behavior(MissedTickBehavior::Delay);
    info!(socket = %args.socket.display(), files = attached.len(), "vramguard agent running");

    loop {
        let wake = tokio::select! {
            _ = sigterm.recv() => Wake::Stop("SIGTERM"),
            _ = sigint.recv() => Wake::Stop("SIGINT"),
            guard = events.readable_mut() => {
                guard.context("polling the event ring buffer")?.clear_ready();
                Wake::Events
            }
            _ = drain.tick() => Wake::Drain,
            _ = sweep.tick() => Wake::Sweep,
            _ = rescan.tick(), if !args.no_discover => Wake::Rescan,
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
            Wake::Events | Wake::Drain => {
                accounting.drain(events.get_mut());
                if accounting.sweep_due() {
                    accounting.sweep();
                }
            }
            Wake::Sweep => {
                accounting.drain(events.get_mut());
                accounting.sweep();
            }
            Wake::Rescan => {
                for file in libcuda::mapped_by_processes() {
                    if let Err(error) = attach(&mut ebpf, &mut attached, file) {
                        warn!("{error:#}");
                    }
                }
            }
            Wake::Client(stream) => {
                accounting.drain(events.get_mut());
                let mut snapshot = accounting.snapshot();
                snapshot.libcuda = attached.values().cloned().collect();
                if let Err(error) = control::serve(stream, &snapshot).await {
                    warn!(%error, "answering a control client failed");
                }
            }
        }
    }
    drop(listener);
    let _ = std::fs::remove_file(&args.socket);
    drop(accounting);
    drop(events);
    drop(ebpf); // dropping the programs detaches every uprobe and the tracepoint
    info!("vramguard agent stopped");
    Ok(())
}

/// Attaches the probes to `file` unless that file already has them.
fn attach(
    ebpf: &mut aya::Ebpf,
    attached: &mut BTreeMap<FileId, AttachReport>,
    file: LibcudaFile,
) -> Result<()> {
    if attached.contains_key(&file.id) {
        return Ok(());
    }
    let report = probes::attach(ebpf, &file)?;
    info!(
        path = %file.path.display(),
        attached = report.attached.len(),
        missing = ?report.missing,
        aliases = ?report.aliases,
        "probes attached to libcuda"
    );
    attached.insert(file.id, report);
    Ok(())
}
