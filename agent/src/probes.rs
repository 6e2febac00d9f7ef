//! Which eBPF program goes on which libcuda symbol, and attaching them to a file.
//!
//! Symbol offsets are resolved once per file from its ELF symbol tables and the programs are
//! attached by offset (aya would re-parse the whole library for every symbol). A symbol the
//! library does not export (an older driver) is skipped and reported; two symbols at one
//! address (an alias) get one set of probes, or every call through them would count twice.
use std::{
    collections::{BTreeMap, HashMap},
    fs::File,
    path::Path,
};

use anyhow::{anyhow, Context, Result};
use aya::{
    programs::{uprobe::UProbeScope, UProbe},
    Ebpf,
};
use object::{Object, ObjectSection, ObjectSymbol};
use serde::{Deserialize, Serialize};

use crate::libcuda::LibcudaFile;

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

/// Every driver API vramguard accounts (DESIGN.md §5).
pub const PROBES: [ProbeSpec; 12] = [
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
];

/// The return probe shared by every allocation API.
pub const RETURN_PROGRAM: &str = common::names::ALLOC_RETURN;

/// What attaching to one file achieved.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AttachReport {
    pub path: String,
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
    names.sort_unstable();
    names.dedup();
    for name in names {
        uprobe(ebpf, name)?
            .load()
            .with_context(|| format!("the kernel refused to load the eBPF program `{name}`"))?;
    }
    Ok(())
}

/// Attaches every probe whose symbol the file exports.
pub fn attach(ebpf: &mut Ebpf, file: &LibcudaFile) -> Result<AttachReport> {
    let offsets = symbol_offsets(&file.path)?;
    let mut report = AttachReport { path: file.path.display().to_string(), ..Default::default() };
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
        attach_one(ebpf, probe.entry, offset, file)?;
        if probe.returns {
            attach_one(ebpf, RETURN_PROGRAM, offset, file)?;
        }
        report.attached.push(probe.symbol.to_string());
    }
    if report.attached.is_empty() {
        return Err(anyhow!(
            "{} exports none of the CUDA allocation symbols vramguard probes: is it a libcuda?",
            file.path.display()
        ));
    }
    Ok(report)
}

fn attach_one(ebpf: &mut Ebpf, program: &str, offset: u64, file: &LibcudaFile) -> Result<()> {
    uprobe(ebpf, program)?
        .attach(offset, &file.path, UProbeScope::AllProcesses)
        .with_context(|| {
            format!("attaching `{program}` at offset {offset:#x} of {}", file.path.display())
        })?;
    Ok(())
}

fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    let program = ebpf
        .program_mut(name)
        .ok_or_else(|| anyhow!("the embedded eBPF object has no program `{name}`"))?;
    program
        .try_into()
        .map_err(|error| anyhow!("eBPF program `{name}` is not a uprobe: {error}"))
}

/// File offsets of the probed symbols that `path` defines.
fn symbol_offsets(path: &Path) -> Result<BTreeMap<&'static str, u64>> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the mapping is read-only and private; a library replaced under us while we
    // read it could give wrong offsets, never memory unsafety of our own data (the bytes are
    // only parsed, with bounds checks, by `object`).
    let data = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("cannot map {}", path.display()))?;
    let elf = object::File::parse(&*data)
        .with_context(|| format!("{} is not an ELF shared library", path.display()))?;
    let mut offsets = BTreeMap::new();
    for symbol in elf.dynamic_symbols().chain(elf.symbols()) {
        let Ok(name) = symbol.name() else { continue };
        let Some(probe) = PROBES.iter().find(|probe| probe.symbol == name) else {
            continue;
        };
        if !symbol.is_definition() || offsets.contains_key(probe.symbol) {
            continue;
        }
        let Some(section) = symbol.section_index().and_then(|i| elf.section_by_index(i).ok())
        else {
            continue;
        };
        let Some((section_offset, _)) = section.file_range() else { continue };
        let Some(relative) = symbol.address().checked_sub(section.address()) else {
            continue;
        };
        offsets.insert(probe.symbol, section_offset + relative);
    }
    Ok(offsets)
}
