//! The user-space half of the eBPF accounting: owns the maps taken out of the loaded object,
//! reads the exits on `EXITS` (which wakes the agent; allocations and frees are not events,
//! the maps and the kernel's counters say them), deletes the allocation and mapping records
//! of dead processes, and builds [`Snapshot`]s.
//!
//! Usage is kept by the kernel side (`PROC_USAGE`, `CGROUP_USAGE`) and a process's usage is
//! dropped by the `process_exit` tracepoint the moment it dies. What is left to user space
//! is its records in `ALLOCS`: a record whose process entry is gone, or belongs to a newer
//! process with the same pid, is stale. The sweep deletes those; it runs after every exit
//! event and on a timer, so a lost event delays the clean-up but never loses it. Imported
//! external memory, kept apart and never charged, is [`super::extmem`]'s, swept
//! with them.
use std::{collections::BTreeMap, fs, time::Instant};

use anyhow::{anyhow, Context, Result};
use aya::{
    maps::{HashMap, MapData, RingBuf},
    Ebpf,
};
use common::{names, spare, stat, AddrSpace, AllocKey, AllocKind, AllocRecord, CgroupUsage, Event, EventKind, ProcUsage, Usage};

use super::{extmem::External, trouble::Counters};
use crate::{
    cgroup::CgroupNames,
    reconcile::EbpfProcess,
    snapshot::{BytesByKind, CgroupRow, KernelMaps, ProcessRow, Snapshot, Stats},
};

pub struct Accounting {
    allocs: HashMap<MapData, AllocKey, AllocRecord>,
    procs: HashMap<MapData, u32, ProcUsage>,
    cgroups: HashMap<MapData, u64, CgroupUsage>,
    counters: Counters,
    external: External,
    /// Live records a cgroup may have (the probes' `MAX_RECORDS_PER_CGROUP`).
    records_cap: u64,
    names: CgroupNames,
    stats: Stats,
    /// Set by an exit event: the next [`Accounting::sweep`] is due now.
    exits_pending: bool,
    /// The eBPF side's lost-exit count at the last drain.
    lost_seen: u64,
    /// Processes whose exit event arrived since the last [`Accounting::take_exits`], with the
    /// time it arrived (the reclaim of their ledger slots is timed from it).
    exited: Vec<(u32, Instant)>,
}

impl Accounting {
    /// Takes the accounting maps and the exit ring buffer out of the loaded object, which was
    /// loaded with `records_cap` as its per-cgroup cap.
    pub fn new(ebpf: &mut Ebpf, records_cap: u64) -> Result<(Accounting, RingBuf<MapData>)> {
        let accounting = Accounting {
            allocs: take(ebpf, names::ALLOCS)?,
            procs: take(ebpf, names::PROC_USAGE)?,
            cgroups: take(ebpf, names::CGROUP_USAGE)?,
            counters: Counters::new(take(ebpf, names::STATS)?),
            external: External::new(ebpf)?,
            records_cap,
            names: CgroupNames::new(),
            stats: Stats::default(),
            exits_pending: false,
            lost_seen: 0,
            exited: Vec::new(),
        };
        Ok((accounting, take(ebpf, names::EXITS)?))
    }

    /// Consumes every queued exit, and notes whether allocations or frees happened since the
    /// last drain; returns how many exits there were plus 1 if the maps changed.
    pub fn drain(&mut self, exits: &mut RingBuf<MapData>) -> usize {
        let lost = self.counters.get(stat::EXITS_LOST);
        if lost != self.lost_seen {
            // Exits were lost: the sweep finds their processes gone.
            self.lost_seen = lost;
            self.exits_pending = true;
        }
        let (allocs, frees) = (self.counters.get(stat::ALLOCS_SEEN), self.counters.get(stat::FREES_SEEN));
        let changed = (allocs, frees) != (self.stats.events_alloc, self.stats.events_free);
        self.stats.events_alloc = allocs;
        self.stats.events_free = frees;
        self.drain_ring(exits) + usize::from(changed)
    }

    fn drain_ring(&mut self, ring: &mut RingBuf<MapData>) -> usize {
        let mut drained = 0;
        while let Some(item) = ring.next() {
            drained += 1;
            if item.len() < size_of::<Event>() {
                continue;
            }
            // SAFETY: the item holds at least size_of::<Event>() bytes written by the eBPF
            // side as an Event (plain integers, any bit pattern valid); read unaligned.
            let event: Event = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
            match event.event {
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
        self.stats.stale_records_removed += self.external.sweep();
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
                pool_kept: usage.pool_kept(),
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
                unrecorded: usage.unrecorded,
                ..ProcessRow::default()
            });
        }
        processes.sort_by_key(|row| row.pid);
        let mut cgroups: Vec<CgroupRow> = Vec::new();
        let rows: Vec<(u64, Usage)> = self.cgroups.iter().filter_map(Result::ok).map(|(id, entry)| (id, entry.usage)).collect();
        for (cgroup_id, usage) in rows {
            if usage.total_bytes() == 0 && usage.live_records() == 0 && usage.unrecorded == 0 {
                continue;
            }
            cgroups.push(CgroupRow {
                capped: is_capped(&usage, self.records_cap),
                unrecorded: usage.unrecorded,
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
        for (key, record) in self.allocs.iter().filter_map(Result::ok) {
            stats.records += 1;
            if key.space == AddrSpace::Pointer as u32 && record.link & spare::STATE == spare::SPARE {
                stats.spare_records += 1;
            }
        }
        self.counters.fill(&mut stats);
        stats.records_cap = self.records_cap;
        let mut kernel_maps = KernelMaps { cgroup_usage: self.cgroups.keys().filter_map(Result::ok).collect(), ..KernelMaps::default() };
        kernel_maps.cgroup_usage.sort_unstable();
        let external_memory = self.external.view(&mut self.names);
        Snapshot { processes, cgroups, stats, kernel_maps, external_memory, ..Snapshot::default() }
    }

    /// The live bytes the probes charge `cgroup` (what the entry probes compare with its
    /// limit); 0 without an entry.
    pub fn cgroup_bytes(&self, cgroup: u64) -> u64 {
        self.cgroups.get(&cgroup, 0).map_or(0, |entry| entry.usage.total_bytes())
    }

    /// The ids of the cgroups with an entry in `CGROUP_USAGE` (or `EXTMEM_CGROUPS`).
    pub fn cgroup_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.cgroups.keys().filter_map(Result::ok).collect();
        ids.extend(self.external.cgroup_ids());
        ids
    }

    /// Counts map entries of removed cgroups the agent's sweep deleted.
    pub fn swept_cgroup_entries(&mut self, entries: usize) {
        self.stats.cgroup_entries_swept += entries as u64;
    }

    /// Deletes the `CGROUP_USAGE` (and `EXTMEM_CGROUPS`) entries of these (removed) cgroups;
    /// returns how many went.
    pub fn forget_cgroups(&mut self, ids: &[u64]) -> usize {
        ids.iter().filter(|id| self.cgroups.remove(id).is_ok()).count() + self.external.forget_cgroups(ids)
    }
}

/// Whether a cgroup holds at least its cap of live records (allocations and VMM mappings) and
/// unrecorded allocations: it is at its cap, or was and still holds what it allocated past it.
pub fn is_capped(usage: &Usage, cap: u64) -> bool {
    // The counters are updated without a lock: frees may briefly run ahead of allocations.
    let live = u64::try_from(usage.live_records() as i64).unwrap_or(0);
    live.saturating_add(usage.unrecorded) >= cap
}

fn by_kind(usage: &Usage) -> BytesByKind {
    AllocKind::ALL
        .iter()
        .map(|kind| (kind.name().to_string(), usage.bytes[*kind as usize]))
        .collect::<BTreeMap<_, _>>()
}

pub(crate) fn take<T>(ebpf: &mut Ebpf, name: &str) -> Result<T>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or_else(|| anyhow!("the embedded eBPF object has no map `{name}`"))?;
    T::try_from(map).with_context(|| format!("map `{name}` has an unexpected type"))
}
