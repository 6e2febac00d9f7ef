//! Loading the eBPF object: the loader's globals and map sizes from the agent's settings, the
//! tracepoints (process exit, cgroup removal, the cgroup tree's other changes, and the new
//! executable mappings discovery is told of) attached, every uprobe program loaded into the
//! kernel for uprobe_multi links ([`super::multi`]; attached later, per libcuda file, by
//! [`super::probes`], which loads them for perf events where those links are refused), the
//! maps taken out for the accounting, the limits and the log. What it returns is the kernel task's state
//! ([`Kernel`]): the programs live and die with that task.
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use aya::programs::TracePoint;
use tokio::io::unix::AsyncFd;
use tracing::{info, warn};

use super::{accounting::Accounting, enforce, multi::MultiPrograms, task::Kernel};
use crate::{cgroup::CgroupNames, preflight::Platform};

/// What the loading depends on (from `vramguard run`'s arguments).
pub struct Settings {
    /// The `ALLOCS` map's size.
    pub max_alloc_records: u32,
    pub records_per_cgroup: u64,
    pub spares_per_process: u64,
    /// The `JOURNAL` ring buffer's size (`--journal-bytes`).
    pub journal_bytes: u32,
    pub enforce: enforce::Mode,
    pub signal: i32,
    /// The limits file, if any.
    pub limits: Option<PathBuf>,
    /// Whether the ledgers' limits are pushed too (`--ledger-dir`).
    pub ledger_limits: bool,
    /// How the uprobes are linked (`--uprobe-links`).
    pub links: super::probes::LinkKind,
}

/// Loads `object` (the embedded eBPF object) and attaches its tracepoints.
pub fn load(settings: &Settings, platform: &Platform, object: &[u8]) -> Result<Kernel> {
    let records_cap = settings.records_per_cgroup;
    let (rmdir_root, rmdir_id) = match &platform.rmdir_offsets {
        Ok(offsets) => (offsets.root, offsets.id),
        Err(_) => (0, 0),
    };
    let mut ebpf = aya::EbpfLoader::new()
        .override_global(common::names::GROUP_DEAD_OFFSET, &platform.group_dead_offset, true)
        .override_global(common::names::MAX_RECORDS_PER_CGROUP, &records_cap, true)
        .override_global(common::names::MAX_SPARES_PER_PROCESS, &settings.spares_per_process, true)
        .override_global(common::names::RMDIR_ROOT_OFFSET, &rmdir_root, true)
        .override_global(common::names::RMDIR_ID_OFFSET, &rmdir_id, true)
        .map_max_entries(common::names::ALLOCS, settings.max_alloc_records)
        .map_max_entries(common::names::JOURNAL, super::accounting::journal_bytes(settings.journal_bytes)?)
        .load(object)
        .context("the kernel refused the eBPF object")?;
    // While every map is in `ebpf` (the log's is taken next).
    let multi = match settings.links {
        super::probes::LinkKind::Perf => None,
        super::probes::LinkKind::Auto => match MultiPrograms::load(object, &ebpf, &super::probes::program_names()) {
            Ok(multi) => Some(multi),
            Err(error) => {
                warn!(error = %format!("{error:#}"), "the uprobe programs cannot be loaded for uprobe_multi links: the probes are perf events (each removed in a grace period of its own)");
                None
            }
        },
    };
    if multi.is_none() {
        super::probes::load_programs(&mut ebpf)?;
    }
    // Before any program runs, so that no line is lost.
    let log = super::log::init(&mut ebpf)?;
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
    match (enforce::deny_support(&mut ebpf), settings.enforce) {
        (Ok(()), _) => info!("deny mode: this kernel lets uprobes write registers, but this build does not implement deny yet"),
        (Err(reason), enforce::Mode::Deny) => bail!("--enforce deny is unavailable: {reason}; use --enforce signal or audit"),
        (Err(reason), _) => info!("deny mode unavailable: {reason}"),
    }
    if settings.enforce == enforce::Mode::Deny {
        bail!("--enforce deny is not implemented by this build; use --enforce signal or audit");
    }
    if settings.enforce != enforce::Mode::Audit && settings.limits.is_none() && !settings.ledger_limits {
        bail!("--enforce {} needs limits: --limits FILE and/or --ledger-dir DIR", settings.enforce.name());
    }
    let mut limits = if settings.limits.is_some() || settings.ledger_limits {
        Some(enforce::Limits::new(&mut ebpf, settings.limits.as_deref(), settings.enforce, settings.signal)?)
    } else {
        None
    };
    let mut cgroups = CgroupNames::watched(super::cgroups::watch_tree(&mut ebpf, platform.rmdir_offsets.is_ok()));
    let exec_mapped = match super::exec::watch(&mut ebpf) {
        Ok(watch) => Some(watch),
        Err(error) => {
            warn!(error = %format!("{error:#}"), "no word from the kernel on new executable mappings: discovery reads new processes' maps every --rescan-ms and every process's every tenth time");
            None
        }
    };
    if let Some(limits) = limits.as_mut() {
        limits.refresh(&mut cgroups);
        info!(mode = ?settings.enforce, cgroups = limits.applied(), "cgroup limits pushed to the probes");
    }
    let (accounting, exits_ring) = Accounting::new(&mut ebpf, records_cap)?;
    // Exits wake the kernel task (allocations and frees emit no events: the maps say them).
    // SAFETY: the ring buffer owns its map fd, which stays open and unchanged until the
    // AsyncFd (which owns the ring buffer) is dropped.
    let exits_ring = unsafe { AsyncFd::register_with_interest(exits_ring, tokio::io::Interest::READABLE) }
        .map_err(|error| anyhow!("cannot poll the exit ring buffer: {error}"))?;
    info!(
        max_alloc_records = settings.max_alloc_records,
        max_alloc_records_per_cgroup = records_cap,
        max_spare_records_per_process = settings.spares_per_process,
        "allocation records: node-wide and per-cgroup caps, spares a process may keep"
    );

    Ok(Kernel { programs: super::task::Programs::new(ebpf, multi), accounting, exits: exits_ring, log, limits, cgroups, exec_mapped })
}
