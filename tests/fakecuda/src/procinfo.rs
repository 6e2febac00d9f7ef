//! Process identity and liveness, from `/proc`: what lets the fake free a dead process's
//! device memory the way the real driver does when a process goes away.
//!
//! A process is identified by (pid, start time in clock ticks since boot: field 22 of
//! `/proc/<pid>/stat`, pid-namespace inode). The start time tells a reused pid from the
//! process that held it before. A zombie counts as dead: the real driver frees a process's
//! memory when its files close at exit, before the parent reaps it.

use std::os::unix::fs::MetadataExt;

/// Who a process is, as recorded in a device slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcId {
    pub pid: u32,
    /// Field 22 of `/proc/<pid>/stat`; 0 when `/proc` could not be read.
    pub start_time: u64,
    /// Inode of `/proc/self/ns/pid`; 0 when unknown.
    pub pidns: u64,
}

impl ProcId {
    /// The calling process.
    pub fn current() -> ProcId {
        let pid = std::process::id();
        let start_time = read_stat("self").map(|s| s.start_time).unwrap_or(0);
        let pidns = std::fs::metadata("/proc/self/ns/pid").map(|m| m.ino()).unwrap_or(0);
        ProcId { pid, start_time, pidns }
    }
}

/// The fields of `/proc/<pid>/stat` the fake uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub state: u8,
    pub start_time: u64,
}

/// Parses the text of a `/proc/<pid>/stat` file. The command name (field 2) may hold spaces
/// and parentheses, so fields are counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    // `fields` starts at field 3 (state); field 22 (starttime) is 19 further on.
    let state = *fields.next()?.as_bytes().first()?;
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start_time })
}

fn read_stat(pid: &str) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

/// Whether the process recorded as (`pid`, `start_time`) still runs. A `start_time` of 0
/// (unknown when recorded) matches any process with that pid.
pub fn is_alive(pid: u32, start_time: u64) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    match read_stat(&pid.to_string()) {
        Some(stat) => {
            // A zombie leader whose other threads run still holds the process's memory, as
            // the real driver keeps it until the process's last thread is gone.
            let running = match stat.state {
                b'X' | b'x' => false,
                b'Z' => other_thread_runs(pid),
                _ => true,
            };
            running && (start_time == 0 || stat.start_time == start_time)
        }
        None => {
            // No /proc entry: either the process is gone or /proc is unusable here; ask the
            // kernel directly. Only ESRCH means "gone".
            // SAFETY: kill with signal 0 sends nothing; it only checks that the pid exists.
            let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
            rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
        }
    }
}

/// Whether a thread of process `pid` other than its leader is listed in its `task` directory.
fn other_thread_runs(pid: u32) -> bool {
    let leader = pid.to_string();
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| tasks.flatten().any(|task| task.file_name().to_str().is_some_and(|tid| tid != leader)))
        .unwrap_or(false)
}

/// The pid the process `owner` has in the pid namespace of `me`, as NVML reports it (the
/// caller's view): its own pid when they share a namespace; else the process whose
/// innermost `NSpid` is `owner.pid`, in `owner`'s namespace, with its start time; `None` when
/// `me` cannot see it (a process of another container, seen from inside one).
pub fn pid_seen_by(owner: &ProcId, me: &ProcId) -> Option<u32> {
    if owner.pidns == me.pidns || owner.pidns == 0 {
        return Some(owner.pid);
    }
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let ns = std::fs::metadata(format!("/proc/{pid}/ns/pid")).ok()?.ino();
        if ns != owner.pidns {
            return None;
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let inner: u32 = status.lines().find(|l| l.starts_with("NSpid:"))?.split_whitespace().last()?.parse().ok()?;
        let started = read_stat(&pid.to_string())?.start_time;
        (inner == owner.pid && (owner.start_time == 0 || started == owner.start_time)).then_some(pid)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_names() {
        let line = "1234 (a) b (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        let stat = parse_stat(line).expect("parse");
        assert_eq!(stat.state, b'S');
        assert_eq!(stat.start_time, 987654);
        assert_eq!(parse_stat("1234 (x) S 1 2"), None);
    }

    #[test]
    fn self_is_alive() {
        let me = ProcId::current();
        assert!(me.start_time > 0);
        assert!(is_alive(me.pid, me.start_time));
        assert!(!is_alive(me.pid, me.start_time + 1));
        assert!(!is_alive(0, 0));
    }
}
