//! What the agent knows of a libcuda file, below the two rooms that deal with one: discovery
//! ([`crate::discovery`], which finds and identifies the files) and the kernel task
//! ([`crate::kernel::probes`], which attaches the programs): the symbols probed on it and by
//! which program ([`PROBES`]), an opened file's identity ([`Opened`]), the [`Prober`] that
//! attaches to one, the request discovery sends the kernel task ([`AttachRequest`]) and what
//! attaching achieved ([`AttachReport`]).
use std::{collections::BTreeMap, fs::File};

use anyhow::Result;
use serde::{Deserialize, Serialize};

/// One probed API: its exported symbol, the entry program, and whether the shared return
/// probe (`alloc_return`) goes on it too.
pub struct ProbeSpec {
    pub symbol: &'static str,
    pub entry: &'static str,
    pub returns: bool,
}

const fn alloc(symbol: &'static str, entry: &'static str) -> ProbeSpec {
    ProbeSpec { symbol, entry, returns: true }
}

const fn free(symbol: &'static str, entry: &'static str) -> ProbeSpec {
    ProbeSpec { symbol, entry, returns: false }
}

/// Every driver API vramguard accounts (docs/design.md, "The eBPF probes"), and the VMM calls
/// that decide how long a `cuMemCreate` handle's memory lives (mapping, unmapping, retaining).
pub const PROBES: [ProbeSpec; 15] = [
    alloc("cuMemAlloc_v2", "mem_alloc"),
    alloc("cuMemAllocPitch_v2", "mem_alloc_pitch"),
    alloc("cuMemAllocManaged", "mem_alloc_managed"),
    alloc("cuMemAllocAsync", "mem_alloc_async"),
    alloc("cuMemAllocAsync_ptsz", "mem_alloc_async"),
    alloc("cuMemAllocFromPoolAsync", "mem_alloc_async"),
    alloc("cuMemAllocFromPoolAsync_ptsz", "mem_alloc_async"),
    alloc("cuMemCreate", "mem_create"),
    free("cuMemFree_v2", "mem_free"),
    free("cuMemFreeAsync", "mem_free"),
    free("cuMemFreeAsync_ptsz", "mem_free"),
    free("cuMemRelease", "mem_release"),
    alloc("cuMemMap", "mem_map"),
    free("cuMemUnmap", "mem_unmap"),
    alloc("cuMemRetainAllocationHandle", "mem_retain"),
];

/// External-memory imports and destroys (never charged, shown: [`crate::kernel::extmem`]), each with
/// its own return program, if any.
pub const EXTMEM_PROBES: [(&str, &str, Option<&str>); 2] = [
    ("cuImportExternalMemory", common::extmem::names::IMPORT, Some(common::extmem::names::IMPORT_RETURN)),
    ("cuDestroyExternalMemory", common::extmem::names::DESTROY, None),
];

/// The return probe shared by every allocation API.
pub const RETURN_PROGRAM: &str = common::names::ALLOC_RETURN;

/// What attaching to one file achieved.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AttachReport {
    /// The path the file was reached by (for a discovered file, as its process's maps name
    /// it: informational, the workload chooses it).
    pub path: String,
    /// The file's identity, which the probes are on.
    #[serde(default)]
    pub dev: u64,
    #[serde(default)]
    pub ino: u64,
    /// `--libcuda`, `well-known path` or `mapped by pid N`.
    #[serde(default)]
    pub origin: String,
    /// For a discovered file, the cgroup (id) of the process it was found in: the container
    /// its probe counts against.
    #[serde(default)]
    pub cgroup: Option<u64>,
    /// Symbols with probes attached.
    pub attached: Vec<String>,
    /// Symbols the library does not export.
    pub missing: Vec<String>,
    /// Symbols skipped because they alias an attached one (same address).
    pub aliases: Vec<String>,
    /// How the probes are linked in the kernel: `uprobe_multi` (a link per program, removed
    /// in one grace period) or `perf_event` (a link per probe, each removed in its own: a
    /// kernel without uprobe_multi links, or `--uprobe-links perf`).
    #[serde(default)]
    pub links: String,
}

/// The identity of a file: device and inode.
pub type FileId = (u64, u64);

/// When a file last changed: its modification time, its status-change time and its size.
/// `ctime` is in the stamp because a file's owner can set `mtime` back after rewriting the
/// file (`utimensat`); nobody can set `ctime`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    pub mtime: (i64, i64),
    pub ctime: (i64, i64),
    pub size: u64,
}

impl Stamp {
    pub fn of(metadata: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            mtime: (metadata.mtime(), metadata.mtime_nsec()),
            ctime: (metadata.ctime(), metadata.ctime_nsec()),
            size: metadata.size(),
        }
    }
}

/// An open file and what `fstat` said of it when it was opened.
pub struct Opened {
    pub file: File,
    pub id: FileId,
    pub stamp: Stamp,
    /// The path it was reached by, for people (for a discovered file, the workload's own
    /// words from its maps).
    pub shown: String,
}

/// Attaches the probes to an identified libcuda (the eBPF side, `kernel::probes::Attacher`, or asked of the kernel task).
pub trait Prober {
    /// Attaches every probe whose symbol `offsets` has, through the open file, and checks
    /// that the kernel attached to the file `file.id` names.
    fn attach(&mut self, file: &Opened, offsets: &BTreeMap<&'static str, u64>) -> Result<AttachReport>;
}

/// Discovery's request to the kernel task (which owns the programs) to probe a file.
pub struct AttachRequest {
    /// A descriptor of discovery's own for the identified file.
    pub file: Opened,
    pub offsets: BTreeMap<&'static str, u64>,
    pub reply: std::sync::mpsc::SyncSender<Result<AttachReport>>,
}

