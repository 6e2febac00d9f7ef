//! `libvramguard.so`: preloaded into every process of a container (`LD_PRELOAD` or
//! `/etc/ld.so.preload`), it interposes the CUDA driver API and admits every allocation
//! through the container's ledger before the real driver is called, so no container exceeds
//! its quota, however many processes race (DESIGN.md §2-4).
//!
//! * [`config`]: the environment (HAMi-core's variables and vramguard's own).
//! * [`real`]: the real libcuda and the real `dlsym`.
//! * [`session`]: this process's ledger, slot and allocations, across fork and exit.
//! * [`pools`]: stream-ordered pools, charged for the memory they hold.
//! * `exports`: the wrappers, `dlsym` and `cuGetProcAddress(_v2)`.
//!
//! Policy, when the ledger cannot be created or fails validation: print what is wrong once
//! and refuse GPU allocations (`CUDA_ERROR_OUT_OF_MEMORY`), unless `VRAMGUARD_FAIL_OPEN=1`.
//! Stream-ordered (`cuMemAllocAsync`, pool) allocations charge what their pool holds,
//! including memory it keeps reserved after frees until trimmed (falling back to one charge
//! per allocation where the driver cannot report pool usage).
pub mod config;
mod exports;
pub mod pools;
pub mod real;
pub mod session;
