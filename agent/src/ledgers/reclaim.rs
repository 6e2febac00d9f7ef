//! Reclaim of ledger slots whose process is gone, and the host pids of live ones.
//!
//! A sweep reads every slot of every watched ledger and judges its process: a slot whose
//! recorded host pid still runs the slot's process is alive (its pid namespace, pid in it and
//! start time checked the first time, since the workload can write the field; its start time
//! after that); a slot whose host pid an earlier sweep verified and that no longer runs that
//! process (no such pid, a zombie, another start time: [`ledger::process::still_runs`]) is
//! dead without more ado, which is how most exits are found; the others (pids not recorded or
//! not verified yet, /proc unable to say) are looked up in one scan of /proc
//! ([`ProcessTable`], made only when a sweep has such a slot, after every ledger was read, so
//! that a process that registered a slot before its ledger was read is in it if it lives). A live process gets its
//! host pid written into its slot ([`Ledger::set_host_pid`]); a slot the table does not find
//! is dead and is freed with [`Ledger::reclaim_process`], which refuses if the slot was freed
//! and reused meanwhile. A zombie counts as dead. However many ledgers and dead slots
//! workloads make, a sweep scans /proc at most once.
//!
//! Sweeps run every second and at once on the eBPF exit event of a process with GPU memory.
//! That event fires inside `do_exit`, before the process becomes a zombie, so its tgid stays
//! pending (and the caller sweeps every millisecond) until its slot is found dead, no
//! live slot is its, or [`PENDING_MAX`] passes. An exit's sweep reads only the ledgers in
//! which the last sweep found the process alive ([`Reclaimer::exit_scope`]): one exit costs
//! one ledger's slots, however many ledgers other tenants have (a hostile one among them);
//! only the exit of a process no sweep has seen yet (it took its slot since) reads them all. Its slot is the one with that host pid, or
//! (for a process that died before a sweep saw it alive) the one with the identity read from
//! /proc when the event arrived (a zombie's /proc entry still tells it). The latency of a
//! reclaim is measured from the exit event's arrival when there was one, else from the
//! sweep that detected the death.
//!
//! # Quiet ledgers
//!
//! A ledger whose last read found a live, pidfd-watched process in every slot (and nothing
//! dead, kept or unresolved, from a copy that caught no mutation) is *quiet*: the exit path
//! frees its slots when their processes die, so a periodic sweep has nothing to do there
//! unless the ledger changed. The periodic sweep ([`Reclaimer::periodic_scope`]) reads
//! instead its [`Stamp`] (read by the scan before it, with the header, in the same `pread`: the mutation counter that every locked operation moves,
//! reads under the lock included, the dirty flag and the slots' high-water mark) and leaves the
//! ledger unread while the stamp is the one its last copy saw and each of its processes is
//! still watched; anything else (a slot registered, freed or charged through the lock, a
//! watched process gone, the file replaced or cut) makes it read as before. An idle node's
//! periodic step is then one `pread` per ledger (`vramguard_reclaim_ledgers_read_total
//! {sweep="all"}` counts the ledgers read).
//!
//! The stamp is what an honest hook moves, not a proof: the file is the workload's, and a
//! workload can write a slot around the lock and leave the counter as it was (or write it
//! back). What that can hide is bounded twice. Every [`READ_ALL`], a periodic sweep reads every
//! ledger whatever its stamp, so a slot written that way is judged (its dead process's slot
//! freed, a live one watched) within [`READ_ALL`], checked in
//! `tests/e2e/tests/exit_path.rs`. And the exit of a process with GPU memory never relies on
//! it: its exit event makes a sweep of the ledgers it was found in, or of all of them if no
//! sweep saw it. So a workload that holds its counter still delays, by at most [`READ_ALL`],
//! only the reclaim of its own container's slots of processes that no sweep saw and that had
//! no GPU memory; nothing it writes frees another process's slot (a slot is freed only by a
//! sweep that judged its process dead, through the worker, which refuses a slot that no longer
//! records that process), and the reconcile pass reads its own copies every pass.
//!
//! # The driver's word on what is still held
//!
//! The driver keeps a process's memory until the last holder of its device files closes them,
//! not until the process exits: a child it forked keeps it (docs/gpu.md). A dead process's
//! slot is therefore freed only once the driver no longer holds its memory, by the driver
//! view's latest read ([`crate::driver`], NVML; [`Reclaimer::set_driver`]): while a read that
//! started after the death was detected still lists the process's host pid with memory (NVML
//! keeps listing the pid of the process that made the memory's client), the slot is *kept*:
//! its container stays charged (the hook refuses past the quota, the metrics and `vramguard
//! audit` show it), and it is looked at again at every sweep and every new driver read. A
//! slot whose process forked ([`ledger::layout::SLOT_FORKED`]) also waits for the first read
//! started after its death was detected (the driver's word, not an old read's); other slots
//! are freed at once when no fresh read says otherwise, so an exit's reclaim does not wait for
//! NVML. Without a driver view that answers (`absent`, `failing`, `hung`), slots are freed as
//! before. A kept slot's reclaim latency is measured from the sweep that found its memory
//! released.
use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use ledger::{copy::Stamp, ProcessIdentity, SlotView};
use tracing::{info, warn};

use crate::{
    driver::{DriverView, State as DriverState},
    identity::{self, ProcessTable},
    ledgers::{
        exits::{Live, Watch},
        AccessError, LedgerHandle, Ledgers,
    },
};

/// Time a sweep spends freeing one ledger's dead slots (beyond one worker call).
pub const LEDGER_BUDGET: Duration = Duration::from_millis(100);

/// How long an exit event waits for its process's slot to be judged dead.
pub const PENDING_MAX: Duration = Duration::from_secs(10);

/// A periodic sweep reads every ledger, quiet or not, at least this often (see the module
/// doc's "Quiet ledgers").
pub const READ_ALL: Duration = Duration::from_secs(10);

pub struct Reclaimer {
    /// False when this agent cannot see every process (not in the host's pid namespace):
    /// then slots are never freed, only reported.
    enabled: bool,
    /// Exit events not resolved yet: tgid -> (arrival, the process's identity if /proc still
    /// had it).
    pending: HashMap<u32, (Instant, Option<ProcessIdentity>)>,
    /// (host pid, slot identity) pairs checked in full by an earlier sweep and seen by the
    /// last one: their start time suffices from then on.
    verified: HashSet<(u32, ProcessIdentity)>,
    /// Ledgers whose slots the last sweep could not read (each said once while it lasts).
    unreadable: HashSet<PathBuf>,
    /// Reclaims performed.
    pub total: u64,
    /// The driver's latest view, for the next sweep.
    driver: Option<Arc<DriverView>>,
    /// Dead processes whose slots are kept while the driver holds their memory: when their
    /// death was first detected, their host pid (0 if never known), and their ledger.
    kept: HashMap<ProcessIdentity, (Instant, u32, PathBuf)>,
    /// Host pid -> the ledgers in which the last sweep that read them found that process
    /// alive: where its exit's sweep looks.
    located: HashMap<u32, Vec<PathBuf>>,
    /// Ledgers read by sweeps (each time one is read): what exits cost, counted.
    pub ledgers_read: u64,
    /// The agent's pid namespace (inode): a slot of a process in it has its pid as host pid.
    pidns: u64,
    /// The processes watched through pidfds ([`super::exits`]): alive without a read of /proc
    /// while watched; told what each sweep found alive.
    watch: Option<Arc<Watch>>,
    /// Reads of `/proc/<pid>` made to judge a slot (a scan of /proc not counted): what the
    /// sweeps cost beyond the ledgers, counted.
    pub proc_reads: u64,
    /// The ledgers the last sweep that read them left with nothing to do (see the module
    /// doc's "Quiet ledgers"), by path.
    quiet: HashMap<PathBuf, Quiet>,
    /// When a sweep last read every ledger.
    read_all_at: Instant,
}

/// A ledger whose last read found only processes watched through pidfds: its handle, its
/// stamp then, and those processes (host pid, identity).
struct Quiet {
    ledger: Arc<LedgerHandle>,
    stamp: Stamp,
    processes: Vec<Watched>,
}

/// A live slot's process: its host pid and identity.
type Watched = (u32, ProcessIdentity);

impl Reclaimer {
    /// A reclaimer; `watching`: whether ledgers are watched at all (else it stays silent).
    pub fn new(watching: bool) -> Reclaimer {
        let enabled = identity::in_initial_pid_namespace();
        if watching && !enabled {
            warn!(
                "this agent does not run in the host's pid namespace (hostPID): it cannot tell a \
                 dead process from an invisible one, so it reclaims no ledger slot"
            );
        }
        Reclaimer { enabled, pending: HashMap::new(), verified: HashSet::new(), unreadable: HashSet::new(), total: 0, driver: None, kept: HashMap::new(), located: HashMap::new(), ledgers_read: 0, pidns: ProcessIdentity::current().map_or(0, |me| me.pidns), watch: None, proc_reads: 0, quiet: HashMap::new(), read_all_at: Instant::now() }
    }

    /// Watches the live processes the sweeps find through `watch` ([`super::exits`]), whose
    /// exit path frees their slots when they die; a watched process is alive to the sweeps
    /// without a read of /proc. Not when slots are never freed (not in the host's pid
    /// namespace).
    pub fn set_watch(&mut self, watch: Arc<Watch>) {
        if self.enabled {
            self.watch = Some(watch);
        }
    }

    /// The driver view the next sweeps ask about dead processes' memory (`None`: none).
    pub fn set_driver(&mut self, view: Option<Arc<DriverView>>) {
        self.driver = view;
    }

    /// Slots of dead processes kept because the driver still holds their memory.
    pub fn kept(&self) -> usize {
        self.kept.len()
    }

    /// Whether the driver may still hold the memory of the dead process of `slot` (host pid
    /// `host`, 0 if unknown), whose death was first detected at `since` (see the module doc).
    fn driver_holds(&self, slot: &ledger::layout::Slot, host: u32, since: Instant) -> bool {
        let Some(view) = self.driver.as_deref().filter(|view| view.status.state == DriverState::Ok) else { return false };
        let fresh = view.read_at.is_some_and(|read| read >= since);
        if !fresh {
            return slot.flags & ledger::layout::SLOT_FORKED != 0;
        }
        host != 0
            && (view.processes.get(&host).is_some_and(|p| p.bytes > 0)
                || view.status.unjoined.iter().any(|row| row.pid == host && row.bytes > 0))
    }

    /// Notes the exit event of process `tgid`, which arrived at `at`.
    pub fn exited(&mut self, tgid: u32, at: Instant) {
        self.pending.entry(tgid).or_insert_with(|| (at, identity::identity_of(tgid)));
    }

    /// Whether exit events wait for their slots (the caller then sweeps again soon).
    pub fn pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The ledgers the pending exits' sweep must read: those in which the last sweep found
    /// each exiting process alive. `None` (read them all) if an exiting process was not seen
    /// in any: it may have taken its slot since.
    pub fn exit_scope(&self) -> Option<HashSet<PathBuf>> {
        if !self.pending_located() {
            return None;
        }
        let scope = self.pending.keys().filter_map(|tgid| self.located.get(tgid)).flatten().cloned().collect();
        Some(scope)
    }

    /// Whether every pending exit's process was found alive in a ledger by the last sweep
    /// that read it (so its sweep is [`Reclaimer::exit_scope`]'s, cheap enough to repeat
    /// every millisecond while the process exits).
    pub fn pending_located(&self) -> bool {
        self.pending.keys().all(|tgid| self.located.contains_key(tgid))
    }

    /// The ledgers a periodic sweep must read (`None`: all of them): every ledger but the
    /// quiet ones whose stamp has not moved and whose processes are all still watched, the
    /// pending exits' ledgers, and all of them every [`READ_ALL`] (see the module doc's "Quiet
    /// ledgers").
    pub fn periodic_scope(&mut self, ledgers: &Ledgers) -> Option<HashSet<PathBuf>> {
        let watch = self.watch.as_ref()?;
        if self.read_all_at.elapsed() >= READ_ALL || !self.pending_located() {
            return None;
        }
        let mut scope = self.exit_scope().unwrap_or_default();
        // Those of the ledgers watched now (a ledger let go, or replaced, is no longer quiet).
        let mut quiet = HashMap::with_capacity(self.quiet.len());
        for (path, ledger) in ledgers.shared() {
            let entry = self.quiet.remove(path).filter(|entry| Arc::ptr_eq(ledger, &entry.ledger));
            let unchanged = entry.as_ref().is_some_and(|entry| {
                !scope.contains(path)
                    && entry.processes.iter().all(|(host, process)| watch.alive(*host, process))
                    && ledger.scanned_stamp().is_ok_and(|stamp| stamp == entry.stamp)
            });
            if !unchanged {
                scope.insert(path.to_path_buf());
            }
            if let Some(entry) = entry {
                quiet.insert(path.to_path_buf(), entry);
            }
        }
        self.quiet = quiet;
        Some(scope)
    }

    /// Records host pids of live slots and frees the slots of dead processes; returns the
    /// latency of each reclaim.
    ///
    /// Two phases: the slots of every ledger are read and judged first; then each ledger's
    /// dead slots are freed by its worker, every ledger on a thread of its own, so a ledger
    /// whose worker is slow (a workload holding its lock or damaging it) costs the sweep at
    /// most one worker deadline in all and never delays the other ledgers' reclaims. A ledger
    /// backed off (its worker would refuse at once) gets no thread: its slots wait.
    pub fn sweep(&mut self, ledgers: &Ledgers) -> Vec<Duration> {
        self.sweep_with(ledgers, None, &mut Vec::new)
    }

    /// [`Reclaimer::sweep`] of the ledgers in `scope` (`None`: all; an exit's sweep:
    /// [`Reclaimer::exit_scope`]), taking the exit events that arrived while it ran from `late`
    /// before it says which reclaims an exit event drove (a process can die, and be found
    /// dead, while its event is on its way). What it learns of the other ledgers' processes
    /// (kept slots, verified and located pids) stays as the last sweep that read them left it.
    pub fn sweep_with(&mut self, ledgers: &Ledgers, scope: Option<&HashSet<PathBuf>>, late: &mut dyn FnMut() -> Vec<(u32, Instant)>) -> Vec<Duration> {
        let in_scope = |path: &Path| scope.is_none_or(|scope| scope.contains(path));
        let mut waiting: HashSet<u32> = HashSet::new();
        let mut verified: HashSet<(u32, ProcessIdentity)> = HashSet::new();
        // First every ledger's slots are read; a slot whose recorded host pid still runs its
        // process is alive without more ado (checked in full the first time, by start time
        // after that). The others are judged by one scan of /proc made after every read: a
        // process that registered a slot before its ledger was read is in it if it lives.
        // Each ledger read: its slots judged, and its stamp if the copy was settled.
        let mut read: Vec<Read<'_>> = Vec::new();
        let mut unreadable = HashSet::new();
        let mut unresolved = false;
        let mut located: HashMap<u32, Vec<PathBuf>> = HashMap::new();
        let mut live: Vec<Live> = Vec::new();
        for (path, ledger) in ledgers.shared().filter(|(path, _)| in_scope(path)) {
            self.ledgers_read += 1;
            let (slots, stamp) = match ledger.copy() {
                // A copy that caught a mutation in progress gives no stamp to rely on.
                Ok(copy) => (copy.live_slots(), copy.settled.then_some(copy.stamp)),
                Err(error) => {
                    // Said once, when it starts (a workload can keep its ledger unreadable).
                    if !self.unreadable.contains(path) {
                        warn!(ledger = %path.display(), %error, "cannot read the ledger's slots (said once while it lasts)");
                    }
                    unreadable.insert(path.to_path_buf());
                    continue;
                }
            };
            let judged: Vec<Judged> = slots
                .into_iter()
                .map(|view| {
                    let slot = view.slot;
                    let process = slot.process();
                    let verdict = if slot.host_pid == 0 {
                        Verdict::Unknown
                    } else if self.watch.as_ref().is_some_and(|watch| watch.alive(slot.host_pid, &process)) {
                        Verdict::Alive(slot.host_pid)
                    } else if self.verified.contains(&(slot.host_pid, process)) {
                        self.proc_reads += 1;
                        match ledger::process::still_runs(slot.host_pid, slot.start_time) {
                            Some(true) => Verdict::Alive(slot.host_pid),
                            Some(false) => Verdict::Dead,
                            None => Verdict::Unknown,
                        }
                    } else {
                        self.proc_reads += 1;
                        if identity::is_process(slot.host_pid, &process) {
                            Verdict::Alive(slot.host_pid)
                        } else {
                            Verdict::Unknown
                        }
                    };
                    if let Verdict::Alive(host) = verdict {
                        verified.insert((host, process));
                    }
                    unresolved |= verdict == Verdict::Unknown;
                    (view, verdict)
                })
                .collect();
            read.push((path, ledger, judged, stamp));
        }
        let table = unresolved.then(ProcessTable::scan);
        // Per ledger: its dead slots, each with when its death was detected.
        let mut dead: Vec<(&Path, &Arc<LedgerHandle>, Vec<Gone>)> = Vec::new();
        let detected = Instant::now();
        let mut kept: HashMap<ProcessIdentity, (Instant, u32, PathBuf)> = HashMap::new();
        // The ledgers read whose every slot's process lives (quiet if each is watched, below).
        let mut lively: Vec<(&Path, &Arc<LedgerHandle>, Stamp, Vec<Watched>)> = Vec::new();
        for (path, ledger, judged, stamp) in read {
            let mut gone = Vec::new();
            let mut processes: Vec<Watched> = Vec::new();
            let mut all_alive = true;
            for (view, verdict) in judged {
                let slot = view.slot;
                let alive = match verdict {
                    Verdict::Alive(host) => Some(host),
                    Verdict::Dead => None,
                    Verdict::Unknown => table.as_ref().and_then(|table| table.find(&slot)),
                };
                all_alive &= alive.is_some();
                if let Some(host) = alive {
                    processes.push((host, slot.process()));
                    located.entry(host).or_default().push(path.to_path_buf());
                    live.push(Live { host, process: slot.process(), path: path.to_path_buf(), slot: view.id, ledger: Arc::clone(ledger) });
                    if slot.host_pid != host {
                        if let Err(error) = ledger.set_host_pid(view.id, host) {
                            warn!(ledger = %path.display(), slot = view.id, %error, "cannot record a slot's host pid");
                        }
                    }
                    if self.pending.contains_key(&host) {
                        waiting.insert(host); // exiting, not a zombie yet
                    }
                } else if self.enabled {
                    let process = slot.process();
                    let (since, known) = self.kept.get(&process).map_or((detected, 0), |(since, host, _)| (*since, *host));
                    let own = if slot.pidns == self.pidns && self.pidns != 0 { slot.pid } else { 0 };
                    let host = [slot.host_pid, known, own]
                        .into_iter()
                        .find(|&pid| pid != 0)
                        .or_else(|| self.pending.iter().find(|(_, (_, seen))| *seen == Some(process)).map(|(tgid, _)| *tgid))
                        .unwrap_or(0);
                    if self.driver_holds(&slot, host, since) {
                        if !self.kept.contains_key(&process) {
                            info!(ledger = %path.display(), slot = view.id, pid = slot.pid, host_pid = host, "a dead process's slot is kept: the driver still holds its memory (a child it forked holds its device files)");
                        }
                        // Recorded, so that the reconcile pass reports the slot (`stale`) with
                        // the memory it still charges.
                        if slot.host_pid == 0 && host != 0 {
                            if let Err(error) = ledger.set_host_pid(view.id, host) {
                                warn!(ledger = %path.display(), slot = view.id, %error, "cannot record a kept slot's host pid");
                            }
                        }
                        kept.insert(process, (since, host, path.to_path_buf()));
                        continue;
                    }
                    gone.push((view, detected));
                }
            }
            if !gone.is_empty() {
                dead.push((path, ledger, gone));
            }
            if let Some(stamp) = stamp.filter(|_| all_alive) {
                lively.push((path, ledger, stamp, processes));
            }
        }
        self.quiet.retain(|path, _| !in_scope(path));
        if let Some(watch) = &self.watch {
            watch.update(&in_scope, live);
            for (path, ledger, stamp, processes) in lively {
                if processes.iter().all(|(host, process)| watch.alive(*host, process)) {
                    self.quiet.insert(path.to_path_buf(), Quiet { ledger: Arc::clone(ledger), stamp, processes });
                }
            }
        }
        // What this sweep did not read stays as the sweep that read it last left it.
        let released: HashSet<ProcessIdentity> =
            self.kept.iter().filter(|(p, (_, _, path))| in_scope(path) && !kept.contains_key(p)).map(|(p, _)| *p).collect();
        self.kept.retain(|_, (_, _, path)| !in_scope(path));
        self.kept.extend(kept);
        // A backed-off ledger's slots wait (its worker would refuse at once: said when the
        // backoff began) without a thread started for them.
        dead.retain(|(_, ledger, _)| !ledger.backed_off());
        let freed: Vec<(&Path, Vec<Freed>)> = std::thread::scope(|scope| {
            let running: Vec<_> = dead
                .into_iter()
                .map(|(path, ledger, gone)| (path, scope.spawn(move || free(path, ledger, gone))))
                .collect();
            running.into_iter().filter_map(|(path, thread)| Some((path, thread.join().ok()?))).collect()
        });
        // Exits that arrived while this sweep ran: their slots may have been read alive, so
        // they stay pending for the next sweep (below) whatever this one found.
        let mut arrived = HashSet::new();
        for (tgid, at) in late() {
            self.exited(tgid, at);
            arrived.insert(tgid);
        }
        let mut reclaimed = Vec::new();
        for (path, slots) in freed {
            for Freed { view, detected, chunks, at } in slots {
                let slot = view.slot;
                let process = slot.process();
                // The exit event of the slot's process: by the host pid a sweep recorded, by
                // the identity /proc gave when the event arrived (none once the exiting
                // process has left its namespaces), or, for a process in the agent's own pid
                // namespace, by its pid there.
                let own = slot.pidns == self.pidns && self.pidns != 0;
                let tgid = self
                    .pending
                    .iter()
                    .find(|(tgid, (_, seen))| {
                        (slot.host_pid != 0 && **tgid == slot.host_pid) || *seen == Some(process) || (own && **tgid == slot.pid)
                    })
                    .map(|(tgid, _)| *tgid);
                let event = tgid.and_then(|tgid| self.pending.remove(&tgid)).map(|(at, _)| at);
                // A kept slot: from the sweep that found the driver had let go of it.
                let event = event.filter(|_| !released.contains(&process));
                let latency = at.saturating_duration_since(event.unwrap_or(detected));
                self.total += 1;
                info!(
                    ledger = %path.display(),
                    slot = view.id,
                    pid = slot.pid,
                    host_pid = tgid.unwrap_or(slot.host_pid),
                    chunks,
                    latency_us = latency.as_micros() as u64,
                    from_exit_event = event.is_some(),
                    "reclaimed the slot of a process that is gone"
                );
                reclaimed.push(latency);
            }
        }
        // An exit's scope holds every pending process's ledgers: what it did not find waiting
        // is done with, as after a sweep of all.
        self.pending.retain(|tgid, (at, _)| (waiting.contains(tgid) || arrived.contains(tgid)) && at.elapsed() < PENDING_MAX);
        if scope.is_none() {
            self.read_all_at = Instant::now();
            self.verified = verified;
            self.unreadable = unreadable;
            self.located = located;
        } else {
            self.verified.extend(verified);
            self.unreadable.retain(|path| !in_scope(path));
            self.unreadable.extend(unreadable);
            for paths in self.located.values_mut() {
                paths.retain(|path| !in_scope(path));
            }
            for (host, paths) in located {
                self.located.entry(host).or_default().extend(paths);
            }
            self.located.retain(|_, paths| !paths.is_empty());
        }
        reclaimed
    }
}

/// A slot as read, and what its recorded host pid says of its process.
type Judged = (SlotView, Verdict);

/// A ledger a sweep read: its path and handle, its slots judged, its stamp (if settled).
type Read<'a> = (&'a Path, &'a Arc<LedgerHandle>, Vec<Judged>, Option<Stamp>);

/// What a slot's recorded host pid says of the slot's process, before any scan of /proc.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// The host pid still runs the slot's process.
    Alive(u32),
    /// The host pid, verified by an earlier sweep, no longer runs it: the process is gone.
    Dead,
    /// No host pid, one not verified (the workload writes the field), or /proc could not
    /// say: the scan of /proc decides.
    Unknown,
}

/// A slot whose process was found gone, and when.
pub(super) type Gone = (SlotView, Instant);

/// A slot freed by a sweep (or by the exit path, [`super::exits`]).
pub(super) struct Freed {
    pub(super) view: SlotView,
    /// When its process was found gone.
    detected: Instant,
    pub(super) chunks: u64,
    /// When the slot was freed.
    pub(super) at: Instant,
}

/// Frees the `gone` slots of `ledger` through its worker, each only if it still describes
/// the process judged dead; stops at the first failure of the worker itself, or once
/// [`LEDGER_BUDGET`] is spent (the other slots wait for a later sweep: a bounded time and at
/// most one log line per ledger and sweep, however many dead slots a workload makes).
pub(super) fn free(path: &Path, ledger: &LedgerHandle, gone: Vec<Gone>) -> Vec<Freed> {
    let start = Instant::now();
    let mut freed = Vec::new();
    for (view, detected) in gone {
        if start.elapsed() > LEDGER_BUDGET {
            break;
        }
        match ledger.reclaim_process(view.id, view.slot.process()) {
            Ok(Some(chunks)) => freed.push(Freed { view, detected, chunks, at: Instant::now() }),
            Ok(None) => {} // freed (or freed and reused) meanwhile, by the hook
            // Left alone for a while: said when it started (its lock stayed held, its worker
            // failed), and in `vramguard audit` while it lasts; the slots wait.
            Err(AccessError::Backoff { .. }) => break,
            Err(error @ AccessError::Refused(_)) => {
                warn!(ledger = %path.display(), slot = view.id, %error, "cannot reclaim a dead process's slot")
            }
            Err(error) => {
                warn!(ledger = %path.display(), %error, "cannot reclaim the dead processes' slots of this ledger for now");
                break;
            }
        }
    }
    freed
}
