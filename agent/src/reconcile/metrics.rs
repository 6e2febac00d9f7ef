//! The agent's Prometheus metrics (rendered from the last reconcile pass's state, at most once
//! per pass by the reconcile task, and served on `--metrics-addr` by [`crate::serve`]).
//!
//! Per ledger and device (labels `ledger`, the file's path, `device_index`, `device_uuid`,
//! empty when the ledger does not know it): `vramguard_container_memory_used_bytes` (what the
//! ledger charges, by `kind`: data, small, context, managed; the kinds sum to the device's
//! usage) and `vramguard_container_memory_limit_bytes`. From the eBPF view:
//! `vramguard_ebpf_process_memory_bytes{pid,cgroup}`. From [`crate::reconcile`]:
//! `vramguard_process_state{pid,state}` (one series per state, 1 for the process's current
//! one), `vramguard_unhooked_processes`, from the driver view ([`crate::driver`]):
//! `vramguard_driver_up`, `vramguard_driver_state{state,reason}`, `vramguard_driver_read_seconds`
//! (registered by the driver task, which times its reads),
//! `vramguard_driver_process_memory_bytes{pid,cgroup}`, `vramguard_driver_unattributed_bytes`
//! (the driver's bytes of processes joined with none the agent sees),
//! `vramguard_device_unexplained_bytes{device_index,device_uuid,cgroup_id}` (GPU memory no
//! listed process explains, [`crate::driver::gap`], and the cgroup it is charged to),
//! `vramguard_device_driver_reserve_bytes{device_index,device_uuid}`,
//! `vramguard_driver_rows_without_figure{device_index,device_uuid}` and
//! `vramguard_container_driver_memory_bytes{ledger}` (what the driver reports the ledger's
//! processes and the other processes of its container's cgroups holding, contexts included),
//! `vramguard_container_ebpf_memory_bytes{ledger}` (the
//! eBPF bytes of the ledger's processes, comparable with the ledger's data, small and managed
//! bytes), `vramguard_container_unaccounted_bytes{ledger}` (what the agent charges the ledger
//! for memory its container holds outside it, [`crate::ledgers::charge`]; also counted in the `data`
//! kind of the used bytes) and `vramguard_container_rejections_total{ledger,device_index}`
//! (the ledger's own count of refused reservations).
//!
//! Every per-ledger family also has the container's labels: `namespace`, `pod`, `container`
//! (for a container the agent provisioned, the runtime's names; otherwise the names the hook
//! recorded in the ledger from the downward API, [`ledger::Ledger::names`]: informational,
//! since a workload can write them; empty when none are recorded) and
//! `pod_uid` (from the cgroup path of a live slot's host process, [`crate::pod`]; kept once
//! found while the ledger is watched; empty until then). With `--hami-metrics` the used and
//! limit bytes are also published under HAMi's monitor names,
//! `hami_vgpu_memory_used_bytes` and `hami_vgpu_memory_limit_bytes` with labels `namespace`,
//! `pod`, `container`, `vdevice_index`, `device_uuid` and HAMi's constant `zone="vGPU"`, for ledgers whose names are known
//! (without them the series of different containers would collide). Of the agent itself:
//! `vramguard_reclaims_total`, `vramguard_reclaim_latency_seconds`,
//! `vramguard_reclaim_sweeps_total{sweep}`, `vramguard_reclaim_ledgers_read_total{sweep}`,
//! `vramguard_reclaim_proc_reads_total`, `vramguard_reclaim_watched`,
//! `vramguard_ledger_dir_listings_total{why}`,
//! `vramguard_reconcile_pass_seconds`,
//! `vramguard_events_lost_total`, `vramguard_over_limit_allocations_total`,
//! `vramguard_enforcement_signals_total`, `vramguard_probes_attached{libcuda, links}`,
//! `vramguard_libcuda_files{state}` (probed, failed, capped),
//! `vramguard_libcuda_capped_containers`, `vramguard_discovery_maps_over_bound_total`,
//! `vramguard_discovery_panics_total`, `vramguard_discovery_maps_read_total{reason}`,
//! `vramguard_discovery_rescans_total`, `vramguard_discovery_found_by_rescan_total`,
//! `vramguard_discovery_events_lost_total`, `vramguard_ledgers`,
//! `vramguard_ledgers_skipped`, `vramguard_ledgers_unreadable`, `vramguard_ledger_workers`,
//! `vramguard_ledgers_backed_off` (ledgers left alone for a while: lock held, worker failed),
//! `vramguard_ledger_dirs_crowded` (directories with more entries than the agent reads),
//! `vramguard_provisioned_containers`, `vramguard_nri_connected`,
//! `vramguard_provision_gpus_undetermined_total` (with `--nri`). Of the kernel side
//! ([`crate::kernel`]): `vramguard_kernel_trouble_total{kind}` (records refused by the
//! per-cgroup cap, full maps, lost events and exits, suppressed log lines),
//! `vramguard_cgroup_alloc_records_capped{cgroup,cgroup_id}` (1 for a cgroup at its cap),
//! `vramguard_cgroup_unrecorded_allocations{cgroup,cgroup_id}`, `vramguard_alloc_records`, `vramguard_alloc_spare_records`,
//! `vramguard_external_memory_bytes{cgroup,cgroup_id}` (imported external memory: never charged),
//! `vramguard_alloc_records_per_cgroup_cap` and `vramguard_cgroups_removed_total{by}` (map
//! entries of removed cgroups deleted by the `kernel` tracepoint or the agent's `sweep`),
//! `vramguard_records_swept_total{by}` (records the sweeps examined: `exit`, the exited
//! processes' own; `full`, every record, only after losses), `vramguard_full_sweeps_total`,
//! `vramguard_record_index_keys`, `vramguard_record_index_overflows_total`,
//! `vramguard_cgroup_tree_walks_total` and `vramguard_agent_signals_total{why}` (the agent's
//! own signals to processes over their cgroup's limit: `escaped`, for memory neither the
//! probes see nor a ledger charges, `unadmitted`, for memory no ledger charges, or
//! `admitted`, a limit below what the ledger admits).
//! Families kept elsewhere join through [`Metrics::register`] (`vramguard_http_connections_total`,
//! [`crate::serve::http`]). Gauges are rebuilt from the current state at each render
//! ([`Metrics::refresh`]).
use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use anyhow::{Context, Result};
use ledger::{layout::KINDS, Kind, ProcessIdentity, SlotView};
use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};
use tracing::warn;

use crate::{
    identity,
    inspect::uuid_text,
    kernel,
    ledgers::{task::Reclaims, Ledgers},
    pod,
    reconcile::{Reconciler, State},
    snapshot::Snapshot,
};

/// Duration buckets of a reconcile pass, in seconds (100 us to 1 s).
const PASS_BUCKETS: [f64; 9] = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01, 0.025, 0.1, 1.0];

/// Latency buckets of a reclaim, in seconds (1 ms to 5 s).
const LATENCY_BUCKETS: [f64; 12] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

pub struct Metrics {
    registry: Registry,
    used: IntGaugeVec,
    limit: IntGaugeVec,
    ebpf_process: IntGaugeVec,
    reclaims: IntCounter,
    latency: Histogram,
    sweeps: IntCounterVec,
    ledgers_read: IntCounterVec,
    proc_reads: IntCounter,
    watched: IntGauge,
    listings: IntCounterVec,
    pass: Histogram,
    events_lost: IntCounter,
    over_limit: IntCounter,
    signals: IntCounter,
    probes: IntGaugeVec,
    libcuda_files: IntGaugeVec,
    capped_containers: IntGauge,
    maps_over_bound: IntCounter,
    discovery_panics: IntCounter,
    maps_read: IntCounterVec,
    rescans: IntCounter,
    found_by_rescan: IntCounter,
    discovery_events_lost: IntCounter,
    ledgers: IntGauge,
    ledgers_skipped: IntGauge,
    ledger_workers: IntGauge,
    provisioned: IntGauge,
    nri_connected: IntGauge,
    gpus_undetermined: IntCounter,
    ledgers_unreadable: IntGauge,
    ledgers_backed_off: IntGauge,
    ledger_dirs_crowded: IntGauge,
    process_state: IntGaugeVec,
    unhooked: IntGauge,
    driver_up: IntGauge,
    driver_state: IntGaugeVec,
    driver_process: IntGaugeVec,
    driver_unattributed: IntGauge,
    device_unexplained: IntGaugeVec,
    device_reserve: IntGaugeVec,
    rows_without_figure: IntGaugeVec,
    kernel_trouble: IntCounterVec,
    capped: IntGaugeVec,
    unrecorded: IntGaugeVec,
    external: IntGaugeVec,
    alloc_records: IntGauge,
    spare_records: IntGauge,
    records_cap: IntGauge,
    cgroups_removed: IntCounterVec,
    records_swept: IntCounterVec,
    full_sweeps: IntCounter,
    record_index_keys: IntGauge,
    record_index_overflows: IntCounter,
    cgroup_tree_walks: IntCounter,
    agent_signals: IntCounterVec,
    container_ebpf: IntGaugeVec,
    container_driver: IntGaugeVec,
    container_held: IntGaugeVec,
    unaccounted: IntGaugeVec,
    rejections: IntCounterVec,
    /// The label values `rejections` has series for.
    rejection_series: BTreeSet<Vec<String>>,
    /// The pod UID found for each watched ledger (by path).
    pod_uids: BTreeMap<String, String>,
    hami: Option<Hami>,
    /// The agent's own identity (its slots are not a container's processes).
    agent: Option<ProcessIdentity>,
}

/// HAMi's monitor families (`--hami-metrics`).
struct Hami {
    used: IntGaugeVec,
    limit: IntGaugeVec,
}

/// The container labels every per-ledger family has, after its own.
const CONTAINER_LABELS: [&str; 4] = ["namespace", "pod", "container", "pod_uid"];

/// `own` followed by [`CONTAINER_LABELS`].
fn with_container(own: &[&'static str]) -> Vec<&'static str> {
    own.iter().copied().chain(CONTAINER_LABELS).collect()
}

/// A ledger's container labels, in [`CONTAINER_LABELS`] order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Container {
    namespace: String,
    pod: String,
    container: String,
    pod_uid: String,
}

impl Container {
    fn values(&self) -> [&str; 4] {
        [&self.namespace, &self.pod, &self.container, &self.pod_uid]
    }

    fn named(&self) -> bool {
        !(self.namespace.is_empty() && self.pod.is_empty() && self.container.is_empty())
    }
}

/// `own` label values followed by the container's.
fn labels<'a>(own: &[&'a str], container: &'a Container) -> Vec<&'a str> {
    own.iter().copied().chain(container.values()).collect()
}

/// The pod UID of the first live slot whose host process still is the slot's process and
/// runs in a pod's cgroup; the agent's own slot (`agent`, [`crate::ledgers::charge`]) is not the
/// container's.
fn pod_uid_of(slots: &[SlotView], agent: Option<ProcessIdentity>) -> Option<String> {
    slots.iter().filter(|view| view.slot.host_pid != 0).find_map(|view| {
        let process = identity::identity_of(view.slot.host_pid)?;
        if process != view.slot.process() || Some(process) == agent {
            return None;
        }
        pod::of_pid(view.slot.host_pid).map(|identity| identity.pod_uid)
    })
}

/// `collector`, registered with `registry`.
fn registered<C: prometheus::core::Collector + Clone + 'static>(registry: &Registry, collector: C) -> Result<C> {
    registry.register(Box::new(collector.clone()))?;
    Ok(collector)
}

fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> Result<IntGaugeVec> {
    registered(registry, IntGaugeVec::new(Opts::new(name, help), labels)?).with_context(|| format!("registering {name}"))
}

/// Brings a counter up to a total kept elsewhere (the kernel's counts only grow).
fn catch_up(counter: &IntCounter, total: u64) {
    let counted = counter.get();
    if total > counted {
        counter.inc_by(total - counted);
    }
}

/// A byte count as a gauge value.
fn value(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

impl Metrics {
    /// The agent's metrics; `hami`: also HAMi's monitor families.
    pub fn new(hami: bool) -> Result<Metrics> {
        let registry = Registry::new();
        let used = gauge_vec(
            &registry,
            "vramguard_container_memory_used_bytes",
            "GPU memory a container's ledger charges, by kind",
            &with_container(&["ledger", "device_index", "device_uuid", "kind"]),
        )?;
        let limit = gauge_vec(
            &registry,
            "vramguard_container_memory_limit_bytes",
            "GPU memory quota of a container's ledger",
            &with_container(&["ledger", "device_index", "device_uuid"]),
        )?;
        let ebpf_process = gauge_vec(
            &registry,
            "vramguard_ebpf_process_memory_bytes",
            "GPU memory a process holds as the eBPF probes saw it",
            &["pid", "cgroup"],
        )?;
        let probes = gauge_vec(&registry, "vramguard_probes_attached", "Probes attached per libcuda file, by how the kernel links them (links: uprobe_multi or perf_event)", &["libcuda", "links"])?;
        let libcuda_files = gauge_vec(
            &registry,
            "vramguard_libcuda_files",
            "Files discovery looked at, by state: probed, failed (unreadable, malformed, refused by the kernel), capped (a libcuda left unprobed by --max-probed-per-container or --max-probed-files)",
            &["state"],
        )?;
        let maps_over_bound = registered(&registry, IntCounter::new(
            "vramguard_discovery_maps_over_bound_total",
            "Processes whose /proc/<pid>/maps was over the bytes or lines discovery reads (read up to the bound, not again while they run; listed in vramguard audit's discovery.skipped)",
        )?)?;
        let discovery_panics = registered(&registry, IntCounter::new(
            "vramguard_discovery_panics_total",
            "Files and processes' maps whose reading panicked in discovery: each skipped (listed in vramguard audit's discovery.skipped), the probes kept",
        )?)?;
        let maps_read = registered(&registry, IntCounterVec::new(
            Opts::new(
                "vramguard_discovery_maps_read_total",
                "Processes' /proc/<pid>/maps read by discovery: reason=\"event\" (the kernel told of an exec, or of a file mapped or made executable), reason=\"rescan\" (every process: at start, every --full-rescan-ms, after events were lost), reason=\"new\" (without the kernel's word: a process of the last minute)",
            ),
            &["reason"],
        )?)?;
        let rescans = registered(&registry, IntCounter::new(
            "vramguard_discovery_rescans_total",
            "Scans of every process's maps after the first (every --full-rescan-ms, and after events were lost)",
        )?)?;
        let found_by_rescan = registered(&registry, IntCounter::new(
            "vramguard_discovery_found_by_rescan_total",
            "Libcuda files (probed or capped) a scan of every process found that no event of the kernel's led to",
        )?)?;
        let discovery_events_lost = registered(&registry, IntCounter::new(
            "vramguard_discovery_events_lost_total",
            "The kernel's events of new executable mappings that found its map of processes full (each makes discovery read every process's maps)",
        )?)?;
        let capped_containers = registered(&registry, IntGauge::new(
            "vramguard_libcuda_capped_containers",
            "Containers (cgroups) whose processes mapped more libcuda files than --max-probed-per-container",
        )?)?;
        let reclaims = registered(&registry, IntCounter::new("vramguard_reclaims_total", "Ledger slots of dead processes reclaimed")?)?;
        let latency = registered(&registry, Histogram::with_opts(
            HistogramOpts::new(
                "vramguard_reclaim_latency_seconds",
                "From a process's exit (the time the kernel gave its exit event; or the sweep that found it dead) to its slot reclaimed",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )?)?;
        let sweeps = registered(&registry, IntCounterVec::new(
            Opts::new(
                "vramguard_reclaim_sweeps_total",
                "Reclaim sweeps: sweep=\"exit\" for exiting processes (the ledgers each was found in), sweep=\"all\" of every watched ledger",
            ),
            &["sweep"],
        )?)?;
        let ledgers_read = registered(&registry, IntCounterVec::new(
            Opts::new(
                "vramguard_reclaim_ledgers_read_total",
                "Ledgers read by reclaim sweeps: sweep=\"exit\" those of exiting processes (the ledgers each was found in), sweep=\"all\" every watched ledger (every --ledger-scan-ms, and for the exit of a process no sweep has seen)",
            ),
            &["sweep"],
        )?)?;
        let proc_reads = registered(&registry, IntCounter::new(
            "vramguard_reclaim_proc_reads_total",
            "Reads of /proc/<pid> made by reclaim sweeps to judge a slot's process (a process watched through a pidfd needs none)",
        )?)?;
        let watched = registered(&registry, IntGauge::new(
            "vramguard_reclaim_watched",
            "Live processes in ledgers watched through a pidfd, whose slots the exit path frees when they exit",
        )?)?;
        let listings = registered(&registry, IntCounterVec::new(
            Opts::new(
                "vramguard_ledger_dir_listings_total",
                "Listings of --ledger-dir by the scans, by why: first, changed (inotify said so), rescan (the periodic full listing), unwatched (no inotify)",
            ),
            &["why"],
        )?)?;
        let pass = registered(&registry, Histogram::with_opts(
            HistogramOpts::new(
                "vramguard_reconcile_pass_seconds",
                "One reconcile pass: the eBPF view read, joined with the ledgers, judged, and the charges updated",
            )
            .buckets(PASS_BUCKETS.to_vec()),
        )?)?;
        let events_lost = registered(&registry, IntCounter::new("vramguard_events_lost_total", "Allocation and free events lost (always 0: the probes count them in maps and send no such events any more; exits: vramguard_kernel_trouble_total{kind=\"exit_events_lost\"})")?)?;
        let over_limit = registered(&registry, IntCounter::new(
            "vramguard_over_limit_allocations_total",
            "Allocations by un-hooked workloads that would pass their cgroup's limit (limits file)",
        )?)?;
        let signals = registered(&registry, IntCounter::new("vramguard_enforcement_signals_total", "Signals sent to stop allocations over a cgroup's limit")?)?;
        let ledgers = registered(&registry, IntGauge::new("vramguard_ledgers", "Ledgers watched under --ledger-dir")?)?;
        let ledgers_skipped =
            registered(&registry, IntGauge::new("vramguard_ledgers_skipped", "Files under --ledger-dir skipped as invalid ledgers")?)?;
        let ledger_workers = registered(&registry, IntGauge::new(
            "vramguard_ledger_workers",
            "Confined ledger worker processes running (one per ledger with recent locked operations)",
        )?)?;
        let provisioned = registered(&registry, IntGauge::new(
            "vramguard_provisioned_containers",
            "Containers the agent provisioned (--nri) that the runtime still has",
        )?)?;
        let gpus_undetermined = registered(&registry, IntCounter::new(
            "vramguard_provision_gpus_undetermined_total",
            "Containers with a quota held to every GPU because the runtime did not say which GPUs they were given",
        )?)?;
        let nri_connected = registered(&registry, IntGauge::new(
            "vramguard_nri_connected",
            "1 while the agent is registered with the container runtime as an NRI plugin (--nri)",
        )?)?;
        let ledgers_unreadable = registered(&registry, IntGauge::new(
            "vramguard_ledgers_unreadable",
            "Watched ledgers the last reconcile pass could not read (cut or grown under the agent)",
        )?)?;
        let ledgers_backed_off = registered(&registry, IntGauge::new(
            "vramguard_ledgers_backed_off",
            "Watched ledgers the agent leaves alone for a while (their lock stayed held, or their worker failed or timed out): see vramguard audit's ledger_problems",
        )?)?;
        let ledger_dirs_crowded = registered(&registry, IntGauge::new(
            "vramguard_ledger_dirs_crowded",
            "Directories under --ledger-dir holding more entries or ledgers than the agent reads (the rest is not watched): see vramguard audit's ledger_problems",
        )?)?;
        let process_state = gauge_vec(
            &registry,
            "vramguard_process_state",
            "Reconciliation state of a process (1 for its current state): ok, drift, unhooked, stale, tampered, unprobed",
            &["pid", "state"],
        )?;
        let driver_up = registered(&registry, IntGauge::new("vramguard_driver_up", "1 while the driver view (NVML) answers, else 0 (see vramguard_driver_state and vramguard audit's driver.reason)")?)?;
        let driver_state = gauge_vec(
            &registry,
            "vramguard_driver_state",
            "The driver view's state (1 for the current one): starting, ok, absent, failing, hung; `reason` says why it is not ok",
            &["state", "reason"],
        )?;
        let driver_process = gauge_vec(
            &registry,
            "vramguard_driver_process_memory_bytes",
            "GPU memory the driver (NVML) reports a process holding over every device, its contexts included",
            &["pid", "cgroup"],
        )?;
        let driver_unattributed = registered(
            &registry,
            IntGauge::new(
                "vramguard_driver_unattributed_bytes",
                "GPU memory the driver (NVML) reports for processes joined with none the agent sees (vramguard audit's driver.unjoined: a pid gone, reused, or of another pid namespace)",
            )?,
        )?;
        let device_labels = ["device_index", "device_uuid"];
        let device_unexplained = gauge_vec(
            &registry,
            "vramguard_device_unexplained_bytes",
            "GPU memory no process NVML lists explains: used less the listed processes' figures less the driver's reserve (measured with no process); cgroup_id: the cgroup it is attributed to and charged to (its processes hold the GPU's device file), empty when none",
            &["device_index", "device_uuid", "cgroup_id"],
        )?;
        let device_reserve = gauge_vec(&registry, "vramguard_device_driver_reserve_bytes", "The driver's own memory on a GPU, measured with no process holding its device file", &device_labels)?;
        let rows_without_figure = gauge_vec(&registry, "vramguard_driver_rows_without_figure", "Processes NVML lists on a GPU without a figure (NVML_VALUE_NOT_AVAILABLE): counted, their memory unexplained", &device_labels)?;
        let unhooked = registered(&registry, IntGauge::new("vramguard_unhooked_processes", "Processes holding GPU memory without a ledger slot")?)?;
        let container_ebpf = gauge_vec(
            &registry,
            "vramguard_container_ebpf_memory_bytes",
            "GPU memory the eBPF probes saw a container's (ledger's) processes hold",
            &with_container(&["ledger"]),
        )?;
        let container_driver = gauge_vec(
            &registry,
            "vramguard_container_driver_memory_bytes",
            "GPU memory the driver (NVML) reports a container's processes holding (its ledger's and the others of its cgroups), contexts included",
            &with_container(&["ledger"]),
        )?;
        let container_held = gauge_vec(
            &registry,
            "vramguard_container_memory_held_bytes",
            "The one figure of a container (ledger): over its processes (its ledger's and the others of its cgroups), the larger of what the probes (live and pool-kept), the ledger and the driver say each holds, a context per device aside",
            &with_container(&["ledger"]),
        )?;
        let unaccounted = gauge_vec(
            &registry,
            "vramguard_container_unaccounted_bytes",
            "GPU memory the agent charges a container's ledger for memory its processes hold outside it (un-hooked or tampering processes)",
            &with_container(&["ledger"]),
        )?;
        let rejections = registered(&registry, IntCounterVec::new(
            Opts::new("vramguard_container_rejections_total", "Reservations a container's ledger refused"),
            &with_container(&["ledger", "device_index"]),
        )?)?;
        let kernel_trouble = registered(&registry, IntCounterVec::new(
            Opts::new(
                "vramguard_kernel_trouble_total",
                "Trouble the eBPF programs met, by kind: records_capped, allocs_map_full, procs_map_full, cgroups_map_full, events_lost, exit_events_lost, untracked_allocs, log_lines_suppressed, journal_lost",
            ),
            &["kind"],
        )?)?;
        let cgroup_labels = ["cgroup", "cgroup_id"];
        let capped = gauge_vec(
            &registry,
            "vramguard_cgroup_alloc_records_capped",
            "1 for a cgroup holding at least its cap of live allocations: its new allocations are charged without a record",
            &cgroup_labels,
        )?;
        let unrecorded = gauge_vec(
            &registry,
            "vramguard_cgroup_unrecorded_allocations",
            "Live allocations of a cgroup charged without a record (past its cap, or the node's record map full)",
            &cgroup_labels,
        )?;
        let external = gauge_vec(
            &registry,
            "vramguard_external_memory_bytes",
            "Bytes of external memory (cuImportExternalMemory) a cgroup's processes imported and have not destroyed: the exporter's memory, never charged to the cgroup",
            &cgroup_labels,
        )?;
        let alloc_records = registered(&registry, IntGauge::new("vramguard_alloc_records", "Allocation records in the kernel map now")?)?;
        let spare_records = registered(&registry, IntGauge::new(
            "vramguard_alloc_spare_records",
            "Of the allocation records, those of freed device pointers kept for the driver's reuse of the address",
        )?)?;
        let records_cap = registered(&registry, IntGauge::new(
            "vramguard_alloc_records_per_cgroup_cap",
            "Live allocation records one cgroup may have (--max-alloc-records-per-cgroup)",
        )?)?;
        let cgroups_removed = registered(&registry, IntCounterVec::new(
            Opts::new(
                "vramguard_cgroups_removed_total",
                "Removed cgroups whose kernel map entries were deleted, by the cgroup_rmdir tracepoint (by=kernel, cgroups) or the agent's sweep (by=sweep, entries)",
            ),
            &["by"],
        )?)?;
        let records_swept = registered(&registry, IntCounterVec::new(
            Opts::new(
                "vramguard_records_swept_total",
                "Allocation records the agent's sweeps examined: by=exit, the exited processes' own records; by=full, every record (only after lost exits or journal entries)",
            ),
            &["by"],
        )?)?;
        let full_sweeps = registered(&registry, IntCounter::new(
            "vramguard_full_sweeps_total",
            "Sweeps of every allocation record (run at the --sweep-ms tick only after lost exits or journal entries, or a full index)",
        )?)?;
        let record_index_keys = registered(&registry, IntGauge::new(
            "vramguard_record_index_keys",
            "Keys in the agent's index of allocation records by process",
        )?)?;
        let record_index_overflows = registered(&registry, IntCounter::new(
            "vramguard_record_index_overflows_total",
            "Record keys the agent's index could not take (at its cap): each makes a full sweep due",
        )?)?;
        let cgroup_tree_walks = registered(&registry, IntCounter::new(
            "vramguard_cgroup_tree_walks_total",
            "Walks of the cgroup2 tree (done when the tree changed, not on a timer)",
        )?)?;
        let agent_signals = registered(&registry, IntCounterVec::new(
            Opts::new(
                "vramguard_agent_signals_total",
                "Signals the agent sent to processes over their cgroup's limit (--enforce signal), by why each was chosen: escaped (memory neither the probes see nor a ledger charges), unadmitted (memory no ledger charges), admitted (a limit below what the ledger admits); also counted in vramguard_enforcement_signals_total",
            ),
            &["why"],
        )?)?;
        let hami = if hami {
            let labels = ["namespace", "pod", "container", "vdevice_index", "device_uuid"];
            // HAMi's monitor marks its per-container families with a constant zone.
            let hami_gauge = |name: &str, help: &str| -> Result<IntGaugeVec> {
                let opts = Opts::new(name, help).const_label("zone", "vGPU");
                registered(&registry, IntGaugeVec::new(opts, &labels)?).with_context(|| format!("registering {name}"))
            };
            Some(Hami {
                used: hami_gauge("hami_vgpu_memory_used_bytes", "GPU memory a container uses (HAMi's monitor name)")?,
                limit: hami_gauge("hami_vgpu_memory_limit_bytes", "GPU memory limit of a container (HAMi's monitor name)")?,
            })
        } else {
            None
        };
        Ok(Metrics {
            registry,
            used,
            limit,
            ebpf_process,
            reclaims,
            latency,
            sweeps,
            ledgers_read,
            proc_reads,
            watched,
            listings,
            pass,
            events_lost,
            over_limit,
            signals,
            probes,
            libcuda_files,
            capped_containers,
            maps_over_bound,
            discovery_panics,
            maps_read,
            rescans,
            found_by_rescan,
            discovery_events_lost,
            ledgers,
            ledgers_skipped,
            ledger_workers,
            provisioned,
            nri_connected,
            gpus_undetermined,
            ledgers_unreadable,
            ledgers_backed_off,
            ledger_dirs_crowded,
            process_state,
            unhooked,
            driver_up,
            driver_state,
            driver_process,
            driver_unattributed,
            device_unexplained,
            device_reserve,
            rows_without_figure,
            kernel_trouble,
            capped,
            unrecorded,
            external,
            alloc_records,
            spare_records,
            records_cap,
            cgroups_removed,
            records_swept,
            full_sweeps,
            record_index_keys,
            record_index_overflows,
            cgroup_tree_walks,
            agent_signals,
            container_ebpf,
            container_driver,
            container_held,
            unaccounted,
            rejections,
            rejection_series: BTreeSet::new(),
            pod_uids: BTreeMap::new(),
            hami,
            agent: ProcessIdentity::current().ok(),
        })
    }

    /// Adds a family another module keeps up to date to what [`Metrics::encode`] renders.
    pub fn register(&self, family: Box<dyn prometheus::core::Collector>) -> Result<()> {
        Ok(self.registry.register(family)?)
    }

    /// Provisioning's state: containers provisioned, whether NRI is connected.
    pub fn set_provisioning(&self, containers: usize, nri_connected: bool, gpus_undetermined: u64) {
        catch_up(&self.gpus_undetermined, gpus_undetermined);
        self.provisioned.set(containers as i64);
        self.nri_connected.set(i64::from(nri_connected));
    }

    /// Times one reconcile pass.
    pub fn passed(&self, took: Duration) {
        self.pass.observe(took.as_secs_f64());
    }

    /// Counts one reclaim.
    pub fn reclaimed(&self, latency: Duration) {
        self.reclaims().observe(latency);
    }

    /// The reclaim counters, for the task that reclaims.
    pub fn reclaims(&self) -> Reclaims {
        Reclaims::new(
            self.reclaims.clone(),
            self.latency.clone(),
            self.sweeps.clone(),
            self.ledgers_read.clone(),
            self.proc_reads.clone(),
            self.watched.clone(),
            self.listings.clone(),
        )
    }

    /// Rebuilds the gauges from the current state.
    /// `charged`: what the agent charges each ledger (by path) for memory held outside it.
    pub fn refresh(&mut self, ledgers: Option<&Ledgers>, snapshot: &Snapshot, reconciler: &Reconciler, charged: &BTreeMap<&str, u64>) {
        let probes = &snapshot.libcuda;
        self.used.reset();
        self.unaccounted.reset();
        self.limit.reset();
        self.container_ebpf.reset();
        self.container_driver.reset();
        self.container_held.reset();
        let driver_by_ledger = reconciler.driver_bytes_by_ledger();
        let held_by_ledger = reconciler.held_bytes_by_ledger();
        if let Some(hami) = &self.hami {
            hami.used.reset();
            hami.limit.reset();
        }
        let ebpf_by_ledger = reconciler.ebpf_bytes_by_ledger();
        let mut rejection_series = BTreeSet::new();
        if let Some(ledgers) = ledgers {
            self.ledgers.set(ledgers.len() as i64);
            self.ledgers_skipped.set(ledgers.skipped() as i64);
            self.ledger_workers.set(ledgers.workers() as i64);
            self.ledgers_backed_off.set(ledgers.backed_off() as i64);
            self.ledger_dirs_crowded.set(ledgers.crowded() as i64);
            for (path, ledger) in ledgers.iter() {
                let header = ledger.header();
                // One private copy per ledger and render (see crate::ledgers).
                let copy = match ledger.copy() {
                    Ok(copy) => copy,
                    Err(error) => {
                        warn!(ledger = %path.display(), %error, "cannot read the ledger for metrics");
                        continue;
                    }
                };
                let slots = copy.live_slots();
                let path = path.display().to_string();
                if let Some(uid) = pod_uid_of(&slots, self.agent) {
                    self.pod_uids.insert(path.clone(), uid);
                }
                // A provisioned container's names are the runtime's; others' are what a hook wrote.
                let container = match ledgers.pinned(std::path::Path::new(&path)) {
                    Some(pin) => {
                        let [namespace, pod, container, pod_uid] = pin.names.clone();
                        Container { namespace, pod, container, pod_uid }
                    }
                    None => {
                        let (namespace, pod, container) = copy.names.text().unwrap_or_default();
                        let pod_uid = self.pod_uids.get(&path).cloned().unwrap_or_default();
                        Container { namespace, pod, container, pod_uid }
                    }
                };
                self.container_ebpf
                    .with_label_values(&labels(&[path.as_str()], &container))
                    .set(value(ebpf_by_ledger.get(path.as_str()).copied().unwrap_or(0)));
                if let Some(bytes) = driver_by_ledger.get(path.as_str()) {
                    self.container_driver.with_label_values(&labels(&[path.as_str()], &container)).set(value(*bytes));
                }
                self.container_held
                    .with_label_values(&labels(&[path.as_str()], &container))
                    .set(value(held_by_ledger.get(path.as_str()).copied().unwrap_or(0)));
                self.unaccounted
                    .with_label_values(&labels(&[path.as_str()], &container))
                    .set(value(charged.get(path.as_str()).copied().unwrap_or(0)));
                for (index, device) in copy.devices.iter().enumerate() {
                    let index = index.to_string();
                    let key: Vec<String> = labels(&[path.as_str(), &index], &container).into_iter().map(String::from).collect();
                    self.set_rejections(&key, device.rejections);
                    rejection_series.insert(key);
                }
                for (index, device) in header.devices[..header.device_count as usize].iter().enumerate() {
                    let index_text = index.to_string();
                    let uuid = uuid_text(&device.uuid);
                    self.limit.with_label_values(&labels(&[path.as_str(), &index_text, &uuid], &container)).set(value(device.limit));
                    let mut chunks = [0u64; KINDS];
                    for view in &slots {
                        for (sum, charged) in chunks.iter_mut().zip(view.slot.devices[index].chunks) {
                            *sum = sum.saturating_add(charged);
                        }
                    }
                    for kind in Kind::ALL {
                        let bytes = chunks[kind as usize].saturating_mul(device.chunk);
                        self.used
                            .with_label_values(&labels(&[path.as_str(), &index_text, &uuid, kind.name()], &container))
                            .set(value(bytes));
                    }
                    if let Some(hami) = self.hami.as_ref().filter(|_| container.named()) {
                        let total = chunks.iter().fold(0u64, |sum, c| sum.saturating_add(*c)).saturating_mul(device.chunk);
                        let hami_labels = [container.namespace.as_str(), &container.pod, &container.container, &index_text, &uuid];
                        hami.used.with_label_values(&hami_labels).set(value(total));
                        hami.limit.with_label_values(&hami_labels).set(value(device.limit));
                    }
                }
            }
        }
        for stale in self.rejection_series.difference(&rejection_series) {
            let values: Vec<&str> = stale.iter().map(String::as_str).collect();
            let _ = self.rejections.remove_label_values(&values);
        }
        self.rejection_series = rejection_series;
        match ledgers {
            Some(ledgers) => self.pod_uids.retain(|path, _| ledgers.iter().any(|(p, _)| p.display().to_string() == *path)),
            None => self.pod_uids.clear(),
        }
        self.process_state.reset();
        for verdict in reconciler.verdicts() {
            let pid = verdict.pid.to_string();
            for state in State::ALL {
                self.process_state.with_label_values(&[pid.as_str(), state.name()]).set(i64::from(state == verdict.state));
            }
        }
        self.unhooked.set(reconciler.verdicts().iter().filter(|v| v.state == State::Unhooked).count() as i64);
        self.ledgers_unreadable.set(reconciler.unreadable().len() as i64);
        self.driver_up.set(i64::from(snapshot.driver.state == crate::driver::State::Ok));
        self.driver_state.reset();
        let reason = snapshot.driver.reason.as_deref().unwrap_or("");
        self.driver_state.with_label_values(&[snapshot.driver.state.name(), reason]).set(1);
        self.driver_unattributed.set(value(snapshot.driver.unjoined.iter().fold(0u64, |sum, p| sum.saturating_add(p.bytes))));
        self.device_unexplained.reset();
        self.device_reserve.reset();
        self.rows_without_figure.reset();
        for device in &snapshot.driver.devices {
            let index = device.index.to_string();
            if let Some(bytes) = device.gap.unexplained {
                let cgroup = device.gap.cgroup_id.map(|id| id.to_string()).unwrap_or_default();
                self.device_unexplained.with_label_values(&[index.as_str(), &device.uuid, &cgroup]).set(value(bytes));
            }
            if let Some(reserve) = device.gap.reserve {
                self.device_reserve.with_label_values(&[index.as_str(), &device.uuid]).set(value(reserve));
            }
            self.rows_without_figure.with_label_values(&[index.as_str(), &device.uuid]).set(i64::from(device.unfigured));
        }
        self.driver_process.reset();
        for row in &snapshot.processes {
            if let Some(bytes) = row.driver_bytes {
                self.driver_process.with_label_values(&[row.pid.to_string().as_str(), &row.cgroup]).set(value(bytes));
            }
        }
        self.ebpf_process.reset();
        for row in &snapshot.processes {
            self.ebpf_process.with_label_values(&[row.pid.to_string().as_str(), &row.cgroup]).set(value(row.total_bytes));
        }
        // The kernel keeps these counts; the counters catch up with them.
        for (counter, total) in [
            (&self.events_lost, snapshot.stats.events_lost),
            (&self.over_limit, snapshot.stats.over_limit),
            (&self.signals, snapshot.stats.signals_sent),
        ] {
            catch_up(counter, total);
        }
        for (kind, total) in kernel::trouble::kinds(&snapshot.stats) {
            catch_up(&self.kernel_trouble.with_label_values(&[kind]), total);
        }
        catch_up(&self.cgroups_removed.with_label_values(&["kernel"]), snapshot.stats.cgroups_removed_by_kernel);
        catch_up(&self.cgroups_removed.with_label_values(&["sweep"]), snapshot.stats.cgroup_entries_swept);
        catch_up(&self.records_swept.with_label_values(&["exit"]), snapshot.stats.records_swept_by_exit);
        catch_up(&self.records_swept.with_label_values(&["full"]), snapshot.stats.records_swept_full);
        catch_up(&self.full_sweeps, snapshot.stats.full_sweeps);
        catch_up(&self.record_index_overflows, snapshot.stats.record_index_overflows);
        catch_up(&self.cgroup_tree_walks, snapshot.stats.cgroup_tree_walks);
        for (why, total) in crate::snapshot::Holder::WHY.iter().zip(snapshot.stats.agent_signals) {
            catch_up(&self.agent_signals.with_label_values(&[why]), total);
        }
        self.record_index_keys.set(value(snapshot.stats.record_index_keys));
        self.capped.reset();
        self.unrecorded.reset();
        for row in &snapshot.cgroups {
            let id = row.cgroup_id.to_string();
            let labels = [row.cgroup.as_str(), id.as_str()];
            if row.capped {
                self.capped.with_label_values(&labels).set(1);
            }
            if row.unrecorded > 0 {
                self.unrecorded.with_label_values(&labels).set(value(row.unrecorded));
            }
        }
        self.external.reset();
        for row in &snapshot.external_memory.cgroups {
            let id = row.cgroup_id.to_string();
            self.external.with_label_values(&[row.cgroup.as_str(), id.as_str()]).set(value(row.bytes));
        }
        self.alloc_records.set(value(snapshot.stats.records));
        self.spare_records.set(value(snapshot.stats.spare_records));
        self.records_cap.set(value(snapshot.stats.records_cap));
        self.probes.reset();
        for report in probes {
            self.probes.with_label_values(&[report.path.as_str(), report.links.as_str()]).set(report.attached.len() as i64);
        }
        let discovery = &snapshot.discovery;
        for (state, files) in [("probed", discovery.probed), ("failed", discovery.failed), ("capped", discovery.capped)] {
            self.libcuda_files.with_label_values(&[state]).set(value(files));
        }
        self.capped_containers.set(value(discovery.capped_containers));
        catch_up(&self.maps_over_bound, discovery.maps_over_bound);
        catch_up(&self.discovery_panics, discovery.panicked);
        for (reason, total) in [("event", discovery.maps_read_event), ("rescan", discovery.maps_read_rescan), ("new", discovery.maps_read_new)] {
            catch_up(&self.maps_read.with_label_values(&[reason]), total);
        }
        catch_up(&self.rescans, discovery.rescans);
        catch_up(&self.found_by_rescan, discovery.found_by_rescan);
        catch_up(&self.discovery_events_lost, discovery.events_lost);
    }

    /// Brings the rejection counter of (ledger, device index, container labels) to the
    /// ledger's count (a ledger replaced at the same path may count from lower: its series
    /// starts over).
    fn set_rejections(&self, key: &[String], total: u64) {
        let labels: Vec<&str> = key.iter().map(String::as_str).collect();
        let counted = self.rejections.with_label_values(&labels).get();
        if total < counted {
            let _ = self.rejections.remove_label_values(&labels);
            self.rejections.with_label_values(&labels).inc_by(total);
        } else {
            self.rejections.with_label_values(&labels).inc_by(total - counted);
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> Result<String> {
        Ok(TextEncoder::new().encode_to_string(&self.registry.gather())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{kernel::probes::AttachReport, reconcile::Observation};

    #[test]
    fn encodes_every_family() {
        let mut metrics = Metrics::new(false).expect("metrics");
        metrics.reclaimed(Duration::from_millis(3));
        let snapshot = Snapshot {
            libcuda: vec![AttachReport { path: "/lib/libcuda.so.1".into(), attached: vec!["a".into(), "b".into()], links: "uprobe_multi".into(), ..Default::default() }],
            ..Default::default()
        };
        let mut reconciler = Reconciler::new(Default::default());
        let seen = |pid, ebpf_bytes| Observation { pid, ebpf_bytes, ..Default::default() };
        reconciler.judge(vec![seen(41, 1 << 20), seen(42, 0)], std::time::Instant::now());
        metrics.refresh(None, &snapshot, &reconciler, &BTreeMap::new());
        let text = metrics.encode().expect("encode");
        assert!(text.contains("vramguard_reclaims_total 1"), "{text}");
        assert!(text.contains("vramguard_reclaim_latency_seconds_bucket{le=\"0.005\"} 1"), "{text}");
        assert!(text.contains("vramguard_probes_attached{libcuda=\"/lib/libcuda.so.1\",links=\"uprobe_multi\"} 2"), "{text}");
        assert!(text.contains("vramguard_events_lost_total 0"), "{text}");
        assert!(text.contains("vramguard_process_state{pid=\"41\",state=\"unhooked\"} 1"), "{text}");
        assert!(text.contains("vramguard_process_state{pid=\"41\",state=\"ok\"} 0"), "{text}");
        assert!(text.contains("vramguard_process_state{pid=\"42\",state=\"ok\"} 1"), "{text}");
        assert!(text.contains("vramguard_unhooked_processes 1"), "{text}");
    }

    #[test]
    fn capped_cgroups_and_kernel_trouble() {
        use crate::snapshot::CgroupRow;
        let mut metrics = Metrics::new(false).expect("metrics");
        let mut snapshot = Snapshot {
            cgroups: vec![
                CgroupRow { cgroup_id: 7, cgroup: "/flood".into(), live_allocations: 100, unrecorded: 40, capped: true, ..Default::default() },
                CgroupRow { cgroup_id: 8, cgroup: "/calm".into(), live_allocations: 3, ..Default::default() },
            ],
            ..Default::default()
        };
        snapshot.stats.records_capped = 40;
        snapshot.stats.log_lines_suppressed = 35;
        snapshot.stats.records_cap = 100;
        snapshot.stats.cgroups_removed_by_kernel = 2;
        let reconciler = Reconciler::new(Default::default());
        metrics.refresh(None, &snapshot, &reconciler, &BTreeMap::new());
        let text = metrics.encode().expect("encode");
        assert!(text.contains("vramguard_cgroup_alloc_records_capped{cgroup=\"/flood\",cgroup_id=\"7\"} 1"), "{text}");
        assert!(!text.contains("vramguard_cgroup_alloc_records_capped{cgroup=\"/calm\""), "{text}");
        assert!(text.contains("vramguard_cgroup_unrecorded_allocations{cgroup=\"/flood\",cgroup_id=\"7\"} 40"), "{text}");
        assert!(text.contains("vramguard_kernel_trouble_total{kind=\"records_capped\"} 40"), "{text}");
        assert!(text.contains("vramguard_kernel_trouble_total{kind=\"log_lines_suppressed\"} 35"), "{text}");
        assert!(text.contains("vramguard_kernel_trouble_total{kind=\"exit_events_lost\"} 0"), "{text}");
        assert!(text.contains("vramguard_alloc_records_per_cgroup_cap 100"), "{text}");
        assert!(text.contains("vramguard_cgroups_removed_total{by=\"kernel\"} 2"), "{text}");
        assert!(text.contains("vramguard_records_swept_total{by=\"exit\"} 0"), "{text}");
        assert!(text.contains("vramguard_kernel_trouble_total{kind=\"journal_lost\"} 0"), "{text}");
        snapshot.external_memory.cgroups =
            vec![crate::kernel::extmem::ExternalRow { cgroup_id: 8, cgroup: "/calm".into(), imports: 1, bytes: 64 << 20, ..Default::default() }];
        metrics.refresh(None, &snapshot, &reconciler, &BTreeMap::new());
        let text = metrics.encode().expect("encode");
        assert!(text.contains("vramguard_external_memory_bytes{cgroup=\"/calm\",cgroup_id=\"8\"} 67108864"), "{text}");
        assert!(!text.contains("vramguard_external_memory_bytes{cgroup=\"/flood\""), "{text}");
        snapshot.external_memory.cgroups.clear();
        // The flooder leaves: its series go.
        snapshot.cgroups.remove(0);
        metrics.refresh(None, &snapshot, &reconciler, &BTreeMap::new());
        let text = metrics.encode().expect("encode");
        assert!(!text.contains("vramguard_cgroup_alloc_records_capped{"), "{text}");
    }

    #[test]
    fn ledger_families_carry_the_container_labels_and_hami_names() {
        use ledger::{layout::CREATOR_AGENT, ContainerNames, DeviceConfig, Geometry, Ledger};
        let dir = std::env::temp_dir().join(format!("vramguard-metrics-labels-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("named")).expect("mkdir");
        std::fs::create_dir_all(dir.join("anonymous")).expect("mkdir");
        let geometry = Geometry {
            slots: 4,
            records: 64,
            devices: vec![DeviceConfig { limit: 64 << 20, chunk: 2 << 20, ..Default::default() }],
        };
        let named = Ledger::create(&dir.join("named/ledger"), &geometry, CREATOR_AGENT).expect("create");
        named.set_names(&ContainerNames::new("team-a", "trainer-0", "main")).expect("names");
        Ledger::create(&dir.join("anonymous/ledger"), &geometry, CREATOR_AGENT).expect("create");
        let mut ledgers = Ledgers::new(dir.clone());
        ledgers.scan();
        let mut metrics = Metrics::new(true).expect("metrics");
        let charged = BTreeMap::from([(dir.join("named/ledger").display().to_string(), 6u64 << 20)]);
        let charged = charged.iter().map(|(path, bytes)| (path.as_str(), *bytes)).collect();
        metrics.refresh(Some(&ledgers), &Snapshot::default(), &Reconciler::new(Default::default()), &charged);
        let text = metrics.encode().expect("encode");
        let named_path = dir.join("named/ledger").display().to_string();
        let anonymous_path = dir.join("anonymous/ledger").display().to_string();
        let limit = format!(
            "vramguard_container_memory_limit_bytes{{container=\"main\",device_index=\"0\",device_uuid=\"\",ledger=\"{named_path}\",namespace=\"team-a\",pod=\"trainer-0\",pod_uid=\"\"}} 67108864"
        );
        assert!(text.contains(&limit), "{text}");
        let anonymous = format!(
            "vramguard_container_rejections_total{{container=\"\",device_index=\"0\",ledger=\"{anonymous_path}\",namespace=\"\",pod=\"\",pod_uid=\"\"}} 0"
        );
        assert!(text.contains(&anonymous), "{text}");
        let unaccounted = format!(
            "vramguard_container_unaccounted_bytes{{container=\"main\",ledger=\"{named_path}\",namespace=\"team-a\",pod=\"trainer-0\",pod_uid=\"\"}} 6291456"
        );
        assert!(text.contains(&unaccounted), "{text}");
        assert!(text.contains("hami_vgpu_memory_limit_bytes{container=\"main\",device_uuid=\"\",namespace=\"team-a\",pod=\"trainer-0\",vdevice_index=\"0\",zone=\"vGPU\"} 67108864"), "{text}");
        assert!(text.contains("hami_vgpu_memory_used_bytes{container=\"main\",device_uuid=\"\",namespace=\"team-a\",pod=\"trainer-0\",vdevice_index=\"0\",zone=\"vGPU\"} 0"), "{text}");
        assert_eq!(text.matches("hami_vgpu_memory_used_bytes{").count(), 1, "only the named ledger: {text}");
        assert!(!Metrics::new(false).expect("metrics").encode().expect("encode").contains("hami_"));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
