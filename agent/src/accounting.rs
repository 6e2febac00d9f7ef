//! The user-space half of the eBPF accounting: owns the maps taken out of the loaded object,
//! counts the ring buffer's events, deletes the allocation records of dead processes, and
//! builds [`Snapshot`]s.
//!
//! Usage is kept by the kernel side (`PROC_USAGE`, `CGROUP_USAGE`) and a process's usage is
//! dropped by the `process_exit` tracepoint the moment it dies. What is left to user space
//! is its records in `ALLOCS`: a record whose process entry is gone, or belongs to a newer
//! process with the same pid, is stale. The sweep deletes those; it runs after every exit
//! event and on a timer, so a lost event delays the clean-up but never loses it.
use std::{collections::BTreeMap, fs, time::Instant};

use anyhow::{anyhow, Context, Result};
use aya::{
    maps::{Array, HashMap, MapData, RingBuf},
    Ebpf,
};
use common::{names, stat, AllocKey, AllocKind, AllocRecord, Event, EventKind, ProcUsage, Usage};

use crate::{
    cgroup::CgroupNames,
    reconcile::EbpfProcess,
    snapshot::{BytesByKind, CgroupRow, ProcessRow, Snapshot, Stats},
};

pub struct Accounting {
    allocs: HashMap<MapData, AllocKey, AllocRecord>,
    procs: HashMap<MapData, u32, ProcUsage>,
    cgroups: HashMap<MapData, u64, Usage>,
    counters: Array<MapData, u64>,
    names: CgroupNames,
    stats: Stats,
    /// Set by an exit event: the next [`Accounting::sweep`] is due now.
    exits_pending: bool,
    /// The eBPF side's lost-event count at the last drain: a lost event may be an exit.
    lost_seen: u64,
    /// Processes whose exit event arrived since the last [`Accounting::take_exits`], with the
    /// time it arrived (the reclaim of their ledger slots is timed from it).
    exited: Vec<(u32, Instant)>,
}

impl Accounting {
    /// Takes the accounting maps and the event ring buffer out of the loaded object.
    pub fn new(ebpf: &mut Ebpf) -> Result<(Accounting, RingBuf<MapData>)> {
        let accounting = Accounting {
            allocs: take(ebpf, names::ALLOCS)?,
            procs: take(ebpf, names::PROC_USAGE)?,
            cgroups: take(ebpf, names::CGROUP_USAGE)?,
            counters: take(ebpf, names::STATS)?,
            names: CgroupNames::new(),
            stats: Stats::default(),
            exits_pending: false,
            lost_seen: 0,
            exited: Vec::new(),
        };
        Ok((accounting, take(ebpf, names::EVENTS)?))
    }

    /// Consumes every queued event; returns how many there were.
    pub fn drain(&mut self, events: &mut RingBuf<MapData>) -> usize {
        let mut drained = 0;
        let lost = self.counter(stat::EVENTS_LOST);
        if lost != self.lost_seen {
            self.lost_seen = lost;
            self.exits_pending = true;
        }
        while let Some(item) = events.next() {
            drained += 1;
            if item.len() < size_of::<Event>() {
                continue;
            }
            // SAFETY: the item holds at least size_of::<Event>() bytes written by the eBPF
            // side as an Event (plain integers, any bit pattern valid); read unaligned.
            let event: Event = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
            match event.event {
                e if e == EventKind::Alloc as u32 => self.stats.events_alloc += 1,
                e if e == EventKind::Free as u32 => self.stats.events_free += 1,
                e if e == EventKind::Exit as u32 => {
                    tracing::debug!(
                        pid = event.tgid,
                        thread = event.tid,
                        bytes = event.size,
                        "process with GPU memory exited"
                    );
                    self.stats.events_exit += 1;
                    self.exits_pending = true;
                    self.exited.push((event.tgid, Instant::now()));
                }
                _ => {}
            }
        }
        drained
    }

    /// The processes whose exit events arrived since the last call.
    pub fn take_exits(&mut self) -> Vec<(u32, Instant)> {
        std::mem::take(&mut self.exited)
    }

    /// Whether an exit was seen since the last sweep.
    pub fn sweep_due(&self) -> bool {
        self.exits_pending
    }

    /// Deletes the records of processes that are gone.
    pub fn sweep(&mut self) {
        self.exits_pending = false;
        let records: Vec<(AllocKey, AllocRecord)> = self.allocs.iter().filter_map(Result::ok).collect();
        for (key, record) in records {
            // Looked up after the record was read: a record is only ever written after its
            // process entry exists, so a missing entry means the process has exited.
            let current = self.procs.get(&key.tgid, 0).ok();
            if current.is_none_or(|p| p.generation != record.generation)
                && self.allocs.remove(&key).is_ok()
            {
                self.stats.stale_records_removed += 1;
            }
        }
    }

    /// Every process the probes saw allocate: the eBPF side of [`crate::reconcile`], cheaper
    /// than a [`Snapshot`].
    pub fn processes(&self) -> Vec<EbpfProcess> {
        self.procs
            .iter()
            .filter_map(Result::ok)
            .map(|(pid, usage)| EbpfProcess {
                pid,
                generation: usage.generation,
                cgroup_id: usage.cgroup_id,
                bytes: usage.usage.total_bytes(),
            })
            .collect()
    }

    /// The current view.
    pub fn snapshot(&mut self) -> Snapshot {
        let mut processes: Vec<ProcessRow> = Vec::new();
        let procs: Vec<(u32, ProcUsage)> = self.procs.iter().filter_map(Result::ok).collect();
        for (pid, proc_usage) in procs {
            let usage = &proc_usage.usage;
            processes.push(ProcessRow {
                pid,
                comm: fs::read_to_string(format!("/proc/{pid}/comm"))
                    .map(|c| c.trim_end().to_string())
                    .unwrap_or_default(),
                cgroup_id: proc_usage.cgroup_id,
                cgroup: self.names.path(proc_usage.cgroup_id).unwrap_or_default(),
                bytes: by_kind(usage),
                total_bytes: usage.total_bytes(),
                live_allocations: usage.live_allocations(),
                allocs: usage.allocs,
                frees: usage.frees,
                ..ProcessRow::default()
            });
        }
        processes.sort_by_key(|row| row.pid);
        let mut cgroups: Vec<CgroupRow> = Vec::new();
        let rows: Vec<(u64, Usage)> = self.cgroups.iter().filter_map(Result::ok).collect();
        for (cgroup_id, usage) in rows {
            if usage.total_bytes() == 0 && usage.live_allocations() == 0 {
                continue;
            }
            cgroups.push(CgroupRow {
                cgroup_id,
                cgroup: self.names.path(cgroup_id).unwrap_or_default(),
                bytes: by_kind(&usage),
                total_bytes: usage.total_bytes(),
                live_allocations: usage.live_allocations(),
                allocs: usage.allocs,
                frees: usage.frees,
            });
        }
        cgroups.sort_by_key(|row| row.cgroup_id);
        let mut stats = self.stats.clone();
        stats.records = self.allocs.keys().filter(Result::is_ok).count() as u64;
        stats.events_lost = self.counter(stat::EVENTS_LOST);
        stats.untracked_allocs = self.counter(stat::UNTRACKED_ALLOCS);
        stats.orphan_returns = self.counter(stat::ORPHAN_RETURNS);
        stats.over_limit = self.counter(stat::OVER_LIMIT);
        stats.signals_sent = self.counter(stat::SIGNALS_SENT);
        Snapshot { processes, cgroups, stats, ..Snapshot::default() }
    }

    fn counter(&self, index: u32) -> u64 {
        self.counters.get(&index, 0).unwrap_or(0)
    }
}

fn by_kind(usage: &Usage) -> BytesByKind {
    AllocKind::ALL
        .iter()
        .map(|kind| (kind.name().to_string(), usage.bytes[*kind as usize]))
        .collect::<BTreeMap<_, _>>()
}

fn take<T>(ebpf: &mut Ebpf, name: &str) -> Result<T>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or_else(|| anyhow!("the embedded eBPF object has no map `{name}`"))?;
    T::try_from(map).with_context(|| format!("map `{name}` has an unexpected type"))
}
