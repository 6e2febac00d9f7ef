//! The driver task: asks its reader thread (which owns NVML: loading, init, reads) for a read
//! every [`EVERY`] and publishes each answer as the latest [`DriverView`]. A read that has
//! not come back within [`READ_BUDGET`] makes the view `hung`; no other read starts until it
//! returns (a hung NVML call holds one thread, never the runtime or another task). Without
//! NVML, the reader retries loading it every [`RETRY`]. Each read's time (the NVML calls
//! alone, on the reader thread) goes into `vramguard_driver_read_seconds` ([`read_seconds`]).
use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{mpsc as std_mpsc, Arc},
    time::{Duration, Instant},
};

use prometheus::{Histogram, HistogramOpts};
use tokio::{
    sync::{oneshot, watch},
    time::{interval, MissedTickBehavior},
};
use tracing::{info, warn};

use super::{
    holders::{self, FileKey},
    listed::{First, Listed},
    nvml::{Nvml, Trouble},
    gap::Gaps,
    DriverStatus, DriverView, Read, State, UnjoinedProcess, NOT_HOLDING, NOT_VISIBLE, NO_FIGURE, REUSED_SINCE_LISTED,
};
use crate::{pidfd::Living, task::Heartbeat};

/// How often NVML is read.
pub const EVERY: Duration = Duration::from_secs(1);
/// How long a read may take before the view is `hung`.
pub const READ_BUDGET: Duration = Duration::from_secs(2);
/// How often the reader tries again to load and initialize NVML while it has none.
pub const RETRY: Duration = Duration::from_secs(30);

/// One read's answer: the library loaded (if any) and what it said (the processes the agent
/// can join, and those it cannot).
type Answer = (Option<String>, Result<(Read, Vec<UnjoinedProcess>), Trouble>);

/// Buckets of [`read_seconds`]: NVML reads take from tens of microseconds (the fake, a few
/// processes) to milliseconds (a real driver, many devices), up to the budget.
const READ_BUCKETS: [f64; 11] = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 2.0];

/// The histogram of NVML read times the driver task fills (the caller registers it with the
/// metrics registry).
pub fn read_seconds() -> prometheus::Result<Histogram> {
    Histogram::with_opts(
        HistogramOpts::new(
            "vramguard_driver_read_seconds",
            "One NVML read (every device's running processes and their memory), timed on the reader thread; a read that fails counts too",
        )
        .buckets(READ_BUCKETS.to_vec()),
    )
}

/// The default `--gpu-device-file`: a GPU's device file, `{minor}` its NVML minor number.
pub const DEFAULT_DEVICE_FILE: &str = "/dev/nvidia{minor}";

/// The driver task's state.
pub struct Driver {
    /// The NVML files to try, in order ([`super::locate`]).
    pub candidates: Vec<PathBuf>,
    /// Where each read's time goes ([`read_seconds`]).
    pub read_seconds: Histogram,
    /// Each GPU's device file, `{minor}` standing for its minor number (`--gpu-device-file`).
    pub device_file: String,
    /// Where the join's table is kept across restarts ([`super::listed`]; none: in memory
    /// only).
    pub state_dir: Option<PathBuf>,
}

impl Driver {
    /// Runs until `stop` turns true, publishing into `view`.
    pub async fn run(self, view: watch::Sender<Arc<DriverView>>, heartbeat: Heartbeat, mut stop: watch::Receiver<bool>) {
        let (requests, reader_requests) = std_mpsc::channel::<oneshot::Sender<Answer>>();
        let (candidates, read_seconds) = (self.candidates, self.read_seconds);
        let pid_namespace = super::foreign_pid_namespace();
        let foreign = pid_namespace.clone();
        let join = Join { device_file: self.device_file, table: self.state_dir.map(|dir| dir.join(super::listed::FILE)), foreign };
        let spawned = std::thread::Builder::new()
            .name("vramguard-nvml".into())
            .spawn(move || reader(candidates, join, read_seconds, reader_requests));
        if let Err(error) = spawned {
            publish(&view, DriverStatus { state: State::Failing, reason: Some(format!("cannot start the NVML reader thread: {error}")), library: None, reads: 0, ..Default::default() }, None);
            return;
        }
        let mut tick = interval(EVERY);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut pending: Option<(oneshot::Receiver<Answer>, Instant)> = None;
        let mut reads = 0u64;
        loop {
            heartbeat.beat();
            tokio::select! {
                _ = stop.changed() => break,
                _ = tick.tick() => match &pending {
                    None => {
                        let (ask, answer) = oneshot::channel();
                        if requests.send(ask).is_err() {
                            publish(&view, DriverStatus { state: State::Failing, reason: Some("the NVML reader thread ended".into()), library: None, reads, ..Default::default() }, None);
                            return;
                        }
                        pending = Some((answer, Instant::now()));
                    }
                    Some((_, started)) if started.elapsed() > READ_BUDGET && view.borrow().status.state != State::Hung => {
                        let library = view.borrow().status.library.clone();
                        let reason = format!("an NVML read has not returned for {} ms (budget {} ms): no other read starts until it does", started.elapsed().as_millis(), READ_BUDGET.as_millis());
                        publish(&view, DriverStatus { state: State::Hung, reason: Some(reason), library, reads, ..Default::default() }, None);
                    }
                    Some(_) => {}
                },
                answer = async { pending.as_mut().map(|(rx, _)| rx).expect("guarded by the condition").await }, if pending.is_some() => {
                    let started = pending.take().map(|(_, at)| at);
                    let Ok((library, answer)) = answer else {
                        publish(&view, DriverStatus { state: State::Failing, reason: Some("the NVML reader thread ended".into()), library: None, reads, ..Default::default() }, None);
                        return;
                    };
                    match answer {
                        Ok((read, unjoined)) => {
                            reads += 1;
                            let status = DriverStatus { state: State::Ok, reason: None, library, reads, mig: read.mig, pid_namespace: pid_namespace.clone(), unjoined, devices: read.devices, install: None };
                            publish(&view, status, Some((read.processes, started.unwrap_or_else(Instant::now))));
                        }
                        Err(trouble) => publish(&view, DriverStatus { state: trouble.state, reason: Some(trouble.reason), library, reads, ..Default::default() }, None),
                    }
                }
            }
        }
    }
}

/// Publishes a new view, logging once per change of state (or of reason while not `ok`).
/// Where the driver's libraries were found ([`DriverStatus::install`]) stays as the first view
/// said it.
fn publish(view: &watch::Sender<Arc<DriverView>>, mut status: DriverStatus, read: Option<(BTreeMap<u32, super::DriverProcess>, Instant)>) {
    let before = view.borrow().status.clone();
    status.install = before.install.clone();
    if status.state == State::Ok {
        tell_what_is_not_joined(&before, &status);
    }
    if before.state != status.state || (status.state != State::Ok && before.reason != status.reason && status.state != State::Hung) {
        let reason = status.reason.as_deref().unwrap_or("");
        let library = status.library.as_deref().unwrap_or("");
        if status.state == State::Ok {
            info!(library, "driver view: NVML answers; processes are joined with its per-process memory");
        } else {
            warn!(state = status.state.name(), reason, library, "driver view unavailable: the agent runs on the probes and the ledgers alone");
        }
    }
    let (processes, read_at) = match read {
        Some((processes, at)) => (processes, Some(at)),
        None => (Default::default(), None),
    };
    view.send_replace(Arc::new(DriverView { status, processes, read_at }));
}

/// Logs, once per change, the GPUs in MIG mode and whether the agent's pid namespace lets it
/// join the driver's pids.
fn tell_what_is_not_joined(before: &DriverStatus, now: &DriverStatus) {
    if before.mig != now.mig {
        for mig in &now.mig {
            match &mig.unread {
                None => info!(gpu = mig.index, instances = mig.instances, "driver view: a GPU in MIG mode, read per MIG device"),
                Some(reason) => warn!(gpu = mig.index, reason = %reason, "driver view: a GPU in MIG mode whose MIG devices cannot be read"),
            }
        }
    }
    if before.pid_namespace != now.pid_namespace {
        if let Some(reason) = &now.pid_namespace {
            warn!(reason = %reason, "driver view: processes are not joined");
        }
    }
}

/// Splits a read's processes into those the agent can join (with their start times) and
/// those it cannot: all of them when the agent is not in the host's pid namespace
/// (`foreign`), else those without a visible process of that pid now, and those whose pid is
/// not the process's the driver means ([`Listed`], updated: NVML keeps listing the pid of
/// the process that made the memory's client while a child it forked holds the memory, after
/// that process exited; a new process given the pid must not be charged with it). A pid
/// first listed is joined only with a process that holds the GPU's device files (`holds`,
/// asked with the pid and the minor numbers of the GPUs it is listed on); one that holds none
/// is never joined while the pid stays listed, unless it opens them. Rows without a figure
/// are reported too.
fn split(mut read: Read, foreign: Option<&str>, start_time_of: impl Fn(u32) -> Option<u64>, holds: impl Fn(u32, &[u32]) -> bool, listed: &mut Listed) -> (Read, Vec<UnjoinedProcess>) {
    let mut unjoined: Vec<UnjoinedProcess> = read.unfigured.iter().map(|&pid| UnjoinedProcess { pid, bytes: 0, reason: NO_FIGURE.to_string() }).collect();
    if let Some(foreign) = foreign {
        listed.clear();
        unjoined.extend(read.processes.iter().map(|(&pid, process)| UnjoinedProcess { pid, bytes: process.bytes, reason: foreign.to_string() }));
        read.processes.clear();
        return (read, unjoined);
    }
    listed.retain(|pid| read.processes.contains_key(&pid) || read.unfigured.contains(&pid));
    let minors = &read.minors;
    read.processes.retain(|&pid, process| {
        let now = start_time_of(pid).filter(|_| pid != 0);
        let on = minors.get(&pid).map(Vec::as_slice).unwrap_or_default();
        let first = match (listed.get(pid), now) {
            (None, None) => First::Nobody,
            (None, Some(now)) if holds(pid, on) => First::Process(now),
            (None, Some(now)) => First::Unproven(now),
            // Proven since: it opened the GPU's files (a process listed as it made its context).
            (Some(First::Unproven(first)), Some(now)) if first == now && holds(pid, on) => First::Process(now),
            (Some(first), _) => first,
        };
        listed.set(pid, first);
        let reason = match (first, now) {
            (First::Process(first), Some(now)) if first == now => {
                process.start_time = now;
                return true;
            }
            (_, None) => NOT_VISIBLE,
            (First::Unproven(first), Some(now)) if first == now => NOT_HOLDING,
            (_, Some(_)) => REUSED_SINCE_LISTED,
        };
        unjoined.push(UnjoinedProcess { pid, bytes: process.bytes, reason: reason.to_string() });
        false
    });
    unjoined.sort_by_key(|u| u.pid);
    (read, unjoined)
}

/// What the reader needs to join a read's pids: the GPUs' device files, where the table is
/// kept, and whether the agent sees the driver's pids at all.
struct Join {
    device_file: String,
    table: Option<PathBuf>,
    foreign: Option<String>,
}

/// The reader's join state: the table (loaded at the first read that answers), and the
/// device files' keys by minor number (looked up once per minor).
struct Joiner {
    join: Join,
    listed: Listed,
    loaded: bool,
    keys: BTreeMap<u32, Option<FileKey>>,
    /// The last save failed (said once until one succeeds).
    unsaved: bool,
    gaps: Gaps,
    /// The listed processes known to run, by pidfd: their start times without a `/proc` read
    /// of each at every read.
    living: Living,
}

impl Joiner {
    /// Joins `read` ([`split`]), loading the table first if not yet, and saving it after if
    /// it changed; then finds what no row explains of each GPU's memory ([`Gaps`]).
    fn join(&mut self, mut read: Read) -> (Read, Vec<UnjoinedProcess>) {
        let gpus: Vec<String> = read.devices.iter().map(|d| d.uuid.clone()).collect();
        if !self.loaded {
            self.loaded = true;
            if let Some(path) = &self.join.table {
                match Listed::load(path, &gpus) {
                    Ok(Some(table)) => {
                        info!(table = %path.display(), pids = table.len(), "driver view: the join's table of listed pids restored from the state directory");
                        self.listed = table;
                    }
                    Ok(None) => {}
                    Err(reason) => warn!(reason = %reason, "driver view: the join's table in the state directory is not used"),
                }
            }
        }
        for device in &read.devices {
            let pattern = &self.join.device_file;
            self.keys.entry(device.minor).or_insert_with(|| holders::key_of(&holders::device_path(pattern, device.minor)));
        }
        let listed: std::collections::BTreeSet<u32> = read.minors.keys().copied().collect();
        self.gaps.update(&mut read.devices, &self.keys, &listed, std::process::id());
        let keys = &self.keys;
        // Without a GPU's device file to compare (the agent cannot see /dev), the proof is
        // not asked: the start time alone decides, as it did before.
        let holds = |pid: u32, minors: &[u32]| {
            let wanted: Vec<FileKey> = minors.iter().filter_map(|m| keys.get(m).copied().flatten()).collect();
            wanted.is_empty() || holders::holds_any(pid, &wanted)
        };
        let starts = match self.join.foreign {
            Some(_) => Default::default(),
            None => self.living.start_times(&read.processes.keys().copied().collect::<Vec<u32>>(), ledger::process::running_start_time_of),
        };
        let joined = split(read, self.join.foreign.as_deref(), |pid| starts.get(&pid).copied().flatten(), holds, &mut self.listed);
        if self.listed.changed() {
            if let Some(path) = &self.join.table {
                match self.listed.save(path, &gpus) {
                    Ok(()) => self.unsaved = false,
                    Err(reason) if !self.unsaved => {
                        self.unsaved = true;
                        warn!(reason = %reason, "driver view: cannot save the join's table (an agent restart would join by start times alone; said once until a save succeeds)");
                    }
                    Err(_) => {}
                }
            }
        }
        joined
    }
}

/// The reader thread: owns NVML, answers each request with one read (loading NVML first when
/// it has none, at most every [`RETRY`]); ends when the task drops its end.
fn reader(candidates: Vec<PathBuf>, join: Join, read_seconds: Histogram, requests: std_mpsc::Receiver<oneshot::Sender<Answer>>) {
    let mut nvml: Option<Nvml> = None;
    let mut last_trouble: Option<(Trouble, Instant)> = None;
    let mut joiner = Joiner { join, listed: Listed::new(), loaded: false, keys: BTreeMap::new(), unsaved: false, gaps: Gaps::default(), living: Living::default() };
    while let Ok(reply) = requests.recv() {
        if nvml.is_none() {
            match &last_trouble {
                Some((trouble, at)) if at.elapsed() < RETRY => {
                    let _ = reply.send((None, Err(trouble.clone())));
                    continue;
                }
                _ => match Nvml::open(&candidates) {
                    Ok(opened) => nvml = Some(opened),
                    Err(trouble) => {
                        last_trouble = Some((trouble.clone(), Instant::now()));
                        let _ = reply.send((None, Err(trouble)));
                        continue;
                    }
                },
            }
        }
        let Some(loaded) = nvml.as_ref() else { continue };
        let started = Instant::now();
        let answer = loaded.read();
        read_seconds.observe(started.elapsed().as_secs_f64());
        let answer = answer.map(|read| joiner.join(read));
        let _ = reply.send((Some(loaded.path().display().to_string()), answer));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::DriverProcess;

    fn read_of(pids: &[u32]) -> Read {
        Read { processes: pids.iter().map(|&pid| (pid, DriverProcess { bytes: u64::from(pid) << 20, devices: 1, start_time: 0 })).collect(), ..Default::default() }
    }

    #[test]
    fn pids_the_agent_cannot_see_are_reported_not_joined() {
        // 7 runs (started at 700), 8 is not visible, 0 is never a process.
        let start_time_of = |pid: u32| (pid == 7 || pid == 0).then_some(u64::from(pid) * 100);
        let (read, unjoined) = split(read_of(&[0, 7, 8]), None, start_time_of, |_, _| true, &mut Listed::new());
        assert_eq!(read.processes.keys().copied().collect::<Vec<_>>(), [7]);
        assert_eq!(read.processes[&7].start_time, 700);
        assert_eq!(unjoined.iter().map(|u| (u.pid, u.reason.as_str())).collect::<Vec<_>>(), [(0, NOT_VISIBLE), (8, NOT_VISIBLE)]);
        // Outside the host's pid namespace, none is joined, each with the reason.
        let (read, unjoined) = split(read_of(&[7, 8]), Some("not the host's"), start_time_of, |_, _| true, &mut Listed::new());
        assert!(read.processes.is_empty());
        assert_eq!(unjoined.iter().map(|u| (u.pid, u.bytes, u.reason.as_str())).collect::<Vec<_>>(), [(7, 7 << 20, "not the host's"), (8, 8 << 20, "not the host's")]);
    }

    #[test]
    fn a_pid_another_process_took_while_the_driver_lists_it_is_not_joined() {
        let mut listed = Listed::new();
        // 7 runs, started at 700; 9 is not visible when first listed.
        let (read, _) = split(read_of(&[7, 9]), None, |pid| (pid == 7).then_some(700), |_, _| true, &mut listed);
        assert_eq!(read.processes.keys().copied().collect::<Vec<_>>(), [7]);
        // 7 exited (a child it forked keeps the memory, NVML still lists 7) and its pid went to
        // a new process (started at 900); 9 is now visible, another process too: neither joined.
        let reused = |pid: u32| Some(if pid == 7 { 900 } else { 950 });
        let (read, unjoined) = split(read_of(&[7, 9]), None, reused, |_, _| true, &mut listed);
        assert!(read.processes.is_empty(), "{read:?}");
        assert_eq!(unjoined.iter().map(|u| (u.pid, u.bytes, u.reason.as_str())).collect::<Vec<_>>(), [(7, 7 << 20, REUSED_SINCE_LISTED), (9, 9 << 20, REUSED_SINCE_LISTED)]);
        // Once NVML no longer lists 7, it is forgotten: a later listing of 7 is a new one.
        let (_, _) = split(read_of(&[9]), None, reused, |_, _| true, &mut listed);
        let (read, unjoined) = split(read_of(&[7]), None, reused, |_, _| true, &mut listed);
        assert_eq!((read.processes[&7].start_time, unjoined), (900, Vec::new()));
    }

    #[test]
    fn a_pid_first_listed_is_joined_only_with_a_process_holding_the_gpus_files() {
        let mut listed = Listed::new();
        let mut read = read_of(&[7, 8]);
        read.minors.insert(7, vec![0]);
        read.minors.insert(8, vec![1]);
        read.unfigured.push(9);
        // 7 holds GPU 0's file; 8 (a reused pid) holds none of GPU 1's.
        let holds = |pid: u32, minors: &[u32]| pid == 7 && minors == [0];
        let (joined, unjoined) = split(read.clone(), None, |pid| Some(u64::from(pid) * 100), holds, &mut listed);
        assert_eq!(joined.processes.keys().copied().collect::<Vec<_>>(), [7]);
        assert_eq!(unjoined.iter().map(|u| (u.pid, u.bytes, u.reason.as_str())).collect::<Vec<_>>(), [(8, 8 << 20, NOT_HOLDING), (9, 0, NO_FIGURE)]);
        // 8 never joins while listed, whatever it holds later, unless it is the same process
        // opening the files: then it is.
        let (joined, _) = split(read.clone(), None, |pid| Some(u64::from(pid) * 100), |_, _| true, &mut listed);
        assert_eq!(joined.processes.keys().copied().collect::<Vec<_>>(), [7, 8]);
        let (joined, unjoined) = split(read, None, |pid| Some(u64::from(pid) * 100 + 1), |_, _| true, &mut listed);
        assert!(joined.processes.is_empty());
        assert!(unjoined.iter().filter(|u| u.pid != 9).all(|u| u.reason == REUSED_SINCE_LISTED), "{unjoined:?}");
    }

    #[test]
    fn the_table_restored_after_a_restart_keeps_a_reused_pid_unjoined() {
        let dir = std::env::temp_dir().join(format!("vramguard-join-restart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(crate::driver::listed::FILE);
        let gpus = vec!["GPU-x".to_string()];
        // Before the restart: 7 listed while process 700 had it.
        let mut listed = Listed::new();
        split(read_of(&[7]), None, |_| Some(700), |_, _| true, &mut listed);
        listed.save(&path, &gpus).expect("save");
        // After: a new process (900) has pid 7 and holds the GPU's files; the restored table
        // says the row is 700's.
        let mut restored = Listed::load(&path, &gpus).expect("valid").expect("a table");
        let (joined, unjoined) = split(read_of(&[7]), None, |_| Some(900), |_, _| true, &mut restored);
        assert!(joined.processes.is_empty());
        assert_eq!(unjoined[0].reason, REUSED_SINCE_LISTED);
        // Without the table, the same process would have been joined: the control.
        let (joined, _) = split(read_of(&[7]), None, |_| Some(900), |_, _| true, &mut Listed::new());
        assert_eq!(joined.processes.keys().copied().collect::<Vec<_>>(), [7]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
