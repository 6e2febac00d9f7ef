//! The driver's view: what NVML (`libnvidia-ml.so.1`) says each process holds on the GPUs,
//! whichever copy of libcuda did the allocating. This room owns the NVML library (found as
//! [`locate`] says, loaded with `libloading` in [`nvml`]), the thread that reads it (one read
//! per second, each within [`task::READ_BUDGET`]: a hung NVML is marked `hung` and no other
//! read starts until it returns) and the published [`DriverView`]: host pid -> bytes summed
//! over devices, and the view's [`DriverStatus`] (`ok`, or `absent`, `failing`, `hung` with
//! the reason). The reconcile task reads the latest view when it passes, never waiting for
//! NVML ([`crate::reconcile`] joins it by pid with the probes' and the ledgers' views).
//!
//! Without NVML (no library, a broken one, a symbol missing, errors, a hang) the agent runs
//! as without this room, and says so: once in the log per change of state, in `vramguard
//! audit` (`driver`) and in the metrics (`vramguard_driver_up`, `vramguard_driver_state`).
//!
//! Pids are those of the NVML caller's pid namespace: the agent runs in the host's
//! (`hostPID`), so they are host pids. NVML gives no start time, so a pid reused between a
//! read and a pass (within a second or two) could be joined with the wrong process.
pub mod nvml;
pub mod task;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Instant,
};

use serde::{Deserialize, Serialize};

/// The NVML library's file name.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

/// Where a host installs NVML, looked at after the operator's path and the directories of
/// the `--libcuda` files (the same directories as [`crate::discovery::well_known_paths`]).
const WELL_KNOWN_DIRS: [&str; 4] =
    ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64", "/usr/lib/aarch64-linux-gnu"];

/// The candidate NVML files, in the order they are tried: the operator's `--nvml` (alone,
/// when given), else `libnvidia-ml.so.1` beside each `--libcuda` file, else at the usual
/// install directories.
pub fn locate(operator: Option<&Path>, libcuda: &[PathBuf]) -> Vec<PathBuf> {
    if let Some(path) = operator {
        return vec![path.to_path_buf()];
    }
    let mut candidates: Vec<PathBuf> = libcuda.iter().filter_map(|file| file.parent()).map(|dir| dir.join(LIBRARY)).collect();
    candidates.extend(WELL_KNOWN_DIRS.iter().map(|dir| Path::new(dir).join(LIBRARY)));
    let mut seen = std::collections::BTreeSet::new();
    candidates.retain(|path| seen.insert(path.clone()));
    candidates
}

/// How NVML answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Not read yet (the agent just started).
    Starting,
    /// The last read answered.
    Ok,
    /// No NVML library could be loaded (none found, a broken file, a symbol missing).
    Absent,
    /// NVML is loaded, but init or a read returned an error.
    Failing,
    /// A read has not come back within its budget; no other starts until it does.
    Hung,
}

impl State {
    pub const ALL: [State; 5] = [State::Starting, State::Ok, State::Absent, State::Failing, State::Hung];

    pub fn name(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Ok => "ok",
            State::Absent => "absent",
            State::Failing => "failing",
            State::Hung => "hung",
        }
    }
}

/// The driver view's state, as `vramguard audit` shows it (`driver`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverStatus {
    pub state: State,
    /// Why it is not `ok`.
    #[serde(default)]
    pub reason: Option<String>,
    /// The NVML file loaded, if any.
    #[serde(default)]
    pub library: Option<String>,
    /// Reads that answered since the agent started.
    #[serde(default)]
    pub reads: u64,
}

impl Default for DriverStatus {
    fn default() -> DriverStatus {
        DriverStatus { state: State::Starting, reason: None, library: None, reads: 0 }
    }
}

/// What NVML says one process holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverProcess {
    /// Bytes over every device (`usedGpuMemory`, the context included).
    pub bytes: u64,
    /// Devices the process holds memory on.
    pub devices: u32,
}

/// The latest driver view.
#[derive(Clone, Debug, Default)]
pub struct DriverView {
    pub status: DriverStatus,
    /// By host pid, from the last read that answered (empty unless `ok`).
    pub processes: BTreeMap<u32, DriverProcess>,
    /// When that read started (what it says is the driver's state then).
    pub read_at: Option<Instant>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operators_path_comes_alone_then_beside_libcuda_then_the_usual_places() {
        assert_eq!(locate(Some(Path::new("/x/nvml.so")), &[PathBuf::from("/d/libcuda.so.1")]), [PathBuf::from("/x/nvml.so")]);
        let found = locate(None, &[PathBuf::from("/d/libcuda.so.1"), PathBuf::from("/usr/lib64/libcuda.so.1")]);
        assert_eq!(found[0], PathBuf::from("/d/libnvidia-ml.so.1"));
        assert_eq!(found[1], PathBuf::from("/usr/lib64/libnvidia-ml.so.1"));
        assert_eq!(found.iter().filter(|p| p.starts_with("/usr/lib64")).count(), 1, "{found:?}");
        assert_eq!(found.len(), 1 + WELL_KNOWN_DIRS.len());
    }
}
