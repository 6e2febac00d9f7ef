//! Reconciliation of the two views of GPU memory: what the hooks charged in the ledgers and
//! what the eBPF probes saw each process allocate in libcuda. Every pass gives each process
//! one [`State`]; `vramguard audit` shows it and the metrics export it.
//!
//! # What is compared
//!
//! Like is compared with like: *requested* bytes of live allocations, context memory left
//! out on both sides.
//!
//! * eBPF: a process's live bytes of every kind the probes see (`device`, `managed`, `async`,
//!   `vmm`), as the driver API was asked for them. The probes never count contexts.
//! * Ledger: the slot's `bytes` (live requested bytes) of kinds `data`, `small` and `managed`,
//!   summed over the ledger's devices; `context` (the per-device context reserve, not an
//!   allocation the probes can see) is excluded, and so are `chunks` (the chunk-rounded
//!   charges). The hook charges `cuMemCreate` and stream-ordered allocations as `data` too.
//!
//! # Joining
//!
//! A slot is joined to the eBPF row of the process with the slot's identity (pid namespace,
//! pid in it, start time, read from `/proc/<pid>` for each process the probes report), so a
//! slot whose host pid the reclaimer has not recorded yet is joined too. The slot is the
//! workload's to write, so the process must also map the ledger file (every hooked process
//! does; `/proc/<pid>/maps`, read once per process): a slot naming another container's
//! process is ignored, and cannot make that process's cgroup this container's. A slot that joins no
//! eBPF row is looked up by its recorded host pid: still running (same start time, not a
//! zombie) means a hooked process the probes see no memory for; gone means a stale slot. A
//! slot with neither a match nor a host pid is left out until the reclaimer records one
//! (within a second). A process in several ledgers is charged their sum (and reported with
//! the first).
//!
//! # States
//!
//! * `tampered`: the ledger charges the process less than the probes saw, by more than the
//!   threshold, on passes [`TAMPER_CONFIRM`] apart (the hook charges before the driver
//!   allocates and releases after it frees, so an honest ledger is behind only while a free
//!   is in flight, the probes having counted it at its start: this is what a process that
//!   wrote its own slot down looks like).
//! * `drift`: the views differ by more than the threshold (the ledger ahead), continuously
//!   for longer than the grace period.
//! * `unhooked`: the probes see GPU memory, and no watched ledger has a slot for the process.
//! * `stale`: a slot whose process is gone (the reclaimer normally frees it within a second).
//! * `unprobed`: the driver ([`crate::driver`], NVML) reports the process holding more than
//!   the probes and its ledger explain, on two consecutive reads ([`figure`]: more than the
//!   larger of its probes' bytes, live and kept by its pools, and its ledger's, plus, on each
//!   device it holds memory on, a context and one 2 MiB page). The context is
//!   `--context-allowance` for every process, whatever its ledger's reserve
//!   ([`DEFAULT_CONTEXT_ALLOWANCE`], 1 GiB: an H100's and an H200's context measured
//!   518 MiB, and PyTorch jobs on the H200 held up to 310 MiB beside it with the CUDA
//!   default of loading modules lazily, `docs/gpu.md`). Memory allocated through a
//!   libcuda no probe is on (a renamed copy loaded and used before discovery reaches it, one
//!   past the per-container cap) looks like this. The driver's figure is from its last read
//!   (up to about two seconds old): it is compared with the largest figure the probes gave
//!   since a pass before that read started, so a free the probes saw after the read is not
//!   taken for an escape.
//! * `ok`: otherwise.
//!
//! A ledger whose header was rewritten since the agent validated it
//! ([`Ledgers::header_change`]) has every process of it reported `tampered` too; what the
//! driver reports such a process holding beyond the other views is charged all the same.
//!
//! # One figure, and enforcement
//!
//! What each process holds is one figure from the three views ([`figure::figure`]: the
//! larger of what each says, as of one driver read; [`Verdict::held_bytes`], summed per
//! container by [`Reconciler::held_bytes_by_ledger`]). The ledger is the tenant's to write,
//! so it never explains memory away from the limits: for the cgroup limit and `--enforce
//! signal`, a process's escaped bytes are the driver's figure less the probes' (live, and
//! what its pools keep) and, per device, a context at `--context-allowance` (never the
//! ledger's reserve) and a 2 MiB page ([`Verdict::enforced_bytes`]), for every process the
//! driver's row is joined with, whatever its state. They, and the `unprobed` bytes, count
//! only as much as [`ESCAPE_CONFIRM_READS`] consecutive driver reads showed.
//!
//! # Containers
//!
//! A ledger's container is known to the kernel by the cgroups of the ledger's live processes:
//! each pass collects them ([`Reconciler::ledger_cgroups`]) from the eBPF rows of the joined
//! processes and from /proc for the others. A cgroup with processes of exactly one ledger
//! is that container's ([`Reconciler::cgroup_ledgers`]; one shared by several ledgers is
//! nobody's, and is held to the smallest of their limits). The agent enforces the ledger's
//! limits on its cgroups ([`crate::kernel::enforce`]),
//! and charges the ledger, through a slot of its own ([`crate::ledgers::charge`]), what the probes
//! see the container hold outside it ([`Reconciler::unaccounted_by_ledger`]): the memory of
//! `unhooked` processes in its cgroups, what `tampered` processes hold beyond their
//! charge, and what the driver reports `unprobed` processes holding beyond the probes and the
//! ledger (their escaped bytes; all of it, context included, for one without a slot), and
//! the GPU memory no driver row explains that is attributed to one of its cgroups (the holders
//! of the GPU's device file, [`crate::driver::gap`]). What
//! each cgroup's processes hold goes to the kernel task ([`Reconciler::holders_by_cgroup`],
//! published by the reconcile task): what two driver reads showed each holding, each read's
//! figures alone ([`figure::at_read`]), and of that what no ledger charges it. That is the
//! cgroup's usage against its limit, and in signal mode the processes of a cgroup over its
//! limit are signalled by the agent, those the hook did not admit first. The agent's own slot
//! is never judged.
//!
//! # Cost
//!
//! A pass reads each ledger's slots from a fresh private copy, without its lock
//! ([`crate::ledgers::LedgerHandle::for_each_claim`]: never a quiet ledger's last copy, so a
//! slot written around the lock is judged at the next pass), and looks up each eBPF
//! process's identity in /proc once per process (cached by pid and the probes' generation
//! of the process, which changes when a pid is reused). Slots without
//! eBPF memory are looked up in /proc (whether their process still runs, and its cgroup)
//! once, then at most once a second per process while the exit path's pidfd watch does not
//! say it runs ([`SlotProcesses`]: after an agent's restart, whose probes never saw the
//! running processes' memory, every slot is such).
//!
//! Passes run every second, for every `audit` (a `/metrics` scrape runs none: it is served
//! the page of the last pass, [`crate::serve`]), and (at most one per
//! [`MIN_INTERVAL`], [`SETTLE`] after the first event) after a drain of the event ring buffer
//! that found events and a ledger sweep that reclaimed slots: a quiet node costs one pass a
//! second.
pub use crate::snapshot::{EbpfProcess, HoldersByCgroup, Holder, State};

pub mod figure;
pub mod metrics;
pub mod task;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::{Duration, Instant},
};

// The pass hashes every process a few times: a fast hasher (the keys are pids and process
// identities, not attacker-chosen strings).
use foldhash::{HashMap, HashMapExt};

use ledger::ProcessIdentity;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::{
    driver::{DriverProcess, DriverView, UnjoinedProcess},
    identity,
    ledgers::Ledgers,
    snapshot::Snapshot,
};

/// Default `--drift-threshold`: 64 MiB.
pub const DEFAULT_THRESHOLD: u64 = 64 << 20;
/// Default `--drift-grace-ms`.
pub const DEFAULT_GRACE_MS: u64 = 5000;
/// How long a ledger must stay behind the probes (beyond the threshold) before its process
/// is `tampered`: longer than a free takes between the probes counting it (at its start) and
/// the hook releasing it (after the driver returns).
pub const TAMPER_CONFIRM: Duration = Duration::from_millis(250);
/// Passes triggered by events are at least this far apart (the timer's are not affected).
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);
/// How long a pass triggered by an event waits (for more to come): an exit's event comes
/// while the kernel still tears its process down, and the exit path frees its slots a
/// millisecond or a few later; a pass started at once ran beside that reclaim on the node's
/// CPUs (the slowest reclaims beside 50 hostile ledgers, 3-4 ms, were each beside such a
/// pass), and saw the process dead but still in its slot.
pub const SETTLE: Duration = Duration::from_millis(25);
/// Default `--context-allowance`: what any process's context (and what comes with it: module
/// images, local memory) may hold on one device (1 GiB: an H100's and an H200's measured
/// 518 MiB, and up to 310 MiB that PyTorch jobs loading modules lazily held beside it on the
/// H200, with room for other drivers, GPUs and libraries; docs/gpu.md).
pub const DEFAULT_CONTEXT_ALLOWANCE: u64 = 1 << 30;
pub use figure::DRIVER_PAGE;
/// How long the figures the probes gave a process are remembered, to compare a driver read
/// that is behind them with what they said when it started.
const EXPLAINED_MEMORY: Duration = Duration::from_secs(4);
/// On how many consecutive driver reads a figure of the driver's must be seen before anything
/// acts on it ([`figure::Confirmed`]).
pub const ESCAPE_CONFIRM_READS: u32 = 2;

/// What one pass found about one process, before judging.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observation {
    /// Host pid.
    pub pid: u32,
    /// The process's cgroup (0 when unknown).
    pub cgroup_id: u64,
    /// The ledger holding the process's slot (its path), if any.
    pub ledger: Option<String>,
    /// Requested bytes the ledger charges (data + small + managed), if it has a slot.
    pub ledger_bytes: Option<u64>,
    /// Requested bytes the probes saw.
    pub ebpf_bytes: u64,
    /// What the probes count its pools keeping ([`EbpfProcess::pool_kept`]), and the probes'
    /// generation of the process.
    pub pool_kept: u64,
    pub generation: u64,
    /// Bytes of its slot's context records beyond the first on each device, if it has a slot.
    pub extra_contexts: u64,
    /// The slot's process is gone.
    pub gone: bool,
    /// The ledger's header was rewritten since the agent validated it.
    pub header_changed: bool,
    /// What the driver reports the process holding, if it reports it.
    pub driver: Option<DriverProcess>,
    /// The context reserve of the process's ledger (per device), if it has a slot.
    pub context_reserve: Option<u64>,
    /// Its start time, as /proc gave it when the probes first reported it.
    pub start_time: Option<u64>,
}

/// One process's state, as the last pass judged it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub pid: u32,
    #[serde(default)]
    pub cgroup_id: u64,
    pub state: State,
    pub ledger: Option<String>,
    pub ledger_bytes: Option<u64>,
    pub ebpf_bytes: u64,
    /// What the driver reports the process holding (context included), if it reports it.
    #[serde(default)]
    pub driver_bytes: Option<u64>,
    /// What the probes count its stream-ordered pools keeping of what they saw freed, held to
    /// what the driver says ([`figure::PoolsKeep`]).
    #[serde(default)]
    pub pool_kept_bytes: u64,
    /// What the process holds: the larger of what the three views say, contexts aside
    /// ([`figure::Figure::held`]).
    #[serde(default)]
    pub held_bytes: u64,
    /// Of an `unprobed` (or `tampered`) process's driver bytes, those neither the probes nor
    /// its ledger explain ([`figure::Figure::unexplained`]), as two consecutive driver reads
    /// showed them: what its container's ledger is charged beyond the probes' figure. 0 in
    /// every other state.
    #[serde(default)]
    pub escaped_bytes: u64,
    /// Of the process's driver bytes, those the probes (live and pool-kept) do not explain,
    /// its contexts (at `--context-allowance` and a page per device) aside, as two
    /// consecutive driver reads showed them ([`figure::Figure::outside`]); the ledger never
    /// explains them away (it is the tenant's to write). What `--enforce audit` takes off its
    /// cgroup's limit in the probes, whatever its state ([`Reconciler::holders_by_cgroup`]).
    #[serde(default)]
    pub enforced_bytes: u64,
    /// What the process holds as two consecutive driver reads showed it, each read's figures
    /// alone ([`figure::at_read`]): what its cgroup's usage counts of it against the limit
    /// ([`Reconciler::holders_by_cgroup`]). 0 without the driver's view.
    #[serde(default)]
    pub limit_bytes: u64,
    /// Of those, the bytes no ledger charges it (its slot's bytes and contexts beyond the
    /// first), on both reads: what the hook did not admit, which makes it the first to be
    /// stopped when its cgroup is over its limit.
    #[serde(default)]
    pub unadmitted_bytes: u64,
    /// The start time the driver's row was joined with (the process the bytes are of).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_start_time: Option<u64>,
    /// The process's start time (clock ticks after boot), as /proc gave it when the probes first
    /// reported it, else its driver row's: what a signal to it checks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Bytes the views may differ by.
    pub threshold: u64,
    /// How long a difference (ledger ahead) may last before it is `drift`.
    pub grace: Duration,
    /// What the context of any process (and what comes with it) may hold per device.
    pub context_allowance: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config { threshold: DEFAULT_THRESHOLD, grace: Duration::from_millis(DEFAULT_GRACE_MS), context_allowance: DEFAULT_CONTEXT_ALLOWANCE }
    }
}

pub struct Reconciler {
    config: Config,
    /// Since when each process's views have differed (ledger ahead) beyond the threshold.
    diverged: HashMap<u32, Instant>,
    /// Since when each process's ledger has been behind the probes beyond the threshold.
    behind: HashMap<u32, Instant>,
    verdicts: Vec<Verdict>,
    last_pass: Option<Instant>,
    /// The identity of each process the probes report.
    probed: identity::ProbedProcesses,
    /// What /proc says about the processes of slots the probes do not report.
    slot_processes: SlotProcesses,
    /// The agent's own identity: its slots hold its charges and are never judged.
    agent: Option<ProcessIdentity>,
    /// The cgroups of each ledger's live processes (by path), as of the last pass.
    ledger_cgroups: BTreeMap<String, BTreeSet<u64>>,
    /// The ledgers the last pass could not read.
    unreadable: BTreeSet<String>,
    /// The driver's latest view, for the next pass.
    driver: Option<Arc<DriverView>>,
    /// The cgroups the driver holds to their quota itself (r615+), by id: what it counts
    /// against the limit (`currentUsed`, summed over the container's GPUs).
    driver_held: BTreeMap<u64, u64>,
    /// What the probes counted of each process at recent passes: (when, live bytes).
    explained: HashMap<u32, Vec<(Instant, u64)>>,
    /// What each process's pools may keep ([`figure::PoolsKeep`]).
    pools: HashMap<u32, figure::PoolsKeep>,
    /// Per process: what consecutive reads showed of it ([`Reads`]).
    escapes: HashMap<u32, Reads>,
    /// Processes already logged as `unprobed` (said once per process).
    unprobed_logged: BTreeSet<u32>,
    /// The driver's rows the last pass joined with no process, as their pids are others' now.
    driver_unjoined: Vec<UnjoinedProcess>,
    /// Which of the driver's processes still run, without a /proc read each pass.
    living: crate::pidfd::Living,
}

/// What consecutive driver reads showed of one process (of the driver row with `start_time`).
#[derive(Default)]
struct Reads {
    start_time: u64,
    /// What the probes and the ledger explained at the last pass, and the last pass that saw
    /// it rise.
    explained: u64,
    explained_rose: Option<Instant>,
    outside: figure::Confirmed,
    unexplained: figure::Agreed,
    held: figure::Confirmed,
    uncharged: figure::Confirmed,
}

/// What two consecutive driver reads confirm of a process: its outside and unexplained bytes
/// ([`figure::Figure`]), what it holds ([`figure::at_read`]) and, of that, what its ledger
/// does not charge.
#[derive(Clone, Copy, Debug, Default)]
struct ConfirmedFigures {
    outside: u64,
    unexplained: u64,
    held: u64,
    uncharged: u64,
}

impl Reconciler {
    pub fn new(config: Config) -> Reconciler {
        Reconciler {
            config,
            diverged: HashMap::new(),
            behind: HashMap::new(),
            verdicts: Vec::new(),
            last_pass: None,
            probed: identity::ProbedProcesses::default(),
            slot_processes: SlotProcesses::default(),
            agent: ProcessIdentity::current().ok(),
            ledger_cgroups: BTreeMap::new(),
            unreadable: BTreeSet::new(),
            driver: None,
            driver_held: BTreeMap::new(),
            explained: HashMap::new(),
            pools: HashMap::new(),
            escapes: HashMap::new(),
            unprobed_logged: BTreeSet::new(),
            driver_unjoined: Vec::new(),
            living: crate::pidfd::Living::default(),
        }
    }

    /// The driver view the last pass joined, if any.
    pub fn driver(&self) -> Option<&DriverView> {
        self.driver.as_deref()
    }

    /// The driver view's status as the last pass used it: with the rows it could not join
    /// (the driver task's, and those whose pid another process has taken since the read).
    pub fn driver_status(&self) -> crate::driver::DriverStatus {
        let mut status = self.driver().map(|d| d.status.clone()).unwrap_or_default();
        status.unjoined.extend(self.driver_unjoined.iter().cloned());
        status
    }

    /// The driver's view the next passes join (the latest published; `None` without one).
    pub fn set_driver(&mut self, view: Option<Arc<DriverView>>) {
        self.driver = view;
    }

    /// The cgroups the driver holds to their quota (by id), with what the driver counts in
    /// each (`currentUsed` over its GPUs): the fourth view. For them the device-total gap is
    /// not attributed (the driver's own figure has what it guessed at: a forked child, a
    /// client without a channel), and their container's figure is never below the driver's.
    pub fn set_driver_held(&mut self, held: BTreeMap<u64, u64>) {
        self.driver_held = held;
    }

    /// Records the identity of eBPF process (`pid`, `generation`) as if read from /proc (for
    /// benchmarks of the join over processes that do not exist).
    #[doc(hidden)]
    pub fn know(&mut self, pid: u32, generation: u64, identity: ProcessIdentity) {
        self.probed.know(pid, generation, identity);
    }

    /// The cgroups of each watched ledger's live processes (by ledger path).
    pub fn ledger_cgroups(&self) -> &BTreeMap<String, BTreeSet<u64>> {
        &self.ledger_cgroups
    }

    /// The ledgers (paths) the last pass could not read (their lock held too long, say):
    /// what it says of their processes is not to be acted on.
    pub fn unreadable(&self) -> &BTreeSet<String> {
        &self.unreadable
    }

    /// The ledger (path) of each cgroup that holds live processes of exactly one ledger: a
    /// container's. A cgroup shared by processes of several ledgers is no one container's
    /// (hooked processes outside containers, or a workload that registered a process in a
    /// second ledger file), so it is left out: no ledger's charge can be pinned on it.
    pub fn cgroup_ledgers(&self) -> BTreeMap<u64, &str> {
        let mut owners: BTreeMap<u64, Option<&str>> = BTreeMap::new();
        for (ledger, cgroups) in &self.ledger_cgroups {
            for cgroup in cgroups {
                owners.entry(*cgroup).and_modify(|owner| *owner = None).or_insert(Some(ledger.as_str()));
            }
        }
        owners.into_iter().filter_map(|(cgroup, owner)| Some((cgroup, owner?))).collect()
    }

    /// The last pass's verdicts, by pid.
    pub fn verdicts(&self) -> &[Verdict] {
        &self.verdicts
    }

    /// When a pass can confirm what the last pass saw and could not yet act on: a ledger
    /// behind the probes ([`TAMPER_CONFIRM`] after it was first seen), so that a slot written
    /// down is `tampered` that long after the pass that saw it, not a timer's period later.
    pub fn next_confirmation(&self) -> Option<Instant> {
        let last = self.last_pass?;
        self.behind.values().map(|since| *since + TAMPER_CONFIRM).filter(|at| *at > last).min()
    }

    /// When a pass an event calls for now runs: [`SETTLE`] from now, and [`MIN_INTERVAL`] after
    /// the last pass at the soonest.
    pub fn event_pass_at(&self) -> Instant {
        let settled = Instant::now() + SETTLE;
        self.last_pass.map_or(settled, |at| settled.max(at + MIN_INTERVAL))
    }

    /// One pass over the watched ledgers and the eBPF view.
    pub fn pass(&mut self, ledgers: Option<&Ledgers>, ebpf: &[EbpfProcess]) {
        self.probed.update(ebpf.iter().map(|p| (p.pid, p.generation)), identity::identity_of);
        let (observations, mut ledger_cgroups, unreadable) =
            observe(ledgers, ebpf, &mut self.probed, &mut self.slot_processes, self.agent, &self.unreadable);
        // A ledger that could not be read this time (its lock held too long) keeps the
        // cgroups it had: its limits stay enforced.
        for ledger in &unreadable {
            if let Some(cgroups) = self.ledger_cgroups.remove(ledger) {
                ledger_cgroups.insert(ledger.clone(), cgroups);
            }
        }
        self.ledger_cgroups = ledger_cgroups;
        self.unreadable = unreadable;
        let mut observations = observations;
        self.driver_unjoined = match self.driver.clone() {
            Some(driver) => {
                let pids: Vec<u32> = driver.processes.keys().copied().collect();
                let starts = self.living.start_times(&pids, ledger::process::running_start_time_of);
                join_driver(&mut observations, &driver.processes, |pid| starts.get(&pid).copied().flatten())
            }
            None => Vec::new(),
        };
        self.judge(observations, Instant::now());
    }

    /// The process's [`figure::Figure`] as of the driver's last read (see [`figure`]), what
    /// its pools may keep, and what two consecutive reads confirm ([`ConfirmedFigures`]).
    ///
    /// The probes' figure is taken as of the read: the largest they gave since a read
    /// interval before it started explains the driver's (a free the probes saw after the read
    /// is not an escape), the smallest bounds what the pools can keep.
    fn figure(&mut self, seen: &Observation, now: Instant) -> (figure::Figure, u64, ConfirmedFigures) {
        let history = self.explained.entry(seen.pid).or_default();
        history.retain(|(at, _)| now.saturating_duration_since(*at) < EXPLAINED_MEMORY);
        history.push((now, seen.ebpf_bytes));
        let read_at = self.driver.as_ref().and_then(|d| d.read_at);
        let since = read_at.map(|at| at.checked_sub(task::EVERY).unwrap_or(at));
        let (low, high) = history
            .iter()
            .filter(|(at, _)| since.is_none_or(|since| *at >= since))
            .fold((seen.ebpf_bytes, seen.ebpf_bytes), |(low, high), (_, bytes)| (low.min(*bytes), high.max(*bytes)));
        let pools = self.pools.entry(seen.pid).or_default();
        pools.update(seen.pool_kept, seen.generation, now);
        if let (Some(driver), Some(read_at)) = (seen.driver, read_at) {
            // Room for what the pools keep: the driver's figure beyond a context per device
            // and the probes' live bytes then (the page is left to the pools: it may be theirs).
            let contexts = u64::from(driver.devices).saturating_mul(self.config.context_allowance);
            pools.read(read_at, driver.bytes.saturating_sub(contexts).saturating_sub(low));
        }
        let kept = pools.kept();
        let views = figure::Views {
            probes: high,
            pool_kept: kept,
            ledger: seen.ledger_bytes.map(|bytes| figure::LedgerView { bytes, extra_contexts: seen.extra_contexts, reserve: seen.context_reserve.unwrap_or(0) }),
            driver: seen.driver.map(|d| figure::DriverView { bytes: d.bytes, devices: d.devices }),
        };
        let figure = figure::figure(&views, self.config.context_allowance);
        let start_time = seen.driver.map_or(0, |d| d.start_time);
        let entry = self.escapes.entry(seen.pid).or_default();
        if entry.start_time != start_time {
            *entry = Reads { start_time, ..Reads::default() };
        }
        let at_read = figure::at_read(low, views.driver, self.config.context_allowance);
        let charged = seen.ledger_bytes.map_or(0, |bytes| bytes.saturating_add(seen.extra_contexts));
        // A read that started before the pass that saw what the probes and the ledger explain
        // rise may show the driver before the growth, which then hides what they do not
        // explain: it may raise the unexplained figure, never lower it. (A job filling its
        // quota while its kernels' memory is charged must not see the charge dropped, fill
        // the room and be stopped: an H200, docs/gpu.md.) A ledger written up at every pass
        // gains nothing by it: the figure only stays.
        let explained = seen.ebpf_bytes.max(charged);
        if explained > entry.explained {
            entry.explained_rose = Some(now);
        }
        entry.explained = explained;
        let behind = read_at.zip(entry.explained_rose).is_some_and(|(read, rose)| read < rose);
        let unexplained = if behind { figure.unexplained.max(entry.unexplained.value()) } else { figure.unexplained };
        let confirmed = ConfirmedFigures {
            outside: entry.outside.see(read_at, figure.outside),
            unexplained: entry.unexplained.see(read_at, unexplained),
            held: entry.held.see(read_at, at_read),
            uncharged: entry.uncharged.see(read_at, at_read.saturating_sub(charged)),
        };
        (figure, kept, confirmed)
    }

    /// Judges `observations` as of `now`, logging every change of state.
    pub fn judge(&mut self, observations: Vec<Observation>, now: Instant) {
        let mut verdicts = Vec::with_capacity(observations.len());
        let mut diverged = HashMap::new();
        let mut behind = HashMap::new();
        let previous: HashMap<u32, State> = self.verdicts.iter().map(|v| (v.pid, v.state)).collect();
        let seen_pids: BTreeSet<u32> = observations.iter().map(|o| o.pid).collect();
        self.explained.retain(|pid, _| seen_pids.contains(pid));
        self.pools.retain(|pid, _| seen_pids.contains(pid));
        self.escapes.retain(|pid, _| seen_pids.contains(pid));
        self.unprobed_logged.retain(|pid| seen_pids.contains(pid));
        for seen in observations {
            let (figure, pool_kept_bytes, confirmed) = if seen.gone { Default::default() } else { self.figure(&seen, now) };
            let (enforced_bytes, escaped_bytes) = (confirmed.outside, confirmed.unexplained);
            let escaped = escaped_bytes > 0;
            let driver_start_time = seen.driver.map(|d| d.start_time);
            let state = match seen.ledger_bytes {
                _ if seen.gone => State::Stale,
                Some(_) if seen.header_changed => State::Tampered,
                _ if escaped => State::Unprobed,
                None if seen.ebpf_bytes > 0 => State::Unhooked,
                None => State::Ok,
                Some(ledger) if seen.ebpf_bytes.saturating_sub(ledger) > self.config.threshold => {
                    // Confirmed on a later pass: a free the probes counted at its start and the
                    // hook releases when the driver returns is behind for a moment only.
                    let since = self.behind.get(&seen.pid).copied().unwrap_or(now);
                    behind.insert(seen.pid, since);
                    if now.saturating_duration_since(since) >= TAMPER_CONFIRM {
                        State::Tampered
                    } else {
                        State::Ok
                    }
                }
                Some(ledger) if ledger.abs_diff(seen.ebpf_bytes) > self.config.threshold => {
                    let since = self.diverged.get(&seen.pid).copied().unwrap_or(now);
                    diverged.insert(seen.pid, since);
                    if now.saturating_duration_since(since) > self.config.grace {
                        State::Drift
                    } else {
                        State::Ok
                    }
                }
                Some(_) => State::Ok,
            };
            if state == State::Unprobed && self.unprobed_logged.insert(seen.pid) {
                let (pid, ebpf_bytes, ledger_bytes, driver_bytes) = (seen.pid, seen.ebpf_bytes, seen.ledger_bytes, seen.driver.map(|d| d.bytes));
                warn!(pid, ?driver_bytes, ebpf_bytes, ?ledger_bytes, "the driver reports a process holding more GPU memory than the probes and its ledger explain: unprobed (said once per process)");
            }
            let before = previous.get(&seen.pid).copied();
            // An `unprobed` process is said once, above, with its driver bytes.
            if before != Some(state) && (before.is_some() || state != State::Ok) && state != State::Unprobed {
                let from = before.map_or("new", State::name);
                let ledger = seen.ledger.as_deref().unwrap_or("");
                let (pid, ebpf_bytes, ledger_bytes) = (seen.pid, seen.ebpf_bytes, seen.ledger_bytes);
                if state == State::Tampered || state == State::Drift {
                    warn!(pid, from = %from, to = %state.name(), ledger = %ledger, ?ledger_bytes, ebpf_bytes, "process state changed");
                } else {
                    info!(pid, from = %from, to = %state.name(), ledger = %ledger, ?ledger_bytes, ebpf_bytes, "process state changed");
                }
            }
            verdicts.push(Verdict {
                pid: seen.pid,
                cgroup_id: seen.cgroup_id,
                state,
                ledger: seen.ledger,
                ledger_bytes: seen.ledger_bytes,
                ebpf_bytes: seen.ebpf_bytes,
                driver_bytes: seen.driver.map(|d| d.bytes),
                pool_kept_bytes,
                held_bytes: figure.held,
                // A tampered process's escaped bytes are charged too (a rewritten header
                // must not switch the driver's view off).
                escaped_bytes: if matches!(state, State::Unprobed | State::Tampered) { escaped_bytes } else { 0 },
                enforced_bytes,
                limit_bytes: confirmed.held,
                unadmitted_bytes: confirmed.uncharged,
                driver_start_time,
                start_time: seen.start_time.or(driver_start_time),
            });
        }
        verdicts.sort_by_key(|v| (v.pid, v.state));
        self.diverged = diverged;
        self.behind = behind;
        self.verdicts = verdicts;
        self.last_pass = Some(now);
    }

    /// eBPF bytes of the processes joined to each ledger.
    pub fn ebpf_bytes_by_ledger(&self) -> BTreeMap<&str, u64> {
        let mut sums: BTreeMap<&str, u64> = BTreeMap::new();
        for verdict in &self.verdicts {
            if let Some(ledger) = &verdict.ledger {
                let sum = sums.entry(ledger.as_str()).or_default();
                *sum = sum.saturating_add(verdict.ebpf_bytes);
            }
        }
        sums
    }

    /// What the probes and the driver see each hooked container (ledger) hold outside its
    /// ledger: the bytes of `unhooked` processes in the ledger's cgroups, what each `tampered`
    /// process of the ledger holds beyond its charge, and what the driver reports `unprobed`
    /// processes holding beyond the probes' and the ledger's figures (an `unprobed` process
    /// without a slot: all the driver reports, its context included, since no ledger charges
    /// any of it), and the driver's unexplained memory attributed to one of the ledger's
    /// cgroups. Ledgers without any are left out.
    pub fn unaccounted_by_ledger(&self) -> BTreeMap<String, u64> {
        let owners = self.cgroup_ledgers();
        let mut sums: BTreeMap<String, u64> = BTreeMap::new();
        for verdict in &self.verdicts {
            let (ledger, bytes) = match (&verdict.ledger, verdict.state) {
                (Some(ledger), State::Tampered) => (
                    Some(ledger.as_str()),
                    verdict.ebpf_bytes.saturating_sub(verdict.ledger_bytes.unwrap_or(0)).saturating_add(verdict.escaped_bytes),
                ),
                (None, State::Unhooked) => (owners.get(&verdict.cgroup_id).copied(), verdict.ebpf_bytes),
                (Some(ledger), State::Unprobed) => (Some(ledger.as_str()), verdict.escaped_bytes),
                (None, State::Unprobed) => (owners.get(&verdict.cgroup_id).copied(), verdict.ebpf_bytes.saturating_add(verdict.escaped_bytes)),
                _ => (None, 0),
            };
            if let Some(ledger) = ledger.filter(|_| bytes > 0) {
                let sum = sums.entry(ledger.to_string()).or_default();
                *sum = sum.saturating_add(bytes);
            }
        }
        // Memory no row of the driver explains, attributed to the cgroup whose processes hold
        // the GPU's device file (crate::driver::gap): its container's ledger is charged too.
        for (cgroup, bytes) in self.driver.as_deref().map(attributed_gaps).unwrap_or_default() {
            if self.driver_held.contains_key(&cgroup) {
                continue;
            }
            if let Some(ledger) = owners.get(&cgroup) {
                let sum = sums.entry(ledger.to_string()).or_default();
                *sum = sum.saturating_add(bytes);
            }
        }
        sums
    }

    /// What each cgroup's processes hold, for the kernel task to hold the cgroup to its limit
    /// ([`crate::kernel::enforce`]): per process, what two driver reads confirmed it holding
    /// ([`Verdict::limit_bytes`]) and of that what no ledger charges
    /// ([`Verdict::unadmitted_bytes`]), the probes' live bytes at the pass, and its enforced
    /// escaped bytes ([`Verdict::enforced_bytes`], which `--enforce audit` takes off the
    /// limit); in [`Holder::stop_order`]. Each carries the start time a signal checks; a
    /// process whose start time is not known, or that holds nothing, is left out.
    pub fn holders_by_cgroup(&self) -> HoldersByCgroup {
        let mut by_cgroup = HoldersByCgroup::new();
        for verdict in self.verdicts.iter().filter(|v| v.state != State::Stale && v.cgroup_id != 0) {
            // The signal checks the start time the driver's figures were joined with.
            let Some(start_time) = verdict.driver_start_time.or(verdict.start_time) else { continue };
            let process = Holder {
                pid: verdict.pid,
                start_time,
                escaped: verdict.enforced_bytes,
                held: verdict.limit_bytes,
                live: verdict.ebpf_bytes,
                unadmitted: verdict.unadmitted_bytes.min(verdict.limit_bytes),
            };
            if process.held > 0 || process.live > 0 || process.escaped > 0 {
                by_cgroup.entry(verdict.cgroup_id).or_default().push(process);
            }
        }
        for processes in by_cgroup.values_mut() {
            processes.sort_by_key(Holder::stop_order);
        }
        by_cgroup
    }

    /// What the driver reports each hooked container (ledger) holding: the driver bytes of
    /// the ledger's processes and of the other processes in its cgroups
    /// ([`Reconciler::cgroup_ledgers`]). Ledgers none of whose processes the driver reports
    /// are left out.
    pub fn driver_bytes_by_ledger(&self) -> BTreeMap<String, u64> {
        let owners = self.cgroup_ledgers();
        let mut sums: BTreeMap<String, u64> = BTreeMap::new();
        for verdict in &self.verdicts {
            let Some(bytes) = verdict.driver_bytes else { continue };
            let ledger = verdict.ledger.as_deref().or_else(|| owners.get(&verdict.cgroup_id).copied());
            if let Some(ledger) = ledger {
                let sum = sums.entry(ledger.to_string()).or_default();
                *sum = sum.saturating_add(bytes);
            }
        }
        sums
    }

    /// The one figure of each hooked container (ledger): the [`Verdict::held_bytes`] of the
    /// ledger's processes and of the other processes in its cgroups
    /// ([`Reconciler::cgroup_ledgers`]), summed. Ledgers without any are left out.
    pub fn held_bytes_by_ledger(&self) -> BTreeMap<String, u64> {
        let owners = self.cgroup_ledgers();
        let mut sums: BTreeMap<String, u64> = BTreeMap::new();
        for verdict in self.verdicts.iter().filter(|v| v.state != State::Stale) {
            let ledger = verdict.ledger.as_deref().or_else(|| owners.get(&verdict.cgroup_id).copied());
            if let Some(ledger) = ledger {
                let sum = sums.entry(ledger.to_string()).or_default();
                *sum = sum.saturating_add(verdict.held_bytes);
            }
        }
        // Where the driver holds the containers, its own count of their cgroups is the floor.
        let mut counted: BTreeMap<&str, u64> = BTreeMap::new();
        for (cgroup, used) in &self.driver_held {
            if let Some(ledger) = owners.get(cgroup) {
                let sum = counted.entry(ledger).or_default();
                *sum = sum.saturating_add(*used);
            }
        }
        for (ledger, used) in counted {
            let sum = sums.entry(ledger.to_string()).or_default();
            *sum = (*sum).max(used);
        }
        sums
    }

    /// Writes the verdicts into `snapshot`'s process rows; processes known only from a
    /// ledger (no eBPF row) get a row of their own.
    pub fn annotate(&self, snapshot: &mut Snapshot) {
        for verdict in &self.verdicts {
            let row = match snapshot.processes.iter_mut().position(|r| r.pid == verdict.pid && r.state.is_none()) {
                Some(index) => &mut snapshot.processes[index],
                None => {
                    let comm = if verdict.state == State::Stale {
                        String::new()
                    } else {
                        std::fs::read_to_string(format!("/proc/{}/comm", verdict.pid))
                            .map(|c| c.trim_end().to_string())
                            .unwrap_or_default()
                    };
                    snapshot.processes.push(crate::snapshot::ProcessRow { pid: verdict.pid, comm, ..Default::default() });
                    let last = snapshot.processes.len() - 1;
                    &mut snapshot.processes[last]
                }
            };
            row.state = Some(verdict.state);
            row.ledger = verdict.ledger.clone();
            row.ledger_bytes = verdict.ledger_bytes;
            row.driver_bytes = verdict.driver_bytes;
            row.pool_kept_bytes = verdict.pool_kept_bytes;
            row.held_bytes = verdict.held_bytes;
            row.escaped_bytes = verdict.enforced_bytes;
            if row.cgroup_id == 0 {
                row.cgroup_id = verdict.cgroup_id;
            }
        }
        snapshot.processes.sort_by_key(|row| row.pid);
    }
}

/// Adds the driver's figure to each process's observation; a live process only the driver
/// reports gets one of its own (its cgroup read from /proc). A row whose pid is another
/// process's now than when the driver task read it (`start_time_of` says the pid's start
/// time now) is joined with none, and returned.
fn join_driver(
    observations: &mut Vec<Observation>,
    driver: &BTreeMap<u32, DriverProcess>,
    start_time_of: impl Fn(u32) -> Option<u64>,
) -> Vec<UnjoinedProcess> {
    // One look-up per driver row, not a walk of the observations.
    let live: HashMap<u32, usize> = observations.iter().enumerate().filter(|(_, o)| !o.gone).map(|(i, o)| (o.pid, i)).rev().collect();
    let mut unjoined = Vec::new();
    for (&pid, process) in driver {
        match start_time_of(pid) {
            Some(now) if now == process.start_time => {}
            Some(_) => {
                unjoined.push(UnjoinedProcess { pid, bytes: process.bytes, reason: crate::driver::REUSED.to_string() });
                continue;
            }
            None => continue, // gone since the read
        }
        if let Some(&index) = live.get(&pid) {
            observations[index].driver = Some(*process);
            continue;
        }
        let Some(cgroup_id) = crate::cgroup::id_of_pid(pid) else { continue }; // gone since the read
        observations.push(Observation { pid, cgroup_id, driver: Some(*process), ..Default::default() });
    }
    unjoined
}

/// The driver view's unexplained GPU memory above the tolerance, by the cgroup it is
/// attributed to ([`crate::driver::gap`]); none unless the view answers.
fn attributed_gaps(driver: &DriverView) -> BTreeMap<u64, u64> {
    let mut by_cgroup = BTreeMap::new();
    if driver.status.state != crate::driver::State::Ok {
        return by_cgroup;
    }
    for device in &driver.status.devices {
        let (Some(cgroup), Some(bytes)) = (device.gap.cgroup_id, device.gap.unexplained) else { continue };
        if bytes > crate::driver::gap::TOLERANCE {
            let sum: &mut u64 = by_cgroup.entry(cgroup).or_default();
            *sum = sum.saturating_add(bytes);
        }
    }
    by_cgroup
}

/// What a slot charges: its requested bytes ([`crate::ledgers::slot_bytes`]) and its context
/// records beyond the first on each device ([`crate::ledgers::slot_extra_contexts`]).
type Charged = (u64, u64);

/// Joins the ledgers' live slots with the eBPF view (`probed`: the identities of its
/// processes, updated with it). Also returns the cgroups of each ledger's live processes, and
/// the ledgers that could not be read.
pub fn observe(
    ledgers: Option<&Ledgers>,
    ebpf: &[EbpfProcess],
    probed: &mut identity::ProbedProcesses,
    slot_processes: &mut SlotProcesses,
    agent: Option<ProcessIdentity>,
    was_unreadable: &BTreeSet<String>,
) -> (Vec<Observation>, BTreeMap<String, BTreeSet<u64>>, BTreeSet<String>) {
    slot_processes.begin_pass();
    let mut unreadable = BTreeSet::new();
    // By eBPF row: (index in `names`, ledger bytes and extra contexts, header changed) of the
    // slots joined to it.
    let mut joined: Vec<Option<(usize, Charged, bool)>> = vec![None; ebpf.len()];
    let mut names: Vec<String> = Vec::new();
    let mut contexts: Vec<Option<u64>> = Vec::new();
    let mut observations = Vec::new();
    let mut ledger_cgroups: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    for (path, ledger) in ledgers.into_iter().flat_map(Ledgers::iter) {
        let devices = ledger.header().device_count as usize;
        let name = path.display().to_string();
        let index = names.len();
        names.push(name.clone());
        let header_changed = ledgers.is_some_and(|l| l.header_change(path).is_some());
        let context_reserve = ledger.header().devices[..devices.min(ledger.header().devices.len())].iter().map(|d| d.context_reserve).max();
        contexts.push(context_reserve);
        let file = ledgers.and_then(|l| l.file_id(path)).unwrap_or_default();
        // Slots joined to an eBPF row, and slots without eBPF memory: judged after the lock
        // is released.
        let mut matched: Vec<(usize, usize, Charged)> = Vec::new();
        let mut unjoined: Vec<(u32, ProcessIdentity, Charged)> = Vec::new();
        let mut cgroups = BTreeSet::new();
        let visited = ledger.for_each_claim(|claim| {
            let process = claim.process;
            if Some(process) == agent {
                return; // the agent's own charges
            }
            let bytes = (claim.bytes, claim.extra_contexts);
            if let Some((row, handle)) = probed.row_of(&process) {
                matched.push((row, handle, bytes));
            } else if claim.host_pid != 0 {
                unjoined.push((claim.host_pid, process, bytes));
            }
            // else: not identified yet; the reclaimer records its host pid soon
        });
        if let Err(error) = visited {
            // Said once, when it starts (a workload can keep its ledger unreadable for good).
            if !was_unreadable.contains(&name) {
                warn!(ledger = %path.display(), %error, "cannot read the ledger's slots to reconcile (said once while it lasts)");
            }
            unreadable.insert(name);
            continue;
        }
        for (row, handle, bytes) in matched {
            // A slot naming a process that does not map this ledger was not written by that
            // process: it neither charges it nor makes its cgroup this container's.
            if !probed.maps_ledger(handle, file) {
                forged(&name, ebpf[row].pid);
                continue;
            }
            let entry = joined[row].get_or_insert((index, (0, 0), false));
            entry.1 = (entry.1 .0.saturating_add(bytes.0), entry.1 .1.saturating_add(bytes.1));
            entry.2 |= header_changed;
            cgroups.insert(ebpf[row].cgroup_id);
        }
        for (host_pid, process, bytes) in unjoined {
            let watched = ledgers.is_some_and(|l| l.watched_alive(host_pid, &process));
            let (gone, cgroup_id) = slot_processes.look_up(host_pid, process, file, watched);
            if cgroup_id != 0 {
                cgroups.insert(cgroup_id);
            }
            observations.push(Observation {
                pid: host_pid,
                cgroup_id,
                ledger: Some(name.clone()),
                ledger_bytes: Some(bytes.0),
                extra_contexts: bytes.1,
                gone,
                header_changed,
                context_reserve,
                ..Default::default()
            });
        }
        ledger_cgroups.insert(name, cgroups);
    }
    for (process, joined) in ebpf.iter().zip(joined) {
        let (pid, cgroup_id, bytes) = (process.pid, process.cgroup_id, process.bytes);
        let (ledger, (ledger_bytes, extra_contexts), header_changed, context_reserve) = match joined {
            Some((ledger, (charged, extra), changed)) => (Some(names[ledger].clone()), (Some(charged), extra), changed, contexts[ledger]),
            None => (None, (None, 0), false, None),
        };
        // A process the probes saw with a slot found by its host pid only (its identity
        // could not be read, e.g. it is exiting): merge rather than report it twice.
        if ledger.is_none() {
            if let Some(other) = observations.iter_mut().find(|o| o.pid == pid && !o.gone) {
                (other.ebpf_bytes, other.pool_kept, other.generation) = (bytes, process.pool_kept, process.generation);
                other.start_time = other.start_time.or(probed.start_time_of(pid));
                continue;
            }
        }
        observations.push(Observation {
            pid,
            cgroup_id,
            ledger,
            ledger_bytes,
            ebpf_bytes: bytes,
            pool_kept: process.pool_kept,
            generation: process.generation,
            start_time: probed.start_time_of(pid),
            extra_contexts,
            header_changed,
            context_reserve,
            ..Default::default()
        });
    }
    slot_processes.end_pass();
    (observations, ledger_cgroups, unreadable)
}

/// Logs, once a minute at most, a slot that names a process which does not map the ledger.
fn forged(ledger: &str, pid: u32) {
    static LAST: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
    let Ok(mut last) = LAST.lock() else { return };
    if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
        *last = Some(Instant::now());
        warn!(ledger = %ledger, pid, "a slot names a process that does not map the ledger: ignored (written by another process of the container?)");
    }
}

/// How long what [`SlotProcesses`] read about a process is trusted.
pub const SLOT_RECHECK: Duration = Duration::from_secs(1);

/// Whether the processes of slots without eBPF memory still run, and their cgroups: checked
/// in full (identity, cgroup) once, then by start time at most once per [`SLOT_RECHECK`] (a
/// pass may run ten times a second; a process found gone stays gone), and forgotten once no
/// slot names them.
#[derive(Default)]
pub struct SlotProcesses {
    /// By (host pid, the slot's identity, the ledger file it was found in: a slot that copies
    /// another ledger's host pid and identity is judged on its own file).
    known: HashMap<(u32, ProcessIdentity, (u64, u64)), SlotProcess>,
    pass: u64,
    /// Looks at /proc made so far.
    reads: u64,
}

struct SlotProcess {
    gone: bool,
    /// 0 when unknown (or gone).
    cgroup_id: u64,
    read: Instant,
    /// The last pass that asked.
    pass: u64,
}

impl SlotProcesses {
    fn begin_pass(&mut self) {
        self.pass += 1;
    }

    fn end_pass(&mut self) {
        let pass = self.pass;
        self.known.retain(|_, process| process.pass == pass);
    }

    /// (gone, cgroup id) of the slot's `process`, whose host pid the slot says is `host_pid`
    /// (a field the workload can write: a host pid that is not the slot's process counts as
    /// gone, so its cgroup is never taken for the ledger's). `watched`: a pidfd watch says
    /// that `host_pid` still runs `process` (the exit path's, [`crate::ledgers::exits`]): a
    /// process checked in full before is not read again while it says so.
    fn look_up(&mut self, host_pid: u32, process: ProcessIdentity, file: (u64, u64), watched: bool) -> (bool, u64) {
        let pass = self.pass;
        if let Some(known) = self.known.get_mut(&(host_pid, process, file)) {
            if !known.gone && !watched && known.read.elapsed() >= SLOT_RECHECK {
                // Checked in full before: whether it still runs is its start time's question
                // (the cgroup of a container's process stays).
                known.gone = ledger::process::running_start_time_of(host_pid) != Some(process.start_time);
                known.read = Instant::now();
                self.reads += 1;
            }
            known.pass = pass;
            return (known.gone, if known.gone { 0 } else { known.cgroup_id });
        }
        // Not the slot's process, or one that does not map the ledger: no process of it.
        let gone = !identity::is_process(host_pid, &process) || !identity::maps_file(host_pid, file);
        let cgroup_id = if gone { 0 } else { crate::cgroup::id_of_pid(host_pid).unwrap_or(0) };
        self.known.insert((host_pid, process, file), SlotProcess { gone, cgroup_id, read: Instant::now(), pass });
        self.reads += 1;
        (gone, cgroup_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ledger::{layout::CREATOR_AGENT, Charge, DeviceConfig, Geometry, Ledger};

    const MIB: u64 = 1 << 20;

    fn seen(pid: u32, ledger_bytes: Option<u64>, ebpf_bytes: u64) -> Observation {
        Observation { pid, ledger: ledger_bytes.map(|_| "/l".to_string()), ledger_bytes, ebpf_bytes, ..Default::default() }
    }

    #[test]
    fn a_slots_process_a_pidfd_watches_is_not_read_again_while_it_is_watched() {
        use std::os::unix::fs::MetadataExt;
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let pid = child.id();
        let process = crate::identity::identity_of(pid).expect("the child's identity");
        let pass = |slots: &mut SlotProcesses, file: (u64, u64), watched: bool| {
            slots.begin_pass();
            let seen = slots.look_up(pid, process, file, watched);
            slots.end_pass();
            seen
        };
        // A file the child maps (its program, once it has replaced the test's), standing for
        // its ledger; checked in full once, watched or not.
        let started = Instant::now();
        let (mut slots, file, cgroup) = loop {
            let program = std::fs::metadata(format!("/proc/{pid}/exe")).expect("its program");
            let file = (program.dev(), program.ino());
            let mut slots = SlotProcesses::default();
            let (gone, cgroup) = pass(&mut slots, file, true);
            if !gone {
                break (slots, file, cgroup);
            }
            assert!(started.elapsed() < Duration::from_secs(5), "the child never ran as a process that maps its program");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(slots.reads, 1);
        let pass = |slots: &mut SlotProcesses, watched: bool| pass(slots, file, watched);
        std::thread::sleep(SLOT_RECHECK);
        // Watched: not read again, whatever the time.
        assert_eq!(pass(&mut slots, true), (false, cgroup));
        assert_eq!(slots.reads, 1, "read again while watched");
        // Not watched (the watch's cap, a pidfd that could not be opened): read once a second.
        assert_eq!(pass(&mut slots, false), (false, cgroup));
        assert_eq!(slots.reads, 2);
        assert_eq!(pass(&mut slots, false), (false, cgroup));
        assert_eq!(slots.reads, 2, "read twice within a second");
        child.kill().expect("kill");
        child.wait().expect("reap");
        std::thread::sleep(SLOT_RECHECK);
        assert_eq!(pass(&mut slots, false), (true, 0), "gone once reaped");
    }

    fn states(r: &Reconciler) -> Vec<(u32, State)> {
        r.verdicts().iter().map(|v| (v.pid, v.state)).collect()
    }

    /// Judges `observations` on two consecutive driver reads, a second apart from `start`
    /// (what the driver shows is acted on once two reads show it).
    fn two_reads(r: &mut Reconciler, observations: Vec<Observation>, start: Instant) {
        for read in 0..2 {
            let at = start + Duration::from_secs(read);
            r.set_driver(Some(Arc::new(DriverView { read_at: Some(at), ..Default::default() })));
            r.judge(observations.clone(), at);
        }
    }

    #[test]
    fn a_pass_an_event_calls_for_settles_first_and_keeps_its_distance_from_the_last() {
        let mut r = Reconciler::new(Config::default());
        let before = Instant::now();
        let at = r.event_pass_at();
        assert!(at >= before + SETTLE && at <= Instant::now() + SETTLE, "no pass yet: SETTLE from now");
        // Just after a pass: MIN_INTERVAL after it (later than SETTLE from now), not dropped.
        let passed = Instant::now();
        r.judge(Vec::new(), passed);
        let at = r.event_pass_at();
        assert!(at >= passed + MIN_INTERVAL && at <= Instant::now() + MIN_INTERVAL, "MIN_INTERVAL after the last pass");
        // A pass long ago: SETTLE from now.
        let before = Instant::now();
        r.judge(Vec::new(), before - Duration::from_secs(1));
        let at = r.event_pass_at();
        assert!(at >= before + SETTLE && at <= Instant::now() + SETTLE, "SETTLE from now");
    }

    #[test]
    fn judges_each_state() {
        let mut r = Reconciler::new(Config::default());
        let now = Instant::now();
        let mut gone = seen(5, Some(10 * MIB), 0);
        gone.gone = true;
        r.judge(
            vec![
                seen(1, Some(100 * MIB), 100 * MIB),
                seen(2, None, 10 * MIB),
                seen(3, Some(0), 100 * MIB),
                seen(4, Some(0), 64 * MIB), // exactly the threshold: within it
                gone,
                seen(6, None, 0),
            ],
            now,
        );
        // 3's ledger is behind: not yet tampered (a free may be in flight), and a pass is
        // asked for when it can be confirmed.
        assert_eq!(
            states(&r),
            vec![(1, State::Ok), (2, State::Unhooked), (3, State::Ok), (4, State::Ok), (5, State::Stale), (6, State::Ok)]
        );
        assert_eq!(r.next_confirmation(), Some(now + TAMPER_CONFIRM));
        assert_eq!(r.ebpf_bytes_by_ledger().get("/l"), Some(&(264 * MIB)));
        // Still behind a confirmation period later: tampered.
        r.judge(vec![seen(3, Some(0), 100 * MIB)], now + TAMPER_CONFIRM);
        assert_eq!(states(&r), vec![(3, State::Tampered)]);
        assert_eq!(r.next_confirmation(), None, "nothing left to confirm");
    }

    #[test]
    fn memory_only_the_driver_explains_is_unprobed() {
        let config = Config { context_allowance: 64 * MIB, ..Config::default() };
        let mut r = Reconciler::new(config);
        let start = Instant::now();
        let driver = |bytes, devices| Some(DriverProcess { bytes, devices, start_time: 0 });
        r.set_driver(Some(Arc::new(DriverView { read_at: Some(start), ..Default::default() })));
        // 96 MiB through an unprobed copy, and its 64 MiB context: beyond the allowance.
        let escaped = Observation { pid: 20, driver: driver(160 * MIB, 1), ..Default::default() };
        // A hooked, probed process: a context at the allowance and a page explain the rest.
        let hooked = Observation { driver: driver(160 * MIB, 1), context_reserve: Some(64 * MIB), ..seen(21, Some(96 * MIB), 96 * MIB) };
        // Exactly at the allowance: context and page on each of two devices.
        let at_edge = Observation { pid: 22, driver: driver(2 * (64 * MIB + DRIVER_PAGE), 2), ..Default::default() };
        // A hooked process that also allocated 500 MiB through an unprobed copy: its ledger
        // charges its 96 MiB and its context; the 500 MiB escaped.
        let leaky = Observation { driver: driver(660 * MIB, 1), context_reserve: Some(64 * MIB), ..seen(23, Some(96 * MIB), 96 * MIB) };
        let all = vec![escaped, hooked, at_edge, leaky];
        // One read is not enough.
        r.judge(all.clone(), start);
        assert_eq!(states(&r), vec![(20, State::Ok), (21, State::Ok), (22, State::Ok), (23, State::Ok)]);
        two_reads(&mut r, all, start + Duration::from_secs(1));
        assert_eq!(states(&r), vec![(20, State::Unprobed), (21, State::Ok), (22, State::Ok), (23, State::Unprobed)]);
        assert_eq!(r.verdicts()[0].driver_bytes, Some(160 * MIB));
        let escaped_bytes: Vec<u64> = r.verdicts().iter().map(|v| v.escaped_bytes).collect();
        assert_eq!(escaped_bytes, [160 * MIB, 0, 0, 500 * MIB]);
        // Charged to the ledgers: all of the slot-less process (its cgroup is the ledger's),
        // the escaped part of the hooked one.
        r.ledger_cgroups = BTreeMap::from([("/l".into(), BTreeSet::from([7]))]);
        let in_container = Observation { pid: 24, cgroup_id: 7, driver: driver(160 * MIB, 1), ..Default::default() };
        let elsewhere = Observation { pid: 25, cgroup_id: 8, driver: driver(160 * MIB, 1), ..Default::default() };
        let leaky = Observation { driver: driver(660 * MIB, 1), context_reserve: Some(64 * MIB), ..seen(23, Some(96 * MIB), 96 * MIB) };
        two_reads(&mut r, vec![in_container, elsewhere, leaky], start + Duration::from_secs(3));
        assert_eq!(r.unaccounted_by_ledger(), BTreeMap::from([("/l".to_string(), 160 * MIB + 500 * MIB)]));
        assert_eq!(r.driver_bytes_by_ledger(), BTreeMap::from([("/l".to_string(), 160 * MIB + 660 * MIB)]));

        // A process the probes saw free 1 GiB after the driver's read started: the read's
        // figure is compared with what the probes said then.
        let mut r = Reconciler::new(config);
        let held = Observation { pid: 30, ..seen(30, None, 1024 * MIB) };
        r.judge(vec![held], start);
        r.set_driver(Some(Arc::new(DriverView { read_at: Some(start + Duration::from_millis(100)), ..Default::default() })));
        let freed = Observation { driver: driver(1088 * MIB, 1), ..seen(30, None, 0) };
        r.judge(vec![freed.clone()], start + Duration::from_millis(900));
        assert_eq!(states(&r), vec![(30, State::Ok)]);
        // Two later reads that still say so: unprobed.
        r.set_driver(Some(Arc::new(DriverView { read_at: Some(start + Duration::from_millis(2500)), ..Default::default() })));
        r.judge(vec![freed.clone()], start + Duration::from_millis(3000));
        assert_eq!(states(&r), vec![(30, State::Ok)]);
        r.set_driver(Some(Arc::new(DriverView { read_at: Some(start + Duration::from_millis(3500)), ..Default::default() })));
        r.judge(vec![freed], start + Duration::from_millis(4000));
        assert_eq!(states(&r), vec![(30, State::Unprobed)]);
    }

    #[test]
    fn enforcement_counts_the_drivers_figure_whatever_the_ledger_says() {
        let config = Config { context_allowance: 64 * MIB, ..Config::default() };
        let mut r = Reconciler::new(config);
        let start = Instant::now();
        r.set_driver(Some(Arc::new(DriverView { read_at: Some(start), ..Default::default() })));
        let driver = |bytes, start_time| Some(DriverProcess { bytes, devices: 1, start_time });
        // 96 MiB through an unprobed copy and a 64 MiB context; the process's slot forges its
        // bytes up to the driver's whole figure: the ledger explains it, nothing is charged,
        // but the cgroup is held to it (160 MiB less a context and a page).
        let forged = Observation { cgroup_id: 7, driver: driver(160 * MIB, 1000), context_reserve: Some(64 * MIB), ..seen(40, Some(160 * MIB), 0) };
        // The same with a rewritten header: tampered, still held to it.
        let header = Observation { pid: 41, header_changed: true, ..forged.clone() };
        // An honest hooked process whose context (500 MiB) is larger than its ledger's reserve
        // (64 MiB) but within a generous allowance: nothing enforced.
        let honest = Observation { cgroup_id: 7, driver: driver(596 * MIB, 1100), context_reserve: Some(64 * MIB), ..seen(42, Some(96 * MIB), 96 * MIB) };
        two_reads(&mut r, vec![forged, header, honest.clone()], start);
        assert_eq!(states(&r), vec![(40, State::Ok), (41, State::Tampered), (42, State::Unprobed)]);
        let enforced: Vec<u64> = r.verdicts().iter().map(|v| v.enforced_bytes).collect();
        assert_eq!(enforced, [94 * MIB, 94 * MIB, 500 * MIB - 66 * MIB]);
        let mut r = Reconciler::new(Config { context_allowance: 600 * MIB, ..config });
        two_reads(&mut r, vec![honest], start);
        assert_eq!(r.verdicts()[0].enforced_bytes, 0, "{:?}", r.verdicts());
    }

    #[test]
    fn a_huge_reserve_in_a_workloads_own_ledger_explains_no_more_than_the_allowance() {
        let mut r = Reconciler::new(Config { context_allowance: 64 * MIB, ..Config::default() });
        let start = Instant::now();
        r.set_driver(Some(Arc::new(DriverView { read_at: Some(start), ..Default::default() })));
        // 500 MiB through an unprobed copy, a 64 MiB context; the ledger says its reserve is 1 TiB.
        let huge = Observation { driver: Some(DriverProcess { bytes: 660 * MIB, devices: 1, start_time: 1 }), context_reserve: Some(1 << 40), ..seen(50, Some(96 * MIB), 96 * MIB) };
        two_reads(&mut r, vec![huge], start);
        assert_eq!((r.verdicts()[0].state, r.verdicts()[0].escaped_bytes), (State::Unprobed, 500 * MIB));
    }

    #[test]
    fn a_rewritten_header_does_not_lose_the_drivers_charge() {
        let mut r = Reconciler::new(Config { context_allowance: 64 * MIB, ..Config::default() });
        let start = Instant::now();
        r.set_driver(Some(Arc::new(DriverView { read_at: Some(start), ..Default::default() })));
        r.ledger_cgroups = BTreeMap::from([("/l".into(), BTreeSet::from([7]))]);
        // 500 MiB through an unprobed copy, beside 96 MiB probed and charged.
        let leaky = Observation {
            cgroup_id: 7,
            header_changed: true,
            driver: Some(DriverProcess { bytes: 660 * MIB, devices: 1, start_time: 1 }),
            context_reserve: Some(64 * MIB),
            ..seen(60, Some(96 * MIB), 96 * MIB)
        };
        two_reads(&mut r, vec![leaky], start);
        assert_eq!((r.verdicts()[0].state, r.verdicts()[0].escaped_bytes), (State::Tampered, 500 * MIB));
        assert_eq!(r.unaccounted_by_ledger(), BTreeMap::from([("/l".to_string(), 500 * MIB)]));
        assert_eq!(r.holders_by_cgroup()[&7].iter().map(|p| p.escaped).collect::<Vec<_>>(), [500 * MIB - 2 * MIB]);
    }

    /// A job whose kernels (eager loading, 800 MiB past its 64 MiB context) are charged, then
    /// fills its quota between a read and the pass that joins it: the read shows the driver
    /// before the growth, which hides the kernels' memory. The charge stays (the job would
    /// otherwise fill the room it held, pass its quota on the driver and be stopped: an H200,
    /// docs/gpu.md). Reads that started after the growth lower it once two agree.
    #[test]
    fn memory_charged_beside_a_growing_ledger_stays_charged_until_a_read_after_the_growth() {
        let mut r = Reconciler::new(Config { context_allowance: 64 * MIB, ..Config::default() });
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let job = |ledger: u64, driver: u64| Observation {
            cgroup_id: 7,
            driver: Some(DriverProcess { bytes: driver, devices: 1, start_time: 1 }),
            context_reserve: Some(64 * MIB),
            ..seen(80, Some(ledger), ledger)
        };
        let pass = |r: &mut Reconciler, read: u64, ledger, driver| {
            r.set_driver(Some(Arc::new(DriverView { read_at: Some(at(read)), ..Default::default() })));
            r.judge(vec![job(ledger, driver)], at(read + 500));
            (r.verdicts()[0].state, r.verdicts()[0].escaped_bytes, r.unaccounted_by_ledger().get("/l").copied().unwrap_or(0))
        };
        let kernels = 800 * MIB;
        pass(&mut r, 0, 200 * MIB, 200 * MIB + 64 * MIB + kernels);
        assert_eq!(pass(&mut r, 1000, 200 * MIB, 200 * MIB + 64 * MIB + kernels), (State::Unprobed, kernels, kernels));
        // 3 GiB more in the ledger by the pass; the read started before it.
        assert_eq!(pass(&mut r, 2000, 3200 * MIB, 200 * MIB + 64 * MIB + kernels), (State::Unprobed, kernels, kernels));
        // A read after the growth shows it all: the same charge.
        assert_eq!(pass(&mut r, 3000, 3200 * MIB, 3200 * MIB + 64 * MIB + kernels), (State::Unprobed, kernels, kernels));
        // One read that shows less (a free, the read, the same allocation again, all between
        // two passes, would show it so): the charge stays.
        let less = 100 * MIB;
        assert_eq!(pass(&mut r, 4000, 3200 * MIB, 3200 * MIB + 64 * MIB + less), (State::Unprobed, kernels, kernels));
        assert_eq!(pass(&mut r, 5000, 3200 * MIB, 3200 * MIB + 64 * MIB + kernels), (State::Unprobed, kernels, kernels));
        // The kernels' memory given back (an unloaded module): two reads after it lower it.
        pass(&mut r, 6000, 3200 * MIB, 3200 * MIB + 64 * MIB + less);
        assert_eq!(pass(&mut r, 7000, 3200 * MIB, 3200 * MIB + 64 * MIB + less), (State::Unprobed, less, less));
        // A read showing more needs two reads as before.
        assert_eq!(pass(&mut r, 8000, 3200 * MIB, 3200 * MIB + 64 * MIB + kernels), (State::Unprobed, less, less));
        assert_eq!(pass(&mut r, 9000, 3200 * MIB, 3200 * MIB + 64 * MIB + kernels), (State::Unprobed, kernels, kernels));
    }

    #[test]
    fn an_escape_is_published_for_the_joined_process_once_two_reads_show_it() {
        let mut r = Reconciler::new(Config { context_allowance: 64 * MIB, ..Config::default() });
        let start = Instant::now();
        // A pid no process has here: the start time published is the joined row's, not /proc's.
        let pid = 4_000_001;
        let escaped = |bytes| Observation { pid, cgroup_id: 7, driver: Some(DriverProcess { bytes, devices: 1, start_time: 4242 }), ..Default::default() };
        let read = |r: &mut Reconciler, at| r.set_driver(Some(Arc::new(DriverView { read_at: Some(at), ..Default::default() })));
        let published = |r: &Reconciler| r.holders_by_cgroup().get(&7).cloned().unwrap_or_default();
        read(&mut r, start);
        r.judge(vec![escaped(200 * MIB)], start);
        assert_eq!(published(&r), [], "one read");
        // Another pass on the same read: still one read.
        r.judge(vec![escaped(200 * MIB)], start + Duration::from_millis(200));
        assert_eq!(published(&r), []);
        // The next read shows less: the smaller of the two is what counts.
        read(&mut r, start + Duration::from_secs(1));
        r.judge(vec![escaped(160 * MIB)], start + Duration::from_secs(1));
        assert_eq!(published(&r), [Holder { pid, start_time: 4242, held: 94 * MIB, unadmitted: 94 * MIB, live: 0, escaped: 94 * MIB }]);
        // A read without it starts over.
        read(&mut r, start + Duration::from_secs(2));
        r.judge(vec![Observation { driver: None, ..escaped(0) }], start + Duration::from_secs(2));
        read(&mut r, start + Duration::from_secs(3));
        r.judge(vec![escaped(160 * MIB)], start + Duration::from_secs(3));
        assert_eq!(published(&r), []);
    }

    /// The pool, as the agent sees it without a hook: 2 GiB by `cuMemAllocAsync`,
    /// freed into a pool that keeps it, 4 s (longer than the probes' figures are remembered),
    /// then 2 GiB from the pool again and 256 MiB more: never outside the probes. The same
    /// pool that gave its memory back at a synchronize (a low release threshold) explains
    /// nothing after: memory the driver shows again without a probed allocation is outside.
    #[test]
    fn a_pool_that_keeps_what_it_frees_is_counted_once() {
        const GIB: u64 = 1 << 30;
        let mut r = Reconciler::new(Config { context_allowance: 64 * MIB, ..Config::default() });
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let process = |ebpf_bytes, pool_kept, driver| Observation {
            pid: 70,
            cgroup_id: 7,
            ebpf_bytes,
            pool_kept,
            generation: 1,
            driver: Some(DriverProcess { bytes: driver + 64 * MIB, devices: 1, start_time: 1 }),
            ..Default::default()
        };
        let read = |r: &mut Reconciler, ms| r.set_driver(Some(Arc::new(DriverView { read_at: Some(at(ms)), ..Default::default() })));
        // Freed before any pass saw it live; the pool keeps it. Six reads, a second apart.
        for second in 0..6 {
            read(&mut r, second * 1000);
            r.judge(vec![process(0, 2 * GIB, 2 * GIB)], at(second * 1000 + 500));
            let v = &r.verdicts()[0];
            assert_eq!((v.state, v.enforced_bytes, v.pool_kept_bytes, v.held_bytes), (State::Ok, 0, 2 * GIB, 2 * GIB), "{v:?}");
            // What the pool keeps counts in the cgroup's usage once two reads show it held (as
            // the driver holds it: a page aside).
            let held = if second == 0 { 0 } else { 2 * GIB - DRIVER_PAGE };
            assert_eq!((v.limit_bytes, v.unadmitted_bytes), (held, held), "{v:?}");
            let holders = r.holders_by_cgroup().get(&7).cloned().unwrap_or_default();
            assert_eq!(holders.iter().map(|h| (h.held, h.live, h.escaped)).collect::<Vec<_>>(), if second == 0 { vec![] } else { vec![(held, 0, 0)] });
        }
        // Taken again, and 256 MiB more; the read is before the pass that sees it.
        read(&mut r, 6000);
        r.judge(vec![process(2 * GIB + 256 * MIB, 0, 2 * GIB + 256 * MIB)], at(6500));
        read(&mut r, 7000);
        r.judge(vec![process(2 * GIB + 256 * MIB, 0, 2 * GIB + 256 * MIB)], at(7500));
        let v = &r.verdicts()[0];
        // (Unhooked: no ledger has a slot for it; nothing escaped.)
        assert_eq!((v.state, v.enforced_bytes, v.held_bytes), (State::Unhooked, 0, 2 * GIB + 256 * MIB), "{v:?}");
        // Its cgroup counts what it holds once: live, nothing kept (taken back), nothing escaped.
        let holders = r.holders_by_cgroup();
        let held = 2 * GIB + 256 * MIB - DRIVER_PAGE;
        assert_eq!(holders[&7].iter().map(|h| (h.held, h.live, h.escaped, h.unadmitted)).collect::<Vec<_>>(), [(held, 2 * GIB + 256 * MIB, 0, held)]);

        // Another process's pool gives its 2 GiB back at a synchronize: a read that started
        // after the probes' figure was seen says so.
        let other = |driver| Observation { pid: 71, ..process(0, 2 * GIB, driver) };
        read(&mut r, 8000);
        r.judge(vec![other(0)], at(8500));
        assert_eq!(r.verdicts()[0].pool_kept_bytes, 2 * GIB, "the read may be before the free");
        read(&mut r, 9000);
        r.judge(vec![other(0)], at(9500));
        assert_eq!(r.verdicts()[0].pool_kept_bytes, 0);
        // Neither read counted the 2 GiB it gave back in its cgroup's usage.
        assert_eq!(r.verdicts()[0].limit_bytes, 0);
        // 2 GiB through a copy of libcuda no probe is on: outside, on two reads.
        for ms in [10000, 11000] {
            read(&mut r, ms);
            r.judge(vec![other(2 * GIB)], at(ms + 500));
        }
        let v = &r.verdicts()[0];
        assert_eq!((v.state, v.enforced_bytes), (State::Unprobed, 2 * GIB - DRIVER_PAGE), "{v:?}");
    }

    #[test]
    fn a_driver_row_whose_pid_is_another_process_now_is_not_joined() {
        let row = |bytes, start_time| DriverProcess { bytes, devices: 1, start_time };
        let driver = BTreeMap::from([(10, row(100 * MIB, 1000)), (11, row(200 * MIB, 1100)), (12, row(MIB, 1200))]);
        let mut observations = vec![seen(10, None, 0), seen(11, None, 0)];
        // 10 is the process read; 11 was reused (a new start time); 12 is gone.
        let now = |pid: u32| match pid {
            10 => Some(1000),
            11 => Some(5000),
            _ => None,
        };
        let unjoined = join_driver(&mut observations, &driver, now);
        assert_eq!(observations.iter().map(|o| (o.pid, o.driver.map(|d| d.bytes))).collect::<Vec<_>>(), [(10, Some(100 * MIB)), (11, None)]);
        assert_eq!(unjoined, [UnjoinedProcess { pid: 11, bytes: 200 * MIB, reason: crate::driver::REUSED.into() }]);
    }

    #[test]
    fn a_ledger_behind_for_a_moment_is_not_tampering() {
        let mut r = Reconciler::new(Config::default());
        let now = Instant::now();
        // A 1 GiB free counted by the probes, not yet released by the hook; then released.
        r.judge(vec![seen(9, Some(1024 * MIB), 0)], now);
        r.judge(vec![seen(9, Some(1024 * MIB), 0)], now + Duration::from_millis(50));
        r.judge(vec![seen(9, Some(0), 0)], now + Duration::from_millis(100));
        // Behind again later: the period starts over.
        r.judge(vec![seen(9, Some(0), 100 * MIB)], now + Duration::from_millis(300));
        assert_eq!(states(&r), vec![(9, State::Ok)]);
        r.judge(vec![seen(9, Some(0), 100 * MIB)], now + Duration::from_millis(400));
        assert_eq!(states(&r), vec![(9, State::Ok)]);
        assert_eq!(r.unaccounted_by_ledger(), BTreeMap::new(), "nothing charged while unconfirmed");
        r.judge(vec![seen(9, Some(0), 100 * MIB)], now + Duration::from_millis(300) + TAMPER_CONFIRM);
        assert_eq!(states(&r), vec![(9, State::Tampered)]);
    }

    #[test]
    fn a_cgroup_shared_by_ledgers_is_nobodys() {
        let mut r = Reconciler::new(Config::default());
        r.ledger_cgroups = BTreeMap::from([("/a".into(), BTreeSet::from([1, 2])), ("/b".into(), BTreeSet::from([2, 3]))]);
        assert_eq!(r.cgroup_ledgers(), BTreeMap::from([(1, "/a"), (3, "/b")]));
        let unhooked = |pid, cgroup_id, ebpf_bytes| Observation { pid, cgroup_id, ebpf_bytes, ..Default::default() };
        r.judge(vec![unhooked(10, 1, MIB), unhooked(11, 2, 5 * MIB), unhooked(12, 3, 2 * MIB), unhooked(13, 3, MIB)], Instant::now());
        assert_eq!(r.unaccounted_by_ledger(), BTreeMap::from([("/a".to_string(), MIB), ("/b".to_string(), 3 * MIB)]));
    }

    #[test]
    fn drift_needs_the_grace_period_and_resets() {
        let config = Config { threshold: 64 * MIB, grace: Duration::from_secs(5), ..Config::default() };
        let mut r = Reconciler::new(config);
        let start = Instant::now();
        let ahead = || vec![seen(7, Some(200 * MIB), 100 * MIB)];
        r.judge(ahead(), start);
        assert_eq!(states(&r), vec![(7, State::Ok)]);
        r.judge(ahead(), start + Duration::from_secs(4));
        assert_eq!(states(&r), vec![(7, State::Ok)]);
        r.judge(ahead(), start + Duration::from_secs(6));
        assert_eq!(states(&r), vec![(7, State::Drift)]);
        // Back in line: ok, and a new difference waits a full grace period again.
        r.judge(vec![seen(7, Some(100 * MIB), 100 * MIB)], start + Duration::from_secs(7));
        assert_eq!(states(&r), vec![(7, State::Ok)]);
        r.judge(ahead(), start + Duration::from_secs(8));
        r.judge(ahead(), start + Duration::from_secs(12));
        assert_eq!(states(&r), vec![(7, State::Ok)]);
        r.judge(ahead(), start + Duration::from_secs(14));
        assert_eq!(states(&r), vec![(7, State::Drift)]);
    }

    #[test]
    fn a_second_context_on_a_device_is_the_ledgers_extra_context() {
        let dir = std::env::temp_dir().join(format!("vramguard-reconcile-ctx-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let device = DeviceConfig { limit: 1 << 30, chunk: 2 * MIB, context_reserve: 64 * MIB, ..Default::default() };
        let geometry = Geometry { slots: 4, records: 64, devices: vec![device, device] };
        let ledger = Ledger::create(&dir.join("ledger"), &geometry, CREATOR_AGENT).expect("create");
        let slot = ledger.register(ProcessIdentity::current().expect("identity")).expect("register");
        let extra = |ledger: &Ledger| {
            let slots = ledger.slots().expect("slots");
            crate::ledgers::slot_extra_contexts(&slots[0].slot, &geometry.devices)
        };
        // One context on each of two devices: none beyond the first.
        ledger.reserve(slot, 0, Charge::Context, 0).expect("context 0");
        ledger.reserve(slot, 1, Charge::Context, 0).expect("context 1");
        assert_eq!(extra(&ledger), 0);
        // A second context on device 0 (cuCtxCreate beside the primary one).
        ledger.reserve(slot, 0, Charge::AnotherContext, 0).expect("another context");
        assert_eq!(extra(&ledger), 64 * MIB);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The identity of a child process once it has exec'd (its start time and namespace).
    fn wait_identity(pid: u32) -> ProcessIdentity {
        for _ in 0..1000 {
            if let Some(identity) = identity::identity_of(pid) {
                return identity;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("no identity for process {pid}");
    }

    #[test]
    fn joins_a_slot_with_this_process_by_identity() {
        let dir = std::env::temp_dir().join(format!("vramguard-reconcile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("pod")).expect("mkdir");
        let geometry = Geometry {
            slots: 4,
            records: 64,
            devices: vec![DeviceConfig { limit: 1 << 30, chunk: 2 * MIB, context_reserve: 64 * MIB, ..Default::default() }],
        };
        let path = dir.join("pod/ledger");
        let ledger = Ledger::create(&path, &geometry, CREATOR_AGENT).expect("create");
        let me = ProcessIdentity::current().expect("identity");
        let slot = ledger.register(me).expect("register");
        ledger.reserve(slot, 0, Charge::Context, 0).expect("context");
        ledger.reserve(slot, 0, Charge::Device(100 * MIB), 0x1000).expect("data");
        ledger.reserve(slot, 0, Charge::Device(4096), 0x2000).expect("small");
        ledger.reserve(slot, 0, Charge::Managed(8 * MIB), 0x3000).expect("managed");
        let charged = 100 * MIB + 4096 + 8 * MIB;
        let mut ledgers = Ledgers::new(dir.clone());
        ledgers.scan();

        let pid = std::process::id();
        let cgroup_id = crate::cgroup::id_of_pid(pid).unwrap_or(0);
        let me = |bytes| EbpfProcess { pid, generation: 1, cgroup_id, bytes, pool_kept: 0 };
        // The reconciler of another process (the agent's own slot is never judged).
        let mut r = Reconciler::new(Config::default());
        r.agent = None;
        r.pass(Some(&ledgers), &[me(charged)]);
        let name = path.display().to_string();
        let ok = Verdict { pid, cgroup_id, state: State::Ok, ledger: Some(name.clone()), ledger_bytes: Some(charged), ebpf_bytes: charged, driver_bytes: None, pool_kept_bytes: 0, held_bytes: charged, escaped_bytes: 0, enforced_bytes: 0, limit_bytes: 0, unadmitted_bytes: 0, driver_start_time: None, start_time: crate::identity::identity_of(pid).map(|i| i.start_time) };
        assert_eq!(r.verdicts(), [ok]);
        assert_eq!(r.ledger_cgroups().get(&name), Some(&BTreeSet::from([cgroup_id])));
        assert_eq!(r.unaccounted_by_ledger(), BTreeMap::new());

        // The probes see 100 MiB more than the ledger charges, for longer than a free could
        // explain: tampered, and the excess is the ledger's unaccounted memory.
        r.pass(Some(&ledgers), &[me(charged + 100 * MIB)]);
        assert_eq!(r.verdicts()[0].state, State::Ok);
        std::thread::sleep(TAMPER_CONFIRM);
        r.pass(Some(&ledgers), &[me(charged + 100 * MIB)]);
        assert_eq!(r.verdicts()[0].state, State::Tampered);
        assert_eq!(r.unaccounted_by_ledger(), BTreeMap::from([(name.clone(), 100 * MIB)]));

        // Without eBPF memory and without a host pid the slot is left out; with this
        // process's host pid recorded it is a live process (ledger ahead, within grace).
        r.pass(Some(&ledgers), &[]);
        assert_eq!(r.verdicts(), []);
        // Recorded as the agent's reclaimer does (the ledger's slots read again at once).
        ledgers.iter().next().expect("watched").1.set_host_pid(slot, pid).expect("written");
        r.pass(Some(&ledgers), &[]);
        assert_eq!(states(&r), vec![(pid, State::Ok)]);
        // Another process (pid 1) is not in any ledger: unhooked. In another cgroup it is
        // no ledger's business; in the ledger's cgroup, its memory is the ledger's.
        r.pass(Some(&ledgers), &[EbpfProcess { pid: 1, generation: 1, cgroup_id: cgroup_id + 1, bytes: MIB, pool_kept: 0 }]);
        assert!(states(&r).contains(&(1, State::Unhooked)), "{:?}", r.verdicts());
        assert_eq!(r.unaccounted_by_ledger(), BTreeMap::new());
        r.pass(Some(&ledgers), &[EbpfProcess { pid: 1, generation: 1, cgroup_id, bytes: MIB, pool_kept: 0 }]);
        assert_eq!(r.unaccounted_by_ledger(), BTreeMap::from([(name.clone(), MIB)]));

        // A slot naming another process (a child that never mapped the ledger), written by
        // this one: not that process's slot. It stays un-hooked, outside the ledger.
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let child_pid = child.id();
        let child_identity = wait_identity(child_pid);
        ledger.register(child_identity).expect("forged slot");
        let forged = EbpfProcess { pid: child_pid, generation: 7, cgroup_id: cgroup_id + 2, bytes: 3 * MIB, pool_kept: 0 };
        r.pass(Some(&ledgers), &[me(charged), forged]);
        let verdict = r.verdicts().iter().find(|v| v.pid == child_pid).cloned().expect("the child's verdict");
        assert_eq!((verdict.state, verdict.ledger.clone()), (State::Unhooked, None), "{verdict:?}");
        assert!(!r.ledger_cgroups()[&name].contains(&(cgroup_id + 2)), "{:?}", r.ledger_cgroups());
        let _ = child.kill();
        let _ = child.wait();

        // Judged from this process, the slot is the reconciler's own: left out.
        let mut own = Reconciler::new(Config::default());
        own.pass(Some(&ledgers), &[me(charged)]);
        assert_eq!(states(&own), vec![(pid, State::Unhooked)]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
