//! Which processes hold a GPU's device files open, from `/proc/<pid>/fd` (its threads' where
//! its main thread exited alone, [`held_by`]): the proof that a
//! driver row's pid is the process that holds the memory ([`super::task`]), and the way to
//! find who holds memory no row explains.
//!
//! A GPU's file is named by `--gpu-device-file` (default `/dev/nvidia{minor}`, `{minor}` being
//! NVML's minor number of the device, or its index where NVML has none). It is matched by
//! what the kernel says of the open file, never by the name a process sees: a character
//! device by its device number (a container's own `/dev/nvidia0` node is another inode with
//! the same number, and a workload may rename it), any other file by (device, inode). Each
//! descriptor costs a `readlink` (sockets, pipes and anonymous inodes are skipped on its
//! answer) and a `stat` of the others; a process is read at most [`MAX_FDS`] descriptors deep
//! (a tenant chooses how many it opens: past the cap it is reported as not holding, and the
//! cap counted).
use std::{
    os::unix::fs::{FileTypeExt, MetadataExt},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// Descriptors read per process at most.
pub const MAX_FDS: usize = 4096;

/// What identifies an open GPU device file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FileKey {
    /// A character device, by its device number (`st_rdev`).
    Char(u64),
    /// Any other file, by (`st_dev`, `st_ino`).
    File(u64, u64),
}

impl FileKey {
    fn of(meta: &std::fs::Metadata) -> FileKey {
        if meta.file_type().is_char_device() {
            FileKey::Char(meta.rdev())
        } else {
            FileKey::File(meta.dev(), meta.ino())
        }
    }
}

/// The path of GPU `minor`'s device file under `pattern` (`{minor}` replaced).
pub fn device_path(pattern: &str, minor: u32) -> PathBuf {
    PathBuf::from(pattern.replace("{minor}", &minor.to_string()))
}

/// The key of the file at `path`, if it exists.
pub fn key_of(path: &Path) -> Option<FileKey> {
    std::fs::metadata(path).ok().map(|meta| FileKey::of(&meta))
}

/// What one process's descriptors show.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// The keys of `wanted` it holds open (each once).
    pub keys: Vec<FileKey>,
    /// More descriptors than [`MAX_FDS`]: the rest were not read.
    pub capped: bool,
}

/// Which of `wanted` process `pid` holds open; `None` when its descriptors cannot be read
/// (it exited, or `/proc` refuses).
///
/// A process whose main thread exited alone shows no descriptor under its pid (the kernel let
/// go of the leader's table). Its threads' are read then (`/proc/<pid>/task/<tid>/fd`):
/// mostly the one table they share, but a thread may have one of its own (a clone without
/// `CLONE_FILES`, `unshare`), so each thread's, [`MAX_THREADS`] at most, and [`MAX_FDS`]
/// descriptors of them all together; past either, `capped`, as for any process.
pub fn held_by(pid: u32, wanted: &[FileKey]) -> Option<Held> {
    let mut held = Held::default();
    let mut read = 0;
    held_in(&format!("/proc/{pid}/fd"), wanted, &mut held, &mut read)?;
    if read > 0 || !ledger::process::has_other_threads(pid) {
        return Some(held);
    }
    let threads = ledger::process::other_threads(pid, MAX_THREADS + 1);
    for tid in threads.iter().take(MAX_THREADS) {
        // A thread gone meanwhile has nothing to show.
        let _ = held_in(&format!("/proc/{pid}/task/{tid}/fd"), wanted, &mut held, &mut read);
        if held.capped {
            break;
        }
    }
    held.capped |= threads.len() > MAX_THREADS;
    Some(held)
}

/// Threads of a process whose main thread exited alone whose descriptors are read at most.
pub const MAX_THREADS: usize = 256;

/// Adds what the descriptors listed in `dir` hold of `wanted` to `held`, counting them in
/// `read` ([`MAX_FDS`] at most, then `capped`).
fn held_in(dir: &str, wanted: &[FileKey], held: &mut Held, read: &mut usize) -> Option<()> {
    let entries = std::fs::read_dir(dir).ok()?;
    for entry in entries {
        if *read >= MAX_FDS {
            held.capped = true;
            break;
        }
        *read += 1;
        let Ok(entry) = entry else { continue };
        let path = entry.path();
        // Sockets, pipes and anonymous inodes (the most common descriptors) are never a GPU's
        // file: their link names say so without a stat.
        if let Ok(target) = std::fs::read_link(&path) {
            let target = target.as_os_str().as_encoded_bytes();
            if target.starts_with(b"socket:") || target.starts_with(b"pipe:") || target.starts_with(b"anon_inode:") {
                continue;
            }
        }
        let Ok(meta) = std::fs::metadata(&path) else { continue };
        let key = FileKey::of(&meta);
        if wanted.contains(&key) && !held.keys.contains(&key) {
            held.keys.push(key);
        }
    }
    Some(())
}

/// Whether process `pid` holds any of `wanted` open.
pub fn holds_any(pid: u32, wanted: &[FileKey]) -> bool {
    held_by(pid, wanted).is_some_and(|held| !held.keys.is_empty())
}

/// One scan of every process's descriptors for `wanted`, within `budget`.
#[derive(Clone, Debug, Default)]
pub struct Scan {
    /// (pid, the keys it holds), for each process holding one, by pid.
    pub holders: Vec<(u32, Vec<FileKey>)>,
    /// Processes read.
    pub processes: usize,
    /// Processes past [`MAX_FDS`] descriptors (read in part).
    pub capped: usize,
    /// The budget ran out before every process was read.
    pub incomplete: bool,
}

/// Reads every process's descriptors (but `skip`'s, the agent itself) for `wanted`, stopping
/// once `budget` is spent.
pub fn scan(wanted: &[FileKey], skip: u32, budget: Duration) -> Scan {
    let started = Instant::now();
    let mut scan = Scan::default();
    let Ok(proc) = std::fs::read_dir("/proc") else {
        scan.incomplete = true;
        return scan;
    };
    for entry in proc.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        if pid == skip {
            continue;
        }
        if started.elapsed() > budget {
            scan.incomplete = true;
            break;
        }
        let Some(held) = held_by(pid, wanted) else { continue };
        scan.processes += 1;
        scan.capped += usize::from(held.capped);
        if !held.keys.is_empty() {
            scan.holders.push((pid, held.keys));
        }
    }
    scan.holders.sort_by_key(|(pid, _)| *pid);
    scan
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_holding_a_file_is_found_by_the_files_identity() {
        let path = std::env::temp_dir().join(format!("vramguard-holders-{}", std::process::id()));
        std::fs::write(&path, b"gpu").expect("write");
        let key = key_of(&path).expect("key");
        assert!(matches!(key, FileKey::File(..)));
        let me = std::process::id();
        assert!(!holds_any(me, &[key]), "not open yet");
        let file = std::fs::File::open(&path).expect("open");
        // Another name for the same file (a renamed device node) is the same key.
        let renamed = path.with_extension("renamed");
        std::fs::rename(&path, &renamed).expect("rename");
        assert_eq!(held_by(me, &[key]).map(|h| h.keys), Some(vec![key]));
        let found = scan(&[key], 0, Duration::from_secs(5));
        assert!(found.holders.iter().any(|(pid, keys)| *pid == me && keys == &[key]), "{found:?}");
        assert!(!found.incomplete && found.processes >= 1);
        assert!(scan(&[key], me, Duration::from_secs(5)).holders.iter().all(|(pid, _)| *pid != me), "skipped");
        drop(file);
        assert!(!holds_any(me, &[key]));
        assert_eq!(key_of(Path::new("/dev/null")).map(|k| matches!(k, FileKey::Char(_))), Some(true));
        assert_eq!(device_path("/dev/nvidia{minor}", 3), PathBuf::from("/dev/nvidia3"));
        let _ = std::fs::remove_file(&renamed);
    }
}
