//! The kernel's own syscall tracepoints (`events/syscalls/sys_enter_*`), read through a tracefs
//! instance of the test's own: an isolated ring buffer with its own event switches and pid
//! filter, so that nothing else tracing on the machine sees or disturbs it. What a process's
//! threads called, in order, is what a test can hold durability to (an `fsync(2)` before and
//! after a `rename(2)`) where no crash can be staged. Needs root, tracefs and syscall
//! tracepoints (`CONFIG_FTRACE_SYSCALLS`); a test fails, saying which, where they are missing.
use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{bail, Context, Result};

/// Where tracefs is mounted.
const TRACEFS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// A tracefs instance recording some syscalls of one process (its threads now, and those they
/// start), removed when dropped.
pub struct SyscallTrace {
    dir: PathBuf,
    events: Vec<PathBuf>,
}

impl SyscallTrace {
    /// Starts recording the `sys_enter_<name>` tracepoint of each of `syscalls` for process
    /// `pid`'s threads and their children.
    pub fn start(pid: u32, syscalls: &[&str]) -> Result<SyscallTrace> {
        let root = TRACEFS.iter().map(Path::new).find(|dir| dir.join("instances").is_dir()).context("no tracefs with instances (mount tracefs at /sys/kernel/tracing)")?;
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let dir = root.join("instances").join(format!("vramguard-e2e-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir(&dir).with_context(|| format!("cannot create the tracefs instance {}", dir.display()))?;
        let mut trace = SyscallTrace { dir, events: Vec::new() };
        let write = |file: &Path, text: &str| std::fs::write(file, text).with_context(|| format!("cannot write {text:?} to {}", file.display()));
        // One clock for every CPU: a thread that moves between CPUs is still read in order.
        write(&trace.dir.join("trace_clock"), "global")?;
        write(&trace.dir.join("options/event-fork"), "1")?;
        // The threads now (read again until no thread started meanwhile: later ones are
        // added by event-fork).
        let threads = |pid: u32| -> Result<Vec<String>> {
            let mut threads: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
                .with_context(|| format!("process {pid}'s threads"))?
                .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
                .collect();
            threads.sort();
            Ok(threads)
        };
        let mut seen = threads(pid)?;
        loop {
            write(&trace.dir.join("set_event_pid"), &seen.join(" "))?;
            let now = threads(pid)?;
            if now.iter().all(|thread| seen.contains(thread)) {
                break;
            }
            seen = now;
        }
        for name in syscalls {
            let event = trace.dir.join("events/syscalls").join(format!("sys_enter_{name}"));
            if !event.is_dir() {
                bail!("no syscall tracepoint {} (a kernel without CONFIG_FTRACE_SYSCALLS?)", event.display());
            }
            write(&event.join("enable"), "1")?;
            trace.events.push(event);
        }
        Ok(trace)
    }

    /// The syscalls recorded so far, by name, in order.
    pub fn calls(&self) -> Result<Vec<String>> {
        let text = std::fs::read_to_string(self.dir.join("trace")).with_context(|| format!("cannot read {}/trace", self.dir.display()))?;
        Ok(text.lines().filter(|line| !line.starts_with('#')).filter_map(syscall_of).map(str::to_owned).collect())
    }
}

/// The syscall a trace line records (`… 123.456: sys_fsync(fd: 0x5)` → `fsync`).
fn syscall_of(line: &str) -> Option<&str> {
    let (_, event) = line.split_once(": sys_")?;
    event.split_once('(').map(|(name, _)| name)
}

impl Drop for SyscallTrace {
    fn drop(&mut self) {
        for event in &self.events {
            let _ = std::fs::write(event.join("enable"), "0");
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_names_its_syscall() {
        assert_eq!(syscall_of("  tokio-runtime-w-4242    [001] .....  1234.567890: sys_fsync(fd: 0x00000007)"), Some("fsync"));
        assert_eq!(syscall_of("vramguard-9 [000] ..... 1.2: sys_renameat2(olddfd: 0xffffff9c, oldname: 0x7f, newdfd: 0xffffff9c)"), Some("renameat2"));
        assert_eq!(syscall_of("# tracer: nop"), None);
    }

    #[test]
    fn this_process_s_fsync_and_rename_are_recorded_in_order() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("vramguard-ftrace-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let trace = SyscallTrace::start(std::process::id(), &["fsync", "rename", "renameat", "renameat2"])?;
        std::thread::spawn({
            let dir = dir.clone();
            move || -> std::io::Result<()> {
                let file = std::fs::File::create(dir.join("a"))?;
                file.sync_all()?;
                std::fs::rename(dir.join("a"), dir.join("b"))?;
                std::fs::File::open(&dir)?.sync_all()
            }
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the writer panicked"))??;
        let calls = trace.calls()?;
        drop(trace);
        let _ = std::fs::remove_dir_all(&dir);
        let order: Vec<&str> = calls.iter().map(|c| if c == "fsync" { "F" } else { "R" }).collect();
        assert_eq!(order, ["F", "R", "F"], "a thread started after the trace is traced too: {calls:?}");
        Ok(())
    }
}
