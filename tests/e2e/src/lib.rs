//! End-to-end test kit: finds the built binaries and the fake driver, gives each test its own
//! fake machine ([`FakeNode`]: a unique `FAKECUDA_NODE`, so tests running in parallel never
//! share devices, and removal of its state files afterwards), and runs `fakecuda-workload`
//! processes ([`Workload`] → [`Running`] → [`Finished`]) whose output lines a test can read
//! and whose checkpoints it can answer.
//!
//! The binaries are not built by `cargo test -p e2e`; build them first:
//! `cargo build -p fakecuda -p workload` (and `-p hook` for the hook's tests; same profile as
//! the tests), or run `cargo xtask test`.
//!
//! A workload runs without the hook unless a test asks for it ([`FakeNode::hooked`]): the
//! test's own `LD_PRELOAD`, `FAKECUDA_*`, `VRAMGUARD_*`, `CUDA_DEVICE_MEMORY_*` and downward
//! API (`POD_NAMESPACE`, `POD_NAME`, `CONTAINER_NAME`) variables are never inherited, so
//! e.g. [`FakeNode::devstat`] always asks the fake driver itself.
//!
//! [`agent`] starts a `vramguard run` for a test; [`cgroup`] makes a cgroup for one;
//! [`http`] scrapes its metrics; [`ledgers`] reads (and scribbles on) ledger files;
//! [`hostile`] is what every attack test checks while its attack runs; [`crafted_elf`] makes
//! the ELF files of the attacks on discovery's time.
//! [`containerd`] runs a real containerd with NRI (from the cache `cargo xtask setup` fills)
//! and drives it through CRI; [`prometheus`] runs a real Prometheus (same cache) on the
//! shipped manifests' scrape configuration and alert rules.
//! [`TempDir`], [`wait_for`] and [`holding`] are the small helpers the agent's tests share.

pub mod agent;
pub mod cgroup;
pub mod containerd;
pub mod crafted_elf;
pub mod ftrace;
pub mod hostile;
pub mod http;
pub mod ledgers;
pub mod prometheus;
pub mod webhook;

use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// Set (to `1`) by `cargo xtask test` for a test binary that runs beside others: an agent
/// that discovers libcuda on the whole node (no `--no-discover`) would find the other
/// binaries' fake drivers, so [`agent::Agent`] refuses to start one there; such a test says
/// `/// Runs alone: <why>` in its doc (or its file `//! Runs alone: <why>`).
pub const SHARED_NODE: &str = "VRAMGUARD_E2E_SHARED_NODE";

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// The driver version [`FakeNode::r615`] gives a node: a driver with per-cgroup memory limits.
pub const R615_DRIVER_VERSION: &str = "615.10.02";

/// The fake driver's default context reserve (`FAKECUDA_CONTEXT_BYTES`).
pub const DEFAULT_CONTEXT_BYTES: u64 = 64 * MIB;

/// How long a test waits for a workload line or exit: `E2E_TIMEOUT_SECS`, default 30.
pub fn timeout() -> Duration {
    let secs = std::env::var("E2E_TIMEOUT_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    Duration::from_secs(secs)
}

/// `target/<profile>`, from the running test binary's path (`target/<profile>/deps/<test>`).
pub fn target_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the test executable's path")?;
    let dir = exe.parent().ok_or_else(|| anyhow!("{} has no parent directory", exe.display()))?;
    let dir = if dir.file_name() == Some(OsStr::new("deps")) {
        dir.parent().ok_or_else(|| anyhow!("{} has no parent directory", dir.display()))?
    } else {
        dir
    };
    Ok(dir.to_path_buf())
}

fn built(name: &str, package: &str) -> Result<PathBuf> {
    let path = target_dir()?.join(name);
    if !path.is_file() {
        bail!("{} is not built: run `cargo build -p {package}` (same profile as the tests) first", path.display());
    }
    Ok(path)
}

/// The `fakecuda-workload` binary.
pub fn workload_bin() -> Result<PathBuf> {
    built("fakecuda-workload", "workload")
}

/// The hook, `libvramguard.so` (`target/<profile>/libvramguard.so`).
pub fn hook_lib() -> Result<PathBuf> {
    let path = target_dir()?.join("libvramguard.so");
    if !path.is_file() {
        bail!(
            "{} is not built: run `cargo xtask test` (or `cargo build -p hook`, same profile as the tests) first",
            path.display()
        );
    }
    Ok(path)
}

/// The fake driver library of this test binary (`libcuda.so.1` of [`fake_driver_dir`]).
pub fn fake_driver_lib() -> Result<PathBuf> {
    Ok(fake_driver_dir()?.join("libcuda.so.1"))
}

/// The fake driver of this test binary, for `LD_LIBRARY_PATH` and `--libcuda`:
/// `target/<profile>/fakecuda/<binary>/` holding `libcuda.so.1`, a copy of the built
/// `target/<profile>/libcuda.so` of its own, and `libnvidia-ml.so.1` → `libcuda.so.1` (the fake
/// driver is a fake NVML too).
///
/// A copy, not a link: uprobes are set on a file (an inode), so an agent of one test binary
/// sees allocations through its own copy only, and `cargo xtask test` can run test binaries
/// side by side. (An agent that discovers libraries on the whole node still finds the others'
/// copies: such tests run alone.) Made once per process; kept while the build's library is
/// not newer; safe against concurrent callers.
pub fn fake_driver_dir() -> Result<PathBuf> {
    static DIR: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut made = DIR.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(dir) = made.as_ref() {
        return Ok(dir.clone());
    }
    let profile_dir = target_dir()?;
    let lib = profile_dir.join("libcuda.so");
    if !lib.is_file() {
        bail!("{} is not built: run `cargo build -p fakecuda` in the tests' profile first", lib.display());
    }
    let exe = std::env::current_exe().context("cannot find the test executable's path")?;
    let dir = profile_dir.join("fakecuda").join(binary_name(&exe));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    copy_into_place(&lib, &dir.join("libcuda.so.1"))?;
    link_into_place(&dir, "libnvidia-ml.so.1", Path::new("libcuda.so.1"))?;
    *made = Some(dir.clone());
    Ok(dir)
}

/// The driver version [`install_fake_driver`] names its files with.
pub const INSTALLED_VERSION: &str = "580.65.06";

/// Makes `root` (standing for a host's `/`) hold this test binary's fake driver at `dir`
/// (`usr/lib/x86_64-linux-gnu`, `run/nvidia/driver/usr/lib64`, ...) as NVIDIA's packages lay
/// it out: `libcuda.so.<version>` and `libnvidia-ml.so.<version>` ([`INSTALLED_VERSION`]),
/// each a hard link to [`fake_driver_lib`] (a copy where it is on another file system), and
/// `libcuda.so.1`, `libnvidia-ml.so.1` relative symlinks to them. Returns the directory.
pub fn install_fake_driver(root: &Path, dir: &str) -> Result<PathBuf> {
    let lib = fake_driver_lib()?;
    let at = root.join(dir);
    std::fs::create_dir_all(&at).with_context(|| format!("cannot create {}", at.display()))?;
    for name in ["libcuda.so", "libnvidia-ml.so"] {
        let file = format!("{name}.{INSTALLED_VERSION}");
        if std::fs::hard_link(&lib, at.join(&file)).is_err() {
            std::fs::copy(&lib, at.join(&file)).with_context(|| format!("cannot copy {} into {}", lib.display(), at.display()))?;
        }
        std::os::unix::fs::symlink(&file, at.join(format!("{name}.1"))).with_context(|| format!("cannot link {name}.1 in {}", at.display()))?;
    }
    Ok(at)
}

/// The name of a test binary without cargo's hash (`accounting-0123456789abcdef` →
/// `accounting`), so a rebuild reuses its directory.
fn binary_name(exe: &Path) -> String {
    let name = exe.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // A binary rebuilt while it runs (`cargo xtask test` rebuilds xtask) reads as deleted.
    let name = name.strip_suffix(" (deleted)").map(str::to_string).unwrap_or(name);
    match name.rsplit_once('-') {
        Some((stem, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => stem.to_string(),
        _ => name,
    }
}

/// Copies `from` to `to` (through a unique temporary name, renamed into place) unless `to` is
/// already a copy at least as new, of the same length.
fn copy_into_place(from: &Path, to: &Path) -> Result<()> {
    let source = std::fs::metadata(from).with_context(|| format!("cannot read {}", from.display()))?;
    if let Ok(copy) = std::fs::symlink_metadata(to) {
        if copy.is_file() && copy.len() == source.len() && copy.modified().ok() >= source.modified().ok() {
            return Ok(());
        }
    }
    let name = to.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = to.with_file_name(format!(".{name}.{}.{}", std::process::id(), unique()));
    std::fs::copy(from, &tmp).with_context(|| format!("cannot copy {} to {}", from.display(), tmp.display()))?;
    std::fs::rename(&tmp, to).with_context(|| format!("cannot rename {} to {}", tmp.display(), to.display()))?;
    Ok(())
}

/// The fake driver shared by everything that runs the build in `profile_dir`
/// (`target/debug`, `target/release`) outside the tests (the benchmark):
/// `target/<profile>/fakecuda/` holding `libcuda.so.1` and `libnvidia-ml.so.1` → `../libcuda.so`.
/// Idempotent and safe against concurrent callers (each link is made under a unique name and
/// renamed into place).
pub fn fake_driver_dir_in(profile_dir: &Path) -> Result<PathBuf> {
    let lib = profile_dir.join("libcuda.so");
    if !lib.is_file() {
        bail!("{} is not built: run `cargo build -p fakecuda` in that profile first", lib.display());
    }
    let dir = profile_dir.join("fakecuda");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        link_into_place(&dir, name, Path::new("../libcuda.so"))?;
    }
    Ok(dir)
}

/// Makes `dir/name` a symlink to `target`, unless it already is one.
fn link_into_place(dir: &Path, name: &str, target: &Path) -> Result<()> {
    let link = dir.join(name);
    if std::fs::read_link(&link).ok().as_deref() == Some(target) {
        return Ok(());
    }
    let tmp = dir.join(format!(".{name}.{}.{}", std::process::id(), unique()));
    std::os::unix::fs::symlink(target, &tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    std::fs::rename(&tmp, &link).with_context(|| format!("cannot rename {} to {}", tmp.display(), link.display()))?;
    Ok(())
}

/// A directory of its own under the temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// `vramguard-e2e-<tag>-<pid>-<n>`, empty.
    pub fn new(tag: &str) -> Result<TempDir> {
        let dir = std::env::temp_dir().join(format!("vramguard-e2e-{tag}-{}-{}", std::process::id(), unique()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        Ok(TempDir(dir))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `<dir>/<pod>/ledger` (a container's directory, as the DaemonSet mounts them), its
    /// directory created.
    pub fn ledger(&self, pod: &str) -> Result<PathBuf> {
        std::fs::create_dir_all(self.0.join(pod))?;
        Ok(self.0.join(pod).join("ledger"))
    }
}

impl Drop for TempDir {
    /// Removes the directory, after unmounting what is mounted under it (the tmpfs of a
    /// ledger the agent provisioned for a container that the test's runtime never removed).
    fn drop(&mut self) {
        unmount_under(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Unmounts whatever is still mounted under `dir`, deepest first.
pub fn unmount_under(dir: &Path) {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else { return };
    let mut points: Vec<&str> = mountinfo.lines().filter_map(|line| line.split_whitespace().nth(4)).filter(|point| Path::new(point).starts_with(dir)).collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for point in points {
        let Ok(point) = std::ffi::CString::new(point) else { continue };
        // SAFETY: umount2(2) with a NUL-terminated path under the harness's own directory.
        unsafe { libc::umount2(point.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Polls `check` every millisecond until it holds or `limit` passes; returns the time taken.
pub fn wait_for(limit: Duration, what: &str, mut check: impl FnMut() -> Result<bool>) -> Result<Duration> {
    let start = Instant::now();
    loop {
        if check()? {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= limit {
            bail!("{what}: not within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Starts `workload` with `steps` followed by a checkpoint and `hold`, and waits for the
/// checkpoint: a process holding what its steps allocated until it is killed or dropped.
pub fn holding(workload: Workload, steps: &[&str]) -> Result<Running> {
    let mut running = workload.steps(steps.iter().copied()).steps(["checkpoint held", "hold"]).spawn()?;
    running.wait_checkpoint("held")?;
    Ok(running)
}

/// The first line of the fake driver's limits file (`tests/fakecuda/src/limits.rs`).
const LIMITS_HEADER: &str = "fakecuda-limits 1";

/// One line of the fake driver's limits file: `<key hex> <dev> <soft> <hard> <cgroup id> <path>`.
struct LimitEntry {
    key: u64,
    dev: u32,
    soft: u64,
    hard: u64,
    id: u64,
    rel: String,
    /// The line itself.
    line: String,
}

/// The entries of a limits file's text.
fn limit_entries(text: &str) -> Result<Vec<LimitEntry>> {
    let mut lines = text.lines();
    if lines.next() != Some(LIMITS_HEADER) {
        bail!("not a limits file of the fake driver: {text:?}");
    }
    lines
        .map(|line| {
            let f: Vec<&str> = line.splitn(6, ' ').collect();
            let num = |i: usize| f.get(i).and_then(|w| w.parse::<u64>().ok());
            let entry = (|| {
                let key = u64::from_str_radix(f.first()?, 16).ok()?;
                let dev = u32::try_from(num(1)?).ok()?;
                let rel = f.get(5)?.to_string();
                Some(LimitEntry { key, dev, soft: num(2)?, hard: num(3)?, id: num(4)?, rel, line: line.to_owned() })
            })();
            entry.ok_or_else(|| anyhow!("a bad line in the fake driver's limits file: {line:?}"))
        })
        .collect()
}

fn unique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A fake machine of its own for one test: a unique `FAKECUDA_NODE` in a state directory.
/// Dropping it removes the device state files.
pub struct FakeNode {
    name: String,
    state_dir: PathBuf,
    env: Vec<(OsString, OsString)>,
}

impl FakeNode {
    /// A node named after `tag` (letters, digits, `-`), unique to this process and call.
    pub fn new(tag: &str) -> FakeNode {
        let tag: String = tag.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' }).collect();
        let name = format!("e2e-{tag}-{}-{}", std::process::id(), unique());
        let shm = Path::new("/dev/shm");
        let state_dir = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
        let mut node = FakeNode { name, state_dir, env: Vec::new() };
        node.cleanup();
        node.env = vec![
            ("FAKECUDA_NODE".into(), node.name.clone().into()),
            ("FAKECUDA_STATE_DIR".into(), node.state_dir.clone().into()),
        ];
        node
    }

    /// A node whose driver is r615 or later ([`R615_DRIVER_VERSION`]): per-cgroup memory
    /// limits (`nvmlDeviceSetMemoryLimits_v1`), CUDA 13.4. [`FakeNode::new`] is a 580 driver.
    pub fn r615(tag: &str) -> FakeNode {
        FakeNode::new(tag).with_driver_version(R615_DRIVER_VERSION)
    }

    /// Makes every process of this node (workloads, and an agent given [`FakeNode::env`]) see
    /// `FAKECUDA_DRIVER_VERSION=version` (`MAJOR.MINOR[.PATCH]`; a major of 615 or more has
    /// per-cgroup memory limits).
    pub fn with_driver_version(self, version: &str) -> FakeNode {
        self.with_env("FAKECUDA_DRIVER_VERSION", version)
    }

    /// Adds a `FAKECUDA_*` setting (or any variable) for every workload of this node.
    pub fn with_env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> FakeNode {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The `FAKECUDA_NODE` value.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `FAKECUDA_STATE_DIR` value.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The state file of device `index`.
    pub fn device_file(&self, index: u32) -> PathBuf {
        self.state_dir.join(format!("{}-dev{index}", self.name))
    }

    /// The per-cgroup memory limits the fake driver keeps for the cgroup at `cgroup_rel_path`
    /// (relative to the cgroup2 root, e.g. [`cgroup::TestCgroup::path`]) on device `dev`, read
    /// from the node's limits file: `Some((soft, hard, used))` as
    /// `nvmlDeviceGetMemoryLimits_v1` reports them (hard `u64::MAX`: no hard limit; `used`:
    /// what the live processes of the cgroup hold on the device, from the device file), `None`
    /// when none are set, or were set on a cgroup since removed (removal clears them). The
    /// fake's file formats are in `tests/fakecuda` (`limits.rs`, `devfile.rs`).
    pub fn driver_limit(&self, cgroup_rel_path: &str, dev: u32) -> Result<Option<(u64, u64, u64)>> {
        let Some((_, text)) = self.limits_file(libc::LOCK_SH)? else { return Ok(None) };
        let Some(e) = limit_entries(&text)?.into_iter().find(|e| e.dev == dev && e.rel == cgroup_rel_path) else {
            return Ok(None);
        };
        if let Ok(root) = cgroup::cgroup2_root() {
            use std::os::unix::fs::MetadataExt;
            let dir = root.join(cgroup_rel_path.trim_start_matches('/'));
            if std::fs::metadata(dir).map(|m| m.ino()).ok() != Some(e.id) {
                return Ok(None);
            }
        }
        Ok(Some((e.soft, e.hard, self.cgroup_used(e.key, dev)?)))
    }

    /// Removes the fake driver's limits of the cgroup at `cgroup_rel_path` on device `dev`
    /// behind everyone's back (as a driver reload would lose them); nothing set is no error.
    pub fn clear_driver_limit(&self, cgroup_rel_path: &str, dev: u32) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let Some((file, text)) = self.limits_file(libc::LOCK_EX)? else { return Ok(()) };
        let kept = limit_entries(&text)?.into_iter().filter(|e| !(e.dev == dev && e.rel == cgroup_rel_path));
        let kept: String = std::iter::once(LIMITS_HEADER.to_owned()).chain(kept.map(|e| e.line)).map(|line| line + "\n").collect();
        file.write_all_at(kept.as_bytes(), 0)?;
        file.set_len(kept.len() as u64)?;
        Ok(())
    }

    /// The node's limits file under `flock(how)` (held while the file is open; open to write
    /// for `LOCK_EX`), and its text; `None` when the fake has not made it.
    fn limits_file(&self, how: libc::c_int) -> Result<Option<(std::fs::File, String)>> {
        use std::os::fd::AsRawFd;
        let path = self.state_dir.join(format!("{}-limits", self.name));
        let file = match std::fs::OpenOptions::new().read(true).write(how == libc::LOCK_EX).open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot open {}", path.display())),
        };
        // SAFETY: flock on a descriptor `file` keeps open (released when it closes).
        if unsafe { libc::flock(file.as_raw_fd(), how) } != 0 {
            bail!("cannot lock {}: {}", path.display(), std::io::Error::last_os_error());
        }
        let mut text = String::new();
        (&file).read_to_string(&mut text).with_context(|| format!("cannot read {}", path.display()))?;
        Ok(Some((file, text)))
    }

    /// What the live processes whose device slots carry cgroup key `key` hold on device `dev`
    /// (a slot is live while some open file holds its lock byte; the fake's `devfile.rs`).
    fn cgroup_used(&self, key: u64, dev: u32) -> Result<u64> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::FileExt;
        let path = self.device_file(dev);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e).with_context(|| format!("cannot open {}", path.display())),
        };
        let mut header = [0u8; 40];
        file.read_exact_at(&mut header, 0)?;
        let word = |at: usize| u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]) as usize;
        if &header[..8] != b"FAKECUDA" || word(8) != 2 {
            bail!("{} is not a version-2 device file of the fake driver", path.display());
        }
        let (header_size, slot_size, slots) = (word(12), word(16), word(20).min(word(36)));
        // SAFETY: flock on a descriptor `file` keeps open (dropped with it).
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH) };
        let mut used = 0u64;
        for s in 0..slots {
            let mut slot = [0u8; 40];
            file.read_exact_at(&mut slot, (header_size + s * slot_size) as u64)?;
            let u64_at = |at: usize| u64::from_le_bytes(slot[at..at + 8].try_into().unwrap_or_default());
            if slot[..4] == [0; 4] || u64_at(32) != key {
                continue;
            }
            // SAFETY: an all-zero flock is valid; F_OFD_GETLK on our own descriptor only asks.
            let mut fl: libc::flock = unsafe { std::mem::zeroed() };
            fl.l_type = libc::F_WRLCK as libc::c_short;
            fl.l_whence = libc::SEEK_SET as libc::c_short;
            fl.l_start = (1i64 << 40) + s as i64;
            fl.l_len = 1;
            // SAFETY: as above, with a valid flock pointer.
            let held = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) } != 0 || fl.l_type != libc::F_UNLCK as libc::c_short;
            if held {
                used = used.saturating_add(u64_at(24));
            }
        }
        Ok(used)
    }

    /// The environment every workload of this node gets.
    pub fn env(&self) -> &[(OsString, OsString)] {
        &self.env
    }

    /// A ledger path of this node's own (`<state dir>/<node>.ledger`), removed with the node.
    pub fn ledger_path(&self) -> PathBuf {
        self.state_dir.join(format!("{}.ledger", self.name))
    }

    /// A workload on this node under the hook: `LD_PRELOAD` of [`hook_lib`], a quota of
    /// `limit` bytes on every device (`CUDA_DEVICE_MEMORY_LIMIT`), the ledger at `ledger`
    /// (`VRAMGUARD_LEDGER`), and a context reserve equal to what the fake charges per
    /// context (`VRAMGUARD_CONTEXT_RESERVE` = this node's `FAKECUDA_CONTEXT_BYTES`).
    pub fn hooked(&self, ledger: &Path, limit: u64) -> Result<Workload> {
        let context = self
            .env
            .iter()
            .rev()
            .find(|(k, _)| k == "FAKECUDA_CONTEXT_BYTES")
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| DEFAULT_CONTEXT_BYTES.to_string().into());
        Ok(self
            .workload()
            .env("LD_PRELOAD", hook_lib()?)
            .env("CUDA_DEVICE_MEMORY_LIMIT", limit.to_string())
            .env("VRAMGUARD_LEDGER", ledger)
            .env("VRAMGUARD_CONTEXT_RESERVE", context))
    }

    /// A workload on this node.
    pub fn workload(&self) -> Workload {
        let mut w = Workload::new();
        for (k, v) in &self.env {
            w = w.env(k, v);
        }
        w
    }

    /// (used, total) bytes of device `dev` across all processes, from a `devstat` workload
    /// (which reaps dead processes first).
    pub fn devstat(&self, dev: u32) -> Result<(u64, u64)> {
        let out = self.workload().step(format!("devstat {dev}")).run()?.success()?;
        let line = out.line("devstat ")?;
        Ok((field(line, "used")?, field(line, "total")?))
    }

    /// Device `dev`'s used bytes.
    pub fn used(&self, dev: u32) -> Result<u64> {
        Ok(self.devstat(dev)?.0)
    }

    /// Removes this node's device state files and limits file (and any temporaries of their
    /// creation).
    pub fn cleanup(&self) {
        let Ok(entries) = std::fs::read_dir(&self.state_dir) else { return };
        let prefix = format!("{}-dev", self.name);
        let tmp_prefix = format!(".{prefix}");
        // The ledger and the temporaries of its creation (`.<name>.ledger.creating.<pid>`).
        let ledger = format!("{}.ledger", self.name);
        let ledger_tmp = format!(".{ledger}.");
        // The fake driver's per-cgroup limits, and the temporaries of its creation.
        let limits = format!("{}-limits", self.name);
        let limits_tmp = format!(".{limits}.");
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let ours = [&prefix, &tmp_prefix, &ledger_tmp, &limits_tmp].iter().any(|p| name.starts_with(p.as_str()));
            if ours || name == ledger || name == limits {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        self.cleanup();
    }
}

/// How the workload finds entry points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Dlsym,
    Getproc,
}

/// The downward API variables the hook records in the ledger: never inherited either (the
/// test may itself run in a pod).
const DOWNWARD_API: [&str; 3] = ["POD_NAMESPACE", "POD_NAME", "CONTAINER_NAME"];

/// A `fakecuda-workload` command being put together.
#[derive(Debug, Clone, Default)]
pub struct Workload {
    args: Vec<OsString>,
    steps: Vec<String>,
    env: Vec<(OsString, OsString)>,
    lib_dirs: Vec<PathBuf>,
    /// A cgroup to join before exec, as its path under the cgroup2 root.
    cgroup: Option<PathBuf>,
    /// A program (and its arguments) that runs the workload: the workload's command line
    /// follows them.
    wrapper: Vec<OsString>,
    /// Another program run in the workload's place (a real client), with the same
    /// environment and command line (`args -- steps`).
    program: Option<PathBuf>,
}

impl Workload {
    /// A workload with no steps, the fake driver on `LD_LIBRARY_PATH`, and no `FAKECUDA_*`,
    /// `VRAMGUARD_*`, `CUDA_DEVICE_MEMORY_*`, `POD_NAMESPACE`, `POD_NAME`, `CONTAINER_NAME` or
    /// `LD_PRELOAD` inherited from the test's environment.
    pub fn new() -> Workload {
        Workload::default()
    }

    /// `--via dlsym|getproc`.
    pub fn via(self, via: Via) -> Workload {
        self.arg("--via").arg(match via {
            Via::Dlsym => "dlsym",
            Via::Getproc => "getproc",
        })
    }

    /// An extra command-line option (before the steps).
    pub fn arg(mut self, arg: impl Into<OsString>) -> Workload {
        self.args.push(arg.into());
        self
    }

    /// One step, e.g. `"alloc a 4m"`.
    pub fn step(mut self, step: impl Into<String>) -> Workload {
        self.steps.push(step.into());
        self
    }

    /// Several steps.
    pub fn steps<S: Into<String>>(mut self, steps: impl IntoIterator<Item = S>) -> Workload {
        self.steps.extend(steps.into_iter().map(Into::into));
        self
    }

    /// An environment variable (later settings of the same key win).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Workload {
        self.env.push((key.into(), value.into()));
        self
    }

    /// A directory to search for libraries before the fake driver's.
    pub fn lib_dir(mut self, dir: impl Into<PathBuf>) -> Workload {
        self.lib_dirs.push(dir.into());
        self
    }

    /// Runs the workload in `cgroup`: the child joins it between fork and exec, so every
    /// CUDA call it makes, `cuInit` included, is the cgroup's.
    pub fn in_cgroup(mut self, cgroup: &cgroup::TestCgroup) -> Workload {
        self.cgroup = Some(cgroup.procs_file());
        self
    }

    /// Runs the workload through `program` with `args` (then the workload's own command
    /// line), e.g. a shell that prepares a mount namespace and `exec`s the rest.
    pub fn wrapped<S: Into<OsString>>(mut self, program: impl Into<OsString>, args: impl IntoIterator<Item = S>) -> Workload {
        self.wrapper = std::iter::once(program.into()).chain(args.into_iter().map(Into::into)).collect();
        self
    }

    /// Runs `program` instead of `fakecuda-workload`: same environment (fake driver, node,
    /// hook settings), command line `args -- steps`.
    pub fn program(mut self, program: impl Into<PathBuf>) -> Workload {
        self.program = Some(program.into());
        self
    }

    /// The command, ready to spawn.
    pub fn command(&self) -> Result<Command> {
        let mut cmd = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(workload_bin()?);
                cmd
            }
            None => Command::new(match &self.program {
                Some(program) => program.clone(),
                None => workload_bin()?,
            }),
        };
        let mut path: Vec<PathBuf> = self.lib_dirs.clone();
        path.push(fake_driver_dir()?);
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            path.extend(std::env::split_paths(&old));
        }
        cmd.env("LD_LIBRARY_PATH", std::env::join_paths(path).context("bad LD_LIBRARY_PATH")?);
        for (k, _) in std::env::vars_os() {
            let key = k.to_string_lossy();
            let ours = ["FAKECUDA_", "VRAMGUARD_", "CUDA_DEVICE_MEMORY_"].iter().any(|p| key.starts_with(p));
            if ours || DOWNWARD_API.contains(&key.as_ref()) || key == "LD_PRELOAD" {
                cmd.env_remove(k);
            }
        }
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd.args(&self.args).arg("--").args(&self.steps);
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        if let Some(procs) = &self.cgroup {
            cgroup::join_before_exec(&mut cmd, procs)?;
        }
        Ok(cmd)
    }

    /// Starts the workload.
    pub fn spawn(&self) -> Result<Running> {
        let mut cmd = self.command()?;
        let mut child = cmd.spawn().with_context(|| format!("cannot start {cmd:?}"))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout pipe"))?;
        let mut stderr = child.stderr.take().ok_or_else(|| anyhow!("no stderr pipe"))?;
        let (tx, rx) = mpsc::channel();
        let out_thread = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => {
                        if tx.send(l).is_err() {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
        });
        let err_text = Arc::new(Mutex::new(String::new()));
        let err_sink = Arc::clone(&err_text);
        let err_thread = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match stderr.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if let Ok(mut s) = err_sink.lock() {
                            s.push_str(&String::from_utf8_lossy(&buf[..n]));
                        }
                    }
                }
            }
        });
        Ok(Running {
            pid: child.id(),
            stdin: child.stdin.take(),
            child: Some(child),
            lines: rx,
            seen: Vec::new(),
            stderr: err_text,
            threads: vec![out_thread, err_thread],
            description: format!("{:?}", self.steps),
        })
    }

    /// Runs the workload to the end (stdin closed at once, so checkpoints pass through).
    pub fn run(&self) -> Result<Finished> {
        self.spawn()?.wait()
    }
}

/// Makes `cmd`'s child write itself into the cgroup whose `cgroup.procs` file is `procs`
/// after fork, before exec; the spawn fails if it cannot.
/// A running workload. Dropping it kills the process.
pub struct Running {
    pid: u32,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    seen: Vec<String>,
    stderr: Arc<Mutex<String>>,
    threads: Vec<JoinHandle<()>>,
    description: String,
}

impl Running {
    /// The workload's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Everything the workload printed on stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn context(&self) -> String {
        format!(
            "workload {} (pid {}): stdout so far {:?}, stderr {:?}",
            self.description,
            self.pid,
            self.seen,
            self.stderr()
        )
    }

    /// The next stdout line; fails on timeout or when the workload closed stdout.
    pub fn next_line(&mut self) -> Result<String> {
        match self.lines.recv_timeout(timeout()) {
            Ok(line) => {
                self.seen.push(line.clone());
                Ok(line)
            }
            Err(RecvTimeoutError::Timeout) => bail!("timed out waiting for a line from {}", self.context()),
            Err(RecvTimeoutError::Disconnected) => {
                // Give the stderr reader a moment to collect the reason.
                std::thread::sleep(Duration::from_millis(50));
                bail!("stdout closed early: {}", self.context())
            }
        }
    }

    /// Reads lines until one starts with `prefix`, and returns it.
    pub fn expect_prefix(&mut self, prefix: &str) -> Result<String> {
        loop {
            let line = self.next_line().with_context(|| format!("waiting for a line starting with {prefix:?}"))?;
            if line.starts_with(prefix) {
                return Ok(line);
            }
        }
    }

    /// Waits for `checkpoint NAME`.
    pub fn wait_checkpoint(&mut self, name: &str) -> Result<()> {
        let want = format!("checkpoint {name}");
        loop {
            let line = self.next_line().with_context(|| format!("waiting for {want:?}"))?;
            if line == want {
                return Ok(());
            }
        }
    }

    /// Lets the workload go on past its current checkpoint.
    pub fn resume(&mut self) -> Result<()> {
        let stdin = self.stdin.as_mut().ok_or_else(|| anyhow!("stdin already closed"))?;
        stdin.write_all(b"\n").and_then(|_| stdin.flush()).context("cannot write to the workload's stdin")
    }

    /// Sends a signal (e.g. `libc::SIGKILL`).
    pub fn signal(&self, sig: i32) -> Result<()> {
        // SAFETY: kill(2) on our own child's pid; the child is not reaped before `wait`, so the
        // pid cannot have been reused.
        let rc = unsafe { libc::kill(self.pid as libc::pid_t, sig) };
        if rc != 0 {
            bail!("kill({}, {sig}): {}", self.pid, std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// SIGKILLs the workload and waits for it.
    pub fn kill(mut self) -> Result<Finished> {
        self.signal(libc::SIGKILL)?;
        self.finish()
    }

    /// Closes stdin (so remaining checkpoints pass) and waits for the workload to exit.
    pub fn wait(mut self) -> Result<Finished> {
        self.stdin = None;
        self.finish()
    }

    fn finish(&mut self) -> Result<Finished> {
        let mut child = self.child.take().ok_or_else(|| anyhow!("already waited"))?;
        let deadline = Instant::now() + timeout();
        let status = loop {
            if let Some(status) = child.try_wait().context("waitpid")? {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("timed out waiting for exit: {}", self.context());
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
        Ok(Finished {
            status,
            stdout: std::mem::take(&mut self.seen),
            stderr: self.stderr(),
            description: self.description.clone(),
        })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A workload that has exited.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    /// Every stdout line, in order.
    pub stdout: Vec<String>,
    pub stderr: String,
    description: String,
}

impl Finished {
    /// Fails unless the workload exited with status 0.
    pub fn success(self) -> Result<Finished> {
        if !self.status.success() {
            bail!("workload {} failed ({}): stdout {:?}, stderr {:?}", self.description, self.status, self.stdout, self.stderr);
        }
        Ok(self)
    }

    /// The exit code (None if killed by a signal).
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// The first stdout line starting with `prefix`.
    pub fn line(&self, prefix: &str) -> Result<&str> {
        self.stdout
            .iter()
            .map(String::as_str)
            .find(|l| l.starts_with(prefix))
            .ok_or_else(|| anyhow!("no line starting with {prefix:?} in {:?} (stderr {:?})", self.stdout, self.stderr))
    }

    /// Every stdout line starting with `prefix`.
    pub fn lines<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.stdout.iter().map(String::as_str).filter(move |l| l.starts_with(prefix))
    }
}

/// The value of `key=VALUE` in a line (decimal, or hex with `0x`).
pub fn field(line: &str, key: &str) -> Result<u64> {
    let text = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .ok_or_else(|| anyhow!("no {key}= in {line:?}"))?;
    parse_u64(text).ok_or_else(|| anyhow!("{key}={text} is not a number in {line:?}"))
}

/// Parses a decimal or `0x` hex number.
pub fn parse_u64(text: &str) -> Option<u64> {
    match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// The parts of an `ok STEP NAME 0xPTR BYTES` line: (step, name, pointer, bytes).
pub fn parse_ok(line: &str) -> Result<(String, String, u64, u64)> {
    let w: Vec<&str> = line.split_whitespace().collect();
    match w.as_slice() {
        ["ok", step, name, ptr, bytes] => Ok((
            step.to_string(),
            name.to_string(),
            parse_u64(ptr).ok_or_else(|| anyhow!("bad pointer in {line:?}"))?,
            parse_u64(bytes).ok_or_else(|| anyhow!("bad size in {line:?}"))?,
        )),
        _ => bail!("not an ok line: {line:?}"),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    #[test]
    fn a_test_binary_is_named_without_cargos_hash() {
        assert_eq!(super::binary_name(Path::new("/t/debug/deps/accounting-0123456789abcdef")), "accounting");
        assert_eq!(super::binary_name(Path::new("/t/debug/deps/hostile_ledger-e29ffc3656bc896d")), "hostile_ledger");
        assert_eq!(super::binary_name(Path::new("/t/debug/xtask")), "xtask");
        assert_eq!(super::binary_name(Path::new("/t/debug/xtask (deleted)")), "xtask");
        assert_eq!(super::binary_name(Path::new("/t/debug/deps/dra-chain")), "dra-chain");
    }
}
