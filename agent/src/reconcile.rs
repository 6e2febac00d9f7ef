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
//! slot whose host pid the reclaimer has not recorded yet is joined too. A slot that joins no
//! eBPF row is looked up by its recorded host pid: still running (same start time, not a
//! zombie) means a hooked process the probes see no memory for; gone means a stale slot. A
//! slot with neither a match nor a host pid is left out until the reclaimer records one
//! (within a second). A process in several ledgers is charged their sum (and reported with
//! the first).
//!
//! # States
//!
//! * `tampered`: the ledger charges the process less than the probes saw, by more than the
//!   threshold; reported at once (the hook charges before the driver allocates and releases
//!   after it frees, so an honest ledger is never behind: this is what a process that wrote
//!   its own slot down looks like).
//! * `drift`: the views differ by more than the threshold (the ledger ahead), continuously
//!   for longer than the grace period.
//! * `unhooked`: the probes see GPU memory, and no watched ledger has a slot for the process.
//! * `stale`: a slot whose process is gone (the reclaimer normally frees it within a second).
//! * `ok`: otherwise.
//!
//! Passes run after every drain of the event ring buffer and every ledger sweep (at most one
//! per [`MIN_INTERVAL`]), at least every second, and for every scrape and `audit`.
use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use ledger::{layout::Slot, Kind, ProcessIdentity};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::{identity, ledgers::Ledgers, snapshot::Snapshot};

/// Default `--drift-threshold`: 64 MiB.
pub const DEFAULT_THRESHOLD: u64 = 64 << 20;
/// Default `--drift-grace-ms`.
pub const DEFAULT_GRACE_MS: u64 = 5000;
/// Passes triggered by events are at least this far apart (the timer's are not affected).
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// A process's reconciliation state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Ok,
    Drift,
    Unhooked,
    Stale,
    Tampered,
}

impl State {
    pub const ALL: [State; 5] = [State::Ok, State::Drift, State::Unhooked, State::Stale, State::Tampered];

    pub fn name(self) -> &'static str {
        match self {
            State::Ok => "ok",
            State::Drift => "drift",
            State::Unhooked => "unhooked",
            State::Stale => "stale",
            State::Tampered => "tampered",
        }
    }
}

/// What one pass found about one process, before judging.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    /// Host pid.
    pub pid: u32,
    /// The ledger holding the process's slot (its path), if any.
    pub ledger: Option<String>,
    /// Requested bytes the ledger charges (data + small + managed), if it has a slot.
    pub ledger_bytes: Option<u64>,
    /// Requested bytes the probes saw.
    pub ebpf_bytes: u64,
    /// The slot's process is gone.
    pub gone: bool,
}

/// One process's state, as the last pass judged it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub pid: u32,
    pub state: State,
    pub ledger: Option<String>,
    pub ledger_bytes: Option<u64>,
    pub ebpf_bytes: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Bytes the views may differ by.
    pub threshold: u64,
    /// How long a difference (ledger ahead) may last before it is `drift`.
    pub grace: Duration,
}

impl Default for Config {
    fn default() -> Config {
        Config { threshold: DEFAULT_THRESHOLD, grace: Duration::from_millis(DEFAULT_GRACE_MS) }
    }
}

pub struct Reconciler {
    config: Config,
    /// Since when each process's views have differed (ledger ahead) beyond the threshold.
    diverged: HashMap<u32, Instant>,
    verdicts: Vec<Verdict>,
    last_pass: Option<Instant>,
}

impl Reconciler {
    pub fn new(config: Config) -> Reconciler {
        Reconciler { config, diverged: HashMap::new(), verdicts: Vec::new(), last_pass: None }
    }

    /// The last pass's verdicts, by pid.
    pub fn verdicts(&self) -> &[Verdict] {
        &self.verdicts
    }

    /// Whether an event-triggered pass is due ([`MIN_INTERVAL`] since the last).
    pub fn due(&self) -> bool {
        self.last_pass.is_none_or(|at| at.elapsed() >= MIN_INTERVAL)
    }

    /// One pass over the watched ledgers and the eBPF view (`(host pid, bytes)` per process).
    pub fn pass(&mut self, ledgers: Option<&Ledgers>, ebpf: &[(u32, u64)]) {
        let observations = observe(ledgers, ebpf);
        self.judge(observations, Instant::now());
    }

    /// Judges `observations` as of `now`, logging every change of state.
    pub fn judge(&mut self, observations: Vec<Observation>, now: Instant) {
        let mut verdicts = Vec::with_capacity(observations.len());
        let mut diverged = HashMap::new();
        for seen in observations {
            let state = match seen.ledger_bytes {
                _ if seen.gone => State::Stale,
                None if seen.ebpf_bytes > 0 => State::Unhooked,
                None => State::Ok,
                Some(ledger) if seen.ebpf_bytes.saturating_sub(ledger) > self.config.threshold => State::Tampered,
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
            let before = self.verdicts.iter().find(|v| v.pid == seen.pid).map(|v| v.state);
            if before != Some(state) && (before.is_some() || state != State::Ok) {
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
                state,
                ledger: seen.ledger,
                ledger_bytes: seen.ledger_bytes,
                ebpf_bytes: seen.ebpf_bytes,
            });
        }
        verdicts.sort_by_key(|v| (v.pid, v.state));
        self.diverged = diverged;
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
        }
        snapshot.processes.sort_by_key(|row| row.pid);
    }
}

/// Requested bytes a slot charges, context excluded (see the module doc).
pub fn slot_bytes(slot: &Slot, devices: usize) -> u64 {
    slot.devices
        .iter()
        .take(devices)
        .flat_map(|device| [Kind::Data, Kind::Small, Kind::Managed].map(|kind| device.bytes[kind as usize]))
        .fold(0u64, u64::saturating_add)
}

/// Joins the ledgers' live slots with the eBPF view.
pub fn observe(ledgers: Option<&Ledgers>, ebpf: &[(u32, u64)]) -> Vec<Observation> {
    // Each eBPF process's identity: how a slot finds its process even before its host pid
    // is recorded.
    let by_identity: HashMap<ProcessIdentity, u32> =
        ebpf.iter().filter_map(|&(pid, _)| identity::identity_of(pid).map(|id| (id, pid))).collect();
    // pid -> (ledger, ledger bytes), for slots joined to an eBPF row.
    let mut joined: HashMap<u32, (String, u64)> = HashMap::new();
    let mut observations = Vec::new();
    for (path, ledger) in ledgers.into_iter().flat_map(Ledgers::iter) {
        let slots = match ledger.slots() {
            Ok(slots) => slots,
            Err(error) => {
                warn!(ledger = %path.display(), %error, "cannot read the ledger's slots to reconcile");
                continue;
            }
        };
        let devices = ledger.header().device_count as usize;
        let name = path.display().to_string();
        for view in slots {
            let slot = view.slot;
            let bytes = slot_bytes(&slot, devices);
            let process = ProcessIdentity { pid: slot.pid, pidns: slot.pidns, start_time: slot.start_time };
            if let Some(&pid) = by_identity.get(&process) {
                let entry = joined.entry(pid).or_insert_with(|| (name.clone(), 0));
                entry.1 = entry.1.saturating_add(bytes);
                continue;
            }
            if slot.host_pid == 0 {
                continue; // not identified yet: the reclaimer records its host pid soon
            }
            let gone = ledger::process::running_start_time_of(slot.host_pid) != Some(slot.start_time);
            observations.push(Observation {
                pid: slot.host_pid,
                ledger: Some(name.clone()),
                ledger_bytes: Some(bytes),
                ebpf_bytes: 0,
                gone,
            });
        }
    }
    for &(pid, bytes) in ebpf {
        let (ledger, ledger_bytes) = match joined.remove(&pid) {
            Some((ledger, charged)) => (Some(ledger), Some(charged)),
            None => (None, None),
        };
        // A process the probes saw with a slot found by its host pid only (its identity
        // could not be read, e.g. it is exiting): merge rather than report it twice.
        if ledger.is_none() {
            if let Some(other) = observations.iter_mut().find(|o| o.pid == pid && !o.gone) {
                other.ebpf_bytes = bytes;
                continue;
            }
        }
        observations.push(Observation { pid, ledger, ledger_bytes, ebpf_bytes: bytes, gone: false });
    }
    observations
}

#[cfg(test)]
mod tests {
    use super::*;
    use ledger::{layout::CREATOR_AGENT, Charge, DeviceConfig, Geometry, Ledger};

    const MIB: u64 = 1 << 20;

    fn seen(pid: u32, ledger_bytes: Option<u64>, ebpf_bytes: u64) -> Observation {
        Observation { pid, ledger: ledger_bytes.map(|_| "/l".to_string()), ledger_bytes, ebpf_bytes, gone: false }
    }

    fn states(r: &Reconciler) -> Vec<(u32, State)> {
        r.verdicts().iter().map(|v| (v.pid, v.state)).collect()
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
        assert_eq!(
            states(&r),
            vec![(1, State::Ok), (2, State::Unhooked), (3, State::Tampered), (4, State::Ok), (5, State::Stale), (6, State::Ok)]
        );
        assert_eq!(r.ebpf_bytes_by_ledger().get("/l"), Some(&(264 * MIB)));
    }

    #[test]
    fn drift_needs_the_grace_period_and_resets() {
        let config = Config { threshold: 64 * MIB, grace: Duration::from_secs(5) };
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
        let mut r = Reconciler::new(Config::default());
        r.pass(Some(&ledgers), &[(pid, charged)]);
        let name = path.display().to_string();
        let ok = Verdict { pid, state: State::Ok, ledger: Some(name.clone()), ledger_bytes: Some(charged), ebpf_bytes: charged };
        assert_eq!(r.verdicts(), [ok]);

        // The probes see 100 MiB more than the ledger charges: tampered.
        r.pass(Some(&ledgers), &[(pid, charged + 100 * MIB)]);
        assert_eq!(r.verdicts()[0].state, State::Tampered);

        // Without eBPF memory and without a host pid the slot is left out; with this
        // process's host pid recorded it is a live process (ledger ahead, within grace).
        r.pass(Some(&ledgers), &[]);
        assert_eq!(r.verdicts(), []);
        ledger.set_host_pid(slot, pid);
        r.pass(Some(&ledgers), &[]);
        assert_eq!(states(&r), vec![(pid, State::Ok)]);
        // Another process (pid 1) is not in any ledger: unhooked.
        r.pass(Some(&ledgers), &[(1, MIB)]);
        assert!(states(&r).contains(&(1, State::Unhooked)), "{:?}", r.verdicts());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
