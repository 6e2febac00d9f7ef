//! The kernel task: owns the loaded eBPF programs (loaded by [`super::load`]; they go, and
//! every probe with them, when the task ends, however it ends) and the maps the agent reads
//! and writes while it runs (the accounting maps and their exit ring buffer, the cgroup
//! limits, the programs' log), and does only work
//! whose size no tenant sets: map sizes are capped at load time, the limits file and the cgroup
//! tree are the operator's. It never touches a ledger, a tenant's file or a worker, so the
//! limits pushed to the probes and the exits handed to reclaim never wait on tenant work.
//!
//! Each turn of its loop is one of: drain the exit ring buffer (woken by the ring, or by the
//! drain timer), sweeping the exited processes' own allocation records; sweep every record if
//! exits or record keys were lost, and removed cgroups' entries if the tree changed
//! (`--sweep-ms`); push the cgroup limits (every
//! `--rescan-ms`, and at once when the provisioned containers change); answer a request for
//! the current view (a [`KernelView`], for reconcile passes and `vramguard audit`); attach
//! the probes to a libcuda file discovery identified (an [`AttachRequest`]: discovery reads
//! the tenants' files, so a panic there never takes the programs with it); forward the
//! programs' log lines.
//!
//! The drain timer is for what does not wake the task: the journal of record keys (written
//! without a wake-up, so that an allocation costs no wake-up of the agent) and the probes'
//! allocation and free counters. It runs every `--drain-ms` while drains find something, and
//! backs off (twice as long after each drain that found nothing) to [`IDLE_DRAIN`] on an idle
//! node; an exit (the ring wakes the task) or a drain that finds anything brings it back to
//! `--drain-ms`; any drain (a reconcile pass's view is taken after one) puts the next timed
//! one a period later. What an idle node's first allocations cost: their keys wait up to
//! [`IDLE_DRAIN`] in the journal (a journal that fills meanwhile loses keys, counted, and the
//! next full sweep finds their records, as for any full journal), and the pass they call for
//! up to as long (a pass runs every second anyway). Enforcement never waits for a drain: the
//! probes hold the limits.
use std::{
    collections::BTreeMap,
    mem::ManuallyDrop,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use aya::{
    maps::{MapData, RingBuf},
    Ebpf,
};
use tokio::{
    io::unix::AsyncFd,
    sync::{mpsc, oneshot, watch},
    time::{interval, MissedTickBehavior},
};
use tracing::{info, warn};

use super::{
    accounting::Accounting,
    enforce,
    log::Logger,
    multi::MultiPrograms,
    probes::{Attacher, Link},
};
use crate::{
    cgroup::CgroupNames,
    libcuda::{AttachRequest, Prober},
    task::{changed, Heartbeat},
    snapshot::{EbpfProcess, HoldersByCgroup, Snapshot},
};

/// The eBPF side as of one drain: the processes (for reconcile) and the whole view.
pub struct KernelView {
    pub processes: Vec<EbpfProcess>,
    pub snapshot: Snapshot,
}

/// How the task is told things and what it tells.
pub struct Wiring {
    /// Asks for a [`KernelView`] (drained just before it is taken).
    pub requests: mpsc::Receiver<oneshot::Sender<KernelView>>,
    /// Discovery's requests to probe a libcuda file.
    pub attach: mpsc::Receiver<AttachRequest>,
    /// The limits the ledgers' containers are held to (cgroup id -> bytes), from reconcile.
    pub ledger_limits: watch::Receiver<BTreeMap<u64, u64>>,
    /// What each cgroup's processes hold as the driver shows it, from reconcile (which joins
    /// the driver's view: NVML is never on this task's path).
    pub holders: watch::Receiver<Arc<HoldersByCgroup>>,
    /// The provisioned containers' limits (cgroup path -> bytes), when the agent provisions.
    pub provisioned: Option<watch::Receiver<BTreeMap<String, u64>>>,
    /// The driver's own limits (r615+): the cgroups it holds get no probe limit.
    pub driver_limits: Option<watch::Receiver<crate::driver_limits::DriverLimits>>,
    /// Where the cgroups the limits file's rules name go (path -> limit), for the driver's
    /// limits.
    pub ruled: Option<watch::Sender<BTreeMap<String, u64>>>,
    /// Exits for the reclaim task: a bounded queue of exits only (allocations are not events);
    /// an exit that finds it full is dropped, and the reclaim sweep finds that process gone
    /// within a second.
    pub exits: mpsc::Sender<(u32, std::time::Instant)>,
    /// Rung when a drain found something (a pass is worth running).
    pub changed: Arc<tokio::sync::Notify>,
    pub heartbeat: Heartbeat,
    pub stop: watch::Receiver<bool>,
}

/// The drain timer's longest period on an idle node (`--drain-ms` while drains find things).
pub const IDLE_DRAIN: Duration = Duration::from_secs(1);

/// The drain timer's next period after a drain (`timed`: the timer's own) that `found`
/// something or not: `every` after one that found something, twice `now` after a timed one
/// that found nothing (up to [`IDLE_DRAIN`]), else `now` again (a drain was just made).
fn next_drain(found: bool, timed: bool, now: Duration, every: Duration) -> Duration {
    match (found, timed) {
        (true, _) => every,
        (false, true) => (now * 2).min(IDLE_DRAIN.max(every)),
        (false, false) => now,
    }
}

/// How often the task does each thing.
pub struct Every {
    pub drain: Duration,
    pub sweep: Duration,
    pub limits: Duration,
}

/// The task's state.
pub struct Kernel {
    /// The loaded programs (their maps taken out into the fields below).
    pub programs: Programs,
    pub accounting: Accounting,
    pub exits: AsyncFd<RingBuf<MapData>>,
    pub log: Logger,
    pub limits: Option<enforce::Limits>,
    pub cgroups: CgroupNames,
    /// Discovery's handle on the new executable mappings (taken by `run` for discovery; none
    /// if the programs could not be attached).
    pub exec_mapped: Option<super::exec::ExecMapped>,
}

/// The loaded programs: dropping them (at the task's end, however it ends: a return, a panic
/// or an abort) starts detaching every probe and tracepoint on a thread of its own (the
/// kernel waits for a grace period for each link, or perf event), which [`wait_detached`]
/// waits for before the agent exits.
pub struct Programs {
    ebpf: ManuallyDrop<Ebpf>,
    /// The uprobe programs loaded for uprobe_multi links (none: perf events).
    multi: Option<MultiPrograms>,
    /// Every probe attached.
    links: Vec<Link>,
}

/// The threads detaching dropped programs.
static DETACHING: Mutex<Vec<std::thread::JoinHandle<()>>> = Mutex::new(Vec::new());

impl Programs {
    pub fn new(ebpf: Ebpf, multi: Option<MultiPrograms>) -> Programs {
        Programs { ebpf: ManuallyDrop::new(ebpf), multi, links: Vec::new() }
    }
}

impl Drop for Programs {
    fn drop(&mut self) {
        // SAFETY: the programs are taken once, here, and the field is never used again.
        let mut ebpf = unsafe { ManuallyDrop::take(&mut self.ebpf) };
        let links = std::mem::take(&mut self.links);
        let multi = self.multi.take();
        let detach = move || {
            let started = std::time::Instant::now();
            let links_count = links.len();
            super::probes::detach_all(&mut ebpf, links);
            let probes = started.elapsed();
            drop(multi);
            drop(ebpf);
            info!(links = links_count, probes = ?probes, took = ?started.elapsed(), "probes detached");
        };
        match std::thread::Builder::new().name("vramguard-detach".into()).spawn(detach) {
            Ok(thread) => DETACHING.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(thread),
            Err(error) => warn!(%error, "cannot start a thread to detach the probes: they go at the agent's exit"),
        }
    }
}

/// Waits up to `limit` for the probes of dropped programs to be detached; whether they are.
pub fn wait_detached(limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    let threads = std::mem::take(&mut *DETACHING.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
    for thread in threads {
        while !thread.is_finished() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = thread.join();
    }
    true
}

impl Kernel {
    /// Attaches probes for the task's owner before the task runs (`--libcuda`, the first scan).
    pub fn attacher(&mut self) -> Attacher<'_> {
        let programs = &mut self.programs;
        Attacher { ebpf: &mut programs.ebpf, multi: programs.multi.as_mut(), links: &mut programs.links }
    }

    /// Runs until `stop` turns true; then flushes the programs' log and detaches every probe.
    pub async fn run(mut self, every: Every, mut wiring: Wiring) -> Result<()> {
        let tick = |period: Duration| {
            let mut timer = interval(period);
            timer.set_missed_tick_behavior(MissedTickBehavior::Delay);
            timer
        };
        let (mut sweep, mut limits_tick) = (tick(every.sweep), tick(every.limits));
        // The drain timer: `every.drain` while drains find something, twice as long after each
        // that finds nothing, up to [`IDLE_DRAIN`] (see the module doc).
        let mut drain_every = every.drain;
        let drain = tokio::time::sleep(drain_every);
        tokio::pin!(drain);
        let mut provisioned = wiring.provisioned.clone();
        let mut driver_limits = wiring.driver_limits.clone();
        let mut holders = Some(wiring.holders.clone());
        let mut dropped_exits = 0u64;
        loop {
            wiring.heartbeat.beat();
            tokio::select! {
                _ = wiring.stop.changed() => break,
                guard = self.exits.readable_mut() => {
                    guard.context("polling the exit ring buffer")?.clear_ready();
                    let found = self.drain(&wiring, &mut dropped_exits);
                    drain_every = next_drain(found, false, drain_every, every.drain);
                    drain.as_mut().reset(tokio::time::Instant::now() + drain_every);
                }
                guard = self.log.readable_mut() => {
                    let mut guard = guard.context("polling the eBPF programs' log")?;
                    guard.get_inner_mut().flush();
                    guard.clear_ready();
                }
                () = &mut drain => {
                    let found = self.drain(&wiring, &mut dropped_exits);
                    drain_every = next_drain(found, true, drain_every, every.drain);
                    drain.as_mut().reset(tokio::time::Instant::now() + drain_every);
                }
                _ = sweep.tick() => {
                    self.drain(&wiring, &mut dropped_exits);
                    self.accounting.sweep_missed();
                    super::cgroups::sweep(&mut self.accounting, self.limits.as_mut(), &mut self.cgroups);
                }
                _ = limits_tick.tick(), if self.limits.is_some() => self.push_limits(&mut wiring),
                _ = changed(&mut provisioned) => self.push_limits(&mut wiring),
                _ = changed(&mut driver_limits) => self.push_limits(&mut wiring),
                _ = changed(&mut holders), if self.limits.is_some() => self.push_limits(&mut wiring),
                request = wiring.requests.recv() => {
                    let Some(reply) = request else { continue };
                    let found = self.drain(&wiring, &mut dropped_exits);
                    drain_every = next_drain(found, false, drain_every, every.drain);
                    drain.as_mut().reset(tokio::time::Instant::now() + drain_every);
                    let _ = reply.send(self.view());
                }
                Some(request) = wiring.attach.recv() => {
                    let report = self.attacher().attach(&request.file, &request.offsets);
                    let _ = request.reply.send(report);
                }
            }
        }
        self.log.get_mut().flush();
        Ok(())
    }

    /// Drains the ring; hands the exits to reclaim and sweeps their records. Whether it found
    /// anything (an exit, a journaled record, an allocation or free counted).
    fn drain(&mut self, wiring: &Wiring, dropped: &mut u64) -> bool {
        let drained = self.accounting.drain(self.exits.get_mut());
        for exit in self.accounting.take_exits() {
            if wiring.exits.try_send(exit).is_err() {
                *dropped += 1;
                if dropped.is_power_of_two() {
                    warn!(dropped = *dropped, "the reclaim task's exit queue is full: exits dropped (its sweep finds them)");
                }
            }
        }
        if self.accounting.sweep_due() {
            self.accounting.sweep();
        }
        if drained > 0 {
            wiring.changed.notify_one();
        }
        drained > 0
    }

    /// Brings the limits in the probes in line with the ledgers' and the provisioned ones.
    fn push_limits(&mut self, wiring: &mut Wiring) {
        let Some(limits) = self.limits.as_mut() else { return };
        if let Some(provisioned) = wiring.provisioned.as_mut() {
            limits.set_provisioned(provisioned.borrow_and_update().clone());
        }
        if let Some(driver) = wiring.driver_limits.as_mut() {
            limits.set_driver_held(driver.borrow_and_update().held_cgroups());
        }
        limits.set_ledger_limits(wiring.ledger_limits.borrow_and_update().clone());
        limits.set_holders(wiring.holders.borrow_and_update().clone());
        limits.refresh(&mut self.cgroups);
        if let Some(ruled) = &wiring.ruled {
            ruled.send_if_modified(|old| {
                let changed = old != limits.ruled();
                if changed {
                    old.clone_from(limits.ruled());
                }
                changed
            });
        }
        let accounting = &self.accounting;
        limits.signal_over_limit(|cgroup| accounting.cgroup_bytes(cgroup));
    }

    /// The probes' maps as they are now.
    fn view(&mut self) -> KernelView {
        let (mut snapshot, processes) = self.accounting.snapshot(&mut self.cgroups);
        snapshot.stats.cgroup_limits = self.limits.as_ref().map_or(0, |l| l.applied() as u64);
        // The agent's signals to processes over their cgroup's limit count with the probes'.
        let (signals, by_why) = self.limits.as_ref().map_or((0, [0; 3]), |l| l.agent_signals());
        snapshot.stats.signals_sent = snapshot.stats.signals_sent.saturating_add(signals);
        snapshot.stats.agent_signals = by_why;
        snapshot.kernel_maps.cgroup_limits = self.limits.as_ref().map_or_else(Vec::new, |l| l.ids());
        KernelView { processes, snapshot }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_drain_timer_backs_off_while_drains_find_nothing_and_comes_back_at_once() {
        let every = Duration::from_millis(100);
        let mut period = every;
        let mut periods = Vec::new();
        for _ in 0..6 {
            period = next_drain(false, true, period, every);
            periods.push(period.as_millis());
        }
        assert_eq!(periods, [200, 400, 800, 1000, 1000, 1000]);
        // A drain made for another reason that found nothing keeps the period; one that found
        // something brings it back, timed or not.
        assert_eq!(next_drain(false, false, period, every), IDLE_DRAIN);
        assert_eq!(next_drain(true, false, period, every), every);
        assert_eq!(next_drain(true, true, period, every), every);
        // A `--drain-ms` above IDLE_DRAIN is never shortened.
        let slow = Duration::from_secs(5);
        assert_eq!(next_drain(false, true, slow, slow), slow);
    }
}
