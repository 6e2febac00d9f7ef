//! Which host process a ledger slot belongs to. A slot records the pid a process has in its
//! own pid namespace, that namespace's inode, and its start time; the host pid is the one
//! whose `/proc/<pid>/ns/pid` is that namespace, whose last `NSpid` entry is that pid, and
//! whose start time matches (so a reused pid is never mistaken for the slot's process). A
//! zombie (killed, not yet reaped) counts as gone: its GPU memory is already released.
//!
//! [`host_pid`] scans /proc for one slot; [`ProcessTable`] scans it once for many slots (the
//! agent's sweep).
use std::{collections::HashMap, fs, os::unix::fs::MetadataExt};

use ledger::{layout::Slot, ProcessIdentity};

/// The host pid of the process a slot describes, if it is still running.
pub fn host_pid(slot: &Slot) -> Option<u32> {
    let entries = fs::read_dir("/proc").ok()?;
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        if fs::metadata(format!("/proc/{pid}/ns/pid")).map(|m| m.ino()).ok() != Some(slot.pidns) {
            continue;
        }
        if namespace_pid(pid) == Some(slot.pid) && ledger::process::running_start_time_of(pid) == Some(slot.start_time) {
            return Some(pid);
        }
    }
    None
}

/// The identity of host process `pid` (pid namespace, pid in it, start time), running or a
/// zombie: what an exit event's process was, looked up while it is still in /proc.
pub fn identity_of(pid: u32) -> Option<ProcessIdentity> {
    let pidns = fs::metadata(format!("/proc/{pid}/ns/pid")).ok()?.ino();
    let inner = namespace_pid(pid)?;
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22 (start time) is the 20th after the command name, which ends at the last ')'.
    let start_time = stat[stat.rfind(')')? + 1..].split_whitespace().nth(19)?.parse().ok()?;
    Some(ProcessIdentity { pid: inner, pidns, start_time })
}

/// The inode of the initial pid namespace (`PROC_PID_INIT_INO` in the kernel).
const INITIAL_PIDNS_INODE: u64 = 0xEFFF_FFFC;

/// Whether this process runs in the host's (initial) pid namespace, where every process of
/// every container is visible; elsewhere a slot's process may be alive yet invisible.
pub fn in_initial_pid_namespace() -> bool {
    fs::metadata("/proc/self/ns/pid").map(|m| m.ino()).ok() == Some(INITIAL_PIDNS_INODE)
}

/// Every running process at one instant, by (pid namespace inode, pid in that namespace).
/// A process that starts after [`ProcessTable::scan`] is missing from it: a caller must
/// confirm with [`host_pid`] before treating a slot it does not find as dead.
pub struct ProcessTable {
    /// (pidns, pid in it) -> (host pid, start time).
    processes: HashMap<(u64, u32), (u32, u64)>,
}

impl ProcessTable {
    pub fn scan() -> ProcessTable {
        let mut processes = HashMap::new();
        let Ok(entries) = fs::read_dir("/proc") else { return ProcessTable { processes } };
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let Ok(pidns) = fs::metadata(format!("/proc/{pid}/ns/pid")).map(|m| m.ino()) else { continue };
            let (Some(inner), Some(start)) = (namespace_pid(pid), ledger::process::running_start_time_of(pid)) else {
                continue;
            };
            processes.insert((pidns, inner), (pid, start));
        }
        ProcessTable { processes }
    }

    /// The host pid of the running process `slot` describes, as of the scan.
    pub fn find(&self, slot: &Slot) -> Option<u32> {
        let &(pid, start) = self.processes.get(&(slot.pidns, slot.pid))?;
        (start == slot.start_time).then_some(pid)
    }
}

/// The pid of host process `pid` inside its own (innermost) pid namespace.
fn namespace_pid(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_this_process_and_not_a_reused_pid() {
        let me = ledger::ProcessIdentity::current().expect("identity");
        let mut slot = Slot {
            state: ledger::layout::SLOT_LIVE,
            pid: me.pid,
            pidns: me.pidns,
            start_time: me.start_time,
            host_pid: 0,
            _pad: 0,
            allocs: 0,
            frees: 0,
            rejections: 0,
            devices: [Default::default(); ledger::layout::MAX_DEVICES],
        };
        assert_eq!(host_pid(&slot), Some(std::process::id()));
        assert_eq!(ProcessTable::scan().find(&slot), Some(std::process::id()));
        assert_eq!(identity_of(std::process::id()), Some(me));
        slot.start_time += 1;
        assert_eq!(host_pid(&slot), None);
        assert_eq!(ProcessTable::scan().find(&slot), None);
    }
}
