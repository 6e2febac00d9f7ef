//! Finding the libcuda files to probe.
//!
//! Uprobes attach to an inode, so a libcuda is identified by its file, not its path: the
//! host's library bind-mounted into ten containers is one file and gets one set of probes.
//! Files come from `--libcuda` and, unless disabled, from every process's `/proc/<pid>/maps`
//! (reached through `/proc/<pid>/root` so that other mount namespaces resolve).
use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

/// The identity of a file: device and inode.
pub type FileId = (u64, u64);

/// A libcuda file and a path through which the agent can open it.
#[derive(Clone, Debug)]
pub struct LibcudaFile {
    pub id: FileId,
    pub path: PathBuf,
}

/// Where a host installs libcuda, searched when neither `--libcuda` nor any process names one.
const WELL_KNOWN: [&str; 4] = [
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
];

/// The file behind `path`, which must exist.
pub fn from_path(path: &Path) -> Result<LibcudaFile> {
    let metadata = fs::metadata(path)
        .with_context(|| format!("--libcuda {}: cannot open the file", path.display()))?;
    if !metadata.is_file() {
        bail!("--libcuda {}: not a regular file", path.display());
    }
    Ok(LibcudaFile { id: (metadata.dev(), metadata.ino()), path: path.to_path_buf() })
}

/// Every distinct libcuda file that exists at a well-known host location.
pub fn well_known() -> Vec<LibcudaFile> {
    WELL_KNOWN.iter().filter_map(|path| from_path(Path::new(path)).ok()).collect()
}

/// Paths the agent looked at for a libcuda, for error messages.
pub fn well_known_paths() -> String {
    WELL_KNOWN.join(", ")
}

/// How many [`Discovery::scan`]s make one that reads every process's maps again.
pub const FULL_SCAN_EVERY: u64 = 10;

/// How long after it first appears a process's maps are read at every scan: programs load
/// libcuda with `dlopen` at their first CUDA call (the CUDA runtime, PyTorch), some time
/// after they start.
pub const YOUNG: std::time::Duration = std::time::Duration::from_secs(60);

/// Discovery that keeps up with new processes cheaply: each scan reads the maps of the
/// processes that appeared in the last [`YOUNG`] seconds and have not been seen mapping a
/// libcuda yet, and every [`FULL_SCAN_EVERY`]th scan those of every process (for a process that loads a libcuda file not probed yet even
/// later). A file already probed needs no finding: its probes cover every process that maps
/// it, whenever it does.
#[derive(Default)]
pub struct Discovery {
    /// Pid -> when a scan first saw it, and whether it was seen mapping a libcuda (a young
    /// process that has one is not read again until the next full scan).
    seen: std::collections::HashMap<u32, (std::time::Instant, bool)>,
    scans: u64,
}

impl Discovery {
    /// The libcuda files mapped by the processes this scan reads.
    pub fn scan(&mut self) -> Vec<LibcudaFile> {
        let now = std::time::Instant::now();
        let full = self.scans.is_multiple_of(FULL_SCAN_EVERY);
        self.scans += 1;
        let mut seen = std::collections::HashMap::new();
        let mut found: BTreeMap<FileId, LibcudaFile> = BTreeMap::new();
        for pid in running_pids() {
            let (first, mapped) = self.seen.get(&pid).copied().unwrap_or((now, false));
            let young = now.saturating_duration_since(first) < YOUNG;
            let mut has = mapped;
            if full || (young && !mapped) {
                for file in mapped_by(pid) {
                    has = true;
                    found.entry(file.id).or_insert(file);
                }
            }
            seen.insert(pid, (first, has));
        }
        self.seen = seen;
        found.into_values().collect()
    }

    /// Makes every process known to the last scan older than [`YOUNG`].
    #[cfg(test)]
    fn age(&mut self) {
        for (first, _) in self.seen.values_mut() {
            *first = first.checked_sub(YOUNG).unwrap_or(*first);
        }
    }
}

/// The pids in /proc now.
fn running_pids() -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries.flatten().filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse().ok())).collect()
}

/// The libcuda files process `pid` maps.
fn mapped_by(pid: u32) -> Vec<LibcudaFile> {
    // Processes come and go while we scan: an unreadable maps file is skipped.
    let Ok(maps) = fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return Vec::new();
    };
    libcuda_paths(&maps)
        .into_iter()
        .filter_map(|path| {
            let through_root = PathBuf::from(format!("/proc/{pid}/root")).join(path.trim_start_matches('/'));
            let metadata = fs::metadata(&through_root).ok()?;
            Some(LibcudaFile { id: (metadata.dev(), metadata.ino()), path: through_root })
        })
        .collect()
}

/// The distinct paths of libcuda files in the text of a `/proc/<pid>/maps`.
fn libcuda_paths(maps: &str) -> Vec<&str> {
    let mut paths: Vec<&str> = maps
        .lines()
        .filter_map(|line| {
            // address perms offset dev inode [path]; the path may contain spaces.
            let path = line.splitn(6, char::is_whitespace).nth(5)?.trim_start();
            let name = path.rsplit('/').next()?;
            // A replaced library shows as "<path> (deleted)": its file has no path to attach to.
            let live = !path.ends_with(" (deleted)");
            (path.starts_with('/') && live && is_libcuda_name(name)).then_some(path)
        })
        .collect();
    paths.sort_unstable();
    paths.dedup();
    paths
}

/// `libcuda.so`, `libcuda.so.1`, `libcuda.so.580.159`, ...
fn is_libcuda_name(name: &str) -> bool {
    name == "libcuda.so" || name.starts_with("libcuda.so.")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_reads_new_processes_and_every_process_on_full_scans() {
        let dir = std::env::temp_dir().join(format!("vramguard-discovery-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("libcuda.so.1");
        fs::write(&path, [0u8; 4096]).expect("write");
        let ours = |found: Vec<LibcudaFile>| found.iter().any(|f| f.path.ends_with(path.strip_prefix("/").unwrap_or(&path)));

        let mut discovery = Discovery::default();
        assert!(!ours(discovery.scan()), "a full scan before this process maps the file");
        // This process maps a libcuda after it started (as dlopen would).
        let file = fs::File::open(&path).expect("open");
        // SAFETY: a private read-only mapping of a file this test owns and does not change.
        let map = unsafe { memmap2::Mmap::map(&file) }.expect("map");
        assert!(ours(discovery.scan()), "a young process's maps are read at every scan");
        // An old process loads it: only the full scan reads its maps.
        drop(map);
        assert!(!ours(discovery.scan()));
        discovery.age();
        // SAFETY: as above.
        let map = unsafe { memmap2::Mmap::map(&file) }.expect("map");
        for scan in 3..FULL_SCAN_EVERY {
            assert!(!ours(discovery.scan()), "scan {scan} reads only young processes");
        }
        assert!(ours(discovery.scan()), "the full scan finds it");
        drop(map);
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn finds_libcuda_in_maps() {
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 fd:01 123 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159
7f0000001000-7f0000002000 r-xp 00001000 fd:01 123 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159
7f0000003000-7f0000004000 r-xp 00000000 fd:01 124 /opt/my dir/libcuda.so.1
7f0000005000-7f0000006000 r-xp 00000000 fd:01 125 /usr/lib/libcudart.so.12
7f0000007000-7f0000008000 rw-p 00000000 00:00 0 
7f0000009000-7f000000a000 r-xp 00000000 fd:01 126 /usr/lib/libcuda.so.1 (deleted)
";
        assert_eq!(
            libcuda_paths(maps),
            vec!["/opt/my dir/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159"]
        );
    }

    #[test]
    fn names() {
        assert!(is_libcuda_name("libcuda.so"));
        assert!(is_libcuda_name("libcuda.so.1"));
        assert!(!is_libcuda_name("libcudart.so.12"));
    }
}
