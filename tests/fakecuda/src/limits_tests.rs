//! Tests of the per-cgroup memory limits ([`crate::limits`], [`crate::nvml`]'s
//! `nvmlDevice{Set,Get}MemoryLimits_v1`, and their enforcement in the driver), run across
//! processes: each test starts child processes of this test binary ([`Child`]: the `child`
//! test, told so by `FAKECUDA_LIMITS_CHILD`), moves them into cgroups of its own under the
//! cgroup2 mount ([`TestCgroup`]), and has them call the fake through commands on stdin.
//! Children keep the NVML session and the driver out of this process, whose environment the
//! NVML unit test changes.
//!
//! The tests that make cgroups need root and a cgroup2 mount; without them they fail saying
//! so (the project's machines have both).

use std::ffi::{c_char, CString};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};

use cuda_abi::nvml::*;
use cuda_abi::*;

use crate::cgroup;
use crate::exports::*;
use crate::nvml::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const MAX: u64 = NVML_DEVICE_MEMORY_LIMIT_MAX;
const R615: &str = "615.10.02";

// ---- the child's side -----------------------------------------------------------------------

/// Answers one command line of the parent; the answer is printed after `@@ `.
fn answer(line: &str) -> String {
    let words: Vec<&str> = line.split_whitespace().collect();
    let num = |i: usize| words.get(i).and_then(|w| w.parse::<u64>().ok()).unwrap_or(0);
    let nvml_dev = |i: u64| {
        let mut dev: nvmlDevice_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let rc = unsafe { nvmlDeviceGetHandleByIndex_v2(i as u32, &mut dev) };
        (rc, dev)
    };
    let path = || CString::new(words.get(3..).unwrap_or_default().join(" ")).expect("no NUL");
    // SAFETY (every call below): valid out-pointers, structs and NUL-terminated strings.
    unsafe {
        match words.first().copied().unwrap_or("") {
            "init" => {
                let mut ctx: CUcontext = std::ptr::null_mut();
                let rc = cuInit(0);
                let rc = if rc == CUDA_SUCCESS { cuDevicePrimaryCtxRetain(&mut ctx, num(1) as CUdevice) } else { rc };
                let rc = if rc == CUDA_SUCCESS { cuCtxSetCurrent(ctx) } else { rc };
                format!("{rc}")
            }
            "alloc" => {
                let mut ptr: CUdeviceptr = 0;
                let rc = cuMemAlloc_v2(&mut ptr, num(1) as usize);
                format!("{rc} {ptr}")
            }
            "free" => format!("{}", cuMemFree_v2(num(1))),
            "async" => {
                let mut ptr: CUdeviceptr = 0;
                format!("{} {ptr}", cuMemAllocAsync(&mut ptr, num(1) as usize, std::ptr::null_mut()))
            }
            "create" => {
                let prop = CUmemAllocationProp {
                    type_: CU_MEM_ALLOCATION_TYPE_PINNED,
                    requested_handle_types: 0,
                    location: CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: 0 },
                    win32_handle_meta_data: std::ptr::null_mut(),
                    alloc_flags: Default::default(),
                };
                let mut h: CUmemGenericAllocationHandle = 0;
                format!("{}", cuMemCreate(&mut h, num(1) as usize, &prop, 0))
            }
            "nvml-init" => format!("{}", nvmlInit_v2()),
            "nvml-versions" => {
                let mut text = [0 as c_char; 80];
                let mut cuda = 0;
                let rc = nvmlSystemGetDriverVersion(text.as_mut_ptr(), 80);
                let rc2 = nvmlSystemGetCudaDriverVersion_v2(&mut cuda);
                let mut plain = 0;
                let _ = cuDriverGetVersion(&mut plain);
                let text = std::ffi::CStr::from_ptr(text.as_ptr()).to_string_lossy().into_owned();
                format!("{rc} {rc2} {text} {cuda} {plain}")
            }
            // set DEV SOFT HARD PATH (HARD `max`: NVML_DEVICE_MEMORY_LIMIT_MAX)
            "set" => {
                let (rc, dev) = nvml_dev(num(1));
                let ns = CString::new(words.get(4..).unwrap_or_default().join(" ")).expect("no NUL");
                let mut l = nvmlSetMemoryLimits_v1_t { name_space: ns.as_ptr(), soft_limit: num(2), hard_limit: num(3) };
                if words.get(3) == Some(&"max") {
                    l.hard_limit = MAX;
                }
                format!("{}", if rc == NVML_SUCCESS { nvmlDeviceSetMemoryLimits_v1(dev, &mut l) } else { rc })
            }
            // get DEV - PATH
            "get" => {
                let (rc, dev) = nvml_dev(num(1));
                let ns = path();
                let mut l = nvmlGetMemoryLimits_v1_t { name_space: ns.as_ptr(), soft_limit: 1, hard_limit: 1, current_used: 1 };
                let rc = if rc == NVML_SUCCESS { nvmlDeviceGetMemoryLimits_v1(dev, &mut l) } else { rc };
                format!("{rc} {} {} {}", l.soft_limit, l.hard_limit, l.current_used)
            }
            // NULL arguments and a bogus device handle, for each call.
            "nulls" => {
                let (_, dev) = nvml_dev(0);
                let bogus: nvmlDevice_t = (dev as *mut u64).wrapping_add(7).cast();
                let ns = CString::new("/").expect("no NUL");
                let mut s = nvmlSetMemoryLimits_v1_t { name_space: std::ptr::null(), soft_limit: 0, hard_limit: MAX };
                let mut g = nvmlGetMemoryLimits_v1_t { name_space: std::ptr::null(), soft_limit: 0, hard_limit: 0, current_used: 0 };
                let codes = [
                    nvmlDeviceSetMemoryLimits_v1(dev, std::ptr::null_mut()),
                    nvmlDeviceSetMemoryLimits_v1(dev, &mut s),
                    nvmlDeviceGetMemoryLimits_v1(dev, std::ptr::null_mut()),
                    nvmlDeviceGetMemoryLimits_v1(dev, &mut g),
                    {
                        s.name_space = ns.as_ptr();
                        nvmlDeviceSetMemoryLimits_v1(bogus, &mut s)
                    },
                    {
                        g.name_space = ns.as_ptr();
                        nvmlDeviceGetMemoryLimits_v1(bogus, &mut g)
                    },
                ];
                codes.map(|c| c.to_string()).join(" ")
            }
            "seteuid" => format!("{}", libc::seteuid(num(1) as libc::uid_t)),
            // Forks a process that keeps this one's open files (and so its memory) until killed.
            "fork-hold" => match libc::fork() {
                0 => loop {
                    libc::pause();
                },
                pid => format!("{pid}"),
            },
            "exit" => std::process::exit(0),
            other => format!("unknown command {other:?}"),
        }
    }
}

/// The child's side: does nothing unless started by [`Child::start`].
#[test]
fn child() {
    if std::env::var_os("FAKECUDA_LIMITS_CHILD").is_none() {
        return;
    }
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let _ = writeln!(out, "@@ {}", answer(&line));
        let _ = out.flush();
    }
}

// ---- the parent's side ----------------------------------------------------------------------

/// A fake node of one test: its own state directory and node name.
struct Node {
    dir: PathBuf,
    env: Vec<(&'static str, String)>,
}

impl Node {
    fn new(tag: &str, version: Option<&str>, context_bytes: u64) -> Node {
        let dir = std::env::temp_dir().join(format!("fakecuda-limits-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("state dir");
        let mut env = vec![
            ("FAKECUDA_STATE_DIR", dir.display().to_string()),
            ("FAKECUDA_NODE", format!("lim-{tag}")),
            ("FAKECUDA_DEVICE_COUNT", "2".into()),
            ("FAKECUDA_DEVICE_BYTES", "1g".into()),
            ("FAKECUDA_CONTEXT_BYTES", context_bytes.to_string()),
        ];
        if let Some(v) = version {
            env.push(("FAKECUDA_DRIVER_VERSION", v.into()));
        }
        Node { dir, env }
    }

    /// A child process on this node with NVML initialised (it sets and gets limits).
    fn nvml_child(&self) -> Child {
        let mut c = self.child();
        assert_eq!(c.rc("nvml-init"), 0);
        c
    }

    /// A child process on this node (in this process's cgroup until moved).
    fn child(&self) -> Child {
        let exe = std::env::current_exe().expect("test binary");
        let mut cmd = Command::new(exe);
        cmd.args(["--exact", "limits_tests::child", "--nocapture", "--test-threads=1"])
            .env_clear()
            .env("FAKECUDA_LIMITS_CHILD", "1")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut proc = cmd.spawn().expect("spawn a child");
        let stdin = proc.stdin.take().expect("stdin");
        let stdout = BufReader::new(proc.stdout.take().expect("stdout"));
        Child { proc, stdin, stdout }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A child process of this test binary, answering commands.
struct Child {
    proc: std::process::Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Child {
    fn pid(&self) -> u32 {
        self.proc.id()
    }

    /// Sends one command and returns the answer.
    fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").expect("write to the child");
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).expect("read from the child");
            assert!(n > 0, "the child ended before answering {command:?}");
            // libtest's "test … " may come first on the line.
            if let Some((_, answer)) = line.trim_end().split_once("@@ ") {
                return answer.to_owned();
            }
        }
    }

    /// The numbers of an answer.
    fn nums(&mut self, command: &str) -> Vec<u64> {
        self.ask(command).split_whitespace().filter_map(|w| w.parse().ok()).collect()
    }

    /// The first number of an answer (a result code).
    fn rc(&mut self, command: &str) -> u64 {
        self.nums(command).first().copied().unwrap_or(u64::MAX)
    }

    /// `(rc, soft, hard, used)` of `nvmlDeviceGetMemoryLimits_v1`.
    fn get(&mut self, dev: u32, path: &Path) -> (u64, u64, u64, u64) {
        let n = self.nums(&format!("get {dev} - {}", path.display()));
        (n[0], n[1], n[2], n[3])
    }

    fn set(&mut self, dev: u32, soft: u64, hard: u64, path: &Path) -> u64 {
        let hard = if hard == MAX { "max".to_owned() } else { hard.to_string() };
        self.rc(&format!("set {dev} {soft} {hard} {}", path.display()))
    }

    /// Ends the child (its memory goes back with its files) and waits for it.
    fn end(mut self) {
        let _ = writeln!(self.stdin, "exit");
        let _ = self.proc.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

/// A cgroup made for one test under the cgroup2 mount, removed on drop.
struct TestCgroup {
    dir: PathBuf,
}

impl TestCgroup {
    /// Always `Some`: a test that cannot make cgroups (not root, or no cgroup2 mount) fails
    /// saying so, never passes without checking.
    fn new(name: &str) -> Option<TestCgroup> {
        let mount = cgroup::mounts().into_iter().find(|m| m.root == "/");
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let Some(mount) = mount.filter(|_| root) else {
            panic!("the limits tests need root and a cgroup2 mount (the project's machines have both)");
        };
        let dir = mount.point.join(format!("fakecuda-limits-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir(&dir);
        std::fs::create_dir(&dir).expect("create a test cgroup");
        Some(TestCgroup { dir })
    }

    fn path(&self) -> &Path {
        &self.dir
    }

    /// Moves a process into this cgroup.
    fn enter(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).expect("move into the cgroup");
    }

    /// Removes the cgroup (its processes gone), retrying while the kernel still counts them
    /// (for up to 2 s); whether it is gone.
    fn remove(&self) -> bool {
        for _ in 0..100 {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        }
        false
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        if !self.remove() {
            eprintln!("cannot remove test cgroup {}", self.dir.display());
        }
    }
}

/// A child on `node`, moved into `cg`, with the driver initialised and NVML too.
fn child_in(node: &Node, cg: &TestCgroup) -> Child {
    let mut c = node.child();
    cg.enter(c.pid());
    assert_eq!(c.rc("nvml-init"), 0);
    assert_eq!(c.rc("init 0"), 0);
    c
}

/// A test cgroup, an r615 node (contexts of `context_bytes`), and a child of it that set a
/// hard limit of `hard` on device 0 for the cgroup; `None` where cgroups cannot be made.
fn limited(tag: &str, context_bytes: u64, hard: u64) -> Option<(TestCgroup, Node, Child)> {
    let cg = TestCgroup::new(tag)?;
    let node = Node::new(tag, Some(R615), context_bytes);
    let mut setter = node.nvml_child();
    assert_eq!(setter.set(0, 0, hard, cg.path()), 0);
    Some((cg, node, setter))
}

// ---- the tests ------------------------------------------------------------------------------

#[test]
fn a_580_driver_does_not_support_limits_and_r615_reports_cuda_13_4() {
    let old = Node::new("580", None, 0);
    let mut c = old.child();
    assert_eq!(c.get(0, &std::env::temp_dir()).0, NVML_ERROR_UNINITIALIZED as u64, "outside a session");
    assert_eq!(c.rc("nvml-init"), 0);
    assert_eq!(c.ask("nvml-versions"), "0 0 580.65.06 13000 13000");
    let cg = cgroup::mounts().into_iter().next().map_or_else(|| PathBuf::from("/"), |m| m.point);
    assert_eq!(c.set(0, 0, GIB, &cg), NVML_ERROR_NOT_SUPPORTED as u64);
    assert_eq!(c.get(0, &cg).0, NVML_ERROR_NOT_SUPPORTED as u64);
    // Argument errors come first: NULLs and a bogus handle are INVALID_ARGUMENT on 580 too.
    assert_eq!(c.ask("nulls"), "2 2 2 2 2 2");
    c.end();

    let new = Node::new("r615-version", Some(R615), 0);
    let mut c = new.nvml_child();
    assert_eq!(c.ask("nvml-versions"), "0 0 615.10.02 13040 13040");
    assert_eq!(c.ask("nulls"), "2 2 2 2 2 2");
    // Not a cgroup: no such path, a directory of another file system.
    assert_eq!(c.get(0, Path::new("/no/such/cgroup")).0, NVML_ERROR_OPERATING_SYSTEM as u64);
    assert_eq!(c.get(0, &std::env::temp_dir()).0, NVML_ERROR_OPERATING_SYSTEM as u64);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        assert_eq!(c.set(0, 0, GIB, &std::env::temp_dir()), NVML_ERROR_OPERATING_SYSTEM as u64);
    }
    c.end();
}

#[test]
fn set_checks_permission_path_and_values_and_get_round_trips() {
    let Some(cg) = TestCgroup::new("values") else { return };
    let node = Node::new("values", Some(R615), 0);
    let mut c = node.nvml_child();
    let p = cg.path();
    assert_eq!(c.get(0, p).0, NVML_ERROR_NOT_FOUND as u64, "nothing set yet");
    assert_eq!(c.set(0, 512 * MIB, 256 * MIB, p), NVML_ERROR_INVALID_ARGUMENT as u64, "soft above hard");
    assert_eq!(c.set(0, 0, GIB + 1, p), NVML_ERROR_INVALID_ARGUMENT as u64, "hard above the device");
    assert_eq!(c.set(0, GIB + 1, MAX, p), NVML_ERROR_INVALID_ARGUMENT as u64, "soft above the device");
    assert_eq!(c.set(0, 0, MAX, p), 0, "clearing what is not set");
    assert_eq!(c.get(0, p).0, NVML_ERROR_NOT_FOUND as u64);
    assert_eq!(c.set(0, 0, GIB, Path::new("/no/such/cgroup")), NVML_ERROR_OPERATING_SYSTEM as u64);

    assert_eq!(c.set(1, 256 * MIB, 512 * MIB, p), 0);
    assert_eq!(c.get(1, p), (0, 256 * MIB, 512 * MIB, 0));
    assert_eq!(c.get(0, p).0, NVML_ERROR_NOT_FOUND as u64, "limits are per device");
    assert_eq!(c.set(1, 0, GIB, p), 0, "a limit of the whole device is allowed");
    assert_eq!(c.get(1, p), (0, 0, GIB, 0));
    assert_eq!(c.set(1, 100 * MIB, MAX, p), 0, "a soft limit alone");
    assert_eq!(c.get(1, p), (0, 100 * MIB, MAX, 0));
    // The path as given, with a trailing slash, names the same cgroup.
    assert_eq!(c.get(1, &p.join("")).1, 100 * MIB);
    let text = std::fs::read_to_string(node.dir.join("lim-values-limits")).expect("the limits file");
    let rel = format!("/{}", p.file_name().expect("a name").to_string_lossy());
    assert!(text.starts_with(crate::limits::HEADER) && text.contains(&format!(" {rel}\n")), "{text}");
    assert_eq!(c.set(1, 0, MAX, p), 0, "cleared");
    assert_eq!(c.get(1, p).0, NVML_ERROR_NOT_FOUND as u64);

    assert_eq!(c.rc("seteuid 65534"), 0);
    assert_eq!(c.set(0, 0, GIB, p), NVML_ERROR_NO_PERMISSION as u64);
    assert_eq!(c.get(0, p).0, NVML_ERROR_NOT_FOUND as u64, "get needs no root");
    c.end();
}

#[test]
fn a_hard_limit_bounds_the_cgroups_processes_together_and_no_other() {
    let (Some(limited), Some(other)) = (TestCgroup::new("bound"), TestCgroup::new("bound-other")) else { return };
    let node = Node::new("bound", Some(R615), 0);
    let mut a = child_in(&node, &limited);
    let mut b = child_in(&node, &limited);
    let mut o = child_in(&node, &other);
    assert_eq!(a.rc(&format!("alloc {}", 64 * MIB)), 0, "before any limit");
    assert_eq!(a.set(0, 0, 96 * MIB, limited.path()), 0);
    assert_eq!(a.get(0, limited.path()), (0, 0, 96 * MIB, 64 * MIB));

    assert_eq!(b.rc(&format!("alloc {}", 34 * MIB)), CUDA_ERROR_OUT_OF_MEMORY as u64, "98 MiB would pass 96");
    assert_eq!(b.rc(&format!("alloc {}", 32 * MIB)), 0, "96 MiB is at the limit");
    assert_eq!(a.rc("alloc 1"), CUDA_ERROR_OUT_OF_MEMORY as u64, "one byte more is a page more");
    assert_eq!(a.rc(&format!("async {}", 2 * MIB)), CUDA_ERROR_OUT_OF_MEMORY as u64, "pools too");
    assert_eq!(a.rc(&format!("create {}", 2 * MIB)), CUDA_ERROR_OUT_OF_MEMORY as u64, "VMM too");
    assert_eq!(o.get(0, limited.path()), (0, 0, 96 * MIB, 96 * MIB), "both processes count");
    assert_eq!(o.rc(&format!("alloc {}", 512 * MIB)), 0, "another cgroup is not limited");
    assert_eq!(o.get(0, other.path()).0, NVML_ERROR_NOT_FOUND as u64);
    // Another device is not limited either.
    let mut a1 = node.child();
    limited.enter(a1.pid());
    assert_eq!(a1.rc("init 1"), 0);
    assert_eq!(a1.rc(&format!("alloc {}", 256 * MIB)), 0);

    // A process that ends gives its share back.
    b.end();
    assert_eq!(a.get(0, limited.path()), (0, 0, 96 * MIB, 64 * MIB));
    assert_eq!(a.rc(&format!("async {}", 2 * MIB)), 0);
    assert_eq!(a.rc(&format!("create {}", 2 * MIB)), 0);
    assert_eq!(a.get(0, limited.path()).3, 68 * MIB);
    // Clearing lifts the limit.
    assert_eq!(a.set(0, 0, MAX, limited.path()), 0);
    assert_eq!(a.rc(&format!("alloc {}", 128 * MIB)), 0);
    a.end();
    a1.end();
    o.end();
}

#[test]
fn contexts_count_against_the_limit() {
    let Some((cg, node, mut setter)) = limited("contexts", 64 * MIB, 32 * MIB) else { return };
    let mut c = node.child();
    cg.enter(c.pid());
    assert_eq!(c.rc("init 0"), CUDA_ERROR_OUT_OF_MEMORY as u64, "a 64 MiB context under a 32 MiB limit");
    assert_eq!(setter.set(0, 0, 64 * MIB, cg.path()), 0);
    assert_eq!(c.rc("init 0"), 0);
    assert_eq!(setter.get(0, cg.path()), (0, 0, 64 * MIB, 64 * MIB));
    c.end();
    setter.end();
}

#[test]
fn a_forked_child_keeps_its_parents_memory_in_the_cgroup() {
    let Some((cg, node, mut watcher)) = limited("fork", 0, 128 * MIB) else { return };
    let mut parent = child_in(&node, &cg);
    assert_eq!(parent.rc(&format!("alloc {}", 64 * MIB)), 0);
    let holder = parent.rc("fork-hold");
    parent.end();
    assert_eq!(watcher.get(0, cg.path()).3, 64 * MIB, "the forked child keeps the memory");
    let mut next = child_in(&node, &cg);
    assert_eq!(next.rc(&format!("alloc {}", 66 * MIB)), CUDA_ERROR_OUT_OF_MEMORY as u64);
    // SAFETY: kills the process this test's child forked.
    unsafe { libc::kill(holder as libc::pid_t, libc::SIGKILL) };
    let mut used = u64::MAX;
    for _ in 0..200 {
        used = watcher.get(0, cg.path()).3;
        if used == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(used, 0, "the memory goes with the last holder");
    assert_eq!(next.rc(&format!("alloc {}", 66 * MIB)), 0);
    next.end();
    watcher.end();
}

#[test]
fn removing_the_cgroup_clears_its_limits() {
    let Some((cg, node, mut setter)) = limited("removed", 0, 16 * MIB) else { return };
    let mut c = child_in(&node, &cg);
    assert_eq!(c.rc(&format!("alloc {}", 32 * MIB)), CUDA_ERROR_OUT_OF_MEMORY as u64);
    c.end();
    assert!(cg.remove());
    assert_eq!(setter.get(0, cg.path()).0, NVML_ERROR_OPERATING_SYSTEM as u64, "the path cannot be opened");
    std::fs::create_dir(cg.path()).expect("the cgroup made again");
    assert_eq!(setter.get(0, cg.path()).0, NVML_ERROR_NOT_FOUND as u64, "a new cgroup at the same path");
    let mut c = child_in(&node, &cg);
    assert_eq!(c.rc(&format!("alloc {}", 32 * MIB)), 0, "and not limited");
    c.end();
    // The next set drops the removed cgroup's entry.
    assert_eq!(setter.set(1, 0, 16 * MIB, cg.path()), 0);
    let text = std::fs::read_to_string(node.dir.join("lim-removed-limits")).expect("the limits file");
    assert_eq!(text.lines().count(), 2, "{text}");
    setter.end();
}
