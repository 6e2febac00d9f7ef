//! `libvramguard.so`: preloaded into every process of a container (`LD_PRELOAD` or
//! `/etc/ld.so.preload`), it interposes the CUDA driver API and admits every allocation
//! through the container's ledger before the real driver is called, so no container exceeds
//! its quota, however many processes race (docs/design.md, "The hook", "The ledger").
//!
//! * [`config`]: the environment (HAMi-core's variables and vramguard's own).
//! * [`real`]: the real libcuda, the process's NVML and the real `dlsym`.
//! * [`session`]: this process's ledger, slot and allocations, across fork and exit.
//! * [`pools`]: stream-ordered pools and graph memory pools, charged for the memory they hold.
//! * `vmm`: VMM handles, charged until released and unmapped.
//! * `contexts`: every context, charged from its creation to its destruction.
//! * `arrays`: CUDA arrays and mipmapped arrays, charged by their real footprint.
//! * `graphs`: graph memory nodes, charged when a launch takes memory into the graph pool.
//! * `exports`: the memory wrappers, `dlsym`, `dlvsym` and `cuGetProcAddress(_v2)`.
//! * `symbols`: lookups in the loaded objects' symbol tables, without `dlsym`.
//!
//! Intercepted (exported, handed out by `dlsym` and `dlvsym` on any handle, and for the driver's also by
//! `cuGetProcAddress(_v2)`): the allocations and frees `cuMemAlloc_v2`, `cuMemAllocPitch_v2`,
//! `cuMemAllocManaged`, `cuMemAllocAsync(_ptsz)`, `cuMemAllocFromPoolAsync(_ptsz)`,
//! `cuMemFree_v2`, `cuMemFreeAsync(_ptsz)`, `cuMemPoolTrimTo`, `cuMemPoolDestroy`; VMM: `cuMemCreate`,
//! `cuMemRelease`, `cuMemMap`, `cuMemUnmap`, `cuMemRetainAllocationHandle`; arrays:
//! `cuArrayCreate_v2`, `cuArray3DCreate_v2`, `cuMipmappedArrayCreate`, `cuArrayDestroy`,
//! `cuMipmappedArrayDestroy`; graph memory: `cuGraphInstantiate(_v2)`,
//! `cuGraphInstantiateWithFlags`, `cuGraphInstantiateWithParams(_ptsz)`,
//! `cuGraphLaunch(_ptsz)`, `cuGraphUpload(_ptsz)`, `cuDeviceGraphMemTrim`,
//! `cuGraphExecDestroy`; the synchronizes at which pools give memory back
//! `cuStreamSynchronize(_ptsz)`, `cuEventSynchronize`, `cuCtxSynchronize(_v2)`; the contexts
//! `cuDevicePrimaryCtxRetain`,
//! `cuDevicePrimaryCtxRelease(_v2)`, `cuCtxCreate_v2/_v3/_v4`, `cuCtxDestroy_v2`; what the
//! workload sees: `cuMemGetInfo_v2`, `cuDeviceTotalMem_v2` and NVML's
//! `nvmlDeviceGetMemoryInfo(_v2)` (total = the quota, free = the quota less the container's
//! usage, each at most what the device reports; NVML's device is matched to the ledger by its
//! UUID); and the routes `cuGetProcAddress(_v2)`, `dlsym` and `dlvsym`. Every other lookup
//! gets exactly the C library's answer (`RTLD_NEXT` relative to the real caller), and no
//! lookup loads libcuda or NVML.
//!
//! Policy, when the ledger cannot be created or fails validation, a setting cannot be read, or
//! a visible GPU is not in the ledger: print what is wrong once and refuse GPU allocations
//! (`CUDA_ERROR_OUT_OF_MEMORY`; there, for a GPU), unless `VRAMGUARD_FAIL_OPEN=1` (not in a
//! provisioned container), which runs without limits and says so once.
//! Stream-ordered (`cuMemAllocAsync`, pool) allocations charge what their pool holds,
//! including memory it keeps reserved after frees until trimmed or released at a synchronize
//! (falling back to one charge per allocation where the driver cannot report pool usage); a
//! refusal is final only after those charges were settled to what the driver reports.
mod arrays;
pub mod config;
mod contexts;
mod exports;
mod graphs;
pub mod pools;
pub mod real;
pub mod session;
mod vmm;
mod symbols;
