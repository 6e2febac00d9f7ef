//! Which host process a ledger slot belongs to. A slot records the pid a process has in its
//! own pid namespace, that namespace's inode, and its start time; the host pid is the one
//! whose `/proc/<pid>/ns/pid` is that namespace, whose last `NSpid` entry is that pid, and
//! whose start time matches (so a reused pid is never mistaken for the slot's process). A
//! zombie (killed, not yet reaped) counts as gone: its GPU memory is already released.
use std::{fs, os::unix::fs::MetadataExt};

use ledger::layout::Slot;

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
        slot.start_time += 1;
        assert_eq!(host_pid(&slot), None);
    }
}
