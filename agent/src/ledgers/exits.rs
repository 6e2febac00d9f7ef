//! The exit path: a slot freed when its process dies, beside the reclaim task's periodic step
//! (the directory scan and the sweep of every ledger), never behind it.
//!
//! Every process a sweep finds alive in a slot (its identity checked against /proc as
//! [`super::reclaim`] says) is watched through a pidfd ([`Watch`]): opened on its host pid,
//! then the pid's start time read again, so that a pid reused between the sweep and the open
//! is never watched (the pidfd pins the process the pid named at the open). A pidfd becomes
//! readable once its process has exited (a zombie or reaped), which is what a sweep calls
//! dead; the exit path ([`ExitPath`]) then reads the ledgers the sweeps found the process in,
//! on the blocking pool, and frees each slot that still records that process (its worker
//! refuses a slot freed, or freed and reused, meanwhile). A slot whose process forked
//! ([`ledger::layout::SLOT_FORKED`]: a child may hold its memory; the sweeps ask the driver)
//! and any slot the exit path could not free are handed to the reclaim task as an exit, whose
//! sweeps decide as before. The exit path reads the ledgers of one process per exit, counted
//! as `sweep="exit"` in `vramguard_reclaim_sweeps_total` and `..._ledgers_read_total`.
//!
//! A watched process is alive to the sweeps without a read of /proc while it is watched: an
//! idle node's sweeps read no `/proc/<pid>/stat` for the slots of watched processes
//! (`vramguard_reclaim_proc_reads_total` counts the reads they make). At most [`MAX_WATCHED`]
//! processes are watched (a descriptor each; at most a quarter of the agent's `RLIMIT_NOFILE`); past it (said once while it lasts,
//! `vramguard_reclaim_watched`), or when a pidfd cannot be opened, a process is judged by
//! /proc at every sweep, and its exit found by its exit event or the next sweep, as before.
//!
//! The eBPF exit events (a process with GPU memory) come here first. The event of a watched
//! process, or of one whose slot the exit path is freeing or just freed, gives its reclaim's
//! latency its start (the time the kernel gave the event, inside `do_exit`). The event comes
//! while the kernel still tears the process down (its memory, its files: about a millisecond
//! before its pidfd says it exited), so the workers of a watched process's ledgers that do not
//! run start then ([`LedgerHandle::warm_worker`]): its reclaim waits for no worker's start
//! (measured in `cargo xtask bench --agent-only`: the worker's part of a first reclaim in a
//! ledger took 0.64 ms at the median and up to 5.9 ms when the worker started at the reclaim,
//! 0.19 ms and up to 2.3 ms with it running). Every other event goes
//! on to the reclaim task (without waiting: a full queue drops it, and the periodic sweep finds
//! the death). A reclaim whose event did not come within [`EVENT_WAIT`] (a process
//! without GPU memory sends none) is measured from its pidfd's wake-up.
use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use ledger::ProcessIdentity;
use tokio::{
    io::{unix::AsyncFd, Interest},
    sync::{mpsc, watch, Notify},
    task::{AbortHandle, JoinSet},
    time::{interval, MissedTickBehavior},
};
use tracing::{info, warn};

use super::{task::Reclaims, LedgerHandle};

/// Processes watched through a pidfd at most (a descriptor each).
pub const MAX_WATCHED: usize = 4096;

/// How long a reclaim the exit path made waits for its process's exit event (for its latency).
pub const EVENT_WAIT: Duration = Duration::from_millis(100);

/// How long an exit event waits for the exit path to free its process's slot (then it is
/// dropped: the process's slot is gone, or the sweeps have it; short, so that a later process
/// given the same pid is not measured from it), and how many are kept at most.
const EVENT_KEPT: Duration = Duration::from_secs(1);
const EVENTS_KEPT: usize = 65536;

/// A slot of a live process, as a sweep found it.
pub struct Live {
    pub host: u32,
    pub process: ProcessIdentity,
    pub path: PathBuf,
    pub slot: u32,
    pub ledger: Arc<LedgerHandle>,
}

/// The processes watched through pidfds, shared by the reclaim task's sweeps (which say which
/// processes live, and ask whether one is watched) and the exit path.
pub struct Watch {
    runtime: tokio::runtime::Handle,
    /// Told the host pid and identity of a process whose pidfd became readable.
    fired: mpsc::UnboundedSender<(u32, ProcessIdentity)>,
    watched: Mutex<HashMap<u32, Watched>>,
    /// Processes watched at most: [`MAX_WATCHED`], or a quarter of the descriptors the agent
    /// may open if that is less (the ledgers, workers and connections need theirs).
    cap: usize,
    /// Whether the cap was hit (said once while it lasts).
    capped: Mutex<bool>,
    gauge: Option<prometheus::IntGauge>,
}

/// A process's slots: each ledger's path, the slot, the ledger.
type Slots = Vec<(PathBuf, u32, Arc<LedgerHandle>)>;

struct Watched {
    process: ProcessIdentity,
    slots: Slots,
    waiter: Waiter,
}

impl Drop for Watched {
    fn drop(&mut self) {
        if let Waiter::Pidfd(task) = &self.waiter {
            task.abort(); // closes its pidfd
        }
    }
}

impl Watch {
    /// A watch whose pidfds are polled by `runtime`'s reactor; the processes that exit are
    /// sent on the returned receiver (for [`ExitPath`]).
    pub fn new(runtime: tokio::runtime::Handle, gauge: Option<prometheus::IntGauge>) -> (Arc<Watch>, mpsc::UnboundedReceiver<(u32, ProcessIdentity)>) {
        let (fired, fired_rx) = mpsc::unbounded_channel();
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit(2) writes one rlimit into `limit`, which lives across the call.
        let known = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
        let cap = if known { usize::try_from(limit.rlim_cur / 4).unwrap_or(usize::MAX).min(MAX_WATCHED) } else { 0 };
        let watch = Watch { runtime, fired, watched: Mutex::new(HashMap::new()), cap, capped: Mutex::new(false), gauge };
        (Arc::new(watch), fired_rx)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Watched>> {
        self.watched.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether host pid `host` is watched as `process` (alive until its pidfd says otherwise).
    pub fn alive(&self, host: u32, process: &ProcessIdentity) -> bool {
        self.lock().get(&host).is_some_and(|watched| watched.process == *process)
    }

    /// Whether host pid `host` is watched.
    pub fn watches(&self, host: u32) -> bool {
        self.lock().contains_key(&host)
    }

    /// Processes watched.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What a sweep of the ledgers `in_scope` found alive: their slots replace those the
    /// watch held for these ledgers; a process no longer in any slot is no longer watched, a
    /// new one is.
    pub fn update(&self, in_scope: &dyn Fn(&Path) -> bool, live: Vec<Live>) {
        let mut watched = self.lock();
        for entry in watched.values_mut() {
            entry.slots.retain(|(path, _, _)| !in_scope(path));
        }
        let mut capped = false;
        for Live { host, process, path, slot, ledger } in live {
            if let Some(entry) = watched.get_mut(&host).filter(|entry| entry.process == process) {
                entry.slots.push((path, slot, ledger));
                continue;
            }
            // Another process at that pid (the watched one is gone: its pidfd said so or soon will).
            watched.remove(&host);
            if watched.len() >= self.cap {
                capped = true;
                continue;
            }
            let Some(waiter) = self.open(host, process) else { continue };
            let exited = matches!(waiter, Waiter::Exited);
            watched.insert(host, Watched { process, slots: vec![(path, slot, ledger)], waiter });
            if exited {
                let _ = self.fired.send((host, process));
            }
        }
        watched.retain(|_, entry| !entry.slots.is_empty());
        if let Some(gauge) = &self.gauge {
            gauge.set(watched.len() as i64);
        }
        drop(watched);
        let mut said = self.capped.lock().unwrap_or_else(PoisonError::into_inner);
        if capped && !*said {
            warn!(cap = self.cap, "too many live processes in ledgers to watch each through a pidfd: the others are judged by /proc at every sweep (said once while it lasts)");
        }
        *said = capped;
    }

    /// The identity of watched process `host` and its slots in ledgers whose workers are not
    /// running (`None` if it is not watched).
    fn cold_slots(&self, host: u32) -> Option<(ProcessIdentity, Slots)> {
        let watched = self.lock();
        let entry = watched.get(&host)?;
        let cold = entry.slots.iter().filter(|(_, _, ledger)| ledger.worker_cold()).map(|(path, slot, ledger)| (path.clone(), *slot, Arc::clone(ledger))).collect();
        Some((entry.process, cold))
    }

    /// Takes process `host` off the watch (its pidfd fired), with the slots it had, if it is
    /// still watched as `process`.
    fn take(&self, host: u32, process: ProcessIdentity) -> Option<Slots> {
        let mut watched = self.lock();
        if watched.get(&host).is_none_or(|entry| entry.process != process) {
            return None;
        }
        let mut entry = watched.remove(&host)?;
        if let Some(gauge) = &self.gauge {
            gauge.set(watched.len() as i64);
        }
        Some(std::mem::take(&mut entry.slots))
    }

    /// Opens a pidfd on `host` and waits on it; `None` if it cannot be opened or registered,
    /// or if /proc cannot say whether `host` still runs `process` once it is open.
    fn open(&self, host: u32, process: ProcessIdentity) -> Option<Waiter> {
        // Gone already (ESRCH: the next sweep finds it dead), or out of descriptors: the sweeps
        // judge it by /proc.
        let fd = crate::pidfd::open(host).ok()?;
        match ledger::process::still_runs(host, process.start_time) {
            Some(true) => {}
            // Died between the sweep and now (or the pid was reused): freed at once.
            Some(false) => return Some(Waiter::Exited),
            None => return None,
        }
        let _runtime = self.runtime.enter();
        // SAFETY: the AsyncFd owns the OwnedFd, which stays open and unchanged until it is dropped.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.ok()?;
        let fired = self.fired.clone();
        let waiter = self.runtime.spawn(async move {
            // Readable once the process has exited; an error only when the runtime shuts down.
            if fd.readable().await.is_ok() {
                let _ = fired.send((host, process));
            }
        });
        Some(Waiter::Pidfd(waiter.abort_handle()))
    }
}

/// What tells the exit path that a watched process exited.
enum Waiter {
    /// A task waiting on its pidfd (aborted, and the pidfd closed, when it is no longer watched).
    Pidfd(AbortHandle),
    /// Nothing: it had exited when it was to be watched, and the exit path was told.
    Exited,
}

/// How the exit path is wired.
pub struct ExitPath {
    pub watch: Arc<Watch>,
    pub fired: mpsc::UnboundedReceiver<(u32, ProcessIdentity)>,
    /// Exit events from the kernel task (tgid, the kernel's time of the exit).
    pub events: mpsc::Receiver<(u32, Instant)>,
    /// Exits for the reclaim task's sweeps.
    pub forward: mpsc::Sender<(u32, Instant)>,
    pub reclaims: Reclaims,
    /// Rung when slots were reclaimed (a pass is worth running).
    pub changed: Arc<Notify>,
}

/// A slot freed by the exit path.
struct Freed {
    path: PathBuf,
    slot: u32,
    pid: u32,
    chunks: u64,
    at: Instant,
}

/// What the exit path did for one exited process.
struct Done {
    host: u32,
    /// When its pidfd fired.
    woke: Instant,
    freed: Vec<Freed>,
    /// Slots left to the sweeps.
    left: bool,
    /// Ledgers read.
    read: u64,
}

impl ExitPath {
    /// Runs until `stop` turns true or the kernel task's exits end.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
        // Exit events of processes watched or being freed, by tgid.
        let mut events: HashMap<u32, Instant> = HashMap::new();
        let mut freeing: HashSet<u32> = HashSet::new();
        // Reclaims made, waiting for their exit event.
        let mut unmatched: HashMap<u32, Done> = HashMap::new();
        let mut running: JoinSet<Done> = JoinSet::new();
        let mut warming: JoinSet<()> = JoinSet::new();
        let mut dropped = 0u64;
        let mut tick = interval(EVENT_WAIT / 4);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.changed() => break,
                event = self.events.recv() => {
                    let Some((tgid, at)) = event else { break };
                    if let Some(done) = unmatched.remove(&tgid) {
                        self.report(done, Some(at));
                        continue;
                    }
                    // Kept also for an exit handed on: its process may be watched by the
                    // sweep that looks for it, and then freed here.
                    if events.len() < EVENTS_KEPT {
                        events.insert(tgid, at);
                    }
                    if freeing.contains(&tgid) {
                        continue;
                    }
                    match self.watch.cold_slots(tgid) {
                        None => self.hand_on(tgid, at, &mut dropped),
                        // The kernel tears the process down before its pidfd says so: its
                        // ledgers' workers start meanwhile, so its reclaim waits for no hello.
                        Some((process, cold)) if !cold.is_empty() => {
                            warming.spawn_blocking(move || warm(process, cold));
                        }
                        Some(_) => {}
                    }
                }
                Some((host, process)) = self.fired.recv() => {
                    let woke = Instant::now();
                    if let Some(slots) = self.watch.take(host, process) {
                        freeing.insert(host);
                        running.spawn_blocking(move || free(host, process, woke, slots));
                    }
                }
                Some(warmed) = warming.join_next(), if !warming.is_empty() => {
                    warmed.map_err(|error| anyhow::anyhow!("the exit path failed to start a ledger's worker: {error}"))?;
                }
                Some(done) = running.join_next(), if !running.is_empty() => {
                    // A panic while freeing is a bug: the task ends (and the agent with it).
                    let done = done.map_err(|error| anyhow::anyhow!("the exit path failed: {error}"))?;
                    freeing.remove(&done.host);
                    self.reclaims.read(true, done.read);
                    if !done.freed.is_empty() {
                        self.changed.notify_one();
                    }
                    if done.left {
                        let at = events.get(&done.host).copied().unwrap_or(done.woke);
                        self.hand_on(done.host, at, &mut dropped);
                    }
                    match events.remove(&done.host) {
                        Some(at) => self.report(done, Some(at)),
                        None if !done.freed.is_empty() => { unmatched.insert(done.host, done); }
                        None => {}
                    }
                }
                _ = tick.tick(), if !unmatched.is_empty() || !events.is_empty() => {
                    let late: Vec<u32> = unmatched.iter().filter(|(_, done)| done.woke.elapsed() >= EVENT_WAIT).map(|(host, _)| *host).collect();
                    for host in late {
                        if let Some(done) = unmatched.remove(&host) {
                            self.report(done, None);
                        }
                    }
                    events.retain(|tgid, at| freeing.contains(tgid) || at.elapsed() < EVENT_KEPT);
                }
            }
        }
        Ok(())
    }

    /// Hands the exit of `tgid` (at `at`) on to the reclaim task's sweeps, without waiting: a
    /// full queue drops it (the periodic sweep finds the death), said at powers of two.
    fn hand_on(&self, tgid: u32, at: Instant, dropped: &mut u64) {
        if self.forward.try_send((tgid, at)).is_err() {
            *dropped += 1;
            if dropped.is_power_of_two() {
                warn!(dropped = *dropped, "the reclaim task's exit queue is full: exits dropped (its sweep finds them)");
            }
        }
    }

    /// Logs and counts the reclaims of `done`, measured from its exit event (`event`) or else
    /// from its pidfd's wake-up.
    fn report(&self, done: Done, event: Option<Instant>) {
        let from = event.map_or(done.woke, |at| at.min(done.woke));
        for Freed { path, slot, pid, chunks, at } in done.freed {
            let latency = at.saturating_duration_since(from);
            self.reclaims.observe(latency);
            info!(
                ledger = %path.display(),
                slot,
                pid,
                host_pid = done.host,
                chunks,
                latency_us = latency.as_micros() as u64,
                from_exit_event = event.is_some(),
                by = "exit path",
                "reclaimed the slot of a process that is gone"
            );
        }
    }
}

/// Starts the workers of the ledgers whose `slots` the exit path is to free for `process`:
/// only where the slot still records it and did not fork (an honest process's hook frees its
/// own slot at its exit, and a forked one's is the sweeps'). A failure is said as the
/// reclaim's would be (the reclaim then finds the ledger backed off and leaves its slot to the
/// sweeps); a ledger backed off already was said when that began.
fn warm(process: ProcessIdentity, slots: Slots) {
    for (path, id, ledger) in slots {
        let owed = ledger.slots().is_ok_and(|views| {
            views.iter().any(|view| view.id == id && view.slot.process() == process && view.slot.flags & ledger::layout::SLOT_FORKED == 0)
        });
        if !owed {
            continue;
        }
        match ledger.warm_worker() {
            Ok(()) | Err(super::worker::AccessError::Backoff { .. }) => {}
            Err(error) => warn!(ledger = %path.display(), %error, "cannot reclaim the dead processes' slots of this ledger for now"),
        }
    }
}

/// Frees the slots of the exited process `process` (host pid `host`, whose pidfd fired at
/// `woke`) that still record it; a slot of a process that forked, and any the worker could not
/// free, are left to the sweeps.
fn free(host: u32, process: ProcessIdentity, woke: Instant, slots: Slots) -> Done {
    let mut done = Done { host, woke, freed: Vec::new(), left: false, read: 0 };
    // The pidfd said so; /proc is asked once more, as a sweep would (a zombie is dead).
    if ledger::process::still_runs(host, process.start_time) != Some(false) {
        done.left = true;
        return done;
    }
    for (path, id, ledger) in slots {
        done.read += 1;
        let view = match ledger.slots() {
            Ok(views) => views.into_iter().find(|view| view.id == id && view.slot.process() == process),
            Err(_) => {
                done.left = true; // the sweeps say why, once
                continue;
            }
        };
        let Some(view) = view else { continue }; // freed (or reused) meanwhile, by its hook or a sweep
        if view.slot.flags & ledger::layout::SLOT_FORKED != 0 {
            done.left = true; // a child may hold its memory: the sweeps ask the driver
            continue;
        }
        // As a sweep frees it (the worker's failures said as a sweep says them); one not freed
        // (the worker failed, or its hook freed it meanwhile) is left to the sweeps.
        let freed = super::reclaim::free(&path, &ledger, vec![(view, woke)]);
        done.left |= freed.is_empty();
        done.freed.extend(freed.into_iter().map(|freed| Freed { path: path.clone(), slot: freed.view.id, pid: freed.view.slot.pid, chunks: freed.chunks, at: freed.at }));
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use ledger::{layout::CREATOR_AGENT, DeviceConfig, Geometry, Ledger};

    /// A watched ledger (one slot of `process`) and its handle.
    fn ledger_with(tag: &str, process: ProcessIdentity) -> (PathBuf, Arc<LedgerHandle>, u32) {
        let dir = std::env::temp_dir().join(format!("vramguard-exits-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("a")).expect("mkdir");
        let geometry = Geometry { slots: 4, records: 64, devices: vec![DeviceConfig { limit: 64 << 20, chunk: 2 << 20, ..Default::default() }] };
        let ledger = Ledger::create(&dir.join("a/ledger"), &geometry, CREATOR_AGENT).expect("create");
        let slot = ledger.register(process).expect("register");
        let mut ledgers = super::super::Ledgers::new(dir.clone());
        ledgers.scan();
        let (_, handle) = ledgers.shared().next().expect("watched");
        (dir, Arc::clone(handle), slot)
    }

    /// A `sleep 30` child with a slot in a watched ledger (`tag` names its directory).
    fn sleeper_in_ledger(tag: &str) -> (std::process::Child, u32, ProcessIdentity, PathBuf, Arc<LedgerHandle>, u32) {
        let child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let pid = child.id();
        let process = crate::identity::identity_of(pid).expect("the child's identity");
        let (dir, handle, slot) = ledger_with(tag, process);
        (child, pid, process, dir, handle, slot)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watched_process_is_told_when_it_exits_and_a_reused_pid_at_once() {
        let (mut child, pid, process, dir, handle, slot) = sleeper_in_ledger("pidfd");
        let (watch, mut fired) = Watch::new(tokio::runtime::Handle::current(), None);
        let path = dir.join("a/ledger");
        let live = |process| Live { host: pid, process, path: path.clone(), slot, ledger: Arc::clone(&handle) };
        watch.update(&|_| true, vec![live(process)]);
        assert!(watch.alive(pid, &process), "watched while it runs");
        assert_eq!(watch.len(), 1);
        // Told nothing while it runs.
        assert!(tokio::time::timeout(Duration::from_millis(300), fired.recv()).await.is_err());

        // Killed and left unreaped (a zombie): told at once.
        child.kill().expect("kill");
        let told = tokio::time::timeout(Duration::from_secs(5), fired.recv()).await.expect("told within 5 s");
        assert_eq!(told, Some((pid, process)));
        let slots = watch.take(pid, process).expect("still watched until taken");
        assert_eq!(slots.len(), 1);
        assert!(!watch.alive(pid, &process) && watch.is_empty());

        // A slot whose identity the pid no longer runs (another start time: the pid reused)
        // is told at once, never watched as alive.
        let other = ProcessIdentity { start_time: process.start_time + 1, ..process };
        watch.update(&|_| true, vec![live(other)]);
        let told = tokio::time::timeout(Duration::from_secs(5), fired.recv()).await.expect("told at once");
        assert_eq!(told, Some((pid, other)));
        // A sweep that no longer finds the slot lets it go.
        watch.update(&|_| true, Vec::new());
        assert!(watch.is_empty());
        child.wait().expect("reap");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    /// An exit path running on `watch` (and `fired`, its receiver): its exit events' sender,
    /// what it hands the sweeps, its stop and its task.
    struct Running {
        events: mpsc::Sender<(u32, Instant)>,
        forwarded: mpsc::Receiver<(u32, Instant)>,
        stop: watch::Sender<bool>,
        task: tokio::task::JoinHandle<anyhow::Result<()>>,
    }

    /// A `sleep 30` child with a slot in a ledger (`tag` names its directory), watched, and an
    /// exit path running on its watch: the child, its pid, the directory, the ledger's handle,
    /// the slot, the exit path.
    fn watched_exit_path(tag: &str) -> (std::process::Child, u32, PathBuf, Arc<LedgerHandle>, u32, Running) {
        let (child, pid, process, dir, handle, slot) = sleeper_in_ledger(tag);
        let (watch, fired) = Watch::new(tokio::runtime::Handle::current(), None);
        watch.update(&|_| true, vec![Live { host: pid, process, path: dir.join("a/ledger"), slot, ledger: Arc::clone(&handle) }]);
        let running = exit_path_on(&watch, fired);
        (child, pid, dir, handle, slot, running)
    }

    fn exit_path_on(watch: &Arc<Watch>, fired: mpsc::UnboundedReceiver<(u32, ProcessIdentity)>) -> Running {
        use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts};
        let (events_tx, events) = mpsc::channel(8);
        let (forward, forwarded) = mpsc::channel(8);
        let counter = |name: &str| IntCounterVec::new(Opts::new(name, "test"), &["sweep"]).expect("counter");
        let reclaims = Reclaims::new(
            IntCounter::new("reclaims", "test").expect("counter"),
            Histogram::with_opts(HistogramOpts::new("latency", "test")).expect("histogram"),
            counter("sweeps"),
            counter("read"),
            IntCounter::new("proc_reads", "test").expect("counter"),
            IntGauge::new("watched", "test").expect("gauge"),
            IntCounterVec::new(Opts::new("listings", "test"), &["why"]).expect("counter"),
        );
        let exit_path = ExitPath { watch: Arc::clone(watch), fired, events, forward, reclaims, changed: Arc::new(Notify::new()) };
        let (stop, stopped) = watch::channel(false);
        Running { events: events_tx, forwarded, stop, task: tokio::spawn(exit_path.run(stopped)) }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_exit_event_starts_the_ledgers_worker_before_the_pidfd_fires() {
        let (mut child, pid, dir, handle, _, running) = watched_exit_path("warm");
        let Running { events: events_tx, mut forwarded, stop: stop_tx, task: running } = running;
        assert!(!handle.worker_running(), "no worker before the exit");

        // The exit event comes while the process is still torn down (here: still runs): its
        // ledger's worker starts; its slot stays.
        events_tx.send((pid, Instant::now())).await.expect("sent");
        let started = Instant::now();
        while !handle.worker_running() {
            assert!(started.elapsed() < Duration::from_secs(5), "the worker did not start on the exit event");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(handle.slots().expect("slots").len(), 1, "the slot of a process that runs stays");
        assert!(forwarded.try_recv().is_err(), "a watched process's event is not handed to the sweeps");

        // Its pidfd fires: the slot is freed by the running worker.
        child.kill().expect("kill");
        let started = Instant::now();
        while !handle.slots().expect("slots").is_empty() {
            assert!(started.elapsed() < Duration::from_secs(5), "the slot was not freed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop_tx.send(true).expect("stop");
        running.await.expect("joined").expect("the exit path ran");
        child.wait().expect("reap");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_exit_event_of_a_process_whose_slot_is_freed_starts_no_worker() {
        let (mut child, pid, dir, handle, slot, running) = watched_exit_path("freed");
        let path = dir.join("a/ledger");
        // Its hook freed its slot at its exit, before the kernel's exit event.
        ledger::Ledger::open(&path).expect("open").reclaim(slot).expect("freed");
        running.events.send((pid, Instant::now())).await.expect("sent");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!handle.worker_running(), "a worker started for a slot nobody owes");
        running.stop.send(true).expect("stop");
        running.task.await.expect("joined").expect("the exit path ran");
        child.kill().expect("kill");
        child.wait().expect("reap");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
