//! The containerd harness (`e2e::containerd`) against a real containerd with NRI, driven
//! through CRI: pods and containers run, `exec_sync` answers, the fake-driver workload runs
//! inside a container, a container's cgroup is where the harness says, containerd restarts
//! and still serves, its NRI socket is where the test asked, and dropping it leaves nothing;
//! the same on containerd 2 (`*_on_containerd_2`, [`Version::run`]).
//! Needs root and the cache `cargo xtask setup` fills (without it these tests fail).
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::containerd::{cri, Cache, ContainerId, ContainerSpec, Containerd, PodId, Version};
use e2e::{timeout, wait_for, FakeNode, TempDir, MIB};

/// A containerd with its NRI socket in `dir`.
fn containerd(dir: &TempDir) -> Containerd {
    let begin = Instant::now();
    let containerd = Containerd::start(&dir.path().join("nri.sock")).expect("start containerd");
    eprintln!(
        "containerd {} serving CRI and NRI {:?} after launch, image imported {:?} after ({})",
        containerd.runtime_version(),
        containerd.start_time(),
        begin.elapsed(),
        containerd.cache().versions().trim_end().replace('\n', "; ")
    );
    containerd
}

fn state(containerd: &Containerd, container: &ContainerId) -> i32 {
    containerd.status(container).expect("container status").status.expect("a status").state
}

/// The `0::` line of /proc/<pid>/cgroup: the process's cgroup2 path.
fn cgroup2_of(pid: u32) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("read /proc/<pid>/cgroup");
    text.lines().find_map(|l| l.strip_prefix("0::")).expect("a cgroup2 line").to_owned()
}

#[test]
fn missing_cache_fails_saying_run_setup() {
    let empty = TempDir::new("no-cache").unwrap();
    let error = Cache::open(empty.path()).err().expect("an empty directory is no cache");
    assert!(format!("{error:#}").contains("run `cargo xtask setup`"), "{error:#}");
    // A cache whose versions file is there but a binary is not is no cache either.
    std::fs::write(empty.path().join(e2e::containerd::VERSIONS_FILE), "containerd 0\n").unwrap();
    let error = Cache::open(empty.path()).err().expect("a cache without its binaries");
    assert!(format!("{error:#}").contains("run `cargo xtask setup`"), "{error:#}");
    // The real cache is complete (without it, this and every other test here fails).
    let cache = Cache::locate().expect("the containerd cache");
    assert!(cache.versions().contains("containerd 1.7."), "{}", cache.versions());
}

#[test]
fn nri_socket_appears_where_asked() {
    let dir = TempDir::new("nri").unwrap();
    let socket = dir.path().join("nri.sock");
    assert!(!socket.exists());
    let containerd = containerd(&dir);
    let kind = std::fs::symlink_metadata(&socket).expect("the NRI socket exists").file_type();
    assert!(kind.is_socket(), "{} is not a socket", socket.display());
    // containerd accepts a connection there (a plugin speaks ttRPC on it).
    UnixStream::connect(&socket).expect("connect to the NRI socket");
    let pid = containerd.pid().expect("containerd runs");
    drop(containerd);
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "containerd {pid} still runs");
    assert!(UnixStream::connect(&socket).is_err(), "the NRI socket still answers after containerd stopped");
}

#[test]
fn pod_and_container_run_and_exec_sync_answers() {
    let dir = TempDir::new("ctd").unwrap();
    let containerd = containerd(&dir);
    let version = containerd.cri().version().expect("CRI Version");
    assert_eq!(version.runtime_name, "containerd");
    assert!(containerd.version().answers(&version.runtime_version), "{version:?}");

    let begin = Instant::now();
    let pod = containerd.pod("web", "team-a", "uid-1", &[("example.com/pod", "yes")]).expect("run a pod");
    let spec = ContainerSpec::new("app").env("GREETING", "hello from the spec").annotation("example.com/ctr", "on");
    let container = containerd.run_container(&pod, &spec).expect("run a container");
    eprintln!("pod + container created and started in {:?}", begin.elapsed());
    assert_eq!(state(&containerd, &container), cri::CONTAINER_RUNNING);

    let out = containerd.exec_sync(&container, &["echo", "hello"]).expect("exec echo");
    assert_eq!((out.exit_code, out.stdout.as_str(), out.stderr.as_str()), (0, "hello\n", ""));
    let out = containerd.exec_sync(&container, &["sh", "-c", "echo oops >&2; exit 3"]).expect("exec sh");
    assert_eq!((out.exit_code, out.stdout.as_str(), out.stderr.as_str()), (3, "", "oops\n"));
    // An exec runs with the container's environment.
    let out = containerd.exec_sync(&container, &["sh", "-c", "echo $GREETING"]).expect("exec sh");
    assert_eq!(out.stdout, "hello from the spec\n");
    assert!(containerd.container_env(&container).unwrap().contains(&"GREETING=hello from the spec".to_owned()));
    let status = containerd.status(&container).unwrap().status.unwrap();
    assert_eq!(status.annotations.get("example.com/ctr").map(String::as_str), Some("on"));
    // The paths the NRI plugin mounts over are free in the image.
    let out = containerd.exec_sync(&container, &["ls", "/etc/ld.so.preload", "/usr/lib/vramguard", "/run/vramguard"]).unwrap();
    assert_eq!(out.exit_code, 1, "{out:?}");

    // A container whose command exits: its exit code and output are reported.
    let short = containerd
        .run_container(&pod, &ContainerSpec::new("short").command(["sh", "-c", "echo done; exit 7"]))
        .expect("run a short container");
    wait_for(timeout(), "the short container to exit", || Ok(state(&containerd, &short) == cri::CONTAINER_EXITED)).unwrap();
    assert_eq!(containerd.status(&short).unwrap().status.unwrap().exit_code, 7);
    assert_eq!(containerd.container_log(&pod, &short).unwrap(), "done\n");

    containerd.stop_container(&container, Duration::ZERO).expect("stop");
    assert_eq!(state(&containerd, &container), cri::CONTAINER_EXITED);
    containerd.remove_container(&container).expect("remove");
    assert!(containerd.status(&container).is_err(), "a removed container still has a status");
    containerd.remove_pod(&pod).expect("remove the pod");
}

#[test]
fn fake_driver_workload_runs_in_a_container_in_its_cgroup() {
    let dir = TempDir::new("ctd").unwrap();
    let containerd = containerd(&dir);
    let node = FakeNode::new("containerd");
    let pod = containerd.pod("gpu", "team-b", "uid-2", &[]).expect("run a pod");
    let workload = e2e::containerd::workload_path();
    let spec = ContainerSpec::new("trainer")
        .command([workload.as_str(), "ctx 0", "alloc a 64m", "hold"])
        .fake_driver(&node)
        .expect("fake driver mounts");
    let container = containerd.run_container(&pod, &spec).expect("run the workload");

    // The allocation made in the container is on the node's fake device, seen from the host.
    wait_for(timeout(), "the container's allocation on the fake device", || Ok(node.used(0)? >= 64 * MIB))
        .unwrap_or_else(|e| panic!("{e:#}; the container's output: {:?}", containerd.container_log(&pod, &container)));
    let log = containerd.container_log(&pod, &container).unwrap();
    assert!(log.lines().any(|l| l.starts_with("ok alloc a ")), "{log}");
    // The same device, asked from inside the container.
    let out = containerd.exec_sync(&container, &[workload.as_str(), "devstat 0"]).unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    let (used, _) = node.devstat(0).unwrap();
    assert!(out.stdout.contains(&format!("devstat used={used} ")), "{out:?} vs used={used}");

    // Un-hooked: the fake libcuda is mapped, no hook is.
    let pid = containerd.container_pid(&container).unwrap();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let driver = format!("{}/libcuda.so.1", e2e::containerd::fake_driver_path().unwrap());
    assert!(maps.contains(&driver), "the fake driver {driver} is not mapped:\n{maps}");
    assert!(!maps.contains("libvramguard"), "a hook is mapped:\n{maps}");

    // Its cgroup is the one the harness names: a plain cgroup2 directory under the pod's
    // cgroup parent, holding the workload.
    let path = containerd.container_cgroup_path(&container).unwrap();
    assert_eq!(path, format!("{}/poduid-2/{}", containerd.cgroup_parent(), container.0));
    assert_eq!(cgroup2_of(pid), path);
    let cgroup: PathBuf = containerd.container_cgroup(&container).unwrap();
    let procs = std::fs::read_to_string(cgroup.join("cgroup.procs")).expect("the container's cgroup.procs");
    assert!(procs.lines().any(|l| l == pid.to_string()), "{pid} not in {}: {procs}", cgroup.display());
    // A process of another container has another cgroup.
    let other = containerd.run_container(&pod, &ContainerSpec::new("sidecar")).unwrap();
    let other_pid = containerd.container_pid(&other).unwrap();
    assert_ne!(cgroup2_of(other_pid), path);
    assert_eq!(cgroup2_of(other_pid), containerd.container_cgroup_path(&other).unwrap());

    // Removing the pod ends the workload and removes its cgroup. (The fake driver cannot
    // give its memory back: only a process of the dead workload's pid namespace may judge
    // its slot.)
    containerd.remove_pod(&pod).expect("remove the pod");
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "the workload {pid} still runs");
    assert!(!cgroup.exists(), "{} is left", cgroup.display());
}

#[test]
fn restarted_containerd_still_serves_its_containers() {
    let dir = TempDir::new("ctd").unwrap();
    let mut containerd = containerd(&dir);
    let pod = containerd.pod("svc", "team-c", "uid-3", &[]).unwrap();
    let before = containerd.run_container(&pod, &ContainerSpec::new("before")).unwrap();
    let container_pid = containerd.container_pid(&before).unwrap();
    let old = containerd.pid().unwrap();

    containerd.restart().expect("restart containerd");
    eprintln!("containerd restarted in {:?}", containerd.start_time());
    assert_ne!(containerd.pid().unwrap(), old);
    assert!(!Path::new(&format!("/proc/{old}")).exists(), "the old containerd {old} still runs");
    assert!(std::fs::symlink_metadata(containerd.nri_socket()).unwrap().file_type().is_socket());

    // The container kept running under its shim, and the new containerd reaches it.
    assert_eq!(state(&containerd, &before), cri::CONTAINER_RUNNING);
    assert_eq!(containerd.container_pid(&before).unwrap(), container_pid);
    let out = containerd.exec_sync(&before, &["echo", "still here"]).unwrap();
    assert_eq!(out.stdout, "still here\n");
    // New containers and pods work.
    let after = containerd.run_container(&pod, &ContainerSpec::new("after")).unwrap();
    assert_eq!(containerd.exec_sync(&after, &["true"]).unwrap().exit_code, 0);
    let second = containerd.pod("svc2", "team-c", "uid-4", &[]).unwrap();
    containerd.run_container(&second, &ContainerSpec::new("x")).unwrap();
}

#[test]
fn dropping_the_harness_leaves_nothing() {
    let dir = TempDir::new("ctd").unwrap();
    let containerd = containerd(&dir);
    let pod: PodId = containerd.pod("left", "team-d", "uid-5", &[]).unwrap();
    let container = containerd.run_container(&pod, &ContainerSpec::new("sleeper")).unwrap();
    let pids = [containerd.pid().unwrap(), containerd.container_pid(&container).unwrap()];
    let cgroup = containerd.container_cgroup(&container).unwrap();
    let parent = e2e::cgroup::cgroup2_root().unwrap().join(containerd.cgroup_parent().trim_start_matches('/'));
    assert!(cgroup.starts_with(&parent) && cgroup.is_dir());
    let socket = containerd.socket();
    let state = socket.parent().unwrap().to_path_buf();
    drop(containerd); // with the pod and its container still running

    for pid in pids {
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "process {pid} is left");
    }
    assert!(!parent.exists(), "cgroup {} is left", parent.display());
    assert!(!state.exists(), "{} is left", state.display());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mountinfo.contains(state.to_str().unwrap()), "mounts are left under {}", state.display());
    let shim_left = std::fs::read_dir("/proc").unwrap().flatten().any(|entry| {
        std::fs::read(entry.path().join("cmdline")).is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == socket.to_str().unwrap().as_bytes()))
    });
    assert!(!shim_left, "a shim of the dropped containerd still runs");
}

#[test]
fn nri_socket_appears_where_asked_on_containerd_2() {
    Version::V2.run(nri_socket_appears_where_asked)
}

#[test]
fn pod_and_container_run_and_exec_sync_answers_on_containerd_2() {
    Version::V2.run(pod_and_container_run_and_exec_sync_answers)
}

#[test]
fn fake_driver_workload_runs_in_a_container_in_its_cgroup_on_containerd_2() {
    Version::V2.run(fake_driver_workload_runs_in_a_container_in_its_cgroup)
}

#[test]
fn restarted_containerd_still_serves_its_containers_on_containerd_2() {
    Version::V2.run(restarted_containerd_still_serves_its_containers)
}

#[test]
fn dropping_the_harness_leaves_nothing_on_containerd_2() {
    Version::V2.run(dropping_the_harness_leaves_nothing)
}

/// The containerd 2 cache is there (`cargo xtask setup` fetches it), and its containerd is a 2.
#[test]
fn containerd_2_is_cached() {
    let cache = Cache::locate_version(Version::V2).expect("the containerd 2 cache");
    assert!(cache.versions().contains("containerd 2."), "{}", cache.versions());
    let empty = TempDir::new("no-cache-2").unwrap();
    let error = Cache::open_set(empty.path(), Version::V2.packages()).err().expect("an empty directory is no cache");
    assert!(format!("{error:#}").contains("run `cargo xtask setup`"), "{error:#}");
}

/// Each containerd reads the kit's configuration as meant (containerd ignores keys it does not
/// know, so a key in the wrong table would go unnoticed): `containerd config dump` of the
/// running one shows the test's NRI socket, CDI on with the test's directory, the native
/// snapshotter and the cached runc, in its own layout; containerd 2 also unpacks imports to
/// the native snapshotter.
#[test]
fn each_containerd_reads_the_configuration_as_written() {
    for version in Version::ALL {
        let dir = TempDir::new("ctd-config").unwrap();
        let containerd = Containerd::start_version(version, &dir.path().join("nri.sock")).expect("start containerd");
        let config = containerd.socket().with_file_name("config.toml");
        let out = std::process::Command::new(containerd.cache().bin("containerd"))
            .arg("--config")
            .arg(&config)
            .args(["config", "dump"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        // 2 writes single-quoted strings, 1.7 double-quoted ones.
        let dump = String::from_utf8_lossy(&out.stdout).replace('\'', "\"");
        let value = |table: &str, key: &str| dumped(&dump, table, key).unwrap_or_else(|| panic!("{version:?}: no {key} in [{table}]:\n{dump}"));
        let quoted = |path: &Path| format!("\"{}\"", path.display());
        let nri = r#"plugins."io.containerd.nri.v1.nri""#;
        assert_eq!(value(nri, "disable"), "false", "{version:?}");
        assert_eq!(value(nri, "socket_path"), quoted(containerd.nri_socket()), "{version:?}");
        let (runtime, images) = match version {
            Version::V1_7 => (r#"plugins."io.containerd.grpc.v1.cri""#, r#"plugins."io.containerd.grpc.v1.cri".containerd"#),
            Version::V2 => (r#"plugins."io.containerd.cri.v1.runtime""#, r#"plugins."io.containerd.cri.v1.images""#),
        };
        let layout = if version == Version::V1_7 { "2" } else { "3" };
        assert!(dump.lines().any(|l| l == format!("version = {layout}")), "{version:?}: {dump}");
        assert_eq!(value(images, "snapshotter"), "\"native\"", "{version:?}");
        assert_eq!(value(runtime, "enable_cdi"), "true", "{version:?}");
        assert_eq!(value(runtime, "cdi_spec_dirs"), format!("[{}]", quoted(&containerd.cdi_dir())), "{version:?}");
        let runc = format!("{runtime}.containerd.runtimes.runc.options");
        assert_eq!(value(&runc, "BinaryName"), quoted(&Cache::locate().unwrap().bin("runc")), "{version:?}");
        assert_eq!(value(&runc, "SystemdCgroup"), "false", "{version:?}");
        if version == Version::V2 {
            let unpack = r#"[plugins."io.containerd.transfer.v1.local".unpack_config]"#;
            assert_eq!(value(unpack, "platform"), "\"linux/amd64\"", "{dump}");
            assert_eq!(value(unpack, "snapshotter"), "\"native\"", "{dump}");
        }
    }
}

/// The value of `key` in the table `[table]` (or the array of tables `[[table]]`, given as
/// `[table]`) of a `containerd config dump`.
fn dumped(dump: &str, table: &str, key: &str) -> Option<String> {
    let header = format!("[{table}]");
    let mut lines = dump.lines().map(str::trim).skip_while(|l| *l != header).skip(1);
    lines.by_ref().take_while(|l| !l.starts_with('[')).find_map(|l| l.strip_prefix(key)?.trim_start().strip_prefix('=').map(|v| v.trim().to_owned()))
}
