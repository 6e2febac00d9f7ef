//! Which eBPF program goes on which libcuda symbol, and attaching them to a file.
//!
//! Symbol offsets are resolved once per file from its dynamic symbol table
//! ([`crate::discovery::elf`]) and the programs are attached by offset through the agent's
//! own descriptor of the file (aya would re-parse the whole library for every symbol, and a
//! path could be redirected). A symbol the
//! library does not export (an older driver) is skipped and reported; two symbols at one
//! address (an alias) get one set of probes, or every call through them would count twice.
//! The external-memory probes ([`EXTMEM_PROBES`]) are optional: a library without those
//! symbols is probed as before (they are listed as missing). A program goes on all its offsets
//! in a file as one uprobe_multi link ([`super::multi`]), or, on a kernel without those, as
//! a perf event per offset.
use std::{
    collections::{BTreeMap, HashMap},
    ffi::CString,
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
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
use tracing::warn;

use super::multi::MultiPrograms;
use crate::libcuda::{Opened, Prober};

pub use crate::libcuda::{AttachReport, ProbeSpec, EXTMEM_PROBES, PROBES, RETURN_PROGRAM};

/// How the probes are linked in the kernel (`--uprobe-links`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LinkKind {
    /// uprobe_multi links where the kernel has them (Linux 6.6 and later), else perf events.
    Auto,
    /// A perf event per probe (slower to remove: each waits for a grace period of its own,
    /// under a mutex the whole node shares).
    Perf,
}

/// Loads every uprobe program of the object for perf events (where there are no uprobe_multi
/// links: the verifier's word at the start, not at the first attach).
pub fn load_programs(ebpf: &mut Ebpf) -> Result<()> {
    for name in program_names() {
        uprobe(ebpf, name)?
            .load()
            .with_context(|| format!("the kernel refused to load the eBPF program `{name}`"))?;
    }
    Ok(())
}

/// At most this many threads close a stop's uprobe_multi links (each closes its share).
const UNLINKING_THREADS: usize = 32;

/// The names of every uprobe program of the object.
pub fn program_names() -> Vec<&'static str> {
    let mut names: Vec<&str> = PROBES.iter().map(|probe| probe.entry).collect();
    names.push(RETURN_PROGRAM);
    names.extend(EXTMEM_PROBES.iter().flat_map(|(_, entry, ret)| std::iter::once(*entry).chain(*ret)));
    names.sort_unstable();
    names.dedup();
    names
}

/// A probe's link in the kernel: a perf event (one program at one offset, through aya), or a
/// uprobe_multi link (one program at all its offsets in a file).
pub enum Link {
    Perf(&'static str, UProbeLinkId),
    Multi(OwnedFd),
}

/// Attaches the programs to files [`crate::discovery`] opened and identified, noting each
/// link (for [`detach_all`]): as uprobe_multi links where `multi` was loaded and the kernel
/// has them ([`MultiPrograms::refused`]), else as perf events (the programs for which aya
/// loads at their first attach, where `multi` was loaded).
pub struct Attacher<'a> {
    pub ebpf: &'a mut Ebpf,
    pub multi: Option<&'a mut MultiPrograms>,
    pub links: &'a mut Vec<Link>,
}

/// Detaches every probe in `links`. The uprobe_multi links are closed at once, on up to
/// [`UNLINKING_THREADS`] threads, so that the kernel's grace periods for them overlap (about
/// 80 ms for a libcuda's, against 0.4 s one after another). A perf event's removal waits for a
/// grace period of its own under the kernel's event mutex (about 110 ms on 6.18, so detaching
/// them in parallel gains nothing): a libcuda's 28 take about 3 s.
pub fn detach_all(ebpf: &mut Ebpf, links: Vec<Link>) {
    let (multi, perf): (Vec<Link>, Vec<Link>) = links.into_iter().partition(|link| matches!(link, Link::Multi(_)));
    let mut shares: Vec<Vec<Link>> = (0..UNLINKING_THREADS.min(multi.len())).map(|_| Vec::new()).collect();
    for (i, link) in multi.into_iter().enumerate() {
        let share = i % shares.len();
        shares[share].push(link);
    }
    std::thread::scope(|scope| {
        for share in shares {
            let closing = std::thread::Builder::new().name("vramguard-unlink".into());
            // Without a thread, the share is closed here.
            let _ = closing.spawn_scoped(scope, move || drop(share));
        }
        for link in perf {
            if let Link::Perf(program, id) = link {
                if let Ok(program) = uprobe(ebpf, program) {
                    let _ = program.detach(id);
                }
            }
        }
    });
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
        let (mut report, points) = plan(offsets)?;
        let mut links: Vec<Link> = Vec::new();
        let linked = match self.multi.as_deref_mut().filter(|multi| multi.usable()) {
            None => attach_perf(self.ebpf, &target, &points, &mut links).map(|()| "perf_event"),
            Some(multi) => match attach_multi(multi, &target, &points, &mut links) {
                Ok(()) => {
                    multi.made();
                    Ok("uprobe_multi")
                }
                // The kernel has them: the file is refused (as for any failed attach).
                Err(error) if multi.known_to_work() => Err(error),
                Err(error) => {
                    detach_all(self.ebpf, std::mem::take(&mut links));
                    match attach_perf(self.ebpf, &target, &points, &mut links) {
                        Ok(()) => {
                            multi.refused();
                            warn!(file = %file.shown, error = %format!("{error:#}"), "the kernel refuses uprobe_multi links: the probes are perf events from now on (each removed in a grace period of its own)");
                            Ok("perf_event")
                        }
                        Err(perf) => Err(error.context(format!("and as perf events: {perf:#}"))),
                    }
                }
            },
        };
        let result = linked.and_then(|kind| {
            report.links = kind.to_string();
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

/// Which program goes on which offset of a file that exports `offsets` (each probe's entry
/// program, then the return program where it has one), and the report of it.
fn plan(offsets: &BTreeMap<&'static str, u64>) -> Result<(AttachReport, Vec<(&'static str, u64)>)> {
    let mut report = AttachReport::default();
    let mut points = Vec::new();
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
        points.push((probe.entry, offset));
        if probe.returns {
            points.push((RETURN_PROGRAM, offset));
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
        points.push((entry, offset));
        if let Some(ret) = ret {
            points.push((ret, offset));
        }
        report.attached.push(symbol.to_string());
    }
    Ok((report, points))
}

/// Puts each program on its `points` in `target` as one uprobe_multi link.
fn attach_multi(multi: &MultiPrograms, target: &Path, points: &[(&'static str, u64)], links: &mut Vec<Link>) -> Result<()> {
    let path = CString::new(target.as_os_str().as_encoded_bytes()).context("a path with a NUL byte")?;
    let mut by_program: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for &(program, offset) in points {
        by_program.entry(program).or_default().push(offset);
    }
    for (made, (program, offsets)) in by_program.into_iter().enumerate() {
        if made > 0 && crate::fault::refused("uprobe-multi") {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL)).with_context(|| format!("linking `{program}` (--fault refuse:uprobe-multi)"));
        }
        let link = multi
            .attach(program, &path, &offsets)
            .with_context(|| format!("linking `{program}` at {} offsets", offsets.len()))?;
        links.push(Link::Multi(link));
    }
    Ok(())
}

/// Puts each program on each of its `points` in `target` as a perf event.
fn attach_perf(ebpf: &mut Ebpf, target: &Path, points: &[(&'static str, u64)], links: &mut Vec<Link>) -> Result<()> {
    for &(program, offset) in points {
        let probe = uprobe(ebpf, program)?;
        if probe.fd().is_err() {
            probe.load().with_context(|| format!("the kernel refused to load the eBPF program `{program}`"))?;
        }
        let id = probe
            .attach(offset, target, UProbeScope::AllProcesses)
            .with_context(|| format!("attaching `{program}` at offset {offset:#x}"))?;
        links.push(Link::Perf(program, id));
    }
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
