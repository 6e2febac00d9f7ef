//! External memory imported into CUDA (`cuImportExternalMemory`: Vulkan, D3D, fd or NvSciBuf
//! memory), as the probes' `EXTMEM*` maps keep it (see `common::extmem`): owns those maps,
//! deletes the records of dead processes (at their exit, found through the index of records
//! by process, or in a full sweep: [`super::accounting`]), and says per process and per cgroup how many
//! imports are live and how many bytes they span, for `vramguard audit` and the
//! `vramguard_external_memory_bytes` metric. The memory belongs to whoever exported it, so it
//! is never charged: nothing here reaches the usage the limits enforce.
use aya::{
    maps::{HashMap, MapData},
    Ebpf,
};
use common::{
    extmem::{names, ExtKey, ExtRecord, ExtUsage},
    journal, AllocKey,
};
pub use crate::snapshot::{ExternalMemory, ExternalRow};

use super::accounting::take;
use crate::cgroup::CgroupNames;

pub struct External {
    records: HashMap<MapData, ExtKey, ExtRecord>,
    procs: HashMap<MapData, u32, ExtUsage>,
    cgroups: HashMap<MapData, u64, ExtUsage>,
}

impl External {
    /// Takes the external-memory maps out of the loaded object.
    pub fn new(ebpf: &mut Ebpf) -> anyhow::Result<External> {
        Ok(External { records: take(ebpf, names::EXTMEM)?, procs: take(ebpf, names::EXTMEM_PROCS)?, cgroups: take(ebpf, names::EXTMEM_CGROUPS)? })
    }

    /// Deletes the records of processes that are gone (their entry was deleted by `ext_exit`,
    /// or belongs to a newer process with the same pid); returns how many it examined and how
    /// many went, and adds the keys of those left to `live`.
    pub fn sweep(&mut self, live: &mut Vec<AllocKey>) -> (u64, u64) {
        let records: Vec<(ExtKey, ExtRecord)> = self.records.iter().filter_map(Result::ok).collect();
        let mut removed = 0;
        for (key, record) in &records {
            if self.is_stale(key, record) {
                removed += u64::from(self.records.remove(key).is_ok());
            } else {
                live.push(AllocKey { tgid: key.tgid, space: journal::EXTERNAL, addr: key.handle });
            }
        }
        (records.len() as u64, removed)
    }

    /// Deletes process `tgid`'s import record of `handle` if it is stale: `Some(true)` if it
    /// went, `Some(false)` if it is live, `None` if there is none.
    pub fn sweep_one(&mut self, tgid: u32, handle: u64) -> Option<bool> {
        let key = ExtKey { tgid, _pad: 0, handle };
        let record = self.records.get(&key, 0).ok()?;
        if self.is_stale(&key, &record) {
            return Some(self.records.remove(&key).is_ok());
        }
        Some(false)
    }

    /// Whether process `tgid` has an import record of `handle`.
    pub fn has(&self, tgid: u32, handle: u64) -> bool {
        self.records.get(&ExtKey { tgid, _pad: 0, handle }, 0).is_ok()
    }

    /// Whether `record` (read before this call) is of a process that is gone: looked up after
    /// the record was read, as a record is only ever written after its process's entry exists.
    fn is_stale(&self, key: &ExtKey, record: &ExtRecord) -> bool {
        self.procs.get(&key.tgid, 0).ok().is_none_or(|p| p.generation != record.generation)
    }

    /// The ids of the cgroups with an entry in `EXTMEM_CGROUPS`.
    pub fn cgroup_ids(&self) -> Vec<u64> {
        self.cgroups.keys().filter_map(Result::ok).collect()
    }

    /// Deletes the entries of these (removed) cgroups; returns how many went.
    pub fn forget_cgroups(&mut self, ids: &[u64]) -> usize {
        ids.iter().filter(|id| self.cgroups.remove(id).is_ok()).count()
    }

    /// The live imports now.
    pub fn view(&self, names: &mut CgroupNames) -> ExternalMemory {
        let mut processes: Vec<ExternalRow> = self
            .procs
            .iter()
            .filter_map(Result::ok)
            .map(|(pid, usage)| row(pid, usage.cgroup_id, &usage, names))
            .filter(live)
            .collect();
        processes.sort_by_key(|row| row.pid);
        let mut cgroups: Vec<ExternalRow> =
            self.cgroups.iter().filter_map(Result::ok).map(|(id, usage)| row(0, id, &usage, names)).filter(live).collect();
        cgroups.sort_by_key(|row| row.cgroup_id);
        ExternalMemory { processes, cgroups }
    }
}

fn row(pid: u32, cgroup_id: u64, usage: &ExtUsage, names: &mut CgroupNames) -> ExternalRow {
    ExternalRow {
        pid,
        cgroup_id,
        cgroup: names.path(cgroup_id).unwrap_or_default(),
        imports: usage.imports,
        bytes: usage.bytes,
        unrecorded: usage.unrecorded,
    }
}

fn live(row: &ExternalRow) -> bool {
    row.imports != 0 || row.bytes != 0 || row.unrecorded != 0
}

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    #[test]
    fn the_probe_reads_the_size_where_cuda_h_puts_it() {
        assert_eq!(common::extmem::DESCRIPTOR_SIZE_OFFSET, cuda_abi::EXTERNAL_MEMORY_SIZE_OFFSET);
        assert_eq!(offset_of!(cuda_abi::CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR, size) as u64, common::extmem::DESCRIPTOR_SIZE_OFFSET);
    }
}
