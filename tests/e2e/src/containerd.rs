//! A real containerd for the end-to-end tests: started privately from the binaries that
//! `cargo xtask setup` caches (Debian's packages, [`PACKAGES`]), with NRI enabled on a socket
//! the test chooses, and driven through the CRI API like a kubelet would ([`cri`]).
//!
//! Two lines of containerd are cached ([`Version`]): 1.7 (trixie's, [`PACKAGES`], the
//! default) and 2 (Debian unstable's, [`PACKAGES_2`]: its daemon, shim and `ctr`; runc and
//! busybox are 1.7's cache's). [`Containerd::start_version`] names one; [`Containerd::start`]
//! runs [`Version::current`]: the one [`Version::run`] set for the calling thread (a test
//! that runs another test's body on containerd 2), else [`VERSION_ENV`], else 1.7. The two
//! are configured alike in the old and the new layout of the configuration
//! ([`Containerd::config`]).
//!
//! [`Containerd::start`] runs containerd with everything of its own under a temporary
//! directory (root, state, gRPC socket, runc's state, the pods' logs), the `native`
//! snapshotter, runc with the cgroupfs driver (a container's cgroup is the plain directory
//! `<cgroup2 mount>/<pod's cgroup parent>/<container id>`: [`Containerd::container_cgroup`])
//! and imports the test image ([`IMAGE`]: busybox at `/bin`, see [`image`]). Pods share the
//! host's network (no CNI); each pod's cgroup parent is `<this containerd's>/pod<uid>`.
//! [`Containerd::restart`] stops containerd with SIGTERM and starts it again on the same
//! state (the containers keep running under their shims). Dropping it removes every pod
//! through CRI, stops containerd, kills any shim or container process left, unmounts what
//! is left under its directory, and removes its cgroups and files.
//!
//! Programs from the host run in a container through [`ContainerSpec::host_programs`] (the
//! host's library directory and the build's `target/<profile>` bind-mounted read-only) and
//! [`ContainerSpec::fake_driver`] (the fake libcuda and a test's [`FakeNode`]). Without the
//! cache every entry point fails with "run `cargo xtask setup`".
pub mod cri;
pub mod image;

use std::cell::Cell;
use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};

use crate::{cgroup, timeout, wait_for, FakeNode, TempDir};

/// A Debian package whose files `cargo xtask setup` caches.
pub struct Package {
    /// The package's name.
    pub name: &'static str,
    /// The suite it comes from.
    pub suite: &'static str,
    /// Files inside the package, cached as `bin/<file name>` ([`cached_name`]).
    pub files: &'static [&'static str],
}

/// The name in the cache's `bin/` of a file of a package (`usr/bin/ctr` → `ctr`).
pub fn cached_name(file: &str) -> &str {
    file.rsplit('/').next().unwrap_or(file)
}

/// What `cargo xtask setup` fetches: containerd 1.7 with NRI from trixie (a stable suite, so
/// reproducible; bookworm's 1.6 has no NRI), runc from bookworm (trixie's needs a newer
/// glibc than bookworm's), and the static busybox the test image is made of.
pub const PACKAGES: &[Package] = &[
    Package {
        name: "containerd",
        suite: "trixie",
        files: &["usr/bin/containerd", "usr/bin/ctr", "usr/bin/containerd-shim-runc-v2"],
    },
    Package { name: "runc", suite: "bookworm", files: &["usr/sbin/runc"] },
    Package { name: "busybox-static", suite: "bookworm", files: &["bin/busybox"] },
];

/// What `cargo xtask setup` fetches for [`Version::V2`]: the current containerd 2 from Debian
/// unstable (2.1.9 when this was written; it needs glibc 2.34, so it runs on bookworm), its
/// daemon, shim and `ctr`. runc and busybox are [`PACKAGES`]'.
pub const PACKAGES_2: &[Package] = &[Package {
    name: "containerd",
    suite: "sid",
    files: &["usr/bin/containerd", "usr/bin/ctr", "usr/bin/containerd-shim-runc-v2"],
}];

/// The variable naming the containerd [`Containerd::start`] runs where no test chose one
/// (`1.7` or `2`): `VRAMGUARD_E2E_CONTAINERD=2 cargo test -p e2e` runs every containerd test
/// on containerd 2.
pub const VERSION_ENV: &str = "VRAMGUARD_E2E_CONTAINERD";

/// A line of containerd the kit runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    /// containerd 1.7 ([`PACKAGES`]): a version 2 configuration, CDI and NRI off unless it
    /// turns them on.
    V1_7,
    /// containerd 2 ([`PACKAGES_2`]): a version 3 configuration (the CRI plugin's keys split
    /// between `io.containerd.cri.v1.images` and `io.containerd.cri.v1.runtime`), CDI and NRI
    /// on by default.
    V2,
}

thread_local! {
    /// The version [`Version::run`] set for this thread.
    static CHOSEN: Cell<Option<Version>> = const { Cell::new(None) };
}

impl Version {
    /// Both lines, oldest first.
    pub const ALL: [Version; 2] = [Version::V1_7, Version::V2];

    /// `1.7` or `2`.
    pub fn name(self) -> &'static str {
        match self {
            Version::V1_7 => "1.7",
            Version::V2 => "2",
        }
    }

    /// The version named `name` (`1.7`, `2`, or a `2.x`).
    pub fn parse(name: &str) -> Result<Version> {
        match name.trim() {
            "1.7" => Ok(Version::V1_7),
            n if n == "2" || n.starts_with("2.") => Ok(Version::V2),
            other => bail!("no containerd {other:?} in the e2e kit: 1.7 or 2"),
        }
    }

    /// What `cargo xtask setup` caches for it (runc and busybox are in [`PACKAGES`] only).
    pub fn packages(self) -> &'static [Package] {
        match self {
            Version::V1_7 => PACKAGES,
            Version::V2 => PACKAGES_2,
        }
    }

    /// Its cache in the target directory `target`: `target/containerd` (1.7, with runc and
    /// busybox) or `target/containerd-2`.
    pub fn cache_dir_in(self, target: &Path) -> PathBuf {
        match self {
            Version::V1_7 => target.join("containerd"),
            Version::V2 => target.join("containerd-2"),
        }
    }

    /// Whether a CRI `runtime_version` (`1.7.24~ds1`, `2.1.9+unknown`, `v2.1.9`) is of this line.
    pub fn answers(self, runtime_version: &str) -> bool {
        let version = runtime_version.trim_start_matches('v');
        match self {
            Version::V1_7 => version.starts_with("1.7."),
            Version::V2 => version.starts_with("2."),
        }
    }

    /// The version [`Containerd::start`] runs: this thread's ([`Version::run`]), else
    /// [`VERSION_ENV`]'s, else 1.7.
    pub fn current() -> Result<Version> {
        if let Some(chosen) = CHOSEN.with(Cell::get) {
            return Ok(chosen);
        }
        match std::env::var(VERSION_ENV) {
            Ok(name) if !name.trim().is_empty() => Version::parse(&name).with_context(|| format!("{VERSION_ENV}={name}")),
            _ => Ok(Version::V1_7),
        }
    }

    /// Runs `body` with this version as the thread's choice: each [`Containerd::start`] in
    /// it (on this thread) runs this containerd. A test runs another test's body this way on
    /// containerd 2: `Version::V2.run(the_other_test)`.
    pub fn run<T>(self, body: impl FnOnce() -> T) -> T {
        struct Restore(Option<Version>);
        impl Drop for Restore {
            fn drop(&mut self) {
                CHOSEN.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(CHOSEN.with(|c| c.replace(Some(self))));
        eprintln!("e2e kit: this test runs containerd {}", self.name());
        body()
    }
}

/// The file in the cache listing `package version` lines, written last by setup: the cache
/// is complete when it is there.
pub const VERSIONS_FILE: &str = "VERSIONS";

/// The image every pod and container runs (its entrypoint sleeps for ever).
pub const IMAGE: &str = "vramguard.test/busybox:1";
/// The containerd namespace CRI uses.
pub const NAMESPACE: &str = "k8s.io";
/// Where [`ContainerSpec::host_programs`] mounts the build's `target/<profile>` directory.
pub const BUILD_DIR: &str = "/opt/vramguard-e2e";
/// Where [`ContainerSpec::fake_driver`] mounts the fake node's state directory.
pub const FAKE_STATE_DIR: &str = "/run/fakecuda";
/// The dynamic loader of x86-64 glibc programs.
const LOADER: &str = "/lib64/ld-linux-x86-64.so.2";

/// Binaries `cargo xtask setup` cached from Debian's packages: containerd's
/// (`target/containerd/`, [`PACKAGES`]) or another set ([`Cache::open_set`], e.g.
/// [`crate::prometheus`]'s).
pub struct Cache {
    dir: PathBuf,
    versions: String,
}

impl Cache {
    /// The cache directory of the target directory `target` (`target/containerd`: 1.7's,
    /// with runc and busybox).
    pub fn dir_in(target: &Path) -> PathBuf {
        Version::V1_7.cache_dir_in(target)
    }

    /// The cache of the target directory this test binary was built in (1.7's, with runc and
    /// busybox).
    pub fn locate() -> Result<Cache> {
        Cache::locate_version(Version::V1_7)
    }

    /// The cache of `version` in the target directory this test binary was built in.
    pub fn locate_version(version: Version) -> Result<Cache> {
        let profile = crate::target_dir()?;
        let target = profile.parent().ok_or_else(|| anyhow!("{} has no parent", profile.display()))?;
        Cache::open_set(&version.cache_dir_in(target), version.packages())
            .with_context(|| format!("containerd {} for the e2e tests is not fetched", version.name()))
    }

    /// The containerd cache at `dir`; fails, saying to run setup, unless it is complete.
    pub fn open(dir: &Path) -> Result<Cache> {
        Cache::open_set(dir, PACKAGES)
    }

    /// The cache of `packages` at `dir`; fails, saying to run setup, unless it is complete.
    pub fn open_set(dir: &Path, packages: &'static [Package]) -> Result<Cache> {
        let names: Vec<&str> = packages.iter().map(|p| p.name).collect();
        let names = names.join(", ");
        let versions = std::fs::read_to_string(dir.join(VERSIONS_FILE)).map_err(|error| {
            anyhow!(
                "no cache of {names} at {} ({error}): run `cargo xtask setup` (it fetches them from Debian's \
                 archive once)",
                dir.display()
            )
        })?;
        let cache = Cache { dir: dir.to_path_buf(), versions };
        for name in Cache::file_names_of(packages) {
            if !cache.bin(name).is_file() {
                bail!("{} is missing from the cache of {names}: run `cargo xtask setup`", cache.bin(name).display());
            }
        }
        Ok(cache)
    }

    /// The names of every cached containerd binary.
    pub fn file_names() -> impl Iterator<Item = &'static str> {
        Cache::file_names_of(PACKAGES)
    }

    /// The names of the cached binaries of `packages`.
    pub fn file_names_of(packages: &'static [Package]) -> impl Iterator<Item = &'static str> {
        packages.iter().flat_map(|p| p.files.iter()).map(|f| cached_name(f))
    }

    /// A cached binary, e.g. `bin("containerd")`.
    pub fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bin").join(name)
    }

    /// The `package version` lines of what is cached.
    pub fn versions(&self) -> &str {
        &self.versions
    }
}

/// A pod sandbox's id.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodId(pub String);

/// A container's id.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContainerId(pub String);

/// A bind mount into a container.
#[derive(Clone, Debug)]
pub struct Mount {
    pub host: PathBuf,
    pub container: PathBuf,
    pub readonly: bool,
    /// [`cri::PROPAGATION_PRIVATE`] unless given ([`ContainerSpec::mount_propagated`]).
    pub propagation: i32,
}

/// What a container runs and gets.
#[derive(Clone, Debug, Default)]
pub struct ContainerSpec {
    pub name: String,
    /// The command line; empty: the image's entrypoint (sleep for ever).
    pub command: Vec<String>,
    pub env: Vec<(String, String)>,
    pub mounts: Vec<Mount>,
    pub annotations: Vec<(String, String)>,
    /// Host device nodes and their paths in the container (the runtime's `linux.devices`).
    pub devices: Vec<(PathBuf, String)>,
    /// Fully qualified CDI device names in the CRI's `CDI_devices` (as the kubelet passes a
    /// DRA driver's devices).
    pub cdi_devices: Vec<String>,
    /// The image; `None`: [`IMAGE`].
    pub image: Option<String>,
    /// The arguments after the image's entrypoint (with an empty `command`).
    pub args: Vec<String>,
    /// The security context; `None`: the runtime's defaults in the pod's namespaces.
    pub security: Option<cri::LinuxContainerSecurityContext>,
}

impl ContainerSpec {
    /// A container named `name` that sleeps.
    pub fn new(name: &str) -> ContainerSpec {
        ContainerSpec { name: name.into(), ..ContainerSpec::default() }
    }

    /// Its command line.
    pub fn command<S: Into<String>>(mut self, argv: impl IntoIterator<Item = S>) -> ContainerSpec {
        self.command = argv.into_iter().map(Into::into).collect();
        self
    }

    /// An environment variable; a later one of the same name replaces it.
    pub fn env(mut self, key: &str, value: &str) -> ContainerSpec {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.into(), value.into()));
        self
    }

    /// A bind mount.
    pub fn mount(self, host: impl Into<PathBuf>, container: impl Into<PathBuf>, readonly: bool) -> ContainerSpec {
        self.mount_propagated(host, container, readonly, cri::PROPAGATION_PRIVATE)
    }

    /// A bind mount with a propagation mode ([`cri::PROPAGATION_HOST_TO_CONTAINER`]: mounts
    /// made under the host path later reach the container).
    pub fn mount_propagated(mut self, host: impl Into<PathBuf>, container: impl Into<PathBuf>, readonly: bool, propagation: i32) -> ContainerSpec {
        self.mounts.push(Mount { host: host.into(), container: container.into(), readonly, propagation });
        self
    }

    /// The host device node `host` at `container` (read, write, mknod), as a device plugin
    /// gives one.
    pub fn device(mut self, host: impl Into<PathBuf>, container: &str) -> ContainerSpec {
        self.devices.push((host.into(), container.into()));
        self
    }

    /// A CDI device in the CRI's `CDI_devices` field.
    pub fn cdi_device(mut self, name: &str) -> ContainerSpec {
        self.cdi_devices.push(name.into());
        self
    }

    /// An annotation.
    pub fn annotation(mut self, key: &str, value: &str) -> ContainerSpec {
        self.annotations.push((key.into(), value.into()));
        self
    }

    /// Lets the container run the host's glibc programs and this build's binaries: the host's
    /// library directory (the one holding the loader) at the same path and `target/<profile>`
    /// at [`BUILD_DIR`], both read-only. Nothing is mounted over `/usr/lib/vramguard`,
    /// `/run/vramguard` or `/etc`.
    pub fn host_programs(self) -> Result<ContainerSpec> {
        let libs = host_library_dir()?;
        Ok(self.mount(&libs, &libs, true).mount(crate::target_dir()?, BUILD_DIR, true))
    }

    /// [`ContainerSpec::host_programs`], plus the fake driver on `LD_LIBRARY_PATH` and the
    /// fake machine `node` (its state directory mounted read-write at [`FAKE_STATE_DIR`],
    /// its `FAKECUDA_*` variables set): a `fakecuda-workload` ([`workload_path`]) in the
    /// container shares devices with the node's workloads on the host.
    pub fn fake_driver(self, node: &FakeNode) -> Result<ContainerSpec> {
        let mut spec = self.host_programs()?.env("LD_LIBRARY_PATH", &fake_driver_path()?);
        for (key, value) in node.env() {
            let key = key.to_str().ok_or_else(|| anyhow!("non-UTF-8 variable name"))?;
            let value = value.to_str().ok_or_else(|| anyhow!("non-UTF-8 value of {key}"))?;
            spec = spec.env(key, value);
        }
        Ok(spec.env("FAKECUDA_STATE_DIR", FAKE_STATE_DIR).mount(node.state_dir(), FAKE_STATE_DIR, false))
    }
}

/// The directory of [`crate::fake_driver_dir`] as a container sees it
/// ([`ContainerSpec::host_programs`]).
pub fn fake_driver_path() -> Result<String> {
    let driver = crate::fake_driver_dir()?;
    let target = crate::target_dir()?;
    let under = driver
        .strip_prefix(&target)
        .ok()
        .and_then(Path::to_str)
        .ok_or_else(|| anyhow!("the fake driver {} is not under {}", driver.display(), target.display()))?;
    Ok(format!("{BUILD_DIR}/{under}"))
}

/// `fakecuda-workload` as a container sees it ([`ContainerSpec::host_programs`]).
pub fn workload_path() -> String {
    format!("{BUILD_DIR}/fakecuda-workload")
}

/// The host directory holding the resolved dynamic loader.
fn host_library_dir() -> Result<PathBuf> {
    let loader = std::fs::canonicalize(LOADER).with_context(|| format!("cannot resolve {LOADER}"))?;
    loader.parent().map(Path::to_path_buf).ok_or_else(|| anyhow!("{} has no parent", loader.display()))
}

/// What an `exec_sync` gave.
#[derive(Debug)]
pub struct Exec {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// A pod as created: its sandbox config goes with each of its containers' creation.
struct Pod {
    config: cri::PodSandboxConfig,
}

/// A private containerd with NRI; see the module's documentation.
pub struct Containerd {
    /// Which containerd runs.
    version: Version,
    /// Its daemon, shim and `ctr`.
    cache: Cache,
    /// runc and busybox (1.7's cache).
    base: Cache,
    /// What its CRI `Version` answered at the latest start.
    runtime_version: String,
    dir: TempDir,
    nri_socket: PathBuf,
    process: Option<Child>,
    cri: cri::Client,
    /// This containerd's cgroup parent, relative to the cgroup roots (`/vramguard-e2e-…`).
    cgroup_parent: String,
    pods: Mutex<HashMap<PodId, Pod>>,
    started: Duration,
    /// Host paths seen elsewhere by this containerd (and its shims and containers):
    /// `(directory of the test, path)` ([`Containerd::start_seeing`]).
    binds: Vec<(PathBuf, PathBuf)>,
    /// Host paths of `binds` this harness created (removed, if still empty, when dropped).
    created: Vec<PathBuf>,
}

impl Containerd {
    /// Starts a containerd ([`Version::current`]) whose NRI socket is `nri_socket` (its
    /// directory must exist) and imports the test image; returns once it answers CRI and the
    /// NRI socket is there.
    pub fn start(nri_socket: &Path) -> Result<Containerd> {
        Containerd::start_seeing(nri_socket, &[])
    }

    /// [`Containerd::start`] of containerd `version`; fails, saying that `cargo xtask setup`
    /// fetches it, where it is not cached.
    pub fn start_version(version: Version, nri_socket: &Path) -> Result<Containerd> {
        Containerd::start_version_seeing(version, nri_socket, &[])
    }

    /// [`Containerd::start`], with containerd in a mount namespace of its own (a slave of the
    /// host's, so the host's mounts still reach it and its own reach nobody) where each
    /// `(dir, path)` of `binds` has the test's directory `dir` bind-mounted at `path`, as a
    /// shared mount: containers see `dir` wherever a pod names the host path `path`, and a
    /// mount made under `path` in containerd's namespace reaches containers that mount it
    /// with `HostToContainer` propagation. Each `path` is created on the host if missing
    /// (empty; nothing is mounted there in the host's namespace). Its namespace is
    /// `/proc/<pid()>/ns/mnt`.
    pub fn start_seeing(nri_socket: &Path, binds: &[(PathBuf, PathBuf)]) -> Result<Containerd> {
        Containerd::start_version_seeing(Version::current()?, nri_socket, binds)
    }

    /// [`Containerd::start_seeing`] of containerd `version`.
    pub fn start_version_seeing(version: Version, nri_socket: &Path, binds: &[(PathBuf, PathBuf)]) -> Result<Containerd> {
        let base = Cache::locate()?;
        let cache = Cache::locate_version(version)?;
        let dir = TempDir::new("containerd")?;
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let cgroup_parent = format!("/vramguard-e2e-containerd-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let socket = dir.path().join("containerd.sock");
        let mut containerd = Containerd {
            cri: cri::Client::new(&socket, timeout())?,
            version,
            cache,
            base,
            runtime_version: String::new(),
            dir,
            nri_socket: nri_socket.to_path_buf(),
            process: None,
            cgroup_parent,
            pods: Mutex::new(HashMap::new()),
            started: Duration::ZERO,
            binds: binds.to_vec(),
            created: Vec::new(),
        };
        containerd.write_config()?;
        containerd.launch()?;
        containerd.import_image()?;
        Ok(containerd)
    }

    /// Stops containerd with SIGTERM (waiting for it to exit) and starts it again on the same
    /// root and state; returns once it answers CRI again.
    pub fn restart(&mut self) -> Result<()> {
        self.terminate()?;
        self.launch()
    }

    /// How long the latest start took (launch to CRI and NRI ready).
    pub fn start_time(&self) -> Duration {
        self.started
    }

    /// The CRI client.
    pub fn cri(&self) -> &cri::Client {
        &self.cri
    }

    /// containerd's gRPC (and CRI) socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    /// The NRI socket containerd listens on.
    pub fn nri_socket(&self) -> &Path {
        &self.nri_socket
    }

    /// containerd's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Child::id)
    }

    /// The cache its daemon, shim and `ctr` come from (1.7's also holds runc and busybox).
    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// Which containerd this is.
    pub fn version(&self) -> Version {
        self.version
    }

    /// What its CRI `Version` answered as the runtime's version at the latest start
    /// (`1.7.24~ds1`, `2.1.9+unknown`).
    pub fn runtime_version(&self) -> &str {
        &self.runtime_version
    }

    /// What containerd logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    /// This containerd's cgroup parent (every pod's cgroup is under it), relative to a cgroup
    /// root, e.g. `/vramguard-e2e-containerd-123-0`.
    pub fn cgroup_parent(&self) -> &str {
        &self.cgroup_parent
    }

    /// Runs a pod sandbox sharing the host's network, with cgroup parent
    /// `<cgroup_parent()>/pod<uid>` (`uid`: letters, digits and `-`).
    pub fn pod(&self, name: &str, namespace: &str, uid: &str, annotations: &[(&str, &str)]) -> Result<PodId> {
        self.pod_in(name, namespace, uid, annotations, namespaces())
    }

    /// [`Containerd::pod`] in the host's pid namespace (`hostPID: true`); its containers get
    /// [`host_pid_namespaces`].
    pub fn host_pid_pod(&self, name: &str, namespace: &str, uid: &str) -> Result<PodId> {
        self.pod_in(name, namespace, uid, &[], host_pid_namespaces())
    }

    fn pod_in(&self, name: &str, namespace: &str, uid: &str, annotations: &[(&str, &str)], options: cri::NamespaceOption) -> Result<PodId> {
        if uid.is_empty() || !uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            bail!("pod uid {uid:?}: letters, digits and '-' only (it names a cgroup)");
        }
        let logs = self.dir.path().join("pods").join(uid);
        std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
        let config = cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata { name: name.into(), uid: uid.into(), namespace: namespace.into(), attempt: 0 }),
            // The host's UTS namespace (with its network): runc sets no hostname there.
            hostname: String::new(),
            log_directory: logs.to_string_lossy().into_owned(),
            labels: HashMap::new(),
            annotations: annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            linux: Some(cri::LinuxPodSandboxConfig {
                cgroup_parent: format!("{}/pod{uid}", self.cgroup_parent),
                security_context: Some(cri::LinuxSandboxSecurityContext { namespace_options: Some(options) }),
            }),
        };
        let response: cri::RunPodSandboxResponse = self
            .cri
            .call("RunPodSandbox", &cri::RunPodSandboxRequest { config: Some(config.clone()), runtime_handler: String::new() })
            .with_context(|| self.log_hint())?;
        let id = PodId(response.pod_sandbox_id);
        self.pods.lock().map_err(|_| anyhow!("pods lock poisoned"))?.insert(id.clone(), Pod { config });
        Ok(id)
    }

    /// Creates (does not start) a container in `pod`.
    pub fn create_container(&self, pod: &PodId, spec: &ContainerSpec) -> Result<ContainerId> {
        let sandbox_config = {
            let pods = self.pods.lock().map_err(|_| anyhow!("pods lock poisoned"))?;
            pods.get(pod).ok_or_else(|| anyhow!("no pod {} made by this harness", pod.0))?.config.clone()
        };
        let path = |p: &Path| p.to_string_lossy().into_owned();
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata { name: spec.name.clone(), attempt: 0 }),
            image: Some(cri::ImageSpec { image: spec.image.clone().unwrap_or_else(|| IMAGE.into()) }),
            command: spec.command.clone(),
            args: spec.args.clone(),
            envs: spec.env.iter().map(|(k, v)| cri::KeyValue { key: k.clone(), value: v.clone() }).collect(),
            mounts: spec
                .mounts
                .iter()
                .map(|m| cri::Mount {
                    container_path: path(&m.container),
                    host_path: path(&m.host),
                    readonly: m.readonly,
                    propagation: m.propagation,
                })
                .collect(),
            annotations: spec.annotations.iter().cloned().collect(),
            devices: spec
                .devices
                .iter()
                .map(|(host, container)| cri::Device { container_path: container.clone(), host_path: path(host), permissions: "rwm".into() })
                .collect(),
            cdi_devices: spec.cdi_devices.iter().map(|name| cri::CdiDevice { name: name.clone() }).collect(),
            log_path: format!("{}.log", spec.name),
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(spec.security.clone().unwrap_or_else(|| cri::LinuxContainerSecurityContext {
                    namespace_options: Some(namespaces()),
                    ..cri::LinuxContainerSecurityContext::default()
                })),
            }),
            ..cri::ContainerConfig::default()
        };
        let request =
            cri::CreateContainerRequest { pod_sandbox_id: pod.0.clone(), config: Some(config), sandbox_config: Some(sandbox_config) };
        let response: cri::CreateContainerResponse = self.cri.call("CreateContainer", &request).with_context(|| self.log_hint())?;
        Ok(ContainerId(response.container_id))
    }

    /// Starts a created container.
    pub fn start_container(&self, container: &ContainerId) -> Result<()> {
        let _: cri::Empty = self
            .cri
            .call("StartContainer", &cri::ContainerIdRequest { container_id: container.0.clone() })
            .with_context(|| self.log_hint())?;
        Ok(())
    }

    /// Creates and starts a container.
    pub fn run_container(&self, pod: &PodId, spec: &ContainerSpec) -> Result<ContainerId> {
        let id = self.create_container(pod, spec)?;
        self.start_container(&id)?;
        Ok(id)
    }

    /// Runs `argv` in a running container (with its environment) and waits for it.
    pub fn exec_sync(&self, container: &ContainerId, argv: &[&str]) -> Result<Exec> {
        let request = cri::ExecSyncRequest {
            container_id: container.0.clone(),
            cmd: argv.iter().map(|s| s.to_string()).collect(),
            timeout: timeout().as_secs() as i64,
        };
        let response: cri::ExecSyncResponse = self.cri.call("ExecSync", &request)?;
        Ok(Exec {
            exit_code: response.exit_code,
            stdout: String::from_utf8_lossy(&response.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&response.stderr).into_owned(),
        })
    }

    /// Stops a container: its stop signal (SIGTERM), then SIGKILL after `grace`.
    pub fn stop_container(&self, container: &ContainerId, grace: Duration) -> Result<()> {
        let request = cri::StopContainerRequest { container_id: container.0.clone(), timeout: grace.as_secs() as i64 };
        let _: cri::Empty = self.cri.call("StopContainer", &request)?;
        Ok(())
    }

    /// Removes a container (stopping it first if it runs).
    pub fn remove_container(&self, container: &ContainerId) -> Result<()> {
        let _: cri::Empty = self.cri.call("RemoveContainer", &cri::ContainerIdRequest { container_id: container.0.clone() })?;
        Ok(())
    }

    /// Stops and removes a pod and its containers.
    pub fn remove_pod(&self, pod: &PodId) -> Result<()> {
        let request = cri::PodSandboxIdRequest { pod_sandbox_id: pod.0.clone() };
        let _: cri::Empty = self.cri.call("StopPodSandbox", &request)?;
        let _: cri::Empty = self.cri.call("RemovePodSandbox", &request)?;
        self.pods.lock().map_err(|_| anyhow!("pods lock poisoned"))?.remove(pod);
        Ok(())
    }

    /// The container's status with containerd's verbose information.
    pub fn status(&self, container: &ContainerId) -> Result<cri::ContainerStatusResponse> {
        self.cri.call("ContainerStatus", &cri::ContainerStatusRequest { container_id: container.0.clone(), verbose: true })
    }

    /// containerd's verbose information on a container (`pid`, `runtimeSpec`, ...).
    pub fn info(&self, container: &ContainerId) -> Result<serde_json::Value> {
        let status = self.status(container)?;
        let info = status.info.get("info").ok_or_else(|| anyhow!("no verbose info for container {}", container.0))?;
        serde_json::from_str(info).with_context(|| format!("container {}'s verbose info is not JSON", container.0))
    }

    /// The OCI runtime spec containerd gave runc (after NRI's adjustments).
    pub fn runtime_spec(&self, container: &ContainerId) -> Result<serde_json::Value> {
        let mut info = self.info(container)?;
        match info.get_mut("runtimeSpec") {
            Some(spec) => Ok(spec.take()),
            None => bail!("container {}'s verbose info has no runtimeSpec", container.0),
        }
    }

    /// Where this containerd reads CDI specs (`cdi_spec_dirs`): a spec written there names
    /// devices a container gets through a `cdi.k8s.io/<name>` annotation.
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    /// The host pid of the container's first process (0 once it has exited).
    pub fn container_pid(&self, container: &ContainerId) -> Result<u32> {
        let info = self.info(container)?;
        let pid = info.get("pid").and_then(serde_json::Value::as_u64).ok_or_else(|| anyhow!("no pid in container {}'s info", container.0))?;
        u32::try_from(pid).context("pid out of range")
    }

    /// The container's cgroup as runc was told it (`linux.cgroupsPath`, e.g.
    /// `/vramguard-e2e-containerd-1-0/podUID/<container id>`).
    pub fn container_cgroup_path(&self, container: &ContainerId) -> Result<String> {
        let spec = self.runtime_spec(container)?;
        spec.pointer("/linux/cgroupsPath")
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("container {} has no linux.cgroupsPath", container.0))
    }

    /// The container's cgroup2 directory on the host (under the cgroup2 mount).
    pub fn container_cgroup(&self, container: &ContainerId) -> Result<PathBuf> {
        let path = self.container_cgroup_path(container)?;
        Ok(cgroup::cgroup2_root()?.join(path.trim_start_matches('/')))
    }

    /// The container's environment (`NAME=value`), as runc was given it.
    pub fn container_env(&self, container: &ContainerId) -> Result<Vec<String>> {
        let spec = self.runtime_spec(container)?;
        let env = spec.pointer("/process/env").and_then(serde_json::Value::as_array).ok_or_else(|| anyhow!("no process.env"))?;
        Ok(env.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
    }

    /// The container's mounts as runc was given them: (destination, source, options).
    pub fn container_mounts(&self, container: &ContainerId) -> Result<Vec<(String, String, Vec<String>)>> {
        let spec = self.runtime_spec(container)?;
        let mounts = spec.get("mounts").and_then(serde_json::Value::as_array).ok_or_else(|| anyhow!("no mounts"))?;
        let text = |m: &serde_json::Value, key: &str| m.get(key).and_then(serde_json::Value::as_str).unwrap_or_default().to_owned();
        Ok(mounts
            .iter()
            .map(|m| {
                let options = m.get("options").and_then(serde_json::Value::as_array).map(|o| o.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect());
                (text(m, "destination"), text(m, "source"), options.unwrap_or_default())
            })
            .collect())
    }

    /// What the container wrote on stdout and stderr so far (the CRI log's message parts).
    pub fn container_log(&self, pod: &PodId, container: &ContainerId) -> Result<String> {
        let (logs, name) = {
            let pods = self.pods.lock().map_err(|_| anyhow!("pods lock poisoned"))?;
            let pod = pods.get(pod).ok_or_else(|| anyhow!("no pod {} made by this harness", pod.0))?;
            let status = self.status(container)?;
            let name = status.status.and_then(|s| s.metadata).map(|m| m.name).ok_or_else(|| anyhow!("container {} has no name", container.0))?;
            (PathBuf::from(&pod.config.log_directory), name)
        };
        let path = logs.join(format!("{name}.log"));
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        // Each line: `<time> <stream> <tag> <text>`; tag `P`: a partial line, continued by the next.
        let mut out = String::new();
        for line in text.lines() {
            let mut parts = line.splitn(4, ' ');
            let (Some(_), Some(_), Some(tag), Some(message)) = (parts.next(), parts.next(), parts.next(), parts.next()) else { continue };
            out.push_str(message);
            if tag != "P" {
                out.push('\n');
            }
        }
        Ok(out)
    }

    fn write_config(&self) -> Result<()> {
        let dir = self.dir.path();
        for sub in ["root", "state", "runc", "opt", "cni", "nri-plugins", "nri-conf", "cdi"] {
            std::fs::create_dir_all(dir.join(sub)).with_context(|| format!("cannot create {}", dir.join(sub).display()))?;
        }
        let path = dir.join("config.toml");
        std::fs::write(&path, self.config()).with_context(|| format!("cannot write {}", path.display()))
    }

    /// The configuration: its own root, state, sockets and directories, the test image as
    /// the sandbox image, the `native` snapshotter, runc from the cache with the cgroupfs
    /// driver, CDI from [`Containerd::cdi_dir`] and NRI on the test's socket. containerd 1.7
    /// reads it in version 2's layout (CDI and NRI turned on here); containerd 2 in version
    /// 3's, where both are on by default (said here all the same) and `ctr images import`
    /// (through the transfer service) needs to be told what to unpack to.
    pub fn config(&self) -> String {
        let dir = self.dir.path();
        let quote = |p: PathBuf| toml_string(&p.to_string_lossy());
        let (root, state, socket, ttrpc, opt) = (
            quote(dir.join("root")),
            quote(dir.join("state")),
            quote(self.socket()),
            quote(dir.join("containerd.ttrpc.sock")),
            quote(dir.join("opt")),
        );
        let (image, runc, runc_root, cni, cdi) = (
            toml_string(IMAGE),
            quote(self.base.bin("runc")),
            quote(dir.join("runc")),
            quote(dir.join("cni")),
            quote(self.cdi_dir()),
        );
        let (nri, nri_plugins, nri_conf) = (quote(self.nri_socket.clone()), quote(dir.join("nri-plugins")), quote(dir.join("nri-conf")));
        // Top-level keys (before any table), then the tables both versions read alike.
        let top = format!("root = {root}\nstate = {state}\n");
        let common = format!(
            r#"[grpc]
  address = {socket}

[ttrpc]
  address = {ttrpc}

[plugins."io.containerd.internal.v1.opt"]
  path = {opt}

[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = {nri}
  plugin_path = {nri_plugins}
  plugin_config_path = {nri_conf}
"#
        );
        // The CRI plugin's runtime part, in the table `table` (1.7: `io.containerd.grpc.v1.cri`,
        // which also holds the images' keys, `more`; 2: `io.containerd.cri.v1.runtime`).
        let runtime = |table: &str, more: &str, more_containerd: &str, cni_bin: &str| {
            format!(
                r#"[{table}]
{more}  restrict_oom_score_adj = true
  disable_apparmor = true
  # CDI devices named in a container's `cdi.k8s.io/` annotations or CRI's CDI_devices, from
  # the specs a test writes in [`Containerd::cdi_dir`] (CDI is on by default in containerd 2).
  enable_cdi = true
  cdi_spec_dirs = [{cdi}]
  [{table}.containerd]
{more_containerd}    default_runtime_name = "runc"
    [{table}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{table}.containerd.runtimes.runc.options]
        BinaryName = {runc}
        Root = {runc_root}
        SystemdCgroup = false
  [{table}.cni]
    {cni_bin}
    conf_dir = {cni}
"#
            )
        };
        match self.version {
            Version::V1_7 => {
                let runtime = runtime(
                    r#"plugins."io.containerd.grpc.v1.cri""#,
                    &format!("  sandbox_image = {image}\n"),
                    "    snapshotter = \"native\"\n",
                    &format!("bin_dir = {cni}"),
                );
                format!(
                    r#"version = 2
{top}# Snapshotters this harness does not use, not probed.
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

{common}
{runtime}"#
                )
            }
            Version::V2 => {
                let runtime = runtime(r#"plugins."io.containerd.cri.v1.runtime""#, "", "", &format!("bin_dirs = [{cni}]"));
                format!(
                    r#"version = 3
{top}# Snapshotters and differs this harness does not use, not probed.
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.erofs", "io.containerd.snapshotter.v1.blockfile", "io.containerd.differ.v1.erofs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

{common}
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = {image}

{runtime}
# `ctr images import` goes through the transfer service, which unpacks only to what it is
# given here ("no unpack platforms defined" otherwise).
[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = "linux/amd64"
  snapshotter = "native"
"#
                )
            }
        }
    }

    /// Starts the containerd process and waits until it answers CRI and NRI's socket is there.
    fn launch(&mut self) -> Result<()> {
        let start = Instant::now();
        let log_path = self.dir.path().join("containerd.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("cannot open {}", log_path.display()))?;
        let log_offset = log.metadata().map(|m| m.len()).unwrap_or(0);
        // The shim is found on PATH.
        let mut path = vec![self.cache.bin("containerd").parent().map(Path::to_path_buf).unwrap_or_default()];
        if let Some(old) = std::env::var_os("PATH") {
            path.extend(std::env::split_paths(&old));
        }
        let mut command = Command::new(self.cache.bin("containerd"));
        command
            .arg("--config")
            .arg(self.dir.path().join("config.toml"))
            .env("PATH", std::env::join_paths(path).context("bad PATH")?)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if !self.binds.is_empty() {
            private_mounts(&mut command, &self.binds, &mut self.created)?;
        }
        let child = command.spawn().with_context(|| format!("cannot start {}", self.cache.bin("containerd").display()))?;
        self.process = Some(child);
        let ready = wait_for(timeout(), "containerd to answer CRI with its NRI socket in place", || {
            if let Some(child) = self.process.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!("containerd exited ({status}); its log:\n{}", tail(&log_path, log_offset));
                }
            }
            Ok(self.nri_socket.exists() && self.socket().exists() && self.cri.version().is_ok())
        });
        if let Err(error) = ready {
            return Err(error.context(format!("containerd's log:\n{}", tail(&log_path, log_offset))));
        }
        self.started = start.elapsed();
        let answered = self.cri.version()?.runtime_version;
        if !self.version.answers(&answered) {
            bail!("containerd {} was asked for, {} answers CRI (cache {})", self.version.name(), answered, self.cache.bin("containerd").display());
        }
        eprintln!("e2e kit: containerd {answered} ({} asked) serves CRI and NRI after {:?}", self.version.name(), self.started);
        self.runtime_version = answered;
        Ok(())
    }

    /// Imports the test image (built from the cached busybox) into CRI's namespace.
    fn import_image(&self) -> Result<()> {
        let archive = self.dir.path().join("image.tar");
        let loader = std::fs::canonicalize(LOADER).with_context(|| format!("cannot resolve {LOADER}"))?;
        image::write_archive(&archive, IMAGE, &["/bin/sleep", "2147483647"], &self.base.bin("busybox"), &loader)?;
        self.import(&archive)
    }

    /// Imports an OCI image archive into CRI's namespace (`ctr images import`), under the
    /// name its index gives; returns once CRI's image service knows every image of the
    /// namespace. (CRI learns of an imported image from containerd's event, after `ctr` has
    /// returned: a pod run at once can miss its sandbox image and try to pull it, as one
    /// run in CI did on containerd 2.)
    pub fn import(&self, archive: &Path) -> Result<()> {
        let output = Command::new(self.cache.bin("ctr"))
            .arg("--address")
            .arg(self.socket())
            .args(["--namespace", NAMESPACE, "images", "import", "--snapshotter", "native"])
            .arg(archive)
            .stdin(Stdio::null())
            .output()
            .context("cannot run ctr")?;
        if !output.status.success() {
            bail!(
                "ctr images import failed ({}): {}{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let listed = Command::new(self.cache.bin("ctr"))
            .arg("--address")
            .arg(self.socket())
            .args(["--namespace", NAMESPACE, "images", "ls", "-q"])
            .stdin(Stdio::null())
            .output()
            .context("cannot run ctr")?;
        ensure!(listed.status.success(), "ctr images ls failed ({}): {}", listed.status, String::from_utf8_lossy(&listed.stderr));
        let names = String::from_utf8_lossy(&listed.stdout).into_owned();
        for name in names.lines().filter(|n| !n.is_empty()) {
            wait_for(timeout(), &format!("CRI to know the imported image {name}"), || self.cri.has_image(name))?;
        }
        Ok(())
    }

    /// SIGTERMs containerd and waits for it (SIGKILL after the e2e timeout).
    fn terminate(&mut self) -> Result<()> {
        let Some(mut child) = self.process.take() else { return Ok(()) };
        let pid = child.id() as libc::pid_t;
        // SAFETY: kill(2) on our own child, not yet reaped, so its pid is still its own.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + timeout();
        loop {
            if child.try_wait()?.is_some() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("containerd did not exit within {:?} of SIGTERM (killed)", timeout());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn log_hint(&self) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("level=error") || l.contains("level=warn")).collect();
        format!("containerd's recent warnings and errors:\n{}", lines[lines.len().saturating_sub(10)..].join("\n"))
    }

    /// Removes every pod this containerd knows (best effort).
    fn remove_all_pods(&self) {
        let listed: Result<cri::ListPodSandboxResponse> = self.cri.call("ListPodSandbox", &cri::ListPodSandboxRequest {});
        match listed {
            Ok(list) => {
                for pod in list.items {
                    if let Err(error) = self.remove_pod(&PodId(pod.id.clone())) {
                        eprintln!("containerd harness: cannot remove pod {}: {error:#}", pod.id);
                    }
                }
            }
            Err(error) => eprintln!("containerd harness: cannot list pods: {error:#}"),
        }
    }

    /// Kills what is left of this containerd: its shims (their command line names its socket)
    /// and any process in its cgroups.
    fn kill_leftovers(&self) {
        let socket = self.socket();
        let socket = socket.as_os_str().as_bytes();
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for entry in entries.flatten() {
                let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<libc::pid_t>().ok()) else { continue };
                let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
                if cmdline.split(|&b| b == 0).any(|arg| arg == socket) {
                    // SAFETY: kill(2); the process names this harness's private socket, so it
                    // is one of this containerd's shims.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        for dir in self.cgroup_dirs() {
            for procs in cgroup_tree(&dir).iter().map(|d| d.join("cgroup.procs")) {
                let Ok(text) = std::fs::read_to_string(&procs) else { continue };
                for pid in text.lines().filter_map(|l| l.trim().parse::<libc::pid_t>().ok()) {
                    // SAFETY: kill(2) on a process in this harness's own cgroup.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
    }

    /// This containerd's cgroup parent in every mounted hierarchy where it exists.
    fn cgroup_dirs(&self) -> Vec<PathBuf> {
        let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else { return Vec::new() };
        mountinfo
            .lines()
            .filter_map(|line| {
                let (left, right) = line.split_once(" - ")?;
                let fstype = right.split_whitespace().next()?;
                (fstype == "cgroup" || fstype == "cgroup2").then(|| left.split_whitespace().nth(4).map(PathBuf::from))?
            })
            .map(|root| root.join(self.cgroup_parent.trim_start_matches('/')))
            .filter(|dir| dir.is_dir())
            .collect()
    }

}

impl Drop for Containerd {
    fn drop(&mut self) {
        if self.process.is_some() {
            self.remove_all_pods();
        }
        if let Err(error) = self.terminate() {
            eprintln!("containerd harness: {error:#}");
        }
        self.kill_leftovers();
        crate::unmount_under(self.dir.path());
        for path in self.created.iter().rev() {
            let _ = std::fs::remove_dir(path);
        }
        for dir in self.cgroup_dirs() {
            let tree = cgroup_tree(&dir);
            for cgroup in tree.iter().rev() {
                // Killed processes leave their cgroup a moment after the signal.
                let _ = wait_for(Duration::from_secs(5), "an emptied cgroup to go", || {
                    Ok(std::fs::remove_dir(cgroup).is_ok() || !cgroup.exists())
                });
            }
        }
    }
}

/// Makes `command` start in a mount namespace of its own, a slave of the caller's, with each
/// `(dir, path)` of `binds` bind-mounted at `path` and made shared ([`Containerd::start_seeing`]).
/// Records in `created` the host paths it had to create (empty directories, removed when the
/// harness is dropped).
fn private_mounts(command: &mut Command, binds: &[(PathBuf, PathBuf)], created: &mut Vec<PathBuf>) -> Result<()> {
    use std::ffi::CString;
    use std::os::unix::process::CommandExt as _;
    let mut pairs = Vec::new();
    for (dir, path) in binds {
        if !path.exists() {
            std::fs::create_dir_all(path).with_context(|| format!("cannot create {}", path.display()))?;
            created.push(path.clone());
        }
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(|_| anyhow!("{} has a NUL byte", p.display()));
        pairs.push((c(dir)?, c(path)?));
    }
    let root = CString::new("/").map_err(|_| anyhow!("NUL"))?;
    // SAFETY: the closure runs in the child between fork and exec; it calls only unshare(2)
    // and mount(2) (async-signal-safe) on strings made before the fork, and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            let check = |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(std::ptr::null(), root.as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_SLAVE, std::ptr::null()))?;
            for (dir, path) in &pairs {
                check(libc::mount(dir.as_ptr(), path.as_ptr(), std::ptr::null(), libc::MS_BIND | libc::MS_REC, std::ptr::null()))?;
                check(libc::mount(std::ptr::null(), path.as_ptr(), std::ptr::null(), libc::MS_SHARED, std::ptr::null()))?;
            }
            Ok(())
        });
    }
    Ok(())
}

/// `dir` and every cgroup below it, parents first.
fn cgroup_tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    let mut next = 0;
    while next < out.len() {
        if let Ok(entries) = std::fs::read_dir(&out[next]) {
            out.extend(entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
        }
        next += 1;
    }
    out
}

/// The namespaces a kubelet asks for a host-network pod: the host's network, a pid
/// namespace per container, an IPC namespace per pod.
fn namespaces() -> cri::NamespaceOption {
    cri::NamespaceOption { network: cri::NAMESPACE_NODE, pid: cri::NAMESPACE_CONTAINER, ipc: cri::NAMESPACE_POD }
}

/// A host-network pod's namespaces with the host's pid namespace (`hostPID: true`).
pub fn host_pid_namespaces() -> cri::NamespaceOption {
    cri::NamespaceOption { pid: cri::NAMESPACE_NODE, ..namespaces() }
}

/// A TOML basic string.
fn toml_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The last lines of a log file from `offset` on.
fn tail(path: &Path, offset: u64) -> String {
    let mut text = String::new();
    if let Ok(mut file) = std::fs::File::open(path) {
        let _ = file.seek(SeekFrom::Start(offset));
        let _ = file.read_to_string(&mut text);
    }
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
