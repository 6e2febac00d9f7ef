//! Pidfds: a descriptor on the very process a pid named when it was opened (its pid reused is
//! another process, which the pidfd never names). What the agent asks of them: to open one
//! ([`open`]), whether their processes have exited (one `poll` for many, [`exited`]), to
//! signal one ([`send_signal`]); and [`Living`], which of a set of pids still run the process
//! first read there.
//!
//! [`Living`] serves the joins with the driver's processes (the reconcile pass's and the driver
//! task's): a process is looked up in `/proc` once (its start time), with a pidfd opened on it
//! first; a later call polls the pidfds together, and one that is readable (its process exited,
//! a zombie or reaped) is dropped and the pid looked up in `/proc` again, as every pid was
//! before. At most [`MAX_PIDFDS`] are held (the rest, and every pid on a kernel without
//! `pidfd_open`, are looked up in `/proc` at each call); those of pids no longer asked about
//! are closed.
use std::{
    collections::HashMap,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
};

/// Pidfds a [`Living`] holds at most (the driver's processes on a node: tens, rarely hundreds).
pub const MAX_PIDFDS: usize = 512;

/// The pidfds of the driver's processes known to run, with their start times.
#[derive(Default)]
pub struct Living {
    known: HashMap<u32, (OwnedFd, u64)>,
    /// `/proc/<pid>/stat` reads made (for tests).
    lookups: u64,
}

impl Living {
    /// The start time of the process each of `pids` is now (`None`: gone, or a zombie), as
    /// `start_time_of` says it (`/proc`), looked up only for pids not known to run still.
    pub fn start_times(&mut self, pids: &[u32], start_time_of: impl Fn(u32) -> Option<u64>) -> HashMap<u32, Option<u64>> {
        self.known.retain(|pid, _| pids.binary_search(pid).is_ok());
        let exited = self.exited();
        let mut starts = HashMap::with_capacity(pids.len());
        for &pid in pids {
            if !exited.contains(&pid) {
                if let Some((_, start)) = self.known.get(&pid) {
                    starts.insert(pid, Some(*start));
                    continue;
                }
            }
            self.known.remove(&pid);
            starts.insert(pid, self.look_up(pid, &start_time_of));
        }
        starts
    }

    /// `pid`'s start time from `/proc`, and a pidfd kept on it when it runs.
    fn look_up(&mut self, pid: u32, start_time_of: &impl Fn(u32) -> Option<u64>) -> Option<u64> {
        self.lookups += 1;
        let pidfd = (self.known.len() < MAX_PIDFDS).then(|| open(pid).ok()).flatten();
        let start = start_time_of(pid)?;
        // Opened before the read and still not readable after it: the process read is the
        // one the pidfd names (a pid is not reused while its process, or its zombie, exists).
        if let Some(pidfd) = pidfd.filter(|pidfd| !exited(&[pidfd.as_raw_fd()]).first().copied().unwrap_or(true)) {
            self.known.insert(pid, (pidfd, start));
        }
        Some(start)
    }

    /// The known pids whose process has exited (one `poll` for all).
    fn exited(&self) -> Vec<u32> {
        let (pids, fds): (Vec<u32>, Vec<i32>) = self.known.iter().map(|(pid, (fd, _))| (*pid, fd.as_raw_fd())).unzip();
        exited(&fds).into_iter().zip(pids).filter_map(|(gone, pid)| gone.then_some(pid)).collect()
    }

    #[cfg(test)]
    fn held(&self) -> usize {
        self.known.len()
    }
}

/// A pidfd on host process `pid` (an error if it is gone, ESRCH, or the kernel has none).
pub fn open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a pid and flags, and returns a new descriptor or -1; it
    // touches no memory of ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned to us, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// For each pidfd of `fds`, whether its process has exited (the pidfd is readable) or the
/// poll failed on it (taken as exited: the caller then asks /proc again). Does not wait.
pub fn exited(fds: &[RawFd]) -> Vec<bool> {
    let mut polled: Vec<libc::pollfd> = fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: poll(2) over a vector of pollfds it owns for the call, without waiting.
    let ready = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, 0) };
    if ready < 0 {
        return vec![true; fds.len()];
    }
    polled.iter().map(|p| p.revents != 0).collect()
}

/// Sends `signal` to the process `pidfd` names (never to another with its pid since).
pub fn send_signal(pidfd: &OwnedFd, signal: i32) -> io::Result<()> {
    // SAFETY: pidfd_send_signal(2) on a pidfd we hold, no siginfo, no flags.
    let rc = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), signal, std::ptr::null::<libc::siginfo_t>(), 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child that sleeps until killed, and is reaped when dropped.
    struct Child(std::process::Child);

    impl Child {
        fn start() -> Child {
            Child(std::process::Command::new("sleep").arg("1000").spawn().expect("spawn sleep"))
        }
        fn pid(&self) -> u32 {
            self.0.id()
        }
    }

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn a_running_process_is_read_from_proc_once_and_an_exit_is_seen() {
        let (a, mut b) = (Child::start(), Child::start());
        let mut pids = vec![a.pid(), b.pid()];
        pids.sort_unstable();
        let mut living = Living::default();
        let proc = ledger::process::running_start_time_of;
        let first = living.start_times(&pids, proc);
        assert!(first.values().all(Option::is_some), "{first:?}");
        assert_eq!((living.lookups, living.held()), (2, 2));
        for _ in 0..10 {
            assert_eq!(living.start_times(&pids, proc), first);
        }
        assert_eq!(living.lookups, 2, "no /proc read while both run");

        // b exits (a zombie until reaped: not running), then is reaped.
        b.0.kill().expect("kill");
        let gone = b.pid();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let after = living.start_times(&pids, proc);
        assert_eq!(after.get(&gone), Some(&None), "a zombie does not run");
        assert_eq!(after.get(&a.pid()), first.get(&a.pid()));
        assert_eq!(living.lookups, 3, "only the exited one read again");
        let _ = b.0.wait();
        assert_eq!(living.start_times(&pids, proc).get(&gone), Some(&None));
        // A pid the driver no longer reports is let go.
        living.start_times(&[a.pid()], proc);
        assert_eq!(living.held(), 1);
    }

    #[test]
    fn a_pid_whose_process_is_another_now_gets_the_new_start_time() {
        let child = Child::start();
        let pid = child.pid();
        let mut living = Living::default();
        // The first read says 1000; the pidfd, opened on the real process, is kept with it.
        living.start_times(&[pid], |_| Some(1000));
        drop(child);
        // Exited and reaped: the pidfd says so, and /proc is asked again (here: a new process
        // with the pid, started at 2000).
        assert_eq!(living.start_times(&[pid], |_| Some(2000)).get(&pid), Some(&Some(2000)));
    }
}
