//! Which eBPF program goes on which libcuda symbol, and attaching them to a file.
//!
//! Symbol offsets are resolved once per file from its dynamic symbol table
//! ([`crate::discovery::elf`]) and the programs are attached by offset through the agent's
//! own descriptor of the file (aya would re-parse the whole library for every symbol, and a
//! path could be redirected). A symbol the
//! library does not export (an older driver) is skipped and reported; two symbols at one
//! address (an alias) get one set of probes, or every call through them would count twice.
//! The external-memory probes ([`EXTMEM_PROBES`]) are optional: a library without those
//! symbols is probed as before (they are listed as missing).
use std::{
    collections::{BTreeMap, HashMap},
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    programs::{
        uprobe::{UProbeLinkId, UProbeScope},
        UProbe,
    },
    Ebpf,
};
use serde::{Deserialize, Serialize};

use crate::discovery::{Opened, Prober};

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

/// Every driver API vramguard accounts (DESIGN.md §5), and the VMM calls that decide how
/// long a `cuMemCreate` handle's memory lives (mapping, unmapping, retaining).
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
}

/// Loads every uprobe program of the object into the kernel (once, before any attach).
pub fn load_programs(ebpf: &mut Ebpf) -> Result<()> {
    let mut names: Vec<&str> = PROBES.iter().map(|probe| probe.entry).collect();
    names.push(RETURN_PROGRAM);
    names.extend(EXTMEM_PROBES.iter().flat_map(|(_, entry, ret)| std::iter::once(*entry).chain(*ret)));
    names.sort_unstable();
    names.dedup();
    for name in names {
        uprobe(ebpf, name)?
            .load()
            .with_context(|| format!("the kernel refused to load the eBPF program `{name}`"))?;
    }
    Ok(())
}

/// Attaches the programs to files [`crate::discovery`] opened and identified, noting each
/// probe's link (for [`detach_all`]).
pub struct Attacher<'a> {
    pub ebpf: &'a mut Ebpf,
    pub links: &'a mut Vec<(&'static str, UProbeLinkId)>,
}

/// Detaches every probe in `links`. Each detach waits for the kernel's unregistration of the
/// perf event (its tracepoint synchronisation: about 100 ms on 6.18, serialised by the
/// kernel's event mutex, so detaching in parallel gains nothing): a libcuda's 28 probes take
/// about 2.7 s, at the stop or at the process's exit alike.
pub fn detach_all(ebpf: &mut Ebpf, links: Vec<(&'static str, UProbeLinkId)>) {
    for (program, link) in links {
        if let Ok(program) = uprobe(ebpf, program) {
            let _ = program.detach(link);
        }
    }
}

/// Discovery's request to the kernel task (which owns the programs) to probe a file.
pub struct AttachRequest {
    /// A descriptor of discovery's own for the identified file.
    pub file: Opened,
    pub offsets: BTreeMap<&'static str, u64>,
    pub reply: std::sync::mpsc::SyncSender<Result<AttachReport>>,
}

/// How long discovery waits for the kernel task to attach to one file (it answers at its
/// next turn: within a drain, unless it is stuck, which its heartbeat says).
const ATTACH_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Discovery's [`Prober`] while the agent runs: each attach is asked of the kernel task, and
/// waited for on discovery's own (blocking) thread.
pub struct RemoteAttacher(pub tokio::sync::mpsc::Sender<AttachRequest>);

impl Prober for RemoteAttacher {
    fn attach(&mut self, file: &Opened, offsets: &BTreeMap<&'static str, u64>) -> Result<AttachReport> {
        let own = file.file.try_clone().context("cannot duplicate the file's descriptor")?;
        let file = Opened { file: own, id: file.id, stamp: file.stamp, shown: file.shown.clone() };
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.0
            .blocking_send(AttachRequest { file, offsets: offsets.clone(), reply })
            .map_err(|_| anyhow!("the kernel task, which attaches probes, is gone"))?;
        answer
            .recv_timeout(ATTACH_WAIT)
            .map_err(|_| anyhow!("the kernel task did not attach within {ATTACH_WAIT:?}"))?
    }
}

impl Prober for Attacher<'_> {
    /// Attaches every probe whose symbol the file exports, by file offset, through
    /// `/proc/self/fd/<n>` (the kernel resolves the agent's own descriptor: no path of the
    /// workload's is walked), then checks that what that path names is the file that was
    /// parsed (true by construction, the descriptor being the agent's; a guard against the
    /// agent's own mistakes, not a tenant's); on any failure the probes attached to it are
    /// detached again.
    fn attach(&mut self, file: &Opened, offsets: &BTreeMap<&'static str, u64>) -> Result<AttachReport> {
        let target = PathBuf::from(format!("/proc/self/fd/{}", file.file.as_raw_fd()));
        let mut links: Vec<(&'static str, UProbeLinkId)> = Vec::new();
        let result = attach_all(self.ebpf, &target, offsets, &mut links).and_then(|mut report| {
            let metadata = std::fs::metadata(&target).with_context(|| format!("cannot stat {} after attaching", target.display()))?;
            if (metadata.dev(), metadata.ino()) != file.id {
                bail!(
                    "the kernel attached to ({}, {}), not the file parsed ({}, {})",
                    metadata.dev(),
                    metadata.ino(),
                    file.id.0,
                    file.id.1
                );
            }
            report.path = file.shown.clone();
            Ok(report)
        });
        if result.is_err() {
            detach_all(self.ebpf, links);
        } else {
            self.links.extend(links);
        }
        result
    }
}

/// Attaches every probe whose symbol `offsets` has to `target`, recording each link.
fn attach_all(
    ebpf: &mut Ebpf,
    target: &Path,
    offsets: &BTreeMap<&'static str, u64>,
    links: &mut Vec<(&'static str, UProbeLinkId)>,
) -> Result<AttachReport> {
    let mut report = AttachReport::default();
    let mut seen: HashMap<u64, &str> = HashMap::new();
    for probe in &PROBES {
        let Some(&offset) = offsets.get(probe.symbol) else {
            report.missing.push(probe.symbol.to_string());
            continue;
        };
        if seen.insert(offset, probe.symbol).is_some() {
            report.aliases.push(probe.symbol.to_string());
            continue;
        }
        links.push((probe.entry, attach_one(ebpf, probe.entry, offset, target)?));
        if probe.returns {
            links.push((RETURN_PROGRAM, attach_one(ebpf, RETURN_PROGRAM, offset, target)?));
        }
        report.attached.push(probe.symbol.to_string());
    }
    if report.attached.is_empty() {
        bail!("it exports none of the CUDA allocation symbols vramguard probes");
    }
    for (symbol, entry, ret) in EXTMEM_PROBES {
        let Some(&offset) = offsets.get(symbol) else {
            report.missing.push(symbol.to_string());
            continue;
        };
        if seen.insert(offset, symbol).is_some() {
            report.aliases.push(symbol.to_string());
            continue;
        }
        links.push((entry, attach_one(ebpf, entry, offset, target)?));
        if let Some(ret) = ret {
            links.push((ret, attach_one(ebpf, ret, offset, target)?));
        }
        report.attached.push(symbol.to_string());
    }
    Ok(report)
}

fn attach_one(ebpf: &mut Ebpf, program: &str, offset: u64, target: &Path) -> Result<UProbeLinkId> {
    uprobe(ebpf, program)?
        .attach(offset, target, UProbeScope::AllProcesses)
        .with_context(|| format!("attaching `{program}` at offset {offset:#x}"))
}

fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    let program = ebpf
        .program_mut(name)
        .ok_or_else(|| anyhow!("the embedded eBPF object has no program `{name}`"))?;
    program
        .try_into()
        .map_err(|error| anyhow!("eBPF program `{name}` is not a uprobe: {error}"))
}
