//! The user-space half of the eBPF accounting: owns the maps taken out of the loaded object,
//! reads the exits on `EXITS` (which wakes the agent; allocations and frees are not events,
//! the maps and the kernel's counters say them), deletes the allocation and mapping records
//! of dead processes, and builds [`Snapshot`]s.
//!
//! Usage is kept by the kernel side (`PROC_USAGE`, `CGROUP_USAGE`) and a process's usage is
//! dropped by the `process_exit` tracepoint the moment it dies. What is left to user space
//! is its records in `ALLOCS`: a record whose process entry is gone, or belongs to a newer
//! process with the same pid, is stale. An exit costs a sweep of the dead process's own
//! records, never of the others': the probes journal the key of every record they insert
//! (`JOURNAL`, read at each drain, before the exits it drained are swept), from which the
//! agent keeps the keys of each process ([`super::index`]); at an exit it looks up exactly
//! those and deletes the stale ones (`records_swept_by_exit` counts the records it examined).
//! Only when that index may miss a record (journal entries lost to a full ring, exits lost,
//! keys past the index's cap) does the `--sweep-ms` timer sweep the whole map once and
//! rebuild the index from it (`full_sweeps`, `records_swept_full`). Imported external memory,
//! kept apart and never charged, is [`super::extmem`]'s, swept with them.
use std::{collections::BTreeMap, fs, time::Instant};

use anyhow::{anyhow, Context, Result};
use aya::{
    maps::{HashMap, IterableMap, MapData, RingBuf},
    Ebpf,
};
use common::{journal, names, stat, AllocKey, AllocKind, AllocRecord, CgroupUsage, Event, EventKind, ProcUsage, Usage};

use super::{extmem::External, index::Index, trouble::Counters};
use crate::{
    cgroup::CgroupNames,
    snapshot::{BytesByKind, CgroupRow, EbpfProcess, KernelMaps, ProcessRow, Snapshot, Stats},
};

pub struct Accounting {
    allocs: HashMap<MapData, AllocKey, AllocRecord>,
    procs: HashMap<MapData, u32, ProcUsage>,
    cgroups: HashMap<MapData, u64, CgroupUsage>,
    counters: Counters,
    external: External,
    /// Live records a cgroup may have (the probes' `MAX_RECORDS_PER_CGROUP`).
    records_cap: u64,
    stats: Stats,
    /// The keys of new records, from the probes.
    journal: RingBuf<MapData>,
    /// Record keys by process, from the journal.
    index: Index,
    /// Processes whose exit arrived and whose records are not swept yet.
    to_sweep: Vec<u32>,
    /// The index may miss records: the next [`Accounting::sweep_missed`] sweeps everything.
    full_due: bool,
    /// The eBPF side's lost-exit and lost-journal counts at the last look.
    lost_seen: (u64, u64),
    /// Processes whose exit event arrived since the last [`Accounting::take_exits`], with the
    /// time of the exit itself (the reclaim of their ledger slots is timed from it).
    exited: Vec<(u32, Instant)>,
    /// Records the agent deleted from `ALLOCS`.
    allocs_removed: u64,
    /// The tree's change count and when removed cgroups' entries were last swept.
    cgroups_swept: Option<(u64, Instant)>,
    /// Each process's command name as first read (`/proc/<pid>/comm`), by its generation:
    /// read once per process, not at every view (those of processes gone are dropped).
    comms: std::collections::HashMap<u32, (u64, String)>,
}

impl Accounting {
    /// Takes the accounting maps and the exit ring buffer out of the loaded object, which was
    /// loaded with `records_cap` as its per-cgroup cap.
    pub fn new(ebpf: &mut Ebpf, records_cap: u64) -> Result<(Accounting, RingBuf<MapData>)> {
        let allocs: HashMap<MapData, AllocKey, AllocRecord> = take(ebpf, names::ALLOCS)?;
        // Room for every record the maps can hold, twice over (a process's keys are compacted
        // at twice its live records), and a compaction's worth per process.
        let max_allocs = allocs.map().info().map_or(common::DEFAULT_MAX_ALLOCS, |info| info.max_entries()) as usize;
        let index_cap = 2 * (max_allocs + common::extmem::MAX_RECORDS as usize) + super::index::MIN_COMPACT * common::MAX_PROCS as usize;
        let accounting = Accounting {
            allocs,
            procs: take(ebpf, names::PROC_USAGE)?,
            cgroups: take(ebpf, names::CGROUP_USAGE)?,
            counters: Counters::new(take(ebpf, names::STATS)?),
            external: External::new(ebpf)?,
            records_cap,
            stats: Stats::default(),
            journal: take(ebpf, names::JOURNAL)?,
            index: Index::new(index_cap),
            to_sweep: Vec::new(),
            full_due: false,
            lost_seen: (0, 0),
            exited: Vec::new(),
            allocs_removed: 0,
            cgroups_swept: None,
            comms: std::collections::HashMap::new(),
        };
        Ok((accounting, take(ebpf, names::EXITS)?))
    }

    /// Consumes every queued exit and journaled record, and notes whether allocations or
    /// frees happened since the last drain; returns how many exits there were plus 1 if the
    /// maps changed.
    pub fn drain(&mut self, exits: &mut RingBuf<MapData>) -> usize {
        self.note_losses();
        let (allocs, frees) = (self.counters.get(stat::ALLOCS_SEEN), self.counters.get(stat::FREES_SEEN));
        let changed = (allocs, frees) != (self.stats.events_alloc, self.stats.events_free);
        self.stats.events_alloc = allocs;
        self.stats.events_free = frees;
        let drained = self.drain_ring(exits);
        // After the exits: a process's records were all journaled before its exit was queued.
        self.drain_journal();
        drained + usize::from(changed)
    }

    /// Exits or journal entries lost since the last look make a full sweep due.
    fn note_losses(&mut self) {
        let lost = (self.counters.get(stat::EXITS_LOST), self.counters.get(stat::JOURNAL_LOST));
        if lost != self.lost_seen {
            self.lost_seen = lost;
            self.full_due = true;
        }
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
                    self.to_sweep.push(event.tgid);
                    self.exited.push((event.tgid, instant_of(event.at_ns)));
                }
                e if e == EventKind::ExternalExit as u32 => self.to_sweep.push(event.tgid),
                _ => {}
            }
        }
        drained
    }

    /// Reads the journal into the index, compacting a process's keys when they are due.
    fn drain_journal(&mut self) {
        let mut due = Vec::new();
        while let Some(item) = self.journal.next() {
            if item.len() < size_of::<AllocKey>() {
                continue;
            }
            // SAFETY: the item holds at least size_of::<AllocKey>() bytes written by the eBPF
            // side as an AllocKey (plain integers, any bit pattern valid); read unaligned.
            let key: AllocKey = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
            if let Some(tgid) = self.index.add(&key) {
                due.push(tgid);
            }
        }
        due.sort_unstable();
        due.dedup();
        for tgid in due {
            let keys = self.index.take(tgid);
            let live = keys.into_iter().filter(|key| self.has_record(tgid, *key)).collect();
            self.index.put_back(tgid, live);
        }
        if !self.index.complete() && !self.full_due {
            self.full_due = true;
            tracing::warn!(cap = self.index.keys_held(), "the index of records by process is full: the records of exited processes are swept by the next full sweep (--sweep-ms)");
        }
    }

    fn has_record(&self, tgid: u32, (space, addr): super::index::Key) -> bool {
        if space == journal::EXTERNAL {
            return self.external.has(tgid, addr);
        }
        self.allocs.get(&AllocKey { tgid, space, addr }, 0).is_ok()
    }

    /// The processes whose exit events arrived since the last call.
    pub fn take_exits(&mut self) -> Vec<(u32, Instant)> {
        std::mem::take(&mut self.exited)
    }

    /// Whether an exit was seen since the last sweep.
    pub fn sweep_due(&self) -> bool {
        !self.to_sweep.is_empty()
    }

    /// Deletes the stale records of the processes whose exits arrived: their own records
    /// only, looked up by their keys in the index.
    pub fn sweep(&mut self) {
        let mut exited = std::mem::take(&mut self.to_sweep);
        exited.sort_unstable();
        exited.dedup();
        for tgid in exited {
            let keys = self.index.take(tgid);
            self.stats.records_swept_by_exit += keys.len() as u64;
            let mut live = Vec::new();
            for key in keys {
                match self.sweep_record(tgid, key) {
                    Some(true) => {
                        self.stats.stale_records_removed += 1;
                        self.allocs_removed += u64::from(key.0 != journal::EXTERNAL);
                    }
                    Some(false) => live.push(key), // a newer process's with this pid
                    None => {}
                }
            }
            self.index.put_back(tgid, live);
        }
    }

    /// Deletes record `key` of process `tgid` if it is stale: `Some(true)` if it went,
    /// `Some(false)` if it is live, `None` if there is none.
    fn sweep_record(&mut self, tgid: u32, (space, addr): super::index::Key) -> Option<bool> {
        if space == journal::EXTERNAL {
            return self.external.sweep_one(tgid, addr);
        }
        let key = AllocKey { tgid, space, addr };
        let record = self.allocs.get(&key, 0).ok()?;
        if self.is_stale(&key, &record) {
            return Some(self.allocs.remove(&key).is_ok());
        }
        Some(false)
    }

    /// Whether `record` (read before this call) is of a process that is gone: looked up after
    /// the record was read, as a record is only ever written after its process entry exists,
    /// so a missing entry means the process has exited.
    fn is_stale(&self, key: &AllocKey, record: &AllocRecord) -> bool {
        self.procs.get(&key.tgid, 0).ok().is_none_or(|p| p.generation != record.generation)
    }

    /// The `--sweep-ms` tick: if the index may miss records (exits or journal entries lost,
    /// the index at its cap), sweeps every record of every process and rebuilds the index from
    /// those left; else nothing.
    pub fn sweep_missed(&mut self) {
        self.note_losses();
        if !self.full_due {
            return;
        }
        // Losses from here on make the next tick sweep again.
        self.full_due = false;
        self.stats.full_sweeps += 1;
        let records: Vec<(AllocKey, AllocRecord)> = super::batch::entries(&self.allocs);
        let mut live = Vec::with_capacity(records.len());
        for (key, record) in &records {
            if !self.is_stale(key, record) {
                live.push(*key);
            } else if self.allocs.remove(key).is_ok() {
                self.stats.stale_records_removed += 1;
                self.allocs_removed += 1;
            }
        }
        let (examined, removed) = self.external.sweep(&mut live);
        self.stats.records_swept_full += records.len() as u64 + examined;
        self.stats.stale_records_removed += removed;
        self.index.rebuild(live);
        tracing::warn!(
            records = records.len() as u64 + examined,
            indexed = self.index.keys_held(),
            exits_lost = self.lost_seen.0,
            journal_lost = self.lost_seen.1,
            index_overflows = self.index.overflows,
            "swept every allocation record: exits or new records' keys were lost (a full ring: raise --journal-bytes if journal_lost grows) or the index was full"
        );
    }

    /// Whether removed cgroups' entries are due for a sweep: the tree changed since the last
    /// one (`changes`: its change count; `None`: not counted, always due), or the last is
    /// [`crate::cgroup::SAFETY_WALK`] old. Notes the sweep as done.
    pub fn cgroup_sweep_due(&mut self, changes: Option<u64>) -> bool {
        let Some(now) = changes else { return true };
        if self.cgroups_swept.is_some_and(|(count, at)| count == now && at.elapsed() < crate::cgroup::SAFETY_WALK) {
            return false;
        }
        self.cgroups_swept = Some((now, Instant::now()));
        true
    }

    /// The current view, with the cgroups' paths from `names`, and every process the probes
    /// saw allocate (the eBPF side of [`crate::reconcile`]), from one read of `PROC_USAGE`.
    pub fn snapshot(&mut self, names: &mut CgroupNames) -> (Snapshot, Vec<EbpfProcess>) {
        let mut processes: Vec<ProcessRow> = Vec::new();
        let procs: Vec<(u32, ProcUsage)> = super::batch::entries(&self.procs);
        let ebpf = procs
            .iter()
            .map(|(pid, usage)| EbpfProcess {
                pid: *pid,
                generation: usage.generation,
                cgroup_id: usage.cgroup_id,
                bytes: usage.usage.total_bytes(),
                pool_kept: usage.pool_kept(),
            })
            .collect();
        let mut comms = std::mem::take(&mut self.comms);
        for (pid, proc_usage) in procs {
            let usage = &proc_usage.usage;
            let comm = match comms.remove(&pid).filter(|(generation, _)| *generation == proc_usage.generation) {
                Some((_, comm)) => comm,
                None => fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| c.trim_end().to_string()).unwrap_or_default(),
            };
            self.comms.insert(pid, (proc_usage.generation, comm.clone()));
            processes.push(ProcessRow {
                pid,
                comm,
                cgroup_id: proc_usage.cgroup_id,
                cgroup: names.path(proc_usage.cgroup_id).unwrap_or_default(),
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
        let rows: Vec<(u64, Usage)> = super::batch::entries(&self.cgroups).into_iter().map(|(id, entry)| (id, entry.usage)).collect();
        let spares = rows.iter().fold(0u64, |sum, (_, usage)| sum.wrapping_add(usage.spares));
        for (cgroup_id, usage) in rows {
            if usage.total_bytes() == 0 && usage.live_records() == 0 && usage.unrecorded == 0 {
                continue;
            }
            cgroups.push(CgroupRow {
                capped: is_capped(&usage, self.records_cap),
                unrecorded: usage.unrecorded,
                cgroup_id,
                cgroup: names.path(cgroup_id).unwrap_or_default(),
                bytes: by_kind(&usage),
                total_bytes: usage.total_bytes(),
                live_allocations: usage.live_allocations(),
                allocs: usage.allocs,
                frees: usage.frees,
            });
        }
        cgroups.sort_by_key(|row| row.cgroup_id);
        let mut stats = self.stats.clone();
        // Counted, not read through: the probes count the records they insert and delete, the
        // agent those it deletes; the spares are the cgroups' (a dead process's leave its
        // cgroup's count at its exit, and the map at its sweep).
        let (added, deleted) = (self.counters.get(stat::RECORDS_ADDED), self.counters.get(stat::RECORDS_DELETED));
        stats.records = u64::try_from(added.wrapping_sub(deleted).wrapping_sub(self.allocs_removed) as i64).unwrap_or(0);
        stats.spare_records = u64::try_from(spares as i64).unwrap_or(0);
        self.counters.fill(&mut stats);
        stats.records_cap = self.records_cap;
        stats.record_index_keys = self.index.keys_held() as u64;
        stats.record_index_overflows = self.index.overflows;
        stats.cgroup_tree_walks = names.watch().walks();
        stats.cgroup_tree_changes = names.watch().changes().unwrap_or(0);
        let mut kernel_maps = KernelMaps { cgroup_usage: self.cgroups.keys().filter_map(Result::ok).collect(), ..KernelMaps::default() };
        kernel_maps.cgroup_usage.sort_unstable();
        let external_memory = self.external.view(names);
        (Snapshot { processes, cgroups, stats, kernel_maps, external_memory, ..Snapshot::default() }, ebpf)
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

/// The [`Instant`] of a `bpf_ktime_get_ns` time (both are CLOCK_MONOTONIC); now, for a time
/// ahead of now (which a correct kernel never gives).
pub fn instant_of(ktime_ns: u64) -> Instant {
    let now = Instant::now();
    let Ok(clock) = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) else { return now };
    let clock_ns = (clock.tv_sec() as u64).saturating_mul(1_000_000_000).saturating_add(clock.tv_nsec() as u64);
    now.checked_sub(std::time::Duration::from_nanos(clock_ns.saturating_sub(ktime_ns))).unwrap_or(now)
}

/// `bytes` if it can size the `JOURNAL` ring buffer (a power of two, at least a page).
pub fn journal_bytes(bytes: u32) -> Result<u32> {
    if !bytes.is_power_of_two() || bytes < 4096 {
        anyhow::bail!("--journal-bytes {bytes}: must be a power of two of at least 4096");
    }
    Ok(bytes)
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::instant_of;

    #[test]
    fn a_kernel_time_is_the_instant_it_names() {
        let clock = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("clock");
        let clock_ns = clock.tv_sec() as u64 * 1_000_000_000 + clock.tv_nsec() as u64;
        let before = Instant::now();
        let at = instant_of(clock_ns - 250_000_000);
        let ago = before.saturating_duration_since(at);
        assert!(ago >= Duration::from_millis(240) && ago <= Duration::from_millis(400), "{ago:?}");
        assert!(instant_of(u64::MAX) <= Instant::now(), "a time ahead of now is now");
    }
}
