//! The agent's side of the eBPF programs: which program goes on which libcuda symbol
//! ([`probes`]), the accounting maps read back and swept ([`accounting`], and the
//! external-memory imports kept apart from it, [`extmem`]), the cgroup limits pushed to the
//! entry probes ([`enforce`]), and the programs' own health and housekeeping: the trouble they
//! count (the per-CPU `STATS` map, [`trouble`]) and log (aya-log records, rate-limited in the
//! kernel, forwarded into the agent's log by [`log`]), and the deletion of removed cgroups'
//! `CGROUP_USAGE` and `CGROUP_LIMITS` entries that the `cgroup_rmdir` tracepoint missed
//! ([`cgroups`]).
pub mod accounting;
pub mod cgroups;
pub mod enforce;
pub mod extmem;
pub mod load;
pub mod log;
pub mod probes;
pub mod trouble;
pub mod task;
