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
        Some(running_start_time(&self.pid.to_string()) == Some(self.start_time))
    }
}

/// The start time of process `pid` (as this process's /proc shows it) while it runs: `None`
/// when it is gone or a zombie (every thread exited, not yet reaped: its memory is already
/// released; a leader whose other threads run is not one, see [`runs`]).
pub fn running_start_time_of(pid: u32) -> Option<u64> {
    running_start_time(&pid.to_string())
}

/// Whether host process `pid` (as this process's /proc shows it) still runs the process that
/// started at `start_time`: `Some(false)` when it certainly does not (no such pid, a zombie ([`runs`]), or
/// the pid reused by a process that started at another time: a process never changes pid, so
/// the one that started at `start_time` is gone for good); `None` when /proc cannot say (any
/// other read error, an unparsable line).
pub fn still_runs(pid: u32, start_time: u64) -> Option<bool> {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let (state, start) = parse_stat(&stat)?;
            Some(start == start_time && runs(&pid.to_string(), state))
        }
        // ESRCH: the process died between the open and the read.
        Err(error) if error.kind() == io::ErrorKind::NotFound || error.raw_os_error() == Some(libc::ESRCH) => Some(false),
        Err(_) => None,
    }
}

fn running_start_time(pid: &str) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (state, start) = parse_stat(&stat)?;
    runs(pid, state).then_some(start)
}

/// Whether process `pid`, whose `/proc/<pid>/stat` says `state`, still runs. A zombie runs
/// when another of its threads does: `stat` shows the state of the thread-group leader, which
/// is a zombie from the moment its own thread exits (`pthread_exit` in `main`) while the other
/// threads go on, holding the process's memory (the process's pidfd and the kernel's exit of
/// the whole group come only with its last thread). Only a zombie's `task` directory is read.
fn runs(pid: &str, state: char) -> bool {
    match state {
        'X' | 'x' => false,
        'Z' => pid.parse().is_ok_and(has_other_threads),
        _ => true,
    }
}

/// Up to `limit` threads of process `pid` other than its leader, in the order
/// `/proc/<pid>/task` lists them. Where the leader exited alone, the kernel let go of its
/// address space and its descriptor table: `/proc/<pid>/maps`, `map_files` and `fd` are
/// empty, and its threads' show the address space they share and their descriptor tables
/// (usually one shared table, but a thread may have one of its own).
pub fn other_threads(pid: u32, limit: usize) -> Vec<u32> {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok()).filter(|&tid| tid != pid).take(limit).collect()
}

/// Whether process `pid` has threads besides its leader (`/proc/<pid>/task`'s link count is 2
/// plus one per thread): one `stat`, to tell a leader that exited alone from a kernel thread
/// or a process with one thread before listing its threads.
pub fn has_other_threads(pid: u32) -> bool {
    fs::metadata(format!("/proc/{pid}/task")).is_ok_and(|meta| meta.nlink() > 3)
}

fn start_time(pid: &str) -> io::Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&stat)
        .map(|(_, start)| start)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("unreadable /proc/{pid}/stat")))
}

/// Field 3 (state) and field 22 (start time) of a `/proc/<pid>/stat` line. The command name
/// (field 2) may contain spaces and parentheses, so fields are counted after its last `)`.
fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 22 is the 19th after the state.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_survives_odd_command_names() {
        let stat = "1234 (a) b (c) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 100";
        assert_eq!(parse_stat(stat), Some(('S', 987654)));
        let zombie = "77 (gone) Z 1 77 77 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 5555 0 0";
        assert_eq!(parse_stat(zombie), Some(('Z', 5555)));
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

    #[test]
    fn still_runs_tells_gone_from_reused_from_unknown() {
        let me = ProcessIdentity::current().expect("own identity");
        assert_eq!(still_runs(me.pid, me.start_time), Some(true));
        assert_eq!(still_runs(me.pid, me.start_time + 1), Some(false), "another start time: the pid was reused");
        // A pid above the kernel's limit (4194304 at most) never exists.
        assert_eq!(still_runs(u32::MAX - 1, me.start_time), Some(false));
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        // Not reaped until `wait`: readable in /proc, running or a zombie.
        let start = start_time(&pid.to_string()).expect("the child's start time");
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(still_runs(pid, start), Some(false), "an exited, unreaped child (a zombie) does not run");
        child.wait().expect("reap");
        assert_eq!(still_runs(pid, start), Some(false), "a reaped child is gone");
    }

    /// Waits up to 5 s for `done` to hold of child `pid`'s /proc entry.
    fn wait_until(pid: u32, what: &str, done: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "child {pid}: {what} within 5 s");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn a_process_whose_main_thread_exited_alone_runs_until_its_last_thread_does() {
        extern "C" fn sleeper(_: *mut libc::c_void) -> *mut libc::c_void {
            loop {
                // SAFETY: pause(2) waits for a signal; the test's SIGKILL ends the process.
                unsafe { libc::pause() };
            }
        }
        // SAFETY: fork(2); the child only starts a thread and ends its own (glibc leaves its
        // allocator and thread bookkeeping usable in a forked child), then never returns here.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            let mut thread: libc::pthread_t = 0;
            // SAFETY: a thread running `sleeper`, which takes no argument; then exit(2) (not
            // exit_group) ends this thread alone, without unwinding.
            unsafe {
                if libc::pthread_create(&mut thread, std::ptr::null(), sleeper, std::ptr::null_mut()) != 0 {
                    libc::_exit(3);
                }
                libc::syscall(libc::SYS_exit, 0);
            }
            unreachable!("exit(2) returned");
        }
        /// Kills and reaps the child if the test fails before it does (its thread would hold
        /// the test's output pipe open).
        struct Reaped(libc::pid_t);
        impl Drop for Reaped {
            fn drop(&mut self) {
                if self.0 > 0 {
                    // SAFETY: kill(2) and waitpid(2) of our own unreaped child.
                    unsafe {
                        libc::kill(self.0, libc::SIGKILL);
                        libc::waitpid(self.0, std::ptr::null_mut(), 0);
                    }
                }
            }
        }
        let mut guard = Reaped(pid);
        let pid = pid as u32;
        let start = start_time(&pid.to_string()).expect("the child's start time");
        let state = || fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|stat| parse_stat(&stat)).map(|(state, _)| state);
        wait_until(pid, "its leader a zombie", || state() == Some('Z'));
        assert_eq!(still_runs(pid, start), Some(true), "its other thread runs: the process runs");
        assert_eq!(running_start_time_of(pid), Some(start));
        // SAFETY: kill(2) of our own unreaped child: the pid names it.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
        wait_until(pid, "its last thread gone", || fs::read_dir(format!("/proc/{pid}/task")).map_or(true, |tasks| tasks.count() <= 1));
        assert_eq!(still_runs(pid, start), Some(false), "every thread exited, not reaped yet: a zombie");
        assert_eq!(running_start_time_of(pid), None);
        let mut status = 0;
        // SAFETY: waits for our own child, with a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) }, pid as libc::pid_t);
        guard.0 = 0;
        assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL, "killed, status {status}");
    }
}
