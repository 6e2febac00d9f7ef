//! A fake CUDA driver (`libcuda.so.1`) with real semantics, for tests and the demo. It is a
//! test double and never shipped as "the" driver.
//!
//! Devices are machine-wide like real GPUs: each lives in a shared-memory state file that all
//! processes map ([`devfile`]), so concurrent processes compete for the same memory, and a
//! process's memory returns to the device when the last holder of its open device file (the
//! process, or a child it forked) closes it. Allocation granularity, context reserve,
//! stream-ordered pools and VMM handles follow what was measured on an H100 ([`driver`]).
//! Configuration comes from `FAKECUDA_*` environment variables ([`config`]). The exported
//! entry points are in [`exports`] (arrays in [`resources`], graphs, stream capture and graph
//! memory in [`graphs`], imported external memory in [`external`]); `cuGetProcAddress`
//! resolution is in [`procaddr`]. The same
//! library is a minimal NVML too ([`nvml`]: init, device handles and UUIDs, memory info, and
//! the per-cgroup memory limits of drivers r615 and later, kept machine-wide in [`limits`] and
//! enforced at every charge of device memory; cgroup paths and keys in [`cgroup`]). The
//! driver version it claims is a knob (`FAKECUDA_DRIVER_VERSION`, default `580.65.06`).
//!
//! Build: `cargo build -p fakecuda` gives `target/<profile>/libcuda.so` with soname
//! `libcuda.so.1`; point `LD_LIBRARY_PATH` at a directory holding a `libcuda.so.1` symlink to it
//! (and a `libnvidia-ml.so.1` one, for NVML; the e2e kit's `fake_driver_dir` makes both).

pub mod api;
pub mod attributes;
pub mod cgroup;
pub mod config;
pub mod devfile;
pub mod driver;
pub mod errors;
pub mod exports;
pub mod external;
pub mod graphs;
pub mod limits;
#[cfg(test)]
mod limits_tests;
pub mod nvml;
pub mod pools;
pub mod procaddr;
pub mod procinfo;
pub mod resources;
pub mod streams;
