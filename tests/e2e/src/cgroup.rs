//! Throw-away cgroup v2 groups for tests: created under the cgroup2 mount, joined by a child
//! between fork and exec, removed on drop.
use std::{
    ffi::CString,
    fs,
    os::unix::{ffi::OsStrExt, fs::MetadataExt, process::CommandExt},
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use anyhow::{anyhow, Context, Result};

/// The agent's flag stating that every container has a cgroup2 group of its own, which
/// `--enforce signal` needs on a hybrid cgroup node such as the CI machines (pure cgroup v2
/// nodes need no statement). The tests that enforce place every process they limit in a
/// [`TestCgroup`] of its own, so the statement holds for them.
pub const SEPARATES_CONTAINERS: &str = "--cgroup2-separates-containers";

/// A cgroup made for one test.
pub struct TestCgroup {
    dir: PathBuf,
    /// The directory made under the cgroup2 root (`dir` itself, or an ancestor of it).
    top: PathBuf,
    /// The cgroup id (`bpf_get_current_cgroup_id`): the inode of its directory.
    pub id: u64,
    /// Its path relative to the cgroup2 root, as the agent prints it.
    pub path: String,
}

impl TestCgroup {
    /// Creates `vramguard-test-<name>-<pid>-<n>` under the cgroup2 mount.
    pub fn create(name: &str) -> Result<TestCgroup> {
        Self::create_nested(name, "")
    }

    /// Creates `vramguard-test-<name>-<pid>-<n>/<inner>` under the cgroup2 mount (`inner`
    /// a relative path of one or more components, e.g. one shaped like a pod's and
    /// container's cgroups); the test's processes go in the innermost one.
    pub fn create_nested(name: &str, inner: &str) -> Result<TestCgroup> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let root = cgroup2_root()?;
        let leaf = format!(
            "vramguard-test-{name}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let top = root.join(&leaf);
        fs::create_dir(&top)
            .with_context(|| format!("cannot create cgroup {} (tests need root)", top.display()))?;
        let inner = inner.trim_matches('/');
        let (dir, path) = if inner.is_empty() {
            (top.clone(), format!("/{leaf}"))
        } else {
            (top.join(inner), format!("/{leaf}/{inner}"))
        };
        // Made before the cgroup owns it, so a failure here leaves `top` to clean up.
        let mut cgroup = TestCgroup { dir, top, id: 0, path };
        fs::create_dir_all(&cgroup.dir).with_context(|| format!("cannot create cgroup {}", cgroup.dir.display()))?;
        cgroup.id = fs::metadata(&cgroup.dir)?.ino();
        Ok(cgroup)
    }

    /// Makes the command's child join this cgroup before it executes.
    pub fn enter(&self, command: &mut Command) -> Result<()> {
        join_before_exec(command, &self.procs_file())
    }

    /// The `cgroup.procs` file of this cgroup.
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }
}

/// Makes the command's child write itself into the cgroup.procs file `procs` between fork and
/// exec, so everything it runs, from its first instruction, belongs to that cgroup.
pub fn join_before_exec(command: &mut Command, procs: &Path) -> Result<()> {
    let procs = CString::new(procs.as_os_str().as_bytes()).context("cgroup path with a NUL byte")?;
    // SAFETY: the closure only makes async-signal-safe system calls (open, write, close) on
    // memory prepared before the fork; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // "0" moves the writing process itself.
            let written = libc::write(fd, b"0".as_ptr().cast(), 1);
            let error = std::io::Error::last_os_error();
            libc::close(fd);
            if written != 1 {
                return Err(error);
            }
            Ok(())
        });
    }
    Ok(())
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Innermost first; members may still be exiting: retry for a little while.
        let mut dir = self.dir.clone();
        loop {
            let removed = (0..50).any(|_| {
                let gone = fs::remove_dir(&dir).is_ok() || !dir.exists();
                if !gone {
                    std::thread::sleep(Duration::from_millis(20));
                }
                gone
            });
            if !removed {
                eprintln!("warning: could not remove test cgroup {}", dir.display());
                return;
            }
            if dir == self.top {
                return;
            }
            match dir.parent() {
                Some(parent) => dir = parent.to_path_buf(),
                None => return,
            }
        }
    }
}

/// The cgroup2 mount point.
pub fn cgroup2_root() -> Result<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
    mountinfo
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = left.split_whitespace().nth(4)?;
            (right.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount_point))
        })
        .ok_or_else(|| anyhow!("no cgroup2 hierarchy is mounted"))
}
