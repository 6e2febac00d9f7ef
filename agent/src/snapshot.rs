//! The agent's view of GPU memory at one instant, as `vramguard audit` receives it over the
//! control socket and prints it (a table, or `--json`), and the types the rooms hand each other
//! through it: what the kernel task reports (processes, external memory), each cgroup's holders,
//! what discovery counts, a process's reconciliation state. The module is below the rooms that
//! fill and read it (kernel, discovery, reconcile, serve): it names their types, never their
//! code, so that none of them depends on another through it.
use std::{collections::BTreeMap, fmt::Write as _};

use serde::{Deserialize, Serialize};

use crate::{driver_limits::DriverLimits, libcuda::AttachReport};

/// Live bytes by allocation kind (`device`, `managed`, `async`, `vmm`).
pub type BytesByKind = BTreeMap<String, u64>;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Snapshot {
    /// One row per process holding GPU memory (or with live allocations).
    pub processes: Vec<ProcessRow>,
    /// One row per cgroup holding GPU memory.
    pub cgroups: Vec<CgroupRow>,
    pub stats: Stats,
    /// The libcuda files probed.
    pub libcuda: Vec<AttachReport>,
    /// What discovery skipped or capped, and its counts.
    #[serde(default)]
    pub discovery: DiscoveryStats,
    /// Where `/metrics` is served (the bound address, also when port 0 was asked for).
    #[serde(default)]
    pub metrics_addr: Option<String>,
    /// Where `/healthz` and `/readyz` are served on a listener of their own (`--health-addr`).
    #[serde(default)]
    pub health_addr: Option<String>,
    /// The ledgers watched under `--ledger-dir`.
    #[serde(default)]
    pub ledgers: Vec<String>,
    /// Files under `--ledger-dir` the agent does not work on as it should, and why
    /// (`skipped: ...`, `tampered: ...`, `unreadable: ...`, `worker failing: ...`), by path.
    #[serde(default)]
    pub ledger_problems: BTreeMap<String, String>,
    /// Which cgroups have entries in the kernel's per-cgroup maps (for checking that removed
    /// cgroups' entries go).
    #[serde(default)]
    pub kernel_maps: KernelMaps,
    /// The containers the agent provisioned (`--nri`), with their quotas.
    #[serde(default)]
    pub provisioned: Vec<crate::provision::Record>,
    /// Whether the agent is registered with the runtime as an NRI plugin (absent without `--nri`).
    #[serde(default)]
    pub nri_connected: Option<bool>,
    /// The driver view's state (NVML): `ok`, or why there is none.
    #[serde(default)]
    pub driver: crate::driver::DriverStatus,
    /// The DRA driver's published pool (absent without `--dra`).
    #[serde(default)]
    pub dra: Option<DraStatus>,
    /// The driver's own per-cgroup limits (r615+): which GPUs have them, and each
    /// provisioned container's as set and read back (absent without `--nri`).
    #[serde(default)]
    pub driver_limits: Option<DriverLimits>,
    /// Imported external memory (`cuImportExternalMemory`), live, per process and cgroup:
    /// shown, never charged.
    #[serde(default)]
    pub external_memory: ExternalMemory,
}

/// The DRA driver's ResourceSlice pool as last published (`--dra`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraStatus {
    /// `shared` (claims share a GPU by consumable capacity), `whole` (the API server drops the
    /// shared form, `DRAConsumableCapacity` being off: each GPU goes whole to one claim), or
    /// empty before the first publication.
    pub sharing: String,
    /// The pool's generation.
    pub generation: i64,
    /// Where the GPUs came from: `nvml`, or `gpu-memory` (the flag, without NVML).
    pub source: String,
    /// (index, `memory` capacity in bytes) of each published GPU.
    pub gpus: Vec<(u32, u64)>,
}

/// A process's reconciliation state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Ok,
    Drift,
    Unhooked,
    Stale,
    Tampered,
    Unprobed,
}

impl State {
    pub const ALL: [State; 6] = [State::Ok, State::Drift, State::Unhooked, State::Stale, State::Tampered, State::Unprobed];

    pub fn name(self) -> &'static str {
        match self {
            State::Ok => "ok",
            State::Drift => "drift",
            State::Unhooked => "unhooked",
            State::Stale => "stale",
            State::Tampered => "tampered",
            State::Unprobed => "unprobed",
        }
    }
}

/// One process as the probes see it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EbpfProcess {
    /// Host pid.
    pub pid: u32,
    /// The probes' generation of the process (its entry's creation time): a pid reused by a
    /// new process gets a new one.
    pub generation: u64,
    pub cgroup_id: u64,
    /// Live requested bytes.
    pub bytes: u64,
    /// Bytes of its stream-ordered allocations it freed that their pools may still keep, as
    /// the probes count them (`common::ProcUsage::pool_kept`).
    pub pool_kept: u64,
}

/// A process holding GPU memory in a cgroup, as a reconcile pass saw it, for the kernel task
/// to hold the cgroup to its limit ([`crate::kernel::enforce`]): which process (host pid and
/// start time, so that a pid reused since is never signalled) and what it holds, on the
/// probes' scale (contexts aside).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    pub start_time: u64,
    /// What two consecutive driver reads showed it holding, each read's figures alone
    /// ([`crate::reconcile::Verdict::limit_bytes`]): its part of the cgroup's usage.
    pub held: u64,
    /// Of `held`, what no ledger charges it: what the hook did not admit
    /// ([`crate::reconcile::Verdict::unadmitted_bytes`]).
    pub unadmitted: u64,
    /// The probes' live bytes at the pass (what they see it free since comes off the usage).
    pub live: u64,
    /// Bytes the driver reports it holding that the probes cannot see, as two consecutive
    /// driver reads showed them ([`crate::reconcile::Verdict::enforced_bytes`]): what
    /// `--enforce audit` takes off the limit the probes check, and, as far as no ledger charges
    /// them, what puts the process first to be stopped.
    pub escaped: u64,
}

impl Holder {
    /// Why a holder is stopped, by the first field of its [`Holder::stop_order`].
    pub const WHY: [&'static str; 3] = ["escaped", "unadmitted", "admitted"];

    /// Who is stopped first when its cgroup is over its limit: a process holding memory
    /// neither the probes see nor a ledger charges (allocated through a copy of libcuda no
    /// probe is on, past the hook), largest first; then one holding memory no ledger charges
    /// (the hook did not admit it: an un-hooked process, new memory on a kept figure its pool
    /// had given back), largest first; then the others, largest first (a limit below what
    /// their ledger admits). Memory the hook charges and the probes cannot see (arrays, graph
    /// memory, a second context) is admitted: it never puts its process first.
    pub fn stop_order(&self) -> (u8, std::cmp::Reverse<u64>) {
        match (self.escaped.min(self.unadmitted), self.unadmitted) {
            (0, 0) => (2, std::cmp::Reverse(self.held)),
            (0, unadmitted) => (1, std::cmp::Reverse(unadmitted)),
            (escaped, _) => (0, std::cmp::Reverse(escaped)),
        }
    }
}

/// Per cgroup id: its processes holding memory, in [`Holder::stop_order`].
pub type HoldersByCgroup = BTreeMap<u64, Vec<Holder>>;

/// Imported external memory, live (imported and not destroyed), as the audit shows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExternalMemory {
    /// One row per process with a live import, by pid.
    pub processes: Vec<ExternalRow>,
    /// One row per cgroup with a live import, by cgroup id.
    pub cgroups: Vec<ExternalRow>,
}

/// One process's or cgroup's live imports.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExternalRow {
    /// Host pid (0 in a cgroup's row).
    #[serde(default)]
    pub pid: u32,
    pub cgroup_id: u64,
    /// Path under the cgroup2 root; empty if the cgroup is gone.
    pub cgroup: String,
    /// Live imports with a record, and the bytes their descriptors gave.
    pub imports: u64,
    pub bytes: u64,
    /// Imports past the cgroup's record cap: counted, their bytes unknown.
    pub unrecorded: u64,
}

/// A file discovery looked at and did not probe, as `vramguard audit` lists it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SkippedFile {
    pub path: String,
    pub dev: u64,
    pub ino: u64,
    /// `pid N` (the process it was found in), `--libcuda` or `well-known path`.
    pub origin: String,
    pub reason: String,
}

/// Discovery's counters, for `vramguard audit` and the metrics.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DiscoveryStats {
    /// Files with probes (`--libcuda`, well-known and discovered).
    pub probed: u64,
    /// Files that failed to open, parse or attach (each version of a file once).
    pub failed: u64,
    /// Libcuda files left unprobed by a cap.
    pub capped: u64,
    /// Containers (cgroups) that reached their cap.
    pub capped_containers: u64,
    /// Processes whose `/proc/<pid>/maps` went over the agent's bounds (each reported once).
    #[serde(default)]
    pub maps_over_bound: u64,
    /// Files and processes' maps whose reading panicked (a bug the tenant's bytes found):
    /// each skipped, remembered like a failed file, and counted.
    #[serde(default)]
    pub panicked: u64,
    /// Processes' maps read: because the kernel told of a new executable mapping (an exec,
    /// `mmap`, `mprotect`), by a scan of every process (the first, the safety net every
    /// `--full-rescan-ms`, or after events were lost), and, without the kernel's word, as a
    /// new process's.
    #[serde(default)]
    pub maps_read_event: u64,
    #[serde(default)]
    pub maps_read_rescan: u64,
    #[serde(default)]
    pub maps_read_new: u64,
    /// Scans of every process after the first.
    #[serde(default)]
    pub rescans: u64,
    /// Libcuda files (probed or capped) such a scan found that no event led to.
    #[serde(default)]
    pub found_by_rescan: u64,
    /// The kernel's events of new executable mappings lost (its map of processes full).
    #[serde(default)]
    pub events_lost: u64,
    /// The most recent files skipped for a reason worth telling (failures, caps, files named
    /// like a libcuda that are not one), newest last.
    pub skipped: Vec<SkippedFile>,
}

/// The cgroup ids with an entry in each per-cgroup kernel map, ascending.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct KernelMaps {
    pub cgroup_usage: Vec<u64>,
    pub cgroup_limits: Vec<u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ProcessRow {
    /// Host pid.
    pub pid: u32,
    pub comm: String,
    pub cgroup_id: u64,
    /// Path under the cgroup2 root; empty if the cgroup is gone.
    pub cgroup: String,
    pub bytes: BytesByKind,
    pub total_bytes: u64,
    /// Allocations not yet freed.
    pub live_allocations: u64,
    pub allocs: u64,
    pub frees: u64,
    /// Allocations charged without a record (its cgroup was at its cap, or the node's record
    /// map was full): their bytes stay charged until the process exits.
    #[serde(default)]
    pub unrecorded: u64,
    /// The reconciliation state (`ok`, `drift`, `unhooked`, `stale`, `tampered`); absent
    /// before the first pass.
    #[serde(default)]
    pub state: Option<State>,
    /// The ledger holding the process's slot (its path); absent for an un-hooked process.
    #[serde(default)]
    pub ledger: Option<String>,
    /// Requested bytes that ledger charges the process (data, small and managed; no context):
    /// what `total_bytes` is compared with.
    #[serde(default)]
    pub ledger_bytes: Option<u64>,
    /// What the driver (NVML) reports the process holding over every device, its contexts
    /// included; absent when the driver view has no figure for it.
    #[serde(default)]
    pub driver_bytes: Option<u64>,
    /// What its stream-ordered pools may keep of what the probes saw freed, held to the
    /// driver's figure ([`crate::reconcile::figure::PoolsKeep`]).
    #[serde(default)]
    pub pool_kept_bytes: u64,
    /// The one figure of the process: the larger of what the three views say, a context per
    /// device aside ([`crate::reconcile::figure::Figure::held`]).
    #[serde(default)]
    pub held_bytes: u64,
    /// Of the driver's figure, what the probes do not explain, confirmed on two driver reads:
    /// what its cgroup counts beside the probes' figure, and what it is signalled for
    /// ([`crate::reconcile::Verdict::enforced_bytes`]).
    #[serde(default)]
    pub escaped_bytes: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CgroupRow {
    pub cgroup_id: u64,
    pub cgroup: String,
    pub bytes: BytesByKind,
    pub total_bytes: u64,
    pub live_allocations: u64,
    pub allocs: u64,
    pub frees: u64,
    /// Live allocations charged without a record (past the cap, or the node's record map
    /// full), until their processes exit.
    #[serde(default)]
    pub unrecorded: u64,
    /// The cgroup holds at least its cap of live allocations (`stats.records_cap`),
    /// recorded or not: new allocations get no record.
    #[serde(default)]
    pub capped: bool,
}

/// Counters of the accounting pipeline itself.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Stats {
    /// Events received from the ring buffer, by kind.
    /// (Allocations and frees are not events: these are the probes' own counts of what they
    /// charged and uncharged, never lost.)
    pub events_alloc: u64,
    pub events_free: u64,
    pub events_exit: u64,
    /// Events the eBPF side could not queue (ring buffer full).
    pub events_lost: u64,
    /// Allocations the eBPF side saw succeed but could not record (a map was full).
    pub untracked_allocs: u64,
    /// Return probes without a saved entry (probes attached during a call).
    pub orphan_returns: u64,
    /// Allocation records in the kernel map now (stale ones included until swept): counted
    /// by the probes as they insert and delete them, less those the agent deleted.
    pub records: u64,
    /// Of `records`, those of freed device pointers kept for the driver's reuse of their
    /// address (`common::spare`) by live processes (a dead process's leave this count at its
    /// exit, and `records` at its sweep).
    #[serde(default)]
    pub spare_records: u64,
    /// Records of dead processes the agent deleted.
    pub stale_records_removed: u64,
    /// Allocations that would have passed their cgroup's limit (limits file).
    #[serde(default)]
    pub over_limit: u64,
    /// Signals the probes sent to stop such allocations.
    #[serde(default)]
    pub signals_sent: u64,
    /// Cgroups with a limit in the probes (limits file and watched ledgers).
    #[serde(default)]
    pub cgroup_limits: u64,
    /// Ledger slots of dead processes the agent reclaimed.
    #[serde(default)]
    pub slots_reclaimed: u64,
    /// Live allocation records a cgroup may have (`--max-alloc-records-per-cgroup`).
    #[serde(default)]
    pub records_cap: u64,
    /// Allocations refused a record because their cgroup was at its cap (charged anyway).
    #[serde(default)]
    pub records_capped: u64,
    /// Allocations refused a record because the node's record map was full (charged anyway).
    #[serde(default)]
    pub allocs_map_full: u64,
    /// Processes whose usage the probes could not track (their map full).
    #[serde(default)]
    pub procs_map_full: u64,
    /// Allocations whose cgroup the probes could not track (their map full).
    #[serde(default)]
    pub cgroups_map_full: u64,
    /// Exit events the eBPF side could not queue (exit ring buffer full).
    #[serde(default)]
    pub exit_events_lost: u64,
    /// Kernel log lines about trouble dropped by the kernel's rate limit.
    #[serde(default)]
    pub log_lines_suppressed: u64,
    /// Removed cgroups whose map entries the `cgroup_rmdir` tracepoint deleted.
    #[serde(default)]
    pub cgroups_removed_by_kernel: u64,
    /// VMM handles left charged until their process exits because one of their mappings
    /// could not be recorded (cgroup at its cap of records, map full).
    #[serde(default)]
    pub vmm_pinned: u64,
    /// Map entries of removed cgroups the agent's sweep deleted.
    #[serde(default)]
    pub cgroup_entries_swept: u64,
    /// Records the sweeps that follow exits examined: the exited processes' own records,
    /// found through the index of records by process (never the other processes').
    #[serde(default)]
    pub records_swept_by_exit: u64,
    /// Records full sweeps of the maps examined (every record: only after exits or journal
    /// entries were lost, or the index was full).
    #[serde(default)]
    pub records_swept_full: u64,
    /// Full sweeps of the maps run.
    #[serde(default)]
    pub full_sweeps: u64,
    /// Keys of new records the probes could not journal (`JOURNAL` full): each makes one full
    /// sweep due.
    #[serde(default)]
    pub journal_lost: u64,
    /// Keys in the agent's index of records by process.
    #[serde(default)]
    pub record_index_keys: u64,
    /// Keys the index could not take (at its cap): a full sweep rebuilds it.
    #[serde(default)]
    pub record_index_overflows: u64,
    /// Walks of the cgroup2 tree (it is walked when it changed: see `crate::cgroup`).
    #[serde(default)]
    pub cgroup_tree_walks: u64,
    /// The cgroup2 tree's changes the kernel counted (directories made, removed, renamed)
    /// since the agent started; 0 where they are not counted (the tree is then walked
    /// whenever it is needed).
    #[serde(default)]
    pub cgroup_tree_changes: u64,
    /// The agent's own signals to processes over their cgroup's limit, by why each was chosen
    /// ([`Holder::WHY`]): memory the probes cannot see and no ledger charges, memory no ledger
    /// charges, or the rest.
    #[serde(default)]
    pub agent_signals: [u64; 3],
}

impl Snapshot {
    /// The human-readable table `vramguard audit` prints.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:>8}  {:<16} {:<40} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10} {:>10}  {:<8}",
            "PID", "COMM", "CGROUP", "DEVICE", "MANAGED", "ASYNC", "VMM", "TOTAL", "ALLOCS", "LEDGER", "DRIVER", "STATE"
        );
        for row in &self.processes {
            let kind = |name: &str| human(row.bytes.get(name).copied().unwrap_or(0));
            let _ = writeln!(
                out,
                "{:>8}  {:<16} {:<40} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10} {:>10}  {:<8}",
                row.pid,
                truncate(&row.comm, 16),
                truncate(&row.cgroup, 40),
                kind("device"),
                kind("managed"),
                kind("async"),
                kind("vmm"),
                human(row.total_bytes),
                row.live_allocations,
                row.ledger_bytes.map_or_else(|| "-".to_string(), human),
                row.driver_bytes.map_or_else(|| "-".to_string(), human),
                row.state.map_or("-", State::name)
            );
        }
        if self.processes.is_empty() {
            let _ = writeln!(out, "(no process holds GPU memory)");
        }
        for row in &self.external_memory.processes {
            let _ = writeln!(
                out,
                "external memory (imported, not charged): pid {} in {}: {} in {} imports{}",
                row.pid,
                if row.cgroup.is_empty() { "(removed)".to_string() } else { truncate(&row.cgroup, 80) },
                human(row.bytes),
                row.imports,
                if row.unrecorded > 0 { format!(" ({} more past the record cap)", row.unrecorded) } else { String::new() }
            );
        }
        for row in self.cgroups.iter().filter(|row| row.capped) {
            let _ = writeln!(
                out,
                "capped: {} ({}) holds {} allocations ({} without a record) against a cap of {} records",
                if row.cgroup.is_empty() { "(removed)".to_string() } else { truncate(&row.cgroup, 80) },
                row.cgroup_id,
                row.live_allocations.saturating_add(row.unrecorded),
                row.unrecorded,
                self.stats.records_cap
            );
        }
        let _ = writeln!(
            out,
            "driver view (NVML): {}{}",
            self.driver.state.name(),
            self.driver.reason.as_deref().map(|reason| format!(": {reason}")).unwrap_or_default()
        );
        for note in self.driver.notes() {
            let _ = writeln!(out, "  {note}");
        }
        if let Some(dra) = &self.dra {
            let gpus: Vec<String> = dra.gpus.iter().map(|(index, capacity)| format!("gpu-{index} {}", human(*capacity))).collect();
            let form = match dra.sharing.as_str() {
                "shared" => "shared: claims share each GPU's memory (consumable capacity)",
                "whole" => "whole: each GPU goes to one claim (the API server drops the shared form: DRAConsumableCapacity is off)",
                _ => "not published yet",
            };
            let _ = writeln!(out, "DRA pool (gpu.vramguard.io, from {}): {form}; generation {}; {}", dra.source, dra.generation, gpus.join(", "));
        }
        if let Some(limits) = &self.driver_limits {
            render_driver_limits(limits, &mut out);
        }
        let probed: Vec<&str> = self.libcuda.iter().map(|f| f.path.as_str()).collect();
        let _ = writeln!(
            out,
            "libcuda probed: {}; events: {} received, {} lost",
            if probed.is_empty() { "none".to_string() } else { probed.join(", ") },
            self.stats.events_alloc + self.stats.events_free + self.stats.events_exit,
            self.stats.events_lost
        );
        out
    }
}

/// The audit's lines: which GPUs take the driver's limits (and why not), then each
/// container's limits as read back.
fn render_driver_limits(limits: &DriverLimits, out: &mut String) {
    let gpus: Vec<String> = limits
        .gpus
        .iter()
        .map(|g| match &g.why_not {
            None => format!("gpu-{} in force", g.gpu),
            Some(why) => format!("gpu-{} not in force ({why})", g.gpu),
        })
        .collect();
    let said = match (&limits.reason, gpus.is_empty()) {
        (Some(reason), _) => format!("none: {reason}"),
        (None, true) => "not read yet".to_string(),
        (None, false) => gpus.join("; "),
    };
    let _ = writeln!(out, "driver limits (per cgroup, r615+): {said}");
    for (id, container) in &limits.containers {
        let gpus: Vec<String> = container
            .gpus
            .iter()
            .map(|g| match (&g.error, g.hard, g.used) {
                (Some(error), _, _) => format!("gpu-{} quota {}: {error}", g.gpu, human(g.quota)),
                (None, Some(hard), Some(used)) => format!("gpu-{} hard {} used {}", g.gpu, human(hard), human(used)),
                _ => format!("gpu-{} quota {}: not read", g.gpu, human(g.quota)),
            })
            .collect();
        let held = match (&container.why_not, container.held) {
            (_, true) => "held by the driver".to_string(),
            (Some(why), false) => format!("not held by the driver ({why})"),
            (None, false) => "not held by the driver".to_string(),
        };
        let _ = writeln!(out, "  {} {held}: {}", truncate(id, 16), gpus.join(", "));
    }
}

/// `text` cut from the left to `width` characters, control characters shown as `?` (cgroup
/// and process names are the workloads' to choose).
fn truncate(text: &str, width: usize) -> String {
    let text: String = text.chars().map(|c| if c.is_control() { '?' } else { c }).collect();
    if text.chars().count() <= width {
        return text;
    }
    let tail: String = text.chars().rev().take(width - 1).collect::<Vec<_>>().into_iter().rev().collect();
    format!("…{tail}")
}

/// Bytes in binary units with one decimal (`0 B`, `512 B`, `14.0 MiB`, `1.5 GiB`).
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_units() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(512), "512 B");
        assert_eq!(human(14 << 20), "14.0 MiB");
        assert_eq!(human(3 << 29), "1.5 GiB");
    }

    #[test]
    fn the_table_shows_ledger_bytes_and_states() {
        let row = |pid, state, ledger_bytes| ProcessRow { pid, state, ledger_bytes, total_bytes: 1 << 20, ..Default::default() };
        let snapshot = Snapshot {
            processes: vec![row(7, Some(State::Tampered), Some(0)), row(8, Some(State::Unhooked), None), row(9, None, None)],
            ..Default::default()
        };
        let table = snapshot.render_table();
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].trim_end().ends_with("LEDGER     DRIVER  STATE"), "{table}");
        assert!(lines[1].trim_end().ends_with("0 B          -  tampered"), "{table}");
        assert!(lines[2].trim_end().ends_with("-          -  unhooked"), "{table}");
        assert!(lines[3].trim_end().ends_with("-          -  -"), "{table}");
        let json = serde_json::to_value(&snapshot.processes[0]).expect("json");
        assert_eq!(json["state"], "tampered");
        assert_eq!(json["ledger_bytes"], 0);
    }

    #[test]
    fn the_table_names_capped_cgroups() {
        let capped = CgroupRow { cgroup_id: 77, cgroup: "/flood".into(), live_allocations: 10, unrecorded: 5, capped: true, ..Default::default() };
        let fine = CgroupRow { cgroup_id: 78, cgroup: "/fine".into(), live_allocations: 3, ..Default::default() };
        let mut snapshot = Snapshot { cgroups: vec![capped, fine], ..Default::default() };
        snapshot.stats.records_cap = 10;
        let table = snapshot.render_table();
        assert!(table.contains("capped: /flood (77) holds 15 allocations (5 without a record) against a cap of 10 records"), "{table}");
        assert!(!table.contains("/fine"), "{table}");
    }

    #[test]
    fn truncates_from_the_left() {
        assert_eq!(truncate("/a/b", 10), "/a/b");
        assert_eq!(truncate("/kubepods/pod1234/abcdef", 8), "…/abcdef");
    }
}
