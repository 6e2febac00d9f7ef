//! External memory (`cuImportExternalMemory`: Vulkan, D3D, fd or NvSciBuf memory imported into
//! CUDA): the keys and values of the eBPF maps that keep it visible. The memory belongs to
//! whoever exported it, so it is never charged to a quota: these maps are separate from the
//! accounting ones (`ALLOCS`, `PROC_USAGE`, `CGROUP_USAGE`) and no limit reads them.
//!
//! `EXTMEM` holds one record per imported, not yet destroyed handle (key [`ExtKey`]), at most
//! `MAX_RECORDS_PER_CGROUP` per cgroup (the same cap as `ALLOCS`, counted apart); totals per
//! process (`EXTMEM_PROCS`) and per cgroup (`EXTMEM_CGROUPS`) are [`ExtUsage`]s.

/// Byte offset of `size` in `CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR` (checked against
/// cuda-abi's layout by the agent's tests).
pub const DESCRIPTOR_SIZE_OFFSET: u64 = 24;
/// Capacity of `EXTMEM` (live imports across the node).
pub const MAX_RECORDS: u32 = 1 << 16;

/// Key of `EXTMEM`: the importing process and the `CUexternalMemory` handle it got.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtKey {
    pub tgid: u32,
    pub _pad: u32,
    pub handle: u64,
}

/// Value of `EXTMEM`: the imported bytes, the cgroup charged with the record, and the
/// generation of the process entry in `EXTMEM_PROCS` it was made under (a record of an
/// earlier process with the same pid is stale).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtRecord {
    pub size: u64,
    pub cgroup_id: u64,
    pub generation: u64,
}

/// Value of `EXTMEM_PENDING` (key: pid_tgid): a `cuImportExternalMemory` between entry and
/// return.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtPending {
    pub out_ptr: u64,
    pub size: u64,
}

/// Value of `EXTMEM_PROCS` (key: tgid) and `EXTMEM_CGROUPS` (key: cgroup id): imported bytes
/// and live imports with a record; `unrecorded`: imports past the cgroup's cap (neither their
/// bytes nor their destruction can be counted). `cgroup_id` and `generation` are the process's
/// (0 in a cgroup's entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtUsage {
    pub bytes: u64,
    pub imports: u64,
    pub unrecorded: u64,
    pub cgroup_id: u64,
    pub generation: u64,
}

/// Names of its maps and programs in the eBPF object.
pub mod names {
    pub const EXTMEM: &str = "EXTMEM";
    pub const EXTMEM_PROCS: &str = "EXTMEM_PROCS";
    pub const EXTMEM_CGROUPS: &str = "EXTMEM_CGROUPS";
    /// Entry and return probes of `cuImportExternalMemory`.
    pub const IMPORT: &str = "ext_import";
    pub const IMPORT_RETURN: &str = "ext_import_return";
    /// Entry probe of `cuDestroyExternalMemory`.
    pub const DESTROY: &str = "ext_destroy";
    /// `sched:sched_process_exit`: a dead process's imports leave its cgroup's totals.
    pub const EXIT: &str = "ext_exit";
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: each type is #[repr(C)], made only of integers with explicit padding fields, so
    // every bit pattern is a valid value and there are no uninitialised padding bytes.
    unsafe impl aya::Pod for super::ExtKey {}
    unsafe impl aya::Pod for super::ExtRecord {}
    unsafe impl aya::Pod for super::ExtPending {}
    unsafe impl aya::Pod for super::ExtUsage {}
}
