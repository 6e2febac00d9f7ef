//! Where the node's NVIDIA driver keeps its user-space libraries (`libcuda.so.1`, which the
//! probes attach to, and `libnvidia-ml.so.1`, NVML), found by the agent itself so that no
//! DaemonSet needs a per-distribution path: the known install directories are looked at under
//! the host's root as the agent sees it (`--host-root`, the DaemonSet's read-only hostPath of
//! `/`; `/` for an agent on the host), the NVIDIA GPU operator's driver root
//! (`/run/nvidia/driver`, where its driver container installs a whole root) first; a driver in
//! none of them is looked for where the host's `ld.so.cache` says its names are (a
//! distribution's own layout, such as a directory per driver version).
//!
//! Each name is resolved inside that root (`openat2(2)` with `RESOLVE_IN_ROOT`): a driver's
//! `libcuda.so.1 -> /usr/lib/...` symlink names the host's file, never the agent
//! container's. The file found is named as the agent sees it (`/host/usr/lib/...`), the path
//! the probes and `dlopen` use; what was found, and where, is logged and in `vramguard audit`
//! (the driver view's `install`).
use std::{
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use nix::fcntl::{openat2, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

/// The CUDA driver library's file name.
pub const LIBCUDA: &str = "libcuda.so.1";

/// The known install directories, relative to a root, in the order they are looked at, and
/// whose layout each is.
pub const KNOWN_DIRS: [(&str, &str); 11] = [
    ("run/nvidia/driver/usr/lib/x86_64-linux-gnu", "the NVIDIA GPU operator's driver root"),
    ("run/nvidia/driver/usr/lib64", "the NVIDIA GPU operator's driver root"),
    ("run/nvidia/driver/usr/lib/aarch64-linux-gnu", "the NVIDIA GPU operator's driver root"),
    ("usr/lib/x86_64-linux-gnu", "Debian and Ubuntu"),
    ("usr/lib64", "RHEL, Fedora, SUSE and Amazon Linux"),
    ("usr/lib/aarch64-linux-gnu", "Debian and Ubuntu on arm64"),
    ("home/kubernetes/bin/nvidia/lib64", "GKE's Container-Optimized OS"),
    ("var/lib/nvidia/lib64", "Container-Optimized OS's cos-extensions"),
    ("usr/local/nvidia/lib64", "GKE and NVIDIA's container images"),
    ("usr/lib/x86_64-linux-gnu/nvidia/current", "Debian's nvidia packages"),
    ("usr/lib", "a distribution without a multiarch directory"),
];

/// The NVIDIA GPU operator's driver root, relative to the host's root.
pub const OPERATOR_ROOT: &str = "run/nvidia/driver";

/// What was found under a root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The root looked under, as the agent sees it.
    pub root: PathBuf,
    /// The directory, relative to the root, where libcuda was found (else where NVML was).
    pub dir: Option<String>,
    /// Whose layout that directory is.
    pub layout: Option<&'static str>,
    /// libcuda, as the agent sees the file (symlinks resolved inside the root).
    pub libcuda: Option<PathBuf>,
    /// NVML, the same way: beside libcuda when it is there, else in the first known directory
    /// that has it.
    pub nvml: Option<PathBuf>,
}

impl Found {
    /// One line for the log and the audit.
    pub fn describe(&self) -> String {
        let file = |path: &Option<PathBuf>, name: &str| match path {
            Some(path) => path.display().to_string(),
            None => format!("no {name}"),
        };
        match (&self.dir, self.layout) {
            (Some(dir), Some(layout)) => format!(
                "{} under {} ({layout}): {}, {}",
                dir,
                self.root.display(),
                file(&self.libcuda, LIBCUDA),
                file(&self.nvml, super::LIBRARY)
            ),
            _ => format!("none of {LIBCUDA} and {} at the known install directories under {}", super::LIBRARY, self.root.display()),
        }
    }

    /// The NVML files worth trying under this root, in order: the one found, then the name in
    /// the GPU operator's driver root (mounted by its driver container after boot, when the
    /// agent may have started: found at NVML's next retry; the operator's own links are
    /// relative).
    pub fn nvml_candidates(&self) -> Vec<PathBuf> {
        let mut candidates: Vec<PathBuf> = self.nvml.iter().cloned().collect();
        let operator = KNOWN_DIRS.iter().filter(|(dir, _)| dir.starts_with(OPERATOR_ROOT));
        candidates.extend(operator.map(|(dir, _)| self.root.join(dir).join(super::LIBRARY)));
        candidates
    }
}

/// The host's dynamic linker cache, relative to the root: where a driver in none of the known
/// directories is looked for last ([`super::ld_cache`]).
pub const LD_CACHE: &str = "etc/ld.so.cache";

/// Whose layout a library found through [`LD_CACHE`] is.
pub const FROM_LD_CACHE: &str = "the host's ld.so.cache";

/// Looks for the driver's libraries under `root`: the known directories, then the paths the
/// host's `ld.so.cache` gives their names.
pub fn find(root: &Path) -> Found {
    let mut found = Found { root: root.to_path_buf(), dir: None, layout: None, libcuda: None, nvml: None };
    let Ok(dir) = std::fs::File::open(root) else {
        return found;
    };
    let cache = read(&dir, LD_CACHE).unwrap_or_default();
    // (name relative to the root, whose layout) to try for a library, in order.
    let places = |library: &str, cache: &[u8]| -> Vec<(String, &'static str)> {
        let known = KNOWN_DIRS.iter().map(|(known, layout)| (format!("{known}/{library}"), *layout));
        let cached = super::ld_cache::paths_of(cache, library).into_iter().map(|path| (path.trim_start_matches('/').to_string(), FROM_LD_CACHE));
        known.chain(cached).collect()
    };
    let first = |library: &str| places(library, &cache).into_iter().find_map(|(name, layout)| Some((resolve(&dir, &name)?, name, layout)));
    if let Some((libcuda, name, layout)) = first(LIBCUDA) {
        let at = Path::new(&name).parent().map(|p| p.display().to_string()).unwrap_or_default();
        found.nvml = resolve(&dir, &format!("{at}/{}", super::LIBRARY));
        found.dir = Some(at);
        found.layout = Some(layout);
        found.libcuda = Some(libcuda);
    }
    if found.nvml.is_none() {
        if let Some((nvml, name, layout)) = first(super::LIBRARY) {
            found.dir = found.dir.or_else(|| Path::new(&name).parent().map(|p| p.display().to_string()));
            found.layout = found.layout.or(Some(layout));
            found.nvml = Some(nvml);
        }
    }
    found
}

/// The bytes of `name` (relative) inside the root `dir`, read as [`resolve`] opens it.
fn read(dir: &std::fs::File, name: &str) -> Option<Vec<u8>> {
    // O_NONBLOCK: a FIFO (or a /proc file) of that name neither blocks the open nor the read.
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)
        .mode(Mode::empty())
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd = openat2(dir.as_raw_fd(), name, how).ok()?;
    // SAFETY: `openat2` returned a new descriptor that nothing else owns.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(&mut file, MAX_LD_CACHE), &mut bytes).ok()?;
    Some(bytes)
}

/// The most of the host's `ld.so.cache` read (a few hundred KiB on a full system).
const MAX_LD_CACHE: u64 = 16 << 20;

/// `name` (relative) opened inside the root `dir` as a regular file, and named as the agent
/// sees it: `None` where it is missing, not a regular file, or cannot be opened.
fn resolve(dir: &std::fs::File, name: &str) -> Option<PathBuf> {
    let how = OpenHow::new().flags(OFlag::O_PATH | OFlag::O_CLOEXEC).mode(Mode::empty()).resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd = openat2(dir.as_raw_fd(), name, how).ok()?;
    // SAFETY: `openat2` returned a new descriptor that nothing else owns.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A fresh directory standing for a host's root (canonical: the agent names files by
    /// their real paths).
    struct Root(PathBuf);

    impl Root {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Root {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn root(tag: &str) -> Root {
        let dir = std::env::temp_dir().join(format!("vramguard-install-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        Root(dir.canonicalize().expect("canonical"))
    }

    fn file(root: &Path, path: &str) -> PathBuf {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::write(&path, b"\x7fELF").expect("write");
        path
    }

    #[test]
    fn the_first_known_directory_with_libcuda_wins_and_nvml_is_taken_beside_it() {
        let root = root("first");
        let libcuda = file(root.path(), "usr/lib64/libcuda.so.580.65.06");
        symlink("libcuda.so.580.65.06", root.path().join("usr/lib64/libcuda.so.1")).expect("symlink");
        let nvml = file(root.path(), "usr/lib64/libnvidia-ml.so.1");
        file(root.path(), "usr/lib/libnvidia-ml.so.1");
        let found = find(root.path());
        assert_eq!(found.dir.as_deref(), Some("usr/lib64"));
        assert_eq!(found.layout, Some("RHEL, Fedora, SUSE and Amazon Linux"));
        assert_eq!(found.libcuda.as_deref(), Some(libcuda.as_path()), "the symlink's target, as the agent names it");
        assert_eq!(found.nvml.as_deref(), Some(nvml.as_path()));
        assert!(found.describe().contains("usr/lib64 under") && found.describe().contains("libcuda.so.580.65.06"), "{}", found.describe());
    }

    #[test]
    fn the_gpu_operator_s_driver_root_comes_first() {
        let root = root("operator");
        file(root.path(), "usr/lib/x86_64-linux-gnu/libcuda.so.1");
        let operator = file(root.path(), "run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1");
        let found = find(root.path());
        assert_eq!(found.libcuda.as_deref(), Some(operator.as_path()));
        assert_eq!(found.layout, Some("the NVIDIA GPU operator's driver root"));
        assert_eq!(found.nvml, None, "no NVML anywhere");
        assert!(found.describe().contains("no libnvidia-ml.so.1"), "{}", found.describe());
    }

    #[test]
    fn an_absolute_symlink_is_resolved_inside_the_root_never_the_agent_s() {
        let root = root("absolute");
        // The host's alternatives link, absolute: inside the root it names the root's file.
        let target = file(root.path(), "etc/alternatives/libcuda.so.1");
        std::fs::create_dir_all(root.path().join("usr/lib/x86_64-linux-gnu")).expect("mkdir");
        symlink("/etc/alternatives/libcuda.so.1", root.path().join("usr/lib/x86_64-linux-gnu/libcuda.so.1")).expect("symlink");
        // A link that climbs out of the root stays in it too (`..` of the root is the root).
        symlink("../../../../../../etc/hostname", root.path().join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")).expect("symlink");
        let found = find(root.path());
        assert_eq!(found.libcuda.as_deref(), Some(target.as_path()));
        assert_eq!(found.nvml, None, "the root has no etc/hostname: the agent's own is not taken");
    }

    #[test]
    fn nothing_found_is_said_and_nvml_is_still_looked_for_in_every_known_directory_later() {
        let root = root("nothing");
        std::fs::create_dir_all(root.path().join("usr/lib64/libcuda.so.1")).expect("a directory of that name");
        let found = find(root.path());
        assert_eq!((found.dir.as_deref(), found.libcuda.as_ref(), found.nvml.as_ref()), (None, None, None));
        assert!(found.describe().starts_with("none of libcuda.so.1 and libnvidia-ml.so.1"), "{}", found.describe());
        let candidates = found.nvml_candidates();
        assert_eq!(candidates.len(), 3, "the GPU operator's root only: {candidates:?}");
        assert_eq!(candidates[0], root.path().join("run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"));
        assert_eq!(find(&root.path().join("missing")).libcuda, None);
    }

    #[test]
    fn nvml_alone_is_found_where_libcuda_is_not() {
        let root = root("nvml");
        let nvml = file(root.path(), "usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1");
        let found = find(root.path());
        assert_eq!((found.libcuda.as_ref(), found.nvml.as_deref(), found.dir.as_deref()), (None, Some(nvml.as_path()), Some("usr/lib/aarch64-linux-gnu")));
        assert_eq!(found.nvml_candidates()[0], nvml);
    }

    #[test]
    fn a_driver_in_no_known_directory_is_found_through_the_host_s_ld_so_cache() {
        let root = root("ldcache");
        // Bottlerocket's layout: a directory per driver version, which the cache names.
        let libcuda = file(root.path(), "usr/lib64/nvidia/tesla/580.65.06/libcuda.so.1");
        let nvml = file(root.path(), "usr/lib64/nvidia/tesla/580.65.06/libnvidia-ml.so.1");
        let cache = crate::driver::ld_cache::tests::cache(&[
            ("libc.so.6", "/usr/lib64/libc.so.6"),
            ("libcuda.so.1", "/usr/lib64/nvidia/tesla/535.54.03/libcuda.so.1"),
            ("libcuda.so.1", "/usr/lib64/nvidia/tesla/580.65.06/libcuda.so.1"),
        ]);
        std::fs::create_dir_all(root.path().join("etc")).expect("etc");
        std::fs::write(root.path().join(LD_CACHE), cache).expect("the cache");
        let found = find(root.path());
        assert_eq!(found.libcuda.as_deref(), Some(libcuda.as_path()), "the first path of the cache's that is there");
        assert_eq!(found.nvml.as_deref(), Some(nvml.as_path()), "beside it");
        assert_eq!((found.dir.as_deref(), found.layout), (Some("usr/lib64/nvidia/tesla/580.65.06"), Some(FROM_LD_CACHE)));
        // A known directory wins over the cache.
        let debian = file(root.path(), "usr/lib/x86_64-linux-gnu/libcuda.so.1");
        assert_eq!(find(root.path()).libcuda.as_deref(), Some(debian.as_path()));
    }

    #[test]
    fn a_fifo_in_the_cache_s_place_neither_blocks_nor_is_read() {
        let root = root("fifo");
        std::fs::create_dir_all(root.path().join("etc")).expect("etc");
        let fifo = std::ffi::CString::new(root.path().join(LD_CACHE).into_os_string().into_encoded_bytes()).expect("a path");
        // SAFETY: mkfifo(3) on a NUL-terminated path this test owns.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo");
        let found = find(root.path());
        assert_eq!(found.libcuda, None, "nothing, at once");
    }
}
