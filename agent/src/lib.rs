//! The `vramguard` node agent as a library: the binary (`src/main.rs`) is its command line,
//! and the benchmarks under `benches/` drive its modules directly.
pub mod cgroup;
pub mod discovery;
pub mod dra;
pub mod driver;
pub mod driver_limits;
pub mod fault;
pub mod glob;
pub mod identity;
pub mod inspect;
pub mod inventory;
pub mod kernel;
pub mod libcuda;
pub mod ledgers;
pub mod pidfd;
pub mod pod;
pub mod preflight;
pub mod prepared;
pub mod procmaps;
pub mod provision;
pub mod quantity;
pub mod reconcile;
pub mod run;
pub mod serve;
pub mod snapshot;
pub mod task;
pub mod webhook;
