//! The ledger's errors: each says which file and what is wrong with it.
use std::{io, path::PathBuf};

use crate::lock::LockError;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("ledger {path}: {source}")]
    Io { path: PathBuf, #[source] source: io::Error },
    #[error("{path} is not a vramguard ledger (bad magic)")]
    NotALedger { path: PathBuf },
    #[error("ledger {path} has layout version {found}; this build reads version {supported}")]
    Version { path: PathBuf, found: u32, supported: u32 },
    #[error("ledger {path} is truncated or resized: {actual} bytes, its header says {expected}")]
    Truncated { path: PathBuf, expected: u64, actual: u64 },
    #[error("ledger {path} is corrupt: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("a ledger already exists at {path}")]
    AlreadyExists { path: PathBuf },
    #[error("invalid ledger configuration: {0}")]
    InvalidConfig(String),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("ledger {path}: its lock stayed held for {waited:?} (a process of the container stopped or hung while holding it?)")]
    Busy { path: PathBuf, waited: std::time::Duration },
    #[error("every one of the ledger's {0} process slots is in use")]
    NoFreeSlot(u32),
    #[error("every one of the ledger's {0} allocation records is in use")]
    NoFreeRecord(u32),
    #[error("slot {0} is not a live slot of this ledger")]
    UnknownSlot(u32),
    #[error("record {0} is not a live allocation of this slot")]
    UnknownRecord(u32),
    #[error("device {0} is not described by this ledger")]
    UnknownDevice(u32),
}

/// Why a reservation was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReserveError {
    /// The quota cannot hold it: the caller returns CUDA_ERROR_OUT_OF_MEMORY.
    #[error("over quota on device {device}: {requested} bytes requested, {used} of {limit} bytes in use")]
    OverQuota { device: u32, requested: u64, used: u64, limit: u64 },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}
