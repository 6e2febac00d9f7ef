//! Who a process is, in a way that survives pid reuse: pid, pid namespace and start time.
use std::{fs, io, os::unix::fs::MetadataExt};

/// The identity a slot records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProcessIdentity {
    /// Pid in the process's own pid namespace.
    pub pid: u32,
    /// Inode of its pid namespace.
    pub pidns: u64,
    /// Start time in clock ticks after boot (`/proc/<pid>/stat` field 22).
    pub start_time: u64,
}

impl ProcessIdentity {
    /// The calling process.
    pub fn current() -> io::Result<ProcessIdentity> {
        Ok(ProcessIdentity {
            pid: std::process::id(),
            pidns: fs::metadata("/proc/self/ns/pid")?.ino(),
            start_time: start_time("self")?,
        })
    }

    /// Whether this process still runs, judged from the caller's pid namespace: `None` when
    /// it lives in another pid namespace (only a process that sees both, such as the node
    /// agent, can tell).
    pub fn is_alive(&self) -> Option<bool> {
        let own = fs::metadata("/proc/self/ns/pid").ok()?.ino();
        if own != self.pidns {
            return None;
        }
        Some(start_time(&self.pid.to_string()).is_ok_and(|start| start == self.start_time))
    }
}

/// The start time of host-visible process `pid` (field 22 of `/proc/<pid>/stat`).
pub fn start_time_of(pid: u32) -> io::Result<u64> {
    start_time(&pid.to_string())
}

/// Field 22 of `/proc/<pid>/stat`. The command name (field 2) may contain spaces and
/// parentheses, so fields are counted after its last `)`.
fn start_time(pid: &str) -> io::Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_start_time(&stat)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("unreadable /proc/{pid}/stat")))
}

fn parse_start_time(stat: &str) -> Option<u64> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // After the command come field 3 (state) onwards: field 22 is the 20th of them.
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_survives_odd_command_names() {
        let stat = "1234 (a) b (c) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 100";
        assert_eq!(parse_start_time(stat), Some(987654));
    }

    #[test]
    fn current_process_is_alive() {
        let me = ProcessIdentity::current().expect("own identity");
        assert_eq!(me.is_alive(), Some(true));
        let reused = ProcessIdentity { start_time: me.start_time + 1, ..me };
        assert_eq!(reused.is_alive(), Some(false));
        let elsewhere = ProcessIdentity { pidns: me.pidns + 1, ..me };
        assert_eq!(elsewhere.is_alive(), None);
    }
}
