//! Limits for workloads that bypass the hook, enforced by the eBPF entry probes.
//!
//! A limits file maps cgroup path patterns to GPU-memory limits, one rule a line:
//!
//! ```text
//! # pattern (cgroup2 path, `*` matches anything)    limit (bytes, or k/m/g/t, 1024-based)
//! /kubepods.slice/*pod1234*                          8g
//! ```
//!
//! The agent re-reads the file every `--rescan-ms` (so a ConfigMap update applies within
//! about a second; an invalid new version is logged and the rules before it stay in force),
//! resolves the patterns against the cgroup2 tree (the first matching rule wins),
//! adds the cgroups of every watched ledger's live processes with that ledger's limit (the
//! sum over its devices: the probes see a cgroup's memory on all devices together; a rule of
//! the file wins over it), and keeps the kernel map `CGROUP_LIMITS` in step, so the entry probe of an allocation
//! that would pass its cgroup's limit counts it (`audit`, the default) or sends the calling
//! process a signal before the driver runs (`signal`, SIGKILL by default). `deny` (making the
//! call return `CUDA_ERROR_OUT_OF_MEMORY`) needs a kernel that lets uprobe programs write
//! their registers; the agent checks at start and says whether this kernel does.
//!
//! The probes see only allocations made through the libcuda files they are on, and count
//! live bytes only: what a stream-ordered pool keeps of what it freed is held by the driver,
//! but a pool with a low release threshold gives it back at a synchronize no probe sees, so a
//! kept figure the entry probe counted would stop honest allocations on memory the driver no
//! longer holds. The entry probe checks a stream-ordered allocation for what the process's
//! pools cannot serve from what they keep: a process that takes back its own pool's memory
//! adds nothing and is never stopped for it.
//!
//! Who takes the room is who is stopped. What a cgroup's processes hold as the driver shows
//! it is the agent's to hold to the limit ([`crate::snapshot::Holder`], joined by
//! [`crate::reconcile`] and handed on by the reconcile task, never read here from NVML): per
//! process, the driver's figure on the probes' scale (a context at `--context-allowance` and
//! a page per device aside: live, kept by its pools, memory the probes cannot see) and never
//! less than the probes' live bytes, each read's figures alone ([`crate::reconcile::figure::at_read`]),
//! the smaller of *two consecutive driver reads*. So what one read alone showed (a free between
//! two reads, a pool trimmed or given back at a synchronize, a process being torn down) never
//! counts, and no view's old figure is ever added to another's newer one. In `signal` mode a
//! cgroup whose usage (that, less what the probes saw leave it since the pass) is over its
//! limit has processes signalled by the agent until what is left is within it, in
//! [`crate::snapshot::Holder::stop_order`]: first those holding memory neither the probes see
//! nor a ledger charges (through a copy of libcuda no probe is on), then those holding memory
//! no ledger charges (the hook did not admit it: an un-hooked process beside a pool that keeps
//! what it freed, new memory on a kept figure its pool had given back), each largest first;
//! then the others, largest first (a limit below what their ledger admits). Memory the hook
//! charges that the probes cannot see (an array, graph memory, a second context) is
//! admitted. Each signal goes through a pidfd, checked by the
//! process's start time, so that a reused pid is never signalled; each process once the
//! signal is delivered or the process is found gone; a failed signal is tried again. The
//! limit pushed to the probes stays the cgroup's, so that the entry probe never stops the next
//! honest allocator of the cgroup for memory another process took. Only the escaped bytes (the
//! driver's figure beyond the probes' live and kept bytes, [`crate::reconcile::Verdict::enforced_bytes`])
//! of a process a signal failed for come off it. In `audit` mode the limit pushed is the
//! cgroup's limit less its processes' escaped bytes, so what passes it is counted, and the
//! processes signal mode would stop are logged. This is as fast as the driver view: about a
//! pass after the second read that shows the memory (two to four seconds). Without the
//! driver's view the agent stops no one: the entry probe's live figure alone is enforced.
//!
//! A limit is only ever pushed for a cgroup that exists when it is pushed: the kernel deletes
//! a removed cgroup's entry (`cgroup_rmdir`), and the agent must not bring it back.
//!
//! The kernel word `LIMITS_ON` tells the entry probes whether to look limits up at all: it is
//! set before the first limit is pushed and cleared only once every limit the agent pushed is
//! removed again, so a node without limits pays no lookup per allocation. While set, it is the
//! generation of `CGROUP_LIMITS`'s contents, moved on after every change of the map: the
//! probes keep a copy of each cgroup's limit beside its usage, good for one generation
//! (`common::CgroupUsage`), which spares them a lookup per allocation.
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use aya::{
    maps::{Array, HashMap, MapData},
    programs::UProbe,
    Ebpf,
};
use common::{enforce, names, CgroupLimit};

use crate::{
    cgroup::CgroupNames,
    glob::matches,
    snapshot::{HoldersByCgroup, Holder},
};

/// What the probes do with an allocation over its cgroup's limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Count it (metric and audit), let it through.
    Audit,
    /// Signal the process before the driver allocates.
    Signal,
    /// Make the call fail without reaching the driver (kernel support needed).
    Deny,
}

impl Mode {
    /// The mode as `--enforce` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Audit => "audit",
            Mode::Signal => "signal",
            Mode::Deny => "deny",
        }
    }
}

/// One rule of a limits file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub pattern: String,
    pub limit: u64,
}

/// Parses a limits file's text.
pub fn parse_rules(text: &str) -> Result<Vec<Rule>> {
    let mut rules = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(pattern), Some(limit), None) = (fields.next(), fields.next(), fields.next()) else {
            bail!("line {}: expected `PATTERN LIMIT`, found {line:?}", number + 1);
        };
        if !pattern.starts_with('/') {
            bail!("line {}: the pattern {pattern:?} must be a cgroup2 path starting with /", number + 1);
        }
        let Some(limit) = cuda_abi::parse_size(limit) else {
            bail!("line {}: {limit:?} is not a size (bytes, or a number with k, m, g or t)", number + 1);
        };
        rules.push(Rule { pattern: pattern.to_string(), limit });
    }
    Ok(rules)
}

/// The rules and the kernel map they are pushed into.
pub struct Limits {
    /// The limits file, re-read at every [`Limits::refresh`] (a ConfigMap update lands
    /// within a second); `text` is what its rules were parsed from.
    file: Option<(PathBuf, String)>,
    rules: Vec<Rule>,
    /// Cgroup path -> limit, of the provisioned containers.
    provisioned: BTreeMap<String, u64>,
    /// Cgroup paths the driver holds to their quota itself (r615+, [`crate::driver_limits`]):
    /// no probe limit and no signal for them, unless a rule of the limits file names them.
    driver_held: std::collections::BTreeSet<String>,
    /// Cgroup id -> limit, from the watched ledgers.
    ledger_limits: BTreeMap<u64, u64>,
    /// Cgroup path -> limit, of the cgroups a rule of the limits file named at the last
    /// refresh (the driver's limits are set on them too).
    ruled: BTreeMap<String, u64>,
    mode: u32,
    signal: u32,
    map: HashMap<MapData, u64, CgroupLimit>,
    applied: BTreeMap<u64, CgroupLimit>,
    /// The processes holding memory in each cgroup, from reconcile.
    holders: std::sync::Arc<HoldersByCgroup>,
    /// Each cgroup's limit before its escaped bytes are taken off (what `applied` was made from).
    limit_of: BTreeMap<u64, u64>,
    /// The processes signalled for their cgroup's limit, and the agent's signals to them.
    stops: Stops,
    /// `LIMITS_ON`, and what was last written to it (0: off; else the map's generation).
    on: Array<MapData, u32>,
    generation: u32,
}

impl Limits {
    /// Limits from `file` (if any) and, later, from the ledgers ([`Limits::set_ledger_limits`]).
    pub fn new(ebpf: &mut Ebpf, file: Option<&Path>, mode: Mode, signal: i32) -> Result<Limits> {
        let (file, rules) = match file {
            Some(file) => {
                let text = fs::read_to_string(file)
                    .with_context(|| format!("cannot read the limits file {}", file.display()))?;
                let rules = parse_rules(&text).with_context(|| format!("in the limits file {}", file.display()))?;
                (Some((file.to_path_buf(), text)), rules)
            }
            None => (None, Vec::new()),
        };
        let mode = match mode {
            Mode::Audit => enforce::AUDIT,
            Mode::Signal => enforce::SIGNAL,
            Mode::Deny => bail!("deny mode is not available (see the log line about it at start)"),
        };
        if !(1..=64).contains(&signal) {
            bail!("--signal {signal} is not a signal number");
        }
        let map = ebpf.take_map(names::CGROUP_LIMITS).context("the eBPF object has no CGROUP_LIMITS map")?;
        let map = HashMap::try_from(map).context("CGROUP_LIMITS has an unexpected type")?;
        let on = ebpf.take_map(names::LIMITS_ON).context("the eBPF object has no LIMITS_ON map")?;
        let on = Array::try_from(on).context("LIMITS_ON has an unexpected type")?;
        Ok(Limits {
            file,
            rules,
            provisioned: BTreeMap::new(),
            driver_held: Default::default(),
            ledger_limits: BTreeMap::new(),
            ruled: BTreeMap::new(),
            mode,
            signal: signal as u32,
            map,
            applied: BTreeMap::new(),
            holders: Default::default(),
            limit_of: BTreeMap::new(),
            stops: Stops::default(),
            on,
            generation: 0,
        })
    }

    /// The cgroups of the watched ledgers' live processes and their ledgers' limits.
    pub fn set_ledger_limits(&mut self, limits: BTreeMap<u64, u64>) {
        self.ledger_limits = limits;
    }

    /// The processes holding memory in each cgroup, as the last reconcile pass saw them.
    pub fn set_holders(&mut self, holders: std::sync::Arc<HoldersByCgroup>) {
        self.holders = holders;
    }

    /// Signals the agent sent to processes over their cgroup's limit, in all and by why
    /// ([`Holder::WHY`]).
    pub fn agent_signals(&self) -> (u64, [u64; 3]) {
        (self.stops.signals, self.stops.by_why)
    }

    /// For each cgroup whose usage is over its limit (its holders' escaped, live and kept
    /// bytes; live no more than `probed`, the probes' figure now): in `signal` mode, signals
    /// its holders in [`Holder::stop_order`] until what is left is within the limit (see the
    /// module doc); in `audit` mode, logs them (once per process).
    pub fn signal_over_limit(&mut self, probed: impl Fn(u64) -> u64) {
        let holders = self.holders.clone();
        let (mode, signal) = (self.mode, self.signal as i32);
        self.stops.act(&holders, &self.limit_of, probed, |process| match mode {
            enforce::SIGNAL => Some(signal_process(process, signal)),
            _ => None,
        });
    }

    /// The cgroups of the provisioned containers (paths relative to the cgroup2 root) and
    /// their limits: after the limits file's rules, before the ledgers' limits.
    pub fn set_provisioned(&mut self, limits: BTreeMap<String, u64>) {
        self.provisioned = limits;
    }

    /// The cgroups (paths relative to the cgroup2 root) the driver holds to their quota: the
    /// provisioned and the ledgers' limits stand down for them (the driver's out-of-memory
    /// stops what would pass the quota; nobody is signalled for it).
    pub fn set_driver_held(&mut self, held: std::collections::BTreeSet<String>) {
        self.driver_held = held;
    }

    /// The cgroups a rule of the limits file named at the last refresh (path relative to the
    /// cgroup2 root -> the rule's limit).
    pub fn ruled(&self) -> &BTreeMap<String, u64> {
        &self.ruled
    }

    /// Re-reads the limits file if it changed: new rules replace the old ones; a file that
    /// cannot be read or parsed leaves the old rules in force (and is logged once).
    fn reload(&mut self) {
        let Some((path, text)) = self.file.as_mut() else { return };
        let now = match fs::read_to_string(&*path) {
            Ok(now) => now,
            Err(error) => {
                let error = format!("unreadable: {error}");
                if *text != error {
                    tracing::warn!(file = %path.display(), %error, "cannot re-read the limits file: the rules read before stay in force");
                    *text = error;
                }
                return;
            }
        };
        if now == *text {
            return;
        }
        match parse_rules(&now) {
            Ok(rules) => {
                tracing::info!(file = %path.display(), rules = rules.len(), "limits file changed: new rules in force");
                self.rules = rules;
            }
            Err(error) => {
                tracing::warn!(file = %path.display(), error = %format!("{error:#}"), "the changed limits file is invalid: the rules read before stay in force");
            }
        }
        *text = now;
    }

    /// Re-reads the limits file if it changed, resolves the rules against the cgroups that
    /// exist now and updates the kernel map.
    pub fn refresh(&mut self, names: &mut CgroupNames) {
        self.reload();
        let mut wanted = BTreeMap::new();
        let mut walked = false;
        let mut held = std::collections::BTreeSet::new();
        let mut ruled = BTreeMap::new();
        if !self.rules.is_empty() || !self.provisioned.is_empty() || !self.driver_held.is_empty() {
            walked = true;
            for (id, path) in names.all() {
                let limit = match self.rules.iter().find(|rule| matches(&rule.pattern, path)) {
                    Some(rule) => {
                        ruled.insert(path.clone(), rule.limit);
                        Some(rule.limit)
                    }
                    None if self.driver_held.contains(path) => {
                        held.insert(*id);
                        None
                    }
                    None => self.provisioned.get(path).copied(),
                };
                if let Some(limit) = limit {
                    wanted.insert(*id, CgroupLimit { limit, mode: self.mode, signal: self.signal });
                }
            }
        }
        self.ruled = ruled;
        for (id, limit) in self.ledger_limits.iter().filter(|(id, _)| !held.contains(id)) {
            wanted.entry(*id).or_insert(CgroupLimit { limit: *limit, mode: self.mode, signal: self.signal });
        }
        // What the probes cannot see a cgroup's processes hold comes off what they may allocate,
        // unless the agent signals the processes that hold it (see the module doc).
        self.limit_of = wanted.iter().map(|(id, limit)| (*id, limit.limit)).collect();
        for (id, limit) in wanted.iter_mut() {
            let escaped = self.holders.get(id).map_or(0, |processes| off_the_limit(self.mode, processes, &self.stops.failed));
            limit.limit = limit.limit.saturating_sub(escaped);
        }
        // A ledger's cgroups come from the last reconcile pass: one may have gone since. Only
        // a limit about to be written needs the check (the tree is walked once for them all).
        if wanted.iter().any(|(id, limit)| self.applied.get(id) != Some(limit)) {
            let existing = if walked { names.known() } else { names.all() };
            if !existing.is_empty() {
                wanted.retain(|id, _| existing.contains_key(id));
            }
        }
        let mut changed = false;
        for id in self.applied.keys().filter(|id| !wanted.contains_key(id)).copied().collect::<Vec<_>>() {
            let _ = self.map.remove(&id);
            self.applied.remove(&id);
            changed = true;
        }
        if !wanted.is_empty() {
            self.switch_on();
        }
        for (id, limit) in wanted {
            if self.applied.get(&id) != Some(&limit) {
                changed = true;
                match self.map.insert(id, limit, 0) {
                    Ok(()) => {
                        self.applied.insert(id, limit);
                    }
                    Err(error) => tracing::warn!(cgroup = id, %error, "cannot push a cgroup limit to the kernel"),
                }
            }
        }
        if changed {
            self.changed();
        }
    }

    /// Cgroups with a limit pushed.
    pub fn applied(&self) -> usize {
        self.applied.len()
    }

    /// The cgroups with a limit in the kernel map, ascending.
    pub fn ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.map.keys().filter_map(Result::ok).collect();
        ids.sort_unstable();
        ids
    }

    /// The cgroups the agent has pushed a limit for (the kernel may have deleted some since).
    pub fn pushed(&self) -> impl Iterator<Item = u64> + '_ {
        self.applied.keys().copied()
    }

    /// Forgets the limits of these (removed) cgroups, in the kernel map and in the agent's
    /// record; returns how many kernel entries went.
    pub fn forget(&mut self, ids: &[u64]) -> usize {
        let pushed = self.applied.len();
        let gone = ids
            .iter()
            .filter(|id| {
                self.applied.remove(id);
                self.map.remove(id).is_ok()
            })
            .count();
        if self.applied.len() != pushed {
            self.changed();
        }
        gone
    }

    /// Sets `LIMITS_ON` before a limit is pushed, if it is off.
    fn switch_on(&mut self) {
        if self.generation == 0 {
            self.write_generation(1);
        }
    }

    /// After a change of the map: `LIMITS_ON` moves on to the next generation (so the probes'
    /// copies of the old limits are read again), or goes off once no pushed limit is left.
    fn changed(&mut self) {
        let next = if self.applied.is_empty() { 0 } else { self.generation.wrapping_add(1).max(1) };
        self.write_generation(next);
        tracing::info!(generation = next, cgroups = self.applied.len(), "cgroup limits in the probes changed");
    }

    fn write_generation(&mut self, generation: u32) {
        match self.on.set(0, generation, 0) {
            Ok(()) => self.generation = generation,
            Err(error) => tracing::warn!(generation, %error, "cannot write LIMITS_ON: the entry probes may not check limits"),
        }
    }
}

/// The processes the agent has signalled (or, in `audit` mode, logged) for their cgroup's
/// limit, and how many signals it sent.
#[derive(Default)]
struct Stops {
    /// (pid, start time) of the processes signalled (or found gone, or logged in `audit`
    /// mode), forgotten once they are no longer reported.
    signalled: std::collections::BTreeSet<(u32, u64)>,
    /// Those a signal failed for (said once; tried again at the next push).
    failed: std::collections::BTreeSet<(u32, u64)>,
    /// Signals sent, and by why ([`Holder::WHY`]).
    signals: u64,
    by_why: [u64; 3],
}

impl Stops {
    /// For each cgroup of `holders` whose usage is over its limit (`limit_of`), hands its
    /// holders to `send` in [`Holder::stop_order`] until what is left is within it. The usage
    /// is what its holders held on two driver reads ([`Holder::held`]), less what the probes
    /// saw leave the cgroup since the pass (their live bytes then beyond `probed`, the
    /// probes' figure now). `send` answers how the signal went (`None`: not sent, `audit`
    /// mode: logged once). A process is counted signalled only once the signal was delivered
    /// or the process is found gone; one a signal failed for is tried again at the next call.
    fn act(
        &mut self,
        holders: &HoldersByCgroup,
        limit_of: &BTreeMap<u64, u64>,
        probed: impl Fn(u64) -> u64,
        mut send: impl FnMut(&Holder) -> Option<std::io::Result<()>>,
    ) {
        let reported: std::collections::BTreeSet<(u32, u64)> = holders.values().flatten().map(|p| (p.pid, p.start_time)).collect();
        self.signalled.retain(|process| reported.contains(process));
        self.failed.retain(|process| reported.contains(process));
        for (cgroup, processes) in holders {
            let Some(&limit) = limit_of.get(cgroup) else { continue };
            let sum = |part: fn(&Holder) -> u64| processes.iter().fold(0u64, |sum, p| sum.saturating_add(part(p)));
            let freed_since = sum(|p| p.live).saturating_sub(probed(*cgroup));
            let usage = sum(|p| p.held).saturating_sub(freed_since);
            for (process, usage) in to_signal(processes, usage, limit, &self.signalled) {
                let key = (process.pid, process.start_time);
                let why = Holder::WHY[usize::from(process.stop_order().0)];
                let (pid, held_bytes, unadmitted_bytes, escaped_bytes) = (process.pid, process.held, process.unadmitted, process.escaped);
                match send(&process) {
                    None => {
                        tracing::warn!(pid, cgroup, held_bytes, unadmitted_bytes, escaped_bytes, usage, limit, why,
                            "a process holding GPU memory past its cgroup's limit: not signalled (--enforce audit; said once per process)");
                        self.signalled.insert(key);
                    }
                    Some(Ok(())) => {
                        self.signals += 1;
                        self.by_why[usize::from(process.stop_order().0)] += 1;
                        tracing::warn!(pid, cgroup, held_bytes, unadmitted_bytes, escaped_bytes, usage, limit, why,
                            "signalled a process holding GPU memory past its cgroup's limit");
                        self.signalled.insert(key);
                    }
                    Some(Err(error)) if is_gone(&error) => {
                        self.signalled.insert(key);
                    }
                    Some(Err(error)) => {
                        if self.failed.insert(key) {
                            tracing::warn!(pid, cgroup, %error, "cannot signal a process over its cgroup's limit: tried again at each push (said once)");
                        }
                    }
                }
            }
        }
    }
}

/// The escaped bytes of a cgroup's `processes` that come off the limit pushed to its probes:
/// all of them in `audit` mode; in `signal` mode only those of processes a signal `failed`
/// for (the others are the agent's to stop).
fn off_the_limit(mode: u32, processes: &[Holder], failed: &std::collections::BTreeSet<(u32, u64)>) -> u64 {
    processes
        .iter()
        .filter(|p| mode != enforce::SIGNAL || failed.contains(&(p.pid, p.start_time)))
        .fold(0u64, |sum, p| sum.saturating_add(p.escaped))
}

/// Whether a signal's `error` says the process is gone (`ESRCH`, or its pid another's now).
fn is_gone(error: &std::io::Error) -> bool {
    error.raw_os_error() == Some(libc::ESRCH) || error.kind() == std::io::ErrorKind::NotFound
}

/// Of a cgroup's `processes` (in [`Holder::stop_order`]), those to signal so that its
/// `usage` comes within `limit`, each with the usage it is signalled at: the `signalled` ones
/// are on their way out already (what they hold counts as gone). A process that holds
/// nothing is never chosen.
fn to_signal(processes: &[Holder], usage: u64, limit: u64, signalled: &std::collections::BTreeSet<(u32, u64)>) -> Vec<(Holder, u64)> {
    let is_signalled = |p: &Holder| signalled.contains(&(p.pid, p.start_time));
    let mut usage = processes.iter().filter(|p| is_signalled(p)).fold(usage, |usage, p| usage.saturating_sub(p.held));
    let mut chosen = Vec::new();
    for process in processes.iter().filter(|p| !is_signalled(p) && p.held > 0) {
        if usage <= limit {
            break;
        }
        chosen.push((*process, usage));
        usage = usage.saturating_sub(process.held);
    }
    chosen
}

/// Sends `signal` to `process` if it still is that process: through a pidfd (opened, then the
/// start time checked, then signalled: a pid reused in between cannot be hit).
fn signal_process(process: &Holder, signal: i32) -> std::io::Result<()> {
    let pidfd = crate::pidfd::open(process.pid)?;
    if ledger::process::running_start_time_of(process.pid) != Some(process.start_time) {
        return Err(std::io::Error::new(std::io::ErrorKind::NotFound, "the process is gone (its pid is another process's now)"));
    }
    if let Err(error) = crate::pidfd::send_signal(&pidfd, signal) {
        if error.raw_os_error() == Some(libc::EPERM) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "not permitted: signalling a process of another uid needs CAP_KILL (add KILL to the DaemonSet's capabilities for --enforce signal)",
            ));
        }
        return Err(error);
    }
    Ok(())
}

/// Whether this kernel lets a uprobe program write its registers (what `deny` needs): loads
/// the `deny_probe` program, which is never attached.
pub fn deny_support(ebpf: &mut Ebpf) -> Result<(), String> {
    let program: &mut UProbe = ebpf
        .program_mut(names::DENY_PROBE)
        .ok_or("the eBPF object has no deny_probe program")?
        .try_into()
        .map_err(|error| format!("{error}"))?;
    program.load().map_err(|error| {
        let log = format!("{error:#}");
        tracing::debug!(verifier = %log, "deny_probe refused");
        // The verifier's own words, e.g. "invalid bpf_context access off=80 size=8".
        let reason = log
            .lines()
            .find(|line| line.contains("invalid bpf_context access"))
            .or_else(|| log.lines().rev().find(|line| !line.trim().is_empty()))
            .unwrap_or("no reason given");
        format!("the kernel refuses uprobe programs that write their registers ({})", reason.trim())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_are_signalled_in_order_until_the_cgroup_is_within_its_limit() {
        const MIB: u64 = 1 << 20;
        let process = |pid, bytes| Holder { pid, start_time: u64::from(pid) * 10, held: bytes, unadmitted: bytes, ..Holder::default() };
        let processes = [process(1, 300 * MIB), process(2, 200 * MIB), process(3, 100 * MIB)];
        let none = std::collections::BTreeSet::new();
        let pids = |chosen: Vec<(Holder, u64)>| chosen.into_iter().map(|(p, _)| p.pid).collect::<Vec<_>>();
        // 700 MiB held (100 of them by processes that hold nothing now) against 1 GiB: within.
        assert_eq!(pids(to_signal(&processes, 700 * MIB, 1024 * MIB, &none)), Vec::<u32>::new());
        // Against 512 MiB: the largest goes (400 left), that is enough.
        assert_eq!(pids(to_signal(&processes, 700 * MIB, 512 * MIB, &none)), [1]);
        // Against 128 MiB: the three.
        assert_eq!(pids(to_signal(&processes, 700 * MIB, 128 * MIB, &none)), [1, 2, 3]);
        // The largest signalled already: not again, and its bytes count as gone.
        let signalled = std::collections::BTreeSet::from([(1, 10)]);
        assert_eq!(pids(to_signal(&processes, 700 * MIB, 512 * MIB, &signalled)), Vec::<u32>::new());
        assert_eq!(pids(to_signal(&processes, 700 * MIB, 300 * MIB, &signalled)), [2]);
    }

    #[test]
    fn a_process_is_counted_signalled_only_once_the_signal_is_delivered_or_it_is_gone() {
        const MIB: u64 = 1 << 20;
        let process = |pid| Holder { pid, start_time: u64::from(pid) * 10, held: 200 * MIB, unadmitted: 200 * MIB, ..Holder::default() };
        // Three processes holding memory no ledger charges in cgroup 7, limited to 128 MiB.
        let escaped = HoldersByCgroup::from([(7, vec![process(1), process(2), process(3)])]);
        let limits = BTreeMap::from([(7, 128 * MIB)]);
        let mut stops = Stops::default();
        let mut tried = Vec::new();
        // 1 refuses (EPERM), 2 is gone (ESRCH), 3 is signalled.
        let answer = |pid: u32| match pid {
            1 => std::io::Error::from_raw_os_error(libc::EPERM).into(),
            2 => std::io::Error::from_raw_os_error(libc::ESRCH).into(),
            _ => None,
        };
        stops.act(&escaped, &limits, |_| 0, |p| {
            tried.push(p.pid);
            Some(answer(p.pid).map_or(Ok(()), Err))
        });
        assert_eq!(tried, [1, 2, 3]);
        assert_eq!(stops.signals, 1);
        assert_eq!(stops.signalled, std::collections::BTreeSet::from([(2, 20), (3, 30)]));
        // The refused one is tried again at the next push; the others are not.
        tried.clear();
        stops.act(&escaped, &limits, |_| 0, |p| {
            tried.push(p.pid);
            Some(Ok(()))
        });
        assert_eq!((tried, stops.signals), (vec![1], 2));
    }

    /// Who is stopped in a cgroup over its limit, case by case: (case, holders as the pass saw
    /// them, the probes' live bytes now, the limit, the pids signalled).
    #[test]
    fn who_is_stopped_when_a_cgroup_is_over_its_limit() {
        const MIB: u64 = 1 << 20;
        // (pid, held on two reads, of it unadmitted by any ledger, live at the pass)
        let h = |pid, held, unadmitted, live| Holder { pid, start_time: u64::from(pid), held, unadmitted, live, escaped: 0 };
        // The same, with bytes the probes cannot see.
        let e = |pid, held, unadmitted, live, escaped| Holder { escaped, ..h(pid, held, unadmitted, live) };
        let sorted = |mut holders: Vec<Holder>| {
            holders.sort_by_key(Holder::stop_order);
            holders
        };
        /// (case, holders, probed now, limit, pids signalled)
        type Case = (&'static str, Vec<Holder>, u64, u64, Vec<u32>);
        #[rustfmt::skip]
        let cases: [Case; 10] = [
            ("a hooked pool keeps 600 MiB (its ledger charges it), an un-hooked process takes 500 beside it",
                vec![h(1, 600 * MIB, 0, 0), h(2, 500 * MIB, 500 * MIB, 500 * MIB)], 500 * MIB, 1024 * MIB, vec![2]),
            ("an un-hooked pool's owner keeps 600, an un-hooked process takes 500: the larger unadmitted goes",
                vec![h(1, 600 * MIB, 600 * MIB, 0), h(2, 500 * MIB, 500 * MIB, 500 * MIB)], 500 * MIB, 1024 * MIB, vec![1]),
            ("the owner took its 600 back beside the un-hooked 400: 1000 MiB on both reads, within",
                vec![h(1, 600 * MIB, 0, 600 * MIB), h(2, 400 * MIB, 400 * MIB, 400 * MIB)], 1000 * MIB, 1024 * MIB, vec![]),
            ("new memory on a kept figure the pool had given back: 1.1 GiB on both reads",
                vec![h(3, 1100 * MIB, 1100 * MIB, 1100 * MIB)], 1100 * MIB, 1024 * MIB, vec![3]),
            ("the un-hooked process freed its 500 since the pass: the probes see it leave",
                vec![h(2, 500 * MIB, 500 * MIB, 500 * MIB), h(1, 600 * MIB, 0, 0)], 0, 1024 * MIB, vec![]),
            ("memory the hook charges and the probes cannot see (arrays) beside an un-hooked taker: the taker goes",
                vec![e(4, 3072 * MIB, 0, 1024 * MIB, 2048 * MIB), h(5, 4096 * MIB, 0, 0), h(6, 4096 * MIB, 4096 * MIB, 4096 * MIB)], 5120 * MIB, 10240 * MIB, vec![6]),
            ("through a copy no probe is on (94 MiB) beside a larger probed un-hooked neighbour (950): the escaper goes",
                vec![h(11, 950 * MIB, 950 * MIB, 950 * MIB), e(12, 94 * MIB, 94 * MIB, 0, 94 * MIB)], 950 * MIB, 1024 * MIB, vec![12]),
            ("a limit below what the ledger admits: the admitted process is stopped too",
                vec![h(7, 4096 * MIB, 0, 4096 * MIB)], 4096 * MIB, 3072 * MIB, vec![7]),
            ("unadmitted first, largest first, then the admitted, until within",
                vec![h(8, 900 * MIB, 0, 900 * MIB), h(9, 300 * MIB, 300 * MIB, 300 * MIB), h(10, 200 * MIB, 100 * MIB, 200 * MIB)], 1400 * MIB, 512 * MIB, vec![9, 10, 8]),
            ("nothing over: nobody",
                vec![h(1, 600 * MIB, 0, 0), h(2, 424 * MIB, 424 * MIB, 424 * MIB)], 424 * MIB, 1024 * MIB, vec![]),
        ];
        for (case, holders, probed, limit, expected) in cases {
            let holders = HoldersByCgroup::from([(9, sorted(holders))]);
            let mut stops = Stops::default();
            let mut stopped = Vec::new();
            stops.act(&holders, &BTreeMap::from([(9, limit)]), |_| probed, |p| {
                stopped.push(p.pid);
                Some(Ok(()))
            });
            assert_eq!(stopped, expected, "{case}");
            let mut why = [0u64; 3];
            for p in holders[&9].iter().filter(|p| expected.contains(&p.pid)) {
                why[usize::from(p.stop_order().0)] += 1;
            }
            assert_eq!(stops.by_why, why, "{case}");
        }
    }

    #[test]
    fn escaped_bytes_come_off_the_probes_limit_only_where_the_agent_does_not_signal() {
        const MIB: u64 = 1 << 20;
        let process = |pid, bytes| Holder { pid, start_time: 1, escaped: bytes, held: bytes, unadmitted: bytes, ..Holder::default() };
        let processes = [process(1, 300 * MIB), process(2, 100 * MIB)];
        let none = std::collections::BTreeSet::new();
        // Audit: all of it (what passes the rest is counted).
        assert_eq!(off_the_limit(enforce::AUDIT, &processes, &none), 400 * MIB);
        // Signal: none; the agent stops the processes over the limit, never the next allocator.
        assert_eq!(off_the_limit(enforce::SIGNAL, &processes, &none), 0);
        // But what a process the agent cannot signal holds does.
        assert_eq!(off_the_limit(enforce::SIGNAL, &processes, &std::collections::BTreeSet::from([(2, 1)])), 100 * MIB);
    }

    #[test]
    fn rules_and_their_errors() {
        let rules = parse_rules("# comment\n/a/* 8g\n\n/b 1024 # trailing\n").expect("rules");
        assert_eq!(rules, vec![Rule { pattern: "/a/*".into(), limit: 8 << 30 }, Rule { pattern: "/b".into(), limit: 1024 }]);
        assert!(parse_rules("/a lots").unwrap_err().to_string().contains("line 1"));
        assert!(parse_rules("a 1g").unwrap_err().to_string().contains("must be a cgroup2 path"));
        assert!(parse_rules("/a 1g extra").is_err());
    }
}
