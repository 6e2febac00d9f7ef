//! The kernel's word on new executable mappings, for discovery: the programs on
//! `sched:sched_process_exec`, `syscalls:sys_enter_mmap` (a file mapped with `PROT_EXEC`) and
//! `syscalls:sys_enter_mprotect`/`sys_enter_pkey_mprotect` (`PROT_EXEC` added to a mapping,
//! of a file or not) put the process in `EXEC_MAPPED`, which discovery takes and empties at
//! each scan ([`ExecMapped::take`]): it reads the maps of those processes only, and of every
//! process on its slow rescan. An event that finds the map full is counted in
//! `EXEC_MAPPED_LOST`, and discovery then reads every process's maps at once.
//!
//! What no event announces, only the rescan finds (within `--full-rescan-ms`, counted in
//! `vramguard_discovery_found_by_rescan_total`): a file mapped executable by the kernel
//! without either syscall (System V shared memory attached with `SHM_EXEC`, the obsolete
//! `uselib`), and a mapping made more than one scan after its `mmap` was entered.
//!
//! The maps are the kernel task's programs' (they go with the programs), read by discovery's
//! handle: reading them never waits on the kernel task.
use anyhow::{anyhow, Context, Result};
use aya::{
    maps::{Array, HashMap, MapData},
    programs::TracePoint,
    Ebpf,
};
use common::{exec_mapped::MAX_PIDS, names};

/// Discovery's handle on `EXEC_MAPPED` and `EXEC_MAPPED_LOST`.
pub struct ExecMapped {
    pids: HashMap<MapData, u32, u8>,
    lost: Array<MapData, u64>,
    /// `EXEC_MAPPED_LOST` at the last take.
    lost_seen: u64,
}

impl ExecMapped {
    /// The processes named since the last take (each removed from the map), and the events
    /// lost since (the map full, or unreadable: then discovery reads every process's maps).
    pub fn take(&mut self) -> (Vec<u32>, u64) {
        let mut pids = Vec::new();
        let mut lost = 0;
        // Taken first, then removed: a process named again meanwhile stays for the next take.
        for key in self.pids.keys().take(MAX_PIDS as usize) {
            match key {
                Ok(pid) => pids.push(pid),
                Err(_) => lost = 1,
            }
        }
        for pid in &pids {
            let _ = self.pids.remove(pid);
        }
        match self.lost.get(&0, 0) {
            Ok(count) => {
                lost += count.saturating_sub(self.lost_seen);
                self.lost_seen = count;
            }
            Err(_) => lost = lost.max(1),
        }
        (pids, lost)
    }
}

/// Loads and attaches the programs and takes their maps; the error says why discovery must
/// go by its timer instead.
pub fn watch(ebpf: &mut Ebpf) -> Result<ExecMapped> {
    let attach = |ebpf: &mut Ebpf, program: &str, events: &[(&str, &str)]| -> Result<()> {
        let program: &mut TracePoint = ebpf
            .program_mut(program)
            .ok_or_else(|| anyhow!("the embedded eBPF object has no `{program}` program"))?
            .try_into()?;
        program.load().context("the kernel refused the program")?;
        for (category, event) in events {
            program.attach(category, event).with_context(|| format!("cannot attach to the {category}:{event} tracepoint"))?;
        }
        Ok(())
    };
    attach(ebpf, names::EXEC_STARTED, &[("sched", "sched_process_exec")])?;
    attach(ebpf, names::EXEC_MMAP, &[("syscalls", "sys_enter_mmap")])?;
    attach(ebpf, names::EXEC_MPROTECT, &[("syscalls", "sys_enter_mprotect"), ("syscalls", "sys_enter_pkey_mprotect")])?;
    let pids = HashMap::try_from(take(ebpf, names::EXEC_MAPPED)?)?;
    let lost = Array::try_from(take(ebpf, names::EXEC_MAPPED_LOST)?)?;
    Ok(ExecMapped { pids, lost, lost_seen: 0 })
}

fn take(ebpf: &mut Ebpf, name: &str) -> Result<aya::maps::Map> {
    ebpf.take_map(name).ok_or_else(|| anyhow!("the embedded eBPF object has no `{name}` map"))
}
