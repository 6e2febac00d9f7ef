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
//! (`hostPID`), so they are host pids. NVML gives no start time: the reader reads each pid's
//! from `/proc` when a read first lists it and remembers it while consecutive reads list the
//! pid (NVML keeps listing the pid of the process that made the memory's driver client, even
//! after it exited while a child it forked holds the memory); a row is joined only while the
//! process at that pid still has that start time, and a pass joins it only with the process
//! that still has it then. What is not joined is reported as what it is, in the status's
//! `unjoined` (`vramguard audit`, and its bytes in `vramguard_driver_unattributed_bytes`): a
//! pid the agent cannot see when it reads (a process of a pid namespace the agent does not see
//! into, or one that exited), a pid another process has taken since the driver first listed
//! it, and every row while the agent is not in the host's pid namespace (`pid_namespace` says
//! so: the driver's pids are then not the agent's).
//!
//! A GPU in MIG mode is read per MIG device (`nvmlDeviceGetMigDeviceHandleByIndex`): each
//! instance's processes, each instance counted as a device of its own (its own context).
//! The parent's list is never used for it (NVML's aggregate there is not per instance, and
//! needs rights the agent may lack). A MIG GPU whose instances cannot be read has its
//! processes left out, and says why (`mig` in the status, and the log once).
pub mod gap;
pub mod holders;
pub mod install;
pub mod ld_cache;
pub mod listed;
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
/// when given), else `libnvidia-ml.so.1` beside each `--libcuda` file, then what [`install`]
/// found under the host's root (and the name in each of its known directories there), then
/// the usual install directories of the agent's own root.
pub fn locate(operator: Option<&Path>, libcuda: &[PathBuf], found: Option<&install::Found>) -> Vec<PathBuf> {
    if let Some(path) = operator {
        return vec![path.to_path_buf()];
    }
    let mut candidates: Vec<PathBuf> = libcuda.iter().filter_map(|file| file.parent()).map(|dir| dir.join(LIBRARY)).collect();
    candidates.extend(found.map(install::Found::nvml_candidates).unwrap_or_default());
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
    /// The GPUs in MIG mode, as the last read found them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<MigDevice>,
    /// Set while the agent is not in the host's pid namespace: why NVML's pids are not joined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid_namespace: Option<String>,
    /// Processes the driver reports that are joined with no process the agent sees, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unjoined: Vec<UnjoinedProcess>,
    /// Each GPU's memory as the last read found it, and what no row explains of it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceMemory>,
    /// Where the driver's libraries were found at the agent's start ([`install::Found::describe`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub install: Option<String>,
}

impl DriverStatus {
    /// What `vramguard audit`'s table says below the state: the GPUs in MIG mode, the pid
    /// namespace if it is not the host's, and the processes not joined.
    pub fn notes(&self) -> Vec<String> {
        let mut notes: Vec<String> = self.install.iter().map(|found| format!("driver libraries: {found}")).collect();
        for mig in &self.mig {
            notes.push(match &mig.unread {
                None => format!("GPU {} in MIG mode: read per MIG device ({} read)", mig.index, mig.instances),
                Some(reason) => format!("GPU {} in MIG mode: {reason}", mig.index),
            });
        }
        notes.extend(self.pid_namespace.clone());
        for process in &self.unjoined {
            notes.push(format!("not joined: pid {} ({} bytes): {}", process.pid, process.bytes, process.reason));
        }
        for device in self.devices.iter().filter(|d| d.gap.unexplained.is_some_and(|b| b > gap::TOLERANCE)) {
            let whose = match device.gap.cgroup_id {
                Some(cgroup) => format!("charged to cgroup {cgroup}, whose processes hold the GPU's device file"),
                None => format!("unattributed (holders not listed: {:?})", device.gap.holders.iter().map(|h| h.pid).collect::<Vec<_>>()),
            };
            notes.push(format!("GPU {}: {} bytes no listed process explains: {whose}", device.index, device.gap.unexplained.unwrap_or(0)));
        }
        notes
    }
}

/// A GPU in MIG mode, as a read found it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDevice {
    /// The GPU's NVML index.
    pub index: u32,
    /// Its MIG devices (instances) read.
    pub instances: u32,
    /// Why its processes could not be read per instance: they are left out.
    #[serde(default)]
    pub unread: Option<String>,
}

/// A process the driver reports and the agent joins with none it sees.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnjoinedProcess {
    /// The pid as NVML gave it.
    pub pid: u32,
    /// What NVML reports it holding over every device.
    pub bytes: u64,
    pub reason: String,
}

/// Why a pid NVML reported is not the agent's to join (see the module doc).
pub const NOT_VISIBLE: &str = "no such process in the agent's pid namespace when read (a process of another pid namespace, or one that exited at once)";
/// Why a pid NVML reported is no longer joined.
pub const REUSED: &str = "the pid is another process's since the read";
/// Why a pid NVML lists is not joined with the process that has it now.
pub const REUSED_SINCE_LISTED: &str = "pid reused since the driver first listed it";
/// Why a pid NVML lists is not joined with the process that had it when first listed.
pub const NOT_HOLDING: &str = "the process with this pid holds none of the GPU's device files: the row is of an earlier process";
/// Why a row NVML lists carries no bytes.
pub const NO_FIGURE: &str = "listed by NVML without a figure (NVML_VALUE_NOT_AVAILABLE): counted, its bytes unknown";

/// The inode of the initial (host) pid namespace (the kernel's `PROC_PID_INIT_INO`).
const HOST_PID_NAMESPACE: &str = "pid:[4026531836]";

/// `None` when this process is in the host's pid namespace, else why NVML's pids are not its.
pub fn foreign_pid_namespace() -> Option<String> {
    let link = std::fs::read_link("/proc/self/ns/pid").map(|l| l.display().to_string());
    match link {
        Ok(link) if link == HOST_PID_NAMESPACE => None,
        Ok(link) => Some(format!("the agent runs in {link}, not the host's pid namespace ({HOST_PID_NAMESPACE}): the driver's pids are not joined (run it with hostPID)")),
        Err(error) => Some(format!("cannot read the agent's pid namespace (/proc/self/ns/pid: {error}): the driver's pids are not joined")),
    }
}

impl Default for DriverStatus {
    fn default() -> DriverStatus {
        DriverStatus { state: State::Starting, reason: None, library: None, reads: 0, mig: Vec::new(), pid_namespace: None, unjoined: Vec::new(), devices: Vec::new(), install: None }
    }
}

/// What NVML says one process holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverProcess {
    /// Bytes over every device (`usedGpuMemory`, the context included).
    pub bytes: u64,
    /// Devices (MIG devices on a GPU in MIG mode) the process holds memory on.
    pub devices: u32,
    /// The process's start time (`/proc/<pid>/stat`) read just after the read; 0 when no
    /// such process was visible then.
    pub start_time: u64,
}

/// What one read found: each pid's figure, the GPUs in MIG mode, the minor numbers of the
/// GPUs each pid is listed on, the pids listed without a figure, and each GPU's memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Read {
    pub processes: BTreeMap<u32, DriverProcess>,
    pub mig: Vec<MigDevice>,
    /// pid -> the minor numbers of the GPUs it is listed on (its device files).
    pub minors: BTreeMap<u32, Vec<u32>>,
    /// Pids NVML listed without a figure (`NVML_VALUE_NOT_AVAILABLE`) on some GPU.
    pub unfigured: Vec<u32>,
    pub devices: Vec<DeviceMemory>,
}

/// One GPU as a read found it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// NVML's index.
    pub index: u32,
    /// NVML's minor number (its device file `/dev/nvidia<minor>`); the index without one.
    pub minor: u32,
    /// NVML's UUID (`GPU-…`); empty where NVML gives none.
    pub uuid: String,
    /// NVML's product name (`NVIDIA H100 80GB HBM3`); empty where NVML gives none.
    #[serde(default)]
    pub name: String,
    /// (total, used) bytes (`nvmlDeviceGetMemoryInfo`), where NVML answers.
    pub memory: Option<(u64, u64)>,
    /// The sum of the figures NVML listed on it.
    pub listed: u64,
    /// Rows listed on it without a figure.
    pub unfigured: u32,
    /// Processes listed on it with a figure.
    #[serde(default)]
    pub processes: u32,
    /// What no row explains of its memory ([`gap`]).
    #[serde(default)]
    pub gap: gap::Gap,
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
    fn the_operators_path_comes_alone_then_beside_libcuda_then_the_host_s_then_the_usual_places() {
        assert_eq!(locate(Some(Path::new("/x/nvml.so")), &[PathBuf::from("/d/libcuda.so.1")], None), [PathBuf::from("/x/nvml.so")]);
        let found = locate(None, &[PathBuf::from("/d/libcuda.so.1"), PathBuf::from("/usr/lib64/libcuda.so.1")], None);
        assert_eq!(found[0], PathBuf::from("/d/libnvidia-ml.so.1"));
        assert_eq!(found[1], PathBuf::from("/usr/lib64/libnvidia-ml.so.1"));
        assert_eq!(found.iter().filter(|p| p.starts_with("/usr/lib64")).count(), 1, "{found:?}");
        assert_eq!(found.len(), 1 + WELL_KNOWN_DIRS.len());
        let host = install::Found { root: "/host".into(), dir: Some("usr/lib64".into()), layout: None, libcuda: None, nvml: Some("/host/usr/lib64/libnvidia-ml.so.580".into()) };
        let found = locate(None, &[PathBuf::from("/d/libcuda.so.1")], Some(&host));
        assert_eq!(found[..3], [PathBuf::from("/d/libnvidia-ml.so.1"), "/host/usr/lib64/libnvidia-ml.so.580".into(), "/host/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1".into()]);
        assert_eq!(found.last(), Some(&Path::new(WELL_KNOWN_DIRS[3]).join(LIBRARY)), "the agent's own places last");
        assert_eq!(found.len(), 2 + 3 + WELL_KNOWN_DIRS.len());
    }
}
