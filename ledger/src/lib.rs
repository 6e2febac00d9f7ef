//! The shared quota ledger: one memory-mapped file per container that every hooked process
//! and the node agent map at once (docs/design.md, "The ledger"). No CUDA and no eBPF here.
//!
//! * [`layout`]: the file's byte layout (header page with limits, state, slots, records,
//!   per-device buddy spaces and block links).
//! * [`file`]: atomic creation and validated opening.
//! * [`copy`]: a bounded private copy of a ledger's state and slots, without mapping it or
//!   taking its lock (how the node agent reads the files its workloads can write).
//! * [`lock`]: the process-shared robust mutex in the file.
//! * [`buddy`]: the buddy allocator with Linux `gpu_buddy` semantics over a word array.
//! * [`Ledger`]: the operations (register, reserve, release, reclaim, repair, check).
//! * [`process`]: process identity that survives pid reuse.
pub mod buddy;
pub mod copy;
pub mod error;
pub mod file;
pub mod layout;
mod ledger;
pub mod lock;
pub mod process;
pub mod provisioned;
mod tables;

pub use error::{LedgerError, ReserveError};
pub use layout::{ContainerNames, DeviceConfig, Geometry, Kind};
pub use ledger::{Charge, Ledger, RecordId, SlotId, SlotView};
pub use process::ProcessIdentity;
