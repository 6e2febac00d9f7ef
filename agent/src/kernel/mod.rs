//! The eBPF side's own health and housekeeping, as the agent sees it: the trouble the programs
//! count (the per-CPU `STATS` map, [`trouble`]) and log (aya-log records, rate-limited in the
//! kernel, forwarded into the agent's log by [`log`]), and the deletion of removed cgroups'
//! `CGROUP_USAGE` and `CGROUP_LIMITS` entries that the `cgroup_rmdir` tracepoint missed
//! ([`cgroups`]).
pub mod cgroups;
pub mod log;
pub mod trouble;
