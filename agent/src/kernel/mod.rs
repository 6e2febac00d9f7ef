//! The agent's side of the eBPF programs: which program goes on which libcuda symbol
//! ([`probes`]; as uprobe_multi links where the kernel has them, the programs loaded for
//! those by [`multi`]), the accounting maps read back (whole, a chunk of entries per system call:
//! [`batch`]) and swept ([`accounting`], its index of
//! records by process, [`index`], and the external-memory imports kept apart from it,
//! [`extmem`]), the cgroup limits pushed to the
//! entry probes ([`enforce`]), and the programs' own health and housekeeping: the trouble they
//! count (the per-CPU `STATS` map, [`trouble`]) and log (aya-log records, rate-limited in the
//! kernel, forwarded into the agent's log by [`log`]), and the deletion of removed cgroups'
//! `CGROUP_USAGE` and `CGROUP_LIMITS` entries that the `cgroup_rmdir` tracepoint missed, with
//! the count of the cgroup tree's changes that tells the agent when to walk it ([`cgroups`]),
//! and the processes that may have mapped a new executable file, for discovery ([`exec`]).
pub mod accounting;
pub mod batch;
pub mod cgroups;
pub mod enforce;
pub mod exec;
pub mod extmem;
pub mod index;
pub mod load;
pub mod log;
pub mod multi;
pub mod probes;
pub mod trouble;
pub mod task;
