//! The kernel side's counters (`STATS`, one value per CPU): lost events and journal entries,
//! full maps, records refused by the per-cgroup cap, suppressed log lines, removed cgroups. The agent sums the
//! CPUs and reports the totals in `vramguard audit`'s stats and as metrics.
use aya::maps::{MapData, PerCpuArray};
use common::stat;

use crate::snapshot::Stats;

/// The `STATS` map.
pub struct Counters {
    map: PerCpuArray<MapData, u64>,
}

impl Counters {
    pub fn new(map: PerCpuArray<MapData, u64>) -> Counters {
        Counters { map }
    }

    /// Counter `index` summed over every CPU (0 if it cannot be read).
    pub fn get(&self, index: u32) -> u64 {
        self.map.get(&index, 0).map_or(0, |values| values.iter().fold(0u64, |sum, v| sum.wrapping_add(*v)))
    }

    /// Copies every kernel-side counter into `stats`.
    pub fn fill(&self, stats: &mut Stats) {
        stats.events_lost = self.get(stat::EVENTS_LOST);
        stats.untracked_allocs = self.get(stat::UNTRACKED_ALLOCS);
        stats.orphan_returns = self.get(stat::ORPHAN_RETURNS);
        stats.over_limit = self.get(stat::OVER_LIMIT);
        stats.signals_sent = self.get(stat::SIGNALS_SENT);
        stats.records_capped = self.get(stat::RECORDS_CAPPED);
        stats.allocs_map_full = self.get(stat::ALLOCS_FULL);
        stats.procs_map_full = self.get(stat::PROCS_FULL);
        stats.cgroups_map_full = self.get(stat::CGROUPS_FULL);
        stats.exit_events_lost = self.get(stat::EXITS_LOST);
        stats.log_lines_suppressed = self.get(stat::LOG_SUPPRESSED);
        stats.cgroups_removed_by_kernel = self.get(stat::CGROUPS_REMOVED);
        stats.vmm_pinned = self.get(stat::VMM_PINNED);
        stats.journal_lost = self.get(stat::JOURNAL_LOST);
    }
}

/// The trouble counters of `stats` by the `kind` label of `vramguard_kernel_trouble_total`.
pub fn kinds(stats: &Stats) -> [(&'static str, u64); 9] {
    [
        ("records_capped", stats.records_capped),
        ("allocs_map_full", stats.allocs_map_full),
        ("procs_map_full", stats.procs_map_full),
        ("cgroups_map_full", stats.cgroups_map_full),
        ("events_lost", stats.events_lost),
        ("exit_events_lost", stats.exit_events_lost),
        ("untracked_allocs", stats.untracked_allocs),
        ("log_lines_suppressed", stats.log_lines_suppressed),
        ("journal_lost", stats.journal_lost),
    ]
}
