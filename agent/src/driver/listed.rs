//! The table the driver view's join keeps: for each pid NVML lists, who had that pid when a
//! read first listed it ([`First`]), kept while consecutive reads list the pid. NVML gives no
//! start time, and keeps listing the pid of the process that made the memory's client after
//! that process exited (while a child it forked holds the memory), so this table is what
//! tells the process the row is of from a later one given the pid.
//!
//! It survives an agent restart: it is saved in the state directory
//! (`<--state-dir>/driver-listed.json`) after each read that changed it, written whole under a
//! temporary name, synced and renamed into place; it is loaded at the first read that
//! answers, and used only if it is valid for this node as it is now: its layout version, the
//! boot (`/proc/sys/kernel/random/boot_id`: start times count from boot), the GPUs (NVML's
//! UUIDs), at most [`MAX_ENTRIES`] entries in a file of at most [`MAX_FILE_BYTES`], no pid 0
//! and no pid twice. A table that is not is ignored, with the reason (logged once).
use std::{
    collections::BTreeMap,
    io::Write,
    path::{Path, PathBuf},
};

use std::os::unix::fs::DirBuilderExt;

use serde::{Deserialize, Serialize};

/// The file's name in the state directory.
pub const FILE: &str = "driver-listed.json";
/// Most pids the table keeps (NVML lists a few hundred processes per GPU at most).
pub const MAX_ENTRIES: usize = 65_536;
/// Largest file loaded.
pub const MAX_FILE_BYTES: u64 = 8 << 20;
const VERSION: u32 = 1;

/// Who had a pid when a read first listed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind", content = "start_time")]
pub enum First {
    /// A process with this start time that held the GPU's device files: the row is its.
    Process(u64),
    /// A process with this start time that held none of the GPU's device files: the row is
    /// not its (the pid was reused before the first listing).
    Unproven(u64),
    /// No process had the pid: the row's process had exited.
    Nobody,
}

/// The table (see the module doc).
#[derive(Clone, Debug, Default)]
pub struct Listed {
    entries: BTreeMap<u32, First>,
    changed: bool,
}

#[derive(Serialize, Deserialize)]
struct OnDisk {
    version: u32,
    boot_id: String,
    gpus: Vec<String>,
    entries: Vec<(u32, First)>,
}

impl Listed {
    pub fn new() -> Listed {
        Listed::default()
    }

    /// The entry of `pid`, if listed.
    pub fn get(&self, pid: u32) -> Option<First> {
        self.entries.get(&pid).copied()
    }

    /// Records `first` for `pid` (a first listing, or an unproven one proven since).
    pub fn set(&mut self, pid: u32, first: First) {
        if self.entries.len() < MAX_ENTRIES || self.entries.contains_key(&pid) {
            self.changed |= self.entries.insert(pid, first) != Some(first);
        }
    }

    /// Forgets the pids `keep` refuses (those the read no longer lists).
    pub fn retain(&mut self, mut keep: impl FnMut(u32) -> bool) {
        let before = self.entries.len();
        self.entries.retain(|pid, _| keep(*pid));
        self.changed |= self.entries.len() != before;
    }

    /// Forgets every pid.
    pub fn clear(&mut self) {
        self.changed |= !self.entries.is_empty();
        self.entries.clear();
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether it changed since the last [`Listed::save`] (or load).
    pub fn changed(&self) -> bool {
        self.changed
    }

    /// Loads the table at `path` for this boot and these GPUs: `Ok(None)` when there is no
    /// file, `Err(reason)` when it is not valid for this node (it is then not used).
    pub fn load(path: &Path, gpus: &[String]) -> Result<Option<Listed>, String> {
        let file = match std::fs::File::open(path) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(format!("cannot open {}: {error}", path.display())),
        };
        let size = file.metadata().map_err(|error| format!("cannot stat {}: {error}", path.display()))?.len();
        if size > MAX_FILE_BYTES {
            return Err(format!("{} holds {size} bytes, more than {MAX_FILE_BYTES}", path.display()));
        }
        let on_disk: OnDisk = serde_json::from_reader(std::io::BufReader::new(file)).map_err(|error| format!("{}: {error}", path.display()))?;
        if on_disk.version != VERSION {
            return Err(format!("{}: layout version {}, expected {VERSION}", path.display(), on_disk.version));
        }
        let boot = boot_id()?;
        if on_disk.boot_id != boot {
            return Err(format!("{}: written in another boot ({}; this one is {boot}): its start times are not this boot's", path.display(), on_disk.boot_id));
        }
        if on_disk.gpus != gpus {
            return Err(format!("{}: written for the GPUs {:?}, not this node's {gpus:?}", path.display(), on_disk.gpus));
        }
        if on_disk.entries.len() > MAX_ENTRIES {
            return Err(format!("{}: {} entries, more than {MAX_ENTRIES}", path.display(), on_disk.entries.len()));
        }
        let mut entries = BTreeMap::new();
        for (pid, first) in on_disk.entries {
            if pid == 0 || entries.insert(pid, first).is_some() {
                return Err(format!("{}: pid {pid} is not a process's, or is there twice", path.display()));
            }
        }
        Ok(Some(Listed { entries, changed: false }))
    }

    /// Writes the table to `path` for these GPUs, atomically (a temporary file beside it,
    /// synced, renamed into place).
    pub fn save(&mut self, path: &Path, gpus: &[String]) -> Result<(), String> {
        let on_disk = OnDisk { version: VERSION, boot_id: boot_id()?, gpus: gpus.to_vec(), entries: self.entries.iter().map(|(pid, first)| (*pid, *first)).collect() };
        let bytes = serde_json::to_vec(&on_disk).map_err(|error| error.to_string())?;
        let tmp: PathBuf = path.with_extension(format!("tmp.{}", std::process::id()));
        let written = (|| -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
            }
            let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if let Err(error) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(format!("cannot write {}: {error}", path.display()));
        }
        self.changed = false;
        Ok(())
    }
}

/// This boot's id.
fn boot_id() -> Result<String, String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_string())
        .map_err(|error| format!("cannot read /proc/sys/kernel/random/boot_id: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_survives_a_save_and_a_load_only_on_this_node() {
        let dir = std::env::temp_dir().join(format!("vramguard-listed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(FILE);
        let gpus = vec!["GPU-a".to_string()];
        assert_eq!(Listed::load(&path, &gpus).map(|l| l.is_none()), Ok(true), "no file yet");
        let mut listed = Listed::new();
        listed.set(7, First::Process(700));
        listed.set(8, First::Nobody);
        listed.set(9, First::Unproven(900));
        assert!(listed.changed());
        listed.save(&path, &gpus).expect("save");
        assert!(!listed.changed());
        let loaded = Listed::load(&path, &gpus).expect("valid").expect("a table");
        assert_eq!((loaded.get(7), loaded.get(8), loaded.get(9), loaded.get(10)), (Some(First::Process(700)), Some(First::Nobody), Some(First::Unproven(900)), None));
        // Another node's GPUs, another boot, a damaged file, a duplicate pid, pid 0: refused.
        assert!(Listed::load(&path, &["GPU-b".to_string()]).expect_err("other GPUs").contains("GPU-b"));
        let text = std::fs::read_to_string(&path).expect("read");
        let other_boot = text.replace(&boot_id().expect("boot id"), "00000000-0000-0000-0000-000000000000");
        std::fs::write(&path, other_boot).expect("write");
        assert!(Listed::load(&path, &gpus).expect_err("other boot").contains("another boot"));
        std::fs::write(&path, &text[..text.len() / 2]).expect("write");
        assert!(Listed::load(&path, &gpus).is_err());
        let twice = text.replace("[8,", "[7,");
        std::fs::write(&path, twice).expect("write");
        assert!(Listed::load(&path, &gpus).expect_err("twice").contains("twice"));
        std::fs::write(&path, text.replace("[8,", "[0,")).expect("write");
        assert!(Listed::load(&path, &gpus).is_err());
        // Bounded: past MAX_ENTRIES new pids are not kept.
        let mut full = Listed::new();
        for pid in 1..=(MAX_ENTRIES as u32 + 5) {
            full.set(pid, First::Nobody);
        }
        assert_eq!(full.len(), MAX_ENTRIES);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
